//! A lane reader's alarm for its ACK tokens' deadlines (see `MedQp::ack_duty`).
//!
//! The reader blocks in `read(2)` on its lane, and must wake when a token it published was
//! not carried in time. A socket's receive timeout counts in scheduler ticks, and a timer
//! per message is dear: on a VM, arming one microseconds ahead costs far more than one
//! milliseconds ahead (each reprograms the clock, an exit to the hypervisor; see
//! docs/measurements.md). So while
//! the reader has token duties, a POSIX timer ticks every [`TOKEN_TICK`], signalling the
//! reader's own thread: the signal interrupts the blocked read (a socket with a receive
//! timeout is never restarted, `SA_RESTART` or not), the reader looks at its deadlines, and
//! the timer is armed and stopped only when duties start and end, not per message. Being
//! periodic, a tick that came before the read blocked cannot leave it asleep for long.
//! Other interrupted calls of the reader are restarted (`SA_RESTART`) or retried.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::time::Duration;

use super::tokens::TOKEN_TICK;

/// The signal: a real-time one nothing else in vrdmad uses.
fn signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

extern "C" fn on_signal(_: libc::c_int) {}

fn install_handler() -> bool {
    static ONCE: Once = Once::new();
    static OK: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid value to fill in; the handler does nothing
        // (async-signal-safe), and only this signal's disposition changes.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            OK.store(libc::sigaction(signal(), &sa, std::ptr::null_mut()) == 0, Ordering::Release);
        }
    });
    OK.load(Ordering::Acquire)
}

/// A timer signalling the thread that made it.
pub(crate) struct TokenTimer {
    id: libc::timer_t,
    armed: bool,
}

impl TokenTimer {
    /// A timer for the calling thread, or none (the reader then does not wait for tokens).
    pub(crate) fn new() -> Option<TokenTimer> {
        if !install_handler() {
            return None;
        }
        // SAFETY: a zeroed sigevent is valid; the fields set name this thread and the signal.
        let mut ev: libc::sigevent = unsafe { std::mem::zeroed() };
        ev.sigev_notify = libc::SIGEV_THREAD_ID;
        ev.sigev_signo = signal();
        // SAFETY: gettid has no arguments and cannot fail.
        ev.sigev_notify_thread_id = unsafe { libc::gettid() };
        let mut id: libc::timer_t = std::ptr::null_mut();
        // SAFETY: valid sigevent and out pointer, live for the call.
        if unsafe { libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev, &mut id) } != 0 {
            return None;
        }
        Some(TokenTimer { id, armed: false })
    }

    fn set(&mut self, first: Duration, every: Duration) -> bool {
        let ts = |d: Duration| libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long };
        let spec = libc::itimerspec { it_interval: ts(every), it_value: ts(first) };
        // SAFETY: our timer, a valid itimerspec; the old value is not wanted.
        unsafe { libc::timer_settime(self.id, 0, &spec, std::ptr::null_mut()) == 0 }
    }

    /// Ticks every [`TOKEN_TICK`] (from now, unless it already ticks); whether it ticks.
    pub(crate) fn tick(&mut self) -> bool {
        if !self.armed {
            self.armed = self.set(TOKEN_TICK, TOKEN_TICK);
        }
        self.armed
    }

    /// No more ticks (until [`TokenTimer::tick`]).
    pub(crate) fn stop(&mut self) {
        if self.armed {
            self.set(Duration::ZERO, Duration::ZERO);
            self.armed = false;
        }
    }
}

impl Drop for TokenTimer {
    fn drop(&mut self) {
        // SAFETY: our timer, deleted once.
        unsafe { libc::timer_delete(self.id) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    /// A read blocked on a socket with a receive timeout returns EINTR at the timer's tick,
    /// and again at the next; stopped, it waits the timeout out.
    #[test]
    fn the_timer_interrupts_a_blocked_socket_read_and_disarmed_does_not() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut t = TokenTimer::new().expect("timer");
        let mut b = [0u8; 1];
        assert!(t.tick());
        for _ in 0..2 {
            let start = Instant::now();
            let err = s.read(&mut b).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "{err}");
            assert!(start.elapsed() < Duration::from_millis(100), "woke after {:?}", start.elapsed());
        }
        t.stop();
        let start = Instant::now();
        let err = s.read(&mut b).unwrap_err();
        assert!(matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(250), "woke after {:?}", start.elapsed());
    }
}
