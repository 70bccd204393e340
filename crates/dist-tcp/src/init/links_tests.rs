//! The crossing rule over every interleaving of two ranks' events, as pure functions: no
//! sockets, no threads, every order tried.

use super::links::*;

/// A connection in the model: dialed by rank `by` to the other rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conn {
    /// Not opened.
    None,
    /// The hello is on its way to the other rank's acceptor.
    HelloSent,
    /// Accepted; the acceptor has not sent its verdict yet.
    Accepting,
    /// The verdict (accept) is on its way back.
    Accepted,
    /// Refused (crossed or duplicate); the refusal is on its way back.
    Refused(Verdict),
    /// The dialer has read the reply.
    Done,
}

/// A rank's dialer in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialer {
    /// Will start at some point (or never, where it is not in the scenario).
    Idle,
    /// Waiting for another attempt on the same link (`Start::Wait`).
    WaitConnected,
    /// Its handshake is in flight.
    InFlight,
    /// Refused as crossed: waiting for the handed connection.
    AwaitHanded,
    /// Returned.
    Done(Got),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Got {
    /// A stream: the connection dialed by rank `.0`.
    Stream(usize),
    Elsewhere,
    Failed,
}

#[derive(Clone, Debug)]
struct World {
    link: [Link; 2],
    /// Each rank's two threads that may dial (the second waits while the first connects).
    dialer: [[Dialer; 2]; 2],
    /// How many of each rank's threads dial in this scenario.
    dials: [usize; 2],
    /// The connection dialed by each rank.
    conn: [Conn; 2],
    /// The connection handed to each rank's dialer (`Link::Handed`).
    handed: [Option<usize>; 2],
    /// A callback delivery pending at each rank (the connection dialed by the other).
    delivering: [Option<usize>; 2],
    /// The connections each rank's callback got.
    callback: [Vec<usize>; 2],
    /// The events so far, for a failure's message.
    trace: Vec<String>,
}

impl World {
    fn new(dials: [usize; 2]) -> World {
        World {
            link: [Link::Idle; 2],
            dialer: [[Dialer::Idle; 2]; 2],
            dials,
            conn: [Conn::None; 2],
            handed: [None; 2],
            delivering: [None; 2],
            callback: [Vec::new(), Vec::new()],
            trace: Vec::new(),
        }
    }

    /// Every event enabled now, each as the world after it.
    fn next(&self) -> Vec<World> {
        let mut out = Vec::new();
        for x in 0..2 {
            let y = 1 - x;
            // A thread of rank x starts to dial, or retries after waiting.
            for th in 0..2 {
                let d = self.dialer[x][th];
                let starts = (d == Dialer::Idle && th < self.dials[x])
                    || (d == Dialer::WaitConnected
                        && matches!(self.link[x], Link::Idle | Link::Connected));
                if !starts {
                    continue;
                }
                let mut w = self.clone();
                w.trace.push(format!("{x}.{th} starts"));
                w.dialer[x][th] = match on_dial(&mut w.link[x]) {
                    Start::Dial => {
                        assert_eq!(w.conn[x], Conn::None, "rank {x} dials twice");
                        w.conn[x] = Conn::HelloSent;
                        Dialer::InFlight
                    }
                    Start::Wait => Dialer::WaitConnected,
                    Start::Already => Dialer::Done(Got::Elsewhere),
                };
                out.push(w);
            }
            // Rank y's acceptor decides on x's connection.
            if self.conn[x] == Conn::HelloSent {
                let mut w = self.clone();
                let v = on_hello(y, x, &mut w.link[y]);
                w.trace.push(format!("{y} decides on {x}'s: {v:?}"));
                w.conn[x] = match v {
                    Verdict::Accept => Conn::Accepting,
                    v => Conn::Refused(v),
                };
                out.push(w);
            }
            // Rank y's acceptor sends its verdict and settles.
            if self.conn[x] == Conn::Accepting {
                let mut w = self.clone();
                let d = on_verdict_sent(&mut w.link[y], true);
                w.trace
                    .push(format!("{y} sent the verdict on {x}'s: {d:?}"));
                match d {
                    Deliver::ToDialer => w.handed[y] = Some(x),
                    Deliver::ToCallback => w.delivering[y] = Some(x),
                    Deliver::Drop => {}
                }
                w.conn[x] = Conn::Accepted;
                out.push(w);
            }
            // Rank y's callback returns.
            if let Some(c) = self.delivering[y] {
                let mut w = self.clone();
                w.trace.push(format!("{y}'s callback took {c}'s"));
                w.callback[y].push(c);
                w.delivering[y] = None;
                on_delivered(&mut w.link[y], true);
                out.push(w);
            }
            // The reply reaches rank x's dialer.
            if matches!(self.conn[x], Conn::Accepted | Conn::Refused(_)) {
                let mut w = self.clone();
                let outcome = match self.conn[x] {
                    Conn::Accepted => Outcome::Won,
                    Conn::Refused(Verdict::Crossed) => Outcome::Crossed,
                    _ => Outcome::Failed,
                };
                let n = on_dial_outcome(&mut w.link[x], outcome);
                w.trace.push(format!("{x} read {outcome:?}: {n:?}"));
                w.conn[x] = Conn::Done;
                let th = (0..2)
                    .find(|&t| w.dialer[x][t] == Dialer::InFlight)
                    .expect("a dialer in flight");
                w.dialer[x][th] = match n {
                    Next::UseOwn => Dialer::Done(Got::Stream(x)),
                    Next::AwaitHanded => Dialer::AwaitHanded,
                    Next::Fail => Dialer::Done(Got::Failed),
                };
                out.push(w);
            }
            // Rank x's waiting dialer takes the handed connection.
            for th in 0..2 {
                if self.dialer[x][th] == Dialer::AwaitHanded && self.link[x] == Link::Handed {
                    let mut w = self.clone();
                    assert!(on_take(&mut w.link[x]));
                    let c = w.handed[x].take().expect("a handed link has a connection");
                    w.trace.push(format!("{x}.{th} took {c}'s"));
                    w.dialer[x][th] = Dialer::Done(Got::Stream(c));
                    out.push(w);
                }
            }
        }
        out
    }

    /// The connections rank `x` got, from its dialer and its callback.
    fn got(&self, x: usize) -> Vec<usize> {
        let mut g = self.callback[x].clone();
        for d in self.dialer[x] {
            if let Dialer::Done(Got::Stream(c)) = d {
                g.push(c);
            }
        }
        g
    }

    /// What must hold once no event is enabled.
    fn check_end(&self) {
        let t = || self.trace.join("; ");
        for x in 0..2 {
            for th in 0..self.dials[x] {
                let d = self.dialer[x][th];
                assert!(
                    matches!(d, Dialer::Done(_)),
                    "rank {x}'s dialer {th} is stuck: {d:?} after {}",
                    t()
                );
                assert_ne!(d, Dialer::Done(Got::Failed), "rank {x} failed: {}", t());
            }
            assert_eq!(self.link[x], Link::Connected, "rank {x}: {}", t());
        }
        let (g0, g1) = (self.got(0), self.got(1));
        assert_eq!(g0.len(), 1, "rank 0 got {g0:?}: {}", t());
        assert_eq!(g0, g1, "the ranks use different connections: {}", t());
        let used = g0[0];
        // The one used was accepted by its acceptor: no frame on a refused connection.
        assert_eq!(self.conn[used], Conn::Done, "{}", t());
        let decided = format!("decides on {used}'s: ");
        assert!(
            self.trace
                .iter()
                .all(|e| !e.contains(&decided) || e.ends_with("Accept")),
            "a refused connection is used: {}",
            t()
        );
        // Both opened: the lower rank's wins.
        if self.conn[0] != Conn::None && self.conn[1] != Conn::None {
            assert_eq!(used, 0, "both dialed and the higher rank's won: {}", t());
        }
    }
}

/// Every interleaving from `w`; returns how many ends were checked.
fn explore(w: &World) -> usize {
    let next = w.next();
    if next.is_empty() {
        w.check_end();
        return 1;
    }
    next.iter().map(explore).sum()
}

/// Both ranks dialing each other, one dialing alone, a second thread of a rank dialing the same
/// peer meanwhile, in every order of their events: each
/// pair ends with exactly one connection, both ranks on it, never one that was refused, and
/// the lower rank's whenever both were opened.
#[test]
fn every_interleaving_ends_with_one_connection() {
    let mut ends = 0;
    for dials in [[1, 0], [0, 1], [1, 1], [2, 1], [1, 2], [2, 2]] {
        let n = explore(&World::new(dials));
        assert!(n > 0);
        ends += n;
    }
    // Enough orders to mean something: the dialers' events interleave in many ways.
    assert!(ends > 1000, "only {ends} interleavings explored");
}

/// The acceptor's decision, case by case.
#[test]
fn the_decision_table() {
    use Link::*;
    let cases = [
        (Idle, 3, Verdict::Accept, Accepting),
        (Idle, 9, Verdict::Accept, Accepting),
        (
            Dialing { accepting: false },
            3,
            Verdict::Accept,
            Dialing { accepting: true },
        ),
        (
            Dialing { accepting: false },
            9,
            Verdict::Crossed,
            Dialing { accepting: false },
        ),
        (
            Dialing { accepting: true },
            3,
            Verdict::Duplicate,
            Dialing { accepting: true },
        ),
        (Accepting, 9, Verdict::Crossed, Accepting),
        (Accepting, 3, Verdict::Duplicate, Accepting),
        (Handed, 9, Verdict::Crossed, Handed),
        (Connected, 9, Verdict::Crossed, Connected),
        (Connected, 3, Verdict::Duplicate, Connected),
    ];
    for (before, peer, verdict, after) in cases {
        // Refusing early is refusing at the hello what the verdict would refuse, changing
        // nothing: the interleavings above, which decide at any moment after the hello,
        // cover it.
        if crosses_early(5, peer, before) {
            assert_eq!((verdict, after), (Verdict::Crossed, before), "{before:?}");
        }
        let mut l = before;
        assert_eq!(on_hello(5, peer, &mut l), verdict, "{before:?} from {peer}");
        assert_eq!(l, after, "{before:?} from {peer}");
    }
    assert!(crosses_early(5, 9, Dialing { accepting: false }));
    assert!(!crosses_early(5, 3, Dialing { accepting: false }));
    assert!(!crosses_early(5, 9, Idle));
}

/// A dialer that gives up while the peer's connection is being accepted leaves it to the
/// callback; one that gives up with nothing coming leaves the link idle for a later dial.
#[test]
fn giving_up_hands_over_or_resets() {
    let mut l = Link::Dialing { accepting: true };
    on_give_up(&mut l);
    assert_eq!(l, Link::Accepting);
    assert_eq!(on_verdict_sent(&mut l, true), Deliver::ToCallback);
    on_delivered(&mut l, true);
    assert_eq!(l, Link::Connected);

    let mut l = Link::Dialing { accepting: false };
    on_give_up(&mut l);
    assert_eq!(l, Link::Idle);
    assert_eq!(on_dial(&mut l), Start::Dial);

    // A verdict that cannot be sent undoes the acceptance.
    let mut l = Link::Idle;
    on_hello(5, 3, &mut l);
    assert_eq!(on_verdict_sent(&mut l, false), Deliver::Drop);
    assert_eq!(l, Link::Idle);
}

/// A connection the callback could not attach leaves the link idle, so that a later dial (of
/// either side) connects the pair; before the fix the link stayed `Connected` to a connection
/// that had been dropped, and every later use of the pair failed.
#[test]
fn a_connection_the_callback_drops_leaves_the_link_idle() {
    let mut l = Link::Idle;
    assert_eq!(on_hello(0, 1, &mut l), Verdict::Accept);
    assert_eq!(on_verdict_sent(&mut l, true), Deliver::ToCallback);
    on_delivered(&mut l, false);
    assert_eq!(l, Link::Idle);
    assert_eq!(on_dial(&mut l), Start::Dial);

    // The same through `Links`, whose callback refuses the stream.
    let links = Links::new(0, |r| r == 0, 2, Box::new(|_, _| false));
    let (a, _b) = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    };
    assert_eq!(links.decide(1), Verdict::Accept);
    links.settle(1, Some(a));
    assert_eq!(links.get(1), Link::Idle);
}
