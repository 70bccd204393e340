//! A peer's process held by a pidfd, for direct reads of its memory: while the pidfd is held
//! and the process has not exited, its pid names it and nothing else (a pid is handed out again
//! only once its process is gone), so a read by pid between two checks that it lives reads that
//! process.

use std::os::fd::OwnedFd;

use rustix::event::{PollFd, PollFlags, Timespec};

/// A peer's process: its pid and a pidfd of it, opened when its socket's `SO_PEERCRED` was read.
#[derive(Debug)]
pub(crate) struct PeerProcess {
    pid: u32,
    fd: OwnedFd,
}

impl PeerProcess {
    /// A pidfd of process `pid`; `None` where there is none: the kernel has no `pidfd_open`
    /// (before Linux 5.3: then no direct reads), the process is gone, or `pid` is a thread
    /// that does not lead its thread group.
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
        Some(PeerProcess { pid, fd })
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn open(_pid: u32) -> Option<PeerProcess> {
        None
    }

    /// The process's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
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
mod tests {
    use super::*;

    /// A child's pidfd says it lives, then that it exited; a thread of this process (not a
    /// thread-group leader) has none, and is of this process.
    #[test]
    fn a_pidfd_follows_its_process() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let p = PeerProcess::open(child.id()).expect("pidfd_open of a child");
        assert_eq!(p.pid(), child.id());
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
}
