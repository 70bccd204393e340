//! A rank's share of an all_reduce on the host arena split over several threads: this one and
//! the group's helper pool ([`HostArena::threads`](crate::transport::HostArena::threads) in all), each
//! taking a range of the bytes. Every element is still reduced by one rank, in rank order,
//! whatever the count, so the result is the same bits.

use std::sync::Mutex;

use crate::error::{DistError, Result};
use crate::link::Link;
use crate::types::Element;

use super::host::Host;
use super::scratch::segment;

impl<L: Link> Host<'_, '_, L> {
    /// Runs `f(at, part)` over `data` cut into parts of at least `min` bytes (`usize::MAX`:
    /// one part), one a thread ([`HostArena::threads`](crate::transport::HostArena::threads) at most:
    /// this one and the group's helpers), `at` the element at which the part starts. Every
    /// part runs whatever another's result, and this returns only once every part has ended
    /// (so no helper touches `data` after it); the error returned is the first part's that
    /// failed.
    pub(super) fn in_parts<T: Element>(
        &self,
        data: &mut [T],
        min: usize,
        f: &(dyn Fn(usize, &mut [T]) -> Result<()> + Sync),
    ) -> Result<()> {
        match self.pool_for(std::mem::size_of_val(data), min) {
            None => f(0, data),
            Some((pool, parts)) => {
                let len = data.len();
                run_parts(pool, cut(vec![(0, data)], len, parts), f)
            }
        }
    }

    /// [`Host::in_parts`] over two ranges (those around this rank's share of a piece), each
    /// `(at, data)`: the parts cut their elements, in order, into equal shares, and `f` runs
    /// on each range of a part (a part may hold the end of one range and the start of the
    /// next).
    pub(super) fn in_parts_of<T: Element>(
        &self,
        ranges: [(usize, &mut [T]); 2],
        min: usize,
        f: &(dyn Fn(usize, &mut [T]) -> Result<()> + Sync),
    ) -> Result<()> {
        let len: usize = ranges.iter().map(|(_, d)| d.len()).sum();
        match self.pool_for(len * std::mem::size_of::<T>(), min) {
            Some((pool, parts)) => run_parts(pool, cut(ranges, len, parts), f),
            None => {
                let mut first = None;
                for (at, d) in ranges {
                    if let Err(e) = f(at, d) {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(()), Err)
            }
        }
    }

    /// The helper pool and the number of parts for `bytes` cut into parts of at least `min`
    /// bytes, one a thread: `None` for one part (or no pool).
    fn pool_for(&self, bytes: usize, min: usize) -> Option<(&rayon::ThreadPool, usize)> {
        let threads = self.a.threads();
        let parts = threads.min(bytes / min.max(1));
        if parts < 2 {
            return None;
        }
        self.c.g.helpers(threads).map(|pool| (pool, parts))
    }
}

/// Runs `f` over every range of every part, part 0 on this thread and each other on `pool`,
/// and returns once all have ended: the first failed part's error, if any.
fn run_parts<T: Element>(
    pool: &rayon::ThreadPool,
    mut cut: Vec<Vec<(usize, &mut [T])>>,
    f: &(dyn Fn(usize, &mut [T]) -> Result<()> + Sync),
) -> Result<()> {
    let failed: Vec<Mutex<Option<DistError>>> = (0..cut.len()).map(|_| Mutex::new(None)).collect();
    let run = |i: usize, part: Vec<(usize, &mut [T])>| {
        for (at, d) in part {
            if let Err(e) = f(at, d) {
                failed[i]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
        }
    };
    pool.in_place_scope(|s| {
        let own = std::mem::take(&mut cut[0]);
        for (i, part) in cut.into_iter().enumerate().skip(1) {
            s.spawn(move |_| run(i, part));
        }
        run(0, own);
    });
    match failed
        .into_iter()
        .find_map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `ranges` (`len` elements in all) cut into `parts` parts of [`segment`]'s lengths, each a
/// list of `(at, data)` pieces of the ranges in order.
fn cut<'d, T>(
    ranges: impl IntoIterator<Item = (usize, &'d mut [T])>,
    len: usize,
    parts: usize,
) -> Vec<Vec<(usize, &'d mut [T])>> {
    let mut out: Vec<Vec<(usize, &mut [T])>> = (0..parts).map(|_| Vec::new()).collect();
    let mut i = 0;
    let mut room = segment(len, parts, 0).len();
    for (mut at, mut d) in ranges {
        while !d.is_empty() {
            while room == 0 && i + 1 < parts {
                i += 1;
                room = segment(len, parts, i).len();
            }
            let take = room.min(d.len()).max(usize::from(i + 1 == parts) * d.len());
            let (head, tail) = std::mem::take(&mut d).split_at_mut(take);
            out[i].push((at, head));
            at += take;
            room = room.saturating_sub(take);
            d = tail;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// The parts take the ranges' elements in order, in the lengths `segment` gives, a part
    /// spanning the end of one range and the start of the next.
    #[test]
    fn cut_spans_ranges_in_order() {
        let mut a = [0u8; 5];
        let mut b = [0u8; 7];
        let parts = super::cut(vec![(0, &mut a[..]), (10, &mut b[..])], 12, 3);
        let shape: Vec<Vec<(usize, usize)>> = parts
            .iter()
            .map(|p| p.iter().map(|(at, d)| (*at, d.len())).collect())
            .collect();
        assert_eq!(
            shape,
            vec![vec![(0, 4)], vec![(4, 1), (10, 3)], vec![(13, 4)]]
        );
        let mut c = [0u8; 3];
        let parts = super::cut(vec![(0, &mut c[..]), (3, &mut [][..])], 3, 2);
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 2);
    }
}
