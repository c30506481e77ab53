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
    ops = [n for n, s in SPECS.items() if s.alias_of is None and s.native is _native]
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
    worker = os.path.join(os.path.dirname(__file__), "dtensor_worker.py")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TESSERA_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, worker, str(WORLD), str(_free_port()), str(TIMEOUT - 30)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = report["ranks"]
    assert len(ranks) == WORLD, f"only ranks {[r['rank'] for r in ranks]} reported (exit codes {report['exitcodes']}):\n{proc.stderr[-4000:]}"
    failures = {f"rank {r['rank']} {case}": err for r in ranks for case, err in r["failed"].items()}
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    cases = {"llama_tp", "moe_ep", "wrong_placements", "llama_dp_x_tp"}
    assert all(set(r["passed"]) == cases for r in ranks), ranks
    print(f"4 ranks, {sorted(cases)}: {elapsed:.1f} s; per case (rank 0) {ranks[0]['times']}")
