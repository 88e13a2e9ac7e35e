//! Slots and their vNICs in vrdmad: a slot's vNIC has the slot's device ID as its name, is
//! made anew for each pod, moved to the pod's tenant once the pod is known, and deleted once
//! no pod holds the slot.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::admin::{Admin, AdminError, Vnic};
use crate::slots::SlotNames;

/// What failed changing a slot's vNIC.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("{0} has no vNIC: was it allocated?")]
    NotBound(String),
    #[error("the admin call's thread failed: {0}")]
    Task(String),
}

/// The vNICs of this node's slots.
pub(crate) struct Binder {
    admin: Admin,
    names: SlotNames,
    /// Locked for one change at a time.
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// When each slot was last bound.
    bound: HashMap<String, Instant>,
    /// The slots the last garbage collection found no pod holding.
    unheld: HashSet<String>,
}

/// Runs the blocking admin calls of `f` off the runtime's thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, BindError> + Send + 'static) -> Result<T, BindError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| BindError::Task(e.to_string()))?
}

impl Binder {
    pub(crate) fn new(admin: Admin, names: SlotNames) -> Binder {
        Binder { admin, names, state: Mutex::new(State::default()) }
    }

    /// Binds slot `id` to a fresh vNIC of the same name in `tenant`: a vNIC left from the
    /// slot's previous pod is deleted first, so no state passes from one pod to the next.
    pub(crate) async fn bind(&self, id: &str, tenant: String) -> Result<Vnic, BindError> {
        let mut state = self.state.lock().await;
        state.bound.insert(id.to_string(), Instant::now());
        state.unheld.remove(id);
        let admin = self.admin.clone();
        let id = id.to_string();
        blocking(move || {
            if admin.find(&id)?.is_some() {
                admin.delete(&id)?;
            }
            Ok(admin.create(&id, &tenant, None)?)
        })
        .await
    }

    /// Moves slot `id`'s vNIC to `tenant`, keeping its address (the CNI plugin may have given
    /// it to the pod already): the vNIC is made anew, before any container of the pod uses
    /// it. Nothing changes when it is in `tenant` already (a container restarting).
    pub(crate) async fn retenant(&self, id: &str, tenant: String) -> Result<Vnic, BindError> {
        let _one = self.state.lock().await;
        let admin = self.admin.clone();
        let id = id.to_string();
        blocking(move || {
            let Some(v) = admin.find(&id)? else { return Err(BindError::NotBound(id)) };
            if v.tenant == tenant {
                return Ok(v);
            }
            admin.delete(&id)?;
            Ok(admin.create(&id, &tenant, Some(format!("{}/{}", v.ip, v.prefix_len)))?)
        })
        .await
    }

    /// Deletes the vNICs of this node's slots that are not in `held` (their pods ended) now
    /// and were not at the previous collection either, so their addresses go back to the
    /// network; returns their names. Two looks in a row, because a kubelet that just
    /// restarted may list no pods for a moment; and a slot bound within `grace` is left
    /// alone, because the kubelet records an allocation only once Allocate returned.
    pub(crate) async fn collect_garbage(&self, held: HashSet<String>, grace: Duration) -> Result<Vec<String>, BindError> {
        let mut state = self.state.lock().await;
        let recent: HashSet<String> = state.bound.iter().filter(|(_, at)| at.elapsed() < grace).map(|(id, _)| id.clone()).collect();
        let before = std::mem::take(&mut state.unheld);
        let admin = self.admin.clone();
        let names = self.names.clone();
        let (deleted, unheld) = blocking(move || {
            let (mut deleted, mut unheld) = (Vec::new(), HashSet::new());
            for v in admin.local_vnics()? {
                if names.index(&v.name).is_none() || held.contains(&v.name) || recent.contains(&v.name) {
                    continue;
                }
                if before.contains(&v.name) {
                    admin.delete(&v.name)?;
                    deleted.push(v.name);
                } else {
                    unheld.insert(v.name);
                }
            }
            Ok((deleted, unheld))
        })
        .await?;
        state.bound.retain(|id, _| !deleted.contains(id));
        state.unheld = unheld;
        Ok(deleted)
    }
}
