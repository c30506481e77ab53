"""`torch.compile(model, backend="tessera")`: AOTAutograd's forward and backward aten graphs
run under DEFER_AND_FUSE, so their fusible runs become generated Tessera kernels (partitioned
by the fusion planner, cached by structure) and every other op stays aten.

Before that, library patterns in the graphs become library ops: scaled-dot-product attention
(`F.scaled_dot_product_attention` without a mask or dropout, causal or not, any scale; aten's
`_scaled_dot_product_flash_attention_for_cpu` and its backward in the graphs AOTAutograd
traces) becomes `tpu.flash_attention_fwd` / `tpu.flash_attention_bwd`. Both are the same
logsumexp-saving flash attention, so the forward's saved `lse` is what the backward reads.
A masked or dropout SDPA, or one on another dtype or rank, stays aten.

Each call of a compiled graph is one recording: the graph's outputs (and the activations
AOTAutograd saves for backward) are the live results at the flush when the call returns;
intermediates are never written. New shapes (and `dynamic=True`) need nothing special: the
engine's programs are keyed by shape, so a new shape is a new cache entry, not an error.

The backend is found through the `torch_dynamo_backends` entry point (pyproject.toml), so
`import tessera` does not import dynamo.
"""

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from tessera import fusion

_aten = torch.ops.aten
_SDPA = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_BWD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


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


def map_library_ops(gm: torch.fx.GraphModule) -> int:
    """Rewrites the library patterns of an aten graph in place (see the module docs); returns
    how many nodes became library ops."""
    if _SDPA is None:
        return 0
    tpu = torch.ops.tpu
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _SDPA.default:
            q, k, v, dropout, causal = (list(node.args) + [0.0, False])[:5]
            args = _flash_args(node, q, k, v, dropout, causal)
            if args is None:
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


def _deferred(gm: torch.fx.GraphModule, example_inputs):
    map_library_ops(gm)

    def run(*args):
        with fusion.set_eager_mode(fusion.EagerMode.DEFER_AND_FUSE):
            return gm(*args)

    return make_boxed_func(run)


_backend = aot_autograd(fw_compiler=_deferred, bw_compiler=_deferred)


def tessera_backend(gm, example_inputs, **kwargs):
    """The `tessera` torch.compile backend (see the module docs)."""
    return _backend(gm, example_inputs, **kwargs)
