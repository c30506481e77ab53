"""Launches of transformers' Mixtral sparse-MoE block under DEFER_AND_FUSE, forward and
backward, beside the aten ops strict eager dispatches, for each experts implementation
(`grouped_mm`, `eager`); the outputs and input gradients are checked against strict's first.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONPATH=<the installed wheel> .venv/bin/python scripts/moe_launches.py
"""
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))

import torch  # noqa: E402
import transformers  # noqa: E402

import tessera  # noqa: E402
from tessera import fusion  # noqa: E402
from fusion_workloads import CountAten  # noqa: E402
from test_fusion_models import report  # noqa: E402

torch.set_num_threads(1)
for impl in ("grouped_mm", "eager"):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation=impl)
    moe = model.model.layers[0].mlp
    x = torch.randn(2, 24, 64)

    def step():
        moe.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        y = moe(xr)
        y = y[0] if isinstance(y, tuple) else y
        y.square().mean().backward()
        return y.detach().clone(), xr.grad.clone()

    want = step()
    with CountAten() as count:
        step()
    fusion.reset_stats()
    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        got = step()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    report(f"Mixtral sparse-MoE block ({impl} experts) fwd+bwd", count.n)
