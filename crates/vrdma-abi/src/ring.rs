//! Rings shared between processes on the direct data path, built on [`crate::shm`].
//!
//! * [`RecvRing`]: a bounded multi-consumer queue of receive WRs (Vyukov's per-slot sequence
//!   numbers). The QP (or SRQ) owner is the only producer; the connected peer's library
//!   consumes an entry when a SEND or WRITE_WITH_IMM arrives; the owner also consumes when it
//!   flushes. A slot can't be reused before its consumer has copied it out.
//! * [`CompRing`]: a single-producer single-consumer ring of inbound completions: the peer
//!   writes the completion of a receive it filled, the owner's CQ polls it.
//!
//! Every index read from shared memory is untrusted: it is masked, and loops are bounded, so
//! a misbehaving peer can corrupt only its own connection, never hang or crash us.

use crate::shm::{MemRegion, ShmError};
use std::sync::atomic::{AtomicU64, Ordering};

const LINE: usize = 64;
/// Size of a page in every layout (regions are page-multiples on all supported hosts).
pub const PAGE: usize = 4096;

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// One scatter/gather element as stored in a receive slot. `repr(C)`: the layout of
/// libibverbs' `struct ibv_sge`, so the drop-in passes applications' lists without copying.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Sge {
    /// Virtual address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the MR that holds it.
    pub lkey: u32,
}

/// A receive work request as carried in a [`RecvRing`] slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecvEntry {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// Scatter list (at most the ring's `max_sge`).
    pub sges: Vec<Sge>,
}

/// Byte layout of a [`RecvRing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvRingLayout {
    /// Number of slots (power of two).
    pub capacity: usize,
    /// Scatter elements per slot.
    pub max_sge: usize,
}

const SLOT_HEADER: usize = 24;
const SGE_SIZE: usize = 16;

impl RecvRingLayout {
    /// Layout for at least `min_entries` receives of up to `max_sge` elements.
    pub fn new(min_entries: usize, max_sge: usize) -> Self {
        // Two slots at least: with one, a slot's sequence number cannot tell full from free.
        RecvRingLayout { capacity: min_entries.max(2).next_power_of_two(), max_sge: max_sge.max(1) }
    }
    /// Layout of a QP's receive queue that may hold `max_wr` receives: twice as many slots.
    /// The owner never has more than `max_wr` outstanding (it counts them), so the slot it
    /// fills next was freed long before, not just now by the peer's core: with the ring
    /// exactly full, every post read a line the peer had written a moment earlier and
    /// stalled on it (about 0.1 us per ping-pong in ib_send_lat, whose 512 receives fill a
    /// 512-slot ring).
    pub fn with_headroom(max_wr: usize, max_sge: usize) -> Self {
        Self::new(max_wr.max(1).saturating_mul(2), max_sge)
    }
    fn slot_size(&self) -> usize {
        // Whole cache lines: a slot never shares a line with its neighbour.
        round_up(SLOT_HEADER + SGE_SIZE * self.max_sge, LINE)
    }
    /// Total bytes, a multiple of [`PAGE`].
    pub fn size(&self) -> usize {
        round_up(3 * LINE + self.capacity * self.slot_size(), PAGE)
    }
}

/// A receive queue in shared memory. See the module documentation.
#[derive(Clone, Copy, Debug)]
pub struct RecvRing {
    mem: MemRegion,
    layout: RecvRingLayout,
}

/// Result of trying to take a receive WR.
#[derive(Debug, PartialEq, Eq)]
pub enum Take {
    /// A receive WR was taken.
    Entry(RecvEntry),
    /// The queue is empty (receiver not ready: RNR).
    Empty,
}

impl RecvRing {
    /// Views `mem` as a ring with `layout`; the region must be at least `layout.size()`.
    pub fn new(mem: MemRegion, layout: RecvRingLayout) -> Result<Self, ShmError> {
        let mem = mem.subregion(0, layout.size())?;
        Ok(RecvRing { mem, layout })
    }

    /// Writes the initial slot sequence numbers; done once by the region's creator.
    pub fn init(&self) -> Result<(), ShmError> {
        for i in 0..self.layout.capacity {
            self.seq(i)?.store(i as u64, Ordering::Relaxed);
        }
        self.enqueue_pos()?.store(0, Ordering::Relaxed);
        self.dequeue_pos()?.store(0, Ordering::Release);
        Ok(())
    }

    /// Layout of this ring.
    pub fn layout(&self) -> RecvRingLayout {
        self.layout
    }

    #[inline]
    fn enqueue_pos(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(LINE)
    }
    #[inline]
    fn dequeue_pos(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(2 * LINE)
    }
    #[inline]
    fn slot_off(&self, pos: u64) -> usize {
        3 * LINE + (pos as usize & (self.layout.capacity - 1)) * self.layout.slot_size()
    }
    fn seq(&self, index: usize) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(3 * LINE + index * self.layout.slot_size())
    }

    /// Appends a receive (owner only). Returns `Ok(false)` when every slot is still in use.
    pub fn push(&self, wr_id: u64, sges: &[Sge]) -> Result<bool, ShmError> {
        if sges.len() > self.layout.max_sge {
            return Err(ShmError::OutOfBounds { offset: sges.len(), len: 1, size: self.layout.max_sge });
        }
        let pos = self.enqueue_pos()?.load(Ordering::Relaxed);
        let off = self.slot_off(pos);
        let seq = self.mem.atomic_u64(off)?.load(Ordering::Acquire);
        if seq != pos {
            return Ok(false);
        }
        self.mem.store_u64(off + 8, wr_id)?;
        self.mem.store_u64(off + 16, sges.len() as u64)?;
        for (i, s) in sges.iter().enumerate() {
            let so = off + SLOT_HEADER + i * SGE_SIZE;
            self.mem.store_u64(so, s.addr)?;
            self.mem.store_u64(so + 8, u64::from(s.length) | (u64::from(s.lkey) << 32))?;
        }
        self.mem.atomic_u64(off)?.store(pos.wrapping_add(1), Ordering::Release);
        self.enqueue_pos()?.store(pos.wrapping_add(1), Ordering::Relaxed);
        Ok(true)
    }

    /// Takes the oldest receive (peer, or owner when flushing).
    pub fn take(&self) -> Result<Take, ShmError> {
        let mut sges = Vec::new();
        Ok(match self.take_into(&mut sges)? {
            Some(wr_id) => Take::Entry(RecvEntry { wr_id, sges }),
            None => Take::Empty,
        })
    }

    /// Takes the oldest receive into `sges` (reused, so the data path does not allocate);
    /// returns its wr_id, or `None` when the queue is empty (receiver not ready: RNR).
    #[inline]
    pub fn take_into(&self, sges: &mut Vec<Sge>) -> Result<Option<u64>, ShmError> {
        let dq = self.dequeue_pos()?;
        // Bounded: a peer that scribbles sequence numbers gets Empty, not a spin.
        for _ in 0..64 {
            let pos = dq.load(Ordering::Relaxed);
            let off = self.slot_off(pos);
            let seq_word = self.mem.atomic_u64(off)?;
            let seq = seq_word.load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos.wrapping_add(1)) as i64;
            if diff == 0 {
                if dq.compare_exchange_weak(pos, pos.wrapping_add(1), Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                    let wr_id = self.mem.load_u64(off + 8)?;
                    let n = (self.mem.load_u64(off + 16)? as usize).min(self.layout.max_sge);
                    sges.clear();
                    for i in 0..n {
                        let so = off + SLOT_HEADER + i * SGE_SIZE;
                        let addr = self.mem.load_u64(so)?;
                        let lk = self.mem.load_u64(so + 8)?;
                        sges.push(Sge { addr, length: lk as u32, lkey: (lk >> 32) as u32 });
                    }
                    seq_word.store(pos.wrapping_add(self.layout.capacity as u64), Ordering::Release);
                    return Ok(Some(wr_id));
                }
            } else if diff < 0 {
                return Ok(None);
            }
        }
        Ok(None)
    }

    /// Prefetches what the next `take_into` touches (the consumer's position and the slot it
    /// takes, both written then): see [`MemRegion::prefetch`].
    #[inline]
    pub fn prefetch_next(&self) {
        let Ok(dq) = self.dequeue_pos() else { return };
        self.mem.prefetch(2 * LINE, true);
        let off = self.slot_off(dq.load(Ordering::Relaxed));
        self.mem.prefetch(off, true);
        self.mem.prefetch(off + SLOT_HEADER, false);
    }

    /// Whether a receive is waiting (a hint; `take` decides).
    #[inline]
    pub fn has_entries(&self) -> bool {
        let (Ok(e), Ok(d)) = (self.enqueue_pos(), self.dequeue_pos()) else {
            return false;
        };
        e.load(Ordering::Acquire) > d.load(Ordering::Acquire)
    }
}

/// One inbound completion, written by the peer into the owner's [`CompRing`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompEntry {
    /// wr_id of the receive that completed.
    pub wr_id: u64,
    /// Bytes received.
    pub byte_len: u32,
    /// Immediate data (network order, as given by the sender).
    pub imm: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u8,
    /// `ibv_wc_status`.
    pub status: u8,
    /// `ibv_wc_flags` (low byte).
    pub wc_flags: u8,
    /// Bit 0: solicited; bit 1: completion of an SRQ receive.
    pub flags: u8,
    /// Sender's QP number.
    pub src_qp: u32,
}

/// [`CompEntry::flags`]: the sender asked for a solicited event.
pub const COMP_SOLICITED: u8 = 1;
/// [`CompEntry::flags`]: the receive came from the QP's SRQ.
pub const COMP_FROM_SRQ: u8 = 2;

/// One cache line per entry: producer and consumer never share a line.
const COMP_ENTRY: usize = LINE;

/// Byte layout of a [`CompRing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompRingLayout {
    /// Number of entries (power of two).
    pub capacity: usize,
}

impl CompRingLayout {
    /// Layout for at least `min_entries` completions.
    pub fn new(min_entries: usize) -> Self {
        CompRingLayout { capacity: min_entries.max(1).next_power_of_two() }
    }
    /// Total bytes, a multiple of [`PAGE`].
    pub fn size(&self) -> usize {
        round_up(3 * LINE + self.capacity * COMP_ENTRY, PAGE)
    }
}

/// Single-producer single-consumer completion ring. See the module documentation.
#[derive(Clone, Copy, Debug)]
pub struct CompRing {
    mem: MemRegion,
    layout: CompRingLayout,
}

impl CompRing {
    /// Views `mem` as a completion ring.
    pub fn new(mem: MemRegion, layout: CompRingLayout) -> Result<Self, ShmError> {
        let mem = mem.subregion(0, layout.size())?;
        Ok(CompRing { mem, layout })
    }
    #[inline]
    fn head(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(LINE)
    }
    #[inline]
    fn tail(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(2 * LINE)
    }
    #[inline]
    fn entry_off(&self, pos: u64) -> usize {
        3 * LINE + (pos as usize & (self.layout.capacity - 1)) * COMP_ENTRY
    }

    /// Appends a completion (the peer). Returns `Ok(false)` when the ring is full.
    pub fn push(&self, e: &CompEntry) -> Result<bool, ShmError> {
        let mut cached_head = 0;
        self.push_cached(e, &mut cached_head)
    }

    /// [`CompRing::push`] with the producer's last view of the consumer's position, so the
    /// consumer's line is read only when the ring looks full.
    #[inline]
    pub fn push_cached(&self, e: &CompEntry, cached_head: &mut u64) -> Result<bool, ShmError> {
        let tail = self.tail()?.load(Ordering::Relaxed);
        if tail.wrapping_sub(*cached_head) >= self.layout.capacity as u64 {
            *cached_head = self.head()?.load(Ordering::Acquire);
            if tail.wrapping_sub(*cached_head) >= self.layout.capacity as u64 {
                return Ok(false);
            }
        }
        let off = self.entry_off(tail);
        self.mem.store_u64(off + 8, e.wr_id)?;
        self.mem.store_u64(off + 16, u64::from(e.byte_len) | (u64::from(e.imm) << 32))?;
        self.mem.store_u64(
            off + 24,
            u64::from(e.src_qp)
                | (u64::from(e.opcode) << 32)
                | (u64::from(e.status) << 40)
                | (u64::from(e.wc_flags) << 48)
                | (u64::from(e.flags) << 56),
        )?;
        // Publishing: the entry's sequence word says "position tail is here".
        self.mem.atomic_u64(off)?.store(tail.wrapping_add(1), Ordering::Release);
        self.tail()?.store(tail.wrapping_add(1), Ordering::Relaxed);
        Ok(true)
    }

    /// Takes the oldest completion (the owner): reads only the entry's own line.
    #[inline]
    pub fn pop(&self) -> Result<Option<CompEntry>, ShmError> {
        let head = self.head()?.load(Ordering::Relaxed);
        let off = self.entry_off(head);
        if self.mem.atomic_u64(off)?.load(Ordering::Acquire) != head.wrapping_add(1) {
            return Ok(None);
        }
        let wr_id = self.mem.load_u64(off + 8)?;
        let a = self.mem.load_u64(off + 16)?;
        let b = self.mem.load_u64(off + 24)?;
        self.head()?.store(head.wrapping_add(1), Ordering::Release);
        Ok(Some(CompEntry {
            wr_id,
            byte_len: a as u32,
            imm: (a >> 32) as u32,
            src_qp: b as u32,
            opcode: (b >> 32) as u8,
            status: (b >> 40) as u8,
            wc_flags: (b >> 48) as u8,
            flags: (b >> 56) as u8,
        }))
    }

    /// The consumer's and the producer's positions (head, tail); the producer uses them to
    /// count completions not yet polled.
    pub fn positions(&self) -> (u64, u64) {
        let h = self.head().map_or(0, |w| w.load(Ordering::Acquire));
        let t = self.tail().map_or(0, |w| w.load(Ordering::Relaxed));
        (h, t)
    }

    /// Whether no completion is waiting.
    #[inline]
    pub fn is_empty(&self) -> bool {
        let Ok(h) = self.head() else { return true };
        let head = h.load(Ordering::Relaxed);
        self.mem.atomic_u64(self.entry_off(head)).map_or(true, |w| w.load(Ordering::Acquire) != head.wrapping_add(1))
    }
}

/// Layout of a QP's shared region: a control page, then its receive ring (absent when the QP
/// uses an SRQ), then its inbound completion ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpRegionLayout {
    /// The QP's own receive ring, if it has no SRQ.
    pub rq: Option<RecvRingLayout>,
    /// Inbound completions.
    pub comp: CompRingLayout,
}

/// Control page word: the owner's QP state (`ibv_qp_state`), written by the owner.
pub const QP_OWNER_STATE: usize = 0;
/// Control page word: non-zero asks the owner to move the QP to ERR (see `QP_ERR_*`).
pub const QP_ERROR_REQUEST: usize = LINE;
/// Control page word: bumped by vrdmad whenever the owner deregisters an MR, so peers
/// revalidate cached remote keys.
pub const QP_MR_EPOCH: usize = 2 * LINE;
/// Control page word: the owner's vNIC generation; unused for now, reserved.
pub const QP_RESERVED: usize = 3 * LINE;

/// Control page word: the owner's Q_Key (UD QPs), checked by UD senders.
pub const QP_QKEY: usize = 4 * LINE;
/// Control page word: lock of the QP's receive side for UD senders (several processes may
/// send to one UD QP; its completion ring has one producer at a time). 0 = free.
pub const QP_UD_LOCK: usize = 5 * LINE;

/// Control page word: the owner's retry attributes, for vrdmad's engine (mediated QPs):
/// `rnr_retry | retry_cnt << 8 | timeout << 16`.
pub const QP_RETRY: usize = 6 * LINE;

/// Error request: the connected peer's process went away.
pub const QP_ERR_PEER_GONE: u64 = 1;
/// Error request: the peer detected a fatal error on this connection.
pub const QP_ERR_REMOTE: u64 = 2;

impl QpRegionLayout {
    /// Layout for a QP with `rq` (None with an SRQ) and a completion ring of `comp` entries.
    pub fn new(rq: Option<RecvRingLayout>, comp_entries: usize) -> Self {
        QpRegionLayout { rq, comp: CompRingLayout::new(comp_entries) }
    }
    /// Offset of the receive ring.
    pub fn rq_offset(&self) -> usize {
        PAGE
    }
    /// Offset of the completion ring.
    pub fn comp_offset(&self) -> usize {
        PAGE + self.rq.map_or(0, |r| r.size())
    }
    /// Total bytes.
    pub fn size(&self) -> usize {
        self.comp_offset() + self.comp.size()
    }
}

/// Layout of an SRQ's shared region: a control page, then the ring.
pub fn srq_region_size(rq: RecvRingLayout) -> usize {
    PAGE + rq.size()
}

/// CQ control page word: arm state (see `CQ_ARM_*`), set by the owner, cleared by whoever
/// delivers the event.
pub const CQ_ARM: usize = 0;
/// CQ control page word: 1 when the CQ has a completion channel (set once by the owner).
pub const CQ_HAS_CHANNEL: usize = LINE;
/// Not armed.
pub const CQ_ARM_NONE: u64 = 0;
/// Armed for the next completion.
pub const CQ_ARM_NEXT: u64 = 1;
/// Armed for the next solicited (or error) completion.
pub const CQ_ARM_SOLICITED: u64 = 2;
/// Size of a CQ's shared region.
pub const CQ_REGION_SIZE: usize = PAGE;

/// A send WR as carried in a [`SqRing`] slot (mediated QPs: vrdmad executes it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SqEntry {
    /// The application's identifier.
    pub wr_id: u64,
    /// `ibv_wr_opcode` (validated by the consumer).
    pub opcode: u32,
    /// `ibv_send_flags`.
    pub send_flags: u32,
    /// Immediate data.
    pub imm_data: u32,
    /// Remote key of RDMA and atomic WRs.
    pub rkey: u32,
    /// Remote address of RDMA and atomic WRs.
    pub remote_addr: u64,
    /// Atomic compare or add operand.
    pub compare_add: u64,
    /// Atomic swap operand.
    pub swap: u64,
    /// Gather list (empty for inline WRs).
    pub sges: Vec<Sge>,
    /// Inline data (copied into the slot at post time).
    pub inline: Vec<u8>,
}

/// Byte layout of a [`SqRing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SqRingLayout {
    /// Number of slots (power of two).
    pub capacity: usize,
    /// Gather elements per slot.
    pub max_sge: usize,
    /// Inline bytes per slot.
    pub max_inline: usize,
}

const SQ_SLOT_HEADER: usize = 64;

impl SqRingLayout {
    /// Layout for at least `min_entries` WRs of up to `max_sge` elements or `max_inline` bytes.
    pub fn new(min_entries: usize, max_sge: usize, max_inline: usize) -> Self {
        SqRingLayout { capacity: min_entries.max(2).next_power_of_two(), max_sge: max_sge.max(1), max_inline }
    }
    fn slot_size(&self) -> usize {
        round_up(SQ_SLOT_HEADER + SGE_SIZE * self.max_sge + self.max_inline, LINE)
    }
    /// Total bytes, a multiple of [`PAGE`].
    pub fn size(&self) -> usize {
        round_up(3 * LINE + self.capacity * self.slot_size(), PAGE)
    }
}

/// Single-producer single-consumer send queue of a *mediated* QP: the owner's library posts,
/// vrdmad's engine consumes. The consumer treats every slot as untrusted (counts bounded by
/// the layout it chose itself).
#[derive(Clone, Copy, Debug)]
pub struct SqRing {
    mem: MemRegion,
    layout: SqRingLayout,
}

impl SqRing {
    /// Views `mem` as a send ring with `layout`.
    pub fn new(mem: MemRegion, layout: SqRingLayout) -> Result<Self, ShmError> {
        let mem = mem.subregion(0, layout.size())?;
        Ok(SqRing { mem, layout })
    }
    /// Layout of this ring.
    pub fn layout(&self) -> SqRingLayout {
        self.layout
    }
    fn head(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(LINE)
    }
    fn tail(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(2 * LINE)
    }
    fn slot_off(&self, pos: u64) -> usize {
        3 * LINE + (pos as usize & (self.layout.capacity - 1)) * self.layout.slot_size()
    }

    /// Prefetches what the consumer's next `pop_into` touches (the producer's position, the
    /// slot's header and first gather elements, the consumer's position it writes): see
    /// [`MemRegion::prefetch`].
    #[inline]
    pub fn prefetch_next(&self) {
        let Ok(head) = self.head() else { return };
        let off = self.slot_off(head.load(Ordering::Relaxed));
        self.mem.prefetch(2 * LINE, false);
        self.mem.prefetch(off, false);
        self.mem.prefetch(off + SQ_SLOT_HEADER, false);
        self.mem.prefetch(LINE, true);
    }

    /// Appends a WR (the owner), with its cached view of the consumer's position. Returns
    /// `Ok(false)` when the ring is full; an error if the WR does not fit a slot.
    pub fn push(&self, e: &SqEntry, cached_head: &mut u64) -> Result<bool, ShmError> {
        if e.sges.len() > self.layout.max_sge || e.inline.len() > self.layout.max_inline {
            return Err(ShmError::OutOfBounds { offset: 0, len: e.sges.len().max(e.inline.len()), size: self.layout.max_sge });
        }
        let tail = self.tail()?.load(Ordering::Relaxed);
        if tail.wrapping_sub(*cached_head) >= self.layout.capacity as u64 {
            *cached_head = self.head()?.load(Ordering::Acquire);
            if tail.wrapping_sub(*cached_head) >= self.layout.capacity as u64 {
                return Ok(false);
            }
        }
        let off = self.slot_off(tail);
        let m = &self.mem;
        m.store_u64(off + 8, e.wr_id)?;
        m.store_u64(off + 16, u64::from(e.opcode) | (u64::from(e.send_flags) << 32))?;
        m.store_u64(off + 24, u64::from(e.imm_data) | (u64::from(e.rkey) << 32))?;
        m.store_u64(off + 32, e.remote_addr)?;
        m.store_u64(off + 40, e.compare_add)?;
        m.store_u64(off + 48, e.swap)?;
        m.store_u64(off + 56, e.sges.len() as u64 | ((e.inline.len() as u64) << 32))?;
        for (i, s) in e.sges.iter().enumerate() {
            let so = off + SQ_SLOT_HEADER + i * SGE_SIZE;
            m.store_u64(so, s.addr)?;
            m.store_u64(so + 8, u64::from(s.length) | (u64::from(s.lkey) << 32))?;
        }
        if !e.inline.is_empty() {
            m.write_from(off + SQ_SLOT_HEADER + self.layout.max_sge * SGE_SIZE, &e.inline)?;
        }
        self.mem.atomic_u64(off)?.store(tail.wrapping_add(1), Ordering::Release);
        self.tail()?.store(tail.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Takes the oldest WR (the engine) into `out`; `Ok(false)` when empty. Counts read from
    /// the slot are clamped to the layout: a lying producer only garbles its own WRs.
    pub fn pop_into(&self, out: &mut SqEntry) -> Result<bool, ShmError> {
        let head = self.head()?.load(Ordering::Relaxed);
        let off = self.slot_off(head);
        if self.mem.atomic_u64(off)?.load(Ordering::Acquire) != head.wrapping_add(1) {
            return Ok(false);
        }
        let m = &self.mem;
        out.wr_id = m.load_u64(off + 8)?;
        let a = m.load_u64(off + 16)?;
        out.opcode = a as u32;
        out.send_flags = (a >> 32) as u32;
        let b = m.load_u64(off + 24)?;
        out.imm_data = b as u32;
        out.rkey = (b >> 32) as u32;
        out.remote_addr = m.load_u64(off + 32)?;
        out.compare_add = m.load_u64(off + 40)?;
        out.swap = m.load_u64(off + 48)?;
        let c = m.load_u64(off + 56)?;
        let nsge = (c as u32 as usize).min(self.layout.max_sge);
        let ninline = ((c >> 32) as usize).min(self.layout.max_inline);
        out.sges.clear();
        for i in 0..nsge {
            let so = off + SQ_SLOT_HEADER + i * SGE_SIZE;
            let addr = m.load_u64(so)?;
            let w = m.load_u64(so + 8)?;
            out.sges.push(Sge { addr, length: w as u32, lkey: (w >> 32) as u32 });
        }
        out.inline.resize(ninline, 0);
        if ninline > 0 {
            m.read_into(off + SQ_SLOT_HEADER + self.layout.max_sge * SGE_SIZE, &mut out.inline)?;
        }
        self.head()?.store(head.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// The consumer's position (WRs ever taken).
    pub fn head_pos(&self) -> u64 {
        self.head().map(|h| h.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// The producer's position (WRs ever posted).
    pub fn tail_pos(&self) -> u64 {
        self.tail().map(|t| t.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// The wr_id and opcode of the WR posted at `pos` (the producer, reading back its own
    /// slot), if the slot still holds it.
    pub fn peek(&self, pos: u64) -> Option<(u64, u32)> {
        let off = self.slot_off(pos);
        if self.mem.atomic_u64(off).ok()?.load(Ordering::Acquire) != pos.wrapping_add(1) {
            return None;
        }
        Some((self.mem.load_u64(off + 8).ok()?, self.mem.load_u64(off + 16).ok()? as u32))
    }

    /// Whether a WR is waiting.
    pub fn has_entries(&self) -> bool {
        let (Ok(h), Ok(t)) = (self.head(), self.tail()) else { return false };
        t.load(Ordering::Acquire) != h.load(Ordering::Relaxed)
    }
}

/// Layout of a mediated QP's *channel* region (created by vrdmad when the QP connects to a
/// peer it reaches through its engine): a control page, the send ring, and the ring of send
/// completions the engine writes (twice the send ring, so WRs in flight plus unpolled
/// completions always fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediatedLayout {
    /// Send ring.
    pub sq: SqRingLayout,
    /// Send completions.
    pub comp: CompRingLayout,
}

/// Channel control word: 1 while the engine sleeps and wants a doorbell (eventfd write)
/// after the next post; the engine clears it when it wakes.
pub const MED_DOORBELL_WANTED: usize = 0;
/// Channel control word: 1 when the engine left WRs in the send ring because the
/// completion ring had no room; the owner rings the doorbell after polling.
pub const MED_STALLED: usize = LINE;
/// Channel control word: how many send-ring WRs the engine has retired (completed in order,
/// with or without a completion entry). If vrdmad dies, the owner flushes the WRs from
/// here to its own producer position.
pub const MED_RETIRED: usize = 2 * LINE;
/// Channel control word: 1 + the CPU the owner ran on when it last rang the doorbell (0:
/// unknown), so the engine's doorbell thread can move to where its wakeups come from. A
/// hint only: any value is harmless.
pub const MED_RINGER_CPU: usize = 3 * LINE;
/// Channel control word of a QP with a *lane* (its own connection to the peer's daemon,
/// shared with the owner): who may write requests on it now, [`SEND_SIDE_FREE`],
/// [`SEND_SIDE_CLIENT`] (the owner, sending one WR itself) or [`SEND_SIDE_ENGINE`] (the
/// engine: retries, errors, large WRs, a full socket). Taken by compare-and-swap from FREE.
pub const MED_SEND_SIDE: usize = 4 * LINE;
/// Channel control word: send-ring position up to which WRs are claimed for sending (by
/// the owner or the engine, whoever held the send side). The WR at position `p` has PSN
/// `p as u32`; the engine takes claimed WRs from the ring as in flight without sending them.
pub const MED_CLAIMED: usize = 5 * LINE;
/// Channel control word: 1 while the engine wants the send side (an RNR or not-ready wait,
/// an error, a backlog): the owner then sends nothing itself, and rings the doorbell when it
/// gives the send side back.
pub const MED_ENGINE_WANTS: usize = 6 * LINE;
/// Channel control word: 1 + the send-ring position of a WR the owner claimed but did not
/// finish sending (its lane had no room): the engine writes the rest of its frame (0: none).
/// Set after [`MED_UNSENT_BYTES`]; while set, the owner sends nothing itself.
pub const MED_UNSENT: usize = 7 * LINE;
/// Channel control word: how many bytes of that frame the owner wrote.
pub const MED_UNSENT_BYTES: usize = 8 * LINE;
/// Channel control line of a QP with a lane: the *ACK token* its daemon publishes for the
/// owner to carry on its lane, a seqlock of four words: sequence (odd while being written),
/// PSN, counter, MAC (see [`AckToken`]).
pub const MED_ACK_TOKEN: usize = 9 * LINE;
/// Channel control word: the counter of the last ACK token put on the lane, by the owner
/// or by the engine sending in its place (the owner's is a claim the daemon only uses to
/// decide when to acknowledge itself; it never trusts it for more than [`AckToken`] says).
pub const MED_ACK_TAKEN: usize = 10 * LINE;
/// Channel control line: counter, PSN and MAC of the ACK token in the frame the owner left
/// unfinished ([`MED_UNSENT`]; counter 0: it carries none), so the engine finishes the frame
/// with the header bytes the owner began. Written before [`MED_UNSENT`].
pub const MED_UNSENT_ACK: usize = 11 * LINE;
/// [`MED_SEND_SIDE`]: nobody is sending.
pub const SEND_SIDE_FREE: u64 = 0;
/// [`MED_SEND_SIDE`]: the owner is writing a request on the lane.
pub const SEND_SIDE_CLIENT: u64 = 1;
/// [`MED_SEND_SIDE`]: the engine sends this QP's requests.
pub const SEND_SIDE_ENGINE: u64 = 2;

/// A deferred ACK that the responder's daemon lets the QP's owner carry on its lane, in the
/// next request it sends there itself (`wire::F_ACKS`): an ACK without a frame, a wakeup
/// and a system call of the daemon's. The MAC (keyed with the secret of the lane the
/// acknowledged requests came on, which only the two daemons hold) is what the receiving
/// daemon checks; the counter, increasing, makes a token good once. The owner can only carry a token or withhold it, and its daemon
/// acknowledges by itself what is not carried soon.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AckToken {
    /// The PSN acknowledged, with every SEND and WRITE before it.
    pub psn: u32,
    /// Per lane, from 1, increasing.
    pub counter: u64,
    /// The daemons' MAC of the token.
    pub mac: u64,
}

impl AckToken {
    /// Publishes the token in a channel's control page (the daemon; one writer per QP).
    pub fn publish(&self, ctl: &MemRegion) -> Result<(), ShmError> {
        let seq = ctl.atomic_u64(MED_ACK_TOKEN)?;
        let s = seq.load(Ordering::Relaxed) | 1;
        seq.store(s, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        ctl.atomic_u64(MED_ACK_TOKEN + 8)?.store(u64::from(self.psn), Ordering::Relaxed);
        ctl.atomic_u64(MED_ACK_TOKEN + 16)?.store(self.counter, Ordering::Relaxed);
        ctl.atomic_u64(MED_ACK_TOKEN + 24)?.store(self.mac, Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// The token published last, if it is newer than `carried_here` and than the last one
    /// carried on the lane ([`MED_ACK_TAKEN`]), claimed as carried now (before the frame
    /// carrying it is written, so the daemon never takes it for one left behind).
    pub fn take_next(ctl: &MemRegion, carried_here: u64) -> Option<AckToken> {
        let carried = carried_here.max(ctl.load_u64(MED_ACK_TAKEN).ok()?);
        let t = AckToken::read(ctl).filter(|t| t.counter > carried)?;
        ctl.store_u64(MED_ACK_TAKEN, t.counter).ok()?;
        Some(t)
    }

    /// The token published last, if one was read whole (none while it is being written).
    pub fn read(ctl: &MemRegion) -> Option<AckToken> {
        let seq = ctl.atomic_u64(MED_ACK_TOKEN).ok()?;
        let s = seq.load(Ordering::Acquire);
        if s & 1 != 0 {
            return None;
        }
        let psn = ctl.atomic_u64(MED_ACK_TOKEN + 8).ok()?.load(Ordering::Relaxed) as u32;
        let counter = ctl.atomic_u64(MED_ACK_TOKEN + 16).ok()?.load(Ordering::Relaxed);
        let mac = ctl.atomic_u64(MED_ACK_TOKEN + 24).ok()?.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        (seq.load(Ordering::Relaxed) == s && counter != 0).then_some(AckToken { psn, counter, mac })
    }
}

impl MediatedLayout {
    /// Layout for a send ring of `sq`.
    pub fn new(sq: SqRingLayout) -> Self {
        MediatedLayout { sq, comp: CompRingLayout::new(2 * sq.capacity) }
    }
    /// Offset of the send ring.
    pub fn sq_offset(&self) -> usize {
        PAGE
    }
    /// Offset of the completion ring.
    pub fn comp_offset(&self) -> usize {
        PAGE + self.sq.size()
    }
    /// Total bytes.
    pub fn size(&self) -> usize {
        self.comp_offset() + self.comp.size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{create_memfd, SharedMapping};
    use std::os::fd::AsFd;

    fn mapping(size: usize) -> SharedMapping {
        let fd = create_memfd("ring", size, true).unwrap();
        SharedMapping::map_sealed(fd.as_fd(), size, true).unwrap()
    }

    /// A published token reads back whole; none before the first, none while the sequence
    /// says a write is under way (odd), and the next publication replaces it.
    #[test]
    fn ack_token_seqlock() {
        let m = mapping(PAGE);
        let ctl = m.region().subregion(0, PAGE).unwrap();
        assert_eq!(AckToken::read(&ctl), None, "nothing published");
        let t = AckToken { psn: 7, counter: 1, mac: 0xdead_beef };
        t.publish(&ctl).unwrap();
        assert_eq!(AckToken::read(&ctl), Some(t));
        let seq = ctl.load_u64(MED_ACK_TOKEN).unwrap();
        assert_eq!(seq % 2, 0);
        ctl.store_u64(MED_ACK_TOKEN, seq + 1).unwrap();
        assert_eq!(AckToken::read(&ctl), None, "being written");
        let u = AckToken { psn: 8, counter: 2, mac: 42 };
        u.publish(&ctl).unwrap();
        assert_eq!(AckToken::read(&ctl), Some(u));
        assert_eq!(ctl.load_u64(MED_ACK_TOKEN).unwrap() % 2, 0);
    }

    #[test]
    fn recv_ring_fifo_and_full() {
        let l = RecvRingLayout::new(4, 2);
        let m = mapping(l.size());
        let r = RecvRing::new(*m.region(), l).unwrap();
        r.init().unwrap();
        assert_eq!(r.take().unwrap(), Take::Empty);
        for i in 0..4 {
            assert!(r.push(i, &[Sge { addr: i * 10, length: 5, lkey: 9 }]).unwrap());
        }
        assert!(!r.push(99, &[]).unwrap());
        for i in 0..4 {
            match r.take().unwrap() {
                Take::Entry(e) => {
                    assert_eq!(e.wr_id, i);
                    assert_eq!(e.sges, vec![Sge { addr: i * 10, length: 5, lkey: 9 }]);
                }
                Take::Empty => panic!("ring lost entry {i}"),
            }
        }
        assert!(r.push(5, &[]).unwrap());
        assert!(r.push(6, &[Sge::default(), Sge::default()]).unwrap());
        assert!(r.push(7, &[Sge::default(); 3]).is_err());
    }

    #[test]
    fn smallest_ring_never_overwrites() {
        // Found by fuzzing: a one-slot ring could not tell full from free.
        let l = RecvRingLayout::new(1, 1);
        let m = mapping(l.size());
        let r = RecvRing::new(*m.region(), l).unwrap();
        r.init().unwrap();
        assert!(r.push(1, &[]).unwrap());
        assert!(r.push(2, &[]).unwrap());
        assert!(!r.push(3, &[]).unwrap());
        assert!(matches!(r.take().unwrap(), Take::Entry(e) if e.wr_id == 1));
        assert!(matches!(r.take().unwrap(), Take::Entry(e) if e.wr_id == 2));
        assert_eq!(r.take().unwrap(), Take::Empty);
    }

    #[test]
    fn hostile_positions_at_the_end_of_u64_do_not_panic() {
        let l = RecvRingLayout::new(4, 1);
        let m = mapping(l.size());
        let r = RecvRing::new(*m.region(), l).unwrap();
        r.init().unwrap();
        let reg = m.region();
        reg.store_u64(LINE, u64::MAX).unwrap();
        reg.store_u64(2 * LINE, u64::MAX).unwrap();
        let slot = 3 * LINE + 3 * (SLOT_HEADER + SGE_SIZE);
        reg.store_u64(slot, u64::MAX).unwrap();
        let _ = r.push(1, &[]).unwrap();
        reg.store_u64(slot, 0).unwrap();
        let _ = r.take().unwrap();
    }

    #[test]
    fn recv_ring_survives_garbage() {
        let l = RecvRingLayout::new(8, 1);
        let m = mapping(l.size());
        let r = RecvRing::new(*m.region(), l).unwrap();
        r.init().unwrap();
        // A hostile peer scribbles over the whole ring.
        for off in (0..l.size()).step_by(8) {
            m.region().store_u64(off, 0xdead_beef_dead_beef ^ off as u64).unwrap();
        }
        let _ = r.take().unwrap();
        let _ = r.push(1, &[]).unwrap();
    }

    #[test]
    fn comp_ring_spsc() {
        let l = CompRingLayout::new(2);
        let m = mapping(l.size());
        let c = CompRing::new(*m.region(), l).unwrap();
        let e = CompEntry { wr_id: 1, byte_len: 2, imm: 3, opcode: 128, status: 0, wc_flags: 2, flags: 1, src_qp: 77 };
        assert!(c.push(&e).unwrap());
        assert!(c.push(&CompEntry { wr_id: 2, ..e }).unwrap());
        assert!(!c.push(&e).unwrap());
        assert_eq!(c.pop().unwrap(), Some(e));
        assert_eq!(c.pop().unwrap().unwrap().wr_id, 2);
        assert_eq!(c.pop().unwrap(), None);
    }

    #[test]
    fn recv_ring_concurrent_consumers_take_each_once() {
        let l = RecvRingLayout::new(64, 1);
        let m = std::sync::Arc::new(mapping(l.size()));
        let r = RecvRing::new(*m.region(), l).unwrap();
        r.init().unwrap();
        let total = 20_000u64;
        let taken = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let taken = taken.clone();
                let m = m.clone();
                std::thread::spawn(move || {
                    let r = RecvRing::new(*m.region(), l).unwrap();
                    let mut mine = Vec::new();
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                    while (mine.len() as u64) < total && std::time::Instant::now() < deadline {
                        if let Take::Entry(e) = r.take().unwrap() {
                            if e.wr_id == u64::MAX {
                                break;
                            }
                            mine.push(e.wr_id);
                        }
                    }
                    taken.lock().unwrap().extend(mine);
                })
            })
            .collect();
        let mut i = 0;
        while i < total {
            if r.push(i, &[]).unwrap() {
                i += 1;
            }
        }
        let mut stops = 0;
        while stops < 2 {
            if r.push(u64::MAX, &[]).unwrap() {
                stops += 1;
            }
        }
        for c in consumers {
            c.join().unwrap();
        }
        let mut all = taken.lock().unwrap().clone();
        all.sort_unstable();
        assert_eq!(all, (0..total).collect::<Vec<_>>());
    }

    #[test]
    fn sq_ring_round_trip_and_full() {
        let l = SqRingLayout::new(2, 2, 16);
        let m = mapping(l.size());
        let r = SqRing::new(*m.region(), l).unwrap();
        let mut cached = 0;
        let e = SqEntry {
            wr_id: 7,
            opcode: 2,
            send_flags: 3,
            imm_data: 9,
            rkey: 11,
            remote_addr: 13,
            compare_add: 15,
            swap: 17,
            sges: vec![Sge { addr: 1, length: 2, lkey: 3 }],
            inline: vec![],
        };
        assert!(r.push(&e, &mut cached).unwrap());
        let e2 = SqEntry { wr_id: 8, sges: vec![], inline: b"hello".to_vec(), ..e.clone() };
        assert!(r.push(&e2, &mut cached).unwrap());
        assert!(!r.push(&e, &mut cached).unwrap(), "two slots: full");
        assert!(r.push(&SqEntry { sges: vec![Sge::default(); 3], ..e.clone() }, &mut cached).is_err());
        let mut out = SqEntry::default();
        assert!(r.has_entries());
        assert!(r.pop_into(&mut out).unwrap());
        assert_eq!(out, e);
        assert!(r.pop_into(&mut out).unwrap());
        assert_eq!(out, e2);
        assert!(!r.pop_into(&mut out).unwrap());
        assert!(!r.has_entries());
        assert!(r.push(&e, &mut cached).unwrap());
    }
}
