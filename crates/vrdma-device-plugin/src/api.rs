//! The kubelet's device plugin API, v1beta1, generated from
//! `proto/deviceplugin/v1beta1/api.proto`.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("v1beta1");

/// The API version this plugin registers with.
pub const VERSION: &str = "v1beta1";
/// A device that can be allocated.
pub const HEALTHY: &str = "Healthy";
/// A device the kubelet must not allocate (vrdmad is down).
pub const UNHEALTHY: &str = "Unhealthy";
/// The kubelet's device plugin directory.
pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins";
/// The kubelet's registration socket in that directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The kubelet's pod resources API, v1, generated from `proto/podresources/v1/api.proto`.
pub mod podresources {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]

    tonic::include_proto!("v1");

    /// The kubelet's pod resources socket.
    pub const SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
}
