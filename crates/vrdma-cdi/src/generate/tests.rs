use super::*;
use crate::{CDI_VERSION, KIND};

fn vnic(name: &str) -> VnicDevice {
    VnicDevice { name: name.into(), dir: PathBuf::from("/run/vrdma/vnics").join(name) }
}

fn dropin() -> DropIn {
    DropIn { path: "/usr/local/lib/vrdma/libibverbs.so.1".into() }
}

#[test]
fn a_device_gives_what_vrdma_run_gives() {
    let d = device_for(&vnic("da"));
    assert_eq!(d.name, "da");
    let e = &d.container_edits;
    assert_eq!(e.env, ["VRDMA_SOCKET=/run/vrdma/control.sock", "VRDMA_VNIC=da"]);
    assert_eq!(e.mounts.len(), 1, "the vNIC's directory and nothing else of vrdma");
    assert_eq!(e.mounts[0].host_path, "/run/vrdma/vnics/da");
    assert_eq!(e.mounts[0].container_path, "/run/vrdma");
    assert!(e.mounts[0].options.iter().any(|o| o == "bind"));
    assert!(!e.mounts[0].options.iter().any(|o| o == "ro"), "clients connect to the socket in it");
    let n = &e.device_nodes[0];
    assert_eq!(n.path, "/dev/infiniband/vrdma_da", "the verbs device's name, as in vrdma run");
    assert_eq!((n.host_path.as_deref(), n.node_type.as_deref(), n.major, n.minor), (Some("/dev/null"), Some("c"), Some(1), Some(3)));
    assert_eq!(n.permissions.as_deref(), Some("rw"), "no mknod right for the container");
}

#[test]
fn the_node_name_is_cut_like_the_verbs_device_name() {
    let long = "n".repeat(64);
    let d = device_for(&vnic(&long));
    assert_eq!(d.container_edits.device_nodes[0].path, format!("/dev/infiniband/{}", vrdma::verbs_device_name(&long)));
    assert_eq!(d.container_edits.device_nodes[0].path.len(), "/dev/infiniband/".len() + 63);
}

#[test]
fn the_dropin_is_shared_read_only_and_first_on_the_loader_path() {
    let s = spec_for(&[vnic("a"), vnic("b")], Some(&dropin())).unwrap();
    let e = &s.container_edits;
    assert_eq!(e.env, ["LD_LIBRARY_PATH=/opt/vrdma/lib", "UCX_IB_RCACHE_ADDR_ALIGN=4096"]);
    assert_eq!(e.mounts[0].host_path, "/usr/local/lib/vrdma/libibverbs.so.1");
    assert_eq!(e.mounts[0].container_path, "/opt/vrdma/lib/libibverbs.so.1");
    assert!(e.mounts[0].options.iter().any(|o| o == "ro"));
    assert!(!e.mounts[0].options.iter().any(|o| o == "noexec"), "the loader maps it executable");
    for d in &s.devices {
        assert!(!d.container_edits.env.iter().any(|v| v.starts_with("LD_LIBRARY_PATH=")));
    }
    let without = spec_for(&[vnic("a")], None).unwrap();
    assert!(without.container_edits.is_empty(), "no drop-in installed: no library edits");
}

#[test]
fn devices_are_sorted_and_cdi_names_only() {
    let s = spec_for(&[vnic("zz"), vnic("0a"), vnic("-lead"), vnic("trail_"), vnic("m-1.x")], None).unwrap();
    assert_eq!(s.cdi_version, CDI_VERSION);
    assert_eq!(s.kind, KIND);
    let names: Vec<_> = s.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["0a", "m-1.x", "zz"]);
}

#[test]
fn no_vnic_no_spec() {
    assert!(spec_for(&[], Some(&dropin())).is_none(), "CDI requires at least one device");
    assert!(spec_for(&[vnic("_")], None).is_none());
}

#[test]
fn device_names() {
    for ok in ["a", "0", "a-b", "a_b", "a.b", "A9"] {
        assert!(is_valid_device_name(ok), "{ok}");
    }
    for bad in ["", "-a", "a-", "_a", "a_", ".a", "a/b", "a b", "ä"] {
        assert!(!is_valid_device_name(bad), "{bad}");
    }
}

/// Every JSON key of `v`, recursively.
fn keys(v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                out.insert(k.clone());
                keys(x, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| keys(x, out)),
        _ => {}
    }
}

#[test]
fn the_json_uses_cdi_names_and_no_field_newer_than_its_version() {
    let s = spec_for(&[vnic("a")], Some(&dropin())).unwrap();
    let v = serde_json::to_value(&s).unwrap();
    let mut k = std::collections::BTreeSet::new();
    keys(&v, &mut k);
    // The fields of CDI 0.5.0 (annotations came in 0.6.0, additionalGids and intelRdt in
    // 0.7.0, netDevices in 1.1.0).
    let v050 = [
        "cdiVersion",
        "kind",
        "devices",
        "name",
        "containerEdits",
        "env",
        "deviceNodes",
        "path",
        "hostPath",
        "type",
        "major",
        "minor",
        "fileMode",
        "permissions",
        "mounts",
        "containerPath",
        "options",
    ];
    let extra: Vec<_> = k.iter().filter(|k| !v050.contains(&k.as_str())).collect();
    assert!(extra.is_empty(), "fields beyond CDI {CDI_VERSION}: {extra:?}");
    assert_eq!(v["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"], "/dev/null");
    let back: crate::Spec = serde_json::from_value(v).unwrap();
    assert_eq!(back, s);
}

#[test]
fn the_dropin_is_found_beside_the_executable() {
    let root = std::env::temp_dir().join(format!("vrdma-cdi-find-{}", std::process::id()));
    let lib = root.join("lib/vrdma");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(root.join("bin")).unwrap();
    assert!(dropin_in(&lib).is_none(), "no file, no drop-in");
    std::fs::write(lib.join(DROPIN_FILE), b"").unwrap();
    assert_eq!(dropin_in(&lib).unwrap().path, lib.join(DROPIN_FILE));
    if std::env::var_os("VRDMA_LIB_DIR").is_none() {
        assert_eq!(find_dropin(Some(&root.join("bin/vrdmad"))).unwrap().path, lib.join(DROPIN_FILE));
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_vnics_edits_are_its_device_then_the_shared_ones() {
    let e = edits_for(&vnic("a"), Some(&dropin()));
    let device = device_for(&vnic("a")).container_edits;
    assert_eq!(e.device_nodes, device.device_nodes);
    assert_eq!(e.mounts[0], device.mounts[0]);
    assert_eq!(e.mounts[1].container_path, format!("{CONTAINER_LIB_DIR}/{DROPIN_FILE}"));
    assert_eq!(e.env[e.env.len() - 2..], ["LD_LIBRARY_PATH=/opt/vrdma/lib", "UCX_IB_RCACHE_ADDR_ALIGN=4096"]);
    assert_eq!(edits_for(&vnic("a"), None), device);
}
