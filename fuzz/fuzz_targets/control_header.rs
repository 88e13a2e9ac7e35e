//! `Header::parse` on arbitrary datagrams, plus the public bounds-checked `Reader` driven by
//! an op sequence taken from the input.
//!
//! Properties: never panics; an accepted header is exactly the little-endian fields of the
//! first `HEADER_LEN` bytes, with the right magic and version, and a length that matches the
//! datagram; `Header::is_valid` agrees with `parse`; the reader never reads out of bounds and
//! its errors are consistent with what is left.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_abi::control::{DecodeError, Header, Reader, HEADER_LEN, MAGIC, MAX_MESSAGE, MAX_STRING, VERSION};

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn check_header(data: &[u8]) {
    match Header::parse(data) {
        Ok(h) => {
            assert!(data.len() >= HEADER_LEN && data.len() <= MAX_MESSAGE);
            assert_eq!(h.magic, MAGIC);
            assert_eq!(h.version, VERSION);
            assert_eq!(h.magic, le32(&data[0..4]));
            assert_eq!(h.version, le16(&data[4..6]));
            assert_eq!(h.op, le16(&data[6..8]));
            assert_eq!(h.seq, le32(&data[8..12]));
            assert_eq!(h.len, le32(&data[12..16]));
            assert_eq!(h.len as usize, data.len() - HEADER_LEN);
            assert_eq!(h.is_valid(data.len() - HEADER_LEN), Ok(()));
        }
        Err(DecodeError::ShortHeader { len, need }) => {
            assert_eq!((len, need), (data.len(), HEADER_LEN));
            assert!(data.len() < HEADER_LEN);
        }
        Err(DecodeError::TooLong { len, max }) => {
            assert_eq!((len, max), (data.len(), MAX_MESSAGE));
            assert!(data.len() > MAX_MESSAGE);
        }
        Err(e) => {
            // Rejected on content: re-check through is_valid on the raw fields.
            assert!(data.len() >= HEADER_LEN && data.len() <= MAX_MESSAGE);
            let h = Header {
                magic: le32(&data[0..4]),
                version: le16(&data[4..6]),
                op: le16(&data[6..8]),
                seq: le32(&data[8..12]),
                len: le32(&data[12..16]),
            };
            assert_eq!(h.is_valid(data.len() - HEADER_LEN), Err(e));
        }
    }
}

/// Drives a `Reader` over `payload` with ops taken from `ops`, tracking the position to
/// check every success and failure.
fn check_reader(ops: &[u8], payload: &[u8]) {
    let mut r = Reader::new(payload);
    let mut pos = 0usize;
    for &op in ops.iter().take(256) {
        let left = payload.len() - pos;
        let res = match op % 9 {
            0 => r.u8().map(|_| 1),
            1 => r.u16().map(|_| 2),
            2 => r.u32().map(|_| 4),
            3 => r.i32().map(|_| 4),
            4 => r.u64().map(|_| 8),
            5 => r.gid().map(|_| 16),
            6 => r.string().map(|s| {
                assert!(s.len() <= MAX_STRING);
                2 + s.len()
            }),
            7 => {
                let max = usize::from(op >> 4) * 8;
                r.count("thing", max).map(|n| {
                    assert!(n <= max);
                    2
                })
            }
            _ => {
                let fin = r.finish();
                assert_eq!(fin.is_ok(), left == 0);
                if let Err(DecodeError::Trailing { extra }) = fin {
                    assert_eq!(extra, left);
                }
                fin.map(|()| 0)
            }
        };
        match res {
            Ok(n) => {
                assert!(n <= left, "reader returned bytes it did not have");
                pos += n;
            }
            Err(DecodeError::Truncated { offset, need, have }) => {
                // A string's or count's u16 prefix may have been consumed before failing.
                assert!(need > have, "truncated although {need} <= {have}");
                assert!(offset >= pos && offset <= payload.len());
                assert_eq!(offset + have, payload.len());
                pos = offset;
            }
            Err(DecodeError::TooMany { .. }) | Err(DecodeError::BadString) => {
                // The u16 prefix (and, for BadString, the bytes) were consumed; stop rather
                // than re-derive the position.
                return;
            }
            Err(DecodeError::Trailing { .. }) => {}
            Err(e) => panic!("unexpected reader error {e:?}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check_header(data);
    // First byte: number of op bytes that follow; the rest is the reader's payload.
    if let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n).min(rest.len());
        check_reader(&rest[..n], &rest[n..]);
    }
});
