//! Protection domains and memory regions.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::device::VCtx;
use crate::sys;
use crate::{guard, invalid, ptr, rc, unsupported, DropInError};

/// A protection domain.
#[repr(C)]
pub struct VPd {
    /// What the application sees.
    pub pd: sys::ibv_pd,
    /// The vrdma PD.
    pub inner: vrdma::Pd,
    /// MRs, QPs, SRQs and AHs using it: deallocating fails with EBUSY until they are gone.
    pub users: AtomicUsize,
}

impl VPd {
    /// The `VPd` of an `ibv_pd` pointer.
    ///
    /// # Safety
    /// `pd` was allocated by our `ibv_alloc_pd` and not deallocated.
    pub unsafe fn from_ptr<'a>(pd: *mut sys::ibv_pd) -> &'a VPd {
        // SAFETY: every ibv_pd we hand out is the first field of a VPd.
        unsafe { &*(pd as *const VPd) }
    }
}

/// `ibv_alloc_pd`.
///
/// # Safety
/// `ctx` is an open context.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_alloc_pd(ctx: *mut sys::ibv_context) -> *mut sys::ibv_pd {
    guard(std::ptr::null_mut(), || {
        ptr((|| {
            if ctx.is_null() {
                return Err(invalid("ibv_alloc_pd", "NULL context"));
            }
            // SAFETY: the caller passes an open context of ours.
            let v = unsafe { VCtx::from_ptr(ctx) };
            let inner = v.ctx.alloc_pd()?;
            let pd = sys::ibv_pd { context: ctx, handle: 0 };
            Ok(Box::into_raw(Box::new(VPd { pd, inner, users: AtomicUsize::new(0) })) as *mut sys::ibv_pd)
        })())
    })
}

/// `ibv_dealloc_pd`: EBUSY while objects use it.
///
/// # Safety
/// `pd` came from `ibv_alloc_pd`.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_dealloc_pd(pd: *mut sys::ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a live PD of ours.
    if unsafe { VPd::from_ptr(pd) }.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: allocated by Box in ibv_alloc_pd.
    drop(unsafe { Box::from_raw(pd as *mut VPd) });
    0
}

/// A memory region.
#[repr(C)]
pub struct VMr {
    /// What the application sees.
    pub mr: sys::ibv_mr,
    inner: vrdma::Mr,
    pd: *const VPd,
}

/// Access flags that only ask for optional behaviour (relaxed ordering): ignored, as a device
/// without them does.
/// (`IBV_ACCESS_OPTIONAL_RANGE`, a macro bindgen cannot evaluate.)
const OPTIONAL_RANGE: u32 = 0x3ff0_0000;

fn reg_mr(pd: *mut sys::ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: u32) -> Result<*mut sys::ibv_mr, DropInError> {
    let op = "ibv_reg_mr";
    if pd.is_null() {
        return Err(invalid(op, "NULL PD"));
    }
    if iova != addr as u64 {
        return Err(unsupported(op, "an IOVA different from the address"));
    }
    let access = access & !OPTIONAL_RANGE;
    let unsupported_flags = access & !(vrdma::access::KNOWN | sys::IBV_ACCESS_MW_BIND | sys::IBV_ACCESS_HUGETLB);
    if unsupported_flags != 0 {
        return Err(unsupported(op, format!("access flags {unsupported_flags:#x}")));
    }
    // SAFETY: the caller passes a live PD of ours.
    let vpd = unsafe { VPd::from_ptr(pd) };
    // SAFETY: the verbs contract: the application keeps [addr, addr+length) allocated until
    // it deregisters the MR.
    let inner = unsafe { vpd.inner.reg_mr(addr as *mut u8, length, access & vrdma::access::KNOWN) }?;
    // SAFETY: pd is live, so is its context.
    let context = unsafe { (*pd).context };
    let mr = sys::ibv_mr { context, pd, addr, length, handle: inner.lkey(), lkey: inner.lkey(), rkey: inner.rkey() };
    vpd.users.fetch_add(1, Ordering::AcqRel);
    Ok(Box::into_raw(Box::new(VMr { mr, inner, pd: vpd })) as *mut sys::ibv_mr)
}

/// `ibv_reg_mr`.
///
/// # Safety
/// `pd` is a live PD; the range stays allocated while registered.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_reg_mr(pd: *mut sys::ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || ptr(reg_mr(pd, addr, length, addr as u64, access as u32)))
}

/// `ibv_reg_mr_iova`.
///
/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_reg_mr_iova(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || ptr(reg_mr(pd, addr, length, iova, access as u32)))
}

/// `ibv_reg_mr_iova2` (what the header's `ibv_reg_mr` macro calls for non-constant access).
///
/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_reg_mr_iova2(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || ptr(reg_mr(pd, addr, length, iova, access)))
}

/// `ibv_dereg_mr`.
///
/// # Safety
/// `mr` came from `ibv_reg_mr` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_dereg_mr(mr: *mut sys::ibv_mr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated by Box in reg_mr.
    let b = unsafe { Box::from_raw(mr as *mut VMr) };
    // SAFETY: the PD outlives its MRs (deallocating it fails while they exist).
    unsafe { &*b.pd }.users.fetch_sub(1, Ordering::AcqRel);
    drop(b);
    0
}

/// `ibv_rereg_mr`: not supported (deregister and register again).
#[no_mangle]
pub extern "C" fn __vrdma_ibv_rereg_mr(
    _mr: *mut sys::ibv_mr,
    _flags: c_int,
    _pd: *mut sys::ibv_pd,
    _addr: *mut c_void,
    _length: usize,
    _access: c_int,
) -> c_int {
    rc(Err(unsupported("ibv_rereg_mr", "re-registration")))
}

/// `ibv_reg_dmabuf_mr`: no dma-bufs.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_reg_dmabuf_mr(
    _pd: *mut sys::ibv_pd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut sys::ibv_mr {
    ptr(Err(unsupported("ibv_reg_dmabuf_mr", "dma-buf memory")))
}
