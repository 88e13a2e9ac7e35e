//! `run_container`: the process tree, the child side (between fork and exec) and the
//! orchestration; the parent's watch loop is in `supervisor.rs`, the sandbox's pieces in
//! `sandbox/`.
//!
//! Process tree:
//!
//! ```text
//! caller ── fork ──▶ "setup" process: unshare(NET|NS|UTS|PID), wait for the parent to
//!   │                 join it to its cgroup and plumb the veth; mounts (sandbox/mounts.rs:
//!   │                 private, read-only host, /dev, /tmp, /run, hidden paths,
//!   │                 /run/vrdma), hostname ── fork ──▶ "init" (PID 1 of the new PID ns):
//!   │                 wait for init, exit         mount /proc (masked), drop capabilities,
//!   │                                             seccomp, exec the command
//!   └─ makes the cgroup (sandbox/cgroup.rs), creates the veth pair, configures eth0 inside
//!      the setup process's netns, forwards SIGINT/SIGTERM, waits, deletes the host veth
//!      and the cgroup
//! ```
//!
//! The child side only makes async-signal-safe calls (raw syscalls through `libc`/`nix` on
//! C strings prepared before the fork; no allocation, no locks), so forking from a process
//! with threads does not risk deadlocking on a lock another thread held at fork time.
//! Child → parent messages travel over a pipe as fixed 8-byte records (atomic writes).

use std::ffi::{CString, OsStr};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{pthread_sigmask, signal, SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::{fork, getpid, getppid, pipe2, sethostname, ForkResult, Pid};

use crate::attach::{AttachError, AttachSpec};
use crate::ip::{check_ifname, check_prefix, delete_link};
use crate::sandbox::cgroup::Cgroup;
use crate::sandbox::mounts::{mount_proc, open_bound_dirs, setup_mounts, MountPlan};
use crate::sandbox::{caps, seccomp};
use crate::status::*;
use crate::supervisor::{MaskGuard, Supervisor};
use crate::{ContainerSpec, NetnsError, CONTAINER_VNIC_DIR};

/// The container's interface.
const CONTAINER_IFNAME: &str = "eth0";

/// PATH used when neither the caller's environment nor `spec.env` has one.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Longest hostname Linux accepts (HOST_NAME_MAX).
const HOSTNAME_MAX: usize = 64;

/// Everything the child side needs, prepared (validated, converted to C strings, pointer
/// arrays built) before the fork so the child never allocates.
struct Plan {
    hostname: CString,
    mounts: MountPlan,
    /// The seccomp programs and the capabilities kept, when sandboxed.
    confine: Option<(seccomp::Filters, u64)>,
    /// Candidate paths for `argv[0]`, tried in order like `execvp`.
    candidates: Vec<CString>,
    /// Owns the strings `argv_ptrs` points into.
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    /// Owns the strings `envp_ptrs` points into.
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const libc::c_char>,
    /// The calling process, so the setup process can tell it was orphaned.
    parent: Pid,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> NetnsError {
    NetnsError::InvalidSpec { field, reason: reason.into() }
}

fn cstring(field: &'static str, bytes: &[u8]) -> Result<CString, NetnsError> {
    CString::new(bytes).map_err(|_| invalid(field, format!("{:?} contains a NUL byte", String::from_utf8_lossy(bytes))))
}

fn same_subnet(a: Ipv4Addr, b: Ipv4Addr, prefix_len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
    u32::from(a) & mask == u32::from(b) & mask
}

impl Plan {
    fn new(spec: &ContainerSpec) -> Result<Plan, NetnsError> {
        // Name → hostname.
        if spec.name.is_empty() || spec.name.len() > HOSTNAME_MAX {
            return Err(invalid("name", format!("{:?}: must be 1..=64 bytes", spec.name)));
        }
        if spec.name.contains('/') {
            return Err(invalid("name", format!("{:?}: contains '/'", spec.name)));
        }
        let hostname = cstring("name", spec.name.as_bytes())?;

        // Network.
        check_ifname("bridge", &spec.bridge)?;
        check_prefix(spec.prefix_len)?;
        if spec.ip == spec.gateway {
            return Err(invalid("ip", format!("{} is the gateway's address", spec.ip)));
        }
        if !same_subnet(spec.ip, spec.gateway, spec.prefix_len) {
            return Err(invalid("gateway", format!("{} is not in {}/{}", spec.gateway, spec.ip, spec.prefix_len)));
        }

        // vNIC directory.
        match std::fs::metadata(&spec.vnic_dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(invalid("vnic_dir", format!("{} is not a directory", spec.vnic_dir.display()))),
            Err(e) => return Err(invalid("vnic_dir", format!("{}: {e}", spec.vnic_dir.display()))),
        }
        let vnic_dir = cstring("vnic_dir", spec.vnic_dir.as_os_str().as_bytes())?;
        let lib_dir = spec.lib_dir.as_ref().map(|d| cstring("lib_dir", d.as_os_str().as_bytes())).transpose()?;

        // Hidden paths.
        let mut hide = Vec::with_capacity(spec.hide_paths.len());
        for p in &spec.hide_paths {
            if !p.is_absolute() {
                return Err(invalid("hide_paths", format!("{} is not absolute", p.display())));
            }
            hide.push(cstring("hide_paths", p.as_os_str().as_bytes())?);
        }

        // Verbs device nodes.
        let mut verbs_nodes = Vec::with_capacity(spec.verbs_devices.len());
        for d in &spec.verbs_devices {
            if d.is_empty() || d.contains('/') || d == "." || d == ".." || d.len() > 63 {
                return Err(invalid("verbs_devices", format!("{d:?}: not a device file name")));
            }
            verbs_nodes.push(cstring("verbs_devices", format!("/dev/infiniband/{d}").as_bytes())?);
        }

        // argv.
        let Some(argv0) = spec.command.first() else {
            return Err(invalid("command", "empty"));
        };
        if argv0.is_empty() {
            return Err(invalid("command", "argv[0] is empty"));
        }
        let argv = spec.command.iter().map(|a| cstring("command", a.as_bytes())).collect::<Result<Vec<_>, _>>()?;
        let argv_ptrs = argv.iter().map(|s| s.as_ptr()).chain([std::ptr::null()]).collect();

        // Environment: the caller's, with spec.env replacing or adding variables.
        let mut env: Vec<(Vec<u8>, Vec<u8>)> = std::env::vars_os().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect();
        for (k, v) in &spec.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(invalid("env", format!("{k:?} is not a valid variable name")));
            }
            if v.contains('\0') {
                return Err(invalid("env", format!("value of {k} contains a NUL byte")));
            }
            match env.iter_mut().find(|(ek, _)| ek == k.as_bytes()) {
                Some(slot) => slot.1 = v.as_bytes().to_vec(),
                None => env.push((k.as_bytes().to_vec(), v.as_bytes().to_vec())),
            }
        }
        let path_var = env.iter().find(|(k, _)| k == b"PATH").map(|(_, v)| v.clone()).unwrap_or_else(|| DEFAULT_PATH.as_bytes().to_vec());
        let envp = env
            .into_iter()
            .map(|(mut k, v)| {
                k.push(b'=');
                k.extend_from_slice(&v);
                cstring("env", &k)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let envp_ptrs = envp.iter().map(|s| s.as_ptr()).chain([std::ptr::null()]).collect();

        // Where execvp would look for argv[0], resolved against the command's PATH.
        let candidates = if argv0.contains('/') {
            vec![cstring("command", argv0.as_bytes())?]
        } else {
            path_var
                .split(|&b| b == b':')
                .map(|dir| {
                    let mut c = if dir.is_empty() { b".".to_vec() } else { dir.to_vec() };
                    c.push(b'/');
                    c.extend_from_slice(argv0.as_bytes());
                    cstring("command", &c)
                })
                .collect::<Result<Vec<_>, _>>()?
        };

        let sandbox = &spec.sandbox;
        let confine = if sandbox.enabled { Some((seccomp::build()?, caps::parse(&sandbox.cap_add)?)) } else { None };
        if sandbox.enabled && sandbox.limits.pids == Some(0) {
            return Err(invalid("sandbox", "a pids limit of 0 leaves no room for the command"));
        }
        let mounts = MountPlan {
            vnic_dir,
            hide,
            verbs_nodes,
            sandboxed: sandbox.enabled,
            writable: sandbox.writable || !sandbox.enabled,
            private_tmp: sandbox.private_tmp,
            userns: sandbox.enabled && sandbox.userns,
            lib_dir,
        };
        Ok(Plan { hostname, mounts, confine, candidates, _argv: argv, argv_ptrs, _envp: envp, envp_ptrs, parent: getpid() })
    }
}

/// Host-side veth name: "vr" + 5 hex digits of a hash of the vNIC name + the setup
/// process's pid in hex (unique among live processes). At most 2 + 5 + 6 = 13 bytes.
pub(crate) fn host_veth_name(vnic: &str, pid: i32) -> String {
    // FNV-1a, 32 bit.
    let mut h: u32 = 0x811c_9dc5;
    for b in vnic.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("vr{:05x}{:x}", h & 0xf_ffff, pid)
}

/// Exit code in the shell convention: the code, or 128+signal.
pub(crate) fn decode_wait_status(status: libc::c_int) -> Option<i32> {
    if libc::WIFEXITED(status) {
        Some(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Some(128 + libc::WTERMSIG(status))
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------
// Child side. Everything below until the parent side runs between fork and exec: only
// async-signal-safe calls, no allocation, never returns.

/// Closes the close-on-exec descriptors this (never exec'ing) process inherited, except
/// `keep`. Another thread of the caller may have had pipes open at the fork — e.g.
/// `std::process::Command`'s stdout and exec-status pipes while it runs `ip` for a second
/// container — and holding their write ends would leave that thread waiting for EOF until
/// this container exits. Descriptors without close-on-exec stay, for the command to inherit.
/// Raw syscalls into a stack buffer only (async-signal-safe).
fn close_inherited_cloexec(keep: [RawFd; 2]) {
    // SAFETY: open(2) of a NUL-terminated literal path.
    let dir = unsafe { libc::open(c"/proc/self/fd".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if dir < 0 {
        return;
    }
    // Closing while listing may shift the listing: repeat until a pass closes nothing.
    loop {
        let mut closed = 0;
        // SAFETY: rewinding our own directory descriptor.
        unsafe { libc::lseek(dir, 0, libc::SEEK_SET) };
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: getdents64(2) into a stack buffer of the given length.
            let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            while off + 19 < n as usize {
                // struct linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8, d_name.
                let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
                if reclen == 0 {
                    break;
                }
                let mut fd: i64 = 0;
                let mut digits = 0;
                for &b in &buf[off + 19..(off + reclen).min(n as usize)] {
                    if !b.is_ascii_digit() {
                        break;
                    }
                    fd = fd * 10 + i64::from(b - b'0');
                    digits += 1;
                }
                off += reclen;
                let Ok(fd) = RawFd::try_from(fd) else { continue };
                if digits == 0 || fd < 3 || fd == dir || keep.contains(&fd) {
                    continue;
                }
                // SAFETY: fcntl(2)/close(2) on a descriptor number of this process.
                unsafe {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags >= 0 && flags & libc::FD_CLOEXEC != 0 {
                        libc::close(fd);
                        closed += 1;
                    }
                }
            }
        }
        if closed == 0 {
            break;
        }
    }
    // SAFETY: closing our own directory descriptor.
    unsafe { libc::close(dir) };
}

/// The setup process (first child).
/// Lets every group of the container open ICMP echo sockets in its own network namespace,
/// as podman does: the sandbox takes CAP_NET_RAW (and `no_new_privs` the file capability
/// of `ping`), so `ping` needs the unprivileged datagram socket. It reaches nothing a raw
/// socket would: only echo requests and their replies. Best effort (between fork and exec:
/// system calls only); without it `ping` fails inside, nothing else does. The range is read
/// in the writer's user namespace: in a user-namespaced container it is written once the id
/// maps exist, and covers the mapped groups only (an unmapped bound is refused).
fn allow_unprivileged_ping(range: &[u8]) {
    let path = c"/proc/sys/net/ipv4/ping_group_range";
    // SAFETY: open/write/close of a NUL-terminated path and a live buffer; no allocation.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, range.as_ptr().cast(), range.len());
            libc::close(fd);
        }
    }
}

/// `ping_group_range` in a user-namespaced container: its mapped groups, 0..USERNS_SIZE
/// (a unit test checks the two agree).
const USERNS_PING_RANGE: &str = "0 65535";

fn setup_process(plan: &Plan, sync_rd: RawFd, status_wr: RawFd) -> ! {
    // Die with the caller: the container must not outlive `vrdma run`.
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if getppid() != plan.parent {
        child_exit(1); // the caller died before prctl took effect
    }
    close_inherited_cloexec([sync_rd, status_wr]);

    let mut flags = CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWPID;
    if plan.mounts.userns {
        // Created first, it owns the other new namespaces: root inside, USERNS_BASE outside.
        flags |= CloneFlags::CLONE_NEWUSER;
    }
    if let Err(e) = unshare(flags) {
        fail(status_wr, MSG_UNSHARE, e);
    }
    // Still the caller's ids (a new user namespace's root only once its maps are written):
    // a private run directory above the vNIC's may be searchable by them alone.
    let bound_dirs = match open_bound_dirs(&plan.mounts) {
        Ok(dirs) => dirs,
        Err((code, e)) => fail(status_wr, code, e),
    };
    if !plan.mounts.userns {
        allow_unprivileged_ping(b"0 2147483647");
    }
    report(status_wr, MSG_READY, 0);

    // Wait for the parent to plumb eth0 into our network namespace.
    let mut byte = [0u8; 1];
    loop {
        match nix::unistd::read(sync_rd, &mut byte) {
            Ok(1) => break,
            Err(Errno::EINTR) => continue,
            _ => child_exit(1), // the parent gave up
        }
    }
    if plan.mounts.userns {
        // The parent has written our uid/gid maps: become the namespace's root.
        // SAFETY: set*id(2) with integer arguments and setgroups(2) with an empty list.
        let rc = unsafe {
            if libc::setresgid(0, 0, 0) != 0 || libc::setgroups(0, std::ptr::null()) != 0 || libc::setresuid(0, 0, 0) != 0 {
                -1
            } else {
                0
            }
        };
        if rc != 0 {
            fail(status_wr, STEP_USERNS, Errno::last());
        }
        // Changing uid or gid cleared the parent death signal: set it again.
        let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
        if getppid() != plan.parent {
            child_exit(1);
        }
        allow_unprivileged_ping(USERNS_PING_RANGE.as_bytes());
    }

    if let Err((code, e)) = setup_mounts(&plan.mounts, bound_dirs) {
        fail(status_wr, code, e);
    }
    if let Err(e) = sethostname(OsStr::from_bytes(plan.hostname.to_bytes())) {
        fail(status_wr, MSG_HOSTNAME, e);
    }

    // SAFETY: fork in a process that only runs async-signal-safe code; the child runs
    // `init_process`, which never returns.
    match unsafe { fork() } {
        Err(e) => fail(status_wr, MSG_FORK_INIT, e),
        Ok(ForkResult::Child) => init_process(plan, status_wr),
        Ok(ForkResult::Parent { child }) => {
            report(status_wr, MSG_INIT_PID, child.as_raw());
            // SAFETY: closing descriptors this process owns and no longer uses, so the
            // parent sees EOF once init has exec'd.
            unsafe {
                libc::close(status_wr);
                libc::close(sync_rd);
            }
            loop {
                let mut status: libc::c_int = 0;
                // SAFETY: waitpid(2) on our own child with a valid out-pointer.
                let rc = unsafe { libc::waitpid(child.as_raw(), &mut status, 0) };
                if rc == child.as_raw() {
                    if let Some(code) = decode_wait_status(status) {
                        child_exit(code);
                    }
                } else if Errno::last() != Errno::EINTR {
                    child_exit(1);
                }
            }
        }
    }
}

/// The container's init (PID 1 of the new PID namespace).
fn init_process(plan: &Plan, status_wr: RawFd) -> ! {
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if let Err((code, e)) = mount_proc(&plan.mounts) {
        fail(status_wr, code, e);
    }
    // Start the command in the state std::process::Command gives children: empty signal
    // mask (the parent blocked SIGINT/SIGTERM), SIGPIPE at its default (Rust ignores it).
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    // SAFETY: resetting a disposition to SIG_DFL installs no handler.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    // Confinement last, right before exec: capabilities (dropping needs CAP_SETPCAP, and
    // the mounts above needed CAP_SYS_ADMIN), then no_new_privs and seccomp.
    if let Some((filters, keep)) = &plan.confine {
        if let Err(e) = caps::drop_all_but(*keep) {
            fail(status_wr, STEP_CAPS, e);
        }
        if let Err(e) = seccomp::install(filters) {
            fail(status_wr, STEP_SECCOMP, e);
        }
    }

    // execvp's search, over candidates resolved before the fork.
    let mut err = Errno::ENOENT;
    let mut saw_eacces = false;
    for path in &plan.candidates {
        // SAFETY: `path` and every pointer in the NULL-terminated `argv_ptrs`/`envp_ptrs`
        // point into CStrings owned by `plan`, alive until exec replaces the image.
        unsafe { libc::execve(path.as_ptr(), plan.argv_ptrs.as_ptr(), plan.envp_ptrs.as_ptr()) };
        err = Errno::last();
        match err {
            Errno::EACCES => saw_eacces = true,
            Errno::ENOENT | Errno::ENOTDIR | Errno::ESTALE | Errno::ELOOP | Errno::ENAMETOOLONG | Errno::ENODEV | Errno::ETIMEDOUT => {}
            _ => break,
        }
    }
    if saw_eacces && err != Errno::EACCES && matches!(err, Errno::ENOENT | Errno::ENOTDIR) {
        err = Errno::EACCES;
    }
    report(status_wr, MSG_EXEC, err as i32);
    child_exit(if err == Errno::ENOENT { 127 } else { 126 })
}

/// Gives the setup process's network namespace its `eth0` through the CNI plugin's own
/// plumbing ([`attach`](crate::attach::attach)): the veth pair, the host end on the bridge,
/// the address with the MAC fixed by it ([`container_mac`](crate::attach::container_mac)),
/// `lo` up and the default route via the bridge's address. One definition of a container's
/// network for `vrdma run` and for the containers of other runtimes.
fn plumb(spec: &ContainerSpec, pid: Pid, host_veth: &str) -> Result<(), NetnsError> {
    let attach = AttachSpec {
        netns: PathBuf::from(format!("/proc/{}/ns/net", pid.as_raw())),
        ifname: CONTAINER_IFNAME.into(),
        host_veth: host_veth.into(),
        bridge: spec.bridge.clone(),
        ip: spec.ip,
        prefix_len: spec.prefix_len,
        gateway: spec.gateway,
        routes: vec![(Ipv4Addr::UNSPECIFIED, 0)],
    };
    crate::attach::attach(&attach).map(drop).map_err(|e| attach_error(e, spec, pid, host_veth))
}

/// `attach`'s error as the step of `run_container` that failed, so `vrdma run` reports
/// what it reported before it shared the plumbing.
fn attach_error(e: AttachError, spec: &ContainerSpec, pid: Pid, host_veth: &str) -> NetnsError {
    match e {
        AttachError::InvalidSpec(e) => e,
        AttachError::SpawnIp { command, source } => NetnsError::SpawnIp { command, source },
        AttachError::LinkExists { name, place } => NetnsError::CreateVeth {
            host_veth: host_veth.into(),
            pid: pid.as_raw(),
            command: format!("ip link add {host_veth} type veth peer name {CONTAINER_IFNAME}"),
            reason: format!("{name} already exists in {place}"),
        },
        AttachError::OpenNetns { path, source } => {
            NetnsError::ConfigureContainerNet { command: format!("open {}", path.display()), reason: source.to_string() }
        }
        AttachError::Attach { command, reason } if command.starts_with("ip link add ") => {
            NetnsError::CreateVeth { host_veth: host_veth.into(), pid: pid.as_raw(), command, reason }
        }
        AttachError::Attach { command, reason } if command.contains(" master ") => {
            NetnsError::AttachVeth { host_veth: host_veth.into(), bridge: spec.bridge.clone(), command, reason }
        }
        AttachError::Attach { command, reason } | AttachError::Detach { command, reason } | AttachError::Inspect { command, reason } => {
            NetnsError::ConfigureContainerNet { command, reason }
        }
    }
}

pub(crate) fn run_container(spec: &ContainerSpec) -> Result<i32, NetnsError> {
    let plan = Plan::new(spec)?;
    let mountpoint = Path::new(CONTAINER_VNIC_DIR);
    // A sandboxed container's /run and /dev are its own; otherwise the mount points are
    // the host's.
    if plan.mounts.writable && !mountpoint.is_dir() {
        std::fs::create_dir_all(mountpoint)
            .map_err(|source| NetnsError::CreateMountpoint { path: PathBuf::from(CONTAINER_VNIC_DIR), source })?;
    }
    // The container's /dev/infiniband is mounted over the host's; a host without RDMA
    // hardware gets the empty directory its udev rules would make for one.
    let devices = Path::new("/dev/infiniband");
    if !plan.mounts.sandboxed && !spec.verbs_devices.is_empty() && !devices.is_dir() {
        std::fs::create_dir_all(devices).map_err(|source| NetnsError::CreateMountpoint { path: devices.to_path_buf(), source })?;
    }

    let pipe_err = |source| NetnsError::SetupParent { what: "pipe", source };
    let (sync_rd, sync_wr) = pipe2(OFlag::O_CLOEXEC).map_err(pipe_err)?;
    let (status_rd, status_wr) = pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(pipe_err)?;

    let mut forwarded = SigSet::empty();
    forwarded.add(Signal::SIGINT);
    forwarded.add(Signal::SIGTERM);
    // Blocked before the fork so no signal is lost between fork and signalfd; the setup
    // process keeps them blocked, init unblocks everything before exec.
    let _mask = MaskGuard::block(&forwarded)?;
    let sigfd = SignalFd::with_flags(&forwarded, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(|source| NetnsError::SetupParent { what: "signalfd", source })?;

    // SAFETY: the child runs only async-signal-safe code on data prepared above (see the
    // module docs) and ends in _exit or exec; it never returns into the caller.
    let child = match unsafe { fork() } {
        Err(source) => return Err(NetnsError::Fork { source }),
        Ok(ForkResult::Child) => {
            let (sync, status) = (sync_rd.as_raw_fd(), status_wr.as_raw_fd());
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| setup_process(&plan, sync, status)));
            child_exit(1)
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    drop(sync_rd);
    drop(status_wr);

    let mut sup = Supervisor::new(child, sigfd, status_rd);
    let result = supervise(spec, &mut sup, sync_wr);
    sup.forward_signals(); // consume what arrived too late to forward
    result
}

fn supervise(spec: &ContainerSpec, sup: &mut Supervisor, sync_wr: OwnedFd) -> Result<i32, NetnsError> {
    // 1. Until the setup process has its namespaces.
    if let Err(e) = sup.wait_until(|s| s.ready || s.failure.is_some() || s.exit.is_some()) {
        sup.abort();
        return Err(e);
    }
    if !sup.ready || sup.failure.is_some() {
        sup.abort();
        return Err(sup.failure_error(spec).unwrap_or(NetnsError::ChildDied { status: sup.exit.unwrap_or(-1) }));
    }

    // 2. Its cgroup (init and everything it forks inherit it), network, then let it
    // continue.
    let cgroup = if spec.sandbox.enabled { Cgroup::create(&spec.name, sup.child.as_raw(), &spec.sandbox.limits) } else { Ok(None) };
    let joined = cgroup.and_then(|cg| match cg {
        Some(cg) => match cg.add(sup.child.as_raw()) {
            Ok(()) => Ok(Some(cg)),
            Err(e) => {
                cg.remove();
                Err(e)
            }
        },
        None => Ok(None),
    });
    let cgroup = match joined {
        Ok(cg) => cg,
        Err(e) => {
            sup.abort();
            return Err(e);
        }
    };
    let mapped = if spec.sandbox.enabled && spec.sandbox.userns { write_id_maps(sup.child.as_raw()) } else { Ok(()) };
    let result = mapped.and_then(|()| supervise_network(spec, sup, sync_wr));
    if result.is_err() {
        sup.abort();
    }
    if let Some(cg) = cgroup {
        cg.remove();
    }
    result
}

/// Maps the container's uids and gids 0..USERNS_SIZE to USERNS_BASE.. on the host.
fn write_id_maps(pid: i32) -> Result<(), NetnsError> {
    let map = format!("0 {} {}\n", crate::sandbox::USERNS_BASE, crate::sandbox::USERNS_SIZE);
    for file in ["uid_map", "gid_map"] {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        std::fs::write(&path, &map).map_err(|source| NetnsError::Cgroup { path, what: "writing the user namespace's id map", source })?;
    }
    Ok(())
}

fn supervise_network(spec: &ContainerSpec, sup: &mut Supervisor, sync_wr: OwnedFd) -> Result<i32, NetnsError> {
    let host_veth = host_veth_name(&spec.name, sup.child.as_raw());
    let go = plumb(spec, sup.child, &host_veth)
        .and_then(|()| nix::unistd::write(&sync_wr, &[1u8]).map(drop).map_err(|source| NetnsError::SyncChild { source }));
    drop(sync_wr);
    if let Err(e) = go {
        sup.abort();
        delete_link(&host_veth);
        return Err(e);
    }

    // 3. Until it exits.
    let waited = sup.wait_until(|s| s.exit.is_some());
    if waited.is_err() {
        sup.abort();
    }
    sup.read_status();
    delete_link(&host_veth);
    waited?;
    if let Some(e) = sup.failure_error(spec) {
        return Err(e);
    }
    Ok(sup.exit.unwrap_or(-1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ping_range_is_the_mapped_groups() {
        assert_eq!(USERNS_PING_RANGE, format!("0 {}", crate::sandbox::USERNS_SIZE - 1));
    }

    #[test]
    fn mountpoint_constants_agree() {
        assert_eq!(crate::sandbox::mounts::VNIC_MOUNTPOINT.to_str().unwrap(), CONTAINER_VNIC_DIR);
    }

    #[test]
    fn veth_names_fit_ifnamsiz() {
        let n = host_veth_name("a-very-long-vnic-name-indeed", 4_194_303);
        assert!(n.len() <= crate::ip::IFNAME_MAX, "{n}");
        assert!(n.starts_with("vr"));
        assert_ne!(host_veth_name("a", 42), host_veth_name("b", 42));
        assert_ne!(host_veth_name("a", 42), host_veth_name("a", 43));
    }

    #[test]
    fn subnet_check() {
        let gw = Ipv4Addr::new(198, 18, 0, 1);
        assert!(same_subnet(Ipv4Addr::new(198, 19, 3, 4), gw, 15));
        assert!(!same_subnet(Ipv4Addr::new(198, 20, 0, 4), gw, 15));
        assert!(same_subnet(Ipv4Addr::new(1, 2, 3, 4), gw, 0));
        assert!(!same_subnet(Ipv4Addr::new(198, 18, 0, 2), gw, 32));
    }

    #[test]
    fn wait_status_decoding() {
        assert_eq!(decode_wait_status(7 << 8), Some(7));
        assert_eq!(decode_wait_status(libc::SIGKILL), Some(137));
    }
}
