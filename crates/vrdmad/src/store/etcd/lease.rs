//! This host's record lives under a lease: a thread keeps the lease alive while the daemon
//! runs (registering again if it expired while we were cut off), so a dead daemon's host
//! disappears after the TTL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::json;

use super::super::{HostRecord, StoreError};
use super::client::Client;
use super::error::EtcdError;
use super::json::{b64, from_json, KeepAliveResp};
use super::keys::host_key;
use super::POLL;

/// The lease this host's record is under.
pub(super) struct Lease {
    pub(super) id: i64,
    pub(super) host: HostRecord,
}

/// Writes `h` under a new lease of `ttl` seconds; the lease's ID.
pub(super) fn put_host_record(client: &Client, ttl: i64, h: &HostRecord) -> Result<i64, StoreError> {
    let id = client.grant(ttl)?;
    let value = serde_json::to_string(h).map_err(|e| EtcdError::Encode(e.to_string()))?;
    client.call("/v3/kv/put", &json!({"key": b64(&host_key(&h.name)), "value": b64(&value), "lease": id.to_string()}))?;
    Ok(id)
}

/// Ends lease `id` now, deleting what is under it.
pub(super) fn revoke(client: &Client, id: i64) -> Result<(), EtcdError> {
    client.call("/v3/lease/revoke", &json!({"ID": id.to_string()})).map(drop)
}

/// Starts the thread keeping `lease` alive (every third of `ttl`) until `stop`.
pub(super) fn spawn_keepalive(client: Arc<Client>, lease: Arc<Mutex<Option<Lease>>>, stop: Arc<AtomicBool>, ttl: i64) {
    let period = Duration::from_secs((ttl / 3).max(1) as u64);
    let spawned = std::thread::Builder::new().name("etcd-keepalive".into()).spawn(move || {
        let mut next = Instant::now() + period;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(POLL.min(period));
            if Instant::now() < next {
                continue;
            }
            let Some((id, host)) = lease.lock().as_ref().map(|l| (l.id, l.host.clone())) else { continue };
            let alive = client
                .call("/v3/lease/keepalive", &json!({"ID": id.to_string()}))
                .and_then(|b| from_json::<KeepAliveResp>(&b))
                .map(|r| r.result.TTL > 0);
            match alive {
                Ok(true) => next = Instant::now() + period,
                Ok(false) => {
                    // Expired (we were cut off longer than the TTL): register again.
                    log::warn!("etcd: lease of host {} expired; registering again", host.name);
                    match put_host_record(&client, ttl, &host) {
                        Ok(id) => {
                            if let Some(l) = lease.lock().as_mut() {
                                l.id = id;
                            }
                            next = Instant::now() + period;
                        }
                        Err(e) => {
                            log::warn!("etcd: registering host {}: {e}", host.name);
                            next = Instant::now() + Duration::from_secs(1);
                        }
                    }
                }
                Err(e) => {
                    log::warn!("etcd: keepalive of host {}: {e}", host.name);
                    next = Instant::now() + Duration::from_secs(1);
                }
            }
        }
    });
    if let Err(e) = spawned {
        log::error!("etcd: cannot start the keepalive thread: {e}");
    }
}
