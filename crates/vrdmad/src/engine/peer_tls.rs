//! Mutual authentication of peer daemons: a TLS 1.3 handshake (rustls, ring) at the start of
//! every daemon connection and lane, both sides presenting a certificate of the cluster's CA
//! (`vrdma ca`) that names their host.
//!
//! What it establishes: the peer holds the private key of a certificate the operator issued
//! for the host it then names in HELLO (checked in `handshake::check_peer`, with the address
//! the cluster view has for that host), and two keys per connection, one per direction,
//! exported from the session ([`FrameKeys`]), that seal every frame after the handshake
//! (`connection::seal`: AES-128-GCM records, numbered per direction). See docs/security.md,
//! "Hosts and the network".
//!
//! The handshake reads exactly one TLS record at a time ([`RecordReader`]), so the sealed
//! records that follow it are never swallowed by rustls; servers send no session tickets.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::connection::seal::{FrameKeys, KEY_LEN, LABEL_CLIENT_TO_SERVER, LABEL_SERVER_TO_CLIENT};

/// Why a handshake or the configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerTlsError {
    /// A file of the host's identity cannot be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// rustls refused the configuration, or the handshake failed.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// The certificate does not name the host it is for.
    #[error("certificate does not name host {0}")]
    WrongHost(String),
    /// The socket failed during the handshake.
    #[error("TLS handshake: {0}")]
    Io(#[from] std::io::Error),
}

/// This host's identity and the cluster's trust root.
pub struct PeerTls {
    host: String,
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls({})", self.host)
    }
}

/// The verified end-entity certificate of a peer.
pub struct PeerCert(CertificateDer<'static>);

impl PeerCert {
    /// Whether the certificate names host `host`.
    pub fn names(&self, host: &str) -> bool {
        names(&self.0, host)
    }
}

fn names(cert: &CertificateDer<'_>, host: &str) -> bool {
    let Ok(name) = ServerName::try_from(host) else { return false };
    webpki::EndEntityCert::try_from(cert).is_ok_and(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
}

fn file_err(path: &Path, reason: impl std::fmt::Display) -> PeerTlsError {
    PeerTlsError::File { path: path.display().to_string(), reason: reason.to_string() }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PeerTls {
    /// Whether `dir` holds a host identity (`ca.pem`, `host.pem`, `host.key`).
    pub fn present(dir: &Path) -> bool {
        ["ca.pem", "host.pem", "host.key"].iter().any(|f| dir.join(f).exists())
    }

    /// Loads host `host`'s identity from `dir` (what `vrdma ca issue` wrote): its certificate
    /// must name `host` and chain to `ca.pem`.
    pub fn load(dir: &Path, host: &str) -> Result<PeerTls, PeerTlsError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|e| file_err(&p, e)).map(|b| (p, b))
        };
        let (ca_path, ca) = read("ca.pem")?;
        let (cert_path, cert) = read("host.pem")?;
        let (key_path, key) = read("host.key")?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            roots.add(c.map_err(|e| file_err(&ca_path, e))?).map_err(|e| file_err(&ca_path, e))?;
        }
        if roots.is_empty() {
            return Err(file_err(&ca_path, "no certificate"));
        }
        let chain = CertificateDer::pem_slice_iter(&cert).collect::<Result<Vec<_>, _>>().map_err(|e| file_err(&cert_path, e))?;
        let Some(leaf) = chain.first() else { return Err(file_err(&cert_path, "no certificate")) };
        if !names(leaf, host) {
            return Err(PeerTlsError::WrongHost(host.to_string()));
        }
        let key = PrivateKeyDer::from_pem_slice(&key).map_err(|e| file_err(&key_path, e))?;
        let roots = Arc::new(roots);
        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| file_err(&ca_path, e))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        // Nothing after the handshake may be a TLS record (see the module's comment).
        server.send_tls13_tickets = 0;
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(PeerTls { host: host.to_string(), client: Arc::new(client), server: Arc::new(server) })
    }

    /// This host's name (its certificate's).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The client's handshake on `s`, with the daemon of host `peer_host`: the keys of the
    /// frames that follow.
    pub fn connect(&self, s: &TcpStream, peer_host: &str) -> Result<FrameKeys, PeerTlsError> {
        let name = ServerName::try_from(peer_host.to_string()).map_err(|_| PeerTlsError::WrongHost(peer_host.to_string()))?;
        let mut c = rustls::ClientConnection::new(self.client.clone(), name)?;
        drive(&mut c, s)?;
        let (send, recv) = (export(&c, LABEL_CLIENT_TO_SERVER)?, export(&c, LABEL_SERVER_TO_CLIENT)?);
        Ok(FrameKeys { send, recv })
    }

    /// The server's handshake on `s`: the peer's verified certificate, and the keys of the
    /// frames that follow.
    pub fn accept(&self, s: &TcpStream) -> Result<(PeerCert, FrameKeys), PeerTlsError> {
        let mut c = rustls::ServerConnection::new(self.server.clone())?;
        drive(&mut c, s)?;
        let cert = c.peer_certificates().and_then(|c| c.first()).ok_or(rustls::Error::NoCertificatesPresented)?;
        let (send, recv) = (export(&c, LABEL_SERVER_TO_CLIENT)?, export(&c, LABEL_CLIENT_TO_SERVER)?);
        Ok((PeerCert(cert.clone().into_owned()), FrameKeys { send, recv }))
    }
}

/// A key of the frames after the handshake, exported from its session (RFC 8446, 7.5).
fn export<D>(c: &rustls::ConnectionCommon<D>, label: &[u8]) -> Result<[u8; KEY_LEN], PeerTlsError> {
    Ok(c.export_keying_material([0u8; KEY_LEN], label, None)?)
}

/// Runs a handshake to its end on a blocking socket (its read timeout bounds each wait).
fn drive<D>(c: &mut rustls::ConnectionCommon<D>, s: &TcpStream) -> Result<(), PeerTlsError> {
    let mut reader = RecordReader { s, header: [0; 5], header_got: 0, body_left: 0 };
    loop {
        while c.wants_write() {
            c.write_tls(&mut &*s)?;
        }
        if !c.is_handshaking() {
            (&*s).flush()?;
            return Ok(());
        }
        if c.read_tls(&mut reader)? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        if let Err(e) = c.process_new_packets() {
            // (Tell the peer why: the alert rustls queued.)
            let _ = c.write_tls(&mut &*s);
            return Err(e.into());
        }
    }
}

/// Reads from the socket without ever going past the end of the current TLS record.
struct RecordReader<'a> {
    s: &'a TcpStream,
    header: [u8; 5],
    header_got: usize,
    body_left: usize,
}

impl Read for RecordReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.body_left == 0 {
            // A record header, byte by byte as it comes.
            let room = (5 - self.header_got).min(buf.len());
            let n = (&*self.s).read(&mut self.header[self.header_got..self.header_got + room])?;
            buf[..n].copy_from_slice(&self.header[self.header_got..self.header_got + n]);
            self.header_got += n;
            if self.header_got == 5 {
                self.body_left = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                self.header_got = 0;
            }
            return Ok(n);
        }
        let want = buf.len().min(self.body_left);
        let n = (&*self.s).read(&mut buf[..want])?;
        self.body_left -= n;
        Ok(n)
    }
}

/// The engine's TLS identity from `dir` (`STATE_DIR/tls`), if it holds one; without one, a
/// cluster daemon says that its transport is unauthenticated. Err: an identity that is there
/// but unusable (fatal: the operator meant TLS).
pub fn peer_tls_for(dir: &Path, host: &str, cluster: bool) -> Result<Option<Arc<PeerTls>>, String> {
    if !PeerTls::present(dir) {
        if cluster {
            log::warn!(
                "no host certificate in {}: connections with other daemons are NOT authenticated (vrdma ca issue {host} --out {})",
                dir.display(),
                dir.display()
            );
        }
        return Ok(None);
    }
    let tls = PeerTls::load(dir, host).map_err(|e| format!("host certificate in {}: {e}", dir.display()))?;
    log::info!("transport: peers authenticated by TLS 1.3 against the CA in {}", dir.display());
    Ok(Some(Arc::new(tls)))
}

#[cfg(test)]
mod tests;
