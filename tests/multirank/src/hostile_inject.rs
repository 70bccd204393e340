//! Someone on the path between two ranks injects a frame into their connection: bytes that
//! arrive on rank 0's side of the connection with rank 1 between two of rank 1's own frames,
//! written through a second handle on rank 1's socket (`dist_tcp::testing::peer_socket`),
//! which reaches rank 0 exactly as segments spliced into the stream by a host on the path do.
//! On a plain connection the forged message is delivered as rank 1's (the threat); on a
//! sealed one (`DIST_SEAL=1`) rank 0's receive fails with an error naming rank 1 and the
//! record that failed its check, and its buffer keeps what it held: nothing forged is
//! delivered.

use std::io::Write;
use std::time::Duration;

use dist_core::{Backend, DistError, Tag};
use dist_tcp::wire::{FrameHeader, FrameKind};

use dist_multirank as common;

const GENUINE: Tag = Tag::user(40);
const TARGET: Tag = Tag::user(41);
const FORGED: &[u8; 16] = b"forged gradient!";

pub fn inject() -> Result<(), String> {
    // Shared memory off: the connection itself carries the frames (under a ring it carries
    // only doorbell bytes, and what is injected there is dropped as such).
    let cfg = common::config().shared_memory(false);
    let sealed = std::env::var("DIST_SEAL").is_ok_and(|v| v == "1");
    let b = dist_tcp::TcpBackend::with_config(cfg).map_err(|e| e.to_string())?;
    let me = b.rank();
    // A genuine exchange first: the connection is up and carries frames both ways.
    let mut got = [0u8; 8];
    if me == 0 {
        b.send_tagged(b"genuine0", 1, GENUINE)
            .map_err(|e| e.to_string())?;
        b.recv_tagged(&mut got, 1, GENUINE)
            .map_err(|e| e.to_string())?;
    } else {
        b.recv_tagged(&mut got, 0, GENUINE)
            .map_err(|e| e.to_string())?;
        b.send_tagged(b"genuine1", 0, GENUINE)
            .map_err(|e| e.to_string())?;
    }
    if &got != if me == 0 { b"genuine1" } else { b"genuine0" } {
        return Err(format!("rank {me}: genuine message garbled: {got:?}"));
    }
    b.barrier().map_err(|e| e.to_string())?;
    if me == 1 {
        // The injection: a data frame on the tag rank 0 waits on, as anyone who can write
        // into the stream can make it (no key needed).
        let mut s = dist_tcp::testing::peer_socket(&b, 0).ok_or("no connection to rank 0")?;
        let h = FrameHeader {
            kind: FrameKind::Data,
            tag: TARGET.to_wire(),
            len: FORGED.len() as u64,
            meta: [0; 16],
        }
        .encode();
        s.write_all(&h)
            .and_then(|()| s.write_all(FORGED))
            .map_err(|e| e.to_string())?;
        // Rank 0 says what it got on a plain connection; a sealed one it closes, and this
        // rank's wait ends with the connection.
        let mut verdict = [0u8; 8];
        let r = b.recv_tagged(&mut verdict, 0, GENUINE);
        return match (sealed, r) {
            (false, Ok(_)) if &verdict == b"accepted" => Ok(()),
            (false, r) => Err(format!(
                "plain: rank 0 did not take the injected frame: {r:?}"
            )),
            (true, Err(_)) => Ok(()),
            (true, Ok(_)) => Err(format!("sealed: rank 0 answered {verdict:?}")),
        };
    }
    let mut buf = [0xAAu8; 16];
    let r = b.recv_tagged_timeout(&mut buf, 1, TARGET, Duration::from_secs(30));
    if !sealed {
        // The threat sealing removes: the forged bytes arrive as rank 1's message.
        r.map_err(|e| format!("plain: {e}"))?;
        if &buf != FORGED {
            return Err(format!("plain: got {buf:?}"));
        }
        b.send_tagged(b"accepted", 1, GENUINE)
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    let e = match r {
        Ok(_) => return Err(format!("sealed: the injected frame was delivered: {buf:?}")),
        Err(e) => e,
    };
    let text = e.to_string();
    let named = matches!(
        e,
        DistError::PeerGone {
            rank: 0,
            peer: 1,
            ..
        }
    ) && text.contains("sealed record")
        && text.contains("from rank 1")
        && text.contains("failed its check");
    if !named {
        return Err(format!(
            "sealed: the error does not name the peer and record: {text}"
        ));
    }
    if buf != [0xAA; 16] {
        return Err(format!("sealed: forged bytes reached the buffer: {buf:?}"));
    }
    eprintln!("rank 0 refused the injected frame: {text}");
    Ok(())
}
