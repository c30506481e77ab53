"""DeferAndFuse: plain PyTorch ops on CPU or `tpu` tensors, recorded and run as generated Tessera kernels.

    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w   # recorded
        print(y)                                                          # flush: one kernel

Under the mode a `TorchDispatchMode` sees every aten op. An op the engine takes (pointwise,
casts, comparisons, `where`, clamps, last-dim row ops, column sums and sums over a run of
inner dims (folded into the matmul whose batches they are, else a matmul by ones), reshapes,
`expand`, `detach`; `mm`,
`bmm`, `addmm` (so `linear` and `matmul`, which decompose into them) as matmul anchors with
fused epilogues; `cat` over the last dim (or, over any dim, of one piece and empty ones: a
copy) and `slice_backward` of a last-dim slice; `select_backward` of a leading dim (a `where`
of a host-made row mask); add/mul/div of a float tensor and a bool one (the bool cast to the
float dtype, as torch promotes it); the views
`t`/`transpose`/`permute`/`slice`/`select`/`as_strided` and inner-dim expands as copies
(also an add/sub/mul/div operand broadcast over inner leading dims, as a causal mask
`[b, 1, s, s]` over scores `[b, h, s, s]`);
see `tessera_kernels::fusion`) is recorded into a native graph and returns a *placeholder*: a
real tensor of the result's shape and dtype whose memory is not written yet. A flush plans
the graph into kernels, generates them with the dsl builder, verifies them, runs them on the
CPU backend (`TESSERA_BACKEND`), and writes only the placeholders somebody still references
(intermediates nobody holds are never written, so their pages are never touched).
A recording holds tensors of one device; on `tpu` (the emulated device or TorchTPU) the
placeholders are device tensors and a flush runs the kernels on the device's execution path
(`tessera._fusion_device`: on the emulated device a placeholder gets memory only when it is
materialised; on TorchTPU each kernel is one `register_custom_kernel` module). A tensor of
another device in the same recording is refused (`fusion-device-mix`: the op runs eagerly).

Flushes happen on: reading values (`.item()`, `bool/int/float()`, `.tolist()`, `.numpy()`,
`repr`/`print`/format, `data_ptr()`, pickling), an op the engine does not take whose inputs are pending (it runs
eagerly after the flush), a write to a tensor the pending graph reads, an in-place op on a
pending tensor that has views, `backward()` / `torch.autograd.grad` (before and after), more
than `TESSERA_FUSION_MAX_OPS` (512) recorded ops, a loop boundary (below), leaving the mode,
and `flush()`. Flush points depend only on the op sequence, never on timing.

The loop heuristic (as TorchTPU cuts training steps): the deferred ops' fingerprints (their
aten overloads) are watched for a repeated suffix; once a whole period of P ops repeats the
P before it, every P ops is a loop boundary, and a flush is cut at a boundary when the next
iteration would pass the size cap. So every flush of a loop holds the same whole iterations
(one structure, program-cache hits) instead of wherever the cap falls. A period is found
when some op occurs once per iteration (the candidate is the distance to the op's previous
occurrence); a mismatch drops it. A loop whose iterations already flush on their own
(an eager op each step) is unaffected: the cap is never near.

Aliasing is eager's: views of pending tensors are real views of the placeholder's memory
(a view that moves elements between rows is recorded as a copy of its source's value, exact
because in-place ops on a group with views are never deferred); a strided real tensor whose
base is contiguous (a weight's `t()`) is recorded as its base and the view, so a matmul reads
it in place (an expand of such a base, a broadcast read in place);
in-place ops are deferred only on a pending tensor with no other live alias (its memory is
then written by the kernel), otherwise they flush and run eagerly. Autograd runs above the
mode, so backward ops are recorded and fused too. A recording holds its placeholders' storages,
so an alias made without the dispatcher (`nn.Parameter(x * 2)`, `as_subclass`, `p.data = y`,
`module.to(dtype)`, `copy.deepcopy` of a module) is seen: its memory is written at the flush
(whoever holds it), and an op, reader, `untyped_storage()`, `__dlpack__` or `__deepcopy__` on
it flushes first. An input is read from the memory it had when recorded (`p.data = t`
afterwards does not change what the recorded op read).

What the mode cannot see: a write to an input through memory torch does not track (a numpy
array or DLPack capsule of it) after an op read it and before the flush (the flush reads the
new values; call `flush()` first); a pending tensor used by plain ops in another thread (the mode
is per thread, as torch's dispatch mode stack: each thread sets its own and defers only its own
ops; readers such as `.tolist()` flush from any thread, ops and flushes of all threads taking
turns on one lock, but another thread's `y.sum()` sees the unwritten memory: flush before handing
tensors over); and `torch.utils.dlpack.to_dlpack` of a pending tensor when it was imported
before `tessera` (`from torch.utils.dlpack import to_dlpack` afterwards, `torch.to_dlpack`,
`t.__dlpack__()` and `np.from_dlpack` flush). `torch.utils.swap_tensors` of a
tensor the recording holds a weak reference to refuses the swap (torch's own rule), and so
does `nn.Module.to` with `torch.__future__.set_swap_module_params_on_conversion(True)` inside
the mode. A result is contiguous where
eager's may keep a transposed input's layout (`x.t() * 2` has strides `(1, rows)` in eager):
values and views are equal, but a `.view` that only eager's strides allow raises here (use
`reshape`), one that eager's strides forbid succeeds here (`(x.t() * 2).view(-1)`), and
`contiguous()`, `reshape` or `flatten` of such a result, which copy in eager, are views here: an in-place write through one changes the other (`y = x.t() * 1; z =
y.contiguous(); z.zero_()` zeroes `y` too; clone first). Under `torch.compile` the backend
restores eager's layouts. The sign of a zero can differ from
eager's where torch's kernels themselves differ by path: a row sum of -0.0 values is -0.0 here
(eager's reductions start at +0.0), `clamp(-0.0, min=0)` is +0.0 (eager keeps -0.0).

If a graph cannot be built or a kernel fails verification the recorded ops are replayed
eagerly and `stats()["fallbacks"]` says why. A graph structure seen with more than
`TESSERA_FUSION_SHAPES` (8) shape variants runs its new variants per op (shape churn, as in
decode loops) instead of compiling a program per step; so does one of one shape seen with more
than 32 sets of Python numbers (the kernels' constants), as an optimizer's bias correction or
a scheduled learning rate, new every step (counted as shape churn too). And a module (`nn.Module`) an
outermost call of which had such a flush is *churning* (for the process): its later calls
flush what is pending and step the mode aside, popping it off the dispatch stack, so the call
and the code after it run strictly at strict eager's cost (a Python dispatch mode costs ~5 us
an op even passing ops through, more than a small model's ops cost: `generate()` of a tiny
Llama ran 2.7x slower under a no-op mode). The mode comes back at the next outermost call of
a module that is not churning, `flush()`, or leaving the mode (a `backward()` while aside runs
strictly too: its forward did, and its shapes churn as the forward's); `stats()["stepped_aside"]`
counts the steps aside. Like every flush point, this
depends only on the op sequence (and the module calls), never on timing. Only churn steps
aside: recording costs ~24 us an op (`scripts/bench_recording.py`), more than an op on a
few thousand elements costs in strict eager, so a loop over tiny tensors whose graphs keep
their shapes (a tiny model's decode with `attn_implementation="sdpa"` and a KV cache, or a
static cache: the growing attention is one eager op, the fused graphs around it do not
churn) runs 5-8x slower than strict on the CPU; run such a loop under
`set_eager_mode(STRICT)`. The mode's hooks
(Tensor's value readers, `torch.autograd.backward` / `grad`, `nn.Module.__call__`) are
installed at its first entry and stay for the process, one check each outside the mode:
patching those classes on every `with` cost ~1.5 ms per `with` (CPython's attribute caches of
all their subclasses start over), 4% of a tiny Llama's `generate()`.
`TESSERA_DUMP_FUSION=DIR` writes each flushed graph, its partition and every kernel's IR and
Mosaic to `DIR/flush_NNNNN.txt`; `TESSERA_FUSION_MODULES=DIR` every kernel flushed as StableHLO
for v5e/v6e/tpu7x (the libtpu tier).
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import re
import threading
import weakref
from collections import Counter

import torch
import torch.utils.dlpack
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tessera import _fusion_device, _native

aten = torch.ops.aten

__all__ = ["EagerMode", "set_eager_mode", "get_eager_mode", "flush", "stats", "reset_stats"]


class EagerMode(enum.Enum):
    STRICT = "strict"
    DEFER_AND_FUSE = "defer_and_fuse"


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.bool: "bool"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _env_count(name: str, default: int) -> int:
    """A positive integer setting from the environment; a value that is not one is an error
    (a typo silently meaning the default would hide that the setting did nothing)."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"tessera: {name}={text!r} is not a positive integer; set it to one (the default is {default}) or unset it")
    return value


def _churn_limit() -> int:
    return _env_count("TESSERA_FUSION_SHAPES", 8)


# Churn: per graph structure without its shapes (or without its Python numbers), the
# variants compiled so far.
_variants: dict = {}
_VARIANT_KEYS = 4096  # structures remembered (oldest forgotten first)
# Variants of one structure and shapes that differ only in Python numbers before they churn:
# more than shapes get (a program's few constant sets, other call sites' `x * 2.0`, `x * 3.0`
# of one shape, all compile), few enough that a number new every step stops compiling soon.
_NUMBER_VARIANTS = 32


def _churning(graph_text: str, live) -> bool:
    """Whether this flush is a new variant of a structure that already has enough compiled
    ones: then it runs per op instead. `TESSERA_FUSION_SHAPES` (8) variants in shapes (decode
    loops whose lengths grow every step would otherwise compile a program per step), or
    `_NUMBER_VARIANTS` (32) of one shape in the Python numbers the kernels hold as constants
    (an optimizer's bias correction or a schedule's learning rate, new every step)."""
    full = f"{graph_text}|{live}"
    # Shapes and the numbers derived from them (a gather's `col_start` of `x[:, -1]`); Python
    # numbers (`3.7e-1#3fd7ae147ae147ae`).
    shapeless = re.sub(r"(?<=: )[0-9]+\b", "#", re.sub(r"\[[0-9, ]*\]", "[]", full))
    numberless = re.sub(r"[-+0-9.eEinfNa]+#[0-9a-f]{16}", "S", full)
    groups = [(_variants.setdefault(("shapes", shapeless), set()), _churn_limit()), (_variants.setdefault(("numbers", numberless), set()), _NUMBER_VARIANTS)]
    while len(_variants) > _VARIANT_KEYS:
        _variants.pop(next(iter(_variants)))
    if full in groups[0][0]:
        return False
    if any(len(seen) >= limit for seen, limit in groups):
        return True
    for seen, _ in groups:
        seen.add(full)
    return False


def _max_ops() -> int:
    return _env_count("TESSERA_FUSION_MAX_OPS", 512)


# ---- stats ------------------------------------------------------------------------------------

_stats = {}


def reset_stats() -> None:
    """Zeroes the counters of `stats()`."""
    _stats.clear()
    _stats.update(ops_deferred=0, ops_eager=0, eager_reasons=Counter(), flushes=0, flush_causes=Counter(),
                  kernels_launched=0, shape_churn=0, results_written=0, temporaries=0, cache_hits=0, cache_misses=0, loop_boundaries=0, stepped_aside=0, fallbacks=[])


reset_stats()


def stats() -> dict:
    """Ops deferred, ops run eagerly and why (`eager_reasons`: rule or op name -> count),
    flushes and their causes, kernels launched, results written to tensors
    (`results_written`) and buffers allocated between kernels (`temporaries`), flushes run
    per op because their structure keeps changing shape (`shape_churn`), program-cache
    hits and misses (this process's flushes), loop boundaries the loop heuristic found,
    steps aside for churning modules, and `fallbacks` (why a flushed graph ran eagerly
    instead)."""
    out = dict(_stats)
    out["eager_reasons"] = dict(_stats["eager_reasons"])
    out["flush_causes"] = dict(_stats["flush_causes"])
    out["fallbacks"] = list(_stats["fallbacks"])
    out["native_cache"] = dict(_native.fusion_cache_info())
    return out


def _rule_of(err: Exception) -> str:
    m = re.search(r"error\[([^\]]+)\]", str(err))
    return m.group(1) if m else type(err).__name__


# ---- the pending graph -----------------------------------------------------------------------


class _Unsupported(Exception):
    """The engine does not take this op (the message is the reason)."""


class _Group:
    """Tensors sharing one placeholder's memory: its current value is node `root`.

    The group holds the placeholder's storage, so a flush can tell whether anybody else still
    does (its use count), whatever tensor object that is: a view, or an alias made without
    the dispatcher (`nn.Parameter(t)`, `as_subclass`, `p.data = t`, `module.to(dtype)`).
    When the placeholder dies with nobody else holding the memory, the group lets it go
    ([`_Group.owner_died`]): an intermediate's memory is freed (and reused) at once, as eager's."""

    __slots__ = ("root", "shape", "dtype", "members", "storage")

    def __init__(self, root, shape, dtype, storage):
        self.root = root
        self.shape = shape
        self.dtype = dtype
        self.members = []  # weakrefs; [0] is the placeholder that owns the memory
        self.storage = storage

    def alive(self):
        return [t for t in (r() for r in self.members) if t is not None]

    def held(self):
        """Whether a tensor (or autograd's saved one) besides the group holds the memory."""
        return self.storage is not None and torch._C._storage_Use_Count(self.storage._cdata) > 1

    def owner_died(self, storages):
        """The weakref callback of the placeholder: it runs while the dying tensor still holds
        the storage (one use) beside the group (one): more uses are an alias, kept for the
        flush; else the storage is dropped (from `storages`, the recording's registry, too)."""

        def callback(_ref):
            s = self.storage
            if s is not None and torch._C._storage_Use_Count(s._cdata) <= 2:
                storages.pop(s._cdata, None)
                self.storage = None

        return callback


class _State:
    def __init__(self):
        self.graph = _native.FusionGraph()
        self.pending = {}  # id(tensor) -> (weakref, node, group)
        self.inputs = []  # real tensors, in graph-input order
        self.input_memory = []  # per input: (storage, dtype, offset, shape, strides) when recorded
        self.input_nodes = {}  # id(real tensor) -> (node, index) of its latest recording
        self.input_node_ids = []  # node of each input
        self.input_storages = set()  # data_ptr of the inputs' storages
        self.strided_inputs = {}  # id(real strided view) -> (weakref, node)
        self.slice_grads = {}  # node of a slice_backward -> (start, end, gradient node)
        self.groups = []
        self.storages = {}  # the placeholders' storages (their `_cdata`) -> group
        self.records = []  # (func, args, kwargs, out_node, target_node) for the eager replay
        self.ops = 0
        self.max_ops = _max_ops()
        self.device = None  # the recorded tensors' device type: "cpu" or "tpu"

    def entry(self, t):
        """`(weakref, node, group)` of a pending tensor; None for any other, and for a pending
        tensor rebound since to other memory (`a.data = z`: it is `z`'s now)."""
        e = self.pending.get(id(t))
        if e is not None and e[0]() is t:
            s = e[2].storage
            if s is not None and _untyped_storage(t)._cdata == s._cdata:
                return e
        return None


_state = _State()
_flush_count = 0


_untyped_storage = torch.Tensor.untyped_storage  # (the mode wraps the method; see _install)


def _storage_key(t):
    """The identity of `t`'s storage (its StorageImpl), or None for a tensor without one
    (sparse, nested, a subclass that refuses `untyped_storage`)."""
    try:
        return _untyped_storage(t)._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _storage_ptr(t):
    try:
        return _untyped_storage(t).data_ptr()
    except Exception:
        return None


def _is_plain_cpu(t):
    return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)


def _node_of(t, st):
    """The node of tensor `t`: pending, or a graph input (recorded on first use)."""
    e = st.entry(t)
    if e is not None:
        return e[1]
    if not _is_plain_cpu(t) or t.layout != torch.strided:
        raise _Unsupported("device")
    _same_device(t, st)
    if t.dtype not in _DTYPES:
        raise _Unsupported("fusion-dtype")
    if not t.is_contiguous():
        node = _real_strided_node(t, st)
        if node is not None:
            return node
    n = st.input_nodes.get(id(t))
    if n is not None and st.inputs[n[1]] is t and _same_memory(t, st.input_memory[n[1]]):
        return n[0]
    try:
        node = st.graph.input(_DTYPES[t.dtype], list(t.shape))
    except ValueError as err:
        raise _Unsupported(_rule_of(err)) from None
    st.input_nodes[id(t)] = (node, len(st.inputs))
    st.input_node_ids.append(node)
    st.inputs.append(t)
    st.input_memory.append((_untyped_storage(t), t.dtype, t.storage_offset(), t.shape, t.stride()))
    st.input_storages.add(_storage_ptr(t))
    return node


def _same_memory(t, memory):
    """Whether `t` still views the memory it viewed when recorded as an input (`p.data = ..`
    swaps it without an op the mode sees: then it is a new input)."""
    storage, dtype, offset, shape, stride = memory
    return _untyped_storage(t)._cdata == storage._cdata and t.dtype == dtype and t.storage_offset() == offset and t.shape == shape and t.stride() == stride


def _same_device(t, st):
    """A recording holds tensors of one device, `cpu` or `tpu` (see `tessera._fusion_device`)."""
    dev = t.device.type
    if dev not in ("cpu", "tpu"):
        raise _Unsupported("device")
    if st.device is None or not (st.inputs or st.records):
        st.device = dev
    elif dev != st.device:
        raise _Unsupported("fusion-device-mix")


def _operand(a, st):
    if isinstance(a, torch.Tensor):
        return _node_of(a, st)
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        raise _Unsupported("operand")
    return float(a)


def _strided_node(st, node, x, func, args, kwargs):
    """The value of the view `func(x, *args[1:])` of pending `x` (node `node`), whatever
    x's own strides: the same view of a contiguous meta tensor of x's shape gives its
    shape, strides and offset relative to x's value, recorded as the graph's `strided` op
    (a reshape, a transpose of the last two dims, or a gather of rows and a column window).
    The result stays a real view of the placeholder's memory; in-place ops on a group with
    views are never deferred, so the copy and the memory agree."""
    probe = func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    try:
        return st.graph.op("strided", "as_strided", [node, list(probe.shape), list(probe.stride()), probe.storage_offset()])[0]
    except ValueError as err:
        raise _Unsupported(_rule_of(err)) from None


def _real_strided_node(t, st):
    """A non-contiguous real tensor that is a view of a contiguous real base: the base as a
    graph input and the view as a `strided` node (a transposed weight is then read in place
    by a matmul); None when it is not such a view."""
    b = t._base
    if b is None or not _is_plain_cpu(b) or not b.is_contiguous() or b.dtype != t.dtype or st.entry(b) is not None:
        return None
    hit = st.strided_inputs.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    base_node = _node_of(b, st)
    node = None
    if t.storage_offset() == b.storage_offset() and t.dim() >= b.dim():
        # An expand of the base (HF's causal mask `[s, s]` expanded to `[b, 1, s, s]`): a
        # broadcast the kernels read in place when the graph takes it, not a copy.
        try:
            if b.expand(t.shape).stride() == t.stride():
                node = st.graph.op("expand", "expand", [base_node, list(t.shape)])[0]
        except (RuntimeError, ValueError):
            node = None
    if node is None:
        try:
            node = st.graph.op("strided", "as_strided", [base_node, list(t.shape), list(t.stride()), t.storage_offset() - b.storage_offset()])[0]
        except ValueError:
            return None
    st.strided_inputs[id(t)] = (weakref.ref(t), node)
    return node


def _has_bool_tensor(args, st):
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args)


def _bool_as_float(args, st, op):
    """The operands of add/mul/div of a float tensor and a bool tensor (MoE's
    `weight * mask`): the bool one cast to the float one's dtype (0 or 1, exact), which is
    how torch promotes it, so the result is eager's bit for bit. Anything else with a bool
    tensor (two bools, a Python number) is refused (`fusion-dtype`)."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        raise _Unsupported("fusion-dtype")
    floats = [a.dtype for a in args if a.dtype in (torch.float32, torch.bfloat16)]
    if len(floats) != 1 or not any(a.dtype == torch.bool for a in args):
        raise _Unsupported("fusion-dtype")
    xs = [_node_of(a, st) for a in args]
    return [op("cast", "to", [x, _DTYPES[floats[0]]])[0] if a.dtype == torch.bool else x for x, a in zip(xs, args)]


def _logic(kind, args, st, op):
    """`and`, `or`, `xor` of two tensors and `not` of one, as masking code writes them
    (`a & b`, `a | b`, `~a`, `torch.logical_*`, `mask_a * mask_b`, `mask_a + mask_b`,
    `isfinite`'s decomposition): each operand becomes 0 or 1 in f32 (a bool's cast; for the
    `logical_*` ops also a float's `x != 0`, NaN true as in torch), and the result a compare
    of their product, maximum or difference with 0: exact, and fused instead of run eagerly
    (a flush). `bitwise_*` of non-bool tensors and Python numbers are refused (`fusion-dtype`)."""
    n = 1 if kind == "not" else 2
    if len(args) != n or not all(isinstance(a, torch.Tensor) and a.dtype in _DTYPES for a in args):
        raise _Unsupported("fusion-dtype")
    xs = [_truth(a, st, op) for a in args]
    if kind == "not":
        return op("compare", "eq", [xs[0], 0.0])
    if kind == "xor":
        return _broadcasting_op("compare", "ne", xs, args, st, op)
    v = _broadcasting_op("binary", "mul" if kind == "and" else "maximum", xs, args, st, op)[0]
    return op("compare", "ne", [v, 0.0])


def _any_all(name, args, kw, st, op):
    """`any` / `all` over the last dim, every element (`dim=None`) or none (`dim=()`), of a
    bool or float tensor: each element's truth ([`_truth`]), its row maximum (`any`) or
    minimum (`all`), and a compare with 0, so masking code's `mask.any(-1)` fuses with the
    mask. Other dims, empty tensors and tensors not pending run eagerly."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kw.pop("dim", None)
    keepdim = bool(args[2] if len(args) > 2 else kw.pop("keepdim", False))
    if kw or not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.numel() == 0:
        raise _Unsupported("fusion-dtype" if isinstance(x, torch.Tensor) and x.dtype not in _DTYPES else f"{name}-args")
    if st.entry(x) is None:
        # Its result usually feeds control flow or `nonzero` (a read, so a flush): recorded
        # over a real tensor it would only add a kernel and a flush where eager adds neither
        # (generate()'s stopping criteria, MoE routing's `mask.any(-1)`).
        raise _Unsupported(f"{name}-of-a-real-tensor")
    rank = x.dim()
    n = _truth(x, st, op)
    if isinstance(dims, (list, tuple)) and len(dims) == 0:
        # (`dim=()` reduces over no dims, unlike `sum`'s: each element's truth.)
        return op("compare", "ne", [n, 0.0])
    if dims is None:
        if keepdim and rank != 1:
            raise _Unsupported(f"{name}-keepdim-all")
        if rank != 1:
            n = op("view", "view", [n, [x.numel()]])[0]
    elif not _last_dim(dims, rank):
        raise _Unsupported(f"{name}-dim")
    r = op("row", "amax" if name == "any" else "amin", [n, keepdim])[0]
    return op("compare", "ne", [r, 0.0])


def _truth(a, st, op):
    """Tensor `a`'s elements as 0 or 1 in f32: a bool's cast, a float's `a != 0` (NaN true,
    as in torch)."""
    x = _node_of(a, st)
    if a.dtype != torch.bool:
        x = op("compare", "ne", [x, 0.0])[0]
    return op("cast", "to", [x, "float32"])[0]


def _all_bools(args):
    return all(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args)


# ---- op table: aten overload -> how to record it ------------------------------------------------

_UNARY = {"neg", "abs", "exp", "log", "tanh", "sqrt", "rsqrt", "erf", "sigmoid", "relu", "silu", "reciprocal",
          "sin", "cos", "log1p", "expm1", "floor", "ceil", "round", "sign"}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "maximum": "maximum", "minimum": "minimum", "pow": "pow"}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
# Logic on masks (see `_logic`): and / or / xor of two tensors, not of one.
_LOGIC = {"logical_and": "and", "bitwise_and": "and", "logical_or": "or", "bitwise_or": "or", "logical_xor": "xor", "bitwise_xor": "xor",
          "logical_not": "not", "bitwise_not": "not"}
_ROW = {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin", "_softmax": "softmax", "_log_softmax": "log_softmax"}
_VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "detach", "alias", "expand"}
# Views that move elements between rows: recorded as copies of the group's memory (see
# `_strided_node`), so they do not flush.
_STRIDED_VIEWS = {"t", "transpose", "permute", "slice", "select", "_reshape_alias", "as_strided"}
_VIEWS |= _STRIDED_VIEWS
# Ops that read only their arguments' metadata: they run eagerly on placeholders.
_META_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "randn_like", "rand_like"}


def _bf16_scalars(args, a, b):
    """Torch's CPU add, sub, rsub, pow and comparisons round a Python number to the
    tensor's dtype when that is bf16 (mul and div do not): so do we."""
    t = [x for x in args if isinstance(x, torch.Tensor)]
    if len(t) == 1 and t[0].dtype == torch.bfloat16:
        # (Called inside __torch_dispatch__, where the mode is off.)
        a = float(torch.tensor(a, dtype=torch.bfloat16)) if isinstance(a, float) else a
        b = float(torch.tensor(b, dtype=torch.bfloat16)) if isinstance(b, float) else b
    return a, b


def _leading_scalar_tensor(args, st):
    """Torch's CPU mul and div round a 0-dim f32 tensor that comes *first* beside a bf16
    tensor to bf16 (one that comes second they take at its f32 value, as the engine takes
    both): a real one becomes its bf16-rounded number; a pending one (its value unknown
    until a flush) is refused (`fusion-f32-0dim-times-bf16`)."""
    x, y = args
    if (isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.float32
            and isinstance(y, torch.Tensor) and y.dim() > 0 and y.dtype == torch.bfloat16):
        if st.entry(x) is not None:
            raise _Unsupported("fusion-f32-0dim-times-bf16")
        # (The mode is off here: plain reads.)
        return float(aten._local_scalar_dense.default(aten._to_copy.default(x, dtype=torch.bfloat16))), y
    return args


def _dims_in_range(dims, rank):
    """Whether every dim is one of a rank-`rank` tensor's, each once (else torch raises: the
    op runs eagerly so that it does)."""
    dims = [dims] if isinstance(dims, int) else list(dims)
    return all(-rank <= d < rank for d in dims) and len({d % rank for d in dims}) == len(dims)


def _last_dim(dims, rank):
    if dims is None:
        return False
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    return len(dims) == 1 and rank >= 1 and _dims_in_range(dims, rank) and dims[0] % rank == rank - 1


def _sum_inner_dims(x, dims, keepdim, st, op):
    """`x.sum(dims)` over a run of adjacent dims before the last (GQA repeat_kv's backward,
    `[b, hkv, rep, s, d].sum(2)`): folded into the matmul that computes `x` when the dims
    are its batches (`Graph::sum_matmul_batches`); else `x` viewed `[lead, r, rest]` and summed by a matmul with
    a `[1, r]` row of ones shared by every batch (`[lead, 1, rest]`, f32 accumulation and one
    rounding, as torch's sum): a matmul kernel, not a flush. Other dim sets are refused
    (`sum-dim`)."""
    rank = x.dim()
    if rank == 0 or not _dims_in_range(dims, rank):
        raise _Unsupported("sum-dim")
    ds = sorted({d % rank for d in ([dims] if isinstance(dims, int) else dims)})
    lo, hi = ds[0], ds[-1]
    if ds != list(range(lo, hi + 1)) or hi >= rank - 1:
        raise _Unsupported("sum-dim")
    try:
        # The batches of a pending matmul (GQA's dV, dK): folded into its contraction.
        return op("summatmul", "sum", [_node_of(x, st), lo, hi, keepdim])
    except _Unsupported:
        pass
    shape = list(x.shape)
    lead, r, rest = math.prod(shape[:lo]), math.prod(shape[lo:hi + 1]), math.prod(shape[hi + 1:])
    ones = _node_of(torch.ones((1, r), dtype=x.dtype), st)
    n = op("view", "view", [_node_of(x, st), [lead, r, rest]])[0]
    s = op("matmul", "mm", [ones, n, None])[0]
    out = shape[:lo] + ([1] * (hi + 1 - lo) if keepdim else []) + shape[hi + 1:]
    return op("view", "view", [s, out])


def _joined_slice_grads(args, st, op):
    """`slice_backward(g1, .., 0, c) + slice_backward(g2, .., c, n)` (the gradients of
    the two halves of a last dim, as RoPE's rotate_half's backward): `cat(g1, g2)`, one row-kernel
    node instead of two and an add (adding the zeros is exact: only a -0.0 keeps its sign).
    None when the operands are not such a pair."""
    x, y = args
    if not all(isinstance(t, torch.Tensor) and st.entry(t) is not None for t in args) or x.shape != y.shape or x.dtype != y.dtype:
        return None
    a, b = st.slice_grads.get(st.entry(x)[1]), st.slice_grads.get(st.entry(y)[1])
    if a is None or b is None:
        return None
    a, b = sorted((a, b))
    if not a[0] == 0 < a[1] == b[0] < b[1] == x.shape[-1]:
        return None
    return op("cat", "cat", [[a[2], b[2]]])


def _broadcasting_op(kind, nm, xs, args, st, op):
    """`op(kind, nm, xs)`; when the graph refuses a broadcast over inner leading dims
    (`fusion-broadcast-rows`: a mask `[b, 1, s, s]` plus scores `[b, h, s, s]`), the
    operand that broadcasts so is first expanded by a gather copy (a stride-0 view of its
    memory) to the result's shape, so the op fuses instead of flushing; a broadcast over the
    last dim too stays refused."""
    try:
        return op(kind, nm, xs)
    except _Unsupported as err:
        if str(err) != "fusion-broadcast-rows":
            raise
    out = list(torch.broadcast_shapes(*(t.shape for t in args if isinstance(t, torch.Tensor))))
    ys = []
    for x, t in zip(xs, args):
        if isinstance(t, torch.Tensor) and list(t.shape) != out:
            padded = [1] * (len(out) - t.dim()) + list(t.shape)
            if padded[-1] != out[-1]:
                raise _Unsupported("fusion-broadcast-rows")
            strides, step = [], 1
            for d in reversed(padded):
                strides.append(step)
                step *= d
            strides = [0 if p == 1 and o != 1 else st_ for p, o, st_ in zip(padded, out, reversed(strides))]
            try:
                x = op("strided", "as_strided", [x, out, strides, 0])[0]
            except _Unsupported:
                raise _Unsupported("fusion-broadcast-rows") from None
        ys.append(x)
    return op(kind, nm, ys)


def _record(func, name, args, kwargs, st):
    """Records one out-of-place op; returns its node. Raises _Unsupported."""
    g = st.graph
    kw = dict(kwargs)

    def op(kind, nm, xs):
        try:
            return g.op(kind, nm, xs)
        except ValueError as err:
            raise _Unsupported(_rule_of(err)) from None

    if name in _UNARY:
        if len(args) != 1 or kw:
            raise _Unsupported(f"{name}-args")
        return op("unary", name, [_node_of(args[0], st)])
    if name == "gelu":
        if kw.get("approximate", "none") != "none":
            raise _Unsupported("gelu-tanh")
        return op("unary", "gelu", [_node_of(args[0], st)])
    if name in ("add", "sub", "rsub"):
        alpha = kw.pop("alpha", 1)
        if kw or len(args) != 2 or alpha != 1:
            raise _Unsupported(f"{name}-alpha")
        if _has_bool_tensor(args, st):
            if name != "add":  # (torch refuses to subtract a bool tensor)
                raise _Unsupported("fusion-dtype")
            if _all_bools(args):  # bool + bool is bool: or
                return _logic("or", args, st, op)
            return _broadcasting_op("binary", name, _bool_as_float(args, st, op), args, st, op)
        if name == "add":
            joined = _joined_slice_grads(args, st, op)
            if joined is not None:
                return joined
        a, b = _bf16_scalars(args, _operand(args[0], st), _operand(args[1], st))
        if name == "rsub":
            return _broadcasting_op("binary", "sub", [b, a], [args[1], args[0]], st, op)
        return _broadcasting_op("binary", name, [a, b], args, st, op)
    if name in _BINARY:
        if kw or len(args) != 2:
            raise _Unsupported(f"{name}-args")
        if _has_bool_tensor(args, st):
            if name not in ("mul", "div"):
                raise _Unsupported("fusion-dtype")
            if name == "mul" and _all_bools(args):  # bool * bool is bool: and
                return _logic("and", args, st, op)
            return _broadcasting_op("binary", _BINARY[name], _bool_as_float(args, st, op), args, st, op)
        if name in ("mul", "div"):
            args = _leading_scalar_tensor(args, st)
        a, b = _operand(args[0], st), _operand(args[1], st)
        if name == "pow":
            a, b = _bf16_scalars(args, a, b)
        return _broadcasting_op("binary", _BINARY[name], [a, b], args, st, op)
    if name in _LOGIC:
        if kw or (name.startswith("bitwise") and not _all_bools(args)):
            raise _Unsupported("fusion-dtype")
        return _logic(_LOGIC[name], args, st, op)
    if name in _COMPARE:
        if kw or len(args) != 2:
            raise _Unsupported(f"{name}-args")
        if _has_bool_tensor(args, st):
            raise _Unsupported("fusion-dtype")
        a, b = _bf16_scalars(args, _operand(args[0], st), _operand(args[1], st))
        return op("compare", name, [a, b])
    if name == "where":
        if kw or len(args) != 3 or not isinstance(args[0], torch.Tensor):
            raise _Unsupported("where-args")
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:]):
            raise _Unsupported("fusion-dtype")
        return op("where", "where", [_node_of(args[0], st), _operand(args[1], st), _operand(args[2], st)])
    if name in ("clamp", "clamp_min", "clamp_max"):
        if name == "clamp":
            lo = args[1] if len(args) > 1 else kw.pop("min", None)
            hi = args[2] if len(args) > 2 else kw.pop("max", None)
        elif name == "clamp_min":
            lo, hi = args[1], None
        else:
            lo, hi = None, args[1]
        if kw or isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor) or isinstance(lo, bool) or isinstance(hi, bool):
            raise _Unsupported("clamp-args")
        return op("clamp", "clamp", [_node_of(args[0], st), None if lo is None else float(lo), None if hi is None else float(hi)])
    if name == "_to_copy":
        dtype = kw.pop("dtype", None)
        dev = kw.pop("device", None)
        kw.pop("non_blocking", None)
        layout = kw.pop("layout", None)
        pin = kw.pop("pin_memory", None)
        mf = kw.pop("memory_format", None)
        if kw or len(args) != 1 or (dev is not None and torch.device(dev).type != args[0].device.type) or layout not in (None, torch.strided) or pin or mf not in (None, torch.preserve_format, torch.contiguous_format):
            raise _Unsupported("to-args")
        dtype = args[0].dtype if dtype is None else dtype
        if dtype not in _DTYPES:
            raise _Unsupported("fusion-dtype")
        return op("cast", "to", [_node_of(args[0], st), _DTYPES[dtype]])
    if name == "clone":
        mf = kw.pop("memory_format", None)
        if kw or mf not in (None, torch.preserve_format, torch.contiguous_format):
            raise _Unsupported("clone-args")
        return op("cast", "to", [_node_of(args[0], st), _DTYPES.get(args[0].dtype, "?")])
    if name in ("any", "all"):
        return _any_all(name, args, kw, st, op)
    if name in _ROW:
        x = args[0]
        rank = x.dim()
        if name in ("_softmax", "_log_softmax"):
            if len(args) != 3 or args[2] or kw or not _last_dim(args[1], rank):
                raise _Unsupported(f"{name}-dim")
            return op("row", _ROW[name], [_node_of(x, st), True])
        dims = args[1] if len(args) > 1 else kw.pop("dim", None)
        keepdim = bool(args[2] if len(args) > 2 else kw.pop("keepdim", False))
        if kw.pop("dtype", None) is not None or kw:
            raise _Unsupported(f"{name}-dtype")
        if x.dtype == torch.bool:
            raise _Unsupported("fusion-dtype")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            # Over every element: the row op of the flattened tensor.
            if keepdim and rank != 1:  # (a 0-d tensor's stays 0-d: eagerly)
                raise _Unsupported(f"{name}-keepdim-all")
            n = _node_of(x, st)
            if rank != 1:
                n = op("view", "view", [n, [x.numel()]])[0]
            return op("row", _ROW[name], [n, keepdim])
        if name == "sum" and rank >= 2 and _dims_in_range(dims, rank) and sorted(d % rank for d in ([dims] if isinstance(dims, int) else dims)) == list(range(rank - 1)):
            # Over every dim but the last: a column sum (bias and norm-weight gradients).
            return op("colsum", "sum", [_node_of(x, st), keepdim])
        if name == "sum" and not _last_dim(dims, rank):
            return _sum_inner_dims(x, dims, keepdim, st, op)
        if not _last_dim(dims, rank):
            raise _Unsupported(f"{name}-dim")
        return op("row", _ROW[name], [_node_of(x, st), keepdim])
    if name in ("mm", "bmm"):
        if kw or len(args) != 2:
            raise _Unsupported(f"{name}-args")
        return op("matmul", name, [_node_of(args[0], st), _node_of(args[1], st), None])
    if name == "addmm":
        beta, alpha = kw.pop("beta", 1), kw.pop("alpha", 1)
        if kw or len(args) != 3 or beta != 1 or alpha != 1 or not isinstance(args[0], torch.Tensor):
            raise _Unsupported("addmm-scale")
        bias, a, b = args
        if bias.dim() == 1 and bias.dtype == a.dtype:
            # linear's bias: added in f32 before the one rounding, as torch's addmm.
            return op("matmul", "addmm", [_node_of(a, st), _node_of(b, st), _node_of(bias, st)])
        mm = op("matmul", "addmm", [_node_of(a, st), _node_of(b, st), None])[0]
        return op("binary", "add", [_node_of(bias, st), mm])
    if name == "cat":
        xs = args[0]
        dim = args[1] if len(args) > 1 else kw.pop("dim", 0)
        full = [t for t in xs if isinstance(t, torch.Tensor) and t.numel() > 0]
        if not kw and len(full) == 1 and all(isinstance(t, torch.Tensor) and t.dtype == full[0].dtype for t in xs) and full[0].dtype in _DTYPES:
            # Empty pieces beside one (HF's DynamicCache appending to an empty cache, over
            # any dim): a copy of that piece.
            return op("cast", "to", [_node_of(full[0], st), _DTYPES[full[0].dtype]])
        if kw or not xs or not all(isinstance(t, torch.Tensor) for t in xs) or not _last_dim(dim, xs[0].dim()):
            raise _Unsupported("cat-dim")
        return op("cat", "cat", [[_node_of(t, st) for t in xs]])
    if name == "slice_backward":
        # The gradient of `x[..., a:b]`: zeros, the gradient, zeros, as a cat over the last dim.
        grad, sizes, dim, start, end, step = args
        rank = len(sizes)
        if kw or step != 1 or rank == 0 or dim % rank != rank - 1 or grad.dtype not in (torch.float32, torch.bfloat16):
            raise _Unsupported("slice_backward-dim")
        cols = sizes[-1]
        start = min(max(start + cols if start < 0 else start, 0), cols)
        end = min(max(end + cols if end < 0 else end, start), cols)
        zero = _node_of(torch.zeros((), dtype=grad.dtype), st)
        lead = list(sizes[:-1])
        pieces = [op("expand", "expand", [zero, lead + [start]])[0]] if start > 0 else []
        pieces.append(_node_of(grad, st))
        if end < cols:
            pieces.append(op("expand", "expand", [zero, lead + [cols - end]])[0])
        out = op("cat", "cat", [pieces])
        st.slice_grads[out[0]] = (start, end, pieces[1 if start > 0 else 0])
        return out
    if name == "select_backward":
        return _select_backward(args, kw, st, op)
    if name in _BACKWARD:
        return _record_backward(name, args, kw, st, op)
    raise _Unsupported(name)


def _select_backward(args, kw, st, op):
    """The gradient of `x.select(dim, i)` (MoE's `w1[e]`) for a leading `dim`: zeros but at
    `i`, as `where(m, grad, 0)` with `m` a host-made bool column `[.., 1]` true on `i`'s
    rows and `grad` unsqueezed at `dim` (read periodically for `dim` 0; a `dim` between
    leading dims is an inner broadcast, refused). Exact: each element is the gradient's
    or +0.0, as torch's zeros."""
    grad, sizes, dim, index = args
    rank = len(sizes)
    if kw or rank < 2 or grad.dtype not in (torch.float32, torch.bfloat16):
        raise _Unsupported("select_backward-args")
    dim %= rank
    if dim == rank - 1:
        raise _Unsupported("select_backward-dim")
    index %= sizes[dim]
    mask = torch.zeros(list(sizes[:-1]) + [1], dtype=torch.bool)
    mask.select(dim, index).fill_(True)
    g = op("view", "view", [_node_of(grad, st), list(sizes[:dim]) + [1] + list(sizes[dim + 1:])])[0]
    return op("where", "where", [_node_of(mask, st), g, 0.0])


_BACKWARD = {"tanh_backward", "sigmoid_backward", "threshold_backward", "silu_backward", "gelu_backward",
             "_softmax_backward_data", "_log_softmax_backward_data"}


def _record_backward(name, args, kw, st, op):
    """Autograd's pointwise and row backward ops, as graph nodes (the formulas of
    torch's derivatives.yaml), computed in f32 and rounded once to the result's dtype as
    torch's kernels do."""
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
    if dtypes - {torch.float32, torch.bfloat16}:
        raise _Unsupported("fusion-dtype")
    out_dtype = args[0].dtype
    node = _record_backward_f32(name, args, kw, st, op)
    if out_dtype != torch.float32:
        node = op("cast", "to", [node[0], _DTYPES[out_dtype]])
    return node


def _record_backward_f32(name, args, kw, st, op):
    def f32(t):
        n = _node_of(t, st)
        return op("cast", "to", [n, "float32"])[0] if t.dtype != torch.float32 else n

    def b(nm, x, y):
        return op("binary", nm, [x, y])[0]

    def u(nm, x):
        return op("unary", nm, [x])[0]

    g = f32(args[0])
    if name == "tanh_backward":  # grad * (1 - out^2)
        o = f32(args[1])
        return op("binary", "mul", [g, b("sub", 1.0, b("mul", o, o))])
    if name == "sigmoid_backward":  # grad * out * (1 - out)
        o = f32(args[1])
        return op("binary", "mul", [b("mul", g, o), b("sub", 1.0, o)])
    if name == "threshold_backward":  # where(self <= threshold, 0, grad)
        x = f32(args[1])
        c = op("compare", "le", [x, float(args[2])])[0]
        return op("where", "where", [c, 0.0, g])
    if name == "silu_backward":  # grad * s * (1 + x * (1 - s)), s = sigmoid(x)
        x = f32(args[1])
        sg = u("sigmoid", x)
        return op("binary", "mul", [b("mul", g, sg), b("add", 1.0, b("mul", x, b("sub", 1.0, sg)))])
    if name == "gelu_backward":  # grad * (cdf(x) + x * pdf(x))
        if kw.pop("approximate", args[2] if len(args) > 2 else "none") != "none" or kw:
            raise _Unsupported("gelu-tanh")
        x = f32(args[1])
        cdf = b("mul", b("add", u("erf", b("mul", x, 0.7071067811865476)), 1.0), 0.5)
        pdf = b("mul", u("exp", b("mul", b("mul", x, x), -0.5)), 0.3989422804014327)
        return op("binary", "mul", [g, b("add", cdf, b("mul", x, pdf))])
    if name in ("_softmax_backward_data", "_log_softmax_backward_data"):
        out, dim, in_dtype = args[1], args[2], args[3]
        if not _last_dim(dim, out.dim()) or in_dtype != out.dtype:
            raise _Unsupported(f"{name}-dim")
        o = f32(out)
        if name == "_softmax_backward_data":  # out * (grad - sum(grad * out))
            s_ = op("row", "sum", [b("mul", g, o), True])[0]
            return op("binary", "mul", [o, b("sub", g, s_)])
        s_ = op("row", "sum", [g, True])[0]  # grad - exp(out) * sum(grad)
        return op("binary", "sub", [g, b("mul", u("exp", o), s_)])
    raise _Unsupported(name)


_OP_INFO: dict = {}


def _op_info(func):
    """(name, base name, in place, mutable, composite) of an aten overload, read from its
    schema once (reading `_schema` costs ~3 us, a third of recording an op)."""
    info = _OP_INFO.get(func)
    if info is None:
        schema = func._schema
        name = schema.name.split("::")[-1]  # "add", "add_", "_softmax", ...
        first = schema.arguments[0] if schema.arguments else None
        inplace = name.endswith("_") and not name.startswith("_") and first is not None and first.alias_info is not None and first.alias_info.is_write
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        # Only a decomposition (`reshape`, `linear`): ops with kernels of their own (`silu_backward`
        # has both) are taken whole, as outside inference mode.
        composite = has(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd) and not has(func.name(), torch._C.DispatchKey.CPU)
        info = _OP_INFO[func] = (name, name[:-1] if inplace else name, inplace, schema.is_mutable, composite)
    return info


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """`torch.var_mean` over a trailing run of dims in recordable ops, in f32 (a bf16 `x`
    rounded once at the end, as torch's), shifted by each row's maximum: `d = x - x0`,
    then the mean-free sum of squares of `d`. A constant row gives variance 0 and mean `x0`
    exactly (a plain `sum / n` is off by rounding, which LayerNorm's `rsqrt(var + 1e-12)`
    magnified to 0.43 where eager gives 0), and a large mean beside a small spread loses
    nothing (1e6 + N(0, 1): 3e-3 of error before). The maximum, not the first element: a
    row reduction stays in the row kernel, where a column slice of a computed `x` (a bf16
    input's cast, a residual sum) made the planner store `x` first (two kernels). A row
    whose shifted mean is not finite (an inf) takes the plain mean, as torch's. Other dims:
    NotImplemented (eagerly)."""
    rank = x.dim()
    dims = sorted({d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])}) if dim is not None and rank else list(range(rank))
    if not dims or dims != list(range(rank - len(dims), rank)) or x.numel() == 0:
        return NotImplemented
    n = math.prod(x.shape[d] for d in dims)
    lead = list(x.shape[: rank - len(dims)])
    xf = x.float().reshape(lead + [n])
    x0 = xf.amax(-1, keepdim=True)
    d = xf - x0
    md = d.mean(-1, keepdim=True)
    e = d - md
    var = (e * e).sum(-1, keepdim=True) / max(n - (1 if correction is None else correction), 0)
    # A sum of squares of finite values that overflows (|x| ~ 1e20 in f32) is NaN, as eager's
    # (whose update overflows to inf - inf): never inf, which LayerNorm's rsqrt made 0s.
    var = torch.where(var == math.inf, math.nan, var)
    mean = torch.where(md.isfinite(), x0 + md, xf.mean(-1, keepdim=True))
    shape = lead + [1] * len(dims) if keepdim else lead
    return var.reshape(shape).to(x.dtype), mean.reshape(shape).to(x.dtype)


def _norms():
    """Ops the mode takes as their decompositions: LayerNorm and its backward (torch's own, as
    Inductor lowers them: row means, `rsqrt`, column sums), whose `var_mean` is
    [`_var_mean`]; so a LayerNorm fuses as RMSNorm does instead of running eagerly."""
    from torch._decomp import decomposition_table

    table = {aten.var_mean.correction: _var_mean, aten.var.correction: lambda *a, **k: _first(_var_mean(*a, **k)),
             aten.std_mean.correction: lambda *a, **k: _sqrt_first(_var_mean(*a, **k)),
             aten.std.correction: lambda *a, **k: _first(_sqrt_first(_var_mean(*a, **k)))}
    for op in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default):
        if op in decomposition_table:
            table[op] = decomposition_table[op]
    return table


# Where a LayerNorm's weight and bias are in its arguments.
_NORM_PARAMS = {aten.native_layer_norm.default: slice(2, 4), aten.native_layer_norm_backward.default: slice(5, 7)}


def _params_match(func, args):
    """Whether a LayerNorm's weight and bias have its input's dtype. Eager's CPU kernel
    raises on an f32 input with bf16 parameters ("mixed dtype"): such a call runs eagerly,
    so that it does."""
    at = _NORM_PARAMS.get(func)
    return at is None or all(p is None or p.dtype == args[0].dtype for p in args[at])


def _first(out):
    return out if out is NotImplemented else out[0]


def _sqrt_first(out):
    return out if out is NotImplemented else (out[0].sqrt(), out[1])


_NORMS = _norms()


class _DeferMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with _lock:
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        name, base, inplace, mutable, composite = _op_info(func)
        if composite:
            # Under `torch.inference_mode()` composite ops (`reshape`, `linear`, `softmax`,
            # ...) reach the mode whole, where autograd would have decomposed them: decompose
            # them here, so the mode sees the ops it sees everywhere else (a `reshape` that
            # must copy is a `clone`, not a view of the placeholder's memory).
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        norm = _NORMS.get(func)
        if norm is not None and args and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.float32, torch.bfloat16) and _params_match(func, args):
            with self:
                out = norm(*args, **kwargs)
            if out is not NotImplemented:
                return out
        st = _state
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        pending = []
        for t in tensors:
            if st.entry(t) is not None:
                pending.append(t)
            elif st.storages and _storage_key(t) in st.storages:
                # An alias of a placeholder made outside the dispatcher: its value first.
                _flush("alias-of-pending")
                st, pending = _state, []
                break

        if func is aten._local_scalar_dense.default:
            if pending:
                _flush("item")
            return func(*args, **kwargs)
        if base in _META_ONLY and not inplace:
            return func(*args, **kwargs)
        if base in _VIEWS and not inplace and args and isinstance(args[0], torch.Tensor) and st.entry(args[0]) is not None:
            try:
                return self._view(func, base, args, kwargs, st)
            except _Unsupported as why:
                return self._eager(func, args, kwargs, f"{base}:{why}", pending)
        if inplace or (base == "copy" and name == "copy_"):
            return self._inplace(func, name, base, args, kwargs, st, pending)
        if mutable or "out" in kwargs:
            return self._eager(func, args, kwargs, f"mutating:{name}", pending, writes=tensors)
        if not tensors:
            return func(*args, **kwargs)
        try:
            # A fresh start on an unsupported op of real tensors: no need to record.
            if not pending and not _recordable(base):
                raise _Unsupported(base)
            node, shape, dtype = _record(func, base, args, kwargs, st)
        except _Unsupported as why:
            return self._eager(func, args, kwargs, f"{why}" if str(why) != base else f"op:{base}", pending)
        return self._result(func, args, kwargs, node, shape, dtype, st)

    # -- helpers --

    def _result(self, func, args, kwargs, node, shape, dtype, st):
        # Inside __torch_dispatch__ the mode is off already: a plain allocation.
        out = _fusion_device.placeholder(shape, _TORCH_DTYPES[dtype], st.device)
        grp = _Group(node, tuple(shape), _TORCH_DTYPES[dtype], _untyped_storage(out))
        owner = weakref.ref(out, grp.owner_died(st.storages))
        grp.members.append(owner)
        st.groups.append(grp)
        st.storages[grp.storage._cdata] = grp
        st.pending[id(out)] = (owner, node, grp)
        st.records.append((func, _template(args, st), _template(kwargs, st), node, None))
        _count_op(st, func)
        return out

    def _view(self, func, base, args, kwargs, st):
        if func is aten.view.dtype:
            raise _Unsupported("view-dtype")  # a reinterpretation of the bits: eagerly
        x = args[0]
        e = st.entry(x)
        out = func(*args, **kwargs)  # the real view of the placeholder (the mode is off here)
        grp = e[2]
        if base == "expand":
            try:
                node = st.graph.op("expand", "expand", [e[1], list(out.shape)])[0]
            except ValueError:
                # An expand over inner dims (repeat_kv's): a copy of the stride-0 view.
                node = _strided_node(st, e[1], x, func, args, kwargs)
        elif x.is_contiguous() and out.is_contiguous() and out.numel() == x.numel():
            try:
                node = st.graph.op("view", "view", [e[1], list(out.shape)])[0]
            except ValueError as err:
                raise _Unsupported(_rule_of(err)) from None
        else:
            node = _strided_node(st, e[1], x, func, args, kwargs)
        grp.members.append(weakref.ref(out))
        st.pending[id(out)] = (weakref.ref(out), node, grp)
        st.records.append((func, _template(args, st), _template(kwargs, st), node, None))
        _count_op(st, func)
        return out

    def _inplace(self, func, name, base, args, kwargs, st, pending):
        target = args[0]
        e = st.entry(target)
        if e is None:
            # A write to real memory: flush first if the pending graph reads it.
            return self._eager(func, args, kwargs, f"inplace-on-real:{name}", pending, writes=[target])
        grp = e[2]
        if len(grp.alive()) != 1 or grp.members[0]() is not target:
            return self._eager(func, args, kwargs, f"inplace-alias:{name}", pending, cause=f"inplace-alias:{name}")
        if base in ("squeeze", "unsqueeze"):
            # `x1d @ w` ends in `squeeze_` of the product: a view of the same memory, in place.
            record = (func, _template(args, st), _template(kwargs, st))
            func(*args, **kwargs)  # the placeholder's sizes (its memory is untouched)
            node = st.graph.op("view", "view", [e[1], list(target.shape)])[0]
            st.records.append(record + (node, e[1]))
            grp.root = node
            st.pending[id(target)] = (e[0], node, grp)
            _count_op(st, func)
            return target
        try:
            if name == "copy_":
                src = args[1]
                if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(target.shape) or len(args) > 2 and args[2]:
                    raise _Unsupported("copy-broadcast")
                node, shape, dtype = st.graph.op("cast", "to", [_node_of(src, st), _DTYPES.get(target.dtype, "?")])
            else:
                node, shape, dtype = _record(func, base, args, kwargs, st)
                if not torch.can_cast(_TORCH_DTYPES[dtype], target.dtype):
                    raise _Unsupported("inplace-cast")  # torch refuses it: eagerly, it raises
                if _TORCH_DTYPES[dtype] != target.dtype:
                    node, shape, dtype = st.graph.op("cast", "to", [node, _DTYPES[target.dtype]])
            if tuple(shape) != tuple(target.shape):
                raise _Unsupported("inplace-broadcast")
        except ValueError as err:
            return self._eager(func, args, kwargs, _rule_of(err), pending, cause=f"eager-op:{name}")
        except _Unsupported as why:
            reason = f"op:{name}" if str(why) == base else str(why)
            return self._eager(func, args, kwargs, reason, pending, cause=f"eager-op:{name}")
        # The template first: every use of the target in the op (`y.add_(y)`) is its value before.
        st.records.append((func, _template(args, st), _template(kwargs, st), node, e[1]))
        grp.root = node
        st.pending[id(target)] = (e[0], node, grp)
        _count_op(st, func)
        return target

    def _eager(self, func, args, kwargs, reason, pending, writes=(), cause=None):
        st = _state
        _stats["ops_eager"] += 1
        _stats["eager_reasons"][reason] += 1
        if pending:
            _flush(cause or f"eager-op:{func._schema.name.split('::')[-1]}")
        elif writes and st.records:
            ptrs = {_storage_ptr(w) for w in writes}
            if ptrs & st.input_storages:
                _flush(cause or f"input-written:{func._schema.name.split('::')[-1]}")
        return func(*args, **kwargs)


def _recordable(base):
    return base in _UNARY or base in _BINARY or base in _COMPARE or base in _LOGIC or base in _ROW or base in ("any", "all") or base in (
        "gelu", "rsub", "where", "clamp", "clamp_min", "clamp_max", "_to_copy", "clone", "mm", "bmm", "addmm", "cat", "slice_backward",
        "select_backward") or base in _BACKWARD


def _count_op(st, func):
    _stats["ops_deferred"] += 1
    if st.ops == 0:
        st.max_ops = _max_ops()  # read once per recording
    st.ops += 1
    period = _loop.step(func)
    if period and st.ops + period > st.max_ops:
        _flush("loop")  # at a loop boundary, when the next iteration would pass the cap
    elif st.ops >= st.max_ops:
        _flush("size-cap")


class _LoopDetector:
    """The loop heuristic: finds a period in the stream of deferred ops' fingerprints (the
    aten overload), across flushes, in O(1) per op. A candidate period is the distance to
    the previous op of the same fingerprint; it is confirmed once a whole period repeats
    the one before it (`run` ops in a row equal to the op `period` before). After that,
    every `period` ops is a loop boundary (`step` returns the period there, else 0); a
    mismatch drops the loop. Only the op sequence decides, never timing."""

    MAX_PERIOD = 4096

    def __init__(self):
        self.n = 0
        self.ring = [None] * self.MAX_PERIOD
        self.last = {}
        self.period = 0
        self.run = 0

    def step(self, fp):
        i, ring, cap = self.n, self.ring, self.MAX_PERIOD
        self.n = i + 1
        p = self.period
        if p and ring[(i - p) % cap] == fp:
            self.run += 1
        else:
            j = self.last.get(fp)
            self.period = p = i - j if j is not None and i - j < cap else 0
            self.run = 1 if p else 0
        self.last[fp] = i
        ring[i % cap] = fp
        if p and self.run >= p and self.run % p == 0:
            _stats["loop_boundaries"] += 1
            return p
        return 0


_loop = _LoopDetector()


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


class _NodeRef:
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


def _template(obj, st):
    """`obj` with pending tensors and graph inputs replaced by their nodes (for the replay)."""

    def sub(a):
        if isinstance(a, torch.Tensor):
            e = st.entry(a)
            if e is not None:
                return _NodeRef(e[1])
            n = st.input_nodes.get(id(a))
            if n is not None and st.inputs[n[1]] is a:
                return _NodeRef(n[0])
            return a
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    if isinstance(obj, dict):
        return {k: sub(v) for k, v in obj.items()}
    return tuple(sub(a) for a in obj)


@contextlib.contextmanager
def _no_dispatch():
    with _disable_current_modes():
        yield


# ---- flush ----------------------------------------------------------------------------------------


def _storage_tensor(grp):
    """A contiguous tensor over the group's memory, of the root's shape; None when nobody
    but the group holds the memory (nobody can read the value: it is never written)."""
    owner = grp.members[0]()
    if owner is not None and grp.storage is not None and _storage_key(owner) == grp.storage._cdata:
        return owner
    if not grp.held():
        return None
    t = torch.empty(0, dtype=grp.dtype, device=grp.storage.device)
    t.set_(grp.storage, 0, grp.shape)
    return t


def _input_tensors(st):
    """The inputs as recorded: an input whose memory was swapped since (`p.data = ...`, not
    an op the mode sees) is read from the memory the recorded op read, as eager did."""
    out = []
    for t, memory in zip(st.inputs, st.input_memory):
        if not _same_memory(t, memory):
            storage, dtype, offset, shape, stride = memory
            t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
        out.append(t)
    return out


def _flush(cause):
    """Runs the pending graph; `cause` is counted in `stats()["flush_causes"]`."""
    with _lock:
        _flush_now(cause)


def _flush_now(cause):
    global _state, _flush_count
    st = _state
    if not st.records:
        return
    _state = _State()
    _stats["flushes"] += 1
    _stats["flush_causes"][cause] += 1
    with _no_dispatch(), torch.no_grad():
        live, outs, dsts = [], [], []
        for grp in st.groups:
            dst = _storage_tensor(grp)
            if dst is None:
                continue
            _fusion_device.materialize(dst)  # memory only for what somebody holds
            live.append(grp.root)
            dsts.append(dst)
            outs.append(dst.view(torch.int8) if dst.dtype == torch.bool else dst)
        st.inputs = _input_tensors(st)
        ins = [t.view(torch.int8) if t.dtype == torch.bool and t.is_contiguous() else (t.contiguous().view(torch.int8) if t.dtype == torch.bool else t) for t in st.inputs]
        dump = None
        d = os.environ.get("TESSERA_DUMP_FUSION")
        if d:
            os.makedirs(d, exist_ok=True)
            _flush_count += 1
            dump = os.path.join(d, f"flush_{_flush_count:05d}.txt")
        if not live:
            return
        if _churning(str(st.graph), live):
            _stats["shape_churn"] += 1
            _aside.churn_events += 1
            _replay(st, live, dsts)
            return
        try:
            r = _run_graph(st, live, ins, outs, dump)
            _stats["kernels_launched"] += r["kernels"]
            _stats["results_written"] += len(live)
            _stats["temporaries"] += r["temps"]
            _stats["cache_hits" if r["hit"] else "cache_misses"] += 1
        except Exception as err:  # noqa: BLE001 (any failure: run the ops as eager would)
            _stats["fallbacks"].append(f"{cause}: {err}")
            _replay(st, live, dsts)


def _run_graph(st, live, ins, outs, dump):
    """The program on the recording's device: natively on the CPU, else through the device's
    execution path (`tessera._fusion_device`)."""
    from tessera._ops import get_target

    if _fusion_device.takes(st.device):
        r = _fusion_device.run(st.graph, live, ins, outs, get_target(), dump, st.device)
    else:
        r = st.graph.run(live, ins, outs, get_target(), dump)
    _fusion_device.write_modules(st.graph, live)
    return r


def _replay(st, live, dsts):
    """Runs the recorded ops eagerly (a program that could not be built) into the live memory."""
    env = dict(zip(st.input_node_ids, st.inputs))

    def sub(a):
        if isinstance(a, _NodeRef):
            return env[a.node]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    for func, args, kwargs, node, before in st.records:
        a = tuple(sub(x) for x in args)
        kw = {k: sub(v) for k, v in kwargs.items()}
        if before is not None:
            # An in-place op: on a copy, so that the value of `before` stays what it was.
            a = (a[0].clone(),) + a[1:]
            func(*a, **kw)
            env[node] = a[0]
        else:
            out = func(*a, **kw)
            # The ops were recorded against contiguous placeholders (views and `as_strided`
            # included): give their replay the same layouts (eager's `x * 2` of a transposed
            # `x` keeps its layout, where a recorded `view` would then fail).
            if isinstance(out, torch.Tensor) and _op_info(func)[1] not in _VIEWS and not out.is_contiguous():
                out = out.contiguous()
            env[node] = out
    for n, dst in zip(live, dsts):
        dst.data.copy_(env[n].reshape(dst.shape))


def flush() -> None:
    """Runs everything recorded so far (cause `explicit`); a mode stepped aside comes back."""
    _flush("explicit")
    _step_back()


# ---- stepping aside for churning modules -------------------------------------------------------


class _Aside(threading.local):
    """Whether this thread's mode is stepped aside now (torch's dispatch mode stack is per
    thread, and so is the mode)."""

    def __init__(self):
        self.active = False  # the dispatch mode is popped
        self.depth = 0  # module calls in progress (only the outermost one decides)
        self.churn_events = 0
        self.stack_depth = 0  # the dispatch mode stack's depth when the mode stepped aside


_aside = _Aside()
_churning_modules = weakref.WeakSet()  # modules a call of which churned (for the process)


def _step_aside():
    """Flushes and pops the dispatch mode: ops run strictly, at eager's cost."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _aside.active or _mode.obj is None or _get_current_dispatch_mode() is not _mode.obj:
        return  # (another mode above ours: stay, popping would reorder the stack)
    _flush("step-aside")
    _mode.obj.__exit__(None, None, None)
    _aside.active = True
    _aside.stack_depth = torch._C._len_torch_dispatch_stack()
    _stats["stepped_aside"] += 1


def _step_back():
    # Only onto the stack it left: pushed above a mode the user entered meanwhile, leaving
    # that mode's `with` would pop ours instead (it comes back once that mode is gone).
    if _aside.active and torch._C._len_torch_dispatch_stack() == _aside.stack_depth:
        _aside.active = False
        _mode.obj.__enter__()


def _wrap_module_call(orig):
    def call(self, *a, **k):
        if _aside.depth or _mode.obj is None:
            return orig(self, *a, **k)  # a submodule (its outermost call decided), or strict
        if self in _churning_modules:
            _step_aside()  # and stay aside after it, until a trigger brings the mode back
        else:
            _step_back()
        before = _aside.churn_events
        _aside.depth = 1
        try:
            return orig(self, *a, **k)
        finally:
            _aside.depth = 0
            if _aside.churn_events != before:
                _churning_modules.add(self)

    return call


# ---- the mode -------------------------------------------------------------------------------------

class _ThreadMode(threading.local):
    """This thread's eager mode and its dispatch mode object (torch's dispatch mode stack is
    per thread: a thread that enters the mode defers its own ops only)."""

    def __init__(self):
        self.current = EagerMode.STRICT
        self.obj = None


_mode = _ThreadMode()
# One recording for the process: ops recorded and flushes (a reader in another thread
# flushes too) take turns, so no flush runs a graph while another thread appends to it.
_lock = threading.RLock()


def _flush_if_pending(t, cause):
    """Flushes when `t` is a pending tensor, or any tensor over a placeholder's memory (a view,
    an alias), from any thread; one check when nothing is pending."""
    if _state.storages:
        with _lock:
            if _state.storages and _storage_key(t) in _state.storages:
                _flush_now(cause)


def _wrap_reader(name, cause):
    orig = getattr(torch.Tensor, name)

    def reader(self, *a, **k):
        _flush_if_pending(self, cause)
        return orig(self, *a, **k)

    reader.__name__ = name
    return reader


def _flushing_to_dlpack(orig):
    """`torch.utils.dlpack.to_dlpack` (a builtin of torch, not a Tensor method) of a pending
    tensor: flushed first, as `t.__dlpack__()` is."""

    def to_dlpack(t, *a, **k):
        if isinstance(t, torch.Tensor):
            _flush_if_pending(t, "dlpack")
        return orig(t, *a, **k)

    to_dlpack.__doc__ = orig.__doc__
    return to_dlpack


def _wrap_backward(orig, cause):
    def backward(*a, **k):
        _flush(cause)
        try:
            return orig(*a, **k)
        finally:
            _flush("post-" + cause)

    return backward


def _install():
    """Installs the mode's hooks once, for the process: flushing Tensor readers, the autograd
    entry points and `nn.Module.__call__`. They stay after the mode is left, where each is one
    check: patching these classes on every `with` invalidated CPython's attribute caches of all
    their subclasses, which cost a tiny model's `generate()` ~1.5 ms per `with` (about 4%)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, cause in (("tolist", "tolist"), ("numpy", "numpy"), ("__repr__", "repr"), ("__format__", "format"),
                        ("__array__", "numpy"), ("item", "item"), ("__bool__", "bool"), ("__int__", "int"),
                        ("__float__", "float"), ("__index__", "int"), ("data_ptr", "data_ptr"),
                        ("__reduce_ex__", "pickle"), ("__deepcopy__", "deepcopy"), ("__dlpack__", "dlpack"),
                        ("untyped_storage", "storage"), ("_typed_storage", "storage")):
        setattr(torch.Tensor, name, _wrap_reader(name, cause))
    torch.autograd.backward = _wrap_backward(torch.autograd.backward, "backward")
    torch.autograd.grad = _wrap_backward(torch.autograd.grad, "grad")
    torch.nn.Module.__call__ = _wrap_module_call(torch.nn.Module.__call__)
    _not_a_compile_frame(torch.nn.Module.__call__)
    # The wrappers run as they are, never traced: Dynamo traced `reader` around the real
    # `Tensor.numpy`, and at run time its numpy helper called `.numpy()`, so `reader` again,
    # without end (`x.numpy().tobytes()` in a compiled function: RecursionError).
    for fn in (torch.Tensor.numpy, torch.autograd.backward):
        _not_a_compile_frame(fn)


def _not_a_compile_frame(fn):
    """Has `torch.compile` skip `fn`'s frame and compile the frames it calls, as it skips
    torch's own `Module.__call__` to compile each `forward`: compiled, the one wrapper every
    module's call runs would hold one Dynamo cache, and one recompile limit (8), for all of
    them, and the ninth compiled module would silently run uncompiled."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without it: its Dynamo then traces the wrapper
        return
    skip_code(fn.__code__)


_installed = False

# Installed at import (one check when nothing is pending), so that `from torch.utils.dlpack
# import to_dlpack` after `import tessera` takes the flushing one.
torch.utils.dlpack.to_dlpack = _flushing_to_dlpack(torch.utils.dlpack.to_dlpack)
_not_a_compile_frame(torch.utils.dlpack.to_dlpack)
if hasattr(torch, "to_dlpack"):
    torch.to_dlpack = torch.utils.dlpack.to_dlpack


class _ModeGuard:
    def __init__(self, previous):
        self.previous = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        set_eager_mode(self.previous)
        return False


def set_eager_mode(mode: EagerMode) -> _ModeGuard:
    """Switches the eager mode now; as a context manager, restores the previous one on exit
    (leaving DEFER_AND_FUSE flushes)."""
    global _loop
    if not isinstance(mode, EagerMode):
        raise ValueError(f"tessera: set_eager_mode takes a tessera.EagerMode, not {mode!r}")
    previous = _mode.current
    if mode is previous:
        return _ModeGuard(previous)
    if mode is EagerMode.DEFER_AND_FUSE:
        # The settings a flush reads, checked at the `with`, not at some later op.
        _max_ops(), _churn_limit(), _native.cpu_backend_name()
        with _lock:
            _loop = _LoopDetector()  # a fresh op stream
        _mode.obj = _DeferMode()
        _mode.obj.__enter__()
        _install()
    else:
        try:
            _flush("exit")
        finally:  # a flush that raises still leaves the mode
            m, _mode.obj = _mode.obj, None
            if m is not None and not _aside.active:
                m.__exit__(None, None, None)
            _aside.active = False
            _mode.current = mode
    _mode.current = mode
    return _ModeGuard(previous)


def get_eager_mode() -> EagerMode:
    """This thread's eager mode (each thread has its own; STRICT until it sets one)."""
    return _mode.current
