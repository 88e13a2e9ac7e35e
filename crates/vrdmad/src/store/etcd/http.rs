//! HTTP/1.1 response decoding: pure, incremental and bounded. etcd's replies come off the
//! network, so every length is checked before it is trusted: the head, each chunk-size line,
//! each chunk and the whole body have limits, and arithmetic on sizes cannot overflow.

use super::error::truncate;

/// Largest response head (status line and headers).
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest response body (a range over every key of a big cluster fits easily).
pub const MAX_BODY: usize = 64 << 20;
/// Longest chunk-size or trailer line.
pub(super) const MAX_CHUNK_LINE: usize = 1024;

/// A response that is not well-formed HTTP/1.1 or exceeds one of the bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// The input ends before the blank line closing the head, or the head is longer than
    /// [`MAX_HEAD`] without one.
    #[error("incomplete or oversized head")]
    HeadIncomplete,
    /// A head longer than [`MAX_HEAD`].
    #[error("response head too large")]
    HeadTooLarge,
    /// The head is not UTF-8.
    #[error("head is not UTF-8")]
    HeadNotUtf8,
    /// Not `HTTP/1.x NNN …` with a status in 100..600.
    #[error("status line {0:?}")]
    StatusLine(String),
    /// A header line without a colon.
    #[error("header line {0:?}")]
    HeaderLine(String),
    /// A transfer encoding other than `chunked`.
    #[error("transfer encoding {0:?}")]
    TransferEncoding(String),
    /// A `Content-Length` that is not a number.
    #[error("content-length {0:?}")]
    ContentLength(String),
    /// Two `Content-Length` headers that disagree.
    #[error("conflicting content-length headers")]
    ConflictingLength,
    /// A `Content-Length` over [`MAX_BODY`].
    #[error("body of {length} bytes exceeds {MAX_BODY}")]
    DeclaredBodyTooLarge {
        /// What the header said.
        length: usize,
    },
    /// More payload arrived than the decoder's limit allows.
    #[error("body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The payload size no longer fits a `usize`.
    #[error("body size overflow")]
    SizeOverflow,
    /// The connection closed before the body was complete.
    #[error("connection closed in the middle of the body")]
    Truncated,
    /// A chunk-size or trailer line longer than its bound.
    #[error("chunk line too long")]
    ChunkLineTooLong,
    /// A chunk-size or trailer line ended by a bare LF.
    #[error("chunk line not ended by CRLF")]
    ChunkLineEnd,
    /// A chunk size that is not UTF-8.
    #[error("chunk size is not ASCII")]
    ChunkSizeNotAscii,
    /// A chunk size that is empty, too long or not hexadecimal.
    #[error("chunk size {0:?}")]
    ChunkSize(String),
    /// A chunk larger than the decoder's limit.
    #[error("chunk of {size} bytes exceeds {limit}")]
    ChunkTooLarge {
        /// The chunk's declared size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A chunk's data not followed by CRLF.
    #[error("chunk data not followed by CRLF")]
    ChunkDataEnd,
    /// Buffered bytes the decoder cannot make progress on.
    #[error("undecodable body")]
    Undecodable,
    /// One newline-delimited message of a stream exceeds its bound.
    #[error("watch message too large")]
    MessageTooLarge,
    /// A stream that should stay open ended.
    #[error("watch stream ended")]
    StreamEnded,
}

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
pub(super) fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Parses a complete head (`buf` ends with the blank line).
pub fn parse_head(buf: &[u8]) -> Result<Head, HttpError> {
    if buf.len() > MAX_HEAD {
        return Err(HttpError::HeadTooLarge);
    }
    let text = std::str::from_utf8(buf).map_err(|_| HttpError::HeadNotUtf8)?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::StatusLine(truncate(status_line)));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| HttpError::StatusLine(truncate(status_line)))?;
    let mut framing = Framing::UntilClose;
    let mut length_seen = false;
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or_else(|| HttpError::HeaderLine(truncate(line)))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if value.eq_ignore_ascii_case("chunked") {
                framing = Framing::Chunked;
            } else {
                return Err(HttpError::TransferEncoding(truncate(value)));
            }
        } else if name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let n: usize = value.parse().map_err(|_| HttpError::ContentLength(truncate(value)))?;
            if n > MAX_BODY {
                return Err(HttpError::DeclaredBodyTooLarge { length: n });
            }
            if length_seen && framing != Framing::Length(n) {
                return Err(HttpError::ConflictingLength);
            }
            length_seen = true;
            framing = Framing::Length(n);
        }
    }
    Ok(Head { status, framing })
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

    /// Changes the payload limit (a long-lived stream bounds its messages, not its total).
    pub(super) fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Whether the decoder is inside a chunk's data, where it consumes whatever it is fed
    /// (elsewhere it may wait for the rest of a line).
    pub(super) fn in_chunk_data(&self) -> bool {
        matches!(self.chunk, ChunkState::Data(_))
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
    pub fn finish(&self) -> Result<(), HttpError> {
        match self.framing {
            Framing::UntilClose => Ok(()),
            _ if self.is_done() => Ok(()),
            _ => Err(HttpError::Truncated),
        }
    }

    fn take(&mut self, n: usize) -> Result<(), HttpError> {
        self.produced = self.produced.checked_add(n).ok_or(HttpError::SizeOverflow)?;
        if self.produced > self.limit {
            return Err(HttpError::BodyTooLarge { limit: self.limit });
        }
        Ok(())
    }

    /// Consumes a prefix of `input`, appending payload to `out`; returns how many bytes of
    /// `input` it consumed. Unconsumed bytes (an incomplete line) must be fed again with
    /// more data after them.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
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
                        return Err(HttpError::ChunkDataEnd);
                    }
                    at += 2;
                    self.chunk = ChunkState::Size;
                }
                ChunkState::Size | ChunkState::Trailer => {
                    let Some(nl) = rest.iter().take(MAX_CHUNK_LINE + 1).position(|&b| b == b'\n') else {
                        if rest.len() > MAX_CHUNK_LINE {
                            return Err(HttpError::ChunkLineTooLong);
                        }
                        return Ok(at);
                    };
                    let line = &rest[..nl];
                    let line = line.strip_suffix(b"\r").ok_or(HttpError::ChunkLineEnd)?;
                    at += nl + 1;
                    if self.chunk == ChunkState::Trailer {
                        if line.is_empty() {
                            self.chunk = ChunkState::Done;
                        }
                        continue;
                    }
                    let size = line.split(|&b| b == b';').next().unwrap_or_default();
                    let size = std::str::from_utf8(size).map_err(|_| HttpError::ChunkSizeNotAscii)?.trim();
                    if size.is_empty() || size.len() > 16 {
                        return Err(HttpError::ChunkSize(truncate(size)));
                    }
                    let n = usize::from_str_radix(size, 16).map_err(|_| HttpError::ChunkSize(truncate(size)))?;
                    if n > self.limit {
                        return Err(HttpError::ChunkTooLarge { size: n, limit: self.limit });
                    }
                    self.chunk = if n == 0 { ChunkState::Trailer } else { ChunkState::Data(n) };
                }
            }
        }
    }
}

/// Decodes one complete HTTP/1.1 response: status and payload.
pub fn decode_response(data: &[u8]) -> Result<(u16, Vec<u8>), HttpError> {
    let end = head_end(&data[..data.len().min(MAX_HEAD)]).ok_or(HttpError::HeadIncomplete)?;
    let head = parse_head(&data[..end])?;
    let mut dec = BodyDecoder::new(head.framing, MAX_BODY);
    let mut out = Vec::new();
    dec.feed(&data[end..], &mut out)?;
    if !dec.is_done() {
        dec.finish()?;
    }
    Ok((head.status, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";

    fn chunked(body: &[u8]) -> Vec<u8> {
        [CHUNKED, body].concat()
    }

    #[test]
    fn heads_and_bodies() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(decode_response(r).unwrap(), (200, b"hello".to_vec()));
        let r = chunked(b"5;x=y\r\nhello\r\n1\r\n!\r\n0\r\nT: v\r\n\r\n");
        assert_eq!(decode_response(&r).unwrap(), (200, b"hello!".to_vec()));
        let r = b"HTTP/1.1 404 Not Found\r\n\r\nnope";
        assert_eq!(decode_response(r).unwrap(), (404, b"nope".to_vec()));
        // Repeated, agreeing lengths; bytes after a Content-Length body are not payload.
        let r = b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\nContent-Length:  2 \r\n\r\nokEXTRA";
        assert_eq!(decode_response(r).unwrap(), (200, b"ok".to_vec()));
        // Chunked wins over a length, whatever the order.
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n2\r\nok\r\n0\r\n\r\n";
        assert_eq!(decode_response(r).unwrap(), (200, b"ok".to_vec()));
    }

    #[test]
    fn truncated_responses_are_refused() {
        let length = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec();
        let chunks = chunked(b"5\r\nhello\r\n0\r\n\r\n");
        for full in [&length, &chunks] {
            let body_at = head_end(full).unwrap();
            for cut in 0..full.len() {
                let err = decode_response(&full[..cut]).unwrap_err();
                let want = if cut < body_at { HttpError::HeadIncomplete } else { HttpError::Truncated };
                assert_eq!(err, want, "{:?}", String::from_utf8_lossy(&full[..cut]));
            }
            assert!(decode_response(full).is_ok());
        }
        assert_eq!(decode_response(b""), Err(HttpError::HeadIncomplete));
        let mut d = BodyDecoder::new(Framing::Length(3), MAX_BODY);
        assert_eq!(d.feed(b"ab", &mut Vec::new()), Ok(2));
        assert_eq!(d.finish(), Err(HttpError::Truncated));
        assert_eq!(BodyDecoder::new(Framing::UntilClose, 0).finish(), Ok(()));
    }

    #[test]
    fn oversized_responses_are_refused() {
        // A head without its end inside MAX_HEAD, and one handed over whole.
        let mut big = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        big.resize(MAX_HEAD + 10, b'a');
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(decode_response(&big), Err(HttpError::HeadIncomplete));
        assert_eq!(parse_head(&big), Err(HttpError::HeadTooLarge));
        let r = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", MAX_BODY + 1);
        assert_eq!(decode_response(r.as_bytes()), Err(HttpError::DeclaredBodyTooLarge { length: MAX_BODY + 1 }));
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n";
        assert!(matches!(decode_response(r), Err(HttpError::ContentLength(_))));
        // The largest chunk size that parses, and one digit more.
        let r = chunked(b"ffffffffffffffff\r\n");
        assert_eq!(decode_response(&r), Err(HttpError::ChunkTooLarge { size: usize::MAX, limit: MAX_BODY }));
        assert!(matches!(decode_response(&chunked(b"fffffffffffffffff\r\n")), Err(HttpError::ChunkSize(_))));
        // Chunks each within the limit, together over it.
        let mut d = BodyDecoder::new(Framing::Chunked, 6);
        assert_eq!(d.feed(b"4\r\nabcd\r\n4\r\nefgh\r\n", &mut Vec::new()), Err(HttpError::BodyTooLarge { limit: 6 }));
        let mut d = BodyDecoder::new(Framing::UntilClose, 4);
        assert_eq!(d.feed(b"hello", &mut Vec::new()), Err(HttpError::BodyTooLarge { limit: 4 }));
        // A chunk-size line (or trailer) that never ends: refused once past the bound, not
        // buffered forever.
        let mut d = BodyDecoder::new(Framing::Chunked, MAX_BODY);
        let long = vec![b'0'; MAX_CHUNK_LINE];
        assert_eq!(d.feed(&long, &mut Vec::new()), Ok(0));
        assert_eq!(d.feed(&[long.as_slice(), b"0"].concat(), &mut Vec::new()), Err(HttpError::ChunkLineTooLong));
        let trailer = [b"0\r\n".as_slice(), &vec![b't'; MAX_CHUNK_LINE + 1]].concat();
        assert_eq!(BodyDecoder::new(Framing::Chunked, 9).feed(&trailer, &mut Vec::new()), Err(HttpError::ChunkLineTooLong));
    }

    #[test]
    fn malformed_responses_are_refused() {
        // The kind of error each gets (what it quotes aside).
        let status = || HttpError::StatusLine(String::new());
        let cases: [(&[u8], HttpError); 14] = [
            (b"SMTP 200 OK\r\n\r\n", status()),
            (b"HTTP/1.1 2000 OK\r\n\r\n", status()),
            (b"HTTP/1.1 099 Low\r\n\r\n", status()),
            (b"HTTP/1.1\r\n\r\n", status()),
            (b"\r\n\r\n", status()),
            (b"HTTP/1.1 200 OK\r\n", HttpError::HeadIncomplete),
            (b"HTTP/1.1 200 \xff\r\n\r\n", HttpError::HeadNotUtf8),
            (b"HTTP/1.1 200 OK\r\nNo colon\r\n\r\n", HttpError::HeaderLine(String::new())),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", HttpError::TransferEncoding(String::new())),
            (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", HttpError::ContentLength(String::new())),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", HttpError::ConflictingLength),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", HttpError::ChunkSize(String::new())),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX", HttpError::ChunkDataEnd),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n", HttpError::ChunkLineEnd),
        ];
        for (bad, want) in cases {
            let e = decode_response(bad).unwrap_err();
            assert_eq!(std::mem::discriminant(&e), std::mem::discriminant(&want), "{:?}: {e:?}", String::from_utf8_lossy(bad));
        }
        for body in [&b"\r\n"[..], b";ext\r\n", b"\xff\r\n"] {
            let e = decode_response(&chunked(body)).unwrap_err();
            assert!(matches!(e, HttpError::ChunkSize(_) | HttpError::ChunkSizeNotAscii), "{body:?}: {e:?}");
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
}
