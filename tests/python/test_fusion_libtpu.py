"""The libtpu tier of the Python fusion tests (`TESSERA_TPU_ORACLE=1`): the fused kernels the
DeferAndFuse tests generate (test_fusion*.py, CPU and `tpu` device) compile with the real TPU
compiler for v5e, v6e and tpu7x.

With the oracle on, conftest.py sets `TESSERA_FUSION_MODULES` for the session, so every flush
writes its program's kernels as StableHLO modules for the three targets (each target's own
program: blocks follow its VMEM), and orders this test after every other; run alone, it runs
test_fusion.py and test_fusion_tpu.py in a child process to produce them. The modules compile
in child processes through interop/python/tpu_compile.py (compile-only, no TPU). Verdicts are
cached under target/tpu-verdicts/ by module text, target and libtpu version (the Rust oracle
tier's cache and key), so a rerun compiles only new kernels.

Compiles take 0.05-20 s: by default a sample of `TESSERA_FUSION_ORACLE_SAMPLE` (100) distinct
kernels per target, chosen by the hash of their text (a uniform, stable sample);
`TESSERA_FUSION_ORACLE_ALL=1` compiles every one (test_fusion_random.py alone makes about 900
per target).
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TARGETS = ("v5e", "v6e", "tpu7x")

pytestmark = [
    pytest.mark.skipif(os.environ.get("TESSERA_TPU_ORACLE") != "1", reason="set TESSERA_TPU_ORACLE=1 to compile with libtpu"),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None or importlib.util.find_spec("libtpu") is None,
                       reason="jax and libtpu are not installed (the compile-only TPU compiler)"),
]


def _fnv1a(data: bytes, basis: int) -> int:
    h = basis
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def verdict_key(text: str, target: str, version: str) -> str:
    """tests/src/oracle.rs's cache key (both tiers share target/tpu-verdicts/)."""
    data = f"{version}\n{target}\n{text}".encode()
    return f"{_fnv1a(data, 0xCBF29CE484222325):016x}{_fnv1a(data, 0x6C62272E07BB0142):016x}"


def _modules_dir(tmp_path_factory) -> Path:
    out = os.environ.get("TESSERA_FUSION_MODULES")
    if out and Path(out).is_dir() and any(Path(out).glob("*.stablehlo.mlir")):
        return Path(out)
    # Run alone: produce them with the fusion tests in a child process.
    out = tmp_path_factory.mktemp("fusion-modules")
    env = dict(os.environ, TESSERA_FUSION_MODULES=str(out), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("TESSERA_TPU_ORACLE")  # the child must not recurse into this test
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_fusion.py"), str(HERE / "test_fusion_tpu.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out


def _sample(modules, n):
    """`n` of the (digest, path, text) modules, by digest: stable and uniform."""
    return sorted(modules)[:n]


def test_generated_fusion_kernels_compile_for_v5e_v6e_tpu7x(tmp_path_factory):
    found = _modules_dir(tmp_path_factory)
    version = importlib.metadata.version("libtpu")
    cache = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "tpu-verdicts"
    cache.mkdir(parents=True, exist_ok=True)
    everything = os.environ.get("TESSERA_FUSION_ORACLE_ALL") == "1"
    n = int(os.environ.get("TESSERA_FUSION_ORACLE_SAMPLE", "100"))

    jobs, totals = [], {}
    for target in TARGETS:
        distinct = {}
        for path in found.glob(f"*.{target}.*.stablehlo.mlir"):
            text = path.read_text()
            distinct.setdefault(hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), (path, text))
        totals[target] = len(distinct)
        chosen = sorted(distinct.items()) if everything else _sample(distinct.items(), n)
        jobs += [(target, path, text) for _, (path, text) in chosen]
    assert all(totals.values()), f"no fused kernels were written for some target: {totals}"

    verdicts, todo = {}, {}
    for target, path, text in jobs:
        assert not text.startswith("// not lowered"), f"{path.name}: {text.strip()}"
        key = verdict_key(text, target, version)
        try:
            verdicts[(target, path)] = json.loads((cache / key).read_text())
        except (OSError, ValueError):
            todo.setdefault(target, []).append((path, key))
    # One compiler process per target, all at once; the paths go in a list file (`@LIST`):
    # thousands of them pass the kernel's limit on a command line (E2BIG).
    lists = tmp_path_factory.mktemp("tpu-compile-lists")
    procs = {}
    for target, items in todo.items():
        listed = lists / f"{target}.txt"
        listed.write_text("".join(f"{p}\n" for p, _ in items))
        procs[target] = subprocess.Popen([sys.executable, str(ROOT / "interop/python/tpu_compile.py"), "--target", target, f"@{listed}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for target, items in todo.items():
        stdout, stderr = procs[target].communicate(timeout=1800)
        results = {r["file"]: r for r in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}
        assert len(results) == len(items), stderr[-4000:]
        for path, key in items:
            r = results[str(path)]
            v = {"ok": r["ok"], "error": r["error"] or "", "libtpu": version, "target": target}
            if r["ok"] or not (v["error"].startswith("timeout") or "failed to start" in v["error"]):
                (cache / key).write_text(json.dumps(v))
            verdicts[(target, path)] = v
    rejected = [(t, p.name, v["error"][:500]) for (t, p), v in verdicts.items() if not v["ok"]]
    assert not rejected, rejected
    compiled = {t: sum(1 for (tt, _) in verdicts if tt == t) for t in TARGETS}
    print(f"\nlibtpu accepted the fusion tests' kernels: {compiled} of {totals} distinct per target"
          f" ({sum(len(v) for v in todo.values())} compiled now, the rest cached)")
