#!/usr/bin/env python3
"""JAX-side timings for the CPU-backend benchmark (`cargo bench -p tessera-tests --features bench --bench cpu_backends`).

Prints one JSON object with medians in seconds (execution only: every function is compiled
once before timing), each at the blocks given on the command line (Tessera's blocks):
  matmul_interpret / matmul_xla           1024^3 f32: Pallas tiled matmul, interpret=True; jnp.dot
  rmsnorm_interpret / rmsnorm_xla         RMSNorm 4096x4096 f32, eps 1e-6, rows per block --rms-rows
  elementwise_interpret / elementwise_xla the 8-op elementwise kernel on 4096x4096 f32, blocks --ew-block
The 8 ops: y = max(x * 1.5 + 0.5, 0) * x - x / (1 + |x|) (mul, add, max, mul, abs, add, div, sub).
"""
import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from benchlib import median_time
from bench_jax import pallas_matmul


def rmsnorm_kernel(x_ref, w_ref, o_ref):
    x = x_ref[...]
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / x.shape[-1]
    o_ref[...] = x * jax.lax.rsqrt(ms + 1e-6) * w_ref[...]


def pallas_rmsnorm(x, w, rows, interpret):
    m, n = x.shape
    return pl.pallas_call(
        rmsnorm_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((rows, n), lambda i: (i, 0)), pl.BlockSpec((1, n), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, n), lambda i: (i, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(x, w)


def ew(x):
    return jnp.maximum(x * 1.5 + 0.5, 0.0) * x - x / (1.0 + jnp.abs(x))


def ew_kernel(x_ref, o_ref):
    o_ref[...] = ew(x_ref[...])


def pallas_ew(x, bm, bn, interpret):
    m, n = x.shape
    return pl.pallas_call(
        ew_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mm-blocks", default="512,512,1024")
    ap.add_argument("--rms-rows", type=int, default=256)
    ap.add_argument("--ew-block", default="512,4096")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out = {"jax_version": jax.__version__}

    def timed(f, *a, runs=args.runs):
        jax.block_until_ready(f(*a))
        return median_time(lambda: jax.block_until_ready(f(*a)), runs)

    slow = max(3, args.runs // 2)
    bm, bn, bk = (int(b) for b in args.mm_blocks.split(","))
    x = jnp.asarray(rng.uniform(-1, 1, (1024, 1024)), dtype=jnp.float32)
    y = jnp.asarray(rng.uniform(-1, 1, (1024, 1024)), dtype=jnp.float32)
    out["matmul_interpret"] = timed(jax.jit(lambda a, b: pallas_matmul(a, b, bm=bm, bk=bk, bn=bn, interpret=True)), x, y, runs=slow)
    out["matmul_xla"] = timed(jax.jit(jnp.dot), x, y)

    x = jnp.asarray(rng.uniform(-1, 1, (4096, 4096)), dtype=jnp.float32)
    w = jnp.asarray(rng.uniform(-1, 1, (1, 4096)), dtype=jnp.float32)
    rows = args.rms_rows
    out["rmsnorm_interpret"] = timed(jax.jit(lambda a, b: pallas_rmsnorm(a, b, rows, True)), x, w, runs=slow)

    @jax.jit
    def rms_xla(a, b):
        ms = jnp.mean(a * a, axis=-1, keepdims=True)
        return a * jax.lax.rsqrt(ms + 1e-6) * b

    out["rmsnorm_xla"] = timed(rms_xla, x, w)
    ebm, ebn = (int(b) for b in args.ew_block.split(","))
    out["elementwise_interpret"] = timed(jax.jit(lambda a: pallas_ew(a, ebm, ebn, True)), x, runs=slow)
    out["elementwise_xla"] = timed(jax.jit(ew), x)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
