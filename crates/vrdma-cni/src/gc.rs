//! GC and STATUS (1.1.0): stale attachments, and whether ADD can work.

use crate::config::Config;
use crate::daemon::Daemon;
use crate::del::undo;
use crate::error::CniError;
use crate::state::State;

/// GC: undoes every recorded attachment of this network that is not among
/// `cni.dev/valid-attachments`, carrying on past failures; returns the first of them.
pub fn gc(conf: &Config) -> Result<(), CniError> {
    if !conf.version.has_status_and_gc() {
        return Err(CniError::IncompatibleVersion { version: conf.version_text.clone(), reason: "GC needs 1.1.0".into() });
    }
    let valid =
        conf.valid_attachments.as_ref().ok_or_else(|| CniError::InvalidConfig { reason: "GC needs cni.dev/valid-attachments".into() })?;
    let daemon = Daemon::new(&conf.admin_socket);
    let state = State::lock(&conf.state_dir, &conf.name)?;
    let mut first_error = None;
    for r in state.records()? {
        if valid.iter().any(|(c, i)| *c == r.container_id && *i == r.ifname) {
            continue;
        }
        match undo(&r, &daemon).and_then(|()| state.remove(&r.container_id, &r.ifname)) {
            Ok(()) => eprintln!("vrdma-cni: GC removed the attachment of {} {}", r.container_id, r.ifname),
            Err(e) => {
                eprintln!("vrdma-cni: GC of {} {}: {e}", r.container_id, r.ifname);
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// STATUS: ready when vrdmad answers.
pub fn status(conf: &Config) -> Result<(), CniError> {
    if !conf.version.has_status_and_gc() {
        return Err(CniError::IncompatibleVersion { version: conf.version_text.clone(), reason: "STATUS needs 1.1.0".into() });
    }
    Daemon::new(&conf.admin_socket).network().map(drop).map_err(|e| CniError::Unavailable { reason: e.to_string() })
}
