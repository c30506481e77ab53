"""Shared fixtures of the Python tests (tests/python/test_*.py).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state (tests draw their own seeds too)."""
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """A clean torch.compile cache before and after the test (compile counts stay exact)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
