#!/usr/bin/env python3
"""JAX-side timings for the flash-attention benchmark (run by `cargo bench -p tessera-tests --features bench --bench attention`).

Flash attention forward, q/k/v [b, h, s, d] f32, sm_scale = 1/sqrt(d), non-causal and
causal. Prints one JSON object with medians in seconds, per causal setting:
  pallas_interpret_128     jax.experimental.pallas.ops.tpu.flash_attention, its default
                           blocks (128), pallas_call(interpret=True) (the HLO interpreter)
  pallas_interpret_blocks  the same at --block (Tessera's default blocks)
  pallas_tpu_interpret     the same at --block under pltpu.force_tpu_interpret_mode() (the
                           TPU interpreter: simulated VMEM/DMA; much slower) if --tpu-interpret
  xla_reference            XLA-CPU: softmax(q k^T * scale [+ causal mask]) v under jit
  max_abs_diff             |pallas interpret - xla reference|, a sanity check of the setup
The Pallas op takes no `interpret` argument in jax 0.10.2: interpret=True is forced by
handing the module a `pl` whose pallas_call sets it. Execution only: every function is
compiled once before timing.
"""
import argparse
import functools
import json
import os
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from benchlib import median_time


def forcing_interpret():
    """A stand-in for the `pl` module that runs every pallas_call with interpret=True."""
    ns = types.SimpleNamespace(**{k: getattr(pl, k) for k in dir(pl) if not k.startswith("__")})
    ns.pallas_call = functools.partial(pl.pallas_call, interpret=True)
    return ns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tpu-interpret", action="store_true")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.b, args.h, args.s, args.d)
    q, k, v = (jnp.asarray(rng.uniform(-1, 1, shape), dtype=jnp.float32) for _ in range(3))
    scale = 1.0 / np.sqrt(args.d)

    def pallas(causal, block):
        bs = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1)
        f = jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=bs))
        return f

    def xla(causal):
        @jax.jit
        def f(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
            if causal:
                mask = jnp.tril(jnp.ones((args.s, args.s), dtype=bool))
                s = jnp.where(mask, s, -jnp.inf)
            return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

        return f

    def timed(f, runs):
        f(q, k, v).block_until_ready()
        return median_time(lambda: f(q, k, v).block_until_ready(), runs)

    outputs = {}

    slow_runs = max(3, args.runs // 2)
    out = {"problem": {"b": args.b, "h": args.h, "s": args.s, "d": args.d, "dtype": "f32", "block": args.block}, "jax_version": jax.__version__}
    real_pl = fa.pl
    for causal in (False, True):
        res = {}
        fa.pl = forcing_interpret()
        try:
            res["pallas_interpret_128"] = timed(pallas(causal, 128), slow_runs)
            res["pallas_interpret_blocks"] = timed(pallas(causal, args.block), slow_runs)
            outputs["pallas"] = pallas(causal, args.block)(q, k, v)
        finally:
            fa.pl = real_pl
        if args.tpu_interpret:
            with pltpu.force_tpu_interpret_mode():
                res["pallas_tpu_interpret"] = timed(pallas(causal, args.block), 1)
        res["xla_reference"] = timed(xla(causal), args.runs)
        res["max_abs_diff"] = float(jnp.max(jnp.abs(outputs["pallas"] - xla(causal)(q, k, v))))
        out["causal" if causal else "noncausal"] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
