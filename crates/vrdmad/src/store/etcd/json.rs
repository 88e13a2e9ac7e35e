//! The JSON shapes of etcd's v3 gateway (proto3 JSON: every field optional, int64 as
//! strings, keys and values base64) and the conversions to and from them.

use base64::Engine as _;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::error::{truncate, EtcdError};

fn int64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        S(String),
        I(i64),
    }
    match N::deserialize(d)? {
        N::I(i) => Ok(i),
        N::S(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RespHeader {
    #[serde(default, deserialize_with = "int64")]
    pub(super) revision: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct Kv {
    #[serde(default)]
    pub(super) key: String,
    #[serde(default)]
    pub(super) value: String,
    #[serde(default, deserialize_with = "int64")]
    pub(super) mod_revision: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RangeResp {
    #[serde(default)]
    pub(super) header: RespHeader,
    #[serde(default)]
    pub(super) kvs: Vec<Kv>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct TxnOpResp {
    pub(super) response_range: Option<RangeResp>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct TxnResp {
    #[serde(default)]
    pub(super) succeeded: bool,
    #[serde(default)]
    pub(super) responses: Vec<TxnOpResp>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct DeleteResp {
    #[serde(default, deserialize_with = "int64")]
    pub(super) deleted: i64,
}

#[derive(Debug, Default, Deserialize)]
#[allow(non_snake_case)]
pub(super) struct LeaseResp {
    #[serde(default, deserialize_with = "int64")]
    pub(super) ID: i64,
    #[serde(default, deserialize_with = "int64")]
    pub(super) TTL: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct KeepAliveResp {
    #[serde(default)]
    pub(super) result: LeaseResp,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct AuthenticateResp {
    #[serde(default)]
    pub(super) token: String,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct WatchEvent {
    #[serde(default, rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) kv: Kv,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct WatchResult {
    #[serde(default)]
    pub(super) canceled: bool,
    #[serde(default, deserialize_with = "int64")]
    pub(super) compact_revision: i64,
    #[serde(default)]
    pub(super) events: Vec<WatchEvent>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct WatchMessage {
    pub(super) result: Option<WatchResult>,
    pub(super) error: Option<Value>,
}

pub(super) fn from_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, EtcdError> {
    serde_json::from_slice(body).map_err(|e| EtcdError::Json(e.to_string()))
}

pub(super) fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
}

pub(super) fn unb64(s: &str) -> Result<String, EtcdError> {
    let raw = base64::engine::general_purpose::STANDARD.decode(s.as_bytes()).map_err(|e| EtcdError::Base64(e.to_string()))?;
    String::from_utf8(raw).map_err(|_| EtcdError::Base64("not UTF-8".into()))
}

/// `range_end` for every key starting with `prefix`.
pub(super) fn prefix_end(prefix: &str) -> String {
    let mut b = prefix.as_bytes().to_vec();
    if let Some(last) = b.last_mut() {
        *last += 1; // prefixes here end in '/', never 0xff
    }
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// A decoded key/value.
pub(super) struct Entry {
    pub(super) key: String,
    pub(super) value: String,
    pub(super) mod_revision: i64,
}

pub(super) fn decode_kv(kv: &Kv) -> Result<Entry, EtcdError> {
    Ok(Entry { key: unb64(&kv.key)?, value: unb64(&kv.value)?, mod_revision: kv.mod_revision })
}

/// etcd's message in an error reply (`{"error": …, "message": …, "code": …}`), else the
/// start of the body.
pub(super) fn status_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").or(v.get("error")).and_then(|m| m.as_str()).map(truncate))
        .unwrap_or_else(|| truncate(&String::from_utf8_lossy(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_replies_and_int64_strings() {
        assert_eq!(
            status_message(br#"{"error":"x","code":16,"message":"etcdserver: invalid auth token"}"#),
            "etcdserver: invalid auth token"
        );
        assert_eq!(status_message(br#"{"error":"etcdserver: too many requests","code":8}"#), "etcdserver: too many requests");
        assert_eq!(status_message(b"not json"), "not json");
        let r: LeaseResp = from_json(br#"{"ID":"7587","TTL":10}"#).unwrap();
        assert_eq!((r.ID, r.TTL), (7587, 10));
        assert!(from_json::<LeaseResp>(br#"{"ID":"x"}"#).is_err());
        let e = decode_kv(&Kv { key: b64("/vrdma/ips/1.2.3.4"), value: b64("a"), mod_revision: 3 }).unwrap();
        assert_eq!((e.key.as_str(), e.value.as_str(), e.mod_revision), ("/vrdma/ips/1.2.3.4", "a", 3));
        assert!(unb64("!!").is_err());
        assert_eq!(prefix_end("/vrdma/"), b64("/vrdma0"));
    }
}
