"""Collective ops written with `#[tpu_kernel]` and remote DMA, as `torch.ops.tpu.*`:

- `all_gather(x, dim, group_name)`: every rank's `x` concatenated along `dim`, on every rank;
- `reduce_scatter(x, dim, group_name)`: the sum over ranks of `x`, split along `dim`, rank
  `r` keeping chunk `r` (bf16 sums in f32, rounded once);
- `all_gather_matmul(x, w, group_name)`: `all_gather(x, 0) @ w` (collective matmul: the
  ring runs under the matmuls);
- `ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes,
  group_name)`: `jax.lax.ragged_all_to_all`'s contract, MoE token dispatch and return: rank
  `d` sends rows `input_offsets[p] .. + send_sizes[p]` of `x` to rank `p`, where they land
  at `output_offsets[p]` of `p`'s result; `recv_sizes[p]` is how many rows `p` sends to
  `d`; rows nobody sends keep `output`'s values.

(TorchTPU's own collectives are `_`-prefixed, so the names do not collide.) `group_name`
is a `torch.distributed` process group's `group_name`; the Python helpers below take the
group itself (default: the world). Each op has autograd (all-gather and reduce-scatter are
each other's transpose; the all-to-all's, `ragged_all_to_all_bwd`, is the all-to-all back)
and fake shapes, so it passes `opcheck`, works under torch.compile, and inside DTensor code
through `to_local`.

On the CPU (gloo), the ring kernels run on Tessera's interpreter, which simulates the
group's devices (`kernels/src/collective.rs`, `interop/torch/src/collective.rs`): each rank
gathers every rank's operands with one `torch.distributed` all-gather, runs the kernel on
all simulated devices, and keeps its own results. So the remote copies, semaphores and
waits of the TPU kernel are what computes the result, and a kernel bug is an error naming
the device; it is a correctness path (each rank does the whole group's work), not a fast
one. On the emulated `tpu` device (host memory) the operands cross as CPU tensors and the
results come back on the device; tensors on TorchTPU's `tpu` device are refused: the
multi-chip TPU path (the same kernels in a multi-partition StableHLO module, which
`tests/tests/collective.rs` compiles with libtpu) is not wired to TorchTPU's runtime yet.
"""

import torch
import torch.distributed as dist

from tessera import _native
from tessera._ops import get_target

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]  # signature codes


def _group(group_name):
    return dist.distributed_c10d._resolve_process_group(group_name)


def _name(op, group):
    """`group`'s name (default: the world's, which needs `init_process_group` first)."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(
                f"tessera.distributed.{op}: the default process group has not been initialized; "
                "call torch.distributed.init_process_group first, or pass group="
            )
        group = dist.group.WORLD
    return group.group_name


def _dim(op, x, dim):
    """`dim` of `x` in `0..x.dim()` (a negative one counts from the end), as torch ops take it;
    out of range: torch's IndexError, never a wrap onto another dim."""
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"tessera {op}: Dimension out of range (expected to be in range of [{-x.dim()}, {x.dim() - 1}], but got {dim})")
    return dim % x.dim()


def _device(op, **tensors):
    """The device the operands are on: the CPU, or the emulated `tpu` device (host memory: its
    tensors cross as CPU tensors and the results come back on it)."""
    device = next(iter(tensors.values())).device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"tessera {op}: `{name}` is on {t.device}, other operands on {device}; pass them on one device")
    if device.type == "cpu":
        return device
    if device.type == "tpu":
        from tessera import emulated_tpu

        if emulated_tpu.is_enabled():
            return device
    raise NotImplementedError(
        f"tessera {op}: the operands are on {device}; the collective kernels run on CPU tensors (gloo) and on the "
        "emulated `tpu` device; TorchTPU's multi-chip path is not wired yet: move the tensors to the CPU"
    )


def _signature(tensors):
    """An int64 tensor naming the operands' dtypes and shapes (padded), to compare across ranks."""
    sig = []
    for t in tensors:
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
        sig += [code, t.dim(), *t.shape, -1]
    return torch.tensor(sig + [0] * (64 - len(sig)), dtype=torch.int64)


def _all_gather_bytes(t, group):
    """Every rank's `t` (same shape and dtype everywhere), by its bytes (gloo moves any dtype
    as uint8)."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    outs = [torch.empty_like(flat) for _ in range(group.size())]
    dist.all_gather(outs, flat, group=group)
    return [o.view(t.dtype).view(t.shape) for o in outs]


def _operands(op, tensors, group):
    """Every rank's operands, after checking all ranks pass the same shapes and dtypes (every
    rank raises the same error when they do not: no rank is left waiting in a collective)."""
    if len(tensors) * 8 > 64 or any(t.dim() > 5 for t in tensors):
        raise ValueError(f"tessera {op}: operands of more than 5 dims are not supported")
    sig = _signature(tensors)
    sigs = [torch.empty_like(sig) for _ in range(group.size())]
    dist.all_gather(sigs, sig, group=group)
    for r, s in enumerate(sigs):
        if not torch.equal(s, sigs[0]):
            shapes = ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors)
            raise ValueError(
                f"tessera {op}: rank {r} passes operands of other shapes or dtypes than rank 0 (this rank: {shapes}); "
                "every rank of the group runs the same kernel: pass the same shapes and dtypes on every rank"
            )
    per_rank = [[] for _ in range(group.size())]
    for t in tensors:
        for r, g in enumerate(_all_gather_bytes(t, group)):
            per_rank[r].append(g)
    return per_rank


def _check_dtype(op, name, t, allowed):
    if t.dtype not in allowed:
        raise TypeError(f"tessera {op}: `{name}` is {t.dtype}; use {' or '.join(str(a).removeprefix('torch.') for a in allowed)}")


# ---- all_gather / reduce_scatter ----------------------------------------------------------


@torch.library.custom_op("tpu::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    device = _device("all_gather", x=x)
    _check_dtype("all_gather", "x", x, (torch.float32, torch.bfloat16, torch.int32))
    group = _group(group_name)
    if x.dim() == 0:
        raise ValueError("tessera all_gather: `x` is 0-dim; gather tensors of at least one dim")
    d = _dim("all_gather", x, dim)
    rows = x.cpu().movedim(d, 0)
    flat = rows.reshape(rows.shape[0], -1)
    (out,) = _native.run_collective("all_gather", [[o[0]] for o in _operands("all_gather", [flat], group)], group.rank(), get_target())
    return out.reshape(group.size() * rows.shape[0], *rows.shape[1:]).movedim(0, d).contiguous().to(device)


@_all_gather.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[_dim("all_gather", x, dim)] *= _group(group_name).size()
    return x.new_empty(shape)


@torch.library.custom_op("tpu::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    device = _device("reduce_scatter", x=x)
    _check_dtype("reduce_scatter", "x", x, (torch.float32, torch.bfloat16))
    group = _group(group_name)
    n = group.size()
    if x.dim() == 0:
        raise ValueError("tessera reduce_scatter: `x` is 0-dim; scatter tensors of at least one dim")
    d = _dim("reduce_scatter", x, dim)
    if x.shape[d] % n:
        raise ValueError(
            f"tessera reduce_scatter: `x` {list(x.shape)} has no dim {dim} divisible by the group's {n} ranks; "
            f"pad dim {dim} to a multiple of {n}"
        )
    rows = x.cpu().movedim(d, 0)
    chunks = rows.reshape(n, rows.shape[0] // n, -1)
    (out,) = _native.run_collective("reduce_scatter", [[o[0]] for o in _operands("reduce_scatter", [chunks], group)], group.rank(), get_target())
    return out.reshape(rows.shape[0] // n, *rows.shape[1:]).movedim(0, d).contiguous().to(device)


@_reduce_scatter.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[_dim("reduce_scatter", x, dim)] //= _group(group_name).size()
    return x.new_empty(shape)


def _dim_ctx(ctx, inputs, output):
    ctx.dim, ctx.group_name = inputs[1], inputs[2]


_all_gather.register_autograd(lambda ctx, g: (_reduce_scatter(g, ctx.dim, ctx.group_name), None, None), setup_context=_dim_ctx)
_reduce_scatter.register_autograd(lambda ctx, g: (_all_gather(g, ctx.dim, ctx.group_name), None, None), setup_context=_dim_ctx)


# ---- all_gather_matmul --------------------------------------------------------------------


@torch.library.custom_op("tpu::all_gather_matmul", mutates_args=())
def _all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group_name: str) -> torch.Tensor:
    device = _device("all_gather_matmul", x=x, w=w)
    group = _group(group_name)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0] or x.dtype != w.dtype:
        raise ValueError(f"tessera all_gather_matmul: x {x.dtype}{list(x.shape)} @ w {w.dtype}{list(w.shape)}: pass x [m, k] and w [k, n] of one dtype")
    _check_dtype("all_gather_matmul", "x", x, (torch.float32, torch.bfloat16))
    (out,) = _native.run_collective("all_gather_matmul", _operands("all_gather_matmul", [x.cpu(), w.cpu()], group), group.rank(), get_target())
    return out.reshape(-1, w.shape[1]).to(device)


@_all_gather_matmul.register_fake
def _(x, w, group_name):
    return x.new_empty(x.shape[0] * _group(group_name).size(), w.shape[1])


def _agmm_ctx(ctx, inputs, output):
    x, w, ctx.group_name = inputs
    ctx.save_for_backward(x, w)


def _agmm_backward(ctx, g):
    x, w = ctx.saved_tensors
    # out = gather(x) @ w on every rank: x's gradient sums every rank's g @ w^T rows of this
    # rank's shard; w's is this rank's gather(x)^T @ g (replicated w: the caller reduces).
    dx = _reduce_scatter(g @ w.t(), 0, ctx.group_name) if ctx.needs_input_grad[0] else None
    dw = _all_gather(x, 0, ctx.group_name).t() @ g if ctx.needs_input_grad[1] else None
    return dx, dw, None


_all_gather_matmul.register_autograd(_agmm_backward, setup_context=_agmm_ctx)


# ---- ragged_all_to_all --------------------------------------------------------------------


def _rows_as_words(op, x):
    """Rows of 16-bit values move as 32-bit words (the kernel copies whole rows; packed
    16-bit rows cannot move one at a time)."""
    if x.dtype in (torch.float32, torch.int32):
        return x
    if x.dtype in (torch.bfloat16, torch.float16):
        if x.shape[1] % 2:
            raise ValueError(f"tessera {op}: {x.dtype} rows of odd width {x.shape[1]} cannot move as 32-bit words; pad the last dim to an even size")
        return x.view(torch.int32)
    raise TypeError(f"tessera {op}: `x` is {x.dtype}; use float32, bfloat16, float16 or int32")


def _check_metadata(meta, rows_in, rows_out, me):
    """Bounds and agreement of every rank's metadata (`meta[r]`: rank r's four [n] arrays),
    checked the same way on every rank so all raise together."""
    n = len(meta)
    for r, (io, ss, oo, rs) in enumerate(meta):
        for p in range(n):
            if ss[p] < 0 or rs[p] < 0 or io[p] < 0 or oo[p] < 0:
                raise ValueError(f"tessera ragged_all_to_all: rank {r}'s offsets and sizes for peer {p} must be >= 0")
            if io[p] + ss[p] > rows_in:
                raise ValueError(
                    f"tessera ragged_all_to_all: rank {r} sends rows {io[p]}..{io[p] + ss[p]} of `x` to rank {p}, "
                    f"but `x` has {rows_in} rows: input_offsets[{p}] + send_sizes[{p}] must be <= x.shape[0]"
                )
            if oo[p] + ss[p] > rows_out:
                raise ValueError(
                    f"tessera ragged_all_to_all: rank {r} writes rows {oo[p]}..{oo[p] + ss[p]} of rank {p}'s result, "
                    f"which has {rows_out} rows: output_offsets[{p}] + send_sizes[{p}] must be <= output.shape[0]"
                )
            if meta[p][3][r] != ss[p]:
                raise ValueError(
                    f"tessera ragged_all_to_all: rank {r} sends {ss[p]} rows to rank {p}, whose recv_sizes[{r}] is {meta[p][3][r]}: "
                    "recv_sizes on each rank must equal what its peers send it"
                )


@torch.library.custom_op("tpu::ragged_all_to_all", mutates_args=())
def _ragged_all_to_all(
    x: torch.Tensor,
    output: torch.Tensor,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    group_name: str,
) -> torch.Tensor:
    op = "ragged_all_to_all"
    device = _device(op, x=x, output=output)
    group = _group(group_name)
    n, me = group.size(), group.rank()
    if x.dim() != 2 or output.dim() != 2 or x.shape[1] != output.shape[1] or x.dtype != output.dtype:
        raise ValueError(f"tessera {op}: x {x.dtype}{list(x.shape)} and output {output.dtype}{list(output.shape)}: pass [rows, h] tensors of one dtype and width")
    meta = []
    for name, m in (("input_offsets", input_offsets), ("send_sizes", send_sizes), ("output_offsets", output_offsets), ("recv_sizes", recv_sizes)):
        if m.shape != (n,) or m.dtype.is_floating_point or m.dtype == torch.bool:
            raise ValueError(f"tessera {op}: `{name}` is {m.dtype}{list(m.shape)}; pass an integer tensor of one entry per rank, [{n}]")
        meta.append(m.to(torch.int32).cpu())
    words = _rows_as_words(op, x.cpu().contiguous())
    operands = _operands(op, meta + [words], group)
    _check_metadata([[m.tolist() for m in o[:4]] for o in operands], x.shape[0], output.shape[0], me)
    (moved,) = _native.run_collective(op, operands, me, get_target(), out_rows=output.shape[0])
    moved = moved.view(x.dtype) if moved.dtype != x.dtype else moved
    # Rows nobody sent keep `output`'s values (the kernel leaves them untouched).
    out = output.cpu().clone()
    for o in operands:
        start, count = int(o[2][me]), int(o[1][me])
        out[start : start + count] = moved[start : start + count]
    return out.to(device)


@_ragged_all_to_all.register_fake
def _(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    return torch.empty_like(output)


@torch.library.custom_op("tpu::ragged_all_to_all_bwd", mutates_args=())
def _ragged_all_to_all_bwd(
    g: torch.Tensor,
    x_rows: int,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `ragged_all_to_all` for `x` (of `x_rows` rows) and `output`, given the
    result's `g`. (One op, so that traced backward graphs hold no data-dependent Python.)"""
    group = _group(group_name)
    me = group.rank()
    # The reverse transfer: each rank returns to peer q the rows q sent it, from where they
    # landed (q's output_offsets[me]) to where they came from (q's input_offsets[me]).
    offsets = torch.stack([input_offsets.to(torch.int64).cpu(), output_offsets.to(torch.int64).cpu()])
    everyone = [torch.empty_like(offsets) for _ in range(group.size())]
    dist.all_gather(everyone, offsets, group=group)
    back_in = torch.tensor([int(e[1][me]) for e in everyone], dtype=torch.int32)
    back_out = torch.tensor([int(e[0][me]) for e in everyone], dtype=torch.int32)
    dx = _ragged_all_to_all(g.contiguous(), g.new_zeros(x_rows, g.shape[1]), back_in, recv_sizes.to(torch.int32), back_out, send_sizes.to(torch.int32), group_name)
    # `output`'s gradient: the rows nobody wrote.
    d_output = g.clone()
    for q, e in enumerate(everyone):
        start, count = int(e[1][me]), int(recv_sizes[q])
        d_output[start : start + count] = 0
    return dx, d_output


@_ragged_all_to_all_bwd.register_fake
def _(g, x_rows, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
    return g.new_empty(x_rows, g.shape[1]), torch.empty_like(g)


def _a2a_ctx(ctx, inputs, output):
    x, _, io, ss, oo, rs, ctx.group_name = inputs
    ctx.x_rows = x.shape[0]  # only its row count: x itself need not live until backward
    ctx.save_for_backward(io, ss, oo, rs)


def _a2a_backward(ctx, g):
    io, ss, oo, rs = ctx.saved_tensors
    dx, d_output = _ragged_all_to_all_bwd(g, ctx.x_rows, io, ss, oo, rs, ctx.group_name)
    return dx, d_output, None, None, None, None, None


_ragged_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_ctx)


# ---- the Python face ----------------------------------------------------------------------


def all_gather(x, dim=0, group=None):
    """`torch.ops.tpu.all_gather` over `group` (a process group; default the world)."""
    return torch.ops.tpu.all_gather(x, dim, _name("all_gather", group))


def reduce_scatter(x, dim=0, group=None):
    """`torch.ops.tpu.reduce_scatter` over `group` (default the world)."""
    return torch.ops.tpu.reduce_scatter(x, dim, _name("reduce_scatter", group))


def all_gather_matmul(x, w, group=None):
    """`torch.ops.tpu.all_gather_matmul` over `group` (default the world)."""
    return torch.ops.tpu.all_gather_matmul(x, w, _name("all_gather_matmul", group))


def ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, group=None):
    """`torch.ops.tpu.ragged_all_to_all` over `group` (default the world)."""
    return torch.ops.tpu.ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, _name("ragged_all_to_all", group))


__all__ = ["all_gather", "reduce_scatter", "all_gather_matmul", "ragged_all_to_all"]
