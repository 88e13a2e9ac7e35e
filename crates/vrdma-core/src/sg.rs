//! Scatter/gather copies and RDMA atomics over memory views.

use vrdma_abi::shm::{MemRegion, ShmError};
use vrdma_abi::verbs::WcStatus;

/// A byte range of a memory view.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// The view.
    pub mem: MemRegion,
    /// Offset within it.
    pub offset: usize,
    /// Length.
    pub len: usize,
}

/// Total length of a list of spans.
pub fn total(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.len).sum()
}

/// Copies the bytes of `src` (gather) into `dst` (scatter) in order, stopping at the end of
/// `src`. The caller has checked `total(dst) >= total(src)` (else LOC_LEN_ERR).
#[inline]
pub fn copy(dst: &[Span], src: &[Span]) -> Result<usize, ShmError> {
    // The common case (one element each side) without the general walk.
    if let ([d], [s]) = (dst, src) {
        if d.len >= s.len {
            d.mem.copy_from_region(d.offset, &s.mem, s.offset, s.len)?;
            return Ok(s.len);
        }
    }
    let (mut di, mut doff) = (0usize, 0usize);
    let mut moved = 0;
    for s in src {
        let mut soff = 0;
        while soff < s.len {
            let Some(d) = dst.get(di) else {
                return Err(ShmError::OutOfBounds { offset: moved, len: s.len - soff, size: moved });
            };
            let n = (d.len - doff).min(s.len - soff);
            d.mem.copy_from_region(d.offset + doff, &s.mem, s.offset + soff, n)?;
            soff += n;
            doff += n;
            moved += n;
            if doff == d.len {
                di += 1;
                doff = 0;
            }
        }
    }
    Ok(moved)
}

/// Copies bytes from a plain slice (inline data) into `dst`.
pub fn copy_from_bytes(dst: &[Span], mut src: &[u8]) -> Result<usize, ShmError> {
    let mut moved = 0;
    for d in dst {
        if src.is_empty() {
            break;
        }
        let n = d.len.min(src.len());
        d.mem.write_from(d.offset, &src[..n])?;
        src = &src[n..];
        moved += n;
    }
    if !src.is_empty() {
        return Err(ShmError::OutOfBounds { offset: moved, len: src.len(), size: moved });
    }
    Ok(moved)
}

/// An RDMA atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomic {
    /// Compare `compare`, swap in `swap`.
    CmpSwap {
        /// The value the target must hold.
        compare: u64,
        /// The value stored if it does.
        swap: u64,
    },
    /// Add `add`.
    FetchAdd {
        /// The value added (wrapping).
        add: u64,
    },
}

/// Executes an atomic on the 8 bytes at `offset` of `mem`; returns the original value.
/// The target must be 8-byte aligned (else REM_INV_REQ_ERR, as hardware answers).
pub fn atomic(mem: &MemRegion, offset: usize, op: Atomic) -> Result<u64, WcStatus> {
    use std::sync::atomic::Ordering::SeqCst;
    if !(mem.addr() + offset).is_multiple_of(8) {
        return Err(WcStatus::RemInvReqErr);
    }
    let word = mem.atomic_u64(offset).map_err(|_| WcStatus::RemAccessErr)?;
    // RDMA atomics are big-endian on the wire but operate on host-order memory in the
    // responder; the requester sees the original value in host order, as with rxe.
    Ok(match op {
        Atomic::CmpSwap { compare, swap } => match word.compare_exchange(compare, swap, SeqCst, SeqCst) {
            Ok(v) | Err(v) => v,
        },
        Atomic::FetchAdd { add } => word.fetch_add(add, SeqCst),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(buf: &mut [u8]) -> MemRegion {
        // SAFETY: the buffer outlives every use in these tests.
        unsafe { MemRegion::from_raw(buf.as_mut_ptr(), buf.len()) }
    }

    #[test]
    fn scatter_gather_crosses_boundaries() {
        let mut a = *b"abcdefgh";
        let mut b = [0u8; 3];
        let mut c = [0u8; 6];
        let src = region(&mut a);
        let (rb, rc) = (region(&mut b), region(&mut c));
        let n = copy(
            &[Span { mem: rb, offset: 0, len: 3 }, Span { mem: rc, offset: 1, len: 5 }],
            &[Span { mem: src, offset: 0, len: 2 }, Span { mem: src, offset: 2, len: 6 }],
        )
        .unwrap();
        assert_eq!(n, 8);
        assert_eq!(&b, b"abc");
        assert_eq!(&c, b"\0defgh");
    }

    #[test]
    fn too_small_destination_is_an_error() {
        let mut a = [1u8; 8];
        let mut b = [0u8; 4];
        let (ra, rb) = (region(&mut a), region(&mut b));
        assert!(copy(&[Span { mem: rb, offset: 0, len: 4 }], &[Span { mem: ra, offset: 0, len: 8 }]).is_err());
        assert!(copy_from_bytes(&[Span { mem: rb, offset: 0, len: 4 }], &[0; 5]).is_err());
    }

    #[test]
    fn atomics() {
        let mut w = [0u64; 2];
        // SAFETY: w outlives the region's use.
        let m = unsafe { MemRegion::from_raw(w.as_mut_ptr() as *mut u8, 16) };
        assert_eq!(atomic(&m, 0, Atomic::FetchAdd { add: 5 }), Ok(0));
        assert_eq!(atomic(&m, 0, Atomic::CmpSwap { compare: 5, swap: 9 }), Ok(5));
        assert_eq!(atomic(&m, 0, Atomic::CmpSwap { compare: 5, swap: 1 }), Ok(9));
        assert_eq!(atomic(&m, 3, Atomic::FetchAdd { add: 1 }), Err(WcStatus::RemInvReqErr));
        assert_eq!(atomic(&m, 16, Atomic::FetchAdd { add: 1 }), Err(WcStatus::RemAccessErr));
    }
}
