#!/usr/bin/env python3
"""Lowers small Pallas remote-DMA kernels (JAX 0.10.2) on a compile-only topology and writes
their Mosaic (pretty), the StableHLO module and the decoded backend_config to
tests/fixtures/collective/: the reference form Tessera's collective emission is compared
against. Run with the project venv: .venv/bin/python scripts/gen_collective_reference.py
"""
import base64
import functools
import json
import os
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental import topologies
from jax._src import shard_map

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "collective")
P = jax.sharding.PartitionSpec


def ring_kernel(x_ref, o_ref, buf_ref, send_sem, recv_sem, ready_sem, *, n, logical):
    """One-direction ring all-gather: o[slot] travels to the right neighbour n-1 times."""
    my_id = lax.axis_index("x")
    right = lax.rem(my_id + 1, n)
    left = lax.rem(my_id + n - 1, n)
    dev = right if logical else (right,)
    left_dev = left if logical else (left,)
    kind = pltpu.DeviceIdType.LOGICAL if logical else pltpu.DeviceIdType.MESH
    o_ref[my_id] = x_ref[...]
    barrier = pltpu.get_barrier_semaphore()
    pltpu.semaphore_signal(barrier, 1, device_id=left_dev, device_id_type=kind)
    pltpu.semaphore_signal(barrier, 1, device_id=dev, device_id_type=kind)
    pltpu.semaphore_wait(barrier, 2)

    def body(i, carry):
        slot = lax.rem(my_id - i + n, n)
        copy = pltpu.make_async_remote_copy(
            src_ref=o_ref.at[slot], dst_ref=o_ref.at[slot],
            send_sem=send_sem.at[0], recv_sem=recv_sem.at[0],
            device_id=dev, device_id_type=kind)
        copy.start()
        copy.wait_send()
        copy.wait_recv()
        # A regular semaphore: tell the left neighbour its slot may be reused.
        pltpu.semaphore_signal(ready_sem.at[0], 1, device_id=left_dev, device_id_type=kind)
        pltpu.semaphore_wait(ready_sem.at[0], 1)
        return carry

    lax.fori_loop(0, n - 1, body, 0)
    buf_ref[...] = o_ref[0]


def build(topology, logical):
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    devs = np.array(topo.devices)
    n = len(devs)
    mesh = jax.sharding.Mesh(devs, ("x",))
    m, k = 8, 128

    def local(x):
        return pl.pallas_call(
            functools.partial(ring_kernel, n=n, logical=logical),
            out_shape=jax.ShapeDtypeStruct((n, m, k), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((m, k), jnp.float32),
                            pltpu.SemaphoreType.DMA((1,)), pltpu.SemaphoreType.DMA((1,)),
                            pltpu.SemaphoreType.REGULAR((1,))],
            compiler_params=pltpu.CompilerParams(collective_id=0),
        )(x)

    f = jax.jit(shard_map.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    sharding = jax.sharding.NamedSharding(mesh, P("x"))
    x = jax.ShapeDtypeStruct((n * m, k), jnp.float32, sharding=sharding)
    lowered = f.lower(x)
    return lowered, topo


def decode(stablehlo):
    """The custom call's backend_config: a JSON string written with `\\22` escapes."""
    raw = stablehlo[stablehlo.index('backend_config = "') + len('backend_config = "'):]
    j, i = "", 0
    while raw[i] != '"':
        if raw[i] == "\\":
            j += chr(int(raw[i + 1:i + 3], 16))
            i += 3
        else:
            j += raw[i]
            i += 1
    return json.loads(j)


def pretty(body_b64):
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir, passmanager
    from jax._src.lib import tpu as tpu_lib
    data = base64.b64decode(body_b64)
    ctx = mlir.make_ir_context()
    tpu_lib.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(data)
        pm = passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})")
        pm.run(module.operation)
        pretty_text = str(module)
        # The stable form at the version Tessera declares (codegen's STABLE_MOSAIC_VERSION).
        pm = passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=true target-version=11})")
        pm.run(module.operation)
        serialized = module.operation.get_asm(print_generic_op_form=True)
        return pretty_text, serialized


def main():
    os.makedirs(OUT, exist_ok=True)
    for topology, logical, name in [("v5e:2x2", False, "ring_mesh"), ("v5e:2x2", True, "ring_logical")]:
        lowered, topo = build(topology, logical)
        text = lowered.as_text()
        cfg = decode(text)
        body = cfg["custom_call_config"]["body"]
        mosaic, serialized = pretty(body)
        cfg["custom_call_config"]["body"] = f"<{len(base64.b64decode(body))} bytes base64>"
        with open(os.path.join(OUT, f"{name}.stablehlo.mlir"), "w") as f:
            f.write(text)
        with open(os.path.join(OUT, f"{name}.mosaic.mlir"), "w") as f:
            f.write(mosaic)
        with open(os.path.join(OUT, f"{name}.serialized.mlir"), "w") as f:
            f.write(serialized)
        with open(os.path.join(OUT, f"{name}.backend_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        compiled = lowered.compile()
        with open(os.path.join(OUT, f"{name}.compiled_hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        print(name, "ok")


if __name__ == "__main__":
    sys.exit(main())
