//! The small areas of a host arena's segment (`arena_map.rs`): what one rank writes, with its
//! word and descriptor, the other reads at any offset and length; accesses out of range and
//! writes to a peer's read-only mapping are refused, nothing written.

use dist_core::transport::HostArena;

use super::super::arena::ArenaSetup;
use super::super::pidfd::PeerProcess;
use super::{Mapping, Refused, SMALL_DATA};

/// Every offset and length near the words' edges reads back what was written, on the owner's
/// mapping and on a peer's read-only one; the word comes last.
#[test]
fn small_areas_round_trip() {
    let (fd, own) = Mapping::create(4 << 10, 0, (0, 1)).unwrap();
    let peer = Mapping::open(&fd, 4 << 10, 0).unwrap();
    let data: Vec<u8> = (0..SMALL_DATA).map(|i| (i * 7 + 3) as u8).collect();
    for (area, len) in [(0, 1), (1, 13), (0, 32), (1, 33), (0, SMALL_DATA)] {
        let seq = 11 + area as u32 + len as u32;
        own.small_put(area, seq, [area as u8 + 1; 16], &data[..len])
            .unwrap();
        for m in [&own, &peer] {
            assert_eq!(m.small_seq(area), seq);
            assert_eq!(m.small_meta(area), [area as u8 + 1; 16]);
            for (at, n) in [
                (0, len),
                (1, len - 1),
                (len / 2, len - len / 2),
                (len - 1, 1),
            ] {
                let mut out = vec![0u8; n];
                m.small_read(area, at, &mut out).unwrap();
                assert_eq!(
                    out,
                    data[at..at + n],
                    "area {area}, {n} bytes at {at} of {len}"
                );
            }
        }
    }
    // The other area keeps its own word.
    assert_eq!(peer.small_seq(0), 11 + SMALL_DATA as u32);
    assert_eq!(peer.small_seq(1), 11 + 1 + 33);
}

#[test]
fn small_accesses_out_of_range_are_refused() {
    let (fd, own) = Mapping::create(4 << 10, 0, (0, 1)).unwrap();
    let peer = Mapping::open(&fd, 4 << 10, 0).unwrap();
    let big = vec![1u8; SMALL_DATA + 1];
    assert_eq!(own.small_put(0, 5, [0; 16], &big), Err(Refused::OutOfRange));
    assert_eq!(own.small_put(2, 5, [0; 16], b"x"), Err(Refused::OutOfRange));
    assert_eq!(
        peer.small_put(0, 5, [0; 16], b"x"),
        Err(Refused::OutOfRange)
    );
    assert_eq!(own.small_seq(0), 0, "nothing written");
    let mut out = [0u8; 2];
    assert_eq!(
        peer.small_read(0, SMALL_DATA - 1, &mut out),
        Err(Refused::OutOfRange)
    );
    assert_eq!(
        peer.small_read(0, usize::MAX, &mut out),
        Err(Refused::OutOfRange)
    );
    assert_eq!(peer.small_read(2, 0, &mut out), Err(Refused::OutOfRange));
    assert_eq!((peer.small_seq(2), peer.small_meta(2)), (0, [0; 16]));
}

/// Through the arena of two ranks: a write of one is read by the other; a rank not on the host
/// and a range out of bounds are errors naming the rank.
#[test]
fn the_arena_passes_small_areas_on() {
    let host = Some([9u8; 32]);
    let (a, b) = (ArenaSetup::new(0, 2, host), ArenaSetup::new(1, 2, host));
    for (x, y, peer) in [(&a, &b, 1), (&b, &a, 0)] {
        x.note_host(peer, host);
        assert!(x.map_peer(peer, y.fd().unwrap(), PeerProcess::open(std::process::id())));
        y.note_mapped_mine(1 - peer);
    }
    let spin = std::time::Duration::ZERO;
    let (a, b) = (
        a.finish(Vec::new(), spin, None, 1),
        b.finish(Vec::new(), spin, None, 1),
    );
    assert_eq!(a.small_len(), SMALL_DATA);
    a.put_small(1, 9, [3; 16], b"small input").unwrap();
    assert_eq!((b.small_seq(0, 1), b.small_meta(0, 1)), (9, [3; 16]));
    let mut out = [0u8; 5];
    b.read_small(0, 1, 6, &mut out).unwrap();
    assert_eq!(&out, b"input");
    let e = b.read_small(0, 1, SMALL_DATA, &mut out).unwrap_err();
    assert!(e.to_string().contains("small area 1 of rank 0"), "{e}");
    let e = b.read_small(5, 0, 0, &mut out).unwrap_err();
    assert!(e.to_string().contains("rank 5"), "{e}");
    assert!(
        a.put_small(0, 1, [0; 16], &vec![0u8; SMALL_DATA + 1])
            .is_err()
    );
}
