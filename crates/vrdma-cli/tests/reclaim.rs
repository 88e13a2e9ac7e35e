//! A client killed with SIGKILL mid-transfer, 50 times: its peer's QP goes to ERR with
//! flushed completions, and vrdmad's resource counts for the dead client's vNIC return to
//! zero every time.

mod common;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};
use vrdma::*;

#[derive(serde::Serialize, serde::Deserialize)]
struct Endpoint {
    qpns: Vec<u32>,
    gid: Vec<u8>,
    addr: u64,
    rkey: u32,
    stride: u64,
}

#[test]
fn killed_clients_leave_nothing_behind_50_times() {
    let d = Daemon::start("reclaim");
    d.ok(&["vnic", "create", "victim", "--tenant", "t"]);
    d.ok(&["vnic", "create", "survivor", "--tenant", "t"]);
    let ctx = Context::open(&d.socket("survivor")).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let buf = MrBuf::new(&pd, 1 << 20, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ).unwrap();
    for round in 0..50 {
        let cq = ctx.create_cq(1024, None).unwrap();
        let qp = pd
            .create_qp(&QpInitAttr::rc(
                &cq,
                &cq,
                QpCaps { max_send_wr: 64, max_recv_wr: 256, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
            ))
            .unwrap();
        let mut child = d
            .vrdma()
            .args(["__peer", "--socket", d.socket("victim").to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let peer: Endpoint = serde_json::from_str(&line).unwrap_or_else(|e| panic!("round {round}: peer said {line:?}: {e}"));
        let me = Endpoint { qpns: vec![qp.qp_num()], gid: ctx.gids()[0].to_vec(), addr: buf.addr(), rkey: buf.mr().rkey(), stride: 0 };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&peer.gid);
        let remote_access = access::REMOTE_WRITE | access::REMOTE_READ;
        qp.init_rc(remote_access).unwrap();
        for i in 0..256 {
            qp.post_recv(&RecvWr { wr_id: i, sg_list: &[buf.sge(0, 4096)] }).unwrap();
        }
        qp.connect_rc(gid, peer.qpns[0], remote_access).unwrap();
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{}", serde_json::to_string(&me).unwrap()).unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "connected", "round {round}");
        // Let traffic flow (the survivor reposts receives, and sends back), then kill.
        let mut wcs = [Wc::EMPTY; 64];
        let t0 = Instant::now();
        let mut received = 0;
        let ssge = [buf.sge(8192, 64)];
        // Traffic for 10-50 ms, and at least until the victim's first messages arrived (a
        // loaded CI machine may not schedule it at once).
        while t0.elapsed() < Duration::from_millis(10 + (round % 5) * 10) || (received == 0 && t0.elapsed() < Duration::from_secs(10)) {
            let n = cq.poll(&mut wcs);
            for w in &wcs[..n] {
                assert_eq!(w.status, WcStatus::Success, "round {round}: {w:?}");
                if w.opcode == WcOpcode::Recv {
                    received += 1;
                    qp.post_recv(&RecvWr { wr_id: w.wr_id, sg_list: &[buf.sge(0, 4096)] }).unwrap();
                }
            }
            // The victim may be slow to repost: a full send queue (RNR backlog) is fine.
            match qp.post_send(&SendWr::new(1_000_000, WrOpcode::Send, &ssge, 0)) {
                Ok(()) | Err(Error::QueueFull { .. }) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert!(received > 0, "round {round}: no traffic before the kill");
        child.kill().unwrap();
        child.wait().unwrap();
        // The survivor's QP goes to ERR; its receives flush; later sends flush.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut flushed = 0;
        while qp.state() != QpState::Err {
            assert!(Instant::now() < deadline, "round {round}: survivor QP never left {:?}", qp.state());
            let n = cq.poll(&mut wcs);
            for w in &wcs[..n] {
                if w.status == WcStatus::WrFlushErr {
                    flushed += 1;
                } else {
                    assert_eq!(w.status, WcStatus::Success, "round {round}");
                    if w.opcode == WcOpcode::Recv {
                        qp.post_recv(&RecvWr { wr_id: w.wr_id, sg_list: &[buf.sge(0, 4096)] }).unwrap();
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        loop {
            let n = cq.poll(&mut wcs);
            if n == 0 {
                break;
            }
            flushed += wcs[..n].iter().filter(|w| w.status == WcStatus::WrFlushErr).count();
        }
        // (The victim may have consumed every posted receive just before dying, so the count
        // of flushed outstanding receives can legitimately be zero; new WRs must flush.)
        let _ = flushed;
        qp.post_send(&SendWr::new(7, WrOpcode::Send, &ssge, 0)).unwrap();
        qp.post_recv(&RecvWr { wr_id: 8, sg_list: &[buf.sge(0, 64)] }).unwrap();
        assert_eq!(cq.poll(&mut wcs[..2]), 2);
        let mut got: Vec<(u64, WcStatus)> = wcs[..2].iter().map(|w| (w.wr_id, w.status)).collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(got, vec![(7, WcStatus::WrFlushErr), (8, WcStatus::WrFlushErr)], "round {round}");
        drop(qp);
        drop(cq);
        // The victim's vNIC is back to zero.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let u = d.vnic("victim")["usage"].clone();
            let zero = ["clients", "pds", "cqs", "qps", "mrs", "mr_bytes", "srqs"].iter().all(|k| u[k] == 0);
            if zero {
                break;
            }
            assert!(Instant::now() < deadline, "round {round}: victim resources not reclaimed: {u}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The survivor holds exactly its PD and MR (its per-round CQs and QPs were destroyed).
    let u = d.vnic("survivor")["usage"].clone();
    assert_eq!(
        (u["clients"].as_u64(), u["pds"].as_u64(), u["mrs"].as_u64(), u["qps"].as_u64(), u["cqs"].as_u64()),
        (Some(1), Some(1), Some(1), Some(0), Some(0)),
        "{u}"
    );
}
