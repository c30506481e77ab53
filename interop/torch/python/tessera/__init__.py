"""Tessera: TPU kernels written in Rust, as ordinary PyTorch ops.

`import tessera` registers every kernel of the library in the `tpu` namespace:
`torch.ops.tpu.flash_attention(q, k, v, causal=True)`, `torch.ops.tpu.rmsnorm(x, w)`, ...
They run on CPU tensors (the kernels on Tessera's interpreter), on TorchTPU's `tpu`
device (the kernels compiled for the TPU), and on the emulated host-memory `tpu` device
(`tessera.emulated_tpu.enable()`, for tests). See `tessera.ops()` for the list.
"""

from tessera import _native
from tessera._ops import SPECS, get_target, register_ops, set_target

__version__ = _native.__version__


def ops():
    """`{name: schema}` of every registered op (`torch.ops.tpu.<name>`)."""
    return {name: f"tpu::{name}{spec.schema}" for name, spec in SPECS.items()}


__all__ = ["ops", "register_ops", "set_target", "get_target", "__version__"]
