"""DeferAndFuse's own cost per recorded op: 800 small pointwise ops (`[8, 128]` f32) recorded
and flushed (one cached program), medians of N, microseconds per op. What the mode adds on top
of the kernels; compare two versions of `tessera/fusion.py` by swapping the installed file.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONPATH=<the installed wheel> .venv/bin/python scripts/bench_recording.py [N]
"""
import os
import sys
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

import tessera  # noqa: E402
from tessera import fusion  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 7
OPS = 800
torch.set_num_threads(1)
x = torch.randn(8, 128)


def chain():
    y = x
    for _ in range(OPS // 2):
        y = y * 1.0001 + 0.5
    return y


def recorded():
    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        y = chain()
        fusion.flush()
    return y


want = chain()
for _ in range(2):  # compile once, warm the caches
    torch.testing.assert_close(recorded(), want)
times = []
for _ in range(N):
    t0 = time.perf_counter()
    recorded()
    times.append(time.perf_counter() - t0)
print(f"{sorted(times)[N // 2] * 1e6 / OPS:.2f} us per recorded op (median of {N}, {OPS} ops, flush included)")
