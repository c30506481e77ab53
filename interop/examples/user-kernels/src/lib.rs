//! Two kernels as a user writes them in their own crate, depending only on `tessera`:
//!
//! - `residual_layernorm`: `h = x + residual`, `y = LayerNorm(h) * weight + bias`, one
//!   kernel, whole rows per block;
//! - `long_softmax`: a softmax over rows too long for one block, in two passes over column
//!   blocks (online max and sum of exponentials, then the normalised exponentials).
//!
//! Each is a kernel builder ([`residual_layernorm`], [`long_softmax`]) that picks blocks
//! for a target, and an [`Op`] entry in [`OPS`] (schema, plan, cases, an independent f64
//! reference) that `tessera::cli::main(OPS)` serves (`src/main.rs`) and torch could
//! register. The tests are in `tests/`; the walk-through is `interop/TUTORIAL.md`.

use tessera::{result, single, tpu_kernel, Array, Call, Case, DType, Input, Kernel, KernelError, Kind, Launch, Op, Output, Plan, Statics, Target, Type};

pub mod reference;

// ---- residual + LayerNorm -----------------------------------------------------------------

#[tpu_kernel(
    grid = [m.div_ceil(bm)],
    (x, residual, y, h) = block([bm, n], |i| [i, 0]),
    (weight, bias) = block([1, n], |i| [0, 0]),
)]
pub fn residual_layernorm_kernel(x: In<m, n>, residual: In<m, n>, weight: In<1, n>, bias: In<1, n>, y: Out<m, n>, h: Out<m, n>, bm: usize, eps: f32) {
    // Normalise the f32 sum, not its rounded copy.
    let s = x[..].cast(f32) + residual[..].cast(f32);
    h[..] = s.cast(h.dtype);
    let d = s - s.sum(1) * (1.0 / n as f32);
    let var = (d * d).sum(1) * (1.0 / n as f32);
    y[..] = (d * (var + eps).rsqrt() * weight[..].cast(f32) + bias[..].cast(f32)).cast(y.dtype);
}

/// Rows per block: six `[bm, n]` streams double-buffered plus f32 temporaries in a sixteenth
/// of the target's default scoped VMEM each, a multiple of 16 rows (bf16's native tile), or
/// all the rows when they fit.
pub fn row_block(m: usize, n: usize, target: &Target) -> usize {
    let rows = (target.default_scoped_vmem_bytes / 16 / (4 * n.max(1))) / 16 * 16;
    if rows >= m { m } else { rows.max(16) }
}

/// The kernel for `x` (`[m, n]`, also the residual's and outputs' type) and `weight`
/// (`[1, n]`, also the bias's).
pub fn residual_layernorm(x: &Type, weight: &Type, eps: f32, target: &Target) -> Result<Kernel, KernelError> {
    let bm = row_block(x.shape[0], x.shape.get(1).copied().unwrap_or(1), target);
    residual_layernorm_kernel(x.clone(), x.clone(), weight.clone(), weight.clone(), x.clone(), x.clone(), bm, eps)
}

fn plan_residual_layernorm(c: &Call) -> Result<Plan, KernelError> {
    let x = c.tensor("x")?.clone();
    let w = c.row_vector("weight", x.shape[1])?;
    let b = c.row_vector("bias", x.shape[1])?;
    let kernel = residual_layernorm(&x, &w, c.statics.f64("eps").unwrap_or(1e-5) as f32, c.target)?;
    Ok(single(c, kernel, vec![c.input("x", x.clone())?, c.input("residual", x)?, c.input("weight", w)?, c.input("bias", b)?], &[]))
}

// ---- two-pass long-row softmax ------------------------------------------------------------

/// A finite "minus infinity": `exp(LOWEST - m)` is 0, never NaN.
const LOWEST: f32 = f32::MIN;

#[tpu_kernel(
    grid = [m.div_ceil(bm), n / bn],
    semantics = [parallel, arbitrary],
    x = block([bm, bn], |i, j| [i, j]),
    (row_max, row_sum) = block([bm, 1], |i, j| [i, 0]),
    (run_max, run_sum) = scratch([bm, 1], f32),
)]
pub fn softmax_stats_kernel(x: In<m, n>, row_max: Out<m, 1>, row_sum: Out<m, 1>, run_max: Scratch, run_sum: Scratch, bm: usize, bn: usize) {
    if program_id(1) == 0 {
        run_max[..] = full([bm, 1], f32, LOWEST);
        run_sum[..] = zeros([bm, 1], f32);
    }
    let v = x[..].cast(f32);
    let old = run_max[..];
    let new = old.max(v.reduce_max(1));
    run_sum[..] = run_sum[..] * (old - new).exp() + (v - new).exp().sum(1);
    run_max[..] = new;
    if program_id(1) == num_programs(1) - 1 {
        row_max[..] = run_max[..];
        row_sum[..] = run_sum[..];
    }
}

#[tpu_kernel(
    grid = [m.div_ceil(bm), n / bn],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    (row_max, row_sum) = block([bm, 1], |i, j| [i, 0]),
)]
pub fn softmax_apply_kernel(x: In<m, n>, row_max: In<m, 1>, row_sum: In<m, 1>, out: Out<m, n>, bm: usize, bn: usize) {
    out[..] = ((x[..].cast(f32) - row_max[..]).exp() / row_sum[..]).cast(out.dtype);
}

/// Blocks of `[16, bn]`: the widest column block of at most 4096 that divides `n` (a
/// multiple of 128), or the whole row when it is at most 4096 long.
pub fn softmax_blocks(x: &Type) -> Result<(usize, usize), KernelError> {
    let (m, n) = (x.shape[0], x.shape.get(1).copied().unwrap_or(1));
    let bn = [4096, 2048, 1024, 512, 256, 128].into_iter().find(|b| n % b == 0).or((n <= 4096).then_some(n));
    let bn = bn.ok_or_else(|| KernelError::new("long_softmax", "input `x`", "operand-shape", format!("rows of {n} columns are longer than one block and not a multiple of 128"), "pad the rows to a multiple of 128 (with a large negative value)"))?;
    Ok((m.min(16), bn))
}

/// The two kernels for `x: [m, n]`: the statistics pass and the apply pass.
pub fn long_softmax(x: &Type) -> Result<[Kernel; 2], KernelError> {
    let (bm, bn) = softmax_blocks(x)?;
    let stats = Type::vector(DType::F32, &[x.shape[0], 1]);
    Ok([softmax_stats_kernel(x.clone(), stats.clone(), stats.clone(), bm, bn)?, softmax_apply_kernel(x.clone(), stats.clone(), stats, x.clone(), bm, bn)?])
}

fn plan_long_softmax(c: &Call) -> Result<Plan, KernelError> {
    let x = c.tensor("x")?.clone();
    let stats = Type::vector(DType::F32, &[x.shape[0], 1]);
    let [first, second] = long_softmax(&x)?;
    let launches = vec![Launch::new(first, vec![c.input("x", x.clone())?]), Launch::new(second, vec![c.input("x", x.clone())?, result(0, 0, stats.clone()), result(0, 1, stats)])];
    Ok(Plan::new(c.op, c.target, launches, vec![result(1, 0, x)]))
}

// ---- the op table ---------------------------------------------------------------------------

fn ref_residual_layernorm(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let (y, h) = reference::residual_layernorm(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[3].to_f64_vec(), a[0].shape[1], s.f64("eps").unwrap_or(1e-5));
    vec![y, h]
}

fn ref_long_softmax(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    vec![reference::softmax(&a[0].to_f64_vec(), a[0].shape[1])]
}

/// This crate's ops, for `tessera::cli::main` and `tessera_torch::init_module`.
pub const OPS: &[Op] = &[
    Op {
        name: "residual_layernorm",
        doc: "h = x + residual; y = LayerNorm(h) * weight + bias (biased variance); returns (y, h)",
        schema: "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps=1e-05) -> (Tensor, Tensor)",
        inputs: &[
            Input { name: "x", dims: "[m, n]", kind: Kind::Float },
            Input { name: "residual", dims: "[m, n]", kind: Kind::Float },
            Input { name: "weight", dims: "[1?, n]", kind: Kind::Float },
            Input { name: "bias", dims: "[1?, n]", kind: Kind::Float },
        ],
        outputs: &[Output { name: "y", shape: "x", dtype: "x" }, Output { name: "h", shape: "x", dtype: "x" }],
        plan: plan_residual_layernorm,
        cases: &[Case { name: "default", statics: "", shapes: &[&[256, 1024], &[256, 1024], &[1024], &[1024]] }],
        reference: Some(ref_residual_layernorm),
        ..Op::EMPTY
    },
    Op {
        name: "long_softmax",
        doc: "softmax over the last dim of x [m, n], two passes over column blocks (rows of any length that is a multiple of 128)",
        schema: "(Tensor x) -> Tensor",
        inputs: &[Input { name: "x", dims: "[m, n]", kind: Kind::Float }],
        outputs: &[Output { name: "out", shape: "x", dtype: "x" }],
        plan: plan_long_softmax,
        cases: &[Case { name: "default", statics: "", shapes: &[&[32, 32768]] }, Case { name: "short", statics: "", shapes: &[&[5, 384]] }],
        reference: Some(ref_long_softmax),
        ..Op::EMPTY
    },
];
