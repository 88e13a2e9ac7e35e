//! Devices and contexts: the device list (the vNIC this process can reach), `ibv_open_device`
//! with its `verbs_context`, and the query verbs (device, port, GID table, P_Key table).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::AsRawFd;
use std::path::Path;

use parking_lot::Mutex;

use crate::sys;
use crate::{fail, guard, invalid, ptr, rc, set_errno, DropInError};

/// Vendor ID reported by default ("VR"); `VRDMA_IBV_VENDOR_ID` overrides it.
pub const VENDOR_ID: u32 = 0x5652;
/// Largest number of address handles.
pub const MAX_AH: i32 = 1 << 16;

/// A device: the vNIC behind `$VRDMA_SOCKET` (or `/run/vrdma/control.sock`).
#[repr(C)]
pub struct VDev {
    /// What the application sees.
    pub dev: sys::ibv_device,
    /// rdma-core's `struct verbs_device` continues after `ibv_device` (ops, refcount, list
    /// entry, sysfs, core_support). Provider libraries the application may have linked
    /// (libmlx5's `mlx5dv_*`, libefa's `efadv_*`) compare `ops` with their own to decide
    /// whether a device is theirs: zeros make them answer "not mine" (EOPNOTSUPP).
    verbs_device_tail: [u64; 8],
    /// The vNIC's context (one control connection per process).
    pub ctx: vrdma::Context,
}

// SAFETY: the C part is written once at creation and then only read; vrdma::Context is Sync.
unsafe impl Sync for VDev {}
// SAFETY: as above.
unsafe impl Send for VDev {}

static DEVICE: Mutex<Option<&'static VDev>> = Mutex::new(None);

fn socket_path() -> std::path::PathBuf {
    std::env::var_os("VRDMA_SOCKET").unwrap_or_else(|| vrdma::DEFAULT_SOCKET.into()).into()
}

fn copy_cstr(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

/// The device of this process's vNIC, found (and its context opened) on first use.
pub fn device() -> Option<&'static VDev> {
    let mut g = DEVICE.lock();
    if let Some(d) = *g {
        return Some(d);
    }
    let sock = socket_path();
    if !sock.exists() {
        return None;
    }
    let ctx = match vrdma::Context::open(&sock) {
        Ok(c) => c,
        Err(e) => {
            fail(&DropInError::Verbs(e));
            return None;
        }
    };
    // Applications expect a NIC's view of a peer that exits first (see the method).
    ctx.set_peer_loss_like_hardware(true);
    let mut dev = sys::ibv_device { node_type: sys::IBV_NODE_CA, transport_type: sys::IBV_TRANSPORT_IB, ..Default::default() };
    // Also the name of the /dev/infiniband node `vrdma run` makes (UCX checks it exists).
    let name = vrdma::verbs_device_name(ctx.name());
    copy_cstr(&mut dev.name, &name);
    copy_cstr(&mut dev.dev_name, &name);
    copy_cstr(&mut dev.dev_path, &format!("/sys/class/infiniband_verbs/{name}"));
    copy_cstr(&mut dev.ibdev_path, &format!("/sys/class/infiniband/{name}"));
    let d: &'static VDev = Box::leak(Box::new(VDev { dev, verbs_device_tail: [0; 8], ctx }));
    *g = Some(d);
    Some(d)
}

/// `ibv_get_device_list`: a NULL-terminated array of the devices (zero or one).
///
/// # Safety
/// `num_devices` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut sys::ibv_device {
    guard(std::ptr::null_mut(), || {
        let devs: Vec<*mut sys::ibv_device> = device().map(|d| &d.dev as *const _ as *mut sys::ibv_device).into_iter().collect();
        // SAFETY: calloc of (n+1) pointers; freed by ibv_free_device_list with free().
        let list = unsafe { libc::calloc(devs.len() + 1, std::mem::size_of::<*mut sys::ibv_device>()) } as *mut *mut sys::ibv_device;
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (i, d) in devs.iter().enumerate() {
            // SAFETY: i < n, within the allocation.
            unsafe { *list.add(i) = *d };
        }
        if !num_devices.is_null() {
            // SAFETY: checked non-NULL; the caller provides an int.
            unsafe { *num_devices = devs.len() as c_int };
        }
        list
    })
}

/// `ibv_free_device_list`.
///
/// # Safety
/// `list` came from `ibv_get_device_list`.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_free_device_list(list: *mut *mut sys::ibv_device) {
    // SAFETY: allocated with calloc by ibv_get_device_list; the devices themselves live on.
    unsafe { libc::free(list.cast()) };
}

/// The `VDev` of a device pointer.
///
/// # Safety
/// `dev` is NULL or a device from our list.
unsafe fn vdev<'a>(dev: *mut sys::ibv_device) -> Option<&'a VDev> {
    // SAFETY: devices are only ever VDevs (ibv_device is their first field), leaked forever.
    unsafe { (dev as *const VDev).as_ref() }
}

/// `ibv_get_device_name`.
///
/// # Safety
/// `dev` is a device from the list.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_get_device_name(dev: *mut sys::ibv_device) -> *const c_char {
    // SAFETY: the caller passes one of our devices (or NULL).
    match unsafe { vdev(dev) } {
        Some(d) => d.dev.name.as_ptr(),
        None => std::ptr::null(),
    }
}

/// `ibv_get_device_guid`: the node GUID, in network byte order.
///
/// # Safety
/// `dev` is a device from the list.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_get_device_guid(dev: *mut sys::ibv_device) -> u64 {
    // SAFETY: the caller passes one of our devices (or NULL).
    unsafe { vdev(dev) }.map_or(0, |d| d.ctx.query_device().node_guid.to_be())
}

/// `ibv_get_device_index`: vrdma devices have no kernel index.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_get_device_index(_dev: *mut sys::ibv_device) -> c_int {
    -1
}

/// An open context: `verbs_context` (which ends with the `ibv_context` applications hold),
/// then vrdma's state.
#[repr(C)]
pub struct VCtx {
    /// What the application and the header's inline functions see.
    pub vctx: sys::verbs_context,
    /// The vNIC.
    pub ctx: vrdma::Context,
    /// Asynchronous events of the context's QPs; its descriptor is `ibv_context.async_fd`.
    pub events: vrdma::AsyncEvents,
    /// The context's QPs by number (`VQp` addresses), for events to name them.
    pub qps: Mutex<std::collections::HashMap<u32, usize>>,
    /// The context's SRQs by handle (`VSrq` addresses), likewise.
    pub srqs: Mutex<std::collections::HashMap<u32, usize>>,
}

impl VCtx {
    /// The `VCtx` of an `ibv_context` pointer.
    ///
    /// # Safety
    /// `ctx` was returned by our `ibv_open_device` and not closed.
    pub unsafe fn from_ptr<'a>(ctx: *mut sys::ibv_context) -> &'a VCtx {
        let off = std::mem::offset_of!(sys::verbs_context, context);
        // SAFETY: every ibv_context we hand out is the `context` field of a VCtx's
        // verbs_context, which is VCtx's first field.
        unsafe { &*((ctx as *mut u8).sub(off) as *const VCtx) }
    }

    /// The `ibv_context` pointer of this context.
    pub fn as_ptr(&self) -> *mut sys::ibv_context {
        &self.vctx.context as *const _ as *mut sys::ibv_context
    }
}

/// The context table every `ibv_context` carries.
fn context_ops() -> sys::ibv_context_ops {
    sys::ibv_context_ops {
        poll_cq: Some(crate::cq::poll_cq),
        req_notify_cq: Some(crate::cq::req_notify_cq),
        post_srq_recv: Some(crate::srq::post_srq_recv),
        post_send: Some(crate::qp::post_send),
        post_recv: Some(crate::qp::post_recv),
        ..Default::default()
    }
}

/// `ibv_open_device`.
///
/// # Safety
/// `dev` is a device from the list.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_open_device(dev: *mut sys::ibv_device) -> *mut sys::ibv_context {
    guard(std::ptr::null_mut(), || {
        ptr((|| {
            // SAFETY: the caller passes one of our devices (or NULL).
            let d = unsafe { vdev(dev) }.ok_or_else(|| invalid("ibv_open_device", "not a vrdma device"))?;
            let events = vrdma::AsyncEvents::new()?;
            d.ctx.watch_events(&events);
            let mut vctx = sys::verbs_context {
                query_port: Some(query_port_ex),
                query_device_ex: Some(query_device_ex),
                create_qp_ex: Some(crate::qp::create_qp_ex),
                sz: std::mem::size_of::<sys::verbs_context>(),
                ..Default::default()
            };
            vctx.context = sys::ibv_context {
                device: dev,
                ops: context_ops(),
                cmd_fd: -1,
                async_fd: events.fd().as_raw_fd(),
                num_comp_vectors: 1,
                abi_compat: usize::MAX as *mut c_void,
                ..Default::default()
            };
            let b = Box::new(VCtx { vctx, ctx: d.ctx.clone(), events, qps: Default::default(), srqs: Default::default() });
            let p = Box::into_raw(b);
            // SAFETY: p is our fresh allocation; the mutex lives in it.
            unsafe { crate::init_sync(&mut (*p).vctx.context.mutex, None) };
            // SAFETY: as above.
            Ok(unsafe { (*p).as_ptr() })
        })())
    })
}

/// `ibv_close_device`. Objects still open keep their vNIC resources until destroyed.
///
/// # Safety
/// `ctx` came from `ibv_open_device` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_close_device(ctx: *mut sys::ibv_context) -> c_int {
    if ctx.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a context of ours, closed once.
    let v = unsafe { VCtx::from_ptr(ctx) } as *const VCtx as *mut VCtx;
    // SAFETY: allocated by Box in ibv_open_device.
    drop(unsafe { Box::from_raw(v) });
    0
}

fn vendor_ids() -> (u32, u32) {
    let env = |k: &str| {
        std::env::var(k).ok().and_then(|v| {
            let v = v.trim();
            match v.strip_prefix("0x") {
                Some(h) => u32::from_str_radix(h, 16).ok(),
                None => v.parse().ok(),
            }
        })
    };
    (env("VRDMA_IBV_VENDOR_ID").unwrap_or(VENDOR_ID), env("VRDMA_IBV_VENDOR_PART_ID").unwrap_or(1))
}

/// `ibv_device_attr` of a context.
pub fn device_attr(ctx: &vrdma::Context) -> sys::ibv_device_attr {
    let a = ctx.query_device();
    let (vendor_id, vendor_part_id) = vendor_ids();
    let mut d = sys::ibv_device_attr {
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id,
        vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: a.max_qp as i32,
        max_qp_wr: a.max_qp_wr as i32,
        device_cap_flags: sys::IBV_DEVICE_RC_RNR_NAK_GEN | sys::IBV_DEVICE_CURR_QP_STATE_MOD | sys::IBV_DEVICE_SYS_IMAGE_GUID,
        max_sge: a.max_sge as i32,
        max_sge_rd: a.max_sge as i32,
        max_cq: a.max_cq as i32,
        max_cqe: a.max_cqe as i32,
        max_mr: a.max_mr as i32,
        max_pd: a.max_pd as i32,
        max_qp_rd_atom: a.max_qp_rd_atom as i32,
        max_res_rd_atom: (a.max_qp_rd_atom.saturating_mul(a.max_qp)).min(i32::MAX as u32) as i32,
        max_qp_init_rd_atom: a.max_qp_init_rd_atom as i32,
        atomic_cap: if a.atomic_glob { sys::IBV_ATOMIC_GLOB } else { sys::IBV_ATOMIC_HCA },
        max_ah: MAX_AH,
        max_srq: a.max_srq as i32,
        max_srq_wr: a.max_srq_wr as i32,
        max_srq_sge: a.max_srq_sge as i32,
        max_pkeys: 1,
        local_ca_ack_delay: 16,
        phys_port_cnt: a.phys_port_cnt,
        ..Default::default()
    };
    copy_cstr(&mut d.fw_ver, &format!("vrdma {}", a.fw_ver));
    d
}

/// `ibv_query_device`.
///
/// # Safety
/// `ctx` is an open context, `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_device(ctx: *mut sys::ibv_context, attr: *mut sys::ibv_device_attr) -> c_int {
    if ctx.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes an open context of ours.
    let v = unsafe { VCtx::from_ptr(ctx) };
    // SAFETY: attr is writable (checked non-NULL).
    unsafe { *attr = device_attr(&v.ctx) };
    0
}

/// `verbs_context.query_device_ex`: the legacy attributes plus zeroed extensions, written up
/// to `attr_size` bytes (older applications have smaller structures).
unsafe extern "C" fn query_device_ex(
    ctx: *mut sys::ibv_context,
    input: *const sys::ibv_query_device_ex_input,
    attr: *mut sys::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: input is NULL or readable.
    if ctx.is_null() || attr.is_null() || (!input.is_null() && unsafe { (*input).comp_mask } != 0) {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes an open context of ours.
    let v = unsafe { VCtx::from_ptr(ctx) };
    let orig = device_attr(&v.ctx);
    let full = sys::ibv_device_attr_ex {
        orig_attr: orig,
        device_cap_flags_ex: u64::from(orig.device_cap_flags),
        phys_port_cnt_ex: u32::from(orig.phys_port_cnt),
        ..Default::default()
    };
    let n = attr_size.min(std::mem::size_of::<sys::ibv_device_attr_ex>());
    if n < std::mem::size_of::<sys::ibv_device_attr>() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's structure has attr_size writable bytes; we copy at most that.
    unsafe { std::ptr::copy_nonoverlapping(&full as *const _ as *const u8, attr as *mut u8, n) };
    0
}

/// Port 1's attributes.
pub fn port_attr(ctx: &vrdma::Context) -> sys::ibv_port_attr {
    let p = ctx.query_port(1).expect("port 1 exists");
    sys::ibv_port_attr {
        state: p.state,
        max_mtu: p.max_mtu,
        active_mtu: p.active_mtu,
        gid_tbl_len: p.gid_tbl_len as i32,
        port_cap_flags: sys::IBV_PORT_IP_BASED_GIDS,
        max_msg_sz: 1 << 30,
        pkey_tbl_len: 1,
        lid: p.lid,
        max_vl_num: 1,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: 5, // LinkUp
        link_layer: p.link_layer,
        ..Default::default()
    }
}

fn write_port_attr(ctx: *mut sys::ibv_context, port: u8, out: *mut sys::ibv_port_attr, len: usize) -> c_int {
    if ctx.is_null() || out.is_null() {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes an open context of ours.
    let v = unsafe { VCtx::from_ptr(ctx) };
    let a = port_attr(&v.ctx);
    let n = len.min(std::mem::size_of::<sys::ibv_port_attr>());
    // SAFETY: the caller's structure has `len` writable bytes; we copy at most that.
    unsafe { std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, out as *mut u8, n) };
    0
}

/// `verbs_context.query_port`, what the header's inline `ibv_query_port` calls.
unsafe extern "C" fn query_port_ex(ctx: *mut sys::ibv_context, port: u8, attr: *mut sys::ibv_port_attr, len: usize) -> c_int {
    write_port_attr(ctx, port, attr, len)
}

/// Bytes of rdma-core's `struct _compat_ibv_port_attr` (ibv_port_attr up to `flags`).
const COMPAT_PORT_ATTR: usize = std::mem::offset_of!(sys::ibv_port_attr, flags) + 1;

/// `ibv_query_port` (the exported one, with the old, shorter structure).
///
/// # Safety
/// `ctx` is an open context, `attr` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_port(ctx: *mut sys::ibv_context, port: u8, attr: *mut sys::ibv_port_attr) -> c_int {
    write_port_attr(ctx, port, attr, COMPAT_PORT_ATTR)
}

fn gid(ctx: *mut sys::ibv_context, port: u32, index: u32) -> Result<[u8; 16], DropInError> {
    if ctx.is_null() {
        return Err(invalid("ibv_query_gid", "NULL context"));
    }
    if port != 1 {
        return Err(invalid("ibv_query_gid", format!("port {port} does not exist")));
    }
    // SAFETY: the caller passes an open context of ours.
    let v = unsafe { VCtx::from_ptr(ctx) };
    v.ctx.gids().get(index as usize).copied().ok_or_else(|| invalid("ibv_query_gid", format!("GID index {index} out of range")))
}

/// `ibv_query_gid`: 0, or -1 with errno.
///
/// # Safety
/// `ctx` is an open context, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_gid(ctx: *mut sys::ibv_context, port: u8, index: c_int, out: *mut sys::ibv_gid) -> c_int {
    if out.is_null() || index < 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    match gid(ctx, u32::from(port), index as u32) {
        Ok(g) => {
            // SAFETY: out is writable (checked non-NULL).
            unsafe { (*out).raw = g };
            0
        }
        Err(e) => {
            set_errno(fail(&e));
            -1
        }
    }
}

fn gid_entry(ctx: *mut sys::ibv_context, port: u32, index: u32) -> Result<sys::ibv_gid_entry, DropInError> {
    let g = gid(ctx, port, index)?;
    Ok(sys::ibv_gid_entry {
        gid: sys::ibv_gid { raw: g },
        gid_index: index,
        port_num: port,
        gid_type: sys::IBV_GID_TYPE_ROCE_V2,
        // SAFETY: plain if_nametoindex on a constant name (0 if the netns has no eth0).
        ndev_ifindex: unsafe { libc::if_nametoindex(c"eth0".as_ptr()) },
    })
}

/// `_ibv_query_gid_ex` (behind the header's inline `ibv_query_gid_ex`): errno on failure.
///
/// # Safety
/// `ctx` is an open context, `entry` has `entry_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn __vrdma__ibv_query_gid_ex(
    ctx: *mut sys::ibv_context,
    port: u32,
    index: u32,
    entry: *mut sys::ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if entry.is_null() || flags != 0 || entry_size < std::mem::size_of::<sys::ibv_gid_entry>() {
        return libc::EINVAL;
    }
    match gid_entry(ctx, port, index) {
        Ok(e) => {
            // SAFETY: entry is writable (checked size and non-NULL).
            unsafe { *entry = e };
            0
        }
        Err(e) => fail(&e),
    }
}

/// `_ibv_query_gid_table`: the number of entries written, or a negative errno.
///
/// # Safety
/// `ctx` is an open context, `entries` has room for `max_entries` of `entry_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn __vrdma__ibv_query_gid_table(
    ctx: *mut sys::ibv_context,
    entries: *mut sys::ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    if ctx.is_null() || flags != 0 || entry_size < std::mem::size_of::<sys::ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: the caller passes an open context of ours.
    let n = unsafe { VCtx::from_ptr(ctx) }.ctx.gids().len();
    if n > max_entries {
        return -(libc::EINVAL as isize);
    }
    for i in 0..n {
        let Ok(e) = gid_entry(ctx, 1, i as u32) else { return -(libc::EINVAL as isize) };
        // SAFETY: i < max_entries entries of entry_size bytes each.
        unsafe { *((entries as *mut u8).add(i * entry_size) as *mut sys::ibv_gid_entry) = e };
    }
    n as isize
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34, used by ibv_devinfo): every vGID is RoCE v2.
///
/// # Safety
/// `ctx` is an open context, `ty` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_gid_type(ctx: *mut sys::ibv_context, port: u8, index: u32, ty: *mut u32) -> c_int {
    if ty.is_null() {
        return libc::EINVAL;
    }
    match gid(ctx, u32::from(port), index) {
        Ok(_) => {
            // SAFETY: ty is writable. 1 = IBV_GID_TYPE_SYSFS_ROCE_V2.
            unsafe { *ty = 1 };
            0
        }
        Err(e) => fail(&e),
    }
}

/// `ibv_query_pkey`: the table has the default P_Key only.
///
/// # Safety
/// `ctx` is an open context, `pkey` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_query_pkey(ctx: *mut sys::ibv_context, port: u8, index: c_int, pkey: *mut u16) -> c_int {
    if ctx.is_null() || pkey.is_null() || port != 1 || index != 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: pkey is writable (checked non-NULL); network byte order, as libibverbs.
    unsafe { *pkey = 0xffffu16.to_be() };
    0
}

/// `ibv_get_pkey_index`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_get_pkey_index(ctx: *mut sys::ibv_context, port: u8, pkey: u16) -> c_int {
    if ctx.is_null() || port != 1 || u16::from_be(pkey) & 0x7fff != 0x7fff {
        set_errno(libc::ENOENT);
        return -1;
    }
    0
}

/// `ibv_fork_init`: registered memory is shared memory (a child shares it, see README), so
/// there is nothing to prepare.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: IBV_FORK_UNNEEDED.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_is_fork_initialized() -> u32 {
    sys::IBV_FORK_UNNEEDED
}

/// `ibv_dontfork_range`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_dofork_range`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_get_sysfs_path`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf` without its trailing newline; the
/// length, or -1.
///
/// # Safety
/// `dir` and `file` are C strings, `buf` has `size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_read_sysfs_file(dir: *const c_char, file: *const c_char, buf: *mut c_char, size: usize) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        return -1;
    }
    // SAFETY: C strings from the caller.
    let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    let path = Path::new(std::ffi::OsStr::new(&*d.to_string_lossy())).join(&*f.to_string_lossy());
    let Ok(mut data) = std::fs::read(path) else { return -1 };
    data.truncate(size - 1);
    if data.last() == Some(&b'\n') {
        data.pop();
    }
    // SAFETY: data.len() < size bytes fit in buf, plus the terminator.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), buf as *mut u8, data.len());
        *buf.add(data.len()) = 0;
    }
    data.len() as c_int
}

/// `ibv_get_async_event`: the oldest event of the context, its QPs or its SRQs (see
/// `vrdma::AsyncEvents`: a QP attached to an SRQ that entered ERR raises
/// `IBV_EVENT_QP_LAST_WQE_REACHED`, a mediated QP that vrdmad's end failed
/// `IBV_EVENT_QP_FATAL`, an SRQ below its armed limit `IBV_EVENT_SRQ_LIMIT_REACHED`, and
/// vrdmad's end `IBV_EVENT_DEVICE_FATAL`). Waits for one unless the
/// application made `async_fd` non-blocking (then fails with EAGAIN when there is none), as
/// libibverbs does.
///
/// # Safety
/// `ctx` is an open context, `event` writable.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_get_async_event(ctx: *mut sys::ibv_context, event: *mut sys::ibv_async_event) -> c_int {
    if ctx.is_null() || event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes an open context of ours.
    let v = unsafe { VCtx::from_ptr(ctx) };
    loop {
        let e = match v.events.next() {
            Ok(e) => e,
            Err(err) => {
                set_errno(err.errno());
                return -1;
            }
        };
        let event_type = match e.kind {
            vrdma::AsyncEventKind::SrqLimitReached => {
                // Under the registry's lock, as for QPs below.
                let srqs = v.srqs.lock();
                let Some(&addr) = srqs.get(&e.qpn) else { continue };
                let srq = addr as *mut crate::srq::VSrq;
                // SAFETY: registered SRQs are live (destroy unregisters them first).
                unsafe { (*srq).events_reported.fetch_add(1, std::sync::atomic::Ordering::AcqRel) };
                // SAFETY: event is writable (checked non-NULL).
                unsafe {
                    *event = sys::ibv_async_event {
                        element: sys::ibv_async_event__bindgen_ty_1 { srq: srq as *mut sys::ibv_srq },
                        event_type: sys::IBV_EVENT_SRQ_LIMIT_REACHED,
                    }
                };
                return 0;
            }
            vrdma::AsyncEventKind::QpLastWqeReached => sys::IBV_EVENT_QP_LAST_WQE_REACHED,
            vrdma::AsyncEventKind::QpFatal => sys::IBV_EVENT_QP_FATAL,
            vrdma::AsyncEventKind::DeviceFatal => {
                // SAFETY: event is writable (checked non-NULL).
                unsafe {
                    *event = sys::ibv_async_event {
                        element: sys::ibv_async_event__bindgen_ty_1 { qp: std::ptr::null_mut() },
                        event_type: sys::IBV_EVENT_DEVICE_FATAL,
                    }
                };
                return 0;
            }
        };
        // Under the registry's lock, so the QP cannot be destroyed before the event counts
        // as reported (destroy waits for its reported events to be acknowledged).
        let qps = v.qps.lock();
        let Some(&addr) = qps.get(&e.qpn) else { continue };
        let qp = addr as *mut crate::qp::VQp;
        // SAFETY: registered QPs are live (destroy unregisters them first).
        unsafe { (*qp).events_reported.fetch_add(1, std::sync::atomic::Ordering::AcqRel) };
        // SAFETY: event is writable (checked non-NULL).
        unsafe { *event = sys::ibv_async_event { element: sys::ibv_async_event__bindgen_ty_1 { qp: qp as *mut sys::ibv_qp }, event_type } };
        return 0;
    }
}

/// `ibv_ack_async_event`: counts the event acknowledged, which a destroy of its QP waits for.
///
/// # Safety
/// `event` was returned by `ibv_get_async_event` and not acknowledged yet.
#[no_mangle]
pub unsafe extern "C" fn __vrdma_ibv_ack_async_event(event: *mut sys::ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: the caller passes an event we returned.
    let e = unsafe { *event };
    if matches!(e.event_type, sys::IBV_EVENT_QP_LAST_WQE_REACHED | sys::IBV_EVENT_QP_FATAL) {
        // SAFETY: the event names a QP that cannot be destroyed before this acknowledgement.
        unsafe { crate::qp::event_acknowledged(e.element.qp) };
    }
    if e.event_type == sys::IBV_EVENT_SRQ_LIMIT_REACHED {
        // SAFETY: the event names an SRQ that cannot be destroyed before this acknowledgement.
        unsafe { crate::srq::event_acknowledged(e.element.srq) };
    }
}

/// `ibv_query_ece`: no enhanced connection establishment.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_query_ece(_qp: *mut sys::ibv_qp, _ece: *mut sys::ibv_ece) -> c_int {
    rc(Err(crate::unsupported("ibv_query_ece", "ECE")))
}

/// `ibv_set_ece`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_set_ece(_qp: *mut sys::ibv_qp, _ece: *mut sys::ibv_ece) -> c_int {
    rc(Err(crate::unsupported("ibv_set_ece", "ECE")))
}
