//! The NCCL setup's agreement: before NCCL init every rank says over TCP whether its setup (the
//! library, its device, rank 0's unique id) worked and, if not, why, in one all_gather; rank
//! 0's record carries the unique id it made. Every rank then goes on, or fails naming each rank
//! that failed and its reason.

use dist_core::flight::rank_list;
use dist_core::{Backend, Collectives};
use dist_tcp::TcpBackend;

use crate::{HybridError, Result};

/// The length of one rank's record: flags, the reason's length (u16, little-endian), the
/// reason, the unique id.
const RECORD: usize = 512;
/// The length of a unique id (NCCL's `ncclUniqueId`).
const ID: usize = 128;
/// Where the unique id starts in a record.
const ID_AT: usize = RECORD - ID;
/// The most bytes of a reason a record carries (a longer one is cut at a character boundary).
const REASON: usize = ID_AT - 3;
/// Record flags.
const FAILED: u8 = 1;
const HAS_ID: u8 = 2;
/// How many distinct reasons an error lists.
const REASONS_SHOWN: usize = 4;

/// One rank's record: `Ok` with the unique id it made (if any), or why its setup failed.
fn encode(mine: &std::result::Result<Option<[u8; ID]>, String>) -> [u8; RECORD] {
    let mut b = [0u8; RECORD];
    match mine {
        Ok(made) => {
            if let Some(id) = made {
                b[0] = HAS_ID;
                b[ID_AT..].copy_from_slice(id);
            }
        }
        Err(why) => {
            b[0] = FAILED;
            let mut len = why.len().min(REASON);
            while !why.is_char_boundary(len) {
                len -= 1;
            }
            b[1..3].copy_from_slice(&(len as u16).to_le_bytes());
            b[3..3 + len].copy_from_slice(&why.as_bytes()[..len]);
        }
    }
    b
}

/// Why a record's rank failed, if it did (a length past the record's room is cut to it).
fn failure(b: &[u8]) -> Option<String> {
    if b[0] & FAILED == 0 {
        return None;
    }
    let len = usize::from(u16::from_le_bytes([b[1], b[2]])).min(REASON);
    Some(String::from_utf8_lossy(&b[3..3 + len]).into_owned())
}

/// Every rank's setup outcome, agreed: `mine` is this rank's (`Ok` with the unique id it made,
/// if it made one). Collective over `tcp`. Returns rank 0's unique id, if it made one, or, on
/// every rank alike, [`HybridError::NcclSetup`] naming each rank that failed.
pub(crate) fn agree(
    tcp: &TcpBackend,
    mine: std::result::Result<Option<[u8; ID]>, String>,
) -> Result<Option<[u8; ID]>> {
    let n = tcp.world_size();
    let mut all = vec![0u8; RECORD * n];
    tcp.all_gather(&encode(&mine), &mut all)?;
    let records: Vec<&[u8]> = all.chunks_exact(RECORD).collect();
    let failed: Vec<(usize, String)> = records
        .iter()
        .enumerate()
        .filter_map(|(r, b)| failure(b).map(|why| (r, why)))
        .collect();
    if !failed.is_empty() {
        return Err(HybridError::NcclSetup {
            rank: tcp.rank(),
            failed,
        });
    }
    let first = records[0];
    Ok((first[0] & HAS_ID != 0).then(|| {
        let mut id = [0u8; ID];
        id.copy_from_slice(&first[ID_AT..]);
        id
    }))
}

/// The failures of [`HybridError::NcclSetup`] in a line: the ranks of each distinct reason, the
/// first few reasons, e.g. "ranks 1, 3: cannot load NCCL: …".
pub(crate) fn describe(failed: &[(usize, String)]) -> String {
    let mut reasons: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, why) in failed {
        match reasons.iter_mut().find(|(w, _)| w == why) {
            Some((_, ranks)) => ranks.push(*r),
            None => reasons.push((why, vec![*r])),
        }
    }
    let mut parts: Vec<String> = reasons
        .iter()
        .take(REASONS_SHOWN)
        .map(|(why, ranks)| format!("{}: {why}", rank_list(ranks)))
        .collect();
    if reasons.len() > REASONS_SHOWN {
        parts.push(format!(
            "and {} other reasons",
            reasons.len() - REASONS_SHOWN
        ));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use dist_tcp::TcpConfig;

    use super::*;

    /// A job of `world` ranks over loopback, one backend per rank.
    fn job(world: usize) -> Vec<TcpBackend> {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let hs: Vec<_> = (0..world)
            .map(|r| {
                std::thread::spawn(move || {
                    let cfg: TcpConfig = TcpBackend::builder(r, world, format!("127.0.0.1:{port}"))
                        .init_timeout(Duration::from_secs(20))
                        .timeout(Duration::from_secs(20));
                    TcpBackend::with_config(cfg).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn a_reason_is_cut_at_a_character_boundary_and_a_peer_length_is_bounded() {
        let long = "é".repeat(REASON);
        let b = encode(&Err(long));
        let got = failure(&b).unwrap();
        assert!(
            got.len() <= REASON && got.chars().all(|c| c == 'é'),
            "{got}"
        );
        let mut forged = [0u8; RECORD];
        forged[0] = FAILED;
        forged[1..3].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(failure(&forged).unwrap().len(), REASON);
        assert_eq!(failure(&encode(&Ok(None))), None);
    }

    /// Rank 1 of 3 fails its setup (as where NCCL cannot be loaded on its host): every rank
    /// gets the same error naming rank 1 and its reason, none a closed connection or a timeout.
    #[test]
    fn one_rank_failing_its_setup_is_named_on_every_rank() {
        let hs: Vec<_> = job(3)
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    let mine = match t.rank() {
                        0 => Ok(Some([7u8; ID])),
                        1 => Err("cannot load NCCL: libnccl.so.2: not found".to_string()),
                        _ => Ok(None),
                    };
                    // As `with_nccl` does on an error: the rank's backend goes with it.
                    let r = agree(&t, mine);
                    drop(t);
                    r
                })
            })
            .collect();
        let outcomes: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        for (r, o) in outcomes.into_iter().enumerate() {
            match o {
                Err(HybridError::NcclSetup { rank, failed }) => {
                    assert_eq!(rank, r);
                    assert_eq!(
                        failed,
                        [(1, "cannot load NCCL: libnccl.so.2: not found".to_string())]
                    );
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
        let e = HybridError::NcclSetup {
            rank: 2,
            failed: vec![(1, "x".into()), (3, "x".into()), (0, "y".into())],
        };
        assert_eq!(
            e.to_string(),
            "rank 2: NCCL setup failed: ranks 1, 3: x; rank 0: y"
        );
    }

    #[test]
    fn rank_0s_unique_id_reaches_every_rank() {
        let tcps = job(3);
        let outcomes: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = tcps
                .iter()
                .map(|t| s.spawn(move || agree(t, Ok((t.rank() == 0).then_some([9u8; ID])))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, o) in outcomes.into_iter().enumerate() {
            assert_eq!(
                o.unwrap_or_else(|e| panic!("rank {r}: {e}")),
                Some([9u8; ID])
            );
        }
    }
}
