//! A mediated QP in the engine: the client's rings mapped into the daemon, and the
//! requester's side (send ring → frames, responses → completions, RNR and timeouts, flush).

mod attach;

pub use attach::AttachError;
mod completion;
mod framing;
mod meter;
mod owed_ack;
mod read_grants;
pub(crate) mod requester;
mod response;
mod views;

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use vrdma_abi::control::QpCaps;
use vrdma_abi::ring::{self, CompEntry, CompRing, MediatedLayout, SqRing, SqRingLayout};
use vrdma_abi::shm::{self, MemRegion, SharedMapping, ShmError};
use vrdma_abi::verbs::{QpState, WcStatus};
use vrdma_core::access::{check, Need};

use super::connection::{Conn, Parked};
use super::lane::tokens::TokenState;
use super::mr::Asker;
use super::{Engine, MappedMr};

pub(crate) use meter::EngineMeter;
pub(crate) use owed_ack::{Partial, RespState, ACK_BYTES, ACK_EVERY, OWED};
#[cfg(test)]
pub(crate) use read_grants::MAX_READS_PER_QP;
pub(crate) use read_grants::{Grant, ReadGrants, Sender as ReadSender};
pub(crate) use requester::{Fs, InFlight, Outbox, ReqState};
pub(crate) use response::handle_response;
pub use views::RecvSideSetup;
pub(crate) use views::{CqView, RecvSide};

/// What the registry hands the engine to mediate a QP.
pub struct MedQpSetup {
    /// The QP.
    pub qpn: u32,
    /// Its client session.
    pub session: u64,
    /// Its PD.
    pub pd: u32,
    /// Its vNIC (whose QoS policy its sends are scheduled by).
    pub vnic: String,
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

/// A mediated QP.
pub(crate) struct MedQp {
    pub(crate) qpn: u32,
    /// Its requester's stream of accesses to copied MRs (see `mr::Asker`).
    req_stream: u64,
    /// Its responder's, new at each reset of the responder (PSNs start again: a result kept
    /// for a request of before must not be taken by one of after).
    resp_stream: AtomicU64,
    pub(crate) session: u64,
    pub(crate) pd: u32,
    /// Its vNIC (the scheduler's unit of fair sharing and caps).
    pub(crate) vnic: String,
    pub(crate) remote: SocketAddr,
    pub(crate) remote_qpn: u32,
    /// Boot id of the peer daemon this QP talks to.
    pub(crate) peer_boot: u64,
    pub(crate) doorbell: Arc<OwnedFd>,
    pub(crate) conn: Arc<Conn>,
    /// `conn` is the QP's lane (its own connection, on which the client also writes requests
    /// while it holds the send side, `ring::MED_SEND_SIDE`), not a shared host connection.
    pub(crate) lane: bool,
    /// The engine keeps the lane's send side (the client writes nothing on it): its vNIC or
    /// tenant has a QoS policy, which only the scheduler applies (`Engine::set_qos`).
    pub(crate) lane_held: AtomicBool,
    /// Held, and the engine has pumped since it took the side: from here on, any WR claimed
    /// beyond what the engine took is a client writing on a lane it does not hold.
    pub(crate) claims_frozen: AtomicBool,
    pub(crate) recv: RecvSide,
    pub(crate) send_cq: CqView,
    pub(crate) recv_cq: CqView,
    pub(crate) _chan: SharedMapping,
    pub(crate) chan_ctl: MemRegion,
    pub(crate) sq: SqRing,
    pub(crate) scomp: CompRing,
    pub(crate) scomp_cap: usize,
    pub(crate) req: Mutex<ReqState>,
    pub(crate) resp: Mutex<RespState>,
    pub(crate) peer_gone: AtomicBool,
    /// Set by [`Engine::detach`] under `recv_gate`.
    pub(crate) detached: AtomicBool,
    /// Held while a receive completion is pushed and while the QP is detached, so that none
    /// is pushed once `Engine::detach` returned: the owner's library empties its completion
    /// ring after a reset's detach, and a completion pushed later (by a reader that held
    /// the QP across the detach) would be taken for one of the QP's next connection. Held
    /// for the push alone, never across I/O.
    pub(crate) recv_gate: parking_lot::Mutex<()>,
    pub(crate) link_down: AtomicBool,
    pub(crate) wants_pump: AtomicBool,
    /// Frames of WRs in flight may still be sent (`InFlight::next_byte`; set under `req` when
    /// some are left, recomputed after each pump: the rest of a large WR's segments, resends
    /// the budget held back): the doorbell thread pumps the QP again though its send ring
    /// may be empty.
    pub(crate) frames_owed: AtomicBool,
    /// Of those, the rest of a WR whose first segment went (see `Pumpable::owes_segments`).
    pub(crate) segments_owed: AtomicBool,
    /// The reader is streaming a READ response into local memory under `req`: the doorbell
    /// thread, which serves every QP, must not wait for that lock (a large response on a
    /// slow link would stall every other QP's sends); it defers this QP's pump instead.
    pub(crate) receiving: AtomicBool,
    /// The doorbell thread skipped a pump while `receiving`: the reader kicks it when done.
    pub(crate) pump_deferred: AtomicBool,
    /// The responder's deferred ACK: `OWED | psn` of the last SEND/WRITE it executed and has
    /// not acknowledged, 0 if none. The next request of this QP carries it ([`vrdma_abi::wire::F_ACKS`]);
    /// if none goes out soon, the connection's reader sends it ([`MedQp::take_owed_ack`]).
    pub(crate) ack_owed: AtomicU64,
    /// The secret of this QP's lane (shared with the peer daemon only): the key of the ACK
    /// tokens that acknowledge its requests ([`MedQp::take_ack_token`]).
    pub(crate) lane_key: Option<[u64; 2]>,
    /// The counter of the last ACK token taken for this QP's requests (each counts once).
    pub(crate) tokens_taken: AtomicU64,
    /// How many ACK tokens acknowledged its requests (logged when it goes).
    pub(crate) tokens_applied: AtomicU64,
    /// What the engine executed for this QP (reported by `vrdma vnic stats` and /metrics).
    pub(crate) meter: Arc<EngineMeter>,
    /// Data bytes of WRITEs and SENDs the engine sent for it and not yet retired: what it
    /// has queued in the host's connections (the scheduler bounds the host's total).
    pub(crate) wire_bytes: AtomicU64,
    /// Large READs its responder answers, whose parts the scheduler lets go.
    pub(crate) reads: ReadGrants,
}

/// Data bytes up to which a frame is copied into the batch buffer rather than sent on its own.
pub(crate) const BATCH_DATA_MAX: usize = 4096;

/// The pieces of data bytes `[from, from + len)` of a WR's scatter/gather list, in order:
/// each element's part of that range as (address, key, bytes); empty elements skipped.
pub(crate) fn sge_pieces(sges: &[ring::Sge], from: u64, len: u64) -> impl Iterator<Item = (u64, u32, u64)> + '_ {
    let (mut skip, mut left) = (from, len);
    sges.iter()
        .filter(|s| s.length > 0)
        .map_while(move |s| {
            if left == 0 {
                return None;
            }
            let room = u64::from(s.length);
            if skip >= room {
                skip -= room;
                return Some(None);
            }
            let n = (room - skip).min(left);
            let piece = (s.addr + skip, s.lkey, n);
            skip = 0;
            left -= n;
            Some(Some(piece))
        })
        .flatten()
}

impl MedQp {
    pub(crate) fn new(
        s: MedQpSetup,
        doorbell: Arc<OwnedFd>,
        conn: Arc<Conn>,
        lane_key: Option<[u64; 2]>,
        peer_boot: u64,
    ) -> Result<(Arc<MedQp>, Arc<OwnedFd>, MediatedLayout), ShmError> {
        let lane = lane_key.is_some();
        let recv = RecvSide::map(s.recv)?;
        let sq_layout =
            SqRingLayout::new(s.caps.max_send_wr.max(1) as usize, s.caps.max_send_sge.max(1) as usize, s.caps.max_inline_data as usize);
        let ml = MediatedLayout::new(sq_layout);
        let fd = shm::create_memfd("vrdma-mediated", ml.size(), true)?;
        let chan = SharedMapping::map_sealed(fd.as_fd(), ml.size(), true)?;
        let r = *chan.region();
        let sq = SqRing::new(r.subregion(ml.sq_offset(), ml.sq.size())?, ml.sq)?;
        let scomp = CompRing::new(r.subregion(ml.comp_offset(), ml.comp.size())?, ml.comp)?;
        let chan_ctl = r.subregion(0, ring::PAGE)?;
        chan_ctl.store_u64(ring::MED_DOORBELL_WANTED, 1)?;
        let q = Arc::new(MedQp {
            qpn: s.qpn,
            req_stream: crate::engine::mr::new_stream(),
            resp_stream: AtomicU64::new(crate::engine::mr::new_stream()),
            session: s.session,
            pd: s.pd,
            vnic: s.vnic,
            remote: s.remote,
            remote_qpn: s.remote_qpn,
            peer_boot,
            doorbell,
            conn,
            lane,
            lane_held: AtomicBool::new(false),
            claims_frozen: AtomicBool::new(false),
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
                partial: None,
                resets: 0,
            }),
            peer_gone: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            recv_gate: parking_lot::Mutex::new(()),
            link_down: AtomicBool::new(false),
            wants_pump: AtomicBool::new(false),
            frames_owed: AtomicBool::new(false),
            segments_owed: AtomicBool::new(false),
            receiving: AtomicBool::new(false),
            pump_deferred: AtomicBool::new(false),
            ack_owed: AtomicU64::new(0),
            lane_key,
            tokens_taken: AtomicU64::new(0),
            tokens_applied: AtomicU64::new(0),
            meter: Arc::default(),
            wire_bytes: AtomicU64::new(0),
            reads: ReadGrants::default(),
        });
        Ok((q, Arc::new(fd), ml))
    }

    /// The responder starts again (a reset): its accesses from now on are a new stream.
    pub(crate) fn new_responder_stream(&self) {
        self.resp_stream.store(crate::engine::mr::new_stream(), Ordering::Release);
    }

    /// Its requester's request `psn`, as it accesses MRs.
    pub(crate) fn as_requester(&self, psn: u32) -> Asker {
        Asker { stream: self.req_stream, psn }
    }

    /// Its responder executing the peer's request `psn`, as it accesses MRs.
    pub(crate) fn as_responder(&self, psn: u32) -> Asker {
        Asker { stream: self.resp_stream.load(Ordering::Acquire), psn }
    }

    /// The owner's QP state.
    pub(crate) fn owner_state(&self) -> Option<QpState> {
        self.recv.owner_state()
    }

    /// The owner's RNR timer code (answered in RNR NAKs).
    pub(crate) fn min_rnr_timer(&self) -> u8 {
        self.recv.qp_map.region().load_u64(ring::QP_RESERVED).unwrap_or(12) as u8
    }

    pub(crate) fn retry_attrs(&self) -> (u8, u8, u8) {
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
    /// Not once the QP is detached (see `recv_gate`).
    pub(crate) fn complete_recv(&self, rs: &mut RespState, ce: &CompEntry) {
        let pushed = {
            let _gate = self.recv_gate.lock();
            !self.detached.load(Ordering::Acquire) && self.recv.inbound.push_cached(ce, &mut rs.inbound_head_cache).unwrap_or(false)
        };
        if pushed {
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
        if self.reads.wanting() && !self.detached.load(Ordering::Acquire) {
            return true;
        }
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
            // (Frames owed of WRs in flight go whatever the completion queue's room.)
            Some(st) => {
                st.wait_until.is_none()
                    && st.data_wait.is_none()
                    && (self.frames_owed.load(Ordering::Acquire) || (st.probe.is_none() && !self.stalled(&st) && !self.reads_at_depth(&st)))
            }
            // Held briefly by a reader (work may follow), or for a whole READ response (the
            // reader kicks us when it is done).
            None => !self.defer_while_receiving(),
        }
    }

    /// With `req` held by someone else: whether that is the reader streaming a READ
    /// response, in which case the pump is left to the reader's kick when it finishes.
    pub(crate) fn defer_while_receiving(&self) -> bool {
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
    pub(crate) fn may_park(&self) -> bool {
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
    pub(crate) fn unpolled(&self) -> usize {
        let (head, tail) = self.scomp.positions();
        tail.wrapping_sub(head) as usize
    }

    pub(crate) fn stalled(&self, st: &ReqState) -> bool {
        st.inflight.len() + self.unpolled() >= self.scomp_cap
    }

    /// Whether `c` is this QP's connection.
    pub(crate) fn uses_conn(&self, c: &Arc<Conn>) -> bool {
        Arc::ptr_eq(&self.conn, c)
    }

    /// WRs wait for the engine to send them (or frames of WRs it sent in part).
    pub(crate) fn has_unsent(&self) -> bool {
        if self.frames_owed.load(Ordering::Acquire) {
            return true;
        }
        if self.lane {
            self.unclaimed()
        } else {
            self.sq.has_entries()
        }
    }
}
