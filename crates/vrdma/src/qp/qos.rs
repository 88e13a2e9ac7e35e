//! The vNIC's caps on the direct path: vrdmad publishes each QP's share in its control page
//! (`vrdma_abi::ring::QpQos`); a post loads one word to see whether it changed, and a capped
//! QP keeps a token bucket (`vrdma_core::bucket`). A WR the bucket refuses waits in the QP's
//! retry queue and goes (and completes) later: back-pressure, as on a loaded NIC, never an
//! error. When vrdmad orders it (the vNIC went over its cap), the QP moves onto vrdmad's
//! engine, which enforces the caps from then on.

use vrdma_abi::control::{Reply, Request};
use vrdma_abi::ring;
use vrdma_abi::verbs::WrOpcode;
use vrdma_core::bucket::TokenBucket;

use super::{QpInner, QpMut, SendWr};
use crate::error::Error;
use crate::mediated::MedChannel;

/// What a QP's library last took from its QoS words.
#[derive(Debug, Default)]
pub(super) struct QosState {
    /// The epoch last applied (`QpQos::epoch`).
    epoch: u64,
    /// The bucket of a capped QP (None: uncapped, the only check a post makes is the epoch).
    pub(super) bucket: Option<TokenBucket>,
    /// The test build's library that ignores its caps (`test-ignore-cap`).
    #[cfg(feature = "test-ignore-cap")]
    ignore: bool,
}

/// Nanoseconds on the coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`: a read of what the
/// kernel's tick last stored, a few nanoseconds in the vDSO, where the precise clock reads the
/// time-stamp counter on every post). The bucket's burst (50 ms) is many ticks (1–4 ms), so
/// the rate over time is exact; a WR held back waits at most a tick longer.
pub(super) fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// Payload bytes of a send WR, as a cap counts them (atomics: 8).
#[inline(always)]
pub(super) fn wr_bytes(wr: &SendWr<'_>, inline: Option<&[u8]>) -> u64 {
    if let Some(b) = inline {
        return b.len() as u64;
    }
    match (wr.opcode, wr.sg_list) {
        (WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd, _) => 8,
        (_, [one]) => u64::from(one.length),
        (_, sges) => sges.iter().map(|s| u64::from(s.length)).sum(),
    }
}

impl QpInner {
    /// Whether vrdmad changed the QP's caps or orders since the QP last looked: one load of a
    /// line only vrdmad writes (rarely), one compare.
    #[inline(always)]
    pub(super) fn qos_changed(&self, m: &QpMut) -> bool {
        self.qos.epoch() != m.qos.epoch
    }

    /// Takes what vrdmad published: a new bucket when the caps changed, and the move onto
    /// the engine when ordered (once the WRs already waiting have gone: they keep their order
    /// ahead of what follows).
    #[cold]
    pub(super) fn apply_qos(&self, m: &mut QpMut) {
        let (epoch, w) = self.qos.read();
        let caps = m.qos.bucket.as_ref().map_or((0, 0), TokenBucket::caps);
        if caps != (w.max_bw, w.max_rate) {
            m.qos.bucket = TokenBucket::new(w.max_bw, w.max_rate, now_ns());
        }
        if w.flags & ring::QP_QOS_DEMOTE != 0 && m.med.is_none() && m.peer.is_some() {
            if !m.pending.is_empty() {
                // Not applied yet: the next post looks again.
                return;
            }
            if let Err(e) = self.move_to_engine(m) {
                // The WR still goes (directly, within the cap): a post never fails for this.
                // vrdmad keeps the vNIC demoted; the next order (a new epoch) tries again.
                eprintln!("vrdma: QP {}: could not move onto vrdmad's engine as ordered: {e}", self.qpn);
            }
        }
        m.qos.epoch = epoch;
    }

    /// Moves the connected QP onto vrdmad's engine: every WR before this one executed (and
    /// completed into the CQ's local queue, which a poll reads before the engine's), every
    /// WR after it goes through the engine's send ring.
    fn move_to_engine(&self, m: &mut QpMut) -> Result<(), Error> {
        let op = "post_send";
        let (reply, fds) = self.ctx.inner.ctl.call(op, &Request::MoveToEngine { qpn: self.qpn }, &[])?;
        if !matches!(reply, Reply::ConnectedMediated { .. }) {
            return Err(Error::UnexpectedReply { op });
        }
        let c = MedChannel::from_reply(self.qpn, m.attr.dest_qp_num, self.me.clone(), &reply, fds)?;
        self.send_cq.add_mediated(c.shared.clone());
        m.med = Some(c);
        m.peer = None;
        m.qos.bucket = None;
        self.ctx.watch_daemon(self.me.clone());
        self.publish_state(m.state, m.attr.min_rnr_timer, m.med.as_ref());
        Ok(())
    }

    /// A capped QP's bucket for a WR: None when it may go (charged; the clock is read only
    /// when the bucket runs dry, i.e. when the cap binds), else how many nanoseconds it waits
    /// (`Outcome::Throttled`, the time metered). A WR that then does not execute (responder
    /// not ready, RNR) gets its charge back ([`QpInner::refund`]): it is tried again.
    #[inline(never)]
    pub(super) fn pace(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) -> Option<u64> {
        #[cfg(feature = "test-ignore-cap")]
        if m.qos.ignore {
            return None;
        }
        let b = m.qos.bucket.as_mut()?;
        let bytes = wr_bytes(wr, inline);
        if b.try_charge(bytes) {
            return None;
        }
        let wait = b.take(now_ns(), bytes).err()?;
        self.meter.add(ring::METER_THROTTLED_NS, wait);
        Some(wait)
    }

    /// Gives back what [`QpInner::pace`] charged for a WR that did not execute.
    #[cold]
    pub(super) fn refund(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) {
        #[cfg(feature = "test-ignore-cap")]
        if m.qos.ignore {
            return;
        }
        if let Some(b) = m.qos.bucket.as_mut() {
            b.refund(wr_bytes(wr, inline));
        }
    }
}

impl super::Qp {
    /// Test build only (`test-ignore-cap`): this QP's library ignores the caps vrdmad
    /// publishes (it still obeys the order to move onto the engine): what vrdmad must catch.
    #[cfg(feature = "test-ignore-cap")]
    pub fn ignore_caps_for_test(&self) {
        self.inner.m.lock().qos.ignore = true;
    }

    /// Whether the QP's library keeps a bucket now (vrdmad published a cap for it).
    pub fn is_capped(&self) -> bool {
        let mut m = self.inner.m.lock();
        if self.inner.qos_changed(&m) {
            self.inner.apply_qos(&mut m);
        }
        m.qos.bucket.is_some()
    }
}
