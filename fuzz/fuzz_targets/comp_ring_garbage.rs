//! `CompRing` push/pop over memory a hostile peer scribbles on.
//!
//! The input picks a small layout, then the ring is created the way vrdma does it (a sealed
//! memfd, `SharedMapping::map_sealed`, `CompRing::new`). A second mapping of the same memfd
//! plays the peer: it overwrites a stretch of the ring with fuzz bytes, and pokes 64-bit
//! words between operations. The owner's view then runs a sequence of push / pop / is_empty
//! taken from the input, decoding popped entries as the CQ poller would.
//!
//! Properties: nothing panics or hangs; in-layout operations never fail with a `ShmError`;
//! a successful push leaves the ring non-empty. While the peer has not touched the ring, it
//! behaves exactly like a bounded FIFO of `capacity` entries.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::collections::VecDeque;
use std::os::fd::AsFd;
use vrdma_abi::ring::{CompEntry, CompRing, CompRingLayout};
use vrdma_abi::shm::{create_memfd, MemRegion, SharedMapping};
use vrdma_abi::verbs::{WcOpcode, WcStatus};

const MAX_ENTRIES: usize = 200;
const MAX_OPS: usize = 512;

/// The peer writes one 64-bit word of the ring: either any word or one of the `hot` words
/// (indices and per-slot sequence numbers), with a raw value, a value near `u64::MAX`, or the
/// value of another word plus a small delta (how a peer forges sequence numbers or indices
/// that line up with the owner's positions).
fn poke(u: &mut Unstructured<'_>, peer: &MemRegion, size: usize, hot: &[usize]) -> Result<()> {
    let words = size / 8;
    let pick = |u: &mut Unstructured<'_>| -> Result<usize> {
        if u.arbitrary::<bool>()? {
            Ok(hot[u.choose_index(hot.len())?])
        } else {
            u.int_in_range(0..=words - 1)
        }
    };
    let word = pick(u)?;
    let v = match u.int_in_range(0..=2u8)? {
        0 => u.arbitrary::<u64>()?,
        1 => u64::MAX - u64::from(u.arbitrary::<u8>()?),
        _ => {
            let from = pick(u)?;
            let delta = i64::from(u.arbitrary::<i8>()?) as u64;
            peer.load_u64(from * 8).expect("peek in bounds").wrapping_add(delta)
        }
    };
    peer.store_u64(word * 8, v).expect("poke in bounds");
    Ok(())
}

fn entry(u: &mut Unstructured<'_>) -> Result<CompEntry> {
    Ok(CompEntry {
        wr_id: u.arbitrary()?,
        byte_len: u.arbitrary()?,
        imm: u.arbitrary()?,
        opcode: u.arbitrary()?,
        status: u.arbitrary()?,
        wc_flags: u.arbitrary()?,
        flags: u.arbitrary()?,
        src_qp: u.arbitrary()?,
    })
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let layout = CompRingLayout::new(u.int_in_range(0..=MAX_ENTRIES)?);
    let size = layout.size();
    let fd = create_memfd("fuzz-comp-ring", size, true).expect("memfd");
    let owner = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("owner mapping");
    let peer = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("peer mapping");
    let ring = CompRing::new(*owner.region(), layout).expect("ring fits its layout");
    assert!(ring.is_empty(), "a zeroed ring is empty");

    let garbage_len = u.int_in_range(0..=size)?;
    let garbage = u.bytes(garbage_len.min(u.len()))?;
    let at = u.int_in_range(0..=size - garbage.len())?;
    peer.region().write_from(at, garbage).expect("garbage in bounds");

    // Words worth forging (mirrors ring.rs's layout; only a bias, any word can be poked):
    // head, tail, and the sequence word of every (64-byte) entry.
    let hot: Vec<usize> =
        [64, 128].into_iter().chain((0..layout.capacity).map(|k| 192 + k * 64)).map(|off| off / 8).filter(|&w| w < size / 8).collect();

    let mut clean = garbage.is_empty();
    let mut model: VecDeque<CompEntry> = VecDeque::new();

    for _ in 0..MAX_OPS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=3u8)? {
            0 => {
                let e = entry(u)?;
                let pushed = ring.push(&e).expect("in-layout push failed");
                if clean {
                    // With a hostile peer the consumer's position is whatever the peer
                    // wrote, so "not empty after a push" only holds for an untouched ring.
                    if pushed {
                        assert!(!ring.is_empty(), "ring empty right after a push");
                    }
                    assert_eq!(pushed, model.len() < layout.capacity, "push vs model");
                    if pushed {
                        model.push_back(e);
                    }
                }
            }
            1 => {
                let popped = ring.pop().expect("in-layout pop failed");
                if let Some(e) = &popped {
                    // What the CQ poller does with an untrusted entry.
                    let _ = WcStatus::from_u8(e.status);
                    let _ = WcOpcode::from_u8(e.opcode);
                }
                if clean {
                    assert_eq!(popped, model.pop_front(), "pop vs model");
                }
            }
            2 => {
                let empty = ring.is_empty();
                if clean {
                    assert_eq!(empty, model.is_empty(), "is_empty vs model");
                }
            }
            _ => {
                // The peer writes one word while the owner works.
                poke(u, peer.region(), size, &hot)?;
                clean = false;
            }
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
