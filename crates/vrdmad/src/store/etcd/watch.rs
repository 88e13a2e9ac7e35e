//! The watch: one thread following `/vrdma/` from a revision, delivering store events, and
//! resynchronising (a fresh snapshot) whenever the stream fails, ends or is compacted away.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::super::{StoreEvent, WatchCallback};
use super::client::Client;
use super::error::{truncate, EtcdError};
use super::http::HttpError;
use super::json::{b64, from_json, prefix_end, unb64, WatchMessage};
use super::keys::{event_of, PREFIX};
use super::{snapshot_of, POLL};

/// Largest single watch message.
pub const MAX_MESSAGE: usize = 16 << 20;
/// A watch stream silent this long is reconnected (with a resync): etcd sends nothing on a
/// quiet stream, and a cut link looks exactly like that.
const WATCH_IDLE: Duration = Duration::from_secs(15);

/// The events in one watch message, the revision it reaches, and whether the watch ended
/// (canceled or compacted: the caller must resync).
pub(super) fn decode_watch_message(line: &[u8]) -> Result<(Vec<StoreEvent>, i64, bool), EtcdError> {
    let m: WatchMessage = from_json(line)?;
    if let Some(e) = m.error {
        return Err(EtcdError::Json(format!("watch error: {}", truncate(&e.to_string()))));
    }
    let Some(r) = m.result else { return Ok((vec![], 0, false)) };
    let ended = r.canceled || r.compact_revision != 0;
    let mut events = Vec::new();
    // Only events advance the revision: a "created" message's header is the store's
    // current revision, sent before the history it is about to replay.
    let mut rev = 0;
    for ev in &r.events {
        let key = unb64(&ev.kv.key)?;
        rev = rev.max(ev.kv.mod_revision);
        let value = if ev.kind == "DELETE" { None } else { Some(unb64(&ev.kv.value)?) };
        match event_of(&key, value.as_deref()) {
            Ok(Some(e)) => events.push(e),
            Ok(None) => {}
            Err(e) => log::warn!("etcd watch: skipping {key}: {e}"),
        }
    }
    Ok((events, rev, ended))
}

/// One watch stream from `*rev + 1` until it fails, ends, stays idle or `stop`; `*rev`
/// follows the events delivered.
fn watch_stream(client: &Client, rev: &mut i64, stop: &AtomicBool, cb: &mut WatchCallback) -> Result<(), EtcdError> {
    let req = json!({"create_request": {"key": b64(PREFIX), "range_end": prefix_end(PREFIX), "start_revision": (*rev + 1).to_string()}});
    let mut s = client.stream("/v3/watch", &req, POLL)?;
    // A watch stream is long-lived: bound each message (MAX_MESSAGE, below), not the total.
    s.unlimited();
    let mut decoded = Vec::new();
    s.decode_buffered(&mut decoded)?;
    let mut last_data = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        while let Some(nl) = decoded.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = decoded.drain(..=nl).collect();
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let (events, r, ended) = decode_watch_message(&line)?;
            for e in events {
                cb(e);
            }
            *rev = (*rev).max(r);
            if ended {
                return Err(EtcdError::Json("watch canceled or compacted".into()));
            }
        }
        if decoded.len() > MAX_MESSAGE {
            return Err(HttpError::MessageTooLarge.into());
        }
        if s.done() {
            return Err(HttpError::StreamEnded.into());
        }
        if s.pump(&mut decoded)? {
            last_data = Instant::now();
        } else if last_data.elapsed() > WATCH_IDLE {
            return Ok(());
        }
    }
    Ok(())
}

/// Starts the watch thread: events after `from_revision` go to `cb` until `stop` or
/// `store_stop` is set.
pub(super) fn spawn(
    client: Arc<Client>,
    from_revision: i64,
    stop: Arc<AtomicBool>,
    store_stop: Arc<AtomicBool>,
    mut cb: WatchCallback,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("etcd-watch".into()).spawn(move || {
        let mut rev = from_revision;
        let stopped = || stop.load(Ordering::SeqCst) || store_stop.load(Ordering::SeqCst);
        let mut resync = false;
        while !stopped() {
            if std::mem::take(&mut resync) {
                match snapshot_of(&client) {
                    Ok(snap) => {
                        rev = snap.revision;
                        cb(StoreEvent::Resync(snap));
                    }
                    Err(e) => {
                        log::warn!("etcd watch: resync failed: {e}");
                        std::thread::sleep(Duration::from_secs(1));
                        resync = true;
                        continue;
                    }
                }
            }
            match watch_stream(&client, &mut rev, &stop, &mut cb) {
                // Idle (maybe a dead link): reconnect from the last event seen.
                Ok(()) => {}
                Err(e) => {
                    log::warn!("etcd watch: {e}; resynchronising");
                    resync = true;
                    std::thread::sleep(POLL);
                }
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::super::RuleRecord;
    use super::*;

    #[test]
    fn watch_messages() {
        let put = format!(
            r#"{{"result":{{"header":{{"revision":"9"}},"events":[{{"kv":{{"key":"{}","mod_revision":"8","value":"{}"}}}},{{"type":"DELETE","kv":{{"key":"{}","mod_revision":"9"}}}}]}}}}"#,
            b64("/vrdma/rules/a/b"),
            b64("{}"),
            b64("/vrdma/vnics/x")
        );
        let (ev, rev, ended) = decode_watch_message(put.as_bytes()).unwrap();
        assert_eq!(ev, vec![StoreEvent::RulePut(RuleRecord::new("a", "b")), StoreEvent::VnicDeleted("x".into())]);
        assert_eq!((rev, ended), (9, false));
        let (_, _, ended) = decode_watch_message(br#"{"result":{"canceled":true,"compact_revision":"3"}}"#).unwrap();
        assert!(ended);
        assert!(decode_watch_message(br#"{"result":{"events":[{"kv":{"key":"!!"}}]}}"#).is_err());
        assert!(decode_watch_message(br#"{"error":{"grpc_code":14}}"#).is_err());
        assert_eq!(decode_watch_message(br#"{"result":{"header":{"revision":"5"},"created":true}}"#).unwrap(), (vec![], 0, false));
    }
}
