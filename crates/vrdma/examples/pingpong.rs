//! Two vNICs, one process, one thread each: SEND/RECV ping-pong plus an RDMA WRITE and READ,
//! data checked. Needs vrdmad running and two vNICs of one tenant:
//!
//! ```sh
//! vrdma vnic create ex-a --tenant ex && vrdma vnic create ex-b --tenant ex
//! cargo run --release -p vrdma --example pingpong -- /run/vrdma/vnics/ex-a/control.sock /run/vrdma/vnics/ex-b/control.sock
//! ```

use vrdma::*;

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    buf: MrBuf,
}

fn side(sock: &str) -> Result<Side, Error> {
    let ctx = Context::open(std::path::Path::new(sock))?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64, None)?;
    let qp = pd.create_qp(&QpInitAttr::rc(
        &cq,
        &cq,
        QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 },
    ))?;
    let buf = MrBuf::new(&pd, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ)?;
    Ok(Side { ctx, _pd: pd, cq, qp, buf })
}

fn connect(s: &Side, peer: &Side) -> Result<(), Error> {
    s.qp.connect_rc(peer.ctx.gids()[0], peer.qp.qp_num(), access::REMOTE_WRITE | access::REMOTE_READ)
}

fn wait(cq: &Cq) -> Wc {
    let mut wc = [Wc::EMPTY];
    while cq.poll(&mut wc) == 0 {
        std::hint::spin_loop();
    }
    assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
    wc[0]
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let (a, b) = (side(&args[1])?, side(&args[2])?);
    connect(&a, &b)?;
    connect(&b, &a)?;
    for i in 0..1000u32 {
        b.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[b.buf.sge(0, 64)] })?;
        a.buf.write(0, &i.to_le_bytes());
        a.qp.post_send(&SendWr::new(2, WrOpcode::Send, &[a.buf.sge(0, 4)], send_flags::SIGNALED))?;
        wait(&a.cq);
        let r = wait(&b.cq);
        let mut got = [0u8; 4];
        b.buf.read(0, &mut got);
        assert_eq!((r.byte_len, u32::from_le_bytes(got)), (4, i));
    }
    let sge = [a.buf.sge(100, 11)];
    a.buf.write(100, b"hello, rdma");
    let mut w = SendWr::new(3, WrOpcode::RdmaWrite, &sge, send_flags::SIGNALED);
    w.remote_addr = b.buf.addr() + 2000;
    w.rkey = b.buf.mr().rkey();
    a.qp.post_send(&w)?;
    wait(&a.cq);
    let mut got = [0u8; 11];
    b.buf.read(2000, &mut got);
    assert_eq!(&got, b"hello, rdma");
    println!("1000 SEND/RECV round trips and an RDMA WRITE verified between {} and {}", a.ctx.name(), b.ctx.name());
    Ok(())
}
