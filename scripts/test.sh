#!/usr/bin/env bash
# Every test, on a fresh machine: installs what it needs (the pinned Python venv with the
# real TPU compiler; cargo fetches the crates), then runs
#   1. the Rust test suite (unit, snapshot, trybuild, proptest numerics, verifier,
#      comparisons with PyTorch),
#   2. the real-compiler tier: every library kernel compiled by libtpu for v5e, v6e, tpu7x.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

step "python venv: jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.52, torch 2.15.0"
bash scripts/setup-venv.sh

step "cargo test (workspace)"
export TESSERA_TPU_ORACLE=1          # enables the tests that call the real TPU compiler
export TESSERA_TORCH=1               # enables the comparisons with PyTorch
export TESSERA_PYTHON="$PWD/.venv/bin/python"
cargo test --workspace --release 2>&1

step "tessera check: every library kernel through libtpu (f32 and bf16)"
cargo run --release -q -p tessera-cli -- check --all --dtype f32
cargo run --release -q -p tessera-cli -- check --all --dtype bf16
