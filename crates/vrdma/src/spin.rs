//! A small lock for the data path's short critical sections (post, poll).
//!
//! Unlike a general mutex, releasing it is a plain store, not an atomic read-modify-write:
//! on the data path every locked instruction shows in latency. Waiters spin briefly, then
//! yield, so a holder that was preempted (two cores, several busy processes) is not starved.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// Tries with the CPU's pause hint before each further try yields the CPU: about as long as
/// handing the CPU to a holder preempted on this CPU and back costs (a few microseconds;
/// the same rule as the polls', `idle.rs`).
const SPINS_BEFORE_YIELD: u32 = 128;

/// The lock word of [`SpinLock`], on its own for a critical section that spans calls
/// (the drop-in's `ibv_wr_start` .. `ibv_wr_complete`).
pub struct RawSpinLock {
    locked: AtomicBool,
}

impl RawSpinLock {
    /// An unlocked lock.
    pub const fn new() -> Self {
        RawSpinLock { locked: AtomicBool::new(false) }
    }

    /// Takes the lock: spins briefly, then yields, so that a holder that was preempted
    /// is not starved.
    #[inline(always)]
    pub fn lock(&self) {
        if self.locked.swap(true, Ordering::Acquire) {
            self.lock_contended();
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins < SPINS_BEFORE_YIELD {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if !self.locked.swap(true, Ordering::Acquire) {
                return;
            }
        }
    }

    /// Releases the lock (a plain store).
    #[inline(always)]
    pub fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }
}

impl Default for RawSpinLock {
    fn default() -> Self {
        Self::new()
    }
}

/// A spin-then-yield lock.
pub(crate) struct SpinLock<T> {
    lock: RawSpinLock,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to `value` to one thread at a time, so it is Sync when
// the value may be sent between threads.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: moving the lock moves the value.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(value: T) -> Self {
        SpinLock { lock: RawSpinLock::new(), value: UnsafeCell::new(value) }
    }

    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        self.lock.lock();
        SpinGuard { lock: self }
    }
}

pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard exists only while this thread holds the lock, and `&mut self`
        // makes this the only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.lock.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn excludes() {
        let l = std::sync::Arc::new(SpinLock::new(0u64));
        let ts: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..100_000 {
                        *l.lock() += 1;
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        assert_eq!(*l.lock(), 400_000);
    }
}
