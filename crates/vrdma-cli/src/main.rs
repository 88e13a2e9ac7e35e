//! The `vrdma` command: a thin binary over the vrdma crates.

mod admin;
mod antagonist;
mod ca;
mod cdi;
mod check;
mod oob;
mod peer;
mod perf;
mod run;
mod stats;
mod top;
mod udburst;
mod units;

use anyhow::bail;
use clap::{Parser, Subcommand};

/// vrdma: virtual RDMA NICs for containers.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Manage vNICs.
    Vnic {
        #[command(subcommand)]
        cmd: VnicCmd,
    },
    /// Tenants: connection rules (symmetric; by default only a tenant's own vNICs connect)
    /// and QoS policies.
    Tenant {
        #[command(subcommand)]
        cmd: TenantCmd,
    },
    /// Hosts of the cluster.
    Host {
        #[command(subcommand)]
        cmd: HostCmd,
    },
    /// The cluster's certificate authority: host certificates that authenticate the daemons'
    /// host-to-host connections.
    Ca {
        #[command(subcommand)]
        cmd: CaCmd,
    },
    /// Run a command in a sandboxed container with a vNIC (see docs/security.md).
    Run {
        /// vNIC to give the container.
        #[arg(long)]
        vnic: String,
        /// Extra environment variables (NAME=VALUE).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        #[command(flatten)]
        sandbox: run::SandboxArgs,
        /// The command.
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// CDI spec of this host's vNICs (podman, containerd, CRI-O, Docker: --device vrdma.io/vnic=NAME).
    Cdi {
        #[command(subcommand)]
        cmd: cdi::CdiCmd,
    },
    /// perftest-shaped benchmark.
    Perf(perf::PerfArgs),
    /// Per-vNIC rates of this host, refreshed every second like `top`.
    Top(top::TopArgs),
    /// Exchange SEND/RECV, WRITE, READ and atomics with every byte verified.
    Check {
        /// Server address (client side).
        server: Option<String>,
        /// TCP port of the out-of-band exchange.
        #[arg(short = 'p', long, default_value_t = 18516)]
        port: u16,
    },
    /// Test peer for end-to-end tests (streams traffic until killed).
    #[command(name = "__peer", hide = true)]
    Peer {
        /// Control socket of the vNIC.
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Also RDMA READ this many bytes of the partner's buffer every 64 iterations
        /// (at most half the 1 MiB buffer), so READ responses stream in while WRITEs are posted.
        #[arg(long, default_value_t = 0)]
        reads: u32,
    },
    /// Husky-style antagonists for the isolation tests (RNR storms, connection churn).
    #[command(name = "__antagonist", hide = true)]
    Antagonist(antagonist::Args),
    /// UD test peer for end-to-end tests: `--receive N` counts and checks N datagrams,
    /// `--send N` sends N back to back (receiver's endpoint on stdin) and destroys its QP.
    #[command(name = "__ud-burst", hide = true)]
    UdBurst {
        /// Control socket of the vNIC.
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Receive this many datagrams.
        #[arg(long, conflicts_with = "send")]
        receive: Option<u32>,
        /// Send this many datagrams.
        #[arg(long)]
        send: Option<u32>,
        /// Receiver: seconds to wait for the rest after the first datagram.
        #[arg(long, default_value_t = 10)]
        wait_secs: u64,
    },
}

#[derive(Subcommand)]
enum VnicCmd {
    /// Create a vNIC.
    Create {
        name: String,
        #[arg(long)]
        tenant: String,
        /// Address/prefix in the container network (chosen when omitted).
        #[arg(long)]
        ip: Option<String>,
        #[command(flatten)]
        limits: LimitArgs,
        /// Host whose vrdmad serves it (default: the host of the daemon asked).
        #[arg(long)]
        host: Option<String>,
    },
    /// Offline migration: serve the vNIC on another host from now on (its containers on the
    /// old host lose their vNIC; start them again on the new host, same vGID).
    Move {
        name: String,
        #[arg(long)]
        host: String,
    },
    /// Change a vNIC's limits (unset ones keep their value); applied to new allocations.
    Limits {
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Change a vNIC's QoS policy (unset fields keep their value): caps on what it sends
    /// and its weight in fair sharing. Applied live on every host within a second.
    Qos {
        name: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Delete a vNIC.
    Delete { name: String },
    /// List vNICs with their resources and counters.
    List {
        #[arg(long)]
        json: bool,
    },
    /// A vNIC's meters: bytes and WRs by opcode, completions by status, RNR,
    /// retransmissions, time throttled, refusals (monotonic over the vNIC's life).
    Stats {
        name: String,
        /// Each live QP's meters too.
        #[arg(long)]
        qp: bool,
        #[arg(long)]
        json: bool,
    },
}

/// A vNIC's limits as options; unset ones keep their value.
#[derive(clap::Args)]
struct LimitArgs {
    #[arg(long)]
    max_pd: Option<u32>,
    #[arg(long)]
    max_cq: Option<u32>,
    #[arg(long)]
    max_qp: Option<u32>,
    #[arg(long)]
    max_mr: Option<u32>,
    #[arg(long)]
    max_mr_bytes: Option<u64>,
    #[arg(long)]
    max_srq: Option<u32>,
    /// Client sessions (connections to the vNIC's socket).
    #[arg(long)]
    max_sessions: Option<u32>,
    /// Bytes of queue memory vrdmad allocates for the vNIC's QPs.
    #[arg(long)]
    max_ring_bytes: Option<u64>,
    /// Lanes of cross-host QPs (QPs beyond go fully mediated).
    #[arg(long)]
    max_lanes: Option<u32>,
    /// Descriptors vrdmad holds for the vNIC's MRs (their memfds).
    #[arg(long)]
    max_fds: Option<u32>,
    /// Control requests handled at once.
    #[arg(long)]
    max_pending: Option<u32>,
    /// CPU vrdmad spends on the vNIC's control requests, in percent of one CPU.
    #[arg(long)]
    max_control_cpu_percent: Option<u32>,
    /// CPU vrdmad spends copying for the vNIC's copied MRs (file-backed, hugetlb or
    /// overlapping memory), in percent of one CPU.
    #[arg(long)]
    max_copy_cpu_percent: Option<u32>,
}

impl LimitArgs {
    /// Whether any limit is given.
    fn any(&self) -> bool {
        [
            self.max_pd,
            self.max_cq,
            self.max_qp,
            self.max_mr,
            self.max_srq,
            self.max_sessions,
            self.max_lanes,
            self.max_fds,
            self.max_pending,
            self.max_control_cpu_percent,
            self.max_copy_cpu_percent,
        ]
        .iter()
        .any(Option::is_some)
            || self.max_mr_bytes.is_some()
            || self.max_ring_bytes.is_some()
    }

    /// The limits as the admin API takes them, each one not given from `unset(key)`.
    fn to_json(&self, unset: impl Fn(&str) -> serde_json::Value) -> serde_json::Value {
        let pick = |new: Option<u64>, key: &str| new.map(serde_json::Value::from).unwrap_or_else(|| unset(key));
        serde_json::json!({
            "max_pd": pick(self.max_pd.map(u64::from), "max_pd"), "max_cq": pick(self.max_cq.map(u64::from), "max_cq"),
            "max_qp": pick(self.max_qp.map(u64::from), "max_qp"), "max_mr": pick(self.max_mr.map(u64::from), "max_mr"),
            "max_mr_bytes": pick(self.max_mr_bytes, "max_mr_bytes"), "max_srq": pick(self.max_srq.map(u64::from), "max_srq"),
            "max_sessions": pick(self.max_sessions.map(u64::from), "max_sessions"),
            "max_ring_bytes": pick(self.max_ring_bytes, "max_ring_bytes"),
            "max_lanes": pick(self.max_lanes.map(u64::from), "max_lanes"),
            "max_fds": pick(self.max_fds.map(u64::from), "max_fds"),
            "max_pending": pick(self.max_pending.map(u64::from), "max_pending"),
            "max_control_cpu_percent": pick(self.max_control_cpu_percent.map(u64::from), "max_control_cpu_percent"),
            "max_copy_cpu_percent": pick(self.max_copy_cpu_percent.map(u64::from), "max_copy_cpu_percent"),
        })
    }
}

/// A QoS policy change as options.
#[derive(clap::Args)]
struct QosArgs {
    /// Egress bandwidth cap: 10Gbit, 400MB, 1.5GiB (per second; bits or bytes); 0 or none
    /// removes it.
    #[arg(long, value_parser = parse_bw)]
    max_bw: Option<u64>,
    /// Message-rate cap, WRs per second: 2M, 500k; 0 or none removes it.
    #[arg(long, value_parser = parse_rate)]
    max_msg_rate: Option<u64>,
    /// Weight in fair sharing of a contended link (1 to 10000; default 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    weight: Option<u32>,
    /// Reset the policy (no caps, weight 1) before applying the options given.
    #[arg(long)]
    clear: bool,
}

fn parse_bw(s: &str) -> Result<u64, units::UnitError> {
    units::parse_bandwidth(s)
}

fn parse_rate(s: &str) -> Result<u64, units::UnitError> {
    units::parse_rate(s)
}

impl QosArgs {
    /// The change as the admin API takes it.
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"clear": self.clear, "max_bw": self.max_bw, "max_msg_rate": self.max_msg_rate, "weight": self.weight})
    }
}

/// A policy as listings show it: `bw/msg-rate/weight`, `-` for no cap.
fn qos_summary(q: &serde_json::Value) -> String {
    let n = |k: &str| q[k].as_u64().unwrap_or(0);
    format!("{}/{}/w{}", units::format_bandwidth(n("max_bw")), units::format_rate(n("max_msg_rate")), q["weight"].as_u64().unwrap_or(1))
}

#[derive(Subcommand)]
enum TenantCmd {
    /// Let vNICs of tenants A and B connect to each other.
    Allow { a: String, b: String },
    /// Remove the rule letting A and B connect.
    Deny { a: String, b: String },
    /// List the rules.
    Rules {
        #[arg(long)]
        json: bool,
    },
    /// Change a tenant's QoS policy: its caps bound the sum of its vNICs on each host, its
    /// weight multiplies its vNICs' weights. Applied live on every host within a second.
    Qos {
        tenant: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// List the tenants (of vNICs, rules and policies) with their QoS policies.
    List {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum HostCmd {
    /// List live hosts (registered by their vrdmad).
    List {
        #[arg(long)]
        json: bool,
    },
    /// This host's transport refusals since its vrdmad started: peers refused at their
    /// handshake or first frame, sealed frames refused (altered, injected, replayed, cut),
    /// frames claiming QPs, lanes or sources their peer does not serve, containers'
    /// connection attempts the firewall refused, invalid store records.
    Stats {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum CaCmd {
    /// Creates a CA: DIR/ca.pem (for every host) and DIR/ca.key (keep it safe).
    Init {
        /// Where the CA lives.
        #[arg(long, default_value = "/etc/vrdma/ca")]
        dir: std::path::PathBuf,
    },
    /// Issues HOST's key pair and certificate (HOST: its `vrdmad --host` name) into OUT:
    /// copy OUT to that host's STATE_DIR/tls (default /var/lib/vrdma/tls).
    Issue {
        /// The host's name in the cluster.
        host: String,
        /// Where the CA lives.
        #[arg(long, default_value = "/etc/vrdma/ca")]
        dir: std::path::PathBuf,
        /// Output directory (default: ./HOST).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Vnic { cmd } => vnic(cmd),
        Cmd::Tenant { cmd } => tenant(cmd),
        Cmd::Host { cmd: HostCmd::Stats { json: as_json } } => {
            let v = admin::call(serde_json::json!({"op": "host_stats"}))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            println!("host {}", v["host"].as_str().unwrap_or(""));
            for (key, what) in [
                ("refused_peers", "peers refused at their handshake or first frame"),
                ("refused_frames", "sealed frames refused (altered, injected, replayed, cut)"),
                ("refused_claims", "frames claiming QPs, lanes or sources their peer does not serve"),
                ("firewall_refusals", "containers' connection attempts to a transport port"),
                ("refused_store_records", "invalid store records"),
            ] {
                let n = v[key].as_u64().map_or_else(|| "-".to_string(), |n| n.to_string());
                println!("{n:>12}  {what}");
            }
            Ok(())
        }
        Cmd::Host { cmd: HostCmd::List { json: as_json } } => {
            let v = admin::call(serde_json::json!({"op": "hosts"}))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v["hosts"])?);
                return Ok(());
            }
            println!("{:<20} {:<16} {:<22} {:>6}", "HOST", "UNDERLAY", "TRANSPORT", "VNICS");
            for h in v["hosts"].as_array().into_iter().flatten() {
                let me = if h["this"] == true { " (this host)" } else { "" };
                println!(
                    "{:<20} {:<16} {:<22} {:>6}{me}",
                    h["host"]["name"].as_str().unwrap_or(""),
                    h["host"]["underlay_ip"].as_str().unwrap_or(""),
                    h["host"]["transport_addr"].as_str().unwrap_or(""),
                    h["vnics"].as_u64().unwrap_or(0)
                );
            }
            Ok(())
        }
        Cmd::Ca { cmd: CaCmd::Init { dir } } => ca::init(&dir),
        Cmd::Ca { cmd: CaCmd::Issue { host, dir, out } } => {
            let out = out.unwrap_or_else(|| std::path::PathBuf::from(&host));
            ca::issue(&dir, &host, &out)
        }
        Cmd::Run { vnic, env, sandbox, cmd } => {
            let env = env
                .into_iter()
                .map(|e| match e.split_once('=') {
                    Some((k, v)) => Ok((k.to_string(), v.to_string())),
                    None => bail!("--env {e}: expected NAME=VALUE"),
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let code = run::run(&vnic, cmd, env, sandbox.into_sandbox()?)?;
            std::process::exit(code);
        }
        Cmd::Cdi { cmd } => cdi::run(cmd),
        Cmd::Perf(a) => perf::run(a),
        Cmd::Top(a) => top::run(&a),
        Cmd::Check { server, port } => check::run(server, port),
        Cmd::Peer { socket, reads } => peer::run(&socket, reads),
        Cmd::Antagonist(a) => antagonist::run(a),
        Cmd::UdBurst { socket, receive, send, wait_secs } => match (receive, send) {
            (Some(n), None) => udburst::receive(&socket, n, wait_secs),
            (None, Some(n)) => udburst::send(&socket, n),
            _ => anyhow::bail!("__ud-burst: --receive N or --send N"),
        },
    }
}

fn tenant(cmd: TenantCmd) -> anyhow::Result<()> {
    use serde_json::json;
    match cmd {
        TenantCmd::Allow { a, b } => {
            admin::call(json!({"op": "allow", "a": a, "b": b}))?;
            println!("tenants {a} and {b} may connect");
        }
        TenantCmd::Deny { a, b } => {
            let v = admin::call(json!({"op": "deny", "a": a, "b": b}))?;
            if v["existed"] == true {
                println!("tenants {a} and {b} may no longer connect");
            } else {
                println!("no rule for tenants {a} and {b}");
            }
        }
        TenantCmd::Qos { tenant, qos } => {
            let mut req = qos.to_json();
            req["op"] = json!("tenant_qos");
            req["tenant"] = json!(tenant);
            let v = admin::call(req)?;
            println!("tenant {tenant}: QoS {}", qos_summary(&v["tenant"]["qos"]));
        }
        TenantCmd::List { json: as_json } => {
            let v = admin::call(json!({"op": "tenants"}))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v["tenants"])?);
                return Ok(());
            }
            println!("{:<16} {:>6} {:>12} {:>12} {:>6}", "TENANT", "VNICS", "MAX_BW", "MAX_MSG_RATE", "WEIGHT");
            for t in v["tenants"].as_array().into_iter().flatten() {
                let q = &t["qos"];
                println!(
                    "{:<16} {:>6} {:>12} {:>12} {:>6}",
                    t["tenant"].as_str().unwrap_or(""),
                    t["vnics"].as_u64().unwrap_or(0),
                    units::format_bandwidth(q["max_bw"].as_u64().unwrap_or(0)),
                    units::format_rate(q["max_msg_rate"].as_u64().unwrap_or(0)),
                    q["weight"].as_u64().unwrap_or(1)
                );
            }
        }
        TenantCmd::Rules { json: as_json } => {
            let v = admin::call(json!({"op": "rules"}))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v["rules"])?);
                return Ok(());
            }
            for r in v["rules"].as_array().into_iter().flatten() {
                println!("{} <-> {}", r["from_tenant"].as_str().unwrap_or(""), r["to_tenant"].as_str().unwrap_or(""));
            }
        }
    }
    Ok(())
}

fn vnic(cmd: VnicCmd) -> anyhow::Result<()> {
    use serde_json::json;
    match cmd {
        VnicCmd::Create { name, tenant, ip, limits, host } => {
            let d = vrdma::Limits::default();
            let defaults = json!({
                "max_pd": d.max_pd, "max_cq": d.max_cq, "max_qp": d.max_qp,
                "max_mr": d.max_mr, "max_mr_bytes": d.max_mr_bytes, "max_srq": d.max_srq,
                "max_sessions": d.max_sessions, "max_ring_bytes": d.max_ring_bytes,
                "max_lanes": d.max_lanes, "max_fds": d.max_fds, "max_pending": d.max_pending,
                "max_control_cpu_percent": d.max_control_cpu_percent,
                "max_copy_cpu_percent": d.max_copy_cpu_percent
            });
            let limits = limits.any().then(|| limits.to_json(|key| defaults[key].clone()));
            let v = admin::call(json!({"op": "create", "name": name, "tenant": tenant, "ip": ip, "limits": limits, "host": host}))?;
            println!(
                "created vNIC {} (tenant {}, address {}/{}, GID ::ffff:{}, host {})",
                v["vnic"]["name"].as_str().unwrap_or(""),
                v["vnic"]["tenant"].as_str().unwrap_or(""),
                v["vnic"]["ip"].as_str().unwrap_or(""),
                v["vnic"]["prefix_len"],
                v["vnic"]["ip"].as_str().unwrap_or(""),
                v["vnic"]["host"].as_str().unwrap_or("")
            );
        }
        VnicCmd::Move { name, host } => {
            let v = admin::call(json!({"op": "move", "name": name, "host": host}))?;
            println!("vNIC {name} is served by host {host} now");
            if v["host_up"] != true {
                eprintln!("note: host {host} is not registered (yet); it will serve {name} when its vrdmad runs");
            }
        }
        VnicCmd::Limits { name, limits } => {
            let list = admin::call(json!({"op": "list"}))?;
            let cur = list["vnics"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["vnic"]["name"] == name.as_str())
                .map(|v| v["vnic"]["limits"].clone())
                .ok_or_else(|| anyhow::anyhow!("no vNIC named {name}"))?;
            let limits = limits.to_json(|key| cur[key].clone());
            admin::call(json!({"op": "set_limits", "name": name, "limits": limits}))?;
            println!("vNIC {name}: limits {limits}");
        }
        VnicCmd::Stats { name, qp, json } => stats::run(&name, qp, json)?,
        VnicCmd::Qos { name, qos } => {
            let mut req = qos.to_json();
            req["op"] = json!("vnic_qos");
            req["name"] = json!(name);
            let v = admin::call(req)?;
            println!("vNIC {name}: QoS {}", qos_summary(&v["vnic"]["qos"]));
        }
        VnicCmd::Delete { name } => {
            admin::call(json!({"op": "delete", "name": name}))?;
            println!("deleted vNIC {name}");
        }
        VnicCmd::List { json: as_json } => {
            let v = admin::call(json!({"op": "list"}))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v["vnics"])?);
                return Ok(());
            }
            println!(
                "{:<16} {:<12} {:<18} {:<12} {:>7} {:>4} {:>4} {:>4} {:>5} {:>12} {:>5} {:>8} {:>8}  QOS (BW/MSG_RATE/WEIGHT)",
                "NAME", "TENANT", "ADDRESS", "HOST", "CLIENTS", "PDS", "CQS", "QPS", "MRS", "MR_BYTES", "SRQS", "REFUSED", "BAD_REQ/KEY",
            );
            for x in v["vnics"].as_array().into_iter().flatten() {
                let (r, u, c) = (&x["vnic"], &x["usage"], &x["counters"]);
                let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
                if x["local"] == false {
                    println!(
                        "{:<16} {:<12} {:<18} {:<12} {:>7} {:>66}  {}",
                        r["name"].as_str().unwrap_or(""),
                        r["tenant"].as_str().unwrap_or(""),
                        format!("{}/{}", r["ip"].as_str().unwrap_or(""), r["prefix_len"]),
                        r["host"].as_str().unwrap_or(""),
                        "-",
                        "",
                        qos_summary(&r["qos"])
                    );
                    continue;
                }
                let host = r["host"].as_str().filter(|h| !h.is_empty()).unwrap_or("(this)");
                let throttled = if x["throttled"] == true { " (throttled)" } else { "" };
                println!(
                    "{:<16} {:<12} {:<18} {:<12} {:>7} {:>4} {:>4} {:>4} {:>5} {:>12} {:>5} {:>8} {:>8}  {}{throttled}",
                    r["name"].as_str().unwrap_or(""),
                    r["tenant"].as_str().unwrap_or(""),
                    format!("{}/{}", r["ip"].as_str().unwrap_or(""), r["prefix_len"]),
                    host,
                    n(&u["clients"]),
                    n(&u["pds"]),
                    n(&u["cqs"]),
                    n(&u["qps"]),
                    n(&u["mrs"]),
                    n(&u["mr_bytes"]),
                    n(&u["srqs"]),
                    n(&c["refused_connections"]),
                    admin::bad_counts(c),
                    qos_summary(&r["qos"])
                );
            }
        }
    }
    Ok(())
}
