//! The plugin's life: serve on its socket in the kubelet's directory, register, and start
//! over when the kubelet restarts (it wipes the directory's sockets and forgets plugins).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use crate::api::device_plugin_server::DevicePluginServer;
use crate::kubelet::{file_identity, register};
use crate::plugin::Plugin;

/// Where the plugin meets the kubelet.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The kubelet's device plugin directory.
    pub plugin_dir: PathBuf,
    /// The kubelet's registration socket (normally `<plugin_dir>/kubelet.sock`).
    pub kubelet_socket: PathBuf,
    /// This plugin's socket name in `plugin_dir`.
    pub endpoint: String,
    /// How often vrdmad, the slot count and the kubelet's socket are looked at.
    pub interval: Duration,
    /// How often the vNICs of ended pods are deleted (None: never).
    pub gc_interval: Option<Duration>,
}

/// What stops the plugin.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The plugin's socket in the kubelet's directory could not be bound.
    #[error("listening on {path}: {source}")]
    Listen {
        /// The socket path (`<plugin_dir>/<endpoint>`).
        path: PathBuf,
        /// Why binding it failed (no such directory, no permission, ...).
        source: std::io::Error,
    },
}

/// Serves until `stop` resolves, then removes the socket.
pub async fn run(plugin: Arc<Plugin>, cfg: ServerConfig, stop: impl std::future::Future<Output = ()>) -> Result<(), ServerError> {
    let ticker = {
        let plugin = plugin.clone();
        let interval = cfg.interval;
        tokio::spawn(async move {
            loop {
                plugin.refresh().await;
                tokio::time::sleep(interval).await;
            }
        })
    };
    let collector = cfg.gc_interval.map(|every| {
        let plugin = plugin.clone();
        tokio::spawn(async move {
            let mut said = false;
            loop {
                tokio::time::sleep(every).await;
                match plugin.collect_garbage(every).await {
                    Ok(deleted) => {
                        said = false;
                        if !deleted.is_empty() {
                            log::info!("deleted the vNICs of ended pods: {}", deleted.join(", "));
                        }
                    }
                    // vrdmad or the kubelet away: said once, tried again next time.
                    Err(e) if !said => {
                        log::warn!("collecting ended pods' vNICs: {e}");
                        said = true;
                    }
                    Err(_) => {}
                }
            }
        })
    });
    let result = tokio::select! {
        r = serve_forever(&plugin, &cfg) => r,
        () = stop => Ok(()),
    };
    ticker.abort();
    if let Some(c) = collector {
        c.abort();
    }
    let _ = std::fs::remove_file(cfg.plugin_dir.join(&cfg.endpoint));
    result
}

async fn serve_forever(plugin: &Arc<Plugin>, cfg: &ServerConfig) -> Result<(), ServerError> {
    let socket = cfg.plugin_dir.join(&cfg.endpoint);
    loop {
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|source| ServerError::Listen { path: socket.clone(), source })?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder().add_service(DevicePluginServer::from_arc(plugin.clone())).serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                async {
                    let _ = stop_rx.await;
                },
            ),
        );
        let kubelet = register_until_accepted(plugin, cfg).await;
        log::info!("registered {} at {} with the kubelet", plugin.config().resource_name, socket.display());
        // Until the kubelet's socket is another file (it restarted) or ours is gone (it wiped
        // the directory): then serve afresh and register again.
        loop {
            tokio::time::sleep(cfg.interval).await;
            let ours = socket.exists();
            if file_identity(&cfg.kubelet_socket) != Some(kubelet) || !ours {
                log::info!("the kubelet restarted: registering again");
                break;
            }
        }
        plugin.end_streams();
        let _ = stop_tx.send(());
        let mut server = server;
        if tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
            server.abort();
        }
    }
}

/// Registers, retrying while the kubelet is not there or refuses; returns the identity of
/// the kubelet socket registered with.
async fn register_until_accepted(plugin: &Arc<Plugin>, cfg: &ServerConfig) -> (u64, u64) {
    let mut said = false;
    loop {
        if let Some(kubelet) = file_identity(&cfg.kubelet_socket) {
            match register(&cfg.kubelet_socket, &cfg.endpoint, &plugin.config().resource_name, plugin.options()).await {
                Ok(()) => return kubelet,
                Err(e) if !said => {
                    log::warn!("{e}; retrying");
                    said = true;
                }
                Err(_) => {}
            }
        }
        tokio::time::sleep(cfg.interval).await;
    }
}
