//! Sequences of requests a hostile peer sends to one of our QPs after the handshake (a peer
//! daemon on its connection, or a client on the lane it holds, which may write any frame),
//! executed by the engine's responder against four MRs of different rights, with receives
//! posted between them (`vrdmad::engine::fuzz_responder`).
//!
//! Properties: never panics or hangs; an MR changes only where a request it grants may write
//! (WRITE/atomic with REMOTE_WRITE/ATOMIC, a SEND into a posted receive's scatter list);
//! answers are well-formed frames, one per request at most; READ and atomic answers come only
//! where the MR grants them, with the MR's own bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vrdmad::engine::fuzz_responder(data);
});
