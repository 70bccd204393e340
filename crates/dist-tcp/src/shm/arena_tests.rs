//! The host arena's segments and their checks: a peer's segment is mapped only when it is what
//! it claims (size, seals, header); every access out of range is an error; words and slots
//! written by one rank are read by the other, and a sleeper is woken by a publish.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::transport::{ArenaWord, HostArena};

use super::super::arena_map::{MAGIC, Mapping, Refused, SLOTS_AT};
use super::super::pidfd::PeerProcess;
use super::*;

/// Two ranks of one host, each with the other's segment mapped.
fn pair() -> (TcpArena, TcpArena) {
    let host = Some([9u8; 32]);
    let (a, b) = (ArenaSetup::new(0, 2, host), ArenaSetup::new(1, 2, host));
    for (x, y, peer) in [(&a, &b, 1), (&b, &a, 0)] {
        x.note_host(peer, host);
        assert!(x.map_peer(peer, y.fd().unwrap(), PeerProcess::open(std::process::id())));
        y.note_mapped_mine(1 - peer);
    }
    let spin = Duration::from_micros(10);
    (
        a.finish(Vec::new(), spin, Some(0), 1),
        b.finish(Vec::new(), spin, Some(0), 1),
    )
}

/// Slots and words written by one rank are read by the other, bounds are checked, and a
/// sleeper on a word is woken by its publish.
#[test]
fn segments_round_trip() {
    let (a, b) = pair();
    assert!(a.complete() && b.complete());
    assert_eq!(a.hosts(), &[0, 0]);
    a.write(1, 100, b"arena bytes").unwrap();
    let mut out = [0u8; 11];
    b.read(0, 1, 100, &mut out).unwrap();
    assert_eq!(&out, b"arena bytes");
    a.read(0, 1, 100, &mut out).unwrap();
    assert_eq!(&out, b"arena bytes");
    a.set_meta(1, [7; 16]);
    a.set_call([8; 16]);
    assert_eq!((b.meta(0, 1), b.call(0)), ([7; 16], [8; 16]));
    assert_eq!(b.load(0, ArenaWord::Input), 0);
    std::thread::scope(|s| {
        let t = Instant::now();
        let sleeper = s.spawn(|| {
            while b.load(0, ArenaWord::Reduced) != 5 {
                b.sleep(0, ArenaWord::Reduced, 0, Duration::from_secs(20));
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        a.publish(ArenaWord::Reduced, 5);
        sleeper.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    });
    assert_eq!(b.load(0, ArenaWord::Reduced), 5);
}

/// Two threads of one rank asleep on a peer's words: the one that wakes first (its limit
/// passed) leaves the other counted as asleep, so the peer's publish still wakes it (with a
/// flag of 0/1 the first cleared it, and the second slept out its limit).
#[test]
fn a_second_sleeper_of_one_rank_is_still_woken() {
    let (a, b) = pair();
    let asleep = || a.maps[1].as_ref().unwrap().load_u32(OFF_ASLEEP);
    std::thread::scope(|s| {
        let t = Instant::now();
        let long = s.spawn(|| {
            while b.load(0, ArenaWord::Reduced) != 3 {
                b.sleep(0, ArenaWord::Reduced, 0, Duration::from_secs(30));
            }
        });
        // Wait (by the deadline below) until the long sleeper is counted.
        while asleep() == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "never counted asleep"
            );
            std::thread::yield_now();
        }
        // A second thread of rank 1 sleeps briefly on another word and wakes by its limit.
        s.spawn(|| b.sleep(0, ArenaWord::Input, 0, Duration::from_millis(1)))
            .join()
            .unwrap();
        let counted = asleep();
        let woken_at = Instant::now();
        a.publish(ArenaWord::Reduced, 3);
        long.join().unwrap();
        assert_eq!(counted, 1, "the long sleeper was no longer counted");
        assert!(
            woken_at.elapsed() < Duration::from_secs(10),
            "{:?}",
            woken_at.elapsed()
        );
    });
    assert_eq!(asleep(), 0);
}

/// A peer reading the call descriptor while its owner rewrites it gets a whole descriptor or
/// none, never half of one and half of another (a torn one looked like a mismatched call:
/// `coll_reductions::n8` failed with "count 70001 vs 0" under load).
#[test]
fn call_descriptors_are_never_torn() {
    let (a, b) = pair();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..200_000u64 {
                let mut m = [0u8; 16];
                m[..8].copy_from_slice(&i.to_le_bytes());
                m[8..].copy_from_slice(&i.to_le_bytes());
                a.set_call(m);
            }
            stop.store(true, std::sync::atomic::Ordering::Release);
        });
        let mut whole = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            let m = b.call(0);
            assert_eq!(m[..8], m[8..], "a torn descriptor");
            whole += 1;
        }
        assert!(whole > 0);
    });
}

/// Accesses past a slot, to a third slot, or to a rank with no mapping are errors.
#[test]
fn out_of_range_accesses_are_refused() {
    let (a, b) = pair();
    let slot = ARENA_SLOT as usize;
    let mut buf = [0u8; 16];
    assert!(b.read(0, 0, slot - 8, &mut buf).is_err());
    assert!(b.read(0, 2, 0, &mut buf).is_err());
    assert!(b.read(0, 0, usize::MAX - 4, &mut buf).is_err());
    assert!(b.read(7, 0, 0, &mut buf).is_err());
    assert!(a.write(0, slot - 15, &buf).is_err());
    assert!(a.write(0, slot - 16, &buf).is_ok());
    assert_eq!(b.load(9, ArenaWord::Input), 0);
}

fn memfd(len: u64, seal: bool) -> OwnedFd {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create("test", MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if seal {
        #[cfg(target_os = "linux")]
        let future_write = SealFlags::FUTURE_WRITE;
        #[cfg(not(target_os = "linux"))]
        let future_write = SealFlags::empty();
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | future_write | SealFlags::SEAL,
        )
        .unwrap();
    }
    fd
}

/// A peer's segment of the wrong size, unsealed, with a corrupt header or naming another rank
/// is refused, with a reason.
#[test]
fn hostile_segments_are_refused() {
    let len = SLOTS_AT as u64 + 2 * ARENA_SLOT;
    let e = Mapping::open(&memfd(len - 1, true), ARENA_SLOT, 1).unwrap_err();
    assert!(e.contains("not a file of"), "{e}");
    let e = Mapping::open(&memfd(len, false), ARENA_SLOT, 1).unwrap_err();
    assert!(e.contains("not sealed"), "{e}");
    let e = Mapping::open(&memfd(len, true), ARENA_SLOT, 1).unwrap_err();
    assert!(e.contains("magic 0x0"), "{e}");
    // Sealed against resizing but still writable by whoever holds it: refused.
    let writable = memfd(len, false);
    rustix::fs::fcntl_add_seals(
        &writable,
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW | rustix::fs::SealFlags::SEAL,
    )
    .unwrap();
    let e = Mapping::open(&writable, ARENA_SLOT, 1).unwrap_err();
    assert!(e.contains("not sealed"), "{e}");
    let (fd, own) = Mapping::create(ARENA_SLOT, 1, (0, 1)).unwrap();
    assert!(Mapping::open(&fd, ARENA_SLOT, 1).is_ok());
    // A peer holding our descriptor cannot write our segment.
    assert!(rustix::io::pwrite(&fd, &[1u8], 0).is_err());
    let e = Mapping::open(&fd, ARENA_SLOT, 2).unwrap_err();
    assert!(e.contains("rank 1"), "{e}");
    assert!(Mapping::open(&fd, ARENA_SLOT / 2, 1).is_err());
    assert!(Mapping::open(&fd, 3, 1).is_err());
    assert!(own.store_u64(0, MAGIC ^ 1, std::sync::atomic::Ordering::SeqCst));
    assert!(
        Mapping::open(&fd, ARENA_SLOT, 1)
            .unwrap_err()
            .contains("arena header")
    );
    // A read-only mapping refuses writes.
    let (fd, own) = Mapping::create(ARENA_SLOT, 1, (0, 1)).unwrap();
    let theirs = Mapping::open(&fd, ARENA_SLOT, 1).unwrap();
    assert_eq!(theirs.write(0, 0, b"x"), Err(Refused::OutOfRange));
    // Nor stores to its words: nothing is stored (a store would fault on the read-only
    // mapping), and the owner's value stays.
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    assert!(!theirs.store_u32(OFF_WORDS[0], 7, relaxed));
    assert!(!theirs.store_u64(OFF_META, 7, relaxed));
    assert!(!theirs.add_u32(OFF_ASLEEP, 1));
    assert_eq!(
        (theirs.load_u32(OFF_WORDS[0]), theirs.load_u32(OFF_ASLEEP)),
        (0, 0)
    );
    assert!(own.store_u32(OFF_WORDS[0], 9, relaxed));
    assert_eq!(theirs.load_u32(OFF_WORDS[0]), 9);
}

/// No two threads of this process copy overlapping bytes of a segment at once: while an
/// access is in progress (held open here, as by a thread in the middle of its copy), an
/// overlapping write, or a read overlapping a write (through the owner's mapping or a peer's
/// made in this process, as here: ranks as threads of one process), is refused with an error
/// naming the rank, nothing copied; disjoint ranges and reads beside reads go ahead, and the
/// range is free again once the access has ended. Fails without `Busy`.
#[test]
fn overlapping_accesses_from_two_threads_are_refused() {
    let (a, b) = pair();
    let own = a.own.as_ref().unwrap();
    let slot = ARENA_SLOT as usize;
    a.write(1, 100, &[9u8; 100]).unwrap();
    let refused = |e: dist_core::DistError, rank: usize| {
        let e = e.to_string();
        assert!(
            e.contains("another thread") && e.contains(&format!("rank {rank}")),
            "{e}"
        );
    };
    {
        // A write of slot 1's bytes 100..200, in progress.
        let _writing = own
            .busy()
            .unwrap()
            .enter(slot + 100, slot + 200, true)
            .unwrap();
        refused(a.write(1, 150, &[1u8; 100]).unwrap_err(), 0);
        let mut out = [0u8; 10];
        refused(a.read(0, 1, 195, &mut out).unwrap_err(), 0);
        refused(b.read(0, 1, 100, &mut out).unwrap_err(), 1);
        assert_eq!(out, [0u8; 10]);
        a.write(0, 100, &[2u8; 100]).unwrap();
        a.write(1, 200, &[3u8; 10]).unwrap();
        a.write(1, 150, &[]).unwrap();
        a.read(0, 1, 90, &mut out).unwrap();
        b.read(0, 1, 90, &mut out).unwrap();
        assert_eq!(out, [0u8; 10]);
    }
    a.write(1, 150, &[1u8; 100]).unwrap();
    {
        let _reading = own.busy().unwrap().enter(slot, slot + 64, false).unwrap();
        let mut out = [0u8; 64];
        a.read(0, 1, 0, &mut out).unwrap();
        b.read(0, 1, 0, &mut out).unwrap();
        refused(a.write(1, 32, &[5u8; 8]).unwrap_err(), 0);
        a.read(0, 1, 0, &mut out).unwrap();
        assert_eq!(out, [0u8; 64]);
    }
    a.write(1, 32, &[5u8; 8]).unwrap();
}

/// Threads writing one range of a rank's slot, each its own byte, beside threads reading it
/// through the owner's mapping and through a peer's of this process, each until 40 of its
/// copies have gone (trying again after a refusal): every read that goes holds one writer's
/// bytes, never a mix, and so does the range at the end. (Without `Busy`, on a 2-core
/// machine, a read saw a mix in five runs of ten.)
#[test]
fn racing_copies_never_see_a_mix() {
    let (a, b) = pair();
    let len = 1 << 20;
    a.write(0, 0, &vec![1u8; len]).unwrap();
    // Each thread tries again after a refusal, for at most 60 s: a guard that refused every
    // copy fails here instead of hanging.
    let until = Instant::now() + Duration::from_secs(60);
    let refused = |e: dist_core::DistError| {
        assert!(e.to_string().contains("another thread"), "{e}");
        assert!(Instant::now() < until, "copies refused for 60 s");
        std::thread::yield_now();
    };
    let uniform = |v: &[u8]| v.iter().all(|&x| x == v[0]) && v[0] != 0;
    std::thread::scope(|s| {
        for t in 1..=3u8 {
            let a = &a;
            s.spawn(move || {
                let data = vec![t + 1; len];
                let mut done = 0;
                while done < 40 {
                    match a.write(0, 0, &data) {
                        Ok(()) => done += 1,
                        Err(e) => refused(e),
                    }
                }
            });
        }
        for reader in [&a, &b] {
            s.spawn(move || {
                let mut out = vec![0u8; len];
                let mut done = 0;
                while done < 40 {
                    match reader.read(0, 0, 0, &mut out) {
                        Ok(()) => {
                            assert!(uniform(&out), "a read saw a mix of writers' bytes");
                            done += 1;
                        }
                        Err(e) => refused(e),
                    }
                }
            });
        }
    });
    let mut out = vec![0u8; len];
    a.read(0, 0, 0, &mut out).unwrap();
    assert!(
        uniform(&out) && out[0] > 1,
        "a mix of writers' bytes, or none written"
    );
}

/// A peer's mapping of a segment made in this process shares the owner's record of copies in
/// progress, also once the owner's mapping is gone; a segment with another token (as one of
/// another process whose file had the same inode) is not taken for it.
#[test]
fn peers_in_this_process_share_the_owners_record() {
    use super::super::busy;
    let (fd, own) = Mapping::create(ARENA_SLOT, 1, (0, 1)).unwrap();
    let theirs = Mapping::open(&fd, ARENA_SLOT, 1).unwrap();
    let slot = ARENA_SLOT as usize;
    let writing = own.busy().unwrap().enter(0, 64, true).unwrap();
    let mut out = [0u8; 8];
    assert_eq!(theirs.read(0, 0, &mut out), Err(Refused::Busy));
    drop(writing);
    theirs.read(0, 0, &mut out).unwrap();
    drop(own);
    let again = Mapping::open(&fd, ARENA_SLOT, 1).unwrap();
    let _writing = again.busy().unwrap().enter(slot, slot + 8, true).unwrap();
    assert_eq!(theirs.read(1, 0, &mut out), Err(Refused::Busy));
    assert!(busy::for_file(&fd, u64::MAX).unwrap().is_none());
}

/// A rank whose peer did not map its segment (or without one) says its arena is incomplete;
/// ranks of other hosts are on hosts of their own.
#[test]
fn incomplete_arenas_and_other_hosts() {
    let host = Some([9u8; 32]);
    let a = ArenaSetup::new(0, 3, host);
    let b = ArenaSetup::new(1, 3, host);
    a.note_host(1, host);
    a.note_host(2, Some([1u8; 32]));
    assert!(a.map_peer(1, b.fd().unwrap(), PeerProcess::open(std::process::id())));
    // Rank 1 never says it mapped rank 0's segment.
    let a = a.finish(
        Vec::<Arc<crate::peer::Peer>>::new(),
        Duration::ZERO,
        Some(0),
        1,
    );
    assert!(!a.complete());
    assert_eq!(a.hosts(), &[0, 0, 2]);
    let off = ArenaSetup::new(0, 2, None).finish(Vec::new(), Duration::ZERO, Some(0), 1);
    assert!(!off.complete());
    assert_eq!(off.hosts(), &[0, 1]);
}

/// Two arenas of one process (ranks as threads) do not read each other directly: a direct
/// read of this process's memory at an address a caller chose could race another thread's
/// write. Reads of a rank that is not a peer are errors too.
#[test]
fn direct_reads_are_probed() {
    let (a, b) = pair();
    assert_eq!((a.direct_min(), b.direct_min()), (None, None));
    let data: Vec<u8> = (0..64).collect();
    let mut out = [0u8; 16];
    let e = b
        .read_direct(0, data.as_ptr() as u64 + 8, &mut out)
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("rank of this process"), "{e}");
    assert_eq!(out, [0u8; 16]);
    assert!(b.read_direct(1, data.as_ptr() as u64, &mut out).is_err());
    assert!(b.read_direct(5, data.as_ptr() as u64, &mut out).is_err());
}

/// A child process that lives while the test needs it (killed on drop).
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A peer whose arena header names another process than the one the kernel names for the
/// socket its descriptors came through is not read directly: here the header names this
/// process (a hostile peer's trick to have a rank read its own memory, at addresses the peer
/// chooses, into results the peer reads), with a probe that would pass, while the socket's
/// process is a child. Without the check the probe passes and the read returns this
/// process's bytes. Where the kernel names no process, no direct reads either.
#[test]
fn direct_reads_follow_the_socket_not_the_header() {
    let child = Child(
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep"),
    );
    let host = Some([9u8; 32]);
    for socket_pid in [Some(child.0.id()), None] {
        let (x, y) = (ArenaSetup::new(0, 2, host), ArenaSetup::new(1, 2, host));
        for (p, q, peer) in [(&x, &y, 1), (&y, &x, 0)] {
            p.note_host(peer, host);
            assert!(p.map_peer(
                peer,
                q.fd().unwrap(),
                socket_pid.and_then(PeerProcess::open)
            ));
            q.note_mapped_mine(1 - peer);
        }
        let (x, _y) = (
            x.finish(Vec::new(), Duration::ZERO, Some(0), 1),
            y.finish(Vec::new(), Duration::ZERO, Some(0), 1),
        );
        assert!(x.complete());
        assert_eq!(x.direct_min(), None, "socket pid {socket_pid:?}");
        let secret = [0x5au8; 16];
        let mut out = [0u8; 16];
        let e = x
            .read_direct(1, secret.as_ptr() as u64, &mut out)
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert!(
            e.to_string().contains("SO_PEERCRED"),
            "socket pid {socket_pid:?}: {e}"
        );
        assert_eq!(out, [0u8; 16], "nothing of this process was read");
    }
}

/// The kernel names the process at the other end of a Unix socket: this one, for a pair
/// made here.
#[test]
fn socket_pid_is_the_kernels() {
    let (u, _v) = std::os::unix::net::UnixStream::pair().unwrap();
    assert_eq!(
        super::super::setup::socket_pid(&u),
        Some(std::process::id())
    );
}

/// Two arenas of ranks 0 and 1 mapped to each other, rank 1's header and socket naming
/// process `pid`.
fn pair_naming(pid: u32) -> (TcpArena, TcpArena) {
    use std::sync::atomic::Ordering;
    let host = Some([7u8; 32]);
    let (x, y) = (ArenaSetup::new(0, 2, host), ArenaSetup::new(1, 2, host));
    let own = &y.own.as_ref().unwrap().1;
    assert!(own.store_u32(super::OFF_PID, pid, Ordering::SeqCst));
    x.note_host(1, host);
    y.note_host(0, host);
    assert!(x.map_peer(1, y.fd().unwrap(), PeerProcess::open(pid)));
    assert!(y.map_peer(0, x.fd().unwrap(), PeerProcess::open(std::process::id())));
    x.note_mapped_mine(1);
    y.note_mapped_mine(0);
    (
        x.finish(Vec::new(), Duration::ZERO, Some(0), 1),
        y.finish(Vec::new(), Duration::ZERO, Some(0), 1),
    )
}

/// A dead peer's pid handed out again as the id of a thread of this process (stood in for
/// by a live thread's id, which the peer's header and socket name): `read_direct` must not
/// read this process's memory through it. Without the pidfd and thread checks it returns
/// this process's bytes.
#[test]
#[cfg(target_os = "linux")]
fn a_reused_pid_that_names_a_thread_here() {
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        tx.send(rustix::thread::gettid().as_raw_nonzero().get())
            .unwrap();
        let _ = stop_rx.recv();
    });
    let tid = u32::try_from(rx.recv().unwrap()).unwrap();
    let (x, _y) = pair_naming(tid);
    let secret = [0x5au8; 16];
    let mut out = [0u8; 16];
    let r = x.read_direct(1, secret.as_ptr() as u64, &mut out);
    let _ = stop_tx.send(());
    t.join().unwrap();
    assert!(
        r.is_err() && out == [0u8; 16],
        "read_direct read this process's memory through thread id {tid}: {r:?}, {out:?}"
    );
    assert_eq!(x.direct_min(), None);
}

/// A peer whose header and socket name a process that shares this one's memory without being
/// a thread of it (a `CLONE_VM` child, such as a `vfork` child before its `exec`, which a
/// reused pid could name) is not read directly: `kcmp` says it shares this memory. Fails
/// without the `kcmp` check: the read returns this process's bytes.
#[test]
#[cfg(target_os = "linux")]
fn a_process_sharing_this_memory_is_not_read() {
    let vm = super::super::pidfd::tests::VmChild::spawn();
    let (x, _y) = pair_naming(u32::try_from(vm.pid).unwrap());
    let secret = [0x5au8; 16];
    let mut out = [0u8; 16];
    let e = x
        .read_direct(1, secret.as_ptr() as u64, &mut out)
        .unwrap_err();
    drop(vm);
    assert_eq!(
        out, [0u8; 16],
        "read this process's memory through its CLONE_VM child"
    );
    // Where kcmp is refused, the child's pidfd (opened by pid) leaves its memory unknown,
    // which refuses it as well.
    let why = match super::super::pidfd::tests::kcmp_refused() {
        None => "shares this process's memory",
        Some(_) => "whether it shares this process's memory is unknown",
    };
    assert!(e.to_string().contains(why), "{e}");
    assert_eq!(x.direct_min(), None);
}

/// A peer whose process has exited is not read directly: refused with `NotFound`, naming
/// the peer, since its pid may name another process by then.
#[test]
fn an_exited_peer_is_not_read() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let (x, _y) = pair_naming(child.id());
    let mut out = [0u8; 8];
    let before = x.read_direct(1, 4096, &mut out);
    assert!(
        before
            .as_ref()
            .map_or_else(|e| !e.to_string().contains("has exited"), |_| true),
        "a live peer is not refused as exited: {before:?}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let e = x.read_direct(1, 4096, &mut out).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
    assert!(
        e.to_string().contains("peer 1") && e.to_string().contains("has exited"),
        "{e}"
    );
    assert_eq!(out, [0u8; 8]);
}

/// A peer whose memory `kcmp` could not compare (Docker's default seccomp filter refuses it
/// without `CAP_SYS_PTRACE` while allowing `process_vm_readv`) is still read where its pidfd
/// came from the socket, refused where it was opened by pid; one sharing this memory never.
#[test]
fn an_unknown_memory_is_read_only_with_the_sockets_pidfd() {
    use super::super::pidfd::{Memory, Taken};
    let unknown = Memory::Unknown("kcmp: Operation not permitted".into());
    assert_eq!(memory_verdict(Taken::FromSocket, &unknown), Ok(()));
    let e = memory_verdict(Taken::ByPid, &unknown).unwrap_err();
    assert!(
        e.contains("opened by pid") && e.contains("Operation not permitted"),
        "{e}"
    );
    for taken in [Taken::FromSocket, Taken::ByPid] {
        assert_eq!(memory_verdict(taken, &Memory::Apart), Ok(()));
        let e = memory_verdict(taken, &Memory::Shared).unwrap_err();
        assert!(e.contains("shares this process's memory"), "{e}");
    }
}
