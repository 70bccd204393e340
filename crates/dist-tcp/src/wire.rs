//! The wire format as pure functions over bytes: the handshake messages, the table of listeners
//! (`table.rs`, the value of a key in the job's store) and the frame header. Nothing here touches a socket, so
//! every decoder can be tested (and fuzzed) on arbitrary, truncated or oversized input.
//!
//! All integers are little-endian. Every handshake message has a fixed size, so a peer can make
//! us read at most [`HELLO_LEN`] bytes before it has been checked, whatever it sends.
//!
//! The shared secret ([`proof`]) admits ranks. With sealing on ([`Hello::sealed`]), the
//! handshake also yields one key per direction ([`seal_keys`]) under which every frame after it
//! is encrypted and authenticated (`seal.rs`); without it those frames, like the store's keys,
//! are neither encrypted nor authenticated: run dist on a trusted network, or over WireGuard or
//! IPsec.

use hmac::{Hmac, Mac};
use sha2::Sha256;

mod table;
pub use table::{
    TableHead, decode_table_entries, decode_table_head, encode_table, encode_table_part,
};

/// The first eight bytes of every handshake message.
pub const MAGIC: [u8; 8] = *b"dist\0tcp";
/// The protocol version this build speaks (10: a lazily formed job's connections carry no
/// shared-memory offers).
pub const PROTOCOL_VERSION: u16 = 10;
/// The shortest shared secret accepted, in bytes: a proof on the wire lets whoever saw it test
/// guesses offline, so the secret must be too long to guess.
pub const MIN_SECRET_LEN: usize = 16;
/// Length of a random nonce and of an HMAC-SHA256 proof.
pub const NONCE_LEN: usize = 32;
/// Length of a [`Hello`].
pub const HELLO_LEN: usize = 64;
/// Longest reason text a [`Reply`] carries.
pub const REASON_LEN: usize = 128;
/// Length of a [`Reply`].
pub const REPLY_LEN: usize = 8 + 4 + NONCE_LEN + NONCE_LEN + 2 + REASON_LEN;
/// Length of a [`FrameHeader`].
pub const FRAME_HEADER_LEN: usize = 40;
/// Length of one rank's entry in the rendezvous table.
pub const TABLE_ENTRY_LEN: usize = 19;
/// Length of the rendezvous table's fixed part ([`TableHead`]).
pub const TABLE_HEAD_LEN: usize = 8 + 8 + 4 + 4 + 4;

/// Why a connection sends its [`Hello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Purpose {
    /// A rank joining the job through rank 0.
    Rendezvous = 1,
    /// A rank connecting to a lower rank to complete the full mesh.
    Mesh = 2,
}

/// The first message of every connection, from the connecting side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// Why it connects.
    pub purpose: Purpose,
    /// Whether the sender is configured with a shared secret.
    pub has_secret: bool,
    /// Whether the sender seals the connection's frames (it then has a secret too): both sides
    /// must agree, and the flag is covered by the proofs, so no one on the path can clear it.
    pub sealed: bool,
    /// The world size the sender was started with.
    pub world_size: u32,
    /// The rank the sender claims.
    pub rank: u32,
    /// The port of the sender's own listener (rendezvous only; 0 otherwise).
    pub listen_port: u16,
    /// The job id handed out by rank 0 (mesh only; 0 otherwise).
    pub job_id: u64,
    /// The sender's random nonce.
    pub nonce: [u8; NONCE_LEN],
}

/// A malformed handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the message needs.
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes given.
        got: usize,
    },
    /// The message does not start with [`MAGIC`]: not a dist peer.
    BadMagic([u8; 8]),
    /// A field has a value this version does not know.
    BadField(&'static str, u64),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Truncated { need, got } => {
                write!(f, "truncated message: need {need} bytes, got {got}")
            }
            DecodeError::BadMagic(m) => write!(
                f,
                "not a dist peer: first bytes {:?} are not the magic {:?}",
                String::from_utf8_lossy(m),
                String::from_utf8_lossy(&MAGIC)
            ),
            DecodeError::BadField(name, v) => write!(f, "invalid {name} {v}"),
        }
    }
}

fn need(buf: &[u8], n: usize) -> Result<(), DecodeError> {
    if buf.len() < n {
        Err(DecodeError::Truncated {
            need: n,
            got: buf.len(),
        })
    } else {
        Ok(())
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn check_magic(buf: &[u8]) -> Result<(), DecodeError> {
    need(buf, 8)?;
    let m: [u8; 8] = buf[..8].try_into().expect("8 bytes");
    if m != MAGIC {
        return Err(DecodeError::BadMagic(m));
    }
    Ok(())
}

impl Hello {
    /// Encodes the message.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10] = self.purpose as u8;
        b[11] = u8::from(self.has_secret) | (u8::from(self.sealed) << 1);
        b[12..16].copy_from_slice(&self.world_size.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..22].copy_from_slice(&self.listen_port.to_le_bytes());
        b[24..32].copy_from_slice(&self.job_id.to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes the message; the version is returned as sent and checked by the caller, so that a
    /// newer peer gets a refusal that names both versions.
    pub fn decode(buf: &[u8]) -> Result<Hello, DecodeError> {
        check_magic(buf)?;
        need(buf, HELLO_LEN)?;
        let purpose = match buf[10] {
            1 => Purpose::Rendezvous,
            2 => Purpose::Mesh,
            p => return Err(DecodeError::BadField("purpose", p.into())),
        };
        // Bit 0: a secret; bit 1: sealed, which needs a secret.
        let (has_secret, sealed) = match buf[11] {
            0 => (false, false),
            1 => (true, false),
            3 => (true, true),
            f => return Err(DecodeError::BadField("flags", f.into())),
        };
        // Reserved bytes must be zero, so that every accepted hello is exactly what its fields
        // encode to: the proof covers the fields, so nothing unchecked rides along.
        let reserved = u16_at(buf, 22);
        if reserved != 0 {
            return Err(DecodeError::BadField("reserved", reserved.into()));
        }
        Ok(Hello {
            version: u16_at(buf, 8),
            purpose,
            has_secret,
            sealed,
            world_size: u32_at(buf, 12),
            rank: u32_at(buf, 16),
            listen_port: u16_at(buf, 20),
            job_id: u64_at(buf, 24),
            nonce: buf[32..64].try_into().expect("32 bytes"),
        })
    }
}

/// Why a connection is refused: the code a [`Reply`] carries on the wire (0 means go on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Refusal {
    /// Not a dist peer.
    BadMagic = 1,
    /// Another protocol version.
    Version = 2,
    /// Another world size.
    WorldSize = 3,
    /// A rank outside the range this listener accepts.
    RankOutOfRange = 4,
    /// The rank has already joined.
    DuplicateRank = 5,
    /// One side has a shared secret and the other has none.
    SecretConfig = 6,
    /// The proof of the shared secret is wrong.
    WrongSecret = 7,
    /// A mesh connection from another job.
    WrongJob = 8,
    /// A malformed message or one for another purpose.
    Protocol = 9,
    /// The job is aborting: another rank failed to initialise.
    Abort = 10,
    /// Both ranks of a pair dialed each other after formation and the lower rank's connection
    /// wins: the higher rank's is refused with this code, and that rank waits for the lower
    /// rank's connection instead of failing (protocol version 6).
    Crossed = 11,
    /// One side seals its connections and the other does not.
    SealConfig = 12,
}

impl Refusal {
    fn from_code(c: u32) -> Option<Refusal> {
        use Refusal::*;
        [
            BadMagic,
            Version,
            WorldSize,
            RankOutOfRange,
            DuplicateRank,
            SecretConfig,
            WrongSecret,
            WrongJob,
            Protocol,
            Abort,
            Crossed,
            SealConfig,
        ]
        .into_iter()
        .find(|r| *r as u32 == c)
    }
}

/// The server's answer to a [`Hello`], and its final verdict after the proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// `None` to go on; otherwise why the connection is refused.
    pub refusal: Option<Refusal>,
    /// The server's nonce.
    pub nonce: [u8; NONCE_LEN],
    /// The server's proof of the shared secret (zeros without one).
    pub proof: [u8; NONCE_LEN],
    /// A human-readable reason for a refusal.
    pub reason: String,
}

fn put_reason(dst: &mut [u8], reason: &str) {
    // Cut at a character boundary so that the text stays valid UTF-8.
    let mut n = reason.len().min(REASON_LEN);
    while !reason.is_char_boundary(n) {
        n -= 1;
    }
    dst[..2].copy_from_slice(&(n as u16).to_le_bytes());
    dst[2..2 + n].copy_from_slice(&reason.as_bytes()[..n]);
}

fn get_reason(src: &[u8]) -> Result<String, DecodeError> {
    let n = u16_at(src, 0) as usize;
    if n > REASON_LEN {
        return Err(DecodeError::BadField("reason length", n as u64));
    }
    Ok(String::from_utf8_lossy(&src[2..2 + n]).into_owned())
}

impl Reply {
    /// An acceptance carrying the server's nonce and proof.
    pub fn accept(nonce: [u8; NONCE_LEN], proof: [u8; NONCE_LEN]) -> Reply {
        Reply {
            refusal: None,
            nonce,
            proof,
            reason: String::new(),
        }
    }

    /// A refusal.
    pub fn refuse(why: Refusal, reason: impl Into<String>) -> Reply {
        Reply {
            refusal: Some(why),
            nonce: [0; NONCE_LEN],
            proof: [0; NONCE_LEN],
            reason: reason.into(),
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let mut b = [0u8; REPLY_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.refusal.map_or(0, |r| r as u32).to_le_bytes());
        b[12..44].copy_from_slice(&self.nonce);
        b[44..76].copy_from_slice(&self.proof);
        put_reason(&mut b[76..], &self.reason);
        b
    }

    /// Decodes the message.
    pub fn decode(buf: &[u8]) -> Result<Reply, DecodeError> {
        check_magic(buf)?;
        need(buf, REPLY_LEN)?;
        let code = u32_at(buf, 8);
        let refusal = match code {
            0 => None,
            c => {
                Some(Refusal::from_code(c).ok_or(DecodeError::BadField("refusal code", c.into()))?)
            }
        };
        Ok(Reply {
            refusal,
            nonce: buf[12..44].try_into().expect("32 bytes"),
            proof: buf[44..76].try_into().expect("32 bytes"),
            reason: get_reason(&buf[76..])?,
        })
    }
}

/// The frame kind reserved for `PeerDied`, rank 0 relaying a rank's death to the ranks that
/// were never connected to it (lazy connections, the peer layer's side). A version-6 build that
/// does not know it yet treats it as an unknown kind, as every other unassigned number.
pub const FRAME_KIND_PEER_DIED: u32 = 4;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum FrameKind {
    /// A message for a receiver.
    Data = 1,
    /// The sender's collective failed; the payload is its error text.
    Abort = 2,
    /// The sender is alive: no payload; the meta says where it is: bytes 0..8 (little-endian)
    /// its latest collective's sequence number (0: none yet), byte 8 flags
    /// ([`HEARTBEAT_CLOSING`], [`HEARTBEAT_ASK`]), byte 9 that collective's state (1 queued,
    /// 2 started, 3 done, 4 failed), byte 10 its kind ([`dist_core::collectives::Kind`]); bytes
    /// 11..16 the same for the calls made beside the backend (a `HybridBackend`'s NCCL calls):
    /// the low 24 bits of the sequence number (little-endian), the state, the kind.
    Heartbeat = 3,
}

/// A heartbeat flag: the sender is closing its backend normally; its connection ending next is
/// no fault.
pub const HEARTBEAT_CLOSING: u8 = 1;

/// A heartbeat flag: the sender asks for a heartbeat back at once (it is gathering where every
/// rank is, for an error).
pub const HEARTBEAT_ASK: u8 = 2;

/// The header in front of every message after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The message's tag ([`dist_core::Tag::to_wire`]).
    pub tag: u64,
    /// Payload length in bytes.
    pub len: u64,
    /// Sixteen bytes for the layer above: the collectives put their call descriptor here.
    pub meta: [u8; 16],
}

/// A malformed frame header: the stream can no longer be trusted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// An unknown kind.
    Kind(u32),
    /// Reserved flag bits set.
    Flags(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Kind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::Flags(x) => write!(f, "reserved frame flags {x:#x} set"),
        }
    }
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[..4].copy_from_slice(&(self.kind as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..40].copy_from_slice(&self.meta);
        b
    }

    /// Decodes a header.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> Result<FrameHeader, FrameError> {
        let kind = match u32_at(b, 0) {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Heartbeat,
            k => return Err(FrameError::Kind(k)),
        };
        let flags = u32_at(b, 4);
        if flags != 0 {
            return Err(FrameError::Flags(flags));
        }
        Ok(FrameHeader {
            kind,
            tag: u64_at(b, 8),
            len: u64_at(b, 16),
            meta: b[24..40].try_into().expect("16 bytes"),
        })
    }
}

/// Which side of the handshake computes a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The connecting rank.
    Client,
    /// The accepting rank.
    Server,
}

fn keyed(
    secret: &[u8],
    side: Side,
    hello: &Hello,
    server_rank: u32,
    server_nonce: &[u8; NONCE_LEN],
) -> Hmac<Sha256> {
    // HMAC takes keys of any length (long ones are hashed), so this never fails.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(match side {
        Side::Client => b"dist/tcp client proof v3",
        Side::Server => b"dist/tcp server proof v3",
    });
    // Every field of the hello, as sent (the magic is constant), then the listener's rank and
    // its nonce: a proof holds for this one connection, claim and listener only.
    mac.update(&hello.encode()[8..]);
    mac.update(&server_rank.to_le_bytes());
    mac.update(server_nonce);
    mac
}

/// The HMAC-SHA256 proof that `side` knows `secret`, bound to every field of the `hello` (the
/// version, purpose, secret flag, world size, claimed rank, listen port, job id and the
/// client's nonce), to the rank of the listening side and to its nonce, so it cannot be
/// replayed on another connection, for another claim, or against another listener. The secret
/// itself never crosses the wire.
///
/// The connecting side proves first; the listener sends its own proof only after checking that
/// one (see `init.rs`), so a stranger never gets a proof to test guesses against.
pub fn proof(
    secret: &[u8],
    side: Side,
    hello: &Hello,
    server_rank: u32,
    server_nonce: &[u8; NONCE_LEN],
) -> [u8; 32] {
    keyed(secret, side, hello, server_rank, server_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a proof in constant time.
pub fn verify_proof(
    secret: &[u8],
    side: Side,
    hello: &Hello,
    server_rank: u32,
    server_nonce: &[u8; NONCE_LEN],
    got: &[u8; NONCE_LEN],
) -> bool {
    keyed(secret, side, hello, server_rank, server_nonce)
        .verify_slice(got)
        .is_ok()
}

/// Length of a sealing key (AES-256).
pub const SEAL_KEY_LEN: usize = 32;

/// The keys of a sealed connection, one per direction: (client to server, server to client).
/// An HMAC-SHA256 of the handshake (every field of the `hello`, the client's nonce among them,
/// the listener's rank and its nonce) under the secret gives a key for this one connection
/// (the extract step of HKDF, RFC 5869); one HMAC under that key per direction, each with its
/// own label, gives the two keys (the expand step). Both nonces are fresh, so no two
/// connections share a key, even between the same two ranks; the labels differ from the
/// proofs', so a proof seen on the wire says nothing of a key.
pub fn seal_keys(
    secret: &[u8],
    hello: &Hello,
    server_rank: u32,
    server_nonce: &[u8; NONCE_LEN],
) -> ([u8; SEAL_KEY_LEN], [u8; SEAL_KEY_LEN]) {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"dist/tcp seal keys v1");
    mac.update(&hello.encode()[8..]);
    mac.update(&server_rank.to_le_bytes());
    mac.update(server_nonce);
    let prk = mac.finalize().into_bytes();
    let expand = |label: &[u8]| -> [u8; SEAL_KEY_LEN] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&prk).expect("a 32-byte key");
        m.update(label);
        m.update(&[1]);
        m.finalize().into_bytes().into()
    };
    (expand(b"client to server"), expand(b"server to client"))
}

#[cfg(test)]
mod tests;
