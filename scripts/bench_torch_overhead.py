#!/usr/bin/env python3
"""Per-call overhead of a Tessera torch op on a small tensor: before and after the CPU path
through libtorch's stable ABI, in one run, next to the stock op.

RMSNorm on an 8x128 float32 tensor, median per call over `--reps` repetitions of `--calls`
calls each, in grad mode (the default) and under inference_mode:
  - stock:   torch.nn.functional.rms_norm (PyTorch's CPU kernels)
  - after:   torch.ops.tpu.rmsnorm as registered (dispatcher -> autograd fast path or CPU
             kernel -> `_native.call_cpu`: tensors read and results allocated through
             libtorch's stable C ABI, interop/torch/src/dispatch.rs)
  - before:  the same op as it was registered before (`tessera_bench::rmsnorm`: a Python
             CPU kernel calling `_native.run`, which reads every tensor attribute and
             allocates results through Python, and torch.library.register_autograd's
             generic autograd kernel)
  - kernel:  the op's plan executed natively on the CPU backend, nothing around it
The overhead of a path is its time minus the kernel's. `TESSERA_NATIVE_DISPATCH=1` makes
"after" the kernels registered from Rust (no Python kernel at all).
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


def per_call(fns, kernel, calls, reps):
    """Per repetition, seconds per call of each function of `fns` (a dict) and the kernel's
    own time (`kernel(calls)`: the median of `calls` executions), interleaved so that
    machine noise hits them alike. Returns `{name: [seconds per rep]}` with "kernel"."""
    for fn in fns.values():
        for _ in range(calls):
            fn()
    samples = {k: [] for k in [*fns, "kernel"]}
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[k].append((time.perf_counter() - start) / calls)
        samples["kernel"].append(kernel(calls))
    return samples


def overhead(samples, name):
    """The median over repetitions of a call's time minus the kernel's in the same one."""
    return statistics.median(c - k for c, k in zip(samples[name], samples["kernel"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shape", default="8x128")
    args = ap.parse_args()
    m, n = map(int, args.shape.split("x"))
    torch.set_num_threads(1)
    x, w = torch.randn(m, n), torch.randn(n)
    eps = 1e-6
    cpu = torch.device("cpu")
    lib = torch.library.Library("tessera_bench", "DEF")
    lib.define("rmsnorm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor")
    lib.impl("rmsnorm", lambda x, w, eps=1e-6: _native.run("rmsnorm", (eps,), [x, w], cpu, tessera.get_target())[0], "CPU")
    torch.library.register_autograd("tessera_bench::rmsnorm", lambda ctx, g: (None, None, None), lib=lib)
    before_op, op = torch.ops.tessera_bench.rmsnorm, torch.ops.tpu.rmsnorm
    calls = {
        "stock": lambda: torch.nn.functional.rms_norm(x, (n,), w, eps),
        "before": lambda: before_op(x, w, eps),
        "after": lambda: op(x, w, eps),
    }
    kernel = lambda n: _native.time_plan("rmsnorm", (eps,), [x, w], tessera.get_target(), n)  # noqa: E731
    grad = per_call(calls, kernel, args.calls, args.reps)
    with torch.inference_mode():
        inf = per_call(calls, kernel, args.calls, args.reps)
    med = statistics.median
    us = 1e6
    mode = "kernels registered from Rust" if os.environ.get("TESSERA_NATIVE_DISPATCH") == "1" else "Python kernel -> call_cpu"
    print(f"rmsnorm {m}x{n} f32, medians over {args.reps} interleaved repetitions of {args.calls} calls (after: {mode})")
    print(f"  stock F.rms_norm          {med(grad['stock']) * us:8.2f} us")
    print(f"  kernel alone              {med(grad['kernel']) * us:8.2f} us   (TESSERA_BACKEND={os.environ.get('TESSERA_BACKEND', 'jit')})")
    print(f"  {'':24}  {'grad mode':>12}  {'inference':>12}")
    for way in ("before", "after"):
        print(f"  {way + ': call':24}  {med(grad[way]) * us:9.2f} us  {med(inf[way]) * us:9.2f} us")
    for way in ("before", "after"):
        print(f"  {way + ': overhead':24}  {overhead(grad, way) * us:9.2f} us  {overhead(inf, way) * us:9.2f} us")
    print(f"  overhead after / before   {overhead(grad, 'after') / overhead(grad, 'before'):9.2f}     {overhead(inf, 'after') / overhead(inf, 'before'):9.2f}")


if __name__ == "__main__":
    main()
