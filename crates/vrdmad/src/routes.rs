//! Container IP reachability across hosts: a /32 route per remote vNIC via its host's
//! underlay address, kept in sync with the store.
//!
//! Containers see the whole container network (198.18.0.0/15) as on-link, so they ARP for a
//! remote container's address; the host answers for it (`proxy_arp` on the bridge, because
//! it has a more specific route out of another interface) and forwards (`ip_forward`) to
//! the serving host's underlay address, which delivers on its own bridge. Our routes carry
//! protocol number [`RT_PROTO`], so a restarted daemon finds and replaces its predecessor's.

use std::collections::HashMap;
use std::net::Ipv4Addr;

/// Routing protocol number marking vrdmad's routes (`ip route … proto 250`).
pub const RT_PROTO: &str = "250";

/// Routes this daemon installed: container address → next hop.
#[derive(Default)]
pub struct Routes {
    installed: HashMap<Ipv4Addr, Ipv4Addr>,
    /// Bridge, forwarding and proxy ARP set up.
    prepared: bool,
    /// A predecessor's routes were looked at.
    adopted: bool,
}

fn ip(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(ip_binary())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn ip_binary() -> &'static str {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"].into_iter().find(|p| std::path::Path::new(p).exists()).unwrap_or("ip")
}

fn sysctl(path: &str, value: &str) {
    if let Err(e) = std::fs::write(path, value) {
        log::warn!("routes: writing {value} to {path}: {e}");
    }
}

impl Routes {
    /// Makes the installed routes equal `want` (container address → underlay next hop).
    /// Failures are logged and retried at the next call.
    pub fn sync(&mut self, want: &HashMap<Ipv4Addr, Ipv4Addr>, bridge: &str, gateway: Ipv4Addr, prefix_len: u8) {
        if !self.adopted {
            self.adopted = true;
            match ip(&["-o", "-4", "route", "show", "proto", RT_PROTO]) {
                Ok(out) => {
                    for line in out.lines() {
                        let w: Vec<&str> = line.split_whitespace().collect();
                        let dst = w.first().and_then(|d| d.trim_end_matches("/32").parse::<Ipv4Addr>().ok());
                        let via = w.iter().position(|x| *x == "via").and_then(|i| w.get(i + 1)).and_then(|v| v.parse().ok());
                        if let (Some(d), Some(v)) = (dst, via) {
                            self.installed.insert(d, v);
                        }
                    }
                }
                Err(e) => log::warn!("routes: {e}"),
            }
        }
        if !want.is_empty() && !self.prepared {
            match vrdma_netns::ensure_bridge(bridge, gateway, prefix_len) {
                Ok(()) => {
                    sysctl("/proc/sys/net/ipv4/ip_forward", "1");
                    sysctl(&format!("/proc/sys/net/ipv4/conf/{bridge}/proxy_arp"), "1");
                    self.prepared = true;
                }
                Err(e) => log::warn!("routes: bridge {bridge}: {e}"),
            }
        }
        let stale: Vec<Ipv4Addr> = self.installed.keys().filter(|a| !want.contains_key(a)).copied().collect();
        for a in stale {
            let dst = format!("{a}/32");
            match ip(&["route", "del", &dst, "proto", RT_PROTO]) {
                Ok(_) => log::info!("routes: removed {dst}"),
                Err(e) if e.contains("No such process") => {}
                Err(e) => {
                    log::warn!("routes: {e}");
                    continue;
                }
            }
            self.installed.remove(&a);
        }
        for (a, via) in want {
            if self.installed.get(a) == Some(via) {
                continue;
            }
            let (dst, via_s) = (format!("{a}/32"), via.to_string());
            match ip(&["route", "replace", &dst, "via", &via_s, "proto", RT_PROTO]) {
                Ok(_) => {
                    log::info!("routes: {dst} via {via}");
                    self.installed.insert(*a, *via);
                }
                Err(e) => log::warn!("routes: {e}"),
            }
        }
    }
}
