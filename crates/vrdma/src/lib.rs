//! `vrdma`: the verbs library of vrdma.
//!
//! A process opens its vNIC ([`Context::open`]) through the control socket vrdmad serves in
//! the vNIC directory (`/run/vrdma/control.sock` inside a container). Control verbs (PD, MR,
//! CQ, QP, SRQ creation, connection) are requests to vrdmad; the data path is direct: the
//! requester's library executes each work request itself, copying straight between its own
//! registered memory and the peer's (shared with it by vrdmad as memfds), and writes the
//! peer's receive completions into a ring the peer polls. One copy per message, no daemon.
//!
//! ```no_run
//! use vrdma::*;
//! let ctx = Context::open_default()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64, None)?;
//! let buf = MrBuf::new(&pd, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE)?;
//! let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, QpCaps::default()))?;
//! # Ok::<(), vrdma::Error>(())
//! ```
//! See `examples/pingpong.rs` for a complete exchange between two processes.

mod cq;
mod ctl;
mod device;
mod error;
mod events;
mod idle;
mod inplace;
mod mediated;
mod move_guard;
mod mover;
mod mr;
mod peer;
mod qp;
mod raw_control;
mod recv_list;
mod rehome;
mod spin;
mod srq;
mod unshare;
mod vm;

pub use cq::{CompChannel, Cq, Wc};
pub use device::{Context, DeviceAttr, Pd, PortAttr};
pub use error::Error;
pub use events::{AsyncEvent, AsyncEventKind, AsyncEvents};
pub use mr::{Backing, Mr, MrBuf};
pub use qp::{Qp, QpAttr, QpInitAttr, RecvWr, SendWr, UdDest, GRH_LEN};
pub use spin::RawSpinLock;
pub use srq::Srq;
pub use vrdma_abi::control::{Limits, Qos, QpCaps, Usage};
pub use vrdma_abi::ring::Sge;
pub use vrdma_abi::verbs::{access, qp_attr, send_flags, wc_flags, QpState, WcOpcode, WcStatus, WrOpcode};
pub use vrdma_core::qp_state::QpType;

/// The verbs device name of vNIC `vnic` (`ibv_device.name` and `dev_name` in the drop-in
/// libibverbs, and the `/dev/infiniband` node `vrdma run` provides for it).
/// At most 63 bytes, as `ibv_device.name` holds (longer vNIC names are cut).
pub fn verbs_device_name(vnic: &str) -> String {
    let mut name = format!("vrdma_{vnic}");
    let mut end = name.len().min(63);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// Path of the control socket when `VRDMA_SOCKET` is not set.
pub const DEFAULT_SOCKET: &str = "/run/vrdma/control.sock";
