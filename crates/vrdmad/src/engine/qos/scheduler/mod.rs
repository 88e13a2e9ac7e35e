//! The egress scheduler of the doorbell thread: caps (token buckets per vNIC and per tenant,
//! bytes and WRs) and weighted fair queuing between vNICs (virtual time per vNIC, advanced by
//! what it sends over its weight times its tenant's; a quantum per round to each vNIC not
//! ahead; round robin over the QPs of each vNIC), so a vNIC's share does not grow with its
//! QP count.
//!
//! Pure logic over an explicit clock: the doorbell thread hands it the QPs that have work and
//! the time; it pumps them through [`Pumpable`] with a [`Budget`] each and says which must
//! wait, until when. A QP that waits keeps its WRs in its send ring (they complete later):
//! back-pressure, never an error or a drop.

use std::collections::{BTreeMap, HashMap};

use vrdma_abi::control::Qos;

use vrdma_core::bucket::TokenBucket;

use super::contention::Contention;

/// How much a bucket may hold: 10 ms of its rate. Small against the 100 ms windows caps are
/// exact over, large against the doorbell thread's 1 ms timer.
pub(crate) const BUCKET_DEPTH_NS: u64 = 10_000_000;

/// Bytes a vNIC of weight 1 (and tenant weight 1) may send per round: a lone vNIC's pump
/// (`PUMP_BUDGET_BYTES`), so sharing the link costs the doorbell thread no more rounds per
/// byte than having it alone (at 64 KiB, two bulk vNICs together got 0.95 GB/s where one
/// alone got 1.3-1.8).
pub(crate) const QUANTUM_BYTES: i64 = 256 << 10;

/// What a WR costs in a round beyond its payload (a frame header, and the work per WR), so
/// floods of small messages share fairly too.
pub(crate) const WR_COST_BYTES: u64 = 64;

/// Most WRs one pump of a QP sends before the others are served.
pub(crate) const PUMP_BUDGET_WRS: usize = 64;

/// Most WRs one pump sends while vNICs share the link: a pump of small WRs takes about a
/// microsecond a WR of the doorbell thread, and another vNIC's WR waits for it.
pub(crate) const SHARED_PUMP_WRS: usize = 16;

/// What a nanosecond of the doorbell thread costs a vNIC, in bytes. A vNIC is charged the
/// larger of its bytes (plus [`WR_COST_BYTES`] a WR) and the thread's time its pumps took,
/// so one that sends small WRs as fast as the thread can frame them advances its virtual
/// time by what it takes of the host, not by 72 "bytes" a WR. One byte a nanosecond is
/// below what the link carries (1-2 GB/s across hosts), so bulk WRs are charged their
/// bytes, as before: at two, a pump's time (preemptions included) decided bulk shares too,
/// and the 16-QP vNIC of a 1:3 weighted pair got 20-21% instead of 25%.
pub(crate) const THREAD_NS_COST_BYTES: u64 = 1;

/// Most payload bytes one pump of a QP sends (past it, the WR in progress still goes).
pub(crate) const PUMP_BUDGET_BYTES: usize = 256 << 10;
/// What a pump of a vNIC alone on the host sends of a large WR's segments: the HOL a
/// newcomer's first message meets is four segments at most.
pub(crate) const ALONE_SEGMENT_BYTES: usize = 1 << 20;

/// Most data bytes the engine keeps queued in the host's connections (sent, not yet
/// acknowledged) while vNICs share the link: past it, WRs wait in their send rings, where
/// the scheduler orders them. Without a bound the sockets' buffers (megabytes each) would be
/// one first-come queue in which a vNIC with more WRs outstanding (more QPs) takes more.
pub(crate) const WIRE_LIMIT_BYTES: u64 = 1 << 20;

/// Virtual time per byte at weight 1 (so weights up to 10000 divide without loss).
pub(crate) const VTIME_SCALE: u64 = 10_000;

/// How far (in virtual time) a vNIC may run ahead of the slowest that had work lately: two
/// quanta at weight 1.
pub(crate) const VTIME_SLACK: u64 = 2 * QUANTUM_BYTES as u64 * VTIME_SCALE;

/// A vNIC counts as sharing the link for this long after it last had work: QPs that wait for
/// acknowledgements come back to the doorbell thread one by one, and a round that sees one
/// vNIC's QPs only must still leave room for the other's.
pub(crate) const RECENT_NS: u64 = 20_000_000;

/// A throttled QP is looked at again no sooner than this (the doorbell thread's timer counts
/// whole milliseconds; waking sooner would only spin).
pub(crate) const MIN_WAIT_NS: u64 = 1_000_000;

/// What one pump of a QP may send, and what it sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Budget {
    /// WRs it may start.
    pub(crate) wrs: usize,
    /// Payload bytes it may start (the WR that crosses it still goes).
    pub(crate) bytes: usize,
    /// WRs it sent.
    pub(crate) sent_wrs: u64,
    /// Their payload bytes.
    pub(crate) sent_bytes: u64,
    /// The doorbell thread's time the pump took, in nanoseconds (timed pumps only).
    pub(crate) busy_ns: u64,
}

impl Budget {
    /// A budget of `wrs` WRs and `bytes` bytes.
    pub(crate) fn new(wrs: usize, bytes: usize) -> Budget {
        Budget { wrs, bytes, sent_wrs: 0, sent_bytes: 0, busy_ns: 0 }
    }

    /// Whether another WR may start.
    pub(crate) fn allows_more(&self) -> bool {
        self.wrs > 0 && self.bytes > 0
    }

    /// A WR of `len` payload bytes went.
    pub(crate) fn spend(&mut self, len: u32) {
        self.spend_part(len, true);
    }

    /// `len` payload bytes of a WR went (its `first` frames, or later segments of it: the
    /// WR counts once).
    pub(crate) fn spend_part(&mut self, len: u32, first: bool) {
        if first {
            self.wrs = self.wrs.saturating_sub(1);
            self.sent_wrs += 1;
        }
        self.bytes = self.bytes.saturating_sub(len as usize);
        self.sent_bytes += u64::from(len);
    }
}

impl Default for Budget {
    /// One pump's worth: what a QP sends before the others are served.
    fn default() -> Self {
        Budget::new(PUMP_BUDGET_WRS, PUMP_BUDGET_BYTES)
    }
}

/// A QP as the scheduler sees it.
pub(crate) trait Pumpable {
    /// Whether it has frames of WRs it began to send still to send (`wire::F_MORE`).
    fn owes_segments(&self) -> bool {
        false
    }
    /// Whether it streams a large message (the rest of a WR in segments, or a READ's
    /// response its responder answers): alone on the host, a pump sends more of it.
    fn streams(&self) -> bool {
        self.owes_segments()
    }
    /// Whether READs its responder answers wait for a grant (see `qp::ReadGrants`).
    fn reads_waiting(&self) -> bool {
        false
    }
    /// Its number.
    fn qpn(&self) -> u32;
    /// Its vNIC.
    fn vnic(&self) -> &str;
    /// Sends up to `budget`, recording what it sent there.
    fn pump(&self, budget: &mut Budget);
    /// As [`Pumpable::pump`], also recording the time it took in `budget.busy_ns` (only
    /// while vNICs share the link: a lone vNIC's latency path reads no clock).
    fn pump_timed(&self, budget: &mut Budget) {
        self.pump(budget);
    }
    /// It waited `ns` nanoseconds for its caps (metered as time throttled).
    fn throttled_for(&self, ns: u64);
}

/// A vNIC's or tenant's caps: a bucket of bytes and WRs, [`BUCKET_DEPTH_NS`] deep.
fn caps_of(q: &Qos, now: u64) -> TokenBucket {
    TokenBucket::with_depth(q.max_bw, q.max_msg_rate, BUCKET_DEPTH_NS, now)
}

/// A vNIC's scheduling state.
#[derive(Debug)]
struct VnicSched {
    tenant: String,
    weight: u32,
    caps: TokenBucket,
    /// Virtual time: what it sent, in bytes × [`VTIME_SCALE`] / its weight.
    vtime: u64,
    /// Where its next round starts among its QPs (round robin).
    cursor: u32,
    /// Whether the scheduler left it wanting the last time it had work: a QP blocked, or a
    /// pump that spent its whole budget (more WRs may wait). Only such a vNIC holds others
    /// back (the floor): one whose QPs ran dry sends all it has, and what limits it (its
    /// client, its window, round trips) is not the link; waiting for its virtual time would
    /// leave the link idle.
    wanting: bool,
    /// The QPs it was left wanting for (blocked, not served, or their pump's budget spent):
    /// once every one of them is gone ([`Scheduler::forget`]), so is the want. A churner's
    /// QP blocked for want of room and destroyed before it came back otherwise left its
    /// vNIC holding the floor, with nothing to send, for `RECENT_NS`.
    left: Vec<u32>,
}

/// A tenant's caps and weight.
#[derive(Debug)]
struct TenantSched {
    weight: u32,
    caps: TokenBucket,
    /// While its cap holds its vNICs back: when they may all send again. They wake together,
    /// so its tokens go to the one furthest behind, not to whichever QP's wait ends first.
    turn_at: u64,
}

/// The scheduler.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    vnics: HashMap<String, VnicSched>,
    tenants: HashMap<String, TenantSched>,
    /// Throttled QPs: when to look at each again, and since when it waits.
    waiting: HashMap<u32, (u64, u64)>,
    /// Rounds so far (the first vNIC served rotates).
    rounds: u64,
    /// QPs left for want of room on the wire.
    blocked: Vec<u32>,
    /// vNICs that had work lately, and when they last did.
    recent: Vec<(String, u64)>,
    /// vNICs their caps (or their tenant's) hold back now: out of the fair-queuing floor.
    held: std::collections::HashSet<String>,
    /// What the scheduler did since it last logged (`vrdmad` at debug level, every second).
    trace: Trace,
    /// Whether two or more vNICs send at once (then lanes are held: `contention`).
    pub(crate) contention: Contention,
}

/// Counts for the scheduler's debug log.
#[derive(Debug, Default)]
struct Trace {
    since: u64,
    alone_rounds: u64,
    shared_rounds: u64,
    blocked_rounds: u64,
    sent: BTreeMap<String, (u64, u64)>,
}

impl Trace {
    fn note(&mut self, vnic: &str, b: &Budget) {
        if !log::log_enabled!(log::Level::Debug) {
            return;
        }
        match self.sent.get_mut(vnic) {
            Some(e) => {
                e.0 += b.sent_bytes;
                e.1 += 1;
            }
            None => {
                self.sent.insert(vnic.to_string(), (b.sent_bytes, 1));
            }
        }
    }

    fn maybe_log(&mut self, now: u64) {
        if now.saturating_sub(self.since) < 1_000_000_000 || !log::log_enabled!(log::Level::Debug) {
            return;
        }
        log::debug!(
            "qos: {} rounds alone, {} shared ({} with a full wire); sent (bytes, pumps): {:?}",
            self.alone_rounds,
            self.shared_rounds,
            self.blocked_rounds,
            self.sent
        );
        *self = Trace { since: now, ..Trace::default() };
    }
}

/// Data bytes the host's connections hold for mediated QPs (sent, not yet acknowledged): in
/// all, and per vNIC where known (a bare total is taken as every vNIC's own).
#[derive(Debug, Default)]
pub(crate) struct OnWire {
    pub(crate) total: u64,
    pub(crate) by_vnic: Option<HashMap<String, u64>>,
}

impl From<u64> for OnWire {
    fn from(total: u64) -> OnWire {
        OnWire { total, by_vnic: None }
    }
}

impl OnWire {
    /// What vNIC `name`'s QPs hold.
    fn of(&self, name: &str) -> u64 {
        match &self.by_vnic {
            Some(m) => m.get(name).copied().unwrap_or(0),
            None => self.total,
        }
    }
}

/// Which QPs must wait after a round.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// QPs deferred by their caps (they need no doorbell: the scheduler wakes them).
    pub(crate) throttled: Vec<u32>,
    /// QPs not served because the host's connections hold [`WIRE_LIMIT_BYTES`]: served in
    /// the next round after acknowledgements free room ([`Scheduler::take_blocked`]).
    pub(crate) blocked: Vec<u32>,
}

impl Scheduler {
    /// The policies of this host's vNICs (name → (tenant, policy)) and of tenants, from now
    /// on; throttled QPs are looked at again at once (a cap may have been raised).
    pub(crate) fn set_policies(&mut self, vnics: &HashMap<String, (String, Qos)>, tenants: &HashMap<String, Qos>, now: u64) {
        self.vnics.retain(|n, _| vnics.contains_key(n));
        for (name, (tenant, q)) in vnics {
            let s = self.vnics.entry(name.clone()).or_insert_with(|| VnicSched {
                tenant: tenant.clone(),
                weight: 1,
                caps: caps_of(q, now),
                vtime: 0,
                cursor: 0,
                wanting: false,
                left: Vec::new(),
            });
            s.tenant = tenant.clone();
            s.weight = q.weight.max(1);
            s.caps.set_caps(q.max_bw, q.max_msg_rate, now);
        }
        let mut wanted: HashMap<&str, Qos> = vnics.values().map(|(t, _)| (t.as_str(), Qos::default())).collect();
        for (t, q) in tenants {
            if let Some(w) = wanted.get_mut(t.as_str()) {
                *w = *q;
            }
        }
        self.tenants.retain(|t, _| wanted.contains_key(t.as_str()));
        for (t, q) in wanted {
            let s = self.tenants.entry(t.to_string()).or_insert_with(|| TenantSched { weight: 1, caps: caps_of(&q, now), turn_at: 0 });
            s.weight = q.weight.max(1);
            s.caps.set_caps(q.max_bw, q.max_msg_rate, now);
            s.turn_at = 0;
        }
        for w in self.waiting.values_mut() {
            w.0 = now;
        }
    }

    /// Whether vNIC `name`, or its tenant, has a cap.
    pub(crate) fn is_capped(&self, name: &str) -> bool {
        self.vnics.get(name).is_some_and(|v| v.caps.is_limited() || self.tenants.get(&v.tenant).is_some_and(|t| t.caps.is_limited()))
    }

    /// Whether vNIC `name` or its tenant has any policy (a cap or a weight other than 1).
    pub(crate) fn has_policy(&self, name: &str) -> bool {
        self.is_capped(name)
            || self.vnics.get(name).is_some_and(|v| v.weight != 1 || self.tenants.get(&v.tenant).is_some_and(|t| t.weight != 1))
    }

    /// Whether the lanes of vNIC `name` are held (the engine keeps their send side): it has
    /// a policy, or two or more of the host's vNICs send at once and it is not light
    /// (`contention`).
    pub(crate) fn holds_lane(&self, name: &str) -> bool {
        self.contention.holds(name) || self.has_policy(name)
    }

    /// QPs waiting for their caps now.
    pub(crate) fn throttled_qps(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.waiting.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// QP `qpn` is gone: it waits for nothing, and its vNIC wants nothing for it.
    pub(crate) fn forget(&mut self, qpn: u32) {
        self.waiting.remove(&qpn);
        for v in self.vnics.values_mut() {
            if let Some(at) = v.left.iter().position(|&q| q == qpn) {
                v.left.swap_remove(at);
                if v.left.is_empty() {
                    v.wanting = false;
                }
            }
        }
    }

    /// QPs left for want of room on the wire, to serve again (taken: each is reported once).
    pub(crate) fn take_blocked(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.blocked)
    }

    /// Whether QPs wait for room on the wire.
    pub(crate) fn has_blocked(&self) -> bool {
        !self.blocked.is_empty()
    }

    /// The throttled QPs due at `now` (to pump in the next round).
    pub(crate) fn due(&self, now: u64) -> Vec<u32> {
        self.waiting.iter().filter(|(_, (at, _))| *at <= now).map(|(q, _)| *q).collect()
    }

    /// When the next throttled QP is due.
    pub(crate) fn next_due(&self) -> Option<u64> {
        self.waiting.values().map(|(at, _)| *at).min()
    }

    /// Whether every QP of `qps` is of one vNIC with no caps (its own or its tenant's), and
    /// no other vNIC had work lately (then it has the link to itself). Notes who had work.
    fn is_alone<Q: Pumpable>(&mut self, qps: &[Q], now: u64) -> bool {
        let Some(first) = qps.first() else { return true };
        let name = first.vnic();
        if !qps.iter().all(|q| q.vnic() == name) {
            for q in qps {
                self.saw(q.vnic(), now);
            }
            return false;
        }
        self.saw(name, now);
        self.recent.retain(|(_, t)| now.saturating_sub(*t) < RECENT_NS);
        self.recent.len() == 1 && !self.is_capped(name)
    }

    /// The slowest virtual time among the vNICs that had work lately (but `except`, and
    /// those their caps hold back); with `wanting_only`, among those the scheduler left
    /// wanting only (who may hold the others back).
    fn floor(&self, now: u64, except: Option<&str>, wanting_only: bool) -> Option<u64> {
        self.recent
            .iter()
            .filter(|(n, t)| now.saturating_sub(*t) < RECENT_NS && Some(n.as_str()) != except && !self.held.contains(n))
            .filter_map(|(n, _)| self.vnics.get(n))
            .filter(|v| v.wanting || !wanting_only)
            .map(|v| v.vtime)
            .min()
    }

    /// vNIC `name` had work at `now`.
    fn saw(&mut self, name: &str, now: u64) {
        match self.recent.iter_mut().find(|(n, _)| n == name) {
            Some(r) => r.1 = r.1.max(now),
            None => self.recent.push((name.to_string(), now)),
        }
    }

    /// One round over `qps` (those with work; duplicates ignored) at `now`; `on_wire()` is
    /// what the host's connections hold (asked only when vNICs share the link).
    pub(crate) fn round<Q: Pumpable, W: Into<OnWire>>(&mut self, qps: &[Q], now: u64, on_wire: impl FnOnce() -> W) -> Round {
        if self.waiting.is_empty() && self.blocked.is_empty() && self.is_alone(qps, now) {
            // One vNIC without caps has the link to itself: each QP one pump, no bookkeeping
            // (the latency path of a lone ping-pong allocates nothing here).
            let mut pumped = Vec::with_capacity(0);
            for q in qps {
                if qps.len() > 1 && pumped.contains(&q.qpn()) {
                    continue;
                }
                if qps.len() > 1 {
                    pumped.push(q.qpn());
                }
                // (The rest of a large WR a few segments at a time: nobody else's frames go
                // between them, and a pump per segment cost a stream a sixth of its rate.)
                let mut b = if q.streams() { Budget::new(PUMP_BUDGET_WRS, ALONE_SEGMENT_BYTES) } else { Budget::default() };
                q.pump(&mut b);
                self.trace.note(q.vnic(), &b);
            }
            self.trace.alone_rounds += 1;
            self.trace.maybe_log(now);
            return Round::default();
        }
        let mut out = Round::default();
        let mut groups: BTreeMap<&str, Vec<&Q>> = BTreeMap::new();
        let mut seen = std::collections::HashSet::new();
        for q in qps {
            if seen.insert(q.qpn()) {
                groups.entry(q.vnic()).or_default().push(q);
            }
        }
        for g in groups.values_mut() {
            g.sort_by_key(|q| q.qpn());
        }
        // A vNIC the policies do not know yet (just created): uncapped, weight 1, alone.
        for name in groups.keys() {
            self.vnics.entry(name.to_string()).or_insert_with(|| VnicSched {
                tenant: String::new(),
                weight: 1,
                caps: caps_of(&Qos::default(), now),
                vtime: 0,
                cursor: 0,
                wanting: false,
                left: Vec::new(),
            });
        }
        // A vNIC's weight: its own times its tenant's (weights multiply, so both `vrdma
        // vnic qos --weight` and `vrdma tenant qos --weight` compare across tenants).
        let weights: HashMap<&str, u64> = groups
            .keys()
            .map(|name| {
                let v = &self.vnics[*name];
                let tw = self.tenants.get(&v.tenant).map_or(1, |t| t.weight);
                (*name, u64::from(tw) * u64::from(v.weight))
            })
            .collect();
        // Fair queuing by virtual time: each vNIC's clock advances by what it sends divided
        // by its weight, and only vNICs within a quantum of the slowest clock among those
        // that had work lately may send. A vNIC whose QPs were away a moment (waiting for an
        // acknowledgement, their client descheduled) keeps its place: the others wait for
        // it (the doorbell thread looks again within a millisecond, or at once when it
        // returns), instead of taking its share. One idle longer than `RECENT_NS` starts
        // again level with the others (no credit saved from idleness).
        // A vNIC held back by its caps holds nobody else back: it is left out of the floor
        // while its caps hold it, and rejoins level with the others (its cap, not the
        // others, decided what it sent meanwhile).
        for name in groups.keys() {
            let Some(v) = self.vnics.get_mut(*name) else { continue };
            let tenant_ready = self.tenants.get_mut(&v.tenant).map_or(now, |t| t.caps.ready_at(now));
            let capped = v.caps.ready_at(now).max(tenant_ready) > now;
            let was_held = self.held.contains(*name);
            if capped && !was_held {
                self.held.insert(name.to_string());
            } else if !capped && was_held {
                self.held.remove(*name);
                let floor = self.floor(now, Some(name), false);
                if let (Some(f), Some(v)) = (floor, self.vnics.get_mut(*name)) {
                    v.vtime = v.vtime.max(f);
                }
            }
        }
        for name in groups.keys() {
            let was_recent = self.recent.iter().any(|(n, t)| n == name && now.saturating_sub(*t) < RECENT_NS);
            if !was_recent {
                let floor = self.floor(now, Some(name), false);
                if let (Some(f), Some(v)) = (floor, self.vnics.get_mut(*name)) {
                    v.vtime = v.vtime.max(f);
                }
            }
            self.saw(name, now);
        }
        self.recent.retain(|(_, t)| now.saturating_sub(*t) < RECENT_NS);
        // Only a vNIC the scheduler keeps from sending holds the others back: one that
        // sends all it has (a flood of small WRs paced by its client, a churner's few
        // SENDs) would otherwise pace every other vNIC to its own slow clock.
        let floor = self.floor(now, None, true);
        let wire: OnWire = on_wire().into();
        let mut room = WIRE_LIMIT_BYTES.saturating_sub(wire.total);
        let total_weight = weights.values().sum::<u64>().max(1);
        let mut names: Vec<&str> = groups.keys().copied().collect();
        // The furthest behind first; ties in turn.
        let rotate = self.rounds as usize;
        self.rounds += 1;
        let len = names.len().max(1);
        names.rotate_left(rotate % len);
        names.sort_by_key(|n| self.vnics.get(*n).map_or(0, |v| v.vtime));
        for name in names {
            let group = &groups[name];
            let weight = weights[name].max(1);
            let Some(vs) = self.vnics.get_mut(name) else { continue };
            let own_ready = vs.caps.ready_at(now);
            let tenant = self.tenants.get_mut(&vs.tenant).map(|t| {
                let ready = t.caps.ready_at(now);
                (t, ready)
            });
            let (ready, at) = match tenant {
                Some((t, tenant_ready)) if tenant_ready > now => {
                    let ready = own_ready.max(tenant_ready);
                    let at = ready.max(now + MIN_WAIT_NS);
                    t.turn_at = t.turn_at.max(at);
                    (ready, t.turn_at)
                }
                // Its tenant's cap has tokens again, but its vNICs take their turn together.
                Some((t, _)) if t.turn_at > now => {
                    let at = if own_ready > t.turn_at { own_ready.max(now + MIN_WAIT_NS) } else { t.turn_at };
                    (own_ready.max(t.turn_at), at)
                }
                _ => (own_ready, own_ready.max(now + MIN_WAIT_NS)),
            };
            if ready > now {
                for q in group {
                    let since = self.waiting.get(&q.qpn()).map_or(now, |w| w.1);
                    self.waiting.insert(q.qpn(), (at, since));
                    out.throttled.push(q.qpn());
                }
                continue;
            }
            // Not throttled (any more): the time waited is metered.
            for q in group {
                if let Some((_, since)) = self.waiting.remove(&q.qpn()) {
                    q.throttled_for(now.saturating_sub(since));
                }
            }
            // A vNIC below its share of the wire (by weight, among those in this round) may
            // fill it however full the wire is: what the others hold never blocks it. Bytes
            // can stay unacknowledged for as long as their sender likes (a peer QP that is
            // gone, with a QP timeout of 0; a lane its client paces to a byte a second), and
            // before, 1 MiB of them stopped every vNIC of the host.
            let share = WIRE_LIMIT_BYTES.saturating_mul(weight) / total_weight;
            let mut vroom = room.max(share.saturating_sub(wire.of(name)));
            let ahead = floor.is_some_and(|f| vs.vtime > f + VTIME_SLACK);
            if vroom == 0 || ahead {
                // The wire is full (and this vNIC has its share of it), or this vNIC is
                // ahead of one kept waiting: served again when acknowledgements free room
                // or that one catches up.
                vs.left.clear();
                for q in group {
                    if !ahead && q.owes_segments() {
                        // The rest of a WRITE or SEND begun in segments: its bytes are on
                        // the wire's account already, and no acknowledgement comes until
                        // they are sent. Continued, nothing new started.
                        let mut b = Budget::new(0, PUMP_BUDGET_BYTES);
                        q.pump(&mut b);
                        self.trace.note(name, &b);
                        if !q.reads_waiting() {
                            continue;
                        }
                        // (Its READs got nothing from that pump: it waits for room, or
                        // the doorbell thread would pump it again at once, for nothing.)
                    }
                    self.blocked.push(q.qpn());
                    out.blocked.push(q.qpn());
                    vs.left.push(q.qpn());
                }
                // (Waiting for its own acknowledgements, it holds nobody back: those may
                // never come.)
                vs.wanting = ahead;
                continue;
            }
            let quantum = (QUANTUM_BYTES as u64).saturating_mul(weight);
            let mut spent = 0u64;
            let n = group.len();
            vs.wanting = false;
            vs.left.clear();
            for k in 0..n {
                if spent >= quantum || vroom == 0 {
                    // (QPs left unserved this round.)
                    vs.wanting = true;
                    // (The cursor is at the first of them.)
                    let first = vs.cursor as usize;
                    vs.left.extend((0..n - k).map(|j| group[(first + j) % n].qpn()));
                    break;
                }
                let idx = (vs.cursor as usize + k) % n;
                let q = group[idx];
                let (mut wrs, mut bytes) = vs.caps.available(now);
                if let Some(t) = self.tenants.get_mut(&vs.tenant) {
                    let (tw, tb) = t.caps.available(now);
                    wrs = wrs.min(tw);
                    bytes = bytes.min(tb);
                }
                let bytes = bytes.min(quantum - spent).min(vroom).max(1);
                let mut b = Budget::new(
                    SHARED_PUMP_WRS.min(usize::try_from(wrs.max(1)).unwrap_or(usize::MAX)),
                    PUMP_BUDGET_BYTES.min(usize::try_from(bytes).unwrap_or(usize::MAX)),
                );
                q.pump_timed(&mut b);
                self.trace.note(name, &b);
                if !b.allows_more() {
                    vs.wanting = true;
                    vs.left.push(q.qpn());
                }
                vs.caps.charge_at(now, b.sent_wrs, b.sent_bytes);
                if let Some(t) = self.tenants.get_mut(&vs.tenant) {
                    t.caps.charge_at(now, b.sent_wrs, b.sent_bytes);
                }
                room = room.saturating_sub(b.sent_bytes);
                vroom = vroom.saturating_sub(b.sent_bytes);
                let cost = (b.sent_bytes + b.sent_wrs * WR_COST_BYTES).max(b.busy_ns.saturating_mul(THREAD_NS_COST_BYTES));
                spent += cost;
                vs.vtime += cost * VTIME_SCALE / weight;
                vs.cursor = ((idx + 1) % n) as u32;
            }
            if !vs.wanting {
                // Sent all it had: it keeps a lead of at most the slack on those the
                // scheduler keeps waiting (served first while it stays light), not a credit
                // that would hold them all back once it has a backlog of its own.
                if let Some(f) = floor {
                    vs.vtime = vs.vtime.max(f.saturating_sub(VTIME_SLACK));
                }
            }
        }
        self.trace.shared_rounds += 1;
        self.trace.blocked_rounds += u64::from(!out.blocked.is_empty());
        self.trace.maybe_log(now);
        out
    }
}

#[cfg(test)]
mod tests;
