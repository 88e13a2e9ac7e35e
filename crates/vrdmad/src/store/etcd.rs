//! The etcd backend: etcd ≥ 3.4's v3 JSON gateway (`/v3/kv/*`, `/v3/watch`, `/v3/lease/*`,
//! `/v3/auth/authenticate`) over a small HTTP/1.1 client on `std::net::TcpStream`, plain or
//! wrapped in TLS (rustls; see [`super::etcd_security`]), with failover between endpoints.
//!
//! Keys (values are JSON):
//!
//! | key | value |
//! |---|---|
//! | `/vrdma/vnics/<name>` | [`VnicRecord`] |
//! | `/vrdma/ips/<a.b.c.d>` | the vNIC name holding the address |
//! | `/vrdma/hosts/<name>` | [`HostRecord`], under a lease the daemon keeps alive |
//! | `/vrdma/rules/<a>/<b>` | [`RuleRecord`] (tenants in sorted order) |
//!
//! Creating a vNIC is one transaction claiming both its name and its address key
//! (`create_revision == 0` on each), so two daemons never hand out the same address.
//!
//! etcd's replies are input like any other: heads, chunk sizes, bodies and single watch
//! messages are bounded, every field is optional, and nothing in a reply can panic us
//! ([`fuzz_decode`] is the fuzzer's entry point).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use parking_lot::Mutex;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

use super::etcd_security::{Credentials, Security, SecurityError};
use super::{HostRecord, RuleRecord, Snapshot, Store, StoreError, StoreEvent, VnicRecord, WatchCallback, WatchHandle};

/// Largest response head (status line and headers).
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest response body (a range over every key of a big cluster fits easily).
pub const MAX_BODY: usize = 64 << 20;
/// Longest auth token accepted from etcd (its simple and JWT tokens are far shorter).
const MAX_TOKEN: usize = 4096;

/// Whether an auth token from etcd can go into a request header as it is.
fn valid_token(t: &str) -> bool {
    !t.is_empty() && t.len() <= MAX_TOKEN && t.bytes().all(|b| b.is_ascii_graphic())
}
/// Largest single watch message.
pub const MAX_MESSAGE: usize = 16 << 20;
/// Longest chunk-size or trailer line.
const MAX_CHUNK_LINE: usize = 1024;

/// Time to connect to one endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Time for one unary request, connect to last byte.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A watch stream silent this long is reconnected (with a resync): etcd sends nothing on a
/// quiet stream, and a cut link looks exactly like that.
const WATCH_IDLE: Duration = Duration::from_secs(15);
/// Granularity of stop checks in the watch and keepalive threads (an idle daemon wakes
/// about once a second for them).
const POLL: Duration = Duration::from_secs(1);
/// TTL of a host's lease: a dead daemon's host record disappears after this.
pub const HOST_TTL_SECS: i64 = 10;

const PREFIX: &str = "/vrdma/";
const VNICS: &str = "/vrdma/vnics/";
const IPS: &str = "/vrdma/ips/";
const HOSTS: &str = "/vrdma/hosts/";
const RULES: &str = "/vrdma/rules/";

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
    Http(String),
    /// A reply is not the JSON we expect.
    #[error("malformed reply from etcd: {0}")]
    Json(String),
    /// A key or value is not valid base64.
    #[error("malformed base64 from etcd: {0}")]
    Base64(String),
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

fn http_err(s: impl Into<String>) -> EtcdError {
    EtcdError::Http(s.into())
}

// ----------------------------------------------------------------------------------------
// HTTP/1.1 decoding (pure, incremental, bounded)

/// A parsed response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// Status code.
    pub status: u16,
    /// How the body is framed.
    pub framing: Framing,
}

/// Body framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length`.
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes.
    UntilClose,
}

/// Finds the end of the head in `buf`: the offset just past `\r\n\r\n`.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Parses a complete head (`buf` ends with the blank line).
pub fn parse_head(buf: &[u8]) -> Result<Head, EtcdError> {
    let text = std::str::from_utf8(buf).map_err(|_| http_err("head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(http_err(format!("status line {:?}", truncate(status_line))));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| http_err(format!("status line {:?}", truncate(status_line))))?;
    let mut framing = Framing::UntilClose;
    let mut length_seen = false;
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or_else(|| http_err(format!("header line {:?}", truncate(line))))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if value.eq_ignore_ascii_case("chunked") {
                framing = Framing::Chunked;
            } else {
                return Err(http_err(format!("transfer encoding {:?}", truncate(value))));
            }
        } else if name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let n: usize = value.parse().map_err(|_| http_err(format!("content-length {:?}", truncate(value))))?;
            if n > MAX_BODY {
                return Err(http_err(format!("body of {n} bytes exceeds {MAX_BODY}")));
            }
            if length_seen && framing != Framing::Length(n) {
                return Err(http_err("conflicting content-length headers"));
            }
            length_seen = true;
            framing = Framing::Length(n);
        }
    }
    Ok(Head { status, framing })
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk: bytes left.
    Data(usize),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until a blank one.
    Trailer,
    Done,
}

/// Incremental decoder of a body: feed it bytes as they arrive, get the payload out.
#[derive(Debug, Clone)]
pub struct BodyDecoder {
    framing: Framing,
    chunk: ChunkState,
    /// Payload bytes produced so far (`Length`: also what is left to read).
    produced: usize,
    limit: usize,
}

impl BodyDecoder {
    /// A decoder for `framing` that fails once more than `limit` payload bytes arrive.
    pub fn new(framing: Framing, limit: usize) -> BodyDecoder {
        BodyDecoder { framing, chunk: ChunkState::Size, produced: 0, limit }
    }

    /// Whether the body is complete (never, for `UntilClose`, until [`Self::finish`]).
    pub fn is_done(&self) -> bool {
        match self.framing {
            Framing::Length(n) => self.produced >= n,
            Framing::Chunked => self.chunk == ChunkState::Done,
            Framing::UntilClose => false,
        }
    }

    /// The connection closed: Ok if that ends the body properly.
    pub fn finish(&self) -> Result<(), EtcdError> {
        match self.framing {
            Framing::UntilClose => Ok(()),
            _ if self.is_done() => Ok(()),
            _ => Err(http_err("connection closed in the middle of the body")),
        }
    }

    fn take(&mut self, n: usize) -> Result<(), EtcdError> {
        self.produced = self.produced.checked_add(n).ok_or_else(|| http_err("body size overflow"))?;
        if self.produced > self.limit {
            return Err(http_err(format!("body exceeds {} bytes", self.limit)));
        }
        Ok(())
    }

    /// Consumes a prefix of `input`, appending payload to `out`; returns how many bytes of
    /// `input` it consumed. Unconsumed bytes (an incomplete line) must be fed again with
    /// more data after them.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, EtcdError> {
        let mut at = 0;
        match self.framing {
            Framing::UntilClose => {
                self.take(input.len())?;
                out.extend_from_slice(input);
                return Ok(input.len());
            }
            Framing::Length(n) => {
                let k = (n - self.produced.min(n)).min(input.len());
                self.take(k)?;
                out.extend_from_slice(&input[..k]);
                return Ok(k);
            }
            Framing::Chunked => {}
        }
        loop {
            let rest = &input[at..];
            match self.chunk {
                ChunkState::Done => return Ok(at),
                ChunkState::Data(left) => {
                    if rest.is_empty() {
                        return Ok(at);
                    }
                    let k = left.min(rest.len());
                    self.take(k)?;
                    out.extend_from_slice(&rest[..k]);
                    at += k;
                    self.chunk = if k == left { ChunkState::DataEnd } else { ChunkState::Data(left - k) };
                }
                ChunkState::DataEnd => {
                    if rest.len() < 2 {
                        return Ok(at);
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err(http_err("chunk data not followed by CRLF"));
                    }
                    at += 2;
                    self.chunk = ChunkState::Size;
                }
                ChunkState::Size | ChunkState::Trailer => {
                    let Some(nl) = rest.iter().take(MAX_CHUNK_LINE + 1).position(|&b| b == b'\n') else {
                        if rest.len() > MAX_CHUNK_LINE {
                            return Err(http_err("chunk line too long"));
                        }
                        return Ok(at);
                    };
                    let line = &rest[..nl];
                    let line = line.strip_suffix(b"\r").ok_or_else(|| http_err("chunk line not ended by CRLF"))?;
                    at += nl + 1;
                    if self.chunk == ChunkState::Trailer {
                        if line.is_empty() {
                            self.chunk = ChunkState::Done;
                        }
                        continue;
                    }
                    let size = line.split(|&b| b == b';').next().unwrap_or_default();
                    let size = std::str::from_utf8(size).map_err(|_| http_err("chunk size is not ASCII"))?.trim();
                    if size.is_empty() || size.len() > 16 {
                        return Err(http_err(format!("chunk size {:?}", truncate(size))));
                    }
                    let n = usize::from_str_radix(size, 16).map_err(|_| http_err(format!("chunk size {:?}", truncate(size))))?;
                    if n > self.limit {
                        return Err(http_err(format!("chunk of {n} bytes exceeds {}", self.limit)));
                    }
                    self.chunk = if n == 0 { ChunkState::Trailer } else { ChunkState::Data(n) };
                }
            }
        }
    }
}

/// Decodes one complete HTTP/1.1 response: status and payload.
pub fn decode_response(data: &[u8]) -> Result<(u16, Vec<u8>), EtcdError> {
    let end = head_end(&data[..data.len().min(MAX_HEAD)]).ok_or_else(|| http_err("incomplete or oversized head"))?;
    let head = parse_head(&data[..end])?;
    let mut dec = BodyDecoder::new(head.framing, MAX_BODY);
    let mut out = Vec::new();
    dec.feed(&data[end..], &mut out)?;
    if !dec.is_done() {
        dec.finish()?;
    }
    Ok((head.status, out))
}

// ----------------------------------------------------------------------------------------
// JSON shapes of etcd's gateway (proto3 JSON: every field optional, int64 as strings)

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
struct RespHeader {
    #[serde(default, deserialize_with = "int64")]
    revision: i64,
}

#[derive(Debug, Default, Deserialize)]
struct Kv {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default, deserialize_with = "int64")]
    mod_revision: i64,
}

#[derive(Debug, Default, Deserialize)]
struct RangeResp {
    #[serde(default)]
    header: RespHeader,
    #[serde(default)]
    kvs: Vec<Kv>,
}

#[derive(Debug, Default, Deserialize)]
struct TxnOpResp {
    response_range: Option<RangeResp>,
}

#[derive(Debug, Default, Deserialize)]
struct TxnResp {
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<TxnOpResp>,
}

#[derive(Debug, Default, Deserialize)]
struct DeleteResp {
    #[serde(default, deserialize_with = "int64")]
    deleted: i64,
}

#[derive(Debug, Default, Deserialize)]
#[allow(non_snake_case)]
struct LeaseResp {
    #[serde(default, deserialize_with = "int64")]
    ID: i64,
    #[serde(default, deserialize_with = "int64")]
    TTL: i64,
}

#[derive(Debug, Default, Deserialize)]
struct KeepAliveResp {
    #[serde(default)]
    result: LeaseResp,
}

#[derive(Debug, Default, Deserialize)]
struct AuthenticateResp {
    #[serde(default)]
    token: String,
}

#[derive(Debug, Default, Deserialize)]
struct WatchEvent {
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    kv: Kv,
}

#[derive(Debug, Default, Deserialize)]
struct WatchResult {
    #[serde(default)]
    canceled: bool,
    #[serde(default, deserialize_with = "int64")]
    compact_revision: i64,
    #[serde(default)]
    events: Vec<WatchEvent>,
}

#[derive(Debug, Default, Deserialize)]
struct WatchMessage {
    result: Option<WatchResult>,
    error: Option<Value>,
}

fn from_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, EtcdError> {
    serde_json::from_slice(body).map_err(|e| EtcdError::Json(e.to_string()))
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
}

fn unb64(s: &str) -> Result<String, EtcdError> {
    let raw = base64::engine::general_purpose::STANDARD.decode(s.as_bytes()).map_err(|e| EtcdError::Base64(e.to_string()))?;
    String::from_utf8(raw).map_err(|_| EtcdError::Base64("not UTF-8".into()))
}

/// `range_end` for every key starting with `prefix`.
fn prefix_end(prefix: &str) -> String {
    let mut b = prefix.as_bytes().to_vec();
    if let Some(last) = b.last_mut() {
        *last += 1; // prefixes here end in '/', never 0xff
    }
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// A decoded key/value.
struct Entry {
    key: String,
    value: String,
    mod_revision: i64,
}

fn decode_kv(kv: &Kv) -> Result<Entry, EtcdError> {
    Ok(Entry { key: unb64(&kv.key)?, value: unb64(&kv.value)?, mod_revision: kv.mod_revision })
}

fn parse_value<T: for<'de> Deserialize<'de>>(key: &str, value: &str) -> Result<T, StoreError> {
    serde_json::from_str(value).map_err(|e| StoreError::BadRecord { key: key.to_string(), reason: e.to_string() })
}

/// The store event a put (`value: Some`) or delete of `key` means; None for keys that
/// carry no event (address claims, foreign keys).
fn event_of(key: &str, value: Option<&str>) -> Result<Option<StoreEvent>, StoreError> {
    if let Some(name) = key.strip_prefix(VNICS) {
        return Ok(Some(match value {
            Some(v) => StoreEvent::VnicPut(parse_value(key, v)?),
            None => StoreEvent::VnicDeleted(name.to_string()),
        }));
    }
    if let Some(name) = key.strip_prefix(HOSTS) {
        return Ok(Some(match value {
            Some(v) => StoreEvent::HostPut(parse_value(key, v)?),
            None => StoreEvent::HostDeleted(name.to_string()),
        }));
    }
    if let Some(pair) = key.strip_prefix(RULES) {
        let (a, b) = pair.split_once('/').ok_or_else(|| StoreError::BadRecord { key: key.into(), reason: "expected rules/A/B".into() })?;
        let r = RuleRecord::new(a, b);
        return Ok(Some(if value.is_some() { StoreEvent::RulePut(r) } else { StoreEvent::RuleDeleted(r) }));
    }
    Ok(None)
}

/// The events in one watch message, the revision it reaches, and whether the watch ended
/// (canceled or compacted: the caller must resync).
fn decode_watch_message(line: &[u8]) -> Result<(Vec<StoreEvent>, i64, bool), EtcdError> {
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

/// Fuzzing entry point: decodes `data` as an HTTP response from etcd and its body as every
/// reply shape we read (unary replies, newline-delimited watch messages). Never panics.
pub fn fuzz_decode(data: &[u8]) {
    let body = match decode_response(data) {
        Ok((_, b)) => b,
        Err(_) => data.to_vec(),
    };
    if let Ok(r) = from_json::<RangeResp>(&body) {
        for kv in &r.kvs {
            if let Ok(e) = decode_kv(kv) {
                let _ = event_of(&e.key, Some(&e.value));
                let _ = event_of(&e.key, None);
            }
        }
    }
    let _ = from_json::<TxnResp>(&body);
    let _ = from_json::<KeepAliveResp>(&body);
    let _ = from_json::<AuthenticateResp>(&body);
    let _ = status_message(&body);
    for line in body.split(|&b| b == b'\n') {
        let _ = decode_watch_message(line);
    }
    // The incremental decoder fed in small pieces must agree with the one-shot one.
    if let Some(end) = head_end(&data[..data.len().min(MAX_HEAD)]) {
        if let Ok(h) = parse_head(&data[..end]) {
            let mut dec = BodyDecoder::new(h.framing, MAX_BODY);
            let (mut pending, mut out) = (Vec::new(), Vec::new());
            for piece in data[end..].chunks(7) {
                pending.extend_from_slice(piece);
                match dec.feed(&pending, &mut out) {
                    Ok(n) => {
                        pending.drain(..n);
                    }
                    Err(_) => return,
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------
// The client

/// A connection to etcd: plain TCP or TLS over it; the HTTP code is the same for both.
trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// The read deadline of a connection, shared by its `Stream` and the socket under it.
#[derive(Clone)]
struct Deadline(Arc<Mutex<Instant>>);

impl Deadline {
    fn new(at: Instant) -> Deadline {
        Deadline(Arc::new(Mutex::new(at)))
    }

    fn set(&self, at: Instant) {
        *self.0.lock() = at;
    }
}

/// The socket under a connection. Every read ends by the deadline: a socket read timeout
/// alone only ends reads during which *nothing* arrives, and rustls keeps reading until a
/// whole record (up to 16 KiB) is in, so a peer trickling a byte per timeout could otherwise
/// hold one TLS read (or the handshake) for hours.
struct DeadlineTcp {
    tcp: TcpStream,
    /// Longest single wait (short, so that callers' loops check their own conditions).
    read_timeout: Duration,
    deadline: Deadline,
}

impl Read for DeadlineTcp {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.0.lock().saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        // set_read_timeout refuses zero.
        self.tcp.set_read_timeout(Some(left.min(self.read_timeout).max(Duration::from_millis(1))))?;
        self.tcp.read(buf)
    }
}

impl Write for DeadlineTcp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

struct Client {
    endpoints: Vec<String>,
    preferred: AtomicUsize,
    security: Security,
    /// The etcd auth token of the user in `security.credentials`; None until authenticated
    /// (or after etcd refused it). An empty token: etcd has auth disabled.
    token: Mutex<Option<String>>,
}

/// An open response whose body is read as it arrives.
struct Stream {
    io: Box<dyn Conn>,
    /// Bounds every read of `io`: the request's deadline (`until`), else one read timeout.
    deadline: Deadline,
    read_timeout: Duration,
    until: Option<Instant>,
    endpoint: String,
    status: u16,
    decoder: BodyDecoder,
    /// Raw bytes read but not yet decoded.
    raw: Vec<u8>,
    /// Set once the peer closed the connection.
    eof: bool,
}

impl Stream {
    /// Reads and decodes what arrives; Ok(false) on a read timeout, Ok(true) when progress
    /// was made or the body ended.
    fn pump(&mut self, out: &mut Vec<u8>) -> Result<bool, EtcdError> {
        let mut buf = [0u8; 16 * 1024];
        let this_read = Instant::now() + self.read_timeout;
        self.deadline.set(self.until.map_or(this_read, |u| u.min(this_read)));
        match self.io.read(&mut buf) {
            Ok(0) => {
                self.eof = true;
                self.decoder.finish()?;
                Ok(true)
            }
            Ok(n) => {
                self.raw.extend_from_slice(&buf[..n]);
                let used = self.decoder.feed(&self.raw, out)?;
                self.raw.drain(..used);
                if self.raw.len() > MAX_CHUNK_LINE + 2 && !matches!(self.decoder.chunk, ChunkState::Data(_)) && used == 0 {
                    return Err(http_err("undecodable body"));
                }
                Ok(true)
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(source) => Err(EtcdError::Io { endpoint: self.endpoint.clone(), source }),
        }
    }

    fn done(&self) -> bool {
        self.eof || self.decoder.is_done()
    }

    /// Reads the rest of a unary response: its body if the status is 200, else the error.
    fn finish_unary(mut self) -> Result<Vec<u8>, EtcdError> {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        self.until = Some(deadline);
        let mut out = Vec::new();
        let d = self.decoder.feed(&self.raw, &mut out)?;
        self.raw.drain(..d);
        while !self.done() {
            if Instant::now() > deadline {
                return Err(EtcdError::Io {
                    endpoint: self.endpoint,
                    source: std::io::Error::new(std::io::ErrorKind::TimedOut, "response body"),
                });
            }
            self.pump(&mut out)?;
        }
        if self.status != 200 {
            let message = status_message(&out);
            return Err(EtcdError::Status { endpoint: self.endpoint, status: self.status, message });
        }
        Ok(out)
    }
}

/// etcd's message in an error reply (`{"error": …, "message": …, "code": …}`), else the
/// start of the body.
fn status_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").or(v.get("error")).and_then(|m| m.as_str()).map(truncate))
        .unwrap_or_else(|| truncate(&String::from_utf8_lossy(body)))
}

/// Whether etcd refused a request for its auth token (invalid or expired token, auth
/// changed since it was issued, or none sent while auth is on): authenticating again fixes
/// it. The gateway maps gRPC's Unauthenticated to 401, the rest to 400 with these messages.
fn token_rejected(e: &EtcdError) -> bool {
    match e {
        EtcdError::Status { status: 401, .. } => true,
        EtcdError::Status { message, .. } => {
            ["invalid auth token", "revision of auth store is old", "user name is empty"].iter().any(|m| message.contains(m))
        }
        _ => false,
    }
}

/// Runs `req` with the current token (authenticating first when there is none); when etcd
/// rejects the token, authenticates again and retries once. Concurrent callers share one
/// authentication: whoever holds the lock refreshes, the others use the fresh token.
fn with_token<T>(
    token: &Mutex<Option<String>>,
    mut authenticate: impl FnMut() -> Result<String, EtcdError>,
    mut req: impl FnMut(&str) -> Result<T, EtcdError>,
) -> Result<T, EtcdError> {
    let current = {
        let mut t = token.lock();
        match &*t {
            Some(t) => t.clone(),
            None => t.insert(authenticate()?).clone(),
        }
    };
    match req(&current) {
        Err(e) if token_rejected(&e) => {
            let fresh = {
                let mut t = token.lock();
                match &*t {
                    // Someone else already replaced the rejected token.
                    Some(t) if *t != current => t.clone(),
                    _ => {
                        log::info!("etcd: auth token refused ({e}); authenticating again");
                        *t = None;
                        t.insert(authenticate()?).clone()
                    }
                }
            };
            req(&fresh)
        }
        r => r,
    }
}

/// The name the server certificate must carry: the endpoint's host (an IP address is
/// checked against the certificate's IP SANs).
fn server_name(endpoint: &str) -> Result<rustls::pki_types::ServerName<'static>, std::io::Error> {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?} is not a valid TLS server name: {e}")))
}

impl Client {
    fn new(endpoints: Vec<String>, security: Security) -> Client {
        Client { endpoints, preferred: AtomicUsize::new(0), security, token: Mutex::new(None) }
    }

    /// Connects to `endpoint` (TLS handshake included), sends `POST path` with `body`, and
    /// reads the response head.
    fn open(&self, endpoint: &str, path: &str, body: &[u8], token: &str, read_timeout: Duration) -> Result<Stream, EtcdError> {
        let io = |source| EtcdError::Io { endpoint: endpoint.to_string(), source };
        let addrs: Vec<_> = endpoint.to_socket_addrs().map_err(io)?.collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let mut tcp = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let tcp = tcp.ok_or_else(|| io(last))?;
        tcp.set_write_timeout(Some(REQUEST_TIMEOUT)).map_err(io)?;
        let _ = tcp.set_nodelay(true);
        // The handshake, the request and the response head share one deadline.
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        let shared = Deadline::new(deadline);
        let mut tcp = DeadlineTcp { tcp, read_timeout, deadline: shared.clone() };
        let mut conn: Box<dyn Conn> = match &self.security.tls {
            None => Box::new(tcp),
            Some(cfg) => {
                let tls = |source| EtcdError::Tls { endpoint: endpoint.to_string(), source };
                let mut c = rustls::ClientConnection::new(cfg.clone(), server_name(endpoint).map_err(tls)?)
                    .map_err(|e| tls(std::io::Error::other(e)))?;
                while c.is_handshaking() {
                    match c.complete_io(&mut tcp) {
                        Ok(_) => {}
                        // The short read timeout: the deadline decides.
                        Err(e)
                            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
                                && Instant::now() < deadline => {}
                        Err(e) => return Err(tls(e)),
                    }
                }
                Box::new(rustls::StreamOwned::new(c, tcp))
            }
        };
        let auth = if token.is_empty() { String::new() } else { format!("Authorization: {token}\r\n") };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        conn.write_all(&req).and_then(|()| conn.flush()).map_err(io)?;
        // The head.
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let end = loop {
            if let Some(e) = head_end(&raw) {
                break e;
            }
            if raw.len() > MAX_HEAD {
                return Err(http_err("response head too large"));
            }
            if Instant::now() > deadline {
                return Err(io(std::io::Error::new(std::io::ErrorKind::TimedOut, "no response head")));
            }
            match conn.read(&mut buf) {
                Ok(0) => {
                    // What a TLS-only etcd does to a plain request: say so.
                    let why = if self.security.tls.is_none() && raw.is_empty() {
                        "closed before the response head (if etcd serves TLS only, give --etcd-cacert)"
                    } else {
                        "closed before the response head"
                    };
                    return Err(io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, why)));
                }
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(io(e)),
            }
        };
        let head = parse_head(&raw[..end])?;
        raw.drain(..end);
        Ok(Stream {
            io: conn,
            deadline: shared,
            read_timeout,
            until: None,
            endpoint: endpoint.to_string(),
            status: head.status,
            decoder: BodyDecoder::new(head.framing, MAX_BODY),
            raw,
            eof: false,
        })
    }

    /// Endpoints in the order to try them: the last one that worked first.
    fn order(&self) -> Vec<usize> {
        let n = self.endpoints.len();
        let p = self.preferred.load(Ordering::Relaxed) % n.max(1);
        (0..n).map(|i| (p + i) % n).collect()
    }

    /// Runs `req` with the user's token when credentials are configured.
    fn authorized<T>(&self, req: impl FnMut(&str) -> Result<T, EtcdError>) -> Result<T, EtcdError> {
        let Some(cred) = &self.security.credentials else {
            let mut req = req;
            return req("");
        };
        with_token(&self.token, || self.authenticate(cred), req)
    }

    /// Exchanges the user's password for a token (`""` if etcd has auth disabled: then no
    /// token is needed, and one is fetched once etcd asks for it).
    fn authenticate(&self, cred: &Credentials) -> Result<String, EtcdError> {
        let body = json!({"name": cred.user, "password": cred.password.expose()});
        match self.call_with("/v3/auth/authenticate", &body, "") {
            Ok(b) => {
                let r: AuthenticateResp = from_json(&b)?;
                if r.token.is_empty() {
                    return Err(EtcdError::Auth { user: cred.user.clone(), message: "no token in etcd's reply".into() });
                }
                // It goes into a header of every request: printable ASCII and bounded, or a
                // reply could inject headers (or a whole request) into the next ones.
                if !valid_token(&r.token) {
                    return Err(EtcdError::Auth { user: cred.user.clone(), message: "malformed token in etcd's reply".into() });
                }
                Ok(r.token)
            }
            Err(EtcdError::Status { message, .. }) if message.contains("authentication is not enabled") => {
                log::debug!("etcd: auth is not enabled; requests go without a token");
                Ok(String::new())
            }
            Err(EtcdError::Status { message, .. }) => Err(EtcdError::Auth { user: cred.user.clone(), message }),
            Err(e) => Err(e),
        }
    }

    /// One request, failing over between endpoints on transport errors, authenticated.
    fn call(&self, path: &str, body: &Value) -> Result<Vec<u8>, EtcdError> {
        self.authorized(|token| self.call_with(path, body, token))
    }

    /// One request with `token`, failing over between endpoints on transport errors.
    fn call_with(&self, path: &str, body: &Value, token: &str) -> Result<Vec<u8>, EtcdError> {
        let body = body.to_string().into_bytes();
        let mut failures = Vec::new();
        for i in self.order() {
            let ep = &self.endpoints[i];
            match self.open(ep, path, &body, token, Duration::from_millis(200)).and_then(Stream::finish_unary) {
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

    /// Opens a streaming request (the watch) on the first endpoint that answers 200.
    fn stream(&self, path: &str, body: &Value) -> Result<Stream, EtcdError> {
        let body = body.to_string().into_bytes();
        self.authorized(|token| {
            let mut failures = Vec::new();
            for i in self.order() {
                let ep = &self.endpoints[i];
                match self.open(ep, path, &body, token, POLL) {
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

    fn range_prefix(&self, prefix: &str) -> Result<RangeResp, EtcdError> {
        from_json(&self.call("/v3/kv/range", &json!({"key": b64(prefix), "range_end": prefix_end(prefix)}))?)
    }

    fn range_key(&self, key: &str) -> Result<Option<Entry>, EtcdError> {
        let r: RangeResp = from_json(&self.call("/v3/kv/range", &json!({"key": b64(key)}))?)?;
        r.kvs.first().map(decode_kv).transpose()
    }

    fn txn(&self, body: &Value) -> Result<TxnResp, EtcdError> {
        from_json(&self.call("/v3/kv/txn", body)?)
    }

    fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let r: LeaseResp = from_json(&self.call("/v3/lease/grant", &json!({"TTL": ttl.to_string()}))?)?;
        if r.ID == 0 {
            return Err(EtcdError::Json("lease grant without an ID".into()));
        }
        Ok(r.ID)
    }
}

// ----------------------------------------------------------------------------------------
// The store

struct Lease {
    id: i64,
    host: HostRecord,
}

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

    /// A store on `endpoints` with TLS and credentials as loaded by
    /// [`super::EtcdConfig::load`], a host lease of `ttl` seconds; checked by reading once
    /// (which authenticates, so wrong credentials fail here).
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
        s.client.range_key("/vrdma/")?;
        Ok(s)
    }

    /// Whether etcd answers over plain HTTP (`/health`-like: a read of one key).
    pub fn healthy(endpoints: &[String]) -> bool {
        Client::new(endpoints.to_vec(), Security::default()).range_key("/vrdma/").is_ok()
    }

    /// Whether etcd answers with this configuration's TLS and credentials.
    pub fn healthy_with(cfg: &super::EtcdConfig) -> bool {
        match cfg.load() {
            Ok(sec) => Client::new(cfg.endpoints.clone(), sec).range_key("/vrdma/").is_ok(),
            Err(_) => false,
        }
    }

    /// One raw request to etcd's JSON gateway with this store's connection settings
    /// (tooling and tests: user and role administration, `auth enable`); the reply's JSON.
    pub fn gateway_call(&self, path: &str, body: &Value) -> Result<Value, StoreError> {
        Ok(from_json(&self.client.call(path, body)?)?)
    }

    fn list<T: for<'de> Deserialize<'de>>(&self, prefix: &str) -> Result<Vec<T>, StoreError> {
        let r = self.client.range_prefix(prefix)?;
        let mut out = Vec::new();
        for kv in &r.kvs {
            let e = decode_kv(kv)?;
            match parse_value(&e.key, &e.value) {
                Ok(v) => out.push(v),
                Err(err) => log::warn!("etcd: skipping {}: {err}", e.key),
            }
        }
        Ok(out)
    }

    fn put_host_record(client: &Client, ttl: i64, h: &HostRecord) -> Result<i64, StoreError> {
        let id = client.grant(ttl)?;
        let value = serde_json::to_string(h).expect("serializable");
        client.call("/v3/kv/put", &json!({"key": b64(&format!("{HOSTS}{}", h.name)), "value": b64(&value), "lease": id.to_string()}))?;
        Ok(id)
    }

    fn spawn_keepalive(&self) {
        let (client, lease, stop, ttl) = (self.client.clone(), self.lease.clone(), self.stop.clone(), self.host_ttl);
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
                        match Self::put_host_record(&client, ttl, &host) {
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

    /// One watch stream from `*rev + 1` until it fails, ends, stays idle or `stop`; `*rev`
    /// follows the events delivered.
    fn watch_stream(client: &Client, rev: &mut i64, stop: &AtomicBool, cb: &mut WatchCallback) -> Result<(), EtcdError> {
        let req =
            json!({"create_request": {"key": b64(PREFIX), "range_end": prefix_end(PREFIX), "start_revision": (*rev + 1).to_string()}});
        let mut s = client.stream("/v3/watch", &req)?;
        // A watch stream is long-lived: bound each message (MAX_MESSAGE, below), not the
        // total.
        s.decoder.limit = usize::MAX;
        let mut decoded = Vec::new();
        let used = s.decoder.feed(&s.raw, &mut decoded)?;
        s.raw.drain(..used);
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
                return Err(http_err("watch message too large"));
            }
            if s.done() {
                return Err(http_err("watch stream ended"));
            }
            if s.pump(&mut decoded)? {
                last_data = Instant::now();
            } else if last_data.elapsed() > WATCH_IDLE {
                return Ok(());
            }
        }
        Ok(())
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(l) = self.lease.lock().take() {
            // Best effort: the host disappears now rather than after its TTL.
            let _ = self.client.call("/v3/lease/revoke", &json!({"ID": l.id.to_string()}));
        }
    }
}

fn vnic_key(name: &str) -> String {
    format!("{VNICS}{name}")
}
fn ip_key(ip: Ipv4Addr) -> String {
    format!("{IPS}{ip}")
}
fn rule_key(r: &RuleRecord) -> String {
    let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
    format!("{RULES}{}/{}", r.from_tenant, r.to_tenant)
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
            Ok(_) => {}
            Err(err) => log::warn!("etcd: skipping {}: {err}", e.key),
        }
    }
    Ok(snap)
}

impl Store for EtcdStore {
    fn list_vnics(&self) -> Result<Vec<VnicRecord>, StoreError> {
        self.list(VNICS)
    }

    fn get_vnic(&self, name: &str) -> Result<Option<VnicRecord>, StoreError> {
        let key = vnic_key(name);
        self.client.range_key(&key)?.map(|e| parse_value(&key, &e.value)).transpose()
    }

    fn create_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        let (nk, ik) = (vnic_key(&v.name), ip_key(v.ip));
        let value = serde_json::to_string(v).expect("serializable");
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
        let old_rec: VnicRecord = parse_value(&key, &old.value)?;
        if old_rec.ip != v.ip {
            return Err(StoreError::IpChanged(v.name.clone()));
        }
        let value = serde_json::to_string(v).expect("serializable");
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
        if let Ok(rec) = parse_value::<VnicRecord>(&key, &old.value) {
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
        let id = Self::put_host_record(&self.client, self.host_ttl, h)?;
        let first = {
            let mut l = self.lease.lock();
            let first = l.is_none();
            if let Some(old) = l.replace(Lease { id, host: h.clone() }) {
                let _ = self.client.call("/v3/lease/revoke", &json!({"ID": old.id.to_string()}));
            }
            first
        };
        if first {
            self.spawn_keepalive();
        }
        Ok(())
    }

    fn list_hosts(&self) -> Result<Vec<HostRecord>, StoreError> {
        self.list(HOSTS)
    }

    fn put_rule(&self, r: &RuleRecord) -> Result<(), StoreError> {
        let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
        let value = serde_json::to_string(&r).expect("serializable");
        self.client.call("/v3/kv/put", &json!({"key": b64(&rule_key(&r)), "value": b64(&value)}))?;
        Ok(())
    }

    fn delete_rule(&self, r: &RuleRecord) -> Result<bool, StoreError> {
        let d: DeleteResp = from_json(&self.client.call("/v3/kv/deleterange", &json!({"key": b64(&rule_key(r))}))?)?;
        Ok(d.deleted > 0)
    }

    fn list_rules(&self) -> Result<Vec<RuleRecord>, StoreError> {
        self.list(RULES)
    }

    fn snapshot(&self) -> Result<Snapshot, StoreError> {
        snapshot_of(&self.client)
    }

    fn watch(&self, from_revision: i64, mut cb: WatchCallback) -> Result<WatchHandle, StoreError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (client, stop2, store_stop) = (self.client.clone(), stop.clone(), self.stop.clone());
        std::thread::Builder::new()
            .name("etcd-watch".into())
            .spawn(move || {
                let mut rev = from_revision;
                let stopped = || stop2.load(Ordering::SeqCst) || store_stop.load(Ordering::SeqCst);
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
                    match Self::watch_stream(&client, &mut rev, &stop2, &mut cb) {
                        // Idle (maybe a dead link): reconnect from the last event seen.
                        Ok(()) => {}
                        Err(e) => {
                            log::warn!("etcd watch: {e}; resynchronising");
                            resync = true;
                            std::thread::sleep(POLL);
                        }
                    }
                }
            })
            .map_err(|e| EtcdError::Io { endpoint: "watch thread".into(), source: e })?;
        Ok(WatchHandle::new(stop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_that_could_break_a_header_are_refused() {
        assert!(valid_token("DjUwMVxJ.abc-123_~"));
        assert!(valid_token("eyJhbGciOiJSUzI1NiJ9.eyJ1c2VybmFtZSI6InZyZG1hIn0.c2ln"));
        for bad in ["", "a\r\nX-Injected: 1", "a b", "tok\n", "t\u{e9}"] {
            assert!(!valid_token(bad), "{bad:?}");
        }
        assert!(!valid_token(&"a".repeat(MAX_TOKEN + 1)));
    }

    /// A peer that trickles one byte per 50 ms (each socket read returns, never timing out)
    /// cannot hold a read loop past the connection's deadline.
    #[test]
    fn a_trickling_peer_cannot_hold_reads_past_the_deadline() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..60 {
                if s.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let tcp = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        let mut s =
            DeadlineTcp { tcp, read_timeout: Duration::from_millis(200), deadline: Deadline::new(start + Duration::from_millis(400)) };
        // What rustls does for one record: read until it is complete.
        let mut got = Vec::new();
        let err = loop {
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(0) => panic!("eof"),
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(e) => break e,
            }
        };
        // The deadline itself (TimedOut) or the socket timeout capped by it (WouldBlock).
        assert!(matches!(err.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock), "{err}");
        let took = start.elapsed();
        assert!(took < Duration::from_millis(1500), "read loop lasted {took:?}");
        assert!(!got.is_empty(), "bytes before the deadline are delivered");
        drop(s);
        server.join().unwrap();
    }

    #[test]
    fn heads_and_bodies() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(decode_response(r).unwrap(), (200, b"hello".to_vec()));
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n1\r\n!\r\n0\r\nT: v\r\n\r\n";
        assert_eq!(decode_response(r).unwrap(), (200, b"hello!".to_vec()));
        let r = b"HTTP/1.1 404 Not Found\r\n\r\nnope";
        assert_eq!(decode_response(r).unwrap(), (404, b"nope".to_vec()));
        for bad in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
            b"SMTP 200 OK\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n",
        ] {
            assert!(decode_response(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn chunked_decoding_is_incremental() {
        let body = b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n";
        for step in 1..body.len() {
            let mut d = BodyDecoder::new(Framing::Chunked, 1000);
            let (mut pending, mut out) = (Vec::new(), Vec::new());
            for piece in body.chunks(step) {
                pending.extend_from_slice(piece);
                let n = d.feed(&pending, &mut out).unwrap();
                pending.drain(..n);
            }
            assert!(d.is_done(), "step {step}");
            assert_eq!(out, b"abc0123456789abcdef");
        }
        let mut d = BodyDecoder::new(Framing::Chunked, 4);
        assert!(d.feed(b"5\r\nhello\r\n", &mut Vec::new()).is_err());
    }

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
        fuzz_decode(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}\n\r\n0\r\n\r\n");
    }

    fn refused(status: u16, message: &str) -> EtcdError {
        EtcdError::Status { endpoint: "e:1".into(), status, message: message.into() }
    }

    #[test]
    fn token_is_fetched_once_and_refreshed_once_when_refused() {
        let token = Mutex::new(None);
        let auths = std::cell::Cell::new(0);
        let authenticate = || {
            auths.set(auths.get() + 1);
            Ok(format!("t{}", auths.get()))
        };
        // First use authenticates; later ones reuse the token.
        assert_eq!(with_token(&token, authenticate, |t| Ok(t.to_string())).unwrap(), "t1");
        assert_eq!(with_token(&token, authenticate, |t| Ok(t.to_string())).unwrap(), "t1");
        assert_eq!(auths.get(), 1);
        // An expired token: authenticate again, retry with the new one.
        for msg in ["etcdserver: invalid auth token", "etcdserver: revision of auth store is old", "etcdserver: user name is empty"] {
            let before = auths.get();
            let mut seen = Vec::new();
            let r = with_token(&token, authenticate, |t| {
                seen.push(t.to_string());
                if seen.len() == 1 {
                    Err(refused(400, msg))
                } else {
                    Ok(())
                }
            });
            assert!(r.is_ok(), "{msg}");
            assert_eq!(auths.get(), before + 1);
            assert_eq!(seen, vec![format!("t{before}"), format!("t{}", before + 1)]);
        }
        // Refused twice: the second refusal is the answer (no loop).
        let calls = std::cell::Cell::new(0);
        let r: Result<(), _> = with_token(&token, authenticate, |_| {
            calls.set(calls.get() + 1);
            Err(refused(401, "unauthenticated"))
        });
        assert!(matches!(r, Err(EtcdError::Status { status: 401, .. })));
        assert_eq!(calls.get(), 2);
        // Other errors are not about the token.
        let before = auths.get();
        let r: Result<(), _> = with_token(&token, authenticate, |_| Err(refused(400, "etcdserver: permission denied")));
        assert!(r.is_err());
        assert_eq!(auths.get(), before);
        // A failed authentication is the answer, and the next call tries again.
        let none = Mutex::new(None);
        let r: Result<(), _> = with_token(&none, || Err(EtcdError::Auth { user: "u".into(), message: "bad".into() }), |_| Ok(()));
        assert!(matches!(r, Err(EtcdError::Auth { .. })));
        assert!(none.lock().is_none());
    }

    #[test]
    fn tls_server_names() {
        use rustls::pki_types::ServerName;
        assert!(matches!(server_name("198.19.0.1:2379").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:2379").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("etcd-0.example:2379").unwrap(), ServerName::DnsName(_)));
        assert!(server_name("bad name:2379").is_err());
        fuzz_decode(b"HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{\"token\":\"abc.1\"}");
        assert_eq!(
            status_message(br#"{"error":"x","code":16,"message":"etcdserver: invalid auth token"}"#),
            "etcdserver: invalid auth token"
        );
    }

    /// A real etcd on 127.0.0.1 for the duration of a test (skipped when not installed).
    pub(crate) struct TestEtcd {
        child: std::process::Child,
        dir: std::path::PathBuf,
        pub endpoint: String,
    }

    impl TestEtcd {
        pub(crate) fn start(tag: &str) -> Option<TestEtcd> {
            if !std::path::Path::new("/usr/bin/etcd").exists() {
                eprintln!("SKIPPED: /usr/bin/etcd is not installed (Debian package etcd-server)");
                return None;
            }
            // Free ports: bind port 0 and let go (a race with other tests is unlikely).
            let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let (cp, pp) = (port(), port());
            let dir = std::env::temp_dir().join(format!("vrdma-etcd-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let client = format!("http://127.0.0.1:{cp}");
            let peer = format!("http://127.0.0.1:{pp}");
            let child = std::process::Command::new("/usr/bin/etcd")
                .args(["--name", "t", "--data-dir"])
                .arg(dir.join("data"))
                .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &format!("t={peer}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
                .spawn()
                .unwrap();
            let e = TestEtcd { child, dir, endpoint: format!("127.0.0.1:{cp}") };
            let deadline = Instant::now() + Duration::from_secs(20);
            while !EtcdStore::healthy(std::slice::from_ref(&e.endpoint)) {
                assert!(Instant::now() < deadline, "etcd did not start");
                std::thread::sleep(Duration::from_millis(100));
            }
            Some(e)
        }
    }

    impl Drop for TestEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn rec(name: &str, ip: u8, host: &str) -> VnicRecord {
        VnicRecord {
            name: name.into(),
            tenant: "t".into(),
            ip: Ipv4Addr::new(198, 18, 1, ip),
            prefix_len: 15,
            limits: Default::default(),
            node_guid: 7,
            host: host.into(),
        }
    }

    fn next(rx: &std::sync::mpsc::Receiver<StoreEvent>) -> StoreEvent {
        loop {
            match rx.recv_timeout(Duration::from_secs(10)).expect("a watch event") {
                StoreEvent::HostPut(_) | StoreEvent::HostDeleted(_) => continue,
                e => return e,
            }
        }
    }

    /// A member answering 429 (overloaded, "too many requests") is failed over like one that
    /// is down, not taken for a wrong request (or, when authenticating, wrong credentials).
    #[test]
    fn an_overloaded_member_is_failed_over() {
        let Some(etcd) = TestEtcd::start("busy") else { return };
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let mut b = [0u8; 4096];
                let _ = s.read(&mut b);
                let body = r#"{"error":"etcdserver: too many requests","code":8}"#;
                let _ = write!(s, "HTTP/1.1 429 Too Many Requests\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            }
        });
        let s = EtcdStore::connect(vec![busy, etcd.endpoint.clone()]).unwrap();
        s.create_vnic(&rec("a", 2, "h1")).unwrap();
        assert_eq!(s.get_vnic("a").unwrap(), Some(rec("a", 2, "h1")));
    }

    #[test]
    fn crud_txn_watch_against_real_etcd() {
        let Some(etcd) = TestEtcd::start("crud") else { return };
        // The first endpoint is dead: every call fails over to the second.
        let s = EtcdStore::connect(vec!["127.0.0.1:1".into(), etcd.endpoint.clone()]).unwrap();
        let snap = s.snapshot().unwrap();
        assert!(snap.vnics.is_empty() && snap.revision > 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let _w = s.watch(snap.revision, Box::new(move |e| tx.send(e).unwrap())).unwrap();

        let a = rec("a", 2, "h1");
        s.create_vnic(&a).unwrap();
        assert!(matches!(s.create_vnic(&a), Err(StoreError::NameTaken(_))));
        assert!(matches!(s.create_vnic(&rec("b", 2, "h1")), Err(StoreError::IpTaken(_))));
        assert_eq!(s.get_vnic("a").unwrap(), Some(a.clone()));
        assert_eq!(s.get_vnic("zz").unwrap(), None);
        let mut moved = a.clone();
        moved.host = "h2".into();
        s.update_vnic(&moved).unwrap();
        assert!(matches!(s.update_vnic(&rec("a", 3, "h1")), Err(StoreError::IpChanged(_))));
        assert!(matches!(s.update_vnic(&rec("nope", 9, "h1")), Err(StoreError::NotFound(_))));
        s.put_rule(&RuleRecord::new("red", "blue")).unwrap();
        assert_eq!(s.list_rules().unwrap(), vec![RuleRecord::new("blue", "red")]);
        assert!(s.delete_rule(&RuleRecord::new("blue", "red")).unwrap());
        assert!(!s.delete_rule(&RuleRecord::new("blue", "red")).unwrap());
        assert!(s.delete_vnic("a").unwrap());
        assert!(!s.delete_vnic("a").unwrap());
        s.create_vnic(&rec("b", 2, "h1")).unwrap(); // the address was freed with "a"
        assert_eq!(s.list_vnics().unwrap(), vec![rec("b", 2, "h1")]);

        assert_eq!(next(&rx), StoreEvent::VnicPut(a.clone()));
        assert_eq!(next(&rx), StoreEvent::VnicPut(moved));
        assert_eq!(next(&rx), StoreEvent::RulePut(RuleRecord::new("blue", "red")));
        assert_eq!(next(&rx), StoreEvent::RuleDeleted(RuleRecord::new("blue", "red")));
        assert_eq!(next(&rx), StoreEvent::VnicDeleted("a".into()));
        assert_eq!(next(&rx), StoreEvent::VnicPut(rec("b", 2, "h1")));

        // Hosts live under a lease: revoked when the store is dropped, expired when the
        // daemon dies without dropping it.
        let h = HostRecord {
            name: "h1".into(),
            transport_addr: "198.19.255.11:4791".parse().unwrap(),
            underlay_ip: Ipv4Addr::new(198, 19, 255, 11),
        };
        let s2 = EtcdStore::connect_with_ttl(vec![etcd.endpoint.clone()], 2).unwrap();
        s2.put_host(&h).unwrap();
        assert_eq!(s.list_hosts().unwrap(), vec![h.clone()]);
        std::thread::sleep(Duration::from_secs(4)); // > TTL: kept alive
        assert_eq!(s.list_hosts().unwrap(), vec![h.clone()]);
        s2.stop.store(true, Ordering::SeqCst); // keepalive stops, as if the daemon hung
        let deadline = Instant::now() + Duration::from_secs(10);
        while !s.list_hosts().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "host record did not expire");
            std::thread::sleep(Duration::from_millis(200));
        }
        s2.lease.lock().take();
    }

    #[test]
    fn concurrent_creates_never_share_an_address() {
        let Some(etcd) = TestEtcd::start("race") else { return };
        let stores: Vec<_> = (0..2).map(|_| Arc::new(EtcdStore::connect(vec![etcd.endpoint.clone()]).unwrap())).collect();
        let threads: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for n in 0..20 {
                        // Both start from the same address and walk up on IpTaken.
                        let mut ip = 2u8;
                        loop {
                            match s.create_vnic(&rec(&format!("v{i}-{n}"), ip, "h")) {
                                Ok(()) => break,
                                Err(StoreError::IpTaken(_)) => ip += 1,
                                Err(e) => panic!("{e}"),
                            }
                        }
                        mine.push(ip);
                    }
                    mine
                })
            })
            .collect();
        let mut all: Vec<u8> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 40);
        assert_eq!(stores[0].list_vnics().unwrap().len(), 40);
    }

    #[test]
    fn watch_from_a_compacted_revision_resyncs() {
        let Some(etcd) = TestEtcd::start("resync") else { return };
        let s = EtcdStore::connect(vec![etcd.endpoint.clone()]).unwrap();
        s.create_vnic(&rec("a", 2, "h")).unwrap();
        s.create_vnic(&rec("b", 3, "h")).unwrap();
        let rev = s.snapshot().unwrap().revision;
        s.client.call("/v3/kv/compaction", &json!({"revision": rev.to_string(), "physical": true})).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let _w = s.watch(1, Box::new(move |e| tx.send(e).unwrap())).unwrap();
        match next(&rx) {
            StoreEvent::Resync(snap) => {
                assert_eq!(snap.vnics, vec![rec("a", 2, "h"), rec("b", 3, "h")]);
                assert!(snap.revision >= rev);
            }
            e => panic!("expected a resync, got {e:?}"),
        }
        s.create_vnic(&rec("c", 4, "h")).unwrap();
        assert_eq!(next(&rx), StoreEvent::VnicPut(rec("c", 4, "h")));
    }
}
