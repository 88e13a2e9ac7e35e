//! `SqRing` as vrdmad's engine consumes it: the producer is a container's library, so the
//! ring's memory is whatever it wrote. The input picks a layout, pushes some valid WRs, then
//! scribbles over the ring; the engine's view pops until empty (bounded).
//!
//! Properties: nothing panics or hangs; in-layout pops never fail with a `ShmError`; a popped
//! entry never carries more than `max_sge` elements or `max_inline` bytes; without garbage,
//! pops return exactly what was pushed, in order.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use std::os::fd::AsFd;
use vrdma_abi::ring::{Sge, SqEntry, SqRing, SqRingLayout};
use vrdma_abi::shm::{create_memfd, SharedMapping};

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let layout = SqRingLayout::new(u.int_in_range(0..=16)?, u.int_in_range(0..=4)?, u.int_in_range(0..=128)?);
    let size = layout.size();
    let fd = create_memfd("fuzz-sq-ring", size, true).expect("memfd");
    let owner = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("mapping");
    let engine = SharedMapping::map_sealed(fd.as_fd(), size, true).expect("mapping");
    let producer = SqRing::new(*owner.region(), layout).expect("fits");
    let consumer = SqRing::new(*engine.region(), layout).expect("fits");
    let mut pushed = Vec::new();
    let mut cached = 0;
    for i in 0..u.int_in_range(0..=layout.capacity)? {
        let nsge = u.int_in_range(0..=layout.max_sge)?;
        let e = SqEntry {
            wr_id: i as u64,
            opcode: u.arbitrary()?,
            send_flags: u.arbitrary()?,
            sges: (0..nsge).map(|k| Sge { addr: k as u64, length: 1, lkey: 2 }).collect(),
            inline: vec![7; u.int_in_range(0..=layout.max_inline)?],
            ..SqEntry::default()
        };
        assert!(producer.push(&e, &mut cached).expect("in layout"), "ring has room");
        pushed.push(e);
    }
    let want = u.int_in_range(0..=size)?.min(u.len());
    let garbage = u.bytes(want)?;
    let at = u.int_in_range(0..=size - garbage.len())?;
    owner.region().write_from(at, garbage).expect("in bounds");
    let clean = garbage.is_empty();
    let mut out = SqEntry::default();
    let mut n = 0;
    // A forged producer position may claim up to 2^64 entries: the engine bounds its work.
    while n < 4 * layout.capacity + 4 && consumer.pop_into(&mut out).expect("in layout") {
        assert!(out.sges.len() <= layout.max_sge && out.inline.len() <= layout.max_inline);
        if clean {
            assert_eq!(out, pushed[n], "pop vs push");
        }
        n += 1;
    }
    if clean {
        assert_eq!(n, pushed.len());
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
