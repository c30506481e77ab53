"""Registers every Tessera op in the `tpu` namespace of `torch.ops`.

Everything here is read from the native op table (`_native.op_table()`, one entry per op,
declared once in `kernels/src`): each op is a FRAGMENT of TorchTPU's `tpu` library
(TorchTPU owns the namespace) with its explicit schema, and four kernels:

- CPU: the op's plan runs on a CPU backend over the tensors' memory. The kernel is a
  one-line Python function handing the dispatcher's arguments to Rust (`_native.call_cpu`),
  which reads the tensors and allocates the results through libtorch's stable C ABI
  (`interop/torch/src/dispatch.rs`); errors are `ValueError`s. `TESSERA_NATIVE_DISPATCH=1`
  registers the kernels from Rust instead (no Python in the call at all; errors are then
  the `RuntimeError`s a C++ kernel can raise);
- PrivateUse1 (`tpu`): the plan is walked launch by launch through a kernel runner
  (`tessera._tpu`): TorchTPU's `register_custom_kernel`/`call_custom_kernel` on a real
  TorchTPU device, the emulator on the emulated host-memory device;
- Meta/fake: output shapes from the op's output expressions (`_fake.py`), symbolic-shape safe;
- Autograd: from the op's declared backward (`_autograd.py`).

An op that is an alias of another's result (`spec.alias_of`) is a CompositeImplicitAutograd
kernel calling that op (`spec.composite`), unless it has a plan of its own: `flash_attention`
(`flash_attention_fwd`'s `o`, from a kernel that does not write lse) has the four kernels
above, and its autograd calls `flash_attention_fwd` when a gradient is needed.
"""

import os
import sys

import torch

from tessera import _native

NAMESPACE = "tpu"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

_target = os.environ.get("TESSERA_TARGET", "v6e")
if _target not in ("v5e", "v5p", "v6e", "tpu7x"):
    raise ImportError(f"tessera: TESSERA_TARGET={_target!r} is not a TPU target; set it to v5e, v5p, v6e or tpu7x (or unset it: v6e)")


# Extension modules whose CPU kernels are registered natively: they read the target
# from their own Rust state, set with the Python one.
_NATIVE_CPU = []
# Every module `register_ops` registered (the library's first).
_NATIVE_MODULES = []


def set_target(name: str) -> None:
    """The TPU generation whose blocks the kernels use (`v5e`, `v5p`, `v6e`, `tpu7x`)."""
    global _target
    if name not in ("v5e", "v5p", "v6e", "tpu7x"):
        raise ValueError(f"tessera: unknown TPU target {name!r}; use v5e, v5p, v6e or tpu7x")
    _target = name
    for native in _NATIVE_CPU:
        native.set_target(name)


def load_tuning_table(path) -> int:
    """Reads a tuning table `tessera tune --save FILE` wrote and makes the ops use it: a call
    whose block statics are left unset and whose op, target, dtype, shapes and other statics
    are exactly an entry's takes the entry's best blocks (tables loaded later win; then
    `TESSERA_TUNING_TABLES`, then the library's shipped table). Every registered module
    reads it (the library's and each user crate's, `register_ops`) and drops its cached
    plans. Returns the number of tuned entries in the file."""
    path = os.fspath(path)
    # Each extension module is its own copy of the Rust library, with its own tables.
    return [native.load_tuning_table(path) for native in _NATIVE_MODULES][0]


def _libtorch_cpu():
    """The path of the running torch's libtorch_cpu shared library."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if os.path.exists(os.path.join(lib, name)):
            return os.path.join(lib, name)
    raise RuntimeError(f"tessera: no libtorch_cpu library under {lib}")


def _register_cpu(native, specs):
    """Registers the CPU kernel of every op of `native` (see the module docs)."""
    path = _libtorch_cpu()
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    native.init_cpu(path, version)
    native.set_target(_target)
    _NATIVE_CPU.append(native)
    native_dispatch = os.environ.get("TESSERA_NATIVE_DISPATCH") == "1" and native.register_cpu_kernels(NAMESPACE, path, version)
    for slot, spec in enumerate(specs):
        spec.slot = None if native_dispatch else slot
        if not spec.composite and not native_dispatch:
            _LIB.impl(spec.name, _cpu_kernel(spec, slot), "CPU")


def get_target() -> str:
    return _target


class OpSpec:
    """One op of a native table: its entry, and where its tensors and statics sit in the schema."""

    def __init__(self, info, native):
        self.name = info["name"]
        self.native = native
        self.qualname = f"{NAMESPACE}::{self.name}"
        self.schema = info["schema"]
        self.doc = info["doc"]
        self.outputs = [tuple(o) for o in info["outputs"]]
        self.backward = info["backward"]
        self.alias_of = info["alias_of"]
        # An alias without a plan of its own: a composite of the op it aliases, no kernels.
        self.composite = self.alias_of is not None and not info.get("alias_plan", False)
        # Each tensor input's name and dims contract (tessera.dtensor's rules use the names).
        self.input_names = list(info.get("inputs", ()))
        self.input_dims = list(info.get("input_dims", ()))
        parsed = torch._C.parse_schema(f"{self.qualname}{self.schema}")
        self.arg_names = [a.name for a in parsed.arguments]
        is_tensor = [str(a.type) in ("Tensor", "Optional[Tensor]") for a in parsed.arguments]
        self.tensor_idx = [i for i, t in enumerate(is_tensor) if t]
        self.static_idx = [i for i, t in enumerate(is_tensor) if not t]
        self.tensor_names = [self.arg_names[i] for i in self.tensor_idx]
        self.single = len(parsed.returns) == 1
        # The dispatcher drops trailing arguments left at their defaults; kernels refill them.
        self.defaults = tuple(a.default_value if a.has_default_value() else None for a in parsed.arguments)

    def split(self, args):
        args = args + self.defaults[len(args):]
        tensors = [_prepare(args[i], self.name, self.arg_names[i]) for i in self.tensor_idx]
        statics = tuple(args[i] for i in self.static_idx)
        return tensors, statics

    def pack(self, results):
        return results[0] if self.single else tuple(results)

    def as_tuple(self, results):
        return (results,) if self.single else tuple(results)


def _prepare(t, op=None, name=None):
    """Contiguous, and int64 index tensors as int32 (the kernels' index type), never a wrap.
    On the host a value outside int32 is an error. A device tensor is saturated instead
    (checking would read a value back to the host on every call), and the kernel treats it
    as any out-of-range index value on a device: a wrong result, never a read outside an
    operand."""
    if t is None:
        return None
    if t.dtype == torch.int64 and t.device.type != "cpu":
        return t.clamp(-(2**31), 2**31 - 1).to(torch.int32).contiguous()
    if t.dtype == torch.int64:
        if t.numel() and bool(((t < -(2**31)) | (t >= 2**31)).any()):
            raise ValueError(
                f"error[index-range]: kernel `{op}`, input `{name}`: holds values outside the int32 range the kernels index with\n"
                "  help: pass index values in [-2^31, 2^31)"
            )
        t = t.to(torch.int32)
    return t.contiguous()


SPECS = {}


def _cpu_kernel(spec, slot):
    call = spec.native.call_cpu

    def cpu_impl(*args):
        # The whole per-call path: the dispatcher's arguments straight to Rust (slot `slot`
        # of the module's table), which reads the tensors through libtorch's stable ABI.
        return call(slot, args)

    cpu_impl.__name__ = f"tessera_{spec.name}_cpu"
    return cpu_impl


def _tpu_kernel(spec):
    from tessera import _fake, _tpu

    def tpu_impl(*args):
        tensors, statics = spec.split(args)
        # The dispatcher picks this kernel when any tensor is on `tpu`: the others (a CPU
        # tensor) are refused, as the fake kernel refuses them under torch.compile.
        _fake.check_one_device(spec.name, zip(spec.tensor_names, tensors))
        return spec.pack(_tpu.run_plan(spec.native, spec.name, statics, tensors, _target))

    tpu_impl.__name__ = f"tessera_{spec.name}_tpu"
    return tpu_impl


def _alias_kernel(spec):
    of, index = spec.alias_of
    target = getattr(torch.ops.tpu, of)

    def alias_impl(*args):
        return target(*args)[index]

    alias_impl.__name__ = f"tessera_{spec.name}"
    return alias_impl


def register_ops(native, fakes=None):
    """Registers every op of `native` as `torch.ops.tpu.<name>`.

    `native` is an extension module filled by `tessera_torch::init_module` (the library's
    `tessera._native`, or a user crate's). Each op's fake kernel comes from its declared
    output shapes, unless `fakes` (a dict or module of functions by op name) gives one;
    its autograd from its declared backward (the library's ops without one raise on
    backprop; a user module may register its own autograd for those).
    """
    from tessera import _autograd, _fake

    specs = [OpSpec(info, native) for info in native.op_table()]
    for spec in specs:
        if spec.name in SPECS:
            raise ValueError(f"tessera: torch.ops.tpu.{spec.name} is already registered; pick another name")
    _NATIVE_MODULES.append(native)
    for spec in specs:
        SPECS[spec.name] = spec
        _LIB.define(f"{spec.name}{spec.schema}")
        if spec.composite:
            _LIB.impl(spec.name, _alias_kernel(spec), "CompositeImplicitAutograd")
            continue
        _LIB.impl(spec.name, _tpu_kernel(spec), "PrivateUse1")
        given = (fakes.get(spec.name) if isinstance(fakes, dict) else getattr(fakes, spec.name, None)) if fakes is not None else None
        torch.library.register_fake(spec.qualname, given or _fake.make_fake(spec), lib=_LIB)
    _register_cpu(native, specs)
    for spec in specs:
        # A user module's op without a declared backward may get its own autograd later.
        # The autograd kernel's no-gradient CPU path calls the Python-registered CPU kernel's
        # Rust directly (not under TESSERA_NATIVE_DISPATCH=1, whose kernel is the dispatcher's).
        fast_cpu = (lambda args, call=native.call_cpu, slot=spec.slot: call(slot, args)) if not spec.composite and spec.slot is not None else None
        _autograd.register(_LIB, spec, error_without_backward=native is _native, fast_cpu=fast_cpu)
    if "tessera.dtensor" in sys.modules:
        # DTensor strategies for a user module's ops too (all-Replicate unless it has rules).
        sys.modules["tessera.dtensor"].register([spec.name for spec in specs])


register_ops(_native)
