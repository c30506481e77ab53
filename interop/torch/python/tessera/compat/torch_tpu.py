"""TorchTPU's own kernel ops (`torch.tpu.ops.*`, which need JAX there) under their names and
argument names, on Tessera's kernels: a model written against TorchTPU's op set runs with
no JAX installed, on the CPU, the emulated `tpu` device and TorchTPU's `tpu` device.

    from tessera.compat import torch_tpu as tpu_ops
    out = tpu_ops.ragged_dot(lhs, rhs, group_sizes)

Covered: `ragged_dot`, `ragged_dot_weight_grad` (Tessera's gmm / tgmm), `splash_sdpa`
for causal and full masks, local (sliding-window) masks, GQA, and an explicit scale
(Tessera's flash attention with its window, whose backward is Tessera's), and
`scaled_mm_1x128_128x128`, the blockwise-scaled fp8 matmul (Tessera's
`scaled_mm_blockwise`; its training forms are `torch.ops.tpu.scaled_mm_blockwise` with
`transpose_rhs=True`, `scaled_mm_blockwise_wgrad` and the quantizers `quantize_fp8_1x128` /
`quantize_fp8_128x1`). Not yet: `scaled_mm_1x128_128x128`'s fused `bias`, which raises
NotImplementedError saying so. Block-size arguments are accepted and ignored: Tessera picks
its blocks per generation.
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


def scaled_mm_1x128_128x128(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    tile_m: Optional[int] = None,
    tile_n: Optional[int] = None,
    tile_k: Optional[int] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Blockwise-scaled fp8 matmul, TorchTPU's recipe (its Pallas kernel
    `torch_tpu/_internal/ops/scaled_mm/kernels/blockwise128_scaled_mm_kernel.py`):
    `a [M, K]` fp8 (float8_e4m3fn or float8_e5m2) with float32 `scale_a [M, K // 128]`
    (1x128: one scale per row per 128-wide K block), `b [K, N]` fp8 (K-major) with float32
    `scale_b [K // 128, ceil(N / 128)]` (128x128 tiles); the scales multiply (dequantization
    factors, not reciprocals): `out[m, n] = sum_kb scale_a[m, kb] * scale_b[kb, n // 128] *
    sum_{k in kb} a[m, k] * b[k, n]`, accumulated in float32, returned in bfloat16.

    K must be a multiple of 128 (TorchTPU's precondition too; zero-pad K and the scales
    otherwise); M and N are free. fp8 is multiplied natively on tpu7x and up-converted to
    bf16 (exactly) on v5e/v5p/v6e. `out_dtype` other than bfloat16 and a fused `bias` are
    not supported (a clear error says so); the tile arguments are accepted and ignored. Not
    differentiable (autograd into fp8 tensors would round the gradients to fp8): the training
    recipe's backward is `torch.ops.tpu.scaled_mm_blockwise(q_dout, b, s_dout, scale_b,
    transpose_rhs=True)` for dA and `torch.ops.tpu.scaled_mm_blockwise_wgrad` for dB, with
    `torch.ops.tpu.quantize_fp8_1x128` / `quantize_fp8_128x1` for their operands."""
    del tile_m, tile_n, tile_k
    if out_dtype != torch.bfloat16:
        raise ValueError(
            f"tessera.compat.torch_tpu.scaled_mm_1x128_128x128: out_dtype={out_dtype} is not supported; Tessera's "
            "scaled_mm_blockwise writes bfloat16 (the recipe's default): pass out_dtype=torch.bfloat16"
        )
    if bias is not None:
        raise NotImplementedError(
            "tessera.compat.torch_tpu.scaled_mm_1x128_128x128: a fused bias is not built yet (TorchTPU adds it in "
            "float32 before the bfloat16 cast); call without bias"
        )
    return torch.ops.tpu.scaled_mm_blockwise(a, b, scale_a, scale_b)
