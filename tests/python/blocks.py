"""Two transformer blocks, each written twice: with Tessera's kernels and with stock PyTorch.

- `LlamaBlock`: RMSNorm -> q/k/v projections -> RoPE on q and k (rotate-half) -> causal
  GQA attention -> o projection -> residual -> RMSNorm -> SwiGLU MLP -> residual, plus an
  LM head (final RMSNorm -> vocab projection -> mean cross-entropy) to drive the backward.
- `MoEBlock`: softmax top-k router with renormalisation -> dispatch by expert -> expert
  SwiGLU MLPs -> weighted combine.

`forward_tessera` does all compute with `torch.ops.tpu.*` (projections are `tpu.matmul`
on `[tokens, hidden]` 2-D views; reshapes and transposes are stock view ops);
`forward_torch` uses stock PyTorch only (F.rms_norm, F.linear, a rotate-half RoPE,
F.scaled_dot_product_attention(enable_gqa=True), F.silu, a loop over experts with index
masks). Both read the same nn.Parameters, so `copy.deepcopy(block).to(dtype)` gives the
same weights in another dtype. Used by tests/python/test_blocks.py; reusable by a benchmark.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # registers torch.ops.tpu.*; the stock paths work without it
    import tessera  # noqa: F401
except ImportError:  # pragma: no cover
    tessera = None

tpu = torch.ops.tpu


def _normal(shape, std, generator):
    return nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64) * std)


def _norm_weight(n, generator):
    # Not all ones, so the forward and the weight gradient both depend on every entry.
    return nn.Parameter(1.0 + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64))


# --------------------------------------------------------------------------------------
# Llama decoder block
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    vocab: int = 512
    eps: float = 1e-6
    theta: float = 10000.0


class LlamaBlock(nn.Module):
    """One Llama decoder layer + an LM head. Linear weights are [out, in] (nn.Linear's layout).

    Parameters are created in float64 from `seed`; cast the module with `.to(dtype)`.
    """

    def __init__(self, cfg: LlamaConfig = LlamaConfig(), seed: int = 0):
        super().__init__()
        self.cfg = c = cfg
        g = torch.Generator().manual_seed(seed)
        h, qd, kvd = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.attn_norm = _norm_weight(h, g)
        self.q_proj = _normal((qd, h), h**-0.5, g)
        self.k_proj = _normal((kvd, h), h**-0.5, g)
        self.v_proj = _normal((kvd, h), h**-0.5, g)
        self.o_proj = _normal((h, qd), qd**-0.5, g)
        self.mlp_norm = _norm_weight(h, g)
        self.gate_proj = _normal((c.ffn, h), h**-0.5, g)
        self.up_proj = _normal((c.ffn, h), h**-0.5, g)
        self.down_proj = _normal((h, c.ffn), c.ffn**-0.5, g)
        self.final_norm = _norm_weight(h, g)
        self.lm_head = _normal((c.vocab, h), h**-0.5, g)

    # ---- Tessera ----------------------------------------------------------------------

    def forward_tessera(self, x, position_ids):
        """x [b, s, hidden], position_ids [b, s] (any int dtype) -> [b, s, hidden]."""
        c = self.cfg
        b, s, hid = x.shape
        t = b * s
        x2 = x.reshape(t, hid)
        pos = position_ids.reshape(t).to(torch.int32)

        n1 = tpu.rmsnorm(x2, self.attn_norm, c.eps)
        q = tpu.matmul(n1, self.q_proj.t()).view(t, c.heads, c.head_dim)
        k = tpu.matmul(n1, self.k_proj.t()).view(t, c.kv_heads, c.head_dim)
        v = tpu.matmul(n1, self.v_proj.t()).view(t, c.kv_heads, c.head_dim)
        q = tpu.rope(q, pos, c.theta, False)
        k = tpu.rope(k, pos, c.theta, False)

        def heads_first(z):  # [t, h, d] -> [b, h, s, d]
            return z.view(b, s, z.shape[1], c.head_dim).transpose(1, 2)

        o = tpu.flash_attention(heads_first(q), heads_first(k), heads_first(v), True)  # GQA inside
        o = o.transpose(1, 2).reshape(t, c.heads * c.head_dim)
        attn = tpu.matmul(o, self.o_proj.t())

        n2, h1 = tpu.rmsnorm_residual(attn, x2, self.mlp_norm, c.eps)  # h1 = x + attn
        gate = tpu.matmul(n2, self.gate_proj.t())
        up = tpu.matmul(n2, self.up_proj.t())
        mlp = tpu.matmul(tpu.swiglu(gate, up), self.down_proj.t())
        return (h1 + mlp).view(b, s, hid)

    def loss_tessera(self, h, labels):
        """Mean cross-entropy of the LM head over h [b, s, hidden], labels [b, s]."""
        h2 = h.reshape(-1, h.shape[-1])
        logits = tpu.matmul(tpu.rmsnorm(h2, self.final_norm, self.cfg.eps), self.lm_head.t())
        loss, _lse = tpu.cross_entropy(logits, labels.reshape(-1).to(torch.int32))
        return loss.mean()

    # ---- stock PyTorch ----------------------------------------------------------------

    def rope_cos_sin(self, position_ids, dtype):
        """Rotate-half (Llama/HF) tables [b, s, head_dim], computed in >= float32, cast to dtype."""
        c = self.cfg
        cdt = torch.promote_types(dtype, torch.float32)
        inv_freq = 1.0 / (c.theta ** (torch.arange(0, c.head_dim, 2, dtype=cdt) / c.head_dim))
        freqs = position_ids.to(cdt)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward_torch(self, x, position_ids):
        c = self.cfg
        b, s, hid = x.shape
        n1 = F.rms_norm(x, (hid,), self.attn_norm, c.eps)
        q = F.linear(n1, self.q_proj).view(b, s, c.heads, c.head_dim).transpose(1, 2)
        k = F.linear(n1, self.k_proj).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = F.linear(n1, self.v_proj).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos_sin(position_ids, x.dtype)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h1 = x + F.linear(o.transpose(1, 2).reshape(b, s, c.heads * c.head_dim), self.o_proj)
        n2 = F.rms_norm(h1, (hid,), self.mlp_norm, c.eps)
        mlp = F.linear(F.silu(F.linear(n2, self.gate_proj)) * F.linear(n2, self.up_proj), self.down_proj)
        return h1 + mlp

    def loss_torch(self, h, labels):
        logits = F.linear(F.rms_norm(h, (h.shape[-1],), self.final_norm, self.cfg.eps), self.lm_head)
        # Upcast as HF does; tpu.cross_entropy also returns float32 losses.
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).long())

    def forward(self, x, position_ids, impl="tessera"):
        return self.forward_tessera(x, position_ids) if impl == "tessera" else self.forward_torch(x, position_ids)

    def loss(self, h, labels, impl="tessera"):
        return self.loss_tessera(h, labels) if impl == "tessera" else self.loss_torch(h, labels)


# --------------------------------------------------------------------------------------
# MoE block
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    hidden: int = 256
    ffn: int = 512
    experts: int = 8
    top_k: int = 2
    # Expert weight layout: "kn" = [E, in, out] (gmm transpose_rhs=False),
    # "nk" = [E, out, in] (nn.Linear per expert; gmm transpose_rhs=True).
    layout: str = "kn"


class MoEBlock(nn.Module):
    """Softmax top-k router (renormalised) + per-expert SwiGLU MLPs. Parameters in float64."""

    def __init__(self, cfg: MoEConfig = MoEConfig(), seed: int = 0):
        super().__init__()
        if cfg.layout not in ("kn", "nk"):
            raise ValueError(f"layout must be 'kn' or 'nk', not {cfg.layout!r}")
        self.cfg = c = cfg
        g = torch.Generator().manual_seed(seed)
        e, d, f = c.experts, c.hidden, c.ffn
        self.router = _normal((e, d), d**-0.5, g)
        up_shape, down_shape = ((e, d, f), (e, f, d)) if c.layout == "kn" else ((e, f, d), (e, d, f))
        self.w_gate = _normal(up_shape, d**-0.5, g)
        self.w_up = _normal(up_shape, d**-0.5, g)
        self.w_down = _normal(down_shape, f**-0.5, g)

    # ---- Tessera ----------------------------------------------------------------------

    def route_tessera(self, x2):
        """x2 [t, hidden] -> (logits [t, E], weights [t, k], int32 ids [t, k])."""
        logits = tpu.matmul(x2, self.router.t())
        weights, ids = tpu.router_topk(logits, self.cfg.top_k, "softmax", True)
        return logits, weights, ids

    def forward_tessera(self, x):
        c = self.cfg
        x2 = x.reshape(-1, c.hidden)
        _, weights, ids = self.route_tessera(x2)
        rows, group_sizes = tpu.permute(x2, ids, c.experts)  # [t*k, hidden], expert-sorted
        tr = c.layout == "nk"
        gate = tpu.gmm(rows, self.w_gate, group_sizes, tr)
        up = tpu.gmm(rows, self.w_up, group_sizes, tr)
        y = tpu.gmm(tpu.swiglu(gate, up), self.w_down, group_sizes, tr)
        return tpu.combine(y, weights, ids, c.experts).view(x.shape)

    # ---- stock PyTorch ----------------------------------------------------------------

    def route_torch(self, x2):
        logits = F.linear(x2, self.router)
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # as HF Mixtral
        weights, ids = probs.topk(self.cfg.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x2.dtype)
        return logits, weights, ids

    def _expert(self, e, xe):
        if self.cfg.layout == "kn":
            return (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
        return F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e])

    def forward_torch(self, x):
        c = self.cfg
        x2 = x.reshape(-1, c.hidden)
        _, weights, ids = self.route_torch(x2)
        out = torch.zeros_like(x2)
        for e in range(c.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            y = self._expert(e, x2[tok])
            out = out.index_add(0, tok, y * weights[tok, slot, None])
        return out.view(x.shape)

    def forward(self, x, impl="tessera"):
        return self.forward_tessera(x) if impl == "tessera" else self.forward_torch(x)

    # ---- inputs with a well-separated routing ------------------------------------------

    def separated_input(self, tokens, margin=0.5, seed=1):
        """x [tokens, hidden] (float64) whose router logits are a shuffled ladder with steps of
        `margin`, plus noise orthogonal to the router's rows.

        A near-tie between the k-th and (k+1)-th logit would let bf16 rounding pick different
        experts in two implementations (a discrete, legitimate difference); with steps of 0.5
        and |logits| <= 2, the bf16 ulp (<= 2^-7) cannot swap them.
        """
        c = self.cfg
        g = torch.Generator().manual_seed(seed)
        w = self.router.detach().double()
        ladder = (torch.arange(c.experts, dtype=torch.float64) - (c.experts - 1) / 2) * margin
        target = torch.stack([ladder[torch.randperm(c.experts, generator=g)] for _ in range(tokens)])
        noise = torch.randn(tokens, c.hidden, generator=g, dtype=torch.float64)
        pinv = torch.linalg.pinv(w)  # [hidden, E]
        noise = noise - (noise @ w.t()) @ pinv.t()  # project out the router's row space
        return noise + target @ pinv.t()
