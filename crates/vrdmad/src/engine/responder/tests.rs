//! Requests in (as a peer daemon's frames), effects out: memory, receive completions, and the
//! answers on the connection.

use std::io::Write;

use vrdma_abi::ring::Sge;
use vrdma_abi::verbs::{access, QpState, WcOpcode, WcStatus};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};

use super::{handle_request, send_owed_ack};
use crate::engine::testing::{connection, engine, mediated_qp, nothing_sent, read_frame};

const QPN: u32 = 0x11;
const PEER_QPN: u32 = 0x22;
const KEY: u32 = 0x700;
const ADDR: u64 = 0x10_0000;
const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// A request of the peer's QP to ours.
fn request(kind: Kind, psn: u32, data_len: usize) -> FrameHeader {
    let mut h = FrameHeader::new(kind);
    h.src_qpn = PEER_QPN;
    h.dst_qpn = QPN;
    h.psn = psn;
    h.data_len = data_len as u32;
    h
}

fn write_to(psn: u32, addr: u64, data_len: usize) -> FrameHeader {
    let mut h = request(Kind::Write, psn, data_len);
    h.rkey = KEY;
    h.remote_addr = addr;
    h
}

/// A SEND lands in the posted receive (data and completion), its ACK is deferred for a
/// request of our QP's own to carry, and the reader sends it when none does.
#[test]
fn a_send_lands_in_the_posted_receive_and_its_ack_is_deferred_until_the_reader_sends_it() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(7, &[Sge { addr: ADDR + 100, length: 64, lkey: KEY }]);

    peer.write_all(b"hello").unwrap();
    let owed = handle_request(&t.e, &c, &c, &request(Kind::Send, 0, 5), None, None, None).unwrap();
    assert!(owed.is_some_and(|o| std::sync::Arc::ptr_eq(&o, &q)), "the ACK is owed");
    assert_eq!(mr.read(ADDR + 100, 5), b"hello");
    let ce = side.poll().expect("a receive completion");
    assert_eq!((ce.wr_id, ce.byte_len, ce.status, ce.src_qp), (7, 5, 0, PEER_QPN));
    assert_eq!(ce.opcode, WcOpcode::Recv as u8);
    assert!(nothing_sent(&peer), "no ACK of its own yet");

    send_owed_ack(&c, &q).unwrap();
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.kind, ack.psn, ack.status, ack.dst_qpn, ack.src_qpn), (Kind::Ack, 0, 0, PEER_QPN, QPN));
    send_owed_ack(&c, &q).unwrap();
    assert!(nothing_sent(&peer), "an ACK goes once");
}

/// A SEND whose QP is detached (its owner resets it: `SetQpState(Reset)`) while the reader
/// is in the middle of its data completes no receive: the owner's library empties its
/// completion ring once the reset's detach returned, so a completion pushed after it would
/// be taken for one of the QP's next connection. Before, the reader holding the QP pushed it
/// whatever the detach.
#[test]
fn a_send_in_progress_when_its_qp_is_detached_completes_no_receive() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(7, &[Sge { addr: ADDR, length: 64, lkey: KEY }]);

    detach_during(&t, &c, &mut peer, &q, request(Kind::Send, 0, 5), b"hel", b"lo", || {});
    assert!(side.poll().is_none(), "a receive completed after its QP was detached");
}

/// Writes the first part `head` of request `h`'s data, has a reader take `h` (it then holds
/// `q`'s responder state while it waits for the rest), detaches `q`'s QP, runs `meanwhile`,
/// writes the rest `tail` and waits for the reader to finish.
#[allow(clippy::too_many_arguments)]
fn detach_during(
    t: &crate::engine::testing::TestEngine,
    c: &std::sync::Arc<crate::engine::connection::Conn>,
    peer: &mut std::net::TcpStream,
    q: &crate::engine::qp::MedQp,
    h: FrameHeader,
    head: &[u8],
    tail: &[u8],
    meanwhile: impl FnOnce(),
) {
    peer.write_all(head).unwrap();
    let (e, c2) = (t.e.clone(), c.clone());
    let reader = std::thread::spawn(move || handle_request(&e, &c2, &c2, &h, None, None, None).map(|_| ()));
    let started = std::time::Instant::now();
    while q.resp.try_lock().is_some() {
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "the reader never took the request");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    t.e.detach(q.qpn);
    meanwhile();
    peer.write_all(tail).unwrap();
    reader.join().unwrap().unwrap();
}

/// Nor does such a reader take a receive posted after the detach (for the QP's next
/// connection): a WRITE_WITH_IMM takes its receive after its data, and a reader that held
/// the QP across the reset took the new receive, whose completion the detach then dropped:
/// the receive was lost.
#[test]
fn a_write_with_imm_in_progress_when_its_qp_is_detached_takes_no_later_receive() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);

    let mut w = write_to(0, ADDR, 5);
    w.flags |= wire::F_IMM;
    detach_during(&t, &c, &mut peer, &q, w, b"imm", b"ed", || side.post_recv(9, &[Sge { addr: ADDR + 4096, length: 64, lkey: KEY }]));
    // Answered as a QP no longer here is, not RNR (which would use up the peer's RNR retries).
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status), (Kind::Ack, Nak::NotReady as u32));
    assert!(side.poll().is_none(), "a receive completed after its QP was detached");
    let mut sges = Vec::new();
    assert_eq!(q.recv.take_recv(&mut sges).map(|(id, _)| id), Some(9), "the receive posted after the detach was taken");
}

/// With no receive posted, a SEND is answered RNR and not executed (the PSN does not move):
/// its resend, once a receive is there, is.
#[test]
fn a_send_without_a_receive_is_answered_rnr_and_executed_when_resent() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);

    peer.write_all(b"early").unwrap();
    assert!(handle_request(&t.e, &c, &c, &request(Kind::Send, 0, 5), None, None, None).unwrap().is_none());
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status, nak.psn), (Kind::Ack, Nak::Rnr as u32, 0));
    assert_eq!(q.resp.lock().expected_psn, 0);
    assert!(side.poll().is_none());

    side.post_recv(1, &[Sge { addr: ADDR, length: 16, lkey: KEY }]);
    peer.write_all(b"again").unwrap();
    assert!(handle_request(&t.e, &c, &c, &request(Kind::Send, 0, 5), None, None, None).unwrap().is_some());
    assert_eq!(mr.read(ADDR, 5), b"again");
    assert_eq!(side.poll().map(|ce| (ce.wr_id, ce.byte_len)), Some((1, 5)));
    assert_eq!(q.resp.lock().expected_psn, 1);
}

/// A request seen before (a resend after a lost ACK) is acknowledged, never executed twice.
#[test]
fn a_duplicate_write_is_acknowledged_but_not_executed_again() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (_q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);

    peer.write_all(b"abc").unwrap();
    handle_request(&t.e, &c, &c, &write_to(0, ADDR + 8, 3), None, None, None).unwrap();
    assert_eq!(mr.read(ADDR + 8, 3), b"abc");
    peer.write_all(b"xyz").unwrap();
    assert!(handle_request(&t.e, &c, &c, &write_to(0, ADDR + 8, 3), None, None, None).unwrap().is_some());
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.kind, ack.status, ack.psn), (Kind::Ack, 0, 0));
    assert_eq!(mr.read(ADDR + 8, 3), b"abc", "not written again");
}

/// A WRITE outside its MR (or to a key that is not there) gets a REMOTE_ACCESS NAK; the
/// requester's QP is then in error, so what it sent after is dropped unanswered, its data
/// read so that the stream stays framed.
#[test]
fn a_write_outside_the_mr_is_refused_and_what_follows_is_dropped() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);

    peer.write_all(&[9u8; 16]).unwrap();
    handle_request(&t.e, &c, &c, &write_to(0, ADDR + 8190, 16), None, None, None).unwrap();
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status), (Kind::Ack, Nak::RemoteAccess as u32));
    assert!(q.resp.lock().dead);

    peer.write_all(b"late").unwrap();
    assert!(handle_request(&t.e, &c, &c, &write_to(1, ADDR, 4), None, None, None).unwrap().is_none());
    assert!(nothing_sent(&peer));
    assert_eq!(mr.read(ADDR, 4), [0u8; 4], "nothing written");
    assert!(!c.readable_now(), "both requests' data was read");
}

/// A request for a QP that is not (yet) here is answered "not ready", one from a QP ours
/// is not paired with "gone"; neither touches anything, and the stream stays framed.
#[test]
fn requests_for_unknown_or_unpaired_qps_are_answered_not_ready_or_gone() {
    let t = engine();
    let (mut peer, c) = connection();
    let (_q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);

    let mut unknown = request(Kind::Send, 0, 3);
    unknown.dst_qpn = QPN + 1;
    peer.write_all(b"abc").unwrap();
    handle_request(&t.e, &c, &c, &unknown, None, None, None).unwrap();
    assert_eq!(read_frame(&mut peer).0.status, Nak::NotReady as u32);

    let mut stranger = request(Kind::Send, 0, 3);
    stranger.src_qpn = PEER_QPN + 1;
    peer.write_all(b"def").unwrap();
    handle_request(&t.e, &c, &c, &stranger, None, None, None).unwrap();
    let (gone, _) = read_frame(&mut peer);
    assert_eq!((gone.status, gone.dst_qpn), (Nak::Gone as u32, PEER_QPN + 1));
    assert!(side.poll().is_none());
    assert!(!c.readable_now(), "their data was read");
}

/// A READ is answered with the MR's bytes; an atomic with the old value, and memory updated.
#[test]
fn a_read_returns_the_mrs_bytes_and_an_atomic_its_old_value() {
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    mr.write(ADDR + 4096, b"remote bytes");
    mr.write(ADDR + 64, &40u64.to_ne_bytes());

    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR + 4096, 12);
    handle_request(&t.e, &c, &c, &read, None, None, None).unwrap();
    let (resp, data) = read_frame(&mut peer);
    assert_eq!((resp.kind, resp.status, resp.psn), (Kind::ReadResp, 0, 0));
    assert_eq!(data, b"remote bytes");

    let mut add = request(Kind::AtomicReq, 1, 0);
    (add.rkey, add.remote_addr, add.arg1) = (KEY, ADDR + 64, 2);
    handle_request(&t.e, &c, &c, &add, None, None, None).unwrap();
    let (resp, _) = read_frame(&mut peer);
    assert_eq!((resp.kind, resp.status, resp.arg1), (Kind::AtomicResp, 0, 40));
    assert_eq!(mr.read(ADDR + 64, 8), 42u64.to_ne_bytes());

    let mut swap = request(Kind::AtomicReq, 2, 0);
    swap.flags |= wire::F_CMP_SWAP;
    (swap.rkey, swap.remote_addr, swap.arg1, swap.arg2) = (KEY, ADDR + 64, 41, 7);
    handle_request(&t.e, &c, &c, &swap, None, None, None).unwrap();
    assert_eq!(read_frame(&mut peer).0.arg1, 42, "compare failed: the old value, nothing swapped");
    assert_eq!(mr.read(ADDR + 64, 8), 42u64.to_ne_bytes());
    assert_eq!(q.resp.lock().expected_psn, 3);

    // The READ again (its requester could not store the response): answered again, with
    // the bytes as they are now, and nothing else moves. Before, an ACK without data
    // completed it.
    mr.write(ADDR + 4096, b"REMOTE");
    handle_request(&t.e, &c, &c, &read, None, None, None).unwrap();
    let (resp, data) = read_frame(&mut peer);
    assert_eq!((resp.kind, resp.status, resp.psn), (Kind::ReadResp, 0, 0));
    assert_eq!(data, b"REMOTE bytes");
    assert_eq!(q.resp.lock().expected_psn, 3);
}

/// Past ACK_EVERY deferred SENDs and WRITEs, the responder acknowledges at once, so that a
/// streaming requester's window keeps moving.
#[test]
fn a_stream_of_writes_is_acknowledged_every_ack_every_requests() {
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let (mut peer, c) = connection();
    let (_q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let every = crate::engine::qp::ACK_EVERY;
    for psn in 0..every {
        peer.write_all(b"x").unwrap();
        handle_request(&t.e, &c, &c, &write_to(psn, ADDR, 1), None, None, None).unwrap();
        if psn + 1 < every {
            assert!(nothing_sent(&peer), "deferred at {psn}");
        }
    }
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.kind, ack.psn), (Kind::Ack, every - 1));
}

/// A client trickling a large WRITE on its lane holds our QP's responder lock for as long as
/// the frame's deadline allows (minutes at 4 MiB/s for a large frame). A (re)connection of
/// that QP, which a peer daemon's shared connection carries, must not wait for it: the old
/// lane is shut down, its request cut short, and the reset is done at once (before, the
/// reader of the connection serving every QP of that host waited out the trickle).
#[test]
fn a_trickling_lane_never_holds_up_a_reconnection() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (_out_peer, out) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &out);
    let (mut lane_peer, lane) = connection();
    let licence = Arc::new(AtomicBool::new(true));
    let lane_in = crate::engine::lane::LaneIn { licence: licence.clone(), conn: lane.clone() };
    t.e.lanes_in.lock().insert((crate::engine::testing::PEER, QPN, PEER_QPN), lane_in);

    // The lane's reader: a WRITE of 1 MiB whose first bytes arrive, then nothing.
    lane_peer.write_all(&[9u8; 100]).unwrap();
    let (e, l, o) = (t.e.clone(), lane.clone(), out.clone());
    let reader =
        std::thread::spawn(move || handle_request(&e, &l, &o, &write_to(0, ADDR, 1 << 20), Some(&licence), Some([1, 2]), None).is_err());
    let started = Instant::now();
    while mr.read(ADDR, 100) != [9u8; 100] {
        assert!(started.elapsed() < Duration::from_secs(5), "the lane's reader never started writing");
        std::thread::sleep(Duration::from_millis(1));
    }

    // The reconnection, as the shared connection's reader makes it.
    let (tx, rx) = std::sync::mpsc::channel();
    let e = t.e.clone();
    std::thread::spawn(move || {
        e.reset_responder(QPN);
        let _ = tx.send(());
    });
    let done = rx.recv_timeout(Duration::from_secs(2));
    if done.is_err() {
        lane.shutdown(); // (lets the test end)
    }
    assert!(done.is_ok(), "the reconnection waited for the lane's trickle");
    assert!(reader.join().unwrap(), "the trickled request was cut short");
    assert!(!lane.is_alive() && t.e.lanes_in.lock().is_empty(), "the old lane is gone");
    assert_eq!(q.resp.lock().expected_psn, 0);
}

/// A READ's data goes in parts of at most `SEGMENT` bytes, each written whole, on the
/// connection its answers take; for a lane's READ that is a connection of the peer
/// daemon's, whose reader answers every QP of that host on it, and on which the
/// connection's answerer sends a lane's READ of more than 1 MiB (as here) as the scheduler
/// grants it (a smaller one of a vNIC without a policy, the lane's server at once). Another
/// QP's answer goes between two parts.
/// Before, one 64-byte READ request a lane's client wrote itself (caps or not) held that
/// connection for the whole READ, up to 2 GiB: here 32 MiB at a slow reader's pace,
/// seconds, during which every other QP's answers waited.
#[test]
fn a_large_read_on_a_lane_lets_other_answers_through() {
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const LEN: usize = 32 << 20;
    const QPN2: u32 = 0x12;
    const PEER_QPN2: u32 = 0x23;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    mr.write(ADDR + LEN as u64 - 5, b"tail!");
    mr.write(ADDR, b"other");
    let (_lane_peer, lane) = connection();
    let (mut out_peer, out) = connection();
    let (_q, _side) = mediated_qp(&t, QPN, PEER_QPN, &lane);
    let (_q2, _side2) = mediated_qp(&t, QPN2, PEER_QPN2, &out);

    // The peer daemon's reader of `out`: slow (a busy or far link) until told otherwise.
    let fast = Arc::new(AtomicBool::new(false));
    let f = fast.clone();
    let reader = std::thread::spawn(move || {
        out_peer.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut frames = Vec::new();
        let (mut big_done, mut small_seen) = (false, false);
        while !(big_done && small_seen) {
            let mut b = [0u8; wire::HEADER_LEN];
            out_peer.read_exact(&mut b).unwrap();
            let h = FrameHeader::decode(&b).unwrap();
            let mut data = vec![0u8; h.data_len as usize];
            for chunk in data.chunks_mut(16 << 10) {
                out_peer.read_exact(chunk).unwrap();
                if !f.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            if h.dst_qpn == PEER_QPN2 {
                small_seen = true;
                assert_eq!((h.kind, &data[..]), (Kind::ReadResp, &b"other"[..]));
            } else {
                big_done = h.flags & wire::F_MORE == 0;
                if big_done {
                    assert_eq!(&data[data.len() - 5..], b"tail!");
                }
            }
            frames.push((h.dst_qpn, h.arg2, h.data_len, h.flags & wire::F_MORE != 0));
        }
        frames
    });

    // The lane's reader executes a READ of all of it.
    let answers = Arc::new(super::ReadAnswers::new(out.clone(), Arc::downgrade(&t.e)));
    let (e, l, o, a) = (t.e.clone(), lane.clone(), out.clone(), answers.clone());
    let licence = Arc::new(AtomicBool::new(true));
    let lane_thread = std::thread::spawn(move || {
        let mut read = request(Kind::ReadReq, 0, 0);
        (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, LEN as u64);
        handle_request(&e, &l, &o, &read, Some(&licence), Some([1, 2]), Some(&a)).unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));

    // Meanwhile the connection's own reader answers another QP's READ of 5 bytes.
    let mut small = request(Kind::ReadReq, 0, 0);
    (small.dst_qpn, small.src_qpn, small.rkey, small.remote_addr, small.arg1) = (QPN2, PEER_QPN2, KEY, ADDR, 5);
    let started = Instant::now();
    handle_request(&t.e, &out, &out, &small, None, None, Some(&answers)).unwrap();
    let waited = started.elapsed();
    fast.store(true, Ordering::Relaxed);
    lane_thread.join().unwrap();
    let frames = reader.join().unwrap();
    assert!(waited < Duration::from_secs(2), "another QP's answer waited {waited:?} for a lane's READ");

    // The READ's parts: in order, contiguous, each at most a segment, the last without F_MORE.
    let parts: Vec<_> = frames.iter().filter(|f| f.0 == PEER_QPN).collect();
    let mut at = 0u64;
    for (i, (_, off, len, more)) in parts.iter().enumerate() {
        assert_eq!(*off, at);
        assert!(*len <= wire::SEGMENT);
        assert_eq!(*more, i + 1 < parts.len());
        at += u64::from(*len);
    }
    assert_eq!(at, LEN as u64);
}

/// The data of `frames` (each a header and its data), written by the peer from a thread of
/// its own (more than a socket buffer holds); joined for the peer's end back.
fn peer_writes(mut peer: std::net::TcpStream, data: Vec<u8>) -> std::thread::JoinHandle<std::net::TcpStream> {
    std::thread::spawn(move || {
        peer.write_all(&data).unwrap();
        peer
    })
}

/// Segment `at..at+n` of a message of `len` bytes (flags as the requester's engine sets them).
fn segment(mut h: FrameHeader, at: usize, n: usize, len: usize) -> FrameHeader {
    h.data_len = n as u32;
    if at > 0 {
        h.flags |= wire::F_CONT;
        h.arg2 = at as u64;
    }
    if at + n < len {
        h.flags |= wire::F_MORE;
    }
    if h.kind == Kind::Write {
        h.remote_addr += at as u64;
    }
    h
}

fn segments_of(len: usize) -> Vec<(usize, usize)> {
    let seg = wire::SEGMENT as usize;
    (0..len.div_ceil(seg)).map(|i| (i * seg, (len - i * seg).min(seg))).collect()
}

/// A SEND in segments (`F_MORE`, `F_CONT`) fills one receive across its scatter list, an
/// element boundary inside a segment; it completes once, at its last segment, with the
/// message's whole length, and is answered once. A resend of its first segment (the
/// requester's after a "not ready") takes the same receive again, not the next one.
#[test]
fn a_send_in_segments_lands_whole_in_one_receive() {
    const LEN: usize = 550_000;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(9, &[Sge { addr: ADDR, length: 300_000, lkey: KEY }, Sge { addr: ADDR + 400_000, length: 300_000, lkey: KEY }]);
    side.post_recv(10, &[Sge { addr: ADDR + 800_000, length: 16, lkey: KEY }]);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
    let segs = segments_of(LEN);
    // The first segment twice (a resend from the start), then the rest.
    let mut stream = data[..segs[0].1].to_vec();
    stream.extend_from_slice(&data);
    let w = peer_writes(peer, stream);
    let first = segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN);
    assert!(handle_request(&t.e, &c, &c, &first, None, None, None).unwrap().is_none());
    for &(at, n) in &segs {
        let h = segment(request(Kind::Send, 0, 0), at, n, LEN);
        handle_request(&t.e, &c, &c, &h, None, None, None).unwrap();
        let ce = side.poll();
        assert_eq!(ce.is_some(), at + n == LEN, "completed at its last segment only");
        if let Some(ce) = ce {
            assert_eq!((ce.wr_id, ce.byte_len, ce.status), (9, LEN as u32, 0));
        }
    }
    let mut peer = w.join().unwrap();
    assert!(mr.read(ADDR, 300_000) == data[..300_000], "first element");
    assert!(mr.read(ADDR + 400_000, LEN - 300_000) == data[300_000..], "second element");
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.kind, ack.psn, ack.status), (Kind::Ack, 0, 0));
    assert!(nothing_sent(&peer), "answered once");
    assert_eq!(q.resp.lock().expected_psn, 1);
    // The next SEND takes the next receive.
    peer.write_all(b"next").unwrap();
    handle_request(&t.e, &c, &c, &request(Kind::Send, 1, 4), None, None, None).unwrap();
    assert_eq!(side.poll().map(|ce| ce.wr_id), Some(10));
}

/// A WRITE_WITH_IMM in segments writes each where it says and consumes its receive with its
/// last: with none posted, that one is answered RNR (the earlier ones' bytes are written, as
/// a NIC's packets would be) and the resend from the first segment completes it. Later
/// segments that continue nothing (their first refused, or never sent) are dropped unanswered.
#[test]
fn a_write_in_segments_completes_once_with_its_whole_length() {
    const LEN: usize = 600_000;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 241) as u8).collect();
    let segs = segments_of(LEN);
    let mut base = write_to(0, ADDR + 1000, 0);
    base.flags |= wire::F_IMM;
    base.imm = 77;
    // A stray later segment first; then the message without a receive; then again with one.
    let mut stream = data[segs[1].0..segs[1].0 + segs[1].1].to_vec();
    stream.extend_from_slice(&data);
    stream.extend_from_slice(&data);
    let w = peer_writes(peer, stream);
    handle_request(&t.e, &c, &c, &segment(base, segs[1].0, segs[1].1, LEN), None, None, None).unwrap();
    for &(at, n) in &segs {
        handle_request(&t.e, &c, &c, &segment(base, at, n, LEN), None, None, None).unwrap();
    }
    assert!(side.poll().is_none());
    side.post_recv(3, &[]);
    for &(at, n) in &segs {
        handle_request(&t.e, &c, &c, &segment(base, at, n, LEN), None, None, None).unwrap();
    }
    let mut peer = w.join().unwrap();
    let (rnr, _) = read_frame(&mut peer);
    assert_eq!((rnr.kind, rnr.status, rnr.psn), (Kind::Ack, Nak::Rnr as u32, 0));
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.kind, ack.status, ack.psn), (Kind::Ack, 0, 0));
    assert!(nothing_sent(&peer), "the stray segment was not answered");
    let ce = side.poll().expect("a completion");
    assert_eq!((ce.wr_id, ce.byte_len, ce.imm, ce.opcode), (3, LEN as u32, 77, WcOpcode::RecvRdmaWithImm as u8));
    assert!(side.poll().is_none(), "once");
    assert!(mr.read(ADDR + 1000, LEN) == data);
    assert_eq!(q.resp.lock().expected_psn, 1);
}

/// A requester that begins a SEND in segments and then, at the same PSN, a WRITE or a READ:
/// the SEND's receive completes in error (it never vanishes) and the request is refused.
#[test]
fn a_send_cut_off_by_another_request_fails_its_receive() {
    const LEN: usize = 400_000;
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (peer, c) = connection();
    let (_q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(4, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    let segs = segments_of(LEN);
    let w = peer_writes(peer, vec![1u8; segs[0].1 + 8]);
    handle_request(&t.e, &c, &c, &segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN), None, None, None).unwrap();
    assert!(side.poll().is_none());
    handle_request(&t.e, &c, &c, &write_to(0, ADDR, 8), None, None, None).unwrap();
    let mut peer = w.join().unwrap();
    let ce = side.poll().expect("the receive completes");
    assert_eq!(ce.wr_id, 4);
    assert_ne!(ce.status, 0);
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status), (Kind::Ack, Nak::InvalidRequest as u32));

    // The same with a READ at that PSN (after the peer reconnects).
    t.e.reset_responder(QPN);
    side.post_recv(5, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    let w = peer_writes(peer, vec![2u8; segs[0].1]);
    handle_request(&t.e, &c, &c, &segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN), None, None, None).unwrap();
    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, 8);
    handle_request(&t.e, &c, &c, &read, None, None, None).unwrap();
    let mut peer = w.join().unwrap();
    let ce = side.poll().expect("the receive completes");
    assert_eq!(ce.wr_id, 5);
    assert_ne!(ce.status, 0);
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status), (Kind::ReadResp, Nak::InvalidRequest as u32));
}

/// A SEND cut off between its segments while its QP is in ERR: the owner's library flushed
/// the receive it had taken with every other, so a peer's reconnection completes nothing
/// (a second completion would use up a receive posted later). While the QP is live, the
/// same cut completes the receive flushed, once.
#[test]
fn a_send_cut_off_after_its_qp_entered_err_is_not_flushed_twice() {
    const LEN: usize = 400_000;
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (peer, c) = connection();
    let (_q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let segs = segments_of(LEN);
    let w = peer_writes(peer, vec![1u8; 2 * segs[0].1]);
    let first = segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN);

    side.post_recv(4, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    handle_request(&t.e, &c, &c, &first, None, None, None).unwrap();
    t.e.reset_responder(QPN);
    let ce = side.poll().expect("flushed while live");
    assert_eq!((ce.wr_id, ce.status), (4, WcStatus::WrFlushErr as u8));
    assert!(side.poll().is_none(), "once");

    side.post_recv(5, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    handle_request(&t.e, &c, &c, &first, None, None, None).unwrap();
    side.set_state(QpState::Err);
    t.e.reset_responder(QPN);
    assert!(side.poll().is_none(), "the library flushed it already");
    let _peer = w.join().unwrap();
}

/// A SEND cut off between its segments holds a receive its QP's SRQ lent it. The library
/// does not flush an SRQ's receives when the QP enters ERR, so the engine does, once, as
/// soon as it sees the state (the client's doorbell), and neither the message's next
/// segment nor a peer's reconnection completes it again. Before, it completed only at a
/// reconnection while still in ERR; a RESET or destroy first lost it.
#[test]
fn an_srq_receive_held_by_a_cut_off_send_is_flushed_when_its_qp_enters_err() {
    use std::time::{Duration, Instant};
    const LEN: usize = 400_000;
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (mut peer, c) = connection();
    let (q, side) = crate::engine::testing::srq_mediated_qp(&t, QPN, PEER_QPN, &c);
    let segs = segments_of(LEN);
    peer.write_all(&vec![1u8; segs[0].1 + segs[1].1]).unwrap();
    side.post_recv(6, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    handle_request(&t.e, &c, &c, &segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN), None, None, None).unwrap();
    assert!(side.poll().is_none());

    side.set_state(QpState::Err);
    vrdma_abi::fd::signal_eventfd(&*q.doorbell);
    let started = Instant::now();
    let ce = loop {
        if let Some(ce) = side.poll() {
            break ce;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "the SRQ's receive was never flushed");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!((ce.wr_id, ce.status, ce.flags & vrdma_abi::ring::COMP_FROM_SRQ != 0), (6, WcStatus::WrFlushErr as u8, true));

    let (at, n) = segs[1];
    handle_request(&t.e, &c, &c, &segment(request(Kind::Send, 0, 0), at, n, LEN), None, None, None).unwrap();
    t.e.reset_responder(QPN);
    assert!(side.poll().is_none(), "flushed once");
}

/// What `q`'s meter counts received of `op`: WRs and bytes.
fn received(q: &crate::engine::qp::MedQp, op: vrdma_abi::verbs::WrOpcode) -> (u64, u64) {
    let w = q.meter.read();
    let i = vrdma_abi::ring::METER_RX + vrdma_abi::ring::meter_opcode(op as u32);
    (w[i], w[i + 1])
}

/// Handles `h` (its data already written by the peer) on a thread of its own; whether it
/// returned within `within`.
fn handled_within(
    t: &crate::engine::testing::TestEngine,
    c: &std::sync::Arc<crate::engine::connection::Conn>,
    h: FrameHeader,
    within: std::time::Duration,
) -> bool {
    let (done, finished) = std::sync::mpsc::channel();
    let (e, c) = (t.e.clone(), c.clone());
    std::thread::spawn(move || {
        if let Ok(Some(q)) = handle_request(&e, &c, &c, &h, None, None, None) {
            send_owed_ack(&c, &q).unwrap();
        }
        let _ = done.send(());
    });
    finished.recv_timeout(within).is_ok()
}

/// A tenant whose copied MR (file-backed memory, reached through its `/proc/PID/mem`) does
/// not answer — it holds its memory-map lock, here the test's stall — holds back no other
/// tenant's requests on the connection they share: its WRITE is answered "not ready" after
/// a short wait and the reader goes on to the next request. Its resend, once its memory
/// answers, lands (the write that went on meanwhile collected, not done twice), and an
/// atomic answered "not ready" meanwhile is done once. Before, the reader waited in the
/// owner's memory for as long as it was held (a loop of `mprotect` over 2 GiB: 10 ms an
/// access at the median, 937 ms at worst), and every vNIC of the host with it.
#[test]
fn a_stalled_copied_mr_holds_back_no_other_qps_requests() {
    use std::time::Duration;
    const OWNER_QPN: u32 = 0x12;
    const OWNER_PEER: u32 = 0x23;
    const COPIED: u32 = 0x701;
    let t = engine();
    let victim_mr = t.broker.register_mr(KEY, ADDR, 8192, ALL);
    let mut copied = t.broker.register_copied_mr(COPIED, 8192, ALL);
    copied.set(64, &40u64.to_ne_bytes());
    let (mut peer, c) = connection();
    let (_victim, _vside) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let (_owner, _oside) = crate::engine::testing::mediated_qp_of(&t, OWNER_QPN, OWNER_PEER, &c, "owner");
    let owner_req = |kind, psn, len| {
        let mut h = request(kind, psn, len);
        (h.src_qpn, h.dst_qpn, h.rkey) = (OWNER_PEER, OWNER_QPN, COPIED);
        h
    };

    let stall = copied.mem.stall.write();
    let mut w = owner_req(Kind::Write, 0, 16);
    w.remote_addr = copied.addr;
    peer.write_all(b"sixteen bytes!!!").unwrap();
    assert!(handled_within(&t, &c, w, Duration::from_secs(3)), "the reader waited in the stalled owner's memory");
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.dst_qpn, nak.status), (OWNER_PEER, Nak::NotReady as u32));
    // The other tenant's WRITE goes through meanwhile.
    peer.write_all(b"victim").unwrap();
    assert!(handled_within(&t, &c, write_to(0, ADDR, 6), Duration::from_secs(3)));
    let (ack, _) = read_frame(&mut peer);
    assert_eq!((ack.dst_qpn, ack.kind, ack.status), (PEER_QPN, Kind::Ack, 0));
    assert_eq!(victim_mr.read(ADDR, 6), b"victim");
    // Still stalled: the resend is answered "not ready" again, at once.
    peer.write_all(b"sixteen bytes!!!").unwrap();
    assert!(handled_within(&t, &c, w, Duration::from_secs(3)));
    assert_eq!(read_frame(&mut peer).0.status, Nak::NotReady as u32);
    drop(stall);

    // Its memory answers: the resend lands.
    let started = std::time::Instant::now();
    loop {
        peer.write_all(b"sixteen bytes!!!").unwrap();
        assert!(handled_within(&t, &c, w, Duration::from_secs(3)));
        let (r, _) = read_frame(&mut peer);
        if r.status == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never answered: {r:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(&copied.bytes()[..16], b"sixteen bytes!!!");

    // An atomic that outlasts the wait goes on, and its resend collects it: done once.
    let stall = copied.mem.stall.write();
    let mut a = owner_req(Kind::AtomicReq, 1, 0);
    (a.remote_addr, a.arg1) = (copied.addr + 64, 2);
    assert!(handled_within(&t, &c, a, Duration::from_secs(3)));
    assert_eq!(read_frame(&mut peer).0.status, Nak::NotReady as u32);
    drop(stall);
    let started = std::time::Instant::now();
    let old = loop {
        assert!(handled_within(&t, &c, a, Duration::from_secs(3)));
        let (r, _) = read_frame(&mut peer);
        if r.kind == Kind::AtomicResp {
            break r.arg1;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never answered: {r:?}");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(old, 40);
    assert_eq!(copied.bytes()[64..72], 42u64.to_ne_bytes(), "added once");
}

/// A READ far larger than a segment, on a connection its QP shares with another tenant's QP
/// (as every QP without a lane shares its host's connection to the peer), is answered by
/// the connection's answerer a segment at a time: the reader goes on at once, and the other
/// QP's WRITE is executed and acknowledged after at most a few of its parts, not after all
/// of them. The READ's parts carry the MR's bytes, in order. Before, the reader sent all 24
/// MiB first (at the slow peer's pace: seconds; 2 GiB on a 10 Gbit/s link held every other
/// tenant's requests to that host for almost two seconds).
#[test]
fn a_large_read_lets_other_qps_requests_through() {
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    const LEN: usize = 24 << 20;
    const OTHER: u32 = 0x12;
    const OTHER_PEER: u32 = 0x23;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 241) as u8).collect();
    mr.write(ADDR, &data);
    let (peer, c) = connection();
    crate::engine::testing::small_buffers(std::os::fd::AsRawFd::as_raw_fd(&peer), libc::SO_RCVBUF);
    crate::engine::testing::small_buffers(std::os::fd::AsRawFd::as_raw_fd(&c.fd()), libc::SO_SNDBUF);
    let (_q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let (_other, _oside) = crate::engine::testing::mediated_qp_of(&t, OTHER, OTHER_PEER, &c, "other");
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));

    // The peer daemon's reader: slow (a far link) until the other QP's answer is in.
    let fast = std::sync::Arc::new(AtomicBool::new(false));
    let f = fast.clone();
    let mut rd = peer.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        rd.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let (mut got, mut other_after, mut last) = (Vec::new(), None, false);
        while !(last && other_after.is_some()) {
            let mut b = [0u8; wire::HEADER_LEN];
            rd.read_exact(&mut b).unwrap();
            let h = FrameHeader::decode(&b).unwrap();
            let mut d = vec![0u8; h.data_len as usize];
            for chunk in d.chunks_mut(64 << 10) {
                rd.read_exact(chunk).unwrap();
                if !f.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(4));
                }
            }
            if h.dst_qpn == OTHER_PEER {
                assert_eq!((h.kind, h.status), (Kind::Ack, 0));
                other_after = Some(got.len());
                f.store(true, Ordering::Relaxed);
            } else {
                assert_eq!((h.kind, h.psn, h.arg2), (Kind::ReadResp, 0, got.len() as u64), "parts in order");
                last = h.flags & wire::F_MORE == 0;
                got.extend_from_slice(&d);
            }
        }
        (got, other_after.unwrap())
    });

    let mut read = request(Kind::ReadReq, 0, 0);
    // (The READ leaves the MR's last page to the other QP's WRITE.)
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, (LEN - 4096) as u64);
    handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
    let mut w = write_to(0, ADDR + (LEN - 4096) as u64, 8);
    (w.src_qpn, w.dst_qpn) = (OTHER_PEER, OTHER);
    (&peer).write_all(b"8 bytes!").unwrap();
    if let Some(q) = handle_request(&t.e, &c, &c, &w, None, None, Some(&answers)).unwrap() {
        send_owed_ack(&c, &q).unwrap();
    }
    let (got, other_after) = reader.join().unwrap();
    assert!(other_after <= 2 << 20, "the other QP's WRITE waited behind {other_after} bytes of the READ");
    assert!(got[..] == data[..LEN - 4096], "the READ's bytes");
}

/// The answerer serves every QP of its connection, and a lane's server holds its QP's
/// responder lock while it reads a request's data at the pace the lane's client writes it
/// (minutes, for a large WRITE trickled to its deadline). Another QP's READ is answered
/// whole while one QP's lock is held, and the held QP's READ goes on once it is free.
/// Before, the answerer waited for that lock with every other READ behind it.
#[test]
fn a_qp_whose_responder_is_busy_holds_up_no_other_qps_read() {
    use std::sync::mpsc;
    use std::time::Duration;
    const LEN: usize = 8 << 20;
    const OTHER: u32 = 0x12;
    const OTHER_PEER: u32 = 0x23;
    const OTHER_LEN: usize = 1 << 20;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    mr.write(ADDR, &data);
    let (peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let (_other, _oside) = crate::engine::testing::mediated_qp_of(&t, OTHER, OTHER_PEER, &c, "other");
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));

    let (other_done, other_seen) = mpsc::channel();
    let mut rd = peer.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        rd.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let (mut held, mut other) = (Vec::new(), Vec::new());
        let (mut held_last, mut other_last) = (false, false);
        while !(held_last && other_last) {
            let (h, d) = read_frame(&mut rd);
            assert_eq!((h.kind, h.status), (Kind::ReadResp, 0));
            let last = h.flags & wire::F_MORE == 0;
            if h.dst_qpn == OTHER_PEER {
                assert_eq!(h.arg2, other.len() as u64, "parts in order");
                other.extend_from_slice(&d);
                other_last = last;
                if last {
                    other_done.send(()).unwrap();
                }
            } else {
                assert_eq!(h.arg2, held.len() as u64, "parts in order");
                held.extend_from_slice(&d);
                held_last = last;
            }
        }
        (held, other)
    });

    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, LEN as u64);
    handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
    let busy = q.resp.lock();
    let mut other_read = request(Kind::ReadReq, 0, 0);
    (other_read.dst_qpn, other_read.src_qpn, other_read.rkey, other_read.remote_addr, other_read.arg1) =
        (OTHER, OTHER_PEER, KEY, ADDR, OTHER_LEN as u64);
    handle_request(&t.e, &c, &c, &other_read, None, None, Some(&answers)).unwrap();
    let answered = other_seen.recv_timeout(Duration::from_secs(5));
    drop(busy);
    assert!(answered.is_ok(), "another QP's READ waited for a busy QP's responder lock");
    let (held, other) = reader.join().unwrap();
    assert!(held[..] == data[..], "the busy QP's READ, once free");
    assert!(other[..] == data[..OTHER_LEN], "the other QP's READ");
}

/// A large READ's parts are this host's egress, and the responding vNIC's: its cap holds
/// them as it holds the vNIC's WRITEs. A vNIC capped at 16 MiB/s answers a READ of 8 MiB
/// in about half a second, every byte in order, and nothing stays on the wire's account.
/// Before, the answerer sent the parts as fast as its socket took them (milliseconds),
/// whatever the cap, and beside another tenant's WRITEs from this host whatever its share.
#[test]
fn a_large_read_is_answered_within_the_responding_vnics_cap() {
    use std::collections::HashMap;
    use std::io::Read;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    use vrdma_abi::control::Qos;
    const LEN: usize = 8 << 20;
    const CAP: u64 = 16 << 20;
    let t = engine();
    let capped = Qos { max_bw: CAP, ..Qos::default() };
    t.e.set_qos(HashMap::from([("v".to_string(), ("t".to_string(), capped))]), HashMap::new());
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 239) as u8).collect();
    mr.write(ADDR, &data);
    let (peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let mut rd = peer.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        rd.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut got = Vec::new();
        loop {
            let mut b = [0u8; wire::HEADER_LEN];
            rd.read_exact(&mut b).unwrap();
            let h = FrameHeader::decode(&b).unwrap();
            assert_eq!((h.kind, h.status, h.arg2), (Kind::ReadResp, 0, got.len() as u64), "parts in order");
            let mut d = vec![0u8; h.data_len as usize];
            rd.read_exact(&mut d).unwrap();
            got.extend_from_slice(&d);
            if h.flags & wire::F_MORE == 0 {
                return got;
            }
        }
    });
    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, LEN as u64);
    let started = Instant::now();
    handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
    let got = reader.join().unwrap();
    let took = started.elapsed();
    assert!(got[..] == data[..], "the READ's bytes");
    let at_cap = Duration::from_secs_f64(LEN as f64 / CAP as f64);
    assert!(took >= at_cap.mul_f64(0.8), "8 MiB answered in {took:?} by a vNIC capped at 16 MiB/s");
    assert!(took <= at_cap * 4, "8 MiB answered in {took:?} at a cap of 16 MiB/s");
    let waited = Instant::now();
    while q.wire_bytes.load(Ordering::Relaxed) != 0 {
        assert!(waited.elapsed() < Duration::from_secs(2), "left on the wire's account: {}", q.wire_bytes.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// READs of a segment or less are the responding vNIC's egress too: while it is capped
/// (its policy set after its QP attached, live), 128 READs of 64 KiB one after the other
/// take about what 8 MiB take at its cap, and once the cap is lifted they are answered at
/// once again. Before, the reader answered every small READ itself, whatever the cap: a
/// peer reading 64 KiB at a time took the host's egress past it.
#[test]
fn small_reads_are_answered_within_the_responding_vnics_cap() {
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    use vrdma_abi::control::Qos;
    const READ: usize = 64 << 10;
    const READS: usize = 128;
    const CAP: u64 = 16 << 20;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, READS * READ, ALL);
    let data: Vec<u8> = (0..READS * READ).map(|i| (i % 233) as u8).collect();
    mr.write(ADDR, &data);
    let (mut peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let read_all = |peer: &mut std::net::TcpStream, first_psn: u32| {
        let started = Instant::now();
        for i in 0..READS {
            let mut read = request(Kind::ReadReq, first_psn + i as u32, 0);
            (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR + (i * READ) as u64, READ as u64);
            handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
            let (h, d) = read_frame(peer);
            assert_eq!((h.kind, h.status, h.psn, h.flags & wire::F_MORE), (Kind::ReadResp, 0, read.psn, 0));
            assert!(d[..] == data[i * READ..(i + 1) * READ], "READ {i}'s bytes");
        }
        started.elapsed()
    };

    let capped = Qos { max_bw: CAP, ..Qos::default() };
    t.e.set_qos(HashMap::from([("v".to_string(), ("t".to_string(), capped))]), HashMap::new());
    let took = read_all(&mut peer, 0);
    let at_cap = Duration::from_secs_f64((READS * READ) as f64 / CAP as f64);
    assert!(took >= at_cap.mul_f64(0.8), "8 MiB of 64 KiB READs answered in {took:?} by a vNIC capped at 16 MiB/s");
    assert!(took <= at_cap * 4, "8 MiB of 64 KiB READs answered in {took:?} at a cap of 16 MiB/s");
    let waited = Instant::now();
    while q.wire_bytes.load(Ordering::Relaxed) != 0 {
        assert!(waited.elapsed() < Duration::from_secs(2), "left on the wire's account: {}", q.wire_bytes.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(1));
    }

    t.e.set_qos(HashMap::from([("v".to_string(), ("t".to_string(), Qos::default()))]), HashMap::new());
    let took = read_all(&mut peer, READS as u32);
    assert!(took < at_cap / 2, "8 MiB of 64 KiB READs answered in {took:?} by a vNIC no longer capped");
}

/// A large READ's parts stay on their QP's wire account until TCP has them acknowledged,
/// as a WRITE's data stays until its peer acknowledges it: a requester that stops reading
/// leaves them there (its vNIC's share of the host's bounded wire is used up, nobody
/// else's), and once it reads them they leave. Before, they left the account when written
/// to the socket, whose buffer (megabytes) was then a queue outside the scheduler's bound.
#[test]
fn a_large_reads_parts_stay_on_the_wire_account_until_tcp_acknowledges_them() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    const LEN: usize = 4 << 20;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    mr.write(ADDR, &vec![7u8; LEN]);
    let (mut peer, c) = connection();
    crate::engine::testing::small_buffers(peer.as_raw_fd(), libc::SO_RCVBUF);
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, LEN as u64);
    handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
    // The requester reads nothing: TCP acknowledges what fits in its receive buffer, and
    // the rest (in our socket's buffer, or not yet written) stays on the account.
    std::thread::sleep(Duration::from_millis(300));
    let held = q.wire_bytes.load(Ordering::Relaxed);
    let mut delivered: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer, live for the call.
    assert_eq!(unsafe { libc::ioctl(peer.as_raw_fd(), libc::FIONREAD, &mut delivered) }, 0);
    assert!(
        held + delivered as u64 >= LEN as u64,
        "{held} bytes on the wire's account, {delivered} delivered: bytes the requester does not have left the account"
    );
    assert!(held <= LEN as u64);
    peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = 0usize;
    while got < LEN {
        let mut b = [0u8; wire::HEADER_LEN];
        peer.read_exact(&mut b).unwrap();
        let h = FrameHeader::decode(&b).unwrap();
        let mut d = vec![0u8; h.data_len as usize];
        peer.read_exact(&mut d).unwrap();
        got += d.len();
    }
    let waited = Instant::now();
    while q.wire_bytes.load(Ordering::Relaxed) != 0 {
        assert!(waited.elapsed() < Duration::from_secs(2), "left on the wire's account: {}", q.wire_bytes.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A large READ's parts leave the wire's account once TCP has them acknowledged, though
/// other threads keep writing on the same connection (the reader's answers to small READs
/// and its ACKs go there too): the first version counted only the answerer's own bytes
/// against what the socket held, and kept the parts on the account for as long as anyone
/// else's frames were queued, blocking the vNIC's WRITEs too.
#[test]
fn a_large_reads_parts_leave_the_wire_account_though_others_write_on_its_connection() {
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    const LEN: usize = 4 << 20;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    mr.write(ADDR, &vec![7u8; LEN]);
    let (peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (all_in, got_all) = std::sync::mpsc::channel();
    let mut rd = peer.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        rd.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut got = 0usize;
        // (Until the other writer stops: its frames keep coming.)
        loop {
            let mut b = [0u8; wire::HEADER_LEN];
            if rd.read_exact(&mut b).is_err() {
                return;
            }
            let h = FrameHeader::decode(&b).unwrap();
            let mut d = vec![0u8; h.data_len as usize];
            rd.read_exact(&mut d).unwrap();
            // (The other writer's frames answer another READ, PSN 99, and are read slowly:
            // the socket stays full of them.)
            if h.psn == 99 {
                std::thread::sleep(Duration::from_micros(300));
            }
            if h.kind == Kind::ReadResp && h.psn == 0 {
                got += d.len();
                if got == LEN {
                    all_in.send(()).unwrap();
                }
            }
        }
    });
    let (s, other_conn) = (stop.clone(), c.clone());
    let other = std::thread::spawn(move || {
        let mut h = super::reply(&request(Kind::ReadReq, 99, 0), Kind::ReadResp);
        h.data_len = 64 << 10;
        let data = vec![0u8; 64 << 10];
        while !s.load(Ordering::Relaxed) {
            other_conn.send(&h, &data).unwrap();
        }
    });
    let mut read = request(Kind::ReadReq, 0, 0);
    (read.rkey, read.remote_addr, read.arg1) = (KEY, ADDR, LEN as u64);
    handle_request(&t.e, &c, &c, &read, None, None, Some(&answers)).unwrap();
    got_all.recv_timeout(Duration::from_secs(20)).expect("the READ's parts never all came");
    let waited = Instant::now();
    let mut left = q.wire_bytes.load(Ordering::Relaxed);
    while left != 0 && waited.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
        left = q.wire_bytes.load(Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    other.join().unwrap();
    c.shutdown();
    reader.join().unwrap();
    assert_eq!(left, 0, "bytes of a READ its requester has were left on the wire's account");
}

/// A QP has at most as many large READs waiting for the answerer as a requester may have
/// outstanding (`qp::MAX_READS_PER_QP`); one more is answered "not ready", its PSN not
/// consumed (it comes again), and another QP's READ on the connection is still taken and
/// answered. Before, the answerer's jobs were one pool of 1024 per connection: a tenant
/// whose READs drain slowly (its vNIC capped) could fill it, and every other tenant's
/// large READs were then sent by the reader itself, holding all of that host's requests
/// behind each.
#[test]
fn a_qp_with_all_its_reads_waiting_is_answered_not_ready_and_others_still_answered() {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};
    use vrdma_abi::control::Qos;
    const LEN: usize = 1 << 20;
    const OTHER: u32 = 0x12;
    const OTHER_PEER: u32 = 0x23;
    let t = engine();
    let slow = Qos { max_bw: 1 << 20, ..Qos::default() };
    t.e.set_qos(HashMap::from([("v".to_string(), ("t".to_string(), slow))]), HashMap::new());
    let _mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    let (mut peer, c) = connection();
    let (_q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let (_other, _oside) = crate::engine::testing::mediated_qp_of(&t, OTHER, OTHER_PEER, &c, "other");
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let read = |psn: u32, src: u32, dst: u32| {
        let mut r = request(Kind::ReadReq, psn, 0);
        (r.rkey, r.remote_addr, r.arg1, r.src_qpn, r.dst_qpn) = (KEY, ADDR, LEN as u64, src, dst);
        r
    };
    let max = crate::engine::qp::MAX_READS_PER_QP as u32;
    for psn in 0..=max {
        handle_request(&t.e, &c, &c, &read(psn, PEER_QPN, QPN), None, None, Some(&answers)).unwrap();
    }
    let mut other_read = read(0, OTHER_PEER, OTHER);
    other_read.rkey = KEY;
    handle_request(&t.e, &c, &c, &other_read, None, None, Some(&answers)).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let (mut refused, mut other_got) = (None, 0usize);
    while refused.is_none() || other_got < LEN {
        assert!(started.elapsed() < Duration::from_secs(5), "refused {refused:?}, the other QP's READ {other_got} bytes");
        let (h, d) = read_frame(&mut peer);
        match (h.dst_qpn, h.kind) {
            (PEER_QPN, Kind::Ack) => refused = Some((h.psn, h.status)),
            (OTHER_PEER, Kind::ReadResp) => other_got += d.len(),
            (PEER_QPN, Kind::ReadResp) => assert!(h.psn < max, "a READ beyond the limit answered"),
            _ => panic!("unexpected {h:?}"),
        }
    }
    assert_eq!(refused, Some((max, Nak::NotReady as u32)), "the READ beyond the limit answered not ready");
}

/// A duplicate READ (its requester starts over from it, and drops what still comes for
/// the READs from there on) ends the READs at and after it that are still being answered:
/// requested again while all of a QP's slots were taken by the first answers, each is
/// taken, not answered "not ready". Before, the originals kept their slots until their
/// last part, and the duplicates were refused again and again (each refusal another
/// restart) until the requester gave up, the vNIC's budget spent on answers dropped on
/// arrival.
#[test]
fn duplicate_reads_replace_the_answers_they_start_over_from() {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};
    use vrdma_abi::control::Qos;
    const LEN: usize = 1 << 20;
    let t = engine();
    let slow = Qos { max_bw: 1 << 20, ..Qos::default() };
    t.e.set_qos(HashMap::from([("v".to_string(), ("t".to_string(), slow))]), HashMap::new());
    let _mr = t.broker.register_mr(KEY, ADDR, LEN, ALL);
    let (mut peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let answers = super::ReadAnswers::new(c.clone(), std::sync::Arc::downgrade(&t.e));
    let read = |psn: u32| {
        let mut r = request(Kind::ReadReq, psn, 0);
        (r.rkey, r.remote_addr, r.arg1) = (KEY, ADDR, LEN as u64);
        r
    };
    let max = crate::engine::qp::MAX_READS_PER_QP as u32;
    for psn in (0..max).chain(3..max) {
        handle_request(&t.e, &c, &c, &read(psn), None, None, Some(&answers)).unwrap();
    }
    peer.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        let mut b = [0u8; wire::HEADER_LEN];
        if std::io::Read::read_exact(&mut peer, &mut b).is_err() {
            continue;
        }
        let h = FrameHeader::decode(&b).unwrap();
        let mut d = vec![0u8; h.data_len as usize];
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        std::io::Read::read_exact(&mut peer, &mut d).unwrap();
        peer.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        assert_ne!(h.kind, Kind::Ack, "a duplicate READ refused: {h:?}");
    }
    assert!(q.reads.wanting() || q.wire_bytes.load(std::sync::atomic::Ordering::Relaxed) > 0, "the READs still answered");
}

/// A WRITE and a SEND in segments whose memory (a copied MR: here the test's stall) stops
/// answering at a later segment are answered "not ready" there, with where they stopped
/// (`arg2`); the segments under way after it are dropped unanswered, and the resend from
/// that segment (`wire::F_RESUME`) continues them: each completes once, with its whole
/// length and every byte, counted once. A resumed segment that continues nothing here
/// (elsewhere in the message) is answered "not ready" from the start. Before, the message
/// could only come again from its first segment, and one whose memory stalled now and then
/// started over at every stall.
#[test]
fn a_message_stopped_at_a_segment_by_stalled_memory_resumes_there() {
    use std::time::{Duration, Instant};
    use vrdma_abi::verbs::WrOpcode;
    const COPIED: u32 = 0x701;
    const LEN: usize = 600_000;
    let t = engine();
    let copied = t.broker.register_copied_mr(COPIED, 2 << 20, ALL);
    let (mut peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(7, &[Sge { addr: copied.addr + (1 << 20), length: LEN as u32, lkey: COPIED }]);
    let segs = segments_of(LEN);
    let (stop, stopped_at) = (segs[1], segs[1].0 as u64);

    for (psn, kind) in [(0, Kind::Write), (1, Kind::Send)] {
        let data: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8 ^ psn as u8).collect();
        let mut base = request(kind, psn, 0);
        (base.rkey, base.remote_addr) = (COPIED, copied.addr + 100);
        let seg = |(at, n): (usize, usize)| segment(base, at, n, LEN);
        let send = |peer: &mut std::net::TcpStream, h: FrameHeader, at: usize| {
            peer.write_all(&data[at..at + h.data_len as usize]).unwrap();
            assert!(handled_within(&t, &c, h, Duration::from_secs(3)), "the reader waited in the stalled memory");
        };
        // Delivers segment `s` (resumed, or after a "not ready" of its own) until it is
        // taken (its memory may be slow to answer the first time, or still finishing the
        // write that went on): its answer, if any.
        let deliver = |peer: &mut std::net::TcpStream, s: (usize, usize), mut resume: bool| {
            let started = Instant::now();
            loop {
                let mut h = seg(s);
                if resume {
                    h.flags |= wire::F_RESUME;
                }
                send(peer, h, s.0);
                if nothing_sent(peer) {
                    return None;
                }
                let (a, _) = read_frame(peer);
                if a.status != Nak::NotReady as u32 {
                    return Some(a);
                }
                assert_eq!(a.arg2, s.0 as u64, "not ready where it stopped");
                assert!(started.elapsed() < Duration::from_secs(5), "never taken");
                resume = s.0 > 0;
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        assert!(deliver(&mut peer, segs[0], false).is_none());
        let stall = copied.mem.stall.write();
        send(&mut peer, seg(stop), stop.0);
        let (nak, _) = read_frame(&mut peer);
        assert_eq!((nak.psn, nak.status, nak.arg2), (psn, Nak::NotReady as u32, stopped_at), "{kind:?} stopped at its second segment");
        // Its last segment, under way: dropped.
        send(&mut peer, seg(segs[2]), segs[2].0);
        assert!(nothing_sent(&peer));
        drop(stall);
        // The resend from where it stopped.
        assert!(deliver(&mut peer, stop, true).is_none());
        let ack = deliver(&mut peer, segs[2], false).expect("an answer");
        assert_eq!((ack.kind, ack.psn, ack.status), (Kind::Ack, psn, 0), "{kind:?} acknowledged");
        let at = if kind == Kind::Write { 100 } else { 1 << 20 };
        assert!(copied.bytes()[at..at + LEN] == data[..], "{kind:?}: every byte");
        let op = if kind == Kind::Write { WrOpcode::RdmaWrite } else { WrOpcode::Send };
        assert_eq!(received(&q, op), (1, LEN as u64), "{kind:?} counted once");
    }
    let ce = side.poll().expect("the SEND's receive completes");
    assert_eq!((ce.wr_id, ce.status, ce.byte_len), (7, 0, LEN as u32));
    assert!(side.poll().is_none(), "once");

    // A resumed segment elsewhere than where its message stopped: from the start, and
    // what its earlier segments counted goes (the whole message counts once, when it comes).
    let data = vec![5u8; LEN];
    let mut base = request(Kind::Write, 2, 0);
    (base.rkey, base.remote_addr) = (COPIED, copied.addr);
    let send = |peer: &mut std::net::TcpStream, h: FrameHeader| {
        peer.write_all(&data[..h.data_len as usize]).unwrap();
        assert!(handled_within(&t, &c, h, Duration::from_secs(3)));
    };
    let started = Instant::now();
    loop {
        send(&mut peer, segment(base, 0, segs[0].1, LEN));
        if nothing_sent(&peer) {
            break;
        }
        read_frame(&mut peer);
        assert!(started.elapsed() < Duration::from_secs(5), "never taken");
    }
    let stall = copied.mem.stall.write();
    send(&mut peer, segment(base, stop.0, stop.1, LEN));
    assert_eq!(read_frame(&mut peer).0.arg2, stopped_at);
    drop(stall);
    let mut h = segment(base, segs[2].0, segs[2].1, LEN);
    h.flags |= wire::F_RESUME;
    send(&mut peer, h);
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.psn, nak.status, nak.arg2), (2, Nak::NotReady as u32, 0));
    let started = Instant::now();
    'whole: loop {
        for &(at, n) in &segs {
            send(&mut peer, segment(base, at, n, LEN));
            if !nothing_sent(&peer) {
                let (a, _) = read_frame(&mut peer);
                if a.status == 0 {
                    break 'whole;
                }
                assert!(started.elapsed() < Duration::from_secs(5), "never taken");
                std::thread::sleep(Duration::from_millis(1));
                continue 'whole;
            }
        }
    }
    assert_eq!(received(&q, WrOpcode::RdmaWrite), (2, 2 * LEN as u64), "each WRITE counted once");
}

/// A READ asked again for the rest of its response (`wire::F_RESUME`, `arg2`: where; its
/// requester stored the parts before) is answered from there, each part at its offset in
/// the READ with its bytes, whether the first answer stopped before its end (memory that
/// did not answer: the PSN not consumed) or went whole (a duplicate): its rights are
/// checked on the whole READ. An offset beyond the READ asks for all of it. Before, every
/// answer began at the start.
#[test]
fn a_read_resumed_is_answered_from_where_it_asks() {
    const LEN: usize = 600_000;
    let t = engine();
    let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let data: Vec<u8> = (0..LEN).map(|i| (i % 247) as u8).collect();
    mr.write(ADDR, &data);
    let (mut peer, c) = connection();
    let (q, _side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    let seg = wire::SEGMENT as usize;
    let read = |from: Option<u64>| {
        let mut h = request(Kind::ReadReq, 0, 0);
        (h.rkey, h.remote_addr, h.arg1) = (KEY, ADDR, LEN as u64);
        if let Some(from) = from {
            h.flags |= wire::F_RESUME;
            h.arg2 = from;
        }
        h
    };
    // The answer's parts, until its last.
    let answer = |peer: &mut std::net::TcpStream| {
        let mut parts = Vec::new();
        loop {
            let (h, bytes) = read_frame(peer);
            assert_eq!((h.kind, h.status), (Kind::ReadResp, 0));
            let at = h.arg2 as usize;
            assert!(bytes[..] == data[at..at + bytes.len()], "the part at {at}: its bytes");
            parts.push(at);
            if h.flags & wire::F_MORE == 0 {
                assert_eq!(at + bytes.len(), LEN, "to the READ's end");
                return parts;
            }
        }
    };
    let from = |at: usize| (at..LEN).step_by(seg).collect::<Vec<_>>();
    for (h, first) in [(read(Some(seg as u64 + 10)), seg + 10), (read(Some(seg as u64)), seg), (read(Some(LEN as u64)), 0), (read(None), 0)]
    {
        let w = std::thread::spawn({
            let (e, c) = (t.e.clone(), c.clone());
            move || handle_request(&e, &c, &c, &h, None, None, None).unwrap()
        });
        assert_eq!(answer(&mut peer), from(first), "asked from {}", h.arg2);
        w.join().unwrap();
        assert_eq!(q.resp.lock().expected_psn, 1, "executed once");
    }
    // Rights on the whole READ: one beyond the MR, resumed inside it, is refused.
    let mut beyond = read(Some(seg as u64));
    beyond.remote_addr = ADDR + (1 << 20) - seg as u64;
    handle_request(&t.e, &c, &c, &beyond, None, None, None).unwrap();
    let (nak, _) = read_frame(&mut peer);
    assert_eq!((nak.kind, nak.status), (Kind::ReadResp, Nak::RemoteAccess as u32));
}

/// A requester that resumes a SEND where it never stopped, again and again (a hostile lane
/// client writes any frame), has it dropped and counted once as not received: the meter
/// comes back to nothing, never below (it is kept at its highest, so a wrapped word would
/// stick). Before, each such segment took the WR back again, and the counter wrapped.
#[test]
fn a_requester_resuming_where_nothing_stopped_never_wraps_the_meter() {
    use vrdma_abi::verbs::WrOpcode;
    const LEN: usize = 600_000;
    let t = engine();
    let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, ALL);
    let (peer, c) = connection();
    let (q, side) = mediated_qp(&t, QPN, PEER_QPN, &c);
    side.post_recv(3, &[Sge { addr: ADDR, length: LEN as u32, lkey: KEY }]);
    let segs = segments_of(LEN);
    let mut resumed = segment(request(Kind::Send, 0, 0), segs[1].0, segs[1].1, LEN);
    resumed.flags |= wire::F_RESUME;
    resumed.arg2 += 1; // not where it stands
    let w = peer_writes(peer, vec![1u8; segs[0].1 + 3 * segs[1].1]);
    handle_request(&t.e, &c, &c, &segment(request(Kind::Send, 0, 0), 0, segs[0].1, LEN), None, None, None).unwrap();
    for _ in 0..3 {
        handle_request(&t.e, &c, &c, &resumed, None, None, None).unwrap();
    }
    let mut peer = w.join().unwrap();
    for _ in 0..3 {
        let (nak, _) = read_frame(&mut peer);
        assert_eq!((nak.status, nak.arg2), (Nak::NotReady as u32, 0), "from its start");
    }
    assert_eq!(received(&q, WrOpcode::Send), (0, 0), "nothing counted, nothing wrapped");
    assert!(side.poll().is_none(), "its receive kept for the message");
}
