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
//! # Gather and scatter as one-hot matmuls — and what that costs
//!
//! The IR has no DMA gather yet, so `permute` and `combine` use the dispatch/combine
//! einsum formulation of GShard-style TPU MoE code: `permute` computes
//! `out_tile = hit^T @ x_tile` accumulated over token tiles, `hit[t, r] = sum_j (pos[t, j]
//! == r)` (k compares), and `combine`
//! `out_tile = W_tile @ y_tile` with `W[t, i] = sum_j w[t, j] * (pos[t, j] == i)`, both on
//! the MXU with f32 accumulation. A one-hot product is exact (one term is `1 * x`, the
//! rest `0 * x`); `combine` rounds `W` to `y`'s dtype before the dot, like the einsum does.
//!
//! **NaN and inf.** `0 * inf` and `0 * NaN` are NaN, so a nonfinite `x` (or `y`) value
//! would reach every row of its tile. The kernels multiply finite stand-ins instead (0,
//! or `y`'s sign in `combine`, so an inf weight still meets the right sign) and carry
//! each nonfinite value's class through a second, bf16 product with the same one-hot
//! (`combine`: with a code of each weight's sign, so each (weight, value) pair lands on
//! its own power of a radix above `k`; exact in f32), then put back exactly what torch's
//! gather / weighted sum gives: the same inf, `w * inf` with the weight's sign, NaN for a
//! NaN, for `0 * inf` and for `inf - inf`. Nonfinite *weights* need nothing: they sit in
//! their own token's row of `W`. The second product is one bf16 MXU pass (twice the
//! flops of a bf16 call, +1/3 or less for f32) plus a few VPU selects per element; the
//! radix code is exact while fewer than 64 slots of one token meet infs in one column.
//!
//! The price is **O(T * T*k * D)** flops (`2 * T * T*k * D`, twice that with the NaN
//! product) and re-reading all of `x` (resp. `y`) once per row tile, where a gather moves
//! `T*k*D` elements. That is fine for decode and small prefill batches (T = 512, k = 2,
//! D = 4096: 4.3 GFLOP + 4.3 for the NaN product, ~44 us at v5e bf16 peak) and quadratic
//! beyond (T = 8192, k = 8, D = 4096: 4.4 TFLOP, ~22 ms, twice that with the NaN product,
//! where a gather moves 0.5 GB in under 1 ms). A DMA gather (row indices by scalar
//! prefetch, one async copy per row; it would also copy NaN and inf as they are) is the
//! scalable version and future work.
//!
//! # Ragged edges
//!
//! Grids are `ceil(n / block)` (Pallas partial edge blocks), so `T` need not be a
//! multiple of any tile. Rows past the end of an input block hold garbage (NaN in the
//! interpreter); since `0 * NaN = NaN`, the contraction operand's tail rows are zeroed
//! with an iota mask before the dot. Output rows past the end are dropped.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics, COMPOSITE};
use crate::plan::{host, result, single, Launch, Operand, Plan};

/// The largest `k` `router_topk` supports (each round is a full pass over the row).
pub const MAX_TOP_K: usize = 8;
/// The most experts a routing op takes: [`routing_metadata_kernel`]'s `[8, e]` i32 temporaries
/// (about ten live) stay within 32 MiB of VMEM.
pub const MAX_EXPERTS: usize = 1 << 16;
/// Rows per `router_topk` block: 256 rows of up to 128 experts is 128 KiB of f32 per
/// temporary, and `T = 512` still splits across two TensorCores.
const ROUTER_ROWS: usize = 256;
/// Row, token and D tiles of the one-hot matmuls: MXU-sized (a multiple of 128 and 256),
/// double-buffered windows plus the accumulator about 5.5 MiB in f32, under every
/// generation's default scoped VMEM.
const ONEHOT_TILE: usize = 512;

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

#[tpu_kernel(
    grid = [rows.div_ceil(tm), d.div_ceil(td), t.div_ceil(tt)],
    semantics = [parallel, parallel, arbitrary],
    pos = block([tt, k], |i, j, kk| [kk, 0]),
    x = block([tt, td], |i, j, kk| [kk, j]),
    out = block([tm, td], |i, j, kk| [i, j]),
    acc = scratch([tm, td], f32),
)]
pub fn permute_kernel(pos: In<t, k>, x: In<t, d>, out: Out<rows, d>, acc: Scratch, tm: usize, td: usize, tt: usize) {
    if program_id(2) == 0 {
        acc[..] = zeros([tm, td], f32);
    }
    let tok0 = program_id(2) * tt;
    // hit[t, r] = 1 where one of token t's slots lands on row r of this tile: k compares
    // against the positions (tokens down the sublanes), then out = hit^T @ x.
    let row = iota([tt, tm], 1) + program_id(0) * tm;
    let live = iota([tt, 1], 0) + tok0 < t;
    let p = pos[..];
    let slot = iota([tt, k], 1);
    let mut hit = zeros([tt, tm], f32);
    for j in 0..k {
        // Rows past T in the last token tile hold garbage positions: they match nothing.
        let pj = select(live, select(slot == j, p, 0).sum(1), -1);
        hit = hit + select(row == pj, 1.0, 0.0);
    }
    let mut xv = x[..].cast(f32);
    if !t.is_multiple_of(tt) {
        // The last token tile reaches past T: zero its garbage rows (0 * NaN = NaN).
        xv = select(iota([tt, td], 0) + tok0 < t, xv, 0.0);
    }
    // A nonfinite x would reach every row through `0 * inf`: gather it zeroed, and its
    // class (+inf 1, -inf -1, NaN 2) by a second one-hot product (exact: one term).
    let (finite_x, class) = nonfinite_split(xv);
    acc[..] += dot_tn(hit.cast(x.dtype), finite_x.cast(x.dtype));
    let gathered = dot_tn(hit.cast(bf16), class);
    let fix = select(gathered > 1.5, f32::NAN, select(gathered > 0.0, f32::INFINITY, f32::NEG_INFINITY));
    acc[..] = select(gathered == 0.0, acc[..], fix);
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

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

/// `(x with nonfinite values zeroed, their class: +inf 1, -inf -1, NaN 2, else 0)`, the
/// class in bf16 (exact) for a one-hot product.
#[tpu_fn]
fn nonfinite_split(x: Value) -> (Value, Value) {
    let finite = (x - x) == 0.0;
    let class = select(finite, 0.0, select(x > 0.0, 1.0, select(x < 0.0, -1.0, 2.0)));
    (select(finite, x, 0.0), class.cast(bf16))
}

#[tpu_kernel(
    grid = [t.div_ceil(tm), d.div_ceil(td), rows.div_ceil(ti)],
    semantics = [parallel, parallel, arbitrary],
    (weights, pos) = block([tm, k], |i, j, kk| [i, 0]),
    y = block([ti, td], |i, j, kk| [kk, j]),
    out = block([tm, td], |i, j, kk| [i, j]),
    acc = scratch([tm, td], f32),
)]
pub fn combine_kernel(weights: In<t, k>, pos: In<t, k>, y: In<rows, d>, out: Out<t, d>, acc: Scratch, tm: usize, td: usize, ti: usize) {
    if program_id(2) == 0 {
        acc[..] = zeros([tm, td], f32);
    }
    let row0 = program_id(2) * ti;
    let row = iota([tm, ti], 1) + row0;
    let w = weights[..].cast(f32);
    let p = pos[..];
    let slot = iota([tm, k], 1);
    let r = combine_radix(k);
    // W[t, i] = sum_j w[t, j] * (pos[t, j] == row0 + i): k compares, no gather. A[t, i]
    // codes the sign of that weight for the nonfinite-y product below: 1 (w > 0), r^2
    // (w < 0), r^4 (w 0 or NaN: any inf it meets makes NaN).
    let mut wt = zeros([tm, ti], f32);
    let mut at = zeros([tm, ti], f32);
    for j in 0..k {
        let pj = select(slot == j, p, 0).sum(1);
        let wj = select(slot == j, w, 0.0).sum(1);
        let aj = select(wj > 0.0, 1.0, select(wj < 0.0, r * r, r * r * r * r));
        let used = row == pj;
        wt = wt + select(used, wj.broadcast_to([tm, ti]), 0.0);
        at = at + select(used, aj.broadcast_to([tm, ti]), 0.0);
    }
    let mut yv = y[..].cast(f32);
    if !rows.is_multiple_of(ti) {
        // The last row tile reaches past T*k: zero its garbage rows (0 * NaN = NaN).
        yv = select(iota([ti, td], 0) + row0 < rows, yv, 0.0);
    }
    // A nonfinite y would reach every token through `0 * inf`. The weighted product takes
    // it as its sign (±1; NaN as 0), so an inf weight still meets the right sign, and a
    // second product gathers its class (+inf 1, -inf r, NaN r^4) times the weight's code:
    // each (weight, y) pair lands on its own power of r (+inf terms on r^0 and r^3, -inf on
    // r and r^2, NaN at r^4 and above), exact in f32 below r^4 <= 2^24.
    let finite = (yv - yv) == 0.0;
    let y_sign = select(yv > 0.0, 1.0, select(yv < 0.0, -1.0, 0.0));
    let y_class = select(finite, 0.0, select(yv > 0.0, 1.0, select(yv < 0.0, r, r * r * r * r)));
    acc[..] += dot(wt.cast(y.dtype), select(finite, yv, y_sign).cast(y.dtype));
    let code = dot(at.cast(bf16), y_class.cast(bf16));
    let nan_term = code >= r * r * r * r;
    let digits = select(nan_term, 0.0, code).cast(i32);
    let ri = r as i32;
    let plus = (digits & (((ri - 1) * ri * ri * ri) | (ri - 1))) != 0;
    let minus = (digits & (((ri - 1) * ri * ri) | ((ri - 1) * ri))) != 0;
    let fix = select(nan_term | (plus & minus), f32::NAN, select(plus, f32::INFINITY, f32::NEG_INFINITY));
    // IEEE addition keeps an inf that a nonfinite weight put in `acc` (inf + -inf = NaN).
    acc[..] = select(code == 0.0, acc[..], acc[..] + fix);
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

/// The radix of `combine_kernel`'s nonfinite code: a power of two above `k` (a digit
/// counts the slots of one kind), at most 64 so that four digits stay exact in f32.
fn combine_radix(k: usize) -> f32 {
    (k + 1).next_power_of_two().clamp(2, 64) as f32
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

/// `permute` (same blocks on every generation): `x [T, D]` into `T*k` sorted rows by the
/// positions `[T, k]` int32 ([`routing_metadata`]). Tiles of up to [`ONEHOT_TILE`] rows,
/// tokens and columns.
pub fn permute_for(x: &Type, k: usize, _target: &Target) -> Result<Kernel, KernelError> {
    let (t, d) = rank2("permute", "x", x)?;
    float_operand("permute", "x", x)?;
    if k == 0 {
        return Err(KernelError::new("permute", "input `expert_ids`", "operand-shape", "k = 0 slots per token", "pass [T, k] expert ids with k >= 1"));
    }
    let pos = Type::vector(DType::I32, &[t, k]);
    let rows = t * k;
    permute_kernel(pos, x.clone(), Type::vector(x.dtype, &[rows, d]), tile(rows, ONEHOT_TILE), tile(d, ONEHOT_TILE), tile(t, ONEHOT_TILE))
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

/// `combine` (same blocks on every generation): weights `[T, k]`, positions `[T, k]` int32, `y [T*k, D]`;
/// the output has `y`'s dtype. Tiles of up to [`ONEHOT_TILE`].
pub fn combine_for(weights: &Type, pos: &Type, y: &Type, _target: &Target) -> Result<Kernel, KernelError> {
    let (t, _) = rank2("combine", "weights", weights)?;
    let (rows, d) = rank2("combine", "y", y)?;
    float_operand("combine", "weights", weights)?;
    float_operand("combine", "y", y)?;
    int_operand("combine", "pos", pos)?;
    combine_kernel(weights.clone(), pos.clone(), y.clone(), Type::vector(y.dtype, &[t, d]), tile(t, ONEHOT_TILE), tile(d, ONEHOT_TILE), tile(rows, ONEHOT_TILE))
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

fn plan_permute(c: &Call) -> Result<Plan, KernelError> {
    let x = c.tensor("x")?.clone();
    let (t, k) = expert_ids(c)?;
    let experts = num_experts(c)?;
    let route = routing_launch(c)?;
    let launch = Launch::new(permute_for(&x, k, c.target)?, vec![result(0, 0, Type::vector(DType::I32, &[t, k])), c.input("x", x)?]);
    let results = vec![result(1, 0, launch.outputs[0].clone()), result(0, 1, Type::vector(DType::I32, &[experts]))];
    ids_check(c, Plan::new(c.op, c.target, vec![route, launch], results))
}

/// A combine launch of `y` rows (tensor `y_name`, `[t*k, d]` by the op's contract)
/// weighted by `weights` (an operand), positions from the routing launch.
fn combine_launch(c: &Call, y_name: &str, weights: Operand, t: usize, k: usize) -> Result<Launch, KernelError> {
    let y = c.tensor(y_name)?.clone();
    let pos = Type::vector(DType::I32, &[t, k]);
    let kernel = combine_for(&weights.ty, &pos, &y, c.target)?;
    Ok(Launch::new(kernel, vec![weights, result(0, 0, pos), c.input(y_name, y)?]))
}

fn plan_combine(c: &Call) -> Result<Plan, KernelError> {
    let weights = c.tensor("weights")?.clone();
    let (t, k) = expert_ids(c)?;
    let launches = vec![routing_launch(c)?, combine_launch(c, "y", c.input("weights", weights)?, t, k)?];
    let results = vec![result(1, 0, launches[1].outputs[0].clone())];
    ids_check(c, Plan::new(c.op, c.target, launches, results))
}

/// Each token's rows summed back: combine with unit weights (host array 0, built from the
/// types alone).
fn plan_permute_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (t, k) = expert_ids(c)?;
    let dtype = c.tensor("dout")?.dtype;
    let ones = Type::vector(dtype, &[t, k]);
    let launches = vec![routing_launch(c)?, combine_launch(c, "dout", host(0, ones), t, k)?];
    let results = vec![result(1, 0, launches[1].outputs[0].clone())];
    let plan = Plan::new(c.op, c.target, launches, results).with_host(vec![Array::from_f32_in(dtype, &[t, k], vec![1.0; t * k])]);
    ids_check(c, plan)
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
        name: "permute", doc: "MoE dispatch: (x rows in expert-sorted order [t*k, d] (stable by expert), int32 group_sizes [num_experts]); one-hot matmul gather, O(t * t*k * d)", schema: "(Tensor x, Tensor expert_ids, int num_experts) -> (Tensor, Tensor)", plan: plan_permute, reference: Some(ref_permute),
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
        name: "combine", doc: "MoE combine: out[t] = sum_j weights[t, j] * y[row of (t, j)] from expert-sorted rows; weighted one-hot matmul, O(t * t*k * d)", schema: "(Tensor y, Tensor weights, Tensor expert_ids, int num_experts) -> Tensor", plan: plan_combine, reference: Some(ref_combine),
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
