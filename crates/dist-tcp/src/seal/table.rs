//! The keys of sealed connections between their handshake and their attachment to a peer:
//! a connection travels from the handshake to its peer through formation, the mesh's links
//! and the lazy dialer as a plain `TcpStream`, so its keys wait here, under the connection's
//! two addresses (which no other open connection of this host shares), until the peer takes
//! them (`Peer::set_conn`).
//!
//! Only a handshake that checked the other side's proof of the secret puts keys here, so what
//! the table holds is bounded by the connections this rank's own job made. Keys of a connection
//! dropped before its attachment are taken by the next connection over the same two addresses
//! (which replaces them) or forgotten after [`KEEP`].

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::wire::SEAL_KEY_LEN;

/// The keys of one sealed connection, as this side uses them.
#[derive(Clone)]
pub(crate) struct Keys {
    /// For the records this side writes.
    pub(crate) tx: [u8; SEAL_KEY_LEN],
    /// For the records this side reads.
    pub(crate) rx: [u8; SEAL_KEY_LEN],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

/// How long keys wait for their connection to be attached: longer than any formation.
const KEEP: Duration = Duration::from_secs(3600);

type Table = HashMap<(SocketAddr, SocketAddr), (Keys, Instant)>;

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

fn addrs(stream: &TcpStream) -> std::io::Result<(SocketAddr, SocketAddr)> {
    Ok((stream.local_addr()?, stream.peer_addr()?))
}

/// Keeps `keys` for `stream` until [`take`] takes them.
pub(crate) fn remember(stream: &TcpStream, keys: Keys) -> std::io::Result<()> {
    let at = addrs(stream)?;
    let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let t = t.get_or_insert_with(HashMap::new);
    let now = Instant::now();
    t.retain(|_, (_, since)| now.duration_since(*since) < KEEP);
    t.insert(at, (keys, now));
    Ok(())
}

/// Takes the keys kept for `stream`, if any.
pub(crate) fn take(stream: &TcpStream) -> Option<Keys> {
    let at = addrs(stream).ok()?;
    let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    t.as_mut()?.remove(&at).map(|(k, _)| k)
}
