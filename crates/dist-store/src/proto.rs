//! PyTorch's TCPStore wire format, as pure functions over bytes: the query types, the request
//! parser the server runs (incremental, bounded, never panics) and the encoders both sides use.
//!
//! A request is a `u8` query type followed by its arguments, with no frame around it. Integers are
//! little-endian; a string (key or value) is a `u64` length and its bytes; a list is a `u64` count
//! and its items. The server answers some queries and not others (see [`Request`]).

/// The magic a new connection's first query (`VALIDATE`) carries.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Query type bytes, in PyTorch's `QueryType` order.
#[allow(missing_docs)]
pub mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// `CHECK`'s one-byte answer: all keys present.
pub const CHECK_READY: u8 = 0;
/// `CHECK`'s one-byte answer: some key missing.
pub const CHECK_NOT_READY: u8 = 1;
/// The byte that ends a `WAIT` (or `BARRIER`): every key is there.
pub const STOP_WAITING: u8 = 0;
/// The byte that answers `CANCEL_WAIT`.
pub const WAIT_CANCELED: u8 = 1;

/// What the parser accepts; a request beyond any of these closes its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    /// Longest key, bytes.
    pub max_key_len: usize,
    /// Longest value, bytes.
    pub max_value_len: usize,
    /// Most keys in one `CHECK`, `WAIT`, `MULTI_GET` or `MULTI_SET`.
    pub max_keys_per_request: usize,
    /// Longest whole request, bytes.
    pub max_request_len: usize,
}

impl Default for WireLimits {
    /// PyTorch's libuv server's caps (8 KiB keys, 8 MiB values, 128 Ki keys a request), and
    /// 64 MiB for a whole request.
    fn default() -> Self {
        WireLimits {
            max_key_len: 8 * 1024,
            max_value_len: 8 * 1024 * 1024,
            max_keys_per_request: 128 * 1024,
            max_request_len: 64 * 1024 * 1024,
        }
    }
}

/// One parsed request, borrowing its keys and values from the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// `VALIDATE magic`: no answer.
    Validate(u32),
    /// `SET key value`: no answer.
    Set(&'a [u8], &'a [u8]),
    /// `COMPARE_SET key expected desired`: answers the value now stored (see the server).
    CompareSet(&'a [u8], &'a [u8], &'a [u8]),
    /// `GET key`: answers the value (empty if missing).
    Get(&'a [u8]),
    /// `ADD key i64`: answers the new `i64`.
    Add(&'a [u8], i64),
    /// `CHECK keys`: answers [`CHECK_READY`] or [`CHECK_NOT_READY`].
    Check(Vec<&'a [u8]>),
    /// `WAIT keys`: answers [`STOP_WAITING`] once all are present.
    Wait(Vec<&'a [u8]>),
    /// `GETNUMKEYS`: answers an `i64`.
    NumKeys,
    /// `DELETE_KEY key`: answers an `i64` (1 deleted, 0 absent).
    DeleteKey(&'a [u8]),
    /// `APPEND key value`: no answer.
    Append(&'a [u8], &'a [u8]),
    /// `MULTI_GET keys`: answers each value.
    MultiGet(Vec<&'a [u8]>),
    /// `MULTI_SET (key value)*`: no answer.
    MultiSet(Vec<(&'a [u8], &'a [u8])>),
    /// `CANCEL_WAIT`: answers [`WAIT_CANCELED`].
    CancelWait,
    /// `PING nonce`: answers the nonce.
    Ping(u32),
    /// `QUEUE_PUSH key value`: no answer.
    QueuePush(&'a [u8], &'a [u8]),
    /// `QUEUE_POP key`: answers an `i64` length and, if it was not 0, the popped value.
    QueuePop(&'a [u8]),
    /// `QUEUE_LEN key`: answers an `i64`.
    QueueLen(&'a [u8]),
    /// `LIST_KEYS`: answers an `i64` count and each key.
    ListKeys,
    /// `BARRIER key world_size`: answers [`STOP_WAITING`] once `world_size` arrived.
    Barrier(&'a [u8], i64),
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    /// The first byte is no query type.
    #[error("unknown query type {0}")]
    UnknownQuery(u8),
    /// A key longer than [`WireLimits::max_key_len`].
    #[error("key of {len} bytes, limit {limit}")]
    KeyTooLong {
        /// Its length.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// A value longer than [`WireLimits::max_value_len`].
    #[error("value of {len} bytes, limit {limit}")]
    ValueTooLong {
        /// Its length.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// More keys than [`WireLimits::max_keys_per_request`].
    #[error("{count} keys in one request, limit {limit}")]
    TooManyKeys {
        /// The count sent.
        count: u64,
        /// The limit.
        limit: usize,
    },
    /// A request longer than [`WireLimits::max_request_len`].
    #[error("request of more than {limit} bytes")]
    RequestTooLong {
        /// The limit.
        limit: usize,
    },
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a WireLimits,
    /// When the request is incomplete: the bytes it is known to need at least.
    need: usize,
}

/// `Ok(None)` inside the parser: the request is not complete yet.
type Step<T> = Result<Option<T>, ParseError>;

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Step<&'a [u8]> {
        let end = match self.pos.checked_add(n) {
            Some(e) => e,
            None => {
                return Err(ParseError::RequestTooLong {
                    limit: self.limits.max_request_len,
                });
            }
        };
        if end > self.limits.max_request_len {
            return Err(ParseError::RequestTooLong {
                limit: self.limits.max_request_len,
            });
        }
        if end > self.buf.len() {
            self.need = end;
            return Ok(None);
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(Some(s))
    }

    fn u64(&mut self) -> Step<u64> {
        Ok(self
            .take(8)?
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))))
    }

    fn u32(&mut self) -> Step<u32> {
        Ok(self
            .take(4)?
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))))
    }

    fn key(&mut self) -> Step<&'a [u8]> {
        let Some(len) = self.u64()? else {
            return Ok(None);
        };
        if len > self.limits.max_key_len as u64 {
            return Err(ParseError::KeyTooLong {
                len,
                limit: self.limits.max_key_len,
            });
        }
        self.take(len as usize)
    }

    fn value(&mut self) -> Step<&'a [u8]> {
        let Some(len) = self.u64()? else {
            return Ok(None);
        };
        if len > self.limits.max_value_len as u64 {
            return Err(ParseError::ValueTooLong {
                len,
                limit: self.limits.max_value_len,
            });
        }
        self.take(len as usize)
    }

    fn count(&mut self) -> Step<usize> {
        let Some(n) = self.u64()? else {
            return Ok(None);
        };
        if n > self.limits.max_keys_per_request as u64 {
            return Err(ParseError::TooManyKeys {
                count: n,
                limit: self.limits.max_keys_per_request,
            });
        }
        Ok(Some(n as usize))
    }

    fn keys(&mut self) -> Step<Vec<&'a [u8]>> {
        let Some(n) = self.count()? else {
            return Ok(None);
        };
        // Each key takes at least its 8-byte length: never reserve more than the bytes present.
        let mut keys = Vec::with_capacity(n.min((self.buf.len() - self.pos) / 8));
        for _ in 0..n {
            let Some(k) = self.key()? else {
                return Ok(None);
            };
            keys.push(k);
        }
        Ok(Some(keys))
    }
}

macro_rules! need {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

/// Parses the request at the start of `buf`: `Ok(Some((request, bytes used)))`, `Ok(None)` when
/// `buf` holds only part of it (call again with more), or the reason to close the connection.
/// Every length is checked against `limits` as soon as it is read, before anything is reserved.
pub fn parse_request<'a>(buf: &'a [u8], limits: &'a WireLimits) -> Step<(Request<'a>, usize)> {
    Ok(parse_or_need(buf, limits)?.ok())
}

/// As [`parse_request`], but an incomplete request comes back as `Err(n)`: the request is known
/// to need at least `n` bytes (a receiver may reserve them at once), `n > buf.len()`.
pub fn parse_or_need<'a>(
    buf: &'a [u8],
    limits: &'a WireLimits,
) -> Result<Result<(Request<'a>, usize), usize>, ParseError> {
    let mut c = Cursor {
        buf,
        pos: 0,
        limits,
        need: 0,
    };
    match parse_with(&mut c)? {
        Some(req) => Ok(Ok((req, c.pos))),
        None => Ok(Err(c.need)),
    }
}

fn parse_with<'a>(c: &mut Cursor<'a>) -> Step<Request<'a>> {
    let q = need!(c.take(1))[0];
    let req = match q {
        query::VALIDATE => Request::Validate(need!(c.u32())),
        query::SET => {
            let k = need!(c.key());
            Request::Set(k, need!(c.value()))
        }
        query::COMPARE_SET => {
            let k = need!(c.key());
            let e = need!(c.value());
            Request::CompareSet(k, e, need!(c.value()))
        }
        query::GET => Request::Get(need!(c.key())),
        query::ADD => {
            let k = need!(c.key());
            Request::Add(k, need!(c.u64()) as i64)
        }
        query::CHECK => Request::Check(need!(c.keys())),
        query::WAIT => Request::Wait(need!(c.keys())),
        query::GETNUMKEYS => Request::NumKeys,
        query::DELETE_KEY => Request::DeleteKey(need!(c.key())),
        query::APPEND => {
            let k = need!(c.key());
            Request::Append(k, need!(c.value()))
        }
        query::MULTI_GET => Request::MultiGet(need!(c.keys())),
        query::MULTI_SET => {
            let n = need!(c.count());
            let mut pairs = Vec::with_capacity(n.min((c.buf.len() - c.pos) / 16));
            for _ in 0..n {
                let k = need!(c.key());
                pairs.push((k, need!(c.value())));
            }
            Request::MultiSet(pairs)
        }
        query::CANCEL_WAIT => Request::CancelWait,
        query::PING => Request::Ping(need!(c.u32())),
        query::QUEUE_PUSH => {
            let k = need!(c.key());
            Request::QueuePush(k, need!(c.value()))
        }
        query::QUEUE_POP => Request::QueuePop(need!(c.key())),
        query::QUEUE_LEN => Request::QueueLen(need!(c.key())),
        query::LIST_KEYS => Request::ListKeys,
        query::BARRIER => {
            let k = need!(c.key());
            Request::Barrier(k, need!(c.u64()) as i64)
        }
        other => return Err(ParseError::UnknownQuery(other)),
    };
    Ok(Some(req))
}

/// Appends a `u64` length and the bytes (the wire's string).
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Appends the encoding of `req` to `out` (what a client sends).
pub fn encode_request(out: &mut Vec<u8>, req: &Request<'_>) {
    fn keys(out: &mut Vec<u8>, ks: &[&[u8]]) {
        out.extend_from_slice(&(ks.len() as u64).to_le_bytes());
        for k in ks {
            put_bytes(out, k);
        }
    }
    match req {
        Request::Validate(m) => {
            out.push(query::VALIDATE);
            out.extend_from_slice(&m.to_le_bytes());
        }
        Request::Set(k, v) => {
            out.push(query::SET);
            put_bytes(out, k);
            put_bytes(out, v);
        }
        Request::CompareSet(k, e, d) => {
            out.push(query::COMPARE_SET);
            put_bytes(out, k);
            put_bytes(out, e);
            put_bytes(out, d);
        }
        Request::Get(k) => {
            out.push(query::GET);
            put_bytes(out, k);
        }
        Request::Add(k, d) => {
            out.push(query::ADD);
            put_bytes(out, k);
            out.extend_from_slice(&d.to_le_bytes());
        }
        Request::Check(ks) => {
            out.push(query::CHECK);
            keys(out, ks);
        }
        Request::Wait(ks) => {
            out.push(query::WAIT);
            keys(out, ks);
        }
        Request::NumKeys => out.push(query::GETNUMKEYS),
        Request::DeleteKey(k) => {
            out.push(query::DELETE_KEY);
            put_bytes(out, k);
        }
        Request::Append(k, v) => {
            out.push(query::APPEND);
            put_bytes(out, k);
            put_bytes(out, v);
        }
        Request::MultiGet(ks) => {
            out.push(query::MULTI_GET);
            keys(out, ks);
        }
        Request::MultiSet(pairs) => {
            out.push(query::MULTI_SET);
            out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
            for (k, v) in pairs {
                put_bytes(out, k);
                put_bytes(out, v);
            }
        }
        Request::CancelWait => out.push(query::CANCEL_WAIT),
        Request::Ping(n) => {
            out.push(query::PING);
            out.extend_from_slice(&n.to_le_bytes());
        }
        Request::QueuePush(k, v) => {
            out.push(query::QUEUE_PUSH);
            put_bytes(out, k);
            put_bytes(out, v);
        }
        Request::QueuePop(k) => {
            out.push(query::QUEUE_POP);
            put_bytes(out, k);
        }
        Request::QueueLen(k) => {
            out.push(query::QUEUE_LEN);
            put_bytes(out, k);
        }
        Request::ListKeys => out.push(query::LIST_KEYS),
        Request::Barrier(k, n) => {
            out.push(query::BARRIER);
            put_bytes(out, k);
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
}

/// Encodes `req` into `out` as [`encode_request`] does, except for a trailing value (of `SET`,
/// `COMPARE_SET`, `APPEND`, `QUEUE_PUSH`), which it returns rather than copies: the request on
/// the wire is `out`'s new bytes, then the returned slice (a large value goes out with one
/// vectored write, uncopied).
pub(crate) fn encode_request_head<'a>(out: &mut Vec<u8>, req: &Request<'a>) -> &'a [u8] {
    let (q, head, tail): (u8, &[&[u8]], &'a [u8]) = match *req {
        Request::Set(k, v) => (query::SET, &[k], v),
        Request::Append(k, v) => (query::APPEND, &[k], v),
        Request::QueuePush(k, v) => (query::QUEUE_PUSH, &[k], v),
        Request::CompareSet(k, e, d) => {
            out.push(query::COMPARE_SET);
            put_bytes(out, k);
            put_bytes(out, e);
            out.extend_from_slice(&(d.len() as u64).to_le_bytes());
            return d;
        }
        _ => {
            encode_request(out, req);
            return &[];
        }
    };
    out.push(q);
    for k in head {
        put_bytes(out, k);
    }
    out.extend_from_slice(&(tail.len() as u64).to_le_bytes());
    tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_head_and_its_tail_are_the_whole_request() {
        let reqs = [
            Request::Set(b"/k", b"value"),
            Request::Append(b"/k", b""),
            Request::QueuePush(b"/q", b"item"),
            Request::CompareSet(b"/k", b"old", b"new"),
            Request::Get(b"/k"),
            Request::Wait(vec![b"/a", b"/b"]),
            Request::Barrier(b"/b", 3),
        ];
        for req in reqs {
            let mut whole = Vec::new();
            encode_request(&mut whole, &req);
            let mut head = Vec::new();
            let tail = encode_request_head(&mut head, &req);
            head.extend_from_slice(tail);
            assert_eq!(head, whole, "{req:?}");
        }
    }

    fn roundtrip(req: Request<'_>) {
        let limits = WireLimits::default();
        let mut buf = Vec::new();
        encode_request(&mut buf, &req);
        // Every strict prefix is incomplete, never an error or a wrong request.
        for cut in 0..buf.len() {
            assert_eq!(
                parse_request(&buf[..cut], &limits),
                Ok(None),
                "prefix {cut}"
            );
        }
        let (got, used) = parse_request(&buf, &limits).unwrap().unwrap();
        assert_eq!(used, buf.len());
        assert_eq!(got, req);
    }

    #[test]
    fn every_query_type_round_trips() {
        roundtrip(Request::Validate(VALIDATION_MAGIC));
        roundtrip(Request::Set(b"/k", b"v"));
        roundtrip(Request::CompareSet(b"/k", b"", b"new"));
        roundtrip(Request::Get(b"/k"));
        roundtrip(Request::Add(b"/k", -5));
        roundtrip(Request::Check(vec![b"/a", b"/b"]));
        roundtrip(Request::Wait(vec![b"/a"]));
        roundtrip(Request::NumKeys);
        roundtrip(Request::DeleteKey(b"/k"));
        roundtrip(Request::Append(b"/k", b"xyz"));
        roundtrip(Request::MultiGet(vec![b"/a", b"/b", b"/c"]));
        roundtrip(Request::MultiSet(vec![(b"/a", b"1"), (b"/b", b"")]));
        roundtrip(Request::CancelWait);
        roundtrip(Request::Ping(1234));
        roundtrip(Request::QueuePush(b"/q", b"item"));
        roundtrip(Request::QueuePop(b"/q"));
        roundtrip(Request::QueueLen(b"/q"));
        roundtrip(Request::ListKeys);
        roundtrip(Request::Barrier(b"/b", 3));
    }

    #[test]
    fn an_incomplete_request_says_what_it_needs() {
        let limits = WireLimits::default();
        let mut buf = Vec::new();
        encode_request(&mut buf, &Request::Set(b"/k", &[5u8; 1000]));
        // Once the value's length is in, the whole request's length is known.
        assert_eq!(parse_or_need(&buf[..20], &limits), Ok(Err(buf.len())));
        assert_eq!(parse_or_need(&buf[..5], &limits), Ok(Err(9)));
    }

    #[test]
    fn the_bytes_are_pytorchs() {
        // SET "/k" = "v": type 1, u64 LE length 2, "/k", u64 LE length 1, "v".
        let mut buf = Vec::new();
        encode_request(&mut buf, &Request::Set(b"/k", b"v"));
        let mut want = vec![
            1u8, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'k', 1, 0, 0, 0, 0, 0, 0, 0, b'v',
        ];
        assert_eq!(buf, want);
        buf.clear();
        encode_request(&mut buf, &Request::Validate(VALIDATION_MAGIC));
        want = vec![0, 0xCE, 0xF7, 0x85, 0x3C];
        assert_eq!(buf, want);
    }

    #[test]
    fn oversized_lengths_are_refused_before_the_bytes_arrive() {
        let limits = WireLimits::default();
        let mut buf = vec![query::SET];
        buf.extend_from_slice(&(limits.max_key_len as u64 + 1).to_le_bytes());
        assert!(matches!(
            parse_request(&buf, &limits),
            Err(ParseError::KeyTooLong { .. })
        ));
        let mut buf = vec![query::SET];
        put_bytes(&mut buf, b"/k");
        buf.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_request(&buf, &limits),
            Err(ParseError::ValueTooLong { .. })
        ));
        let mut buf = vec![query::WAIT];
        buf.extend_from_slice(&(limits.max_keys_per_request as u64 + 1).to_le_bytes());
        assert!(matches!(
            parse_request(&buf, &limits),
            Err(ParseError::TooManyKeys { .. })
        ));
        assert_eq!(
            parse_request(&[19], &limits),
            Err(ParseError::UnknownQuery(19))
        );
        let small = WireLimits {
            max_request_len: 32,
            ..limits
        };
        let mut buf = vec![query::SET];
        put_bytes(&mut buf, b"/k");
        put_bytes(&mut buf, &[0u8; 40]);
        assert!(matches!(
            parse_request(&buf, &small),
            Err(ParseError::RequestTooLong { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any bytes: the parser returns (never panics), uses no more than it was given, and a
        /// request it accepts re-encodes to exactly the bytes it used.
        #[test]
        fn any_bytes_parse_or_refuse(bytes in proptest::collection::vec(any::<u8>(), 0..256),
                                     first in 0u8..24) {
            let mut buf = vec![first];
            buf.extend_from_slice(&bytes);
            let limits = WireLimits { max_key_len: 64, max_value_len: 128,
                                      max_keys_per_request: 8, max_request_len: 200 };
            if let Ok(Some((req, used))) = parse_request(&buf, &limits) {
                prop_assert!(used <= buf.len());
                let mut again = Vec::new();
                encode_request(&mut again, &req);
                prop_assert_eq!(&again[..], &buf[..used]);
            }
        }

        /// Small lengths so that well-formed requests come up often.
        #[test]
        fn near_valid_requests(first in 0u8..20, lens in proptest::collection::vec(0u64..12, 0..6),
                               fill in any::<u8>()) {
            let mut buf = vec![first];
            for l in lens {
                buf.extend_from_slice(&l.to_le_bytes());
                buf.extend(std::iter::repeat_n(fill, l as usize));
            }
            let limits = WireLimits::default();
            if let Ok(Some((req, used))) = parse_request(&buf, &limits) {
                let mut again = Vec::new();
                encode_request(&mut again, &req);
                prop_assert_eq!(&again[..], &buf[..used]);
            }
        }
    }
}
