//! The semantics core of vrdma: pure functions over queue state and memory
//! views, shared by the direct and mediated data paths.
//!
//! * [`qp_state`]: the QP state machine with the attribute masks each transition requires.
//! * [`access`]: MR bounds and access-flag checks, mapping failures to completion statuses.
//! * [`sg`]: scatter/gather copies between memory views, and the RDMA atomics.
//! * [`bucket`]: the token bucket behind a vNIC's caps (bytes and WRs per second).
//! * [`timers`]: the IB encodings of the RNR and transport timers.

pub mod access;
pub mod bucket;
pub mod qp_state;
pub mod sg;
pub mod timers;

pub use vrdma_abi::verbs;
