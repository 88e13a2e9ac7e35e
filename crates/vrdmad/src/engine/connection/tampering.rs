//! A man in the middle of a sealed connection (see `seal`): the test relays what one end
//! wrote to the other, and flips a bit, replays a record, injects bytes or cuts the stream
//! on the way. Each is refused before anything of it is acted on, counted once, and ends
//! the reading; the same tampering of an unsealed connection (the code before sealing) is
//! read as if the peer had sent it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vrdma_abi::shm::{create_memfd, SharedMapping};
use vrdma_abi::wire::{FrameHeader, Kind};

use super::seal::{FrameKeys, Sealer, KEY_LEN, RECORD_OVERHEAD};
use super::{Conn, PeerRx};
use crate::engine::testing::PEER;

/// A connected pair of sockets: (ours, the far end).
fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    (a, b)
}

const KEYS: ([u8; KEY_LEN], [u8; KEY_LEN]) = ([1; KEY_LEN], [2; KEY_LEN]);

/// What the sender wrote for three frames: a small one, a WRITE with 40000 bytes of data
/// (three records), and a batch (as the requester writes it).
fn sent(sealed: bool) -> (Vec<u8>, Vec<u8>) {
    let (ours, mut far) = socket_pair();
    let c = Conn::new(ours, PEER);
    if sealed {
        c.seal_frames(&FrameKeys { send: KEYS.0, recv: KEYS.1 }, Arc::new(AtomicU64::new(0)));
    }
    let data: Vec<u8> = (0..40_000u32).map(|i| (i * 13) as u8).collect();
    c.send(&FrameHeader::new(Kind::Heartbeat), &[]).unwrap();
    let mut w = FrameHeader::new(Kind::Write);
    w.data_len = data.len() as u32;
    c.send(&w, &data).unwrap();
    c.send_raw([FrameHeader::new(Kind::HeartbeatAck).encode(), FrameHeader::new(Kind::HeartbeatAck).encode()].concat()).unwrap();
    c.shutdown();
    let mut wire = Vec::new();
    far.read_to_end(&mut wire).unwrap();
    (wire, data)
}

/// The receiver's view of `wire` (as the relay delivered it): the frames it read (kind, and
/// for the WRITE whether the memory got the data the sender sent), the first failure, and
/// how many records it refused.
fn receive(wire: &[u8], sealed: bool, data: &[u8]) -> (Vec<(Kind, bool)>, Option<String>, u64) {
    let (ours, mut far) = socket_pair();
    let c = Conn::new(ours, PEER);
    let refused = Arc::new(AtomicU64::new(0));
    if sealed {
        c.seal_frames(&FrameKeys { send: KEYS.1, recv: KEYS.0 }, refused.clone());
    }
    far.write_all(wire).unwrap();
    drop(far);
    let fd = create_memfd("tamper-test", 64 << 10, true).unwrap();
    let mem = SharedMapping::map_sealed(std::os::fd::AsFd::as_fd(&fd), 64 << 10, true).unwrap();
    let live = PeerRx::new();
    let mut frames = Vec::new();
    let failure = loop {
        let h = match c.read_header(&live, Duration::from_secs(5)) {
            Ok((h, _)) => h,
            Err(e) => break Some(e.to_string()),
        };
        if h.data_len > 0 {
            if let Err(e) = c.read_region(mem.region(), 0, h.data_len as usize) {
                break Some(e.to_string());
            }
        }
        let mut got = vec![0u8; h.data_len as usize];
        mem.region().read_into(0, &mut got).unwrap();
        frames.push((h.kind, h.kind == Kind::Write && got == data));
        if frames.len() == 4 {
            break None;
        }
    };
    (frames, failure, refused.load(Ordering::Relaxed))
}

/// Where each record of a sealed `wire` starts.
fn records(wire: &[u8]) -> Vec<usize> {
    let (mut at, mut starts) = (0, Vec::new());
    while at + 4 <= wire.len() {
        starts.push(at);
        at += u32::from_be_bytes(wire[at..at + 4].try_into().unwrap()) as usize + RECORD_OVERHEAD;
    }
    starts
}

#[test]
fn an_untouched_sealed_stream_reads_as_sent() {
    let (wire, data) = sent(true);
    let (frames, failure, refused) = receive(&wire, true, &data);
    assert_eq!(failure, None);
    assert_eq!(frames, [(Kind::Heartbeat, false), (Kind::Write, true), (Kind::HeartbeatAck, false), (Kind::HeartbeatAck, false)]);
    assert_eq!(refused, 0);
    // (On the wire: no frame in the clear.)
    assert!(!wire.windows(16).any(|w| data.windows(16).next() == Some(w)));
}

#[test]
fn a_flipped_bit_is_refused_before_its_bytes_are_used() {
    let (wire, data) = sent(true);
    let starts = records(&wire);
    // A bit in: the first record's length, its header bytes, its tag; the WRITE's data in its
    // second record; the batch.
    for at in [1, 10, starts[1] - 3, starts[2] + 100, starts[4] + 30] {
        let mut w = wire.clone();
        w[at] ^= 0x04;
        let (frames, failure, refused) = receive(&w, true, &data);
        assert!(failure.is_some(), "flip at {at}: read {frames:?}");
        assert_eq!(refused, 1, "flip at {at}");
        // Nothing of a WRITE whose record was altered reached the memory whole.
        assert!(!frames.contains(&(Kind::Write, true)) || at > starts[4] - 1, "flip at {at}: {frames:?}");
    }
    // Unsealed (the code before sealing): the same flip in the WRITE's data is written to
    // memory, and nobody notices.
    let (plain, data) = sent(false);
    let mut w = plain.clone();
    w[64 + 64 + 1000] ^= 0x04;
    let (frames, failure, _) = receive(&w, false, &data);
    assert_eq!(failure, None);
    assert_eq!(frames[1], (Kind::Write, false), "the altered WRITE was stored as sent");
}

#[test]
fn replayed_injected_reordered_and_cut_records_are_refused() {
    let (wire, data) = sent(true);
    let s = records(&wire);
    let rec = |i: usize| wire[s[i]..s.get(i + 1).copied().unwrap_or(wire.len())].to_vec();
    let forged = Sealer::new(&[9; KEY_LEN]).seal(&[&FrameHeader::new(Kind::PeerGone).encode()]).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("the first record replayed", [rec(0), rec(0), wire[s[1]..].to_vec()].concat()),
        ("a record replayed later", [wire.clone(), rec(0)].concat()),
        ("records reordered", [rec(0), rec(2), rec(1), wire[s[3]..].to_vec()].concat()),
        ("a record dropped", [rec(0), wire[s[2]..].to_vec()].concat()),
        ("a record of another key injected", [rec(0), forged, wire[s[1]..].to_vec()].concat()),
        ("a frame in the clear injected", [rec(0), FrameHeader::new(Kind::PeerGone).encode().to_vec(), wire[s[1]..].to_vec()].concat()),
        ("the stream cut inside a record", wire[..s[2] + 50].to_vec()),
    ];
    for (what, w) in cases {
        let (frames, failure, refused) = receive(&w, true, &data);
        assert!(failure.is_some(), "{what}: read {frames:?}");
        assert_eq!(refused, 1, "{what}");
        assert!(!frames.iter().any(|(k, _)| *k == Kind::PeerGone), "{what}: acted on an injected frame");
    }
    // Unsealed: a frame injected in the clear is read as the peer's.
    let (plain, data) = sent(false);
    let w = [&plain[..64], &FrameHeader::new(Kind::PeerGone).encode(), &plain[64..]].concat();
    let (frames, _, _) = receive(&w, false, &data);
    assert_eq!(frames[1].0, Kind::PeerGone, "the injected frame was read");
}

/// A large frame from registered memory (a READ response) goes sealed a stretch at a time,
/// and arrives whole.
#[test]
fn a_large_region_goes_sealed_and_arrives_whole() {
    const LEN: usize = 600 << 10;
    let (ours, theirs) = socket_pair();
    let fd = create_memfd("tamper-big", LEN, true).unwrap();
    let src = SharedMapping::map_sealed(std::os::fd::AsFd::as_fd(&fd), LEN, true).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    src.region().write_from(0, &data).unwrap();
    let sender = std::thread::spawn(move || {
        let c = Conn::new(ours, PEER);
        c.seal_frames(&FrameKeys { send: KEYS.0, recv: KEYS.1 }, Arc::new(AtomicU64::new(0)));
        let mut h = FrameHeader::new(Kind::ReadResp);
        h.data_len = LEN as u32;
        c.send_region(&h, src.region(), 0, LEN).unwrap();
    });
    let c = Conn::new(theirs, PEER);
    let refused = Arc::new(AtomicU64::new(0));
    c.seal_frames(&FrameKeys { send: KEYS.1, recv: KEYS.0 }, refused.clone());
    let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
    assert_eq!((h.kind, h.data_len as usize), (Kind::ReadResp, LEN));
    let fd2 = create_memfd("tamper-big-dst", LEN, true).unwrap();
    let dst = SharedMapping::map_sealed(std::os::fd::AsFd::as_fd(&fd2), LEN, true).unwrap();
    c.read_region(dst.region(), 0, LEN).unwrap();
    sender.join().unwrap();
    let mut got = vec![0u8; LEN];
    dst.region().read_into(0, &mut got).unwrap();
    assert!(got == data && refused.load(Ordering::Relaxed) == 0);
}
