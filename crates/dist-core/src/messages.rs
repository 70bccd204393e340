//! [`TypedMessages`]: point-to-point messages of any [`Element`] type, and receiving a message
//! whose length the receiver does not know, on every [`Backend`].

use std::time::{Duration, Instant};

use crate::backend::{Backend, Tag};
use crate::error::{DistError, Result};
use crate::types::Element;

/// Typed point-to-point messages, for every [`Backend`] (a transport, a group, a sub-group).
/// A message is its elements' bytes in memory order; the receiver must use the sender's
/// element type (nothing on the wire says which it was).
pub trait TypedMessages: Backend {
    /// Sends the elements of `data` to `dst` on `tag` ([`Backend::send_tagged`]).
    fn send_slice<T: Element>(&self, data: &[T], dst: usize, tag: Tag) -> Result<()> {
        self.send_tagged(bytemuck::cast_slice(data), dst, tag)
    }

    /// Receives the next message from `src` on `tag` into `buf`, which it must fill exactly
    /// ([`Backend::recv_tagged`]: a message of another length is a
    /// [`DistError::SizeMismatch`] in bytes, and stays queued).
    fn recv_slice<T: Element>(&self, buf: &mut [T], src: usize, tag: Tag) -> Result<()> {
        self.recv_tagged(bytemuck::cast_slice_mut(buf), src, tag)
    }

    /// Receives the next message from `src` on `tag`, whatever its length, within the default
    /// timeout, as elements of `T`. A message longer than `max_len` elements, or whose length
    /// is not a whole number of `T`s, is a [`DistError::SizeMismatch`] (nothing is allocated
    /// for it, and it stays queued).
    ///
    /// It first receives into an empty buffer: a message of another length is then reported
    /// with its length and left queued, as every backend does ([`Backend::recv_tagged_timeout`]);
    /// an empty message is received there and then. Should another thread take the message
    /// between the two receives (two threads receiving on one peer and tag), it tries the next
    /// one, until the deadline.
    fn recv_vec<T: Element>(&self, src: usize, tag: Tag, max_len: usize) -> Result<Vec<T>> {
        let timeout = self.default_timeout();
        let op = || {
            format!(
                "recv_vec from {src} (tag {tag}, at most {max_len} {})",
                T::DTYPE
            )
        };
        let deadline = crate::transport::deadline_after(Instant::now(), timeout, self.rank(), op)?;
        let size = std::mem::size_of::<T>();
        let max_bytes = max_len.saturating_mul(size);
        let left = || deadline.saturating_duration_since(Instant::now());
        loop {
            let len = match self.recv_tagged_timeout(&mut [], src, tag, left()) {
                Ok(()) => return Ok(Vec::new()),
                Err(DistError::SizeMismatch { got, .. }) => got,
                Err(e) => return Err(e.with_op(&op())),
            };
            if len > max_bytes || len % size != 0 {
                return Err(DistError::SizeMismatch {
                    rank: self.rank(),
                    peer: src,
                    op: format!("{} ({size}-byte elements, at most {max_bytes} bytes)", op()),
                    expected: (len - len % size).min(max_bytes),
                    got: len,
                });
            }
            let mut v = vec![T::zeroed(); len / size];
            match self.recv_tagged_timeout(bytemuck::cast_slice_mut(&mut v), src, tag, left()) {
                Ok(()) => return Ok(v),
                // Taken by another thread: the next message is another length.
                Err(DistError::SizeMismatch { .. }) if left() > Duration::ZERO => continue,
                Err(e) => return Err(e.with_op(&op())),
            }
        }
    }
}

impl<B: Backend + ?Sized> TypedMessages for B {}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::testing::run_group;
    use crate::{Subgroups, Tuning};

    #[test]
    fn typed_slices_and_vectors_of_unknown_length_arrive_whole() {
        let out = run_group(
            3,
            |_| Tuning::default(),
            Duration::from_secs(10),
            |g| {
                let (me, n) = (g.rank(), g.world_size());
                let (right, left) = ((me + 1) % n, (me + n - 1) % n);
                let mine: Vec<f64> = (0..me * 100 + 7).map(|i| (me * 1000 + i) as f64).collect();
                g.send_slice(&mine, right, Tag::user(3))?;
                g.send_slice::<i8>(&[], right, Tag::user(4))?;
                g.send_slice(&[me as u32; 4], right, Tag::user(5))?;
                let got: Vec<f64> = g.recv_vec(left, Tag::user(3), 1 << 20)?;
                let empty: Vec<i8> = g.recv_vec(left, Tag::user(4), 0)?;
                let mut fixed = [0u32; 4];
                g.recv_slice(&mut fixed, left, Tag::user(5))?;
                let want: Vec<f64> = (0..left * 100 + 7)
                    .map(|i| (left * 1000 + i) as f64)
                    .collect();
                assert_eq!(got, want);
                assert!(empty.is_empty());
                assert_eq!(fixed, [left as u32; 4]);
                Ok(())
            },
        );
        for r in out {
            r.unwrap();
        }
    }

    #[test]
    fn recv_vec_refuses_long_and_ragged_messages_and_leaves_them_queued() {
        let out = run_group(
            2,
            |_| Tuning::default(),
            Duration::from_secs(10),
            |g| {
                if g.rank() == 0 {
                    g.send_slice(&[1u8; 10], 1, Tag::user(1))?;
                    g.send_slice(&[7u32; 3], 1, Tag::user(2))?;
                    return Ok(());
                }
                // 10 bytes are not a whole number of u32s; then too many for a cap of 2 u32s.
                match g.recv_vec::<u32>(0, Tag::user(1), 100) {
                    Err(DistError::SizeMismatch { peer, got, op, .. }) => {
                        assert_eq!((peer, got), (0, 10));
                        assert!(op.contains("4-byte elements"), "{op}");
                    }
                    other => panic!("{other:?}"),
                }
                match g.recv_vec::<u32>(0, Tag::user(2), 2) {
                    Err(DistError::SizeMismatch { expected, got, .. }) => {
                        assert_eq!((expected, got), (8, 12))
                    }
                    other => panic!("{other:?}"),
                }
                // Both stayed queued: taken whole afterwards.
                assert_eq!(g.recv_vec::<u8>(0, Tag::user(1), 10)?, [1u8; 10]);
                assert_eq!(g.recv_vec::<u32>(0, Tag::user(2), 3)?, [7u32; 3]);
                Ok(())
            },
        );
        for r in out {
            r.unwrap();
        }
    }

    #[test]
    fn recv_vec_times_out_and_works_in_a_sub_group() {
        let out = run_group(
            4,
            |_| Tuning::default(),
            Duration::from_millis(300),
            |g| {
                let me = g.rank();
                // Groups {1, 3} and {0, 2}, each in reverse order.
                let sub = g.split(Some(me as u32 % 2), -(me as i64))?.unwrap();
                let peer = 1 - sub.rank();
                sub.send_slice(&[me as i32; 5], peer, Tag::user(9))?;
                let got: Vec<i32> = sub.recv_vec(peer, Tag::user(9), 5)?;
                assert_eq!(got, [(me ^ 2) as i32; 5]);
                match sub.recv_vec::<i32>(peer, Tag::user(9), 5) {
                    Err(DistError::Timeout { peer: p, op, .. }) => {
                        assert_eq!(p, peer);
                        assert!(op.contains("recv_vec"), "{op}");
                    }
                    other => panic!("{other:?}"),
                }
                Ok(())
            },
        );
        for r in out {
            r.unwrap();
        }
    }
}
