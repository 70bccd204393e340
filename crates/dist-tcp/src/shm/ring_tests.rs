//! Tests of the ring over two mappings of one memfd (as the two processes map it), and of a
//! third mapping playing a hostile peer that writes the header.

use std::io::IoSlice;
use std::os::fd::OwnedFd;
use std::time::Instant;

use super::*;
use crate::shm::map::{HEADER, MIN_CAP, OFF_HEAD, OFF_TAIL};

const CAP: u64 = MIN_CAP;

fn pair(cap: u64) -> (TxRing, RxRing, OwnedFd) {
    let (fd, seg) = Segment::create(cap).unwrap();
    let rx = Segment::open(&fd, cap).unwrap();
    (TxRing::new(seg, cap, 1), RxRing::new(rx, cap, 0), fd)
}

fn write_all(tx: &mut TxRing, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        let (n, _) = tx.write_some(&[IoSlice::new(bytes)]).unwrap();
        assert!(n > 0, "ring full");
        bytes = &bytes[n..];
    }
}

/// Bytes written across the end of the ring come out whole and in order, many times round.
#[test]
fn bytes_wrap_around_the_end_in_order() {
    let (mut tx, mut rx, _fd) = pair(CAP);
    let mut next = 0u8;
    let mut expect = 0u8;
    // Pieces of a size that does not divide the capacity, so every wrap splits a piece.
    for round in 0..50 {
        let piece: Vec<u8> = (0..1000 + round)
            .map(|_| {
                next = next.wrapping_add(1);
                next
            })
            .collect();
        write_all(&mut tx, &piece);
        let mut out = vec![0u8; piece.len()];
        let mut got = 0;
        while got < out.len() {
            got += rx.read(&mut out[got..]).unwrap();
        }
        for b in out {
            expect = expect.wrapping_add(1);
            assert_eq!(b, expect);
        }
    }
    assert!(tx.tail > 10 * CAP, "went round the ring");
    assert_eq!(rx.read(&mut [0u8; 8]).unwrap(), 0);
}

/// A vectored write fills the ring and no more; the rest goes once the consumer reads.
#[test]
fn a_full_ring_takes_nothing_more() {
    let (mut tx, mut rx, _fd) = pair(CAP);
    let a = vec![1u8; 3000];
    let b = vec![2u8; 3000];
    let (n, _) = tx
        .write_some(&[IoSlice::new(&a), IoSlice::new(&b)])
        .unwrap();
    assert_eq!(n as u64, CAP);
    assert_eq!(tx.write_some(&[IoSlice::new(&b)]).unwrap(), (0, false));
    let mut out = vec![0u8; 100];
    assert_eq!(rx.read(&mut out).unwrap(), 100);
    assert_eq!(tx.write_some(&[IoSlice::new(&b)]).unwrap().0, 100);
}

/// A producer waiting for room on a full ring returns at its limit (not before, not long
/// after) when nobody reads.
#[test]
fn waiting_on_a_full_ring_ends_at_the_limit() {
    let (mut tx, _rx, _fd) = pair(CAP);
    write_all(&mut tx, &vec![0u8; CAP as usize]);
    let t = Instant::now();
    tx.wait_room(Duration::from_millis(100)).unwrap();
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(90) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    assert_eq!(tx.room(&String::new).unwrap(), 0);
}

/// A producer asleep on a full ring is woken by the consumer's read, long before its limit.
#[test]
fn a_read_wakes_the_waiting_producer() {
    let (mut tx, mut rx, _fd) = pair(CAP);
    write_all(&mut tx, &vec![0u8; CAP as usize]);
    std::thread::scope(|s| {
        let waiter = s.spawn(move || {
            let t = Instant::now();
            while tx.room(&String::new).unwrap() == 0 && t.elapsed() < Duration::from_secs(20) {
                tx.wait_room(Duration::from_secs(20)).unwrap();
            }
            (tx.room(&String::new).unwrap(), t.elapsed())
        });
        // Read once the producer is asleep (either order is correct: a read before it sleeps
        // leaves room it sees before sleeping).
        while tx_waiting(&rx) == 0 && !waiter.is_finished() {
            std::thread::yield_now();
        }
        assert_eq!(rx.read(&mut [0u8; 64]).unwrap(), 64);
        let (room, waited) = waiter.join().unwrap();
        assert_eq!(room, 64);
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    });
}

fn tx_waiting(rx: &RxRing) -> u32 {
    rx.seg.u32_at(OFF_TX_WAITING).load(Ordering::SeqCst)
}

/// The doorbell: a consumer that armed is owed exactly one ring by the next write; one that
/// did not, none; and arming with bytes already there says so.
#[test]
fn an_armed_consumer_gets_one_doorbell() {
    let (mut tx, mut rx, _fd) = pair(CAP);
    assert!(!rx.arm().unwrap());
    assert_eq!(tx.write_some(&[IoSlice::new(b"ab")]).unwrap(), (2, true));
    assert_eq!(tx.write_some(&[IoSlice::new(b"cd")]).unwrap(), (2, false));
    assert!(rx.arm().unwrap(), "bytes are waiting");
    assert_eq!(rx.read(&mut [0u8; 4]).unwrap(), 4);
}

/// A producer and a consumer on two threads move 64 MiB through a 4 KiB ring in pieces of
/// odd sizes, sleeping on the futex when full and spinning when empty; every byte is checked.
#[test]
fn two_threads_move_checked_bytes() {
    let (mut tx, mut rx, _fd) = pair(CAP);
    const TOTAL: u64 = 64 << 20;
    let byte = |i: u64| (i.wrapping_mul(2654435761) >> 7) as u8;
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut pos = 0u64;
            let mut piece = vec![0u8; 7919];
            let deadline = Instant::now() + Duration::from_secs(60);
            while pos < TOTAL {
                let k = piece.len().min((TOTAL - pos) as usize);
                for (j, b) in piece[..k].iter_mut().enumerate() {
                    *b = byte(pos + j as u64);
                }
                let mut off = 0;
                while off < k {
                    let (n, _) = tx.write_some(&[IoSlice::new(&piece[off..k])]).unwrap();
                    if n == 0 {
                        assert!(Instant::now() < deadline, "producer stuck");
                        tx.wait_room(Duration::from_millis(50)).unwrap();
                    }
                    off += n;
                }
                pos += k as u64;
            }
        });
        let mut pos = 0u64;
        let mut buf = vec![0u8; 5003];
        let deadline = Instant::now() + Duration::from_secs(60);
        while pos < TOTAL {
            let n = rx.read(&mut buf).unwrap();
            if n == 0 {
                assert!(Instant::now() < deadline, "consumer stuck at {pos}");
                std::thread::yield_now();
            }
            for (j, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, byte(pos + j as u64), "byte {}", pos + j as u64);
            }
            pos += n as u64;
        }
    });
}

/// A peer that writes a position beyond the ring into the header gets an error naming this
/// rank, the peer, the operation and both positions against the capacity, on either side, and
/// nothing is copied.
#[test]
fn a_corrupt_position_is_an_error_naming_the_peer() {
    let (tx, rx, fd) = pair(CAP);
    let (mut tx, mut rx) = (tx.for_rank(0), rx.for_rank(1));
    let evil = Segment::open(&fd, CAP).unwrap();
    write_all(&mut tx, b"hello");
    // The producer's position, as the consumer reads it: far past what the ring can hold.
    evil.u64_at(OFF_TAIL).store(5 + CAP + 1, Ordering::SeqCst);
    let mut out = [7u8; 16];
    let e = rx.read(&mut out).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert_eq!(
        e.to_string(),
        format!(
            "rank 1: corrupt shared-memory ring from peer 0 while reading up to 16 bytes from \
             it: its write position {} is {} bytes ahead of this rank's read position 0; it may \
             be at most the ring's {CAP} bytes ahead",
            5 + CAP + 1,
            5 + CAP + 1
        )
    );
    assert_eq!(out, [7u8; 16], "nothing copied");
    // Behind the consumer (a position that went backwards) is as wrong.
    evil.u64_at(OFF_TAIL).store(0, Ordering::SeqCst);
    assert_eq!(rx.read(&mut out[..5]).unwrap(), 0);
    evil.u64_at(OFF_TAIL).store(5, Ordering::SeqCst);
    assert_eq!(rx.read(&mut out[..5]).unwrap(), 5);
    evil.u64_at(OFF_TAIL).store(2, Ordering::SeqCst);
    assert!(rx.read(&mut out).is_err());
    assert!(rx.arm().is_err());
    // The consumer's position, as the producer reads it.
    // Ahead of what was ever written.
    evil.u64_at(OFF_HEAD).store(15, Ordering::SeqCst);
    let e = tx.write_some(&[IoSlice::new(b"x")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "rank 0: corrupt shared-memory ring from peer 1 while writing 1 bytes to it: its \
             read position 15 is 10 bytes ahead of this rank's write position 5, which may be \
             at most the ring's {CAP} bytes ahead of it"
        )
    );
    assert!(tx.wait_room(Duration::from_millis(1)).is_err());
}

/// Random header values from the "peer" never make a read or write touch memory outside the
/// ring (the mapping is exactly header + capacity, so an access beyond would fault) or panic.
#[test]
fn random_header_values_never_fault() {
    let (mut tx, mut rx, fd) = pair(CAP);
    let evil = Segment::open(&fd, CAP).unwrap();
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut buf = vec![0u8; 3 * CAP as usize];
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = match x % 4 {
            0 => x,
            1 => x % (3 * CAP),
            2 => rx.head.wrapping_add(x % (2 * CAP)),
            _ => tx.tail.wrapping_sub(x % (2 * CAP)),
        };
        let off = if x & 0x100 == 0 { OFF_TAIL } else { OFF_HEAD };
        evil.u64_at(off).store(v, Ordering::SeqCst);
        let _ = rx.read(&mut buf);
        let _ = tx.write_some(&[IoSlice::new(&buf[..(x % 5000) as usize])]);
    }
}

/// The consumer maps only a sealed file of the offered size whose header agrees.
#[test]
fn open_refuses_what_could_fault_or_lie() {
    let (fd, _seg) = Segment::create(CAP).unwrap();
    assert!(
        Segment::open(&fd, 2 * CAP)
            .unwrap_err()
            .contains("not a file of")
    );
    assert!(
        Segment::open(&fd, CAP + 1)
            .unwrap_err()
            .contains("power of two")
    );
    // An unsealed memfd (it could shrink under the mapping).
    let raw = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&raw, HEADER as u64 + CAP).unwrap();
    assert!(Segment::open(&raw, CAP).unwrap_err().contains("sealed"));
    // Sealed, right size, but a header that is not a ring's.
    let bad = rustix::fs::memfd_create(
        "t",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&bad, HEADER as u64 + CAP).unwrap();
    rustix::fs::fcntl_add_seals(
        &bad,
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW | rustix::fs::SealFlags::SEAL,
    )
    .unwrap();
    assert!(Segment::open(&bad, CAP).unwrap_err().contains("magic"));
}

/// A peer's segment is checked for its seals before its size: an unsealed file is refused as
/// unsealed whatever its size (its size, checked first, could change before the seals were
/// looked at; a file shrunk under the mapping makes reads fault with `SIGBUS`).
#[test]
fn open_checks_the_seals_before_the_size() {
    use rustix::fs::MemfdFlags;
    let fd = rustix::fs::memfd_create("test", MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 2 * CAP).unwrap();
    let e = Segment::open(&fd, CAP).unwrap_err();
    assert!(e.contains("not sealed"), "{e}");
}

/// `wait_on` with an address that is no word of a mapping is an error, not undefined
/// behaviour: the kernel reads the word, an unmapped address is `EFAULT` and a misaligned one
/// `EINVAL`, each returned at once.
#[test]
#[cfg(target_os = "linux")]
fn a_bad_futex_address_is_an_error() {
    let limit = std::time::Duration::from_secs(5);
    let t = Instant::now();
    let e = wait_on(std::ptr::null(), 0, limit).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    let words = [0u32; 2];
    let odd = words.as_ptr().cast::<u8>().wrapping_add(1).cast::<u32>();
    let e = wait_on(odd, 0, limit).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    assert!(t.elapsed() < limit, "waited {:?}", t.elapsed());
}
