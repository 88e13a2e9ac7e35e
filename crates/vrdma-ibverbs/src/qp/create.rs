//! Creating and destroying QPs: `ibv_create_qp`, `verbs_context.create_qp_ex` (the
//! header's inline `ibv_create_qp_ex`), `ibv_qp_to_qp_ex`, `ibv_destroy_qp`.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use vrdma::QpCaps;

use super::batch::Batch;
use super::VQp;
use crate::async_ack::wait_events_acknowledged;
use crate::cq::VCq;
use crate::mr::VPd;
use crate::srq::VSrq;
use crate::sys;
use crate::{guard, invalid, ptr, unsupported, DropInError};

/// The fields `ibv_qp_init_attr` and `ibv_qp_init_attr_ex` share.
struct Init {
    qp_context: *mut c_void,
    send_cq: *mut sys::ibv_cq,
    recv_cq: *mut sys::ibv_cq,
    srq: *mut sys::ibv_srq,
    cap: *mut sys::ibv_qp_cap,
    qp_type: u32,
    sq_sig_all: bool,
}

/// The [`Init`] of an `ibv_qp_init_attr` or `ibv_qp_init_attr_ex` (same field names).
macro_rules! init_of {
    ($a:expr) => {
        Init {
            qp_context: $a.qp_context,
            send_cq: $a.send_cq,
            recv_cq: $a.recv_cq,
            srq: $a.srq,
            cap: &mut $a.cap,
            qp_type: $a.qp_type,
            sq_sig_all: $a.sq_sig_all != 0,
        }
    };
}

fn create(pd: *mut sys::ibv_pd, init: &Init) -> Result<*mut sys::ibv_qp, DropInError> {
    let op = "ibv_create_qp";
    if pd.is_null() || init.send_cq.is_null() || init.recv_cq.is_null() || init.cap.is_null() {
        return Err(invalid(op, "NULL PD or CQ"));
    }
    let ud = match init.qp_type {
        sys::IBV_QPT_RC => false,
        sys::IBV_QPT_UD => true,
        t => return Err(unsupported(op, format!("QP type {t} (RC and UD only)"))),
    };
    // SAFETY: the caller passes live objects of ours.
    let (vpd, scq, rcq, vsrq) =
        unsafe { (VPd::from_ptr(pd), VCq::from_ptr(init.send_cq), VCq::from_ptr(init.recv_cq), (init.srq as *const VSrq).as_ref()) };
    // SAFETY: cap is readable (checked non-NULL).
    let c = unsafe { *init.cap };
    let cap = QpCaps {
        max_send_wr: c.max_send_wr,
        max_recv_wr: if vsrq.is_some() { 0 } else { c.max_recv_wr },
        max_send_sge: c.max_send_sge,
        max_recv_sge: if vsrq.is_some() { 0 } else { c.max_recv_sge },
        max_inline_data: c.max_inline_data,
    };
    let mut attr = if ud { vrdma::QpInitAttr::ud(&scq.inner, &rcq.inner, cap) } else { vrdma::QpInitAttr::rc(&scq.inner, &rcq.inner, cap) };
    attr.srq = vsrq.map(|s| &s.inner);
    // SAFETY: a live PD of ours belongs to an open context of ours.
    let vctx = unsafe { crate::device::VCtx::from_ptr(vpd.pd.context) };
    attr.events = Some(&vctx.events);
    attr.sq_sig_all = init.sq_sig_all;
    let inner = vpd.inner.create_qp(&attr)?;
    let got = inner.cap();
    // SAFETY: cap is writable: libibverbs returns the capabilities granted there.
    unsafe {
        *init.cap = sys::ibv_qp_cap {
            max_send_wr: got.max_send_wr,
            max_recv_wr: got.max_recv_wr,
            max_send_sge: got.max_send_sge,
            max_recv_sge: got.max_recv_sge,
            max_inline_data: got.max_inline_data,
        }
    };
    let qp_base = sys::ibv_qp {
        context: vpd.pd.context,
        qp_context: init.qp_context,
        pd,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        handle: inner.qp_num(),
        qp_num: inner.qp_num(),
        state: sys::IBV_QPS_RESET,
        qp_type: init.qp_type,
        ..Default::default()
    };
    let ex = super::wr::qp_ex(qp_base);
    vpd.users.fetch_add(1, Ordering::AcqRel);
    scq.users.fetch_add(1, Ordering::AcqRel);
    rcq.users.fetch_add(1, Ordering::AcqRel);
    if let Some(s) = vsrq {
        s.users.fetch_add(1, Ordering::AcqRel);
    }
    let p = Box::into_raw(Box::new(VQp {
        ex,
        inner,
        pd: vpd,
        send_cq: scq,
        recv_cq: rcq,
        srq: init.srq as *const VSrq,
        ud,
        sq_sig_all: init.sq_sig_all,
        batch: UnsafeCell::new(Batch::new()),
        batch_lock: vrdma::RawSpinLock::new(),
        events_reported: std::sync::atomic::AtomicU32::new(0),
    }));
    // SAFETY: p is our fresh allocation.
    unsafe { crate::init_sync(&mut (*p).ex.qp_base.mutex, Some(&mut (*p).ex.qp_base.cond)) };
    // SAFETY: as above.
    vctx.qps.lock().insert(unsafe { (*p).ex.qp_base.qp_num }, p as usize);
    Ok(p as *mut sys::ibv_qp)
}

/// `ibv_create_qp`.
///
/// # Safety
/// `pd` is a live PD, `attr` a valid `ibv_qp_init_attr` (its `cap` is updated).
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_qp(pd: *mut sys::ibv_pd, attr: *mut sys::ibv_qp_init_attr) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        if attr.is_null() {
            return ptr(Err(invalid("ibv_create_qp", "NULL attributes")));
        }
        // SAFETY: attr is a valid init structure (checked non-NULL).
        let a = unsafe { &mut *attr };
        ptr(create(pd, &init_of!(a)))
    })
}

/// Send operations the `ibv_wr_*` API supports.
const SEND_OPS: u64 = (sys::IBV_QP_EX_WITH_RDMA_WRITE
    | sys::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | sys::IBV_QP_EX_WITH_SEND
    | sys::IBV_QP_EX_WITH_SEND_WITH_IMM
    | sys::IBV_QP_EX_WITH_RDMA_READ
    | sys::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | sys::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;

/// `verbs_context.create_qp_ex` (the header's inline `ibv_create_qp_ex` with more than a PD).
pub(crate) unsafe extern "C" fn create_qp_ex(_ctx: *mut sys::ibv_context, attr: *mut sys::ibv_qp_init_attr_ex) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        let op = "ibv_create_qp_ex";
        if attr.is_null() {
            return ptr(Err(invalid(op, "NULL attributes")));
        }
        // SAFETY: attr is a valid init structure (checked non-NULL).
        let a = unsafe { &mut *attr };
        let known = sys::IBV_QP_INIT_ATTR_PD | sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | sys::IBV_QP_INIT_ATTR_CREATE_FLAGS;
        if a.comp_mask & !known != 0 {
            return ptr(Err(unsupported(op, format!("comp_mask {:#x}", a.comp_mask & !known))));
        }
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_PD == 0 {
            return ptr(Err(invalid(op, "no PD")));
        }
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
            return ptr(Err(unsupported(op, format!("create_flags {:#x}", a.create_flags))));
        }
        if a.comp_mask & sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 && a.send_ops_flags & !SEND_OPS != 0 {
            return ptr(Err(unsupported(op, format!("send_ops_flags {:#x}", a.send_ops_flags & !SEND_OPS))));
        }
        ptr(create(a.pd, &init_of!(a)))
    })
}

/// `ibv_qp_to_qp_ex`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_qp_to_qp_ex(qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    qp as *mut sys::ibv_qp_ex
}

/// `ibv_destroy_qp`.
///
/// # Safety
/// `qp` is a live QP, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live QP of ours.
    let v = unsafe { VQp::from_ptr(qp) };
    // SAFETY: its context is open (a context is closed after its QPs).
    let vctx = unsafe { crate::device::VCtx::from_ptr(v.ex.qp_base.context) };
    // No event names it from now on; then wait until the application has acknowledged
    // every event it was given about it, as libibverbs does.
    vctx.qps.lock().remove(&v.ex.qp_base.qp_num);
    vctx.events.purge_qp(v.ex.qp_base.qp_num);
    // SAFETY: the QP's mutex and cond were initialised at creation.
    unsafe { wait_events_acknowledged(qp, v.events_reported.load(Ordering::Acquire)) };
    // SAFETY: allocated by Box in create.
    let b = unsafe { Box::from_raw(qp as *mut VQp) };
    // SAFETY: the PD, CQs and SRQ outlive their QPs (destroying them fails while it exists).
    unsafe {
        (*b.pd).users.fetch_sub(1, Ordering::AcqRel);
        (*b.send_cq).users.fetch_sub(1, Ordering::AcqRel);
        (*b.recv_cq).users.fetch_sub(1, Ordering::AcqRel);
        if let Some(s) = b.srq.as_ref() {
            s.users.fetch_sub(1, Ordering::AcqRel);
        }
    }
    drop(b);
    0
}
