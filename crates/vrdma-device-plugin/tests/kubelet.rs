//! The device plugin against a test kubelet built from the kubelet's published device plugin
//! API (the vendored api.proto): the real `vrdma-device-plugin` binary and a real vrdmad, in
//! temporary directories. Registration, ListAndWatch updates as the slot count changes and as
//! vrdmad stops and starts, Allocate's answers (CDI names and the fallback), and registration
//! again after the kubelet restarts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt as _;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status, Streaming};
use vrdma_device_plugin::admin::Admin;
use vrdma_device_plugin::api;
use vrdma_device_plugin::api::device_plugin_client::DevicePluginClient;
use vrdma_device_plugin::api::podresources;
use vrdma_device_plugin::kubelet::unix_channel;

const PLUGIN: &str = env!("CARGO_BIN_EXE_vrdma-device-plugin");
const WAIT: Duration = Duration::from_secs(15);

/// vrdmad is built by vrdma-cli, beside this package's binary in the same target directory.
fn vrdmad_path() -> PathBuf {
    Path::new(PLUGIN).with_file_name("vrdmad")
}

/// The kubelet's Registration service: hands every request to the test.
struct Registrar {
    requests: mpsc::UnboundedSender<api::RegisterRequest>,
}

#[tonic::async_trait]
impl api::registration_server::Registration for Registrar {
    async fn register(&self, req: Request<api::RegisterRequest>) -> Result<Response<api::Empty>, Status> {
        let req = req.into_inner();
        // As the kubelet: only the versions it supports.
        if req.version != api::VERSION {
            return Err(Status::invalid_argument(format!("unsupported version {}", req.version)));
        }
        let _ = self.requests.send(req);
        Ok(Response::new(api::Empty {}))
    }
}

/// A kubelet serving Registration on `<dir>/kubelet.sock`.
struct TestKubelet {
    dir: PathBuf,
    requests: mpsc::UnboundedReceiver<api::RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl TestKubelet {
    /// Starts as the kubelet does: the directory's old sockets removed, then kubelet.sock.
    fn start(dir: &Path) -> TestKubelet {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            std::fs::remove_file(e.path()).unwrap();
        }
        let listener = UnixListener::bind(dir.join(api::KUBELET_SOCKET)).unwrap();
        let (tx, requests) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(api::registration_server::RegistrationServer::new(Registrar { requests: tx }))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        TestKubelet { dir: dir.to_path_buf(), requests, stop: Some(stop), server }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = tokio::time::timeout(WAIT, &mut self.server).await;
        self.server.abort();
        let _ = std::fs::remove_file(self.dir.join(api::KUBELET_SOCKET));
    }

    async fn registration(&mut self) -> api::RegisterRequest {
        tokio::time::timeout(WAIT, self.requests.recv()).await.expect("the plugin registers").unwrap()
    }

    /// Dials the plugin as the kubelet does after a registration: `<dir>/<endpoint>`.
    async fn plugin(&self, req: &api::RegisterRequest) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(unix_channel(&self.dir.join(&req.endpoint)).await.expect("the plugin's socket answers"))
    }

    /// Waits for a registration whose socket answers, as the kubelet does: a plugin that
    /// registered before this kubelet wiped the directory registers again with a new socket.
    async fn registered_plugin(&mut self) -> (api::RegisterRequest, DevicePluginClient<Channel>) {
        loop {
            let req = self.registration().await;
            if let Ok(channel) = unix_channel(&self.dir.join(&req.endpoint)).await {
                return (req, DevicePluginClient::new(channel));
            }
        }
    }
}

/// The kubelet's pod resources API: the pods the test says hold devices.
#[derive(Clone, Default)]
struct PodResources {
    pods: Arc<Mutex<Vec<podresources::PodResources>>>,
}

impl PodResources {
    fn start(socket: &Path) -> PodResources {
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let listener = UnixListener::bind(socket).unwrap();
        let me = PodResources::default();
        let service = podresources::pod_resources_lister_server::PodResourcesListerServer::new(me.clone());
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(UnixListenerStream::new(listener)));
        me
    }

    /// The pods ended and were deleted: the kubelet forgets them.
    fn clear(&self) {
        self.pods.lock().unwrap().clear();
    }

    /// Pod `namespace/name` holds `device` (one container's).
    fn hold(&self, namespace: &str, name: &str, device: &str) {
        let devices =
            vec![podresources::ContainerDevices { resource_name: "vrdma.io/vnic".into(), device_ids: vec![device.into()], topology: None }];
        let container = podresources::ContainerResources { name: "main".into(), devices, ..Default::default() };
        let pod = podresources::PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers: vec![container],
            ..Default::default()
        };
        self.pods.lock().unwrap().push(pod);
    }
}

#[tonic::async_trait]
impl podresources::pod_resources_lister_server::PodResourcesLister for PodResources {
    async fn list(
        &self,
        _: Request<podresources::ListPodResourcesRequest>,
    ) -> Result<Response<podresources::ListPodResourcesResponse>, Status> {
        Ok(Response::new(podresources::ListPodResourcesResponse { pod_resources: self.pods.lock().unwrap().clone() }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<podresources::AllocatableResourcesRequest>,
    ) -> Result<Response<podresources::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn get(
        &self,
        _: Request<podresources::GetPodResourcesRequest>,
    ) -> Result<Response<podresources::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// A child process killed when the test ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_vrdmad(dir: &Path) -> Proc {
    let run = dir.join("run");
    let _ = std::fs::remove_file(run.join("admin.sock"));
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("vrdmad.log")).unwrap();
    let child = Command::new(vrdmad_path())
        .args(["--run-dir", run.to_str().unwrap(), "--state-dir", dir.join("state").to_str().unwrap(), "--host", "test-node"])
        .args(["--cdi-dir", dir.join("cdi").to_str().unwrap()])
        .env("VRDMA_LIB_DIR", dir.join("lib"))
        .env("RUST_LOG", "warn")
        .stderr(log)
        .spawn()
        .expect("start vrdmad");
    let admin = Admin::new(&run);
    let deadline = std::time::Instant::now() + WAIT;
    while !admin.is_up() {
        assert!(
            std::time::Instant::now() < deadline,
            "vrdmad did not start: {}",
            std::fs::read_to_string(dir.join("vrdmad.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Proc(child)
}

/// Reads ListAndWatch updates until one satisfies `want`; returns it as (ID, health) pairs.
async fn until(
    stream: &mut Streaming<api::ListAndWatchResponse>,
    what: &str,
    want: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = Vec::new();
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next()).await;
        let Ok(Some(Ok(update))) = next else { panic!("no ListAndWatch update with {what} (last: {last:?}; stream: {next:?})") };
        last = update.devices.iter().map(|d| (d.id.clone(), d.health.clone())).collect();
        if want(&last) {
            return last;
        }
    }
}

fn all(health: &'static str, n: usize) -> impl Fn(&[(String, String)]) -> bool {
    move |devs| devs.len() == n && devs.iter().all(|(_, h)| h == health)
}

/// vrdmad's CDI spec once it has device `name`.
async fn cdi_spec(dir: &Path, name: &str) -> vrdma_cdi::Spec {
    let path = dir.join("cdi").join(vrdma_cdi::SPEC_FILE);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let spec = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str::<vrdma_cdi::Spec>(&t).ok());
        match spec {
            Some(s) if s.devices.iter().any(|d| d.name == name) => return s,
            _ if tokio::time::Instant::now() > deadline => panic!("vrdmad's CDI spec {} has no device {name}: {spec:?}", path.display()),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn allocate_one(id: &str) -> api::AllocateRequest {
    api::AllocateRequest { container_requests: vec![api::ContainerAllocateRequest { devices_ids: vec![id.into()] }] }
}

#[tokio::test(flavor = "current_thread")]
async fn a_kubelet_drives_the_device_plugin() {
    let test = "a_kubelet_drives_the_device_plugin";
    if !vrdma_test_support::require_files(test, &[vrdmad_path().to_str().unwrap()], "vrdmad: cargo build -p vrdma-cli --bin vrdmad") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vrdma-device-plugin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let plugin_dir = dir.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let run_dir = dir.join("run");
    let lib_dir = dir.join("lib");
    std::fs::create_dir_all(&lib_dir).unwrap();
    // Stands in for the drop-in: only its presence matters to the spec and the fallback.
    std::fs::write(lib_dir.join(vrdma_cdi::DROPIN_FILE), b"").unwrap();
    let slots_file = dir.join("slots");
    std::fs::write(&slots_file, "2\n").unwrap();
    let tenant_map = dir.join("tenants.json");
    std::fs::write(&tenant_map, r#"{"team-a": "blue"}"#).unwrap();
    let pod_resources_socket = dir.join("pod-resources/kubelet.sock");

    let mut vrdmad = Some(start_vrdmad(&dir));
    let mut kubelet = TestKubelet::start(&plugin_dir);
    let pods = PodResources::start(&pod_resources_socket);
    let plugin_log = std::fs::File::create(dir.join("plugin.log")).unwrap();
    let mut plugin = Proc(
        Command::new(PLUGIN)
            .args(["--plugin-dir", plugin_dir.to_str().unwrap(), "--run-dir", run_dir.to_str().unwrap()])
            .args(["--lib-dir", lib_dir.to_str().unwrap(), "--slots-file", slots_file.to_str().unwrap(), "--slots", "1"])
            .args(["--node-name", "Test-Node", "--edits", "cdi,mounts", "--interval-ms", "100", "--gc-interval-ms", "2000"])
            .args(["--tenant", "k8s-tenant", "--tenant-from", "map", "--tenant-map", tenant_map.to_str().unwrap()])
            .args(["--pod-resources-socket", pod_resources_socket.to_str().unwrap(), "--cdi-dir", dir.join("cdi").to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stderr(plugin_log)
            .spawn()
            .expect("start the plugin"),
    );

    // Registration.
    let reg = kubelet.registration().await;
    assert_eq!(reg.resource_name, "vrdma.io/vnic");
    assert_eq!(reg.endpoint, "vrdma-vnic.sock");
    assert!(reg.options.as_ref().unwrap().get_preferred_allocation_available);
    assert!(reg.options.as_ref().unwrap().pre_start_required, "the tenant depends on the pod: PreStartContainer sets it");
    let mut client = kubelet.plugin(&reg).await;
    let opts = client.get_device_plugin_options(api::Empty {}).await.unwrap().into_inner();
    assert_eq!(Some(opts), reg.options);

    // The slots, healthy, under stable IDs; then one more slot.
    let mut watch = client.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    let devs = until(&mut watch, "2 healthy slots", all(api::HEALTHY, 2)).await;
    let ids: Vec<String> = devs.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(ids, ["k8s-test-node-0", "k8s-test-node-1"]);
    std::fs::write(&slots_file, "3\n").unwrap();
    let devs = until(&mut watch, "3 healthy slots", all(api::HEALTHY, 3)).await;
    assert_eq!(devs[..2].iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(), ids, "device IDs are stable");

    // The preferred allocation: what must be included, then the lowest slots.
    let pref = client
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["k8s-test-node-2".into(), "k8s-test-node-1".into(), "k8s-test-node-0".into()],
                must_include_device_i_ds: vec!["k8s-test-node-2".into()],
                allocation_size: 2,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pref.container_responses[0].device_i_ds, ["k8s-test-node-2", "k8s-test-node-0"]);

    // Allocate: a fresh vNIC named after the slot, of the configured tenant; its CDI name
    // and the same edits as mounts, environment and a device node.
    let admin = Admin::new(&run_dir);
    let resp = client.allocate(allocate_one("k8s-test-node-1")).await.unwrap().into_inner();
    let c = &resp.container_responses[0];
    assert_eq!(c.cdi_devices, [api::CdiDevice { name: "vrdma.io/vnic=k8s-test-node-1".into() }]);
    let vnic = admin.find("k8s-test-node-1").unwrap().expect("Allocate made the vNIC");
    assert_eq!(vnic.tenant, "k8s-tenant");
    let vnic_dir = run_dir.join("vnics/k8s-test-node-1");
    let mount = c.mounts.iter().find(|m| m.container_path == "/run/vrdma").expect("the vNIC directory is mounted");
    assert_eq!(Path::new(&mount.host_path), vnic_dir);
    assert!(vnic_dir.join("control.sock").exists(), "the mounted directory is the vNIC's");
    assert!(!mount.read_only);
    let lib = c.mounts.iter().find(|m| Path::new(&m.host_path) == lib_dir.join(vrdma_cdi::DROPIN_FILE)).expect("the drop-in is mounted");
    assert!(lib.read_only);
    assert_eq!(c.envs["LD_LIBRARY_PATH"], vrdma_cdi::CONTAINER_LIB_DIR);
    assert_eq!(c.envs["VRDMA_SOCKET"], "/run/vrdma/control.sock");
    assert_eq!(c.envs["VRDMA_VNIC"], "k8s-test-node-1");
    assert_eq!(c.devices.len(), 1);
    assert_eq!(c.devices[0].container_path, "/dev/infiniband/vrdma_k8s-test-node-1");
    // One definition: the fallback is what vrdmad's CDI spec gives that device.
    let spec = cdi_spec(&dir, "k8s-test-node-1").await;
    let device = spec.devices.iter().find(|d| d.name == "k8s-test-node-1").unwrap();
    let mut env: Vec<String> = spec.container_edits.env.iter().chain(&device.container_edits.env).cloned().collect();
    env.sort();
    let mut fallback_env: Vec<String> = c.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    fallback_env.sort();
    assert_eq!(fallback_env, env);
    let spec_mounts: Vec<(String, String)> = spec
        .container_edits
        .mounts
        .iter()
        .chain(&device.container_edits.mounts)
        .map(|m| (m.host_path.clone(), m.container_path.clone()))
        .collect();
    let fallback_mounts: Vec<(String, String)> = c.mounts.iter().map(|m| (m.host_path.clone(), m.container_path.clone())).collect();
    assert_eq!(fallback_mounts, spec_mounts);
    let spec_nodes: Vec<&str> = device.container_edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(c.devices.iter().map(|d| d.container_path.as_str()).collect::<Vec<_>>(), spec_nodes);
    // Allocated again (a new pod on the slot): the vNIC is made anew.
    client.allocate(allocate_one("k8s-test-node-1")).await.unwrap();
    assert!(admin.find("k8s-test-node-1").unwrap().is_some());
    // Bad requests: not a slot of this node, two vNICs for one container.
    let e = client.allocate(allocate_one("k8s-other-node-0")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let two = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest { devices_ids: vec!["k8s-test-node-0".into(), "k8s-test-node-2".into()] }],
    };
    assert_eq!(client.allocate(two).await.unwrap_err().code(), Code::InvalidArgument);

    // PreStartContainer: the pod holding the device (as the kubelet's pod resources API
    // says) is in namespace team-a, whose tenant the map says is blue: the vNIC moves to
    // it and keeps its address. Unknown pods fail closed; unmapped namespaces get the default.
    let before = admin.find("k8s-test-node-1").unwrap().unwrap();
    let pre_start = |id: &str| api::PreStartContainerRequest { devices_ids: vec![id.into()] };
    let e = client.pre_start_container(pre_start("k8s-test-node-1")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    pods.hold("team-a", "rdma-0", "k8s-test-node-1");
    client.pre_start_container(pre_start("k8s-test-node-1")).await.unwrap();
    let after = admin.find("k8s-test-node-1").unwrap().unwrap();
    assert_eq!(after.tenant, "blue");
    assert_eq!((after.ip, after.prefix_len), (before.ip, before.prefix_len), "the vNIC keeps its address");
    client.pre_start_container(pre_start("k8s-test-node-1")).await.unwrap();
    assert_eq!(admin.find("k8s-test-node-1").unwrap().unwrap(), after, "a container restart changes nothing");
    client.allocate(allocate_one("k8s-test-node-2")).await.unwrap();
    pods.hold("team-b", "other", "k8s-test-node-2");
    client.pre_start_container(pre_start("k8s-test-node-2")).await.unwrap();
    assert_eq!(admin.find("k8s-test-node-2").unwrap().unwrap().tenant, "k8s-tenant");

    // vrdmad stops: every slot Unhealthy, Allocate unavailable; it starts again: Healthy.
    drop(vrdmad.take());
    until(&mut watch, "3 unhealthy slots", all(api::UNHEALTHY, 3)).await;
    let e = client.allocate(allocate_one("k8s-test-node-0")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    vrdmad = Some(start_vrdmad(&dir));
    until(&mut watch, "3 healthy slots again", all(api::HEALTHY, 3)).await;
    std::fs::write(&slots_file, "1\n").unwrap();
    until(&mut watch, "1 healthy slot", all(api::HEALTHY, 1)).await;

    // The kubelet restarts (wiping the plugins' sockets): the plugin serves and registers
    // again, and the old stream ends.
    kubelet.stop().await;
    kubelet = TestKubelet::start(&plugin_dir);
    let reg = kubelet.registration().await;
    assert_eq!(reg.resource_name, "vrdma.io/vnic");
    let ended = tokio::time::timeout(WAIT, async { while let Some(Ok(_)) = watch.next().await {} }).await;
    assert!(ended.is_ok(), "the old ListAndWatch stream ends");
    drop(client);
    // Away for a while this time: the plugin waits for it, and when the new kubelet wipes
    // the socket the plugin made meanwhile, serves on a new one and registers again.
    kubelet.stop().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    kubelet = TestKubelet::start(&plugin_dir);
    let (reg, mut client) = kubelet.registered_plugin().await;
    assert_eq!(reg.resource_name, "vrdma.io/vnic");
    let mut watch = client.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    until(&mut watch, "1 healthy slot after the restart", all(api::HEALTHY, 1)).await;
    let resp = client.allocate(allocate_one("k8s-test-node-0")).await.unwrap().into_inner();
    assert_eq!(resp.container_responses[0].cdi_devices[0].name, "vrdma.io/vnic=k8s-test-node-0");

    // The pods end: their slots' vNICs are deleted (their addresses go back to the network).
    pods.clear();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let left: Vec<String> =
            admin.local_vnics().unwrap().into_iter().map(|v| v.name).filter(|n| n.starts_with("k8s-test-node-")).collect();
        if left.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the vNICs of ended pods remain: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // SIGTERM: the plugin leaves, taking its socket with it.
    // SAFETY: kill has no memory effects; the pid is our own live child.
    unsafe { libc::kill(plugin.0.id() as i32, libc::SIGTERM) };
    let status = plugin.0.wait().unwrap();
    assert!(
        status.success(),
        "the plugin exits cleanly on SIGTERM: {status}; log:\n{}",
        std::fs::read_to_string(dir.join("plugin.log")).unwrap_or_default()
    );
    assert!(!plugin_dir.join(&reg.endpoint).exists(), "the plugin removes its socket");

    kubelet.stop().await;
    drop(vrdmad);
    let _ = std::fs::remove_dir_all(&dir);
}
