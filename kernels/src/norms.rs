//! Normalisation and gated-activation kernels of a Llama-style block, forward and
//! backward: fused residual-add RMSNorm, LayerNorm, RMSNorm backward, SwiGLU and its
//! backward.
//!
//! All are row-blocked like `elementwise.rs`: each grid step owns `bt` whole rows, so the
//! per-row reductions never cross blocks. Math runs in f32 whatever the storage dtype.
//!
//! Block rule ([`row_tiles`]): `bt` rows with about `min(1 MiB, scoped VMEM / (4 * streams))`
//! of f32 per block *as laid out* (lanes padded to 128), where `streams` counts the op's
//! row-blocked `[t, d]` operands (inputs and outputs): each is double-buffered by the
//! pipeline and the body keeps about as many f32 temporaries again, so `4 * streams`
//! blocks fit the target's default scoped VMEM. `bt` is a multiple of the dtype's sublane
//! tiling (`Target::tiling`: 8, or 16 for bf16 on tpu7x), or all of `t`; the last block
//! may be partial. Rows too wide for `bt` of them at that budget run as two passes over
//! column blocks (`wide_rows.rs`); the GLU and add kernels tile columns directly.
//!
//! `rmsnorm_bwd`'s weight gradient sums over every row. It is accumulated in an f32
//! `[1, d]` VMEM scratch across the row axis, which is therefore `arbitrary`, and written
//! once at the last step: one kernel, no host pass and no `[t / bt, d]` partials in HBM.
//! The price is that the row axis is not split across the two TensorCores of v5p/tpu7x.

use tessera_dsl::interp::Array;
use tessera_dsl::{Executor, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::blocks::{row_tiles, RowTiles};
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{result, single, Launch, Operand, Plan};
use crate::wide_rows;
use crate::{f64s, last_dim, RMSNORM_EPS};

/// LayerNorm's epsilon in the library entry (PyTorch's default; the builders take any).
pub const LAYERNORM_EPS: f32 = 1e-5;

// ---- kernels ------------------------------------------------------------------------------

/// `v - mean(v)` along rows of `len` values, by the corrected two-pass algorithm: subtract the computed mean, then the
/// mean of what is left. No `E[x^2] - E[x]^2` cancellation, and the rounding error of the
/// first mean (large when the row mean is) is removed: a constant row centres to exactly 0,
/// as in torch, instead of to one ulp of the mean that `rsqrt(var + eps)` magnifies.
#[tpu_fn]
pub fn centre(v: Value, len: usize) -> Value {
    let first = v - v.sum(1) * (1.0 / len as f32);
    first - first.sum(1) * (1.0 / len as f32)
}

#[tpu_kernel(
    grid = [t.div_ceil(bt)],
    semantics = [parallel],
    (x, residual, out, new_residual) = block([bt, d], |i| [i, 0]),
    w = block([1, d], |i| [0, 0]),
)]
pub fn rmsnorm_residual_kernel(x: In<t, d>, residual: In<t, d>, w: In<1, d>, out: Out<t, d>, new_residual: Out<t, d>, bt: usize, eps: f32) {
    // Normalise the f32 sum, not its rounded copy: one rounding fewer for bf16 storage.
    let h = x[..].cast(f32) + residual[..].cast(f32);
    new_residual[..] = h.cast(new_residual.dtype);
    let mean_sq = (h * h).sum(1) * (1.0 / d as f32);
    out[..] = (h * (mean_sq + eps).rsqrt() * w[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [t.div_ceil(bt)],
    semantics = [parallel],
    (x, out) = block([bt, d], |i| [i, 0]),
    (w, b) = block([1, d], |i| [0, 0]),
)]
pub fn layernorm_kernel(x: In<t, d>, w: In<1, d>, b: In<1, d>, out: Out<t, d>, bt: usize, eps: f32) {
    let v = x[..].cast(f32);
    let centred = centre(v, d);
    let var = (centred * centred).sum(1) * (1.0 / d as f32);
    out[..] = (centred * (var + eps).rsqrt() * w[..].cast(f32) + b[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [t.div_ceil(bt)],
    semantics = [arbitrary],
    (x, dy, dx) = block([bt, d], |i| [i, 0]),
    (w, dw) = block([1, d], |i| [0, 0]),
    dw_acc = scratch([1, d], f32),
)]
pub fn rmsnorm_bwd_kernel(x: In<t, d>, w: In<1, d>, dy: In<t, d>, dx: Out<t, d>, dw: Out<1, d>, dw_acc: Scratch, bt: usize, eps: f32) {
    // y = x * r * w with r = rsqrt(mean(x^2) + eps), so per row
    // dx = r * (dy * w) - x * r^3 * mean(dy * w * x) and dw = sum over rows of dy * x * r.
    let v = x[..].cast(f32);
    let g = dy[..].cast(f32);
    let gw = g * w[..].cast(f32);
    let r = ((v * v).sum(1) * (1.0 / d as f32) + eps).rsqrt();
    let c = (gw * v).sum(1) * (1.0 / d as f32);
    dx[..] = (r * gw - v * (r * r * r) * c).cast(dx.dtype);
    if program_id(0) == 0 {
        dw_acc[..] = zeros([1, d], f32);
    }
    let mut part = g * v * r;
    if !t.is_multiple_of(bt) {
        // Rows past `t` in the last block are garbage: keep them out of the sum.
        part = select(iota([bt, d], 0) + program_id(0) * (bt as i32) < (t as i32), part, 0.0);
    }
    dw_acc[..] += part.sum(0);
    if program_id(0) == num_programs(0) - 1 {
        dw[..] = dw_acc[..].cast(dw.dtype);
    }
}

#[tpu_kernel(
    grid = [t.div_ceil(bt)],
    semantics = [arbitrary],
    (x, dy, dx) = block([bt, d], |i| [i, 0]),
    (w, dw, db) = block([1, d], |i| [0, 0]),
    (dw_acc, db_acc) = scratch([1, d], f32),
)]
pub fn layernorm_bwd_kernel(x: In<t, d>, w: In<1, d>, dy: In<t, d>, dx: Out<t, d>, dw: Out<1, d>, db: Out<1, d>, dw_acc: Scratch, db_acc: Scratch, bt: usize, eps: f32) {
    // y = xhat * w + b, xhat = (x - mean) * rstd, so per row with g = dy * w:
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dw, db = sums over rows of dy * xhat, dy.
    let centred = centre(x[..].cast(f32), d);
    let rstd = ((centred * centred).sum(1) * (1.0 / d as f32) + eps).rsqrt();
    let xhat = centred * rstd;
    let mut g = dy[..].cast(f32);
    let gw = g * w[..].cast(f32);
    let c1 = gw.sum(1) * (1.0 / d as f32);
    let c2 = (gw * xhat).sum(1) * (1.0 / d as f32);
    dx[..] = (rstd * (gw - c1 - xhat * c2)).cast(dx.dtype);
    if program_id(0) == 0 {
        dw_acc[..] = zeros([1, d], f32);
        db_acc[..] = zeros([1, d], f32);
    }
    let mut part = g * xhat;
    if !t.is_multiple_of(bt) {
        // Rows past `t` in the last block are garbage: keep them out of the sums.
        let live = iota([bt, d], 0) + program_id(0) * (bt as i32) < (t as i32);
        part = select(live, part, 0.0);
        g = select(live, g, 0.0);
    }
    dw_acc[..] += part.sum(0);
    db_acc[..] += g.sum(0);
    if program_id(0) == num_programs(0) - 1 {
        dw[..] = dw_acc[..].cast(dw.dtype);
        db[..] = db_acc[..].cast(db.dtype);
    }
}

/// The gated linear units: `act(a) * b` with `act` SiLU (SwiGLU) or tanh-approximated
/// GELU (GeGLU), one body for the family.
#[tpu_kernel(
    name = if gelu { "geglu_kernel" } else { "swiglu_kernel" },
    grid = [t.div_ceil(bt), f.div_ceil(bf)],
    semantics = [parallel, parallel],
    (a, b, out) = block([bt, bf], |i, j| [i, j]),
)]
pub fn glu_kernel(a: In<t, f>, b: In<t, f>, out: Out<t, f>, bt: usize, bf: usize, gelu: bool) {
    let av = a[..].cast(f32);
    if gelu {
        let th = (GELU_C * (av + 0.044715 * av * av * av)).tanh();
        out[..] = (0.5 * av * (1.0 + th) * b[..].cast(f32)).cast(out.dtype);
    } else {
        out[..] = (av * sigmoid(av) * b[..].cast(f32)).cast(out.dtype);
    }
}

/// `(da, db)` of [`glu_kernel`]: `db = dy * act(a)`, `da = dy * b * act'(a)`.
#[tpu_kernel(
    name = if gelu { "geglu_bwd_kernel" } else { "swiglu_bwd_kernel" },
    grid = [t.div_ceil(bt), f.div_ceil(bf)],
    semantics = [parallel, parallel],
    (a, b, dy, da, db) = block([bt, bf], |i, j| [i, j]),
)]
pub fn glu_bwd_kernel(a: In<t, f>, b: In<t, f>, dy: In<t, f>, da: Out<t, f>, db: Out<t, f>, bt: usize, bf: usize, gelu: bool) {
    let av = a[..].cast(f32);
    let g = dy[..].cast(f32);
    if gelu {
        // gelu(a) = a * h, h = (1 + tanh(u)) / 2, u = c * (a + 0.044715 a^3):
        // gelu'(a) = h + a * (1 - tanh(u)^2) / 2 * c * (1 + 3 * 0.044715 a^2).
        let th = (GELU_C * (av + 0.044715 * av * av * av)).tanh();
        db[..] = (g * 0.5 * av * (1.0 + th)).cast(db.dtype);
        let dact = 0.5 * (1.0 + th) + 0.5 * av * (1.0 - th * th) * GELU_C * (1.0 + 0.134145 * av * av);
        da[..] = (g * b[..].cast(f32) * dact).cast(da.dtype);
    } else {
        let sg = sigmoid(av);
        db[..] = (g * av * sg).cast(db.dtype);
        // d silu(a) / da = s + a * s * (1 - s) = s * (1 + a * (1 - s)).
        da[..] = (g * b[..].cast(f32) * sg * (1.0 + av * (1.0 - sg))).cast(da.dtype);
    }
}

#[tpu_kernel(
    grid = [t.div_ceil(bt), d.div_ceil(bd)],
    semantics = [parallel, parallel],
    (a, b, out) = block([bt, bd], |i, j| [i, j]),
)]
pub fn add_kernel(a: In<t, d>, b: In<t, d>, out: Out<t, d>, bt: usize, bd: usize) {
    out[..] = (a[..].cast(f32) + b[..].cast(f32)).cast(out.dtype);
}

// ---- kernels with the target's blocks -----------------------------------------------------

/// Row-blocked `[t, d]` operands (inputs and outputs) of each row-reduction kernel.
const RESIDUAL_STREAMS: usize = 4;
const LAYERNORM_STREAMS: usize = 2;
const BWD_STREAMS: usize = 3;

/// The op kernels with default blocks for a target, from operand types (what `emit` lowers).
pub mod build {
    use super::*;

    /// `(out, new_residual)` of the fused residual-add RMSNorm.
    /// `(out, new_residual)` of the fused residual-add RMSNorm (whole rows).
    pub fn rmsnorm_residual(x: &Type, residual: &Type, w: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        rmsnorm_residual_kernel(x.clone(), residual.clone(), w.clone(), x.clone(), x.clone(), row_tiles(x, RESIDUAL_STREAMS, target).bm, eps)
    }

    /// LayerNorm (whole rows).
    pub fn layernorm(x: &Type, w: &Type, b: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        layernorm_kernel(x.clone(), w.clone(), b.clone(), x.clone(), row_tiles(x, LAYERNORM_STREAMS, target).bm, eps)
    }

    /// `(dx, dw)`; `dw` has `w`'s type (whole rows).
    pub fn rmsnorm_bwd(x: &Type, w: &Type, dy: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        rmsnorm_bwd_kernel(x.clone(), w.clone(), dy.clone(), x.clone(), w.clone(), row_tiles(x, BWD_STREAMS, target).bm, eps)
    }

    /// `act(a) * b` (SwiGLU, or GeGLU with `gelu`).
    pub fn glu(a: &Type, b: &Type, gelu: bool, target: &Target) -> Result<Kernel, KernelError> {
        let RowTiles { bm, bn } = row_tiles(a, 3, target);
        glu_kernel(a.clone(), b.clone(), a.clone(), bm, bn, gelu)
    }

    /// `a + b` (summed in f32, as the backward kernels accumulate).
    pub fn add(a: &Type, target: &Target) -> Result<Kernel, KernelError> {
        let RowTiles { bm, bn } = row_tiles(a, 3, target);
        add_kernel(a.clone(), a.clone(), a.clone(), bm, bn)
    }

    /// `(da, db)`.
    pub fn glu_bwd(a: &Type, b: &Type, dy: &Type, gelu: bool, target: &Target) -> Result<Kernel, KernelError> {
        let RowTiles { bm, bn } = row_tiles(a, 5, target);
        glu_bwd_kernel(a.clone(), b.clone(), dy.clone(), a.clone(), a.clone(), bm, bn, gelu)
    }
}

// ---- ops on arrays (through the op table) ---------------------------------------------------

fn run2(exec: &dyn Executor, op: &str, inputs: &[&Array], statics: &str, target: &Target) -> Result<(Array, Array), KernelError> {
    let mut out = crate::run(exec, op, inputs, statics, target)?.into_iter();
    match (out.next(), out.next()) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(KernelError::new(op, "outputs", "output-count", "expected 2 results", "report this as a library bug")),
    }
}

/// `(rmsnorm(x + residual) * w, x + residual)`.
pub fn rmsnorm_residual(exec: &dyn Executor, x: &Array, residual: &Array, w: &Array, eps: f32, target: &Target) -> Result<(Array, Array), KernelError> {
    run2(exec, "rmsnorm_residual", &[x, residual, w], &format!("eps={eps:?}"), target)
}

/// `(x - mean) / sqrt(var + eps) * w + b` per row (biased variance).
pub fn layernorm(exec: &dyn Executor, x: &Array, w: &Array, b: &Array, eps: f32, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "layernorm", &[x, w, b], &format!("eps={eps:?}"), target)
}

/// `(dx, dw)` of `y = rmsnorm(x) * w` given `dy`.
pub fn rmsnorm_bwd(exec: &dyn Executor, x: &Array, w: &Array, dy: &Array, eps: f32, target: &Target) -> Result<(Array, Array), KernelError> {
    run2(exec, "rmsnorm_bwd", &[x, w, dy], &format!("eps={eps:?}"), target)
}

/// `silu(a) * b`.
pub fn swiglu(exec: &dyn Executor, a: &Array, b: &Array, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "swiglu", &[a, b], "", target)
}

/// `(da, db)` of `y = silu(a) * b` given `dy`.
pub fn swiglu_bwd(exec: &dyn Executor, a: &Array, b: &Array, dy: &Array, target: &Target) -> Result<(Array, Array), KernelError> {
    run2(exec, "swiglu_bwd", &[a, b, dy], "", target)
}

// ---- ops ------------------------------------------------------------------------------------

fn eps(c: &Call, default: f32) -> f32 {
    c.statics.f64("eps").unwrap_or(default as f64) as f32
}

/// Tensor inputs `names` (of one shape, by the op's dims) seen as `[rows, d]`, all of
/// `names[0]`'s dtype (the kernels stream them with one row tiling).
fn same_rows(c: &Call, names: &[&str]) -> Result<Type, KernelError> {
    let first = c.rows(names[0])?;
    for &n in &names[1..] {
        let t = c.tensor(n)?;
        if t.dtype != first.dtype {
            return Err(c.err(format!("input `{n}`"), "operand-dtype", format!("{n} is {t}, {} is {}", names[0], c.tensor(names[0])?), format!("pass {n} of {}'s dtype ({})", names[0], first.dtype)));
        }
    }
    Ok(first)
}

fn plan_rmsnorm_residual(c: &Call) -> Result<Plan, KernelError> {
    let x = same_rows(c, &["x", "residual"])?;
    let w = c.row_vector("weight", x.shape[1])?;
    let shape = c.tensor("x")?.shape.clone();
    let (x_in, r_in, w_in) = (c.input("x", x.clone())?, c.input("residual", x.clone())?, c.input("weight", w.clone())?);
    let tiles = row_tiles(&x, RESIDUAL_STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        // h = x + residual (stored: it is `new_residual`), then RMSNorm of the stored h
        // in two passes (what torch computes too: the norm of the rounded sum).
        let mut launches = vec![Launch::new(build::add(&x, c.target)?, vec![x_in, r_in])];
        let out = wide_rows::rmsnorm_launches(&mut launches, &x, result(0, 0, x.clone()), &w, w_in, eps(c, RMSNORM_EPS), tiles, c.op, c.target)?;
        let ty = Type::vector(x.dtype, &shape);
        return Ok(Plan::new(c.op, c.target, launches, vec![result(out, 0, ty.clone()), result(0, 0, ty)]));
    }
    let kernel = build::rmsnorm_residual(&x, &x, &w, eps(c, RMSNORM_EPS), c.target)?;
    Ok(single(c, kernel, vec![x_in, r_in, w_in], &[Some(shape.clone()), Some(shape)]))
}

/// The launches of `rmsnorm_bwd(x, w, dy)`, whole rows or in two passes; returns the
/// index of the launch whose outputs are `(dx, dw)`.
fn rmsnorm_bwd_launches(c: &Call, launches: &mut Vec<Launch>, x: &Type, ins: [Operand; 3], w: &Type) -> Result<usize, KernelError> {
    let tiles = row_tiles(x, BWD_STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        return wide_rows::rmsnorm_bwd_launches(launches, x, ins, w, eps(c, RMSNORM_EPS), tiles, c.op);
    }
    launches.push(Launch::new(build::rmsnorm_bwd(x, w, x, eps(c, RMSNORM_EPS), c.target)?, ins.into()));
    Ok(launches.len() - 1)
}

/// rmsnorm_bwd on `h`, then `dx + d_new_residual` (the residual stream's own gradient).
fn plan_rmsnorm_residual_bwd(c: &Call) -> Result<Plan, KernelError> {
    let h = same_rows(c, &["h", "dout", "dh"])?;
    let w = c.row_vector("weight", h.shape[1])?;
    let mut launches = Vec::new();
    let bwd = rmsnorm_bwd_launches(c, &mut launches, &h, [c.input("h", h.clone())?, c.input("weight", w.clone())?, c.input("dout", h.clone())?], &w)?;
    launches.push(Launch::new(build::add(&h, c.target)?, vec![result(bwd, 0, h.clone()), c.input("dh", h.clone())?]));
    let shape = c.tensor("h")?.shape.clone();
    let results = vec![result(bwd + 1, 0, Type::vector(h.dtype, &shape)), result(bwd, 1, c.tensor("weight")?.clone())];
    Ok(Plan::new(c.op, c.target, launches, results))
}

fn plan_layernorm(c: &Call) -> Result<Plan, KernelError> {
    let x = same_rows(c, &["x"])?;
    let (w, b) = (c.row_vector("weight", x.shape[1])?, c.row_vector("bias", x.shape[1])?);
    let shape = c.tensor("x")?.shape.clone();
    let ins = [c.input("x", x.clone())?, c.input("weight", w.clone())?, c.input("bias", b.clone())?];
    let tiles = row_tiles(&x, LAYERNORM_STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        return wide_rows::layernorm(c, &x, ins, &w, eps(c, LAYERNORM_EPS), tiles, shape);
    }
    let kernel = build::layernorm(&x, &w, &b, eps(c, LAYERNORM_EPS), c.target)?;
    Ok(single(c, kernel, ins.into(), &[Some(shape)]))
}

fn plan_layernorm_bwd(c: &Call) -> Result<Plan, KernelError> {
    let x = same_rows(c, &["x", "dy"])?;
    let w = c.row_vector("weight", x.shape[1])?;
    let eps = eps(c, LAYERNORM_EPS);
    let ins = [c.input("x", x.clone())?, c.input("weight", w.clone())?, c.input("dy", x.clone())?];
    let (dx_ty, w_ty) = (Type::vector(x.dtype, &c.tensor("x")?.shape), c.tensor("weight")?.clone());
    // dbias has the bias's shape ([d] or [1, d], whichever weight's is) when it is given.
    let b_ty = if c.given("bias") {
        c.row_vector("bias", x.shape[1])?;
        Type::vector(w_ty.dtype, &c.tensor("bias")?.shape)
    } else {
        w_ty.clone()
    };
    let tiles = row_tiles(&x, BWD_STREAMS, c.target);
    if !tiles.whole_rows(x.shape[1]) {
        // The apply pass also streams dw and db, and keeps their f32 sums: [1, bn] rows
        // that pad to whole sublane tiles, so they count as two more streams.
        let mut launches = Vec::new();
        let bwd = wide_rows::layernorm_bwd_launches(&mut launches, &x, ins, &w, eps, row_tiles(&x, BWD_STREAMS + 2, c.target), c.op)?;
        let results = vec![result(bwd, 0, dx_ty), result(bwd, 1, w_ty), result(bwd, 2, b_ty)];
        return Ok(Plan::new(c.op, c.target, launches, results));
    }
    let kernel = layernorm_bwd_kernel(x.clone(), w.clone(), x.clone(), x.clone(), w.clone(), w.clone(), tiles.bm, eps)?;
    let shapes = [Some(dx_ty.shape), Some(w_ty.shape), Some(b_ty.shape)];
    Ok(single(c, kernel, ins.into(), &shapes))
}

fn plan_rmsnorm_bwd(c: &Call) -> Result<Plan, KernelError> {
    let x = same_rows(c, &["x", "dy"])?;
    let w = c.row_vector("weight", x.shape[1])?;
    let mut launches = Vec::new();
    let bwd = rmsnorm_bwd_launches(c, &mut launches, &x, [c.input("x", x.clone())?, c.input("weight", w.clone())?, c.input("dy", x.clone())?], &w)?;
    let results = vec![result(bwd, 0, Type::vector(x.dtype, &c.tensor("x")?.shape)), result(bwd, 1, c.tensor("weight")?.clone())];
    Ok(Plan::new(c.op, c.target, launches, results))
}

fn plan_glu(c: &Call, gelu: bool) -> Result<Plan, KernelError> {
    let a = same_rows(c, &["a", "b"])?;
    let shape = Some(c.tensor("a")?.shape.clone());
    Ok(single(c, build::glu(&a, &a, gelu, c.target)?, vec![c.input("a", a.clone())?, c.input("b", a)?], &[shape]))
}

fn plan_glu_bwd(c: &Call, gelu: bool) -> Result<Plan, KernelError> {
    let a = same_rows(c, &["a", "b", "dy"])?;
    let shape = Some(c.tensor("a")?.shape.clone());
    let kernel = build::glu_bwd(&a, &a, &a, gelu, c.target)?;
    Ok(single(c, kernel, vec![c.input("a", a.clone())?, c.input("b", a.clone())?, c.input("dy", a)?], &[shape.clone(), shape]))
}

fn eps_of(s: &Statics, default: f32) -> f64 {
    s.f64("eps").unwrap_or(default as f64) as f32 as f64
}

fn ref_rmsnorm_residual(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (out, h) = reference::rmsnorm_residual(&x[0], &x[1], &x[2], last_dim(&a[0]), eps_of(s, RMSNORM_EPS));
    vec![out, h]
}

fn ref_rmsnorm_residual_bwd(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (dx, dw) = reference::rmsnorm_bwd(&x[0], &x[1], &x[2], last_dim(&a[0]), eps_of(s, RMSNORM_EPS));
    vec![dx.iter().zip(&x[3]).map(|(a, b)| a + b).collect(), dw]
}

fn ref_layernorm_bwd(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (dx, dw, db) = reference::layernorm_bwd(&x[0], &x[1], &x[2], last_dim(&a[0]), eps_of(s, LAYERNORM_EPS));
    vec![dx, dw, db]
}

fn ref_layernorm(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![reference::layernorm(&x[0], &x[1], &x[2], last_dim(&a[0]), eps_of(s, LAYERNORM_EPS))]
}

fn ref_rmsnorm_bwd(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (dx, dw) = reference::rmsnorm_bwd(&x[0], &x[1], &x[2], last_dim(&a[0]), eps_of(s, RMSNORM_EPS));
    vec![dx, dw]
}

fn ref_glu(a: &[Array], gelu: bool) -> Vec<Vec<f64>> {
    let x = f64s(a);
    vec![if gelu { reference::geglu(&x[0], &x[1]) } else { reference::swiglu(&x[0], &x[1]) }]
}

fn ref_glu_bwd(a: &[Array], gelu: bool) -> Vec<Vec<f64>> {
    let x = f64s(a);
    let (da, db) = if gelu { reference::geglu_bwd(&x[0], &x[1], &x[2]) } else { reference::swiglu_bwd(&x[0], &x[1], &x[2]) };
    vec![da, db]
}

/// `sqrt(2 / pi)`, of the tanh-approximated GELU.
const GELU_C: f64 = 0.7978845608028654;

/// The GLU family's entries (`act(a) * b` and its backward) for one activation.
const fn glu_ops(name: &'static str, bwd: &'static str, doc: &'static str, bwd_doc: &'static str, gelu: bool) -> [Op; 2] {
    const ROWS: &[Input] = &[rows("a"), rows("b")];
    const BWD_ROWS: &[Input] = &[rows("a"), rows("b"), rows("dy")];
    const OUT: &[Output] = &[like("out", "a")];
    const GRADS: &[Output] = &[like("da", "a"), like("db", "a")];
    const CASES: &[Case] = &[Case { name: "default", statics: "", shapes: &[&[1024, 2816], &[1024, 2816]] }, Case { name: "alt", statics: "", shapes: &[&[200, 1408], &[200, 1408]] }];
    const BWD_CASES: &[Case] = &[Case { name: "default", statics: "", shapes: &[&[1024, 2816], &[1024, 2816], &[1024, 2816]] }, Case { name: "alt", statics: "", shapes: &[&[1, 4096], &[1, 4096], &[1, 4096]] }];
    let (plan, plan_bwd): (crate::op::PlanFn, crate::op::PlanFn) = if gelu { (|c| plan_glu(c, true), |c| plan_glu_bwd(c, true)) } else { (|c| plan_glu(c, false), |c| plan_glu_bwd(c, false)) };
    let (reference, reference_bwd): (crate::op::ReferenceFn, crate::op::ReferenceFn) = if gelu { (|a, _| ref_glu(a, true), |a, _| ref_glu_bwd(a, true)) } else { (|a, _| ref_glu(a, false), |a, _| ref_glu_bwd(a, false)) };
    [
        Op { name, doc, schema: "(Tensor a, Tensor b) -> Tensor", plan, reference: Some(reference), inputs: ROWS, outputs: OUT, backward: Some(Backward { op: bwd, args: "a, b, d_out", grads: &["a", "b"] }), cases: CASES, ..Op::EMPTY },
        Op { name: bwd, doc: bwd_doc, schema: "(Tensor a, Tensor b, Tensor dy) -> (Tensor, Tensor)", plan: plan_bwd, reference: Some(reference_bwd), inputs: BWD_ROWS, outputs: GRADS, cases: BWD_CASES, ..Op::EMPTY },
    ]
}
const SWIGLU: [Op; 2] = glu_ops("swiglu", "swiglu_bwd", "SwiGLU gate: silu(a) * b, silu(a) = a * sigmoid(a)", "(da, db) of swiglu: db = dy * silu(a), da = dy * b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))", false);
const GEGLU: [Op; 2] = glu_ops("geglu", "geglu_bwd", "GeGLU gate: gelu(a) * b (tanh approximation), the math in f32", "(da, db) of geglu: da = dy * b * gelu'(a), db = dy * gelu(a)", true);

const fn rows(name: &'static str) -> Input {
    Input { name, dims: "[..., d]", kind: Kind::Float }
}
/// `[d]`, or the kernels' `[1, d]` (see `Call::row_vector`); not a `[]` for d = 1.
const WEIGHT: Input = Input { name: "weight", dims: "[1?, d]", kind: Kind::Float };
const fn like(name: &'static str, of: &'static str) -> Output {
    Output { name, shape: of, dtype: of }
}

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "rmsnorm_residual", doc: "fused residual add + RMSNorm: h = x + residual; (rmsnorm(h) * weight, h)", schema: "(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)", plan: plan_rmsnorm_residual, reference: Some(ref_rmsnorm_residual),
        inputs: &[rows("x"), rows("residual"), WEIGHT], outputs: &[like("out", "x"), like("new_residual", "x")],
        backward: Some(Backward { op: "rmsnorm_residual_bwd", args: "new_residual, weight, d_out, d_new_residual, eps", grads: &["x residual", "weight"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024, 1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[40, 5120], &[40, 5120], &[5120]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[6, 300_000], &[300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "rmsnorm_residual_bwd", doc: "(dx, dweight) of rmsnorm_residual from h = x + residual: rmsnorm_bwd(h) + dh (dx is also the residual's gradient)", schema: "(Tensor h, Tensor weight, Tensor dout, Tensor dh, float eps=1e-06) -> (Tensor, Tensor)", plan: plan_rmsnorm_residual_bwd, reference: Some(ref_rmsnorm_residual_bwd),
        inputs: &[rows("h"), WEIGHT, rows("dout"), rows("dh")], outputs: &[like("dx", "h"), like("dweight", "weight")],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024, 1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[40, 5120], &[5120], &[40, 5120], &[40, 5120]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[300_000], &[6, 300_000], &[6, 300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "layernorm", doc: "LayerNorm over the last dim, (x - mean) / sqrt(var + eps) * weight + bias (biased variance)", schema: "(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> Tensor", plan: plan_layernorm, reference: Some(ref_layernorm),
        inputs: &[rows("x"), WEIGHT, Input { name: "bias", dims: "[1?, d]", kind: Kind::Float }], outputs: &[like("out", "x")],
        backward: Some(Backward { op: "layernorm_bwd", args: "x, weight, d_out, eps, bias", grads: &["x", "weight", "bias"] }),
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024]] }, Case { name: "alt", statics: "", shapes: &[&[300, 640], &[640], &[640]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[300_000], &[300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "layernorm_bwd", doc: "(dx, dweight, dbias) of layernorm: dx per row; dweight and dbias summed over rows in f32 VMEM scratch along the (arbitrary) row axis; dbias has bias's shape when bias is given (only its shape is read), else weight's", schema: "(Tensor x, Tensor weight, Tensor dy, float eps=1e-05, Tensor? bias=None) -> (Tensor, Tensor, Tensor)", plan: plan_layernorm_bwd, reference: Some(ref_layernorm_bwd),
        inputs: &[rows("x"), WEIGHT, rows("dy"), Input { name: "bias", dims: "[1?, d]", kind: Kind::Float }], outputs: &[like("dx", "x"), like("dweight", "weight"), Output { name: "dbias", shape: "bias | weight", dtype: "weight" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[300, 640], &[640], &[300, 640]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[300_000], &[6, 300_000]] }], ..Op::EMPTY
    },
    Op {
        name: "rmsnorm_bwd", doc: "(dx, dweight) of rmsnorm: dx per row; dweight summed over rows in an f32 VMEM scratch along the (arbitrary) row axis", schema: "(Tensor x, Tensor weight, Tensor dy, float eps=1e-06) -> (Tensor, Tensor)", plan: plan_rmsnorm_bwd, reference: Some(ref_rmsnorm_bwd),
        inputs: &[rows("x"), WEIGHT, rows("dy")], outputs: &[like("dx", "x"), like("dweight", "weight")],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 1024], &[1024], &[1024, 1024]] }, Case { name: "alt", statics: "", shapes: &[&[512, 1536], &[1536], &[512, 1536]] }, Case { name: "wide", statics: "", shapes: &[&[6, 300_000], &[300_000], &[6, 300_000]] }], ..Op::EMPTY
    },
    SWIGLU[0],
    SWIGLU[1],
    GEGLU[0],
    GEGLU[1],
];

/// Independent references: plain f64 loops over row-major data, written from the formulas
/// and sharing no code with the kernels. The backward ones are checked against central
/// differences of the forward ones in the tests.
pub mod reference {
    fn sigmoid(a: f64) -> f64 {
        1.0 / (1.0 + (-a).exp())
    }

    /// `(rmsnorm(x + residual) * w, x + residual)` for rows of length `d`.
    pub fn rmsnorm_residual(x: &[f64], residual: &[f64], w: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
        let h: Vec<f64> = x.iter().zip(residual).map(|(a, b)| a + b).collect();
        let mut out = vec![0.0; h.len()];
        for (row, o) in h.chunks(d).zip(out.chunks_mut(d)) {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let r = 1.0 / (ms + eps).sqrt();
            for j in 0..d {
                o[j] = row[j] * r * w[j];
            }
        }
        (out, h)
    }

    /// LayerNorm of rows of length `d` with biased variance.
    pub fn layernorm(x: &[f64], w: &[f64], b: &[f64], d: usize, eps: f64) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            for j in 0..d {
                o[j] = (row[j] - mean) / (var + eps).sqrt() * w[j] + b[j];
            }
        }
        out
    }

    /// `(dx, dw, db)` of `y = (x - mean) / sqrt(var + eps) * w + b` (biased variance),
    /// rows of length `d`.
    pub fn layernorm_bwd(x: &[f64], w: &[f64], dy: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; d], vec![0.0; d]);
        for ((row, g), out) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
            let c1 = (0..d).map(|j| g[j] * w[j]).sum::<f64>() / d as f64;
            let c2 = (0..d).map(|j| g[j] * w[j] * xhat[j]).sum::<f64>() / d as f64;
            for j in 0..d {
                out[j] = rstd * (g[j] * w[j] - c1 - xhat[j] * c2);
                dw[j] += g[j] * xhat[j];
                db[j] += g[j];
            }
        }
        (dx, dw, db)
    }

    /// `(dx, dw)` of `y = x * rsqrt(mean(x^2) + eps) * w`, rows of length `d`.
    pub fn rmsnorm_bwd(x: &[f64], w: &[f64], dy: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; d];
        for ((row, g), out) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            let c = (0..d).map(|j| g[j] * w[j] * row[j]).sum::<f64>() / d as f64;
            for j in 0..d {
                out[j] = r * g[j] * w[j] - row[j] * r.powi(3) * c;
                dw[j] += g[j] * row[j] * r;
            }
        }
        (dx, dw)
    }

    /// `a * sigmoid(a) * b`.
    pub fn swiglu(a: &[f64], b: &[f64]) -> Vec<f64> {
        a.iter().zip(b).map(|(&a, &b)| a * sigmoid(a) * b).collect()
    }

    /// `gelu_tanh(z)` and its derivative, from the formula.
    fn gelu_tanh(z: f64) -> (f64, f64) {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (z + 0.044715 * z.powi(3))).tanh();
        (0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z))
    }

    /// `gelu_tanh(a) * b`.
    pub fn geglu(a: &[f64], b: &[f64]) -> Vec<f64> {
        a.iter().zip(b).map(|(&a, &b)| gelu_tanh(a).0 * b).collect()
    }

    /// `(da, db)` of `y = gelu_tanh(a) * b`.
    pub fn geglu_bwd(a: &[f64], b: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
        (0..a.len()).map(|i| (dy[i] * b[i] * gelu_tanh(a[i]).1, dy[i] * gelu_tanh(a[i]).0)).unzip()
    }

    /// `(da, db)` of `y = silu(a) * b`.
    pub fn swiglu_bwd(a: &[f64], b: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let mut da = Vec::with_capacity(a.len());
        let mut db = Vec::with_capacity(a.len());
        for i in 0..a.len() {
            let s = sigmoid(a[i]);
            db.push(dy[i] * a[i] * s);
            da.push(dy[i] * b[i] * s * (1.0 + a[i] * (1.0 - s)));
        }
        (da, db)
    }
}
