//! Queue pairs. `VQp`, what an `ibv_qp` (and `ibv_qp_ex`) the application holds points to,
//! and its verbs by responsibility:
//!
//! - `create`: `ibv_create_qp`, `verbs_context.create_qp_ex`, `ibv_destroy_qp`;
//! - `attr`: the state machine and attributes (`ibv_modify_qp`, `ibv_query_qp`);
//! - `post`: posting through the context's `ops` table (the header's inline
//!   `ibv_post_send`/`ibv_post_recv`), UD destinations from address handles;
//! - `batch` and `wr`: the `ibv_qp_ex` work-request API (`ibv_wr_start` …
//!   `ibv_wr_complete`, what perftest uses by default): the WRs being built, and the
//!   entry points that build and post them.

mod attr;
mod batch;
mod create;
mod post;
mod wr;

pub(crate) use crate::async_ack::event_acknowledged;
pub use attr::{__vrdma_ibv_modify_qp, __vrdma_ibv_query_qp, __vrdma_ibv_query_qp_data_in_order};
pub(crate) use create::create_qp_ex;
pub use create::{__vrdma_ibv_create_qp, __vrdma_ibv_destroy_qp, __vrdma_ibv_qp_to_qp_ex};
pub(crate) use post::{post_each, post_recv, post_send, sge_list};

use std::cell::UnsafeCell;

use crate::cq::VCq;
use crate::mr::VPd;
use crate::srq::VSrq;
use crate::sys;
use batch::Batch;

/// Largest scatter/gather list of one WR.
pub const MAX_SGE: usize = 32;

/// A queue pair. `ibv_qp_ex` (which begins with `ibv_qp`) is first, so the same address
/// serves `ibv_qp_to_qp_ex`.
#[repr(C)]
pub struct VQp {
    /// What the application sees.
    pub ex: sys::ibv_qp_ex,
    /// The vrdma QP.
    pub inner: vrdma::Qp,
    pd: *const VPd,
    send_cq: *const VCq,
    recv_cq: *const VCq,
    srq: *const VSrq,
    ud: bool,
    sq_sig_all: bool,
    /// Work requests being built between `ibv_wr_start` and `ibv_wr_complete`.
    batch: UnsafeCell<Batch>,
    /// Held from `ibv_wr_start` until `ibv_wr_complete` or `ibv_wr_abort`: that span is a
    /// per-QP critical section that the provider enforces (ibv_wr_post(3), "CONCURRENCY";
    /// only QPs of a thread domain, which vrdma does not offer, are left to the caller), so
    /// two threads building on one QP take turns instead of mixing their WRs.
    batch_lock: vrdma::RawSpinLock,
    /// Asynchronous events of this QP returned by `ibv_get_async_event` (the acknowledged
    /// ones are `ibv_qp.events_completed`, as in libibverbs).
    pub events_reported: std::sync::atomic::AtomicU32,
}

impl VQp {
    /// The `VQp` of an `ibv_qp` (or `ibv_qp_ex`) pointer.
    ///
    /// # Safety
    /// `qp` was created by us and not destroyed.
    pub unsafe fn from_ptr<'a>(qp: *mut sys::ibv_qp) -> &'a VQp {
        // SAFETY: every ibv_qp we hand out is the first field of a VQp.
        unsafe { &*(qp as *const VQp) }
    }

    /// Takes `batch_lock` (`ibv_wr_start`).
    #[inline(always)]
    fn lock_batch(&self) {
        self.batch_lock.lock();
    }

    /// Releases `batch_lock` (`ibv_wr_complete`, `ibv_wr_abort`).
    #[inline(always)]
    fn unlock_batch(&self) {
        self.batch_lock.unlock();
    }
}
