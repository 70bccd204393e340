//! `UniqueId`: the 128 bytes that let the ranks of a communicator find each other.

use dist_nccl_sys::{Library as Nccl, ncclUniqueId};

use crate::error::{NcclCode, NcclError, Result};
use crate::shared::nccl_error;

/// The 128 opaque bytes that let ranks find each other. Rank 0 makes one and every rank passes
/// the same one to [`crate::Communicator::init_rank`]; move it as bytes (over TCP, through the
/// launcher...).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "...)")
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (works without a GPU).
    pub fn new(nccl: &Nccl) -> Result<UniqueId> {
        const OP: &str = "ncclGetUniqueId";
        let f = dist_nccl_sys::nccl_fn!(nccl, ncclGetUniqueId)?;
        let mut raw = ncclUniqueId::default();
        // SAFETY: the pointer is valid for one ncclUniqueId, which NCCL fills (rank 0 of every
        // multirank GPU trial, e.g. `nccl_collectives`; dist-nccl-sys's
        // `real_library_reports_version_errors_and_ids` makes the same call without a GPU).
        let r = unsafe { f(&mut raw) };
        NcclCode::check(r).map_err(|code| nccl_error(nccl, OP, OP, code, None))?;
        Ok(UniqueId(bytemuck::cast(raw.internal)))
    }

    /// The id from its 128 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let a: [u8; 128] = b.try_into().map_err(|_| NcclError::Config {
            what: "NCCL unique id".into(),
            reason: format!("{} bytes, expected 128", b.len()),
        })?;
        Ok(UniqueId(a))
    }

    /// Its 128 bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    pub(crate) fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: bytemuck::cast(self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_is_128_bytes_and_round_trips() {
        let mut b = [0u8; 128];
        b[0] = 0xff;
        b[127] = 7;
        let id = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(id.as_bytes(), &b);
        let raw = id.raw();
        // Bytes travel unchanged whatever the sign of c_char on this target.
        assert_eq!(raw.internal[0] as u8, 0xff);
        assert_eq!(raw.internal[127] as u8, 7);
        let e = UniqueId::from_bytes(&b[..100]).unwrap_err();
        assert!(e.to_string().contains("100 bytes, expected 128"), "{e}");
    }
}
