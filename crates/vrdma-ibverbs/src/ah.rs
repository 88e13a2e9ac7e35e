//! Address handles (UD destinations), and building them from a received completion's GRH.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use crate::device::VCtx;
use crate::mr::VPd;
use crate::sys;
use crate::{fail, guard, invalid, ptr, set_errno, unsupported, DropInError};

/// An address handle.
#[repr(C)]
pub struct VAh {
    /// What the application sees.
    pub ah: sys::ibv_ah,
    attr: sys::ibv_ah_attr,
    pd: *const VPd,
}

impl VAh {
    /// The destination GID.
    pub fn dgid(&self) -> [u8; 16] {
        // SAFETY: reading the raw bytes of a GID union is always valid.
        unsafe { self.attr.grh.dgid.raw }
    }
}

fn create(pd: *mut sys::ibv_pd, attr: *const sys::ibv_ah_attr) -> Result<*mut sys::ibv_ah, DropInError> {
    let op = "ibv_create_ah";
    if pd.is_null() || attr.is_null() {
        return Err(invalid(op, "NULL PD or attributes"));
    }
    // SAFETY: the caller passes a live PD of ours and readable attributes.
    let (vpd, a) = unsafe { (VPd::from_ptr(pd), *attr) };
    if a.is_global == 0 {
        return Err(invalid(op, "RoCE address handles need a GRH (is_global) with the destination GID"));
    }
    if a.port_num != 1 {
        return Err(invalid(op, format!("port {} does not exist", a.port_num)));
    }
    if usize::from(a.grh.sgid_index) >= vpd.inner.context().gids().len() {
        return Err(invalid(op, format!("sgid_index {} out of range", a.grh.sgid_index)));
    }
    // Like a NIC resolving the destination's address: a GID this vNIC may not reach (another
    // tenant, no such vNIC) fails here, not silently on every send.
    // SAFETY: reading the raw bytes of a GID union is always valid.
    vpd.inner.context().check_gid(unsafe { a.grh.dgid.raw })?;
    vpd.users.fetch_add(1, Ordering::AcqRel);
    let ah = sys::ibv_ah { context: vpd.pd.context, pd, handle: 0 };
    Ok(Box::into_raw(Box::new(VAh { ah, attr: a, pd: vpd })) as *mut sys::ibv_ah)
}

/// `ibv_create_ah`.
///
/// # Safety
/// `pd` is a live PD, `attr` readable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_ah(pd: *mut sys::ibv_pd, attr: *mut sys::ibv_ah_attr) -> *mut sys::ibv_ah {
    guard(std::ptr::null_mut(), || ptr(create(pd, attr)))
}

/// `ibv_destroy_ah`.
///
/// # Safety
/// `ah` is a live address handle, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_destroy_ah(ah: *mut sys::ibv_ah) -> c_int {
    if ah.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: allocated by Box in create.
    let b = unsafe { Box::from_raw(ah as *mut VAh) };
    // SAFETY: the PD outlives its AHs.
    unsafe { &*b.pd }.users.fetch_sub(1, Ordering::AcqRel);
    drop(b);
    0
}

/// `ibv_init_ah_from_wc`: the address of the sender of a UD receive, from the GRH vrdma
/// writes at the start of every UD receive buffer (IB layout: the sender's GID at byte 8,
/// ours at byte 24).
///
/// # Safety
/// `ctx` is an open context, `wc` and `grh` readable, `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_init_ah_from_wc(
    ctx: *mut sys::ibv_context,
    port: u8,
    wc: *mut sys::ibv_wc,
    grh: *mut sys::ibv_grh,
    attr: *mut sys::ibv_ah_attr,
) -> c_int {
    if ctx.is_null() || wc.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes readable completions and a writable attribute structure.
    let (w, out) = unsafe { (&*wc, &mut *attr) };
    *out = sys::ibv_ah_attr { dlid: w.slid, sl: w.sl, src_path_bits: w.dlid_path_bits, port_num: port, ..Default::default() };
    if w.wc_flags & sys::IBV_WC_GRH == 0 || grh.is_null() {
        let e = invalid("ibv_init_ah_from_wc", "RoCE needs the completion's GRH");
        set_errno(fail(&e));
        return -1;
    }
    // SAFETY: grh is readable (checked non-NULL).
    let g = unsafe { *grh };
    let flow = u32::from_be(g.version_tclass_flow);
    out.is_global = 1;
    out.grh.dgid = g.sgid;
    out.grh.flow_label = flow & 0xfffff;
    out.grh.traffic_class = ((flow >> 20) & 0xff) as u8;
    out.grh.hop_limit = 0xff;
    // SAFETY: the caller passes an open context of ours; GID unions are plain bytes.
    let gids = unsafe { VCtx::from_ptr(ctx) }.ctx.gids().to_vec();
    // SAFETY: as above.
    let mine = unsafe { g.dgid.raw };
    match gids.iter().position(|x| *x == mine) {
        Some(i) => {
            out.grh.sgid_index = i as u8;
            0
        }
        None => {
            let e = invalid("ibv_init_ah_from_wc", "the GRH's destination GID is not in the GID table");
            set_errno(fail(&e));
            -1
        }
    }
}

/// `ibv_create_ah_from_wc`.
///
/// # Safety
/// As `ibv_init_ah_from_wc`, with a live PD.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_create_ah_from_wc(
    pd: *mut sys::ibv_pd,
    wc: *mut sys::ibv_wc,
    grh: *mut sys::ibv_grh,
    port: u8,
) -> *mut sys::ibv_ah {
    if pd.is_null() {
        return ptr(Err(invalid("ibv_create_ah_from_wc", "NULL PD")));
    }
    let mut attr = sys::ibv_ah_attr::default();
    // SAFETY: pd is live, so is its context; the rest is the caller's contract.
    if unsafe { __vrdma_ibv_init_ah_from_wc((*pd).context, port, wc, grh, &mut attr) } != 0 {
        return std::ptr::null_mut();
    }
    guard(std::ptr::null_mut(), || ptr(create(pd, &attr)))
}

/// `ibv_resolve_eth_l2_from_gid`: vNICs have no Ethernet layer to resolve.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_resolve_eth_l2_from_gid(
    _ctx: *mut sys::ibv_context,
    _attr: *mut sys::ibv_ah_attr,
    _eth_mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    crate::rc(Err(unsupported("ibv_resolve_eth_l2_from_gid", "Ethernet L2 addresses")))
}
