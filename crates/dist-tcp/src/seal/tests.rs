//! Unit tests of the sealing layer: records round-trip in any pieces; a record tampered with in
//! any byte, replayed, reordered or cut short is an error naming the peer and the record, and
//! nothing of it is handed on.

use std::io::{ErrorKind, IoSlice};

use super::*;

const KEY: [u8; 32] = [9; 32];
const PEER: usize = 3;

/// The records sealing `msgs`, each message sealed on its own (a message over RECORD_MAX
/// spans records): the records, one `Vec` each.
fn records(msgs: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut s = Sealer::new(&KEY);
    let mut out = Vec::new();
    for m in msgs {
        let mut bufs = [IoSlice::new(m)];
        let mut bufs = &mut bufs[..];
        while !bufs.is_empty() {
            let n = s.seal(bufs).unwrap();
            assert!(n > 0);
            IoSlice::advance_slices(&mut bufs, n);
            out.push(s.pending().to_vec());
            let left = s.pending().len();
            s.advance(left);
        }
    }
    out
}

/// Reads `stream` through an opener, `piece` bytes at a time with a `WouldBlock` between
/// pieces, into reads of at most `chunk` bytes: the text handed on, and how the stream ended.
fn open_all(stream: &[u8], piece: usize, chunk: usize) -> (Vec<u8>, std::io::Result<()>) {
    let mut o = Opener::new(&KEY, PEER);
    let mut at = 0;
    let mut ready = false;
    let mut read = |dst: &mut [u8]| -> std::io::Result<usize> {
        if !ready {
            ready = true;
            return Err(ErrorKind::WouldBlock.into());
        }
        ready = false;
        let n = dst.len().min(piece).min(stream.len() - at);
        dst[..n].copy_from_slice(&stream[at..at + n]);
        at += n;
        Ok(n)
    };
    let mut got = Vec::new();
    let mut buf = vec![0u8; chunk];
    loop {
        match o.read(&mut read, &mut buf) {
            Ok(0) => return (got, Ok(())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => {
                // A failed stream stays failed.
                let again = o.read(&mut read, &mut buf).unwrap_err();
                assert_eq!(again.to_string(), e.to_string());
                return (got, Err(e));
            }
        }
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn records_round_trip_in_any_pieces() {
    let big = pattern(RECORD_MAX * 2 + 123, 1);
    let small = pattern(40, 2);
    let msgs: [&[u8]; 3] = [&small, &big, &small];
    let recs = records(&msgs);
    assert_eq!(
        recs.len(),
        1 + 3 + 1,
        "the large message spans three records"
    );
    for r in &recs {
        let len = u32::from_le_bytes(r[..4].try_into().unwrap()) as usize;
        assert_eq!(r.len(), HEAD_LEN + len + TAG_LEN);
        assert!(len <= RECORD_MAX);
    }
    let stream = recs.concat();
    // The text is encrypted: the pattern does not show in the stream.
    assert!(!stream.windows(32).any(|w| w == &big[1000..1032]));
    let want = [&small[..], &big, &small].concat();
    for (piece, chunk) in [(1, 7), (13, 4096), (5000, 100_000), (usize::MAX, 1)] {
        let (got, end) = open_all(&stream, piece, chunk);
        end.unwrap();
        assert!(
            got == want,
            "pieces of {piece}, reads of {chunk}: the text differs"
        );
    }
}

/// Every byte of a record (its head, text and tag) is covered: one bit changed anywhere is an
/// error naming the peer and the record, and nothing of that record (or after it) is handed on.
#[test]
fn a_record_changed_in_any_byte_is_an_error_and_nothing_of_it_is_handed_on() {
    let first = pattern(100, 3);
    let second = pattern(300, 4);
    let recs = records(&[&first, &second]);
    let clean = recs.concat();
    let start = recs[0].len();
    for at in start..clean.len() {
        let mut bad = clean.clone();
        bad[at] ^= 0x10;
        let (got, end) = open_all(&bad, 64, 4096);
        let e = end.expect_err("a changed byte must fail");
        assert_eq!(e.kind(), ErrorKind::InvalidData);
        let text = e.to_string();
        assert!(
            text.contains("sealed record 1") && text.contains(&format!("rank {PEER}")),
            "byte {at}: {text}"
        );
        assert_eq!(
            got, first,
            "byte {at}: only the first record's text is handed on"
        );
    }
}

#[test]
fn a_replayed_record_is_an_error() {
    let recs = records(&[b"first message", b"second message"]);
    let replayed = [recs[0].clone(), recs[0].clone(), recs[1].clone()].concat();
    let (got, end) = open_all(&replayed, 1000, 1000);
    let e = end.unwrap_err().to_string();
    assert!(
        e.contains("sealed record 1") && e.contains("replayed"),
        "{e}"
    );
    assert_eq!(got, b"first message");
}

#[test]
fn reordered_records_are_an_error() {
    let recs = records(&[b"first message", b"second message"]);
    let swapped = [recs[1].clone(), recs[0].clone()].concat();
    let (got, end) = open_all(&swapped, 1000, 1000);
    let e = end.unwrap_err().to_string();
    assert!(
        e.contains("sealed record 0") && e.contains("reordered"),
        "{e}"
    );
    assert!(got.is_empty());
    // A record dropped from the stream is the same: the next one is out of place.
    let (got, end) = open_all(&recs[1], 1000, 1000);
    assert!(end.is_err());
    assert!(got.is_empty());
}

#[test]
fn a_stream_cut_inside_a_record_is_an_error_and_between_records_an_end() {
    let recs = records(&[b"first message", b"second message"]);
    let stream = recs.concat();
    for cut in recs[0].len() + 1..stream.len() {
        let (got, end) = open_all(&stream[..cut], 7, 1000);
        let e = end.unwrap_err().to_string();
        assert!(
            e.contains("ended inside sealed record 1") && e.contains("truncated"),
            "cut at {cut}: {e}"
        );
        assert_eq!(got, b"first message");
    }
    let (got, end) = open_all(&stream[..recs[0].len()], 7, 1000);
    end.unwrap();
    assert_eq!(got, b"first message");
}

/// A head that claims more than a record carries (or nothing) is an error before anything more
/// is read: no one on the path can make the reader hold more than one record.
#[test]
fn a_head_past_the_bound_is_an_error_before_more_is_read() {
    for len in [0u32, RECORD_MAX as u32 + 1, u32::MAX] {
        let mut stream = len.to_le_bytes().to_vec();
        stream.extend(std::iter::repeat_n(0u8, 1 << 20));
        let mut o = Opener::new(&KEY, PEER);
        let mut taken = 0usize;
        let mut read = |dst: &mut [u8]| -> std::io::Result<usize> {
            let n = dst.len().min(stream.len() - taken);
            dst[..n].copy_from_slice(&stream[taken..taken + n]);
            taken += n;
            Ok(n)
        };
        let e = o.read(&mut read, &mut [0u8; 64]).unwrap_err().to_string();
        assert!(e.contains(&format!("claims {len} bytes")), "{e}");
        assert!(taken <= OPEN_BUF_MIN, "read {taken} bytes past a bad head");
        assert!(o.buf.len() <= OPEN_BUF_MAX);
    }
}

/// Records sealed under another key (the other direction's, another connection's) fail.
#[test]
fn a_record_under_another_key_is_an_error() {
    let recs = records(&[b"hello"]);
    let mut o = Opener::new(&[8; 32], PEER);
    let mut at = 0;
    let stream = recs.concat();
    let mut read = |dst: &mut [u8]| -> std::io::Result<usize> {
        let n = dst.len().min(stream.len() - at);
        dst[..n].copy_from_slice(&stream[at..at + n]);
        at += n;
        Ok(n)
    };
    let e = o.read(&mut read, &mut [0u8; 64]).unwrap_err().to_string();
    assert!(e.contains("failed its check"), "{e}");
}
