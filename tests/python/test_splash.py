"""tessera.splash: masks from mask_mods, constructors and bool tensors, against math attention
with the same mask evaluated densely here (the metadata never reaches the reference), values
and gradients, f32 and bf16; block skipping; the emulated `tpu` device; torch.compile; errors.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_splash.py
"""
import math
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

tessera = pytest.importorskip("tessera")
from tessera import splash  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def dense(mask_mod, heads, sq, skv):
    """The mask evaluated pair by pair on plain Python ints (no broadcasting, unlike
    make_mask): [heads, sq, skv]."""
    return torch.tensor([[[bool(mask_mod(0, h, r, c)) for c in range(skv)] for r in range(sq)] for h in range(heads)], dtype=torch.bool)


def math_attention(q, k, v, mask, scale=None):
    """float64 softmax attention over the visible keys; a row that sees nothing gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    s = s.masked_fill(~mask[None], -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


MASKS = {
    "causal": (splash.causal(), None),
    "local_small": (splash.local(20), None),  # smaller than a block
    "local_wide_two_sided": (splash.local(150, 40), None),  # wider than a block, both sides
    "chunked": (splash.chunked(48), None),
    "prefix_lm": (splash.prefix_lm(37), None),
    "per_head": (lambda b, h, q, kv: (kv <= q) & (q - kv <= 8 + 40 * h), "heads"),
}

# (B, H, Hkv, Sq, Skv, D): GQA 1 / 4 / 8, lengths that are not multiples of the blocks.
SHAPES = [(1, 2, 2, 130, 130, 32), (2, 4, 1, 200, 170, 64), (1, 8, 1, 96, 260, 32)]


def rel_err(got, want):
    got, want = got.detach().double(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("name,dtype", [(n, F32) for n in MASKS] + [(n, BF16) for n in ("causal", "local_wide_two_sided", "per_head")],
                         ids=[f"{n}-f32" for n in MASKS] + [f"{n}-bf16" for n in ("causal", "local_wide_two_sided", "per_head")])
def test_masks_match_math_attention(name, dtype):
    mask_mod, per = MASKS[name]
    tol = 1e-4 if dtype == F32 else 3e-2
    for n, (b, h, hkv, sq, skv, d) in enumerate(SHAPES):
        torch.manual_seed(n)
        heads = h if per else None
        m = splash.make_mask(mask_mod, sq, skv, heads=heads, block_q=32, block_kv=128)
        want_mask = dense(mask_mod, h if per else 1, sq, skv)
        q = torch.randn(b, h, sq, d, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, skv, d, dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, skv, d, dtype=dtype, requires_grad=True)
        o = splash.splash_attention(q, k, v, m)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = math_attention(*ref_in, want_mask)
        assert rel_err(o.detach(), ref.detach()) < tol, (name, n)
        do = torch.randn_like(o)
        o.backward(do)
        ref.backward(do.double())
        for t, r, what in zip((q, k, v), ref_in, "qkv"):
            assert rel_err(t.grad, r.grad) < 2 * tol, (name, n, what)


def test_bool_tensor_mask_and_skipping():
    torch.manual_seed(0)
    bits = torch.rand(300, 300) < 0.5
    bits[:, 128:256] = False  # a whole column of kv blocks no query sees
    m = splash.make_mask(bits, block_q=64, block_kv=128)
    assert m.q_len == 300 and m.kv_len == 300
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    o = splash.splash_attention(q, k, v, m)
    assert rel_err(o, math_attention(q, k, v, bits[None])) < 1e-4
    # 5 q blocks x 3 kv blocks, the middle kv block never visited.
    assert m.visits() == 10, m
    assert not (m.fwd_info[0][m.fwd_info[1] != 0] == 1).any()
    causal = splash.make_mask(splash.causal(), 1024, 1024, block_q=128, block_kv=128)
    assert causal.visits() == 36 and causal.partial_blocks == 1, causal


def test_segments_soft_cap_and_scale():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 160, 32) for _ in range(3))
    seg = torch.tensor([[0] * 70 + [1] * 90, [0] * 100 + [1] * 60], dtype=torch.int32)
    m = splash.make_mask(splash.causal(), 160, 160, block_q=32, block_kv=128)
    o = splash.splash_attention(q, k, v, m, sm_scale=0.3, soft_cap=2.0, q_segment_ids=seg, kv_segment_ids=seg)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.3
    s = 2.0 * torch.tanh(s / 2.0)
    mask = torch.tril(torch.ones(160, 160, dtype=torch.bool))[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])
    ref = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v.double()
    assert rel_err(o, ref) < 1e-4


def test_compile_fullgraph_and_reuse():
    m = splash.make_mask(splash.local(31), 256, 256, block_q=64, block_kv=128)
    blocks, fwd, bwd = m.tensors("cpu")
    f = torch.compile(lambda q, k, v: torch.ops.tpu.splash_attention(q, k, v, blocks, fwd, bwd).relu(), fullgraph=True, backend="aot_eager")
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    assert rel_err(f(q, k, v), math_attention(q, k, v, dense(splash.local(31), 1, 256, 256)).relu()) < 1e-4


def test_emulated_tpu_device():
    emu = pytest.importorskip("tessera.emulated_tpu")
    emu.enable()
    m = splash.make_mask(splash.chunked(64), 192, 192, block_q=64, block_kv=128)
    q, k, v = (torch.randn(1, 2, 192, 32) for _ in range(3))
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, v))
    o = splash.splash_attention(qt, kt, vt, m)
    assert o.device.type == "tpu"
    assert m.tensors("tpu")[1] is m.tensors("tpu")[1], "the metadata moves to a device once"
    o.sum().backward()
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = math_attention(*ref_in, dense(splash.chunked(64), 1, 192, 192))
    ref.sum().backward()
    assert rel_err(o.cpu(), ref) < 1e-4
    assert rel_err(qt.grad.cpu(), ref_in[0].grad) < 2e-4


def test_errors_name_what_to_change():
    m = splash.make_mask(splash.causal(), 128, 128)
    q = torch.randn(1, 2, 256, 32)
    with pytest.raises(ValueError, match="q_len=128"):
        splash.splash_attention(q, q, q, m)
    with pytest.raises(ValueError, match="heads"):
        splash.splash_attention(*(torch.randn(1, 3, 128, 32) for _ in range(3)), splash.make_mask(splash.causal(), 128, 128, heads=2))
    with pytest.raises(ValueError, match="non-negative"):
        splash.local(-1)
    with pytest.raises(ValueError, match="bool"):
        splash.make_mask(torch.ones(4, 4), 4, 4)
    with pytest.raises(ValueError, match="q_len and kv_len"):
        splash.make_mask(splash.causal())
    with pytest.raises(TypeError, match="bool tensor"):
        splash.make_mask(lambda b, h, q, kv: q - kv, 8, 8)
    # Metadata for other lengths, passed to the op directly: the op's own error.
    other = splash.make_mask(splash.causal(), 512, 128, block_q=128)
    with pytest.raises(ValueError, match="fwd_info"):
        torch.ops.tpu.splash_attention(torch.randn(1, 2, 128, 32), *(torch.randn(1, 2, 128, 32) for _ in range(2)), *other.tensors("cpu"))


def test_masks_that_one_metadata_cannot_serve_are_refused():
    """One metadata serves every batch element (and every head without heads=): a mask_mod that
    reads b, or h without heads=, is refused rather than silently taking b = 0 / h = 0."""
    docs = torch.tensor([[0] * 64 + [1] * 64, [0] * 16 + [1] * 112])
    with pytest.raises(ValueError, match="batch index b"):
        splash.make_mask(lambda b, h, q, kv: docs[b, q] == docs[b, kv], 128, 128)
    per_head = lambda b, h, q, kv: (kv <= q) & (q - kv <= 8 * (h + 1))  # noqa: E731
    with pytest.raises(ValueError, match="heads="):
        splash.make_mask(per_head, 128, 128)
    assert splash.make_mask(per_head, 128, 128, heads=4).heads == 4
    # A captured tensor indexed by q / kv only (documents shared by the batch) is fine.
    doc = docs[0]
    m = splash.make_mask(lambda b, h, q, kv: doc[q] == doc[kv], 128, 128)
    q = torch.randn(2, 2, 128, 32)
    assert rel_err(splash.splash_attention(q, q, q, m), math_attention(q, q, q, (doc[:, None] == doc[None, :])[None])) < 1e-4
    with pytest.raises(ValueError, match="drop heads="):
        splash.make_mask(torch.ones(128, 128, dtype=torch.bool), heads=4)
    with pytest.raises(ValueError, match="block_q = 33"):
        splash.make_mask(splash.causal(), 77, 130, block_q=33)
    with pytest.raises(ValueError, match="head_dim"):
        splash.make_mask(splash.causal(), 128, 128, head_dim=0)
    with pytest.raises(ValueError, match="at least one"):
        splash.and_masks()
    import numpy as np

    assert splash.make_mask(splash.causal(), np.int64(128), np.int64(128)).q_len == 128
    assert splash.make_mask(torch.ones(64, 64, dtype=torch.bool)).partial_blocks == 0
    with pytest.raises(RuntimeError, match="outside the compiled function"):
        torch.compile(lambda q: splash.splash_attention(q, q, q, splash.causal()), fullgraph=True)(torch.randn(1, 1, 64, 32))


def test_jax_is_never_imported():
    assert "jax" not in sys.modules
