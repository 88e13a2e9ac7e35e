//! The staging backstop: a thread of the library that retries SENDs waiting for room in a
//! responder's staging ring (`staged.rs`) while the application does not poll its send CQ.
//!
//! On a NIC a posted WR goes out whatever the application does next; here a SEND that did not
//! fit the responder's ring waits in the QP's retry queue, which polls of the send CQ drive.
//! An application that posts unsignaled SENDs and then waits for its peer without polling
//! (perftest's bandwidth client does, for its last WRs) would hold them forever. One thread
//! per process, started by the first such wait, sleeping on a condition variable whenever no
//! QP waits; it holds the QPs weakly.

use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use super::QpInner;

/// How often the backstop retries while some QP waits (a poll by the application, when it
/// polls, comes sooner).
const RETRY_EVERY: Duration = Duration::from_micros(200);

struct Backstop {
    waiting: Mutex<Vec<Weak<QpInner>>>,
    wake: Condvar,
}

static BACKSTOP: OnceLock<Option<Arc<Backstop>>> = OnceLock::new();

fn backstop() -> Option<&'static Arc<Backstop>> {
    BACKSTOP
        .get_or_init(|| {
            let b = Arc::new(Backstop { waiting: Mutex::new(Vec::new()), wake: Condvar::new() });
            let run = b.clone();
            // Without the thread, SENDs still go on from the application's polls.
            std::thread::Builder::new().name("vrdma-staging".into()).spawn(move || run.serve()).ok().map(|_| b)
        })
        .as_ref()
}

impl Backstop {
    fn serve(&self) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            while waiting.is_empty() {
                waiting = self.wake.wait(waiting).unwrap_or_else(|e| e.into_inner());
            }
            let qps: Vec<Arc<QpInner>> = waiting.iter().filter_map(Weak::upgrade).collect();
            waiting.clear();
            drop(waiting);
            for q in &qps {
                q.progress();
            }
            waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            // Those still waiting for room stay (`progress` asked again through
            // `wait_for_room`); the others are done.
            if !waiting.is_empty() {
                drop(waiting);
                std::thread::sleep(RETRY_EVERY);
                waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

impl QpInner {
    /// Asks the backstop to retry this QP's waiting SENDs (a SEND found no room in the
    /// responder's staging ring).
    pub(super) fn wait_for_room(&self) {
        let Some(b) = backstop() else { return };
        let mut waiting = b.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if !waiting.iter().any(|w| w.ptr_eq(&self.me)) {
            waiting.push(self.me.clone());
            b.wake.notify_one();
        }
    }
}
