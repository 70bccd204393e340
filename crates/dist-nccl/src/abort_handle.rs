//! [`AbortHandle`]: aborts a communicator from another thread without borrowing it.

use std::sync::Arc;

use crate::shared::{Abort, Shared};

/// Aborts a [`Communicator`](crate::Communicator) from anywhere (see
/// [`Communicator::abort_handle`](crate::Communicator::abort_handle)).
#[derive(Clone)]
pub struct AbortHandle {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AbortHandle({})", self.shared.who)
    }
}

impl AbortHandle {
    /// [`Communicator::abort_with`](crate::Communicator::abort_with): never waits behind a call inside NCCL (the abort then
    /// happens when that call returns).
    pub fn abort_with(&self, reason: impl Into<String>) {
        self.shared.request_abort(Abort::Error(reason.into()));
    }

    /// Why the communicator was aborted, if it was (`None` also while the abort waits for a
    /// call inside NCCL to return).
    pub fn aborted(&self) -> Option<String> {
        self.shared
            .try_lock()
            .and_then(|st| st.aborted.as_ref().map(Abort::reason))
    }
}
