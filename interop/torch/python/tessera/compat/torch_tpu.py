"""TorchTPU's own kernel ops (`torch.tpu.ops.*`, which need JAX there) under their names and
argument names, on Tessera's kernels: a model written against TorchTPU's op set runs with
no JAX installed, on the CPU, the emulated `tpu` device and TorchTPU's `tpu` device.

    from tessera.compat import torch_tpu as tpu_ops
    out = tpu_ops.ragged_dot(lhs, rhs, group_sizes)

Covered: `ragged_dot`, `ragged_dot_weight_grad` (Tessera's gmm / tgmm) and `splash_sdpa`
for causal and full masks, local (sliding-window) masks, GQA, and an explicit scale
(Tessera's flash attention with its window, whose backward is Tessera's). Not yet:
`scaled_mm_1x128_128x128` (blockwise-scaled fp8), which raises NotImplementedError saying
so. Block-size arguments are accepted and ignored: Tessera picks its blocks per generation.
"""

from __future__ import annotations

from typing import Optional

import torch

import tessera  # noqa: F401  (registers torch.ops.tpu.*)

__all__ = ["ragged_dot", "ragged_dot_weight_grad", "splash_sdpa", "scaled_mm_1x128_128x128"]


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`result[start_i:end_i] = lhs[start_i:end_i] @ rhs[i]` for consecutive row groups of
    `group_sizes[i]` rows (`lhs [m, k]`, `rhs [g, k, n]`); differentiable in `lhs` and `rhs`
    when `out` is not given, as TorchTPU's."""
    result = torch.ops.tpu.gmm(lhs, rhs, group_sizes)
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(f"tessera.compat.torch_tpu.ragged_dot: out is {tuple(out.shape)}, the result {tuple(result.shape)}")
    with torch.no_grad():
        out.copy_(result)
    return out


def ragged_dot_weight_grad(lhs: torch.Tensor, grad_output: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """`result[i] = lhs[start_i:end_i].T @ grad_output[start_i:end_i]`: `[g, k, n]`."""
    return torch.ops.tpu.tgmm(lhs, grad_output, group_sizes)


def splash_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    is_causal: bool = True,
    local_window_size: Optional[int] = None,
    enable_gqa: bool = False,
    **blocks,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)` for `[b, h, s, d]`
    tensors (`k`, `v` with `h / g` heads under GQA), differentiable in q, k and v.

    `local_window_size = w`: a local mask as JAX splash attention's `LocalMask(window_size=(w,
    0 if is_causal else w))`, which TorchTPU's splash_sdpa builds on: query `r` sees key `c`
    iff `r - w <= c` (and `c <= r` when causal, else `c <= r + w`), i.e. `w` keys before the
    query plus its own (`window_left = w`, `window_right = w` when not causal). This is one
    more key than transformers' `sliding_window = w` (`window_left = w - 1`). (My reading of
    TorchTPU's argument: its source was not available to check; the JAX mask it wraps is.)
    Blocks outside the window are skipped (no compute, no DMA)."""
    unknown = set(blocks) - _BLOCK_ARGS
    if unknown:
        raise TypeError(f"splash_sdpa() got unexpected keyword arguments {sorted(unknown)}")
    window_left = window_right = None
    if local_window_size is not None:
        if isinstance(local_window_size, bool) or not isinstance(local_window_size, int) or local_window_size < 0:
            raise ValueError(
                f"tessera.compat.torch_tpu.splash_sdpa: local_window_size must be a non-negative int (keys before "
                f"the query), got {local_window_size!r}"
            )
        window_left = local_window_size
        window_right = None if is_causal else local_window_size
    heads, kv_heads = q.shape[1], k.shape[1]
    if enable_gqa != (heads != kv_heads):
        raise ValueError(f"enable_gqa ({enable_gqa}) does not match inputs: n_heads={heads}, n_kv_heads={kv_heads}")
    return torch.ops.tpu.flash_attention(q, k, v, causal=is_causal, sm_scale=scale, window_left=window_left, window_right=window_right)


_BLOCK_ARGS = {
    "block_q", "block_kv", "block_dkv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
    "block_q_dq", "block_kv_dq", "use_fused_bwd_kernel", "use_vmap_bwd", "q_layout", "k_layout", "v_layout",
}


def scaled_mm_1x128_128x128(*args, **kwargs):
    """Blockwise-scaled fp8 matmul (1x128 activation scales, 128x128 weight scales)."""
    raise NotImplementedError(
        "tessera.compat.torch_tpu.scaled_mm_1x128_128x128: Tessera's blockwise-scaled fp8 matmul is not built yet"
    )
