"""DeferAndFuse with matmul anchors and transformer views, against eager PyTorch.

Matmuls (`mm`, `addmm`, `bmm`, and `linear` / `matmul`, which decompose into them) are
recorded with their pointwise epilogue fused; the views a transformer block takes
(transpose / permute / slice / select / expand over inner dims / cat over the last dim) are
recorded as copies instead of flushing. A plain-PyTorch Llama decoder block runs forward
and backward under the mode and matches strict eager; the test prints aten ops in strict
eager against kernels launched deferred.
"""

import math
import random

import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera import fusion
from fusion_workloads import CountAten

DEFER = tessera.EagerMode.DEFER_AND_FUSE

# Views of real tensors run eagerly (they launch nothing in either mode): reported apart.
_VIEW_REASONS = {f"op:{v}" for v in ("t", "transpose", "permute", "slice", "select", "view", "_unsafe_view", "unsqueeze",
                                      "squeeze", "expand", "detach", "alias", "_reshape_alias", "as_strided")}


@pytest.fixture(autouse=True)
def _fresh():
    fusion.reset_stats()
    yield
    tessera.set_eager_mode(tessera.EagerMode.STRICT)


def _tol(dtype):
    return (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)


def _computing_eager(s):
    return sum(n for r, n in s["eager_reasons"].items() if r not in _VIEW_REASONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(77, 96, 200), (64, 128, 256), (5, 33, 17)])
def test_linear_with_bias_activation_and_residual_is_one_kernel(dtype, m, k, n):
    torch.manual_seed(m + k + n)
    x, w, b, r = (torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype) / k ** 0.5, torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype))
    want = F.gelu(F.linear(x, w, b)) + r
    with tessera.set_eager_mode(DEFER):
        got = F.gelu(F.linear(x, w, b)) + r
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    s = fusion.stats()
    assert s["kernels_launched"] == 1 and _computing_eager(s) == 0 and s["flush_causes"] == {"exit": 1}, s


@pytest.mark.parametrize("seed", range(12))
def test_random_matmul_graphs_match_eager(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    m, k, n = (rng.choice([8, 16, 77, 96, 128, 200]) for _ in range(3))
    batch = rng.choice([(), (3,), (2, 2)])
    ta, tb = rng.random() < 0.3, rng.random() < 0.5
    a = torch.randn(*batch, k, m, dtype=dtype).transpose(-1, -2) if ta else torch.randn(*batch, m, k, dtype=dtype)
    b = torch.randn(*batch, n, k, dtype=dtype).transpose(-1, -2) if tb else torch.randn(*batch, k, n, dtype=dtype)
    res = torch.randn(*batch, m, n, dtype=dtype)
    ops = [rng.randrange(4) for _ in range(rng.randrange(4))]

    def f(a, b, res):
        y = torch.matmul(a, b)
        for o in ops:
            y = [F.silu, torch.relu, lambda t: t + res, lambda t: t * 0.5][o](y)
        return y

    want = f(a, b, res)
    with tessera.set_eager_mode(DEFER):
        got = f(a, b, res)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * k ** 0.5)
    s = fusion.stats()
    assert s["fallbacks"] == [] and s["flush_causes"] == {"exit": 1}, s


def test_bmm_and_transposed_operands_backward():
    torch.manual_seed(0)
    a = torch.randn(3, 40, 24, requires_grad=True)
    b = torch.randn(3, 56, 24, requires_grad=True)
    g = torch.randn(3, 40, 56)

    def run():
        y = torch.tanh(torch.bmm(a, b.transpose(1, 2)))
        (y * g).sum().backward()
        return y.detach()

    want = run()
    wa, wb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    with tessera.set_eager_mode(DEFER):
        got = run()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.grad, wa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.grad, wb, rtol=1e-4, atol=1e-4)
    assert fusion.stats()["fallbacks"] == [], fusion.stats()


@pytest.mark.parametrize("hd", [128, 48])
def test_transformer_views_do_not_flush(hd):
    torch.manual_seed(hd)
    b, s, h = 2, 32, 4
    x = torch.randn(b, s, h * hd)

    def f(x):
        y = (x * 2).view(b, s, h, hd).transpose(1, 2)  # [b, h, s, hd], a strided view
        rot = torch.cat((-y[..., hd // 2:], y[..., :hd // 2]), dim=-1)
        z = y * 0.5 + rot
        rep = z[:, :, None, :, :].expand(b, h, 2, s, hd).reshape(b, 2 * h, s, hd)
        first = rep.select(2, 0) + rep[:, :, 5]
        window = rep[:, 1:3, 3:11] * 1.5
        back = z.transpose(1, 2).reshape(b, s, h * hd)
        return rep, first, window, back

    want = f(x)
    with tessera.set_eager_mode(DEFER):
        got = f(x)
        s_ = fusion.stats()
        assert s_["flushes"] == 0, s_
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)
    st = fusion.stats()
    assert st["flush_causes"] == {"exit": 1} and _computing_eager(st) == 0 and st["fallbacks"] == [], st


def test_unsupported_matmuls_fall_back_with_a_reason():
    x, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    with tessera.set_eager_mode(DEFER):
        y = torch.exp(torch.randn(8, 4))
        z = x @ w  # float64: eager
    torch.testing.assert_close(z, x @ w)
    assert y.shape == (8, 4)
    r = fusion.stats()["eager_reasons"]
    assert any("dtype" in k for k in r), r


# ---- a Llama decoder block in plain PyTorch ---------------------------------------------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def _llama_block(x, p, cos, sin, mask, nh, nkv, hd):
    b, s, _ = x.shape
    h = _rms(x, p["ln1"])
    q = F.linear(h, p["wq"]).view(b, s, nh, hd).transpose(1, 2)
    k = F.linear(h, p["wk"]).view(b, s, nkv, hd).transpose(1, 2)
    v = F.linear(h, p["wv"]).view(b, s, nkv, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    rep = nh // nkv
    k = k[:, :, None, :, :].expand(b, nkv, rep, s, hd).reshape(b, nh, s, hd)
    v = v[:, :, None, :, :].expand(b, nkv, rep, s, hd).reshape(b, nh, s, hd)
    att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd)
    att = torch.softmax(att + mask, dim=-1)
    o = torch.matmul(att, v).transpose(1, 2).reshape(b, s, nh * hd)
    x = x + F.linear(o, p["wo"])
    h = _rms(x, p["ln2"])
    return x + F.linear(F.silu(F.linear(h, p["wg"])) * F.linear(h, p["wu"]), p["wd"])


def _llama_inputs(dtype, b=2, s=32, dm=256, nh=4, nkv=2, ff=512):
    hd = dm // nh
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dtype)
    p = {"ln1": (1 + 0.1 * torch.randn(dm, generator=g)).to(dtype), "ln2": (1 + 0.1 * torch.randn(dm, generator=g)).to(dtype),
         "wq": rnd(nh * hd, dm, scale=dm ** -0.5), "wk": rnd(nkv * hd, dm, scale=dm ** -0.5), "wv": rnd(nkv * hd, dm, scale=dm ** -0.5),
         "wo": rnd(dm, nh * hd, scale=(nh * hd) ** -0.5), "wg": rnd(ff, dm, scale=dm ** -0.5), "wu": rnd(ff, dm, scale=dm ** -0.5),
         "wd": rnd(dm, ff, scale=ff ** -0.5)}
    for t in p.values():
        t.requires_grad_(True)
    pos = torch.arange(s, dtype=torch.float32)[:, None] * (10000 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd))[None]
    emb = torch.cat((pos, pos), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    mask = torch.full((s, s), float("-inf")).triu(1).to(dtype)
    x = rnd(b, s, dm).requires_grad_(True)
    return x, p, cos, sin, mask, (nh, nkv, hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_block_forward_backward_matches_strict_with_fewer_launches(dtype):
    x, p, cos, sin, mask, heads = _llama_inputs(dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step():
        y = _llama_block(x, p, cos, sin, mask, *heads)
        (y.float() * dy.float()).sum().backward()
        return y.detach()

    counter = CountAten()
    with counter:
        want = step()
    grads = {k: t.grad.clone() for k, t in p.items()}
    gx = x.grad.clone()
    for t in [x, *p.values()]:
        t.grad = None
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        got = step()
    s = fusion.stats()
    rtol, atol = (1e-3, 1e-3) if dtype == torch.float32 else (5e-2, 5e-2)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad, gx, rtol=rtol, atol=atol * 4)
    for k, t in p.items():
        scale = float(grads[k].float().abs().max())
        torch.testing.assert_close(t.grad.float(), grads[k].float(), rtol=rtol * 4, atol=atol * 4 * max(scale, 1.0), msg=k)
    computing = _computing_eager(s)
    deferred = s["kernels_launched"] + computing
    ratio = counter.n / deferred
    print(f"\nllama block {dtype} fwd+bwd: strict {counter.n} aten ops; deferred {s['kernels_launched']} kernels + {computing} eager ops"
          f" (+ {s['ops_eager'] - computing} eager views of real tensors) = {deferred}: {ratio:.2f}x; flushes {s['flush_causes']};"
          f" eager {dict(sorted(s['eager_reasons'].items()))}; fallbacks {s['fallbacks']}")
    assert s["fallbacks"] == [], s["fallbacks"]
    assert ratio >= LLAMA_RATIO, (ratio, s)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_llama_block_forward_launch_ratio(dtype):
    x, p, cos, sin, mask, heads = _llama_inputs(dtype)
    with torch.no_grad():
        counter = CountAten()
        with counter:
            want = _llama_block(x, p, cos, sin, mask, *heads)
        fusion.reset_stats()
        with tessera.set_eager_mode(DEFER):
            got = _llama_block(x, p, cos, sin, mask, *heads)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    s = fusion.stats()
    computing = _computing_eager(s)
    deferred = s["kernels_launched"] + computing
    print(f"\nllama block forward: strict {counter.n} aten ops; deferred {s['kernels_launched']} kernels + {computing} eager ops = {deferred}:"
          f" {counter.n / deferred:.2f}x; flushes {s['flush_causes']}; eager {dict(sorted(s['eager_reasons'].items()))}")
    assert s["fallbacks"] == [], s["fallbacks"]
    assert counter.n / deferred >= LLAMA_FORWARD_RATIO, s


# The ratios reached (asserted so that a regression shows); see the printed figures.
# Reached: forward 92 aten ops -> 16 kernels (5.75x); forward + backward f32 263 -> 48
# kernels, no eager op (5.48x; bf16 266 -> 48, 5.54x): repeat_kv's backward sums fold into
# the dV / dK matmuls, RoPE's two slice_backward halves join into one cat, and each cat is a
# node of the row kernel around it.
LLAMA_RATIO = 5.4
LLAMA_FORWARD_RATIO = 5.7
