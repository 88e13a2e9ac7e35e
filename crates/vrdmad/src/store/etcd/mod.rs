//! The etcd backend: etcd ≥ 3.4's v3 JSON gateway (`/v3/kv/*`, `/v3/watch`, `/v3/lease/*`,
//! `/v3/auth/authenticate`) over a small HTTP/1.1 client on `std::net::TcpStream`, plain or
//! wrapped in TLS (rustls; see [`security`]), with failover between endpoints.
//!
//! Keys (values are JSON):
//!
//! | key | value |
//! |---|---|
//! | `/vrdma/vnics/<name>` | [`VnicRecord`] |
//! | `/vrdma/ips/<a.b.c.d>` | the vNIC name holding the address |
//! | `/vrdma/hosts/<name>` | [`HostRecord`], under a lease the daemon keeps alive |
//! | `/vrdma/rules/<a>/<b>` | [`RuleRecord`] (tenants in sorted order) |
//! | `/vrdma/tenants/<name>` | [`TenantRecord`] (the tenant's QoS policy) |
//!
//! Creating a vNIC is one transaction claiming both its name and its address key
//! (`create_revision == 0` on each), so two daemons never hand out the same address.
//!
//! etcd's replies are input like any other: heads, chunk sizes, bodies and single watch
//! messages are bounded, every field is optional, and nothing in a reply can panic us
//! ([`fuzz_decode`] is the fuzzer's entry point).
//!
//! Layout, bottom up: `http` (response decoding), `json` (the gateway's reply shapes),
//! `keys` (the table above), `conn` (TCP and TLS with a read deadline), `stream` (one
//! request and its response), `client` (failover), `auth` (etcd users' tokens), `lease`
//! (this host's record and its keepalive), `watch`, and here the [`Store`] itself.

mod auth;
mod client;
mod conn;
mod error;
mod fuzz;
mod http;
mod json;
mod keys;
mod lease;
pub mod security;
mod stream;
#[cfg(test)]
mod tests;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{json, Value};

use super::{HostRecord, RuleRecord, Snapshot, Store, StoreError, StoreEvent, TenantRecord, VnicRecord, WatchCallback, WatchHandle};
use client::Client;
use json::{b64, decode_kv, from_json, DeleteResp};
use keys::{event_of, ip_key, parse_vnic, rule_key, tenant_key, vnic_key, HOSTS, PREFIX, RULES, TENANTS, VNICS};
use lease::Lease;

pub use error::EtcdError;
pub use fuzz::fuzz_decode;
pub use http::{decode_response, parse_head, BodyDecoder, Framing, Head, HttpError, MAX_BODY, MAX_HEAD};
pub use security::{EtcdConfig, Password, Security, SecurityError};
pub use watch::MAX_MESSAGE;

/// The store event a put (`value: Some`) or delete of `key` means, as the watch decodes it
/// (None for keys that carry none); the fuzzer's way in.
pub fn decode_event(key: &str, value: Option<&str>) -> Result<Option<StoreEvent>, StoreError> {
    event_of(key, value)
}

/// Granularity of stop checks in the watch and keepalive threads (an idle daemon wakes
/// about once a second for them).
const POLL: Duration = Duration::from_secs(1);
/// TTL of a host's lease: a dead daemon's host record disappears after this.
pub const HOST_TTL_SECS: i64 = 10;

/// The etcd backend.
pub struct EtcdStore {
    client: Arc<Client>,
    lease: Arc<Mutex<Option<Lease>>>,
    stop: Arc<AtomicBool>,
    host_ttl: i64,
}

impl EtcdStore {
    /// A store on `endpoints` (`host:port`), checked by reading once.
    pub fn connect(endpoints: Vec<String>) -> Result<EtcdStore, StoreError> {
        Self::connect_with_ttl(endpoints, HOST_TTL_SECS)
    }

    /// Like [`Self::connect`], with a host lease of `ttl` seconds.
    pub fn connect_with_ttl(endpoints: Vec<String>, ttl: i64) -> Result<EtcdStore, StoreError> {
        Self::connect_secure(endpoints, Security::default(), ttl)
    }

    /// A store on `endpoints` with TLS and credentials as loaded by [`EtcdConfig::load`], a
    /// host lease of `ttl` seconds; checked by reading once (which authenticates, so wrong
    /// credentials fail here).
    pub fn connect_secure(endpoints: Vec<String>, security: Security, ttl: i64) -> Result<EtcdStore, StoreError> {
        if endpoints.is_empty() {
            return Err(StoreError::BadUrl { url: String::new(), reason: "no endpoints".into() });
        }
        let s = EtcdStore {
            client: Arc::new(Client::new(endpoints, security)),
            lease: Arc::new(Mutex::new(None)),
            stop: Arc::new(AtomicBool::new(false)),
            host_ttl: ttl.max(2),
        };
        s.client.range_key(PREFIX)?;
        Ok(s)
    }

    /// Whether etcd answers over plain HTTP (`/health`-like: a read of one key).
    pub fn healthy(endpoints: &[String]) -> bool {
        Client::new(endpoints.to_vec(), Security::default()).range_key(PREFIX).is_ok()
    }

    /// Whether etcd answers with this configuration's TLS and credentials.
    pub fn healthy_with(cfg: &EtcdConfig) -> bool {
        match cfg.load() {
            Ok(sec) => Client::new(cfg.endpoints.clone(), sec).range_key(PREFIX).is_ok(),
            Err(_) => false,
        }
    }

    /// One raw request to etcd's JSON gateway with this store's connection settings
    /// (tooling and tests: user and role administration, `auth enable`); the reply's JSON.
    pub fn gateway_call(&self, path: &str, body: &Value) -> Result<Value, StoreError> {
        Ok(from_json(&self.client.call(path, body)?)?)
    }

    /// The records under `prefix`, as the events putting them (names checked against their
    /// keys; rules taken from their keys, as the watch does).
    fn list(&self, prefix: &str) -> Result<Vec<StoreEvent>, StoreError> {
        let r = self.client.range_prefix(prefix)?;
        let mut out = Vec::new();
        for kv in &r.kvs {
            let e = decode_kv(kv)?;
            match event_of(&e.key, Some(&e.value)) {
                Ok(Some(v)) => out.push(v),
                Ok(None) => {}
                Err(err) => log::warn!("etcd: skipping {}: {err}", e.key),
            }
        }
        Ok(out)
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(l) = self.lease.lock().take() {
            // Best effort: the host disappears now rather than after its TTL.
            let _ = lease::revoke(&self.client, l.id);
        }
    }
}

/// Everything under `/vrdma/` at one revision.
fn snapshot_of(client: &Client) -> Result<Snapshot, StoreError> {
    let r = client.range_prefix(PREFIX)?;
    let mut snap = Snapshot { revision: r.header.revision, ..Default::default() };
    for kv in &r.kvs {
        let e = decode_kv(kv)?;
        match event_of(&e.key, Some(&e.value)) {
            Ok(Some(StoreEvent::VnicPut(v))) => snap.vnics.push(v),
            Ok(Some(StoreEvent::HostPut(h))) => snap.hosts.push(h),
            Ok(Some(StoreEvent::RulePut(r))) => snap.rules.push(r),
            Ok(Some(StoreEvent::TenantPut(t))) => snap.tenants.push(t),
            Ok(_) => {}
            Err(err) => log::warn!("etcd: skipping {}: {err}", e.key),
        }
    }
    Ok(snap)
}

impl Store for EtcdStore {
    fn list_vnics(&self) -> Result<Vec<VnicRecord>, StoreError> {
        Ok(self.list(VNICS)?.into_iter().filter_map(|e| if let StoreEvent::VnicPut(v) = e { Some(v) } else { None }).collect())
    }

    fn get_vnic(&self, name: &str) -> Result<Option<VnicRecord>, StoreError> {
        let key = vnic_key(name);
        self.client.range_key(&key)?.map(|e| parse_vnic(&key, &e.value)).transpose()
    }

    fn create_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        let (nk, ik) = (vnic_key(&v.name), ip_key(v.ip));
        let value = serde_json::to_string(v).map_err(|e| EtcdError::Encode(e.to_string()))?;
        let absent = |k: &str| json!({"key": b64(k), "result": "EQUAL", "target": "CREATE", "create_revision": "0"});
        let r = self.client.txn(&json!({
            "compare": [absent(&nk), absent(&ik)],
            "success": [
                {"request_put": {"key": b64(&nk), "value": b64(&value)}},
                {"request_put": {"key": b64(&ik), "value": b64(&v.name)}},
            ],
            "failure": [{"request_range": {"key": b64(&nk)}}, {"request_range": {"key": b64(&ik)}}],
        }))?;
        if r.succeeded {
            return Ok(());
        }
        let taken = |i: usize| r.responses.get(i).and_then(|x| x.response_range.as_ref()).is_some_and(|rr| !rr.kvs.is_empty());
        if taken(0) {
            Err(StoreError::NameTaken(v.name.clone()))
        } else if taken(1) {
            Err(StoreError::IpTaken(v.ip))
        } else {
            Err(StoreError::Conflict(v.name.clone()))
        }
    }

    fn update_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        let key = vnic_key(&v.name);
        let Some(old) = self.client.range_key(&key)? else { return Err(StoreError::NotFound(v.name.clone())) };
        let old_rec = parse_vnic(&key, &old.value)?;
        if old_rec.ip != v.ip {
            return Err(StoreError::IpChanged(v.name.clone()));
        }
        let value = serde_json::to_string(v).map_err(|e| EtcdError::Encode(e.to_string()))?;
        let r = self.client.txn(&json!({
            "compare": [{"key": b64(&key), "result": "EQUAL", "target": "MOD", "mod_revision": old.mod_revision.to_string()}],
            "success": [{"request_put": {"key": b64(&key), "value": b64(&value)}}],
        }))?;
        if r.succeeded {
            Ok(())
        } else {
            Err(StoreError::Conflict(v.name.clone()))
        }
    }

    fn delete_vnic(&self, name: &str) -> Result<bool, StoreError> {
        let key = vnic_key(name);
        let Some(old) = self.client.range_key(&key)? else { return Ok(false) };
        let mut ops = vec![json!({"request_delete_range": {"key": b64(&key)}})];
        // The address claim goes with it (a malformed record leaves its claim, never
        // someone else's).
        if let Ok(rec) = parse_vnic(&key, &old.value) {
            let ik = ip_key(rec.ip);
            if self.client.range_key(&ik)?.is_some_and(|e| e.value == name) {
                ops.push(json!({"request_delete_range": {"key": b64(&ik)}}));
            }
        }
        let r = self.client.txn(&json!({
            "compare": [{"key": b64(&key), "result": "EQUAL", "target": "MOD", "mod_revision": old.mod_revision.to_string()}],
            "success": ops,
        }))?;
        if r.succeeded {
            Ok(true)
        } else {
            Err(StoreError::Conflict(name.to_string()))
        }
    }

    fn put_host(&self, h: &HostRecord) -> Result<(), StoreError> {
        let id = lease::put_host_record(&self.client, self.host_ttl, h)?;
        let first = {
            let mut l = self.lease.lock();
            let first = l.is_none();
            if let Some(old) = l.replace(Lease { id, host: h.clone() }) {
                let _ = lease::revoke(&self.client, old.id);
            }
            first
        };
        if first {
            lease::spawn_keepalive(self.client.clone(), self.lease.clone(), self.stop.clone(), self.host_ttl);
        }
        Ok(())
    }

    fn list_hosts(&self) -> Result<Vec<HostRecord>, StoreError> {
        Ok(self.list(HOSTS)?.into_iter().filter_map(|e| if let StoreEvent::HostPut(h) = e { Some(h) } else { None }).collect())
    }

    fn put_rule(&self, r: &RuleRecord) -> Result<(), StoreError> {
        let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
        let value = serde_json::to_string(&r).map_err(|e| EtcdError::Encode(e.to_string()))?;
        self.client.call("/v3/kv/put", &json!({"key": b64(&rule_key(&r)), "value": b64(&value)}))?;
        Ok(())
    }

    fn delete_rule(&self, r: &RuleRecord) -> Result<bool, StoreError> {
        let d: DeleteResp = from_json(&self.client.call("/v3/kv/deleterange", &json!({"key": b64(&rule_key(r))}))?)?;
        Ok(d.deleted > 0)
    }

    fn list_rules(&self) -> Result<Vec<RuleRecord>, StoreError> {
        Ok(self.list(RULES)?.into_iter().filter_map(|e| if let StoreEvent::RulePut(r) = e { Some(r) } else { None }).collect())
    }

    fn put_tenant(&self, t: &TenantRecord) -> Result<(), StoreError> {
        let value = serde_json::to_string(t).map_err(|e| EtcdError::Encode(e.to_string()))?;
        self.client.call("/v3/kv/put", &json!({"key": b64(&tenant_key(&t.name)), "value": b64(&value)}))?;
        Ok(())
    }

    fn delete_tenant(&self, name: &str) -> Result<bool, StoreError> {
        let d: DeleteResp = from_json(&self.client.call("/v3/kv/deleterange", &json!({"key": b64(&tenant_key(name))}))?)?;
        Ok(d.deleted > 0)
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        Ok(self.list(TENANTS)?.into_iter().filter_map(|e| if let StoreEvent::TenantPut(t) = e { Some(t) } else { None }).collect())
    }

    fn snapshot(&self) -> Result<Snapshot, StoreError> {
        snapshot_of(&self.client)
    }

    fn watch(&self, from_revision: i64, cb: WatchCallback) -> Result<WatchHandle, StoreError> {
        let stop = Arc::new(AtomicBool::new(false));
        watch::spawn(self.client.clone(), from_revision, stop.clone(), self.stop.clone(), cb)
            .map_err(|e| EtcdError::Io { endpoint: "watch thread".into(), source: e })?;
        Ok(WatchHandle::new(stop))
    }
}
