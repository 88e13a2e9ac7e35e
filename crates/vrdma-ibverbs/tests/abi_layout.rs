//! The Rust layouts of the structures applications share with libibverbs match Debian's
//! rdma-core 44 headers: a C program compiled with gcc against `<infiniband/verbs.h>` prints
//! sizeof/offsetof of each, and the test compares them with `sys.rs`.

use std::mem::{offset_of, size_of};
use std::process::Command;

use vrdma_ibverbs::sys::*;

macro_rules! layout {
    ($( $ty:ident { $($field:ident),* } )*) => {{
        let mut rust = Vec::new();
        let mut c = String::new();
        $(
            rust.push(format!("{} size {}", stringify!($ty), size_of::<$ty>()));
            c.push_str(&format!("  printf(\"{} size %zu\\n\", sizeof(struct {}));\n", stringify!($ty), stringify!($ty)));
            $(
                rust.push(format!("{}.{} {}", stringify!($ty), stringify!($field), offset_of!($ty, $field)));
                c.push_str(&format!(
                    "  printf(\"{}.{} %zu\\n\", offsetof(struct {}, {}));\n",
                    stringify!($ty), stringify!($field), stringify!($ty), stringify!($field)
                ));
            )*
        )*
        (rust, c)
    }};
}

#[test]
fn layouts_match_the_system_headers() {
    if !vrdma_test_support::require_files("layouts_match_the_system_headers", &["/usr/include/infiniband/verbs.h"], "libibverbs-dev") {
        return;
    }
    let (rust, body) = layout! {
        ibv_device { _ops, node_type, transport_type, name, dev_name, dev_path, ibdev_path }
        ibv_context_ops { alloc_mw, bind_mw, dealloc_mw, poll_cq, req_notify_cq, post_srq_recv, post_send, post_recv, _compat_async_event }
        ibv_context { device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat }
        verbs_context {
            query_port, advise_mr, alloc_null_mr, read_counters, create_counters, alloc_dm, modify_cq, create_cq_ex, priv_,
            query_device_ex, ibv_create_flow, open_qp, create_qp_ex, get_srq_num, create_srq_ex, open_xrcd, close_xrcd,
            _ABI_placeholder3, sz, context
        }
        ibv_device_attr { fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id, vendor_part_id, hw_ver, max_qp,
            max_qp_wr, device_cap_flags, max_sge, max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom, atomic_cap, max_ah, max_srq,
            max_srq_wr, max_srq_sge, max_pkeys, local_ca_ack_delay, phys_port_cnt }
        ibv_device_attr_ex { orig_attr, comp_mask, odp_caps, completion_timestamp_mask, hca_core_clock, device_cap_flags_ex,
            tso_caps, rss_caps, max_wq_type_rq, packet_pacing_caps, raw_packet_caps, tm_caps, cq_mod_caps, max_dm_size,
            pci_atomic_caps, xrc_odp_caps, phys_port_cnt_ex }
        ibv_query_device_ex_input { comp_mask }
        ibv_port_attr { state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, pkey_tbl_len, lid, sm_lid, lmc,
            max_vl_num, active_width, active_speed, phys_state, link_layer, flags, port_cap_flags2 }
        ibv_gid_entry { gid, gid_index, port_num, gid_type, ndev_ifindex }
        ibv_pd { context, handle }
        ibv_mr { context, pd, addr, length, handle, lkey, rkey }
        ibv_comp_channel { context, fd, refcnt }
        ibv_cq { context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed, async_events_completed }
        ibv_cq_ex { context, channel, cq_context, handle, cqe, comp_mask, status, wr_id, start_poll, next_poll, end_poll,
            read_opcode, read_completion_wallclock_ns }
        ibv_srq { context, srq_context, pd, handle, mutex, cond, events_completed }
        ibv_srq_attr { max_wr, max_sge, srq_limit }
        ibv_srq_init_attr { srq_context, attr }
        ibv_qp { context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex, cond, events_completed }
        ibv_qp_ex { qp_base, comp_mask, wr_id, wr_flags, wr_atomic_cmp_swp, wr_atomic_fetch_add, wr_bind_mw, wr_local_inv,
            wr_rdma_read, wr_rdma_write, wr_rdma_write_imm, wr_send, wr_send_imm, wr_send_inv, wr_send_tso, wr_set_ud_addr,
            wr_set_xrc_srqn, wr_set_inline_data, wr_set_inline_data_list, wr_set_sge, wr_set_sge_list, wr_start, wr_complete,
            wr_abort, wr_atomic_write }
        ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data }
        ibv_qp_init_attr { qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all }
        ibv_qp_init_attr_ex { qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all, comp_mask, pd, xrcd, create_flags,
            max_tso_header, rwq_ind_tbl, rx_hash_conf, source_qpn, send_ops_flags }
        ibv_global_route { dgid, flow_label, sgid_index, hop_limit, traffic_class }
        ibv_ah_attr { grh, dlid, sl, src_path_bits, static_rate, is_global, port_num }
        ibv_qp_attr { qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn, dest_qp_num, qp_access_flags, cap,
            ah_attr, alt_ah_attr, pkey_index, alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic,
            max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout, rate_limit }
        ibv_ah { context, pd, handle }
        ibv_grh { version_tclass_flow, paylen, next_hdr, hop_limit, sgid, dgid }
        ibv_sge { addr, length, lkey }
        ibv_send_wr { wr_id, next, sg_list, num_sge, opcode, send_flags, wr, qp_type }
        ibv_recv_wr { wr_id, next, sg_list, num_sge }
        ibv_wc { wr_id, status, opcode, vendor_err, byte_len, qp_num, src_qp, wc_flags, pkey_index, slid, sl, dlid_path_bits }
        ibv_data_buf { addr, length }
        ibv_async_event { element, event_type }
    };
    // bindgen renames the C field `priv` (a Rust keyword) to `priv_`.
    let body = body.replace("offsetof(struct verbs_context, priv_)", "offsetof(struct verbs_context, priv)");
    let dir = std::env::temp_dir().join(format!("vrdma-abi-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    std::fs::write(
        &src,
        format!("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {{\n{body}  return 0;\n}}\n"),
    )
    .unwrap();
    let exe = dir.join("layout");
    let cc = Command::new("gcc").arg("-o").arg(&exe).arg(&src).output().expect("gcc runs");
    assert!(cc.status.success(), "gcc failed: {}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&exe).output().unwrap();
    let c: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(c.len(), rust.len());
    let diff: Vec<String> = c.iter().zip(&rust).filter(|(a, b)| a != b).map(|(a, b)| format!("C: {a}  Rust: {b}")).collect();
    assert!(diff.is_empty(), "layout mismatches:\n{}", diff.join("\n"));
    // Field offsets inside unions of ibv_send_wr that the data path reads.
    assert_eq!(offset_of!(ibv_send_wr, __bindgen_anon_1), 36);
    assert_eq!(size_of::<ibv_send_wr>(), 128);
}
