//! Keeps this host's CDI spec (`<cdi_dir>/vrdma.io-vnic.json`, see the vrdma-cdi crate)
//! listing exactly the vNICs this daemon serves, so `--device vrdma.io/vnic=NAME` works in
//! podman, containerd, CRI-O and Docker as soon as a vNIC is served here, and stops with it.

use crate::server::Daemon;

impl Daemon {
    /// Rewrites the spec if the served vNICs changed (a no-op without `cdi_dir`). Failures
    /// are logged: the vNICs work regardless, and the next change tries again.
    pub(crate) fn sync_cdi(&self) {
        let Some(dir) = &self.cfg.cdi_dir else { return };
        // Absolute: runtimes resolve the spec's paths from their own working directory.
        let dir_of = |name: &str| std::path::absolute(self.vnic_dir(name)).unwrap_or_else(|_| self.vnic_dir(name));
        let vnics: Vec<vrdma_cdi::VnicDevice> =
            self.status().into_iter().map(|s| vrdma_cdi::VnicDevice { dir: dir_of(&s.record.name), name: s.record.name }).collect();
        let spec = vrdma_cdi::spec_for(&vnics, self.cfg.cdi_dropin.as_ref());
        match vrdma_cdi::write_spec(dir, spec.as_ref()) {
            Ok(true) => {
                log::info!("CDI spec {}: {} vNIC device(s)", vrdma_cdi::spec_path(dir).display(), spec.map_or(0, |s| s.devices.len()))
            }
            Ok(false) => {}
            Err(e) => log::error!("{e}"),
        }
    }
}
