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
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// The connection broke or timed out mid-request.
    #[error("talking to vrdmad at {}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// What broke.
        source: std::io::Error,
    },
    /// The reply was not JSON.
    #[error("vrdmad's reply")]
    BadReply {
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// vrdmad answered with an error.
    #[error("{message}")]
    Refused {
        /// vrdmad's `error`.
        message: String,
    },
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A one-shot admin socket answering `reply` to the first line.
    fn server(tag: &str, reply: &'static str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("vrdmad-admin-client-{tag}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut line = String::new();
            BufReader::new(s.try_clone().unwrap()).read_line(&mut line).unwrap();
            writeln!(&s, "{reply}").unwrap();
        });
        path
    }

    #[test]
    fn ok_replies_are_returned_and_errors_typed() {
        let p = server("ok", r#"{"ok": true, "x": 1}"#);
        assert_eq!(call(&p, &serde_json::json!({"op": "list"}), Some(Duration::from_secs(5))).unwrap()["x"], 1);
        let p = server("refused", r#"{"ok": false, "error": "no vNIC named a"}"#);
        let e = call(&p, &serde_json::json!({"op": "delete", "name": "a"}), None).unwrap_err();
        assert!(matches!(&e, AdminClientError::Refused { message } if message == "no vNIC named a"), "{e}");
        let p = server("garbage", "not json");
        assert!(matches!(call(&p, &serde_json::json!({}), None), Err(AdminClientError::BadReply { .. })));
        let e = call(Path::new("/nonexistent/admin.sock"), &serde_json::json!({}), None).unwrap_err();
        assert!(matches!(e, AdminClientError::Connect { .. }));
        assert!(e.to_string().contains("is vrdmad running?"));
    }
}
