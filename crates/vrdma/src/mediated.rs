//! The library's side of a *mediated* QP (DESIGN §3): its peer is on another host (or policy
//! puts vrdmad in the path), so `post_send` writes each WR into a send ring that vrdmad's
//! engine executes, and the send CQ polls the engine's completions from the channel's
//! completion ring. Receives are unchanged: the engine takes them from the QP's receive
//! ring and writes their completions into its inbound ring, as a local peer would.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use vrdma_abi::control::Reply;
use vrdma_abi::ring::{self, CompEntry, CompRing, MediatedLayout, SqEntry, SqRing, SqRingLayout};
use vrdma_abi::shm::{MemRegion, SharedMapping};
use vrdma_abi::verbs::send_flags;

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
}

impl MedChannel {
    /// Maps the channel vrdmad created for `qpn` (reply to `ConnectQp`).
    pub(crate) fn from_reply(
        qpn: u32,
        qp: std::sync::Weak<crate::qp::QpInner>,
        reply: &Reply,
        fds: Vec<OwnedFd>,
    ) -> Result<MedChannel, Error> {
        let op = "modify_qp(RTR)";
        let &Reply::ConnectedMediated { sq_entries, max_sge, max_inline, comp_entries } = reply else {
            return Err(Error::UnexpectedReply { op });
        };
        let [region_fd, doorbell]: [OwnedFd; 2] = fds.try_into().map_err(|_| Error::UnexpectedReply { op })?;
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
        let shared = std::sync::Arc::new(MedShared { _map: map, ctl, comp, doorbell, qpn, qp });
        Ok(MedChannel { shared, sq, head_cache: 0, scratch: SqEntry::default() })
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
    /// application may reuse its buffer as soon as `post_send` returns).
    pub(crate) fn post(&mut self, wr: &SendWr<'_>, signal_all: bool) -> Result<bool, Error> {
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
        let pushed = self.sq.push(e, &mut self.head_cache).map_err(|source| Error::Shm { op: "post_send", source })?;
        if pushed {
            self.shared.ring_if_wanted();
        }
        Ok(pushed)
    }
}
