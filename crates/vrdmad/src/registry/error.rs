//! Why the registry refuses a request (sent back to the client as errno and message), and
//! why it drops a datagram another daemon forwarded.

use std::net::{Ipv6Addr, SocketAddr};

use vrdma_abi::control::{MrChunk, QpCaps};
use vrdma_abi::shm::ShmError;
use vrdma_core::access::Need;

use crate::engine::EngineError;
use crate::procmem::ProcMemError;

/// Failure of a request. The client gets [`RequestError::errno`] and the `Display` text;
/// [`RequestError::is_bad_input`] tells a protocol violation (counted and logged) from a
/// normal verb failure such as a limit.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    // Protocol violations: malformed requests, or objects the caller does not own.
    /// The session is not (or no longer) open.
    #[error("no session")]
    NoSession,
    /// A request came with another number of descriptors than it needs.
    #[error("expected {expected} fds, got {got}")]
    FdCount { expected: usize, got: usize },
    /// HELLO with a protocol version this daemon does not speak.
    #[error("protocol version {version} unsupported")]
    Version { version: u32 },
    #[error("PD handle {pd} is not yours")]
    NotYourPd { pd: u32 },
    #[error("CQ handle {cq} is not yours")]
    NotYourCq { cq: u32 },
    #[error("SRQ {srq} is not yours")]
    NotYourSrq { srq: u32 },
    #[error("QP {qpn} is not yours")]
    NotYourQp { qpn: u32 },
    #[error("MR key {key:#x} is not yours")]
    NotYourMr { key: u32 },
    #[error("state {state} invalid")]
    BadQpState { state: u8 },
    #[error("QP {qpn} is not an RC QP")]
    NotRcQp { qpn: u32 },
    #[error("QP {qpn} is not a UD QP")]
    NotUdQp { qpn: u32 },
    #[error("QP {qpn} did not resolve UD QP {dest_qpn}")]
    UdDestNotResolved { qpn: u32, dest_qpn: u32 },
    #[error("empty MR")]
    EmptyMr,
    #[error("MR wraps the address space")]
    MrWraps,
    #[error("MR chunk {chunk:?} does not tile the region")]
    ChunkMisplaced { chunk: MrChunk },
    #[error("chunk overflows")]
    ChunkOverflows,
    /// A chunk's memfd is not sealed, or smaller than the chunk.
    #[error("{0}")]
    ChunkUnsealed(#[source] ShmError),
    #[error("MR chunks cover {covered} bytes, the region spans {span}")]
    ChunksShort { covered: u64, span: u64 },
    #[error("MR {key:#x} is not a copied MR")]
    NotCopiedMr { key: u32 },
    #[error("not a copy request")]
    NotCopyRequest,

    // Verb failures.
    /// The session's vNIC left this host (deleted or moved) while the session was open.
    #[error("vNIC was deleted")]
    VnicDeleted,
    #[error("no vNIC named {name}")]
    NoSuchVnic { name: String },
    #[error("vNIC {name} has {clients} live clients")]
    VnicInUse { name: String, clients: u32 },
    /// A per-vNIC object count limit (`object`: PD, CQ, SRQ, QP, MR).
    #[error("{object} limit {limit} reached")]
    LimitReached { object: &'static str, limit: u32 },
    #[error("MR byte limit {limit} reached")]
    MrBytesLimit { limit: u64 },
    #[error("PD {pd} still has QPs, MRs or SRQs")]
    PdInUse { pd: u32 },
    #[error("CQ {cq} still has QPs")]
    CqInUse { cq: u32 },
    #[error("SRQ {srq} still has QPs")]
    SrqInUse { srq: u32 },
    #[error("cqe {cqe} out of range")]
    CqeOutOfRange { cqe: u32 },
    #[error("SRQ max_wr {max_wr} / max_sge {max_sge} out of range")]
    SrqOutOfRange { max_wr: u32, max_sge: u32 },
    #[error("QP type {qp_type} is not supported (RC and UD only)")]
    QpTypeUnsupported { qp_type: u8 },
    #[error("QP capabilities {caps:?} exceed the device limits")]
    QpCapsTooLarge { caps: QpCaps },
    /// Creating or mapping a queue's shared memory failed.
    #[error("{0}")]
    QueueMemory(#[source] ShmError),
    #[error("eventfd failed")]
    Eventfd(#[source] std::io::Error),
    #[error("the QP's CQ is gone")]
    QpCqGone,
    #[error("the QP's SRQ is gone")]
    QpSrqGone,
    #[error("the QP's datagram socket is gone")]
    UdSocketGone,
    #[error("no vNIC has GID {gid}")]
    UnknownGid { gid: Ipv6Addr },
    #[error("tenant {from} may not connect to tenant {to}")]
    TenantsNotAllowed { from: String, to: String },
    /// A peer daemon's request names a source vNIC that daemon does not serve.
    #[error("the daemon at {from} may not speak for GID {gid}: {why}")]
    ForeignSource { gid: Ipv6Addr, from: std::net::SocketAddr, why: super::cluster::SourceRefusal },
    #[error("vNIC {vnic} is on host {host}, which is down")]
    HostDown { vnic: String, host: String },
    #[error("vNIC {vnic} has no QP {qpn}")]
    NoRcQp { vnic: String, qpn: u32 },
    #[error("vNIC {vnic} has no UD QP {qpn}")]
    NoUdQp { vnic: String, qpn: u32 },
    #[error("UD QP {qpn} is gone")]
    UdDestGone { qpn: u32 },
    #[error("QP {qpn} is not connected")]
    NotConnected { qpn: u32 },
    /// A peer is on another host (or policy mediates) and this registry has no engine.
    #[error("no mediated engine")]
    NoEngine,
    #[error("cross-host connection needs the mediated engine")]
    CrossHostNeedsEngine,
    /// The engine failed to reach, or was refused by, the peer's daemon.
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("key {key:#x} is not an MR of the peer's PD")]
    NotPeerMr { key: u32 },
    #[error("MR {key:#x} does not grant {need:?} on {len} bytes at {addr:#x}")]
    MrDenies { key: u32, need: Need, len: u64, addr: u64 },
    /// A copied MR over memory the session's process cannot share, and its memory could
    /// not be opened when it connected.
    #[error("memory that cannot be shared needs the client's memory: {why}")]
    NoProcessMemory { why: String },
    #[error("memory that cannot be shared cannot be registered on this session")]
    CopyUnsupported,
    /// A copied MR's bytes are not readable in its owner's memory.
    #[error("{0}")]
    MrUnreadable(#[source] ProcMemError),
    /// A copy through a copied MR's owner memory failed.
    #[error("{0}")]
    Copy(#[source] ProcMemError),
}

impl RequestError {
    /// The errno the client's verb returns.
    pub fn errno(&self) -> i32 {
        use RequestError::*;
        match self {
            NoSession | FdCount { .. } | NotYourPd { .. } | NotYourCq { .. } | NotYourSrq { .. } | NotYourQp { .. } => libc::EINVAL,
            NotYourMr { .. } | BadQpState { .. } | NotRcQp { .. } | NotUdQp { .. } | UdDestNotResolved { .. } => libc::EINVAL,
            EmptyMr | MrWraps | ChunkMisplaced { .. } | ChunkOverflows | ChunkUnsealed(_) | ChunksShort { .. } => libc::EINVAL,
            NotCopiedMr { .. } | NotCopyRequest => libc::EINVAL,
            Version { .. } => libc::EPROTO,
            VnicDeleted => libc::ENODEV,
            NoSuchVnic { .. } | NoUdQp { .. } | UdDestGone { .. } => libc::ENOENT,
            VnicInUse { .. } | PdInUse { .. } | CqInUse { .. } | SrqInUse { .. } => libc::EBUSY,
            LimitReached { .. } | QueueMemory(_) | Eventfd(_) => libc::ENOMEM,
            MrBytesLimit { .. } => libc::EDQUOT,
            CqeOutOfRange { .. } | SrqOutOfRange { .. } | QpCapsTooLarge { .. } | QpCqGone | QpSrqGone => libc::EINVAL,
            QpTypeUnsupported { .. } | CopyUnsupported => libc::EOPNOTSUPP,
            UdSocketGone => libc::EIO,
            UnknownGid { .. } | HostDown { .. } | NoEngine | CrossHostNeedsEngine => libc::EHOSTUNREACH,
            TenantsNotAllowed { .. } | NoRcQp { .. } | ForeignSource { .. } => libc::ECONNREFUSED,
            NotConnected { .. } => libc::ENOTCONN,
            Engine(e) => e.errno(),
            NotPeerMr { .. } | MrDenies { .. } => libc::EACCES,
            NoProcessMemory { .. } => libc::EPERM,
            MrUnreadable(_) => libc::EFAULT,
            Copy(ProcMemError::Misaligned { .. }) => libc::EINVAL,
            Copy(_) => libc::EFAULT,
        }
    }

    /// Whether this is a protocol violation (a malformed request, or one naming objects the
    /// caller does not own), counted as bad input, rather than a normal verb failure.
    pub fn is_bad_input(&self) -> bool {
        use RequestError::*;
        matches!(
            self,
            NoSession
                | FdCount { .. }
                | Version { .. }
                | NotYourPd { .. }
                | NotYourCq { .. }
                | NotYourSrq { .. }
                | NotYourQp { .. }
                | NotYourMr { .. }
                | BadQpState { .. }
                | NotRcQp { .. }
                | NotUdQp { .. }
                | UdDestNotResolved { .. }
                | EmptyMr
                | MrWraps
                | ChunkMisplaced { .. }
                | ChunkOverflows
                | ChunkUnsealed(_)
                | ChunksShort { .. }
                | NotCopiedMr { .. }
                | NotCopyRequest
        )
    }
}

/// Why a datagram another daemon forwarded may not reach one of our UD QPs (it is dropped,
/// as a network would drop it; the reason is only logged).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UdRefusal {
    #[error("no UD QP {qpn}")]
    NoUdQp { qpn: u32 },
    #[error("the QP has no session")]
    NoSession,
    #[error("its vNIC was deleted")]
    VnicDeleted,
    #[error("QP {qpn} is not at GID {gid}")]
    WrongGid { qpn: u32, gid: Ipv6Addr },
    #[error("unknown source GID")]
    UnknownSource,
    #[error("source vNIC {vnic} is not served by {from}")]
    WrongDaemon { vnic: String, from: SocketAddr },
    #[error("tenant {from} may not reach tenant {to}")]
    TenantsNotAllowed { from: String, to: String },
}
