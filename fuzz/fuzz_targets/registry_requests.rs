//! Control requests as hostile clients send them, statefully: sequences of requests from
//! several sessions of two vNICs of different tenants, handles taken from earlier replies
//! (any session's), sessions closing with objects held, vNICs deleted and limits lowered
//! under them (see `vrdmad::registry::fuzz_requests`).
//!
//! Properties: never panics; after every step each object belongs to a live session that
//! lists it, each vNIC's usage and charged queue memory equal what its sessions hold, and
//! no allocation succeeds past a limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vrdmad::registry::fuzz_requests(data);
});
