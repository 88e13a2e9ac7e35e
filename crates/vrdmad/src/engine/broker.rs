//! What the engine asks of the daemon's registry, and what the registry hands it.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use vrdma_abi::control::MrChunk;
use vrdma_abi::wire::ConnectReq;
use vrdma_core::access::MrBounds;

use super::UdReceiverSetup;
use crate::procmem::ProcMem;

/// An MR the engine may access, as the registry describes it.
#[derive(Clone)]
pub struct MrGrant {
    /// Session that registered it.
    pub session: u64,
    /// Its PD.
    pub pd: u32,
    /// Range and access.
    pub bounds: MrBounds,
    /// Its memfd chunks (none for a copied MR).
    pub chunks: Vec<(MrChunk, Arc<OwnedFd>)>,
    /// A copied MR's owner memory (the copying fallback, [`crate::procmem`]).
    pub proc_mem: Option<Arc<ProcMem>>,
}

/// Why a connection was refused (by the peer daemon's broker, or on the way there): the errno
/// the requester's `ibv_modify_qp` returns, and the reason, which crosses the wire in the
/// CONNECT_REP and goes into both daemons' logs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Refusal {
    /// The errno for the verb.
    pub errno: i32,
    /// Why, in one line.
    pub reason: String,
}

impl Refusal {
    /// A refusal with `errno` because of `reason`.
    pub fn new(errno: i32, reason: impl Into<String>) -> Refusal {
        Refusal { errno, reason: reason.into() }
    }
}

/// What the engine asks of the daemon's registry (implemented by the daemon; called with no
/// engine lock held).
pub trait Broker: Send + Sync {
    /// A peer daemon (listening at `from`) asks to connect its QP `src_qpn` to our
    /// `dst_qpn`: tenant rules, GID and QP checks.
    fn accept_remote(&self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), Refusal>;
    /// The peer daemon at `from` says its QP `remote_qpn`, connected to our `local_qpn`, is
    /// gone.
    fn peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32);
    /// May a datagram from the vNIC with `src_gid` (behind the daemon at `from`) reach our
    /// UD QP `dst_qpn` at `dgid`? Err: why not.
    fn accept_ud(&self, from: SocketAddr, src_gid: &[u8; 16], dst_qpn: u32, dgid: &[u8; 16]) -> Result<(), String>;
    /// Our UD QP `qpn`'s receiving side, if it is one.
    fn ud_receiver(&self, qpn: u32) -> Option<UdReceiverSetup>;
    /// Is the daemon whose transport listens at `addr` host `name` of the cluster? Err: why
    /// not. (Without a cluster view, as in the engine's own tests: yes.)
    fn check_peer_host(&self, name: &str, addr: SocketAddr) -> Result<(), String> {
        let _ = (name, addr);
        Ok(())
    }
    /// The name of the host whose daemon listens at `addr`, if the cluster has one (the name
    /// its certificate must carry).
    fn host_at(&self, addr: SocketAddr) -> Option<String> {
        let _ = addr;
        None
    }
}

/// Where the answer to a CONNECT_REQ goes.
pub(crate) type ConnectWaiter = std::sync::mpsc::SyncSender<Result<(), Refusal>>;
