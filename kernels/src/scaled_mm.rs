//! Blockwise-scaled fp8 matmul, the DeepSeek-V3 / TorchTPU recipe ("1x128 activations,
//! 128x128 weights"), its two backward forms and the 1x128 / 128x1 quantizers.
//!
//! **The recipe, as TorchTPU 0.2.0 defines it** (its Pallas kernel
//! `torch_tpu/_internal/ops/scaled_mm/kernels/blockwise128_scaled_mm_kernel.py`,
//! `scaled_mm_1x128_128x128(a, b, scale_a, scale_b, *, out_dtype=bfloat16, ...)`): `a [M, K]`
//! fp8 with `scale_a [M, K/128]` (one f32 scale per row per 128-wide K block), `b [K, N]`
//! fp8 stored K-major with `scale_b [K/128, ceil(N/128)]` (one per 128x128 tile), and
//! `out[m, n] = sum_kb scale_a[m, kb] * scale_b[kb, n/128] * sum_{k in kb} a[m, k] b[k, n]`
//! accumulated in f32, bf16 out. The scales are **dequantization** factors (multiplied in,
//! not reciprocals); torchao's `blockwise_fp8_training` passes `1 / x_scale` of its
//! quantizer to its GEMM for the same reason. TorchTPU's op requires `K % 128 == 0` (its
//! only shape precondition; M and N are free) and so does Tessera: a K that is not a
//! multiple of 128 is refused (`operand-shape`, naming the operand) rather than padded.
//! M and N edges are partial blocks (rows and columns past the edge are dropped).
//!
//! **Backward** (TorchTPU lists both as TBD; the forms are DeepSeek-V3's and torchao's
//! `Float8BlockwiseLinear`): with `out = a @ b`,
//!
//! - `dA = dOut @ B^T` (dgrad) is the forward recipe again: `dOut` quantized 1x128 along
//!   N ([`quantize_fp8_1x128`]), `B^T`'s 128x128 scales are `scale_b^T`: `scaled_mm_blockwise`
//!   with `transpose_rhs` reads `b [K, N]` in place as `B^T` and `scale_b` as
//!   `[K/128, N/128]` (here N is the contraction, so `N % 128 == 0`);
//! - `dB = A^T @ dOut` (wgrad, `scaled_mm_blockwise_wgrad`) contracts over M, so both
//!   operands are quantized 128x1 (one scale per column per 128-row block:
//!   [`quantize_fp8_128x1`], DeepSeek-V3's "1x128 tiles converted to 128x1 for the
//!   backward"); `M % 128 == 0`.
//!
//! The quantizers use DeepSeek-V3's / torchao's amax scaling: per block
//! `scale = max(amax(|x|), 1e-12) / 448` and `q = (x / scale).to(float8_e4m3fn)` (448 is
//! e4m3fn's largest finite value), so `q * scale` dequantizes; a NaN in a block makes its
//! scale and every `q` of the block NaN (as torch's `amax` and division do).
//!
//! **No autograd.** The ops declare no backward: their data inputs are fp8, and torch
//! casts a gradient to its input's dtype, so a gradient into `a` would be rounded to fp8.
//! The recipe's backward is these ops called explicitly (the training test in
//! `tests/tests/scaled_mm.rs` and `tests/python/test_compat_torch_tpu.py`).
//!
//! **Nonfinite values.** NaN in an operand or a scale propagates as torch's
//! dequantize-first product does (the row, the column, the tile's columns). An infinite
//! scale gives TorchTPU's factored product (its kernel computes `dot * sa * sb` per block:
//! `inf` unless the block's sum is 0), where dequantizing first in torch gives NaN from any
//! `0 * inf` term; the references here follow TorchTPU. The quantizers never produce an
//! infinite scale from finite data.
//!
//! **fp8 on the MXU.** Both formats (`float8_e4m3fn`, `float8_e5m2`, also mixed) are
//! multiplied natively on tpu7x; on v5e/v5p/v6e, whose MXUs have no fp8 mode, the blocks
//! are up-converted to bf16 in VMEM first (exact: every fp8 value is a bf16 value), so the
//! verifier gives no `matmul-emulated` warning. f32 and bf16 operands are also accepted
//! (one dtype for both), for runs of the op table at those dtypes.
//!
//! **Blocks.** `[bm, bn]` output blocks up to 512 x 512 and K steps of up to 1024, each
//! step a loop over its 128-wide K sub-blocks: sub-product `dot(a_t, b_t)` times the row
//! scales `[bm, 1]` (picked from the `[bm, K/128]` scale block with a select and a sum)
//! times the tile-scale row `[1, bn]` (each 128-column tile's entry picked from the whole
//! `scale_b` array in VMEM likewise; all exact: the other entries are replaced by 0, so a
//! NaN elsewhere stays out). The wgrad kernel tiles `[bk, bn]` up to 512 and steps M by up
//! to 512 rows, a loop over their 128-row blocks.

use rand::{rngs::StdRng, Rng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::op::{Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{single, Plan};

/// The scale block: 128 elements of K (or of M for the 128x1 forms).
pub const BLOCK: usize = 128;
/// e4m3fn's largest finite value: the quantizers map each block's amax to it.
pub const E4M3_MAX: f32 = 448.0;
/// The amax floor of an all-zero block (torchao's and DeepSeek-V3's `EPS`).
pub const AMAX_EPS: f32 = 1e-12;

#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn), k / bk],
    semantics = [parallel, parallel, arbitrary],
    a = block([bm, bk], |i, j, kk| [i, kk]),
    b = block([if transpose_rhs { bn } else { bk }, if transpose_rhs { bk } else { bn }], |i, j, kk| [if transpose_rhs { j } else { kk }, if transpose_rhs { kk } else { j }]),
    scale_a = block([bm, kb], |i, j, kk| [i, 0]),
    scale_b = block([sb0, sb1], |i, j, kk| [0, 0]),
    out = block([bm, bn], |i, j, kk| [i, j]),
    acc = scratch([bm, bn], f32),
)]
#[rustfmt::skip]
pub fn scaled_mm_blockwise_kernel(
    a: In<m, k>, b: In<_, _>, scale_a: In<m, kb>, scale_b: In<sb0, sb1>, out: Out<m, n>, acc: Scratch,
    bm: usize, bn: usize, bk: usize, transpose_rhs: bool, up: bool,
) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, bn], f32);
    }
    let r = iota([sb0, sb1], 0);
    let c = iota([sb0, sb1], 1);
    let lane = iota([1, bn], 1);
    // The 128-wide K sub-blocks of this step, one scale column of `scale_a` and one row of
    // tile scales each.
    for t in 0..bk / 128 {
        let kbi = program_id(2) * (bk / 128) + t;
        let mut x = a[(.., ds(t * 128, 128))];
        if up {
            x = x.cast(bf16);
        }
        // Row scales [bm, 1]: picked by a select (the rest 0, so a NaN elsewhere stays out)
        // and a sum; the tile scales [1, bn]: each 128-column tile's entry likewise.
        let sa = select(iota([bm, kb], 1) == kbi, scale_a[..], 0.0).sum(1);
        let mut sb = zeros([1, bn], f32);
        for u in 0..bn.div_ceil(128) {
            let nbi = program_id(1) * bn.div_ceil(128) + u;
            let mut hit = (r == kbi) & (c == nbi);
            if transpose_rhs {
                hit = (r == nbi) & (c == kbi);
            }
            let v = select(hit, scale_b[..], 0.0).sum(1).sum(0);
            sb = select((lane >= u * 128) & (lane < u * 128 + 128), v, sb);
        }
        if transpose_rhs {
            let mut y = b[(.., ds(t * 128, 128))];
            if up {
                y = y.cast(bf16);
            }
            acc[..] += dot_t(x, y) * sa * sb;
        } else {
            let mut y = b[(ds(t * 128, 128), ..)];
            if up {
                y = y.cast(bf16);
            }
            acc[..] += dot(x, y) * sa * sb;
        }
    }
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

/// `dB = A^T @ G` with both operands' 128x1 scales (`scale_a [M/128, K]`, `scale_g
/// [M/128, N]`): the product of M block `mb` is scaled by the outer product of the two
/// scale rows, `scale_a[mb, :]^T scale_g[mb, :]`. Each grid step takes `bm` rows of M (a
/// loop over its 128-row sub-blocks).
#[tpu_kernel(
    grid = [k.div_ceil(bk), n.div_ceil(bn), m / bm],
    semantics = [parallel, parallel, arbitrary],
    a = block([bm, bk], |i, j, mm| [mm, i]),
    g = block([bm, bn], |i, j, mm| [mm, j]),
    scale_a = block([mb, bk], |i, j, mm| [0, i]),
    scale_g = block([mb, bn], |i, j, mm| [0, j]),
    out = block([bk, bn], |i, j, mm| [i, j]),
    acc = scratch([bk, bn], f32),
)]
#[rustfmt::skip]
pub fn scaled_mm_blockwise_wgrad_kernel(
    a: In<m, k>, g: In<m, n>, scale_a: In<mb, k>, scale_g: In<mb, n>, out: Out<k, n>, acc: Scratch,
    bm: usize, bk: usize, bn: usize, up: bool,
) {
    if program_id(2) == 0 {
        acc[..] = zeros([bk, bn], f32);
    }
    for t in 0..bm / 128 {
        let mbi = program_id(2) * (bm / 128) + t;
        let mut x = a[(ds(t * 128, 128), ..)];
        let mut y = g[(ds(t * 128, 128), ..)];
        if up {
            x = x.cast(bf16);
            y = y.cast(bf16);
        }
        let sa = select(iota([mb, bk], 0) == mbi, scale_a[..], 0.0).sum(0);
        let sg = select(iota([mb, bn], 0) == mbi, scale_g[..], 0.0).sum(0);
        acc[..] += dot_tn(x, y) * sa.t() * sg;
    }
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

/// 1x128 quantization: per row and 128-wide block of the last dim,
/// `scale = max(amax, 1e-12) / 448`, `q = (x / scale).to(e4m3fn)`. The scale block is the
/// whole `[bm, K/128]` row block, kept in VMEM across the (arbitrary) K axis, one column
/// written per step.
#[tpu_kernel(
    grid = [m.div_ceil(bm), k / 128],
    semantics = [parallel, arbitrary],
    x = block([bm, 128], |i, kk| [i, kk]),
    q = block([bm, 128], |i, kk| [i, kk]),
    scale = block([bm, kb], |i, kk| [i, 0]),
)]
pub fn quantize_fp8_1x128_kernel(x: In<m, k>, q: Out<m, k>, scale: Out<m, kb>, bm: usize) {
    let v = x[..].cast(f32);
    let s = v.abs().reduce_max(1).max(1e-12) / 448.0;
    q[..] = (v / s).cast(q.dtype);
    let col = iota([bm, kb], 1) == program_id(1);
    if program_id(1) == 0 {
        scale[..] = select(col, s.broadcast_to([bm, kb]), 0.0);
    } else {
        scale[..] = select(col, s.broadcast_to([bm, kb]), scale[..]);
    }
}

/// 128x1 quantization: per column and 128-row block, the same scaling; the scale block is
/// the whole `[M/128, bn]` column block, one row written per (arbitrary) M step.
#[tpu_kernel(
    grid = [n.div_ceil(bn), m / 128],
    semantics = [parallel, arbitrary],
    x = block([128, bn], |j, mm| [mm, j]),
    q = block([128, bn], |j, mm| [mm, j]),
    scale = block([mb, bn], |j, mm| [0, j]),
)]
pub fn quantize_fp8_128x1_kernel(x: In<m, n>, q: Out<m, n>, scale: Out<mb, n>, bn: usize) {
    let v = x[..].cast(f32);
    let s = v.abs().reduce_max(0).max(1e-12) / 448.0;
    q[..] = (v / s).cast(q.dtype);
    let row = iota([mb, bn], 0) == program_id(1);
    if program_id(1) == 0 {
        scale[..] = select(row, s.broadcast_to([mb, bn]), 0.0);
    } else {
        scale[..] = select(row, s.broadcast_to([mb, bn]), scale[..]);
    }
}

// ---- plans ----------------------------------------------------------------------------------

/// `a` and `b` are both fp8 (either format), or both of one float dtype; whether the dot
/// up-converts them to bf16 on `target` (fp8 on a generation without an fp8 MXU).
fn operand_dtypes(c: &Call, a: &str, b: &str) -> Result<bool, KernelError> {
    let (ta, tb) = (c.tensor(a)?.dtype, c.tensor(b)?.dtype);
    if ta.is_fp8() && tb.is_fp8() {
        return Ok(!(c.target.matmul_dtypes.contains(&ta) && c.target.matmul_dtypes.contains(&tb)));
    }
    if ta == tb && !ta.is_fp8() {
        return Ok(false);
    }
    Err(c.err(format!("input `{b}`"), "operand-dtype", format!("{a} is {ta} and {b} is {tb}"), format!("pass {a} and {b} both in fp8 (float8_e4m3fn or float8_e5m2, formats may differ), or both in one float dtype")))
}

/// `dim` (of `what`) is a multiple of 128, the scale block.
fn multiple_of_block(c: &Call, operand: &str, what: &str, dim: usize) -> Result<(), KernelError> {
    if dim.is_multiple_of(BLOCK) {
        return Ok(());
    }
    Err(c.err(
        format!("input `{operand}`"),
        "operand-shape",
        format!("{what} = {dim} is not a multiple of {BLOCK}: the blockwise fp8 recipe scales the contraction in blocks of {BLOCK} (TorchTPU's scaled_mm_1x128_128x128 requires the same)"),
        format!("zero-pad {what} up to {} (and the scales with it), or use matmul", dim.next_multiple_of(BLOCK)),
    ))
}

/// Scale input `name` has shape `want` (what the data operands imply).
fn scale_shape(c: &Call, name: &str, want: [usize; 2], rule: &str) -> Result<(), KernelError> {
    let t = c.tensor(name)?;
    if t.shape == want {
        return Ok(());
    }
    Err(c.err(format!("input `{name}`"), "operand-shape", format!("{name} is {:?}; {rule} makes it {want:?}", t.shape), format!("pass {name} of shape {want:?}")))
}

fn plan_scaled_mm(c: &Call) -> Result<Plan, KernelError> {
    let up = operand_dtypes(c, "a", "b")?;
    let t = c.statics.bool("transpose_rhs");
    let (at, bt) = (c.tensor("a")?.clone(), c.tensor("b")?.clone());
    let (m, k) = (at.shape[0], at.shape[1]);
    let n = if t { bt.shape[0] } else { bt.shape[1] };
    multiple_of_block(c, "a", "the contraction K (a's last dim)", k)?;
    let (kb, nb) = (k / BLOCK, n.div_ceil(BLOCK));
    scale_shape(c, "scale_a", [m, kb], "one scale per row of a per 128-wide K block (1x128)")?;
    let sb_shape = if t { [nb, kb] } else { [kb, nb] };
    scale_shape(c, "scale_b", sb_shape, if t { "transpose_rhs: b is [N, K], one scale per 128x128 tile of b ([ceil(N/128), K/128])" } else { "one scale per 128x128 tile of b ([K/128, ceil(N/128)])" })?;
    let (sa, sb) = (c.tensor("scale_a")?.clone(), c.tensor("scale_b")?.clone());
    let (bm, bn, bk) = scaled_mm_blocks(m, k, n);
    let kernel = scaled_mm_blockwise_kernel(at.clone(), bt.clone(), sa.clone(), sb.clone(), Type::vector(DType::BF16, &[m, n]), bm, bn, bk, t, up)?;
    let kernel = crate::blocks::fit_vmem_limit(kernel, c.target);
    Ok(single(c, kernel, vec![c.input("a", at)?, c.input("b", bt)?, c.input("scale_a", sa)?, c.input("scale_b", sb)?], &[]))
}

fn plan_wgrad(c: &Call) -> Result<Plan, KernelError> {
    let up = operand_dtypes(c, "a", "g")?;
    let (at, gt) = (c.tensor("a")?.clone(), c.tensor("g")?.clone());
    let (m, k, n) = (at.shape[0], at.shape[1], gt.shape[1]);
    multiple_of_block(c, "a", "the contraction M (a's and g's first dim)", m)?;
    scale_shape(c, "scale_a", [m / BLOCK, k], "one scale per column of a per 128-row block (128x1)")?;
    scale_shape(c, "scale_g", [m / BLOCK, n], "one scale per column of g per 128-row block (128x1)")?;
    let (sa, sg) = (c.tensor("scale_a")?.clone(), c.tensor("scale_g")?.clone());
    // Rows of M per step: the largest multiple of 128 up to 512 dividing M.
    let (bm, bk, bn) = (crate::blocks::pick_block(m, 512, BLOCK), k.min(512), n.min(512));
    let kernel = scaled_mm_blockwise_wgrad_kernel(at.clone(), gt.clone(), sa.clone(), sg.clone(), Type::vector(DType::BF16, &[k, n]), bm, bk, bn, up)?;
    let kernel = crate::blocks::fit_vmem_limit(kernel, c.target);
    Ok(single(c, kernel, vec![c.input("a", at)?, c.input("g", gt)?, c.input("scale_a", sa)?, c.input("scale_g", sg)?], &[]))
}

fn plan_quantize_1x128(c: &Call) -> Result<Plan, KernelError> {
    let xt = c.tensor("x")?.clone();
    let (m, k) = (xt.shape[0], xt.shape[1]);
    multiple_of_block(c, "x", "x's last dim", k)?;
    let bm = if m <= 512 { m } else { 512 };
    let kernel = quantize_fp8_1x128_kernel(xt.clone(), Type::vector(DType::F8E4M3FN, &[m, k]), Type::vector(DType::F32, &[m, k / BLOCK]), bm)?;
    Ok(single(c, kernel, vec![c.input("x", xt)?], &[]))
}

fn plan_quantize_128x1(c: &Call) -> Result<Plan, KernelError> {
    let xt = c.tensor("x")?.clone();
    let (m, n) = (xt.shape[0], xt.shape[1]);
    multiple_of_block(c, "x", "x's first dim", m)?;
    let bn = n.min(512);
    let kernel = quantize_fp8_128x1_kernel(xt.clone(), Type::vector(DType::F8E4M3FN, &[m, n]), Type::vector(DType::F32, &[m / BLOCK, n]), bn)?;
    Ok(single(c, kernel, vec![c.input("x", xt)?], &[]))
}

/// Blocks of [`scaled_mm_blockwise_kernel`]: `bm`, `bn` up to 512 (all of the dim if
/// smaller, else 512 with a partial last block), `bk` the largest multiple of 128 up to 1024
/// dividing K (each grid step runs `bk / 128` scaled sub-products; 1024 is TorchTPU's
/// default `tile_k` too). libtpu's estimate at 512x1024x1024 e4m3fn: v6e 9,399 cycles
/// (`bk` 512: 15,970; 128x128 steps: 36,598), tpu7x 7,102.
pub fn scaled_mm_blocks(m: usize, k: usize, n: usize) -> (usize, usize, usize) {
    (m.min(512), n.min(512), crate::blocks::pick_block(k, 1024, BLOCK))
}

/// `scaled_mm_blockwise(a, b, scale_a, scale_b)` for `target` (types as the op takes them).
pub fn scaled_mm_blockwise(a: &Type, b: &Type, scale_a: &Type, scale_b: &Type, transpose_rhs: bool, target: &Target) -> Result<Kernel, KernelError> {
    let up = a.dtype.is_fp8() && !(target.matmul_dtypes.contains(&a.dtype) && target.matmul_dtypes.contains(&b.dtype));
    let dim = |t: &Type, i: usize| t.shape.get(i).copied().unwrap_or(0);
    let (m, n) = (dim(a, 0), if transpose_rhs { dim(b, 0) } else { dim(b, 1) });
    let (bm, bn, bk) = scaled_mm_blocks(m, dim(a, 1), n);
    scaled_mm_blockwise_kernel(a.clone(), b.clone(), scale_a.clone(), scale_b.clone(), Type::vector(DType::BF16, &[m, n]), bm, bn, bk, transpose_rhs, up)
}

// ---- references (f64, the recipe's factored form) ---------------------------------------------

/// `out[i, j] = sum_kb scale_a[i, kb] * scale_b[kb, j/128] * sum_{p in kb} a[i, p] b[p, j]`
/// (`b` read as `[n, k]` with `transpose_rhs`, `scale_b` as `[n/128, k/128]`): each
/// 128-block's exact sum times its two scales, TorchTPU's definition (for finite scales
/// equal to dequantizing first).
pub fn reference(a: &[f64], b: &[f64], sa: &[f64], sb: &[f64], m: usize, k: usize, n: usize, transpose_rhs: bool) -> Vec<f64> {
    let (kb, nb) = (k / BLOCK, n.div_ceil(BLOCK));
    let bval = |p: usize, j: usize| if transpose_rhs { b[j * k + p] } else { b[p * n + j] };
    let sbv = |q: usize, j: usize| if transpose_rhs { sb[(j / BLOCK) * kb + q] } else { sb[q * nb + j / BLOCK] };
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..kb).map(|q| (q * BLOCK..(q + 1) * BLOCK).map(|p| a[i * k + p] * bval(p, j)).sum::<f64>() * sa[i * kb + q] * sbv(q, j)).sum();
        }
    }
    out
}

/// `dB[p, j] = sum_mb scale_a[mb, p] * scale_g[mb, j] * sum_{i in mb} a[i, p] g[i, j]`.
pub fn reference_wgrad(a: &[f64], g: &[f64], sa: &[f64], sg: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; k * n];
    for p in 0..k {
        for j in 0..n {
            out[p * n + j] = (0..m / BLOCK).map(|q| (q * BLOCK..(q + 1) * BLOCK).map(|i| a[i * k + p] * g[i * n + j]).sum::<f64>() * sa[q * k + p] * sg[q * n + j]).sum();
        }
    }
    out
}

/// The quantizers' reference: `(q, scale)` of `x [rows, cols]` with blocks of 128 along
/// the last dim (`along_rows = false`, 1x128) or the first (128x1), in f32 as torch
/// computes `scale = amax.clamp(min=1e-12) / 448`, `q = (x / scale).to(e4m3fn)`.
pub fn reference_quantize(x: &[f64], rows: usize, cols: usize, along_rows: bool) -> (Vec<f64>, Vec<f64>) {
    let (sr, sc) = if along_rows { (rows / BLOCK, cols) } else { (rows, cols / BLOCK) };
    let block_of = |i: usize, j: usize| if along_rows { (i / BLOCK) * sc + j } else { i * sc + j / BLOCK };
    let mut amax = vec![0f32; sr * sc];
    let mut nan = vec![false; sr * sc];
    for i in 0..rows {
        for j in 0..cols {
            let v = (x[i * cols + j] as f32).abs();
            let b = block_of(i, j);
            nan[b] |= v.is_nan();
            amax[b] = amax[b].max(v);
        }
    }
    let scale: Vec<f32> = amax.iter().zip(&nan).map(|(&a, &n)| if n { f32::NAN } else { a.max(AMAX_EPS) / E4M3_MAX }).collect();
    let q = (0..rows * cols).map(|e| tessera_dsl::fp8::e4m3fn_to_f32(tessera_dsl::fp8::e4m3fn_from_f32(x[e] as f32 / scale[block_of(e / cols, e % cols)])) as f64).collect();
    (q, scale.iter().map(|&s| s as f64).collect())
}

// ---- random inputs ----------------------------------------------------------------------------

/// The fp8 format a run of the op table at float dtype `dtype` uses: that format for an
/// fp8 run (`tessera run --dtype float8_e5m2`), else e4m3fn for f32 runs and e5m2 for bf16
/// runs (so the table's cases at f32 and bf16 exercise both formats).
pub fn format_for(dtype: DType) -> DType {
    match dtype {
        DType::F8E4M3FN | DType::F8E5M2 => dtype,
        DType::BF16 => DType::F8E5M2,
        _ => DType::F8E4M3FN,
    }
}

/// fp8 data of `dtype` in about [-4, 4) (so e5m2's and e4m3fn's subnormal-free range is
/// used) and positive scales in [2^-8, 2^-4) (what amax/448 gives for activations of
/// magnitude ~0.1-30).
fn fp8_data(dtype: DType, shape: &[usize], rng: &mut StdRng) -> Array {
    let v: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
    Array::from_f32_as_fp8(dtype, shape, &v)
}

fn scales(shape: &[usize], rng: &mut StdRng) -> Array {
    Array::from_f32(shape, (0..shape.iter().product::<usize>()).map(|_| rng.gen_range(0.004f32..0.0625)).collect())
}

fn random_fp8_pair(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let f = format_for(dtype);
    vec![fp8_data(f, &shapes[0], rng), fp8_data(f, &shapes[1], rng), scales(&shapes[2], rng), scales(&shapes[3], rng)]
}

fn random_quantize(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    // Rows of very different magnitudes, so the per-block scales differ.
    let (r, c) = (shapes[0][0], shapes[0][1]);
    let mags: Vec<f32> = (0..r).map(|_| 2f32.powi(rng.gen_range(-6..6))).collect();
    let v: Vec<f32> = (0..r * c).map(|e| rng.gen_range(-1.0f32..1.0) * mags[e / c]).collect();
    vec![Array::from_f32_in(if dtype == DType::BF16 { DType::BF16 } else { DType::F32 }, &shapes[0], v)]
}

fn ref_forward(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let t = s.bool("transpose_rhs");
    let (m, k) = (a[0].shape[0], a[0].shape[1]);
    let n = if t { a[1].shape[0] } else { a[1].shape[1] };
    vec![reference(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[3].to_f64_vec(), m, k, n, t)]
}

fn ref_wgrad(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let (m, k, n) = (a[0].shape[0], a[0].shape[1], a[1].shape[1]);
    vec![reference_wgrad(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[3].to_f64_vec(), m, k, n)]
}

fn ref_quantize_1x128(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let (q, s) = reference_quantize(&a[0].to_f64_vec(), a[0].shape[0], a[0].shape[1], false);
    vec![q, s]
}

fn ref_quantize_128x1(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let (q, s) = reference_quantize(&a[0].to_f64_vec(), a[0].shape[0], a[0].shape[1], true);
    vec![q, s]
}

/// This module's ops.
#[rustfmt::skip]
pub const OPS: &[Op] = &[
    Op {
        name: "scaled_mm_blockwise", doc: "blockwise-scaled fp8 matmul (DeepSeek-V3 / TorchTPU scaled_mm_1x128_128x128): fp8 a [m, k] with f32 scale_a [m, k/128] (1x128) @ fp8 b [k, n] with f32 scale_b [k/128, ceil(n/128)] (128x128), dequantization scales, f32 accumulation, bf16 out; transpose_rhs reads b as [n, k] (the dgrad dOut @ B^T); k % 128 == 0",
        schema: "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, bool transpose_rhs=False) -> Tensor", plan: plan_scaled_mm, reference: Some(ref_forward),
        inputs: &[Input { name: "a", dims: "[m, k]", kind: Kind::AnyFloat }, Input { name: "b", dims: "[transpose_rhs ? n : k, transpose_rhs ? k : n]", kind: Kind::AnyFloat }, Input { name: "scale_a", dims: "[m, kb]", kind: Kind::Float32 }, Input { name: "scale_b", dims: "[sb0, sb1]", kind: Kind::Float32 }],
        outputs: &[Output { name: "out", shape: "[a.0, transpose_rhs ? b.0 : b.1]", dtype: "bf16" }],
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[512, 1024], &[1024, 1024], &[512, 8], &[8, 8]] },
            Case { name: "edges", statics: "", shapes: &[&[200, 256], &[256, 300], &[200, 2], &[2, 3]] },
            Case { name: "dgrad", statics: "transpose_rhs=True", shapes: &[&[200, 384], &[256, 384], &[200, 3], &[2, 3]] },
        ],
        random: Some(random_fp8_pair), ..Op::EMPTY
    },
    Op {
        name: "scaled_mm_blockwise_wgrad", doc: "wgrad of the blockwise fp8 recipe: dB = a^T @ g for fp8 a [m, k], g [m, n] with 128x1 f32 scales scale_a [m/128, k], scale_g [m/128, n], f32 accumulation, bf16 [k, n]; m % 128 == 0",
        schema: "(Tensor a, Tensor g, Tensor scale_a, Tensor scale_g) -> Tensor", plan: plan_wgrad, reference: Some(ref_wgrad),
        inputs: &[Input { name: "a", dims: "[m, k]", kind: Kind::AnyFloat }, Input { name: "g", dims: "[m, n]", kind: Kind::AnyFloat }, Input { name: "scale_a", dims: "[mb, k]", kind: Kind::Float32 }, Input { name: "scale_g", dims: "[mb, n]", kind: Kind::Float32 }],
        outputs: &[Output { name: "out", shape: "[a.1, g.1]", dtype: "bf16" }],
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[1024, 512], &[1024, 512], &[8, 512], &[8, 512]] },
            Case { name: "edges", statics: "", shapes: &[&[256, 200], &[256, 136], &[2, 200], &[2, 136]] },
        ],
        random: Some(random_fp8_pair), ..Op::EMPTY
    },
    Op {
        name: "quantize_fp8_1x128", doc: "1x128 fp8 quantization (DeepSeek-V3 activations): per row and 128-wide block of x [m, k], scale = max(amax|x|, 1e-12) / 448 (f32 [m, k/128]) and q = (x / scale) in float8_e4m3fn; k % 128 == 0",
        schema: "(Tensor x) -> (Tensor, Tensor)", plan: plan_quantize_1x128, reference: Some(ref_quantize_1x128),
        inputs: &[Input { name: "x", dims: "[m, k]", kind: Kind::Float }],
        outputs: &[Output { name: "q", shape: "x", dtype: "float8_e4m3fn" }, Output { name: "scale", shape: "[x.0, x.1 / 128]", dtype: "f32" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[512, 1024]] }, Case { name: "edges", statics: "", shapes: &[&[200, 384]] }],
        random: Some(random_quantize), ..Op::EMPTY
    },
    Op {
        name: "quantize_fp8_128x1", doc: "128x1 fp8 quantization (the wgrad operands): per column and 128-row block of x [m, n], scale = max(amax|x|, 1e-12) / 448 (f32 [m/128, n]) and q = (x / scale) in float8_e4m3fn; m % 128 == 0",
        schema: "(Tensor x) -> (Tensor, Tensor)", plan: plan_quantize_128x1, reference: Some(ref_quantize_128x1),
        inputs: &[Input { name: "x", dims: "[m, n]", kind: Kind::Float }],
        outputs: &[Output { name: "q", shape: "x", dtype: "float8_e4m3fn" }, Output { name: "scale", shape: "[x.0 / 128, x.1]", dtype: "f32" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 512]] }, Case { name: "edges", statics: "", shapes: &[&[384, 200]] }],
        random: Some(random_quantize), ..Op::EMPTY
    },
];
