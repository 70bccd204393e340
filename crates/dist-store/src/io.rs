//! The client's socket: every read and write within a deadline, and the failures an exchange
//! can end in before the operation's context is added.
//!
//! Few system calls an exchange: answers are read through a small buffer (a GET's length and
//! value come with one `read`), a large value is written from the caller's slice with one
//! vectored write, and the socket's timeouts are set only when the one set would pass the
//! deadline (it is set a little short of it, so that the next operations, whose deadlines lie
//! later, reuse it; a read that times out early is retried until the deadline).

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::proto::{self, Request};

/// Why an exchange failed, before it is given the operation's context.
pub(crate) enum Fail {
    Io(io::Error),
    Timeout(&'static str),
    Protocol(String),
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            Fail::Timeout("the server's reply")
        } else {
            Fail::Io(e)
        }
    }
}

/// Bytes read ahead of need: a few answers' worth.
const READ_AHEAD: usize = 16 * 1024;
/// The most of a value allocated before it arrives.
const GROW: usize = 8 << 20;

/// A connection's socket and what the client keeps beside it.
#[derive(Debug)]
pub(crate) struct Sock {
    pub(crate) stream: TcpStream,
    rbuf: Box<[u8]>,
    /// `rbuf[rpos..rend]` is read and not yet taken.
    rpos: usize,
    rend: usize,
    /// The receive and send timeouts set on the socket now.
    rto: Option<Duration>,
    wto: Option<Duration>,
    /// A request's bytes before its trailing value.
    wbuf: Vec<u8>,
}

impl Sock {
    pub(crate) fn new(stream: TcpStream) -> Sock {
        Sock {
            stream,
            rbuf: vec![0u8; READ_AHEAD].into_boxed_slice(),
            rpos: 0,
            rend: 0,
            rto: None,
            wto: None,
            wbuf: Vec::with_capacity(256),
        }
    }
}

/// A socket with a deadline on every read and write.
pub(crate) struct Io<'a> {
    pub(crate) s: &'a mut Sock,
    pub(crate) deadline: Instant,
    pub(crate) max_reply_len: u64,
}

pub(crate) fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::ErrorKind::TimedOut.into())
    } else {
        Ok(left)
    }
}

/// Makes sure the socket's timeout `set` (now `current`) ends no later than `deadline`: keeps
/// it if so, else sets it a sixteenth short of the time left.
fn arm(
    current: &mut Option<Duration>,
    deadline: Instant,
    set: impl FnOnce(Option<Duration>) -> io::Result<()>,
) -> io::Result<()> {
    let left = remaining(deadline)?;
    if current.is_some_and(|t| t <= left) {
        return Ok(());
    }
    let t = (left - left / 16).max(Duration::from_millis(1)).min(left);
    set(Some(t))?;
    *current = Some(t);
    Ok(())
}

/// Whether `e` is a socket timeout (early, or at the deadline).
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl Io<'_> {
    fn arm_read(&mut self) -> io::Result<()> {
        let stream = &self.s.stream;
        arm(&mut self.s.rto, self.deadline, |t| {
            stream.set_read_timeout(t)
        })
    }

    fn arm_write(&mut self) -> io::Result<()> {
        let stream = &self.s.stream;
        arm(&mut self.s.wto, self.deadline, |t| {
            stream.set_write_timeout(t)
        })
    }

    pub(crate) fn send(&mut self, req: &Request<'_>) -> io::Result<()> {
        let mut head = std::mem::take(&mut self.s.wbuf);
        head.clear();
        let tail = proto::encode_request_head(&mut head, req);
        let r = self.write_two(&head, tail);
        self.s.wbuf = head;
        r
    }

    /// Writes `a` then `b`, vectored.
    fn write_two(&mut self, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
        while !a.is_empty() || !b.is_empty() {
            self.arm_write()?;
            let r = if a.is_empty() {
                self.s.stream.write(b)
            } else {
                self.s
                    .stream
                    .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
            };
            match r {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    let from_a = n.min(a.len());
                    a = &a[from_a..];
                    b = &b[n - from_a..];
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) && Instant::now() < self.deadline => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(crate) fn write_all(&mut self, b: &[u8]) -> io::Result<()> {
        self.write_two(b, &[])
    }

    /// Reads more into the buffer (which is empty); fails on end of stream or deadline.
    fn fill(&mut self) -> io::Result<()> {
        loop {
            self.arm_read()?;
            match self.s.stream.read(&mut self.s.rbuf) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    ));
                }
                Ok(n) => {
                    self.s.rpos = 0;
                    self.s.rend = n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) && Instant::now() < self.deadline => {}
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) fn read_exact(&mut self, mut b: &mut [u8]) -> io::Result<()> {
        while !b.is_empty() {
            if self.s.rpos == self.s.rend {
                self.fill()?;
            }
            let n = b.len().min(self.s.rend - self.s.rpos);
            b[..n].copy_from_slice(&self.s.rbuf[self.s.rpos..self.s.rpos + n]);
            self.s.rpos += n;
            b = &mut b[n..];
        }
        Ok(())
    }

    pub(crate) fn u8(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    pub(crate) fn i64(&mut self) -> io::Result<i64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    pub(crate) fn u32(&mut self) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    pub(crate) fn bytes(&mut self) -> Result<Vec<u8>, Fail> {
        let len = self.i64()? as u64;
        if len > self.max_reply_len {
            return Err(Fail::Protocol(format!(
                "a value of {len} bytes, more than the {} this client accepts",
                self.max_reply_len
            )));
        }
        let len = len as usize;
        let buffered = len.min(self.s.rend - self.s.rpos);
        let mut v = Vec::with_capacity(len.min(GROW));
        v.extend_from_slice(&self.s.rbuf[self.s.rpos..self.s.rpos + buffered]);
        self.s.rpos += buffered;
        // The rest straight into the value, as much a read as the socket holds. At most 8 MiB
        // (the largest value PyTorch's libuv server takes) is trusted with an allocation before
        // it arrives; a longer value grows by that much at a time.
        while v.len() < len {
            let mut filled = v.len();
            let end = len.min(filled + GROW);
            v.resize(end, 0);
            while filled < end {
                self.arm_read()?;
                match self.s.stream.read(&mut v[filled..end]) {
                    Ok(0) => {
                        return Err(Fail::Io(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the server closed the connection",
                        )));
                    }
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if timed_out(&e) && Instant::now() < self.deadline => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(v)
    }
}
