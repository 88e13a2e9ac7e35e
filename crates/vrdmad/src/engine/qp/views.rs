//! A QP's receiving side and CQs, mapped into the daemon from their shared regions.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::fd::signal_eventfd;
use vrdma_abi::ring::{self, CompRing, QpRegionLayout, RecvRing, RecvRingLayout};
use vrdma_abi::shm::{SharedMapping, ShmError};
use vrdma_abi::verbs::QpState;

/// A QP's receiving side as the registry describes it (mediated RC and UD from other hosts).
pub struct RecvSideSetup {
    /// The QP's shared region (control page, receive ring, inbound completions).
    pub qp_region: Arc<OwnedFd>,
    /// Its receive ring layout (None with an SRQ).
    pub rq: Option<RecvRingLayout>,
    /// Its inbound completion ring entries.
    pub comp_entries: u32,
    /// Its SRQ region and layout.
    pub srq: Option<(Arc<OwnedFd>, RecvRingLayout)>,
}

/// A QP's receiving side mapped into the daemon: its shared region, receive ring (or SRQ)
/// and inbound completion ring.
pub(crate) struct RecvSide {
    pub(crate) qp_map: SharedMapping,
    rq: Option<RecvRing>,
    srq: Option<(SharedMapping, RecvRing)>,
    pub(crate) inbound: CompRing,
}

impl RecvSide {
    /// Maps `s`.
    pub(crate) fn map(s: RecvSideSetup) -> Result<RecvSide, ShmError> {
        let layout = QpRegionLayout::new(s.rq, s.comp_entries as usize);
        let qp_map = SharedMapping::map_sealed(s.qp_region.as_fd(), layout.size(), true)?;
        let rq = match s.rq {
            Some(l) => Some(RecvRing::new(qp_map.region().subregion(layout.rq_offset(), l.size())?, l)?),
            None => None,
        };
        let inbound = CompRing::new(qp_map.region().subregion(layout.comp_offset(), layout.comp.size())?, layout.comp)?;
        let srq = match s.srq {
            Some((fd, l)) => {
                let m = SharedMapping::map_sealed(fd.as_fd(), ring::srq_region_size(l), true)?;
                let r = RecvRing::new(m.region().subregion(ring::PAGE, l.size())?, l)?;
                Some((m, r))
            }
            None => None,
        };
        Ok(RecvSide { qp_map, rq, srq, inbound })
    }

    /// The owner's QP state.
    pub(crate) fn owner_state(&self) -> Option<QpState> {
        QpState::from_u32(self.qp_map.region().load_u64(ring::QP_OWNER_STATE).ok()? as u32)
    }

    /// Prefetches the receive ring's next slot (see [`vrdma_abi::shm::MemRegion::prefetch`]).
    pub(crate) fn prefetch_recv(&self) {
        match (&self.srq, &self.rq) {
            (Some((_, r)), _) | (None, Some(r)) => r.prefetch_next(),
            (None, None) => {}
        }
    }

    /// Takes the next receive WR (SRQ, else RQ) into `sges`: its wr_id and whether it came
    /// from the SRQ, or `None` (none posted).
    pub(crate) fn take_recv(&self, sges: &mut Vec<ring::Sge>) -> Option<(u64, bool)> {
        let (ring, srq) = match (&self.srq, &self.rq) {
            (Some((_, r)), _) => (r, true),
            (None, Some(r)) => (r, false),
            (None, None) => return None,
        };
        ring.take_into(sges).ok().flatten().map(|id| (id, srq))
    }
}

/// A CQ's arm word and eventfd, as the engine sees them.
pub(crate) struct CqView {
    map: SharedMapping,
    eventfd: Arc<OwnedFd>,
}

impl CqView {
    pub(crate) fn new((region, eventfd): (Arc<OwnedFd>, Arc<OwnedFd>)) -> Result<CqView, ShmError> {
        let map = SharedMapping::map_sealed(region.as_fd(), ring::CQ_REGION_SIZE, true)?;
        Ok(CqView { map, eventfd })
    }

    /// Delivers an event if the CQ is armed for this completion (same rule as the library's).
    pub(crate) fn notify(&self, solicited_or_error: bool) {
        let Ok(arm) = self.map.region().atomic_u64(ring::CQ_ARM) else { return };
        std::sync::atomic::fence(Ordering::SeqCst);
        let a = arm.load(Ordering::SeqCst);
        let fire = a == ring::CQ_ARM_NEXT || (a == ring::CQ_ARM_SOLICITED && solicited_or_error);
        if fire && arm.compare_exchange(a, ring::CQ_ARM_NONE, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            signal_eventfd(&self.eventfd);
        }
    }
}
