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

/// The 4-bit weight matmuls (`quant4`) and `int_mm` against their f64 references (decode,
/// dequantise, multiply), on the interpreter and the JIT, f32 and bf16, at v5e's and v6e's
/// blocks: five shape sets each, among them a single row (decode), K not a multiple of 128,
/// N not a multiple of 128, several K steps, and group sizes 32 to 128 for int4, then int4
/// groups longer than the 128-row K step (256 for all of K = 256, two and eight of them, and
/// 192); and the input gradients (`*_dx`) at five sets each (int4's also at those groups).
#[test]
fn four_bit_and_int8_matmuls_match_reference() {
    use tessera_codegen::cpu::Backend;
    // (op, shapes): x [m, k], w [k/2, n], scale [k/g, n] (+ global scale [1]).
    let int4: [[&[usize]; 3]; 9] = [
        [&[1, 2048], &[1024, 1536], &[16, 1536]],
        [&[40, 2880], &[1440, 200], &[45, 200]],
        [&[7, 192], &[96, 136], &[6, 136]],
        [&[130, 4096], &[2048, 256], &[64, 256]],
        [&[64, 1024], &[512, 512], &[8, 512]],
        [&[4, 256], &[128, 16], &[1, 16]],
        [&[5, 512], &[256, 136], &[2, 136]],
        [&[8, 2048], &[1024, 128], &[8, 128]],
        [&[3, 384], &[192, 128], &[2, 128]],
    ];
    let mx: [[&[usize]; 3]; 5] = [
        [&[1, 2048], &[1024, 1536], &[64, 1536]],
        [&[40, 2880], &[1440, 200], &[90, 200]],
        [&[7, 192], &[96, 136], &[6, 136]],
        [&[130, 4096], &[2048, 256], &[128, 256]],
        [&[64, 1024], &[512, 512], &[32, 512]],
    ];
    let nv: [[&[usize]; 4]; 5] = [
        [&[1, 2048], &[1024, 1536], &[128, 1536], &[1]],
        [&[40, 2880], &[1440, 200], &[180, 200], &[1]],
        [&[7, 192], &[96, 136], &[12, 136], &[1]],
        [&[130, 4096], &[2048, 256], &[256, 256], &[1]],
        [&[64, 1024], &[512, 512], &[64, 512], &[1]],
    ];
    // The input gradients: dy [m, n], the same w and scales (n blocks divide n).
    let dx: [(&str, [&[usize]; 4]); 18] = [
        ("matmul_int4_dx", [&[4, 16], &[128, 16], &[1, 16], &[]]),
        ("matmul_int4_dx", [&[5, 256], &[256, 256], &[2, 256], &[]]),
        ("matmul_int4_dx", [&[3, 128], &[192, 128], &[2, 128], &[]]),
        ("matmul_int4_dx", [&[1, 1536], &[1024, 1536], &[16, 1536], &[]]),
        ("matmul_int4_dx", [&[40, 200], &[1440, 200], &[45, 200], &[]]),
        ("matmul_int4_dx", [&[7, 136], &[96, 136], &[6, 136], &[]]),
        ("matmul_int4_dx", [&[130, 256], &[2048, 256], &[64, 256], &[]]),
        ("matmul_int4_dx", [&[64, 1024], &[512, 1024], &[8, 1024], &[]]),
        ("matmul_mxfp4_dx", [&[1, 1536], &[1024, 1536], &[64, 1536], &[]]),
        ("matmul_mxfp4_dx", [&[40, 200], &[1440, 200], &[90, 200], &[]]),
        ("matmul_mxfp4_dx", [&[7, 136], &[96, 136], &[6, 136], &[]]),
        ("matmul_mxfp4_dx", [&[130, 256], &[2048, 256], &[128, 256], &[]]),
        ("matmul_mxfp4_dx", [&[64, 1024], &[512, 1024], &[32, 1024], &[]]),
        ("matmul_nvfp4_dx", [&[1, 1536], &[1024, 1536], &[128, 1536], &[1]]),
        ("matmul_nvfp4_dx", [&[40, 200], &[1440, 200], &[180, 200], &[1]]),
        ("matmul_nvfp4_dx", [&[7, 136], &[96, 136], &[12, 136], &[1]]),
        ("matmul_nvfp4_dx", [&[130, 256], &[2048, 256], &[256, 256], &[1]]),
        ("matmul_nvfp4_dx", [&[64, 1024], &[512, 1024], &[64, 1024], &[1]]),
    ];
    let int_mm: [[&[usize]; 2]; 5] = [[&[1, 2048], &[2048, 640]], [&[40, 200], &[200, 72]], [&[256, 4096], &[4096, 512]], [&[33, 2880], &[2880, 136]], [&[512, 128], &[128, 128]]];
    let mut sets: Vec<(&str, Vec<Vec<usize>>)> = Vec::new();
    sets.extend(int4.iter().map(|s| ("matmul_int4", s.iter().map(|d| d.to_vec()).collect())));
    sets.extend(mx.iter().map(|s| ("matmul_mxfp4", s.iter().map(|d| d.to_vec()).collect())));
    sets.extend(nv.iter().map(|s| ("matmul_nvfp4", s.iter().map(|d| d.to_vec()).collect())));
    sets.extend(int_mm.iter().map(|s| ("int_mm", s.iter().map(|d| d.to_vec()).collect())));
    sets.extend(dx.iter().map(|(name, s)| (*name, s.iter().filter(|d| !d.is_empty()).map(|d| d.to_vec()).collect())));
    for (seed, (name, shapes)) in sets.iter().enumerate() {
        let op = tessera_kernels::find(name).unwrap();
        let statics = op.statics("").unwrap();
        for dtype in [DType::F32, DType::BF16] {
            for target in [Target::V5E, Target::V6E] {
                for be in [Backend::Interp, Backend::Jit] {
                    let r = tessera_kernels::harness::run_case(op, &statics, shapes, dtype, &target, seed as u64, be.executor()).unwrap_or_else(|e| panic!("{name} {shapes:?}: {e}"));
                    assert!(r.passed(), "{name} {shapes:?} {dtype} on {target} ({be:?}): {:?}", r.outputs);
                }
            }
        }
    }
}

/// Every E2M1 code under every E8M0 scale byte, read back exactly: `x` is the identity, so
/// `out = W` as the kernel dequantised it (f32). 2^-127 (byte 0, subnormal: the CPU keeps
/// it, a TPU flushes it) to 2^123 (250) included, 255 is NaN; int4's 16 codes with a scale
/// of 1 likewise. Interpreter and JIT.
#[test]
fn every_code_and_scale_byte_decodes_exactly() {
    use tessera_codegen::cpu::Backend;
    use tessera_dsl::interp::Array;
    use tessera_kernels::quant4::{e2m1_value, PLANE};
    // 64 K rows (the 16 codes four times), 256 columns: column j has scale byte j.
    let (k, n) = (64, 256);
    // W[p, j] = code (p % 16), scale byte j for the two groups of the column.
    let mut packed = vec![0i8; k / 2 * n];
    for p in 0..k {
        for j in 0..n {
            let code = (p % 16) as u8;
            let (row, high) = (p % PLANE + (p / 64) * PLANE, (p % 64) >= PLANE);
            let b = &mut packed[row * n + j];
            *b = ((*b as u8) | if high { code << 4 } else { code }) as i8;
        }
    }
    let eye: Vec<f32> = (0..k * k).map(|e| if e / k == e % k { 1.0 } else { 0.0 }).collect();
    let x = Array::from_f32(&[k, k], eye);
    let w = Array::from_i8(&[k / 2, n], packed);
    let bytes: Vec<i8> = (0..2 * n).map(|e| (e % n) as u8 as i8).collect();
    let mx_scale = Array::from_i8(&[2, n], bytes);
    let ones = Array::from_f32(&[2, n], vec![1.0; 2 * n]);
    let op = tessera_kernels::find("matmul_mxfp4").unwrap();
    let op4 = tessera_kernels::find("matmul_int4").unwrap();
    for be in [Backend::Interp, Backend::Jit] {
        let out = op.run(be.executor(), &[Some(&x), Some(&w), Some(&mx_scale)], &op.statics("").unwrap(), &Target::V5E).unwrap();
        let got = out[0].to_f64_vec();
        let out4 = op4.run(be.executor(), &[Some(&x), Some(&w), Some(&ones)], &op4.statics("").unwrap(), &Target::V5E).unwrap();
        let got4 = out4[0].to_f64_vec();
        for p in 0..k {
            for j in 0..n {
                let code = (p % 16) as u8;
                let byte = j % 256;
                // Bytes 251..254 scale 6 past f32's range: that column of W holds an inf,
                // and the identity's zeros times it are NaN (as in torch); not checked here.
                if (251..255).contains(&byte) {
                    continue;
                }
                let want = if byte == 255 { f64::NAN } else { e2m1_value(code) * 2f64.powi(byte as i32 - 127) };
                let g = got[p * n + j];
                assert!(g == want || (g.is_nan() && want.is_nan()), "{be:?}: code {code:#x} with E8M0 byte {byte}: {g} vs {want}");
                let want4 = if code >= 8 { code as f64 - 16.0 } else { code as f64 };
                assert_eq!(got4[p * n + j], want4, "{be:?}: int4 code {code:#x}");
            }
        }
    }
}

/// Bad shapes are errors that name the op, the operand and the rule, and say what to pass.
#[test]
fn four_bit_contract_errors_say_what_to_pass() {
    use tessera_dsl::Type;
    let t = |d: DType, s: &[usize]| Some(Type::vector(d, s));
    let cases: Vec<(&str, Vec<Option<Type>>, &str, &str)> = vec![
        ("matmul_int4", vec![t(DType::F32, &[4, 256]), t(DType::I8, &[256, 128]), t(DType::F32, &[2, 128])], "operand-shape", "k / 2 = 128"),
        ("matmul_int4", vec![t(DType::F32, &[4, 160]), t(DType::I8, &[80, 128]), t(DType::F32, &[5, 128])], "operand-shape", "multiple of 64"),
        ("matmul_int4", vec![t(DType::F32, &[4, 256]), t(DType::I8, &[128, 128]), t(DType::F32, &[16, 128])], "operand-shape", "multiple of 32"),
        ("matmul_mxfp4", vec![t(DType::F32, &[4, 256]), t(DType::I8, &[128, 128]), t(DType::I8, &[16, 128])], "operand-shape", "one scale per 32"),
        ("matmul_nvfp4", vec![t(DType::F32, &[4, 256]), t(DType::I8, &[128, 128]), t(DType::F8E4M3FN, &[16, 128]), t(DType::F32, &[2])], "operand-shape", "global_scale"),
        ("matmul_mxfp4", vec![t(DType::F32, &[4, 256]), t(DType::I32, &[128, 128]), t(DType::I8, &[8, 128])], "operand-dtype", "int8"),
    ];
    for (name, inputs, rule, words) in cases {
        let op = tessera_kernels::find(name).unwrap();
        let e = op.plan_for(&inputs, &op.statics("").unwrap(), &Target::V5E).err().unwrap_or_else(|| panic!("{name} {inputs:?} must be refused"));
        assert_eq!(e.rule, rule, "{e}");
        assert!(e.to_string().contains(name) && e.to_string().contains(words), "`{words}` missing from: {e}");
    }
}
