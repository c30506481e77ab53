#!/usr/bin/env bash
# Installs LLVM 22 (Debian's llvm-22-dev) for the LLVM CPU backend (`--features llvm`,
# inkwell 0.11 through llvm-sys 221) if it is missing. Run as root on a fresh Debian machine
# (the test script does); prints the prefix to export as LLVM_SYS_221_PREFIX.
set -euo pipefail
PREFIX=/usr/lib/llvm-22
if [ ! -x "$PREFIX/bin/llvm-config" ]; then
    echo "setup-llvm: installing llvm-22-dev (apt)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev >/dev/null
fi
"$PREFIX/bin/llvm-config" --version >&2
echo "$PREFIX"
