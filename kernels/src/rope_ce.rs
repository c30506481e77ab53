//! Rotary position embeddings and fused cross-entropy, forward and backward.
//!
//! **RoPE.** The op takes `x: [t, h, dh]` and views it as `[t, h * dh]` (free, row-major):
//! heads sit side by side in the lanes. A grid step owns `tm` rows and one *chunk* of
//! `w` lanes holding whole heads, `w = lcm(dh, 128)` when that divides `h * dh` (so the
//! block is lane-aligned: `w = dh` for dh = 128 or 256, two heads for dh = 64), else the
//! whole row. Lane shuffles are not IR ops, so the pair swap is a matmul with a constant
//! signed permutation `R [w, w]` built in-kernel from iota compares (block-diagonal over
//! the chunk's heads): `x_rot = x @ R`, `out = x * cos + x_rot * sin`. That costs `2w`
//! MXU flops per element (3x that for f32, see [`rope_kernel`]) against ~3 VPU ops, on an
//! op that is HBM-bound anyway. `cos`/`sin` come from the host as f32 `[t, w]` tables
//! (angles in f64 from `position_ids` and `theta`, repeated across the chunk's heads);
//! their block index does not move along the chunk axis, so each is fetched once per
//! row tile.
//!
//! Variants: rotate-half (GPT-NeoX / Llama; pairs `(i, i + dh/2)`, frequency `i`) and
//! interleaved (GPT-J; pairs `(2i, 2i + 1)`, frequency `i`).
//!
//! **Cross-entropy.** `logits [t, v]`, `labels [t]` -> `loss [t]`, `lse [t, 1]` (f32):
//! grid (row tiles `parallel`, vocab tiles `arbitrary`), online logsumexp in f32 scratch
//! (running max and rescaled running sum), the label's logit picked by an `iota ==
//! label` mask. The `[t, v]` probabilities never exist. Columns past `v` in the last
//! vocab block are masked (they are garbage; NaN in the interpreter). Labels outside
//! `[0, v)` (PyTorch's `ignore_index = -100`) give loss 0 and gradient 0. The backward
//! pass recomputes `softmax = exp(x - lse)` block by block.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::{self, Array, Data};
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::{harness, LibraryKernel, Operand, OperandKind};

/// RoPE's base in the library entries (the builders take any).
pub const ROPE_THETA: f64 = 10000.0;

/// Bytes of f32 per RoPE block (the same budget as the row kernels).
const ROPE_BLOCK_BYTES: usize = 1 << 20;
/// Cross-entropy tile: rows x vocab columns (1 MiB of f32 logits per step).
const CE_ROWS: usize = 128;
const CE_VOCAB: usize = 2048;
/// Masked logits and the running max's start: finite, so `exp(m_old - m_new)` never
/// sees `-inf - -inf`.
const MASKED: f32 = f32::MIN;

// ---- RoPE ------------------------------------------------------------------------------

/// Rotates the pairs of `x` (`[t, n]`, `n` = heads x `dh`) by the angles in `cos`/`sin`
/// (`[t, w]`, one chunk of heads), block `[tm, w]`. `sign = 1` is the forward rotation,
/// `sign = -1` its transpose (the backward pass).
///
/// The rotation of a pair is `R`-mixing plus a per-pair angle, and both members of a
/// pair share their angle, so `(dy * sin) @ R^T = (dy @ R^T) * sin = -(dy @ R) * sin`
/// (`R` is antisymmetric): forward and backward differ only in `sign`, and `R` always
/// multiplies the raw input, which keeps bf16 inputs exact in one bf16 MXU pass. f32
/// inputs are split into three bf16 pieces (hi + mid + lo = x exactly) so the permutation
/// stays exact whatever precision the MXU uses for f32 operands.
#[tpu_kernel(
    grid = [t.div_ceil(tm), n / w],
    semantics = [parallel, parallel],
    x = block([tm, w], |i, j| [i, j]),
    cos = block([tm, w], |i, j| [i, 0]),
    sin = block([tm, w], |i, j| [i, 0]),
    out = block([tm, w], |i, j| [i, j]),
)]
pub fn rope_kernel(x: In<t, n>, cos: In<t, w>, sin: In<t, w>, out: Out<t, n>, tm: usize, dh: usize, interleaved: bool, sign: f32) {
    // R[i, i + off] = +1 and R[i + off, i] = -1 for i the first member of a pair.
    let r = iota([w, w], 0);
    let c = iota([w, w], 1);
    let off = if interleaved { 1 } else { (dh / 2) as i32 };
    let first = if interleaved {
        (r & 1) == 0
    } else {
        // r mod dh < dh / 2, with floor(r / dh) through f32 (no vector integer division
        // on the VPU); exact since the +0.5 keeps the quotient 0.5/dh away from integers.
        let head = ((r.cast(f32) + 0.5) * (1.0 / dh as f32)).cast(i32);
        r - head * (dh as i32) < off
    };
    let plus = ((c - r) == off) & first;
    let minus = ((r - c) == off) & !first;
    let rmat = select(plus, 1.0, select(minus, -1.0, 0.0)).cast(bf16);
    let v = x[..];
    let rot = if x.dtype == bf16 {
        dot(v, rmat)
    } else {
        let hi = v.cast(bf16);
        let rest = v - hi.cast(f32);
        let mid = rest.cast(bf16);
        let lo = (rest - mid.cast(f32)).cast(bf16);
        dot(hi, rmat) + dot(mid, rmat) + dot(lo, rmat)
    };
    out[..] = (v.cast(f32) * cos[..] + rot * (sin[..] * sign)).cast(out.dtype);
}

/// The lane chunk a RoPE grid step owns: `lcm(dh, 128)` when it divides `n = h * dh`,
/// else the whole row (a full-dim block is always legal).
pub fn rope_chunk(n: usize, dh: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let w = dh / gcd(dh, 128) * 128;
    if n.is_multiple_of(w) { w } else { n }
}

/// Rows per RoPE block: about [`ROPE_BLOCK_BYTES`] of f32 per `[tm, w]` block, a multiple
/// of the dtype's sublane tiling, or all of `t`. `t` need not be a multiple (edge blocks
/// are partial; rows are independent, so nothing needs masking).
fn rope_rows(t: usize, w: usize, dtype: DType, target: &Target) -> usize {
    row_tile(t, ROPE_BLOCK_BYTES / (4 * w), target.tiling(dtype).0.max(8))
}

/// `rows` rounded down to `align` (at least `align`), or all of `t` when that is no more.
fn row_tile(t: usize, rows: usize, align: usize) -> usize {
    let rows = (rows / align * align).max(align);
    if t <= rows { t } else { rows }
}

fn shape_err(op: &str, subject: &str, message: String, help: &str) -> KernelError {
    KernelError::new(op, subject, "operand-shape", message, help)
}

/// `(t, h, dh)` of a RoPE input, checked.
fn rope_dims(op: &str, x: &Type) -> Result<(usize, usize, usize), KernelError> {
    match x.shape[..] {
        [t, h, dh] if t > 0 && h > 0 && dh >= 2 && dh % 2 == 0 => Ok((t, h, dh)),
        _ => Err(shape_err(op, "input `x`", format!("x has shape {:?}", x.shape), "pass x as [tokens, heads, head_dim] with an even head_dim")),
    }
}

/// The RoPE kernel for an op input `x: [t, h, dh]` on `target` (default blocks); it takes
/// `x` viewed as `[t, h * dh]` and f32 tables `[t, rope_chunk(h * dh, dh)]`.
pub fn build_rope(x: &Type, interleaved: bool, backward: bool, target: &Target) -> Result<Kernel, KernelError> {
    let op = if backward { "rope_bwd" } else { "rope" };
    let (t, h, dh) = rope_dims(op, x)?;
    if !x.dtype.is_float() {
        return Err(KernelError::new(op, "input `x`", "operand-dtype", format!("x is {}", x.dtype), "RoPE takes f32 or bf16 activations"));
    }
    let n = h * dh;
    let w = rope_chunk(n, dh);
    let flat = Type::vector(x.dtype, &[t, n]);
    let table = Type::vector(DType::F32, &[t, w]);
    let sign = if backward { -1.0 } else { 1.0 };
    rope_kernel(flat.clone(), table.clone(), table, flat, rope_rows(t, w, x.dtype, target), dh, interleaved, sign)
}

/// Host-side `cos`/`sin` tables `[t, w]` (f32) for `positions`: column `c` holds the
/// angle of lane `c mod dh` of a head. Angles are computed in f64 and rounded once: in
/// f32, `position * inv_freq` alone loses ~1e-4 rad at positions in the thousands.
pub fn rope_tables(positions: &[i32], dh: usize, w: usize, theta: f64, interleaved: bool) -> (Array, Array) {
    let half = dh / 2;
    let (mut cos, mut sin) = (Vec::with_capacity(positions.len() * w), Vec::with_capacity(positions.len() * w));
    for &p in positions {
        for c in 0..w {
            let lane = c % dh;
            let pair = if interleaved { lane / 2 } else { lane % half };
            let angle = p as f64 * theta.powf(-2.0 * pair as f64 / dh as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let shape = [positions.len(), w];
    (Array::from_f32(&shape, cos), Array::from_f32(&shape, sin))
}

/// The positions of a RoPE call as i32, checked against `t`.
fn positions_of<'a>(op: &str, positions: &'a Array, t: usize) -> Result<&'a [i32], KernelError> {
    match positions.as_i32() {
        Some(p) if positions.shape == [t] => Ok(p),
        _ => Err(shape_err(op, "input `position_ids`", format!("position_ids is {}{:?}, x has {t} tokens", positions.dtype, positions.shape), "pass int32 position ids of shape [tokens]")),
    }
}

fn reshaped(a: &Array, shape: &[usize]) -> Array {
    Array { shape: shape.to_vec(), ..a.clone() }
}

fn run_rope(x: &Array, positions: &Array, theta: f64, interleaved: bool, backward: bool, target: &Target) -> Result<Array, KernelError> {
    let op = if backward { "rope_bwd" } else { "rope" };
    let kernel = build_rope(&Type::vector(x.dtype, &x.shape), interleaved, backward, target)?;
    let (t, h, dh) = (x.shape[0], x.shape[1], x.shape[2]);
    let positions = positions_of(op, positions, t)?;
    let (cos, sin) = rope_tables(positions, dh, rope_chunk(h * dh, dh), theta, interleaved);
    let out = interp::run(&kernel, &[&reshaped(x, &[t, h * dh]), &cos, &sin])?;
    Ok(reshaped(&out[0], &x.shape))
}

/// RoPE on the CPU interpreter: `x: [t, h, dh]` (f32 or bf16) rotated by the angles of
/// `positions: i32[t]` with base `theta`; rotate-half unless `interleaved`.
pub fn rope(x: &Array, positions: &Array, theta: f64, interleaved: bool, target: &Target) -> Result<Array, KernelError> {
    run_rope(x, positions, theta, interleaved, false, target)
}

/// The gradient of [`rope`] with respect to `x`, given `dy` (the inverse rotation).
pub fn rope_bwd(dy: &Array, positions: &Array, theta: f64, interleaved: bool, target: &Target) -> Result<Array, KernelError> {
    run_rope(dy, positions, theta, interleaved, true, target)
}

// ---- cross-entropy ---------------------------------------------------------------------

/// Forward: `loss = lse - logits[label]` per row, `lse = logsumexp(logits)`, by
/// `[tm, tv]` tiles with the vocab axis last and `arbitrary`.
#[tpu_kernel(
    grid = [t.div_ceil(tm), vocab.div_ceil(tv)],
    semantics = [parallel, arbitrary],
    logits = block([tm, tv], |i, j| [i, j]),
    labels = block([tm, 1], |i, j| [i, 0]),
    loss = block([tm, 1], |i, j| [i, 0]),
    lse = block([tm, 1], |i, j| [i, 0]),
    m_run = scratch([tm, 1], f32),
    s_run = scratch([tm, 1], f32),
    picked = scratch([tm, 1], f32),
)]
pub fn cross_entropy_kernel(logits: In<t, vocab>, labels: In<t, 1>, loss: Out<t, 1>, lse: Out<t, 1>, m_run: Scratch, s_run: Scratch, picked: Scratch, tm: usize, tv: usize) {
    let j = program_id(1);
    if j == 0 {
        m_run[..] = full([tm, 1], f32, MASKED);
        s_run[..] = zeros([tm, 1], f32);
        picked[..] = zeros([tm, 1], f32);
    }
    let col = iota([tm, tv], 1) + j * (tv as i32);
    let label = labels[..];
    // Columns past the vocabulary (last tile) hold garbage: mask before any reduction.
    let x = select(col < (vocab as i32), logits[..].cast(f32), MASKED);
    let m_old = m_run[..];
    let m_new = m_old.max(x.reduce_max(1));
    s_run[..] = s_run[..] * (m_old - m_new).exp() + (x - m_new).exp().sum(1);
    m_run[..] = m_new;
    picked[..] += select(col == label, x, 0.0).sum(1);
    if j == num_programs(1) - 1 {
        let l = m_run[..] + s_run[..].log();
        lse[..] = l;
        let valid = (label >= 0) & (label < (vocab as i32));
        loss[..] = select(valid, l - picked[..], 0.0);
    }
}

/// Backward: `dlogits = (exp(logits - lse) - onehot(label)) * dloss`, each `[tm, tv]`
/// tile independent (both grid axes `parallel`).
#[tpu_kernel(
    grid = [t.div_ceil(tm), vocab.div_ceil(tv)],
    semantics = [parallel, parallel],
    logits = block([tm, tv], |i, j| [i, j]),
    labels = block([tm, 1], |i, j| [i, 0]),
    lse = block([tm, 1], |i, j| [i, 0]),
    dloss = block([tm, 1], |i, j| [i, 0]),
    dlogits = block([tm, tv], |i, j| [i, j]),
)]
pub fn cross_entropy_bwd_kernel(logits: In<t, vocab>, labels: In<t, 1>, lse: In<t, 1>, dloss: In<t, 1>, dlogits: Out<t, vocab>, tm: usize, tv: usize) {
    // No column mask: columns past the vocabulary are garbage but their writes are dropped.
    let col = iota([tm, tv], 1) + program_id(1) * (tv as i32);
    let label = labels[..];
    let p = (logits[..].cast(f32) - lse[..].cast(f32)).exp();
    let onehot = select(col == label, 1.0, 0.0);
    let valid = (label >= 0) & (label < (vocab as i32));
    let g = select(valid, dloss[..].cast(f32), 0.0);
    dlogits[..] = ((p - onehot) * g).cast(dlogits.dtype);
}

/// Cross-entropy tiles for `[t, v]` logits of `dtype`: up to [`CE_ROWS`] rows (a multiple
/// of the sublane tiling, or all of `t`) by up to [`CE_VOCAB`] columns (a multiple of 128,
/// or all of `v`). Neither dim need divide: edge tiles are partial and masked.
pub fn cross_entropy_blocks(t: usize, v: usize, dtype: DType, target: &Target) -> (usize, usize) {
    (row_tile(t, CE_ROWS, target.tiling(dtype).0.max(8)), if v <= CE_VOCAB { v } else { CE_VOCAB })
}

fn ce_dims(op: &str, logits: &Type) -> Result<(usize, usize), KernelError> {
    match logits.shape[..] {
        [t, v] if logits.dtype.is_float() => Ok((t, v)),
        _ => Err(shape_err(op, "input `logits`", format!("logits is {}{:?}", logits.dtype, logits.shape), "pass float logits of shape [tokens, vocab]")),
    }
}

/// The cross-entropy forward kernel for `logits: [t, v]` on `target` (default blocks);
/// it takes labels as i32 `[t, 1]` and returns f32 `loss [t, 1]` and `lse [t, 1]`.
pub fn build_cross_entropy(logits: &Type, target: &Target) -> Result<Kernel, KernelError> {
    let (t, v) = ce_dims("cross_entropy", logits)?;
    let (tm, tv) = cross_entropy_blocks(t, v, logits.dtype, target);
    let col = |d| Type::vector(d, &[t, 1]);
    cross_entropy_kernel(logits.clone(), col(DType::I32), col(DType::F32), col(DType::F32), tm, tv)
}

/// The cross-entropy backward kernel: `lse` and `dloss` are `[t, 1]` of any float dtype
/// (f32 as the forward returns them); `dlogits` has the logits' dtype.
pub fn build_cross_entropy_bwd(logits: &Type, lse_dtype: DType, dloss_dtype: DType, target: &Target) -> Result<Kernel, KernelError> {
    let (t, v) = ce_dims("cross_entropy_bwd", logits)?;
    let (tm, tv) = cross_entropy_blocks(t, v, logits.dtype, target);
    let col = |d| Type::vector(d, &[t, 1]);
    cross_entropy_bwd_kernel(logits.clone(), col(DType::I32), col(lse_dtype), col(dloss_dtype), logits.clone(), tm, tv)
}

/// `a` (of `t` elements: `[t]` or `[t, 1]`) as a `[t, 1]` column, checked.
fn column(op: &str, name: &str, a: &Array, t: usize, int: bool) -> Result<Array, KernelError> {
    let ok = a.len() == t && (a.shape == [t] || a.shape == [t, 1]) && (a.dtype == DType::I32) == int && (int || a.dtype.is_float());
    if !ok {
        let want = if int { "int32" } else { "float" };
        return Err(shape_err(op, &format!("input `{name}`"), format!("{name} is {}{:?}, the logits have {t} rows", a.dtype, a.shape), &format!("pass {want} {name} of shape [tokens]")));
    }
    Ok(reshaped(a, &[t, 1]))
}

/// Cross-entropy on the CPU interpreter: `(loss [t], lse [t, 1])`, both f32, for
/// `logits: [t, v]` and `labels: i32[t]`.
pub fn cross_entropy(logits: &Array, labels: &Array, target: &Target) -> Result<(Array, Array), KernelError> {
    let kernel = build_cross_entropy(&Type::vector(logits.dtype, &logits.shape), target)?;
    let t = logits.shape[0];
    let labels = column("cross_entropy", "labels", labels, t, true)?;
    let mut out = interp::run(&kernel, &[logits, &labels])?;
    let lse = out.pop().expect("two outputs");
    let loss = out.pop().expect("two outputs");
    Ok((reshaped(&loss, &[t]), lse))
}

/// The gradient of `sum(cross_entropy(logits, labels).loss * dloss)` with respect to the
/// logits, given the forward's `lse`; `dlogits` has the logits' dtype.
pub fn cross_entropy_bwd(logits: &Array, labels: &Array, lse: &Array, dloss: &Array, target: &Target) -> Result<Array, KernelError> {
    let kernel = build_cross_entropy_bwd(&Type::vector(logits.dtype, &logits.shape), lse.dtype, dloss.dtype, target)?;
    let t = logits.shape[0];
    let op = "cross_entropy_bwd";
    let args = [logits.clone(), column(op, "labels", labels, t, true)?, column(op, "lse", lse, t, false)?, column(op, "dloss", dloss, t, false)?];
    Ok(interp::run(&kernel, &args.iter().collect::<Vec<_>>())?.remove(0))
}

// ---- library entries -------------------------------------------------------------------

fn arity(op: &str, n: usize, want: usize) -> Result<(), KernelError> {
    if n == want {
        return Ok(());
    }
    Err(KernelError::new(op, "inputs", "input-count", format!("{n} inputs given, the op takes {want}"), "pass one array per input operand"))
}


/// x in [-1, 1) and positions drawn from [0, 8192) in no particular order.
fn rope_inputs(shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let (xs, ts) = (&shapes[0], shapes[1][0]);
    let x = Array::from_f32_in(dtype, xs, harness::uniform(xs.iter().product(), 1.0, rng));
    let pos = Array::from_i32(&[ts], (0..ts).map(|_| rng.gen_range(0..8192)).collect());
    vec![x, pos]
}

fn rope_op_build(types: &[Type], target: &Target, interleaved: bool, backward: bool) -> Result<Vec<Kernel>, KernelError> {
    arity(if backward { "rope_bwd" } else { "rope" }, types.len(), 2)?;
    Ok(vec![build_rope(&types[0], interleaved, backward, target)?])
}

fn rope_op_run(a: &[Array], target: &Target, interleaved: bool, backward: bool) -> Result<Vec<Array>, KernelError> {
    arity(if backward { "rope_bwd" } else { "rope" }, a.len(), 2)?;
    Ok(vec![run_rope(&a[0], &a[1], ROPE_THETA, interleaved, backward, target)?])
}

fn rope_op_reference(a: &[Array], interleaved: bool, backward: bool) -> Vec<Vec<f64>> {
    let (t, h, dh) = (a[0].shape[0], a[0].shape[1], a[0].shape[2]);
    let pos = a[1].to_f64_vec();
    let f = if backward { reference::rope_bwd } else { reference::rope };
    vec![f(&a[0].to_f64_vec(), &pos, t, h, dh, ROPE_THETA, interleaved)]
}

/// Logits in [-4, 4) (a spread that exercises the max subtraction), labels in [0, v).
fn ce_inputs(shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let (t, v) = (shapes[0][0], shapes[0][1]);
    let logits = Array::from_f32_in(dtype, &[t, v], harness::uniform(t * v, 4.0, rng));
    let labels = Array::from_i32(&[t], (0..t).map(|_| rng.gen_range(0..v as i32)).collect());
    vec![logits, labels]
}

/// [`ce_inputs`] plus the forward's `lse` (exact, rounded to `dtype`) and a random `dloss`.
fn ce_bwd_inputs(shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let mut a = ce_inputs(shapes, dtype, rng);
    let (t, v) = (shapes[0][0], shapes[0][1]);
    let x = a[0].to_f64_vec();
    let lse = x
        .chunks(v)
        .map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            (m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln()) as f32
        })
        .collect();
    a.push(Array::from_f32_in(dtype, &[t, 1], lse));
    a.push(Array::from_f32_in(dtype, &[t], harness::uniform(t, 1.0, rng)));
    a
}

const ROPE_INPUTS: &[Operand] = &[
    Operand { name: "x", dims: "[t, h, dh]", default_shape: &[1024, 8, 128], kind: OperandKind::Float },
    Operand { name: "position_ids", dims: "[t]", default_shape: &[1024], kind: OperandKind::Int32 },
];
const ROPE_BWD_INPUTS: &[Operand] = &[
    Operand { name: "dy", dims: "[t, h, dh]", default_shape: &[1024, 8, 128], kind: OperandKind::Float },
    Operand { name: "position_ids", dims: "[t]", default_shape: &[1024], kind: OperandKind::Int32 },
];
/// dh = 64 (two heads per 128-lane chunk) and more rows than one block, the last partial.
const ROPE_ALT: &[&[usize]] = &[&[4100, 6, 64], &[4100]];

const CE_INPUTS: &[Operand] = &[
    Operand { name: "logits", dims: "[t, v]", default_shape: &[512, 32000], kind: OperandKind::Float },
    Operand { name: "labels", dims: "[t]", default_shape: &[512], kind: OperandKind::Int32 },
];
const CE_BWD_INPUTS: &[Operand] = &[
    Operand { name: "logits", dims: "[t, v]", default_shape: &[512, 32000], kind: OperandKind::Float },
    Operand { name: "labels", dims: "[t]", default_shape: &[512], kind: OperandKind::Int32 },
    Operand { name: "lse", dims: "[t, 1]", default_shape: &[512, 1], kind: OperandKind::Float },
    Operand { name: "dloss", dims: "[t]", default_shape: &[512], kind: OperandKind::Float },
];

/// The interleaved (GPT-J) RoPE, listed in [`OPS`] under its own name.
pub const ROPE_INTERLEAVED: LibraryKernel = LibraryKernel {
    name: "rope_interleaved",
    summary: "RoPE, interleaved (GPT-J) pairs (2i, 2i+1), theta = 10000",
    signature: "rope(x: [t, h, dh], position_ids: i32[t]; theta: f64 = 10000, interleaved: bool = true) -> [t, h, dh]",
    inputs: ROPE_INPUTS,
    alt_shapes: ROPE_ALT,
    build: |t, target| rope_op_build(t, target, true, false),
    run: |a, target| rope_op_run(a, target, true, false),
    random_inputs: rope_inputs,
    reference: |a| rope_op_reference(a, true, false),
};

/// The backward of [`ROPE_INTERLEAVED`].
pub const ROPE_INTERLEAVED_BWD: LibraryKernel = LibraryKernel {
    name: "rope_interleaved_bwd",
    summary: "gradient of interleaved RoPE (the inverse rotation)",
    signature: "rope_bwd(dy: [t, h, dh], position_ids: i32[t]; theta: f64 = 10000, interleaved: bool = true) -> [t, h, dh]",
    inputs: ROPE_BWD_INPUTS,
    alt_shapes: ROPE_ALT,
    build: |t, target| rope_op_build(t, target, true, true),
    run: |a, target| rope_op_run(a, target, true, true),
    random_inputs: rope_inputs,
    reference: |a| rope_op_reference(a, true, true),
};

/// This module's library ops.
pub const OPS: &[LibraryKernel] = &[
    LibraryKernel {
        name: "rope",
        summary: "rotary position embedding, rotate-half (GPT-NeoX/Llama) pairs (i, i+dh/2), theta = 10000; pair swap as a matmul with an in-kernel signed permutation",
        signature: "rope(x: [t, h, dh], position_ids: i32[t]; theta: f64 = 10000, interleaved: bool = false) -> [t, h, dh]",
        inputs: ROPE_INPUTS,
        alt_shapes: ROPE_ALT,
        build: |t, target| rope_op_build(t, target, false, false),
        run: |a, target| rope_op_run(a, target, false, false),
        random_inputs: rope_inputs,
        reference: |a| rope_op_reference(a, false, false),
    },
    LibraryKernel {
        name: "rope_bwd",
        summary: "gradient of rope: dx = dy * cos + (dy * sin) @ R^T (the inverse rotation)",
        signature: "rope_bwd(dy: [t, h, dh], position_ids: i32[t]; theta: f64 = 10000, interleaved: bool = false) -> [t, h, dh]",
        inputs: ROPE_BWD_INPUTS,
        alt_shapes: ROPE_ALT,
        build: |t, target| rope_op_build(t, target, false, true),
        run: |a, target| rope_op_run(a, target, false, true),
        random_inputs: rope_inputs,
        reference: |a| rope_op_reference(a, false, true),
    },
    LibraryKernel {
        name: "cross_entropy",
        summary: "fused softmax cross-entropy over vocab tiles: online logsumexp in f32 scratch, label logit by iota mask; labels outside [0, v) give 0",
        signature: "cross_entropy(logits: [t, v], labels: i32[t]) -> (loss: f32[t], lse: f32[t, 1])",
        inputs: CE_INPUTS,
        // A GPT-2-sized vocabulary (not a multiple of the tile) and a partial row tile.
        alt_shapes: &[&[300, 50257], &[300]],
        build: |t, target| {
            arity("cross_entropy", t.len(), 2)?;
            Ok(vec![build_cross_entropy(&t[0], target)?])
        },
        run: |a, target| {
            arity("cross_entropy", a.len(), 2)?;
            let (loss, lse) = cross_entropy(&a[0], &a[1], target)?;
            Ok(vec![loss, lse])
        },
        random_inputs: ce_inputs,
        reference: |a| {
            let (loss, lse) = reference::cross_entropy(&a[0].to_f64_vec(), &labels_of(&a[1]), a[0].shape[1]);
            vec![loss, lse]
        },
    },
    LibraryKernel {
        name: "cross_entropy_with_grad",
        summary: "the training step's loss op: cross_entropy then cross_entropy_bwd with dloss = 1, giving per-token loss and the logit gradient; never holds the [t, v] probabilities",
        signature: "cross_entropy_with_grad(logits: [t, v], labels: i32[t]) -> (loss: f32[t], dlogits: [t, v])",
        inputs: CE_INPUTS,
        alt_shapes: &[&[300, 50257], &[300]],
        build: |t, target| {
            arity("cross_entropy_with_grad", t.len(), 2)?;
            Ok(vec![build_cross_entropy(&t[0], target)?, build_cross_entropy_bwd(&t[0], DType::F32, DType::F32, target)?])
        },
        run: |a, target| {
            arity("cross_entropy_with_grad", a.len(), 2)?;
            let (loss, lse) = cross_entropy(&a[0], &a[1], target)?;
            let ones = Array::from_f32(&[a[0].shape[0]], vec![1.0; a[0].shape[0]]);
            let dlogits = cross_entropy_bwd(&a[0], &a[1], &lse, &ones, target)?;
            Ok(vec![loss, dlogits])
        },
        random_inputs: ce_inputs,
        reference: |a| {
            let labels = labels_of(&a[1]);
            let v = a[0].shape[1];
            let logits = a[0].to_f64_vec();
            let (loss, _) = reference::cross_entropy(&logits, &labels, v);
            vec![loss, reference::cross_entropy_bwd(&logits, &labels, &vec![1.0; a[0].shape[0]], v)]
        },
    },
    LibraryKernel {
        name: "cross_entropy_bwd",
        summary: "gradient of cross_entropy: dlogits = (softmax - onehot(label)) * dloss by vocab tiles, softmax recomputed from lse",
        signature: "cross_entropy_bwd(logits: [t, v], labels: i32[t], lse: [t, 1], dloss: [t]) -> [t, v]",
        inputs: CE_BWD_INPUTS,
        alt_shapes: &[&[300, 50257], &[300], &[300, 1], &[300]],
        build: |t, target| {
            arity("cross_entropy_bwd", t.len(), 4)?;
            Ok(vec![build_cross_entropy_bwd(&t[0], t[2].dtype, t[3].dtype, target)?])
        },
        run: |a, target| {
            arity("cross_entropy_bwd", a.len(), 4)?;
            Ok(vec![cross_entropy_bwd(&a[0], &a[1], &a[2], &a[3], target)?])
        },
        random_inputs: ce_bwd_inputs,
        reference: |a| vec![reference::cross_entropy_bwd(&a[0].to_f64_vec(), &labels_of(&a[1]), &a[3].to_f64_vec(), a[0].shape[1])],
    },
    ROPE_INTERLEAVED,
    ROPE_INTERLEAVED_BWD,
];

fn labels_of(a: &Array) -> Vec<i64> {
    match &a.data {
        Data::I32(v) => v.iter().map(|&l| l as i64).collect(),
        _ => a.to_f64_vec().iter().map(|&l| l as i64).collect(),
    }
}

/// Independent f64 references: explicit rotation formulas with the trig evaluated
/// directly, explicit log-softmax. They share no code with the kernels or their host
/// tables.
pub mod reference {
    /// The two lanes of pair `i` of a head and the pair's frequency.
    fn pair(i: usize, dh: usize, theta: f64, interleaved: bool) -> (usize, usize, f64) {
        let freq = 1.0 / theta.powf((2 * i) as f64 / dh as f64);
        if interleaved { (2 * i, 2 * i + 1, freq) } else { (i, i + dh / 2, freq) }
    }

    /// RoPE of `x: [t, h, dh]`: each pair `(a, b)` rotated by `pos * theta^(-2i/dh)`:
    /// `(xa cos - xb sin, xb cos + xa sin)`.
    pub fn rope(x: &[f64], pos: &[f64], t: usize, h: usize, dh: usize, theta: f64, interleaved: bool) -> Vec<f64> {
        let mut out = vec![0.0; t * h * dh];
        for (tok, &p) in pos.iter().enumerate().take(t) {
            for head in 0..h {
                let base = (tok * h + head) * dh;
                for i in 0..dh / 2 {
                    let (a, b, freq) = pair(i, dh, theta, interleaved);
                    let (s, c) = (p * freq).sin_cos();
                    let (xa, xb) = (x[base + a], x[base + b]);
                    out[base + a] = xa * c - xb * s;
                    out[base + b] = xb * c + xa * s;
                }
            }
        }
        out
    }

    /// The transpose of [`rope`] applied to `dy`: a rotation is orthogonal, so its
    /// transpose is the rotation by minus the angle, i.e. RoPE at negated positions.
    pub fn rope_bwd(dy: &[f64], pos: &[f64], t: usize, h: usize, dh: usize, theta: f64, interleaved: bool) -> Vec<f64> {
        let neg: Vec<f64> = pos.iter().map(|p| -p).collect();
        rope(dy, &neg, t, h, dh, theta, interleaved)
    }

    fn log_softmax_row(row: &[f64]) -> (Vec<f64>, f64) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
        (row.iter().map(|z| z - lse).collect(), lse)
    }

    /// `(loss, lse)` per row of `logits: [t, v]`: `loss = -log_softmax(row)[label]`, 0 for
    /// labels outside `[0, v)`.
    pub fn cross_entropy(logits: &[f64], labels: &[i64], v: usize) -> (Vec<f64>, Vec<f64>) {
        let mut loss = Vec::new();
        let mut lses = Vec::new();
        for (row, &label) in logits.chunks(v).zip(labels) {
            let (logp, lse) = log_softmax_row(row);
            loss.push(if (0..v as i64).contains(&label) { -logp[label as usize] } else { 0.0 });
            lses.push(lse);
        }
        (loss, lses)
    }

    /// `d(sum(loss * dloss)) / dlogits = (softmax - onehot(label)) * dloss`, 0 for rows
    /// whose label is outside `[0, v)`.
    pub fn cross_entropy_bwd(logits: &[f64], labels: &[i64], dloss: &[f64], v: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(logits.len());
        for ((row, &label), &g) in logits.chunks(v).zip(labels).zip(dloss) {
            let (logp, _) = log_softmax_row(row);
            let valid = (0..v as i64).contains(&label);
            out.extend(logp.iter().enumerate().map(|(j, lp)| if valid { (lp.exp() - (j as i64 == label) as u8 as f64) * g } else { 0.0 }));
        }
        out
    }
}
