//! Abort notices: what a peer's abort frame says, and the bounded list a backend keeps.

use super::*;

/// An abort notice received from a peer: who sent it, on which tag, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank that aborted (sent the notice).
    pub from: usize,
    /// The rank at fault, where the notice names one (a peer that died or went silent, or the
    /// origin of an abort passed on); else the failure is `from`'s own.
    pub culprit: Option<usize>,
    /// The tag of the operation it aborted.
    pub tag: Tag,
    /// Its error.
    pub reason: String,
}

impl AbortNotice {
    /// The rank the failure is due to: the culprit it names, else its sender.
    pub fn origin(&self) -> usize {
        self.culprit.unwrap_or(self.from)
    }
}

/// The abort notices of one backend, shared by its peers. Once one has arrived, every wait on a
/// system tag (barrier, collectives) fails with it instead of waiting out its deadline.
#[derive(Debug, Default)]
pub(crate) struct Aborts {
    raised: AtomicBool,
    notices: Mutex<Vec<AbortNotice>>,
}

impl Aborts {
    /// Records `n`. Only the first [`ABORTS_KEPT`] are kept: a peer flooding abort frames
    /// cannot grow this list.
    pub(crate) fn raise(&self, n: AbortNotice) {
        let mut v = self.notices.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < ABORTS_KEPT {
            v.push(n);
        }
        drop(v);
        self.raised.store(true, Ordering::Release);
    }

    pub(crate) fn raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    pub(crate) fn notices(&self) -> Vec<AbortNotice> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn error(&self, me: usize, op: String) -> DistError {
        let first = self.notices().into_iter().next();
        DistError::Aborted {
            rank: me,
            op,
            origin: first.as_ref().map_or(me, AbortNotice::origin),
            reason: first.map_or_else(|| "aborted".into(), |n| n.reason),
        }
    }
}

/// A hook the owning backend passes to each peer to hear of abort frames.
pub(crate) type AbortSink = Arc<dyn Fn(AbortNotice) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(from: usize, culprit: Option<usize>, reason: &str) -> AbortNotice {
        AbortNotice {
            from,
            culprit,
            tag: Tag::system(2),
            reason: reason.into(),
        }
    }

    /// The first notice is the one every wait reports, naming its culprit (else its sender);
    /// a flood keeps only the first [`ABORTS_KEPT`].
    #[test]
    fn the_first_notice_decides_and_a_flood_is_bounded() {
        let a = Aborts::default();
        assert!(!a.raised());
        a.raise(notice(3, Some(1), "peer 1 gone"));
        a.raise(notice(2, None, "mine"));
        assert!(a.raised());
        match a.error(0, "all_reduce(f32 x 4, sum)".into()) {
            DistError::Aborted {
                rank: 0,
                op,
                origin: 1,
                reason,
            } => assert_eq!(
                (op.as_str(), reason.as_str()),
                ("all_reduce(f32 x 4, sum)", "peer 1 gone")
            ),
            other => panic!("{other}"),
        }
        for i in 0..3 * ABORTS_KEPT {
            a.raise(notice(i, None, "flood"));
        }
        assert_eq!(a.notices().len(), ABORTS_KEPT);
        assert_eq!(notice(4, None, "x").origin(), 4);
    }
}
