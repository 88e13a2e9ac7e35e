//! `vrdma-cni`: the CNI plugin (a thin binary over the `vrdma_cni` library), and its
//! installer (`vrdma-cni install`).

use std::io::Write;

const USAGE: &str = "\
vrdma-cni: CNI plugin attaching containers to vrdma's network with a vNIC's address.

Run by a container runtime with CNI_COMMAND and the other CNI_* variables set and the
network configuration on stdin (see README.md, \"CNI\").

  vrdma-cni install [--conf-dir DIR] [--bin-dir DIR] [--name NAME] [--vnic-arg KEY]
                    [--tenant TENANT] [--admin-socket PATH] [--secondary] [--force]
      Copies this binary to BIN-DIR (default /usr/lib/cni) and writes NAME.conflist
      (NAME default vrdma) to CONF-DIR (default /etc/cni/net.d).";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("install") => match vrdma_cni::install::install(&args[1..]) {
            Ok(report) => println!("{report}"),
            Err(e) => {
                eprintln!("vrdma-cni install: {e}");
                std::process::exit(2);
            }
        },
        Some("-h" | "--help" | "help") => println!("{USAGE}"),
        Some("-V" | "--version") => println!("vrdma-cni {} (CNI {})", env!("CARGO_PKG_VERSION"), vrdma_cni::version::SUPPORTED.join(", ")),
        Some(other) => {
            eprintln!("vrdma-cni: unknown argument {other:?}\n\n{USAGE}");
            std::process::exit(2);
        }
        None => {
            // Started by hand (no CNI_COMMAND): answer the error without waiting for stdin.
            let out = if std::env::var_os("CNI_COMMAND").is_some() {
                vrdma_cni::run(|k| std::env::var(k).ok(), &mut std::io::stdin().lock())
            } else {
                eprintln!("{USAGE}\n");
                vrdma_cni::run(|k| std::env::var(k).ok(), &mut std::io::empty())
            };
            if let Some(s) = out.stdout {
                let mut stdout = std::io::stdout().lock();
                let _ = writeln!(stdout, "{s}");
                let _ = stdout.flush();
            }
            std::process::exit(out.exit_code);
        }
    }
}
