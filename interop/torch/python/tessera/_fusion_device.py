"""DeferAndFuse on the `tpu` device: placeholders in device memory and flushes through the
device's execution path (`tessera._tpu`, the path library ops take there).

A recording holds tensors of one device (`cpu` or `tpu`; mixing them is refused with
`fusion-device-mix` and the op runs eagerly). On the CPU a flush runs the program natively
(`FusionGraph.run`). On `tpu` it walks the program's launches here:

- **Placeholders.** On the emulated `tpu` device a placeholder is a device tensor with no
  memory yet (`tessera_emulated_tpu::empty_unallocated`; its views are real views). A flush
  gives only the placeholders somebody still holds their memory, from the device allocator
  (`materialize`): an intermediate nobody holds is never allocated, and
  `torch.tpu.max_memory_allocated()` shows it. On TorchTPU a placeholder is a plain
  `torch.empty` on the device (TorchTPU's allocator decides when memory exists).
- **Temporaries** (values one kernel stores for a later one) are device tensors allocated
  when their kernel runs and dropped after their last reader.
- **Launches** go through `tessera._tpu.runner()`, which sees a `FusionProgram` as it sees a
  library plan: on TorchTPU each kernel is one `register_custom_kernel` module (its StableHLO
  holding the generated kernel's Mosaic, named `tessera.fusion.<structural digest>.fusedN`,
  keyed by a digest of its text), registered once and called with `call_custom_kernel`
  (its fresh results are copied into the placeholders' memory); on the emulated device the
  same modules are built and keyed and the kernel runs on the CPU backend over device
  memory. No JAX on either.

`TESSERA_FUSION_MODULES=DIR` writes every distinct kernel a flush runs (on any device) as a
StableHLO module for each target of `TESSERA_FUSION_MODULE_TARGETS` (default
`v5e,v6e,tpu7x`): the libtpu tier (tests/python/test_fusion_libtpu.py) compiles them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch

from tessera import _tpu

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "bool": torch.bool}

# Device type -> runner for flushes of that device routed through this path (see `route`).
_routes: dict = {}


@contextlib.contextmanager
def route(device_type: str, runner):
    """Flushes of graphs on `device_type` run through this path with `runner` (a callable
    `runner(program, i, inputs, outputs) -> results`, as `tessera._tpu`'s runners). For tests:
    the TorchTPU stand-in routes CPU tensors through TorchTPU's registration API."""
    previous = _routes.get(device_type)
    _routes[device_type] = runner
    try:
        yield
    finally:
        if previous is None:
            _routes.pop(device_type, None)
        else:
            _routes[device_type] = previous


def takes(device_type) -> bool:
    """Whether a flush of a graph on `device_type` runs here (else natively on the CPU)."""
    return device_type == "tpu" or device_type in _routes


def _emulated(device_type) -> bool:
    if device_type != "tpu":
        return False
    from tessera import emulated_tpu

    return emulated_tpu.is_enabled()


def placeholder(shape, dtype, device_type):
    """A deferred result's tensor: no memory yet on the emulated `tpu`, `torch.empty` elsewhere."""
    if _emulated(device_type):
        return torch.ops.tessera_emulated_tpu.empty_unallocated(list(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device_type or "cpu")


def materialize(t) -> None:
    """Gives a placeholder its memory (the emulated `tpu`'s allocator); no-op elsewhere."""
    if t.device.type == "tpu" and _emulated("tpu"):
        torch.ops.tessera_emulated_tpu.materialize(t)


# HBM bytes the launched kernels move by their cost estimate (scripts/fusion_memory_tpu.py).
_hbm = {"bytes": 0, "kernels": 0}


def hbm_bytes(reset=False) -> dict:
    """`{"bytes", "kernels"}`: the cost estimate's HBM bytes of every kernel this path launched
    (since the last `reset`)."""
    out = dict(_hbm)
    if reset:
        _hbm.update(bytes=0, kernels=0)
    return out


def run(graph, live, inputs, outputs, target, dump, device_type) -> dict:
    """Runs the program of `graph` for `live` into `outputs` (the live results' memory, on the
    device) from `inputs` through the device's runner; returns `{"hit", "kernels", "temps"}`.
    A program that cannot be built, lowered or run raises (the caller replays eagerly)."""
    try:
        program, hit = graph.program(live, target)
    except ValueError as err:
        if dump:
            _write(dump, f"# graph (live {live})\n{graph}\n# not built: {err}\n")
        raise
    if dump:
        text = program.describe()
        for i in range(len(program)):
            try:
                text += f"# mosaic of {program.kernel_name(i)} for {program.target}\n{program.mosaic(i)}\n"
            except ValueError as err:
                text += f"# no mosaic for {program.kernel_name(i)}: {err}\n"
        _write(dump, text)
    runner = _routes.get(device_type) or _tpu.runner()
    run_program(program, inputs, outputs, runner)
    for i in range(len(program)):
        _hbm["bytes"] += program.cost(i)["bytes_accessed"]
        _hbm["kernels"] += 1
    return {"hit": hit, "kernels": len(program), "temps": len(program.temps)}


def run_program(program, inputs, outputs, runner) -> None:
    """Walks the launches: operands seen as each kernel's `[rows, cols]`, temporaries
    allocated on the device for as long as a later kernel reads them."""
    device = (list(outputs) or list(inputs))[0].device
    temp_types = program.temps
    last_read = {}
    for i in range(len(program)):
        for kind, k, _ in program.args(i):
            if kind == "temp":
                last_read[k] = i
    temps = {}

    def buf(kind, k):
        return inputs[k] if kind == "input" else outputs[k] if kind == "output" else temps[k]

    for i in range(len(program)):
        ins = [buf(kind, k).reshape(shape) for kind, k, shape in program.args(i)]
        results = program.outputs(i)
        outs = []
        for kind, k, shape in results:
            if kind == "temp":
                dtype, n = temp_types[k]
                temps[k] = torch.empty(n, dtype=_DTYPES[dtype], device=device)
            outs.append(buf(kind, k).view(shape))
        got = runner(program, i, ins, outs)
        for (kind, k, _), out, res in zip(results, outs, got):
            if res is out:
                continue  # written in place (the emulator)
            # TorchTPU's call_custom_kernel returns fresh results.
            if kind == "temp":
                temps[k] = res.reshape(-1)
            else:
                out.copy_(res.reshape(out.shape))
        for k in [k for k, last in last_read.items() if last == i]:
            temps.pop(k, None)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


# ---- TESSERA_FUSION_MODULES: the kernels a run generated, for the libtpu tier -----------------

_written: set = set()  # module files written by this process
_structures: set = set()  # (graph, live) whose modules were written


def write_modules(graph, live) -> None:
    """With `TESSERA_FUSION_MODULES=DIR`: writes each kernel of `graph`'s program for `live`
    as a StableHLO module for every target of `TESSERA_FUSION_MODULE_TARGETS` (programs for
    other targets are built outside the program cache, so its counters do not move)."""
    out = os.environ.get("TESSERA_FUSION_MODULES")
    if not out:
        return
    structure = f"{graph}|{list(live)}"
    if structure in _structures:
        return
    _structures.add(structure)
    targets = [t for t in os.environ.get("TESSERA_FUSION_MODULE_TARGETS", "v5e,v6e,tpu7x").split(",") if t]
    os.makedirs(out, exist_ok=True)
    for target in targets:
        try:
            program, _ = graph.program(live, target, cached=False)
        except ValueError:
            continue  # not built: the flush itself reports it (fallbacks)
        _write_program(program, out)


def _write_program(program, out) -> None:
    for i in range(len(program)):
        try:
            text = program.module(i)
        except ValueError as err:
            text = f"// not lowered: {err}\n"
        digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        name = f"{program.kernel_name(i)}.{program.target}.{digest}.stablehlo.mlir"
        if name in _written:
            continue
        _written.add(name)
        path = os.path.join(out, name)
        if not os.path.exists(path):
            _write(path, text)
