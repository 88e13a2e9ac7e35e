//! Shared receive queues.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};

use vrdma::RecvWr;

use crate::mr::VPd;
use crate::qp::sge_list;
use crate::sys;
use crate::{guard, invalid, ptr, rc, reject_wr, unsupported, DropInError};

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
            let p = Box::into_raw(Box::new(VSrq { srq, inner, pd: vpd, max_wr: a.attr.max_wr, max_sge, users: AtomicUsize::new(0) }));
            // SAFETY: p is our fresh allocation.
            unsafe { crate::init_sync(&mut (*p).srq.mutex, Some(&mut (*p).srq.cond)) };
            Ok(p as *mut sys::ibv_srq)
        })())
    })
}

/// `ibv_modify_srq`: vrdma SRQs have a fixed size and raise no limit events.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_modify_srq(_srq: *mut sys::ibv_srq, _attr: *mut sys::ibv_srq_attr, _mask: c_int) -> c_int {
    rc(Err(unsupported("ibv_modify_srq", "resizing SRQs and SRQ limit events")))
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
        *attr = sys::ibv_srq_attr { max_wr: v.max_wr, max_sge: v.max_sge, srq_limit: 0 };
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
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: a list of valid WRs (verbs contract).
        let w = unsafe { &*cur };
        // SAFETY: the WR's list has num_sge entries.
        let r = unsafe { sge_list(w.sg_list, w.num_sge) }
            .and_then(|sg_list| v.inner.post_recv(&RecvWr { wr_id: w.wr_id, sg_list }).map_err(DropInError::from));
        if let Err(e) = r {
            // SAFETY: bad_wr is the caller's (null or writable).
            return unsafe { reject_wr(bad_wr, cur, &e) };
        }
        cur = w.next;
    }
    0
}
