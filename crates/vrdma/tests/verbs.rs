//! Verbs semantics against an in-process vrdmad, each case on the direct data path and through
//! the mediated engine without and with lanes (`each_path!`).

mod common;
use common::*;
use vrdma::*;

fn recv(e: &End, wr_id: u64, off: usize, len: u32) {
    e.qp.post_recv(&RecvWr { wr_id, sg_list: &[e.buf.sge(off, len)] }).unwrap();
}

each_path!(send_recv_write_read_atomics_with_checked_data);
fn send_recv_write_read_atomics_with_checked_data(mode: Mode) {
    let h = Host::new(mode, "ops");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);

    // SEND / RECV with immediate, scatter over two SGEs.
    b.qp.post_recv(&RecvWr { wr_id: 7, sg_list: &[b.buf.sge(0, 3), b.buf.sge(100, 100)] }).unwrap();
    a.buf.write(0, b"hello world");
    let sg_wr = [a.buf.sge(0, 11)];
    let mut wr = SendWr::new(1, WrOpcode::SendWithImm, &sg_wr, send_flags::SIGNALED | send_flags::SOLICITED);
    wr.imm_data = 0xabcd;
    a.qp.post_send(&wr).unwrap();
    let s = wait_one(&a.cq);
    assert_eq!((s.wr_id, s.status, s.opcode), (1, WcStatus::Success, WcOpcode::Send));
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len, r.imm_data, r.wc_flags & wc_flags::WITH_IMM, r.src_qp),
        (7, WcStatus::Success, WcOpcode::Recv, 11, 0xabcd, wc_flags::WITH_IMM, a.qp.qp_num())
    );
    let mut got = [0u8; 8];
    b.buf.read(100, &mut got);
    let mut head = [0u8; 3];
    b.buf.read(0, &mut head);
    assert_eq!(&head, b"hel");
    assert_eq!(&got, b"lo world");

    // RDMA WRITE of a pattern, then READ it back into another offset.
    let pat: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    a.buf.write(4096, &pat);
    let sg_w = [a.buf.sge(4096, 4096)];
    let mut w = SendWr::new(2, WrOpcode::RdmaWrite, &sg_w, send_flags::SIGNALED);
    w.remote_addr = b.buf.addr() + 8192;
    w.rkey = b.buf.mr().rkey();
    a.qp.post_send(&w).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut out = vec![0u8; 4096];
    b.buf.read(8192, &mut out);
    assert_eq!(out, pat);
    let sg_rd = [a.buf.sge(16384, 4096)];
    let mut rd = SendWr::new(3, WrOpcode::RdmaRead, &sg_rd, send_flags::SIGNALED);
    rd.remote_addr = b.buf.addr() + 8192;
    rd.rkey = b.buf.mr().rkey();
    a.qp.post_send(&rd).unwrap();
    let c = wait_one(&a.cq);
    assert_eq!((c.status, c.opcode, c.byte_len), (WcStatus::Success, WcOpcode::RdmaRead, 4096));
    a.buf.read(16384, &mut out);
    assert_eq!(out, pat);

    // WRITE_WITH_IMM consumes a receive and reports the immediate.
    recv(&b, 8, 0, 0);
    let sg_wi = [a.buf.sge(0, 5)];
    let mut wi = SendWr::new(4, WrOpcode::RdmaWriteWithImm, &sg_wi, 0);
    wi.remote_addr = b.buf.addr() + 30000;
    wi.rkey = b.buf.mr().rkey();
    wi.imm_data = 99;
    a.qp.post_send(&wi).unwrap();
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.opcode, r.imm_data, r.byte_len), (8, WcOpcode::RecvRdmaWithImm, 99, 5));
    poll_none(&a.cq); // unsignaled

    // Atomics: fetch-add then compare-and-swap, results checked on both sides.
    b.buf.write(40000, &5u64.to_ne_bytes());
    let sg_fa = [a.buf.sge(50000, 8)];
    let mut fa = SendWr::new(5, WrOpcode::AtomicFetchAndAdd, &sg_fa, send_flags::SIGNALED);
    fa.remote_addr = b.buf.addr() + 40000;
    fa.rkey = b.buf.mr().rkey();
    fa.compare_add = 10;
    a.qp.post_send(&fa).unwrap();
    assert_eq!(wait_one(&a.cq).opcode, WcOpcode::FetchAdd);
    let mut v = [0u8; 8];
    a.buf.read(50000, &mut v);
    assert_eq!(u64::from_ne_bytes(v), 5);
    let sg_cs = [a.buf.sge(50008, 8)];
    let mut cs = SendWr::new(6, WrOpcode::AtomicCmpAndSwp, &sg_cs, send_flags::SIGNALED);
    cs.remote_addr = b.buf.addr() + 40000;
    cs.rkey = b.buf.mr().rkey();
    cs.compare_add = 15;
    cs.swap = 77;
    a.qp.post_send(&cs).unwrap();
    assert_eq!(wait_one(&a.cq).opcode, WcOpcode::CompSwap);
    a.buf.read(50008, &mut v);
    assert_eq!(u64::from_ne_bytes(v), 15);
    b.buf.read(40000, &mut v);
    assert_eq!(u64::from_ne_bytes(v), 77);

    // Inline send from a stack buffer (no MR).
    recv(&b, 9, 0, 64);
    let stack = *b"inline!";
    let sge = Sge { addr: stack.as_ptr() as u64, length: 7, lkey: 0 };
    a.qp.post_send(&SendWr::new(10, WrOpcode::Send, &[sge], send_flags::INLINE | send_flags::SIGNALED)).unwrap();
    assert_eq!(wait_one(&b.cq).byte_len, 7);
    let mut g = [0u8; 7];
    b.buf.read(0, &mut g);
    assert_eq!(&g, b"inline!");
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
}

each_path!(receive_queue_holds_max_recv_wr_and_recycles_in_order);
fn receive_queue_holds_max_recv_wr_and_recycles_in_order(mode: Mode) {
    // The shared ring has twice max_recv_wr slots (RecvRingLayout::with_headroom); the
    // queue itself must still hold exactly max_recv_wr receives, and keep their order
    // through many wraps of the ring.
    let h = Host::new(mode, "rqcap");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    for i in 0..128 {
        recv(&b, i, (i as usize % 64) * 16, 16);
    }
    let full = b.qp.post_recv(&RecvWr { wr_id: 999, sg_list: &[b.buf.sge(0, 16)] }).unwrap_err();
    assert_eq!(full.errno(), libc::ENOMEM, "{full}");
    let sg = [a.buf.sge(0, 8)];
    for n in 0..1000u64 {
        a.buf.write(0, &n.to_le_bytes());
        a.qp.post_send(&SendWr::new(n, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        let r = wait_one(&b.cq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (n, WcStatus::Success, 8), "receive {n}");
        let mut got = [0u8; 8];
        b.buf.read((n as usize % 64) * 16, &mut got);
        assert_eq!(u64::from_le_bytes(got), n);
        // Reposted at once: the queue stays full, and one more is still refused.
        recv(&b, n + 128, ((n + 128) as usize % 64) * 16, 16);
        if n % 97 == 0 {
            let e = b.qp.post_recv(&RecvWr { wr_id: 999, sg_list: &[b.buf.sge(0, 16)] }).unwrap_err();
            assert_eq!(e.errno(), libc::ENOMEM);
        }
    }
}

each_path!(bad_lkey_is_loc_prot_err_and_flushes);
fn bad_lkey_is_loc_prot_err_and_flushes(mode: Mode) {
    let h = Host::new(mode, "lkey");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    recv(&b, 1, 0, 64);
    let bad = Sge { addr: a.buf.addr(), length: 8, lkey: a.buf.mr().lkey() ^ 0x100 };
    a.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[bad], send_flags::SIGNALED)).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::LocProtErr);
    assert_eq!(a.qp.state(), QpState::Err);
    a.qp.post_send(&SendWr::new(2, WrOpcode::Send, &[a.buf.sge(0, 8)], 0)).unwrap();
    let f = wait_one(&a.cq);
    assert_eq!((f.wr_id, f.status), (2, WcStatus::WrFlushErr));
    // Out of the MR's bounds is the same error.
    let h2 = Host::new(mode, "lkey2");
    let (c, d) = h2.pair(&h2.vnic("c", "t"), &h2.vnic("d", "t"), ALL);
    recv(&d, 1, 0, 64);
    c.qp.post_send(&SendWr::new(3, WrOpcode::Send, &[Sge { addr: c.buf.addr() + BUF as u64 - 4, length: 8, lkey: c.buf.mr().lkey() }], 0))
        .unwrap();
    assert_eq!(wait_one(&c.cq).status, WcStatus::LocProtErr);
}

each_path!(remote_access_errors);
fn remote_access_errors(mode: Mode) {
    let h = Host::new(mode, "rkey");
    let sa = h.vnic("a", "t");
    let sb = h.vnic("b", "t");
    // b grants only REMOTE_READ.
    for (case, flags) in [("bad rkey", 0u8), ("out of bounds", 1), ("no write access", 2), ("no atomic access", 3)] {
        let a = end(&sa, ALL, false);
        let b = end(&sb, access::LOCAL_WRITE | access::REMOTE_READ, false);
        connect_with(&a, b.ctx.gids()[0], b.qp.qp_num(), 7).unwrap();
        connect_with(&b, a.ctx.gids()[0], a.qp.qp_num(), 7).unwrap();
        recv(&a, 50, 0, 8);
        let sg_w = [a.buf.sge(0, 8)];
        let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &sg_w, send_flags::SIGNALED);
        w.remote_addr = b.buf.addr();
        w.rkey = b.buf.mr().rkey();
        match flags {
            0 => {
                w.opcode = WrOpcode::RdmaRead;
                w.rkey ^= 0x1000;
            }
            1 => {
                w.opcode = WrOpcode::RdmaRead;
                w.remote_addr += BUF as u64;
            }
            2 => {}
            _ => {
                w.opcode = WrOpcode::AtomicFetchAndAdd;
            }
        }
        a.qp.post_send(&w).unwrap();
        a.qp.post_send(&SendWr::new(2, WrOpcode::RdmaRead, &[a.buf.sge(8, 8)], 0)).unwrap();
        let c = wait_one(&a.cq);
        assert_eq!(c.status, WcStatus::RemAccessErr, "{case}");
        assert_eq!(a.qp.state(), QpState::Err, "{case}");
        let mut seen = vec![wait_one(&a.cq)];
        seen.push(wait_one(&a.cq));
        seen.sort_by_key(|w| w.wr_id);
        assert_eq!((seen[0].wr_id, seen[0].status), (2, WcStatus::WrFlushErr), "{case}");
        assert_eq!((seen[1].wr_id, seen[1].status), (50, WcStatus::WrFlushErr), "{case}: receives flush too");
    }
}

each_path!(zero_length_rdma_names_no_memory);
fn zero_length_rdma_names_no_memory(mode: Mode) {
    // IB spec C9-88: a zero-length RDMA WRITE or READ checks no R_Key or address (UCX flushes
    // a QP with a zero-length WRITE to rkey 0); WRITE_WITH_IMM still delivers its immediate.
    // A non-zero length with the same rkey is still refused.
    let h = Host::new(mode, "zerolen");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    recv(&b, 70, 0, 8);
    let none: [Sge; 0] = [];
    let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &none, send_flags::SIGNALED);
    a.qp.post_send(&w).unwrap();
    let empty_sge = [a.buf.sge(0, 0)];
    let mut r = SendWr::new(2, WrOpcode::RdmaRead, &empty_sge, send_flags::SIGNALED);
    r.rkey = 0xdead_beef;
    r.remote_addr = 0x10;
    a.qp.post_send(&r).unwrap();
    w.wr_id = 3;
    w.opcode = WrOpcode::RdmaWriteWithImm;
    w.imm_data = 0x5eed;
    a.qp.post_send(&w).unwrap();
    for want in [(1, WcOpcode::RdmaWrite), (2, WcOpcode::RdmaRead), (3, WcOpcode::RdmaWrite)] {
        let c = wait_one(&a.cq);
        assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (want.0, WcStatus::Success, want.1, 0));
    }
    let c = wait_one(&b.cq);
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len, c.imm_data), (70, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 0, 0x5eed));
    assert_ne!(c.wc_flags & wc_flags::WITH_IMM, 0);
    // One byte to rkey 0: REM_ACCESS_ERR, as ever.
    let one = [a.buf.sge(0, 1)];
    a.qp.post_send(&SendWr::new(4, WrOpcode::RdmaWrite, &one, send_flags::SIGNALED)).unwrap();
    let c = wait_one(&a.cq);
    assert_eq!((c.wr_id, c.status), (4, WcStatus::RemAccessErr));
}

each_path!(rnr_retry_exhausted_and_rnr_recovers);
fn rnr_retry_exhausted_and_rnr_recovers(mode: Mode) {
    let h = Host::new(mode, "rnr");
    let sa = h.vnic("a", "t");
    let sb = h.vnic("b", "t");
    let a = end(&sa, ALL, false);
    let b = end(&sb, ALL, false);
    connect_with(&a, b.ctx.gids()[0], b.qp.qp_num(), 2).unwrap();
    connect_with(&b, a.ctx.gids()[0], a.qp.qp_num(), 7).unwrap();
    // No receive posted: retried rnr_retry=2 times, then RNR_RETRY_EXC_ERR.
    a.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[a.buf.sge(0, 8)], send_flags::SIGNALED)).unwrap();
    let c = wait_one(&a.cq);
    assert_eq!(c.status, WcStatus::RnrRetryExcErr);
    assert_eq!(a.qp.state(), QpState::Err);

    // With infinite retries the send waits until the receive is posted, then lands.
    let c2 = end(&sa, ALL, false);
    let d2 = end(&sb, ALL, false);
    connect_with(&c2, d2.ctx.gids()[0], d2.qp.qp_num(), 7).unwrap();
    connect_with(&d2, c2.ctx.gids()[0], c2.qp.qp_num(), 7).unwrap();
    c2.buf.write(0, b"late");
    c2.qp.post_send(&SendWr::new(5, WrOpcode::Send, &[c2.buf.sge(0, 4)], send_flags::SIGNALED)).unwrap();
    poll_none(&c2.cq);
    std::thread::sleep(std::time::Duration::from_millis(20));
    poll_none(&c2.cq);
    recv(&d2, 6, 0, 4);
    assert_eq!(wait_one(&c2.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&d2.cq).wr_id, 6);
}

// A requester whose responder posts no receive for a long time (an RNR storm, Husky's
// antagonist: 10 µs RNR timers, retried for ever) backs off: the wait doubles with each
// repeated RNR NAK of the same request, up to a millisecond, instead of a resend and a NAK
// every 10 µs; the engine resends the refused request alone, not the send queue behind it,
// and sleeps out its waits; once the receives are posted, every SEND lands within that
// millisecond, in order.
each_path!(repeated_rnr_naks_back_off);
fn repeated_rnr_naks_back_off(mode: Mode) {
    const SENDS: u64 = 8;
    let before = engine_cpu_us("engine-doorbell");
    let h = Host::new(mode, "rnrstorm");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    for i in 0..SENDS {
        let off = i as usize * 64;
        a.buf.write(off, &[b'0' + i as u8; 5]);
        a.qp.post_send(&SendWr::new(i, WrOpcode::Send, &[a.buf.sge(off, 5)], send_flags::SIGNALED)).unwrap();
    }
    // Polled all the while, as a busy application would (the direct path retries on polls).
    let storm = std::time::Duration::from_millis(300);
    let cpu_before = engine_cpu_us("engine-doorbell");
    let start = std::time::Instant::now();
    while start.elapsed() < storm {
        poll_none(&a.cq);
        std::thread::yield_now();
    }
    // The engine sleeps out its waits: a real-time thread polling until each was due held
    // its CPU from the applications there for the whole storm.
    let after = engine_cpu_us("engine-doorbell");
    let ours = cpu_before.keys().filter(|t| !before.contains_key(*t) && after.contains_key(*t));
    let busy = std::time::Duration::from_micros(ours.map(|t| after[t].saturating_sub(cpu_before[t])).sum());
    assert!(busy < storm / 3, "the engine's doorbell thread ran {busy:?} of the {storm:?} storm");
    let req = serde_json::json!({"op": "stats", "name": "a"});
    let s = vrdmad::admin_client::call(&h.daemon.run_dir().join("admin.sock"), &req, None).unwrap();
    let naks = s["vnics"][0]["total"]["rnr_naks"].as_u64().expect("rnr_naks");
    let resent = s["vnics"][0]["total"]["retransmissions"].as_u64().expect("retransmissions");
    // At the 10 µs timer alone that is thousands; backing off, 300 ms take about 300 + 7.
    assert!((10..=600).contains(&naks), "{naks} RNR NAKs in {storm:?}");
    // One resend per NAK once the refused request goes alone; the whole queue only at the
    // first (the direct path has no wire and resends nothing).
    assert!(resent <= naks + 4 * SENDS, "{resent} requests resent for {naks} RNR NAKs");
    for i in 0..SENDS {
        recv(&b, 100 + i, i as usize * 64, 5);
    }
    let posted = std::time::Instant::now();
    for i in 0..SENDS {
        let c = wait_one(&a.cq);
        assert_eq!((c.wr_id, c.status), (i, WcStatus::Success));
    }
    let late = posted.elapsed();
    for i in 0..SENDS {
        let c = wait_one(&b.cq);
        assert_eq!((c.wr_id, c.status, c.byte_len), (100 + i, WcStatus::Success, 5));
        let mut got = [0u8; 5];
        b.buf.read(i as usize * 64, &mut got);
        assert_eq!(got, [b'0' + i as u8; 5]);
    }
    assert!(late < std::time::Duration::from_millis(100), "the SENDs landed {late:?} after the receives were posted");
}

each_path!(receive_too_small_is_loc_len_err_on_responder);
fn receive_too_small_is_loc_len_err_on_responder(mode: Mode) {
    let h = Host::new(mode, "len");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    recv(&b, 1, 0, 4);
    a.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[a.buf.sge(0, 8)], send_flags::SIGNALED)).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemInvReqErr);
    assert_eq!(wait_one(&b.cq).status, WcStatus::LocLenErr);
    assert_eq!(b.qp.state(), QpState::Err);
}

each_path!(state_machine_errors_are_einval);
fn state_machine_errors_are_einval(mode: Mode) {
    let h = Host::new(mode, "sm");
    let e = end(&h.vnic("a", "t"), ALL, false);
    // RESET -> RTR skips INIT.
    let err = e.qp.modify(&rtr_attr(e.ctx.gids()[0], e.qp.qp_num()), RTR_MASK).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL);
    // Missing required attributes.
    let a = QpAttr { qp_state: QpState::Init as u32, port_num: 1, ..Default::default() };
    assert_eq!(e.qp.modify(&a, qp_attr::STATE | qp_attr::PORT).unwrap_err().errno(), libc::EINVAL);
    // Bad port.
    let a = QpAttr { qp_state: QpState::Init as u32, port_num: 2, ..Default::default() };
    assert_eq!(
        e.qp.modify(&a, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS).unwrap_err().errno(),
        libc::EINVAL
    );
    // Posting sends before RTS.
    to_init(&e.qp);
    assert_eq!(e.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[], 0)).unwrap_err().errno(), libc::EINVAL);
    // Too many SGEs.
    assert_eq!(e.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[e.buf.sge(0, 1); 5] }).unwrap_err().errno(), libc::EINVAL);
}

each_path!(tenants_are_isolated_and_unknown_gids_refused);
fn tenants_are_isolated_and_unknown_gids_refused(mode: Mode) {
    let h = Host::new(mode, "tenant");
    let a = end(&h.vnic("a", "red"), ALL, false);
    let b = end(&h.vnic("b", "blue"), ALL, false);
    to_init(&a.qp);
    let err = a.qp.modify(&rtr_attr(b.ctx.gids()[0], b.qp.qp_num()), RTR_MASK).unwrap_err();
    assert_eq!(err.errno(), libc::ECONNREFUSED, "{err}");
    assert_eq!(a.qp.state(), QpState::Init);
    let err = a.qp.modify(&rtr_attr([9; 16], 5), RTR_MASK).unwrap_err();
    assert_eq!(err.errno(), libc::EHOSTUNREACH, "{err}");
    let st: Vec<(String, u64)> = h.daemon.status().into_iter().map(|s| (s.record.name, s.counters.refused_connections)).collect();
    assert!(st.iter().all(|(_, refused)| *refused >= 1), "{st:?}");
}

each_path!(completion_channel_wakes_sleeper_and_solicited_only);
fn completion_channel_wakes_sleeper_and_solicited_only(mode: Mode) {
    let h = Host::new(mode, "chan");
    let sa = h.vnic("a", "t");
    let sb = h.vnic("b", "t");
    let a = end(&sa, ALL, false);
    let ctx = Context::open(&sb).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let qp = pd
        .create_qp(&QpInitAttr::rc(
            &cq,
            &cq,
            QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
        ))
        .unwrap();
    let buf = MrBuf::new(&pd, 4096, ALL).unwrap();
    connect_with(&a, ctx.gids()[0], qp.qp_num(), 7).unwrap();
    to_init(&qp);
    qp.modify(&rtr_attr(a.ctx.gids()[0], a.qp.qp_num()), RTR_MASK).unwrap();
    for i in 0..3 {
        qp.post_recv(&RecvWr { wr_id: i, sg_list: &[buf.sge(0, 64)] }).unwrap();
    }
    cq.req_notify(true).unwrap();
    // Not solicited: no event.
    a.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[a.buf.sge(0, 8)], 0)).unwrap();
    assert!(ch.get_cq_event(Some(std::time::Duration::from_millis(50))).unwrap().is_none());
    // Solicited, from another thread while we sleep.
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        a.qp.post_send(&SendWr::new(2, WrOpcode::Send, &[a.buf.sge(0, 8)], send_flags::SOLICITED)).unwrap();
        a
    });
    let got = ch.get_cq_event(Some(std::time::Duration::from_secs(5))).unwrap().expect("event");
    assert!(got.ptr_eq(&cq));
    cq.ack_events(1);
    assert_eq!(wait_one(&cq).wr_id, 0);
    assert_eq!(wait_one(&cq).wr_id, 1);
    let _a = t.join().unwrap();
}

each_path!(srq_shared_by_two_qps);
fn srq_shared_by_two_qps(mode: Mode) {
    let h = Host::new(mode, "srq");
    let sa = h.vnic("a", "t");
    let sb = h.vnic("b", "t");
    let ctx = Context::open(&sb).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let buf = MrBuf::new(&pd, 4096, ALL).unwrap();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 0, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let mut init = QpInitAttr::rc(&cq, &cq, caps);
    init.srq = Some(&srq);
    let q1 = pd.create_qp(&init).unwrap();
    let q2 = pd.create_qp(&init).unwrap();
    let s1 = end(&sa, ALL, false);
    let s2 = end(&sa, ALL, false);
    for (s, q) in [(&s1, &q1), (&s2, &q2)] {
        connect_with(s, ctx.gids()[0], q.qp_num(), 7).unwrap();
        to_init(q);
        q.modify(&rtr_attr(s.ctx.gids()[0], s.qp.qp_num()), RTR_MASK).unwrap();
    }
    for i in 0..4 {
        srq.post_recv(&RecvWr { wr_id: 100 + i, sg_list: &[buf.sge(i as usize * 64, 64)] }).unwrap();
    }
    s1.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s1.buf.sge(0, 8)], 0)).unwrap();
    s2.qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s2.buf.sge(0, 8)], 0)).unwrap();
    let (w1, w2) = (wait_one(&cq), wait_one(&cq));
    let mut ids = [w1.wr_id, w2.wr_id];
    ids.sort();
    assert_eq!(ids, [100, 101]);
    let mut qps = [w1.qp_num, w2.qp_num];
    qps.sort();
    let mut want = [q1.qp_num(), q2.qp_num()];
    want.sort();
    assert_eq!(qps, want);

    // The SRQ holds exactly its 16 receives (its ring has twice the slots), and keeps them
    // in order, with their data, through many wraps of the ring, from both QPs.
    for i in 4..18 {
        srq.post_recv(&RecvWr { wr_id: 100 + i, sg_list: &[buf.sge((i % 32) as usize * 64, 64)] }).unwrap();
    }
    let full = srq.post_recv(&RecvWr { wr_id: 999, sg_list: &[buf.sge(0, 64)] }).unwrap_err();
    assert_eq!(full.errno(), libc::ENOMEM, "{full}");
    for n in 2..500u64 {
        let s = if n % 2 == 0 { &s1 } else { &s2 };
        // (The sender reaps its send completions, as on a NIC, where a send queue's slots
        // come back only through its CQ: through the engine an ACK may lag the receive.)
        let mut sent = [Wc::EMPTY; 4];
        while s.cq.poll(&mut sent) > 0 {}
        s.buf.write(0, &n.to_le_bytes());
        s.qp.post_send(&SendWr::new(n, WrOpcode::Send, &[s.buf.sge(0, 8)], 0)).unwrap();
        let r = wait_one(&cq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (100 + n, WcStatus::Success, 8), "receive {n}");
        let mut got = [0u8; 8];
        buf.read((n % 32) as usize * 64, &mut got);
        assert_eq!(u64::from_le_bytes(got), n);
        srq.post_recv(&RecvWr { wr_id: 100 + n + 16, sg_list: &[buf.sge(((n + 16) % 32) as usize * 64, 64)] }).unwrap();
        if n % 61 == 0 {
            assert_eq!(srq.post_recv(&RecvWr { wr_id: 999, sg_list: &[buf.sge(0, 64)] }).unwrap_err().errno(), libc::ENOMEM);
        }
    }
}

each_path!(srq_limit_event_fires_once_below_the_armed_limit);
fn srq_limit_event_fires_once_below_the_armed_limit(mode: Mode) {
    let h = Host::new(mode, "srqlimit");
    let (sa, sb) = (h.vnic("a", "t"), h.vnic("b", "t"));
    let ctx = Context::open(&sb).unwrap();
    let events = AsyncEvents::new().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let buf = MrBuf::new(&pd, 4096, ALL).unwrap();
    let (s, _q) = srq_qp_facing(&sa, &ctx, &pd, &cq, &srq, 1);
    assert_eq!(srq.arm_limit(17, &events).unwrap_err().errno(), libc::EINVAL);
    srq.arm_limit(3, &events).unwrap();
    assert_eq!(srq.limit(), 3);
    for i in 0..6 {
        srq.post_recv(&RecvWr { wr_id: i, sg_list: &[buf.sge(i as usize * 64, 64)] }).unwrap();
    }
    let expect_event = |want: bool| {
        // The event is raised by the poll that took the completion, before it returns.
        let got = events.pending();
        assert_eq!(got, usize::from(want), "events pending");
        if want {
            let e = events.next().unwrap();
            assert_eq!((e.kind, e.qpn), (AsyncEventKind::SrqLimitReached, srq.handle()));
        }
    };
    for n in 0..6u64 {
        s.qp.post_send(&SendWr::new(n, WrOpcode::Send, &[s.buf.sge(0, 8)], 0)).unwrap();
        let r = wait_one(&cq);
        assert_eq!((r.wr_id, r.status), (n, WcStatus::Success));
        // 6 posted: 5, 4, 3 outstanding stay at or above the limit of 3; 2 is below it
        // (one event, the limit disarmed); 1 raises nothing more. Armed again (2) while
        // 1 is outstanding, the next receive taken (0 left) raises it once more.
        match n {
            3 | 5 => {
                expect_event(true);
                assert_eq!(srq.limit(), 0, "disarmed after its event");
            }
            _ => expect_event(false),
        }
        if n == 4 {
            srq.arm_limit(2, &events).unwrap();
        }
    }
}

each_path!(limits_are_enforced);
fn limits_are_enforced(mode: Mode) {
    let h = Host::new(mode, "limits");
    let l = Limits { max_pd: 1, max_cq: 1, max_qp: 1, max_mr: 1, max_mr_bytes: 8192, max_srq: 0, ..Limits::default() };
    let ctx = Context::open(&h.vnic_limits("a", "t", l)).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(ctx.alloc_pd().err().unwrap().errno(), libc::ENOMEM);
    let cq = ctx.create_cq(4, None).unwrap();
    assert_eq!(ctx.create_cq(4, None).err().unwrap().errno(), libc::ENOMEM);
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let _qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).unwrap();
    assert_eq!(pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).err().unwrap().errno(), libc::ENOMEM);
    assert_eq!(MrBuf::new(&pd, 16384, 0).err().unwrap().errno(), libc::EDQUOT);
    let _m = MrBuf::new(&pd, 4096, 0).unwrap();
    assert_eq!(MrBuf::new(&pd, 4096, 0).err().unwrap().errno(), libc::ENOMEM);
    assert_eq!(pd.create_srq(4, 1).err().unwrap().errno(), libc::ENOMEM);
}

each_path!(reg_mr_on_heap_stack_and_overlaps_is_zero_copy);
fn reg_mr_on_heap_stack_and_overlaps_is_zero_copy(mode: Mode) {
    let h = Host::new(mode, "regmr");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    // Ordinary heap memory with content registered after being written.
    let mut heap = vec![0u8; 100_000];
    for (i, x) in heap.iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    // SAFETY: `heap` outlives both MRs (dropped at the end of the test).
    let m1 = unsafe { b.pd.reg_mr(heap.as_mut_ptr(), heap.len(), ALL) }.unwrap();
    // SAFETY: as above; overlaps m1.
    let m2 = unsafe { b.pd.reg_mr(heap.as_mut_ptr().add(5000), 1000, ALL) }.unwrap();
    assert!(heap.iter().enumerate().all(|(i, x)| *x == (i % 251) as u8), "content survives registration");
    // The peer writes through m2; the application sees it in its own vector.
    a.buf.write(0, b"ZEROCOPY");
    let sg_w = [a.buf.sge(0, 8)];
    let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &sg_w, send_flags::SIGNALED);
    w.remote_addr = heap.as_ptr() as u64 + 5500;
    w.rkey = m2.rkey();
    a.qp.post_send(&w).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(&heap[5500..5508], b"ZEROCOPY");
    // And reads through m1 see the application's later writes.
    heap[90_000] = 0xee;
    let sg_r = [a.buf.sge(100, 1)];
    let mut r = SendWr::new(2, WrOpcode::RdmaRead, &sg_r, send_flags::SIGNALED);
    r.remote_addr = heap.as_ptr() as u64 + 90_000;
    r.rkey = m1.rkey();
    a.qp.post_send(&r).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut one = [0u8; 1];
    a.buf.read(100, &mut one);
    assert_eq!(one[0], 0xee);
    // Deregistered keys stop working.
    let rk = m2.rkey();
    drop(m2);
    let sg_w2 = [a.buf.sge(0, 8)];
    let mut w2 = SendWr::new(3, WrOpcode::RdmaWrite, &sg_w2, send_flags::SIGNALED);
    w2.remote_addr = heap.as_ptr() as u64 + 5500;
    w2.rkey = rk;
    a.qp.post_send(&w2).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemAccessErr);
    drop(m1);
    // Stack memory registers too.
    let mut stack = [1u8; 3000];
    // SAFETY: `stack` outlives the MR.
    let ms = unsafe { b.pd.reg_mr(stack.as_mut_ptr(), stack.len(), access::LOCAL_WRITE) }.unwrap();
    assert!(stack.iter().all(|x| *x == 1));
    stack[0] = 2;
    drop(ms);
    assert_eq!(stack[0], 2);
}

each_path!(large_registration_keeps_every_byte_and_is_reachable_across_its_copy_steps);
fn large_registration_keeps_every_byte_and_is_reachable_across_its_copy_steps(mode: Mode) {
    let h = Host::new(mode, "bigmr");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    // Large enough to be split into two segments copied in parallel, each moved in several
    // steps, with an odd tail; some pages never touched (non-resident, must read as zero).
    let len = (70 << 20) + 3 * 4096 + 100;
    let mut big = vec![0u8; len];
    let hole = (20 << 20)..(26 << 20) + 123;
    let pattern = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 1;
    for (i, x) in big.iter_mut().enumerate() {
        if !hole.contains(&i) {
            *x = pattern(i);
        }
    }
    // SAFETY: `big` outlives the MR (dropped before it).
    let mr = unsafe { b.pd.reg_mr(big.as_mut_ptr(), len, ALL) }.unwrap();
    for (i, x) in big.iter().enumerate() {
        let want = if hole.contains(&i) { 0 } else { pattern(i) };
        assert_eq!(*x, want, "byte {i} changed by registration");
    }
    // The peer writes across step and segment boundaries and reads them back.
    for (n, at) in [(4 << 20) - 4, (35 << 20) - 4, (36 << 20) - 2, len - 8, 21 << 20].into_iter().enumerate() {
        let tag = [b'A' + n as u8; 8];
        a.buf.write(0, &tag);
        let sg_w = [a.buf.sge(0, 8)];
        let mut w = SendWr::new(10 + n as u64, WrOpcode::RdmaWrite, &sg_w, send_flags::SIGNALED);
        w.remote_addr = big.as_ptr() as u64 + at as u64;
        w.rkey = mr.rkey();
        a.qp.post_send(&w).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        assert_eq!(&big[at..at + 8], &tag, "write at {at}");
        big[at] ^= 0xff;
        let sg_r = [a.buf.sge(64, 8)];
        let mut r = SendWr::new(20 + n as u64, WrOpcode::RdmaRead, &sg_r, send_flags::SIGNALED);
        r.remote_addr = big.as_ptr() as u64 + at as u64;
        r.rkey = mr.rkey();
        a.qp.post_send(&r).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        let mut got = [0u8; 8];
        a.buf.read(64, &mut got);
        assert_eq!(got, big[at..at + 8], "read at {at}");
    }
    drop(mr);
}

/// Memory that cannot be moved onto a memfd, for the copying fallback.
struct OddMemory {
    ptr: *mut u8,
    len: usize,
    file: Option<std::path::PathBuf>,
    restore_hugepages: Option<String>,
}

impl OddMemory {
    fn file(shared: bool, len: usize, tag: &str) -> OddMemory {
        use std::os::fd::AsRawFd;
        // A file of its own: the variants of a case run side by side in one process.
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vrdma-odd-{tag}-{}-{n}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(len as u64).unwrap();
        let flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
        // SAFETY: a fresh mapping of our own file.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, f.as_raw_fd(), 0) };
        assert_ne!(p, libc::MAP_FAILED);
        OddMemory { ptr: p as *mut u8, len, file: Some(path), restore_hugepages: None }
    }

    /// 2 MiB of hugetlb memory, reserving huge pages if there are none (root); the reason
    /// where the kernel has no hugetlb support or refuses.
    fn hugetlb() -> Result<OddMemory, String> {
        let len = 2 << 20;
        let try_map = || {
            // SAFETY: a fresh anonymous hugetlb mapping.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                    -1,
                    0,
                )
            };
            (p != libc::MAP_FAILED).then_some(p as *mut u8)
        };
        let mut restore = None;
        let ptr = match try_map() {
            Some(p) => p,
            None => {
                let knob = "/proc/sys/vm/nr_hugepages";
                let Ok(before) = std::fs::read_to_string(knob) else {
                    return Err(format!("this kernel has no hugetlb support ({knob} is missing)"));
                };
                let n: u64 = before.trim().parse().unwrap_or(0);
                if std::fs::write(knob, format!("{}", n + 2)).is_err() {
                    return Err(format!("no free huge pages and {knob} is not writable (not root)"));
                }
                restore = Some(before);
                match try_map() {
                    Some(p) => p,
                    None => {
                        let _ = std::fs::write(knob, restore.as_deref().unwrap_or("0"));
                        return Err("the kernel could not reserve 2 huge pages".into());
                    }
                }
            }
        };
        Ok(OddMemory { ptr, len, file: None, restore_hugepages: restore })
    }

    fn read(&self, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= self.len);
        let mut v = vec![0u8; n];
        // SAFETY: in bounds of our mapping; peers wrote it before the completion we waited for.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), n) };
        v
    }

    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for OddMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer registered.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        if let Some(p) = &self.file {
            let _ = std::fs::remove_file(p);
        }
        if let Some(n) = &self.restore_hugepages {
            let _ = std::fs::write("/proc/sys/vm/nr_hugepages", n);
        }
    }
}

/// Every operation against, and from, an MR that takes the copying fallback, data checked.
fn copied_mr_case(mode: Mode, tag: &str, mem: &OddMemory) {
    let h = Host::new(mode, &format!("copied-{tag}"));
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let len = 256 * 1024;
    mem.write(0, &vec![0x5a; len + 16]);
    // An unaligned start, as applications register.
    // SAFETY: `mem` outlives the MR (dropped at the end of this function).
    let mr = unsafe { b.pd.reg_mr(mem.ptr.add(3), len, ALL) }.unwrap();
    let base = mem.ptr as u64 + 3;
    let pat = |n: usize, k: u32| -> Vec<u8> { (0..n as u32).map(|i| (i.wrapping_mul(k) >> 3) as u8).collect() };

    // RDMA WRITE into it (more than one copy step), edges untouched.
    let w_data = pat(60_000, 2654435761);
    a.buf.write(0, &w_data);
    let sg = [a.buf.sge(0, 60_000)];
    let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
    w.remote_addr = base + 10;
    w.rkey = mr.rkey();
    a.qp.post_send(&w).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success, "{tag}: write");
    assert_eq!(mem.read(13, 60_000), w_data, "{tag}: written bytes");
    assert_eq!(mem.read(12, 1), [0x5a], "{tag}: byte before");
    assert_eq!(mem.read(13 + 60_000, 1), [0x5a], "{tag}: byte after");
    if let Some(path) = &mem.file {
        if tag == "shared-file" {
            // The application's memory is still its file: the bytes are in the file.
            let f = std::fs::read(path).unwrap();
            assert_eq!(&f[13..13 + 60_000], &w_data[..], "{tag}: the file holds the written bytes");
        }
    }

    // RDMA READ of what the application wrote itself.
    let r_data = pat(40_000, 40503);
    mem.write(3 + 70_000, &r_data);
    let sg = [a.buf.sge(0, 40_000)];
    let mut r = SendWr::new(2, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    r.remote_addr = base + 70_000;
    r.rkey = mr.rkey();
    a.qp.post_send(&r).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success, "{tag}: read");
    let mut got = vec![0u8; 40_000];
    a.buf.read(0, &mut got);
    assert_eq!(got, r_data, "{tag}: read bytes");

    // Atomics.
    let at = (base + 120_000).next_multiple_of(8);
    let at_off = (at - mem.ptr as u64) as usize;
    mem.write(at_off, &5u64.to_ne_bytes());
    let sg = [a.buf.sge(50_000, 8)];
    let mut fa = SendWr::new(3, WrOpcode::AtomicFetchAndAdd, &sg, send_flags::SIGNALED);
    fa.remote_addr = at;
    fa.rkey = mr.rkey();
    fa.compare_add = 10;
    a.qp.post_send(&fa).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success, "{tag}: fetch-add");
    let mut v = [0u8; 8];
    a.buf.read(50_000, &mut v);
    assert_eq!(u64::from_ne_bytes(v), 5, "{tag}: fetch-add original");
    let mut cs = SendWr::new(4, WrOpcode::AtomicCmpAndSwp, &sg, send_flags::SIGNALED);
    cs.remote_addr = at;
    cs.rkey = mr.rkey();
    cs.compare_add = 15;
    cs.swap = 77;
    a.qp.post_send(&cs).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success, "{tag}: cmp-swap");
    a.buf.read(50_000, &mut v);
    assert_eq!(u64::from_ne_bytes(v), 15, "{tag}: cmp-swap original");
    assert_eq!(mem.read(at_off, 8), 77u64.to_ne_bytes(), "{tag}: cmp-swap result");

    // SEND scattered over an ordinary MR and the copied one; the rest of the receive buffer
    // is untouched.
    let msg = pat(50, 7);
    b.qp.post_recv(&RecvWr { wr_id: 9, sg_list: &[b.buf.sge(0, 4), Sge { addr: base + 150_000, length: 100, lkey: mr.lkey() }] }).unwrap();
    a.buf.write(1000, &msg);
    a.qp.post_send(&SendWr::new(5, WrOpcode::Send, &[a.buf.sge(1000, 50)], send_flags::SIGNALED)).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success, "{tag}: send");
    let rc = wait_one(&b.cq);
    assert_eq!((rc.wr_id, rc.status, rc.byte_len), (9, WcStatus::Success, 50), "{tag}: receive");
    let mut head = [0u8; 4];
    b.buf.read(0, &mut head);
    assert_eq!(&head, &msg[..4]);
    assert_eq!(mem.read(3 + 150_000, 46), &msg[4..], "{tag}: received bytes");
    assert_eq!(mem.read(3 + 150_046, 54), vec![0x5a; 54], "{tag}: rest of the receive buffer");

    // The copied MR as the local side of b's own WRITE and READ.
    let sg = [Sge { addr: base + 70_000, length: 1000, lkey: mr.lkey() }];
    let mut bw = SendWr::new(6, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
    bw.remote_addr = a.buf.addr() + 2000;
    bw.rkey = a.buf.mr().rkey();
    b.qp.post_send(&bw).unwrap();
    assert_eq!(wait_one(&b.cq).status, WcStatus::Success, "{tag}: write from it");
    let mut got = vec![0u8; 1000];
    a.buf.read(2000, &mut got);
    assert_eq!(got, &r_data[..1000]);
    let sg = [Sge { addr: base + 200_000, length: 1000, lkey: mr.lkey() }];
    let mut br = SendWr::new(7, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    br.remote_addr = a.buf.addr();
    br.rkey = a.buf.mr().rkey();
    b.qp.post_send(&br).unwrap();
    assert_eq!(wait_one(&b.cq).status, WcStatus::Success, "{tag}: read into it");
    assert_eq!(mem.read(3 + 200_000, 1000), &r_data[..1000]);

    // Out of its bounds is REM_ACCESS_ERR, as for any MR.
    let sg = [a.buf.sge(0, 8)];
    let mut oob = SendWr::new(8, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
    oob.remote_addr = base + len as u64 - 4;
    oob.rkey = mr.rkey();
    a.qp.post_send(&oob).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemAccessErr, "{tag}: out of bounds");
    assert_eq!(mem.read(3 + len - 4, 4), vec![0x5a; 4]);
    drop(mr);
}

each_path!(file_backed_and_hugetlb_memory_register_through_the_copying_fallback);
fn file_backed_and_hugetlb_memory_register_through_the_copying_fallback(mode: Mode) {
    let len = 512 * 1024;
    copied_mr_case(mode, "shared-file", &OddMemory::file(true, len, "shared"));
    copied_mr_case(mode, "private-file", &OddMemory::file(false, len, "private"));
    {
        // One variant at a time reserves huge pages and gives them back.
        static HUGE_PAGES: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = HUGE_PAGES.lock().unwrap_or_else(|e| e.into_inner());
        match OddMemory::hugetlb() {
            Ok(m) => copied_mr_case(mode, "hugetlb", &m),
            Err(why) => vrdma_test_support::skip(
                &format!("file_backed_and_hugetlb_memory_register_through_the_copying_fallback::{mode:?} (hugetlb half)"),
                why,
            ),
        }
    }
    // Writable access to read-only memory is refused as the kernel refuses pinning it.
    let h = Host::new(mode, "copied-ro");
    let e = end(&h.vnic("a", "t"), ALL, false);
    let ro = OddMemory::file(false, 8192, "ro");
    // SAFETY: our own mapping.
    assert_eq!(unsafe { libc::mprotect(ro.ptr as *mut libc::c_void, 8192, libc::PROT_READ) }, 0);
    // SAFETY: `ro` outlives the MRs.
    assert_eq!(unsafe { e.pd.reg_mr(ro.ptr, 8192, ALL) }.err().unwrap().errno(), libc::EFAULT);
    // SAFETY: as above.
    let m = unsafe { e.pd.reg_mr(ro.ptr, 8192, access::REMOTE_READ) }.unwrap();
    drop(m);
}

each_path!(lane_and_engine_sends_mix_in_order_with_checked_data);
/// Mediated QPs with a lane send small WRs from the library and leave large ones (and
/// everything after a retry wait) to the engine: bursts that mix both arrive whole and in
/// order, READs and atomics through the lane return the right data, and after an RNR
/// wait the library sends on its lane again.
fn lane_and_engine_sends_mix_in_order_with_checked_data(mode: Mode) {
    // Lanes on in both mediated variants (without them there is nothing to test here).
    let h = Host::new(mode.with_lanes(), "lane");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let mediated = a.qp.is_mediated();
    let pattern = |msg: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (msg * 31 + i * 7) as u8).collect() };
    const SLOT: usize = 6144;
    const BURST: usize = 8;
    for round in 0..24 {
        for k in 0..BURST {
            recv(&b, (round * BURST + k) as u64, k * SLOT, SLOT as u32);
        }
        let mut sent = Vec::new();
        for k in 0..BURST {
            let msg = round * BURST + k;
            // Every third message is larger than the lane takes (the engine sends it); the
            // others small, half of them inline.
            let len = if msg.is_multiple_of(3) { 5000 } else { 1 + (msg * 37) % 200 };
            let data = pattern(msg, len);
            a.buf.write(k * SLOT, &data);
            let sg = [a.buf.sge(k * SLOT, len as u32)];
            let mut flags = if k == BURST - 1 { send_flags::SIGNALED } else { 0 };
            if msg % 2 == 1 && len <= 200 {
                flags |= send_flags::INLINE;
            }
            a.qp.post_send(&SendWr::new(msg as u64, WrOpcode::Send, &sg, flags)).unwrap();
            sent.push(data);
        }
        let s = wait_one(&a.cq);
        assert_eq!((s.wr_id, s.status), (((round + 1) * BURST - 1) as u64, WcStatus::Success));
        for (k, data) in sent.iter().enumerate() {
            let r = wait_one(&b.cq);
            assert_eq!((r.wr_id, r.status, r.byte_len as usize), ((round * BURST + k) as u64, WcStatus::Success, data.len()));
            let mut got = vec![0u8; data.len()];
            b.buf.read(k * SLOT, &mut got);
            assert_eq!(&got, data, "message {}", round * BURST + k);
        }
    }

    // READ and fetch-and-add through the lane (small requests; the data comes back).
    let remote = pattern(999, 512);
    b.buf.write(60000, &remote);
    let sg_rd = [a.buf.sge(50000, 512)];
    let mut rd = SendWr::new(500, WrOpcode::RdmaRead, &sg_rd, send_flags::SIGNALED);
    rd.remote_addr = b.buf.addr() + 60000;
    rd.rkey = b.buf.mr().rkey();
    a.qp.post_send(&rd).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut got = vec![0u8; 512];
    a.buf.read(50000, &mut got);
    assert_eq!(got, remote);
    b.buf.write(64000, &41u64.to_ne_bytes());
    let sg_fa = [a.buf.sge(49000, 8)];
    let mut fa = SendWr::new(501, WrOpcode::AtomicFetchAndAdd, &sg_fa, send_flags::SIGNALED);
    fa.remote_addr = b.buf.addr() + 64000;
    fa.rkey = b.buf.mr().rkey();
    fa.compare_add = 1;
    a.qp.post_send(&fa).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut old = [0u8; 8];
    a.buf.read(49000, &mut old);
    assert_eq!(u64::from_ne_bytes(old), 41);
    let mut now = [0u8; 8];
    b.buf.read(64000, &mut now);
    assert_eq!(u64::from_ne_bytes(now), 42);

    // No receive posted: RNR waits are the engine's; once the receive is there the send
    // lands, and the next sends go on the lane again.
    a.buf.write(0, b"rnr!");
    a.qp.post_send(&SendWr::new(600, WrOpcode::Send, &[a.buf.sge(0, 4)], send_flags::SIGNALED)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    poll_none(&a.cq);
    recv(&b, 601, 0, 64);
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&b.cq).wr_id, 601);
    let before = a.qp.lane_sends();
    for i in 0..50u64 {
        recv(&b, 700 + i, 0, 64);
        a.qp.post_send(&SendWr::new(700 + i, WrOpcode::Send, &[a.buf.sge(0, 4)], send_flags::SIGNALED)).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        assert_eq!(wait_one(&b.cq).wr_id, 700 + i);
    }
    if mediated {
        assert!(before > 0, "no WR went on the lane");
        assert!(a.qp.lane_sends() - before >= 25, "after the RNR wait only {} of 50 sends went on the lane", a.qp.lane_sends() - before);
    } else {
        assert_eq!(a.qp.lane_sends(), 0);
    }
}

each_path!(large_sends_and_writes_arrive_whole);
/// SENDs and WRITEs far larger than a segment (without a lane the engine sends them in parts
/// of 256 KiB, `wire::SEGMENT`, on the connection every QP to that host shares) arrive whole
/// and in place: a SEND across two scatter elements whose boundary falls inside a part, a
/// WRITE_WITH_IMM that completes its receive with its whole length, and WRITEs larger than
/// the bytes the host keeps on the wire unacknowledged (1 MiB), back to back.
fn large_sends_and_writes_arrive_whole(mode: Mode) {
    const LEN: usize = (1 << 20) + 12345;
    const FIRST: usize = 300_000;
    const BIG: usize = (5 << 20) + 7;
    let h = Host::new(mode, "bigsend");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let src = MrBuf::new(&a.pd, 12 << 20, ALL).unwrap();
    let dst = MrBuf::new(&b.pd, 12 << 20, ALL).unwrap();
    let pat: Vec<u8> = (0..BIG).map(|i| (i * 13 % 251) as u8).collect();
    src.write(0, &pat);

    let rsg = [dst.sge(0, FIRST as u32), dst.sge(FIRST + 4096, (LEN - FIRST) as u32)];
    b.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &rsg }).unwrap();
    let sg = [src.sge(0, LEN as u32)];
    a.qp.post_send(&SendWr::new(2, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status, r.byte_len), (1, WcStatus::Success, LEN as u32));
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    let mut out = vec![0u8; FIRST];
    dst.read(0, &mut out);
    assert!(out == pat[..FIRST], "the SEND's first element");
    let mut out = vec![0u8; LEN - FIRST];
    dst.read(FIRST + 4096, &mut out);
    assert!(out == pat[FIRST..LEN], "the SEND's second element");

    b.qp.post_recv(&RecvWr { wr_id: 3, sg_list: &[] }).unwrap();
    let sg = [src.sge(0, BIG as u32)];
    for (i, at) in [(4u64, 2 << 20), (5, 0), (6, 6 << 20)] {
        let op = if i == 6 { WrOpcode::RdmaWriteWithImm } else { WrOpcode::RdmaWrite };
        let mut w = SendWr::new(i, op, &sg, send_flags::SIGNALED);
        w.remote_addr = dst.addr() + at as u64;
        w.rkey = dst.mr().rkey();
        w.imm_data = 42;
        a.qp.post_send(&w).unwrap();
    }
    for i in [4, 5, 6] {
        let c = wait_one(&a.cq);
        assert_eq!((c.wr_id, c.status, c.byte_len), (i, WcStatus::Success, BIG as u32));
    }
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.opcode, r.imm_data, r.byte_len), (3, WcOpcode::RecvRdmaWithImm, 42, BIG as u32));
    for at in [0, 6 << 20] {
        let mut out = vec![0u8; BIG];
        dst.read(at, &mut out);
        assert!(out == pat, "the WRITE at {at}");
    }
}

each_path!(a_large_read_arrives_whole_across_its_scatter_list);
/// A READ larger than a READ response's part (the engine sends its data in parts of 256 KiB,
/// `wire::SEGMENT`), into two scatter elements whose boundary falls inside a part,
/// arrives whole and in place.
fn a_large_read_arrives_whole_across_its_scatter_list(mode: Mode) {
    const LEN: usize = (1 << 20) + 12345;
    const FIRST: usize = 300_000;
    let h = Host::new(mode, "bigread");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let src = MrBuf::new(&b.pd, 2 << 20, ALL).unwrap();
    let dst = MrBuf::new(&a.pd, 2 << 20, ALL).unwrap();
    let pat: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    src.write(100, &pat);
    let sg = [dst.sge(0, FIRST as u32), dst.sge(FIRST + 4096, (LEN - FIRST) as u32)];
    let mut rd = SendWr::new(1, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    rd.remote_addr = src.addr() + 100;
    rd.rkey = src.mr().rkey();
    a.qp.post_send(&rd).unwrap();
    let c = wait_one(&a.cq);
    assert_eq!((c.status, c.byte_len), (WcStatus::Success, LEN as u32));
    let mut out = vec![0u8; FIRST];
    dst.read(0, &mut out);
    assert!(out == pat[..FIRST], "the first element");
    let mut out = vec![0u8; LEN - FIRST];
    dst.read(FIRST + 4096, &mut out);
    assert!(out == pat[FIRST..], "the second element");
}
