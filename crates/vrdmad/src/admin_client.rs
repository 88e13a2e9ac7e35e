//! Client side of the admin socket (see [`crate::admin`]): one JSON line out, one back.
//! Shared by the `vrdma` CLI and the CNI plugin.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// vrdmad's run directory when `VRDMA_RUN_DIR` is not set.
pub const DEFAULT_RUN_DIR: &str = "/run/vrdma";

/// Why an admin request got no `ok` answer.
#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    /// The socket could not be reached: vrdmad is not running (or not here).
    #[error("connecting to vrdmad at {} (is vrdmad running?)", path.display())]
    Connect { path: PathBuf, source: std::io::Error },
    /// The connection broke or timed out mid-request.
    #[error("talking to vrdmad at {}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// The reply was not JSON.
    #[error("vrdmad's reply")]
    BadReply { source: serde_json::Error },
    /// vrdmad answered with an error.
    #[error("{message}")]
    Refused { message: String },
}

/// vrdmad's run directory (`$VRDMA_RUN_DIR`, default [`DEFAULT_RUN_DIR`]).
pub fn run_dir() -> PathBuf {
    std::env::var_os("VRDMA_RUN_DIR").map(PathBuf::from).unwrap_or_else(|| DEFAULT_RUN_DIR.into())
}

/// The admin socket in [`run_dir`].
pub fn default_socket() -> PathBuf {
    run_dir().join("admin.sock")
}

/// Sends one request to the admin socket at `socket`; returns the reply when it is `ok`.
/// `timeout` bounds each read and write (None: wait as long as it takes).
pub fn call(socket: &Path, req: &serde_json::Value, timeout: Option<Duration>) -> Result<serde_json::Value, AdminClientError> {
    let path = || socket.to_path_buf();
    let s = UnixStream::connect(socket).map_err(|source| AdminClientError::Connect { path: path(), source })?;
    let io = |source| AdminClientError::Io { path: path(), source };
    s.set_read_timeout(timeout).map_err(io)?;
    s.set_write_timeout(timeout).map_err(io)?;
    let mut w = s.try_clone().map_err(io)?;
    writeln!(w, "{req}").map_err(io)?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).map_err(io)?;
    let v: serde_json::Value = serde_json::from_str(&line).map_err(|source| AdminClientError::BadReply { source })?;
    if v["ok"] != serde_json::Value::Bool(true) {
        let message = v["error"].as_str().unwrap_or("vrdmad refused the request").to_string();
        return Err(AdminClientError::Refused { message });
    }
    Ok(v)
}
