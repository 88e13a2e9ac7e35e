//! Caps on a mediated QP, the minimal hook the direct path's demotion needs: a vNIC that
//! went over its cap on the direct path (`registry::qos`) has its QPs moved onto the engine,
//! which paces each of them to its share of the vNIC's caps with a token bucket
//! (`vrdma_core::bucket`). The send ring keeps what waits: the client sees its WRs complete
//! later, as on a loaded NIC. (Per-vNIC and per-tenant buckets and fair queuing across all
//! mediated QPs are the engine's QoS proper, issue 29 point 2; this only holds one QP.)

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use vrdma_core::bucket::TokenBucket;

use super::{MedQp, ReqState};
use crate::engine::Engine;

/// Nanoseconds of `t` on the engine's pacing clock.
fn ns(t: Instant) -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    t.saturating_duration_since(*START.get_or_init(Instant::now)).as_nanos() as u64
}

impl MedQp {
    /// Whether the QP's cap holds its next WR back at `now`: then the pump stops, and a
    /// timer pumps the QP again when it may go.
    pub(crate) fn pace_holds(&self, e: &Engine, st: &mut ReqState, now: Instant) -> bool {
        let Some(b) = st.pace.as_mut() else { return false };
        let wait = b.wait_ns(ns(now));
        if wait == 0 {
            return false;
        }
        let at = now + Duration::from_nanos(wait);
        st.wait_until = Some(at);
        e.add_timer(at, self.qpn);
        true
    }

    /// Charges a WR of `bytes` that went to the QP's cap.
    pub(crate) fn pace_charge(st: &mut ReqState, bytes: u64) {
        if let Some(b) = st.pace.as_mut() {
            b.charge(bytes);
        }
    }
}

impl Engine {
    /// Holds mediated QP `qpn` to `max_bw` bytes/s and `max_rate` WRs/s (0: that one
    /// uncapped); unchanged caps keep the bucket's level. Whether the engine has the QP.
    pub fn set_qp_caps(&self, qpn: u32, max_bw: u64, max_rate: u64) -> bool {
        let Some(q) = self.qps.read().get(&qpn).cloned() else { return false };
        {
            let mut st = q.req.lock();
            let now = st.pace.as_ref().map_or((0, 0), TokenBucket::caps);
            if now != (max_bw, max_rate) {
                st.pace = TokenBucket::new(max_bw, max_rate, ns(Instant::now()));
            }
        }
        self.kick_qp(&q);
        true
    }
}
