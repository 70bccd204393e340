//! A Rust rank of a job torchrun launches, beside Python ranks or alone: it forms its dist job
//! through the store torchrun's agent serves (`MASTER_ADDR:MASTER_PORT`, no second port),
//! checks an all_reduce, trades keys with the other dist ranks through `store()` (under the
//! job's prefix), and, with `PYTHON_RANKS` set, reads the key a Python rank set through
//! `torch.distributed.TCPStore` and sets one for it (`mixed_store.py` starts such a job).
//!
//! ```text
//! torchrun --standalone --nproc-per-node 2 --no-python target/debug/examples/mixed_store
//! torchrun --standalone --nproc-per-node 3 crates/dist-tcp/examples/mixed_store.py \
//!     target/debug/examples/mixed_store
//! ```

use std::time::Duration;

use dist_core::{Backend, Collectives, ReduceOp};
use dist_store::Store;
use dist_tcp::TcpBackend;

const WAIT: Duration = Duration::from_secs(60);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let b = TcpBackend::from_env()?;
    let (me, n) = (b.rank(), b.world_size());
    let mut x = [me as u64 + 1];
    b.all_reduce(&mut x, ReduceOp::Sum)?;
    if x[0] != (n * (n + 1) / 2) as u64 {
        return Err(format!("all_reduce gave {}", x[0]).into());
    }
    // The dist ranks' own keys, under the job's prefix.
    let store = b.store();
    store.set(&format!("hello/{me}"), format!("rank {me}").as_bytes())?;
    for r in 0..n {
        let v = store.get(&format!("hello/{r}"), WAIT)?;
        if v != format!("rank {r}").as_bytes() {
            return Err(format!("key hello/{r} holds {:?}", String::from_utf8_lossy(&v)).into());
        }
    }
    // Keys agreed with the Python ranks, on the connection without a prefix: the same store.
    if std::env::var("PYTHON_RANKS").is_ok_and(|p| p != "0") {
        let shared = store.inner();
        let said = shared.get("mixed/from_python", WAIT)?;
        shared.set(
            &format!("mixed/from_rust/{me}"),
            format!("rust rank {me} read {:?}", String::from_utf8_lossy(&said)).as_bytes(),
        )?;
    }
    println!(
        "rust rank {me} of {n}: formed through the store at {} (keys under {}), all_reduce {}",
        store.inner().server(),
        store.prefix(),
        x[0]
    );
    Ok(())
}
