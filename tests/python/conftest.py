"""Shared fixtures of the Python tests (tests/python/test_*.py).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The libtpu tier of the fusion tests (test_fusion_libtpu.py): every flush of the session
# writes its kernels here as StableHLO modules, and that test (ordered last) compiles them.
if os.environ.get("TESSERA_TPU_ORACLE") == "1" and not os.environ.get("TESSERA_FUSION_MODULES"):
    os.environ["TESSERA_FUSION_MODULES"] = tempfile.mkdtemp(prefix="tessera-fusion-modules-")
    atexit.register(shutil.rmtree, os.environ["TESSERA_FUSION_MODULES"], True)


def pytest_collection_modifyitems(items):
    """test_fusion_libtpu.py runs after every test that may generate a fused kernel."""
    items.sort(key=lambda item: item.path.name == "test_fusion_libtpu.py")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state (tests draw their own seeds too)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_churn_counts():
    """Each test starts with no churn history: the mode counts a structure's variants (shapes,
    Python numbers) for the process, so other tests' `x * 2.0`, `x * 3.0`, ... would make a
    test's first `x * c` churn and run per op, depending on which tests ran before it."""
    import sys

    fusion = sys.modules.get("tessera.fusion")
    if fusion is not None:
        fusion._variants.clear()


@pytest.fixture
def fresh_dynamo():
    """A clean torch.compile cache before and after the test (compile counts stay exact)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
