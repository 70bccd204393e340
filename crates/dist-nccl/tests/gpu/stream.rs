//! Every call on a stream the caller owns (`Communicator::on`), between kernels of the caller
//! on that stream: a slow kernel before it writes the input and a sentinel in the output, and a
//! copy after it reads the output. The result proves the order: the call read the input only
//! after the kernel wrote it, wrote the output after the sentinel (the sentinel does not
//! survive), and the copy after it saw its result. Without event tracking (`tracked` false)
//! nothing but the stream orders them.

use std::time::Duration;

use crate::calls::{ALL, K};
use crate::rig;

/// How long the kernel before each call spins: far longer than a call takes.
const SPIN_NS: u64 = 5_000_000;
const SENTINEL: f32 = -1.0e6;

pub fn every_call(tracked: bool) -> Result<(), String> {
    let r = rig(tracked, Duration::from_secs(30));
    let s = r.ctx.new_stream().map_err(|e| e.to_string())?;
    let mut failures = Vec::new();
    for (i, call) in ALL.into_iter().enumerate() {
        let e = |e: cudarc::driver::DriverError| format!("{call:?}: {e}");
        let mut send = s.alloc_zeros::<f32>(K).map_err(e)?;
        let mut recv = s.alloc_zeros::<f32>(K).map_err(e)?;
        let mut out = s.alloc_zeros::<f32>(K).map_err(e)?;
        let base = 100.0 * (i as f32 + 1.0);
        if call.in_place() {
            r.k.spin_fill(&s, &mut recv, base, SPIN_NS);
        } else {
            r.k.spin_fill(&s, &mut send, base, SPIN_NS);
            r.k.spin_fill(&s, &mut recv, SENTINEL, SPIN_NS);
        }
        call.eager(&r.comm, &s, &send, &mut recv)
            .map_err(|e| format!("{call:?}: {e}"))?;
        s.memcpy_dtod(&recv, &mut out).map_err(e)?;
        r.comm
            .synchronize_stream(&s)
            .map_err(|e| format!("{call:?}: {e}"))?;
        let got = s.clone_dtoh(&out).map_err(e)?;
        let want: Vec<f32> = (0..K).map(|j| call.want(base + j as f32)).collect();
        if got != want {
            failures.push(format!("{call:?}: got {got:?}, want {want:?}"));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}
