//! [`Work`]: a handle on the work enqueued on a communicator's stream up to a point, an event
//! recorded there, to wait on with the communicator's deadline and abort, or to poll.
//!
//! What makes it sound without relying on its drop: every call of this crate enqueues its
//! kernels on a stream and, before returning, has cudarc record each buffer's read or write
//! event on that stream after them (the guards of `Ops::launch`, dropped at once, or at a
//! group's end). From then on, every use of those buffers through cudarc (a kernel on another
//! stream, a copy to the host, the buffer's free) first waits for that event, so it is ordered
//! after the NCCL call, whether a handle is waited on, dropped, or forgotten
//! (`mem::forget`). Only a context whose event tracking was turned off (cudarc's
//! `disable_event_tracking`, an `unsafe` call whose contract makes such ordering the caller's)
//! loses that. A handle is therefore only a way to learn when the work is done and whether it
//! failed; dropping one does not wait and cancels nothing.

use std::time::Duration;

use cudarc::driver::CudaEvent;

use crate::communicator::Communicator;
use crate::error::Result;
use crate::shared::cuda;
use crate::watchdog::WATCH_EVERY;

/// The work enqueued on a communicator's stream up to the moment it was made (see
/// [`Communicator::record_work`]), as a CUDA event recorded there.
///
/// Dropping it neither waits nor cancels: the work goes on, later uses of its buffers are
/// ordered after it (see the module's docs), and a failure shows at the next wait or
/// synchronize.
pub struct Work<'a> {
    comm: &'a Communicator,
    event: CudaEvent,
    op: &'static str,
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work({} on {:?})", self.op, self.comm)
    }
}

impl Communicator {
    /// A handle on everything enqueued on the communicator's stream so far, named `op` (the
    /// call it follows, for errors): an event recorded on the stream now.
    pub fn record_work(&self, op: &'static str) -> Result<Work<'_>> {
        if let Some(why) = self.shared.doomed.get() {
            return Err(self.shared.aborted_error(op, why));
        }
        if crate::capture::capturing(self.stream())
            .map_err(cuda(&self.shared.who, "query the stream's capture state"))?
        {
            return Err(self.invalid(
                op,
                "the communicator's stream is capturing a CUDA graph: nothing recorded runs \
                 until a replay (wait for replays with Graph::synchronize)"
                    .into(),
            ));
        }
        let event = self
            .ctx
            .new_event(None)
            .map_err(cuda(&self.shared.who, "create an event"))?;
        event
            .record(self.stream())
            .map_err(cuda(&self.shared.who, "record an event"))?;
        Ok(Work {
            comm: self,
            event,
            op,
        })
    }
}

impl Work<'_> {
    /// The call this handle follows.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The communicator it belongs to.
    pub fn communicator(&self) -> &Communicator {
        self.comm
    }

    /// Whether the work has ended: completed, or failed (the communicator was aborted; `wait`
    /// then says why). Never blocks.
    pub fn is_completed(&self) -> bool {
        if self.comm.shared.doomed.get().is_some() {
            return true;
        }
        // A CUDA error here is not a completion: `false` sends the caller to `wait`, which
        // reports it.
        self.event.try_is_complete().unwrap_or(false)
    }

    /// Waits until the work has completed, within the communicator's timeout; a failure of
    /// the communicator (a dead peer, an abort, a mismatch found by a check) ends the wait
    /// with its error, and a timeout aborts the communicator and returns
    /// [`NcclError::Timeout`](crate::NcclError::Timeout).
    pub fn wait(self) -> Result<()> {
        let limit = self.comm.shared.timeout + WATCH_EVERY * 10;
        self.comm.wait_event(&self.event, limit, self.op)
    }

    /// [`Work::wait`] with a deadline of its own, capped at the communicator's timeout: past
    /// it the communicator is aborted (a hang ends in a named error, as for
    /// [`Communicator::synchronize_timeout`]) and this returns the timeout.
    pub fn wait_timeout(self, timeout: Duration) -> Result<()> {
        let limit = timeout.min(self.comm.shared.timeout);
        self.comm.wait_event(&self.event, limit, self.op)
    }
}
