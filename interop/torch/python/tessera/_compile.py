"""`torch.compile(model, backend="tessera")`: AOTAutograd's forward and backward aten graphs
run under DEFER_AND_FUSE, so their fusible runs become generated Tessera kernels (partitioned
by the fusion planner, cached by structure) and every other op stays aten.

Each call of a compiled graph is one recording: the graph's outputs (and the activations
AOTAutograd saves for backward) are the live results at the flush when the call returns;
intermediates are never written. New shapes (and `dynamic=True`) need nothing special: the
engine's programs are keyed by shape, so a new shape is a new cache entry, not an error.

The backend is found through the `torch_dynamo_backends` entry point (pyproject.toml), so
`import tessera` does not import dynamo.
"""

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from tessera import fusion


def _deferred(gm: torch.fx.GraphModule, example_inputs):
    def run(*args):
        with fusion.set_eager_mode(fusion.EagerMode.DEFER_AND_FUSE):
            return gm(*args)

    return make_boxed_func(run)


_backend = aot_autograd(fw_compiler=_deferred, bw_compiler=_deferred)


def tessera_backend(gm, example_inputs, **kwargs):
    """The `tessera` torch.compile backend (see the module docs)."""
    return _backend(gm, example_inputs, **kwargs)
