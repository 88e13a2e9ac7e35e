//! `vrdma-cni`, a CNI plugin (spec 1.1.0, also 1.0.0 and 0.3.0-0.4.0; SPEC.md of
//! containernetworking/cni): it attaches a container runtime's network namespace to this
//! host's vrdma network with a vNIC's address, as `vrdma run` attaches its own containers
//! (DESIGN.md §5 "Address: CNI"): a veth pair, the host end on the bridge (`vrdma0`), the
//! container's end named `CNI_IFNAME` with the vNIC's address and a MAC fixed by it, and a
//! default route (or, on a secondary network, the route to vrdma's network) via the bridge.
//!
//! The vNIC is a named one (configuration `vnic`, or `CNI_ARGS`) or one the plugin creates
//! for the container (configuration `tenant`) and deletes on DEL; see [`config`].
//!
//! Commands: ADD ([`add`]), DEL ([`del`]), CHECK ([`check`]), STATUS and GC ([`gc`]),
//! VERSION. Results and errors are CNI JSON on stdout; errors exit non-zero with the spec's
//! codes or ours ([`CniError::code`]).

pub mod add;
pub mod check;
pub mod config;
pub mod daemon;
pub mod del;
pub mod env;
pub mod error;
pub mod gc;
pub mod install;
pub mod names;
pub mod result;
pub mod state;
pub mod version;

use std::io::Read;

use serde_json::{json, Value};

pub use env::{Command, Invocation};
pub use error::CniError;

/// What to print on stdout, and the exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: Option<String>,
    pub exit_code: i32,
}

/// Runs one invocation: `get_env` gives the CNI_* variables, `stdin` the configuration.
/// Errors are also logged on stderr.
pub fn run(get_env: impl Fn(&str) -> Option<String>, stdin: &mut dyn Read) -> Outcome {
    let mut error_version = version::LATEST.to_string();
    match dispatch(get_env, stdin, &mut error_version) {
        Ok(out) => Outcome { stdout: out.map(|v| v.to_string()), exit_code: 0 },
        Err(e) => {
            eprintln!("vrdma-cni: {e}");
            Outcome { stdout: Some(e.to_json(&error_version).to_string()), exit_code: 1 }
        }
    }
}

fn dispatch(get_env: impl Fn(&str) -> Option<String>, stdin: &mut dyn Read, error_version: &mut String) -> Result<Option<Value>, CniError> {
    // All of stdin first, even when the environment is wrong: a runtime writing it must not
    // see a broken pipe instead of our error.
    let mut bytes = Vec::new();
    let read = stdin.read_to_end(&mut bytes);
    let inv = Invocation::from_env(get_env)?;
    read.map_err(|source| CniError::Io { source })?;
    let value: Result<Value, _> = serde_json::from_slice(&bytes);
    let requested = value.as_ref().ok().and_then(config::version_of).map(str::to_string);
    if let Some(v) = requested.as_deref().filter(|v| version::SUPPORTED.contains(v)) {
        *error_version = v.to_string();
    }
    if inv.command == Command::Version {
        let v = requested.unwrap_or_else(|| version::LATEST.to_string());
        return Ok(Some(json!({"cniVersion": v, "supportedVersions": version::SUPPORTED})));
    }
    let value = value.map_err(|e| CniError::Decode { what: "the network configuration", reason: e.to_string() })?;
    let conf = config::Config::from_value(value)?;
    match (inv.command, inv.attachment.as_ref()) {
        (Command::Add, Some(at)) => add::add(&inv, at, &conf).map(Some),
        (Command::Del, Some(at)) => del::del(&inv, at, &conf).map(|()| None),
        (Command::Check, Some(at)) => check::check(at, &conf).map(|()| None),
        (Command::Gc, _) => gc::gc(&conf).map(|()| None),
        (Command::Status, _) => gc::status(&conf).map(|()| None),
        (command, _) => unreachable!("{command:?} without its attachment: Invocation::from_env requires it"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run_with(vars: &[(&str, &str)], stdin: &str) -> (Value, i32) {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let o = run(|k| m.get(k).cloned(), &mut stdin.as_bytes());
        (o.stdout.map(|s| serde_json::from_str(&s).unwrap()).unwrap_or(Value::Null), o.exit_code)
    }

    #[test]
    fn version_reports_what_we_speak() {
        let (v, code) = run_with(&[("CNI_COMMAND", "VERSION")], r#"{"cniVersion": "1.0.0"}"#);
        assert_eq!(code, 0);
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["supportedVersions"], json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]));
        let (v, _) = run_with(&[("CNI_COMMAND", "VERSION")], "");
        assert_eq!(v["cniVersion"], "1.1.0");
    }

    #[test]
    fn errors_are_cni_json_with_codes() {
        let add = [("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_NETNS", "/nonexistent/ns"), ("CNI_IFNAME", "eth0")];
        let (e, code) = run_with(&[], "{}");
        assert_eq!((code, e["code"].as_u64()), (1, Some(4)));
        let (e, _) = run_with(&add, "{not json");
        assert_eq!(e["code"], 6);
        let (e, _) = run_with(&add, r#"{"cniVersion": "0.2.0", "name": "n", "vnic": "a"}"#);
        assert_eq!((e["code"].as_u64(), e["cniVersion"].as_str()), (Some(1), Some("1.1.0")));
        let (e, _) = run_with(&add, r#"{"cniVersion": "1.0.0", "name": "n"}"#);
        assert_eq!((e["code"].as_u64(), e["cniVersion"].as_str()), (Some(7), Some("1.0.0")));
        assert!(e["msg"].is_string() && e["details"].is_string());
        // A namespace that is not there: nothing to clean up for the runtime.
        let (e, _) = run_with(&add, r#"{"cniVersion": "1.0.0", "name": "n", "vnic": "a"}"#);
        assert_eq!(e["code"], 3, "{e}");
        let check = [("CNI_COMMAND", "CHECK"), ("CNI_CONTAINERID", "c"), ("CNI_NETNS", "/x"), ("CNI_IFNAME", "eth0")];
        let (e, _) = run_with(&check, r#"{"cniVersion": "0.3.1", "name": "n", "vnic": "a"}"#);
        assert_eq!(e["code"], 1, "no CHECK before 0.4.0");
        let (e, _) = run_with(&check, r#"{"cniVersion": "1.0.0", "name": "n", "vnic": "a"}"#);
        assert_eq!(e["code"], 7, "CHECK without prevResult");
        let (e, _) = run_with(&[("CNI_COMMAND", "STATUS")], r#"{"cniVersion": "1.0.0", "name": "n", "vnic": "a"}"#);
        assert_eq!(e["code"], 1, "no STATUS before 1.1.0");
        let (e, _) = run_with(
            &[("CNI_COMMAND", "STATUS")],
            r#"{"cniVersion": "1.1.0", "name": "n", "vnic": "a", "adminSocket": "/nonexistent/a.sock"}"#,
        );
        assert_eq!(e["code"], 50);
    }
}
