//! `Request::decode` on arbitrary datagrams: vrdmad decodes every request a client sends.
//!
//! Properties: never panics; a decoded request re-encodes (with the same seq) to exactly the
//! bytes received (the request encoding is canonical), and decoding that again yields the
//! same value. A direct copy (`PeerMrCopy`) never decodes with more than
//! `MAX_DIRECT_COPY` bytes: vrdmad sizes its copy by that bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_abi::control::{Header, Request, MAX_DIRECT_COPY};

fuzz_target!(|data: &[u8]| {
    let decoded = Request::decode(data);
    match &decoded {
        Ok((seq, req)) => {
            let h = Header::parse(data).expect("a decoded request has a valid header");
            assert_eq!(h.seq, *seq, "decode returned a seq other than the header's");
            if let Request::PeerMrCopy { len, .. } = req {
                assert!(*len as usize <= MAX_DIRECT_COPY, "a direct copy of {len} bytes decoded");
            }

            let bytes = req.encode(*seq);
            let again = Request::decode(&bytes).expect("a re-encoded request must decode");
            assert_eq!(&again, decoded.as_ref().unwrap(), "round trip changed the request");
            assert_eq!(bytes, data, "request encoding is not canonical");
        }
        Err(e) => {
            // A bad header must be reported as such, with the same error as Header::parse.
            if let Err(he) = Header::parse(data) {
                assert_eq!(*e, he, "decode and Header::parse disagree on a bad header");
            }
        }
    }
});
