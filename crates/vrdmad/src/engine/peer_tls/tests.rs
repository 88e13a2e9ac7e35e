use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};

use super::*;

/// A CA, and host identities it issued, in a temporary directory per host.
struct Pki {
    dir: PathBuf,
    ca: (rcgen::Certificate, KeyPair),
}

impl Pki {
    fn new(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("vrdma-peertls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, "test CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Pki { dir, ca: (cert, key) }
    }

    /// Host `name`'s directory, with a certificate naming `cert_name`.
    fn host(&self, name: &str, cert_name: &str) -> PathBuf {
        let d = self.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, cert_name);
        p.subject_alt_names = vec![SanType::DnsName(cert_name.try_into().unwrap())];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.ca.0, &self.ca.1).unwrap();
        std::fs::write(d.join("host.pem"), cert.pem()).unwrap();
        std::fs::write(d.join("host.key"), key.serialize_pem()).unwrap();
        std::fs::write(d.join("ca.pem"), self.ca.0.pem()).unwrap();
        d
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server's side of a handshake: the peer's certificate and the plaintext that followed.
type Served = Result<(PeerCert, Vec<u8>), PeerTlsError>;

/// Runs a handshake between `client` (expecting `expect`) and `server` over loopback; the
/// server's verified peer certificate, and what a record the client sealed right after the
/// handshake opened to with the server's keys (nothing of it swallowed by the handshake's
/// reads, and the two ends exported matching keys, one per direction).
fn handshake(client: &PeerTls, expect: &str, server: Arc<PeerTls>) -> (Result<(), PeerTlsError>, Served) {
    use crate::engine::connection::seal::{Opener, Sealer, RECORD_OVERHEAD};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let (cert, keys) = server.accept(&s)?;
        assert_ne!(keys.send, keys.recv);
        let mut after = vec![0u8; 11 + RECORD_OVERHEAD];
        s.try_clone().unwrap().read_exact(&mut after)?;
        let plain = Opener::new(&keys.recv).open(&mut after).expect("the client's record opens").to_vec();
        Ok((cert, plain))
    });
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    let r = client.connect(&s, expect);
    if let Ok(keys) = &r {
        (&s).write_all(&Sealer::new(&keys.send).seal(&[b"first frame"]).unwrap()).unwrap();
    }
    drop(s);
    (r.map(drop), srv.join().unwrap())
}

#[test]
fn hosts_of_one_ca_authenticate_each_other_by_name() {
    let pki = Pki::new("ok");
    let h1 = PeerTls::load(&pki.host("h1", "h1"), "h1").unwrap();
    let h2 = Arc::new(PeerTls::load(&pki.host("h2", "h2"), "h2").unwrap());
    let (c, s) = handshake(&h1, "h2", h2.clone());
    c.unwrap();
    let (cert, after) = s.unwrap();
    assert!(cert.names("h1") && !cert.names("h2"));
    assert_eq!(after, b"first frame");
    // A client expecting another host than the server's certificate names: refused.
    let (c, _) = handshake(&h1, "h3", h2);
    assert!(c.is_err());
}

#[test]
fn a_certificate_of_another_ca_or_for_another_host_is_refused() {
    let pki = Pki::new("bad");
    let other = Pki::new("other");
    let h2 = Arc::new(PeerTls::load(&pki.host("h2", "h2"), "h2").unwrap());
    // A host of another CA, whichever side it is on.
    let stranger = PeerTls::load(&other.host("h1", "h1"), "h1").unwrap();
    let (c, s) = handshake(&stranger, "h2", h2.clone());
    assert!(c.is_err() && s.is_err());
    let (c, s) = handshake(&PeerTls::load(&pki.host("h1", "h1"), "h1").unwrap(), "h2", Arc::new(stranger));
    assert!(c.is_err() && s.is_err());
    // A certificate is loaded only as the identity of the host it names.
    assert!(matches!(PeerTls::load(&pki.host("h3", "h1"), "h3"), Err(PeerTlsError::WrongHost(_))));
    assert!(matches!(PeerTls::load(&pki.dir.join("missing"), "h1"), Err(PeerTlsError::File { .. })));
    assert!(!PeerTls::present(&pki.dir.join("missing")) && PeerTls::present(&pki.dir.join("h2")));
}
