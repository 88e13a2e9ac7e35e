//! The `vrdma` command: a thin binary over the vrdma crates.

mod admin;
mod oob;
mod peer;
mod perf;
mod run;

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
    /// Run a command in a container with a vNIC.
    Run {
        /// vNIC to give the container.
        #[arg(long)]
        vnic: String,
        /// Extra environment variables (NAME=VALUE).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        /// The command.
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// perftest-shaped benchmark.
    Perf(perf::PerfArgs),
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
    },
    /// Delete a vNIC.
    Delete { name: String },
    /// List vNICs with their resources and counters.
    List {
        #[arg(long)]
        json: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Vnic { cmd } => vnic(cmd),
        Cmd::Run { vnic, env, cmd } => {
            let env = env
                .into_iter()
                .map(|e| match e.split_once('=') {
                    Some((k, v)) => Ok((k.to_string(), v.to_string())),
                    None => bail!("--env {e}: expected NAME=VALUE"),
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let code = run::run(&vnic, cmd, env)?;
            std::process::exit(code);
        }
        Cmd::Perf(a) => perf::run(a),
        Cmd::Check { server, port } => perf::check(server, port),
        Cmd::Peer { socket } => peer::run(&socket),
    }
}

fn vnic(cmd: VnicCmd) -> anyhow::Result<()> {
    use serde_json::json;
    match cmd {
        VnicCmd::Create { name, tenant, ip, max_pd, max_cq, max_qp, max_mr, max_mr_bytes, max_srq } => {
            let d = vrdma::Limits::default();
            let any =
                max_pd.is_some() || max_cq.is_some() || max_qp.is_some() || max_mr.is_some() || max_mr_bytes.is_some() || max_srq.is_some();
            let limits = any.then(|| {
                json!({
                    "max_pd": max_pd.unwrap_or(d.max_pd), "max_cq": max_cq.unwrap_or(d.max_cq), "max_qp": max_qp.unwrap_or(d.max_qp),
                    "max_mr": max_mr.unwrap_or(d.max_mr), "max_mr_bytes": max_mr_bytes.unwrap_or(d.max_mr_bytes), "max_srq": max_srq.unwrap_or(d.max_srq)
                })
            });
            let v = admin::call(json!({"op": "create", "name": name, "tenant": tenant, "ip": ip, "limits": limits}))?;
            println!(
                "created vNIC {} (tenant {}, address {}/{}, GID ::ffff:{})",
                v["vnic"]["name"].as_str().unwrap_or(""),
                v["vnic"]["tenant"].as_str().unwrap_or(""),
                v["vnic"]["ip"].as_str().unwrap_or(""),
                v["vnic"]["prefix_len"],
                v["vnic"]["ip"].as_str().unwrap_or("")
            );
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
                "{:<16} {:<12} {:<18} {:>7} {:>4} {:>4} {:>4} {:>5} {:>12} {:>5} {:>8} {:>8}",
                "NAME", "TENANT", "ADDRESS", "CLIENTS", "PDS", "CQS", "QPS", "MRS", "MR_BYTES", "SRQS", "REFUSED", "BAD_REQ"
            );
            for x in v["vnics"].as_array().into_iter().flatten() {
                let (r, u, c) = (&x["vnic"], &x["usage"], &x["counters"]);
                let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
                println!(
                    "{:<16} {:<12} {:<18} {:>7} {:>4} {:>4} {:>4} {:>5} {:>12} {:>5} {:>8} {:>8}",
                    r["name"].as_str().unwrap_or(""),
                    r["tenant"].as_str().unwrap_or(""),
                    format!("{}/{}", r["ip"].as_str().unwrap_or(""), r["prefix_len"]),
                    n(&u["clients"]),
                    n(&u["pds"]),
                    n(&u["cqs"]),
                    n(&u["qps"]),
                    n(&u["mrs"]),
                    n(&u["mr_bytes"]),
                    n(&u["srqs"]),
                    n(&c["refused_connections"]),
                    n(&c["bad_requests"])
                );
            }
        }
    }
    Ok(())
}
