//! The network configuration on stdin: the spec's keys and ours.
//!
//! Ours (all optional):
//! - `vnic`: attach to this existing vNIC;
//! - `deviceID`: what Multus adds from the device plugin's allocation: the pod's vNIC
//!   (vrdma-device-plugin names each device after its vNIC);
//! - `vnicArg`: a `CNI_ARGS` key whose value names the vNIC (e.g. `K8S_POD_NAME`, which
//!   podman sets to the container's name); `CNI_ARGS` key `VRDMA_VNIC` always does;
//! - `tenant`: with a named vNIC, the tenant it must belong to; without one, create a vNIC
//!   of this tenant for the container (deleted on DEL), with `limits` (`maxPd`, `maxCq`,
//!   `maxQp`, `maxMr`, `maxMrBytes`, `maxSrq`, `maxSessions`, `maxRingBytes`,
//!   `maxLanes`, `maxPending`, `maxControlCpuPercent`) and the address of `CNI_ARGS` `IP` or
//!   `runtimeConfig.ips` if given;
//! - `adminSocket`: vrdmad's admin socket (default `$VRDMA_RUN_DIR/admin.sock`, else
//!   /run/vrdma/admin.sock);
//! - `bridge`: the host bridge (default `vrdma0`, as `vrdma run`);
//! - `defaultRoute`: true (default) for a default route via the bridge's address (primary
//!   network); false for a secondary network (under Multus), which gets only the route to
//!   vrdma's network;
//! - `stateDir`: where the plugin records its attachments (default /var/lib/cni/vrdma).

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;
use vrdma_abi::control::Limits;

use crate::env::{valid_id, Invocation};
use crate::error::CniError;
use crate::version::Version;

/// The `CNI_ARGS` key that always names the vNIC.
pub(crate) const VNIC_ARG: &str = "VRDMA_VNIC";
/// Default of `bridge`.
pub(crate) const DEFAULT_BRIDGE: &str = "vrdma0";
/// Default of `stateDir`.
pub(crate) const DEFAULT_STATE_DIR: &str = "/var/lib/cni/vrdma";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConf {
    cni_version: Option<String>,
    name: Option<String>,
    vnic: Option<String>,
    #[serde(rename = "deviceID")]
    device_id: Option<String>,
    vnic_arg: Option<String>,
    tenant: Option<String>,
    limits: Option<RawLimits>,
    admin_socket: Option<PathBuf>,
    bridge: Option<String>,
    default_route: Option<bool>,
    state_dir: Option<PathBuf>,
    ipam: Option<Value>,
    prev_result: Option<Value>,
    runtime_config: Option<RuntimeConfig>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<ValidAttachment>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawLimits {
    max_pd: Option<u32>,
    max_cq: Option<u32>,
    max_qp: Option<u32>,
    max_mr: Option<u32>,
    max_mr_bytes: Option<u64>,
    max_srq: Option<u32>,
    max_sessions: Option<u32>,
    max_ring_bytes: Option<u64>,
    max_lanes: Option<u32>,
    max_fds: Option<u32>,
    max_pending: Option<u32>,
    max_control_cpu_percent: Option<u32>,
    max_copy_cpu_percent: Option<u32>,
}

#[derive(Deserialize, Default)]
struct RuntimeConfig {
    #[serde(default)]
    ips: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ValidAttachment {
    #[serde(rename = "containerID")]
    container_id: String,
    ifname: String,
}

/// A decoded, validated configuration.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) version: Version,
    /// `cniVersion` as given (echoed in results).
    pub(crate) version_text: String,
    pub(crate) name: String,
    pub(crate) vnic: Option<String>,
    /// Multus' `deviceID`: the vNIC the device plugin allocated to the pod.
    pub(crate) device_id: Option<String>,
    pub(crate) vnic_arg: Option<String>,
    pub(crate) tenant: Option<String>,
    pub(crate) limits: Option<Limits>,
    pub(crate) admin_socket: PathBuf,
    pub(crate) bridge: String,
    pub(crate) default_route: bool,
    pub(crate) state_dir: PathBuf,
    pub(crate) prev_result: Option<Value>,
    /// `runtimeConfig.ips` (the `ips` capability).
    pub(crate) runtime_ips: Vec<String>,
    /// GC's `cni.dev/valid-attachments`: (container ID, ifname).
    pub(crate) valid_attachments: Option<Vec<(String, String)>>,
}

/// Where the container's vNIC comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VnicSource {
    /// An existing vNIC; of `tenant` if set; with address `ip` if one was asked for.
    Named { vnic: String, tenant: Option<String>, ip: Option<Ipv4Addr> },
    /// A vNIC the plugin creates for the container and deletes on DEL.
    PerContainer { tenant: String, limits: Option<Limits>, ip: Option<Ipv4Addr> },
}

fn invalid(reason: impl Into<String>) -> CniError {
    CniError::InvalidConfig { reason: reason.into() }
}

/// The `cniVersion` of a configuration, if it has a string one (for error results).
pub(crate) fn version_of(value: &Value) -> Option<&str> {
    value.get("cniVersion").and_then(Value::as_str)
}

impl Config {
    /// Validates the decoded stdin.
    pub(crate) fn from_value(value: Value) -> Result<Config, CniError> {
        let raw: RawConf =
            serde_json::from_value(value).map_err(|e| CniError::Decode { what: "the network configuration", reason: e.to_string() })?;
        let version_text = raw.cni_version.clone().unwrap_or_else(|| "0.1.0".into());
        let version = Version::of_config(raw.cni_version.as_deref())?;
        let name = raw.name.ok_or_else(|| invalid("no name"))?;
        if !valid_id(&name) {
            return Err(invalid(format!("name {name:?} is not [A-Za-z0-9][A-Za-z0-9_.-]*")));
        }
        if let Some(ipam) = raw.ipam {
            return Err(CniError::UnsupportedField { key: "ipam".into(), value: format!("{ipam} (the address is the vNIC's)") });
        }
        let bridge = raw.bridge.unwrap_or_else(|| DEFAULT_BRIDGE.into());
        if bridge.is_empty() || bridge.len() > 15 || bridge.bytes().any(|b| b == b'/' || b == b':' || !b.is_ascii_graphic()) {
            return Err(invalid(format!("bridge {bridge:?} is not an interface name")));
        }
        for (key, v) in [("vnic", &raw.vnic), ("deviceID", &raw.device_id), ("tenant", &raw.tenant), ("vnicArg", &raw.vnic_arg)] {
            if v.as_deref() == Some("") {
                return Err(invalid(format!("{key} is empty")));
            }
        }
        let limits = raw.limits.map(|l| {
            let d = Limits::default();
            Limits {
                max_pd: l.max_pd.unwrap_or(d.max_pd),
                max_cq: l.max_cq.unwrap_or(d.max_cq),
                max_qp: l.max_qp.unwrap_or(d.max_qp),
                max_mr: l.max_mr.unwrap_or(d.max_mr),
                max_mr_bytes: l.max_mr_bytes.unwrap_or(d.max_mr_bytes),
                max_srq: l.max_srq.unwrap_or(d.max_srq),
                max_sessions: l.max_sessions.unwrap_or(d.max_sessions),
                max_ring_bytes: l.max_ring_bytes.unwrap_or(d.max_ring_bytes),
                max_lanes: l.max_lanes.unwrap_or(d.max_lanes),
                max_fds: l.max_fds.unwrap_or(d.max_fds),
                max_pending: l.max_pending.unwrap_or(d.max_pending),
                max_control_cpu_percent: l.max_control_cpu_percent.unwrap_or(d.max_control_cpu_percent),
                max_copy_cpu_percent: l.max_copy_cpu_percent.unwrap_or(d.max_copy_cpu_percent),
            }
        });
        Ok(Config {
            version,
            version_text,
            name,
            vnic: raw.vnic,
            device_id: raw.device_id,
            vnic_arg: raw.vnic_arg,
            tenant: raw.tenant,
            limits,
            admin_socket: raw.admin_socket.unwrap_or_else(vrdmad::admin_client::default_socket),
            bridge,
            default_route: raw.default_route.unwrap_or(true),
            state_dir: raw.state_dir.unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            prev_result: raw.prev_result.filter(|p| !p.is_null()),
            runtime_ips: raw.runtime_config.unwrap_or_default().ips,
            valid_attachments: raw.valid_attachments.map(|v| v.into_iter().map(|a| (a.container_id, a.ifname)).collect()),
        })
    }

    /// Which vNIC the container gets: `CNI_ARGS` `VRDMA_VNIC`, else Multus' `deviceID`, else
    /// the `CNI_ARGS` key `vnicArg` names, else `vnic`; else one created for it in `tenant`.
    pub(crate) fn vnic_source(&self, inv: &Invocation) -> Result<VnicSource, CniError> {
        let named = inv
            .arg(VNIC_ARG)
            .or(self.device_id.as_deref())
            .or_else(|| self.vnic_arg.as_deref().and_then(|k| inv.arg(k)))
            .or(self.vnic.as_deref());
        let ip = self.requested_ip(inv)?;
        match (named, &self.tenant) {
            (Some(vnic), tenant) => {
                if !vnic.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') || vnic.len() > 64 {
                    return Err(invalid(format!("vNIC name {vnic:?} is not 1-64 characters of [A-Za-z0-9_-]")));
                }
                if self.limits.is_some() {
                    return Err(invalid("limits apply only to vNICs the plugin creates (tenant without vnic)"));
                }
                Ok(VnicSource::Named { vnic: vnic.to_string(), tenant: tenant.clone(), ip })
            }
            (None, Some(tenant)) => Ok(VnicSource::PerContainer { tenant: tenant.clone(), limits: self.limits, ip }),
            (None, None) => Err(invalid(format!(
                "no vNIC: set vnic, or tenant (a vNIC per container), or CNI_ARGS {VNIC_ARG}{}",
                self.vnic_arg.as_deref().map(|k| format!(" or {k}")).unwrap_or_default()
            ))),
        }
    }

    /// The address asked for: `CNI_ARGS` `IP` (podman's `--ip`), else the first of
    /// `runtimeConfig.ips` (a prefix length there is ignored: the network's is used).
    fn requested_ip(&self, inv: &Invocation) -> Result<Option<Ipv4Addr>, CniError> {
        let Some(text) = inv.arg("IP").or(self.runtime_ips.first().map(String::as_str)) else { return Ok(None) };
        let addr = text.split_once('/').map_or(text, |(a, _)| a);
        addr.parse().map(Some).map_err(|_| invalid(format!("requested address {text:?} is not an IPv4 address")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conf(v: Value) -> Result<Config, CniError> {
        Config::from_value(v)
    }

    fn inv(args: &[(&str, &str)]) -> Invocation {
        Invocation {
            command: crate::env::Command::Add,
            attachment: None,
            args: args.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    #[test]
    fn defaults_and_our_keys() {
        let c = conf(json!({"cniVersion": "1.0.0", "name": "vrdma", "type": "vrdma-cni", "vnic": "a"})).unwrap();
        assert_eq!(c.version_text, "1.0.0");
        assert_eq!(c.bridge, "vrdma0");
        assert!(c.default_route);
        assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert_eq!(c.vnic_source(&inv(&[])).unwrap(), VnicSource::Named { vnic: "a".into(), tenant: None, ip: None });
        let c = conf(json!({"cniVersion": "1.1.0", "name": "n", "type": "vrdma-cni", "tenant": "t", "limits": {"maxQp": 4},
            "adminSocket": "/tmp/a.sock", "bridge": "br9", "defaultRoute": false, "stateDir": "/tmp/s"}))
        .unwrap();
        assert_eq!((c.admin_socket.to_str(), c.bridge.as_str(), c.default_route), (Some("/tmp/a.sock"), "br9", false));
        match c.vnic_source(&inv(&[("IP", "198.19.1.2")])).unwrap() {
            VnicSource::PerContainer { tenant, limits: Some(l), ip } => {
                assert_eq!(tenant, "t");
                assert_eq!(l.max_qp, 4);
                assert_eq!(l.max_pd, Limits::default().max_pd);
                assert_eq!(ip, Some("198.19.1.2".parse().unwrap()));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_vnic_comes_from_cni_args_first() {
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n", "vnic": "cfg", "vnicArg": "K8S_POD_NAME"})).unwrap();
        let named = |args: &[(&str, &str)]| match c.vnic_source(&inv(args)).unwrap() {
            VnicSource::Named { vnic, .. } => vnic,
            other => panic!("{other:?}"),
        };
        assert_eq!(named(&[]), "cfg");
        assert_eq!(named(&[("K8S_POD_NAME", "pod")]), "pod");
        assert_eq!(named(&[("K8S_POD_NAME", "pod"), ("VRDMA_VNIC", "v")]), "v");
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n", "runtimeConfig": {"ips": ["198.19.0.9/15"]}, "tenant": "t"})).unwrap();
        assert!(
            matches!(c.vnic_source(&inv(&[])).unwrap(), VnicSource::PerContainer { ip: Some(a), .. } if a == Ipv4Addr::new(198, 19, 0, 9))
        );
    }

    #[test]
    fn bad_configurations_get_their_codes() {
        let code = |v: Value| conf(v).unwrap_err().code();
        assert_eq!(code(json!({"name": "n", "vnic": "a"})), 1, "no cniVersion is 0.1.0");
        assert_eq!(code(json!({"cniVersion": "9.9.9", "name": "n"})), 1);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "vnic": "a"})), 7, "no name");
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "bad name"})), 7);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "n", "bridge": "a/b"})), 7);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "n", "vnic": ""})), 7);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "host-local"}})), 2);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "n", "vnic": 5})), 6);
        assert_eq!(code(json!({"cniVersion": "1.0.0", "name": "n", "limits": {"maxBananas": 1}})), 6);
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n"})).unwrap();
        assert_eq!(c.vnic_source(&inv(&[])).unwrap_err().code(), 7, "neither vnic nor tenant");
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n", "vnic": "a", "limits": {}})).unwrap();
        assert_eq!(c.vnic_source(&inv(&[])).unwrap_err().code(), 7, "limits on a named vNIC");
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n", "vnic": "a/b"})).unwrap();
        assert_eq!(c.vnic_source(&inv(&[])).unwrap_err().code(), 7);
        let c = conf(json!({"cniVersion": "1.0.0", "name": "n", "tenant": "t"})).unwrap();
        assert_eq!(c.vnic_source(&inv(&[("IP", "nope")])).unwrap_err().code(), 7);
    }

    #[test]
    fn gc_attachments_and_prev_result_are_kept() {
        let c = conf(json!({"cniVersion": "1.1.0", "name": "n", "tenant": "t", "prevResult": {"cniVersion": "1.1.0"},
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]}))
        .unwrap();
        assert_eq!(c.valid_attachments, Some(vec![("c1".to_string(), "eth0".to_string())]));
        assert!(c.prev_result.is_some());
    }
}
