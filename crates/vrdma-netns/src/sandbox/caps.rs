//! Capabilities: the container keeps none but those named with `--cap-add`.
//!
//! Done with `prctl`/`capset` through `libc` rather than the `caps` crate: the child side
//! runs between fork and exec and may only make async-signal-safe calls, and `caps` builds
//! `HashSet`s. The command runs as uid 0, and on exec the kernel gives uid 0 every
//! capability of the bounding set (and the inheritable set), so both are cut down to the
//! kept set; effective, permitted and inheritable are set to it with `capset`, and the
//! ambient set is cleared.

use nix::errno::Errno;

use crate::NetnsError;

/// Names as in capabilities(7), without the `CAP_` prefix, indexed by number.
const NAMES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// The capability set of `names` (`NET_RAW`, `cap_net_raw`, `CAP_NET_RAW` all name one),
/// as a bit mask.
pub(crate) fn parse(names: &[String]) -> Result<u64, NetnsError> {
    let mut mask = 0u64;
    for n in names {
        let upper = n.to_ascii_uppercase();
        let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
        let Some(i) = NAMES.iter().position(|c| *c == bare) else {
            return Err(NetnsError::InvalidSpec { field: "cap_add", reason: format!("{n:?} is not a capability (see capabilities(7))") });
        };
        mask |= 1 << i;
    }
    Ok(mask)
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// What the bounding set keeps beyond the kept capabilities: CAP_NET_RAW. Distributions
/// install `ping` with the file capability `cap_net_raw+ep`, and the kernel refuses to exec
/// a file whose effective capabilities it cannot all grant from the bounding set (EPERM);
/// with it in the bounding set, `ping` starts and, since `no_new_privs` (always set with this
/// drop) keeps exec from granting any file capability, gets none and uses the unprivileged
/// ICMP socket instead. The bounding set grants nothing by itself.
const BOUNDING_ONLY: u64 = 1 << 13;

/// Drops every capability not in `keep` (nor [`BOUNDING_ONLY`]) from the bounding set,
/// clears the ambient set, and sets effective = permitted = inheritable = `keep`. Needs
/// CAP_SETPCAP (dropped last). Async-signal-safe (prctl and capset on stack data).
pub(crate) fn drop_all_but(keep: u64) -> Result<(), Errno> {
    for cap in 0..64 {
        if (keep | BOUNDING_ONLY) & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl(2) with integer arguments.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            match Errno::last() {
                Errno::EINVAL => break, // past the kernel's last capability
                e => return Err(e),
            }
        }
    }
    // SAFETY: prctl(2) with integer arguments. EINVAL: a kernel without ambient capabilities.
    if unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) } != 0 && Errno::last() != Errno::EINVAL {
        return Err(Errno::last());
    }
    let low = keep as u32;
    let high = (keep >> 32) as u32;
    let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let data =
        [CapData { effective: low, permitted: low, inheritable: low }, CapData { effective: high, permitted: high, inheritable: high }];
    // SAFETY: capset(2) reads the header and two data structs, both on our stack.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_with_or_without_prefix_in_any_case() {
        assert_eq!(parse(&["NET_RAW".into()]).unwrap(), 1 << 13);
        assert_eq!(parse(&["cap_net_raw".into(), "CAP_SYS_ADMIN".into()]).unwrap(), (1 << 13) | (1 << 21));
        assert_eq!(parse(&[]).unwrap(), 0);
        assert!(matches!(parse(&["NET_MAGIC".into()]), Err(NetnsError::InvalidSpec { field: "cap_add", .. })));
        assert_eq!(NAMES[40], "CHECKPOINT_RESTORE");
    }
}
