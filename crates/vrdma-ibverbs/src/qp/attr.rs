//! The state machine and attributes: `ibv_modify_qp`, `ibv_query_qp`.

use std::ffi::c_int;

use vrdma::QpCaps;

use super::VQp;
use crate::sys;
use crate::{fail, guard, DropInError};

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
