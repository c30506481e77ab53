//! Runs a library kernel on the CPU interpreter with random inputs and compares it with
//! the kernel's independent f64 reference. The CLI's `tessera run` and the numerics tests
//! both go through here, so what the CLI prints is what the tests assert.

use std::time::{Duration, Instant};

use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::{Array, Data};
use tessera_dsl::{DType, KernelError, Target};

use crate::LibraryKernel;

/// How far a kernel's output may be from the f64 reference, as the max-norm relative
/// error `max|out - ref| / max|ref|`: f32 kernels compute in f32 (about 1e-7 per op,
/// growing with reduction length); bf16 outputs are rounded to 8 bits of mantissa
/// (relative step 2^-8).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1.6e-2,
        _ => 1e-5,
    }
}

/// How one output compares with its reference.
#[derive(Clone, Debug)]
pub struct OutputCheck {
    pub dtype: DType,
    /// `max|out - ref| / max|ref|` for float outputs (0 for integer outputs).
    pub scaled_err: f64,
    pub tolerance: f64,
    /// Elements that are NaN (never written, or poisoned).
    pub nan_count: usize,
    /// Integer outputs must match exactly: elements that differ.
    pub mismatches: usize,
}

impl OutputCheck {
    pub fn passed(&self) -> bool {
        self.nan_count == 0 && self.mismatches == 0 && self.scaled_err <= self.tolerance
    }
}

/// The outcome of one run against the reference.
#[derive(Clone, Debug)]
pub struct Report {
    pub kernel: String,
    pub shapes: Vec<Vec<usize>>,
    pub dtype: DType,
    /// The grid of the op's (first) kernel.
    pub grid: Vec<usize>,
    pub outputs: Vec<OutputCheck>,
    pub interp_time: Duration,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.outputs.iter().all(OutputCheck::passed)
    }

    /// The output furthest from passing (largest error relative to its tolerance).
    pub fn worst(&self) -> &OutputCheck {
        let badness = |o: &OutputCheck| if o.nan_count > 0 || o.mismatches > 0 { f64::INFINITY } else { o.scaled_err / o.tolerance };
        self.outputs.iter().max_by(|a, b| badness(a).total_cmp(&badness(b))).expect("ops have at least one output")
    }
}

/// Compares one output with its reference: float outputs by max-norm relative error
/// against the dtype's tolerance, integer outputs exactly.
pub fn check_output(got: &Array, expected: &[f64]) -> OutputCheck {
    let values = got.to_f64_vec();
    let nan_count = values.iter().filter(|v| v.is_nan()).count();
    let mut check = OutputCheck { dtype: got.dtype, scaled_err: 0.0, tolerance: tolerance(got.dtype), nan_count, mismatches: values.len().abs_diff(expected.len()) };
    if got.dtype.is_float() {
        let max_abs_err = values.iter().zip(expected).map(|(g, e)| (g - e).abs()).filter(|d| !d.is_nan()).fold(0.0, f64::max);
        let max_ref = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        check.scaled_err = max_abs_err / max_ref.max(f64::MIN_POSITIVE);
    } else {
        check.mismatches += values.iter().zip(expected).filter(|(g, e)| g != e).count();
    }
    check
}

/// `n` values uniform in `[-scale, scale)`.
pub fn uniform(n: usize, scale: f32, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

/// Uniform values in [-1, 1) (positive in [0.5, 1.5) for scale operands), rounded to `dtype`.
pub fn random_array(dtype: DType, shape: &[usize], rng: &mut StdRng) -> Array {
    let vals = uniform(shape.iter().product(), 1.0, rng);
    let data = match dtype {
        DType::BF16 => Data::BF16(vals.iter().map(|&v| bf16::from_f32(v)).collect()),
        DType::I32 => Data::I32(vals.iter().map(|&v| (v * 100.0) as i32).collect()),
        DType::I8 => Data::I8(vals.iter().map(|&v| (v * 100.0) as i8).collect()),
        DType::Bool => Data::Bool(vals.iter().map(|&v| v > 0.0).collect()),
        DType::F32 => Data::F32(vals),
    };
    Array { dtype, shape: shape.to_vec(), data }
}

/// Runs the op on the interpreter with inputs drawn from `seed` for `shapes` and `dtype`
/// (kernels built for `target`'s default blocks) and compares every output with the
/// independent reference.
pub fn run_against_reference(op: &LibraryKernel, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64) -> Result<Report, KernelError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let inputs = (op.random_inputs)(shapes, dtype, &mut rng);
    let kernels = (op.build)(&crate::types_of(&inputs), target)?;
    let start = Instant::now();
    let outputs = (op.run)(&inputs, target)?;
    let interp_time = start.elapsed();
    let expected = (op.reference)(&inputs);
    if outputs.len() != expected.len() {
        return Err(KernelError::new(op.name, "outputs", "output-count", format!("the op produced {} outputs, its reference {}", outputs.len(), expected.len()), "make the op's run and reference agree"));
    }
    let checks = outputs.iter().zip(&expected).map(|(got, want)| check_output(got, want)).collect();
    Ok(Report {
        kernel: op.name.to_string(),
        shapes: shapes.to_vec(),
        dtype,
        grid: kernels.first().map(|k| k.grid.iter().map(|g| g.extent).collect()).unwrap_or_default(),
        outputs: checks,
        interp_time,
    })
}
