//! The fuzzer's entry point for a sealed connection's reader
//! (`fuzz/fuzz_targets/sealed_frames.rs`): a stream of frames, sealed in records of the
//! sizes the input picks, read back through [`Conn`] as an engine's reader reads them.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use vrdma_abi::wire::{FrameHeader, HEADER_LEN};

use super::seal::{fuzz_sealed_stream, FrameKeys, Sealer, KEY_LEN};
use super::{Conn, PeerRx};

/// The frames (kind and data length) of `plain` a reader of it must deliver: whole ones
/// that decode, up to the first that does not.
fn frames_of(plain: &[u8]) -> Vec<(u8, u32)> {
    let (mut at, mut out) = (0, Vec::new());
    while let Some(head) = plain.get(at..at + HEADER_LEN) {
        let Ok(h) = FrameHeader::decode(head.try_into().unwrap_or(&[0; HEADER_LEN])) else { break };
        let end = at + HEADER_LEN + h.data_len as usize;
        if end > plain.len() {
            break;
        }
        out.push((h.kind as u8, h.data_len));
        at = end;
    }
    out
}

/// `data`: a byte picking the record sizes, then the plaintext stream a peer sends. Panics
/// if the sealed reader delivers other frames than the plaintext holds (in order, whole,
/// none invented), or reads on past its end. Also runs [`fuzz_sealed_stream`] on `data`.
pub fn fuzz_sealed_reader(data: &[u8]) {
    fuzz_sealed_stream(data);
    let Some((&seed, plain)) = data.split_first() else { return };
    let expected = frames_of(plain);
    let Ok(l) = TcpListener::bind("127.0.0.1:0") else { return };
    let Ok(far) = l.local_addr().and_then(TcpStream::connect) else { return };
    let Ok((ours, _)) = l.accept() else { return };
    let _ = ours.set_read_timeout(Some(Duration::from_secs(5)));
    let keys = FrameKeys { send: [3; KEY_LEN], recv: [4; KEY_LEN] };
    let c = Conn::new(ours, std::net::SocketAddr::from(([127, 0, 0, 1], 1)));
    c.seal_frames(&keys, Arc::new(AtomicU64::new(0)));
    // Records of the sizes the seed picks (1 to 300 bytes, and whole 16 KiB ones).
    let step = if seed == 0 { usize::MAX } else { usize::from(seed) * 7 % 300 + 1 };
    let mut wire = Vec::new();
    let mut s = Sealer::new(&keys.recv);
    for chunk in plain.chunks(step.min(plain.len().max(1))) {
        assert!(s.seal_into(&mut wire, &[chunk]).is_ok(), "sealing failed");
    }
    let writer = std::thread::spawn(move || {
        let mut far = far;
        let _ = far.write_all(&wire);
    });
    let live = PeerRx::new();
    let mut got = Vec::new();
    while let Ok((h, _)) = c.read_header(&live, Duration::from_secs(5)) {
        let mut body = vec![0u8; (h.data_len as usize).min(plain.len())];
        if body.len() < h.data_len as usize || c.read_exact(&mut body).is_err() {
            break;
        }
        got.push((h.kind as u8, h.data_len));
        if got.len() > expected.len() {
            break;
        }
    }
    let _ = writer.join();
    assert_eq!(got, expected, "the sealed reader delivered other frames than were sent");
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_abi::wire::Kind;

    #[test]
    fn sealed_readers_deliver_the_frames_sent_whatever_the_record_sizes() {
        let mut plain = Vec::new();
        for (kind, len) in [(Kind::Heartbeat, 0usize), (Kind::Write, 5000), (Kind::Send, 3), (Kind::HeartbeatAck, 0)] {
            let mut h = FrameHeader::new(kind);
            h.data_len = len as u32;
            plain.extend_from_slice(&h.encode());
            plain.extend((0..len).map(|i| i as u8));
        }
        for seed in [0u8, 1, 9, 42, 255] {
            fuzz_sealed_reader(&[&[seed][..], &plain].concat());
            // Cut short, and with garbage after the frames.
            fuzz_sealed_reader(&[&[seed][..], &plain[..plain.len() - 2]].concat());
            fuzz_sealed_reader(&[&[seed][..], &plain, b"garbage"].concat());
        }
        fuzz_sealed_reader(&[]);
        fuzz_sealed_reader(&[7]);
    }
}
