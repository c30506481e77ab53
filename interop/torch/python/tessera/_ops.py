"""Registers every Tessera op in the `tpu` namespace of `torch.ops`.

Each op is a FRAGMENT of TorchTPU's `tpu` library (TorchTPU owns the namespace) with an
explicit schema from the native op table, and four kernels:

- CPU: the op's plan runs on the interpreter over the tensors' memory (`_native.run`);
- PrivateUse1 (`tpu`): the plan is walked launch by launch through a kernel runner
  (`tessera._tpu`): TorchTPU's `register_custom_kernel`/`call_custom_kernel` on a real
  TorchTPU device, the interpreter on the emulated host-memory device;
- Meta/fake: output shapes from `_fake.py`, symbolic-shape safe;
- Autograd (where a backward exists): `_autograd.py`.
"""

import os

import torch

from tessera import _native

NAMESPACE = "tpu"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

_target = os.environ.get("TESSERA_TARGET", "v6e")


def set_target(name: str) -> None:
    """The TPU generation whose blocks the kernels use (`v5e`, `v5p`, `v6e`, `tpu7x`)."""
    global _target
    if name not in ("v5e", "v5p", "v6e", "tpu7x"):
        raise ValueError(f"tessera: unknown TPU target {name!r}; use v5e, v5p, v6e or tpu7x")
    _target = name


def get_target() -> str:
    return _target


class OpSpec:
    """One op: where its tensors and static arguments sit in the schema."""

    def __init__(self, name, schema, doc, native):
        self.name = name
        self.native = native
        self.qualname = f"{NAMESPACE}::{name}"
        self.schema = schema
        self.doc = doc
        parsed = torch._C.parse_schema(f"{self.qualname}{schema}")
        self.arg_names = [a.name for a in parsed.arguments]
        is_tensor = [str(a.type) in ("Tensor", "Optional[Tensor]") for a in parsed.arguments]
        self.tensor_idx = [i for i, t in enumerate(is_tensor) if t]
        self.static_idx = [i for i, t in enumerate(is_tensor) if not t]
        self.single = len(parsed.returns) == 1
        # The dispatcher drops trailing arguments left at their defaults; kernels refill them.
        self.defaults = tuple(a.default_value if a.has_default_value() else None for a in parsed.arguments)

    def split(self, args):
        args = args + self.defaults[len(args):]
        tensors = [_prepare(args[i]) for i in self.tensor_idx]
        statics = tuple(args[i] for i in self.static_idx)
        return tensors, statics

    def pack(self, results):
        return results[0] if self.single else tuple(results)


def _prepare(t):
    """Contiguous, and int64 index tensors as int32 (the kernels' index type)."""
    if t is None:
        return None
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    return t.contiguous()


SPECS = {}


def _cpu_kernel(spec):
    name, single, tensor_idx, static_idx, defaults = spec.name, spec.single, spec.tensor_idx, spec.static_idx, spec.defaults
    run = spec.native.run
    cpu = torch.device("cpu")

    def cpu_impl(*args):
        # Kept minimal: this is the per-call path (contiguity and int64 are handled natively).
        args = args + defaults[len(args):]
        tensors = [args[i] for i in tensor_idx]
        statics = tuple(args[i] for i in static_idx)
        out = run(name, statics, tensors, cpu, _target)
        return out[0] if single else tuple(out)

    cpu_impl.__name__ = f"tessera_{name}_cpu"
    return cpu_impl


def _tpu_kernel(spec):
    from tessera import _tpu

    def tpu_impl(*args):
        tensors, statics = spec.split(args)
        return spec.pack(_tpu.run_plan(spec.native, spec.name, statics, tensors, _target))

    tpu_impl.__name__ = f"tessera_{spec.name}_tpu"
    return tpu_impl


def register_ops(native, fakes):
    """Registers every op of `native` as `torch.ops.tpu.<name>`.

    `native` is an extension module filled by `tessera_torch::init_module` (the library's
    `tessera._native`, or a user crate's); `fakes` maps each op name to its fake (meta)
    function, which returns empty outputs of the right shapes and dtypes.
    """
    for name, schema, doc in native.op_table():
        if name in SPECS:
            raise ValueError(f"tessera: torch.ops.tpu.{name} is already registered; pick another name")
        fake = fakes.get(name) if isinstance(fakes, dict) else getattr(fakes, name, None)
        if fake is None:
            raise ValueError(f"tessera: no fake implementation given for {name}; pass one in `fakes`")
        spec = OpSpec(name, schema, doc, native)
        SPECS[name] = spec
        _LIB.define(f"{name}{schema}")
        _LIB.impl(name, _cpu_kernel(spec), "CPU")
        _LIB.impl(name, _tpu_kernel(spec), "PrivateUse1")
        torch.library.register_fake(spec.qualname, fake, lib=_LIB)


def _register_library():
    from tessera import _autograd, _fake

    register_ops(_native, _fake)

    # flash_attention: the output of flash_attention_fwd (the user-facing op, as in
    # torch_xla); a composite, so autograd flows through flash_attention_fwd's backward.
    schema = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> Tensor"
    _LIB.define(f"flash_attention{schema}")

    def flash_attention(q, k, v, causal=False, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None):
        return torch.ops.tpu.flash_attention_fwd(q, k, v, causal, sm_scale, soft_cap, q_segment_ids, kv_segment_ids)[0]

    _LIB.impl("flash_attention", flash_attention, "CompositeImplicitAutograd")
    SPECS["flash_attention"] = OpSpec("flash_attention", schema, "flash attention output (differentiable)", _native)
    _autograd.register(_LIB)


_register_library()
