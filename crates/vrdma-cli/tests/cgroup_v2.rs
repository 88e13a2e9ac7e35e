//! `vrdma run`'s limits on a cgroup v2 host (issue 26, docs/security.md "Containers"). The
//! development and CI machines mount cgroup v1 (the unified hierarchy holds no controller),
//! so the v2 path is exercised in a virtual machine: Debian's kernel under QEMU (software
//! emulation: nested KVM is not usable here), an initramfs of busybox, iproute2, vrdma and
//! vrdmad, and tests/cgroup_v2_init.sh as PID 1, which mounts only cgroup2, runs containers
//! with and without limits and reports each check on the serial console.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use vrdma_test_support::{require_files, require_root, skip};

const INIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cgroup_v2_init.sh");

/// Every check the init script makes; each must report `ok`.
const CHECKS: &[&str] = &[
    "container_in_its_cgroup",
    "pids_max",
    "memory_max",
    "swap_off",
    "cpu_max",
    "container_running",
    "killed_run_leaves_no_process",
    "stale_cgroup_removed_by_the_next_run",
    "fork_bomb_stops_at_pids_max",
    "allocation_under_the_limit_runs",
    "allocation_past_the_limit_is_killed",
    "cpu_quota_throttles",
    "cgroup_removed_after_the_run",
    "default_pids_max",
    "default_memory_max_is_half_the_ram",
    "default_cpu_unlimited",
    "cgroup_removed_after_sigterm",
    "no_limits_no_cgroup",
    "container_beside_the_callers_cgroup",
    "the_callers_parent_limits_bind",
    "no_cgroup_left_under_the_parent",
];

/// Kernel modules the machine loads, in dependency order (the vNIC bridge and veth pairs,
/// overlayfs for the container's /tmp).
const MODULES: &[&str] = &["llc", "stp", "bridge", "veth", "overlay"];

/// The newest installed kernel image with its modules: `(vmlinuz, modules directory)`.
fn kernel() -> Option<(PathBuf, PathBuf)> {
    let mut found: Vec<(PathBuf, PathBuf)> = std::fs::read_dir("/boot")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.strip_prefix("vmlinuz-")?.to_string();
            let modules = Path::new("/lib/modules").join(&name);
            modules.join("kernel").is_dir().then(|| (e.path(), modules))
        })
        .collect();
    found.sort();
    found.pop()
}

/// Copies the shared libraries `file` links into `root`, at their paths.
fn add_libraries(root: &Path, file: &str) {
    let ldd = Command::new("ldd").arg(file).output().unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout).split_whitespace().filter(|w| w.starts_with('/')) {
        let dest = root.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(lib, &dest).unwrap_or_else(|e| panic!("copying {lib}: {e}"));
    }
}

/// Finds `<name>.ko` under the kernel's module tree.
fn module(dir: &Path, name: &str) -> Option<PathBuf> {
    let out = Command::new("find").arg(dir).args(["-name", &format!("{name}.ko")]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().next().map(PathBuf::from)
}

/// The initramfs: busybox (static), iproute2's `ip`, vrdma and vrdmad (stripped), the
/// modules and the init script; gzipped newc cpio, as the kernel unpacks it.
fn initramfs(work: &Path, modules_dir: &Path) -> PathBuf {
    let root = work.join("root");
    for d in ["bin", "proc", "sys", "dev", "run", "tmp", "var/tmp", "root", "etc", "mods"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    // iproute2's `ip` (vrdma needs `-j`), also at /bin/ip ahead of busybox's applet.
    add_libraries(&root, "/usr/sbin/ip");
    for dest in ["usr/sbin/ip", "bin/ip"] {
        std::fs::create_dir_all(root.join(dest).parent().unwrap()).unwrap();
        std::fs::copy("/usr/sbin/ip", root.join(dest)).unwrap();
    }
    for (bin, name) in [(VRDMA, "vrdma"), (VRDMAD, "vrdmad")] {
        add_libraries(&root, bin);
        let st = Command::new("strip").arg("-o").arg(root.join("bin").join(name)).arg(bin).status().unwrap();
        assert!(st.success(), "strip {bin}");
    }
    for m in MODULES {
        let ko = module(modules_dir, m).unwrap_or_else(|| panic!("module {m}.ko not under {}", modules_dir.display()));
        std::fs::copy(ko, root.join("mods").join(format!("{m}.ko"))).unwrap();
    }
    std::fs::write(root.join("mods/order"), MODULES.join("\n")).unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::copy(INIT, root.join("init")).unwrap();
    std::fs::set_permissions(root.join("init"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let image = work.join("initramfs.cpio.gz");
    let pack = format!("find . | cpio -o -H newc --quiet | gzip -1 > {}", image.display());
    let st = Command::new("sh").args(["-c", &pack]).current_dir(&root).status().unwrap();
    assert!(st.success(), "packing the initramfs");
    image
}

#[test]
fn limits_hold_on_a_cgroup_v2_host() {
    let test = "limits_hold_on_a_cgroup_v2_host";
    let tools = ["/usr/bin/qemu-system-x86_64", "/bin/busybox", "/bin/cpio", "/usr/bin/strip", "/usr/sbin/ip"];
    if !require_root(test) || !require_files(test, &tools, "qemu-system-x86 busybox-static cpio binutils iproute2") {
        return;
    }
    let Some((vmlinuz, modules_dir)) = kernel() else {
        skip(test, "no kernel image in /boot with its modules (install linux-image-cloud-amd64)");
        return;
    };
    let work = std::env::temp_dir().join(format!("vrdma-cgroup-v2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let image = initramfs(&work, &modules_dir);
    // Software emulation (TCG): 2 CPUs, 1 GiB, the serial console on stdout (into a file: a
    // pipe nobody reads while waiting could fill).
    let console = work.join("console");
    let vm = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=multi", "-cpu", "max", "-m", "1024", "-smp", "2", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(&vmlinuz)
        .arg("-initrd")
        .arg(&image)
        .args(["-append", "console=ttyS0 quiet panic=-1"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&console).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_, qemu) = wait_output(vm, Duration::from_secs(600));
    let out = format!("{}{qemu}", std::fs::read_to_string(&console).unwrap_or_default());
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("--- the machine's console ({})\n{out}", vmlinuz.display());
    assert!(out.contains("VM DONE"), "the machine did not finish its checks");
    let failed: Vec<&str> = CHECKS.iter().copied().filter(|c| !out.contains(&format!("CHECK {c} ok"))).collect();
    assert!(failed.is_empty(), "checks not ok on cgroup v2: {failed:?}");
}
