"""Tessera's ops under DTensor (`torch.distributed.tensor`): a sharding rule per op.

`import tessera.dtensor` (or `import tessera` after `torch.distributed.tensor` was imported)
registers a DTensor sharding strategy for every `torch.ops.tpu.*` op, so the ops take
DTensor arguments like aten ops do: `parallelize_module` with `ColwiseParallel` /
`RowwiseParallel` around Tessera's RMSNorm, RoPE, flash attention and SwiGLU, expert
weights sharded over their expert dim for `gmm`, and so on. Each op's local kernel then runs
on each rank's shard, unchanged.

The rules are the table `RULES` below: per op, the dims that may be sharded, named as in
the op's input contracts (`kernels/src`, `[b, h, sq, d]`, `[..., n]`, `[g, k, n]`; read from
`_native.op_table()`'s `input_dims`). A rule `Rule("h", "hkv")` means: on one mesh dim,
every input holding a dim named `h` or `hkv` is sharded on it, every other input is
replicated; an output is sharded where its shape expression (the fake kernel's, `outputs`)
takes a sharded input dim, and an output that takes none is declared `partial` (a sum of
the shards' results, `Partial()`) or `replicate` in the rule, else the rule is refused when
derived. `Rule("...")` shards any one of the leading (row) dims of `[..., n]` inputs. Every
op also gets the all-`Replicate` strategy, so an op with no rule (`REPLICATE_ONLY`, and any
op of a user crate) runs whole on every rank: correct, never fast.

Two kinds of rules carry a condition DTensor's per-mesh-dim rules cannot state, checked on
every full-mesh candidate:

- dims sharded together (`Rule("h", "hkv")`, GQA's query and kv heads; `Rule("g", "m")`,
  experts and their rows) need every such dim divisible by its number of shards, so the
  shards line up (query heads `[i*H/N, (i+1)*H/N)` read kv heads `[i*Hkv/N, ...)`): a mesh
  that does not divide the kv heads is never offered head sharding;
- `aligned="lhs"`: gmm/tgmm's expert rule is offered only when `lhs` already arrives
  sharded by rows on that mesh dim, i.e. the caller laid each rank's rows out as exactly its
  experts' groups (a capacity layout, or what an all-to-all produced); DTensor never chooses
  it by itself for replicated tokens, where it would be wrong for ragged groups. The
  kernels' host check (`group-sizes`: the local sizes must sum to the local rows) refuses a
  misaligned shard.

Inputs whose placement no rule takes are redistributed by DTensor to the cheapest valid
one (that is what a strategy listing only the valid input specs does), never computed on
the wrong shard. Registration goes through DTensor's own op-strategy machinery
(`ShardingPropagator.register_op_strategy` and `expand_to_full_mesh_op_strategy`, what
`torch.distributed.tensor.experimental.register_sharding` is built on) because
`register_sharding` takes per-mesh-dim rules only and cannot filter full-mesh candidates.
"""

import math
import re
from dataclasses import dataclass, field

import torch

from tessera._ops import SPECS

__all__ = ["Rule", "RULES", "REPLICATE_ONLY", "register", "placements_for", "ShardingRuleError"]


class ShardingRuleError(ValueError):
    """A rule that does not fit its op's contract (a bug in `RULES`)."""


@dataclass(frozen=True)
class Rule:
    """Dims (contract names) sharded together on one mesh dim; see the module docs."""

    dims: tuple
    partial: frozenset = field(default_factory=frozenset)
    replicate: frozenset = field(default_factory=frozenset)
    aligned: str = None  # an input that must already arrive sharded as the rule shards it

    def __init__(self, *dims, partial=(), replicate=(), aligned=None):
        object.__setattr__(self, "dims", tuple(dims))
        object.__setattr__(self, "partial", frozenset(partial))
        object.__setattr__(self, "replicate", frozenset(replicate))
        object.__setattr__(self, "aligned", aligned)


ROWS = Rule("...")
HEADS = Rule("h", "hkv")  # GQA: query and kv heads together, groups whole per shard
EXPERTS = Rule("g", "m", aligned="lhs")  # expert parallel: experts with their rows

# Per op: its rules (besides all-Replicate, always offered). Backward ops shard like their
# forwards; a weight's gradient summed over the sharded rows is `partial`.
RULES = {
    # matmul: rows (x Shard(0)), columns (y Shard(1) -> out Shard(1)), contraction
    # (x Shard(1), y Shard(0) -> Partial), as aten.mm.
    "matmul": [Rule("m"), Rule("n"), Rule("k", partial=["out"])],
    "matmul_bwd": [Rule("m", partial=["dy"]), Rule("n", partial=["dx"]), Rule("k")],
    "quantized_matmul": [Rule("m"), Rule("n"), Rule("k", partial=["out"])],
    "quantized_matmul_dx": [Rule("m"), Rule("k"), Rule("n", partial=["dx"])],
    # 4-bit weights: rows, or columns (w and its scales by n); not K, whose shards would
    # have to fall on the 64-row nibble-plane chunks of w (divisibility is all a rule states).
    "matmul_int4": [Rule("m"), Rule("n")],
    "matmul_mxfp4": [Rule("m"), Rule("n")],
    "matmul_nvfp4": [Rule("m"), Rule("n")],
    "matmul_int4_dx": [Rule("m"), Rule("n", partial=["dx"])],
    "matmul_mxfp4_dx": [Rule("m"), Rule("n", partial=["dx"])],
    "matmul_nvfp4_dx": [Rule("m"), Rule("n", partial=["dx"])],
    "int_mm": [Rule("m"), Rule("n"), Rule("k", partial=["out"])],
    # Row ops: over tokens (any leading dim), never the normalised / softmax dim.
    "softmax": [ROWS],
    "softmax_bwd": [ROWS],
    "rmsnorm": [ROWS],
    "rmsnorm_bwd": [Rule("...", partial=["dweight"])],
    "rmsnorm_residual": [ROWS],
    "rmsnorm_residual_bwd": [Rule("...", partial=["dweight"])],
    "layernorm": [ROWS],
    "layernorm_bwd": [Rule("...", partial=["dweight", "dbias"])],
    # Elementwise: rows and columns (tensor parallel MLPs shard the hidden dim).
    "gelu_affine": [ROWS, Rule("n")],
    "gelu_affine_bwd": [Rule("...", partial=["da", "db"]), Rule("n")],
    "swiglu": [ROWS, Rule("d")],
    "swiglu_bwd": [ROWS, Rule("d")],
    "geglu": [ROWS, Rule("d")],
    "geglu_bwd": [ROWS, Rule("d")],
    # RoPE: tokens (with their position ids) or heads, not the rotated head dim.
    "rope": [Rule("t"), Rule("h")],
    "rope_bwd": [Rule("t"), Rule("h")],
    # Cross-entropy: tokens. The per-token loss has no reduction inside the op (a `.mean()`
    # after it is aten's, which DTensor reduces itself); the vocab dim is refused (the
    # log-sum-exp is not a sum of shards), so vocab-sharded logits are redistributed.
    "cross_entropy": [Rule("t")],
    "cross_entropy_bwd": [Rule("t")],
    "cross_entropy_with_grad": [Rule("t")],
    # Grouped matmuls: experts (aligned rows), output columns, or the contraction (Partial),
    # as aten._grouped_mm plus expert parallelism. Rows alone are not a rule: which groups
    # a row shard holds depends on the values of group_sizes.
    "gmm": [EXPERTS, Rule("n"), Rule("k", partial=["out"])],
    "gmm_bwd": [EXPERTS, Rule("k"), Rule("n", partial=["dlhs"])],
    "tgmm": [EXPERTS, Rule("k"), Rule("n")],
    # Routing: top-k per token; permute/combine sort all tokens by expert (a global order),
    # so only the hidden dim shards.
    "router_topk": [Rule("t")],
    "permute": [Rule("d", replicate=["group_sizes"])],
    "permute_bwd": [Rule("d")],
    "combine": [Rule("d")],
    # Attention: batch, or heads (GQA-aware), as aten's scaled_dot_product_attention.
    "flash_attention_fwd": [Rule("b"), HEADS],
    "flash_attention": [Rule("b"), HEADS],
    "flash_attention_bwd": [Rule("b"), HEADS],
    # Splash: batch only (the mask metadata is replicated; its walks may be per head).
    "splash_attention_fwd": [Rule("b")],
    "splash_attention": [Rule("b")],
    "splash_attention_bwd": [Rule("b")],
    "paged_attention": [Rule("b"), HEADS],
    "ragged_paged_attention": [HEADS],
    # Blockwise fp8: the scales' blocks run along k (1x128) or m (128x1), so the other dim
    # shards freely; the wgrad contracts over m (output [k, n]).
    "scaled_mm_blockwise": [Rule("m")],
    "scaled_mm_blockwise_wgrad": [Rule("k"), Rule("n")],
    "quantize_fp8_1x128": [Rule("m")],
    "quantize_fp8_128x1": [Rule("n")],
}

# Ops that run replicated on purpose (none in the library today; a user crate's ops are
# replicated unless it adds rules to RULES before registering).
REPLICATE_ONLY = frozenset()


# ---- the dims contracts --------------------------------------------------------------------


def _resolve(item, statics):
    """`flag ? a : b` by the bool static `flag`; anything else as is."""
    if "?" in item and ":" in item:
        flag, rest = item.split("?", 1)
        a, b = rest.split(":", 1)
        return _resolve((a if statics[flag.strip()] else b).strip(), statics)
    return item.strip()


def dim_names(dims, rank, statics):
    """The name of each dim of a tensor of `rank` under contract `dims`: a name (`"t"`),
    `("...", j)` for leading dim j of `[..., n]`, or an opaque item (`"t*k"`, `"1"`)."""
    items = [i.strip() for i in dims.strip()[1:-1].split(",") if i.strip()]
    items = [_resolve(i, statics) if not i.endswith("?") else i for i in items]
    if items and items[0] == "...":
        rest = rank - (len(items) - 1)
        return [("...", j) for j in range(rest)] + items[1:]
    required = [i for i in items if not i.endswith("?")]
    if rank == len(required):
        items = required
    return [i[:-1].strip() if i.endswith("?") else i for i in items]


def _output_sources(expr, tensor_dims, statics):
    """For each dim of an output with shape expression `expr` (`_fake`'s grammar), the
    input dim `(name, position)` it is, or None (a product, a static, an integer)."""
    expr = expr.strip()
    if not expr.startswith("["):
        # `x | y`: the first given (tensor_dims holds the given inputs).
        name = next((n for n in map(str.strip, expr.split("|")) if n in tensor_dims), expr)
        return [(name, p) for p in range(len(tensor_dims[name]))]
    from tessera._fake import _split

    out = []
    for item in _split(expr[1:-1]):
        item = _resolve(item, statics) if "?" in item else item
        if item.startswith("*"):
            name, _, rng = item[1:].partition("[")
            positions = list(range(len(tensor_dims[name.strip()])))
            if rng:
                lo, _, hi = rng.rstrip("]").partition(":")
                positions = positions[int(lo) if lo.strip() else None : int(hi) if hi.strip() else None]
            out.extend((name.strip(), p) for p in positions)
        elif re.fullmatch(r"\s*\w+\.-?\d+\s*", item):  # `x.1`; `x.1 / 128` is opaque
            name, d = item.split(".", 1)
            rank = len(tensor_dims[name.strip()])
            out.append((name.strip(), int(d) % rank))
        else:
            out.append(None)
    return out


@dataclass
class Variant:
    """One rule made concrete for one call: a placement per input and per output, as
    `("shard", dim)`, `"partial"` or `"replicate"`; `grouped`: the `(input, dim)`s that
    must divide evenly; `aligned`: the `(input, dim)` that must already be sharded so."""

    rule: Rule
    inputs: dict
    outputs: list
    grouped: list
    aligned: tuple = None


def placements_for(name, shapes, statics):
    """The rules of op `name` for a call with input `shapes` (`{input: shape}`, absent
    optional inputs left out) and `statics` (`{name: value}`), as `Variant`s. Raises
    `ShardingRuleError` for a rule that does not fit the op's contract."""
    spec = SPECS[name]
    if spec.composite:
        raise ShardingRuleError(f"tpu::{name} is an alias of tpu::{spec.alias_of[0]}: DTensor sees that op")
    rules = [] if name in REPLICATE_ONLY else RULES.get(name, [])
    tensor_dims = {}
    for inp, dims in zip(spec.input_names, spec.input_dims):
        if inp in shapes:
            tensor_dims[inp] = dim_names(dims, len(shapes[inp]), statics)
    sources = [_output_sources(shape, tensor_dims, statics) for _, shape, _ in spec.outputs]
    variants = []
    for rule in rules:
        if rule.dims == ("...",):
            lead = max((sum(isinstance(n, tuple) for n in names) for names in tensor_dims.values()), default=0)
            matchers = [lambda n, j=j: n == ("...", j) for j in range(lead)]
        else:
            matchers = [lambda n, dims=rule.dims: n in dims]
        for match in matchers:
            inputs, sharded = {}, set()
            for inp, names in tensor_dims.items():
                hits = [p for p, n in enumerate(names) if match(n)]
                if len(hits) > 1:
                    raise ShardingRuleError(f"tpu::{name}: rule {rule.dims} shards two dims of `{inp}`")
                inputs[inp] = ("shard", hits[0]) if hits else "replicate"
                sharded.update((inp, p) for p in hits)
            if not sharded:
                continue
            outputs = []
            for (oname, _, _), src in zip(spec.outputs, sources):
                hits = [p for p, s in enumerate(src) if s in sharded]
                if len(hits) > 1:
                    raise ShardingRuleError(f"tpu::{name}: rule {rule.dims} shards two dims of output `{oname}`")
                if hits:
                    outputs.append(("shard", hits[0]))
                elif oname in rule.partial:
                    outputs.append("partial")
                elif oname in rule.replicate:
                    outputs.append("replicate")
                else:
                    raise ShardingRuleError(
                        f"tpu::{name}: rule {rule.dims} leaves output `{oname}` unsharded; declare it partial or replicate"
                    )
            grouped = sorted(sharded) if len(rule.dims) > 1 else []
            aligned = None
            if rule.aligned is not None:
                aligned = (rule.aligned, inputs[rule.aligned][1]) if inputs.get(rule.aligned, "replicate") != "replicate" else None
                if aligned is None:
                    raise ShardingRuleError(f"tpu::{name}: rule {rule.dims} does not shard its aligned input `{rule.aligned}`")
            variants.append(Variant(rule, inputs, outputs, grouped, aligned))
    return variants


# ---- registration with DTensor -------------------------------------------------------------


def _torch_placement(p):
    from torch.distributed.tensor import Partial, Replicate, Shard

    if p == "partial":
        return Partial()
    if p == "replicate":
        return Replicate()
    return Shard(p[1])


def _strategy(spec):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    schema_args = torch._C.parse_schema(f"{spec.qualname}{spec.schema}").arguments
    n_out = len(spec.outputs)

    def strategy(op_schema):
        mesh = op_schema.get_mesh_from_args()
        # Every argument by name: positional, then keyword, then defaults.
        values = {}
        for i, a in enumerate(schema_args):
            if i < len(op_schema.args_schema):
                values[a.name] = op_schema.args_schema[i]
            elif a.name in op_schema.kwargs_schema:
                values[a.name] = op_schema.kwargs_schema[a.name]
            else:
                values[a.name] = spec.defaults[i]
        tensors = {n: v for n, v in values.items() if isinstance(v, OpStrategy)}
        statics = {n: v for n, v in values.items() if n not in tensors}
        shapes = {n: tuple(v.shape) for n, v in tensors.items()}
        variants = placements_for(spec.name, shapes, statics)
        # Inputs in DTensor's order: positional tensor args, then keyword ones.
        order = [a.name for a, v in zip(schema_args, op_schema.args_schema) if isinstance(v, OpStrategy)]
        order += [k for k, v in op_schema.kwargs_schema.items() if isinstance(v, OpStrategy)]

        def row(outs, ins):
            return [_torch_placement(p) for p in outs] + [_torch_placement(ins[n]) for n in order]

        replicate = row(["replicate"] * n_out, {n: "replicate" for n in order})
        single = [replicate] + [row(v.outputs, v.inputs) for v in variants]
        by_inputs = {tuple(r[n_out:]): v for r, v in zip(single[1:], variants)}
        result = expand_to_full_mesh_op_strategy(mesh, op_schema, single, input_index=n_out)
        current = [tensors[n].strategies[0].output_spec.placements for n in order]

        def valid(candidate: OpSpec):
            ins = candidate.input_specs
            for d in range(mesh.ndim):
                v = by_inputs.get(tuple(s.placements[d] for s in ins))
                if v is None:
                    continue
                for inp, dim in v.grouped:
                    i = order.index(inp)
                    shards = math.prod(mesh.size(e) for e in range(mesh.ndim) if ins[i].placements[e] == Shard(dim))
                    if shapes[inp][dim] % shards:
                        return False
                if v.aligned is not None:
                    i = order.index(v.aligned[0])
                    if current[i][d] != Shard(v.aligned[1]):
                        return False
            return True

        return OpStrategy([c for c in result.strategies if valid(c)])

    return strategy


_registered = set()


def register(names=None):
    """Registers the DTensor strategy of every op in `tessera.ops()` (or of `names`); ops
    already registered are skipped. Called by `import tessera.dtensor`, and by
    `tessera.register_ops` for a user module's ops once this module is imported."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in names if names is not None else list(SPECS):
        spec = SPECS[name]
        if name in _registered or spec.composite:
            continue  # a plain alias is CompositeImplicitAutograd: DTensor sees its target
        op = getattr(torch.ops.tpu, name).default
        parsed = torch._C.parse_schema(f"{spec.qualname}{spec.schema}")
        static_argnum = min((i for i, a in enumerate(parsed.arguments) if i in spec.static_idx), default=100)
        propagator.register_op_strategy(op, _strategy(spec), RuntimeSchemaInfo(static_argnum=static_argnum))
        _registered.add(name)


register()
