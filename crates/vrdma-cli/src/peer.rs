//! `vrdma __peer`: a test peer for end-to-end tests that kill clients mid-transfer. It
//! prints its endpoint as a JSON line, reads the other side's from stdin, connects, says
//! `connected`, then streams RDMA WRITEs and SENDs (and, with `--reads`, RDMA READs) at the
//! other side until killed.

use anyhow::{bail, Context as _};
use std::io::{BufRead, Write};
use vrdma::*;

use crate::oob::Endpoint;

const BUF: usize = 1 << 20;

/// Runs the peer on the vNIC at `socket`.
pub(crate) fn run(socket: &std::path::Path, reads: u32) -> anyhow::Result<()> {
    if reads as usize > BUF / 2 {
        bail!("--reads {reads}: at most {} bytes", BUF / 2);
    }
    let ctx = Context::open(socket)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(1024, None)?;
    let qp = pd.create_qp(&QpInitAttr::rc(
        &cq,
        &cq,
        QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 },
    ))?;
    let buf = MrBuf::new(&pd, BUF, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ)?;
    let remote_access = access::REMOTE_WRITE | access::REMOTE_READ;
    // INIT first: the receives are posted before the other side can connect and send.
    qp.init_rc(remote_access)?;
    for i in 0..256 {
        qp.post_recv(&RecvWr { wr_id: i, sg_list: &[buf.sge(BUF / 2, 4096)] })?;
    }
    let me = Endpoint {
        qpns: vec![qp.qp_num()],
        gid: ctx.gids()[0].to_vec(),
        addr: buf.addr(),
        rkey: buf.mr().rkey(),
        stride: BUF as u64,
        areas: 1,
    };
    let mut out = std::io::stdout();
    writeln!(out, "{}", serde_json::to_string(&me)?)?;
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let peer: Endpoint = serde_json::from_str(&line).context("peer endpoint")?;
    let mut gid = [0u8; 16];
    gid.copy_from_slice(peer.gid.get(..16).context("peer GID")?);
    qp.connect_rc(gid, peer.qpns[0], remote_access)?;
    writeln!(out, "connected")?;
    out.flush()?;
    let wsge = [buf.sge(0, 65536)];
    let ssge = [buf.sge(0, 64)];
    // READs land in the buffer's first half; received SENDs in the second.
    let rsge = [buf.sge(0, reads)];
    let mut wcs = [Wc::EMPTY; 32];
    let mut i: u64 = 0;
    loop {
        i += 1;
        let mut w = SendWr::new(i, WrOpcode::RdmaWrite, &wsge, if i.is_multiple_of(16) { send_flags::SIGNALED } else { 0 });
        w.remote_addr = peer.addr + (i % 8) * 65536;
        w.rkey = peer.rkey;
        // A full send queue (the other side is slow to repost receives) just means: poll.
        let mut read = SendWr::new(i, WrOpcode::RdmaRead, &rsge, send_flags::SIGNALED);
        read.remote_addr = peer.addr;
        read.rkey = peer.rkey;
        for r in [
            qp.post_send(&w),
            if i.is_multiple_of(4) { qp.post_send(&SendWr::new(i, WrOpcode::Send, &ssge, 0)) } else { Ok(()) },
            if reads > 0 && i.is_multiple_of(64) { qp.post_send(&read) } else { Ok(()) },
        ] {
            match r {
                Ok(()) | Err(Error::QueueFull { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let n = cq.poll(&mut wcs);
        for c in &wcs[..n] {
            if c.opcode == WcOpcode::Recv && c.status == WcStatus::Success {
                qp.post_recv(&RecvWr { wr_id: c.wr_id, sg_list: &[buf.sge(BUF / 2, 4096)] })?;
            } else if c.status != WcStatus::Success {
                bail!("completion error {:?}", c.status);
            }
        }
    }
}
