//! The engine's meter of a mediated QP: the same words as a direct QP's control-page meter
//! (`vrdma_abi::ring::QpMeter`), kept in the daemon's own memory, where the client cannot
//! write them.

use std::sync::atomic::{AtomicU64, Ordering};

use vrdma_abi::ring::{meter_opcode, meter_status, MeterWords, METER_RETRANSMITS, METER_RNR, METER_RX, METER_THROTTLED_NS, METER_WORDS};
use vrdma_abi::verbs::{WcStatus, WrOpcode};
use vrdma_abi::wire::{FrameHeader, Kind, F_CMP_SWAP, F_CONT, F_IMM};

/// Counters of what the engine executed for one QP. Relaxed adds: the words are read only to
/// report them.
#[derive(Debug)]
pub(crate) struct EngineMeter([AtomicU64; METER_WORDS]);

impl Default for EngineMeter {
    fn default() -> Self {
        EngineMeter(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl EngineMeter {
    fn add(&self, i: usize, v: u64) {
        self.0[i % METER_WORDS].fetch_add(v, Ordering::Relaxed);
    }

    /// A WR of this QP (requester) finished with `status`, carrying `len` bytes.
    pub(crate) fn completed(&self, opcode: WrOpcode, status: WcStatus, len: u32) {
        if status == WcStatus::Success {
            let i = meter_opcode(opcode as u32);
            self.add(i, 1);
            self.add(i + 1, u64::from(len));
        }
        self.add(meter_status(status as u8), 1);
    }

    /// The words of request `h` among the received ones, and its bytes.
    fn received_words(h: &FrameHeader) -> Option<(usize, u64)> {
        let (opcode, bytes) = match h.kind {
            Kind::Write if h.flags & F_IMM != 0 => (WrOpcode::RdmaWriteWithImm, u64::from(h.data_len)),
            Kind::Write => (WrOpcode::RdmaWrite, u64::from(h.data_len)),
            Kind::Send if h.flags & F_IMM != 0 => (WrOpcode::SendWithImm, u64::from(h.data_len)),
            Kind::Send => (WrOpcode::Send, u64::from(h.data_len)),
            Kind::ReadReq => (WrOpcode::RdmaRead, h.arg1),
            Kind::AtomicReq if h.flags & F_CMP_SWAP != 0 => (WrOpcode::AtomicCmpAndSwp, 8),
            Kind::AtomicReq => (WrOpcode::AtomicFetchAndAdd, 8),
            _ => return None,
        };
        Some((METER_RX + meter_opcode(opcode as u32), bytes))
    }

    /// A request for this QP (responder) arrived and is being executed: its bytes, and the
    /// WR once (at its first segment, see `wire::F_MORE`).
    pub(crate) fn received(&self, h: &FrameHeader) {
        if let Some((i, bytes)) = Self::received_words(h) {
            self.add(i, u64::from(!is_continuation(h)));
            self.add(i + 1, bytes);
        }
    }

    /// Request `h`, counted by [`EngineMeter::received`] after `earlier` bytes of earlier
    /// segments of its message, was answered RNR or not ready: it will come again and count
    /// then.
    pub(crate) fn not_received(&self, h: &FrameHeader, earlier: u64) {
        if let Some((i, bytes)) = Self::received_words(h) {
            self.take_back(i, 1);
            self.take_back(i + 1, bytes + earlier);
        }
    }

    /// Takes `n` back from word `i`, never below 0: a peer that sends what the responder
    /// cannot follow must not wrap a counter that is kept at its highest (`registry::metering`).
    fn take_back(&self, i: usize, n: u64) {
        let _ = self.0[i].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(n)));
    }

    /// The message `h` belongs to, counted with `done` bytes of its earlier segments, is
    /// dropped: its requester sends it again from its start, and it counts then.
    pub(crate) fn message_not_received(&self, h: &FrameHeader, done: u64) {
        if let Some((i, _)) = Self::received_words(h) {
            self.take_back(i, 1);
            self.take_back(i + 1, done);
        }
    }

    /// A later segment `h` of a message, counted by [`EngineMeter::received`], was answered
    /// not ready, and its message resumes from it (`wire::F_RESUME`): its bytes count when
    /// it comes again (the message's WR counted at its first segment).
    pub(crate) fn segment_not_received(&self, h: &FrameHeader) {
        if let Some((i, bytes)) = Self::received_words(h) {
            self.take_back(i + 1, bytes);
        }
    }

    /// The peer answered RNR.
    pub(crate) fn rnr(&self) {
        self.add(METER_RNR, 1);
    }

    /// `n` requests were sent again.
    pub(crate) fn retransmitted(&self, n: u64) {
        self.add(METER_RETRANSMITS, n);
    }

    /// Its WRs waited `ns` nanoseconds for the vNIC's or tenant's caps.
    pub(crate) fn throttled(&self, ns: u64) {
        self.add(METER_THROTTLED_NS, ns);
    }

    /// Every word.
    pub(crate) fn read(&self) -> MeterWords {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}

/// Whether `h` is a segment after the first of a WRITE or SEND (`wire::F_CONT`; the flag means
/// nothing on other kinds).
pub(crate) fn is_continuation(h: &FrameHeader) -> bool {
    matches!(h.kind, Kind::Write | Kind::Send) && h.flags & F_CONT != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_abi::ring::METER_STATUS;

    #[test]
    fn completions_count_bytes_on_success_and_every_status() {
        let m = EngineMeter::default();
        m.completed(WrOpcode::Send, WcStatus::Success, 100);
        m.completed(WrOpcode::Send, WcStatus::RemAccessErr, 100);
        m.rnr();
        m.retransmitted(3);
        let w = m.read();
        assert_eq!((w[4], w[5]), (1, 100));
        assert_eq!(w[METER_STATUS], 1);
        assert_eq!(w[METER_STATUS + WcStatus::RemAccessErr as usize], 1);
        assert_eq!((w[METER_RNR], w[METER_RETRANSMITS]), (1, 3));
    }

    /// A message in segments counts as one WR of all their bytes; answered RNR at its last
    /// segment, it counts nothing until it comes again.
    #[test]
    fn a_message_in_segments_counts_once() {
        use vrdma_abi::wire::{F_CONT, F_MORE};
        let m = EngineMeter::default();
        let seg = |flags, len| {
            let mut h = FrameHeader::new(Kind::Write);
            (h.flags, h.data_len) = (flags, len);
            h
        };
        let write = METER_RX + meter_opcode(WrOpcode::RdmaWrite as u32);
        for attempt in 0..2 {
            m.received(&seg(F_MORE, 100));
            m.received(&seg(F_MORE | F_CONT, 100));
            let last = seg(F_CONT, 50);
            m.received(&last);
            if attempt == 0 {
                m.not_received(&last, 200);
                assert_eq!((m.read()[write], m.read()[write + 1]), (0, 0));
            }
        }
        assert_eq!((m.read()[write], m.read()[write + 1]), (1, 250));
    }

    #[test]
    fn a_request_answered_rnr_counts_once_it_is_executed() {
        let m = EngineMeter::default();
        let mut h = FrameHeader::new(Kind::Send);
        h.data_len = 64;
        m.received(&h);
        m.not_received(&h, 0);
        m.received(&h);
        h.kind = Kind::ReadReq;
        h.arg1 = 4096;
        m.received(&h);
        let w = m.read();
        let send = METER_RX + meter_opcode(WrOpcode::Send as u32);
        let read = METER_RX + meter_opcode(WrOpcode::RdmaRead as u32);
        assert_eq!((w[send], w[send + 1], w[read], w[read + 1]), (1, 64, 1, 4096));
    }
}
