//! Client of vrdmad's admin socket (JSON lines), over [`vrdmad::admin_client`]: the socket
//! in `$VRDMA_RUN_DIR` (default /run/vrdma).

/// Sends one admin request; returns the reply when `ok`.
pub(crate) fn call(req: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    Ok(vrdmad::admin_client::call(&vrdmad::admin_client::default_socket(), &req, None)?)
}

/// The `BAD_REQ/KEY` column of `vrdma vnic list`: requests refused as malformed or naming
/// objects the vNIC does not own, and remote keys refused (not a peer's MR, beyond its
/// rights, or throttled after too many).
pub(crate) fn bad_counts(counters: &serde_json::Value) -> String {
    let n = |k: &str| counters[k].as_u64().unwrap_or(0);
    format!("{}/{}", n("bad_requests"), n("bad_keys"))
}
