//! Row-blocked elementwise and row-reduction kernels: fused `gelu(x * a + b)`, row
//! softmax and RMSNorm. Each grid step owns `bm` whole rows, so reductions along a row
//! never cross blocks. Math runs in f32 whatever the storage dtype (v5e has no bf16
//! VPU/EUP, and it is what PyTorch and JAX do for these ops).

use tessera_dsl::interp::Array;
use tessera_dsl::{Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::row_block;
use crate::op::{Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{single, Plan};
use crate::{f64s, last_dim, reference};

/// Bytes of f32 per row block: large enough to amortise per-step overhead, small enough
/// that a few temporaries of the block stay well inside VMEM.
const ROW_BLOCK_BYTES: usize = 1 << 20;

fn rows(x: &Type, target: &Target) -> usize {
    let m = x.shape.first().copied().unwrap_or(0);
    let n = x.shape.get(1).copied().unwrap_or(0);
    row_block(m, n, target.tiling(x.dtype).0, ROW_BLOCK_BYTES)
}

#[tpu_kernel(
    grid = [m / bm],
    semantics = [parallel],
    x = block([bm, n], |i| [i, 0]),
    a = block([1, n], |i| [0, 0]),
    b = block([1, n], |i| [0, 0]),
    out = block([bm, n], |i| [i, 0]),
)]
pub fn gelu_affine_kernel(x: In<m, n>, a: In<1, n>, b: In<1, n>, out: Out<m, n>, bm: usize) {
    let z = x[..].cast(f32) * a[..].cast(f32) + b[..].cast(f32);
    // tanh approximation, as jax.nn.gelu(approximate=True) and torch's gelu(approximate="tanh").
    let inner = 0.7978845608028654 * (z + 0.044715 * z * z * z);
    out[..] = (0.5 * z * (1.0 + inner.tanh())).cast(out.dtype);
}

/// `gelu(x * a + b)` with `a`, `b` of shape `[1, n]` broadcast over rows.
pub fn gelu_affine(x: &Type, a: &Type, b: &Type, target: &Target) -> Result<Kernel, KernelError> {
    gelu_affine_kernel(x.clone(), a.clone(), b.clone(), x.clone(), rows(x, target))
}

#[tpu_kernel(
    grid = [m / bm],
    semantics = [parallel],
    x = block([bm, n], |i| [i, 0]),
    out = block([bm, n], |i| [i, 0]),
)]
pub fn softmax_kernel(x: In<m, n>, out: Out<m, n>, bm: usize) {
    let v = x[..].cast(f32);
    let e = (v - v.reduce_max(1)).exp();
    out[..] = (e / e.sum(1)).cast(out.dtype);
}

/// Softmax along the last dim of a `[m, n]` array.
pub fn softmax(x: &Type, target: &Target) -> Result<Kernel, KernelError> {
    softmax_kernel(x.clone(), x.clone(), rows(x, target))
}

#[tpu_kernel(
    grid = [m / bm],
    semantics = [parallel],
    x = block([bm, n], |i| [i, 0]),
    w = block([1, n], |i| [0, 0]),
    out = block([bm, n], |i| [i, 0]),
)]
pub fn rmsnorm_kernel(x: In<m, n>, w: In<1, n>, out: Out<m, n>, bm: usize, eps: f32) {
    let v = x[..].cast(f32);
    let mean_sq = (v * v).sum(1) * (1.0 / n as f32);
    out[..] = (v * (mean_sq + eps).rsqrt() * w[..].cast(f32)).cast(out.dtype);
}

/// RMSNorm over the last dim: `x * rsqrt(mean(x^2) + eps) * w`, `w` of shape `[1, n]`.
pub fn rmsnorm(x: &Type, w: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
    rmsnorm_kernel(x.clone(), w.clone(), x.clone(), rows(x, target), eps)
}

#[tpu_kernel(
    grid = [m / bm],
    semantics = [parallel],
    a = block([bm, n], |i| [i, 0]),
    b = block([bm, n], |i| [i, 0]),
    out = block([bm, n], |i| [i, 0]),
)]
pub fn geglu_kernel(a: In<m, n>, b: In<m, n>, out: Out<m, n>, bm: usize) {
    let z = a[..].cast(f32);
    let t = (0.7978845608028654 * (z + 0.044715 * z * z * z)).tanh();
    out[..] = (0.5 * z * (1.0 + t) * b[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [m / bm],
    semantics = [parallel],
    a = block([bm, n], |i| [i, 0]),
    b = block([bm, n], |i| [i, 0]),
    dy = block([bm, n], |i| [i, 0]),
    da = block([bm, n], |i| [i, 0]),
    db = block([bm, n], |i| [i, 0]),
)]
pub fn geglu_bwd_kernel(a: In<m, n>, b: In<m, n>, dy: In<m, n>, da: Out<m, n>, db: Out<m, n>, bm: usize) {
    // gelu(z) = z * h with h = (1 + tanh(u)) / 2, u = c * (z + 0.044715 z^3):
    // gelu'(z) = h + z * (1 - tanh(u)^2) / 2 * c * (1 + 3 * 0.044715 z^2).
    let z = a[..].cast(f32);
    let g = dy[..].cast(f32);
    let t = (0.7978845608028654 * (z + 0.044715 * z * z * z)).tanh();
    let gelu = 0.5 * z * (1.0 + t);
    let dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z);
    db[..] = (g * gelu).cast(db.dtype);
    da[..] = (g * b[..].cast(f32) * dgelu).cast(da.dtype);
}

// ---- ops ------------------------------------------------------------------------------------

/// The epsilon of `rmsnorm`'s schema default.
pub const RMSNORM_EPS: f32 = 1e-6;

fn plan_gelu_affine(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    c.float("x")?;
    let (a, b) = (c.row_vector("a", x.shape[1])?, c.row_vector("b", x.shape[1])?);
    let kernel = gelu_affine(&x, &a, &b, c.target)?;
    let shape = c.tensor("x")?.shape.clone();
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("a", a)?, c.input("b", b)?], &[Some(shape)]))
}

fn plan_softmax(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    c.float("x")?;
    let shape = c.tensor("x")?.shape.clone();
    Ok(single(c, softmax(&x, c.target)?, vec![c.input("x", x)?], &[Some(shape)]))
}

fn plan_rmsnorm(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    c.float("x")?;
    let w = c.row_vector("weight", x.shape[1])?;
    let eps = c.statics.f64("eps").unwrap_or(RMSNORM_EPS as f64) as f32;
    let kernel = rmsnorm(&x, &w, eps, c.target)?;
    let shape = c.tensor("x")?.shape.clone();
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("weight", w)?], &[Some(shape)]))
}

/// `names` seen as `[rows, n]`, all of the first one's shape and dtype.
fn rows_alike(c: &Call, names: &[&str]) -> Result<Type, KernelError> {
    let first = c.rows(names[0])?;
    c.float(names[0])?;
    for &name in &names[1..] {
        let (t, want) = (c.tensor(name)?, c.tensor(names[0])?);
        if t != want {
            return Err(c.err(format!("input `{name}`"), "operand-shape", format!("{name} is {t}, {} is {want}", names[0]), format!("pass {name} with {}'s shape and dtype", names[0])));
        }
    }
    Ok(first)
}

fn plan_geglu(c: &Call) -> Result<Plan, KernelError> {
    let a = rows_alike(c, &["a", "b"])?;
    let shape = Some(c.tensor("a")?.shape.clone());
    let kernel = geglu_kernel(a.clone(), a.clone(), a.clone(), rows(&a, c.target))?;
    Ok(single(c, kernel, vec![c.input("a", a.clone())?, c.input("b", a)?], &[shape]))
}

fn plan_geglu_bwd(c: &Call) -> Result<Plan, KernelError> {
    let a = rows_alike(c, &["a", "b", "dy"])?;
    let shape = Some(c.tensor("a")?.shape.clone());
    let kernel = geglu_bwd_kernel(a.clone(), a.clone(), a.clone(), a.clone(), a.clone(), rows(&a, c.target))?;
    Ok(single(c, kernel, vec![c.input("a", a.clone())?, c.input("b", a.clone())?, c.input("dy", a)?], &[shape.clone(), shape]))
}

/// `gelu_tanh(a) * b` and its derivatives in f64, from the formula.
fn gelu_tanh(z: f64) -> (f64, f64) {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let u = c * (z + 0.044715 * z.powi(3));
    let t = u.tanh();
    (0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z))
}

fn ref_geglu(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![x[0].iter().zip(&x[1]).map(|(&z, &b)| gelu_tanh(z).0 * b).collect()]
}

fn ref_geglu_bwd(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let da = (0..x[0].len()).map(|i| x[2][i] * x[1][i] * gelu_tanh(x[0][i]).1).collect();
    let db = (0..x[0].len()).map(|i| x[2][i] * gelu_tanh(x[0][i]).0).collect();
    vec![da, db]
}

fn ref_gelu_affine(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::gelu_affine(&x[0], &x[1], &x[2], last_dim(&a[0]))]
}

fn ref_softmax(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    vec![reference::softmax(&a[0].to_f64_vec(), last_dim(&a[0]))]
}

fn ref_rmsnorm(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::rmsnorm(&x[0], &x[1], last_dim(&a[0]), s.f64("eps").unwrap_or(RMSNORM_EPS as f64) as f32 as f64)]
}

const ROW: Input = Input { name: "x", dims: "[..., n]", kind: Kind::Float };
const LIKE_X: &[Output] = &[Output { name: "out", shape: "x", dtype: "x" }];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "geglu",
        doc: "GeGLU gate: gelu(a) * b (tanh approximation), the math in f32",
        schema: "(Tensor a, Tensor b) -> Tensor",
        inputs: &[Input { name: "a", dims: "[..., n]", kind: Kind::Float }, Input { name: "b", dims: "[..., n]", kind: Kind::Float }],
        outputs: &[Output { name: "out", shape: "a", dtype: "a" }],
        plan: plan_geglu,
        backward: Some(crate::op::Backward { op: "geglu_bwd", args: "a, b, d_out", grads: &["a", "b"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 2816], &[1024, 2816]] }, Case { name: "alt", statics: "", shapes: &[&[24, 640], &[24, 640]] }],
        random: None,
        reference: Some(ref_geglu),
        alias_of: None,
    },
    Op {
        name: "geglu_bwd",
        doc: "(da, db) of geglu: da = dy * b * gelu'(a), db = dy * gelu(a)",
        schema: "(Tensor a, Tensor b, Tensor dy) -> (Tensor, Tensor)",
        inputs: &[Input { name: "a", dims: "[..., n]", kind: Kind::Float }, Input { name: "b", dims: "[..., n]", kind: Kind::Float }, Input { name: "dy", dims: "[..., n]", kind: Kind::Float }],
        outputs: &[Output { name: "da", shape: "a", dtype: "a" }, Output { name: "db", shape: "a", dtype: "a" }],
        plan: plan_geglu_bwd,
        backward: None,
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 2816], &[1024, 2816], &[1024, 2816]] }, Case { name: "alt", statics: "", shapes: &[&[24, 640], &[24, 640], &[24, 640]] }],
        random: None,
        reference: Some(ref_geglu_bwd),
        alias_of: None,
    },
    Op {
        name: "gelu_affine",
        doc: "gelu(x * a + b) (tanh approximation), a and b [n] broadcast over rows",
        schema: "(Tensor x, Tensor a, Tensor b) -> Tensor",
        inputs: &[ROW, Input { name: "a", dims: "[n]", kind: Kind::Float }, Input { name: "b", dims: "[n]", kind: Kind::Float }],
        outputs: LIKE_X,
        plan: plan_gelu_affine,
        backward: None,
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[256, 640], &[640], &[640]] }],
        random: None,
        reference: Some(ref_gelu_affine),
        alias_of: None,
    },
    Op {
        name: "softmax",
        doc: "softmax over the last dim",
        schema: "(Tensor x) -> Tensor",
        inputs: &[ROW],
        outputs: LIKE_X,
        plan: plan_softmax,
        backward: None,
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[96, 2048]] }],
        random: None,
        reference: Some(ref_softmax),
        alias_of: None,
    },
    Op {
        name: "rmsnorm",
        doc: "RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight",
        schema: "(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
        inputs: &[ROW, Input { name: "weight", dims: "[n]", kind: Kind::Float }],
        outputs: LIKE_X,
        plan: plan_rmsnorm,
        backward: Some(crate::op::Backward { op: "rmsnorm_bwd", args: "x, weight, d_out, eps", grads: &["x", "weight"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[48, 4096], &[4096]] }],
        random: None,
        reference: Some(ref_rmsnorm),
        alias_of: None,
    },
];
