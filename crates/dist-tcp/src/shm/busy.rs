//! Which bytes of an arena segment's slots this process's threads are copying at the moment
//! ([`Busy`]), so that no two of them copy overlapping bytes at once where one writes: that
//! would be a data race, and [`dist_core::HostArena`]'s `write` and `read` are safe methods any
//! thread may call. The collectives never do (each step's ranges are disjoint); a caller that
//! does gets its later copy refused instead.
//!
//! A segment's record is shared by every mapping of it in this process: the owner's, and a
//! peer's where the peer rank lives in the same process (ranks as threads of one process map
//! each other's segments at other addresses), found by the segment's file ([`for_file`]).

use std::os::fd::AsFd;
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

/// A file's identity: its device and inode (unique among live files).
type FileId = (u64, u64);

/// The records of the segments made in this process, by file; an entry whose record is gone
/// (no mapping of its segment alive) is dropped when the next segment is made.
type MadeHere = Mutex<Vec<(FileId, Weak<Busy>)>>;

fn made_here() -> &'static MadeHere {
    static MADE: OnceLock<MadeHere> = OnceLock::new();
    MADE.get_or_init(|| Mutex::new(Vec::new()))
}

fn file_id(fd: &impl AsFd) -> std::io::Result<FileId> {
    let st = rustix::fs::fstat(fd)?;
    // Already u64 on some targets, not on all.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    Ok((st.st_dev as u64, st.st_ino as u64))
}

/// A new record for a segment this process just made in file `fd`.
pub(crate) fn for_new_file(fd: &impl AsFd) -> std::io::Result<Arc<Busy>> {
    let id = file_id(fd)?;
    let busy = Arc::new(Busy::default());
    let mut made = made_here().lock().unwrap_or_else(|p| p.into_inner());
    // A file of the same identity that is gone (no mapping of it alive) leaves its entry.
    made.retain(|(other, b)| *other != id && b.strong_count() > 0);
    made.push((id, Arc::downgrade(&busy)));
    Ok(busy)
}

/// The record of the segment in file `fd` if this process made it (a peer rank of this
/// process), else `None` (a segment of another process, which this one only reads).
pub(crate) fn for_file(fd: &impl AsFd) -> std::io::Result<Option<Arc<Busy>>> {
    let id = file_id(fd)?;
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
