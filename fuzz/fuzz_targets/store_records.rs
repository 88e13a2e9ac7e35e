//! Store records as a hostile etcd client writes them: a sequence of key puts, deletes and
//! resyncs (lines of `KEY\tVALUE`, `KEY`, `!`), decoded as vrdmad's watch decodes them and
//! passed through the guard that stands between the store and the daemon.
//!
//! Properties (semantic, not only decoding): never panics; every record the guard lets
//! through has a name of `[A-Za-z0-9][A-Za-z0-9._-]{0,62}` equal to its key, an address inside
//! the container network, limits in range; no two admitted vNICs (or hosts) share an address.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vrdmad::store::fuzz_records(data);
});
