//! A vNIC's caps on the direct path, vrdmad's side. The library of each directly connected
//! QP enforces its share of the caps (published in the QP's control page, `ring::QpQos`);
//! vrdmad checks, every [`TICK`], what the vNIC's direct QPs sent (their meters, which it
//! reads anyway), over the last second. A vNIC over 110% of a cap is *demoted*: its QPs are
//! ordered onto the engine (`QP_QOS_DEMOTE`; the library moves at its next post with
//! `MoveToEngine`), whose egress scheduler holds them to the vNIC's caps with the rest of
//! its mediated QPs (`engine/qos`, from the same policy), and its new connections go through
//! the engine too. It stays demoted while the daemon serves the vNIC (a daemon
//! restart, or the vNIC's deletion, ends it); this is logged once and counted
//! (`Counters::demotions`).

use std::collections::{HashMap, VecDeque};

use vrdma_abi::control::Qos;
use vrdma_abi::ring::{QosWords, QpQos, METER_OPCODES, QP_QOS_DEMOTE};

use vrdma_abi::control::Reply;
use vrdma_abi::wire::ConnectReq;

use super::{gid_of, ConnectPlan, Plan, Registry, RemoteConnect, ReplyFds, RequestError, QPT_RC};

/// How often vrdmad looks at the direct QPs' meters.
pub const TICK: std::time::Duration = std::time::Duration::from_millis(100);
/// The window a vNIC's rate is judged over (nanoseconds).
pub const WINDOW_NS: u64 = 1_000_000_000;
/// How far over its cap a vNIC may go over [`WINDOW_NS`] before it is demoted, in percent
/// of the cap (the library's bucket allows 5% of burst; the rest is room for sampling).
pub const TOLERANCE_PERCENT: u64 = 110;

/// What a vNIC was caught doing: what it sent within the last second (the window, or the
/// part of it watched under the current caps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Excess {
    /// Bytes sent within the last second.
    pub bytes_per_s: u64,
    /// WRs sent within the last second.
    pub wrs_per_s: u64,
}

/// The check of one vNIC: what its direct QPs sent, sample by sample, over the last second.
/// Pure (the caller passes the clock and the QPs' counts), so tests run on a fake clock.
#[derive(Debug, Default)]
pub struct Detector {
    /// The caps the samples were taken under (a change starts the window again).
    caps: (u64, u64),
    /// Each QP's (bytes, WRs) sent at the last sample (a counter that went back counts 0).
    last: HashMap<u32, (u64, u64)>,
    /// (from, to, bytes, WRs): sent between two samples, oldest first.
    samples: VecDeque<(u64, u64, u64, u64)>,
    /// When the window started (the first sample under these caps), and the last sample.
    since: Option<u64>,
    last_ns: u64,
}

impl Detector {
    /// One sample at `now_ns`: each direct QP's (QPN, bytes sent, WRs sent) since it was
    /// created. Returns what was sent over the last [`WINDOW_NS`] (or since the caps were
    /// set, if that is less) if it exceeds a second's worth of a cap by more than the
    /// tolerance.
    pub fn sample(&mut self, now_ns: u64, caps: (u64, u64), qps: &[(u32, u64, u64)]) -> Option<Excess> {
        if caps != self.caps {
            *self = Detector { caps, ..Detector::default() };
        }
        let (mut bytes, mut wrs) = (0u64, 0u64);
        let mut last = HashMap::with_capacity(qps.len());
        for &(qpn, b, w) in qps {
            let (pb, pw) = self.last.get(&qpn).copied().unwrap_or((0, 0));
            bytes = bytes.saturating_add(b.saturating_sub(pb));
            wrs = wrs.saturating_add(w.saturating_sub(pw));
            // A claim lower than one before is not taken: the QP cannot win credit back.
            last.insert(qpn, (b.max(pb), w.max(pw)));
        }
        self.last = last;
        if self.since.is_none() {
            // The first sample sets the baseline: what came before is not in the window.
            self.since = Some(now_ns);
            self.last_ns = now_ns;
            return None;
        }
        let from = self.last_ns;
        self.last_ns = now_ns.max(from);
        self.samples.push_back((from, now_ns, bytes, wrs));
        while self.samples.front().is_some_and(|s| now_ns.saturating_sub(s.1) >= WINDOW_NS) {
            self.samples.pop_front();
        }
        // What the samples cover: a late sample covers more than a tick, so the window may
        // reach further back than a second; it is judged against that much of the cap.
        let covered = self.samples.front().map_or(0, |s| now_ns.saturating_sub(s.0)).max(WINDOW_NS);
        // Judged over what the window holds so far, against at least a whole second's
        // allowance: a QP's bucket lets through at most its rate times the time plus its
        // burst, so even a partial window over 110% of one second's cap is conclusive.
        let (sb, sw) = self.samples.iter().fold((0u64, 0u64), |(b, w), s| (b.saturating_add(s.2), w.saturating_add(s.3)));
        let over = |sent: u64, cap: u64| {
            cap != 0
                && u128::from(sent) * 100 * u128::from(WINDOW_NS) > u128::from(cap) * u128::from(TOLERANCE_PERCENT) * u128::from(covered)
        };
        (over(sb, caps.0) || over(sw, caps.1)).then_some(Excess { bytes_per_s: sb, wrs_per_s: sw })
    }
}

/// vrdmad's QoS state of the vNICs it serves.
#[derive(Default)]
pub(crate) struct QosWatch {
    detectors: HashMap<String, Detector>,
    /// vNICs moved off the direct path.
    demoted: HashMap<String, Excess>,
    /// QPs the engine holds only to answer a peer QP moved onto it (their own library still
    /// sends directly): the answer their own `MoveToEngine` will get, by QPN.
    parked: HashMap<u32, (Reply, ReplyFds)>,
}

impl Registry {
    /// Sets vNIC `name`'s caps and weight (the store's watch calls it when the record's
    /// policy changes; tests call it directly): its QPs get their new shares at once.
    pub fn set_vnic_qos(&mut self, name: &str, qos: Qos) {
        if let Some(v) = self.vnics.get_mut(name) {
            v.rec.qos = qos;
            self.publish_qos(name);
        }
    }

    /// Whether some vNIC served here has a cap (or was demoted): the check runs every
    /// [`TICK`] only then.
    pub fn any_capped(&self) -> bool {
        !self.qos_watch.demoted.is_empty() || self.vnics.values().any(|v| v.rec.qos.is_capped())
    }

    /// Whether vNIC `name` was moved off the direct path for exceeding its caps.
    pub fn is_demoted(&self, name: &str) -> bool {
        self.qos_watch.demoted.contains_key(name)
    }

    /// The RC QPs of vNIC `name`.
    fn rc_qps_of(&self, name: &str) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .sessions
            .values()
            .filter(|s| s.vnic == name)
            .flat_map(|s| s.qps.iter().copied())
            .filter(|q| self.qps.get(q).is_some_and(|q| q.qp_type == QPT_RC))
            .collect();
        v.sort_unstable();
        v
    }

    /// Publishes vNIC `name`'s caps to its RC QPs, each its share (the caps divided evenly:
    /// their sum never exceeds the vNIC's), with the order to move onto the engine if the
    /// vNIC is demoted (the engine then holds the vNIC's QPs to its caps as a whole: its
    /// scheduler has the same policy from the store).
    pub(super) fn publish_qos(&mut self, name: &str) {
        let Some(v) = self.vnics.get(name) else { return };
        let qos = v.rec.qos;
        let qps = self.rc_qps_of(name);
        let n = qps.len().max(1) as u64;
        let share = |cap: u64| if cap == 0 { 0 } else { (cap / n).max(1) };
        let demoted = self.is_demoted(name);
        let words =
            QosWords { max_bw: share(qos.max_bw), max_rate: share(qos.max_msg_rate), flags: if demoted { QP_QOS_DEMOTE } else { 0 } };
        for qpn in qps {
            if let Some(q) = self.qps.get(&qpn).and_then(|q| QpQos::new(q.mapping.region())) {
                q.publish(words);
            }
        }
    }

    /// What each direct QP of vNIC `name` says it sent: (QPN, bytes, WRs) over its life.
    fn direct_sends_of(&self, name: &str) -> Vec<(u32, u64, u64)> {
        self.rc_qps_of(name)
            .into_iter()
            .filter_map(|qpn| {
                let q = self.qps.get(&qpn)?;
                // (A QP the engine holds only as a responder still sends directly.)
                if q.connected_to.is_none() || (q.remote.is_some() && !self.qos_watch.parked.contains_key(&qpn)) {
                    return None;
                }
                let w = vrdma_abi::ring::QpMeter::new(q.mapping.region())?.read();
                let (mut bytes, mut wrs) = (0u64, 0u64);
                for op in 0..METER_OPCODES {
                    wrs = wrs.wrapping_add(w[2 * op]);
                    bytes = bytes.wrapping_add(w[2 * op + 1]);
                }
                Some((qpn, bytes, wrs))
            })
            .collect()
    }

    /// One check of every capped vNIC at `now_ns` (every [`TICK`]): demotes those over
    /// their caps; returns the names demoted now.
    pub fn qos_tick(&mut self, now_ns: u64) -> Vec<String> {
        self.forget_qos_of_gone();
        let mut names: Vec<String> = self.vnics.keys().cloned().collect();
        names.sort();
        let mut demoted_now = Vec::new();
        for name in names {
            let qos = self.vnics[&name].rec.qos;
            // Shares follow the vNIC's QPs and its record (a store change that replaced it);
            // a demoted vNIC's new QPs get the order, and the engine's hold follows the policy.
            self.publish_qos(&name);
            if self.is_demoted(&name) {
                continue;
            }
            if !qos.is_capped() {
                self.qos_watch.detectors.remove(&name);
                continue;
            }
            let sends = self.direct_sends_of(&name);
            let d = self.qos_watch.detectors.entry(name.clone()).or_default();
            let Some(excess) = d.sample(now_ns, (qos.max_bw, qos.max_msg_rate), &sends) else { continue };
            self.qos_watch.detectors.remove(&name);
            self.qos_watch.demoted.insert(name.clone(), excess);
            if let Some(v) = self.vnics.get_mut(&name) {
                v.counters.demotions += 1;
            }
            log::warn!(
                "vNIC {name}: sent {} bytes and {} WRs within the last second on the direct path, over its caps \
                 ({} bytes/s, {} WRs/s; 0 = none) by more than {}%: moved to the mediated path, which enforces them",
                excess.bytes_per_s,
                excess.wrs_per_s,
                qos.max_bw,
                qos.max_msg_rate,
                TOLERANCE_PERCENT - 100
            );
            self.publish_qos(&name);
            demoted_now.push(name);
        }
        demoted_now
    }

    /// Forgets the QoS state of vNICs no longer served.
    fn forget_qos_of_gone(&mut self) {
        let vnics = &self.vnics;
        self.qos_watch.detectors.retain(|n, _| vnics.contains_key(n));
        self.qos_watch.demoted.retain(|n, _| vnics.contains_key(n));
        let qps = &self.qps;
        self.qos_watch.parked.retain(|q, _| qps.get(q).is_some_and(|q| q.remote.is_some()));
    }

    /// `MoveToEngine`, first half: QP `qpn` of a demoted vNIC, connected directly, is to be
    /// connected to the same peer QP through this daemon's engine. Returns the plan (the
    /// engine's step, taken without the registry lock) and the peer QP.
    pub fn prepare_move_to_engine(&mut self, session: u64, qpn: u32) -> Result<(ConnectPlan, u32), RequestError> {
        let q = self.own_qp(session, qpn)?;
        let Some(dest) = q.connected_to.filter(|_| q.remote.is_none() || self.qos_watch.parked.contains_key(&qpn)) else {
            return Err(RequestError::NotConnected { qpn });
        };
        let vnic = self.sessions[&session].vnic.clone();
        if !self.is_demoted(&vnic) {
            return Err(RequestError::NotDemoted { qpn });
        }
        let engine = self.engine.clone().ok_or(RequestError::NoEngine)?;
        let req = self.connect_req(qpn, dest).ok_or(RequestError::NoRcQp { vnic, qpn: dest })?;
        Ok((Plan::Remote(RemoteConnect { addr: engine.local_addr(), req }), dest))
    }

    /// What QP `from` says when it connects to QP `to` through the engine (both served here).
    fn connect_req(&self, from: u32, to: u32) -> Option<ConnectReq> {
        let rec_of = |qpn: u32| {
            let q = self.qps.get(&qpn)?;
            let s = self.sessions.get(&q.session)?;
            self.vnics.get(&s.vnic).map(|v| &v.rec)
        };
        let (me, peer) = (rec_of(from)?, rec_of(to)?);
        Some(ConnectReq { src_gid: gid_of(me.ip), dst_gid: gid_of(peer.ip), src_tenant: me.tenant.clone() })
    }

    /// The answer already made for QP `qpn`'s `MoveToEngine` (the engine took it as its
    /// peer's responder first), if any.
    pub fn take_parked_move(&mut self, qpn: u32) -> Option<(Reply, ReplyFds)> {
        self.qos_watch.parked.remove(&qpn)
    }

    /// The peer QP `peer` of QP `qpn` moving onto the engine must be there too, to answer
    /// it: its session and what it says to connect, unless the engine holds it already.
    pub fn peer_to_attach(&self, peer: u32, qpn: u32) -> Option<(u64, ConnectReq)> {
        let p = self.qps.get(&peer).filter(|p| p.remote.is_none())?;
        Some((p.session, self.connect_req(peer, qpn)?))
    }

    /// Keeps the answer of peer QP `qpn`'s own move (the engine holds it as a responder
    /// now; its library keeps sending directly until its own vNIC is demoted), and does not
    /// count its attachment as a connection.
    pub fn park_for_move(&mut self, session: u64, qpn: u32, answer: (Reply, ReplyFds)) {
        if let Ok(v) = self.vnic_of(session) {
            v.counters.connections = v.counters.connections.saturating_sub(1);
        }
        self.qos_watch.parked.insert(qpn, answer);
    }

    /// `MoveToEngine`, after the engine connected the QP: it is paced from its first WR
    /// there, and the move is not counted as a new connection.
    pub fn finish_move_to_engine(&mut self, session: u64, qpn: u32, counted: bool) {
        if let (true, Ok(v)) = (counted, self.vnic_of(session)) {
            v.counters.connections = v.counters.connections.saturating_sub(1);
        }
        let vnic = self.sessions.get(&session).map(|s| s.vnic.clone());
        if let Some(vnic) = vnic {
            self.publish_qos(&vnic);
            log::info!("vNIC {vnic}: QP {qpn} moved onto the engine");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Samples every 100 ms of one QP sending `rate` bytes/s; the first time caught.
    fn run(d: &mut Detector, caps: (u64, u64), rate: u64, from_ms: u64, to_ms: u64, sent: &mut u64) -> Option<(u64, Excess)> {
        let mut t = from_ms;
        while t <= to_ms {
            if let Some(e) = d.sample(t * MS, caps, &[(7, *sent, *sent / 1000)]) {
                return Some((t, e));
            }
            *sent += rate / 10;
            t += 100;
        }
        None
    }

    #[test]
    fn an_obedient_vnic_at_its_cap_is_never_caught() {
        let mut d = Detector::default();
        let mut sent = 0;
        // 5% over (the bucket's burst), for a minute.
        assert_eq!(run(&mut d, (200_000_000, 0), 210_000_000, 0, 60_000, &mut sent), None);
    }

    #[test]
    fn a_vnic_over_its_cap_by_more_than_a_tenth_is_caught_within_the_window() {
        let mut d = Detector::default();
        let mut sent = 0;
        let (t, e) = run(&mut d, (200_000_000, 0), 250_000_000, 0, 5000, &mut sent).expect("caught");
        assert_eq!(t, 900, "once a second's allowance and a tenth are spent");
        assert_eq!(e.bytes_per_s, 225_000_000);
    }

    #[test]
    fn a_flood_after_a_quiet_second_is_caught_at_once() {
        let mut d = Detector::default();
        let mut sent = 0;
        assert_eq!(run(&mut d, (200_000_000, 0), 0, 0, 2000, &mut sent), None);
        let (t, _) = run(&mut d, (200_000_000, 0), 5_000_000_000, 2100, 5000, &mut sent).expect("caught");
        assert!(t <= 2200, "{t}");
    }

    #[test]
    fn a_late_sample_is_judged_over_the_time_it_covers() {
        let mut d = Detector::default();
        let cap = 200_000_000u64;
        // At the cap exactly (the bucket's burst on top at the start), sampled every 100 ms,
        // then one sample 500 ms late: never caught.
        let mut sent = cap / 20;
        let mut t = 0;
        for _ in 0..30 {
            assert_eq!(d.sample(t * MS, (cap, 0), &[(7, sent, 0)]), None, "at {t} ms");
            let step = if t == 1500 { 600 } else { 100 };
            t += step;
            sent += cap / 1000 * step;
        }
    }

    #[test]
    fn the_message_rate_cap_is_checked_too() {
        let mut d = Detector::default();
        let mut sent = 0;
        // 1000 bytes per WR: 300 000 WRs/s against a cap of 200 000.
        assert!(run(&mut d, (0, 200_000), 300_000_000, 0, 3000, &mut sent).is_some());
    }

    #[test]
    fn a_cap_change_starts_the_window_again() {
        let mut d = Detector::default();
        let mut sent = 0;
        assert_eq!(run(&mut d, (400_000_000, 0), 400_000_000, 0, 3000, &mut sent), None);
        // Lowered: what was sent under the old cap does not count against the new one.
        let mut at = 3100;
        let mut caught = None;
        while at <= 3900 {
            caught = caught.or(d.sample(at * MS, (200_000_000, 0), &[(7, sent, 0)]));
            sent += 20_000_000;
            at += 100;
        }
        assert_eq!(caught, None);
    }

    #[test]
    fn counters_that_go_back_or_vanish_count_nothing() {
        let mut d = Detector::default();
        assert_eq!(d.sample(0, (1000, 0), &[(1, 1_000_000, 0)]), None);
        for t in 1..=20 {
            // QP 1 claims less than before; then it is gone.
            let qps: &[(u32, u64, u64)] = if t < 10 { &[(1, 5, 0)] } else { &[] };
            assert_eq!(d.sample(t * 100 * MS, (1000, 0), qps), None);
        }
    }
}
