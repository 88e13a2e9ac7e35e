//! `vrdma cdi generate`: this host's CDI spec (kind vrdma.io/vnic), made from vrdmad's vNIC
//! list exactly as vrdmad keeps it in /var/run/cdi, for static use (e.g. in /etc/cdi, or
//! for a host whose vrdmad runs with `--cdi-dir none`).

use anyhow::{bail, Context as _};
use clap::Subcommand;
use std::path::PathBuf;

use crate::admin;

/// `vrdma cdi …`.
#[derive(Subcommand)]
pub(crate) enum CdiCmd {
    /// Write the CDI spec of the vNICs this host serves (to stdout without --output).
    Generate {
        /// The file to write (atomically: a temporary file renamed over it).
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

/// Runs a `vrdma cdi` command.
pub(crate) fn run(cmd: CdiCmd) -> anyhow::Result<()> {
    let CdiCmd::Generate { output } = cmd;
    let list = admin::call(serde_json::json!({"op": "list"}))?;
    let vnics: Vec<vrdma_cdi::VnicDevice> = list["vnics"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["local"] == true)
        .filter_map(|v| Some(vrdma_cdi::VnicDevice { name: v["vnic"]["name"].as_str()?.into(), dir: v["dir"].as_str()?.into() }))
        .collect();
    for v in vnics.iter().filter(|v| !vrdma_cdi::is_valid_device_name(&v.name)) {
        eprintln!("note: vNIC {} gets no CDI device (CDI names begin and end with a letter or digit)", v.name);
    }
    let exe = std::env::current_exe().ok();
    let dropin = vrdma_cdi::find_dropin(exe.as_deref());
    if dropin.is_none() {
        eprintln!("note: no drop-in libibverbs installed (scripts/install-dropin.sh, or VRDMA_LIB_DIR): the spec mounts no verbs library");
    }
    let Some(spec) = vrdma_cdi::spec_for(&vnics, dropin.as_ref()) else {
        bail!("this host serves no vNIC with a CDI name: a CDI spec needs at least one device (`vrdma vnic create`)");
    };
    match output {
        Some(path) => {
            vrdma_cdi::write_spec_file(&path, Some(&spec))?;
            eprintln!("wrote {} ({} device(s) of kind {})", path.display(), spec.devices.len(), vrdma_cdi::KIND);
        }
        None => println!("{}", serde_json::to_string_pretty(&spec).context("encoding the spec")?),
    }
    Ok(())
}
