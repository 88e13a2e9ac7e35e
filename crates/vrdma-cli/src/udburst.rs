//! `vrdma __ud-burst`: a UD test peer for end-to-end tests. The receiver posts a receive for
//! every datagram, prints its endpoint as a JSON line and counts what arrives, each datagram
//! checked. The sender reads that endpoint from stdin, posts its datagrams back to back and
//! destroys its QP the moment the last send completes: a completed UD send has left the
//! NIC, so every datagram must still arrive.

use anyhow::{bail, Context as _};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};
use vrdma::*;

use crate::oob::Endpoint;

/// Payload bytes per datagram (plus the 40-byte GRH in the receive buffer).
const PAYLOAD: usize = 4000;
const SLOT: usize = GRH_LEN + PAYLOAD;
const QKEY: u32 = 0x1111_1111;

/// Byte `at` of datagram `seq`.
fn pattern(seq: u64, at: usize) -> u8 {
    (seq.wrapping_mul(31).wrapping_add(at as u64 * 7) % 251) as u8
}

fn ud_qp<'a>(pd: &'a Pd, cq: &'a Cq, depth: u32) -> anyhow::Result<Qp> {
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd.create_qp(&QpInitAttr::ud(cq, cq, caps))?;
    let a = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qkey: QKEY, ..Default::default() };
    qp.modify(&a, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY)?;
    qp.modify(&QpAttr { qp_state: QpState::Rtr as u32, ..Default::default() }, qp_attr::STATE)?;
    qp.modify(&QpAttr { qp_state: QpState::Rts as u32, ..Default::default() }, qp_attr::STATE | qp_attr::SQ_PSN)?;
    Ok(qp)
}

/// Receives `count` datagrams on the vNIC at `socket` within `wait_secs` of the first.
pub(crate) fn receive(socket: &std::path::Path, count: u32, wait_secs: u64) -> anyhow::Result<()> {
    let ctx = Context::open(socket)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(count.max(1), None)?;
    let qp = ud_qp(&pd, &cq, count.max(1))?;
    let buf = MrBuf::new(&pd, SLOT * count as usize, access::LOCAL_WRITE)?;
    for i in 0..count {
        qp.post_recv(&RecvWr { wr_id: u64::from(i), sg_list: &[buf.sge(SLOT * i as usize, SLOT as u32)] })?;
    }
    let me = Endpoint { qpns: vec![qp.qp_num()], gid: ctx.gids()[0].to_vec(), addr: 0, rkey: 0, stride: 0, areas: 0 };
    let mut out = std::io::stdout();
    writeln!(out, "{}", serde_json::to_string(&me)?)?;
    out.flush()?;
    let mut wcs = [Wc::EMPTY; 64];
    let mut seen = vec![false; count as usize];
    let mut got = 0u32;
    let mut deadline: Option<Instant> = None;
    let mut slot = vec![0u8; SLOT];
    while got < count {
        if deadline.is_some_and(|d| Instant::now() > d) {
            bail!("received {got} of {count} datagrams");
        }
        let n = cq.poll(&mut wcs);
        if n == 0 {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(wait_secs));
        for c in &wcs[..n] {
            if c.status != WcStatus::Success || c.byte_len as usize != SLOT {
                bail!("receive {}: {:?}, {} bytes", c.wr_id, c.status, c.byte_len);
            }
            buf.read(SLOT * c.wr_id as usize, &mut slot);
            let payload = &slot[GRH_LEN..];
            let seq = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
            if seq >= u64::from(count) || seen[seq as usize] {
                bail!("datagram {seq} unexpected or repeated");
            }
            if let Some(at) = (8..PAYLOAD).find(|&at| payload[at] != pattern(seq, at)) {
                bail!("datagram {seq}: byte {at} corrupted");
            }
            seen[seq as usize] = true;
            got += 1;
        }
    }
    writeln!(out, "received {count} datagrams, all verified")?;
    Ok(())
}

/// Sends `count` datagrams to the endpoint read from stdin, then destroys the QP at once.
pub(crate) fn send(socket: &std::path::Path, count: u32) -> anyhow::Result<()> {
    const DEPTH: u32 = 128;
    let ctx = Context::open(socket)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(DEPTH, None)?;
    let qp = ud_qp(&pd, &cq, DEPTH)?;
    let buf = MrBuf::new(&pd, PAYLOAD * DEPTH as usize, access::LOCAL_WRITE)?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let peer: Endpoint = serde_json::from_str(&line).context("receiver endpoint")?;
    let mut dgid = [0u8; 16];
    dgid.copy_from_slice(peer.gid.get(..16).context("receiver GID")?);
    let dest = UdDest { dgid, qpn: *peer.qpns.first().context("receiver QPN")?, qkey: QKEY };
    let mut wcs = [Wc::EMPTY; 64];
    let mut outstanding = 0u32;
    let mut payload = vec![0u8; PAYLOAD];
    for seq in 0..u64::from(count) {
        while outstanding == DEPTH {
            let n = cq.poll(&mut wcs);
            if let Some(c) = wcs[..n].iter().find(|c| c.status != WcStatus::Success) {
                bail!("send {}: {:?}", c.wr_id, c.status);
            }
            outstanding -= n as u32;
        }
        payload[..8].copy_from_slice(&seq.to_le_bytes());
        for (at, b) in payload.iter_mut().enumerate().skip(8) {
            *b = pattern(seq, at);
        }
        let slot = PAYLOAD * (seq % u64::from(DEPTH)) as usize;
        buf.write(slot, &payload);
        let sg = [buf.sge(slot, PAYLOAD as u32)];
        qp.post_send_ud(&SendWr::new(seq, WrOpcode::Send, &sg, send_flags::SIGNALED), &dest)?;
        outstanding += 1;
    }
    while outstanding > 0 {
        let n = cq.poll(&mut wcs);
        if let Some(c) = wcs[..n].iter().find(|c| c.status != WcStatus::Success) {
            bail!("send {}: {:?}", c.wr_id, c.status);
        }
        outstanding -= n as u32;
    }
    // Destroyed the moment its last send completed.
    drop(qp);
    println!("sent {count} datagrams");
    Ok(())
}
