//! Mixture-of-experts routing: `router_topk` (gate + top-k + renormalisation), `permute`
//! (token rows into expert-sorted order, the input layout of `gmm`) and `combine` (the
//! weighted sum of each token's expert outputs back in token order).
//!
//! # How the pieces fit
//!
//! ```text
//! logits [T, E] --router_topk--> weights [T, k], expert_ids [T, k]
//! expert_ids --plan (host)--> Routing { src [T*k], pos [T, k], group_sizes [E] }
//! x [T, D] --permute(src)--> xs [T*k, D]  --gmm(group_sizes)--> ys [T*k, D]
//! ys, weights --combine(pos)--> out [T, D],  out[t] = sum_j w[t, j] * ys[pos[t, j]]
//! ```
//!
//! The sorted order is a *stable* sort of the `T*k` (token, slot) pairs, flattened as
//! `t * k + j`, by expert id: rows of one expert are contiguous and in token order.
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
//! NaN logits are not supported (a NaN row gets id `E`, which [`plan`] rejects).
//!
//! # Gather and scatter as one-hot matmuls — and what that costs
//!
//! The IR has no DMA gather yet, so `permute` and `combine` use the dispatch/combine
//! einsum formulation of GShard-style TPU MoE code: `permute` computes
//! `out_tile = onehot(src[rows]) @ x_tile` accumulated over token tiles, and `combine`
//! `out_tile = W_tile @ y_tile` with `W[t, i] = sum_j w[t, j] * (pos[t, j] == i)`, both on
//! the MXU with f32 accumulation. A one-hot product is exact (one term is `1 * x`, the
//! rest `0 * x`); `combine` rounds `W` to `y`'s dtype before the dot, like the einsum does.
//!
//! The price is **O(T * T*k * D)** flops (`2 * T * T*k * D`) and re-reading all of `x`
//! (resp. `y`) once per row tile, where a gather moves `T*k*D` elements. That is fine
//! for decode and small prefill batches (T = 512, k = 2, D = 4096: 4.3 GFLOP, ~22 us at
//! v5e peak) and quadratic beyond (T = 8192, k = 8, D = 4096: 4.4 TFLOP, ~22 ms, where a
//! gather moves 0.5 GB in under 1 ms). A DMA gather (row indices
//! by scalar prefetch, one async copy per row) is the scalable version; it needs the
//! async-copy IR of issue 3 and is future work.
//!
//! # Ragged edges
//!
//! Grids are `ceil(n / block)` (Pallas partial edge blocks), so `T` need not be a
//! multiple of any tile. Rows past the end of an input block hold garbage (NaN in the
//! interpreter); since `0 * NaN = NaN`, the contraction operand's tail rows are zeroed
//! with an iota mask before the dot. Output rows past the end are dropped.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{verify, DType, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::{harness, LibraryKernel, Operand, OperandKind};

/// The largest `k` `router_topk` supports (each round is a full pass over the row).
pub const MAX_TOP_K: usize = 8;
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
    weights = block([tm, k], |i| [i, 0]),
    expert_ids = block([tm, k], |i| [i, 0]),
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
        let m = s.reduce_max(1);
        let idx = select(s == m, cand, e).reduce_min(1);
        let hit = col == idx;
        s = select(hit, NEG_INF, s);
        cand = select(hit, e, cand);
        top = select(slot == j, m, top);
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
    src = block([tm, 1], |i, j, kk| [i, 0]),
    x = block([tt, td], |i, j, kk| [kk, j]),
    out = block([tm, td], |i, j, kk| [i, j]),
    acc = scratch([tm, td], f32),
)]
pub fn permute_kernel(src: In<rows, 1>, x: In<t, d>, out: Out<rows, d>, acc: Scratch, tm: usize, td: usize, tt: usize) {
    if program_id(2) == 0 {
        acc[..] = zeros([tm, td], f32);
    }
    let tok0 = program_id(2) * tt;
    let onehot = select(iota([tm, tt], 1) + tok0 == src[..], 1.0, 0.0).cast(x.dtype);
    let mut xv = x[..];
    if !t.is_multiple_of(tt) {
        // The last token tile reaches past T: zero its garbage rows (0 * NaN = NaN).
        xv = select(iota([tt, td], 0) + tok0 < t, xv, 0.0);
    }
    acc[..] += dot(onehot, xv);
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

#[tpu_kernel(
    grid = [t.div_ceil(tm), d.div_ceil(td), rows.div_ceil(ti)],
    semantics = [parallel, parallel, arbitrary],
    weights = block([tm, k], |i, j, kk| [i, 0]),
    pos = block([tm, k], |i, j, kk| [i, 0]),
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
    // W[t, i] = sum_j w[t, j] * (pos[t, j] == row0 + i): k compares, no gather.
    let mut wt = zeros([tm, ti], f32);
    for j in 0..k {
        let pj = select(slot == j, p, 0).sum(1);
        let wj = select(slot == j, w, 0.0).sum(1).broadcast_to([tm, ti]);
        wt = wt + select(row == pj, wj, 0.0);
    }
    let mut yv = y[..];
    if !rows.is_multiple_of(ti) {
        // The last row tile reaches past T*k: zero its garbage rows (0 * NaN = NaN).
        yv = select(iota([ti, td], 0) + row0 < rows, yv, 0.0);
    }
    acc[..] += dot(wt.cast(y.dtype), yv);
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
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

/// `permute` (same blocks on every generation): `x [T, D]` and `rows = T*k` sorted rows (the `src` column is
/// `[rows, 1]` int32). Tiles of up to [`ONEHOT_TILE`] rows, tokens and columns.
pub fn permute_for(x: &Type, rows: usize, _target: &Target) -> Result<Kernel, KernelError> {
    let (t, d) = rank2("permute", "x", x)?;
    float_operand("permute", "x", x)?;
    let src = Type::vector(DType::I32, &[rows, 1]);
    permute_kernel(src, x.clone(), Type::vector(x.dtype, &[rows, d]), tile(rows, ONEHOT_TILE), tile(d, ONEHOT_TILE), tile(t, ONEHOT_TILE))
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

/// Sorts the routing on the host: a stable counting sort of the `T*k` (token, slot)
/// pairs by expert id. `ids` is the `[T, k]` int32 output of [`route`].
pub fn plan(ids: &Array, num_experts: usize) -> Result<Routing, KernelError> {
    let err = |rule, message: String, help: &str| KernelError::new("plan", "operand `expert_ids`", rule, message, help);
    let (Some(data), &[t, k]) = (ids.as_i32(), &ids.shape[..]) else {
        return Err(err("operand-shape", format!("expert_ids is {}{:?}", ids.dtype, ids.shape), "pass the [T, k] int32 expert ids from router_topk"));
    };
    if let Some((n, &bad)) = data.iter().enumerate().find(|(_, &e)| e < 0 || e as usize >= num_experts) {
        return Err(err("expert-id-range", format!("token {} slot {} routes to expert {bad}, but there are {num_experts} experts", n / k, n % k), "pass ids in 0..num_experts (NaN logits give id E)"));
    }
    let mut group_sizes = vec![0i32; num_experts];
    for &e in data {
        group_sizes[e as usize] += 1;
    }
    let mut next: Vec<usize> = group_sizes.iter().scan(0usize, |start, &g| Some(std::mem::replace(start, *start + g as usize))).collect();
    let mut src = vec![0i32; t * k];
    let mut pos = vec![0i32; t * k];
    for (n, &e) in data.iter().enumerate() {
        let row = next[e as usize];
        next[e as usize] += 1;
        src[row] = (n / k) as i32;
        pos[n] = row as i32;
    }
    Ok(Routing { tokens: t, k, src, pos, group_sizes })
}

fn run_checked(kernel: &Kernel, target: &Target, args: &[&Array]) -> Result<Vec<Array>, KernelError> {
    verify::verify(kernel, target)?;
    interp::run(kernel, args)
}

fn check_tokens(op: &str, operand: &str, a: &Array, routing: &Routing, want: usize) -> Result<(), KernelError> {
    if a.shape.len() == 2 && a.shape[0] == want {
        return Ok(());
    }
    Err(KernelError::new(
        op,
        format!("operand `{operand}`"),
        "routing-shape",
        format!("shape {:?}, but the routing has {} tokens x {} slots", a.shape, routing.tokens, routing.k),
        format!("pass {want} rows"),
    ))
}

/// Gate + top-k on the CPU interpreter: `(weights [T, k], expert_ids [T, k])`.
pub fn route(logits: &Array, k: usize, gate: Gate, normalize: bool, target: &Target) -> Result<(Array, Array), KernelError> {
    let kernel = router_topk(&Type::vector(logits.dtype, &logits.shape), k, gate, normalize, target)?;
    let mut out = run_checked(&kernel, target, &[logits])?.into_iter();
    Ok((out.next().expect("two outputs"), out.next().expect("two outputs")))
}

/// `x [T, D]` rows in expert-sorted order, `[T*k, D]`.
pub fn permute(x: &Array, routing: &Routing, target: &Target) -> Result<Array, KernelError> {
    check_tokens("permute", "x", x, routing, routing.tokens)?;
    let rows = routing.src.len();
    let kernel = permute_for(&Type::vector(x.dtype, &x.shape), rows, target)?;
    let src = Array::from_i32(&[rows, 1], routing.src.clone());
    Ok(run_checked(&kernel, target, &[&src, x])?.remove(0))
}

/// `out[t] = sum_j weights[t, j] * y[pos[t, j]]`, `[T, D]` in `y`'s dtype.
pub fn combine(y: &Array, weights: &Array, routing: &Routing, target: &Target) -> Result<Array, KernelError> {
    check_tokens("combine", "y", y, routing, routing.src.len())?;
    if weights.shape != [routing.tokens, routing.k] {
        return Err(KernelError::new(
            "combine",
            "operand `weights`",
            "routing-shape",
            format!("shape {:?}, the routing is [{}, {}]", weights.shape, routing.tokens, routing.k),
            "pass the [T, k] weights from router_topk",
        ));
    }
    let pos = Array::from_i32(&[routing.tokens, routing.k], routing.pos.clone());
    let kernel = combine_for(&Type::vector(weights.dtype, &weights.shape), &Type::vector(DType::I32, &pos.shape), &Type::vector(y.dtype, &y.shape), target)?;
    Ok(run_checked(&kernel, target, &[weights, &pos, y])?.remove(0))
}

// ---- library entries ----------------------------------------------------------------------

/// The library entry's static parameters for `router_topk`.
pub const LIBRARY_TOP_K: usize = 2;
pub const LIBRARY_GATE: Gate = Gate::Softmax;
pub const LIBRARY_NORMALIZE: bool = true;

/// The number of experts random routings draw from for `[T, k]` ids: `2k + 3` (odd, not
/// a power of two). Expert 1 is never chosen, so one group is always empty.
pub fn random_routing_experts(k: usize) -> usize {
    2 * k + 3
}

/// Random valid routing: each token picks `k` distinct experts of
/// [`random_routing_experts`], never expert 1.
pub fn random_expert_ids(t: usize, k: usize, rng: &mut StdRng) -> Array {
    let pool: Vec<i32> = (0..random_routing_experts(k) as i32).filter(|&e| e != 1).collect();
    let mut ids = Vec::with_capacity(t * k);
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

fn ids_input(shapes: &[Vec<usize>], at: usize, rng: &mut StdRng) -> Array {
    let s = shapes.get(at).map(|s| s.as_slice()).unwrap_or(&[]);
    random_expert_ids(s.first().copied().unwrap_or(1), s.get(1).copied().unwrap_or(1), rng)
}

fn arity(op: &str, n: usize, want: usize) -> Result<(), KernelError> {
    if n == want {
        return Ok(());
    }
    Err(KernelError::new(op, "inputs", "input-count", format!("{n} inputs given, the op takes {want}"), "pass one array per input operand"))
}

fn routing_of(op: &str, ids: &Array) -> Result<Routing, KernelError> {
    let experts = ids.as_i32().and_then(|d| d.iter().max()).map_or(1, |&m| m.max(0) as usize + 1);
    plan(ids, experts).map_err(|e| KernelError { kernel: op.to_string(), ..e })
}

fn rows_of(op: &str, ids: &Type) -> Result<usize, KernelError> {
    let (t, k) = rank2(op, "expert_ids", ids)?;
    int_operand(op, "expert_ids", ids)?;
    Ok(t * k)
}

const fn operand(name: &'static str, dims: &'static str, default_shape: &'static [usize], kind: OperandKind) -> Operand {
    Operand { name, dims, default_shape, kind }
}

/// This module's library ops.
pub const OPS: &[LibraryKernel] = &[
    LibraryKernel {
        name: "router_topk",
        summary: "MoE router: softmax over experts, top-2 (ties: lowest expert), renormalised; f32 math",
        signature: "router_topk(logits: [t, e]; k = 2, gate = softmax, normalize = true) -> (weights: [t, k], expert_ids: [t, k] i32)",
        inputs: &[operand("logits", "[t, e]", &[512, 8], OperandKind::Float)],
        alt_shapes: &[&[1000, 60]],
        build: |t, target| {
            arity("router_topk", t.len(), 1)?;
            Ok(vec![router_topk(&t[0], LIBRARY_TOP_K, LIBRARY_GATE, LIBRARY_NORMALIZE, target)?])
        },
        run: |a, target| {
            arity("router_topk", a.len(), 1)?;
            let (w, ids) = route(&a[0], LIBRARY_TOP_K, LIBRARY_GATE, LIBRARY_NORMALIZE, target)?;
            Ok(vec![w, ids])
        },
        random_inputs: crate::uniform_inputs,
        reference: |a| {
            let (w, ids) = reference::router_topk(&a[0].to_f64_vec(), a[0].shape[1], LIBRARY_TOP_K, LIBRARY_GATE == Gate::Sigmoid, LIBRARY_NORMALIZE);
            vec![w, ids.into_iter().map(|i| i as f64).collect()]
        },
    },
    LibraryKernel {
        name: "permute",
        summary: "MoE dispatch: token rows into expert-sorted order (stable by expert), one-hot matmul gather, O(T*Tk*D)",
        signature: "permute(x: [t, d], expert_ids: [t, k] i32) -> [t*k, d]",
        inputs: &[operand("x", "[t, d]", &[512, 512], OperandKind::Float), operand("expert_ids", "[t, k]", &[512, 2], OperandKind::Int32)],
        alt_shapes: &[&[1000, 384], &[1000, 4]],
        build: |t, target| {
            arity("permute", t.len(), 2)?;
            Ok(vec![permute_for(&t[0], rows_of("permute", &t[1])?, target)?])
        },
        run: |a, target| {
            arity("permute", a.len(), 2)?;
            Ok(vec![permute(&a[0], &routing_of("permute", &a[1])?, target)?])
        },
        random_inputs: |shapes, dtype, rng| vec![harness::random_array(dtype, &shapes[0], rng), ids_input(shapes, 1, rng)],
        reference: |a| {
            let ids: Vec<i64> = a[1].to_f64_vec().into_iter().map(|v| v as i64).collect();
            vec![reference::permute(&a[0].to_f64_vec(), a[0].shape[1], &ids, a[1].shape[1])]
        },
    },
    LibraryKernel {
        name: "combine",
        summary: "MoE combine: out[t] = sum_j w[t, j] * y[pos[t, j]] from expert-sorted rows, weighted one-hot matmul, O(T*Tk*D)",
        signature: "combine(y: [t*k, d], weights: [t, k], expert_ids: [t, k] i32) -> [t, d]",
        inputs: &[
            operand("y", "[t*k, d]", &[1024, 512], OperandKind::Float),
            operand("weights", "[t, k]", &[512, 2], OperandKind::Float),
            operand("expert_ids", "[t, k]", &[512, 2], OperandKind::Int32),
        ],
        alt_shapes: &[&[4000, 384], &[1000, 4], &[1000, 4]],
        build: |t, target| {
            arity("combine", t.len(), 3)?;
            rows_of("combine", &t[2])?;
            Ok(vec![combine_for(&t[1], &t[2], &t[0], target)?])
        },
        run: |a, target| {
            arity("combine", a.len(), 3)?;
            Ok(vec![combine(&a[0], &a[1], &routing_of("combine", &a[2])?, target)?])
        },
        random_inputs: |shapes, dtype, rng| {
            let y = harness::random_array(dtype, &shapes[0], rng);
            let w = harness::random_array(dtype, &shapes[1], rng);
            vec![y, w, ids_input(shapes, 2, rng)]
        },
        reference: |a| {
            let ids: Vec<i64> = a[2].to_f64_vec().into_iter().map(|v| v as i64).collect();
            vec![reference::combine(&a[0].to_f64_vec(), a[0].shape[1], &a[1].to_f64_vec(), &ids, a[2].shape[1])]
        },
    },
];

/// Independent references: plain f64 loops (explicit softmax, sort-based top-k and
/// routing order, gather, weighted sum) sharing no code with the kernels or [`plan`].
pub mod reference {
    /// Top-k of each length-`e` row of `logits`: `(weights, ids)`, both `[T, k]`
    /// row-major. Order: larger logit first, ties to the lower index.
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
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
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
