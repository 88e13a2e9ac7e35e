//! Meters of QPs and vNICs: a live QP's counters are what its library wrote in its control
//! page (direct path, reported as claimed) plus what the engine counted (mediated path),
//! with the receives of a direct QP taken from its connected peer's sends; vrdmad keeps the
//! highest value seen of each word, so counters never go back whatever a client writes. A
//! QP that goes folds its counts into its vNIC's totals, which outlive client restarts and
//! (persisted by `crate::metrics::persist`) daemon restarts.

use std::collections::HashMap;

use vrdma_abi::ring::{MeterWords, QpMeter, METER_OPCODES, METER_RX, METER_WORDS};

use super::{Counters, Registry};

/// A vNIC's meter: its totals (gone QPs folded in, live ones added) and its live QPs'.
#[derive(Clone, Debug)]
pub struct VnicMeter {
    /// The vNIC.
    pub name: String,
    /// Its tenant.
    pub tenant: String,
    /// Totals over the vNIC's life.
    pub total: MeterWords,
    /// Live QPs (QPN, counters since created), by QPN.
    pub qps: Vec<(u32, MeterWords)>,
    /// Its control-path counters.
    pub counters: Counters,
}

/// Adds `b` to `a`, word by word.
pub(crate) fn add_words(a: &mut MeterWords, b: &MeterWords) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = x.wrapping_add(*y);
    }
}

/// Raises each word of `seen` to `now`'s when higher: monotonic whatever `now` says.
pub(crate) fn raise_words(seen: &mut MeterWords, now: &MeterWords) {
    for (s, n) in seen.iter_mut().zip(now) {
        *s = (*s).max(*n);
    }
}

impl Registry {
    /// Totals to start vNICs from (loaded from the state file at start).
    pub fn set_meter_base(&mut self, base: HashMap<String, MeterWords>) {
        for (name, words) in &base {
            if let Some(v) = self.vnics.get_mut(name) {
                add_words(&mut v.meter, words);
            }
        }
        self.meter_base = base.into_iter().filter(|(n, _)| !self.vnics.contains_key(n)).collect();
    }

    /// What a client library wrote in QP `qpn`'s meter.
    fn client_meter(&self, qpn: u32) -> MeterWords {
        self.qps.get(&qpn).and_then(|q| QpMeter::new(q.mapping.region())).map_or([0; METER_WORDS], |m| m.read())
    }

    /// QP `qpn`'s counters now, before the monotonic guard.
    fn qp_meter_now(&self, qpn: u32) -> Option<MeterWords> {
        let q = self.qps.get(&qpn)?;
        let mut w = self.client_meter(qpn);
        // Receives are never the client's to say: the peer's library sent them (direct) or
        // the engine executed them (mediated).
        w[METER_RX..METER_RX + 2 * METER_OPCODES].fill(0);
        if let Some(p) = q.connected_to.filter(|p| self.qps.contains_key(p)) {
            let pw = self.client_meter(p);
            for i in 0..2 * METER_OPCODES {
                w[METER_RX + i] = w[METER_RX + i].wrapping_add(pw[i]);
            }
        }
        add_words(&mut w, &q.engine_meter_kept);
        if let Some(e) = self.engine.as_ref().and_then(|e| e.meter_of(qpn)) {
            add_words(&mut w, &e);
        }
        Some(w)
    }

    /// Keeps what the engine counted for QP `qpn`, which it is about to let go of (the QP
    /// is reset or destroyed; a new connection starts a new engine meter).
    pub(super) fn keep_engine_meter(&mut self, qpn: u32) {
        let Some(e) = self.engine.as_ref().and_then(|e| e.meter_of(qpn)) else { return };
        if let Some(q) = self.qps.get_mut(&qpn) {
            add_words(&mut q.engine_meter_kept, &e);
        }
    }

    /// Updates and returns QP `qpn`'s monotonic counters.
    fn refresh_qp_meter(&mut self, qpn: u32) -> Option<MeterWords> {
        let now = self.qp_meter_now(qpn)?;
        let q = self.qps.get_mut(&qpn)?;
        raise_words(&mut q.meter_seen, &now);
        Some(q.meter_seen)
    }

    /// Folds QP `qpn`'s counters into its vNIC's totals (it is going); its direct peer's
    /// receives from it are taken first, while its counters can still be read.
    pub(super) fn fold_qp_meter(&mut self, qpn: u32) {
        if let Some(p) = self.qps.get(&qpn).and_then(|q| q.connected_to) {
            self.refresh_qp_meter(p);
        }
        let Some(words) = self.refresh_qp_meter(qpn) else { return };
        let Some(vnic) = self.qps.get(&qpn).and_then(|q| self.sessions.get(&q.session)).map(|s| s.vnic.clone()) else { return };
        if let Some(v) = self.vnics.get_mut(&vnic) {
            add_words(&mut v.meter, &words);
        }
    }

    /// The meter of vNIC `name` (None if it is not served here).
    pub fn vnic_meter(&mut self, name: &str) -> Option<VnicMeter> {
        let v = self.vnics.get(name)?;
        let (tenant, mut total, counters) = (v.rec.tenant.clone(), v.meter, v.counters);
        let mut qpns: Vec<u32> = self.sessions.values().filter(|s| s.vnic == name).flat_map(|s| s.qps.iter().copied()).collect();
        qpns.sort_unstable();
        let mut qps = Vec::with_capacity(qpns.len());
        for qpn in qpns {
            if let Some(w) = self.refresh_qp_meter(qpn) {
                add_words(&mut total, &w);
                qps.push((qpn, w));
            }
        }
        Some(VnicMeter { name: name.to_string(), tenant, total, qps, counters })
    }

    /// The meters of every vNIC served here, by name.
    pub fn vnic_meters(&mut self) -> Vec<VnicMeter> {
        let mut names: Vec<String> = self.vnics.keys().cloned().collect();
        names.sort();
        names.iter().filter_map(|n| self.vnic_meter(n)).collect()
    }

    /// Totals of every vNIC served here, and those loaded for vNICs not (yet) served: what
    /// the state file keeps.
    pub fn meter_totals(&mut self) -> HashMap<String, MeterWords> {
        let mut out = self.meter_base.clone();
        for m in self.vnic_meters() {
            out.insert(m.name, m.total);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::VnicRecord;
    use vrdma_abi::control::{Limits, QpCaps, Reply, Request};

    fn rec(name: &str) -> VnicRecord {
        VnicRecord {
            name: name.into(),
            tenant: "t".into(),
            ip: std::net::Ipv4Addr::new(198, 18, 0, 2),
            prefix_len: 15,
            limits: Limits::default(),
            node_guid: 1,
            host: String::new(),
            qos: Default::default(),
        }
    }

    /// A session of vNIC `v` with one RC QP; (session, QPN).
    fn session_with_qp(r: &mut Registry, v: &str) -> (u64, u32) {
        let s = r.open_session(v, None).unwrap();
        let mut handle = |req| match r.handle_request(s, req, vec![]).unwrap().0 {
            Reply::Handle { handle } => handle,
            Reply::Cq { cq } => cq,
            Reply::Qp { qpn, .. } => qpn,
            other => panic!("{other:?}"),
        };
        let pd = handle(Request::AllocPd);
        let cq = handle(Request::CreateCq { cqe: 16 });
        let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qpn = handle(Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });
        (s, qpn)
    }

    /// The meter a client library writes in QP `qpn`'s control page.
    fn client(r: &Registry, qpn: u32) -> QpMeter {
        QpMeter::new(r.qps[&qpn].mapping.region()).unwrap()
    }

    #[test]
    fn qps_fold_into_their_vnic_and_counters_never_go_back() {
        let mut r = Registry::default();
        r.set_meter_base(HashMap::from([("v".to_string(), {
            let mut w = [0; METER_WORDS];
            w[1] = 1000; // saved by an earlier daemon: 1000 bytes of RDMA WRITE
            w
        })]));
        r.add_vnic(rec("v"));
        let (s, qpn) = session_with_qp(&mut r, "v");
        client(&r, qpn).sent(0, 500);
        let m = r.vnic_meter("v").unwrap();
        assert_eq!((m.total[0], m.total[1]), (1, 1500));
        assert_eq!((m.qps.len(), m.qps[0].0, m.qps[0].1[1]), (1, qpn, 500));
        // A client that rewinds its meter changes nothing; one that adds does.
        client(&r, qpn).add(1, u64::MAX - 499);
        assert_eq!(r.vnic_meter("v").unwrap().total[1], 1500);
        client(&r, qpn).sent(0, 100);
        assert_eq!(r.vnic_meter("v").unwrap().total[1], 1500);
        // The client goes: its counts stay with the vNIC; a new one adds to them.
        r.close_session(s);
        let m = r.vnic_meter("v").unwrap();
        assert_eq!((m.total[1], m.qps.len()), (1500, 0));
        let (_, qpn) = session_with_qp(&mut r, "v");
        client(&r, qpn).sent(2, 64);
        let totals = r.meter_totals();
        assert_eq!((totals["v"][1], totals["v"][4], totals["v"][5]), (1500, 1, 64));
    }

    #[test]
    fn totals_of_vnics_not_served_yet_are_kept() {
        let mut r = Registry::default();
        let mut w = [0; METER_WORDS];
        w[1] = 7;
        r.set_meter_base(HashMap::from([("later".to_string(), w)]));
        assert_eq!(r.meter_totals()["later"][1], 7);
        r.add_vnic(rec("later"));
        assert_eq!(r.vnic_meter("later").unwrap().total[1], 7);
    }

    #[test]
    fn raising_never_lowers_and_adding_sums() {
        let mut seen = [0u64; METER_WORDS];
        let mut now = [0u64; METER_WORDS];
        now[1] = 100;
        raise_words(&mut seen, &now);
        now[1] = 5; // a client that rewinds its counters
        raise_words(&mut seen, &now);
        assert_eq!(seen[1], 100);
        let mut total = [1u64; METER_WORDS];
        add_words(&mut total, &seen);
        assert_eq!((total[0], total[1]), (1, 101));
    }
}
