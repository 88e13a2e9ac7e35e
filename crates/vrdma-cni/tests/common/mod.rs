//! The real `vrdma-cni` binary driven as a runtime drives it, against a real vrdmad with a
//! private run and state directory, on real network namespaces (root only).
//!
//! Names are unique per test process: namespaces `cni-<pid>-<tag>`, vNICs `cni<pid><tag>`,
//! container IDs `cnitest-<pid>-<tag>`; addresses are 198.19.<100 + pid % 100>.<n> (each
//! test its own n), so parallel runs from other worktrees on the shared bridge vrdma0 do not
//! meet ours.

#![allow(dead_code)]

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const CNI: &str = env!("CARGO_BIN_EXE_vrdma-cni");

/// A binary of the vrdma-cli package, built beside ours (`cargo build -p vrdma-cli --bins`).
pub fn sibling_binary(name: &str) -> PathBuf {
    Path::new(CNI).parent().expect("the binary's directory").join(name)
}

/// Root, iproute2 and vrdma-cli's binaries are there; else the test is skipped (or fails
/// under CI).
pub fn prerequisites(test: &str) -> bool {
    if !vrdma_test_support::require_root(test) {
        return false;
    }
    let vrdmad = sibling_binary("vrdmad");
    let vrdma = sibling_binary("vrdma");
    vrdma_test_support::require_files(test, &["/usr/sbin/ip"], "iproute2")
        && vrdma_test_support::require_files(
            test,
            &[vrdmad.to_str().unwrap(), vrdma.to_str().unwrap()],
            "them with `cargo build -p vrdma-cli --bins` (same profile)",
        )
}

/// This process's third octet.
pub fn octet() -> u8 {
    100 + (std::process::id() % 100) as u8
}

/// 198.19.<octet>.<n>.
pub fn addr(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, octet(), n)
}

pub fn vnic_name(tag: &str) -> String {
    format!("cni{}{tag}", std::process::id())
}

pub fn container_id(tag: &str) -> String {
    format!("cnitest-{}-{tag}", std::process::id())
}

pub struct Daemon {
    child: Child,
    pub dir: PathBuf,
}

impl Daemon {
    pub fn start(tag: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("vrdma-cni-e2e-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(sibling_binary("vrdmad"))
            .args(["--run-dir", dir.join("run").to_str().unwrap(), "--state-dir", dir.join("state").to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stderr(std::fs::File::create(dir.join("vrdmad.log")).unwrap())
            .spawn()
            .expect("start vrdmad");
        let d = Daemon { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.admin_socket().exists() {
            assert!(Instant::now() < deadline, "vrdmad did not start: {}", d.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn admin_socket(&self) -> PathBuf {
        self.dir.join("run/admin.sock")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("cni-state")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("vrdmad.log")).unwrap_or_default()
    }

    pub fn vrdma(&self) -> Command {
        let mut c = Command::new(sibling_binary("vrdma"));
        c.env("VRDMA_RUN_DIR", self.dir.join("run")).env("RUST_BACKTRACE", "0");
        c
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.vrdma().args(args).output().unwrap();
        assert!(o.status.success(), "vrdma {args:?}: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Creates vNIC `name` of `tenant` at `ip`.
    pub fn create_vnic(&self, name: &str, tenant: &str, ip: Ipv4Addr) {
        self.ok(&["vnic", "create", name, "--tenant", tenant, "--ip", &format!("{ip}/15")]);
    }

    /// vrdmad's vNICs: name → tenant.
    pub fn vnics(&self) -> Vec<(String, String)> {
        let v: Value = serde_json::from_str(&self.ok(&["vnic", "list", "--json"])).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| (e["vnic"]["name"].as_str().unwrap().into(), e["vnic"]["tenant"].as_str().unwrap().into()))
            .collect()
    }

    /// A network configuration with our admin socket and state directory, plus `extra`.
    pub fn conf(&self, extra: Value) -> Value {
        let mut c = json!({
            "cniVersion": "1.1.0",
            "name": "vrdma-test",
            "type": "vrdma-cni",
            "adminSocket": self.admin_socket(),
            "stateDir": self.state_dir(),
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// Files left in the plugin's state directory for the test network.
    pub fn records(&self) -> Vec<String> {
        std::fs::read_dir(self.state_dir().join("vrdma-test"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("cni-{}-{tag}", std::process::id());
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name]).expect("ip netns add");
        Netns { name }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// `ip -n NS ARGS`.
    pub fn ip(&self, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Interface names in the namespace.
    pub fn links(&self) -> Vec<String> {
        self.ip(&["-o", "link", "show"])
            .unwrap()
            .lines()
            .filter_map(|l| l.split(": ").nth(1).map(|n| n.split('@').next().unwrap().to_string()))
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

pub fn ip(args: &[&str]) -> Result<String, String> {
    let o = Command::new("/usr/sbin/ip").args(args).output().map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// Whether host link `name` exists.
pub fn host_link_exists(name: &str) -> bool {
    ip(&["link", "show", "dev", name]).is_ok()
}

/// One plugin invocation's answer.
#[derive(Debug)]
pub struct Answer {
    pub ok: bool,
    /// stdout as JSON (Null when empty).
    pub json: Value,
    pub stderr: String,
}

impl Answer {
    /// The error code of a failed invocation.
    pub fn code(&self) -> u64 {
        assert!(!self.ok, "expected an error, got success: {}", self.json);
        assert!(self.json["msg"].is_string() && self.json["details"].is_string(), "not a CNI error: {}", self.json);
        self.json["code"].as_u64().unwrap_or_else(|| panic!("no code in {}", self.json))
    }
}

/// Runs the plugin: `vars` are CNI_* variables (CNI_PATH is added), `conf` goes to stdin.
pub fn invoke(vars: &[(&str, &str)], conf: &Value) -> Answer {
    let mut child = Command::new(CNI)
        .env_clear()
        .env("CNI_PATH", Path::new(CNI).parent().unwrap())
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(vars.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Started without CNI_COMMAND the plugin does not read stdin (a person may have started
    // it): a broken pipe is fine then, as it is for Go's os/exec.
    let _ = child.stdin.take().unwrap().write_all(conf.to_string().as_bytes());
    let o = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let json = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {text}"))
    };
    Answer { ok: o.status.success(), json, stderr: String::from_utf8_lossy(&o.stderr).into_owned() }
}

/// CNI_COMMAND `command` for (container, netns, ifname), with `args` as CNI_ARGS.
pub fn attachment(command: &str, cid: &str, netns: Option<&Netns>, ifname: &str, args: &str, conf: &Value) -> Answer {
    let path = netns.map(Netns::path);
    let mut vars = vec![("CNI_COMMAND", command), ("CNI_CONTAINERID", cid), ("CNI_IFNAME", ifname)];
    if let Some(p) = &path {
        vars.push(("CNI_NETNS", p));
    }
    if !args.is_empty() {
        vars.push(("CNI_ARGS", args));
    }
    invoke(&vars, conf)
}

/// `conf` with `prevResult`.
pub fn with_prev(conf: &Value, prev: &Value) -> Value {
    let mut c = conf.clone();
    c["prevResult"] = prev.clone();
    c
}

/// The host veth the plugin names for (container, ifname) (as `names::host_veth`).
pub fn host_veth(cid: &str, ifname: &str) -> String {
    vrdma_cni::names::host_veth(cid, ifname)
}
