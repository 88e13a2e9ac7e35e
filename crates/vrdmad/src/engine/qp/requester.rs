//! The requester: the send ring's WRs admitted, framed and sent (batched, or straight from
//! registered memory), resent after RNR and not-ready waits, waited out for a gone peer.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_abi::ring::{self, SqEntry};
use vrdma_abi::verbs::{send_flags, QpState, WcStatus, WrOpcode};
use vrdma_abi::wire::{self, FrameHeader};
use vrdma_core::access::Need;
use vrdma_core::timers;

use super::MedQp;
use crate::engine::connection::Parked;
use crate::engine::mr::NotNow;
use crate::engine::qos::Budget;
use crate::engine::trace;
use crate::engine::{Engine, MappedMr};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fs {
    /// Sent, waiting for its response.
    Sent,
    /// Finished with this status (completes in order).
    Done(WcStatus),
}

pub(crate) struct InFlight {
    pub(crate) psn: u32,
    pub(crate) wr: SqEntry,
    pub(crate) opcode: WrOpcode,
    pub(crate) len: u32,
    pub(crate) state: Fs,
    pub(crate) first_sent: Instant,
    pub(crate) rnr_tries: u32,
    /// Data bytes the engine's pump put on the wire for it, counted in `MedQp::wire_bytes`
    /// until it retires (0: sent by the client on its lane, or never sent).
    pub(crate) on_wire: u32,
    /// A READ: bytes of its response in so far (it comes in parts, `wire::F_MORE`), and the
    /// first error met scattering them.
    pub(crate) read_done: u32,
    pub(crate) read_err: Option<WcStatus>,
    /// A READ: a part of its response could not be stored now (`mr::NotNow`): it is asked
    /// again from that part's offset (here) once its last part is in.
    pub(crate) read_again: Option<u32>,
    /// A READ asked again: parts of an earlier answer that do not fit are dropped, not an
    /// error.
    pub(crate) read_restarted: bool,
    /// An atomic: its response's original value, until it is stored in the WR's buffer
    /// (whose memory did not answer at once, `mr::NotNow`).
    pub(crate) atomic_owed: Option<u64>,
    /// Data bytes from which its frames are still to be sent (a large WRITE or SEND goes in
    /// segments, a few per pump; a resend from its start); `None` once all are queued.
    pub(crate) next_byte: Option<u32>,
    /// A WRITE or SEND in segments answered "not ready" at one of them, or a READ whose
    /// response stopped or could not be stored from some part on: where its resends begin
    /// (`wire::F_RESUME`; 0: from its start).
    pub(crate) resume_at: u32,
    /// The furthest it was resumed from: resuming further on is progress (its retries count
    /// from there).
    pub(crate) resumed_high: u32,
}

impl InFlight {
    /// WR `wr` (`opcode`) under `psn`, sent at `first_sent`, in `state`.
    pub(crate) fn new(psn: u32, wr: SqEntry, opcode: WrOpcode, state: Fs, first_sent: Instant) -> InFlight {
        InFlight {
            psn,
            wr,
            opcode,
            len: 0,
            state,
            first_sent,
            rnr_tries: 0,
            on_wire: 0,
            read_done: 0,
            read_err: None,
            read_again: None,
            read_restarted: false,
            atomic_owed: None,
            next_byte: None,
            resume_at: 0,
            resumed_high: 0,
        }
    }

    /// Where a resend of it begins among its frames (`next_byte`): a WRITE's or SEND's at the
    /// segment it was stopped at, a READ's request (asking for the rest) whole.
    pub(crate) fn resend_from(&self) -> u32 {
        if self.opcode == WrOpcode::RdmaRead {
            0
        } else {
            self.resume_at
        }
    }

    /// Whether its next frame is a resend from where it was stopped (`wire::F_RESUME`).
    pub(crate) fn resuming(&self) -> bool {
        self.resume_at > 0 && self.next_byte == Some(self.resend_from())
    }
}

pub(crate) struct ReqState {
    pub(crate) next_psn: u32,
    pub(crate) inflight: VecDeque<InFlight>,
    pub(crate) comp_head_cache: u64,
    /// A local error is queued: send nothing new.
    pub(crate) stop: bool,
    /// An error completed: everything after it flushes.
    pub(crate) errored: bool,
    /// RNR / not-ready wait: resend from `resend_from` at this time.
    pub(crate) wait_until: Option<Instant>,
    pub(crate) resend_from: Option<u32>,
    /// A request answered RNR again and again, resent alone: the requests after it (which
    /// the responder drops until it executes this one) are resent, and new ones sent, only
    /// once it is answered ([`RNR_PROBE_AFTER`]).
    pub(crate) probe: Option<u32>,
    /// The time the engine's timer is set for to give up on a gone peer (one timer per
    /// deadline, however often the QP is pumped meanwhile).
    pub(crate) gone_timer: Option<Instant>,
    /// A response showed the QP's requests moving (one executed or acknowledged, an RNR, a
    /// message resumed further on) since the last retry: that retry takes it for the time
    /// its "not ready" retries count from (`progress_at`), as a NIC's retry count starts
    /// again at every answer. (A flag, so that an ACK reads no clock.)
    pub(crate) progressed: bool,
    pub(crate) progress_at: Option<Instant>,
    /// Send-ring WRs retired so far (published as `MED_RETIRED`).
    pub(crate) retired: u64,
    /// A frame the client began on the lane and left to the engine: (PSN, bytes written,
    /// the ACK token its header carries).
    pub(crate) unfinished: Option<(u32, u64, Option<ring::AckToken>)>,
    /// Some atomic's result waits to be stored (`InFlight::atomic_owed`).
    pub(crate) atomics_owed: bool,
    /// Waiting for data a copied MR's owner's memory did not give (`MedQp::wait_for_data`):
    /// the QP is pumped again then (one timer), nothing is tried before.
    pub(crate) data_wait: Option<Instant>,
    /// A pump stopped at a READ or atomic beyond the initiator depth
    /// ([`MedQp::reads_at_depth`]): the completion of any of those outstanding (at the
    /// head of `inflight` or not) has the QP pumped again.
    pub(crate) depth_held: bool,
}

impl ReqState {
    pub(crate) fn new(first_psn: u32) -> ReqState {
        ReqState {
            next_psn: first_psn,
            inflight: VecDeque::new(),
            comp_head_cache: 0,
            stop: false,
            errored: false,
            wait_until: None,
            resend_from: None,
            probe: None,
            gone_timer: None,
            progressed: false,
            progress_at: None,
            retired: 0,
            unfinished: None,
            atomics_owed: false,
            data_wait: None,
            depth_held: false,
        }
    }

    /// The request sent at `psn` and not yet answered, if any.
    pub(crate) fn unanswered(&self, psn: u32) -> Option<&InFlight> {
        self.inflight.iter().find(|f| f.psn == psn && f.state == Fs::Sent)
    }

    /// The WR just popped from the send ring into `wr` (left empty), as sent at `now` under
    /// the QP's next PSN (a WR's PSN is its send-ring position): not yet admitted, which
    /// sets its opcode and length.
    #[inline]
    pub(crate) fn number_popped(&mut self, wr: &mut SqEntry, now: Instant) -> InFlight {
        let psn = self.next_psn;
        self.next_psn = psn.wrapping_add(1);
        InFlight::new(psn, std::mem::take(wr), WrOpcode::RdmaWrite, Fs::Sent, now)
    }
}

/// Frames built under the QP's lock and written after it is released (a reader waiting for
/// the lock must never wait for a full socket).
#[derive(Default)]
pub(crate) struct Outbox {
    pub(crate) items: Vec<Out>,
    pub(crate) cur: Vec<u8>,
}

pub(crate) enum Out {
    /// Small frames, batched.
    Bytes(Vec<u8>),
    /// A frame whose data is sent straight from registered memory.
    Region(FrameHeader, Arc<MappedMr>, usize, usize),
}

impl Outbox {
    pub(crate) fn push_big(&mut self, o: Out) {
        if !self.cur.is_empty() {
            self.items.push(Out::Bytes(std::mem::take(&mut self.cur)));
        }
        self.items.push(o);
    }
    pub(crate) fn finish(mut self) -> Vec<Out> {
        if !self.cur.is_empty() {
            self.items.push(Out::Bytes(std::mem::take(&mut self.cur)));
        }
        self.items
    }
}

/// How soon a QP is pumped again when its MR's owner's memory did not answer
/// (`mr::NotNow`).
pub(crate) const DATA_RETRY: Duration = Duration::from_micros(200);

/// From this many RNR NAKs in a row, a request is resent alone (see [`ReqState::probe`]).
pub(crate) const RNR_PROBE_AFTER: u32 = 2;

/// Most READs and atomics a QP has outstanding (its initiator depth: the `max_rd_atomic`
/// the library allows at most, and sets when it connects a QP).
pub(crate) const MAX_RD_ATOMIC: usize = 16;

/// "Forever" for a WR to a gone peer with timeout 0 (an `Instant` this far ahead cannot
/// overflow).
const GONE_FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

impl MedQp {
    /// Runs the send side: flushes after errors, resends after RNR waits, sends new WRs.
    /// Only the doorbell thread calls it, so a QP's requests leave in PSN order (on a lane,
    /// only while the engine holds the QP's send side).
    /// It sends at most `budget` of new WRs (the scheduler's grant) and records there what
    /// it sent.
    pub(crate) fn pump(&self, e: &Engine, budget: &mut Budget) {
        if self.detached.load(Ordering::Acquire) {
            return;
        }
        if self.lane && !self.acquire_send_side() {
            // The client is writing a request: it rings when it is done.
            return;
        }
        // (Not after a pump that did not run: a frame the client left unfinished may wait.)
        if self.pump_sends(e, budget) && self.lane {
            self.release_send_side_if_clean(e);
        }
    }

    /// Whether it ran (it leaves the QP to the reader streaming a READ response into it).
    pub(crate) fn pump_sends(&self, e: &Engine, budget: &mut Budget) -> bool {
        let mut out = Outbox::default();
        {
            let mut guard = match self.req.try_lock() {
                Some(g) => g,
                None if self.defer_while_receiving() => return false,
                None => self.req.lock(),
            };
            self.pump_locked(e, &mut guard, &mut out, budget);
        }
        for o in out.finish() {
            trace::record(trace::Stage::SendStart, self.qpn, 0);
            let r = match o {
                Out::Bytes(b) => self.conn.send_raw(b),
                Out::Region(h, mr, off, len) => self.conn.send_mr(&h, &mr, off, len),
            };
            trace::record(trace::Stage::SendEnd, self.qpn, 0);
            if let Err(err) = r {
                // The reader of this connection sees it close and fails the peer's QPs.
                log::warn!("engine: QP {}: send failed: {err}", self.qpn);
                self.conn.shutdown();
                return true;
            }
        }
        true
    }

    pub(crate) fn pump_locked(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox, budget: &mut Budget) {
        self.adopt(e, st);
        self.take_unsent(st);
        self.pump_state(e, st, out, budget);
        if self.frames_owed.load(Ordering::Relaxed) {
            // (Set when frames were left owed: what is left of them now.)
            let (mut any, mut begun) = (false, false);
            for f in st.inflight.iter().filter(|f| f.state == Fs::Sent) {
                let Some(n) = f.next_byte else { continue };
                any = true;
                // (A resumed message starts afresh: its bytes left the wire's account.)
                begun |= n > 0 && !f.resuming();
            }
            self.frames_owed.store(any, Ordering::Release);
            self.segments_owed.store(begun, Ordering::Release);
        }
        if self.lane {
            // What the engine took is claimed: the client sends only after it.
            self.chan_ctl.store_u64(ring::MED_CLAIMED, self.sq.head_pos()).ok();
            // (Pumped with the side the engine keeps while held: the client claims nothing
            // more, see `adopt`.)
            if self.lane_held.load(Ordering::Acquire) {
                self.claims_frozen.store(true, Ordering::Release);
            }
        }
    }

    pub(crate) fn pump_state(&self, e: &Engine, st: &mut ReqState, out: &mut Outbox, budget: &mut Budget) {
        let owner = self.owner_state();
        if st.errored || self.link_down.load(Ordering::Acquire) || owner == Some(QpState::Err) {
            if st.unfinished.take().is_some_and(|(_, sent, _)| sent > 0) {
                // A frame the client cut is never finished now: the lane ends, rather than
                // leave the peer's responder waiting for the rest of it.
                self.conn.shutdown();
            }
            self.flush(st);
            if owner == Some(QpState::Err) {
                // (Not waited for: a busy responder meets the state at its next request.)
                if let Some(mut rs) = self.resp.try_lock() {
                    crate::engine::responder::flush_srq_receive(self, &mut rs);
                }
            }
            return;
        }
        if let Some(t) = st.data_wait {
            if Instant::now() < t {
                return;
            }
            st.data_wait = None;
        }
        if st.atomics_owed {
            self.store_atomic_results(e, st);
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
        if !self.finish_unsent(e, st, out) {
            return;
        }
        let now = Instant::now();
        if let Some(t) = st.wait_until {
            if now < t {
                return;
            }
            st.wait_until = None;
            // (Nothing is resent to a peer QP that is gone: no answer would come.)
            if let Some(from) = st.resend_from.take().filter(|_| !self.peer_gone.load(Ordering::Acquire)) {
                let alone = st.unanswered(from).is_some_and(|f| f.rnr_tries >= RNR_PROBE_AFTER);
                self.resend(st, from, alone);
            }
        }
        if !self.send_owed(e, out, st, budget) {
            return;
        }
        if let Some(p) = st.probe {
            let unanswered = st.unanswered(p).is_some();
            let gone = self.peer_gone.load(Ordering::Acquire);
            if unanswered && !gone {
                // Nothing after it would be executed yet.
                return;
            }
            st.probe = None;
            if !unanswered && !gone {
                self.resend(st, p.wrapping_add(1), false);
                if !self.send_owed(e, out, st, budget) {
                    return;
                }
            }
        }
        if self.peer_gone.load(Ordering::Acquire) && self.wait_out_gone_peer(e, st, now) {
            return;
        }
        let mut wr = SqEntry::default();
        // One doorbell thread serves every QP of the host: a QP gets the budget the scheduler
        // grants it this round (its vNIC's fair share, its caps), then the thread serves the
        // others (at least one WR goes on any grant).
        while !st.stop {
            if !budget.allows_more() {
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
            if self.reads_at_depth(st) {
                // (Pumped again when one completes: `retire_and_kick`.)
                st.depth_held = true;
                break;
            }
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                break;
            }
            let mut f = st.number_popped(&mut wr, now);
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
                    f.next_byte = Some(0);
                    if !self.send_some(e, out, &mut f, token, budget) {
                        self.wait_for_data(e, st);
                    }
                    if f.next_byte.is_some() {
                        // Its other segments go first, in later pumps.
                        self.frames_owed.store(true, Ordering::Release);
                        st.inflight.push_back(f);
                        break;
                    }
                }
            }
            st.inflight.push_back(f);
        }
        self.retire(st);
    }

    /// Whether the next WR is a READ or an atomic and [`MAX_RD_ATOMIC`] of those are
    /// outstanding already: it waits in the send ring (with every WR behind it), as a
    /// NIC's requester holds a READ beyond its initiator depth. A responder takes that many
    /// large READs of a QP at a time (`ReadGrants`) and answers one more "not ready".
    pub(crate) fn reads_at_depth(&self, st: &ReqState) -> bool {
        let is_read = |op: WrOpcode| matches!(op, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
        // (Cheap while fewer WRs than that are in flight at all: the latency path.)
        if st.inflight.len() < MAX_RD_ATOMIC {
            return false;
        }
        let next = self.sq.peek(self.sq.head_pos()).and_then(|(_, op)| WrOpcode::from_u32(op));
        next.is_some_and(is_read) && st.inflight.iter().filter(|f| f.state == Fs::Sent && is_read(f.opcode)).count() >= MAX_RD_ATOMIC
    }

    /// Stores the results of atomics answered while their buffers' memory did not answer.
    fn store_atomic_results(&self, e: &Engine, st: &mut ReqState) {
        let mut owed = false;
        for f in st.inflight.iter_mut().filter(|f| f.state == Fs::Sent && f.atomic_owed.is_some()) {
            match self.store_atomic_result(e, f) {
                Some(status) => {
                    f.state = Fs::Done(status);
                    st.progressed = true;
                }
                None => owed = true,
            }
        }
        st.atomics_owed = owed;
        if owed {
            self.wait_for_data(e, st);
        }
    }

    /// Writes atomic `f`'s result (its response in, `f.atomic_owed`) into its buffer: its
    /// status, or `None` while that memory does not answer (`mr::NotNow`: the caller has the
    /// QP pumped again, [`MedQp::wait_for_data`], to collect the write that went on).
    pub(crate) fn store_atomic_result(&self, e: &Engine, f: &mut InFlight) -> Option<WcStatus> {
        let value = f.atomic_owed?;
        let s = f.wr.sges[0];
        let status = match self.local_span(e, s.lkey, s.addr, 8, Need::LocalWrite) {
            Ok((mr, off)) => match mr.write_for(self.as_requester(f.psn), off, &value.to_ne_bytes()) {
                Err(NotNow) => return None,
                Ok(Ok(())) => WcStatus::Success,
                Ok(Err(_)) => WcStatus::LocProtErr,
            },
            Err(st) => st,
        };
        f.atomic_owed = None;
        Some(status)
    }

    /// Counts the data of `f` from its byte `from` on (a WRITE or SEND whose first frame
    /// from there was just queued: the rest of its segments are committed with it) in the
    /// bytes the host's connections hold, until it is retired or NAKed.
    fn count_on_wire(&self, f: &mut InFlight, from: u32) {
        if f.on_wire == 0 && matches!(f.opcode, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::Send | WrOpcode::SendWithImm) {
            f.on_wire = f.len.saturating_sub(from);
            self.wire_bytes.fetch_add(u64::from(f.on_wire), Ordering::Relaxed);
        }
    }

    /// Sends what is owed of WRs sent before, in PSN order: the rest of a large one's
    /// segments, resends. Within `budget`, but on a lane all of it (its client sends only
    /// after the engine). Whether all of it went.
    fn send_owed(&self, e: &Engine, out: &mut Outbox, st: &mut ReqState, budget: &mut Budget) -> bool {
        if !self.frames_owed.load(Ordering::Relaxed) {
            return true;
        }
        let mut stalled = false;
        for f in st.inflight.iter_mut().filter(|f| f.state == Fs::Sent && f.next_byte.is_some()) {
            // (A budget of bytes but no WRs continues WRs begun, starts none: see
            // `Pumpable::owes_segments`.)
            let starts = f.next_byte == Some(0) || f.resuming();
            if !self.lane && (budget.bytes == 0 || (starts && budget.wrs == 0)) {
                return false;
            }
            stalled = !self.send_some(e, out, f, None, budget);
            if f.next_byte.is_some() {
                break;
            }
        }
        if stalled {
            self.wait_for_data(e, st);
        }
        !stalled && st.inflight.iter().all(|f| f.state != Fs::Sent || f.next_byte.is_none())
    }

    /// Queues frames of `f` from its `next_byte` on (see [`MedQp::queue_frames`]) and
    /// charges them to `budget`. False if it stopped for data a copied MR's owner's memory
    /// did not give now (see [`MedQp::wait_for_data`]).
    fn send_some(&self, e: &Engine, out: &mut Outbox, f: &mut InFlight, token: Option<ring::AckToken>, budget: &mut Budget) -> bool {
        let from = f.next_byte.unwrap_or(0);
        let starts = from == 0 || f.resuming();
        let (n, rest, stalled) = self.queue_frames(e, out, f, from, token, budget.bytes);
        if n > 0 || !stalled {
            // (From where a "not ready" stopped it, it starts again as a new WR would: its
            // rest is committed to the wire again, and charged as a WR.)
            budget.spend_part(n, starts);
            if starts {
                self.count_on_wire(f, from);
            }
        }
        f.next_byte = rest;
        !stalled
    }

    /// A frame's data is in a copied MR whose owner's memory did not give it now
    /// (`mr::NotNow`; the read goes on on its agent): the QP sends nothing more until it is
    /// pumped again on a timer, and then collects it. The doorbell thread, which serves every
    /// vNIC, never waits for that memory.
    pub(crate) fn wait_for_data(&self, e: &Engine, st: &mut ReqState) {
        if st.data_wait.is_some() {
            // (Its timer is set.)
            return;
        }
        let at = Instant::now() + DATA_RETRY;
        st.data_wait = Some(at);
        self.frames_owed.store(true, Ordering::Release);
        e.add_timer(at, self.qpn);
    }

    /// The peer QP is gone. Like a NIC whose retries go unanswered, the oldest unacknowledged
    /// WR fails RETRY_EXC_ERR once the QP's retries are spent (timeout × (retry_cnt + 1) after
    /// it was first sent; never with timeout 0), not at once: a ping-pong peer that sent one
    /// message too many and exits within that time finishes cleanly, as on hardware. Until
    /// then the pump sleeps on a timer; returns whether it waits.
    pub(crate) fn wait_out_gone_peer(&self, e: &Engine, st: &mut ReqState, now: Instant) -> bool {
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
    pub(crate) fn admit(&self, e: &Engine, f: &mut InFlight) -> Result<(), WcStatus> {
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

    pub(crate) fn header(&self, f: &InFlight) -> FrameHeader {
        FrameHeader::request(f.opcode, &f.wr, f.psn, self.qpn, self.remote_qpn, f.len)
    }

    /// Resends every request still unanswered from PSN `from` on, or (`alone`) only the one
    /// at `from`, as a probe: a request the responder answered RNR several times in a row is
    /// likely to be refused again, and it drops every later one until it executes this one,
    /// so resending a whole send queue behind it at each RNR wait (32 4-KiB SENDs on each
    /// of 8 QPs every millisecond in an RNR storm: a gigabyte a second) moved bytes for
    /// nothing. They are marked; [`MedQp::send_owed`] sends them, charged to the vNIC's
    /// fair share as new ones are (or a QP that only resends, in an RNR storm where the peer
    /// posts no receive, would hold the scheduler's virtual-time floor still and every other
    /// vNIC of the host would wait for it).
    fn resend(&self, st: &mut ReqState, from: u32, alone: bool) {
        for f in st.inflight.iter_mut().filter(|f| f.state == Fs::Sent && f.psn.wrapping_sub(from) as i32 >= 0) {
            if f.atomic_owed.is_some() {
                // (Done: only its result waits to be stored.)
                continue;
            }
            // (A message the responder stopped at a segment goes again from that one; a READ
            // asks for the rest of its response.)
            f.next_byte = Some(f.resend_from());
            self.meter.retransmitted(1);
            if alone {
                st.probe = Some(from);
                break;
            }
        }
        self.frames_owed.store(true, Ordering::Release);
    }
}
