//! `cargo xtask store --port P`: serves a TCPStore (dist-store's server, which PyTorch's client
//! speaks to as well) until stopped, for jobs started by hand: each rank then sets
//! `DIST_SERVE_STORE=0`, `MASTER_ADDR` and `MASTER_PORT`, and forms through it. SIGINT or
//! SIGTERM stops it (their default action ends the process, and the kernel closes every
//! connection).

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use dist_store::StoreServer;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The port to listen on (0: any free port, printed).
    #[arg(long)]
    pub port: u16,
    /// The address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind: IpAddr,
}

pub fn run(args: &Args) -> Result<()> {
    let at = SocketAddr::new(args.bind, args.port);
    let server = StoreServer::bind(at).with_context(|| format!("serve a store on {at}"))?;
    // One line, flushed, that a script (or a test) can wait for.
    println!("store serving on {}", server.local_addr());
    loop {
        // Nothing to do but serve: the server's own thread does. SIGINT/SIGTERM end the process.
        std::thread::park();
    }
}
