//! The `ibv_qp_ex` work-request API (`ibv_wr_start` … `ibv_wr_complete`, what perftest
//! uses by default): entry points that build WRs into the QP's batch and post them.

use std::ffi::{c_int, c_void};

use vrdma::{SendWr, Sge, WrOpcode};

use super::batch::{Batch, BatchWr, CurData, SMALL_INLINE};
use super::post::{post_wr, ud_dest};
use super::{VQp, MAX_SGE};
use crate::sys;
use crate::{fail, invalid, unsupported, DropInError};

/// The `ibv_qp_ex` of a new QP: `qp_base`, and this API's entry points.
pub(super) fn qp_ex(qp_base: sys::ibv_qp) -> sys::ibv_qp_ex {
    sys::ibv_qp_ex {
        qp_base,
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: Some(wr_bind_mw),
        wr_local_inv: Some(wr_local_inv),
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: Some(wr_send_inv),
        wr_send_tso: Some(wr_send_tso),
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: Some(wr_set_xrc_srqn),
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: Some(wr_atomic_write),
        ..Default::default()
    }
}

/// The batch of a QP.
///
/// # Safety
/// `qp` is a live QP of ours, and this thread holds its `batch_lock` (taken by
/// `ibv_wr_start`: the other `ibv_wr_*` calls are made between it and `ibv_wr_complete` or
/// `ibv_wr_abort`, verbs contract), or is about to take or release it.
#[allow(clippy::mut_from_ref)]
unsafe fn batch<'a>(qp: *mut sys::ibv_qp_ex) -> (&'a VQp, &'a mut Batch) {
    // SAFETY: the caller's contract.
    let v = unsafe { VQp::from_ptr(qp as *mut sys::ibv_qp) };
    // SAFETY: the batch lock makes this thread the only builder, so this is the only
    // reference.
    (v, unsafe { &mut *v.batch.get() })
}

/// Starts a WR: the current one, if any, moves into the batch's list first.
#[inline(always)]
fn begin(qp: *mut sys::ibv_qp_ex, opcode: WrOpcode, remote: (u32, u64), atomic: (u64, u64), imm: u32) {
    // SAFETY: called by the ibv_wr_* entry points with the application's QP.
    let (v, b) = unsafe { batch(qp) };
    if b.has_cur {
        // Out of line, so that the usual path saves no registers.
        return begin_next(qp, opcode, remote, atomic, imm);
    }
    b.cur = SendWr {
        wr_id: v.ex.wr_id,
        opcode,
        send_flags: v.ex.wr_flags & !vrdma::send_flags::INLINE,
        sg_list: &[],
        imm_data: imm,
        remote_addr: remote.1,
        rkey: remote.0,
        compare_add: atomic.0,
        swap: atomic.1,
    };
    b.cur_data = CurData::None;
    b.cur_ud = 0;
    b.has_cur = true;
}

/// `begin` of a batch's second or later WR.
#[cold]
#[inline(never)]
fn begin_next(qp: *mut sys::ibv_qp_ex, opcode: WrOpcode, remote: (u32, u64), atomic: (u64, u64), imm: u32) {
    // SAFETY: called by begin with the application's QP.
    unsafe { batch(qp) }.1.spill();
    begin(qp, opcode, remote, atomic, imm)
}

#[cold]
fn batch_error(qp: *mut sys::ibv_qp_ex, e: DropInError) {
    // SAFETY: called by the ibv_wr_* entry points with the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if b.error == 0 {
        b.error = fail(&e);
    }
}

unsafe extern "C" fn wr_start(qp: *mut sys::ibv_qp_ex) {
    // SAFETY: the application's QP.
    unsafe { VQp::from_ptr(qp as *mut sys::ibv_qp) }.lock_batch();
    // SAFETY: the application's QP, its batch lock now held.
    unsafe { batch(qp) }.1.clear();
}

unsafe extern "C" fn wr_abort(qp: *mut sys::ibv_qp_ex) {
    // SAFETY: the application's QP, its batch lock held since ibv_wr_start.
    let (v, b) = unsafe { batch(qp) };
    b.clear();
    v.unlock_batch();
}

/// The `SendWr` of a built WR (its lists are the batch's).
#[inline(always)]
fn send_wr_of<'a>(b: &'a Batch, w: &BatchWr, inline_sge: &'a mut [Sge; 1]) -> SendWr<'a> {
    let (sg, flags): (&[Sge], u32) = if w.is_inline {
        let (s, e) = (w.inline.0 as usize, w.inline.1 as usize);
        // SAFETY: s <= e <= inline.len(): the range was recorded when the bytes were appended.
        *inline_sge = [Sge { addr: unsafe { b.inline.as_ptr().add(s) } as u64, length: (e - s) as u32, lkey: 0 }];
        (&inline_sge[..usize::from(e > s)], w.flags | vrdma::send_flags::INLINE)
    } else {
        (&b.sges[w.sges.0 as usize..w.sges.1 as usize], w.flags & !vrdma::send_flags::INLINE)
    };
    SendWr {
        wr_id: w.wr_id,
        opcode: w.opcode,
        send_flags: flags,
        sg_list: sg,
        imm_data: w.imm,
        remote_addr: w.remote_addr,
        rkey: w.rkey,
        compare_add: w.compare_add,
        swap: w.swap,
    }
}

/// Whether one built WR would be posted (`Qp::check_send`, and a UD WR's address handle).
fn check_built(v: &VQp, b: &Batch, w: &BatchWr) -> Result<(), DropInError> {
    let mut inline_sge = [Sge { addr: 0, length: 0, lkey: 0 }];
    v.inner.check_send(&send_wr_of(b, w, &mut inline_sge))?;
    if v.ud {
        let (ah, qpn, qkey) = w.ud.checked_sub(1).map_or((std::ptr::null_mut(), 0, 0), |i| b.ud[i as usize]);
        ud_dest(ah, qpn, qkey)?;
    }
    Ok(())
}

/// Posts one built WR.
fn post_built(v: &VQp, b: &Batch, w: &BatchWr) -> Result<(), DropInError> {
    let mut inline_sge = [Sge { addr: 0, length: 0, lkey: 0 }];
    let wr = send_wr_of(b, w, &mut inline_sge);
    if !v.ud {
        v.inner.post_send(&wr)?;
        return Ok(());
    }
    let ud = w.ud.checked_sub(1).map(|i| b.ud[i as usize]);
    post_wr(v, &wr, ud)
}

unsafe extern "C" fn wr_complete(qp: *mut sys::ibv_qp_ex) -> c_int {
    // SAFETY: the application's QP.
    let (v, b) = unsafe { batch(qp) };
    if b.error == 0 && b.has_cur && b.wrs.is_empty() && !v.ud {
        // The usual batch (one RC WR, as latency loops post): posted as built.
        let r = v.inner.post_send(&b.cur);
        b.clear();
        v.unlock_batch();
        return match r {
            Ok(()) => 0,
            Err(e) => fail(&DropInError::from(e)),
        };
    }
    wr_complete_batch(v, b)
}

/// `ibv_wr_complete` of anything but one RC WR.
#[inline(never)]
fn wr_complete_batch(v: &VQp, b: &mut Batch) -> c_int {
    let mut result = b.error;
    if result == 0 && b.has_cur {
        b.spill();
    }
    // A batch is posted entirely or not at all (ibv_wr_post(3)): every WR is checked before
    // the first is posted. (Only a send queue that fills up halfway is not foreseen.)
    if result == 0 {
        if let Some(e) = b.wrs.iter().find_map(|w| check_built(v, b, w).err()) {
            result = fail(&e);
        }
    }
    if result == 0 {
        for w in &b.wrs {
            if let Err(e) = post_built(v, b, w) {
                result = fail(&e);
                break;
            }
        }
    }
    b.clear();
    v.unlock_batch();
    result
}

unsafe extern "C" fn wr_send(qp: *mut sys::ibv_qp_ex) {
    begin(qp, WrOpcode::Send, (0, 0), (0, 0), 0);
}

unsafe extern "C" fn wr_send_imm(qp: *mut sys::ibv_qp_ex, imm: u32) {
    begin(qp, WrOpcode::SendWithImm, (0, 0), (0, 0), imm);
}

unsafe extern "C" fn wr_rdma_write(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64) {
    begin(qp, WrOpcode::RdmaWrite, (rkey, remote_addr), (0, 0), 0);
}

unsafe extern "C" fn wr_rdma_write_imm(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64, imm: u32) {
    begin(qp, WrOpcode::RdmaWriteWithImm, (rkey, remote_addr), (0, 0), imm);
}

unsafe extern "C" fn wr_rdma_read(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64) {
    begin(qp, WrOpcode::RdmaRead, (rkey, remote_addr), (0, 0), 0);
}

unsafe extern "C" fn wr_atomic_cmp_swp(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64, compare: u64, swap: u64) {
    begin(qp, WrOpcode::AtomicCmpAndSwp, (rkey, remote_addr), (compare, swap), 0);
}

unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut sys::ibv_qp_ex, rkey: u32, remote_addr: u64, add: u64) {
    begin(qp, WrOpcode::AtomicFetchAndAdd, (rkey, remote_addr), (add, 0), 0);
}

unsafe extern "C" fn wr_bind_mw(qp: *mut sys::ibv_qp_ex, _mw: *mut sys::ibv_mw, _rkey: u32, _info: *const sys::ibv_mw_bind_info) {
    batch_error(qp, unsupported("ibv_wr_bind_mw", "memory windows"));
}

unsafe extern "C" fn wr_local_inv(qp: *mut sys::ibv_qp_ex, _rkey: u32) {
    batch_error(qp, unsupported("ibv_wr_local_inv", "memory windows"));
}

unsafe extern "C" fn wr_send_inv(qp: *mut sys::ibv_qp_ex, _rkey: u32) {
    batch_error(qp, unsupported("ibv_wr_send_inv", "memory windows"));
}

unsafe extern "C" fn wr_send_tso(qp: *mut sys::ibv_qp_ex, _hdr: *mut c_void, _hdr_sz: u16, _mss: u16) {
    batch_error(qp, unsupported("ibv_wr_send_tso", "TSO (raw packet QPs)"));
}

unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut sys::ibv_qp_ex, _srqn: u32) {
    batch_error(qp, unsupported("ibv_wr_set_xrc_srqn", "XRC"));
}

unsafe extern "C" fn wr_atomic_write(qp: *mut sys::ibv_qp_ex, _rkey: u32, _addr: u64, _data: *const c_void) {
    batch_error(qp, unsupported("ibv_wr_atomic_write", "atomic write"));
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut sys::ibv_qp_ex, ah: *mut sys::ibv_ah, remote_qpn: u32, remote_qkey: u32) {
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if !b.has_cur {
        return batch_error(qp, invalid("ibv_wr_set_ud_addr", "no work request started"));
    }
    b.ud.push((ah, remote_qpn, remote_qkey));
    b.cur_ud = b.ud.len() as u32;
}

unsafe extern "C" fn wr_set_sge(qp: *mut sys::ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if !b.has_cur {
        return batch_error(qp, invalid("ibv_wr_set_sge", "no work request started"));
    }
    // SAFETY: our own allocation, not read meanwhile (see Batch::point_at_store_sge).
    unsafe { (*b.store.as_ptr()).sge = Sge { addr, length, lkey } };
    b.point_at_store_sge(1);
    b.set_inline_flag(false);
    b.cur_data = CurData::OneSge;
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut sys::ibv_qp_ex, n: usize, list: *const sys::ibv_sge) {
    if n > MAX_SGE || (n > 0 && list.is_null()) {
        return batch_error(qp, invalid("ibv_wr_set_sge_list", format!("{n} scatter/gather elements")));
    }
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if !b.has_cur {
        return batch_error(qp, invalid("ibv_wr_set_sge_list", "no work request started"));
    }
    let start = b.sges.len();
    b.sges.extend((0..n).map(|i| {
        // SAFETY: the caller's list has n entries.
        let s = unsafe { &*list.add(i) };
        Sge { addr: s.addr, length: s.length, lkey: s.lkey }
    }));
    // SAFETY: the elements just appended; `sges` is not appended to again before this WR
    // is posted or spilled (which records the range instead).
    b.cur.sg_list = unsafe { std::slice::from_raw_parts(b.sges.as_ptr().add(start), n) };
    b.set_inline_flag(false);
    b.cur_data = CurData::Sges(start as u32, b.sges.len() as u32);
}

/// Copies inline data for the current WR (the application may reuse its buffers at once)
/// into the batch's inline buffer.
#[inline(never)]
fn set_inline(qp: *mut sys::ibv_qp_ex, bufs: &[(*const u8, usize)]) {
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if !b.has_cur {
        return batch_error(qp, invalid("ibv_wr_set_inline_data", "no work request started"));
    }
    if bufs.iter().any(|&(p, n)| n > 0 && p.is_null()) {
        return batch_error(qp, invalid("ibv_wr_set_inline_data", "NULL buffer"));
    }
    let start = b.inline.len();
    for &(p, n) in bufs {
        if n > 0 {
            // SAFETY: the caller's buffer has n readable bytes that cannot overlap ours.
            b.inline.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
        }
    }
    let end = b.inline.len();
    // SAFETY: our own allocation, not read meanwhile (see Batch::point_at_store_sge); the
    // bytes stay where they are until this WR is posted or spilled (nothing else appends).
    unsafe {
        (*b.store.as_ptr()).sge = Sge { addr: b.inline.as_ptr().add(start) as u64, length: (end - start) as u32, lkey: 0 };
    }
    b.point_at_store_sge(usize::from(end > start));
    b.set_inline_flag(true);
    b.cur_data = CurData::Inline(start as u32, end as u32);
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut sys::ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if b.has_cur && (8..=16).contains(&length) && !addr.is_null() {
        // The latency tests' case, with no call (so no registers to save): two overlapping
        // 8-byte moves into the bytes beside the WR.
        // SAFETY: the application's buffer has `length` readable bytes; `store` is our own
        // allocation with room for SMALL_INLINE >= 16 bytes, not read meanwhile.
        unsafe {
            small_inline(b, addr as *const u8, length, |p, d| {
                std::ptr::write_unaligned(d as *mut u64, std::ptr::read_unaligned(p as *const u64));
                std::ptr::write_unaligned(d.add(length - 8) as *mut u64, std::ptr::read_unaligned(p.add(length - 8) as *const u64));
            })
        };
        return;
    }
    set_inline_other(qp, addr as *const u8, length)
}

/// `ibv_wr_set_inline_data` of other lengths.
#[inline(never)]
fn set_inline_other(qp: *mut sys::ibv_qp_ex, addr: *const u8, length: usize) {
    // SAFETY: the application's QP.
    let (_, b) = unsafe { batch(qp) };
    if b.has_cur && length <= SMALL_INLINE && (length == 0 || !addr.is_null()) {
        // SAFETY: as in wr_set_inline_data: `length` readable bytes at addr, room for
        // SMALL_INLINE bytes in `store`.
        unsafe { small_inline(b, addr, length, |p, d| std::ptr::copy_nonoverlapping(p, d, length)) };
        return;
    }
    set_inline(qp, &[(addr, length)]);
}

/// Makes `length` (<= SMALL_INLINE) bytes at `addr`, copied by `copy(addr, destination)`,
/// the current WR's inline data.
///
/// # Safety
/// `b.has_cur`; `addr` has `length` readable bytes (or `length` is 0); `copy` writes at most
/// `length` bytes.
#[inline(always)]
unsafe fn small_inline(b: &mut Batch, addr: *const u8, length: usize, copy: impl FnOnce(*const u8, *mut u8)) {
    let st = b.store.as_ptr();
    // SAFETY: `store` is our own allocation with room for SMALL_INLINE bytes, not read
    // meanwhile; the caller's contract covers the source.
    let d = unsafe { (&raw mut (*st).bytes) as *mut u8 };
    if length > 0 {
        copy(addr, d);
    }
    // SAFETY: as above.
    unsafe { (*st).sge = Sge { addr: d as u64, length: length as u32, lkey: 0 } };
    b.point_at_store_sge(usize::from(length > 0));
    b.set_inline_flag(true);
    b.cur_data = CurData::SmallInline(length as u32);
}

unsafe extern "C" fn wr_set_inline_data_list(qp: *mut sys::ibv_qp_ex, n: usize, list: *const sys::ibv_data_buf) {
    if n > 0 && list.is_null() {
        return batch_error(qp, invalid("ibv_wr_set_inline_data_list", "NULL list"));
    }
    // SAFETY: the caller's list has n entries.
    let bufs: Vec<(*const u8, usize)> = (0..n).map(|i| unsafe { ((*list.add(i)).addr as *const u8, (*list.add(i)).length) }).collect();
    set_inline(qp, &bufs);
}
