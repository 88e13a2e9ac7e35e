//! Shared receive queues.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use vrdma_abi::control::{Reply, Request};
use vrdma_abi::ring::{self, RecvRing, RecvRingLayout};
use vrdma_abi::shm::SharedMapping;

use crate::device::{Pd, PdInner};
use crate::error::{invalid, Error};
use crate::qp::posted::PostedRecvs;
use crate::qp::RecvWr;
use crate::spin::SpinLock;

pub(crate) struct SrqInner {
    pd: Arc<PdInner>,
    pub(crate) handle: u32,
    _region: SharedMapping,
    pub(crate) ring: RecvRing,
    max_wr: u64,
    max_sge: usize,
    posted: Mutex<u64>,
    /// `posted`'s value, for the limit check (which runs under a CQ's spin lock).
    posted_total: AtomicU64,
    polled: AtomicU64,
    /// The armed limit (low 32 bits; 0: disarmed, see [`Srq::arm_limit`]) and how many times
    /// it was armed (high 32 bits), so a check that began before an arming cannot use it up.
    armed: AtomicU64,
    /// Where the limit event goes (set when armed).
    events: Mutex<Option<Arc<crate::events::EventsInner>>>,
    /// The receives posted, as posted (a leaf lock; see `qp::posted`).
    pub(crate) copy: SpinLock<PostedRecvs>,
}

impl SrqInner {
    /// The owner polled a completion that took one of our receives. Called under the CQ's
    /// spin lock: atomics only, but for the event itself (once per arming).
    #[inline]
    pub(crate) fn consumed(&self) {
        let polled = self.polled.fetch_add(1, Ordering::AcqRel) + 1;
        if self.armed.load(Ordering::Acquire) as u32 != 0 {
            self.check_limit(polled);
        }
    }

    #[cold]
    fn check_limit(&self, polled: u64) {
        loop {
            let armed = self.armed.load(Ordering::Acquire);
            let limit = armed as u32;
            if limit == 0 {
                return;
            }
            // Loaded after `armed`: receives posted before that arming are counted.
            let outstanding = self.posted_total.load(Ordering::Acquire).saturating_sub(polled);
            if outstanding >= u64::from(limit) {
                return;
            }
            // Once per arming, by whichever poll saw the count below it; re-checked if the
            // limit was armed again meanwhile.
            if self.armed.compare_exchange(armed, armed & !0xffff_ffff, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                if let Some(ev) = self.events.lock().as_ref() {
                    ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::SrqLimitReached, qpn: self.handle });
                }
                return;
            }
        }
    }
}

/// A shared receive queue.
#[derive(Clone)]
pub struct Srq {
    pub(crate) inner: Arc<SrqInner>,
}

impl Pd {
    /// Creates an SRQ of `max_wr` receives of up to `max_sge` elements.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, Error> {
        let op = "create_srq";
        let (r, fds) = self.inner.ctx.inner.ctl.call(op, &Request::CreateSrq { pd: self.inner.handle, max_wr, max_sge }, &[])?;
        let Reply::Srq { srq, entries, max_sge: sge } = r else {
            return Err(Error::UnexpectedReply { op });
        };
        let fd = fds.into_iter().next().ok_or(Error::UnexpectedReply { op })?;
        let layout = RecvRingLayout::new(entries as usize, sge as usize);
        let shm_err = |source| Error::Shm { op, source };
        let region = SharedMapping::map_sealed(fd.as_fd(), ring::srq_region_size(layout), true).map_err(shm_err)?;
        let ring = RecvRing::new(region.region().subregion(ring::PAGE, layout.size()).map_err(shm_err)?, layout).map_err(shm_err)?;
        Ok(Srq {
            inner: Arc::new(SrqInner {
                pd: self.inner.clone(),
                handle: srq,
                _region: region,
                ring,
                max_wr: u64::from(max_wr),
                max_sge: max_sge as usize,
                posted: Mutex::new(0),
                posted_total: AtomicU64::new(0),
                polled: AtomicU64::new(0),
                armed: AtomicU64::new(0),
                events: Mutex::new(None),
                copy: SpinLock::new(PostedRecvs::new(max_wr.max(entries) as usize)),
            }),
        })
    }
}

impl Srq {
    /// Posts a receive WR.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), Error> {
        let s = &self.inner;
        if wr.sg_list.len() > s.max_sge {
            return Err(invalid("post_srq_recv", format!("{} SGEs exceed max_sge {}", wr.sg_list.len(), s.max_sge)));
        }
        // Receive buffers registered in place move onto shared memory first (mr.rs).
        crate::mr::share_receive_buffers(&s.pd.ctx, wr.sg_list);
        let mut posted = s.posted.lock();
        if *posted - s.polled.load(Ordering::Acquire) >= s.max_wr {
            return Err(Error::QueueFull { op: "post_srq_recv" });
        }
        let flags = crate::qp::receive_flags(&s.pd.ctx, wr.sg_list, &mut None);
        if !crate::qp::posted::post(&s.copy, &s.ring, wr.wr_id, wr.sg_list, flags)
            .map_err(|source| Error::Shm { op: "post_srq_recv", source })?
        {
            return Err(Error::QueueFull { op: "post_srq_recv" });
        }
        *posted += 1;
        s.posted_total.store(*posted, Ordering::Release);
        Ok(())
    }

    /// Handle (unique within the vNIC).
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// Arms the SRQ limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): once fewer than `limit`
    /// receives are outstanding, `events` gets [`crate::AsyncEventKind::SrqLimitReached`]
    /// and the limit is disarmed (reads 0) until armed again; 0 disarms it. Receives are
    /// taken by the senders' side (a peer's library, or vrdmad), so the drop is seen when
    /// this process polls the completion that took one, not earlier.
    pub fn arm_limit(&self, limit: u32, events: &crate::AsyncEvents) -> Result<(), Error> {
        let s = &self.inner;
        if u64::from(limit) > s.max_wr {
            return Err(invalid("modify_srq", format!("limit {limit} exceeds max_wr {}", s.max_wr)));
        }
        *s.events.lock() = Some(events.inner.clone());
        let times = (s.armed.load(Ordering::Acquire) >> 32).wrapping_add(1) & 0xffff_ffff;
        s.armed.store(times << 32 | u64::from(limit), Ordering::Release);
        Ok(())
    }

    /// The armed limit (0: disarmed, or it fired).
    pub fn limit(&self) -> u32 {
        self.inner.armed.load(Ordering::Acquire) as u32
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // Its handle will not name it any more.
        if let Some(ev) = self.events.lock().as_ref() {
            ev.purge_srq(self.handle);
        }
        let _ = self.pd.ctx.inner.ctl.call("destroy_srq", &Request::DestroySrq { srq: self.handle }, &[]);
    }
}
