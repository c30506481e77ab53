#!/usr/bin/env python3
"""DeferAndFuse's memory on the emulated `tpu` device: peak allocated bytes of one call of
scripts/bench_fusion.py's 8-op elementwise chain and RMSNorm, strict eager vs DEFER_AND_FUSE,
from the device allocator (`torch.tpu.max_memory_allocated()` after
`reset_peak_memory_stats()`), beside the inputs' and the output's bytes.

Deferred, a call's only allocation is its output (placeholders get memory only when a flush
materialises a result somebody holds; one fused kernel needs no temporaries), so its peak
is inputs + output; strict eager allocates every intermediate.

Then a Llama decoder block in plain ops (tests/python/test_fusion.py's), forward and backward:
the HBM bytes the fused kernels move (their cost estimate) plus the bytes of the ops that
still ran eagerly (matmuls, ...), vs the sum over every eager op's bytes in strict mode (an op's
bytes: its tensor inputs and outputs; views move none).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python scripts/fusion_memory_tpu.py [--size 1024]
"""
import argparse
import gc
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # the emulated device, not TorchTPU

import torch  # noqa: E402

import tessera  # noqa: E402
from tessera import _fusion_device, emulated_tpu, fusion  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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


class OpBytes(TorchDispatchMode):
    """Sums the bytes every executed aten op reads and writes (views and metadata ops: none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if not any(r.alias_info is not None for r in returns) and func._schema.name.split("::")[-1] not in ("empty", "empty_strided", "empty_like", "empty_unallocated", "_local_scalar_dense"):
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.ops += 1
        return out


def llama_block(d=512, f=1024, t=256, h=8):
    torch.manual_seed(1)
    p = {k: (torch.randn(*s) * 0.1).to("tpu").requires_grad_(True) for k, s in
         dict(wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d), w1=(d, f), w3=(d, f), w2=(f, d), n1=(d,), n2=(d,)).items()}
    mask = torch.ones(t, t, dtype=torch.bool).tril().to("tpu")

    def block(x):
        a = rmsnorm(x, p["n1"] + 1)
        q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
        q, k, v = (z.view(t, h, d // h).transpose(0, 1) for z in (q, k, v))
        s = (q @ k.transpose(-1, -2)) * (d // h) ** -0.5
        s = torch.where(mask, s, float("-inf")).softmax(-1)
        o = (s @ v).transpose(0, 1).reshape(t, d) @ p["wo"]
        x = x + o
        m = rmsnorm(x, p["n2"] + 1)
        return x + (torch.nn.functional.silu(m @ p["w1"]) * (m @ p["w3"])) @ p["w2"]

    x = torch.randn(t, d, device="tpu")
    rows = {}
    for mode in (tessera.EagerMode.STRICT, tessera.EagerMode.DEFER_AND_FUSE):
        fusion.reset_stats()
        _fusion_device.hbm_bytes(reset=True)
        with OpBytes() as counter, tessera.set_eager_mode(mode):  # the counter sees what executes
            block(x).square().mean().backward()
        rows[mode] = (counter.bytes, counter.ops, _fusion_device.hbm_bytes()["bytes"], fusion.stats()["kernels_launched"])
    (sb, sops, _, _), (eb, eops, fb, kernels) = rows[tessera.EagerMode.STRICT], rows[tessera.EagerMode.DEFER_AND_FUSE]
    print(f"llama block fwd+bwd (d={d}, ffn={f}, tokens={t}) on the emulated tpu, HBM bytes by op / kernel:")
    print(f"  strict:   {sops} aten ops moving {sb / MiB:8.2f} MiB")
    print(f"  deferred: {kernels} fused kernels moving {fb / MiB:8.2f} MiB (cost estimate) + {eops} eager ops moving {eb / MiB:8.2f} MiB"
          f" = {(fb + eb) / MiB:8.2f} MiB")
    print(f"  the ops the engine took: {(sb - eb) / MiB:.2f} MiB as strict aten ops vs {fb / MiB:.2f} MiB fused ({(sb - eb) / max(fb, 1):.1f}x)")


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
    llama_block()


if __name__ == "__main__":
    main()
