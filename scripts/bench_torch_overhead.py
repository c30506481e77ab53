#!/usr/bin/env python3
"""Per-call overhead of a Tessera torch op on a small tensor, next to the stock op.

RMSNorm on an 8x128 float32 tensor, three timings in one run, median per call over
`--reps` repetitions of `--calls` calls each:
  - stock:   torch.nn.functional.rms_norm (PyTorch's CPU kernel)
  - tessera: torch.ops.tpu.rmsnorm (dispatcher -> Python kernel -> Rust plan -> interpreter)
  - kernel:  the same plan executed natively on the interpreter, nothing around it
The overhead is tessera - kernel: what the torch op adds above the kernel's own time.
Its parts, also timed: the dispatcher calling a Python kernel that does nothing (registered
the same way, a floor for any Python-registered op), and `_native.run` called directly (the
native call: tensor attributes, plan lookup, output allocation, the kernel).
Run: .venv/bin/python scripts/bench_torch_overhead.py
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

import tessera  # noqa: E402
from tessera import _native  # noqa: E402


def per_call(fn, calls, reps):
    for _ in range(calls):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shape", default="8x128")
    args = ap.parse_args()
    m, n = map(int, args.shape.split("x"))
    torch.set_num_threads(1)
    x, w = torch.randn(m, n), torch.randn(n)
    eps = 1e-6
    stock = per_call(lambda: torch.nn.functional.rms_norm(x, (n,), w, eps), args.calls, args.reps)
    op = torch.ops.tpu.rmsnorm
    tess = per_call(lambda: op(x, w, eps), args.calls, args.reps)
    with torch.inference_mode():
        tess_inf = per_call(lambda: op(x, w, eps), args.calls, args.reps)
    lib = torch.library.Library("tessera_bench", "DEF")
    lib.define("noop(Tensor x, Tensor w, float eps=1e-06) -> Tensor")
    out = torch.empty(m, n)
    lib.impl("noop", lambda x, w, eps=1e-6: out, "CPU")
    noop = torch.ops.tessera_bench.noop
    cpu = torch.device("cpu")
    with torch.inference_mode():
        floor = per_call(lambda: noop(x, w, eps), args.calls, args.reps)
        native = per_call(lambda: _native.run("rmsnorm", (eps,), [x, w], cpu, tessera.get_target()), args.calls, args.reps)
    kernel = statistics.median(_native.time_plan("rmsnorm", (eps,), [x, w], tessera.get_target(), args.calls) for _ in range(args.reps))
    us = 1e6
    print(f"rmsnorm {m}x{n} f32, median per call over {args.reps} x {args.calls} calls")
    print(f"  stock F.rms_norm                 {stock * us:8.2f} us")
    print(f"  torch.ops.tpu.rmsnorm            {tess * us:8.2f} us   (grad mode)")
    print(f"  torch.ops.tpu.rmsnorm            {tess_inf * us:8.2f} us   (inference_mode)")
    print(f"  kernel alone (interpreter)       {kernel * us:8.2f} us")
    print(f"  parts: dispatcher -> no-op Python kernel {floor * us:6.2f} us, _native.run {native * us:6.2f} us")
    print(f"  overhead above the kernel        {(tess - kernel) * us:8.2f} us   (grad mode)")
    print(f"  overhead above the kernel        {(tess_inf - kernel) * us:8.2f} us   (inference_mode)")


if __name__ == "__main__":
    main()
