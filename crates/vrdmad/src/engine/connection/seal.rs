//! Sealed frames: after the TLS handshake, every byte a daemon connection or lane carries
//! goes in *records* sealed with AES-128-GCM (ring), one key per direction exported from the
//! connection's TLS session, and the record's sequence number (per direction, from 0) as
//! its nonce. The receiver opens records in order with the number it expects, so an altered,
//! injected, replayed, reordered or dropped record fails to open; the connection then ends.
//!
//! A record: `len` (u32, big-endian, the plaintext's length, 1..=[`RECORD_MAX`]), the
//! ciphertext, the 16-byte tag; `len` is authenticated as associated data. Records do not
//! follow frame boundaries: a writer seals whatever it writes in one call (a frame, a batch
//! of frames, part of a large one); the reader hands on the plaintext as a byte stream.

use vrdma_abi::shm::SharedMapping;

use vrdma_abi::seal::record_len;
pub(crate) use vrdma_abi::seal::sealed_len;
pub(crate) use vrdma_abi::seal::SealKey;
pub use vrdma_abi::seal::{SealError, KEY_LEN, RECORD_MAX, RECORD_OVERHEAD};

/// Labels of the two directions' keys (RFC 8446 exporters; distinct per direction).
pub(crate) const LABEL_CLIENT_TO_SERVER: &[u8] = b"EXPORTER-vrdma-frames-client-to-server";
pub(crate) const LABEL_SERVER_TO_CLIENT: &[u8] = b"EXPORTER-vrdma-frames-server-to-client";

/// The keys of one connection, from its TLS session: what we send with, what we receive with.
pub struct FrameKeys {
    /// Seals what this end sends.
    pub send: [u8; KEY_LEN],
    /// Opens what this end receives.
    pub recv: [u8; KEY_LEN],
}

impl std::fmt::Debug for FrameKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKeys(..)")
    }
}

/// Where a sender's next sequence number is kept.
enum Seq {
    /// Here: we are the connection's only writer.
    Own(u64),
    /// In a word of a lane's channel page (at this offset of the mapping), shared with the
    /// client library, which seals what it writes on the lane itself while it holds the send
    /// side (see `lane::send_side`). A client that changes it breaks only its own lane.
    Shared(SharedMapping, usize),
}

/// The sending half: seals what is written, in order.
pub struct Sealer {
    key: SealKey,
    /// The key's bytes (a lane hands them to its client).
    bytes: [u8; KEY_LEN],
    seq: Seq,
}

impl Sealer {
    /// A sealer whose first record is number 0.
    pub fn new(k: &[u8; KEY_LEN]) -> Sealer {
        Sealer { key: SealKey::new(k), bytes: *k, seq: Seq::Own(0) }
    }

    /// The key (for a lane's client).
    pub(crate) fn key_bytes(&self) -> [u8; KEY_LEN] {
        self.bytes
    }

    fn next(&self) -> u64 {
        match &self.seq {
            Seq::Own(n) => *n,
            Seq::Shared(m, at) => m.region().load_u64(*at).unwrap_or(u64::MAX),
        }
    }

    fn set_next(&mut self, n: u64) {
        match &mut self.seq {
            Seq::Own(x) => *x = n,
            Seq::Shared(m, at) => {
                let _ = m.region().store_u64(*at, n);
            }
        }
    }

    /// From now on the sequence number is kept in the word at `at` of `map` (set to ours).
    pub(crate) fn share_sequence(&mut self, map: SharedMapping, at: usize) {
        let n = self.next();
        let _ = map.region().store_u64(at, n);
        self.seq = Seq::Shared(map, at);
    }

    /// The records of `pieces` (one byte stream), appended to `out`; the next sequence
    /// numbers are used. Nothing is appended for no bytes.
    pub fn seal_into(&mut self, out: &mut Vec<u8>, pieces: &[&[u8]]) -> Result<(), SealError> {
        let next = self.key.seal_at(self.next(), out, pieces)?;
        self.set_next(next);
        Ok(())
    }

    /// The records of a byte stream of `len` bytes that `fill(at, buf)` writes (`at`: where
    /// `buf` begins in the stream), appended to `out`: the bytes are read once, into `out`.
    pub(crate) fn seal_filled(&mut self, out: &mut Vec<u8>, len: usize, fill: impl FnMut(usize, &mut [u8])) -> Result<(), SealError> {
        let next = self.key.seal_filled_at(self.next(), out, len, fill)?;
        self.set_next(next);
        Ok(())
    }

    /// The records of `pieces` as they were sealed before, from number `seq` (a lane's
    /// client sealed them and could not write them all): the counter does not move.
    pub(crate) fn reseal(&self, seq: u64, pieces: &[&[u8]]) -> Result<Vec<u8>, SealError> {
        let mut out = Vec::new();
        self.key.seal_at(seq, &mut out, pieces)?;
        Ok(out)
    }

    /// Reserves the numbers of the next `records` records (sealed later, with
    /// [`Sealer::key`], in their order on the wire): the first of them.
    pub(crate) fn reserve(&mut self, records: u64) -> Result<u64, SealError> {
        let first = self.next();
        self.set_next(first.checked_add(records).ok_or(SealError::Exhausted)?);
        Ok(first)
    }

    /// The key (to seal records whose numbers were reserved).
    pub(crate) fn key(&self) -> &SealKey {
        &self.key
    }

    /// [`Sealer::seal_into`] a new buffer.
    pub fn seal(&mut self, pieces: &[&[u8]]) -> Result<Vec<u8>, SealError> {
        let mut out = Vec::new();
        self.seal_into(&mut out, pieces)?;
        Ok(out)
    }
}

/// The receiving half: opens records in order from the bytes received.
pub struct Opener {
    key: SealKey,
    seq: u64,
}

impl Opener {
    /// An opener expecting record number 0 first.
    pub fn new(k: &[u8; KEY_LEN]) -> Opener {
        Opener { key: SealKey::new(k), seq: 0 }
    }

    /// Records opened so far.
    pub fn opened(&self) -> u64 {
        self.seq
    }

    /// The refusal of a record the connection ended inside.
    pub fn truncated(&self) -> SealError {
        SealError::Truncated { seq: self.seq }
    }

    /// How many bytes the record at the start of `buf` takes, once its length is there.
    pub fn record_len(&self, buf: &[u8]) -> Result<Option<usize>, SealError> {
        record_len(self.seq, buf)
    }

    /// Opens the record that is all of `record` (as [`Opener::record_len`] measured it), in
    /// place: its plaintext.
    pub fn open<'a>(&mut self, record: &'a mut [u8]) -> Result<&'a [u8], SealError> {
        let seq = self.seq;
        let plain = self.key.open_at(seq, record)?;
        self.seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
        Ok(plain)
    }
}

/// The fuzzer's entry point (`fuzz/fuzz_targets/sealed_frames.rs`): `data` as what a peer
/// sends after the handshake, cut into the reads `cuts` gives, against a receiver with a key
/// the peer does not have; and the same bytes sealed by a sender with the right key, with
/// bytes flipped where `data` says. Panics if a forged record opens, or if a record the
/// sender sealed opens to other bytes than it sealed.
pub fn fuzz_sealed_stream(data: &[u8]) {
    let (forged_key, real_key) = ([7u8; KEY_LEN], [9u8; KEY_LEN]);
    // Whatever arrives under a key the sender does not hold never opens.
    let mut o = Opener::new(&forged_key);
    let mut buf = data.to_vec();
    if let Ok(Some(n)) = o.record_len(&buf) {
        if n <= buf.len() {
            assert!(o.open(&mut buf[..n]).is_err(), "a record not sealed with our key opened");
        }
    }
    // A sealed stream opens to what was sealed, record by record; any flipped byte, and
    // everything after it, is refused.
    let Some((&flip_at, payload)) = data.split_first() else { return };
    let mut s = Sealer::new(&real_key);
    let mut wire = Vec::new();
    for chunk in payload.chunks(97) {
        assert!(s.seal_into(&mut wire, &[chunk]).is_ok(), "sealing failed");
    }
    let flip = (!wire.is_empty() && flip_at & 1 == 1).then(|| usize::from(flip_at) * 131 % wire.len());
    if let Some(i) = flip {
        wire[i] ^= 1 << (flip_at % 8);
    }
    let mut o = Opener::new(&real_key);
    let (mut at, mut plain) = (0, Vec::new());
    let mut failed = false;
    while at < wire.len() {
        match o.record_len(&wire[at..]) {
            Ok(Some(n)) if at + n <= wire.len() => match o.open(&mut wire[at..at + n]) {
                Ok(p) => {
                    plain.extend_from_slice(p);
                    at += n;
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            },
            _ => {
                failed = true;
                break;
            }
        }
    }
    match flip {
        None => assert_eq!(plain, payload, "a sealed stream opened to other bytes"),
        Some(_) => {
            assert!(failed, "a stream with a flipped byte opened whole");
            assert!(payload.starts_with(&plain), "a record opened to other bytes than were sealed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Sealer, Opener) {
        let k = [5u8; KEY_LEN];
        (Sealer::new(&k), Opener::new(&k))
    }

    /// Opens every whole record of `wire` in order; the plaintext, or the first refusal.
    fn open_all(o: &mut Opener, wire: &mut [u8]) -> Result<Vec<u8>, SealError> {
        let (mut at, mut out) = (0, Vec::new());
        while let Some(n) = o.record_len(&wire[at..])? {
            if at + n > wire.len() {
                return Err(o.truncated());
            }
            out.extend_from_slice(o.open(&mut wire[at..at + n])?);
            at += n;
            if at == wire.len() {
                break;
            }
        }
        Ok(out)
    }

    #[test]
    fn a_stream_opens_to_what_was_sealed_across_pieces_and_records() {
        let (mut s, mut o) = pair();
        let big: Vec<u8> = (0..RECORD_MAX * 2 + 100).map(|i| i as u8).collect();
        let mut wire = s.seal(&[b"head", &[], &big, b"tail"]).unwrap();
        assert_eq!(wire.len(), 4 + big.len() + 4 + 3 * RECORD_OVERHEAD);
        let plain = open_all(&mut o, &mut wire).unwrap();
        assert_eq!(plain, [&b"head"[..], &big, b"tail"].concat());
        assert_eq!(o.opened(), 3);
        assert!(s.seal(&[]).unwrap().is_empty());
        // Filled in place: the same records as from pieces.
        let (mut a, mut b) = (pair().0, pair().0);
        let mut filled = Vec::new();
        a.seal_filled(&mut filled, big.len(), |at, buf| buf.copy_from_slice(&big[at..at + buf.len()])).unwrap();
        assert_eq!(filled, b.seal(&[&big]).unwrap());
    }

    #[test]
    fn flipped_replayed_reordered_and_injected_records_are_refused() {
        let (mut s, _) = pair();
        let r0 = s.seal(&[b"frame zero"]).unwrap();
        let r1 = s.seal(&[b"frame one"]).unwrap();
        let fresh = || pair().1;
        // A bit flipped anywhere: in the length, the ciphertext, the tag.
        for i in 0..r0.len() {
            let mut w = r0.clone();
            w[i] ^= 0x10;
            assert!(open_all(&mut fresh(), &mut w).is_err(), "flip at {i} opened");
        }
        // Replayed: the same record twice.
        let mut o = fresh();
        let mut w = [r0.clone(), r0.clone()].concat();
        assert_eq!(open_all(&mut o, &mut w), Err(SealError::Forged { seq: 1 }));
        // Reordered, or one dropped.
        let mut w = [r1.clone(), r0.clone()].concat();
        assert_eq!(open_all(&mut fresh(), &mut w), Err(SealError::Forged { seq: 0 }));
        // Injected: bytes made up, or a record sealed with another key.
        let mut w = [&[0, 0, 0, 3][..], b"abc", &[0; 16]].concat();
        assert!(open_all(&mut fresh(), &mut w).is_err());
        let mut w = Sealer::new(&[6u8; KEY_LEN]).seal(&[b"frame zero"]).unwrap();
        assert!(open_all(&mut fresh(), &mut w).is_err());
        // An absurd length is refused before anything is read for it.
        assert!(matches!(fresh().record_len(&[0xff, 0xff, 0xff, 0xff]), Err(SealError::BadLength { .. })));
        assert!(matches!(fresh().record_len(&[0, 0, 0, 0]), Err(SealError::BadLength { .. })));
    }

    #[test]
    fn the_fuzz_entry_holds_on_samples() {
        fuzz_sealed_stream(b"");
        fuzz_sealed_stream(&[0]);
        fuzz_sealed_stream(&[1, 2, 3]);
        let long: Vec<u8> = (0..2000).map(|i| (i * 31) as u8).collect();
        fuzz_sealed_stream(&long);
        let mut odd = long.clone();
        odd[0] = 0x33;
        fuzz_sealed_stream(&odd);
        fuzz_sealed_stream(&[0, 0, 0, 4, 1, 2, 3, 4]);
    }
}
