//! [`CompRing`]: a single-producer single-consumer ring of inbound completions. The peer
//! writes the completion of a receive it filled; the owner's CQ polls it.

use super::{ring_size, slot_offset, spsc_has_room, FIRST_POSITION, LINE, SECOND_POSITION};
use crate::shm::{MemRegion, ShmError};
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Bit 0: solicited; bit 1: completion of an SRQ receive; bit 2: payload staged.
    pub flags: u8,
    /// Sender's QP number.
    pub src_qp: u32,
}

/// [`CompEntry::flags`]: the sender asked for a solicited event.
pub const COMP_SOLICITED: u8 = 1;
/// [`CompEntry::flags`]: the receive came from the QP's SRQ.
pub const COMP_FROM_SRQ: u8 = 2;
/// [`CompEntry::flags`]: the payload waits in the QP's staging ring (see `staging.rs`); the
/// owner scatters it into the receive buffer before it reports the completion.
pub const COMP_STAGED: u8 = 4;

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
    /// Total bytes, a multiple of [`PAGE`](super::PAGE).
    pub fn size(&self) -> usize {
        ring_size(self.capacity, COMP_ENTRY)
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
        self.mem.atomic_u64(FIRST_POSITION)
    }
    #[inline]
    fn tail(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(SECOND_POSITION)
    }
    #[inline]
    fn entry_off(&self, pos: u64) -> usize {
        slot_offset(pos, self.layout.capacity, COMP_ENTRY)
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
        if !spsc_has_room(tail, self.layout.capacity, cached_head, || Ok(self.head()?.load(Ordering::Acquire)))? {
            return Ok(false);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::mapping;

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
}
