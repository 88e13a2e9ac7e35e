//! The `--metrics ADDR` endpoint: a minimal HTTP/1.x responder on one thread, answering
//! `GET /metrics` (and HEAD) only. A request is read for at most [`READ_DEADLINE`] and
//! [`MAX_REQUEST`] bytes, then the connection is closed: a slow or hostile scraper delays
//! the next one by at most that, and never holds memory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::exposition::{encode_meters, HostCounters, CONTENT_TYPE};
use crate::server::Daemon;

/// Longest a request may take to arrive.
pub const READ_DEADLINE: Duration = Duration::from_secs(2);
/// Largest request head read.
pub const MAX_REQUEST: usize = 8192;

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound.
    #[error("metrics endpoint on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Its thread could not start.
    #[error("metrics endpoint thread")]
    Thread(#[source] std::io::Error),
}

/// Serves daemon `d`'s meters on `addr` (per-QP series too with `per_qp`); returns the
/// address bound (`addr` may name port 0).
pub fn serve(d: &Arc<Daemon>, addr: SocketAddr, per_qp: bool) -> Result<SocketAddr, MetricsError> {
    let l = TcpListener::bind(addr).map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = l.local_addr().map_err(|source| MetricsError::Bind { addr, source })?;
    let weak: Weak<Daemon> = Arc::downgrade(d);
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for s in l.incoming().flatten() {
                let Some(d) = weak.upgrade() else { return };
                let _ = answer(s, || {
                    let meters = d.registry.lock().vnic_meters();
                    let counters = HostCounters {
                        refused_peers: d.engine().refused_peers(),
                        refused_frames: d.engine().refused_frames(),
                        refused_claims: d.engine().refused_claims(),
                        firewall_refusals: crate::firewall::refused_connections(),
                        refused_store_records: d.store().refused_records(),
                    };
                    encode_meters(&meters, &d.host().name, per_qp, &counters)
                });
            }
        })
        .map_err(MetricsError::Thread)?;
    log::info!("metrics on http://{bound}/metrics");
    Ok(bound)
}

/// Reads the request head (bounded in time and size) of `s`.
fn read_head(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let start = Instant::now();
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let left = READ_DEADLINE.checked_sub(start.elapsed()).filter(|d| !d.is_zero());
        let Some(left) = left else { return Err(std::io::ErrorKind::TimedOut.into()) };
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
    }
    Ok(head)
}

/// The status line and body for request head `head`.
fn route(head: &[u8], body: impl FnOnce() -> String) -> (&'static str, &'static str, String, bool) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => ("200 OK", CONTENT_TYPE, body(), method == "HEAD"),
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain", "only /metrics here\n".into(), method == "HEAD"),
        _ => ("405 Method Not Allowed", "text/plain", "GET /metrics only\n".into(), false),
    }
}

fn answer(mut s: TcpStream, body: impl FnOnce() -> String) -> std::io::Result<()> {
    s.set_write_timeout(Some(READ_DEADLINE))?;
    let head = match read_head(&mut s) {
        Ok(h) => h,
        Err(_) => {
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            return Ok(());
        }
    };
    let (status, ctype, text, head_only) = route(&head, body);
    let mut out = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", text.len());
    if !head_only {
        out.push_str(&text);
    }
    s.write_all(out.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_metrics_is_served() {
        let ok = route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", || "x 1\n".into());
        assert_eq!((ok.0, ok.2.as_str()), ("200 OK", "x 1\n"));
        assert_eq!(route(b"GET /metrics?a=b HTTP/1.0\r\n\r\n", || "y".into()).0, "200 OK");
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n", || unreachable!()).0, "404 Not Found");
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n", || unreachable!()).0, "405 Method Not Allowed");
        assert_eq!(route(b"", || unreachable!()).0, "405 Method Not Allowed");
    }

    #[test]
    fn a_silent_client_is_cut_off_at_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let _c = TcpStream::connect(addr).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let t = Instant::now();
        assert!(read_head(&mut s).is_err());
        assert!(t.elapsed() < READ_DEADLINE + Duration::from_secs(1));
    }
}
