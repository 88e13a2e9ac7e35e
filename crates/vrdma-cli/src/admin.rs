//! Client of vrdmad's admin socket (JSON lines), over [`vrdmad::admin_client`]: the socket
//! in `$VRDMA_RUN_DIR` (default /run/vrdma).

/// Sends one admin request; returns the reply when `ok`.
pub fn call(req: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    Ok(vrdmad::admin_client::call(&vrdmad::admin_client::default_socket(), &req, None)?)
}
