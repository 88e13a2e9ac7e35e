//! The container's seccomp filter: a deny list in the spirit of Docker's default profile
//! (everything a container without capabilities has no use for), stricter where vrdma can
//! be (no ptrace, no new namespaces at all, no packet sockets, no terminal injection).
//!
//! Built with `seccompiler` (rust-vmm's, as in Firecracker) before the fork; installed in
//! the container's init right before exec. A denied call fails with `EPERM`, except
//! `clone3`, which fails with `ENOSYS` so that glibc falls back to `clone`, whose flags the
//! filter can inspect (clone3 passes them in memory, out of seccomp's reach; Docker does
//! the same). The filter checks the architecture: a call through another ABI (i386's
//! `int 0x80`) kills the process. On x86_64 a third program refuses every call of the x32
//! ABI (numbers with bit 30 set, which share x86_64's audit architecture): the deny list
//! is keyed on x86_64 numbers, and a kernel that enables x32 would otherwise run the same
//! calls under the other numbering.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use crate::NetnsError;

/// Syscalls denied outright: mounts and the new mount API, module loading, kexec, the
/// kernel keyring, BPF, perf, tracing other processes, swap, accounting, reboot, clock
/// changes, namespaces, and the rest of Docker's list.
const DENIED: &[libc::c_long] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_quotactl,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_lookup_dcookie,
    libc::SYS_userfaultfd,
    libc::SYS_syslog,
    libc::SYS_fanotify_init,
    libc::SYS_chroot,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_uselib,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ustat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_sysfs,
    #[cfg(target_arch = "x86_64")]
    libc::SYS__sysctl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_nfsservctl,
];

/// Every `CLONE_NEW*` flag: `clone` with any of them is denied (unshare is denied whole).
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWCGROUP as u64,
    0x80, // CLONE_NEWTIME (not in every libc)
];

/// Socket families refused: raw link-layer access (packet sockets need CAP_NET_RAW too;
/// this holds even with `--cap-add NET_RAW`, which is for ICMP/raw IP only).
const DENIED_FAMILIES: &[u64] = &[libc::AF_PACKET as u64];

/// ioctls refused on any descriptor: pushing input into a terminal the container shares
/// with its caller (TIOCSTI, TIOCLINUX), and asking a socket for its network namespace.
#[allow(clippy::unnecessary_cast)] // TIOCSTI is a c_ulong or a c_int, by platform
const DENIED_IOCTLS: &[u64] = &[libc::TIOCSTI as u64, 0x541C /* TIOCLINUX */, 0x894C /* SIOCGSKNS */];

/// The programs to install: the `EPERM` deny list, `clone3` → `ENOSYS`, and (x86_64) the
/// x32 ABI → `EPERM`.
pub(crate) struct Filters {
    pub deny: BpfProgram,
    pub clone3: BpfProgram,
    pub x32: BpfProgram,
}

/// The x32 ABI's marker in the syscall number (`__X32_SYSCALL_BIT`).
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Refuses (`EPERM`) every syscall whose number has [`X32_SYSCALL_BIT`], allows the rest (the
/// deny list judges them). Four classic BPF instructions: seccompiler matches syscall
/// numbers only by equality, and x32 has a range of its own numbers besides.
fn x32_program() -> BpfProgram {
    const LD_W_ABS: u16 = 0x20; // BPF_LD (0) | BPF_W (0) | BPF_ABS
    const JSET_K: u16 = 0x05 | 0x40; // BPF_JMP | BPF_JSET | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let nr_offset = 0; // seccomp_data.nr
    let insn = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        insn(LD_W_ABS, 0, 0, nr_offset),
        insn(JSET_K, 0, 1, X32_SYSCALL_BIT),
        insn(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        insn(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

fn arch() -> Result<TargetArch, NetnsError> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|e| NetnsError::Seccomp { reason: e.to_string() })
}

/// A condition on argument `arg`, compared over `len`: `Dword` (the low 32 bits) for an
/// argument the kernel takes as an `int`, since it ignores the register's high half, which a
/// caller could otherwise set to slip past an equality test.
fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, NetnsError> {
    SeccompCondition::new(arg, len, op, value).map_err(|e| NetnsError::Seccomp { reason: e.to_string() })
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, NetnsError> {
    SeccompRule::new(conditions).map_err(|e| NetnsError::Seccomp { reason: e.to_string() })
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> Result<BpfProgram, NetnsError> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(errno as u32), arch()?)
        .map_err(|e| NetnsError::Seccomp { reason: e.to_string() })?;
    filter.try_into().map_err(|e: seccompiler::BackendError| NetnsError::Seccomp { reason: e.to_string() })
}

/// Builds both programs (allocates: call before the fork).
pub(crate) fn build() -> Result<Filters, NetnsError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    rules.insert(
        libc::SYS_clone,
        NAMESPACE_FLAGS
            .iter()
            .map(|&f| rule(vec![cond(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(f), f)?]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_socket,
        DENIED_FAMILIES.iter().map(|&f| rule(vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, f)?])).collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_ioctl,
        DENIED_IOCTLS.iter().map(|&r| rule(vec![cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, r)?])).collect::<Result<_, _>>()?,
    );
    let deny = compile(rules, libc::EPERM)?;
    let clone3 = compile(BTreeMap::from([(libc::SYS_clone3, Vec::new())]), libc::ENOSYS)?;
    let x32 = if cfg!(target_arch = "x86_64") { x32_program() } else { Vec::new() };
    Ok(Filters { deny, clone3, x32 })
}

/// Installs both programs in the calling thread (sets `no_new_privs` first, which seccomp
/// requires of a process without CAP_SYS_ADMIN and which the sandbox wants anyway).
/// Async-signal-safe: two prctl/seccomp calls on memory prepared before the fork.
pub(crate) fn install(filters: &Filters) -> Result<(), nix::errno::Errno> {
    for program in [&filters.clone3, &filters.deny, &filters.x32] {
        if program.is_empty() {
            continue;
        }
        if seccompiler::apply_filter(program).is_err() {
            return Err(nix::errno::Errno::last());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile_for_this_machine() {
        let f = build().unwrap();
        assert!(f.deny.len() > DENIED.len(), "one jump per denied syscall at least");
        assert!(!f.clone3.is_empty());
    }

    /// In a forked child (the filter is per process and irreversible): denied calls fail
    /// with EPERM, clone3 with ENOSYS, and everything else (fork, sockets, exec) still works.
    #[test]
    fn denied_calls_fail_and_ordinary_ones_work() {
        let f = build().unwrap();
        // SAFETY: the child only makes raw syscalls and _exits.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let code = (|| {
                    if install(&f).is_err() {
                        return 10;
                    }
                    // SAFETY: raw syscalls with integer arguments; none touches our memory
                    // except socket(2)'s return value, closed at once.
                    unsafe {
                        if libc::unshare(libc::CLONE_NEWUSER) != -1 || *libc::__errno_location() != libc::EPERM {
                            return 11;
                        }
                        if libc::syscall(libc::SYS_clone3, 0usize, 0usize) != -1 || *libc::__errno_location() != libc::ENOSYS {
                            return 12;
                        }
                        if libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, 0) != -1 || *libc::__errno_location() != libc::EPERM {
                            return 13;
                        }
                        // The family with garbage in the register's high half (the kernel
                        // reads an int) is still AF_PACKET to the filter.
                        let family = (1i64 << 32) | i64::from(libc::AF_PACKET);
                        if libc::syscall(libc::SYS_socket, family, libc::SOCK_DGRAM, 0) != -1 || *libc::__errno_location() != libc::EPERM {
                            return 17;
                        }
                        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
                        if s < 0 {
                            return 14;
                        }
                        if libc::ioctl(s, 0x894C) != -1 || *libc::__errno_location() != libc::EPERM {
                            return 15;
                        }
                        libc::close(s);
                        if libc::getpid() <= 0 {
                            return 16;
                        }
                        // x32's getpid: refused by the filter (without it, ENOSYS on a kernel
                        // with x32 off, a pid on one with it on).
                        #[cfg(target_arch = "x86_64")]
                        if libc::syscall(i64::from(X32_SYSCALL_BIT) | libc::SYS_getpid) != -1 || *libc::__errno_location() != libc::EPERM {
                            return 18;
                        }
                    }
                    0
                })();
                // SAFETY: leaving the forked test child without running the harness's code.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let st = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
            }
        }
    }
}
