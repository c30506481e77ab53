//! A user kernel as a PyTorch op: `torch.ops.tpu.scaled_silu(x, scale, beta=1.0)`.
//!
//! Three pieces (see README.md for the walk-through):
//!
//! 1. the kernel, written with `#[tpu_kernel]`;
//! 2. its [`Op`] entry: the torch schema, the inputs and outputs (whose shape expressions
//!    give the fake kernel), and a plan function that turns a call (input types and static
//!    arguments) into kernel launches;
//! 3. the Python extension module, filled by [`tessera_torch::init_module`].
//!
//! In Python, `tessera.register_ops(tessera_example)` then registers every op of the module
//! as `torch.ops.tpu.<name>`, the way the library registers its own.

use tessera::kernels::blocks::{row_tiles, RowTiles};
use tessera::{single, tpu_kernel, Array, Call, Input, Kind, KernelError, Knob, Op, Output, Plan, Statics, Target, Type};

// ---- 1. the kernel ------------------------------------------------------------------------------

#[tpu_kernel(
    // One grid step per `[bm, bn]` block; a partial last block is fine (its reads past the
    // end are garbage, its writes there are dropped). Grid dims are `parallel` unless
    // `semantics` says otherwise.
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    scale = block([1, bn], |i, j| [0, j]),
)]
pub fn scaled_silu_kernel(x: In<m, n>, scale: In<1, n>, out: Out<m, n>, bm: usize, bn: usize, beta: f32) {
    // Elementwise, so any block works; the math runs in f32 whatever the storage dtype
    // (f32, bf16, or fp8: `float8_e4m3fn` / `float8_e5m2` take no arithmetic on a TPU, so
    // the cast to f32 is what makes them work).
    let v = x[..].cast(f32);
    out[..] = (v * sigmoid(beta * v) * scale[..].cast(f32)).cast(out.dtype);
}

/// Blocks of about 1 MiB of f32 as laid out in VMEM (the library's rule for its row
/// kernels, `x` and `out` being the two streams): whole rows unless they are too wide.
pub fn blocks(x: &Type, target: &Target) -> RowTiles {
    row_tiles(x, 2, target)
}

// ---- 2. the op ------------------------------------------------------------------------------------

/// `x [..., n]` is the kernel's `[m, n]` and `scale [n]` its `[1, n]`: views of the same
/// memory, so the plan is one launch and no copies.
fn plan_scaled_silu(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows("x")?;
    let scale = c.row_vector("scale", x.shape[1])?;
    let beta = c.statics.f64("beta").unwrap_or(1.0) as f32; // statics by name, defaults filled in
    // Blocks: given (or set by a tuning table, see `KNOBS`), else the library's row rule.
    let RowTiles { bm, bn } = blocks(&x, c.target);
    let (bm, bn) = (c.block("block_rows", bm)?, c.block("block_cols", bn)?);
    let kernel = scaled_silu_kernel(x.clone(), scale.clone(), x.clone(), bm, bn, beta)?;
    let out_shape = c.tensor("x")?.shape.clone(); // the [m, n] output seen with x's shape
    Ok(single(c, kernel, vec![c.input("x", x)?, c.input("scale", scale)?], &[Some(out_shape)]))
}

/// The independent reference, in plain f64 loops: `x * sigmoid(beta * x) * scale` per row.
pub fn reference(x: &[f64], scale: &[f64], beta: f64) -> Vec<f64> {
    let n = scale.len();
    x.iter().enumerate().map(|(i, &v)| v / (1.0 + (-beta * v).exp()) * scale[i % n]).collect()
}

fn reference_entry(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    vec![reference(&a[0].to_f64_vec(), &a[1].to_f64_vec(), s.f64("beta").unwrap_or(1.0))]
}

/// What `tessera tune` tries for the blocks (`cargo run --release -p tessera-example
/// --no-default-features --features cli -- tune scaled_silu --target v6e --save tuned.json`):
/// sublane multiples of rows by lane multiples of columns; the plan builder and the
/// verifier prune what a shape, dtype or target cannot take.
pub const KNOBS: &[Knob] = &[
    Knob { name: "block_rows", values: &["8", "16", "32", "64", "128", "256", "512"] },
    Knob { name: "block_cols", values: &["128", "256", "512", "1024", "2048"] },
];

/// The tuning table this crate ships (what `tessera tune --save tuned.json` wrote); the
/// Python module adds it at import, so `torch.ops.tpu.scaled_silu` takes its blocks.
pub const TUNED: &str = include_str!("../tuned.json");

/// This crate's ops.
pub const OPS: &[Op] = &[Op {
                             name: "scaled_silu", doc: "x * sigmoid(beta * x) * scale (Swish-beta; silu(x) * scale at beta=1), scale [n] (or [1, n]) broadcast over rows; the result has x's dtype", schema: "(Tensor x, Tensor scale, float beta=1.0, int? block_rows=None, int? block_cols=None) -> Tensor", plan: plan_scaled_silu, knobs: KNOBS,
                             inputs: &[Input { name: "x", dims: "[..., n]", kind: Kind::AnyFloat }, Input { name: "scale", dims: "[1?, n]", kind: Kind::AnyFloat }], outputs: &[Output { name: "out", shape: "x", dtype: "x" }],
                             cases: &[tessera::Case { name: "default", statics: "beta=1.702", shapes: &[&[512, 1024], &[1024]] }], reference: Some(reference_entry),
                             ..Op::EMPTY
                         }];

// ---- 3. the Python module -------------------------------------------------------------------------

#[cfg(feature = "python")]
#[pyo3::pymodule]
fn tessera_example(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    tessera::tune::add_table(TUNED, "tessera_example/tuned.json").map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    tessera_torch::init_module(m, OPS)
}
