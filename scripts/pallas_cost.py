#!/usr/bin/env python3
"""libtpu's static cost of the Pallas TPU kernels shipped in JAX, compile-only.

The other side of `tessera cost` (issue 14): the same LLO profile (DESIGN.md section 9), read
by the same parser (`interop/python/tpu_compile.py --profile`), for JAX's own kernels at
given shapes and blocks, so a ratio of estimated cycles compares like with like.

Usage:
  pallas_cost.py --target v5e CASE [CASE ...]
  CASE = KERNEL:key=value,...   e.g.
    matmul:m=4096,k=4096,n=4096,bm=512,bk=1024,bn=1024,dtype=bf16
    flash:b=1,h=8,s=2048,d=128,causal=1,bq=128,bk=128,dtype=bf16        (forward, inference: o only)
    flash_res:b=1,h=8,s=2048,d=128,causal=1,bq=128,bk=128,dtype=bf16    (forward with residuals l, m: what training runs)
    flash_train:b=1,h=8,s=2048,d=128,causal=1,bq=128,dtype=bf16         (forward with residuals + backward, every block bq)
    gmm:m=4096,k=1024,n=1024,g=8,tm=256,tk=1024,tn=1024,dtype=bf16,sizes=512;512;...
    splash:h=8,s=2048,d=128,bq=256,bk=256,mask=causal,dtype=bf16     (forward; mask = causal | full | local:W | chunked:C,
                                                                      a numpy mask: partial blocks read as bits, as Tessera's)
Output: one JSON line per case: {"case", "target", "ok", "error", "profile"} where profile
is as in tpu_compile.py --profile. Each case compiles in its own child process (the
profiler aborts on some kernels; a crash is that case's error, not the run's).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "interop", "python"))
import tpu_compile  # noqa: E402  (read_profile, topology_for, trim_error)


def parse_case(text):
    kernel, _, rest = text.partition(":")
    params = {}
    for kv in filter(None, rest.split(",")):
        key, _, value = kv.partition("=")
        params[key.strip()] = value.strip()
    return kernel, params


def build(kernel, p):
    """(function, argument shapes) of one case."""
    import jax
    import jax.numpy as jnp
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[p.get("dtype", "bf16")]
    S = jax.ShapeDtypeStruct
    i = lambda key: int(p[key])  # noqa: E731
    if kernel == "matmul":
        from jax.experimental.pallas.ops.tpu import matmul as mm
        f = lambda x, y: mm.matmul(x, y, block_shape=(i("bm"), i("bn")), block_k=i("bk"))  # noqa: E731
        return f, [S((i("m"), i("k")), dtype), S((i("k"), i("n")), dtype)]
    if kernel == "flash":
        from jax.experimental.pallas.ops.tpu import flash_attention as fa
        bq, bk = i("bq"), i("bk")
        major = int(p.get("bk_major", bk))
        sizes = fa.BlockSizes(block_q=bq, block_k_major=major, block_k=bk, block_b=1)
        causal = p.get("causal", "0") in ("1", "true", "True")
        d = i("d")
        f = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, sm_scale=1.0 / d ** 0.5, block_sizes=sizes)  # noqa: E731
        shape = (i("b"), i("h"), i("s"), d)
        return f, [S(shape, dtype)] * 3
    if kernel == "flash_res":
        # The forward a training step runs: o and the softmax residuals (Pallas' l and m,
        # each f32 [b, h, s, 128]) that its backward reads, as Tessera's forward writes lse.
        from jax.experimental.pallas.ops.tpu import flash_attention as fa
        bq, bk = i("bq"), i("bk")
        causal = p.get("causal", "0") in ("1", "true", "True")
        d = i("d")
        f = lambda q, k, v: fa._flash_attention_impl(q, k, v, None, None, True, causal, 1.0 / d ** 0.5, 1, bq, bk, bk, False)  # noqa: E731
        shape = (i("b"), i("h"), i("s"), d)
        return f, [S(shape, dtype)] * 3
    if kernel == "flash_train":
        # Forward (with residuals) and backward (dkv, dq kernels): jax.grad of the kernel.
        import jax.numpy as jnp_
        from jax.experimental.pallas.ops.tpu import flash_attention as fa
        b = i("bq")
        sizes = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1,
                              block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b,
                              block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
        causal = p.get("causal", "0") in ("1", "true", "True")
        d = i("d")
        loss = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, sm_scale=1.0 / d ** 0.5, block_sizes=sizes).astype(jnp_.float32).sum()  # noqa: E731
        f = jax.grad(loss, argnums=(0, 1, 2))
        shape = (i("b"), i("h"), i("s"), d)
        return f, [S(shape, dtype)] * 3
    if kernel == "gmm":
        from jax.experimental.pallas.ops.tpu.megablox import gmm as _gmm
        sizes = [int(s) for s in p["sizes"].split(";")]
        tiling = (i("tm"), i("tk"), i("tn"))
        import numpy as np
        gs = jnp.asarray(np.array(sizes, np.int32))
        # Group sizes are data: close over them as a constant, as the Tessera plan's host
        # metadata is (the kernel's visit count is static either way).
        f = lambda lhs, rhs: _gmm(lhs, rhs, gs, preferred_element_type=jnp.float32, tiling=tiling)  # noqa: E731
        return f, [S((i("m"), i("k")), dtype), S((len(sizes), i("k"), i("n")), dtype)]
    if kernel == "splash":
        import numpy as np
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        h, s, d = i("h"), i("s"), i("d")
        r, c = np.arange(s)[:, None], np.arange(s)[None, :]
        kind, _, arg = p.get("mask", "causal").partition(":")
        mask = {"causal": c <= r, "full": np.ones((s, s), bool), "local": (c <= r) & (r - c <= int(arg or 0)),
                "chunked": (c <= r) & (r // max(int(arg or 1), 1) == c // max(int(arg or 1), 1))}[kind]
        sizes = sk.BlockSizes(block_q=i("bq"), block_kv=i("bk"), block_kv_compute=i("bk"))
        kernel_fn = sk.make_splash_mha_single_device(np.broadcast_to(mask, (h, s, s)), block_sizes=sizes)
        f = lambda q, k, v: kernel_fn(q, k, v)  # noqa: E731
        return f, [S((h, s, d), dtype)] * 3
    raise SystemExit(f"unknown kernel {kernel!r}: matmul | flash | flash_res | flash_train | gmm | splash")


def child(target, case):
    """Runs in a fresh process: flags set before jax is imported."""
    work = tempfile.mkdtemp(prefix="pallas-cost-")
    llo, prof, flags = tpu_compile.profile_dirs(work)
    tpu_compile.add_libtpu_flags(flags)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    topo = topologies.get_topology_desc(topology_name=tpu_compile.topology_for(target), platform="tpu")
    mesh = Mesh(np.array([topo.devices[0]]), ("x",))
    sharding = NamedSharding(mesh, P())
    f, shapes = build(*parse_case(case))
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
    jax.jit(f).lower(*args).compile()
    result = tpu_compile.read_profile(llo, prof)
    shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.target, a.cases[0])))
        return 0
    all_ok = True
    for case in a.cases:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--target", a.target, case],
                           capture_output=True, text=True)
        line = next((l for l in reversed(r.stdout.splitlines()) if l.startswith("{")), None)
        if r.returncode == 0 and line:
            out = {"case": case, "target": a.target, "ok": True, "error": None, "profile": json.loads(line)}
        else:
            all_ok = False
            out = {"case": case, "target": a.target, "ok": False, "profile": None,
                   "error": tpu_compile.trim_error(r.stderr[-4000:] or f"exit status {r.returncode}")}
        print(json.dumps(out), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
