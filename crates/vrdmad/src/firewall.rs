//! Keeps containers away from the daemons' transport port: an nftables table of vrdmad's own
//! (`ip vrdmad_<port>`) that rejects, and counts, TCP connections to the port
//!
//! - arriving on the container bridge (this host's containers, to this daemon: `input`),
//! - forwarded from the bridge (this host's containers, to another host's daemon: `forward`),
//! - from the container network's addresses, wherever they arrive from (`input`), except this
//!   host's own underlay subnet when it lies inside that range (as on the simulated hosts).
//!
//! Every daemon installs it, so a container reaches no daemon's port: its packets enter the
//! cluster through its own host's bridge. The table replaces any predecessor's atomically at
//! start and is deleted on a clean exit ([`TransportFirewall::remove`], also on drop).

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Name of the counter of refused connection attempts.
const COUNTER: &str = "from_containers";

/// Failures installing the rules.
#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    /// `nft` could not be run (not installed: Debian's `nftables` package).
    #[error("cannot run nft ({0}); install Debian's nftables package")]
    NoNft(std::io::Error),
    /// `nft` refused the rules.
    #[error("nft: {0}")]
    Nft(String),
}

/// What to protect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirewallConfig {
    /// The transport's TCP port.
    pub port: u16,
    /// The container bridge (`vrdma0`).
    pub bridge: String,
    /// The container network.
    pub network: (Ipv4Addr, u8),
    /// This host's underlay subnet, exempted from the container-network match when inside it.
    pub underlay: Option<(Ipv4Addr, u8)>,
}

/// The installed table.
pub struct TransportFirewall {
    table: String,
    removed: AtomicBool,
}

fn nft_binary() -> &'static str {
    ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"].into_iter().find(|p| std::path::Path::new(p).exists()).unwrap_or("nft")
}

fn nft(args: &[&str], script: Option<&str>) -> Result<String, FirewallError> {
    use std::io::Write as _;
    let mut child = Command::new(nft_binary())
        .args(args)
        .stdin(if script.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(FirewallError::NoNft)?;
    if let (Some(s), Some(mut stdin)) = (script, child.stdin.take()) {
        stdin.write_all(s.as_bytes()).map_err(|e| FirewallError::Nft(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| FirewallError::Nft(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(FirewallError::Nft(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

fn masked((a, len): (Ipv4Addr, u8)) -> Ipv4Addr {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len.min(32))) };
    Ipv4Addr::from(u32::from(a) & mask)
}

/// Whether subnet `inner` lies inside `outer`.
fn inside(inner: (Ipv4Addr, u8), outer: (Ipv4Addr, u8)) -> bool {
    inner.1 >= outer.1 && masked((inner.0, outer.1)) == masked(outer)
}

/// The nft script installing (or replacing) the table.
pub fn script(table: &str, c: &FirewallConfig) -> String {
    let (net, len) = (masked(c.network), c.network.1);
    let (port, bridge) = (c.port, &c.bridge);
    let reject = format!("counter name \"{COUNTER}\" reject with tcp reset");
    // An underlay inside the container range: its hosts are not containers, and forwarding a
    // container's connection to one of them is stopped here too.
    let (exempt, forward_to_underlay) = match c.underlay {
        Some(u) if inside(u, c.network) => (
            format!(" ip saddr != {}/{}", masked(u), u.1),
            format!("\x20   iifname \"{bridge}\" ip daddr {}/{} tcp dport {port} {reject}\n", masked(u), u.1),
        ),
        _ => (String::new(), String::new()),
    };
    format!(
        "table ip {table} {{}}\n\
         delete table ip {table}\n\
         table ip {table} {{\n\
         \x20 counter {COUNTER} {{}}\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority filter - 10; policy accept;\n\
         \x20   iifname \"{bridge}\" tcp dport {port} {reject}\n\
         \x20   ip saddr {net}/{len}{exempt} tcp dport {port} {reject}\n\
         \x20 }}\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority filter - 10; policy accept;\n\
         \x20   iifname \"{bridge}\" ip daddr != {net}/{len} tcp dport {port} {reject}\n\
         {forward_to_underlay}\
         \x20 }}\n\
         }}\n"
    )
}

/// The subnet of the interface holding `addr` (`ip -o -4 addr show`).
pub fn subnet_of(addr: Ipv4Addr) -> Option<(Ipv4Addr, u8)> {
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"].into_iter().find(|p| std::path::Path::new(p).exists())?;
    let out = Command::new(ip).args(["-o", "-4", "addr", "show"]).stdin(Stdio::null()).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let cidr = w.iter().position(|x| *x == "inet").and_then(|i| w.get(i + 1))?;
        let (a, len) = cidr.split_once('/')?;
        let (a, len) = (a.parse::<Ipv4Addr>().ok()?, len.parse::<u8>().ok()?);
        (a == addr).then_some((a, len))
    })
}

/// The firewall of this process, removed by [`remove_installed`] on exit.
static INSTALLED: parking_lot::Mutex<Option<Arc<TransportFirewall>>> = parking_lot::Mutex::new(None);

/// Installs the firewall for a cluster daemon and keeps it for the process's life; logs its
/// count when it grows. Failure is logged, not fatal (the daemon still works, unprotected).
pub fn install_for_daemon(c: &FirewallConfig) {
    match TransportFirewall::install(c) {
        Ok(fw) => {
            fw.report_every(Duration::from_secs(10));
            *INSTALLED.lock() = Some(fw);
        }
        Err(e) => log::error!("transport port {} stays reachable from containers: {e}", c.port),
    }
}

/// Refused connection attempts counted by this process's firewall, if it has one.
pub fn refused_connections() -> Option<u64> {
    INSTALLED.lock().as_ref().and_then(|f| f.refused())
}

/// Removes this process's firewall (on exit).
pub fn remove_installed() {
    if let Some(fw) = INSTALLED.lock().take() {
        fw.remove();
    }
}

impl TransportFirewall {
    /// Installs the table for `c` (replacing a predecessor's of the same port).
    pub fn install(c: &FirewallConfig) -> Result<Arc<TransportFirewall>, FirewallError> {
        let table = format!("vrdmad_{}", c.port);
        nft(&["-f", "-"], Some(&script(&table, c)))?;
        log::info!(
            "transport port {} closed to containers ({} and {}/{}): nft table ip {table}",
            c.port,
            c.bridge,
            masked(c.network),
            c.network.1
        );
        Ok(Arc::new(TransportFirewall { table, removed: AtomicBool::new(false) }))
    }

    /// Connection attempts from containers refused so far (packets the rules rejected).
    pub fn refused(&self) -> Option<u64> {
        let out = nft(&["list", "counter", "ip", &self.table, COUNTER], None).ok()?;
        let w: Vec<&str> = out.split_whitespace().collect();
        w.iter().position(|x| *x == "packets").and_then(|i| w.get(i + 1)).and_then(|n| n.parse().ok())
    }

    /// Logs the count whenever it grew, every `every`, while the firewall is installed.
    pub fn report_every(self: &Arc<Self>, every: Duration) {
        let me = Arc::downgrade(self);
        let _ = std::thread::Builder::new().name("transport-fw".into()).spawn(move || {
            let mut last = 0;
            loop {
                std::thread::sleep(every);
                let Some(fw) = me.upgrade() else { return };
                if fw.removed.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(n) = fw.refused().filter(|n| *n > last) {
                    log::warn!("transport: refused {} connection attempts from containers ({n} in all)", n - last);
                    last = n;
                }
            }
        });
    }

    /// Deletes the table.
    pub fn remove(&self) {
        if !self.removed.swap(true, Ordering::SeqCst) {
            if let Err(e) = nft(&["delete", "table", "ip", &self.table], None) {
                log::warn!("transport firewall: {e}");
            }
        }
    }
}

impl Drop for TransportFirewall {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(underlay: Option<(Ipv4Addr, u8)>) -> FirewallConfig {
        FirewallConfig { port: 4791, bridge: "vrdma0".into(), network: (Ipv4Addr::new(198, 18, 0, 0), 15), underlay }
    }

    #[test]
    fn the_script_rejects_containers_and_exempts_an_underlay_inside_their_range() {
        let s = script("t", &cfg(Some((Ipv4Addr::new(198, 19, 7, 11), 24))));
        assert!(s.contains("iifname \"vrdma0\" tcp dport 4791 counter name \"from_containers\" reject with tcp reset"), "{s}");
        assert!(s.contains("ip saddr 198.18.0.0/15 ip saddr != 198.19.7.0/24 tcp dport 4791"), "{s}");
        assert!(s.contains("iifname \"vrdma0\" ip daddr != 198.18.0.0/15 tcp dport 4791"), "{s}");
        assert!(s.contains("iifname \"vrdma0\" ip daddr 198.19.7.0/24 tcp dport 4791"), "{s}");
        assert!(s.starts_with("table ip t {}\ndelete table ip t\n"), "{s}");
        let s = script("t", &cfg(Some((Ipv4Addr::new(10, 1, 2, 3), 16))));
        assert!(s.contains("ip saddr 198.18.0.0/15 tcp dport 4791") && !s.contains("10.1.0.0"), "{s}");
        assert!(inside((Ipv4Addr::new(198, 19, 7, 0), 24), (Ipv4Addr::new(198, 18, 0, 0), 15)));
        assert!(!inside((Ipv4Addr::new(198, 20, 7, 0), 24), (Ipv4Addr::new(198, 18, 0, 0), 15)));
        assert!(!inside((Ipv4Addr::new(198, 0, 0, 0), 8), (Ipv4Addr::new(198, 18, 0, 0), 15)));
    }

    /// Installs and removes the table for real (root with nft only): in a fresh network
    /// namespace, so nothing of the host's is touched.
    #[test]
    fn installs_counts_and_removes() {
        const TEST: &str = "firewall::installs_counts_and_removes";
        if !vrdma_test_support::require_root(TEST)
            || !vrdma_test_support::require_files(TEST, &["/usr/sbin/nft", "/usr/bin/unshare"], "nftables")
        {
            return;
        }
        // A child in a new network namespace does the work; `unshare -n` runs this test binary.
        let exe = std::env::current_exe().unwrap();
        if std::env::var_os("VRDMA_FW_CHILD").is_none() {
            let st = Command::new("unshare")
                .args(["-n", "--"])
                .arg(&exe)
                .args(["--exact", "firewall::tests::installs_counts_and_removes", "--nocapture"])
                .env("VRDMA_FW_CHILD", "1")
                .status()
                .unwrap();
            assert!(st.success());
            return;
        }
        let fw = TransportFirewall::install(&FirewallConfig { port: 4999, ..cfg(None) }).unwrap();
        assert_eq!(fw.refused(), Some(0));
        // Installing again replaces, not duplicates.
        let again = TransportFirewall::install(&FirewallConfig { port: 4999, ..cfg(None) }).unwrap();
        again.removed.store(true, Ordering::SeqCst);
        drop(again);
        assert!(nft(&["list", "table", "ip", "vrdmad_4999"], None).unwrap().matches("reject").count() == 3);
        drop(fw);
        assert!(nft(&["list", "table", "ip", "vrdmad_4999"], None).is_err());
    }
}
