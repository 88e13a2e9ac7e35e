//! The vNIC's caps on the direct path: vrdmad publishes each QP's share in its control page
//! (`vrdma_abi::ring::QpQos`); a post loads one word to see whether it changed, and a capped
//! QP keeps a token bucket (`vrdma_core::bucket`). A WR the bucket refuses waits in the QP's
//! retry queue and goes (and completes) later: back-pressure, as on a loaded NIC, never an
//! error. When vrdmad orders it (the vNIC went over its cap), the QP moves onto vrdmad's
//! engine, which enforces the caps from then on.

use std::sync::OnceLock;
use std::time::Instant;

use vrdma_abi::control::{Reply, Request};
use vrdma_abi::ring;
use vrdma_abi::verbs::WrOpcode;
use vrdma_core::bucket::TokenBucket;

use super::direct::Outcome;
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

/// Nanoseconds on the process's monotonic clock (the buckets' time).
pub(super) fn now_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Payload bytes of a send WR, as a cap counts them (atomics: 8).
#[inline(always)]
pub(super) fn wr_bytes(wr: &SendWr<'_>, inline: Option<&[u8]>) -> u64 {
    if let Some(b) = inline {
        return b.len() as u64;
    }
    match wr.opcode {
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => 8,
        _ => wr.sg_list.iter().map(|s| u64::from(s.length)).sum(),
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
    pub(super) fn apply_qos(&self, m: &mut QpMut) -> Result<(), Error> {
        let (epoch, w) = self.qos.read();
        let caps = m.qos.bucket.as_ref().map_or((0, 0), TokenBucket::caps);
        if caps != (w.max_bw, w.max_rate) {
            m.qos.bucket = TokenBucket::new(w.max_bw, w.max_rate, now_ns());
        }
        if w.flags & ring::QP_QOS_DEMOTE != 0 && m.med.is_none() && m.peer.is_some() {
            if !m.pending.is_empty() {
                // Not applied yet: the next post looks again.
                return Ok(());
            }
            self.move_to_engine(m)?;
        }
        m.qos.epoch = epoch;
        Ok(())
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

    /// [`QpInner::execute`] of a capped QP: the WR goes if the bucket lets it (else it waits
    /// `Outcome::Throttled`, the time waited metered); one that did not execute (responder
    /// not ready, RNR) gets its charge back, since it is tried again.
    #[inline(never)]
    pub(super) fn execute_capped(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) -> Outcome {
        #[cfg(feature = "test-ignore-cap")]
        if m.qos.ignore {
            return self.execute_uncapped(m, wr, inline);
        }
        let bytes = wr_bytes(wr, inline);
        if let Some(b) = m.qos.bucket.as_mut() {
            if let Err(wait) = b.take(now_ns(), bytes) {
                self.meter.add(ring::METER_THROTTLED_NS, wait);
                return Outcome::Throttled(wait);
            }
        }
        let outcome = self.execute_uncapped(m, wr, inline);
        if matches!(outcome, Outcome::Rnr | Outcome::NotReady) {
            if let Some(b) = m.qos.bucket.as_mut() {
                b.refund(bytes);
            }
        }
        outcome
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
            let _ = self.inner.apply_qos(&mut m);
        }
        m.qos.bucket.is_some()
    }
}
