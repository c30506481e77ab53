"""Splash attention: flash attention over a block-sparse mask (JAX splash attention's design).

Build a mask's block metadata once on the host, then call the op as often as you like::

    from tessera import splash
    mask = splash.make_mask(splash.causal(), q_len=4096, kv_len=4096)      # once
    o = splash.splash_attention(q, k, v, mask)                             # differentiable

`make_mask` takes a `mask_mod(b, h, q_idx, kv_idx) -> bool` in `torch.nn.attention.flex_attention`'s
style (evaluated with broadcast index tensors, so write it with torch ops: `q_idx >= kv_idx`,
`&`, `|`, `//`), one of the constructors below, or a boolean tensor `[q_len, kv_len]` /
`[heads, q_len, kv_len]` (True = the query sees the key). The metadata is three small tensors
(`mask_blocks` int8, `fwd_info` / `bwd_info` int32) that `torch.ops.tpu.splash_attention` takes;
blocks no query sees are never fetched, blocks every query sees apply no mask. No value is read
back to the host per call, so the op is safe on the `tpu` device and under DeferAndFuse.

Constructors (all `mask_mod`s):

- `causal()`: key `c <= q`.
- `local(left, right=0)`: `q - left <= c <= q + right` (JAX's `LocalMask(window_size=(left,
  right))`; transformers' `sliding_window = w` is `local(w - 1)`).
- `chunked(size)`: causal inside chunks of `size` (Llama 4's chunked attention).
- `prefix_lm(prefix)`: causal, plus every query sees the first `prefix` keys.
- `and_masks(*m)`, `or_masks(*m)`: combinations.

One mask serves every batch element (a `mask_mod` that reads `b` is refused: per-sequence
documents are `q_segment_ids` / `kv_segment_ids`), and every head unless `heads=` is given (a
`mask_mod` that reads `h` without it is refused). Build masks outside `torch.compile`d code.
The kernels clamp every index the metadata holds, so metadata not built here can give wrong
values but never reads outside an operand.

Memory: building evaluates the mask densely (`heads * q_len * kv_len` booleans, one pass).
"""

from __future__ import annotations

import functools
import operator

import torch

from tessera import _native

__all__ = ["SplashMask", "make_mask", "splash_attention", "causal", "local", "chunked", "prefix_lm", "and_masks", "or_masks"]


def _index(where, name, x, lo, optional=False):
    """`x` as an int >= lo (anything `operator.index` takes: numpy integers too); None stays
    None when `optional`."""
    if x is None and optional:
        return None
    try:
        v = operator.index(x)
    except TypeError:
        v = None
    if v is None or isinstance(x, bool) or v < lo:
        kind = "a non-negative int" if lo == 0 else "a positive int" if lo == 1 else f"an int >= {lo}"
        raise ValueError(f"tessera.splash.{where}: {name} = {x!r}; pass {kind}" + (" or None" if optional else ""))
    return v


def _combine(where, mods, op):
    """A mask_mod visible where `op` (& or |) of every mask in `mods` is."""
    if not mods:
        raise ValueError(f"tessera.splash.{where}: pass at least one mask_mod")
    return lambda b, h, q, kv: functools.reduce(op, (m(b, h, q, kv) for m in mods))


def causal():
    """Query `q` sees key `c` iff `c <= q`."""
    return lambda b, h, q, kv: kv <= q


def local(left: int, right: int = 0):
    """`q - left <= c <= q + right` (causal when `right = 0`)."""
    left, right = _index("local", "left", left, 0), _index("local", "right", right, 0)
    return lambda b, h, q, kv: (kv >= q - left) & (kv <= q + right)


def chunked(size: int):
    """Causal inside consecutive chunks of `size` queries / keys (Llama 4's chunked attention)."""
    size = _index("chunked", "size", size, 1)
    return lambda b, h, q, kv: (q // size == kv // size) & (kv <= q)


def prefix_lm(prefix: int):
    """Causal, and every query sees the first `prefix` keys (bidirectional prefix)."""
    prefix = _index("prefix_lm", "prefix", prefix, 0)
    return lambda b, h, q, kv: (kv <= q) | (kv < prefix)


def and_masks(*mods):
    """Visible where every mask sees."""
    return _combine("and_masks", mods, operator.and_)


def or_masks(*mods):
    """Visible where any mask sees."""
    return _combine("or_masks", mods, operator.or_)


class SplashMask:
    """A mask's block metadata (see the module docs). Build with `make_mask`."""

    def __init__(self, mask_blocks: torch.Tensor, fwd_info: torch.Tensor, bwd_info: torch.Tensor, q_len: int, kv_len: int, heads: int):
        self.mask_blocks, self.fwd_info, self.bwd_info = mask_blocks, fwd_info, bwd_info
        self.q_len, self.kv_len, self.heads = q_len, kv_len, heads
        self.block_q, self.block_kv = mask_blocks.shape[1], mask_blocks.shape[2]
        self._on = {torch.device("cpu"): (mask_blocks, fwd_info, bwd_info)}

    def tensors(self, device) -> tuple:
        """`(mask_blocks, fwd_info, bwd_info)` on `device`, copied there once."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in self._on[torch.device("cpu")])
        return self._on[device]

    @property
    def partial_blocks(self) -> int:
        """How many distinct partial blocks the mask has (a mask without any still stores one
        all-zero placeholder block)."""
        return int(self.mask_blocks.shape[0]) if bool((self.fwd_info[1] == 1).any()) else 0

    def visits(self) -> int:
        """How many (head, q block, kv block) pairs are computed (the others are skipped)."""
        return int((self.fwd_info[1] != 0).sum())

    def __repr__(self):
        nq = -(-self.q_len // self.block_q)
        nk = -(-self.kv_len // self.block_kv)
        return (f"SplashMask(q_len={self.q_len}, kv_len={self.kv_len}, heads={self.heads}, blocks={self.block_q}x{self.block_kv}, "
                f"visits {self.visits()} of {self.heads * nq * nk} blocks, {self.partial_blocks} distinct partial)")


def _dense(mask, q_len, kv_len, heads):
    """The mask as a bool tensor `[heads or 1, q_len, kv_len]` and its head count."""
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or mask.dim() not in (2, 3):
            raise ValueError(f"tessera.splash.make_mask: a tensor mask must be bool [q_len, kv_len] or [heads, q_len, kv_len], got {mask.dtype} {list(mask.shape)}")
        m = mask.detach().to("cpu")
        if m.dim() == 2:
            m = m[None]
        if heads is not None and heads != m.shape[0]:
            raise ValueError(f"tessera.splash.make_mask: heads={heads} but the mask is {list(mask.shape)}; a [q_len, kv_len] mask serves every head and a [heads, q_len, kv_len] one has its own heads: drop heads=")
        if q_len is not None and m.shape[1] != q_len or kv_len is not None and m.shape[2] != kv_len:
            raise ValueError(f"tessera.splash.make_mask: the mask is {list(mask.shape)} but q_len={q_len}, kv_len={kv_len}")
        return m.contiguous(), m.shape[0]
    if not callable(mask):
        raise TypeError(f"tessera.splash.make_mask: mask must be a mask_mod(b, h, q_idx, kv_idx), a bool tensor or a constructor's result, got {type(mask).__name__}")
    if q_len is None or kv_len is None:
        raise ValueError("tessera.splash.make_mask: a mask_mod needs q_len and kv_len")
    q = torch.arange(q_len)[None, :, None]
    kv = torch.arange(kv_len)[None, None, :]

    def evaluate(b, h):
        m = mask(torch.tensor(b), h, q, kv)
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise TypeError(f"tessera.splash.make_mask: the mask_mod returned {type(m).__name__ if not isinstance(m, torch.Tensor) else m.dtype}, not a bool tensor (combine conditions with & and |, not `and` / `or`)")
        return torch.broadcast_to(m, (h.shape[0], q_len, kv_len))

    def differs(a, b_eval):
        # A mask_mod that indexes a captured tensor may not accept index 1: then it cannot
        # depend on that index.
        try:
            return not torch.equal(a, b_eval())
        except (IndexError, RuntimeError):
            return False

    hs = 1 if heads is None else heads
    m = evaluate(0, torch.arange(hs)[:, None, None])
    # The metadata serves every batch element, and every head unless heads= is given.
    if differs(m[:1], lambda: evaluate(1, torch.zeros(1, 1, 1, dtype=torch.long))):
        raise ValueError("tessera.splash.make_mask: the mask_mod depends on the batch index b, but one mask serves every batch "
                         "element; express per-sequence documents with q_segment_ids / kv_segment_ids, or build a mask per batch element")
    if heads is None and differs(m, lambda: evaluate(0, torch.ones(1, 1, 1, dtype=torch.long))):
        raise ValueError("tessera.splash.make_mask: the mask_mod depends on the head index h: pass heads=<number of query heads> "
                         "for a mask per head")
    return m.contiguous(), hs


@torch.compiler.disable
def make_mask(mask, q_len: int | None = None, kv_len: int | None = None, *, heads: int | None = None, block_q: int | None = None,
              block_kv: int | None = None, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> SplashMask:
    """The block metadata of `mask` (see the module docs). `heads`: evaluate a `mask_mod` per
    query head (a mask per head); else one mask serves every head. Blocks default to the
    target's (`tessera.set_target`) for `head_dim` and `dtype`. It reads the mask on the host:
    inside a compiled function it runs eagerly (a graph break), once per call; build a mask
    that does not change outside the function and pass the SplashMask in."""
    q_len, kv_len, heads, block_q, block_kv = (
        _index("make_mask", name, x, 1, optional=True) for name, x in (("q_len", q_len), ("kv_len", kv_len), ("heads", heads), ("block_q", block_q), ("block_kv", block_kv))
    )
    head_dim = _index("make_mask", "head_dim", head_dim, 1)
    bits, hs = _dense(mask, q_len, kv_len, heads)
    sq, skv = bits.shape[1], bits.shape[2]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"tessera.splash.make_mask: dtype {dtype}; pass torch.float32 or torch.bfloat16 (the q/k/v dtype the blocks are sized for)")
    dq, dk = _native.splash_default_blocks(sq, skv, head_dim, str(dtype).removeprefix("torch."))
    bq, bk = min(block_q or dq, sq), min(block_kv or dk, skv)
    # The TPU's (8, 128) tiling: a block is a multiple of it or the whole length.
    for name, b, n, unit in (("block_q", bq, sq, 8), ("block_kv", bk, skv, 128)):
        if b != n and b % unit:
            raise ValueError(f"tessera.splash.make_mask: {name} = {b} for a length of {n}; use a multiple of {unit}, or the whole length {n}")
    raw = bits.to(torch.uint8).numpy().tobytes()
    (mb, mb_shape), (fi, fi_shape), (bi, bi_shape) = _native.splash_mask_info(raw, hs, sq, skv, bq, bk)
    as_tensor = lambda b, shape, dt: torch.frombuffer(bytearray(b), dtype=dt).reshape(shape)  # noqa: E731
    return SplashMask(as_tensor(mb, mb_shape, torch.int8), as_tensor(fi, fi_shape, torch.int32), as_tensor(bi, bi_shape, torch.int32), sq, skv, hs)


def splash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SplashMask, *, sm_scale: float | None = None,
                     soft_cap: float | None = None, q_segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`softmax(mask(sm_scale * q @ k^T)) @ v` (soft cap and segment ids as flash attention's),
    q `[B, H, Sq, D]`, k and v `[B, Hkv, Skv, D]`; differentiable. A `mask_mod` or a bool tensor
    is accepted too and built per call: build it once with `make_mask` to reuse it."""
    if not isinstance(mask, SplashMask):
        if torch.compiler.is_compiling():
            raise RuntimeError("tessera.splash.splash_attention under torch.compile takes a SplashMask: build it with "
                               "tessera.splash.make_mask outside the compiled function")
        mask = make_mask(mask, q.shape[-2], k.shape[-2], block_q=None, head_dim=q.shape[-1], dtype=q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.bfloat16)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"tessera splash_attention: q is {list(q.shape)} and k is {list(k.shape)}; pass q [B, H, Sq, D] and k, v [B, Hkv, Skv, D]")
    if (q.shape[2], k.shape[2]) != (mask.q_len, mask.kv_len):
        raise ValueError(f"tessera splash_attention: the mask was built for q_len={mask.q_len}, kv_len={mask.kv_len} but q has {q.shape[2]} queries and k {k.shape[2]} keys; build the mask for these lengths")
    if mask.heads not in (1, q.shape[1]):
        raise ValueError(f"tessera splash_attention: the mask has {mask.heads} heads but q has {q.shape[1]}; build it with heads=None (shared) or heads={q.shape[1]}")
    blocks, fwd, bwd = mask.tensors(q.device)
    return torch.ops.tpu.splash_attention(q, k, v, blocks, fwd, bwd, sm_scale, soft_cap, q_segment_ids, kv_segment_ids)
