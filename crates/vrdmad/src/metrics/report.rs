//! A meter's words (`vrdma_abi::ring::MeterWords`) as named counters, for `vrdma vnic
//! stats`, `vrdma top` and /metrics.

use std::collections::BTreeMap;

use vrdma_abi::ring::{
    meter_opcode, MeterWords, METER_OPCODES, METER_RETRANSMITS, METER_RNR, METER_RX, METER_STATUS, METER_STATUSES, METER_THROTTLED_NS,
};

/// Names of `ibv_wr_opcode` 0..=6, as labels.
pub const OPCODES: [&str; METER_OPCODES] =
    ["rdma_write", "rdma_write_with_imm", "send", "send_with_imm", "rdma_read", "atomic_cmp_and_swp", "atomic_fetch_and_add"];

/// Label of `ibv_wc_status` `s` (None for values no verb returns).
pub fn status_name(s: usize) -> Option<&'static str> {
    Some(match s {
        0 => "success",
        1 => "loc_len_err",
        2 => "loc_qp_op_err",
        4 => "loc_prot_err",
        5 => "wr_flush_err",
        7 => "bad_resp_err",
        8 => "loc_access_err",
        9 => "rem_inv_req_err",
        10 => "rem_access_err",
        11 => "rem_op_err",
        12 => "retry_exc_err",
        13 => "rnr_retry_exc_err",
        19 => "fatal_err",
        21 => "general_err",
        _ => return None,
    })
}

/// WRs and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OpCount {
    /// Work requests.
    pub wrs: u64,
    /// Payload bytes.
    pub bytes: u64,
}

/// A meter, named.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MeterReport {
    /// Bytes sent (as requester), every opcode.
    pub tx_bytes: u64,
    /// WRs sent.
    pub tx_wrs: u64,
    /// Bytes received (as responder).
    pub rx_bytes: u64,
    /// WRs received.
    pub rx_wrs: u64,
    /// Sent, by opcode (those with any).
    pub tx: BTreeMap<String, OpCount>,
    /// Received, by opcode.
    pub rx: BTreeMap<String, OpCount>,
    /// Completions of sent WRs by status (successes: every WR sent).
    pub completions: BTreeMap<String, u64>,
    /// RNR NAKs met.
    pub rnr_naks: u64,
    /// Requests sent again.
    pub retransmissions: u64,
    /// Seconds held back by a cap.
    pub throttled_seconds: f64,
}

fn by_opcode(w: &MeterWords, base: usize) -> BTreeMap<String, OpCount> {
    (0..METER_OPCODES as u32)
        .map(|op| (op, base + meter_opcode(op)))
        .filter(|&(_, i)| w[i] != 0 || w[i + 1] != 0)
        .map(|(op, i)| (OPCODES[op as usize].to_string(), OpCount { wrs: w[i], bytes: w[i + 1] }))
        .collect()
}

impl MeterReport {
    /// Names `w`.
    pub fn from_words(w: &MeterWords) -> Self {
        let tx = by_opcode(w, 0);
        let rx = by_opcode(w, METER_RX);
        let mut completions = BTreeMap::new();
        // Successes are the WRs sent: both paths count a sent WR when it completes well.
        let sent: u64 = tx.values().map(|c| c.wrs).sum();
        completions.insert("success".to_string(), sent);
        for s in 1..METER_STATUSES {
            let n = w[METER_STATUS + s];
            if n != 0 {
                let name = status_name(s).unwrap_or("other");
                *completions.entry(name.to_string()).or_insert(0) += n;
            }
        }
        MeterReport {
            tx_bytes: tx.values().map(|c| c.bytes).sum(),
            tx_wrs: sent,
            rx_bytes: rx.values().map(|c| c.bytes).sum(),
            rx_wrs: rx.values().map(|c| c.wrs).sum(),
            tx,
            rx,
            completions,
            rnr_naks: w[METER_RNR],
            retransmissions: w[METER_RETRANSMITS],
            throttled_seconds: w[METER_THROTTLED_NS] as f64 / 1e9,
        }
    }
}

/// The admin socket's answer to `stats` (see `crate::admin::AdminRequest::Stats`).
pub(crate) fn stats_reply(
    d: &crate::server::Daemon,
    name: Option<&str>,
    qps: bool,
) -> Result<serde_json::Value, crate::server::ServerError> {
    use serde_json::json;
    let meters = {
        let mut reg = d.registry.lock();
        match name {
            Some(n) => match reg.vnic_meter(n) {
                Some(m) => vec![m],
                None => return Ok(json!({"ok": false, "error": format!("no vNIC named {n} is served by this host")})),
            },
            None => reg.vnic_meters(),
        }
    };
    let host = &d.host().name;
    let vnics: Vec<_> = meters
        .iter()
        .map(|m| {
            let mut v = json!({
                "vnic": m.name, "tenant": m.tenant, "host": host,
                "total": MeterReport::from_words(&m.total), "counters": m.counters,
            });
            if qps {
                let q: Vec<_> = m.qps.iter().map(|(qpn, w)| json!({"qpn": qpn, "meter": MeterReport::from_words(w)})).collect();
                v["qps"] = json!(q);
            }
            v
        })
        .collect();
    Ok(json!({"ok": true, "vnics": vnics}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_abi::ring::METER_WORDS;

    #[test]
    fn words_are_named_and_summed() {
        let mut w = [0u64; METER_WORDS];
        w[0] = 2; // 2 WRITEs
        w[1] = 8192;
        w[4] = 1; // 1 SEND
        w[5] = 64;
        w[METER_RX + 4] = 1; // 1 SEND received
        w[METER_RX + 5] = 3;
        w[METER_STATUS + 10] = 1;
        w[METER_RNR] = 4;
        let r = MeterReport::from_words(&w);
        assert_eq!((r.tx_wrs, r.tx_bytes), (3, 8256));
        assert_eq!(r.tx["rdma_write"], OpCount { wrs: 2, bytes: 8192 });
        assert_eq!(r.completions["success"], 3);
        assert_eq!(r.completions["rem_access_err"], 1);
        assert_eq!(r.rnr_naks, 4);
        assert_eq!(r.rx_bytes, 3);
    }
}
