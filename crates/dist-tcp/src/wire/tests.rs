//! Unit tests of `wire`.

use super::*;

fn hello() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        purpose: Purpose::Mesh,
        has_secret: true,
        sealed: false,
        world_size: 5,
        rank: 3,
        listen_port: 29_501,
        job_id: 0xdead_beef,
        nonce: [7; NONCE_LEN],
    }
}

#[test]
fn hello_round_trips_and_rejects_truncation_and_garbage() {
    let h = hello();
    let b = h.encode();
    assert_eq!(Hello::decode(&b), Ok(h));
    for n in 0..HELLO_LEN {
        assert!(Hello::decode(&b[..n]).is_err(), "decoded {n} bytes");
    }
    // A longer buffer decodes the first HELLO_LEN bytes only.
    let mut long = b.to_vec();
    long.extend_from_slice(&[0xff; 1000]);
    assert_eq!(Hello::decode(&long), Ok(h));
    let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
    assert!(matches!(Hello::decode(http), Err(DecodeError::BadMagic(_))));
    let mut bad = b;
    bad[10] = 9;
    assert_eq!(
        Hello::decode(&bad),
        Err(DecodeError::BadField("purpose", 9))
    );
    bad = b;
    bad[11] = 2;
    assert_eq!(Hello::decode(&bad), Err(DecodeError::BadField("flags", 2)));
}

#[test]
fn reply_and_status_round_trip_and_cut_long_reasons() {
    let r = Reply::refuse(Refusal::DuplicateRank, "rank 3 already joined");
    assert_eq!(Reply::decode(&r.encode()), Ok(r.clone()));
    let a = Reply::accept([1; NONCE_LEN], [2; NONCE_LEN]);
    assert_eq!(Reply::decode(&a.encode()), Ok(a));
    let long = "é".repeat(200);
    let d = Reply::decode(&Reply::refuse(Refusal::Protocol, long).encode()).unwrap();
    assert!(d.reason.len() <= REASON_LEN && d.reason.chars().all(|c| c == 'é'));
    let mut bad = r.encode();
    bad[8] = 99;
    assert!(Reply::decode(&bad).is_err());
    bad = r.encode();
    bad[76] = 0xff; // reason length 255 > REASON_LEN
    assert!(Reply::decode(&bad).is_err());
}

#[test]
fn table_round_trips_v4_and_v6() {
    let addrs: Vec<std::net::SocketAddr> = vec![
        "127.0.0.1:29500".parse().unwrap(),
        "[::1]:40000".parse().unwrap(),
        "10.1.2.3:1".parse().unwrap(),
    ];
    let b = encode_table(42, &addrs);
    let head = decode_table_head(&b).unwrap();
    assert_eq!(
        head,
        TableHead {
            job_id: 42,
            world: 3,
            first: 0,
            count: 3
        }
    );
    assert!(head.is_whole());
    assert_eq!(
        decode_table_entries(&b[TABLE_HEAD_LEN..], 3).unwrap(),
        addrs
    );
    assert!(decode_table_entries(&b[TABLE_HEAD_LEN..b.len() - 1], 3).is_err());
    assert!(decode_table_head(&b[..10]).is_err());
}

/// A part of the table says which ranks it holds; a range past the world size is an error
/// (naming the range's end), whatever the count claims, and nothing overflows.
#[test]
fn table_parts_round_trip_and_ranges_past_the_world_are_errors() {
    let a: std::net::SocketAddr = "10.0.0.7:4242".parse().unwrap();
    let b = encode_table_part(9, 1024, 513, &[a]);
    let head = decode_table_head(&b).unwrap();
    assert_eq!(
        head,
        TableHead {
            job_id: 9,
            world: 1024,
            first: 513,
            count: 1
        }
    );
    assert!(!head.is_whole());
    assert_eq!(
        decode_table_entries(&b[TABLE_HEAD_LEN..], 1).unwrap(),
        vec![a]
    );
    let mut bad = encode_table_part(9, 4, 3, &[a]);
    bad[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        decode_table_head(&bad),
        Err(DecodeError::BadField(
            "table range end",
            3 + u64::from(u32::MAX)
        ))
    );
    let past = encode_table_part(9, 4, 4, &[a]);
    assert_eq!(
        decode_table_head(&past),
        Err(DecodeError::BadField("table range end", 5))
    );
}

#[test]
fn frame_header_round_trips_and_rejects_unknown_kinds() {
    let h = FrameHeader {
        kind: FrameKind::Data,
        tag: u64::MAX,
        len: 1 << 40,
        meta: [3; 16],
    };
    assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
    let mut b = h.encode();
    b[0] = 77;
    assert_eq!(FrameHeader::decode(&b), Err(FrameError::Kind(77)));
    b = h.encode();
    b[5] = 1;
    assert_eq!(FrameHeader::decode(&b), Err(FrameError::Flags(0x100)));
}

#[test]
fn proofs_bind_secret_side_claim_and_listener() {
    let h = hello();
    let sn = [9; NONCE_LEN];
    let key = b"0123456789abcdef";
    let p = proof(key, Side::Client, &h, 2, &sn);
    assert!(verify_proof(key, Side::Client, &h, 2, &sn, &p));
    assert!(!verify_proof(
        b"0123456789abcdeX",
        Side::Client,
        &h,
        2,
        &sn,
        &p
    ));
    assert!(!verify_proof(key, Side::Server, &h, 2, &sn, &p));
    assert!(!verify_proof(key, Side::Client, &h, 1, &sn, &p));
    assert!(!verify_proof(key, Side::Client, &h, 2, &[8; NONCE_LEN], &p));
    // Every field of the hello is inside the MAC, the listen port and version included.
    let changed: [fn(&mut Hello); 9] = [
        |h| h.version += 1,
        |h| h.purpose = Purpose::Rendezvous,
        |h| h.has_secret = false,
        |h| h.sealed = true,
        |h| h.world_size += 1,
        |h| h.rank += 1,
        |h| h.listen_port += 1,
        |h| h.job_id += 1,
        |h| h.nonce[31] ^= 1,
    ];
    for (i, change) in changed.iter().enumerate() {
        let mut h2 = h;
        change(&mut h2);
        assert!(
            !verify_proof(key, Side::Client, &h2, 2, &sn, &p),
            "field {i} is not covered by the proof"
        );
    }
}

#[test]
fn table_entries_with_a_count_that_overflows_are_an_error() {
    assert_eq!(
        decode_table_entries(&[], usize::MAX),
        Err(DecodeError::BadField("table entries", u64::MAX))
    );
}

mod props {
    use super::super::*;
    use proptest::prelude::*;

    fn any_hello() -> impl Strategy<Value = Hello> {
        (
            any::<u16>(),
            prop_oneof![Just(Purpose::Rendezvous), Just(Purpose::Mesh)],
            (any::<bool>(), any::<bool>()),
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            any::<u64>(),
            any::<[u8; NONCE_LEN]>(),
        )
            .prop_map(
                |(version, purpose, flags, world_size, rank, listen_port, job_id, nonce)| {
                    let (has_secret, seal) = flags;
                    Hello {
                        version,
                        purpose,
                        has_secret,
                        // Sealing needs a secret: a hello may not say sealed without one.
                        sealed: has_secret && seal,
                        world_size,
                        rank,
                        listen_port,
                        job_id,
                        nonce,
                    }
                },
            )
    }

    fn any_refusal() -> impl Strategy<Value = Option<Refusal>> {
        prop_oneof![
            Just(None),
            (1u32..=11).prop_map(|c| Some(Refusal::from_code(c).expect("codes 1 to 11")))
        ]
    }

    fn any_reply() -> impl Strategy<Value = Reply> {
        (
            any_refusal(),
            any::<[u8; NONCE_LEN]>(),
            any::<[u8; NONCE_LEN]>(),
            "\\PC{0,40}",
        )
            .prop_map(|(refusal, nonce, proof, reason)| Reply {
                refusal,
                nonce,
                proof,
                reason,
            })
    }

    fn any_addr() -> impl Strategy<Value = std::net::SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>())
                .prop_map(|(ip, port)| std::net::SocketAddr::from((ip, port))),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, port)| {
                std::net::SocketAddr::from((std::net::Ipv6Addr::from(ip), port))
            }),
        ]
    }

    /// Bytes that start like a real message often enough to reach the later checks.
    fn noisy(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
        let len = valid.len();
        (
            proptest::collection::vec((0..len.max(1), any::<u8>()), 0..4),
            0..=len + 8,
        )
            .prop_map(move |(flips, cut)| {
                let mut b = valid.clone();
                for (at, x) in flips {
                    if at < b.len() {
                        b[at] = x;
                    }
                }
                b.resize(cut, 0xee);
                b
            })
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300), n in 0usize..64) {
            let _ = Hello::decode(&b);
            let _ = Reply::decode(&b);
            let _ = decode_table_head(&b);
            let _ = decode_table_entries(&b, n);
        }

        #[test]
        fn hello_round_trips_and_cut_hellos_are_errors(h in any_hello(), cut in 0..HELLO_LEN) {
            let b = h.encode();
            prop_assert_eq!(Hello::decode(&b), Ok(h));
            prop_assert!(
                matches!(Hello::decode(&b[..cut]), Err(DecodeError::Truncated { .. })),
                "{} bytes decoded", cut
            );
        }

        #[test]
        fn damaged_hellos_never_panic(b in any_hello().prop_flat_map(|h| noisy(h.encode().to_vec()))) {
            if let Ok(h) = Hello::decode(&b) {
                // Whatever decodes re-encodes to the bytes it came from.
                prop_assert_eq!(&h.encode()[..], &b[..HELLO_LEN]);
            }
        }

        #[test]
        fn reply_round_trips_and_cut_replies_are_errors(r in any_reply(), cut in 0..REPLY_LEN) {
            let b = r.encode();
            let d = Reply::decode(&b).expect("decodes");
            // Reasons are cut at REASON_LEN bytes, on a character boundary.
            prop_assert!(r.reason.starts_with(&d.reason));
            prop_assert!(d.reason.len() <= REASON_LEN);
            prop_assert!(d.reason.len() + 3 >= r.reason.len().min(REASON_LEN));
            prop_assert_eq!((d.refusal, d.nonce, d.proof), (r.refusal, r.nonce, r.proof));
            prop_assert!(
                matches!(Reply::decode(&b[..cut]), Err(DecodeError::Truncated { .. })),
                "{} bytes decoded", cut
            );
        }

        #[test]
        fn damaged_replies_never_panic(b in any_reply().prop_flat_map(|r| noisy(r.encode().to_vec()))) {
            let _ = Reply::decode(&b);
        }

        #[test]
        fn table_round_trips_and_cut_tables_are_errors(
            job in any::<u64>(),
            addrs in proptest::collection::vec(any_addr(), 1..20),
            cut in any::<prop::sample::Index>(),
        ) {
            let b = encode_table(job, &addrs);
            let n = addrs.len();
            let whole = TableHead { job_id: job, world: n as u32, first: 0, count: n as u32 };
            prop_assert_eq!(decode_table_head(&b), Ok(whole));
            let entries = &b[TABLE_HEAD_LEN..];
            let got = decode_table_entries(entries, n).expect("decodes");
            prop_assert_eq!(got, addrs);
            let head_cut = cut.index(TABLE_HEAD_LEN);
            prop_assert!(
                matches!(decode_table_head(&b[..head_cut]), Err(DecodeError::Truncated { .. })),
                "{} bytes of head decoded", head_cut
            );
            let entries_cut = cut.index(entries.len());
            prop_assert!(
                matches!(decode_table_entries(&entries[..entries_cut], n), Err(DecodeError::Truncated { .. })),
                "{} bytes of entries decoded", entries_cut
            );
        }

        #[test]
        fn damaged_tables_never_panic(
            b in proptest::collection::vec(any_addr(), 1..6)
                .prop_flat_map(|a| noisy(encode_table(7, &a))),
            n in 0usize..8,
        ) {
            let _ = decode_table_head(&b);
            if b.len() >= TABLE_HEAD_LEN {
                let _ = decode_table_entries(&b[TABLE_HEAD_LEN..], n);
            }
        }
    }
}

/// The two keys of a sealed connection differ from each other, from every other connection's
/// (another nonce of either side, another listener) and under another secret; the sealed flag
/// rides in the hello's flags (bit 1, with the secret's bit 0) and is covered by the proofs.
#[test]
fn seal_keys_are_per_connection_and_direction() {
    let mut h = hello();
    h.sealed = true;
    let b = h.encode();
    assert_eq!(b[11], 3);
    assert_eq!(Hello::decode(&b), Ok(h));
    let key = b"0123456789abcdef";
    let sn = [5; NONCE_LEN];
    let (c2s, s2c) = seal_keys(key, &h, 2, &sn);
    assert_ne!(c2s, s2c);
    let mut other_client = h;
    other_client.nonce[0] ^= 1;
    for (k, what) in [
        (seal_keys(key, &other_client, 2, &sn), "the client's nonce"),
        (seal_keys(key, &h, 2, &[6; NONCE_LEN]), "the server's nonce"),
        (seal_keys(key, &h, 1, &sn), "the listener's rank"),
        (seal_keys(b"fedcba9876543210", &h, 2, &sn), "the secret"),
    ] {
        assert!(k.0 != c2s && k.1 != s2c, "{what} does not change the keys");
    }
    // Neither key is a proof seen on the wire.
    assert_ne!(proof(key, Side::Client, &h, 2, &sn), c2s);
    assert_ne!(proof(key, Side::Server, &h, 2, &sn), s2c);
}
