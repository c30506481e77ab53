"""The DeferAndFuse acceptance workloads in plain torch ops, shared by the fusion tests
(scripts/bench_fusion.py keeps its own copy so it runs without the test tree)."""
import torch


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
