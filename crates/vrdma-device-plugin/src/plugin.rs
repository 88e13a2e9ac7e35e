//! The DevicePlugin service: the node's vNIC slots as devices, their health from vrdmad,
//! Allocate and PreStartContainer binding them to vNICs (`crate::binding`).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::admin::Admin;
use crate::api;
use crate::binding::{BindError, Binder};
use crate::edits::{container_response, spec_lists, ContainerPaths, EditForms};
use crate::pods::{held_devices, pod_holding, PodsError};
use crate::slots::{SlotNames, SlotSource};
use crate::tenant::TenantPolicy;

/// What the plugin serves.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The extended resource (`vrdma.io/vnic`).
    pub resource_name: String,
    /// Where the number of slots (devices advertised) comes from.
    pub slots: SlotSource,
    /// The slots' device IDs, which are also the names of their vNICs.
    pub names: SlotNames,
    /// Which tenant a pod's vNIC is made in.
    pub tenants: TenantPolicy,
    /// Host paths (vrdmad's run directory, the drop-in libibverbs) the mounts answer exposes.
    pub paths: ContainerPaths,
    /// Whether Allocate answers with CDI device names, mounts, or both.
    pub forms: EditForms,
    /// The kubelet's pod resources socket (which pod holds a device, for its tenant).
    pub pod_resources: PathBuf,
    /// vrdmad's CDI spec directory: with CDI answers, Allocate waits until the spec lists the
    /// vNIC, so the runtime can resolve the name it is given (None: no wait).
    pub cdi_dir: Option<PathBuf>,
}

/// How long Allocate waits for vrdmad's CDI spec to list a new vNIC.
const CDI_WAIT: Duration = Duration::from_secs(5);

/// What the devices' list depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeState {
    pub(crate) slots: u32,
    pub(crate) vrdmad_up: bool,
}

/// The plugin's state, shared by every connection and every restart of its server.
pub struct Plugin {
    cfg: PluginConfig,
    admin: Admin,
    state: watch::Sender<NodeState>,
    /// Bumped when the server restarts (kubelet restart): ends the open ListAndWatch streams,
    /// which would otherwise hold the old server's graceful shutdown forever.
    generation: watch::Sender<u64>,
    binder: Binder,
}

/// The device list of `state`.
pub(crate) fn devices(names: &SlotNames, state: NodeState) -> Vec<api::Device> {
    let health = if state.vrdmad_up { api::HEALTHY } else { api::UNHEALTHY };
    (0..state.slots).map(|i| api::Device { id: names.id(i), health: health.into(), topology: None }).collect()
}

/// What stopped a garbage collection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GcError {
    #[error(transparent)]
    Pods(#[from] PodsError),
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// The kubelet's view of a failed binding: vrdmad away is worth retrying, the rest is not.
fn bind_status(e: BindError) -> Status {
    match &e {
        BindError::Admin(a) if a.is_unreachable() => Status::unavailable(e.to_string()),
        BindError::Admin(_) | BindError::NotBound(_) => Status::failed_precondition(e.to_string()),
        BindError::Task(_) => Status::internal(e.to_string()),
    }
}

impl Plugin {
    /// The plugin for `cfg`, with vrdmad and the slot count looked at once; the server
    /// ([`crate::server::run`]) keeps that state fresh.
    pub fn new(cfg: PluginConfig) -> Arc<Plugin> {
        let admin = Admin::new(&cfg.paths.run_dir);
        let state = NodeState { slots: cfg.slots.current(), vrdmad_up: admin.is_up() };
        Arc::new(Plugin {
            binder: Binder::new(admin.clone(), cfg.names.clone()),
            cfg,
            admin,
            state: watch::Sender::new(state),
            generation: watch::Sender::new(0),
        })
    }

    pub(crate) fn config(&self) -> &PluginConfig {
        &self.cfg
    }

    /// The state as last seen.
    pub(crate) fn state(&self) -> NodeState {
        *self.state.borrow()
    }

    /// Looks at vrdmad and the slot count again; open ListAndWatch streams see a change.
    pub async fn refresh(self: &Arc<Self>) {
        let me = self.clone();
        let now = tokio::task::spawn_blocking(move || NodeState { slots: me.cfg.slots.current(), vrdmad_up: me.admin.is_up() }).await;
        let Ok(now) = now else { return };
        self.state.send_if_modified(|s| {
            if *s == now {
                return false;
            }
            log::info!("devices: {} slot(s), vrdmad {}", now.slots, if now.vrdmad_up { "up" } else { "down" });
            *s = now;
            true
        });
    }

    /// Ends the ListAndWatch streams of the server being replaced.
    pub fn end_streams(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Deletes the vNICs of slots no pod holds any more (see [`Binder::collect_garbage`]).
    pub(crate) async fn collect_garbage(&self, grace: Duration) -> Result<Vec<String>, GcError> {
        let held = held_devices(&self.cfg.pod_resources, &self.cfg.resource_name).await?;
        Ok(self.binder.collect_garbage(held, grace).await?)
    }

    /// Waits until vrdmad's CDI spec lists `vnic`, when Allocate answers with CDI names.
    async fn await_cdi(&self, vnic: &str) -> Result<(), Status> {
        let Some(dir) = self.cfg.cdi_dir.as_ref().filter(|_| self.cfg.forms.cdi) else { return Ok(()) };
        let deadline = tokio::time::Instant::now() + CDI_WAIT;
        while !spec_lists(dir, vnic) {
            if tokio::time::Instant::now() > deadline {
                return Err(Status::unavailable(format!(
                    "vrdmad's CDI spec in {} does not list vNIC {vnic}: is it vrdmad's --cdi-dir (and the runtime's)?",
                    dir.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// The options this plugin registers with.
    pub fn options(&self) -> api::DevicePluginOptions {
        api::DevicePluginOptions { pre_start_required: self.cfg.tenants.needs_pod(), get_preferred_allocation_available: true }
    }

    /// The slot index of `id`, if it is one of the current slots.
    fn slot(&self, id: &str) -> Option<u32> {
        self.cfg.names.index(id).filter(|i| *i < self.state().slots)
    }
}

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<api::Empty>) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(self.options()))
    }

    type ListAndWatchStream = Stream<api::ListAndWatchResponse>;

    async fn list_and_watch(&self, _: Request<api::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut state = self.state.subscribe();
        let mut generation = self.generation.subscribe();
        let names = self.cfg.names.clone();
        tokio::spawn(async move {
            loop {
                let now = *state.borrow_and_update();
                if tx.send(Ok(api::ListAndWatchResponse { devices: devices(&names, now) })).await.is_err() {
                    return;
                }
                tokio::select! {
                    r = state.changed() => if r.is_err() { return },
                    _ = generation.changed() => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let container_responses = req.into_inner().container_requests.iter().map(|c| self.prefer(c)).collect();
        Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, req: Request<api::AllocateRequest>) -> Result<Response<api::AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let [id] = c.devices_ids.as_slice() else {
                return Err(Status::invalid_argument(format!(
                    "a container gets one vNIC (it asked for {} of {}): request {}: 1",
                    c.devices_ids.len(),
                    self.cfg.resource_name,
                    self.cfg.resource_name
                )));
            };
            if self.slot(id).is_none() {
                return Err(Status::invalid_argument(format!("{id} is not one of this node's {} devices", self.cfg.resource_name)));
            }
            let vnic = self.binder.bind(id, self.cfg.tenants.tenant(None)).await.map_err(bind_status)?;
            self.await_cdi(&vnic.name).await?;
            log::info!("allocated {id}: vNIC {} ({}/{}, tenant {})", vnic.name, vnic.ip, vnic.prefix_len, vnic.tenant);
            container_responses.push(container_response(self.cfg.forms, &self.cfg.paths, &vnic.name));
        }
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }

    /// Gives the vNIC its pod's tenant, now that the kubelet knows which pod holds it
    /// (registered as required only when the tenant depends on the pod).
    async fn pre_start_container(
        &self,
        req: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        if !self.cfg.tenants.needs_pod() {
            return Ok(Response::new(api::PreStartContainerResponse {}));
        }
        for id in req.into_inner().devices_ids {
            if self.slot(&id).is_none() {
                return Err(Status::invalid_argument(format!("{id} is not one of this node's {} devices", self.cfg.resource_name)));
            }
            // Fail closed: a pod whose tenant is unknown must not run in the default one.
            let pod = pod_holding(&self.cfg.pod_resources, &self.cfg.resource_name, &id)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?
                .ok_or_else(|| {
                    Status::failed_precondition(format!("no pod holds {id} (kubelet pod resources API): its tenant is unknown"))
                })?;
            let tenant = self.cfg.tenants.tenant(Some(&pod.namespace));
            let vnic = self.binder.retenant(&id, tenant).await.map_err(bind_status)?;
            self.await_cdi(&vnic.name).await?;
            log::info!("{id}: pod {}/{}, vNIC {} of tenant {}", pod.namespace, pod.name, vnic.name, vnic.tenant);
        }
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

impl Plugin {
    /// The lowest-numbered slots first (so vNIC names stay dense), those the kubelet must
    /// include before any other.
    fn prefer(&self, c: &api::ContainerPreferredAllocationRequest) -> api::ContainerPreferredAllocationResponse {
        let want = usize::try_from(c.allocation_size).unwrap_or(0);
        let mut ids: Vec<String> = c.must_include_device_i_ds.clone();
        let mut rest: Vec<&String> = c.available_device_i_ds.iter().filter(|id| !ids.contains(id)).collect();
        rest.sort_by_key(|id| self.cfg.names.index(id).unwrap_or(u32::MAX));
        ids.extend(rest.into_iter().take(want.saturating_sub(ids.len())).cloned());
        api::ContainerPreferredAllocationResponse { device_i_ds: ids }
    }
}
