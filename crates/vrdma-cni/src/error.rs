//! The plugin's errors and their CNI error codes (SPEC.md, "Error").

use std::path::PathBuf;

use vrdma_netns::attach::AttachError;
use vrdma_netns::NetnsError;

/// Everything an invocation can fail with. [`CniError::code`] is the number the runtime
/// sees: the spec's well-known codes below 100, ours from 100.
#[derive(Debug, thiserror::Error)]
pub enum CniError {
    /// The configuration's `cniVersion` is one we do not speak, or too old for the command.
    #[error("CNI version {version}: {reason}")]
    IncompatibleVersion { version: String, reason: String },
    /// A configuration key we refuse (the spec wants key and value in the message).
    #[error("unsupported field {key}: {value}")]
    UnsupportedField { key: String, value: String },
    /// The container's network namespace is not there (ADD, CHECK).
    #[error("container {container}: {reason}")]
    UnknownContainer { container: String, reason: String },
    /// A CNI_* variable is missing or malformed; `vars` names it.
    #[error("environment {vars}: {reason}")]
    InvalidEnv { vars: String, reason: String },
    /// Reading the configuration from stdin failed.
    #[error("reading the network configuration: {source}")]
    Io { source: std::io::Error },
    /// The configuration (or part of it) is not the JSON we expect.
    #[error("decoding {what}: {reason}")]
    Decode { what: &'static str, reason: String },
    /// The configuration decodes but is unusable.
    #[error("invalid network configuration: {reason}")]
    InvalidConfig { reason: String },
    /// vrdmad cannot be reached right now.
    #[error("{reason}")]
    TryAgainLater { reason: String },
    /// STATUS: vrdmad is not there, so no ADD can succeed.
    #[error("{reason}")]
    Unavailable { reason: String },
    /// vrdmad refused a request or answered nonsense.
    #[error("vrdmad: {reason}")]
    Daemon { reason: String },
    /// The configuration names a vNIC vrdmad does not know.
    #[error("no vNIC named {vnic} (see `vrdma vnic list`)")]
    UnknownVnic { vnic: String },
    /// The vNIC belongs to another tenant than the configuration says.
    #[error("vNIC {vnic} belongs to tenant {actual}, not {expected}")]
    WrongTenant { vnic: String, actual: String, expected: String },
    /// The vNIC is served by another host: its containers must run there.
    #[error("vNIC {vnic} is served by host {host}, not this one")]
    VnicElsewhere { vnic: String, host: String },
    /// The vNIC already gives its address to another container.
    #[error("vNIC {vnic} is attached to container {container} ({ifname}) already")]
    VnicInUse { vnic: String, container: String, ifname: String },
    /// This container already has this interface (a second ADD).
    #[error("container {container} already has {ifname}: {reason}")]
    AlreadyAttached { container: String, ifname: String, reason: String },
    /// The host bridge could not be set up.
    #[error("bridge: {0}")]
    Bridge(#[from] NetnsError),
    /// Plumbing the veth pair or reading its state failed.
    #[error("network: {0}")]
    Network(#[from] AttachError),
    /// CHECK found the attachment not as its result says.
    #[error("{reason}")]
    CheckFailed { reason: String },
    /// The plugin's record of its attachments could not be read or written.
    #[error("state {}: {source}", path.display())]
    State { path: PathBuf, source: std::io::Error },
}

impl CniError {
    /// The CNI error code.
    pub fn code(&self) -> u32 {
        match self {
            CniError::IncompatibleVersion { .. } => 1,
            CniError::UnsupportedField { .. } => 2,
            CniError::UnknownContainer { .. } => 3,
            CniError::InvalidEnv { .. } => 4,
            CniError::Io { .. } => 5,
            CniError::Decode { .. } => 6,
            CniError::InvalidConfig { .. } => 7,
            CniError::TryAgainLater { .. } => 11,
            CniError::Unavailable { .. } => 50,
            CniError::Daemon { .. } => 100,
            CniError::UnknownVnic { .. } => 101,
            CniError::WrongTenant { .. } => 102,
            CniError::VnicElsewhere { .. } => 103,
            CniError::VnicInUse { .. } => 104,
            CniError::AlreadyAttached { .. } => 105,
            CniError::Bridge(_) | CniError::Network(_) => 106,
            CniError::CheckFailed { .. } => 107,
            CniError::State { .. } => 108,
        }
    }

    /// The short `msg` of the error result.
    pub fn summary(&self) -> &'static str {
        match self {
            CniError::IncompatibleVersion { .. } => "incompatible CNI version",
            CniError::UnsupportedField { .. } => "unsupported field in network configuration",
            CniError::UnknownContainer { .. } => "container unknown or does not exist",
            CniError::InvalidEnv { .. } => "invalid environment variables",
            CniError::Io { .. } => "I/O failure",
            CniError::Decode { .. } => "failed to decode content",
            CniError::InvalidConfig { .. } => "invalid network configuration",
            CniError::TryAgainLater { .. } => "try again later",
            CniError::Unavailable { .. } => "plugin not available",
            CniError::Daemon { .. } => "vrdmad refused the request",
            CniError::UnknownVnic { .. } => "unknown vNIC",
            CniError::WrongTenant { .. } => "vNIC of another tenant",
            CniError::VnicElsewhere { .. } => "vNIC served by another host",
            CniError::VnicInUse { .. } => "vNIC in use",
            CniError::AlreadyAttached { .. } => "interface exists",
            CniError::Bridge(_) | CniError::Network(_) => "network setup failed",
            CniError::CheckFailed { .. } => "check failed",
            CniError::State { .. } => "plugin state unusable",
        }
    }

    /// The error result (SPEC.md "Error") in protocol version `cni_version`.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        serde_json::json!({"cniVersion": cni_version, "code": self.code(), "msg": self.summary(), "details": self.to_string()})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_results_carry_code_msg_and_details() {
        let e = CniError::UnknownVnic { vnic: "x".into() };
        let j = e.to_json("1.0.0");
        assert_eq!(j["code"], 101);
        assert_eq!(j["cniVersion"], "1.0.0");
        assert_eq!(j["msg"], "unknown vNIC");
        assert!(j["details"].as_str().unwrap().contains("no vNIC named x"));
        assert_eq!(CniError::InvalidEnv { vars: "CNI_NETNS".into(), reason: "missing".into() }.code(), 4);
        assert_eq!(CniError::TryAgainLater { reason: "down".into() }.code(), 11);
    }
}
