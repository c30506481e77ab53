"""The DeferAndFuse acceptance workloads in plain torch ops, and the strict aten-op counter
their launch ratios are measured against, shared by the fusion tests
(scripts/bench_fusion.py keeps its own copy of the workloads so it runs without the test tree)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def chain(x):
    """The 8-op elementwise chain of the issue's CPU speed and memory points."""
    y = x * 1.5 + 0.25
    y = torch.tanh(y)
    y = y * y
    y = torch.exp(-y)
    y = torch.maximum(y, x)
    y = torch.sigmoid(y) - 0.5
    return y.clamp(min=-0.2, max=0.4)


class CountAten(TorchDispatchMode):
    """Counts the aten ops strict eager dispatches (`n`)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
