//! Links the cdylib as rdma-core's `libibverbs.so.1`: soname, and every exported symbol with
//! the version Debian's libibverbs gives it (`exports.txt`).
//!
//! rustc passes its own anonymous version script for the cdylib, which would claim every
//! `#[no_mangle]` symbol unversioned; so each symbol is implemented as `__vrdma_<name>` and the
//! public name is an alias (`--defsym`) that only our named version script covers.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=exports.txt");
    let text = std::fs::read_to_string("exports.txt").expect("exports.txt");
    let mut by_version: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let mut it = line.split_whitespace();
        let (Some(v), Some(s)) = (it.next(), it.next()) else { panic!("bad line in exports.txt: {line}") };
        by_version.entry(v.to_string()).or_default().push(s.to_string());
    }
    // Version nodes in rdma-core's order: 1.0, 1.1, 1.5 ... 1.14, then the private one.
    let mut versions: Vec<&String> = by_version.keys().collect();
    versions.sort_by_key(|v| match v.strip_prefix("IBVERBS_1.") {
        Some(n) => (0, n.parse::<u32>().unwrap_or(0)),
        None => (1, 0),
    });
    let mut script = String::new();
    let mut prev: Option<&String> = None;
    for (i, v) in versions.iter().enumerate() {
        let _ = writeln!(script, "{v} {{\n  global:");
        for s in &by_version[*v] {
            let _ = writeln!(script, "    {s};");
        }
        if i == 0 {
            script.push_str("  local: *;\n");
        }
        match prev {
            Some(p) if !v.starts_with("IBVERBS_PRIVATE") => {
                let _ = writeln!(script, "}} {p};");
            }
            _ => script.push_str("};\n"),
        }
        prev = Some(v);
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("libibverbs.map");
    std::fs::write(&out, script).expect("write version script");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", out.display());
    for syms in by_version.values() {
        for s in syms {
            println!("cargo:rustc-cdylib-link-arg=-Wl,--defsym={s}=__vrdma_{s}");
        }
    }
}
