"""`torch.compile(model, backend="tessera")`: AOTAutograd's forward and backward aten graphs
run under DEFER_AND_FUSE, so their fusible runs become generated Tessera kernels (partitioned
by the fusion planner, cached by structure) and every other op stays aten.

Before that, library patterns in the graphs become library ops: scaled-dot-product attention
(`F.scaled_dot_product_attention` without a mask or dropout, causal or not, any scale; aten's
`_scaled_dot_product_flash_attention_for_cpu` and its backward in the graphs AOTAutograd
traces) becomes `tpu.flash_attention_fwd` / `tpu.flash_attention_bwd`. Both are the same
logsumexp-saving flash attention, so the forward's saved `lse` is what the backward reads.
A forward whose logsumexp nothing reads (an inference graph) becomes `tpu.flash_attention`,
whose kernel writes no `lse`.
A masked or dropout SDPA, or one on another dtype or rank, stays aten.

The MoE pattern: `torch._grouped_mm` (aten `_grouped_mm`, what transformers' `grouped_mm`
experts and torchtitan call; cumulative int32 `offs` per expert) becomes the library's grouped
matmuls, forward and backward: `x [m, k] @ w [g, k, n]` is `tpu.gmm` (a `w` that is the
transposed view of a `[g, n, k]` weight is read in place with `transpose_rhs`, as the
backward's `grad @ w^T` is), and the weight gradient's `a [k, m] @ b [m, n] -> [g, k, n]` is
`tpu.tgmm` of `a^T` (in place: `a` is the activations' transposed view).
The group sizes are the offsets' differences, computed on the device (no value read). Rows at
or past `offs[-1]`, which torch's grouped matmul leaves unspecified, join the last group in
`gmm`; `tgmm` gives them a group of their own and drops it, so the weight gradient is torch's
exactly. No rows give the empty product (zero weight gradients); offsets that decrease or
pass the rows are refused (`group-sizes`), where torch returns unspecified values. A bias, an
`out_dtype`, other ranks or dtypes stay aten. transformers' own fallback
(`transformers::grouped_mm_fallback` and its backward, what its `grouped_mm` experts call under
`torch.compile` in float32) maps the same way, with the rows past `offs[-1]` zero as it gives
them.

Results keep eager's memory layout: where eager's result of an op is a transposed layout (SDPA's
output over transposed q/k/v, a pointwise op of a transposed tensor) and the generated kernel or
library op gave a contiguous one, it is copied into that layout at run time
(`match_eager_layouts`), since AOTAutograd's graphs rely on it (a `reshape` traced as a `view`).

Each call of a compiled graph is one recording: the graph's outputs (and the activations
AOTAutograd saves for backward) are the live results at the flush when the call returns;
intermediates are never written. New shapes (and `dynamic=True`) need nothing special: the
engine's programs are keyed by shape, so a new shape is a new cache entry, not an error.

The backend is found through the `torch_dynamo_backends` entry point (pyproject.toml), so
`import tessera` does not import dynamo.
"""

import contextlib
import operator

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from tessera import fusion

_aten = torch.ops.aten
_SDPA = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_BWD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_GROUPED_MM = getattr(getattr(_aten, "_grouped_mm", None), "default", None)


def _tensor_meta(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _flash_args(node, q, k, v, dropout, causal):
    """`(causal, sm_scale)` when this SDPA node is one flash attention computes: no mask, no
    dropout, 4-d float32/bfloat16 q, k, v with whole GQA groups; else None."""
    if node.kwargs.get("attn_mask") is not None or dropout:
        return None
    metas = [_tensor_meta(x) for x in (q, k, v)]
    if any(m is None or m.dim() != 4 or m.dtype not in (torch.float32, torch.bfloat16) for m in metas):
        return None
    mq, mk, _ = metas
    if mk.shape[1] == 0 or mq.shape[1] % mk.shape[1] or mq.dtype != mk.dtype:
        return None
    scale = node.kwargs.get("scale")
    return bool(causal), None if scale is None else float(scale)


def _group_sizes(offs, rows, tail_group):
    """torch's cumulative `offs` as int32 group sizes, on the device (no value read). Rows
    past `offs[-1]` join the last group, or with `tail_group` are one more group (`rows -
    offs[-1]` of them). Offsets that decrease or pass `rows` give a negative size, which the
    library refuses (`group-sizes`) in both forms alike."""
    offs = offs.to(torch.int32)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    tail = rows - offs[-1:]
    if tail_group:
        return torch.cat([offs - starts, tail])
    return torch.cat([(offs - starts)[:-1], torch.where(tail >= 0, rows - starts[-1:], tail)])


@contextlib.contextmanager
def _offs_named(rows):
    """The library's refusal of a negative group size, said of `offs`, what the caller passed."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        if "group-sizes" not in str(e):
            raise
        raise ValueError(f"torch._grouped_mm under backend 'tessera': `offs` must not decrease nor pass the rows ({rows}), "
                         f"whose values torch leaves unspecified; the offsets give a negative group size ({e})") from None


def _gmm_of_grouped_mm(x, w, offs, transpose_rhs=False):
    """`torch._grouped_mm(x [m, k], w [g, k, n], offs)` as `tpu.gmm`. A `w` that is the transposed
    view of a `[g, n, k]` weight (transformers' layout; the backward's `grad @ w^T`) is read in
    place with `transpose_rhs`."""
    if not transpose_rhs and not w.is_contiguous() and w.mT.is_contiguous():
        w, transpose_rhs = w.mT, True
    n = w.shape[1] if transpose_rhs else w.shape[2]
    if x.numel() == 0 or w.numel() == 0:
        return x.new_zeros(x.shape[0], n)  # an empty product (the library refuses empty arrays)
    with _offs_named(x.shape[0]):
        return torch.ops.tpu.gmm(x, w, _group_sizes(offs, x.shape[0], False), transpose_rhs)


def _tgmm_of_grouped_mm(a, grad, offs):
    """`torch._grouped_mm(a [k, m], grad [m, n], offs) -> [g, k, n]` as `tpu.tgmm` of `a^T` (the
    backward's `a` is the transposed view of the activations, so `a^T` is them in place); the
    rows past `offs[-1]` are an extra group, dropped."""
    if a.numel() == 0 or grad.numel() == 0:
        return a.new_zeros(offs.shape[0], a.shape[0], grad.shape[1])
    with _offs_named(a.shape[1]):
        return torch.ops.tpu.tgmm(a.t(), grad, _group_sizes(offs, a.shape[1], True))[:-1]


def _rows_before(out, end):
    """`out` with its rows at or past `end` (a one-element device tensor) zeroed."""
    rows = torch.arange(out.shape[0], device=out.device, dtype=torch.int32).unsqueeze(-1)
    return torch.where(rows < end.to(torch.int32), out, out.new_zeros(()))


def _hf_grouped_mm(x, w, offs):
    """transformers' `grouped_mm_fallback(x [m, k], w [g, k, n], offs)`: rows past `offs[-1]` zero."""
    return _rows_before(_gmm_of_grouped_mm(x, w, offs, False), offs[-1:])


def _hf_grouped_mm_backward(x, w, offs, grad):
    """transformers' `grouped_mm_fallback_backward`: `(grad @ w[g]^T, x[rows_g]^T @ grad[rows_g])`."""
    dx = _rows_before(_gmm_of_grouped_mm(grad, w, offs, True), offs[-1:])
    return dx, _tgmm_of_grouped_mm(x.t(), grad, offs)


def _hf_fallback_call(node):
    """The library call for transformers' grouped-matmul fallback ops, or None."""
    name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else ""
    if name not in ("transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward"):
        return None
    metas = [_tensor_meta(a) for a in node.args]
    if len(metas) < 3 or any(m is None for m in metas):
        return None
    x, w, offs = metas[:3]
    if x.dtype not in (torch.float32, torch.bfloat16) or any(m.dtype != x.dtype for m in metas[1:] if m is not offs):
        return None
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        return None
    return (_hf_grouped_mm if len(node.args) == 3 else _hf_grouped_mm_backward), tuple(node.args)


def _grouped_mm_call(node):
    """`(function, args)` computing this `_grouped_mm` node with the library, or None (see the
    module docs for what stays aten)."""
    a, b = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    out_dtype = node.args[4] if len(node.args) > 4 else node.kwargs.get("out_dtype")
    ma, mb, mo, out = _tensor_meta(a), _tensor_meta(b), _tensor_meta(offs), _tensor_meta(node)
    if offs is None or bias is not None or any(m is None for m in (ma, mb, mo, out)):
        return None
    if ma.dtype not in (torch.float32, torch.bfloat16) or mb.dtype != ma.dtype or out.dtype != ma.dtype:
        return None
    if out_dtype is not None and out_dtype != ma.dtype:
        return None
    if mo.dim() != 1 or mo.dtype not in (torch.int32, torch.int64) or mo.shape[0] == 0:
        return None
    if ma.dim() == 2 and mb.dim() == 3 and mb.shape[0] == mo.shape[0]:
        return _gmm_of_grouped_mm, (a, b, offs)
    if ma.dim() == 2 and mb.dim() == 2 and out.dim() == 3:
        return _tgmm_of_grouped_mm, (a, b, offs)
    return None


def map_library_ops(gm: torch.fx.GraphModule) -> int:
    """Rewrites the library patterns of an aten graph in place (see the module docs); returns
    how many nodes became library ops."""
    tpu = torch.ops.tpu
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        call = _grouped_mm_call(node) if node.target is _GROUPED_MM else _hf_fallback_call(node)
        if call is not None:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(*call)
        elif _SDPA is not None and node.target is _SDPA.default:
            q, k, v, dropout, causal = (list(node.args) + [0.0, False])[:5]
            args = _flash_args(node, q, k, v, dropout, causal)
            if args is None:
                continue
            if all(u.target is operator.getitem and u.args[1] == 0 for u in node.users):
                # Only the output is read: the kernel without lse, in place of each getitem.
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(tpu.flash_attention.default, (q, k, v, *args))
                val = node.meta.get("val")
                new.meta = {**node.meta, "val": val[0]} if isinstance(val, (tuple, list)) else dict(node.meta)
                for use in list(node.users):
                    use.replace_all_uses_with(new)
                    gm.graph.erase_node(use)
                gm.graph.erase_node(node)
                changed += 1
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(tpu.flash_attention_fwd.default, (q, k, v, *args))
        elif _SDPA_BWD is not None and node.target is _SDPA_BWD.default:
            do, q, k, v, o, lse, dropout, causal = (list(node.args) + [0.0, False])[:8]
            args = _flash_args(node, q, k, v, dropout, causal)
            if args is None:
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(tpu.flash_attention_bwd.default, (q, k, v, o, lse, do, *args))
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _hint(n):
    return n.node.hint if isinstance(n, torch.SymInt) and n.node.hint is not None else int(n)


def _memory_order(val):
    """The dims of eager's result `val` from outermost to innermost in memory, when it is a
    dense permutation of a contiguous tensor (a transposed layout) other than the contiguous
    one; else None."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.layout != torch.strided:
        return None
    try:
        shape, stride = [_hint(n) for n in val.shape], [_hint(n) for n in val.stride()]
    except (TypeError, ValueError, RuntimeError):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    if not _laid_out(shape, stride, order):
        return None
    big = [d for d in order if shape[d] != 1]
    return None if big == sorted(big) else order


def _laid_out(shape, stride, order):
    """Whether `stride` is the dense layout of `shape` with dims in memory order `order`
    (the strides of size-1 dims do not matter)."""
    expect = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expect:
            return False
        expect *= shape[d]
    return True


def _in_eager_layout(x, order):
    """`x` in eager's memory order `order`: a result of a generated kernel or a library op is
    contiguous, where eager's kept its input's transposed layout (SDPA's output over
    transposed q, a pointwise op of a transposed tensor), and AOTAutograd's graph relies on
    it (a `reshape` traced as a `view`). A copy in that order, then the permuted view."""
    if not isinstance(x, torch.Tensor) or x.dim() != len(order) or _laid_out(list(x.shape), list(x.stride()), order):
        return x
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.permute(order).contiguous().permute(inverse)


def match_eager_layouts(gm: torch.fx.GraphModule) -> int:
    """After every node whose eager result has a transposed layout (its `val` metadata), the
    same layout at run time ([`_in_eager_layout`]: a no-op when the value already has it, as
    an op left to aten gives it). Views follow their base and are left alone. Returns how many
    nodes were guarded."""
    guarded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            continue
        order = _memory_order(node.meta.get("val"))
        if order is None:
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(_in_eager_layout, (node, order))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        guarded += 1
    if guarded:
        gm.recompile()
    return guarded


def _deferred(gm: torch.fx.GraphModule, example_inputs):
    map_library_ops(gm)
    match_eager_layouts(gm)

    def run(*args):
        with fusion.set_eager_mode(fusion.EagerMode.DEFER_AND_FUSE):
            return gm(*args)

    return make_boxed_func(run)


_backend = aot_autograd(fw_compiler=_deferred, bw_compiler=_deferred)


def tessera_backend(gm, example_inputs, **kwargs):
    """The `tessera` torch.compile backend (see the module docs)."""
    return _backend(gm, example_inputs, **kwargs)
