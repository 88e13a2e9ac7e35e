//! QoS on the host's egress where the engine carries the bytes: the policies of this host's
//! vNICs and their tenants ([`Engine::set_qos`], from the store's watch), caps and weighted
//! fair queuing in the doorbell thread ([`scheduler`], with `vrdma_core::bucket`'s token
//! buckets, the library's own).
//!
//! Lanes bypass the doorbell thread (the client writes small WRs to its lane itself), so a
//! vNIC with a policy gets no new lane, and the lanes it has are *held* (the engine keeps
//! their send side: `MedQp::hold_lane`), live, when it gets one; so are every lane's while
//! two or more of the host's vNICs send at once ([`contention`]). Then all their WRs go
//! through the scheduler (see docs/architecture.md, "QoS").

pub(crate) mod contention;
mod scheduler;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use vrdma_abi::control::Qos;

use super::qp::MedQp;
use super::ud::{Pumped, UdSender};
use super::Engine;

pub(crate) use scheduler::{Budget, OnWire, Pumpable, Scheduler};

/// What the scheduler pumps: a mediated QP's send ring, or a UD QP's datagram socket (its
/// datagrams across hosts are its vNIC's egress too, held to the same caps and shares).
pub(crate) enum Scheduled<'a> {
    Qp {
        e: &'a Engine,
        q: &'a Arc<MedQp>,
    },
    /// `ended`: how its last pump ended, once it has nothing more to give this pass (its
    /// client closed it, or it parked on a backlogged connection); `scratch`: the doorbell
    /// thread's buffers for a datagram and its frame.
    Ud {
        e: &'a Arc<Engine>,
        s: &'a Arc<UdSender>,
        ended: Cell<Option<Pumped>>,
        scratch: &'a RefCell<(Vec<u8>, Vec<u8>)>,
    },
}

impl Scheduled<'_> {
    fn pump_now(&self, budget: &mut Budget) {
        match self {
            // The budget goes to its sends and to the READs its responder answers, each
            // first in turn.
            Scheduled::Qp { e, q } if q.reads.reads_go_first() => {
                q.reads.grant(budget, &q.wire_bytes);
                q.pump(e, budget);
            }
            Scheduled::Qp { e, q } => {
                q.pump(e, budget);
                q.reads.grant(budget, &q.wire_bytes);
            }
            Scheduled::Ud { e, s, ended, scratch } => {
                if ended.get().is_some() {
                    return;
                }
                let mut scratch = scratch.borrow_mut();
                let (msg, frame) = &mut *scratch;
                let r = s.pump_within(e, budget, msg, frame);
                if matches!(r, Pumped::Closed | Pumped::Parked) {
                    ended.set(Some(r));
                }
            }
        }
    }
}

impl Pumpable for Scheduled<'_> {
    fn qpn(&self) -> u32 {
        match self {
            Scheduled::Qp { q, .. } => q.qpn,
            Scheduled::Ud { s, .. } => s.qpn,
        }
    }
    fn vnic(&self) -> &str {
        match self {
            Scheduled::Qp { q, .. } => &q.vnic,
            Scheduled::Ud { s, .. } => &s.vnic,
        }
    }
    fn pump(&self, budget: &mut Budget) {
        self.pump_now(budget);
    }
    fn owes_segments(&self) -> bool {
        matches!(self, Scheduled::Qp { q, .. } if q.segments_owed.load(Ordering::Acquire))
    }
    fn streams(&self) -> bool {
        self.owes_segments() || self.reads_waiting()
    }
    fn reads_waiting(&self) -> bool {
        matches!(self, Scheduled::Qp { q, .. } if q.reads.wanting())
    }
    fn pump_timed(&self, budget: &mut Budget) {
        let started = Instant::now();
        self.pump_now(budget);
        budget.busy_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    }
    fn throttled_for(&self, ns: u64) {
        if let Scheduled::Qp { q, .. } = self {
            q.meter.throttled(ns);
        }
    }
}

impl Engine {
    /// The scheduler's clock: nanoseconds since the engine started.
    pub(crate) fn qos_now(&self) -> u64 {
        u64::try_from(Instant::now().saturating_duration_since(self.started).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The policies of this host's vNICs (name → (tenant, policy)) and of the tenants, in
    /// force from now on (a throttled QP is looked at again at once).
    ///
    /// The lanes of a vNIC that now has a policy (its own or its tenant's) are revoked live:
    /// the engine keeps their send side, so every WR goes through the scheduler, as do the
    /// responses to its READs of every size; when the policy is cleared they are given back
    /// (`Engine::qos_hold`).
    pub fn set_qos(&self, vnics: HashMap<String, (String, Qos)>, tenants: HashMap<String, Qos>) {
        let now = self.qos_now();
        let mut changed = 0usize;
        {
            // (The scheduler's lock before the QP table's: `attach` decides a new QP's hold
            // under both, so no QP misses a change.)
            let mut qos = self.qos.lock();
            qos.set_policies(&vnics, &tenants, now);
            for q in self.qps.read().values() {
                if Engine::qos_hold(&qos, q) {
                    changed += 1;
                    log::debug!(
                        "engine: QP {}: lane {} (vNIC {})",
                        q.qpn,
                        if q.lane_held.load(Ordering::Relaxed) { "held for QoS" } else { "given back" },
                        q.vnic
                    );
                }
            }
        }
        if changed > 0 {
            log::info!("engine: QoS policies changed the hold on {changed} lane(s)");
        }
        self.kick();
    }

    /// Holds QP `q`'s egress in the scheduler, or lets it go, as `qos` says of its vNIC:
    /// its lane's send side (`Scheduler::holds_lane`), and, while the vNIC has a policy, the
    /// responses to its READs of a segment or less. Under the scheduler's lock (a new QP's
    /// caller takes it before it adds the QP to the table: see `set_qos`). Whether its lane
    /// changed hands (the QP is then to be pumped).
    pub(crate) fn qos_hold(qos: &Scheduler, q: &MedQp) -> bool {
        q.reads.schedule_every_size(qos.has_policy(&q.vnic));
        q.hold_lane(qos.holds_lane(&q.vnic))
    }

    /// Whether a QP of vNIC `vnic` may have a lane: not if the vNIC or its tenant has a
    /// policy, which only the doorbell thread can apply.
    pub fn qos_allows_lane(&self, vnic: &str) -> bool {
        !self.qos.lock().has_policy(vnic)
    }

    /// vNICs with a QP waiting for its caps now.
    pub fn throttled_vnics(&self) -> HashSet<String> {
        // (The scheduler's lock before the QP table's, never inside it: the doorbell thread
        // takes them in that order.)
        let waiting = self.qos.lock().throttled_qps();
        let qps = self.qps.read();
        waiting.iter().filter_map(|qpn| qps.get(qpn).map(|q| q.vnic.clone())).collect()
    }

    /// Whether QPs wait for room on the wire (an acknowledgement should wake the doorbell
    /// thread): a flag the doorbell thread sets after each round, so a reader never waits
    /// for the scheduler's lock.
    pub(crate) fn qos_wire_waiting(&self) -> bool {
        self.wire_waiting.load(Ordering::Acquire)
    }

    /// Data bytes the host's connections hold for mediated QPs (sent, not retired), in all
    /// and per vNIC.
    pub(crate) fn wire_use(&self) -> OnWire {
        let mut by_vnic: HashMap<String, u64> = HashMap::new();
        let mut total = 0;
        for q in self.qps.read().values() {
            let b = q.wire_bytes.load(Ordering::Relaxed);
            if b > 0 {
                total += b;
                match by_vnic.get_mut(&q.vnic) {
                    Some(v) => *v += b,
                    None => {
                        by_vnic.insert(q.vnic.clone(), b);
                    }
                }
            }
        }
        OnWire { total, by_vnic: Some(by_vnic) }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;

    use vrdma_abi::control::Qos;

    use crate::engine::testing::{connection, engine, mediated_lane_qp, mediated_qp};

    /// A policy that reaches the engine holds its vNIC's lanes at once (the engine wants the
    /// send side); cleared, they are given back. QPs without a lane are not touched.
    #[test]
    fn a_policy_holds_the_vnics_lanes_and_clearing_it_gives_them_back() {
        let t = engine();
        let (_p1, lane) = connection();
        let (_p2, shared) = connection();
        let (q, _s1) = mediated_lane_qp(&t, 7, 70, &lane);
        let (plain, _s2) = mediated_qp(&t, 8, 80, &shared);
        let policy = |weight| HashMap::from([("v".to_string(), ("t".to_string(), Qos { weight, ..Qos::default() }))]);
        t.e.set_qos(policy(2), HashMap::new());
        assert!(q.lane_held.load(Ordering::Acquire));
        assert_eq!(q.chan_ctl.load_u64(vrdma_abi::ring::MED_ENGINE_WANTS).unwrap(), 1, "the engine asked for the side");
        assert!(!plain.lane_held.load(Ordering::Acquire));
        t.e.set_qos(policy(1), HashMap::new());
        assert!(!q.lane_held.load(Ordering::Acquire));
    }

    /// Bytes a vNIC keeps on the wire unacknowledged (its peer QP gone with a QP timeout of
    /// 0, a lane its client paces to a byte a second; here a peer that reads and never
    /// answers) block that vNIC only. Before, 1 MiB of them (the host's whole wire budget)
    /// stopped every other vNIC's sends across hosts, for as long as their sender kept
    /// ringing its doorbell.
    #[test]
    fn bytes_never_acknowledged_block_no_other_vnic() {
        use std::io::Read;
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        use vrdma_abi::ring::{Sge, SqEntry};
        use vrdma_abi::verbs::{access, WrOpcode};
        use vrdma_abi::wire::{FrameHeader, Kind, HEADER_LEN};

        use crate::engine::testing::mediated_qp_of;

        let t = engine();
        let _mr = t.broker.register_mr(0x700, 0x10_0000, 1 << 20, access::LOCAL_WRITE);
        let (mut hostile_peer, hc) = connection();
        hostile_peer.set_read_timeout(None).unwrap();
        std::thread::spawn(move || {
            let mut b = vec![0u8; 1 << 16];
            while matches!(hostile_peer.read(&mut b), Ok(1..)) {}
        });
        let (hq, _hs) = mediated_qp_of(&t, 7, 70, &hc, "hostile");
        let write = SqEntry {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite as u32,
            rkey: 9,
            remote_addr: 0x4000,
            sges: vec![Sge { addr: 0x10_0000, length: 1 << 20, lkey: 0x700 }],
            ..SqEntry::default()
        };
        assert!(hq.sq.push(&write, &mut 0).unwrap());
        hq.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        let started = Instant::now();
        while hq.wire_bytes.load(Ordering::Relaxed) < 1 << 20 {
            assert!(started.elapsed() < Duration::from_secs(5), "the WRITE never went");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Its client keeps ringing.
        let stop = Arc::new(AtomicBool::new(false));
        let (s, e, q) = (stop.clone(), t.e.clone(), hq.clone());
        let ringer = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                q.wants_pump.store(true, Ordering::Release);
                e.kick();
                std::thread::sleep(Duration::from_millis(2));
            }
        });

        // Another vNIC's SEND goes.
        let (mut victim_peer, vc) = connection();
        let (vq, _vs) = mediated_qp_of(&t, 8, 80, &vc, "victim");
        assert!(vq.sq.push(&SqEntry { wr_id: 2, opcode: WrOpcode::Send as u32, ..SqEntry::default() }, &mut 0).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        vq.wants_pump.store(true, Ordering::Release);
        t.e.kick();
        victim_peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut frame = [0u8; HEADER_LEN];
        let got = victim_peer.read_exact(&mut frame);
        stop.store(true, Ordering::Relaxed);
        ringer.join().unwrap();
        assert!(got.is_ok(), "another vNIC's SEND never went beside 1 MiB never acknowledged");
        let h = FrameHeader::decode(&frame).unwrap();
        assert_eq!((h.kind, h.dst_qpn), (Kind::Send, 80));
    }
}
