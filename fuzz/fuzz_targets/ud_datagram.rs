//! UD datagrams to other hosts (`vrdma_abi::ud`): a client's message on its datagram socket
//! and a peer daemon's UD_SEND frame data are both untrusted input.
//!
//! Properties: `UdDatagram::decode` and `split_frame` never panic on any bytes; whatever
//! decodes respects the MTU, carries only known flags, and re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_abi::ud::{self, UdDatagram, UD_DATAGRAM_HEADER, UD_F_IMM, UD_F_SOLICITED, UD_FRAME_GIDS, UD_MTU};

fuzz_target!(|data: &[u8]| {
    if let Ok((d, payload)) = UdDatagram::decode(data) {
        assert!(payload.len() <= UD_MTU);
        assert_eq!(d.flags & !(UD_F_IMM | UD_F_SOLICITED), 0);
        assert_eq!(&d.encode_header()[..], &data[..UD_DATAGRAM_HEADER], "decode/encode round trip");
        assert_eq!(payload, &data[UD_DATAGRAM_HEADER..]);
    }
    if let Ok(f) = ud::split_frame(data) {
        assert!(f.payload.len() <= UD_MTU);
        assert_eq!(&f.src_gid[..], &data[..16]);
        assert_eq!(&f.dst_gid[..], &data[16..UD_FRAME_GIDS]);
        let _ = ud::grh(&f.src_gid, &f.dst_gid, f.payload.len());
    }
});
