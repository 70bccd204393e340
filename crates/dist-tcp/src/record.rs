//! The TCP backend's flight record: point-to-point operations recorded, where every rank is
//! (for the errors of timed-out collectives), and the record written to `DIST_TRACE_DIR`.

use dist_core::Result;
use dist_core::flight::{OpInfo, OpState, describe_positions};

use crate::{Shared, TcpBackend};

impl TcpBackend {
    /// Runs a point-to-point operation, recorded in the flight recorder (two uncontended locks,
    /// no allocation unless it fails).
    pub(crate) fn recorded(
        &self,
        op: &'static str,
        bytes: usize,
        peer: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let info = OpInfo {
            seq: 0,
            op,
            dtype: "",
            count: bytes,
            peer: Some(peer),
        };
        let flight = &self.shared.flight;
        let entry = flight.begin(info, OpState::Started);
        let r = f();
        flight.finish(
            entry,
            r.as_ref().map_err(|e| e as &dyn std::fmt::Display).copied(),
        );
        r
    }
}

impl Shared {
    /// Writes the flight record to `DIST_TRACE_DIR`, if set (on a failure).
    pub(crate) fn write_trace(&self) {
        if let Some(dir) = &self.trace_dir {
            let _one_at_a_time = self.trace_lock.lock().unwrap_or_else(|p| p.into_inner());
            match self.flight.write_json(dir, self.rank, self.world) {
                Ok(path) => {
                    tracing::info!(rank = self.rank, path = %path.display(), "flight record written")
                }
                Err(e) => {
                    tracing::warn!(rank = self.rank, dir = %dir.display(), error = %e, "flight record not written")
                }
            }
        }
    }

    /// Where every rank is: this one from its own record, every peer from its last heartbeat.
    pub(crate) fn positions_text(&self) -> String {
        let all: Vec<_> = self
            .peers
            .iter()
            .map(|p| {
                if p.rank == self.rank {
                    (p.rank, self.flight.position())
                } else {
                    (p.rank, p.remote_position())
                }
            })
            .collect();
        describe_positions(&all)
    }
}
