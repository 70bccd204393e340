//! Platform socket flags, from `libc` for the target being built (never a hard-coded number:
//! Linux's `MSG_DONTWAIT` is `MSG_WAITALL` on macOS and the BSDs).

/// Don't block: a `recv`/`send` with this flag fails with `WouldBlock` instead of waiting.
pub(crate) const MSG_DONTWAIT: i32 = libc::MSG_DONTWAIT;

/// A write to a closed peer is an `EPIPE` error, never a `SIGPIPE` that kills the process.
/// Apple's systems have no such flag; there [`prepare`] sets `SO_NOSIGPIPE` on the socket.
#[cfg(not(target_vendor = "apple"))]
pub(crate) const MSG_NOSIGNAL: i32 = libc::MSG_NOSIGNAL;
#[cfg(target_vendor = "apple")]
pub(crate) const MSG_NOSIGNAL: i32 = 0;

/// Sets what the target needs on a connected socket before frames are written to it.
pub(crate) fn prepare(sock: &socket2::Socket) -> std::io::Result<()> {
    #[cfg(target_vendor = "apple")]
    sock.set_nosigpipe(true)?;
    let _ = sock;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags are the target's own: on Linux 0x40 and 0x4000; on the BSDs `MSG_DONTWAIT`
    /// is 0x80 (0x40 there is `MSG_WAITALL`, which the old hard-coded value meant).
    #[test]
    fn flags_are_the_targets() {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        assert_eq!((MSG_DONTWAIT, MSG_NOSIGNAL), (0x40, 0x4000));
        #[cfg(any(target_os = "freebsd", target_vendor = "apple"))]
        assert_eq!(MSG_DONTWAIT, 0x80);
        assert_ne!(MSG_DONTWAIT, libc::MSG_WAITALL);
        assert_ne!(MSG_DONTWAIT, 0);
    }
}
