//! Queue pairs (RC, and UD): the objects, their creation and the verbs' entry points.
//!
//! The requester executes each send WR itself, inside `post_send` (or later, from a poll,
//! when the responder was not ready): it checks its local keys, maps the responder's MR on
//! first use of a key, copies the bytes once, and for receive-consuming opcodes takes the
//! responder's receive WR from the shared ring and writes the responder's completion.
//!
//! - `state`: `ibv_modify_qp` (the state machine, via `vrdma-core`) and entering ERR;
//!   `connect`: the usual RC connect sequence in one call;
//! - `post`: what every `post_send` checks, and the RC post itself;
//! - `direct`: executing a send WR against a peer on this host (shared memory);
//! - `lane`: whether a mediated QP's client may send a WR on its lane itself;
//! - `qos`: the vNIC's caps on the direct path (a token bucket; the move onto vrdmad's
//!   engine when vrdmad orders it);
//! - `staged`: SENDs through the responder's staging ring (a peer never writes a receive
//!   buffer), and the responder scattering them into its receive buffers when it polls;
//! - `backstop`: a thread retrying SENDs that wait for staging room while nobody polls;
//! - `retry`: WRs kept while the responder is not ready or has no receive posted;
//! - `ud`: datagrams (to this host's QPs directly, to other hosts through vrdmad);
//! - `recv`: posting receives, and polling the completions peers write for this QP.

mod backstop;
mod connect;
mod direct;
mod lane;
mod post;
pub(crate) mod posted;
mod qos;
mod recv;
mod retry;
mod staged;
mod state;
#[cfg(test)]
mod tests;
mod ud;

pub(crate) use staged::receive_flags;
pub use ud::{UdDest, GRH_LEN};

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use vrdma_abi::control::{QpCaps, Reply, Request};
use vrdma_abi::ring::{CompRing, QpMeter, QpQos, QpRegionLayout, RecvRing, RecvRingLayout, Sge, StagingRing};
use vrdma_abi::shm::{SharedMapping, ShmError};
use vrdma_abi::verbs::{QpState, WrOpcode};
use vrdma_core::qp_state::QpType;
use vrdma_core::sg::Span;

use crate::cq::{Cq, CqInner};
use crate::device::{Context, Pd, PdInner};
use crate::error::{invalid, Error};
use crate::mediated::MedChannel;
use crate::mr::LocalMr;
use crate::peer::{Peer, UdRoute};
use crate::spin::SpinLock;
use crate::srq::{Srq, SrqInner};
use retry::PendingWr;

/// QP creation attributes.
pub struct QpInitAttr<'a> {
    /// CQ of send completions.
    pub send_cq: &'a Cq,
    /// CQ of receive completions.
    pub recv_cq: &'a Cq,
    /// Shared receive queue, if any.
    pub srq: Option<&'a Srq>,
    /// Capabilities.
    pub cap: QpCaps,
    /// Every send WR generates a completion.
    pub sq_sig_all: bool,
    /// Transport: RC (connected) or UD (datagrams, see [`Qp::post_send_ud`]).
    pub qp_type: QpType,
    /// Where the QP raises asynchronous events (none: not raised).
    pub events: Option<&'a crate::AsyncEvents>,
}

impl<'a> QpInitAttr<'a> {
    /// RC QP attributes.
    pub fn rc(send_cq: &'a Cq, recv_cq: &'a Cq, cap: QpCaps) -> Self {
        QpInitAttr { send_cq, recv_cq, srq: None, cap, sq_sig_all: false, qp_type: QpType::Rc, events: None }
    }

    /// UD QP attributes.
    pub fn ud(send_cq: &'a Cq, recv_cq: &'a Cq, cap: QpCaps) -> Self {
        QpInitAttr { send_cq, recv_cq, srq: None, cap, sq_sig_all: false, qp_type: QpType::Ud, events: None }
    }
}

/// `ibv_qp_attr` (the fields RC uses).
#[derive(Clone, Copy, Debug, Default)]
#[allow(missing_docs)]
pub struct QpAttr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub qp_access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// Address vector: whether a GRH (and so `dgid`) is given; RoCE needs it.
    pub is_global: bool,
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub cap: QpCaps,
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub opcode: WrOpcode,
    /// `send_flags::*`.
    pub send_flags: u32,
    /// Gather list (local keys), or inline data pointers with `send_flags::INLINE`.
    pub sg_list: &'a [Sge],
    /// Immediate data for *_WITH_IMM.
    pub imm_data: u32,
    /// RDMA and atomic target address.
    pub remote_addr: u64,
    /// RDMA and atomic target key.
    pub rkey: u32,
    /// Atomic compare (CMP_AND_SWP) or add (FETCH_AND_ADD) operand.
    pub compare_add: u64,
    /// Atomic swap operand.
    pub swap: u64,
}

impl<'a> SendWr<'a> {
    /// A WR with no remote or atomic fields.
    pub fn new(wr_id: u64, opcode: WrOpcode, sg_list: &'a [Sge], send_flags: u32) -> Self {
        SendWr { wr_id, opcode, send_flags, sg_list, imm_data: 0, remote_addr: 0, rkey: 0, compare_add: 0, swap: 0 }
    }
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Scatter list.
    pub sg_list: &'a [Sge],
}

struct QpMut {
    state: QpState,
    attr: QpAttr,
    peer: Option<Peer>,
    /// Set instead of `peer` when vrdmad's engine executes this QP's sends.
    med: Option<MedChannel>,
    pending: VecDeque<PendingWr>,
    spans: Vec<Span>,
    rsges: Vec<Sge>,
    waiting_registered: bool,
    rq_posted: u64,
    /// UD destinations resolved so far.
    ud_peers: HashMap<([u8; 16], u32), UdRoute>,
    /// Buffer of datagrams to other hosts (see `send_remote_ud`).
    ud_msg: Vec<u8>,
    /// The connected peer's process went away (noticed lazily, see
    /// `Context::set_peer_loss_like_hardware`): the next send fails with RETRY_EXC_ERR.
    peer_gone: bool,
    /// The local MR of the last one-element send (its lkey): spares the context's MR table
    /// (a read lock and a hash) on every post. Used only while the MR is still registered.
    last_mr: Option<(u32, Arc<LocalMr>)>,
    /// The MR of the last one-element receive (its lkey), as `last_mr` for sends (`staged`).
    last_recv_mr: Option<(u32, Arc<LocalMr>)>,
    /// The caps vrdmad published, as last applied (see `qos`).
    qos: qos::QosState,
    /// The SEND under way through the responder's staging ring, if one is cut in parts.
    staged_tx: staged::StagedTx,
}

pub(crate) struct QpInner {
    me: Weak<QpInner>,
    ctx: Context,
    /// The PD (kept alive while the QP lives; its handle checks local keys).
    pd: Arc<PdInner>,
    pub(crate) qpn: u32,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    srq: Option<Arc<SrqInner>>,
    events: Option<Arc<crate::events::EventsInner>>,
    region: SharedMapping,
    /// Counters of what this library executed (direct path), for vrdmad's reports.
    meter: QpMeter,
    /// The caps and orders vrdmad publishes for this QP (direct path).
    qos: QpQos,
    rq: Option<RecvRing>,
    comp: CompRing,
    /// Where peers stage the SENDs to this QP (see `staged`).
    staging: StagingRing,
    /// What this QP drained of its staging ring.
    staged_rx: SpinLock<staged::StagedRx>,
    /// The receives posted to `rq`, as posted (a leaf lock: taken under `m` or `staged_rx`).
    posted: SpinLock<posted::PostedRecvs>,
    cap: QpCaps,
    rq_capacity: u64,
    sq_sig_all: bool,
    qp_type: QpType,
    m: SpinLock<QpMut>,
    state_hint: AtomicU8,
    rq_polled: AtomicU64,
    flush_recv: AtomicU8,
}

/// A queue pair.
pub struct Qp {
    pub(crate) inner: Arc<QpInner>,
}

impl Pd {
    /// Creates a QP (RC or UD, per `init.qp_type`).
    pub fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Qp, Error> {
        let op = "create_qp";
        let ctx = &self.inner.ctx;
        if !Arc::ptr_eq(&init.send_cq.inner.ctx.inner, &ctx.inner) || !Arc::ptr_eq(&init.recv_cq.inner.ctx.inner, &ctx.inner) {
            return Err(invalid(op, "CQ of another context"));
        }
        let mut cap = init.cap;
        cap.max_send_sge = cap.max_send_sge.max(1);
        cap.max_recv_sge = cap.max_recv_sge.max(1);
        cap.max_send_wr = cap.max_send_wr.max(1);
        let req = Request::CreateQp {
            pd: self.inner.handle,
            send_cq: init.send_cq.inner.handle,
            recv_cq: init.recv_cq.inner.handle,
            srq: init.srq.map_or(0, |s| s.inner.handle),
            qp_type: if init.qp_type == QpType::Ud { 4 } else { 2 },
            caps: cap,
        };
        let (r, fds) = ctx.inner.ctl.call(op, &req, &[])?;
        let Reply::Qp { qpn, rq_entries, max_recv_sge, comp_entries } = r else {
            return Err(Error::UnexpectedReply { op });
        };
        let fd = fds.into_iter().next().ok_or(Error::UnexpectedReply { op })?;
        let rq_layout = (rq_entries > 0).then(|| RecvRingLayout::new(rq_entries as usize, max_recv_sge as usize));
        let layout = QpRegionLayout::new(rq_layout, comp_entries as usize);
        let shm_err = |source| Error::Shm { op, source };
        let (region, rq, comp, staging) = map_qp_region(fd.as_fd(), &layout).map_err(shm_err)?;
        let meter = QpMeter::new(region.region()).ok_or(Error::UnexpectedReply { op })?;
        let qos = QpQos::new(region.region()).ok_or(Error::UnexpectedReply { op })?;
        let inner = Arc::new_cyclic(|me| QpInner {
            me: me.clone(),
            ctx: ctx.clone(),
            pd: self.inner.clone(),
            qpn,
            send_cq: init.send_cq.inner.clone(),
            recv_cq: init.recv_cq.inner.clone(),
            srq: init.srq.map(|s| s.inner.clone()),
            events: init.events.map(|e| e.inner.clone()),
            region,
            meter,
            qos,
            rq,
            comp,
            staging,
            staged_rx: SpinLock::new(staged::StagedRx::default()),
            posted: SpinLock::new(posted::PostedRecvs::new(cap.max_recv_wr.max(rq_entries) as usize)),
            cap,
            rq_capacity: u64::from(cap.max_recv_wr.max(1)),
            sq_sig_all: init.sq_sig_all,
            qp_type: init.qp_type,
            m: SpinLock::new(QpMut {
                state: QpState::Reset,
                attr: QpAttr { min_rnr_timer: 12, timeout: 14, retry_cnt: 7, rnr_retry: 7, ..Default::default() },
                peer: None,
                med: None,
                pending: VecDeque::new(),
                spans: Vec::with_capacity(cap.max_send_sge as usize),
                rsges: Vec::with_capacity(32),
                waiting_registered: false,
                rq_posted: 0,
                ud_peers: HashMap::new(),
                ud_msg: Vec::new(),
                peer_gone: false,
                last_mr: None,
                last_recv_mr: None,
                qos: qos::QosState::default(),
                staged_tx: staged::StagedTx::default(),
            }),
            state_hint: AtomicU8::new(QpState::Reset as u8),
            rq_polled: AtomicU64::new(0),
            flush_recv: AtomicU8::new(0),
        });
        inner.publish_state(QpState::Reset, 12, None);
        init.recv_cq.inner.recv_qps.attach(inner.clone());
        Ok(Qp { inner })
    }
}

impl Qp {
    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        let mut m = self.inner.m.lock();
        self.inner.check_error_request(&mut m);
        m.state
    }

    /// How many WRs this QP's library sent on its lane itself (a mediated QP whose vrdmad
    /// gave it one: small WRs leave from `post_send` while the engine does not need the
    /// QP's send side), for diagnostics and tests; 0 for other QPs.
    pub fn lane_sends(&self) -> u64 {
        self.inner.m.lock().med.as_ref().map_or(0, |c| c.lane_sends)
    }

    /// Whether vrdmad's engine executes this QP's sends (peer on another host, or policy),
    /// rather than the library itself (direct, same host). False until connected.
    pub fn is_mediated(&self) -> bool {
        self.inner.m.lock().med.is_some()
    }

    /// Capabilities granted.
    pub fn cap(&self) -> QpCaps {
        self.inner.cap
    }

    /// Current attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        let mut m = self.inner.m.lock();
        self.inner.check_error_request(&mut m);
        let mut a = m.attr;
        a.qp_state = m.state as u32;
        a.cur_qp_state = m.state as u32;
        a.cap = self.inner.cap;
        a
    }
}

/// Maps a QP's shared region (sealed, from `fd`, laid out as `layout`): the mapping, its
/// receive ring (none with an SRQ), its inbound completion ring and its staging ring. The owner's library and
/// its connected peers map it alike.
pub(crate) fn map_qp_region(
    fd: BorrowedFd<'_>,
    layout: &QpRegionLayout,
) -> Result<(SharedMapping, Option<RecvRing>, CompRing, StagingRing), ShmError> {
    let region = SharedMapping::map_sealed(fd, layout.size(), true)?;
    let rq = match layout.rq {
        Some(l) => Some(RecvRing::new(region.region().subregion(layout.rq_offset(), l.size())?, l)?),
        None => None,
    };
    let comp = CompRing::new(region.region().subregion(layout.comp_offset(), layout.comp.size())?, layout.comp)?;
    let staging = StagingRing::new(region.region().subregion(layout.staging_offset(), vrdma_abi::ring::STAGING_REGION)?)?;
    Ok((region, rq, comp, staging))
}

impl Drop for QpInner {
    fn drop(&mut self) {
        let _ = self.ctx.inner.ctl.call("destroy_qp", &Request::DestroyQp { qpn: self.qpn }, &[]);
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let me = Arc::downgrade(&self.inner);
        self.inner.recv_cq.recv_qps.detach(&self.inner);
        let mut m = self.inner.m.lock();
        if let Some(c) = m.med.take() {
            self.inner.send_cq.remove_mediated(&c.shared);
        }
        if m.waiting_registered {
            m.waiting_registered = false;
            self.inner.send_cq.waiting_qps.lock().retain(|w| !w.ptr_eq(&me));
            self.inner.send_cq.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
