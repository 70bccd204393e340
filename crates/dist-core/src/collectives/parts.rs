//! A rank's share of an all_reduce on the host arena split over several threads: this one and
//! the group's helper pool ([`HostArena::threads`](crate::HostArena::threads) in all), each
//! taking a range of the bytes. Every element is still reduced by one rank, in rank order,
//! whatever the count, so the result is the same bits.

use std::sync::Mutex;

use crate::error::{DistError, Result};
use crate::link::Link;
use crate::types::Element;

use super::host::Host;
use super::scratch::segment;

impl<L: Link> Host<'_, '_, L> {
    /// Runs `f(at, part)` over `data` cut into parts of at least `min` bytes, one a thread
    /// ([`HostArena::threads`](crate::HostArena::threads) at most: this one and the group's
    /// helpers), `at` the element at which the part starts. Every part runs whatever
    /// another's result, and this returns only once every part has ended (so no helper
    /// touches `data` after it); the error returned is the first part's that failed.
    pub(super) fn in_parts<T: Element>(
        &self,
        data: &mut [T],
        min: usize,
        f: &(dyn Fn(usize, &mut [T]) -> Result<()> + Sync),
    ) -> Result<()> {
        let threads = self.a.threads();
        let parts = threads.min(std::mem::size_of_val(data) / min.max(1)).max(1);
        let pool = match parts {
            1 => None,
            _ => self.c.g.helpers(threads),
        };
        let Some(pool) = pool else {
            return f(0, data);
        };
        let len = data.len();
        let failed: Vec<Mutex<Option<DistError>>> = (0..parts).map(|_| Mutex::new(None)).collect();
        let run = |i: usize, part: &mut [T]| {
            if let Err(e) = f(segment(len, parts, i).start, part) {
                *failed[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        };
        pool.in_place_scope(|s| {
            let mut rest = &mut data[..];
            let mut own = None;
            for i in 0..parts {
                let (part, tail) = rest.split_at_mut(segment(len, parts, i).len());
                rest = tail;
                match i {
                    0 => own = Some(part),
                    _ => s.spawn(move |_| run(i, part)),
                }
            }
            if let Some(part) = own {
                run(0, part);
            }
        });
        match failed
            .into_iter()
            .find_map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
