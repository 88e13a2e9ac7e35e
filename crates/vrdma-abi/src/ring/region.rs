//! Layouts of the regions a QP, an SRQ and a CQ share on the direct path, and the words of
//! their control pages.

use super::{CompRingLayout, RecvRingLayout, LINE, PAGE};

/// Layout of a QP's shared region: a control page, then its receive ring (absent when the QP
/// uses an SRQ), then its inbound completion ring, then its staging ring (`staging.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpRegionLayout {
    /// The QP's own receive ring, if it has no SRQ.
    pub rq: Option<RecvRingLayout>,
    /// Inbound completions.
    pub comp: CompRingLayout,
}

/// Control page word: the owner's QP state (`ibv_qp_state`), written by the owner.
pub const QP_OWNER_STATE: usize = 0;
/// Control page word: non-zero asks the owner to move the QP to ERR (see `QP_ERR_*`).
pub const QP_ERROR_REQUEST: usize = LINE;
/// Control page word: bumped by vrdmad whenever the owner deregisters an MR, so peers
/// revalidate cached remote keys.
pub const QP_MR_EPOCH: usize = 2 * LINE;
/// Control page word: the owner's vNIC generation; unused for now, reserved.
pub const QP_RESERVED: usize = 3 * LINE;

/// Control page word: the owner's Q_Key (UD QPs), checked by UD senders.
pub const QP_QKEY: usize = 4 * LINE;
/// Control page word: lock of the QP's receive side for UD senders (several processes may
/// send to one UD QP; its completion ring has one producer at a time). 0 = free.
pub const QP_UD_LOCK: usize = 5 * LINE;

/// Control page word: the owner's retry attributes, for vrdmad's engine (mediated QPs):
/// `rnr_retry | retry_cnt << 8 | timeout << 16`.
pub const QP_RETRY: usize = 6 * LINE;

/// Control page line 7: the QP's share of its vNIC's caps, written by vrdmad only, read by
/// the owner's library on each direct post (see docs/architecture.md, "Caps on the direct
/// path"). [`QP_QOS_EPOCH`] moves on (Release) after the other words changed, so one load of
/// it tells the library whether anything did.
pub const QP_QOS_EPOCH: usize = 7 * LINE;
/// Control page word: the QP's byte cap in bytes/s (0: none).
pub const QP_QOS_MAX_BW: usize = 7 * LINE + 8;
/// Control page word: the QP's WR-rate cap in WRs/s (0: none).
pub const QP_QOS_MAX_RATE: usize = 7 * LINE + 16;
/// Control page word: orders from vrdmad (`QP_QOS_*` bits).
pub const QP_QOS_FLAGS: usize = 7 * LINE + 24;
/// QoS order: the vNIC exceeded its cap on the direct path; the owner moves the QP onto the
/// engine (`Request::MoveToEngine`) before its next direct send.
pub const QP_QOS_DEMOTE: u64 = 1;

// Lines 8..14: the QP's meter (`meter.rs`, `QP_METER`).

/// Error request: the connected peer's process went away.
pub const QP_ERR_PEER_GONE: u64 = 1;
/// Error request: the peer detected a fatal error on this connection.
pub const QP_ERR_REMOTE: u64 = 2;

impl QpRegionLayout {
    /// Layout for a QP with `rq` (None with an SRQ) and a completion ring of `comp` entries.
    pub fn new(rq: Option<RecvRingLayout>, comp_entries: usize) -> Self {
        QpRegionLayout { rq, comp: CompRingLayout::new(comp_entries) }
    }
    /// Offset of the receive ring.
    pub fn rq_offset(&self) -> usize {
        PAGE
    }
    /// Offset of the completion ring.
    pub fn comp_offset(&self) -> usize {
        PAGE + self.rq.map_or(0, |r| r.size())
    }
    /// Offset of the staging ring (page-aligned: the rings before it are page multiples).
    pub fn staging_offset(&self) -> usize {
        self.comp_offset() + self.comp.size()
    }
    /// Total bytes.
    pub fn size(&self) -> usize {
        self.staging_offset() + super::STAGING_REGION
    }
}

/// Layout of an SRQ's shared region: a control page, then the ring.
pub fn srq_region_size(rq: RecvRingLayout) -> usize {
    PAGE + rq.size()
}

/// CQ control page word: arm state (see `CQ_ARM_*`), set by the owner, cleared by whoever
/// delivers the event.
pub const CQ_ARM: usize = 0;
/// CQ control page word: 1 when the CQ has a completion channel (set once by the owner).
pub const CQ_HAS_CHANNEL: usize = LINE;
/// Not armed.
pub const CQ_ARM_NONE: u64 = 0;
/// Armed for the next completion.
pub const CQ_ARM_NEXT: u64 = 1;
/// Armed for the next solicited (or error) completion.
pub const CQ_ARM_SOLICITED: u64 = 2;
/// Size of a CQ's shared region.
pub const CQ_REGION_SIZE: usize = PAGE;
