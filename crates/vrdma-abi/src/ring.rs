//! Rings shared between processes on the direct data path, built on [`crate::shm`].
//!
//! * [`RecvRing`] (`recv.rs`): a bounded multi-consumer queue of receive WRs (Vyukov's
//!   per-slot sequence numbers). The QP (or SRQ) owner is the only producer; the connected
//!   peer's library consumes an entry when a SEND or WRITE_WITH_IMM arrives; the owner also
//!   consumes when it flushes. A slot can't be reused before its consumer has copied it out.
//! * [`CompRing`] (`comp.rs`): a single-producer single-consumer ring of inbound
//!   completions: the peer writes the completion of a receive it filled, the owner's CQ
//!   polls it.
//! * [`StagingRing`] (`staging.rs`): a single-producer single-consumer byte ring in a QP's
//!   region where a peer's SEND payload waits until the responder's library scatters it
//!   into its receive buffer (a peer never writes memory it has no remote rights to).
//! * [`SqRing`] (`sq.rs`): the send queue of a mediated QP, which vrdmad's engine consumes.
//! * `qos.rs`: a QP's caps as vrdmad publishes them to the library ([`QpQos`]).
//! * `region.rs`: the layouts of the QP, SRQ and CQ regions and their control words;
//!   `mediated.rs`: the layout of a mediated QP's channel region, its control words and
//!   [`AckToken`].
//!
//! Every index read from shared memory is untrusted: it is masked, and loops are bounded, so
//! a misbehaving peer can corrupt only its own connection, never hang or crash us.

mod comp;
mod mediated;
mod meter;
mod qos;
mod recv;
mod region;
mod sq;
mod staging;

pub use comp::{CompEntry, CompRing, CompRingLayout, COMP_FROM_SRQ, COMP_SOLICITED, COMP_STAGED};
pub use mediated::{
    AckToken, MediatedLayout, LANE_DATA_MAX, MED_ACK_TAKEN, MED_ACK_TOKEN, MED_CLAIMED, MED_DOORBELL_WANTED, MED_ENGINE_WANTS,
    MED_LANE_SEAL, MED_LANE_SEQ, MED_RETIRED, MED_RINGER_CPU, MED_SEND_SIDE, MED_STALLED, MED_UNSENT, MED_UNSENT_ACK, MED_UNSENT_BYTES,
    MED_UNSENT_SEQ, SEND_SIDE_CLIENT, SEND_SIDE_ENGINE, SEND_SIDE_FREE,
};
pub use meter::{
    meter_opcode, meter_status, MeterWords, QpMeter, METER_OPCODES, METER_RETRANSMITS, METER_RNR, METER_RX, METER_STATUS, METER_STATUSES,
    METER_THROTTLED_NS, METER_WORDS, QP_METER,
};
pub use qos::{QosWords, QpQos};
pub use recv::{RecvEntry, RecvRing, RecvRingLayout, Take, RECV_REMOTE_WRITABLE};
pub use region::{
    srq_region_size, QpRegionLayout, CQ_ARM, CQ_ARM_NEXT, CQ_ARM_NONE, CQ_ARM_SOLICITED, CQ_HAS_CHANNEL, CQ_REGION_SIZE, QP_ERROR_REQUEST,
    QP_ERR_PEER_GONE, QP_ERR_REMOTE, QP_MR_EPOCH, QP_OWNER_STATE, QP_QKEY, QP_QOS_DEMOTE, QP_QOS_EPOCH, QP_QOS_FLAGS, QP_QOS_MAX_BW,
    QP_QOS_MAX_RATE, QP_RESERVED, QP_RETRY, QP_UD_LOCK,
};
pub use sq::{SqEntry, SqRing, SqRingLayout};
pub use staging::{StagedRecord, StagingRing, STAGED_LAST, STAGED_MAX_SGE, STAGING_BYTES, STAGING_REGION};

use crate::shm::{MemRegion, ShmError};

/// A cache line.
const LINE: usize = 64;
/// Size of a page in every layout (regions are page-multiples on all supported hosts).
pub const PAGE: usize = 4096;

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

// Every ring's region: line 0 unused, a position word on each of lines 1 and 2 (the
// producer's and the consumer's, never sharing a line), then the slots.
/// Offset of a ring's first position word (a [`RecvRing`]'s producer, an SPSC ring's consumer).
const FIRST_POSITION: usize = LINE;
/// Offset of a ring's second position word.
const SECOND_POSITION: usize = 2 * LINE;
/// Offset of a ring's first slot.
const SLOTS: usize = 3 * LINE;

/// Bytes of a ring of `capacity` slots of `slot_size` bytes, a multiple of [`PAGE`].
fn ring_size(capacity: usize, slot_size: usize) -> usize {
    round_up(SLOTS + capacity * slot_size, PAGE)
}

/// Offset of the slot of position `pos` in a ring of `capacity` (a power of two) slots of
/// `slot_size` bytes; masked, since positions are read from shared memory.
#[inline]
fn slot_offset(pos: u64, capacity: usize, slot_size: usize) -> usize {
    SLOTS + (pos as usize & (capacity - 1)) * slot_size
}

/// Whether a single-producer single-consumer ring of `capacity` slots has room at the
/// producer's position `tail`. The consumer's position is read (`read_head`, into
/// `cached_head`) only when the producer's last view of it says full, so the producer does
/// not touch the consumer's line on every push.
#[inline]
fn spsc_has_room(
    tail: u64,
    capacity: usize,
    cached_head: &mut u64,
    read_head: impl FnOnce() -> Result<u64, ShmError>,
) -> Result<bool, ShmError> {
    if tail.wrapping_sub(*cached_head) >= capacity as u64 {
        *cached_head = read_head()?;
        if tail.wrapping_sub(*cached_head) >= capacity as u64 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// One scatter/gather element as stored in a receive slot. `repr(C)`: the layout of
/// libibverbs' `struct ibv_sge`, so the drop-in passes applications' lists without copying.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Sge {
    /// Virtual address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the MR that holds it.
    pub lkey: u32,
}

/// Bytes of an [`Sge`] in a slot: the address, then length and key in one word.
const SGE_SIZE: usize = 16;

/// Writes `sges` into a slot's gather list at `off` (the receive and send rings share the
/// format).
#[inline]
fn write_sges(mem: &MemRegion, off: usize, sges: &[Sge]) -> Result<(), ShmError> {
    for (i, s) in sges.iter().enumerate() {
        let so = off + i * SGE_SIZE;
        mem.store_u64(so, s.addr)?;
        mem.store_u64(so + 8, u64::from(s.length) | (u64::from(s.lkey) << 32))?;
    }
    Ok(())
}

/// Reads `n` elements of the gather list at `off` into `out`, which it clears first.
#[inline]
fn read_sges(mem: &MemRegion, off: usize, n: usize, out: &mut Vec<Sge>) -> Result<(), ShmError> {
    out.clear();
    for i in 0..n {
        let so = off + i * SGE_SIZE;
        let addr = mem.load_u64(so)?;
        let w = mem.load_u64(so + 8)?;
        out.push(Sge { addr, length: w as u32, lkey: (w >> 32) as u32 });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::shm::{create_memfd, SharedMapping};
    use std::os::fd::AsFd;

    /// A sealed shared mapping of `size` bytes for a ring under test.
    pub(crate) fn mapping(size: usize) -> SharedMapping {
        let fd = create_memfd("ring", size, true).unwrap();
        SharedMapping::map_sealed(fd.as_fd(), size, true).unwrap()
    }
}
