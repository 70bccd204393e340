//! The table of listeners down a binomial tree, in a lazy formation.
//!
//! Rank 0 sends the whole table only to the ranks whose parent it is (1, 2, 4, …) and every
//! other rank `r` only the listener of its parent, `r` less its highest set bit. Such a rank
//! dials its parent (the mesh handshake, authenticated as every connection after formation),
//! reads the whole table from it, checks it against what rank 0 said, and forwards it to its
//! own children (`r + 2^k` for every `2^k > r`), which dial it in turn ([`Forward`]). Rank 0
//! sends ⌈log₂ n⌉ tables instead of n − 1, and no rank more than that.
//!
//! The tree's connections stay up as the ranks' first lazy connections (handed on like any
//! connection a peer makes): the edge `r`–`r + 2^k` (`r < 2^k`) is the round-`k` partner of
//! recursive doubling (`me XOR 2^k`), which the barrier uses too on many ranks, and an edge of
//! the tree a group's tuning goes down (`dist_core::Group::form`, the same tree).

use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};

use super::handshake::{read_exact_by, write_by};
use super::links::OnIncoming;
use super::mesh::{Dialed, Mesh};
use crate::wire::{self, TABLE_ENTRY_LEN, TABLE_HEAD_LEN, TableHead};

/// The parent of rank `r` (`r > 0`) in the tree: `r` less its highest set bit. The tree is
/// [`dist_core::collectives::forming_tree`], the one a group's tuning goes down, so that a lazy
/// job forms its group over connections its formation made.
pub(crate) fn parent(r: usize) -> usize {
    dist_core::collectives::forming_tree(r, r + 1)
        .0
        .unwrap_or(0)
}

/// The children of rank `r` in a tree of `world` ranks: `r + 2^k` for every `2^k > r`.
#[cfg(test)]
pub(crate) fn children(r: usize, world: usize) -> impl Iterator<Item = usize> {
    dist_core::collectives::forming_tree(r, world).1.into_iter()
}

fn is_child(me: usize, r: usize, world: usize) -> bool {
    r > me && r < world && parent(r) == me
}

/// Reads a table (its head and the entries the head announces) by `deadline`. `io` builds the
/// error for a read that fails, `bad` the one for a table that is not valid for a job of
/// `world` ranks; neither allocates more than `world` entries, whatever the head claims.
pub(crate) fn read_table(
    s: &mut TcpStream,
    world: usize,
    deadline: Instant,
    io: &dyn Fn(std::io::Error) -> DistError,
    bad: &dyn Fn(String) -> DistError,
) -> Result<(TableHead, Vec<SocketAddr>)> {
    let mut head = [0u8; TABLE_HEAD_LEN];
    read_exact_by(s, &mut head, deadline).map_err(io)?;
    let h = wire::decode_table_head(&head).map_err(|e| bad(format!("bad table: {e}")))?;
    if h.world as usize != world {
        return Err(bad(format!(
            "table has {} ranks, expected {world}",
            h.world
        )));
    }
    // The head's range lies within the world (checked by the decoder), so this is at most
    // `world` entries.
    let mut entries = vec![0u8; h.count as usize * TABLE_ENTRY_LEN];
    read_exact_by(s, &mut entries, deadline).map_err(io)?;
    let addrs = wire::decode_table_entries(&entries, h.count as usize)
        .map_err(|e| bad(format!("bad table: {e}")))?;
    Ok((h, addrs))
}

/// Dials `parent` (at `parent_addr`, as rank 0 said) through `mesh` and reads the whole table
/// from it: it must be this job's (`job_id`, `world` ranks) and list `parent_addr` as the
/// parent's listener. Returns the table and the connection, which stays up.
pub(crate) fn table_from_parent(
    mesh: &Mesh,
    parent: usize,
    parent_addr: SocketAddr,
    job_id: u64,
    world: usize,
    deadline: Instant,
) -> Result<(Vec<SocketAddr>, TcpStream)> {
    let (me, started) = (mesh.rank(), Instant::now());
    let who = format!("rank {parent} at {parent_addr} (this rank's parent in the table's tree)");
    let mut s = match mesh.dial(parent, deadline)? {
        Dialed::Stream(s) => s,
        Dialed::Elsewhere => {
            return Err(DistError::HandshakeRefused {
                rank: me,
                peer: who,
                reason: "it dialed this rank during formation instead of waiting for it".into(),
            });
        }
    };
    let bad = |reason: String| DistError::HandshakeRefused {
        rank: me,
        peer: who.clone(),
        reason,
    };
    let io = |e: std::io::Error| DistError::RendezvousFailed {
        rank: me,
        joined: 0,
        world_size: world,
        missing: vec![parent],
        waited: started.elapsed(),
        detail: format!("no table from {who}: {e}"),
    };
    let (h, addrs) = read_table(&mut s, world, deadline, &io, &bad)?;
    check_forwarded(&h, &addrs, parent, parent_addr, job_id).map_err(bad)?;
    Ok((addrs, s))
}

/// Checks a table a parent forwarded: the whole table, of the job rank 0 named, listing the
/// parent where rank 0 said it listens.
pub(crate) fn check_forwarded(
    h: &TableHead,
    addrs: &[SocketAddr],
    parent: usize,
    parent_addr: SocketAddr,
    job_id: u64,
) -> std::result::Result<(), String> {
    if !h.is_whole() {
        return Err(format!(
            "forwarded ranks {}..{} of the table of {}, not the whole table",
            h.first,
            u64::from(h.first) + u64::from(h.count),
            h.world
        ));
    }
    if h.job_id != job_id {
        return Err(format!(
            "forwarded the table of job {:#x}, not rank 0's job {job_id:#x}",
            h.job_id
        ));
    }
    match addrs.get(parent) {
        Some(a) if *a == parent_addr => Ok(()),
        got => Err(format!(
            "forwarded a table that lists rank {parent} at {got:?}, where rank 0 says it \
             listens at {parent_addr}"
        )),
    }
}

/// A rank's side of the tree as a parent: the connections its children make, answered with
/// the table (at once, or as soon as it arrives), then handed on as any connection a peer
/// makes. Every other connection goes straight on.
pub(crate) struct Forward {
    me: usize,
    world: usize,
    /// How long writing the table to one child may take.
    write_timeout: Duration,
    deliver: OnIncoming,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The whole table, encoded, once this rank has it.
    table: Option<Arc<Vec<u8>>>,
    /// Children whose connection came before the table did.
    pending: Vec<(usize, TcpStream)>,
    /// Children answered (or pending): a later connection of theirs is an ordinary one.
    served: Vec<usize>,
}

impl Forward {
    /// Forwards for rank `me` of `world`, handing every connection on to `deliver`.
    pub(crate) fn new(
        me: usize,
        world: usize,
        write_timeout: Duration,
        deliver: OnIncoming,
    ) -> Forward {
        Forward {
            me,
            world,
            write_timeout,
            deliver,
            state: Mutex::new(State::default()),
        }
    }

    /// The connection `peer` made to this rank (its handshake done); as
    /// [`OnIncoming`](super::OnIncoming).
    pub(crate) fn incoming(&self, peer: usize, stream: TcpStream) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !is_child(self.me, peer, self.world) || st.served.contains(&peer) {
            drop(st);
            return (self.deliver)(peer, stream);
        }
        st.served.push(peer);
        match st.table.clone() {
            Some(t) => {
                drop(st);
                self.answer(peer, stream, &t)
            }
            None => {
                // Answered by `publish`. Should that write fail, the child fails its
                // formation (no table), and with it the job.
                st.pending.push((peer, stream));
                true
            }
        }
    }

    /// Hands on a connection this rank made itself (to its parent).
    pub(crate) fn hand_on(&self, peer: usize, stream: TcpStream) -> bool {
        (self.deliver)(peer, stream)
    }

    /// This rank has the whole table (`table`, encoded): answers the children waiting, and
    /// every child that connects from now on at once.
    pub(crate) fn publish(&self, table: Vec<u8>) {
        let table = Arc::new(table);
        let pending = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.table = Some(table.clone());
            std::mem::take(&mut st.pending)
        };
        for (peer, s) in pending {
            self.answer(peer, s, &table);
        }
    }

    fn answer(&self, peer: usize, mut s: TcpStream, table: &[u8]) -> bool {
        match write_by(&mut s, table, Instant::now() + self.write_timeout) {
            Ok(()) => (self.deliver)(peer, s),
            Err(e) => {
                tracing::warn!(
                    rank = self.me,
                    peer,
                    bytes = table.len(),
                    error = %e,
                    "could not forward the table to a child in the tree"
                );
                false
            }
        }
    }
}
