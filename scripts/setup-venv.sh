#!/usr/bin/env bash
# Creates the project-local Python venv (.venv) with the pinned real TPU compiler stack:
# jax/jaxlib 0.10.2 and libtpu 0.0.52, which compile for TPUs without one (DESIGN §4),
# torch 2.15.0 (PyPI's build; runs on the CPU) and torch-tpu 0.2.0 (TorchTPU; its
# kernel-registration API works without a TPU), transformers (the attention-interface
# test), and the build and test tools: maturin (the `tessera` package), ninja (the
# emulated `tpu` device's C++ extension), pytest (with xdist: two workers).
# Idempotent: a venv that already has the pins is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=(jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.52 numpy==2.4.6 torch==2.15.0 torch-tpu==0.2.0
      transformers==5.24.0 maturin==1.16.0 ninja==1.13.2 pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.151.9)
PY=${PYTHON:-python3}

if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    echo "setup-venv: installing python3-venv (apt)"
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup-venv: creating .venv"
    "$PY" -m venv .venv
fi
if .venv/bin/python - "${PINS[@]}" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
PYEOF
    echo "setup-venv: .venv is up to date"
else
    echo "setup-venv: pip install ${PINS[*]}"
    .venv/bin/python -m pip install --disable-pip-version-check -q "${PINS[@]}"
fi
