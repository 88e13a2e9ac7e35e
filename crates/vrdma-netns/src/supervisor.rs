//! The parent side of `run_container`: blocks SIGINT/SIGTERM while it runs ([`MaskGuard`]),
//! and watches the setup process ([`Supervisor`]): its status pipe, its exit, and signals
//! to forward.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::SignalFd;
use nix::unistd::Pid;

use crate::container::decode_wait_status;
use crate::status::*;
use crate::{ContainerSpec, NetnsError};

/// Blocks SIGINT/SIGTERM in the calling thread for the duration of `run_container`.
pub(crate) struct MaskGuard {
    old: SigSet,
}

impl MaskGuard {
    pub(crate) fn block(set: &SigSet) -> Result<MaskGuard, NetnsError> {
        let mut old = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(set), Some(&mut old))
            .map_err(|source| NetnsError::SetupParent { what: "signal mask", source })?;
        Ok(MaskGuard { old })
    }
}

impl Drop for MaskGuard {
    fn drop(&mut self) {
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&self.old), None);
    }
}

/// Watches the setup process: its status pipe, its exit, and signals to forward.
pub(crate) struct Supervisor {
    pub(crate) child: Pid,
    pub(crate) pidfd: Option<OwnedFd>,
    pub(crate) sigfd: SignalFd,
    pub(crate) status: Option<OwnedFd>,
    pub(crate) pending: Vec<u8>,
    pub(crate) ready: bool,
    pub(crate) init_pid: Option<Pid>,
    pub(crate) failure: Option<(u32, i32)>,
    pub(crate) exit: Option<i32>,
    pub(crate) signals: u32,
    /// When a forwarded SIGINT/SIGTERM has not ended the container by then, SIGKILL: the
    /// command is PID 1 of its namespace, which the kernel shields from signals it has no
    /// handler for, so `timeout` or `kill` alone would never stop a plain program.
    pub(crate) kill_at: Option<std::time::Instant>,
}

/// How long a container has to exit after a forwarded SIGINT/SIGTERM before SIGKILL.
pub(crate) const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

impl Supervisor {
    pub(crate) fn new(child: Pid, sigfd: SignalFd, status: OwnedFd) -> Supervisor {
        // SAFETY: pidfd_open(2) takes a pid and flags, touches no memory of ours, and
        // returns a new descriptor or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, child.as_raw(), 0) };
        let pidfd = RawFd::try_from(raw).ok().filter(|fd| *fd >= 0).map(|fd| {
            // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
            unsafe { OwnedFd::from_raw_fd(fd) }
        });
        Supervisor {
            child,
            pidfd,
            sigfd,
            status: Some(status),
            pending: Vec::new(),
            ready: false,
            init_pid: None,
            failure: None,
            exit: None,
            signals: 0,
            kill_at: None,
        }
    }

    /// Waits for something to happen (a message, a signal, the child's exit) and handles
    /// it. Without a pidfd (kernel < 5.3) it polls for the exit every 50 ms.
    pub(crate) fn pump(&mut self) -> Result<(), NetnsError> {
        let mut timeout = if self.pidfd.is_some() { PollTimeout::NONE } else { PollTimeout::from(50u16) };
        if let Some(at) = self.kill_at {
            let left = at.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                self.escalate();
                return self.check_exit();
            }
            let ms = u16::try_from(left.as_millis().saturating_add(1)).unwrap_or(u16::MAX);
            if self.pidfd.is_some() || ms < 50 {
                timeout = PollTimeout::from(ms);
            }
        }
        let (sig_ready, status_ready) = {
            let mut fds = vec![PollFd::new(self.sigfd.as_fd(), PollFlags::POLLIN)];
            if let Some(fd) = &self.pidfd {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
            }
            let status_idx = self.status.as_ref().map(|fd| {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            match poll(&mut fds, timeout) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(source) => return Err(NetnsError::Wait { source }),
            }
            let fired = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
            (fired(0), status_idx.is_some_and(fired))
        };
        if status_ready {
            self.read_status();
        }
        if sig_ready {
            self.forward_signals();
        }
        self.check_exit()
    }

    pub(crate) fn read_status(&mut self) {
        let Some(fd) = &self.status else { return };
        let mut buf = [0u8; 64];
        loop {
            match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => {
                    self.status = None; // EOF: init exec'd, or everyone exited
                    break;
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => break,
                Err(e) => {
                    log::warn!("reading the container status pipe: {e}");
                    self.status = None;
                    break;
                }
            }
        }
        while self.pending.len() >= 8 {
            let rec: Vec<u8> = self.pending.drain(..8).collect();
            let code = u32::from_ne_bytes([rec[0], rec[1], rec[2], rec[3]]);
            let value = i32::from_ne_bytes([rec[4], rec[5], rec[6], rec[7]]);
            match code {
                MSG_READY => self.ready = true,
                MSG_INIT_PID => self.init_pid = Some(Pid::from_raw(value)),
                _ => {
                    if self.failure.is_none() {
                        self.failure = Some((code, value));
                    }
                }
            }
        }
    }

    /// First SIGINT/SIGTERM: forwarded to the container's init. A later one, or one before
    /// init exists: SIGKILL (PID 1 of a PID namespace ignores signals it has no handler for,
    /// so a shell would otherwise never stop).
    pub(crate) fn forward_signals(&mut self) {
        while let Ok(Some(info)) = self.sigfd.read_signal() {
            if self.exit.is_some() {
                continue; // nothing left to deliver to
            }
            self.signals += 1;
            let received = Signal::try_from(info.ssi_signo as i32).unwrap_or(Signal::SIGTERM);
            let (target, sig) = match self.init_pid {
                Some(init) if self.signals == 1 => (init, received),
                Some(init) => (init, Signal::SIGKILL),
                None => (self.child, Signal::SIGKILL),
            };
            log::info!("forwarding {received} to the container as {sig} (pid {target})");
            let _ = nix::sys::signal::kill(target, sig);
            if sig != Signal::SIGKILL && self.kill_at.is_none() {
                self.kill_at = Some(std::time::Instant::now() + STOP_GRACE);
            }
        }
    }

    /// The grace period after a forwarded signal ran out: SIGKILL the container's init (the
    /// whole PID namespace dies with it).
    pub(crate) fn escalate(&mut self) {
        self.kill_at = None;
        if self.exit.is_some() {
            return;
        }
        let target = self.init_pid.unwrap_or(self.child);
        log::info!("the container did not exit within {STOP_GRACE:?} of the signal; sending SIGKILL (pid {target})");
        let _ = nix::sys::signal::kill(target, Signal::SIGKILL);
    }

    pub(crate) fn check_exit(&mut self) -> Result<(), NetnsError> {
        if self.exit.is_some() {
            return Ok(());
        }
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid(2) on our own child with a valid out-pointer.
        let rc = unsafe { libc::waitpid(self.child.as_raw(), &mut status, libc::WNOHANG) };
        if rc == self.child.as_raw() {
            self.exit = decode_wait_status(status);
        } else if rc < 0 && Errno::last() != Errno::EINTR {
            return Err(NetnsError::Wait { source: Errno::last() });
        }
        Ok(())
    }

    pub(crate) fn wait_until(&mut self, done: impl Fn(&Supervisor) -> bool) -> Result<(), NetnsError> {
        while !done(self) {
            self.pump()?;
        }
        Ok(())
    }

    /// Kills the setup process (its init follows through PDEATHSIG) and reaps it.
    pub(crate) fn abort(&mut self) {
        if self.exit.is_some() {
            return;
        }
        let _ = nix::sys::signal::kill(self.child, Signal::SIGKILL);
        loop {
            let mut status: libc::c_int = 0;
            // SAFETY: waitpid(2) on our own child with a valid out-pointer.
            let rc = unsafe { libc::waitpid(self.child.as_raw(), &mut status, 0) };
            if rc == self.child.as_raw() {
                self.exit = Some(decode_wait_status(status).unwrap_or(128 + libc::SIGKILL));
                break;
            }
            if rc < 0 && Errno::last() != Errno::EINTR {
                break;
            }
        }
        self.read_status();
    }

    /// The error the container side reported, with the spec's context.
    pub(crate) fn failure_error(&self, spec: &ContainerSpec) -> Option<NetnsError> {
        let (code, value) = self.failure?;
        let source = Errno::from_raw(value);
        Some(match code {
            MSG_UNSHARE => NetnsError::Unshare { source },
            MSG_PRIVATE => NetnsError::MakeMountsPrivate { source },
            MSG_HOSTNAME => NetnsError::SetHostname { hostname: spec.name.clone(), source },
            MSG_BIND => NetnsError::BindVnicDir { vnic_dir: spec.vnic_dir.clone(), source },
            MSG_FORK_INIT => NetnsError::ForkInit { source },
            MSG_PROC => NetnsError::MountProc { source },
            MSG_SYS => NetnsError::MountSys { source },
            MSG_EXEC => NetnsError::Exec { command: spec.command[0].clone(), source },
            c if c >= MSG_SANDBOX => {
                let step = usize::try_from(c - MSG_SANDBOX).ok().and_then(|i| SANDBOX_STEPS.get(i)).copied().unwrap_or("?");
                NetnsError::Sandbox { step, source }
            }
            c if c >= MSG_DEVICES => {
                let device = usize::try_from(c - MSG_DEVICES)
                    .ok()
                    .and_then(|i| i.checked_sub(1))
                    .and_then(|i| spec.verbs_devices.get(i))
                    .cloned()
                    .unwrap_or_default();
                NetnsError::VerbsDevice { device, source }
            }
            c if c >= MSG_HIDE => {
                let path = usize::try_from(c - MSG_HIDE).ok().and_then(|i| spec.hide_paths.get(i)).cloned().unwrap_or_default();
                NetnsError::HidePath { path, source }
            }
            _ => NetnsError::ChildDied { status: self.exit.unwrap_or(-1) },
        })
    }
}
