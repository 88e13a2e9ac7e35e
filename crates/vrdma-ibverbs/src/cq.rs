//! Completion queues, completion channels and CQ events.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use vrdma::Wc;

use crate::device::VCtx;
use crate::sys;
use crate::{fail, guard, invalid, ptr, rc, set_errno, DropInError};

/// A completion channel.
#[repr(C)]
pub struct VChannel {
    /// What the application sees (`fd` is pollable: it becomes readable with an event).
    pub ch: sys::ibv_comp_channel,
    inner: vrdma::CompChannel,
    /// CQs delivering events here, by handle (`VCq` addresses).
    cqs: Mutex<HashMap<u32, usize>>,
}

/// A completion queue.
#[repr(C)]
pub struct VCq {
    /// What the application sees.
    pub cq: sys::ibv_cq,
    /// The vrdma CQ.
    pub inner: vrdma::Cq,
    channel: *mut VChannel,
    /// QPs using it: destroying fails with EBUSY until they are gone.
    pub users: AtomicUsize,
}

impl VCq {
    /// The `VCq` of an `ibv_cq` pointer.
    ///
    /// # Safety
    /// `cq` was created by our `ibv_create_cq` and not destroyed.
    pub unsafe fn from_ptr<'a>(cq: *mut sys::ibv_cq) -> &'a VCq {
        // SAFETY: every ibv_cq we hand out is the first field of a VCq.
        unsafe { &*(cq as *const VCq) }
    }
}

/// `ibv_create_comp_channel`.
///
/// # Safety
/// `ctx` is an open context.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_comp_channel(ctx: *mut sys::ibv_context) -> *mut sys::ibv_comp_channel {
    guard(std::ptr::null_mut(), || {
        ptr((|| {
            if ctx.is_null() {
                return Err(invalid("ibv_create_comp_channel", "NULL context"));
            }
            // SAFETY: the caller passes an open context of ours.
            let v = unsafe { VCtx::from_ptr(ctx) };
            let inner = v.ctx.create_comp_channel()?;
            let ch = sys::ibv_comp_channel { context: ctx, fd: inner.fd(), refcnt: 0 };
            Ok(Box::into_raw(Box::new(VChannel { ch, inner, cqs: Mutex::new(HashMap::new()) })) as *mut sys::ibv_comp_channel)
        })())
    })
}

/// `ibv_destroy_comp_channel`: EBUSY while CQs still use it.
///
/// # Safety
/// `ch` came from `ibv_create_comp_channel`.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_destroy_comp_channel(ch: *mut sys::ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return libc::EINVAL;
    }
    let v = ch as *mut VChannel;
    // SAFETY: every channel we hand out is a VChannel.
    if !unsafe { &*v }.cqs.lock().is_empty() {
        return libc::EBUSY;
    }
    // SAFETY: allocated by Box in ibv_create_comp_channel.
    drop(unsafe { Box::from_raw(v) });
    0
}

/// `ibv_create_cq`.
///
/// # Safety
/// `ctx` is an open context, `channel` NULL or a channel of it.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_cq(
    ctx: *mut sys::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut sys::ibv_cq {
    guard(std::ptr::null_mut(), || {
        ptr((|| {
            let op = "ibv_create_cq";
            if ctx.is_null() {
                return Err(invalid(op, "NULL context"));
            }
            // SAFETY: the caller passes an open context of ours.
            let v = unsafe { VCtx::from_ptr(ctx) };
            let max = v.ctx.query_device().max_cqe;
            if cqe < 1 || cqe as u32 > max {
                return Err(invalid(op, format!("cqe {cqe} is not in 1..={max}")));
            }
            let ch = channel as *mut VChannel;
            // SAFETY: channel is NULL or one of ours (a VChannel).
            let inner = v.ctx.create_cq(cqe as u32, unsafe { ch.as_ref() }.map(|c| &c.inner))?;
            let cq = sys::ibv_cq { context: ctx, channel, cq_context, handle: inner.handle(), cqe, ..Default::default() };
            let handle = inner.handle();
            let p = Box::into_raw(Box::new(VCq { cq, inner, channel: ch, users: AtomicUsize::new(0) }));
            // SAFETY: p is our fresh allocation.
            unsafe { crate::init_sync(&mut (*p).cq.mutex, Some(&mut (*p).cq.cond)) };
            // SAFETY: channel is NULL or one of ours.
            if let Some(c) = unsafe { ch.as_ref() } {
                c.cqs.lock().insert(handle, p as usize);
            }
            Ok(p as *mut sys::ibv_cq)
        })())
    })
}

/// `ibv_destroy_cq`: EBUSY while QPs still use it.
///
/// # Safety
/// `cq` came from `ibv_create_cq` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_destroy_cq(cq: *mut sys::ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    let p = cq as *mut VCq;
    // SAFETY: every CQ we hand out is a VCq.
    let v = unsafe { &*p };
    if v.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: the channel outlives its CQs (destroying it fails while they exist).
    if let Some(c) = unsafe { v.channel.as_ref() } {
        c.cqs.lock().remove(&v.inner.handle());
    }
    // SAFETY: allocated by Box in ibv_create_cq.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `ibv_resize_cq`: vrdma CQs have a fixed size.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_resize_cq(_cq: *mut sys::ibv_cq, _cqe: c_int) -> c_int {
    rc(Err(crate::unsupported("ibv_resize_cq", "CQs cannot be resized")))
}

/// Converts a vrdma completion into the application's `ibv_wc`.
#[inline]
pub fn to_ibv_wc(w: &Wc) -> sys::ibv_wc {
    sys::ibv_wc {
        wr_id: w.wr_id,
        status: w.status as u32,
        opcode: w.opcode as u32,
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        __bindgen_anon_1: sys::ibv_wc__bindgen_ty_1 { imm_data: w.imm_data },
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// `ops.poll_cq` (the header's inline `ibv_poll_cq`).
pub(crate) unsafe extern "C" fn poll_cq(cq: *mut sys::ibv_cq, num_entries: c_int, wc: *mut sys::ibv_wc) -> c_int {
    if cq.is_null() || num_entries < 0 || (wc.is_null() && num_entries > 0) {
        return -1;
    }
    // SAFETY: the caller passes a live CQ of ours.
    let v = unsafe { VCq::from_ptr(cq) };
    // Straight into the application's array, converted on the way: no intermediate buffer.
    // SAFETY: the caller provides room for num_entries completions, and i < num_entries.
    v.inner.poll_with(num_entries as usize, |i, w| unsafe { wc.add(i).write(to_ibv_wc(&w)) }) as c_int
}

/// `ops.req_notify_cq` (the header's inline `ibv_req_notify_cq`).
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut sys::ibv_cq, solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live CQ of ours.
    let v = unsafe { VCq::from_ptr(cq) };
    if v.channel.is_null() {
        // Arming a CQ without a channel is allowed; no event can be delivered.
        return 0;
    }
    rc(v.inner.req_notify(solicited_only != 0).map_err(DropInError::from))
}

/// `ibv_get_cq_event`: waits for the next event of one of the channel's CQs (or fails with
/// EAGAIN at once if the application made the channel's fd non-blocking).
///
/// # Safety
/// `ch` is a live channel; `cq` and `cq_context` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_get_cq_event(
    ch: *mut sys::ibv_comp_channel,
    cq: *mut *mut sys::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if ch.is_null() || cq.is_null() || cq_context.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: every channel we hand out is a VChannel.
    let v = unsafe { &*(ch as *const VChannel) };
    // SAFETY: F_GETFL on the channel's fd.
    let nonblock = unsafe { libc::fcntl(v.ch.fd, libc::F_GETFL) } & libc::O_NONBLOCK != 0;
    loop {
        match v.inner.get_cq_event(nonblock.then_some(Duration::ZERO)) {
            Ok(Some(c)) => {
                let Some(&p) = v.cqs.lock().get(&c.handle()) else { continue };
                let p = p as *mut sys::ibv_cq;
                // SAFETY: registered CQs are live VCqs; the out-pointers are writable.
                unsafe {
                    *cq = p;
                    *cq_context = (*p).cq_context;
                }
                return 0;
            }
            Ok(None) => {
                set_errno(libc::EAGAIN);
                return -1;
            }
            Err(e) => {
                set_errno(fail(&DropInError::from(e)));
                return -1;
            }
        }
    }
}

/// `ibv_ack_cq_events`.
///
/// # Safety
/// `cq` is a live CQ.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_ack_cq_events(cq: *mut sys::ibv_cq, nevents: u32) {
    if cq.is_null() {
        return;
    }
    let p = cq as *mut VCq;
    // SAFETY: the caller passes a live CQ of ours; its counter is updated under its mutex, as
    // libibverbs does, and waiters on its condition are woken.
    unsafe {
        let m = &mut (*p).cq.mutex as *mut sys::pthread_mutex_t as *mut libc::pthread_mutex_t;
        libc::pthread_mutex_lock(m);
        (*p).cq.comp_events_completed = (*p).cq.comp_events_completed.wrapping_add(nevents);
        libc::pthread_cond_signal(&mut (*p).cq.cond as *mut sys::pthread_cond_t as *mut libc::pthread_cond_t);
        libc::pthread_mutex_unlock(m);
        (*p).inner.ack_events(nevents);
    }
}
