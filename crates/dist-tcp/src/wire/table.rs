//! The rendezvous table as bytes: rank 0's table of every rank's listener (the job id, the world
//! size, which ranks' entries follow, then one entry per rank), whole or in parts.

use super::{
    DecodeError, MAGIC, TABLE_ENTRY_LEN, TABLE_HEAD_LEN, check_magic, need, u16_at, u32_at, u64_at,
};

/// The fixed part of a rendezvous table: which entries of the job's table of listeners follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableHead {
    /// The job id rank 0 handed out.
    pub job_id: u64,
    /// The number of ranks in the job.
    pub world: u32,
    /// The rank of the first entry that follows.
    pub first: u32,
    /// How many entries follow (those of ranks `first..first + count`).
    pub count: u32,
}

impl TableHead {
    /// Whether the entries that follow are the whole table.
    pub fn is_whole(&self) -> bool {
        self.first == 0 && self.count == self.world
    }
}

/// Encodes the whole rendezvous table: the job id and every rank's listener.
pub fn encode_table(job_id: u64, addrs: &[std::net::SocketAddr]) -> Vec<u8> {
    encode_table_part(job_id, addrs.len() as u32, 0, addrs)
}

/// Encodes part of the rendezvous table of a job of `world` ranks: the listeners of ranks
/// `first..first + addrs.len()`.
pub fn encode_table_part(
    job_id: u64,
    world: u32,
    first: u32,
    addrs: &[std::net::SocketAddr],
) -> Vec<u8> {
    let mut b = Vec::with_capacity(TABLE_HEAD_LEN + addrs.len() * TABLE_ENTRY_LEN);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&job_id.to_le_bytes());
    b.extend_from_slice(&world.to_le_bytes());
    b.extend_from_slice(&first.to_le_bytes());
    b.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
    for a in addrs {
        let (family, ip) = match a.ip() {
            std::net::IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
            std::net::IpAddr::V6(v6) => (6u8, v6.octets()),
        };
        b.push(family);
        b.extend_from_slice(&a.port().to_le_bytes());
        b.extend_from_slice(&ip);
    }
    b
}

/// Decodes the table's fixed part: the job id, the world size and which entries follow (a
/// range past the world size is an error).
pub fn decode_table_head(buf: &[u8]) -> Result<TableHead, DecodeError> {
    check_magic(buf)?;
    need(buf, TABLE_HEAD_LEN)?;
    let head = TableHead {
        job_id: u64_at(buf, 8),
        world: u32_at(buf, 16),
        first: u32_at(buf, 20),
        count: u32_at(buf, 24),
    };
    let end = u64::from(head.first) + u64::from(head.count);
    if end > u64::from(head.world) {
        return Err(DecodeError::BadField("table range end", end));
    }
    Ok(head)
}

/// Decodes the table's entries.
pub fn decode_table_entries(
    buf: &[u8],
    n: usize,
) -> Result<Vec<std::net::SocketAddr>, DecodeError> {
    let len = n
        .checked_mul(TABLE_ENTRY_LEN)
        .ok_or(DecodeError::BadField("table entries", n as u64))?;
    need(buf, len)?;
    buf.chunks_exact(TABLE_ENTRY_LEN)
        .take(n)
        .map(|e| {
            let port = u16_at(e, 1);
            let ip = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&e[3..19]).expect("16 bytes"));
            match e[0] {
                4 => ip
                    .to_ipv4_mapped()
                    .map(|v4| std::net::SocketAddr::from((v4, port)))
                    .ok_or(DecodeError::BadField("ipv4 address", 0)),
                6 => Ok(std::net::SocketAddr::from((ip, port))),
                f => Err(DecodeError::BadField("address family", f.into())),
            }
        })
        .collect()
}
