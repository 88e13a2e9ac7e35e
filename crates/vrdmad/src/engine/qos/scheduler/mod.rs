//! The egress scheduler of the doorbell thread: caps (token buckets per vNIC and per tenant,
//! bytes and WRs) and weighted fair queuing between vNICs (deficit round robin over vNICs,
//! each vNIC's quantum proportional to its weight times its tenant's, and round robin over
//! the QPs of each vNIC), so a vNIC's share does not grow with its QP count.
//!
//! Pure logic over an explicit clock: the doorbell thread hands it the QPs that have work and
//! the time; it pumps them through [`Pumpable`] with a [`Budget`] each and says which must
//! wait, until when. A QP that waits keeps its WRs in its send ring (they complete later):
//! back-pressure, never an error or a drop.

use std::collections::{BTreeMap, HashMap};

use vrdma_abi::control::Qos;

use super::bucket::TokenBucket;

/// How much a bucket may hold: 10 ms of its rate. Small against the 100 ms windows caps are
/// exact over, large against the doorbell thread's 1 ms timer.
pub(crate) const BUCKET_DEPTH_NS: u64 = 10_000_000;

/// Bytes a vNIC of weight 1, alone in a tenant of weight 1, may send per round.
pub(crate) const QUANTUM_BYTES: i64 = 64 << 10;

/// What a WR costs in a round beyond its payload (a frame header, and the work per WR), so
/// floods of small messages share fairly too.
pub(crate) const WR_COST_BYTES: u64 = 64;

/// Most WRs one pump of a QP sends before the others are served.
pub(crate) const PUMP_BUDGET_WRS: usize = 64;

/// Most payload bytes one pump of a QP sends (past it, the WR in progress still goes).
pub(crate) const PUMP_BUDGET_BYTES: usize = 256 << 10;

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
}

impl Budget {
    /// A budget of `wrs` WRs and `bytes` bytes.
    pub(crate) fn new(wrs: usize, bytes: usize) -> Budget {
        Budget { wrs, bytes, sent_wrs: 0, sent_bytes: 0 }
    }

    /// Whether another WR may start.
    pub(crate) fn allows_more(&self) -> bool {
        self.wrs > 0 && self.bytes > 0
    }

    /// A WR of `len` payload bytes went.
    pub(crate) fn spend(&mut self, len: u32) {
        self.wrs = self.wrs.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(len as usize);
        self.sent_wrs += 1;
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
    /// Its number.
    fn qpn(&self) -> u32;
    /// Its vNIC.
    fn vnic(&self) -> &str;
    /// Sends up to `budget`, recording what it sent there.
    fn pump(&self, budget: &mut Budget);
    /// Whether it has WRs it could send now.
    fn has_work(&self) -> bool;
    /// It waited `ns` nanoseconds for its caps (metered as time throttled).
    fn throttled_for(&self, ns: u64);
}

/// A pair of buckets: bytes and WRs.
#[derive(Clone, Debug)]
struct Caps {
    bytes: TokenBucket,
    wrs: TokenBucket,
}

impl Caps {
    fn new(q: &Qos, now: u64) -> Caps {
        Caps { bytes: TokenBucket::new(q.max_bw, BUCKET_DEPTH_NS, now), wrs: TokenBucket::new(q.max_msg_rate, BUCKET_DEPTH_NS, now) }
    }

    fn set(&mut self, q: &Qos, now: u64) {
        self.bytes.set_rate(q.max_bw, now);
        self.wrs.set_rate(q.max_msg_rate, now);
    }

    /// When these caps let something go again (`now` if they do now).
    fn ready_at(&mut self, now: u64) -> u64 {
        self.bytes.ready_at(now).max(self.wrs.ready_at(now))
    }

    /// (WRs, bytes) they allow now.
    fn allowance(&mut self, now: u64) -> (u64, u64) {
        (self.wrs.available(now), self.bytes.available(now))
    }

    fn charge(&mut self, wrs: u64, bytes: u64) {
        self.wrs.charge(wrs);
        self.bytes.charge(bytes);
    }

    fn is_limited(&self) -> bool {
        self.bytes.is_limited() || self.wrs.is_limited()
    }
}

/// A vNIC's scheduling state.
#[derive(Debug)]
struct VnicSched {
    tenant: String,
    weight: u32,
    caps: Caps,
    /// Deficit round robin: bytes it may still send (negative: owed from a WR larger than
    /// what it had).
    deficit: i64,
    /// Where its next round starts among its QPs (round robin).
    cursor: u32,
}

/// A tenant's caps and weight.
#[derive(Debug)]
struct TenantSched {
    weight: u32,
    caps: Caps,
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
}

/// Which QPs must wait for their caps after a round.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// QPs deferred by their caps (they need no doorbell: the scheduler wakes them).
    pub(crate) throttled: Vec<u32>,
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
                caps: Caps::new(q, now),
                deficit: 0,
                cursor: 0,
            });
            s.tenant = tenant.clone();
            s.weight = q.weight.max(1);
            s.caps.set(q, now);
        }
        let mut wanted: HashMap<&str, Qos> = vnics.values().map(|(t, _)| (t.as_str(), Qos::default())).collect();
        for (t, q) in tenants {
            if let Some(w) = wanted.get_mut(t.as_str()) {
                *w = *q;
            }
        }
        self.tenants.retain(|t, _| wanted.contains_key(t.as_str()));
        for (t, q) in wanted {
            let s = self.tenants.entry(t.to_string()).or_insert_with(|| TenantSched { weight: 1, caps: Caps::new(&q, now) });
            s.weight = q.weight.max(1);
            s.caps.set(&q, now);
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

    /// vNICs with a QP waiting for its caps now.
    pub(crate) fn throttled_vnics(&self, qp_vnic: impl Fn(u32) -> Option<String>) -> Vec<String> {
        let mut v: Vec<String> = self.waiting.keys().filter_map(|q| qp_vnic(*q)).collect();
        v.sort();
        v.dedup();
        v
    }

    /// QP `qpn` is gone.
    pub(crate) fn forget(&mut self, qpn: u32) {
        self.waiting.remove(&qpn);
    }

    /// The throttled QPs due at `now` (to pump in the next round).
    pub(crate) fn due(&self, now: u64) -> Vec<u32> {
        self.waiting.iter().filter(|(_, (at, _))| *at <= now).map(|(q, _)| *q).collect()
    }

    /// When the next throttled QP is due.
    pub(crate) fn next_due(&self) -> Option<u64> {
        self.waiting.values().map(|(at, _)| *at).min()
    }

    /// Whether every QP of `qps` is of one vNIC with no caps (its own or its tenant's).
    fn is_free<Q: Pumpable>(&self, qps: &[Q]) -> bool {
        let Some(first) = qps.first() else { return true };
        let name = first.vnic();
        qps.iter().all(|q| q.vnic() == name) && !self.is_capped(name)
    }

    /// One round over `qps` (those with work; duplicates ignored) at `now`.
    pub(crate) fn round<Q: Pumpable>(&mut self, qps: &[Q], now: u64) -> Round {
        if self.waiting.is_empty() && self.is_free(qps) {
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
                q.pump(&mut Budget::default());
            }
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
                caps: Caps::new(&Qos::default(), now),
                deficit: 0,
                cursor: 0,
            });
        }
        // A vNIC's quantum: its weight times its tenant's (weights multiply, so both
        // `vrdma vnic qos --weight` and `vrdma tenant qos --weight` compare across tenants).
        let quanta: HashMap<&str, i64> = groups
            .keys()
            .map(|name| {
                let v = &self.vnics[*name];
                let tw = self.tenants.get(&v.tenant).map_or(1, |t| t.weight);
                let q = QUANTUM_BYTES.saturating_mul(i64::from(tw)).saturating_mul(i64::from(v.weight));
                (*name, q)
            })
            .collect();
        let names: Vec<&str> = groups.keys().copied().collect();
        let start = (self.rounds % names.len().max(1) as u64) as usize;
        self.rounds += 1;
        let mut sent_any = false;
        for i in 0..names.len() {
            let name = names[(start + i) % names.len()];
            let group = &groups[name];
            let Some(vs) = self.vnics.get_mut(name) else { continue };
            let tenant = self.tenants.get_mut(&vs.tenant);
            let ready = match tenant {
                Some(t) => vs.caps.ready_at(now).max(t.caps.ready_at(now)),
                None => vs.caps.ready_at(now),
            };
            if ready > now {
                let at = ready.max(now + MIN_WAIT_NS);
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
            vs.deficit = vs.deficit.saturating_add(quanta[name]);
            let n = group.len();
            let mut any_work = false;
            for k in 0..n {
                if vs.deficit <= 0 {
                    any_work = true;
                    break;
                }
                let idx = (vs.cursor as usize + k) % n;
                let q = group[idx];
                let (mut wrs, mut bytes) = vs.caps.allowance(now);
                if let Some(t) = self.tenants.get_mut(&vs.tenant) {
                    let (tw, tb) = t.caps.allowance(now);
                    wrs = wrs.min(tw);
                    bytes = bytes.min(tb);
                }
                if wrs == 0 && bytes == 0 {
                    any_work = true;
                    break;
                }
                let bytes = bytes.min(u64::try_from(vs.deficit).unwrap_or(0)).max(1);
                let mut b = Budget::new(
                    PUMP_BUDGET_WRS.min(usize::try_from(wrs.max(1)).unwrap_or(usize::MAX)),
                    PUMP_BUDGET_BYTES.min(usize::try_from(bytes).unwrap_or(usize::MAX)),
                );
                q.pump(&mut b);
                vs.caps.charge(b.sent_wrs, b.sent_bytes);
                if let Some(t) = self.tenants.get_mut(&vs.tenant) {
                    t.caps.charge(b.sent_wrs, b.sent_bytes);
                }
                let cost = b.sent_bytes + b.sent_wrs * WR_COST_BYTES;
                vs.deficit = vs.deficit.saturating_sub(i64::try_from(cost).unwrap_or(i64::MAX));
                sent_any |= b.sent_wrs > 0;
                vs.cursor = ((idx + 1) % n) as u32;
                any_work |= q.has_work();
            }
            if !any_work {
                // Idle: no credit saved for later (a debt stays).
                vs.deficit = vs.deficit.min(0);
            }
        }
        if !sent_any {
            // Every vNIC with work owes more than one quantum (WRs larger than their
            // quanta): skip the empty rounds, as if they had run, up to the one in which the
            // first of them may send again.
            let owed: Vec<(&str, i64)> = names
                .iter()
                .filter(|n| !out.throttled.iter().any(|q| groups[*n].iter().any(|g| g.qpn() == *q)))
                .map(|n| (*n, self.vnics[*n].deficit))
                .filter(|(_, d)| *d <= 0)
                .collect();
            let rounds = owed.iter().map(|(n, d)| (-d) / quanta[n]).min();
            if let Some(k) = rounds {
                for (n, _) in &owed {
                    if let Some(v) = self.vnics.get_mut(*n) {
                        v.deficit = v.deficit.saturating_add(quanta[n].saturating_mul(k));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
