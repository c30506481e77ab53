#!/usr/bin/env python3
"""DeferAndFuse's memory on the emulated `tpu` device: peak allocated bytes of one call of
scripts/bench_fusion.py's 8-op elementwise chain and RMSNorm, strict eager vs DEFER_AND_FUSE,
from the device allocator (`torch.tpu.max_memory_allocated()` after
`reset_peak_memory_stats()`), beside the inputs' and the output's bytes.

Deferred, a call's only allocation is its output (placeholders get memory only when a flush
materialises a result somebody holds; one fused kernel needs no temporaries), so its peak
is inputs + output; strict eager allocates every intermediate.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python scripts/fusion_memory_tpu.py [--size 1024]
"""
import argparse
import gc
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # the emulated device, not TorchTPU

import torch  # noqa: E402

import tessera  # noqa: E402
from tessera import emulated_tpu, fusion  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fusion import chain, rmsnorm  # noqa: E402  (the same workloads as the speed bench)

MiB = 1 << 20


def peak_bytes(fn, args, mode):
    """Peak allocated bytes above what is allocated before the call (the inputs)."""
    gc.collect()
    torch.tpu.reset_peak_memory_stats()
    start = torch.tpu.memory_allocated()
    with tessera.set_eager_mode(mode):
        out = fn(*args)
    peak = torch.tpu.max_memory_allocated() - start
    return peak, out.numel() * out.element_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    n = ap.parse_args().size
    emulated_tpu.enable()
    x = torch.randn(n, n, device="tpu")
    w = torch.rand(n, device="tpu") + 0.5
    print(f"emulated tpu, {n}x{n} f32: peak allocated bytes of one call (torch.tpu.max_memory_allocated)")
    for name, fn, args in (("chain8", chain, (x,)), ("rmsnorm", rmsnorm, (x, w))):
        ins = sum(a.numel() * a.element_size() for a in args)
        peak = {}
        for mode in (tessera.EagerMode.STRICT, tessera.EagerMode.DEFER_AND_FUSE):
            fusion.reset_stats()
            peak[mode], out = peak_bytes(fn, args, mode)
        kernels = fusion.stats()["kernels_launched"]
        deferred, strict = peak[tessera.EagerMode.DEFER_AND_FUSE], peak[tessera.EagerMode.STRICT]
        verdict = "= inputs + output" if deferred == out else f"!= inputs + output ({(deferred - out) / MiB:+.2f} MiB)"
        print(f"{name:8s} inputs {ins / MiB:6.2f} MiB  output {out / MiB:6.2f} MiB  "
              f"deferred peak inputs + {deferred / MiB:6.2f} MiB ({verdict}, {kernels} kernel)  "
              f"strict peak inputs + {strict / MiB:6.2f} MiB ({strict / max(deferred, 1):.1f}x)")


if __name__ == "__main__":
    main()
