//! Weight-only int8 quantized matmul: `out[m, n] = (x[m, k] @ w[n, k]^T) * scale[n]`, with
//! `w` stored as int8 and one f32 scale per output channel (the layout of a PyTorch
//! `Linear` weight quantized per channel). The int8 block is widened to `x`'s dtype in
//! VMEM, so HBM traffic for the weight is a quarter of f32 (half of bf16); the product
//! accumulates in f32 scratch and the scale is applied once, at the last K step.
//!
//! **Nonfinite scales.** Applying the scale after the sum is exact for finite scales, but
//! torch dequantizes first (`x @ (w * scale)^T`, also `_weight_int8pack_mm`), so for an inf
//! scale each term is `x * (w * inf)`: NaN where `x * w = 0`, and the sum is NaN unless all
//! terms share one sign. Each (i, j) block checks its scales at the first K step (a VPU
//! reduce moved to a scalar with `item()` and kept in SMEM so a scalar `if` can use it);
//! only blocks holding a nonfinite scale also accumulate `sign(x) @ sign(w)^T` (exact
//! ±1 / 0 in bf16) for those columns and finish them as ±inf when `|sum| = k`, else NaN.
//! Other blocks run the plain product. (The cost estimate counts the costlier branch.)

use rand::{rngs::StdRng, Rng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::blocks::{fit_blocks, pick_block};
use crate::harness;
use crate::op::{Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{single, Plan};

#[tpu_kernel(
    grid = [m / bm, n / bn, k / bk],
    semantics = [parallel, parallel, arbitrary],
    x = block([bm, bk], |i, j, kk| [i, kk]),
    w = block([bn, bk], |i, j, kk| [j, kk]),
    scale = block([1, bn], |i, j, kk| [0, j]),
    out = block([bm, bn], |i, j, kk| [i, j]),
    acc = scratch([bm, bn], f32),
    flag = scratch_smem([1, 1], i32),
)]
#[rustfmt::skip]
pub fn quantized_matmul_kernel(
    x: In<m, k>, w: In<n, k>, scale: In<1, n>, out: Out<m, n>, acc: Scratch, flag: Scratch,
    bm: usize, bn: usize, bk: usize,
) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, bn], f32);
        // Whether this column block has a nonfinite scale, kept in SMEM for the k steps.
        let s = scale[..];
        flag[(0, 0)] = select((s - s) != 0.0, 1, 0).reduce_max(1).item();
    }
    if flag[(0, 0)] == 0 {
        acc[..] += dot_t(x[..], w[..].cast(x.dtype));
    } else {
        // torch dequantizes first: out = sum_p x[p] * (w[p] * s), so with s = ±inf each term
        // is ±inf by the sign of x[p] * w[p], or NaN where that is 0; the sum is ±inf only if
        // all k terms share one sign, i.e. |sum_p sign(x[p]) sign(w[p])| = k (exact in f32).
        // Those columns accumulate the sign product instead (one product live at a time).
        let sb = scale[..].broadcast_to([bm, bn]);
        acc[..] += select((sb - sb) != 0.0, 0.0, dot_t(x[..], w[..].cast(x.dtype)));
        let xs = sign_of(x[..]);
        let ws = sign_of(w[..]);
        let sb = scale[..].broadcast_to([bm, bn]);
        acc[..] += select((sb - sb) != 0.0, dot_t(xs, ws), 0.0);
    }
    if program_id(2) == num_programs(2) - 1 {
        if flag[(0, 0)] == 0 {
            out[..] = (acc[..] * scale[..]).cast(out.dtype);
        } else {
            let a = acc[..];
            let sb = scale[..].broadcast_to([bm, bn]);
            let same_sign = a.abs() == (k as f32);
            out[..] = select((sb - sb) != 0.0, select(same_sign, select(a > 0.0, sb, -sb), f32::NAN), a * sb).cast(out.dtype);
        }
    }
}

/// `sign(x)` in bf16 (exact): 1, -1, or 0 for 0 and NaN.
#[tpu_fn]
fn sign_of(x: Value) -> Value {
    select(x > 0, 1.0, select(x < 0, -1.0, 0.0)).cast(bf16)
}

/// Blocks for the quantized matmul: the `matmul` rule (start at (512, 1024, 1024),
/// MXU-aligned divisors, halve bk, then bn, then bm until the double-buffered windows and
/// the accumulator fit 3/4 of the default scoped VMEM), with the weight window in int8.
pub fn quantized_matmul_blocks(m: usize, k: usize, n: usize, dtype: DType, target: &Target) -> (usize, usize, usize) {
    let (sub, lane) = target.tiling(dtype);
    let mut bm = pick_block(m, 512, sub);
    let mut bk = pick_block(k, 1024, lane.max(target.mxu.min(k)));
    // n is the weight's second-to-last dim: int8 packs 32 rows per tile.
    let mut bn = pick_block(n, 1024, target.tiling(DType::I8).0.max(lane).max(target.mxu.min(n)));
    let vmem = |bm: usize, bk: usize, bn: usize| {
        2 * (target.padded_bytes(dtype, &[bm, bk]) + target.padded_bytes(DType::I8, &[bn, bk]) + target.padded_bytes(DType::F32, &[1, bn]) + target.padded_bytes(dtype, &[bm, bn]))
            + target.padded_bytes(DType::F32, &[bm, bn])
    };
    fit_blocks(&mut [(&mut bk, k), (&mut bn, n), (&mut bm, m)], target.default_scoped_vmem_bytes * 3 / 4, |b| vmem(b[2], b[0], b[1]));
    (bm, bk, bn)
}

/// `quantized_matmul(x, w, scale)` for `target` with the default blocks; the output has
/// `x`'s dtype.
pub fn quantized_matmul(x: &Type, w: &Type, scale: &Type, target: &Target) -> Result<Kernel, KernelError> {
    let dim = |t: &Type, i: usize| t.shape.get(i).copied().unwrap_or(0);
    let (m, k, n) = (dim(x, 0), dim(x, 1), dim(w, 0));
    let (bm, bk, bn) = quantized_matmul_blocks(m, k, n, x.dtype, target);
    quantized_matmul_kernel(x.clone(), w.clone(), scale.clone(), Type::vector(x.dtype, &[m, n]), bm, bn, bk)
}

/// x `[m, k]` float, int8 w `[n, k]`, float32 scale `[n]`: the op's contract, checked.
fn plan_quantized_matmul(c: &Call) -> Result<Plan, KernelError> {
    let scale = c.row_vector("scale", c.tensor("w")?.shape[0])?;
    let (xt, wt) = (c.tensor("x")?.clone(), c.tensor("w")?.clone());
    let kernel = quantized_matmul(&xt, &wt, &scale, c.target)?;
    Ok(single(c, kernel, vec![c.input("x", xt)?, c.input("w", wt)?, c.input("scale", scale)?], &[]))
}

/// `dx = dy @ (w * scale[:, None])` (`quantized_matmul`'s input gradient): `dy [m, n]`,
/// int8 `w [n, k]`, the scale folded into `dy`'s columns in f32 before the product (exact
/// for finite scales up to one rounding to `dy`'s dtype; an inf scale gives the inf / NaN
/// terms torch's dequantize-first product gives). n, the contraction, is the last axis.
#[tpu_kernel(
    grid = [m / bm, k / bk, n / bn],
    semantics = [parallel, parallel, arbitrary],
    dy = block([bm, bn], |i, j, c| [i, c]),
    w = block([bn, bk], |i, j, c| [c, j]),
    scale = block([1, bn], |i, j, c| [0, c]),
    dx = block([bm, bk], |i, j, c| [i, j]),
    acc = scratch([bm, bk], f32),
)]
pub fn quantized_matmul_dx_kernel(dy: In<m, n>, w: In<n, k>, scale: In<1, n>, dx: Out<m, k>, acc: Scratch, bm: usize, bn: usize, bk: usize) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, bk], f32);
    }
    let scaled = (dy[..].cast(f32) * scale[..]).cast(dy.dtype);
    acc[..] += dot(scaled, w[..].cast(dy.dtype));
    if program_id(2) == num_programs(2) - 1 {
        dx[..] = acc[..].cast(dx.dtype);
    }
}

/// Blocks of [`quantized_matmul_dx_kernel`]: as [`quantized_matmul_blocks`], with the
/// contraction n as the int8 weight's row (sublane) dim.
pub fn quantized_matmul_dx_blocks(m: usize, n: usize, k: usize, dtype: DType, target: &Target) -> (usize, usize, usize) {
    let (sub, lane) = target.tiling(dtype);
    let mut bm = pick_block(m, 512, sub);
    let mut bn = pick_block(n, 1024, target.tiling(DType::I8).0.max(lane).max(target.mxu.min(n)));
    let mut bk = pick_block(k, 1024, lane.max(target.mxu.min(k)));
    let vmem = |bm: usize, bn: usize, bk: usize| {
        2 * (target.padded_bytes(dtype, &[bm, bn]) + target.padded_bytes(DType::I8, &[bn, bk]) + target.padded_bytes(DType::F32, &[1, bn]) + target.padded_bytes(dtype, &[bm, bk]))
            + target.padded_bytes(DType::F32, &[bm, bk])
    };
    fit_blocks(&mut [(&mut bn, n), (&mut bk, k), (&mut bm, m)], target.default_scoped_vmem_bytes * 3 / 4, |b| vmem(b[2], b[0], b[1]));
    (bm, bn, bk)
}

/// dy `[m, n]` float, int8 w `[n, k]`, float32 scale `[n]`.
fn plan_quantized_matmul_dx(c: &Call) -> Result<Plan, KernelError> {
    let scale = c.row_vector("scale", c.tensor("w")?.shape[0])?;
    let (dyt, wt) = (c.tensor("dy")?.clone(), c.tensor("w")?.clone());
    let (m, n, k) = (dyt.shape[0], dyt.shape[1], wt.shape[1]);
    let (bm, bn, bk) = quantized_matmul_dx_blocks(m, n, k, dyt.dtype, c.target);
    let kernel = quantized_matmul_dx_kernel(dyt.clone(), wt.clone(), scale.clone(), Type::vector(dyt.dtype, &[m, k]), bm, bn, bk)?;
    Ok(single(c, kernel, vec![c.input("dy", dyt)?, c.input("w", wt)?, c.input("scale", scale)?], &[]))
}

/// Independent reference of the input gradient: `dx[i, p] = sum_j dy[i, j] * (w[j, p] * scale[j])`.
pub fn reference_dx(dy: &[f64], w: &[f64], scale: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut dx = vec![0.0; m * k];
    for i in 0..m {
        for p in 0..k {
            dx[i * k + p] = (0..n).map(|j| dy[i * n + j] * (w[j * k + p] * scale[j])).sum();
        }
    }
    dx
}

/// Random activations in [-1, 1), int8 weights over the full range, scales in [0.001, 0.02)
/// (what symmetric per-channel quantization of weights of magnitude ~1 gives).
fn random_inputs(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let x = harness::random_array(dtype, &shapes[0], rng);
    let w: Vec<i8> = (0..shapes[1].iter().product::<usize>()).map(|_| rng.gen_range(-127..=127)).collect();
    let scale: Vec<f32> = (0..shapes[2].iter().product::<usize>()).map(|_| rng.gen_range(0.001..0.02)).collect();
    vec![x, Array::from_i8(&shapes[1], w), Array::from_f32(&shapes[2], scale)]
}

/// Independent reference: `out[i, j] = sum_p x[i, p] * (w[j, p] * scale[j])` in f64, the
/// weight dequantized first (as torch's `_weight_int8pack_mm`: an inf scale gives NaN
/// where a term is `0 * inf` or the terms' signs differ).
pub fn reference(x: &[f64], w: &[f64], scale: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| x[i * k + p] * (w[j * k + p] * scale[j])).sum();
        }
    }
    out
}

/// `torch._int_mm` (int8 `a [m, k] @ b [k, n]`, exact int32 accumulation, wrapping past
/// 2^31 as torch's) is [`crate::matmul::matmul_kernel`] with int8 operands, whose accumulator
/// is then i32. The MXU multiplies int8 natively on v5e, v5p and v6e; tpu7x has no int8
/// mode (libtpu still compiles it, and the verifier warns `matmul-emulated`).
///
/// Its blocks: `bm` up to 512 rows (int8 tiles are 32 rows), `bn` up to
/// 512 and `bk` up to 2048 lanes, MXU-aligned divisors, halved (bk, bn, bm) to fit 3/4 of
/// the default scoped VMEM.
pub fn int_mm_blocks(m: usize, k: usize, n: usize, target: &Target) -> (usize, usize, usize) {
    let (sub, lane) = target.native_tile(DType::I8);
    let mut bm = pick_block(m, 512, sub);
    let mut bk = pick_block(k, 2048, lane.max(target.mxu.min(k)));
    let mut bn = pick_block(n, 512, lane.max(target.mxu.min(n)));
    let vmem = |bm: usize, bk: usize, bn: usize| 2 * (target.padded_bytes(DType::I8, &[bm, bk]) + target.padded_bytes(DType::I8, &[bk, bn]) + target.padded_bytes(DType::I32, &[bm, bn])) + target.padded_bytes(DType::I32, &[bm, bn]);
    fit_blocks(&mut [(&mut bk, k), (&mut bn, n), (&mut bm, m)], target.default_scoped_vmem_bytes * 3 / 4, |b| vmem(b[2], b[0], b[1]));
    (bm, bk, bn)
}

fn plan_int_mm(c: &Call) -> Result<Plan, KernelError> {
    let (a, b) = (c.tensor("a")?.clone(), c.tensor("b")?.clone());
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let (bm, bk, bn) = int_mm_blocks(m, k, n, c.target);
    let kernel = crate::matmul::matmul_kernel(a.clone(), b.clone(), Type::vector(DType::I32, &[m, n]), bm, bn, bk, k, false, false)?;
    Ok(single(c, kernel, vec![c.input("a", a)?, c.input("b", b)?], &[]))
}

/// `a @ b` of integers, exactly (in f64: |sum| < 2^53 for any k below 2^38).
pub fn reference_int_mm(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    // int32 wraps as torch's accumulator does.
    crate::reference::matmul(a, b, m, k, n).iter().map(|&v| v as i64 as i32 as f64).collect()
}

fn random_int8_pair(shapes: &[Vec<usize>], _: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    // The full int8 range, -128 included.
    shapes.iter().map(|s| Array::from_i8(s, (0..s.iter().product::<usize>()).map(|_| rng.gen::<i8>()).collect())).collect()
}

/// This module's ops.
pub const OPS: &[Op] = &[Op {
                             name: "quantized_matmul", doc: "x [m, k] @ (int8 w [n, k] * float32 scale [n])^T: weight-only int8 with per-output-channel scales, f32 accumulation", schema: "(Tensor x, Tensor w, Tensor scale) -> Tensor", plan: plan_quantized_matmul, reference: Some(|a, _| { let (m, k, n) = (a[0].shape[0], a[0].shape[1], a[1].shape[0]); vec![reference(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), m, k, n)] }),
                             inputs: &[Input { name: "x", dims: "[m, k]", kind: Kind::Float }, Input { name: "w", dims: "[n, k]", kind: Kind::Int8 }, Input { name: "scale", dims: "[1?, n]", kind: Kind::Float32 }], outputs: &[Output { name: "out", shape: "[x.0, w.0]", dtype: "x" }],
                             backward: Some(crate::op::Backward { op: "quantized_matmul_dx", args: "d_out, w, scale", grads: &["x"] }),
                             cases: &[Case { name: "default", statics: "", shapes: &[&[512, 2048], &[2048, 2048], &[2048]] }, Case { name: "alt", statics: "", shapes: &[&[384, 1536], &[640, 1536], &[640]] }], random: Some(random_inputs), ..Op::EMPTY
                         },
                         Op {
                             name: "quantized_matmul_dx", doc: "dx of quantized_matmul: dy [m, n] @ (int8 w [n, k] * float32 scale [n]), f32 accumulation (w and scale get no gradient)", schema: "(Tensor dy, Tensor w, Tensor scale) -> Tensor", plan: plan_quantized_matmul_dx, reference: Some(|a, _| { let (m, n, k) = (a[0].shape[0], a[0].shape[1], a[1].shape[1]); vec![reference_dx(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), m, n, k)] }),
                             inputs: &[Input { name: "dy", dims: "[m, n]", kind: Kind::Float }, Input { name: "w", dims: "[n, k]", kind: Kind::Int8 }, Input { name: "scale", dims: "[1?, n]", kind: Kind::Float32 }], outputs: &[Output { name: "dx", shape: "[dy.0, w.1]", dtype: "dy" }],
                             cases: &[Case { name: "default", statics: "", shapes: &[&[512, 2048], &[2048, 2048], &[2048]] }, Case { name: "alt", statics: "", shapes: &[&[384, 640], &[640, 1536], &[640]] }], random: Some(random_inputs), ..Op::EMPTY
                         },
                         Op {
                             name: "int_mm", doc: "torch._int_mm: int8 a [m, k] @ int8 b [k, n] -> int32 [m, n], exact int32 accumulation (native int8 MXU on v5e, v5p, v6e; tpu7x has no int8 mode: it compiles, with a matmul-emulated warning)", schema: "(Tensor a, Tensor b) -> Tensor", plan: plan_int_mm, reference: Some(|a, _| { let (m, k, n) = (a[0].shape[0], a[0].shape[1], a[1].shape[1]); vec![reference_int_mm(&a[0].to_f64_vec(), &a[1].to_f64_vec(), m, k, n)] }),
                             inputs: &[Input { name: "a", dims: "[m, k]", kind: Kind::Int8 }, Input { name: "b", dims: "[k, n]", kind: Kind::Int8 }], outputs: &[Output { name: "out", shape: "[a.0, b.1]", dtype: "i32" }],
                             cases: &[Case { name: "default", statics: "", shapes: &[&[256, 4096], &[4096, 512]] }, Case { name: "edges", statics: "", shapes: &[&[40, 200], &[200, 72]] }, Case { name: "decode", statics: "", shapes: &[&[8, 2048], &[2048, 768]] }], random: Some(random_int8_pair), ..Op::EMPTY
                         }];
