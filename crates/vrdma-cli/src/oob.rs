//! Out-of-band exchange over TCP (the container network), as RDMA applications do: QP
//! numbers, GIDs, buffer addresses and keys, then a line per synchronisation point.

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// One side's connection details.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Endpoint {
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
pub struct Oob {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Oob {
    /// Server side: waits for one client on `port`.
    pub fn accept(port: u16) -> anyhow::Result<Oob> {
        let l = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
        let (s, _) = l.accept()?;
        s.set_nodelay(true)?;
        Ok(Oob { r: BufReader::new(s.try_clone()?), w: s })
    }

    /// Client side: connects to `host:port`, retrying for a few seconds while the server
    /// starts.
    pub fn connect(host: &str, port: u16) -> anyhow::Result<Oob> {
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
    pub fn send<T: Serialize>(&mut self, v: &T) -> anyhow::Result<()> {
        let mut s = serde_json::to_string(v)?;
        s.push('\n');
        self.w.write_all(s.as_bytes())?;
        Ok(())
    }

    /// Receives one JSON line.
    pub fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> anyhow::Result<T> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            bail!("peer closed the out-of-band connection");
        }
        Ok(serde_json::from_str(&line)?)
    }
}
