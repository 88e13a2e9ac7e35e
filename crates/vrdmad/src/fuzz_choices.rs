//! A fuzzer's input read as a sequence of choices, for the stateful fuzz targets (the
//! registry's request sequences, the responder's frame sequences): each read takes bytes off
//! the front, and none left ends the sequence.

/// The input not read yet.
pub(crate) struct Choices<'a>(pub(crate) &'a [u8]);

impl Choices<'_> {
    pub(crate) fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    pub(crate) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes([self.byte()?, self.byte()?, self.byte()?, self.byte()?]))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from(self.u32()?) | u64::from(self.u32()?) << 32)
    }
    /// A small number, most often; sometimes any.
    pub(crate) fn small(&mut self) -> Option<u32> {
        let b = self.byte()?;
        Some(if b < 240 { u32::from(b) } else { self.u32()? })
    }
    /// Whether nothing is left.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
