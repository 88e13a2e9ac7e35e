//! The `qos-watch` thread: every `registry::QOS_TICK` while some vNIC served here has a cap
//! (else twice a second, to notice one), the registry checks that the direct path keeps to
//! the caps (`Registry::qos_tick`).

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::Daemon;
use crate::registry::QOS_TICK;

/// How often an uncapped host looks whether a cap appeared.
const IDLE_TICK: Duration = Duration::from_millis(500);

/// Starts the thread; it ends with the daemon.
pub(super) fn start(d: &Arc<Daemon>) {
    let weak: Weak<Daemon> = Arc::downgrade(d);
    let spawned = std::thread::Builder::new().name("qos-watch".into()).spawn(move || {
        static START: OnceLock<Instant> = OnceLock::new();
        let start = *START.get_or_init(Instant::now);
        let mut wait = IDLE_TICK;
        loop {
            std::thread::sleep(wait);
            let Some(d) = weak.upgrade() else { return };
            let mut reg = d.registry.lock();
            reg.qos_tick(start.elapsed().as_nanos() as u64);
            wait = if reg.any_capped() { QOS_TICK } else { IDLE_TICK };
        }
    });
    if let Err(e) = spawned {
        log::warn!("no qos-watch thread ({e}): caps on the direct path are not checked");
    }
}
