//! Normalisation and gated-activation kernels of a Llama-style block, forward and
//! backward: fused residual-add RMSNorm, LayerNorm, RMSNorm backward, SwiGLU and its
//! backward.
//!
//! All are row-blocked like `elementwise.rs`: each grid step owns `bt` whole rows, so the
//! per-row reductions never cross blocks and any row length is legal (a block always spans
//! the full last dim). Math runs in f32 whatever the storage dtype.
//!
//! Block rule ([`row_tile`]): `bt` rows with about `min(1 MiB, scoped VMEM / (4 * streams))`
//! of f32 per block, where `streams` counts the op's row-blocked `[t, d]` operands (inputs
//! and outputs): each is double-buffered by the pipeline and the body keeps about as many
//! f32 temporaries again, so `4 * streams` blocks fit the target's default scoped VMEM.
//! `bt` is a multiple of the dtype's sublane tiling (`Target::tiling`: 8, or 16 for bf16
//! on tpu7x) dividing `t`, or all of `t`.
//!
//! `rmsnorm_bwd`'s weight gradient sums over every row. It is accumulated in an f32
//! `[1, d]` VMEM scratch across the row axis, which is therefore `arbitrary`, and written
//! once at the last step: one kernel, no host pass and no `[t / bt, d]` partials in HBM.
//! The price is that the row axis is not split across the two TensorCores of v5p/tpu7x.

use tessera_dsl::interp::{self, Array};
use tessera_dsl::{Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::row_block;
use crate::{f64s, float, uniform_inputs, LibraryKernel, RMSNORM_EPS};

/// LayerNorm's epsilon in the library entry (PyTorch's default; the builders take any).
pub const LAYERNORM_EPS: f32 = 1e-5;

/// Upper bound on f32 bytes per row block (as in `elementwise.rs`).
const MAX_BLOCK_BYTES: usize = 1 << 20;

/// Rows per block for an op over `[t, d]` arrays of `x`'s dtype with `streams` row-blocked
/// operands (see the module docs for the rule).
pub fn row_tile(x: &Type, streams: usize, target: &Target) -> usize {
    let t = x.shape.first().copied().unwrap_or(0);
    let d = x.shape.get(1).copied().unwrap_or(0);
    let bytes = MAX_BLOCK_BYTES.min(target.default_scoped_vmem_bytes / (4 * streams.max(1)));
    row_block(t, d, target.tiling(x.dtype).0, bytes)
}

// ---- kernels ------------------------------------------------------------------------------

#[tpu_kernel(
    grid = [t / bt],
    semantics = [parallel],
    x = block([bt, d], |i| [i, 0]),
    residual = block([bt, d], |i| [i, 0]),
    w = block([1, d], |i| [0, 0]),
    out = block([bt, d], |i| [i, 0]),
    new_residual = block([bt, d], |i| [i, 0]),
)]
pub fn rmsnorm_residual_kernel(x: In<t, d>, residual: In<t, d>, w: In<1, d>, out: Out<t, d>, new_residual: Out<t, d>, bt: usize, eps: f32) {
    // Normalise the f32 sum, not its rounded copy: one rounding fewer for bf16 storage.
    let h = x[..].cast(f32) + residual[..].cast(f32);
    new_residual[..] = h.cast(new_residual.dtype);
    let mean_sq = (h * h).sum(1) * (1.0 / d as f32);
    out[..] = (h * (mean_sq + eps).rsqrt() * w[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [t / bt],
    semantics = [parallel],
    x = block([bt, d], |i| [i, 0]),
    w = block([1, d], |i| [0, 0]),
    b = block([1, d], |i| [0, 0]),
    out = block([bt, d], |i| [i, 0]),
)]
pub fn layernorm_kernel(x: In<t, d>, w: In<1, d>, b: In<1, d>, out: Out<t, d>, bt: usize, eps: f32) {
    let v = x[..].cast(f32);
    // Two passes over the block (mean, then centred squares): no E[x^2] - E[x]^2 cancellation.
    let centred = v - v.sum(1) * (1.0 / d as f32);
    let var = (centred * centred).sum(1) * (1.0 / d as f32);
    out[..] = (centred * (var + eps).rsqrt() * w[..].cast(f32) + b[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [t / bt],
    semantics = [arbitrary],
    x = block([bt, d], |i| [i, 0]),
    w = block([1, d], |i| [0, 0]),
    dy = block([bt, d], |i| [i, 0]),
    dx = block([bt, d], |i| [i, 0]),
    dw = block([1, d], |i| [0, 0]),
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
    dw_acc[..] += (g * v * r).sum(0);
    if program_id(0) == num_programs(0) - 1 {
        dw[..] = dw_acc[..].cast(dw.dtype);
    }
}

#[tpu_kernel(
    grid = [t / bt],
    semantics = [parallel],
    a = block([bt, f], |i| [i, 0]),
    b = block([bt, f], |i| [i, 0]),
    out = block([bt, f], |i| [i, 0]),
)]
pub fn swiglu_kernel(a: In<t, f>, b: In<t, f>, out: Out<t, f>, bt: usize) {
    let av = a[..].cast(f32);
    out[..] = (av * sigmoid(av) * b[..].cast(f32)).cast(out.dtype);
}

#[tpu_kernel(
    grid = [t / bt],
    semantics = [parallel],
    a = block([bt, f], |i| [i, 0]),
    b = block([bt, f], |i| [i, 0]),
    dy = block([bt, f], |i| [i, 0]),
    da = block([bt, f], |i| [i, 0]),
    db = block([bt, f], |i| [i, 0]),
)]
pub fn swiglu_bwd_kernel(a: In<t, f>, b: In<t, f>, dy: In<t, f>, da: Out<t, f>, db: Out<t, f>, bt: usize) {
    let av = a[..].cast(f32);
    let g = dy[..].cast(f32);
    let s = sigmoid(av);
    db[..] = (g * av * s).cast(db.dtype);
    // d silu(a) / da = s + a * s * (1 - s) = s * (1 + a * (1 - s)).
    da[..] = (g * b[..].cast(f32) * s * (1.0 + av * (1.0 - s))).cast(da.dtype);
}

// ---- kernels with the target's blocks -----------------------------------------------------

/// The op kernels with default blocks for a target, from operand types (what `emit` lowers).
pub mod build {
    use super::*;

    /// `(out, new_residual)` of the fused residual-add RMSNorm.
    pub fn rmsnorm_residual(x: &Type, residual: &Type, w: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        rmsnorm_residual_kernel(x.clone(), residual.clone(), w.clone(), x.clone(), x.clone(), row_tile(x, 4, target), eps)
    }

    pub fn layernorm(x: &Type, w: &Type, b: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        layernorm_kernel(x.clone(), w.clone(), b.clone(), x.clone(), row_tile(x, 2, target), eps)
    }

    /// `(dx, dw)`; `dw` has `w`'s type.
    pub fn rmsnorm_bwd(x: &Type, w: &Type, dy: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
        rmsnorm_bwd_kernel(x.clone(), w.clone(), dy.clone(), x.clone(), w.clone(), row_tile(x, 3, target), eps)
    }

    pub fn swiglu(a: &Type, b: &Type, target: &Target) -> Result<Kernel, KernelError> {
        swiglu_kernel(a.clone(), b.clone(), a.clone(), row_tile(a, 3, target))
    }

    /// `(da, db)`.
    pub fn swiglu_bwd(a: &Type, b: &Type, dy: &Type, target: &Target) -> Result<Kernel, KernelError> {
        swiglu_bwd_kernel(a.clone(), b.clone(), dy.clone(), a.clone(), a.clone(), row_tile(a, 5, target))
    }
}

// ---- ops on arrays, for composition -------------------------------------------------------

fn ty(a: &Array) -> Type {
    Type::vector(a.dtype, &a.shape)
}

fn run(kernel: Result<Kernel, KernelError>, args: &[&Array]) -> Result<Vec<Array>, KernelError> {
    interp::run(&kernel?, args)
}

fn pair(name: &str, outputs: Vec<Array>) -> Result<(Array, Array), KernelError> {
    let n = outputs.len();
    let mut it = outputs.into_iter();
    match (it.next(), it.next()) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(KernelError::new(name, "outputs", "output-count", format!("the kernel produced {n} outputs, expected 2"), "report this as a library bug")),
    }
}

fn single(name: &str, outputs: Vec<Array>) -> Result<Array, KernelError> {
    outputs.into_iter().next().ok_or_else(|| KernelError::new(name, "outputs", "output-count", "the kernel produced no output", "report this as a library bug"))
}

/// `(rmsnorm(x + residual) * w, x + residual)` on the CPU interpreter.
pub fn rmsnorm_residual(x: &Array, residual: &Array, w: &Array, eps: f32, target: &Target) -> Result<(Array, Array), KernelError> {
    let t = [ty(x), ty(residual), ty(w)];
    pair("rmsnorm_residual", run(build::rmsnorm_residual(&t[0], &t[1], &t[2], eps, target), &[x, residual, w])?)
}

/// `(x - mean) / sqrt(var + eps) * w + b` per row (biased variance).
pub fn layernorm(x: &Array, w: &Array, b: &Array, eps: f32, target: &Target) -> Result<Array, KernelError> {
    let t = [ty(x), ty(w), ty(b)];
    single("layernorm", run(build::layernorm(&t[0], &t[1], &t[2], eps, target), &[x, w, b])?)
}

/// `(dx, dw)` of `y = rmsnorm(x) * w` given `dy`.
pub fn rmsnorm_bwd(x: &Array, w: &Array, dy: &Array, eps: f32, target: &Target) -> Result<(Array, Array), KernelError> {
    let t = [ty(x), ty(w), ty(dy)];
    pair("rmsnorm_bwd", run(build::rmsnorm_bwd(&t[0], &t[1], &t[2], eps, target), &[x, w, dy])?)
}

/// `silu(a) * b`.
pub fn swiglu(a: &Array, b: &Array, target: &Target) -> Result<Array, KernelError> {
    let t = [ty(a), ty(b)];
    single("swiglu", run(build::swiglu(&t[0], &t[1], target), &[a, b])?)
}

/// `(da, db)` of `y = silu(a) * b` given `dy`.
pub fn swiglu_bwd(a: &Array, b: &Array, dy: &Array, target: &Target) -> Result<(Array, Array), KernelError> {
    let t = [ty(a), ty(b), ty(dy)];
    pair("swiglu_bwd", run(build::swiglu_bwd(&t[0], &t[1], &t[2], target), &[a, b, dy])?)
}

// ---- library entries ----------------------------------------------------------------------

fn build_rmsnorm_residual(t: &[Type], target: &Target) -> Result<Kernel, KernelError> {
    let t = crate::arity("rmsnorm_residual", t, 3)?;
    build::rmsnorm_residual(&t[0], &t[1], &t[2], RMSNORM_EPS, target)
}

fn build_layernorm(t: &[Type], target: &Target) -> Result<Kernel, KernelError> {
    let t = crate::arity("layernorm", t, 3)?;
    build::layernorm(&t[0], &t[1], &t[2], LAYERNORM_EPS, target)
}

fn build_rmsnorm_bwd(t: &[Type], target: &Target) -> Result<Kernel, KernelError> {
    let t = crate::arity("rmsnorm_bwd", t, 3)?;
    build::rmsnorm_bwd(&t[0], &t[1], &t[2], RMSNORM_EPS, target)
}

fn build_swiglu(t: &[Type], target: &Target) -> Result<Kernel, KernelError> {
    let t = crate::arity("swiglu", t, 2)?;
    build::swiglu(&t[0], &t[1], target)
}

fn build_swiglu_bwd(t: &[Type], target: &Target) -> Result<Kernel, KernelError> {
    let t = crate::arity("swiglu_bwd", t, 3)?;
    build::swiglu_bwd(&t[0], &t[1], &t[2], target)
}

/// This module's library ops.
pub const OPS: &[LibraryKernel] = &[
    LibraryKernel {
        name: "rmsnorm_residual",
        summary: "fused residual add + RMSNorm: h = x + residual, (h * rsqrt(mean(h^2) + eps) * w, h), eps = 1e-6",
        signature: "rmsnorm_residual(x: [t, d], residual: [t, d], w: [1, d]; eps: f32) -> (out: [t, d], new_residual: [t, d])",
        inputs: &[float("x", "[t, d]", &[1024, 1024]), float("residual", "[t, d]", &[1024, 1024]), float("w", "[1, d]", &[1, 1024])],
        alt_shapes: &[&[40, 5120], &[40, 5120], &[1, 5120]],
        build: |t, target| Ok(vec![build_rmsnorm_residual(t, target)?]),
        run: |a, target| crate::run_single(build_rmsnorm_residual, a, target),
        random_inputs: uniform_inputs,
        reference: |a| {
            let x = f64s(a);
            let (out, h) = reference::rmsnorm_residual(&x[0], &x[1], &x[2], a[0].shape[1], RMSNORM_EPS as f64);
            vec![out, h]
        },
    },
    LibraryKernel {
        name: "layernorm",
        summary: "LayerNorm over the last dim, (x - mean) / sqrt(var + eps) * w + b, biased variance, eps = 1e-5",
        signature: "layernorm(x: [t, d], w: [1, d], b: [1, d]; eps: f32) -> [t, d]",
        inputs: &[float("x", "[t, d]", &[1024, 1024]), float("w", "[1, d]", &[1, 1024]), float("b", "[1, d]", &[1, 1024])],
        alt_shapes: &[&[300, 640], &[1, 640], &[1, 640]],
        build: |t, target| Ok(vec![build_layernorm(t, target)?]),
        run: |a, target| crate::run_single(build_layernorm, a, target),
        random_inputs: uniform_inputs,
        reference: |a| {
            let x = f64s(a);
            vec![reference::layernorm(&x[0], &x[1], &x[2], a[0].shape[1], LAYERNORM_EPS as f64)]
        },
    },
    LibraryKernel {
        name: "rmsnorm_bwd",
        summary: "RMSNorm backward: dx per row; dw summed over rows in an f32 VMEM scratch along the (arbitrary) row axis",
        signature: "rmsnorm_bwd(x: [t, d], w: [1, d], dy: [t, d]; eps: f32) -> (dx: [t, d], dw: [1, d])",
        inputs: &[float("x", "[t, d]", &[1024, 1024]), float("w", "[1, d]", &[1, 1024]), float("dy", "[t, d]", &[1024, 1024])],
        alt_shapes: &[&[512, 1536], &[1, 1536], &[512, 1536]],
        build: |t, target| Ok(vec![build_rmsnorm_bwd(t, target)?]),
        run: |a, target| crate::run_single(build_rmsnorm_bwd, a, target),
        random_inputs: uniform_inputs,
        reference: |a| {
            let x = f64s(a);
            let (dx, dw) = reference::rmsnorm_bwd(&x[0], &x[1], &x[2], a[0].shape[1], RMSNORM_EPS as f64);
            vec![dx, dw]
        },
    },
    LibraryKernel {
        name: "swiglu",
        summary: "SwiGLU gate: silu(a) * b, silu(a) = a * sigmoid(a)",
        signature: "swiglu(a: [t, f], b: [t, f]) -> [t, f]",
        inputs: &[float("a", "[t, f]", &[1024, 2816]), float("b", "[t, f]", &[1024, 2816])],
        alt_shapes: &[&[200, 1408], &[200, 1408]],
        build: |t, target| Ok(vec![build_swiglu(t, target)?]),
        run: |a, target| crate::run_single(build_swiglu, a, target),
        random_inputs: uniform_inputs,
        reference: |a| {
            let x = f64s(a);
            vec![reference::swiglu(&x[0], &x[1])]
        },
    },
    LibraryKernel {
        name: "swiglu_bwd",
        summary: "SwiGLU backward: db = dy * silu(a), da = dy * b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))",
        signature: "swiglu_bwd(a: [t, f], b: [t, f], dy: [t, f]) -> (da: [t, f], db: [t, f])",
        inputs: &[float("a", "[t, f]", &[1024, 2816]), float("b", "[t, f]", &[1024, 2816]), float("dy", "[t, f]", &[1024, 2816])],
        alt_shapes: &[&[1, 4096], &[1, 4096], &[1, 4096]],
        build: |t, target| Ok(vec![build_swiglu_bwd(t, target)?]),
        run: |a, target| crate::run_single(build_swiglu_bwd, a, target),
        random_inputs: uniform_inputs,
        reference: |a| {
            let x = f64s(a);
            let (da, db) = reference::swiglu_bwd(&x[0], &x[1], &x[2]);
            vec![da, db]
        },
    },
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
