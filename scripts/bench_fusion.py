#!/usr/bin/env python3
"""DeferAndFuse on the CPU: an 8-op elementwise chain and RMSNorm written in plain torch ops,
`F.layer_norm` (one aten op, decomposed by the mode) and a residual sum with the LayerNorm
after it, [4096, 4096] f32 (or --dtype bfloat16), strict eager vs DEFER_AND_FUSE (the generated kernels on TESSERA_BACKEND,
the JIT by default) vs torch.compile(backend="tessera") vs torch.compile (inductor, unless
--no-inductor).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python scripts/bench_fusion.py [--iters 7] [--size 4096] [--threads N] [--dtype bfloat16]

Each figure is the median of --iters timed calls after one warm-up call (which compiles:
the deferred path's kernels are cached by structure, inductor's by its own cache). The
deferred call includes recording the ops and the flush (planning is a cache hit). Prints one
line per workload with the medians in ms, each way's speed-up over strict eager, the
deferred and tessera-compiled times over inductor's, and the kernels launched per call, and
under it the median CPU time a call of each way (process CPU time, all threads: on a machine
other jobs load, the figure they disturb least; with --threads 1 the fair one, as OpenMP
threads that spin-wait count too); then (unless --no-memory) the peak
resident memory of one call of each way in a fresh process, above the inputs (VmHWM after
resetting it through /proc/self/clear_refs; Linux).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import tessera
from tessera import fusion


def chain(x):
    y = x * 1.5 + 0.25
    y = torch.tanh(y)
    y = y * y
    y = torch.exp(-y)
    y = torch.maximum(y, x)
    y = torch.sigmoid(y) - 0.5
    return y.clamp(min=-0.2, max=0.4)


def rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


def add_layernorm(x, r, w, b):
    """A transformer block's residual sum and the next LayerNorm; both results live."""
    h = x + r
    return h, torch.nn.functional.layer_norm(h, h.shape[-1:], w, b)


CPU = {}


def median_ms(fn, iters):
    """Median wall time of `iters` calls after a warm-up, in ms; their median CPU time of the
    process (all threads) goes to CPU["last"]."""
    fn()
    ts, cs = [], []
    for _ in range(iters):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    CPU["last"] = statistics.median(cs) * 1e3
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the inputs' dtype (the memory figures are f32's)")
    ap.add_argument("--threads", type=int, help="threads for torch (eager, inductor) and for the Tessera kernels (TESSERA_THREADS)")
    ap.add_argument("--peak", nargs=2, metavar=("WORKLOAD", "WAY"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peak:
        return peak(a.peak[0], a.peak[1], a.size)
    if a.threads:
        # Read by the native module at its first kernel run, which comes after this.
        os.environ["TESSERA_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    n = a.size
    dtype = getattr(torch, a.dtype)
    x = torch.randn(n, n).to(dtype)
    r = torch.randn(n, n).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, [{n}, {n}] {a.dtype}, median of {a.iters}")
    workloads = (("chain8", chain, (x,), 8), ("rmsnorm", rmsnorm, (x, w), 6), ("layernorm", layernorm, (x, w, w - 1), 1),
                 ("add+layernorm", add_layernorm, (x, r, w, w - 1), 2))
    for name, f, args, nops in workloads:
        want = f(*args)
        strict = median_ms(lambda: f(*args), a.iters)
        cpu = {"strict": CPU["last"]}

        def deferred():
            with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
                return f(*args)

        got = deferred()
        torch.testing.assert_close(got, want, **tol)
        fusion.reset_stats()
        defer = median_ms(deferred, a.iters)
        cpu["deferred"] = CPU["last"]
        s = fusion.stats()
        kernels = s["kernels_launched"] / (a.iters + 1)
        line = f"{name:13s} ({nops} aten ops): strict {strict:8.1f} ms   deferred {defer:8.1f} ms ({kernels:.0f} kernel/call, hits {s['cache_hits']}) {strict / defer:5.2f}x faster"
        t = torch.compile(f, backend="tessera")
        torch.testing.assert_close(t(*args), want, **tol)
        comp = median_ms(lambda: t(*args), a.iters)
        cpu["compile(tessera)"] = CPU["last"]
        line += f"   compile(tessera) {comp:8.1f} ms {strict / comp:5.2f}x faster"
        if not a.no_inductor:
            c = torch.compile(f)
            torch.testing.assert_close(c(*args), want, **tol)
            ind = median_ms(lambda: c(*args), a.iters)
            cpu["inductor"] = CPU["last"]
            line += f"   inductor {ind:8.1f} ms {strict / ind:5.2f}x faster   deferred/inductor {defer / ind:5.2f}x   compile(tessera)/inductor {comp / ind:5.2f}x"
        print(line, flush=True)
        ratios = f"   deferred/inductor {cpu['deferred'] / cpu['inductor']:5.2f}x" if "inductor" in cpu else ""
        print(f"{'':13s} CPU time a call (median, all threads): " + ", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items()) + f"   strict/deferred {cpu['strict'] / cpu['deferred']:5.2f}x" + ratios, flush=True)
    if not a.no_memory:
        for name in ("chain8", "rmsnorm"):
            figures = []
            for way in ("strict", "deferred"):
                out = subprocess.run([sys.executable, __file__, "--size", str(n), "--peak", name, way], capture_output=True, text=True, check=True)
                figures.append(f"{way} {float(out.stdout.split()[-1]):7.1f} MiB")
            print(f"{name:8s} peak RSS above the inputs (the result included), one call in a fresh process: " + ", ".join(figures) + f" (one [{n}, {n}] f32 tensor is {n * n * 4 / 2**20:.0f} MiB)")


def peak(name, way, n):
    x = torch.randn(n, n)
    w = torch.rand(n) + 0.5
    f, args = (chain, (x,)) if name == "chain8" else (rmsnorm, (x, w))
    # Warm up on a small shape (imports, JIT code for the small kernel), then measure.
    small = (torch.randn(8, n),) if name == "chain8" else (torch.randn(8, n), w)
    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        f(*small)
    f(*small)
    # Linux: writing 5 to clear_refs resets the high-water mark VmHWM to the current RSS.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = _status_kib("VmRSS")
    if way == "strict":
        y = f(*args)
    else:
        with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
            y = f(*args)
    print((_status_kib("VmHWM") - base) / 1024)
    del y


def _status_kib(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


if __name__ == "__main__":
    main()
