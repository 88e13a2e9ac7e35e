//! Client of vrdmad's admin socket (JSON lines).

use anyhow::{bail, Context as _};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

/// vrdmad's run directory (`$VRDMA_RUN_DIR`, default /run/vrdma).
pub fn run_dir() -> PathBuf {
    std::env::var_os("VRDMA_RUN_DIR").map(PathBuf::from).unwrap_or_else(|| "/run/vrdma".into())
}

/// Sends one admin request; returns the reply when `ok`.
pub fn call(req: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    let path = run_dir().join("admin.sock");
    let s = UnixStream::connect(&path).with_context(|| format!("connecting to vrdmad at {} (is vrdmad running?)", path.display()))?;
    let mut w = s.try_clone()?;
    writeln!(w, "{req}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    let v: serde_json::Value = serde_json::from_str(&line).context("vrdmad's reply")?;
    if v["ok"] != serde_json::Value::Bool(true) {
        bail!("{}", v["error"].as_str().unwrap_or("vrdmad refused the request"));
    }
    Ok(v)
}

/// The `BAD_REQ/KEY` column of `vrdma vnic list`: requests refused as malformed or naming
/// objects the vNIC does not own, and remote keys refused (not a peer's MR, beyond its
/// rights, or throttled after too many).
pub fn bad_counts(counters: &serde_json::Value) -> String {
    let n = |k: &str| counters[k].as_u64().unwrap_or(0);
    format!("{}/{}", n("bad_requests"), n("bad_keys"))
}
