#!/usr/bin/env python3
"""The installed `tessera` wheel, checked from outside the source tree: run by
`scripts/test.sh` with the fresh venv's Python, with no cargo on PATH.

Checks that the package imports from the venv (not the checkout), that its native module
links neither libpython (abi3) nor libtorch (the stable-ABI functions are looked up at run
time), and runs every op of the table once on its smallest case (one op of each family and
more) against the table's independent f64 reference, a user kernel from the example wheel,
and one DeferAndFuse region.
"""
import os
import shutil
import subprocess
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

import tessera  # noqa: E402
from tessera import _native  # noqa: E402


def main():
    assert shutil.which("cargo") is None and shutil.which("rustc") is None, "cargo/rustc on PATH: this check is for a machine without Rust"
    where = os.path.dirname(tessera.__file__)
    assert where.startswith(sys.prefix), f"tessera imported from {where}, not from the venv {sys.prefix}"
    native = _native.__file__
    assert native.endswith(".abi3.so"), f"not an abi3 module: {native}"
    needed = [line.split("[")[1].rstrip("]") for line in subprocess.run(["readelf", "-d", native], capture_output=True, text=True, check=True).stdout.splitlines() if "(NEEDED)" in line]
    assert not [n for n in needed if n.startswith(("libpython", "libtorch", "libc10"))], f"the native module links {needed}"
    print(f"tessera {_native.__version__} from {where}; {os.path.basename(native)} needs {', '.join(needed)}")

    failures = []
    for info in _native.op_table():
        op = info["name"]
        case, _, _ = min(_native.op_cases(op), key=lambda c: sum(_prod(s) for s in c[2]))
        tensors, statics = _native.sample(op, case, "float32", 0)
        spec = tessera._ops.SPECS[op]
        tensors_it, statics_it = iter(tensors), iter(statics)
        args = [next(tensors_it, None) if i in spec.tensor_idx else next(statics_it) for i in range(len(spec.arg_names))]
        out = getattr(torch.ops.tpu, op)(*args)
        outs = out if isinstance(out, tuple) else (out,)
        refs = [torch.frombuffer(bytearray(b), dtype=torch.float64).reshape(shape) for b, shape in _native.reference(op, case, [args[i] for i in spec.tensor_idx])]
        for o, r in zip(outs, refs):
            if o.is_floating_point():
                # Equal values (the same infinity: a row that sees no key has lse -inf) and NaN
                # where the reference is NaN agree; anything else counts its distance.
                od = o.double()
                same = (od == r) | (od.isnan() & r.isnan())
                err = torch.where(same, 0.0, (od - r).abs()).nan_to_num(nan=float("inf")).max().item() if o.numel() else 0.0
                # 1e-3 of the reference's magnitude, or two ulps of a coarser output dtype
                # (bf16: 2^-6, as the CLI's tolerance) where rounding alone is larger.
                finite = r[r.isfinite()]
                tol = max(1e-3, 2 * torch.finfo(o.dtype).eps) * max(1.0, finite.abs().max().item() if finite.numel() else 1.0)
                ok = err <= tol
            else:
                ok = torch.equal(o.to(torch.int64), r.to(torch.int64))
                err = "exact" if ok else "mismatch"
            if not ok:
                failures.append(f"{op}/{case}: {err}")
        print(f"  {op:28} {case:20} ok" if not failures or not failures[-1].startswith(op + "/") else f"  {op:28} {case:20} FAILED")

    import tessera_example  # the example crate's wheel: a user kernel as torch.ops.tpu.scaled_silu

    tessera.register_ops(tessera_example)

    x, scale = torch.randn(4, 256), torch.rand(256) + 0.5
    got = torch.ops.tpu.scaled_silu(x, scale, 1.0)
    want = torch.nn.functional.silu(x) * scale
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        failures.append("scaled_silu (tessera_example)")
    print(f"  user kernel scaled_silu ({os.path.basename(tessera_example.__file__)}) {'ok' if torch.allclose(got, want, atol=1e-5, rtol=1e-5) else 'FAILED'}")

    a, w = torch.randn(64, 256), torch.randn(256)
    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        y = a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6) * w
        y = y.tolist()
    ref = (a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6) * w).tolist()
    fused_ok = torch.allclose(torch.tensor(y), torch.tensor(ref), atol=1e-5, rtol=1e-5) and tessera.fusion.stats()["kernels_launched"] > 0
    if not fused_ok:
        failures.append("DeferAndFuse RMSNorm")
    print(f"  DeferAndFuse RMSNorm region {'ok' if fused_ok else 'FAILED'}")

    if failures:
        sys.exit("wheel smoke test failed: " + "; ".join(failures))
    print(f"wheel smoke test: {len(_native.op_table())} ops, a user kernel and a fused region ok")


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
