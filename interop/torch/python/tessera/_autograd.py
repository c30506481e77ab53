"""Autograd for the ops that have backward kernels.

Each backward is made of `torch.ops.tpu.*` calls (the backward kernels), so it runs on
whatever device the forward ran on and `torch.compile` traces it like any op.
Outputs that are statistics for the backward (`lse`) are not differentiable.
"""

import torch

tpu = torch.ops.tpu


def _matmul_backward(ctx, g):
    x, y = ctx.saved_tensors
    dx = tpu.matmul(g, y.t()) if ctx.needs_input_grad[0] else None
    dy = tpu.matmul(x.t(), g) if ctx.needs_input_grad[1] else None
    return dx, dy


def _matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _rmsnorm_setup(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def _rmsnorm_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = tpu.rmsnorm_bwd(x, w, dy, ctx.eps)
    return dx, dw, None


def _rmsnorm_residual_setup(ctx, inputs, output):
    x, residual, w, eps = inputs
    ctx.save_for_backward(output[1], w)
    ctx.eps = eps


def _rmsnorm_residual_backward(ctx, dout, dh):
    h, w = ctx.saved_tensors
    dx, dw = tpu.rmsnorm_bwd(h, w, dout, ctx.eps)
    if dh is not None:
        dx = dx + dh
    return dx, dx, dw, None


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    da, db = tpu.swiglu_bwd(a, b, dy)
    return da, db


def _rope_setup(ctx, inputs, output):
    x, position_ids, theta, interleaved = inputs
    ctx.save_for_backward(position_ids)
    ctx.statics = (theta, interleaved)


def _rope_backward(ctx, dy):
    (position_ids,) = ctx.saved_tensors
    return tpu.rope_bwd(dy, position_ids, *ctx.statics), None, None, None


def _cross_entropy_setup(ctx, inputs, output):
    logits, labels = inputs
    loss, lse = output
    ctx.save_for_backward(logits, labels, lse)
    ctx.mark_non_differentiable(lse)


def _cross_entropy_backward(ctx, dloss, dlse):
    logits, labels, lse = ctx.saved_tensors
    return tpu.cross_entropy_bwd(logits, labels, lse, dloss), None


def _gmm_setup(ctx, inputs, output):
    lhs, rhs, group_sizes, transpose_rhs = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)
    ctx.transpose_rhs = transpose_rhs


def _gmm_backward(ctx, grad):
    lhs, rhs, group_sizes = ctx.saved_tensors
    dlhs = tpu.gmm(grad, rhs, group_sizes, not ctx.transpose_rhs) if ctx.needs_input_grad[0] else None
    drhs = None
    if ctx.needs_input_grad[1]:
        # rhs [g, k, n]: lhs^T @ grad per group; rhs [g, n, k] (transposed): grad^T @ lhs.
        drhs = tpu.tgmm(grad, lhs, group_sizes) if ctx.transpose_rhs else tpu.tgmm(lhs, grad, group_sizes)
    return dlhs, drhs, None, None


def _permute_setup(ctx, inputs, output):
    x, expert_ids, num_experts = inputs
    ctx.save_for_backward(expert_ids)
    ctx.num_experts = num_experts
    ctx.mark_non_differentiable(output[1])


def _permute_backward(ctx, dxs, dgroup_sizes):
    (ids,) = ctx.saved_tensors
    # Each token's rows summed back: combine with unit weights.
    ones = torch.ones(ids.shape, dtype=dxs.dtype, device=dxs.device)
    return tpu.combine(dxs, ones, ids, ctx.num_experts), None, None


def _combine_setup(ctx, inputs, output):
    y, weights, expert_ids, num_experts = inputs
    ctx.save_for_backward(y, weights, expert_ids)
    ctx.num_experts = num_experts


def _combine_backward(ctx, dout):
    y, weights, ids = ctx.saved_tensors
    # Row r of y holds (token, slot) = divmod(order[r], k): expert-sorted, stable.
    order = torch.argsort(ids.reshape(-1).to(torch.int64), stable=True)
    dout_rows = tpu.permute(dout, ids, ctx.num_experts)[0]
    w_rows = weights.reshape(-1)[order].unsqueeze(1)
    dy = (dout_rows.float() * w_rows.float()).to(y.dtype)
    dw_rows = (dout_rows.float() * y.float()).sum(1)
    dw = torch.empty_like(dw_rows).index_copy_(0, order, dw_rows).reshape(weights.shape).to(weights.dtype)
    return dy, dw, None, None


def _router_setup(ctx, inputs, output):
    logits, k, gate, normalize = inputs
    weights, ids = output
    ctx.save_for_backward(logits, weights, ids)
    ctx.statics = (gate, normalize)
    ctx.mark_non_differentiable(ids)


def _router_backward(ctx, dweights, dids):
    # Closed forms (f32) of the gate's gradient at the chosen experts; others get 0.
    logits, weights, ids = ctx.saved_tensors
    gate, normalize = ctx.statics
    ids = ids.to(torch.int64)
    dw, w = dweights.float(), weights.float()
    if gate == "softmax" and normalize:
        # w is a softmax over the chosen logits alone.
        dl = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, ids, w * (dw - (w * dw).sum(1, keepdim=True)))
    elif gate == "softmax":
        p = torch.softmax(logits.float(), dim=1)
        dp = torch.zeros_like(p).scatter_(1, ids, dw)
        dl = p * (dp - (p * dp).sum(1, keepdim=True))
    else:
        s = torch.sigmoid(logits.float().gather(1, ids))
        ds = (dw - (w * dw).sum(1, keepdim=True)) / s.sum(1, keepdim=True) if normalize else dw
        dl = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, ids, ds * s * (1 - s))
    return dl.to(logits.dtype), None, None, None


def _flash_setup(ctx, inputs, output):
    q, k, v, causal, sm_scale, soft_cap, q_seg, kv_seg = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_seg, kv_seg)
    ctx.statics = (causal, sm_scale, soft_cap)
    ctx.mark_non_differentiable(lse)


def _flash_backward(ctx, do, dlse):
    q, k, v, o, lse, q_seg, kv_seg = ctx.saved_tensors
    causal, sm_scale, soft_cap = ctx.statics
    dq, dk, dv = tpu.flash_attention_bwd(q, k, v, o, lse, do, causal, sm_scale, soft_cap, q_seg, kv_seg)
    return dq, dk, dv, None, None, None, None, None


BACKWARDS = {
    "matmul": (_matmul_setup, _matmul_backward),
    "rmsnorm": (_rmsnorm_setup, _rmsnorm_backward),
    "rmsnorm_residual": (_rmsnorm_residual_setup, _rmsnorm_residual_backward),
    "swiglu": (_swiglu_setup, _swiglu_backward),
    "rope": (_rope_setup, _rope_backward),
    "cross_entropy": (_cross_entropy_setup, _cross_entropy_backward),
    "gmm": (_gmm_setup, _gmm_backward),
    "router_topk": (_router_setup, _router_backward),
    "permute": (_permute_setup, _permute_backward),
    "combine": (_combine_setup, _combine_backward),
    "flash_attention_fwd": (_flash_setup, _flash_backward),
}


def _no_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"torch.ops.tpu.{name} has no backward: a gradient cannot flow through it. "
            f"Detach its inputs (or its outputs) where no gradient is needed."
        )

    return backward


def register(lib):
    from tessera import _native

    for name, (setup, backward) in BACKWARDS.items():
        torch.library.register_autograd(f"tpu::{name}", backward, setup_context=setup, lib=lib)
    # Without an autograd kernel, torch's fallback only warns and backprop silently gives
    # no gradient (None) to the op's inputs: make that an error naming the op instead.
    for name, _, _ in _native.op_table():
        if name not in BACKWARDS:
            torch.library.register_autograd(f"tpu::{name}", _no_backward(name), lib=lib)
