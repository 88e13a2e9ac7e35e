//! SENDs into receive buffers that grant no remote access (LOCAL_WRITE only, on the heap):
//! every size up to more than the responder's staging ring holds, every byte checked, on
//! each data path (`each_path!`), into a QP's own receive queue, an SRQ, and a receiver
//! asleep on its completion channel.

mod common;
use common::*;

use std::time::{Duration, Instant};
use vrdma::*;

/// 0, 1, 4 KiB, 64 KiB, 1 MiB and 16 MiB (more than a staging ring holds).
const SIZES: [usize; 6] = [0, 1, 4 << 10, 64 << 10, 1 << 20, 16 << 20];
const MAX: usize = 16 << 20;

/// Heap memory registered LOCAL_WRITE only (leaked: it outlives its MR).
fn local_write_heap(pd: &Pd, len: usize) -> (Mr, &'static mut [u8]) {
    let mem: &'static mut [u8] = Vec::leak(vec![0u8; len]);
    // SAFETY: `mem` is leaked, so it outlives the MR.
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), len, access::LOCAL_WRITE) }.expect("reg_mr");
    (mr, mem)
}

fn pattern(size: usize, i: usize) -> u8 {
    (i.wrapping_mul(131) ^ size ^ (i >> 12)) as u8
}

/// The receive list for `size` bytes at the start of `mr`: two elements (a scatter), one
/// of 4 KiB + 1 (or less) and the rest, with room to spare.
fn receive_sges(mr: &Mr, size: usize) -> Vec<Sge> {
    let first = (size / 2).min(4097) as u32;
    let base = mr.addr();
    vec![
        Sge { addr: base, length: first, lkey: mr.lkey() },
        Sge { addr: base + u64::from(first), length: (MAX - first as usize) as u32, lkey: mr.lkey() },
    ]
}

/// Polls `cq` (and the sender's `other`, so that its waiting SEND goes on) until it has a
/// completion; panics after 60 s.
fn wait_with(cq: &Cq, other: &Cq, other_got: &mut Vec<Wc>) -> Wc {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut wc = [Wc::EMPTY];
    loop {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        if other.poll(&mut wc) == 1 {
            other_got.push(wc[0]);
        }
        assert!(Instant::now() < deadline, "no completion within 60 s");
        std::thread::yield_now();
    }
}

fn check_received(mem: &[u8], size: usize) {
    if let Some(i) = (0..size).find(|&i| mem[i] != pattern(size, i)) {
        panic!("{size}-byte SEND: byte {i} is {:#x}, sent {:#x}", mem[i], pattern(size, i));
    }
    assert!(mem[size..size + 64.min(MAX - size)].iter().all(|b| *b == 0xee), "{size}-byte SEND: nothing beyond it written");
}

each_path!(sends_into_local_write_receive_buffers_keep_every_byte);
fn sends_into_local_write_receive_buffers_keep_every_byte(mode: Mode) {
    let h = Host::new(mode, "staged");
    let (a, b) = h.pair(&h.vnic("a", "t"), &h.vnic("b", "t"), ALL);
    let (src_mr, src) = local_write_heap(&a.pd, MAX);
    let (dst_mr, dst) = local_write_heap(&b.pd, MAX);
    for (n, size) in SIZES.into_iter().enumerate() {
        for (i, x) in src[..size].iter_mut().enumerate() {
            *x = pattern(size, i);
        }
        dst.fill(0xee);
        b.qp.post_recv(&RecvWr { wr_id: 100 + n as u64, sg_list: &receive_sges(&dst_mr, size) }).unwrap();
        let sge = [Sge { addr: src_mr.addr(), length: size as u32, lkey: src_mr.lkey() }];
        let mut wr = SendWr::new(n as u64, if n % 2 == 1 { WrOpcode::SendWithImm } else { WrOpcode::Send }, &sge, send_flags::SIGNALED);
        wr.imm_data = 0xabc0 + n as u32;
        a.qp.post_send(&wr).unwrap();
        let mut sent = Vec::new();
        let r = wait_with(&b.cq, &a.cq, &mut sent);
        assert_eq!((r.wr_id, r.status, r.byte_len as usize), (100 + n as u64, WcStatus::Success, size), "{size}-byte SEND");
        if n % 2 == 1 {
            assert_eq!((r.wc_flags & wc_flags::WITH_IMM, r.imm_data), (wc_flags::WITH_IMM, 0xabc0 + n as u32));
        }
        let s = if sent.is_empty() { wait_one(&a.cq) } else { sent[0] };
        assert_eq!((s.wr_id, s.status), (n as u64, WcStatus::Success), "{size}-byte SEND: the sender's completion");
        check_received(dst, size);
    }
    drop((src_mr, dst_mr));
}

each_path!(sends_into_local_write_srq_buffers_keep_every_byte);
fn sends_into_local_write_srq_buffers_keep_every_byte(mode: Mode) {
    let h = Host::new(mode, "staged-srq");
    let sa = h.vnic("a", "t");
    let ctx = Context::open(&h.vnic("b", "t")).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let srq = pd.create_srq(8, 2).unwrap();
    let (s, q) = srq_qp_facing(&sa, &ctx, &pd, &cq, &srq, 2);
    assert_eq!(q.is_mediated(), mode.mediated());
    let (src_mr, src) = local_write_heap(&s.pd, MAX);
    let (dst_mr, dst) = local_write_heap(&pd, MAX);
    for (n, size) in SIZES.into_iter().enumerate() {
        for (i, x) in src[..size].iter_mut().enumerate() {
            *x = pattern(size, i);
        }
        dst.fill(0xee);
        srq.post_recv(&RecvWr { wr_id: 200 + n as u64, sg_list: &receive_sges(&dst_mr, size) }).unwrap();
        let sge = [Sge { addr: src_mr.addr(), length: size as u32, lkey: src_mr.lkey() }];
        s.qp.post_send(&SendWr::new(n as u64, WrOpcode::Send, &sge, send_flags::SIGNALED)).unwrap();
        let mut sent = Vec::new();
        let r = wait_with(&cq, &s.cq, &mut sent);
        assert_eq!((r.wr_id, r.status, r.byte_len as usize, r.qp_num), (200 + n as u64, WcStatus::Success, size, q.qp_num()));
        let done = if sent.is_empty() { wait_one(&s.cq) } else { sent[0] };
        assert_eq!((done.wr_id, done.status), (n as u64, WcStatus::Success));
        check_received(dst, size);
    }
    drop((src_mr, dst_mr));
}

each_path!(a_receiver_asleep_on_its_channel_gets_every_size);
fn a_receiver_asleep_on_its_channel_gets_every_size(mode: Mode) {
    let h = Host::new(mode, "staged-chan");
    let sa = h.vnic("a", "t");
    let ctx = Context::open(&h.vnic("b", "t")).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 2, max_inline_data: 0 };
    let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).unwrap();
    let a = end(&sa, ALL, false);
    connect_with(&a, ctx.gids()[0], qp.qp_num(), 7).unwrap();
    to_init(&qp);
    qp.modify(&rtr_attr(a.ctx.gids()[0], a.qp.qp_num()), RTR_MASK).unwrap();
    let (dst_mr, dst) = local_write_heap(&pd, MAX);
    let sender = std::thread::spawn(move || {
        let (src_mr, src) = local_write_heap(&a.pd, MAX);
        for (n, size) in SIZES.into_iter().enumerate() {
            for (i, x) in src[..size].iter_mut().enumerate() {
                *x = pattern(size, i);
            }
            // Solicited on every other SEND: the receiver sleeps armed for solicited
            // completions then, and the large ones still arrive.
            let flags = send_flags::SIGNALED | if n % 2 == 0 { send_flags::SOLICITED } else { 0 };
            let sge = [Sge { addr: src_mr.addr(), length: size as u32, lkey: src_mr.lkey() }];
            a.qp.post_send(&SendWr::new(n as u64, WrOpcode::Send, &sge, flags)).unwrap();
            let w = wait_one_long(&a.cq);
            assert_eq!((w.wr_id, w.status), (n as u64, WcStatus::Success), "{size}-byte SEND");
            // The receiver checks and reposts before the next one.
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(src_mr);
        a
    });
    for (n, size) in SIZES.into_iter().enumerate() {
        dst.fill(0xee);
        qp.post_recv(&RecvWr { wr_id: 300 + n as u64, sg_list: &receive_sges(&dst_mr, size) }).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let r = loop {
            let mut wc = [Wc::EMPTY];
            if cq.poll(&mut wc) == 1 {
                break wc[0];
            }
            cq.req_notify(n % 2 == 0).unwrap();
            if cq.poll(&mut wc) == 1 {
                break wc[0];
            }
            if ch.get_cq_event(Some(Duration::from_secs(1))).unwrap().is_some() {
                cq.ack_events(1);
            }
            assert!(Instant::now() < deadline, "{size}-byte SEND: no completion within 60 s");
        };
        assert_eq!((r.wr_id, r.status, r.byte_len as usize), (300 + n as u64, WcStatus::Success, size), "{size}-byte SEND");
        check_received(dst, size);
        // The next receive is posted before the sender's next SEND (it waits 20 ms).
    }
    let _a = sender.join().unwrap();
    drop(dst_mr);
}

/// Polls until one completion arrives (60 s at most: 16 MiB through the mediated engine).
fn wait_one_long(cq: &Cq) -> Wc {
    let mut wc = [Wc::EMPTY];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion within 60 s");
        std::thread::yield_now();
    }
}
