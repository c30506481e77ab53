#!/usr/bin/env bash
# The main job, CPU only (needs just cargo): emit the kernel library for every TPU
# generation, then run every kernel on the CPU JIT (Cranelift) against its reference.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tessera-cli
for t in v5e v5p v6e tpu7x; do
    echo "== emit --all --target $t"
    target/release/tessera emit --all --target "$t" --out "out/$t"
done
for d in f32 bf16; do
    echo "== run --all --dtype $d --backend jit (CPU JIT vs f64 reference)"
    target/release/tessera run --all --dtype "$d" --backend jit
done
