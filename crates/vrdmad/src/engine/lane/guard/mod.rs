//! Lane sockets that cannot be turned against the host.
//!
//! A lane's client holds a TCP socket of the daemon's network namespace (see
//! `lane::open_lane`). Unguarded, a container could disconnect it (`connect(AF_UNSPEC)`) and
//! connect it again anywhere this host reaches (loopback services, etcd, other daemons), or
//! `listen` on it for anyone who reaches the host. The kernel remembers which cgroup made a
//! socket, and nothing a socket's holder does changes that; so lane sockets are made by a
//! helper process that lives alone in a cgroup of their own, and cgroup BPF programs on
//! that cgroup confine every socket made there:
//!
//! - `connect` (IPv4 and IPv6) is refused unless the socket was armed, by its cookie, in a
//!   map that the program empties as it allows: the daemon arms each socket for its one
//!   connect to the peer daemon, and no later connect of it can pass.
//! - every segment for such a socket that has no remote end is dropped: a listening socket
//!   never completes a handshake, while a connected lane receives its peer's ACKs.
//! - `bind` is refused: a disconnected lane socket cannot take a port the host's services
//!   want (a lane's own connect binds its port without this hook; a `listen` still takes an
//!   ephemeral one, which receives nothing).
//!
//! The programs stay attached to the cgroup while any of its sockets lives, even after the
//! daemon exits (the kernel keeps a removed cgroup's programs for its sockets). When the
//! kernel lacks any of this (no cgroup v2, no BPF, not root), [`LaneGuard::start`] fails and
//! the daemon runs without lanes. It checks that the kernel enforces both rules before
//! saying yes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;
use vrdma_abi::fd::set_nonblocking;

/// What can fail while setting up or using the guard.
#[derive(Debug, thiserror::Error)]
pub enum LaneGuardError {
    /// No cgroup v2 hierarchy is mounted (`/proc/self/mountinfo`).
    #[error("no cgroup2 file system mounted")]
    NoCgroup2,
    /// Creating, opening or joining the lane cgroup.
    #[error("lane cgroup {path}: {op}: {source}")]
    Cgroup { path: PathBuf, op: &'static str, source: std::io::Error },
    /// A bpf(2) command (map, program load with the verifier's log, attach).
    #[error("bpf {op}: {source}{log}")]
    Bpf { op: &'static str, source: std::io::Error, log: String },
    /// Starting the socket helper, or talking to it.
    #[error("lane socket helper: {op}: {source}")]
    Helper { op: &'static str, source: std::io::Error },
    /// Arming, connecting or configuring one lane socket.
    #[error("lane socket to {addr}: {op}: {source}")]
    Socket { addr: SocketAddr, op: &'static str, source: std::io::Error },
    /// The kernel accepted the programs but did not enforce them.
    #[error("the kernel does not confine lane sockets: {0}")]
    NotEnforced(String),
}

impl LaneGuardError {
    /// Whether the host cannot have the guard at all (no cgroup v2, no BPF, not privileged),
    /// as opposed to the guard failing.
    pub fn unsupported(&self) -> bool {
        let lacking = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::ENOSYS | libc::EROFS));
        match self {
            LaneGuardError::NoCgroup2 => true,
            // (EACCES from a program load is the verifier refusing it: a failure.)
            LaneGuardError::Bpf { op: "load", source, .. } if source.raw_os_error() == Some(libc::EACCES) => false,
            LaneGuardError::Cgroup { source, .. } | LaneGuardError::Bpf { source, .. } => lacking(source),
            _ => false,
        }
    }
}

/// Makes lane sockets in the guarded cgroup (see the module documentation).
pub(crate) struct LaneGuard {
    /// Our end of the helper's socket pair; one request at a time.
    helper: Mutex<UnixStream>,
    helper_pid: libc::pid_t,
    cgroup: PathBuf,
    /// Cookies of sockets allowed one connect.
    armed: OwnedFd,
    /// The attached programs (kept open only for the record: attachment holds them).
    _progs: Vec<OwnedFd>,
}

// bpf(2) commands, types and helpers used here (linux/bpf.h).
const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_MAP_DELETE_ELEM: libc::c_int = 3;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_PROG_TYPE_CGROUP_SKB: u32 = 8;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET_INGRESS: u32 = 0;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
const BPF_CGROUP_INET6_CONNECT: u32 = 11;
const BPF_CGROUP_INET4_BIND: u32 = 8;
const BPF_CGROUP_INET6_BIND: u32 = 9;
const BPF_FUNC_MAP_DELETE_ELEM: i32 = 3;
const BPF_FUNC_GET_SOCKET_COOKIE: i32 = 46;
const BPF_PSEUDO_MAP_FD: u8 = 1;
/// `offsetof(struct __sk_buff, remote_port)`.
const SKB_REMOTE_PORT: i16 = 132;
/// How many sockets can be armed at once (each only between its creation and its connect).
const ARMED_MAX: u32 = 1024;

/// One BPF instruction (`struct bpf_insn`).
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    /// dst_reg and src_reg, a nibble each (see [`insn`]).
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    // (C bit-fields: dst_reg is the low nibble on little-endian hosts, the high one on big.)
    let regs = if cfg!(target_endian = "little") { (src << 4) | dst } else { (dst << 4) | src };
    Insn { code, regs, off, imm }
}
const fn mov64_reg(dst: u8, src: u8) -> Insn {
    insn(0xbf, dst, src, 0, 0)
}
const fn mov64_imm(dst: u8, imm: i32) -> Insn {
    insn(0xb7, dst, 0, 0, imm)
}
const fn add64_imm(dst: u8, imm: i32) -> Insn {
    insn(0x07, dst, 0, 0, imm)
}
const fn call(helper: i32) -> Insn {
    insn(0x85, 0, 0, 0, helper)
}
const fn exit() -> Insn {
    insn(0x95, 0, 0, 0, 0)
}
/// `*(u64 *)(dst + off) = src`.
const fn stx64(dst: u8, off: i16, src: u8) -> Insn {
    insn(0x7b, dst, src, off, 0)
}
/// `dst = *(u32 *)(src + off)`.
const fn ldx32(dst: u8, src: u8, off: i16) -> Insn {
    insn(0x61, dst, src, off, 0)
}
/// `if dst != imm goto +off`.
const fn jne_imm(dst: u8, imm: i32, off: i16) -> Insn {
    insn(0x55, dst, 0, off, imm)
}

/// cgroup/connect4 and connect6: allowed once per armed cookie (deleting it), refused
/// otherwise (0: the connect fails with EPERM).
fn connect_program(armed_fd: RawFd) -> Vec<Insn> {
    vec![
        call(BPF_FUNC_GET_SOCKET_COOKIE), // r0 = cookie of ctx's socket (r1 = ctx)
        stx64(10, -8, 0),
        insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, armed_fd), // r1 = &armed (ld_imm64)
        insn(0, 0, 0, 0, 0),
        mov64_reg(2, 10),
        add64_imm(2, -8),
        call(BPF_FUNC_MAP_DELETE_ELEM), // 0 if it was armed
        jne_imm(0, 0, 2),
        mov64_imm(0, 1),
        exit(),
        mov64_imm(0, 0),
        exit(),
    ]
}

/// cgroup/bind4 and bind6: refused (EPERM). A lane's connect binds its port without this
/// hook; an explicit bind could only take a port the host's services want.
fn bind_program() -> Vec<Insn> {
    vec![mov64_imm(0, 0), exit()]
}

/// cgroup_skb/ingress: drops segments for a socket without a remote end (a listener).
fn ingress_program() -> Vec<Insn> {
    vec![ldx32(2, 1, SKB_REMOTE_PORT), mov64_imm(0, 1), jne_imm(2, 0, 1), mov64_imm(0, 0), exit()]
}

/// `union bpf_attr` (144 bytes in this kernel's headers; the kernel accepts a shorter or
/// zero-padded one), filled field by field.
#[repr(C, align(8))]
struct BpfAttr([u8; 144]);

impl BpfAttr {
    fn new() -> Self {
        BpfAttr([0; 144])
    }
    fn u32(mut self, off: usize, v: u32) -> Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, off: usize, v: u64) -> Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn name(mut self, off: usize, name: &str) -> Self {
        let n = name.len().min(15);
        self.0[off..off + n].copy_from_slice(&name.as_bytes()[..n]);
        self
    }
}

fn bpf(cmd: libc::c_int, attr: &BpfAttr) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, initialised bpf_attr of the size passed; every pointer in it
    // (instructions, license, log, key, value) points to memory live for the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_ptr(), attr.0.len() as libc::c_uint) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn bpf_fd(cmd: libc::c_int, attr: &BpfAttr) -> std::io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: these commands return a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn load(prog_type: u32, attach_type: u32, name: &str, insns: &[Insn]) -> Result<OwnedFd, LaneGuardError> {
    let license = b"GPL\0";
    let mut log = vec![0u8; 16384];
    let attr = BpfAttr::new()
        .u32(0, prog_type)
        .u32(4, insns.len() as u32)
        .u64(8, insns.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .name(48, name)
        .u32(68, attach_type);
    bpf_fd(BPF_PROG_LOAD, &attr).map_err(|source| {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
        LaneGuardError::Bpf { op: "load", source, log: if text.is_empty() { text } else { format!(" (verifier: {text})") } }
    })
}

fn attach(cgroup: &OwnedFd, prog: &OwnedFd, attach_type: u32) -> Result<(), LaneGuardError> {
    let attr = BpfAttr::new().u32(0, cgroup.as_raw_fd() as u32).u32(4, prog.as_raw_fd() as u32).u32(8, attach_type);
    bpf(BPF_PROG_ATTACH, &attr).map(drop).map_err(|source| LaneGuardError::Bpf { op: "attach", source, log: String::new() })
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a hybrid host).
fn cgroup2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // (root, mount point) of each cgroup2 mount; one of the whole hierarchy first.
    let mounts: Vec<(&str, &str)> = info
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mut f = pre.split(' ');
            (post.split(' ').next()? == "cgroup2").then_some((f.nth(3)?, f.next()?))
        })
        .collect();
    let (_, point) = mounts.iter().find(|(root, _)| *root == "/").or(mounts.first())?;
    Some(PathBuf::from(unescape_mountinfo(point)))
}

/// mountinfo writes space, tab, newline and backslash in paths as octal escapes (`\040`).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where [`mount_cgroup2`] mounts the hierarchy.
const OWN_MOUNT: &str = "/run/vrdmad-cgroup2";

/// Mounts the cgroup v2 hierarchy where this mount namespace shows none: `ip netns exec`,
/// for one, mounts a fresh /sys over the one that had it.
fn mount_cgroup2() -> Result<PathBuf, LaneGuardError> {
    let path = PathBuf::from(OWN_MOUNT);
    let err = |op, source| LaneGuardError::Cgroup { path: path.clone(), op, source };
    std::fs::create_dir_all(&path).map_err(|e| err("mkdir", e))?;
    let target = std::ffi::CString::new(OWN_MOUNT).map_err(|e| err("path", e.into()))?;
    let fstype = c"cgroup2";
    // SAFETY: NUL-terminated strings live for the call; no data argument.
    let r = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    // (Only where no cgroup2 shows: a second mount here would stack, not fail.)
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ENODEV) { LaneGuardError::NoCgroup2 } else { err("mount", e) });
    }
    match cgroup2_mount() {
        Some(m) => Ok(m),
        None => Err(LaneGuardError::NoCgroup2),
    }
}

/// Removes lane cgroups of daemons that are gone (empty ones only: rmdir fails otherwise).
fn remove_stale(mount: &Path) {
    let Ok(dir) = std::fs::read_dir(mount) else { return };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix("vrdma-lanes.")).and_then(|p| p.split('.').next()?.parse::<u32>().ok());
        let Some(pid) = pid else { continue };
        // (A minute's grace: a daemon in another PID namespace is not in our /proc, and its
        // new cgroup is empty until its helper joins.)
        let old = entry
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(60));
        if old && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

fn socket_cookie(fd: RawFd) -> std::io::Result<u64> {
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for the kernel to write the 8-byte cookie.
    syscall_result(unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_COOKIE, (&mut cookie as *mut u64).cast(), &mut len) })?;
    Ok(cookie)
}

fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// A system call's result: the errno when it returned a negative value.
fn syscall_result(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// connect(2) on a raw socket.
fn raw_connect(fd: RawFd, addr: &SocketAddr) -> std::io::Result<()> {
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    syscall_result(unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len) })
}

/// bind(2) on a raw socket.
fn raw_bind(fd: RawFd, addr: &SocketAddr) -> std::io::Result<()> {
    let (ss, len) = sockaddr(addr);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    syscall_result(unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) })
}

/// Disconnects a TCP socket (connect with AF_UNSPEC), as a container holding a lane could.
fn disconnect(fd: RawFd) {
    // SAFETY: all-zero is a valid sockaddr (family AF_UNSPEC).
    let unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    // SAFETY: `unspec` is a valid address of the size passed.
    unsafe { libc::connect(fd, &unspec, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t) };
}

/// A finished non-blocking connect's result (SO_ERROR).
fn connect_result(fd: RawFd) -> std::io::Result<()> {
    let mut so_error = 0i32;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: `so_error` and `len` are valid for the kernel to write an int.
    syscall_result(unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, (&mut so_error as *mut i32).cast(), &mut len) })?;
    match so_error {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Waits until `fd` is writable (a connect finished) or `timeout` passes.
fn wait_writable(fd: RawFd, timeout: Duration) -> std::io::Result<bool> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, live for the call.
        let n = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        match n {
            0 => return Ok(false),
            1.. => return Ok(true),
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => continue,
            _ => return Err(std::io::Error::last_os_error()),
        }
    }
}

/// The helper's life, in the forked child: only system calls (async-signal-safe, no
/// allocation; the parent has other threads). Each request is one byte, 4 or 6; the answer
/// is an errno (0) and, on success, the new socket in SCM_RIGHTS.
/// Where the helper goes when the daemon is gone: it leaves its cgroup for the root one and
/// removes it (the programs stay with the lane sockets still alive), however the daemon
/// ended. Built before the fork: the child allocates nothing.
struct HelperExit {
    root_procs: std::ffi::CString,
    cgroup: std::ffi::CString,
}

fn helper_main(ctrl: RawFd, daemons_end: RawFd, exit: &HelperExit) -> ! {
    // SAFETY: system calls on integers and on stack buffers live for each call; the child has
    // no other thread and touches no lock or allocator.
    unsafe {
        let name = b"vrdmad-lanes\0";
        libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0);
        // Nothing of the daemon's but the request socket (and stdio) stays open here: not its
        // listeners, nor the daemon's end of this pair, whose closing must be our end.
        libc::close(daemons_end);
        if ctrl != 3 {
            if libc::dup2(ctrl, 3) < 0 {
                libc::_exit(1);
            }
            libc::close(ctrl);
        }
        // The daemon's signal handlers and mask are not ours.
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2] {
            libc::signal(sig, libc::SIG_DFL);
        }
        if libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32) < 0 {
            for fd in 4..65536 {
                libc::close(fd);
            }
        }
        loop {
            let mut req = 0u8;
            let n = libc::read(3, (&mut req as *mut u8).cast(), 1);
            if n == 0 {
                let fd = libc::open(exit.root_procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"0".as_ptr().cast(), 1); // "0": this process
                    libc::close(fd);
                    libc::rmdir(exit.cgroup.as_ptr());
                }
                libc::_exit(0);
            }
            if n < 0 {
                if *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                libc::_exit(1);
            }
            let domain = if req == 6 { libc::AF_INET6 } else { libc::AF_INET };
            let fd = libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            let mut errno: i32 = if fd < 0 { *libc::__errno_location() } else { 0 };
            let mut iov = libc::iovec { iov_base: (&mut errno as *mut i32).cast(), iov_len: 4 };
            let mut cbuf = [0u64; 4]; // CMSG_SPACE(sizeof(int)) = 24 bytes, 8-aligned
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            if fd >= 0 {
                msg.msg_control = cbuf.as_mut_ptr().cast();
                msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
            }
            let sent = libc::sendmsg(3, &msg, libc::MSG_NOSIGNAL);
            if fd >= 0 {
                libc::close(fd);
            }
            if sent < 0 {
                libc::_exit(1);
            }
        }
    }
}

impl LaneGuard {
    /// Sets the guard up: the lane cgroup, its programs, the helper in it, then a check
    /// that the kernel refuses a guarded socket's second connect and its listener's
    /// handshakes.
    pub(crate) fn start() -> Result<LaneGuard, LaneGuardError> {
        let mount = match cgroup2_mount() {
            Some(m) => m,
            None => mount_cgroup2()?,
        };
        remove_stale(&mount);
        // (pid.n: one daemon process may hold several, as tests do.)
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cgroup = mount.join(format!("vrdma-lanes.{}.{n}", std::process::id()));
        let cg_err = |op, source| LaneGuardError::Cgroup { path: cgroup.clone(), op, source };
        let _ = std::fs::remove_dir(&cgroup); // an earlier daemon of the same pid
        std::fs::create_dir(&cgroup).map_err(|e| cg_err("mkdir", e))?;
        let guard = Self::set_up(&mount, cgroup.clone()).inspect_err(|_| {
            let _ = std::fs::remove_dir(&cgroup);
        })?;
        guard.self_test()?;
        Ok(guard)
    }

    fn set_up(mount: &Path, cgroup: PathBuf) -> Result<LaneGuard, LaneGuardError> {
        let cg_err = |op, source| LaneGuardError::Cgroup { path: cgroup.clone(), op, source };
        let cg_fd = OwnedFd::from(std::fs::File::open(&cgroup).map_err(|e| cg_err("open", e))?);
        let map_attr = BpfAttr::new().u32(0, BPF_MAP_TYPE_HASH).u32(4, 8).u32(8, 4).u32(12, ARMED_MAX).name(28, "vrdma_lane_arm");
        let armed =
            bpf_fd(BPF_MAP_CREATE, &map_attr).map_err(|source| LaneGuardError::Bpf { op: "map create", source, log: String::new() })?;
        let connect = connect_program(armed.as_raw_fd());
        let progs = vec![
            load(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_CGROUP_INET4_CONNECT, "vrdma_lane_c4", &connect)?,
            load(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_CGROUP_INET6_CONNECT, "vrdma_lane_c6", &connect)?,
            load(BPF_PROG_TYPE_CGROUP_SKB, BPF_CGROUP_INET_INGRESS, "vrdma_lane_in", &ingress_program())?,
            load(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_CGROUP_INET4_BIND, "vrdma_lane_b4", &bind_program())?,
            load(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_CGROUP_INET6_BIND, "vrdma_lane_b6", &bind_program())?,
        ];
        let attach_types =
            [BPF_CGROUP_INET4_CONNECT, BPF_CGROUP_INET6_CONNECT, BPF_CGROUP_INET_INGRESS, BPF_CGROUP_INET4_BIND, BPF_CGROUP_INET6_BIND];
        for (prog, attach_type) in progs.iter().zip(attach_types) {
            attach(&cg_fd, prog, attach_type)?;
        }
        let (ours, theirs) = UnixStream::pair().map_err(|source| LaneGuardError::Helper { op: "socketpair", source })?;
        let c_path =
            |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).map_err(|e| cg_err("path", std::io::Error::other(e)));
        let exit = HelperExit { root_procs: c_path(&mount.join("cgroup.procs"))?, cgroup: c_path(&cgroup)? };
        // SAFETY: the child runs `helper_main` only, which makes system calls alone (see it).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(LaneGuardError::Helper { op: "fork", source: std::io::Error::last_os_error() });
        }
        if pid == 0 {
            helper_main(theirs.as_raw_fd(), ours.as_raw_fd(), &exit);
        }
        drop(theirs);
        let guard = LaneGuard { helper: Mutex::new(ours), helper_pid: pid, cgroup: cgroup.clone(), armed, _progs: progs };
        // The helper makes no socket before it is asked, and it is asked only once it is in.
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string()).map_err(|e| cg_err("join", e))?;
        Ok(guard)
    }

    /// A new socket of the guarded cgroup, from the helper.
    fn new_socket(&self, v6: bool) -> std::io::Result<OwnedFd> {
        let mut helper = self.helper.lock();
        helper.write_all(&[if v6 { 6 } else { 4 }])?;
        let mut errno = 0i32;
        let mut iov = libc::iovec { iov_base: (&mut errno as *mut i32).cast(), iov_len: 4 };
        let mut cbuf = [0u64; 4];
        // SAFETY: all-zero is a valid msghdr; its pointers are set to live buffers below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = loop {
            // SAFETY: `msg` describes live buffers; the kernel writes at most their sizes.
            let n = unsafe { libc::recvmsg(helper.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue; // (nothing was taken)
            }
            break n;
        };
        if n != 4 || msg.msg_flags & libc::MSG_CTRUNC != 0 {
            // An answer not taken whole would answer the next request: no more requests.
            let err = if n < 0 { std::io::Error::last_os_error() } else { std::io::Error::from(std::io::ErrorKind::UnexpectedEof) };
            let _ = helper.shutdown(std::net::Shutdown::Both);
            return Err(err);
        }
        // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR checks the control length.
        let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: a non-null header lies within `cbuf`, as recvmsg wrote it.
        if c.is_null() || unsafe { (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS } {
            return Err(std::io::Error::from_raw_os_error(if errno != 0 { errno } else { libc::EPROTO }));
        }
        // SAFETY: an SCM_RIGHTS message from the helper carries exactly one descriptor, now ours.
        let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>()) };
        // SAFETY: the received descriptor is new in this process and owned by no one else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn set_armed(&self, cookie: u64, on: bool) -> std::io::Result<()> {
        let one = 1u32;
        let attr = BpfAttr::new().u32(0, self.armed.as_raw_fd() as u32).u64(8, &cookie as *const u64 as u64);
        // (The kernel wants every field past the command's last one zero: no value to delete.)
        let attr = if on { attr.u64(16, &one as *const u32 as u64) } else { attr };
        match bpf(if on { BPF_MAP_UPDATE_ELEM } else { BPF_MAP_DELETE_ELEM }, &attr) {
            Err(e) if !on && e.raw_os_error() == Some(libc::ENOENT) => Ok(()), // the connect took it
            r => r.map(drop),
        }
    }

    /// A TCP connection to `addr` from a guarded socket: it can never be connected
    /// elsewhere, nor listen.
    pub(crate) fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream, LaneGuardError> {
        let err = |op, source| LaneGuardError::Socket { addr, op, source };
        let fd = self.new_socket(addr.is_ipv6()).map_err(|e| err("socket", e))?;
        let cookie = socket_cookie(fd.as_raw_fd()).map_err(|e| err("cookie", e))?;
        set_nonblocking(&fd, true).map_err(|e| err("nonblocking", e))?;
        self.set_armed(cookie, true).map_err(|e| err("arm", e))?;
        let started = raw_connect(fd.as_raw_fd(), &addr);
        // Whatever happened, this socket has had its one connect.
        let disarmed = self.set_armed(cookie, false);
        match started {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
                if !wait_writable(fd.as_raw_fd(), timeout).map_err(|e| err("connect", e))? {
                    return Err(err("connect", std::io::Error::from(std::io::ErrorKind::TimedOut)));
                }
                connect_result(fd.as_raw_fd()).map_err(|e| err("connect", e))?;
            }
            Err(e) => return Err(err("connect", e)),
        }
        disarmed.map_err(|e| err("disarm", e))?;
        set_nonblocking(&fd, false).map_err(|e| err("blocking", e))?;
        Ok(TcpStream::from(fd))
    }

    /// Checks that the kernel enforces both rules on a guarded socket, over loopback.
    fn self_test(&self) -> Result<(), LaneGuardError> {
        let io = |what: &'static str| move |source| LaneGuardError::Helper { op: what, source };
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io("self-test listener"))?;
        let target = listener.local_addr().map_err(io("self-test listener"))?;
        let s = self.connect(target, Duration::from_secs(2))?;
        let (mut accepted, _) = listener.accept().map_err(io("self-test accept"))?;
        (&s).write_all(b"x").map_err(io("self-test send"))?;
        let mut b = [0u8; 1];
        accepted.read_exact(&mut b).map_err(io("self-test receive"))?;
        // Disconnect, as a container could, then try what it would.
        disconnect(s.as_raw_fd());
        match raw_connect(s.as_raw_fd(), &target) {
            Ok(()) => return Err(LaneGuardError::NotEnforced("a second connect went through".into())),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            Err(e) => return Err(LaneGuardError::NotEnforced(format!("a second connect failed with {e}, not EPERM"))),
        }
        match raw_bind(s.as_raw_fd(), &SocketAddr::from(([127, 0, 0, 1], 0))) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            r => return Err(LaneGuardError::NotEnforced(format!("a bind gave {r:?}, not EPERM"))),
        }
        // SAFETY: listen on a socket we hold.
        if let Err(e) = syscall_result(unsafe { libc::listen(s.as_raw_fd(), 1) }) {
            return Err(LaneGuardError::NotEnforced(format!("listen failed ({e}): the listener rule is untested")));
        }
        let port = s.local_addr().map_err(io("self-test listener"))?.port();
        let listening = SocketAddr::from(([127, 0, 0, 1], port));
        // A handshake over loopback takes microseconds; a dropped SYN is retried after 1 s.
        if TcpStream::connect_timeout(&listening, Duration::from_millis(100)).is_ok() {
            return Err(LaneGuardError::NotEnforced("a guarded socket accepted a connection".into()));
        }
        Ok(())
    }
}

impl Drop for LaneGuard {
    fn drop(&mut self) {
        // Our end closing ends the helper (EOF), which removes its cgroup; the programs stay
        // for the lane sockets that outlive us (the kernel keeps them with the sockets).
        let _ = self.helper.lock().shutdown(std::net::Shutdown::Both);
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.helper_pid, &mut status, 0) };
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

#[cfg(test)]
mod tests;
