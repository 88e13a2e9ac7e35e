//! [`StagingRing`]: where a peer's SEND waits for the responder on the direct path.
//!
//! A NIC never lets a peer touch memory without remote access rights, and a receive buffer
//! usually has none (LOCAL_WRITE only). So the sender's library does not write the posted
//! receive buffer itself: it copies the payload into this ring, part of the responder QP's
//! region, and the responder's own library scatters it into its receive buffer when it polls
//! (before reporting the completion). A single-producer single-consumer byte ring of
//! records, each a header, the receive's scatter list and a contiguous payload; a record
//! that would wrap is preceded by a padding record to the end of the ring. A SEND larger
//! than a record can hold is sent as several records (`msg_offset` tells where each goes);
//! the last one has [`STAGED_LAST`].
//!
//! Everything read from the ring is untrusted: the consumer checks every length against the
//! bytes the producer published, so a hostile peer corrupts only its own messages.

use std::sync::atomic::Ordering;

use super::{read_sges, round_up, write_sges, Sge, LINE, PAGE, SGE_SIZE};
use crate::shm::{MemRegion, ShmError};

/// Payload bytes of a QP's staging ring (its control page comes on top).
pub const STAGING_BYTES: usize = 256 << 10;
/// Size of the staging area in a QP region: a control page, then the ring.
pub const STAGING_REGION: usize = PAGE + STAGING_BYTES;

/// Control word: bytes ever published by the producer.
const HEAD: usize = 0;
/// Control word: bytes ever released by the consumer.
const TAIL: usize = LINE;
/// Bytes of a record header.
const HEADER: usize = LINE;
/// Header word offsets.
const H_KIND_FLAGS: usize = 0;
const H_MSG_OFFSET: usize = 8;
const H_LEN_NSGE: usize = 16;

const KIND_DATA: u64 = 1;
const KIND_PAD: u64 = 2;
/// Record flag: the last record of its message.
pub const STAGED_LAST: u32 = 1;
/// The most scatter elements a record carries.
pub const STAGED_MAX_SGE: usize = 64;
/// The smallest part of a message worth a record of its own while the ring is nearly full
/// (smaller parts wait for room instead, so a large SEND is not cut into slivers).
const MIN_PART: usize = 16 << 10;

/// A record as the consumer reads it.
#[derive(Debug)]
pub struct StagedRecord {
    /// [`STAGED_LAST`] or 0.
    pub flags: u32,
    /// Where in the message the payload goes.
    pub msg_offset: u64,
    /// The payload, in the ring (valid until [`StagingRing::release`]).
    pub payload: MemRegion,
    /// Ring bytes the record takes (with the padding before it).
    size: u64,
}

/// Where the next record goes (see [`StagingRing::plan`]).
struct Plan {
    head: u64,
    pos: usize,
    pad: bool,
    len: usize,
    size: usize,
}

/// A QP's staging ring. See the module documentation.
#[derive(Clone, Copy, Debug)]
pub struct StagingRing {
    ctl: MemRegion,
    data: MemRegion,
}

fn record_size(nsge: usize, len: usize) -> usize {
    round_up(HEADER + nsge * SGE_SIZE + len, LINE)
}

impl StagingRing {
    /// Views `mem` (at least [`STAGING_REGION`] bytes) as a staging ring.
    pub fn new(mem: MemRegion) -> Result<Self, ShmError> {
        Ok(StagingRing { ctl: mem.subregion(0, PAGE)?, data: mem.subregion(PAGE, STAGING_BYTES)? })
    }

    fn head(&self) -> Result<u64, ShmError> {
        Ok(self.ctl.atomic_u64(HEAD)?.load(Ordering::Acquire))
    }

    fn tail(&self) -> Result<u64, ShmError> {
        Ok(self.ctl.atomic_u64(TAIL)?.load(Ordering::Acquire))
    }

    /// Whether nothing is waiting for the consumer.
    pub fn is_empty(&self) -> bool {
        matches!((self.head(), self.tail()), (Ok(h), Ok(t)) if h == t)
    }

    /// The largest payload one record may carry with `nsge` scatter elements: half the ring,
    /// so that a record always fits once the ring is empty, wherever its position is.
    pub fn max_part(nsge: usize) -> usize {
        (STAGING_BYTES / 2 - HEADER - nsge * SGE_SIZE) & !(LINE - 1)
    }

    /// Where a record of up to `want` payload bytes with `nsge` scatter elements would go:
    /// `None` if the ring has too little room now.
    fn plan(&self, nsge: usize, want: usize) -> Result<Option<Plan>, ShmError> {
        let (head, tail) = (self.head()?, self.tail()?);
        let used = head.wrapping_sub(tail);
        if used > STAGING_BYTES as u64 || head % LINE as u64 != 0 {
            return Err(ShmError::OutOfBounds { offset: used as usize, len: 0, size: STAGING_BYTES });
        }
        let free = STAGING_BYTES - used as usize;
        let pos = (head % STAGING_BYTES as u64) as usize;
        let to_end = STAGING_BYTES - pos;
        let overhead = HEADER + nsge * SGE_SIZE;
        // Payload room in `space` contiguous bytes (all sizes are multiples of LINE).
        let room = |space: usize| (space >= overhead).then(|| (space - overhead) & !(LINE - 1));
        let want = want.min(Self::max_part(nsge));
        // Here, or after padding to the end of the ring, whichever holds more.
        let here = room(free.min(to_end));
        let after_pad = if free > to_end { room(free - to_end) } else { None };
        let (pad, space) = match (here, after_pad) {
            (Some(h), Some(a)) if h < want && a > h => (true, a),
            (Some(h), _) => (false, h),
            (None, Some(a)) => (true, a),
            (None, None) => return Ok(None),
        };
        let len = want.min(space);
        if len < want && len < MIN_PART {
            return Ok(None);
        }
        let size = record_size(nsge, len) + if pad { to_end } else { 0 };
        Ok((size <= free).then_some(Plan { head, pos, pad, len, size }))
    }

    /// Whether a [`StagingRing::push`] of `want` bytes with up to `nsge` scatter elements
    /// would publish a record now (it still would at the producer's next push).
    pub fn can_push(&self, nsge: usize, want: usize) -> bool {
        matches!(self.plan(nsge, want), Ok(Some(_)))
    }

    /// Whether a record of `len` payload bytes with `nsge` scatter elements fits whole now
    /// (it still does at the next [`StagingRing::push`] of the same producer).
    pub fn has_room(&self, nsge: usize, len: usize) -> bool {
        len <= Self::max_part(nsge) && matches!(self.plan(nsge, len), Ok(Some(p)) if p.len == len)
    }

    /// Producer: publishes a record of up to `want` payload bytes for `sges` at `msg_offset`,
    /// filling its payload with `fill(payload, len)`. Returns the payload length published
    /// (`want` if it fit, else a part of it worth sending), or `None` if the ring has too
    /// little room now. The record is marked [`STAGED_LAST`] if `last_if_whole` and it
    /// holds all of `want`.
    pub fn push<F>(&self, msg_offset: u64, want: usize, last_if_whole: bool, sges: &[Sge], fill: F) -> Result<Option<usize>, ShmError>
    where
        F: FnOnce(&MemRegion, usize) -> Result<(), ShmError>,
    {
        let nsge = sges.len().min(STAGED_MAX_SGE);
        let Some(Plan { head, pos, pad, len, size }) = self.plan(nsge, want)? else { return Ok(None) };
        let mut at = pos;
        if pad {
            self.data.store_u64(at + H_KIND_FLAGS, KIND_PAD)?;
            at = 0;
        }
        let flags = if last_if_whole && len == want { STAGED_LAST } else { 0 };
        self.data.store_u64(at + H_KIND_FLAGS, KIND_DATA | (u64::from(flags) << 32))?;
        self.data.store_u64(at + H_MSG_OFFSET, msg_offset)?;
        self.data.store_u64(at + H_LEN_NSGE, len as u64 | ((nsge as u64) << 32))?;
        write_sges(&self.data, at + HEADER, &sges[..nsge])?;
        fill(&self.data.subregion(at + HEADER + nsge * SGE_SIZE, len)?, len)?;
        self.ctl.atomic_u64(HEAD)?.store(head.wrapping_add(size as u64), Ordering::Release);
        Ok(Some(len))
    }

    /// Consumer: the next record (its scatter list into `sges`), or `None` if there is none.
    /// An error means the producer wrote garbage.
    pub fn peek(&self, sges: &mut Vec<Sge>) -> Result<Option<StagedRecord>, ShmError> {
        let (head, tail) = (self.head()?, self.tail()?);
        let avail = head.wrapping_sub(tail);
        if avail == 0 {
            return Ok(None);
        }
        let bad = |offset: usize| ShmError::OutOfBounds { offset, len: avail as usize, size: STAGING_BYTES };
        if avail > STAGING_BYTES as u64 || avail % LINE as u64 != 0 || tail % LINE as u64 != 0 {
            return Err(bad(0));
        }
        let mut pos = (tail % STAGING_BYTES as u64) as usize;
        let mut skipped = 0usize;
        let mut kind_flags = self.data.load_u64(pos + H_KIND_FLAGS)?;
        if kind_flags & 0xffff_ffff == KIND_PAD {
            skipped = STAGING_BYTES - pos;
            pos = 0;
            if skipped as u64 + HEADER as u64 > avail {
                return Err(bad(pos));
            }
            kind_flags = self.data.load_u64(H_KIND_FLAGS)?;
        }
        if kind_flags & 0xffff_ffff != KIND_DATA {
            return Err(bad(pos));
        }
        let len_nsge = self.data.load_u64(pos + H_LEN_NSGE)?;
        let (len, nsge) = ((len_nsge as u32) as usize, (len_nsge >> 32) as usize);
        if nsge > STAGED_MAX_SGE || len > STAGING_BYTES {
            return Err(bad(pos));
        }
        let size = record_size(nsge, len);
        if pos + size > STAGING_BYTES || (skipped + size) as u64 > avail {
            return Err(bad(pos));
        }
        read_sges(&self.data, pos + HEADER, nsge, sges)?;
        Ok(Some(StagedRecord {
            flags: (kind_flags >> 32) as u32,
            msg_offset: self.data.load_u64(pos + H_MSG_OFFSET)?,
            payload: self.data.subregion(pos + HEADER + nsge * SGE_SIZE, len)?,
            size: (skipped + size) as u64,
        }))
    }

    /// Consumer: frees `rec`'s bytes for the producer.
    pub fn release(&self, rec: &StagedRecord) -> Result<(), ShmError> {
        let t = self.ctl.atomic_u64(TAIL)?;
        t.store(t.load(Ordering::Relaxed).wrapping_add(rec.size), Ordering::Release);
        Ok(())
    }

    /// Consumer: drops everything published (a QP reset for a new connection).
    pub fn clear(&self) -> Result<(), ShmError> {
        let h = self.head()?;
        self.ctl.atomic_u64(TAIL)?.store(h, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::mapping;

    fn ring() -> (crate::shm::SharedMapping, StagingRing) {
        let m = mapping(STAGING_REGION);
        let r = StagingRing::new(*m.region()).unwrap();
        (m, r)
    }

    fn fill_with(byte: u8) -> impl FnOnce(&MemRegion, usize) -> Result<(), ShmError> {
        move |m, len| m.write_from(0, &vec![byte; len])
    }

    #[test]
    fn records_arrive_in_order_with_their_scatter_lists() {
        let (_m, r) = ring();
        let sges = [Sge { addr: 0x1000, length: 100, lkey: 7 }, Sge { addr: 0x9000, length: 5, lkey: 8 }];
        assert_eq!(r.push(0, 3, true, &sges, fill_with(0xab)).unwrap(), Some(3));
        assert_eq!(r.push(0, 0, true, &sges[..1], fill_with(0)).unwrap(), Some(0));
        let mut got = Vec::new();
        let a = r.peek(&mut got).unwrap().unwrap();
        assert_eq!((a.flags, a.msg_offset, a.payload.len(), &got[..]), (STAGED_LAST, 0, 3, &sges[..]));
        let mut b = [0u8; 3];
        a.payload.read_into(0, &mut b).unwrap();
        assert_eq!(b, [0xab; 3]);
        r.release(&a).unwrap();
        let z = r.peek(&mut got).unwrap().unwrap();
        assert_eq!((z.flags, z.payload.len(), got.len()), (STAGED_LAST, 0, 1));
        r.release(&z).unwrap();
        assert!(r.is_empty());
        assert!(r.peek(&mut got).unwrap().is_none());
    }

    #[test]
    fn a_large_message_is_cut_into_parts_that_wrap_and_wait_for_room() {
        let (_m, r) = ring();
        let total = 3 * STAGING_BYTES + 12345;
        let sges = [Sge { addr: 0, length: total as u32, lkey: 1 }];
        let (mut sent, mut received, mut got) = (0usize, 0usize, Vec::new());
        let mut rounds = 0;
        while received < total {
            rounds += 1;
            assert!(rounds < 1000);
            while sent < total {
                let part = r.push(sent as u64, total - sent, true, &sges, |m, len| {
                    let bytes: Vec<u8> = (sent..sent + len).map(|i| i as u8).collect();
                    m.write_from(0, &bytes)
                });
                match part.unwrap() {
                    Some(n) => sent += n,
                    None => break,
                }
            }
            // The consumer takes one record per round: the producer meets a full ring.
            if let Some(rec) = r.peek(&mut got).unwrap() {
                assert_eq!(rec.msg_offset as usize, received);
                let mut b = vec![0u8; rec.payload.len()];
                rec.payload.read_into(0, &mut b).unwrap();
                assert!(b.iter().enumerate().all(|(i, &x)| x == (received + i) as u8));
                received += b.len();
                assert_eq!(rec.flags == STAGED_LAST, received == total);
                r.release(&rec).unwrap();
            }
        }
        assert!(r.is_empty());
    }

    #[test]
    fn garbage_from_the_producer_is_an_error_not_a_panic() {
        let (m, r) = ring();
        let region = m.region();
        for (head, word) in [(64u64, 0u64), (64, KIND_DATA | 1 << 40), (STAGING_BYTES as u64 + 64, KIND_DATA), (64, KIND_PAD), (65, 1)] {
            region.store_u64(TAIL, 0).unwrap();
            region.store_u64(HEAD, head).unwrap();
            region.store_u64(PAGE, word).unwrap();
            region.store_u64(PAGE + H_LEN_NSGE, u64::from(u32::MAX)).unwrap();
            assert!(r.peek(&mut Vec::new()).is_err(), "head {head} word {word:#x}");
        }
        region.store_u64(TAIL, 5).unwrap();
        assert!(r.push(0, 1, true, &[], fill_with(1)).is_err());
    }
}
