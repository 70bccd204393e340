//! The client's socket: every read and write within a deadline, and the failures an exchange
//! can end in before the operation's context is added.

use std::io::{self, Read, Write};
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

/// A socket with a deadline on every read and write.
pub(crate) struct Io<'a> {
    pub(crate) s: &'a mut TcpStream,
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

impl Io<'_> {
    pub(crate) fn send(&mut self, req: &Request<'_>) -> io::Result<()> {
        let mut buf = Vec::new();
        proto::encode_request(&mut buf, req);
        self.write_all(&buf)
    }

    pub(crate) fn write_all(&mut self, mut b: &[u8]) -> io::Result<()> {
        while !b.is_empty() {
            self.s.set_write_timeout(Some(remaining(self.deadline)?))?;
            match self.s.write(b) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => b = &b[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(crate) fn read_exact(&mut self, mut b: &mut [u8]) -> io::Result<()> {
        while !b.is_empty() {
            self.s.set_read_timeout(Some(remaining(self.deadline)?))?;
            match self.s.read(b) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    ));
                }
                Ok(n) => b = &mut b[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
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
        // Grow with what arrives rather than trusting the length with an allocation.
        let mut v = Vec::with_capacity((len as usize).min(1 << 20));
        let mut chunk = [0u8; 64 * 1024];
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(chunk.len());
            self.read_exact(&mut chunk[..n])?;
            v.extend_from_slice(&chunk[..n]);
            left -= n;
        }
        Ok(v)
    }
}
