//! A QP's caps as vrdmad publishes them in its control page (line 7: `QP_QOS_*` in
//! `region.rs`): vrdmad writes the caps and orders, then moves the epoch on; the owner's
//! library loads the epoch on each direct post and reads the rest only when it moved.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{QP_QOS_EPOCH, QP_QOS_FLAGS, QP_QOS_MAX_BW, QP_QOS_MAX_RATE};
use crate::shm::MemRegion;

/// What vrdmad published for a QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosWords {
    /// Bytes/s (0: uncapped).
    pub max_bw: u64,
    /// WRs/s (0: uncapped).
    pub max_rate: u64,
    /// `QP_QOS_*` order bits.
    pub flags: u64,
}

/// The QoS words of a QP's control page.
#[derive(Clone, Copy, Debug)]
pub struct QpQos {
    /// The epoch word; the other three follow it in the same line (checked in `new`).
    epoch: NonNull<AtomicU64>,
}

// SAFETY: the words are atomics in memory other processes write anyway (see MemRegion's).
unsafe impl Send for QpQos {}
// SAFETY: as above.
unsafe impl Sync for QpQos {}

const _: () = assert!(QP_QOS_MAX_BW == QP_QOS_EPOCH + 8 && QP_QOS_MAX_RATE == QP_QOS_EPOCH + 16 && QP_QOS_FLAGS == QP_QOS_EPOCH + 24);

impl QpQos {
    /// The words of the QP region whose control page is `ctl` (None if it is too small). It
    /// may be used as long as `ctl` may (the contract of every `MemRegion`).
    pub fn new(ctl: &MemRegion) -> Option<Self> {
        let words = ctl.subregion(QP_QOS_EPOCH, 32).ok()?;
        let first = words.atomic_u64(0).ok()?;
        Some(QpQos { epoch: NonNull::from(first) })
    }

    #[inline(always)]
    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: `new` checked that four aligned words start at `epoch`, in a region mapped
        // while this is used; the index is reduced below 4.
        unsafe { &*self.epoch.as_ptr().add(i % 4) }
    }

    /// The epoch: it moves whenever the other words change (a relaxed load: the data path
    /// reads it on every post; [`QpQos::read`] orders the rest).
    #[inline(always)]
    pub fn epoch(&self) -> u64 {
        self.word(0).load(Ordering::Relaxed)
    }

    /// The epoch and the words published with it (a seqlock read: retried while vrdmad is
    /// writing, at most a few times; vrdmad is the only writer).
    pub fn read(&self) -> (u64, QosWords) {
        let mut last = (0, QosWords::default());
        for _ in 0..8 {
            let e = self.word(0).load(Ordering::Acquire);
            let w = QosWords {
                max_bw: self.word(1).load(Ordering::Acquire),
                max_rate: self.word(2).load(Ordering::Acquire),
                flags: self.word(3).load(Ordering::Acquire),
            };
            last = (e, w);
            if e & 1 == 0 && self.word(0).load(Ordering::Acquire) == e {
                break;
            }
        }
        last
    }

    /// Publishes `w` (vrdmad only) if it differs from what is there; whether it did.
    pub fn publish(&self, w: QosWords) -> bool {
        if self.read().1 == w {
            return false;
        }
        // Odd while writing, even (and larger) after: a reader never takes half of it.
        let e = self.word(0).load(Ordering::Relaxed);
        let start = if e & 1 == 0 { e.wrapping_add(1) } else { e.wrapping_add(2) };
        self.word(0).store(start, Ordering::Release);
        self.word(1).store(w.max_bw, Ordering::Release);
        self.word(2).store(w.max_rate, Ordering::Release);
        self.word(3).store(w.flags, Ordering::Release);
        self.word(0).store(start.wrapping_add(1), Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_words_are_read_back_and_move_the_epoch() {
        let m = super::super::tests::mapping(super::super::PAGE);
        let q = QpQos::new(m.region()).unwrap();
        assert_eq!(q.read(), (0, QosWords::default()));
        let w = QosWords { max_bw: 200_000_000, max_rate: 0, flags: super::super::QP_QOS_DEMOTE };
        assert!(q.publish(w));
        let (e, got) = q.read();
        assert_eq!((e, got), (2, w));
        assert_eq!(q.epoch(), 2);
        assert!(!q.publish(w), "unchanged: the epoch stays");
        assert_eq!(q.epoch(), 2);
    }
}
