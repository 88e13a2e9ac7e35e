//! A client's memory accessed on a thread of its own, for callers that serve every vNIC.
//!
//! Reading or writing `/proc/PID/mem` (and reading `/proc/PID/maps`) waits for the process's
//! memory-map lock, which the process can hold for writing as long as it likes (a loop of
//! `mprotect` or `fork` over gigabytes), and for its page faults (a file on a slow disk). The
//! mediated engine's doorbell thread and its connections' readers serve every vNIC of the
//! host, so they hand such accesses to the owner's agent and wait a little
//! ([`ENGINE_WAIT`]): what is not done by then goes on there while the caller answers "not
//! ready" (the requester retries) or, on the requester's side, tries again later. The result
//! is kept under the caller's key for that retry, so an access that took longer than the
//! wait is not done twice (an atomic) nor again and again (a slow read).
//!
//! An owner that holds its lock only slows its own traffic: its agent has at most
//! [`CAPACITY`] accesses under way or waiting to be collected, and asks for more are "slow"
//! at once, without waiting.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use vrdma_core::sg::Atomic;

use super::{ProcMem, ProcMemError};

/// How long a caller serving every vNIC waits for an access of a client's memory before it
/// leaves it to go on alone: many times what a copy of a segment (256 KiB) from resident
/// memory takes, a fraction of what the memory-map lock can be held for.
pub const ENGINE_WAIT: Duration = Duration::from_micros(500);

/// Accesses under way or waiting to be collected, per client (a few segments of memory).
const CAPACITY: usize = 8;

/// How long a result nobody collected is kept (a requester gives up on a request well
/// before: its transport timeout).
const KEEP: Duration = Duration::from_secs(10);

/// What an access is, for the caller that may come back for it: the same key names the
/// same access (the same request of the same QP at the same bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The caller's stream (a QP of the engine, unique for the daemon's life).
    pub stream: u64,
    /// The request's PSN.
    pub psn: u32,
    /// The first byte, in the process.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Read, write or atomic.
    pub what: What,
}

/// The kind of access under a [`Key`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum What {
    /// A read of the bytes.
    Read,
    /// A write of the bytes.
    Write,
    /// An RDMA atomic on them.
    Atomic,
}

/// An access's result.
#[derive(Debug)]
pub enum Done {
    /// The bytes read.
    Bytes(Vec<u8>),
    /// Written.
    Written,
    /// An atomic's original value.
    Word(u64),
}

/// The access did not finish within the wait: it goes on; ask again with the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slow;

type Job = Box<dyn FnOnce() -> Result<Done, ProcMemError> + Send>;

enum Slot {
    Waiting,
    Finished(Result<Done, ProcMemError>, Instant),
}

#[derive(Default)]
struct State {
    queue: VecDeque<(Key, Job)>,
    slots: HashMap<Key, Slot>,
    worker: bool,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// A client's accesses, one at a time, on its own thread (started at the first).
pub(crate) struct Agent {
    shared: Arc<Shared>,
    pid: i32,
}

impl Agent {
    pub(crate) fn new(pid: i32) -> Agent {
        Agent { shared: Arc::default(), pid }
    }

    /// Runs `job` under `key` on the agent, waiting at most `wait` for it (or collects the
    /// result of an earlier call's `job` under the same key, which then is not run).
    /// `Err(Slow)` when it is not done by then (it goes on), when it is still going on from
    /// before, or when the agent has [`CAPACITY`] accesses to do already.
    pub(crate) fn run(
        &self,
        key: Key,
        wait: Duration,
        job: impl FnOnce() -> Result<Done, ProcMemError> + Send + 'static,
    ) -> Result<Result<Done, ProcMemError>, Slow> {
        let deadline = Instant::now() + wait;
        let mut s = self.shared.state.lock();
        match s.slots.remove(&key) {
            Some(Slot::Finished(r, _)) => return Ok(r),
            Some(Slot::Waiting) => {
                s.slots.insert(key, Slot::Waiting);
                return Err(Slow);
            }
            None => {}
        }
        if !make_room(&mut s) {
            return Err(Slow);
        }
        if !s.worker {
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new().name(format!("vrdmad-mem-{}", self.pid)).spawn(move || work(&shared));
            if let Err(source) = spawned {
                return Ok(Err(ProcMemError::Worker { pid: self.pid, source }));
            }
            s.worker = true;
        }
        s.slots.insert(key, Slot::Waiting);
        s.queue.push_back((key, Box::new(job)));
        self.shared.work.notify_one();
        loop {
            if let Some(Slot::Finished(..)) = s.slots.get(&key) {
                let Some(Slot::Finished(r, _)) = s.slots.remove(&key) else { unreachable!() };
                return Ok(r);
            }
            if self.shared.done.wait_until(&mut s, deadline).timed_out() {
                return match s.slots.remove(&key) {
                    Some(Slot::Finished(r, _)) => Ok(r),
                    other => {
                        if let Some(slot) = other {
                            s.slots.insert(key, slot);
                        }
                        Err(Slow)
                    }
                };
            }
        }
    }
}

impl ProcMem {
    /// Reads `key.len` bytes at `key.addr` on the process's agent, as [`ProcMem::read_now`]
    /// does, waiting at most `wait` (see [`Agent::run`]).
    pub fn read_on_agent(self: &Arc<Self>, key: Key, wait: Duration) -> Result<Result<Vec<u8>, ProcMemError>, Slow> {
        let m = self.clone();
        let r = self.agent.run(key, wait, move || {
            let mut buf = vec![0u8; key.len as usize];
            m.read_now(key.addr, &mut buf).map(|()| Done::Bytes(buf))
        })?;
        Ok(r.and_then(|d| match d {
            Done::Bytes(b) if b.len() as u64 == key.len => Ok(b),
            _ => Err(ProcMemError::Mismatch { pid: self.pid }),
        }))
    }

    /// Writes `data` (`key.len` bytes) at `key.addr` on the process's agent, as
    /// [`ProcMem::write_now`] does, waiting at most `wait`.
    pub fn write_on_agent(self: &Arc<Self>, key: Key, data: Vec<u8>, wait: Duration) -> Result<Result<(), ProcMemError>, Slow> {
        let m = self.clone();
        let r = self.agent.run(key, wait, move || m.write_now(key.addr, &data).map(|()| Done::Written))?;
        Ok(r.and_then(|d| match d {
            Done::Written => Ok(()),
            _ => Err(ProcMemError::Mismatch { pid: self.pid }),
        }))
    }

    /// RDMA atomic `op` at `key.addr` on the process's agent, as [`ProcMem::atomic_now`]
    /// does, waiting at most `wait`; the original value.
    pub fn atomic_on_agent(self: &Arc<Self>, key: Key, op: Atomic, wait: Duration) -> Result<Result<u64, ProcMemError>, Slow> {
        let m = self.clone();
        let r = self.agent.run(key, wait, move || m.atomic_now(key.addr, op).map(Done::Word))?;
        Ok(r.and_then(|d| match d {
            Done::Word(v) => Ok(v),
            _ => Err(ProcMemError::Mismatch { pid: self.pid }),
        }))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
    }
}

/// Frees a slot for a new access if there are [`CAPACITY`]: results kept too long, then the
/// oldest result but an atomic's (dropped, it would be done again when its request comes
/// back). False if every slot is an access under way or an atomic's result.
fn make_room(s: &mut State) -> bool {
    let now = Instant::now();
    s.slots.retain(|_, slot| !matches!(slot, Slot::Finished(_, at) if now.duration_since(*at) > KEEP));
    if s.slots.len() < CAPACITY {
        return true;
    }
    let oldest = s
        .slots
        .iter()
        .filter_map(|(k, slot)| match slot {
            Slot::Finished(_, at) if k.what != What::Atomic => Some((*at, *k)),
            _ => None,
        })
        .min_by_key(|(at, _)| *at);
    match oldest {
        Some((_, k)) => {
            s.slots.remove(&k);
            true
        }
        None => false,
    }
}

/// The agent's thread: runs jobs in order until the agent is dropped and none is left.
fn work(shared: &Shared) {
    let mut s = shared.state.lock();
    loop {
        let Some((key, job)) = s.queue.pop_front() else {
            if s.closed {
                s.worker = false;
                return;
            }
            shared.work.wait(&mut s);
            continue;
        };
        drop(s);
        // (A job that panicked fails its access, not the agent: its slots would fill for good.)
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
            .unwrap_or_else(|_| Err(ProcMemError::Worker { pid: 0, source: std::io::Error::other("the access panicked") }));
        s = shared.state.lock();
        if let Some(slot @ Slot::Waiting) = s.slots.get_mut(&key) {
            *slot = Slot::Finished(r, Instant::now());
        }
        shared.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::mpsc;

    use super::*;

    fn key(psn: u32) -> Key {
        Key { stream: 1, psn, addr: 0x1000, len: 8, what: What::Atomic }
    }

    fn read_key(psn: u32) -> Key {
        Key { what: What::Read, ..key(psn) }
    }

    const LONG: Duration = Duration::from_secs(5);

    /// A job that takes longer than the wait goes on; the same key collects its result later,
    /// without running it again (an atomic done twice would be wrong).
    #[test]
    fn a_slow_access_goes_on_and_is_collected_once() {
        let a = Agent::new(0);
        let (go, gate) = mpsc::channel::<()>();
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let job = move || {
            gate.recv().ok();
            r.fetch_add(1, Ordering::SeqCst);
            Ok(Done::Word(7))
        };
        assert_eq!(a.run(key(1), Duration::from_millis(5), job).err(), Some(Slow));
        let r = runs.clone();
        let again = move || {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(Done::Word(99))
        };
        assert_eq!(a.run(key(1), LONG, again).err(), Some(Slow), "still under way: slow at once");
        go.send(()).unwrap();
        let started = Instant::now();
        loop {
            let r = runs.clone();
            match a.run(key(1), LONG, move || {
                r.fetch_add(1, Ordering::SeqCst);
                Ok(Done::Word(99))
            }) {
                Ok(Ok(Done::Word(v))) => {
                    assert_eq!(v, 7, "the first job's result");
                    break;
                }
                Err(Slow) => assert!(started.elapsed() < LONG),
                other => panic!("{other:?}"),
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "run once");
    }

    /// An agent stuck on one access takes at most CAPACITY of them and refuses more at once,
    /// without waiting; once it moves, results nobody collected make room for new accesses,
    /// but an atomic's result is kept for its request (done again, it would be done twice).
    #[test]
    fn a_stuck_agent_refuses_more_at_once() {
        let a = Agent::new(0);
        let (go, gate) = mpsc::channel::<()>();
        assert!(a
            .run(key(0), Duration::ZERO, move || {
                gate.recv().ok();
                Ok(Done::Word(5))
            })
            .is_err());
        for psn in 1..CAPACITY as u32 {
            assert_eq!(a.run(read_key(psn), Duration::from_millis(1), || Ok(Done::Written)).err(), Some(Slow));
        }
        let started = Instant::now();
        assert_eq!(a.run(read_key(100), LONG, || Ok(Done::Written)).err(), Some(Slow));
        assert!(started.elapsed() < Duration::from_secs(1), "refused without waiting");
        go.send(()).unwrap();
        // Once it moves, the queued ones finish and their results make room.
        let started = Instant::now();
        for psn in 100..100 + CAPACITY as u32 {
            while a.run(read_key(psn), LONG, || Ok(Done::Written)).is_err() {
                assert!(started.elapsed() < LONG);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        match a.run(key(0), LONG, || Ok(Done::Word(99))) {
            Ok(Ok(Done::Word(v))) => assert_eq!(v, 5, "the atomic's own result, kept"),
            other => panic!("{other:?}"),
        }
    }
}
