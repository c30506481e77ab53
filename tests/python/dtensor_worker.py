"""`test_dtensor.py`'s 4-process run (gloo on CPU): every case on every rank.

    python dtensor_worker.py WORLD PORT TIMEOUT

Each case compares the DTensor run with the same computation on plain tensors in this
process (the single-process reference, same weights), and the reference once with plain
torch math. Prints one JSON line: `{"results": [{"rank", "case", "error", "time"}, ...],
"exitcodes"}`, a result per case and rank as each ends; ranks still running at TIMEOUT
(a hang) are killed, their missing cases reported by the test.
"""
import copy
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module  # noqa: E402

import tessera  # noqa: E402  (torch.distributed.tensor already loaded: rules registered)
import tessera.distributed as tdist  # noqa: E402

tpu = torch.ops.tpu
TOL = dict(rtol=1e-4, atol=1e-5)


def close(got, want, what):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    if got.shape != want.shape or not torch.allclose(got, want, **TOL):
        err = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
        raise AssertionError(f"{what}: differs from the single-process reference (max abs err {err})")


# ---- a Llama-style decoder block of torch.ops.tpu.* ops -------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        out = tpu.rmsnorm(x, self.weight, 1e-6)
        if isinstance(out, DTensor):
            self.seen = out.placements
        return out


class Attention(nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.h, self.hkv, self.dh = heads, kv_heads, head_dim
        self.wq = nn.Linear(d, heads * head_dim, bias=False)
        self.wk = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if isinstance(q, DTensor):  # the position ids join the mesh, replicated
            pos = DTensor.from_local(pos, q.device_mesh, [Replicate()] * q.device_mesh.ndim, run_check=False)
        pos = pos.repeat(b)  # [b*s] token positions
        q = tpu.rope(q.reshape(b * s, self.h, self.dh), pos).reshape(b, s, self.h, self.dh).transpose(1, 2)
        k = tpu.rope(k.reshape(b * s, self.hkv, self.dh), pos).reshape(b, s, self.hkv, self.dh).transpose(1, 2)
        v = v.reshape(b, s, self.hkv, self.dh).transpose(1, 2)
        o = tpu.flash_attention(q, k, v, causal=True)
        if isinstance(o, DTensor):  # what the rules chose, checked by the test
            self.seen = {"rope": q.placements, "flash_attention": o.placements, "local_heads": o.to_local().shape[1]}
        return self.wo(o.transpose(1, 2).reshape(b, s, self.h * self.dh))


class MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = tpu.swiglu(self.gate(x), self.up(x))
        if isinstance(h, DTensor):
            self.seen = h.placements
        return self.down(h)


class Block(nn.Module):
    def __init__(self, d=64, heads=8, kv_heads=4, head_dim=16, f=128):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(d), Attention(d, heads, kv_heads, head_dim)
        self.mlp_norm, self.mlp = RMSNorm(d), MLP(d, f)

    def forward(self, x, pos):
        h = x + self.attn(self.attn_norm(x), pos)
        return h + self.mlp(self.mlp_norm(h))


# Tensor parallel with sequence parallel norms (torchtitan's Llama plan): norms over
# sequence shards, q/k/v and gate/up column-parallel (heads / hidden sharded through rope,
# flash attention and swiglu), wo/down row-parallel reduce-scattered back to sequence shards.
TP_PLAN = {
    "attn_norm": SequenceParallel(),
    "attn.wq": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    "attn.wk": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    "attn.wv": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    "mlp_norm": SequenceParallel(),
    "mlp.gate": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    "mlp.up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
}


def torch_block(block, x, pos):
    """The block in plain torch math (no tessera op): the reference's own reference."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x, pos):  # x [b, s, h, dh], rotate-half
        dh = x.shape[-1]
        inv = 10000.0 ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        ang = pos.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
        x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
        return x * cos[None, :, None] + torch.cat([-x2, x1], -1) * sin[None, :, None]

    a = block.attn
    b, s, _ = x.shape
    h = rms(x, block.attn_norm.weight)
    q = rope((h @ a.wq.weight.T).view(b, s, a.h, a.dh), pos).transpose(1, 2)
    k = rope((h @ a.wk.weight.T).view(b, s, a.hkv, a.dh), pos).transpose(1, 2)
    v = (h @ a.wv.weight.T).view(b, s, a.hkv, a.dh).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + o.transpose(1, 2).reshape(b, s, -1) @ a.wo.weight.T
    m = block.mlp
    h = rms(x, block.mlp_norm.weight)
    return x + (F.silu(h @ m.gate.weight.T) * (h @ m.up.weight.T)) @ m.down.weight.T


def grads_of(module):
    return {n: p.grad for n, p in module.named_parameters()}


def case_llama_tp(mesh, rank, world, tp_dim=None):
    """parallelize_module over the tensor-parallel mesh (dim `tp_dim` of a 2-D mesh, whose
    other dim is data parallel: each dp rank runs its batch shard), fwd + bwd."""
    torch.manual_seed(0)
    ref = Block()
    x = torch.randn(4, 16, 64)
    pos = torch.arange(16)
    dy = torch.randn(4, 16, 64)
    if rank == 0 and tp_dim is None:  # the math, once, against plain torch
        with torch.no_grad():
            close(ref(x, pos), torch_block(ref, x, pos), "tessera block vs plain torch")
    tp_mesh = mesh if tp_dim is None else mesh[tp_dim]
    if tp_dim is not None:  # data parallel: this rank's batch shard
        dp = mesh.get_local_rank(0)
        sl = slice(dp * 2, dp * 2 + 2)
        x, dy = x[sl], dy[sl]
    block = parallelize_module(copy.deepcopy(ref), tp_mesh, TP_PLAN)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref, pos)
    out_ref.backward(dy)

    # Sequence-sharded input: this rank's chunk of the sequence (a slice of one leaf).
    chunk = x.shape[1] // tp_mesh.size()
    mine = slice(tp_mesh.get_local_rank() * chunk, (tp_mesh.get_local_rank() + 1) * chunk)
    x_leaf = x.clone().requires_grad_()
    x_dt = DTensor.from_local(x_leaf[:, mine], tp_mesh, [Shard(1)], run_check=False)
    out = block(x_dt, pos)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
    close(out, out_ref, "block output")
    # Sharded all the way through: norms over sequence shards, heads through rope and
    # attention (whole GQA groups per rank), the hidden dim through swiglu.
    n = tp_mesh.size()
    assert block.attn_norm.seen == block.mlp_norm.seen == (Shard(1),), (block.attn_norm.seen, block.mlp_norm.seen)
    assert block.attn.seen == {"rope": (Shard(1),), "flash_attention": (Shard(1),), "local_heads": 8 // n}, block.attn.seen
    assert block.mlp.seen == (Shard(2),), block.mlp.seen
    out.backward(DTensor.from_local(dy[:, mine].contiguous(), tp_mesh, [Shard(1)], run_check=False))
    for name, g in grads_of(block).items():
        close(g, grads_of(ref)[name], f"grad of {name}")
    # The input's gradient: each rank's leaf has its sequence chunk's.
    dx = x_leaf.grad.clone()
    dist.all_reduce(dx, group=tp_mesh.get_group())
    close(dx, x_ref.grad, "grad of the input")


# ---- MoE: experts sharded (expert parallel) through gmm --------------------------------------


def moe(x, router, w_gate, w_up, w_down, k, capacity, ep_mesh=None):
    """Top-k MoE with a capacity layout: row `e * capacity + i` holds expert e's i-th routed
    row (zeros past its count). Under `ep_mesh` the layout is redistributed to Shard(0)
    (each rank its experts' rows: the dispatch an all-to-all will do) and the expert
    weights are DTensors sharded over experts; gmm/swiglu run on the shards."""
    e = router.shape[1]
    weights, ids = tpu.router_topk(x @ router, k)
    xs, counts = tpu.permute(x, ids, e)  # rows sorted by expert
    starts = torch.cumsum(counts, 0) - counts
    rows = torch.arange(xs.shape[0])
    expert = torch.repeat_interleave(torch.arange(e), counts.long())
    slot = expert * capacity + (rows - starts.long()[expert])
    buf = xs.new_zeros(e * capacity, xs.shape[1]).index_copy(0, slot, xs)
    sizes = torch.full((e,), capacity, dtype=torch.int32)
    if ep_mesh is not None:
        buf = DTensor.from_local(buf, ep_mesh, [Replicate()], run_check=False).redistribute(ep_mesh, [Shard(0)])
        sizes = DTensor.from_local(sizes, ep_mesh, [Replicate()], run_check=False).redistribute(ep_mesh, [Shard(0)])
    h = tpu.swiglu(tpu.gmm(buf, w_gate, sizes), tpu.gmm(buf, w_up, sizes))
    y = tpu.gmm(h, w_down, sizes)
    if ep_mesh is not None:
        assert y.placements == (Shard(0),), y.placements  # the expert rule ran, no gather of weights
        y = y.redistribute(ep_mesh, [Replicate()]).to_local()  # the return all-to-all
    return tpu.combine(y.index_select(0, slot), weights, ids, e)


def case_moe_ep(mesh, rank, world):
    torch.manual_seed(1)
    t, d, f, e, k = 24, 32, 64, 8, 2
    x = torch.randn(t, d)
    params = [torch.randn(d, e), torch.randn(e, d, f) / 4, torch.randn(e, d, f) / 4, torch.randn(e, f, d) / 4]
    dy = torch.randn(t, d)
    capacity = t * k // e + 4  # the same on every rank (routing is replicated)
    _, ids = tpu.router_topk(x @ params[0], k)
    capacity = max(capacity, int(torch.bincount(ids.reshape(-1).long(), minlength=e).max()))

    ref = [p.clone().requires_grad_() for p in params]
    x_ref = x.clone().requires_grad_()
    out_ref = moe(x_ref, *ref, k, capacity)
    out_ref.backward(dy)
    if rank == 0:  # the reference once against plain torch (dense top-k mixture)
        with torch.no_grad():
            w, ids = tpu.router_topk(x @ params[0], k)
            dense = torch.zeros(t, d)
            for j in range(k):
                ex = ids[:, j].long()
                g, u, dn = params[1][ex], params[2][ex], params[3][ex]
                hid = F.silu(torch.einsum("td,tdf->tf", x, g)) * torch.einsum("td,tdf->tf", x, u)
                dense += w[:, j : j + 1] * torch.einsum("tf,tfd->td", hid, dn)
            close(out_ref.detach(), dense, "tessera MoE vs plain torch")

    sharded = [params[0].clone().requires_grad_()] + [
        distribute_tensor(p.clone(), mesh, [Shard(0)]).requires_grad_() for p in params[1:]
    ]
    for p in sharded[1:]:
        assert p.to_local().shape[0] == e // world  # each rank stores its experts only
    x_ep = x.clone().requires_grad_()
    out = moe(x_ep, *sharded, k, capacity, ep_mesh=mesh)
    close(out, out_ref, "MoE output")
    out.backward(dy)
    close(x_ep.grad, x_ref.grad, "MoE grad of x")
    close(sharded[0].grad, ref[0].grad, "MoE grad of the router")
    for i in (1, 2, 3):
        close(sharded[i].grad, ref[i].grad, f"MoE grad of expert weights {i}")


# ---- placements a rule does not take: redistributed, or a clear error ------------------------


def case_wrong_placements(mesh, rank, world):
    torch.manual_seed(2)
    # RMSNorm with its input sharded on the normalised dim: redistributed, still right.
    x, w = torch.randn(8, 64), torch.randn(64)
    out = tpu.rmsnorm(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Replicate()]))
    close(out, tpu.rmsnorm(x, w), "rmsnorm of an input sharded on its normalised dim")
    assert out.placements != (Shard(1),), out.placements

    # Attention with q heads sharded but kv heads replicated: kv heads get sharded to match.
    q, kk, v = torch.randn(2, 8, 16, 16), torch.randn(2, 4, 16, 16), torch.randn(2, 4, 16, 16)
    want = tpu.flash_attention(q, kk, v, causal=True)
    o = tpu.flash_attention(distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(kk, mesh, [Replicate()]), distribute_tensor(v, mesh, [Replicate()]), causal=True)
    assert o.placements == (Shard(1),), o.placements
    close(o, want, "flash attention, q heads sharded and kv heads replicated")

    # GQA with kv heads the mesh does not divide (H = 12, Hkv = 6 on 4 ranks: torch would
    # split them 3,3,3,3 and 2,2,2,0), or fewer than the ranks (Hkv = 2): no head sharding.
    for h, hkv in ((12, 6), (8, 2)):
        q2, k2, v2 = torch.randn(2, h, 16, 16), torch.randn(2, hkv, 16, 16), torch.randn(2, hkv, 16, 16)
        want = tpu.flash_attention(q2, k2, v2, causal=True)
        o = tpu.flash_attention(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q2, k2, v2)), causal=True)
        close(o, want, f"flash attention, {hkv} kv heads on {world} ranks")
        assert Shard(1) not in o.placements, o.placements
    # ... while the batch can still be sharded.
    q3, k3 = torch.randn(4, 8, 16, 16), torch.randn(4, 2, 16, 16)
    o = tpu.flash_attention(*(distribute_tensor(t, mesh, [Shard(0)]) for t in (q3, k3, k3)), causal=False)
    assert o.placements == (Shard(0),), o.placements
    close(o, tpu.flash_attention(q3, k3, k3, causal=False), "flash attention sharded over batch")

    # Cross-entropy with vocab-sharded logits: redistributed (the lse is not a sum of shards).
    logits, labels = torch.randn(8, 64), torch.randint(0, 64, (8,), dtype=torch.int32)
    loss, lse = tpu.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]), distribute_tensor(labels, mesh, [Replicate()]))
    want_loss, want_lse = tpu.cross_entropy(logits, labels)
    close(loss, want_loss, "cross entropy of vocab-sharded logits")
    close(lse, want_lse, "cross entropy lse of vocab-sharded logits")

    # ... and over tokens, with the mean after the op reduced by DTensor (aten's rule: the
    # token-sharded sum becomes Partial, then Replicate), forward and backward.
    lg_ref = logits.clone().requires_grad_()
    tpu.cross_entropy(lg_ref, labels)[0].mean().backward()
    lg = distribute_tensor(logits.clone(), mesh, [Shard(0)]).requires_grad_()
    mean = tpu.cross_entropy(lg, distribute_tensor(labels, mesh, [Shard(0)]))[0].mean()
    close(mean, tpu.cross_entropy(logits, labels)[0].mean(), "mean cross entropy over token shards")
    mean.backward()
    assert lg.grad.placements == (Shard(0),), lg.grad.placements
    close(lg.grad, lg_ref.grad, "grad of the mean cross entropy over token shards")

    # matmul: column (Shard(1) weight -> Shard(1) out) and row (Shard(0) of K -> Partial).
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    col = tpu.matmul(distribute_tensor(a, mesh, [Replicate()]), distribute_tensor(b, mesh, [Shard(1)]))
    assert col.placements == (Shard(1),), col.placements
    close(col, a @ b, "matmul, column parallel")
    row = tpu.matmul(distribute_tensor(a, mesh, [Shard(1)]), distribute_tensor(b, mesh, [Shard(0)]))
    assert row.placements == (Partial(),), row.placements
    close(row, a @ b, "matmul, row parallel")

    # gmm with experts sharded but tokens replicated: the expert rule needs aligned rows,
    # so the weights are gathered instead (right for any group sizes).
    lhs, rhs = torch.randn(16, 32), torch.randn(4, 32, 16)
    sizes = torch.tensor([3, 5, 1, 7], dtype=torch.int32)
    got = tpu.gmm(distribute_tensor(lhs, mesh, [Replicate()]), distribute_tensor(rhs, mesh, [Shard(0)]), distribute_tensor(sizes, mesh, [Replicate()]))
    close(got, tpu.gmm(lhs, rhs, sizes), "gmm, experts sharded, tokens replicated")
    # Rows sharded as if aligned with the experts when they are not: the kernels' host
    # check refuses every misaligned shard (here all of them) with an error naming gmm.
    try:
        tpu.gmm(distribute_tensor(lhs, mesh, [Shard(0)]), distribute_tensor(rhs, mesh, [Shard(0)]), distribute_tensor(torch.tensor([3, 5, 3, 5], dtype=torch.int32), mesh, [Shard(0)]))
    except ValueError as e:
        assert "gmm" in str(e) and "group_sizes" in str(e) and "Shard(0)" in str(e), e
    else:
        raise AssertionError("gmm on misaligned expert shards did not raise")


def case_2d_mesh(mesh2, rank, world):
    case_llama_tp(mesh2, rank, world, tp_dim="tp")
    # Heads sharded over both mesh dims: 6 kv heads split 2 ways per mesh dim but not 4
    # ways overall, a condition on the whole mesh (each dim alone would pass).
    torch.manual_seed(3)
    q, kv = torch.randn(2, 12, 16, 16), torch.randn(2, 6, 16, 16)
    o = tpu.flash_attention(*(distribute_tensor(t, mesh2, [Shard(1), Shard(1)]) for t in (q, kv, kv)))
    close(o, tpu.flash_attention(q, kv, kv), "flash attention, heads over both mesh dims")
    assert o.placements != (Shard(1), Shard(1)), o.placements


def case_user_op(mesh, rank, world):
    """A user crate's op (no rules): replicated, still right."""
    try:
        import tessera_example
    except ImportError:
        return
    tessera.register_ops(tessera_example)  # torch.ops.tpu.scaled_silu, and its DTensor strategy
    x, scale = torch.randn(8, 16), torch.randn(16)
    got = tpu.scaled_silu(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(scale, mesh, [Replicate()]))
    close(got, tpu.scaled_silu(x, scale), "a user op without rules")
    assert got.placements == (Replicate(),), got.placements

# ---- the collective kernels as torch.ops.tpu.* (remote DMA rings on the device simulation) ----


def _gathered(t):
    """Every rank's `t` through torch.distributed's own all-gather (the independent reference)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def case_collectives(mesh, rank, world):
    """all_gather / reduce_scatter / all_gather_matmul against torch.distributed and plain
    sums, forward and backward; ranks passing different shapes all raise (none hangs)."""
    gen = torch.Generator().manual_seed(100 + rank)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-5)), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        x = torch.randn(3, 5, 6, generator=gen).to(dtype)
        for dim in (0, 1, -1):
            want = torch.cat(_gathered(x), dim=dim)
            got = tdist.all_gather(x, dim)
            assert torch.equal(got, want), f"all_gather dim {dim} {dtype}"
        y = torch.randn(2, 4 * world, 3, generator=gen).to(dtype)
        want = torch.stack([t.float() for t in _gathered(y)]).sum(0).chunk(world, dim=1)[rank].to(dtype)
        got = tdist.reduce_scatter(y, 1)
        assert torch.allclose(got.float(), want.float(), **tol), f"reduce_scatter {dtype}: {(got.float() - want.float()).abs().max()}"
    # Backward: all_gather's is the reduce-scatter of every rank's output gradient.
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    g = torch.randn(4 * world, 8, generator=gen)
    tdist.all_gather(x, 0).backward(g)
    want = torch.stack(_gathered(g)).sum(0).chunk(world)[rank]
    assert torch.allclose(x.grad, want, rtol=1e-5, atol=1e-5), "all_gather backward"
    y = torch.randn(4 * world, 8, generator=gen, requires_grad=True)
    g = torch.randn(4, 8, generator=gen)
    tdist.reduce_scatter(y, 0).backward(g)
    assert torch.equal(y.grad, torch.cat(_gathered(g))), "reduce_scatter backward"
    # all_gather_matmul: gather(x) @ w, and its gradients.
    torch.manual_seed(7)
    w = torch.randn(16, 24, requires_grad=True)
    x = torch.randn(8, 16, generator=gen, requires_grad=True)
    out = tdist.all_gather_matmul(x, w)
    xs = torch.cat(_gathered(x.detach()))
    close(out, xs @ w.detach(), "all_gather_matmul")
    g = torch.randn_like(out)
    out.backward(g)
    gs = _gathered(g)
    close(x.grad, sum(gi[rank * 8 : (rank + 1) * 8] for gi in gs) @ w.detach().t(), "all_gather_matmul dx")
    close(w.grad, xs.t() @ g, "all_gather_matmul dw")
    # The ops' registrations (schema, fake shapes, autograd) and a fullgraph compile.
    group_name = dist.group.WORLD.group_name
    a = torch.randn(4, 8, generator=gen, requires_grad=True)
    for op, args in (
        (tpu.all_gather, (a, 1, group_name)),
        (tpu.reduce_scatter, (torch.randn(4 * world, 3, generator=gen, requires_grad=True), 0, group_name)),
        (tpu.all_gather_matmul, (a, torch.randn(8, 16, generator=gen, requires_grad=True), group_name)),
    ):
        torch.library.opcheck(op, args)
    compiled = torch.compile(lambda x, w: F.relu(tdist.all_gather_matmul(x, w)).sum(0), backend="aot_eager", fullgraph=True)
    close(compiled(x.detach(), w.detach()), F.relu(xs @ w.detach()).sum(0), "all_gather_matmul under torch.compile(fullgraph=True)")
    # A dim out of range is torch's IndexError on every rank (never a wrap onto another dim).
    for f in (tdist.all_gather, tdist.reduce_scatter):
        for d in (2, 5, -3):
            try:
                f(torch.zeros(4 * world, 3), d)
            except IndexError as e:
                assert "Dimension out of range" in str(e) and f.__name__ in str(e), e
            else:
                raise AssertionError(f"{f.__name__} with dim {d} of a 2-D tensor did not raise")
    # Ranks that disagree on shapes: every rank raises the same error.
    try:
        tdist.all_gather(torch.zeros(2 + (rank == 1), 3), 0)
    except ValueError as e:
        assert "rank 1 passes operands of other shapes" in str(e), e
    else:
        raise AssertionError("all_gather with different shapes on rank 1 did not raise")


def case_ragged_all_to_all(mesh, rank, world):
    """Random ragged metadata (the same draw on every rank), f32 and bf16 rows: each rank's
    result equals the rows its peers sent, placed where they said; rows nobody sends keep
    `output`'s values; a recv_sizes that disagrees with the senders raises on every rank."""
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float32)):
        g = torch.Generator().manual_seed(seed)
        t, h = 13, 6
        sizes = torch.randint(0, 4, (world, world), generator=g)  # sizes[d][p]: rows d sends p
        rows_in = [torch.randn(t, h, generator=g).to(dtype) for _ in range(world)]
        # Receivers stack senders in order, after a gap of 1 row; `output` starts as -7.
        tout = 1 + int(sizes.sum(0).max())
        io = torch.cumsum(sizes[rank], 0) - sizes[rank]
        oo = torch.tensor([1 + int(sizes[:rank, p].sum()) for p in range(world)])
        got = tdist.ragged_all_to_all(rows_in[rank], torch.full((tout, h), -7.0, dtype=dtype), io, sizes[rank], oo, sizes[:, rank])
        want = torch.full((tout, h), -7.0, dtype=dtype)
        at = 1
        for d in range(world):
            start = int(sizes[d, :rank].sum())
            n = int(sizes[d, rank])
            want[at : at + n] = rows_in[d][start : start + n]
            at += n
        assert torch.equal(got, want), f"ragged_all_to_all seed {seed} {dtype}"
        if seed == 0:
            args = (rows_in[rank].clone().requires_grad_(), torch.zeros(tout, h, requires_grad=True), io, sizes[rank], oo, sizes[:, rank], dist.group.WORLD.group_name)
            torch.library.opcheck(tpu.ragged_all_to_all, args)
    try:
        bad = sizes[:, rank].clone()
        bad[0] += 1
        tdist.ragged_all_to_all(rows_in[rank], torch.zeros(tout + 1, h, dtype=dtype), io, sizes[rank], oo, bad)
    except ValueError as e:
        assert "recv_sizes on each rank must equal what its peers send it" in str(e), e
    else:
        raise AssertionError("mismatched recv_sizes did not raise")


def case_collectives_on_tpu(mesh, rank, world):
    """The collective ops on the emulated `tpu` device: results on the device, equal to the CPU
    run, gradients too."""
    from tessera import emulated_tpu

    dev = emulated_tpu.enable()
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(4, 16, generator=gen)
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    xt, wt = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    out = tdist.all_gather_matmul(xt, wt)
    assert out.device.type == "tpu", out.device
    close(out.cpu(), torch.cat(_gathered(x)) @ w, "all_gather_matmul on tpu")
    out.sum().backward()
    assert xt.grad.device.type == "tpu"
    close(xt.grad.cpu(), world * torch.ones(4, 8) @ w.t(), "all_gather_matmul dx on tpu")
    got = tdist.reduce_scatter(torch.arange(world * 3.0).repeat(2, 1).to(dev), 1)
    assert torch.equal(got.cpu(), world * torch.arange(rank * 3.0, rank * 3.0 + 3).repeat(2, 1)), got.cpu()



def moe_a2a(x, router, w_gate, w_up, w_down, k, e, group=None):
    """Expert-parallel top-k MoE on this rank's tokens `x`: rows sorted by expert
    (`permute`), sent to the ranks that own their experts with the ragged all-to-all, run
    through gmm/swiglu on the local experts (`w_*` hold this rank's `e / world`), sent back
    with the ragged all-to-all in reverse, and combined."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    el = e // world
    weights, ids = tpu.router_topk(x @ router, k)
    xs, counts = tpu.permute(x, ids, e)
    c = torch.stack(_gathered(counts.to(torch.int64)))  # c[q, ex]: rows rank q routes to expert ex
    per_rank = c.view(world, world, el).sum(-1)  # per_rank[q, p]: rows q sends p
    send, recv = per_rank[rank], per_rank[:, rank]
    io = torch.cumsum(send, 0) - send
    oo = torch.stack([per_rank[:rank, p].sum() for p in range(world)])
    tout = int(per_rank.sum(0).max())  # one receive buffer shape on every rank
    got = tdist.ragged_all_to_all(xs, xs.new_zeros(tout, x.shape[1]), io, send, oo, recv, group)
    # Received rows are sender-major; gmm wants them expert-major.
    base = torch.cumsum(recv, 0) - recv
    local = c[:, rank * el : (rank + 1) * el]  # local[q, j]: rows from q for local expert j
    within = torch.cumsum(local, 1) - local
    perm = torch.cat([torch.arange(int(local[q, j])) + int(base[q] + within[q, j]) for j in range(el) for q in range(world)]).long()
    sizes = local.sum(0).to(torch.int32)
    grouped = got.index_select(0, perm)
    hid = tpu.swiglu(tpu.gmm(grouped, w_gate, sizes), tpu.gmm(grouped, w_up, sizes))
    y = tpu.gmm(hid, w_down, sizes)
    back = y.new_zeros(tout, y.shape[1]).index_copy(0, perm, y)
    # The return trip: the rows each peer sent, from where they landed to where they came from.
    their_io = torch.stack([torch.cumsum(per_rank[q], 0)[rank] - per_rank[q, rank] for q in range(world)])
    ret = tdist.ragged_all_to_all(back, xs.new_zeros(xs.shape), base, recv, their_io, send, group)
    return tpu.combine(ret, weights, ids, e)


def case_moe_a2a(mesh, rank, world):
    torch.manual_seed(3)
    t, d, f, e, k = 12, 32, 48, 8, 2
    el = e // world
    xs_all = torch.randn(world * t, d)  # every rank's tokens (the same draw everywhere)
    params = [torch.randn(d, e), torch.randn(e, d, f) / 4, torch.randn(e, d, f) / 4, torch.randn(e, f, d) / 4]
    dy_all = torch.randn(world * t, d)
    # The single-process reference: plain torch, dense over each token's top-k experts.
    ref = [p.clone().requires_grad_() for p in params]
    x_ref = xs_all.clone().requires_grad_()
    w, ids = tpu.router_topk(x_ref @ ref[0], k)
    dense = torch.zeros(world * t, d)
    for j in range(k):
        ex = ids[:, j].long()
        hid = F.silu(torch.einsum("td,tdf->tf", x_ref, ref[1][ex])) * torch.einsum("td,tdf->tf", x_ref, ref[2][ex])
        dense = dense + w[:, j : j + 1] * torch.einsum("tf,tfd->td", hid, ref[3][ex])
    dense.backward(dy_all)
    mine = slice(rank * t, (rank + 1) * t)
    experts = slice(rank * el, (rank + 1) * el)
    x = xs_all[mine].clone().requires_grad_()
    local = [params[0].clone().requires_grad_()] + [p[experts].clone().requires_grad_() for p in params[1:]]
    out = moe_a2a(x, *local, k, e)
    close(out, dense.detach()[mine], "MoE (ragged all-to-all) output")
    out.backward(dy_all[mine])
    close(x.grad, x_ref.grad[mine], "MoE (ragged all-to-all) grad of x")
    for i in (1, 2, 3):
        close(local[i].grad, ref[i].grad[experts], f"MoE (ragged all-to-all) grad of expert weights {i}")
    router_grad = local[0].grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the ranks' sum
    close(router_grad, ref[0].grad, "MoE (ragged all-to-all) grad of the router")



CASES = [("llama_tp", case_llama_tp), ("moe_ep", case_moe_ep), ("collectives", case_collectives), ("ragged_all_to_all", case_ragged_all_to_all), ("moe_a2a", case_moe_a2a), ("collectives_on_tpu", case_collectives_on_tpu), ("wrong_placements", case_wrong_placements), ("user_op", case_user_op)]


def run_rank(rank, world, port, results):
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for name, fn in CASES + [("llama_dp_x_tp", lambda m, r, w: case_2d_mesh(mesh2, r, w))]:
        t0 = time.time()
        try:
            fn(mesh, rank, world)
            error = None
        except Exception as e:  # reported per case as it ends (a later hang loses nothing)
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        results.put({"rank": rank, "case": name, "error": error, "time": round(time.time() - t0, 2)})
        dist.barrier()
    dist.destroy_process_group()


def main():
    """Imports once, then forks the ranks (no op has run yet, so no thread pool is
    inherited): one import of torch + tessera instead of one per rank."""
    import multiprocessing
    import queue

    world, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline, out = time.time() + timeout, []
    expected = world * (len(CASES) + 1)
    while len(out) < expected:
        try:
            out.append(results.get(timeout=max(0.1, deadline - time.time())))
        except queue.Empty:  # a rank hung or died: report what arrived
            break
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.time()))
        if p.is_alive():
            p.kill()
    print(json.dumps({"results": out, "exitcodes": [p.exitcode for p in procs]}), flush=True)


if __name__ == "__main__":
    main()
