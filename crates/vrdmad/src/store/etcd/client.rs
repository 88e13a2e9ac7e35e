//! The client of etcd's gateway: one request per connection, failing over between the
//! endpoints (the last one that answered is tried first), authenticated when credentials
//! are configured (see [`super::auth`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{json, Value};

use super::conn;
use super::error::EtcdError;
use super::json::{b64, decode_kv, from_json, prefix_end, Entry, LeaseResp, RangeResp, TxnResp};
use super::security::Security;
use super::stream::Stream;

/// Longest single read of a unary response (short, so that its deadline is checked often).
const UNARY_READ: Duration = Duration::from_millis(200);

pub(super) struct Client {
    endpoints: Vec<String>,
    preferred: AtomicUsize,
    pub(super) security: Security,
    /// The etcd auth token of the user in `security.credentials`; None until authenticated
    /// (or after etcd refused it). An empty token: etcd has auth disabled.
    pub(super) token: Mutex<Option<String>>,
}

impl Client {
    pub(super) fn new(endpoints: Vec<String>, security: Security) -> Client {
        Client { endpoints, preferred: AtomicUsize::new(0), security, token: Mutex::new(None) }
    }

    /// Connects to `endpoint` (TLS handshake included), sends `POST path` with `body`, and
    /// reads the response head.
    fn open(&self, endpoint: &str, path: &str, body: &[u8], token: &str, read_timeout: Duration) -> Result<Stream, EtcdError> {
        Stream::open(conn::connect(endpoint, &self.security, read_timeout)?, path, body, token)
    }

    /// Endpoints in the order to try them: the last one that worked first.
    fn order(&self) -> Vec<usize> {
        let n = self.endpoints.len();
        let p = self.preferred.load(Ordering::Relaxed) % n.max(1);
        (0..n).map(|i| (p + i) % n).collect()
    }

    /// One request, failing over between endpoints on transport errors, authenticated.
    pub(super) fn call(&self, path: &str, body: &Value) -> Result<Vec<u8>, EtcdError> {
        self.authorized(|token| self.call_with(path, body, token))
    }

    /// One request with `token`, failing over between endpoints on transport errors.
    pub(super) fn call_with(&self, path: &str, body: &Value, token: &str) -> Result<Vec<u8>, EtcdError> {
        let body = body.to_string().into_bytes();
        let mut failures = Vec::new();
        for i in self.order() {
            let ep = &self.endpoints[i];
            match self.open(ep, path, &body, token, UNARY_READ).and_then(Stream::finish_unary) {
                Ok(b) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(b);
                }
                // The request is wrong: another member would say the same. (Not 429: that
                // member is overloaded, and another may not be; later, it may not be either.)
                Err(e @ EtcdError::Status { status: 400..=428 | 430..=499, .. }) => return Err(e),
                // Transport and TLS failures and 5xx (e.g. a member without a leader): next
                // member.
                Err(e) => {
                    log::debug!("etcd {ep}{path}: {e}");
                    failures.push(e.to_string());
                }
            }
        }
        Err(EtcdError::Unreachable(failures.join("; ")))
    }

    /// Opens a streaming request (the watch) on the first endpoint that answers 200; its
    /// reads wait at most `read_timeout` each.
    pub(super) fn stream(&self, path: &str, body: &Value, read_timeout: Duration) -> Result<Stream, EtcdError> {
        let body = body.to_string().into_bytes();
        self.authorized(|token| {
            let mut failures = Vec::new();
            for i in self.order() {
                let ep = &self.endpoints[i];
                match self.open(ep, path, &body, token, read_timeout) {
                    Ok(s) if s.status == 200 => {
                        self.preferred.store(i, Ordering::Relaxed);
                        return Ok(s);
                    }
                    Ok(s) => match s.finish_unary() {
                        Err(e @ EtcdError::Status { status: 400..=428 | 430..=499, .. }) => return Err(e),
                        Err(e) => failures.push(e.to_string()),
                        Ok(_) => failures.push(format!("{ep}: unexpected status")),
                    },
                    Err(e) => failures.push(e.to_string()),
                }
            }
            Err(EtcdError::Unreachable(failures.join("; ")))
        })
    }

    pub(super) fn range_prefix(&self, prefix: &str) -> Result<RangeResp, EtcdError> {
        from_json(&self.call("/v3/kv/range", &json!({"key": b64(prefix), "range_end": prefix_end(prefix)}))?)
    }

    pub(super) fn range_key(&self, key: &str) -> Result<Option<Entry>, EtcdError> {
        let r: RangeResp = from_json(&self.call("/v3/kv/range", &json!({"key": b64(key)}))?)?;
        r.kvs.first().map(decode_kv).transpose()
    }

    pub(super) fn txn(&self, body: &Value) -> Result<TxnResp, EtcdError> {
        from_json(&self.call("/v3/kv/txn", body)?)
    }

    pub(super) fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let r: LeaseResp = from_json(&self.call("/v3/lease/grant", &json!({"TTL": ttl.to_string()}))?)?;
        if r.ID == 0 {
            return Err(EtcdError::Json("lease grant without an ID".into()));
        }
        Ok(r.ID)
    }
}
