//! Tiled matmul: `out[m, n] = op(x) @ op(y)`, f32 accumulation in VMEM scratch across the
//! K axis (the last, `arbitrary` grid axis), cast to the output dtype into the resident output
//! block at every step (written back to HBM once, after the last). `op` is
//! the identity or a transpose of the stored operand (`transpose_lhs` / `transpose_rhs`),
//! which is how the backward's `g @ y^T` and `x^T @ g` read their operands in place.

use rand::rngs::StdRng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::{fit_blocks, pick_block};
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{single, Launch, Plan};
use crate::{f64s, harness};

#[tpu_kernel(
    // A partial last m or n block computes rows / columns that are dropped; k must be a
    // multiple of bk (a partial k block would add what lies past x's rows).
    grid = [m.div_ceil(bm), n.div_ceil(bn), k / bk],
    semantics = [parallel, parallel, arbitrary],
    x = block([if transpose_lhs { bk } else { bm }, if transpose_lhs { bm } else { bk }], |i, j, kk| [if transpose_lhs { kk } else { i }, if transpose_lhs { i } else { kk }]),
    y = block([if transpose_rhs { bn } else { bk }, if transpose_rhs { bk } else { bn }], |i, j, kk| [if transpose_rhs { j } else { kk }, if transpose_rhs { kk } else { j }]),
    out = block([bm, bn], |i, j, kk| [i, j]),
    // The dot's accumulator: f32 for floats, i32 for int8 (`int_mm`).
    acc = scratch([bm, bn], if x.dtype.is_int() { ::tessera_dsl::DType::I32 } else { ::tessera_dsl::DType::F32 }),
)]
pub fn matmul_kernel(x: In<_, _>, y: In<_, _>, out: Out<m, n>, acc: Scratch, bm: usize, bn: usize, bk: usize, k: usize, transpose_lhs: bool, transpose_rhs: bool) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, bn], acc.dtype);
    }
    if transpose_lhs {
        acc[..] += dot_tn(x[..], y[..]);
    } else if transpose_rhs {
        acc[..] += dot_t(x[..], y[..]);
    } else {
        acc[..] += dot(x[..], y[..]);
    }
    // Every step, as Pallas' matmul: the output block stays resident across k and is written
    // back once, and the cast and stores hide under the MXU-bound step, where a last-step
    // branch ran them alone (libtpu: 1.0% of the 4096^3 bf16 kernel's cycles on v5e).
    out[..] = acc[..].cast(out.dtype);
}

/// Block sizes for `matmul` on `target`.
///
/// Rule: start from (512, 1024, 1024) — big enough that the MXU stays busy and each
/// grid step amortises its ~0.35 us overhead (DESIGN §6: 91.5% of v5e peak at these
/// blocks, 6% at 128^3) — then, where the problem has rows to spare, make the output tile tall
/// enough that HBM keeps up with the MXU. A `[bm, bk] x [bk, bn]` step moves `(bm + bn) * bk` elements for `2 bm bn bk`
/// flops: `2 bm bn / ((bm + bn) * bytes)` flops per byte, against the target's ridge, its
/// bf16 peak per core over its HBM bandwidth (v5e 240, v5p 83, v6e 561, tpu7x 313). 512 x
/// 1024 in bf16 (341) clears every ridge but v6e's, where bm doubles to 2048 (683) and bk
/// stays 1024, the windows taking up to a quarter of the core's VMEM with the kernel's limit
/// raised (libtpu's static estimate on v6e, bf16, before the every-step store: 8192^3
/// 1,294 us = 92.4% of MXU peak, against 1,356 us = 88.2% with bk 512 as before; 4096^3 172
/// against 179 us, and 266 us at (512, 1024, 1024); f32 4096^3 286 against 515 us). Then the
/// blocks are restricted to multiples of the MXU edge that divide the problem, and bk, bn,
/// bm halved in turn until the double-buffered windows plus the accumulator fit in 3/4 of
/// the target's default scoped VMEM (or the raised budget).
pub fn matmul_blocks(m: usize, k: usize, n: usize, in_dtype: DType, out_dtype: DType, target: &Target) -> (usize, usize, usize) {
    let (sub, lane) = target.tiling(in_dtype);
    let ridge = target.core_peak_tflops() * 1e3 / target.hbm_gbps;
    // In bf16 bytes whatever the dtype: f32 runs the MXU at a fraction of bf16's rate, so
    // bf16 is the case where HBM binds.
    let intensity = |bm: usize, bn: usize| (2 * bm * bn) as f64 / ((bm + bn) * 2) as f64;
    let mut start_m = 512;
    let mut budget = target.default_scoped_vmem_bytes * 3 / 4;
    // Doubling keeps at least two steps along m, so the next block's copy still overlaps
    // this one's dots (at 1024^3 on v6e one step is 8.7% more cycles than two).
    while start_m < 2048 && 4 * start_m <= m && intensity(start_m, 1024) < ridge {
        start_m *= 2;
        // The taller tile keeps bk at 1024 (each step's fixed cost over twice the dots) and
        // may pass the default scoped VMEM: up to a quarter of the core's, the kernel raising
        // its limit (`fit_vmem_limit`), as Pallas kernels pass `vmem_limit_bytes`.
        budget = budget.max(target.vmem_bytes / 4);
    }
    let mut bm = pick_block(m, start_m, sub.max(target.tiling(out_dtype).0));
    // A divisor far below the tile (200 rows of m = 1000) re-reads y once per step, and y's
    // bytes then bind (v6e, 1000 x 4096 x 4096 bf16: 127 us against 46 us for one step):
    // take all of m under two tiles, else whole tiles and a partial last block.
    if m > start_m && 2 * bm <= start_m {
        bm = if m < 2 * start_m { m } else { start_m };
    }
    let mut bk = pick_block(k, 1024, lane.max(target.mxu.min(k)));
    let mut bn = pick_block(n, 1024, lane.max(target.mxu.min(n)));
    let vmem = |bm: usize, bk: usize, bn: usize| {
        2 * (target.padded_bytes(in_dtype, &[bm, bk]) + target.padded_bytes(in_dtype, &[bk, bn]) + target.padded_bytes(out_dtype, &[bm, bn]))
            + target.padded_bytes(DType::F32, &[bm, bn])
    };
    fit_blocks(&mut [(&mut bk, k), (&mut bn, n), (&mut bm, m)], budget, |b| vmem(b[2], b[0], b[1]));
    (bm, bk, bn)
}

/// `op(x) @ op(y)` for `target` with the default blocks; the output has `x`'s dtype. With
/// `transpose_lhs`, `x` is stored `[k, m]`; with `transpose_rhs`, `y` is stored `[n, k]`.
pub fn matmul_t(x: &Type, y: &Type, transpose_lhs: bool, transpose_rhs: bool, target: &Target) -> Result<Kernel, KernelError> {
    let dim = |t: &Type, i: usize| t.shape.get(i).copied().unwrap_or(0);
    let (m, k) = if transpose_lhs { (dim(x, 1), dim(x, 0)) } else { (dim(x, 0), dim(x, 1)) };
    let n = if transpose_rhs { dim(y, 0) } else { dim(y, 1) };
    let (bm, bk, bn) = matmul_blocks(m, k, n, x.dtype, x.dtype, target);
    Ok(crate::blocks::fit_vmem_limit(matmul_kernel(x.clone(), y.clone(), Type::vector(x.dtype, &[m, n]), bm, bn, bk, k, transpose_lhs, transpose_rhs)?, target))
}

/// `x @ y` for `target` with the default blocks; the output has `x`'s dtype.
pub fn matmul(x: &Type, y: &Type, target: &Target) -> Result<Kernel, KernelError> {
    matmul_t(x, y, false, false, target)
}

// ---- ops ------------------------------------------------------------------------------------

/// Float inputs `a` and `b` (kinds checked by the op's contract) of one dtype.
fn check_float_pair(c: &Call, a: &str, b: &str) -> Result<(), KernelError> {
    let (ta, tb) = (c.tensor(a)?, c.tensor(b)?);
    if ta.dtype != tb.dtype {
        return Err(c.err(format!("input `{b}`"), "operand-dtype", format!("{a} is {} and {b} {}", ta.dtype, tb.dtype), format!("pass {a} and {b} of one float dtype")));
    }
    Ok(())
}

fn plan_matmul(c: &Call) -> Result<Plan, KernelError> {
    check_float_pair(c, "x", "y")?;
    let (x, y) = (c.tensor("x")?.clone(), c.tensor("y")?.clone());
    let (m, k, n) = (x.shape[0], x.shape[1], y.shape[1]);
    // Blocks: given (or from a tuning table), else the rule of `matmul_blocks`.
    let (dm, dk, dn) = matmul_blocks(m, k, n, x.dtype, x.dtype, c.target);
    let (bm, bk, bn) = (c.block("block_m", dm)?, c.block("block_k", dk)?, c.block("block_n", dn)?);
    // A partial m or n block only computes rows / columns that are dropped; a partial k
    // block would add what lies past the end of x's rows into every result.
    if !k.is_multiple_of(bk) {
        return Err(c.err("argument `block_k`", "option-value", format!("block_k = {bk} does not divide k = {k}"), "pass a block_k that divides x's columns, or leave it unset"));
    }
    let (sub, lane) = c.target.block_tile(x.dtype);
    for (name, block, dim, tile) in [("block_m", bm, m, sub), ("block_k", bk, k, lane), ("block_n", bn, n, lane)] {
        check_block(c, name, block, dim, tile)?;
    }
    let kernel = crate::blocks::fit_vmem_limit(matmul_kernel(x.clone(), y.clone(), Type::vector(x.dtype, &[m, n]), bm, bn, bk, k, false, false)?, c.target);
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("y", y)?], &[]))
}

/// A given block static (`block_m` of `m` rows, ...) as the kernel's windows take it: a
/// multiple of the block tile (8 rows, 128 columns), or the whole dim; at most the dim
/// rounded up to the tile (a larger block only computes padding, and takes its VMEM).
fn check_block(c: &Call, name: &str, block: usize, dim: usize, tile: usize) -> Result<(), KernelError> {
    let most = dim.next_multiple_of(tile);
    if c.usize_opt(name)?.is_none() || block == dim || (block.is_multiple_of(tile) && block <= most) {
        return Ok(());
    }
    let dim_name = &name[name.len() - 1..];
    let (rule, why) = if block.is_multiple_of(tile) { ("block-shape", format!("larger than {dim_name} = {dim}")) } else { ("block-tiling", format!("neither a multiple of {tile} nor {dim_name} = {dim}")) };
    let help = if most == dim {
        format!("use a multiple of {tile} up to {dim}")
    } else if most == tile {
        format!("use {dim} or {tile}")
    } else {
        format!("use a multiple of {tile} up to {most}, or {dim}")
    };
    Err(c.err(format!("argument `{name}`"), rule, format!("{name} = {block} is {why}"), format!("{help}; or leave {name} unset for the default blocks")))
}

/// `dx = dout @ y^T`, `dy = x^T @ dout`: two launches reading every operand in place.
fn plan_matmul_bwd(c: &Call) -> Result<Plan, KernelError> {
    check_float_pair(c, "x", "y")?;
    check_float_pair(c, "x", "dout")?;
    let (xt, yt, gt) = (c.tensor("x")?.clone(), c.tensor("y")?.clone(), c.tensor("dout")?.clone());
    let dx = Launch::new(matmul_t(&gt, &yt, false, true, c.target)?, vec![c.input("dout", gt.clone())?, c.input("y", yt)?]);
    let dy = Launch::new(matmul_t(&xt, &gt, true, false, c.target)?, vec![c.input("x", xt)?, c.input("dout", gt)?]);
    let results = vec![crate::plan::result(0, 0, dx.outputs[0].clone()), crate::plan::result(1, 0, dy.outputs[0].clone())];
    Ok(Plan::new(c.op, c.target, vec![dx, dy], results))
}

fn reference_matmul(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![crate::reference::matmul(&x[0], &x[1], a[0].shape[0], a[0].shape[1], a[1].shape[1])]
}

fn random_bwd(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    shapes.iter().map(|s| harness::random_array(dtype, s, rng)).collect()
}

fn reference_matmul_bwd(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let v = f64s(a);
    let (m, k, n) = (a[0].shape[0], a[0].shape[1], a[1].shape[1]);
    let (x, y, g) = (&v[0], &v[1], &v[2]);
    let mut dx = vec![0.0; m * k];
    let mut dy = vec![0.0; k * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                dx[i * k + p] += g[i * n + j] * y[p * n + j];
                dy[p * n + j] += x[i * k + p] * g[i * n + j];
            }
        }
    }
    vec![dx, dy]
}

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "matmul", doc: "x [m, k] @ y [k, n]: tiled, f32 accumulator in VMEM scratch, K reduction on the last (arbitrary) grid axis", schema: "(Tensor x, Tensor y, int? block_m=None, int? block_k=None, int? block_n=None) -> Tensor", plan: plan_matmul, reference: Some(reference_matmul), knobs: crate::tune::MATMUL,
        inputs: &[Input { name: "x", dims: "[m, k]", kind: Kind::Float }, Input { name: "y", dims: "[k, n]", kind: Kind::Float }], outputs: &[Output { name: "out", shape: "[x.0, y.1]", dtype: "x" }],
        backward: Some(Backward { op: "matmul_bwd", args: "x, y, d_out", grads: &["x", "y"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[384, 768], &[768, 1536]] }], ..Op::EMPTY
    },
    Op {
        name: "matmul_bwd", doc: "(dx, dy) of matmul: dx = dout @ y^T and dy = x^T @ dout, operands read transposed in place", schema: "(Tensor x, Tensor y, Tensor dout) -> (Tensor, Tensor)", plan: plan_matmul_bwd, reference: Some(reference_matmul_bwd),
        inputs: &[Input { name: "x", dims: "[m, k]", kind: Kind::Float }, Input { name: "y", dims: "[k, n]", kind: Kind::Float }, Input { name: "dout", dims: "[m, n]", kind: Kind::Float }], outputs: &[Output { name: "dx", shape: "x", dtype: "x" }, Output { name: "dy", shape: "y", dtype: "y" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[512, 1024], &[1024, 768], &[512, 768]] }, Case { name: "alt", statics: "", shapes: &[&[384, 768], &[768, 1536], &[384, 1536]] }], random: Some(random_bwd), ..Op::EMPTY
    },
];
