"""Every `torch.ops.tpu.*` op of the tessera package, on CPU tensors (the interpreter).

For every op in `tessera.ops()` (a test fails if an op has no samples):

- `torch.library.opcheck` with all its default tests on every sample (schema, autograd
  registration, fake tensor vs real kernel, AOT dispatch with dynamic shapes), float inputs
  requiring grad for the differentiable ops;
- numerics against an independent float64 PyTorch reference written here (stock torch ops),
  float32 and bfloat16, relative max-norm error (max |got - ref| / max |ref|);
- gradients of the differentiable ops through autograd vs autograd of the float64 reference;
- `torch.compile(fullgraph=True)` (inductor) of a small transformer block and of a MoE layer
  with dynamic shapes, forward and backward, equal to eager; `torch.export.export`;
- shape errors: a `ValueError` naming the op, the operand and the violated rule.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_ops.py
"""
import functools
import math
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

tessera = pytest.importorskip("tessera")
from tessera._autograd import LSE_GRADIENTS  # noqa: E402
tpu = torch.ops.tpu

F32, BF16, I32, I8 = torch.float32, torch.bfloat16, torch.int32, torch.int8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOATS = (F32, BF16)
# Relative max-norm tolerance by the dtype of the output compared (fp8 results are the
# quantizers', bit for bit against a reference computed as torch computes them).
TOL = {F32: 1e-5, BF16: 2e-2, E4M3: 0.0, E5M2: 0.0}

# Differentiable ops, from the op table's declared backwards: which arguments get gradients,
# which outputs carry them (expert ids and group sizes do not; lse does, through a composite).
def _differentiable():
    from tessera._ops import SPECS

    args, outs = {}, {}
    for name, spec in SPECS.items():
        source = SPECS[spec.alias_of[0]] if spec.alias_of else spec
        if source.backward is None:
            continue
        bwd_op, bwd_args, grads = source.backward
        targets = {n for g in grads for n in g}
        args[name] = tuple(i for i, n in enumerate(spec.arg_names) if n in targets)
        if spec.alias_of:
            outs[name] = (0,)
        elif bwd_op == "composite":
            outs[name] = tuple(i for i, (_, _, dtype) in enumerate(spec.outputs) if dtype != "i32")
        else:
            # lse carries a gradient where a composite adds it (tessera._autograd.LSE_GRADIENTS).
            outs[name] = tuple(i for i, (o, _, _) in enumerate(spec.outputs) if "d_" + o in bwd_args or (o == "lse" and name in LSE_GRADIENTS))
    return args, outs


DIFF_ARGS, DIFF_OUTS = _differentiable()


def diff_outs(op, kwargs):
    """The outputs of a call of `op` a gradient may flow into (None: all)."""
    return DIFF_OUTS.get(op)


# ---- helpers -------------------------------------------------------------------------------


class Rng:
    """Seeded tensors: each sample draws from its own generator, so samples are reproducible."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=F32, scale=1.0):
        return (torch.randn(*shape, generator=self.g, dtype=torch.float64) * scale).to(dtype)

    def uniform(self, *shape, lo=-1.0, hi=1.0, dtype=F32):
        return (torch.rand(*shape, generator=self.g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)

    def randint(self, lo, hi, *shape, dtype=I32):
        return torch.randint(lo, hi, shape, generator=self.g).to(dtype)


def f64(t):
    """A float tensor as a detached float64 copy; anything else unchanged."""
    return t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def rel_err(got, ref):
    """max |got - ref| / max |ref| (NaN counts as infinitely wrong; a zero ref (up to float64
    roundoff, < 1e-12): the absolute error)."""
    got, ref = got.detach().double(), ref.detach().double()
    if ref.numel() == 0:
        return 0.0
    diff = (got - ref).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    scale = ref.abs().max().item()
    return diff.max().item() / (scale if scale > 1e-12 else 1.0)


def bits_equal(a, b):
    """Exactly equal (fp8 compared by their codes: fp8 CPU tensors take no torch.equal)."""
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and a.dtype == b.dtype:
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def assert_close(got, ref, what, tol=None):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
    if not ref.is_floating_point():
        assert torch.equal(got.to(ref.dtype), ref), f"{what}: integer output differs from the reference:\n{got}\nvs\n{ref}"
        return
    tol = TOL[got.dtype] if tol is None else tol
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative max-norm error {err:.3g} > {tol:g}"


# ---- independent float64 references (stock torch ops only) ---------------------------------


def vjp(f, inputs, cotangents):
    """Gradients of `f(*inputs)` (a tensor or tuple) w.r.t. `inputs` for `cotangents`."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    with torch.enable_grad():
        outs = as_tuple(f(*leaves))
        return torch.autograd.grad([o for o, c in zip(outs, cotangents) if c is not None], leaves, [c for c in cotangents if c is not None], allow_unused=True)


def ref_matmul(x, y):
    return x @ y


def ref_gelu_affine(x, a, b):
    return F.gelu(x * a + b, approximate="tanh")


def ref_softmax(x):
    return torch.softmax(x, -1)


def ref_rmsnorm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_rmsnorm_residual(x, residual, weight, eps=1e-6):
    h = x + residual
    return ref_rmsnorm(h, weight, eps), h


def ref_layernorm(x, weight, bias, eps=1e-5):
    # weight and bias are [n] or [1, n] each (their gradients keep those shapes).
    return F.layer_norm(x, (x.shape[-1],), weight.reshape(-1), bias.reshape(-1), eps)


def ref_rmsnorm_bwd(x, weight, dy, eps=1e-6):
    return vjp(lambda x, w: ref_rmsnorm(x, w, eps), (x, weight), (dy,))


def ref_swiglu(a, b):
    return F.silu(a) * b


def ref_swiglu_bwd(a, b, dy):
    return vjp(ref_swiglu, (a, b), (dy,))


def ref_rope(x, position_ids, theta=10000.0, interleaved=False):
    """x [t, h, d]: rotate-half (Llama / NeoX) or interleaved pairs (GPT-J), angle p * theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position_ids.double()[:, None, None] * inv_freq  # [t, 1, d/2]
    cos, sin = angle.cos(), angle.sin()
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def ref_rope_bwd(dy, position_ids, theta=10000.0, interleaved=False):
    return vjp(lambda x: ref_rope(x, position_ids, theta, interleaved), (torch.zeros_like(dy),), (dy,))[0]


def ref_cross_entropy(logits, labels):
    """(loss, lse); a label outside [0, vocab) (e.g. -100) is ignored: loss 0."""
    labels = labels.long()
    loss = F.cross_entropy(logits, labels.where((labels >= 0) & (labels < logits.shape[1]), -100), reduction="none", ignore_index=-100)
    return loss, torch.logsumexp(logits, -1)


def ref_cross_entropy_bwd(logits, labels, lse, dloss):
    return vjp(lambda z: ref_cross_entropy(z, labels)[0], (logits,), (dloss.double(),))[0]


def ref_cross_entropy_with_grad(logits, labels):
    loss = ref_cross_entropy(logits, labels)[0]
    return loss, ref_cross_entropy_bwd(logits, labels, None, torch.ones_like(loss))


def ref_quantized_matmul(x, w, scale):
    return x @ (w.double() * scale.double()[:, None]).T


def ref_matmul_int4(x, w, scale):
    return x @ tessera.quant4.dequantize("int4", w, scale)


def ref_matmul_mxfp4(x, w, scale):
    return x @ tessera.quant4.dequantize("mxfp4", w, scale)


def ref_matmul_nvfp4(x, w, scale, global_scale):
    return x @ tessera.quant4.dequantize("nvfp4", w, scale, global_scale)


def ref_matmul_int4_dx(dy, w, scale):
    return dy @ tessera.quant4.dequantize("int4", w, scale).T


def ref_matmul_mxfp4_dx(dy, w, scale):
    return dy @ tessera.quant4.dequantize("mxfp4", w, scale).T


def ref_matmul_nvfp4_dx(dy, w, scale, global_scale):
    return dy @ tessera.quant4.dequantize("nvfp4", w, scale, global_scale).T


def ref_int_mm(a, b):
    return (a.double() @ b.double()).to(torch.int64).to(torch.int32)


def _per_element(scale, rows, cols, br, bc):
    """A scale per `br x bc` block, repeated to every element of a `[rows, cols]` operand."""
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def ref_scaled_mm_blockwise(a, b, scale_a, scale_b, transpose_rhs=False):
    """TorchTPU's blockwise recipe: per 128-wide K block, the block's product times its row
    scales and its 128x128 tile scales (for finite scales: dequantize, then matmul)."""
    a, b = a.double(), (b.double().T if transpose_rhs else b.double())
    sb = scale_b.double().T if transpose_rhs else scale_b.double()  # [k/128, ceil(n/128)]
    n = b.shape[1]
    out = 0
    for q in range(a.shape[1] // 128):
        blk = slice(q * 128, (q + 1) * 128)
        out = out + (a[:, blk] @ b[blk]) * scale_a.double()[:, q : q + 1] * sb[q].repeat_interleave(128)[:n]
    return out


def ref_scaled_mm_blockwise_wgrad(a, g, scale_a, scale_g):
    """a^T @ g per 128-row block, times the outer product of the blocks' 128x1 scales."""
    out = 0
    for q in range(a.shape[0] // 128):
        blk = slice(q * 128, (q + 1) * 128)
        out = out + (a.double()[blk].T @ g.double()[blk]) * scale_a.double()[q][:, None] * scale_g.double()[q][None, :]
    return out


def _quantize(x, br, bc):
    """torch's amax/448 recipe in float32: scale = amax.clamp(min=1e-12) / 448 per block,
    q = (x / scale).to(float8_e4m3fn)."""
    x = x.float()
    m, n = x.shape
    amax = x.abs().reshape(m // br, br, n // bc, bc).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / 448.0
    q = (x / _per_element(scale, m, n, br, bc)).to(E4M3)
    return q.double(), scale.double()


def ref_quantize_fp8_1x128(x):
    return _quantize(x, 1, 128)


def ref_quantize_fp8_128x1(x):
    return _quantize(x, 128, 1)


def _groups(group_sizes):
    ends = torch.cumsum(group_sizes.long(), 0).tolist()
    return list(zip([0] + ends[:-1], ends))


def ref_gmm(lhs, rhs, group_sizes, transpose_rhs=False):
    parts = [lhs[s:e] @ (rhs[g].T if transpose_rhs else rhs[g]) for g, (s, e) in enumerate(_groups(group_sizes))]
    return torch.cat(parts, 0)


def ref_tgmm(lhs, grad, group_sizes):
    return torch.stack([lhs[s:e].T @ grad[s:e] for s, e in _groups(group_sizes)])


def ref_router_topk(logits, k=2, gate="softmax", normalize=True):
    """Top-k on the logits, ties to the lowest expert id (a stable descending sort)."""
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    if gate == "softmax":
        w = torch.softmax(logits, -1).gather(1, ids)
    else:
        w = torch.sigmoid(logits.gather(1, ids))
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(I32)


def _sorted_rows(expert_ids):
    """The (token, slot) pairs, flattened as t * k + j, stably sorted by expert id."""
    return torch.sort(expert_ids.reshape(-1).long(), stable=True).indices


def ref_permute(x, expert_ids, num_experts):
    order = _sorted_rows(expert_ids)
    sizes = torch.bincount(expert_ids.reshape(-1).long(), minlength=num_experts).to(I32)
    return x[order // expert_ids.shape[1]], sizes


def ref_combine(y, weights, expert_ids, num_experts):
    t, k = expert_ids.shape
    order = _sorted_rows(expert_ids)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * k)
    return (weights[..., None] * y[pos.view(t, k)]).sum(1)


def _attention_logits(q, k, sm_scale, soft_cap, causal, q_segment_ids, kv_segment_ids, window_left=None, window_right=None):
    """Scaled, capped logits [b, h, sq, skv] and the visibility mask (GQA by repeating kv heads;
    row r sees key c only if r - c <= window_left and c - r <= window_right, when given)."""
    g = q.shape[1] // k.shape[1]
    s = sm_scale * q @ k.repeat_interleave(g, 1).transpose(-1, -2)
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    sq, skv = q.shape[2], k.shape[2]
    mask = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask)  # top-left aligned, as SDPA's is_causal
    r, c = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    if window_left is not None:
        mask = mask & (r - c <= window_left)
    if window_right is not None:
        mask = mask & (c - r <= window_right)
    mask = mask[None, None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return s, mask


def ref_flash_attention_fwd(q, k, v, causal=False, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None, window_left=None, window_right=None):
    """(o, lse) by math attention over the visible keys: masking selects (a masked logit is
    -inf whatever its value), and a row with no visible key or only -inf logits gets o = 0
    (SDPA's safe softmax). Neither SDPA backend is this on nonfinite inputs: CPU's fused
    kernel turns a NaN query row into zeros, the math backend adds its mask, so a masked
    NaN or +inf logit poisons the row."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s, mask = _attention_logits(q, k, scale, soft_cap, causal, q_segment_ids, kv_segment_ids, window_left, window_right)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
    o = p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return o, lse


def ref_flash_attention(*args, **kwargs):
    return ref_flash_attention_fwd(*args, **kwargs)[0]


def ref_flash_attention_bwd(q, k, v, o, lse, do, causal=False, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None, window_left=None, window_right=None):
    fwd = lambda q, k, v: ref_flash_attention_fwd(q, k, v, causal, sm_scale, soft_cap, q_segment_ids, kv_segment_ids, window_left, window_right)[0]  # noqa: E731
    return vjp(fwd, (q, k, v), (do,))


def splash_dense_mask(mask_blocks, fwd_info, sq, skv):
    """The `[heads, sq, skv]` bool mask splash metadata describes, decoded here from its
    documented format (independently of the Rust builder): a visited block is all visible
    (kind 2) or its partial block's bits (kind 1); unvisited blocks are masked."""
    _, bq, bk = mask_blocks.shape
    _, heads, nq, steps = fwd_info.shape
    nk = -(-skv // bk)
    assert nq == -(-sq // bq), "the metadata's q blocks"
    m = torch.zeros(heads, nq * bq, nk * bk, dtype=torch.bool)
    info = fwd_info.long().tolist()
    for h in range(heads):
        for i in range(nq):
            for st in range(steps):
                j, kind, mid = info[0][h][i][st], info[1][h][i][st], info[2][h][i][st]
                if kind:
                    blk = torch.ones(bq, bk, dtype=torch.bool) if kind == 2 else mask_blocks[mid] != 0
                    m[h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk] = blk
    return m[:, :sq, :skv]


def ref_splash_attention_fwd(q, k, v, mask_blocks, fwd_info, bwd_info, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None):
    """Math attention under the decoded mask (and segment ids), as ref_flash_attention_fwd."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s, seg = _attention_logits(q, k, scale, soft_cap, False, q_segment_ids, kv_segment_ids, None, None)
    mask = seg & splash_dense_mask(mask_blocks, fwd_info, q.shape[2], k.shape[2])[None]
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
    return p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1), lse


def ref_splash_attention(*args, **kwargs):
    return ref_splash_attention_fwd(*args, **kwargs)[0]


def ref_splash_attention_bwd(q, k, v, o, lse, do, mask_blocks, fwd_info, bwd_info, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None):
    fwd = lambda q, k, v: ref_splash_attention_fwd(q, k, v, mask_blocks, fwd_info, bwd_info, sm_scale, soft_cap, q_segment_ids, kv_segment_ids)[0]  # noqa: E731
    return vjp(fwd, (q, k, v), (do,))


def _gather_pages(pages, page_indices):
    """[hkv, num_pages, page_size, d] pages of one sequence's table -> its [hkv, tokens, d] cache."""
    hkv, _, ps, d = pages.shape
    return pages[:, page_indices.long()].reshape(hkv, -1, d)


def ref_paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=None, k_scale=None, v_scale=None, k_token_scales=None, v_token_scales=None):
    """Decode attention (q pre-scaled): gathered pages, softmax masked past each length; empty -> 0.
    A quantized cache is dequantised first: stored * scale * token scale."""
    def dequantize(pages, scale, token_scales):
        x = pages.double() * (1.0 if scale is None else scale)
        return x if token_scales is None else x * token_scales.double()[..., None]

    k_pages, v_pages = dequantize(k_pages, k_scale, k_token_scales), dequantize(v_pages, v_scale, v_token_scales)
    b, h, d = q.shape
    g = h // k_pages.shape[0]
    k = torch.stack([_gather_pages(k_pages, page_indices[s]) for s in range(b)]).repeat_interleave(g, 1)  # [b, h, n, d]
    v = torch.stack([_gather_pages(v_pages, page_indices[s]) for s in range(b)]).repeat_interleave(g, 1)
    scores = torch.einsum("bhd,bhnd->bhn", q, k)
    visible = torch.arange(k.shape[2])[None, None, :] < lengths.long()[:, None, None]
    p = torch.softmax(scores.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    return torch.einsum("bhn,bhnd->bhd", p, v)


def ref_ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0, sliding_window=None, soft_cap=None, num_queries_per_block=None, num_kv_pages_per_block=None):
    """Per sequence: its query tokens at the last q_len positions of its kv_len keys, causal (+ window)."""
    out = torch.zeros_like(q)
    g = q.shape[1] // k_pages.shape[0]
    for s in range(int(num_seqs[0])):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if end == start:
            continue
        k = _gather_pages(k_pages, page_indices[s])[:, :kv_len].repeat_interleave(g, 0)  # [h, kv_len, d]
        v = _gather_pages(v_pages, page_indices[s])[:, :kv_len].repeat_interleave(g, 0)
        scores = sm_scale * q[start:end].transpose(0, 1) @ k.transpose(1, 2)  # [h, q_len, kv_len]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(kv_len - (end - start), kv_len)[:, None]
        kpos = torch.arange(kv_len)[None, :]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible = visible & (kpos > qpos - sliding_window)
        p = torch.softmax(scores.masked_fill(~visible, -math.inf), -1)
        out[start:end] = (p @ v).transpose(0, 1)
    return out


REFERENCES = {name[4:]: f for name, f in dict(globals()).items() if name.startswith("ref_")}


# ---- samples: valid inputs for every op ------------------------------------------------------

SAMPLES = {}  # op -> [(sample name, dtypes, builder(rng, dtype) -> (args, kwargs))]
# Samples drawn from the op table (ops without hand-written samples): sample -> case.
TABLE_SAMPLES = {}


def sample(op, name, dtypes=FLOATS):
    def register(builder):
        SAMPLES.setdefault(op, []).append((name, dtypes, builder))
        return builder

    return register


@sample("matmul", "aligned")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt), r.randn(128, 256, dtype=dt)), {}


@sample("matmul", "small_full_dims")
def _(r, dt):
    return (r.randn(8, 64, dtype=dt), r.randn(64, 32, dtype=dt)), {}


@sample("matmul", "multi_block")
def _(r, dt):
    # Several m blocks and two k steps (bk = 1024): the accumulator across k.
    return (r.randn(640, 2048, dtype=dt, scale=0.1), r.randn(2048, 384, dtype=dt)), {}


@sample("matmul", "transposed_views")
def _(r, dt):
    # Non-contiguous operands (views of transposed storage): the op reads them as torch does.
    return (r.randn(128, 16, dtype=dt).t(), r.randn(64, 128, dtype=dt).t()), {}


@sample("gelu_affine", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("gelu_affine", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("gelu_affine", "3d_unaligned")
def _(r, dt):
    return (r.randn(2, 5, 96, dtype=dt), r.randn(96, dtype=dt), r.randn(96, dtype=dt)), {}


@sample("softmax", "3d")
def _(r, dt):
    return (r.randn(2, 8, 128, dtype=dt, scale=3.0),), {}


@sample("softmax", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt, scale=3.0),), {}


@sample("softmax", "unaligned")
def _(r, dt):
    return (r.randn(5, 200, dtype=dt, scale=3.0),), {}


@sample("rmsnorm", "3d_default_eps")
def _(r, dt):
    return (r.randn(2, 8, 128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("rmsnorm", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("rmsnorm", "eps_kwarg")
def _(r, dt):
    return (r.randn(16, 256, dtype=dt, scale=0.01), r.randn(256, dtype=dt)), {"eps": 1e-3}


@sample("rmsnorm_residual", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt), r.randn(16, 128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("rmsnorm_residual", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt), r.randn(2560, 128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("rmsnorm_residual", "3d_eps")
def _(r, dt):
    return (r.randn(2, 8, 128, dtype=dt), r.randn(2, 8, 128, dtype=dt), r.randn(128, dtype=dt), 1e-4), {}


@sample("layernorm", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt, scale=2.0) + 3.0, r.randn(128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("layernorm", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(128, dtype=dt)), {}


@sample("layernorm", "3d_eps")
def _(r, dt):
    return (r.randn(2, 8, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(128, dtype=dt)), {"eps": 1e-3}


@sample("layernorm", "weight_and_bias_of_other_ranks")
def _(r, dt):
    # weight [n] and bias [1, n]: each gradient has its input's shape.
    return (r.randn(6, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(1, 128, dtype=dt)), {}


@sample("rmsnorm_bwd", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(16, 128, dtype=dt)), {}


@sample("rmsnorm_bwd", "multi_block")
def _(r, dt):
    # The weight gradient accumulates across row blocks.
    return (r.randn(2560, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(2560, 128, dtype=dt)), {}


@sample("rmsnorm_bwd", "3d_eps")
def _(r, dt):
    return (r.randn(2, 8, 128, dtype=dt), r.randn(128, dtype=dt), r.randn(2, 8, 128, dtype=dt), 1e-3), {}


@sample("swiglu", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt, scale=3.0), r.randn(16, 128, dtype=dt)), {}


@sample("swiglu", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt, scale=3.0), r.randn(2560, 128, dtype=dt)), {}


@sample("swiglu", "3d")
def _(r, dt):
    return (r.randn(2, 8, 256, dtype=dt, scale=3.0), r.randn(2, 8, 256, dtype=dt)), {}


@sample("swiglu_bwd", "rows")
def _(r, dt):
    return (r.randn(16, 128, dtype=dt, scale=3.0), r.randn(16, 128, dtype=dt), r.randn(16, 128, dtype=dt)), {}


@sample("swiglu_bwd", "multi_block")
def _(r, dt):
    return (r.randn(2560, 128, dtype=dt, scale=3.0), r.randn(2560, 128, dtype=dt), r.randn(2560, 128, dtype=dt)), {}


@sample("rope", "rotate_half")
def _(r, dt):
    return (r.randn(16, 2, 64, dtype=dt), torch.arange(16, dtype=I32)), {}


@sample("rope", "interleaved_theta")
def _(r, dt):
    return (r.randn(8, 4, 128, dtype=dt), r.randint(0, 4096, 8)), {"theta": 500000.0, "interleaved": True}


@sample("rope", "multi_block")
def _(r, dt):
    # 2048-row blocks: a partial last one.
    return (r.randn(2100, 1, 128, dtype=dt), r.randint(0, 8192, 2100)), {}


@sample("rope", "int64_positions_strided_x")
def _(r, dt):
    x = r.randn(16, 4, 128, dtype=dt)[:, ::2]  # every other head: a strided view
    return (x, torch.arange(100, 116)), {}


@sample("rope_bwd", "rotate_half")
def _(r, dt):
    return (r.randn(16, 2, 64, dtype=dt), r.randint(0, 100, 16)), {}


@sample("rope_bwd", "interleaved")
def _(r, dt):
    return (r.randn(8, 4, 128, dtype=dt), r.randint(0, 4096, 8), 1000.0, True), {}


def _labels(r, t, vocab, ignored=()):
    labels = r.randint(0, vocab, t)
    labels[list(ignored)] = -100
    return labels


@sample("cross_entropy", "vocab_256")
def _(r, dt):
    return (r.randn(16, 256, dtype=dt, scale=3.0), _labels(r, 16, 256)), {}


@sample("cross_entropy", "tiled_ignore_index_int64")
def _(r, dt):
    # Tiles of 128 rows x 2048 vocab: partial last tiles both ways; ignored labels; int64 labels.
    return (r.randn(136, 2176, dtype=dt, scale=3.0), _labels(r, 136, 2176, ignored=(3, 17, 130)).long()), {}


@sample("cross_entropy_bwd", "vocab_256")
def _(r, dt):
    logits, labels = r.randn(16, 256, dtype=dt, scale=3.0), _labels(r, 16, 256, ignored=(5,))
    lse = torch.logsumexp(logits.double(), -1).float()
    return (logits, labels, lse, r.randn(16)), {}


@sample("cross_entropy_bwd", "tiled_lse_bf16")
def _(r, dt):
    logits, labels = r.randn(136, 2176, dtype=dt, scale=3.0), _labels(r, 136, 2176, ignored=(7,))
    lse = torch.logsumexp(logits.double(), -1).float()
    return (logits, labels, lse, r.randn(136)), {}


@sample("cross_entropy_with_grad", "tiled")
def _(r, dt):
    return (r.randn(136, 2176, dtype=dt, scale=3.0), _labels(r, 136, 2176)), {}


@sample("cross_entropy_with_grad", "vocab_256")
def _(r, dt):
    return (r.randn(16, 256, dtype=dt, scale=3.0), _labels(r, 16, 256, ignored=(0,))), {}


@sample("quantized_matmul", "per_channel")
def _(r, dt):
    return (r.randn(16, 256, dtype=dt), r.randint(-127, 128, 128, 256, dtype=I8), r.uniform(128, lo=0.001, hi=0.02)), {}


@sample("quantized_matmul", "multi_block")
def _(r, dt):
    # Two k steps (bk = 1024) and two n blocks: the scale applied once, at the last k step.
    return (r.randn(16, 2048, dtype=dt), r.randint(-127, 128, 1536, 2048, dtype=I8), r.uniform(1536, lo=0.001, hi=0.02)), {}


# 4-bit weights, quantized from float weights by tessera.quant4 (the packing a user makes).
@sample("matmul_int4", "group_128")
def _(r, dt):
    w, s = tessera.quant4.quantize_int4(r.randn(384, 1024, scale=0.05), group_size=128, scale_dtype=dt)
    return (r.randn(24, 1024, dtype=dt), w, s), {}


@sample("matmul_int4", "decode_group_32_odd_n")
def _(r, dt):
    w, s = tessera.quant4.quantize_int4(r.randn(200, 192, scale=0.05), group_size=32)
    return (r.randn(1, 192, dtype=dt), w, s), {}


@sample("matmul_int4", "group_256_two_groups")
def _(r, dt):
    # Groups longer than the kernel's usual 128-row K step (scale [2, n]).
    w, s = tessera.quant4.quantize_int4(r.randn(48, 512, scale=0.05), group_size=256, scale_dtype=dt)
    return (r.randn(6, 512, dtype=dt), w, s), {}


@sample("matmul_mxfp4", "two_k_steps")
def _(r, dt):
    w, s = tessera.quant4.quantize_mxfp4(r.randn(256, 2048, scale=0.05) * torch.logspace(-2, 2, 2048)[None, :])
    return (r.randn(20, 2048, dtype=dt), w, s), {}


@sample("matmul_mxfp4", "gpt_oss_blocks")
def _(r, dt):
    # A checkpoint's blocks/scales (HF gpt-oss layout), repacked; K = 2880 is not a multiple of 128.
    n, kb = 136, 90
    blocks = torch.randint(0, 256, (n, kb, 16), generator=r.g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (n, kb), generator=r.g, dtype=torch.uint8)
    w, s = tessera.quant4.from_mx_blocks(blocks, scales)
    return (r.randn(9, kb * 32, dtype=dt), w, s), {}


@sample("matmul_nvfp4", "rows_of_different_scale")
def _(r, dt):
    w, s, g = tessera.quant4.quantize_nvfp4(r.randn(300, 512) * torch.logspace(-3, 1, 300)[:, None])
    return (r.randn(33, 512, dtype=dt), w, s, g), {}


@sample("matmul_nvfp4", "decode")
def _(r, dt):
    w, s, g = tessera.quant4.quantize_nvfp4(r.randn(640, 1024, scale=0.02))
    return (r.randn(2, 1024, dtype=dt), w, s, g), {}


@sample("int_mm", "edges", dtypes=(F32,))
def _(r, dt):
    return (r.randint(-128, 128, 72, 200, dtype=I8), r.randint(-128, 128, 200, 40, dtype=I8)), {}


@sample("int_mm", "two_k_steps", dtypes=(F32,))
def _(r, dt):
    # Every product at its extreme (-128 * -128) in one column: 2^14 * 4096 = 2^26, exact.
    a, b = r.randint(-128, 128, 64, 4096, dtype=I8), r.randint(-128, 128, 4096, 256, dtype=I8)
    a[0], b[:, 0] = -128, -128
    return (a, b), {}


def _fp8(r, dt, *shape, mag=4.0):
    """fp8 data: e4m3fn in float32 samples, e5m2 in bfloat16 samples (both formats run)."""
    return r.uniform(*shape, lo=-mag, hi=mag).to(E4M3 if dt == F32 else E5M2)


def _scales(r, *shape):
    return r.uniform(*shape, lo=2**-8, hi=2**-4)


@sample("scaled_mm_blockwise", "edges")
def _(r, dt):
    # M and N not multiples of the 128 blocks; two K blocks.
    return (_fp8(r, dt, 72, 256), _fp8(r, dt, 256, 200), _scales(r, 72, 2), _scales(r, 2, 2)), {}


@sample("scaled_mm_blockwise", "dgrad")
def _(r, dt):
    # dA = dOut @ B^T: b [n, k] read in place, its tile scales [ceil(n/128), k/128].
    return (_fp8(r, dt, 40, 384), _fp8(r, dt, 136, 384), _scales(r, 40, 3), _scales(r, 2, 3)), {"transpose_rhs": True}


@sample("scaled_mm_blockwise_wgrad", "two_m_blocks")
def _(r, dt):
    return (_fp8(r, dt, 256, 72), _fp8(r, dt, 256, 136), _scales(r, 2, 72), _scales(r, 2, 136)), {}


@sample("quantize_fp8_1x128", "rows")
def _(r, dt):
    x = r.randn(40, 384, dtype=F32) * torch.logspace(-3, 3, 40, dtype=F32)[:, None]
    x[0, :128] = 0  # an all-zero block: scale 1e-12 / 448, q = 0
    return (x.to(dt),), {}


@sample("quantize_fp8_128x1", "columns")
def _(r, dt):
    return ((r.randn(256, 72, dtype=F32) * torch.logspace(-3, 3, 72, dtype=F32)).to(dt),), {}


GROUPS = [5, 0, 43, 16]  # an empty group and unaligned boundaries; 64 rows


@sample("gmm", "ragged_groups")
def _(r, dt):
    return (r.randn(64, 128, dtype=dt), r.randn(4, 128, 256, dtype=dt), torch.tensor(GROUPS, dtype=I32)), {}


@sample("gmm", "transpose_rhs")
def _(r, dt):
    return (r.randn(64, 128, dtype=dt), r.randn(4, 128, 128, dtype=dt), torch.tensor(GROUPS, dtype=I32), True), {}


@sample("gmm", "int64_sizes_empty_last")
def _(r, dt):
    return (r.randn(64, 128, dtype=dt), r.randn(3, 128, 128, dtype=dt), torch.tensor([40, 24, 0])), {}


@sample("gmm", "multi_tile")
def _(r, dt):
    # Row tiles of 512 (v6e): groups cross tile boundaries, a partial last tile.
    return (r.randn(524, 128, dtype=dt), r.randn(4, 128, 128, dtype=dt), torch.tensor([100, 0, 300, 124], dtype=I32)), {}


@sample("tgmm", "multi_tile")
def _(r, dt):
    return (r.randn(524, 128, dtype=dt), r.randn(524, 128, dtype=dt), torch.tensor([100, 0, 300, 124], dtype=I32)), {}


@sample("tgmm", "ragged_groups")
def _(r, dt):
    return (r.randn(64, 128, dtype=dt), r.randn(64, 256, dtype=dt), torch.tensor(GROUPS, dtype=I32)), {}


@sample("router_topk", "softmax_renorm")
def _(r, dt):
    return (r.randn(24, 8, dtype=dt, scale=2.0),), {}


@sample("router_topk", "sigmoid_k3")
def _(r, dt):
    return (r.randn(24, 16, dtype=dt, scale=2.0), 3, "sigmoid", False), {}


@sample("router_topk", "multi_block")
def _(r, dt):
    return (r.randn(300, 64, dtype=dt, scale=2.0), 8), {}


@sample("router_topk", "sigmoid_renorm_k1")
def _(r, dt):
    return (r.randn(16, 8, dtype=dt, scale=2.0), 1, "sigmoid"), {}


@sample("router_topk", "ties_softmax")
def _(r, dt):
    logits = r.randn(16, 8, dtype=dt, scale=2.0)
    logits[0] = 0.0  # all tied: experts 0, 1
    logits[1, 2:6] = 5.0  # four tied maxima: experts 2, 3
    return (logits, 2), {"normalize": False}


def _routing(r, t, experts, k, dt, skew=0.0):
    """Expert ids (and weights) from torch.ops.tpu.router_topk; `skew` leaves the last experts idle."""
    logits = r.randn(t, experts) - skew * torch.arange(experts, dtype=F32)
    return tpu.router_topk(logits.to(dt), k)


@sample("permute", "k2")
def _(r, dt):
    _, ids = _routing(r, 16, 8, 2, dt)
    return (r.randn(16, 128, dtype=dt), ids, 8), {}


@sample("permute", "k3_idle_experts")
def _(r, dt):
    _, ids = _routing(r, 24, 8, 3, dt, skew=3.0)
    return (r.randn(24, 128, dtype=dt), ids, 8), {}


@sample("permute", "multi_tile")
def _(r, dt):
    # One-hot tiles of 512 rows and tokens: 1040 rows from 520 tokens.
    _, ids = _routing(r, 520, 8, 2, dt)
    return (r.randn(520, 128, dtype=dt), ids, 8), {}


@sample("combine", "multi_tile")
def _(r, dt):
    w, ids = _routing(r, 520, 8, 2, dt)
    return (r.randn(1040, 128, dtype=dt), w, ids, 8), {}


@sample("combine", "k2")
def _(r, dt):
    w, ids = _routing(r, 16, 8, 2, dt)
    return (r.randn(32, 128, dtype=dt), w, ids, 8), {}


@sample("combine", "k3_idle_experts")
def _(r, dt):
    w, ids = _routing(r, 24, 8, 3, dt, skew=3.0)
    return (r.randn(72, 128, dtype=dt), w, ids, 8), {}


def _qkv(r, dt, b, h, hkv, sq, skv, d):
    return r.randn(b, h, sq, d, dtype=dt), r.randn(b, hkv, skv, d, dtype=dt), r.randn(b, hkv, skv, d, dtype=dt)


def _segments(b, n, cuts):
    ids = torch.zeros(b, n, dtype=I32)
    for c in cuts:
        ids[:, c:] += 1
    return ids


# Attention cases: (q, k, v, statics and segment ids). The kernels' blocks are up to 2 * MXU
# (512 on v6e) rows: the "long" cases take several q and kv blocks, with partial last blocks.
ATTENTION = {
    "causal_gqa": lambda r, dt: (*_qkv(r, dt, 1, 4, 2, 128, 128, 64), {"causal": True}),
    # Sq != Skv, explicit scale and a soft cap.
    "cross_scale_softcap": lambda r, dt: (*_qkv(r, dt, 2, 2, 1, 64, 200, 64), {"sm_scale": 0.3, "soft_cap": 2.5}),
    "causal_segments": lambda r, dt: (*_qkv(r, dt, 1, 2, 2, 128, 128, 64), {"causal": True, "q_segment_ids": _segments(1, 128, (50, 97)), "kv_segment_ids": _segments(1, 128, (50, 97))}),
    # Causal is top-left aligned (query i sees keys <= i), also when Sq != Skv, as SDPA's is_causal.
    "causal_sq_gt_skv": lambda r, dt: (*_qkv(r, dt, 1, 2, 2, 200, 64, 64), {"causal": True}),
    "long_causal_gqa": lambda r, dt: (*_qkv(r, dt, 1, 2, 1, 640, 640, 64), {"causal": True}),
    # Sliding windows: causal (HF's sliding_window 64), and left + right with segment ids.
    "causal_window": lambda r, dt: (*_qkv(r, dt, 1, 4, 1, 300, 300, 64), {"causal": True, "window_left": 63}),
    "window_left_right_segments": lambda r, dt: (
        *_qkv(r, dt, 1, 2, 2, 300, 300, 64),
        {"window_left": 40, "window_right": 7, "q_segment_ids": _segments(1, 300, (150,)), "kv_segment_ids": _segments(1, 300, (150,))},
    ),
    "long_kv_segments_softcap": lambda r, dt: (
        *_qkv(r, dt, 1, 2, 1, 64, 600, 128),
        {"sm_scale": 0.1, "soft_cap": 4.0, "q_segment_ids": _segments(1, 64, (40,)), "kv_segment_ids": _segments(1, 600, (300,))},
    ),
}


def _attention_sample(op, name, case):
    if op == "flash_attention_bwd":

        @sample(op, name)
        def _(r, dt):
            """o and lse of the float64 reference, a random do."""
            q, k, v, kw = case(r, dt)
            o, lse = ref_flash_attention_fwd(f64(q), f64(k), f64(v), **kw)
            return (q, k, v, o.to(dt), lse.float(), r.randn(*q.shape, dtype=dt)), kw

    else:

        @sample(op, name)
        def _(r, dt):
            q, k, v, kw = case(r, dt)
            return (q, k, v), kw


for _op in ("flash_attention_fwd", "flash_attention", "flash_attention_bwd"):
    for _name, _case in ATTENTION.items():
        _attention_sample(_op, _name, _case)


# Splash attention: masks built by tessera.splash (structured with segment ids, per head, a
# bool tensor) at blocks small enough for several per axis; the reference decodes the metadata
# itself. (tests/python/test_splash.py and tests/tests/splash.rs cover the mask families.)
def _splash_mask(mask, sq, skv, bq, bk, heads=None):
    m = tessera.splash.make_mask(mask, sq, skv, heads=heads, block_q=bq, block_kv=bk)
    return m.mask_blocks, m.fwd_info, m.bwd_info


SPLASH = {
    "local_segments_softcap": lambda r, dt: (
        *_qkv(r, dt, 1, 2, 2, 300, 300, 64),
        *_splash_mask(tessera.splash.local(40, 7), 300, 300, 64, 128),
        {"sm_scale": 0.2, "soft_cap": 3.0, "q_segment_ids": _segments(1, 300, (150,)), "kv_segment_ids": _segments(1, 300, (150,))},
    ),
    "per_head_chunked": lambda r, dt: (
        *_qkv(r, dt, 1, 4, 1, 256, 256, 64),
        *_splash_mask(tessera.splash.and_masks(tessera.splash.chunked(96), lambda b, h, q, kv: q - kv <= 30 + 40 * h), 256, 256, 32, 128, heads=4),
        {},
    ),
    "random_bool_cross": lambda r, dt: (*_qkv(r, dt, 2, 2, 1, 150, 260, 32), *_splash_mask(torch.rand(150, 260, generator=torch.Generator().manual_seed(5)) < 0.3, 150, 260, 32, 128), {}),
}


def _splash_sample(op, name, case):
    if op == "splash_attention_bwd":

        @sample(op, name)
        def _(r, dt):
            """o and lse of the float64 reference, a random do."""
            q, k, v, mb, fi, bi, kw = case(r, dt)
            o, lse = ref_splash_attention_fwd(f64(q), f64(k), f64(v), mb, fi, bi, **kw)
            return (q, k, v, o.to(dt), lse.float(), r.randn(*q.shape, dtype=dt), mb, fi, bi), kw

    else:

        @sample(op, name)
        def _(r, dt):
            q, k, v, mb, fi, bi, kw = case(r, dt)
            return (q, k, v, mb, fi, bi), kw


for _op in ("splash_attention_fwd", "splash_attention", "splash_attention_bwd"):
    for _name, _case in SPLASH.items():
        _splash_sample(_op, _name, _case)


def _pages(r, dt, hkv, num_pages, page_size, d):
    return r.randn(hkv, num_pages, page_size, d, dtype=dt), r.randn(hkv, num_pages, page_size, d, dtype=dt)


@sample("paged_attention", "gqa_default_blocks")
def _(r, dt):
    # Lengths: empty, one token, partial pages, the full table (4 pages of 16).
    k, v = _pages(r, dt, 2, 16, 16, 128)
    q = r.randn(4, 4, 128, dtype=dt, scale=128**-0.5)  # pre-scaled
    return (q, k, v, torch.tensor([0, 1, 37, 64], dtype=I32), r.randint(0, 16, 4, 4)), {}


@sample("paged_attention", "mha_one_page_blocks")
def _(r, dt):
    k, v = _pages(r, dt, 2, 8, 16, 128)
    q = r.randn(3, 2, 128, dtype=dt, scale=128**-0.5)
    return (q, k, v, torch.tensor([40, 5, 48], dtype=I32), r.randint(0, 8, 3, 3)), {"pages_per_compute_block": 1}


@sample("paged_attention", "multi_block_default")
def _(r, dt):
    # Default compute block: 2 * MXU tokens (32 pages of 16 on v6e): 40 pages take two.
    k, v = _pages(r, dt, 1, 64, 16, 128)
    q = r.randn(2, 2, 128, dtype=dt, scale=128**-0.5)
    return (q, k, v, torch.tensor([640, 300], dtype=I32), r.randint(0, 64, 2, 40)), {}


def _quantized_pages(r, cache, hkv, num_pages, page_size, d):
    """A K/V cache stored as `cache` (int8 codes in -127..127, fp8 of unit-range data)."""
    if cache == torch.int8:
        return [r.randint(-127, 128, hkv, num_pages, page_size, d, dtype=torch.int8) for _ in range(2)]
    return [r.uniform(hkv, num_pages, page_size, d).to(cache) for _ in range(2)]


@sample("paged_attention", "int8_per_token_scales")
def _(r, dt):
    # An int8 cache with a scale per cached token and kv head (and per-tensor scales on top).
    k, v = _quantized_pages(r, torch.int8, 2, 16, 16, 128)
    q = r.randn(4, 8, 128, dtype=dt, scale=128**-0.5)
    ks, vs = (r.uniform(2, 16, 16, lo=0.5 / 127, hi=1.5 / 127) for _ in range(2))
    return (q, k, v, torch.tensor([0, 1, 37, 64], dtype=I32), r.randint(0, 16, 4, 4)), {"k_scale": 0.5, "v_scale": 2.0, "k_token_scales": ks, "v_token_scales": vs, "pages_per_compute_block": 2}


@sample("paged_attention", "fp8_e4m3fn_per_tensor_scales")
def _(r, dt):
    k, v = _quantized_pages(r, torch.float8_e4m3fn, 1, 12, 16, 128)
    q = r.randn(3, 4, 128, dtype=dt, scale=128**-0.5)
    return (q, k, v, torch.tensor([47, 5, 0], dtype=I32), r.randint(0, 12, 3, 3)), {"k_scale": 0.25, "v_scale": 3.0}


@sample("paged_attention", "fp8_e5m2_per_token_scales")
def _(r, dt):
    k, v = _quantized_pages(r, torch.float8_e5m2, 4, 10, 8, 64)
    q = r.randn(2, 8, 64, dtype=dt, scale=64**-0.5)
    ks, vs = (r.uniform(4, 10, 8, lo=0.5, hi=2.0) for _ in range(2))
    return (q, k, v, torch.tensor([21, 40], dtype=I32), r.randint(0, 10, 2, 5)), {"k_token_scales": ks, "v_token_scales": vs}


def _ragged_metadata(seqs, pages_per_seq, num_pages, r, garbage=0):
    """(kv_lens, page_indices, cu_q_lens, num_seqs) for [(q_len, kv_len)], plus `garbage`
    sequences past num_seqs whose metadata is invalid (and must be ignored)."""
    kv_lens = [kv for _, kv in seqs] + [pages_per_seq * 16 + 7] * garbage
    cu = [0]
    for q_len, kv in seqs:
        assert q_len <= kv <= pages_per_seq * 16
        cu.append(cu[-1] + q_len)
    cu += [cu[-1] + 1000] * garbage
    s = len(seqs) + garbage
    return (torch.tensor(kv_lens, dtype=I32), r.randint(0, num_pages, s, pages_per_seq), torch.tensor(cu, dtype=I32), torch.tensor([len(seqs)], dtype=I32)), cu[len(seqs)]


@sample("ragged_paged_attention", "mixed_batch")
def _(r, dt):
    # Empty sequence, decode, decode with no query scheduled, prefill, chunked prefill;
    # padding tokens at the end; one garbage sequence past num_seqs.
    seqs = [(0, 0), (1, 20), (0, 33), (17, 17), (12, 50)]
    meta, used = _ragged_metadata(seqs, 4, 16, r, garbage=1)
    k, v = _pages(r, dt, 2, 16, 16, 128)
    q = r.randn(used + 6, 4, 128, dtype=dt)
    return (q, k, v, *meta), {"sm_scale": 128**-0.5}


@sample("ragged_paged_attention", "window_softcap_blocks")
def _(r, dt):
    seqs = [(3, 64), (1, 9), (20, 20), (8, 41)]
    meta, used = _ragged_metadata(seqs, 4, 12, r)
    k, v = _pages(r, dt, 1, 12, 16, 128)
    q = r.randn(used, 2, 128, dtype=dt)
    return (q, k, v, *meta, 0.1, 24, 3.0, 16, 1), {}


OPS = sorted(tessera.ops())


def _table_sample(op, case):
    """A sample from op `op`'s table case (its own input generator), in schema order."""
    from tessera._ops import SPECS

    spec = SPECS[op]

    def builder(r, dt):
        seed = int(r.randint(0, 2**31 - 1, 1)[0])
        tensors, statics = tessera._native.sample(op, case, str(dt).removeprefix("torch."), seed)
        tensors, statics = iter(tensors), iter(statics)
        args = [next(tensors, None) if i in spec.tensor_idx else next(statics) for i in range(len(spec.arg_names))]
        return tuple(args), {}

    return builder


# Ops added through the table alone get samples from their smallest case and the table's
# independent f64 reference: every op is covered without editing this file.
for _op in OPS:
    if _op not in SAMPLES:
        _cases = tessera._native.op_cases(_op)
        _case = min(_cases, key=lambda c: sum(math.prod(s) for s in c[2]))[0]
        SAMPLES[_op] = [(f"table_{_case}", FLOATS, _table_sample(_op, _case))]
        TABLE_SAMPLES[(_op, f"table_{_case}")] = _case


def reference(op, name, args, kwargs):
    """The sample's float64 reference outputs: the torch reference written here, or for a
    table sample the op table's f64 reference."""
    case = TABLE_SAMPLES.get((op, name))
    if case is None:
        return as_tuple(REFERENCES[op](*map(f64, args), **kwargs))
    tensors = [a for a in args if isinstance(a, torch.Tensor) or a is None]
    from tessera._ops import SPECS

    tensors = [args[i] for i in SPECS[op].tensor_idx]
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.float64).reshape(shape) for b, shape in tessera._native.reference(op, case, [t.detach() if t is not None else None for t in tensors]))


def is_large(name):
    """Samples big enough for several blocks of the kernels' tiling (multi-block accumulators,
    online softmax across kv blocks, partial edge blocks, groups across row tiles)."""
    return name.startswith(("multi_", "long_", "tiled"))


def cases(dtypes=FLOATS, ops=None, large=None):
    """pytest params (op, sample, dtype); `large`: only large (True) or small (False) samples."""
    return [
        pytest.param(op, name, dt, id=f"{op}-{name}-{str(dt).removeprefix('torch.')}")
        for op in (OPS if ops is None else ops)
        for name, dts, _ in SAMPLES.get(op, ())
        for dt in dts
        if dt in dtypes and large in (None, is_large(name))
    ]


def build(op, name, dtype, requires_grad=False):
    """The sample's (args, kwargs), float inputs of differentiable ops requiring grad."""
    index = [n for n, _, _ in SAMPLES[op]].index(name)
    builder = SAMPLES[op][index][2]
    seed = sum(map(ord, f"{op}/{name}"))
    args, kwargs = builder(Rng(seed), dtype)
    if requires_grad:
        diff = set(DIFF_ARGS.get(op, ()))
        args = tuple(a.detach().requires_grad_() if i in diff else a for i, a in enumerate(args))
    return args, kwargs


# ---- every op is covered -----------------------------------------------------------------------


def test_every_op_has_samples_and_a_reference():
    ops = set(tessera.ops())
    assert "flash_attention" in ops
    assert not ops - set(SAMPLES), f"ops without samples: {sorted(ops - set(SAMPLES))}"
    hand = {op for op, samples in SAMPLES.items() if any((op, n) not in TABLE_SAMPLES for n, _, _ in samples)}
    assert not hand - set(REFERENCES), f"hand-written samples without a reference: {sorted(hand - set(REFERENCES))}"
    assert not set(SAMPLES) - ops, f"samples of unknown ops: {sorted(set(SAMPLES) - ops)}"


def test_differentiable_ops_are_the_ones_with_autograd():
    """Every op with a declared backward gets an autograd kernel; the others raise on backprop
    (test_ops_without_backward_refuse_to_backprop); the differentiable arguments name inputs."""
    from tessera._ops import SPECS

    assert {"matmul", "rmsnorm", "flash_attention", "flash_attention_fwd", "gmm", "router_topk", "combine"} <= set(DIFF_ARGS)
    for op, idx in DIFF_ARGS.items():
        assert idx and all(i in SPECS[op].tensor_idx for i in idx), f"{op}: gradients for {idx}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(SPECS[op].qualname, "Autograd") or SPECS[op].alias_of, op


# ---- opcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("op,name,dtype", cases(large=False))
def test_opcheck(op, name, dtype):
    args, kwargs = build(op, name, dtype, requires_grad=op in DIFF_ARGS)
    fp8 = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2)]
    if not fp8:
        torch.library.opcheck(getattr(tpu, op).default, args, kwargs)
        return
    # torch's SchemaCheckMode (opcheck's test_schema) multiplies inputs to detect mutation,
    # which fp8 CPU tensors do not support: check the rest, and non-mutation by the bytes.
    before = [a.view(torch.uint8).clone() for a in fp8]
    torch.library.opcheck(getattr(tpu, op).default, args, kwargs, test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    getattr(tpu, op)(*args, **kwargs)
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8, before)), f"{op} mutated an fp8 input"


# ---- numerics ------------------------------------------------------------------------------------


# Outputs that are float32 whatever the input dtype (the others have the float inputs' dtype).
F32_OUTPUTS = {"cross_entropy": (0, 1), "cross_entropy_with_grad": (0,), "flash_attention_fwd": (1,), "splash_attention_fwd": (1,)}
# Outputs whose dtype is the op's own, whatever the inputs' (the blockwise fp8 recipe).
FIXED_OUTPUTS = {"int_mm": (I32,), "scaled_mm_blockwise": (BF16,), "scaled_mm_blockwise_wgrad": (BF16,), "quantize_fp8_1x128": (E4M3, F32), "quantize_fp8_128x1": (E4M3, F32)}


@functools.cache
def sample_and_reference(op, name, dtype):
    """The sample's (args, kwargs) and its float64 reference outputs, built once (read-only)."""
    args, kwargs = build(op, name, dtype)
    return args, kwargs, reference(op, name, args, kwargs)


@pytest.mark.parametrize("op,name,dtype", cases())
def test_numerics(op, name, dtype):
    args, kwargs, ref = sample_and_reference(op, name, dtype)
    got = as_tuple(getattr(tpu, op)(*args, **kwargs))
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        want = FIXED_OUTPUTS[op][i] if op in FIXED_OUTPUTS else F32 if i in F32_OUTPUTS.get(op, ()) else dtype if r.is_floating_point() else r.dtype
        assert g.dtype == want, f"{op} output {i}: dtype {g.dtype}, expected {want}"
        assert_close(g, r, f"{op} output {i}")


@pytest.fixture
def target():
    """Restores the default TPU target after a test that changes it."""
    before = tessera.get_target()
    yield
    tessera.set_target(before)


@pytest.mark.parametrize("name", ["v5e", "v5p", "tpu7x"])
def test_numerics_on_other_targets(name, target):
    """Blocks depend on the target (MXU size, bf16 tiling, VMEM): every sample on each other one."""
    tessera.set_target(name)
    for op, sample_name, dtype in (p.values for p in cases()):
        args, kwargs, ref = sample_and_reference(op, sample_name, dtype)
        got = as_tuple(getattr(tpu, op)(*args, **kwargs))
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, f"{name}: {op}/{sample_name}/{dtype} output {i}")


def test_plan_cache_gives_the_same_results():
    """The same op with two shapes, twice each: cached plans give the same results."""
    r = Rng(1)
    x1, x2, w = r.randn(16, 128), r.randn(24, 128), r.randn(128)
    first = [tpu.rmsnorm(x1, w), tpu.rmsnorm(x2, w)]
    second = [tpu.rmsnorm(x1, w), tpu.rmsnorm(x2, w)]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---- gradients -----------------------------------------------------------------------------------


GRAD_CASES = [pytest.param(*p.values, False, id=p.id) for p in cases(ops=sorted(DIFF_ARGS), large=False)]
GRAD_CASES += [pytest.param(*p.values, False, id=p.id) for p in cases((F32,), sorted(DIFF_ARGS), large=True)]
GRAD_CASES += [pytest.param(*p.values, True, id=p.id + "-expanded") for p in cases((F32,), sorted(DIFF_ARGS), large=False)]


@pytest.mark.parametrize("op,name,dtype,expanded", GRAD_CASES)
def test_gradients(op, name, dtype, expanded):
    """`expanded`: cotangents broadcast from their last dim (stride 0, as `.sum()` gives)."""
    args, kwargs = build(op, name, dtype, requires_grad=True)
    diff = DIFF_ARGS[op]
    outs = as_tuple(getattr(tpu, op)(*args, **kwargs))
    out_idx = diff_outs(op, kwargs) or range(len(outs))
    r = Rng(99)
    if expanded:
        cotangents = [r.randn(outs[i].shape[-1], dtype=torch.float64).expand(outs[i].shape) for i in out_idx]
    else:
        cotangents = [r.randn(*outs[i].shape, dtype=torch.float64) for i in out_idx]
    grads = torch.autograd.grad([outs[i] for i in out_idx], [args[i] for i in diff], [c.to(outs[i].dtype) for c, i in zip(cotangents, out_idx)])

    if op not in REFERENCES:
        # A table-only op: autograd must give what its declared backward op gives called
        # directly (that op's numerics are checked against its own table reference).
        for i, g, want in zip(diff, grads, declared_backward(op, args, kwargs, outs, {i: c.to(outs[i].dtype) for c, i in zip(cotangents, out_idx)})):
            assert g.dtype == args[i].dtype
            assert_close(g, want, f"{op}: gradient of input {i} vs its backward op", tol=0.0)
        return

    ref_args = list(map(f64, args))
    full = [None] * len(outs)
    for c, i in zip(cotangents, out_idx):
        full[i] = c

    def f(*leaves):
        a = list(ref_args)
        for i, leaf in zip(diff, leaves):
            a[i] = leaf
        return REFERENCES[op](*a, **kwargs)

    ref_grads = vjp(f, [ref_args[i] for i in diff], full)
    for i, g, rg in zip(diff, grads, ref_grads):
        assert g.dtype == args[i].dtype
        assert_close(g, rg, f"{op}: gradient of input {i}")


def declared_backward(op, args, kwargs, outs, cotangents):
    """The gradients of op's differentiable inputs from its declared backward op called
    directly, for output cotangents `{output index: tensor}` (zeros elsewhere)."""
    from tessera._ops import SPECS

    spec = SPECS[op]
    bwd_op, bwd_args, grads = spec.backward
    full = list(args) + [kwargs.get(n, spec.defaults[i]) for i, n in enumerate(spec.arg_names) if i >= len(args)]
    env = dict(zip(spec.arg_names, [a.detach() if isinstance(a, torch.Tensor) else a for a in full]))
    for i, (name, _, _) in enumerate(spec.outputs):
        env[name] = outs[i].detach()
        env["d_" + name] = cotangents.get(i, torch.zeros_like(outs[i]))
    results = as_tuple(getattr(tpu, bwd_op)(*[env[a] for a in bwd_args]))
    by_input = {}
    for result, targets in zip(results, grads):
        for name in targets:
            by_input[spec.arg_names.index(name)] = result
    return [by_input[i] for i in DIFF_ARGS[op]]


def check_lse_gradients(device, compiled):
    """A gradient into lse (a z-loss on cross-entropy's, merging partial attentions on flash
    attention's) reaches the inputs as torch's logsumexp gives it (f64 references)."""
    torch.manual_seed(0)
    x = torch.randn(6, 300)
    labels = torch.tensor([1, 2, -100, 4, 299, 0], dtype=I32)

    def ce(logits):
        loss, lse = tpu.cross_entropy(logits.to(device), labels.to(device))
        return (loss + 0.1 * lse ** 2).sum()

    xr = x.double().requires_grad_()
    want_ce = torch.autograd.grad((F.cross_entropy(xr, labels.long(), reduction="none") + 0.1 * torch.logsumexp(xr, -1) ** 2).sum(), xr)[0]
    q = torch.randn(1, 4, 40, 16)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)

    def attn(q, k, v):
        o, lse = tpu.flash_attention_fwd(q.to(device), k.to(device), v.to(device), causal=True, window_left=7)
        return (o * o).sum() + (lse * torch.arange(40, dtype=torch.float32, device=device)).sum()

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    s = qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) / 4
    rows, cols = torch.arange(40).unsqueeze(1), torch.arange(40)
    s = s.masked_fill(~((cols <= rows) & (rows - cols <= 7)), float("-inf"))
    o_ref = torch.softmax(s, -1) @ vr.repeat_interleave(2, 1)
    want_attn = torch.autograd.grad((o_ref * o_ref).sum() + (torch.logsumexp(s, -1) * torch.arange(40)).sum(), (qr, kr, vr))
    f, g = (torch.compile(ce, backend="aot_eager"), torch.compile(attn, backend="aot_eager")) if compiled else (ce, attn)
    xa = x.clone().requires_grad_()
    got = torch.autograd.grad(f(xa), xa)[0]
    torch.testing.assert_close(got.double(), want_ce, rtol=1e-5, atol=1e-6, msg="cross_entropy")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for got, want in zip(torch.autograd.grad(g(*leaves), leaves), want_attn):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg="flash attention")
    # With a soft cap (a torch composite): s = cap * tanh(raw / cap).
    qr = q.double().requires_grad_()
    s = 3.0 * torch.tanh(qr @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4 / 3.0)
    want = torch.autograd.grad((torch.logsumexp(s, -1) * torch.arange(40)).sum(), qr)[0]
    qc = q.clone().requires_grad_()
    o, lse = tpu.flash_attention_fwd(qc.to(device), k.to(device), v.to(device), soft_cap=3.0)
    got = torch.autograd.grad((lse * torch.arange(40, dtype=torch.float32, device=device)).sum(), qc)[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg="flash attention, soft cap")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lse_gradients(compiled, fresh_dynamo):
    check_lse_gradients("cpu", compiled)


def test_flash_attention_runs_its_own_kernel_when_no_gradient_is_needed():
    """`flash_attention` without a gradient to compute (no_grad, inference_mode, inputs that
    need none) runs its own plan, whose kernel writes no lse; with one it runs
    flash_attention_fwd, whose autograd saves lse for the backward. Seen below autograd by a
    dispatch mode; o is the same either way and the gradients are math attention's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "tpu":
                self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    r = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 200, 64, generator=r), torch.randn(2, 2, 333, 64, generator=r), torch.randn(2, 2, 333, 64, generator=r))
    want = tpu.flash_attention_fwd(q, k, v, True)[0]
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context(), Seen() as seen:
            o = tpu.flash_attention(q, k, v, True)
        assert seen.ops == ["flash_attention"], (context.__name__, seen.ops)
        assert torch.equal(o, want), context.__name__
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with Seen() as seen:
        o = tpu.flash_attention(qg, kg, vg, True)
    assert seen.ops == ["flash_attention_fwd"], seen.ops
    assert torch.equal(o.detach(), want)
    o.backward(torch.ones_like(o))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1), is_causal=True).backward(torch.ones_like(o))
    for got, ref in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(got.grad, ref.grad, atol=1e-4, rtol=1e-4)


# int_mm takes no float tensor (nothing can require grad), so it has no backprop to refuse.
NO_BACKWARD = [op for op in OPS if op not in DIFF_ARGS and op != "int_mm"]


@pytest.mark.parametrize("op", NO_BACKWARD)
def test_ops_without_backward_refuse_to_backprop(op):
    """Backprop through an op with no backward is an error naming it, not a silent None gradient."""
    args, kwargs = build(op, SAMPLES[op][0][0], F32)
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    outs = [o for o in as_tuple(getattr(tpu, op)(*args, **kwargs)) if o.requires_grad]
    assert outs, f"{op}: no output requires grad"
    with pytest.raises(RuntimeError, match=f"torch.ops.tpu.{op} has no backward"):
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# ---- torch.compile and torch.export ---------------------------------------------------------------

T, D, H, HKV, DH, VOCAB = 128, 128, 2, 1, 64, 256


def transformer_block(x, norm, wq, wk, wv, wg, wu, wout, positions, labels):
    """rmsnorm -> q/k/v matmuls -> rope -> causal GQA flash attention -> rmsnorm_residual -> swiglu -> CE.

    Returns (loss [T], residual [T, D]); the few stock ops are views, so the graph is mostly
    tpu ops (each inductor kernel is a C++ compile: this keeps a cold compile cheap)."""
    h = tpu.rmsnorm(x, norm)
    q = tpu.rope(tpu.matmul(h, wq).view(T, H, DH), positions)
    k = tpu.rope(tpu.matmul(h, wk).view(T, HKV, DH), positions, 10000.0)
    v = tpu.matmul(h, wv).view(T, HKV, DH)
    bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  [T, heads, DH] -> [1, heads, T, DH] (a view)
    a = tpu.flash_attention(bhsd(q), bhsd(k), bhsd(v), causal=True).squeeze(0).transpose(0, 1).reshape(T, D)
    y, residual = tpu.rmsnorm_residual(a, x, norm)
    g = tpu.swiglu(tpu.matmul(y, wg), tpu.matmul(y, wu))
    loss, lse = tpu.cross_entropy(tpu.matmul(g, wout), labels)
    return loss, residual


def block_inputs(r):
    params = {
        "x": r.randn(T, D),
        "norm": 1.0 + 0.1 * r.randn(D),
        "wq": r.randn(D, H * DH, scale=D**-0.5),
        "wk": r.randn(D, HKV * DH, scale=D**-0.5),
        "wv": r.randn(D, HKV * DH, scale=D**-0.5),
        "wg": r.randn(D, 256, scale=D**-0.5),
        "wu": r.randn(D, 256, scale=D**-0.5),
        "wout": r.randn(256, VOCAB, scale=256**-0.5),
    }
    return params, {"positions": torch.arange(T, dtype=I32), "labels": r.randint(0, VOCAB, T)}


def run_with_grads(fn, params, others, cotangents):
    """fn's outputs and the gradients of every param for the given output cotangents."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    outs = as_tuple(fn(**leaves, **others))
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs], {k: v.grad for k, v in leaves.items()}


def assert_same_run(got, want, what):
    (outs, grads), (outs_e, grads_e) = got, want
    for i, (o, oe) in enumerate(zip(outs, outs_e)):
        assert_close(o, oe, f"{what}: output {i}", tol=1e-6)
    for name in grads_e:
        assert grads[name] is not None, f"{what}: no gradient for {name}"
        assert_close(grads[name], grads_e[name], f"{what}: gradient of {name}", tol=1e-5)


def test_compile_inductor_fullgraph_forward_and_backward(fresh_dynamo):
    r = Rng(7)
    params, others = block_inputs(r)
    cotangents = [r.randn(T), r.randn(T, D)]
    eager = run_with_grads(transformer_block, params, others, cotangents)
    compiled = torch.compile(transformer_block, backend="inductor", fullgraph=True)
    assert_same_run(run_with_grads(compiled, params, others, cotangents), eager, "inductor")


def every_sample_once():
    """(op, sample, dtype) for every small sample of every op, in the sample's first dtype."""
    return [
        pytest.param(op, name, dts[0], id=f"{op}-{name}-{str(dts[0]).removeprefix('torch.')}")
        for op in OPS
        for name, dts, _ in SAMPLES.get(op, ())
        if not is_large(name)
    ]


@pytest.mark.parametrize("op,name,dtype", every_sample_once())
def test_compile_fullgraph_every_op(op, name, dtype, fresh_dynamo):
    """Every op, the fp8, quantized-cache and windowed ones included, traces into one graph
    under torch.compile(fullgraph=True): dynamo through the call (lists, optionals, floats
    as the schema has them), AOTAutograd on the op's fake, no graph break; and the compiled
    call gives eager's results bit for bit (the same kernels run)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    args, kwargs = build(op, name, dtype)
    fn = getattr(tpu, op)
    eager = fn(*args, **kwargs)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(lambda *a, **k: fn(*a, **k), backend=counter, fullgraph=True)(*args, **kwargs)
    assert counter.frame_count == 1, f"{op}: {counter.frame_count} graphs"
    flat = lambda r: list(r) if isinstance(r, (tuple, list)) else [r]  # noqa: E731
    for i, (a, b) in enumerate(zip(flat(got), flat(eager), strict=True)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{op} result {i}"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype in (E4M3, E5M2) else torch.equal(a, b), f"{op} result {i} differs from eager"


def moe_layer(x, norm, router_w, w_gate, w_up, w_down, labels):
    """rmsnorm -> router_topk -> permute -> gmm (gate, up) -> swiglu -> gmm (down, transposed) -> combine -> CE."""
    experts = w_up.shape[0]
    h = tpu.rmsnorm(x, norm)
    weights, ids = tpu.router_topk(tpu.matmul(h, router_w), 2)
    xs, sizes = tpu.permute(h, ids, experts)
    act = tpu.swiglu(tpu.gmm(xs, w_gate, sizes), tpu.gmm(xs, w_up, sizes))
    out = tpu.combine(tpu.gmm(act, w_down, sizes, True), weights, ids, experts)
    return tpu.cross_entropy(out, labels)[0]


def test_compile_dynamic_shapes(fresh_dynamo):
    """One dynamic compile serves several token counts: every fake runs on symbolic shapes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe_layer, backend=counter, fullgraph=True, dynamic=True)
    r = Rng(11)
    experts, d, f = 4, 128, 128
    params = {
        "norm": 1.0 + 0.1 * r.randn(d),
        "router_w": r.randn(d, experts),
        "w_gate": r.randn(experts, d, f, scale=d**-0.5),
        "w_up": r.randn(experts, d, f, scale=d**-0.5),
        "w_down": r.randn(experts, d, f, scale=f**-0.5),
    }
    for t in (16, 24, 40):
        inputs = {"x": r.randn(t, d), **params}
        others, cotangents = {"labels": r.randint(0, d, t)}, [r.randn(t)]
        eager = run_with_grads(moe_layer, inputs, others, cotangents)
        assert_same_run(run_with_grads(compiled, inputs, others, cotangents), eager, f"dynamic, {t} tokens")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for 3 token counts"


class SmallModel(torch.nn.Module):
    def __init__(self, r):
        super().__init__()
        self.norm = torch.nn.Parameter(1.0 + 0.1 * r.randn(D))
        self.wqkv = torch.nn.Parameter(r.randn(D, 3 * D, scale=D**-0.5))
        self.wg = torch.nn.Parameter(r.randn(D, 256, scale=D**-0.5))
        self.wu = torch.nn.Parameter(r.randn(D, 256, scale=D**-0.5))

    def forward(self, x):
        t = x.shape[0]
        h = tpu.rmsnorm(x, self.norm)
        q, k, v = tpu.matmul(h, self.wqkv).view(t, 3, H, DH).permute(1, 2, 0, 3).unsqueeze(1).unbind(0)  # [1, H, t, DH]
        a = tpu.flash_attention(q, k, v, True).squeeze(0).permute(1, 0, 2).reshape(t, D)
        return tpu.swiglu(tpu.matmul(a, self.wg), tpu.matmul(a, self.wu))


def test_export():
    model = SmallModel(Rng(5))
    x = Rng(6).randn(T, D)
    ep = torch.export.export(model, (x,))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for op in ("rmsnorm", "matmul", "swiglu"):
        assert getattr(tpu, op).default in targets, f"tpu.{op} not in the exported graph"
    assert tpu.flash_attention.default in targets or tpu.flash_attention_fwd.default in targets
    with torch.no_grad():
        assert_close(ep.module()(x), model(x), "exported module", tol=1e-6)


def test_export_dynamic_tokens():
    model = SmallModel(Rng(5))
    tokens = torch.export.Dim("tokens", min=16, max=1024)
    ep = torch.export.export(model, (Rng(6).randn(T, D),), dynamic_shapes=({0: tokens},))
    x = Rng(8).randn(64, D)
    with torch.no_grad():
        assert_close(ep.module()(x), model(x), "exported module, 64 tokens", tol=1e-6)


# ---- errors ---------------------------------------------------------------------------------------

i32 = lambda *v: torch.tensor(v, dtype=I32)  # noqa: E731

ERRORS = {
    "matmul_k": (lambda: tpu.matmul(torch.randn(8, 64), torch.randn(32, 16)), ["matmul", "`y`", "operand-shape", "[64, n]"]),
    "gmm_group_sum": (lambda: tpu.gmm(torch.randn(16, 128), torch.randn(2, 128, 128), i32(3, 4)), ["gmm", "group_sizes", "group-sizes", "16 rows"]),
    "gmm_rhs": (lambda: tpu.gmm(torch.randn(16, 128), torch.randn(2, 64, 128), i32(8, 8)), ["gmm", "`rhs`", "operand-shape"]),
    "tgmm_rows": (lambda: tpu.tgmm(torch.randn(16, 128), torch.randn(8, 128), i32(8, 8)), ["tgmm", "`grad`", "operand-shape"]),
    "rmsnorm_weight": (lambda: tpu.rmsnorm(torch.randn(8, 128), torch.randn(64)), ["rmsnorm", "`weight`", "operand-shape", "[128]"]),
    "layernorm_bias": (lambda: tpu.layernorm(torch.randn(8, 128), torch.randn(128), torch.randn(64)), ["layernorm", "`bias`", "operand-shape"]),
    "rope_positions": (lambda: tpu.rope(torch.randn(8, 2, 64), torch.arange(9, dtype=I32)), ["rope", "position_ids", "operand-shape", "[8]"]),
    "cross_entropy_labels": (lambda: tpu.cross_entropy(torch.randn(8, 128), torch.zeros(7, dtype=I32)), ["cross_entropy", "`labels`", "operand-shape"]),
    "quantized_matmul_scale": (lambda: tpu.quantized_matmul(torch.randn(8, 128), torch.zeros(64, 128, dtype=I8), torch.ones(32)), ["quantized_matmul", "`scale`", "operand-shape"]),
    "router_gate": (lambda: tpu.router_topk(torch.randn(8, 8), 2, "relu"), ["router_topk", "`gate`", "option-value"]),
    "router_k": (lambda: tpu.router_topk(torch.randn(8, 16), 9), ["router_topk", "`k`", "top-k"]),
    "combine_weights": (lambda: tpu.combine(torch.randn(16, 128), torch.randn(8, 3), torch.zeros(8, 2, dtype=I32), 4), ["combine", "weights", "operand-shape"]),
    "permute_expert_range": (lambda: tpu.permute(torch.randn(2, 128), i32([0, 9], [1, 2]), 8), ["permute", "expert_ids", "expert-id-range"]),
    "combine_expert_range": (lambda: tpu.combine(torch.randn(4, 128), torch.ones(2, 2), i32([0, 1], [7, 2]), 4), ["combine", "expert_ids", "expert-id-range"]),
    "flash_rank": (lambda: tpu.flash_attention(*[torch.randn(2, 128, 64)] * 3), ["flash_attention", "`q`", "operand-rank"]),
    "flash_heads": (lambda: tpu.flash_attention(torch.randn(1, 3, 128, 64), torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)), ["flash_attention", "`k`", "operand-shape", "multiple"]),
    "flash_one_segment": (lambda: tpu.flash_attention(*[torch.randn(1, 2, 128, 64)] * 3, q_segment_ids=torch.zeros(1, 128, dtype=I32)), ["flash_attention", "q_segment_ids", "segment-ids"]),
    "paged_heads": (lambda: tpu.paged_attention(torch.randn(2, 3, 128), torch.randn(2, 8, 16, 128), torch.randn(2, 8, 16, 128), torch.ones(2, dtype=I32), torch.zeros(2, 2, dtype=I32)), ["paged_attention", "operand-shape", "multiple of Hkv"]),
    "ragged_window": (lambda: tpu.ragged_paged_attention(torch.randn(16, 2, 128), *[torch.randn(2, 8, 16, 128)] * 2, torch.ones(2, dtype=I32), torch.zeros(2, 2, dtype=I32), i32(0, 1, 2), i32(2), 1.0, 0), ["ragged_paged_attention", "sliding_window", "option-value"]),
    "matmul_float64": (lambda: tpu.matmul(torch.randn(8, 64, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)), ["matmul", "`x`", "float64"]),
    "matmul_block_n": (lambda: tpu.matmul(torch.randn(100, 256), torch.randn(256, 100), block_n=1), ["kernel `matmul`", "argument `block_n`", "block-tiling", "use 100 or 128"]),
    "matmul_block_m_huge": (lambda: tpu.matmul(torch.randn(100, 256), torch.randn(256, 100), block_m=1 << 20), ["kernel `matmul`", "argument `block_m`", "block-shape", "up to 104, or 100"]),
    "gmm_tiling": (lambda: tpu.gmm(torch.randn(20, 16), torch.randn(3, 16, 200), i32(5, 10, 5), tiling=[8, 16, 8]), ["kernel `gmm`", "argument `tiling`", "block-tiling", "tn = 8", "multiple of 128, or 200"]),
    "paged_k_scale_nan": (lambda: tpu.paged_attention(torch.randn(2, 4, 64), *[torch.ones(2, 4, 16, 64, dtype=I8)] * 2, i32(5, 3), i32([0, 1], [2, 3]), k_scale=math.nan), ["paged_attention", "argument `k_scale`", "option-value", "finite k_scale"]),
    "ragged_v_scale_inf": (lambda: tpu.ragged_paged_attention(torch.randn(8, 4, 64), *[torch.ones(2, 4, 16, 64, dtype=I8)] * 2, i32(5, 3), i32([0, 1], [2, 3]), i32(0, 5, 8), i32(2), v_scale=-math.inf), ["ragged_paged_attention", "argument `v_scale`", "option-value", "finite v_scale"]),
}




@pytest.mark.parametrize("case", list(ERRORS))
def test_clear_errors(case):
    call, needles = ERRORS[case]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    missing = [n for n in needles if n not in message]
    assert not missing, f"the error does not name {missing}:\n{message}"
