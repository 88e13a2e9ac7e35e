//! Exports with no vrdma implementation. Binaries and libraries linked against Debian's
//! libibverbs import them (librdmacm, and the provider libraries libmlx5 and libefa that
//! perftest links, need the private `IBVERBS_PRIVATE_34` ones to load at all); each fails the
//! way libibverbs fails an unsupported verb, and none touches its arguments.

use std::ffi::{c_int, c_uint, c_void};

use crate::sys;
use crate::{ptr, rc, set_errno, unsupported};

/// `ibv_attach_mcast`: no multicast.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_attach_mcast(_qp: *mut sys::ibv_qp, _gid: *const sys::ibv_gid, _lid: u16) -> c_int {
    rc(Err(unsupported("ibv_attach_mcast", "multicast")))
}

/// `ibv_detach_mcast`: no multicast.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_detach_mcast(_qp: *mut sys::ibv_qp, _gid: *const sys::ibv_gid, _lid: u16) -> c_int {
    rc(Err(unsupported("ibv_detach_mcast", "multicast")))
}

/// `ibv_import_device`: no shared kernel contexts.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_import_device(_cmd_fd: c_int) -> *mut sys::ibv_context {
    ptr(Err(unsupported("ibv_import_device", "importing contexts")))
}

/// `ibv_import_pd`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_import_pd(_ctx: *mut sys::ibv_context, _handle: u32) -> *mut sys::ibv_pd {
    ptr(Err(unsupported("ibv_import_pd", "importing objects")))
}

/// `ibv_import_mr`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_import_mr(_pd: *mut sys::ibv_pd, _handle: u32) -> *mut sys::ibv_mr {
    ptr(Err(unsupported("ibv_import_mr", "importing objects")))
}

/// `ibv_import_dm`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_import_dm(_ctx: *mut sys::ibv_context, _handle: u32) -> *mut sys::ibv_dm {
    ptr(Err(unsupported("ibv_import_dm", "device memory")))
}

/// `ibv_unimport_pd`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_unimport_pd(_pd: *mut sys::ibv_pd) {}

/// `ibv_unimport_mr`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_unimport_mr(_mr: *mut sys::ibv_mr) {}

/// `ibv_unimport_dm`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_unimport_dm(_dm: *mut sys::ibv_dm) {}

/// `ibv_copy_qp_attr_from_kern` (kernel-structure conversion for librdmacm; vrdma has no
/// kernel structures, so there is nothing to convert).
#[no_mangle]
pub extern "C" fn __vrdma_ibv_copy_qp_attr_from_kern(_dst: *mut c_void, _src: *mut c_void) {}

/// `ibv_copy_ah_attr_from_kern`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_copy_ah_attr_from_kern(_dst: *mut c_void, _src: *mut c_void) {}

/// `ibv_copy_path_rec_from_kern`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *mut c_void) {}

/// `ibv_copy_path_rec_to_kern`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_copy_path_rec_to_kern(_dst: *mut c_void, _src: *mut c_void) {}

// ---- IBVERBS_PRIVATE_34: the provider interface. vrdma loads no providers, so nothing calls
// these through us; they exist so that provider libraries an application links can load.

/// `verbs_allow_disassociate_destroy` (a flag providers read).
#[no_mangle]
pub static __vrdma_verbs_allow_disassociate_destroy: bool = false;

/// `verbs_register_driver_34`: provider libraries register themselves when loaded; vrdma
/// does not use them.
#[no_mangle]
pub extern "C" fn __vrdma_verbs_register_driver_34(_ops: *const c_void) {}

/// `__verbs_log`.
#[no_mangle]
pub extern "C" fn __vrdma___verbs_log(_ctx: *mut c_void, _level: u32) {}

/// `verbs_set_ops`.
#[no_mangle]
pub extern "C" fn __vrdma_verbs_set_ops(_vctx: *mut c_void, _ops: *const c_void) {}

/// `verbs_uninit_context`.
#[no_mangle]
pub extern "C" fn __vrdma_verbs_uninit_context(_vctx: *mut c_void) {}

/// `verbs_init_cq`.
#[no_mangle]
pub extern "C" fn __vrdma_verbs_init_cq(_cq: *mut c_void, _ctx: *mut c_void, _channel: *mut c_void, _cq_context: *mut c_void) {}

/// `_verbs_init_and_alloc_context`.
#[no_mangle]
pub extern "C" fn __vrdma__verbs_init_and_alloc_context(_dev: *mut c_void, _cmd_fd: c_int) -> *mut c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

/// `verbs_open_device`.
#[no_mangle]
pub extern "C" fn __vrdma_verbs_open_device(_dev: *mut c_void, _private: *mut c_void) -> *mut c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

/// `__ioctl_final_num_attrs`.
#[no_mangle]
pub extern "C" fn __vrdma___ioctl_final_num_attrs(num_attrs: c_uint, _link: *mut c_void) -> c_uint {
    num_attrs
}

/// `ibv_read_ibdev_sysfs_file`: no sysfs device.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_read_ibdev_sysfs_file(_buf: *mut c_void, _size: usize, _dev: *mut c_void, _fmt: *const c_void) -> c_int {
    set_errno(libc::ENOENT);
    -1
}

/// Defines kernel-command exports (`ibv_cmd_*`, `execute_ioctl`): they return an errno.
macro_rules! cmd_stubs {
    ($($name:ident),* $(,)?) => {
        $(
            #[doc = "A provider kernel command: EOPNOTSUPP."]
            #[no_mangle]
            pub extern "C" fn $name() -> c_int {
                libc::EOPNOTSUPP
            }
        )*
    };
}

cmd_stubs!(
    __vrdma_execute_ioctl,
    __vrdma_ibv_cmd_advise_mr,
    __vrdma_ibv_cmd_alloc_dm,
    __vrdma_ibv_cmd_alloc_mw,
    __vrdma_ibv_cmd_alloc_pd,
    __vrdma_ibv_cmd_attach_mcast,
    __vrdma_ibv_cmd_close_xrcd,
    __vrdma_ibv_cmd_create_ah,
    __vrdma_ibv_cmd_create_counters,
    __vrdma_ibv_cmd_create_cq,
    __vrdma_ibv_cmd_create_cq_ex,
    __vrdma_ibv_cmd_create_flow,
    __vrdma_ibv_cmd_create_flow_action_esp,
    __vrdma_ibv_cmd_create_qp,
    __vrdma_ibv_cmd_create_qp_ex,
    __vrdma_ibv_cmd_create_qp_ex2,
    __vrdma_ibv_cmd_create_rwq_ind_table,
    __vrdma_ibv_cmd_create_srq,
    __vrdma_ibv_cmd_create_srq_ex,
    __vrdma_ibv_cmd_create_wq,
    __vrdma_ibv_cmd_dealloc_mw,
    __vrdma_ibv_cmd_dealloc_pd,
    __vrdma_ibv_cmd_dereg_mr,
    __vrdma_ibv_cmd_destroy_ah,
    __vrdma_ibv_cmd_destroy_counters,
    __vrdma_ibv_cmd_destroy_cq,
    __vrdma_ibv_cmd_destroy_flow,
    __vrdma_ibv_cmd_destroy_flow_action,
    __vrdma_ibv_cmd_destroy_qp,
    __vrdma_ibv_cmd_destroy_rwq_ind_table,
    __vrdma_ibv_cmd_destroy_srq,
    __vrdma_ibv_cmd_destroy_wq,
    __vrdma_ibv_cmd_detach_mcast,
    __vrdma_ibv_cmd_free_dm,
    __vrdma_ibv_cmd_get_context,
    __vrdma_ibv_cmd_modify_cq,
    __vrdma_ibv_cmd_modify_flow_action_esp,
    __vrdma_ibv_cmd_modify_qp,
    __vrdma_ibv_cmd_modify_qp_ex,
    __vrdma_ibv_cmd_modify_srq,
    __vrdma_ibv_cmd_modify_wq,
    __vrdma_ibv_cmd_open_qp,
    __vrdma_ibv_cmd_open_xrcd,
    __vrdma_ibv_cmd_poll_cq,
    __vrdma_ibv_cmd_post_recv,
    __vrdma_ibv_cmd_post_send,
    __vrdma_ibv_cmd_post_srq_recv,
    __vrdma_ibv_cmd_query_context,
    __vrdma_ibv_cmd_query_device_any,
    __vrdma_ibv_cmd_query_mr,
    __vrdma_ibv_cmd_query_port,
    __vrdma_ibv_cmd_query_qp,
    __vrdma_ibv_cmd_query_srq,
    __vrdma_ibv_cmd_read_counters,
    __vrdma_ibv_cmd_reg_dm_mr,
    __vrdma_ibv_cmd_reg_dmabuf_mr,
    __vrdma_ibv_cmd_reg_mr,
    __vrdma_ibv_cmd_req_notify_cq,
    __vrdma_ibv_cmd_rereg_mr,
    __vrdma_ibv_cmd_resize_cq,
);
