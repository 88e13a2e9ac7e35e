//! The library's side of a *mediated* QP: its peer is on another host (or policy
//! puts vrdmad in the path), so `post_send` writes each WR into a send ring that vrdmad's
//! engine executes, and the send CQ polls the engine's completions from the channel's
//! completion ring. Receives are unchanged: the engine takes them from the QP's receive
//! ring and writes their completions into its inbound ring, as a local peer would.
//!
//! With a *lane* (a TCP connection of the QP's own to the peer's daemon, given by vrdmad),
//! a small WR is also sent from here, in `post_send`, while the engine does not need the
//! QP's send side: the frame goes straight onto the lane, with no engine wakeup on the way
//! out; the engine reads the responses and completes the WR as if it had sent it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use vrdma_abi::control::Reply;
use vrdma_abi::ring::{self, AckToken, CompEntry, CompRing, MediatedLayout, SqEntry, SqRing, SqRingLayout};
use vrdma_abi::shm::{MemRegion, SharedMapping};
use vrdma_abi::verbs::{send_flags, WrOpcode};
use vrdma_abi::wire::{FrameHeader, HEADER_LEN};

use crate::error::Error;
use crate::qp::SendWr;

/// The shared half: what the send CQ's poller reads (it is the completion ring's only
/// consumer, under the CQ's list lock).
pub(crate) struct MedShared {
    _map: SharedMapping,
    ctl: MemRegion,
    comp: CompRing,
    doorbell: OwnedFd,
    pub(crate) qpn: u32,
    /// The QP, so that polling a fatal completion moves it to ERR before the poll returns.
    pub(crate) qp: std::sync::Weak<crate::qp::QpInner>,
}

impl MedShared {
    /// Tells the engine there is work (only when it sleeps and asked for a doorbell).
    pub(crate) fn ring_if_wanted(&self) {
        let Ok(w) = self.ctl.atomic_u64(ring::MED_DOORBELL_WANTED) else { return };
        std::sync::atomic::fence(Ordering::SeqCst);
        if w.load(Ordering::SeqCst) != 0 && w.swap(0, Ordering::SeqCst) != 0 {
            // SAFETY: no arguments; returns a CPU number or -1.
            let cpu = unsafe { libc::sched_getcpu() };
            self.ctl.store_u64(ring::MED_RINGER_CPU, u64::try_from(cpu).map_or(0, |c| c + 1)).ok();
            self.ring();
        }
    }

    /// Wakes the engine unconditionally (state changes it must act on, e.g. ERR).
    pub(crate) fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writing a live u64 to an eventfd we hold.
        unsafe { libc::write(self.doorbell.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
    }

    /// Takes the oldest send completion.
    pub(crate) fn pop(&self) -> Option<CompEntry> {
        self.comp.pop().ok().flatten()
    }

    /// How many send-ring WRs the engine retired (see `MED_RETIRED`).
    pub(crate) fn retired(&self) -> u64 {
        self.ctl.load_u64(ring::MED_RETIRED).unwrap_or(0)
    }

    /// After polling: if the engine stalled on a full completion ring, wake it.
    pub(crate) fn after_poll(&self) {
        if let Ok(w) = self.ctl.atomic_u64(ring::MED_STALLED) {
            if w.load(Ordering::Acquire) != 0 && w.swap(0, Ordering::AcqRel) != 0 {
                self.ring();
            }
        }
    }
}

/// The posting half, owned by the QP (under its lock).
pub(crate) struct MedChannel {
    pub(crate) shared: std::sync::Arc<MedShared>,
    sq: SqRing,
    head_cache: u64,
    scratch: SqEntry,
    /// The QP's lane, if vrdmad gave it one, and the peer's QPN (frames name it).
    lane: Option<OwnedFd>,
    remote_qpn: u32,
    comp_cap: u64,
    /// The gather list of the frame being sent (kept to avoid an allocation per WR).
    iov: Vec<libc::iovec>,
    /// WRs sent on the lane from here.
    pub(crate) lane_sends: u64,
    /// The counter of the last ACK token carried (each goes once).
    last_token: u64,
    /// A sealed lane's key (vrdmad's daemons seal every frame between them: see
    /// `vrdma_abi::seal`), and the records of the frame being sent (kept to avoid an
    /// allocation per WR).
    seal: Option<Box<vrdma_abi::seal::SealKey>>,
    sealed: Vec<u8>,
}

// SAFETY: `iov` is scratch space, only filled and used within `send_on_lane` (its pointers
// never outlive the call); everything else is Send already.
unsafe impl Send for MedChannel {}

/// Largest data of a WR the client sends on its lane itself; larger ones are the engine's,
/// which streams them from memory without ever blocking a `post_send`.
pub(crate) use vrdma_abi::ring::LANE_DATA_MAX;

impl MedChannel {
    /// Maps the channel vrdmad created for `qpn` (reply to `ConnectQp`).
    pub(crate) fn from_reply(
        qpn: u32,
        remote_qpn: u32,
        qp: std::sync::Weak<crate::qp::QpInner>,
        reply: &Reply,
        fds: Vec<OwnedFd>,
    ) -> Result<MedChannel, Error> {
        let op = "modify_qp(RTR)";
        let &Reply::ConnectedMediated { sq_entries, max_sge, max_inline, comp_entries } = reply else {
            return Err(Error::UnexpectedReply { op });
        };
        if !(2..=3).contains(&fds.len()) {
            return Err(Error::UnexpectedReply { op });
        }
        let mut fds = fds.into_iter();
        let (Some(region_fd), Some(doorbell), lane) = (fds.next(), fds.next(), fds.next()) else {
            return Err(Error::UnexpectedReply { op });
        };
        if !sq_entries.is_power_of_two() || sq_entries > 1 << 16 || max_sge == 0 || max_sge > 64 || max_inline > 1 << 16 {
            return Err(Error::UnexpectedReply { op });
        }
        let layout = MediatedLayout::new(SqRingLayout::new(sq_entries as usize, max_sge as usize, max_inline as usize));
        if layout.comp.capacity != comp_entries as usize {
            return Err(Error::UnexpectedReply { op });
        }
        let shm_err = |source| Error::Shm { op, source };
        let map = SharedMapping::map_sealed(region_fd.as_fd(), layout.size(), true).map_err(shm_err)?;
        let r = *map.region();
        let sq = SqRing::new(r.subregion(layout.sq_offset(), layout.sq.size()).map_err(shm_err)?, layout.sq).map_err(shm_err)?;
        let comp = CompRing::new(r.subregion(layout.comp_offset(), layout.comp.size()).map_err(shm_err)?, layout.comp).map_err(shm_err)?;
        let ctl = r.subregion(0, ring::PAGE).map_err(shm_err)?;
        // A sealed lane: its key, which the daemon wrote before it handed over the lane.
        let seal = lane.as_ref().filter(|_| ctl.load_u64(ring::MED_LANE_SEAL).unwrap_or(0) == 1).map(|_| {
            let mut key = [0u8; vrdma_abi::seal::KEY_LEN];
            for (i, word) in key.chunks_exact_mut(8).enumerate() {
                word.copy_from_slice(&ctl.load_u64(ring::MED_LANE_SEAL + 8 * (i + 1)).unwrap_or(0).to_le_bytes());
            }
            Box::new(vrdma_abi::seal::SealKey::new(&key))
        });
        let shared = std::sync::Arc::new(MedShared { _map: map, ctl, comp, doorbell, qpn, qp });
        Ok(MedChannel {
            shared,
            sq,
            head_cache: 0,
            scratch: SqEntry::default(),
            lane,
            remote_qpn,
            comp_cap: u64::from(comp_entries),
            iov: Vec::new(),
            lane_sends: 0,
            last_token: 0,
            seal,
            sealed: Vec::new(),
        })
    }

    /// Whether the QP has a lane (see the module's documentation).
    pub(crate) fn has_lane(&self) -> bool {
        self.lane.is_some()
    }

    /// The WRs posted but not retired by the engine, oldest first: (wr_id, opcode).
    pub(crate) fn unretired(&self) -> Vec<(u64, u32)> {
        let tail = self.sq.tail_pos();
        let cap = self.sq.layout().capacity as u64;
        // The daemon wrote the retired count: never trust it beyond the ring's size.
        let from = self.shared.retired().max(tail.saturating_sub(cap)).min(tail);
        (from..tail).filter_map(|pos| self.sq.peek(pos)).collect()
    }

    /// Posts one WR; `Ok(false)` if the send ring is full. Inline data is copied now (the
    /// application may reuse its buffer as soon as `post_send` returns). `on_lane` (data
    /// length as [`FrameHeader::request`] takes it): the caller checked the WR's local
    /// access as the engine would, so it may be sent on the lane from here.
    pub(crate) fn post(&mut self, wr: &SendWr<'_>, signal_all: bool, on_lane: Option<u32>) -> Result<bool, Error> {
        let e = &mut self.scratch;
        e.wr_id = wr.wr_id;
        e.opcode = wr.opcode as u32;
        e.send_flags = wr.send_flags | if signal_all { send_flags::SIGNALED } else { 0 };
        e.imm_data = wr.imm_data;
        e.rkey = wr.rkey;
        e.remote_addr = wr.remote_addr;
        e.compare_add = wr.compare_add;
        e.swap = wr.swap;
        e.sges.clear();
        e.inline.clear();
        if wr.send_flags & send_flags::INLINE != 0 {
            for s in wr.sg_list.iter().filter(|s| s.length > 0) {
                // SAFETY: inline data pointers are valid during post_send (verbs contract).
                let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
                let at = e.inline.len();
                e.inline.resize(at + s.length as usize, 0);
                mem.read_into(0, &mut e.inline[at..]).map_err(|source| Error::Shm { op: "post_send", source })?;
            }
        } else {
            e.sges.extend_from_slice(wr.sg_list);
        }
        let pos = self.sq.tail_pos();
        let pushed = self.sq.push(e, &mut self.head_cache).map_err(|source| Error::Shm { op: "post_send", source })?;
        if pushed && !on_lane.is_some_and(|len| self.send_on_lane(pos, wr.opcode, len)) {
            self.shared.ring_if_wanted();
        }
        Ok(pushed)
    }

    /// Sends the WR just posted at send-ring position `pos` on the lane, if the send side is
    /// free and every earlier WR was claimed; whether it did. The engine takes it from the
    /// ring as sent (its PSN is `pos`) when its response comes.
    fn send_on_lane(&mut self, pos: u64, opcode: WrOpcode, len: u32) -> bool {
        let Some(lane) = self.lane.as_ref() else { return false };
        let ctl = self.shared.ctl;
        // Room for its completion: WRs not retired and completions not polled must fit the
        // completion ring, as the engine keeps them (else the engine waits for a poll).
        let (head, tail) = self.shared.comp.positions();
        let outstanding = (pos + 1).wrapping_sub(self.shared.retired());
        if outstanding.saturating_add(tail.wrapping_sub(head)) > self.comp_cap {
            return false;
        }
        let Ok(side) = ctl.atomic_u64(ring::MED_SEND_SIDE) else { return false };
        // The WR's publication before the side is looked at: an engine releasing the side
        // meanwhile then sees it unclaimed and sends it (the store-load pair with
        // `release_send_side_if_clean`).
        std::sync::atomic::fence(Ordering::SeqCst);
        if side.compare_exchange(ring::SEND_SIDE_FREE, ring::SEND_SIDE_CLIENT, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return false;
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if ctl.load_u64(ring::MED_ENGINE_WANTS).unwrap_or(1) != 0
            || ctl.load_u64(ring::MED_UNSENT).unwrap_or(1) != 0
            || ctl.load_u64(ring::MED_CLAIMED).unwrap_or(0) != pos
        {
            // The engine sends (earlier WRs, a retry, an error): give the side back, and wake
            // it, as it may have found the side taken by us a moment ago.
            side.store(ring::SEND_SIDE_FREE, Ordering::SeqCst);
            self.shared.ring();
            return false;
        }
        ctl.store_u64(ring::MED_CLAIMED, pos + 1).ok();
        let e = &self.scratch;
        let mut h = FrameHeader::request(opcode, e, pos as u32, self.shared.qpn, self.remote_qpn, len);
        let carries_data = matches!(opcode, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm);
        // The ACK our daemon deferred for the peer's requests, if it published one we have
        // not carried: the peer's daemon reads this frame anyway (a SEND's or WRITE's `arg1`
        // and `arg2` are free for it).
        // (Claimed as carried now: what the send below does not write of the frame, the
        // engine writes.)
        let token = if carries_data { AckToken::take_next(&ctl, self.last_token) } else { None };
        if let Some(t) = &token {
            h.carry(t);
            self.last_token = t.counter;
        }
        let h = h.encode();
        self.iov.clear();
        self.iov.push(libc::iovec { iov_base: h.as_ptr() as *mut libc::c_void, iov_len: HEADER_LEN });
        if carries_data && len > 0 {
            if e.send_flags & send_flags::INLINE != 0 {
                self.iov.push(libc::iovec { iov_base: e.inline.as_ptr() as *mut libc::c_void, iov_len: e.inline.len() });
            } else {
                for s in e.sges.iter().filter(|s| s.length > 0) {
                    self.iov.push(libc::iovec { iov_base: s.addr as *mut libc::c_void, iov_len: s.length as usize });
                }
            }
        }
        // A sealed lane: the frame goes as records sealed from the lane's sequence word,
        // which the side's holder advances (the engine seals with it too).
        let seq = ctl.load_u64(ring::MED_LANE_SEQ).unwrap_or(0);
        if let Some(key) = &self.seal {
            let len: usize = self.iov.iter().map(|v| v.iov_len).sum();
            self.sealed.clear();
            // The frame's pieces are read straight into the records, which are sealed there
            // (one copy of the bytes, then the cipher in place).
            let iov = &self.iov;
            let (mut piece, mut piece_at) = (0, 0);
            // (Cannot fail for a frame: sequence numbers run out after 2^64 records.)
            let next = key
                .seal_filled_at(seq, &mut self.sealed, len, |_, buf| {
                    let mut done = 0;
                    while done < buf.len() {
                        let v = &iov[piece];
                        let n = (v.iov_len - piece_at).min(buf.len() - done);
                        // SAFETY: as for the send below: the frame header above, the WR's
                        // inline copy, or gather elements the caller checked against this
                        // process's registered MRs, all readable now (a registered MR stays
                        // mapped while registered: the verbs contract).
                        let mem = unsafe { MemRegion::from_raw(v.iov_base.cast(), v.iov_len) };
                        let out = &mut buf[done..done + n];
                        if mem.read_into(piece_at, out).is_err() {
                            out.fill(0);
                        }
                        (done, piece_at) = (done + n, piece_at + n);
                        if piece_at == v.iov_len {
                            (piece, piece_at) = (piece + 1, 0);
                        }
                    }
                })
                .unwrap_or(seq);
            ctl.store_u64(ring::MED_LANE_SEQ, next).ok();
            self.iov.clear();
            self.iov.push(libc::iovec { iov_base: self.sealed.as_ptr() as *mut libc::c_void, iov_len: self.sealed.len() });
        }
        let total: usize = self.iov.iter().map(|v| v.iov_len).sum();
        // SAFETY: the iovecs describe the frame header above, the WR's inline copy, or
        // gather elements the caller checked against this process's registered MRs, or the
        // sealed records of those, all readable during the call (a bad address would be
        // EFAULT, not undefined behaviour).
        let sent = unsafe { vrdma_abi::shm::try_sendmsg(lane.as_fd(), &self.iov) };
        if !matches!(sent, Ok(n) if n == total) {
            // No room for all of it (the path is busy), or an error (which wrote nothing):
            // the engine writes the rest when there is room, from its backlog, and meets any
            // error itself (a lane that failed fails the QP, as a NIC whose link failed); a
            // post_send never waits for the network. (It wants the side now: woken below.)
            // The token the frame's header carries, for the engine to rebuild it alike.
            let t = token.unwrap_or_default();
            ctl.store_u64(ring::MED_UNSENT_ACK, t.counter).ok();
            ctl.store_u64(ring::MED_UNSENT_ACK + 8, u64::from(t.psn)).ok();
            ctl.store_u64(ring::MED_UNSENT_ACK + 16, t.mac).ok();
            ctl.store_u64(ring::MED_UNSENT_BYTES, sent.unwrap_or(0) as u64).ok();
            // (Sealed: the engine seals the frame again from this number, alike.)
            ctl.store_u64(ring::MED_UNSENT_SEQ, seq).ok();
            if let Ok(w) = ctl.atomic_u64(ring::MED_UNSENT) {
                w.store(pos + 1, Ordering::Release);
            }
            ctl.store_u64(ring::MED_ENGINE_WANTS, 1).ok();
        }
        side.store(ring::SEND_SIDE_FREE, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if ctl.load_u64(ring::MED_ENGINE_WANTS).unwrap_or(0) != 0 {
            self.shared.ring();
        }
        self.lane_sends += 1;
        true
    }
}
