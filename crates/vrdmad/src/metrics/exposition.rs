//! The meters in Prometheus' text exposition format (OpenMetrics, through the
//! `prometheus-client` crate): one counter family per kind of count, labelled by `vnic`,
//! `tenant`, `host` (and `opcode` or `status`), per-QP families (`qpn` label) only when
//! asked, to bound the series' number.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::report::{MeterReport, OPCODES};
use crate::registry::VnicMeter;

/// Content type of [`encode_meters`]' text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type Fam = Family<Labels, Counter>;

/// Counter families of one scope (`vrdma_vnic_*` or `vrdma_qp_*`).
struct Families {
    tx_bytes: Fam,
    tx_wrs: Fam,
    rx_bytes: Fam,
    rx_wrs: Fam,
    completions: Fam,
    rnr: Fam,
    retrans: Fam,
    throttled: Family<Labels, Counter<f64, std::sync::atomic::AtomicU64>>,
}

impl Families {
    fn register(reg: &mut Registry, scope: &str) -> Self {
        let f = Families {
            tx_bytes: Fam::default(),
            tx_wrs: Fam::default(),
            rx_bytes: Fam::default(),
            rx_wrs: Fam::default(),
            completions: Fam::default(),
            rnr: Fam::default(),
            retrans: Fam::default(),
            throttled: Family::default(),
        };
        let n = |s: &str| format!("vrdma_{scope}_{s}");
        reg.register(n("tx_bytes"), "Payload bytes of work requests sent (as requester), by opcode", f.tx_bytes.clone());
        reg.register(n("tx_wrs"), "Work requests sent (as requester) and completed successfully, by opcode", f.tx_wrs.clone());
        reg.register(n("rx_bytes"), "Payload bytes of work requests received (as responder), by opcode", f.rx_bytes.clone());
        reg.register(n("rx_wrs"), "Work requests received (as responder), by opcode", f.rx_wrs.clone());
        reg.register(n("completions"), "Completions of sent work requests, by status", f.completions.clone());
        reg.register(n("rnr_naks"), "Receiver-not-ready NAKs met", f.rnr.clone());
        reg.register(n("retransmissions"), "Requests sent again", f.retrans.clone());
        reg.register(n("throttled_seconds"), "Time held back by a bandwidth or message-rate cap", f.throttled.clone());
        f
    }

    fn add(&self, base: &Labels, r: &MeterReport) {
        let with = |k: &str, v: &str| {
            let mut l = base.clone();
            l.push((k.to_string(), v.to_string()));
            l
        };
        for op in OPCODES {
            let tx = r.tx.get(op).copied().unwrap_or_default();
            let rx = r.rx.get(op).copied().unwrap_or_default();
            self.tx_bytes.get_or_create(&with("opcode", op)).inc_by(tx.bytes);
            self.tx_wrs.get_or_create(&with("opcode", op)).inc_by(tx.wrs);
            self.rx_bytes.get_or_create(&with("opcode", op)).inc_by(rx.bytes);
            self.rx_wrs.get_or_create(&with("opcode", op)).inc_by(rx.wrs);
        }
        for (status, n) in &r.completions {
            self.completions.get_or_create(&with("status", status)).inc_by(*n);
        }
        self.rnr.get_or_create(base).inc_by(r.rnr_naks);
        self.retrans.get_or_create(base).inc_by(r.retransmissions);
        self.throttled.get_or_create(base).inc_by(r.throttled_seconds);
    }
}

/// What the host's transport refused (the `vrdma_host_*` series): hostile peers and
/// networks, not any vNIC's doing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Peers refused at their handshake or first frame.
    pub refused_peers: u64,
    /// Sealed records refused (altered, injected, replayed, cut), each ending its connection.
    pub refused_frames: u64,
    /// Frames of authenticated peers refused for claiming QPs, lanes or datagram sources
    /// they do not serve.
    pub refused_claims: u64,
    /// Containers' connection attempts to a transport port the firewall refused (none
    /// without the firewall).
    pub firewall_refusals: Option<u64>,
    /// Records read from the store and refused as invalid.
    pub refused_store_records: u64,
}

/// The host's counters, registered in `reg`.
fn register_host(reg: &mut Registry, host: &str, c: &HostCounters) {
    let labels: Labels = vec![("host".into(), host.to_string())];
    let series = [
        ("refused_peers", "Peers refused at their TLS handshake or first frame", Some(c.refused_peers)),
        (
            "refused_frames",
            "Sealed frames refused as altered, injected, replayed or cut (each ended its connection)",
            Some(c.refused_frames),
        ),
        (
            "refused_claims",
            "Frames of authenticated peers refused for claiming QPs, lanes or datagram sources they do not serve",
            Some(c.refused_claims),
        ),
        ("firewall_refusals", "Containers' connection attempts to a transport port, refused by the firewall", c.firewall_refusals),
        ("refused_store_records", "Records read from the store and refused as invalid", Some(c.refused_store_records)),
    ];
    for (name, help, value) in series {
        let Some(v) = value else { continue };
        let f = Fam::default();
        reg.register(format!("vrdma_host_{name}"), help, f.clone());
        f.get_or_create(&labels).inc_by(v);
    }
}

/// The exposition text of `meters` and the transport's `counters` served by `host`; per-QP
/// series too with `per_qp`.
pub fn encode_meters(meters: &[VnicMeter], host: &str, per_qp: bool, counters: &HostCounters) -> String {
    let mut reg = Registry::default();
    register_host(&mut reg, host, counters);
    let vnic = Families::register(&mut reg, "vnic");
    let qp = per_qp.then(|| Families::register(&mut reg, "qp"));
    let plain = |name: &str, help: &str, reg: &mut Registry| {
        let f = Fam::default();
        reg.register(format!("vrdma_vnic_{name}"), help, f.clone());
        f
    };
    let refused = plain("refused_connections", "Connections refused by tenant rules or unknown destinations", &mut reg);
    let bad_keys = plain("bad_keys", "Requests naming a memory key the vNIC may not use", &mut reg);
    let bad_requests = plain("bad_requests", "Control requests refused as malformed or naming others' objects", &mut reg);
    let connections = plain("connections", "Connections established", &mut reg);
    let demotions = plain("demotions", "Times the vNIC was moved off the direct path for exceeding its caps there", &mut reg);
    for m in meters {
        let base: Labels = vec![("vnic".into(), m.name.clone()), ("tenant".into(), m.tenant.clone()), ("host".into(), host.to_string())];
        vnic.add(&base, &MeterReport::from_words(&m.total));
        // Counters by name, so that counters other changes add are reported once present.
        let c = serde_json::to_value(m.counters).unwrap_or_default();
        let get = |k: &str| c.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        refused.get_or_create(&base).inc_by(get("refused_connections"));
        bad_keys.get_or_create(&base).inc_by(get("bad_keys"));
        bad_requests.get_or_create(&base).inc_by(get("bad_requests"));
        connections.get_or_create(&base).inc_by(get("connections"));
        demotions.get_or_create(&base).inc_by(get("demotions"));
        if let Some(qp) = &qp {
            for (qpn, w) in &m.qps {
                let mut l = base.clone();
                l.push(("qpn".into(), qpn.to_string()));
                qp.add(&l, &MeterReport::from_words(w));
            }
        }
    }
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Counters;
    use vrdma_abi::ring::METER_WORDS;

    #[test]
    fn series_are_named_by_convention_and_labelled() {
        let mut total = [0u64; METER_WORDS];
        total[0] = 3;
        total[1] = 3 << 20;
        let m = VnicMeter {
            name: "v1".into(),
            tenant: "t".into(),
            total,
            qps: vec![(7, total)],
            counters: Counters { refused_connections: 2, ..Counters::default() },
        };
        let host =
            HostCounters { refused_peers: 4, refused_frames: 1, refused_claims: 3, firewall_refusals: None, refused_store_records: 2 };
        let text = encode_meters(std::slice::from_ref(&m), "h1", false, &host);
        assert!(text.contains("vrdma_host_refused_peers_total{host=\"h1\"} 4"), "{text}");
        assert!(text.contains("vrdma_host_refused_frames_total{host=\"h1\"} 1"), "{text}");
        assert!(text.contains("vrdma_host_refused_claims_total{host=\"h1\"} 3"), "{text}");
        assert!(text.contains("vrdma_host_refused_store_records_total{host=\"h1\"} 2"), "{text}");
        assert!(!text.contains("firewall"), "{text}");
        assert!(text.contains("# TYPE vrdma_vnic_tx_bytes counter"), "{text}");
        assert!(text.contains("vrdma_vnic_tx_bytes_total{vnic=\"v1\",tenant=\"t\",host=\"h1\",opcode=\"rdma_write\"} 3145728"), "{text}");
        assert!(text.contains("vrdma_vnic_completions_total{vnic=\"v1\",tenant=\"t\",host=\"h1\",status=\"success\"} 3"), "{text}");
        assert!(text.contains("vrdma_vnic_refused_connections_total{vnic=\"v1\",tenant=\"t\",host=\"h1\"} 2"), "{text}");
        assert!(!text.contains("vrdma_qp_"));
        assert!(text.ends_with("# EOF\n"));
        assert!(encode_meters(&[m], "h1", true, &host).contains("qpn=\"7\""));
    }
}
