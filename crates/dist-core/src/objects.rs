//! [`ObjectCollectives`]: broadcast and all_gather of byte strings whose lengths differ between
//! ranks (serialised configs, metrics), for every group.

use crate::collectives::Collectives;
use crate::error::{DistError, Result};

/// The most bytes [`ObjectCollectives`] move in one call: one object, and (for
/// [`ObjectCollectives::all_gather_bytes`]) every rank's block together. A length past it,
/// from any rank, is an error on every rank before anything of that size is allocated.
pub const MAX_OBJECT_BYTES: usize = 256 << 20;

/// Collectives on byte strings of lengths that differ between ranks, for every
/// [`Collectives`] implementor (a transport, a group, a sub-group). Each call is two
/// collectives (the lengths, then the bytes), with the group's timeout and mismatch checks.
pub trait ObjectCollectives: Collectives {
    /// `data` on `root` (any length up to [`MAX_OBJECT_BYTES`]) to every rank; every rank gets
    /// a copy (`data` is read on `root` only). Too long an object is an
    /// [`DistError::InvalidArgument`] on every rank, the group still usable.
    fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        let me = self.rank();
        let mut len = [if me == root { data.len() as u64 } else { 0 }];
        self.broadcast(&mut len, root)
            .map_err(|e| e.with_op("broadcast_bytes (length)"))?;
        let len = usize::try_from(len[0])
            .ok()
            .filter(|&l| l <= MAX_OBJECT_BYTES)
            .ok_or_else(|| DistError::InvalidArgument {
                rank: me,
                op: format!("broadcast_bytes from {root}"),
                reason: format!(
                    "rank {root}'s object is {} bytes, more than {MAX_OBJECT_BYTES}",
                    len[0]
                ),
            })?;
        let mut buf = if me == root {
            data.to_vec()
        } else {
            vec![0; len]
        };
        self.broadcast(&mut buf, root)
            .map_err(|e| e.with_op("broadcast_bytes"))?;
        Ok(buf)
    }

    /// Every rank's `data` (lengths may differ) to every rank, in rank order. The bytes travel
    /// as one [`Collectives::all_gather_v`] of the objects as they are (no padding), so all of
    /// them together may be at most [`MAX_OBJECT_BYTES`]; past it every rank gets an
    /// [`DistError::InvalidArgument`] naming the total and the longest, the group still usable.
    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (me, n) = (self.rank(), self.world_size());
        let mut lens = vec![0u64; n];
        self.all_gather(&[data.len() as u64], &mut lens)
            .map_err(|e| e.with_op("all_gather_bytes (lengths)"))?;
        let total = lens
            .iter()
            .try_fold(0u64, |t, &l| t.checked_add(l))
            .filter(|&t| t <= MAX_OBJECT_BYTES as u64);
        let Some(total) = total else {
            let (longest, &max) = lens
                .iter()
                .enumerate()
                .max_by_key(|&(r, l)| (*l, std::cmp::Reverse(r)))
                .unwrap_or((0, &0));
            let sum: u128 = lens.iter().map(|&l| u128::from(l)).sum();
            return Err(DistError::InvalidArgument {
                rank: me,
                op: "all_gather_bytes".into(),
                reason: format!(
                    "the {n} objects are {sum} bytes in all, more than {MAX_OBJECT_BYTES} \
                     (rank {longest}'s object is the longest, {max} bytes)"
                ),
            });
        };
        // Every length is at most the total, which fits in memory's `usize` here.
        let counts: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let mut all = vec![0u8; total as usize];
        self.all_gather_v(data, &mut all, &counts)
            .map_err(|e| e.with_op("all_gather_bytes"))?;
        let mut rest = all.as_slice();
        Ok(counts
            .iter()
            .map(|&c| {
                let (block, tail) = rest.split_at(c);
                rest = tail;
                block.to_vec()
            })
            .collect())
    }
}

impl<C: Collectives + ?Sized> ObjectCollectives for C {}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::testing::run_group;
    use crate::{Backend, ReduceOp, Tuning};

    fn object(r: usize) -> Vec<u8> {
        (0..r * 37 + (r % 2) * 1000)
            .map(|i| (i * 7 + r) as u8)
            .collect()
    }

    #[test]
    fn objects_of_every_length_reach_every_rank() {
        let out = run_group(
            5,
            |_| Tuning::default(),
            Duration::from_secs(10),
            |g| {
                let me = g.rank();
                for root in 0..5 {
                    let got = g.broadcast_bytes(&object(me), root)?;
                    assert_eq!(got, object(root), "from {root}");
                }
                let all = g.all_gather_bytes(&object(me))?;
                assert_eq!(all, (0..5).map(object).collect::<Vec<_>>());
                // Rank 0's object is empty: an all-empty gather.
                let none = g.all_gather_bytes(&[])?;
                assert!(none.iter().all(Vec::is_empty) && none.len() == 5);
                Ok(())
            },
        );
        for r in out {
            r.unwrap();
        }
    }

    #[test]
    fn too_long_objects_are_refused_on_every_rank_and_the_group_goes_on() {
        let out = run_group(
            3,
            |_| Tuning::default(),
            Duration::from_secs(20),
            |g| {
                let me = g.rank();
                // Zeroed memory, made only on the rank that sends it (its pages untouched).
                // One long object among empty ones travels unpadded: 3 blocks of it would be
                // more than the limit, the objects themselves are not.
                let half = vec![0u8; if me == 2 { MAX_OBJECT_BYTES / 2 } else { 0 }];
                let all = g.all_gather_bytes(&half)?;
                let lens: Vec<usize> = all.iter().map(Vec::len).collect();
                assert_eq!(lens, [0, 0, MAX_OBJECT_BYTES / 2]);
                drop(all);
                let big = vec![
                    0u8;
                    if me == 0 {
                        0
                    } else {
                        MAX_OBJECT_BYTES / 2 + me
                    }
                ];
                let e = g.all_gather_bytes(&big).unwrap_err();
                assert!(
                    matches!(&e, DistError::InvalidArgument { reason, .. }
                        if reason.contains("rank 2's object is the longest")
                            && reason.contains(&format!("{} bytes in all", MAX_OBJECT_BYTES + 3))),
                    "{e}"
                );
                let huge = vec![0u8; if me == 1 { MAX_OBJECT_BYTES + 1 } else { 0 }];
                let e = g.broadcast_bytes(&huge, 1).unwrap_err();
                assert!(
                    matches!(&e, DistError::InvalidArgument { reason, .. } if reason.contains("rank 1's object")),
                    "{e}"
                );
                let mut x = [1u32];
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                assert_eq!(x, [3]);
                Ok(())
            },
        );
        for r in out {
            r.unwrap();
        }
    }
}
