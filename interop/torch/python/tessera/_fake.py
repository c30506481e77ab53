"""Fake (meta) implementations: each op's output shapes and dtypes from its inputs'.

They only use shape arithmetic, so symbolic shapes flow through `torch.compile` and
`torch.export`. The real kernels are checked against these by `torch.library.opcheck`.
"""

import torch

F32, I32 = torch.float32, torch.int32


def _like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def matmul(x, y):
    return x.new_empty((x.shape[0], y.shape[1]))


def gelu_affine(x, a, b):
    return _like(x)


def softmax(x):
    return _like(x)


def rmsnorm(x, weight, eps=1e-6):
    return _like(x)


def rmsnorm_residual(x, residual, weight, eps=1e-6):
    return _like(x), _like(x)


def layernorm(x, weight, bias, eps=1e-5):
    return _like(x)


def rmsnorm_bwd(x, weight, dy, eps=1e-6):
    return _like(x), _like(weight)


def swiglu(a, b):
    return _like(a)


def swiglu_bwd(a, b, dy):
    return _like(a), _like(a)


def rope(x, position_ids, theta=10000.0, interleaved=False):
    return _like(x)


def rope_bwd(dy, position_ids, theta=10000.0, interleaved=False):
    return _like(dy)


def cross_entropy(logits, labels):
    t = logits.shape[0]
    return logits.new_empty((t,), dtype=F32), logits.new_empty((t,), dtype=F32)


def cross_entropy_bwd(logits, labels, lse, dloss):
    return _like(logits)


def cross_entropy_with_grad(logits, labels):
    return logits.new_empty((logits.shape[0],), dtype=F32), _like(logits)


def quantized_matmul(x, w, scale):
    return x.new_empty((x.shape[0], w.shape[0]))


def gmm(lhs, rhs, group_sizes, transpose_rhs=False):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return lhs.new_empty((lhs.shape[0], n))


def tgmm(lhs, grad, group_sizes):
    return lhs.new_empty((group_sizes.shape[0], lhs.shape[1], grad.shape[1]))


def router_topk(logits, k=2, gate="softmax", normalize=True):
    t = logits.shape[0]
    return logits.new_empty((t, k)), logits.new_empty((t, k), dtype=I32)


def permute(x, expert_ids, num_experts):
    rows = expert_ids.shape[0] * expert_ids.shape[1]
    return x.new_empty((rows, x.shape[1])), x.new_empty((num_experts,), dtype=I32)


def combine(y, weights, expert_ids, num_experts):
    return y.new_empty((expert_ids.shape[0], y.shape[1]))


def flash_attention_fwd(q, k, v, causal=False, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None):
    return _like(q), q.new_empty(q.shape[:3], dtype=F32)


def flash_attention_bwd(q, k, v, o, lse, do, causal=False, sm_scale=None, soft_cap=None, q_segment_ids=None, kv_segment_ids=None):
    return _like(q), _like(k), _like(v)


def paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=None):
    return _like(q)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0, sliding_window=None, soft_cap=None, num_queries_per_block=None, num_kv_pages_per_block=None):
    return _like(q)
