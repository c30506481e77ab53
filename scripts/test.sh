#!/usr/bin/env bash
# Every test, on a fresh machine: installs what it needs (the pinned Python venv with the
# real TPU compiler; LLVM 22 from Debian; cargo fetches the crates), then runs
#   1. the Rust test suite (unit, snapshot, trybuild, proptest numerics, verifier,
#      comparisons with PyTorch, the CPU-backend conformance suite on interp, the
#      Cranelift JIT and LLVM), then every library op on the JIT vs its reference,
#   2. the real-compiler tier: every library kernel compiled by libtpu for v5e, v6e, tpu7x
#      (bf16 all on v5e, a stable sixth on v6e and on tpu7x; f32 a stable twelfth; TESSERA_LIBTPU_SAMPLE=1 compiles all),
#      and the verifier's evidence (tests/tests/rulebook.rs: every rulebook pair half and a
#      stable sixth of the probes judged by libtpu again, about 1 min cold, the rest against
#      the recorded verdicts; TESSERA_LIBTPU_SAMPLE=1 judges all of them, about 2 min; verdicts
#      cached under target/tpu-verdicts/ by module text and libtpu version),
#   3. the PyTorch face: builds the `tessera` wheel (abi3, maturin) and the user-kernel
#      example's, installs them into a fresh venv with no Rust on PATH, smoke-tests them
#      (scripts/wheel_smoke.py: every op once, a user kernel, a fused region), then runs
#      tests/python with pytest against them (torch.ops.tpu.* on the CPU and on the
#      emulated `tpu` device, opcheck, torch.compile, the TorchTPU path, Llama/MoE blocks,
#      transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

# apt first (LLVM, then the venv's python3-venv if missing: never two apt-gets at once).
step "LLVM 22 for the LLVM CPU backend (llvm-22-dev)"
export LLVM_SYS_221_PREFIX="$(bash scripts/setup-llvm.sh)"

# The venv is ~3 minutes of downloads and unpacking, the build ~6 of compiling: side by side.
step "python venv (in the background while cargo builds): jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.52, torch 2.15.0, torch-tpu 0.2.0"
VENV_LOG="$(mktemp)"
bash scripts/setup-venv.sh >"$VENV_LOG" 2>&1 &
VENV_PID=$!

# The Python extension crates are built by maturin below, not linked into test binaries.
# `llvm` adds the LLVM backend to the CLI and its instantiation of the conformance suite
# (tests/tests/conformance.rs runs on interp, jit and llvm).
CARGO_TEST=(cargo test --workspace --release --exclude tessera-torch --exclude tessera-example
            --features tessera-tests/llvm,tessera-cli/llvm)
step "cargo build of the workspace's tests (with the LLVM backend)"
"${CARGO_TEST[@]}" --no-run 2>&1

step "waiting for the python venv"
if ! wait "$VENV_PID"; then
    cat "$VENV_LOG"
    echo "setup-venv.sh failed" >&2
    exit 1
fi
cat "$VENV_LOG"

step "cargo test (workspace, with the LLVM backend)"
export TESSERA_TPU_ORACLE=1          # enables the tests that call the real TPU compiler
export TESSERA_TORCH=1               # enables the comparisons with PyTorch
export TESSERA_PYTHON="$PWD/.venv/bin/python"
"${CARGO_TEST[@]}" 2>&1

step "the torch example's Rust tests (its kernel and op without the Python module: no libpython to link)"
cargo test --release -p tessera-example --no-default-features --features tessera/llvm,cli 2>&1

# Sampled: the conformance suite runs every library case in both dtypes on the JIT (LLVM a stable sixth of each dtype)
# against the interpreter, op_table every op in both against its reference, and the
# module tests (attention, gmm, routing, ...) their cases against theirs.
step "tessera run on the JIT, sampled (every library case runs in the conformance suite)"
for op in rmsnorm flash_attention_fwd gmm permute rope; do
    cargo run --release -q -p tessera-cli --features llvm -- run "$op" --backend jit --dtype f32
done

step "tessera check through libtpu, sampled (tests/tests/tpu_compiler.rs already compiled the library kernels for v5e/v6e/tpu7x: bf16 all on v5e and a sixth on v6e/tpu7x, f32 a twelfth)"
cargo run --release -q -p tessera-cli --features llvm -- check rmsnorm --dtype bf16
cargo run --release -q -p tessera-cli --features llvm -- check flash_attention_fwd --dtype f32 --target v6e

step "tessera wheels: maturin build (abi3) of the package and of the user-kernel example"
rm -rf target/wheels
PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin build --release -q -m interop/torch/Cargo.toml -o target/wheels 2>&1
PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin build --release -q -m interop/torch/example/Cargo.toml -o target/wheels 2>&1

step "a fresh venv with no Rust on PATH: install the wheels, smoke-test them, run pytest against them"
# The fresh venv's own site-packages holds only the two wheels; torch, jax, libtpu,
# transformers and pytest come from .venv through a .pth that sys.path appends after it
# (so the wheels win over anything in .venv, and 5 GB of torch is not installed twice).
WHEEL_VENV="$PWD/target/wheel-venv"
rm -rf "$WHEEL_VENV"
"${PYTHON:-python3}" -m venv "$WHEEL_VENV"
echo "$PWD/.venv/lib/python3.11/site-packages" > "$WHEEL_VENV/lib/python3.11/site-packages/zz_tessera_test_deps.pth"
# The ninja package finds its binary in the running venv's bin (where `pip install ninja`
# puts it); the emulated tpu device's one-time C++ build needs it there.
ln -s "$PWD/.venv/bin/ninja" "$WHEEL_VENV/bin/ninja"
NO_RUST_PATH=""
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
    [ -e "$d/cargo" ] || [ -e "$d/rustc" ] || NO_RUST_PATH="${NO_RUST_PATH:+$NO_RUST_PATH:}$d"
done
export TORCH_DEVICE_BACKEND_AUTOLOAD=0   # TorchTPU must not claim the `tpu` device here
export TESSERA_CACHE_DIR="$PWD/target/tessera-cache"   # the emulated device's C++ build
PATH="$NO_RUST_PATH" "$WHEEL_VENV/bin/python" -m pip install --disable-pip-version-check -q \
    --no-deps --no-index --ignore-installed target/wheels/*.whl
PATH="$NO_RUST_PATH" "$WHEEL_VENV/bin/python" scripts/wheel_smoke.py

# Two pytest workers (pytest-xdist), a test file per worker at a time: most tests hold one
# core (torch on one thread), and files keep their order-dependent checks together.
step "pytest tests/python (the PyTorch face, against the installed wheels; two workers)"
PATH="$NO_RUST_PATH" "$WHEEL_VENV/bin/python" -m pytest -q -n 2 --dist loadfile --durations=15 tests/python
