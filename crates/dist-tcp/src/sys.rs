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
    // (Test: `tests::poll_and_unread_report_a_sockets_state`.)
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
    // is passed as `nfds`; fds that are not open are reported in `revents` (POLLNVAL). (Test:
    // `tests::poll_many_reports_each_fd`.)
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
    // (Test: `tests::poll_and_unread_report_a_sockets_state`.)
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

    /// A descriptor number no process here has open (far past any open-file limit).
    const NOT_OPEN: std::os::fd::RawFd = 1 << 30;

    /// `poll_read`, `poll_write` and `unread` on a socket pair: nothing to read, then the
    /// bytes written (all of them unread), then the peer's shutdown; room to write, then none
    /// once the buffer is full (the wait ends at its limit); a descriptor that is not open is
    /// `POLLNVAL`, not an error.
    #[test]
    fn poll_and_unread_report_a_sockets_state() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::time::{Duration, Instant};
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = b.as_raw_fd();
        assert_eq!(poll_read(fd, Duration::ZERO).unwrap(), 0);
        assert_eq!(unread(fd).unwrap(), 0);
        a.write_all(b"hello").unwrap();
        assert_ne!(
            poll_read(fd, Duration::from_secs(5)).unwrap() & libc::POLLIN,
            0
        );
        assert_eq!(unread(fd).unwrap(), 5);
        a.shutdown(std::net::Shutdown::Write).unwrap();
        let ev = poll_read(fd, Duration::from_secs(5)).unwrap();
        assert_ne!(ev & (PEER_SHUT | libc::POLLIN), 0, "{ev:#x}");
        // Room to write, until the buffer is full.
        let (c, _d) = std::os::unix::net::UnixStream::pair().unwrap();
        let w2 = c.as_raw_fd();
        assert_ne!(poll_write(w2, Duration::ZERO).unwrap() & libc::POLLOUT, 0);
        c.set_nonblocking(true).unwrap();
        let mut c = c;
        while c.write(&[0u8; 4096]).is_ok() {}
        let t = Instant::now();
        assert_eq!(poll_write(w2, Duration::from_millis(50)).unwrap(), 0);
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
        assert_ne!(
            poll_read(NOT_OPEN, Duration::ZERO).unwrap() & libc::POLLNVAL,
            0
        );
        assert!(unread(NOT_OPEN).is_err());
    }

    /// `poll_many` reports which descriptors are ready, each in its own `revents`, and returns
    /// at once with none and no time to wait.
    #[test]
    fn poll_many_reports_each_fd() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::time::Duration;
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (_c, d) = std::os::unix::net::UnixStream::pair().unwrap();
        a.write_all(b"x").unwrap();
        let mut fds = [b.as_raw_fd(), d.as_raw_fd(), NOT_OPEN].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        assert_eq!(poll_many(&mut fds, Duration::from_secs(5)).unwrap(), 2);
        assert_ne!(fds[0].revents & libc::POLLIN, 0);
        assert_eq!(fds[1].revents, 0);
        assert_ne!(fds[2].revents & libc::POLLNVAL, 0);
        assert_eq!(poll_many(&mut [], Duration::ZERO).unwrap(), 0);
    }
}
