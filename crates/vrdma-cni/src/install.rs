//! `vrdma-cni install`: the plugin binary where runtimes look for plugins, and a network
//! configuration list runtimes load (podman's CNI backend reads /etc/cni/net.d and runs
//! plugins from /usr/lib/cni).

use std::io;
use std::path::{Path, PathBuf};

use serde_json::json;

/// Installer options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// Network name (`podman run --network NAME`) and the conflist's file name.
    pub name: String,
    /// `vnicArg`: the CNI_ARGS key naming the vNIC; podman sets `K8S_POD_NAME` to the
    /// container's name. None: no such key.
    pub vnic_arg: Option<String>,
    pub tenant: Option<String>,
    pub admin_socket: Option<PathBuf>,
    /// A secondary network (no default route).
    pub secondary: bool,
    /// Replace a different existing conflist.
    pub force: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            conf_dir: "/etc/cni/net.d".into(),
            bin_dir: "/usr/lib/cni".into(),
            name: "vrdma".into(),
            vnic_arg: Some("K8S_POD_NAME".into()),
            tenant: None,
            admin_socket: None,
            secondary: false,
            force: false,
        }
    }
}

/// Why installing failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{0}")]
    Usage(String),
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: io::Error },
    #[error("{} exists with other contents (use --force to replace it)", .0.display())]
    Exists(PathBuf),
}

/// Parses the arguments after `install`.
pub fn parse(args: &[String]) -> Result<Options, InstallError> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(|| InstallError::Usage(format!("{flag} needs a value")));
        match flag.as_str() {
            "--conf-dir" => o.conf_dir = value()?.into(),
            "--bin-dir" => o.bin_dir = value()?.into(),
            "--name" => o.name = value()?,
            "--vnic-arg" => o.vnic_arg = Some(value()?).filter(|v| !v.is_empty()),
            "--tenant" => o.tenant = Some(value()?),
            "--admin-socket" => o.admin_socket = Some(value()?.into()),
            "--secondary" => o.secondary = true,
            "--force" => o.force = true,
            other => return Err(InstallError::Usage(format!("unknown option {other:?}"))),
        }
    }
    if !crate::env::valid_id(&o.name) {
        return Err(InstallError::Usage(format!("network name {:?} is not [A-Za-z0-9][A-Za-z0-9_.-]*", o.name)));
    }
    Ok(o)
}

/// The network configuration list for `o` (CNI 1.0.0, which podman 4's libcni speaks).
pub fn conflist(o: &Options) -> serde_json::Value {
    let mut plugin = json!({"type": "vrdma-cni"});
    if let Some(k) = &o.vnic_arg {
        plugin["vnicArg"] = json!(k);
    }
    if let Some(t) = &o.tenant {
        plugin["tenant"] = json!(t);
    }
    if let Some(s) = &o.admin_socket {
        plugin["adminSocket"] = json!(s);
    }
    if o.secondary {
        plugin["defaultRoute"] = json!(false);
    }
    json!({"cniVersion": "1.0.0", "name": o.name, "plugins": [plugin]})
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io { what, path, source }
}

/// Runs `vrdma-cni install ARGS`; returns what it did.
pub fn install(args: &[String]) -> Result<String, InstallError> {
    let o = parse(args)?;
    let exe = std::env::current_exe().map_err(io_err("finding", Path::new("/proc/self/exe")))?;
    let bin = o.bin_dir.join("vrdma-cni");
    std::fs::create_dir_all(&o.bin_dir).map_err(io_err("creating", &o.bin_dir))?;
    if std::fs::canonicalize(&bin).ok() != std::fs::canonicalize(&exe).ok() {
        // Copy, then rename: a runtime executing the old binary meanwhile is not disturbed.
        let tmp = o.bin_dir.join(".vrdma-cni.new");
        std::fs::copy(&exe, &tmp).map_err(io_err("copying to", &tmp))?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(io_err("chmod", &tmp))?;
        std::fs::rename(&tmp, &bin).map_err(io_err("installing", &bin))?;
    }
    let conf = o.conf_dir.join(format!("{}.conflist", o.name));
    let text = serde_json::to_string_pretty(&conflist(&o)).expect("json") + "\n";
    std::fs::create_dir_all(&o.conf_dir).map_err(io_err("creating", &o.conf_dir))?;
    match std::fs::read_to_string(&conf) {
        Ok(old) if old == text => {}
        Ok(_) if !o.force => return Err(InstallError::Exists(conf)),
        _ => std::fs::write(&conf, &text).map_err(io_err("writing", &conf))?,
    }
    Ok(format!("installed {} and {} (network {:?})", bin.display(), conf.display(), o.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_and_the_conflist() {
        let o = parse(&[]).unwrap();
        assert_eq!(o, Options::default());
        assert_eq!(
            conflist(&o),
            json!({"cniVersion": "1.0.0", "name": "vrdma", "plugins": [{"type": "vrdma-cni", "vnicArg": "K8S_POD_NAME"}]})
        );
        let o = parse(&args(&["--name", "rdma2", "--vnic-arg", "", "--tenant", "t", "--secondary", "--conf-dir", "/tmp/c"])).unwrap();
        assert_eq!(o.conf_dir, PathBuf::from("/tmp/c"));
        assert_eq!(
            conflist(&o),
            json!({"cniVersion": "1.0.0", "name": "rdma2", "plugins": [{"type": "vrdma-cni", "tenant": "t", "defaultRoute": false}]})
        );
        assert!(parse(&args(&["--name"])).is_err());
        assert!(parse(&args(&["--bogus"])).is_err());
        assert!(parse(&args(&["--name", "a b"])).is_err());
    }

    #[test]
    fn install_writes_binary_and_conflist_once() {
        let dir = std::env::temp_dir().join(format!("vrdma-cni-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = args(&["--conf-dir", dir.join("net.d").to_str().unwrap(), "--bin-dir", dir.join("bin").to_str().unwrap()]);
        install(&a).unwrap();
        assert!(dir.join("bin/vrdma-cni").is_file());
        let conf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("net.d/vrdma.conflist")).unwrap()).unwrap();
        assert_eq!(conf["plugins"][0]["type"], "vrdma-cni");
        install(&a).unwrap();
        let mut other = a.clone();
        other.extend(args(&["--tenant", "t"]));
        assert!(matches!(install(&other), Err(InstallError::Exists(_))));
        other.push("--force".into());
        install(&other).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
