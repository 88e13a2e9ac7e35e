//! The kubelet side: registering with its Registration service over its Unix socket, and
//! noticing that it restarted (its kubelet.sock is a new file).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::api;

/// What failed registering.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("connecting to the kubelet at {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("the kubelet at {path} refused the registration: {status}")]
    Refused { path: PathBuf, status: tonic::Status },
}

/// A gRPC channel over the Unix socket `path`.
pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by the API and unused: the connector dials the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Registers `endpoint` (a socket name in the kubelet's device plugin directory) as the
/// plugin for `resource_name`.
pub(crate) async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
    options: api::DevicePluginOptions,
) -> Result<(), RegisterError> {
    let channel = unix_channel(kubelet_socket).await.map_err(|source| RegisterError::Connect { path: kubelet_socket.into(), source })?;
    let mut client = api::registration_client::RegistrationClient::new(channel);
    let req = api::RegisterRequest {
        version: api::VERSION.into(),
        endpoint: endpoint.into(),
        resource_name: resource_name.into(),
        options: Some(options),
    };
    client.register(req).await.map_err(|status| RegisterError::Refused { path: kubelet_socket.into(), status })?;
    Ok(())
}

/// Which file a path is (device and inode), if it exists: a restarted kubelet removes and
/// binds its socket again, giving a new inode.
pub(crate) fn file_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}
