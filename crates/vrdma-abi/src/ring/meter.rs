//! A QP's meter: the counters its owner's library keeps in the QP's control page on the
//! direct path (where the library, not vrdmad, moves the bytes), in one layout shared with
//! vrdmad's engine (mediated path) so the daemon reports both alike.
//!
//! Layout (u64 words from [`QP_METER`]): for each `ibv_wr_opcode` `op` (0..=6), the WRs
//! sent at word `2·op` and their bytes at `2·op + 1` (one opcode's pair shares a line);
//! from [`METER_RX`] the same for WRs received as responder (written by vrdmad's engine
//! only: on the direct path vrdmad derives them from the connected peer's sends); then
//! completions by status (`ibv_wc_status` `s` at [`METER_STATUS`]` + s`); then RNR NAKs,
//! retransmissions and nanoseconds throttled.
//!
//! The owner's library is the only writer on the direct path: a plain load and store of a
//! word in a line only it writes (no atomic read-modify-write, no fence). vrdmad reads the
//! words for reporting only: a client can write anything there, so its counters say what its
//! library claims it did (they are monotonic in vrdmad, which keeps the highest value seen).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::LINE;
use crate::shm::MemRegion;

/// Offset of the meter in a QP's control page.
pub const QP_METER: usize = 8 * LINE;
/// Opcodes metered (`ibv_wr_opcode` 0..=6).
pub const METER_OPCODES: usize = 7;
/// First word of the WRs received as responder, by opcode (pairs like the sends').
pub const METER_RX: usize = 16;
/// First word of the completions by status.
pub const METER_STATUS: usize = 32;
/// Statuses metered (`ibv_wc_status` 0..=23; others count as the last).
pub const METER_STATUSES: usize = 24;
/// Word of RNR NAKs met (a send found no receive posted).
pub const METER_RNR: usize = METER_STATUS + METER_STATUSES;
/// Word of retransmissions.
pub const METER_RETRANSMITS: usize = METER_RNR + 1;
/// Word of nanoseconds spent throttled by a cap.
pub const METER_THROTTLED_NS: usize = METER_RNR + 2;
/// Words of a meter.
pub const METER_WORDS: usize = 64;

// The meter fits the control page, and its last word is within it.
const _: () = assert!(QP_METER + METER_WORDS * 8 <= super::PAGE && METER_THROTTLED_NS < METER_WORDS);

/// Words of a meter, as read.
pub type MeterWords = [u64; METER_WORDS];

/// Index of the WR count of `opcode` (its bytes are at the next word).
#[inline(always)]
pub const fn meter_opcode(opcode: u32) -> usize {
    2 * (opcode as usize % METER_OPCODES)
}

/// Index of the completions of `status`.
#[inline(always)]
pub const fn meter_status(status: u8) -> usize {
    let s = status as usize;
    METER_STATUS + if s < METER_STATUSES { s } else { METER_STATUSES - 1 }
}

/// The meter in a QP's control page (`ctl`: the region's first page), written by its owner.
#[derive(Clone, Copy, Debug)]
pub struct QpMeter {
    /// The first of [`METER_WORDS`] aligned words, checked once in [`QpMeter::new`] so that
    /// counting on the data path checks nothing.
    words: NonNull<AtomicU64>,
}

// SAFETY: the words are atomics in memory other processes write anyway (see MemRegion's).
unsafe impl Send for QpMeter {}
// SAFETY: as above.
unsafe impl Sync for QpMeter {}

impl QpMeter {
    /// The meter of the QP region whose control page is `ctl` (None if it is too small). It
    /// may be used as long as `ctl` may (the contract of every `MemRegion`).
    pub fn new(ctl: &MemRegion) -> Option<Self> {
        let words = ctl.subregion(QP_METER, METER_WORDS * 8).ok()?;
        let first = words.atomic_u64(0).ok()?;
        Some(QpMeter { words: NonNull::from(first) })
    }

    #[inline(always)]
    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: `new` checked that METER_WORDS aligned words start at `words`, in a region
        // mapped while this meter is used; the index is reduced below METER_WORDS.
        unsafe { &*self.words.as_ptr().add(i % METER_WORDS) }
    }

    /// Adds `v` to word `i`: a relaxed load and store (one writer), no read-modify-write.
    #[inline(always)]
    pub fn add(&self, i: usize, v: u64) {
        let w = self.word(i);
        w.store(w.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
    }

    /// One WR of `opcode` sent, carrying `bytes`.
    #[inline(always)]
    pub fn sent(&self, opcode: u32, bytes: u64) {
        let i = meter_opcode(opcode);
        self.add(i, 1);
        self.add(i + 1, bytes);
    }

    /// Every word.
    pub fn read(&self) -> MeterWords {
        std::array::from_fn(|i| self.word(i).load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_fits_the_control_page_and_counts() {
        let m = super::super::tests::mapping(super::super::PAGE);
        let q = QpMeter::new(m.region()).unwrap();
        q.sent(0, 100);
        q.sent(0, 28);
        q.add(meter_status(13), 1);
        q.add(meter_status(200), 1);
        let w = q.read();
        assert_eq!((w[0], w[1]), (2, 128));
        assert_eq!(w[METER_STATUS + 13], 1);
        assert_eq!(w[METER_STATUS + METER_STATUSES - 1], 1);
    }
}
