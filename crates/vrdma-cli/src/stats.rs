//! `vrdma vnic stats NAME`: a vNIC's meters (bytes and WRs by opcode, completions by status,
//! RNR, retransmissions, time throttled, refusals), from vrdmad's admin socket.

use serde_json::{json, Value};

use crate::admin;

/// `n` bytes for people (B, KiB, MiB, GiB).
pub(crate) fn human_bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Prints one meter report (`MeterReport` as JSON), indented by `pad`.
fn print_meter(m: &Value, pad: &str) {
    println!(
        "{pad}sent     {:>12} WRs {:>12}    received {:>12} WRs {:>12}",
        n(&m["tx_wrs"]),
        human_bytes(n(&m["tx_bytes"]) as f64),
        n(&m["rx_wrs"]),
        human_bytes(n(&m["rx_bytes"]) as f64)
    );
    let mut ops: Vec<&String> = m["tx"].as_object().into_iter().flatten().map(|(k, _)| k).collect();
    ops.extend(m["rx"].as_object().into_iter().flatten().map(|(k, _)| k));
    ops.sort();
    ops.dedup();
    if !ops.is_empty() {
        println!("{pad}{:<22} {:>12} {:>16} {:>12} {:>16}", "OPCODE", "TX_WRS", "TX_BYTES", "RX_WRS", "RX_BYTES");
        for op in ops {
            let (t, r) = (&m["tx"][op], &m["rx"][op]);
            println!("{pad}{op:<22} {:>12} {:>16} {:>12} {:>16}", n(&t["wrs"]), n(&t["bytes"]), n(&r["wrs"]), n(&r["bytes"]));
        }
    }
    let comps: Vec<String> = m["completions"].as_object().into_iter().flatten().map(|(k, v)| format!("{k}={}", n(v))).collect();
    println!("{pad}completions {}", comps.join(" "));
    println!(
        "{pad}rnr_naks {}  retransmissions {}  throttled {:.3} s",
        n(&m["rnr_naks"]),
        n(&m["retransmissions"]),
        m["throttled_seconds"].as_f64().unwrap_or(0.0)
    );
}

/// `vrdma vnic stats`.
pub(crate) fn run(name: &str, qps: bool, as_json: bool) -> anyhow::Result<()> {
    let v = admin::call(json!({"op": "stats", "name": name, "qps": qps}))?;
    let Some(x) = v["vnics"].as_array().and_then(|a| a.first()) else { anyhow::bail!("vrdmad returned no meter for {name}") };
    if as_json {
        println!("{}", serde_json::to_string_pretty(x)?);
        return Ok(());
    }
    println!(
        "vNIC {} (tenant {}, host {})",
        x["vnic"].as_str().unwrap_or(name),
        x["tenant"].as_str().unwrap_or(""),
        x["host"].as_str().unwrap_or("")
    );
    print_meter(&x["total"], "  ");
    let c = &x["counters"];
    println!(
        "  connections {}  refused_connections {}  bad_keys {}  bad_requests {}  demotions {}",
        n(&c["connections"]),
        n(&c["refused_connections"]),
        n(&c["bad_keys"]),
        n(&c["bad_requests"]),
        n(&c["demotions"])
    );
    for q in x["qps"].as_array().into_iter().flatten() {
        println!("  QP {}", n(&q["qpn"]));
        print_meter(&q["meter"], "    ");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(512.0), "512 B");
        assert_eq!(human_bytes(1536.0), "1.5 KiB");
        assert_eq!(human_bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3.0 GiB");
    }
}
