//! Control protocol between the client library and vrdmad, over the vNIC's
//! `control.sock` (`SOCK_SEQPACKET`: one datagram per message, file descriptors alongside
//! with `SCM_RIGHTS`).
//!
//! A message is a [`Header`] (`repr(C)`, little-endian, validated by [`Header::parse`]) and a
//! payload decoded by a bounds-checked [`Reader`]. vrdmad trusts no byte of it: every decoder
//! returns [`DecodeError`] on bad input, never panics (see `fuzz/`).

mod codec;
mod header;
mod op;
mod reply;
mod request;
#[cfg(test)]
mod tests;

pub use codec::{Reader, Writer};
pub use header::{Header, HEADER_LEN};

/// Magic number at the start of every message ("VRDM").
pub const MAGIC: u32 = 0x4d44_5256;
/// Protocol version this build speaks.
/// Bumped whenever a message or a shared-memory layout changes: a client and a daemon of
/// different layouts must refuse each other at Hello, not misread each other's rings.
pub const VERSION: u16 = 8;
/// Largest message, header included: a [`MAX_COPY_DATA`] copy with room to spare (a
/// `SOCK_SEQPACKET` datagram this size fits the default socket buffers).
pub const MAX_MESSAGE: usize = MAX_COPY_DATA + 8 * 1024;
/// Largest number of file descriptors carried by one message.
pub const MAX_FDS: usize = 64;
/// Largest string in a message.
pub const MAX_STRING: usize = 1024;
/// Largest number of chunks of one MR.
pub const MAX_MR_CHUNKS: usize = 64;
/// Most bytes one [`Request::PeerMrWrite`] or [`Reply::Bytes`] carries (well inside
/// [`MAX_MESSAGE`] with its header). Each is a round trip to vrdmad, so larger ones move the
/// copying fallback's large writes faster (docs/measurements.md); 64 KiB keeps a
/// datagram's linear part in the kernel to an order-2 allocation (the rest goes in page
/// fragments), which a fragmented host can still satisfy.
pub const MAX_COPY_DATA: usize = 64 * 1024;

/// Decoding failures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message of {len} bytes is shorter than its {need}-byte header")]
    ShortHeader { len: usize, need: usize },
    #[error("bad magic {magic:#x}")]
    BadMagic { magic: u32 },
    #[error("unsupported protocol version {version}")]
    BadVersion { version: u16 },
    #[error("payload length {declared} does not match the {actual} bytes received")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("message of {len} bytes exceeds the maximum {max}")]
    TooLong { len: usize, max: usize },
    #[error("unknown operation {op}")]
    UnknownOp { op: u16 },
    #[error("truncated payload: needed {need} bytes at offset {offset}, had {have}")]
    Truncated { offset: usize, need: usize, have: usize },
    #[error("{what} count {count} exceeds the maximum {max}")]
    TooMany { what: &'static str, count: usize, max: usize },
    #[error("string is not UTF-8")]
    BadString,
    #[error("{extra} trailing bytes after the payload")]
    Trailing { extra: usize },
    #[error("field {field} has invalid value {value}")]
    BadValue { field: &'static str, value: u64 },
}

/// One piece of a memory region: `len` bytes at `mr_offset` within the MR's page-aligned
/// span are the bytes of the accompanying memfd at `fd_offset`. Each chunk carries one fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrChunk {
    /// Offset within the page-aligned span of the MR.
    pub mr_offset: u64,
    /// Length in bytes (page multiple).
    pub len: u64,
    /// Offset within the memfd (page multiple).
    pub fd_offset: u64,
}

/// Capabilities requested for a QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather elements per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather elements per receive WR.
    pub max_recv_sge: u32,
    /// Inline data bytes.
    pub max_inline_data: u32,
}

/// Per-vNIC resource limits (also stored with each vNIC record, as JSON, with the `serde`
/// feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Limits {
    /// Protection domains.
    pub max_pd: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Queue pairs.
    pub max_qp: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Bytes of registered memory.
    pub max_mr_bytes: u64,
    /// Shared receive queues.
    pub max_srq: u32,
    /// Client sessions (connections to the vNIC's control socket; a daemon thread each).
    #[cfg_attr(feature = "serde", serde(default = "default_max_sessions"))]
    pub max_sessions: u32,
    /// Bytes of queue memory vrdmad allocates for the vNIC's QPs (receive and completion
    /// rings).
    #[cfg_attr(feature = "serde", serde(default = "default_max_ring_bytes"))]
    pub max_ring_bytes: u64,
    /// Lanes (client-held sockets to a peer daemon) of the vNIC's cross-host QPs; QPs beyond
    /// go without one (fully mediated).
    #[cfg_attr(feature = "serde", serde(default = "default_max_lanes"))]
    pub max_lanes: u32,
    /// Control requests being handled at once for the vNIC's sessions.
    #[cfg_attr(feature = "serde", serde(default = "default_max_pending"))]
    pub max_pending: u32,
    /// CPU time vrdmad spends on the vNIC's control requests, in percent of one CPU (beyond
    /// it, the vNIC's requests wait).
    #[cfg_attr(feature = "serde", serde(default = "default_max_control_cpu_percent"))]
    pub max_control_cpu_percent: u32,
}

// (Defaults of the limits added later, for records stored without them.)
fn default_max_sessions() -> u32 {
    Limits::default().max_sessions
}
fn default_max_ring_bytes() -> u64 {
    Limits::default().max_ring_bytes
}
fn default_max_lanes() -> u32 {
    Limits::default().max_lanes
}
fn default_max_pending() -> u32 {
    Limits::default().max_pending
}
fn default_max_control_cpu_percent() -> u32 {
    Limits::default().max_control_cpu_percent
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_pd: 1024,
            max_cq: 4096,
            max_qp: 4096,
            max_mr: 16384,
            max_mr_bytes: 64 << 30,
            max_srq: 1024,
            max_sessions: 256,
            max_ring_bytes: 1 << 30,
            max_lanes: 256,
            max_pending: 64,
            max_control_cpu_percent: 10,
        }
    }
}

/// Counts of the resources a vNIC holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Usage {
    /// Live client connections.
    pub clients: u32,
    /// Protection domains.
    pub pds: u32,
    /// Completion queues.
    pub cqs: u32,
    /// Queue pairs.
    pub qps: u32,
    /// Memory regions.
    pub mrs: u32,
    /// Registered bytes.
    pub mr_bytes: u64,
    /// Shared receive queues.
    pub srqs: u32,
}

/// Client → daemon requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// First message of a connection.
    Hello { version: u32 },
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_dealloc_pd`.
    DeallocPd { pd: u32 },
    /// `ibv_reg_mr`; one fd per chunk follows. No chunks at all registers memory that cannot
    /// be shared (file-backed, hugetlb…): vrdmad then copies every remote access through the
    /// registering process's memory (the copying fallback).
    RegMr { pd: u32, addr: u64, length: u64, access: u32, chunks: Vec<MrChunk> },
    /// `ibv_dereg_mr`.
    DeregMr { key: u32 },
    /// `ibv_create_cq`.
    CreateCq { cqe: u32 },
    /// `ibv_destroy_cq`.
    DestroyCq { cq: u32 },
    /// `ibv_create_srq`.
    CreateSrq { pd: u32, max_wr: u32, max_sge: u32 },
    /// `ibv_destroy_srq`.
    DestroySrq { srq: u32 },
    /// `ibv_create_qp` (`srq` 0 = none).
    CreateQp { pd: u32, send_cq: u32, recv_cq: u32, srq: u32, qp_type: u8, caps: QpCaps },
    /// Tells the daemon the QP's new state (it tracks connections).
    SetQpState { qpn: u32, state: u8 },
    /// `modify_qp(RTR)`: connect to `dest_qpn` at `dgid`.
    ConnectQp { qpn: u32, dgid: [u8; 16], dest_qpn: u32 },
    /// `ibv_destroy_qp`.
    DestroyQp { qpn: u32 },
    /// Map the connected peer's MR with key `key` (for RDMA ops or to fill a receive).
    MapPeerMr { qpn: u32, key: u32 },
    /// Resource counts of this vNIC.
    QueryUsage,
    /// `ibv_create_ah`: whether `dgid` is a vNIC this one may reach (tenant rules).
    CheckGid { dgid: [u8; 16] },
    /// A UD send from `qpn` to `dest_qpn` at `dgid`: the destination UD QP's rings (replied as
    /// [`Reply::Connected`], fds as for [`Request::ConnectQp`]); connects nothing.
    ResolveUd { qpn: u32, dgid: [u8; 16], dest_qpn: u32 },
    /// Map the MR with key `key` of UD QP `dest_qpn`, resolved before by `qpn` (to fill a
    /// receive).
    MapUdPeerMr { qpn: u32, dest_qpn: u32, key: u32 },
    /// Writes `data` at `addr` of the peer's copied MR `key` (see [`Reply::PeerMr`]); the
    /// peer is `qpn`'s connected QP (`dest_qpn` 0) or UD destination `dest_qpn`. `need_remote`:
    /// the access needs REMOTE_WRITE (an RDMA WRITE), else LOCAL_WRITE (a receive buffer).
    PeerMrWrite { qpn: u32, dest_qpn: u32, key: u32, addr: u64, need_remote: bool, data: Vec<u8> },
    /// Reads `len` (≤ [`MAX_COPY_DATA`]) bytes at `addr` of the peer's copied MR `key`
    /// (REMOTE_READ); replied as [`Reply::Bytes`].
    PeerMrRead { qpn: u32, dest_qpn: u32, key: u32, addr: u64, len: u32 },
    /// An RDMA atomic on the 8 bytes at `addr` of the peer's copied MR `key`; replied as
    /// [`Reply::Atomic`].
    PeerMrAtomic { qpn: u32, dest_qpn: u32, key: u32, addr: u64, cmp_swap: bool, compare_add: u64, swap: u64 },
}

/// vNIC description returned by [`Reply::Hello`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnicInfo {
    /// vNIC name.
    pub name: String,
    /// Tenant.
    pub tenant: String,
    /// GID table (vGIDs).
    pub gids: Vec<[u8; 16]>,
    /// Limits.
    pub limits: Limits,
    /// Node GUID.
    pub node_guid: u64,
}

/// Description of a connected peer's shared state; fds follow in order: QP region, recv CQ
/// region, recv CQ eventfd, and the SRQ region if `srq_ring` is some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Peer's QP number.
    pub qpn: u32,
    /// Peer's receive ring (entries, max_sge), if it has no SRQ.
    pub rq_ring: Option<(u32, u32)>,
    /// Peer's inbound completion ring entries.
    pub comp_entries: u32,
    /// Peer's SRQ ring (entries, max_sge), if any.
    pub srq_ring: Option<(u32, u32)>,
}

/// Daemon → client replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The request failed with `errno`.
    Error { errno: i32, message: String },
    /// Done, nothing to return.
    Ok,
    /// Hello answered.
    Hello(VnicInfo),
    /// A new handle (PD, CQ, SRQ…).
    Handle { handle: u32 },
    /// A registered MR.
    Mr { lkey: u32, rkey: u32 },
    /// A CQ; fds: region memfd, eventfd.
    Cq { cq: u32 },
    /// An SRQ; fd: region memfd.
    Srq { srq: u32, entries: u32, max_sge: u32 },
    /// A QP; fd: region memfd.
    Qp { qpn: u32, rq_entries: u32, max_recv_sge: u32, comp_entries: u32 },
    /// Connected; fds as described in [`PeerInfo`].
    Connected(PeerInfo),
    /// Connected through vrdmad's engine (the peer is on another host, or policy mediates):
    /// the QP posts its send WRs into a [`crate::ring::SqRing`] of `sq_entries` slots
    /// (`max_sge`, `max_inline`) and polls send completions from a ring of `comp_entries`,
    /// both in one channel region ([`crate::ring::MediatedLayout`]); fds: that region and
    /// the engine's doorbell eventfd, and, when the engine gives the QP a *lane*, the lane's
    /// TCP socket: the client may write its requests there itself while it holds the
    /// channel's send side ([`crate::ring::MED_SEND_SIDE`]).
    ConnectedMediated { sq_entries: u32, max_sge: u32, max_inline: u32, comp_entries: u32 },
    /// A UD destination on another host, reached through vrdmad: the UD QP sends its
    /// datagrams there as [`crate::ud::UdDatagram`] messages on the `SOCK_SEQPACKET` socket
    /// in fds (the same socket for every remote destination of the QP).
    UdRemote,
    /// A peer MR; one fd per chunk. No chunks: the MR is copied (registered without chunks),
    /// reach it with [`Request::PeerMrWrite`], [`Request::PeerMrRead`] and
    /// [`Request::PeerMrAtomic`].
    PeerMr { addr: u64, length: u64, access: u32, chunks: Vec<MrChunk> },
    /// Bytes read from a copied MR.
    Bytes { data: Vec<u8> },
    /// An atomic's original value.
    Atomic { old: u64 },
    /// Usage of this vNIC.
    Usage(Usage),
}
