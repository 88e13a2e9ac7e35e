//! Posting through the context's `ops` table (the header's inline `ibv_post_send` and
//! `ibv_post_recv`): the application's WRs translated to vrdma's, gather lists passed
//! without copying, UD destinations from address handles.

use std::ffi::c_int;

use vrdma::{RecvWr, SendWr, Sge, WrOpcode};

use super::{VQp, MAX_SGE};
use crate::ah::VAh;
use crate::sys;
use crate::{invalid, reject_wr, unsupported, DropInError};

// vrdma's Sge is libibverbs' ibv_sge, field for field: lists are passed without copying.
const _: () = {
    assert!(std::mem::size_of::<Sge>() == std::mem::size_of::<sys::ibv_sge>());
    assert!(std::mem::align_of::<Sge>() == std::mem::align_of::<sys::ibv_sge>());
    assert!(std::mem::offset_of!(Sge, addr) == std::mem::offset_of!(sys::ibv_sge, addr));
    assert!(std::mem::offset_of!(Sge, length) == std::mem::offset_of!(sys::ibv_sge, length));
    assert!(std::mem::offset_of!(Sge, lkey) == std::mem::offset_of!(sys::ibv_sge, lkey));
};

/// A WR's scatter/gather list as vrdma's (the same layout; bounded by `MAX_SGE`).
///
/// # Safety
/// `list` has `n` readable entries that stay unchanged while the slice is used (verbs
/// contract: during the post call).
#[inline(always)]
pub(crate) unsafe fn sge_list<'a>(list: *const sys::ibv_sge, n: c_int) -> Result<&'a [Sge], DropInError> {
    if n == 0 {
        return Ok(&[]);
    }
    if n < 0 || n as usize > MAX_SGE || list.is_null() {
        return Err(invalid("post", format!("{n} scatter/gather elements")));
    }
    // SAFETY: n readable entries (caller), and Sge has ibv_sge's layout (asserted above).
    Ok(unsafe { std::slice::from_raw_parts(list as *const Sge, n as usize) })
}

/// The UD destination of a WR.
pub(super) fn ud_dest(ah: *mut sys::ibv_ah, remote_qpn: u32, remote_qkey: u32) -> Result<vrdma::UdDest, DropInError> {
    // SAFETY: the application passes one of our address handles.
    let ah = unsafe { (ah as *const VAh).as_ref() }.ok_or_else(|| invalid("post_send", "UD work request without an address handle"))?;
    Ok(vrdma::UdDest { dgid: ah.dgid(), qpn: remote_qpn, qkey: remote_qkey })
}

#[inline]
pub(super) fn post_wr(v: &VQp, wr: &SendWr<'_>, ud: Option<(*mut sys::ibv_ah, u32, u32)>) -> Result<(), DropInError> {
    if v.ud {
        let (ah, qpn, qkey) = ud.unwrap_or((std::ptr::null_mut(), 0, 0));
        v.inner.post_send_ud(wr, &ud_dest(ah, qpn, qkey)?)?;
    } else {
        v.inner.post_send(wr)?;
    }
    Ok(())
}

#[inline]
fn post_one(v: &VQp, w: &sys::ibv_send_wr) -> Result<(), DropInError> {
    let opcode = WrOpcode::from_u32(w.opcode).ok_or_else(|| unsupported("ibv_post_send", format!("opcode {}", w.opcode)))?;
    // SAFETY: the WR's list has num_sge entries (verbs contract).
    let sges = unsafe { sge_list(w.sg_list, w.num_sge) }?;
    let mut wr = SendWr::new(w.wr_id, opcode, sges, w.send_flags);
    // SAFETY: reading plain-data union members of the WR.
    unsafe {
        wr.imm_data = w.__bindgen_anon_1.imm_data;
        match opcode {
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                let a = &w.wr.atomic;
                wr.remote_addr = a.remote_addr;
                wr.rkey = a.rkey;
                wr.compare_add = a.compare_add;
                wr.swap = a.swap;
            }
            _ if !v.ud => {
                wr.remote_addr = w.wr.rdma.remote_addr;
                wr.rkey = w.wr.rdma.rkey;
            }
            _ => {}
        }
    }
    if !v.ud {
        v.inner.post_send(&wr)?;
        return Ok(());
    }
    // SAFETY: reading plain-data union members (meaningful for UD QPs only).
    let ud_fields = unsafe { (w.wr.ud.ah, w.wr.ud.remote_qpn, w.wr.ud.remote_qkey) };
    post_wr(v, &wr, Some(ud_fields))
}

/// `ops.post_send` (the header's inline `ibv_post_send`).
pub(crate) unsafe extern "C" fn post_send(qp: *mut sys::ibv_qp, wr: *mut sys::ibv_send_wr, bad_wr: *mut *mut sys::ibv_send_wr) -> c_int {
    if !qp.is_null() && !wr.is_null() {
        // SAFETY: the caller passes a live QP of ours and a valid WR.
        let (v, w) = unsafe { (VQp::from_ptr(qp), &*wr) };
        if w.next.is_null() && !v.ud && w.num_sge >= 0 && w.num_sge as usize <= MAX_SGE && !w.sg_list.is_null() {
            // The usual post (one RC WR, not an atomic): straight to Qp::post_send, with the
            // application's own gather list.
            if let Some(
                opcode @ (WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaRead),
            ) = WrOpcode::from_u32(w.opcode)
            {
                // SAFETY: the WR's list has num_sge entries, Sge has ibv_sge's layout (both
                // checked above); plain-data union members of the WR.
                let (sg_list, imm_data, remote_addr, rkey) = unsafe {
                    (
                        std::slice::from_raw_parts(w.sg_list as *const Sge, w.num_sge as usize),
                        w.__bindgen_anon_1.imm_data,
                        w.wr.rdma.remote_addr,
                        w.wr.rdma.rkey,
                    )
                };
                let swr = SendWr {
                    wr_id: w.wr_id,
                    opcode,
                    send_flags: w.send_flags,
                    sg_list,
                    imm_data,
                    remote_addr,
                    rkey,
                    compare_add: 0,
                    swap: 0,
                };
                return match v.inner.post_send(&swr) {
                    Ok(()) => 0,
                    // SAFETY: bad_wr is the caller's (null or writable).
                    Err(e) => unsafe { reject_wr(bad_wr, wr, &DropInError::from(e)) },
                };
            }
        }
    }
    // SAFETY: the caller's arguments, passed on.
    unsafe { post_send_list(qp, wr, bad_wr) }
}

/// `post_send` of a list, UD, atomics, or several elements.
///
/// # Safety
/// As `post_send`.
#[inline(never)]
unsafe fn post_send_list(qp: *mut sys::ibv_qp, wr: *mut sys::ibv_send_wr, bad_wr: *mut *mut sys::ibv_send_wr) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live QP of ours.
    let v = unsafe { VQp::from_ptr(qp) };
    // SAFETY: the caller's list and bad_wr, passed on.
    unsafe { post_each(wr, bad_wr, |w| post_one(v, w)) }
}

/// `ops.post_recv` (the header's inline `ibv_post_recv`).
pub(crate) unsafe extern "C" fn post_recv(qp: *mut sys::ibv_qp, wr: *mut sys::ibv_recv_wr, bad_wr: *mut *mut sys::ibv_recv_wr) -> c_int {
    if !qp.is_null() && !wr.is_null() {
        // SAFETY: the caller passes a live QP of ours and a valid WR.
        let (v, w) = unsafe { (VQp::from_ptr(qp), &*wr) };
        if w.next.is_null() && w.num_sge >= 0 && w.num_sge as usize <= MAX_SGE && !w.sg_list.is_null() {
            // The usual post (one WR, as latency loops repost): no list walk, the
            // application's own scatter list.
            // SAFETY: the WR's list has num_sge entries, Sge has ibv_sge's layout.
            let sg_list = unsafe { std::slice::from_raw_parts(w.sg_list as *const Sge, w.num_sge as usize) };
            // The list call itself: Qp::post_recv would only re-wrap its result.
            return match v.inner.post_recv_list(std::slice::from_ref(&RecvWr { wr_id: w.wr_id, sg_list })) {
                Ok(()) => 0,
                // SAFETY: bad_wr is the caller's (null or writable).
                Err((_, e)) => unsafe { reject_wr(bad_wr, wr, &DropInError::from(e)) },
            };
        }
    }
    // SAFETY: the caller's arguments, passed on.
    unsafe { post_recv_list(qp, wr, bad_wr) }
}

/// `post_recv` of a list, or of several elements.
///
/// # Safety
/// As `post_recv`.
#[inline(never)]
unsafe fn post_recv_list(qp: *mut sys::ibv_qp, wr: *mut sys::ibv_recv_wr, bad_wr: *mut *mut sys::ibv_recv_wr) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live QP of ours.
    let v = unsafe { VQp::from_ptr(qp) };
    let post = |w: &sys::ibv_recv_wr| {
        // SAFETY: the WR's list has num_sge entries.
        unsafe { sge_list(w.sg_list, w.num_sge) }
            .and_then(|sg_list| v.inner.post_recv(&RecvWr { wr_id: w.wr_id, sg_list }).map_err(DropInError::from))
    };
    // SAFETY: the caller's list and bad_wr, passed on.
    unsafe { post_each(wr, bad_wr, post) }
}

/// A WR of the linked lists the post verbs take.
pub(crate) trait LinkedWr {
    /// The WR after this one (null: the last).
    fn next(&self) -> *mut Self;
}

impl LinkedWr for sys::ibv_send_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

impl LinkedWr for sys::ibv_recv_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

/// Posts the WRs of the list at `first` in order with `post`; at the first that fails,
/// points `*bad_wr` at it and returns its errno (0 when all were posted).
///
/// # Safety
/// `first` is null or a list of valid WRs (verbs contract); `bad_wr` is null or writable.
#[inline(always)]
pub(crate) unsafe fn post_each<W: LinkedWr>(
    first: *mut W,
    bad_wr: *mut *mut W,
    mut post: impl FnMut(&W) -> Result<(), DropInError>,
) -> c_int {
    let mut cur = first;
    while !cur.is_null() {
        // SAFETY: a list of valid WRs (the caller's contract).
        let w = unsafe { &*cur };
        if let Err(e) = post(w) {
            // SAFETY: bad_wr is the caller's (null or writable).
            return unsafe { reject_wr(bad_wr, cur, &e) };
        }
        cur = w.next();
    }
    0
}
