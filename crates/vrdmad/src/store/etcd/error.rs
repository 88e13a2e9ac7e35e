//! What can go wrong talking to etcd.

use super::http::HttpError;
use super::security::SecurityError;

/// Failures of the etcd backend and its HTTP client.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint could be reached; the last failure of each is listed.
    #[error("no etcd endpoint reachable: {0}")]
    Unreachable(String),
    /// Talking to one endpoint failed.
    #[error("etcd {endpoint}: {source}")]
    Io {
        /// `host:port`.
        endpoint: String,
        /// Why.
        source: std::io::Error,
    },
    /// etcd answered with an error status.
    #[error("etcd {endpoint} answered {status}: {message}")]
    Status {
        /// `host:port`.
        endpoint: String,
        /// HTTP status.
        status: u16,
        /// etcd's message.
        message: String,
    },
    /// A reply is not valid HTTP/1.1 or exceeds a bound.
    #[error("malformed HTTP from etcd: {0}")]
    Http(#[from] HttpError),
    /// A reply is not the JSON we expect.
    #[error("malformed reply from etcd: {0}")]
    Json(String),
    /// A key or value is not valid base64.
    #[error("malformed base64 from etcd: {0}")]
    Base64(String),
    /// A record could not be encoded as JSON to be written.
    #[error("encoding a record for etcd: {0}")]
    Encode(String),
    /// The TLS handshake with one endpoint failed (certificate not signed by our CA, name
    /// mismatch, client certificate refused, not a TLS server…): like a connection failure,
    /// the next endpoint is tried.
    #[error("etcd {endpoint}: TLS: {source}")]
    Tls {
        /// `host:port`.
        endpoint: String,
        /// Why (rustls' error inside).
        source: std::io::Error,
    },
    /// etcd refused the user's credentials.
    #[error("etcd authentication as user {user} failed: {message}")]
    Auth {
        /// The user.
        user: String,
        /// etcd's message.
        message: String,
    },
    /// The TLS or credential configuration is unusable (fatal at start-up).
    #[error(transparent)]
    Config(#[from] SecurityError),
}

/// At most 80 characters of `s`: what an error message quotes of a peer's input.
pub(super) fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}
