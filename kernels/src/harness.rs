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
/// error `max|out - ref| / max|ref|` (see [`error_scale`] for a zero reference): f32
/// kernels compute in f32 (about 1e-7 per op, growing with reduction length); bf16
/// outputs are rounded to 8 bits of mantissa (relative step 2^-8).
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
    /// Elements that are NaN where the reference is not (never written, or poisoned).
    pub nan_count: usize,
    /// Integer outputs must match exactly: elements that differ.
    pub mismatches: usize,
    /// Float elements whose class differs from the reference's: an infinity (or a finite
    /// value) where the reference is finite (or infinite, or NaN).
    pub nonfinite: usize,
}

impl OutputCheck {
    pub fn passed(&self) -> bool {
        self.nan_count == 0 && self.mismatches == 0 && self.nonfinite == 0 && self.scaled_err <= self.tolerance
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
        let badness = |o: &OutputCheck| if o.nan_count > 0 || o.mismatches > 0 || o.nonfinite > 0 { f64::INFINITY } else { o.scaled_err / o.tolerance };
        self.outputs.iter().max_by(|a, b| badness(a).total_cmp(&badness(b))).expect("ops have at least one output")
    }
}

/// The largest reference magnitude below which errors are judged absolutely.
pub const ZERO_REFERENCE: f64 = 1e-6;

/// What a float output's error is divided by: `max|ref|`, or 1 when the reference is
/// (near) zero. A result that is exactly 0 in exact arithmetic (the dq of a query that sees
/// one key) comes out of f32 arithmetic as rounding noise of its O(1) intermediates, which
/// no relative error can judge; against 1 (the scale of the random inputs) an output that
/// should be 0 still fails unless it is within the tolerance of 0. The tests' and the torch
/// suite's comparisons use the same convention.
pub fn error_scale(max_ref: f64) -> f64 {
    if max_ref > ZERO_REFERENCE { max_ref } else { 1.0 }
}

/// Compares one output with its reference: float outputs by max-norm relative error
/// against the dtype's tolerance over the reference's finite elements, and exactly where
/// the reference is infinite or NaN (the same value class); integer outputs exactly.
pub fn check_output(got: &Array, expected: &[f64]) -> OutputCheck {
    let values = got.to_f64_vec();
    let nan_count = values.iter().zip(expected).filter(|(g, e)| g.is_nan() && !e.is_nan()).count();
    let mut check = OutputCheck { dtype: got.dtype, scaled_err: 0.0, tolerance: tolerance(got.dtype), nan_count, mismatches: values.len().abs_diff(expected.len()), nonfinite: 0 };
    if got.dtype.is_float() {
        let finite = |e: &&(&f64, &f64)| e.1.is_finite() && e.0.is_finite();
        let pairs: Vec<(&f64, &f64)> = values.iter().zip(expected).collect();
        check.nonfinite = pairs.iter().filter(|(g, e)| !g.is_nan() && (if e.is_finite() { !g.is_finite() } else { g != e })).count();
        let max_abs_err = pairs.iter().filter(finite).map(|(g, e)| (*g - *e).abs()).fold(0.0, f64::max);
        let max_ref = expected.iter().filter(|e| e.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
        check.scaled_err = max_abs_err / error_scale(max_ref);
    } else {
        check.mismatches += values.iter().zip(expected).filter(|(g, e)| g != e).count();
    }
    check
}

/// Reserves (and releases) the host memory a run of `plan` takes: each input, then the
/// inputs, results and the reference's f64 copies of both together. An error names the
/// input or the total and the bytes.
fn reserve_run(op: &Op, types: &[Option<tessera_dsl::Type>], plan: &crate::Plan) -> Result<(), KernelError> {
    let mut bytes = 0usize;
    let mut elems = 0usize;
    let overflow = || crate::plan::alloc_error(op.name, "the run", None);
    for (input, ty) in op.inputs.iter().zip(types) {
        let Some(ty) = ty else { continue };
        let (n, b) = crate::contract::counts(ty.dtype, &ty.shape).ok_or_else(overflow)?;
        drop(crate::plan::try_vec::<u8>(op.name, &format!("input `{}`", input.name), b, DType::I8)?);
        bytes = bytes.checked_add(b).ok_or_else(overflow)?;
        elems = elems.checked_add(n).ok_or_else(overflow)?;
    }
    for r in &plan.results {
        let (n, b) = crate::contract::counts(r.ty.dtype, &r.ty.shape).ok_or_else(overflow)?;
        bytes = bytes.checked_add(b).ok_or_else(overflow)?;
        // The reference's result and `to_f64_vec` of the output.
        elems = elems.checked_add(n.checked_mul(2).ok_or_else(overflow)?).ok_or_else(overflow)?;
    }
    let total = elems.checked_mul(8).and_then(|f| f.checked_add(bytes)).ok_or_else(overflow)?;
    drop(crate::plan::try_vec::<u8>(op.name, "the run (inputs, results and the reference's f64 copies)", total, DType::I8)?);
    Ok(())
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
        DType::F8E4M3FN | DType::F8E5M2 => return Array::from_f32_as_fp8(dtype, shape, &vals),
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
///
/// The shapes are checked before anything is drawn: the plan is built for them (the op's
/// contract) and verified for `target`, and the host memory of the run (inputs, results
/// and their f64 copies for the reference) is reserved fallibly, so a shape that cannot
/// run is an error naming it, never an abort. The inputs drawn have exactly `shapes`.
pub fn run_case(op: &Op, statics: &Statics, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64, exec: &dyn Executor) -> Result<Report, KernelError> {
    if shapes.len() > op.inputs.len() {
        return Err(KernelError::new(op.name, "inputs", "input-count", format!("{} shapes given, the op takes {} tensors", shapes.len(), op.inputs.len()), "give one shape per tensor input"));
    }
    let types = op.types(shapes, dtype);
    let plan = op.plan_for(&types, statics, target)?;
    for launch in &plan.launches {
        tessera_dsl::verify::verify(&launch.kernel, target)?;
    }
    reserve_run(op, &types, &plan)?;
    let mut rng = StdRng::seed_from_u64(seed);
    // An alias draws its inputs as the op it is an alias of.
    let source = op.alias_of.and_then(|(of, _)| crate::find(of)).unwrap_or(op);
    let inputs = inputs_for(source, shapes, dtype, statics, &mut rng);
    if inputs.len() != shapes.len() {
        return Err(KernelError::new(op.name, "inputs", "input-generator", format!("the op's random inputs are {} arrays for {} shapes", inputs.len(), shapes.len()), "report this as a Tessera bug"));
    }
    for ((input, want), got) in op.inputs.iter().zip(shapes).zip(&inputs) {
        if &got.shape != want {
            return Err(KernelError::new(op.name, format!("input `{}`", input.name), "input-generator", format!("the op's random inputs have `{}` {:?}, not the requested {want:?}", input.name, got.shape), "report this as a Tessera bug (the op's `random` fn must use the shapes it is given)"));
        }
    }
    let given: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
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
