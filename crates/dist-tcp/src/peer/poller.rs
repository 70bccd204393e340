//! The I/O thread's readiness poller: which watched connections became readable, and wakes from
//! other threads. Interest is one-shot: a connection reported readable is not reported again
//! until its interest is registered again ([`Poller::modify`]).
//!
//! On Linux and Android it is epoll through rustix, with an `eventfd` for wakes that stays
//! registered: a wait is one `epoll_wait`, plus a `read` of the `eventfd` when a wake came. The
//! `polling` crate, used elsewhere, spends five system calls on each wait (it arms a `timerfd`
//! for the timeout and registers it and its wake descriptor again every time): at 1,024 ranks
//! on 2 cores those were about 650,000 of the job's 1.5 million system calls.

use std::time::Duration;

/// The key of no connection (ranks are smaller), for the wake descriptor.
#[cfg(any(target_os = "linux", target_os = "android"))]
const WAKE_KEY: u64 = u64::MAX;

/// Readiness of sockets registered under keys (a peer's rank), and wakes.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(super) struct Poller {
    epoll: rustix::fd::OwnedFd,
    wake: rustix::fd::OwnedFd,
}

/// Room for the events of one wait, kept by the waiting thread.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(super) struct Events(Vec<rustix::event::epoll::Event>);

#[cfg(any(target_os = "linux", target_os = "android"))]
impl Events {
    pub(super) fn new() -> Events {
        Events(Vec::with_capacity(256))
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
impl Poller {
    pub(super) fn new() -> std::io::Result<Poller> {
        use rustix::event::epoll::{self, CreateFlags, EventData, EventFlags};
        use rustix::event::{EventfdFlags, eventfd};
        let ep = epoll::create(CreateFlags::CLOEXEC)?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        // Level-triggered: it stays reported until read, and needs no registering again.
        epoll::add(&ep, &wake, EventData::new_u64(WAKE_KEY), EventFlags::IN)?;
        Ok(Poller { epoll: ep, wake })
    }

    /// Watches `fd` under `key`, with no interest yet.
    ///
    /// # Safety
    /// The caller deletes `fd` ([`Poller::delete`]) before it is closed, as the `polling`
    /// fallback requires (epoll itself forgets a closed descriptor; the contract is the same on
    /// every platform so that the I/O thread's code is).
    pub(super) unsafe fn add(&self, fd: impl rustix::fd::AsFd, key: usize) -> std::io::Result<()> {
        use rustix::event::epoll::{self, EventData, EventFlags};
        epoll::add(
            &self.epoll,
            fd,
            EventData::new_u64(key as u64),
            EventFlags::ONESHOT,
        )?;
        Ok(())
    }

    /// Registers (`readable`) or clears the one-shot interest in `fd`, watched under `key`.
    pub(super) fn modify(
        &self,
        fd: impl rustix::fd::AsFd,
        key: usize,
        readable: bool,
    ) -> std::io::Result<()> {
        use rustix::event::epoll::{self, EventData, EventFlags};
        let flags = if readable {
            EventFlags::IN | EventFlags::ONESHOT
        } else {
            EventFlags::ONESHOT
        };
        epoll::modify(&self.epoll, fd, EventData::new_u64(key as u64), flags)?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub(super) fn delete(&self, fd: impl rustix::fd::AsFd) -> std::io::Result<()> {
        rustix::event::epoll::delete(&self.epoll, fd)?;
        Ok(())
    }

    /// Makes the current or next [`Poller::wait`] return.
    pub(super) fn notify(&self) -> std::io::Result<()> {
        match rustix::io::write(&self.wake, &1u64.to_ne_bytes()) {
            // The counter is full (2^64 - 2 wakes unread): the wait returns anyway.
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits until a watched socket is readable, a wake comes, or `timeout` passes (rounded up
    /// to the millisecond; `None`: no limit), and puts the keys of the readable sockets in
    /// `ready` (after what it held).
    pub(super) fn wait(
        &self,
        events: &mut Events,
        ready: &mut Vec<usize>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        use rustix::event::{Timespec, epoll};
        // At most an hour: longer ones would take `epoll_pwait2`, which kernels before 5.11
        // lack (the I/O thread's timers are shorter anyway).
        let timeout = timeout.map(|t| {
            let t = t.min(Duration::from_secs(3600));
            Timespec {
                tv_sec: t.as_secs() as _,
                tv_nsec: t.subsec_nanos() as _,
            }
        });
        events.0.clear();
        epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(&mut events.0),
            timeout.as_ref(),
        )?;
        for ev in events.0.iter() {
            match ev.data.u64() {
                WAKE_KEY => {
                    let mut b = [0u8; 8];
                    // Resets the counter; `AGAIN` if another wait read it first.
                    let _ = rustix::io::read(&self.wake, &mut b);
                }
                key => ready.push(key as usize),
            }
        }
        Ok(())
    }
}

/// Elsewhere: the `polling` crate (kqueue on the BSDs and macOS).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(super) struct Poller {
    poller: polling::Poller,
}

/// Room for the events of one wait, kept by the waiting thread.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(super) struct Events(polling::Events);

#[cfg(not(any(target_os = "linux", target_os = "android")))]
impl Events {
    pub(super) fn new() -> Events {
        Events(polling::Events::new())
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
impl Poller {
    pub(super) fn new() -> std::io::Result<Poller> {
        Ok(Poller {
            poller: polling::Poller::new()?,
        })
    }

    /// Watches `stream` under `key`, with no interest yet.
    ///
    /// # Safety
    /// The caller deletes `stream` ([`Poller::delete`]) before it is closed (`polling`'s
    /// requirement).
    pub(super) unsafe fn add(
        &self,
        stream: &std::net::TcpStream,
        key: usize,
    ) -> std::io::Result<()> {
        // SAFETY: passed on to our caller (see above).
        unsafe { self.poller.add(stream, polling::Event::none(key)) }
    }

    /// Registers (`readable`) or clears the one-shot interest in `stream`, watched under `key`.
    pub(super) fn modify(
        &self,
        stream: &std::net::TcpStream,
        key: usize,
        readable: bool,
    ) -> std::io::Result<()> {
        let ev = if readable {
            polling::Event::readable(key)
        } else {
            polling::Event::none(key)
        };
        self.poller.modify(stream, ev)
    }

    /// Stops watching `stream`.
    pub(super) fn delete(&self, stream: &std::net::TcpStream) -> std::io::Result<()> {
        self.poller.delete(stream)
    }

    /// Makes the current or next [`Poller::wait`] return.
    pub(super) fn notify(&self) -> std::io::Result<()> {
        self.poller.notify()
    }

    /// Waits until a watched socket is readable, a wake comes, or `timeout` passes (`None`: no
    /// limit), and puts the keys of the readable sockets in `ready` (after what it held).
    pub(super) fn wait(
        &self,
        events: &mut Events,
        ready: &mut Vec<usize>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        events.0.clear();
        self.poller.wait(&mut events.0, timeout)?;
        ready.extend(events.0.iter().map(|ev| ev.key));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn wait(p: &Poller, e: &mut Events, timeout: Duration) -> Vec<usize> {
        let mut ready = Vec::new();
        p.wait(e, &mut ready, Some(timeout)).unwrap();
        ready
    }

    /// A readable socket is reported once per registration of interest, under its key, and
    /// not at all without one.
    #[test]
    fn interest_is_one_shot_and_keyed() {
        let (p, mut e) = (Poller::new().unwrap(), Events::new());
        let (mut a, b) = pair();
        // SAFETY: `b` is deleted below, before it drops; if an assertion fails first, the
        // poller (declared before `b`) is dropped after it: epoll forgets a closed descriptor.
        unsafe { p.add(&b, 7) }.unwrap();
        a.write_all(b"x").unwrap();
        let short = Duration::from_millis(20);
        assert!(
            wait(&p, &mut e, short).is_empty(),
            "reported with no interest"
        );
        p.modify(&b, 7, true).unwrap();
        assert_eq!(wait(&p, &mut e, Duration::from_secs(10)), vec![7]);
        assert!(
            wait(&p, &mut e, short).is_empty(),
            "reported twice for one registration"
        );
        p.modify(&b, 7, true).unwrap();
        assert_eq!(wait(&p, &mut e, Duration::from_secs(10)), vec![7]);
        p.modify(&b, 7, false).unwrap();
        assert!(
            wait(&p, &mut e, short).is_empty(),
            "reported after interest was cleared"
        );
        p.delete(&b).unwrap();
    }

    /// A wake from another thread ends a wait with no limit; it is consumed, so the next wait
    /// lasts its timeout; a wake before the wait makes it return at once.
    #[test]
    fn a_wake_ends_one_wait() {
        let (p, mut e) = (std::sync::Arc::new(Poller::new().unwrap()), Events::new());
        let t = Instant::now();
        let waker = {
            let p = p.clone();
            std::thread::spawn(move || p.notify().unwrap())
        };
        let mut ready = Vec::new();
        p.wait(&mut e, &mut ready, None).unwrap();
        waker.join().unwrap();
        assert!(ready.is_empty());
        assert!(t.elapsed() < Duration::from_secs(10));
        let t = Instant::now();
        assert!(wait(&p, &mut e, Duration::from_millis(30)).is_empty());
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "a consumed wake ended a wait"
        );
        p.notify().unwrap();
        let t = Instant::now();
        assert!(wait(&p, &mut e, Duration::from_secs(10)).is_empty());
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "a wake before the wait was lost"
        );
    }
}
