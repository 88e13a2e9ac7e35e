//! One HTTP exchange on a [`Connection`]: the request, the response head, then the body
//! decoded as it arrives (read to the end for a unary call, or followed for the watch).

use std::io::{Read, Write};
use std::time::Instant;

use super::conn::{Connection, REQUEST_TIMEOUT};
use super::error::EtcdError;
use super::http::{head_end, parse_head, BodyDecoder, HttpError, MAX_BODY, MAX_CHUNK_LINE, MAX_HEAD};
use super::json::status_message;

/// An open response whose body is read as it arrives.
pub(super) struct Stream {
    conn: Connection,
    /// The request's deadline for every read, else one read timeout.
    until: Option<Instant>,
    pub(super) status: u16,
    decoder: BodyDecoder,
    /// Raw bytes read but not yet decoded.
    raw: Vec<u8>,
    /// Set once the peer closed the connection.
    eof: bool,
}

impl Stream {
    /// Sends `POST path` with `body` (and `token`, unless empty) and reads the response head,
    /// by the connection's deadline.
    pub(super) fn open(mut conn: Connection, path: &str, body: &[u8], token: &str) -> Result<Stream, EtcdError> {
        let endpoint = &conn.endpoint;
        let auth = if token.is_empty() { String::new() } else { format!("Authorization: {token}\r\n") };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        conn.io.write_all(&req).and_then(|()| conn.io.flush()).map_err(|e| conn.io_error(e))?;
        let deadline = conn.deadline.at();
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let end = loop {
            if let Some(e) = head_end(&raw) {
                break e;
            }
            if raw.len() > MAX_HEAD {
                return Err(HttpError::HeadTooLarge.into());
            }
            if Instant::now() > deadline {
                return Err(conn.io_error(std::io::Error::new(std::io::ErrorKind::TimedOut, "no response head")));
            }
            match conn.io.read(&mut buf) {
                Ok(0) => {
                    // What a TLS-only etcd does to a plain request: say so.
                    let why = if !conn.tls && raw.is_empty() {
                        "closed before the response head (if etcd serves TLS only, give --etcd-cacert)"
                    } else {
                        "closed before the response head"
                    };
                    return Err(conn.io_error(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, why)));
                }
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(conn.io_error(e)),
            }
        };
        let head = parse_head(&raw[..end])?;
        raw.drain(..end);
        Ok(Stream { conn, until: None, status: head.status, decoder: BodyDecoder::new(head.framing, MAX_BODY), raw, eof: false })
    }

    /// Lets the body grow without bound (a watch bounds each message instead).
    pub(super) fn unlimited(&mut self) {
        self.decoder.set_limit(usize::MAX);
    }

    /// Decodes what was read along with the head.
    pub(super) fn decode_buffered(&mut self, out: &mut Vec<u8>) -> Result<(), EtcdError> {
        let used = self.decoder.feed(&self.raw, out)?;
        self.raw.drain(..used);
        Ok(())
    }

    /// Reads and decodes what arrives; Ok(false) on a read timeout, Ok(true) when progress
    /// was made or the body ended.
    pub(super) fn pump(&mut self, out: &mut Vec<u8>) -> Result<bool, EtcdError> {
        let mut buf = [0u8; 16 * 1024];
        let this_read = Instant::now() + self.conn.read_timeout;
        self.conn.deadline.set(self.until.map_or(this_read, |u| u.min(this_read)));
        match self.conn.io.read(&mut buf) {
            Ok(0) => {
                self.eof = true;
                self.decoder.finish()?;
                Ok(true)
            }
            Ok(n) => {
                self.raw.extend_from_slice(&buf[..n]);
                let used = self.decoder.feed(&self.raw, out)?;
                self.raw.drain(..used);
                if self.raw.len() > MAX_CHUNK_LINE + 2 && !self.decoder.in_chunk_data() && used == 0 {
                    return Err(HttpError::Undecodable.into());
                }
                Ok(true)
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(source) => Err(self.conn.io_error(source)),
        }
    }

    pub(super) fn done(&self) -> bool {
        self.eof || self.decoder.is_done()
    }

    /// Reads the rest of a unary response: its body if the status is 200, else the error.
    pub(super) fn finish_unary(mut self) -> Result<Vec<u8>, EtcdError> {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        self.until = Some(deadline);
        let mut out = Vec::new();
        self.decode_buffered(&mut out)?;
        while !self.done() {
            if Instant::now() > deadline {
                return Err(self.conn.io_error(std::io::Error::new(std::io::ErrorKind::TimedOut, "response body")));
            }
            self.pump(&mut out)?;
        }
        if self.status != 200 {
            let message = status_message(&out);
            return Err(EtcdError::Status { endpoint: self.conn.endpoint, status: self.status, message });
        }
        Ok(out)
    }
}
