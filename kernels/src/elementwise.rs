//! Row-blocked elementwise and row-reduction kernels: fused `gelu(x * a + b)`, row
//! softmax and RMSNorm. Blocks follow [`row_tiles`]: a grid step owns `bm` whole rows,
//! so reductions along a row never cross blocks, unless rows are too wide for VMEM; then
//! softmax and RMSNorm run as two passes over column blocks (`wide_rows.rs`) and the
//! elementwise op simply tiles columns too. Math runs in f32 whatever the storage dtype
//! (v5e has no bf16 VPU/EUP, and it is what PyTorch and JAX do for these ops).

use tessera_dsl::interp::Array;
use tessera_dsl::{Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::{row_tiles, RowTiles};
use crate::op::{Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{result, single, Plan};
use crate::wide_rows;
use crate::{f64s, last_dim, reference};

/// Row-blocked operands of every op here: the input and the output.
const STREAMS: usize = 2;
/// softmax_bwd's: y, dy and dx.
const BWD_STREAMS: usize = 3;

#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, parallel],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    (a, b) = block([1, bn], |i, j| [0, j]),
)]
pub fn gelu_affine_kernel(x: In<m, n>, a: In<1, n>, b: In<1, n>, out: Out<m, n>, bm: usize, bn: usize) {
    let z = x[..].cast(f32) * a[..].cast(f32) + b[..].cast(f32);
    // tanh approximation, as jax.nn.gelu(approximate=True) and torch's gelu(approximate="tanh").
    let inner = 0.7978845608028654 * (z + 0.044715 * z * z * z);
    out[..] = (0.5 * z * (1.0 + inner.tanh())).cast(out.dtype);
}

/// `gelu(x * a + b)` with `a`, `b` of shape `[1, n]` broadcast over rows.
pub fn gelu_affine(x: &Type, a: &Type, b: &Type, target: &Target) -> Result<Kernel, KernelError> {
    let RowTiles { bm, bn } = row_tiles(x, STREAMS, target);
    gelu_affine_kernel(x.clone(), a.clone(), b.clone(), x.clone(), bm, bn)
}

#[tpu_kernel(
    grid = [m.div_ceil(bm)],
    semantics = [parallel],
    (x, out) = block([bm, n], |i| [i, 0]),
)]
pub fn softmax_kernel(x: In<m, n>, out: Out<m, n>, bm: usize) {
    let v = x[..].cast(f32);
    let e = (v - v.reduce_max(1)).exp();
    out[..] = (e / e.sum(1)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [m.div_ceil(bm)],
    semantics = [parallel],
    (y, dy, dx) = block([bm, n], |i| [i, 0]),
)]
pub fn softmax_bwd_kernel(y: In<m, n>, dy: In<m, n>, dx: Out<m, n>, bm: usize) {
    // y = softmax(x): dx = y * (dy - sum(dy * y)) per row, in f32.
    let p = y[..].cast(f32);
    let g = dy[..].cast(f32);
    dx[..] = (p * (g - (g * p).sum(1))).cast(dx.dtype);
}

/// `(dx, da, db)` of `out = gelu(x * a + b)`: `dz = dy * gelu'(x * a + b)`, `dx = dz * a`,
/// and `da`, `db` summed over rows (`sum(dz * x)`, `sum(dz)`) in f32 scratch along the
/// row axis, the grid's last and `arbitrary` one.
#[tpu_kernel(
    grid = [n.div_ceil(bn), m.div_ceil(bm)],
    semantics = [parallel, arbitrary],
    (x, dy, dx) = block([bm, bn], |j, i| [i, j]),
    (a, b, da, db) = block([1, bn], |j, i| [0, j]),
    (da_acc, db_acc) = scratch([1, bn], f32),
)]
pub fn gelu_affine_bwd_kernel(x: In<m, n>, a: In<1, n>, b: In<1, n>, dy: In<m, n>, dx: Out<m, n>, da: Out<1, n>, db: Out<1, n>, da_acc: Scratch, db_acc: Scratch, bm: usize, bn: usize) {
    let v = x[..].cast(f32);
    let av = a[..].cast(f32);
    let z = v * av + b[..].cast(f32);
    let t = (0.7978845608028654 * (z + 0.044715 * z * z * z)).tanh();
    // d/dz of 0.5 z (1 + tanh(k (z + c z^3))).
    let slope = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z);
    let mut dz = dy[..].cast(f32) * slope;
    dx[..] = (dz * av).cast(dx.dtype);
    let i = program_id(1);
    if i == 0 {
        da_acc[..] = zeros([1, bn], f32);
        db_acc[..] = zeros([1, bn], f32);
    }
    if !m.is_multiple_of(bm) {
        // Rows past `m` in the last block are garbage: keep them out of the sums.
        let live = iota([bm, bn], 0) + i * (bm as i32) < (m as i32);
        dz = select(live, dz, 0.0);
        da_acc[..] += (dz * select(live, v, 0.0)).sum(0);
    } else {
        da_acc[..] += (dz * v).sum(0);
    }
    db_acc[..] += dz.sum(0);
    if i == num_programs(1) - 1 {
        da[..] = da_acc[..].cast(da.dtype);
        db[..] = db_acc[..].cast(db.dtype);
    }
}

/// Softmax along the last dim of a `[m, n]` array, whole rows per block (`bm` of
/// [`row_tiles`]; rows too wide for that are [`crate::wide_rows::softmax`]'s).
pub fn softmax(x: &Type, target: &Target) -> Result<Kernel, KernelError> {
    softmax_kernel(x.clone(), x.clone(), row_tiles(x, STREAMS, target).bm)
}

#[tpu_kernel(
    grid = [m.div_ceil(bm)],
    semantics = [parallel],
    (x, out) = block([bm, n], |i| [i, 0]),
    w = block([1, n], |i| [0, 0]),
)]
pub fn rmsnorm_kernel(x: In<m, n>, w: In<1, n>, out: Out<m, n>, bm: usize, eps: f32) {
    let v = x[..].cast(f32);
    let mean_sq = (v * v).sum(1) * (1.0 / n as f32);
    out[..] = (v * (mean_sq + eps).rsqrt() * w[..].cast(f32)).cast(out.dtype);
}

/// RMSNorm over the last dim: `x * rsqrt(mean(x^2) + eps) * w`, `w` of shape `[1, n]`,
/// whole rows per block.
pub fn rmsnorm(x: &Type, w: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
    rmsnorm_kernel(x.clone(), w.clone(), x.clone(), row_tiles(x, STREAMS, target).bm, eps)
}

// ---- ops ------------------------------------------------------------------------------------

/// The epsilon of `rmsnorm`'s schema default.
pub const RMSNORM_EPS: f32 = 1e-6;

fn plan_gelu_affine(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    let (a, b) = (c.row_vector("a", x.shape[1])?, c.row_vector("b", x.shape[1])?);
    let kernel = gelu_affine(&x, &a, &b, c.target)?;
    let shape = c.tensor("x")?.shape.clone();
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("a", a)?, c.input("b", b)?], &[Some(shape)]))
}

fn plan_softmax(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    let shape = c.tensor("x")?.shape.clone();
    let tiles = row_tiles(&x, STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        return wide_rows::softmax(c, &x, c.input("x", x.clone())?, tiles, shape);
    }
    Ok(single(c, softmax(&x, c.target)?, vec![c.input("x", x)?], &[Some(shape)]))
}

/// `y` and `dy` (the softmax's output and its gradient) seen as `[rows, n]` of one dtype.
fn softmax_bwd_rows(c: &Call) -> Result<Type, KernelError> {
    let y = c.rows("out")?;
    let dy = c.tensor("dy")?;
    if dy.dtype != y.dtype {
        return Err(c.err("input `dy`", "operand-dtype", format!("dy is {dy}, out is {}", c.tensor("out")?), format!("pass dy of out's dtype ({})", y.dtype)));
    }
    Ok(y)
}

fn plan_softmax_bwd(c: &Call) -> Result<Plan, KernelError> {
    let y = softmax_bwd_rows(c)?;
    let shape = c.tensor("out")?.shape.clone();
    let (y_in, dy_in) = (c.input("out", y.clone())?, c.input("dy", y.clone())?);
    let tiles = row_tiles(&y, BWD_STREAMS, c.target);
    if !tiles.whole_rows(y.shape[1]) {
        return wide_rows::softmax_bwd(c, &y, [y_in, dy_in], tiles, shape);
    }
    Ok(single(c, softmax_bwd_kernel(y.clone(), y.clone(), y.clone(), tiles.bm)?, vec![y_in, dy_in], &[Some(shape)]))
}

fn plan_gelu_affine_bwd(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    let (a, b) = (c.row_vector("a", x.shape[1])?, c.row_vector("b", x.shape[1])?);
    let dy = c.tensor("dy")?;
    if dy.dtype != x.dtype {
        return Err(c.err("input `dy`", "operand-dtype", format!("dy is {dy}, x is {}", c.tensor("x")?), format!("pass dy of x's dtype ({})", x.dtype)));
    }
    // Streams: x, dy, dx by rows (a, b and their gradients are one row each).
    let RowTiles { bm, bn } = row_tiles(&x, 3, c.target);
    let kernel = gelu_affine_bwd_kernel(x.clone(), a.clone(), b.clone(), x.clone(), x.clone(), a.clone(), b.clone(), bm, bn)?;
    let shapes = [Some(c.tensor("x")?.shape.clone()), Some(c.tensor("a")?.shape.clone()), Some(c.tensor("b")?.shape.clone())];
    Ok(single(c, kernel, vec![c.input("x", x.clone())?, c.input("a", a)?, c.input("b", b)?, c.input("dy", x)?], &shapes))
}

fn plan_rmsnorm(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    let w = c.row_vector("weight", x.shape[1])?;
    let eps = c.statics.f64("eps").unwrap_or(RMSNORM_EPS as f64) as f32;
    let shape = c.tensor("x")?.shape.clone();
    let tiles = row_tiles(&x, STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        let mut launches = Vec::new();
        let out = wide_rows::rmsnorm_launches(&mut launches, &x, c.input("x", x.clone())?, &w, c.input("weight", w.clone())?, eps, tiles, c.op, c.target)?;
        return Ok(Plan::new(c.op, c.target, launches, vec![result(out, 0, Type::vector(x.dtype, &shape))]));
    }
    let kernel = rmsnorm(&x, &w, eps, c.target)?;
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("weight", w)?], &[Some(shape)]))
}

fn ref_gelu_affine(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::gelu_affine(&x[0], &x[1], &x[2], last_dim(&a[0]))]
}

fn ref_softmax(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    vec![reference::softmax(&a[0].to_f64_vec(), last_dim(&a[0]))]
}

fn ref_softmax_bwd(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::softmax_bwd(&x[0], &x[1], last_dim(&a[0]))]
}

fn ref_gelu_affine_bwd(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (dx, da, db) = reference::gelu_affine_bwd(&x[0], &x[1], &x[2], &x[3], last_dim(&a[0]));
    vec![dx, da, db]
}

fn ref_rmsnorm(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::rmsnorm(&x[0], &x[1], last_dim(&a[0]), s.f64("eps").unwrap_or(RMSNORM_EPS as f64) as f32 as f64)]
}

const ROW: Input = Input { name: "x", dims: "[..., n]", kind: Kind::Float };
/// A per-column vector: `[n]`, or the kernels' `[1, n]` (see `Call::row_vector`); not a
/// `[]` for n = 1.
const fn vector(name: &'static str) -> Input {
    Input { name, dims: "[1?, n]", kind: Kind::Float }
}
const LIKE_X: &[Output] = &[Output { name: "out", shape: "x", dtype: "x" }];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "gelu_affine", doc: "gelu(x * a + b) (tanh approximation), a and b [n] broadcast over rows", schema: "(Tensor x, Tensor a, Tensor b) -> Tensor", plan: plan_gelu_affine, reference: Some(ref_gelu_affine),
        inputs: &[ROW, vector("a"), vector("b")], outputs: LIKE_X,
        backward: Some(crate::op::Backward { op: "gelu_affine_bwd", args: "x, a, b, d_out", grads: &["x", "a", "b"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[256, 640], &[640], &[640]] }], ..Op::EMPTY
    },
    Op {
        name: "gelu_affine_bwd", doc: "(dx, da, db) of gelu_affine: dx per element; da, db summed over rows in f32 VMEM scratch along the (arbitrary) row axis", schema: "(Tensor x, Tensor a, Tensor b, Tensor dy) -> (Tensor, Tensor, Tensor)", plan: plan_gelu_affine_bwd, reference: Some(ref_gelu_affine_bwd),
        inputs: &[ROW, vector("a"), vector("b"), Input { name: "dy", dims: "[..., n]", kind: Kind::Float }],
        outputs: &[Output { name: "dx", shape: "x", dtype: "x" }, Output { name: "da", shape: "a", dtype: "a" }, Output { name: "db", shape: "b", dtype: "b" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[250, 640], &[640], &[640], &[250, 640]] }], ..Op::EMPTY
    },
    Op {
        name: "softmax", doc: "softmax over the last dim", schema: "(Tensor x) -> Tensor", plan: plan_softmax, reference: Some(ref_softmax),
        inputs: &[ROW], outputs: LIKE_X,
        backward: Some(crate::op::Backward { op: "softmax_bwd", args: "out, d_out", grads: &["x"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[96, 2048]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "softmax_bwd", doc: "dx of softmax from its output: out * (dy - sum(dy * out)) per row (two passes over column blocks for rows too wide for VMEM)", schema: "(Tensor out, Tensor dy) -> Tensor", plan: plan_softmax_bwd, reference: Some(ref_softmax_bwd),
        inputs: &[Input { name: "out", dims: "[..., n]", kind: Kind::Float }, Input { name: "dy", dims: "[..., n]", kind: Kind::Float }],
        outputs: &[Output { name: "dx", shape: "out", dtype: "out" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[96, 2048], &[96, 2048]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[6, 300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "rmsnorm", doc: "RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight", schema: "(Tensor x, Tensor weight, float eps=1e-06) -> Tensor", plan: plan_rmsnorm, reference: Some(ref_rmsnorm),
        inputs: &[ROW, vector("weight")], outputs: LIKE_X,
        backward: Some(crate::op::Backward { op: "rmsnorm_bwd", args: "x, weight, d_out, eps", grads: &["x", "weight"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[48, 4096], &[4096]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[300_000]] }], ..Op::EMPTY
    },
];
