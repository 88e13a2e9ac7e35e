//! Stateful fuzzing of the responder: sequences of requests that a hostile peer sends to one
//! of our QPs once its connection is up — a peer daemon on its connection, or a client on
//! the lane it holds (which may write any frame) — interleaved with the receives our QP's
//! own client posts. The input picks every field: kind, PSN (around the expected one), key,
//! address (around and across the MRs' bounds), length, immediate and atomic operands,
//! segment flags of WRITEs and SENDs (first, middle, last, in any order), and where the
//! scatter lists of the receives point.
//!
//! Four MRs of the QP's PD, side by side in its address space: `A` grants everything, `B`
//! only REMOTE_READ, `C` only LOCAL_WRITE (where receives land), `D` nothing (a secret);
//! and `E`, granting everything, elsewhere, reached as memory that cannot be shared is
//! (through the process's `/proc/PID/mem`, on its agent), whose owner the input can have
//! start and end moving it (its writes and atomics do not answer) or, in tests and fuzzing
//! builds, hold its memory-map lock (none of its accesses answers): the requests, segments
//! and READ parts that need them are answered "not ready" and resumed (`wire::F_RESUME`).
//! Properties checked after every request (panics if not):
//! - nothing panics, and every request returns (its data is there or the stream ended);
//! - `B` and `D` never change; `A` changes only inside a WRITE's or an atomic's target
//!   naming `A`, or inside a posted receive's scatter list for a SEND or WRITE_WITH_IMM;
//!   `C` only inside a posted receive's scatter list;
//! - every answer is a well-formed frame of an answer kind, at most one per request; a
//!   READ response comes only for a READ naming `A`, `B` or `E` inside its bounds, and
//!   carries exactly that MR's bytes (`E`'s, which writes that did not answer in time may
//!   still change, only its range); an atomic response only for an atomic naming `A` or `E`;
//! - a receive completes at most once.

// (A fuzz harness: a failed step is a finding, reported by its panic.)
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use vrdma_abi::ring::Sge;
use vrdma_abi::verbs::access;
use vrdma_abi::wire::{self, FrameHeader, Kind, HEADER_LEN};

use super::handle_request;
use crate::engine::testing::{connection, engine, mediated_qp, TestEngine, TestMr};
use crate::fuzz_choices::Choices;

/// The engine every input's QP lives in (started once: an engine per input would spend the
/// fuzzer's time starting threads).
static HARNESS: OnceLock<TestEngine> = OnceLock::new();
/// `E`'s memory and the access to it (for the process's life: the agent may write it after
/// an input ends, as a write that did not answer in time goes on).
static COPIED: OnceLock<(u64, Arc<crate::procmem::ProcMem>)> = OnceLock::new();
/// `E`'s length.
const COPIED_LEN: usize = 8192;
/// QPNs and keys: fresh for every input (its MRs are forgotten at its end).
static NEXT: AtomicU32 = AtomicU32::new(0x100);

const BASE: u64 = 0x40_0000;
/// (offset from BASE, length, access, fill byte) of A, B, C, D.
const MRS: [(u64, usize, u32, u8); 4] = [
    (0, 8192, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC, 0x00),
    (8192, 4096, access::REMOTE_READ, 0xbb),
    (12288, 8192, access::LOCAL_WRITE, 0x00),
    (20480, 4096, 0, 0xee),
];
const END: u64 = BASE + 24576;
/// Requests per input at most.
const MAX_STEPS: usize = 64;

/// The choices of requests' fields.
trait RequestChoices {
    /// One of the five MRs' keys (index 0..5, `E` last), or a key of nobody's.
    fn key(&mut self, keys: &[u32; 5]) -> Option<(Option<usize>, u32)>;
    /// An address near or inside the MRs: an MR's start (`E`'s at `copied`) plus a small
    /// signed offset, or anything.
    fn addr(&mut self, copied: u64) -> Option<u64>;
}

impl RequestChoices for Choices<'_> {
    fn key(&mut self, keys: &[u32; 5]) -> Option<(Option<usize>, u32)> {
        let b = self.byte()?;
        Some(match b % 7 {
            i @ 0..=4 => (Some(usize::from(i)), keys[usize::from(i)]),
            5 => (None, keys[0] ^ 0x8000_0000),
            // (A bit no input's keys have.)
            _ => (None, 0x4000_0000 | u32::from(b) << 8),
        })
    }
    fn addr(&mut self, copied: u64) -> Option<u64> {
        let b = self.byte()?;
        let off = i64::from(self.u16()? as i16);
        Some(match b % 9 {
            i @ 0..=3 => (BASE + MRS[usize::from(i)].0).wrapping_add_signed(off),
            4 => END.wrapping_add_signed(off),
            5 => u64::MAX - u64::from(self.u16()?),
            8 => copied.wrapping_add_signed(off / 4),
            _ => BASE.wrapping_add_signed(off * 8),
        })
    }
}

/// The MRs' bytes, A to D.
fn snapshot(mrs: &[TestMr]) -> Vec<Vec<u8>> {
    mrs.iter().zip(MRS).map(|(m, (off, len, _, _))| m.read(BASE + off, len)).collect()
}

/// Panics unless every byte that differs between `before` and `after` lies in one of the
/// `allowed` address ranges.
fn only_changed_within(before: &[Vec<u8>], after: &[Vec<u8>], allowed: &[(u64, u64)], what: &str) {
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        for (at, (x, y)) in b.iter().zip(a).enumerate() {
            if x != y {
                let addr = BASE + MRS[i].0 + at as u64;
                assert!(
                    allowed.iter().any(|&(s, l)| addr >= s && addr - s < l),
                    "{what}: MR {} changed at {addr:#x} (allowed: {allowed:x?})",
                    ["A", "B", "C", "D"][i]
                );
            }
        }
    }
}

/// The answer frames waiting at the peer's end of the answers' connection.
fn answers(peer: &mut std::net::TcpStream, pending: &mut Vec<u8>) -> Vec<(FrameHeader, Vec<u8>)> {
    // (Not waiting: a request may well have no answer. The file may be the requests' too,
    // which are written blocking: back to blocking after.)
    peer.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 65536];
    loop {
        match peer.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("reading answers: {e}"),
        }
    }
    peer.set_nonblocking(false).expect("blocking");
    let mut out = Vec::new();
    while pending.len() >= HEADER_LEN {
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&pending[..HEADER_LEN]);
        let h = FrameHeader::decode(&hb).unwrap_or_else(|e| panic!("an answer that is no frame: {e}"));
        let len = h.data_len as usize;
        if pending.len() < HEADER_LEN + len {
            // (A large READ response still on its way: wait for the rest.)
            let mut rest = vec![0u8; HEADER_LEN + len - pending.len()];
            peer.read_exact(&mut rest).expect("the rest of an answer");
            pending.extend_from_slice(&rest);
        }
        let data = pending[HEADER_LEN..HEADER_LEN + len].to_vec();
        pending.drain(..HEADER_LEN + len);
        out.push((h, data));
    }
    out
}

/// Runs one input (see the module's comment). Panics on a broken property.
pub fn fuzz_responder(data: &[u8]) {
    let t = HARNESS.get_or_init(engine);
    let mut ch = Choices(data);
    let Some(setup) = ch.byte() else { return };
    let lane = setup & 1 != 0;
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let (qpn, peer_qpn) = (n * 2, n * 2 + 1);
    let keys: [u32; 5] = std::array::from_fn(|i| (n << 4) | i as u32);
    let mrs: Vec<TestMr> = MRS
        .iter()
        .zip(keys)
        .map(|(&(off, len, acc, fill), key)| {
            let m = t.broker.register_mr(key, BASE + off, len, acc);
            m.write(BASE + off, &vec![fill; len]);
            m
        })
        .collect();
    let (e_addr, mem) = COPIED.get_or_init(|| {
        // (Never freed, and reached only by its address: the kernel writes it. u64s: atomics
        // need 8-byte alignment.)
        let addr = Box::into_raw(vec![0u64; COPIED_LEN / 8].into_boxed_slice()) as *mut u64 as u64;
        (addr, Arc::new(crate::procmem::ProcMem::open(std::process::id() as i32).expect("/proc/self/mem")))
    });
    let e_addr = *e_addr;
    t.broker.register_copied_mr_at(keys[4], e_addr, COPIED_LEN, MRS[0].2, mem);
    let mut moving = false;
    #[cfg(any(test, fuzzing))]
    let mut stalled = None;
    let (mut peer, c) = connection();
    let (mut answers_peer, out) = if lane { connection() } else { (peer.try_clone().expect("clone"), c.clone()) };
    let (q, side) = mediated_qp(t, qpn, peer_qpn, &out);
    let licence = AtomicBool::new(true);
    let lane_key = lane.then_some([7u64, 9]);

    let mut receives: Vec<(u64, u64)> = Vec::new();
    let (mut posted, mut completed) = (0u64, std::collections::HashSet::new());
    let mut pending = Vec::new();
    let mut pattern = 0x10u8;
    for _ in 0..MAX_STEPS {
        let Some(op) = ch.byte() else { break };
        if op % 8 == 0 && op & 0x80 != 0 {
            // The peer reconnects: a new PSN sequence, and a QP an error ended lives again.
            t.e.reset_responder(qpn);
            continue;
        }
        if op % 8 == 0 && op & 0x40 != 0 {
            if op & 0x20 != 0 {
                // E's owner takes its memory-map lock, or lets it go.
                #[cfg(any(test, fuzzing))]
                {
                    stalled = match stalled.take() {
                        Some(guard) => {
                            drop(guard);
                            None
                        }
                        None => Some(mem.stall.write()),
                    };
                }
                continue;
            }
            // E's owner starts moving it (its writes and atomics wait), or ends the move.
            if moving {
                mem.end_move(e_addr, COPIED_LEN as u64);
            }
            moving = !moving && mem.begin_move(e_addr, COPIED_LEN as u64);
            continue;
        }
        if op % 8 == 0 {
            // Our client posts a receive: one or two scatter entries, mostly into C.
            let mut sges = Vec::new();
            for _ in 0..1 + usize::from(op & 0x10 != 0) {
                let (Some((_, lkey)), Some(addr), Some(len)) = (ch.key(&keys), ch.addr(e_addr), ch.u16()) else { break };
                let lkey = if op & 0x20 == 0 { keys[2] } else { lkey };
                sges.push(Sge { addr, length: u32::from(len), lkey });
                receives.push((addr, u64::from(len)));
            }
            if !sges.is_empty() {
                posted += 1;
                side.try_post_recv(posted, &sges);
            }
            continue;
        }
        let kind =
            [Kind::Write, Kind::Send, Kind::ReadReq, Kind::AtomicReq, Kind::Write, Kind::Send, Kind::ReadReq][usize::from(op % 8) - 1];
        let (Some((named, rkey)), Some(addr), Some(len), Some(psn_delta)) = (ch.key(&keys), ch.addr(e_addr), ch.u16(), ch.byte()) else {
            break;
        };
        let mut h = FrameHeader::new(kind);
        (h.src_qpn, h.dst_qpn) = (peer_qpn, qpn);
        let expected = q.resp.lock().expected_psn;
        h.psn = match psn_delta {
            0..=191 => expected,
            d => expected.wrapping_add_signed(i32::from(d as i8)),
        };
        (h.rkey, h.remote_addr) = (rkey, addr);
        if op & 0x08 != 0 {
            // ACKs of our QP's own requests riding on it (it has none outstanding).
            h.flags |= wire::F_ACKS;
            h.status = u32::from(psn_delta);
        }
        if op & 0x40 != 0 && matches!(kind, Kind::Write | Kind::Send) {
            h.flags |= wire::F_IMM;
            h.imm = u32::from(op);
        }
        if op & 0x10 != 0 && matches!(kind, Kind::Write | Kind::Send) {
            // A segment of a larger message: first, middle or last, in order or not; a later
            // one where the message stands or elsewhere, resumed (after "not ready") or not.
            let Some(seg) = ch.byte() else { break };
            h.flags |= [0, wire::F_MORE, wire::F_MORE | wire::F_CONT, wire::F_CONT][usize::from(seg % 4)];
            if h.flags & wire::F_CONT != 0 {
                let done = q.resp.lock().partial.as_ref().map_or(0, |p| p.done);
                h.arg2 = if seg & 0x80 == 0 { done } else { done.wrapping_add(u64::from(seg & 0x3c)) };
                if seg & 0x40 != 0 {
                    h.flags |= wire::F_RESUME;
                }
            }
        }
        let mut payload = Vec::new();
        match kind {
            Kind::Write | Kind::Send => {
                h.data_len = u32::from(len);
                pattern = if pattern >= 0x90 { 0x10 } else { pattern + 1 };
                payload = vec![pattern; usize::from(len)];
            }
            Kind::ReadReq => {
                h.arg1 = if op & 0x80 != 0 { u64::from(len) << 16 } else { u64::from(len) };
                if op & 0x10 != 0 {
                    // Asked again for the rest of its response, from anywhere.
                    let Some(from) = ch.u16() else { break };
                    h.flags |= wire::F_RESUME;
                    h.arg2 = u64::from(from);
                }
            }
            _ => {
                let (Some(a1), Some(a2)) = (ch.u64(), ch.u64()) else { break };
                (h.arg1, h.arg2) = (a1, a2);
                if op & 0x40 != 0 {
                    h.flags |= wire::F_CMP_SWAP;
                }
            }
        }
        // The last request may be cut short: its data ends with the stream.
        let cut = ch.is_empty() && !payload.is_empty() && op & 0x20 != 0;
        if cut {
            payload.truncate(payload.len() / 2);
        }
        if peer.write_all(&payload).is_err() {
            break;
        }
        if cut {
            let _ = peer.shutdown(Shutdown::Write);
        }
        let before = snapshot(&mrs);
        let handled = handle_request(&t.e, &c, &out, &h, Some(&licence).filter(|_| lane), lane_key, None);
        let after = snapshot(&mrs);

        // Memory: only where this request may write.
        let mut allowed: Vec<(u64, u64)> = Vec::new();
        if named == Some(0) {
            match kind {
                Kind::Write => allowed.push((addr, u64::from(len))),
                Kind::AtomicReq => allowed.push((addr, 8)),
                _ => {}
            }
        }
        if h.flags & wire::F_IMM != 0 || kind == Kind::Send {
            allowed.extend(receives.iter().copied());
        }
        only_changed_within(&before, &after, &allowed, &format!("{kind:?} key {rkey:#x} at {addr:#x} len {len}"));
        assert_eq!(after[1], before[1], "B (REMOTE_READ only) changed");
        assert_eq!(after[3], before[3], "D (no rights) changed");

        // Answers: at most one to this request, of an answer kind, and READ/atomic answers
        // only where due. (An ACK deferred earlier may come too, from another engine thread.)
        let got = answers(&mut answers_peer, &mut pending);
        let to_this = got.iter().filter(|(a, _)| a.psn == h.psn).count();
        assert!(to_this <= 1, "{to_this} answers to one request: {:?}", got.iter().map(|(h, _)| h.kind).collect::<Vec<_>>());
        for (a, bytes) in &got {
            assert_eq!((a.dst_qpn, a.src_qpn), (peer_qpn, qpn), "an answer of another QP");
            assert!(a.psn == h.psn || a.kind == Kind::Ack, "a {:?} for PSN {} answering PSN {}", a.kind, a.psn, h.psn);
            match a.kind {
                Kind::Ack => {}
                Kind::ReadResp if a.status == 0 => {
                    assert_eq!(kind, Kind::ReadReq, "a READ response to a {kind:?}");
                    if h.arg1 == 0 {
                        assert!(bytes.is_empty());
                        continue;
                    }
                    let i = named.filter(|&i| i <= 1 || i == 4).unwrap_or_else(|| panic!("READ of key {rkey:#x} answered with data"));
                    let (start, mlen) = if i == 4 { (e_addr, COPIED_LEN) } else { (BASE + MRS[i].0, MRS[i].1) };
                    assert!(addr >= start && addr - start + h.arg1 <= mlen as u64, "READ beyond the MR answered");
                    // (From where a resumed READ asks, to its end: its MRs are smaller than a part.)
                    let from = if h.flags & wire::F_RESUME != 0 && h.arg2 < h.arg1 { h.arg2 } else { 0 };
                    assert_eq!((a.arg2, a.arg2 + bytes.len() as u64), (from, h.arg1), "READ response's range");
                    if i != 4 {
                        let at = (addr - start + from) as usize;
                        assert_eq!(bytes.as_slice(), &after[i][at..at + bytes.len()], "READ response bytes");
                    }
                }
                Kind::AtomicResp if a.status == 0 => {
                    assert!(kind == Kind::AtomicReq && matches!(named, Some(0 | 4)), "an atomic response to {kind:?} of key {rkey:#x}");
                }
                Kind::ReadResp | Kind::AtomicResp => {}
                other => panic!("answer of kind {other:?}"),
            }
        }
        while let Some(ce) = side.poll() {
            assert!(completed.insert(ce.wr_id), "receive {} completed twice", ce.wr_id);
        }
        if handled.is_err() || cut {
            break;
        }
    }
    if moving {
        mem.end_move(e_addr, COPIED_LEN as u64);
    }
    #[cfg(any(test, fuzzing))]
    drop(stalled);

    drop(side);
    t.e.detach(qpn);
    for key in keys {
        t.e.forget_mr(key);
    }
    // Closed without TIME_WAIT: thousands of inputs a second would use up the loopback's
    // ports.
    for fd in [peer.as_raw_fd(), answers_peer.as_raw_fd(), c.raw_fd(), out.raw_fd()] {
        abort_on_close(fd);
    }
    c.shutdown();
    out.shutdown();
}

/// Makes the last `close` of socket `fd` reset the connection (`SO_LINGER` 0).
fn abort_on_close(fd: RawFd) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt reads `l`, live and of the size given, for the call.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, std::ptr::addr_of!(l).cast(), std::mem::size_of_val(&l) as libc::socklen_t)
    };
}

/// Builds an input (see `fuzz_responder` for how it is read).
struct Input(Vec<u8>);

impl Input {
    fn lane(lane: bool) -> Input {
        Input(vec![u8::from(lane)])
    }
    /// Key of MR `key` (0-4 A-E, 5-6 nobody's), address `off` from the start of MR `mr`
    /// (0-3 A-D, 8 E).
    fn target(&mut self, key: u8, mr: u8, off: i16) {
        self.0.push(key);
        self.0.push(mr);
        self.0.extend_from_slice(&off.to_le_bytes());
    }
    fn recv(mut self, mr: u8, off: i16, len: u16) -> Self {
        self.0.push(0);
        self.target(2, mr, off);
        self.0.extend_from_slice(&len.to_le_bytes());
        self
    }
    /// op 1 WRITE, 2 SEND, 3 READ (its length `len`); the expected PSN.
    fn req(mut self, op: u8, key: u8, mr: u8, off: i16, len: u16) -> Self {
        self.0.push(op);
        self.target(key, mr, off);
        self.0.extend_from_slice(&len.to_le_bytes());
        self.0.push(0);
        self
    }
    /// As [`Input::req`], a segment of a WRITE or SEND: `which` 1 first, 2 middle, 3 last.
    fn seg(mut self, op: u8, key: u8, mr: u8, off: i16, len: u16, which: u8) -> Self {
        self = self.req(op | 0x10, key, mr, off, len);
        self.0.push(which);
        self
    }
    fn atomic(mut self, key: u8, mr: u8, off: i16, add: u64) -> Self {
        self.0.push(4);
        self.target(key, mr, off);
        self.0.extend_from_slice(&[0, 0, 0]);
        self.0.extend_from_slice(&add.to_le_bytes());
        self.0.extend_from_slice(&0u64.to_le_bytes());
        self
    }
    /// A READ asked again from its byte `from` (`wire::F_RESUME`).
    fn resumed_read(mut self, key: u8, mr: u8, off: i16, len: u16, from: u16) -> Self {
        self = self.req(3 | 0x10, key, mr, off, len);
        self.0.extend_from_slice(&from.to_le_bytes());
        self
    }
    fn reset(mut self) -> Self {
        self.0.push(0x80);
        self
    }
    /// E's owner starts moving it, or ends the move.
    fn toggle_move(mut self) -> Self {
        self.0.push(0x40);
        self
    }
    /// E's owner takes its memory-map lock, or lets it go.
    fn toggle_stall(mut self) -> Self {
        self.0.push(0x60);
        self
    }
}

/// Every right and refusal once, each after a reconnection (an error ends the QP), on a
/// peer's connection and on a lane: the fuzz target's seeds.
pub fn responder_seeds() -> Vec<Vec<u8>> {
    [false, true]
        .map(|lane| {
            Input::lane(lane)
                .recv(2, 0, 64)
                .req(2, 0, 0, 0, 16) // SEND into C
                .req(1, 0, 0, 100, 32) // WRITE A
                .req(3, 1, 1, 8, 64) // READ B
                .req(3, 0, 0, 90, 64) // READ A
                .atomic(0, 0, 64, 5) // on A
                .req(1, 1, 1, 0, 16) // WRITE B: refused
                .reset()
                .req(3, 3, 3, 0, 8) // READ D: refused
                .reset()
                .req(3, 2, 2, 0, 8) // READ C: refused
                .reset()
                .req(1, 0, 0, 8184, 16) // WRITE across A's end: refused
                .reset()
                .atomic(1, 1, 0, 1) // atomic on B: refused
                .reset()
                .recv(1, 0, 64) // a receive into B
                .req(2, 0, 0, 0, 16) // SEND: a local protection error, B untouched
                .reset()
                .req(3, 0, 0, 0, 8)
                .req(2, 0, 0, 0, 300) // no receive: RNR
                .reset()
                .recv(2, 0, 200)
                .seg(2, 0, 0, 0, 50, 1) // a SEND in three segments into C
                .seg(2, 0, 0, 0, 50, 2)
                .seg(2, 0, 0, 0, 50, 3)
                .seg(1, 0, 0, 100, 40, 1) // a WRITE in two into A
                .seg(1, 0, 0, 140, 40, 3)
                .seg(1, 0, 0, 0, 40, 3) // a later segment of nothing: dropped
                .seg(1, 0, 0, 0, 40, 0x43) // resumed, with nothing to resume: not ready
                .seg(1, 1, 1, 0, 16, 1) // a first segment into B: refused
                .reset()
                .seg(1, 4, 8, 0, 40, 1) // a WRITE in three into E
                .toggle_move() // (E's accesses do not answer)
                .seg(1, 4, 8, 40, 40, 2) // not ready, resumable where it stopped
                .seg(1, 4, 8, 80, 40, 3) // under way: dropped
                .toggle_move()
                .seg(1, 4, 8, 40, 40, 0x42) // resumed there
                .seg(1, 4, 8, 80, 40, 3)
                .recv(2, 0, 200)
                .toggle_move()
                .atomic(4, 8, 16, 1) // an atomic on E: not ready
                .toggle_move()
                .toggle_stall()
                .req(3, 4, 8, 0, 64) // a READ of E: not ready
                .toggle_stall()
                .resumed_read(4, 8, 0, 64, 32) // the READ, from its byte 32
                .resumed_read(0, 0, 0, 64, 16) // a duplicate READ of A, from 16
                .0
        })
        .into()
}

#[cfg(test)]
mod tests {
    use super::{fuzz_responder, responder_seeds};

    /// The seeds, then pseudo-random sequences. The checks catch a responder that lets a
    /// WRITE into an MR granting only REMOTE_READ, or answers a READ of an MR granting no
    /// REMOTE_READ (both tried by hand on a responder broken so).
    #[test]
    fn hand_made_request_sequences_keep_every_property() {
        for seed in responder_seeds() {
            fuzz_responder(&seed);
        }
        fuzz_responder(&[]);
        fuzz_responder(&[1]);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..300 {
            let v: Vec<u8> = (0..200)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            fuzz_responder(&v);
        }
    }
}
