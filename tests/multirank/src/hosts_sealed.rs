//! Sealed all_reduces between two simulated hosts (rank 0 on host 0, rank 1 on host 1), every
//! result checked word for word. On plain hosts every call completes. The harness's
//! `hosts_sealed_path_*` trials run it on hosts joined by a hub that forges, replays, reorders
//! or cuts short the segments of their connection: there rank 1's call must end with an error
//! naming rank 0, and no rank may ever take a wrong result as its own ([`FORGED`] says it did).

use dist_core::collectives::Collectives;
use dist_core::{Backend, ReduceOp};
use dist_tcp::TcpBackend;

/// What a rank's error says when a result it was handed differs from the true one: something
/// forged was delivered.
pub const FORGED: &str = "forged data delivered";
/// The all_reduces each rank makes.
const CALLS: usize = 16;
/// The words of each (1 MiB): each crosses the link in several sealed records.
const WORDS: usize = 1 << 17;

/// Rank `r`'s word `i` in call `c`: no two alike, so a segment of the stream put in another's
/// place changes the result.
fn word(r: usize, c: usize, i: usize) -> u64 {
    ((r as u64 + 1) << 48) | ((c as u64) << 24) | i as u64
}

pub fn sealed_path() -> Result<(), String> {
    let cfg = dist_multirank::config()
        .seal(true)
        .secret(b"multirank-sealed-path-secret".to_vec());
    let b = TcpBackend::with_config(cfg).map_err(|e| format!("init: {e}"))?;
    let (me, n) = (b.rank(), b.world_size());
    for c in 0..CALLS {
        let mut x: Vec<u64> = (0..WORDS).map(|i| word(me, c, i)).collect();
        b.all_reduce(&mut x, ReduceOp::Sum)
            .map_err(|e| format!("rank {me}: all_reduce {c} of {CALLS} failed: {e}"))?;
        for (i, v) in x.iter().enumerate() {
            let want: u64 = (0..n).map(|r| word(r, c, i)).sum();
            if *v != want {
                return Err(format!(
                    "{FORGED}: rank {me}, all_reduce {c}, word {i}: {v:#x}, the true sum {want:#x}"
                ));
            }
        }
    }
    println!("rank {me}: {CALLS} sealed all_reduces of {WORDS} words, every result true");
    Ok(())
}
