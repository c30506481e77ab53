"""Tessera: TPU kernels written in Rust, as ordinary PyTorch ops.

`import tessera` registers every kernel of the library in the `tpu` namespace:
`torch.ops.tpu.flash_attention(q, k, v, causal=True)`, `torch.ops.tpu.rmsnorm(x, w)`, ...
They run on CPU tensors (the kernels on Tessera's interpreter), on TorchTPU's `tpu`
device (the kernels compiled for the TPU), and on the emulated host-memory `tpu` device
(`tessera.emulated_tpu.enable()`, for tests). See `tessera.ops()` for the list.
"""

from tessera import _native
from tessera._ops import SPECS, get_target, load_tuning_table, register_ops, set_target

from tessera import fusion, quant4, splash
from tessera.fusion import EagerMode, get_eager_mode, set_eager_mode

__version__ = _native.__version__

import sys as _sys

import torch.distributed as _dist

if _dist.is_available():
    # torch.ops.tpu.{all_gather, reduce_scatter, all_gather_matmul, ragged_all_to_all}
    from tessera import distributed  # noqa: F401

if "torch.distributed.tensor" in _sys.modules:
    # DTensor already loaded: register the ops' sharding rules now (else `import tessera.dtensor`).
    from tessera import dtensor  # noqa: F401


def ops():
    """`{name: schema}` of every registered op (`torch.ops.tpu.<name>`)."""
    return {name: f"tpu::{name}{spec.schema}" for name, spec in SPECS.items()}


def cache_info():
    """Every cache's entries, capacity, hits and misses: `plans` (native, by op, statics,
    input types and target; `TESSERA_PLAN_CACHE`), `cpu_code` (the compiled CPU backend's
    kernels; `TESSERA_JIT_CACHE`) and `modules` (lowered TPU modules; `TESSERA_MODULE_CACHE`).
    All are LRU, 256 entries by default."""
    from tessera import _tpu

    info = _native.cache_info()
    info["modules"] = _tpu._modules.info()
    return info


__all__ = ["fusion", "splash", "EagerMode", "set_eager_mode", "get_eager_mode", "ops", "cache_info", "register_ops", "load_tuning_table", "set_target", "get_target", "__version__"]
