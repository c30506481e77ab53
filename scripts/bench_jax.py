#!/usr/bin/env python3
"""JAX-side timings for Tessera's side-by-side benchmarks (run by `cargo bench -p tessera-tests --features bench`).

Prints one JSON object with medians in seconds:
  export_matmul_warm    jax.export of the Pallas tiled matmul for TPU (512^3 f32, 128 blocks),
                        lowering only, after a first warm-up export in the same process
  export_matmul_first   the first export in the process (imports already done)
  interpret_matmul      Pallas interpret=True, 1024^3 f32, 128^3 blocks, on the CPU
  xla_dot               XLA-CPU jnp.dot, 1024^3 f32
"""
import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # export targets TPU by name; execution is on the CPU

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from benchlib import median_time


def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _done():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def pallas_matmul(x, y, bm=128, bk=128, bn=128, interpret=False):
    m, k = x.shape
    n = y.shape[1]
    return pl.pallas_call(
        matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(m // bm, n // bn, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(x, y)


def export_matmul():
    spec = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    exp = jax.export.export(jax.jit(pallas_matmul), platforms=["tpu"])(spec, spec)
    return exp.mlir_module()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    out = {}
    t = time.perf_counter()
    export_matmul()
    out["export_matmul_first"] = time.perf_counter() - t
    # jax.jit caches traces per function object; a fresh closure each time measures the
    # whole trace + lower + export path a user pays for a new kernel or new shapes.
    def fresh_export():
        spec = jax.ShapeDtypeStruct((512, 512), jnp.float32)
        f = lambda x, y: pallas_matmul(x, y)
        jax.export.export(jax.jit(f), platforms=["tpu"])(spec, spec).mlir_module()
    out["export_matmul_warm"] = median_time(fresh_export, args.runs)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1024, 1024), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((1024, 1024), dtype=np.float32))
    interp = jax.jit(lambda a, b: pallas_matmul(a, b, interpret=True))
    interp(x, y).block_until_ready()  # compile once; time execution only
    out["interpret_matmul"] = median_time(lambda: interp(x, y).block_until_ready(), max(3, args.runs // 2))
    dot = jax.jit(jnp.dot)
    dot(x, y).block_until_ready()
    out["xla_dot"] = median_time(lambda: dot(x, y).block_until_ready(), args.runs)
    out["jax_version"] = jax.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
