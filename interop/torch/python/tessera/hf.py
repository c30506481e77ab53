"""Hugging Face transformers integration: ``attn_implementation="tessera"``.

    import tessera.hf
    tessera.hf.register()
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="tessera")

After ``register()`` every model whose attention layers dispatch through
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` (Llama, Mistral,
Qwen2/3, Gemma 2/3 and most other models in transformers 5.x) runs its attention through
``torch.ops.tpu.flash_attention`` (or ``torch.ops.tpu.splash_attention`` for masks flash attention
cannot express, below). Tested with transformers 5.24 (tests/python/test_hf.py).

How transformers (5.24) wires a custom name, and what ``register()`` therefore does:

* ``AttentionInterface.register(name, fn)`` puts ``fn`` in the class-wide mapping. That mapping is
  both the registry the layers call into and the list ``PreTrainedModel.get_correct_attn_implementation``
  validates ``attn_implementation`` against (``"eager"`` plus its keys; a name of the form
  ``org/repo`` would be taken for a Hub kernel instead, hence the plain name).
* ``AttentionMaskInterface.register(name, mask_fn)`` is needed too. For a name missing from that
  mapping, ``masking_utils._preprocess_mask_arguments`` assumes the backend needs no mask and
  ``create_causal_mask`` returns ``None``: padding would be silently dropped. ``mask_fn`` here is
  transformers' own ``sdpa_mask`` (so the model gets exactly the mask SDPA would: ``None`` when the
  pattern is plain causal, a boolean ``[B, 1, Sq, Skv]`` mask otherwise), and when that mask is
  "causal (top-left aligned) or full, optionally a causal sliding window, plus a 2D padding mask" it
  tags the tensor with the padding and the window, which the attention function turns into the
  kernel's segment ids and ``window_left`` without reading the 4D mask. Plain causal and full masks
  are recognised by their mask function; wrapped ones (sliding window, chunks, overlays, packing) by
  one comparison per forward with the plain causal mask (e.g. a padded prompt shorter than the
  sliding window is plain causal after all) and, failing that, with the plain sliding-window causal
  mask of the ``local_size`` transformers passes (Mistral's ``sliding_window``, Gemma 2/3's sliding
  layers), built by transformers' own ``sliding_window_causal_mask_function``.

The attention function follows ``integrations/sdpa_attention.py``: arguments
``(module, query [B,H,Sq,D], key/value [B,Hkv,Skv,D], attention_mask, dropout=, scaling=, **kwargs)``,
returns ``(attn_output [B,Sq,H,D] contiguous, None)``.

* ``scaling`` -> ``sm_scale``; ``softcap`` (Gemma 2/3) -> ``soft_cap``.
* Grouped-query attention is passed through as is; the kernel handles ``H % Hkv == 0``.
* Sliding window: transformers' ``sliding_window = w`` lets query position ``q`` see key position
  ``kv`` iff ``kv <= q`` and ``kv > q - w`` (``masking_utils.sliding_window_overlay``): ``w`` keys,
  the query's own included. That is the kernel's ``window_left = w - 1`` with ``causal=True``
  (``q - kv <= w - 1``); blocks outside the band are skipped, not masked.
* No mask: causal iff the layer is causal (``is_causal`` kwarg, else ``module.is_causal``) and
  ``Sq > 1``; a single decode query attends to the whole cache. ``Skv > Sq > 1`` without a mask only
  happens in a prefill into an empty static cache; the unwritten cache tail is cut off, as the SDPA
  integration does.
* Padding (a 2D ``attention_mask`` with zeros): segment ids, valid tokens 1 and padding 0, on both
  queries and keys (each query then sees at least itself, so no row is empty; the outputs at padded
  query positions are as meaningless as in eager). Bidirectional masks give the queries all 1.
* One query token (decoding) with any boolean mask ``[B, 1, 1, Skv]`` (padding, static cache slots,
  sliding window): that mask is a per-key mask, so it becomes the kv segment ids directly.
* Any other boolean mask (packed sequences, several new tokens on top of a filled cache, chunked
  attention as Llama 4's, bidirectional windows, image-token overlays, a custom boolean 4D mask) ->
  ``tessera.splash``: the mask's block metadata is built once per forward from the 4D mask (one
  read of it on the host; batch rows with equal masks share one), and attention runs through
  ``torch.ops.tpu.splash_attention``, skipping the blocks no query sees. A float (additive) mask
  -> ``NotImplementedError``; so are dropout while training, ``position_bias``, attention sinks
  (``s_aux``) and varlen kwargs. Nothing is silently ignored.

Importing this module does not import transformers; ``register()`` does.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["NAME", "register", "is_registered", "tessera_attention_forward"]

NAME = "tessera"

_log = logging.getLogger(__name__)
_warned_output_attentions = False

_MASK_RULE = (
    'attn_implementation="tessera" runs torch.ops.tpu.flash_attention (no mask, padding, causal sliding '
    "windows) or torch.ops.tpu.splash_attention (any other boolean mask [batch or 1, 1, q_len, kv_len]); "
    "transformers built a different mask here ({what}): a custom 4D float (additive) mask, or one whose "
    "shape does not match the batch and lengths. Pass a boolean mask (True = attend), or load the model "
    'with attn_implementation="sdpa" or "eager" for these inputs (model.set_attn_implementation("sdpa") '
    "switches an existing model)."
)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f'attn_implementation="tessera" does not support {what}. Use attn_implementation="sdpa" or "eager" '
        "for this model/configuration."
    )


def tessera_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function running ``torch.ops.tpu.flash_attention``.

    query: [B, H, Sq, D]; key, value: [B, Hkv, Skv, D]. Returns ([B, Sq, H, D], None).
    """
    global _warned_output_attentions

    if dropout and dropout > 0.0 and getattr(module, "training", True):
        raise NotImplementedError(
            f'attn_implementation="tessera" has no attention dropout, but the model asked for dropout={dropout} '
            "(the config's attention_dropout while in train mode). Set config.attention_dropout = 0.0, "
            'or use attn_implementation="sdpa" or "eager".'
        )
    if kwargs.get("position_bias") is not None:
        raise _unsupported("an additive position bias (position_bias)")
    if kwargs.get("s_aux") is not None:
        raise _unsupported("attention sinks (s_aux)")
    for varlen in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(varlen) is not None:
            raise _unsupported(f"packed variable-length batches ({varlen})")
    if kwargs.get("output_attentions", False) and not _warned_output_attentions:
        _warned_output_attentions = True
        _log.warning(
            'attn_implementation="tessera" does not return attention weights (output_attentions=True); '
            'use "eager" if you need them.'
        )
    if query.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f'attn_implementation="tessera" supports float32 and bfloat16, got {query.dtype}. Load the model '
            "with dtype=torch.bfloat16 or torch.float32."
        )

    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    q_seg = kv_seg = window_left = None
    if attention_mask is None:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        # One query token attends to every cached key (bottom-right alignment); only q_len > 1 needs
        # the triangle, and without a mask transformers guarantees the top-left one (sdpa_attention.py).
        causal = bool(is_causal) and q_len > 1
    else:
        # With a mask, the mask alone defines the pattern (SDPA drops is_causal then too).
        expressed = _segments(attention_mask, batch, q_len, kv_len)
        if expressed is None:
            # Any other boolean mask: splash attention over its block metadata.
            out = _splash(query, key, value, attention_mask, scaling, softcap)
            return out.transpose(1, 2).contiguous(), None
        causal, q_seg, kv_seg, window_left = expressed

    if causal and kv_len > q_len:
        # Top-left causal never reaches keys past q_len: these are unwritten static-cache slots.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if kv_seg is not None:
            kv_seg = kv_seg[:, :q_len]

    out = torch.ops.tpu.flash_attention(
        query,
        key,
        value,
        causal,
        None if scaling is None else float(scaling),
        None if softcap is None else float(softcap),
        q_seg,
        kv_seg,
        window_left=window_left,
    )
    return out.transpose(1, 2).contiguous(), None


# The tag the mask function puts on the masks it can describe: (pattern, padding [B, Skv] bool or None,
# window_left or None).
_TAG = "_tessera_mask"


def _segments(mask, batch: int, q_len: int, kv_len: int):
    """(causal, q_segment_ids, kv_segment_ids, window_left) expressing `mask` for flash attention;
    None for another boolean mask (splash attention takes it); NotImplementedError otherwise."""
    what = type(mask).__name__
    if isinstance(mask, torch.Tensor):
        what += f" of shape {tuple(mask.shape)}, dtype {mask.dtype}"
        shaped = mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[-2:] == (q_len, kv_len)
        if shaped and mask.shape[0] in (1, batch):
            tag = getattr(mask, _TAG, None)
            if tag is not None:
                # Built by _mask below: causal (aligned) or full attention, a window, plus padding.
                pattern, padding, window = tag
                causal = pattern == "causal" and q_len > 1
                if padding is None:
                    return causal, None, None, window
                kv_seg = padding.to(torch.int32).expand(batch, kv_len)
                if pattern == "causal":
                    q_seg = kv_seg[:, :q_len]  # queries are the first q_len keys
                else:
                    q_seg = torch.ones((batch, q_len), dtype=torch.int32, device=kv_seg.device)
                return causal, q_seg.contiguous(), kv_seg.contiguous(), window
            if q_len == 1 and mask.dtype == torch.bool:
                # A single query row: the mask is just which keys it sees.
                kv_seg = mask[:, 0, 0, :].to(torch.int32).expand(batch, kv_len).contiguous()
                return False, torch.ones((batch, 1), dtype=torch.int32, device=kv_seg.device), kv_seg, None
            if mask.dtype == torch.bool:
                return None  # splash attention's (see _splash)
    raise NotImplementedError(_MASK_RULE.format(what=what))


# The splash masks of a 4D boolean mask, cached on the mask tensor (every layer of a forward
# gets the same tensor): one per distinct batch row, and which row each batch element uses.
_SPLASH = "_tessera_splash"


@torch.compiler.disable
def _splash(query, key, value, mask, scaling, softcap):
    """Attention under any boolean mask ``[B or 1, 1, Sq, Skv]`` through splash attention: the
    mask's block metadata is built once per forward on the host (one read of the mask), and batch
    elements with the same mask share it; blocks no query sees are skipped. Under
    `torch.compile` it runs eagerly (a graph break: the metadata needs the mask's values)."""
    from tessera import splash

    batch = query.shape[0]
    cached = getattr(mask, _SPLASH, None)
    if cached is None:
        rows = mask[:, 0].to("cpu")
        distinct, which = [], []
        for b in range(rows.shape[0]):
            same = next((i for i, r in enumerate(distinct) if torch.equal(r, rows[b])), None)
            if same is None:
                distinct.append(rows[b])
                same = len(distinct) - 1
            which.append(same)
        dt = query.dtype if query.dtype in (torch.float32, torch.bfloat16) else torch.bfloat16
        cached = ([splash.make_mask(r, head_dim=query.shape[-1], dtype=dt) for r in distinct], which)
        setattr(mask, _SPLASH, cached)
    masks, which = cached
    scale = None if scaling is None else float(scaling)
    cap = None if softcap is None else float(softcap)
    if len(masks) == 1:
        return splash.splash_attention(query, key, value, masks[0], sm_scale=scale, soft_cap=cap)
    outs = [splash.splash_attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], masks[which[b % len(which)]], sm_scale=scale, soft_cap=cap) for b in range(batch)]
    return torch.cat(outs, 0)


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """The "tessera" entry of AttentionMaskInterface: transformers' ``sdpa_mask``, tagged when expressible."""
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    if mask_function is None:
        mask_function = causal_mask_function
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )
    if not isinstance(mask, torch.Tensor):
        return mask
    window = None
    if mask_function is bidirectional_mask_function:
        pattern = "full"
    else:
        # Causal only if top-left aligned: the queries sit at the keys' first positions.
        if isinstance(q_offset, torch.Tensor):  # static caches pass a tensor
            if torch.compiler.is_compiling():
                return mask
            q_offset = int(q_offset)
        if q_offset != kv_offset:
            return mask
        if mask_function is not causal_mask_function:
            # Sliding windows, chunks, packing and overlays wrap the causal function, yet often still
            # give the plain causal pattern (e.g. a padded prompt shorter than the sliding window).
            # Compare once per forward (not per layer); unequal -> untagged -> refused.
            if torch.compiler.is_compiling():
                return mask

            def same_as(function):
                plain = sdpa_mask(
                    batch_size=batch_size,
                    q_length=q_length,
                    kv_length=kv_length,
                    q_offset=q_offset,
                    kv_offset=kv_offset,
                    mask_function=function,
                    attention_mask=attention_mask,
                    allow_is_causal_skip=False,
                    device=mask.device,
                )
                return plain is not None and plain.shape == mask.shape and torch.equal(plain, mask)

            if not same_as(causal_mask_function):
                # A sliding window of `local_size` keys (the query's own included): window_left = w - 1.
                local = kwargs.get("local_size")
                if not (isinstance(local, int) and local >= 1 and same_as(sliding_window_causal_mask_function(local))):
                    return mask
                window = local - 1
        pattern = "causal"
    padding = None
    if attention_mask is not None:
        # As sdpa_mask reads it: key j is position kv_offset + j, positions past the 2D mask are padding.
        padding = prepare_padding_mask(attention_mask.to(torch.bool), kv_length, kv_offset)
        padding = padding[:, kv_offset : kv_offset + kv_length]
    setattr(mask, _TAG, (pattern, padding, window))
    return mask


def is_registered() -> bool:
    """Whether ``register()`` has run (and nobody replaced the entries since)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError:
        return False
    return (
        AttentionInterface._global_mapping.get(NAME) is tessera_attention_forward
        and AttentionMaskInterface._global_mapping.get(NAME) is _mask
    )


def register() -> str:
    """Register ``attn_implementation="tessera"`` with transformers. Idempotent; returns the name.

    Raises ImportError if transformers is not installed, RuntimeError if this build of tessera
    has no ``torch.ops.tpu.flash_attention``.
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("tessera.hf.register() needs the `transformers` package (pip install transformers)") from e
    if not hasattr(torch.ops.tpu, "flash_attention"):
        raise RuntimeError(
            "torch.ops.tpu.flash_attention is not available: this tessera build does not provide it "
            "(import tessera first, and rebuild interop/torch if needed)"
        )
    AttentionInterface.register(NAME, tessera_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
