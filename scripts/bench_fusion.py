#!/usr/bin/env python3
"""DeferAndFuse on the CPU: an 8-op elementwise chain and RMSNorm written in plain torch ops,
[4096, 4096] f32, strict eager vs DEFER_AND_FUSE (the generated kernels on TESSERA_BACKEND,
the JIT by default) vs torch.compile (inductor, unless --no-inductor).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python scripts/bench_fusion.py [--iters 7] [--size 4096]

Each figure is the median of --iters timed calls after one warm-up call (which compiles:
the deferred path's kernels are cached by structure, inductor's by its own cache). The
deferred call includes recording the ops and the flush (planning is a cache hit). Prints one
line per workload with the medians in ms and the ratios strict/deferred and
deferred/inductor, and the kernels launched per call.
"""
import argparse
import statistics
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


def median_ms(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--no-inductor", action="store_true")
    a = ap.parse_args()
    n = a.size
    x = torch.randn(n, n)
    w = torch.rand(n) + 0.5
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, [{n}, {n}] f32, median of {a.iters}")
    for name, f, args, nops in (("chain8", chain, (x,), 8), ("rmsnorm", rmsnorm, (x, w), 6)):
        want = f(*args)
        strict = median_ms(lambda: f(*args), a.iters)

        def deferred():
            with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
                return f(*args)

        got = deferred()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        fusion.reset_stats()
        defer = median_ms(deferred, a.iters)
        s = fusion.stats()
        kernels = s["kernels_launched"] / (a.iters + 1)
        line = f"{name:8s} ({nops} aten ops): strict {strict:8.1f} ms   deferred {defer:8.1f} ms ({kernels:.0f} kernel/call, hits {s['cache_hits']})   strict/deferred {strict / defer:5.2f}x"
        if not a.no_inductor:
            c = torch.compile(f)
            torch.testing.assert_close(c(*args), want, rtol=1e-5, atol=1e-5)
            ind = median_ms(lambda: c(*args), a.iters)
            line += f"   inductor {ind:8.1f} ms   deferred/inductor {defer / ind:5.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
