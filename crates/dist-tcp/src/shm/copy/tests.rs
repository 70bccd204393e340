//! Tests of the shared-memory copies: every method this processor can run, every length up to
//! a few turns of the widest word, every alignment of both sides, into and out of a real shared
//! mapping, with the bytes around each copy left untouched.

use super::{Choice, Method, STRING_MIN, STRING_MIN_WIDE, read_with, write_with};
use crate::shm::shared_map::SharedMap;

/// Every method this processor can run, with its name: each word width it has, each with and
/// without string moves (`rep movsb` runs on every x86-64 processor; ERMS only makes it fast).
fn methods() -> Vec<(String, Choice)> {
    let mut widths = vec![Method::Words8];
    #[cfg(target_arch = "x86_64")]
    {
        widths.push(Method::Words16);
        if std::arch::is_x86_feature_detected!("avx2") {
            widths.push(Method::Words32);
        } else {
            eprintln!("skipped: 32-byte words (this processor has no AVX2)");
        }
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2")
        {
            widths.push(Method::Words64);
        } else {
            eprintln!("skipped: 64-byte words (this processor has no AVX-512 with AVX2)");
        }
    }
    let strings: &[bool] = if cfg!(target_arch = "x86_64") {
        &[false, true]
    } else {
        &[false]
    };
    let mut all = vec![];
    for &words in &widths {
        for &s in strings {
            all.push((
                format!("{words:?} strings {s}"),
                Choice { words, strings: s },
            ));
        }
    }
    all
}

/// A shared mapping of `len` bytes (a memfd, as the rings and arenas are).
fn mapping(len: usize) -> SharedMap {
    let fd = rustix::fs::memfd_create("dist-copy-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    // SAFETY: the file was just made `len` bytes long and nothing resizes it.
    unsafe { SharedMap::new(&fd, len, true).unwrap() }
}

/// Writes `src` at `base + at` and reads it back into `back[from..]` by method `c`, checking
/// the copy and that no byte around either range changed.
fn round_trip(c: Choice, name: &str, base: *mut u8, src: &[u8], at: usize, from: usize) {
    let len = src.len();
    let mut back = vec![0u8; len + from + 70];
    // SAFETY: `at + len + 1` lies within the mapping (the callers size it so); the test holds
    // no reference into it; `back` has `from + len` bytes and more.
    unsafe {
        std::ptr::write_bytes(base, 0xee, at + len + 1);
        write_with(c, base.add(at), src.as_ptr(), len);
        read_with(c, base.add(at), back.as_mut_ptr().add(from), len);
        assert_eq!(
            *base.add(at + len),
            0xee,
            "{name}: len {len} at {at}: byte after"
        );
        if at > 0 {
            assert_eq!(
                *base.add(at - 1),
                0xee,
                "{name}: len {len} at {at}: byte before"
            );
        }
    }
    assert!(
        back[from..from + len] == *src,
        "{name}: len {len} at {at} from {from}"
    );
    assert!(
        back[..from].iter().all(|&b| b == 0),
        "{name}: before the copy"
    );
    assert!(
        back[from + len..].iter().all(|&b| b == 0),
        "{name}: after the copy"
    );
}

/// Every length up to past four 64-byte words, at every alignment of both sides up to one
/// 64-byte word's, by every method.
#[test]
fn copies_every_alignment_and_length() {
    let map = mapping(4096);
    let src: Vec<u8> = (0..400u32).map(|i| (i * 7 + 1) as u8).collect();
    let offsets: Vec<usize> = (0..18).chain([31, 32, 33, 47, 63, 64, 65]).collect();
    for (name, c) in methods() {
        for len in 0..300 {
            for &at in &offsets {
                for &from in &offsets {
                    round_trip(c, &name, map.ptr(), &src[from..from + len], at, from);
                }
            }
        }
    }
}

/// Lengths around the string-move thresholds and long ones, at a few alignments, by every
/// method.
#[test]
fn long_copies_by_every_method() {
    let map = mapping(1 << 20);
    let src: Vec<u8> = (0..(1u32 << 19))
        .map(|i| (i * 13 + i / 251) as u8)
        .collect();
    let lens = [
        STRING_MIN - 1,
        STRING_MIN,
        STRING_MIN + 1,
        STRING_MIN + 63,
        STRING_MIN_WIDE - 1,
        STRING_MIN_WIDE,
        STRING_MIN_WIDE + 65,
        100_003,
        (1 << 19) - 100,
    ];
    for (name, c) in methods() {
        for len in lens {
            for (at, from) in [(0, 0), (1, 0), (0, 7), (13, 37), (64, 32)] {
                round_trip(c, &name, map.ptr(), &src[from..from + len], at, from);
            }
        }
    }
}

/// The method this process uses is one the processor has.
#[test]
fn the_choice_is_one_the_processor_runs() {
    let c = super::choice();
    assert!(
        methods().iter().any(|(_, m)| m.words == c.words),
        "chose {c:?}"
    );
}
