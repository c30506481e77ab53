"""The `tpu` (PrivateUse1) path: walk an op's plan launch by launch through a runner.

A plan (built and cached natively from the call's shapes, dtypes and static arguments)
lists kernel launches: each has a StableHLO module holding the `tpu_custom_call`, its
operands (op inputs, host-prepared arrays, earlier launches' outputs, each seen through a
view or the head-major relayout) and its output types. Two runners execute launches:

- `TorchTpuRunner`: TorchTPU's `register_custom_kernel` (once per module) and
  `call_custom_kernel`, on a real TorchTPU device. No JAX anywhere on this path.
- `EmulatorRunner`: the emulated host-memory `tpu` device (tests); the same modules are
  built and keyed, and the launch's kernel runs on the interpreter over device memory.

Host-prepared arrays (gmm group metadata, MoE routing positions, RoPE tables) need the
values of a few integer inputs; those are read back to the host (a device sync).
"""

import collections
import hashlib
import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32, "int8": torch.int8, "bool": torch.bool,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


class Module:
    """A launch's module and the key TorchTPU caches it under (a digest of its text)."""

    def __init__(self, name, text):
        self.name = name
        self.text = text
        self.key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _capacity(var, default):
    text = os.environ.get(var)
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"tessera: {var}={text!r} is not a positive integer (the number of entries the cache keeps)")
    return n


class ModuleCache:
    """Lowered modules by (plan id, launch), least recently used evicted beyond
    `TESSERA_MODULE_CACHE` entries (default 256): a run over many distinct shapes keeps
    the recent modules, not every one (`make_plan` returns a new wrapper per call, so the
    key is the native plan's `id`)."""

    def __init__(self):
        self.entries = collections.OrderedDict()
        self.capacity = None
        self.hits = self.misses = 0

    def get(self, plan, i):
        if self.capacity is None:
            self.capacity = _capacity("TESSERA_MODULE_CACHE", 256)
        key = (plan.id, i)
        entry = self.entries.get(key)
        if entry is not None:
            self.hits += 1
            self.entries.move_to_end(key)
            return entry[1]
        self.misses += 1
        # The entry holds the plan: its id (the native plan's address) is then never reused
        # by another plan while the entry lives (another module's, or one the plan cache
        # dropped), which would hand out the wrong kernel.
        module = Module(plan.kernel_name(i), plan.module(i))
        self.entries[key] = (plan, module)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return module

    def info(self):
        return {"entries": len(self.entries), "capacity": self.capacity or _capacity("TESSERA_MODULE_CACHE", 256), "hits": self.hits, "misses": self.misses}


_modules = ModuleCache()


def module_of(plan, i):
    """Launch `i`'s module, lowered and keyed once per plan."""
    return _modules.get(plan, i)


class TorchTpuRunner:
    """Submits launches to TorchTPU."""

    def __init__(self):
        from torch_tpu._internal.pallas import tpu_torch_pallas

        self.api = tpu_torch_pallas

    def register(self, module):
        if not self.api.lookup_custom_kernel(module.name, module.key):
            self.api.register_custom_kernel(module.name, module.key, serialized_mlir_module=module.text)

    def __call__(self, plan, i, inputs, outputs):
        module = module_of(plan, i)
        self.register(module)
        return list(self.api.call_custom_kernel(module.name, module.key, inputs=inputs, output_shapes=outputs))


class EmulatorRunner:
    """Runs launches on the interpreter over host-memory (emulated `tpu`) tensors."""

    def __init__(self):
        self.registered = {}

    def register(self, module):
        self.registered.setdefault((module.name, module.key), module.text)

    def __call__(self, plan, i, inputs, outputs):
        self.register(module_of(plan, i))
        # The emulated device's memory is host memory: say so, or the bridge refuses it.
        plan.emulate(i, [t.contiguous() for t in inputs], outputs, "tpu")
        return outputs


_runner = None


def runner():
    """The runner for this process: the emulator when the emulated device is on, else TorchTPU."""
    global _runner
    if _runner is None:
        from tessera import emulated_tpu

        _runner = EmulatorRunner() if emulated_tpu.is_enabled() else TorchTpuRunner()
    return _runner


def _layout(t, layout, shape):
    """`t` seen as the consumer needs it (see `plan.rs`'s `Layout`)."""
    if layout is None:
        return t.reshape(shape)
    hkv, group, padded = layout
    if hkv == 0:  # rows zero-padded to `padded` (a bf16 gather source)
        return torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[0]))
    if len(shape) == 4:  # [T, Hkv*G, D] -> [Hkv, G, Tp, D]
        tokens, _, d = t.shape
        x = t.reshape(tokens, hkv, group, d).permute(1, 2, 0, 3)
        return torch.nn.functional.pad(x, (0, 0, 0, padded - tokens)).contiguous()
    tokens = shape[0]  # [Hkv, G, Tp, D] -> [T, Hkv*G, D]
    return t[:, :, :tokens].permute(2, 0, 1, 3).reshape(shape)


def plan_for(native, name, statics, tensors, target):
    """The (cached) plan of op `name` of extension module `native` for these tensors."""
    metas = [None if t is None else (str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors]
    return native.make_plan(name, statics, metas, target)


# Plans' host arrays (they depend on types and statics only: RoPE's frequency table,
# attention's placeholder segment ids, a window's band metadata), moved to each device once.
# Bounded, least recently used first out.
_CONSTANTS = collections.OrderedDict()
_CONSTANTS_KEPT = 256


def _host_arrays(plan, key, device):
    """The plan's host arrays on `device`."""
    key = (key, str(device))
    arrays = _CONSTANTS.get(key)
    if arrays is None:
        arrays = [h.to(device) for h in plan.host_arrays()]
        _CONSTANTS[key] = arrays
        if len(_CONSTANTS) > _CONSTANTS_KEPT:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(key)
    return arrays


def run_plan(native, name, statics, tensors, target, run=None):
    """Runs op `name` on tensors of one device through `run` (default: `runner()`)."""
    run = run or runner()
    plan = plan_for(native, name, statics, tensors, target)
    device = next(t.device for t in tensors if t is not None)
    key = (id(native), name, repr(statics), repr([None if t is None else (t.dtype, tuple(t.shape)) for t in tensors]), target)
    host = _host_arrays(plan, key, device)
    results = []

    def operand(kind, a, b, layout, shape, dtype):
        src = tensors[a] if kind == "input" else host[a] if kind == "host" else results[a][b]
        return _layout(src, layout, shape)

    for i in range(len(plan)):
        inputs = [operand(*arg) for arg in plan.args(i)]
        outputs = [torch.empty(shape, dtype=_DTYPES[dtype], device=device) for shape, dtype in plan.outputs(i)]
        results.append(run(plan, i, inputs, outputs))
    # Results are fresh tensors: a result that is a view of an input or host array is copied.
    return [operand(*r) if r[0] == "result" else operand(*r).clone() for r in plan.results()]
