//! [`TcpStore`]: a client of PyTorch's TCPStore protocol (PyTorch's libuv and legacy servers,
//! and dist's [`StoreServer`](crate::StoreServer)), following PyTorch's own client's
//! conventions: user keys go out under `/`, `get` waits before it reads, a timed-out wait is
//! cancelled on the server.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::Store;
use crate::error::{Result, StoreError};
use crate::io::{Fail, Io, Sock, remaining};
use crate::proto::{self, Request, VALIDATION_MAGIC};

/// The prefix PyTorch's client puts before every user key.
pub const KEY_PREFIX: &str = "/";

/// How a [`TcpStore`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    /// Deadline of operations that do not wait for keys (and of connecting).
    pub timeout: Duration,
    /// Longest value or answer accepted from the server; a longer one fails the operation.
    pub max_reply_len: u64,
}

impl Default for ClientOptions {
    /// 300 s (PyTorch's default store timeout), 1 GiB.
    fn default() -> Self {
        ClientOptions {
            timeout: Duration::from_secs(300),
            max_reply_len: 1 << 30,
        }
    }
}

/// A connection to a TCPStore server. One operation at a time goes over it (callers on several
/// threads take turns); open more for concurrency.
#[derive(Debug)]
pub struct TcpStore {
    server: String,
    opts: ClientOptions,
    conn: Mutex<Conn>,
}

#[derive(Debug)]
struct Conn {
    sock: Sock,
    /// An earlier failure left bytes of unknown meaning on the connection.
    broken: bool,
}

fn prefixed(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_PREFIX.len() + key.len());
    k.extend_from_slice(KEY_PREFIX.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

impl TcpStore {
    /// Connects to the server at `addr` with the default options and `timeout` for connecting
    /// and for every operation that does not wait for keys. Retries refused connections until
    /// then (the server may not be up yet), and validates each as PyTorch's client does
    /// (`VALIDATE` magic, then a `PING` whose nonce must come back).
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> Result<TcpStore> {
        TcpStore::connect_with(
            addr,
            ClientOptions {
                timeout,
                ..ClientOptions::default()
            },
        )
    }

    /// As [`TcpStore::connect`], with every option.
    pub fn connect_with(addr: impl ToSocketAddrs, opts: ClientOptions) -> Result<TcpStore> {
        let start = Instant::now();
        let deadline = start + opts.timeout;
        let mut attempts = 0u32;
        let mut backoff = Duration::from_millis(10);
        let mut server = String::from("?");
        loop {
            attempts += 1;
            let err = match Self::try_connect(&addr, deadline, &mut server) {
                Ok(sock) => {
                    return Ok(TcpStore {
                        server,
                        opts,
                        conn: Mutex::new(Conn {
                            sock,
                            broken: false,
                        }),
                    });
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now + backoff >= deadline {
                return Err(StoreError::Connect {
                    server,
                    attempts,
                    elapsed: now - start,
                    source: err,
                });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn try_connect(
        addr: &impl ToSocketAddrs,
        deadline: Instant,
        server: &mut String,
    ) -> io::Result<Sock> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            *server = a.to_string();
            match Self::connect_one(a, deadline) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn connect_one(a: SocketAddr, deadline: Instant) -> io::Result<Sock> {
        let s = TcpStream::connect_timeout(&a, remaining(deadline)?)?;
        s.set_nodelay(true)?;
        let mut s = Sock::new(s);
        let mut io = Io {
            s: &mut s,
            deadline,
            max_reply_len: 0,
        };
        let nonce = std::process::id();
        let mut buf = Vec::new();
        proto::encode_request(&mut buf, &Request::Validate(VALIDATION_MAGIC));
        proto::encode_request(&mut buf, &Request::Ping(nonce));
        io.write_all(&buf)?;
        let back = io.u32()?;
        if back != nonce {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("ping nonce {nonce} came back as {back}"),
            ));
        }
        Ok(s)
    }

    /// The server's address, as dialled.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The deadline of operations that do not wait for keys.
    pub fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    /// The same connection with `timeout` as the deadline of operations that do not wait for
    /// keys (as [`ClientOptions::timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> TcpStore {
        self.opts.timeout = timeout;
        self
    }

    /// This end's address of the connection: the local interface that reaches the server.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.sock.stream.local_addr()
    }

    /// Runs one exchange under the connection's lock, within `deadline`, giving any failure
    /// the operation's context. A failure that may leave a reply in flight breaks the connection.
    fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        deadline: Instant,
        f: impl FnOnce(&mut Io<'_>) -> Result<T, Fail>,
    ) -> Result<T> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.broken {
            return Err(StoreError::Broken {
                op,
                key: key.into(),
                server: self.server.clone(),
            });
        }
        let mut io = Io {
            s: &mut conn.sock,
            deadline,
            max_reply_len: self.opts.max_reply_len,
        };
        match f(&mut io) {
            Ok(v) => Ok(v),
            Err(fail) => {
                conn.broken = true;
                Err(match fail {
                    Fail::Io(source) => StoreError::Io {
                        op,
                        key: key.into(),
                        server: self.server.clone(),
                        source,
                    },
                    Fail::Timeout(what) => StoreError::Timeout {
                        op,
                        key: key.into(),
                        server: self.server.clone(),
                        timeout: self.opts.timeout,
                        waited_for: what.into(),
                    },
                    Fail::Protocol(detail) => StoreError::Protocol {
                        op,
                        key: key.into(),
                        server: self.server.clone(),
                        detail,
                    },
                })
            }
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.opts.timeout
    }

    /// Sends WAIT for `keys` (already prefixed) and reads its answer within `timeout`; on
    /// timeout cancels the wait as PyTorch's client does and reports `Ok(false)`.
    fn do_wait(io: &mut Io<'_>, keys: &[&[u8]], timeout: Duration) -> Result<bool, Fail> {
        io.send(&Request::Wait(keys.to_vec()))?;
        Self::stop_or_cancel(io, "wait", timeout)
    }

    /// After a request the server answers with STOP_WAITING once it is met (WAIT, BARRIER):
    /// reads that answer within `timeout` (`Ok(true)`); on timeout sends CANCEL_WAIT and reads
    /// WAIT_CANCELED, after a STOP_WAITING that may have crossed the cancel (`Ok(false)`).
    /// `what` names the request in a protocol error.
    fn stop_or_cancel(io: &mut Io<'_>, what: &str, timeout: Duration) -> Result<bool, Fail> {
        let wait_deadline = Instant::now() + timeout;
        let cancel_deadline = io.deadline.max(wait_deadline) + Duration::from_secs(30);
        io.deadline = wait_deadline;
        match io.u8() {
            Ok(proto::STOP_WAITING) => return Ok(true),
            Ok(b) => {
                return Err(Fail::Protocol(format!(
                    "{what} answered {b}, not STOP_WAITING"
                )));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(Fail::Io(e)),
        }
        // The wait timed out: cancel it. The server may have sent STOP_WAITING just before it
        // saw the cancel; then WAIT_CANCELED follows it.
        io.deadline = cancel_deadline;
        io.send(&Request::CancelWait)?;
        let mut b = io.u8()?;
        if b == proto::STOP_WAITING {
            b = io.u8()?;
        }
        if b != proto::WAIT_CANCELED {
            return Err(Fail::Protocol(format!(
                "cancel_wait answered {b}, not WAIT_CANCELED"
            )));
        }
        Ok(false)
    }

    fn wait_timeout(&self, op: &'static str, keys: &[&str], timeout: Duration) -> StoreError {
        StoreError::Timeout {
            op,
            key: keys.first().copied().unwrap_or("").into(),
            server: self.server.clone(),
            timeout,
            waited_for: format!("keys {keys:?}"),
        }
    }

    fn check_count(&self, op: &'static str, keys: &[&str], n: usize) -> Result<()> {
        if keys.len() != n {
            return Err(StoreError::InvalidArgument {
                op,
                key: keys.first().copied().unwrap_or("").into(),
                server: self.server.clone(),
                detail: format!("{} keys and {n} values", keys.len()),
            });
        }
        Ok(())
    }

    /// `BARRIER`: the server-side barrier newer PyTorch servers (and dist's) offer. PyTorch's
    /// 2.11 servers do not know it and close the connection; [`Store::barrier`] works with all.
    pub fn server_barrier(&self, key: &str, world_size: usize, timeout: Duration) -> Result<()> {
        let k = prefixed(key);
        let done = self.call("server_barrier", key, self.deadline(), |io| {
            io.send(&Request::Barrier(&k, world_size as i64))?;
            Self::stop_or_cancel(io, "barrier", timeout)
        })?;
        if done {
            Ok(())
        } else {
            Err(self.wait_timeout("server_barrier", &[key], timeout))
        }
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = prefixed(key);
        self.call("set", key, self.deadline(), |io| {
            Ok(io.send(&Request::Set(&k, value))?)
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = prefixed(key);
        let got = self.call("get", key, self.deadline(), |io| {
            if !Self::do_wait(io, &[&k], timeout)? {
                return Ok(None);
            }
            io.deadline = Instant::now() + self.opts.timeout;
            io.send(&Request::Get(&k))?;
            Ok(Some(io.bytes()?))
        })?;
        got.ok_or_else(|| self.wait_timeout("get", &[key], timeout))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = prefixed(key);
        self.call("add", key, self.deadline(), |io| {
            io.send(&Request::Add(&k, delta))?;
            Ok(io.i64()?)
        })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = prefixed(key);
        self.call("compare_set", key, self.deadline(), |io| {
            io.send(&Request::CompareSet(&k, expected, desired))?;
            io.bytes()
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        let key0 = keys.first().copied().unwrap_or("");
        let done = self.call("wait", key0, self.deadline(), |io| {
            Self::do_wait(io, &refs, timeout)
        })?;
        if done {
            Ok(())
        } else {
            Err(self.wait_timeout("wait", keys, timeout))
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        let key0 = keys.first().copied().unwrap_or("");
        self.call("check", key0, self.deadline(), |io| {
            io.send(&Request::Check(refs))?;
            match io.u8()? {
                proto::CHECK_READY => Ok(true),
                proto::CHECK_NOT_READY => Ok(false),
                b => Err(Fail::Protocol(format!("check answered {b}"))),
            }
        })
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        let k = prefixed(key);
        self.call("delete_key", key, self.deadline(), |io| {
            io.send(&Request::DeleteKey(&k))?;
            Ok(io.i64()? == 1)
        })
    }

    fn num_keys(&self) -> Result<i64> {
        self.call("num_keys", "", self.deadline(), |io| {
            io.send(&Request::NumKeys)?;
            Ok(io.i64()?)
        })
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = prefixed(key);
        self.call("append", key, self.deadline(), |io| {
            Ok(io.send(&Request::Append(&k, value))?)
        })
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        let key0 = keys.first().copied().unwrap_or("");
        let got = self.call("multi_get", key0, self.deadline(), |io| {
            if !Self::do_wait(io, &refs, timeout)? {
                return Ok(None);
            }
            io.deadline = Instant::now() + self.opts.timeout;
            io.send(&Request::MultiGet(refs.clone()))?;
            let mut out = Vec::with_capacity(refs.len());
            for _ in 0..refs.len() {
                out.push(io.bytes()?);
            }
            Ok(Some(out))
        })?;
        got.ok_or_else(|| self.wait_timeout("multi_get", keys, timeout))
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        self.check_count("multi_set", keys, values.len())?;
        let ks: Vec<Vec<u8>> = keys.iter().map(|k| prefixed(k)).collect();
        let pairs: Vec<(&[u8], &[u8])> = ks
            .iter()
            .map(Vec::as_slice)
            .zip(values.iter().copied())
            .collect();
        let key0 = keys.first().copied().unwrap_or("");
        self.call("multi_set", key0, self.deadline(), |io| {
            Ok(io.send(&Request::MultiSet(pairs))?)
        })
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = prefixed(key);
        self.call("queue_push", key, self.deadline(), |io| {
            Ok(io.send(&Request::QueuePush(&k, value))?)
        })
    }

    fn queue_pop(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = prefixed(key);
        let deadline = Instant::now() + timeout;
        loop {
            // Another client may take the item between the wake-up and the pop: wait again.
            let left = deadline.saturating_duration_since(Instant::now());
            let got = self.call("queue_pop", key, self.deadline(), |io| {
                if !Self::do_wait(io, &[&k], left)? {
                    return Ok(None);
                }
                io.deadline = Instant::now() + self.opts.timeout;
                Self::pop(io, &k)
            })?;
            match got {
                Some(v) => return Ok(v),
                None if Instant::now() >= deadline => {
                    return Err(self.wait_timeout("queue_pop", &[key], timeout));
                }
                None => {}
            }
        }
    }

    fn try_queue_pop(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let k = prefixed(key);
        self.call("queue_pop", key, self.deadline(), |io| Self::pop(io, &k))
    }

    fn queue_len(&self, key: &str) -> Result<i64> {
        let k = prefixed(key);
        self.call("queue_len", key, self.deadline(), |io| {
            io.send(&Request::QueueLen(&k))?;
            Ok(io.i64()?)
        })
    }

    fn list_keys(&self) -> Result<Vec<String>> {
        self.call("list_keys", "", self.deadline(), |io| {
            io.send(&Request::ListKeys)?;
            let n = io.i64()?;
            if n < 0 {
                return Err(Fail::Protocol(format!("list_keys answered a count of {n}")));
            }
            let mut keys = Vec::new();
            for _ in 0..n {
                let k = io.bytes()?;
                // PyTorch's client lists its own keys only (those under its prefix).
                if let Some(rest) = k.strip_prefix(KEY_PREFIX.as_bytes()) {
                    keys.push(String::from_utf8_lossy(rest).into_owned());
                }
            }
            Ok(keys)
        })
    }

    fn barrier(&self, key: &str, world_size: usize, timeout: Duration) -> Result<()> {
        crate::counting_barrier(self, key, world_size, timeout)
    }
}

impl TcpStore {
    /// `QUEUE_POP`: `Ok(None)` when the queue was empty.
    fn pop(io: &mut Io<'_>, k: &[u8]) -> Result<Option<Vec<u8>>, Fail> {
        io.send(&Request::QueuePop(k))?;
        let n = io.i64()?;
        if n <= 0 {
            return Ok(None);
        }
        Ok(Some(io.bytes()?))
    }
}
