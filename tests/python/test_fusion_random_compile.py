"""The random op graphs of `test_fusion_random.py` under `torch.compile(backend="tessera")`,
forward and backward: 500 programs by default (`TESSERA_FUSION_COMPILE_EXAMPLES`), in
compiled functions of 50 (`TESSERA_FUSION_COMPILE_BATCH`): dynamo and AOTAutograd cost
~0.1 s a program, so a function per program would be minutes more. Each batch asserts that
nothing fell back to an eager replay and that dynamo never gave up on a frame (which would
compare eager with eager). About 1.5 min on one core, sized for the test command's budget
(the eager tier runs 2,000 forward and 1,000 backward of the same generator); pytest's
second worker runs the other files meanwhile.

    TESSERA_FUSION_COMPILE_EXAMPLES=10000 ... pytest tests/python/test_fusion_random_compile.py
"""
import os

import pytest
import torch

from tessera import fusion
# The generator, the runner and the comparison are the eager tier's; so are its module
# fixtures (every shape on the fused path, torch on one thread).
from test_fusion_random import GRAD_LOW_TOL, _no_churn_limit, _one_thread, close, inputs_of, program_of, run, runs_cleanly  # noqa: F401

COMPILE_EXAMPLES = int(os.environ.get("TESSERA_FUSION_COMPILE_EXAMPLES", "500"))
_compiled = [0]

COMPILE_BATCH = int(os.environ.get("TESSERA_FUSION_COMPILE_BATCH", "50"))  # programs per compiled function


def loss_of(pool):
    terms = [(t.float() * (k + 1) * 0.01).sum() for k, (t, _, _) in enumerate(pool) if t.dtype != torch.bool and t.requires_grad]
    return sum(terms) if terms else None


@pytest.mark.parametrize("batch", range(max(1, COMPILE_EXAMPLES // COMPILE_BATCH)))
def test_random_graphs_under_torch_compile(batch, fresh_dynamo):
    """A batch of random programs (in-place ops and views included) in one function under
    `torch.compile(backend="tessera")`, forward and backward: the leaves require grad and the
    loss is taken outside the compiled function, so backward runs AOTAutograd's compiled
    backward graph (AOTAutograd functionalizes the in-place ops)."""
    # Programs none of whose ops raise: dynamo gives up on a frame whose tracing raises (even
    # inside a try) and runs it eagerly, which would compare eager with eager.
    progs, seed = [], 1_000_003 * batch * COMPILE_BATCH + 17
    while len(progs) < COMPILE_BATCH:
        p = program_of(seed)
        seed += 1
        if runs_cleanly(p, inputs_of(p, 2)):
            progs.append(p)
    data = [inputs_of(p, 2) for p in progs]

    def leaves():
        return [[t.clone().requires_grad_(True) for t in ts] for ts in data]

    def f(*flat):
        out, k = [], 0
        for p in progs:
            n = len(p[0])
            out.append([t for t, _, _ in run(p, flat[k:k + n], requires_grad=True, copy=False)])
            k += n
        return out

    def check(fn):
        ls = leaves()
        got = fn(*[t for ts in ls for t in ts])
        loss = loss_of([(t, 0, 0) for ts in got for t in ts])
        if loss is not None:
            loss.backward()
        return got, [t.grad for ts in ls for t in ts]

    want_pools = [run(p, ts, requires_grad=True) for p, ts in zip(progs, data)]
    want, want_grads = check(f)
    fusion.reset_stats()
    # A program that reads a value (`float(...)`) breaks the graph inside `run`, whose frame
    # dynamo then compiles once per program: past its recompile limit (8) it would run the
    # rest eagerly and compare eager with eager. Raise the limit, and fail if it is hit.
    limits = dict(recompile_limit=4 * COMPILE_BATCH, accumulated_recompile_limit=8 * COMPILE_BATCH, fail_on_recompile_limit_hit=True)
    with torch._dynamo.config.patch(**limits):
        got, grads = check(torch.compile(f, backend="tessera"))
    s = fusion.stats()
    assert not s["fallbacks"] and not s["shape_churn"] and s["kernels_launched"] > 0, s
    _compiled[0] += len(progs)
    for gp, wp, pool in zip(got, want, want_pools):
        assert len(gp) == len(wp)
        for g, w, (_, ex, low) in zip(gp, wp, pool):
            close(g.detach(), w.detach(), ex, low)
    low = any(lo for pool in want_pools for _, _, lo in pool)
    for g, w in zip(grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            close(g, w, False, low, GRAD_LOW_TOL)


def test_ran_as_many_programs_as_configured():
    """(Runs last, in file order.) The tier compared as many programs as it was set to."""
    if _compiled[0] == 0:
        pytest.skip("run with the whole file")
    print(f"\nrandom graphs under torch.compile(backend='tessera'): {_compiled[0]} forward+backward")
    assert _compiled[0] >= COMPILE_BATCH * (COMPILE_EXAMPLES // COMPILE_BATCH), _compiled
