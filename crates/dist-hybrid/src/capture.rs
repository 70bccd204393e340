//! CUDA graphs of the hybrid's NCCL calls: [`HybridBackend::capture`] records device-buffer
//! collectives (and the caller's own work on the capture's stream) into a [`HybridGraph`],
//! which [`HybridGraph::launch`] replays any number of times. It is `dist_nccl`'s
//! `Communicator::capture` on the communicator's own stream (where every device call of the
//! hybrid runs), with the hybrid's record and check around it.
//!
//! What the NCCL call check does with a graph. The check compares, asynchronously and from
//! background threads, each rank's NCCL calls with the previous rank's by sequence number;
//! nothing of it runs at the moment a replay's kernels run, and nothing of it can. So:
//! - **At capture**, each captured collective takes its sequence number and is compared as a
//!   call is (collective, element type, count, reduce op or counts' fingerprint, root): ranks
//!   that capture different calls, or capture where another rank makes an eager call, are a
//!   mismatch, found and reported as for calls (the communicator is aborted on every rank, so
//!   no replay runs after).
//! - **At each replay**, [`HybridGraph::launch`] takes one sequence number and hands the check
//!   one descriptor, `graph calls x N gXXXXXXXX`: the number of collectives the graph holds and
//!   a fingerprint of their descriptors (FNV-1a over each, without its sequence number). Ranks
//!   that replay different graphs, or replay where another rank makes a call, are a mismatch
//!   likewise. The fingerprint is of what the check compares: a graph's point-to-point calls
//!   and its PreMulSum scalars are not in it (they may differ between ranks), as they are not
//!   in a call's descriptor.
//!   A replay costs the calling thread what a call does for the check: one `try_send`.
//! - Off (`DIST_NCCL_CHECK=0`, [`HybridBackend::set_nccl_check`]): captured calls and replays
//!   still take their sequence numbers, so the ranks stay in step.
//!
//! The record ([`HybridBackend::nccl_flight`]): each captured call is recorded when made and
//! finished when the capture ends (done: it was recorded into the graph, nothing ran; failed:
//! the capture failed). Each replay is recorded as one call, `graph` of `calls` × N, queued
//! until a synchronize sees it done, so a timeout names the replay a rank waits in.
//!
//! Deadlines: a replay is work enqueued on the communicator's stream like a call: the
//! communicator's watchdog bounds it with the NCCL timeout (a hung replay aborts the
//! communicator, which ends its NCCL kernels), and [`HybridGraph::synchronize`],
//! [`HybridBackend::synchronize_nccl`] and [`HybridBackend::synchronize_nccl_timeout`] wait for
//! it (the last with a shorter bound of the caller's). A timeout names where every rank's NCCL
//! calls are, replays included.
//!
//! What is refused: a plain device call of the backend inside the capture's closure (its
//! stream is capturing: it fails with an error saying so, and the capture goes on), the
//! `_async` calls and a synchronize there; a capture where the backend has no NCCL
//! communicator ([`crate::HybridError::NoNccl`]). An error inside the closure ends the capture
//! and returns that error; nothing recorded is kept.
//!
//! ```no_run
//! # use dist_core::ReduceOp;
//! # fn demo(h: &dist_hybrid::HybridBackend) -> dist_hybrid::Result<()> {
//! let s = h.nccl().expect("a GPU here").stream().clone();
//! let grads = s.alloc_zeros::<f32>(1 << 20).unwrap();
//! let graph = h.capture(|cap| {
//!     // ... the caller's kernels on cap.stream() ...
//!     cap.all_reduce_in_place(&grads, ReduceOp::Avg)
//! })?;
//! for _step in 0..100 {
//!     graph.launch()?;
//! }
//! graph.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! A buffer the graph uses cannot be freed while it can replay:
//!
//! ```compile_fail,E0505
//! # use dist_core::ReduceOp;
//! # fn demo(h: &dist_hybrid::HybridBackend) -> dist_hybrid::Result<()> {
//! let a = h.nccl().unwrap().stream().alloc_zeros::<f32>(1024).unwrap();
//! let graph = h.capture(|cap| cap.all_reduce_in_place(&a, ReduceOp::Sum))?;
//! drop(a);
//! graph.launch()
//! # }
//! ```
//!
//! and the capture belongs to its thread (CUDA's thread-local capture mode):
//!
//! ```compile_fail,E0277
//! # use dist_core::ReduceOp;
//! # fn demo(h: &dist_hybrid::HybridBackend) -> dist_hybrid::Result<()> {
//! let a = h.nccl().unwrap().stream().alloc_zeros::<f32>(1024).unwrap();
//! let graph = h.capture(|cap| {
//!     std::thread::scope(|t| {
//!         t.spawn(|| cap.all_reduce_in_place(&a, ReduceOp::Sum));
//!     });
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use dist_core::collectives::Kind;
use dist_core::flight::Entry;
use dist_core::{ReduceOp, Transport};
use dist_nccl::{Capture, Graph, NcclError, NcclType};
use dist_tcp::TcpBackend;

use crate::check::Desc;
use crate::device::{even, fingerprint, native, total};
use crate::{HybridBackend, HybridError, Result};

/// The collective name a replay's descriptor carries.
const GRAPH: &str = "graph";
/// Its "element type": the count is of calls.
const GRAPH_UNIT: &str = "calls";
/// FNV-1a's offset basis and prime (32 bits).
const FNV_OFFSET: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

/// `hash` with the descriptor `d` mixed in, its sequence number left out (FNV-1a over its
/// text), so that the same calls captured at another point hash alike.
pub(crate) fn mix(hash: u32, d: &Desc) -> u32 {
    let shape = Desc { seq: 0, ..*d }.to_string();
    shape
        .bytes()
        .fold(hash, |h, b| (h ^ u32::from(b)).wrapping_mul(FNV_PRIME))
}

/// The fingerprint a replay's descriptor carries in the reduce op's place.
fn graph_name(hash: u32) -> String {
    format!("g{hash:08x}")
}

/// An open capture of the hybrid's NCCL calls (see [`HybridBackend::capture`]). Its calls are
/// those of the backend on device buffers, recorded into the graph, each buffer borrowed
/// (shared) for the graph's life as `dist_nccl::Capture`'s are.
pub struct HybridCapture<'c, 'buf, H: Transport = TcpBackend> {
    h: &'buf HybridBackend<H>,
    cap: &'c Capture<'buf>,
    /// The record's entries of the captured calls, finished when the capture ends.
    entries: RefCell<Vec<Entry>>,
    /// The collectives captured, and the hash of their descriptors.
    calls: Cell<usize>,
    hash: Cell<u32>,
}

impl<H: Transport> std::fmt::Debug for HybridCapture<'_, '_, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HybridCapture({:?}, {} calls)",
            self.cap,
            self.calls.get()
        )
    }
}

/// A CUDA graph of the hybrid's NCCL calls (see [`HybridBackend::capture`]), replayed on the
/// communicator's stream. It borrows the backend and the buffers its calls name while it
/// lives; dropping it waits for its replays within the NCCL timeout, as `dist_nccl::Graph`.
pub struct HybridGraph<'buf, H: Transport = TcpBackend> {
    h: &'buf HybridBackend<H>,
    graph: Graph<'buf>,
    calls: usize,
    name: String,
}

impl<H: Transport> std::fmt::Debug for HybridGraph<'_, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HybridGraph({} calls, {})", self.calls, self.name)
    }
}

impl<H: Transport> HybridBackend<H> {
    /// Records the device-buffer calls `f` makes through its [`HybridCapture`] (and the
    /// caller's own work on [`HybridCapture::stream`], the communicator's stream) into a CUDA
    /// graph, and returns it to replay. Each captured collective is compared by the NCCL call
    /// check now, and each replay later as one call (the module's docs say how). Refused
    /// without an NCCL communicator, while the communicator's stream is capturing already or
    /// this thread has an NCCL group open, and once the communicator was aborted; an error
    /// inside `f` ends the capture, discards it and is returned.
    pub fn capture<'buf>(
        &'buf self,
        f: impl FnOnce(&HybridCapture<'_, 'buf, H>) -> Result<()>,
    ) -> Result<HybridGraph<'buf, H>> {
        let c = self.need_nccl("capture")?;
        let mut failed: Option<HybridError> = None;
        let mut entries = Vec::new();
        let (mut calls, mut hash) = (0, FNV_OFFSET);
        let graph = c.capture(c.stream(), |cap| {
            let hc = HybridCapture {
                h: self,
                cap,
                entries: RefCell::new(Vec::new()),
                calls: Cell::new(0),
                hash: Cell::new(FNV_OFFSET),
            };
            let r = f(&hc);
            entries = hc.entries.take();
            (calls, hash) = (hc.calls.get(), hc.hash.get());
            r.map_err(|e| {
                failed = Some(e);
                // Only ends the capture: the closure's own error is returned below.
                NcclError::Config {
                    what: "hybrid capture".into(),
                    reason: "the capture's closure failed".into(),
                }
            })
        });
        let graph = match (graph, failed) {
            (_, Some(e)) => Err(e),
            (Err(e), None) => Err(self.explain_nccl(e)),
            (Ok(g), None) => Ok(g),
        };
        if let Some(w) = &self.watch {
            let outcome: std::result::Result<(), &dyn std::fmt::Display> = match &graph {
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            for e in entries {
                w.flight.finish(e, outcome);
            }
        }
        Ok(HybridGraph {
            h: self,
            graph: graph?,
            calls,
            name: graph_name(hash),
        })
    }
}

impl<'buf, H: Transport> HybridCapture<'_, 'buf, H> {
    /// The capturing stream (the communicator's): work the caller enqueues on it is recorded
    /// into the same graph, in order with the calls.
    pub fn stream(&self) -> &'buf Arc<CudaStream> {
        self.cap.stream()
    }

    /// One collective: recorded, its descriptor to the check and into the graph's
    /// fingerprint, then `f` records it into the graph.
    fn call<T: NcclType>(
        &self,
        coll: Kind,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
        f: impl FnOnce(&Capture<'buf>) -> dist_nccl::Result<()>,
    ) -> Result<()> {
        if let Some(w) = &self.h.watch {
            let (d, e) = w.begin_captured(coll.name(), T::NAME, count, op, root);
            self.entries.borrow_mut().push(e);
            self.calls.set(self.calls.get() + 1);
            self.hash.set(mix(self.hash.get(), &d));
            self.h.note_for_check(w, d);
        }
        f(self.cap).map_err(|e| self.h.explain_nccl(e))
    }

    /// One point-to-point call: recorded only (the check compares collectives).
    fn p2p<T: NcclType>(
        &self,
        op: &'static str,
        count: usize,
        peer: usize,
        f: impl FnOnce(&Capture<'buf>) -> dist_nccl::Result<()>,
    ) -> Result<()> {
        if let Some(w) = &self.h.watch {
            let e = w.begin_captured_p2p(op, T::NAME, count, peer);
            self.entries.borrow_mut().push(e);
        }
        f(self.cap).map_err(|e| self.h.explain_nccl(e))
    }

    /// All-reduce of `send` into `recv` (same length), recorded into the graph.
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: &'buf CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.call::<T>(Kind::AllReduce, send.len(), Some(op.name()), None, |c| {
            c.all_reduce(send, recv, op)
        })
    }

    /// All-reduce in place, recorded into the graph (what the backend's `all_reduce` does on
    /// a device buffer).
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &'buf CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.call::<T>(Kind::AllReduce, buf.len(), Some(op.name()), None, |c| {
            c.all_reduce_in_place(buf, op)
        })
    }

    /// Broadcast of `buf` from `root`, in place, recorded into the graph.
    pub fn broadcast<T: NcclType>(&self, buf: &'buf CudaSlice<T>, root: usize) -> Result<()> {
        self.call::<T>(Kind::Broadcast, buf.len(), None, Some(root), |c| {
            c.broadcast(buf, root)
        })
    }

    /// Reduce of `send` into `recv` on `root` (required there, ignored elsewhere), recorded
    /// into the graph.
    pub fn reduce<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: Option<&'buf CudaSlice<T>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.call::<T>(Kind::Reduce, send.len(), Some(op.name()), Some(root), |c| {
            c.reduce(send, recv, op, root)
        })
    }

    /// All-gather of `send` (k) into `recv` (k × size), recorded into the graph.
    pub fn all_gather<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: &'buf CudaSlice<T>,
    ) -> Result<()> {
        self.call::<T>(Kind::AllGather, send.len(), None, None, |c| {
            c.all_gather(send, recv)
        })
    }

    /// Reduce-scatter of `send` (k × size) into `recv` (k), recorded into the graph.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: &'buf CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.call::<T>(
            Kind::ReduceScatter,
            recv.len(),
            Some(op.name()),
            None,
            |c| c.reduce_scatter(send, recv, op),
        )
    }

    /// All-to-all of equal blocks, recorded into the graph (as the backend's, fused sends and
    /// receives with an NCCL older than 2.28).
    pub fn all_to_all<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: &'buf CudaSlice<T>,
    ) -> Result<()> {
        self.call::<T>(Kind::AllToAll, send.len(), None, None, |c| {
            let comm = c.communicator();
            if native(comm) || !send.len().is_multiple_of(comm.size()) {
                return c.all_to_all(send, recv);
            }
            let counts = even(send.len() / comm.size(), comm.size());
            c.all_to_all_v(send, &counts, recv, &counts)
        })
    }

    /// Gather of every rank's `send` into `recv` on `root`, recorded into the graph.
    pub fn gather<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: Option<&'buf CudaSlice<T>>,
        root: usize,
    ) -> Result<()> {
        self.call::<T>(Kind::Gather, send.len(), None, Some(root), |c| {
            let comm = c.communicator();
            if native(comm) {
                return c.gather(send, recv, root);
            }
            c.gather_v(send, recv, &even(send.len(), comm.size()), root)
        })
    }

    /// Scatter of `send`'s blocks on `root` into every rank's `recv`, recorded into the graph.
    pub fn scatter<T: NcclType>(
        &self,
        send: Option<&'buf CudaSlice<T>>,
        recv: &'buf CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        self.call::<T>(Kind::Scatter, recv.len(), None, Some(root), |c| {
            let comm = c.communicator();
            if native(comm) {
                return c.scatter(send, recv, root);
            }
            c.scatter_v(send, recv, &even(recv.len(), comm.size()), root)
        })
    }

    /// The uneven all-gather (rank r's block of `counts[r]`), recorded into the graph.
    pub fn all_gather_v<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: &'buf CudaSlice<T>,
        counts: &[usize],
    ) -> Result<()> {
        let fp = fingerprint(counts);
        self.call::<T>(Kind::AllGatherV, total(counts), Some(&fp), None, |c| {
            c.all_gather_v(send, recv, counts)
        })
    }

    /// The uneven gather into `recv` on `root`, recorded into the graph.
    pub fn gather_v<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        recv: Option<&'buf CudaSlice<T>>,
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        let fp = fingerprint(counts);
        self.call::<T>(Kind::GatherV, total(counts), Some(&fp), Some(root), |c| {
            c.gather_v(send, recv, counts, root)
        })
    }

    /// The uneven scatter from `send` on `root`, recorded into the graph.
    pub fn scatter_v<T: NcclType>(
        &self,
        send: Option<&'buf CudaSlice<T>>,
        counts: &[usize],
        recv: &'buf CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        let fp = fingerprint(counts);
        self.call::<T>(Kind::ScatterV, total(counts), Some(&fp), Some(root), |c| {
            c.scatter_v(send, recv, counts, root)
        })
    }

    /// The uneven all-to-all, recorded into the graph (the check compares its collective and
    /// type only, as for the call).
    pub fn all_to_all_v<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        send_counts: &[usize],
        recv: &'buf CudaSlice<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.call::<T>(Kind::AllToAllV, 0, None, None, |c| {
            c.all_to_all_v(send, send_counts, recv, recv_counts)
        })
    }

    /// A send of `buf` to `dst`, recorded into the graph (the peer's graph or calls must
    /// receive it).
    pub fn send_to<T: NcclType>(&self, buf: &'buf CudaSlice<T>, dst: usize) -> Result<()> {
        self.p2p::<T>("send", buf.len(), dst, |c| c.send(buf, dst))
    }

    /// A receive into `buf` from `src`, recorded into the graph.
    pub fn recv_from<T: NcclType>(&self, buf: &'buf CudaSlice<T>, src: usize) -> Result<()> {
        self.p2p::<T>("recv", buf.len(), src, |c| c.recv(buf, src))
    }

    /// A send to `dst` and a receive from `src` fused in one NCCL group, recorded into the
    /// graph (as [`HybridBackend::send_recv`]; the group borrows `recv` exclusively).
    pub fn send_recv<T: NcclType>(
        &self,
        send: &'buf CudaSlice<T>,
        dst: usize,
        recv: &'buf mut CudaSlice<T>,
        src: usize,
    ) -> Result<()> {
        if let Some(w) = &self.h.watch {
            let mut entries = self.entries.borrow_mut();
            entries.push(w.begin_captured_p2p("send", T::NAME, send.len(), dst));
            entries.push(w.begin_captured_p2p("recv", T::NAME, recv.len(), src));
        }
        self.cap
            .group(|g| {
                g.send(send, dst)?;
                g.recv(recv, src)
            })
            .map_err(|e| self.h.explain_nccl(e))
    }
}

impl<H: Transport> HybridGraph<'_, H> {
    /// The stream its replays run on: the communicator's.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.graph.stream()
    }

    /// The collectives the graph holds (its point-to-point calls not counted).
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Enqueues one replay on the communicator's stream: recorded as one call and compared by
    /// the check as one (`graph calls x N` and the graph's fingerprint), then launched as
    /// `dist_nccl::Graph::launch` does (under the communicator's lock, refused once it was
    /// aborted, watched with its timeout). Every rank launches its replays where it would make
    /// the calls they hold.
    pub fn launch(&self) -> Result<()> {
        self.h.checked(
            GRAPH,
            GRAPH_UNIT,
            self.calls,
            Some(&self.name),
            None,
            || self.graph.launch(),
        )
    }

    /// Waits until the replays enqueued so far (and every other call of the backend) have
    /// completed, as [`HybridBackend::synchronize_nccl`] does: within the NCCL timeout, a
    /// timeout naming where every rank's NCCL calls are.
    pub fn synchronize(&self) -> Result<()> {
        self.h.sync_with(|_| self.graph.synchronize())
    }

    /// [`HybridGraph::launch`], then [`HybridGraph::synchronize`].
    pub fn replay(&self) -> Result<()> {
        self.launch()?;
        self.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{Frame, Matcher, Name, mismatch_text};

    fn desc(seq: u64, coll: &str, count: u64, op: &str) -> Desc {
        Desc {
            seq,
            coll: Name::new(coll),
            dtype: Name::new("f32"),
            count,
            op: Name::new(op),
            root: None,
        }
    }

    fn shape(descs: &[Desc]) -> String {
        graph_name(descs.iter().fold(FNV_OFFSET, mix))
    }

    #[test]
    fn a_graphs_fingerprint_is_of_its_calls_not_their_sequence_numbers() {
        let a = [
            desc(3, "all_reduce", 8, "sum"),
            desc(4, "broadcast", 8, "-"),
        ];
        let later = [
            desc(40, "all_reduce", 8, "sum"),
            desc(41, "broadcast", 8, "-"),
        ];
        assert_eq!(shape(&a), shape(&later), "the same calls captured later");
        let n = shape(&a);
        assert_eq!(n.len(), 9, "{n}: within the check's 15 bytes");
        assert!(n.starts_with('g'));
        // Another count, another op, another order, one call fewer: another graph.
        let other = [
            vec![
                desc(3, "all_reduce", 9, "sum"),
                desc(4, "broadcast", 8, "-"),
            ],
            vec![
                desc(3, "all_reduce", 8, "max"),
                desc(4, "broadcast", 8, "-"),
            ],
            vec![
                desc(3, "broadcast", 8, "-"),
                desc(4, "all_reduce", 8, "sum"),
            ],
            vec![desc(3, "all_reduce", 8, "sum")],
        ];
        for o in &other {
            assert_ne!(shape(o), n, "{o:?}");
        }
    }

    /// A replay of one graph against another rank's replay of a different graph, or against
    /// its eager call, is a mismatch the check reports naming both; the same graph matches.
    #[test]
    fn the_check_compares_replays() {
        let g = |seq, calls, hash: &str| Desc {
            seq,
            coll: Name::new(GRAPH),
            dtype: Name::new(GRAPH_UNIT),
            count: calls,
            op: Name::new(hash),
            root: None,
        };
        let a = shape(&[desc(1, "all_reduce", 8, "sum")]);
        let b = shape(&[desc(1, "all_reduce", 16, "sum")]);
        let f = Frame::Descs(vec![g(7, 1, &a)]);
        assert_eq!(
            Frame::decode(&f.encode()),
            Ok(f),
            "the descriptor travels intact"
        );

        let mut m = Matcher::default();
        assert_eq!(m.mine(g(7, 1, &a)), None);
        assert_eq!(m.theirs(g(7, 1, &a)), None, "the same graph matches");

        let mut m = Matcher::default();
        assert_eq!(m.mine(g(7, 1, &a)), None);
        let found = m.theirs(g(7, 1, &b)).expect("another graph is a mismatch");
        let text = mismatch_text(1, 0, &found);
        assert!(text.contains(&format!("#7 graph calls x 1 {a}")), "{text}");
        assert!(text.contains(&format!("#7 graph calls x 1 {b}")), "{text}");

        let mut m = Matcher::default();
        assert_eq!(m.mine(g(7, 1, &a)), None);
        let found = m
            .theirs(desc(7, "all_reduce", 8, "sum"))
            .expect("a replay against a call is a mismatch");
        let text = mismatch_text(1, 0, &found);
        assert!(text.contains("#7 all_reduce f32 x 8 sum"), "{text}");
    }
}
