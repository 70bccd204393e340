//! Support for dist's own tests, not part of the API: a rank that forms the mesh with the real
//! handshake and then gets the raw connections, to play a hostile peer.

use std::net::TcpStream;

use dist_core::Result;

use crate::{TcpConfig, init};

/// Joins the job `cfg` describes through the real rendezvous and handshake, and returns the
/// connection to every other rank (`None` at this rank's own index), with no reader on them.
pub fn form_raw(cfg: &TcpConfig) -> Result<Vec<Option<TcpStream>>> {
    init::form(cfg)
}
