//! A real vrdmad process with a private run and state directory, driven through the real
//! `vrdma` binary, for end-to-end tests.

#![allow(dead_code)]

pub(crate) mod cluster;
pub(crate) mod perf;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
pub(crate) const VRDMAD: &str = env!("CARGO_BIN_EXE_vrdmad");

// Not every test file uses it (as with the rest of this module: `dead_code` above).
#[allow(unused_imports)]
pub(crate) use vrdma_test_support::is_root;

pub(crate) struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
}

impl Daemon {
    pub(crate) fn start(tag: &str) -> Daemon {
        Daemon::start_with(tag, &[])
    }

    /// As `start`, with more vrdmad options.
    pub(crate) fn start_with(tag: &str, args: &[&str]) -> Daemon {
        let dir = std::env::temp_dir().join(format!("vrdma-e2e-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(VRDMAD)
            .args(["--run-dir", dir.join("run").to_str().unwrap(), "--state-dir", dir.join("state").to_str().unwrap()])
            .args(args)
            .env("RUST_LOG", "warn")
            // The test's own CDI spec directory, not the host's /var/run/cdi (`--cdi-dir` wins).
            .env("VRDMA_CDI_DIR", dir.join("cdi"))
            .stderr(std::fs::File::create(dir.join("vrdmad.log")).unwrap())
            .spawn()
            .expect("start vrdmad");
        let d = Daemon { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.run_dir().join("admin.sock").exists() {
            assert!(Instant::now() < deadline, "vrdmad did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub(crate) fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    pub(crate) fn vrdma(&self) -> Command {
        let mut c = Command::new(VRDMA);
        c.env("VRDMA_RUN_DIR", self.run_dir()).env("VRDMA_STATE_DIR", self.dir.join("state")).env("RUST_BACKTRACE", "0");
        c
    }

    pub(crate) fn ok(&self, args: &[&str]) -> String {
        let o = self.vrdma().args(args).output().unwrap();
        assert!(o.status.success(), "vrdma {args:?} failed: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    pub(crate) fn socket(&self, vnic: &str) -> PathBuf {
        self.run_dir().join("vnics").join(vnic).join("control.sock")
    }

    /// `vrdma vnic list --json` as a value.
    pub(crate) fn list(&self) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["vnic", "list", "--json"])).unwrap()
    }

    pub(crate) fn vnic(&self, name: &str) -> serde_json::Value {
        self.list().as_array().unwrap().iter().find(|v| v["vnic"]["name"] == name).cloned().expect("vnic listed")
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("vrdmad.log")).unwrap_or_default()
    }

    /// Spawns `vrdma run --vnic VNIC -- ARGS`.
    pub(crate) fn container(&self, vnic: &str, args: &[&str]) -> Child {
        self.vrdma().args(["run", "--vnic", vnic, "--"]).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    }

    /// CPU time (user+system) vrdmad used so far.
    pub(crate) fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the command name.
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // SAFETY: sysconf has no memory effects.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        Duration::from_millis(ticks * 1000 / hz)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn wait_output(mut c: Child, limit: Duration) -> (bool, String) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            let o = c.wait_with_output().unwrap();
            return (st.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
        }
        if Instant::now() > deadline {
            let stacks = process_tree_stacks(c.id());
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            return (
                false,
                format!(
                    "TIMED OUT\n{}{}\n-- where it hung --\n{stacks}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every process under `root` (itself included) with its threads' kernel wait channels and,
/// when gdb is installed, their user-space backtraces: what a timed-out test prints so that
/// a hang explains itself.
pub(crate) fn process_tree_stacks(root: u32) -> String {
    let mut pids = vec![root];
    let mut i = 0;
    while i < pids.len() {
        let parent = pids[i];
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rfind(')').and_then(|at| stat[at + 2..].split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(parent) && !pids.contains(&pid) {
                pids.push(pid);
            }
        }
        i += 1;
    }
    let gdb = std::path::Path::new("/usr/bin/gdb").exists();
    let mut out = String::new();
    for pid in pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        out.push_str(&format!("pid {pid}: {cmdline}\n"));
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let tid = t.file_name().to_string_lossy().into_owned();
            let rd = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{f}")).unwrap_or_default();
            out.push_str(&format!("  thread {tid} {}: wchan {} syscall {}\n", rd("comm").trim(), rd("wchan").trim(), rd("syscall").trim()));
        }
        if gdb {
            if let Ok(o) = Command::new("gdb").args(["-batch", "-p", &pid.to_string(), "-ex", "thread apply all bt 12"]).output() {
                let bt = String::from_utf8_lossy(&o.stdout);
                // Frames of the runtime's entry and thread start say nothing about a hang.
                let noise = ["std::", "core::", "alloc::", "__libc_start", "_start ()", "start_thread", "clone3"];
                for l in bt.lines().filter(|l| (l.starts_with('#') && !noise.iter().any(|n| l.contains(n))) || l.starts_with("Thread")) {
                    out.push_str(&format!("    {l}\n"));
                }
            }
        }
    }
    out
}

/// The newest build of the drop-in libibverbs (release or deps copy).
pub(crate) fn dropin_so() -> PathBuf {
    let release = PathBuf::from(VRDMA).parent().unwrap().to_path_buf();
    let cands = [release.join("libvrdma_ibverbs.so"), release.join("deps").join("libvrdma_ibverbs.so")];
    cands
        .iter()
        .filter_map(|p| Some((std::fs::metadata(p).ok()?.modified().ok()?, p.clone())))
        .max()
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("the drop-in is not built: run `cargo build --release -p vrdma-ibverbs` (looked for {cands:?})"))
}

/// perftest's and ibv_*_pingpong's device identity for the "new work-request API" runs:
/// perftest uses `ibv_wr_*` (and inline data) only on devices it recognises (ConnectX-4 and
/// later, EFA); with vrdma's own vendor ID it falls back to `ibv_post_send`.
pub(crate) const CONNECTX5: [&str; 4] = ["-e", "VRDMA_IBV_VENDOR_ID=0x02c9", "-e", "VRDMA_IBV_VENDOR_PART_ID=4119"];

/// mpirun's options (as root) for UCX on vNICs only (ud_verbs is rc_verbs' wireup
/// transport); UCX's log names the transport of each endpoint's tagged messages.
pub(crate) const MPI_OVER_UCX: [&str; 14] = [
    "--mca",
    "pml",
    "ucx",
    "--mca",
    "osc",
    "ucx",
    "--mca",
    "btl",
    "self",
    "-x",
    "UCX_TLS=rc_verbs,ud_verbs,self",
    "-x",
    "UCX_LOG_LEVEL=info",
    "--allow-run-as-root",
];

/// Whether Open MPI is missing (then `test` is skipped, saying why, or fails under CI).
pub(crate) fn mpi_missing(test: &str) -> bool {
    !vrdma_test_support::require_programs(test, &["mpicc", "mpirun"], "openmpi-bin libopenmpi-dev")
}

/// crates/vrdma-ibverbs/tests/mpi_pingpong.c built with mpicc into `dir`.
pub(crate) fn build_mpi_pingpong(dir: &Path) -> PathBuf {
    let exe = dir.join("mpi_pingpong");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vrdma-ibverbs/tests/mpi_pingpong.c");
    let cc = Command::new("mpicc").args(["-O2", "-Wall", "-o"]).arg(&exe).arg(&src).output().unwrap();
    assert!(cc.status.success(), "mpicc: {}", String::from_utf8_lossy(&cc.stderr));
    exe
}

/// mpi_pingpong's run `what` succeeded with every message checked, its tagged messages over
/// rc_verbs on each of `vnics`; prints its figures. `context` (logs) goes with a failure.
pub(crate) fn check_mpi_pingpong(what: &str, ok: bool, out: &str, vnics: &[&str], context: &str) {
    assert!(ok && out.contains("mpi over vrdma: all checked"), "MPI {what} failed:\n{out}\n{context}");
    for v in vnics {
        assert!(out.contains(&format!("tag(rc_verbs/vrdma_{v}:1")), "MPI {what}: messages did not go over rc_verbs on {v}:\n{out}");
    }
    for l in out.lines().filter(|l| l.starts_with("size ")) {
        eprintln!("ok: mpi {what}: {l}");
    }
}

/// Writes an executable script (an rsh agent).
pub(crate) fn write_script(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// What a client/server pair of commands did: each side's success and output.
pub(crate) struct Outcome {
    pub(crate) ok_c: bool,
    pub(crate) out_c: String,
    pub(crate) ok_s: bool,
    pub(crate) out_s: String,
    pub(crate) what: String,
}

impl Outcome {
    /// Both sides succeeded and printed `needle`.
    pub(crate) fn assert_ok(&self, needle: &str) {
        assert!(
            self.ok_c && self.ok_s && self.out_c.contains(needle) && self.out_s.contains(needle),
            "{} failed\n--- client:\n{}\n--- server:\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        let result = |l: &&str| l.contains(needle) && (needle != " " || l.trim_start().starts_with(|c: char| c.is_ascii_digit()));
        eprintln!("ok: {}: {}", self.what, self.out_c.lines().rfind(result).unwrap_or_default().trim());
    }

    /// Both sides failed, promptly, with the tenant refusal.
    pub(crate) fn assert_refused(&self) {
        assert!(!self.ok_c && !self.ok_s, "{}: a cross-tenant run must fail\n{}\n{}", self.what, self.out_c, self.out_s);
        assert!(
            !self.out_c.contains("TIMED OUT") && !self.out_s.contains("TIMED OUT"),
            "{}: hung\n{}\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        assert!(
            self.out_c.contains("may not connect to tenant") || self.out_s.contains("may not connect to tenant"),
            "{}: no clear error\n{}\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        eprintln!("ok: {}: refused", self.what);
    }
}
