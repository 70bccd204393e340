//! The server's data and its waiting clients, with no I/O: a request in, answers out (to the
//! asking client and to the waiters it wakes). The event loop in `server.rs` feeds it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::proto::{self, Request};

/// A connection's number inside the server.
pub(crate) type ClientId = usize;

/// Totals the whole server may hold (beyond them the asking client is closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most keys stored (values and queues together).
    pub max_keys: usize,
    /// Most bytes of keys, values and queued items stored.
    pub max_bytes: usize,
    /// Most key registrations of waiting clients, over all clients.
    pub max_waiting_keys: usize,
    /// Longest answer to one request (a `MULTI_GET`'s values together) and longest value an
    /// `APPEND` may grow.
    pub max_reply_len: usize,
}

impl Default for StoreLimits {
    /// 1 Mi keys, 1 GiB, 1 Mi waiting keys, 64 MiB answers.
    fn default() -> Self {
        StoreLimits {
            max_keys: 1 << 20,
            max_bytes: 1 << 30,
            max_waiting_keys: 1 << 20,
            max_reply_len: 64 << 20,
        }
    }
}

/// Why a request made the server close its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The store would pass one of [`StoreLimits`].
    Full(&'static str),
    /// `ADD` or `BARRIER` on a value that is no decimal integer, or an overflow.
    NotANumber,
    /// A `WAIT` or `BARRIER` while the client already waits.
    AlreadyWaiting,
    /// `VALIDATE` again after the first query.
    Revalidate,
}

/// One answer to send: bytes, or a stored value sent as its `u64` length and its bytes without
/// copying it (a GET of 1 MiB shares the stored value rather than building a 1 MiB answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    Bytes(Vec<u8>),
    Value(Arc<[u8]>),
}

impl Answer {
    /// Bytes on the wire.
    pub(crate) fn len(&self) -> usize {
        match self {
            Answer::Bytes(b) => b.len(),
            Answer::Value(v) => 8 + v.len(),
        }
    }
}

impl From<Vec<u8>> for Answer {
    fn from(b: Vec<u8>) -> Self {
        Answer::Bytes(b)
    }
}

/// Answers to send: (client, answer), in order.
pub(crate) type Outbox = Vec<(ClientId, Answer)>;

#[derive(Debug, Default)]
pub(crate) struct State {
    kv: HashMap<Vec<u8>, Arc<[u8]>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key -> clients waiting on it (a client appears once per time it listed the key).
    waiting: HashMap<Vec<u8>, Vec<ClientId>>,
    /// Client -> how many of its registrations are still unset.
    awaited: HashMap<ClientId, usize>,
    waiting_keys: usize,
    keys: usize,
    bytes: usize,
    limits: StoreLimits,
}

fn encode_i64(v: i64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn bytes_of(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + b.len());
    proto::put_bytes(&mut out, b);
    out
}

impl State {
    pub(crate) fn new(limits: StoreLimits) -> State {
        State {
            limits,
            ..State::default()
        }
    }

    /// Makes room for a new or changed entry: `old` bytes leave, `new` come, `add_key` keys more.
    fn charge(&mut self, old: usize, new: usize, add_key: bool) -> Result<(), Refusal> {
        let keys = self.keys + usize::from(add_key);
        let bytes = self.bytes - old + new;
        if keys > self.limits.max_keys {
            return Err(Refusal::Full("keys"));
        }
        if bytes > self.limits.max_bytes {
            return Err(Refusal::Full("bytes"));
        }
        self.keys = keys;
        self.bytes = bytes;
        Ok(())
    }

    /// Stores `value` without waking anyone.
    fn store(&mut self, key: &[u8], value: &[u8]) -> Result<(), Refusal> {
        let old = self.kv.get(key).map(|v| key.len() + v.len());
        self.charge(old.unwrap_or(0), key.len() + value.len(), old.is_none())?;
        match self.kv.get_mut(key) {
            Some(v) => *v = Arc::from(value),
            None => {
                self.kv.insert(key.to_vec(), Arc::from(value));
            }
        }
        Ok(())
    }

    /// Stores `value` and wakes the clients waiting on `key`.
    fn put(&mut self, key: &[u8], value: &[u8], out: &mut Outbox) -> Result<(), Refusal> {
        self.store(key, value)?;
        self.wake_all(key, out);
        Ok(())
    }

    fn wake_all(&mut self, key: &[u8], out: &mut Outbox) {
        if let Some(clients) = self.waiting.remove(key) {
            self.waiting_keys -= clients.len();
            for c in clients {
                self.count_down(c, out);
            }
        }
    }

    fn count_down(&mut self, c: ClientId, out: &mut Outbox) {
        if let Some(n) = self.awaited.get_mut(&c) {
            *n -= 1;
            if *n == 0 {
                self.awaited.remove(&c);
                out.push((c, vec![proto::STOP_WAITING].into()));
            }
        }
    }

    /// A queue push wakes the first client waiting on the queue's key.
    fn wake_one(&mut self, key: &[u8], out: &mut Outbox) {
        let Some(clients) = self.waiting.get_mut(key) else {
            return;
        };
        let c = clients.remove(0);
        if clients.is_empty() {
            self.waiting.remove(key);
        }
        self.waiting_keys -= 1;
        self.count_down(c, out);
    }

    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn register(&mut self, c: ClientId, keys: &[&[u8]]) -> Result<(), Refusal> {
        if self.awaited.contains_key(&c) {
            return Err(Refusal::AlreadyWaiting);
        }
        let missing: Vec<&[u8]> = keys.iter().copied().filter(|k| !self.present(k)).collect();
        if self.waiting_keys + missing.len() > self.limits.max_waiting_keys {
            return Err(Refusal::Full("waiting keys"));
        }
        self.waiting_keys += missing.len();
        self.awaited.insert(c, missing.len());
        for k in missing {
            self.waiting.entry(k.to_vec()).or_default().push(c);
        }
        Ok(())
    }

    /// Forgets a client's wait (on `CANCEL_WAIT` and when it disconnects).
    pub(crate) fn forget(&mut self, c: ClientId) {
        if self.awaited.remove(&c).is_none() {
            return;
        }
        let mut removed = 0;
        self.waiting.retain(|_, cs| {
            let before = cs.len();
            cs.retain(|&x| x != c);
            removed += before - cs.len();
            !cs.is_empty()
        });
        self.waiting_keys -= removed;
    }

    fn parse_i64(v: &[u8]) -> Result<i64, Refusal> {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .ok_or(Refusal::NotANumber)
    }

    /// Runs one request of client `c` (already validated). Answers go to `out`.
    pub(crate) fn apply(
        &mut self,
        c: ClientId,
        req: Request<'_>,
        out: &mut Outbox,
    ) -> Result<(), Refusal> {
        match req {
            Request::Validate(_) => return Err(Refusal::Revalidate),
            Request::Ping(n) => out.push((c, n.to_le_bytes().to_vec().into())),
            Request::Set(k, v) => self.put(k, v, out)?,
            Request::CompareSet(k, expected, desired) => {
                let answer = match self.kv.get(k) {
                    None if expected.is_empty() => {
                        self.put(k, desired, out)?;
                        bytes_of(desired).into()
                    }
                    // PyTorch's answer for a missing key and a non-empty expectation: the
                    // expectation itself (nothing is stored).
                    None => bytes_of(expected).into(),
                    Some(cur) if &cur[..] == expected => {
                        self.put(k, desired, out)?;
                        bytes_of(desired).into()
                    }
                    Some(cur) => Answer::Value(cur.clone()),
                };
                out.push((c, answer));
            }
            Request::Get(k) => {
                let answer = match self.kv.get(k) {
                    Some(v) => Answer::Value(v.clone()),
                    None => bytes_of(&[]).into(),
                };
                out.push((c, answer));
            }
            Request::Add(k, delta) => {
                let cur = match self.kv.get(k) {
                    Some(v) => Self::parse_i64(v)?,
                    None => 0,
                };
                let new = cur.checked_add(delta).ok_or(Refusal::NotANumber)?;
                self.put(k, new.to_string().as_bytes(), out)?;
                out.push((c, encode_i64(new).into()));
            }
            Request::Check(keys) => {
                let ready = keys.iter().all(|k| self.present(k));
                let answer = if ready {
                    proto::CHECK_READY
                } else {
                    proto::CHECK_NOT_READY
                };
                out.push((c, vec![answer].into()));
            }
            Request::Wait(keys) => {
                if keys.iter().all(|k| self.present(k)) {
                    if self.awaited.contains_key(&c) {
                        return Err(Refusal::AlreadyWaiting);
                    }
                    out.push((c, vec![proto::STOP_WAITING].into()));
                } else {
                    self.register(c, &keys)?;
                }
            }
            Request::NumKeys => out.push((c, encode_i64(self.kv.len() as i64).into())),
            Request::DeleteKey(k) => {
                let n = match self.kv.remove(k) {
                    Some(v) => {
                        self.keys -= 1;
                        self.bytes -= k.len() + v.len();
                        1
                    }
                    None => 0,
                };
                out.push((c, encode_i64(n).into()));
            }
            Request::Append(k, v) => {
                let old = self.kv.get(k).map_or(0, |v| v.len());
                if old + v.len() > self.limits.max_reply_len {
                    return Err(Refusal::Full("value length"));
                }
                let mut cur = self.kv.get(k).map(|v| v.to_vec()).unwrap_or_default();
                cur.extend_from_slice(v);
                self.put(k, &cur, out)?;
            }
            Request::MultiGet(keys) => {
                let total: usize = keys
                    .iter()
                    .map(|k| 8 + self.kv.get(*k).map_or(0, |v| v.len()))
                    .sum();
                if total > self.limits.max_reply_len {
                    return Err(Refusal::Full("reply length"));
                }
                let mut answer = Vec::with_capacity(total);
                for k in keys {
                    proto::put_bytes(&mut answer, self.kv.get(k).map(|v| &v[..]).unwrap_or(&[]));
                }
                out.push((c, answer.into()));
            }
            Request::MultiSet(pairs) => {
                for (k, v) in pairs {
                    self.put(k, v, out)?;
                }
            }
            Request::CancelWait => {
                self.forget(c);
                out.push((c, vec![proto::WAIT_CANCELED].into()));
            }
            Request::QueuePush(k, v) => {
                let fresh = !self.queues.contains_key(k);
                self.charge(0, v.len() + if fresh { k.len() } else { 0 }, fresh)?;
                self.queues
                    .entry(k.to_vec())
                    .or_default()
                    .push_back(v.to_vec());
                self.wake_one(k, out);
            }
            Request::QueuePop(k) => {
                let mut answer = Vec::new();
                match self.queues.get_mut(k) {
                    Some(q) if !q.is_empty() => {
                        answer.extend_from_slice(&(q.len() as i64).to_le_bytes());
                        let v = q.pop_front().expect("not empty");
                        self.bytes -= v.len();
                        proto::put_bytes(&mut answer, &v);
                        if q.is_empty() {
                            self.queues.remove(k);
                            self.keys -= 1;
                            self.bytes -= k.len();
                        }
                    }
                    _ => answer.extend_from_slice(&0i64.to_le_bytes()),
                }
                out.push((c, answer.into()));
            }
            Request::QueueLen(k) => {
                let n = self.queues.get(k).map_or(0, VecDeque::len);
                out.push((c, encode_i64(n as i64).into()));
            }
            Request::ListKeys => {
                let mut answer = (self.kv.len() as i64).to_le_bytes().to_vec();
                for k in self.kv.keys() {
                    proto::put_bytes(&mut answer, k);
                }
                out.push((c, answer.into()));
            }
            Request::Barrier(k, world_size) => {
                if self.awaited.contains_key(&c) {
                    return Err(Refusal::AlreadyWaiting);
                }
                let count = match self.kv.get(k) {
                    Some(v) => Self::parse_i64(v)?,
                    None => 0,
                }
                .checked_add(1)
                .ok_or(Refusal::NotANumber)?;
                self.store(k, count.to_string().as_bytes())?;
                if count >= world_size {
                    self.wake_all(k, out);
                    out.push((c, vec![proto::STOP_WAITING].into()));
                } else {
                    if self.waiting_keys >= self.limits.max_waiting_keys {
                        return Err(Refusal::Full("waiting keys"));
                    }
                    self.waiting_keys += 1;
                    self.awaited.insert(c, 1);
                    self.waiting.entry(k.to_vec()).or_default().push(c);
                }
            }
        }
        Ok(())
    }

    /// Keys, bytes and waiting registrations held now.
    #[cfg(test)]
    pub(crate) fn usage(&self) -> (usize, usize, usize) {
        (self.keys, self.bytes, self.waiting_keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answers as the bytes they put on the wire.
    fn run(s: &mut State, c: ClientId, req: Request<'_>) -> Vec<(ClientId, Vec<u8>)> {
        let mut out = Vec::new();
        s.apply(c, req, &mut out).unwrap();
        out.into_iter()
            .map(|(c, a)| match a {
                Answer::Bytes(b) => (c, b),
                Answer::Value(v) => (c, bytes_of(&v)),
            })
            .collect()
    }

    #[test]
    fn wait_wakes_when_the_last_key_is_set() {
        let mut s = State::new(StoreLimits::default());
        assert!(run(&mut s, 1, Request::Wait(vec![b"a", b"b", b"a"])).is_empty());
        assert!(run(&mut s, 2, Request::Set(b"b", b"1")).is_empty());
        // "a" was listed twice: one set counts for both.
        assert_eq!(
            run(&mut s, 2, Request::Set(b"a", b"1")),
            vec![(1, vec![proto::STOP_WAITING])]
        );
        assert_eq!(s.usage().2, 0);
    }

    #[test]
    fn cancel_forgets_the_wait() {
        let mut s = State::new(StoreLimits::default());
        run(&mut s, 1, Request::Wait(vec![b"a"]));
        assert_eq!(
            run(&mut s, 1, Request::CancelWait),
            vec![(1, vec![proto::WAIT_CANCELED])]
        );
        assert!(run(&mut s, 2, Request::Set(b"a", b"1")).is_empty());
        assert_eq!(s.usage().2, 0);
    }

    #[test]
    fn compare_set_follows_pytorch() {
        let mut s = State::new(StoreLimits::default());
        // Missing key, non-empty expectation: the expectation comes back, nothing stored.
        assert_eq!(
            run(&mut s, 1, Request::CompareSet(b"k", b"x", b"y")),
            vec![(1, bytes_of(b"x"))]
        );
        assert_eq!(run(&mut s, 1, Request::Get(b"k")), vec![(1, bytes_of(b""))]);
        // Missing key, empty expectation: stored.
        assert_eq!(
            run(&mut s, 1, Request::CompareSet(b"k", b"", b"y")),
            vec![(1, bytes_of(b"y"))]
        );
        // Mismatch: the current value.
        assert_eq!(
            run(&mut s, 1, Request::CompareSet(b"k", b"z", b"w")),
            vec![(1, bytes_of(b"y"))]
        );
    }

    #[test]
    fn add_is_ascii_decimal_and_refuses_other_values() {
        let mut s = State::new(StoreLimits::default());
        assert_eq!(
            run(&mut s, 1, Request::Add(b"n", 5)),
            vec![(1, encode_i64(5))]
        );
        assert_eq!(
            run(&mut s, 1, Request::Get(b"n")),
            vec![(1, bytes_of(b"5"))]
        );
        run(&mut s, 1, Request::Set(b"x", b"abc"));
        let mut out = Vec::new();
        assert_eq!(
            s.apply(1, Request::Add(b"x", 1), &mut out),
            Err(Refusal::NotANumber)
        );
        run(
            &mut s,
            1,
            Request::Set(b"m", &i64::MAX.to_string().into_bytes()),
        );
        assert_eq!(
            s.apply(1, Request::Add(b"m", 1), &mut out),
            Err(Refusal::NotANumber)
        );
    }

    #[test]
    fn queue_push_wakes_one_waiter() {
        let mut s = State::new(StoreLimits::default());
        run(&mut s, 1, Request::Wait(vec![b"q"]));
        run(&mut s, 2, Request::Wait(vec![b"q"]));
        assert_eq!(
            run(&mut s, 3, Request::QueuePush(b"q", b"x")),
            vec![(1, vec![proto::STOP_WAITING])]
        );
        let mut popped = (1i64).to_le_bytes().to_vec();
        proto::put_bytes(&mut popped, b"x");
        assert_eq!(run(&mut s, 1, Request::QueuePop(b"q")), vec![(1, popped)]);
        assert_eq!(
            run(&mut s, 1, Request::QueuePop(b"q")),
            vec![(1, 0i64.to_le_bytes().to_vec())]
        );
        assert_eq!(s.usage(), (0, 0, 1));
    }

    #[test]
    fn limits_refuse_and_leave_the_store_as_it_was() {
        let mut s = State::new(StoreLimits {
            max_keys: 2,
            max_bytes: 10,
            max_waiting_keys: 1,
            max_reply_len: 100,
        });
        run(&mut s, 1, Request::Set(b"a", b"1"));
        let mut out = Vec::new();
        assert_eq!(
            s.apply(1, Request::Set(b"b", b"too long!"), &mut out),
            Err(Refusal::Full("bytes"))
        );
        run(&mut s, 1, Request::Set(b"b", b"2"));
        assert_eq!(
            s.apply(1, Request::Set(b"c", b"3"), &mut out),
            Err(Refusal::Full("keys"))
        );
        assert_eq!(
            s.apply(2, Request::Wait(vec![b"x", b"y"]), &mut out),
            Err(Refusal::Full("waiting keys"))
        );
        assert_eq!(s.usage(), (2, 4, 0));
    }

    #[test]
    fn barrier_releases_everyone_at_world_size() {
        let mut s = State::new(StoreLimits::default());
        assert!(run(&mut s, 1, Request::Barrier(b"b", 3)).is_empty());
        assert!(run(&mut s, 2, Request::Barrier(b"b", 3)).is_empty());
        let out = run(&mut s, 3, Request::Barrier(b"b", 3));
        let mut woken: Vec<ClientId> = out.iter().map(|(c, _)| *c).collect();
        woken.sort();
        assert_eq!(woken, vec![1, 2, 3]);
    }
}
