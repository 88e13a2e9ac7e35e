//! The crate's one error type.

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;

/// Everything [`ensure_bridge`](crate::ensure_bridge) and
/// [`run_container`](crate::run_container) can fail with: one variant per failing
/// operation, each carrying what it was operating on.
///
/// Variants that wrap an `ip` (iproute2) invocation carry the command line that was run
/// (`command`) and why it failed (`reason`: its trimmed stderr, or its exit status when it
/// printed nothing).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetnsError {
    /// A [`ContainerSpec`](crate::ContainerSpec) field (or an `ensure_bridge` argument) is
    /// unusable; nothing was created.
    #[error("invalid {field}: {reason}")]
    InvalidSpec {
        /// Which field or argument, e.g. `"name"`, `"command"`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The `ip` program could not be started (iproute2 not installed?), or, for commands
    /// run inside the container, the container's network namespace could not be entered.
    #[error("cannot run `{command}`: {source}")]
    SpawnIp {
        /// The command line.
        command: String,
        /// Why it could not be started.
        #[source]
        source: io::Error,
    },

    /// Asking `ip` whether the bridge exists failed for a reason other than "does not exist".
    #[error("querying bridge {bridge} with `{command}` failed: {reason}")]
    QueryBridge {
        /// The bridge name.
        bridge: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// A link with the bridge's name exists but is not a bridge.
    #[error("{bridge} exists but is not a bridge")]
    NotABridge {
        /// The link name.
        bridge: String,
    },

    /// Creating the bridge failed.
    #[error("creating bridge {bridge} with `{command}` failed: {reason}")]
    CreateBridge {
        /// The bridge name.
        bridge: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Listing or adding the gateway address on the bridge failed.
    #[error("assigning {address} to bridge {bridge} with `{command}` failed: {reason}")]
    BridgeAddress {
        /// The bridge name.
        bridge: String,
        /// The address with prefix, e.g. `198.18.0.1/15`.
        address: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Pinning the bridge's MAC address failed.
    #[error("pinning the MAC address of bridge {bridge} with `{command}` failed: {reason}")]
    BridgeMac {
        /// The bridge name.
        bridge: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Setting the bridge up failed.
    #[error("setting bridge {bridge} up with `{command}` failed: {reason}")]
    BridgeUp {
        /// The bridge name.
        bridge: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Creating the mount point for the vNIC directory (`/run/vrdma`) on the host failed.
    #[error("creating mount point {path}: {source}")]
    CreateMountpoint {
        /// The mount point.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// Creating a synchronisation pipe or the signal descriptor failed.
    #[error("creating {what}: {source}")]
    SetupParent {
        /// `"pipe"`, `"signalfd"`, `"signal mask"`.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Forking the container's first process failed.
    #[error("forking the container process: {source}")]
    Fork {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// The container process died before it was ready (killed from outside?).
    #[error("the container process exited during setup with status {status}")]
    ChildDied {
        /// Its exit code (128+signal if killed).
        status: i32,
    },

    /// `unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWPID)` failed in the
    /// container process (`EPERM` without CAP_SYS_ADMIN).
    #[error("unsharing namespaces in the container process: {source}")]
    Unshare {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Creating the veth pair with its peer in the container's network namespace failed.
    #[error("creating veth {host_veth} for container pid {pid} with `{command}` failed: {reason}")]
    CreateVeth {
        /// The host-side interface name.
        host_veth: String,
        /// The container process (whose netns receives `eth0`).
        pid: i32,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Attaching the host veth to the bridge and setting it up failed.
    #[error("attaching {host_veth} to bridge {bridge} with `{command}` failed: {reason}")]
    AttachVeth {
        /// The host-side interface name.
        host_veth: String,
        /// The bridge name.
        bridge: String,
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Configuring `lo`, `eth0`'s address, `eth0` up, or the default route inside the
    /// container's network namespace failed.
    #[error("configuring the container network with `{command}` failed: {reason}")]
    ConfigureContainerNet {
        /// The command line (run inside the container's network namespace).
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },

    /// Telling the container process to continue failed.
    #[error("signalling the container process: {source}")]
    SyncChild {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Making all mounts private (`mount --make-rprivate /`) in the container failed.
    #[error("making mounts private in the container: {source}")]
    MakeMountsPrivate {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Setting the container's hostname failed.
    #[error("setting hostname {hostname:?} in the container: {source}")]
    SetHostname {
        /// The hostname.
        hostname: String,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Bind-mounting the vNIC directory onto `/run/vrdma` failed.
    #[error("bind-mounting {vnic_dir} onto /run/vrdma in the container: {source}")]
    BindVnicDir {
        /// The host vNIC directory.
        vnic_dir: PathBuf,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Covering a hidden path with an empty tmpfs (or `/dev/null`, for a file) failed.
    #[error("hiding {path} in the container: {source}")]
    HidePath {
        /// The path being hidden.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Mounting the container's own `/dev/infiniband` or making a device node in it failed.
    #[error("making /dev/infiniband/{device} in the container: {source}")]
    VerbsDevice {
        /// The device node's name ("" for the `/dev/infiniband` tmpfs itself).
        device: String,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Forking the container's PID 1 failed.
    #[error("forking the container's init process: {source}")]
    ForkInit {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Mounting a sysfs of the container's network namespace on `/sys` failed.
    #[error("mounting /sys in the container: {source}")]
    MountSys {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Mounting a fresh procfs on `/proc` in the container failed.
    #[error("mounting /proc in the container: {source}")]
    MountProc {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Executing the command failed (`ENOENT`: not found on the container's `PATH`).
    #[error("executing {command:?} in the container: {source}")]
    Exec {
        /// `argv[0]`.
        command: String,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Waiting for the container process failed.
    #[error("waiting for the container process: {source}")]
    Wait {
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// A step of the sandbox inside the container failed (see `sandbox::Step` for the list:
    /// read-only root, private /tmp, /dev, /proc masks, capabilities, seccomp …).
    #[error("sandbox step {step:?} in the container: {source}")]
    Sandbox {
        /// Which step, e.g. `"read-only root"`, `"seccomp"`.
        step: &'static str,
        /// The underlying error.
        #[source]
        source: Errno,
    },

    /// Creating, limiting, joining or removing the container's cgroup failed.
    #[error("cgroup {path}: {what}: {source}")]
    Cgroup {
        /// The cgroup directory or control file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// The seccomp filter could not be built for this architecture.
    #[error("building the seccomp filter: {reason}")]
    Seccomp {
        /// seccompiler's error.
        reason: String,
    },
}
