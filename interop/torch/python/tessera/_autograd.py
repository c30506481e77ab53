"""Autograd, derived from each op's table entry.

An op's backward is declared natively (`kernels/src/op.rs`, `Backward`): another op of the
table, its arguments (the forward's inputs, outputs and statics, and `d_<output>` for the
gradient flowing into an output) and which forward inputs its results are the gradients
of. `register` turns that into `torch.library.register_autograd` for every op, so the
backward runs as `torch.ops.tpu.*` calls on whatever device the forward ran on and
`torch.compile` traces it like any op. Outputs whose gradient the backward does not take
(expert ids, group sizes) are marked non-differentiable. The `lse` of flash attention and of
cross-entropy is differentiable: its gradient (a z-loss, merging partial attentions) is added
by a composite of library ops (`LSE_GRADIENTS`), run only when one flows.

Two ops declare a `composite` backward: a torch composite of other ops, written below
(`COMPOSITES`), until they get backward kernels of their own.
"""

import sys

import torch

tpu = torch.ops.tpu

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



COMPOSITES = {
    "router_topk": (_router_setup, _router_backward),
    "combine": (_combine_setup, _combine_backward),
}


def _flash_lse_gradient(env, d_lse):
    """q's and k's gradients through `lse = logsumexp(s)`, `s = scale * q k^T` (masked):
    `dq = scale * d_lse * (P @ K)` and `dk = scale * P^T @ (d_lse * q)`, i.e. the forward
    with k as the values and the backward's dv of `do = d_lse * q` (summed over a GQA group's
    heads). Extra launches, only when a gradient flows into lse (a z-loss, merging partial
    attentions). With a soft cap the weights' derivative carries `1 - tanh^2`, which no
    kernel computes: a torch composite then ([`_capped_lse_gradient`])."""
    q, k = env["q"], env["k"]
    if env["soft_cap"] is not None:
        return _capped_lse_gradient(env, d_lse)
    scale = env["sm_scale"] if env["sm_scale"] is not None else q.shape[-1] ** -0.5
    statics = (env["causal"], env["sm_scale"], None, env["q_segment_ids"], env["kv_segment_ids"], env["window_left"], env["window_right"])
    d = d_lse.reshape(q.shape[:3]).unsqueeze(-1).float()
    pk = tpu.flash_attention_fwd(q, k, k, *statics)[0]
    dq = (scale * d * pk.float()).to(q.dtype)
    dv_of = tpu.flash_attention_bwd(q, k, env["v"], env["o"], env["lse"], (d * q.float()).to(q.dtype), *statics)[2]
    return {"q": dq, "k": (scale * dv_of.float()).to(k.dtype)}


def _capped_lse_gradient(env, d_lse):
    """The lse gradient of soft-capped attention in f32 torch ops over the whole `[sq, skv]`
    score matrix per head (memory the kernels never hold): `ds = p * d_lse * (1 - (s /
    cap)^2)` for the visible pairs (causal, window, segment ids as the kernels mask them)."""
    q, k, cap = env["q"], env["k"], env["soft_cap"]
    b, h, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    scale = env["sm_scale"] if env["sm_scale"] is not None else dim ** -0.5
    kr = k.float().repeat_interleave(h // hkv, 1)
    s = cap * torch.tanh(scale * (q.float() @ kr.transpose(-1, -2)) / cap)
    rows, cols = torch.arange(sq, device=q.device).unsqueeze(1), torch.arange(skv, device=q.device)
    keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device)
    if env["causal"]:
        keep &= cols <= rows
    if env["window_left"] is not None:
        keep &= rows - cols <= env["window_left"]
    if env["window_right"] is not None:
        keep &= cols - rows <= env["window_right"]
    keep = keep.expand(b, 1, sq, skv)
    if env["q_segment_ids"] is not None:
        keep = keep & (env["q_segment_ids"].reshape(b, 1, sq, 1) == env["kv_segment_ids"].reshape(b, 1, 1, skv))
    lse = env["lse"].float().reshape(b, h, sq, 1)
    p = torch.where(keep & (lse > float("-inf")), torch.exp(s - lse), 0.0)
    ds = p * d_lse.float().reshape(b, h, sq, 1) * (1 - (s / cap) ** 2) * scale
    dq = ds @ kr
    dk = (ds.transpose(-1, -2) @ q.float()).reshape(b, hkv, h // hkv, skv, dim).sum(2)
    return {"q": dq.to(q.dtype), "k": dk.to(k.dtype)}


def _cross_entropy_lse_gradient(env, d_lse):
    """logits' gradient through `lse = logsumexp(logits)`: `softmax * d_lse`, every row
    (an ignored row's lse is its logsumexp too), in f32."""
    logits, lse = env["logits"], env["lse"]
    p = torch.exp(logits.float() - lse.float().reshape(-1, 1))
    return {"logits": (p * d_lse.float().reshape(-1, 1)).to(logits.dtype)}


# Ops whose declared backward does not take a gradient into their `lse` output: it is added
# by these composites when one flows (the output stays differentiable).
LSE_GRADIENTS = {
    "flash_attention_fwd": _flash_lse_gradient,
    "cross_entropy": _cross_entropy_lse_gradient,
}


def _zeros_factory(out):
    """Makes the zero gradient of output `out` when none flows into it: a DTensor's with
    its mesh and placements (a plain tensor would not mix with the DTensor arguments)."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and isinstance(out, dt.DTensor):
        local, mesh, placements = out.to_local(), out.device_mesh, out.placements
        shape, stride, dtype, device = out.shape, out.stride(), local.dtype, local.device
        local_shape = local.shape
        return lambda: dt.DTensor.from_local(torch.zeros(local_shape, dtype=dtype, device=device), mesh, placements, run_check=False, shape=shape, stride=stride)
    shape, dtype, device = out.shape, out.dtype, out.device
    return lambda: torch.zeros(shape, dtype=dtype, device=device)


def _declared(spec):
    """setup_context and backward of an op whose backward is another op of the table."""
    bwd_op, args, grads = spec.backward
    names, outputs = spec.arg_names, [o[0] for o in spec.outputs]
    tensor_args = [a for a in args if not a.startswith("d_") and (a in outputs or a in spec.tensor_names)]
    static_args = [a for a in args if not a.startswith("d_") and a not in tensor_args]
    flowing = {a[2:] for a in args if a.startswith("d_")}
    input_index = {n: i for i, n in enumerate(names)}
    backward_fn = getattr(tpu, bwd_op)

    lse_gradient = LSE_GRADIENTS.get(spec.name)
    differentiable = flowing | ({"lse"} if lse_gradient else set())
    # The lse composite reads every argument of the op.
    saved = tensor_args + [a for a in names if lse_gradient and a in spec.tensor_names and a not in tensor_args]
    kept = static_args + [a for a in names if lse_gradient and a not in spec.tensor_names and a not in static_args]

    def setup(ctx, inputs, output):
        inputs = tuple(inputs) + spec.defaults[len(inputs):]
        out = spec.as_tuple(output)
        env = dict(zip(names, inputs))
        env.update(zip(outputs, out))
        ctx.save_for_backward(*[env[a] for a in saved])
        ctx.statics = {a: env[a] for a in kept}
        ctx.out_zeros = [_zeros_factory(o) for o in out]
        nondiff = [o for name, o in zip(outputs, out) if name not in differentiable or not o.is_floating_point()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        if lse_gradient:
            ctx.set_materialize_grads(False)  # no gradient into lse: None, not zeros

    def backward(ctx, *grad_outputs):
        env = dict(zip(saved, ctx.saved_tensors))
        env.update(ctx.statics)
        for name, g, zeros in zip(outputs, grad_outputs, ctx.out_zeros):
            env["d_" + name] = g if g is not None else zeros()
        from tessera._ops import SPECS

        results = SPECS[bwd_op].as_tuple(backward_fn(*[env[a] for a in args]))
        grads_in = [None] * len(names)
        d_lse = grad_outputs[outputs.index("lse")] if lse_gradient else None
        extra = lse_gradient(env, d_lse) if d_lse is not None else {}
        for result, targets in list(zip(results, grads)) + [(g, [name]) for name, g in extra.items()]:
            for name in targets:
                i = input_index[name]
                grads_in[i] = result if grads_in[i] is None else grads_in[i] + result
        return tuple(grads_in)

    return setup, backward


def _no_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"torch.ops.tpu.{name} has no backward: a gradient cannot flow through it. "
            f"Detach its inputs (or its outputs) where no gradient is needed."
        )

    return backward


def _impl(lib, spec, backward, setup_context, fast_cpu):
    """`torch.library.register_autograd`, with a fast path: on CPU tensors none of which
    needs a gradient (grad mode or not), `fast_cpu(args)` runs the CPU kernel directly
    instead of torch's generic kernel redispatching below autograd (one Python hop and one
    dispatcher round trip fewer). Any other key below autograd (a TorchDispatchMode such
    as DeferAndFuse, a tensor subclass, another device) takes torch's path."""
    make = getattr(getattr(torch._library, "autograd", None), "make_autograd_impl", None)
    if fast_cpu is None or make is None:
        torch.library.register_autograd(spec.qualname, backward, setup_context=setup_context, lib=lib)
        return
    op = torch._library.utils.lookup_op(spec.qualname)
    generic = make(op, torch._library.autograd.Info(backward, setup_context))
    after_autograd = torch._C._after_autograd_keyset
    # CPU tensors, or none at all (a None for a required tensor: the CPU kernel names it).
    direct = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.Undefined)
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad

    def autograd(keyset, *args):
        if (keyset & after_autograd).highestPriorityTypeId() in direct and not (grad_enabled() and any_requires_grad(*args)):
            return fast_cpu(args)
        return generic(keyset, *args)

    autograd.__name__ = f"tessera_{spec.name}_autograd"
    lib.impl(spec.name, autograd, "Autograd", with_keyset=True)


def _through(lib, spec, fast_cpu):
    """The autograd kernel of an alias with kernels of its own, result `index` of op `of`
    (`spec.alias_of`): with no gradient to compute, the op's own kernels run
    (`flash_attention`'s writes no lse); with one, op `of` does, whose autograd saves what
    its backward reads (`flash_attention_fwd` saves lse)."""
    of, index = spec.alias_of
    op = torch._library.utils.lookup_op(spec.qualname)
    after_autograd = torch._C._after_autograd_keyset
    direct = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.Undefined)
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad

    def autograd(keyset, *args):
        if grad_enabled() and any_requires_grad(*args):
            return getattr(tpu, of)(*args)[index]
        below = keyset & after_autograd
        if fast_cpu is not None and below.highestPriorityTypeId() in direct:
            return fast_cpu(args)
        return op.redispatch(below, *args)

    autograd.__name__ = f"tessera_{spec.name}_autograd"
    lib.impl(spec.name, autograd, "Autograd", with_keyset=True)


def register(lib, spec, error_without_backward=True, fast_cpu=None):
    """Registers op `spec`'s autograd: its declared backward, its composite, or an error.
    `fast_cpu(args)`: the op's CPU kernel, for the path where no gradient is needed."""
    if spec.composite:
        return  # a composite of the aliased op: autograd flows through it
    if spec.alias_of is not None:
        _through(lib, spec, fast_cpu)
        return
    if spec.backward is None:
        if not error_without_backward:
            return
        # Without an autograd kernel, torch's fallback only warns and backprop silently gives
        # no gradient (None) to the op's inputs: make that an error naming the op instead.
        _impl(lib, spec, _no_backward(spec.name), None, fast_cpu)
        return
    setup, backward = COMPOSITES[spec.name] if spec.backward[0] == "composite" else _declared(spec)
    _impl(lib, spec, backward, setup, fast_cpu)
