//! The process at the other end of a connected Unix socket, as the kernel recorded it when the
//! connection was made (`SO_PEERCRED`), and that process held by a pidfd ([`PeerProcess`]):
//! what a rank learns of the peer whose shared-memory descriptors came through the socket
//! (`setup.rs`), before its host arena may read that peer's memory directly (`arena.rs`).

use std::os::fd::AsFd;
#[cfg(target_os = "linux")]
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use super::pidfd::PeerProcess;

/// The process at the other end of `u` ([`socket_pid`]), held by a pidfd taken from the socket
/// where the kernel offers it ([`PeerProcess::of_socket`]); `None` where there is none (then
/// no direct reads of the peer).
pub(super) fn socket_process(u: &UnixStream) -> Option<PeerProcess> {
    PeerProcess::of_socket(u.as_fd(), socket_pid(u)?)
}

/// The process at the other end of `u`, as the kernel recorded it when the connection was made
/// (`SO_PEERCRED`: the connecting process on the accepting side, the listening one on the
/// connecting side), in this process's pid namespace; `None` where it cannot say (then no
/// direct reads of the peer: `arena.rs`), and where the peer's process has no pid in this
/// namespace (the kernel then reports pid 0: ranks in separate containers sharing a network
/// namespace).
#[cfg(target_os = "linux")]
pub(super) fn socket_pid(u: &UnixStream) -> Option<u32> {
    peercred_pid(u.as_raw_fd())
}

/// `SO_PEERCRED`'s pid for the socket `fd`, read into a plain `libc::ucred`: rustix's wrapper
/// holds the pid in a non-zero type, and the kernel's 0 (no pid in this namespace) makes that
/// undefined behaviour. 0 or a failure gives `None`.
#[cfg(target_os = "linux")]
fn peercred_pid(fd: std::os::fd::RawFd) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live, writable `libc::ucred` (every bit pattern valid) and `len` its
    // size, so the kernel writes at most `len` bytes into it; `fd` is borrowed from the
    // caller's socket for the call. Shown by `socket_pid_is_this_process_over_a_pair`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 || len as usize != std::mem::size_of::<libc::ucred>() {
        return None;
    }
    u32::try_from(cred.pid).ok().filter(|&p| p != 0)
}

#[cfg(not(target_os = "linux"))]
pub(super) fn socket_pid(_u: &UnixStream) -> Option<u32> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// `SO_PEERCRED` over a connected pair names this process; a descriptor that is not a
    /// socket gives `None`, not an error or a pid.
    #[test]
    fn socket_pid_is_this_process_over_a_pair() {
        let (u, _v) = UnixStream::pair().unwrap();
        assert_eq!(socket_pid(&u), Some(std::process::id()));
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        assert_eq!(peercred_pid(f.as_raw_fd()), None);
    }
}
