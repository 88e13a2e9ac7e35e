//! Queue pairs (RC, and UD): the state machine (via `vrdma-core`), posting, and the direct
//! data path.
//!
//! The requester executes each send WR itself, inside `post_send` (or later, from a poll,
//! when the responder was not ready): it checks its local keys, maps the responder's MR on
//! first use of a key, copies the bytes once, and for receive-consuming opcodes takes the
//! responder's receive WR from the shared ring and writes the responder's completion.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use vrdma_abi::control::{QpCaps, Reply, Request};
use vrdma_abi::ring::{self, CompEntry, CompRing, QpRegionLayout, RecvRing, RecvRingLayout, Sge, Take};
use vrdma_abi::shm::{MemRegion, SharedMapping};
use vrdma_abi::verbs::{qp_attr, send_flags, wc_flags, QpState, WcOpcode, WcStatus, WrOpcode};
use vrdma_core::access::{check, Need};
use vrdma_core::qp_state::{check_modify, QpType};
use vrdma_core::sg::{self, Atomic, Span};
use vrdma_core::timers;

use crate::cq::{comp_to_wc, Cq, CqInner, Wc};
use crate::device::{Context, Pd, PdInner};
use crate::error::{invalid, Error};
use crate::mediated::MedChannel;
use crate::mr::LocalMr;
use crate::peer::{Connection, Peer, UdRoute};
use crate::spin::SpinLock;
use crate::srq::{Srq, SrqInner};

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

/// Bytes of the Global Routing Header at the start of every UD receive (IB semantics: the
/// receive buffer must have room for it; the payload follows).
pub const GRH_LEN: usize = vrdma_abi::ud::GRH_LEN;
/// Largest UD message (the path MTU, 4096).
pub const UD_MTU: u64 = vrdma_abi::ud::UD_MTU as u64;

/// Hands a UD datagram for another host to vrdmad on the QP's datagram socket. A full socket
/// or a failure drops the datagram, as UD may.
/// `msg` is a buffer kept from one datagram to the next.
fn send_remote_ud(socket: &OwnedFd, msg: &mut Vec<u8>, wr: &SendWr<'_>, dest: &UdDest, qkey: u32, spans: &[Span], total: u64) {
    use vrdma_abi::ud::{UdDatagram, UD_DATAGRAM_HEADER, UD_F_IMM, UD_F_SOLICITED};
    let mut flags = 0;
    if wr.opcode == WrOpcode::SendWithImm {
        flags |= UD_F_IMM;
    }
    if wr.send_flags & send_flags::SOLICITED != 0 {
        flags |= UD_F_SOLICITED;
    }
    let d = UdDatagram { dest_qpn: dest.qpn, qkey, imm: if flags & UD_F_IMM != 0 { wr.imm_data } else { 0 }, flags, dgid: dest.dgid };
    msg.resize(UD_DATAGRAM_HEADER + total as usize, 0);
    msg[..UD_DATAGRAM_HEADER].copy_from_slice(&d.encode_header());
    let mut at = UD_DATAGRAM_HEADER;
    for sp in spans {
        if sp.mem.read_into(sp.offset, &mut msg[at..at + sp.len]).is_err() {
            return;
        }
        at += sp.len;
    }
    // A full socket is a send queue the "NIC" (vrdmad's engine) has not drained yet: wait for
    // room, as a post waits for a hardware queue, but never for long (a stuck daemon must not
    // hang the application: after that the datagram is dropped).
    let deadline = Instant::now() + UD_SEND_WAIT;
    loop {
        // SAFETY: sends `msg`, a live buffer of `msg.len()` bytes, on a socket we hold.
        let n = unsafe { libc::send(socket.as_raw_fd(), msg.as_ptr().cast(), msg.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        let mut pfd = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
        // SAFETY: polls one live pollfd.
        unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
    }
}

/// How long a UD send to another host waits for room on its datagram socket.
const UD_SEND_WAIT: Duration = Duration::from_secs(1);

/// Destination of a UD send (what an address handle and the WR's `ud` fields name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDest {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Destination QP number.
    pub qpn: u32,
    /// Q_Key (if its high bit is set, the sending QP's own Q_Key is used).
    pub qkey: u32,
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

/// A send WR kept for later (responder not ready): owns its lists and inline bytes.
struct PendingWr {
    wr_id: u64,
    opcode: WrOpcode,
    send_flags: u32,
    sges: Vec<Sge>,
    inline: Vec<u8>,
    imm_data: u32,
    remote_addr: u64,
    rkey: u32,
    compare_add: u64,
    swap: u64,
    first_try: Instant,
    next_try: Instant,
    rnr_tries: u32,
}

enum Outcome {
    /// Executed (successfully or with an error completion already generated).
    Done,
    /// The responder had no receive posted.
    Rnr,
    /// The responder is not in RTR/RTS yet.
    NotReady,
}

struct QpMut {
    state: QpState,
    attr: QpAttr,
    peer: Option<Peer>,
    /// Set instead of `peer` when vrdmad's engine executes this QP's sends.
    med: Option<MedChannel>,
    pending: VecDeque<PendingWr>,
    spans: Vec<Span>,
    rspans: Vec<Span>,
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
    rq: Option<RecvRing>,
    comp: CompRing,
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
        let region = SharedMapping::map_sealed(fd.as_fd(), layout.size(), true).map_err(shm_err)?;
        let rq = match rq_layout {
            Some(l) => Some(RecvRing::new(region.region().subregion(layout.rq_offset(), l.size()).map_err(shm_err)?, l).map_err(shm_err)?),
            None => None,
        };
        let comp = CompRing::new(region.region().subregion(layout.comp_offset(), layout.comp.size()).map_err(shm_err)?, layout.comp)
            .map_err(shm_err)?;
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
            rq,
            comp,
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
                rspans: Vec::with_capacity(32),
                rsges: Vec::with_capacity(32),
                waiting_registered: false,
                rq_posted: 0,
                ud_peers: HashMap::new(),
                ud_msg: Vec::new(),
                peer_gone: false,
                last_mr: None,
            }),
            state_hint: AtomicU8::new(QpState::Reset as u8),
            rq_polled: AtomicU64::new(0),
            flush_recv: AtomicU8::new(0),
        });
        inner.publish_state(QpState::Reset, 12, None);
        {
            let mut qps = init.recv_cq.inner.recv_qps.lock();
            qps.push(inner.clone());
            init.recv_cq.inner.recv_count.store(qps.len(), Ordering::Release);
        }
        Ok(Qp { inner })
    }
}

impl QpInner {
    fn publish_state(&self, s: QpState, min_rnr_timer: u8, med: Option<&MedChannel>) {
        let r = self.region.region();
        if let Ok(w) = r.atomic_u64(ring::QP_RESERVED) {
            w.store(u64::from(min_rnr_timer), Ordering::Release);
        }
        if let Ok(w) = r.atomic_u64(ring::QP_OWNER_STATE) {
            w.store(s as u64, Ordering::Release);
        }
        if let Some(c) = med {
            // The engine acts on state changes (ERR: flush what it holds).
            c.shared.ring();
        }
        self.state_hint.store(s as u8, Ordering::Release);
    }

    /// Applies an error request from the peer or vrdmad (peer gone, remote fatal error);
    /// whether the QP entered ERR.
    fn check_error_request(&self, m: &mut QpMut) -> bool {
        let Ok(w) = self.region.region().atomic_u64(ring::QP_ERROR_REQUEST) else {
            return false;
        };
        let v = w.load(Ordering::Acquire);
        if v != 0 {
            w.store(0, Ordering::Release);
            if !matches!(m.state, QpState::Err | QpState::Reset) {
                if v == ring::QP_ERR_PEER_GONE && self.ctx.inner.hw_peer_loss.load(Ordering::Relaxed) {
                    m.peer_gone = true;
                } else {
                    self.enter_error(m);
                    return true;
                }
            }
        }
        false
    }

    /// Moves to ERR unless already there (or in RESET): a fatal completion was just polled.
    pub(crate) fn enter_error_if_live(&self) {
        let mut m = self.m.lock();
        if !matches!(m.state, QpState::Err | QpState::Reset) {
            self.enter_error(&mut m);
        }
    }

    /// vrdmad is gone (its control socket hung up): a mediated QP's engine went with it.
    /// The engine's unpolled completions are kept, every WR it had not retired completes
    /// with WR_FLUSH_ERR, and the QP moves to ERR (receives flush), so nothing waits for an
    /// engine that will never answer. Direct QPs keep working (shared memory).
    pub(crate) fn daemon_gone(&self) {
        let mut m = self.m.lock();
        let Some(ch) = m.med.take() else { return };
        self.send_cq.remove_mediated(&ch.shared);
        while let Some(e) = ch.shared.pop() {
            self.send_cq.push_local(crate::cq::comp_to_wc(&e, self.qpn));
        }
        for (wr_id, opcode) in ch.unretired() {
            let op = WrOpcode::from_u32(opcode).map(|o| o.wc_opcode()).unwrap_or(WcOpcode::Send);
            self.send_cq.push_local_for(wr_id, WcStatus::WrFlushErr, op, self.qpn, 0);
        }
        if !matches!(m.state, QpState::Err | QpState::Reset) {
            self.enter_error(&mut m);
            if let Some(ev) = &self.events {
                ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::QpFatal, qpn: self.qpn });
            }
        }
    }

    /// Moves to ERR: every outstanding send WR completes with WR_FLUSH_ERR, and receives
    /// are flushed by the next poll of the receive CQ (after completions already delivered).
    fn enter_error(&self, m: &mut QpMut) {
        m.state = QpState::Err;
        self.publish_state(QpState::Err, m.attr.min_rnr_timer, m.med.as_ref());
        while let Some(p) = m.pending.pop_front() {
            self.send_cq.push_local_for(p.wr_id, WcStatus::WrFlushErr, p.opcode.wc_opcode(), self.qpn, 0);
        }
        if self.srq.is_none() {
            self.flush_recv.store(1, Ordering::Release);
        } else if let Some(ev) = &self.events {
            // Its receives come from the SRQ, and it takes no more of them.
            ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::QpLastWqeReached, qpn: self.qpn });
        }
        // Wake a sleeper on the receive CQ so it polls the flushes.
        crate::cq::maybe_notify(self.recv_cq.region(), self.recv_cq.eventfd(), true);
    }

    fn local_spans(&self, sges: &[Sge], need: Need, out: &mut Vec<Span>) -> Result<u64, WcStatus> {
        out.clear();
        let mrs = self.ctx.inner.mrs.read();
        let mut total = 0u64;
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let mr = mrs.get(&s.lkey).ok_or(need.failure())?;
            let off = check(&mr.bounds, s.addr, u64::from(s.length), need)?;
            out.push(Span { mem: mr.mem, offset: off as usize, len: s.length as usize });
            total += u64::from(s.length);
        }
        Ok(total)
    }

    /// Executes one send WR against the connected peer.
    #[allow(clippy::too_many_arguments)]
    fn execute(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) -> Outcome {
        let opcode = wr.opcode;
        if m.peer_gone {
            // Like a NIC's retries to a QP that no longer exists: RETRY_EXC_ERR once the
            // QP's retries are spent (timeout × (retry_cnt + 1); never with timeout 0), not at
            // once. A ping-pong peer that sent one message too many and finishes within that
            // time exits cleanly, as it does on hardware.
            return Outcome::NotReady;
        }
        let Some(peer) = m.peer.as_ref() else {
            self.fail(m, wr.wr_id, opcode, WcStatus::RetryExcErr);
            return Outcome::Done;
        };
        if !matches!(peer.state(), Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) {
            return Outcome::NotReady;
        }
        if inline.is_none() && wr.sg_list.len() == 1 {
            match opcode {
                WrOpcode::RdmaWrite => return self.write_one(m, wr),
                WrOpcode::Send | WrOpcode::SendWithImm => return self.send_one(m, wr),
                _ => {}
            }
        }
        // Gather list: registered memory, or inline bytes (copied at post time if kept).
        let mut spans = std::mem::take(&mut m.spans);
        let total = if let Some(bytes) = inline {
            spans.clear();
            if !bytes.is_empty() {
                // SAFETY: `bytes` lives for this call; the region is only read.
                let mem = unsafe { MemRegion::from_raw(bytes.as_ptr() as *mut u8, bytes.len()) };
                spans.push(Span { mem, offset: 0, len: bytes.len() });
            }
            Ok(bytes.len() as u64)
        } else if wr.send_flags & send_flags::INLINE != 0 {
            spans.clear();
            let mut t = 0u64;
            for s in wr.sg_list.iter().filter(|s| s.length > 0) {
                // SAFETY: inline data pointers must be valid during post_send (verbs
                // contract), and inline WRs execute within post_send or are copied.
                let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
                spans.push(Span { mem, offset: 0, len: s.length as usize });
                t += u64::from(s.length);
            }
            Ok(t)
        } else {
            let need = if matches!(opcode, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) {
                Need::LocalWrite
            } else {
                Need::LocalRead
            };
            self.local_spans(wr.sg_list, need, &mut spans)
        };
        let outcome = match total {
            Err(st) => {
                self.fail(m, wr.wr_id, opcode, st);
                Outcome::Done
            }
            Ok(total) => self.execute_remote(m, wr, &spans, total),
        };
        m.spans = spans;
        outcome
    }

    /// The most common work request, an RDMA WRITE of one element, without the general
    /// scatter/gather machinery (same checks, same statuses).
    #[inline(always)]
    fn write_one(&self, m: &mut QpMut, wr: &SendWr<'_>) -> Outcome {
        let len = wr.sg_list[0].length as usize;
        let src = self.source_one(&mut m.last_mr, wr);
        let peer = m.peer.as_mut().expect("checked by execute");
        let result = src.and_then(|src| match peer.span_cached(wr.rkey, wr.remote_addr, len as u64, Need::RemoteWrite) {
            // A mapped MR: nothing is staged, nothing to flush.
            Some(dst) => {
                dst.and_then(|dst| dst.mem.copy_from_region(dst.offset, &src.mem, src.offset, len).map_err(|_| WcStatus::RemAccessErr))
            }
            None => self.write_one_uncached(peer, wr, &src),
        });
        match result {
            Ok(()) => {
                if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
                    self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, WcOpcode::RdmaWrite, self.qpn, len as u32);
                }
            }
            Err(st) => self.fail(m, wr.wr_id, WrOpcode::RdmaWrite, st),
        }
        Outcome::Done
    }

    /// `write_one` to an MR not in the peer's one-entry cache (first use, copied MR,
    /// zero length): apart, so that the usual case's span never goes through memory.
    #[inline(never)]
    fn write_one_uncached(&self, peer: &mut Peer, wr: &SendWr<'_>, src: &Span) -> Result<(), WcStatus> {
        let len = src.len;
        let dst = peer.span(&self.ctx, self.qpn, wr.rkey, wr.remote_addr, len as u64, Need::RemoteWrite)?;
        dst.mem.copy_from_region(dst.offset, &src.mem, src.offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        peer.flush(&self.ctx, self.qpn, &[dst], len as u64)
    }

    /// The local source of a one-element WR: inline bytes or registered memory.
    #[inline(always)]
    fn source_one(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, wr: &SendWr<'_>) -> Result<Span, WcStatus> {
        let s = wr.sg_list[0];
        let len = s.length as usize;
        if wr.send_flags & send_flags::INLINE != 0 {
            // SAFETY: inline data pointers must be valid during post_send (verbs contract);
            // this runs within post_send (kept WRs take the general path with a copy).
            return Ok(Span { mem: unsafe { MemRegion::from_raw(s.addr as *mut u8, len) }, offset: 0, len });
        }
        if len == 0 {
            return Ok(Span { mem: MemRegion::empty(), offset: 0, len: 0 });
        }
        if let Some((k, mr)) = last_mr.as_ref() {
            if *k == s.lkey && mr.valid.load(Ordering::Acquire) {
                return check(&mr.bounds, s.addr, u64::from(s.length), Need::LocalRead).map(|off| Span {
                    mem: mr.mem,
                    offset: off as usize,
                    len,
                });
            }
        }
        let mrs = self.ctx.inner.mrs.read();
        match mrs.get(&s.lkey) {
            Some(mr) => {
                *last_mr = Some((s.lkey, mr.clone()));
                check(&mr.bounds, s.addr, u64::from(s.length), Need::LocalRead).map(|off| Span { mem: mr.mem, offset: off as usize, len })
            }
            None => Err(WcStatus::LocProtErr),
        }
    }

    /// Whether a mediated QP's client may send `wr` on its lane itself, and the length its
    /// frame names: the checks the engine makes when it takes a WR (local keys, bounds and
    /// access, lengths), so that a WR the engine would fail is left to the engine.
    fn lane_len(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, wr: &SendWr<'_>) -> Option<u32> {
        let fetches = matches!(wr.opcode, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
        let need = if fetches { Need::LocalWrite } else { Need::LocalRead };
        let inline = wr.send_flags & send_flags::INLINE != 0;
        if inline && fetches {
            // (Its gather list went into the inline copy: the engine makes of it what it does.)
            return None;
        }
        let mut total = 0u64;
        for s in wr.sg_list.iter().filter(|s| s.length > 0) {
            total += u64::from(s.length);
            if !inline && !self.local_access_ok(last_mr, s, need) {
                return None;
            }
        }
        match wr.opcode {
            WrOpcode::RdmaRead => u32::try_from(total).ok().filter(|&t| t <= vrdma_abi::wire::MAX_MESSAGE),
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => (total == 8 && wr.sg_list.len() == 1).then_some(8),
            _ => (total <= crate::mediated::LANE_DATA_MAX).then_some(total as u32),
        }
    }

    /// `s` lies in one of the QP's PD's MRs with `need`'s access (as the engine checks it).
    fn local_access_ok(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, s: &Sge, need: Need) -> bool {
        let pd = self.pd.handle;
        if let Some((k, mr)) = last_mr.as_ref() {
            if *k == s.lkey && mr.valid.load(Ordering::Acquire) {
                return mr.pd == pd && check(&mr.bounds, s.addr, u64::from(s.length), need).is_ok();
            }
        }
        let mrs = self.ctx.inner.mrs.read();
        match mrs.get(&s.lkey) {
            Some(mr) => {
                *last_mr = Some((s.lkey, mr.clone()));
                mr.pd == pd && check(&mr.bounds, s.addr, u64::from(s.length), need).is_ok()
            }
            None => false,
        }
    }

    /// A SEND (or SEND_WITH_IMM) of one element, without the general gather walk: takes the
    /// responder's receive, scatters into it and completes it (same checks and statuses as
    /// the general path).
    fn send_one(&self, m: &mut QpMut, wr: &SendWr<'_>) -> Outcome {
        let src = match self.source_one(&mut m.last_mr, wr) {
            Ok(s) => s,
            Err(st) => {
                self.fail(m, wr.wr_id, wr.opcode, st);
                return Outcome::Done;
            }
        };
        let QpMut { peer, rspans, rsges, .. } = &mut *m;
        let peer = peer.as_mut().expect("checked by execute");
        let Some((recv_wr_id, srq)) = peer.take_recv(rsges) else { return Outcome::Rnr };
        let with_imm = wr.opcode == WrOpcode::SendWithImm;
        let mut flags = if wr.send_flags & send_flags::SOLICITED != 0 { ring::COMP_SOLICITED } else { 0 };
        if srq {
            flags |= ring::COMP_FROM_SRQ;
        }
        let mut ce = CompEntry {
            wr_id: recv_wr_id,
            byte_len: src.len as u32,
            imm: if with_imm { wr.imm_data } else { 0 },
            opcode: WcOpcode::Recv as u8,
            status: 0,
            wc_flags: if with_imm { wc_flags::WITH_IMM as u8 } else { 0 },
            flags,
            src_qp: self.qpn,
        };
        rspans.clear();
        let mut room = 0u64;
        let mut bad = None;
        for s in rsges.iter().filter(|s| s.length > 0) {
            match peer.span(&self.ctx, self.qpn, s.lkey, s.addr, u64::from(s.length), Need::LocalWrite) {
                Ok(sp) => {
                    rspans.push(sp);
                    room += u64::from(s.length);
                }
                Err(_) => {
                    // The responder's receive buffer is bad: its error, our REM_OP_ERR.
                    bad = Some((WcStatus::LocProtErr, WcStatus::RemOpErr));
                    break;
                }
            }
        }
        if bad.is_none() && room < src.len as u64 {
            bad = Some((WcStatus::LocLenErr, WcStatus::RemInvReqErr));
        }
        if bad.is_none() && (sg::copy(rspans, &[src]).is_err() || peer.flush(&self.ctx, self.qpn, rspans, src.len as u64).is_err()) {
            bad = Some((WcStatus::LocProtErr, WcStatus::RemOpErr));
        }
        if let Some((theirs, ours)) = bad {
            ce.status = theirs as u8;
            ce.byte_len = 0;
            peer.complete(&ce);
            peer.request_error();
            self.fail(m, wr.wr_id, wr.opcode, ours);
            return Outcome::Done;
        }
        peer.complete(&ce);
        if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
            self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, WcOpcode::Send, self.qpn, src.len as u32);
        }
        Outcome::Done
    }

    fn execute_remote(&self, m: &mut QpMut, wr: &SendWr<'_>, spans: &[Span], total: u64) -> Outcome {
        let opcode = wr.opcode;
        let qpn = self.qpn;
        let ctx = &self.ctx;
        let mut rspans = std::mem::take(&mut m.rspans);
        let mut rsges = std::mem::take(&mut m.rsges);
        let result: Result<u32, (WcStatus, bool)> = (|| {
            let peer = m.peer.as_mut().expect("checked by execute");
            match opcode {
                WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => {
                    let target = peer.span(ctx, qpn, wr.rkey, wr.remote_addr, total, Need::RemoteWrite).map_err(|s| (s, false))?;
                    let recv = if opcode == WrOpcode::RdmaWriteWithImm {
                        match peer.take_recv(&mut rsges) {
                            Some(r) => Some(r),
                            None => return Err((WcStatus::RnrRetryExcErr, true)),
                        }
                    } else {
                        None
                    };
                    sg::copy(&[target], spans).map_err(|_| (WcStatus::RemAccessErr, false))?;
                    peer.flush(ctx, qpn, &[target], total).map_err(|s| (s, false))?;
                    if let Some((recv_wr_id, srq)) = recv {
                        let flags = (if wr.send_flags & send_flags::SOLICITED != 0 { ring::COMP_SOLICITED } else { 0 })
                            | if srq { ring::COMP_FROM_SRQ } else { 0 };
                        let ce = CompEntry {
                            wr_id: recv_wr_id,
                            byte_len: total as u32,
                            imm: wr.imm_data,
                            opcode: WcOpcode::RecvRdmaWithImm as u8,
                            status: 0,
                            wc_flags: wc_flags::WITH_IMM as u8,
                            flags,
                            src_qp: qpn,
                        };
                        peer.complete(&ce);
                    }
                    Ok(total as u32)
                }
                WrOpcode::Send | WrOpcode::SendWithImm => {
                    let Some((recv_wr_id, srq)) = peer.take_recv(&mut rsges) else {
                        return Err((WcStatus::RnrRetryExcErr, true));
                    };
                    let with_imm = opcode == WrOpcode::SendWithImm;
                    let mut flags = if wr.send_flags & send_flags::SOLICITED != 0 { ring::COMP_SOLICITED } else { 0 };
                    if srq {
                        flags |= ring::COMP_FROM_SRQ;
                    }
                    let mut ce = CompEntry {
                        wr_id: recv_wr_id,
                        byte_len: total as u32,
                        imm: if with_imm { wr.imm_data } else { 0 },
                        opcode: WcOpcode::Recv as u8,
                        status: 0,
                        wc_flags: if with_imm { wc_flags::WITH_IMM as u8 } else { 0 },
                        flags,
                        src_qp: qpn,
                    };
                    rspans.clear();
                    let mut room = 0u64;
                    for s in rsges.iter().filter(|s| s.length > 0) {
                        match peer.span(ctx, qpn, s.lkey, s.addr, u64::from(s.length), Need::LocalWrite) {
                            Ok(sp) => {
                                rspans.push(sp);
                                room += u64::from(s.length);
                            }
                            Err(_) => {
                                // The responder's receive buffer is bad: its error, our REM_OP_ERR.
                                ce.status = WcStatus::LocProtErr as u8;
                                ce.byte_len = 0;
                                peer.complete(&ce);
                                peer.request_error();
                                return Err((WcStatus::RemOpErr, false));
                            }
                        }
                    }
                    if room < total {
                        ce.status = WcStatus::LocLenErr as u8;
                        ce.byte_len = 0;
                        peer.complete(&ce);
                        peer.request_error();
                        return Err((WcStatus::RemInvReqErr, false));
                    }
                    if sg::copy(&rspans, spans).is_err() || peer.flush(ctx, qpn, &rspans, total).is_err() {
                        // The responder's (copied) receive buffer could not be written.
                        ce.status = WcStatus::LocProtErr as u8;
                        ce.byte_len = 0;
                        peer.complete(&ce);
                        peer.request_error();
                        return Err((WcStatus::RemOpErr, false));
                    }
                    peer.complete(&ce);
                    Ok(total as u32)
                }
                WrOpcode::RdmaRead => {
                    let src = peer.span(ctx, qpn, wr.rkey, wr.remote_addr, total, Need::RemoteRead).map_err(|s| (s, false))?;
                    let copied = sg::copy(spans, &[src]);
                    let _ = peer.flush(ctx, qpn, &[], 0); // releases a copied MR's staged bytes
                    copied.map_err(|_| (WcStatus::LocProtErr, false))?;
                    Ok(total as u32)
                }
                WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                    if total != 8 || spans.len() != 1 {
                        return Err((WcStatus::LocLenErr, false));
                    }
                    let op = if opcode == WrOpcode::AtomicCmpAndSwp {
                        Atomic::CmpSwap { compare: wr.compare_add, swap: wr.swap }
                    } else {
                        Atomic::FetchAdd { add: wr.compare_add }
                    };
                    let old = peer.atomic(ctx, qpn, wr.rkey, wr.remote_addr, op).map_err(|s| (s, false))?;
                    let l = spans[0];
                    l.mem.write_from(l.offset, &old.to_ne_bytes()).map_err(|_| (WcStatus::LocProtErr, false))?;
                    Ok(8)
                }
            }
        })();
        m.rspans = rspans;
        m.rsges = rsges;
        match result {
            Ok(len) => {
                if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
                    self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, opcode.wc_opcode(), qpn, len);
                }
                Outcome::Done
            }
            Err((_, true)) => Outcome::Rnr,
            Err((st, false)) => {
                self.fail(m, wr.wr_id, opcode, st);
                Outcome::Done
            }
        }
    }

    /// Delivers a UD datagram of `total` bytes (`spans`) to `dest`, or drops it.
    fn deliver_ud(&self, m: &mut QpMut, wr: &SendWr<'_>, dest: &UdDest, spans: &[Span], total: u64) {
        let key = (dest.dgid, dest.qpn);
        if let std::collections::hash_map::Entry::Vacant(slot) = m.ud_peers.entry(key) {
            match Peer::resolve_ud(&self.ctx, self.qpn, dest.dgid, dest.qpn) {
                Ok(p) => {
                    slot.insert(p);
                }
                Err(_) => return, // no such destination: the datagram is lost
            }
        }
        let qkey = if dest.qkey & 0x8000_0000 != 0 { m.attr.qkey } else { dest.qkey };
        if let Some(UdRoute::Remote(socket)) = m.ud_peers.get(&key) {
            return send_remote_ud(socket, &mut m.ud_msg, wr, dest, qkey, spans, total);
        }
        let my_gid = self.ctx.gids().first().copied().unwrap_or_default();
        let mut rsges = std::mem::take(&mut m.rsges);
        let mut rspans = std::mem::take(&mut m.rspans);
        let Some(UdRoute::Direct(peer)) = m.ud_peers.get_mut(&key) else { unreachable!("resolved above, not remote") };
        'deliver: {
            if !matches!(peer.state(), Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) || peer.qkey() != qkey {
                break 'deliver;
            }
            let Some(_lock) = peer.ud_lock() else { break 'deliver };
            let Some((recv_wr_id, srq)) = peer.take_recv(&mut rsges) else { break 'deliver };
            let imm = (wr.opcode == WrOpcode::SendWithImm).then_some(wr.imm_data);
            let solicited = wr.send_flags & send_flags::SOLICITED != 0;
            let mut ce = vrdma_abi::ud::recv_completion(recv_wr_id, total as usize, imm, solicited, srq, self.qpn);
            rspans.clear();
            let mut room = 0u64;
            for s in rsges.iter().filter(|s| s.length > 0) {
                match peer.span(&self.ctx, self.qpn, s.lkey, s.addr, u64::from(s.length), Need::LocalWrite) {
                    Ok(sp) => {
                        rspans.push(sp);
                        room += u64::from(s.length);
                    }
                    Err(_) => {
                        ce.status = WcStatus::LocProtErr as u8;
                        break;
                    }
                }
            }
            if ce.status == 0 && room < GRH_LEN as u64 + total {
                ce.status = WcStatus::LocLenErr as u8;
            }
            if ce.status == 0 {
                let mut grh = vrdma_abi::ud::grh(&my_gid, &dest.dgid, total as usize);
                // SAFETY: `grh` lives for this block and is only read.
                let gmem = unsafe { MemRegion::from_raw(grh.as_mut_ptr(), GRH_LEN) };
                let mut src = Vec::with_capacity(spans.len() + 1);
                src.push(Span { mem: gmem, offset: 0, len: GRH_LEN });
                src.extend_from_slice(spans);
                if sg::copy(&rspans, &src).is_err() || peer.flush(&self.ctx, self.qpn, &rspans, GRH_LEN as u64 + total).is_err() {
                    ce.status = WcStatus::LocProtErr as u8;
                }
            }
            if ce.status != 0 {
                ce.byte_len = 0;
            }
            peer.complete(&ce);
        }
        m.rsges = rsges;
        m.rspans = rspans;
    }

    /// Completes `wr_id` with an error and moves the QP to ERR.
    fn fail(&self, m: &mut QpMut, wr_id: u64, opcode: WrOpcode, st: WcStatus) {
        self.send_cq.push_local_for(wr_id, st, opcode.wc_opcode(), self.qpn, 0);
        self.enter_error(m);
    }

    fn keep(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<Vec<u8>>) {
        let now = Instant::now();
        let inline = inline.unwrap_or_else(|| {
            if wr.send_flags & send_flags::INLINE == 0 {
                return Vec::new();
            }
            let mut v = Vec::new();
            for s in wr.sg_list {
                // SAFETY: inline pointers are valid during post_send; copied now so the WR
                // can run later.
                let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
                let mut b = vec![0u8; s.length as usize];
                let _ = mem.read_into(0, &mut b);
                v.extend_from_slice(&b);
            }
            v
        });
        m.pending.push_back(PendingWr {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            send_flags: wr.send_flags,
            sges: if wr.send_flags & send_flags::INLINE != 0 { Vec::new() } else { wr.sg_list.to_vec() },
            inline,
            imm_data: wr.imm_data,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            compare_add: wr.compare_add,
            swap: wr.swap,
            first_try: now,
            next_try: now,
            rnr_tries: 0,
        });
        if !m.waiting_registered {
            m.waiting_registered = true;
            self.send_cq.waiting_qps.lock().push(self.me.clone());
            self.send_cq.waiting.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// What every `post_send` checks first (RC and UD alike): an error request is applied, a
    /// QP before RTS refuses the WR (EINVAL), a QP in ERR flushes it (`Ok(false)`), and the
    /// list and inline sizes must fit the QP's capabilities.
    #[inline(always)]
    fn admit_send(&self, m: &mut QpMut, wr: &SendWr<'_>, op: &'static str) -> Result<bool, Error> {
        self.check_error_request(m);
        self.state_admits_send(m, op)?;
        // A mediated QP's older WRs are flushed by the engine: this one follows them.
        if m.state == QpState::Err && m.med.is_none() {
            self.send_cq.push_local_for(wr.wr_id, WcStatus::WrFlushErr, wr.opcode.wc_opcode(), self.qpn, 0);
            return Ok(false);
        }
        self.wr_fits(wr, op)?;
        Ok(true)
    }

    /// A send may be posted in any state from RTS on (in ERR it is flushed).
    #[inline(always)]
    fn state_admits_send(&self, m: &QpMut, op: &'static str) -> Result<(), Error> {
        match m.state {
            QpState::Reset | QpState::Init | QpState::Rtr => Err(invalid(op, format!("QP is in {:?}", m.state))),
            _ => Ok(()),
        }
    }

    /// The WR's gather list and inline data fit the QP's capabilities.
    #[inline(always)]
    fn wr_fits(&self, wr: &SendWr<'_>, op: &'static str) -> Result<(), Error> {
        if wr.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(invalid(op, format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.cap.max_send_sge)));
        }
        if wr.send_flags & send_flags::INLINE != 0 {
            let len: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if len > u64::from(self.cap.max_inline_data) {
                return Err(invalid(op, format!("{len} inline bytes exceed max_inline_data {}", self.cap.max_inline_data)));
            }
        }
        Ok(())
    }

    /// Retries waiting WRs whose time has come.
    pub(crate) fn progress(&self) {
        let mut m = self.m.lock();
        self.check_error_request(&mut m);
        let now = Instant::now();
        while let Some(p) = m.pending.pop_front() {
            let responder_ready_again = p.rnr_tries > 0 && m.peer.as_ref().is_some_and(|peer| peer.has_recv());
            if p.next_try > now && !responder_ready_again {
                m.pending.push_front(p);
                break;
            }
            let wr = SendWr {
                wr_id: p.wr_id,
                opcode: p.opcode,
                send_flags: p.send_flags & !send_flags::INLINE,
                sg_list: &p.sges,
                imm_data: p.imm_data,
                remote_addr: p.remote_addr,
                rkey: p.rkey,
                compare_add: p.compare_add,
                swap: p.swap,
            };
            let inline = (p.send_flags & send_flags::INLINE != 0).then_some(&p.inline[..]);
            match self.execute(&mut m, &wr, inline) {
                Outcome::Done => {}
                Outcome::Rnr => {
                    let rnr_retry = m.attr.rnr_retry;
                    let mut p = p;
                    p.rnr_tries += 1;
                    if rnr_retry != timers::RNR_RETRY_INFINITE && p.rnr_tries > u32::from(rnr_retry) {
                        self.fail(&mut m, p.wr_id, p.opcode, WcStatus::RnrRetryExcErr);
                        break;
                    }
                    let wait = m.peer.as_ref().map_or(Duration::from_micros(640), |peer| timers::rnr_timer(peer.min_rnr_timer()));
                    p.next_try = now + wait;
                    m.pending.push_front(p);
                    break;
                }
                Outcome::NotReady => {
                    let limit = timers::retry_limit(m.attr.timeout, m.attr.retry_cnt);
                    if limit.is_some_and(|l| now.duration_since(p.first_try) > l) {
                        self.fail(&mut m, p.wr_id, p.opcode, WcStatus::RetryExcErr);
                        break;
                    }
                    let mut p = p;
                    p.next_try = now + Duration::from_micros(100);
                    m.pending.push_front(p);
                    break;
                }
            }
        }
        if m.pending.is_empty() && m.waiting_registered {
            m.waiting_registered = false;
            let me = self.me.clone();
            self.send_cq.waiting_qps.lock().retain(|w| !w.ptr_eq(&me));
            self.send_cq.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Hands inbound completions of this QP to `put` as completions `n..max` (called by the
    /// receive CQ's poll); the new count.
    pub(crate) fn poll_inbound<P: FnMut(usize, Wc)>(&self, mut n: usize, max: usize, put: &mut P) -> usize {
        let hint = self.state_hint.load(Ordering::Acquire);
        if hint != QpState::Err as u8 {
            if let Ok(w) = self.region.region().atomic_u64(ring::QP_ERROR_REQUEST) {
                if w.load(Ordering::Relaxed) != 0 {
                    let mut m = self.m.lock();
                    if self.check_error_request(&mut m) && m.med.is_some() && Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                        // The engine wrote the fatal completion before asking for ERR, but
                        // this poll may have passed the engine's ring before it did: the
                        // receives flush on the next poll, after that completion (as a NIC
                        // reports the error before the flushes it causes). enter_error woke
                        // a sleeper on this CQ, so that poll comes.
                        return n;
                    }
                }
            }
        }
        while n < max {
            let Ok(Some(e)) = self.comp.pop() else { break };
            if e.flags & ring::COMP_FROM_SRQ != 0 {
                if let Some(s) = &self.srq {
                    s.consumed();
                }
            } else {
                self.rq_polled.fetch_add(1, Ordering::AcqRel);
            }
            put(n, comp_to_wc(&e, self.qpn));
            n += 1;
            if e.status != WcStatus::Success as u8 && e.status != WcStatus::WrFlushErr as u8 {
                // A responder-side error: the QP is in ERR by the time the owner sees it.
                self.enter_error_if_live();
            }
        }
        if self.flush_recv.load(Ordering::Acquire) != 0 && self.comp.is_empty() {
            self.flush_recv.store(0, Ordering::Release);
            if let Some(rq) = &self.rq {
                while let Ok(Take::Entry(e)) = rq.take() {
                    self.rq_polled.fetch_add(1, Ordering::AcqRel);
                    let wc = Wc::new(e.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
                    if n < max {
                        put(n, wc);
                        n += 1;
                    } else {
                        self.recv_cq.push_local(wc);
                    }
                }
            }
        }
        n
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

    /// Takes an RC QP from RESET through INIT and RTR to RTS, connected to `dest_qp_num` at
    /// `dgid` (GID index 0 of port 1), with the attributes RDMA applications usually choose:
    /// the boilerplate of every RC program, in one call. Each step is an ordinary `modify`.
    pub fn connect_rc(&self, dgid: [u8; 16], dest_qp_num: u32, remote_access: u32) -> Result<(), Error> {
        let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qp_access_flags: remote_access, ..Default::default() };
        self.modify(&init, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS)?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr as u32,
            path_mtu: 5,
            dest_qp_num,
            is_global: true,
            dgid,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            ..Default::default()
        };
        self.modify(
            &rtr,
            qp_attr::STATE
                | qp_attr::AV
                | qp_attr::PATH_MTU
                | qp_attr::DEST_QPN
                | qp_attr::RQ_PSN
                | qp_attr::MAX_DEST_RD_ATOMIC
                | qp_attr::MIN_RNR_TIMER,
        )?;
        let rts =
            QpAttr { qp_state: QpState::Rts as u32, timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 16, ..Default::default() };
        self.modify(
            &rts,
            qp_attr::STATE | qp_attr::SQ_PSN | qp_attr::TIMEOUT | qp_attr::RETRY_CNT | qp_attr::RNR_RETRY | qp_attr::MAX_QP_RD_ATOMIC,
        )
    }

    /// `ibv_modify_qp`: validates the transition and its attribute mask like hardware
    /// (EINVAL otherwise); RESET→…→RTR connects through vrdmad, which may refuse (tenant
    /// rules: ECONNREFUSED; unknown GID: EHOSTUNREACH).
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> Result<(), Error> {
        let q = &self.inner;
        let mut m = q.m.lock();
        q.check_error_request(&mut m);
        let to_state = QpState::from_u32(attr.qp_state).ok_or_else(|| invalid("modify_qp", "bad qp_state"))?;
        let cur_given = QpState::from_u32(attr.cur_qp_state).unwrap_or(m.state);
        let from = m.state;
        let to = check_modify(q.qp_type, from, mask, to_state, cur_given)?;
        let op = "modify_qp";
        if mask & qp_attr::PORT != 0 && attr.port_num != 1 {
            return Err(invalid(op, format!("port {} does not exist", attr.port_num)));
        }
        if mask & qp_attr::PATH_MTU != 0 && !(1..=5).contains(&attr.path_mtu) {
            return Err(invalid(op, format!("path_mtu {} invalid", attr.path_mtu)));
        }
        if mask & qp_attr::MIN_RNR_TIMER != 0 && attr.min_rnr_timer > 31 {
            return Err(invalid(op, "min_rnr_timer > 31"));
        }
        if mask & qp_attr::TIMEOUT != 0 && attr.timeout > 31 {
            return Err(invalid(op, "timeout > 31"));
        }
        if mask & qp_attr::RETRY_CNT != 0 && attr.retry_cnt > 7 {
            return Err(invalid(op, "retry_cnt > 7"));
        }
        if mask & qp_attr::RNR_RETRY != 0 && attr.rnr_retry > 7 {
            return Err(invalid(op, "rnr_retry > 7"));
        }
        if mask & (qp_attr::MAX_QP_RD_ATOMIC) != 0 && attr.max_rd_atomic > 16 {
            return Err(invalid(op, "max_rd_atomic > 16"));
        }
        if mask & (qp_attr::MAX_DEST_RD_ATOMIC) != 0 && attr.max_dest_rd_atomic > 16 {
            return Err(invalid(op, "max_dest_rd_atomic > 16"));
        }
        if mask & qp_attr::AV != 0 {
            if !attr.is_global {
                return Err(invalid(op, "RoCE address vectors need a GRH (is_global) with the destination GID"));
            }
            if usize::from(attr.sgid_index) >= q.ctx.gids().len() {
                return Err(invalid(op, format!("sgid_index {} out of range", attr.sgid_index)));
            }
        }
        if from == QpState::Init && to == QpState::Rtr && q.qp_type == QpType::Rc {
            match Peer::connect(&q.ctx, q.qpn, q.me.clone(), attr.dgid, attr.dest_qp_num)? {
                Connection::Direct(peer) => m.peer = Some(peer),
                Connection::Mediated(c) => {
                    q.send_cq.add_mediated(c.shared.clone());
                    m.med = Some(c);
                    q.ctx.watch_daemon(q.me.clone());
                }
            }
            m.peer_gone = false;
        }
        let a = &mut m.attr;
        macro_rules! set {
            ($bit:expr, $($f:ident),+) => { if mask & $bit != 0 { $(a.$f = attr.$f;)+ } };
        }
        set!(qp_attr::ACCESS_FLAGS, qp_access_flags);
        set!(qp_attr::PKEY_INDEX, pkey_index);
        set!(qp_attr::PORT, port_num);
        set!(qp_attr::QKEY, qkey);
        set!(qp_attr::AV, is_global, dgid, sgid_index, hop_limit);
        set!(qp_attr::PATH_MTU, path_mtu);
        set!(qp_attr::TIMEOUT, timeout);
        set!(qp_attr::RETRY_CNT, retry_cnt);
        set!(qp_attr::RNR_RETRY, rnr_retry);
        set!(qp_attr::RQ_PSN, rq_psn);
        set!(qp_attr::SQ_PSN, sq_psn);
        set!(qp_attr::MAX_QP_RD_ATOMIC, max_rd_atomic);
        set!(qp_attr::MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
        set!(qp_attr::MIN_RNR_TIMER, min_rnr_timer);
        set!(qp_attr::DEST_QPN, dest_qp_num);
        if mask & qp_attr::QKEY != 0 {
            if let Ok(w) = q.region.region().atomic_u64(ring::QP_QKEY) {
                w.store(u64::from(attr.qkey), Ordering::Release);
            }
        }
        match to {
            QpState::Err if from != QpState::Err => q.enter_error(&mut m),
            QpState::Reset => {
                // Back to a clean QP: nothing outstanding, no peer, no completions.
                m.pending.clear();
                m.peer = None;
                if let Some(c) = m.med.take() {
                    q.send_cq.remove_mediated(&c.shared);
                }
                m.peer_gone = false;
                while let Ok(Some(_)) = q.comp.pop() {}
                if let Some(rq) = &q.rq {
                    while let Ok(Take::Entry(_)) = rq.take() {}
                }
                q.rq_polled.store(m.rq_posted, Ordering::Release);
                q.flush_recv.store(0, Ordering::Release);
                let _ = q.ctx.inner.ctl.call(op, &Request::SetQpState { qpn: q.qpn, state: QpState::Reset as u8 }, &[]);
            }
            _ => {}
        }
        m.state = to;
        if let Ok(w) = q.region.region().atomic_u64(ring::QP_RETRY) {
            let a = &m.attr;
            w.store(u64::from(a.rnr_retry) | u64::from(a.retry_cnt) << 8 | u64::from(a.timeout) << 16, Ordering::Release);
        }
        q.publish_state(to, m.attr.min_rnr_timer, m.med.as_ref());
        Ok(())
    }

    /// `ibv_post_send` of one WR. Errors are immediate (EINVAL, ENOMEM) only for WRs that
    /// could not be posted; everything else completes with a status.
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        if q.qp_type != QpType::Rc {
            return Err(invalid(op, "a UD QP needs a destination (post_send_ud)"));
        }
        let mut m = q.m.lock();
        if !q.admit_send(&mut m, wr, op)? {
            return Ok(());
        }
        if m.med.is_some() {
            let on_lane = if m.state == QpState::Rts && m.med.as_ref().is_some_and(MedChannel::has_lane) {
                q.lane_len(&mut m.last_mr, wr)
            } else {
                None
            };
            let c = m.med.as_mut().expect("checked");
            return if c.post(wr, q.sq_sig_all, on_lane)? { Ok(()) } else { Err(Error::QueueFull { op }) };
        }
        if !m.pending.is_empty() {
            if m.pending.len() >= q.cap.max_send_wr as usize {
                return Err(Error::QueueFull { op });
            }
            q.keep(&mut m, wr, None);
            return Ok(());
        }
        match q.execute(&mut m, wr, None) {
            Outcome::Done => {}
            Outcome::Rnr | Outcome::NotReady => q.keep(&mut m, wr, None),
        }
        Ok(())
    }

    /// Whether [`Qp::post_send`] (or, on a UD QP, [`Qp::post_send_ud`]) would refuse `wr`
    /// now, without posting it: the checks that make a post fail (the QP's type and state,
    /// the gather list and inline data against its capabilities, a UD QP's opcodes), none
    /// of a post's effects. A batch that must be posted entirely or not at all (the drop-in's
    /// `ibv_wr_complete`) checks every WR with it first. A full send queue is not foreseen.
    pub fn check_send(&self, wr: &SendWr<'_>) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        let mut m = q.m.lock();
        q.check_error_request(&mut m);
        q.state_admits_send(&m, op)?;
        if m.state == QpState::Err && m.med.is_none() {
            return Ok(());
        }
        q.wr_fits(wr, op)?;
        if q.qp_type == QpType::Ud && !matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) {
            return Err(invalid(op, format!("{:?} on a UD QP (UD only sends)", wr.opcode)));
        }
        Ok(())
    }

    /// `ibv_post_send` of one WR on a UD QP, to `dest`. Datagram semantics: the send completes
    /// successfully once executed, whether or not the destination took it (no receive posted,
    /// wrong Q_Key, destination gone: dropped). The receiver gets a [`GRH_LEN`]-byte GRH
    /// (sender's GID at byte 8, its own at byte 24) before the payload, and a completion
    /// with `wc_flags::GRH` and the sender's QPN.
    pub fn post_send_ud(&self, wr: &SendWr<'_>, dest: &UdDest) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        if q.qp_type != QpType::Ud {
            return Err(invalid(op, "not a UD QP"));
        }
        let mut m = q.m.lock();
        if !q.admit_send(&mut m, wr, op)? {
            return Ok(());
        }
        if !matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) {
            return Err(invalid(op, format!("{:?} on a UD QP (UD only sends)", wr.opcode)));
        }
        let inline = wr.send_flags & send_flags::INLINE != 0;
        let mut spans = std::mem::take(&mut m.spans);
        let total = if inline {
            spans.clear();
            let mut t = 0u64;
            for s in wr.sg_list.iter().filter(|s| s.length > 0) {
                // SAFETY: inline data pointers are valid during post_send (verbs contract), and
                // UD sends execute within it.
                let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
                spans.push(Span { mem, offset: 0, len: s.length as usize });
                t += u64::from(s.length);
            }
            Ok(t)
        } else {
            q.local_spans(wr.sg_list, Need::LocalRead, &mut spans)
        };
        let status = match total {
            Err(st) => st,
            Ok(t) if t > UD_MTU => WcStatus::LocLenErr,
            Ok(t) => {
                q.deliver_ud(&mut m, wr, dest, &spans, t);
                WcStatus::Success
            }
        };
        m.spans = spans;
        if status != WcStatus::Success {
            q.fail(&mut m, wr.wr_id, wr.opcode, status);
        } else if q.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
            let len = total.unwrap_or(0) as u32;
            q.send_cq.push_local_for(wr.wr_id, WcStatus::Success, wr.opcode.wc_opcode(), q.qpn, len);
        }
        Ok(())
    }

    /// `ibv_post_recv` of one WR.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), Error> {
        self.post_recv_list(std::slice::from_ref(wr)).map_err(|(_, e)| e)
    }

    /// `ibv_post_recv` of a list: posts in order under one lock; on failure returns the index
    /// of the first WR not posted (`bad_wr`) with the error.
    pub fn post_recv_list(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, Error)> {
        let q = &self.inner;
        let op = "post_recv";
        let Some(rq) = &q.rq else {
            return Err((0, invalid(op, "QP uses an SRQ")));
        };
        let mut m = q.m.lock();
        for (i, wr) in wrs.iter().enumerate() {
            if m.state == QpState::Reset {
                return Err((i, invalid(op, "QP is in RESET")));
            }
            if wr.sg_list.len() > q.cap.max_recv_sge as usize {
                return Err((i, invalid(op, format!("{} SGEs exceed max_recv_sge {}", wr.sg_list.len(), q.cap.max_recv_sge))));
            }
            if m.state == QpState::Err {
                q.recv_cq.push_local_for(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, q.qpn, 0);
                continue;
            }
            if m.rq_posted - q.rq_polled.load(Ordering::Acquire) >= q.rq_capacity {
                return Err((i, Error::QueueFull { op }));
            }
            match rq.push(wr.wr_id, wr.sg_list) {
                Ok(true) => m.rq_posted += 1,
                Ok(false) => return Err((i, Error::QueueFull { op })),
                Err(source) => return Err((i, Error::Shm { op, source })),
            }
        }
        Ok(())
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        let _ = self.ctx.inner.ctl.call("destroy_qp", &Request::DestroyQp { qpn: self.qpn }, &[]);
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let me = Arc::downgrade(&self.inner);
        {
            let mut qps = self.inner.recv_cq.recv_qps.lock();
            qps.retain(|q| !Arc::ptr_eq(q, &self.inner));
            self.inner.recv_cq.recv_count.store(qps.len(), Ordering::Release);
        }
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
