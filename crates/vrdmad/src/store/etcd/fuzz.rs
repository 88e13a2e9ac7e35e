//! The fuzzer's entry point (`fuzz/fuzz_targets/etcd_response.rs`): every decoder of what
//! etcd sends, on arbitrary bytes.

use super::http::{decode_response, head_end, parse_head, BodyDecoder, MAX_BODY, MAX_HEAD};
use super::json::{decode_kv, from_json, status_message, AuthenticateResp, KeepAliveResp, RangeResp, TxnResp};
use super::keys::event_of;
use super::watch::decode_watch_message;

/// Decodes `data` as an HTTP response from etcd and its body as every reply shape we read
/// (unary replies, newline-delimited watch messages). Never panics.
pub fn fuzz_decode(data: &[u8]) {
    let body = match decode_response(data) {
        Ok((_, b)) => b,
        Err(_) => data.to_vec(),
    };
    if let Ok(r) = from_json::<RangeResp>(&body) {
        for kv in &r.kvs {
            if let Ok(e) = decode_kv(kv) {
                let _ = event_of(&e.key, Some(&e.value));
                let _ = event_of(&e.key, None);
            }
        }
    }
    let _ = from_json::<TxnResp>(&body);
    let _ = from_json::<KeepAliveResp>(&body);
    let _ = from_json::<AuthenticateResp>(&body);
    let _ = status_message(&body);
    for line in body.split(|&b| b == b'\n') {
        let _ = decode_watch_message(line);
    }
    // The incremental decoder fed in small pieces must agree with the one-shot one.
    if let Some(end) = head_end(&data[..data.len().min(MAX_HEAD)]) {
        if let Ok(h) = parse_head(&data[..end]) {
            let mut dec = BodyDecoder::new(h.framing, MAX_BODY);
            let (mut pending, mut out) = (Vec::new(), Vec::new());
            for piece in data[end..].chunks(7) {
                pending.extend_from_slice(piece);
                match dec.feed(&pending, &mut out) {
                    Ok(n) => {
                        pending.drain(..n);
                    }
                    Err(_) => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_of_every_shape_decode_without_panicking() {
        for data in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}\n\r\n0\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{\"token\":\"abc.1\"}",
            br#"{"kvs":[{"key":"L3ZyZG1hL3J1bGVzL2E=","value":"e30="}]}"#,
            br#"{"result":{"events":[{"kv":{"key":"!!"}}]}}"#,
            b"",
            b"\r\n\r\n",
            b"\xff\xfe",
        ] {
            fuzz_decode(data);
        }
    }
}
