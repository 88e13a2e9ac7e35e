//! `RecvRing` push/take over memory a hostile peer scribbles on.
//!
//! The input picks a small layout, then the ring is created the way vrdma does it (a sealed
//! memfd, `SharedMapping::map_sealed`, `RecvRing::new` + `init`). A second mapping of the same
//! memfd plays the peer: it overwrites a stretch of the ring with fuzz bytes, and pokes 64-bit
//! words between operations. The owner's view then runs a sequence of push / take /
//! has_entries taken from the input.
//!
//! Properties: nothing panics or hangs; in-layout operations never fail with a `ShmError`
//! (every offset is masked into the ring); a take never returns more than `max_sge`
//! elements; a push of more than `max_sge` elements is refused. While the peer has not
//! touched the ring, it behaves exactly like a bounded FIFO of `capacity` entries.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::collections::VecDeque;
use std::os::fd::AsFd;
use vrdma_abi::ring::{RecvEntry, RecvRing, RecvRingLayout, Sge, Take};
use vrdma_abi::shm::{create_memfd, MemRegion, SharedMapping};

/// Upper bounds keep one iteration cheap (at most two pages per ring).
const MAX_ENTRIES: usize = 40;
const MAX_SGE: usize = 4;
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

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let layout = RecvRingLayout::new(u.int_in_range(0..=MAX_ENTRIES)?, u.int_in_range(0..=MAX_SGE)?);
    let size = layout.size();
    let fd = create_memfd("fuzz-recv-ring", size, true).expect("memfd");
    let owner = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("owner mapping");
    let peer = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("peer mapping");
    let ring = RecvRing::new(*owner.region(), layout).expect("ring fits its layout");
    ring.init().expect("init");
    assert_eq!(ring.layout(), layout);

    // The peer overwrites a stretch of the ring with fuzz bytes.
    let garbage_len = u.int_in_range(0..=size)?;
    let garbage = u.bytes(garbage_len.min(u.len()))?;
    let at = u.int_in_range(0..=size - garbage.len())?;
    peer.region().write_from(at, garbage).expect("garbage in bounds");

    // Reference model, valid while the peer has written nothing.
    // Words worth forging (mirrors ring.rs's layout; only a bias, any word can be poked):
    // enqueue_pos, dequeue_pos, and every slot's sequence number.
    let slot_size = 24 + 16 * layout.max_sge;
    let hot: Vec<usize> = [64, 128]
        .into_iter()
        .chain((0..layout.capacity).map(|k| 192 + k * slot_size))
        .map(|off| off / 8)
        .filter(|&w| w < size / 8)
        .collect();

    let mut clean = garbage.is_empty();
    let mut model: VecDeque<RecvEntry> = VecDeque::new();
    let mut next_wr_id = 0u64;

    for _ in 0..MAX_OPS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=3u8)? {
            0 => {
                let n = u.int_in_range(0..=layout.max_sge + 1)?;
                let mut sges = Vec::with_capacity(n);
                for _ in 0..n {
                    sges.push(Sge { addr: u.arbitrary()?, length: u.arbitrary()?, lkey: u.arbitrary()? });
                }
                let wr_id = next_wr_id;
                next_wr_id += 1;
                let res = ring.push(wr_id, &sges);
                if n > layout.max_sge {
                    assert!(res.is_err(), "push of {n} > max_sge elements accepted");
                    continue;
                }
                let pushed = res.expect("in-layout push failed");
                if clean {
                    assert_eq!(pushed, model.len() < layout.capacity, "push vs model");
                    if pushed {
                        model.push_back(RecvEntry { wr_id, sges });
                    }
                }
            }
            1 => {
                let taken = ring.take().expect("in-layout take failed");
                if let Take::Entry(e) = &taken {
                    assert!(e.sges.len() <= layout.max_sge, "take returned too many sges");
                }
                if clean {
                    match model.pop_front() {
                        Some(want) => assert_eq!(taken, Take::Entry(want), "take vs model"),
                        None => assert_eq!(taken, Take::Empty, "take from an empty ring"),
                    }
                }
            }
            2 => {
                let _ = ring.has_entries();
                if clean {
                    assert_eq!(ring.has_entries(), !model.is_empty(), "has_entries vs model");
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
