"""Every `torch.ops.tpu.*` op on the emulated `tpu` device (PrivateUse1, host memory).

For each op and sample of test_ops.py (float32 and bfloat16): the inputs moved to `tpu`,
the op dispatched there must reach the PrivateUse1 kernel (the tpu path: plan, modules,
runner; counted at the runner) and return `tpu` tensors equal to the CPU op's results.
The kernels are the same on both sides, so equality is exact. No call may copy a value
from the device to the host (counted by the emulated device). The differentiable ops'
gradients on `tpu` must equal the CPU gradients too (the backward formulas mix the
backward kernels with stock glue ops, which run through the CPU fallback; tolerance f32).
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from tessera import _tpu, emulated_tpu  # noqa: E402

import test_ops  # noqa: E402  (the samples)

CASES = [(op, name, dt) for op, samples in sorted(test_ops.SAMPLES.items()) for name, dtypes, _ in samples for dt in dtypes]


@pytest.fixture(scope="module")
def launches():
    """Enables the emulated device and counts the launches its runner executes."""
    emulated_tpu.enable()
    runner = _tpu.runner()
    assert isinstance(runner, _tpu.EmulatorRunner)
    count = {"n": 0}
    call = runner.__class__.__call__

    def counting(self, plan, i, inputs, outputs):
        assert all(t.device.type == "tpu" for t in [*inputs, *outputs])
        count["n"] += 1
        return call(self, plan, i, inputs, outputs)

    runner.__class__.__call__ = counting
    yield count
    runner.__class__.__call__ = call


def to_tpu(x, requires_grad=False):
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().to("tpu")
    return t.requires_grad_() if requires_grad else t


def device_to_host():
    return torch.tpu.transfer_stats()["device_to_host.count"]


@pytest.mark.parametrize("op,name,dtype", CASES, ids=[f"{o}-{n}-{str(d).removeprefix('torch.')}" for o, n, d in CASES])
def test_op_on_tpu_matches_cpu(launches, op, name, dtype):
    args, kwargs = test_ops.build(op, name, dtype)
    want = test_ops.as_tuple(getattr(torch.ops.tpu, op)(*args, **kwargs))
    before = launches["n"]
    tpu_args, tpu_kwargs = [to_tpu(a) for a in args], {k: to_tpu(v) for k, v in kwargs.items()}
    reads = device_to_host()
    got = test_ops.as_tuple(getattr(torch.ops.tpu, op)(*tpu_args, **tpu_kwargs))
    reads = device_to_host() - reads
    assert launches["n"] > before, f"{op} did not reach the tpu (PrivateUse1) kernel"
    assert reads == 0, f"{op}/{name}: {reads} device-to-host copies in one call"
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.device.type == "tpu", f"result {j} is on {g.device}"
        assert g.dtype == w.dtype and g.shape == w.shape
        assert test_ops.bits_equal(g.cpu(), w), f"{op}/{name}: result {j} differs from the CPU op"


GRAD_CASES = [(op, name) for op, name, dt in CASES if dt == torch.float32 and op in test_ops.DIFF_ARGS]


@pytest.mark.parametrize("op,name", GRAD_CASES, ids=[f"{o}-{n}" for o, n in GRAD_CASES])
def test_gradients_on_tpu_match_cpu(launches, op, name):
    args, kwargs = test_ops.build(op, name, torch.float32, requires_grad=True)
    diff = test_ops.DIFF_ARGS[op]
    outs = test_ops.diff_outs(op, kwargs)

    def grads(call_args):
        results = test_ops.as_tuple(getattr(torch.ops.tpu, op)(*call_args, **{k: to_tpu(v) if call_args is not args else v for k, v in kwargs.items()}))
        picked = [results[i] for i in (outs or range(len(results)))]
        loss = sum((r.float() * (k + 1)).sum() for k, r in enumerate(picked))
        return torch.autograd.grad(loss, [call_args[i] for i in diff])

    want = grads(args)
    got = grads(tuple(to_tpu(a, requires_grad=i in diff) for i, a in enumerate(args)))
    for i, g, w in zip(diff, got, want):
        assert g.device.type == "tpu"
        err = test_ops.rel_err(g.cpu().double(), w.double())
        assert err <= 1e-5, f"{op}/{name}: gradient of argument {i} differs on tpu by {err:.2e}"


def test_lse_gradients_on_tpu(launches):
    test_ops.check_lse_gradients("tpu", compiled=False)


def test_mixed_devices_are_refused(launches):
    """A call mixing `tpu` and CPU tensors reaches the tpu kernel whichever comes first: it
    is refused as the fake kernel refuses it under torch.compile (was: run, the result on the
    first tensor's device, then a backward failing inside autograd)."""
    T = torch.ops.tpu
    x, w = torch.randn(6, 8), torch.randn(8)
    q = torch.randn(1, 2, 8, 16)
    calls = [
        (lambda: T.rmsnorm(x.to("tpu"), w), "kernel `rmsnorm`, input `weight`: a tensor on cpu, `x` is on tpu:0"),
        (lambda: T.rmsnorm(x, w.to("tpu")), "kernel `rmsnorm`, input `weight`: a tensor on tpu:0, `x` is on cpu"),
        (lambda: T.rmsnorm(x.to("tpu").requires_grad_(), w.clone().requires_grad_()), "kernel `rmsnorm`, input `weight`"),
        (lambda: T.matmul(x.to("tpu"), torch.randn(8, 3)), "kernel `matmul`, input `y`"),
        # Without gradients flash_attention runs its own kernel, the op the caller named.
        (lambda: T.flash_attention(q.to("tpu"), q, q), "kernel `flash_attention`, input `k`"),
    ]
    for call, needle in calls:
        with pytest.raises(ValueError, match=r"error\[operand-device\]") as info:
            call()
        assert needle in str(info.value), str(info.value)


def test_unsupported_dtype_names_the_kernel_and_input(launches):
    """On `tpu` as on the CPU: the op, the operand and the rule (was a bare "unsupported dtype")."""
    for dev in ("cpu", "tpu"):
        with pytest.raises(ValueError, match=r"error\[operand-dtype\]: kernel `rmsnorm`, input `x`: tensors of float16 are not supported"):
            torch.ops.tpu.rmsnorm(torch.randn(3, 8, device=dev).half(), torch.ones(8, device=dev).half())
