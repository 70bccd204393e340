//! Simulated hosts with latency between them, without `tc netem` (which kernels built without
//! `CONFIG_NET_SCH_NETEM`, this project's among them, lack): each host's `eth0` is a TAP device
//! whose other side is a file descriptor of the launcher, and a hub in the launcher passes every
//! frame one host sends to every other host, each frame held the delay first. The hub costs
//! tens of microseconds per frame and a copy per host; it is for latency, not bandwidth.
//!
//! Every `unsafe` block here is a system call on descriptors this module owns, with buffers
//! that live for the call; the multirank target's trial `hosts_delay_holds_every_frame` runs
//! them all (two hosts 20 ms apart: every TCP round trip takes at least 40 ms).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the hub's threads look at their stop flag.
const TICK: Duration = Duration::from_millis(50);
/// Room for any frame (the TAP's MTU is 1,500; a frame adds its 14-byte header).
const FRAME_MAX: usize = 65_536;

/// Something on the path between the hosts (for tests of what it can do to their traffic):
/// the hub hands it each frame, with the host that sent it, before passing anything on, and
/// passes on the frames it returns in its place (none: the frame is dropped; more: frames
/// injected). It runs on the hub's one forwarding thread, frame after frame in order.
pub type OnPath = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Vec<u8>> + Send>;

/// The hub's threads; dropping it stops and joins them.
#[derive(Debug)]
pub(crate) struct Hub {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn open(path: &str) -> Result<OwnedFd, String> {
    let c = std::ffi::CString::new(path).map_err(|_| format!("bad path {path:?}"))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call; a non-negative result is a
    // descriptor this process now owns alone, given to `OwnedFd` at once.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(os_err(&format!("open {path}")));
    }
    // SAFETY: as above: `fd` is open and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_ro(path: &str) -> Result<OwnedFd, String> {
    let c = std::ffi::CString::new(path).map_err(|_| format!("bad path {path:?}"))?;
    // SAFETY: as in `open`.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(os_err(&format!("open {path}")));
    }
    // SAFETY: as in `open`.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn setns(fd: &OwnedFd) -> Result<(), String> {
    // SAFETY: `fd` is an open namespace descriptor; setns changes only the calling thread's
    // network namespace (a thread `tap_in` starts for this alone).
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(os_err("setns"));
    }
    Ok(())
}

/// A TAP device named `name` inside network namespace `netns`, and the descriptor that is its
/// other side (the device goes when the descriptor closes). Made on a thread of its own, which
/// enters the namespace and ends, so no other thread of this process changes namespace.
pub(crate) fn tap_in(netns: &str, name: &str) -> Result<OwnedFd, String> {
    let target = open_ro(&format!("/run/netns/{netns}"))?;
    let name = name.to_string();
    std::thread::spawn(move || -> Result<OwnedFd, String> {
        setns(&target)?;
        let tun = open("/dev/net/tun")?;
        // SAFETY: ifreq is plain data, valid when zeroed.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        if name.len() >= req.ifr_name.len() {
            return Err(format!("interface name {name:?} is too long"));
        }
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one `ifreq`, which `req` is, alive for the call.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(os_err("ioctl TUNSETIFF"));
        }
        Ok(tun)
    })
    .join()
    .map_err(|_| "the thread that makes a TAP panicked".to_string())?
}

/// Whether `fd` has a frame to read within [`TICK`].
fn readable(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the call.
    let n = unsafe { libc::poll(&mut p, 1, TICK.as_millis() as libc::c_int) };
    n > 0 && p.revents & libc::POLLIN != 0
}

impl Hub {
    /// Starts passing frames between `taps`, each held `delay`, through `on_path` if given.
    pub(crate) fn start(taps: Vec<OwnedFd>, delay: Duration, mut on_path: Option<OnPath>) -> Hub {
        let taps: Arc<Vec<OwnedFd>> = Arc::new(taps);
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<(Instant, usize, Vec<u8>)>();
        let mut threads = Vec::new();
        for from in 0..taps.len() {
            let (taps, stop, tx) = (taps.clone(), stop.clone(), tx.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; FRAME_MAX];
                while !stop.load(Ordering::Relaxed) {
                    if !readable(&taps[from]) {
                        continue;
                    }
                    // SAFETY: `buf` is valid for `buf.len()` writes for the call.
                    let n = unsafe {
                        libc::read(taps[from].as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                    };
                    if n > 0 {
                        let frame = buf[..n as usize].to_vec();
                        if tx.send((Instant::now() + delay, from, frame)).is_err() {
                            return;
                        }
                    }
                }
            }));
        }
        drop(tx);
        let stop2 = stop.clone();
        threads.push(std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let (due, from, frame) = match rx.recv_timeout(TICK) {
                    Ok(f) => f,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                // Frames come in the order they are due (one delay for all): hold each until
                // its time.
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let frames = match on_path.as_mut() {
                    Some(f) => f(from, frame),
                    None => vec![frame],
                };
                for frame in &frames {
                    for (to, tap) in taps.iter().enumerate() {
                        if to != from {
                            // SAFETY: `frame` is valid for `frame.len()` reads for the call. A
                            // frame the device refuses (its host's link down, or one malformed
                            // by `on_path`) is dropped, as a wire would.
                            let _ = unsafe {
                                libc::write(tap.as_raw_fd(), frame.as_ptr().cast(), frame.len())
                            };
                        }
                    }
                }
            }
        }));
        Hub { stop, threads }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
