//! The CDI (Container Device Interface) spec of this host's vNICs, kind [`KIND`]
//! (DESIGN §5): podman ≥ 4.1, CRI-O, containerd ≥ 1.7 and Docker ≥ 25 read it from
//! [`DEFAULT_SPEC_DIR`] and apply a device's edits on `--device vrdma.io/vnic=NAME`.
//!
//! A device gives the container what `vrdma run` gives it: the vNIC's directory at
//! `/run/vrdma` (and nothing else of vrdma), the drop-in libibverbs read-only and first on
//! the loader's path, `/dev/infiniband/vrdma_<vnic>`, and the library's environment (see
//! [`generate`]). vrdmad keeps the spec current; `vrdma cdi generate` writes it for static
//! use. Both go through [`write_spec`], so they write the same file.

mod error;
pub mod generate;
pub mod spec;
mod write;

pub use error::CdiError;
pub use generate::{
    device_for, edits_for, find_dropin, is_valid_device_name, spec_for, DropIn, VnicDevice, CONTAINER_LIB_DIR, CONTAINER_VNIC_DIR,
    DROPIN_FILE, UCX_TUNING,
};
pub use spec::{ContainerEdits, Device, DeviceNode, Mount, Spec};
pub use write::{spec_path, write_spec, write_spec_file};

/// The CDI kind of vNICs: `--device vrdma.io/vnic=NAME`.
pub const KIND: &str = "vrdma.io/vnic";

/// The spec version written: the lowest one that has every field the spec uses (device
/// node `hostPath` and device names starting with a digit came in 0.5.0). It is what the
/// CDI library's own `MinimumRequiredVersion` gives for this spec, and runtimes read any
/// version up to theirs: podman 4.3 (Debian 12) knows versions up to 0.5.0 and refuses
/// newer ones, while the current spec (1.1.0) still accepts 0.5.0 documents.
pub const CDI_VERSION: &str = "0.5.0";

/// Where runtimes look for generated (as opposed to installed) specs.
pub const DEFAULT_SPEC_DIR: &str = "/var/run/cdi";

/// The spec's file name in the spec directory (`<vendor>-<class>.json`, the CDI convention).
pub const SPEC_FILE: &str = "vrdma.io-vnic.json";
