//! The fixed header of every control message, and the framing of a payload behind it.

use super::codec::{Reader, Writer};
use super::{DecodeError, MAGIC, MAX_MESSAGE, VERSION};

/// Fixed message header.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u16,
    /// Operation code of the payload.
    pub op: u16,
    /// Request sequence number, echoed in the reply.
    pub seq: u32,
    /// Payload bytes following the header.
    pub len: u32,
}

/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = std::mem::size_of::<Header>();

impl Header {
    /// Parses and validates the header of a received datagram of `buf.len()` bytes.
    pub fn parse(buf: &[u8]) -> Result<Header, DecodeError> {
        if buf.len() < HEADER_LEN {
            return Err(DecodeError::ShortHeader { len: buf.len(), need: HEADER_LEN });
        }
        if buf.len() > MAX_MESSAGE {
            return Err(DecodeError::TooLong { len: buf.len(), max: MAX_MESSAGE });
        }
        let mut r = Reader::new(&buf[..HEADER_LEN]);
        let h = Header { magic: r.u32()?, version: r.u16()?, op: r.u16()?, seq: r.u32()?, len: r.u32()? };
        h.is_valid(buf.len() - HEADER_LEN)?;
        Ok(h)
    }

    /// Checks magic, version and that the declared length matches what arrived.
    pub fn is_valid(&self, payload_len: usize) -> Result<(), DecodeError> {
        if self.magic != MAGIC {
            return Err(DecodeError::BadMagic { magic: self.magic });
        }
        if self.version != VERSION {
            return Err(DecodeError::BadVersion { version: self.version });
        }
        if self.len as usize != payload_len {
            return Err(DecodeError::LengthMismatch { declared: self.len as usize, actual: payload_len });
        }
        Ok(())
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.magic.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.op.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
}

/// The datagram of operation `op` with sequence number `seq` and the payload written in `w`.
pub(super) fn frame(op: u16, seq: u32, w: Writer) -> Vec<u8> {
    let payload = w.as_bytes();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    Header { magic: MAGIC, version: VERSION, op, seq, len: payload.len() as u32 }.write(&mut out);
    out.extend_from_slice(payload);
    out
}

/// Validates a received datagram's header and decodes its payload with `payload` (given the
/// header's operation), which must consume every byte; returns the header's sequence number
/// with what `payload` decoded.
pub(super) fn unframe<T>(
    buf: &[u8],
    payload: impl FnOnce(u16, &mut Reader<'_>) -> Result<T, DecodeError>,
) -> Result<(u32, T), DecodeError> {
    let h = Header::parse(buf)?;
    let mut r = Reader::new(&buf[HEADER_LEN..]);
    let decoded = payload(h.op, &mut r)?;
    r.finish()?;
    Ok((h.seq, decoded))
}
