//! The bounds-checked payload codec: little-endian integers, GIDs, flags, length-prefixed
//! strings and bytes, bounded counts, and the MR chunk lists several messages carry.

use super::{DecodeError, MrChunk, MAX_COPY_DATA, MAX_MR_CHUNKS, MAX_STRING};

/// Bounds-checked little-endian reader.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Reads `buf` from its start.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.buf.len() - self.pos;
        if n > have {
            return Err(DecodeError::Truncated { offset: self.pos, need: n, have });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// One byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    /// A little-endian u16.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    /// A little-endian u32.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    /// A little-endian i32.
    pub fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(self.u32()? as i32)
    }
    /// A little-endian u64.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// A 16-byte GID.
    pub fn gid(&mut self) -> Result<[u8; 16], DecodeError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Ok(a)
    }
    /// A length-prefixed UTF-8 string of at most [`MAX_STRING`] bytes.
    pub fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(DecodeError::TooMany { what: "string byte", count: n, max: MAX_STRING });
        }
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::BadString)
    }
    /// A count prefix bounded by `max`.
    pub fn count(&mut self, what: &'static str, max: usize) -> Result<usize, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(DecodeError::TooMany { what, count: n, max });
        }
        Ok(n)
    }
    /// A boolean byte (0 or 1).
    pub fn flag(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue { field, value: u64::from(v) }),
        }
    }
    /// A length-prefixed byte string of at most [`MAX_COPY_DATA`] bytes.
    pub fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        if n > MAX_COPY_DATA {
            return Err(DecodeError::BadValue { field: "data length", value: n as u64 });
        }
        Ok(self.take(n)?.to_vec())
    }
    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            extra => Err(DecodeError::Trailing { extra }),
        }
    }
}

/// Little-endian writer.
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub(super) fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn i32(&mut self, v: i32) -> &mut Self {
        self.u32(v as u32)
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn gid(&mut self, g: &[u8; 16]) -> &mut Self {
        self.buf.extend_from_slice(g);
        self
    }
    pub(super) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
        self
    }
    pub(super) fn string(&mut self, s: &str) -> &mut Self {
        let b = &s.as_bytes()[..s.len().min(MAX_STRING)];
        self.u16(b.len() as u16);
        self.buf.extend_from_slice(b);
        self
    }
    pub(super) fn count(&mut self, n: usize) -> &mut Self {
        self.u16(n as u16)
    }
    /// The payload written so far.
    pub(super) fn as_bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// Writes the chunk list of an MR (a count, then each chunk).
pub(super) fn write_chunks(w: &mut Writer, chunks: &[MrChunk]) {
    w.count(chunks.len());
    for c in chunks {
        w.u64(c.mr_offset).u64(c.len).u64(c.fd_offset);
    }
}

/// Reads what [`write_chunks`] wrote, at most [`MAX_MR_CHUNKS`] chunks.
pub(super) fn read_chunks(r: &mut Reader<'_>) -> Result<Vec<MrChunk>, DecodeError> {
    let n = r.count("MR chunk", MAX_MR_CHUNKS)?;
    (0..n).map(|_| Ok(MrChunk { mr_offset: r.u64()?, len: r.u64()?, fd_offset: r.u64()? })).collect()
}
