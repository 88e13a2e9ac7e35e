//! Fair sharing for lanes: while two or more of this host's vNICs send across hosts at once,
//! the lanes of every vNIC that is not *light* are held (the engine keeps their send side,
//! `MedQp::hold_lane`), so their small WRs too go through the scheduler's weighted fair
//! queuing; a vNIC sending alone keeps its lanes, and with them their latency.
//!
//! A light vNIC (a ping-pong, a request now and then: few bytes and a WR rate a round trip
//! bounds, [`LIGHT_BYTES_PER_TICK`], [`LIGHT_WRS_PER_TICK`]) keeps its lanes under contention
//! too: it takes next to nothing of the link, and through the doorbell thread its every
//! message would wait behind the heavy vNICs' pumps (a ping-pong beside a READ storm: 118 µs
//! from the ping's arrival to the pong's send, against none on the lane). A vNIC is heavy from the
//! first sample that finds it over the bounds until [`LIGHT_AFTER_NS`] of samples below.
//!
//! Who sends is read from what the engine holds anyway: each mediated QP's send-ring tail
//! (every WR a client posts moves it, whether the client then writes it to its lane or
//! not). A client cannot hide its sending (a WR not in its ring is never completed nor
//! adopted), and faking it (posting) only makes the host hold lanes, as real sending would.
//! A watcher thread samples the tails every [`TICK`] ([`watch_contention`]); the decision is
//! [`Contention`], pure, on an explicit clock.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use crate::engine::Engine;

/// How often the tails are sampled: lanes are held within this (plus a sample's delay) of a
/// second vNIC starting to send.
pub(crate) const TICK: Duration = Duration::from_millis(10);

/// How long the watcher sleeps while the engine has no lane QP, unless one attaches (which
/// wakes it): it looks again only to notice that the engine stopped.
pub(crate) const IDLE_TICK: Duration = Duration::from_secs(1);

/// A vNIC counts as sending for this long after its ring last moved (a ping-pong's client
/// posts once per round trip; a bandwidth test's every few microseconds).
pub(crate) const ACTIVE_NS: u64 = 50_000_000;

/// Lanes come back after this long with at most one vNIC sending (no flapping between held
/// and not while two vNICs take turns).
pub(crate) const RELEASE_AFTER_NS: u64 = 200_000_000;

/// A heavy vNIC is light again after this long below the bounds: five ticks, so that a
/// bulk transfer's pauses do not give its lanes back, while an application that turns to
/// ping-pong (a benchmark's latency run after its bandwidth run) gets them back soon.
pub(crate) const LIGHT_AFTER_NS: u64 = 50_000_000;

/// Most bytes a light vNIC's WRs carry in a tick (25.6 MB/s): a 64-byte ping-pong at
/// 100,000 round trips a second is a quarter of it.
pub(crate) const LIGHT_BYTES_PER_TICK: u64 = 256 << 10;

/// Most WRs a light vNIC posts in a tick (100,000 a second): more than one QP's ping-pong
/// across hosts (a 15 µs round trip is 67,000 WRs a second on each side).
pub(crate) const LIGHT_WRS_PER_TICK: u64 = 1000;

/// One mediated QP as the watcher samples it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpSample<'a> {
    pub(crate) qpn: u32,
    pub(crate) vnic: &'a str,
    /// WRs it sent since it was made: its send ring's tail, plus the engine's resends (an
    /// RNR storm posts its WRs once and then only resends them).
    pub(crate) tail: u64,
    /// Bytes its completed WRs carried, from its meter.
    pub(crate) bytes: u64,
}

/// Which vNICs sent lately, and whether lanes are held for it.
#[derive(Debug, Default)]
pub(crate) struct Contention {
    /// Each QP's send-ring tail and bytes sent at the last sample.
    tails: HashMap<u32, (u64, u64)>,
    /// vNICs found over the light bounds, and when last.
    heavy: HashMap<String, u64>,
    /// vNICs whose rings moved lately, and when they last did.
    active: HashMap<String, u64>,
    contended: bool,
    /// Since when at most one vNIC sends (while contended).
    calm_since: Option<u64>,
}

impl Contention {
    /// Whether two or more vNICs send now.
    #[cfg(test)]
    pub(crate) fn is_contended(&self) -> bool {
        self.contended
    }

    /// Whether the lanes of vNIC `name` are held for fair sharing now: vNICs contend, and it
    /// is not light.
    pub(crate) fn holds(&self, name: &str) -> bool {
        self.contended && self.heavy.contains_key(name)
    }

    /// The vNICs over the light bounds lately (for the log).
    pub(crate) fn heavy_vnics(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.heavy.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// The vNICs counted as sending now (for the log).
    pub(crate) fn active_vnics(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.active.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// One sample at `now_ns` of each mediated QP; returns whether vNICs contend from now on.
    pub(crate) fn sample<'a>(&mut self, now_ns: u64, qps: impl IntoIterator<Item = QpSample<'a>>) -> bool {
        let mut tails = HashMap::with_capacity(self.tails.len());
        // Per vNIC: WRs posted and bytes sent since the last sample.
        let mut load: HashMap<&str, (u64, u64)> = HashMap::new();
        for q in qps {
            // (A QP seen for the first time sets its baseline.)
            if let Some(&(tail, bytes)) = self.tails.get(&q.qpn) {
                if tail != q.tail {
                    stamp(&mut self.active, q.vnic, now_ns);
                }
                let l = load.entry(q.vnic).or_default();
                l.0 += q.tail.saturating_sub(tail);
                l.1 += q.bytes.saturating_sub(bytes);
            }
            tails.insert(q.qpn, (q.tail, q.bytes));
        }
        self.tails = tails;
        for (vnic, (wrs, bytes)) in load {
            if bytes > LIGHT_BYTES_PER_TICK || wrs > LIGHT_WRS_PER_TICK {
                stamp(&mut self.heavy, vnic, now_ns);
            }
        }
        self.heavy.retain(|_, t| now_ns.saturating_sub(*t) < LIGHT_AFTER_NS);
        self.active.retain(|_, t| now_ns.saturating_sub(*t) < ACTIVE_NS);
        if self.active.len() >= 2 {
            self.contended = true;
            self.calm_since = None;
        } else if self.contended {
            let since = *self.calm_since.get_or_insert(now_ns);
            if now_ns.saturating_sub(since) >= RELEASE_AFTER_NS {
                self.contended = false;
                self.calm_since = None;
            }
        }
        self.contended
    }
}

/// Records that vNIC `name` was seen at `now_ns` (allocating its name only the first time).
fn stamp(seen: &mut HashMap<String, u64>, name: &str, now_ns: u64) {
    match seen.get_mut(name) {
        Some(t) => *t = now_ns,
        None => {
            seen.insert(name.to_string(), now_ns);
        }
    }
}

/// What the watcher reads of a QP: its send ring's tail plus the engine's resends (both
/// WRs that take the link), and its meter's bytes sent.
fn sample_of(q: &crate::engine::qp::MedQp) -> (u32, String, u64, u64) {
    let w = q.meter.read();
    let bytes = (0..vrdma_abi::ring::METER_OPCODES).map(|i| w[2 * i + 1]).sum();
    (q.qpn, q.vnic.clone(), q.sq.tail_pos().wrapping_add(w[vrdma_abi::ring::METER_RETRANSMITS]), bytes)
}

/// The watcher: every [`TICK`], samples the send rings and meters of the engine's QPs and
/// holds or gives back each lane as contention and its vNIC's load say (a lane of a vNIC
/// with a policy stays held either way). Ends with the engine. Only while the engine has
/// lane QPs does it look at anything (otherwise it sleeps until one attaches).
pub(crate) fn watch_contention(engine: Weak<Engine>) {
    let started = std::time::Instant::now();
    let mut pause = TICK;
    loop {
        if pause == IDLE_TICK {
            std::thread::park_timeout(pause);
        } else {
            std::thread::sleep(pause);
        }
        let Some(e) = engine.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let samples: Vec<(u32, String, u64, u64)> = {
            let qps = e.qps.read();
            if !qps.values().any(|q| q.lane) {
                // (Nothing to hold; a lane QP attached later starts as the last decision
                // says, wakes this thread, and the next samples correct it. An idle daemon
                // wakes once a second: on a VM each wakeup costs tens of microseconds.)
                pause = IDLE_TICK;
                continue;
            }
            pause = TICK;
            qps.values().map(|q| sample_of(q)).collect()
        };
        let now = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // (The scheduler's lock before the QP table's, as everywhere.)
        let mut qos = e.qos.lock();
        let held = qos.contention.sample(
            now,
            samples.iter().map(|(qpn, vnic, tail, bytes)| QpSample { qpn: *qpn, vnic: vnic.as_str(), tail: *tail, bytes: *bytes }),
        );
        let (mut holding, mut giving_back) = (0usize, 0usize);
        for q in e.qps.read().values().filter(|q| q.lane) {
            let hold = qos.holds_lane(&q.vnic);
            if q.hold_lane(hold) {
                *if hold { &mut holding } else { &mut giving_back } += 1;
            }
        }
        if holding + giving_back == 0 {
            continue;
        }
        let active = qos.contention.active_vnics().join(", ");
        let heavy = qos.contention.heavy_vnics().join(", ");
        drop(qos);
        let what = match (holding, giving_back) {
            (h, 0) => format!("holding {h} lane(s)"),
            (0, g) => format!("giving back {g} lane(s)"),
            (h, g) => format!("holding {h} lane(s), giving back {g}"),
        };
        log::info!(
            "engine: {} vNICs send across hosts ({active}; heavy: {heavy}): {what}",
            if held { "two or more" } else { "at most one of the" }
        );
        e.kick();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A QP whose every posted WR completed, with nothing sent (light by bytes).
    fn qp(qpn: u32, vnic: &str, tail: u64) -> QpSample<'_> {
        QpSample { qpn, vnic, tail, bytes: 0 }
    }

    /// Samples every 10 ms from `from` to `to` ms; `moving(t)` names the vNICs whose QP
    /// (one each: a = 1, b = 2) posted since the last sample. Returns the last decision.
    fn run(c: &mut Contention, tails: &mut [u64; 2], from: u64, to: u64, moving: impl Fn(u64) -> Vec<&'static str>) -> bool {
        let mut held = c.is_contended();
        for t in (from..to).step_by(10) {
            for v in moving(t) {
                tails[usize::from(v == "b")] += 1;
            }
            held = c.sample(t * MS, [qp(1, "a", tails[0]), qp(2, "b", tails[1])]);
        }
        held
    }

    #[test]
    fn one_vnic_alone_keeps_its_lanes() {
        let mut c = Contention::default();
        let mut tails = [0, 0];
        assert!(!run(&mut c, &mut tails, 0, 1000, |_| vec!["a"]));
    }

    #[test]
    fn two_sending_vnics_hold_lanes_within_a_tick() {
        let mut c = Contention::default();
        let mut tails = [0, 0];
        run(&mut c, &mut tails, 0, 100, |_| vec!["a"]);
        assert!(!c.is_contended());
        // b starts: the first sample after its post decides.
        assert!(run(&mut c, &mut tails, 100, 120, |_| vec!["a", "b"]));
    }

    #[test]
    fn lanes_come_back_only_after_a_calm_spell() {
        let mut c = Contention::default();
        let mut tails = [0, 0];
        run(&mut c, &mut tails, 0, 100, |_| vec!["a", "b"]);
        assert!(c.is_contended());
        // b stops: still held for ACTIVE_NS + RELEASE_AFTER_NS.
        assert!(run(&mut c, &mut tails, 100, 300, |_| vec!["a"]));
        assert!(!run(&mut c, &mut tails, 300, 400, |_| vec!["a"]));
    }

    #[test]
    fn vnics_taking_turns_within_the_window_count_as_sharing() {
        let mut c = Contention::default();
        let mut tails = [0, 0];
        // a in even 20 ms slots, b in odd ones: both active within 50 ms.
        let turns = |t: u64| if (t / 20).is_multiple_of(2) { vec!["a"] } else { vec!["b"] };
        assert!(run(&mut c, &mut tails, 0, 1000, turns));
    }

    #[test]
    fn a_new_qp_sets_its_baseline_without_counting_as_sending() {
        let mut c = Contention::default();
        assert!(!c.sample(0, [qp(1, "a", 5)]));
        assert!(!c.sample(10 * MS, [qp(1, "a", 6), qp(2, "b", 1_000)]));
        assert!(c.sample(20 * MS, [qp(1, "a", 7), qp(2, "b", 1_001)]));
    }

    /// Samples every 10 ms from `from` to `to` ms of a ping-pong vNIC "light" (600 WRs of 8
    /// bytes a tick: a 17 µs round trip) and a vNIC "other" whose tick `load` gives (WRs
    /// posted, bytes sent).
    fn run_light(c: &mut Contention, st: &mut [(u64, u64); 2], from: u64, to: u64, load: impl Fn(u64) -> (u64, u64)) {
        for t in (from..to).step_by(10) {
            st[0].0 += 600;
            st[0].1 += 600 * 8;
            let (wrs, bytes) = load(t);
            st[1].0 += wrs;
            st[1].1 += bytes;
            c.sample(
                t * MS,
                [
                    QpSample { qpn: 1, vnic: "light", tail: st[0].0, bytes: st[0].1 },
                    QpSample { qpn: 2, vnic: "other", tail: st[1].0, bytes: st[1].1 },
                ],
            );
        }
    }

    /// A ping-pong beside a bulk sender keeps its lanes (its messages would wait behind the
    /// bulk's pumps in the doorbell thread); the bulk's are held.
    #[test]
    fn a_light_vnic_keeps_its_lanes_beside_a_heavy_one() {
        let mut c = Contention::default();
        let mut st = [(0, 0); 2];
        run_light(&mut c, &mut st, 0, 200, |_| (160, 160 * 65536));
        assert!(c.is_contended());
        assert!(!c.holds("light"), "the ping-pong's lanes were held");
        assert!(c.holds("other"), "the bulk sender's lanes were not held");
    }

    /// Small WRs faster than a round trip allows are heavy though they carry few bytes (a
    /// flood of 8-byte WRs); a second ping-pong is not.
    #[test]
    fn many_small_wrs_make_a_vnic_heavy() {
        let mut c = Contention::default();
        let mut st = [(0, 0); 2];
        run_light(&mut c, &mut st, 0, 100, |_| (5000, 5000 * 8));
        assert!(c.holds("other"), "a flood of 8-byte WRs kept its lanes");
        let mut c = Contention::default();
        let mut st = [(0, 0); 2];
        run_light(&mut c, &mut st, 0, 100, |_| (600, 600 * 8));
        assert!(!c.holds("other"), "a second ping-pong lost its lanes");
    }

    /// A heavy vNIC is light again only after a calm spell (no flapping while a bulk sender
    /// pauses between bursts), and lanes are held only while vNICs contend.
    #[test]
    fn a_heavy_vnic_turns_light_after_a_calm_spell() {
        let mut c = Contention::default();
        let mut st = [(0, 0); 2];
        run_light(&mut c, &mut st, 0, 100, |_| (160, 160 * 65536));
        run_light(&mut c, &mut st, 100, 140, |_| (10, 80));
        assert!(c.holds("other"), "light again within the calm spell");
        run_light(&mut c, &mut st, 140, 200, |_| (10, 80));
        assert!(!c.holds("other"), "still heavy after the calm spell");
        // Heavy, but alone: nothing to share, no lane held.
        let mut alone = Contention::default();
        let mut tail = 0;
        for t in (0..200).step_by(10) {
            tail += 160;
            alone.sample(t * MS, [QpSample { qpn: 2, vnic: "other", tail, bytes: tail * 65536 }]);
        }
        assert!(!alone.holds("other"));
    }
}
