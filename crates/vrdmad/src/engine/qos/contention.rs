//! Fair sharing for lanes: while two or more of this host's vNICs send across hosts at once,
//! every lane is held (the engine keeps its send side, `MedQp::hold_lane`), so their small
//! WRs too go through the scheduler's weighted fair queuing; a vNIC sending alone keeps its
//! lanes, and with them their latency.
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

/// A vNIC counts as sending for this long after its ring last moved (a ping-pong's client
/// posts once per round trip; a bandwidth test's every few microseconds).
pub(crate) const ACTIVE_NS: u64 = 50_000_000;

/// Lanes come back after this long with at most one vNIC sending (no flapping between held
/// and not while two vNICs take turns).
pub(crate) const RELEASE_AFTER_NS: u64 = 200_000_000;

/// Which vNICs sent lately, and whether lanes are held for it.
#[derive(Debug, Default)]
pub(crate) struct Contention {
    /// Each QP's send-ring tail at the last sample.
    tails: HashMap<u32, u64>,
    /// vNICs whose rings moved lately, and when they last did.
    active: HashMap<String, u64>,
    contended: bool,
    /// Since when at most one vNIC sends (while contended).
    calm_since: Option<u64>,
}

impl Contention {
    /// Whether lanes are held now.
    pub(crate) fn is_contended(&self) -> bool {
        self.contended
    }

    /// The vNICs counted as sending now (for the log).
    pub(crate) fn active_vnics(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.active.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// One sample at `now_ns` of each mediated QP's (QPN, vNIC, send-ring tail); returns
    /// whether lanes are to be held from now on.
    pub(crate) fn sample<'a>(&mut self, now_ns: u64, qps: impl IntoIterator<Item = (u32, &'a str, u64)>) -> bool {
        let mut tails = HashMap::with_capacity(self.tails.len());
        for (qpn, vnic, tail) in qps {
            // (A QP seen for the first time sets its baseline.)
            if self.tails.get(&qpn).is_some_and(|t| *t != tail) {
                match self.active.get_mut(vnic) {
                    Some(t) => *t = now_ns,
                    None => {
                        self.active.insert(vnic.to_string(), now_ns);
                    }
                }
            }
            tails.insert(qpn, tail);
        }
        self.tails = tails;
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

/// The watcher: every [`TICK`], samples the send rings of the engine's QPs and holds or gives
/// back the lanes when contention starts or ends (a lane of a vNIC with a policy stays held
/// either way). Ends with the engine. Only while the engine has lane QPs does it look at
/// anything (a read of the QP table every tick otherwise).
pub(crate) fn watch_contention(engine: Weak<Engine>) {
    let started = std::time::Instant::now();
    loop {
        std::thread::sleep(TICK);
        let Some(e) = engine.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let samples: Vec<(u32, String, u64)> = {
            let qps = e.qps.read();
            if !qps.values().any(|q| q.lane) {
                // (Nothing to hold; a lane QP attached later starts as the last decision
                // says, and the next samples correct it.)
                continue;
            }
            qps.values().map(|q| (q.qpn, q.vnic.clone(), q.sq.tail_pos())).collect()
        };
        let now = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // (The scheduler's lock before the QP table's, as everywhere.)
        let mut qos = e.qos.lock();
        let was = qos.contention.is_contended();
        let held = qos.contention.sample(now, samples.iter().map(|(q, v, t)| (*q, v.as_str(), *t)));
        if held == was {
            continue;
        }
        let mut changed = 0usize;
        for q in e.qps.read().values().filter(|q| q.lane) {
            changed += usize::from(q.hold_lane(qos.holds_lane(&q.vnic)));
        }
        let active = qos.contention.active_vnics().join(", ");
        drop(qos);
        log::info!(
            "engine: {} vNICs send across hosts ({active}): {} {changed} lane(s)",
            if held { "two or more" } else { "at most one of the" },
            if held { "holding" } else { "giving back" }
        );
        e.kick();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Samples every 10 ms from `from` to `to` ms; `moving(t)` names the vNICs whose QP
    /// (one each: a = 1, b = 2) posted since the last sample. Returns the last decision.
    fn run(c: &mut Contention, tails: &mut [u64; 2], from: u64, to: u64, moving: impl Fn(u64) -> Vec<&'static str>) -> bool {
        let mut held = c.is_contended();
        for t in (from..to).step_by(10) {
            for v in moving(t) {
                tails[usize::from(v == "b")] += 1;
            }
            held = c.sample(t * MS, [(1, "a", tails[0]), (2, "b", tails[1])]);
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
        assert!(!c.sample(0, [(1, "a", 5)]));
        assert!(!c.sample(10 * MS, [(1, "a", 6), (2, "b", 1_000)]));
        assert!(c.sample(20 * MS, [(1, "a", 7), (2, "b", 1_001)]));
    }
}
