//! Queue pairs: creation (`ibv_create_qp`, `verbs_context.create_qp_ex`), the state machine
//! (`ibv_modify_qp`, `ibv_query_qp`), posting through the context's `ops` table (the
//! header's inline `ibv_post_send`/`ibv_post_recv`) and the `ibv_qp_ex` work-request API
//! (`ibv_wr_start` … `ibv_wr_complete`, what perftest uses by default).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use vrdma::{QpCaps, RecvWr, SendWr, Sge, WrOpcode};

use crate::ah::VAh;
use crate::cq::VCq;
use crate::mr::VPd;
use crate::srq::VSrq;
use crate::sys;
use crate::{fail, guard, invalid, ptr, reject_wr, unsupported, DropInError};

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

/// A work request of a batch that has several, kept until `ibv_wr_complete` (only the last
/// one started is [`Batch::cur`]).
#[derive(Clone, Copy)]
struct BatchWr {
    wr_id: u64,
    remote_addr: u64,
    compare_add: u64,
    swap: u64,
    flags: u32,
    imm: u32,
    rkey: u32,
    opcode: WrOpcode,
    /// The inline bytes (`Batch::inline[inline.0..inline.1]`) are the WR's data, not `sges`.
    is_inline: bool,
    /// Ranges of `Batch::sges` and `Batch::inline`.
    sges: (u32, u32),
    inline: (u32, u32),
    /// Index + 1 into `Batch::ud` (0: none).
    ud: u32,
}

/// Capacities reserved when the QP is created, so that building the usual batch (a few
/// WRs, a few SGEs, inline data up to a cache line or two) never allocates.
const BATCH_WRS: usize = 16;
const BATCH_SGES: usize = 16;
const BATCH_INLINE: usize = 1024;

/// Inline data up to this size is kept beside the current WR (`CurStore::bytes`).
const SMALL_INLINE: usize = 64;

/// Where the data of the current WR is (what `Batch::spill` copies into the batch's lists).
#[derive(Clone, Copy)]
enum CurData {
    None,
    /// `CurStore::sge`.
    OneSge,
    /// `Batch::sges[a..e]`.
    Sges(u32, u32),
    /// The first `n` bytes of `CurStore::bytes`.
    SmallInline(u32),
    /// `Batch::inline[a..e]`.
    Inline(u32, u32),
}

/// The current WR's gather element and small inline data, at a fixed address (its own
/// allocation) that `Batch::cur.sg_list` points to.
struct CurStore {
    sge: Sge,
    bytes: [u8; SMALL_INLINE],
}

/// The WRs built between `ibv_wr_start` and `ibv_wr_complete`. The last one started is kept
/// in the form `Qp::post_send` takes (`cur`), so the usual batch of one WR is posted as it
/// was built, without being copied again; a second WR first moves the current one into
/// `wrs` (`spill`).
struct Batch {
    /// The WR being built (meaningful while `has_cur`). Its gather list points into
    /// `store`, `sges` or `inline`, whichever `cur_data` names, and is set again whenever
    /// those may have moved (each `ibv_wr_set_*` call sets it after appending).
    cur: SendWr<'static>,
    cur_data: CurData,
    /// Index + 1 into `ud` (0: none).
    cur_ud: u32,
    has_cur: bool,
    store: std::ptr::NonNull<CurStore>,
    /// The WRs before `cur` in a batch of several.
    wrs: Vec<BatchWr>,
    sges: Vec<Sge>,
    inline: Vec<u8>,
    /// UD destinations (`ibv_wr_set_ud_addr`).
    ud: Vec<(*mut sys::ibv_ah, u32, u32)>,
    /// First error of the batch (reported by `ibv_wr_complete`).
    error: c_int,
}

impl Batch {
    fn new() -> Batch {
        let store = Box::new(CurStore { sge: Sge { addr: 0, length: 0, lkey: 0 }, bytes: [0; SMALL_INLINE] });
        Batch {
            cur: SendWr::new(0, WrOpcode::Send, &[], 0),
            cur_data: CurData::None,
            cur_ud: 0,
            has_cur: false,
            store: std::ptr::NonNull::from(Box::leak(store)),
            wrs: Vec::with_capacity(BATCH_WRS),
            sges: Vec::with_capacity(BATCH_SGES),
            inline: Vec::with_capacity(BATCH_INLINE),
            ud: Vec::new(),
            error: 0,
        }
    }

    #[inline]
    fn clear(&mut self) {
        self.has_cur = false;
        self.wrs.clear();
        self.sges.clear();
        self.inline.clear();
        self.ud.clear();
        self.error = 0;
    }

    /// `cur`'s gather list: `n` (0 or 1) elements at `store.sge`.
    #[inline(always)]
    fn point_at_store_sge(&mut self, n: usize) {
        // SAFETY: `store` is our own allocation, alive until the batch is dropped, and the
        // slice is read only through `cur` (by `Qp::post_send`) while the batch lives; it is
        // written only through the raw pointer, never while a post reads it (one builder
        // per QP at a time, verbs contract).
        self.cur.sg_list = unsafe { std::slice::from_raw_parts(&raw const (*self.store.as_ptr()).sge, n) };
    }

    /// Sets or clears `cur`'s INLINE flag with a store of the whole word: a byte-wide store
    /// there (what the compiler would make of `|=`) could not be forwarded to the 4-byte
    /// load of the flags that posting does a few instructions later, which would wait for
    /// the store to reach the cache.
    #[inline(always)]
    fn set_inline_flag(&mut self, on: bool) {
        let f = self.cur.send_flags;
        let f = if on { f | vrdma::send_flags::INLINE } else { f & !vrdma::send_flags::INLINE };
        // SAFETY: a valid, aligned place of ours.
        unsafe { std::ptr::write_volatile(&mut self.cur.send_flags, f) };
    }

    /// Moves the current WR into `wrs` (its data into `sges` or `inline`), before another
    /// WR starts.
    #[cold]
    #[inline(never)]
    fn spill(&mut self) {
        let c = &self.cur;
        let (s, i) = (self.sges.len() as u32, self.inline.len() as u32);
        let (sges, inline, is_inline) = match self.cur_data {
            CurData::None => ((s, s), (i, i), false),
            CurData::OneSge => {
                // SAFETY: our own allocation (see point_at_store_sge).
                self.sges.push(unsafe { (*self.store.as_ptr()).sge });
                ((s, s + 1), (i, i), false)
            }
            CurData::Sges(a, e) => ((a, e), (i, i), false),
            CurData::SmallInline(n) => {
                // SAFETY: our own allocation; n <= SMALL_INLINE (set by wr_set_inline_data).
                let bytes = unsafe { &(&(*self.store.as_ptr()).bytes)[..n as usize] };
                self.inline.extend_from_slice(bytes);
                ((s, s), (i, i + n), true)
            }
            CurData::Inline(a, e) => ((s, s), (a, e), true),
        };
        self.wrs.push(BatchWr {
            wr_id: c.wr_id,
            remote_addr: c.remote_addr,
            compare_add: c.compare_add,
            swap: c.swap,
            flags: c.send_flags,
            imm: c.imm_data,
            rkey: c.rkey,
            opcode: c.opcode,
            is_inline,
            sges,
            inline,
            ud: self.cur_ud,
        });
        self.has_cur = false;
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: `store` came from Box::leak in Batch::new and is freed only here.
        drop(unsafe { Box::from_raw(self.store.as_ptr()) });
    }
}

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
    let ex = sys::ibv_qp_ex {
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
    };
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
        ptr(create(
            pd,
            &Init {
                qp_context: a.qp_context,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                cap: &mut a.cap,
                qp_type: a.qp_type,
                sq_sig_all: a.sq_sig_all != 0,
            },
        ))
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
        ptr(create(
            a.pd,
            &Init {
                qp_context: a.qp_context,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                cap: &mut a.cap,
                qp_type: a.qp_type,
                sq_sig_all: a.sq_sig_all != 0,
            },
        ))
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

/// The QP's mutex and cond (initialised at creation; bindgen's types have libc's layout).
///
/// # Safety
/// `qp` is a live QP of ours.
unsafe fn qp_sync(qp: *mut sys::ibv_qp) -> (*mut libc::pthread_mutex_t, *mut libc::pthread_cond_t) {
    // SAFETY: the caller's contract: both fields are in bounds of a live ibv_qp.
    unsafe { (std::ptr::addr_of_mut!((*qp).mutex).cast(), std::ptr::addr_of_mut!((*qp).cond).cast()) }
}

/// Waits until `reported` events of `qp` are acknowledged (`ibv_qp.events_completed`).
///
/// # Safety
/// `qp` is a live QP of ours.
unsafe fn wait_events_acknowledged(qp: *mut sys::ibv_qp, reported: u32) {
    // SAFETY: the caller's contract; the mutex and cond were initialised at creation.
    unsafe {
        let (m, c) = qp_sync(qp);
        libc::pthread_mutex_lock(m);
        // Read afresh each time: `event_acknowledged` changes it while we wait.
        while std::ptr::read_volatile(std::ptr::addr_of!((*qp).events_completed)) < reported {
            libc::pthread_cond_wait(c, m);
        }
        libc::pthread_mutex_unlock(m);
    }
}

/// `ibv_ack_async_event` of an event of `qp`.
///
/// # Safety
/// `qp` is a live QP of ours that an unacknowledged event named.
pub(crate) unsafe fn event_acknowledged(qp: *mut sys::ibv_qp) {
    // SAFETY: as in wait_events_acknowledged.
    unsafe {
        let (m, c) = qp_sync(qp);
        libc::pthread_mutex_lock(m);
        (*qp).events_completed += 1;
        libc::pthread_cond_signal(c);
        libc::pthread_mutex_unlock(m);
    }
}

fn to_vrdma_attr(a: &sys::ibv_qp_attr) -> vrdma::QpAttr {
    vrdma::QpAttr {
        qp_state: a.qp_state,
        cur_qp_state: a.cur_qp_state,
        path_mtu: a.path_mtu,
        qp_access_flags: a.qp_access_flags,
        pkey_index: a.pkey_index,
        port_num: a.port_num,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        is_global: a.ah_attr.is_global != 0,
        // SAFETY: reading the raw bytes of a GID union is always valid.
        dgid: unsafe { a.ah_attr.grh.dgid.raw },
        sgid_index: a.ah_attr.grh.sgid_index,
        hop_limit: a.ah_attr.grh.hop_limit,
        cap: QpCaps {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        },
    }
}

/// `ibv_modify_qp`: 0 or an errno (EINVAL for a bad transition or mask; ECONNREFUSED or
/// EHOSTUNREACH when vrdmad refuses the connection, explained on stderr).
///
/// # Safety
/// `qp` is a live QP, `attr` readable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_modify_qp(qp: *mut sys::ibv_qp, attr: *mut sys::ibv_qp_attr, mask: c_int) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the caller passes a live QP of ours and readable attributes.
        let (v, a) = unsafe { (VQp::from_ptr(qp), &*attr) };
        match v.inner.modify(&to_vrdma_attr(a), mask as u32) {
            Ok(()) => {
                if mask as u32 & sys::IBV_QP_STATE != 0 {
                    // SAFETY: the application's view of the state, as libibverbs keeps it.
                    unsafe { (*qp).state = a.qp_state };
                }
                0
            }
            Err(e) => fail(&DropInError::from(e)),
        }
    })
}

/// `ibv_query_qp`.
///
/// # Safety
/// `qp` is a live QP, `attr` and `init` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    _mask: c_int,
    init: *mut sys::ibv_qp_init_attr,
) -> c_int {
    if qp.is_null() || attr.is_null() || init.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live QP of ours.
    let v = unsafe { VQp::from_ptr(qp) };
    let q = v.inner.query();
    let cap = sys::ibv_qp_cap {
        max_send_wr: q.cap.max_send_wr,
        max_recv_wr: q.cap.max_recv_wr,
        max_send_sge: q.cap.max_send_sge,
        max_recv_sge: q.cap.max_recv_sge,
        max_inline_data: q.cap.max_inline_data,
    };
    let mut a = sys::ibv_qp_attr {
        qp_state: q.qp_state,
        cur_qp_state: q.cur_qp_state,
        path_mtu: q.path_mtu,
        qkey: q.qkey,
        rq_psn: q.rq_psn,
        sq_psn: q.sq_psn,
        dest_qp_num: q.dest_qp_num,
        qp_access_flags: q.qp_access_flags,
        cap,
        pkey_index: q.pkey_index,
        max_rd_atomic: q.max_rd_atomic,
        max_dest_rd_atomic: q.max_dest_rd_atomic,
        min_rnr_timer: q.min_rnr_timer,
        port_num: q.port_num,
        timeout: q.timeout,
        retry_cnt: q.retry_cnt,
        rnr_retry: q.rnr_retry,
        ..Default::default()
    };
    a.ah_attr.is_global = u8::from(q.is_global);
    a.ah_attr.grh.dgid.raw = q.dgid;
    a.ah_attr.grh.sgid_index = q.sgid_index;
    a.ah_attr.grh.hop_limit = q.hop_limit;
    a.ah_attr.port_num = q.port_num;
    // SAFETY: the out-structures are writable; the QP's fields are ours.
    unsafe {
        *attr = a;
        let b = &v.ex.qp_base;
        *init = sys::ibv_qp_init_attr {
            qp_context: b.qp_context,
            send_cq: b.send_cq,
            recv_cq: b.recv_cq,
            srq: b.srq,
            cap,
            qp_type: b.qp_type,
            sq_sig_all: c_int::from(v.sq_sig_all),
        };
        (*qp).state = q.qp_state;
    }
    0
}

/// `ibv_query_qp_data_in_order`: no guarantee is promised.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_query_qp_data_in_order(_qp: *mut sys::ibv_qp, _op: u32, _flags: u32) -> c_int {
    0
}

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
fn ud_dest(ah: *mut sys::ibv_ah, remote_qpn: u32, remote_qkey: u32) -> Result<vrdma::UdDest, DropInError> {
    // SAFETY: the application passes one of our address handles.
    let ah = unsafe { (ah as *const VAh).as_ref() }.ok_or_else(|| invalid("post_send", "UD work request without an address handle"))?;
    Ok(vrdma::UdDest { dgid: ah.dgid(), qpn: remote_qpn, qkey: remote_qkey })
}

#[inline]
fn post_wr(v: &VQp, wr: &SendWr<'_>, ud: Option<(*mut sys::ibv_ah, u32, u32)>) -> Result<(), DropInError> {
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
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: a list of valid WRs (verbs contract).
        let w = unsafe { &*cur };
        if let Err(e) = post_one(v, w) {
            // SAFETY: bad_wr is the caller's (null or writable).
            return unsafe { reject_wr(bad_wr, cur, &e) };
        }
        cur = w.next;
    }
    0
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

// ---- The ibv_qp_ex work-request API ----

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
