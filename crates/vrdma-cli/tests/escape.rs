//! The escape suite (issue 26, docs/security.md "Containers (vrdma run)"): a probe running as
//! root inside `vrdma run` tries every way out it knows (tests/escape_probe.py, one line per
//! attempt), and every attempt must fail; afterwards the host, vrdmad and the other vNIC
//! still work.

mod common;
use common::*;
use std::time::Duration;
use vrdma_test_support::{require_files, require_root};

const PROBE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/escape_probe.py");

/// Every attempt the probe makes; each must be reported, and blocked.
const ATTEMPTS: &[&str] = &[
    "umount_run_vrdma",
    "mount_over_run_vrdma",
    "fsopen",
    "open_tree",
    "pivot_root",
    "vrdma_sockets",
    "write_host_files",
    "ptrace_attach",
    "process_vm_readv",
    "init_module",
    "finit_module",
    "socket_af_packet",
    "socket_af_packet_dgram",
    "socket_raw_inet",
    "socket_raw_icmp",
    "unshare_user",
    "unshare_mnt",
    "unshare_net",
    "unshare_pid",
    "unshare_uts",
    "unshare_ipc",
    "unshare_cgroup",
    "unshare_time",
    "clone_newuser",
    "siocgskns",
    "add_key",
    "bpf",
    "x32_abi",
    "capabilities",
    "proc_sysrq_trigger",
    "proc_kcore",
    "proc_sys_write",
    "dev_nodes",
    "fork_bomb",
    "memory_limit",
];

#[test]
fn a_root_process_in_vrdma_run_cannot_escape() {
    let test = "a_root_process_in_vrdma_run_cannot_escape";
    if !require_root(test) || !require_files(test, &["/usr/bin/python3"], "python3") {
        return;
    }
    let d = Daemon::start("escape");
    d.ok(&["vnic", "create", "ea", "--tenant", "blue", "--ip", "198.18.16.2/15"]);
    d.ok(&["vnic", "create", "eb", "--tenant", "blue", "--ip", "198.18.16.3/15"]);
    let run_dir = d.run_dir().display().to_string();
    // As root of a user namespace (the default), and as root in the host's user namespace.
    for mode in [&[][..], &["--no-userns"][..]] {
        let tag = format!("{}{}", std::process::id(), mode.join(""));
        // Not PID 1: the probe also attacks the container's PID 1 (the shell).
        let script = format!("/usr/bin/python3 {PROBE} {run_dir} eb {tag}; exit $?");
        let probe = d
            .vrdma()
            .args(["run", "--vnic", "ea", "--pids-limit", "128", "--memory", "256M", "--cpus", "1"])
            .args(mode)
            .args(["--", "sh", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (ok, out) = wait_output(probe, Duration::from_secs(240));
        eprintln!("--- probe {mode:?}\n{out}");
        assert!(ok && out.contains("PROBE done"), "the probe {mode:?} did not finish:\n{out}");
        let mut escaped = Vec::new();
        for attempt in ATTEMPTS {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("PROBE {attempt} ")))
                .unwrap_or_else(|| panic!("no result for {attempt}:\n{out}"));
            if !line.starts_with(&format!("PROBE {attempt} blocked")) {
                escaped.push(line.to_string());
            }
        }
        // Writes the probe made in its private /tmp and /var/tmp never reach the host.
        for dir in ["/etc", "/root", "/var/tmp", "/tmp", "/usr/local", "/var/lib"] {
            let p = format!("{dir}/vrdma-escape-{tag}");
            if std::path::Path::new(&p).exists() {
                let _ = std::fs::remove_file(&p);
                escaped.push(format!("{p} appeared on the host"));
            }
        }
        assert!(escaped.is_empty(), "escapes {mode:?}:\n{}\n\nfull output:\n{out}", escaped.join("\n"));
    }

    // The container's cgroup is gone; the host, vrdmad and the other vNIC still work.
    let leftovers: Vec<String> = ["/sys/fs/cgroup/vrdma", "/sys/fs/cgroup/unified/vrdma", "/sys/fs/cgroup/pids/vrdma"]
        .iter()
        .flat_map(|p| std::fs::read_dir(p).into_iter().flatten().flatten())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path().display().to_string())
        .filter(|p| p.contains("/ea-"))
        .collect();
    assert!(leftovers.is_empty(), "cgroups left behind: {leftovers:?}");
    assert_eq!(d.list().as_array().unwrap().len(), 2, "vnic list after the probe");
    let server = d.container("eb", &[VRDMA, "check", "-p", "18640"]);
    std::thread::sleep(Duration::from_millis(300));
    // The client in a user namespace: the vNIC works the same from there.
    let client = d
        .vrdma()
        .args(["run", "--userns", "--vnic", "ea", "--", VRDMA, "check", "-p", "18640", "198.18.16.3"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(60));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "vrdma check after the probe:\nclient:\n{out_c}\nserver:\n{out_s}");

    // Root inside is unprivileged outside by default; `--no-userns` keeps the host's ids.
    // vrdmad's run and state directories in a directory searchable by root alone (as
    // `mktemp -d` makes) keep no container from its vNIC: the sandbox opens the vNIC's
    // directory with the caller's ids, and what the container's root cannot reach needs
    // no cover.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&d.dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    for (mode, want) in [(&[][..], format!("0 {} 65536", 1_000_000)), (&["--no-userns"][..], "0 0 4294967295".to_string())] {
        let out = d.vrdma().args(["run", "--vnic", "ea"]).args(mode).args(["--", "cat", "/proc/self/uid_map"]).output().unwrap();
        let map = String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(map, want, "uid map {mode:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // The drop-in in that directory too: the sandbox binds its directory in, so the
    // container's root loads it (the loader would otherwise fall back, silently, on the
    // system's libibverbs, which finds no device).
    if require_files(test, &["/usr/bin/ibv_devices"], "ibverbs-utils") {
        let lib = d.dir.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(dropin_so(), lib.join("libibverbs.so.1")).unwrap();
        let out = d.vrdma().env("VRDMA_LIB_DIR", &lib).args(["run", "--vnic", "ea", "--", "ibv_devices"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("vrdma_ea"), "ibv_devices in a user namespace: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
}
