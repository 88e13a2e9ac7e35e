//! The READ responses a QP's responder owes, let go by the doorbell thread's scheduler.
//!
//! A READ's response is the responding host's egress, as much as a WRITE is the requesting
//! host's: the bytes leave here. The connection's answerer (`responder::ReadAnswers`)
//! sends a large READ's parts, but only those the scheduler granted: each round the QP is
//! pumped, what its budget leaves (caps, fair share, room on the wire) goes to its READs
//! a segment at a time, charged to its vNIC like the WRs it sends. Before, the answerer
//! sent every READ's parts as fast as its socket took them, and a tenant reading 8 MiB at a
//! time from this host left another's WRITEs from here 0.34-0.40 of their fair share.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use vrdma_abi::wire;

use crate::engine::qos::Budget;

/// Most bytes of one READ granted and not yet sent: a lone READ streams, asking the
/// doorbell thread for more once half of it is sent, not at every segment (each ask is a
/// wakeup of that thread, which preempts what runs on its CPU).
pub(crate) const GRANT_AHEAD_BYTES: usize = 2 << 20;

/// Most large READs one QP may have waiting for their parts: what a requester may have
/// outstanding (`max_qp_rd_atom`, which our requester keeps to). One beyond it (a
/// duplicate resent meanwhile, or a peer that ignores the limit) is answered "not ready"
/// and comes again: the answerer's jobs are no resource one tenant's QPs can fill for
/// the others.
pub(crate) const MAX_READS_PER_QP: usize = super::requester::MAX_RD_ATOMIC;

/// Who sends a READ's granted parts, woken when there are more.
pub(crate) trait Sender: Send + Sync {
    fn wake(&self);
}

/// One READ's response between the scheduler (which grants its parts) and its sender.
pub(crate) struct Grant {
    /// Bytes of the response not granted yet.
    left: AtomicUsize,
    /// Bytes granted and not yet sent (on the QP's `wire_bytes` from their grant; its
    /// sender takes them off once TCP acknowledged them).
    granted: AtomicUsize,
    /// Nothing granted yet (its first grant counts it as a WR).
    fresh: AtomicBool,
    /// Its sender dropped it (sent, ended by a reset or an error, its QP or connection gone).
    ended: AtomicBool,
    sender: Weak<dyn Sender>,
    /// The READ's PSN.
    psn: u32,
}

impl Grant {
    /// The response to READ `psn`, `len` bytes, sent by `sender`.
    pub(crate) fn new(psn: u32, len: usize, sender: Weak<dyn Sender>) -> Arc<Grant> {
        Arc::new(Grant {
            psn,
            left: AtomicUsize::new(len),
            granted: AtomicUsize::new(0),
            fresh: AtomicBool::new(true),
            ended: AtomicBool::new(false),
            sender,
        })
    }

    /// Whether `n` bytes (its next part) may go.
    pub(crate) fn allows(&self, n: usize) -> bool {
        self.granted.load(Ordering::Acquire) >= n
    }

    /// Whether it has ended (its QP went).
    pub(crate) fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Its sender sent `n` bytes of it (still on the wire's account: see `granted`).
    /// Whether it should ask the scheduler for more (half its lead is gone).
    pub(crate) fn sent(&self, n: usize) -> bool {
        // (Wrapping: a duplicate READ may end it, zeroing `granted`, while its sender sends a
        // part granted before; the end took that part off the wire's account, and the
        // sender's drop of it later gives it back, so the counts agree modulo 2^64.)
        let before = self.granted.fetch_sub(n, Ordering::AcqRel);
        self.left.load(Ordering::Acquire) > 0 && before.wrapping_sub(n) <= GRANT_AHEAD_BYTES / 2
    }

    /// Its sender dropped it: what was granted and not sent leaves the wire's account.
    /// (Under the list's lock, [`ReadGrants::end`]: a grant that saw it live adds nothing
    /// after.)
    fn end(&self, wire_bytes: &AtomicU64) {
        self.ended.store(true, Ordering::Release);
        let unsent = self.granted.swap(0, Ordering::AcqRel);
        wire_bytes.fetch_sub(unsent as u64, Ordering::Relaxed);
    }

    /// Whether it still has parts to grant or send.
    fn is_live(&self) -> bool {
        !self.has_ended() && (self.left.load(Ordering::Acquire) > 0 || self.granted.load(Ordering::Acquire) > 0)
    }

    /// Tells its sender there is something to do with it.
    fn wake(&self) {
        if let Some(s) = self.sender.upgrade() {
            s.wake();
        }
    }

    fn wants(&self) -> bool {
        !self.has_ended() && self.left.load(Ordering::Acquire) > 0 && self.granted.load(Ordering::Acquire) < GRANT_AHEAD_BYTES
    }
}

/// A QP's READ responses waiting for grants, in the order they were taken.
#[derive(Default)]
pub(crate) struct ReadGrants {
    grants: Mutex<Listed>,
    /// How many are listed (so the doorbell thread's look at an idle QP takes no lock).
    count: AtomicUsize,
    /// Whether the scheduler's next pump of the QP grants READs before its sends (they
    /// take turns at going first: a QP whose own WRs filled every pump's budget left its
    /// READs nothing).
    reads_first: AtomicBool,
    /// Whether READs of a segment or less are granted too (see [`ReadGrants::schedules`]).
    every_size: AtomicBool,
}

#[derive(Default)]
struct Listed {
    grants: Vec<Arc<Grant>>,
    /// Its QP went ([`ReadGrants::end_all`]): nothing more is listed.
    closed: bool,
}

impl ReadGrants {
    /// Whether the response to a READ of `len` bytes waits for grants: one of more than a
    /// segment always (sent by its responder's reader, it would hold every other QP's
    /// requests behind it), a smaller one while the QP's vNIC or its tenant has a policy
    /// ([`ReadGrants::schedule_every_size`]: its caps hold what peers read from it).
    /// Otherwise the reader answers it at once, the lowest latency. (Doing so whenever
    /// vNICs contend cost the other tenants' latency: docs/measurements.md.)
    pub(crate) fn schedules(&self, len: u64) -> bool {
        len > u64::from(wire::SEGMENT) || self.every_size.load(Ordering::Acquire)
    }

    /// Whether READs of every size wait for grants from now on (the QP's vNIC or its tenant
    /// has a policy: `Scheduler::has_policy`).
    pub(crate) fn schedule_every_size(&self, yes: bool) {
        self.every_size.store(yes, Ordering::Release);
    }

    /// Whether READs of every size wait for grants ([`ReadGrants::schedule_every_size`]).
    pub(crate) fn schedules_every_size(&self) -> bool {
        self.every_size.load(Ordering::Acquire)
    }

    /// Lists `g` (its sender asks the QP to be pumped); false if the QP went, or has
    /// [`MAX_READS_PER_QP`] READs listed already.
    pub(crate) fn add(&self, g: Arc<Grant>) -> bool {
        let mut v = self.grants.lock();
        v.grants.retain(|g| g.is_live());
        if v.closed || v.grants.len() >= MAX_READS_PER_QP {
            return false;
        }
        v.grants.push(g);
        self.count.store(v.grants.len(), Ordering::Release);
        true
    }

    /// Its sender dropped `g` (sent, ended, or its connection gone): what was granted
    /// and not sent leaves the wire's account (`wire_bytes`).
    pub(crate) fn end(&self, g: &Grant, wire_bytes: &AtomicU64) {
        let _v = self.grants.lock();
        g.end(wire_bytes);
    }

    /// Whether this pump grants READs before the QP's sends (they alternate).
    pub(crate) fn reads_go_first(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0 && !self.reads_first.fetch_xor(true, Ordering::Relaxed)
    }

    /// Whether a READ waits for a grant now.
    pub(crate) fn wanting(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0 && self.grants.lock().grants.iter().any(|g| g.wants())
    }

    /// Grants the READs parts, a segment at a time in turn, within `budget` (what the
    /// pump left of it; a READ's first part counts as a WR): on the wire's account
    /// (`wire_bytes`) until sent. Wakes the senders of what it granted.
    pub(crate) fn grant(&self, budget: &mut Budget, wire_bytes: &AtomicU64) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut woken: Vec<Arc<Grant>> = Vec::new();
        {
            // (Under the list's lock throughout: a READ ended meanwhile gets nothing.)
            let mut v = self.grants.lock();
            v.grants.retain(|g| g.is_live());
            self.count.store(v.grants.len(), Ordering::Release);
            let mut any = true;
            while any && budget.allows_more() {
                any = false;
                for g in v.grants.iter().filter(|g| g.wants()) {
                    if !budget.allows_more() {
                        break;
                    }
                    let n = g.left.load(Ordering::Acquire).min(wire::SEGMENT as usize);
                    g.left.fetch_sub(n, Ordering::AcqRel);
                    wire_bytes.fetch_add(n as u64, Ordering::Relaxed);
                    g.granted.fetch_add(n, Ordering::AcqRel);
                    budget.spend_part(n as u32, g.fresh.swap(false, Ordering::AcqRel));
                    if !woken.iter().any(|w| Arc::ptr_eq(w, g)) {
                        woken.push(g.clone());
                    }
                    any = true;
                }
            }
        }
        // (Not under the list's lock: a sender takes its own state's lock to be woken.)
        woken.iter().for_each(|g| g.wake());
    }

    /// The requester asked again from READ `psn` (a duplicate: it starts over from there
    /// and drops what comes for the READs at and after it), or `None`: the responder was
    /// reset. Those READs end (their senders drop them): answering them would only take
    /// the vNIC's budget and their slots (the duplicates were refused "not ready" again
    /// and again while the READs they replace were still answered).
    pub(crate) fn end_from(&self, psn: Option<u32>, wire_bytes: &AtomicU64) {
        let ended: Vec<Arc<Grant>> = {
            let v = self.grants.lock();
            let stale = |g: &&Arc<Grant>| psn.is_none_or(|p| g.psn.wrapping_sub(p) < 1 << 31);
            let ended: Vec<Arc<Grant>> = v.grants.iter().filter(stale).cloned().collect();
            for g in &ended {
                g.end(wire_bytes);
            }
            ended
        };
        ended.iter().for_each(|g| g.wake());
    }

    /// The QP went: its READs end (their senders drop them), and no more are listed.
    pub(crate) fn end_all(&self, wire_bytes: &AtomicU64) {
        self.grants.lock().closed = true;
        self.end_from(None, wire_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);
    impl Sender for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A duplicate READ ends a READ whose granted part its sender is sending: the sender
    /// still marks the part sent, drops the READ, and retires the part once TCP
    /// acknowledges it; the wire's account comes back to nothing. Before, marking the part
    /// sent overflowed (a panic in a debug build, which killed the connection's answerer).
    #[test]
    fn a_part_sent_as_its_read_ends_leaves_nothing_on_the_wire_account() {
        let seg = wire::SEGMENT as usize;
        let sender: Arc<dyn Sender> = Arc::new(Count::default());
        let g = Grant::new(7, 4 * seg, Arc::downgrade(&sender));
        let grants = ReadGrants::default();
        assert!(grants.add(g.clone()));
        let wire_bytes = AtomicU64::new(0);
        grants.grant(&mut Budget::new(64, seg), &wire_bytes);
        assert!(g.allows(seg), "the sender sees its part granted");
        grants.end_from(Some(7), &wire_bytes);
        assert!(!g.sent(seg), "an ended READ asks for nothing");
        grants.end(&g, &wire_bytes);
        // (TCP acknowledges the part: the sender retires it.)
        wire_bytes.fetch_sub(seg as u64, Ordering::Relaxed);
        assert_eq!(wire_bytes.load(Ordering::Relaxed), 0);
    }

    /// Grants go a segment at a time to each READ in turn, within the budget, at most
    /// `GRANT_AHEAD_BYTES` ahead of what was sent; the budget counts each READ once as a
    /// WR; the wire's account holds what is granted and not sent, and nothing once the
    /// READ ends.
    #[test]
    fn reads_are_granted_in_turn_within_the_budget_and_their_lead() {
        let seg = wire::SEGMENT as usize;
        let sender: Arc<dyn Sender> = Arc::new(Count::default());
        let lead = GRANT_AHEAD_BYTES / seg;
        let (a, b) = (Grant::new(0, 4 * lead * seg, Arc::downgrade(&sender)), Grant::new(0, seg + 5, Arc::downgrade(&sender)));
        let grants = ReadGrants::default();
        assert!(grants.add(a.clone()) && grants.add(b.clone()));
        let wire_bytes = AtomicU64::new(0);
        let mut budget = Budget::new(64, 3 * seg);
        grants.grant(&mut budget, &wire_bytes);
        // a, b, a: the third crosses the budget's bytes.
        assert_eq!((a.granted.load(Ordering::Relaxed), b.granted.load(Ordering::Relaxed)), (2 * seg, seg));
        assert_eq!((budget.sent_wrs, budget.sent_bytes), (2, 3 * seg as u64));
        assert_eq!(wire_bytes.load(Ordering::Relaxed), 3 * seg as u64);
        let mut budget = Budget::new(64, 100 * seg);
        grants.grant(&mut budget, &wire_bytes);
        assert_eq!(a.granted.load(Ordering::Relaxed), GRANT_AHEAD_BYTES, "no more than the lead");
        assert_eq!(b.granted.load(Ordering::Relaxed), seg + 5, "its tail");
        assert_eq!(budget.sent_wrs, 0, "each READ counted once");
        assert!(!grants.wanting());
        assert!(a.allows(seg));
        for _ in 0..lead / 2 - 1 {
            assert!(!a.sent(seg), "more than half the lead left");
        }
        assert!(a.sent(seg), "half of it gone: more wanted");
        assert!(grants.wanting());
        grants.end(&a, &wire_bytes);
        assert!(!b.sent(seg + 5), "all of it sent");
        let sent = (lead / 2 * seg + seg + 5) as u64;
        assert_eq!(wire_bytes.load(Ordering::Relaxed), sent, "only what was sent left on the wire's account");
        assert!(!grants.wanting());
        grants.grant(&mut Budget::new(64, 100 * seg), &wire_bytes);
        assert_eq!(grants.count.load(Ordering::Relaxed), 0, "ended and finished READs dropped");
    }

    /// A QP lists at most `MAX_READS_PER_QP` READs at a time (ended ones make room), and
    /// none once it went; a READ ended while listed is granted nothing more.
    #[test]
    fn a_qp_lists_a_bounded_number_of_reads_and_none_once_gone() {
        let seg = wire::SEGMENT as usize;
        let sender: Arc<dyn Sender> = Arc::new(Count::default());
        let grants = ReadGrants::default();
        let listed: Vec<_> = (0..MAX_READS_PER_QP).map(|_| Grant::new(0, 4 * seg, Arc::downgrade(&sender))).collect();
        for g in &listed {
            assert!(grants.add(g.clone()));
        }
        assert!(!grants.add(Grant::new(0, seg, Arc::downgrade(&sender))), "one beyond the limit");
        let wire_bytes = AtomicU64::new(0);
        grants.end(&listed[0], &wire_bytes);
        grants.grant(&mut Budget::new(64, 100 * seg), &wire_bytes);
        assert_eq!(listed[0].granted.load(Ordering::Relaxed), 0, "an ended READ is granted nothing");
        assert!(grants.add(Grant::new(0, seg, Arc::downgrade(&sender))), "an ended READ makes room");
        grants.end_all(&wire_bytes);
        assert!(!grants.add(Grant::new(0, seg, Arc::downgrade(&sender))), "none once the QP went");
        assert!(listed[1].has_ended());
    }

    /// A READ its sender ends while the doorbell thread grants it leaves nothing on the
    /// wire's account, whichever comes first: the first version checked the READ live,
    /// then added, and an end between the two left a segment on the account for good
    /// (about 30 in 20,000 races).
    #[test]
    fn a_read_ended_while_granted_leaves_nothing_on_the_wire_account() {
        use std::sync::Barrier;
        const RACES: usize = 20_000;
        let sender: Arc<dyn Sender> = Arc::new(Count::default());
        let wire_bytes = Arc::new(AtomicU64::new(0));
        let barrier = Arc::new(Barrier::new(2));
        let grants: Arc<Vec<(ReadGrants, Arc<Grant>)>> = Arc::new(
            (0..RACES)
                .map(|_| {
                    let (g, r) = (ReadGrants::default(), Grant::new(0, 64 << 20, Arc::downgrade(&sender)));
                    assert!(g.add(r.clone()));
                    (g, r)
                })
                .collect(),
        );
        let (w, b, l) = (wire_bytes.clone(), barrier.clone(), grants.clone());
        let granter = std::thread::spawn(move || {
            for (g, _) in l.iter() {
                b.wait();
                g.grant(&mut Budget::new(64, 64 << 20), &w);
            }
        });
        for (g, r) in grants.iter() {
            barrier.wait();
            g.end(r, &wire_bytes);
        }
        granter.join().unwrap();
        assert_eq!(wire_bytes.load(Ordering::Relaxed), 0, "segments granted to ended READs left on the wire's account");
    }
}
