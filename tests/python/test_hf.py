"""attn_implementation="tessera" (interop/torch/python/tessera/hf.py) against transformers' eager attention.

Tiny randomly initialised models (no download): the same weights run once with "eager" and once with
"tessera"; logits and gradients must agree, and a TorchDispatchMode proves that every attention layer
went through torch.ops.tpu.flash_attention (one call per layer per forward, one backward kernel per
layer per backward) with the expected arguments. Covered: f32 and bf16 Llama (GQA), backward, padded
batches (segment ids), decoding with dynamic and static caches, Gemma 2 (softcap, custom scaling,
sliding-window decoding), sliding-window prompts longer than the window (Mistral, Gemma 2 and
Gemma 3: the kernel's window_left, padded batches, generate), the op's window against SDPA with an
explicit band mask, and the clear errors for masks the kernel cannot express and for dropout.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_hf.py

Skipped when transformers is not installed or tessera has no torch.ops.tpu.flash_attention.
The repository's hf.py is tested even when the installed tessera package is older.
"""
import copy
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
tessera = pytest.importorskip("tessera")

if not hasattr(torch.ops.tpu, "flash_attention"):
    pytest.skip("this tessera build has no torch.ops.tpu.flash_attention", allow_module_level=True)

from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, StaticCache  # noqa: E402


from tessera import hf  # noqa: E402

hf.register()

LAYERS = 2
VOCAB = 1000
BATCH, SEQ = 2, 64


class TpuOps(TorchDispatchMode):
    """Records every torch.ops.tpu.* call that reaches the dispatcher, with its arguments by name.

    tpu::flash_attention (o alone) runs its own kernel when no gradient is needed and
    tpu::flash_attention_fwd when one is (splash likewise); either counts as "the op ran".
    """

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "tpu":
            bound = {}
            for i, a in enumerate(func._schema.arguments):
                if i < len(args):
                    bound[a.name] = args[i]
                elif a.name in kwargs:
                    bound[a.name] = kwargs[a.name]
                elif a.has_default_value():
                    bound[a.name] = a.default_value
            self.calls.append((func._opname, bound))
        return func(*args, **kwargs)

    def named(self, name):
        return [b for n, b in self.calls if n == name]

    def flash(self):
        """The forward attention calls."""
        return self.named("flash_attention_fwd") or self.named("flash_attention")

    def splash(self):
        """The forward splash attention calls (`splash_attention`, o alone, without gradients)."""
        return self.named("splash_attention_fwd") or self.named("splash_attention")


def llama_config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per kv head
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.05,  # peakier attention than the default 0.02, so the mask matters
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def pair(config, dtype=torch.float32):
    """(eager, tessera) models with identical weights, in eval mode."""
    # from_config writes the implementation into the config it is given: one copy each
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager", dtype=dtype)
    tes = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tessera", dtype=dtype)
    tes.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager"
    assert tes.config._attn_implementation == "tessera"
    return eager.eval(), tes.eval()


def tokens(batch=BATCH, seq=SEQ, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(got, ref):
    """Max-norm error relative to the reference's max magnitude."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# Tolerances, relative to max |reference|.
F32_TOL = 1e-4
BF16_TOL = 3e-2


def test_register_is_idempotent_and_validated():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert hf.register() == "tessera"
    assert hf.register() == "tessera"
    assert hf.is_registered()
    assert AttentionMaskInterface._global_mapping["tessera"] is hf._mask
    assert "tessera" in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert AttentionInterface._global_mapping["tessera"] is hf.tessera_attention_forward
    assert ALL_ATTENTION_FUNCTIONS.get_interface("tessera", None) is hf.tessera_attention_forward
    # transformers validates attn_implementation against the registered names
    with pytest.raises(ValueError, match="not supported"):
        AutoModelForCausalLM.from_config(llama_config(), attn_implementation="tessera_unregistered")
    model = AutoModelForCausalLM.from_config(llama_config(), attn_implementation="eager")
    model.set_attn_implementation("tessera")  # switching an existing model
    assert model.config._attn_implementation == "tessera"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_llama_logits_match_eager(dtype):
    eager, tes = pair(llama_config())
    ids = tokens()
    with torch.no_grad():
        ref32 = eager(ids).logits
        eager, tes = eager.to(dtype), tes.to(dtype)  # the same weights, rounded
        ref = eager(ids).logits
        with TpuOps() as ops:
            got = tes(ids).logits
    assert got.dtype == dtype and got.shape == (BATCH, SEQ, VOCAB)
    calls = ops.flash()
    assert len(calls) == LAYERS, f"expected one flash_attention call per layer, got {len(calls)}"
    for c in calls:
        assert c["causal"] is True and c["q"].dtype == dtype
        assert c["q"].shape == (BATCH, 4, SEQ, 64) and c["k"].shape == (BATCH, 2, SEQ, 64)  # kv heads not repeated
        assert c["sm_scale"] == pytest.approx(64**-0.5)
        assert c["soft_cap"] is None and c["q_segment_ids"] is None
    err = rel_err(got, ref)
    if dtype == torch.float32:
        print(f"llama f32: logits rel err vs eager {err:.2e} (tol {F32_TOL:.0e})")
        assert err <= F32_TOL
    else:
        # both bf16 runs round differently; against the f32 logits tessera must be about as good as eager
        err_tes, err_eager = rel_err(got, ref32), rel_err(ref, ref32)
        print(f"llama bf16: rel err vs eager bf16 {err:.2e}; vs f32: tessera {err_tes:.2e}, eager {err_eager:.2e}")
        assert err <= BF16_TOL
        assert err_tes <= max(1.5 * err_eager, 1e-2)


def test_llama_backward_matches_eager():
    eager, tes = pair(llama_config())
    eager.train(), tes.train()  # attention_dropout is 0.0, so training mode must work
    ids = tokens()
    loss_ref = eager(ids, labels=ids).loss
    loss_ref.backward()
    with TpuOps() as ops:
        loss = tes(ids, labels=ids).loss
    assert len(ops.flash()) == LAYERS
    with TpuOps() as bwd_ops:
        loss.backward()
    if hasattr(torch.ops.tpu, "flash_attention_bwd"):
        assert len(bwd_ops.named("flash_attention_bwd")) == LAYERS
    assert rel_err(loss, loss_ref) <= F32_TOL
    ref_grads = dict(eager.named_parameters())
    worst = ("", 0.0)
    for name, p in tes.named_parameters():
        g, g_ref = p.grad, ref_grads[name].grad
        assert g is not None, f"no gradient for {name}"
        err = rel_err(g, g_ref)
        worst = max(worst, (name, err), key=lambda t: t[1])
        assert err <= 1e-3, f"{name}: grad rel err {err:.2e}"
    print(f"llama backward: worst grad rel err {worst[1]:.2e} ({worst[0]})")
    # the attention projections really received gradient through the op
    assert tes.model.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0


def test_all_ones_attention_mask_needs_no_mask():
    eager, tes = pair(llama_config())
    ids = tokens()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).logits
        with TpuOps() as ops:
            got = tes(ids, attention_mask=mask).logits
    calls = ops.flash()
    assert len(calls) == LAYERS
    assert all(c["causal"] is True and c["q_segment_ids"] is None for c in calls)
    assert rel_err(got, ref) <= F32_TOL


def padded(ids):
    """(attention_mask, position_ids): row 0 left-padded by 5 tokens, row 1 right-padded by 7."""
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, -7:] = 0
    return mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_padded_batch_matches_eager():
    eager, tes = pair(llama_config())
    ids = tokens()
    mask, pos = padded(ids)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, position_ids=pos).logits
        with TpuOps() as ops:
            got = tes(ids, attention_mask=mask, position_ids=pos).logits
    calls = ops.flash()
    assert len(calls) == LAYERS
    for c in calls:  # padding -> segment ids (1 = token, 0 = padding) on queries and keys, causal kept
        assert c["causal"] is True
        assert torch.equal(c["q_segment_ids"], mask.to(torch.int32))
        assert torch.equal(c["kv_segment_ids"], mask.to(torch.int32))
    valid = mask.bool()  # outputs at padded positions are meaningless in both implementations
    assert not got[valid].isnan().any()
    err = rel_err(got[valid], ref[valid])
    print(f"llama padded: logits rel err {err:.2e}")
    assert err <= F32_TOL


def test_padded_backward_matches_eager():
    eager, tes = pair(llama_config())
    eager.train(), tes.train()
    ids = tokens()
    mask, pos = padded(ids)
    # no loss on padding, nor on the logits of a padded position (the one before a left-padded row's
    # first token): those are meaningless in both implementations
    after_pad = torch.cat([torch.zeros_like(mask[:, :1]), 1 - mask[:, :-1]], dim=1).bool()
    labels = ids.masked_fill((mask == 0) | after_pad, -100)
    eager(ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
    tes(ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
    ref_grads = dict(eager.named_parameters())
    for name, p in tes.named_parameters():
        err = rel_err(p.grad, ref_grads[name].grad)
        assert err <= 1e-3, f"{name}: grad rel err {err:.2e}"


@pytest.mark.parametrize("with_padding", [False, True], ids=["unpadded", "left-padded"])
def test_decode_with_dynamic_cache_matches_eager(with_padding):
    eager, tes = pair(llama_config())
    ids = tokens()
    mask = torch.ones_like(ids)
    if with_padding:
        mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(model):
        out = model(ids[:, :48], attention_mask=mask[:, :48], position_ids=pos[:, :48], use_cache=True)
        logits = [out.logits]
        for t in (48, 49):  # two decode steps, one token each
            out = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=pos[:, t : t + 1],
                cache=out.cache,
                use_cache=True,
            )
            logits.append(out.logits)
        return logits

    with torch.no_grad():
        ref = run(eager)
        with TpuOps() as ops:
            got = run(tes)
    calls = ops.flash()
    assert len(calls) == 3 * LAYERS
    for c in calls[LAYERS:]:  # one query attends to the whole (valid) cache: no triangle
        assert c["causal"] is False and c["q"].shape[2] == 1 and c["k"].shape[2] in (49, 50)
        assert (c["kv_segment_ids"] is not None) == with_padding
    valid = mask[:, :48].bool()
    assert rel_err(got[0][valid], ref[0][valid]) <= F32_TOL
    for step, step_ref in zip(got[1:], ref[1:]):
        assert rel_err(step, step_ref) <= F32_TOL


def test_static_cache_prefill_and_decode_match_eager():
    config = llama_config()
    eager, tes = pair(config)
    ids = tokens()

    def run(model):
        cache = StaticCache(config=config, max_cache_len=96)
        logits = [model(ids[:, :48], cache=cache, use_cache=True).logits]
        for t in (48, 49):
            logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
        return logits

    with torch.no_grad():
        ref = run(eager)
        with TpuOps() as ops:
            got = run(tes)
    calls = ops.flash()
    assert len(calls) == 3 * LAYERS
    prefill, decode = calls[:LAYERS], calls[LAYERS:]
    assert all(c["k"].shape[2] == 48 and c["causal"] for c in prefill)  # unwritten cache slots cut off
    for c in decode:  # static-cache decode gets a [B, 1, 1, 96] mask: it becomes kv segment ids
        assert c["k"].shape[2] == 96 and not c["causal"]
        assert int(c["kv_segment_ids"][0].sum()) in (49, 50)
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= F32_TOL


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_left_padded_batch_matches_eager(cache_implementation):
    eager, tes = pair(llama_config())
    ids = tokens(seq=16)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    kw["cache_implementation"] = cache_implementation
    with torch.no_grad():
        ref = eager.generate(ids, **kw)
        with TpuOps() as ops:
            got = tes.generate(ids, **kw)
    assert len(ops.flash()) == 12 * LAYERS  # prefill + 11 decode steps
    assert torch.equal(got, ref)


def test_other_boolean_masks_run_splash_attention_and_match_eager():
    """Masks flash attention cannot express go through splash attention: several new tokens on
    top of a filled cache (bottom-right causal), packed sequences (position_ids restarting inside
    a row: a block-diagonal causal mask), a custom boolean 4D mask. A float mask is refused."""
    eager, tes = pair(llama_config())
    ids = tokens()
    with torch.no_grad():
        cache_e = eager(ids[:, :48], use_cache=True).cache
        with TpuOps() as ops:
            out_t = tes(ids[:, :48], use_cache=True)
            got = tes(ids[:, 48:52], cache=out_t.cache).logits
        assert len(ops.splash()) == LAYERS, "the chunk on a filled cache ran splash attention"
        want = eager(ids[:, 48:52], cache=cache_e).logits
        assert rel_err(got, want) < F32_TOL
        # packed sequences: position_ids restart inside a row
        pos = torch.cat([torch.arange(32), torch.arange(32)]).expand(BATCH, -1)
        with TpuOps() as ops:
            got = tes(ids, position_ids=pos, use_cache=False).logits
        assert ops.splash(), "packed sequences ran splash attention"
        assert rel_err(got, eager(ids, position_ids=pos, use_cache=False).logits) < F32_TOL
        # a custom boolean 4D mask, a different band per batch row; eager adds a boolean mask to
        # the scores (True = +1), so SDPA, which reads it as "attend", is the reference here
        r, c = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
        custom = torch.stack([(c <= r) & (r - c <= 5 + 9 * b) for b in range(BATCH)])[:, None]
        sdpa = copy.deepcopy(eager)
        sdpa.set_attn_implementation("sdpa")
        assert rel_err(tes(ids, attention_mask=custom).logits, sdpa(ids, attention_mask=custom).logits) < F32_TOL
        # a custom 4D float mask: refused
        with pytest.raises(NotImplementedError, match="float"):
            tes(ids, attention_mask=torch.zeros(BATCH, 1, SEQ, SEQ))


def test_dropout_in_training_is_refused():
    _, tes = pair(llama_config(attention_dropout=0.1))
    tes.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        tes(tokens())
    tes.eval()  # eval mode passes dropout=0.0
    with torch.no_grad():
        tes(tokens())


def gemma2_config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,  # one sliding-window layer, one full layer
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=32,  # scaling 32**-0.5, not 1/sqrt(head_dim)
        attn_logit_softcapping=2.0,  # small enough to bite with these weights
        sliding_window=128,  # longer than the sequence: no sliding mask needed
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    kw.update(overrides)
    return Gemma2Config(**kw)


def test_gemma2_softcap_and_scaling_match_eager():
    config = gemma2_config()
    eager, tes = pair(config)
    ids = tokens()
    with torch.no_grad():
        ref = eager(ids).logits
        with TpuOps() as ops:
            got = tes(ids).logits
        for layer in eager.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = eager(ids).logits
    calls = ops.flash()
    assert len(calls) == LAYERS
    for c in calls:
        assert c["soft_cap"] == 2.0 and c["sm_scale"] == pytest.approx(32**-0.5) and c["causal"] is True
    assert rel_err(uncapped, ref) > 100 * F32_TOL  # the cap changes the result
    err = rel_err(got, ref)
    print(f"gemma2 softcap: logits rel err {err:.2e}")
    assert err <= F32_TOL


def test_gemma2_sliding_window_decode_matches_eager():
    """Decoding past the window: the sliding layer's one-row mask becomes kv segment ids."""
    eager, tes = pair(gemma2_config(sliding_window=16))
    ids = tokens(seq=24)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # and some left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(model):
        out = model(ids[:, :12], attention_mask=mask[:, :12], position_ids=pos[:, :12], use_cache=True)
        logits = [out.logits]
        for t in range(12, 24):
            out = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=pos[:, t : t + 1],
                cache=out.cache,
                use_cache=True,
            )
            logits.append(out.logits)
        return logits

    with torch.no_grad():
        ref = run(eager)
        with TpuOps() as ops:
            got = run(tes)
    assert len(ops.flash()) == 13 * LAYERS
    valid = mask[:, :12].bool()
    assert rel_err(got[0][valid], ref[0][valid]) <= F32_TOL
    for step, step_ref in zip(got[1:], ref[1:]):
        assert rel_err(step, step_ref) <= F32_TOL
    # a multi-token input longer than the window: the sliding layer runs with window_left = 15
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, position_ids=pos).logits
        with TpuOps() as ops:
            got = tes(ids, attention_mask=mask, position_ids=pos).logits
    assert sorted(str(c["window_left"]) for c in ops.flash()) == ["15", "None"]
    valid = mask.bool()
    assert rel_err(got[valid], ref[valid]) <= F32_TOL


# ---- sliding windows longer than the window: Mistral, Gemma 3 ---------------------------------

WINDOW = 16  # HF's sliding_window: query q sees keys q - 15 ..= q (window_left = 15)


def mistral_config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,  # GQA 4
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return MistralConfig(**kw)


def gemma3_config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def windowed_prompt(seq=4 * WINDOW + 8):
    """A batch of two prompts of `seq` tokens (4 windows and more), the first left-padded by 5."""
    ids = tokens(seq=seq, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask


@pytest.mark.parametrize("model", ["mistral", "gemma3"])
@pytest.mark.parametrize("padded", [False, True])
def test_sliding_window_logits_match_eager(model, padded):
    config = mistral_config() if model == "mistral" else gemma3_config()
    eager, tes = pair(config)
    ids, mask = windowed_prompt()
    kw = dict(attention_mask=mask) if padded else {}
    with torch.no_grad():
        ref = eager(ids, **kw).logits
        with TpuOps() as ops:
            got = tes(ids, **kw).logits
        # The window matters here: full causal attention gives other logits.
        unwindowed = copy.deepcopy(config)
        unwindowed.sliding_window = None if model == "mistral" else 4096
        full, _ = pair(unwindowed)
        full.load_state_dict(eager.state_dict())
        far = full(ids, **kw).logits
    calls = ops.flash()
    assert len(calls) == LAYERS
    want = [str(WINDOW - 1)] * LAYERS if model == "mistral" else [str(WINDOW - 1), "None"]
    assert [str(c["window_left"]) for c in calls] == want
    assert all(c["causal"] is True for c in calls)
    if padded:
        assert all(c["q_segment_ids"] is not None for c in calls)
    valid = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    assert rel_err(far[valid], ref[valid]) > 100 * F32_TOL
    err = rel_err(got[valid], ref[valid])
    print(f"{model} padded={padded}: logits rel err {err:.2e}")
    assert err <= F32_TOL


@pytest.mark.parametrize("model", ["mistral", "gemma3"])
def test_sliding_window_generate_matches_eager(model):
    eager, tes = pair(mistral_config() if model == "mistral" else gemma3_config())
    ids, mask = windowed_prompt()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = eager.generate(ids, **kw)
        with TpuOps() as ops:
            got = tes.generate(ids, **kw)
    assert len(ops.flash()) == 8 * LAYERS  # prefill + 7 decode steps
    assert torch.equal(got, ref)


def test_sliding_window_backward_matches_eager():
    eager, tes = pair(mistral_config())
    ids, mask = windowed_prompt()
    grads = []
    for m in (eager, tes):
        m.zero_grad()
        logits = m(ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for r, g in zip(*grads):
        assert rel_err(g, r) <= F32_TOL


@pytest.mark.parametrize("backend", ["tessera", "eager"])
def test_sliding_window_under_torch_compile_matches_eager(backend):
    """Compiled, the sliding mask is not tagged (it is compared on the host), so it runs splash
    attention, whose metadata reads the mask: that part runs eagerly (a graph break). It
    crashed before (`tessera` backend: RecursionError; `eager`: bytearray untraceable)."""
    torch._dynamo.reset()
    eager, tes = pair(mistral_config())
    ids, mask = windowed_prompt(seq=2 * WINDOW + 3)
    ref = eager(ids, attention_mask=mask).logits
    (ref[mask.bool()] ** 2).mean().backward()
    compiled = torch.compile(tes, backend=backend)
    got = compiled(ids, attention_mask=mask).logits
    (got[mask.bool()] ** 2).mean().backward()
    valid = mask.bool()
    assert rel_err(got[valid], ref[valid]) <= F32_TOL
    for (name, r), g in zip(eager.named_parameters(), tes.parameters()):
        assert rel_err(g.grad, r.grad) <= F32_TOL, name


def band(sq, skv, causal, left, right):
    r, c = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    m = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        m &= c <= r
    if left is not None:
        m &= r - c <= left
    if right is not None:
        m &= c - r <= right
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,skv,causal,left,right", [(200, 200, True, 30, None), (150, 260, False, 70, 20), (96, 96, True, 200, None)])
def test_flash_attention_window_is_sdpa_with_a_band_mask(dtype, sq, skv, causal, left, right):
    """torch.ops.tpu.flash_attention's window against SDPA with the explicit boolean band mask
    (float64), values and gradients; GQA 2."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, sq, 32, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, skv, 32, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 2, skv, 32, generator=g).to(dtype).requires_grad_()
    out = torch.ops.tpu.flash_attention(q, k, v, causal, window_left=left, window_right=right)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=band(sq, skv, causal, left, right), enable_gqa=True)
    tol = BF16_TOL if dtype == torch.bfloat16 else F32_TOL
    assert rel_err(out, want) <= tol
    cot = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), cot)
    ref = torch.autograd.grad(want, (q64, k64, v64), cot.double())
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= 2 * tol


def test_flash_attention_negative_window_is_refused():
    q = torch.randn(1, 2, 64, 32)
    with pytest.raises(Exception) as e:
        torch.ops.tpu.flash_attention(q, q, q, True, window_left=-1)
    text = str(e.value)
    assert "flash_attention" in text and "window_left" in text and "option-value" in text, text
    print(f"refused: {text}")


def test_llama4_chunked_attention_matches_eager():
    """Llama 4's chunked attention layers (causal inside chunks of 16 keys) through splash
    attention, a prompt 4x the chunk: logits equal eager, greedy generate() gives eager's tokens."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, intermediate_size_mlp=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=16,
                           max_position_embeddings=256, interleave_moe_layer_step=2)
    assert cfg.layer_types.count("chunked_attention") == 3
    torch.manual_seed(0)
    eager = Llama4ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    tes = Llama4ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="tessera").eval()
    tes.load_state_dict(eager.state_dict())
    ids = tokens(seq=64)
    with torch.no_grad():
        with TpuOps() as ops:
            got = tes(ids).logits
        assert len(ops.splash()) == 3, "the chunked layers ran splash attention"
        assert rel_err(got, eager(ids).logits) < F32_TOL
        kw = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids[:, :20]), pad_token_id=0)
        assert torch.equal(tes.generate(ids[:, :20], **kw), eager.generate(ids[:, :20], **kw))
