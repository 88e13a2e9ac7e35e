//! Out-of-band exchange over TCP (the container network), as RDMA applications do: QP
//! numbers, GIDs, buffer addresses and keys, then a line per synchronisation point.

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One side's connection details.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Endpoint {
    /// QP numbers, one per QP.
    pub qpns: Vec<u32>,
    /// GID (index 0), as 16 bytes.
    pub gid: Vec<u8>,
    /// Buffer address.
    pub addr: u64,
    /// Buffer rkey.
    pub rkey: u32,
    /// Bytes of buffer per area.
    pub stride: u64,
    /// Buffer areas: 1 when QPs share the buffer, else one per QP.
    #[serde(default)]
    pub areas: u64,
}

/// A line-oriented TCP exchange.
pub(crate) struct Oob {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Oob {
    /// Server side: waits for one client on `port`.
    pub(crate) fn accept(port: u16) -> anyhow::Result<Oob> {
        let l = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
        let (s, _) = l.accept()?;
        s.set_nodelay(true)?;
        Ok(Oob { r: BufReader::new(s.try_clone()?), w: s })
    }

    /// Client side: connects to `host:port`, retrying for a few seconds while the server
    /// starts.
    pub(crate) fn connect(host: &str, port: u16) -> anyhow::Result<Oob> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match TcpStream::connect((host, port)) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(Oob { r: BufReader::new(s.try_clone()?), w: s });
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e).with_context(|| format!("connecting to {host}:{port}")),
            }
        }
    }

    /// Sends a JSON value as one line.
    pub(crate) fn send<T: Serialize>(&mut self, v: &T) -> anyhow::Result<()> {
        let mut s = serde_json::to_string(v)?;
        s.push('\n');
        self.w.write_all(s.as_bytes())?;
        Ok(())
    }

    /// A flag that a thread sets when the peer's end of this connection closes (the peer
    /// exited or was killed) or fails. Loops that wait on memory for the peer's next write
    /// check it: a dead peer writes nothing more, and its QP's fate shows nowhere in our
    /// memory. The thread only waits for the hang-up (poll(2) for POLLRDHUP, never POLLIN),
    /// so it never reads what `recv` expects.
    pub(crate) fn watch_hangup(&self) -> anyhow::Result<Arc<AtomicBool>> {
        let gone = Arc::new(AtomicBool::new(false));
        let (stream, flag) = (self.w.try_clone()?, gone.clone());
        std::thread::Builder::new().name("peer-watch".into()).spawn(move || {
            let mut p = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
            loop {
                // SAFETY: one valid pollfd; the stream (and so its fd) lives in this thread.
                let n = unsafe { libc::poll(&mut p, 1, -1) };
                if n > 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    break;
                }
            }
            flag.store(true, Ordering::Relaxed);
        })?;
        Ok(gone)
    }

    /// Receives one JSON line.
    pub(crate) fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> anyhow::Result<T> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            bail!("peer closed the out-of-band connection");
        }
        Ok(serde_json::from_str(&line)?)
    }
}
