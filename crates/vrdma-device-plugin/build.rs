//! Generates the kubelet's device plugin API (v1beta1) from the vendored proto: server and
//! client for both services, so the tests' kubelet uses the same published definitions.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/api.proto");
    tonic_prost_build::configure().compile_protos(&["proto/api.proto"], &["proto"])?;
    Ok(())
}
