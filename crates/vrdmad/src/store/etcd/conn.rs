//! One connection to one etcd endpoint: TCP whose every read ends by a deadline, with TLS
//! (rustls, configured by [`super::security`]) over it when configured. The HTTP code above
//! is the same for both.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::EtcdError;
use super::security::Security;

/// Time to connect to one endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Time for one unary request, connect to last byte.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to etcd: plain TCP or TLS over it.
pub(super) trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// The read deadline of a connection, shared by its `Stream` and the socket under it.
#[derive(Clone)]
pub(super) struct Deadline(Arc<Mutex<Instant>>);

impl Deadline {
    pub(super) fn new(at: Instant) -> Deadline {
        Deadline(Arc::new(Mutex::new(at)))
    }

    pub(super) fn set(&self, at: Instant) {
        *self.0.lock() = at;
    }

    pub(super) fn at(&self) -> Instant {
        *self.0.lock()
    }
}

/// The socket under a connection. Every read ends by the deadline: a socket read timeout
/// alone only ends reads during which *nothing* arrives, and rustls keeps reading until a
/// whole record (up to 16 KiB) is in, so a peer trickling a byte per timeout could otherwise
/// hold one TLS read (or the handshake) for hours.
struct DeadlineTcp {
    tcp: TcpStream,
    /// Longest single wait (short, so that callers' loops check their own conditions).
    read_timeout: Duration,
    deadline: Deadline,
}

impl Read for DeadlineTcp {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.at().saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        // set_read_timeout refuses zero.
        self.tcp.set_read_timeout(Some(left.min(self.read_timeout).max(Duration::from_millis(1))))?;
        self.tcp.read(buf)
    }
}

impl Write for DeadlineTcp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

/// An open connection, handshake done, its deadline `REQUEST_TIMEOUT` after the connect.
pub(super) struct Connection {
    pub(super) io: Box<dyn Conn>,
    /// Bounds every read of `io`.
    pub(super) deadline: Deadline,
    /// Longest single read.
    pub(super) read_timeout: Duration,
    /// `host:port`.
    pub(super) endpoint: String,
    /// Whether `io` is TLS.
    pub(super) tls: bool,
}

impl Connection {
    pub(super) fn io_error(&self, source: std::io::Error) -> EtcdError {
        EtcdError::Io { endpoint: self.endpoint.clone(), source }
    }
}

/// The name the server certificate must carry: the endpoint's host (an IP address is
/// checked against the certificate's IP SANs).
fn server_name(endpoint: &str) -> Result<rustls::pki_types::ServerName<'static>, std::io::Error> {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?} is not a valid TLS server name: {e}")))
}

/// Connects to `endpoint` and, with TLS configured, completes the handshake; reads wait at
/// most `read_timeout` each.
pub(super) fn connect(endpoint: &str, security: &Security, read_timeout: Duration) -> Result<Connection, EtcdError> {
    let io = |source| EtcdError::Io { endpoint: endpoint.to_string(), source };
    let addrs: Vec<_> = endpoint.to_socket_addrs().map_err(io)?.collect();
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    let mut tcp = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let tcp = tcp.ok_or_else(|| io(last))?;
    tcp.set_write_timeout(Some(REQUEST_TIMEOUT)).map_err(io)?;
    let _ = tcp.set_nodelay(true);
    // The handshake, the request and the response head share one deadline.
    let until = Instant::now() + REQUEST_TIMEOUT;
    let deadline = Deadline::new(until);
    let mut tcp = DeadlineTcp { tcp, read_timeout, deadline: deadline.clone() };
    let io: Box<dyn Conn> = match &security.tls {
        None => Box::new(tcp),
        Some(cfg) => {
            let tls = |source| EtcdError::Tls { endpoint: endpoint.to_string(), source };
            let mut c = rustls::ClientConnection::new(cfg.clone(), server_name(endpoint).map_err(tls)?)
                .map_err(|e| tls(std::io::Error::other(e)))?;
            while c.is_handshaking() {
                match c.complete_io(&mut tcp) {
                    Ok(_) => {}
                    // The short read timeout: the deadline decides.
                    Err(e)
                        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) && Instant::now() < until => {}
                    Err(e) => return Err(tls(e)),
                }
            }
            Box::new(rustls::StreamOwned::new(c, tcp))
        }
    };
    Ok(Connection { io, deadline, read_timeout, endpoint: endpoint.to_string(), tls: security.tls.is_some() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that trickles one byte per 50 ms (each socket read returns, never timing out)
    /// cannot hold a read loop past the connection's deadline.
    #[test]
    fn a_trickling_peer_cannot_hold_reads_past_the_deadline() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..60 {
                if s.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let tcp = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        let mut s =
            DeadlineTcp { tcp, read_timeout: Duration::from_millis(200), deadline: Deadline::new(start + Duration::from_millis(400)) };
        // What rustls does for one record: read until it is complete.
        let mut got = Vec::new();
        let err = loop {
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(0) => panic!("eof"),
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(e) => break e,
            }
        };
        // The deadline itself (TimedOut) or the socket timeout capped by it (WouldBlock).
        assert!(matches!(err.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock), "{err}");
        let took = start.elapsed();
        assert!(took < Duration::from_millis(1500), "read loop lasted {took:?}");
        assert!(!got.is_empty(), "bytes before the deadline are delivered");
        drop(s);
        server.join().unwrap();
    }

    #[test]
    fn tls_server_names() {
        use rustls::pki_types::ServerName;
        assert!(matches!(server_name("198.19.0.1:2379").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:2379").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("etcd-0.example:2379").unwrap(), ServerName::DnsName(_)));
        assert!(server_name("bad name:2379").is_err());
    }
}
