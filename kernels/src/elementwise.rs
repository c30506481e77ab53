//! Row-blocked elementwise and row-reduction kernels: fused `gelu(x * a + b)`, row
//! softmax and RMSNorm. Each grid step owns `bm` whole rows, so reductions along a row
//! never cross blocks. Math runs in f32 whatever the storage dtype (v5e has no bf16
//! VPU/EUP, and it is what PyTorch and JAX do for these ops).

use tessera_dsl::{Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::row_block;

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
