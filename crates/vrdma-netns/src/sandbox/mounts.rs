//! The container's mount tree, made by the setup process (everything but `/proc`) and by
//! the container's init (`/proc`, which must belong to the new PID namespace).
//!
//! Sandboxed (the default):
//!
//! - every mount made private, then the whole inherited tree read-only, nosuid and nodev
//!   (`mount_setattr(AT_RECURSIVE)`, Linux ≥ 5.12), `/sys` included (a sysfs of the
//!   container's network namespace);
//! - `/dev` a fresh tmpfs with null, zero, full, random, urandom and tty, `/dev/pts`
//!   (a new devpts instance), `/dev/shm`, and `/dev/infiniband` with the verbs nodes;
//! - `/tmp` the host's `/tmp` under a private writable tmpfs layer (overlayfs: programs
//!   built on the host in `/tmp` run, nothing written reaches the host), or a plain private
//!   tmpfs (`private_tmp`, or where overlayfs is missing); `/var/tmp` and `/run` private
//!   tmpfs; the hidden paths covered;
//! - `/run/vrdma` the vNIC's directory (bound from a descriptor opened before anything was
//!   covered), read-only: the only thing of vrdma the container sees;
//! - `/proc` its own, with Docker's masks (kcore, keys, timer_list, … covered; sys,
//!   sysrq-trigger, irq, bus, fs read-only).
//!
//! With `writable`, the host's tree stays writable and `/tmp`, `/var/tmp`, `/run` are the
//! host's (`/run/vrdma` is bound over the host's mount point), as before the sandbox.
//!
//! Everything here runs between fork and exec: raw syscalls on C strings prepared before the
//! fork, no allocation.

use std::ffi::CStr;
use std::os::fd::RawFd;

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{stat, SFlag};

use crate::status::*;

/// What the mount steps need, prepared before the fork.
pub(crate) struct MountPlan {
    /// The vNIC's host directory.
    pub vnic_dir: std::ffi::CString,
    /// Paths covered with an empty tmpfs (directories) or /dev/null (files).
    pub hide: Vec<std::ffi::CString>,
    /// `/dev/infiniband/<name>` for each verbs device.
    pub verbs_nodes: Vec<std::ffi::CString>,
    /// Sandbox the filesystem (fresh /dev, /proc masks); false: as before the sandbox.
    pub sandboxed: bool,
    /// The host's tree stays writable, /tmp /var/tmp /run are the host's.
    pub writable: bool,
    /// /tmp a plain tmpfs instead of a private layer over the host's /tmp.
    pub private_tmp: bool,
    /// In a user namespace: device nodes are the host's, bound (mknod is not allowed).
    pub userns: bool,
    /// A host directory bound at [`LIB_MOUNTPOINT`] (only where /run is ours).
    pub lib_dir: Option<std::ffi::CString>,
}

/// Where the library directory appears (`CONTAINER_LIB_MOUNT` as a C string).
pub(crate) const LIB_MOUNTPOINT: &CStr = c"/run/vrdma-lib";

/// Where the vNIC directory appears (`CONTAINER_VNIC_DIR` as a C string).
pub(crate) const VNIC_MOUNTPOINT: &CStr = c"/run/vrdma";

type Step = Result<(), (u32, Errno)>;

const NONE: Option<&CStr> = None;

fn at(code: u32) -> impl Fn(Errno) -> (u32, Errno) {
    move |e| (code, e)
}

fn tmpfs(target: &CStr, flags: MsFlags, data: &CStr) -> Result<(), Errno> {
    mount(Some(c"tmpfs"), target, Some(c"tmpfs"), flags, Some(data))
}

/// `/proc/self/fd/<fd>` into `buf` (a bind mount's source for a descriptor). Async-signal-safe.
fn fd_path(fd: RawFd, buf: &mut [u8; 32]) -> &CStr {
    let prefix = b"/proc/self/fd/";
    buf[..prefix.len()].copy_from_slice(prefix);
    let mut digits = [0u8; 12];
    let mut n = fd.unsigned_abs();
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[prefix.len() + i] = digits[len - 1 - i];
    }
    buf[prefix.len() + len] = 0;
    CStr::from_bytes_until_nul(&buf[..]).unwrap_or(c"/")
}

/// The directories bound into the container, as descriptors.
pub(crate) struct BoundDirs {
    vnic: RawFd,
    lib: Option<RawFd>,
}

/// The vNIC directory (and the library directory, if any) as descriptors, opened by the
/// setup process in its new mount namespace before it takes a user namespace's ids and
/// before /run (or the run directory, if hidden) is covered: as the container's root the
/// directories above them (a private run directory's, a home directory) may not be
/// searchable.
pub(crate) fn open_bound_dirs(p: &MountPlan) -> Result<BoundDirs, (u32, Errno)> {
    let open = |path: &CStr, step: u32| {
        // SAFETY: open(2) of a NUL-terminated path prepared before the fork.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            Err((step, Errno::last()))
        } else {
            Ok(fd)
        }
    };
    let vnic = open(&p.vnic_dir, STEP_VNIC_FD)?;
    let lib = p.lib_dir.as_deref().map(|d| open(d, STEP_LIB_DIR)).transpose()?;
    Ok(BoundDirs { vnic, lib })
}

/// The setup process's mounts, in its new mount namespace; `dirs` from [`open_bound_dirs`].
pub(crate) fn setup_mounts(p: &MountPlan, dirs: BoundDirs) -> Step {
    let vnic_fd = dirs.vnic;
    // Nothing we mount may propagate back to the host.
    mount(NONE, c"/", NONE, MsFlags::MS_REC | MsFlags::MS_PRIVATE, NONE).map_err(at(MSG_PRIVATE))?;
    // A /sys of the container's network namespace, as `ip netns exec` makes: its
    // /sys/class/net lists the container's eth0, not the host's interfaces (UCX's TCP
    // transport, for one, only uses the interfaces listed there). (Mounts under the host's
    // /sys, such as cgroupfs, are not carried over.)
    let _ = umount2(c"/sys", MntFlags::MNT_DETACH);
    let noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some(c"sysfs"), c"/sys", Some(c"sysfs"), noexec, NONE).map_err(at(MSG_SYS))?;

    if p.sandboxed && !p.writable {
        read_only_tree().map_err(at(STEP_READ_ONLY))?;
    }
    if p.sandboxed {
        make_dev(p)?;
    } else if !p.verbs_nodes.is_empty() {
        // As before the sandbox: only /dev/infiniband is the container's own.
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
        tmpfs(c"/dev/infiniband", flags, c"mode=0755,size=64k").map_err(at(MSG_DEVICES))?;
        make_verbs_nodes(p, -1)?;
    }
    let private = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if p.sandboxed && !p.writable {
        make_tmp(p.private_tmp).map_err(at(STEP_TMP))?;
        tmpfs(c"/var/tmp", private, c"mode=1777").map_err(at(STEP_VAR_TMP))?;
    }
    hide_paths(p)?;
    if p.sandboxed && !p.writable {
        tmpfs(c"/run", private | MsFlags::MS_NOEXEC, c"mode=0755").map_err(at(STEP_RUN))?;
        // SAFETY: mkdir(2) of a literal path in the tmpfs just mounted.
        if unsafe { libc::mkdir(VNIC_MOUNTPOINT.as_ptr(), 0o755) } != 0 {
            return Err((STEP_RUN, Errno::last()));
        }
    }
    // The vNIC's own directory at /run/vrdma.
    let mut buf = [0u8; 32];
    mount(Some(fd_path(vnic_fd, &mut buf)), VNIC_MOUNTPOINT, NONE, MsFlags::MS_BIND, NONE).map_err(at(MSG_BIND))?;
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(vnic_fd) };
    if let Some(lib_fd) = dirs.lib {
        if p.sandboxed && !p.writable {
            // SAFETY: mkdir(2) of a literal path in our /run tmpfs.
            if unsafe { libc::mkdir(LIB_MOUNTPOINT.as_ptr(), 0o755) } != 0 {
                return Err((STEP_LIB_DIR, Errno::last()));
            }
            mount(Some(fd_path(lib_fd, &mut buf)), LIB_MOUNTPOINT, NONE, MsFlags::MS_BIND, NONE).map_err(at(STEP_LIB_DIR))?;
            set_attr(LIB_MOUNTPOINT, false, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0).map_err(at(STEP_LIB_DIR))?;
        }
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(lib_fd) };
    }
    Ok(())
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;

/// mount_setattr(2) on `path` (and everything below it with `recursive`).
fn set_attr(path: &CStr, recursive: bool, set: u64, clear: u64) -> Result<(), Errno> {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let attr = MountAttr { attr_set: set, attr_clr: clear, propagation: 0, userns_fd: 0 };
    let flags = if recursive { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: mount_setattr(2) reads `attr` (its size passed) and a NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Everything mounted so far: read-only, nosuid, nodev (the host's /dev is covered next).
fn read_only_tree() -> Result<(), Errno> {
    set_attr(c"/", true, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0)
}

/// The host's device nodes a user-namespaced container gets (it cannot mknod).
const HOST_DEVICES: [&CStr; 6] = [c"/dev/null", c"/dev/zero", c"/dev/full", c"/dev/random", c"/dev/urandom", c"/dev/tty"];

/// Binds the device `fd` refers to onto a new empty file `target`, usable (the bind
/// inherits the read-only, nodev tree's flags; neither is locked on the host's /dev).
fn bind_device(fd: RawFd, target: &CStr) -> Result<(), Errno> {
    // SAFETY: open(2)/close(2) of a NUL-terminated path in our own tmpfs.
    let f = unsafe { libc::open(target.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o666) };
    if f < 0 {
        return Err(Errno::last());
    }
    // SAFETY: closing the descriptor just opened.
    unsafe { libc::close(f) };
    let mut buf = [0u8; 32];
    mount(Some(fd_path(fd, &mut buf)), target, NONE, MsFlags::MS_BIND, NONE)?;
    set_attr(target, false, 0, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV)
}

/// A fresh /dev: the harmless devices, ptys of its own, shared memory, the verbs nodes.
fn make_dev(p: &MountPlan) -> Step {
    let e = at(STEP_DEV);
    // In a user namespace: the host's nodes, held before /dev is covered.
    let mut host = [-1; HOST_DEVICES.len()];
    if p.userns {
        for (fd, path) in host.iter_mut().zip(HOST_DEVICES) {
            // SAFETY: open(2) of a literal path.
            *fd = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
            if *fd < 0 {
                return Err((STEP_DEV, Errno::last()));
            }
        }
    }
    tmpfs(c"/dev", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, c"mode=0755,size=64k").map_err(&e)?;
    // The same devices as HOST_DEVICES, by number.
    let numbers: [(u32, u32); 6] = [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0)];
    for (i, (path, (major, minor))) in HOST_DEVICES.into_iter().zip(numbers).enumerate() {
        if p.userns {
            bind_device(host[i], path).map_err(&e)?;
        } else {
            mknod_rw(path, major, minor).map_err(&e)?;
        }
    }
    let links: [(&CStr, &CStr); 5] = [
        (c"pts/ptmx", c"/dev/ptmx"),
        (c"/proc/self/fd", c"/dev/fd"),
        (c"/proc/self/fd/0", c"/dev/stdin"),
        (c"/proc/self/fd/1", c"/dev/stdout"),
        (c"/proc/self/fd/2", c"/dev/stderr"),
    ];
    for (target, link) in links {
        // SAFETY: symlink(2) of literal paths into the tmpfs just mounted.
        if unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) } != 0 {
            return Err((STEP_DEV, Errno::last()));
        }
    }
    for dir in [c"/dev/pts", c"/dev/shm", c"/dev/infiniband"] {
        // SAFETY: mkdir(2) of a literal path in the tmpfs just mounted.
        if unsafe { libc::mkdir(dir.as_ptr(), 0o755) } != 0 {
            return Err((STEP_DEV, Errno::last()));
        }
    }
    mount(
        Some(c"devpts"),
        c"/dev/pts",
        Some(c"devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(c"newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(&e)?;
    tmpfs(c"/dev/shm", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, c"mode=1777").map_err(&e)?;
    let made = make_verbs_nodes(p, host[0]);
    for fd in host.into_iter().filter(|fd| *fd >= 0) {
        // SAFETY: closing our own descriptors.
        unsafe { libc::close(fd) };
    }
    made
}

/// A character node usable by anyone (the explicit chmod undoes the umask).
fn mknod_rw(path: &CStr, major: u32, minor: u32) -> Result<(), Errno> {
    // SAFETY: mknod(2) and chmod(2) on a NUL-terminated path.
    let rc = unsafe {
        let rc = libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor));
        if rc == 0 {
            libc::chmod(path.as_ptr(), 0o666)
        } else {
            rc
        }
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// The verbs device nodes in /dev/infiniband: `/dev/null`'s device (1:3): nothing is meant
/// to open them, and what does gets a harmless null device. (Libraries such as UCX only use
/// a verbs device whose node exists and is read-writable.)
/// In a user namespace, the host's /dev/null (`host_null`) is bound instead.
fn make_verbs_nodes(p: &MountPlan, host_null: RawFd) -> Step {
    for (i, node) in p.verbs_nodes.iter().enumerate() {
        let code = MSG_DEVICES.saturating_add(1).saturating_add(u32::try_from(i).unwrap_or(u32::MAX));
        if p.userns {
            bind_device(host_null, node).map_err(at(code))?;
        } else {
            mknod_rw(node, 1, 3).map_err(at(code))?;
        }
    }
    Ok(())
}

/// /tmp: the host's under a private writable layer, or a plain tmpfs.
fn make_tmp(private_tmp: bool) -> Result<(), Errno> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if !private_tmp {
        // The layer's directories live on a staging tmpfs that is detached once the overlay
        // holds it (overlayfs keeps its own reference to its upper layer).
        tmpfs(c"/run", flags, c"mode=0700")?;
        // SAFETY: mkdir(2) of literal paths in the tmpfs just mounted.
        let made = unsafe { libc::mkdir(c"/run/upper".as_ptr(), 0o1777) == 0 && libc::mkdir(c"/run/work".as_ptr(), 0o700) == 0 };
        // SAFETY: chmod(2) of a literal path (mkdir's mode went through the umask).
        let made = made && unsafe { libc::chmod(c"/run/upper".as_ptr(), 0o1777) } == 0;
        let layered = made
            && mount(Some(c"overlay"), c"/tmp", Some(c"overlay"), flags, Some(c"lowerdir=/tmp,upperdir=/run/upper,workdir=/run/work"))
                .is_ok();
        umount2(c"/run", MntFlags::MNT_DETACH)?;
        if layered {
            return Ok(());
        }
        // No overlayfs here: a plain private /tmp.
    }
    tmpfs(c"/tmp", flags, c"mode=1777")
}

fn hide_paths(p: &MountPlan) -> Step {
    for (i, path) in p.hide.iter().enumerate() {
        let code = MSG_HIDE.saturating_add(u32::try_from(i).unwrap_or(u32::MAX - MSG_HIDE));
        let st = match stat(path.as_c_str()) {
            Ok(st) => st,
            Err(Errno::ENOENT | Errno::ENOTDIR) => continue,
            // A directory above it is not searchable by the container's root (a user
            // namespace's, with no capability over the host's files): nothing there can be
            // reached by any path, so there is nothing to cover.
            Err(Errno::EACCES) if p.userns => continue,
            Err(e) => return Err((code, e)),
        };
        let is_dir = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR;
        let res = if is_dir {
            tmpfs(path.as_c_str(), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, c"mode=0755,size=1m")
        } else {
            mount(Some(c"/dev/null"), path.as_c_str(), NONE, MsFlags::MS_BIND, NONE)
        };
        res.map_err(at(code))?;
    }
    Ok(())
}

/// /proc paths covered (as Docker masks them): files with /dev/null, directories with an
/// empty read-only tmpfs.
const PROC_MASKED: &[&CStr] = &[
    c"/proc/kcore",
    c"/proc/keys",
    c"/proc/timer_list",
    c"/proc/timer_stats",
    c"/proc/sched_debug",
    c"/proc/latency_stats",
    c"/proc/acpi",
    c"/proc/scsi",
    c"/proc/asound",
    c"/sys/firmware",
    c"/sys/devices/virtual/powercap",
];

/// /proc paths made read-only.
const PROC_READ_ONLY: &[&CStr] = &[c"/proc/sys", c"/proc/sysrq-trigger", c"/proc/irq", c"/proc/bus", c"/proc/fs"];

/// In the container's init: a procfs of its PID namespace (the mount namespace is private,
/// so the host's /proc is untouched), masked when sandboxed.
pub(crate) fn mount_proc(p: &MountPlan) -> Step {
    let noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some(c"proc"), c"/proc", Some(c"proc"), noexec, NONE).map_err(at(MSG_PROC))?;
    if !p.sandboxed {
        return Ok(());
    }
    let e = at(STEP_PROC_MASKS);
    for path in PROC_MASKED {
        let Ok(st) = stat(*path) else { continue };
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
            tmpfs(path, noexec | MsFlags::MS_RDONLY, c"size=0").map_err(&e)?;
        } else {
            mount(Some(c"/dev/null"), *path, NONE, MsFlags::MS_BIND, NONE).map_err(&e)?;
        }
    }
    for path in PROC_READ_ONLY {
        if stat(*path).is_err() {
            continue;
        }
        mount(Some(*path), *path, NONE, MsFlags::MS_BIND | MsFlags::MS_REC, NONE).map_err(&e)?;
        let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | noexec;
        mount(NONE, *path, NONE, ro, NONE).map_err(&e)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_paths() {
        let mut buf = [0u8; 32];
        assert_eq!(fd_path(7, &mut buf), c"/proc/self/fd/7");
        assert_eq!(fd_path(1234567, &mut buf), c"/proc/self/fd/1234567");
        assert_eq!(fd_path(0, &mut buf), c"/proc/self/fd/0");
    }
}
