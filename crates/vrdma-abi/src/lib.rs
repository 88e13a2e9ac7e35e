//! Shared layouts of vrdma.
//!
//! * [`shm`] is the only module that touches raw shared memory: unsafe constructors with a
//!   written `# Safety` contract, a safe bounds-checked API on top.
//! * [`ring`] builds the receive queues and inbound-completion rings that two processes
//!   share on the direct data path, on top of [`shm`].
//! * [`control`] is the control protocol between a client library and vrdmad: `repr(C)`
//!   header plus a bounds-checked payload codec, validated on every receive.
//! * [`wire`] is the host-to-host protocol between vrdmads (mediated path).
//! * [`seal`] is the record format of sealed frames (AES-128-GCM) on daemon connections
//!   and lanes.
//! * [`ud`] is the format of UD datagrams to other hosts (client → vrdmad → vrdmad).
//! * [`verbs`] holds the verbs constants (opcodes, statuses, access flags) both sides use.
//! * [`fd`] has the eventfd and `O_NONBLOCK` helpers both sides use.
//! * [`procmap`] finds the mappings of an address space around a range (both sides check
//!   memory against them).
//! * `repr_enum!` defines the `repr` enums of the above with their checked decoders.

pub mod channel;
pub mod control;
pub mod fd;
pub mod procmap;
mod repr_enum;
pub mod ring;
pub mod seal;
pub mod shm;
pub mod ud;
pub mod verbs;
pub mod wire;
