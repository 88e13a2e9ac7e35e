//! The deployment manifests (deploy/kubernetes) validate offline: Kubernetes' own kinds
//! against Kubernetes' published schemas (PyPI's kubernetes-validate, strict), the custom
//! resources against their CRDs' shape, and the references between them
//! (deploy/kubernetes/validate.py says what exactly).

use std::path::Path;
use std::process::Command;

/// Where scripts/deps.sh installs kubernetes-validate (a venv of its own: Debian's Python
/// refuses system-wide pip installs).
const PYTHON: &str = "/opt/vrdma/kubernetes-validate/bin/python3";

#[test]
fn deployment_manifests_validate_against_kubernetes_schemas() {
    let test = "deployment_manifests_validate_against_kubernetes_schemas";
    if !vrdma_test_support::require_files(test, &[PYTHON], "scripts/deps.sh: a venv with PyPI's kubernetes-validate") {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let out = Command::new(PYTHON).arg(dir.join("validate.py")).arg(&dir).output().expect("run validate.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the manifests do not validate:\n{text}");
    assert!(text.contains(" passed, 0 failed"), "validate.py checked nothing:\n{text}");
}
