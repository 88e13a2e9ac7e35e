//! The drop-in under unmodified binaries, without containers (no root needed): an in-process
//! vrdmad, host processes with `LD_LIBRARY_PATH` at a copy of this build's cdylib and
//! `VRDMA_SOCKET` at a vNIC, out-of-band exchange on 127.0.0.1. (The container runs are in
//! crates/vrdma-cli/tests/dropin.rs.)

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Two CPUs, busy-polling programs: one pair at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct Host {
    daemon: Arc<vrdmad::Daemon>,
    dir: PathBuf,
    lib: PathBuf,
}

impl Host {
    fn new(tag: &str) -> Host {
        let dir = std::env::temp_dir().join(format!("vrdma-ibv-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = vrdmad::Config { run_dir: dir.join("run"), state_dir: dir.join("state"), ..Default::default() };
        let daemon = vrdmad::Daemon::start(cfg).expect("daemon starts");
        // The cdylib of this very build sits next to the test executable.
        let so = std::env::current_exe().unwrap().parent().unwrap().join("libvrdma_ibverbs.so");
        assert!(so.exists(), "{} is missing", so.display());
        let lib = dir.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(&so, lib.join("libibverbs.so.1")).unwrap();
        Host { daemon, dir, lib }
    }

    fn vnic(&self, name: &str, tenant: &str) -> PathBuf {
        self.daemon.create_vnic(name, tenant, None, None).expect("vnic");
        self.daemon.vnic_dir(name).join("control.sock")
    }

    fn cmd(&self, sock: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(args[0]);
        c.args(&args[1..]).env("LD_LIBRARY_PATH", &self.lib).env("VRDMA_SOCKET", sock).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    /// Server `args -p PORT` on `srv`, client `args -p PORT 127.0.0.1` on `cli`.
    fn pair(&self, srv: &Path, cli: &Path, args: &[&str], port: u16) -> (bool, String, bool, String) {
        let p = port.to_string();
        let server = self.cmd(srv, &[args, &["-p", &p]].concat()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let client = self.cmd(cli, &[args, &["-p", &p, "127.0.0.1"]].concat()).spawn().unwrap();
        let (ok_c, out_c) = wait(client, Duration::from_secs(120));
        let (ok_s, out_s) = wait(server, Duration::from_secs(30));
        (ok_c, out_c, ok_s, out_s)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait(mut c: Child, limit: Duration) -> (bool, String) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            let o = c.wait_with_output().unwrap();
            return (st.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            return (false, format!("TIMED OUT\n{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ok_pair(r: (bool, String, bool, String), needle: &str, what: &str) {
    let (ok_c, out_c, ok_s, out_s) = r;
    assert!(ok_c && ok_s && out_c.contains(needle) && out_s.contains(needle), "{what}\n--- client:\n{out_c}\n--- server:\n{out_s}");
}

/// Builds `tests/NAME.c` against Debian's libibverbs into the host's directory; None (after
/// the prerequisite check's verdict) when gcc or the headers are missing.
fn build_c_test(h: &Host, test: &str, name: &str, extra: &[&str]) -> Option<PathBuf> {
    if !vrdma_test_support::require_programs(test, &["gcc"], "gcc")
        || !vrdma_test_support::require_files(test, &["/usr/include/infiniband/verbs.h"], "libibverbs-dev")
    {
        return None;
    }
    let exe = h.dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/{name}.c"));
    // Linked against Debian's libibverbs, run over the drop-in: an unmodified binary.
    let cc = Command::new("gcc").arg("-O1").args(extra).arg("-o").arg(&exe).arg(&src).arg("-libverbs").arg("-pthread").output().unwrap();
    assert!(cc.status.success(), "gcc: {}", String::from_utf8_lossy(&cc.stderr));
    Some(exe)
}

#[test]
fn c_program_sees_verbs_semantics() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new("c");
    let Some(exe) = build_c_test(&h, "c_program_sees_verbs_semantics", "verbs_semantics", &[]) else { return };
    let sock = h.vnic("a", "t");
    let (ok, out) = wait(h.cmd(&sock, &[exe.to_str().unwrap()]).env("SOCK_A", &sock).spawn().unwrap(), Duration::from_secs(60));
    assert!(ok && out.contains("ALL OK"), "{out}");
}

/// Registration caches (UCX's, Open MPI's) drop an entry when their mmap/munmap/mremap hooks
/// see its memory change. Registering, deregistering and registering again a written buffer
/// must not show up there at all, or every rendezvous registers (and moves) its buffer anew.
#[test]
fn registration_is_invisible_to_memory_hooks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new("hooks");
    let Some(exe) = build_c_test(&h, "registration_is_invisible_to_memory_hooks", "memory_hooks", &["-rdynamic"]) else { return };
    let sock = h.vnic("a", "t");
    let (ok, out) = wait(h.cmd(&sock, &[exe.to_str().unwrap()]).spawn().unwrap(), Duration::from_secs(60));
    assert!(ok && out.contains("ALL OK"), "{out}");
}

#[test]
fn ibverbs_utils() {
    if !vrdma_test_support::require_programs("ibverbs_utils", &["ibv_rc_pingpong"], "ibverbs-utils") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new("utils");
    let (a, b, c) = (h.vnic("a", "blue"), h.vnic("b", "blue"), h.vnic("c", "red"));
    let (ok, out) = wait(h.cmd(&a, &["ibv_devinfo", "-v"]).spawn().unwrap(), Duration::from_secs(20));
    assert!(ok && out.contains("vrdma_a") && out.contains("PORT_ACTIVE") && out.contains("Ethernet") && out.contains("RoCE v2"), "{out}");
    ok_pair(h.pair(&a, &b, &["ibv_rc_pingpong", "-g", "0", "-n", "200", "-c"], 20501), "200 iters", "rc_pingpong -c");
    ok_pair(h.pair(&a, &b, &["ibv_rc_pingpong", "-g", "0", "-n", "200", "-e", "-N"], 20502), "200 iters", "rc_pingpong -e -N");
    ok_pair(h.pair(&a, &b, &["ibv_srq_pingpong", "-g", "0", "-n", "200"], 20503), "200 iters", "srq_pingpong");
    ok_pair(h.pair(&a, &b, &["ibv_ud_pingpong", "-g", "0", "-n", "200", "-c"], 20504), "200 iters", "ud_pingpong");
    // Across tenants: refused, both exit non-zero, nobody hangs.
    let (ok_c, out_c, ok_s, out_s) = h.pair(&a, &c, &["ibv_rc_pingpong", "-g", "0"], 20505);
    assert!(!ok_c && !ok_s && !out_c.contains("TIMED OUT") && !out_s.contains("TIMED OUT"), "{out_c}\n{out_s}");
    assert!(out_s.contains("tenant blue may not connect to tenant red"), "{out_s}");
    let (ok_c, out_c, ok_s, out_s) = h.pair(&a, &c, &["ibv_ud_pingpong", "-g", "0"], 20506);
    assert!(!ok_c && !ok_s && !out_c.contains("TIMED OUT") && out_s.contains("Failed to create AH"), "{out_c}\n{out_s}");
}

#[test]
fn perftest_smoke() {
    if !vrdma_test_support::require_programs("perftest_smoke", &["ib_write_bw"], "perftest") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new("perftest");
    let (a, b) = (h.vnic("a", "t"), h.vnic("b", "t"));
    let mut port = 20520;
    for test in ["ib_send_lat", "ib_write_lat", "ib_read_lat", "ib_atomic_lat", "ib_send_bw", "ib_write_bw", "ib_read_bw", "ib_atomic_bw"] {
        for extra in [&[][..], &["--use_old_post_send"][..]] {
            port += 1;
            let args = [&[test, "-x", "0", "-n", "200"][..], extra].concat();
            let (ok_c, out_c, ok_s, out_s) = h.pair(&a, &b, &args, port);
            assert!(ok_c && ok_s, "{args:?}\n--- client:\n{out_c}\n--- server:\n{out_s}");
            assert!(out_c.lines().any(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())), "{args:?}: no results\n{out_c}");
        }
    }
}
