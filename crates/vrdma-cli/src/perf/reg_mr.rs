//! `vrdma perf reg_mr`: how long registering memory takes.

use anyhow::{bail, Context as _};
use std::time::Instant;
use vrdma::*;

use super::args::PerfArgs;

/// `vrdma perf reg_mr -s SIZE`: time to register SIZE bytes of ordinary heap memory, written
/// before registration (so every page is resident and must be preserved).
pub(crate) fn reg_mr_bench(a: &PerfArgs) -> anyhow::Result<()> {
    let ctx = Context::open_default().context("opening the vNIC")?;
    let pd = ctx.alloc_pd()?;
    let size = a.size as usize;
    let mut mem = vec![0u8; size];
    for (i, b) in mem.iter_mut().enumerate().step_by(4096) {
        *b = i as u8 | 1;
    }
    let t0 = Instant::now();
    // SAFETY: `mem` outlives the MR (dropped first below).
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), size, access::LOCAL_WRITE | access::REMOTE_WRITE) }?;
    let reg = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    drop(mr);
    let dereg = t1.elapsed().as_secs_f64();
    if mem.iter().enumerate().step_by(4096).any(|(i, b)| *b != (i as u8 | 1)) {
        bail!("memory content changed by registration");
    }
    let row = serde_json::json!({"test": "reg_mr", "size": size, "iterations": 1, "reg_s": reg, "dereg_s": dereg, "GBps": size as f64 / reg / 1e9});
    if a.json {
        println!("{row}");
    } else {
        println!("reg_mr of {size} bytes (all pages resident): {reg:.3} s ({:.2} GB/s), dereg {dereg:.4} s", size as f64 / reg / 1e9);
    }
    Ok(())
}
