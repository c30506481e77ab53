//! Mixture-of-experts routing: `router_topk` (gate + top-k + renormalisation), `permute`
//! (token rows into expert-sorted order, the input layout of `gmm`) and `combine` (the
//! weighted sum of each token's expert outputs back in token order).
//!
//! # How the pieces fit
//!
//! ```text
//! logits [T, E] --router_topk--> weights [T, k], expert_ids [T, k]
//! expert_ids --routing_metadata (device)--> pos [T, k], group_sizes [E]
//! x [T, D] --permute(pos)--> xs [T*k, D]  --gmm(group_sizes)--> ys [T*k, D]
//! ys, weights --combine(pos)--> out [T, D],  out[t] = sum_j w[t, j] * ys[pos[t, j]]
//! ```
//!
//! The sorted order is a *stable* sort of the `T*k` (token, slot) pairs, flattened as
//! `t * k + j`, by expert id: rows of one expert are contiguous and in token order.
//! [`routing_metadata_kernel`] computes it on the device as the first launch of `permute`,
//! `permute_bwd` and `combine` (one-hot counts over the experts and prefix sums, no sort),
//! so no call reads the ids back to the host; [`plan`] is the same order by a host sort,
//! its reference.
//!
//! # Top-k
//!
//! `k` rounds (k = 1..=8) of: row max -> lowest column attaining it (iota + select +
//! reduce_min) -> record -> mask it out (-inf, and its column is withdrawn so that a row of
//! `-inf` logits still yields `k` distinct experts). **Ties go to the lowest expert
//! index**, as in `torch.topk` / `jax.lax.top_k` on CPU. Selection runs on the logits, not
//! on the gate's output: softmax and sigmoid are monotonic, and comparing logits avoids
//! false ties where the gate rounds (sigmoid saturates to 1.0 in f32 for logits > ~17).
//! The gate is then applied to the `k` selected logits: softmax over all `E` experts or
//! an elementwise sigmoid, optionally renormalised to sum to 1 (Mixtral / Qwen3-MoE:
//! softmax, top-k, renormalise). All math is f32; weights are stored in the logits' dtype.
//! A NaN logit ranks above every number, as in `torch.topk` (NaNs among themselves: the
//! lowest expert first); its weight is NaN (and, through the softmax sum or the
//! renormalisation, the row's other weights too, as torch's).
//!
//! # Gathers by DMA
//!
//! `permute`, `combine` and `permute_bwd` are row gathers ([`gather_rows_kernel`]): each
//! output row is one row of the source (`permute`: `out[r] = x[src[r]]`, `src` the inverse
//! of the routing, [`invert_positions_kernel`]) or the weighted sum of `k` rows (`combine`:
//! `out[t] = sum_j w[t, j] * y[pos[t, j]]`; `permute_bwd` unweighted). Every (row, slot)
//! is one DMA from the source in HBM into VMEM, with the indices read as scalars from SMEM:
//! the work is `T * k` copies of a row and `T * k * D` multiply-adds, linear in tokens
//! (the one-hot matmuls this replaces cost `2 * T * T*k * D` MXU flops: 17.6 TFLOP at
//! T = 16384, k = 8, D = 4096). Values are copied bit for bit, so NaN and inf come out as
//! torch's gather and weighted sum give them, with no special handling.
//!
//! A DMA moves whole packed rows: a bf16 vreg row holds two rows of the array, so a bf16
//! row travels with its neighbour (`r & !1, r | 1`) and the kernel keeps the wanted half
//! (a one-row f32 copy in VMEM after widening); an odd-rowed bf16 source is padded with a
//! zero row by the plan (`Layout::PadRows`). So a bf16 gather moves twice its rows' bytes.
//!
//! # Ragged edges
//!
//! Grids are `ceil(n / block)` (Pallas partial edge blocks), so `T` need not be a
//! multiple of any tile. The last gather step issues copies only for its live rows;
//! output rows past the end are dropped. An index outside the source (an expert id outside
//! `0..E` routes to row -1) contributes nothing.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics, COMPOSITE};
use crate::plan::{host, result, single, Launch, Layout, Operand, Plan, Source};

/// The largest `k` `router_topk` supports (each round is a full pass over the row).
pub const MAX_TOP_K: usize = 8;
/// The most experts a routing op takes: [`routing_metadata_kernel`]'s `[8, e]` i32 temporaries
/// (about ten live) stay within 32 MiB of VMEM.
pub const MAX_EXPERTS: usize = 1 << 16;
/// Rows per `router_topk` block: 256 rows of up to 128 experts is 128 KiB of f32 per
/// temporary, and `T = 512` still splits across two TensorCores.
const ROUTER_ROWS: usize = 256;
const NEG_INF: f32 = f32::NEG_INFINITY;

/// The gate applied to the router logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Softmax over all experts (Mixtral, Qwen3-MoE).
    Softmax,
    /// Elementwise sigmoid (DeepSeek-V3 style scores).
    Sigmoid,
}

// ---- kernels ------------------------------------------------------------------------------

#[tpu_kernel(
    grid = [t.div_ceil(tm)],
    semantics = [parallel],
    logits = block([tm, e], |i| [i, 0]),
    (weights, expert_ids) = block([tm, k], |i| [i, 0]),
)]
pub fn router_topk_kernel(logits: In<t, e>, weights: Out<t, k>, expert_ids: Out<t, k>, tm: usize, sigmoid_gate: bool, normalize: bool) {
    let x = logits[..].cast(f32);
    let col = iota([tm, e], 1);
    let slot = iota([tm, k], 1);
    let mut s = x;
    // Columns still selectable; a taken one becomes `e`, which reduce_min never prefers.
    let mut cand = col;
    let mut top = zeros([tm, k], f32);
    let mut ids = zeros([tm, k], i32);
    for j in 0..k {
        // NaN ranks above every number (torch.topk): a row with a NaN left takes its
        // lowest such column; taken columns become -inf, so the next round moves on.
        let nan = s != s;
        let nan_f = select(nan, 1.0, 0.0);
        let nan_left = nan_f.reduce_max(1);
        let m = select(nan, NEG_INF, s).reduce_max(1);
        // The row's NaNs if any are left, else the columns equal to its max.
        let best = (nan_f == nan_left) & (nan | (s == m));
        let idx = select(best, cand, e).reduce_min(1);
        let hit = col == idx;
        s = select(hit, NEG_INF, s);
        cand = select(hit, e, cand);
        top = select(slot == j, select(nan_left > 0.0, f32::NAN, m), top);
        ids = select(slot == j, idx, ids);
    }
    let w = if sigmoid_gate {
        sigmoid(top)
    } else {
        let mx = x.reduce_max(1);
        (top - mx).exp() / (x - mx).exp().sum(1)
    };
    let w = if normalize { w / w.sum(1) } else { w };
    weights[..] = w.cast(weights.dtype);
    expert_ids[..] = ids;
}

/// `out[i] = sum_j w[i, j] * src[idx[i, j]]` (with `weighted` false, `sum_j src[idx[i, j]]`:
/// `permute`'s copy when `k = 1`), `idx [rows, k]`; an index outside `0..n` contributes
/// nothing. Each grid step takes `tm` output rows: it copies its indices to SMEM, starts one
/// DMA per (row, slot) from `src` in HBM into VMEM, waits for them all, and sums in f32.
///
/// A DMA moves whole packed rows: `pk` = 2 rows for bf16 (a bf16 vreg row holds two rows of
/// the array), so the copy of row `r` is the pair `r & !1, r | 1` into slot rows `2s, 2s + 1`
/// (the plan pads an odd-rowed bf16 `src` with a zero row, `Layout::PadRows`); slot `j`'s rows
/// start at `j * sp`, `sp` the slot's rows rounded up to a 16-row tile. Each slot's
/// pairs are widened to f32 in VMEM and row `2s + (r & 1)` is picked by a one-row VMEM copy
/// (f32 rows move alone). Values are copied bit for bit and summed as torch's weighted sum:
/// NaN and inf propagate as `w * y` does.
#[tpu_kernel(
    grid = [rows.div_ceil(tm)],
    semantics = [parallel],
    idx = block([tm, k], |i| [i, 0]),
    weights = block([if weighted { tm } else { 1 }, if weighted { k } else { 1 }], |i| [if weighted { i } else { 0 }, 0]),
    out = block([tm, d], |i| [i, 0]),
    buf = scratch([k * sp, d], src.dtype),
    wide = scratch([pk * tm, d], f32),
    picked = scratch([tm, d], f32),
    idx_s = scratch_smem([tm, k], i32),
    sem = semaphores(3),
)]
#[rustfmt::skip]
pub fn gather_rows_kernel(
    idx: In<rows, k>, weights: In<_, _>, src: Any<n, d>, out: Out<rows, d>,
    buf: Scratch, wide: Scratch, picked: Scratch, idx_s: Scratch, sem: Scratch,
    tm: usize, pk: usize, sp: usize, weighted: bool,
) {
    dma_start(idx, idx_s, sem[1]);
    dma_wait(idx, idx_s, sem[1]);
    // Rows past `rows` in the last step have no indices.
    let live = (rows - program_id(0) * tm).min(tm);
    for i in 0..live {
        for j in 0..k {
            let first = (idx_s[(i, j)].max(0).min(n - 1) >> (pk - 1)) << (pk - 1);
            dma_start(src[(ds(first, pk), ..)], buf[(ds(j * sp + i * pk, pk), ..)], sem[0]);
        }
    }
    for i in 0..live {
        for j in 0..k {
            let first = (idx_s[(i, j)].max(0).min(n - 1) >> (pk - 1)) << (pk - 1);
            dma_wait(src[(ds(first, pk), ..)], buf[(ds(j * sp + i * pk, pk), ..)], sem[0]);
        }
    }
    let p = idx[..];
    let slot = iota([tm, k], 1);
    let mut acc = zeros([tm, d], f32);
    for j in 0..k {
        let rows_j = if pk == 1 {
            buf[(ds(j * sp, tm), ..)].cast(f32)
        } else {
            // The slot's pairs in f32, then each row's half of its pair by a one-row copy.
            wide[..] = buf[(ds(j * sp, pk * tm), ..)].cast(f32);
            for i in 0..live {
                let half = idx_s[(i, j)].max(0).min(n - 1) & 1;
                dma_start(wide[(ds(i * 2 + half, 1), ..)], picked[(ds(i, 1), ..)], sem[2]);
            }
            for i in 0..live {
                let half = idx_s[(i, j)].max(0).min(n - 1) & 1;
                dma_wait(wide[(ds(i * 2 + half, 1), ..)], picked[(ds(i, 1), ..)], sem[2]);
            }
            picked[..]
        };
        let r = select(slot == j, p, 0).sum(1);
        let row = select((r >= 0) & (r < n), rows_j, 0.0);
        let term = if weighted { select(slot == j, weights[..].cast(f32), 0.0).sum(1) * row } else { row };
        // The first term as it is (a copy keeps -0.0), the others added.
        acc = if j == 0 { term } else { acc + term };
    }
    out[..] = acc.cast(out.dtype);
}

/// The inverse of the routing, `src[pos[t, j]] = t` (`src [rows, 1]`, the source token of
/// each sorted row; -1 where no valid pair lands): the gather index of `permute`. One
/// 4-byte DMA per (token, slot) from a VMEM column of token ids into HBM, after the first
/// step has filled `src` with -1. The grid is `arbitrary`: the fill precedes every write.
#[tpu_kernel(
    grid = [t.div_ceil(bt)],
    semantics = [arbitrary],
    pos = block([bt, k], |i| [i, 0]),
    tokens = scratch([bt, 1], i32),
    fill = scratch([fr, 1], i32),
    pos_s = scratch_smem([bt, k], i32),
    sem = semaphores(2),
)]
#[rustfmt::skip]
pub fn invert_positions_kernel(pos: In<t, k>, src: AnyOut<rows, 1>, tokens: Scratch, fill: Scratch, pos_s: Scratch, sem: Scratch, bt: usize, fr: usize) {
    if program_id(0) == 0 {
        // Whole `fr`-row copies, then the rest in a multiple of 8 rows and at most 8 more
        // (the DMA row granularity).
        fill[..] = full([fr, 1], i32, -1);
        let whole = rows / fr * fr;
        let eights = rows % fr / 8 * 8;
        let last = rows % fr % 8;
        if fr == rows {
            dma_start(fill, src, sem[0]);
        } else {
            for c in 0..rows / fr {
                dma_start(fill, src[(ds(c * fr, fr), ..)], sem[0]);
            }
        }
        if eights > 0 {
            dma_start(fill[(0..eights, ..)], src[(whole..whole + eights, ..)], sem[0]);
        }
        if last > 0 {
            dma_start(fill[(0..last, ..)], src[(rows - last..rows, ..)], sem[0]);
        }
        if fr == rows {
            dma_wait(fill, src, sem[0]);
        } else {
            for c in 0..rows / fr {
                dma_wait(fill, src[(ds(c * fr, fr), ..)], sem[0]);
            }
        }
        if eights > 0 {
            dma_wait(fill[(0..eights, ..)], src[(whole..whole + eights, ..)], sem[0]);
        }
        if last > 0 {
            dma_wait(fill[(0..last, ..)], src[(rows - last..rows, ..)], sem[0]);
        }
    }
    dma_start(pos, pos_s, sem[1]);
    dma_wait(pos, pos_s, sem[1]);
    tokens[..] = iota([bt, 1], 0) + program_id(0) * bt;
    let live = (t - program_id(0) * bt).min(bt);
    for i in 0..live {
        for j in 0..k {
            let r = pos_s[(i, j)];
            if (r >= 0) & (r < rows) {
                dma_start(tokens[(ds(i, 1), ..)], src[(ds(r, 1), ..)], sem[0]);
            }
        }
    }
    for i in 0..live {
        for j in 0..k {
            let r = pos_s[(i, j)];
            if (r >= 0) & (r < rows) {
                dma_wait(tokens[(ds(i, 1), ..)], src[(ds(r, 1), ..)], sem[0]);
            }
        }
    }
}

/// Rows of `-1` [`invert_positions_kernel`] writes per fill DMA (all of `src` when fewer).
const FILL: usize = 1024;

/// The routing of `expert_ids` (`[t, k]`) computed on the device, so no call reads the ids
/// back: `pos [t, k]`, each (token, slot) pair's row in the stable expert-sorted order (the
/// host's [`plan`]), and `group_sizes [1, e]`, the rows per expert.
///
/// Two passes (the grid's first axis) over token blocks of `bt`: the first counts each
/// expert's pairs, the second turns the counts into offsets (an exclusive prefix sum over
/// the experts) and gives pair `(t, j)` of expert `x` the row `offset[x] + earlier[x] +
/// (pairs of x in this block before it)`, where `earlier` counts the blocks before and the
/// in-block count is a prefix sum of the `[bt, e]` one-hot counts down the tokens. Work is
/// `t * k * e` (linear in tokens; one-hot over experts, no sort).
///
/// An id outside `0..e` belongs to no expert: its pair gets row -1, which no kernel
/// matches (the CPU path refuses such ids first; a device call cannot without a read).
#[tpu_kernel(
    grid = [2, t.div_ceil(bt)],
    semantics = [arbitrary, arbitrary],
    expert_ids = block([bt, k], |p, i| [i, 0]),
    pos = block([bt, k], |p, i| [i * p, 0]),
    group_sizes = block([1, e], |p, i| [0, 0]),
    (totals, offsets, earlier) = scratch([1, e], i32),
)]
pub fn routing_metadata_kernel(expert_ids: In<t, k>, pos: Out<t, k>, group_sizes: Out<1, e>, totals: Scratch, offsets: Scratch, earlier: Scratch, bt: usize) {
    let phase = program_id(0);
    let tok0 = program_id(1) * bt;
    let live = iota([bt, 1], 0) + tok0 < t;
    let ids = expert_ids[..];
    let slot = iota([bt, k], 1);
    let expert = iota([bt, e], 1);
    // counts[t, x]: slots of token t routed to expert x (rows past T count nothing).
    let mut counts = zeros([bt, e], i32);
    for j in 0..k {
        let id = select(live, select(slot == j, ids, 0).sum(1), -1);
        counts = counts + select(expert == id, 1, 0);
    }
    if phase == 0 {
        if program_id(1) == 0 {
            totals[..] = zeros([1, e], i32);
        }
        totals[..] = totals[..] + counts.sum(0);
    } else {
        if program_id(1) == 0 {
            let all = totals[..];
            offsets[..] = all.cumsum(1) - all;
            earlier[..] = zeros([1, e], i32);
            group_sizes[..] = all;
        }
        let before = counts.cumsum(0) - counts + offsets[..] + earlier[..];
        let mut seen = zeros([bt, e], i32);
        let mut rows = zeros([bt, k], i32);
        for j in 0..k {
            let id = select(live, select(slot == j, ids, 0).sum(1), -1);
            let mine = expert == id;
            // One lane sum: a pair of no expert sums nothing, so its row is -1.
            let row = select(mine, before + seen + 1, 0).sum(1) - 1;
            rows = select(slot == j, row, rows);
            seen = seen + select(mine, 1, 0);
        }
        pos[..] = rows;
        earlier[..] = earlier[..] + counts.sum(0);
    }
}

// ---- block rules and builders -------------------------------------------------------------

/// A tile of at most `max` (a multiple of every tiling) over `n`: all of `n` when it fits,
/// else `max` with a partial edge block.
fn tile(n: usize, max: usize) -> usize {
    n.min(max)
}

fn rank2(op: &str, operand: &str, t: &Type) -> Result<(usize, usize), KernelError> {
    match t.shape[..] {
        [a, b] if a > 0 && b > 0 => Ok((a, b)),
        _ => Err(KernelError::new(op, format!("operand `{operand}`"), "operand-shape", format!("shape {:?} is not a non-empty rank-2 array", t.shape), "pass a [rows, cols] array")),
    }
}

fn float_operand(op: &str, operand: &str, t: &Type) -> Result<(), KernelError> {
    if matches!(t.dtype, DType::F32 | DType::BF16) {
        return Ok(());
    }
    Err(KernelError::new(op, format!("operand `{operand}`"), "operand-dtype", format!("{operand} is {}", t.dtype), "pass f32 or bf16 data"))
}

fn int_operand(op: &str, operand: &str, t: &Type) -> Result<(), KernelError> {
    if t.dtype == DType::I32 {
        return Ok(());
    }
    Err(KernelError::new(op, format!("operand `{operand}`"), "operand-dtype", format!("{operand} is {}", t.dtype), "pass int32 indices"))
}

/// `router_topk` with blocks of [`ROUTER_ROWS`] rows (all of `T` when smaller); the rule
/// is the same on every generation (the blocks are tiny next to VMEM).
/// Outputs: weights `[T, k]` in the logits' dtype, expert ids `[T, k]` int32.
pub fn router_topk(logits: &Type, k: usize, gate: Gate, normalize: bool, _target: &Target) -> Result<Kernel, KernelError> {
    let (t, e) = rank2("router_topk", "logits", logits)?;
    float_operand("router_topk", "logits", logits)?;
    if k == 0 || k > MAX_TOP_K.min(e) {
        return Err(KernelError::new(
            "router_topk",
            "parameter `k`",
            "top-k",
            format!("k = {k} with {e} experts"),
            format!("use 1 <= k <= {} (at most {MAX_TOP_K} and at most the number of experts)", MAX_TOP_K.min(e)),
        ));
    }
    router_topk_kernel(logits.clone(), Type::vector(logits.dtype, &[t, k]), Type::vector(DType::I32, &[t, k]), tile(t, ROUTER_ROWS), gate == Gate::Sigmoid, normalize)
}

/// Rows a DMA of [`gather_rows_kernel`] moves: 2 for bf16 (packed row pairs), 1 for f32.
fn packed_rows(dtype: DType) -> usize {
    32 / dtype.bits()
}

/// Output rows per step of [`gather_rows_kernel`]: its slot buffer `[k * pk * tm, d]` and f32
/// staging within a quarter of the target's default scoped VMEM, a multiple of 16 from 16 to 256 (all the
/// rows when fewer).
fn gather_tile(rows: usize, k: usize, d: usize, dtype: DType, target: &Target) -> usize {
    let pk = packed_rows(dtype);
    let per_row = k * pk * target.padded_bytes(dtype, &[1, d]) + (pk + 1) * target.padded_bytes(DType::F32, &[1, d]);
    let tm = (target.default_scoped_vmem_bytes / 4 / per_row / 16 * 16).clamp(16, 256);
    if rows <= tm { rows } else { tm }
}

/// [`gather_rows_kernel`] for indices `idx [rows, k]` into `src [n, d]` (f32 or bf16; a bf16
/// `src` has an even `n`: the plan pads it), weighted by `weights [rows, k]` when given.
pub fn gather_rows(op: &str, idx: &Type, weights: Option<&Type>, src: &Type, target: &Target) -> Result<Kernel, KernelError> {
    let (rows, k) = rank2(op, "idx", idx)?;
    let (n, d) = rank2(op, "src", src)?;
    float_operand(op, "src", src)?;
    let pk = packed_rows(src.dtype);
    if n % pk != 0 {
        return Err(KernelError::new(op, "plan", "plan-consistency", format!("a bf16 gather source of {n} rows (odd)"), "report this as a Tessera bug (the plan pads it)"));
    }
    let unit = Type::vector(DType::F32, &[1, 1]);
    let tm = gather_tile(rows, k, d, src.dtype, target);
    // Each slot's rows start at a multiple of 16 (a bf16 tile), so dynamic slot offsets load aligned.
    let sp = (pk * tm).next_multiple_of(16);
    let kernel = gather_rows_kernel(idx.clone(), weights.unwrap_or(&unit).clone(), src.clone(), Type::vector(src.dtype, &[rows, d]), tm, pk, sp, weights.is_some())?;
    Ok(crate::blocks::fit_vmem_limit(kernel, target))
}

/// [`invert_positions_kernel`] for positions `[t, k]`: `src [t * k, 1]` int32.
pub fn invert_positions(t: usize, k: usize) -> Result<Kernel, KernelError> {
    let pos = Type::vector(DType::I32, &[t, k]);
    invert_positions_kernel(pos, Type::vector(DType::I32, &[t * k, 1]), t.min(ROUTER_ROWS), (t * k).min(FILL))
}

/// Token rows per block of [`routing_metadata_kernel`]: each `[bt, e]` i32 temporary near
/// 256 KiB of VMEM, a multiple of 8, all of `t` when that is no more.
fn routing_block(t: usize, experts: usize) -> usize {
    let lanes = experts.div_ceil(128) * 128;
    let bt = ((64 << 10) / lanes / 8 * 8).clamp(8, ROUTER_ROWS);
    if t <= bt { t } else { bt }
}

/// The device routing of `[T, k]` int32 expert ids over `experts` experts: outputs
/// `pos [T, k]` and `group_sizes [1, experts]` (see [`routing_metadata_kernel`]).
pub fn routing_metadata(ids: &Type, experts: usize, target: &Target) -> Result<Kernel, KernelError> {
    let (t, _) = rank2("routing_metadata", "expert_ids", ids)?;
    int_operand("routing_metadata", "expert_ids", ids)?;
    let kernel = routing_metadata_kernel(ids.clone(), ids.clone(), Type::vector(DType::I32, &[1, experts]), routing_block(t, experts))?;
    Ok(crate::blocks::fit_vmem_limit(kernel, target))
}

// ---- host side ----------------------------------------------------------------------------

/// Where each routed (token, slot) pair goes in expert-sorted order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    pub tokens: usize,
    pub k: usize,
    /// Sorted row -> source token, `T*k` entries.
    pub src: Vec<i32>,
    /// `[T, k]` row-major: (token, slot) -> sorted row.
    pub pos: Vec<i32>,
    /// Rows per expert, `E` entries summing to `T*k` (the `gmm` group sizes).
    pub group_sizes: Vec<i32>,
}

/// Sorts the routing on the host: a stable sort of the `T*k` (token, slot) pairs by
/// expert id. `ids` is the `[T, k]` int32 output of [`route`].
pub fn plan(ids: &Array, num_experts: usize) -> Result<Routing, KernelError> {
    let (t, k, src, pos) = sorted("plan", ids, num_experts)?;
    Ok(Routing { tokens: t, k, src, pos, group_sizes: group_sizes("plan", ids, num_experts)? })
}

/// The checked ids of `[T, k]` `ids` over `num_experts` experts: `(T, k, data)`.
fn checked_ids<'a>(op: &str, ids: &'a Array, num_experts: usize) -> Result<(usize, usize, &'a [i32]), KernelError> {
    let err = |rule, message: String, help: &str| KernelError::new(op, "input `expert_ids`", rule, message, help);
    let (Some(data), &[t, k]) = (ids.as_i32(), &ids.shape[..]) else {
        return Err(err("operand-shape", format!("expert_ids is {}{:?}", ids.dtype, ids.shape), "pass the [T, k] int32 expert ids from router_topk"));
    };
    if let Some((n, &bad)) = data.iter().enumerate().find(|(_, &e)| e < 0 || e as usize >= num_experts) {
        return Err(err("expert-id-range", format!("token {} slot {} routes to expert {bad}, but there are {num_experts} experts", n / k, n % k), "pass ids in 0..num_experts"));
    }
    Ok((t, k, data))
}

/// `(T, k, src, pos)` of a routing: memory in `T*k` only, whatever the number of experts
/// (`combine` and `permute_bwd` need no group sizes).
fn sorted(op: &str, ids: &Array, num_experts: usize) -> Result<(usize, usize, Vec<i32>, Vec<i32>), KernelError> {
    let (t, k, data) = checked_ids(op, ids, num_experts)?;
    let mut order: Vec<usize> = (0..data.len()).collect();
    order.sort_by_key(|&n| data[n]); // stable: ties keep (token, slot) order
    let (mut src, mut pos) = (vec![0i32; data.len()], vec![0i32; data.len()]);
    for (row, &n) in order.iter().enumerate() {
        src[row] = (n / k) as i32;
        pos[n] = row as i32;
    }
    Ok((t, k, src, pos))
}

/// Rows per expert (`num_experts` entries), allocated fallibly: the count is a static the
/// caller chooses, up to 2^31 - 1.
fn group_sizes(op: &str, ids: &Array, num_experts: usize) -> Result<Vec<i32>, KernelError> {
    let (_, _, data) = checked_ids(op, ids, num_experts)?;
    let mut sizes = crate::plan::try_vec(op, "result `group_sizes`", num_experts, DType::I32)?;
    sizes.resize(num_experts, 0);
    for &e in data {
        sizes[e as usize] += 1;
    }
    Ok(sizes)
}

/// Gate + top-k: `(weights [T, k], expert_ids [T, k])`.
pub fn route(exec: &dyn Executor, logits: &Array, k: usize, gate: Gate, normalize: bool, target: &Target) -> Result<(Array, Array), KernelError> {
    let gate = if gate == Gate::Sigmoid { "sigmoid" } else { "softmax" };
    let mut out = crate::run(exec, "router_topk", &[logits], &format!("k={k}, gate=\"{gate}\", normalize={}", if normalize { "True" } else { "False" }), target)?.into_iter();
    out.next().zip(out.next()).ok_or_else(|| KernelError::new("router_topk", "outputs", "output-count", "expected 2 results", "report this as a library bug"))
}

/// `x [T, D]` rows in expert-sorted order, `[T*k, D]`, with the rows per expert.
pub fn permute(exec: &dyn Executor, x: &Array, expert_ids: &Array, num_experts: usize, target: &Target) -> Result<(Array, Array), KernelError> {
    let mut out = crate::run(exec, "permute", &[x, expert_ids], &format!("num_experts={num_experts}"), target)?.into_iter();
    out.next().zip(out.next()).ok_or_else(|| KernelError::new("permute", "outputs", "output-count", "expected 2 results", "report this as a library bug"))
}

/// `out[t] = sum_j weights[t, j] * y[row of (t, j)]`, `[T, D]` in `y`'s dtype.
pub fn combine(exec: &dyn Executor, y: &Array, weights: &Array, expert_ids: &Array, num_experts: usize, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "combine", &[y, weights, expert_ids], &format!("num_experts={num_experts}"), target)
}

// ---- ops ------------------------------------------------------------------------------------

fn plan_router_topk(c: &Call) -> Result<Plan, KernelError> {
    let logits = c.tensor("logits")?.clone();
    let gate = match c.statics.str("gate") {
        "softmax" => Gate::Softmax,
        "sigmoid" => Gate::Sigmoid,
        other => return Err(c.err("argument `gate`", "option-value", format!("gate = {other:?}"), "use \"softmax\" or \"sigmoid\"")),
    };
    let kernel = router_topk(&logits, c.usize("k")?, gate, c.statics.bool("normalize"), c.target)?;
    Ok(single(c, kernel, vec![c.input("logits", logits)?], &[]))
}

/// `(t, k)` of the `[t, k]` int32 expert ids of a routing call (shape and dtype are the
/// op's contract, checked); empty routings are refused.
fn expert_ids(c: &Call) -> Result<(usize, usize), KernelError> {
    let ids = c.tensor("expert_ids")?;
    match ids.shape[..] {
        [t, k] if t > 0 && k > 0 => Ok((t, k)),
        _ => Err(c.err("input `expert_ids`", "operand-shape", format!("expert_ids is {ids}"), "pass the [tokens, k] integer expert ids from router_topk, at least one of each")),
    }
}

/// `num_experts`, at most [`MAX_EXPERTS`]: the device routing keeps `[bt, e]` one-hot
/// counts in VMEM.
fn num_experts(c: &Call) -> Result<usize, KernelError> {
    let e = c.usize("num_experts")?;
    if e == 0 || e > MAX_EXPERTS {
        return Err(c.err("argument `num_experts`", "option-value", format!("num_experts = {e}"), format!("pass between 1 and {MAX_EXPERTS} experts (the routing kernel counts every expert per block of tokens in VMEM)")));
    }
    Ok(e)
}

/// The routing launch (launch 0 of every routing plan): positions and group sizes from
/// the expert ids on the device.
fn routing_launch(c: &Call) -> Result<Launch, KernelError> {
    let ids = c.tensor("expert_ids")?.clone();
    let kernel = routing_metadata(&ids, num_experts(c)?, c.target)?;
    Ok(Launch::new(kernel, vec![c.input("expert_ids", ids)?]))
}

/// The plan's check of the expert ids where values are at hand (CPU tensors): the device
/// path routes them without reading them.
fn ids_check(c: &Call, plan: Plan) -> Result<Plan, KernelError> {
    let (op, experts) = (c.op, num_experts(c)?);
    Ok(plan.with_check(&[c.index("expert_ids")?], Box::new(move |v| checked_ids(op, v[0], experts).map(|_| ()))))
}

/// Tensor input `name` as the source of a gather: as it is, or for an odd-rowed bf16
/// tensor padded with a zero row (a DMA moves bf16 rows in pairs).
fn gather_source(c: &Call, name: &str) -> Result<Operand, KernelError> {
    let t = c.tensor(name)?.clone();
    let (n, d) = (t.shape[0], t.shape[1]);
    if n % packed_rows(t.dtype) == 0 {
        return c.input(name, t);
    }
    let padded = n.next_multiple_of(packed_rows(t.dtype));
    Ok(Operand { source: Source::Input(c.index(name)?), layout: Layout::PadRows { rows: padded }, ty: Type::vector(t.dtype, &[padded, d]) })
}

/// The gather launch of a routing plan: rows of `src` (a tensor input) at `idx` (an operand),
/// weighted by `weights` or summed (a unit weight: host array 0, `[1, 1]`).
fn gather_launch(c: &Call, idx: Operand, weights: Option<Operand>, src: &str) -> Result<Launch, KernelError> {
    let src = gather_source(c, src)?;
    let kernel = gather_rows(c.op, &idx.ty, weights.as_ref().map(|w| &w.ty), &src.ty, c.target)?;
    let weights = weights.unwrap_or_else(|| host(0, Type::vector(DType::F32, &[1, 1])));
    Ok(Launch::new(kernel, vec![idx, weights, src]))
}

fn unit_weight() -> Vec<Array> {
    vec![Array::from_f32(&[1, 1], vec![1.0])]
}

/// Routing, its inverse (`src`: the token of each sorted row), and the gather of `x`'s rows.
fn plan_permute(c: &Call) -> Result<Plan, KernelError> {
    let (t, k) = expert_ids(c)?;
    let experts = num_experts(c)?;
    let invert = Launch::new(invert_positions(t, k)?, vec![result(0, 0, Type::vector(DType::I32, &[t, k]))]);
    let gather = gather_launch(c, result(1, 0, Type::vector(DType::I32, &[t * k, 1])), None, "x")?;
    let results = vec![result(2, 0, gather.outputs[0].clone()), result(0, 1, Type::vector(DType::I32, &[experts]))];
    ids_check(c, Plan::new(c.op, c.target, vec![routing_launch(c)?, invert, gather], results).with_host(unit_weight()))
}

/// Routing and the weighted gather of each token's `k` rows of `y`.
fn plan_combine(c: &Call) -> Result<Plan, KernelError> {
    let weights = c.tensor("weights")?.clone();
    let (t, k) = expert_ids(c)?;
    let gather = gather_launch(c, result(0, 0, Type::vector(DType::I32, &[t, k])), Some(c.input("weights", weights)?), "y")?;
    let results = vec![result(1, 0, gather.outputs[0].clone())];
    ids_check(c, Plan::new(c.op, c.target, vec![routing_launch(c)?, gather], results))
}

/// Each token's `k` rows of `dout` summed back: the gather unweighted.
fn plan_permute_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (t, k) = expert_ids(c)?;
    let gather = gather_launch(c, result(0, 0, Type::vector(DType::I32, &[t, k])), None, "dout")?;
    let results = vec![result(1, 0, gather.outputs[0].clone())];
    ids_check(c, Plan::new(c.op, c.target, vec![routing_launch(c)?, gather], results).with_host(unit_weight()))
}

/// Random valid routing for [`random_expert_ids`] shapes: `x`, then the ids.
fn permute_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    vec![harness::random_array(dtype, &shapes[0], rng), ids_input(shapes, 1, s, rng)]
}

fn combine_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let y = harness::random_array(dtype, &shapes[0], rng);
    let w = harness::random_array(dtype, &shapes[1], rng);
    vec![y, w, ids_input(shapes, 2, s, rng)]
}

fn ids_of(a: &Array) -> Vec<i64> {
    a.to_f64_vec().into_iter().map(|v| v as i64).collect()
}

fn ref_router_topk(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let k = s.i64("k").unwrap_or(2) as usize;
    let (w, ids) = reference::router_topk(&a[0].to_f64_vec(), a[0].shape[1], k, s.str("gate") == "sigmoid", s.bool("normalize"));
    vec![w, ids.into_iter().map(|i| i as f64).collect()]
}

fn ref_permute(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let ids = ids_of(&a[1]);
    let experts = s.i64("num_experts").unwrap_or(0) as usize;
    let mut sizes = vec![0.0; experts];
    for &e in &ids {
        sizes[e as usize] += 1.0;
    }
    vec![reference::permute(&a[0].to_f64_vec(), a[0].shape[1], &ids, a[1].shape[1]), sizes]
}

fn ref_combine(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    vec![reference::combine(&a[0].to_f64_vec(), a[0].shape[1], &a[1].to_f64_vec(), &ids_of(&a[2]), a[2].shape[1])]
}

/// `dx[t] = sum_j dout[row of (t, j)]`: combine with unit weights.
fn ref_permute_bwd(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let ids = ids_of(&a[1]);
    vec![reference::combine(&a[0].to_f64_vec(), a[0].shape[1], &vec![1.0; ids.len()], &ids, a[1].shape[1])]
}

fn permute_bwd_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    vec![harness::random_array(dtype, &shapes[0], rng), ids_input(shapes, 1, s, rng)]
}

const IDS: Input = Input { name: "expert_ids", dims: "[t, k]", kind: Kind::Int32 };

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "router_topk", doc: "MoE router: (weights [t, k], int32 expert_ids [t, k]); softmax or sigmoid gate over the experts, top-k (ties: lowest expert), optionally renormalised; f32 math", schema: "(Tensor logits, int k=2, str gate=\"softmax\", bool normalize=True) -> (Tensor, Tensor)", plan: plan_router_topk, reference: Some(ref_router_topk),
        inputs: &[Input { name: "logits", dims: "[t, e]", kind: Kind::Float }], outputs: &[Output { name: "weights", shape: "[logits.0, k]", dtype: "logits" }, Output { name: "expert_ids", shape: "[logits.0, k]", dtype: "i32" }],
        backward: Some(Backward { op: COMPOSITE, args: "", grads: &["logits"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[512, 8]] }, Case { name: "alt", statics: "k=4", shapes: &[&[1000, 60]] }, Case { name: "sigmoid", statics: "gate=\"sigmoid\"", shapes: &[&[512, 8]] }], ..Op::EMPTY
    },
    Op {
        name: "permute", doc: "MoE dispatch: (x rows in expert-sorted order [t*k, d] (stable by expert), int32 group_sizes [num_experts]); a row gather by DMA (one copy per row), O(t*k*d)", schema: "(Tensor x, Tensor expert_ids, int num_experts) -> (Tensor, Tensor)", plan: plan_permute, reference: Some(ref_permute),
        inputs: &[Input { name: "x", dims: "[t, d]", kind: Kind::Float }, IDS], outputs: &[Output { name: "xs", shape: "[expert_ids.0 * expert_ids.1, x.1]", dtype: "x" }, Output { name: "group_sizes", shape: "[num_experts]", dtype: "i32" }],
        backward: Some(Backward { op: "permute_bwd", args: "d_xs, expert_ids, num_experts", grads: &["x"] }),
        cases: &[Case { name: "default", statics: "num_experts=7", shapes: &[&[512, 512], &[512, 2]] }, Case { name: "alt", statics: "num_experts=11", shapes: &[&[1000, 384], &[1000, 4]] }], random: Some(permute_inputs), ..Op::EMPTY
    },
    Op {
        name: "permute_bwd", doc: "gradient of permute: dx[t] = sum over t's k rows of dout (combine with unit weights)", schema: "(Tensor dout, Tensor expert_ids, int num_experts) -> Tensor", plan: plan_permute_bwd, reference: Some(ref_permute_bwd),
        inputs: &[Input { name: "dout", dims: "[t*k, d]", kind: Kind::Float }, IDS], outputs: &[Output { name: "dx", shape: "[expert_ids.0, dout.1]", dtype: "dout" }],
        cases: &[Case { name: "default", statics: "num_experts=7", shapes: &[&[1024, 512], &[512, 2]] }, Case { name: "alt", statics: "num_experts=11", shapes: &[&[4000, 384], &[1000, 4]] }], random: Some(permute_bwd_inputs), ..Op::EMPTY
    },
    Op {
        name: "combine", doc: "MoE combine: out[t] = sum_j weights[t, j] * y[row of (t, j)] from expert-sorted rows; a weighted gather of each token's k rows by DMA, O(t*k*d)", schema: "(Tensor y, Tensor weights, Tensor expert_ids, int num_experts) -> Tensor", plan: plan_combine, reference: Some(ref_combine),
        inputs: &[Input { name: "y", dims: "[t*k, d]", kind: Kind::Float }, Input { name: "weights", dims: "[t, k]", kind: Kind::Float }, IDS], outputs: &[Output { name: "out", shape: "[expert_ids.0, y.1]", dtype: "y" }],
        backward: Some(Backward { op: COMPOSITE, args: "", grads: &["y", "weights"] }),
        cases: &[Case { name: "default", statics: "num_experts=7", shapes: &[&[1024, 512], &[512, 2], &[512, 2]] }, Case { name: "alt", statics: "num_experts=11", shapes: &[&[4000, 384], &[1000, 4], &[1000, 4]] }], random: Some(combine_inputs), ..Op::EMPTY
    },
];

// ---- random inputs --------------------------------------------------------------------------

/// The number of experts random routings draw from for `[T, k]` ids: `2k + 3` (odd, not
/// a power of two). Expert 1 is never chosen, so one group is always empty.
pub fn random_routing_experts(k: usize) -> usize {
    2 * k + 3
}

/// Random valid routing: each token picks `k` distinct experts of
/// [`random_routing_experts`], never expert 1.
pub fn random_expert_ids(t: usize, k: usize, rng: &mut StdRng) -> Array {
    random_expert_ids_over(t, k, random_routing_experts(k), rng)
}

/// Random valid routing over `experts` experts (at least `k + 1`): each token picks `k`
/// distinct experts, never expert 1 (so one group is always empty).
pub fn random_expert_ids_over(t: usize, k: usize, experts: usize, rng: &mut StdRng) -> Array {
    let experts = experts.max(k + 1).min(i32::MAX as usize);
    let mut ids = Vec::with_capacity(t * k);
    if experts > 4 * k + 4096 {
        // Many experts: draw and redraw duplicates (a pool of every id would be as large
        // as the expert count, up to 2^31).
        for _ in 0..t {
            let start = ids.len();
            while ids.len() < start + k {
                let e = rng.gen_range(0..experts as i32);
                if e != 1 && !ids[start..].contains(&e) {
                    ids.push(e);
                }
            }
        }
        return Array::from_i32(&[t, k], ids);
    }
    let pool: Vec<i32> = (0..experts as i32).filter(|&e| e != 1).collect();
    for _ in 0..t {
        let mut p = pool.clone();
        for j in 0..k {
            let pick = rng.gen_range(j..p.len());
            p.swap(j, pick);
        }
        ids.extend_from_slice(&p[..k]);
    }
    Array::from_i32(&[t, k], ids)
}

/// Random ids of shape `shapes[at]` over `num_experts` (or [`random_routing_experts`]).
fn ids_input(shapes: &[Vec<usize>], at: usize, s: &Statics, rng: &mut StdRng) -> Array {
    let shape = shapes.get(at).map(|s| s.as_slice()).unwrap_or(&[]);
    let (t, k) = (shape.first().copied().unwrap_or(1), shape.get(1).copied().unwrap_or(1));
    let experts = s.i64("num_experts").map_or(random_routing_experts(k), |e| e.max(0) as usize);
    if (1..=k).contains(&experts) {
        // Fewer experts than k + 1 (k distinct ones and the always-empty expert 1): ids
        // with repeats, still below num_experts, so the call stays valid.
        return Array::from_i32(&[t, k], (0..t * k).map(|_| rng.gen_range(0..experts as i32)).collect());
    }
    random_expert_ids_over(t, k, experts, rng)
}

/// Independent references: plain f64 loops (explicit softmax, sort-based top-k and
/// routing order, gather, weighted sum) sharing no code with the kernels or [`plan`].
pub mod reference {
    /// Top-k of each length-`e` row of `logits`: `(weights, ids)`, both `[T, k]`
    /// row-major. Order: NaN first, then larger logit first, ties to the lower index.
    pub fn router_topk(logits: &[f64], e: usize, k: usize, sigmoid: bool, normalize: bool) -> (Vec<f64>, Vec<usize>) {
        let mut weights = Vec::new();
        let mut ids = Vec::new();
        for row in logits.chunks(e) {
            let scores: Vec<f64> = if sigmoid {
                row.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect()
            } else {
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
                row.iter().map(|v| (v - max).exp() / sum).collect()
            };
            // NaN first (torch.topk ranks it above every number), then larger logits;
            // ties (NaN with NaN, -0 with +0) to the lower index.
            let rank = |a: usize, b: usize| match (row[a].is_nan(), row[b].is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (x, y) if x != y => y.cmp(&x),
                _ => row[b].partial_cmp(&row[a]).unwrap_or(std::cmp::Ordering::Equal),
            };
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| rank(a, b).then(a.cmp(&b)));
            let picked = &order[..k];
            let total: f64 = picked.iter().map(|&i| scores[i]).sum();
            for &i in picked {
                weights.push(if normalize { scores[i] / total } else { scores[i] });
                ids.push(i);
            }
        }
        (weights, ids)
    }

    /// For `[T, k]` expert ids: `order[r]` = the flattened (token, slot) index `t*k + j`
    /// of sorted row `r` (stable sort by expert).
    pub fn sorted_order(ids: &[i64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&n| ids[n]); // `sort_by_key` is stable
        order
    }

    /// `x [T, d]` rows gathered into expert-sorted order: `[T*k, d]`.
    pub fn permute(x: &[f64], d: usize, ids: &[i64], k: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(ids.len() * d);
        for n in sorted_order(ids) {
            let t = n / k;
            out.extend_from_slice(&x[t * d..(t + 1) * d]);
        }
        out
    }

    /// `out[t] = sum_j w[t, j] * y[row of (t, j)]`, `y [T*k, d]` in sorted order.
    pub fn combine(y: &[f64], d: usize, w: &[f64], ids: &[i64], k: usize) -> Vec<f64> {
        let tokens = ids.len() / k;
        let mut out = vec![0.0; tokens * d];
        for (r, n) in sorted_order(ids).into_iter().enumerate() {
            let t = n / k;
            for c in 0..d {
                out[t * d + c] += w[n] * y[r * d + c];
            }
        }
        out
    }
}
