//! Argument checks that need no GPU.

/// `got` elements where `want` are needed, or why not.
pub(crate) fn len_ok(what: &str, got: usize, want: usize) -> std::result::Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} has {got} elements, expected {want}"))
    }
}

/// A rank (root or peer) in `0..size`, as NCCL's `int`.
pub(crate) fn rank_ok(what: &str, r: usize, size: usize) -> std::result::Result<i32, String> {
    if r < size && r <= i32::MAX as usize {
        Ok(r as i32)
    } else {
        Err(format!("{what} {r} is out of range for {size} ranks"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_checks_without_a_gpu() {
        assert_eq!(len_ok("recv", 20, 20), Ok(()));
        assert_eq!(
            len_ok("recv", 21, 20).unwrap_err(),
            "recv has 21 elements, expected 20"
        );
        assert_eq!(rank_ok("root", 1, 2), Ok(1));
        assert_eq!(
            rank_ok("peer", 2, 2).unwrap_err(),
            "peer 2 is out of range for 2 ranks"
        );
    }
}
