//! DEL: remove what ADD made. Idempotent and best effort, as the spec asks: a missing
//! namespace, veth or vNIC is success.

use crate::config::{Config, VnicSource};
use crate::daemon::Daemon;
use crate::env::Attachment;
use crate::error::CniError;
use crate::state::{Record, State};
use crate::{names, Invocation};

/// Runs DEL.
pub fn del(inv: &Invocation, at: &Attachment, conf: &Config) -> Result<(), CniError> {
    let daemon = Daemon::new(&conf.admin_socket);
    let state = State::lock(&conf.state_dir, &conf.name)?;
    let record = match state.get(&at.container_id, &at.ifname)? {
        Some(r) => r,
        // No record (an ADD that died before writing it, or a record lost): the names are
        // derived from the attachment, and the configuration says whether the vNIC was ours.
        None => {
            let per_container = matches!(conf.vnic_source(inv), Ok(VnicSource::PerContainer { .. }));
            Record {
                container_id: at.container_id.clone(),
                ifname: at.ifname.clone(),
                netns: at.netns.as_ref().map(|p| p.display().to_string()),
                vnic: if per_container { names::vnic(&at.container_id, &at.ifname) } else { String::new() },
                created_vnic: per_container,
                host_veth: names::host_veth(&at.container_id, &at.ifname),
                complete: false,
            }
        }
    };
    undo(&record, &daemon)?;
    state.remove(&at.container_id, &at.ifname)
}

/// Deletes the veth pair and, if the plugin created it, the vNIC. The record stays with the
/// caller: it is removed only once this succeeded, so a failure can be retried.
pub fn undo(record: &Record, daemon: &Daemon) -> Result<(), CniError> {
    vrdma_netns::attach::detach(&record.host_veth)?;
    if record.created_vnic && !record.vnic.is_empty() {
        daemon.delete(&record.vnic)?;
    }
    Ok(())
}
