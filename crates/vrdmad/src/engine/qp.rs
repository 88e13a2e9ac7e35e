//! A mediated QP in the engine: the client's rings mapped into the daemon, and the
//! requester's side (send ring → frames, responses → completions, RNR and timeouts, flush).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use vrdma_abi::control::QpCaps;
use vrdma_abi::ring::{self, CompEntry, CompRing, MediatedLayout, QpRegionLayout, RecvRing, RecvRingLayout, SqEntry, SqRing, SqRingLayout};
use vrdma_abi::shm::{self, MemRegion, SharedMapping};
use vrdma_abi::verbs::{send_flags, QpState, WcStatus, WrOpcode};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};
use vrdma_core::access::{check, Need};
use vrdma_core::timers;

use super::link::{Conn, Parked};
use super::{Engine, MappedMr};

/// What the registry hands the engine to mediate a QP.
pub struct MedQpSetup {
    /// The QP.
    pub qpn: u32,
    /// Its client session.
    pub session: u64,
    /// Its PD.
    pub pd: u32,
    /// The peer daemon's transport address.
    pub remote: SocketAddr,
    /// The peer QP there.
    pub remote_qpn: u32,
    /// The QP's capabilities (send ring size, SGEs, inline).
    pub caps: QpCaps,
    /// Its receiving side.
    pub recv: RecvSideSetup,
    /// Send CQ region and eventfd.
    pub send_cq: (Arc<OwnedFd>, Arc<OwnedFd>),
    /// Receive CQ region and eventfd.
    pub recv_cq: (Arc<OwnedFd>, Arc<OwnedFd>),
}

/// A QP's receiving side as the registry describes it (mediated RC and UD from other hosts).
pub struct RecvSideSetup {
    /// The QP's shared region (control page, receive ring, inbound completions).
    pub qp_region: Arc<OwnedFd>,
    /// Its receive ring layout (None with an SRQ).
    pub rq: Option<RecvRingLayout>,
    /// Its inbound completion ring entries.
    pub comp_entries: u32,
    /// Its SRQ region and layout.
    pub srq: Option<(Arc<OwnedFd>, RecvRingLayout)>,
}

/// A QP's receiving side mapped into the daemon: its shared region, receive ring (or SRQ)
/// and inbound completion ring.
pub(crate) struct RecvSide {
    pub(crate) qp_map: SharedMapping,
    rq: Option<RecvRing>,
    srq: Option<(SharedMapping, RecvRing)>,
    pub(crate) inbound: CompRing,
}

impl RecvSide {
    /// Maps `s`.
    pub(crate) fn map(s: RecvSideSetup) -> Result<RecvSide, String> {
        let e = |x: shm::ShmError| x.to_string();
        let layout = QpRegionLayout::new(s.rq, s.comp_entries as usize);
        let qp_map = SharedMapping::map_sealed(s.qp_region.as_fd(), layout.size(), true).map_err(e)?;
        let rq = match s.rq {
            Some(l) => Some(RecvRing::new(qp_map.region().subregion(layout.rq_offset(), l.size()).map_err(e)?, l).map_err(e)?),
            None => None,
        };
        let inbound =
            CompRing::new(qp_map.region().subregion(layout.comp_offset(), layout.comp.size()).map_err(e)?, layout.comp).map_err(e)?;
        let srq = match s.srq {
            Some((fd, l)) => {
                let m = SharedMapping::map_sealed(fd.as_fd(), ring::srq_region_size(l), true).map_err(e)?;
                let r = RecvRing::new(m.region().subregion(ring::PAGE, l.size()).map_err(e)?, l).map_err(e)?;
                Some((m, r))
            }
            None => None,
        };
        Ok(RecvSide { qp_map, rq, srq, inbound })
    }

    /// The owner's QP state.
    pub(crate) fn owner_state(&self) -> Option<QpState> {
        QpState::from_u32(self.qp_map.region().load_u64(ring::QP_OWNER_STATE).ok()? as u32)
    }

    /// Prefetches the receive ring's next slot (see [`MemRegion::prefetch`]).
    pub(crate) fn prefetch_recv(&self) {
        match (&self.srq, &self.rq) {
            (Some((_, r)), _) | (None, Some(r)) => r.prefetch_next(),
            (None, None) => {}
        }
    }

    /// Takes the next receive WR (SRQ, else RQ) into `sges`: its wr_id and whether it came
    /// from the SRQ, or `None` (none posted).
    pub(crate) fn take_recv(&self, sges: &mut Vec<ring::Sge>) -> Option<(u64, bool)> {
        let (ring, srq) = match (&self.srq, &self.rq) {
            (Some((_, r)), _) => (r, true),
            (None, Some(r)) => (r, false),
            (None, None) => return None,
        };
        ring.take_into(sges).ok().flatten().map(|id| (id, srq))
    }
}

/// A CQ's arm word and eventfd, as the engine sees them.
pub(crate) struct CqView {
    map: SharedMapping,
    eventfd: Arc<OwnedFd>,
}

impl CqView {
    pub(crate) fn new((region, eventfd): (Arc<OwnedFd>, Arc<OwnedFd>)) -> Result<CqView, String> {
        let map = SharedMapping::map_sealed(region.as_fd(), ring::CQ_REGION_SIZE, true).map_err(|e| e.to_string())?;
        Ok(CqView { map, eventfd })
    }

    /// Delivers an event if the CQ is armed for this completion (same rule as the library's).
    pub(crate) fn notify(&self, solicited_or_error: bool) {
        let Ok(arm) = self.map.region().atomic_u64(ring::CQ_ARM) else { return };
        std::sync::atomic::fence(Ordering::SeqCst);
        let a = arm.load(Ordering::SeqCst);
        let fire = a == ring::CQ_ARM_NEXT || (a == ring::CQ_ARM_SOLICITED && solicited_or_error);
        if fire && arm.compare_exchange(a, ring::CQ_ARM_NONE, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            super::write_eventfd(&self.eventfd);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fs {
    /// Sent, waiting for its response.
    Sent,
    /// Finished with this status (completes in order).
    Done(WcStatus),
}

struct InFlight {
    psn: u32,
    wr: SqEntry,
    opcode: WrOpcode,
    len: u32,
    state: Fs,
    first_sent: Instant,
    rnr_tries: u32,
}

struct ReqState {
    next_psn: u32,
    inflight: VecDeque<InFlight>,
    comp_head_cache: u64,
    /// A local error is queued: send nothing new.
    stop: bool,
    /// An error completed: everything after it flushes.
    errored: bool,
    /// RNR / not-ready wait: resend from `resend_from` at this time.
    wait_until: Option<Instant>,
    resend_from: Option<u32>,
    /// The time the engine's timer is set for to give up on a gone peer (one timer per
    /// deadline, however often the QP is pumped meanwhile).
    gone_timer: Option<Instant>,
    /// Send-ring WRs retired so far (published as `MED_RETIRED`).
    retired: u64,
    /// A frame the client began on the lane and left to the engine: (PSN, bytes written,
    /// the ACK token its header carries).
    unfinished: Option<(u32, u64, Option<ring::AckToken>)>,
}

impl ReqState {
    fn new(first_psn: u32) -> ReqState {
        ReqState {
            next_psn: first_psn,
            inflight: VecDeque::new(),
            comp_head_cache: 0,
            stop: false,
            errored: false,
            wait_until: None,
            resend_from: None,
            gone_timer: None,
            retired: 0,
            unfinished: None,
        }
    }
}

/// Frames built under the QP's lock and written after it is released (a reader waiting for
/// the lock must never wait for a full socket).
#[derive(Default)]
struct Outbox {
    items: Vec<Out>,
    cur: Vec<u8>,
}

enum Out {
    /// Small frames, batched.
    Bytes(Vec<u8>),
    /// A frame whose data is sent straight from registered memory.
    Region(FrameHeader, Arc<MappedMr>, usize, usize),
}

impl Outbox {
    fn push_big(&mut self, o: Out) {
        if !self.cur.is_empty() {
            self.items.push(Out::Bytes(std::mem::take(&mut self.cur)));
        }
        self.items.push(o);
    }
    fn finish(mut self) -> Vec<Out> {
        if !self.cur.is_empty() {
            self.items.push(Out::Bytes(std::mem::take(&mut self.cur)));
        }
        self.items
    }
}

pub(crate) struct RespState {
    pub(crate) expected_psn: u32,
    pub(crate) inbound_head_cache: u64,
    /// After an error NAK the requester's QP is in ERR: later requests are dropped.
    pub(crate) dead: bool,
    pub(crate) sges: Vec<ring::Sge>,
    /// Scatter spans of the SEND being received (kept to avoid an allocation per message).
    pub(crate) spans: Vec<((Arc<MappedMr>, usize), u64)>,
    /// SENDs and WRITEs executed since this side's last ACK went (sent, or carried by a
    /// request or a token), and their bytes (a deferred ACK is sent at once past
    /// [`ACK_EVERY`] or [`ACK_BYTES`]).
    pub(crate) unacked: u32,
    pub(crate) unacked_bytes: u64,
    /// ACK tokens (a QP with a lane: see [`MedQp::publish_ack_token`]).
    pub(crate) tokens: TokenState,
}

/// The responder's ACK tokens for the QP's owner to carry on its lane.
#[derive(Default)]
pub(crate) struct TokenState {
    /// Tokens published (the last one's counter).
    published: u64,
    /// The token published last and not yet settled (carried, or replaced by our own ACK),
    /// with when.
    pending: Option<(ring::AckToken, Instant)>,
    /// The last PSN a token acknowledged that no ACK of ours has covered since, and when we
    /// acknowledge it ourselves at the latest (an owner that withholds tokens delays its
    /// peer's completions by at most [`TOKEN_TRUST`]).
    unconfirmed: Option<(u32, Instant)>,
    /// Deferred ACKs to send without a token still (after tokens went uncarried), and how
    /// many the next uncarried one skips.
    skip: u32,
    backoff: u32,
}

/// How long a token waits for the owner's next request before the responder acknowledges by
/// itself (give or take a [`TOKEN_TICK`]): an owner that answers what it just received
/// does so long before; one that does not answer pays it once, and tokens then pause.
pub(crate) const TOKEN_WAIT: Duration = Duration::from_micros(500);
/// The period of a lane reader's token timer (see `token_timer`).
pub(crate) const TOKEN_TICK: Duration = Duration::from_micros(500);
/// Longest a token's PSN goes without an ACK of the responder's own.
pub(crate) const TOKEN_TRUST: Duration = Duration::from_millis(2);
/// Uncarried tokens turn them off for this many deferred ACKs, doubling up to
/// [`TOKEN_BACKOFF_MAX`] while they keep going uncarried (an owner that does not answer:
/// at most one wait in this many of its peer's messages).
const TOKEN_BACKOFF_MIN: u32 = 64;
const TOKEN_BACKOFF_MAX: u32 = 1 << 16;

/// What a lane's reader does about a QP's ACKs before it waits ([`MedQp::ack_duty`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AckDuty {
    /// Nothing until this instant (or the next request).
    Wait(Instant),
    /// Send the deferred ACK now ([`crate::engine::responder::send_owed_ack`]).
    SendOwed,
    /// Acknowledge this PSN ourselves (tokens did; the owner may have withheld them).
    Confirm(u32),
    /// Nothing left.
    Idle,
}

/// A responder ACKs at once after this many deferred SENDs and WRITEs...
pub(crate) const ACK_EVERY: u32 = 16;
/// ...or this many of their bytes, so a streaming requester's window keeps moving.
pub(crate) const ACK_BYTES: u64 = 64 * 1024;
/// Marks [`MedQp::ack_owed`] as holding a PSN.
const OWED: u64 = 1 << 32;

/// "Forever" for a WR to a gone peer with timeout 0 (an `Instant` this far ahead cannot
/// overflow).
const GONE_FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Most WRs one pump of a QP sends before the doorbell thread serves the others.
const PUMP_BUDGET_WRS: usize = 64;
/// Most payload bytes one pump of a QP sends (past it, the WR in progress still goes).
const PUMP_BUDGET_BYTES: usize = 256 << 10;

/// A mediated QP.
pub(crate) struct MedQp {
    pub(crate) qpn: u32,
    pub(crate) session: u64,
    pub(crate) pd: u32,
    pub(crate) remote: SocketAddr,
    pub(crate) remote_qpn: u32,
    /// Boot id of the peer daemon this QP talks to.
    pub(crate) peer_boot: u64,
    pub(crate) doorbell: Arc<OwnedFd>,
    conn: Arc<Conn>,
    /// `conn` is the QP's lane (its own connection, on which the client also writes requests
    /// while it holds the send side, `ring::MED_SEND_SIDE`), not a shared host connection.
    lane: bool,
    pub(crate) recv: RecvSide,
    send_cq: CqView,
    pub(crate) recv_cq: CqView,
    _chan: SharedMapping,
    chan_ctl: MemRegion,
    sq: SqRing,
    scomp: CompRing,
    scomp_cap: usize,
    req: Mutex<ReqState>,
    pub(crate) resp: Mutex<RespState>,
    pub(crate) peer_gone: AtomicBool,
    pub(crate) detached: AtomicBool,
    link_down: AtomicBool,
    pub(crate) wants_pump: AtomicBool,
    /// The reader is streaming a READ response into local memory under `req`: the doorbell
    /// thread, which serves every QP, must not wait for that lock (a large response on a
    /// slow link would stall every other QP's sends); it defers this QP's pump instead.
    receiving: AtomicBool,
    /// The doorbell thread skipped a pump while `receiving`: the reader kicks it when done.
    pump_deferred: AtomicBool,
    /// The responder's deferred ACK: `OWED | psn` of the last SEND/WRITE it executed and has
    /// not acknowledged, 0 if none. The next request of this QP carries it ([`wire::F_ACKS`]);
    /// if none goes out soon, the connection's reader sends it ([`MedQp::take_owed_ack`]).
    ack_owed: AtomicU64,
    /// The secret of this QP's lane (shared with the peer daemon only): the key of the ACK
    /// tokens that acknowledge its requests ([`MedQp::take_ack_token`]).
    lane_key: Option<[u64; 2]>,
    /// The counter of the last ACK token taken for this QP's requests (each counts once).
    tokens_taken: AtomicU64,
    /// How many ACK tokens acknowledged its requests (logged when it goes).
    pub(crate) tokens_applied: AtomicU64,
}

/// Data bytes up to which a frame is copied into the batch buffer rather than sent on its own.
const BATCH_DATA_MAX: usize = 4096;

impl MedQp {
    pub(crate) fn new(
        s: MedQpSetup,
        doorbell: Arc<OwnedFd>,
        conn: Arc<Conn>,
        lane_key: Option<[u64; 2]>,
        peer_boot: u64,
    ) -> Result<(Arc<MedQp>, Arc<OwnedFd>, MediatedLayout), String> {
        let lane = lane_key.is_some();
        let e = |x: shm::ShmError| x.to_string();
        let recv = RecvSide::map(s.recv)?;
        let sq_layout =
            SqRingLayout::new(s.caps.max_send_wr.max(1) as usize, s.caps.max_send_sge.max(1) as usize, s.caps.max_inline_data as usize);
        let ml = MediatedLayout::new(sq_layout);
        let fd = shm::create_memfd("vrdma-mediated", ml.size(), true).map_err(e)?;
        let chan = SharedMapping::map_sealed(fd.as_fd(), ml.size(), true).map_err(e)?;
        let r = *chan.region();
        let sq = SqRing::new(r.subregion(ml.sq_offset(), ml.sq.size()).map_err(e)?, ml.sq).map_err(e)?;
        let scomp = CompRing::new(r.subregion(ml.comp_offset(), ml.comp.size()).map_err(e)?, ml.comp).map_err(e)?;
        let chan_ctl = r.subregion(0, ring::PAGE).map_err(e)?;
        chan_ctl.store_u64(ring::MED_DOORBELL_WANTED, 1).map_err(e)?;
        let q = Arc::new(MedQp {
            qpn: s.qpn,
            session: s.session,
            pd: s.pd,
            remote: s.remote,
            remote_qpn: s.remote_qpn,
            peer_boot,
            doorbell,
            conn,
            lane,
            recv,
            send_cq: CqView::new(s.send_cq)?,
            recv_cq: CqView::new(s.recv_cq)?,
            _chan: chan,
            chan_ctl,
            sq,
            scomp,
            scomp_cap: ml.comp.capacity,
            req: Mutex::new(ReqState::new(0)),
            resp: Mutex::new(RespState {
                expected_psn: 0,
                inbound_head_cache: 0,
                dead: false,
                sges: Vec::new(),
                spans: Vec::new(),
                unacked: 0,
                unacked_bytes: 0,
                tokens: TokenState::default(),
            }),
            peer_gone: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            link_down: AtomicBool::new(false),
            wants_pump: AtomicBool::new(false),
            receiving: AtomicBool::new(false),
            pump_deferred: AtomicBool::new(false),
            ack_owed: AtomicU64::new(0),
            lane_key,
            tokens_taken: AtomicU64::new(0),
            tokens_applied: AtomicU64::new(0),
        });
        Ok((q, Arc::new(fd), ml))
    }

    /// The owner's QP state.
    pub(crate) fn owner_state(&self) -> Option<QpState> {
        self.recv.owner_state()
    }

    /// The owner's RNR timer code (answered in RNR NAKs).
    pub(crate) fn min_rnr_timer(&self) -> u8 {
        self.recv.qp_map.region().load_u64(ring::QP_RESERVED).unwrap_or(12) as u8
    }

    fn retry_attrs(&self) -> (u8, u8, u8) {
        let w = self.recv.qp_map.region().load_u64(ring::QP_RETRY).unwrap_or(0x0e_07_07);
        (w as u8, (w >> 8) as u8, (w >> 16) as u8)
    }

    /// Asks the owner to move its QP to ERR.
    pub(crate) fn set_error_request(&self) {
        // (The request before the wish: see `release_send_side_if_clean`.)
        if let Ok(w) = self.recv.qp_map.region().atomic_u64(ring::QP_ERROR_REQUEST) {
            w.store(ring::QP_ERR_REMOTE, Ordering::SeqCst);
        }
        self.want_send_side();
    }

    /// Moves the owner's QP to ERR (it flushes its receives; the engine its sends).
    pub(crate) fn request_error(&self) {
        self.set_error_request();
        self.recv_cq.notify(true);
        self.send_cq.notify(true);
    }

    pub(crate) fn is_link_down(&self) -> bool {
        self.link_down.load(Ordering::Acquire)
    }

    /// The link to the peer failed: everything outstanding flushes.
    pub(crate) fn link_failed(&self) {
        self.link_down.store(true, Ordering::Release);
        self.want_send_side();
        self.request_error();
    }

    /// Pushes a receive completion into the owner's inbound ring and wakes it if armed.
    pub(crate) fn complete_recv(&self, rs: &mut RespState, ce: &CompEntry) {
        if self.recv.inbound.push_cached(ce, &mut rs.inbound_head_cache).unwrap_or(false) {
            self.recv_cq.notify(ce.flags & ring::COMP_SOLICITED != 0 || ce.status != 0);
        }
    }

    /// The span of `[addr, addr+len)` in one of this QP's own MRs.
    pub(crate) fn local_span(&self, e: &Engine, key: u32, addr: u64, len: u64, need: Need) -> Result<(Arc<MappedMr>, usize), WcStatus> {
        let mr = e.mr(key, self.session, self.pd).ok_or(need.failure())?;
        check(&mr.bounds, addr, len, need)?;
        let off = (addr - mr.span_start) as usize;
        Ok((mr, off))
    }

    /// Whether the doorbell thread should keep polling this QP.
    pub(crate) fn has_work(&self) -> bool {
        if !self.has_unsent() || self.detached.load(Ordering::Acquire) {
            return false;
        }
        if self.lane && self.client_holds_side_and_knows() {
            // It rings when it lets go (or never: then only its own QP waits), so the
            // doorbell thread does not poll it meanwhile.
            return false;
        }
        if self.conn.backlog() > 0 && self.may_park() && self.conn.park_if_backlogged(Parked::Qp(self.qpn)) {
            // Pumped again when the connection's backlog is sent.
            return false;
        }
        match self.req.try_lock() {
            Some(st) => st.wait_until.is_none() && !self.stalled(&st),
            // Held briefly by a reader (work may follow), or for a whole READ response (the
            // reader kicks us when it is done).
            None => !self.defer_while_receiving(),
        }
    }

    /// With `req` held by someone else: whether that is the reader streaming a READ
    /// response, in which case the pump is left to the reader's kick when it finishes.
    fn defer_while_receiving(&self) -> bool {
        // SeqCst store, then load (the reader: store, then swap): either the reader sees the
        // deferral and kicks us, or we see it has finished.
        self.pump_deferred.store(true, Ordering::SeqCst);
        if self.receiving.load(Ordering::SeqCst) {
            return true;
        }
        self.pump_deferred.store(false, Ordering::SeqCst);
        false
    }

    /// Parked behind its connection's backlog (see [`Conn::park_if_backlogged`]), so needing
    /// no doorbell or kick until that is sent.
    pub(crate) fn is_parked(&self) -> bool {
        self.may_park() && self.conn.is_parked(Parked::Qp(self.qpn))
    }

    /// A QP whose link failed or that is in ERR has only its flush to do, which needs no
    /// room on the connection: it is never parked (nor left without doorbells).
    fn may_park(&self) -> bool {
        !self.is_link_down() && self.owner_state() != Some(QpState::Err)
    }

    /// The CPU the client last rang the doorbell from, as it says (a hint).
    pub(crate) fn ringer_cpu(&self) -> Option<usize> {
        let v = self.chan_ctl.load_u64(ring::MED_RINGER_CPU).ok()?;
        usize::try_from(v.checked_sub(1)?).ok()
    }

    /// Asks clients for a doorbell on their next post (the engine is going to sleep).
    pub(crate) fn want_doorbell(&self) {
        if let Ok(w) = self.chan_ctl.atomic_u64(ring::MED_DOORBELL_WANTED) {
            w.store(1, Ordering::SeqCst);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Send completions written but not yet polled by the owner.
    fn unpolled(&self) -> usize {
        let (head, tail) = self.scomp.positions();
        tail.wrapping_sub(head) as usize
    }

    fn stalled(&self, st: &ReqState) -> bool {
        st.inflight.len() + self.unpolled() >= self.scomp_cap
    }

    /// Whether `c` is this QP's connection.
    pub(crate) fn uses_conn(&self, c: &Arc<Conn>) -> bool {
        Arc::ptr_eq(&self.conn, c)
    }

    /// Closes the QP's lane (destroyed, reset, its peer failed): the client's end of it stops
    /// carrying anything, and its reader ends.
    pub(crate) fn close_lane(&self) {
        if self.lane {
            self.conn.shutdown();
        }
    }

    /// Asks the client to leave the send side to the engine (it sends nothing itself, and
    /// rings when it gives the side back).
    pub(crate) fn want_send_side(&self) {
        if self.lane {
            // (After the flag that says why, if any: see `release_send_side_if_clean`.)
            std::sync::atomic::fence(Ordering::SeqCst);
            self.chan_ctl.store_u64(ring::MED_ENGINE_WANTS, 1).ok();
        }
    }

    /// The client holds the send side, and the engine has asked for it (so the client rings
    /// the doorbell when it lets go).
    fn client_holds_side_and_knows(&self) -> bool {
        self.chan_ctl.load_u64(ring::MED_SEND_SIDE).unwrap_or(0) == ring::SEND_SIDE_CLIENT
            && self.chan_ctl.load_u64(ring::MED_ENGINE_WANTS).unwrap_or(0) != 0
    }

    /// Takes the send side of a lane QP for the engine: false while the client is writing a
    /// request (it rings the doorbell when done, having seen `MED_ENGINE_WANTS`). Never
    /// waits: a client that holds it forever stalls only its own QP.
    fn acquire_send_side(&self) -> bool {
        let Ok(side) = self.chan_ctl.atomic_u64(ring::MED_SEND_SIDE) else { return false };
        self.want_send_side();
        std::sync::atomic::fence(Ordering::SeqCst);
        match side.compare_exchange(ring::SEND_SIDE_FREE, ring::SEND_SIDE_ENGINE, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) | Err(ring::SEND_SIDE_ENGINE) => true,
            Err(ring::SEND_SIDE_CLIENT) => false,
            Err(_) => {
                // Garbage from the client: the engine takes the side.
                side.store(ring::SEND_SIDE_ENGINE, Ordering::SeqCst);
                true
            }
        }
    }

    /// Gives a lane QP's send side back to the client once the engine has nothing of its own
    /// to send: no retry wait, no error, no backlog, every posted WR claimed.
    ///
    /// Whoever wants the side back meanwhile must not be overwritten: a wish made under the
    /// QP's lock (a retry wait, a WR the engine must fail) is held off by holding the lock
    /// throughout; one made without it (a failed link, a gone peer, an error request) sets
    /// its flag before it asks, and the flags are read again after the wish is cleared.
    fn release_send_side_if_clean(&self, e: &Engine) {
        let Some(st) = self.req.try_lock() else { return };
        let clean = !st.stop
            && !st.errored
            && st.wait_until.is_none()
            && st.resend_from.is_none()
            && st.unfinished.is_none()
            && !self.stalled(&st)
            && self.conn.backlog() == 0
            && self.chan_ctl.load_u64(ring::MED_UNSENT).unwrap_or(1) == 0
            && !self.unclaimed();
        if !clean || !self.free_of_lockless_wishes() {
            return;
        }
        self.chan_ctl.store_u64(ring::MED_ENGINE_WANTS, 0).ok();
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.free_of_lockless_wishes() {
            self.want_send_side();
            return;
        }
        if let Ok(side) = self.chan_ctl.atomic_u64(ring::MED_SEND_SIDE) {
            side.store(ring::SEND_SIDE_FREE, Ordering::SeqCst);
        }
        drop(st);
        std::sync::atomic::fence(Ordering::SeqCst);
        // A WR posted while the engine held the side was left to the engine by its poster.
        if self.unclaimed() && self.acquire_send_side() {
            self.wants_pump.store(true, Ordering::Release);
            e.kick();
        }
    }

    /// No reason to keep a lane QP's send side that is set without the QP's lock: the peer
    /// is gone, the link is down, an error is requested, or the owner's QP left RTS.
    fn free_of_lockless_wishes(&self) -> bool {
        !self.peer_gone.load(Ordering::Acquire)
            && !self.is_link_down()
            && self.recv.qp_map.region().load_u64(ring::QP_ERROR_REQUEST).unwrap_or(1) == 0
            && self.owner_state() == Some(QpState::Rts)
    }

    /// Send-ring position up to which WRs are claimed (sent, or being sent, by the client or
    /// the engine), never behind what the engine took.
    fn claimed(&self) -> u64 {
        let head = self.sq.head_pos();
        let c = self.chan_ctl.load_u64(ring::MED_CLAIMED).unwrap_or(0);
        if c.wrapping_sub(head) as i64 > 0 {
            c.min(self.sq.tail_pos().max(head))
        } else {
            head
        }
    }

    /// A lane QP has posted WRs nobody claimed.
    fn unclaimed(&self) -> bool {
        self.sq.tail_pos().wrapping_sub(self.claimed()) as i64 > 0
    }

    /// WRs wait for the engine to send them.
    fn has_unsent(&self) -> bool {
        if self.lane {
            self.unclaimed()
        } else {
            self.sq.has_entries()
        }
    }

    /// Takes the WRs the client sent itself from the send ring as in flight (in order: their
    /// PSNs are their ring positions, as the engine numbers what it pops).
    fn adopt(&self, e: &Engine, st: &mut ReqState) {
        if !self.lane {
            return;
        }
        let claimed = self.claimed();
        let now = Instant::now();
        let mut wr = SqEntry::default();
        while claimed.wrapping_sub(self.sq.head_pos()) as i64 > 0 {
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                break;
            }
            let psn = st.next_psn;
            st.next_psn = psn.wrapping_add(1);
            let mut f = InFlight {
                psn,
                wr: std::mem::take(&mut wr),
                opcode: WrOpcode::RdmaWrite,
                len: 0,
                state: Fs::Sent,
                first_sent: now,
                rnr_tries: 0,
            };
            if let Err(status) = self.admit(e, &mut f) {
                // The client checks what it sends itself; one that lies fails its own WR.
                f.state = Fs::Done(status);
                st.stop = true;
                self.want_send_side();
            }
            st.inflight.push_back(f);
        }
    }

    /// A WR the client claimed but did not finish sending (its lane had no room): the engine
    /// writes the rest of its frame, before anything else goes on the lane.
    fn take_unsent(&self, st: &mut ReqState) {
        if !self.lane || self.chan_ctl.load_u64(ring::MED_UNSENT).unwrap_or(0) == 0 {
            return;
        }
        let Ok(w) = self.chan_ctl.atomic_u64(ring::MED_UNSENT) else { return };
        let v = w.swap(0, Ordering::AcqRel);
        let sent = self.chan_ctl.load_u64(ring::MED_UNSENT_BYTES).unwrap_or(0);
        // (Whatever the client says: the peer's daemon checks a token, and one it made up
        // only breaks its own lane.)
        let word = |i: usize| self.chan_ctl.load_u64(ring::MED_UNSENT_ACK + 8 * i).unwrap_or(0);
        let token = (word(0) != 0).then(|| ring::AckToken { counter: word(0), psn: word(1) as u32, mac: word(2) });
        if v != 0 && st.unfinished.is_none() {
            st.unfinished = Some((v.wrapping_sub(1) as u32, sent, token));
        }
    }

    /// Writes the rest of the frame the client began (see [`MedQp::take_unsent`]); its
    /// bytes are the ones the client would have written (one header builder, the same WR).
    fn finish_unsent(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox) {
        let Some((psn, sent, token)) = st.unfinished.take() else { return };
        let Some(f) = st.inflight.iter().find(|f| f.psn == psn && f.state == Fs::Sent) else {
            // (Flushed meanwhile.) What follows a cut frame would be misread: the lane ends.
            if sent > 0 {
                self.conn.shutdown();
            }
            return;
        };
        // (The frame's own data: a READ or atomic request carries none, whatever its length.)
        if self.header(f).data_len as usize > BATCH_DATA_MAX && f.wr.send_flags & send_flags::INLINE == 0 {
            // Never sent from a client (too large): a lying client breaks its own lane.
            self.conn.shutdown();
            return;
        }
        let start = out.cur.len();
        // (The header the client began: with the token it carried, if any.)
        self.send_wr(e, out, f, token);
        let frame = out.cur.len() - start;
        let skip = usize::try_from(sent).map_or(frame, |s| s.min(frame));
        out.cur.drain(start..start + skip);
    }

    /// Runs the send side: flushes after errors, resends after RNR waits, sends new WRs.
    /// Only the doorbell thread calls it, so a QP's requests leave in PSN order (on a lane,
    /// only while the engine holds the QP's send side).
    pub(crate) fn pump(&self, e: &Engine) {
        if self.detached.load(Ordering::Acquire) {
            return;
        }
        if self.lane && !self.acquire_send_side() {
            // The client is writing a request: it rings when it is done.
            return;
        }
        // (Not after a pump that did not run: a frame the client left unfinished may wait.)
        if self.pump_sends(e) && self.lane {
            self.release_send_side_if_clean(e);
        }
    }

    /// Whether it ran (it leaves the QP to the reader streaming a READ response into it).
    fn pump_sends(&self, e: &Engine) -> bool {
        let mut out = Outbox::default();
        {
            let mut guard = match self.req.try_lock() {
                Some(g) => g,
                None if self.defer_while_receiving() => return false,
                None => self.req.lock(),
            };
            self.pump_locked(e, &mut guard, &mut out);
        }
        for o in out.finish() {
            super::trace::record(super::trace::Stage::SendStart, self.qpn, 0);
            let r = match o {
                Out::Bytes(b) => self.conn.send_raw(b),
                Out::Region(h, mr, off, len) => self.conn.send_mr(&h, &mr, off, len),
            };
            super::trace::record(super::trace::Stage::SendEnd, self.qpn, 0);
            if let Err(err) = r {
                // The reader of this connection sees it close and fails the peer's QPs.
                log::warn!("engine: QP {}: send failed: {err}", self.qpn);
                self.conn.shutdown();
                return true;
            }
        }
        true
    }

    fn pump_locked(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox) {
        self.adopt(e, st);
        self.take_unsent(st);
        self.pump_state(e, st, out);
        if self.lane {
            // What the engine took is claimed: the client sends only after it.
            self.chan_ctl.store_u64(ring::MED_CLAIMED, self.sq.head_pos()).ok();
        }
    }

    fn pump_state(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox) {
        let owner = self.owner_state();
        if st.errored || self.link_down.load(Ordering::Acquire) || owner == Some(QpState::Err) {
            if st.unfinished.take().is_some_and(|(_, sent, _)| sent > 0) {
                // A frame the client cut is never finished now: the lane ends, rather than
                // leave the peer's responder waiting for the rest of it.
                self.conn.shutdown();
            }
            self.flush(st);
            return;
        }
        if matches!(owner, Some(QpState::Reset | QpState::Init | QpState::Rtr)) {
            return;
        }
        // Frames wait for room in the connection's socket (a slow peer or path): this QP is
        // pumped again once they are sent, so the doorbell thread never waits on them.
        if self.conn.park_if_backlogged(Parked::Qp(self.qpn)) {
            return;
        }
        // First on the lane: the rest of a frame the client began.
        self.finish_unsent(e, st, out);
        let now = Instant::now();
        if let Some(t) = st.wait_until {
            if now < t {
                return;
            }
            st.wait_until = None;
            // (Nothing is resent to a peer QP that is gone: no answer would come.)
            if let Some(from) = st.resend_from.take().filter(|_| !self.peer_gone.load(Ordering::Acquire)) {
                for f in st.inflight.iter().filter(|f| f.state == Fs::Sent && f.psn.wrapping_sub(from) as i32 >= 0) {
                    self.send_wr(e, out, f, None);
                }
            }
        }
        if self.peer_gone.load(Ordering::Acquire) && self.wait_out_gone_peer(e, st, now) {
            return;
        }
        let mut wr = SqEntry::default();
        // One doorbell thread serves every QP of the host: a QP with a deep send queue of
        // large WRITEs gets a budget per round, then the thread kicks it again and serves the
        // others first (fairness between vNICs; at least one WR always goes).
        let (mut budget_wrs, mut budget_bytes) = (PUMP_BUDGET_WRS, PUMP_BUDGET_BYTES);
        while !st.stop {
            if budget_wrs == 0 || budget_bytes == 0 {
                break;
            }
            if self.stalled(st) {
                self.chan_ctl.store_u64(ring::MED_STALLED, 1).ok();
                std::sync::atomic::fence(Ordering::SeqCst);
                if self.stalled(st) {
                    break;
                }
                self.chan_ctl.store_u64(ring::MED_STALLED, 0).ok();
            }
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                break;
            }
            let psn = st.next_psn;
            st.next_psn = st.next_psn.wrapping_add(1);
            let mut f = InFlight {
                psn,
                wr: std::mem::take(&mut wr),
                opcode: WrOpcode::RdmaWrite,
                len: 0,
                state: Fs::Sent,
                first_sent: now,
                rnr_tries: 0,
            };
            match self.admit(e, &mut f) {
                Err(status) => {
                    f.state = Fs::Done(status);
                    st.stop = true;
                }
                Ok(()) if self.peer_gone.load(Ordering::Acquire) => {
                    // Nothing answers it: it waits out the QP's retries below.
                    st.inflight.push_back(f);
                    self.wait_out_gone_peer(e, st, now);
                    break;
                }
                Ok(()) => {
                    let token = self.token_to_carry(f.opcode);
                    self.send_wr(e, out, &f, token);
                    budget_wrs -= 1;
                    if matches!(f.opcode, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::Send | WrOpcode::SendWithImm) {
                        budget_bytes = budget_bytes.saturating_sub(f.len as usize);
                    }
                }
            }
            st.inflight.push_back(f);
        }
        self.retire(st);
    }

    /// The peer QP is gone. Like a NIC whose retries go unanswered, the oldest unacknowledged
    /// WR fails RETRY_EXC_ERR once the QP's retries are spent (timeout × (retry_cnt + 1) after
    /// it was first sent; never with timeout 0), not at once: a ping-pong peer that sent one
    /// message too many and exits within that time finishes cleanly, as on hardware. Until
    /// then the pump sleeps on a timer; returns whether it waits.
    fn wait_out_gone_peer(&self, e: &Engine, st: &mut ReqState, now: Instant) -> bool {
        let Some(f) = st.inflight.iter_mut().find(|f| f.state == Fs::Sent) else {
            return false;
        };
        let (_, retry_cnt, timeout) = self.retry_attrs();
        let Some(limit) = timers::retry_limit(timeout, retry_cnt) else {
            // Timeout 0 retries forever: the pump sleeps (no timer) until the QP is moved
            // to ERR or destroyed.
            st.wait_until = Some(now + GONE_FOREVER);
            return true;
        };
        let give_up_at = f.first_sent + limit;
        if now >= give_up_at {
            f.state = Fs::Done(WcStatus::RetryExcErr);
            st.stop = true;
            return false;
        }
        st.wait_until = Some(give_up_at);
        if st.gone_timer != Some(give_up_at) {
            st.gone_timer = Some(give_up_at);
            e.add_timer(give_up_at, self.qpn);
        }
        true
    }

    /// Local checks of a WR taken from the (untrusted) send ring; computes its length.
    fn admit(&self, e: &Engine, f: &mut InFlight) -> Result<(), WcStatus> {
        f.opcode = WrOpcode::from_u32(f.wr.opcode).ok_or(WcStatus::LocQpOpErr)?;
        let need = match f.opcode {
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => Need::LocalWrite,
            _ => Need::LocalRead,
        };
        let mut total = 0u64;
        if f.wr.send_flags & send_flags::INLINE != 0 && need == Need::LocalRead {
            total = f.wr.inline.len() as u64;
        } else {
            for s in f.wr.sges.iter().filter(|s| s.length > 0) {
                self.local_span(e, s.lkey, s.addr, u64::from(s.length), need)?;
                total += u64::from(s.length);
            }
        }
        if total > u64::from(wire::MAX_MESSAGE) {
            return Err(WcStatus::LocLenErr);
        }
        if matches!(f.opcode, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) && (total != 8 || f.wr.sges.len() != 1) {
            return Err(WcStatus::LocLenErr);
        }
        f.len = total as u32;
        Ok(())
    }

    fn header(&self, f: &InFlight) -> FrameHeader {
        FrameHeader::request(f.opcode, &f.wr, f.psn, self.qpn, self.remote_qpn, f.len)
    }

    /// On a lane, the ACK token published for the owner that a request of `opcode` the
    /// engine sends in its place carries (a SEND or WRITE: the owner's large WRs, resends
    /// after an RNR wait), so the owner's answers acknowledge as well whoever sends them;
    /// it counts as carried ([`ring::MED_ACK_TAKEN`]).
    fn token_to_carry(&self, opcode: WrOpcode) -> Option<ring::AckToken> {
        if !self.lane || !matches!(opcode, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm) {
            return None;
        }
        ring::AckToken::take_next(&self.chan_ctl, 0)
    }

    /// Queues the request frame of `f`, with ACK `token` on a lane: small ones copied into
    /// the batch, large ones sent later straight from registered memory.
    fn send_wr(&self, e: &Engine, out: &mut Outbox, f: &InFlight, token: Option<ring::AckToken>) {
        let mut h = self.header(f);
        // (On a lane its responder takes F_ACKS only as a token: the client writes there.)
        if let Some(psn) = (!self.lane).then(|| self.take_owed_ack()).flatten() {
            h.flags |= wire::F_ACKS;
            h.status = psn;
        }
        if let Some(t) = &token {
            h.carry(t);
        }
        let len = h.data_len as usize;
        let inline = f.wr.send_flags & send_flags::INLINE != 0;
        // No allocation per WR: the non-empty elements are walked in place.
        let mut sges = f.wr.sges.iter().filter(|s| s.length > 0);
        let single = sges.clone().nth(1).is_none();
        if let (true, false, true, Some(s)) = (len > BATCH_DATA_MAX, inline, single, sges.clone().next()) {
            if let Ok((mr, off)) = self.local_span(e, s.lkey, s.addr, u64::from(s.length), Need::LocalRead) {
                out.push_big(Out::Region(h, mr, off, len));
                return;
            }
        }
        let batch = &mut out.cur;
        batch.extend_from_slice(&h.encode());
        if len == 0 {
            return;
        }
        if inline {
            batch.extend_from_slice(&f.wr.inline);
            return;
        }
        for s in sges.by_ref() {
            let at = batch.len();
            batch.resize(at + s.length as usize, 0);
            // Deregistered since admission: zeros go out (the application broke the verbs
            // contract by deregistering an MR in use).
            if let Ok((mr, off)) = self.local_span(e, s.lkey, s.addr, u64::from(s.length), Need::LocalRead) {
                let _ = mr.read(off, &mut batch[at..]);
            }
        }
    }

    /// The responder executed SEND/WRITE `psn` and defers its ACK.
    pub(crate) fn owe_ack(&self, psn: u32) {
        self.ack_owed.store(OWED | u64::from(psn), Ordering::Release);
    }

    /// The responder acknowledges everything now: nothing stays owed.
    pub(crate) fn clear_owed_ack(&self) {
        self.ack_owed.store(0, Ordering::Release);
    }

    /// Publishes the deferred ACK of SEND/WRITE `psn` (executed, but for its completion,
    /// written next) as a token for the owner to carry on its lane, in the next request it
    /// sends there itself: the peer daemon reads that request anyway, so the ACK costs no
    /// frame, system call or wakeup of ours and no wakeup of the peer's reader (on 2 CPUs
    /// the wakeup alone is a fifth of a one-way message). Only a QP with a lane whose
    /// requests came on a lane; none while uncarried tokens turned them off. Whether the
    /// owner carried it is settled by [`MedQp::ack_duty`].
    ///
    /// The MAC is keyed with the secret of the *requester's* lane, the one the acknowledged
    /// request came on (`requester_key`): its daemon checks a token with its QP's own lane
    /// secret, so a token of an earlier connection of the pair (another lane, another
    /// secret) never counts after a reconnection restarted the PSNs.
    pub(crate) fn publish_ack_token(&self, rs: &mut RespState, psn: u32, requester_key: [u64; 2]) {
        if !self.lane {
            return;
        }
        let t = &mut rs.tokens;
        if t.skip > 0 {
            t.skip -= 1;
            return;
        }
        let counter = t.published + 1;
        let token = ring::AckToken { psn, counter, mac: wire::lane_ack_mac(requester_key, self.remote_qpn, self.qpn, psn, counter) };
        if token.publish(&self.chan_ctl).is_err() {
            return;
        }
        t.published = counter;
        let now = Instant::now();
        t.pending = Some((token, now));
        let due = t.unconfirmed.map_or(now + TOKEN_TRUST, |(_, due)| due);
        t.unconfirmed = Some((psn, due));
    }

    /// Our own ACK covers everything executed: no token waits or stays unconfirmed.
    pub(crate) fn acked_by_us(rs: &mut RespState) {
        rs.tokens.pending = None;
        rs.tokens.unconfirmed = None;
    }

    /// What the reader of the lane this QP's requests come on must do about its ACKs before
    /// it waits for more (at `now`): wait (for the owner to carry the pending token, or for an
    /// unconfirmed PSN's deadline), send the deferred ACK (no token, or one the owner did not
    /// carry in [`TOKEN_WAIT`]: tokens then pause), confirm a PSN tokens acknowledged (an
    /// ACK of our own at most [`TOKEN_TRUST`] later), or nothing. `can_wait` false (the
    /// reader has no timer): a pending token is settled at once.
    pub(crate) fn ack_duty(&self, now: Instant, can_wait: bool) -> AckDuty {
        let mut guard = self.resp.lock();
        let rs = &mut *guard;
        let t = &mut rs.tokens;
        if let Some((token, at)) = t.pending {
            // (The owner's claim: a false one only delays its peer, by TOKEN_TRUST at most.)
            let taken = self.chan_ctl.load_u64(ring::MED_ACK_TAKEN).unwrap_or(0);
            let carried = taken >= token.counter && taken <= t.published;
            let until = at + TOKEN_WAIT;
            if !carried && now < until && can_wait {
                return AckDuty::Wait(t.unconfirmed.map_or(until, |(_, due)| due.min(until)));
            }
            t.pending = None;
            if carried {
                t.backoff = 0;
                let _ = self.ack_owed.compare_exchange(OWED | u64::from(token.psn), 0, Ordering::AcqRel, Ordering::Relaxed);
                // The ACK went: the count towards one of our own starts again, so that a
                // ping-pong's ACKs all ride on its answers.
                rs.unacked = 0;
                rs.unacked_bytes = 0;
            } else {
                t.backoff = (t.backoff * 2).clamp(TOKEN_BACKOFF_MIN, TOKEN_BACKOFF_MAX);
                t.skip = t.backoff;
            }
        }
        if self.ack_owed.load(Ordering::Acquire) != 0 {
            return AckDuty::SendOwed;
        }
        match t.unconfirmed {
            Some((psn, due)) if now >= due || !can_wait => {
                t.unconfirmed = None;
                AckDuty::Confirm(psn)
            }
            Some((_, due)) => AckDuty::Wait(due),
            None => AckDuty::Idle,
        }
    }

    /// Takes the deferred ACK, if any (its PSN).
    pub(crate) fn take_owed_ack(&self) -> Option<u32> {
        if self.ack_owed.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let v = self.ack_owed.swap(0, Ordering::AcqRel);
        (v & OWED != 0).then_some(v as u32)
    }

    /// Whether a deferred ACK is waiting.
    pub(crate) fn owes_ack(&self) -> bool {
        self.ack_owed.load(Ordering::Acquire) != 0
    }

    /// Starts fetching the cache lines of shared memory that handling request `h` will
    /// touch and that the owner's CPU wrote last (its send ring for a token's WRs, its
    /// receive ring, the token's seqlock), so that their cross-core misses overlap instead of
    /// following one another on the way to the completion its application waits for. The
    /// completion rings are left alone: their owner spins on them. (Lane QPs only: the
    /// others' owners write neither the claim nor tokens.)
    pub(crate) fn prefetch_for(&self, h: &FrameHeader) {
        if !self.lane {
            return;
        }
        if h.flags & wire::F_ACKS != 0 {
            self.chan_ctl.prefetch(ring::MED_CLAIMED, false);
            self.sq.prefetch_next();
            self.chan_ctl.prefetch(ring::MED_RETIRED, true);
        }
        if h.kind == Kind::Send || h.kind == Kind::Write && h.flags & wire::F_IMM != 0 {
            self.recv.prefetch_recv();
            self.chan_ctl.prefetch(ring::MED_ACK_TOKEN, true);
        }
    }

    /// Whether request `h` (from the peer's QP `h.src_qpn` to this one, on a lane) carries a
    /// genuine ACK token of the peer daemon's for this QP's requests ([`wire::F_ACKS`]): the
    /// MAC keyed with this QP's own lane secret (so only the peer daemon, which got it in
    /// our LANE frame, could make it, and only for this connection of the pair), on a SEND
    /// or WRITE (whose `arg1` and `arg2` carry nothing else), and each counter once. Whatever
    /// else a client writes there is ignored.
    pub(crate) fn take_ack_token(&self, h: &FrameHeader) -> bool {
        let Some(key) = self.lane_key else { return false };
        if !matches!(h.kind, Kind::Send | Kind::Write) || h.arg2 != wire::lane_ack_mac(key, self.qpn, h.src_qpn, h.status, h.arg1) {
            return false;
        }
        // (One reader per lane takes tokens; the maximum keeps this monotonic regardless.)
        let fresh = self.tokens_taken.fetch_max(h.arg1, Ordering::AcqRel) < h.arg1;
        if fresh {
            self.tokens_applied.fetch_add(1, Ordering::Relaxed);
        }
        fresh
    }

    /// The peer acknowledged (cumulatively) every SEND and WRITE up to `through`, on a
    /// request of its own ([`wire::F_ACKS`]): complete them.
    pub(crate) fn ack_through(&self, e: &Engine, through: u32) {
        let guard = self.req.lock();
        self.acked_through(e, guard, through);
    }

    /// [`MedQp::ack_through`] for an ACK token, on the lane reader of the peer's requests,
    /// which must not wait for a READ response streaming into this QP (for as long as a slow
    /// link takes): then the token is dropped, and the peer's daemon acknowledges by itself
    /// within [`TOKEN_TRUST`], on the connection the response takes, after it.
    pub(crate) fn ack_token_through(&self, e: &Engine, through: u32) {
        let guard = match self.req.try_lock() {
            Some(g) => g,
            None if self.receiving.load(Ordering::SeqCst) => return,
            None => self.req.lock(),
        };
        self.acked_through(e, guard, through);
    }

    fn acked_through(&self, e: &Engine, mut guard: parking_lot::MutexGuard<'_, ReqState>, through: u32) {
        let st = &mut *guard;
        self.adopt(e, st);
        if !mark_acked(st, through) {
            return;
        }
        self.retire_and_kick(e, guard);
    }

    /// Completes what finished and, if that freed room while the send ring holds more,
    /// has the doorbell thread pump again (after releasing the lock).
    fn retire_and_kick(&self, e: &Engine, mut guard: parking_lot::MutexGuard<'_, ReqState>) {
        let before = guard.inflight.len();
        self.retire(&mut guard);
        let freed = guard.inflight.len() < before;
        drop(guard);
        let deferred = self.pump_deferred.swap(false, Ordering::SeqCst);
        // (A QP parked behind its connection's backlog is pumped when that is sent.)
        if (deferred || (freed && self.has_unsent())) && !self.is_parked() {
            self.wants_pump.store(true, Ordering::Release);
            e.kick();
        }
    }

    /// Completes finished WRs in order.
    fn retire(&self, st: &mut ReqState) {
        let mut notify = None;
        let retired_before = st.retired;
        while let Some(f) = st.inflight.front() {
            let Fs::Done(status) = f.state else { break };
            let signaled = f.wr.send_flags & send_flags::SIGNALED != 0;
            let fatal = status != WcStatus::Success && status != WcStatus::WrFlushErr;
            if status != WcStatus::Success || signaled {
                let ce = CompEntry {
                    wr_id: f.wr.wr_id,
                    byte_len: if status == WcStatus::Success { f.len } else { 0 },
                    imm: 0,
                    opcode: f.opcode.wc_opcode() as u8,
                    status: status as u8,
                    wc_flags: 0,
                    flags: 0,
                    src_qp: self.qpn,
                };
                if !self.scomp.push_cached(&ce, &mut st.comp_head_cache).unwrap_or(false) {
                    self.chan_ctl.store_u64(ring::MED_STALLED, 1).ok();
                    break;
                }
                notify = Some(notify.unwrap_or(false) | (status != WcStatus::Success));
            }
            st.inflight.pop_front();
            st.retired += 1;
            if fatal {
                // After the completion: the library moves the QP to ERR when it polls the
                // error itself; this word covers an owner that never polls.
                self.set_error_request();
                st.errored = true;
                for g in st.inflight.iter_mut() {
                    g.state = Fs::Done(WcStatus::WrFlushErr);
                }
            }
        }
        if st.retired != retired_before {
            self.chan_ctl.store_u64(ring::MED_RETIRED, st.retired).ok();
        }
        if let Some(err) = notify {
            self.send_cq.notify(err);
        }
    }

    /// ERR: every WR in flight and in the send ring completes with WR_FLUSH_ERR.
    fn flush(&self, st: &mut ReqState) {
        st.wait_until = None;
        st.resend_from = None;
        for f in st.inflight.iter_mut() {
            if f.state == Fs::Sent {
                f.state = Fs::Done(WcStatus::WrFlushErr);
            }
        }
        loop {
            self.retire(st);
            if !st.inflight.is_empty() || self.stalled(st) {
                if self.stalled(st) {
                    self.chan_ctl.store_u64(ring::MED_STALLED, 1).ok();
                }
                return;
            }
            let mut wr = SqEntry::default();
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                return;
            }
            let opcode = WrOpcode::from_u32(wr.opcode).unwrap_or(WrOpcode::Send);
            let psn = st.next_psn;
            st.next_psn = psn.wrapping_add(1);
            st.inflight.push_back(InFlight {
                psn,
                wr,
                opcode,
                len: 0,
                state: Fs::Done(WcStatus::WrFlushErr),
                first_sent: Instant::now(),
                rnr_tries: 0,
            });
        }
    }
}

/// Marks every SEND and WRITE sent up to PSN `through` (wrapping) done: the responder
/// executes in PSN order, so an acknowledgement covers everything before it. READs and
/// atomics wait for their own responses. Whether anything changed.
fn mark_acked(st: &mut ReqState, through: u32) -> bool {
    let mut any = false;
    for f in st.inflight.iter_mut() {
        if through.wrapping_sub(f.psn) as i32 <= -1 {
            break;
        }
        let plain = matches!(f.opcode, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm);
        if plain && f.state == Fs::Sent {
            f.state = Fs::Done(WcStatus::Success);
            any = true;
        }
    }
    any
}

/// A response on one of our connections: completes (or schedules the retry of) the request,
/// and (acknowledgements being cumulative) every SEND and WRITE before it.
/// A reader streaming a READ response into a QP (see [`MedQp::defer_while_receiving`]):
/// when it ends, however it ends, a pump the doorbell thread skipped meanwhile is requested.
struct Receiving<'a> {
    e: &'a Engine,
    q: &'a MedQp,
}

impl<'a> Receiving<'a> {
    fn start(e: &'a Engine, q: &'a MedQp) -> Receiving<'a> {
        q.receiving.store(true, Ordering::SeqCst);
        Receiving { e, q }
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.q.receiving.store(false, Ordering::SeqCst);
        // SeqCst store, then swap (the doorbell thread: store, then load): either it saw
        // `receiving` clear, or we see its deferral here. (`retire_and_kick` may have taken
        // the deferral already, and kicked.)
        if self.q.pump_deferred.swap(false, Ordering::SeqCst) {
            self.q.wants_pump.store(true, Ordering::Release);
            self.e.kick();
        }
    }
}

pub(crate) fn handle_response(e: &Arc<Engine>, c: &Conn, h: &FrameHeader) -> std::io::Result<()> {
    let data = u64::from(h.data_len);
    let q = e.qps.read().get(&h.dst_qpn).cloned();
    let Some(q) = q.filter(|q| q.remote == c.peer && q.remote_qpn == h.src_qpn) else {
        return c.discard(data);
    };
    // A READ response is streamed into memory under the QP's lock, as long as it takes on a
    // slow link: marked before the lock is taken, so that a doorbell thread finding the lock
    // held always knows to skip the QP rather than wait (the reader kicks it when done).
    let _receiving = (h.kind == Kind::ReadResp).then(|| Receiving::start(e, &q));
    let mut guard = q.req.lock();
    let st = &mut *guard;
    q.adopt(e, st);
    // Every response but "not ready" and "gone" comes from the responder executing in order
    // at this PSN, so everything before it was executed.
    let in_order = !matches!(Nak::from_u32(h.status), Some(Nak::NotReady | Nak::Gone));
    let earlier_done = in_order && mark_acked(st, h.psn.wrapping_sub(1));
    let Some(i) = st.inflight.iter().position(|f| f.psn == h.psn && f.state == Fs::Sent) else {
        if earlier_done {
            q.retire_and_kick(e, guard);
        }
        return c.discard(data);
    };
    let mut consumed = false;
    let new_state = match Nak::from_u32(h.status) {
        None if h.status != 0 => Some(WcStatus::GeneralErr),
        None => match h.kind {
            Kind::ReadResp => {
                consumed = true;
                let r = scatter_read(e, &q, c, &st.inflight[i], h.data_len);
                // (The data is in: a pump may wait for the lock the little time left.)
                q.receiving.store(false, Ordering::SeqCst);
                Some(r?)
            }
            Kind::AtomicResp => {
                let f = &st.inflight[i];
                let s = f.wr.sges[0];
                Some(match q.local_span(e, s.lkey, s.addr, 8, Need::LocalWrite) {
                    Ok((mr, off)) => match mr.write(off, &h.arg1.to_ne_bytes()) {
                        Ok(()) => WcStatus::Success,
                        Err(_) => WcStatus::LocProtErr,
                    },
                    Err(st) => st,
                })
            }
            _ => Some(WcStatus::Success),
        },
        Some(Nak::Rnr) | Some(Nak::NotReady) => {
            let (rnr_retry, retry_cnt, timeout) = q.retry_attrs();
            let now = Instant::now();
            let f = &mut st.inflight[i];
            let give_up = if h.status == Nak::Rnr as u32 {
                f.rnr_tries += 1;
                rnr_retry != timers::RNR_RETRY_INFINITE && f.rnr_tries > u32::from(rnr_retry)
            } else {
                timers::retry_limit(timeout, retry_cnt).is_some_and(|l| now.duration_since(f.first_sent) > l)
            };
            if give_up {
                Some(if h.status == Nak::Rnr as u32 { WcStatus::RnrRetryExcErr } else { WcStatus::RetryExcErr })
            } else {
                let wait = if h.status == Nak::Rnr as u32 { timers::rnr_timer(h.arg1 as u8) } else { Duration::from_micros(200) };
                let at = now + wait;
                st.wait_until = Some(at);
                st.resend_from = Some(h.psn);
                // The resend is the engine's: the client stops sending meanwhile.
                q.want_send_side();
                e.add_timer(at, q.qpn);
                None
            }
        }
        Some(Nak::RemoteAccess) => Some(WcStatus::RemAccessErr),
        Some(Nak::InvalidRequest) => Some(WcStatus::RemInvReqErr),
        Some(Nak::RemoteOperation) => Some(WcStatus::RemOpErr),
        Some(Nak::Gone) => {
            // The responder no longer has our peer: retries would go unanswered, and the
            // pump fails the WR when they are spent.
            q.peer_gone.store(true, Ordering::Release);
            q.want_send_side();
            q.pump_deferred.store(true, Ordering::SeqCst);
            None
        }
    };
    if !consumed {
        c.discard(data)?;
    }
    if let Some(s) = new_state {
        st.inflight[i].state = Fs::Done(s);
    }
    q.retire_and_kick(e, guard);
    Ok(())
}

/// Reads READ response data into the WR's local scatter list.
fn scatter_read(e: &Engine, q: &MedQp, c: &Conn, f: &InFlight, len: u32) -> std::io::Result<WcStatus> {
    if len != f.len {
        c.discard(u64::from(len))?;
        return Ok(WcStatus::RemOpErr);
    }
    let mut left = u64::from(len);
    let mut status = WcStatus::Success;
    for s in f.wr.sges.iter().filter(|s| s.length > 0) {
        let n = u64::from(s.length).min(left);
        if n == 0 {
            break;
        }
        match q.local_span(e, s.lkey, s.addr, n, Need::LocalWrite) {
            Ok((mr, off)) if status == WcStatus::Success => {
                if !mr.receive(c, off, n as usize)? {
                    status = WcStatus::LocProtErr;
                }
            }
            Ok(_) => c.discard(n)?,
            Err(st) => {
                status = st;
                c.discard(n)?;
            }
        }
        left -= n;
    }
    if left > 0 {
        c.discard(left)?;
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(first_psn: u32, ops: &[WrOpcode]) -> ReqState {
        let mut st = ReqState::new(first_psn);
        for &opcode in ops {
            let psn = st.next_psn;
            st.next_psn = psn.wrapping_add(1);
            st.inflight.push_back(InFlight {
                psn,
                wr: SqEntry::default(),
                opcode,
                len: 0,
                state: Fs::Sent,
                first_sent: Instant::now(),
                rnr_tries: 0,
            });
        }
        st
    }

    fn done(st: &ReqState) -> Vec<bool> {
        st.inflight.iter().map(|f| f.state != Fs::Sent).collect()
    }

    #[test]
    fn a_cumulative_ack_completes_sends_and_writes_up_to_its_psn_only() {
        use WrOpcode::*;
        let mut st = state(10, &[Send, RdmaRead, RdmaWrite, AtomicFetchAndAdd, SendWithImm, RdmaWriteWithImm]);
        assert!(mark_acked(&mut st, 12));
        // READ and atomics wait for their own responses; nothing past 12 is touched.
        assert_eq!(done(&st), [true, false, true, false, false, false]);
        assert!(!mark_acked(&mut st, 12), "acknowledging again changes nothing");
        assert!(!mark_acked(&mut st, 9), "an older acknowledgement changes nothing");
        assert!(mark_acked(&mut st, 15));
        assert_eq!(done(&st), [true, false, true, false, true, true]);
    }

    #[test]
    fn a_cumulative_ack_works_across_psn_wrap() {
        use WrOpcode::*;
        let mut st = state(u32::MAX - 1, &[Send, Send, Send, Send]);
        assert!(mark_acked(&mut st, 0)); // u32::MAX - 1, u32::MAX, 0
        assert_eq!(done(&st), [true, true, true, false]);
    }

    #[test]
    fn an_ack_before_the_first_psn_in_flight_changes_nothing() {
        let mut st = state(100, &[WrOpcode::Send]);
        assert!(!mark_acked(&mut st, 99));
        assert!(!mark_acked(&mut st, 100u32.wrapping_sub(1 << 30)));
        assert_eq!(done(&st), [false]);
    }
}
