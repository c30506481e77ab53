#!/usr/bin/env python3
"""JAX-side timings for the grouped-matmul benchmark (run by `cargo bench -p tessera-tests --features bench --bench gmm`).

gmm: lhs [m, k] bf16 (rows sorted by group), rhs [g, k, n] bf16, group sizes given on the
command line (the Rust side draws them, so both sides run the same problem). Prints one
JSON object with medians in seconds:
  interpret_gmm_128      megablox gmm, Pallas interpret=True, tiling (128, 128, 128) (its default)
  interpret_gmm_blocks   megablox gmm, interpret=True, tiling --tiling (Tessera's default blocks)
  xla_per_group          XLA-CPU: jnp.dot per group (static slices) under jit, f32 accumulation
Execution only: every function is compiled once before timing.
"""
import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
from benchlib import median_time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--group-sizes", default="512,512,512,512,512,512,512,512")
    ap.add_argument("--tiling", default="256,1024,1024")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(s) for s in args.group_sizes.split(",")]
    assert sum(sizes) == args.m, "group sizes must sum to m"
    g = len(sizes)
    tiling = tuple(int(t) for t in args.tiling.split(","))

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.uniform(-1, 1, (args.m, args.k)), dtype=jnp.bfloat16)
    rhs = jnp.asarray(rng.uniform(-1, 1, (g, args.k, args.n)), dtype=jnp.bfloat16)
    gs = jnp.asarray(sizes, dtype=jnp.int32)

    def interp(tiles):
        f = jax.jit(lambda a, b, s: megablox_gmm(a, b, s, preferred_element_type=jnp.bfloat16, tiling=tiles, interpret=True))
        f(lhs, rhs, gs).block_until_ready()
        return lambda: f(lhs, rhs, gs).block_until_ready()

    offsets = np.concatenate([[0], np.cumsum(sizes)])

    @jax.jit
    def per_group(a, b):
        outs = [jnp.dot(a[offsets[i]:offsets[i + 1]], b[i], preferred_element_type=jnp.float32) for i in range(g)]
        return jnp.concatenate(outs, axis=0).astype(a.dtype)

    per_group(lhs, rhs).block_until_ready()
    slow_runs = max(3, args.runs // 2)
    out = {
        "interpret_gmm_128": median_time(interp((128, 128, 128)), slow_runs),
        "interpret_gmm_blocks": median_time(interp(tiling), slow_runs),
        "xla_per_group": median_time(lambda: per_group(lhs, rhs).block_until_ready(), args.runs),
        "tiling": list(tiling),
        "group_sizes": sizes,
        "jax_version": jax.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
