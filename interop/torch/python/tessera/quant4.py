"""4-bit weights for `torch.ops.tpu.matmul_int4 / matmul_mxfp4 / matmul_nvfp4`.

The kernels compute `x @ W` for a K-major weight `W [k, n]` (a `Linear` weight is `W.T`)
stored as 4-bit codes in Tessera's *nibble-plane* packing: int8 `[k / 2, n]`, where byte
`(32 c + i, j)` holds `W[64 c + i, j]` in its low nibble and `W[64 c + 32 + i, j]` in its high
nibble. A 32-row slice of the packed block then unpacks into two whole 32-row tiles of `W`
with a mask and a shift (checkpoints pack consecutive K pairs into a byte, which would need a
lane shuffle on the TPU). Repack once, at load time:

    w, scale = tessera.quant4.quantize_mxfp4(linear.weight)        # from float weights
    w, scale = tessera.quant4.from_mx_blocks(blocks, scales)       # an OCP MX checkpoint (gpt-oss)
    y = torch.ops.tpu.matmul_mxfp4(x, w, scale)

Formats (scales are `[k / g, n]`, one per `g` consecutive weights of K):

- int4: signed codes -8..7, f32 or bf16 scales, any group size that is a multiple of 32;
- MXFP4 (OCP MX): E2M1 codes (±0, 0.5, 1, 1.5, 2, 3, 4, 6), E8M0 scale bytes (`2^(e - 127)`;
  passed as int8/uint8 bits or `torch.float8_e8m0fnu`), g = 32;
- NVFP4: E2M1 codes, `float8_e4m3fn` scales, g = 16, and one float32 global scale.

`dequantize` is the plain-torch definition the kernels are tested against.
"""

import torch

__all__ = ["E2M1_VALUES", "pack", "unpack", "quantize_int4", "quantize_mxfp4", "quantize_nvfp4", "from_mx_blocks", "dequantize"]

# E2M1 magnitudes by the code's low 3 bits; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_PLANE = 32


def _check_k(k):
    if k % 64:
        raise ValueError(f"tessera.quant4: K = {k} is not a multiple of 64 (the packing's 32-row nibble planes); pad K with zero weights")


def pack(codes):
    """4-bit codes `[k, n]` (integers 0..15, or -8..7 for int4) -> int8 `[k / 2, n]` in the
    nibble-plane packing."""
    k, n = codes.shape
    _check_k(k)
    c = (codes.to(torch.int32) & 15).reshape(k // 64, 2, _PLANE, n)
    return (c[:, 0] | (c[:, 1] << 4)).reshape(k // 2, n).to(torch.uint8).view(torch.int8)


def unpack(w):
    """int8 `[k / 2, n]` nibble planes -> codes `[k, n]` (0..15)."""
    kh, n = w.shape
    b = w.view(torch.uint8).to(torch.int32).reshape(kh // _PLANE, 1, _PLANE, n)
    return torch.cat([b & 15, b >> 4], dim=1).reshape(kh * 2, n)


def _e2m1_code(v):
    """Nearest E2M1 code of `v` (ties to the even mantissa, as the OCP spec rounds), saturating at ±6."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    a = v.double().abs().clamp(max=6.0).contiguous()
    # Midpoints between neighbours; a tie goes to the code with an even mantissa bit.
    idx = torch.bucketize(a, (mags[1:] + mags[:-1]) / 2)
    mid = (mags[idx.clamp(max=7)] + mags[(idx - 1).clamp(min=0)]) / 2
    tie_down = (a == mid) & (idx % 2 == 1)
    idx = torch.where(tie_down, idx - 1, idx)
    return (idx | torch.where(v < 0, 8, 0)).to(torch.int32)


def quantize_int4(weight, group_size=128, scale_dtype=torch.float32):
    """Symmetric int4 of a `Linear` weight `[n, k]`: scale = amax / 7 per `group_size` of K,
    codes = round(w / scale) in -8..7. Returns `(w int8 [k / 2, n], scale [k / g, n])`."""
    wt = weight.detach().double().T  # [k, n]
    k, n = wt.shape
    if group_size % 32 or k % group_size:
        raise ValueError(f"tessera.quant4.quantize_int4: group_size {group_size} must be a multiple of 32 dividing K = {k}")
    g = wt.reshape(k // group_size, group_size, n)
    scale = (g.abs().amax(1) / 7).clamp(min=1e-12).to(scale_dtype)
    codes = torch.round(g / scale.double()[:, None]).clamp(-8, 7).reshape(k, n)
    return pack(codes), scale


def quantize_mxfp4(weight):
    """OCP MXFP4 of a `Linear` weight `[n, k]`: per 32 of K, the shared exponent
    `floor(log2(amax)) - 2` (E2M1's largest exponent), codes rounded to nearest.
    Returns `(w int8 [k / 2, n], scale int8 [k / 32, n])` (E8M0 bytes)."""
    wt = weight.detach().double().T
    k, n = wt.shape
    g = wt.reshape(k // 32, 32, n)
    amax = g.abs().amax(1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    codes = _e2m1_code(g / torch.pow(2.0, e)[:, None]).reshape(k, n)
    return pack(codes), (e + 127).to(torch.uint8).view(torch.int8)


def quantize_nvfp4(weight):
    """NVFP4 of a `Linear` weight `[n, k]`: global scale = amax / (448 * 6), per 16 of K an
    e4m3fn scale = amax_block / 6 / global, codes rounded to nearest.
    Returns `(w int8 [k / 2, n], scale float8_e4m3fn [k / 16, n], global_scale float32 [1])`."""
    wt = weight.detach().double().T
    k, n = wt.shape
    glob = (wt.abs().amax() / (448 * 6)).clamp(min=1e-12)
    g = wt.reshape(k // 16, 16, n)
    scale = (g.abs().amax(1) / 6 / glob).to(torch.float8_e4m3fn)
    s = scale.double() * glob
    codes = _e2m1_code(torch.where(s[:, None] > 0, g / s[:, None], torch.zeros_like(g))).reshape(k, n)
    return pack(codes), scale, glob.float().reshape(1)


def from_mx_blocks(blocks, scales):
    """An OCP MX checkpoint's weight (HF gpt-oss: `blocks` uint8 `[n, k / 32, 16]` holding two
    E2M1 codes per byte, the first in the low nibble; `scales` uint8 `[n, k / 32]`) ->
    `(w int8 [k / 2, n], scale int8 [k / 32, n])` for `matmul_mxfp4`."""
    n, kb, _ = blocks.shape
    b = blocks.view(torch.uint8).to(torch.int32).reshape(n, kb * 16)
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(n, kb * 32)
    return pack(codes.T), scales.view(torch.uint8).T.contiguous().view(torch.int8)


def dequantize(fmt, w, scale, global_scale=None):
    """`W [k, n]` in float64 from the packed weight and its scales (`fmt`: "int4", "mxfp4" or
    "nvfp4"): the plain-torch definition the kernels are tested against."""
    codes = unpack(w)
    k, n = codes.shape
    g = k // scale.shape[0]
    if fmt == "int4":
        vals = torch.where(codes >= 8, codes - 16, codes).double()
        s = scale.double()
    else:
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
        vals = torch.where(codes >= 8, -mags[codes & 7], mags[codes & 7])
        s = scale.view(torch.uint8).view(torch.float8_e8m0fnu).double() if fmt == "mxfp4" else scale.double()
        if fmt == "nvfp4":
            s = s * global_scale.double().reshape(())
    return vals * s.repeat_interleave(g, 0)
