//! podman (Debian 12's 4.3, CNI backend, runc) runs containers on networks `vrdma-cni
//! install` wrote: the container's eth0 has its vNIC's address, and `podman run --rm` leaves
//! nothing behind. Only the network here (the vNIC's device through CDI is tested with
//! podman in vrdma-cli's tests). Podman runs with a private storage root, run root,
//! containers.conf and network directory, so it does not meet other podman users.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A root filesystem of the host's `sh`, `ip` and `sleep` with their libraries (no
/// registry, no image build).
fn rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    for d in ["bin", "etc", "proc", "sys", "dev", "tmp", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for bin in ["/bin/sh", "/bin/ip", "/bin/sleep"] {
        let real = std::fs::canonicalize(bin).unwrap();
        std::fs::copy(&real, root.join("bin").join(Path::new(bin).file_name().unwrap())).unwrap();
        let ldd = Command::new("ldd").arg(&real).output().unwrap();
        for lib in String::from_utf8_lossy(&ldd.stdout).split_whitespace().filter(|w| w.starts_with('/')) {
            let to = root.join(lib.trim_start_matches('/'));
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(lib, &to).unwrap();
        }
    }
    root
}

struct Podman {
    dir: PathBuf,
    rootfs: PathBuf,
}

impl Podman {
    /// Installs networks `<name>` (vNIC named by the container's name) and `<name>-t`
    /// (a vNIC per container, tenant `t7`) for `d` into a private CNI directory.
    fn new(d: &Daemon, name: &str) -> Podman {
        let dir = d.dir.join("podman");
        let rootfs = rootfs(&dir);
        let (conf_dir, bin_dir) = (dir.join("net.d"), dir.join("bin"));
        let install = |net: &str, extra: &[&str]| {
            let o = Command::new(CNI)
                .arg("install")
                .args(["--name", net, "--conf-dir", conf_dir.to_str().unwrap(), "--bin-dir", bin_dir.to_str().unwrap()])
                .args(["--admin-socket", d.admin_socket().to_str().unwrap(), "--state-dir", d.state_dir().to_str().unwrap()])
                .args(extra)
                .output()
                .unwrap();
            assert!(o.status.success(), "vrdma-cni install: {}", String::from_utf8_lossy(&o.stderr));
        };
        install(name, &[]);
        install(&format!("{name}-t"), &["--vnic-arg", "", "--tenant", "t7"]);
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[network]\nnetwork_backend = \"cni\"\nnetwork_config_dir = \"{}\"\ncni_plugin_dirs = [\"{}\", \"/usr/lib/cni\"]\n",
                conf_dir.display(),
                bin_dir.display()
            ),
        )
        .unwrap();
        Podman { dir, rootfs }
    }

    /// `podman run --rm` of `script` on `network`, with `args`; returns success and output.
    fn run(&self, network: &str, args: &[&str], cni_args: Option<&str>, script: &str) -> (bool, String) {
        let mut c = Command::new("/usr/bin/podman");
        c.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .args(["--root", self.dir.join("root").to_str().unwrap(), "--runroot", self.dir.join("runroot").to_str().unwrap()])
            // vfs: overlay would leave its private mount in our directory.
            .args(["--storage-driver", "vfs"])
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs", "run", "--rm"])
            .args(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--network", network])
            .args(args)
            .args(["--rootfs", self.rootfs.to_str().unwrap(), "/bin/sh", "-c", script]);
        if let Some(a) = cni_args {
            c.env("CNI_ARGS", a);
        }
        let o = c.output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    }
}

#[test]
fn podman_containers_get_their_vnics_address() {
    let test = "podman_containers_get_their_vnics_address";
    if !prerequisites(test)
        || !vrdma_test_support::require_files(test, &["/usr/bin/podman", "/usr/sbin/runc", "/usr/bin/ldd"], "podman runc libc-bin")
    {
        return;
    }
    let d = Daemon::start("podman");
    let network = format!("cni-podman-{}", std::process::id());
    let p = Podman::new(&d, &network);
    let show = "ip -4 -o addr show dev eth0; ip -o link show dev eth0; ip route";

    // The vNIC named like the container (podman's K8S_POD_NAME).
    let vnic = vnic_name("pod");
    d.create_vnic(&vnic, "t7", addr(80));
    let (ok, out) = p.run(&network, &["--name", &vnic], None, show);
    assert!(ok, "podman run: {out}\n{}", d.log());
    assert!(out.contains(&format!("inet {}/15", addr(80))), "{out}");
    assert!(out.contains(&format!("0a:58:c6:13:{:02x}:50", octet())), "{out}");
    assert!(out.contains("default via 198.18.0.1 dev eth0"), "{out}");
    assert!(d.records().is_empty(), "podman's DEL left {:?}", d.records());

    // A vNIC created for the container, at the address CNI_ARGS asks for, gone afterwards.
    let (ok, out) = p.run(&format!("{network}-t"), &[], Some(&format!("IP={}", addr(81))), show);
    assert!(ok, "podman run: {out}\n{}", d.log());
    assert!(out.contains(&format!("inet {}/15", addr(81))), "{out}");
    assert_eq!(d.vnics(), [(vnic.clone(), "t7".to_string())], "the created vNIC is deleted with the container");
    assert!(d.records().is_empty(), "{:?}", d.records());

    // An unknown vNIC fails the start, cleanly.
    let (ok, out) = p.run(&network, &["--name", &vnic_name("nosuch")], None, "true");
    assert!(!ok && out.contains("no vNIC named"), "{out}");
    assert!(d.records().is_empty(), "{:?}", d.records());
}
