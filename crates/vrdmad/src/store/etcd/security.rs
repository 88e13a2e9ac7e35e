//! How vrdmad authenticates to etcd and etcd to vrdmad: TLS (server certificate checked
//! against a CA bundle and the endpoint's host name or IP, optional client certificate for
//! etcd's `--client-cert-auth`) and etcd users (`auth enable`: a user name and password
//! exchanged for a token).
//!
//! [`EtcdConfig`] is what the operator configured (paths, names); [`EtcdConfig::load`] checks
//! it and reads every file once, at start-up, into [`Security`], which the client shares
//! between all its connections. Configuration errors are fatal; nothing here touches the
//! network.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Configuration errors: an inconsistent combination of options or an unusable file.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// Options that do not go together (or one missing its partner).
    #[error("etcd options: {0}")]
    Inconsistent(String),
    /// A configured file cannot be read.
    #[error("{what} {path}: {source}")]
    Read {
        /// Which option (`--etcd-cacert`, …).
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A PEM file holds nothing usable.
    #[error("{what} {path}: {reason}")]
    Pem {
        /// Which option.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// rustls refused the assembled configuration (e.g. a key that does not match its
    /// certificate, an unsupported key type).
    #[error("TLS configuration: {0}")]
    Tls(String),
}

/// A password, kept out of `Debug` output (configurations get logged).
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    /// Wraps a password.
    pub fn new(p: impl Into<String>) -> Password {
        Password(p.into())
    }

    /// Reads a password file (`--etcd-password-file`): its first line, without the line
    /// end (files written by `echo` end in one).
    pub fn from_file(path: &Path) -> Result<Password, SecurityError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecurityError::Read {
            what: "--etcd-password-file",
            path: path.display().to_string(),
            source,
        })?;
        let line = text.lines().next().unwrap_or_default();
        if line.is_empty() {
            return Err(SecurityError::Pem { what: "--etcd-password-file", path: path.display().to_string(), reason: "empty".into() });
        }
        Ok(Password(line.to_string()))
    }

    /// The secret itself (only for the authenticate request).
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(***)")
    }
}

/// How to reach etcd (`vrdmad --store etcd://…` or `https://…` and the `--etcd-*` options).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` endpoints, tried in turn.
    pub endpoints: Vec<String>,
    /// The store URL said `https://`: TLS even before a CA is given (then one must be).
    pub https: bool,
    /// CA bundle (PEM) that etcd's server certificate must chain to; TLS is on when set.
    pub cacert: Option<PathBuf>,
    /// Client certificate chain (PEM), for etcd's `--client-cert-auth`.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// etcd user (with `auth enable`).
    pub user: Option<String>,
    /// That user's password.
    pub password: Option<Password>,
}

/// Credentials of an etcd user.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// User name.
    pub user: String,
    /// Password.
    pub password: Password,
}

/// The loaded security settings one client uses for every connection.
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// TLS client configuration; None: plain TCP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// etcd user, if any.
    pub credentials: Option<Credentials>,
}

impl EtcdConfig {
    /// A plain-HTTP configuration on `endpoints`, without credentials.
    pub fn plain(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig { endpoints, ..Default::default() }
    }

    /// Whether connections use TLS.
    pub fn tls(&self) -> bool {
        self.https || self.cacert.is_some()
    }

    /// Rejects combinations that cannot work (checked before any file is read).
    pub fn validate(&self) -> Result<(), SecurityError> {
        let bad = |m: &str| Err(SecurityError::Inconsistent(m.into()));
        if self.endpoints.is_empty() {
            return bad("no endpoints");
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => return bad("--etcd-cert needs --etcd-key"),
            (None, Some(_)) => return bad("--etcd-key needs --etcd-cert"),
            _ => {}
        }
        if self.https && self.cacert.is_none() {
            return bad("an https:// store needs --etcd-cacert (the CA that signed etcd's certificate)");
        }
        if self.cert.is_some() && self.cacert.is_none() {
            return bad("a client certificate (--etcd-cert) is only sent over TLS: give --etcd-cacert too");
        }
        match (&self.user, &self.password) {
            (Some(u), _) if u.is_empty() || u.contains(':') => bad("--etcd-user: a non-empty name without ':'"),
            (Some(_), None) => bad("--etcd-user needs a password (--etcd-password-file or VRDMA_ETCD_PASSWORD)"),
            (None, Some(_)) => bad("a password needs --etcd-user"),
            _ => Ok(()),
        }
    }

    /// Validates, then reads the CA, certificate and key files into the settings every
    /// connection uses.
    pub fn load(&self) -> Result<Security, SecurityError> {
        self.validate()?;
        let credentials = match (&self.user, &self.password) {
            (Some(user), Some(password)) => Some(Credentials { user: user.clone(), password: password.clone() }),
            _ => None,
        };
        if credentials.is_some() && !self.tls() {
            log::warn!("etcd: the password is sent over plain HTTP; give --etcd-cacert to use TLS");
        }
        let Some(ca) = &self.cacert else { return Ok(Security { tls: None, credentials }) };
        let mut roots = rustls::RootCertStore::empty();
        for c in read_certs("--etcd-cacert", ca)? {
            roots.add(c).map_err(|e| pem_err("--etcd-cacert", ca, format!("not a usable CA certificate: {e}")))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| SecurityError::Tls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs("--etcd-cert", cert)?;
                let key = read_key(key)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| SecurityError::Tls(format!("client certificate and key: {e}")))?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(Security { tls: Some(Arc::new(config)), credentials })
    }
}

fn pem_err(what: &'static str, path: &Path, reason: String) -> SecurityError {
    SecurityError::Pem { what, path: path.display().to_string(), reason }
}

fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read { what, path: path.display().to_string(), source })
}

/// Every certificate of a PEM file (at least one).
fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
    let pem = read_file(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(what, path, format!("malformed PEM: {e}")))?;
    if certs.is_empty() {
        return Err(pem_err(what, path, "no CERTIFICATE in the file".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, SecurityError> {
    const WHAT: &str = "--etcd-key";
    let pem = read_file(WHAT, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| pem_err(WHAT, path, format!("no usable private key: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EtcdConfig {
        EtcdConfig::plain(vec!["198.19.0.1:2379".into()])
    }

    #[test]
    fn inconsistent_combinations_are_refused() {
        let p = |s: &str| Some(PathBuf::from(s));
        let cases = [
            (EtcdConfig { cert: p("c"), cacert: p("ca"), ..cfg() }, "--etcd-cert needs --etcd-key"),
            (EtcdConfig { key: p("k"), cacert: p("ca"), ..cfg() }, "--etcd-key needs --etcd-cert"),
            (EtcdConfig { cert: p("c"), key: p("k"), ..cfg() }, "only sent over TLS"),
            (EtcdConfig { https: true, ..cfg() }, "needs --etcd-cacert"),
            (EtcdConfig { user: Some("u".into()), ..cfg() }, "needs a password"),
            (EtcdConfig { password: Some(Password::new("p")), ..cfg() }, "needs --etcd-user"),
            (EtcdConfig { user: Some(String::new()), password: Some(Password::new("p")), ..cfg() }, "non-empty"),
            (EtcdConfig::plain(vec![]), "no endpoints"),
        ];
        for (c, want) in cases {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{c:?}: {e}");
        }
        cfg().validate().unwrap();
        let ok = EtcdConfig { user: Some("u".into()), password: Some(Password::new("p")), ..cfg() };
        assert!(ok.load().unwrap().tls.is_none());
    }

    #[test]
    fn passwords_stay_out_of_debug_output() {
        let c = EtcdConfig { user: Some("u".into()), password: Some(Password::new("hunter2")), ..cfg() };
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!format!("{:?}", c.load().unwrap()).contains("hunter2"));
    }

    #[test]
    fn password_files() {
        let dir = std::env::temp_dir().join(format!("vrdma-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("pw");
        std::fs::write(&f, "s3cret\n").unwrap();
        assert_eq!(Password::from_file(&f).unwrap().expose(), "s3cret");
        std::fs::write(&f, "\n").unwrap();
        assert!(Password::from_file(&f).is_err());
        assert!(Password::from_file(&dir.join("missing")).unwrap_err().to_string().contains("--etcd-password-file"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = std::env::temp_dir().join(format!("vrdma-tlscfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let missing = dir.join("missing.pem");
        let e = EtcdConfig { cacert: Some(missing.clone()), ..cfg() }.load().unwrap_err().to_string();
        assert!(e.contains("--etcd-cacert") && e.contains("missing.pem"), "{e}");
        let e = EtcdConfig { cacert: Some(junk.clone()), ..cfg() }.load().unwrap_err().to_string();
        assert!(e.contains("no CERTIFICATE"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
