//! `vrdma perf`'s options, and what they mean: the test's kind, its sizes and iterations.

use anyhow::bail;

/// Benchmark options.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct PerfArgs {
    /// send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw, atomic_bw
    pub(crate) test: String,
    /// Server address (client side); the server runs without it.
    pub(crate) server: Option<String>,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 2)]
    pub(crate) size: u64,
    /// All sizes from 2 B to 8 MiB.
    #[arg(short = 'a', long)]
    pub(crate) all: bool,
    /// Iterations (default 1000 for latency, 5000 for bandwidth; fewer for large sizes with -a).
    #[arg(short = 'n', long)]
    pub(crate) iters: Option<u64>,
    /// Number of QPs (bandwidth tests).
    #[arg(short = 'q', long, default_value_t = 1)]
    pub(crate) qps: u32,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub(crate) port: u16,
    /// Outstanding work requests per QP (bandwidth tests).
    #[arg(short = 't', long, default_value_t = 128)]
    pub(crate) tx_depth: u32,
    /// Run bandwidth tests for this many seconds instead of a fixed count (write/read/atomic).
    #[arg(short = 'D', long)]
    pub(crate) duration: Option<f64>,
    /// Bandwidth client: also report the rate completed in each interval of this many
    /// seconds (a line per interval, JSON with --json), to watch a rate change during a run.
    #[arg(long, value_name = "SECS")]
    pub(crate) interval: Option<f64>,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Give each QP its own buffer (default: QPs share one buffer, as perftest shares one
    /// MR; separate buffers make -q runs measure the CPU caches as much as vrdma).
    #[arg(long)]
    pub(crate) buf_per_qp: bool,
    /// Verify the data after each size (outside the timed loop): received and written bytes
    /// against a known pattern (and that nothing beyond the message changed), read bytes
    /// likewise, atomic counters and fetched values; any mismatch fails the run.
    #[arg(long)]
    pub(crate) check: bool,
    /// The memory this side registers: anon (zero-copy), or file / hugetlb (memory vrdma
    /// cannot share, which takes the copying fallback through vrdmad).
    #[arg(long, default_value = "anon")]
    pub(crate) mem: vrdma::Backing,
    /// Bandwidth client: start the timed loop at this wall-clock time (milliseconds since
    /// the Unix epoch), so that many pairs started one after another measure the same
    /// window (with -D, their figures add up to the aggregate).
    #[arg(long, value_name = "UNIX_MS")]
    pub(crate) start_at: Option<u64>,
    /// SENDs and WRITEs up to this many bytes go inline (perftest's -I; perftest itself
    /// sends nothing inline on a device it does not recognise, vrdma's included).
    #[arg(short = 'I', long, default_value_t = DEFAULT_INLINE)]
    pub(crate) inline_size: u32,
    /// How write_lat waits for the peer's write to land in memory: `pause` (with the CPU's
    /// spin-wait hint) or `plain` (without: ib_write_lat's loop, which reads the byte and
    /// its run state as ours reads the byte and the peer's hang-up flag; compare
    /// ib_write_lat with `--spin plain`).
    #[arg(long, value_enum, default_value_t = Spin::Pause)]
    pub(crate) spin: Spin,
}

/// Default inline limit of `vrdma perf` (and the QPs' `max_inline_data`).
pub(crate) const DEFAULT_INLINE: u32 = 64;

/// How a latency loop waits on memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Spin {
    /// With `std::hint::spin_loop` (PAUSE) between reads.
    Pause,
    /// Back-to-back reads (of the byte and the hang-up flag).
    Plain,
}

/// The operation a test measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Send,
    Write,
    Read,
    Atomic,
}

/// The largest message size.
pub(crate) const MAX_SIZE: u64 = 8 << 20;

/// The kind of `test` and whether it measures latency (else bandwidth).
pub(crate) fn parse(test: &str) -> anyhow::Result<(Kind, bool)> {
    let (k, lat) = match test.rsplit_once('_') {
        Some((k, "lat")) => (k, true),
        Some((k, "bw")) => (k, false),
        _ => bail!("unknown test {test}: expected send|write|read|atomic _lat|_bw"),
    };
    let kind = match k {
        "send" => Kind::Send,
        "write" => Kind::Write,
        "read" => Kind::Read,
        "atomic" => Kind::Atomic,
        _ => bail!("unknown test {test}"),
    };
    Ok((kind, lat))
}

/// The message sizes a run goes through.
pub(crate) fn sizes(a: &PerfArgs, kind: Kind) -> Vec<u64> {
    if kind == Kind::Atomic {
        return vec![8];
    }
    if a.all {
        (1..=23).map(|i| 1u64 << i).collect()
    } else {
        vec![a.size]
    }
}

/// Iterations at `size`.
pub(crate) fn iters_for(a: &PerfArgs, lat: bool, size: u64) -> u64 {
    if let Some(n) = a.iters {
        return n;
    }
    let base: u64 = if lat { 1000 } else { 5000 };
    if a.all {
        // Keep -a runs bounded: at most ~1 GiB per size.
        base.min(((1u64 << 30) / size).max(100))
    } else {
        base
    }
}
