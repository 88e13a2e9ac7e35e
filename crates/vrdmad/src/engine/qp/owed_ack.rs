//! The responder's side of a QP: its state, and the ACK it defers for a request of the QP's
//! own to carry.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::ring;

use super::MedQp;
use crate::engine::lane::tokens::TokenState;
use crate::engine::MappedMr;

pub(crate) struct RespState {
    pub(crate) expected_psn: u32,
    pub(crate) inbound_head_cache: u64,
    /// After an error NAK the requester's QP is in ERR: later requests are dropped.
    pub(crate) dead: bool,
    pub(crate) sges: Vec<ring::Sge>,
    /// Scatter spans of the SEND being received (kept to avoid an allocation per message).
    pub(crate) spans: Vec<((Arc<MappedMr>, usize), u64)>,
    /// SENDs and WRITEs executed since this side's last ACK went (sent, or carried by a
    /// request or a token), and their bytes (a deferred ACK is sent at once past
    /// [`ACK_EVERY`] or [`ACK_BYTES`]).
    pub(crate) unacked: u32,
    pub(crate) unacked_bytes: u64,
    /// ACK tokens (a QP with a lane: see [`MedQp::publish_ack_token`]).
    pub(crate) tokens: TokenState,
    /// The WRITE or SEND whose segments are arriving (`wire::F_MORE`), if any.
    pub(crate) partial: Option<Partial>,
    /// Resets of the responder (a (re)connection starts PSNs again): a READ answered apart
    /// (`responder::ReadAnswers`) ends at one.
    pub(crate) resets: u64,
}

/// A WRITE or SEND received in segments, up to its latest one.
pub(crate) struct Partial {
    pub(crate) psn: u32,
    pub(crate) kind: vrdma_abi::wire::Kind,
    /// Whether it carries immediate data (its meter's word: `wire::F_IMM`).
    pub(crate) imm: bool,
    /// Data bytes of the segments executed so far.
    pub(crate) done: u64,
    /// Whether its next segment may continue it: not after the responder answered it (not
    /// ready), until the requester resends it from its first segment...
    pub(crate) open: bool,
    /// ...or, where it was answered "not ready" for memory that did not answer, from the
    /// segment at `done` (`wire::F_RESUME`).
    pub(crate) resumable: bool,
    /// A SEND's receive (`wr_id`, from the SRQ), taken at its first segment and kept for a
    /// resend of the message, and that receive's scatter list.
    pub(crate) recv: Option<(u64, bool)>,
    pub(crate) sges: Vec<ring::Sge>,
}

/// A responder ACKs at once after this many deferred SENDs and WRITEs...
pub(crate) const ACK_EVERY: u32 = 16;

/// ...or this many of their bytes, so a streaming requester's window keeps moving.
pub(crate) const ACK_BYTES: u64 = 64 * 1024;

/// Marks [`MedQp::ack_owed`] as holding a PSN.
pub(crate) const OWED: u64 = 1 << 32;

impl MedQp {
    /// The responder executed SEND/WRITE `psn` and defers its ACK.
    pub(crate) fn owe_ack(&self, psn: u32) {
        self.ack_owed.store(OWED | u64::from(psn), Ordering::Release);
    }

    /// The responder acknowledges everything now: nothing stays owed.
    pub(crate) fn clear_owed_ack(&self) {
        self.ack_owed.store(0, Ordering::Release);
    }

    /// The deferred ACK, if any (its PSN), left owed: a frame about to carry it settles it
    /// once queued ([`MedQp::settle_owed_ack`]).
    pub(crate) fn owed_ack(&self) -> Option<u32> {
        let v = self.ack_owed.load(Ordering::Acquire);
        (v & OWED != 0).then_some(v as u32)
    }

    /// The deferred ACK of `psn` is carried by a frame queued: no longer owed, unless a later
    /// one is owed meanwhile (not carried yet). (Sent meanwhile by the reader too, it goes
    /// twice: ACKs are cumulative.)
    pub(crate) fn settle_owed_ack(&self, psn: u32) {
        let _ = self.ack_owed.compare_exchange(OWED | u64::from(psn), 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Takes the deferred ACK, if any (its PSN).
    pub(crate) fn take_owed_ack(&self) -> Option<u32> {
        if self.ack_owed.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let v = self.ack_owed.swap(0, Ordering::AcqRel);
        (v & OWED != 0).then_some(v as u32)
    }

    /// Whether a deferred ACK is waiting.
    pub(crate) fn owes_ack(&self) -> bool {
        self.ack_owed.load(Ordering::Acquire) != 0
    }
}
