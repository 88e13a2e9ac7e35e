//! Running iproute2's `ip`, and the host bridge.

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::NetnsError;

/// Longest Linux interface name (IFNAMSIZ - 1).
pub(crate) const IFNAME_MAX: usize = 15;

/// Why an `ip` invocation failed.
pub(crate) enum IpFailure {
    /// It could not be started.
    Spawn { command: String, source: io::Error },
    /// It ran and exited unsuccessfully.
    Failed { command: String, reason: String },
}

impl IpFailure {
    /// Turns a `Failed` into the operation's variant; `Spawn` becomes `SpawnIp`.
    pub(crate) fn into_error(self, failed: impl FnOnce(String, String) -> NetnsError) -> NetnsError {
        match self {
            IpFailure::Spawn { command, source } => NetnsError::SpawnIp { command, source },
            IpFailure::Failed { command, reason } => failed(command, reason),
        }
    }
}

/// The `ip` binary: the first `ip` on `PATH`, else the usual sbin locations (`vrdma run`
/// is often started with a user's PATH through sudo), else plain `ip`.
pub(crate) fn ip_binary() -> &'static Path {
    static IP: OnceLock<PathBuf> = OnceLock::new();
    IP.get_or_init(|| {
        let from_path = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default();
        let fallbacks = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from);
        from_path.into_iter().chain(fallbacks).map(|dir| dir.join("ip")).find(|p| p.is_file()).unwrap_or_else(|| PathBuf::from("ip"))
    })
}

fn command_line(args: &[&str]) -> String {
    let mut s = String::from("ip");
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

/// Runs `ip ARGS` on the host; returns its stdout. (Inside a namespace: attach.rs's
/// `Netns::ip`.)
pub(crate) fn run_ip(args: &[&str]) -> Result<String, IpFailure> {
    let command = command_line(args);
    log::debug!("{command}");
    let out = Command::new(ip_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| IpFailure::Spawn { command: command.clone(), source })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let reason = if stderr.is_empty() { format!("exited with {}", out.status) } else { stderr };
    Err(IpFailure::Failed { command, reason })
}

/// Checks that `name` can be a Linux interface name.
pub(crate) fn check_ifname(field: &'static str, name: &str) -> Result<(), NetnsError> {
    let bad = |reason: &str| NetnsError::InvalidSpec { field, reason: format!("{name:?}: {reason}") };
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name.len() > IFNAME_MAX {
        return Err(bad("longer than 15 bytes"));
    }
    if name == "." || name == ".." {
        return Err(bad("not a valid interface name"));
    }
    if name.bytes().any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace() || !b.is_ascii()) {
        return Err(bad("contains '/', ':', whitespace, NUL or non-ASCII"));
    }
    Ok(())
}

/// Checks a prefix length.
pub(crate) fn check_prefix(prefix_len: u8) -> Result<(), NetnsError> {
    if prefix_len == 0 || prefix_len > 32 {
        return Err(NetnsError::InvalidSpec { field: "prefix_len", reason: format!("{prefix_len} is not in 1..=32") });
    }
    Ok(())
}

/// Whether `ip -o link show` says "does not exist".
pub(crate) fn is_missing_device(reason: &str) -> bool {
    reason.contains("does not exist") || reason.contains("Cannot find device")
}

/// Makes sure the host bridge `bridge` exists, holds `gateway/prefix_len`, and is up.
///
/// Idempotent and safe to race with another caller doing the same: a missing bridge is
/// created, a missing address is added, and the bridge is set up; anything already in place
/// is left alone (other addresses on the bridge are kept). IP forwarding is not touched: the
/// bridge only has to switch between containers of this host.
///
/// Needs CAP_NET_ADMIN and iproute2's `ip`.
///
/// # Errors
///
/// [`NetnsError::InvalidSpec`] for a bad name or prefix, [`NetnsError::NotABridge`] if a
/// non-bridge link has the name, and the `ip` failure variants ([`NetnsError::SpawnIp`],
/// [`NetnsError::QueryBridge`], [`NetnsError::CreateBridge`],
/// [`NetnsError::BridgeAddress`], [`NetnsError::BridgeUp`]).
pub fn ensure_bridge(bridge: &str, gateway: Ipv4Addr, prefix_len: u8) -> Result<(), NetnsError> {
    check_ifname("bridge", bridge)?;
    check_prefix(prefix_len)?;

    // 1. The link, and that it is a bridge.
    match run_ip(&["-d", "-j", "link", "show", "dev", bridge]) {
        Ok(json) => {
            if !json.replace(' ', "").contains("\"info_kind\":\"bridge\"") {
                return Err(NetnsError::NotABridge { bridge: bridge.to_string() });
            }
        }
        Err(IpFailure::Failed { reason, .. }) if is_missing_device(&reason) => {
            match run_ip(&["link", "add", "name", bridge, "type", "bridge"]) {
                Ok(_) => log::info!("created bridge {bridge}"),
                // Someone else created it between our check and our add.
                Err(IpFailure::Failed { reason, .. }) if reason.contains("File exists") => {}
                Err(e) => {
                    return Err(e.into_error(|command, reason| NetnsError::CreateBridge { bridge: bridge.to_string(), command, reason }))
                }
            }
        }
        Err(e) => return Err(e.into_error(|command, reason| NetnsError::QueryBridge { bridge: bridge.to_string(), command, reason })),
    }

    // 2. The gateway address.
    let address = format!("{gateway}/{prefix_len}");
    let addr_err = |e: IpFailure| {
        e.into_error(|command, reason| NetnsError::BridgeAddress { bridge: bridge.to_string(), address: address.clone(), command, reason })
    };
    let shown = run_ip(&["-o", "-4", "addr", "show", "dev", bridge]).map_err(addr_err)?;
    let present = shown.split_whitespace().any(|w| w == address);
    if !present {
        match run_ip(&["addr", "add", &address, "brd", "+", "dev", bridge]) {
            Ok(_) => log::info!("added {address} to bridge {bridge}"),
            Err(IpFailure::Failed { reason, .. }) if reason.contains("File exists") || reason.contains("already assigned") => {}
            Err(e) => return Err(addr_err(e)),
        }
    }

    // 3. A fixed MAC address. A bridge whose address was never set takes the lowest MAC of
    // its ports, so it changes whenever a container whose veth had that MAC exits (or one
    // with a lower MAC starts); every other container's ARP entry for the gateway and for
    // proxy-ARPed remote addresses then points at a MAC nobody answers, and their TCP
    // connections stall. Setting the address, even to its current value, pins it (done
    // once: setting it also flushes the bridge's neighbour table).
    let pinned = std::fs::read_to_string(format!("/sys/class/net/{bridge}/addr_assign_type")).is_ok_and(|t| t.trim() == "3");
    if !pinned {
        pin_mac(bridge)?;
    }

    // 4. Up.
    run_ip(&["link", "set", "dev", bridge, "up"])
        .map_err(|e| e.into_error(|command, reason| NetnsError::BridgeUp { bridge: bridge.to_string(), command, reason }))?;
    Ok(())
}

/// Sets `bridge`'s MAC address to its current one (`NET_ADDR_SET`: ports no longer move it).
fn pin_mac(bridge: &str) -> Result<(), NetnsError> {
    let mac_err = |e: IpFailure| e.into_error(|command, reason| NetnsError::BridgeMac { bridge: bridge.to_string(), command, reason });
    let shown = run_ip(&["-j", "link", "show", "dev", bridge]).map_err(mac_err)?;
    let mac = link_address(&shown).ok_or_else(|| NetnsError::BridgeMac {
        bridge: bridge.to_string(),
        command: format!("ip -j link show dev {bridge}"),
        reason: "no MAC address in its output".into(),
    })?;
    run_ip(&["link", "set", "dev", bridge, "address", &mac]).map_err(mac_err)?;
    Ok(())
}

/// The MAC address in `ip -j link show` output (`"address":"xx:xx:xx:xx:xx:xx"`).
fn link_address(json: &str) -> Option<String> {
    let compact = json.replace(' ', "");
    let at = compact.find("\"address\":\"")? + "\"address\":\"".len();
    let mac = compact[at..].split('"').next()?;
    let valid = mac.len() == 17 && mac.split(':').count() == 6 && mac.split(':').all(|b| b.len() == 2 && u8::from_str_radix(b, 16).is_ok());
    valid.then(|| mac.to_string())
}

/// Deletes a host interface; "not found" is success (the kernel removes a veth pair by
/// itself once the container's network namespace is gone).
pub(crate) fn delete_link(name: &str) {
    match run_ip(&["link", "del", "dev", name]) {
        Ok(_) => {}
        Err(IpFailure::Failed { reason, .. }) if is_missing_device(&reason) => {}
        Err(IpFailure::Failed { command, reason }) => {
            log::warn!("cleaning up {name}: `{command}` failed: {reason}")
        }
        Err(IpFailure::Spawn { command, source }) => {
            log::warn!("cleaning up {name}: cannot run `{command}`: {source}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::link_address;

    #[test]
    fn link_address_is_read_from_ip_json_and_validated() {
        let json = r#"[{"ifindex":5,"ifname":"vrdma0","flags":["UP"],"address": "de:ce:53:8f:a7:5b","broadcast":"ff:ff:ff:ff:ff:ff"}]"#;
        assert_eq!(link_address(json).as_deref(), Some("de:ce:53:8f:a7:5b"));
        assert_eq!(link_address(r#"[{"address":"de:ce:53:8f:a7"}]"#), None);
        assert_eq!(link_address(r#"[{"address":"zz:ce:53:8f:a7:5b"}]"#), None);
        assert_eq!(link_address(r#"[{"ifname":"x"}]"#), None);
    }
}
