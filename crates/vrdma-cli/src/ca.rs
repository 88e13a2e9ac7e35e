//! `vrdma ca`: the operator's certificate authority for the daemons' host-to-host transport,
//! the one trust root of a cluster (as etcd's and Kubernetes' PKI tooling make one).
//!
//! `vrdma ca init --dir D` makes the CA: `D/ca.pem` (its certificate, for every host) and
//! `D/ca.key` (its private key, mode 0600, which stays with the operator). `vrdma ca issue HOST
//! --dir D --out O` makes a host's key pair and certificate, naming `HOST` (the `vrdmad --host`
//! name) as its DNS subject alternative name, for both TLS roles, and writes what that host's
//! vrdmad reads from `STATE_DIR/tls/`: `O/host.pem`, `O/host.key` (0600) and `O/ca.pem`.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use anyhow::Context as _;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};

/// The CA's common name; its identity is its key (the key identifier every host certificate
/// names as its authority).
const CA_NAME: &str = "vrdma cluster CA";
/// Validity of the CA and of host certificates (days).
const CA_DAYS: i64 = 3650;
const HOST_DAYS: i64 = 825;

fn ca_params() -> anyhow::Result<CertificateParams> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, CA_NAME);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(CA_DAYS);
    Ok(p)
}

/// Writes `data` to a new file (never over an existing one) with `mode`.
fn write_new(path: &Path, data: &str, mode: u32) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {} (remove it first to replace it)", path.display()))?;
    f.write_all(data.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// `vrdma ca init`: a new CA in `dir`.
pub(crate) fn init(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let key = KeyPair::generate()?;
    let cert = ca_params()?.self_signed(&key)?;
    write_new(&dir.join("ca.key"), &key.serialize_pem(), 0o600)?;
    write_new(&dir.join("ca.pem"), &cert.pem(), 0o644)?;
    println!("CA written to {}: ca.pem (give it to every host), ca.key (keep it here)", dir.display());
    Ok(())
}

/// `vrdma ca issue`: a key pair and certificate for host `host`, signed by the CA in `dir`,
/// written to `out`.
pub(crate) fn issue(dir: &Path, host: &str, out: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        vrdmad::store::valid_record_name(host),
        "host name {host:?}: 1-63 characters of [A-Za-z0-9._-], starting with a letter or digit"
    );
    let ca_key_pem = std::fs::read_to_string(dir.join("ca.key")).with_context(|| format!("reading the CA key in {}", dir.display()))?;
    let ca_pem = std::fs::read_to_string(dir.join("ca.pem")).with_context(|| format!("reading the CA certificate in {}", dir.display()))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).context("the CA key")?;
    // The issuer as a certificate object: the same name and key as the CA's (what a host
    // certificate refers to), re-signed here only to sign with.
    let issuer = ca_params()?.self_signed(&ca_key)?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, host);
    p.subject_alt_names = vec![SanType::DnsName(host.try_into().with_context(|| format!("{host:?} as a DNS name"))?)];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // A daemon is a TLS server for the connections it accepts and a client for its own.
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(HOST_DAYS);
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer, &ca_key)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_new(&out.join("host.key"), &key.serialize_pem(), 0o600)?;
    write_new(&out.join("host.pem"), &cert.pem(), 0o644)?;
    match std::fs::read_to_string(out.join("ca.pem")) {
        Ok(existing) if existing == ca_pem => {}
        _ => {
            let _ = std::fs::remove_file(out.join("ca.pem"));
            write_new(&out.join("ca.pem"), &ca_pem, 0o644)?;
        }
    }
    println!(
        "certificate for host {host} written to {}: host.pem, host.key, ca.pem (vrdmad reads them from STATE_DIR/tls/)",
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_chain_to_the_ca_and_name_their_host() {
        let dir = std::env::temp_dir().join(format!("vrdma-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init(&dir.join("ca")).unwrap();
        assert!(init(&dir.join("ca")).is_err(), "an existing CA is never overwritten");
        issue(&dir.join("ca"), "h1", &dir.join("h1")).unwrap();
        assert!(issue(&dir.join("ca"), "../x", &dir.join("x")).is_err());
        let tls = vrdmad::engine::PeerTls::load(&dir.join("h1"), "h1").unwrap();
        assert_eq!(tls.host(), "h1");
        let mode = std::fs::metadata(dir.join("h1/host.key")).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
        // Issued for h1: refused as h2's identity.
        assert!(vrdmad::engine::PeerTls::load(&dir.join("h1"), "h2").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
