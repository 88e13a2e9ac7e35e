//! The CNI_* environment of an invocation (SPEC.md, "Parameters").

use std::path::PathBuf;

use crate::error::CniError;

/// `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Version,
    Gc,
}

/// What the runtime asks for, from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    pub command: Command,
    /// For ADD, DEL and CHECK.
    pub attachment: Option<Attachment>,
    /// `CNI_ARGS` as key/value pairs, in order.
    pub args: Vec<(String, String)>,
}

/// One container's interface: the spec's key of an attachment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
    /// `CNI_NETNS`; required for ADD and CHECK, optional for DEL.
    pub netns: Option<PathBuf>,
}

impl Invocation {
    /// Reads and validates the variables `get` returns (the process environment, or a
    /// test's map).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Invocation, CniError> {
        let get = |k: &str| get(k).filter(|v| !v.is_empty());
        let invalid = |vars: &str, reason: String| CniError::InvalidEnv { vars: vars.to_string(), reason };
        let command = match get("CNI_COMMAND").as_deref() {
            None => return Err(invalid("CNI_COMMAND", "missing".into())),
            Some("ADD") => Command::Add,
            Some("DEL") => Command::Del,
            Some("CHECK") => Command::Check,
            Some("STATUS") => Command::Status,
            Some("VERSION") => Command::Version,
            Some("GC") => Command::Gc,
            Some(other) => return Err(invalid("CNI_COMMAND", format!("unknown command {other:?}"))),
        };
        let attachment = match command {
            Command::Add | Command::Check | Command::Del => {
                let need_netns = command != Command::Del;
                let mut missing: Vec<&str> = ["CNI_CONTAINERID", "CNI_IFNAME"].into_iter().filter(|k| get(k).is_none()).collect();
                if need_netns && get("CNI_NETNS").is_none() {
                    missing.push("CNI_NETNS");
                }
                if !missing.is_empty() {
                    return Err(invalid(&missing.join(", "), "missing".into()));
                }
                let container_id = get("CNI_CONTAINERID").unwrap_or_default();
                if !valid_id(&container_id) {
                    return Err(invalid("CNI_CONTAINERID", format!("{container_id:?} is not [A-Za-z0-9][A-Za-z0-9_.-]*")));
                }
                let ifname = get("CNI_IFNAME").unwrap_or_default();
                if let Err(why) = check_ifname(&ifname) {
                    return Err(invalid("CNI_IFNAME", format!("{ifname:?}: {why}")));
                }
                let netns = get("CNI_NETNS").map(PathBuf::from);
                if let Some(p) = &netns {
                    if !p.is_absolute() {
                        return Err(invalid("CNI_NETNS", format!("{} is not an absolute path", p.display())));
                    }
                }
                Some(Attachment { container_id, ifname, netns })
            }
            _ => None,
        };
        let args = parse_args(get("CNI_ARGS").as_deref().unwrap_or("")).map_err(|why| invalid("CNI_ARGS", why))?;
        Ok(Invocation { command, attachment, args })
    }

    /// The value of `CNI_ARGS` key `key` (the last one given).
    pub fn arg(&self, key: &str) -> Option<&str> {
        self.args.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Container IDs and network names: `[A-Za-z0-9][A-Za-z0-9_.-]*`.
pub fn valid_id(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphanumeric()) && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The spec's rules for CNI_IFNAME (Linux's): 1-15 bytes, not `.` or `..`, no `/`, `:` or
/// whitespace.
fn check_ifname(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 15 {
        return Err("must be 1 to 15 bytes long");
    }
    if name == "." || name == ".." {
        return Err("must not be . or ..");
    }
    if name.bytes().any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || !b.is_ascii_graphic()) {
        return Err("must not contain /, :, whitespace or non-ASCII");
    }
    Ok(())
}

/// `K=V;K2=V2` (empty parts are skipped).
fn parse_args(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(';')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(format!("{p:?} is not KEY=VALUE")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn inv(vars: &[(&str, &str)]) -> Result<Invocation, CniError> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Invocation::from_env(|k| m.get(k).cloned())
    }

    const ADD: [(&str, &str); 4] =
        [("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c0ffee"), ("CNI_NETNS", "/run/netns/x"), ("CNI_IFNAME", "eth0")];

    #[test]
    fn add_reads_the_attachment_and_args() {
        let mut vars = ADD.to_vec();
        vars.push(("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web;;VRDMA_VNIC=a"));
        let i = inv(&vars).unwrap();
        assert_eq!(i.command, Command::Add);
        let a = i.attachment.as_ref().unwrap();
        assert_eq!((a.container_id.as_str(), a.ifname.as_str()), ("c0ffee", "eth0"));
        assert_eq!(a.netns.as_deref(), Some(std::path::Path::new("/run/netns/x")));
        assert_eq!(i.arg("K8S_POD_NAME"), Some("web"));
        assert_eq!(i.arg("VRDMA_VNIC"), Some("a"));
        assert_eq!(i.arg("nope"), None);
    }

    #[test]
    fn missing_and_malformed_variables_are_code_4_naming_them() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![], "CNI_COMMAND"),
            (vec![("CNI_COMMAND", "FROB")], "CNI_COMMAND"),
            (vec![("CNI_COMMAND", "ADD")], "CNI_CONTAINERID, CNI_IFNAME, CNI_NETNS"),
            (vec![("CNI_COMMAND", "CHECK"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0")], "CNI_NETNS"),
            (vec![("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "-c"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "/x")], "CNI_CONTAINERID"),
            (vec![("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "a/b"), ("CNI_NETNS", "/x")], "CNI_IFNAME"),
            (vec![("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "sixteen-bytes-xx"), ("CNI_NETNS", "/x")], "CNI_IFNAME"),
            (vec![("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "x")], "CNI_NETNS"),
            (vec![("CNI_COMMAND", "VERSION"), ("CNI_ARGS", "novalue")], "CNI_ARGS"),
        ];
        for (vars, named) in cases {
            let e = inv(&vars).unwrap_err();
            assert_eq!(e.code(), 4, "{vars:?}");
            assert!(matches!(&e, CniError::InvalidEnv { vars, .. } if vars == named), "{e}");
        }
    }

    #[test]
    fn del_needs_no_netns_and_version_no_container() {
        let i = inv(&[("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0")]).unwrap();
        assert_eq!(i.attachment.unwrap().netns, None);
        let v = inv(&[("CNI_COMMAND", "VERSION")]).unwrap();
        assert_eq!((v.command, v.attachment), (Command::Version, None));
        assert_eq!(inv(&[("CNI_COMMAND", "GC")]).unwrap().command, Command::Gc);
        assert_eq!(inv(&[("CNI_COMMAND", "STATUS")]).unwrap().command, Command::Status);
    }

    #[test]
    fn ids_follow_the_spec() {
        assert!(valid_id("a") && valid_id("0abc_d.e-f"));
        assert!(!valid_id("") && !valid_id("_a") && !valid_id("a b") && !valid_id("a/b"));
    }
}
