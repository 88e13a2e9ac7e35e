#!/usr/bin/env bash
# Every test of vrdma: formatting, lints, unit and end-to-end tests (containers need root),
# and a short fuzzing pass over every decoder of untrusted input.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
export RUST_BACKTRACE=${RUST_BACKTRACE:-0}
echo "== cargo fmt --check"; cargo fmt --all -- --check
echo "== cargo clippy -D warnings"; cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== build"; cargo build --release --workspace --quiet
echo "== tests"
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --workspace --release --no-fail-fast
else
  cargo test --workspace --release --no-fail-fast
fi
if [ -x scripts/fuzz-smoke.sh ]; then echo "== fuzz smoke"; FUZZ_SECONDS=${FUZZ_SECONDS:-15} ./scripts/fuzz-smoke.sh; fi
echo "== all tests passed"
