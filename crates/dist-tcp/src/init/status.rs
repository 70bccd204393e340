//! Rank 0 reads every rank's init status on one thread: `poll` over all the rendezvous
//! connections (formation used to start a thread per rank), so that the first failure is seen
//! at once whichever rank it comes from.

use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Instant;

use crate::wire::{STATUS_LEN, Status};

/// Reads one status from each of `conns` (the connection to rank `i + 1` at `i`) by
/// `deadline`; returns the first failure as `(rank, reason)`, or `None` when every rank is
/// ready. The connections are left blocking.
pub(super) fn gather(conns: &[TcpStream], deadline: Instant) -> Option<(usize, String)> {
    let failure = gather_nonblocking(conns, deadline);
    for s in conns {
        let _ = s.set_nonblocking(false);
    }
    failure
}

fn gather_nonblocking(conns: &[TcpStream], deadline: Instant) -> Option<(usize, String)> {
    let n = conns.len();
    for (i, s) in conns.iter().enumerate() {
        if let Err(e) = s.set_nonblocking(true) {
            return Some((i + 1, format!("rank {}: no status: {e}", i + 1)));
        }
    }
    let mut bufs = vec![[0u8; STATUS_LEN]; n];
    let mut got = vec![0usize; n];
    let mut fds: Vec<libc::pollfd> = conns
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut left = n;
    while left > 0 {
        let wait = deadline.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            return Some((
                0,
                "ranks did not finish connecting before the init deadline".into(),
            ));
        }
        if let Err(e) = crate::sys::poll_many(&mut fds, wait) {
            return Some((0, format!("poll the ranks' statuses: {e}")));
        }
        for i in 0..n {
            if fds[i].revents == 0 {
                continue;
            }
            fds[i].revents = 0;
            let rank = i + 1;
            match (&conns[i]).read(&mut bufs[i][got[i]..]) {
                Ok(0) => {
                    return Some((
                        rank,
                        format!(
                            "rank {rank}: no status: connection closed after {} of {STATUS_LEN} \
                             bytes",
                            got[i]
                        ),
                    ));
                }
                Ok(k) => got[i] += k,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Some((rank, format!("rank {rank}: no status: {e}"))),
            }
            if got[i] < STATUS_LEN {
                continue;
            }
            // Done with this one: poll ignores a negative fd.
            fds[i].fd = -1;
            left -= 1;
            match Status::decode(&bufs[i]) {
                Ok((_, Status::Ready)) => {}
                Ok((_, Status::Failed(why))) => return Some((rank, why)),
                Ok((_, Status::Go)) => {
                    return Some((rank, format!("rank {rank} sent an unexpected status")));
                }
                Err(e) => return Some((rank, format!("rank {rank}: {e}"))),
            }
        }
    }
    None
}
