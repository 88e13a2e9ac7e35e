//! Queue memory vrdmad allocates for a vNIC (QP, SRQ and CQ rings), charged against its
//! `max_ring_bytes` so one tenant cannot make the daemon allocate without bound.

use super::vnic::VnicState;
use super::RequestError;

impl VnicState {
    /// Charges `bytes` of queue memory, or refuses (and counts the refusal) if the vNIC's
    /// limit would be exceeded.
    pub(super) fn charge_ring(&mut self, bytes: u64) -> Result<(), RequestError> {
        let limit = self.rec.limits.max_ring_bytes;
        if self.counters.ring_bytes.saturating_add(bytes) > limit {
            return Err(RequestError::RingBytesLimit { limit, want: bytes });
        }
        self.counters.ring_bytes += bytes;
        Ok(())
    }

    /// Gives back what [`VnicState::charge_ring`] charged.
    pub(super) fn uncharge_ring(&mut self, bytes: u64) {
        self.counters.ring_bytes = self.counters.ring_bytes.saturating_sub(bytes);
    }
}
