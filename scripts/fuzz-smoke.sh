#!/usr/bin/env bash
# Fuzz smoke test for vrdma-abi's decoders of untrusted input (see fuzz/).
#
# Builds every cargo-fuzz target in fuzz/ and runs each one for FUZZ_SECONDS seconds
# (default 20), starting from a generated seed corpus. Fails if any target crashes,
# panics, times out (one input taking over FUZZ_TIMEOUT seconds, default 10) or runs out
# of memory; the failing input is left under fuzz/artifacts/<target>/.
#
# Works on a stable toolchain: cargo-fuzz passes nightly-only flags to rustc
# (-Zsanitizer=address, sanitizer-coverage options), which RUSTC_BOOTSTRAP=1 allows.
# Needs a C++ compiler (libfuzzer-sys builds libFuzzer from source).
#
# Usage: scripts/fuzz-smoke.sh [target...]   (default: every target of `cargo fuzz list`)
set -euo pipefail

FUZZ_SECONDS="${FUZZ_SECONDS:-20}"
FUZZ_TIMEOUT="${FUZZ_TIMEOUT:-10}"
export RUSTC_BOOTSTRAP=1
# Cargo caches rustc's answers (target/.rustc_info.json) without keying them on
# RUSTC_BOOTSTRAP: one `cargo fuzz` run without it poisons the cache with a "-Z is only
# accepted on nightly" failure. Don't use the cache.
export CARGO_CACHE_RUSTC_INFO=0

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi

if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi
if [[ ${#targets[@]} -eq 0 ]]; then
    echo "no fuzz targets found" >&2
    exit 1
fi

echo "==> generating seed corpus"
cargo run --quiet --example gen_seeds -- corpus

echo "==> building ${targets[*]}"
for t in "${targets[@]}"; do
    cargo fuzz build "$t"
done

failed=()
for t in "${targets[@]}"; do
    if compgen -G "regressions/$t/*" >/dev/null; then
        echo "==> replaying regressions of $t"
        cargo fuzz run "$t" regressions/"$t"/* -- -runs=0 || failed+=("$t (regression)")
    fi
done
for t in "${targets[@]}"; do
    echo "==> fuzzing $t for ${FUZZ_SECONDS}s"
    if ! cargo fuzz run "$t" -- \
        -max_total_time="$FUZZ_SECONDS" \
        -timeout="$FUZZ_TIMEOUT" \
        -rss_limit_mb=2048 \
        -print_final_stats=1; then
        failed+=("$t")
    fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED: ${failed[*]} (crashing inputs in fuzz/artifacts/)" >&2
    for t in "${failed[@]}"; do
        ls -1 "artifacts/$t" 2>/dev/null | sed "s|^|  artifacts/$t/|" >&2 || true
    done
    exit 1
fi
echo "==> all ${#targets[@]} fuzz targets ran ${FUZZ_SECONDS}s without a crash"
