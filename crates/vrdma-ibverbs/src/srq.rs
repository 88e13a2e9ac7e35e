//! Shared receive queues.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use vrdma::RecvWr;

pub(crate) use crate::async_ack::event_acknowledged;
use crate::async_ack::wait_events_acknowledged;
use crate::device::VCtx;
use crate::mr::VPd;
use crate::qp::{post_each, sge_list};
use crate::sys;
use crate::{guard, invalid, ptr, rc, unsupported, DropInError};

/// A shared receive queue.
#[repr(C)]
pub struct VSrq {
    /// What the application sees.
    pub srq: sys::ibv_srq,
    /// The vrdma SRQ.
    pub inner: vrdma::Srq,
    pd: *const VPd,
    max_wr: u32,
    max_sge: u32,
    /// QPs using it: destroying fails with EBUSY until they are gone.
    pub users: AtomicUsize,
    /// Asynchronous events of this SRQ returned by `ibv_get_async_event` (the acknowledged
    /// ones are `srq.events_completed`; destroy waits for the two to meet).
    pub events_reported: AtomicU32,
}

/// `ibv_create_srq`.
///
/// # Safety
/// `pd` is a live PD, `attr` a valid `ibv_srq_init_attr` (its `attr` is updated).
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_srq(pd: *mut sys::ibv_pd, attr: *mut sys::ibv_srq_init_attr) -> *mut sys::ibv_srq {
    guard(std::ptr::null_mut(), || {
        ptr((|| {
            let op = "ibv_create_srq";
            if pd.is_null() || attr.is_null() {
                return Err(invalid(op, "NULL PD or attributes"));
            }
            // SAFETY: the caller passes a live PD of ours and a valid init structure.
            let (vpd, a) = unsafe { (VPd::from_ptr(pd), &mut *attr) };
            let dev = vpd.inner.context().query_device();
            if a.attr.max_wr == 0 || a.attr.max_wr > dev.max_srq_wr || a.attr.max_sge > dev.max_srq_sge {
                return Err(invalid(op, format!("max_wr {} / max_sge {} out of range", a.attr.max_wr, a.attr.max_sge)));
            }
            let max_sge = a.attr.max_sge.max(1);
            let inner = vpd.inner.create_srq(a.attr.max_wr, max_sge)?;
            a.attr.max_sge = max_sge;
            let srq =
                sys::ibv_srq { context: vpd.pd.context, srq_context: a.srq_context, pd, handle: inner.handle(), ..Default::default() };
            vpd.users.fetch_add(1, Ordering::AcqRel);
            let handle = inner.handle();
            let p = Box::into_raw(Box::new(VSrq {
                srq,
                inner,
                pd: vpd,
                max_wr: a.attr.max_wr,
                max_sge,
                users: AtomicUsize::new(0),
                events_reported: AtomicU32::new(0),
            }));
            // SAFETY: p is our fresh allocation.
            unsafe { crate::init_sync(&mut (*p).srq.mutex, Some(&mut (*p).srq.cond)) };
            // SAFETY: the PD's context is an open context of ours.
            unsafe { VCtx::from_ptr(vpd.pd.context) }.srqs.lock().insert(handle, p as usize);
            Ok(p as *mut sys::ibv_srq)
        })())
    })
}

/// `ibv_modify_srq`: arms the SRQ limit (`IBV_SRQ_LIMIT`; the event is
/// `IBV_EVENT_SRQ_LIMIT_REACHED`, see `vrdma::Srq::arm_limit`). vrdma SRQs have a fixed
/// size: `IBV_SRQ_MAX_WR` is unsupported.
///
/// # Safety
/// `srq` is a live SRQ, `attr` readable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_modify_srq(srq: *mut sys::ibv_srq, attr: *mut sys::ibv_srq_attr, mask: c_int) -> c_int {
    let op = "ibv_modify_srq";
    if srq.is_null() || attr.is_null() {
        return rc(Err(invalid(op, "NULL SRQ or attributes")));
    }
    let mask = mask as u32;
    if mask & sys::IBV_SRQ_MAX_WR != 0 {
        return rc(Err(unsupported(op, "resizing SRQs")));
    }
    if mask & !sys::IBV_SRQ_LIMIT != 0 {
        return rc(Err(invalid(op, format!("unknown attribute mask {mask:#x}"))));
    }
    if mask == 0 {
        return 0;
    }
    // SAFETY: the caller passes a live SRQ of ours and a readable structure.
    let (v, a) = unsafe { (&*(srq as *const VSrq), &*attr) };
    // SAFETY: the SRQ's context is an open context of ours.
    let ctx = unsafe { VCtx::from_ptr(v.srq.context) };
    rc(v.inner.arm_limit(a.srq_limit, &ctx.events).map_err(DropInError::from))
}

/// `ibv_query_srq`.
///
/// # Safety
/// `srq` is a live SRQ, `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_srq(srq: *mut sys::ibv_srq, attr: *mut sys::ibv_srq_attr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live SRQ of ours and a writable structure.
    unsafe {
        let v = &*(srq as *const VSrq);
        *attr = sys::ibv_srq_attr { max_wr: v.max_wr, max_sge: v.max_sge, srq_limit: v.inner.limit() };
    }
    0
}

/// `ibv_destroy_srq`: EBUSY while QPs use it.
///
/// # Safety
/// `srq` is a live SRQ, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_destroy_srq(srq: *mut sys::ibv_srq) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    let p = srq as *mut VSrq;
    // SAFETY: the caller passes a live SRQ of ours.
    if unsafe { &*p }.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // No new events can name it; then the ones reported must be acknowledged (as
    // libibverbs documents for ibv_destroy_srq).
    // SAFETY: the caller passes a live SRQ of ours.
    let (ctx, handle) = unsafe { ((*p).srq.context, (*p).srq.handle) };
    // SAFETY: the SRQ's context is an open context of ours.
    unsafe { VCtx::from_ptr(ctx) }.srqs.lock().remove(&handle);
    // SAFETY: a live SRQ of ours; its mutex and cond were initialised at creation.
    unsafe { wait_events_acknowledged(srq, (*p).events_reported.load(Ordering::Acquire)) };
    // SAFETY: allocated by Box in ibv_create_srq.
    let b = unsafe { Box::from_raw(p) };
    // SAFETY: the PD outlives its SRQs.
    unsafe { &*b.pd }.users.fetch_sub(1, Ordering::AcqRel);
    drop(b);
    0
}

/// `ops.post_srq_recv` (the header's inline `ibv_post_srq_recv`).
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut sys::ibv_srq,
    wr: *mut sys::ibv_recv_wr,
    bad_wr: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live SRQ of ours.
    let v = unsafe { &*(srq as *const VSrq) };
    let post = |w: &sys::ibv_recv_wr| {
        // SAFETY: the WR's list has num_sge entries.
        unsafe { sge_list(w.sg_list, w.num_sge) }
            .and_then(|sg_list| v.inner.post_recv(&RecvWr { wr_id: w.wr_id, sg_list }).map_err(DropInError::from))
    };
    // SAFETY: the caller's list and bad_wr, passed on.
    unsafe { post_each(wr, bad_wr, post) }
}
