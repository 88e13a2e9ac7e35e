//! Stage timestamps of the mediated data path, for latency work.
//!
//! Tracers that follow the scheduler (`perf sched` and the like) change where and when the
//! engine's threads run, and with them the latency they are meant to explain. This one
//! reads clocks: when vrdmad starts with `VRDMA_ENGINE_TRACE=<prefix>`, every engine thread
//! records (CLOCK_MONOTONIC ns, [`Stage`], CPU, QPN, PSN) at the points below into a buffer
//! of [`CAPACITY`] records allocated at start (64 MiB), a background thread appends them to
//! `<prefix>.<pid>` as text lines (`ns stage cpu qpn psn`) every 250 ms (the last 250 ms
//! before the daemon exits are not written), and recording stops when the buffer is full.
//! Readers then also read with `recvmsg` to learn when the kernel received each segment
//! (`SO_TIMESTAMPNS`, which turns receive timestamps on for the whole host), splitting the
//! network leg into the sender's kernel path and the receiver's wakeup. That is a few clock
//! reads and a `sched_getcpu` per leg: small beside the microseconds measured, not nothing.
//! All daemons of a simulated cluster share one clock, so their files line up;
//! `scripts/engine-trace.py` turns them into per-stage medians.
//!
//! Off (the default), a record point costs a load and a branch.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Records kept (16 bytes each) before recording stops.
pub(crate) const CAPACITY: usize = 4 << 20;

/// Where a record is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Stage {
    /// The doorbell thread goes to sleep in `epoll_wait`.
    DoorbellSleep = 1,
    /// It woke (QPN: how many events).
    DoorbellWake = 2,
    /// A QP's frames are about to be written to its connection.
    SendStart = 3,
    /// They were written (the call returned).
    SendEnd = 4,
    /// The kernel received the segment a reader woke for (its receive timestamp).
    Received = 5,
    /// A reader of an inbound connection has a frame's header.
    RequestRead = 6,
    /// It has executed the frame.
    RequestDone = 7,
    /// It sent the ACKs it owed (before blocking).
    AcksSent = 8,
    /// A reader of an outbound connection has a frame's header.
    ResponseRead = 9,
    /// It has handled the frame.
    ResponseDone = 10,
}

struct Buffer {
    /// Two words per record: nanoseconds (stored last; 0 while being written) and the rest.
    words: Vec<AtomicU64>,
    next: AtomicUsize,
    path: String,
}

static BUFFER: OnceLock<Option<Buffer>> = OnceLock::new();

fn buffer() -> Option<&'static Buffer> {
    BUFFER
        .get_or_init(|| {
            let prefix = std::env::var("VRDMA_ENGINE_TRACE").ok().filter(|p| !p.is_empty())?;
            let path = format!("{prefix}.{}", std::process::id());
            log::warn!("engine: tracing data-path stages to {path}");
            std::thread::Builder::new().name("engine-trace".into()).spawn(writer).ok()?;
            Some(Buffer { words: (0..CAPACITY * 2).map(|_| AtomicU64::new(0)).collect(), next: AtomicUsize::new(0), path })
        })
        .as_ref()
}

/// Whether tracing is on.
pub(crate) fn enabled() -> bool {
    buffer().is_some()
}

/// Records `stage` now.
#[inline]
pub(crate) fn record(stage: Stage, qpn: u32, psn: u32) {
    if let Some(b) = buffer() {
        store(b, now_ns(), stage, qpn, psn);
    }
}

/// Records `stage` at `ns` (CLOCK_MONOTONIC).
pub(crate) fn record_at(ns: u64, stage: Stage, qpn: u32, psn: u32) {
    if let Some(b) = buffer() {
        store(b, ns, stage, qpn, psn);
    }
}

fn store(b: &Buffer, ns: u64, stage: Stage, qpn: u32, psn: u32) {
    let i = b.next.fetch_add(1, Ordering::Relaxed);
    if i >= CAPACITY {
        return;
    }
    // (A zero time marks a slot not yet written: the writer would wait at it for good.)
    let ns = ns.max(1);
    // SAFETY: sched_getcpu has no arguments and no memory effects.
    let cpu = unsafe { libc::sched_getcpu() }.max(0) as u64;
    b.words[2 * i + 1].store(encode(stage, cpu, qpn, psn), Ordering::Relaxed);
    b.words[2 * i].store(ns, Ordering::Release);
}

fn encode(stage: Stage, cpu: u64, qpn: u32, psn: u32) -> u64 {
    (stage as u64) << 56 | (cpu & 0xff) << 48 | (u64::from(qpn) & 0xff_ffff) << 24 | u64::from(psn) & 0xff_ffff
}

/// The text line of a record: `ns stage cpu qpn psn`.
fn line(ns: u64, w: u64) -> String {
    format!("{ns} {} {} {} {}\n", w >> 56, (w >> 48) & 0xff, (w >> 24) & 0xff_ffff, w & 0xff_ffff)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a live timespec to fill.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// A kernel receive timestamp (CLOCK_REALTIME) on the CLOCK_MONOTONIC scale.
pub(crate) fn monotonic_of_realtime(realtime_ns: u64) -> u64 {
    let (real, mono) = (clock_ns(libc::CLOCK_REALTIME), now_ns());
    realtime_ns.wrapping_sub(real.wrapping_sub(mono))
}

/// Appends finished records to the file until the buffer is full and written.
fn writer() {
    let mut done = 0;
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let Some(b) = buffer() else { return };
        let mut text = String::new();
        while done < CAPACITY {
            let ns = b.words[2 * done].load(Ordering::Acquire);
            if ns == 0 {
                break;
            }
            text.push_str(&line(ns, b.words[2 * done + 1].load(Ordering::Relaxed)));
            done += 1;
        }
        if !text.is_empty() {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(&b.path);
            if let Err(e) = file.and_then(|mut f| f.write_all(text.as_bytes())) {
                log::warn!("engine: trace file {}: {e}", b.path);
                return;
            }
        }
        if done >= CAPACITY {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_its_fields() {
        let w = encode(Stage::Received, 1, 0x12_3456, 0xff_ffff);
        assert_eq!(line(42, w), "42 5 1 1193046 16777215\n");
        // Wider QPNs and PSNs keep their low 24 bits and leave the other fields alone.
        assert_eq!(line(1, encode(Stage::AcksSent, 300, 0x1ff_ffff, 0x100_0001)), "1 8 44 16777215 1\n");
    }

    #[test]
    fn receive_timestamps_land_on_the_monotonic_clock() {
        let mono = monotonic_of_realtime(clock_ns(libc::CLOCK_REALTIME));
        let now = now_ns();
        assert!(now >= mono && now - mono < 1_000_000_000, "{mono} vs {now}");
    }
}
