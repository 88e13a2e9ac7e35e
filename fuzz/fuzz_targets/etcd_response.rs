//! vrdmad's etcd client decoders on arbitrary bytes: the HTTP/1.1 response head, the body
//! (Content-Length, chunked, until close), and every JSON reply shape (range, txn, lease
//! keepalive, authenticate, error replies, newline-delimited watch messages with base64 keys
//! and values).
//!
//! Properties: never panics; an accepted response has a status in 100..600 and a body within
//! `MAX_BODY`; the incremental body decoder, fed the same bytes in pieces of any size (taken
//! from the input), produces exactly what the one-shot decoder produced.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdmad::store::etcd::{decode_response, fuzz_decode, parse_head, BodyDecoder, MAX_BODY, MAX_HEAD};

fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

fuzz_target!(|input: &[u8]| {
    let Some((&step, data)) = input.split_first() else { return };
    fuzz_decode(data);
    let one_shot = decode_response(data);
    if let Ok((status, body)) = &one_shot {
        assert!((100..600).contains(status));
        assert!(body.len() <= MAX_BODY);
    }
    let Some(end) = head_end(&data[..data.len().min(MAX_HEAD)]) else {
        assert!(one_shot.is_err());
        return;
    };
    let Ok(head) = parse_head(&data[..end]) else {
        assert!(one_shot.is_err());
        return;
    };
    let mut dec = BodyDecoder::new(head.framing, MAX_BODY);
    let (mut pending, mut out) = (Vec::new(), Vec::new());
    let mut failed = false;
    for piece in data[end..].chunks(usize::from(step).max(1)) {
        pending.extend_from_slice(piece);
        match dec.feed(&pending, &mut out) {
            Ok(n) => {
                assert!(n <= pending.len());
                pending.drain(..n);
            }
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    let incremental_ok = !failed && (dec.is_done() || dec.finish().is_ok());
    match one_shot {
        Ok((_, body)) => {
            assert!(incremental_ok, "one-shot accepted what the incremental decoder refused");
            assert_eq!(body, out, "decoders disagree");
        }
        Err(_) => assert!(!incremental_ok, "incremental accepted what the one-shot decoder refused"),
    }
});
