//! The host-to-host frame decoder (`vrdma_abi::wire`): a peer daemon is untrusted input.
//!
//! Properties: `FrameHeader::decode` and `ConnectReq::decode` never panic on any bytes; a
//! header that decodes re-encodes to the same bytes except nothing (round trip), its data
//! length respects its kind's bound, and a CONNECT_REQ that decodes round-trips too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_abi::wire::{self, ConnectReq, FrameHeader, Kind, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if data.len() >= HEADER_LEN {
        let mut b = [0u8; HEADER_LEN];
        b.copy_from_slice(&data[..HEADER_LEN]);
        if let Ok(h) = FrameHeader::decode(&b) {
            assert_eq!(h.encode(), b, "decode/encode round trip");
            match h.kind {
                Kind::Write | Kind::Send | Kind::ReadResp => assert!(h.data_len <= wire::MAX_MESSAGE),
                Kind::Hello | Kind::Lane | Kind::ConnectReq | Kind::ConnectRep => assert!(h.data_len <= wire::MAX_CONTROL_DATA),
                Kind::UdSend => assert!(h.data_len as usize <= vrdma_abi::ud::UD_FRAME_MAX),
                _ => assert_eq!(h.data_len, 0),
            }
            if h.kind == Kind::ReadReq {
                assert!(h.arg1 <= u64::from(wire::MAX_MESSAGE));
            }
        }
    }
    let rest = data.get(HEADER_LEN.min(data.len())..).unwrap_or_default();
    if let Ok(c) = ConnectReq::decode(rest) {
        assert_eq!(ConnectReq::decode(&c.encode()).expect("re-decodes"), c);
    }
    let _ = wire::text(rest);
});
