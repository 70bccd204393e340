//! The NCCL setup's agreement: rank 0 puts the unique id it made in the job's store (the key
//! `unique_id` under the job's `nccl` prefix), then every rank says over TCP whether its setup
//! (the library, its device, rank 0's unique id) worked and, if not, why, in one all_gather.
//! Every rank then goes on, taking the id from the store, or fails naming each rank that failed
//! and its reason. And the job's backend put together from its TCP side and its communicator
//! (at formation and after a recovery).

use std::time::Duration;

use dist_core::flight::rank_list;
use dist_core::{Backend, Collectives};
use dist_tcp::TcpBackend;
use dist_tcp::dist_store::Store;

use std::sync::Arc;

use dist_nccl::Communicator;

use crate::{HybridBackend, HybridError, Result, check, watch};

/// The length of one rank's record: flags, the reason's length (u16, little-endian), the
/// reason.
const RECORD: usize = 384;
/// The length of a unique id (NCCL's `ncclUniqueId`).
const ID: usize = 128;
/// The most bytes of a reason a record carries (a longer one is cut at a character boundary).
const REASON: usize = RECORD - 3;
/// The key of rank 0's unique id, under the job's `nccl` prefix in its store.
const ID_KEY: &str = "unique_id";
/// How long a rank waits for the unique id in the store: rank 0 set it before the all_gather
/// that precedes the read, so it is there; this only bounds a store gone astray.
const ID_WAIT: Duration = Duration::from_secs(60);
/// Record flags.
const FAILED: u8 = 1;
const HAS_ID: u8 = 2;
/// How many distinct reasons an error lists.
const REASONS_SHOWN: usize = 4;

/// One rank's record: `Ok` with whether it made a unique id, or why its setup failed.
fn encode(mine: &std::result::Result<bool, String>) -> [u8; RECORD] {
    let mut b = [0u8; RECORD];
    match mine {
        Ok(made) => {
            if *made {
                b[0] = HAS_ID;
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
/// if it made one, which goes into the job's store first). Collective over `tcp`. Returns rank
/// 0's unique id, if it made one, or, on every rank alike, [`HybridError::NcclSetup`] naming
/// each rank that failed.
pub(crate) fn agree(
    tcp: &TcpBackend,
    mine: std::result::Result<Option<[u8; ID]>, String>,
) -> Result<Option<[u8; ID]>> {
    let (me, n) = (tcp.rank(), tcp.world_size());
    let store = tcp.store_under("nccl");
    let mine = mine.and_then(|made| match made {
        Some(id) => store
            .set(ID_KEY, &id)
            .map(|()| Some(id))
            .map_err(|e| format!("cannot put the NCCL unique id in the job's store: {e}")),
        None => Ok(None),
    });
    let mut all = vec![0u8; RECORD * n];
    tcp.all_gather(
        &encode(&mine.as_ref().map(Option::is_some).map_err(String::clone)),
        &mut all,
    )?;
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
    if records[0][0] & HAS_ID == 0 {
        return Ok(None);
    }
    if let Ok(Some(id)) = mine {
        return Ok(Some(id));
    }
    let not_read = |why: String| HybridError::NcclSetup {
        rank: me,
        failed: vec![(
            0,
            format!(
                "rank {me} cannot read its NCCL unique id (key {}/{ID_KEY} in the job's store at \
                 {}): {why}",
                store.prefix(),
                store.inner().server()
            ),
        )],
    };
    let bytes = store
        .get(ID_KEY, ID_WAIT)
        .map_err(|e| not_read(e.to_string()))?;
    let id: [u8; ID] = bytes
        .as_slice()
        .try_into()
        .map_err(|_| not_read(format!("{} bytes, not {ID}", bytes.len())))?;
    Ok(Some(id))
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

impl HybridBackend {
    /// The job's backend without NCCL (`why` says why not).
    pub(crate) fn tcp_only(tcp: TcpBackend, why: String) -> HybridBackend {
        let tcp = Arc::new(tcp);
        HybridBackend {
            root: tcp.clone(),
            whole_job: true,
            tcp,
            nccl: None,
            why_no_nccl: why,
            watch: None,
            checker: None,
            check_calls: false,
        }
    }

    /// The job's backend of `tcp` and `comm` (the same ranks), with the record of its NCCL
    /// calls, the heartbeats that carry their position, and the call check (`check_calls`:
    /// whether calls are compared).
    pub(crate) fn with_comm(
        tcp: TcpBackend,
        comm: Communicator,
        check_calls: bool,
    ) -> HybridBackend {
        let (me, n) = (tcp.rank(), tcp.world_size());
        let tcp = Arc::new(tcp);
        let trace = tcp.trace_dir().map(|d| (d.to_path_buf(), n));
        let watch = Arc::new(watch::Watch::new(me, comm.abort_handle(), trace));
        {
            // The heartbeats of the TCP mesh say where this rank's NCCL calls are, so that a
            // rank whose NCCL call times out can say where every rank's are.
            let w = watch.clone();
            tcp.report_beside(move || w.flight.position());
        }
        let (fail, peer) = watch::sinks(&watch);
        let peer = watch::watch_peer_faults(&tcp, peer);
        let checker = check::Checker::start(tcp.clone(), fail, peer);
        HybridBackend {
            root: tcp.clone(),
            whole_job: true,
            tcp,
            nccl: Some(comm),
            why_no_nccl: String::new(),
            watch: Some(watch),
            checker: Some(checker),
            check_calls,
        }
    }
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
        assert_eq!(failure(&encode(&Ok(false))), None);
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

    /// Rank 0's unique id reaches every rank through the job's store: it is there, under the
    /// job's `nccl` prefix, for any rank to read.
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
        let stored = tcps[2]
            .store_under("nccl")
            .get(ID_KEY, Duration::from_secs(5))
            .unwrap();
        assert_eq!(stored, [9u8; ID]);
    }
}
