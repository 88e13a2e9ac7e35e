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
pub const VERSION: u16 = 14;
/// Largest message, header included: a [`MAX_COPY_DATA`] copy with room to spare (a
/// `SOCK_SEQPACKET` datagram this size fits the default socket buffers).
pub const MAX_MESSAGE: usize = MAX_COPY_DATA + 8 * 1024;
/// Largest number of file descriptors carried by one message.
pub const MAX_FDS: usize = 64;
/// Largest string in a message.
pub const MAX_STRING: usize = 1024;
/// Largest number of chunks of one MR.
pub const MAX_MR_CHUNKS: usize = 64;
/// Most MR keys one [`Reply::Keys`] carries (the client asks again while it gets some).
pub const MAX_KEYS: usize = 1024;
/// Most bytes one [`Request::PeerMrWrite`] or [`Reply::Bytes`] carries (well inside
/// [`MAX_MESSAGE`] with its header). Each is a round trip to vrdmad, so larger ones move the
/// copying fallback's large writes faster (docs/measurements.md); 64 KiB keeps a
/// datagram's linear part in the kernel to an order-2 allocation (the rest goes in page
/// fragments), which a fragmented host can still satisfy.
pub const MAX_COPY_DATA: usize = 64 * 1024;
/// Most bytes one [`Request::PeerMrCopy`] moves: no byte crosses the socket, so only the
/// time one request holds a vrdmad thread bounds it (about a millisecond at memory speed).
pub const MAX_DIRECT_COPY: usize = 4 << 20;

/// Decoding failures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The message is too short to hold a [`Header`].
    #[error("message of {len} bytes is shorter than its {need}-byte header")]
    ShortHeader {
        /// Bytes received.
        len: usize,
        /// Bytes of a header.
        need: usize,
    },
    /// The header does not start with [`MAGIC`]: not a vrdma message.
    #[error("bad magic {magic:#x}")]
    BadMagic {
        /// The first four bytes, as read.
        magic: u32,
    },
    /// The header's protocol version is not [`VERSION`].
    #[error("unsupported protocol version {version}")]
    BadVersion {
        /// The version the peer speaks.
        version: u16,
    },
    /// The header's payload length disagrees with the datagram's size.
    #[error("payload length {declared} does not match the {actual} bytes received")]
    LengthMismatch {
        /// Payload bytes the header declares.
        declared: usize,
        /// Payload bytes that arrived.
        actual: usize,
    },
    /// The message is larger than [`MAX_MESSAGE`].
    #[error("message of {len} bytes exceeds the maximum {max}")]
    TooLong {
        /// Bytes of the message.
        len: usize,
        /// The largest message allowed.
        max: usize,
    },
    /// The header's operation code names no request or reply.
    #[error("unknown operation {op}")]
    UnknownOp {
        /// The operation code received.
        op: u16,
    },
    /// The payload ends inside a field.
    #[error("truncated payload: needed {need} bytes at offset {offset}, had {have}")]
    Truncated {
        /// Payload offset of the field.
        offset: usize,
        /// Bytes the field needs.
        need: usize,
        /// Bytes left from `offset`.
        have: usize,
    },
    /// A length-prefixed list or string is longer than its limit.
    #[error("{what} count {count} exceeds the maximum {max}")]
    TooMany {
        /// What is counted (chunks, GIDs, string bytes…).
        what: &'static str,
        /// The count received.
        count: usize,
        /// Its limit.
        max: usize,
    },
    /// A string field is not valid UTF-8.
    #[error("string is not UTF-8")]
    BadString,
    /// Bytes remain after the last field of the payload.
    #[error("{extra} trailing bytes after the payload")]
    Trailing {
        /// Bytes left over.
        extra: usize,
    },
    /// A field holds a value outside its domain (an unknown enum value, a bool not 0 or 1…).
    #[error("field {field} has invalid value {value}")]
    BadValue {
        /// The field's name.
        field: &'static str,
        /// The value received.
        value: u64,
    },
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
    /// Bytes of queue memory vrdmad allocates for the vNIC's QPs, SRQs and CQs (receive and
    /// completion rings, CQ pages).
    #[cfg_attr(feature = "serde", serde(default = "default_max_ring_bytes"))]
    pub max_ring_bytes: u64,
    /// Lanes (client-held sockets to a peer daemon) of the vNIC's cross-host QPs; QPs beyond
    /// go without one (fully mediated).
    #[cfg_attr(feature = "serde", serde(default = "default_max_lanes"))]
    pub max_lanes: u32,
    /// Descriptors vrdmad holds for the vNIC's MRs: the memfds they live in, which each
    /// registration sends, and the read-only copies made for peers.
    #[cfg_attr(feature = "serde", serde(default = "default_max_fds"))]
    pub max_fds: u32,
    /// Control requests being handled at once for the vNIC's sessions.
    #[cfg_attr(feature = "serde", serde(default = "default_max_pending"))]
    pub max_pending: u32,
    /// CPU time vrdmad spends on the vNIC's control requests, in percent of one CPU (beyond
    /// it, the vNIC's requests wait).
    #[cfg_attr(feature = "serde", serde(default = "default_max_control_cpu_percent"))]
    pub max_control_cpu_percent: u32,
    /// CPU time vrdmad spends copying for the vNIC's copied MRs (the copying fallback's
    /// `PeerMrRead`/`PeerMrWrite`/`PeerMrCopy`/`PeerMrAtomic`), in percent of one CPU: the
    /// data path of memory that cannot be shared, paced apart from control requests.
    #[cfg_attr(feature = "serde", serde(default = "default_max_copy_cpu_percent"))]
    pub max_copy_cpu_percent: u32,
}

// (Defaults of the limits added later, for records stored without them.)
#[cfg(feature = "serde")]
fn default_max_sessions() -> u32 {
    Limits::default().max_sessions
}
#[cfg(feature = "serde")]
fn default_max_ring_bytes() -> u64 {
    Limits::default().max_ring_bytes
}
#[cfg(feature = "serde")]
fn default_max_lanes() -> u32 {
    Limits::default().max_lanes
}
#[cfg(feature = "serde")]
fn default_max_fds() -> u32 {
    Limits::default().max_fds
}
#[cfg(feature = "serde")]
fn default_max_pending() -> u32 {
    Limits::default().max_pending
}
#[cfg(feature = "serde")]
fn default_max_control_cpu_percent() -> u32 {
    Limits::default().max_control_cpu_percent
}
#[cfg(feature = "serde")]
fn default_max_copy_cpu_percent() -> u32 {
    Limits::default().max_copy_cpu_percent
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
            max_fds: 8192,
            max_pending: 64,
            max_control_cpu_percent: 10,
            max_copy_cpu_percent: 50,
        }
    }
}

/// Quality-of-service policy of a vNIC or a tenant: caps on what it sends and its weight in
/// fair sharing (also stored with the records, as JSON, with the `serde` feature). A cap of
/// 0 means none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
pub struct Qos {
    /// Egress bytes per second (payload bytes of the WRs it posts); 0: uncapped.
    pub max_bw: u64,
    /// Work requests per second it posts; 0: uncapped.
    pub max_msg_rate: u64,
    /// Share of a contended link relative to other vNICs (or tenants); at least 1.
    pub weight: u32,
}

impl Default for Qos {
    fn default() -> Self {
        Qos { max_bw: 0, max_msg_rate: 0, weight: 1 }
    }
}

impl Qos {
    /// Whether the policy caps anything.
    pub fn is_capped(&self) -> bool {
        self.max_bw != 0 || self.max_msg_rate != 0
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
    Hello {
        /// The protocol version the client speaks ([`VERSION`]).
        version: u32,
    },
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_dealloc_pd`.
    DeallocPd {
        /// The PD handle to free.
        pd: u32,
    },
    /// `ibv_reg_mr`; one fd per chunk follows. No chunks at all registers memory that cannot
    /// be shared (file-backed, hugetlb…): vrdmad then copies every remote access through the
    /// registering process's memory (the copying fallback).
    RegMr {
        /// The PD the MR belongs to.
        pd: u32,
        /// Start of the region in the registering process's address space.
        addr: u64,
        /// Bytes of the region.
        length: u64,
        /// Access flags ([`crate::verbs::access`]).
        access: u32,
        /// The memfd pieces that back the region's page-aligned span (empty: copied MR).
        chunks: Vec<MrChunk>,
    },
    /// `ibv_dereg_mr`.
    DeregMr {
        /// The MR's lkey.
        key: u32,
    },
    /// `ibv_create_cq`.
    CreateCq {
        /// Minimum number of completion entries.
        cqe: u32,
    },
    /// `ibv_destroy_cq`.
    DestroyCq {
        /// The CQ handle.
        cq: u32,
    },
    /// `ibv_create_srq`.
    CreateSrq {
        /// The PD the SRQ belongs to.
        pd: u32,
        /// Receive work requests it holds.
        max_wr: u32,
        /// Scatter/gather elements per receive work request.
        max_sge: u32,
    },
    /// `ibv_destroy_srq`.
    DestroySrq {
        /// The SRQ handle.
        srq: u32,
    },
    /// `ibv_create_qp` (`srq` 0 = none).
    CreateQp {
        /// The PD the QP belongs to.
        pd: u32,
        /// The CQ send completions go to.
        send_cq: u32,
        /// The CQ receive completions go to.
        recv_cq: u32,
        /// The SRQ it receives from, 0 for its own receive queue.
        srq: u32,
        /// Raw `ibv_qp_type` (RC or UD).
        qp_type: u8,
        /// Queue depths and limits requested.
        caps: QpCaps,
    },
    /// Tells the daemon the QP's new state (it tracks connections).
    SetQpState {
        /// The QP.
        qpn: u32,
        /// Raw `ibv_qp_state` it moved to.
        state: u8,
    },
    /// `modify_qp(RTR)`: connect to `dest_qpn` at `dgid`.
    ConnectQp {
        /// The caller's RC QP.
        qpn: u32,
        /// The destination vNIC's GID.
        dgid: [u8; 16],
        /// The destination QP number.
        dest_qpn: u32,
    },
    /// `ibv_destroy_qp`.
    DestroyQp {
        /// The QP.
        qpn: u32,
    },
    /// The library obeys `ring::QP_QOS_DEMOTE`: its directly connected RC QP `qpn` moves
    /// onto vrdmad's engine, which enforces the vNIC's caps from now on (reply
    /// [`Reply::ConnectedMediated`] with the channel's fds, as for a mediated `ConnectQp`).
    MoveToEngine {
        /// The caller's RC QP, connected on the direct path.
        qpn: u32,
    },
    /// Map the connected peer's MR with key `key` (for RDMA ops or to fill a receive).
    MapPeerMr {
        /// The caller's connected RC QP.
        qpn: u32,
        /// The peer MR's rkey (or lkey, to fill a receive).
        key: u32,
    },
    /// Resource counts of this vNIC.
    QueryUsage,
    /// `ibv_create_ah`: whether `dgid` is a vNIC this one may reach (tenant rules).
    CheckGid {
        /// The destination GID of the address handle.
        dgid: [u8; 16],
    },
    /// A UD send from `qpn` to `dest_qpn` at `dgid`: the destination UD QP's rings (replied as
    /// [`Reply::Connected`], fds as for [`Request::ConnectQp`]); connects nothing.
    ResolveUd {
        /// The caller's UD QP.
        qpn: u32,
        /// The destination vNIC's GID.
        dgid: [u8; 16],
        /// The destination UD QP number.
        dest_qpn: u32,
    },
    /// Map the MR with key `key` of UD QP `dest_qpn`, resolved before by `qpn` (to fill a
    /// receive).
    MapUdPeerMr {
        /// The caller's UD QP.
        qpn: u32,
        /// The resolved destination UD QP.
        dest_qpn: u32,
        /// The destination's MR key.
        key: u32,
    },
    /// Writes `data` at `addr` of the peer's copied MR `key` (see [`Reply::PeerMr`]); the
    /// peer is `qpn`'s connected QP (`dest_qpn` 0) or UD destination `dest_qpn`. `need_remote`:
    /// the access needs REMOTE_WRITE (an RDMA WRITE), else LOCAL_WRITE (a receive buffer).
    PeerMrWrite {
        /// The caller's QP.
        qpn: u32,
        /// The UD destination, or 0 for the RC QP's connected peer.
        dest_qpn: u32,
        /// The peer MR's key.
        key: u32,
        /// Address in the peer MR to write at.
        addr: u64,
        /// Whether the write needs REMOTE_WRITE (else LOCAL_WRITE).
        need_remote: bool,
        /// The bytes to write (at most [`MAX_COPY_DATA`]).
        data: Vec<u8>,
    },
    /// Reads `len` (≤ [`MAX_COPY_DATA`]) bytes at `addr` of the peer's copied MR `key`
    /// (REMOTE_READ); replied as [`Reply::Bytes`].
    PeerMrRead {
        /// The caller's QP.
        qpn: u32,
        /// The UD destination, or 0 for the RC QP's connected peer.
        dest_qpn: u32,
        /// The peer MR's key.
        key: u32,
        /// Address in the peer MR to read from.
        addr: u64,
        /// Bytes to read.
        len: u32,
    },
    /// An RDMA atomic on the 8 bytes at `addr` of the peer's copied MR `key`; replied as
    /// [`Reply::Atomic`].
    PeerMrAtomic {
        /// The caller's QP.
        qpn: u32,
        /// The UD destination, or 0 for the RC QP's connected peer.
        dest_qpn: u32,
        /// The peer MR's key.
        key: u32,
        /// Address of the 8-byte target (8-byte aligned).
        addr: u64,
        /// Compare-and-swap if true, else fetch-and-add.
        cmp_swap: bool,
        /// The value compared with (compare-and-swap) or added (fetch-and-add).
        compare_add: u64,
        /// The value stored when the comparison holds (compare-and-swap only).
        swap: u64,
    },
    /// Copies `len` (≤ [`MAX_DIRECT_COPY`]) bytes between `[addr, addr+len)` of the peer's
    /// copied MR `key` and `[local_addr, local_addr+len)` of the caller's own MR `lkey` (in
    /// the PD of `qpn`), vrdmad moving the bytes itself: no byte crosses the socket. `to_peer`:
    /// from the caller's MR into the peer's (an RDMA WRITE, needing REMOTE_WRITE with
    /// `need_remote`, else LOCAL_WRITE: a receive buffer), else from the peer's into the
    /// caller's (an RDMA READ: REMOTE_READ there, LOCAL_WRITE here). Replied [`Reply::Ok`];
    /// EOPNOTSUPP when vrdmad cannot reach the caller's memory (the caller falls back on
    /// [`Request::PeerMrRead`] / [`Request::PeerMrWrite`]). `staged` (a READ only): the
    /// bytes go to the start of the session's staging buffer ([`Request::CopyStaging`])
    /// instead, for the caller to copy into its MR itself; the caller's MR is checked all
    /// the same.
    PeerMrCopy {
        /// The caller's QP.
        qpn: u32,
        /// The UD destination, or 0 for the RC QP's connected peer.
        dest_qpn: u32,
        /// The peer MR's key.
        key: u32,
        /// Address in the peer MR.
        addr: u64,
        /// The caller's own MR (its lkey).
        lkey: u32,
        /// Address in the caller's MR.
        local_addr: u64,
        /// Bytes to copy.
        len: u32,
        /// Direction: caller → peer if true, else peer → caller.
        to_peer: bool,
        /// A write into the peer needs REMOTE_WRITE (else LOCAL_WRITE).
        need_remote: bool,
        /// A READ into the session's staging buffer (see above).
        staged: bool,
    },
    /// The session's staging buffer for staged direct copies: a sealed memfd of
    /// [`MAX_DIRECT_COPY`] bytes, made at the first ask (charged to the vNIC's queue memory)
    /// and the same for the session's life; replied [`Reply::Ok`] with its fd. The caller
    /// maps it read-only and takes each [`Request::PeerMrCopy`]'s bytes from it before its
    /// next staged copy.
    CopyStaging,
    /// The keys of this session's MRs that a peer lost the right to while it had them
    /// mapped: each must move onto new memfd pages ([`Request::RehomeMr`]). vrdmad signals
    /// the eventfd of the [`Reply::Hello`] when there are some.
    TakeRehomes,
    /// MR `key` is about to move: peers asking for it get EBUSY (and wait) until the
    /// [`Request::RehomeMr`] that follows; the owner's MR epoch moves on now, so that peers
    /// stop using their mappings before the bytes are copied.
    BeginRehome {
        /// The MR about to move.
        key: u32,
    },
    /// MR `key` now lives on these chunks (one fd each, tiling its page span as at
    /// registration): its former memfds are no longer its memory, and peers that still may
    /// access it map the new ones (its owner's QPs' MR epoch moves on). No chunks: it did
    /// not move after all (it stays on its memfds).
    RehomeMr {
        /// The MR that moved.
        key: u32,
        /// Its new chunks (their memfds travel as fds).
        chunks: Vec<MrChunk>,
    },
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
    Error {
        /// The errno the verb returns.
        errno: i32,
        /// Why, for the client's logs.
        message: String,
    },
    /// Done, nothing to return.
    Ok,
    /// Hello answered; fd (from daemons that re-home MRs): an eventfd signalled when
    /// [`Request::TakeRehomes`] has keys to give.
    Hello(VnicInfo),
    /// A new handle (PD, CQ, SRQ…).
    Handle {
        /// The object's handle, unique within the session.
        handle: u32,
    },
    /// A registered MR.
    Mr {
        /// Key for local access (work requests of this process).
        lkey: u32,
        /// Key peers use for RDMA access.
        rkey: u32,
    },
    /// A CQ; fds: region memfd, eventfd.
    Cq {
        /// The CQ handle.
        cq: u32,
    },
    /// An SRQ; fd: region memfd.
    Srq {
        /// The SRQ handle.
        srq: u32,
        /// Slots of its receive ring (≥ the requested `max_wr`).
        entries: u32,
        /// Scatter/gather elements per slot.
        max_sge: u32,
    },
    /// A QP; fd: region memfd.
    Qp {
        /// The QP number.
        qpn: u32,
        /// Slots of its receive ring (0 with an SRQ).
        rq_entries: u32,
        /// Scatter/gather elements per receive slot.
        max_recv_sge: u32,
        /// Slots of its inbound completion ring.
        comp_entries: u32,
    },
    /// Connected; fds as described in [`PeerInfo`].
    Connected(PeerInfo),
    /// Connected through vrdmad's engine (the peer is on another host, or policy mediates):
    /// the QP posts its send WRs into a [`crate::ring::SqRing`] of `sq_entries` slots
    /// (`max_sge`, `max_inline`) and polls send completions from a ring of `comp_entries`,
    /// both in one channel region ([`crate::ring::MediatedLayout`]); fds: that region and
    /// the engine's doorbell eventfd, and, when the engine gives the QP a *lane*, the lane's
    /// TCP socket: the client may write its requests there itself while it holds the
    /// channel's send side ([`crate::ring::MED_SEND_SIDE`]).
    ConnectedMediated {
        /// Slots of the send ring.
        sq_entries: u32,
        /// Scatter/gather elements per send slot.
        max_sge: u32,
        /// Inline data bytes per send slot.
        max_inline: u32,
        /// Slots of the send-completion ring.
        comp_entries: u32,
    },
    /// A UD destination on another host, reached through vrdmad: the UD QP sends its
    /// datagrams there as [`crate::ud::UdDatagram`] messages on the `SOCK_SEQPACKET` socket
    /// in fds (the same socket for every remote destination of the QP).
    UdRemote,
    /// A peer MR; one fd per chunk. No chunks: the MR is copied (registered without chunks),
    /// reach it with [`Request::PeerMrWrite`], [`Request::PeerMrRead`] and
    /// [`Request::PeerMrAtomic`].
    PeerMr {
        /// Start address of the MR in its owner's address space.
        addr: u64,
        /// Bytes of the MR.
        length: u64,
        /// Its access flags ([`crate::verbs::access`]).
        access: u32,
        /// The memfd pieces to map (empty: a copied MR).
        chunks: Vec<MrChunk>,
    },
    /// Bytes read from a copied MR.
    Bytes {
        /// The bytes read.
        data: Vec<u8>,
    },
    /// An atomic's original value.
    Atomic {
        /// The 8 bytes at the target before the atomic.
        old: u64,
    },
    /// Usage of this vNIC.
    Usage(Usage),
    /// MR keys (at most [`MAX_KEYS`]).
    Keys {
        /// The MR keys.
        keys: Vec<u32>,
    },
}
