//! The record format of sealed frames (see vrdmad's `engine::connection::seal`), shared by
//! vrdmad and the client library, which seals what it writes on its lane itself.
//!
//! A record: `len` (u32, big-endian, the plaintext's length, 1..=[`RECORD_MAX`]), the
//! AES-128-GCM ciphertext (ring), the 16-byte tag; `len` is authenticated as associated data,
//! and the nonce is the record's sequence number in its direction (never sent: a record
//! opens only as the number the receiver expects next).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};

/// Largest plaintext of one record (a large frame goes in several).
pub const RECORD_MAX: usize = 16 * 1024;
/// Bytes a record adds to its plaintext: the length before it and the tag after it.
pub const RECORD_OVERHEAD: usize = LEN_BYTES + TAG_LEN;
const LEN_BYTES: usize = 4;
const TAG_LEN: usize = 16;
/// Bytes of a key.
pub const KEY_LEN: usize = 16;

/// Why a record was refused, or could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    /// The tag does not match: the record was altered, injected, replayed or reordered.
    #[error("record {seq} fails authentication (altered, injected, replayed or out of order)")]
    Forged {
        /// The sequence number it was opened with.
        seq: u64,
    },
    /// The length prefix is out of range.
    #[error("record {seq} claims {len} bytes")]
    BadLength {
        /// The sequence number it would have had.
        seq: u64,
        /// What it claims.
        len: usize,
    },
    /// The connection ended inside a record (cut short on the way).
    #[error("the connection ended inside record {seq}")]
    Truncated {
        /// The record's sequence number.
        seq: u64,
    },
    /// The sequence space is used up (2^64 records: never in practice).
    #[error("sequence numbers exhausted")]
    Exhausted,
}

/// One direction's key.
pub struct SealKey(LessSafeKey);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

impl SealKey {
    /// The key of `bytes`.
    pub fn new(bytes: &[u8; KEY_LEN]) -> SealKey {
        match UnboundKey::new(&AES_128_GCM, bytes) {
            Ok(k) => SealKey(LessSafeKey::new(k)),
            // (The only failure is a wrong key length, which the type excludes.)
            Err(_) => unreachable!("AES-128-GCM takes {KEY_LEN}-byte keys"),
        }
    }

    /// The records of a byte stream of `len` bytes that `fill(at, buf)` writes (`at`: where
    /// `buf` begins in the stream), numbered from `seq`, appended to `out`: the bytes are
    /// read once, into `out`, and sealed there. Returns the number after the last record.
    pub fn seal_filled_at(&self, seq: u64, out: &mut Vec<u8>, len: usize, fill: impl FnMut(usize, &mut [u8])) -> Result<u64, SealError> {
        // (Grown in place: a buffer the caller keeps across calls is not allocated again.)
        let start = out.len();
        out.resize(start + sealed_len(len), 0);
        self.seal_filled_into(seq, &mut out[start..], len, fill)
    }

    /// [`SealKey::seal_filled_at`] into `buf`, which is [`sealed_len`]`(len)` bytes long.
    pub fn seal_filled_into(&self, seq: u64, buf: &mut [u8], len: usize, mut fill: impl FnMut(usize, &mut [u8])) -> Result<u64, SealError> {
        debug_assert_eq!(buf.len(), sealed_len(len));
        let (mut at, mut pos, mut seq) = (0, 0, seq);
        while at < len {
            let n = (len - at).min(RECORD_MAX);
            let len_bytes = (n as u32).to_be_bytes();
            buf[pos..pos + LEN_BYTES].copy_from_slice(&len_bytes);
            let (start, end) = (pos + LEN_BYTES, pos + LEN_BYTES + n);
            fill(at, &mut buf[start..end]);
            let tag = self
                .0
                .seal_in_place_separate_tag(nonce(seq), Aad::from(len_bytes), &mut buf[start..end])
                .map_err(|_| SealError::Exhausted)?;
            buf[end..end + TAG_LEN].copy_from_slice(tag.as_ref());
            seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
            (at, pos) = (at + n, end + TAG_LEN);
        }
        Ok(seq)
    }

    /// The records of `pieces` (one byte stream, as [`SealKey::seal_filled_at`]).
    pub fn seal_at(&self, seq: u64, out: &mut Vec<u8>, pieces: &[&[u8]]) -> Result<u64, SealError> {
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        let (mut idx, mut off) = (0, 0);
        self.seal_filled_at(seq, out, total, |_, buf| {
            let mut done = 0;
            while done < buf.len() {
                let p = pieces[idx];
                let n = (p.len() - off).min(buf.len() - done);
                buf[done..done + n].copy_from_slice(&p[off..off + n]);
                (done, off) = (done + n, off + n);
                if off == p.len() {
                    (idx, off) = (idx + 1, 0);
                }
            }
        })
    }

    /// Opens record number `seq`, all of `record` (as [`record_len`] measured it), in place:
    /// its plaintext.
    pub fn open_at<'a>(&self, seq: u64, record: &'a mut [u8]) -> Result<&'a [u8], SealError> {
        let (len_bytes, body) = record.split_first_chunk_mut::<LEN_BYTES>().ok_or(SealError::BadLength { seq, len: 0 })?;
        let plain = self.0.open_in_place(nonce(seq), Aad::from(*len_bytes), body).map_err(|_| SealError::Forged { seq })?;
        Ok(plain)
    }
}

/// Bytes of the records of a `len`-byte stream.
pub fn sealed_len(len: usize) -> usize {
    len + len.div_ceil(RECORD_MAX) * RECORD_OVERHEAD
}

/// How many bytes the record at the start of `buf` (number `seq`) takes, once its length is
/// there.
pub fn record_len(seq: u64, buf: &[u8]) -> Result<Option<usize>, SealError> {
    let Some(len) = buf.first_chunk::<LEN_BYTES>() else { return Ok(None) };
    let len = u32::from_be_bytes(*len) as usize;
    if len == 0 || len > RECORD_MAX {
        return Err(SealError::BadLength { seq, len });
    }
    Ok(Some(len + RECORD_OVERHEAD))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_open_only_as_their_own_number() {
        let k = SealKey::new(&[1; KEY_LEN]);
        let mut out = Vec::new();
        let next = k.seal_at(7, &mut out, &[b"ab", b"", b"cde"]).unwrap();
        assert_eq!(next, 8);
        assert_eq!(record_len(7, &out).unwrap(), Some(out.len()));
        let mut again = out.clone();
        assert_eq!(k.open_at(7, &mut out).unwrap(), b"abcde");
        assert_eq!(k.open_at(8, &mut again), Err(SealError::Forged { seq: 8 }));
        let mut big = Vec::new();
        let data = vec![3u8; RECORD_MAX + 1];
        assert_eq!(k.seal_at(0, &mut big, &[&data[..10], &data[10..]]).unwrap(), 2);
        assert_eq!(big.len(), data.len() + 2 * RECORD_OVERHEAD);
    }

    /// Sealing and opening throughput (`cargo test --release -p vrdma-abi --lib
    /// seal_throughput -- --ignored --nocapture`): the cipher's cost per byte, apart from
    /// the network's.
    #[test]
    #[ignore]
    fn seal_throughput() {
        let k = SealKey::new(&[1; KEY_LEN]);
        let data = vec![7u8; 1 << 20];
        let rounds = 200;
        let t = std::time::Instant::now();
        let mut wire = Vec::new();
        for i in 0..rounds {
            wire.clear();
            k.seal_at(i * 64, &mut wire, &[&data]).unwrap();
        }
        let seal = t.elapsed();
        let t = std::time::Instant::now();
        for _ in 0..rounds {
            let mut w = wire.clone();
            let (mut at, mut seq) = (0, (rounds - 1) * 64);
            while at < w.len() {
                let n = record_len(seq, &w[at..]).unwrap().unwrap();
                k.open_at(seq, &mut w[at..at + n]).unwrap();
                (at, seq) = (at + n, seq + 1);
            }
        }
        let open = t.elapsed();
        let mbps = |d: std::time::Duration| (rounds as f64) * 1.048576 / d.as_secs_f64() * 1000.0 / 1000.0;
        eprintln!("AES-128-GCM records of 16 KiB: seal {:.0} MB/s, open (with a copy) {:.0} MB/s", mbps(seal), mbps(open));
        // What integrity alone would cost (no format of ours does it): the same key's tag
        // over each 16 KiB as associated data, nothing encrypted (GMAC).
        let t = std::time::Instant::now();
        for i in 0..rounds {
            for (j, chunk) in data.chunks(RECORD_MAX).enumerate() {
                let tag = k.0.seal_in_place_separate_tag(nonce(i * 64 + j as u64), Aad::from(chunk), &mut []).unwrap();
                let _ = std::hint::black_box(tag);
            }
        }
        eprintln!("AES-128-GCM tag over 16 KiB as associated data only (GMAC): {:.0} MB/s", mbps(t.elapsed()));
        let chacha = LessSafeKey::new(UnboundKey::new(&ring::aead::CHACHA20_POLY1305, &[1; 32]).unwrap());
        let t = std::time::Instant::now();
        for i in 0..rounds {
            for (j, chunk) in data.chunks(RECORD_MAX).enumerate() {
                let tag = chacha.seal_in_place_separate_tag(nonce(i * 64 + j as u64), Aad::from(chunk), &mut []).unwrap();
                let _ = std::hint::black_box(tag);
            }
        }
        eprintln!("ChaCha20-Poly1305 tag over 16 KiB as associated data only (Poly1305): {:.0} MB/s", mbps(t.elapsed()));
        let t = std::time::Instant::now();
        let mut buf = data.clone();
        for i in 0..rounds {
            for (j, chunk) in buf.chunks_mut(RECORD_MAX).enumerate() {
                let tag = chacha.seal_in_place_separate_tag(nonce(i * 64 + j as u64), Aad::empty(), chunk).unwrap();
                let _ = std::hint::black_box(tag);
            }
        }
        eprintln!("ChaCha20-Poly1305 records of 16 KiB: seal {:.0} MB/s", mbps(t.elapsed()));
        let t = std::time::Instant::now();
        let mut copy = vec![0u8; data.len()];
        for _ in 0..rounds {
            copy.copy_from_slice(&data);
            std::hint::black_box(&copy);
        }
        eprintln!("memcpy of the same bytes: {:.0} MB/s", mbps(t.elapsed()));
    }
}
