//! `Reply::decode` on arbitrary datagrams: the client library decodes every reply vrdmad
//! sends (a compromised or buggy daemon must not crash the application).
//!
//! Properties: never panics; a decoded reply re-encodes with the same seq to bytes that
//! decode to the same value, and that second encoding is a fixed point. (The reply encoding
//! is not canonical: an absent ring in `Connected` ignores the entries/max_sge words.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_abi::control::{Header, Reply};

fuzz_target!(|data: &[u8]| {
    let decoded = Reply::decode(data);
    match &decoded {
        Ok((seq, rep)) => {
            let h = Header::parse(data).expect("a decoded reply has a valid header");
            assert_eq!(h.seq, *seq, "decode returned a seq other than the header's");

            let bytes = rep.encode(*seq);
            assert_eq!(bytes.len(), data.len(), "re-encoding changed the message length");
            let again = Reply::decode(&bytes).expect("a re-encoded reply must decode");
            assert_eq!(&again, decoded.as_ref().unwrap(), "round trip changed the reply");
            assert_eq!(again.1.encode(*seq), bytes, "re-encoding is not a fixed point");
        }
        Err(e) => {
            if let Err(he) = Header::parse(data) {
                assert_eq!(*e, he, "decode and Header::parse disagree on a bad header");
            }
        }
    }
});
