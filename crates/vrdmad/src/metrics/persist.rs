//! vNIC meter totals across daemon restarts: `<state_dir>/meters.json`, written every
//! [`SAVE_EVERY`] by a thread (and by [`save_now`]), loaded at start. What the live QPs
//! counted after the last save is lost if the daemon dies uncleanly (at most
//! [`SAVE_EVERY`]'s worth).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use vrdma_abi::ring::{MeterWords, METER_WORDS};

use crate::server::Daemon;

/// How often the totals are saved.
pub const SAVE_EVERY: Duration = Duration::from_secs(5);

/// The state file in `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("meters.json")
}

/// Loads the totals saved in `state_dir` (none if absent or unreadable, which is logged).
pub fn load(state_dir: &Path) -> HashMap<String, MeterWords> {
    let p = path(state_dir);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
        Err(e) => {
            log::warn!("{}: {e}; meters start from 0", p.display());
            return HashMap::new();
        }
    };
    let parsed: HashMap<String, Vec<u64>> = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => {
            log::warn!("{}: {e}; meters start from 0", p.display());
            return HashMap::new();
        }
    };
    parsed
        .into_iter()
        .map(|(name, v)| {
            let mut w = [0u64; METER_WORDS];
            for (d, s) in w.iter_mut().zip(v) {
                *d = s;
            }
            (name, w)
        })
        .collect()
}

/// Saves `totals` in `state_dir` (through a temporary file and a rename: never half written).
pub fn save(state_dir: &Path, totals: &HashMap<String, MeterWords>) -> std::io::Result<()> {
    let as_vecs: HashMap<&String, Vec<u64>> = totals.iter().map(|(k, v)| (k, v.to_vec())).collect();
    let p = path(state_dir);
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&as_vecs).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, &p)
}

/// Saves the daemon's totals now.
pub fn save_now(d: &Daemon) -> std::io::Result<()> {
    let totals = d.registry.lock().meter_totals();
    save(&d.cfg.state_dir, &totals)
}

/// Starts the thread that saves the totals every [`SAVE_EVERY`] while the daemon lives.
pub fn start(d: &Arc<Daemon>) {
    let weak: Weak<Daemon> = Arc::downgrade(d);
    let spawned = std::thread::Builder::new().name("meters-save".into()).spawn(move || {
        // What was saved last: an idle host writes nothing (a save costs its file system a
        // write and a rename, and the daemon milliseconds of CPU).
        let mut saved: Option<HashMap<String, MeterWords>> = None;
        loop {
            std::thread::sleep(SAVE_EVERY);
            let Some(d) = weak.upgrade() else { return };
            let totals = d.registry.lock().meter_totals();
            if saved.as_ref() == Some(&totals) {
                continue;
            }
            match save(&d.cfg.state_dir, &totals) {
                Ok(()) => saved = Some(totals),
                Err(e) => log::warn!("saving meters in {}: {e}", d.cfg.state_dir.display()),
            }
        }
    });
    if let Err(e) = spawned {
        log::warn!("no meters-save thread ({e}): meters restart from their last save");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_round_trip_and_garbage_starts_from_zero() {
        let dir = std::env::temp_dir().join(format!("vrdmad-meters-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(load(&dir).is_empty());
        let mut w = [0u64; METER_WORDS];
        w[1] = 12345;
        w[METER_WORDS - 1] = 7;
        let totals = HashMap::from([("a".to_string(), w)]);
        save(&dir, &totals).unwrap();
        assert_eq!(load(&dir), totals);
        std::fs::write(path(&dir), "{not json").unwrap();
        assert!(load(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
