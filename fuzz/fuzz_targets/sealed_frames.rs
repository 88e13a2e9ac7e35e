//! What a peer sends after the TLS handshake, sealed (`vrdmad::engine::Sealer`): records of
//! sizes the input picks, read back through an engine connection's sealed reader; and
//! records forged, flipped, replayed or cut on the way.
//!
//! Properties: never panics; the reader delivers exactly the frames sent, in order, whole;
//! a record not sealed with the receiver's key, or with a flipped byte, never opens.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vrdmad::engine::fuzz_sealed_reader(data);
});
