//! Calls recorded into CUDA graphs (`Communicator::capture`) and replayed: every call with the
//! caller's kernel before it in the same graph, the right result after every replay; a group of
//! send and receive; what cannot be captured refused without breaking the capture; captures
//! right after eager calls (the watchdog must not put its mark into them); and a replay that
//! hangs, ended by the communicator's timeout.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use dist_core::ReduceOp;
use dist_nccl::NcclError;

use crate::calls::{ALL, K};
use crate::rig;

fn e(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn n(what: &str) -> impl Fn(NcclError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// The raw pointer of `buf` (for the caller's kernels inside a graph), taken on `s`.
fn raw(buf: &CudaSlice<f32>, s: &CudaStream) -> u64 {
    let (p, _read) = buf.device_ptr(s);
    p
}

fn expect(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

fn idle(s: &CudaStream) -> Result<(), String> {
    let st = s.capture_status().map_err(e("capture status"))?;
    expect(
        st == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        || format!("the stream is left in capture state {st:?}"),
    )
}

/// Every call in one graph, each after the caller's kernel that adds 1 to its input: after
/// replay r the output is the initial input plus r (twice that for `PreMulSum(2)`). With
/// tracking, on the communicator's own stream; without, on one of the caller's.
pub fn every_call(tracked: bool) -> Result<(), String> {
    let r = rig(tracked, Duration::from_secs(30));
    let s: Arc<CudaStream> = if tracked {
        r.comm.stream().clone()
    } else {
        r.ctx.new_stream().map_err(e("stream"))?
    };
    let x0 = |i: usize, j: usize| 1000.0 * (i as f32 + 1.0) + j as f32;
    let mut bufs = Vec::new();
    for (i, call) in ALL.into_iter().enumerate() {
        let input: Vec<f32> = (0..K).map(|j| x0(i, j)).collect();
        let send = s.clone_htod(&input).map_err(e("send"))?;
        let recv = if call.in_place() {
            s.clone_htod(&input).map_err(e("recv"))?
        } else {
            s.alloc_zeros::<f32>(K).map_err(e("recv"))?
        };
        bufs.push((send, recv));
    }
    let inputs: Vec<u64> = ALL
        .iter()
        .zip(&bufs)
        .map(|(c, (send, recv))| raw(if c.in_place() { recv } else { send }, &s))
        .collect();
    let graph = r
        .comm
        .capture(&s, |cap| {
            for (i, call) in ALL.into_iter().enumerate() {
                // SAFETY: the input buffer lives until after the graph (declared before it,
                // borrowed by it); the kernel runs on the graph's stream, in order with the
                // calls, and touches its K elements only.
                unsafe { r.k.add_raw(cap.stream(), inputs[i], K, 1.0) };
                call.captured(cap, &bufs[i].0, &bufs[i].1)?;
            }
            Ok(())
        })
        .map_err(n("capture"))?;
    idle(&s)?;
    let check = |replays: usize| -> Result<(), String> {
        for (i, call) in ALL.into_iter().enumerate() {
            // On the graph's stream: after the replays enqueued there.
            let got = s.clone_dtoh(&bufs[i].1).map_err(e("read"))?;
            let want: Vec<f32> = (0..K)
                .map(|j| call.want(x0(i, j) + replays as f32))
                .collect();
            expect(got == want, || {
                format!("{call:?} after {replays} replays: got {got:?}, want {want:?}")
            })?;
        }
        Ok(())
    };
    for rep in 1..=3 {
        graph.launch().map_err(n("launch"))?;
        check(rep)?;
    }
    for _ in 0..4 {
        graph.launch().map_err(n("launch"))?;
    }
    graph.synchronize().map_err(n("graph synchronize"))?;
    check(7)?;
    drop(graph);
    // The communicator still runs eager calls on the same stream, and its work is watched.
    let (send, recv) = &mut bufs[0];
    r.comm
        .on(&s)
        .all_reduce(send, recv, ReduceOp::Sum)
        .map_err(n("eager after"))?;
    r.comm.synchronize_stream(&s).map_err(n("synchronize"))?;
    expect(r.comm.async_error().is_none(), || {
        "an asynchronous error".into()
    })
}

/// Send and receive to itself in one group inside the capture: the group borrows the output
/// exclusively, until the graph is dropped; after three replays it holds the input plus 3.
pub fn group_send_recv() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    let s = r.ctx.new_stream().map_err(e("stream"))?;
    let input: Vec<f32> = (0..K).map(|j| j as f32).collect();
    let a = s.clone_htod(&input).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    let pa = raw(&a, &s);
    {
        let graph = r
            .comm
            .capture(&s, |cap| {
                // SAFETY: `a` outlives the graph; its K elements, on the graph's stream.
                unsafe { r.k.add_raw(cap.stream(), pa, K, 1.0) };
                cap.group(|g| {
                    g.send(&a, 0)?;
                    g.recv(&mut b, 0)
                })
            })
            .map_err(n("capture"))?;
        for _ in 0..3 {
            graph.launch().map_err(n("launch"))?;
        }
    }
    let got = s.clone_dtoh(&b).map_err(e("read"))?;
    let want: Vec<f32> = input.iter().map(|x| x + 3.0).collect();
    expect(got == want, || format!("got {got:?}, want {want:?}"))
}

fn refused(what: &str, r: dist_nccl::Result<()>, needle: &str) -> Result<(), String> {
    match r {
        Err(err) if err.to_string().contains(needle) => Ok(()),
        other => Err(format!(
            "{what}: want an error saying {needle:?}, got {other:?}"
        )),
    }
}

/// What cannot be captured is refused, and the capture it was refused in stays valid.
pub fn refusals() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    let s = r.ctx.new_stream().map_err(e("stream"))?;
    let a = s.clone_htod(&[1.0f32; K]).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    let c = s.alloc_zeros::<f32>(K).map_err(e("c"))?;
    let short = s.alloc_zeros::<f32>(K - 1).map_err(e("short"))?;
    r.comm.synchronize_stream(&s).map_err(n("sync"))?;

    // A capture the caller began with cudarc: dist's calls on it are refused.
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin"))?;
    let call = r.comm.on(&s).all_reduce(&a, &mut b, ReduceOp::Sum);
    let sync = r.comm.synchronize_stream(&s);
    let nested = r.comm.capture(&s, |_| Ok(())).map(drop);
    let ended = s.end_capture(CUgraphInstantiate_flags(0));
    refused(
        "a call on a capturing stream",
        call,
        "capturing a CUDA graph",
    )?;
    refused(
        "a synchronize of a capturing stream",
        sync,
        "capturing a CUDA graph",
    )?;
    refused(
        "a capture of a capturing stream",
        nested,
        "capturing already",
    )?;
    if let Err(err) = ended {
        return Err(format!(
            "the refused calls broke the caller's capture: {err}"
        ));
    }

    // Inside dist's capture of the communicator's own stream: only the capture's calls.
    let own = r.comm.stream().clone();
    let mut inside = Vec::new();
    let graph = r
        .comm
        .capture(&own, |cap| {
            inside.push(("a plain call", r.comm.all_reduce(&a, &mut b, ReduceOp::Sum)));
            inside.push(("a synchronize", r.comm.synchronize()));
            inside.push(("a work handle", r.comm.record_work("x").map(drop)));
            cap.all_reduce(&a, &c, ReduceOp::Sum)
        })
        .map_err(n("capture"))?;
    for (what, res) in inside {
        refused(what, res, "capturing a CUDA graph")?;
    }
    graph.replay().map_err(n("replay"))?;
    drop(graph);
    let got = own.clone_dtoh(&c).map_err(e("read"))?;
    expect(got == [1.0; K], || {
        format!("captured all_reduce gave {got:?}")
    })?;

    // A failing call ends the capture with its error; so does a panic.
    let failed = r
        .comm
        .capture(&s, |cap| cap.all_reduce(&a, &short, ReduceOp::Sum))
        .map(drop);
    refused("a bad call inside a capture", failed, "recv")?;
    idle(&s)?;
    let panicked = std::panic::catch_unwind(AssertUnwindSafe(|| {
        r.comm
            .capture(&s, |_| panic!("a panic inside the capture"))
            .map(drop)
    }));
    expect(panicked.is_err(), || {
        "the panic did not reach the caller".into()
    })?;
    idle(&s)?;

    // After an abort a graph launch is refused.
    let graph = r
        .comm
        .capture(&s, |cap| cap.all_reduce(&a, &c, ReduceOp::Sum))
        .map_err(n("capture"))?;
    graph.replay().map_err(n("replay before the abort"))?;
    r.comm.abort();
    refused("a launch after abort", graph.launch(), "abort() was called")
}

/// Captures begun right after eager calls on the same stream: a capture lasts 2 ms, so the
/// watchdog (every 10 ms) often looks while the stream captures, with the eager call not yet
/// marked; its mark must stay out of the capture (else the capture ends invalidated, or the
/// communicator is aborted).
pub fn after_eager_calls() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    let s = r.ctx.new_stream().map_err(e("stream"))?;
    let a = s.clone_htod(&[2.0f32; K]).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    let c = s.alloc_zeros::<f32>(K).map_err(e("c"))?;
    for i in 0..60 {
        r.comm
            .on(&s)
            .all_reduce(&a, &mut b, ReduceOp::Sum)
            .map_err(n("eager"))?;
        let graph = r
            .comm
            .capture(&s, |cap| {
                cap.all_reduce(&a, &c, ReduceOp::Sum)?;
                // Keeps the capture open while the watchdog looks (the condition under test).
                std::thread::sleep(Duration::from_millis(2));
                Ok(())
            })
            .map_err(|err| format!("capture {i}: {err}"))?;
        graph.replay().map_err(|err| format!("replay {i}: {err}"))?;
    }
    let (gb, gc) = (
        s.clone_dtoh(&b).map_err(e("b"))?,
        s.clone_dtoh(&c).map_err(e("c"))?,
    );
    expect(gb == [2.0; K] && gc == [2.0; K], || {
        format!("{gb:?} {gc:?}")
    })?;
    expect(r.comm.abort_handle().aborted().is_none(), || {
        format!("aborted: {:?}", r.comm.abort_handle().aborted())
    })?;
    expect(r.comm.async_error().is_none(), || {
        "an asynchronous error".into()
    })
}

/// A replay whose work does not complete (the caller's kernel spins for 4 s) is ended at the
/// communicator's timeout (1 s): `Graph::synchronize` returns the timeout well before the
/// kernel ends, and the communicator is aborted.
pub fn bounded_replay() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(1));
    let s = r.comm.stream().clone();
    let a = s.clone_htod(&[1.0f32; K]).map_err(e("a"))?;
    let c = s.alloc_zeros::<f32>(K).map_err(e("c"))?;
    r.comm.synchronize().map_err(n("sync"))?;
    let graph = r
        .comm
        .capture(&s, |cap| {
            // SAFETY: no element is written (n = 0): the kernel only spins.
            unsafe { r.k.spin_fill_raw(cap.stream(), 0, 0, 0.0, 4_000_000_000) };
            cap.all_reduce(&a, &c, ReduceOp::Sum)
        })
        .map_err(n("capture"))?;
    graph.launch().map_err(n("launch"))?;
    let t0 = Instant::now();
    let waited = graph.synchronize();
    let took = t0.elapsed();
    expect(matches!(waited, Err(NcclError::Timeout { .. })), || {
        format!("want a timeout, got {waited:?}")
    })?;
    expect(took < Duration::from_millis(2500), || {
        format!("the timeout took {took:?} (the kernel spins 4 s)")
    })?;
    let after = r
        .comm
        .all_reduce_in_place(&mut s.alloc_zeros::<f32>(K).map_err(e("x"))?, ReduceOp::Sum);
    expect(after.is_err(), || {
        "a call after the timeout was not refused".into()
    })
}
