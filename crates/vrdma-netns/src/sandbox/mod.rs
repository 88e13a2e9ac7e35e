//! What makes `vrdma run` a sandbox (issue 26, docs/security.md): the filesystem view
//! ([`mounts`]), capabilities ([`caps`]), the seccomp filter ([`seccomp`]) and the cgroup
//! limits ([`cgroup`]). [`Sandbox`] is the caller's say in it.

pub(crate) mod caps;
pub(crate) mod cgroup;
pub(crate) mod mounts;
pub(crate) mod seccomp;

pub use cgroup::parse_size;

/// How strictly a container is confined; part of [`ContainerSpec`](crate::ContainerSpec).
/// The default is the full sandbox with [`Limits::default`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// False: none of the sandbox (today's `--privileged`): every capability of the caller,
    /// no seccomp, the host's /dev and a writable host filesystem, no limits. For trusted use.
    pub enabled: bool,
    /// Capabilities kept (names as in capabilities(7), with or without `CAP_`); by default
    /// none.
    pub cap_add: Vec<String>,
    /// Keep the host's filesystem writable, and /tmp, /var/tmp and /run the host's.
    pub writable: bool,
    /// /tmp a plain empty tmpfs; by default it is the host's /tmp under a private writable
    /// layer (what the container writes stays in it; the host's files show through).
    pub private_tmp: bool,
    /// cgroup limits.
    pub limits: Limits,
    /// A user namespace: uid/gid 0..65536 inside are [`USERNS_BASE`].. outside, so that the
    /// container's root is nobody on the host (its files show as owned by `nobody`). On by
    /// default where the kernel offers user namespaces ([`userns_available`]).
    pub userns: bool,
}

/// Whether this kernel lets us create a user namespace (`user.max_user_namespaces` above 0;
/// a kernel built without them has no such file).
pub fn userns_available() -> bool {
    std::fs::read_to_string("/proc/sys/user/max_user_namespaces").ok().and_then(|s| s.trim().parse::<u64>().ok()).is_some_and(|n| n > 0)
}

/// The host uid and gid of a user-namespaced container's root.
pub const USERNS_BASE: u32 = 1_000_000;
/// How many ids a user-namespaced container has.
pub const USERNS_SIZE: u32 = 65_536;

impl Default for Sandbox {
    fn default() -> Sandbox {
        Sandbox {
            enabled: true,
            cap_add: Vec::new(),
            writable: false,
            private_tmp: false,
            limits: Limits::default(),
            userns: userns_available(),
        }
    }
}

/// The container's cgroup limits; `None`: unlimited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most processes and threads at once (`pids.max`).
    pub pids: Option<u64>,
    /// Most memory in bytes (`memory.max`; swap is off for the container).
    pub memory: Option<u64>,
    /// CPU time in thousandths of a CPU (`cpu.max`), e.g. 1500 for `--cpus 1.5`.
    pub cpu_millis: Option<u64>,
}

/// Default `pids.max`: podman's default, ample for MPI ranks with UCX's threads.
pub const DEFAULT_PIDS_LIMIT: u64 = 2048;

impl Default for Limits {
    /// [`DEFAULT_PIDS_LIMIT`] processes, half of the host's RAM (one container cannot push
    /// the host into its OOM killer, and a large job still fits), no CPU limit (CPU time is
    /// shared fairly by the scheduler and a quota slows latency-bound RDMA loops).
    fn default() -> Limits {
        Limits { pids: Some(DEFAULT_PIDS_LIMIT), memory: half_of_ram(), cpu_millis: None }
    }
}

/// Half of MemTotal, or `None` where /proc/meminfo cannot be read.
pub fn half_of_ram() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024 / 2)
}
