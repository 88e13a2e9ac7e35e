//! Generates the kubelet's device plugin API (v1beta1) and pod resources API (v1) from the
//! vendored protos: servers and clients of every service, so the tests' kubelet uses the
//! same published definitions as the plugin.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/deviceplugin/v1beta1/api.proto", "proto/podresources/v1/api.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&protos, &["proto"])?;
    Ok(())
}
