//! [`RecvRing`]: the receive queue of a QP or SRQ, multi-consumer (Vyukov's per-slot
//! sequence numbers). The owner is the only producer; the connected peer's library consumes
//! an entry when a SEND or WRITE_WITH_IMM arrives, the owner when it flushes.

use super::{read_sges, ring_size, round_up, slot_offset, write_sges, Sge, FIRST_POSITION, LINE, SECOND_POSITION, SGE_SIZE, SLOTS};
use crate::shm::{MemRegion, ShmError};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Receive flag (the high half of a slot's element count): every element of the receive
/// lies in an MR that grants REMOTE_WRITE, so a peer may write it directly instead of staging
/// the SEND (`staging.rs`). Set by the owner's library; a peer that finds it false is refused
/// the mapping, as for any MR it may not write.
pub const RECV_REMOTE_WRITABLE: u32 = 1;

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
    /// stalled on it (ib_send_lat's 512 receives fill a 512-slot ring; see
    /// docs/measurements.md).
    pub fn with_headroom(max_wr: usize, max_sge: usize) -> Self {
        Self::new(max_wr.max(1).saturating_mul(2), max_sge)
    }
    fn slot_size(&self) -> usize {
        // Whole cache lines: a slot never shares a line with its neighbour.
        round_up(SLOT_HEADER + SGE_SIZE * self.max_sge, LINE)
    }
    /// Total bytes, a multiple of [`PAGE`](super::PAGE).
    pub fn size(&self) -> usize {
        ring_size(self.capacity, self.slot_size())
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
        self.mem.atomic_u64(FIRST_POSITION)
    }
    #[inline]
    fn dequeue_pos(&self) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(SECOND_POSITION)
    }
    #[inline]
    fn slot_off(&self, pos: u64) -> usize {
        slot_offset(pos, self.layout.capacity, self.layout.slot_size())
    }
    fn seq(&self, index: usize) -> Result<&AtomicU64, ShmError> {
        self.mem.atomic_u64(SLOTS + index * self.layout.slot_size())
    }

    /// Appends a receive (owner only). Returns `Ok(false)` when every slot is still in use.
    pub fn push(&self, wr_id: u64, sges: &[Sge]) -> Result<bool, ShmError> {
        self.push_flagged(wr_id, sges, 0)
    }

    /// [`RecvRing::push`] with flags (`RECV_*`).
    pub fn push_flagged(&self, wr_id: u64, sges: &[Sge], flags: u32) -> Result<bool, ShmError> {
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
        self.mem.store_u64(off + 16, sges.len() as u64 | (u64::from(flags) << 32))?;
        write_sges(&self.mem, off + SLOT_HEADER, sges)?;
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
        Ok(self.take_into_flagged(sges)?.map(|(wr_id, _)| wr_id))
    }

    /// [`RecvRing::take_into`], with the receive's flags (`RECV_*`).
    #[inline]
    pub fn take_into_flagged(&self, sges: &mut Vec<Sge>) -> Result<Option<(u64, u32)>, ShmError> {
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
                    let count = self.mem.load_u64(off + 16)?;
                    let n = (count as u32 as usize).min(self.layout.max_sge);
                    read_sges(&self.mem, off + SLOT_HEADER, n, sges)?;
                    seq_word.store(pos.wrapping_add(self.layout.capacity as u64), Ordering::Release);
                    return Ok(Some((wr_id, (count >> 32) as u32)));
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
        self.mem.prefetch(SECOND_POSITION, true);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::mapping;

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
    fn flags_travel_with_the_receive_and_leave_its_count_alone() {
        let layout = RecvRingLayout::new(4, 2);
        let m = mapping(layout.size());
        let r = RecvRing::new(*m.region(), layout).unwrap();
        r.init().unwrap();
        let sges = [Sge { addr: 1, length: 2, lkey: 3 }, Sge { addr: 4, length: 5, lkey: 6 }];
        assert!(r.push_flagged(7, &sges, RECV_REMOTE_WRITABLE).unwrap());
        assert!(r.push(8, &sges[..1]).unwrap());
        let mut got = Vec::new();
        assert_eq!(r.take_into_flagged(&mut got).unwrap(), Some((7, RECV_REMOTE_WRITABLE)));
        assert_eq!(got, sges);
        assert_eq!(r.take_into_flagged(&mut got).unwrap(), Some((8, 0)));
        assert_eq!(got, sges[..1]);
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
        let slot = slot_offset(u64::MAX, l.capacity, l.slot_size());
        reg.store_u64(slot, u64::MAX).unwrap();
        assert!(r.push(1, &[]).unwrap(), "the slot's sequence number says free");
        reg.store_u64(slot, 0).unwrap();
        assert!(matches!(r.take().unwrap(), Take::Entry(e) if e.wr_id == 1), "positions wrap to 0");
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
}
