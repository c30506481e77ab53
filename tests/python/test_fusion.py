"""DeferAndFuse (`tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE)`): flush triggers,
aliasing and in-place cases, fallbacks and stats, autograd, dumps.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest -q tests/python/test_fusion*.py
"""
import os
import threading

import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera import fusion
from fusion_workloads import chain, rmsnorm

DEFER = tessera.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def _fresh_stats():
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT
    fusion.reset_stats()
    yield
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT


def test_rmsnorm_is_one_kernel_and_matches_eager():
    x, w = torch.randn(64, 256), torch.rand(256) + 0.5
    want = rmsnorm(x, w)
    with tessera.set_eager_mode(DEFER):
        got = rmsnorm(x, w)
    s = fusion.stats()
    assert s["kernels_launched"] == 1, s
    assert s["ops_deferred"] >= 6 and s["flush_causes"] == {"exit": 1}, s
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_eight_op_chain_and_bf16():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(33, 130).to(dtype)
        want = chain(x)
        with tessera.set_eager_mode(DEFER):
            got = chain(x)
            fusion.flush()
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_cache_hits_on_the_second_call():
    x = torch.randn(16, 128)
    with tessera.set_eager_mode(DEFER):
        a = chain(x)
        fusion.flush()
        b = chain(x)
        fusion.flush()
        chain(x)  # nobody holds the result: nothing runs
        fusion.flush()
    s = fusion.stats()
    assert s["cache_hits"] >= 1 and s["kernels_launched"] == 2, s
    assert torch.equal(a, b)


@pytest.mark.parametrize("read,cause", [
    (lambda y: y.sum().item(), "item"),
    (lambda y: y.tolist(), "tolist"),
    (lambda y: y.numpy(), "numpy"),
    (lambda y: repr(y), "repr"),
    (lambda y: bool(y[0, 0] > 0), None),
    (lambda y: float(y[0, 0]), None),
    (lambda y: print(y), "repr"),
])
def test_value_reads_flush(read, cause, capsys):
    x = torch.randn(4, 8)
    want = chain(x)
    with tessera.set_eager_mode(DEFER):
        y = chain(x)
        read(y)
        assert fusion.stats()["flushes"] >= 1, fusion.stats()
        if cause:
            assert cause in fusion.stats()["flush_causes"], fusion.stats()
    torch.testing.assert_close(y, want)


def test_value_reads_give_the_flushed_values():
    x = torch.randn(4, 8)
    with tessera.set_eager_mode(DEFER):
        y = x * 2
        assert y.tolist() == (x * 2).tolist()
        z = x + 1
        assert (z.numpy() == (x + 1).numpy()).all()
        assert float(x.sum() * 0 + 3.0) == 3.0


def test_unsupported_op_flushes_its_inputs_and_runs_eagerly():
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    with tessera.set_eager_mode(DEFER):
        h = torch.relu(x * 2)
        y = torch.cumsum(h, 0) @ w  # cumsum: not the engine's
        z = y + 1
    torch.testing.assert_close(z, torch.cumsum(torch.relu(x * 2), 0) @ w + 1)
    s = fusion.stats()
    assert any(c.startswith("eager-op:cumsum") for c in s["flush_causes"]), s
    assert s["ops_eager"] >= 1


def test_a_broadcast_over_inner_leading_dims_is_expanded_by_a_gather():
    """`q * cos` with cos `[b, 1, s, d]` and q `[b, h, s, d]`: the operand is expanded by a
    copy kernel, nothing eager (`x + y` of `[4, 3, 8]` and `[1, 3, 8]` reads y periodically,
    3 rows: stacked operands)."""
    g = torch.Generator().manual_seed(5)
    q, cos = torch.randn(2, 4, 24, 16, generator=g), torch.randn(2, 1, 24, 16, generator=g)
    x, y = torch.randn(4, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        a = (q * 2) * cos
        b = cos - (q + 1)
        c = (x * 1) + y
        fusion.flush()
    torch.testing.assert_close(a, q * 2 * cos)
    torch.testing.assert_close(b, cos - (q + 1))
    torch.testing.assert_close(c, x + y)
    s = fusion.stats()
    assert s["ops_eager"] == 0 and not s["fallbacks"], s
    assert s["kernels_launched"] >= 3, s


def test_periodic_rope_and_its_cat_are_one_kernel():
    """HF RoPE with cos/sin `[1, 1, s, d]` over q `[b, h, s, d]` (s = 24; s = 20, which no
    multiple of the sublanes divides: stacked operands): cos and sin are read periodically
    and rotate_half's cat joins the kernel: one kernel, eager's values."""
    g = torch.Generator().manual_seed(6)
    for dtype, s in ((torch.float32, 24), (torch.bfloat16, 20)):
        q = torch.randn(2, 4, s, 16, generator=g).to(dtype)
        cos, sin = torch.randn(1, 1, s, 16, generator=g).to(dtype), torch.randn(1, 1, s, 16, generator=g).to(dtype)

        def rope(q):
            return q * cos + torch.cat((-q[..., 8:], q[..., :8]), dim=-1) * sin

        want = rope(q)
        fusion.reset_stats()
        with tessera.set_eager_mode(DEFER):
            got = rope(q)
        st = fusion.stats()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # (The slices of the real q are views run eagerly: they compute nothing.)
        assert st["kernels_launched"] == 1 and set(st["eager_reasons"]) <= {"op:slice"} and not st["fallbacks"], st


def test_an_expanded_real_tensor_is_read_in_place():
    """A real tensor's expand (HF's causal mask `[s, s]` expanded to `[b, 1, s, s]`) read by
    a deferred op is a broadcast of the tensor, not a copy kernel: one kernel."""
    g = torch.Generator().manual_seed(8)
    m = torch.rand(24, 24, generator=g) > 0.5
    x = torch.randn(2, 1, 24, 24, generator=g)
    me = m.expand(2, 1, 24, 24)
    want = torch.where(me, x * 2, -1.0)
    with tessera.set_eager_mode(DEFER):
        got = torch.where(me, x * 2, -1.0)
        fusion.flush()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    s = fusion.stats()
    assert s["kernels_launched"] == 1 and s["ops_eager"] == 0 and not s["fallbacks"], s


def test_select_backward_and_a_float_times_a_bool_tensor_fuse():
    """MoE's `w[e]` (its gradient: select_backward, zeros but at e) and `weight * mask`
    (a bool tensor promoted to the float dtype): recorded, eager's values bit for bit;
    subtracting a bool tensor stays eager (torch raises for it)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    x = torch.randn(3, 8, generator=g)
    weight, mask = torch.rand(6, 2, generator=g), torch.rand(6, 2, generator=g) > 0.5

    def step():
        w.grad = None
        y = sum((x @ w[e]).square().sum() * (e + 1) for e in (0, 2, -1))
        y.backward()
        return w.grad.clone(), (weight * mask).sum(-1), mask / (weight + 1), (mask + weight.bfloat16()) * 2

    want = step()
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        got = step()
    # (The gradient through the matmuls: their sums' order differs.)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    s = fusion.stats()
    assert not any("select_backward" in r or r == "fusion-dtype" for r in s["eager_reasons"]), s
    assert not s["fallbacks"], s
    with tessera.set_eager_mode(DEFER):
        with pytest.raises(RuntimeError, match="Subtraction"):
            weight - mask


def test_a_cat_onto_an_empty_tensor_is_a_copy():
    """HF's DynamicCache appends the first keys to an empty cache (`cat` over dim -2)."""
    x, empty = torch.randn(2, 2, 5, 16), torch.zeros(2, 2, 0, 16)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        y = x * 2
        c = torch.cat([empty, y], dim=-2)
        y.add_(1)  # the cat is a copy, not a view of y
        fusion.flush()
    torch.testing.assert_close(c, x * 2)
    torch.testing.assert_close(y, x * 2 + 1)
    s = fusion.stats()
    assert s["ops_eager"] == 0 and not s["fallbacks"], s


def test_unsupported_dtype_and_shape_fall_back_with_the_reason():
    xi = torch.arange(12).reshape(3, 4)
    x = torch.randn(4, 3, 8)
    y = torch.randn(4, 1, 1)
    with tessera.set_eager_mode(DEFER):
        a = xi * 2  # int64
        b = x + y  # a broadcast over an inner leading dim, and the last
        c = x.sum((0, 2))  # not one run of dims: neither a row, a column nor an inner-dim sum
    torch.testing.assert_close(a, xi * 2)
    torch.testing.assert_close(b, x + y)
    torch.testing.assert_close(c, x.sum((0, 2)))
    r = fusion.stats()["eager_reasons"]
    assert r.get("fusion-dtype", 0) >= 1, r
    assert r.get("fusion-broadcast-rows", 0) == 1, r
    assert r.get("sum-dim", 0) == 1, r


def test_a_program_that_cannot_be_built_replays_eagerly_and_says_why(monkeypatch):
    x = torch.randn(8, 32)
    want = chain(x)

    def refuse(self, *a, **k):
        raise ValueError("error[vmem-budget]: kernel `fused0`: refused for this test")

    monkeypatch.setattr(tessera._native.FusionGraph, "run", refuse, raising=False)
    with tessera.set_eager_mode(DEFER):
        got = chain(x)
    torch.testing.assert_close(got, want)
    fb = fusion.stats()["fallbacks"]
    assert len(fb) == 1 and "vmem-budget" in fb[0], fb
    # Every kind of record replays: views, expand, in-place, row ops, backward ops.
    a = torch.randn(4, 1, requires_grad=True)
    with tessera.set_eager_mode(DEFER):
        e = (a * 2).expand(4, 8)
        v = e.reshape(32).view(4, 8)
        y = torch.tanh(v).softmax(-1)
        z = y.sum(-1)
        t = y.clone()
        t.mul_(3).add_(1)
        z.sum().backward()
    ar = a.detach().clone().requires_grad_(True)
    yr = torch.tanh((ar * 2).expand(4, 8)).softmax(-1)
    yr.sum(-1).sum().backward()
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(t, yr * 3 + 1)
    torch.testing.assert_close(a.grad, ar.grad)
    assert len(fusion.stats()["fallbacks"]) >= 2 and fusion.stats()["kernels_launched"] == 0


NO_REPEATS = [torch.tanh, torch.sigmoid, torch.exp, torch.neg, torch.abs, torch.relu, torch.sin, torch.cos,
              torch.atan, lambda y: y * 1.01, lambda y: y + 0.5, lambda y: y - 0.25]  # 12 different aten ops


def test_size_cap_flushes(monkeypatch):
    monkeypatch.setenv("TESSERA_FUSION_MAX_OPS", "5")
    x = torch.randn(4, 8)
    y = x
    with tessera.set_eager_mode(DEFER):
        for f in NO_REPEATS:
            y = f(y)
    want = x
    for f in NO_REPEATS:
        want = f(want)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # atan is not the engine's: it flushes the first 8 and runs eagerly; then 3 more.
    s = fusion.stats()
    assert s["flush_causes"].get("size-cap") == 1 and s["loop_boundaries"] == 0, s


def loop_step(x, w):
    y = torch.tanh(x * w + 1.0)
    y = y.sigmoid() - 0.5
    return (y * y).sum(-1, keepdim=True) + x  # 8 aten ops


def test_a_loop_flushes_at_its_iteration_boundary(monkeypatch):
    """A cap of 10 ops cuts 8-op steps at drifting phases (4 structures); the loop heuristic
    finds the period and cuts every step at the same place: one structure, cache hits."""
    monkeypatch.setenv("TESSERA_FUSION_MAX_OPS", "10")
    x, w = torch.randn(8, 32), torch.randn(32)
    entries = tessera._native.fusion_cache_info()["entries"]
    n = 24
    with tessera.set_eager_mode(DEFER):
        y = x
        for _ in range(n):
            y = loop_step(y, w)
    want = x
    for _ in range(n):
        want = loop_step(want, w)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    s = fusion.stats()
    # Found after two steps (the first cut by the cap): then one flush per step.
    assert s["flush_causes"].get("loop", 0) >= n - 3 and s["flush_causes"].get("size-cap", 0) <= 1, s
    assert s["cache_hits"] >= n - 4 and s["cache_misses"] <= 3, s
    assert tessera._native.fusion_cache_info()["entries"] - entries <= 3
    # Under the default cap (512) the same loop is cut where the next step would not fit:
    # the flushes after the first hold the same 63 whole steps.
    fusion.reset_stats()
    monkeypatch.delenv("TESSERA_FUSION_MAX_OPS")
    with tessera.set_eager_mode(DEFER):
        y = x
        for _ in range(200):
            y = loop_step(y, w)
    s = fusion.stats()
    assert s["flush_causes"] == {"loop": 3, "exit": 1} and s["cache_hits"] >= 1, s


def test_the_loop_heuristic_needs_a_whole_repeated_period():
    x = torch.randn(4, 8)
    with tessera.set_eager_mode(DEFER):
        y = x
        for f in NO_REPEATS[:8] + NO_REPEATS[:7]:  # a period and most of a second
            y = f(y)
    assert fusion.stats()["loop_boundaries"] == 0, fusion.stats()


def test_only_referenced_results_are_written():
    x = torch.randn(16, 128)
    with tessera.set_eager_mode(DEFER):
        y = chain(x)
        fusion.flush()
    s = fusion.stats()
    assert s["kernels_launched"] == 1
    # One stored result: the chain's 8 intermediates were never written anywhere.
    assert s["results_written"] == 1 and s["temporaries"] == 0, s
    torch.testing.assert_close(y, chain(x))
    # Held intermediates are written, nothing else.
    with tessera.set_eager_mode(DEFER):
        a = x * 2
        b = torch.tanh(a) + 1  # noqa: F841
        c = b.sum(-1)
    assert fusion.stats()["results_written"] == 1 + 3, fusion.stats()
    torch.testing.assert_close(c, (torch.tanh(x * 2) + 1).sum(-1))


def test_pickling_and_data_ptr_flush(tmp_path):
    x = torch.randn(4, 8)
    with tessera.set_eager_mode(DEFER):
        y = torch.exp(x)
        torch.save(y, tmp_path / "y.pt")
        assert "pickle" in fusion.stats()["flush_causes"], fusion.stats()
        z = x + 1
        z.data_ptr()
        assert "data_ptr" in fusion.stats()["flush_causes"], fusion.stats()
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), torch.exp(x))


# ---- aliasing and in-place ---------------------------------------------------------------------


def test_inplace_on_a_pending_tensor_is_deferred():
    x = torch.randn(8, 16)
    with tessera.set_eager_mode(DEFER):
        y = x * 2
        y.add_(1)
        y.mul_(x)
        y.clamp_(min=0)
    torch.testing.assert_close(y, ((x * 2 + 1) * x).clamp(min=0))
    assert fusion.stats()["ops_eager"] == 0, fusion.stats()


def test_inplace_on_an_input_flushes_readers_first():
    x = torch.randn(8, 16)
    x0 = x.clone()
    with tessera.set_eager_mode(DEFER):
        y = x * 2  # reads x
        x.add_(1)  # eager, after y is computed from the old x
        z = x * 3
    torch.testing.assert_close(y, x0 * 2)
    torch.testing.assert_close(z, (x0 + 1) * 3)
    assert any(c.startswith("input-written") for c in fusion.stats()["flush_causes"]), fusion.stats()


def test_views_of_pending_tensors_alias():
    x = torch.randn(4, 6)
    with tessera.set_eager_mode(DEFER):
        y = x + 1
        v = y.view(24)
        u = y.unsqueeze(0)
        d = y.detach()
        y.mul_(2)  # y has live views: flush, then eager in place
        assert v.data_ptr() == y.data_ptr()
    torch.testing.assert_close(v, ((x + 1) * 2).view(24))
    torch.testing.assert_close(u[0], (x + 1) * 2)
    torch.testing.assert_close(d, (x + 1) * 2)
    assert any(c.startswith("inplace-alias") for c in fusion.stats()["flush_causes"]), fusion.stats()


def test_view_alone_survives_its_base():
    x = torch.randn(4, 6)
    with tessera.set_eager_mode(DEFER):
        v = (x * 3).view(2, 12)  # the base placeholder dies here
        w = v.sum(-1)
    torch.testing.assert_close(v, (x * 3).view(2, 12))
    torch.testing.assert_close(w, (x * 3).view(2, 12).sum(-1))


def test_real_views_of_inputs_see_eager_writes():
    x = torch.randn(4, 6)
    with tessera.set_eager_mode(DEFER):
        col = x[:, 0]  # a strided view of a real tensor: eager
        y = torch.exp(x)
        x.mul_(0)
        s = col.sum()
    assert s.item() == 0.0
    torch.testing.assert_close(y, torch.exp(x + 0) * 0 + y)  # y was computed before the write


def test_expand_and_broadcasts():
    a, b = torch.randn(5, 1), torch.randn(7)
    with tessera.set_eager_mode(DEFER):
        e = (a * 2).expand(5, 7)
        y = e + b
        z = torch.where(y > 0, y, 0.0)
    torch.testing.assert_close(y, (a * 2).expand(5, 7) + b)
    torch.testing.assert_close(z, torch.where(y > 0, y, 0.0))
    assert e.stride() == (1, 0)


def test_copy_into_a_pending_tensor():
    x = torch.randn(3, 4)
    with tessera.set_eager_mode(DEFER):
        y = torch.exp(x)
        y.copy_(x.to(torch.bfloat16))
    torch.testing.assert_close(y, x.to(torch.bfloat16).float())


# ---- autograd ---------------------------------------------------------------------------------


def test_backward_matches_eager_and_flushes():
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = rmsnorm(x, w).softmax(-1).sum()
    y.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = None
    w.grad = None
    with tessera.set_eager_mode(DEFER):
        y2 = rmsnorm(x, w).softmax(-1).sum()
        y2.backward()
    torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-5)
    c = fusion.stats()["flush_causes"]
    assert c.get("backward") == 1 and c.get("post-backward") == 1, c
    assert fusion.stats()["ops_deferred"] > 10


def test_torch_autograd_grad():
    x = torch.randn(4, 16, requires_grad=True)
    (g_want,) = torch.autograd.grad(torch.tanh(x * 2).sum(), x)
    with tessera.set_eager_mode(DEFER):
        (g,) = torch.autograd.grad(torch.tanh(x * 2).sum(), x)
    torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-6)


# ---- dumps and the mode ---------------------------------------------------------------------


def test_dump_writes_graph_partition_ir_and_mosaic(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DUMP_FUSION", str(tmp_path))
    x, w = torch.randn(16, 128), torch.randn(128)
    with tessera.set_eager_mode(DEFER):
        y = rmsnorm(x, w)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1, files
    text = (tmp_path / files[0]).read_text()
    assert "# graph" in text and "# kernel 0" in text and "kernel fused0" in text and "# mosaic of fused0" in text
    assert "func.func" in text


def test_mode_switching():
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT
    g = tessera.set_eager_mode(DEFER)
    assert tessera.get_eager_mode() is DEFER
    y = torch.ones(3) * 2
    tessera.set_eager_mode(tessera.EagerMode.STRICT)
    assert y.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        tessera.set_eager_mode("defer")
    del g
    # Tensor methods are restored.
    assert "tolist" not in torch.Tensor.__dict__ or torch.Tensor.tolist.__name__ != "reader"


# ---- torch.compile(backend="tessera") ------------------------------------------------------


def test_torch_compile_backend_forward_and_backward(fresh_dynamo):
    def block(x, w):
        h = rmsnorm(x, w)
        return torch.nn.functional.silu(h).softmax(-1) * 2

    x = torch.randn(16, 128, requires_grad=True)
    w = torch.rand(128, requires_grad=True)
    want = block(x, w)
    want.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = None
    w.grad = None
    c = torch.compile(block, backend="tessera")
    got = c(x, w)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-5)
    s = fusion.stats()
    assert s["kernels_launched"] >= 2, s
    # A new shape compiles again without error (and dynamic=True too).
    x2 = torch.randn(8, 64)
    torch.testing.assert_close(c(x2, torch.ones(64)), block(x2, torch.ones(64)), rtol=1e-5, atol=1e-5)
    d = torch.compile(block, backend="tessera", dynamic=True)
    for m in (4, 12):
        xm = torch.randn(m, 32)
        torch.testing.assert_close(d(xm, torch.ones(32)), block(xm, torch.ones(32)), rtol=1e-5, atol=1e-5)


def test_backward_ops_are_deferred_too():
    import torch.nn.functional as F

    def f(x):
        h = torch.tanh(x) + torch.sigmoid(x) + torch.relu(x) + F.silu(x) + F.gelu(x)
        return (h.softmax(-1) + h.log_softmax(-1)).sum()

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -6)):
        x = torch.randn(8, 128).to(dtype).requires_grad_(True)
        f(x).backward()
        want = x.grad.clone()
        x.grad = None
        fusion.reset_stats()
        with tessera.set_eager_mode(DEFER):
            f(x).backward()
        # Gradients reach ~400 here (log_softmax's): the tolerance is of that scale.
        scale = float(want.float().abs().max())
        torch.testing.assert_close(x.grad, want, rtol=tol, atol=tol * scale)
        r = fusion.stats()["eager_reasons"]
        assert not any("backward" in k for k in r), r


def test_strided_and_bool_real_inputs():
    x = torch.randn(8, 16)
    m = torch.rand(16, 8) > 0.5  # a real bool input
    e = torch.randn(16).expand(16, 16)  # stride 0
    with tessera.set_eager_mode(DEFER):
        y = x.t() * 2  # a transposed real input
        z = torch.where(m, y, -1.0)
        b = z > 0  # a bool result
        w = e + 1
    torch.testing.assert_close(y, x.t() * 2)
    torch.testing.assert_close(z, torch.where(m, x.t() * 2, -1.0))
    assert b.dtype == torch.bool and torch.equal(b, torch.where(m, x.t() * 2, -1.0) > 0)
    torch.testing.assert_close(w, e + 1)
    # Only the transpose (a view of a real tensor) ran eagerly; nothing flushed early.
    assert fusion.stats()["eager_reasons"] == {"op:t": 1}, fusion.stats()
    assert fusion.stats()["flush_causes"] == {"exit": 1}, fusion.stats()


def test_llama_style_block_in_plain_ops():
    """A decoder block written with plain torch ops: the matmuls stay aten, everything
    between them is fused; forward and backward equal eager."""
    torch.manual_seed(1)
    d, f, t, h = 64, 128, 16, 4
    p = {k: (torch.randn(*s) * 0.1).requires_grad_(True) for k, s in
         dict(wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d), w1=(d, f), w3=(d, f), w2=(f, d), n1=(d,), n2=(d,)).items()}

    def block(x):
        a = rmsnorm(x, p["n1"] + 1)
        q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
        q, k, v = (z.view(t, h, d // h).transpose(0, 1) for z in (q, k, v))
        s = (q @ k.transpose(-1, -2)) * (d // h) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        s = torch.where(mask, s, float("-inf")).softmax(-1)
        o = (s @ v).transpose(0, 1).reshape(t, d) @ p["wo"]
        x = x + o
        m = rmsnorm(x, p["n2"] + 1)
        return x + (torch.nn.functional.silu(m @ p["w1"]) * (m @ p["w3"])) @ p["w2"]

    x = torch.randn(t, d)
    want = block(x)
    want.square().mean().backward()
    grads = {k: v.grad.clone() for k, v in p.items()}
    for v in p.values():
        v.grad = None
    with tessera.set_eager_mode(DEFER):
        got = block(x)
        got.square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for k, v in p.items():
        torch.testing.assert_close(v.grad, grads[k], rtol=1e-4, atol=1e-5, msg=k)
    s = fusion.stats()
    assert s["kernels_launched"] > 0 and s["ops_deferred"] > s["kernels_launched"], s
    print(f"\nllama-style block fwd+bwd: {s['ops_deferred']} ops deferred into {s['kernels_launched']} kernels, "
          f"{s['ops_eager']} ops eager, {s['flushes']} flushes")


def test_bf16_numbers_round_as_torch_rounds_them():
    x = torch.tensor([0.10009765625, 0.099609375, 1.5390625, -2.0]).bfloat16()
    c = -1.21484375  # not a bf16 value
    cases = [lambda x: x > 0.1, lambda x: x >= 0.1, lambda x: x + c, lambda x: x - c, lambda x: c - x,
             lambda x: x * c, lambda x: x / c, lambda x: x.abs() ** 1.3, lambda x: x * torch.tensor(c),
             lambda x: x + torch.tensor(c), lambda x: x > torch.tensor(0.1),
             # A 0-dim f32 tensor first (found by the random graphs): torch multiplies by its f32 value.
             lambda x: torch.tensor(c) * x, lambda x: torch.tensor(c) / x, lambda x: x / torch.tensor(c),
             lambda x: torch.tensor(c) * torch.tanh(x),
             lambda x: (torch.tensor(c) + 0.0) * x]  # a pending 0-dim first: refused, eager
    for f in cases:
        want = f(x)
        with tessera.set_eager_mode(DEFER):
            got = f(x)
        assert torch.equal(got, want), (got, want)


def test_python_numbers_that_change_every_step_churn_as_shapes_do(monkeypatch):
    """A kernel holds Python numbers as constants, so a number new every step (Adam's bias
    correction `1 - beta ** step`, a scheduled learning rate) compiled a program per step:
    after 32 variants of one structure and shape it runs per op, as shape churn does."""
    monkeypatch.setattr(fusion, "_variants", {})
    fusion.reset_stats()
    x = torch.randn(16, 40)
    outs = []
    with tessera.set_eager_mode(DEFER):
        for step in range(1, 41):
            outs.append((step, (x * (1 - 0.9**step)).exp() + 0.5))
            fusion.flush()
        again = (x * (1 - 0.9**3)).exp() + 0.5  # a variant compiled before still runs fused
    s = fusion.stats()
    assert s["cache_misses"] == 32 and s["shape_churn"] == 8 and s["kernels_launched"] == 33, s
    for step, y in outs + [(3, again)]:
        torch.testing.assert_close(y, (x * (1 - 0.9**step)).exp() + 0.5)


def test_shape_churn_runs_per_op_after_eight_variants(monkeypatch):
    monkeypatch.setattr(fusion, "_variants", {})
    outs = []
    with tessera.set_eager_mode(DEFER):
        for m in range(1, 13):
            x = torch.randn(m, 40)
            outs.append((x, rmsnorm(x, torch.ones(40))))
            fusion.flush()
        # A shape compiled before still runs fused.
        x = torch.randn(3, 40)
        y = rmsnorm(x, torch.ones(40))
    s = fusion.stats()
    assert s["shape_churn"] == 4 and s["kernels_launched"] == 9, s
    for x, y_ in outs + [(x, y)]:
        torch.testing.assert_close(y_, rmsnorm(x, torch.ones(40)))


def test_native_graph_refuses_bad_input_with_the_rule():
    G = tessera._native.FusionGraph
    g = G()
    x = g.input("float32", [4, 8])
    bad = [
        lambda: g.input("int64", [4]),
        lambda: g.input("float32", [1 << 40, 1 << 40]),
        lambda: g.op("unary", "nope", [x]),
        lambda: g.op("kind", "add", [x]),
        lambda: g.op("binary", "add", [x, 99]),
        lambda: g.op("binary", "add", [1.0, 2.0]),
        lambda: g.op("view", "view", [x, [3, 3]]),
        lambda: g.op("row", "sum", [x]),  # a missing argument
        lambda: g.op("cast", "to", [x, "int8"]),
        lambda: g.storage(1000),
    ]
    for f in bad:
        with pytest.raises((ValueError, IndexError, TypeError)) as e:
            f()
        msg = str(e.value)
        assert "fusion" in msg or "index" in msg.lower() or "out of range" in msg, msg
    y = g.op("unary", "exp", [x])[0]
    t = torch.randn(4, 8)
    out = torch.empty(4, 8)
    with pytest.raises(ValueError, match="argument-count|fusion"):
        g.run([y], [], [out], "v5e")
    with pytest.raises(ValueError, match="argument-shape"):
        g.run([y], [torch.randn(5)], [out], "v5e")
    with pytest.raises(ValueError, match="output-aliasing"):
        g.run([y], [t], [t], "v5e")
    with pytest.raises(ValueError, match="fusion-operand"):
        g.run([1000], [t], [out], "v5e")
    with pytest.raises(ValueError, match="target"):
        g.run([y], [t], [out], "v9z")
    g.run([y], [t], [out], "v5e")
    torch.testing.assert_close(out, torch.exp(t))


def test_column_sums_fuse_with_their_producers():
    x, dy = torch.randn(1000, 96), torch.randn(1000, 96)
    with tessera.set_eager_mode(DEFER):
        dw = (dy * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
        db = dy.reshape(10, 100, 96).sum((0, 1), keepdim=True)
    torch.testing.assert_close(dw, (dy * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db, dy.reshape(10, 100, 96).sum((0, 1), keepdim=True), rtol=1e-4, atol=1e-4)
    s = fusion.stats()
    # Both sums run over the same 1000 rows of 96 (the reshape keeps the rows): one kernel.
    assert s["kernels_launched"] == 1 and s["eager_reasons"] == {"op:view": 1}, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_sign_and_trig_fuse_and_match_torch(dtype):
    # Ties (0.5, 1.5, -2.5: to even, as torch.round), signed zeros, infinities and NaN
    # (torch.sign(nan) is 0), and values away from integers for the transcendental ones.
    special = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 3.75, -3.25, 1e-3]
    x = torch.cat([torch.tensor(special), torch.randn(112) * 8]).reshape(8, 16).to(dtype)
    exact = {"floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "sign": torch.sign}
    smooth = {"sin": torch.sin, "cos": torch.cos, "log1p": lambda t: torch.log1p(t.abs()), "expm1": lambda t: torch.expm1(t.clamp(-20, 20))}
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        got = {name: f(x) for name, f in {**exact, **smooth}.items()}
    for name, f in exact.items():
        torch.testing.assert_close(got[name], f(x), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
    for name, f in smooth.items():
        tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-6
        torch.testing.assert_close(got[name], f(x), rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{name}: {m}")
    s = fusion.stats()
    assert s["kernels_launched"] >= 1 and not any(k.startswith("op:") and k[3:] in exact.keys() | smooth.keys() for k in s["eager_reasons"]), s


# ---- churning modules step aside ----------------------------------------------------------------


class RowNorm(torch.nn.Module):
    def forward(self, x):
        return rmsnorm(x, torch.ones(x.shape[-1])).softmax(-1).cumsum(-1)  # cumsum (not fused): a flush


def test_a_module_whose_calls_churn_steps_aside(monkeypatch):
    """A decode-like loop: every call is a new shape. After the call that churned (the 9th
    variant), the module's calls run strictly with the mode popped (nothing recorded, no
    per-op cost), and so does the code after them, until a trigger brings the mode back."""
    monkeypatch.setattr(fusion, "_variants", {})
    m, other = RowNorm(), torch.nn.Identity()
    outs = []
    with tessera.set_eager_mode(DEFER):
        for n in range(1, 16):
            x = torch.randn(2, n)
            outs.append((x, m(x)))
        s = fusion.stats()
        # 9 calls recorded (7 ops each), the 9th churned; the 6 after it ran strictly.
        assert s["shape_churn"] == 1 and s["stepped_aside"] == 1 and s["ops_deferred"] == 9 * 7, s
        deferred = s["ops_deferred"]
        y = m(torch.randn(2, 3)) * 2  # aside: strict, both the call and the op after it
        assert fusion.stats()["ops_deferred"] == deferred, fusion.stats()
        other(y)  # a module that does not churn: the mode is back
        z = torch.exp(y)
        assert fusion.stats()["ops_deferred"] == deferred + 1, fusion.stats()
        a = torch.randn(2, 5, requires_grad=True)
        m(a).sum().backward()  # aside: a backward of a strict forward runs strictly too
        assert fusion.stats()["ops_deferred"] == deferred + 1, fusion.stats()
        fusion.flush()  # flush() brings the mode back
        w = z + 1
        assert fusion.stats()["ops_deferred"] == deferred + 2 and fusion.stats()["stepped_aside"] == 2, fusion.stats()
    for x, got in outs:
        torch.testing.assert_close(got, RowNorm()(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, torch.exp(y) + 1)
    ar = a.detach().clone().requires_grad_(True)
    RowNorm()(ar).sum().backward()
    torch.testing.assert_close(a.grad, ar.grad)
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


def test_the_mode_hooks_are_installed_once_and_inert_outside_it():
    """The hooks stay after the mode is left (re-patching per `with` cost ~1.5 ms): entering
    again installs nothing new, and outside the mode module calls, value reads and backward
    run as strict's with nothing recorded or counted."""
    with tessera.set_eager_mode(DEFER):
        pass
    hooks = (torch.nn.Module.__call__, torch.Tensor.item, torch.Tensor.__repr__, torch.autograd.backward, torch.autograd.grad)
    with tessera.set_eager_mode(DEFER):
        (torch.ones(3) * 2).sum().item()
    assert (torch.nn.Module.__call__, torch.Tensor.item, torch.Tensor.__repr__, torch.autograd.backward, torch.autograd.grad) == hooks
    fusion.reset_stats()
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    y.square().sum().backward()
    assert y.sum().item() == pytest.approx(float((x @ lin.weight.t() + lin.bias).sum()))
    assert repr(torch.ones(2)) == "tensor([1., 1.])" and bool(torch.ones(1))
    assert x.grad is not None and torch.autograd.grad((x * 3).sum(), x)[0].eq(3).all()
    s = fusion.stats()
    assert s["ops_deferred"] == s["ops_eager"] == s["flushes"] == s["stepped_aside"] == 0, s


def test_inference_mode_sees_the_ops_no_grad_sees():
    """Under `torch.inference_mode()` composite ops (`reshape`, `linear`, `softmax`, `flatten`,
    `matmul`, ...) reach the mode undecomposed; a `reshape` that must copy was taken for a view
    of the placeholder's unwritten memory (garbage, silently). They are decomposed as autograd
    would: the same values and the same kernels as under `no_grad`."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 8), torch.randn(6, 8), torch.randn(6)

    def f():
        a = (x * 2).transpose(1, 2).reshape(3, -1) + 1
        c = torch.nn.functional.linear(x, w, b).softmax(-1).flatten(1)
        d = torch.matmul(x, x.mT).reshape_as(x.new_empty(3, 16)) * 0.5
        e = torch.nn.functional.layer_norm(x, (8,)).narrow(-1, 0, 4).square()
        return a, c, d, e

    want = f()
    got = {}
    for ctx in (torch.no_grad, torch.inference_mode):
        fusion.reset_stats()
        with ctx(), tessera.set_eager_mode(DEFER):
            out = f()
        got[ctx.__name__] = fusion.stats()["kernels_launched"]
        for o, w_ in zip(out, want):
            torch.testing.assert_close(o, w_, rtol=1e-5, atol=1e-5, msg=lambda m: f"{ctx.__name__}: {m}")
    assert got["inference_mode"] == got["no_grad"] > 0, got


def test_found_by_a_random_graph_probe():
    """Cases a random op-graph fuzzer found: each gave a wrong value or shape, crashed, or fell
    back where it need not."""
    x = torch.tensor([1.0, -2.0])
    with tessera.set_eager_mode(DEFER):
        bits = (x * 2).view(torch.int32) + 1  # a reinterpretation of the bits, not a shape view
        zero_d = torch.tensor(1.5).sum(dim=None, keepdim=True) + 1  # a 0-d tensor stays 0-d
    assert torch.equal(bits, (x * 2).view(torch.int32) + 1) and bits.dtype == torch.int32
    assert zero_d.shape == torch.Size([]) and zero_d.item() == 2.5
    with pytest.raises(RuntimeError, match="appears multiple times"):
        with tessera.set_eager_mode(DEFER):
            (torch.ones(3, 4) * 2).sum((0, 0)).tolist()

    # A batched product of a transposed view with a row sum, and an unrelated 0-d result in
    # the same flush: the 0-d value joined the epilogue, whose parallel grid then wrote its
    # one block from every step (the verifier refused the kernel: a fallback).
    torch.manual_seed(0)
    a, w, s = torch.randn(5, 8, 4), torch.randn(129, 8), torch.tensor(0.07)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        y = (a.mT @ w.t()).sum(-1)
        z = s * 2
    torch.testing.assert_close(y, (a.mT @ w.t()).sum(-1), rtol=1e-5, atol=1e-5)
    assert z.item() == pytest.approx(0.14) and not fusion.stats()["fallbacks"], fusion.stats()

    # Rows with no aligned divisor used to be one block of all of them (VMEM overflow past
    # ~73k rows): now blocks of aligned rows with a partial last one.
    big, wt, bias = torch.randn(100003, 2), torch.randn(7, 2), torch.randn(7)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        out = torch.nn.functional.linear(big, wt, bias).relu()
    torch.testing.assert_close(out, torch.nn.functional.linear(big, wt, bias).relu(), rtol=1e-5, atol=1e-5)
    assert fusion.stats()["kernels_launched"] == 1 and not fusion.stats()["fallbacks"], fusion.stats()

    # bf16 x^3 and x^-2: torch's CPU kernel rounds the square first (a model probe's GPT-2
    # gelu_new differed from strict in 0.3% of elements).
    xb = (torch.randn(4096) + 0.1).bfloat16()
    with tessera.set_eager_mode(DEFER):
        cubes, inv_squares = torch.pow(xb, 3.0), torch.pow(xb, -2.0)
    assert torch.equal(cubes, torch.pow(xb, 3.0)) and torch.equal(inv_squares, torch.pow(xb, -2.0))

    # `vector @ matrix` ends in `squeeze_` of the product, which flushed every time.
    v, m = torch.randn(8), torch.randn(8, 4)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        r = (v @ m).relu() + 1
    torch.testing.assert_close(r, (v @ m).relu() + 1)
    assert fusion.stats()["flush_causes"] == {"exit": 1} and fusion.stats()["kernels_launched"] == 1, fusion.stats()


def test_found_by_a_user_side_probe():
    """Two linears sharing a weight and a bias (two checkpointed blocks sharing a layer, in
    their recomputation) made a kernel with two operands of one name: the whole graph ran
    eagerly (`duplicate-operand` in `fallbacks`)."""
    torch.manual_seed(0)
    w, b, x1, x2 = torch.randn(16, 16), torch.randn(16), torch.randn(4, 16), torch.randn(4, 16)
    cases = {
        "apart": lambda: (F.linear(x1, w, b), F.linear(x2, w, b)),
        "product": lambda: (F.linear(x1, w, b) * F.linear(x2, w, b),),
        "addmm": lambda: (torch.addmm(b, x1, w) * torch.addmm(b, x2, w),),
    }
    for name, f in cases.items():
        want = f()
        fusion.reset_stats()
        with tessera.set_eager_mode(DEFER):
            got = f()
        for g, w_ in zip(got, want):
            torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        s = fusion.stats()
        assert not s["fallbacks"] and s["kernels_launched"] >= 1, (name, s)


def test_settings_that_are_not_numbers_or_backends_are_errors(monkeypatch):
    """A typo in a setting was the default in silence (`TESSERA_FUSION_MAX_OPS=abc`), and a bad
    `TESSERA_BACKEND` a fallback at every flush: now the `with` refuses them."""
    for name, value in (("TESSERA_FUSION_MAX_OPS", "abc"), ("TESSERA_FUSION_SHAPES", "0")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(ValueError, match=f"{name}='{value}' is not a positive integer"):
                tessera.set_eager_mode(DEFER)
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT
    with monkeypatch.context() as m:
        m.setenv("TESSERA_BACKEND", "bogus")
        with pytest.raises(ValueError, match="TESSERA_BACKEND=\"bogus\" is not a CPU backend"):
            tessera.set_eager_mode(DEFER)
    with tessera.set_eager_mode(DEFER):  # and the mode works after
        y = torch.ones(3) * 2
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_compiled_modules_keep_their_own_dynamo_caches_after_the_mode(fresh_dynamo):
    """The mode's `nn.Module.__call__` wrapper was a frame Dynamo compiled: every compiled
    module shared its cache and its recompile limit (8), and the ninth ran uncompiled."""
    with tessera.set_eager_mode(DEFER):
        (torch.ones(2) * 2).sum().item()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    for i in range(11):
        # A forward of its own code per class (as distinct model classes have).
        cls = type(f"Scaled{i}", (torch.nn.Module,), {"forward": eval(f"lambda self, x: x * {i + 2} + 1")})
        out = torch.compile(cls(), backend=backend)(torch.ones(2, 4))
        assert torch.equal(out, torch.full((2, 4), i + 3.0))
    assert len(calls) == 11, len(calls)


def test_an_inplace_op_reading_its_target_replays_and_a_failed_exit_flush_leaves_the_mode(monkeypatch):
    """`y.add_(y)` recorded the target's second use as the op's own result, so a replay (a
    churned shape, a fallback) raised KeyError, and the raise at the exit flush left the mode
    on the dispatch stack for the rest of the process."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    monkeypatch.setattr(fusion, "_variants", {})
    monkeypatch.setenv("TESSERA_FUSION_SHAPES", "1")
    fusion.reset_stats()
    for n in (3, 4, 5):  # the second and third shapes churn: replayed per op
        with tessera.set_eager_mode(DEFER):
            y = torch.ones(n) * 2
            y.add_(y)
            y.mul_(y)
        assert torch.equal(y, torch.full((n,), 16.0))
    assert fusion.stats()["shape_churn"] >= 2

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(fusion, "_state", fusion._State())  # (the records it leaves are dropped after)
    monkeypatch.setattr(fusion, "_flush", broken)
    with pytest.raises(RuntimeError, match="boom"):
        with tessera.set_eager_mode(DEFER):
            torch.ones(2) * 2
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT and _get_current_dispatch_mode() is None


def test_decode_like_churn_is_seen_through_shape_derived_offsets_and_replays_exactly(monkeypatch):
    """Found on transformers' `generate()` (batch 2, left padding, no cache): the last position's
    slice `h[:, -1, :]` put a shape-derived `col_start` in the structure, so every step was a new
    structure (a program compiled per token, never churn); and the per-op replay of a churned
    step ran eager's `x * 2` of a transposed `x` (eager keeps that layout) into a `view` recorded
    against a contiguous placeholder: RuntimeError."""
    monkeypatch.setattr(fusion, "_variants", {})
    fusion.reset_stats()
    w = torch.randn(64, 64)
    ins = [(torch.randn(2, s, 64), torch.randn(2, s, 4, 16).transpose(1, 2)) for s in range(4, 16)]
    outs = []
    with tessera.set_eager_mode(DEFER):
        for a, x in ins:
            got = (torch.tanh(a @ w)[:, -1, :] * 2).sum()
            float(got)  # a flush per step, as generate's token read
            y = x * 2
            z = y @ y.transpose(-1, -2)
            float(z[0, 0, 0, 0])
            outs.append((got, z))
    for (a, x), (got, z) in zip(ins, outs):
        torch.testing.assert_close(got, (torch.tanh(a @ w)[:, -1, :] * 2).sum())
        torch.testing.assert_close(z, (x * 2) @ (x * 2).transpose(-1, -2), rtol=1e-5, atol=1e-4)
    s = fusion.stats()
    # Two structures, 12 shapes each: 8 compiled, 4 churned, per structure.
    assert s["shape_churn"] == 8 and s["cache_misses"] == 16, s


# ---- aliases made outside the dispatcher ------------------------------------------------------------


@pytest.mark.parametrize("make", [
    pytest.param(lambda y: torch.nn.Parameter(y), id="nn.Parameter"),
    pytest.param(lambda y: y.as_subclass(torch.Tensor), id="as_subclass"),
    pytest.param(lambda y: torch.Tensor._make_subclass(torch.Tensor, y), id="_make_subclass"),
])
def test_an_alias_of_a_pending_tensor_made_without_the_dispatcher_reads_its_value(make):
    """`nn.Parameter(x * 0.5)` and friends hold the placeholder's memory through a new tensor
    object the mode never sees made; the placeholder itself dies at once. Its value is still
    written (the memory is held), and an op reading the alias flushes first."""
    x = torch.randn(4, 8)
    with tessera.set_eager_mode(DEFER):
        alias = make(x * 0.5)  # the placeholder `x * 0.5` dies here
        z = (x + alias.detach()) * 2
    torch.testing.assert_close(alias.detach(), x * 0.5)
    torch.testing.assert_close(z, (x + x * 0.5) * 2)
    assert not fusion.stats()["fallbacks"], fusion.stats()


def test_module_init_deepcopy_and_to_dtype_inside_the_mode():
    """A module built inside the mode (its parameter computed by an op), `copy.deepcopy` of a
    module, and `module.to(torch.bfloat16)` (`param.data = param.to(...)`: the parameter's
    memory is swapped to the placeholder's, outside the dispatcher) give eager's weights."""
    import copy

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(8) * 0.5)

        def forward(self, x):
            return x * self.scale

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 16)
    w = lin.weight.detach().clone()
    x = torch.randn(3, 8)
    with tessera.set_eager_mode(DEFER):
        m = Scaled()
        y = m(x)
        twin = copy.deepcopy(lin)
        lin.to(torch.bfloat16)
        wb = lin.weight.detach().clone()
        pending = x * 3
        snapshot = copy.deepcopy(pending)  # a deepcopy of a pending tensor reads its value
    torch.testing.assert_close(y, x * 0.5)
    torch.testing.assert_close(twin.weight.detach(), w, rtol=0, atol=0)
    assert wb.dtype == torch.bfloat16 and torch.equal(wb, w.bfloat16())
    torch.testing.assert_close(snapshot, x * 3)
    assert not fusion.stats()["fallbacks"], fusion.stats()


@pytest.mark.parametrize("replay", [False, True], ids=["kernels", "eager replay"])
def test_an_input_whose_memory_is_swapped_after_it_was_read_keeps_the_value_read(replay, monkeypatch):
    """`p.data = t` swaps a recorded input's memory without an op the mode sees: the pending
    op still reads the memory it read when recorded, as eager did, and a later op reads the
    new memory; in the kernels and in the eager replay of a program that cannot be built."""
    if replay:
        def refuse(self, *a, **k):
            raise ValueError("error[vmem-budget]: kernel `fused0`: refused for this test")

        monkeypatch.setattr(tessera._native.FusionGraph, "run", refuse, raising=False)
    p = torch.nn.Parameter(torch.ones(2, 3))
    with tessera.set_eager_mode(DEFER):
        y = p * 2
        p.data = torch.zeros(2, 3)
        z = p + 1
    torch.testing.assert_close(y, torch.full((2, 3), 2.0))
    torch.testing.assert_close(z, torch.ones(2, 3))
    assert bool(fusion.stats()["fallbacks"]) == replay


def test_a_pending_tensor_rebound_to_other_memory_is_that_memory():
    """`a.data = z` while `a` is pending: `a` is `z`'s memory now (eager's), so `a * 3`
    reads z, and the pending value is not written into z. Sparse tensors (no storage to
    look up) pass through the mode's alias checks."""
    x, z = torch.ones(4), torch.full((4,), 5.0)
    sparse = torch.eye(4).to_sparse()
    with tessera.set_eager_mode(DEFER):
        a = x * 1
        a.data = z
        d = a * 3
        s = torch.sparse.mm(sparse, x.reshape(4, 1) * 2)
        r = repr(sparse * 3)
    torch.testing.assert_close(d, torch.full((4,), 15.0))
    torch.testing.assert_close(z, torch.full((4,), 5.0))
    torch.testing.assert_close(s, x.reshape(4, 1) * 2)
    assert r.startswith("tensor(indices=")


def test_raw_storage_and_dlpack_of_a_pending_tensor_flush():
    import numpy as np

    x = torch.arange(8.0)
    with tessera.set_eager_mode(DEFER):
        y = x * 2
        via_dlpack = np.from_dlpack(y).copy()
        z = x * 3
        raw = torch.frombuffer(bytearray(bytes(z.untyped_storage())), dtype=torch.float32)
    np.testing.assert_array_equal(via_dlpack, (x * 2).numpy())
    torch.testing.assert_close(raw, x * 3)


def test_out_of_range_dims_and_uncastable_in_place_results_raise_as_eager():
    x = torch.randn(3, 4)
    with tessera.set_eager_mode(DEFER):
        y = x * 1
        for f in (lambda: y.sum(5), lambda: y.amax(2), lambda: y.mean(-3), lambda: torch.log_softmax(y, 3), lambda: y.sum((0, 3))):
            with pytest.raises(IndexError):
                f()
        scalar = torch.tensor(2.0) * 1
        assert scalar.sum(-1).item() == 2.0 and scalar.sum(0).item() == 2.0
        b = torch.ones(4, dtype=torch.bool) & torch.ones(4, dtype=torch.bool)
        with pytest.raises(RuntimeError, match="can't be cast"):
            b.mul_(torch.full((4,), 0.5))


def test_a_mode_stepped_aside_does_not_come_back_above_a_mode_entered_meanwhile(monkeypatch):
    """Aside (a churning module), the user enters another dispatch mode and calls a module
    that does not churn: the mode stays aside there (pushed above the user's mode, leaving the
    user's `with` would pop it instead), and comes back at the next call once that mode is gone."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(fusion, "_variants", {})
    monkeypatch.setenv("TESSERA_FUSION_SHAPES", "1")
    m, other = RowNorm(), torch.nn.Identity()
    with tessera.set_eager_mode(DEFER):
        for n in range(1, 4):
            m(torch.randn(2, n)).sum().item()
        m(torch.randn(2, 5))
        assert fusion.stats()["stepped_aside"] >= 1
        with Passthrough():
            other(torch.randn(2, 3))
            assert [type(x).__name__ for x in _get_current_dispatch_mode_stack()] == ["Passthrough"]
        assert _get_current_dispatch_mode_stack() == []
        other(torch.randn(2, 3))
        assert [type(x).__name__ for x in _get_current_dispatch_mode_stack()] == ["_DeferMode"]
    assert _get_current_dispatch_mode_stack() == []


# ---- bad input: eager, with the reason ------------------------------------------------------------


@pytest.mark.parametrize("name,make,reason", [
    ("float64", lambda: torch.randn(4, 8, dtype=torch.float64), "fusion-dtype"),
    ("float16", lambda: torch.randn(4, 8).half(), "fusion-dtype"),
    ("int64", lambda: torch.arange(32).reshape(4, 8), "fusion-dtype"),
    ("int32", lambda: torch.arange(32, dtype=torch.int32).reshape(4, 8), "fusion-dtype"),
    ("complex64", lambda: torch.randn(4, 8, dtype=torch.complex64), "fusion-dtype"),
    ("rows wider than the cap", lambda: torch.randn(2, 40000), "fusion-row-width"),
    ("empty", lambda: torch.randn(0, 8), "fusion-empty"),
    ("empty rows", lambda: torch.randn(3, 0), "fusion-empty"),
])
def test_unsupported_inputs_run_eagerly_with_the_reason(name, make, reason):
    x = make()

    def f(t):
        y = t * 2 + 1
        return y if not t.dtype.is_floating_point and not t.is_complex() else torch.exp(y) - t

    want = f(x)
    with tessera.set_eager_mode(DEFER):
        got = f(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # eager's own kernels: bit for bit
    s = fusion.stats()
    assert s["eager_reasons"].get(reason, 0) >= 2 and s["ops_deferred"] == 0 and s["kernels_launched"] == 0, s


def test_a_kernel_the_verifier_refuses_falls_back_and_says_why():
    """Not simulated: 16 inputs and 16 results of rows of 32768 f32 in one kernel need ~79 MiB
    of VMEM at the smallest block (8 rows), over tpu7x's 64 MiB: the verifier refuses it, the
    ops replay eagerly, and `fallbacks` carries the verifier's rule and numbers."""
    from tessera import _ops

    xs = [torch.randn(8, 32768) for _ in range(16)]
    before = _ops.get_target()
    _ops.set_target("tpu7x")
    try:
        with tessera.set_eager_mode(DEFER):
            ys = [torch.tanh(xs[i] * 2 + xs[(i + 1) % 16]) for i in range(16)]
            fusion.flush()
    finally:
        _ops.set_target(before)
    for i, y in enumerate(ys):
        torch.testing.assert_close(y, torch.tanh(xs[i] * 2 + xs[(i + 1) % 16]), rtol=0, atol=0)
    s = fusion.stats()
    assert s["kernels_launched"] == 0 and len(s["fallbacks"]) == 1, s
    assert "vmem-budget" in s["fallbacks"][0] and "tpu7x" in s["fallbacks"][0], s["fallbacks"]


@pytest.fixture
def mapped_library_ops(monkeypatch):
    """The list of `map_library_ops` results, one per graph the tessera backend compiles."""
    from tessera import _compile

    mapped = []
    real = _compile.map_library_ops
    monkeypatch.setattr(_compile, "map_library_ops", lambda gm: mapped.append(real(gm)) or mapped[-1])
    return mapped


def _grouped_mlp(x, w1, w2t, offs):
    """Two grouped matmuls as an MoE expert MLP: the second weight stored `[g, n, k]` and read
    transposed, as transformers' experts hold it."""
    h = torch._grouped_mm(x, w1, offs).relu()
    return torch._grouped_mm(h, w2t.transpose(-2, -1), offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offs", [[10, 30, 30, 64], [0, 20, 41, 50], [64]], ids=["empty-group", "tail-rows", "one-group"])
def test_torch_compile_maps_grouped_mm_to_gmm_and_tgmm(fresh_dynamo, mapped_library_ops, dtype, offs):
    """torch._grouped_mm (the MoE experts' primitive) under torch.compile(backend="tessera") runs
    tpu.gmm forward, and tpu.gmm (dx) and tpu.tgmm (dw) backward; outputs and gradients equal
    eager's on the rows torch defines (rows past offs[-1] are unspecified in torch: the weight
    gradients must still exclude them)."""
    g = len(offs)
    gen = torch.Generator().manual_seed(len(offs) + offs[-1])
    x = torch.randn(64, 32, generator=gen).to(dtype).requires_grad_(True)
    w1 = (torch.randn(g, 32, 48, generator=gen) * 0.2).to(dtype).requires_grad_(True)
    w2t = (torch.randn(g, 40, 48, generator=gen) * 0.2).to(dtype).requires_grad_(True)
    o = torch.tensor(offs, dtype=torch.int32)
    end = offs[-1]

    def run(fn):
        for t in (x, w1, w2t):
            t.grad = None
        y = fn(x, w1, w2t, o)
        # Linear in y over every row: the rows past offs[-1] get a gradient too (torch's
        # values there are unspecified, its gradient is not), and the weight gradients must
        # leave them out.
        (y.float() * torch.linspace(-1, 1, 40)).sum().backward()
        return y.detach()[:end], x.grad[:end].clone(), w1.grad.clone(), w2t.grad.clone()

    want = run(_grouped_mlp)
    got = run(torch.compile(_grouped_mlp, backend="tessera"))
    assert mapped_library_ops == [2, 4], f"2 grouped matmuls forward, 2 x (gmm + tgmm) backward: {mapped_library_ops}"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("y", "dx", "dw1", "dw2t"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_torch_compile_grouped_mm_edges(fresh_dynamo, mapped_library_ops):
    """No rows (every group empty) gives the empty product and zero weight gradients, as
    aot_eager does; offsets that decrease or pass the rows are refused with the rule, forward
    and backward alike (torch's own grouped matmul returns unspecified values there)."""
    x = torch.randn(0, 32, requires_grad=True)
    w1 = torch.randn(3, 32, 48, requires_grad=True)
    w2t = torch.randn(3, 40, 48, requires_grad=True)
    compiled = torch.compile(_grouped_mlp, backend="tessera")
    y = compiled(x, w1, w2t, torch.zeros(3, dtype=torch.int32))
    y.sum().backward()
    assert y.shape == (0, 40) and mapped_library_ops == [2, 4]
    assert not w1.grad.any() and not w2t.grad.any()
    x = torch.randn(16, 32)
    for bad in ([4, 2, 16], [4, 8, 20]):
        with torch.no_grad(), pytest.raises(ValueError, match="group-sizes"):
            compiled(x, w1.detach(), w2t.detach(), torch.tensor(bad, dtype=torch.int32))


def test_torch_compile_leaves_other_grouped_mm_forms_to_aten(fresh_dynamo, mapped_library_ops):
    """A batched (3-d x 3-d, no offsets) grouped matmul is not the MoE pattern: it stays aten."""
    a, b = torch.randn(4, 16, 32), torch.randn(4, 32, 16)
    f = lambda a, b: torch._grouped_mm(a, b).relu()  # noqa: E731
    torch.testing.assert_close(torch.compile(f, backend="tessera")(a, b), f(a, b))
    assert mapped_library_ops == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_moe_under_torch_compile_runs_the_library_grouped_matmuls(fresh_dynamo, mapped_library_ops, dtype):
    """A tiny transformers Mixtral with `experts_implementation="grouped_mm"` (bfloat16 calls
    torch._grouped_mm, float32 transformers' own fallback op under torch.compile) under
    torch.compile(backend="tessera"): logits, loss and gradients equal eager's, and every expert
    matmul, forward and backward, is the library's gmm / tgmm."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="grouped_mm", dtype=dtype)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))

    def step(m):
        model.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach().float(), {k: p.grad.float().clone() for k, p in model.named_parameters()}

    want_logits, want_grads = step(model)
    logits, grads = step(torch.compile(model, backend="tessera"))
    layers = config.num_hidden_layers
    # Forward: two expert matmuls a layer. Backward: bfloat16's aten op gives a gmm and a tgmm
    # each, float32's fallback one backward op (both of them) each.
    assert sum(mapped_library_ops) == 2 * layers + 2 * layers * (2 if dtype == torch.bfloat16 else 1), mapped_library_ops
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want_logits.abs().max()
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=tol * scale)
    for k, g in want_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=0, atol=tol * max(g.abs().max(), 1e-6), msg=k)


def test_torch_compile_maps_sdpa_to_flash_attention(fresh_dynamo, monkeypatch):
    """F.scaled_dot_product_attention under torch.compile(backend="tessera") runs Tessera's flash
    attention forward and backward (causal or not, a given scale, GQA); a masked SDPA stays aten."""
    import torch.nn.functional as F
    from tessera import _compile

    mapped = []
    real = _compile.map_library_ops
    monkeypatch.setattr(_compile, "map_library_ops", lambda gm: mapped.append(real(gm)) or mapped[-1])

    def attn(q, k, v, causal, scale, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True).relu()

    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        for causal, scale in ((True, None), (False, 0.3)):
            mapped.clear()
            torch.manual_seed(0)
            q = torch.randn(2, 4, 96, 32, dtype=dtype, requires_grad=True)
            k = torch.randn(2, 2, 96, 32, dtype=dtype, requires_grad=True)
            v = torch.randn(2, 2, 96, 32, dtype=dtype, requires_grad=True)
            want = attn(q, k, v, causal, scale)
            want.sum().backward()
            grads = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            got = torch.compile(attn, backend="tessera")(q, k, v, causal, scale)
            got.sum().backward()
            assert mapped == [1, 1], f"forward and backward each map one SDPA: {mapped}"
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            for t, g in zip((q, k, v), grads):
                torch.testing.assert_close(t.grad, g, rtol=tol * 5, atol=tol * 5)
    mapped.clear()
    q = torch.randn(1, 2, 64, 32)
    mask = torch.rand(64, 64) < 0.5
    torch.testing.assert_close(torch.compile(attn, backend="tessera")(q, q, q, False, None, mask), attn(q, q, q, False, None, mask), rtol=1e-5, atol=1e-5)
    assert mapped == [0], "a masked SDPA stays aten"
    # An inference graph reads no logsumexp: the forward is flash_attention, whose kernel
    # writes no lse.
    targets = []

    def record(gm):
        n = real(gm)
        targets.append({node.target for node in gm.graph.nodes if node.op == "call_function"})
        return n

    monkeypatch.setattr(_compile, "map_library_ops", record)
    q, k, v = torch.randn(2, 4, 96, 32), torch.randn(2, 2, 96, 32), torch.randn(2, 2, 96, 32)
    with torch.no_grad():
        got = torch.compile(attn, backend="tessera")(q, k, v, True, None)
    torch.testing.assert_close(got, attn(q, k, v, True, None), rtol=2e-5, atol=2e-5)
    assert len(targets) == 1 and torch.ops.tpu.flash_attention.default in targets[0], targets
    assert torch.ops.tpu.flash_attention_fwd.default not in targets[0], targets


def test_torch_compile_results_keep_eager_memory_layouts(fresh_dynamo):
    """AOTAutograd's graphs rely on eager's result layouts (a `reshape` of a transposed result
    traced as a `view`): SDPA's output over transposed q/k/v (mapped to flash attention), a
    pointwise op of a transposed tensor (a generated kernel), and a masked SDPA (aten) reading
    one, forward and backward, and the layouts the caller sees are eager's."""
    import torch.nn.functional as F

    mask = torch.ones(8, 8, dtype=torch.bool).tril()

    def heads(x):
        return x.view(2, 8, 4, 16).transpose(1, 2)

    cases = {
        "flash": lambda x: F.scaled_dot_product_attention(heads(x), heads(x * 2), heads(x), is_causal=True).transpose(1, 2).contiguous().reshape(2, 8, 64),
        "flash output": lambda x: F.scaled_dot_product_attention(heads(x), heads(x), heads(x)),
        "pointwise": lambda x: (x.transpose(-1, -2) * 2).transpose(-1, -2).reshape(-1),
        "pointwise output": lambda x: x.transpose(-1, -2).exp(),
        "masked sdpa of a fused q": lambda x: F.scaled_dot_product_attention(heads(x) * 2, heads(x), heads(x), attn_mask=mask).transpose(1, 2).reshape(2, 8, 64),
        "as_strided": lambda x: (x[0].t() * 2).as_strided((3, 3), (1, 8)),
    }
    for name, f in cases.items():
        x = torch.randn(2, 8, 64, requires_grad=True)
        want = f(x)
        want.square().sum().backward()
        gx, x.grad = x.grad.clone(), None
        got = torch.compile(f, backend="tessera")(x)
        got.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=name)
        assert got.stride() == want.stride(), (name, got.stride(), want.stride())
        torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_torch_compile_runs_a_transformers_llama_with_its_default_sdpa_attention(fresh_dynamo, attn):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the masked SDPA stays aten and reads the fused RoPE's q

    def step(m, **kw):
        model.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids, **kw)
        out.loss.backward()
        return out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    compiled = torch.compile(model, backend="tessera")
    for kw in ({}, {"attention_mask": mask}):
        want_logits, want_grads = step(model, **kw)
        logits, grads = step(compiled, **kw)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-3, atol=1e-5, msg=k)


def test_threads_each_have_their_own_mode_and_take_turns_on_the_recording():
    """The mode is per thread, as torch's dispatch mode stack: overlapping `with`s in two
    threads (A enters, B enters, A leaves, B leaves) each defer their own ops and leave the
    process strict. A reader in another thread (`tolist` of the main thread's latest result)
    flushes on the one lock ops and flushes take, so the main thread's results stay right
    (before, a few in a thousand were garbage: a flush ran while the main thread recorded)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as stack

    x = torch.randn(4, 6)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with tessera.set_eager_mode(DEFER):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with tessera.set_eager_mode(DEFER):
            b_in.set()
            a_out.wait(10)
            before = fusion.stats()["ops_deferred"]
            y = (x * 2).exp()
            seen["b"] = (tessera.get_eager_mode(), len(stack()), fusion.stats()["ops_deferred"] - before)
        seen["b_after"] = (tessera.get_eager_mode(), len(stack()))
        seen["y"] = y

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["b"] == (DEFER, 1, 2), seen
    assert seen["b_after"] == (tessera.EagerMode.STRICT, 0), seen
    torch.testing.assert_close(seen["y"], (x * 2).exp())
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT and not stack()
    with tessera.set_eager_mode(DEFER):
        before = fusion.stats()["ops_deferred"]
        (x * 2).exp()
        assert fusion.stats()["ops_deferred"] - before == 2

    x = torch.randn(16, 32)
    want = [((x * k).softmax(-1) + x.exp().mean(-1, keepdim=True)).mul(2).sum(-1) for k in range(7)]
    latest, stop, wrong = {"t": None}, threading.Event(), []

    def reader():
        while not stop.is_set():
            t = latest["t"]
            if t is not None:
                t.tolist()

    r = threading.Thread(target=reader)
    r.start()
    try:
        with tessera.set_eager_mode(DEFER):
            for i in range(600):
                y = (x * (i % 7)).softmax(-1) + x.exp().mean(-1, keepdim=True)
                latest["t"] = y
                z = (y * 2).sum(-1)
                if not torch.allclose(z, want[i % 7], atol=1e-4):
                    wrong.append(i)
    finally:
        stop.set()
        r.join()
    assert not wrong, wrong


def test_to_dlpack_of_a_pending_tensor_flushes():
    """`torch.utils.dlpack.to_dlpack` is a builtin, not a Tensor method: imported after
    `tessera`, it flushes as `__dlpack__` does (it exported unwritten memory)."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    x = torch.randn(4, 6)
    with tessera.set_eager_mode(DEFER):
        y = (x * 2).exp()
        z = from_dlpack(to_dlpack(y)).clone()
        w = from_dlpack(torch.to_dlpack((x * 3).exp())).clone()
    torch.testing.assert_close(z, (x * 2).exp())
    torch.testing.assert_close(w, (x * 3).exp())


def test_numpy_of_a_tensor_inside_a_compiled_function():
    """The mode's `Tensor.numpy` hook runs untraced: Dynamo traced it, and its run-time numpy
    helper called `.numpy()`, so the hook again, without end (RecursionError) whenever a
    compiled function went on with the array after a graph break (`.numpy().tobytes()`)."""
    with tessera.set_eager_mode(DEFER):
        pass  # the hooks are installed for the process

    def f(x):
        raw = (x > 0).to(torch.uint8).numpy().tobytes()
        return x * len(raw) + torch.from_numpy(x.numpy() * 2)

    x = torch.randn(4, 5)
    for backend in ("eager", "tessera"):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend=backend)(x), x * 20 + x * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_and_variance_are_recorded_not_run_eagerly(dtype):
    """LayerNorm (forward and backward) is taken as torch's own decomposition, and `var`,
    `std` and their `_mean` forms over trailing dims as row ops (mean, then the mean-free sum
    of squares in f32): the same values as strict eager, NaN where eager's, and none of them
    runs eagerly (they did: `native_layer_norm` was a flush in every transformer block)."""
    torch.manual_seed(0)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    x = torch.randn(6, 5, 40, dtype=dtype)
    x[1, 2, 7] = float("nan")
    w, b = torch.randn(40, dtype=dtype), torch.randn(40, dtype=dtype)
    w2 = torch.randn(5, 40, dtype=dtype)

    def f(x, w, b, w2):
        return [
            F.layer_norm(x, (40,), w, b),
            F.layer_norm(x, (40,)),
            F.layer_norm(x, (5, 40), w2),
            x.var(-1),
            x.var((-2, -1), keepdim=True, correction=0),
            torch.var_mean(x, -1, correction=2)[0],
            torch.var_mean(x, -1, correction=2)[1],
            x.std(-1, keepdim=True),
            torch.std_mean(x.flatten(), 0)[0],
            x[:, :, :1].var(-1),  # one element, correction 1: 0 / 0
        ]

    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, w2)]
    want = f(*leaves)
    sum(o.float().nan_to_num().sum() for o in want[:3]).backward()
    want_grads = [t.grad for t in leaves]
    fusion.reset_stats()
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, w2)]
    with tessera.set_eager_mode(DEFER):
        got = f(*leaves)
        sum(o.float().nan_to_num().sum() for o in got[:3]).backward()
        got_grads = [t.grad for t in leaves]
    for i, (g, w_) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w_, equal_nan=True, **tol, msg=lambda m: f"output {i}: {m}")
    for i, (g, w_) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(g, w_, equal_nan=True, **tol, msg=lambda m: f"grad {i}: {m}")
    eager = fusion.stats()["eager_reasons"]
    assert not [r for r in eager if any(k in r for k in ("layer_norm", "var", "std"))], eager


def test_variance_of_a_constant_row_is_zero_and_a_large_mean_costs_nothing():
    """The variance is shifted by each row's first element: a constant row (3.3, not exact as a
    sum) has variance 0 and LayerNorm gives 0 there even at BERT's eps 1e-12 (0.43 before, a
    plain `sum / n` mean being off by rounding); 1e6 + N(0, 1) keeps the variance to f32's
    precision (3e-3 of error before); an inf row's mean is inf, as eager's."""
    x = torch.full((3, 768), 3.3)
    x[1] = torch.randn(768)
    x[2] = 1e6 + torch.randn(768)
    ln = torch.nn.LayerNorm(768, eps=1e-12)
    want = ln(x)
    with tessera.set_eager_mode(DEFER):
        got = ln(x)
        var = x.var(-1)
        _, mean_inf = torch.var_mean(torch.tensor([[float("inf"), 1.0, 2.0]]), -1)
    assert torch.equal(got[0], torch.zeros(768)) and torch.equal(want[0], torch.zeros(768))
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert var[0] == 0
    exact = x.double().var(-1)
    assert abs(var[2].item() - exact[2].item()) <= 1e-5 * exact[2].item(), (var[2], exact[2])
    assert mean_inf.item() == float("inf")
    # A bool tensor's variance is eager's error, not a value.
    with tessera.set_eager_mode(DEFER), pytest.raises(NotImplementedError, match="floating point"):
        torch.tensor([[True, False]]).var(-1)


def test_mask_logic_is_recorded_not_run_eagerly():
    """`&`, `|`, `^`, `~`, the `logical_*` ops (also of floats, NaN counting as true), bool
    `*` and `+`, in-place `&=` / `|=`, broadcast masks, `isfinite` (whose decomposition
    multiplies two bools) and `any` / `all` over the last dim or everything give strict
    eager's masks and are fused: none runs eagerly (each was an eager op and a flush;
    `isfinite` split every LayerNorm into two flushes)."""
    torch.manual_seed(0)
    x = torch.randn(8, 33)
    x[2, 3], x[4, 5], x[5, 6] = float("nan"), float("inf"), -float("inf")
    y = torch.randn(8, 33)
    y[1, 1] = 0.0
    row = torch.randn(1, 33) > 0

    def f(x, y, row):
        a, b = x > 0, y < 0.5
        m = a.clone()
        m &= b
        n = a.clone()
        n |= row
        return [
            a & b, a | b, a ^ b, ~a, a * b, a + b, a & row, row | b,
            torch.logical_and(x, y), torch.logical_or(x, b), torch.logical_xor(y, a), torch.logical_not(x),
            torch.logical_not(a), x.isfinite(), m, n,
            torch.where(a & ~b, x, y),  # a mask used as a condition in the same kernel
            # (any / all of a pending tensor: of a real one they run eagerly, see below)
            (a & b).any(-1), (a | row).all(-1, keepdim=True), (x + 0).any(-1), (x * 1).all(1), a.any(), (-x).all(),
            torch.any(y > 2, dim=-1), torch.any(a, dim=()), (x * 2).all(dim=(), keepdim=True),  # dim=(): no dims
        ]

    want = f(x, y, row)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        got = f(x, y, row)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0, msg=lambda m: f"output {i}: {m}")
    s = fusion.stats()
    computing = {r: c for r, c in s["eager_reasons"].items() if not r.startswith(("op:clone", "op:view", "op:slice", "op:alias", "op:detach"))}
    assert not computing, s["eager_reasons"]
    assert set(s["flush_causes"]) == {"exit"}, s["flush_causes"]
    # `any` of a real tensor runs eagerly: recorded, the read that follows would flush it.
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        assert bool(x.any()) and fusion.stats()["flushes"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pending", [False, True])
def test_a_layer_norm_is_one_kernel_with_its_input(dtype, pending):
    """`F.layer_norm` in the mode is one flush of one kernel (row statistics and the
    normalisation in one row kernel, as RMSNorm), with the residual sum that computes its
    input when there is one. A bf16 input's f32 cast and a residual sum are values the
    kernel computes: the variance's shift (each row's maximum) is a row op over them, where
    a column slice of them had made the planner store them first (two kernels)."""
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    x, r, w, b = (torch.randn(*s, dtype=dtype) for s in ((16, 96), (16, 96), (96,), (96,)))

    def f(x, r):
        h = x + r if pending else x
        return F.layer_norm(h, (96,), w, b)

    want = f(x, r)
    fusion.reset_stats()
    with tessera.set_eager_mode(DEFER):
        got = f(x, r)
    torch.testing.assert_close(got, want, **tol)
    s = fusion.stats()
    assert (s["flushes"], s["kernels_launched"]) == (1, 1), s


def test_layer_norm_overflow_is_nan_and_mixed_dtypes_raise_as_eager():
    """A row whose sum of squares overflows f32 (|x| ~ 1e20) gives NaN, as eager's f32
    LayerNorm (it gave 0s: `rsqrt(inf)`); a constant row of 3e38 has variance 0, so 0 (as a
    float64 LayerNorm; eager's overflows to NaN); an f32 input with bf16 parameters raises
    eager's "mixed dtype" error instead of returning a value."""
    torch.manual_seed(0)
    x = torch.randn(2, 8) * 1e20
    with tessera.set_eager_mode(DEFER):
        got = F.layer_norm(x, (8,))
        const = F.layer_norm(torch.full((1, 8), 3e38), (8,))
    assert torch.isnan(F.layer_norm(x, (8,))).all() and torch.isnan(got).all(), got
    assert torch.equal(const, torch.zeros(1, 8)), const
    w = torch.randn(8).bfloat16()
    with pytest.raises(RuntimeError, match="mixed dtype"):
        F.layer_norm(torch.randn(4, 8), (8,), w, w)
    with tessera.set_eager_mode(DEFER), pytest.raises(RuntimeError, match="mixed dtype"):
        F.layer_norm(torch.randn(4, 8), (8,), w, w)
