//! Runs a library kernel on the CPU interpreter with random inputs and compares it with
//! the kernel's independent f64 reference. The CLI's `tessera run` and the numerics tests
//! both go through here, so what the CLI prints is what the tests assert.

use std::time::{Duration, Instant};

use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::{self, Array, Data};
use tessera_dsl::{DType, KernelError, Target, Type};

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

/// The outcome of one run against the reference.
#[derive(Clone, Debug)]
pub struct Report {
    pub kernel: String,
    pub shapes: Vec<Vec<usize>>,
    pub dtype: DType,
    pub grid: Vec<usize>,
    pub max_abs_err: f64,
    /// `max_abs_err / max|ref|`, compared with [`tolerance`].
    pub scaled_err: f64,
    pub tolerance: f64,
    /// Output elements that are NaN (never written, or poisoned).
    pub nan_count: usize,
    pub interp_time: Duration,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.nan_count == 0 && self.scaled_err <= self.tolerance
    }
}

/// Uniform values in [-1, 1) (positive in [0.5, 1.5) for scale operands), rounded to `dtype`.
pub fn random_array(dtype: DType, shape: &[usize], rng: &mut StdRng) -> Array {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let data = match dtype {
        DType::BF16 => Data::BF16(vals.iter().map(|&v| bf16::from_f32(v)).collect()),
        DType::I32 => Data::I32(vals.iter().map(|&v| (v * 100.0) as i32).collect()),
        DType::I8 => Data::I8(vals.iter().map(|&v| (v * 100.0) as i8).collect()),
        DType::Bool => Data::Bool(vals.iter().map(|&v| v > 0.0).collect()),
        DType::F32 => Data::F32(vals),
    };
    Array { dtype, shape: shape.to_vec(), data }
}

/// Every element as f64.
pub fn to_f64(a: &Array) -> Vec<f64> {
    match &a.data {
        Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
        Data::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
        Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
        Data::I8(v) => v.iter().map(|&x| x as f64).collect(),
        Data::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
    }
}

/// Builds `kernel` for `shapes` and `dtype` on `target`, runs it on the interpreter with
/// inputs drawn from `seed`, and compares with the reference.
pub fn run_against_reference(kernel: &LibraryKernel, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64) -> Result<Report, KernelError> {
    let types: Vec<Type> = shapes.iter().map(|s| Type::vector(dtype, s)).collect();
    let k = (kernel.build)(&types, target)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let inputs: Vec<Array> = shapes.iter().map(|s| random_array(dtype, s, &mut rng)).collect();
    let refs: Vec<&Array> = inputs.iter().collect();
    let start = Instant::now();
    let outputs = interp::run(&k, &refs)?;
    let interp_time = start.elapsed();
    let host: Vec<Vec<f64>> = inputs.iter().map(to_f64).collect();
    let expected = (kernel.reference)(&host, shapes);
    let got = to_f64(&outputs[0]);
    let nan_count = got.iter().filter(|v| v.is_nan()).count();
    let max_abs_err = got.iter().zip(&expected).map(|(g, e)| (g - e).abs()).filter(|d| !d.is_nan()).fold(0.0, f64::max);
    let max_ref = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    Ok(Report {
        kernel: kernel.name.to_string(),
        shapes: shapes.to_vec(),
        dtype,
        grid: k.grid.iter().map(|g| g.extent).collect(),
        max_abs_err,
        scaled_err: max_abs_err / max_ref.max(f64::MIN_POSITIVE),
        tolerance: tolerance(dtype),
        nan_count,
        interp_time,
    })
}
