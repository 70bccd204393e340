//! Which bytes of an arena segment's slots this process's threads are copying at the moment
//! ([`Busy`]), so that no two of them copy overlapping bytes at once where one writes: that
//! would be a data race, and [`dist_core::transport::HostArena`]'s `write` and `read` are safe methods any
//! thread may call. The collectives never do (each step's ranges are disjoint); a caller that
//! does gets its later copy refused instead.
//!
//! A segment's record is shared by every mapping of it in this process: the owner's, and a
//! peer's where the peer rank lives in the same process (ranks as threads of one process map
//! each other's segments at other addresses), found by the segment's file and a token in its header ([`for_file`]).

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The ranges of a segment's slots (byte offsets from the first slot) being copied now, each
/// marked write or read.
#[derive(Debug, Default)]
pub(crate) struct Busy(Mutex<Vec<(usize, usize, bool)>>);

/// An access entered in [`Busy`]; leaving (on drop, a panic included) takes it out.
pub(crate) struct Entered<'a> {
    busy: &'a Busy,
    range: (usize, usize, bool),
}

impl Busy {
    /// Enters the range `start..end` (a write if `write`), or `None` if it overlaps one in
    /// progress of which either is a write. An empty range touches nothing: always entered,
    /// never recorded.
    pub(crate) fn enter(&self, start: usize, end: usize, write: bool) -> Option<Entered<'_>> {
        let range = (start, end, write);
        if start >= end {
            return Some(Entered { busy: self, range });
        }
        let mut now = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let clash = now
            .iter()
            .any(|&(s, e, w)| s < end && start < e && (w || write));
        if clash {
            return None;
        }
        now.push(range);
        Some(Entered { busy: self, range })
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if self.range.0 >= self.range.1 {
            return;
        }
        let mut now = self.busy.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = now.iter().position(|&r| r == self.range) {
            now.swap_remove(i);
        }
    }
}

/// A segment's identity in this process: its file's device and inode, and the token the
/// owner wrote in its header ([`for_new_file`]). The inode alone would do on kernels from 5.9
/// (never reused for a memfd); before, a 32-bit count shared with other kernel files could in
/// principle give two live files one number, and the token keeps them apart.
type SegmentId = (u64, u64, u64);

/// The records of the segments made in this process, by identity; an entry whose record is
/// gone (no mapping of its segment alive) is dropped when the next segment is made.
type MadeHere = Mutex<Vec<(SegmentId, Weak<Busy>)>>;

fn made_here() -> &'static MadeHere {
    static MADE: OnceLock<MadeHere> = OnceLock::new();
    MADE.get_or_init(|| Mutex::new(Vec::new()))
}

fn segment_id(fd: &impl AsFd, token: u64) -> std::io::Result<SegmentId> {
    let st = rustix::fs::fstat(fd)?;
    // Already u64 on some targets, not on all.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    Ok((st.st_dev as u64, st.st_ino as u64, token))
}

/// A new record for a segment this process just made in file `fd`, with the token (never 0,
/// never given twice in this process) its owner writes in the segment's header.
pub(crate) fn for_new_file(fd: &impl AsFd) -> std::io::Result<(u64, Arc<Busy>)> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    let id = segment_id(fd, token)?;
    let busy = Arc::new(Busy::default());
    let mut made = made_here().lock().unwrap_or_else(|p| p.into_inner());
    made.retain(|(_, b)| b.strong_count() > 0);
    made.push((id, Arc::downgrade(&busy)));
    Ok((token, busy))
}

/// The record of the segment in file `fd` whose header holds `token`, if this process made
/// it (a peer rank of this process) and a mapping of it is alive; else `None` (a segment of
/// another process, which this one only reads).
pub(crate) fn for_file(fd: &impl AsFd, token: u64) -> std::io::Result<Option<Arc<Busy>>> {
    let id = segment_id(fd, token)?;
    let made = made_here().lock().unwrap_or_else(|p| p.into_inner());
    Ok(made
        .iter()
        .find(|(other, _)| *other == id)
        .and_then(|(_, b)| b.upgrade()))
}

#[cfg(test)]
mod tests {
    use super::Busy;

    /// Overlaps clash where one side writes; reads share; empty ranges never clash; a range
    /// is free again once left.
    #[test]
    fn ranges_clash_only_where_one_writes() {
        let b = Busy::default();
        let w = b.enter(100, 200, true).unwrap();
        assert!(b.enter(199, 300, false).is_none());
        assert!(b.enter(0, 101, true).is_none());
        assert!(b.enter(200, 300, true).is_some());
        assert!(b.enter(150, 150, true).is_some());
        drop(w);
        let r = b.enter(100, 200, false).unwrap();
        assert!(b.enter(120, 130, false).is_some());
        assert!(b.enter(120, 130, true).is_none());
        drop(r);
        assert!(b.enter(120, 130, true).is_some());
    }
}
