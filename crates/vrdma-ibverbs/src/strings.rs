//! The `*_str` functions and rate conversions, with rdma-core's wording and tables.

use std::ffi::{c_char, c_int};

use crate::sys;

/// `ibv_node_type_str`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_node_type_str(v: c_int) -> *const c_char {
    let s: &std::ffi::CStr = match v {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_port_state_str`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_port_state_str(v: u32) -> *const c_char {
    let s: &std::ffi::CStr = match v {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active defer",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_event_type_str`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_event_type_str(v: u32) -> *const c_char {
    let s: &std::ffi::CStr = match v {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        4 => c"communication established",
        5 => c"send queue drained",
        6 => c"path migrated",
        7 => c"path migration request error",
        8 => c"local catastrophic error",
        9 => c"port active",
        10 => c"port error",
        11 => c"LID change",
        12 => c"P_Key change",
        13 => c"SM change",
        14 => c"SRQ catastrophic error",
        15 => c"SRQ limit reached",
        16 => c"last WQE reached",
        17 => c"client reregistration",
        18 => c"GID table change",
        19 => c"WQ fatal",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_wc_status_str`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_wc_status_str(v: u32) -> *const c_char {
    let s: &std::ffi::CStr = match v {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        3 => c"local EE context operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        6 => c"memory management operation error",
        7 => c"bad response error",
        8 => c"local access error",
        9 => c"remote invalid request error",
        10 => c"remote access error",
        11 => c"remote operation error",
        12 => c"transport retry counter exceeded",
        13 => c"RNR retry counter exceeded",
        14 => c"local RDD violation error",
        15 => c"remote invalid RD request",
        16 => c"aborted error",
        17 => c"invalid EE context number",
        18 => c"invalid EE context state",
        19 => c"fatal error",
        20 => c"response timeout error",
        21 => c"general error",
        22 => c"TM error",
        23 => c"TM software rendezvous",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_rate_to_mult`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_rate_to_mult(v: u32) -> c_int {
    match v {
        2 => 1,
        5 => 2,
        3 => 4,
        6 => 8,
        4 => 12,
        7 => 16,
        8 => 24,
        9 => 32,
        10 => 48,
        19 => 11,
        20 => 20,
        21 => 160,
        22 => 240,
        23 => 320,
        24 => 480,
        _ => -1,
    }
}

/// `mult_to_ibv_rate`.
#[no_mangle]
pub extern "C" fn __vrdma_mult_to_ibv_rate(v: c_int) -> u32 {
    match v {
        1 => sys::IBV_RATE_2_5_GBPS,
        2 => sys::IBV_RATE_5_GBPS,
        4 => sys::IBV_RATE_10_GBPS,
        8 => sys::IBV_RATE_20_GBPS,
        12 => sys::IBV_RATE_30_GBPS,
        16 => sys::IBV_RATE_40_GBPS,
        24 => sys::IBV_RATE_60_GBPS,
        32 => sys::IBV_RATE_80_GBPS,
        48 => sys::IBV_RATE_120_GBPS,
        11 => sys::IBV_RATE_28_GBPS,
        20 => sys::IBV_RATE_50_GBPS,
        160 => sys::IBV_RATE_400_GBPS,
        240 => sys::IBV_RATE_600_GBPS,
        320 => sys::IBV_RATE_800_GBPS,
        480 => sys::IBV_RATE_1200_GBPS,
        _ => sys::IBV_RATE_MAX,
    }
}

/// `ibv_rate_to_mbps`.
#[no_mangle]
pub extern "C" fn __vrdma_ibv_rate_to_mbps(v: u32) -> c_int {
    match v {
        2 => 2500,
        5 => 5000,
        3 => 10000,
        6 => 20000,
        4 => 30000,
        7 => 40000,
        8 => 60000,
        9 => 80000,
        10 => 120000,
        11 => 14062,
        12 => 56250,
        13 => 112500,
        14 => 168750,
        15 => 25781,
        16 => 103125,
        17 => 206250,
        18 => 309375,
        19 => 28125,
        20 => 53125,
        21 => 425000,
        22 => 637500,
        23 => 850000,
        24 => 1275000,
        _ => -1,
    }
}

/// `mbps_to_ibv_rate`.
#[no_mangle]
pub extern "C" fn __vrdma_mbps_to_ibv_rate(v: c_int) -> u32 {
    match v {
        2500 => sys::IBV_RATE_2_5_GBPS,
        5000 => sys::IBV_RATE_5_GBPS,
        10000 => sys::IBV_RATE_10_GBPS,
        20000 => sys::IBV_RATE_20_GBPS,
        30000 => sys::IBV_RATE_30_GBPS,
        40000 => sys::IBV_RATE_40_GBPS,
        60000 => sys::IBV_RATE_60_GBPS,
        80000 => sys::IBV_RATE_80_GBPS,
        120000 => sys::IBV_RATE_120_GBPS,
        14062 => sys::IBV_RATE_14_GBPS,
        56250 => sys::IBV_RATE_56_GBPS,
        112500 => sys::IBV_RATE_112_GBPS,
        168750 => sys::IBV_RATE_168_GBPS,
        25781 => sys::IBV_RATE_25_GBPS,
        103125 => sys::IBV_RATE_100_GBPS,
        206250 => sys::IBV_RATE_200_GBPS,
        309375 => sys::IBV_RATE_300_GBPS,
        28125 => sys::IBV_RATE_28_GBPS,
        53125 => sys::IBV_RATE_50_GBPS,
        425000 => sys::IBV_RATE_400_GBPS,
        637500 => sys::IBV_RATE_600_GBPS,
        850000 => sys::IBV_RATE_800_GBPS,
        1275000 => sys::IBV_RATE_1200_GBPS,
        _ => sys::IBV_RATE_MAX,
    }
}
