//! Who connects to whom after formation, when both sides of a pair may dial at once.
//!
//! Each rank keeps one [`Link`] per peer, under one lock shared by its acceptor and its
//! dialers. The transitions are pure functions over a `Link` ([`on_dial`], [`on_hello`],
//! [`on_verdict_sent`], [`on_dial_outcome`], [`on_give_up`]), so that `links_tests.rs` can run
//! them over every interleaving of two ranks' events; [`Links`] applies them under its lock.
//!
//! The crossing rule: when both ranks of a pair dial each other, the lower rank's connection
//! wins. A rank's acceptor accepts a peer's connection when it is not connecting to that peer
//! itself, or when it is and the peer is the lower rank; it refuses a higher rank that it is
//! connecting to (or already connected with) as [`Refusal::Crossed`](crate::wire::Refusal),
//! and that rank then stops dialing and waits for the lower rank's connection. The decision is
//! made just before the verdict, the last handshake message, and frames flow only after it, so
//! no frame ever travels on the losing connection.

use std::net::TcpStream;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// A rank's view of its connection to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Link {
    /// No connection, and none being made.
    Idle,
    /// A dialer of this rank is connecting to the peer (its handshake in flight, or refused as
    /// crossed and waiting). `accepting`: the acceptor has meanwhile accepted the peer's own
    /// connection (the peer is the lower rank) and is sending its verdict.
    Dialing { accepting: bool },
    /// The acceptor accepted the peer's connection while no dialer of this rank was connecting,
    /// and is sending its verdict or handing the stream to the `on_incoming` callback.
    Accepting,
    /// The peer's connection, accepted while this rank was dialing, waits for the dialer.
    Handed,
    /// Connected: the stream went to a dialer or to the callback.
    Connected,
}

/// The acceptor's decision on a connection that passed every other check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Accept it.
    Accept,
    /// Refuse it with `Refusal::Crossed`: the other side waits for this rank's connection.
    Crossed,
    /// Refuse it: already connected (a lower rank dialing again: not a correct peer).
    Duplicate,
}

/// Where an accepted stream goes once its verdict is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deliver {
    /// To this rank's dialer, which waits for it ([`Link::Handed`]).
    ToDialer,
    /// To the `on_incoming` callback; then [`on_delivered`].
    ToCallback,
    /// Nowhere: the verdict could not be sent, the connection is dropped.
    Drop,
}

/// What a dialer does first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// Connect (the link is now `Dialing`).
    Dial,
    /// Another thread is connecting, or the acceptor is delivering: wait for `Connected`.
    Wait,
    /// Already connected: the stream went elsewhere.
    Already,
}

/// How a dialer's own handshake ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Accepted.
    Won,
    /// Refused as crossed.
    Crossed,
    /// Failed otherwise.
    Failed,
}

/// What the dialer does after its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Use its own connection (the link is now `Connected`).
    UseOwn,
    /// Drop its own connection, if any, and wait for the peer's ([`Link::Handed`]).
    AwaitHanded,
    /// Report the failure (the link is `Idle` again).
    Fail,
}

/// A dialer starts on a link.
pub(crate) fn on_dial(link: &mut Link) -> Start {
    match *link {
        Link::Idle => {
            *link = Link::Dialing { accepting: false };
            Start::Dial
        }
        Link::Connected => Start::Already,
        Link::Dialing { .. } | Link::Accepting | Link::Handed => Start::Wait,
    }
}

/// The acceptor of rank `me` decides on rank `peer`'s connection, just before the verdict.
pub(crate) fn on_hello(me: usize, peer: usize, link: &mut Link) -> Verdict {
    match *link {
        Link::Idle => {
            *link = Link::Accepting;
            Verdict::Accept
        }
        Link::Dialing { accepting: false } if peer < me => {
            *link = Link::Dialing { accepting: true };
            Verdict::Accept
        }
        _ if peer > me => Verdict::Crossed,
        _ => Verdict::Duplicate,
    }
}

/// Whether rank `me`'s acceptor can refuse `peer`'s connection as crossed as soon as its hello
/// has passed the checks, before the challenge: this rank is dialing the higher `peer` itself.
/// Changes nothing (a crossed refusal never does), so it needs no proof of the secret first;
/// [`on_hello`] decides again at the verdict for connections that pass here.
pub(crate) fn crosses_early(me: usize, peer: usize, link: Link) -> bool {
    peer > me && matches!(link, Link::Dialing { .. })
}

/// The acceptor has sent its verdict on an accepted connection (`ok`), or failed to.
pub(crate) fn on_verdict_sent(link: &mut Link, ok: bool) -> Deliver {
    match (*link, ok) {
        (Link::Dialing { accepting: true }, true) => {
            *link = Link::Handed;
            Deliver::ToDialer
        }
        (Link::Dialing { accepting: true }, false) => {
            *link = Link::Dialing { accepting: false };
            Deliver::Drop
        }
        (Link::Accepting, true) => Deliver::ToCallback,
        (Link::Accepting, false) => {
            *link = Link::Idle;
            Deliver::Drop
        }
        // Not reachable from `on_hello`'s `Accept`; nothing to deliver to.
        _ => Deliver::Drop,
    }
}

/// The callback has taken the stream: `attached`, the peer uses it now (the link is
/// `Connected`); otherwise it was dropped (the link is `Idle` again, so that either side can
/// connect later instead of finding a link connected to nothing).
pub(crate) fn on_delivered(link: &mut Link, attached: bool) {
    if *link == Link::Accepting {
        *link = if attached {
            Link::Connected
        } else {
            Link::Idle
        };
    }
}

/// A dialer's own handshake ended.
pub(crate) fn on_dial_outcome(link: &mut Link, outcome: Outcome) -> Next {
    match (*link, outcome) {
        (Link::Dialing { accepting: false }, Outcome::Won) => {
            *link = Link::Connected;
            Next::UseOwn
        }
        (Link::Dialing { accepting: false }, Outcome::Failed) => {
            *link = Link::Idle;
            Next::Fail
        }
        // The peer's connection is accepted (or being accepted): the lower rank's wins, and
        // only a lower rank's is ever accepted while dialing, so this rank's own (accepted
        // only by a peer that broke the rule) is dropped unused.
        _ => Next::AwaitHanded,
    }
}

/// A waiting dialer takes the handed stream, if there is one.
pub(crate) fn on_take(link: &mut Link) -> bool {
    if *link == Link::Handed {
        *link = Link::Connected;
        true
    } else {
        false
    }
}

/// A dialer gives up at its deadline: the link returns to `Idle`, or, if the acceptor is
/// meanwhile accepting the peer's connection, that connection goes to the callback.
pub(crate) fn on_give_up(link: &mut Link) {
    match *link {
        Link::Dialing { accepting: false } => *link = Link::Idle,
        Link::Dialing { accepting: true } => *link = Link::Accepting,
        _ => {}
    }
}

/// Called with each connection accepted from a peer while no dialer of this rank waited for it;
/// returns whether the connection is now in use (`false`: it was dropped).
pub type OnIncoming = Box<dyn Fn(usize, TcpStream) -> bool + Send + Sync>;

/// The per-peer links of one rank, shared by its acceptor and its dialers.
pub(crate) struct Links {
    me: usize,
    state: Mutex<Table>,
    changed: Condvar,
    on_incoming: OnIncoming,
}

struct Table {
    links: Vec<Link>,
    /// The stream of each [`Link::Handed`] link.
    handed: Vec<Option<TcpStream>>,
}

impl Links {
    /// Links for rank `me` of `world`, `Connected` where `connected` says so (the rank itself,
    /// and the connections formation made).
    pub(crate) fn new(
        me: usize,
        connected: impl Fn(usize) -> bool,
        world: usize,
        on_incoming: OnIncoming,
    ) -> Links {
        let links = (0..world)
            .map(|r| {
                if connected(r) {
                    Link::Connected
                } else {
                    Link::Idle
                }
            })
            .collect();
        Links {
            me,
            state: Mutex::new(Table {
                links,
                handed: (0..world).map(|_| None).collect(),
            }),
            changed: Condvar::new(),
            on_incoming,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic under this lock leaves the table as it was between two transitions.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The link to `peer` now.
    pub(crate) fn get(&self, peer: usize) -> Link {
        self.lock().links[peer]
    }

    /// The acceptor's decision on `peer`'s connection (see [`on_hello`]).
    pub(crate) fn decide(&self, peer: usize) -> Verdict {
        on_hello(self.me, peer, &mut self.lock().links[peer])
    }

    /// Whether `peer`'s connection can be refused as crossed at once (see [`crosses_early`]).
    pub(crate) fn crosses_early(&self, peer: usize) -> bool {
        crosses_early(self.me, peer, self.get(peer))
    }

    /// The verdict on an accepted connection went out with `stream`, or could not (`None`).
    pub(crate) fn settle(&self, peer: usize, stream: Option<TcpStream>) {
        let mut t = self.lock();
        let deliver = on_verdict_sent(&mut t.links[peer], stream.is_some());
        match (deliver, stream) {
            (Deliver::ToDialer, Some(s)) => {
                t.handed[peer] = Some(s);
                drop(t);
                self.changed.notify_all();
            }
            (Deliver::ToCallback, Some(s)) => {
                drop(t);
                let attached = (self.on_incoming)(peer, s);
                on_delivered(&mut self.lock().links[peer], attached);
                self.changed.notify_all();
            }
            _ => {
                drop(t);
                self.changed.notify_all();
            }
        }
    }

    /// Starts a dial of `peer` (see [`on_dial`]), waiting by `deadline` while another thread
    /// connects: `Start::Dial` makes the caller the dialer; `Start::Already` means the link
    /// is connected; `None` means the deadline passed.
    pub(crate) fn begin(&self, peer: usize, deadline: Instant) -> Option<Start> {
        let mut t = self.lock();
        loop {
            match on_dial(&mut t.links[peer]) {
                Start::Wait => t = self.wait(t, deadline)?,
                s => return Some(s),
            }
        }
    }

    /// The dialer's own handshake with `peer` ended (see [`on_dial_outcome`]).
    pub(crate) fn outcome(&self, peer: usize, outcome: Outcome) -> Next {
        let next = on_dial_outcome(&mut self.lock().links[peer], outcome);
        self.changed.notify_all();
        next
    }

    /// Waits by `deadline` for the peer's connection to be handed to this dialer; at the
    /// deadline gives up ([`on_give_up`]) and returns `None`.
    pub(crate) fn await_handed(&self, peer: usize, deadline: Instant) -> Option<TcpStream> {
        let mut t = self.lock();
        loop {
            if on_take(&mut t.links[peer]) {
                let s = t.handed[peer].take();
                drop(t);
                self.changed.notify_all();
                return s;
            }
            match self.wait(t, deadline) {
                Some(g) => t = g,
                None => {
                    let mut t = self.lock();
                    if on_take(&mut t.links[peer]) {
                        // Handed between the wait's end and this lock: take it after all.
                        return t.handed[peer].take();
                    }
                    on_give_up(&mut t.links[peer]);
                    drop(t);
                    self.changed.notify_all();
                    return None;
                }
            }
        }
    }

    /// Waits for a change by `deadline`; `None` once it has passed.
    fn wait<'a>(
        &self,
        t: MutexGuard<'a, Table>,
        deadline: Instant,
    ) -> Option<MutexGuard<'a, Table>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let (t, _) = self
            .changed
            .wait_timeout(t, left)
            .unwrap_or_else(|p| p.into_inner());
        Some(t)
    }
}
