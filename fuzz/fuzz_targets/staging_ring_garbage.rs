//! `StagingRing` push/peek/release over memory a hostile peer scribbles on.
//!
//! The ring lives in a sealed memfd mapped twice: the owner's view runs a sequence of
//! producer and consumer operations taken from the input, the peer's view overwrites a
//! stretch of it with fuzz bytes first and pokes 64-bit words between operations (the
//! producer of a real staging ring is the other process).
//!
//! Properties: nothing panics or hangs; a peeked record's payload and scatter list lie
//! within the ring (the region accessors would fail otherwise) and hold at most
//! `STAGED_MAX_SGE` elements. While the peer has not touched the ring it is a FIFO: records
//! come back in push order, with the pushed offset, length and bytes.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::collections::VecDeque;
use std::os::fd::AsFd;
use vrdma_abi::ring::{Sge, StagingRing, STAGED_MAX_SGE, STAGING_REGION};
use vrdma_abi::shm::{create_memfd, SharedMapping};

const MAX_OPS: usize = 256;
const MAX_SGE: usize = 4;

fn byte_of(seed: u64, i: usize) -> u8 {
    (seed as usize).wrapping_mul(31).wrapping_add(i) as u8
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let fd = create_memfd("fuzz-staging-ring", STAGING_REGION, true).expect("memfd");
    let owner = SharedMapping::map_sealed(fd.as_fd(), STAGING_REGION, true).expect("owner mapping");
    let peer = SharedMapping::map_sealed(fd.as_fd(), STAGING_REGION, true).expect("peer mapping");
    let ring = StagingRing::new(*owner.region()).expect("ring fits its region");

    let garbage_len = u.int_in_range(0..=4096usize)?;
    let garbage = u.bytes(garbage_len.min(u.len()))?;
    let at = u.int_in_range(0..=STAGING_REGION - garbage.len())?;
    peer.region().write_from(at, garbage).expect("garbage in bounds");
    let mut clean = garbage.is_empty();

    // (msg_offset, len, nsge) of records pushed and not yet released, while clean.
    let mut model: VecDeque<(u64, usize, usize)> = VecDeque::new();
    let mut sges = Vec::new();
    for _ in 0..MAX_OPS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=4u8)? {
            0 => {
                let n = u.int_in_range(0..=MAX_SGE)?;
                let list: Vec<Sge> =
                    (0..n).map(|_| Ok(Sge { addr: u.arbitrary()?, length: u.arbitrary()?, lkey: u.arbitrary()? })).collect::<Result<_>>()?;
                let want = u.int_in_range(0..=300_000usize)?;
                let offset: u64 = u.arbitrary()?;
                let pushed = ring.push(offset, want, u.arbitrary()?, &list, |region, len| {
                    region.write_from(0, &(0..len).map(|i| byte_of(offset, i)).collect::<Vec<u8>>())
                });
                match pushed {
                    Ok(Some(len)) => {
                        assert!(len <= want, "pushed {len} of {want}");
                        if clean {
                            model.push_back((offset, len, n));
                        }
                    }
                    Ok(None) => {}
                    Err(e) => assert!(!clean, "push on a clean ring failed: {e}"),
                }
            }
            1 => match ring.peek(&mut sges) {
                Ok(Some(rec)) => {
                    assert!(sges.len() <= STAGED_MAX_SGE, "{} elements", sges.len());
                    let len = rec.payload.len();
                    if clean {
                        let (offset, want_len, n) = model.pop_front().expect("peeked a record never pushed");
                        assert_eq!((rec.msg_offset, len, sges.len()), (offset, want_len, n), "record vs model");
                        let mut b = [0u8; 1];
                        for i in (0..len).step_by(4093) {
                            rec.payload.read_into(i, &mut b).expect("payload in bounds");
                            assert_eq!(b[0], byte_of(offset, i), "byte {i}");
                        }
                    } else if len > 0 {
                        rec.payload.read_into(len - 1, &mut [0u8; 1]).expect("payload in bounds");
                    }
                    let _ = ring.release(&rec);
                }
                Ok(None) => assert!(!clean || model.is_empty(), "a pushed record went missing"),
                Err(e) => assert!(!clean, "peek on a clean ring failed: {e}"),
            },
            2 => {
                let _ = ring.is_empty();
                let _ = ring.can_push(u.int_in_range(0..=MAX_SGE)?, u.int_in_range(0..=300_000usize)?);
            }
            3 => {
                let _ = ring.clear();
                model.clear();
            }
            _ => {
                let words = STAGING_REGION / 8;
                let w = if u.arbitrary::<bool>()? { u.int_in_range(0..=16usize)? } else { u.int_in_range(0..=words - 1)? };
                peer.region().store_u64(w * 8, u.arbitrary()?).expect("poke in bounds");
                clean = false;
            }
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
