//! vrdmad keeps its CDI spec current as vNICs come and go, and `vrdma cdi generate` writes
//! the same spec (a real vrdmad and the real CLI; no namespaces or containers: podman.rs
//! runs containers from the spec).

mod common;
use common::*;

use std::path::{Path, PathBuf};

/// The spec file of daemon `d` (the tests' daemons keep theirs in `<dir>/cdi`).
fn spec_file(d: &Daemon) -> PathBuf {
    d.dir.join("cdi").join("vrdma.io-vnic.json")
}

fn device_names(spec: &serde_json::Value) -> Vec<String> {
    spec["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect()
}

/// A stand-in drop-in library, found by vrdmad and the CLI through VRDMA_LIB_DIR: one
/// fixed path for every test of this file, so tests running side by side set the same value.
fn fake_dropin() -> PathBuf {
    let lib = std::env::temp_dir().join("vrdma-cdi-test-lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libibverbs.so.1"), b"").unwrap();
    std::env::set_var("VRDMA_LIB_DIR", &lib);
    lib
}

#[test]
fn vrdmad_keeps_the_spec_current_and_the_cli_writes_the_same() {
    let lib = fake_dropin();
    let d = Daemon::start("cdi-current");
    let spec = spec_file(&d);
    assert!(!spec.exists(), "no vNIC, no spec (CDI requires a device)");

    d.ok(&["vnic", "create", "c1", "--tenant", "blue"]);
    d.ok(&["vnic", "create", "c2", "--tenant", "blue"]);
    let text = std::fs::read_to_string(&spec).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["kind"], "vrdma.io/vnic");
    assert_eq!(device_names(&v), ["c1", "c2"]);
    let c1 = &v["devices"][0]["containerEdits"];
    assert_eq!(c1["mounts"][0]["hostPath"], d.run_dir().join("vnics/c1").display().to_string());
    assert_eq!(c1["mounts"][0]["containerPath"], "/run/vrdma");
    assert_eq!(c1["deviceNodes"][0]["path"], "/dev/infiniband/vrdma_c1");
    assert_eq!(v["containerEdits"]["mounts"][0]["hostPath"], lib.join("libibverbs.so.1").display().to_string());

    // The CLI: the same spec, on stdout or into a file.
    assert_eq!(d.ok(&["cdi", "generate"]), text, "vrdma cdi generate prints the daemon's spec");
    let out = d.dir.join("static").join("vrdma.json");
    d.ok(&["cdi", "generate", "--output", out.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), text);

    d.ok(&["vnic", "delete", "c1"]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
    assert_eq!(device_names(&v), ["c2"], "a deleted vNIC leaves the spec");
    d.ok(&["vnic", "delete", "c2"]);
    assert!(!spec.exists(), "the last vNIC takes the spec with it");
    let o = d.vrdma().args(["cdi", "generate"]).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("at least one device"), "{o:?}");
    leftovers(&spec);
}

/// Only the spec itself is ever in the directory (no temporary file stays).
fn leftovers(spec: &Path) {
    let dir = spec.parent().unwrap();
    let names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| n == "vrdma.io-vnic.json"), "{names:?}");
}

#[test]
fn a_restarted_vrdmad_rewrites_the_spec_of_its_vnics() {
    fake_dropin();
    let d = Daemon::start("cdi-restart");
    d.ok(&["vnic", "create", "r1", "--tenant", "blue"]);
    let spec = spec_file(&d);
    std::fs::remove_file(&spec).unwrap();
    // The same state directory, a new daemon: its first sync writes the spec again.
    let mut d = d;
    let _ = d.child.kill();
    let _ = d.child.wait();
    let _ = std::fs::remove_file(d.run_dir().join("admin.sock"));
    d.child = std::process::Command::new(VRDMAD)
        .args(["--run-dir", d.run_dir().to_str().unwrap(), "--state-dir", d.dir.join("state").to_str().unwrap()])
        .args(["--cdi-dir", d.dir.join("cdi").to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !spec.exists() {
        assert!(std::time::Instant::now() < deadline, "the restarted vrdmad wrote no spec");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
    assert_eq!(device_names(&v), ["r1"]);
}

#[test]
fn cdi_dir_none_writes_nothing() {
    fake_dropin();
    let d = Daemon::start_with("cdi-none", &["--cdi-dir", "none"]);
    d.ok(&["vnic", "create", "n1", "--tenant", "blue"]);
    assert!(!d.dir.join("cdi").exists() && !Path::new("none").exists());
}
