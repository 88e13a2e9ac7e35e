//! The engine's settings and their defaults.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::PeerTls;

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where the transport listens (port 0: any).
    pub listen: SocketAddr,
    /// This host's name (told to peers).
    pub host: String,
    /// TCP connections per peer host (QPs are spread over them by QPN).
    pub connections_per_host: usize,
    /// A peer silent this long (no data, no heartbeat answer) is declared dead: its QPs go to
    /// ERR and their outstanding WRs flush.
    pub peer_timeout: Duration,
    /// How long the doorbell thread keeps polling after work before sleeping.
    pub spin: Duration,
    /// Whether engine threads move to the CPU their wakeups come from (`affinity`).
    pub follow_cpu: bool,
    /// Whether RC QPs get lanes: a connection of their own to the peer's daemon, shared
    /// with the client library, which then sends small requests itself while the engine
    /// does not need the QP's send side (no engine wakeup per message; see `lane::open_lane`).
    /// On by default, where the kernel can confine the sockets clients hold (`lane::guard`);
    /// off, with a warning saying why, where it cannot.
    pub lanes: bool,
    /// This host's certificate and the cluster's CA: every daemon connection and lane starts
    /// with a mutually authenticated TLS 1.3 handshake (`peer_tls`). None: no authentication.
    pub tls: Option<Arc<PeerTls>>,
}

/// TCP connections per peer host by default (QPs are spread over them by QPN, each with its
/// reader threads).
pub const DEFAULT_CONNECTIONS: usize = 2;

/// The doorbell thread's default polling after work: none on a machine of two CPUs or
/// fewer, 50 µs above. It polls at real-time priority, so on two CPUs it keeps a
/// busy-polling application off a core for the whole spin, which more than doubled the
/// one-way latency of a ping-pong through the engine there (docs/measurements.md).
pub fn default_spin() -> Duration {
    spin_for_cpus(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// [`default_spin`] on a machine of `cpus` CPUs.
fn spin_for_cpus(cpus: usize) -> Duration {
    match cpus {
        0..=2 => Duration::ZERO,
        _ => Duration::from_micros(50),
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 4791)),
            host: "localhost".into(),
            connections_per_host: DEFAULT_CONNECTIONS,
            peer_timeout: Duration::from_secs(5),
            spin: default_spin(),
            follow_cpu: true,
            lanes: true,
            tls: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The doorbell thread spins only where it cannot keep an application off its only
    /// other core; an unknown CPU count counts as one.
    #[test]
    fn the_doorbell_thread_spins_only_above_two_cpus() {
        assert_eq!(spin_for_cpus(0), Duration::ZERO);
        assert_eq!(spin_for_cpus(1), Duration::ZERO);
        assert_eq!(spin_for_cpus(2), Duration::ZERO);
        assert_eq!(spin_for_cpus(3), Duration::from_micros(50));
        assert_eq!(spin_for_cpus(64), Duration::from_micros(50));
    }

    /// The defaults: the well-known port on every address, lanes and CPU following on, a
    /// peer declared dead after 5 s of silence, and the spin of this machine.
    #[test]
    fn defaults_listen_on_the_transport_port_with_lanes_on() {
        let c = EngineConfig::default();
        assert_eq!(c.listen, "0.0.0.0:4791".parse::<SocketAddr>().unwrap());
        assert_eq!(c.connections_per_host, DEFAULT_CONNECTIONS);
        assert_eq!(c.peer_timeout, Duration::from_secs(5));
        assert_eq!(c.spin, default_spin());
        assert!(c.lanes && c.follow_cpu);
    }
}
