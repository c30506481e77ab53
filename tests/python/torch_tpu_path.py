"""The TorchTPU path of every op, up to submission, on a machine without a TPU.

Run by test_torch_tpu_path.py in its own process (TorchTPU and the emulated `tpu` device
must not share one): for each op and sample of test_ops.py (float32 and bfloat16), the op's
plan is walked by `tessera._tpu.run_plan`, the function the `tpu` kernels use, with a
runner that does everything TorchTPU's runner does before `call_custom_kernel` (lower each
launch's module, key it, `register_custom_kernel` it through TorchTPU's API, check
`lookup_custom_kernel`) and then executes the launch on the interpreter, so later launches
see real values. The results must equal the CPU op's exactly (same kernels), which checks
the plan walk itself: views, the head-major relayout, host arrays, multi-launch chains.

Writes every distinct module to OUTDIR and prints one JSON object: the modules, the ops
covered, and whether `jax` was imported (it must not be).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python tests/python/torch_tpu_path.py OUTDIR
"""
import json
import os
import sys

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from torch_tpu._internal.pallas import tpu_torch_pallas  # noqa: E402,F401  (TorchTPU's kernel API)

import tessera  # noqa: E402,F401
from tessera import _ops, _tpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_ops  # noqa: E402  (the samples)

TARGET = "v6e"


class RegisteringRunner(_tpu.TorchTpuRunner):
    """TorchTPU's runner up to `call_custom_kernel`, then the interpreter (no TPU here)."""

    def __init__(self):
        super().__init__()
        self.modules = {}

    def __call__(self, plan, i, inputs, outputs):
        module = _tpu.module_of(plan, i)
        self.register(module)
        if not self.api.lookup_custom_kernel(module.name, module.key):
            raise AssertionError(f"{module.name}: TorchTPU does not find the module just registered")
        self.modules[module.key] = module
        plan.emulate(i, [t.contiguous() for t in inputs], outputs)
        return outputs


def positional(spec, args, kwargs):
    """The call's arguments in schema order, defaults filled."""
    full = list(args) + [kwargs[n] if n in kwargs else spec.defaults[i] for i, n in enumerate(spec.arg_names) if i >= len(args)]
    return tuple(full)


def main(outdir):
    runner = RegisteringRunner()
    covered = []
    for op, samples in sorted(test_ops.SAMPLES.items()):
        spec = _ops.SPECS[op]
        if spec.alias_of is not None:
            continue  # an alias (flash_attention): its kernels are flash_attention_fwd's
        for name, dtypes, _ in samples:
            for dtype in dtypes:
                args, kwargs = test_ops.build(op, name, dtype)
                tensors, statics = spec.split(positional(spec, args, kwargs))
                got = _tpu.run_plan(spec.native, op, statics, tensors, TARGET, run=runner)
                want = test_ops.as_tuple(getattr(torch.ops.tpu, op)(*args, **kwargs))
                for j, (g, w) in enumerate(zip(got, want)):
                    if g.dtype != w.dtype or g.shape != w.shape or not test_ops.bits_equal(g, w):
                        raise AssertionError(f"{op}/{name}/{dtype}: result {j} of the tpu path differs from the CPU op")
                covered.append(f"{op}/{name}/{str(dtype).removeprefix('torch.')}")
    os.makedirs(outdir, exist_ok=True)
    files = []
    for key, module in sorted(runner.modules.items()):
        path = os.path.join(outdir, f"{module.name}.{key[:12]}.stablehlo.mlir")
        with open(path, "w") as f:
            f.write(module.text)
        files.append(path)
    jax_loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
    print(json.dumps({"modules": files, "covered": covered, "jax_modules": jax_loaded}))


if __name__ == "__main__":
    main(sys.argv[1])
