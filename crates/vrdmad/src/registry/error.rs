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
    FdCount {
        /// Descriptors the request needs.
        expected: usize,
        /// Descriptors that came with it.
        got: usize,
    },
    /// HELLO with a protocol version this daemon does not speak.
    #[error("protocol version {version} unsupported")]
    Version {
        /// The version the client asked for.
        version: u32,
    },
    /// The request names a PD handle this session did not allocate.
    #[error("PD handle {pd} is not yours")]
    NotYourPd {
        /// The PD handle named.
        pd: u32,
    },
    /// The request names a CQ handle this session did not create.
    #[error("CQ handle {cq} is not yours")]
    NotYourCq {
        /// The CQ handle named.
        cq: u32,
    },
    /// The request names an SRQ this session did not create.
    #[error("SRQ {srq} is not yours")]
    NotYourSrq {
        /// The SRQ handle named.
        srq: u32,
    },
    /// The request names a QP number this session did not create.
    #[error("QP {qpn} is not yours")]
    NotYourQp {
        /// The QP number named.
        qpn: u32,
    },
    /// The request names an MR key this session did not register.
    #[error("MR key {key:#x} is not yours")]
    NotYourMr {
        /// The MR key named.
        key: u32,
    },
    /// A QP state change to a value that is no `ibv_qp_state`.
    #[error("state {state} invalid")]
    BadQpState {
        /// The raw state value received.
        state: u8,
    },
    /// An RC-only request (connect, map the connected peer's MR) on a QP of another type.
    #[error("QP {qpn} is not an RC QP")]
    NotRcQp {
        /// The caller's QP.
        qpn: u32,
    },
    /// A UD-only request (resolve a destination) on a QP of another type.
    #[error("QP {qpn} is not a UD QP")]
    NotUdQp {
        /// The caller's QP.
        qpn: u32,
    },
    /// A UD QP asks for an MR of a destination it never resolved.
    #[error("QP {qpn} did not resolve UD QP {dest_qpn}")]
    UdDestNotResolved {
        /// The caller's UD QP.
        qpn: u32,
        /// The destination UD QP it did not resolve.
        dest_qpn: u32,
    },
    /// An MR registration of zero bytes.
    #[error("empty MR")]
    EmptyMr,
    /// An MR whose address plus length overflows 64 bits.
    #[error("MR wraps the address space")]
    MrWraps,
    /// An MR chunk that does not start where the previous one ended, or is not page-aligned.
    #[error("MR chunk {chunk:?} does not tile the region")]
    ChunkMisplaced {
        /// The offending chunk.
        chunk: MrChunk,
    },
    /// An MR chunk whose memfd offset plus length overflows 64 bits.
    #[error("chunk overflows")]
    ChunkOverflows,
    /// A chunk's memfd is not sealed, or smaller than the chunk.
    #[error("{0}")]
    ChunkUnsealed(#[source] ShmError),
    /// A chunk's memfd is leased by its owner: opening it again would wait for the lease.
    #[error("an MR's memfd is leased (F_SETLEASE): it cannot be opened again for a peer")]
    ChunkLeased,
    /// The MR's chunks end before its page-aligned span does.
    #[error("MR chunks cover {covered} bytes, the region spans {span}")]
    ChunksShort {
        /// Bytes the chunks cover.
        covered: u64,
        /// Bytes of the MR's page-aligned span.
        span: u64,
    },
    /// A copy request (`PeerMrWrite`/`Read`/`Atomic`) for an MR that is shared, not copied.
    #[error("MR {key:#x} is not a copied MR")]
    NotCopiedMr {
        /// The peer MR key named.
        key: u32,
    },
    /// A request that is not one of the copy requests reached the copy handler.
    #[error("not a copy request")]
    NotCopyRequest,
    /// A request that is not CreateQp reached the queue-creation handler.
    #[error("not a CreateQp request")]
    NotCreateQp,

    // Verb failures.
    /// The session's vNIC left this host (deleted or moved) while the session was open.
    #[error("vNIC was deleted")]
    VnicDeleted,
    /// No vNIC of that name on this host.
    #[error("no vNIC named {name}")]
    NoSuchVnic {
        /// The vNIC name asked for.
        name: String,
    },
    /// A vNIC cannot be deleted or moved while clients have it open.
    #[error("vNIC {name} has {clients} live clients")]
    VnicInUse {
        /// The vNIC.
        name: String,
        /// Its open sessions.
        clients: u32,
    },
    /// A per-vNIC object count limit (`object`: PD, CQ, SRQ, QP, MR).
    #[error("{object} limit {limit} reached")]
    LimitReached {
        /// Kind of object ("PD", "CQ", …).
        object: &'static str,
        /// The vNIC's limit for it.
        limit: u32,
    },
    /// Registering the MR would exceed the vNIC's limit on registered bytes.
    #[error("MR byte limit {limit} reached")]
    MrBytesLimit {
        /// The vNIC's limit in bytes.
        limit: u64,
    },
    /// The vNIC's queue memory (`max_ring_bytes`) would be exceeded.
    #[error("queue memory limit {limit} bytes reached ({want} more asked)")]
    RingBytesLimit {
        /// The vNIC's limit in bytes.
        limit: u64,
        /// Bytes the new queue would add.
        want: u64,
    },
    /// The descriptors vrdmad holds for the vNIC's MRs (`max_fds`), or for all vNICs together
    /// (its own open-files limit less a reserve), would be exceeded.
    #[error("descriptor limit {limit} reached ({held} held, up to {want} more asked)")]
    DescriptorLimit {
        /// The limit that would be passed.
        limit: u64,
        /// Held now.
        held: u64,
        /// What the request could add.
        want: u64,
    },
    /// The vNIC has `max_sessions` client sessions open.
    #[error("session limit {limit} reached")]
    SessionLimit {
        /// The vNIC's session limit.
        limit: u32,
    },
    /// The vNIC's sessions have `max_pending` control requests in progress.
    #[error("{limit} control requests already in progress")]
    PendingLimit {
        /// The vNIC's limit of requests in progress.
        limit: u32,
    },
    /// A PD cannot be freed while objects still use it.
    #[error("PD {pd} still has QPs, MRs or SRQs")]
    PdInUse {
        /// The PD handle.
        pd: u32,
    },
    /// A CQ cannot be destroyed while QPs still complete into it.
    #[error("CQ {cq} still has QPs")]
    CqInUse {
        /// The CQ handle.
        cq: u32,
    },
    /// An SRQ cannot be destroyed while QPs still receive from it.
    #[error("SRQ {srq} still has QPs")]
    SrqInUse {
        /// The SRQ handle.
        srq: u32,
    },
    /// A CQ of zero entries, or more than the device allows.
    #[error("cqe {cqe} out of range")]
    CqeOutOfRange {
        /// The requested number of entries.
        cqe: u32,
    },
    /// An SRQ of zero or too many work requests or scatter/gather elements.
    #[error("SRQ max_wr {max_wr} / max_sge {max_sge} out of range")]
    SrqOutOfRange {
        /// Requested receive work requests.
        max_wr: u32,
        /// Requested scatter/gather elements per work request.
        max_sge: u32,
    },
    /// A QP type other than RC and UD.
    #[error("QP type {qp_type} is not supported (RC and UD only)")]
    QpTypeUnsupported {
        /// The raw `ibv_qp_type` requested.
        qp_type: u8,
    },
    /// QP capabilities beyond what the device advertises.
    #[error("QP capabilities {caps:?} exceed the device limits")]
    QpCapsTooLarge {
        /// The capabilities requested.
        caps: QpCaps,
    },
    /// Creating or mapping a queue's shared memory failed.
    #[error("{0}")]
    QueueMemory(#[source] ShmError),
    /// Creating a CQ's completion eventfd failed.
    #[error("eventfd failed")]
    Eventfd(#[source] std::io::Error),
    /// The CQ a QP completes into was destroyed under it.
    #[error("the QP's CQ is gone")]
    QpCqGone,
    /// The SRQ a QP receives from was destroyed under it.
    #[error("the QP's SRQ is gone")]
    QpSrqGone,
    /// The socket a UD QP sends remote datagrams on was closed.
    #[error("the QP's datagram socket is gone")]
    UdSocketGone,
    /// The destination GID is no vNIC's, here or in the cluster.
    #[error("no vNIC has GID {gid}")]
    UnknownGid {
        /// The destination GID.
        gid: Ipv6Addr,
    },
    /// The tenant rules do not let the caller's tenant reach the destination's.
    #[error("tenant {from} may not connect to tenant {to}")]
    TenantsNotAllowed {
        /// The caller's tenant.
        from: String,
        /// The destination's tenant.
        to: String,
    },
    /// A peer daemon's request names a source vNIC that daemon does not serve.
    #[error("the daemon at {from} may not speak for GID {gid}: {why}")]
    ForeignSource {
        /// The source GID the request named.
        gid: Ipv6Addr,
        /// The daemon that sent it.
        from: std::net::SocketAddr,
        /// Why that daemon may not speak for it.
        why: super::cluster::SourceRefusal,
    },
    /// The destination vNIC's host has stopped renewing its lease.
    #[error("vNIC {vnic} is on host {host}, which is down")]
    HostDown {
        /// The destination vNIC.
        vnic: String,
        /// The host that serves it.
        host: String,
    },
    /// The destination vNIC has no RC QP of that number (as a closed port: refused).
    #[error("vNIC {vnic} has no QP {qpn}")]
    NoRcQp {
        /// The destination vNIC.
        vnic: String,
        /// The QP number asked for.
        qpn: u32,
    },
    /// The destination vNIC has no UD QP of that number.
    #[error("vNIC {vnic} has no UD QP {qpn}")]
    NoUdQp {
        /// The destination vNIC.
        vnic: String,
        /// The QP number asked for.
        qpn: u32,
    },
    /// A resolved UD destination was destroyed since.
    #[error("UD QP {qpn} is gone")]
    UdDestGone {
        /// The destination UD QP.
        qpn: u32,
    },
    /// A request that needs a connected peer on a QP that has none.
    #[error("QP {qpn} is not connected")]
    NotConnected {
        /// The caller's QP.
        qpn: u32,
    },
    /// `MoveToEngine` for a QP of a vNIC that vrdmad did not demote.
    #[error("QP {qpn}: its vNIC was not moved off the direct path")]
    NotDemoted {
        /// The caller's QP.
        qpn: u32,
    },
    /// A peer is on another host (or policy mediates) and this registry has no engine.
    #[error("no mediated engine")]
    NoEngine,
    /// The destination is on another host, which only the mediated engine reaches.
    #[error("cross-host connection needs the mediated engine")]
    CrossHostNeedsEngine,
    /// A request reaching another daemon came to the registry alone: the daemon takes that
    /// step itself, without the registry lock (`Daemon::connect_qp`, `Daemon::resolve_ud`).
    #[error("reaching another host's daemon is the daemon's step, not the registry's")]
    RemoteNeedsDaemon,
    /// The engine failed to reach, or was refused by, the peer's daemon.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The key names no MR in the PD of the peer QP.
    #[error("key {key:#x} is not an MR of the peer's PD")]
    NotPeerMr {
        /// The MR key asked for.
        key: u32,
    },
    /// The peer MR does not cover the range or lacks the access the operation needs.
    #[error("MR {key:#x} does not grant {need:?} on {len} bytes at {addr:#x}")]
    MrDenies {
        /// The peer MR key.
        key: u32,
        /// The access the operation needs.
        need: Need,
        /// Bytes accessed.
        len: u64,
        /// Start address of the access.
        addr: u64,
    },
    /// The peer's MR grants nothing a peer may map (no remote access, no local write).
    #[error("MR {key:#x} grants a peer no access")]
    MrNotExposed {
        /// The MR key asked for.
        key: u32,
    },
    /// The vNIC asked for too many keys that were not its peers' MRs within one interval:
    /// its peer-MR requests are refused until the interval ends.
    #[error("too many bad remote keys from this vNIC: peer-MR requests refused for {retry_ms} ms")]
    BadKeysThrottled {
        /// How long until the interval ends.
        retry_ms: u64,
    },
    /// The MR's owner is moving it to new pages: ask again shortly.
    #[error("MR {key:#x} is moving to new pages")]
    MrMoving {
        /// The MR being moved.
        key: u32,
    },
    /// A memfd could not be reopened read-only for a peer.
    #[error("reopening an MR's memory read-only: {0}")]
    ReadOnlyReopen(#[source] std::io::Error),
    /// A copied MR over memory the session's process cannot share, and its memory could
    /// not be opened when it connected.
    #[error("memory that cannot be shared needs the client's memory: {why}")]
    NoProcessMemory {
        /// Why the process's memory could not be opened.
        why: String,
    },
    /// Memory that cannot be shared, registered on a session with no process memory to copy
    /// through.
    #[error("memory that cannot be shared cannot be registered on this session")]
    CopyUnsupported,
    /// A copied MR's bytes are not readable in its owner's memory.
    #[error("{0}")]
    MrUnreadable(#[source] ProcMemError),
    /// A copy through a copied MR's owner memory failed.
    #[error("{0}")]
    Copy(#[source] ProcMemError),
    /// A direct copy (`PeerMrCopy`) was refused on the requester's side, or failed.
    #[error("{0}")]
    DirectCopy(#[from] super::copy_into::CopyIntoError),
}

impl RequestError {
    /// The errno the client's verb returns.
    pub fn errno(&self) -> i32 {
        use RequestError::*;
        match self {
            NoSession | FdCount { .. } | NotYourPd { .. } | NotYourCq { .. } | NotYourSrq { .. } | NotYourQp { .. } => libc::EINVAL,
            NotYourMr { .. } | BadQpState { .. } | NotRcQp { .. } | NotUdQp { .. } | UdDestNotResolved { .. } => libc::EINVAL,
            EmptyMr | MrWraps | ChunkMisplaced { .. } | ChunkOverflows | ChunkUnsealed(_) | ChunksShort { .. } => libc::EINVAL,
            NotCopiedMr { .. } | NotCopyRequest | NotCreateQp => libc::EINVAL,
            Version { .. } => libc::EPROTO,
            VnicDeleted => libc::ENODEV,
            NoSuchVnic { .. } | NoUdQp { .. } | UdDestGone { .. } => libc::ENOENT,
            VnicInUse { .. } | PdInUse { .. } | CqInUse { .. } | SrqInUse { .. } => libc::EBUSY,
            LimitReached { .. } | QueueMemory(_) | Eventfd(_) => libc::ENOMEM,
            MrBytesLimit { .. } => libc::EDQUOT,
            RingBytesLimit { .. } => libc::ENOMEM,
            SessionLimit { .. } | DescriptorLimit { .. } => libc::EMFILE,
            PendingLimit { .. } => libc::EAGAIN,
            CqeOutOfRange { .. } | SrqOutOfRange { .. } | QpCapsTooLarge { .. } | QpCqGone | QpSrqGone => libc::EINVAL,
            QpTypeUnsupported { .. } | CopyUnsupported => libc::EOPNOTSUPP,
            UdSocketGone => libc::EIO,
            UnknownGid { .. } | HostDown { .. } | NoEngine | CrossHostNeedsEngine | RemoteNeedsDaemon => libc::EHOSTUNREACH,
            TenantsNotAllowed { .. } | NoRcQp { .. } | ForeignSource { .. } => libc::ECONNREFUSED,
            NotConnected { .. } => libc::ENOTCONN,
            NotDemoted { .. } => libc::EPERM,
            Engine(e) => e.errno(),
            NotPeerMr { .. } | MrDenies { .. } | MrNotExposed { .. } => libc::EACCES,
            BadKeysThrottled { .. } => libc::EAGAIN,
            MrMoving { .. } => libc::EBUSY,
            ReadOnlyReopen(_) => libc::ENOMEM,
            ChunkLeased => libc::EBUSY,
            NoProcessMemory { .. } => libc::EPERM,
            MrUnreadable(_) => libc::EFAULT,
            Copy(ProcMemError::Misaligned { .. }) => libc::EINVAL,
            Copy(ProcMemError::Moving { .. }) => libc::EBUSY,
            Copy(_) => libc::EFAULT,
            DirectCopy(e) => e.errno(),
        }
    }

    /// Whether a per-vNIC limit refused the request (counted in the vNIC's
    /// `refused_by_limits`).
    pub fn is_limit(&self) -> bool {
        use RequestError::*;
        matches!(
            self,
            LimitReached { .. }
                | MrBytesLimit { .. }
                | RingBytesLimit { .. }
                | DescriptorLimit { .. }
                | SessionLimit { .. }
                | PendingLimit { .. }
        )
    }

    /// Whether this is a protocol violation (a malformed request, or one naming objects the
    /// caller does not own), counted as bad input, rather than a normal verb failure.
    pub fn is_bad_input(&self) -> bool {
        use RequestError::*;
        if let DirectCopy(e) = self {
            return e.is_bad_input();
        }
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
                | ChunkLeased
                | ChunksShort { .. }
                | NotCopiedMr { .. }
                | NotCopyRequest
                | NotCreateQp
        )
    }
}

/// Why a datagram another daemon forwarded may not reach one of our UD QPs (it is dropped,
/// as a network would drop it; the reason is only logged).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UdRefusal {
    /// No UD QP of the datagram's destination number on this host.
    #[error("no UD QP {qpn}")]
    NoUdQp {
        /// The destination QP number.
        qpn: u32,
    },
    /// The destination QP's session has closed.
    #[error("the QP has no session")]
    NoSession,
    /// The destination QP's vNIC was deleted.
    #[error("its vNIC was deleted")]
    VnicDeleted,
    /// The destination QP exists, but its vNIC does not have the datagram's destination GID.
    #[error("QP {qpn} is not at GID {gid}")]
    WrongGid {
        /// The destination QP number.
        qpn: u32,
        /// The destination GID in the datagram.
        gid: Ipv6Addr,
    },
    /// The datagram's source GID is no vNIC the cluster knows.
    #[error("unknown source GID")]
    UnknownSource,
    /// The source vNIC is served by another daemon than the one that forwarded it (spoofing).
    #[error("source vNIC {vnic} is not served by {from}")]
    WrongDaemon {
        /// The vNIC the source GID belongs to.
        vnic: String,
        /// The daemon the datagram came from.
        from: SocketAddr,
    },
    /// The tenant rules do not let the source's tenant reach the destination's.
    #[error("tenant {from} may not reach tenant {to}")]
    TenantsNotAllowed {
        /// The source's tenant.
        from: String,
        /// The destination's tenant.
        to: String,
    },
}
