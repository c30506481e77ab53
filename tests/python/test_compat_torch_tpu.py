"""tessera.compat.torch_tpu: TorchTPU's op names and argument names on Tessera's kernels,
checked against plain torch (values and gradients), and without JAX in the process.

Run: TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_compat_torch_tpu.py
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tessera.compat import torch_tpu as tpu_ops


def groups(sizes):
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    return list(zip(starts[:-1], starts[1:]))


@pytest.mark.parametrize("sizes", [[128, 0, 256, 128], [37, 91, 0, 128]])
def test_ragged_dot_and_its_gradients(sizes):
    g, k, n = len(sizes), 128, 256
    lhs = torch.randn(sum(sizes), k, requires_grad=True)
    rhs = torch.randn(g, k, n, requires_grad=True)
    gs = torch.tensor(sizes, dtype=torch.int32)
    out = tpu_ops.ragged_dot(lhs, rhs, gs)
    want = torch.cat([lhs[a:b] @ rhs[i] for i, (a, b) in enumerate(groups(sizes))])
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)
    cot = torch.randn_like(out)
    got = torch.autograd.grad(out, (lhs, rhs), cot)
    ref = torch.autograd.grad(want, (lhs, rhs), cot)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    buf = torch.empty(sum(sizes), n)
    assert tpu_ops.ragged_dot(lhs.detach(), rhs.detach(), gs, out=buf) is buf
    torch.testing.assert_close(buf, want.detach(), atol=1e-3, rtol=1e-3)


def test_ragged_dot_weight_grad():
    sizes = [64, 128, 0, 64]
    lhs, dout = torch.randn(256, 128), torch.randn(256, 128)
    got = tpu_ops.ragged_dot_weight_grad(lhs, dout, torch.tensor(sizes, dtype=torch.int32))
    want = torch.stack([lhs[a:b].T @ dout[a:b] for a, b in groups(sizes)])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("causal,heads,kv_heads,scale", [(True, 4, 4, None), (False, 4, 2, 0.1), (True, 8, 2, None)])
def test_splash_sdpa_is_sdpa(causal, heads, kv_heads, scale):
    q = torch.randn(2, heads, 256, 64, requires_grad=True)
    k = torch.randn(2, kv_heads, 256, 64, requires_grad=True)
    v = torch.randn(2, kv_heads, 256, 64, requires_grad=True)
    gqa = heads != kv_heads
    out = tpu_ops.splash_sdpa(q, k, v, scale=scale, is_causal=causal, enable_gqa=gqa, block_q=256, block_kv=256)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    cot = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("causal,window", [(True, 40), (False, 70), (True, 0)])
def test_splash_sdpa_local_window_is_sdpa_with_the_band_mask(causal, window):
    """local_window_size = w: key c is seen by query r iff r - w <= c and c <= r (causal) or
    c <= r + w, against SDPA with that boolean mask written out (values and gradients)."""
    q = torch.randn(1, 4, 200, 64, requires_grad=True)
    k = torch.randn(1, 2, 200, 64, requires_grad=True)
    v = torch.randn(1, 2, 200, 64, requires_grad=True)
    out = tpu_ops.splash_sdpa(q, k, v, is_causal=causal, local_window_size=window, enable_gqa=True)
    r, c = torch.arange(200)[:, None], torch.arange(200)[None, :]
    band = (r - c <= window) & ((c <= r) if causal else (c - r <= window))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    cot = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)


def test_what_is_not_there_says_so():
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(ValueError, match="local_window_size"):
        tpu_ops.splash_sdpa(q, q, q, local_window_size=-1)
    with pytest.raises(ValueError, match="enable_gqa"):
        tpu_ops.splash_sdpa(q, q[:, :1], q[:, :1])
    with pytest.raises(TypeError, match="block_zz"):
        tpu_ops.splash_sdpa(q, q, q, block_zz=1)
    a, sa = torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(8, 1)
    b, sb = torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1)
    with pytest.raises(NotImplementedError, match="bias"):
        tpu_ops.scaled_mm_1x128_128x128(a, b, sa, sb, bias=torch.zeros(128))
    with pytest.raises(ValueError, match="out_dtype"):
        tpu_ops.scaled_mm_1x128_128x128(a, b, sa, sb, out_dtype=torch.float32)
    # K not a multiple of 128: TorchTPU's precondition, an error naming the op, `a` and the rule.
    with pytest.raises(ValueError, match=r"scaled_mm_blockwise.*`a`.*multiple of 128"):
        tpu_ops.scaled_mm_1x128_128x128(torch.zeros(8, 100, dtype=torch.float8_e4m3fn), torch.zeros(100, 128, dtype=torch.float8_e4m3fn), sa, sb)
    with pytest.raises(ValueError, match=r"scale_b.*\[1, 2\]"):
        tpu_ops.scaled_mm_1x128_128x128(a, torch.zeros(128, 200, dtype=torch.float8_e4m3fn), sa, sb)


def per_element(scale, rows, cols, br, bc):
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def quantize(x, br, bc):
    """torch's amax/448 recipe: scale = amax.clamp(min=1e-12) / 448 per block, q = x / scale."""
    m, n = x.shape
    amax = x.float().abs().reshape(m // br, br, n // bc, bc).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / 448
    return (x.float() / per_element(scale, m, n, br, bc)).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("m,k,n", [(64, 256, 256), (200, 384, 300), (1, 128, 72)])
def test_scaled_mm_1x128_128x128_is_dequantize_then_matmul(fmt, m, k, n):
    torch.manual_seed(m + k + n)
    a = (torch.rand(m, k) * 8 - 4).to(fmt)
    b = (torch.rand(k, n) * 8 - 4).to(fmt)
    sa = torch.rand(m, k // 128) * 0.05 + 0.004
    sb = torch.rand(k // 128, -(-n // 128)) * 0.05 + 0.004
    out = tpu_ops.scaled_mm_1x128_128x128(a, b, sa, sb, tile_m=256, tile_n=256, tile_k=512)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = (a.double() * per_element(sa.double(), m, k, 1, 128)) @ (b.double() * per_element(sb.double(), k, n, 128, 128))
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err
    # NaN in a row scale: that row only, as torch's dequantize-first product.
    row = min(3, m - 1)
    sa[row, 0] = float("nan")
    out = tpu_ops.scaled_mm_1x128_128x128(a, b, sa, sb)
    assert out[row].isnan().all() and not out[:row].isnan().any() and not out[row + 1:].isnan().any()


def test_the_training_recipe_against_torch():
    """out = x @ w, dx = dout @ w^T (dgrad: the same op, transpose_rhs), dw = x^T @ dout
    (wgrad, 128x1 operands), with the quantizers checked bit for bit against torch's
    amax/448 recipe and the results against the unquantized float64 products."""
    torch.manual_seed(0)
    m, k, n = 256, 384, 256
    x, w, dout = torch.randn(m, k), torch.randn(k, n) * 0.05, torch.randn(m, n) * 0.01
    tpu = torch.ops.tpu
    qx, sx = tpu.quantize_fp8_1x128(x)
    rq, rs = quantize(x, 1, 128)
    assert torch.equal(qx.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sx, rs)
    qw, sw = quantize(w, 128, 128)  # a weight is quantized once, per 128x128 tile
    out = tpu.scaled_mm_blockwise(qx, qw, sx, sw)
    qd, sd = tpu.quantize_fp8_1x128(dout)
    dx = tpu.scaled_mm_blockwise(qd, qw, sd, sw, transpose_rhs=True)
    qx1, sx1 = tpu.quantize_fp8_128x1(x)
    qd1, sd1 = tpu.quantize_fp8_128x1(dout)
    rq, rs = quantize(dout, 128, 1)
    assert torch.equal(qd1.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sd1, rs)
    dw = tpu.scaled_mm_blockwise_wgrad(qx1, qd1, sx1, sd1)
    x64, w64, d64 = x.double(), w.double(), dout.double()
    for got, want in [(out, x64 @ w64), (dx, d64 @ w64.T), (dw, x64.T @ d64)]:
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs().max() / want.abs().max()) < 5e-2


def test_jax_is_never_imported():
    code = (
        "import sys, torch\n"
        "from tessera.compat import torch_tpu as t\n"
        "x = torch.randn(256, 128); w = torch.randn(2, 128, 128); gs = torch.tensor([128, 128], dtype=torch.int32)\n"
        "t.ragged_dot(x, w, gs); t.ragged_dot_weight_grad(x, torch.randn(256, 128), gs)\n"
        "q = torch.randn(1, 2, 128, 64); t.splash_sdpa(q, q, q)\n"
        "f8 = torch.float8_e4m3fn; t.scaled_mm_1x128_128x128(torch.zeros(8, 128, dtype=f8), torch.zeros(128, 128, dtype=f8), torch.ones(8, 1), torch.ones(1, 1))\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
        "print('JAX', bad)\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "JAX []" in p.stdout, p.stdout
