//! Attaching a network namespace someone else made (a container runtime's, through the CNI
//! plugin) to the host bridge, as [`run_container`](crate::run_container) attaches its own:
//! a veth pair, the host end on the bridge, the other end in the namespace with the vNIC's
//! address, a MAC fixed by that address, and routes via the bridge's address.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ip::{check_ifname, check_prefix, ip_binary, is_missing_device, run_ip, IpFailure};
use crate::NetnsError;

/// Why attaching, detaching or inspecting failed. Variants wrapping an `ip` invocation carry
/// its command line and `reason` (its stderr, or its exit status when it printed nothing).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// A name or the prefix length is unusable; nothing was touched.
    #[error(transparent)]
    InvalidSpec(#[from] NetnsError),
    /// The namespace path cannot be opened, or is not a namespace.
    #[error("network namespace {}: {source}", path.display())]
    OpenNetns {
        /// The path given.
        path: PathBuf,
        /// Why it is unusable.
        source: io::Error,
    },
    /// The interface already exists (`place`: the namespace's path, or "the host").
    #[error("{name} already exists in {place}")]
    LinkExists {
        /// The interface.
        name: String,
        /// The namespace's path, or "the host".
        place: String,
    },
    /// `ip` could not be started, or the namespace not entered.
    #[error("cannot run `{command}`: {source}")]
    SpawnIp {
        /// The command line.
        command: String,
        /// Why it could not run.
        source: io::Error,
    },
    /// A step of [`attach`] failed (what was made is gone again).
    #[error("`{command}` failed: {reason}")]
    Attach {
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },
    /// Deleting the host end failed for another reason than its absence.
    #[error("`{command}` failed: {reason}")]
    Detach {
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },
    /// Reading a link's or the routes' state failed.
    #[error("`{command}` failed: {reason}")]
    Inspect {
        /// The command line.
        command: String,
        /// `ip`'s stderr or exit status.
        reason: String,
    },
}

impl AttachError {
    /// `ip`'s failure as `failed`'s variant, or [`AttachError::SpawnIp`].
    fn from_ip(e: IpFailure, failed: fn(String, String) -> AttachError) -> AttachError {
        match e {
            IpFailure::Spawn { command, source } => AttachError::SpawnIp { command, source },
            IpFailure::Failed { command, reason } => failed(command, reason),
        }
    }
}

/// What [`attach`] builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachSpec {
    /// The namespace: a path such as `/run/netns/NAME` or `/proc/PID/ns/net`.
    pub netns: PathBuf,
    /// The interface's name inside the namespace (e.g. `eth0`).
    pub ifname: String,
    /// The host end's name; its owner chooses it so that it can find it again.
    pub host_veth: String,
    /// Host bridge the host end joins (see [`ensure_bridge`](crate::ensure_bridge)).
    pub bridge: String,
    /// The address inside.
    pub ip: Ipv4Addr,
    /// Its prefix length (1..=32).
    pub prefix_len: u8,
    /// Next hop of `routes`: the bridge's address.
    pub gateway: Ipv4Addr,
    /// Routes via `gateway` to add inside (destination, prefix length); `0.0.0.0/0` is the
    /// default route.
    pub routes: Vec<(Ipv4Addr, u8)>,
}

/// What [`attach`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    /// MAC address of the host end.
    pub host_mac: String,
    /// MAC address of the interface inside ([`container_mac`] of the address).
    pub container_mac: String,
}

/// A link as `ip -o link show` describes it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LinkState {
    /// MAC address (`xx:xx:…`).
    pub mac: String,
    /// Administratively up.
    pub up: bool,
    /// The bridge it is a port of.
    pub master: Option<String>,
    /// IPv4 addresses with prefix lengths.
    pub addresses: Vec<(Ipv4Addr, u8)>,
}

/// An IPv4 route through a link, as `ip -4 route show dev` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteState {
    /// Destination and prefix length (`default` is 0.0.0.0/0).
    pub dst: (Ipv4Addr, u8),
    /// Next hop, if any.
    pub via: Option<Ipv4Addr>,
}

/// The MAC address of a container interface with address `ip`: locally administered,
/// `0a:58` then the address (as CNI's bridge plugin does), so a vNIC's next container
/// answers with the MAC its neighbours still have for that address. (With a fresh random
/// one, traffic to the address went to the previous container's MAC until the stale entry
/// failed: tens of seconds, and UCX's connection setup across hosts timed out once.)
pub fn container_mac(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("0a:58:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// An opened network namespace.
struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    /// Opens `path` and checks that it is a namespace (nsfs), so that nothing is created for
    /// a path that is not one.
    fn open(path: &Path) -> Result<Netns, AttachError> {
        let open_err = |source| AttachError::OpenNetns { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(open_err)?;
        // SAFETY: fstatfs writes only into the zeroed struct we own, on a descriptor we hold.
        let is_nsfs = unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            libc::fstatfs(file.as_raw_fd(), &mut st) == 0 && st.f_type == NSFS_MAGIC
        };
        if !is_nsfs {
            return Err(open_err(io::Error::new(io::ErrorKind::InvalidInput, "not a namespace (nsfs) file")));
        }
        Ok(Netns { file, path: path.to_path_buf() })
    }

    /// Runs `ip ARGS` inside the namespace.
    fn ip(&self, args: &[&str]) -> Result<String, IpFailure> {
        let command = format!("ip {} [in {}]", args.join(" "), self.path.display());
        log::debug!("{command}");
        let fd: RawFd = self.file.as_raw_fd();
        let mut cmd = Command::new(ip_binary());
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and only calls the
        // async-signal-safe setns(2) on a descriptor the parent keeps open (close-on-exec
        // closes it only at exec); `last_os_error` does not allocate.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().map_err(|source| IpFailure::Spawn { command: command.clone(), source })?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let reason = if stderr.is_empty() { format!("exited with {}", out.status) } else { stderr };
        Err(IpFailure::Failed { command, reason })
    }
}

/// `NSFS_MAGIC` of linux/magic.h (libc does not export it on every target).
const NSFS_MAGIC: libc::c_long = 0x6e73_6673;

fn attach_err(e: IpFailure) -> AttachError {
    AttachError::from_ip(e, |command, reason| AttachError::Attach { command, reason })
}

/// Creates the veth pair for `spec`, its host end on the bridge and up, the other end in
/// the namespace as `spec.ifname` with the address, [`container_mac`], `lo` up and the
/// routes. All or nothing: on any error the pair is deleted again before returning.
///
/// # Errors
///
/// [`AttachError::InvalidSpec`] for bad names or prefix, [`AttachError::OpenNetns`] when the
/// namespace cannot be opened or is not one, [`AttachError::LinkExists`] when
/// `spec.ifname` exists in the namespace or `spec.host_veth` on the host (nothing is
/// touched then), [`AttachError::Attach`] or [`AttachError::SpawnIp`] when a step fails.
pub fn attach(spec: &AttachSpec) -> Result<Attached, AttachError> {
    check_ifname("ifname", &spec.ifname)?;
    check_ifname("host_veth", &spec.host_veth)?;
    check_ifname("bridge", &spec.bridge)?;
    check_prefix(spec.prefix_len)?;
    let netns = Netns::open(&spec.netns)?;
    if link_in(&netns, &spec.ifname)?.is_some() {
        return Err(AttachError::LinkExists { name: spec.ifname.clone(), place: spec.netns.display().to_string() });
    }
    if host_link(&spec.host_veth)?.is_some() {
        return Err(AttachError::LinkExists { name: spec.host_veth.clone(), place: "the host".into() });
    }
    let container_mac = container_mac(spec.ip);
    let netns_path = spec.netns.to_string_lossy();
    run_ip(&[
        "link",
        "add",
        &spec.host_veth,
        "type",
        "veth",
        "peer",
        "name",
        &spec.ifname,
        "address",
        &container_mac,
        "netns",
        &netns_path,
    ])
    .map_err(attach_err)?;
    match configure(spec, &netns) {
        Ok(host_mac) => Ok(Attached { host_mac, container_mac }),
        Err(e) => {
            crate::ip::delete_link(&spec.host_veth);
            Err(e)
        }
    }
}

/// The steps after the pair exists; returns the host end's MAC.
fn configure(spec: &AttachSpec, netns: &Netns) -> Result<String, AttachError> {
    run_ip(&["link", "set", "dev", &spec.host_veth, "master", &spec.bridge, "up"]).map_err(attach_err)?;
    let address = format!("{}/{}", spec.ip, spec.prefix_len);
    netns.ip(&["link", "set", "dev", "lo", "up"]).map_err(attach_err)?;
    netns.ip(&["addr", "add", &address, "brd", "+", "dev", &spec.ifname]).map_err(attach_err)?;
    netns.ip(&["link", "set", "dev", &spec.ifname, "up"]).map_err(attach_err)?;
    let gateway = spec.gateway.to_string();
    for &(dst, len) in &spec.routes {
        let dst = if len == 0 { "default".to_string() } else { format!("{dst}/{len}") };
        // `onlink`: the gateway need not be inside a narrower prefix of the address.
        netns.ip(&["route", "add", &dst, "via", &gateway, "dev", &spec.ifname, "onlink"]).map_err(attach_err)?;
    }
    let host = host_link(&spec.host_veth)?.ok_or_else(|| AttachError::Attach {
        command: format!("ip -o link show dev {}", spec.host_veth),
        reason: "the host end vanished".into(),
    })?;
    Ok(host.mac)
}

/// Deletes the host end of a veth pair (which deletes its peer too). Returns whether it
/// existed; a missing link is no error, so this can be repeated.
///
/// # Errors
///
/// [`AttachError::InvalidSpec`] for a bad name; [`AttachError::Detach`] or
/// [`AttachError::SpawnIp`] when `ip` fails for another reason than a missing link.
pub fn detach(host_veth: &str) -> Result<bool, AttachError> {
    check_ifname("host_veth", host_veth)?;
    match run_ip(&["link", "del", "dev", host_veth]) {
        Ok(_) => Ok(true),
        Err(IpFailure::Failed { reason, .. }) if is_missing_device(&reason) => Ok(false),
        Err(e) => Err(AttachError::from_ip(e, |command, reason| AttachError::Detach { command, reason })),
    }
}

/// The host link `name`, or None if there is none.
///
/// # Errors
///
/// [`AttachError::Inspect`] or [`AttachError::SpawnIp`] when `ip` fails otherwise.
pub fn host_link(name: &str) -> Result<Option<LinkState>, AttachError> {
    check_ifname("name", name)?;
    link_from(run_ip(&["-o", "link", "show", "dev", name]), || run_ip(&["-o", "-4", "addr", "show", "dev", name]))
}

/// The link `ifname` inside the namespace at `netns`, or None if there is none.
///
/// # Errors
///
/// [`AttachError::OpenNetns`] when the namespace is not there; else as [`host_link`].
pub fn netns_link(netns: &Path, ifname: &str) -> Result<Option<LinkState>, AttachError> {
    check_ifname("ifname", ifname)?;
    link_in(&Netns::open(netns)?, ifname)
}

/// The IPv4 routes through `ifname` inside the namespace at `netns`.
///
/// # Errors
///
/// As [`netns_link`].
pub fn netns_routes(netns: &Path, ifname: &str) -> Result<Vec<RouteState>, AttachError> {
    check_ifname("ifname", ifname)?;
    let out = Netns::open(netns)?.ip(&["-4", "route", "show", "dev", ifname]).map_err(inspect_err)?;
    Ok(out.lines().filter_map(parse_route).collect())
}

fn link_in(netns: &Netns, ifname: &str) -> Result<Option<LinkState>, AttachError> {
    link_from(netns.ip(&["-o", "link", "show", "dev", ifname]), || netns.ip(&["-o", "-4", "addr", "show", "dev", ifname]))
}

fn inspect_err(e: IpFailure) -> AttachError {
    AttachError::from_ip(e, |command, reason| AttachError::Inspect { command, reason })
}

fn link_from(
    shown: Result<String, IpFailure>,
    addresses: impl FnOnce() -> Result<String, IpFailure>,
) -> Result<Option<LinkState>, AttachError> {
    let line = match shown {
        Ok(out) => out,
        Err(IpFailure::Failed { reason, .. }) if is_missing_device(&reason) => return Ok(None),
        Err(e) => return Err(inspect_err(e)),
    };
    let mut state = parse_link(&line);
    state.addresses = parse_addresses(&addresses().map_err(inspect_err)?);
    Ok(Some(state))
}

/// Reads `ip -o link show` output: flags, master, MAC.
fn parse_link(line: &str) -> LinkState {
    let flags = line.split_once('<').and_then(|(_, rest)| rest.split_once('>')).map(|(f, _)| f).unwrap_or("");
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |key: &str| words.iter().position(|w| *w == key).and_then(|i| words.get(i + 1)).map(|s| s.to_string());
    LinkState {
        mac: after("link/ether").unwrap_or_default(),
        up: flags.split(',').any(|f| f == "UP"),
        master: after("master"),
        addresses: Vec::new(),
    }
}

/// Reads `ip -o -4 addr show` output: every `inet A.B.C.D/LEN`.
fn parse_addresses(out: &str) -> Vec<(Ipv4Addr, u8)> {
    let words: Vec<&str> = out.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == "inet")
        .filter_map(|w| {
            let (a, l) = w[1].split_once('/')?;
            Some((a.parse().ok()?, l.parse().ok()?))
        })
        .collect()
}

/// Reads one line of `ip -4 route show dev` output.
fn parse_route(line: &str) -> Option<RouteState> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let dst = match *words.first()? {
        "default" => (Ipv4Addr::UNSPECIFIED, 0),
        d => match d.split_once('/') {
            Some((a, l)) => (a.parse().ok()?, l.parse().ok()?),
            None => (d.parse().ok()?, 32),
        },
    };
    let via = words.iter().position(|w| *w == "via").and_then(|i| words.get(i + 1)).and_then(|v| v.parse().ok());
    Some(RouteState { dst, via })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_mac_is_the_address_locally_administered() {
        assert_eq!(container_mac("198.18.0.3".parse().unwrap()), "0a:58:c6:12:00:03");
    }

    #[test]
    fn link_lines_are_read() {
        let host = "157: vc0123456789a@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue master vrdma0 state UP mode DEFAULT group default qlen 1000\\    link/ether 9a:1b:2c:3d:4e:5f brd ff:ff:ff:ff:ff:ff link-netnsid 3";
        let s = parse_link(host);
        assert_eq!(s.mac, "9a:1b:2c:3d:4e:5f");
        assert!(s.up);
        assert_eq!(s.master.as_deref(), Some("vrdma0"));
        let down = parse_link(
            "2: eth0@if157: <BROADCAST,MULTICAST> mtu 1500 qdisc noop state DOWN\\    link/ether 0a:58:c6:13:ff:01 brd ff:ff:ff:ff:ff:ff",
        );
        assert!(!down.up);
        assert_eq!(down.master, None);
    }

    #[test]
    fn addresses_and_routes_are_read() {
        let addrs = "2: eth0    inet 198.19.7.2/15 brd 198.19.255.255 scope global eth0\\       valid_lft forever preferred_lft forever";
        assert_eq!(parse_addresses(addrs), vec![("198.19.7.2".parse().unwrap(), 15)]);
        assert_eq!(
            parse_route("default via 198.18.0.1"),
            Some(RouteState { dst: (Ipv4Addr::UNSPECIFIED, 0), via: Some("198.18.0.1".parse().unwrap()) })
        );
        assert_eq!(
            parse_route("198.18.0.0/15 proto kernel scope link src 198.19.7.2"),
            Some(RouteState { dst: ("198.18.0.0".parse().unwrap(), 15), via: None })
        );
        assert_eq!(parse_route("10.1.2.3 via 198.18.0.1").map(|r| r.dst), Some(("10.1.2.3".parse().unwrap(), 32)));
        assert_eq!(parse_route(""), None);
    }
}
