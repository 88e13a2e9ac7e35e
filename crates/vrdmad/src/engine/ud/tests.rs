//! Datagrams in (a client's socket, a peer daemon's `UdSend` frames), effects out: receive
//! completions with their GRH, or drops that are counted and leave the stream framed.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vrdma_abi::ring::{CompEntry, Sge};
use vrdma_abi::ud::{self, UdDatagram, GRH_LEN, UD_FRAME_GIDS};
use vrdma_abi::verbs::{access, wc_flags, WcStatus};
use vrdma_abi::wire::{self, FrameHeader, Kind};

use super::{receive, seqpacket_pair, Pumped, UdSender};
use crate::engine::testing::{connection, engine, ClientRecvSide, PEER};

const DST_QPN: u32 = 0x31;
const SRC_QPN: u32 = 0x41;
const QKEY: u32 = 0x1111;
const KEY: u32 = 0x900;
const ADDR: u64 = 0x20_0000;
const SRC_GID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const DGID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// A `UdSend` frame's header for `payload` (its data: both GIDs, then the payload).
fn ud_send(payload: &[u8], qkey: u32) -> (FrameHeader, Vec<u8>) {
    let mut h = FrameHeader::new(Kind::UdSend);
    h.dst_qpn = DST_QPN;
    h.src_qpn = SRC_QPN;
    h.arg1 = u64::from(qkey);
    h.flags |= wire::F_IMM;
    h.imm = 0xabcd;
    let mut data = SRC_GID.to_vec();
    data.extend_from_slice(&DGID);
    data.extend_from_slice(payload);
    h.data_len = data.len() as u32;
    (h, data)
}

fn wait_for_completion(side: &ClientRecvSide) -> CompEntry {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(ce) = side.poll() {
            return ce;
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A datagram from another host lands in the posted receive behind its GRH, spread over the
/// receive's scatter list, with a completion that says so (GRH, immediate data).
#[test]
fn a_datagram_lands_behind_its_grh_across_the_receives_scatter_list() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
    let side = t.broker.add_ud_qp(DST_QPN, QKEY);
    // The GRH and the payload's first 10 bytes in the first element, the rest in the second.
    side.post_recv(3, &[Sge { addr: ADDR, length: (GRH_LEN + 10) as u32, lkey: KEY }, Sge { addr: ADDR + 4096, length: 100, lkey: KEY }]);
    let (mut peer, c) = connection();
    let payload: Vec<u8> = (0..50u8).collect();
    let (h, data) = ud_send(&payload, QKEY);
    peer.write_all(&data).unwrap();
    receive(&t.e, &c, PEER, &h, &mut Vec::new()).unwrap();

    let ce = side.poll().expect("a completion");
    assert_eq!((ce.wr_id, ce.status, ce.byte_len, ce.src_qp, ce.imm), (3, 0, (GRH_LEN + 50) as u32, SRC_QPN, 0xabcd));
    assert_eq!(u32::from(ce.wc_flags), wc_flags::GRH | wc_flags::WITH_IMM);
    assert_eq!(mr.read(ADDR, GRH_LEN), ud::grh(&SRC_GID, &DGID, 50));
    assert_eq!(mr.read(ADDR + GRH_LEN as u64, 10), payload[..10]);
    assert_eq!(mr.read(ADDR + 4096, 40), payload[10..]);
}

/// What cannot be delivered (wrong Q_Key, refused by the tenant rules, no receive posted,
/// QP not ready, malformed) is dropped without a completion, and the next datagram on the
/// same connection is still read whole.
#[test]
fn undeliverable_datagrams_are_dropped_and_the_stream_stays_framed() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
    let side = t.broker.add_ud_qp(DST_QPN, QKEY);
    let (mut peer, c) = connection();
    let mut buf = Vec::new();
    let mut deliver = |h: &FrameHeader, data: &[u8]| {
        peer.write_all(data).unwrap();
        receive(&t.e, &c, PEER, h, &mut buf).unwrap();
    };

    // No receive posted.
    let (h, data) = ud_send(b"one", QKEY);
    deliver(&h, &data);
    side.post_recv(1, &[Sge { addr: ADDR, length: 4096, lkey: KEY }]);
    // Wrong Q_Key.
    let (h, data) = ud_send(b"two", QKEY + 1);
    deliver(&h, &data);
    // Refused by the broker.
    *t.broker.refuse_ud.lock() = Some("tenant rules".into());
    let (h, data) = ud_send(b"three", QKEY);
    deliver(&h, &data);
    *t.broker.refuse_ud.lock() = None;
    // Shorter than its two GIDs.
    let (mut h, _) = ud_send(b"", QKEY);
    h.data_len = (UD_FRAME_GIDS - 1) as u32;
    deliver(&h, &[0u8; UD_FRAME_GIDS - 1]);
    assert!(side.poll().is_none(), "nothing delivered");

    let (h, data) = ud_send(b"four", QKEY);
    deliver(&h, &data);
    let ce = side.poll().expect("the good one");
    assert_eq!((ce.wr_id, ce.byte_len, ce.status), (1, (GRH_LEN + 4) as u32, 0));
}

/// A receive too small for the GRH and payload completes in error (LOC_LEN_ERR), as on the
/// direct path; one whose buffer is not the QP's MR with LOC_PROT_ERR.
#[test]
fn a_receive_too_small_or_not_registered_completes_in_error() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
    let side = t.broker.add_ud_qp(DST_QPN, QKEY);
    side.post_recv(1, &[Sge { addr: ADDR, length: (GRH_LEN + 3) as u32, lkey: KEY }]);
    side.post_recv(2, &[Sge { addr: ADDR, length: 4096, lkey: KEY + 1 }]);
    let (mut peer, c) = connection();
    for _ in 0..2 {
        let (h, data) = ud_send(b"four", QKEY);
        peer.write_all(&data).unwrap();
        receive(&t.e, &c, PEER, &h, &mut Vec::new()).unwrap();
    }
    let small = side.poll().unwrap();
    assert_eq!((small.wr_id, small.status, small.byte_len), (1, WcStatus::LocLenErr as u8, 0));
    let unregistered = side.poll().unwrap();
    assert_eq!((unregistered.wr_id, unregistered.status), (2, WcStatus::LocProtErr as u8));
}

/// A UD QP's datagram to a GID it did not resolve, one over the MTU and one with unknown
/// flags are dropped and counted; a closed client socket ends the sender's pumping.
#[test]
fn a_sender_drops_and_counts_what_it_cannot_forward() {
    let t = engine();
    let (client, socket) = seqpacket_pair().unwrap();
    let s = UdSender::new(SRC_QPN, "v", SRC_GID, socket);
    let send = |msg: &[u8]| {
        // SAFETY: sends `msg`, live for the call, on our end of the pair.
        let n = unsafe { libc::send(client.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        assert_eq!(n, msg.len() as isize);
    };
    let d = UdDatagram { dest_qpn: DST_QPN, qkey: QKEY, imm: 0, flags: 0, dgid: DGID };
    let mut msg = d.encode_header().to_vec();
    msg.extend_from_slice(b"unrouted");
    send(&msg);
    let mut big = d.encode_header().to_vec();
    big.resize(ud::UD_DATAGRAM_MAX + 1, 0);
    send(&big);
    let mut odd = UdDatagram { flags: 0x80, ..d }.encode_header().to_vec();
    odd.extend_from_slice(b"x");
    send(&odd);

    let (mut m, mut f) = (Vec::new(), Vec::new());
    assert_eq!(s.pump(&t.e, &mut m, &mut f), Pumped::Empty);
    assert_eq!(s.dropped.load(std::sync::atomic::Ordering::Relaxed), 3);
    drop(client);
    assert_eq!(s.pump(&t.e, &mut m, &mut f), Pumped::Closed);
}

/// End to end through the engine: a datagram a client writes to its UD QP's socket is
/// forwarded by the doorbell thread over the link (here to this same engine) and delivered
/// to the destination QP by the link's reader.
#[test]
fn a_clients_datagram_reaches_the_destination_qp_over_the_link() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
    let side = t.broker.add_ud_qp(DST_QPN, QKEY);
    side.post_recv(9, &[Sge { addr: ADDR, length: 4096, lkey: KEY }]);
    let client = t.e.add_ud_route(SRC_QPN, SRC_GID, DGID, t.e.local_addr(), "v").unwrap().expect("the QP's first route");
    assert!(t.e.add_ud_route(SRC_QPN, SRC_GID, DGID, t.e.local_addr(), "v").unwrap().is_none(), "one socket per QP");

    let d = UdDatagram { dest_qpn: DST_QPN, qkey: QKEY, imm: 0, flags: ud::UD_F_SOLICITED, dgid: DGID };
    let mut msg = d.encode_header().to_vec();
    msg.extend_from_slice(b"over the link");
    // SAFETY: sends `msg`, live for the call, on the client's end.
    let n = unsafe { libc::send(client.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    assert_eq!(n, msg.len() as isize);

    let ce = wait_for_completion(&side);
    assert_eq!((ce.wr_id, ce.status, ce.byte_len, ce.src_qp), (9, 0, (GRH_LEN + 13) as u32, SRC_QPN));
    assert_eq!(mr.read(ADDR + GRH_LEN as u64, 13), b"over the link");
    t.e.detach_ud(SRC_QPN);
}

/// The UD receive lock lives in memory the destination's client writes: a client that holds
/// it costs the connection delivering to every QP of its host at most a few milliseconds per
/// second, however many datagrams come for it (each dropped, as UD may), and deliveries
/// resume once it lets go.
#[test]
fn a_held_ud_lock_cannot_stall_the_delivering_connection() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
    let side = t.broker.add_ud_qp(DST_QPN, QKEY);
    for i in 0..2 {
        side.post_recv(i, &[Sge { addr: ADDR, length: 4096, lkey: KEY }]);
    }
    let (mut peer, c) = connection();
    let mut buf = Vec::new();
    side.set_ud_lock(true);
    let started = Instant::now();
    for _ in 0..40 {
        let (h, data) = ud_send(b"held", QKEY);
        peer.write_all(&data).unwrap();
        receive(&t.e, &c, PEER, &h, &mut buf).unwrap();
    }
    let stalled = started.elapsed();
    assert!(stalled < Duration::from_millis(200), "40 datagrams to a QP whose lock is held took {stalled:?}");
    let early = side.poll();
    assert!(early.is_none(), "dropped while the lock is held: {early:?}");
    side.set_ud_lock(false);
    let (h, data) = ud_send(b"free", QKEY);
    peer.write_all(&data).unwrap();
    receive(&t.e, &c, PEER, &h, &mut buf).unwrap();
    assert_eq!(side.poll().expect("delivered once the lock is free").status, 0);
}

/// A vNIC's caps hold its datagrams to other hosts as they hold its QPs' WRs: the doorbell
/// thread forwards them through the scheduler. Before, datagrams went around it, and a vNIC
/// capped at 1 MB/s sent 400 KB of them in a few milliseconds (taking the doorbell thread
/// from every other vNIC meanwhile, for as many datagrams as its sockets held).
#[test]
fn a_capped_vnics_datagrams_are_held_to_its_cap() {
    use std::collections::HashMap;
    use vrdma_abi::control::Qos;

    const CAP: u64 = 1_000_000;
    const PAYLOAD: usize = 4000;
    const COUNT: usize = 100;
    let t = engine();
    // (Each datagram that arrives is refused and counted: the count of arrivals.)
    *t.broker.refuse_ud.lock() = Some("counted".into());
    let policy = HashMap::from([("v".to_string(), ("t".to_string(), Qos { max_bw: CAP, ..Qos::default() }))]);
    t.e.set_qos(policy, HashMap::new());
    let client = t.e.add_ud_route(SRC_QPN, SRC_GID, DGID, t.e.local_addr(), "v").unwrap().expect("the QP's socket");

    let d = UdDatagram { dest_qpn: DST_QPN, qkey: QKEY, imm: 0, flags: 0, dgid: DGID };
    let mut msg = d.encode_header().to_vec();
    msg.resize(msg.len() + PAYLOAD, 7);
    let started = Instant::now();
    for _ in 0..COUNT {
        // SAFETY: sends `msg`, live for the call, on the client's end.
        let n = unsafe { libc::send(client.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        assert_eq!(n, msg.len() as isize);
    }
    std::thread::sleep(Duration::from_millis(100));
    let arrived = t.e.refused_claims() as usize;
    // What the cap lets through in the time that passed: its rate, the bucket's 10 ms and a
    // datagram in progress (bounded from the time measured, however slow the machine).
    let allowed = (started.elapsed().as_secs_f64() * CAP as f64 + CAP as f64 / 100.0) as usize / PAYLOAD + 3;
    assert!(arrived <= allowed, "{arrived} datagrams of {PAYLOAD} bytes arrived where the cap allows {allowed}");
    // Held back, never dropped: all arrive.
    let deadline = Instant::now() + Duration::from_secs(10);
    while (t.e.refused_claims() as usize) < COUNT {
        assert!(Instant::now() < deadline, "only {} of {COUNT} arrived", t.e.refused_claims());
        std::thread::sleep(Duration::from_millis(20));
    }
    t.e.detach_ud(SRC_QPN);
}
