//! Whole-frame deadlines for lanes. A lane's far end is a client's socket, so what arrives on
//! it is untrusted: a request frame must arrive whole within a deadline set by its length,
//! not merely make progress now and then (the socket's read timeout is per read: a client
//! sending a WRITE's data one byte every few seconds would otherwise keep the QP's
//! responder lock for ever). A frame late past its deadline ends the lane: one watchdog
//! thread shuts its socket down, which wakes the blocked read with an error.
//!
//! Arming and disarming is one atomic store each (no syscall on the data path); the watchdog
//! sleeps while no lane is served and checks every [`TICK`] while some are.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::engine::connection::Conn;

/// What any frame may take, however short.
pub(crate) const FRAME_BASE: Duration = Duration::from_secs(2);
/// The slowest data rate a frame's data may arrive at (bytes per second) beyond
/// [`FRAME_BASE`]: a peer daemon's lane moves megabytes per millisecond.
pub(crate) const FRAME_MIN_RATE: u64 = 4 << 20;
/// How often the watchdog looks at armed deadlines.
const TICK: Duration = Duration::from_millis(100);

/// The deadline of one lane's frame in progress.
pub(crate) struct FrameClock {
    /// Milliseconds after [`epoch`] when the frame in progress must be complete; 0: none.
    due_ms: AtomicU64,
    conn: Weak<Conn>,
}

/// The process's reference instant for deadlines.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

/// The time a frame with `data_len` bytes of data may take to arrive whole.
pub(crate) fn allowance(data_len: u64) -> Duration {
    FRAME_BASE + Duration::from_millis(data_len.saturating_mul(1000) / FRAME_MIN_RATE)
}

impl FrameClock {
    /// Arms the clock: the frame begun now must be read within `allowance`.
    pub(crate) fn arm(&self, allowance: Duration) {
        let due = now_ms().saturating_add(allowance.as_millis() as u64).max(1);
        self.due_ms.store(due, Ordering::Release);
    }

    /// The frame was read whole.
    pub(crate) fn disarm(&self) {
        self.due_ms.store(0, Ordering::Release);
    }

    /// Whether the frame in progress is past its deadline.
    fn expired(&self, now: u64) -> bool {
        let due = self.due_ms.load(Ordering::Acquire);
        due != 0 && now >= due
    }
}

/// The watchdog: the clocks of the lanes served, checked by one thread.
struct Watchdog {
    clocks: Mutex<Vec<Weak<FrameClock>>>,
    wake: Condvar,
}

static WATCHDOG: OnceLock<Result<Arc<Watchdog>, String>> = OnceLock::new();

/// A clock for lane connection `conn`, watched until it is dropped. Fails if the watchdog
/// thread cannot be started (the lane is then refused).
pub(crate) fn watch(conn: &Arc<Conn>) -> Result<Arc<FrameClock>, String> {
    let dog = WATCHDOG
        .get_or_init(|| {
            let dog = Arc::new(Watchdog { clocks: Mutex::new(Vec::new()), wake: Condvar::new() });
            let d = dog.clone();
            std::thread::Builder::new()
                .name("engine-lane-deadlines".into())
                .spawn(move || d.run())
                .map(|_| dog)
                .map_err(|e| format!("no thread for lane deadlines: {e}"))
        })
        .clone()?;
    let clock = Arc::new(FrameClock { due_ms: AtomicU64::new(0), conn: Arc::downgrade(conn) });
    dog.clocks.lock().push(Arc::downgrade(&clock));
    dog.wake.notify_one();
    Ok(clock)
}

impl Watchdog {
    fn run(&self) {
        let mut clocks = self.clocks.lock();
        loop {
            clocks.retain(|c| c.strong_count() > 0);
            if clocks.is_empty() {
                self.wake.wait(&mut clocks);
                continue;
            }
            let now = now_ms();
            for c in clocks.iter().filter_map(Weak::upgrade) {
                if c.expired(now) {
                    c.disarm();
                    if let Some(conn) = c.conn.upgrade() {
                        log::warn!("engine: a lane from {} sent a frame too slowly: closed", conn.peer);
                        conn.shutdown();
                    }
                }
            }
            self.wake.wait_for(&mut clocks, TICK);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::engine::testing::connection;

    /// A frame whose bytes trickle in (each read making progress, so a per-read timeout
    /// never fires) is cut off at its deadline: the read blocked on it fails.
    #[test]
    fn a_trickled_frame_ends_its_lane_at_the_deadline() {
        let (mut peer, c) = connection();
        let clock = watch(&c).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let trickle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) && peer.write_all(b"x").is_ok() {
                std::thread::sleep(Duration::from_millis(50));
            }
            // (Shut down by the watchdog: the peer sees the end.)
            let _ = peer.read(&mut [0u8; 1]);
        });
        let started = Instant::now();
        clock.arm(Duration::from_millis(300));
        let mut buf = vec![0u8; 1000];
        let r = c.read_exact(&mut buf);
        stop.store(true, Ordering::Relaxed);
        assert!(r.is_err(), "the trickled frame was read whole");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "cut off after {took:?}");
        trickle.join().unwrap();
    }

    /// A frame read in time is not cut off, and a disarmed clock never fires.
    #[test]
    fn a_frame_in_time_is_untouched() {
        let (mut peer, c) = connection();
        let clock = watch(&c).unwrap();
        clock.arm(allowance(8));
        peer.write_all(&[7u8; 8]).unwrap();
        let mut buf = [0u8; 8];
        c.read_exact(&mut buf).unwrap();
        clock.disarm();
        std::thread::sleep(TICK * 3);
        assert!(c.is_alive());
        assert_eq!(allowance(FRAME_MIN_RATE), FRAME_BASE + Duration::from_secs(1));
    }
}
