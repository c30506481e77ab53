//! Rotary position embeddings and fused cross-entropy, forward and backward.
//!
//! **RoPE.** The op takes `x: [t, h, dh]` and views it as `[t, h * dh]` (free, row-major):
//! heads sit side by side in the lanes. A grid step owns `tm` rows and one *chunk* of
//! `w` lanes holding whole heads, `w = lcm(dh, 128)` when that divides `h * dh` (so the
//! block is lane-aligned: `w = dh` for dh = 128 or 256, two heads for dh = 64), else the
//! whole row. The pair swap is two lane shifts through an f32 VMEM scratch (static-slice
//! stores and loads) and a select, `out = x * cos + swap(x) * sin` on the VPU: no MXU
//! work, exact, and each output reads only its own pair, so a NaN or inf of `x` reaches
//! exactly the two outputs torch's formula gives it (a matmul with a ±1 permutation, the
//! earlier form, spread it over the whole chunk through `0 * inf`). `cos`/`sin` are built
//! in the kernel from `position_ids` and a per-lane frequency table that depends on the
//! statics only ([`rope_freqs`]), once per row tile into VMEM scratch, so a call reads no
//! value back to the host.
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
use tessera_dsl::interp::{Array, Data};
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{host, result, single, Launch, Operand, Plan};

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
/// Pair members are `off` lanes apart (`dh / 2` rotate-half, 1 interleaved), the same for
/// every pair of the chunk, so the swap is two lane shifts by `off` through the f32
/// scratch `shift` (static-slice stores and loads; no MXU): lane `i` of `up` holds
/// `x[i + off]`, of `down` `x[i - off]`, and a select takes `-up` for a pair's first
/// member and `down` for its second. The `off` lanes a shift leaves stale are never
/// selected, and each output lane reads only its own pair, so a NaN or inf reaches
/// exactly the two outputs of its pair (as torch's `x * cos + rotate(x) * sin`); the
/// values are exact (no rounding before the final f32 multiply-add).
///
/// The angles come from `positions` (`[t, 1]` i32) and `freqs` ([`rope_freqs`]), built
/// into the `cos`/`sin` scratch at the first chunk of each row tile (the chunk axis is
/// `arbitrary`, so a row tile's chunks run in order on one core) and reused by the rest.
/// A position splits into three 11-bit chunks `c_k`, and the angle in turns is
/// `sum_k c_k * frac(2^(11k) * f)` with each `frac(..)` held as two 13-bit parts and a
/// remainder: every `c_k * part` is exact in f32, so its fraction is too, and only the
/// remainders' tiny products and the final sum round. The angle is reduced to one turn
/// before `cos`/`sin`, so it stays within ~1e-6 rad of the exact angle for any i32
/// position (a plain f32 `position * inv_freq` is ~1e-4 rad off in the thousands).
#[tpu_kernel(
    grid = [t.div_ceil(tm), n / w],
    semantics = [parallel, arbitrary],
    (x, out) = block([tm, w], |i, j| [i, j]),
    positions = block([tm, 1], |i, j| [i, 0]),
    freqs = block([9, w], |i, j| [0, 0]),
    (shift, cos, sin) = scratch([tm, w], f32),
)]
pub fn rope_kernel(x: In<t, n>, positions: In<t, 1>, freqs: In<9, w>, out: Out<t, n>, shift: Scratch, cos: Scratch, sin: Scratch, tm: usize, dh: usize, interleaved: bool, sign: f32) {
    if program_id(1) == 0 {
        let p = positions[..];
        let c0 = (p & 2047).cast(f32);
        let c1 = ((p >> 11) & 2047).cast(f32);
        let c2 = (p >> 22).cast(f32);
        // Exact products, so `frac` of each is exact.
        let a = c0 * freqs[(0..1, ..)];
        let b = c0 * freqs[(1..2, ..)];
        let turns = frac(a) + frac(b) + c0 * freqs[(2..3, ..)];
        let a = c1 * freqs[(3..4, ..)];
        let b = c1 * freqs[(4..5, ..)];
        let turns = turns + frac(a) + frac(b) + c1 * freqs[(5..6, ..)];
        let a = c2 * freqs[(6..7, ..)];
        let b = c2 * freqs[(7..8, ..)];
        let turns = turns + frac(a) + frac(b) + c2 * freqs[(8..9, ..)];
        // sin and cos of the angle by quadrant: `q` quarter turns plus `y` in [-pi/4, pi/4],
        // where Taylor polynomials to y^9 / y^8 are within 3e-8 (the generic sin/cos
        // lowering reduces any f32 argument and costs several times more).
        let q = (turns * 4.0).round();
        let y = (turns - q * 0.25) * std::f32::consts::TAU;
        let y2 = y * y;
        let s = y * (1.0 + y2 * (-1.0 / 6.0 + y2 * (1.0 / 120.0 + y2 * (-1.0 / 5040.0 + y2 * (1.0 / 362880.0)))));
        let c = 1.0 + y2 * (-0.5 + y2 * (1.0 / 24.0 + y2 * (-1.0 / 720.0 + y2 * (1.0 / 40320.0))));
        let quadrant = q.cast(i32) & 3;
        let odd = (quadrant & 1) == 1;
        let sin_sign = select(quadrant >= 2, -1.0, 1.0);
        let cos_sign = select((quadrant == 1) | (quadrant == 2), -1.0, 1.0);
        sin[..] = select(odd, c, s) * sin_sign;
        cos[..] = select(odd, s, c) * cos_sign;
    }
    let off = if interleaved { 1 } else { dh / 2 };
    // A lane's place in its pair, computed on one row and broadcast down the block.
    let lane = iota([1, w], 1);
    let first = if interleaved {
        (lane & 1).broadcast_to([tm, w]) == 0
    } else {
        // lane mod dh, with floor(lane / dh) through f32 (no vector integer division on
        // the VPU); exact since the +0.5 keeps the quotient 0.5/dh away from integers.
        let head = ((lane.cast(f32) + 0.5) * (1.0 / dh as f32)).cast(i32);
        (lane - head * (dh as i32)).broadcast_to([tm, w]) < (off as i32)
    };
    let v = x[..].cast(f32);
    shift[..] = v;
    let up_src = shift[(.., off..w)];
    let down_src = shift[(.., 0..(w - off))];
    shift[(.., 0..(w - off))] = up_src;
    let up = shift[..];
    shift[(.., off..w)] = down_src;
    let down = shift[..];
    // (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin); the transpose flips the signs.
    let swapped = if sign > 0.0 { select(first, -up, down) } else { select(first, up, -down) };
    out[..] = (v * cos[..] + swapped * sin[..]).cast(out.dtype);
}

/// `x - trunc(x)`: the fraction of an f32 below 2^31 in magnitude, exact.
#[tpu_fn]
fn frac(x: Value) -> Value {
    x - x.cast(i32).cast(f32)
}

/// The per-lane frequency table of [`rope_kernel`], `[9, w]` f32: row `3k + i` holds part
/// `i` of `frac(2^(11k) * f)` for lane `c`'s frequency in turns, `f = theta^(-2 pair /
/// dh) / 2 pi` (`pair` of lane `c mod dh`). Parts 0 and 1 have 13 significant bits (their
/// products with an 11-bit position chunk are exact in f32), part 2 is the f32 rest. It
/// depends on the statics alone: no input value is read to build it.
pub fn rope_freqs(dh: usize, w: usize, theta: f64, interleaved: bool) -> Array {
    // `x` rounded to 13 significant bits (exact in f32).
    let head = |x: f64| {
        if x == 0.0 {
            return 0.0;
        }
        let q = 2f64.powi(x.abs().log2().floor() as i32 - 12);
        (x / q).round() * q
    };
    let mut rows = vec![0f32; 9 * w];
    for c in 0..w {
        let lane = c % dh;
        let pair = if interleaved { lane / 2 } else { lane % (dh / 2) };
        let turns = theta.powf(-2.0 * pair as f64 / dh as f64) / std::f64::consts::TAU;
        for k in 0..3 {
            let scaled = turns * 2f64.powi(11 * k as i32);
            let g = scaled - scaled.floor();
            let h0 = head(g);
            let h1 = head(g - h0);
            for (i, part) in [h0, h1, g - h0 - h1].into_iter().enumerate() {
                rows[(3 * k + i) * w + c] = part as f32;
            }
        }
    }
    Array::from_f32(&[9, w], rows)
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

/// `(t, h, dh)` of a RoPE input (argument `name`: `x`, or `dy` of the backward), checked.
fn rope_dims(op: &str, name: &str, x: &Type) -> Result<(usize, usize, usize), KernelError> {
    match x.shape[..] {
        [t, h, dh] if t > 0 && h > 0 && dh >= 2 && dh % 2 == 0 => Ok((t, h, dh)),
        _ => Err(shape_err(op, &format!("input `{name}`"), format!("{name} has shape {:?}", x.shape), &format!("pass {name} as [tokens, heads, head_dim] with an even head_dim"))),
    }
}

/// The RoPE kernel for an op input `x: [t, h, dh]` on `target` (default blocks); it takes
/// `x` viewed as `[t, h * dh]`, the positions as an i32 column `[t, 1]` and the table
/// [`rope_freqs`] `[9, rope_chunk(h * dh, dh)]`.
pub fn build_rope(x: &Type, interleaved: bool, backward: bool, target: &Target) -> Result<Kernel, KernelError> {
    let (op, name) = if backward { ("rope_bwd", "dy") } else { ("rope", "x") };
    let (t, h, dh) = rope_dims(op, name, x)?;
    if !x.dtype.is_float() {
        return Err(KernelError::new(op, format!("input `{name}`"), "operand-dtype", format!("{name} is {}", x.dtype), "RoPE takes f32 or bf16 activations"));
    }
    let n = h * dh;
    let w = rope_chunk(n, dh);
    let flat = Type::vector(x.dtype, &[t, n]);
    let sign = if backward { -1.0 } else { 1.0 };
    rope_kernel(flat.clone(), Type::vector(DType::I32, &[t, 1]), Type::vector(DType::F32, &[9, w]), flat, rope_rows(t, w, x.dtype, target), dh, interleaved, sign)
}

/// RoPE: `x: [t, h, dh]` (f32 or bf16) rotated by the angles of `positions: i32[t]`
/// with base `theta`; rotate-half unless `interleaved`.
pub fn rope(exec: &dyn Executor, x: &Array, positions: &Array, theta: f64, interleaved: bool, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "rope", &[x, positions], &format!("theta={theta:?}, interleaved={}", if interleaved { "True" } else { "False" }), target)
}

/// The gradient of [`rope`] with respect to `x`, given `dy` (the inverse rotation).
pub fn rope_bwd(exec: &dyn Executor, dy: &Array, positions: &Array, theta: f64, interleaved: bool, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "rope_bwd", &[dy, positions], &format!("theta={theta:?}, interleaved={}", if interleaved { "True" } else { "False" }), target)
}

// ---- cross-entropy ---------------------------------------------------------------------

/// Forward: `loss = lse - logits[label]` per row, `lse = logsumexp(logits)`, by
/// `[tm, tv]` tiles with the vocab axis last and `arbitrary`.
#[tpu_kernel(
    grid = [t.div_ceil(tm), vocab.div_ceil(tv)],
    semantics = [parallel, arbitrary],
    logits = block([tm, tv], |i, j| [i, j]),
    (labels, loss, lse) = block([tm, 1], |i, j| [i, 0]),
    (m_run, s_run, picked) = scratch([tm, 1], f32),
)]
pub fn cross_entropy_kernel(logits: In<t, vocab>, labels: In<t, 1>, loss: Out<t, 1>, lse: Out<t, 1>, m_run: Scratch, s_run: Scratch, picked: Scratch, tm: usize, tv: usize, ignore_index: i32) {
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
        // With a +inf logit l is NaN (exp(inf - inf)), as torch's log_softmax and so the
        // loss; torch's logsumexp is +inf there.
        let m = m_run[..];
        let l = m + s_run[..].log();
        lse[..] = select(m == f32::INFINITY, f32::INFINITY, l);
        // The host checks labels are in [0, vocab) or ignore_index; the range test also
        // keeps a bad label that reached the kernel from picking a garbage column.
        let valid = (label != ignore_index) & (label >= 0) & (label < (vocab as i32));
        loss[..] = select(valid, l - picked[..], 0.0);
    }
}

/// Backward: `dlogits = (exp(logits - lse) - onehot(label)) * dloss`, each `[tm, tv]`
/// tile independent (both grid axes `parallel`).
#[tpu_kernel(
    grid = [t.div_ceil(tm), vocab.div_ceil(tv)],
    semantics = [parallel, parallel],
    (logits, dlogits) = block([tm, tv], |i, j| [i, j]),
    (labels, lse, dloss) = block([tm, 1], |i, j| [i, 0]),
)]
pub fn cross_entropy_bwd_kernel(logits: In<t, vocab>, labels: In<t, 1>, lse: In<t, 1>, dloss: In<t, 1>, dlogits: Out<t, vocab>, tm: usize, tv: usize, ignore_index: i32) {
    // No column mask: columns past the vocabulary are garbage but their writes are dropped.
    let col = iota([tm, tv], 1) + program_id(1) * (tv as i32);
    let label = labels[..];
    // The forward's lse is +inf where a logit is: the row's softmax is NaN (torch's).
    let lse_row = lse[..].cast(f32);
    let p = (logits[..].cast(f32) - select(lse_row == f32::INFINITY, f32::NAN, lse_row)).exp();
    let onehot = select(col == label, 1.0, 0.0);
    let valid = (label != ignore_index) & (label >= 0) & (label < (vocab as i32));
    // An ignored row's gradient is softmax * 0, as torch computes it (NaN with a NaN row).
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
pub fn build_cross_entropy(logits: &Type, ignore_index: i32, target: &Target) -> Result<Kernel, KernelError> {
    let (t, v) = ce_dims("cross_entropy", logits)?;
    let (tm, tv) = cross_entropy_blocks(t, v, logits.dtype, target);
    let col = |d| Type::vector(d, &[t, 1]);
    cross_entropy_kernel(logits.clone(), col(DType::I32), col(DType::F32), col(DType::F32), tm, tv, ignore_index)
}

/// The cross-entropy backward kernel: `lse` and `dloss` are `[t, 1]` of any float dtype
/// (f32 as the forward returns them); `dlogits` has the logits' dtype.
pub fn build_cross_entropy_bwd(logits: &Type, lse_dtype: DType, dloss_dtype: DType, ignore_index: i32, target: &Target) -> Result<Kernel, KernelError> {
    let (t, v) = ce_dims("cross_entropy_bwd", logits)?;
    let (tm, tv) = cross_entropy_blocks(t, v, logits.dtype, target);
    let col = |d| Type::vector(d, &[t, 1]);
    cross_entropy_bwd_kernel(logits.clone(), col(DType::I32), col(lse_dtype), col(dloss_dtype), logits.clone(), tm, tv, ignore_index)
}

/// Cross-entropy: `(loss [t], lse [t])`, both f32, for `logits: [t, v]` and
/// `labels: i32[t]`.
pub fn cross_entropy(exec: &dyn Executor, logits: &Array, labels: &Array, target: &Target) -> Result<(Array, Array), KernelError> {
    let mut out = crate::run(exec, "cross_entropy", &[logits, labels], "", target)?.into_iter();
    let (loss, lse) = (out.next(), out.next());
    loss.zip(lse).ok_or_else(|| KernelError::new("cross_entropy", "outputs", "output-count", "expected 2 results", "report this as a library bug"))
}

/// The gradient of `sum(cross_entropy(logits, labels).loss * dloss)` with respect to the
/// logits, given the forward's `lse`; `dlogits` has the logits' dtype.
pub fn cross_entropy_bwd(exec: &dyn Executor, logits: &Array, labels: &Array, lse: &Array, dloss: &Array, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "cross_entropy_bwd", &[logits, labels, lse, dloss], "", target)
}

// ---- ops ------------------------------------------------------------------------------------

/// x (`dy`) is `[t, h, dh]` and position_ids `[t]` int32 (the op's contract, checked).
fn plan_rope(c: &Call) -> Result<Plan, KernelError> {
    let backward = c.op == "rope_bwd";
    let name = if backward { "dy" } else { "x" };
    let x = c.tensor(name)?.clone();
    let interleaved = c.statics.bool("interleaved");
    let kernel = build_rope(&x, interleaved, backward, c.target)?;
    let (t, h, dh) = (x.shape[0], x.shape[1], x.shape[2]);
    let w = rope_chunk(h * dh, dh);
    let args = vec![c.input(name, Type::vector(x.dtype, &[t, h * dh]))?, column(c, "position_ids", t)?, host(0, Type::vector(DType::F32, &[9, w]))];
    let theta = c.statics.f64("theta").unwrap_or(ROPE_THETA);
    // The frequencies are theta^(-2i/dh): a base of 0 or below makes them infinite or NaN
    // (and every output with them); a NaN or infinite one is no base at all.
    if !(theta > 0.0 && theta.is_finite()) {
        return Err(c.err("argument `theta`", "option-value", format!("theta = {theta}: the rotary base must be a finite positive number"), format!("pass a finite positive theta (default {ROPE_THETA})")));
    }
    Ok(single(c, kernel, args, &[Some(x.shape.clone())]).with_host(vec![rope_freqs(dh, w, theta, interleaved)]))
}

/// Tensor input `name` (`[t]`, or `[t, 1]` where its dims allow) as a `[t, 1]` column.
fn column(c: &Call, name: &str, t: usize) -> Result<Operand, KernelError> {
    c.input(name, Type::vector(c.tensor(name)?.dtype, &[t, 1]))
}

fn logits_rows(c: &Call) -> Result<(Type, usize), KernelError> {
    let logits = c.tensor("logits")?.clone();
    ce_dims(c.op, &logits)?;
    let t = logits.shape[0];
    Ok((logits, t))
}

/// `ignore_index` as the kernels' i32 (torch's default, -100).
fn ignore_index(c: &Call) -> Result<i32, KernelError> {
    let v = c.statics.i64("ignore_index").unwrap_or(-100);
    i32::try_from(v).map_err(|_| c.err("argument `ignore_index`", "option-value", format!("ignore_index = {v}"), "pass an ignore_index in the int32 range"))
}

/// The plan's check that every label is a class of the `v`-column logits or `ignore`
/// (torch's cross_entropy contract: other labels are an error, not a loss of 0).
fn labels_check(c: &Call, plan: Plan, v: usize, ignore: i32) -> Result<Plan, KernelError> {
    let op = c.op;
    let check: crate::plan::CheckFn = Box::new(move |a| {
        let labels = a[0].as_i32().unwrap_or(&[]);
        match labels.iter().enumerate().find(|(_, &l)| l != ignore && !(0..v as i64).contains(&(l as i64))) {
            Some((row, &l)) => Err(KernelError::new(op, "input `labels`", "label-range", format!("row {row} has label {l}, but the logits have {v} classes"), format!("pass labels in [0, {v}), or {ignore} (ignore_index) for rows to ignore"))),
            None => Ok(()),
        }
    });
    Ok(plan.with_check(&[c.index("labels")?], check))
}

fn plan_cross_entropy(c: &Call) -> Result<Plan, KernelError> {
    let (logits, t) = logits_rows(c)?;
    let (v, ignore) = (logits.shape[1], ignore_index(c)?);
    let kernel = build_cross_entropy(&logits, ignore, c.target)?;
    let args = vec![c.input("logits", logits)?, column(c, "labels", t)?];
    labels_check(c, single(c, kernel, args, &[Some(vec![t]), Some(vec![t])]), v, ignore)
}

fn plan_cross_entropy_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (logits, t) = logits_rows(c)?;
    let (labels, lse, dloss) = (column(c, "labels", t)?, column(c, "lse", t)?, column(c, "dloss", t)?);
    let (v, ignore) = (logits.shape[1], ignore_index(c)?);
    let kernel = build_cross_entropy_bwd(&logits, lse.ty.dtype, dloss.ty.dtype, ignore, c.target)?;
    labels_check(c, single(c, kernel, vec![c.input("logits", logits)?, labels, lse, dloss], &[]), v, ignore)
}

fn plan_cross_entropy_with_grad(c: &Call) -> Result<Plan, KernelError> {
    let (logits, t) = logits_rows(c)?;
    let (v, ignore) = (logits.shape[1], ignore_index(c)?);
    let forward = build_cross_entropy(&logits, ignore, c.target)?;
    let labels = column(c, "labels", t)?;
    let col = Type::vector(DType::F32, &[t, 1]);
    let backward = build_cross_entropy_bwd(&logits, DType::F32, DType::F32, ignore, c.target)?;
    let launches = vec![
        Launch::new(forward, vec![c.input("logits", logits.clone())?, labels.clone()]),
        Launch::new(backward, vec![c.input("logits", logits.clone())?, labels, result(0, 1, col.clone()), host(0, col)]),
    ];
    let results = vec![result(0, 0, Type::vector(DType::F32, &[t])), result(1, 0, logits)];
    let plan = Plan::new(c.op, c.target, launches, results).with_host(vec![Array::from_f32(&[t, 1], vec![1.0; t])]);
    labels_check(c, plan, v, ignore)
}

/// x in [-1, 1) and positions drawn from [0, 8192) in no particular order.
fn rope_inputs(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let (xs, ts) = (&shapes[0], shapes[1][0]);
    let x = Array::from_f32_in(dtype, xs, harness::uniform(xs.iter().product(), 1.0, rng));
    let pos = Array::from_i32(&[ts], (0..ts).map(|_| rng.gen_range(0..8192)).collect());
    vec![x, pos]
}

fn ref_rope(a: &[Array], s: &Statics, backward: bool) -> Vec<Vec<f64>> {
    let (t, h, dh) = (a[0].shape[0], a[0].shape[1], a[0].shape[2]);
    let pos = a[1].to_f64_vec();
    let f = if backward { reference::rope_bwd } else { reference::rope };
    vec![f(&a[0].to_f64_vec(), &pos, t, h, dh, s.f64("theta").unwrap_or(ROPE_THETA), s.bool("interleaved"))]
}

/// Logits in [-4, 4) (a spread that exercises the max subtraction), labels in [0, v) with
/// every 7th row `ignore_index`.
fn ce_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let (t, v) = (shapes[0][0], shapes[0][1]);
    let ignore = s.i64("ignore_index").unwrap_or(-100) as i32;
    let logits = Array::from_f32_in(dtype, &[t, v], harness::uniform(t * v, 4.0, rng));
    let labels = Array::from_i32(&[t], (0..t).map(|r| if r % 7 == 3 { ignore } else { rng.gen_range(0..v as i32) }).collect());
    vec![logits, labels]
}

/// [`ce_inputs`] plus the forward's `lse` (exact, rounded to `dtype`) and a random `dloss`.
fn ce_bwd_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let mut a = ce_inputs(shapes, dtype, s, rng);
    let (t, v) = (shapes[0][0], shapes[0][1]);
    let x = a[0].to_f64_vec();
    let lse = x
        .chunks(v)
        .map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            (m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln()) as f32
        })
        .collect();
    a.push(Array::from_f32_in(dtype, &shapes[2], lse));
    a.push(Array::from_f32_in(dtype, &[t], harness::uniform(t, 1.0, rng)));
    a
}

fn ref_cross_entropy(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let (loss, lse) = reference::cross_entropy(&a[0].to_f64_vec(), &labels_of(&a[1], s), a[0].shape[1]);
    vec![loss, lse]
}

fn ref_cross_entropy_bwd(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    vec![reference::cross_entropy_bwd(&a[0].to_f64_vec(), &labels_of(&a[1], s), &a[3].to_f64_vec(), a[0].shape[1])]
}

fn ref_cross_entropy_with_grad(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let labels = labels_of(&a[1], s);
    let v = a[0].shape[1];
    let logits = a[0].to_f64_vec();
    let (loss, _) = reference::cross_entropy(&logits, &labels, v);
    vec![loss, reference::cross_entropy_bwd(&logits, &labels, &vec![1.0; a[0].shape[0]], v)]
}

/// The labels for the references, which ignore any label outside `[0, v)`: rows labelled
/// `ignore_index` become -1.
fn labels_of(a: &Array, s: &Statics) -> Vec<i64> {
    let ignore = s.i64("ignore_index").unwrap_or(-100);
    let labels: Vec<i64> = match &a.data {
        Data::I32(v) => v.iter().map(|&l| l as i64).collect(),
        _ => a.to_f64_vec().iter().map(|&l| l as i64).collect(),
    };
    labels.into_iter().map(|l| if l == ignore { -1 } else { l }).collect()
}

const POSITIONS: Input = Input { name: "position_ids", dims: "[t]", kind: Kind::Int32 };
/// Default, dh = 64 with more rows than one block (the last partial), and both interleaved.
const ROPE_CASES: &[Case] = &[
    Case { name: "default", statics: "", shapes: &[&[1024, 8, 128], &[1024]] },
    Case { name: "alt", statics: "", shapes: &[&[4100, 6, 64], &[4100]] },
    Case { name: "interleaved", statics: "interleaved=True", shapes: &[&[1024, 8, 128], &[1024]] },
    Case { name: "interleaved_alt", statics: "interleaved=True", shapes: &[&[4100, 6, 64], &[4100]] },
];
const LOGITS: Input = Input { name: "logits", dims: "[t, v]", kind: Kind::Float };
const LABELS: Input = Input { name: "labels", dims: "[t]", kind: Kind::Int32 };
/// A GPT-2-sized vocabulary (not a multiple of the tile) and a partial row tile.
const CE_CASES: &[Case] = &[Case { name: "default", statics: "", shapes: &[&[512, 32000], &[512]] }, Case { name: "alt", statics: "ignore_index=0", shapes: &[&[300, 50257], &[300]] }];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "rope", doc: "rotary embedding of x [tokens, heads, head_dim] at integer position_ids [tokens]: rotate-half (GPT-NeoX/Llama) pairs (i, i+dh/2), or interleaved (GPT-J) pairs (2i, 2i+1); pair swap by lane shifts (VPU; a NaN stays in its pair)", schema: "(Tensor x, Tensor position_ids, float theta=10000.0, bool interleaved=False) -> Tensor", plan: plan_rope, reference: Some(|a, s| ref_rope(a, s, false)),
        inputs: &[Input { name: "x", dims: "[t, h, dh]", kind: Kind::Float }, POSITIONS], outputs: &[Output { name: "out", shape: "x", dtype: "x" }],
        backward: Some(Backward { op: "rope_bwd", args: "d_out, position_ids, theta, interleaved", grads: &["x"] }),
        cases: ROPE_CASES, random: Some(rope_inputs), ..Op::EMPTY
    },
    Op {
        name: "rope_bwd", doc: "gradient of rope: the inverse rotation (rope at minus the angles)", schema: "(Tensor dy, Tensor position_ids, float theta=10000.0, bool interleaved=False) -> Tensor", plan: plan_rope, reference: Some(|a, s| ref_rope(a, s, true)),
        inputs: &[Input { name: "dy", dims: "[t, h, dh]", kind: Kind::Float }, POSITIONS], outputs: &[Output { name: "dx", shape: "dy", dtype: "dy" }],
        cases: ROPE_CASES, random: Some(rope_inputs), ..Op::EMPTY
    },
    Op {
        name: "cross_entropy", doc: "(loss [t], lse [t]) in float32 for logits [t, v] and int32 labels [t]: online logsumexp over vocab tiles in f32 scratch, the label's logit by an iota mask; the [t, v] probabilities never exist", schema: "(Tensor logits, Tensor labels, int ignore_index=-100) -> (Tensor, Tensor)", plan: plan_cross_entropy, reference: Some(ref_cross_entropy),
        inputs: &[LOGITS, LABELS], outputs: &[Output { name: "loss", shape: "[logits.0]", dtype: "f32" }, Output { name: "lse", shape: "[logits.0]", dtype: "f32" }],
        backward: Some(Backward { op: "cross_entropy_bwd", args: "logits, labels, lse, d_loss, ignore_index", grads: &["logits"] }),
        cases: CE_CASES, random: Some(ce_inputs), ..Op::EMPTY
    },
    Op {
        name: "cross_entropy_bwd", doc: "dlogits = (softmax - onehot(label)) * dloss by vocab tiles, the softmax recomputed from lse", schema: "(Tensor logits, Tensor labels, Tensor lse, Tensor dloss, int ignore_index=-100) -> Tensor", plan: plan_cross_entropy_bwd, reference: Some(ref_cross_entropy_bwd),
        inputs: &[LOGITS, LABELS, Input { name: "lse", dims: "[t, 1?]", kind: Kind::Float }, Input { name: "dloss", dims: "[t]", kind: Kind::Float }], outputs: &[Output { name: "dlogits", shape: "logits", dtype: "logits" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[512, 32000], &[512], &[512], &[512]] }, Case { name: "alt", statics: "", shapes: &[&[300, 50257], &[300], &[300, 1], &[300]] }], random: Some(ce_bwd_inputs), ..Op::EMPTY
    },
    Op {
        name: "cross_entropy_with_grad", doc: "(loss, dlogits of sum(loss)): the training step's loss op, cross_entropy then cross_entropy_bwd with dloss = 1; never holds the [t, v] probabilities", schema: "(Tensor logits, Tensor labels, int ignore_index=-100) -> (Tensor, Tensor)", plan: plan_cross_entropy_with_grad, reference: Some(ref_cross_entropy_with_grad),
        inputs: &[LOGITS, LABELS], outputs: &[Output { name: "loss", shape: "[logits.0]", dtype: "f32" }, Output { name: "dlogits", shape: "logits", dtype: "logits" }],
        cases: CE_CASES, random: Some(ce_inputs), ..Op::EMPTY
    },
];

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

    /// `(log_softmax(row), logsumexp(row))` as torch computes them: the log-softmax
    /// shifted by the max (NaN throughout with a NaN or a +inf logit, or with all -inf),
    /// the logsumexp NaN with a NaN, +inf with a +inf, -inf over all -inf.
    fn log_softmax_row(row: &[f64]) -> (Vec<f64>, f64) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let shifted = (row.iter().map(|z| (z - m).exp()).sum::<f64>()).ln();
        let logp = row.iter().map(|z| z - m - shifted).collect();
        let lse = if row.iter().any(|z| z.is_nan()) { f64::NAN } else if m.is_infinite() { m } else { m + shifted };
        (logp, lse)
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

    /// `d(sum(loss * dloss)) / dlogits = (softmax - onehot(label)) * dloss`; a row whose
    /// label is outside `[0, v)` gets `softmax * 0` (torch's arithmetic: 0, or NaN where
    /// the softmax is).
    pub fn cross_entropy_bwd(logits: &[f64], labels: &[i64], dloss: &[f64], v: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(logits.len());
        for ((row, &label), &g) in logits.chunks(v).zip(labels).zip(dloss) {
            let (logp, _) = log_softmax_row(row);
            let g = if (0..v as i64).contains(&label) { g } else { 0.0 };
            out.extend(logp.iter().enumerate().map(|(j, lp)| (lp.exp() - (j as i64 == label) as u8 as f64) * g));
        }
        out
    }
}
