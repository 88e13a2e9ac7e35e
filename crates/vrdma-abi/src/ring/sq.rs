//! [`SqRing`]: the send queue of a *mediated* QP, single-producer single-consumer: the
//! owner's library posts, vrdmad's engine executes.

use super::{read_sges, ring_size, round_up, slot_offset, spsc_has_room, write_sges, Sge, FIRST_POSITION, LINE, SECOND_POSITION, SGE_SIZE};
use crate::shm::{MemRegion, ShmError};
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Total bytes, a multiple of [`PAGE`](super::PAGE).
    pub fn size(&self) -> usize {
        ring_size(self.capacity, self.slot_size())
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
        self.mem.atomic_u64(FIRST_POSITION)
    }
    fn tail(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(SECOND_POSITION)
    }
    fn slot_off(&self, pos: u64) -> usize {
        slot_offset(pos, self.layout.capacity, self.layout.slot_size())
    }

    /// Prefetches what the consumer's next `pop_into` touches (the producer's position, the
    /// slot's header and first gather elements, the consumer's position it writes): see
    /// [`MemRegion::prefetch`].
    #[inline]
    pub fn prefetch_next(&self) {
        let Ok(head) = self.head() else { return };
        let off = self.slot_off(head.load(Ordering::Relaxed));
        self.mem.prefetch(SECOND_POSITION, false);
        self.mem.prefetch(off, false);
        self.mem.prefetch(off + SQ_SLOT_HEADER, false);
        self.mem.prefetch(FIRST_POSITION, true);
    }

    /// Appends a WR (the owner), with its cached view of the consumer's position. Returns
    /// `Ok(false)` when the ring is full; an error if the WR does not fit a slot.
    pub fn push(&self, e: &SqEntry, cached_head: &mut u64) -> Result<bool, ShmError> {
        if e.sges.len() > self.layout.max_sge || e.inline.len() > self.layout.max_inline {
            return Err(ShmError::OutOfBounds { offset: 0, len: e.sges.len().max(e.inline.len()), size: self.layout.max_sge });
        }
        let tail = self.tail()?.load(Ordering::Relaxed);
        if !spsc_has_room(tail, self.layout.capacity, cached_head, || Ok(self.head()?.load(Ordering::Acquire)))? {
            return Ok(false);
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
        write_sges(m, off + SQ_SLOT_HEADER, &e.sges)?;
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
        read_sges(m, off + SQ_SLOT_HEADER, nsge, &mut out.sges)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::mapping;

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
