"""`torch.ops.tpu.*` under DTensor (`tessera.dtensor`): the sharding rules.

- every op has rules (or is replicate-only) that derive cleanly from its contract, on
  every case of the op table;
- each rule, simulated in one process: the inputs split as the rule places them, the op
  run on each shard, the outputs assembled from their placements (concatenated, summed for
  `Partial`, any one for `Replicate`) equal the op on the whole inputs;
- 4 processes (gloo on CPU, `dtensor_worker.py`, one import forked into the ranks): a
  Llama-style block (RMSNorm, RoPE, GQA flash attention, SwiGLU) under
  `parallelize_module` on a 1-D mesh of 4 and a 2x2 data x tensor parallel mesh, an MoE
  block with experts sharded through gmm, and placements the rules do not take
  (redistributed or a clear error); forward and backward against the single-process run
  of the same weights and, once, plain torch math.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_dtensor.py
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("tessera")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import tessera.dtensor as tdt  # noqa: E402
from tessera import _native  # noqa: E402
from tessera._ops import SPECS  # noqa: E402

WORLD = 4
TIMEOUT = 150  # seconds for the whole 4-rank run; a hang fails the test, never blocks CI


def test_every_op_has_rules_fitting_its_contract():
    ops = [n for n, s in SPECS.items() if not s.composite and s.native is _native]
    missing = [n for n in ops if n not in tdt.RULES and n not in tdt.REPLICATE_ONLY]
    assert not missing, f"ops with neither sharding rules nor a documented replicate fallback: {missing}"
    assert not set(tdt.RULES) - set(SPECS), "rules for ops that do not exist"
    for name in ops:
        spec = SPECS[name]
        for case, given, shapes in _native.op_cases(name):
            statics = {spec.arg_names[i]: spec.defaults[i] for i in spec.static_idx}
            statics.update(_parse_statics(given))
            # Raises ShardingRuleError for a rule that does not fit (an output left unplaced).
            variants = tdt.placements_for(name, dict(zip(spec.input_names, shapes)), statics)
            assert len(variants) >= len(tdt.RULES.get(name, ())), (name, case)



def test_collective_kernels_refuse_bad_groups_by_name():
    """The native entry of the collective ops (one process, no group): what it refuses, it
    names (the op, the device, the rule), never a hang or a wrong tensor."""
    x = torch.ones(4, 8)
    with pytest.raises(ValueError, match="device 1 of a group of 1"):
        _native.run_collective("all_gather", [[x]], 1, "v6e")
    with pytest.raises(ValueError, match="device 0 of a group of 0"):
        _native.run_collective("all_gather", [], 0, "v6e")
    # A group of one: the collective is the identity (as torch.distributed's are).
    y = torch.randn(4, 8)
    (one,) = _native.run_collective("reduce_scatter", [[y[None]]], 0, "v6e")
    assert torch.equal(one, y)
    with pytest.raises(ValueError, match="device 1's operands .* differ from device 0's"):
        _native.run_collective("all_gather", [[x], [torch.ones(5, 8)]], 0, "v6e")
    with pytest.raises(ValueError, match="no collective"):
        _native.run_collective("all_reduce", [[x], [x]], 0, "v6e")
    with pytest.raises(ValueError, match="x has 3 chunks for a group of 2"):
        _native.run_collective("reduce_scatter", [[torch.ones(3, 4, 8)], [torch.ones(3, 4, 8)]], 1, "v6e")
    # Two devices, in one process: device 1's all-gather is both shards.
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    (out,) = _native.run_collective("all_gather", [[a], [b]], 1, "v6e")
    assert torch.equal(out, torch.stack([a, b]))
    # Overlapping writes into one device's result: the simulator's race, named.
    meta = [torch.tensor(v, dtype=torch.int32) for v in ([0, 0], [2, 2], [0, 0], [2, 2])]
    with pytest.raises(ValueError, match="remote-buffer-race"):
        _native.run_collective("ragged_all_to_all", [meta + [torch.randn(4, 8)], meta + [torch.randn(4, 8)]], 0, "v6e", out_rows=4)


def test_collective_helpers_need_a_process_group():
    """Before init_process_group, the helpers' default group is refused by name (was an
    AttributeError on the world group's None)."""
    import tessera.distributed as tdist

    assert not torch.distributed.is_initialized()
    for f in (tdist.all_gather, tdist.reduce_scatter):
        with pytest.raises(ValueError, match=f"tessera.distributed.{f.__name__}: the default process group has not been initialized"):
            f(torch.randn(4, 8))


def _parse_statics(text):
    """A case's statics, `"transpose_rhs=True num_experts=7"` (only bools and ints matter here)."""
    out = {}
    for item in text.replace(",", " ").split():
        k, _, v = item.partition("=")
        out[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_on_4_ranks():
    # The emulated `tpu` device's extension, built (or found in TESSERA_CACHE_DIR) once here,
    # so the ranks only load it.
    from tessera import emulated_tpu

    emulated_tpu.enable()
    worker = os.path.join(os.path.dirname(__file__), "dtensor_worker.py")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TESSERA_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, worker, str(WORLD), str(_free_port()), str(TIMEOUT - 30)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    failures = [f"rank {r['rank']} {r['case']}: {r['error']}" for r in results if r["error"]]
    assert not failures, "\n".join(failures)
    cases = {"llama_tp", "moe_ep", "collectives", "ragged_all_to_all", "moe_a2a", "collectives_on_tpu", "wrong_placements", "user_op", "llama_dp_x_tp"}
    done = {(r["rank"], r["case"]) for r in results}
    missing = sorted({(rank, c) for rank in range(WORLD) for c in cases} - done)
    assert not missing, f"(rank, case) never finished (hung or died; exit codes {report['exitcodes']}): {missing}\n{proc.stderr[-3000:]}"
    times = {r["case"]: r["time"] for r in results if r["rank"] == 0}
    print(f"4 ranks: {elapsed:.1f} s; per case (rank 0): {times}")


# ---- each rule simulated in one process ------------------------------------------------------

# Small shapes per op (its tensor inputs in schema order) and the case whose statics and
# input generator (the op table's, contract-respecting: labels, group sizes, page tables)
# are used; `None` takes the op's first case.
SIM = {
    "matmul": (None, [[8, 16], [16, 8]]),
    "matmul_bwd": (None, [[8, 16], [16, 8], [8, 8]]),
    "quantized_matmul": (None, [[8, 16], [8, 16], [8]]),
    "quantized_matmul_dx": (None, [[8, 8], [8, 16], [8]]),
    "matmul_int4": (None, [[8, 128], [64, 16], [4, 16]]),
    "matmul_mxfp4": (None, [[8, 128], [64, 16], [4, 16]]),
    "matmul_nvfp4": (None, [[8, 128], [64, 16], [8, 16], [1]]),
    "matmul_int4_dx": (None, [[8, 16], [64, 16], [4, 16]]),
    "matmul_mxfp4_dx": (None, [[8, 16], [64, 16], [4, 16]]),
    "matmul_nvfp4_dx": (None, [[8, 16], [64, 16], [8, 16], [1]]),
    "int_mm": (None, [[8, 16], [16, 8]]),
    "gelu_affine": (None, [[2, 4, 16], [16], [16]]),
    "gelu_affine_bwd": (None, [[8, 16], [16], [16], [8, 16]]),
    "softmax": (None, [[4, 16]]),
    "softmax_bwd": (None, [[4, 16], [4, 16]]),
    "rmsnorm": (None, [[2, 4, 16], [16]]),
    "rmsnorm_bwd": (None, [[8, 16], [16], [8, 16]]),
    "rmsnorm_residual": (None, [[8, 16], [8, 16], [16]]),
    "rmsnorm_residual_bwd": (None, [[8, 16], [16], [8, 16], [8, 16]]),
    "layernorm": (None, [[8, 16], [16], [16]]),
    "layernorm_bwd": (None, [[8, 16], [16], [8, 16]]),
    "swiglu": (None, [[4, 16], [4, 16]]),
    "swiglu_bwd": (None, [[4, 16], [4, 16], [4, 16]]),
    "geglu": (None, [[4, 16], [4, 16]]),
    "geglu_bwd": (None, [[4, 16], [4, 16], [4, 16]]),
    "rope": (None, [[8, 4, 16], [8]]),
    "rope_bwd": (None, [[8, 4, 16], [8]]),
    "cross_entropy": (None, [[8, 32], [8]]),
    "cross_entropy_bwd": (None, [[8, 32], [8], [8, 1], [8]]),
    "cross_entropy_with_grad": (None, [[8, 32], [8]]),
    "gmm": ("transposed", [[16, 16], [4, 8, 16], [4]]),
    "tgmm": (None, [[16, 16], [16, 8], [4]]),
    "gmm_bwd": (None, [[16, 16], [4, 16, 8], [4], [16, 8]]),
    "router_topk": (None, [[8, 4]]),
    "permute": (None, [[8, 16], [8, 2]]),
    "permute_bwd": (None, [[16, 16], [8, 2]]),
    "combine": (None, [[16, 16], [8, 2], [8, 2]]),
    "flash_attention_fwd": ("causal_alt", [[2, 4, 8, 16], [2, 2, 8, 16], [2, 2, 8, 16]]),
    "flash_attention": ("causal_alt", [[2, 4, 8, 16], [2, 2, 8, 16], [2, 2, 8, 16]]),
    "flash_attention_bwd": ("causal_alt", [[2, 4, 8, 16], [2, 2, 8, 16], [2, 2, 8, 16], [2, 4, 8, 16], [2, 4, 8], [2, 4, 8, 16]]),
    # Splash: 8 x 8 blocks over 16 queries and keys (2 x 2 blocks), random walks.
    "splash_attention_fwd": (None, [[2, 4, 16, 16], [2, 2, 16, 16], [2, 2, 16, 16], [2, 8, 8], [3, 1, 2, 2], [3, 1, 2, 2]]),
    "splash_attention": (None, [[2, 4, 16, 16], [2, 2, 16, 16], [2, 2, 16, 16], [2, 8, 8], [3, 1, 2, 2], [3, 1, 2, 2]]),
    "splash_attention_bwd": (None, [[2, 4, 16, 16], [2, 2, 16, 16], [2, 2, 16, 16], [2, 4, 16, 16], [2, 4, 16], [2, 4, 16, 16], [2, 8, 8], [3, 1, 2, 2], [3, 1, 2, 2]]),
    "paged_attention": (None, [[2, 4, 16], [2, 8, 16, 16], [2, 8, 16, 16], [2], [2, 4]]),
    "ragged_paged_attention": (None, [[16, 4, 16], [2, 8, 16, 16], [2, 8, 16, 16], [2], [2, 4], [3], [1]]),
    "scaled_mm_blockwise": (None, [[16, 256], [256, 128], [16, 2], [2, 1]]),
    "scaled_mm_blockwise_wgrad": (None, [[256, 256], [256, 256], [2, 256], [2, 256]]),
    "quantize_fp8_1x128": (None, [[16, 256]]),
    "quantize_fp8_128x1": (None, [[256, 64]]),
}
SHARDS = 2


def _sim_ids():
    return [n for n, s in SPECS.items() if not s.composite and s.native is _native]


def test_every_op_is_simulated():
    assert set(SIM) == set(_sim_ids())


@pytest.mark.parametrize("name", sorted(SIM))
def test_rule_simulated(name):
    """Every rule of `name`: inputs split as placed, the op per shard, outputs assembled
    from their placements, equal to the op on the whole inputs (exact for ints)."""
    spec = SPECS[name]
    case, shapes = SIM[name]
    case = case or _native.op_cases(name)[0][0]
    tensors, statics = _native.sample(name, case, "float32", 7, shapes)
    inputs = dict(zip(spec.input_names, tensors))
    statics = dict(zip((spec.arg_names[i] for i in spec.static_idx), statics))
    op = getattr(torch.ops.tpu, name)

    def call(values):
        args = [values.get(a, statics.get(a)) for a in spec.arg_names]
        return spec.as_tuple(op(*args))

    variants = tdt.placements_for(name, {n: tuple(t.shape) for n, t in inputs.items()}, statics)
    assert variants, name
    for v in variants:
        given = dict(inputs)
        if v.aligned is not None:  # expert rule: each shard's rows are exactly its groups'
            g, m = given["group_sizes"].shape[0], given[v.aligned[0]].shape[0]
            per = [torch.tensor([1] * (g // SHARDS - 1) + [m // SHARDS - (g // SHARDS - 1)]) for _ in range(SHARDS)]
            given["group_sizes"] = torch.cat([p.roll(i) for i, p in enumerate(per)]).to(torch.int32)
        whole = call(given)
        pieces = [
            call({n: (t.chunk(SHARDS, v.inputs[n][1])[r] if v.inputs[n] != "replicate" else t) for n, t in given.items()})
            for r in range(SHARDS)
        ]
        for i, (want, place) in enumerate(zip(whole, v.outputs)):
            got_all = [p[i] for p in pieces]
            if place == "partial":
                got = sum(g.double() for g in got_all).to(want.dtype)
            elif place == "replicate":
                got = got_all[0]
                assert all(torch.equal(g, got) for g in got_all), (name, v.rule.dims, i)
            else:
                got = torch.cat(got_all, place[1])
            what = f"{name} rule {v.rule.dims} ({v.inputs}) output {spec.outputs[i][0]} ({place})"
            if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no fp8 arithmetic on the CPU
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
            elif want.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=what)
            else:
                assert torch.equal(got, want), what
