//! UD QPs (datagrams with a GRH, Q_Keys, drops) and the hardware-like handling of a peer
//! that goes away, against an in-process vrdmad.

mod common;
use common::*;
use vrdma::*;

struct UdEnd {
    ctx: Context,
    cq: Cq,
    qp: Qp,
    buf: MrBuf,
    _pd: Pd,
}

const QKEY: u32 = 0x1111_1111;

fn ud_end(sock: &std::path::Path) -> UdEnd {
    let ctx = Context::open(sock).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
    let qp = pd.create_qp(&QpInitAttr::ud(&cq, &cq, caps)).unwrap();
    let buf = MrBuf::new(&pd, 1 << 16, access::LOCAL_WRITE).unwrap();
    // RESET -> INIT (Q_Key) -> RTR -> RTS: UD needs no address vector.
    let a = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qkey: QKEY, ..Default::default() };
    qp.modify(&a, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY).unwrap();
    qp.modify(&QpAttr { qp_state: QpState::Rtr as u32, ..Default::default() }, qp_attr::STATE).unwrap();
    qp.modify(&QpAttr { qp_state: QpState::Rts as u32, ..Default::default() }, qp_attr::STATE | qp_attr::SQ_PSN).unwrap();
    UdEnd { ctx, cq, qp, buf, _pd: pd }
}

fn send(from: &UdEnd, to: &UdEnd, wr_id: u64, data: &[u8], qkey: u32) {
    from.buf.write(0, data);
    let sg = [from.buf.sge(0, data.len() as u32)];
    let wr = SendWr::new(wr_id, WrOpcode::Send, &sg, send_flags::SIGNALED);
    from.qp.post_send_ud(&wr, &UdDest { dgid: to.ctx.gids()[0], qpn: to.qp.qp_num(), qkey }).unwrap();
    let c = wait_one(&from.cq);
    assert_eq!((c.wr_id, c.status), (wr_id, WcStatus::Success), "UD sends always complete");
}

each_path!(ud_datagrams_carry_a_grh_and_respect_qkeys);
fn ud_datagrams_carry_a_grh_and_respect_qkeys(mode: Mode) {
    let h = Host::new(mode, "ud");
    let a = ud_end(&h.vnic("a", "t"));
    let b = ud_end(&h.vnic("b", "t"));

    // No receive posted: dropped, the sender still completes.
    send(&a, &b, 1, b"lost", QKEY);
    poll_none(&b.cq);

    // Delivered: GRH (sender's GID at 8, ours at 24), then the payload.
    b.qp.post_recv(&RecvWr { wr_id: 9, sg_list: &[b.buf.sge(0, 40 + 100)] }).unwrap();
    send(&a, &b, 2, b"datagram", QKEY);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status, r.byte_len, r.src_qp), (9, WcStatus::Success, 40 + 8, a.qp.qp_num()));
    assert_eq!(r.wc_flags & wc_flags::GRH, wc_flags::GRH);
    let mut grh = [0u8; 48];
    b.buf.read(0, &mut grh);
    assert_eq!(grh[0] >> 4, 6);
    assert_eq!(&grh[8..24], &a.ctx.gids()[0]);
    assert_eq!(&grh[24..40], &b.ctx.gids()[0]);
    assert_eq!(&grh[40..48], b"datagram");

    // A wrong Q_Key is dropped silently; the high bit means "the sender QP's own Q_Key".
    b.qp.post_recv(&RecvWr { wr_id: 10, sg_list: &[b.buf.sge(0, 140)] }).unwrap();
    send(&a, &b, 3, b"bad qkey", 0x2222);
    poll_none(&b.cq);
    send(&a, &b, 4, b"own qkey", 0x8000_0000);
    assert_eq!(wait_one(&b.cq).wr_id, 10);

    // A receive without room for the GRH and the payload completes with LOC_LEN_ERR.
    b.qp.post_recv(&RecvWr { wr_id: 11, sg_list: &[b.buf.sge(0, 40)] }).unwrap();
    send(&a, &b, 5, b"too long", QKEY);
    assert_eq!(wait_one(&b.cq).status, WcStatus::LocLenErr);

    // RC operations and RC posting are refused on UD QPs.
    let sg = [a.buf.sge(0, 8)];
    assert!(a.qp.post_send(&SendWr::new(6, WrOpcode::Send, &sg, 0)).is_err());
    let dest = UdDest { dgid: b.ctx.gids()[0], qpn: b.qp.qp_num(), qkey: QKEY };
    assert!(a.qp.post_send_ud(&SendWr::new(7, WrOpcode::RdmaWrite, &sg, 0), &dest).is_err());
}

each_path!(ud_destinations_follow_tenant_rules);
fn ud_destinations_follow_tenant_rules(mode: Mode) {
    let h = Host::new(mode, "ud-tenants");
    let a = ud_end(&h.vnic("a", "t"));
    let c = ud_end(&h.vnic("c", "other"));
    let e = a.ctx.check_gid(c.ctx.gids()[0]).unwrap_err();
    assert_eq!(e.errno(), libc::ECONNREFUSED, "{e}");
    a.ctx.check_gid(a.ctx.gids()[0]).unwrap();
    assert_eq!(a.ctx.check_gid([9; 16]).unwrap_err().errno(), libc::EHOSTUNREACH);
    // Sending anyway: the datagram is dropped.
    c.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[c.buf.sge(0, 140)] }).unwrap();
    send(&a, &c, 1, b"no", QKEY);
    poll_none(&c.cq);
}

each_path!(peer_loss_like_hardware_keeps_receives_until_the_next_send);
fn peer_loss_like_hardware_keeps_receives_until_the_next_send(mode: Mode) {
    let h = Host::new(mode, "peerloss");
    let (sa, sb) = (h.vnic("a", "t"), h.vnic("b", "t"));
    let (a, b) = h.pair(&sa, &sb, ALL);
    a.ctx.set_peer_loss_like_hardware(true);
    a.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[a.buf.sge(0, 64)] }).unwrap();
    drop(b);
    std::thread::sleep(std::time::Duration::from_millis(100));
    // The receive stays posted (a NIC hears nothing when a remote QP goes away)...
    poll_none(&a.cq);
    assert_eq!(a.qp.state(), QpState::Rts);
    // ...until the QP sends to the vanished peer, and then only once its retries are spent
    // (timeout 10 = 4.2 ms, retry_cnt 2: 12.6 ms), as a NIC's would be.
    let sg = [a.buf.sge(128, 8)];
    let posted = std::time::Instant::now();
    a.qp.post_send(&SendWr::new(2, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
    let mut got = [wait_one(&a.cq), wait_one(&a.cq)];
    assert!(posted.elapsed() >= std::time::Duration::from_millis(12), "failed after {:?}, before the retries", posted.elapsed());
    got.sort_by_key(|w| w.wr_id);
    assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::WrFlushErr));
    assert_eq!((got[1].wr_id, got[1].status), (2, WcStatus::RetryExcErr));
    assert_eq!(a.qp.state(), QpState::Err);
}

each_path!(peer_loss_with_timeout_zero_waits_until_the_qp_leaves_rts);
fn peer_loss_with_timeout_zero_waits_until_the_qp_leaves_rts(mode: Mode) {
    let before_host = engine_cpu_us("engine");
    let h = Host::new(mode, "peerloss0");
    let (sa, sb) = (h.vnic("a", "t"), h.vnic("b", "t"));
    let a = end(&sa, ALL, false);
    let b = end(&sb, ALL, false);
    // Timeout 0 is "retry forever" (IB spec): a's sends to a vanished peer never fail by
    // themselves.
    to_init(&a.qp);
    a.qp.modify(&rtr_attr(b.ctx.gids()[0], b.qp.qp_num()), RTR_MASK).unwrap();
    let rts = QpAttr { qp_state: QpState::Rts as u32, timeout: 0, retry_cnt: 2, rnr_retry: 7, max_rd_atomic: 1, ..Default::default() };
    a.qp.modify(&rts, RTS_MASK).unwrap();
    connect_with(&b, a.ctx.gids()[0], a.qp.qp_num(), 7).unwrap();
    a.ctx.set_peer_loss_like_hardware(true);
    drop(b);
    std::thread::sleep(std::time::Duration::from_millis(100));
    // Two: the second waits in the send queue behind the first, which waits for an answer.
    let sg = [a.buf.sge(0, 8)];
    for id in [1, 2] {
        a.qp.post_send(&SendWr::new(id, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
    }
    let (cpu_before, waited) = (engine_cpu_us("engine"), std::time::Instant::now());
    std::thread::sleep(std::time::Duration::from_millis(400));
    poll_none(&a.cq);
    assert_eq!(a.qp.state(), QpState::Rts);
    // Waiting costs nothing: the engine does not poll a QP that waits without end (at
    // real-time priority it would hold a CPU). Counted over this host's engine threads
    // (started after `before_host`, alive throughout); on the direct path nothing runs
    // meanwhile, and the check bites the mediated variants.
    let after = engine_cpu_us("engine");
    let ours: Vec<&String> = cpu_before.keys().filter(|t| !before_host.contains_key(*t) && after.contains_key(*t)).collect();
    assert!(!ours.is_empty(), "no engine threads found");
    let cpu: u64 = ours.iter().map(|t| after[*t].saturating_sub(cpu_before[*t])).sum();
    let wall = waited.elapsed().as_micros() as u64;
    assert!(cpu * 4 < wall, "engine threads used {cpu} us of CPU in {wall} us of waiting");
    // Moving the QP to ERR flushes the WRs, in order, as on a NIC.
    a.qp.modify(&QpAttr { qp_state: QpState::Err as u32, ..Default::default() }, qp_attr::STATE).unwrap();
    let got = [wait_one(&a.cq), wait_one(&a.cq)].map(|w| (w.wr_id, w.status));
    assert_eq!(got, [(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]);
}
