//! The connection's backlog (a full socket never blocks its writer) and read-ahead (frames
//! arrive whole and in order, read ahead or peeked).

use super::rx::RX_BUF;
use super::*;
use crate::engine::mr::{MappedMr, MrMemory};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Weak;
use std::time::Duration;
use vrdma_abi::shm::{create_memfd, SharedMapping};
use vrdma_abi::wire::{FrameHeader, Kind, HEADER_LEN};
use vrdma_core::access::MrBounds;

fn small_buffers(s: &TcpStream, opt: libc::c_int) {
    let bytes: libc::c_int = 16 << 10;
    set_socket_option(s.as_raw_fd(), libc::SOL_SOCKET, opt, &bytes).unwrap();
}

/// The doorbell thread writes a connection whose peer does not read: every send returns
/// at once, the rest waits in the backlog (MR bytes by reference), QPs park behind it,
/// and once room comes the peer gets every frame whole and in order, and the parked QPs
/// are handed back.
#[test]
fn a_full_socket_never_blocks_the_writer_and_the_backlog_keeps_frame_order() {
    full_socket_backlog(false);
}

/// The same on a sealed connection: MR frames are sealed a stretch at a time as the socket
/// takes them, with the numbers they were queued with, between frames sealed at once.
#[test]
fn a_sealed_backlog_keeps_frame_and_record_order() {
    full_socket_backlog(true);
}

fn full_socket_backlog(sealed: bool) {
    // SAFETY: plain epoll_create1; the descriptor is owned below.
    let epfd = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut server, _) = l.accept().unwrap();
    small_buffers(&client, libc::SO_SNDBUF);
    small_buffers(&server, libc::SO_RCVBUF);
    let hook = Hook { epfd: epfd.as_raw_fd(), token: 42, resume: Weak::new() };
    let c = Conn::with_hook(client, l.local_addr().unwrap(), Some(hook));
    let key = [8u8; super::seal::KEY_LEN];
    if sealed {
        let keys = super::seal::FrameKeys { send: key, recv: [9; super::seal::KEY_LEN] };
        c.seal_frames(&keys, Arc::new(std::sync::atomic::AtomicU64::new(0)));
    }

    const MR_LEN: usize = 1 << 20;
    let fd = create_memfd("backlog-test", MR_LEN, true).unwrap();
    let mapping = SharedMapping::reserve(MR_LEN).unwrap();
    mapping.place_fd(0, fd.as_fd(), 0, MR_LEN, true).unwrap();
    let pattern: Vec<u8> = (0..MR_LEN).map(|i| (i * 7 % 253) as u8).collect();
    mapping.region().write_from(0, &pattern).unwrap();
    let mr = Arc::new(MappedMr {
        mem: MrMemory::Mapped(mapping),
        span_start: 0,
        bounds: MrBounds { addr: 0, length: MR_LEN as u64, access: 0 },
        session: 0,
        pd: 0,
    });

    let mut expected = Vec::new();
    for i in 0..48u32 {
        let mut h = FrameHeader::new(Kind::Write);
        h.psn = i;
        let off = (i as usize * 4099) % (MR_LEN / 2);
        let len = 60_000 + i as usize;
        h.data_len = len as u32;
        expected.extend_from_slice(&h.encode());
        if i % 3 == 0 {
            let data: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
            c.send(&h, &data).unwrap();
            expected.extend_from_slice(&data);
        } else {
            c.send_mr(&h, &mr, off, len).unwrap();
            expected.extend_from_slice(&pattern[off..off + len]);
        }
    }
    assert!(c.backlog() > 0, "about 3 MB went to 32 KiB of socket buffers");
    assert!(c.park_if_backlogged(Parked::Qp(7)));
    assert!(c.park_if_backlogged(Parked::Qp(7)) && c.park_if_backlogged(Parked::Ud(9)));

    let want = expected.len();
    let reader = std::thread::spawn(move || {
        if !sealed {
            let mut got = vec![0u8; want];
            server.read_exact(&mut got).unwrap();
            return got;
        }
        let (mut o, mut got) = (super::seal::Opener::new(&key), Vec::new());
        while got.len() < want {
            let mut rec = vec![0u8; 4];
            server.read_exact(&mut rec).unwrap();
            let n = o.record_len(&rec).unwrap().unwrap();
            rec.resize(n, 0);
            server.read_exact(&mut rec[4..]).unwrap();
            got.extend_from_slice(o.open(&mut rec).unwrap());
        }
        got
    });
    let mut parked = Vec::new();
    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
    while parked.is_empty() {
        // SAFETY: a live epoll fd and a buffer of 4 events.
        let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 10_000) };
        assert_eq!(n, 1, "EPOLLOUT is armed while there is a backlog");
        let token = ev[0].u64;
        assert_eq!(token, 42);
        parked = c.on_writable();
    }
    assert_eq!(parked, [Parked::Qp(7), Parked::Ud(9)]);
    assert_eq!(c.backlog(), 0);
    assert!(!c.park_if_backlogged(Parked::Qp(7)));
    assert!(reader.join().unwrap() == expected, "the peer got the frames whole and in order");
}

/// A connection to read (as a reader thread does) and the socket that writes to it.
fn reading_conn() -> (TcpStream, Conn) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let writer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    (writer, Conn::new(server, l.local_addr().unwrap()))
}

/// A SEND frame with `data`; its QP number (in the header's first 20 bytes) differs by
/// `psn`, so that a header cut by a read differs between frames.
fn frame(psn: u32, data: &[u8]) -> Vec<u8> {
    let mut h = FrameHeader::new(Kind::Send);
    h.psn = psn;
    h.dst_qpn = 1000 + psn;
    h.data_len = data.len() as u32;
    let mut b = h.encode().to_vec();
    b.extend_from_slice(data);
    b
}

/// The reader's read-ahead: small frames written in one go are all taken from one read,
/// a frame's data goes to memory or a buffer (or is dropped) whole and in order whether it was read
/// ahead, partly read ahead (larger than the buffer) or not at all, a header split over
/// two writes is joined, and `readable_now` sees what is buffered.
#[test]
fn frames_read_ahead_arrive_whole_and_in_order() {
    frames_read_ahead_arrive_whole_and_in_order_when(false);
}

/// The same for a lane's reader, which peeks.
#[test]
fn frames_peeked_arrive_whole_and_in_order() {
    frames_read_ahead_arrive_whole_and_in_order_when(true);
}

fn frames_read_ahead_arrive_whole_and_in_order_when(peek: bool) {
    let (mut writer, c) = reading_conn();
    if peek {
        c.peek_reads();
    }
    let live = PeerRx::new();
    let small: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 8 + i as usize]).collect();
    let big: Vec<u8> = (0..3 * RX_BUF + 123).map(|i| (i % 251) as u8).collect();
    let mut all = Vec::new();
    for (i, d) in small.iter().enumerate() {
        all.extend_from_slice(&frame(i as u32, d));
    }
    all.extend_from_slice(&frame(100, &big));
    all.extend_from_slice(&frame(101, b"tail"));
    writer.write_all(&all).unwrap();

    const LEN: usize = 1 << 16;
    let fd = vrdma_abi::shm::create_memfd("rx-test", LEN, true).unwrap();
    let mapping = SharedMapping::reserve(LEN).unwrap();
    mapping.place_fd(0, fd.as_fd(), 0, LEN, true).unwrap();
    let mem = mapping.region();

    // Wait until everything is in the socket, so that the first read takes a full buffer.
    std::thread::sleep(Duration::from_millis(100));
    let mut reads = 0;
    for (i, d) in small.iter().enumerate() {
        let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        reads += usize::from(read);
        assert_eq!((h.psn, h.data_len as usize), (i as u32, d.len()));
        if i % 5 == 4 {
            // Refused data is dropped, and the next frame is still found.
            c.discard(d.len() as u64).unwrap();
        } else if i % 2 == 0 {
            let mut got = vec![0u8; d.len()];
            c.read_exact(&mut got).unwrap();
            assert_eq!(&got, d);
        } else {
            c.read_region(mem, 100 * i, d.len()).unwrap();
            let mut got = vec![0u8; d.len()];
            mem.read_into(100 * i, &mut got).unwrap();
            assert_eq!(&got, d);
        }
        assert!(c.readable_now(), "the next frame is there");
    }
    assert_eq!(reads, 1, "twenty small frames came with one read");
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!((h.psn, h.data_len as usize), (100, big.len()));
    c.read_region(mem, 4096, big.len()).unwrap();
    let mut got = vec![0u8; big.len()];
    mem.read_into(4096, &mut got).unwrap();
    assert!(got == big, "a frame larger than the buffer, partly read ahead");
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!(h.psn, 101);
    let mut tail = [0u8; 4];
    c.read_exact(&mut tail).unwrap();
    assert_eq!(&tail, b"tail");
    assert!(!c.readable_now(), "nothing left");

    // A header that arrives in two parts.
    let f = frame(7, b"split");
    writer.write_all(&f[..10]).unwrap();
    let joined = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        writer.write_all(&f[10..]).unwrap();
        writer
    });
    let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert!(read);
    assert_eq!((h.psn, h.data_len), (7, 5));
    let mut d = [0u8; 5];
    c.read_exact(&mut d).unwrap();
    assert_eq!(&d, b"split");
    drop(joined.join().unwrap());
}

/// The read-ahead's edges: a read that ends inside a header (the rest of the header is
/// read after what is left moves to the front), data served partly from the buffer and
/// partly straight from the socket, and `readable_now` seeing a frame that is in the
/// socket but not yet read ahead.
#[test]
fn a_header_cut_by_the_read_ahead_is_joined_and_data_straddles_buffer_and_socket() {
    a_header_cut_by_the_read_ahead_is_joined_when(false);
}

/// The same for a lane's reader, which peeks.
#[test]
fn a_header_cut_by_a_peek_is_joined_and_data_straddles_buffer_and_socket() {
    a_header_cut_by_the_read_ahead_is_joined_when(true);
}

fn a_header_cut_by_the_read_ahead_is_joined_when(peek: bool) {
    let (mut writer, c) = reading_conn();
    if peek {
        c.peek_reads();
    }
    let live = PeerRx::new();
    // The first read (a full buffer) ends 20 bytes into the second frame's header.
    let first: Vec<u8> = (0..RX_BUF - HEADER_LEN - 20).map(|i| (i % 253) as u8).collect();
    let second: Vec<u8> = (0..20_000).map(|i| (i % 241) as u8).collect();
    let mut all = frame(1, &first);
    all.extend_from_slice(&frame(2, &second));
    all.extend_from_slice(&frame(3, b"third"));
    writer.write_all(&all).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert!(read);
    assert_eq!((h.psn, h.data_len as usize), (1, first.len()));
    let mut got = vec![0u8; first.len()];
    c.read_exact(&mut got).unwrap();
    assert!(got == first);
    assert_eq!(c.rx.lock().buffered(), 20, "a cut header is left");
    let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert!(read, "the rest of the header took a read");
    assert_eq!((h.dst_qpn, h.psn, h.data_len as usize), (1002, 2, second.len()));
    let buffered = c.rx.lock().buffered();
    assert!(buffered > 0 && buffered < second.len(), "{buffered} of the data read ahead");
    let mut got = vec![0u8; second.len()];
    c.read_exact(&mut got).unwrap();
    assert!(got == second, "data from the buffer, then from the socket");
    assert_eq!(c.rx.lock().buffered(), 0);
    assert!(c.readable_now(), "the third frame waits in the socket");
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!(h.psn, 3);
    let mut third = [0u8; 5];
    c.read_exact(&mut third).unwrap();
    assert_eq!(&third, b"third");
    assert!(!c.readable_now());
}

/// Bytes in `c`'s socket that nobody has read (or dropped).
fn unread_in_socket(c: &Conn) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int into the live `n`.
    assert_eq!(unsafe { libc::ioctl(c.stream.as_raw_fd(), libc::FIONREAD, &mut n) }, 0);
    n as usize
}

/// A lane's reader peeks: the frame it has stays in the socket (so the kernel does not
/// send and process its TCP ACK inside the read that brings the frame) until the reader
/// is about to wait for more, and is then dropped, never read twice.
#[test]
fn a_peeking_reader_leaves_a_frame_in_the_socket_until_it_waits_again() {
    let (mut writer, c) = reading_conn();
    c.peek_reads();
    let live = PeerRx::new();
    let one = frame(1, b"one");
    writer.write_all(&one).unwrap();
    let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert!(read);
    assert_eq!(h.psn, 1);
    let mut d = [0u8; 3];
    c.read_exact(&mut d).unwrap();
    assert_eq!(&d, b"one");
    assert_eq!(unread_in_socket(&c), one.len(), "the frame handled is still in the socket");
    assert!(!c.readable_now(), "and is no news");
    assert_eq!(unread_in_socket(&c), 0, "dropped before the reader waits");

    // Blocked in a peek, the reader gets the next frame, not the last one again.
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        writer.write_all(&frame(2, b"two")).unwrap();
        writer.write_all(&frame(3, b"three")).unwrap();
        writer
    });
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!(h.psn, 2);
    c.discard(3).unwrap();
    let writer = late.join().unwrap();
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!(h.psn, 3);
    let mut d = [0u8; 5];
    c.read_exact(&mut d).unwrap();
    assert_eq!(&d, b"three");
    drop(writer);
    assert!(c.read_header(&live, Duration::from_secs(5)).is_err(), "the peer closed: EOF, not an old frame");
}

/// A connection that fails while QPs are parked behind its backlog hands them back (to
/// flush), rather than leaving them waiting for room that will never come.
#[test]
fn parked_senders_come_back_when_the_connection_fails() {
    // SAFETY: plain epoll_create1; the descriptor is owned below.
    let epfd = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    small_buffers(&client, libc::SO_SNDBUF);
    small_buffers(&server, libc::SO_RCVBUF);
    let hook = Hook { epfd: epfd.as_raw_fd(), token: 7, resume: Weak::new() };
    let c = Conn::with_hook(client, l.local_addr().unwrap(), Some(hook));
    let data = vec![5u8; 60_000];
    let mut h = FrameHeader::new(Kind::Send);
    h.data_len = data.len() as u32;
    while c.backlog() == 0 {
        c.send(&h, &data).unwrap();
    }
    assert!(c.park_if_backlogged(Parked::Qp(3)) && c.park_if_backlogged(Parked::Ud(4)));
    // The peer resets the connection with our bytes unread.
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    set_socket_option(server.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, &linger).unwrap();
    drop(server);
    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: a live epoll fd and a buffer of 4 events.
    let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 10_000) };
    assert_eq!(n, 1, "the reset is reported");
    assert_eq!(c.on_writable(), [Parked::Qp(3), Parked::Ud(4)]);
    assert_eq!(c.backlog(), 0);
    assert!(!c.is_alive());
}

/// A sealed connection to read and the socket that writes to it, with the sealer of the
/// writer's records.
fn sealed_reading_conn(peek: bool) -> (TcpStream, super::seal::Sealer, Conn) {
    let (writer, c) = reading_conn();
    let keys = super::seal::FrameKeys { send: [1; super::seal::KEY_LEN], recv: [2; super::seal::KEY_LEN] };
    c.seal_frames(&keys, Arc::new(std::sync::atomic::AtomicU64::new(0)));
    if peek {
        c.peek_reads();
    }
    (writer, super::seal::Sealer::new(&keys.recv), c)
}

/// A sealed reader delivers frames whole and in order whether their records hold several
/// frames, part of one, or a frame's end and the next frame's start: data read into memory
/// (straight from the records), into a buffer, or dropped, across records and reads.
#[test]
fn sealed_frames_arrive_whole_and_in_order() {
    sealed_frames_arrive_whole_and_in_order_when(false);
}

/// The same for a sealed lane's reader, which peeks whole records.
#[test]
fn sealed_frames_peeked_arrive_whole_and_in_order() {
    sealed_frames_arrive_whole_and_in_order_when(true);
}

fn sealed_frames_arrive_whole_and_in_order_when(peek: bool) {
    let (mut writer, mut sealer, c) = sealed_reading_conn(peek);
    let live = PeerRx::new();
    let sizes = [0usize, 8, 100, 16_000, 16_384, 40_000, 3, 100_000, 5, 70_000, 1];
    let frames: Vec<(u32, Vec<u8>)> =
        sizes.iter().enumerate().map(|(i, &n)| (i as u32, (0..n).map(|j| (j * 13 + i) as u8).collect())).collect();
    // Sealed three ways: all in one go, one frame per write, and in odd pieces.
    let mut plain = Vec::new();
    for (psn, d) in &frames {
        plain.extend_from_slice(&frame(*psn, d));
    }
    let wires = [
        sealer.seal(&[&plain]).unwrap(),
        frames.iter().flat_map(|(psn, d)| sealer.seal(&[&frame(*psn, d)]).unwrap()).collect(),
        plain.chunks(7777).flat_map(|p| sealer.seal(&[p]).unwrap()).collect::<Vec<u8>>(),
    ];
    const LEN: usize = 1 << 18;
    let fd = vrdma_abi::shm::create_memfd("sealed-rx-test", LEN, true).unwrap();
    let mapping = SharedMapping::reserve(LEN).unwrap();
    mapping.place_fd(0, fd.as_fd(), 0, LEN, true).unwrap();
    let mem = mapping.region();
    for wire in wires {
        let w = std::thread::spawn(move || {
            writer.write_all(&wire).unwrap();
            writer
        });
        for (i, (psn, d)) in frames.iter().enumerate() {
            let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
            assert_eq!((h.psn, h.data_len as usize), (*psn, d.len()));
            match i % 3 {
                0 => c.discard(d.len() as u64).unwrap(),
                1 => {
                    let mut got = vec![0u8; d.len()];
                    c.read_exact(&mut got).unwrap();
                    assert!(&got == d, "frame {psn} into a buffer");
                }
                _ => {
                    c.read_region(mem, 1000 + i, d.len()).unwrap();
                    let mut got = vec![0u8; d.len()];
                    mem.read_into(1000 + i, &mut got).unwrap();
                    assert!(&got == d, "frame {psn} into memory");
                }
            }
        }
        writer = w.join().unwrap();
        assert!(!c.readable_now(), "nothing left");
        assert_eq!(unread_in_socket(&c), 0, "nothing left in the socket either");
    }
    drop(writer);
    assert!(c.read_header(&live, Duration::from_secs(5)).is_err(), "the peer closed: EOF, not an old frame");
}

/// A sealed reader says a header took a read only when it took bytes from the socket, not
/// when the records it had received already held the frame: the CPU follower asks the
/// kernel where data came in (a system call) only after real reads.
#[test]
fn a_sealed_reader_reports_reads_from_the_socket_only() {
    for peek in [false, true] {
        let (mut writer, mut sealer, c) = sealed_reading_conn(peek);
        let live = PeerRx::new();
        // Frames of 8 KiB, each sealed alone (as a lane's client seals them), all received
        // before the reader looks: one read takes them all (the socket buffer holds them).
        let data: Vec<u8> = (0..8192).map(|i| (i % 251) as u8).collect();
        for i in 0..6 {
            writer.write_all(&sealer.seal(&[&frame(i, &data)]).unwrap()).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let mut reads = 0;
        for i in 0..6 {
            let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
            assert_eq!(h.psn, i);
            reads += usize::from(read);
            let mut d = vec![0u8; data.len()];
            c.read_exact(&mut d).unwrap();
            assert!(d == data);
        }
        assert_eq!(reads, 1, "{reads} reads reported for 6 frames received at once (peek: {peek})");
    }
}

/// A sealed lane's reader peeks too: the record it opened stays in the socket until the
/// reader is about to wait for more, is then dropped, and is never opened twice (a record
/// opened twice would fail: its number is used).
#[test]
fn a_sealed_peeking_reader_leaves_its_records_in_the_socket_until_it_waits_again() {
    let (mut writer, mut sealer, c) = sealed_reading_conn(true);
    let live = PeerRx::new();
    let one = sealer.seal(&[&frame(1, b"one")]).unwrap();
    writer.write_all(&one).unwrap();
    let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert!(read);
    assert_eq!(h.psn, 1);
    let mut d = [0u8; 3];
    c.read_exact(&mut d).unwrap();
    assert_eq!(&d, b"one");
    assert_eq!(unread_in_socket(&c), one.len(), "the record handled is still in the socket");
    assert!(!c.readable_now(), "and is no news");
    assert_eq!(unread_in_socket(&c), 0, "dropped before the reader waits");

    // Blocked in a peek, the reader gets the next records, not the last one again; a frame
    // cut between two records is joined across a peek and a read.
    let two = frame(2, &[9u8; 30_000]);
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        writer.write_all(&sealer.seal(&[&two[..100]]).unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        writer.write_all(&sealer.seal(&[&two[100..], &frame(3, b"three")]).unwrap()).unwrap();
        writer
    });
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!((h.psn, h.data_len), (2, 30_000));
    let mut got = vec![0u8; 30_000];
    c.read_exact(&mut got).unwrap();
    assert!(got.iter().all(|&b| b == 9));
    let writer = late.join().unwrap();
    let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
    assert_eq!(h.psn, 3);
    let mut d = [0u8; 5];
    c.read_exact(&mut d).unwrap();
    assert_eq!(&d, b"three");
    assert!(!c.readable_now());
    drop(writer);
    assert!(c.read_header(&live, Duration::from_secs(5)).is_err(), "the peer closed: EOF, not an old record");
}

/// 1 MiB WRITE frames from registered memory to registered memory over loopback, through a
/// non-blocking connection's backlog (as the doorbell thread sends) and a reader's
/// `read_region` (as the responder receives), sealed or not; MB/s. Run with
/// `cargo test --release -p vrdmad --lib region_throughput -- --ignored --nocapture`: the
/// cost of sealing on the bulk path apart from the network's and the engine's.
#[test]
#[ignore]
fn region_throughput() {
    for sealed in [false, true, false, true] {
        let mbps = region_stream_mbps(sealed, 400);
        eprintln!("1 MiB frames MR to MR over loopback, {}: {mbps:.0} MB/s", if sealed { "sealed" } else { "unsealed" });
    }
}

fn region_stream_mbps(sealed: bool, frames: usize) -> f64 {
    const LEN: usize = 1 << 20;
    // SAFETY: plain epoll_create1; the descriptor is owned below.
    let epfd = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    client.set_nonblocking(true).unwrap();
    let hook = Hook { epfd: epfd.as_raw_fd(), token: 1, resume: Weak::new() };
    let c = Conn::with_hook(client, l.local_addr().unwrap(), Some(hook));
    let r = Conn::new(server, l.local_addr().unwrap());
    if sealed {
        c.seal_frames(
            &super::seal::FrameKeys { send: [1; super::seal::KEY_LEN], recv: [2; super::seal::KEY_LEN] },
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        );
        r.seal_frames(
            &super::seal::FrameKeys { send: [2; super::seal::KEY_LEN], recv: [1; super::seal::KEY_LEN] },
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        );
    }
    let map = |name: &str| {
        let fd = create_memfd(name, LEN, true).unwrap();
        let m = SharedMapping::reserve(LEN).unwrap();
        m.place_fd(0, fd.as_fd(), 0, LEN, true).unwrap();
        m
    };
    let src = map("throughput-src");
    src.region().write_from(0, &(0..LEN).map(|i| (i * 7 % 251) as u8).collect::<Vec<u8>>()).unwrap();
    let mr = Arc::new(MappedMr {
        mem: MrMemory::Mapped(src),
        span_start: 0,
        bounds: MrBounds { addr: 0, length: LEN as u64, access: 0 },
        session: 0,
        pd: 0,
    });
    let dst = map("throughput-dst");
    let start = std::time::Instant::now();
    let reader = std::thread::spawn(move || {
        let live = PeerRx::new();
        for _ in 0..frames {
            let (h, _) = r.read_header(&live, Duration::from_secs(10)).unwrap();
            r.read_region(dst.region(), 0, h.data_len as usize).unwrap();
        }
        let mut last = [0u8; 16];
        dst.region().read_into(LEN - 16, &mut last).unwrap();
        last
    });
    let mut h = FrameHeader::new(Kind::Write);
    h.data_len = LEN as u32;
    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
    for _ in 0..frames {
        c.send_mr(&h, &mr, 0, LEN).unwrap();
        while c.backlog() > 2 * LEN {
            // SAFETY: a live epoll fd and a buffer of 4 events.
            unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 1000) };
            c.on_writable();
        }
    }
    while c.backlog() > 0 {
        // SAFETY: as above.
        unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 1000) };
        c.on_writable();
    }
    let last = reader.join().unwrap();
    let expect: Vec<u8> = (LEN - 16..LEN).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(&last[..], &expect[..]);
    (frames * LEN) as f64 / start.elapsed().as_secs_f64() / 1e6
}

/// 8-byte frames ping-ponged over loopback between two connections' readers (one peeking,
/// as a lane's), sealed or not; the median round trip in µs. Run with `cargo test --release
/// -p vrdmad --lib small_frame_round_trip -- --ignored --nocapture`: what sealing adds to a
/// small message apart from the engine's path.
#[test]
#[ignore]
fn small_frame_round_trip() {
    for sealed in [false, true, false, true] {
        let us = round_trip_us(sealed, 20_000);
        eprintln!("8-byte frame round trip over loopback, {}: p50 {us:.2} us", if sealed { "sealed" } else { "unsealed" });
    }
}

fn round_trip_us(sealed: bool, rounds: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
    for s in [&a, &b] {
        s.set_nodelay(true).unwrap();
    }
    let (ca, cb) = (Conn::new(a, l.local_addr().unwrap()), Conn::new(b, l.local_addr().unwrap()));
    if sealed {
        ca.seal_frames(
            &super::seal::FrameKeys { send: [1; super::seal::KEY_LEN], recv: [2; super::seal::KEY_LEN] },
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        );
        cb.seal_frames(
            &super::seal::FrameKeys { send: [2; super::seal::KEY_LEN], recv: [1; super::seal::KEY_LEN] },
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        );
    }
    // B reads as a lane's reader does (peeking) and answers on its connection.
    cb.peek_reads();
    drop((a2, b2));
    let echo = std::thread::spawn(move || {
        let live = PeerRx::new();
        let mut d = [0u8; 8];
        for _ in 0..rounds {
            let (h, _) = cb.read_header(&live, Duration::from_secs(10)).unwrap();
            cb.read_exact(&mut d).unwrap();
            let _ = cb.readable_now();
            cb.send(&h, &d).unwrap();
        }
    });
    let live = PeerRx::new();
    let mut h = FrameHeader::new(Kind::Send);
    h.data_len = 8;
    let mut d = [0u8; 8];
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        ca.send(&h, &d).unwrap();
        let _ = ca.read_header(&live, Duration::from_secs(10)).unwrap();
        ca.read_exact(&mut d).unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    echo.join().unwrap();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Ending a socket a client shares (a lane: shut down, then disconnected before our last
/// reference closes) takes the socket's lock, which the client holds for as long as a
/// `send(2)` of its copies (page faults included: evicted file pages read at random held it
/// most of a second per 256 MiB on the development VM; here a page whose fault userfaultfd
/// holds until the test lets go). Neither may wait for that on the engine thread that does
/// it: before, both waited out the client's send (3 s here).
#[test]
fn ending_a_shared_socket_never_waits_for_its_clients_send() {
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    #[repr(C)]
    struct UffdioApi {
        api: u64,
        features: u64,
        ioctls: u64,
    }
    #[repr(C)]
    struct UffdioRegister {
        start: u64,
        len: u64,
        mode: u64,
        ioctls: u64,
    }
    // _IOWR(0xAA, 0x3F, struct uffdio_api), _IOWR(0xAA, 0x00, struct uffdio_register).
    const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
    const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;

    // SAFETY: the userfaultfd system call takes flags only; its result is a descriptor we own.
    let uffd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) } as i32;
    if uffd < 0 {
        // (Under CI a missing prerequisite fails the test.)
        vrdma_test_support::skip(
            "ending_a_shared_socket_never_waits_for_its_clients_send",
            format_args!("no userfaultfd ({})", std::io::Error::last_os_error()),
        );
        return;
    }
    // SAFETY: a fresh descriptor, owned from here on.
    let uffd = unsafe { OwnedFd::from_raw_fd(uffd) };
    let mut api = UffdioApi { api: 0xAA, features: 0, ioctls: 0 };
    // SAFETY: the ioctl reads and writes a live struct of the size its number encodes.
    assert_eq!(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) }, 0);
    let len = 1 << 16;
    // SAFETY: a new private anonymous mapping, unmapped below.
    let at = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    assert_ne!(at, libc::MAP_FAILED);
    let mut reg = UffdioRegister { start: at as u64, len: len as u64, mode: 1, ioctls: 0 };
    // SAFETY: as above; the range is our own mapping.
    assert_eq!(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) }, 0);

    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (_theirs, _) = l.accept().unwrap();
    let c = Arc::new(Conn::new(ours, crate::engine::testing::PEER));
    // The client's descriptor, and its send of memory whose first page faults.
    let client = c.try_clone_stream().unwrap();
    let sending = Arc::new(AtomicBool::new(false));
    let flag = sending.clone();
    let addr = at as usize;
    let sender = std::thread::spawn(move || {
        flag.store(true, Ordering::Release);
        // SAFETY: sends from our mapping of `len` bytes, live until the test unmaps it after
        // this thread ends.
        unsafe { libc::send(client.as_raw_fd(), addr as *const libc::c_void, len, 0) }
    });
    while !sending.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(200));

    // The lane ends (the QP destroyed: under the registry's lock), and our last reference
    // goes (on the doorbell thread, say).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let started = Instant::now();
        c.shutdown();
        assert!(!c.is_alive());
        drop(c);
        let _ = tx.send(started.elapsed());
    });
    let quick = rx.recv_timeout(Duration::from_secs(3));
    // Let the client's fault fail (its send returns), whatever happened.
    drop(uffd);
    let late = quick.is_err().then(|| rx.recv_timeout(Duration::from_secs(10)));
    sender.join().unwrap();
    // SAFETY: our mapping, no longer used.
    unsafe { libc::munmap(at, len) };
    assert!(quick.is_ok(), "ending the shared socket waited for the client's send ({late:?})");
}
