//! Keeping copies through a process's memory out of ranges the process is moving onto shared
//! memory (an MR registered in place moving onto memfds): a copy that wrote the old pages
//! after the owner copied them would be lost.
//!
//! The owner asks vrdmad to begin the move (`BeginRehome`): from then on accesses to the range
//! wait, and the move starts once no access to it is under way (the owner asks again until
//! then); `RehomeMr` ends it, and the waiting accesses go on, into the new pages at the same
//! addresses. A move that never ends (the owner died in it) lets a waiting access fail after
//! [`MOVE_WAIT`].

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long an access waits for a move of its range.
pub(super) const MOVE_WAIT: Duration = Duration::from_secs(5);

/// Moves in progress and accesses under way, by range `[start, end)`.
#[derive(Default)]
pub(super) struct MoveGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    moving: Vec<(u64, u64)>,
    /// Accesses under way (a range may appear more than once).
    accessing: Vec<(u64, u64)>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn range(addr: u64, len: u64) -> (u64, u64) {
    (addr, addr.saturating_add(len.max(1)))
}

/// An access under way (ends when dropped).
pub(super) struct Pass<'a> {
    gate: &'a MoveGate,
    range: (u64, u64),
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut st = self.gate.state.lock();
        if let Some(i) = st.accessing.iter().position(|r| *r == self.range) {
            st.accessing.swap_remove(i);
        }
        drop(st);
        self.gate.changed.notify_all();
    }
}

impl MoveGate {
    /// Admits an access to `[addr, addr+len)` once no move of it is in progress; `None` if one
    /// lasted longer than [`MOVE_WAIT`].
    pub(super) fn pass(&self, addr: u64, len: u64) -> Option<Pass<'_>> {
        let r = range(addr, len);
        let deadline = Instant::now() + MOVE_WAIT;
        let mut st = self.state.lock();
        while st.moving.iter().any(|m| overlaps(*m, r)) {
            if self.changed.wait_until(&mut st, deadline).timed_out() {
                return None;
            }
        }
        st.accessing.push(r);
        Some(Pass { gate: self, range: r })
    }

    /// Admits an access to `[addr, addr+len)` only if no move of it is under way (`None`
    /// then): for the requester's own memory, whose move its own library makes and which a
    /// request of its waiting here would hold up (its control socket is busy with it).
    pub(super) fn try_pass(&self, addr: u64, len: u64) -> Option<Pass<'_>> {
        let r = range(addr, len);
        let mut st = self.state.lock();
        if st.moving.iter().any(|m| overlaps(*m, r)) {
            return None;
        }
        st.accessing.push(r);
        Some(Pass { gate: self, range: r })
    }

    /// Marks `[addr, addr+len)` as moving (once, however often asked) if no access to it is
    /// under way; whether it did. A range is never marked while an access holds it: the mover
    /// asks again, and a mover that gives up leaves nothing behind, nor can two processes'
    /// gates, each held by a copy waiting for the other (direct copies take both), block each
    /// other.
    pub(super) fn begin(&self, addr: u64, len: u64) -> bool {
        let r = range(addr, len);
        let mut st = self.state.lock();
        if st.accessing.iter().any(|a| overlaps(*a, r)) {
            return false;
        }
        if !st.moving.contains(&r) {
            st.moving.push(r);
        }
        true
    }

    /// Ends the move of `[addr, addr+len)`.
    pub(super) fn end(&self, addr: u64, len: u64) {
        let r = range(addr, len);
        self.state.lock().moving.retain(|m| *m != r);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A move waits for accesses under way to its range (not others), accesses wait for the
    /// move, and go on when it ends.
    #[test]
    fn moves_and_accesses_exclude_each_other() {
        let g = MoveGate::default();
        let a = g.pass(0x1000, 0x100).unwrap();
        let other = g.pass(0x9000, 0x100).unwrap();
        assert!(!g.begin(0x1000, 0x1000), "an access is under way");
        drop(a);
        assert!(g.begin(0x1000, 0x1000), "asked again: none any more");
        drop(other);
        std::thread::scope(|sc| {
            let waiter = sc.spawn(|| {
                let t = Instant::now();
                let p = g.pass(0x1800, 8);
                (p.is_some(), t.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            g.end(0x1000, 0x1000);
            let (ok, waited) = waiter.join().unwrap();
            assert!(ok && waited >= Duration::from_millis(40), "the access waited for the move: {waited:?}");
        });
        assert!(g.pass(0x1000, 8).is_some());
    }
}
