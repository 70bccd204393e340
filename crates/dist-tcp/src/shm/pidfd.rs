//! A peer's process held by a pidfd, for direct reads of its memory: while the pidfd is held
//! and the process has not exited, its pid names it and nothing else (a pid is handed out again
//! only once its process is gone), so a read by pid between two checks that it lives reads that
//! process, unless it exits, is reaped and its pid is handed out again within the read's one
//! syscall (`arena.rs` says why that is accepted). The pidfd is taken from the Unix socket the
//! peer's descriptors came through where the kernel offers it (`SO_PEERPIDFD`), so that it
//! names the process that made the connection, not whichever has its pid when it is opened.
//!
//! Pidfds, `SO_PEERPIDFD` and `kcmp` are Linux's: on other targets no process is ever held
//! (no direct reads), and what only that path uses is compiled but unused.
#![cfg_attr(not(target_os = "linux"), allow(dead_code))]

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::event::{PollFd, PollFlags, Timespec};

/// How a [`PeerProcess`]'s pidfd was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    /// From the socket (`SO_PEERPIDFD`, Linux 6.5 on): the process the kernel recorded for
    /// the connection itself.
    FromSocket,
    /// By pid (`pidfd_open`), on a kernel without `SO_PEERPIDFD` (`ENOPROTOOPT`): the process that had the pid
    /// `SO_PEERCRED` gave when it was opened (it could in principle have been handed out again
    /// in between, if the peer exited that soon; the checks in [`TcpArena`] still apply).
    ///
    /// [`TcpArena`]: super::arena::TcpArena
    ByPid,
}

/// Whether a process shares this process's memory, as `kcmp(KCMP_VM)` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Its own memory.
    Apart,
    /// This process's memory: a thread of it, this process itself, or a child made with
    /// `CLONE_VM` (a `vfork`/`posix_spawn` child before its `exec`).
    Shared,
    /// `kcmp` could not say (a kernel without it, or a seccomp filter or ptrace rule that
    /// refuses it): the error.
    Unknown(String),
}

/// A peer's process: its pid and a pidfd of it, taken when its socket's `SO_PEERCRED` was
/// read, and whether it shares this process's memory (checked once, with the pidfd held).
#[derive(Debug)]
pub(crate) struct PeerProcess {
    pid: u32,
    fd: OwnedFd,
    taken: Taken,
    memory: Memory,
}

impl PeerProcess {
    /// The process at the other end of the connected Unix socket `sock`, whose pid
    /// `SO_PEERCRED` gave as `pid`: its pidfd from the socket (`SO_PEERPIDFD`: the very process
    /// the pid names, both read from the socket's record), else, on a kernel without that
    /// option (`ENOPROTOOPT`, what a kernel answers for a socket option it does not know),
    /// [`PeerProcess::open`]. `None` where there is none: the process is gone (Linux 6.5 to
    /// 6.15 answer `EINVAL` for a peer already reaped, whose pid may name another process by
    /// now: not opened by pid), or the kernel has neither.
    #[cfg(target_os = "linux")]
    pub(crate) fn of_socket(sock: BorrowedFd<'_>, pid: u32) -> Option<PeerProcess> {
        Self::from_peer_pidfd(peer_pidfd(sock), pid)
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn of_socket(_sock: BorrowedFd<'_>, _pid: u32) -> Option<PeerProcess> {
        None
    }

    /// [`PeerProcess::of_socket`] from what `SO_PEERPIDFD` gave.
    fn from_peer_pidfd(got: Result<OwnedFd, rustix::io::Errno>, pid: u32) -> Option<PeerProcess> {
        match got {
            Ok(fd) => Some(Self::held(pid, fd, Taken::FromSocket)),
            Err(rustix::io::Errno::NOPROTOOPT) => Self::open(pid),
            Err(_) => None,
        }
    }

    /// A pidfd of process `pid` (`pidfd_open`); `None` where there is none: the kernel has no
    /// `pidfd_open` (before Linux 5.3: then no direct reads), the process is gone, or `pid` is
    /// a thread that does not lead its thread group.
    #[cfg(target_os = "linux")]
    pub(crate) fn open(pid: u32) -> Option<PeerProcess> {
        use std::os::fd::FromRawFd;
        let raw = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        let flags: libc::c_uint = 0;
        // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or
        // -1; no memory of this process is passed. (Test: `pidfd::tests`.)
        let r = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, flags) };
        let fd = i32::try_from(r).ok().filter(|&f| f >= 0)?;
        // SAFETY: `fd` was returned just now by pidfd_open, so it is open and owned by nothing
        // else in this process.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Some(Self::held(pid, fd, Taken::ByPid))
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn open(_pid: u32) -> Option<PeerProcess> {
        None
    }

    /// The process `fd` holds, `pid` its pid: whether it shares this process's memory is
    /// asked now, while the pidfd is held, and believed only if the process has not exited
    /// after the question (so the pid `kcmp` was given named it).
    fn held(pid: u32, fd: OwnedFd, taken: Taken) -> PeerProcess {
        let mut p = PeerProcess {
            pid,
            fd,
            taken,
            memory: Memory::Unknown("not asked".into()),
        };
        let memory = shares_memory(pid);
        p.memory = if p.exited() {
            Memory::Unknown("the process exited".into())
        } else {
            memory
        };
        p
    }

    /// The process's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// How its pidfd was taken.
    pub(crate) fn taken(&self) -> Taken {
        self.taken
    }

    /// Whether it shares this process's memory.
    pub(crate) fn memory(&self) -> &Memory {
        &self.memory
    }

    /// Whether the process has exited: its pidfd polls readable (a failing poll counts as
    /// exited too, so that no read follows it).
    pub(crate) fn exited(&self) -> bool {
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        loop {
            match rustix::event::poll(&mut fds, Some(&zero)) {
                Ok(_) => return !fds[0].revents().is_empty(),
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return true,
            }
        }
    }
}

/// `SO_PEERPIDFD` of the Unix socket `sock`: a pidfd of the process the kernel recorded for
/// the connection.
#[cfg(target_os = "linux")]
fn peer_pidfd(sock: BorrowedFd<'_>) -> Result<OwnedFd, rustix::io::Errno> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a live, writable `c_int` and `len` its size, so the kernel writes at most
    // `len` bytes into it; `sock` is borrowed for the call. Shown by
    // `pidfd::tests::the_socket_names_its_peer_by_pidfd`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(rustix::io::Errno::from_raw_os_error(
            e.raw_os_error().unwrap_or(libc::EINVAL),
        ));
    }
    if fd < 0 {
        return Err(rustix::io::Errno::BADF);
    }
    // SAFETY: the kernel returned `fd` just now as a new descriptor of this process, owned by
    // nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    if len as usize != std::mem::size_of::<libc::c_int>() {
        // Closed as `owned` drops.
        return Err(rustix::io::Errno::BADF);
    }
    Ok(owned)
}

/// `kcmp`'s comparison of memories (`KCMP_VM` of `linux/kcmp.h`).
#[cfg(target_os = "linux")]
const KCMP_VM: libc::c_int = 1;

/// Whether process `pid` shares this process's memory (`kcmp(KCMP_VM)`).
#[cfg(target_os = "linux")]
fn shares_memory(pid: u32) -> Memory {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Memory::Unknown(format!("pid {pid} is out of range"));
    };
    let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let (zero, zero2): (libc::c_ulong, libc::c_ulong) = (0, 0);
    // SAFETY: kcmp takes two pids, a type and two indices by value (unused for KCMP_VM) and
    // returns 0, 1, 2 or -1; no memory of this process is passed. (Test:
    // `pidfd::tests::a_process_sharing_this_memory_is_known`.)
    let r = unsafe { libc::syscall(libc::SYS_kcmp, me, pid, KCMP_VM, zero, zero2) };
    // 0: the same memory; 1, 2: ordered apart; 3: apart, unordered.
    match r {
        0 => Memory::Shared,
        1..=3 => Memory::Apart,
        _ => Memory::Unknown(format!("kcmp: {}", std::io::Error::last_os_error())),
    }
}

#[cfg(not(target_os = "linux"))]
fn shares_memory(_pid: u32) -> Memory {
    Memory::Unknown("kcmp is Linux's".into())
}

/// Whether `pid` names this process or one of its threads (an entry in `/proc/self/task`);
/// true also where `/proc` cannot say, so that no read of this process follows.
pub(crate) fn of_this_process(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    match std::fs::metadata(format!("/proc/self/task/{pid}")) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            !std::path::Path::new("/proc/self/task").is_dir()
        }
        Err(_) => true,
    }
}

#[cfg(all(test, target_os = "linux"))]
pub(super) mod tests {
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::net::UnixListener;

    use super::*;

    /// A child process that lives while the test needs it (killed and reaped on drop).
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// The pid the kernel says a pidfd names (`Pid:` of its `/proc/self/fdinfo` entry).
    fn pidfd_pid(p: &PeerProcess) -> Option<u32> {
        let info =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", p.fd.as_raw_fd())).ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("Pid:"))
            .and_then(|v| v.trim().parse().ok())
    }

    /// A child's pidfd says it lives, then that it exited; a thread of this process (not a
    /// thread-group leader) has none, and is of this process.
    #[test]
    fn a_pidfd_follows_its_process() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let p = PeerProcess::open(child.id()).expect("pidfd_open of a child");
        assert_eq!((p.pid(), p.taken()), (child.id(), Taken::ByPid));
        assert_eq!(pidfd_pid(&p), Some(child.id()));
        assert_memory(&p, &Memory::Apart);
        assert!(!p.exited());
        assert!(!of_this_process(child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(p.exited());
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(rustix::thread::gettid().as_raw_nonzero().get())
                .unwrap();
            let _ = stop_rx.recv();
        });
        let tid = u32::try_from(rx.recv().unwrap()).unwrap();
        assert!(of_this_process(tid));
        assert!(of_this_process(std::process::id()));
        assert!(
            PeerProcess::open(tid).is_none(),
            "thread {tid} has no pidfd"
        );
        let _ = stop_tx.send(());
        t.join().unwrap();
    }

    /// A child that connects to a Unix socket here (in the child, before it runs `sleep`):
    /// this end's pidfd comes from the socket (`SO_PEERPIDFD`, this kernel has it) and names
    /// the child, as `SO_PEERCRED`'s pid does; it polls exited once the child is gone. Fails
    /// without `SO_PEERPIDFD` (the pidfd taken by pid). On a kernel before Linux 6.5 the
    /// option is missing: the test says so and checks the fallback instead.
    #[test]
    fn the_socket_names_its_peer_by_pidfd() {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::process::CommandExt;
        let name = format!(
            "dist-pidfd-test-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        );
        let l = UnixListener::bind_addr(
            &std::os::unix::net::SocketAddr::from_abstract_name(&name).unwrap(),
        )
        .unwrap();
        // The abstract address, built here: the child only makes two system calls with it.
        // SAFETY: `sockaddr_un` is plain data, for which all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, &b) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
            *d = b as libc::c_char;
        }
        let len =
            (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: the hook runs in the forked child before exec; it makes only `socket` and
        // `connect` calls (async-signal-safe) on a copied address, allocates nothing and
        // takes no lock.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if fd < 0 || libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = Child(cmd.spawn().expect("spawn a connecting sleep"));
        let (u, _) = l.accept().unwrap();
        let pid = super::super::setup::socket_pid(&u).expect("SO_PEERCRED names the child");
        assert_eq!(pid, child.0.id());
        let p = match peer_pidfd(u.as_fd()) {
            Err(rustix::io::Errno::NOPROTOOPT) => {
                eprintln!("skipped: this kernel has no SO_PEERPIDFD (Linux 6.5); fallback checked");
                let p = PeerProcess::of_socket(u.as_fd(), pid).expect("the fallback's pidfd");
                assert_eq!(p.taken(), Taken::ByPid);
                return;
            }
            got => PeerProcess::from_peer_pidfd(got, pid).expect("a pidfd from the socket"),
        };
        assert_eq!((p.pid(), p.taken()), (child.0.id(), Taken::FromSocket));
        assert_eq!(
            pidfd_pid(&p),
            Some(child.0.id()),
            "the pidfd names the child"
        );
        assert_memory(&p, &Memory::Apart);
        assert!(!p.exited());
        let q = PeerProcess::of_socket(u.as_fd(), pid).unwrap();
        assert_eq!(q.taken(), Taken::FromSocket);
        drop(child);
        assert!(p.exited() && q.exited());
    }

    /// Where `SO_PEERPIDFD` is unknown (`ENOPROTOOPT`) the pidfd is opened by pid; any other
    /// failure gives none: `EINVAL` (Linux 6.5 to 6.15: the peer was reaped, so its pid may
    /// name another process already) and `ESRCH` say the process is gone. Fails with `EINVAL`
    /// taken for an unknown option (the pid was opened, a window for a reused pid).
    #[test]
    fn without_so_peerpidfd_the_pidfd_is_opened_by_pid() {
        let child = Child(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep"),
        );
        let pid = child.0.id();
        let p = PeerProcess::from_peer_pidfd(Err(rustix::io::Errno::NOPROTOOPT), pid)
            .expect("opened by pid");
        assert_eq!((p.pid(), p.taken()), (pid, Taken::ByPid));
        assert_eq!(pidfd_pid(&p), Some(pid));
        for gone in [rustix::io::Errno::INVAL, rustix::io::Errno::SRCH] {
            assert!(
                PeerProcess::from_peer_pidfd(Err(gone), pid).is_none(),
                "{gone:?} says the process is gone"
            );
        }
    }

    /// Whether `kcmp` is refused here (a seccomp filter, as Docker's default one without
    /// `CAP_SYS_PTRACE`, or a kernel without it): asked of this process itself, which it
    /// would say shares this memory.
    pub(crate) fn kcmp_refused() -> Option<String> {
        match shares_memory(std::process::id()) {
            Memory::Unknown(e) => Some(e),
            _ => None,
        }
    }

    /// `p`'s memory is `want`, where `kcmp` answers; where it is refused, unknown (and the
    /// comparison is reported skipped).
    fn assert_memory(p: &PeerProcess, want: &Memory) {
        match kcmp_refused() {
            None => assert_eq!(p.memory(), want, "process {}", p.pid()),
            Some(why) => {
                assert!(matches!(p.memory(), Memory::Unknown(_)), "{:?}", p.memory());
                eprintln!("skipped: kcmp is refused here ({why}): {want:?} not checked");
            }
        }
    }

    /// A child made with `CLONE_VM` (as `vfork` makes, and `posix_spawn` before its `exec`),
    /// blocked in `pause` until killed, on a stack of this test's.
    pub(crate) struct VmChild {
        pub(crate) pid: libc::pid_t,
        _stack: Vec<u8>,
    }

    extern "C" fn pause_for_ever(_: *mut libc::c_void) -> libc::c_int {
        let (kill, none): (libc::c_ulong, libc::c_ulong) = (libc::SIGKILL as libc::c_ulong, 0);
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes the signal by value: the child dies with the
        // thread that made it (a test run killed mid-test leaves no child paused on its
        // memory). The child has no thread-local storage of its own (no CLONE_SETTLS): it uses
        // none, and a failing raw syscall's errno would land in the spawning thread's, which
        // outlives the child (`VmChild`'s drop kills and reaps it first).
        unsafe {
            libc::syscall(
                libc::SYS_prctl,
                libc::PR_SET_PDEATHSIG,
                kill,
                none,
                none,
                none,
            )
        };
        loop {
            // SAFETY: `pause` takes nothing; the raw syscall sets no errno unless it fails,
            // which it does only on a signal, and this child ends by SIGKILL.
            unsafe { libc::syscall(libc::SYS_pause) };
        }
    }

    impl VmChild {
        pub(crate) fn spawn() -> VmChild {
            let mut stack = vec![0u8; 256 << 10];
            let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
            // SAFETY: the child runs `pause_for_ever` on `stack`'s top (16-aligned, owned by
            // the returned value, which kills and reaps the child before the stack is freed);
            // it touches no memory but its own frames on that stack. SIGCHLD as its exit
            // signal lets `waitpid` reap it.
            let pid = unsafe {
                libc::clone(
                    pause_for_ever,
                    top as *mut libc::c_void,
                    libc::CLONE_VM | libc::SIGCHLD,
                    std::ptr::null_mut(),
                )
            };
            assert!(pid > 0, "clone: {}", std::io::Error::last_os_error());
            VmChild { pid, _stack: stack }
        }
    }

    impl Drop for VmChild {
        fn drop(&mut self) {
            // SAFETY: kill and waitpid take the child's pid (ours to reap) and an out-pointer
            // to a live local.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                let mut status = 0;
                libc::waitpid(self.pid, &mut status, 0);
            }
        }
    }

    /// This process itself and a `CLONE_VM` child share this process's memory, and `kcmp`
    /// says so; a child of its own (`sleep`) does not. The `CLONE_VM` child is no thread of
    /// this process: the `/proc/self/task` check misses it, `kcmp` does not (the refusal
    /// that follows is `arena_tests::a_process_sharing_this_memory_is_not_read`).
    #[test]
    fn a_process_sharing_this_memory_is_known() {
        let own = PeerProcess::open(std::process::id()).expect("a pidfd of this process");
        assert_memory(&own, &Memory::Shared);
        let vm = VmChild::spawn();
        let pid = u32::try_from(vm.pid).unwrap();
        assert!(
            !of_this_process(pid),
            "the CLONE_VM child is no thread here"
        );
        let p = PeerProcess::open(pid).expect("a pidfd of the CLONE_VM child");
        assert_memory(&p, &Memory::Shared);
        drop(vm);
        let apart = Child(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep"),
        );
        let p = PeerProcess::open(apart.0.id()).unwrap();
        assert_memory(&p, &Memory::Apart);
    }
}
