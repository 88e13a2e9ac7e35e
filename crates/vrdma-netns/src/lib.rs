//! vrdma's minimal container runtime, behind `vrdma run`.
//!
//! [`run_container`] starts a command in new network, mount, UTS and PID namespaces:
//!
//! - **network**: a veth pair whose host end (named `vr…`, see [`run_container`]) is attached
//!   to a host bridge (made with [`ensure_bridge`]) and whose other end is `eth0` in the
//!   container, with the spec's address, `lo` up and a default route via the bridge's
//!   address;
//! - **mounts**: all mounts made private, the vNIC's host directory bind-mounted at
//!   [`CONTAINER_VNIC_DIR`] (`/run/vrdma`, hiding the host's other vNICs and the admin
//!   socket), an empty tmpfs over each existing `hide_paths` entry, a `/dev/infiniband` of
//!   its own with the `verbs_devices` nodes (if any), a `/sys` of the container's network
//!   namespace (as `ip netns exec` mounts it) and a fresh `/proc`.
//!   The rest of the host filesystem stays visible, so installed programs run;
//! - **UTS**: the hostname is the vNIC name;
//! - **PID**: the command is PID 1 of its PID namespace.
//!
//! and, unless [`Sandbox::enabled`] is false, a sandbox (docs/security.md, "Containers"):
//! a read-only view of the host's root with private /tmp, /var/tmp, /run, its own /dev
//! and masked /proc, no capabilities but those asked for, `no_new_privs`, a seccomp filter,
//! and cgroup limits on processes, memory and CPU (see the [`sandbox`] module).
//! Without it, this is isolation for addressing only: the command runs as root with the
//! caller's capabilities and could undo its mounts.
//!
//! Requirements: root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2's `ip`, Linux ≥ 5.3 for
//! exit notification through a pidfd (older kernels fall back to polling every 50 ms),
//! Linux ≥ 5.12 for the sandbox's read-only root (`mount_setattr`; else use `writable`),
//! cgroup v2 or v1 with the pids, memory and cpu controllers for its limits.
//!
//! # Threads
//!
//! [`run_container`] forks. Call it from a single-threaded process (the `vrdma` CLI) before
//! starting any threads. It is written to survive being called from a multi-threaded
//! process too (the child side makes only async-signal-safe calls on data prepared before
//! the fork; the tests rely on this), with these caveats: a SIGINT/SIGTERM delivered to
//! another thread is not forwarded (and kills the process with its default action; the
//! container then dies with it), and descriptors other threads open without `O_CLOEXEC`
//! around the fork leak into the container. (Close-on-exec ones are closed in the setup
//! process at once: held there, another thread's `Command` pipes would never see EOF.)

pub mod attach;
mod container;
mod error;
mod ip;
pub mod sandbox;
mod status;
mod supervisor;

use std::net::Ipv4Addr;
use std::path::PathBuf;

pub use error::NetnsError;
pub use ip::ensure_bridge;
pub use sandbox::{parse_size, Limits, Sandbox};

/// Where the vNIC directory appears inside the container.
pub const CONTAINER_VNIC_DIR: &str = "/run/vrdma";
/// Where [`ContainerSpec::lib_dir`] appears when the sandbox covers `/run`.
pub const CONTAINER_LIB_MOUNT: &str = "/run/vrdma-lib";

/// What to run and how to wire it up; input to [`run_container`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    /// vNIC name: the container's hostname (at most 64 bytes, no `/`) and the seed of the
    /// host veth's name.
    pub name: String,
    /// The vNIC's host directory, e.g. `/run/vrdma/vnics/<name>`; bind-mounted at
    /// [`CONTAINER_VNIC_DIR`] inside. Must exist.
    pub vnic_dir: PathBuf,
    /// The container's address on `eth0` (vrdma uses 198.18.0.0/15).
    pub ip: Ipv4Addr,
    /// Prefix length of `ip`'s subnet, e.g. 15; 1..=32, and `gateway` must be in it.
    pub prefix_len: u8,
    /// The default route's next hop: the bridge's address, e.g. 198.18.0.1.
    pub gateway: Ipv4Addr,
    /// Host bridge the veth is attached to, e.g. `vrdma0` (see [`ensure_bridge`]).
    pub bridge: String,
    /// argv of the command; `command[0]` is looked up on `PATH` like `execvp` does (the
    /// `PATH` from `env` if set there, else the caller's).
    pub command: Vec<String>,
    /// Variables set for the command on top of the caller's environment (same name:
    /// replaced).
    pub env: Vec<(String, String)>,
    /// Absolute host paths to hide inside: each existing directory is covered with an empty
    /// tmpfs (an existing file with `/dev/null`); missing ones are skipped. Resolved after
    /// `/run/vrdma` is replaced, so paths under `/run/vrdma` refer to the vNIC's directory.
    pub hide_paths: Vec<PathBuf>,
    /// Verbs device node names (e.g. `vrdma_<vnic>`, the drop-in's `ibv_device.dev_name`) to
    /// provide in the container's own `/dev/infiniband`: a tmpfs there (which also hides the
    /// host's RDMA devices) holds one character node per name that behaves as `/dev/null`.
    /// Libraries such as UCX only use a verbs device whose `/dev/infiniband/<dev_name>` is a
    /// read-writable character device; the drop-in itself never opens it. Empty: the
    /// container's `/dev/infiniband` is the host's.
    pub verbs_devices: Vec<String>,
    /// A host directory of libraries (vrdma's drop-in) bound read-only at
    /// [`CONTAINER_LIB_MOUNT`] when the sandbox covers `/run` (sandboxed, not `writable`;
    /// [`lib_dir_is_mounted`] says so). Opened with the caller's ids, like the vNIC's
    /// directory, so a user-namespaced container loads it even where its root could not
    /// search the host path. Otherwise the container uses it where it is.
    pub lib_dir: Option<PathBuf>,
    /// How strictly the command is confined (see [`Sandbox`]; the default is the full
    /// sandbox).
    pub sandbox: Sandbox,
}

/// Whether a container with `sandbox` sees [`ContainerSpec::lib_dir`] at
/// [`CONTAINER_LIB_MOUNT`] (else at its host path).
pub fn lib_dir_is_mounted(sandbox: &Sandbox) -> bool {
    sandbox.enabled && !sandbox.writable
}

/// Runs `spec.command` in a new container to completion and returns its exit code
/// (128 + signal number if a signal killed it).
///
/// The command inherits stdin, stdout, stderr, the working directory and the caller's
/// environment (plus `spec.env`). The host end of the veth pair is named
/// `vr` + 5 hex digits of a hash of `spec.name` + the container's setup process id in hex
/// (at most 13 bytes, unique while the container runs) and is deleted afterwards.
///
/// Signals: while this runs, SIGINT and SIGTERM are blocked in the calling thread and
/// handled here: the first is forwarded to the command (PID 1 of its namespace, which
/// ignores signals it installed no handler for, like any container init); a second one, or
/// the container still running 3 seconds after the first, kills it with SIGKILL (as
/// `docker stop` does after its grace period). If the calling thread dies, the container is killed
/// (`PR_SET_PDEATHSIG`).
///
/// See the [crate docs](crate) for requirements and threading.
///
/// # Errors
///
/// [`NetnsError::InvalidSpec`] before anything is created; otherwise the variant of the
/// step that failed, e.g. [`NetnsError::Unshare`] (`EPERM` when not root),
/// [`NetnsError::CreateVeth`], [`NetnsError::BindVnicDir`], or [`NetnsError::Exec`] when
/// the command cannot be executed (`ENOENT`: not found). Any veth created is removed and
/// the container's processes are killed before an error is returned.
pub fn run_container(spec: &ContainerSpec) -> Result<i32, NetnsError> {
    container::run_container(spec)
}
