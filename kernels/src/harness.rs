//! Runs a library op on a CPU backend with random inputs and compares it with the op's
//! independent f64 reference. The CLI's `tessera run` and the numerics tests both go
//! through here, so what the CLI prints is what the tests assert.

use std::time::{Duration, Instant};

use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::{Array, Data};
use tessera_dsl::{DType, Executor, Interpreter, KernelError, Target};

use crate::op::{Kind, Op, Statics};

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
    /// The backend that ran it (`interp`, `jit`, ...).
    pub backend: &'static str,
    /// Wall time of the run (plan building and verification excluded).
    pub run_time: Duration,
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

/// Random inputs for an op without its own generator: uniform floats in [-1, 1) (f32 for
/// `Float32` inputs), int32 in [0, 100), int8 over [-100, 100).
pub fn default_inputs(op: &Op, shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    op.inputs.iter().zip(shapes).map(|(i, s)| if i.kind == Kind::Int32 { Array::from_i32(s, (0..s.iter().product()).map(|_| rng.gen_range(0..100)).collect()) } else { random_array(i.kind.dtype(dtype), s, rng) }).collect()
}

/// The op's random inputs for `shapes`, float `dtype` and `statics`.
pub fn inputs_for(op: &Op, shapes: &[Vec<usize>], dtype: DType, statics: &Statics, rng: &mut StdRng) -> Vec<Array> {
    match op.random {
        Some(f) => f(shapes, dtype, statics, rng),
        None => default_inputs(op, shapes, dtype, rng),
    }
}

/// Runs the op with its default statics on the interpreter, inputs drawn from `seed` for
/// `shapes` and `dtype`, and compares every result with the independent reference.
pub fn run_against_reference(op: &Op, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64) -> Result<Report, KernelError> {
    run_case(op, &op.statics("")?, shapes, dtype, target, seed, &Interpreter)
}

/// Runs the op with `statics` on `exec` (kernels built for `target`'s default blocks),
/// inputs drawn from `seed`, and compares every result with the independent reference.
pub fn run_case(op: &Op, statics: &Statics, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64, exec: &dyn Executor) -> Result<Report, KernelError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let inputs = inputs_for(op, shapes, dtype, statics, &mut rng);
    let given: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
    let types = given.iter().map(|a| a.map(|a| tessera_dsl::Type::vector(a.dtype, &a.shape))).chain(std::iter::repeat(None)).take(op.inputs.len()).collect::<Vec<_>>();
    let plan = op.plan_for(&types, statics, target)?;
    let start = Instant::now();
    let outputs = op.run(exec, &given, statics, target)?;
    let run_time = start.elapsed();
    let reference = op.reference.or_else(|| op.alias_of.and_then(|(of, _)| crate::find(of)?.reference));
    let Some(reference) = reference else {
        return Err(KernelError::new(op.name, "reference", "no-reference", "the op has no independent reference", "give the op a `reference` in its table entry"));
    };
    let mut expected = reference(&inputs, statics);
    if let Some((_, i)) = op.alias_of {
        expected = expected.into_iter().skip(i).take(1).collect();
    }
    if outputs.len() != expected.len() {
        return Err(KernelError::new(op.name, "outputs", "output-count", format!("the op produced {} outputs, its reference {}", outputs.len(), expected.len()), "make the op's plan and reference agree"));
    }
    let checks = outputs.iter().zip(&expected).map(|(got, want)| check_output(got, want)).collect();
    Ok(Report {
        kernel: op.name.to_string(),
        shapes: shapes.to_vec(),
        dtype,
        grid: plan.launches.first().map(|l| l.kernel.grid.iter().map(|g| g.extent).collect()).unwrap_or_default(),
        outputs: checks,
        backend: exec.name(),
        run_time,
    })
}
