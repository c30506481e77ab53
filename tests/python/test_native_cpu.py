"""The CPU kernels' path through libtorch's stable C ABI (interop/torch/src/dispatch.rs):
tensors read and results allocated by handle, every argument kind of the schemas, the
autograd kernel's no-gradient shortcut, the handles' ownership (no leak over many calls),
and the kernels registered from Rust (`TESSERA_NATIVE_DISPATCH=1`, in a subprocess) with
their errors as Python exceptions.

Run: TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_native_cpu.py
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tessera  # noqa: F401

tpu = torch.ops.tpu


def rmsnorm_ref(x, w, eps=1e-6):
    xf = x.double()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(16, 256), id="contiguous"),
        pytest.param(lambda: torch.randn(256, 16).t(), id="transposed"),
        pytest.param(lambda: torch.randn(16, 512)[:, ::2], id="strided"),
        pytest.param(lambda: torch.randn(1, 256).expand(16, 256), id="stride0"),
        pytest.param(lambda: torch.randn(4, 16, 256)[1], id="offset"),
        pytest.param(lambda: torch._neg_view(torch.randn(16, 256)), id="neg-view"),
        pytest.param(lambda: torch.frombuffer(bytearray(2) + bytearray(torch.randn(16, 256).numpy().tobytes()), dtype=torch.float32, count=16 * 256, offset=2).reshape(16, 256), id="misaligned"),
        pytest.param(lambda: torch.randn(16, 256).to(torch.bfloat16)[:, :], id="bf16"),
    ],
)
def test_layouts_are_read_as_their_values(make):
    x = make()
    w = torch.randn(256, dtype=x.dtype)
    torch.testing.assert_close(tpu.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w), atol=2e-2 if x.dtype == torch.bfloat16 else 1e-5, rtol=1e-2 if x.dtype == torch.bfloat16 else 1e-5)


def test_int64_indices_are_narrowed_and_range_checked():
    logits, labels = torch.randn(8, 128), torch.randint(0, 128, (8,))
    torch.testing.assert_close(tpu.cross_entropy(logits, labels), tpu.cross_entropy(logits, labels.to(torch.int32)))
    with pytest.raises(ValueError, match=r"error\[index-range\].*cross_entropy.*labels"):
        tpu.cross_entropy(logits, torch.full((8,), 2**40))


def test_statics_of_every_kind():
    # str (router gate), bool, int, float?, int[]? (gmm tiling) and an absent Tensor?.
    logits = torch.randn(16, 8)
    w, ids = tpu.router_topk(logits, 2, "sigmoid", True)
    assert ids.shape == (16, 2) and torch.allclose(w.sum(1), torch.ones(16), atol=1e-5)
    lhs, rhs = torch.randn(256, 128), torch.randn(2, 128, 128)
    sizes = torch.tensor([128, 128], dtype=torch.int32)
    want = torch.cat([lhs[:128] @ rhs[0], lhs[128:] @ rhs[1]])
    torch.testing.assert_close(tpu.gmm(lhs, rhs, sizes, False, [128, 128, 128]), want, atol=1e-3, rtol=1e-3)
    q = torch.randn(1, 2, 128, 64)
    out = tpu.flash_attention(q, q, q, causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), atol=2e-3, rtol=2e-3)


def test_no_grad_shortcut_keeps_modes_and_gradients():
    x, w = torch.randn(8, 128, requires_grad=True), torch.randn(128)
    y = tpu.rmsnorm(x, w, 1e-6)
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        tpu.rmsnorm(x.detach(), w, 1e-6)  # grad mode, nothing requires grad
    assert any("tpu.rmsnorm" in s for s in seen), f"the shortcut skipped a TorchDispatchMode: {seen}"


def test_handles_are_freed():
    # Every input handle, optional box and result handle the kernel owns is freed: resident
    # memory stays flat over many calls (a leaked 1 MiB result per call would add 2 GiB).
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    x, w = torch.randn(512, 512), torch.randn(512)
    for _ in range(200):
        tpu.rmsnorm(x, w, 1e-6)
    before = rss()
    for _ in range(2000):
        tpu.rmsnorm(x, w, 1e-6)
        tpu.flash_attention(*[torch.randn(1, 1, 128, 64)] * 3)
    grown = rss() - before
    assert grown < 64 << 20, f"resident memory grew by {grown >> 20} MiB over 2000 calls"


NATIVE_DISPATCH = r"""
import torch, tessera
tpu = torch.ops.tpu
assert tessera._ops.SPECS["rmsnorm"].slot is None, "kernels not registered from Rust"
x, w = torch.randn(8, 256), torch.randn(256)
xf = x.double()
want = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
torch.testing.assert_close(tpu.rmsnorm(x, w, 1e-6), want)
torch.testing.assert_close(tpu.rmsnorm(torch.randn(256, 8).t().contiguous(), w, 1e-6).shape, torch.Size([8, 256]))
with torch.inference_mode():
    torch.testing.assert_close(tpu.rmsnorm(x, w, 1e-6), want)
w2, ids = tpu.router_topk(torch.randn(16, 8), 2, "softmax", False)
assert ids.dtype == torch.int32 and w2.shape == (16, 2)
cases = {
    "shape": (lambda: tpu.rmsnorm(x, w[:128], 1e-6), ["rmsnorm", "`weight`", "operand-shape"]),
    "dtype": (lambda: tpu.matmul(torch.randn(8, 64, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)), ["matmul", "`x`", "float64"]),
    "option": (lambda: tpu.router_topk(torch.randn(8, 8), 2, "relu"), ["router_topk", "gate", "option-value"]),
    "index": (lambda: tpu.cross_entropy(torch.randn(8, 128), torch.full((8,), 2**40)), ["cross_entropy", "labels", "index-range"]),
    "meta": (lambda: tpu.softmax(torch.randn(8, 128, device="meta")), None),
}
for name, (call, needles) in cases.items():
    try:
        out = call()
    except RuntimeError as e:
        text = str(e)
        if needles:
            assert text.startswith("error[") and all(n in text for n in needles), f"{name}: {text}"
        print("RAISED", name, type(e).__name__)
        continue
    assert name == "meta" and out.device.type == "meta", f"{name}: accepted"
    print("META", name)
y = torch.randn(8, 128, requires_grad=True)
tpu.rmsnorm(y, w[:128], 1e-6).sum().backward()
assert y.grad is not None
print("OK")
"""


def test_kernels_registered_from_rust():
    env = dict(os.environ, TESSERA_NATIVE_DISPATCH="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    p = subprocess.run([sys.executable, "-c", NATIVE_DISPATCH], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
    assert p.stdout.count("RAISED") == 4 and "OK" in p.stdout, p.stdout
