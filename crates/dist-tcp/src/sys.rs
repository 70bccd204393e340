//! Platform socket flags, from `libc` for the target being built (never a hard-coded number:
//! Linux's `MSG_DONTWAIT` is `MSG_WAITALL` on macOS and the BSDs).

/// Don't block: a `recv`/`send` with this flag fails with `WouldBlock` instead of waiting.
pub(crate) const MSG_DONTWAIT: i32 = libc::MSG_DONTWAIT;

/// A write to a closed peer is an `EPIPE` error, never a `SIGPIPE` that kills the process.
/// Apple's systems have no such flag; there [`prepare`] sets `SO_NOSIGPIPE` on the socket.
#[cfg(not(target_vendor = "apple"))]
pub(crate) const MSG_NOSIGNAL: i32 = libc::MSG_NOSIGNAL;
#[cfg(target_vendor = "apple")]
pub(crate) const MSG_NOSIGNAL: i32 = 0;

/// Sets what the target needs on a connected socket before frames are written to it.
pub(crate) fn prepare(sock: &socket2::Socket) -> std::io::Result<()> {
    #[cfg(target_vendor = "apple")]
    sock.set_nosigpipe(true)?;
    let _ = sock;
    Ok(())
}

/// Hang-up bits of [`poll_read`]'s result: the connection is reset, or shut in both directions
/// (by the peer, or locally).
pub(crate) const HUNG_UP: i16 = libc::POLLHUP | libc::POLLERR;
/// The peer shut its sending side (end of stream after the bytes already received).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) const PEER_SHUT: i16 = libc::POLLRDHUP;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) const PEER_SHUT: i16 = 0;

/// Waits up to `limit` (rounded down to milliseconds) until `fd` has bytes to read or hangs up,
/// without taking any; returns poll's `revents` (0 if the time passed or a signal came).
pub(crate) fn poll_read(
    fd: std::os::fd::RawFd,
    limit: std::time::Duration,
) -> std::io::Result<i16> {
    poll_one(fd, libc::POLLIN | PEER_SHUT, limit.as_millis())
}

/// Waits up to `limit` (rounded up to milliseconds) until `fd` has room to write or hangs up;
/// returns poll's `revents` (0 if the time passed or a signal came).
pub(crate) fn poll_write(
    fd: std::os::fd::RawFd,
    limit: std::time::Duration,
) -> std::io::Result<i16> {
    poll_one(fd, libc::POLLOUT, limit.as_micros().div_ceil(1000))
}

fn poll_one(fd: std::os::fd::RawFd, events: i16, ms: u128) -> std::io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = ms.min(i32::MAX as u128) as i32;
    // SAFETY: `p` is one initialised `pollfd` that outlives the call, and we pass `nfds` = 1.
    // An fd that is not open is reported in `revents` (POLLNVAL), not undefined behaviour.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(p.revents)
}

/// Waits up to `limit` (rounded up to milliseconds) until one of `fds` has what it asks for;
/// returns at once when `fds` is empty and `limit` is zero. Returns how many have events (0 if
/// the time passed or a signal came); an error of `poll` itself is returned.
pub(crate) fn poll_many(
    fds: &mut [libc::pollfd],
    limit: std::time::Duration,
) -> std::io::Result<usize> {
    let ms = limit.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a live, initialised slice of `pollfd` for the whole call, and its length
    // is passed as `nfds`; fds that are not open are reported in `revents` (POLLNVAL).
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

/// Bytes received on `fd` and not yet read.
pub(crate) fn unread(fd: std::os::fd::RawFd) -> std::io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one `c_int` through the pointer, which points to `n`, live here.
    if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags are the target's own: on Linux 0x40 and 0x4000; on the BSDs `MSG_DONTWAIT`
    /// is 0x80 (0x40 there is `MSG_WAITALL`, which the old hard-coded value meant).
    #[test]
    fn flags_are_the_targets() {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        assert_eq!((MSG_DONTWAIT, MSG_NOSIGNAL), (0x40, 0x4000));
        #[cfg(any(target_os = "freebsd", target_vendor = "apple"))]
        assert_eq!(MSG_DONTWAIT, 0x80);
        assert_ne!(MSG_DONTWAIT, libc::MSG_WAITALL);
        assert_ne!(MSG_DONTWAIT, 0);
    }
}
