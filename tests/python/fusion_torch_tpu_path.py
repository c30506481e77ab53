"""DeferAndFuse's TorchTPU path, up to submission, on a machine without a TPU.

Run by test_fusion_tpu.py in its own process (TorchTPU and the emulated `tpu` device must not
share one). Flushes of CPU tensors are routed through the `tpu` device's path
(`tessera._fusion_device.route`) with `tessera._tpu.TorchTpuRunner` itself: each fused kernel
is lowered to a StableHLO module holding its Mosaic, `register_custom_kernel`-ed through
TorchTPU's real API (once: `lookup_custom_kernel` first) and called with `call_custom_kernel`.
With no TPU, the stand-in's `call_custom_kernel` checks that TorchTPU knows the module
under that name and key and runs the launch on the interpreter into fresh results (as
TorchTPU returns them), so the walk's copies into the placeholders are exercised too.

Workloads: the 8-op chain (f32, bf16), RMSNorm, softmax, a two-kernel graph (a column sum and
its reader, so a temporary crosses kernels), and autograd's backward ops; each flushed twice. The
results are compared with eager PyTorch (strict mode) here; the report carries the
registrations and calls per kernel, and which `jax` modules were imported (none may be).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python tests/python/fusion_torch_tpu_path.py OUTDIR
"""
import collections
import json
import os
import sys

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from torch_tpu._internal.pallas import tpu_torch_pallas  # noqa: E402  (TorchTPU's kernel API)

import tessera  # noqa: E402
from tessera import _fusion_device, _tpu, fusion  # noqa: E402
from fusion_workloads import chain, rmsnorm  # noqa: E402

DEFER = tessera.EagerMode.DEFER_AND_FUSE


class StandInApi:
    """TorchTPU's kernel API: registration and lookup are TorchTPU's own; `call_custom_kernel`
    (which needs a TPU) checks the module is registered and runs it on the interpreter."""

    def __init__(self):
        self.registered = collections.Counter()  # kernel name -> register_custom_kernel calls
        self.calls = collections.Counter()  # kernel name -> call_custom_kernel calls
        self.modules = {}  # (name, key) -> module text
        self.launch = None  # (program, i): set by the runner just before it calls

    def lookup_custom_kernel(self, name, key):
        return tpu_torch_pallas.lookup_custom_kernel(name, key)

    def register_custom_kernel(self, name, key, serialized_mlir_module):
        self.registered[name] += 1
        self.modules[(name, key)] = serialized_mlir_module
        return tpu_torch_pallas.register_custom_kernel(name, key, serialized_mlir_module=serialized_mlir_module)

    def call_custom_kernel(self, name, key, inputs, output_shapes):
        if not tpu_torch_pallas.lookup_custom_kernel(name, key):
            raise AssertionError(f"call_custom_kernel({name}): TorchTPU does not know this module")
        program, i = self.launch
        if program.kernel_name(i) != name:
            raise AssertionError(f"call_custom_kernel({name}) for launch {program.kernel_name(i)}")
        self.calls[name] += 1
        outs = [torch.empty_like(o) for o in output_shapes]  # fresh results, as TorchTPU's
        program.emulate(i, [t.contiguous() for t in inputs], outs)
        return outs


class StandInRunner(_tpu.TorchTpuRunner):
    """`TorchTpuRunner` unchanged (module cache, register once, call), over the stand-in API."""

    def __init__(self):
        self.api = StandInApi()

    def __call__(self, plan, i, inputs, outputs):
        self.api.launch = (plan, i)
        return super().__call__(plan, i, inputs, outputs)


def colsum_then_scale(x):
    s = torch.tanh(x).sum(0, keepdim=True)  # a column sum: its reader starts a new kernel
    return x * s


def backward_ops(g, x):
    # Autograd's backward ops, called directly: with TorchTPU loaded the autograd engine
    # probes for TPU devices (a metadata server this machine does not have), so no
    # backward() here; test_fusion_tpu.py runs real backward passes on the emulated device.
    aten = torch.ops.aten
    return aten.silu_backward(g, x) + aten.tanh_backward(g, torch.tanh(x)) + aten._softmax_backward_data(g, torch.softmax(x, -1), -1, x.dtype)


def main(outdir):
    torch.manual_seed(0)
    x = torch.randn(96, 256)
    w = torch.rand(256) + 0.5
    work = {
        "chain_f32": (chain, (x,), 1e-5),
        "chain_bf16": (chain, (x.bfloat16(),), 2e-2),
        "rmsnorm": (rmsnorm, (x, w), 1e-5),
        "softmax": (lambda t: torch.softmax(t * 2.0, -1), (x,), 1e-5),
        "colsum_then_scale": (colsum_then_scale, (x,), 1e-4),
        "backward_ops": (backward_ops, (torch.randn(96, 256), x), 1e-5),
    }
    runner = StandInRunner()
    report = {}
    with _fusion_device.route("cpu", runner):
        for name, (fn, args, tol) in work.items():
            want = fn(*args)
            before = (sum(runner.api.registered.values()), sum(runner.api.calls.values()))
            runs = []
            for _ in range(2):  # the second flush: same structure, nothing new registered
                fusion.reset_stats()
                with tessera.set_eager_mode(DEFER):
                    got = fn(*args)
                    fusion.flush()
                s = fusion.stats()
                if s["fallbacks"] or s["kernels_launched"] == 0:
                    raise AssertionError(f"{name}: {s}")
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)
                runs.append({"kernels": s["kernels_launched"], "registered": sum(runner.api.registered.values()), "calls": sum(runner.api.calls.values())})
            report[name] = {"before": before, "runs": runs}
    os.makedirs(outdir, exist_ok=True)
    files = []
    for (kname, key), text in sorted(runner.api.modules.items()):
        path = os.path.join(outdir, f"{kname}.{key[:12]}.stablehlo.mlir")
        with open(path, "w") as f:
            f.write(text)
        files.append(path)
    jax_loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
    print(json.dumps({"work": report, "registered": dict(runner.api.registered), "calls": dict(runner.api.calls),
                      "modules": files, "jax_modules": jax_loaded}))


if __name__ == "__main__":
    main(sys.argv[1])
