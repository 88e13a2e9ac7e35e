//! The generated spec validates against CDI's JSON schema (vendored in tests/data/cdi-schema,
//! see SOURCE.md there), checked with Python's `jsonschema` (Debian: python3-jsonschema).

use std::path::{Path, PathBuf};
use std::process::Command;

use vrdma_cdi::{spec_for, DropIn, VnicDevice};

const JSONSCHEMA: &str = "/usr/lib/python3/dist-packages/jsonschema/__init__.py";

/// Validates the JSON file `doc` against schema.json (with its `defs.json` references);
/// returns (valid, what the validator said).
fn validate(doc: &Path) -> (bool, String) {
    let schema_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cdi-schema");
    let script = r#"
import json, pathlib, sys
import jsonschema
d = pathlib.Path(sys.argv[1]).resolve()
schema = json.loads((d / "schema.json").read_text())
defs = json.loads((d / "defs.json").read_text())
resolver = jsonschema.RefResolver(base_uri=d.as_uri() + "/", referrer=schema, store={(d / "defs.json").as_uri(): defs})
jsonschema.Draft7Validator(schema, resolver=resolver).validate(json.loads(pathlib.Path(sys.argv[2]).read_text()))
print("valid")
"#;
    let o = Command::new("python3").args(["-W", "ignore", "-c", script]).arg(&schema_dir).arg(doc).output().expect("run python3");
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vrdma-cdi-schema-{name}-{}.json", std::process::id()))
}

#[test]
fn generated_spec_validates_against_the_cdi_schema() {
    if !vrdma_test_support::require_files("generated_spec_validates_against_the_cdi_schema", &[JSONSCHEMA], "python3-jsonschema") {
        return;
    }
    let vnics: Vec<VnicDevice> =
        ["da", "0b", "n.1"].iter().map(|n| VnicDevice { name: n.to_string(), dir: format!("/run/vrdma/vnics/{n}").into() }).collect();
    for dropin in [None, Some(DropIn { path: "/usr/local/lib/vrdma/libibverbs.so.1".into() })] {
        let spec = spec_for(&vnics, dropin.as_ref()).unwrap();
        let doc = scratch("good");
        std::fs::write(&doc, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        let (ok, out) = validate(&doc);
        std::fs::remove_file(&doc).unwrap();
        assert!(ok, "the spec does not validate:\n{out}\n{}", serde_json::to_string_pretty(&spec).unwrap());
    }
}

/// The check is not vacuous: documents the schema forbids are refused.
#[test]
fn the_schema_check_refuses_bad_specs() {
    if !vrdma_test_support::require_files("the_schema_check_refuses_bad_specs", &[JSONSCHEMA], "python3-jsonschema") {
        return;
    }
    let spec = spec_for(&[VnicDevice { name: "a".into(), dir: "/run/vrdma/vnics/a".into() }], None).unwrap();
    let good = serde_json::to_value(&spec).unwrap();
    let mut no_devices = good.clone();
    no_devices.as_object_mut().unwrap().remove("devices");
    let mut mount_without_path = good.clone();
    mount_without_path["devices"][0]["containerEdits"]["mounts"][0].as_object_mut().unwrap().remove("containerPath");
    let mut major_as_text = good;
    major_as_text["devices"][0]["containerEdits"]["deviceNodes"][0]["major"] = "1".into();
    for (what, bad) in [("no devices", no_devices), ("a mount without containerPath", mount_without_path), ("a text major", major_as_text)]
    {
        let doc = scratch("bad");
        std::fs::write(&doc, serde_json::to_vec(&bad).unwrap()).unwrap();
        let (ok, out) = validate(&doc);
        std::fs::remove_file(&doc).unwrap();
        assert!(!ok, "{what} was accepted:\n{out}");
    }
}
