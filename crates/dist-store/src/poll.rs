//! The server's readiness poller: epoll itself on Linux (one `epoll_wait` a turn of the loop, an
//! eventfd to wake it for stopping), `polling` elsewhere. `polling`'s `wait` costs four more
//! system calls a turn on Linux (re-arming its timer and notifier, draining the notifier), as
//! many as the read and the write a request needs; the loop runs a turn per request when
//! clients take turns.

/// The key of the wake-up source; clients' keys are below it.
pub(crate) const NOTIFY: usize = usize::MAX;

/// One readiness report: (key, readable). A writable-only report is `readable == false`.
pub(crate) type Ready = (usize, bool);

#[cfg(target_os = "linux")]
mod imp {
    use std::io;
    use std::os::fd::{AsFd, OwnedFd};

    use std::mem::MaybeUninit;

    use rustix::event::epoll::{self, CreateFlags, Event, EventData, EventFlags};
    use rustix::event::{EventfdFlags, eventfd};

    use super::{NOTIFY, Ready};

    #[derive(Debug)]
    pub(crate) struct Poll {
        epoll: OwnedFd,
        wake: OwnedFd,
    }

    /// Reports taken from one `epoll_wait`; level-triggered, so the rest come with the next.
    const BATCH: usize = 256;

    fn flags(read: bool, write: bool) -> EventFlags {
        let mut f = EventFlags::empty();
        if read {
            f |= EventFlags::IN | EventFlags::RDHUP;
        }
        if write {
            f |= EventFlags::OUT;
        }
        f
    }

    impl Poll {
        pub(crate) fn new() -> io::Result<Poll> {
            let epoll = epoll::create(CreateFlags::CLOEXEC)?;
            let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
            epoll::add(
                &epoll,
                &wake,
                EventData::new_u64(NOTIFY as u64),
                EventFlags::IN,
            )?;
            Ok(Poll { epoll, wake })
        }

        /// Registers `fd` under `key`.
        ///
        /// # Safety
        ///
        /// `fd` must be deleted from this poller before it is closed (`polling`'s contract,
        /// which the other platforms' poller has; epoll itself needs nothing).
        pub(crate) unsafe fn add(
            &self,
            fd: impl AsFd,
            key: usize,
            read: bool,
            write: bool,
        ) -> io::Result<()> {
            let data = EventData::new_u64(key as u64);
            Ok(epoll::add(&self.epoll, fd, data, flags(read, write))?)
        }

        pub(crate) fn modify(
            &self,
            fd: impl AsFd,
            key: usize,
            read: bool,
            write: bool,
        ) -> io::Result<()> {
            let data = EventData::new_u64(key as u64);
            Ok(epoll::modify(&self.epoll, fd, data, flags(read, write))?)
        }

        pub(crate) fn delete(&self, fd: impl AsFd) -> io::Result<()> {
            Ok(epoll::delete(&self.epoll, fd)?)
        }

        /// Blocks until something is ready; appends what is to `out`. A wake-up is reported as
        /// [`NOTIFY`] (and drained).
        pub(crate) fn wait(&self, out: &mut Vec<Ready>) -> io::Result<()> {
            let mut buf = [MaybeUninit::<Event>::uninit(); BATCH];
            let events = match epoll::wait(&self.epoll, &mut buf, None) {
                Ok((events, _)) => events,
                Err(rustix::io::Errno::INTR) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            for ev in events.iter() {
                let key = ev.data.u64() as usize;
                if key == NOTIFY {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&self.wake, &mut b);
                }
                let f = ev.flags;
                let readable = f.intersects(
                    EventFlags::IN | EventFlags::RDHUP | EventFlags::HUP | EventFlags::ERR,
                );
                out.push((key, readable));
            }
            Ok(())
        }

        /// Wakes a [`Poll::wait`] in progress (or the next one).
        pub(crate) fn notify(&self) -> io::Result<()> {
            match rustix::io::write(&self.wake, &1u64.to_ne_bytes()) {
                // A full counter already wakes the loop.
                Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;
    use std::os::fd::AsFd;

    use polling::{Event, Events, PollMode, Poller};

    use super::{NOTIFY, Ready};

    #[derive(Debug)]
    pub(crate) struct Poll {
        poller: Poller,
        events: std::sync::Mutex<Events>,
    }

    impl Poll {
        pub(crate) fn new() -> io::Result<Poll> {
            Ok(Poll {
                poller: Poller::new()?,
                events: std::sync::Mutex::new(Events::new()),
            })
        }

        /// As the Linux one: `fd` must be deleted before it is closed.
        pub(crate) unsafe fn add(
            &self,
            fd: impl AsFd,
            key: usize,
            read: bool,
            write: bool,
        ) -> io::Result<()> {
            // SAFETY: this function's own contract, passed on to its caller: `fd` is deleted
            // from the poller before it is closed.
            unsafe {
                self.poller.add_with_mode(
                    &fd.as_fd(),
                    Event::new(key, read, write),
                    PollMode::Level,
                )
            }
        }

        pub(crate) fn modify(
            &self,
            fd: impl AsFd,
            key: usize,
            read: bool,
            write: bool,
        ) -> io::Result<()> {
            self.poller
                .modify_with_mode(fd.as_fd(), Event::new(key, read, write), PollMode::Level)
        }

        pub(crate) fn delete(&self, fd: impl AsFd) -> io::Result<()> {
            self.poller.delete(fd.as_fd())
        }

        pub(crate) fn wait(&self, out: &mut Vec<Ready>) -> io::Result<()> {
            let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
            events.clear();
            match self.poller.wait(&mut events, None) {
                Ok(0) => out.push((NOTIFY, true)),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
                Err(e) => return Err(e),
            }
            out.extend(events.iter().map(|ev| (ev.key, ev.readable)));
            Ok(())
        }

        pub(crate) fn notify(&self) -> io::Result<()> {
            self.poller.notify()
        }
    }
}

pub(crate) use imp::Poll;
