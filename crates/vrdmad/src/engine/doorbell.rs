//! The doorbell thread: one epoll set for the mediated QPs' doorbells, UD datagram sockets
//! and our connections' room, driving the QPs' send sides, timers and heartbeats.

use std::cell::{Cell, RefCell};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use vrdma_abi::fd::drain_eventfd;

use super::affinity;
use super::connection::{Conn, Hook, Parked};
use super::link::Link;
use super::priority::{realtime_thread, DOORBELL_PRIORITY};
use super::qos::Scheduled;
use super::qp::MedQp;
use super::trace;
use super::ud::UdSender;
use super::Engine;

pub(crate) const KICK_TOKEN: u64 = u64::MAX;

/// Doorbell-thread epoll tokens of UD datagram sockets: this bit, and the QPN.
const UD_TOKEN: u64 = 1 << 32;

/// Doorbell-thread epoll tokens of our connections (room for their backlog): this bit, and
/// a number.
const CONN_TOKEN: u64 = 1 << 33;

/// What an event of the doorbell thread's epoll set is about, by its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Token {
    /// The engine's kick eventfd.
    Kick,
    /// Room in one of our connections (the whole token, its key in `out_conns`).
    Conn(u64),
    /// A UD QP's datagram socket.
    Ud(u32),
    /// A mediated QP's doorbell.
    Qp(u32),
}

impl Token {
    pub(crate) fn of(token: u64) -> Token {
        if token == KICK_TOKEN {
            Token::Kick
        } else if token & CONN_TOKEN != 0 {
            Token::Conn(token)
        } else if token & UD_TOKEN != 0 {
            Token::Ud(token as u32)
        } else {
            Token::Qp(token as u32)
        }
    }

    /// The token of UD QP `qpn`'s datagram socket.
    pub(crate) fn ud(qpn: u32) -> u64 {
        UD_TOKEN | u64::from(qpn)
    }

    /// The token of mediated QP `qpn`'s doorbell.
    pub(crate) fn qp(qpn: u32) -> u64 {
        u64::from(qpn)
    }

    /// The token of our connection number `id` (its low 32 bits).
    pub(crate) fn conn(id: u64) -> u64 {
        CONN_TOKEN | (id & 0xffff_ffff)
    }
}

impl Engine {
    pub(crate) fn epoll_add(&self, fd: i32, token: u64) -> std::io::Result<()> {
        self.epoll_add_events(fd, token, libc::EPOLLIN as u32)
    }

    pub(crate) fn epoll_add_events(&self, fd: i32, token: u64, events: u32) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: valid epoll fd and event struct.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    pub(crate) fn epoll_del(&self, fd: i32) {
        // SAFETY: valid epoll fd; a stale fd only makes the call fail.
        unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// Where a new non-blocking connection asks for room: our epoll, a fresh token.
    pub(crate) fn conn_hook(self: &Arc<Self>) -> Hook {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        Hook { epfd: self.epoll.as_raw_fd(), token: Token::conn(id), resume: Arc::downgrade(self) }
    }

    /// Records a non-blocking connection under its token.
    pub(crate) fn register_conn(&self, c: &Arc<Conn>, token: u64) {
        let mut m = self.out_conns.lock();
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(token, Arc::downgrade(c));
    }

    /// What was parked on a connection that failed or went: the doorbell thread resumes it.
    pub(crate) fn resume_parked(&self, parked: Vec<Parked>) {
        if !parked.is_empty() {
            self.resumed.lock().extend(parked);
            self.kick();
        }
    }

    /// Resumes what was parked (a QP is pumped, a UD socket read again).
    pub(crate) fn resume(&self, parked: impl IntoIterator<Item = Parked>, active: &mut Vec<Arc<MedQp>>) {
        for p in parked {
            match p {
                Parked::Qp(qpn) => active.extend(self.qps.read().get(&qpn).cloned()),
                Parked::Ud(qpn) => {
                    if let Some(s) = self.ud_senders.read().get(&qpn) {
                        // Level-triggered: reported at once if datagrams wait.
                        let _ = self.epoll_add(s.socket.as_raw_fd(), Token::ud(qpn));
                    }
                }
            }
        }
    }
}

/// `epoll_wait` on `epfd` for at most `timeout`, to the nanosecond (`epoll_pwait2`; where the
/// kernel lacks it, rounded up to a whole millisecond, never down to a busy loop).
fn epoll_wait_for(epfd: std::os::fd::RawFd, events: &mut [libc::epoll_event], timeout: Duration) -> i32 {
    // Set once the kernel has answered ENOSYS: not asked again on every wakeup.
    static NO_PWAIT2: AtomicBool = AtomicBool::new(false);
    let max = events.len().min(i32::MAX as usize) as i32;
    if NO_PWAIT2.load(Ordering::Relaxed) {
        return epoll_wait_ms(epfd, events, max, timeout);
    }
    let ts =
        libc::timespec { tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: a valid epoll fd, a buffer of `max` entries and a timespec, all live for the
    // call; no signal mask (null, size 0).
    let n = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait2,
            epfd,
            events.as_mut_ptr(),
            max,
            &ts as *const libc::timespec,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if n >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS) {
        return n as i32;
    }
    NO_PWAIT2.store(true, Ordering::Relaxed);
    epoll_wait_ms(epfd, events, max, timeout)
}

/// `epoll_wait` for `timeout` rounded up to whole milliseconds (at most `max` events).
fn epoll_wait_ms(epfd: std::os::fd::RawFd, events: &mut [libc::epoll_event], max: i32, timeout: Duration) -> i32 {
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: a valid epoll fd and a buffer of at least `max` entries, live for the call.
    unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), max, ms) }
}

/// The doorbell thread: sleeps until a client rings, a timer is due or a reader kicks; runs
/// the QPs' send sides; spins for `cfg.spin` after work so back-to-back posts need no wakeup.
pub(crate) fn doorbell_loop(engine: Weak<Engine>) {
    realtime_thread(DOORBELL_PRIORITY);
    let mut follower = affinity::CpuFollower::always(engine.upgrade().is_some_and(|e| e.cfg.follow_cpu));
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
    let mut last_heartbeat = Instant::now();
    let mut active: Vec<Arc<MedQp>> = Vec::new();
    // UD QPs' datagram sockets with datagrams to forward (through the scheduler, as the
    // send rings are).
    let mut ud_active: Vec<Arc<UdSender>> = Vec::new();
    let ud_scratch = RefCell::new((Vec::new(), Vec::new()));
    loop {
        let Some(e) = engine.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let hb_every = e.cfg.peer_timeout / 4;
        let now = Instant::now();
        let next_timer = e.timers.lock().peek().map(|r| r.0 .0);
        // The heartbeat needs no precision: rounded up to a millisecond. A due timer (an RNR
        // wait, as short as 10 µs) is slept out exactly: this thread runs at real-time
        // priority, and polling until it is due (as it once did) held its CPU from every
        // application there for as long as an RNR storm lasted.
        let ms = |d: Duration| Duration::from_millis(d.as_micros().div_ceil(1000) as u64);
        let mut wait = ms(hb_every.saturating_sub(now.duration_since(last_heartbeat)));
        if let Some(t) = next_timer {
            wait = wait.min(t.saturating_duration_since(now));
        }
        // QPs waiting for their caps: rounded up (a millisecond late is nothing against the
        // 100 ms windows caps hold over; early would spin).
        {
            let qos = e.qos.lock();
            if let Some(t) = qos.next_due() {
                wait = wait.min(ms(Duration::from_nanos(t.saturating_sub(e.qos_now()))));
            }
            // QPs waiting for room on the wire are woken by acknowledgements (a kick); this
            // bounds the wait should one be missed.
            if qos.has_blocked() {
                wait = wait.min(Duration::from_millis(1));
            }
        }
        let epfd = e.epoll.as_raw_fd();
        drop(e);
        trace::record(trace::Stage::DoorbellSleep, 0, 0);
        let n = epoll_wait_for(epfd, &mut events, wait);
        trace::record(trace::Stage::DoorbellWake, n.max(0) as u32, 0);
        let Some(e) = engine.upgrade() else { return };
        active.clear();
        ud_active.clear();
        // Whatever asks for a pass other than a doorbell (resumed or closing senders, QPs
        // wanting a pump) kicks: without a kick those lists are not even looked at, so a
        // doorbell's way to the wire does not scan every QP of the host.
        let mut kicked = false;
        for ev in events.iter().take(n.max(0) as usize) {
            match Token::of(ev.u64) {
                Token::Kick => {
                    drain_eventfd(&e.kick);
                    kicked = true;
                }
                Token::Conn(token) => {
                    let conn = e.out_conns.lock().get(&token).and_then(std::sync::Weak::upgrade);
                    if let Some(c) = conn {
                        e.resume(c.on_writable(), &mut active);
                    }
                }
                Token::Ud(qpn) => {
                    // (Pumped in the scheduler's round below.)
                    ud_active.extend(e.ud_senders.read().get(&qpn).cloned());
                }
                Token::Qp(qpn) => {
                    if let Some(q) = e.qps.read().get(&qpn) {
                        // (Edge-triggered: nothing to read.)
                        active.push(q.clone());
                    }
                }
            }
        }
        // Rung by a client: move to its CPU if it keeps ringing from there.
        if let Some(q) = active.first() {
            follower.woken_from(|| q.ringer_cpu());
        }
        if kicked {
            // Parked on connections that failed or went.
            let resumed = std::mem::take(&mut *e.resumed.lock());
            e.resume(resumed, &mut active);
            // Destroyed UD QPs: forward what they sent before going.
            let closing = std::mem::take(&mut *e.ud_closing.lock());
            let mut scratch = ud_scratch.borrow_mut();
            let (msg, frame) = &mut *scratch;
            for s in closing {
                s.drain(&e, msg, frame);
            }
        }
        // Due timers (RNR waits, not-ready retries).
        let now = Instant::now();
        loop {
            let due = {
                let mut t = e.timers.lock();
                match t.peek() {
                    Some(r) if r.0 .0 <= now => t.pop().map(|r| r.0 .1),
                    _ => None,
                }
            };
            let Some(qpn) = due else { break };
            if let Some(q) = e.qps.read().get(&qpn) {
                active.push(q.clone());
            }
        }
        // QPs whose caps let them go again, and those that waited for room on the wire.
        let due = {
            let mut qos = e.qos.lock();
            let mut due = qos.due(e.qos_now());
            due.extend(qos.take_blocked());
            due
        };
        if !due.is_empty() {
            let qps = e.qps.read();
            active.extend(due.iter().filter_map(|qpn| qps.get(qpn).cloned()));
            drop(qps);
            // A UD socket the scheduler held back is read again (and reported by epoll
            // again while datagrams wait there).
            let senders = e.ud_senders.read();
            for s in due.iter().filter_map(|qpn| senders.get(qpn)) {
                let _ = e.epoll_add(s.socket.as_raw_fd(), Token::ud(s.qpn));
                ud_active.push(s.clone());
            }
        }
        // Responses may have freed room in every QP that had work: readers kick us for those.
        if kicked {
            for q in e.qps.read().values() {
                if q.wants_pump.swap(false, Ordering::AcqRel) {
                    active.push(q.clone());
                }
            }
        }
        if !active.is_empty() || !ud_active.is_empty() {
            // (No clock reads when there is no spin, as on two CPUs: one pass, then again
            // only while there is more.)
            let spin = !e.cfg.spin.is_zero();
            let spin_until = if spin { Instant::now() + e.cfg.spin } else { now };
            let mut throttled: Vec<u32>;
            let scheduled: Vec<Scheduled> = active
                .iter()
                .map(|q| Scheduled::Qp { e: &e, q })
                .chain(ud_active.iter().map(|s| Scheduled::Ud { e: &e, s, ended: Cell::new(None), scratch: &ud_scratch }))
                .collect();
            loop {
                // One round of the scheduler: each vNIC its fair share, within its caps.
                let round = e.qos.lock().round(&scheduled, e.qos_now(), || e.wire_use());
                e.wire_waiting.store(!round.blocked.is_empty(), Ordering::Release);
                throttled = round.throttled;
                throttled.extend(round.blocked);
                let more = active.iter().any(|q| !throttled.contains(&q.qpn) && q.has_work());
                if !more && (!spin || Instant::now() >= spin_until) {
                    break;
                }
                if !more {
                    std::hint::spin_loop();
                }
                if more && (!spin || Instant::now() >= spin_until + e.cfg.spin * 4) {
                    // Still busy (e.g. stalled on completions): let the sleeper logic decide.
                    break;
                }
            }
            for sc in &scheduled {
                // A datagram socket whose client closed it (nothing more will come), parked
                // on a backlogged connection (resumed when that is sent), or that the
                // scheduler holds back (its caps, a full wire: read again when it is due)
                // leaves the epoll set, not just muted: epoll would report it again at once.
                if let Scheduled::Ud { s, ended, .. } = sc {
                    if ended.get().is_some() || throttled.contains(&s.qpn) {
                        e.epoll_del(s.socket.as_raw_fd());
                    }
                }
            }
            drop(scheduled);
            for q in &active {
                // A throttled QP needs no doorbells either: the scheduler wakes it when its
                // caps let it go (or, waiting for room on the wire, when an acknowledgement
                // frees some).
                if throttled.contains(&q.qpn) {
                    continue;
                }
                // A parked QP needs no doorbells (each would be a wakeup for nothing): it is
                // pumped, and then asks again, once its connection has room.
                if !q.is_parked() {
                    q.want_doorbell();
                }
                if q.has_work() {
                    e.kick_qp(q);
                }
            }
        }
        if last_heartbeat.elapsed() >= hb_every {
            last_heartbeat = Instant::now();
            let links: Vec<Arc<Link>> = e.links.lock().values().cloned().collect();
            for l in links {
                if let Err(err) = l.heartbeat(e.cfg.peer_timeout) {
                    e.fail_peer(l.addr, l.peer_boot, &err);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of epoll token reads back as what it was made for, over the whole range of
    /// QPNs and connection numbers, and none is taken for the kick.
    #[test]
    fn epoll_tokens_read_back_as_what_they_were_made_for() {
        for n in [0u32, 1, 0x00ff_ffff, u32::MAX - 1, u32::MAX] {
            assert_eq!(Token::of(Token::qp(n)), Token::Qp(n));
            assert_eq!(Token::of(Token::ud(n)), Token::Ud(n));
            let conn = Token::conn(u64::from(n));
            assert_eq!(Token::of(conn), Token::Conn(conn));
        }
        assert_eq!(Token::of(KICK_TOKEN), Token::Kick);
        // A connection number past 32 bits wraps into its range rather than into a UD bit.
        assert_eq!(Token::conn((1 << 32) | 7), Token::conn(7));
        assert!(matches!(Token::of(Token::conn(u64::MAX)), Token::Conn(_)));
    }
}
