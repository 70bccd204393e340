//! Sealed connections: with sealing on, every byte a rank writes to a TCP connection after the
//! handshake goes out in records that AES-256-GCM encrypts and authenticates, under the key of
//! that direction of that connection (`wire::seal_keys`, from the handshake), and the reader
//! hands nothing of a record on before its tag is checked.
//!
//! A record is its head (the length of its text, 4 bytes little-endian, at most
//! [`RECORD_MAX`]), the encrypted text, and the 16-byte tag; the head is the AEAD's associated
//! data. The nonce is the record's number in its direction (from 0, 8 bytes little-endian and
//! 4 zero bytes): a record replayed, dropped or moved is opened under another number than it was
//! sealed with and fails its check as a forged one does. A stream that ends inside a record is
//! an error, one that ends between records ends as a plain one does (the frame layer above
//! tells a frame cut short). Each check names the peer and the record.
//!
//! What a peer (or anyone on the path) can make the reader hold before a check: one record,
//! [`RECORD_MAX`] bytes and its head and tag; a longer head is an error before anything more is
//! read.

use std::io::{Error, ErrorKind, IoSlice};

use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Tag};

mod table;
#[cfg(test)]
mod tests;

pub(crate) use table::{Keys, remember, take};

/// The most text one record carries: large enough that the tag, the head and the per-record
/// work are a small part of a bulk transfer, small enough to bound what the reader holds.
pub(crate) const RECORD_MAX: usize = 64 << 10;
/// A record's head: the length of its text.
pub(crate) const HEAD_LEN: usize = 4;
/// A record's tag.
pub(crate) const TAG_LEN: usize = 16;
/// The reader's buffer at first (it doubles up to one whole record as records need it): a quiet
/// connection's records are heartbeats and small messages.
const OPEN_BUF_MIN: usize = 4 << 10;
/// The reader's buffer at most: one record, whole.
const OPEN_BUF_MAX: usize = HEAD_LEN + RECORD_MAX + TAG_LEN;

/// The nonce of record `n`.
fn nonce(n: u64) -> aes_gcm::Nonce<aes_gcm::aead::consts::U12> {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&n.to_le_bytes());
    b.into()
}

/// The writing side: seals the bytes of frames into records, one at a time, and keeps the
/// record until it is all written.
pub(crate) struct Sealer {
    aead: Aes256Gcm,
    /// The number of the next record.
    next: u64,
    /// The sealed record being written (empty: none).
    out: Vec<u8>,
    /// How much of `out` is written.
    sent: usize,
}

impl Sealer {
    pub(crate) fn new(key: &[u8; 32]) -> Sealer {
        Sealer {
            aead: Aes256Gcm::new(key.into()),
            next: 0,
            out: Vec::new(),
            sent: 0,
        }
    }

    /// The part of the sealed record not yet written.
    pub(crate) fn pending(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    /// `n` more bytes of the record are written.
    pub(crate) fn advance(&mut self, n: usize) {
        self.sent += n;
        if self.sent >= self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
    }

    /// Seals the first bytes of `bufs`, up to [`RECORD_MAX`], into the next record and returns
    /// how many it took (0 for none). The record before must be all written.
    pub(crate) fn seal(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        debug_assert!(self.pending().is_empty(), "a record is still being written");
        let n = bufs.iter().map(|b| b.len()).sum::<usize>().min(RECORD_MAX);
        if n == 0 {
            return Ok(0);
        }
        // A nonce is never used twice under one key: after 2^64 - 1 records (far more than any
        // connection carries) the connection ends instead.
        let Some(after) = self.next.checked_add(1) else {
            return Err(Error::other(
                "sealed connection exhausted its record numbers",
            ));
        };
        self.out.clear();
        self.sent = 0;
        self.out.reserve(HEAD_LEN + n + TAG_LEN);
        self.out.extend_from_slice(&(n as u32).to_le_bytes());
        let mut left = n;
        for b in bufs {
            let k = b.len().min(left);
            self.out.extend_from_slice(&b[..k]);
            left -= k;
            if left == 0 {
                break;
            }
        }
        let (head, text) = self.out.split_at_mut(HEAD_LEN);
        let tag = self
            .aead
            .encrypt_in_place_detached(&nonce(self.next), head, text)
            // AES-GCM refuses only texts longer than 64 GiB; a record is at most RECORD_MAX.
            .map_err(|_| Error::other("sealing a record failed"))?;
        self.out.extend_from_slice(&tag);
        self.next = after;
        Ok(n)
    }
}

/// The reading side: reads records, checks and opens each whole one, and hands on only the
/// text of records that passed.
pub(crate) struct Opener {
    aead: Aes256Gcm,
    /// The peer's rank, for errors.
    peer: usize,
    /// The number the next record must have been sealed with.
    next: u64,
    buf: Box<[u8]>,
    /// Opened text not yet handed on: `buf[text.0..text.1]`.
    text: (usize, usize),
    /// Bytes read and not yet opened: `buf[raw.0..raw.1]`.
    raw: (usize, usize),
    /// Why the stream failed its check: every later read fails alike.
    failed: Option<String>,
}

impl Opener {
    pub(crate) fn new(key: &[u8; 32], peer: usize) -> Opener {
        Opener {
            aead: Aes256Gcm::new(key.into()),
            peer,
            next: 0,
            buf: vec![0u8; OPEN_BUF_MIN].into_boxed_slice(),
            text: (0, 0),
            raw: (0, 0),
            failed: None,
        }
    }

    /// Opened text is waiting to be handed on.
    pub(crate) fn has_text(&self) -> bool {
        self.text.0 < self.text.1
    }

    /// A read would hand text on without reading the stream: text is opened, or a whole record
    /// waits to be opened (the stream's readiness tells of neither).
    pub(crate) fn ready(&self) -> bool {
        let (lo, hi) = self.raw;
        self.has_text()
            || self.buf[lo..hi]
                .first_chunk::<HEAD_LEN>()
                .is_some_and(|h| hi - lo >= HEAD_LEN + u32::from_le_bytes(*h) as usize + TAG_LEN)
    }

    /// Bytes read from the stream and not yet handed on (opened or not).
    pub(crate) fn held(&self) -> usize {
        (self.text.1 - self.text.0) + (self.raw.1 - self.raw.0)
    }

    fn fail(&mut self, why: String) -> Error {
        tracing::warn!(peer = self.peer, "{why}");
        self.failed = Some(why.clone());
        Error::new(ErrorKind::InvalidData, why)
    }

    /// The length of the text of the record that starts the unread bytes, once its head is in.
    fn record_len(&mut self) -> std::io::Result<Option<usize>> {
        let (lo, hi) = self.raw;
        if hi - lo < HEAD_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes(self.buf[lo..lo + HEAD_LEN].try_into().expect("4 bytes"));
        let len = len as usize;
        if len == 0 || len > RECORD_MAX {
            return Err(self.fail(format!(
                "sealed record {} from rank {} claims {len} bytes of text (1 to {RECORD_MAX} \
                 allowed): forged or corrupted on the wire",
                self.next, self.peer
            )));
        }
        Ok(Some(len))
    }

    /// Reads into `dst` without blocking the text of records that passed their check, reading
    /// the stream with `read` (which returns `WouldBlock` when nothing is there, `Ok(0)` at the
    /// end of the stream). `Ok(0)` at the end of the stream between records; an error for a
    /// record that fails its check or a stream that ends inside one.
    pub(crate) fn read(
        &mut self,
        read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>,
        dst: &mut [u8],
    ) -> std::io::Result<usize> {
        if let Some(why) = &self.failed {
            return Err(Error::new(ErrorKind::InvalidData, why.clone()));
        }
        loop {
            if self.has_text() {
                let (lo, hi) = self.text;
                let n = dst.len().min(hi - lo);
                dst[..n].copy_from_slice(&self.buf[lo..lo + n]);
                self.text.0 += n;
                return Ok(n);
            }
            if dst.is_empty() {
                return Ok(0);
            }
            let need = match self.record_len()? {
                Some(len) => HEAD_LEN + len + TAG_LEN,
                None => HEAD_LEN,
            };
            if self.raw.1 - self.raw.0 >= need && need > HEAD_LEN {
                self.open(need)?;
                continue;
            }
            self.make_room(need);
            let (lo, hi) = self.raw;
            match read(&mut self.buf[hi..]) {
                Ok(0) if lo == hi => return Ok(0),
                Ok(0) => {
                    let why = format!(
                        "the connection from rank {} ended inside sealed record {} ({} of {} \
                         bytes): truncated on the wire",
                        self.peer,
                        self.next,
                        hi - lo,
                        need.max(hi - lo)
                    );
                    return Err(self.fail(why));
                }
                Ok(k) => self.raw.1 += k,
                Err(e) => return Err(e),
            }
        }
    }

    /// Room after the unread bytes for a record of `need` bytes in all: the unread bytes moved
    /// to the front, the buffer grown (up to one whole record).
    fn make_room(&mut self, need: usize) {
        let (lo, hi) = self.raw;
        if self.buf.len() < need {
            let mut bigger = vec![0u8; need.max(self.buf.len() * 2).min(OPEN_BUF_MAX)];
            bigger[..hi - lo].copy_from_slice(&self.buf[lo..hi]);
            self.buf = bigger.into_boxed_slice();
            self.raw = (0, hi - lo);
        } else if lo + need > self.buf.len() || hi == self.buf.len() {
            self.buf.copy_within(lo..hi, 0);
            self.raw = (0, hi - lo);
        }
    }

    /// Checks and opens the record of `total` bytes that starts the unread bytes.
    fn open(&mut self, total: usize) -> std::io::Result<()> {
        let lo = self.raw.0;
        let len = total - HEAD_LEN - TAG_LEN;
        let (head, rest) = self.buf[lo..lo + total].split_at_mut(HEAD_LEN);
        let (text, tag) = rest.split_at_mut(len);
        let tag = Tag::clone_from_slice(tag);
        if self
            .aead
            .decrypt_in_place_detached(&nonce(self.next), head, text, &tag)
            .is_err()
        {
            let why = format!(
                "sealed record {} from rank {} ({len} bytes of text) failed its check: forged, \
                 replayed, reordered or corrupted on the wire; nothing of it was delivered",
                self.next, self.peer
            );
            return Err(self.fail(why));
        }
        self.next += 1;
        self.text = (lo + HEAD_LEN, lo + HEAD_LEN + len);
        self.raw.0 = lo + total;
        Ok(())
    }
}
