//! The status pipe between the container's processes and `run_container`: fixed 8-byte
//! records (a code, then a pid or an errno), written atomically with async-signal-safe
//! calls only, and the child side's way out (`fail`, `child_exit`).

use std::os::fd::RawFd;

use nix::errno::Errno;

// Message codes on the status pipe; the second word is a pid or an errno.
pub(crate) const MSG_READY: u32 = 1;
pub(crate) const MSG_INIT_PID: u32 = 2;
pub(crate) const MSG_UNSHARE: u32 = 10;
pub(crate) const MSG_PRIVATE: u32 = 11;
pub(crate) const MSG_HOSTNAME: u32 = 12;
pub(crate) const MSG_BIND: u32 = 13;
pub(crate) const MSG_FORK_INIT: u32 = 14;
pub(crate) const MSG_PROC: u32 = 15;
pub(crate) const MSG_EXEC: u32 = 16;
pub(crate) const MSG_SYS: u32 = 17;
/// `MSG_HIDE + i`: hiding `hide_paths[i]` failed.
pub(crate) const MSG_HIDE: u32 = 1000;
/// `MSG_DEVICES`: mounting the container's `/dev/infiniband` failed; `MSG_DEVICES + 1 + i`:
/// making `verbs_devices[i]`'s node failed.
pub(crate) const MSG_DEVICES: u32 = 2000;
/// `MSG_SANDBOX + i`: sandbox step `SANDBOX_STEPS[i]` failed.
pub(crate) const MSG_SANDBOX: u32 = 3000;

/// The sandbox's steps, by `MSG_SANDBOX` offset (names as `NetnsError::Sandbox` shows them).
pub(crate) const SANDBOX_STEPS: &[&str] = &[
    "opening the vNIC directory",
    "read-only root",
    "private /tmp",
    "private /var/tmp",
    "private /run",
    "/dev",
    "/proc masks",
    "capabilities",
    "seccomp",
    "user namespace",
    "the drop-in's directory",
];
pub(crate) const STEP_VNIC_FD: u32 = MSG_SANDBOX;
pub(crate) const STEP_READ_ONLY: u32 = MSG_SANDBOX + 1;
pub(crate) const STEP_TMP: u32 = MSG_SANDBOX + 2;
pub(crate) const STEP_VAR_TMP: u32 = MSG_SANDBOX + 3;
pub(crate) const STEP_RUN: u32 = MSG_SANDBOX + 4;
pub(crate) const STEP_DEV: u32 = MSG_SANDBOX + 5;
pub(crate) const STEP_PROC_MASKS: u32 = MSG_SANDBOX + 6;
pub(crate) const STEP_CAPS: u32 = MSG_SANDBOX + 7;
pub(crate) const STEP_SECCOMP: u32 = MSG_SANDBOX + 8;
pub(crate) const STEP_USERNS: u32 = MSG_SANDBOX + 9;
pub(crate) const STEP_LIB_DIR: u32 = MSG_SANDBOX + 10;

pub(crate) fn child_exit(code: i32) -> ! {
    // SAFETY: _exit(2) is async-signal-safe and skips atexit handlers and destructors that
    // belong to the parent's copy of the process state.
    unsafe { libc::_exit(code) }
}

pub(crate) fn report(fd: RawFd, code: u32, value: i32) {
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&code.to_ne_bytes());
    msg[4..].copy_from_slice(&value.to_ne_bytes());
    // SAFETY: write(2) of an 8-byte stack buffer to a descriptor this process owns;
    // async-signal-safe. 8 < PIPE_BUF, so the record is written atomically or not at all.
    unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
}

pub(crate) fn fail(fd: RawFd, code: u32, errno: Errno) -> ! {
    report(fd, code, errno as i32);
    child_exit(1)
}
