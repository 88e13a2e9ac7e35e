//! MPI applications over the drop-in between two `vrdma run` containers (mpirun on the host,
//! its rsh agent `vrdma run`, as dropin.rs's `mpi_runs_over_the_vnic`): the benchmark apps of
//! scripts/bench-apps.sh (bench/apps/) build and run correctly, each checking its own results.
//!
//! - fresh_buffers: every message in a buffer allocated for it and freed after it (malloc, and
//!   mmap/munmap), every byte checked on the receiver, over UCX's rc_verbs, whose rendezvous
//!   registers the buffers through UCX's registration cache: the cache must see each free or
//!   munmap and never reuse a registration for new memory at the same address. Then
//!   fresh_alltoallv: Graph-500's exchange alone, fresh buffers around every
//!   `MPI_Alltoallv` (16 KiB to 4 MiB to each rank), every byte checked; then exchange: the
//!   same buffers throughout (ping-pong and both ranks at once, 8 B to 4 MiB), every
//!   message's number and every block's bytes checked.
//! - graph500: our Graph-500-style BFS and SSSP, every root's result validated as the
//!   specification asks, over Open MPI's UCX with UCX's defaults.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// The runs share two CPUs with everything else: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn missing_prerequisites(test: &str) -> bool {
    !vrdma_test_support::require_root(test) || mpi_missing(test)
}

/// A vrdmad with two vNICs (names and addresses of these tests only) and the rsh agent.
struct Pair {
    d: Daemon,
    lib: PathBuf,
    agent: PathBuf,
    vnics: [String; 2],
}

impl Pair {
    fn new(tag: &str, names: [&str; 2], ips: [&str; 2]) -> Pair {
        let d = Daemon::start(tag);
        let lib = d.dir.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(dropin_so(), lib.join("libibverbs.so.1")).unwrap();
        for (n, ip) in names.iter().zip(ips) {
            d.ok(&["vnic", "create", n, "--tenant", "apps", "--ip", &format!("{ip}/15")]);
        }
        let agent = d.dir.join("vrdma-rsh");
        write_script(&agent, &format!("#!/bin/sh\nhost=$1; shift\nexec {VRDMA} run --vnic \"$host\" -- sh -c \"$*\"\n"));
        Pair { d, lib, agent, vnics: names.map(String::from) }
    }

    /// `mpirun -np 2` with one rank in each container; `mpi` are mpirun's transport options.
    fn mpirun(&self, mpi: &[&str], app: &[&str], limit: Duration) -> (bool, String) {
        let hosts = self.vnics.join(",");
        let child = Command::new("mpirun")
            .args(["--mca", "plm_rsh_agent"])
            .arg(&self.agent)
            .args(["--host", &hosts, "-np", "2", "--bind-to", "none", "--mca", "oob_tcp_if_include", "198.18.0.0/15"])
            .args(mpi)
            .args(app)
            .env("VRDMA_LIB_DIR", &self.lib)
            .envs(self.d.vrdma().get_envs().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_output(child, limit)
    }

    /// As `mpirun`, once more if the first run fails (a loaded machine stalls container runs
    /// now and then; a wrong result fails both).
    fn mpirun_retry(&self, mpi: &[&str], app: &[&str], limit: Duration, ok: impl Fn(&str) -> bool) -> (bool, String) {
        let (good, out) = self.mpirun(mpi, app, limit);
        if good && ok(&out) {
            return (true, out);
        }
        eprintln!("{app:?} failed once; again. Its output:\n{out}");
        let (good, out2) = self.mpirun(mpi, app, limit);
        (good && ok(&out2), format!("{out}\n--- second run:\n{out2}"))
    }
}

/// bench/apps/NAME.c built with mpicc into `dir`.
fn build_app(dir: &Path, name: &str) -> PathBuf {
    mpicc(dir, name, name, &["-lm"])
}

/// bench/apps/NAME.c built with mpicc and `flags` into `dir/out`.
fn mpicc(dir: &Path, name: &str, out: &str, flags: &[&str]) -> PathBuf {
    let target = dir.join(out);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../bench/apps/{name}.c"));
    let cc = Command::new("mpicc").args(["-O2", "-Wall", "-o"]).arg(&target).arg(&src).args(flags).output().unwrap();
    assert!(cc.status.success(), "mpicc {name}: {}", String::from_utf8_lossy(&cc.stderr));
    target
}

#[test]
fn mpi_with_buffers_freed_between_sends_checks_every_byte() {
    if missing_prerequisites("mpi_with_buffers_freed_between_sends_checks_every_byte") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = Pair::new("apps-fresh", ["fba", "fbb"], ["198.18.76.2", "198.18.76.3"]);
    let exe = build_app(&p.d.dir, "fresh_buffers");
    let exe = exe.to_str().unwrap();
    // Sizes up to 4 MiB: UCX's eager copies below its rendezvous threshold, RDMA READ of
    // registered buffers above it; a window of 8 fresh buffers in flight per step.
    for alloc in ["-a", "-M"] {
        let app = [exe, alloc, "-i", "6", "-w", "8", "-m", "4194304"];
        let out = checked_run(&p, &format!("fresh_buffers {alloc}"), &app, "fresh buffers: all checked", "size ");
        for v in &p.vnics {
            assert!(out.contains(&format!("tag(rc_verbs/vrdma_{v}:1")), "fresh_buffers {alloc}: not over rc_verbs on {v}:\n{out}");
        }
    }
    let exe = build_app(&p.d.dir, "fresh_alltoallv");
    checked_run(&p, "fresh_alltoallv", &[exe.to_str().unwrap(), "-i", "6", "-m", "4194304"], "fresh alltoallv: all checked", "alltoallv ");
    // And the other way round: the same buffers for every message (registration-cache hits),
    // each message stamped with its number and every block's bytes checked.
    let exe = build_app(&p.d.dir, "exchange");
    checked_run(&p, "exchange", &[exe.to_str().unwrap(), "-i", "200", "-m", "4194304"], "exchange: all checked", "exchange ");
}

/// Runs `app` over UCX between the pair, which must print `all_checked`; shows its figures
/// (the lines starting with `figures`) under `what`, and returns its output.
fn checked_run(p: &Pair, what: &str, app: &[&str], all_checked: &str, figures: &str) -> String {
    let (ok, out) = p.mpirun_retry(&MPI_OVER_UCX, app, Duration::from_secs(300), |o| o.contains(all_checked));
    assert!(ok, "{what} failed:\n{out}\n{}", p.d.log());
    for l in out.lines().filter(|l| l.starts_with(figures)) {
        eprintln!("ok: {what}: {l}");
    }
    out
}

#[test]
fn graph500_bfs_and_sssp_validate_over_ucx_defaults() {
    if missing_prerequisites("graph500_bfs_and_sssp_validate_over_ucx_defaults") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = Pair::new("apps-g500", ["gva", "gvb"], ["198.18.76.4", "198.18.76.5"]);
    let exe = build_app(&p.d.dir, "graph500");
    // Through bench-apps.sh's SIZES_PROFILE library too (PMPI wrappers timing the exchanges
    // by size), which must leave the results alone.
    let sizes = mpicc(&p.d.dir, "mpi_sizes", "libmpi_sizes.so", &["-shared", "-fPIC"]);
    let preload = format!("LD_PRELOAD={}", sizes.display());
    let mpi: Vec<&str> = "--mca pml ucx --mca osc ucx --mca btl self -x UCX_LOG_LEVEL=info --allow-run-as-root -x"
        .split(' ')
        .chain([preload.as_str()])
        .collect();
    let app = [exe.to_str().unwrap(), "-s", "13", "-n", "4"];
    let (ok, out) = p.mpirun_retry(&mpi, &app, Duration::from_secs(300), |o| o.contains("graph500: validation passed"));
    assert!(ok, "graph500 failed:\n{out}\n{}", p.d.log());
    assert!(out.contains("mpi_sizes: alltoallv") && out.contains("mpi_sizes: allreduce"), "no exchange times by size:\n{out}");
    // UCX's defaults pick rc_verbs on the vNICs for the ranks' tagged messages.
    for v in &p.vnics {
        assert!(out.contains(&format!("rc_verbs/vrdma_{v}:1")), "graph500: UCX did not use rc_verbs on {v}:\n{out}");
    }
    for l in out.lines().filter(|l| l.contains("TEPS") || l.starts_with("construction")) {
        eprintln!("ok: graph500 s13: {l}");
    }
}
