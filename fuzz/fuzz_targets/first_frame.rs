//! A peer's first frame (HELLO or LANE: a 64-byte header, then `HOST\nADDR`), decoded as an
//! accepting vrdmad decodes it, and the identity it claims judged against a cluster view.
//!
//! Properties: never panics; a claimed host name is accepted only if it is a valid record
//! name; an identity is accepted only where the view has that host at that address.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vrdmad::engine::fuzz_first_frame(data);
});
