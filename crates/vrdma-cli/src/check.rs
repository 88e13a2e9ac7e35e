//! `vrdma check`: every operation once between two vNICs, every byte verified.

use anyhow::bail;
use vrdma::*;

use crate::oob::Oob;
use crate::perf::{pattern, poll_n, post_recvs, setup, Kind, PerfArgs, Setup, Spin, DEFAULT_INLINE};

/// Fails, naming the first byte where `got` differs from `want`.
fn verify(what: &str, got: &[u8], want: &[u8]) -> anyhow::Result<()> {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        bail!("{what}: data mismatch at byte {i}: got {:#x}, want {:#x}", got[i], want[i]);
    }
    Ok(())
}

/// `vrdma check`: SEND/RECV, RDMA WRITE, RDMA READ and both atomics between two vNICs,
/// every byte verified on the receiving side. Exits non-zero on any mismatch.
pub(crate) fn run(server: Option<String>, port: u16) -> anyhow::Result<()> {
    const LEN: usize = 1 << 20;
    let client = server.is_some();
    let mut oob = match &server {
        Some(h) => Oob::connect(h, port)?,
        None => Oob::accept(port)?,
    };
    let a = PerfArgs {
        test: "send_lat".into(),
        server: server.clone(),
        size: LEN as u64,
        all: false,
        iters: None,
        qps: 1,
        port,
        tx_depth: 16,
        duration: None,
        interval: None,
        json: false,
        buf_per_qp: false,
        mem: vrdma::Backing::Anonymous,
        start_at: None,
        check: false,
        inline_size: DEFAULT_INLINE,
        spin: Spin::Pause,
    };
    let s = setup(&a, Kind::Send, true, &mut oob)?;
    let mut wcs = [Wc::EMPTY; 4];
    let half = (s.stride / 2) as usize;
    let qp = &s.qps[0];
    post_recvs(&s, 0, 1)?;
    oob.send(&"posted")?;
    let _: String = oob.recv()?;
    // 1. SEND/RECV both ways.
    let p1 = pattern(1, LEN);
    if client {
        s.buf.write(0, &p1);
        qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s.buf.sge(0, LEN as u32)], send_flags::SIGNALED))?;
        poll_n(&s.scq, 1, &mut wcs)?;
        poll_n(&s.rcq, 1, &mut wcs)?;
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        let echo: Vec<u8> = p1.iter().map(|b| b ^ 0xff).collect();
        verify("SEND echo", &got, &echo)?;
        println!("SEND/RECV      ok: {LEN} bytes each way, verified");
    } else {
        poll_n(&s.rcq, 1, &mut wcs)?;
        if wcs[0].byte_len as usize != LEN {
            bail!("received {} bytes, expected {LEN}", wcs[0].byte_len);
        }
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        verify("SEND", &got, &p1)?;
        let echo: Vec<u8> = got.iter().map(|b| b ^ 0xff).collect();
        s.buf.write(0, &echo);
        qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s.buf.sge(0, LEN as u32)], send_flags::SIGNALED))?;
        poll_n(&s.scq, 1, &mut wcs)?;
    }
    // 2. RDMA WRITE client -> server, verified by the server.
    let p2 = pattern(2, LEN);
    if client {
        s.buf.write(0, &p2);
        post_to_peer(&s, &mut wcs, 2, WrOpcode::RdmaWrite, LEN, (0, 0))?;
        server_verdict(&mut oob, "written")?;
        println!("RDMA WRITE     ok: {LEN} bytes, verified by the target");
    } else {
        let _: String = oob.recv()?;
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        match verify("WRITE", &got, &p2) {
            Ok(()) => oob.send(&"ok")?,
            Err(e) => {
                oob.send(&e.to_string())?;
                return Err(e);
            }
        }
    }
    // 3. RDMA READ: the server publishes a pattern, the client reads and checks it.
    let p3 = pattern(3, LEN);
    if client {
        let _: String = oob.recv()?;
        post_to_peer(&s, &mut wcs, 3, WrOpcode::RdmaRead, LEN, (0, 0))?;
        let mut got = vec![0u8; LEN];
        s.buf.read(0, &mut got);
        verify("READ", &got, &p3)?;
        oob.send(&"read")?;
        println!("RDMA READ      ok: {LEN} bytes, verified");
    } else {
        s.buf.write(half, &p3);
        oob.send(&"published")?;
        let _: String = oob.recv()?;
    }
    // 4. Atomics on a counter in the server's memory.
    if client {
        let _: String = oob.recv()?;
        post_to_peer(&s, &mut wcs, 4, WrOpcode::AtomicFetchAndAdd, 8, (5, 0))?;
        let mut v = [0u8; 8];
        s.buf.read(0, &mut v);
        if u64::from_ne_bytes(v) != 100 {
            bail!("FETCH_AND_ADD returned {}, expected 100", u64::from_ne_bytes(v));
        }
        post_to_peer(&s, &mut wcs, 4, WrOpcode::AtomicCmpAndSwp, 8, (105, 7))?;
        s.buf.read(0, &mut v);
        if u64::from_ne_bytes(v) != 105 {
            bail!("CMP_AND_SWP returned {}, expected 105", u64::from_ne_bytes(v));
        }
        server_verdict(&mut oob, "swapped")?;
        println!("ATOMIC FAA+CAS ok: 100 +5 -> 105, CAS 105->7, verified by the target");
    } else {
        s.buf.write(half, &100u64.to_ne_bytes());
        oob.send(&"counter")?;
        let _: String = oob.recv()?;
        let mut v = [0u8; 8];
        s.buf.read(half, &mut v);
        let val = u64::from_ne_bytes(v);
        oob.send(&if val == 7 { "ok".to_string() } else { format!("counter is {val}, expected 7") })?;
        if val != 7 {
            bail!("counter is {val}, expected 7");
        }
        println!("check server: all data verified");
    }
    Ok(())
}

/// Posts one signaled `opcode` of `len` bytes from the start of our buffer to the peer's
/// second half, with the atomic operands `(compare_add, swap)`, and waits for its completion.
fn post_to_peer(
    s: &Setup,
    wcs: &mut [Wc],
    wr_id: u64,
    opcode: WrOpcode,
    len: usize,
    (compare_add, swap): (u64, u64),
) -> anyhow::Result<()> {
    let sg = [s.buf.sge(0, len as u32)];
    let mut wr = SendWr::new(wr_id, opcode, &sg, send_flags::SIGNALED);
    wr.remote_addr = s.peer.addr + s.stride / 2;
    wr.rkey = s.peer.rkey;
    wr.compare_add = compare_add;
    wr.swap = swap;
    s.qps[0].post_send(&wr)?;
    poll_n(&s.scq, 1, wcs)
}

/// Tells the server that `what` is done and fails unless its check of the data passed.
fn server_verdict(oob: &mut Oob, what: &str) -> anyhow::Result<()> {
    oob.send(&what)?;
    let v: String = oob.recv()?;
    if v != "ok" {
        bail!("server: {v}");
    }
    Ok(())
}
