//! int8 weight-only quantized matmul on the interpreter vs its f64 reference, f32 and
//! bf16 activations, several shape sets (full-dim small blocks, non-power-of-two dims,
//! a single row), at the blocks v5e and v6e pick.

use tessera_dsl::{DType, Target};
use tessera_kernels::harness::run_against_reference;

#[test]
fn quantized_matmul_matches_reference() {
    let op = tessera_kernels::find("quantized_matmul").unwrap();
    let sets: [[&[usize]; 3]; 6] = [
        [&[128, 256], &[128, 256], &[1, 128]],
        [&[512, 2048], &[2048, 2048], &[1, 2048]],
        [&[8, 4096], &[1024, 4096], &[1, 1024]],
        [&[1, 512], &[384, 512], &[1, 384]],
        [&[40, 96], &[24, 96], &[1, 24]],
        [&[384, 1536], &[640, 1536], &[1, 640]],
    ];
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::V6E] {
            for (seed, set) in sets.iter().enumerate() {
                let shapes: Vec<Vec<usize>> = set.iter().map(|s| s.to_vec()).collect();
                let r = run_against_reference(op, &shapes, dtype, &target, seed as u64).unwrap_or_else(|e| panic!("{shapes:?}: {e}"));
                assert!(r.passed(), "{shapes:?} {dtype} on {target}: {:?}", r.outputs);
            }
        }
    }
}

/// An inf or NaN scale gives what torch's dequantize-first product gives (`x @ (w *
/// scale)^T`, as `_weight_int8pack_mm`): ±inf where all k terms share a sign, NaN where
/// one is `0 * inf` or the signs differ; other column blocks (no nonfinite scale) are
/// untouched, and a nonfinite x propagates as in the plain product. Several column and
/// K blocks (n = k = 2048), f32 and bf16.
#[test]
fn nonfinite_scales_match_dequantize_first() {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use tessera_dsl::interp::Array;
    use tessera_tests::nonfinite::assert_matches;
    let (m, k, n) = (6, 2048, 2048);
    let mut rng = StdRng::seed_from_u64(9);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut w: Vec<i8> = (0..n * k).map(|_| rng.gen_range(-127..=127)).collect();
    let mut scale: Vec<f32> = (0..n).map(|_| rng.gen_range(0.001..0.02)).collect();
    for p in 0..k {
        x[p] = rng.gen_range(0.1..1.0); // row 0 all positive
        x[2 * k + p] = x[p];
        w[5 * k + p] = rng.gen_range(1..=127); // column 5 all positive, 700 all negative
        w[700 * k + p] = rng.gen_range(-127..=-1);
        w[9 * k + p] = rng.gen_range(1..=127);
    }
    x[2 * k + 11] = 0.0; // row 2: one zero (0 * inf)
    w[9 * k + 100] = 0; // column 9: one zero weight
    x[4 * k + 17] = f32::INFINITY; // an inf activation (finite scales elsewhere)
    scale[5] = f32::INFINITY;
    scale[700] = f32::NEG_INFINITY;
    scale[9] = f32::INFINITY;
    scale[1500] = f32::NAN;
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::V6E] {
            let xa = Array::from_f32_in(dtype, &[m, k], x.clone());
            let wa = Array::from_i8(&[n, k], w.clone());
            let sa = Array::from_f32(&[n], scale.clone());
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
            let (got, _) = assert_matches("quantized_matmul", "quantized_matmul", &[Some(&xa), Some(&wa), Some(&sa)], "", &target, tol);
            let o = got[0].to_f64_vec();
            let at = |i: usize, j: usize| o[i * n + j];
            assert_eq!((at(0, 5), at(0, 700)), (f64::INFINITY, f64::INFINITY), "{dtype} {target}: same-sign terms");
            assert!(at(1, 5).is_nan() && at(2, 5).is_nan() && at(0, 9).is_nan() && at(3, 1500).is_nan(), "{dtype} {target}");
            assert!(at(1, 1000).is_finite() && !at(4, 1000).is_finite(), "{dtype} {target}: finite scales, an inf activation");
        }
    }
}
