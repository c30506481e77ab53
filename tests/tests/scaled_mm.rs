//! The blockwise-scaled fp8 matmul (issue 15 item 2, `kernels/src/scaled_mm.rs`):
//!
//! - forward (`1x128 x 128x128`), dgrad (`transpose_rhs`: `dOut @ B^T`) and wgrad (`128x1 x
//!   128x1`: `A^T @ dOut`) on every CPU backend with bitwise agreement, against an f64
//!   reference written here (dequantize, then matmul), float8_e4m3fn, float8_e5m2 and
//!   mixed, six shape sets with partial M / N (and K / N for wgrad) edge blocks at small
//!   explicit blocks;
//! - the 1x128 and 128x1 quantizers bit for bit against an amax/448 reference (zero blocks,
//!   NaN blocks, bf16 input), and the whole training recipe (quantize, dgrad, wgrad)
//!   against the unquantized f64 products within fp8's quantization error;
//! - NaN in an operand or a scale propagates as torch's dequantize-first product does;
//! - bad input is an error naming the op, the operand and the rule (K % 128, scale shapes,
//!   dtypes), never a panic;
//! - on v5e/v6e the fp8 blocks are up-converted (no `matmul-emulated` warning), on tpu7x
//!   the dot is fp8; the libtpu tier compiles one configuration of each kernel for v5e, v6e
//!   and tpu7x.

use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::Array;
use tessera_dsl::{fp8, verify, DType, Interpreter, Kernel, Target, Type};
use tessera_kernels::scaled_mm::{quantize_fp8_128x1_kernel, quantize_fp8_1x128_kernel, scaled_mm_blockwise_kernel, scaled_mm_blockwise_wgrad_kernel};
use tessera_tests::backends::{assert_libtpu_accepts, run_all, ty};

const E4: DType = DType::F8E4M3FN;
const E5: DType = DType::F8E5M2;
const B: usize = 128;

fn fp8_array(dtype: DType, shape: &[usize], rng: &mut StdRng) -> Array {
    let v: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.gen_range(-6.0f32..6.0)).collect();
    Array::from_f32_as_fp8(dtype, shape, &v)
}

fn scales(shape: &[usize], rng: &mut StdRng) -> Array {
    Array::from_f32(shape, (0..shape.iter().product::<usize>()).map(|_| 2f32.powi(rng.gen_range(-9..-2)) * rng.gen_range(1.0f32..2.0)).collect())
}

/// Dequantize, then matmul, in f64: `a [m, k]` with `sa [m, k/128]`, `b [k, n]` (or `[n, k]`
/// with `t`) with `sb` per 128x128 tile of b as stored.
fn dequant_matmul(a: &Array, b: &Array, sa: &Array, sb: &Array, t: bool) -> Vec<f64> {
    let (m, k) = (a.shape[0], a.shape[1]);
    let n = if t { b.shape[0] } else { b.shape[1] };
    let (a, b, sa, sb) = (a.to_f64_vec(), b.to_f64_vec(), sa.to_f64_vec(), sb.to_f64_vec());
    let (kb, nb) = (k / B, n.div_ceil(B));
    let da: Vec<f64> = (0..m * k).map(|e| a[e] * sa[(e / k) * kb + (e % k) / B]).collect();
    // b dequantized as [k, n].
    let db: Vec<f64> = (0..k * n).map(|e| { let (p, j) = (e / n, e % n); if t { b[j * k + p] * sb[(j / B) * kb + p / B] } else { b[e] * sb[(p / B) * nb + j / B] } }).collect();
    tessera_kernels::reference::matmul(&da, &db, m, k, n)
}

/// `max|got - want| / max|want|` over finite references, and the NaN positions agree.
fn assert_close(got: &Array, want: &[f64], tol: f64, what: &str) {
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{what}");
    let scale = want.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let mut err = 0f64;
    for (i, (x, w)) in g.iter().zip(want).enumerate() {
        assert_eq!(x.is_nan(), w.is_nan(), "{what}: element {i} is {x}, the reference {w}");
        if w.is_finite() {
            err = err.max((x - w).abs() / scale);
        }
    }
    assert!(err <= tol, "{what}: relative error {err:.3e} > {tol:.1e}");
}

/// bf16 output: one rounding of an O(max) value, plus f32 accumulation.
const BF16_TOL: f64 = 1.6e-2;

#[test]
fn forward_and_dgrad_match_dequantize_then_matmul_on_every_backend() {
    // (m, k, n, bm, bn, bk, transpose_rhs): partial M blocks (bm not dividing m), partial N
    // blocks (n % 128 != 0, and n % bn != 0), n < 128, a single row, several K steps and
    // several 128-wide sub-blocks per step.
    let sets = [(64, 128, 128, 64, 128, 128, false), (200, 256, 300, 64, 256, 128, false), (96, 384, 100, 32, 100, 384, false), (1, 512, 256, 1, 256, 256, false), (130, 256, 400, 64, 256, 256, true), (72, 384, 256, 32, 128, 128, true)];
    let mut rng = StdRng::seed_from_u64(15);
    for (idx, &(m, k, n, bm, bn, bk, t)) in sets.iter().enumerate() {
        for (da, db) in [(E4, E4), (E5, E5), (E4, E5)] {
            let a = fp8_array(da, &[m, k], &mut rng);
            let b = fp8_array(db, &if t { [n, k] } else { [k, n] }, &mut rng);
            let sa = scales(&[m, k / B], &mut rng);
            let sb = scales(&if t { [n.div_ceil(B), k / B] } else { [k / B, n.div_ceil(B)] }, &mut rng);
            let want = dequant_matmul(&a, &b, &sa, &sb, t);
            for up in [true, false] {
                let kern = scaled_mm_blockwise_kernel(ty(da, &a.shape), ty(db, &b.shape), ty(DType::F32, &sa.shape), ty(DType::F32, &sb.shape), ty(DType::BF16, &[m, n]), bm, bn, bk, t, up).unwrap();
                let out = run_all(&kern, &[&a, &b, &sa, &sb]);
                assert_close(&out[0], &want, BF16_TOL, &format!("set {idx} {m}x{k}x{n} blocks {bm}x{bn}x{bk} t {t} {da} x {db} up {up}"));
            }
        }
    }
}

#[test]
fn wgrad_matches_dequantize_then_matmul_on_every_backend() {
    // (m, k, n, bm, bk, bn): partial K and N output blocks, one M block, several M steps,
    // several 128-row sub-blocks per step.
    let sets = [(128, 128, 128, 128, 128, 128), (256, 200, 136, 128, 128, 128), (384, 64, 300, 384, 64, 128), (128, 512, 40, 128, 256, 40), (512, 136, 256, 256, 128, 256)];
    let mut rng = StdRng::seed_from_u64(16);
    for (idx, &(m, k, n, bm, bk, bn)) in sets.iter().enumerate() {
        for (da, dg) in [(E4, E4), (E5, E5), (E4, E5)] {
            let a = fp8_array(da, &[m, k], &mut rng);
            let g = fp8_array(dg, &[m, n], &mut rng);
            let (sa, sg) = (scales(&[m / B, k], &mut rng), scales(&[m / B, n], &mut rng));
            let (av, gv, sav, sgv) = (a.to_f64_vec(), g.to_f64_vec(), sa.to_f64_vec(), sg.to_f64_vec());
            let mut want = vec![0.0; k * n];
            for i in 0..m {
                for p in 0..k {
                    let x = av[i * k + p] * sav[(i / B) * k + p];
                    for j in 0..n {
                        want[p * n + j] += x * gv[i * n + j] * sgv[(i / B) * n + j];
                    }
                }
            }
            let kern = scaled_mm_blockwise_wgrad_kernel(ty(da, &[m, k]), ty(dg, &[m, n]), ty(DType::F32, &sa.shape), ty(DType::F32, &sg.shape), ty(DType::BF16, &[k, n]), bm, bk, bn, true).unwrap();
            let out = run_all(&kern, &[&a, &g, &sa, &sg]);
            assert_close(&out[0], &want, BF16_TOL, &format!("wgrad set {idx} {m}x{k}x{n} {da} x {dg}"));
        }
    }
}

/// torch's recipe, in f32 as torch computes it: `scale = amax.clamp(min=1e-12) / 448`,
/// `q = (x / scale).to(float8_e4m3fn)`, per block of `rows x cols`.
fn quantize_ref(x: &[f32], m: usize, n: usize, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let (sr, sc) = (m.div_ceil(rows), n / cols);
    let mut scale = vec![0f32; sr * sc];
    for bi in 0..sr {
        for bj in 0..sc {
            let mut amax = 0f32;
            let mut nan = false;
            for i in bi * rows..((bi + 1) * rows).min(m) {
                for j in bj * cols..(bj + 1) * cols {
                    nan |= x[i * n + j].is_nan();
                    amax = amax.max(x[i * n + j].abs());
                }
            }
            scale[bi * sc + bj] = if nan { f32::NAN } else { amax.max(1e-12) / 448.0 };
        }
    }
    let q = (0..m * n).map(|e| fp8::e4m3fn_from_f32(x[e] / scale[(e / n / rows) * sc + (e % n) / cols])).collect();
    (q, scale)
}

fn assert_quantized(got: &[Array], q: &[u8], s: &[f32], what: &str) {
    let gq = got[0].fp8_bits().unwrap();
    // NaN codes: any NaN of e4m3fn (0x7f / 0xff) is NaN.
    let same = |a: u8, b: u8| a == b || (a & 0x7f == 0x7f && b & 0x7f == 0x7f);
    for (i, (&a, &b)) in gq.iter().zip(q).enumerate() {
        assert!(same(a, b), "{what}: q[{i}] = {a:#04x}, reference {b:#04x}");
    }
    let gs = got[1].to_f32_vec();
    for (i, (&a, &b)) in gs.iter().zip(s).enumerate() {
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{what}: scale[{i}] = {a:e}, reference {b:e}");
    }
}

fn quantizer_input(m: usize, n: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * n).map(|e| rng.gen_range(-1.0f32..1.0) * 2f32.powi(((e / n) % 11) as i32 - 5)).collect();
    // An all-zero 1x128 block and 128x1 block (scale 1e-12/448, q all zero) and a NaN.
    x[..B].fill(0.0);
    for i in 0..B.min(m) {
        x[i * n + n - 1] = 0.0;
    }
    x[(m - 1) * n + 3] = f32::NAN;
    x
}

#[test]
fn quantizers_match_the_amax_reference_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(17);
    for (m, n, bm) in [(200, 384, 64), (130, 256, 130), (1, 128, 1)] {
        for dtype in [DType::F32, DType::BF16] {
            let x = quantizer_input(m, n, &mut rng);
            let xa = Array::from_f32_in(dtype, &[m, n], x);
            let (q, s) = quantize_ref(&xa.to_f32_vec(), m, n, 1, B);
            let k = quantize_fp8_1x128_kernel(ty(dtype, &[m, n]), ty(E4, &[m, n]), ty(DType::F32, &[m, n / B]), bm).unwrap();
            assert_quantized(&run_all(&k, &[&xa]), &q, &s, &format!("1x128 {m}x{n} {dtype}"));
            // The NaN block: NaN scale, every q of the block NaN.
            assert!(s[(m - 1) * (n / B)].is_nan());
        }
    }
    for (m, n, bn) in [(256, 200, 128), (384, 64, 64), (128, 640, 256)] {
        let x = quantizer_input(m, n, &mut rng);
        let xa = Array::from_f32(&[m, n], x.clone());
        let (q, s) = quantize_ref(&x, m, n, B, 1);
        let k = quantize_fp8_128x1_kernel(ty(DType::F32, &[m, n]), ty(E4, &[m, n]), ty(DType::F32, &[m / B, n]), bn).unwrap();
        assert_quantized(&run_all(&k, &[&xa]), &q, &s, &format!("128x1 {m}x{n}"));
    }
}

fn run(op: &str, inputs: &[&Array], statics: &str) -> Vec<Array> {
    let op = tessera_kernels::find(op).unwrap();
    let given: Vec<Option<&Array>> = inputs.iter().copied().map(Some).collect();
    op.run(&Interpreter, &given, &op.statics(statics).unwrap(), &Target::V6E).unwrap_or_else(|e| panic!("{}: {e}", op.name))
}

/// The training recipe end to end through the op table: out = x @ w, dx = dout @ w^T,
/// dw = x^T @ dout with x and dout quantized by the ops (1x128 for out and dx, 128x1 for
/// dw) and w per 128x128 tile on the host (a weight is quantized once), against the
/// unquantized f64 products: within e4m3fn's quantization error.
#[test]
fn the_training_recipe_tracks_the_unquantized_products() {
    let (m, k, n) = (256, 384, 256);
    let mut rng = StdRng::seed_from_u64(18);
    let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let w: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-0.1f32..0.1)).collect();
    let dout: Vec<f32> = (0..m * n).map(|_| rng.gen_range(-0.01f32..0.01)).collect();
    let (xa, da) = (Array::from_f32(&[m, k], x.clone()), Array::from_f32(&[m, n], dout.clone()));
    // w's 128x128 tiles: scale = amax / 448 per tile, q = w / scale (host side, as a
    // weight is quantized once).
    let (kb, nb) = (k / B, n / B);
    let mut sw = vec![0f32; kb * nb];
    for p in 0..k {
        for j in 0..n {
            sw[(p / B) * nb + j / B] = sw[(p / B) * nb + j / B].max(w[p * n + j].abs());
        }
    }
    sw.iter_mut().for_each(|s| *s = s.max(1e-12) / 448.0);
    let qw = Array::from_f32_as_fp8(E4, &[k, n], &(0..k * n).map(|e| w[e] / sw[(e / n / B) * nb + (e % n) / B]).collect::<Vec<_>>());
    let sw = Array::from_f32(&[kb, nb], sw);
    let qx = run("quantize_fp8_1x128", &[&xa], "");
    let out = run("scaled_mm_blockwise", &[&qx[0], &qw, &qx[1], &sw], "");
    let qd = run("quantize_fp8_1x128", &[&da], "");
    // dgrad reads w [k, n] and its scales [k/128, n/128] in place as B^T.
    let dx = run("scaled_mm_blockwise", &[&qd[0], &qw, &qd[1], &sw], "transpose_rhs=True");
    let (qx2, qd2) = (run("quantize_fp8_128x1", &[&xa], ""), run("quantize_fp8_128x1", &[&da], ""));
    let dw = run("scaled_mm_blockwise_wgrad", &[&qx2[0], &qd2[0], &qx2[1], &qd2[1]], "");
    let mm = |a: &[f32], b: &[f32], r: usize, inner: usize, c: usize, ta: bool, tb: bool| -> Vec<f64> {
        let mut o = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                o[i * c + j] = (0..inner).map(|p| a[if ta { p * r + i } else { i * inner + p }] as f64 * b[if tb { j * inner + p } else { p * c + j }] as f64).sum();
            }
        }
        o
    };
    // e4m3fn keeps 3 mantissa bits: each operand is within 2^-4 relative; over a sum of
    // random-sign terms the error of the product is well inside 5% of its max.
    assert_close(&out[0], &mm(&x, &w, m, k, n, false, false), 5e-2, "out = x @ w");
    assert_close(&dx[0], &mm(&dout, &w, m, n, k, false, true), 5e-2, "dx = dout @ w^T");
    assert_close(&dw[0], &mm(&x, &dout, k, m, n, true, false), 5e-2, "dw = x^T @ dout");
}

/// NaN in a, in b, in a row scale or in a tile scale: NaN exactly where torch's
/// dequantize-first product has it (the row; the column; row m; the tile's columns).
#[test]
fn nan_propagates_as_dequantize_first() {
    let (m, k, n) = (40, 256, 256);
    let mut rng = StdRng::seed_from_u64(19);
    let mut a = fp8_array(E4, &[m, k], &mut rng).to_f32_vec();
    let mut b = fp8_array(E5, &[k, n], &mut rng).to_f32_vec();
    let mut sa = scales(&[m, 2], &mut rng).to_f32_vec();
    let mut sb = scales(&[2, 2], &mut rng).to_f32_vec();
    a[3 * k + 7] = f32::NAN; // row 3
    b[200 * n + 5] = f32::NAN; // column 5
    sa[10 * 2 + 1] = f32::NAN; // row 10
    sb[1] = f32::NAN; // columns 128..256
    let (a, b) = (Array::from_f32_as_fp8(E4, &[m, k], &a), Array::from_f32_as_fp8(E5, &[k, n], &b));
    let (sa, sb) = (Array::from_f32(&[m, 2], sa), Array::from_f32(&[2, 2], sb));
    let want = dequant_matmul(&a, &b, &sa, &sb, false);
    for (i, w) in want.iter().enumerate() {
        let (r, c) = (i / n, i % n);
        assert_eq!(w.is_nan(), r == 3 || r == 10 || c == 5 || c >= 128, "reference at ({r}, {c})");
    }
    let out = run("scaled_mm_blockwise", &[&a, &b, &sa, &sb], "");
    assert_close(&out[0], &want, BF16_TOL, "NaN propagation");
}

#[test]
fn bad_input_is_an_error_naming_the_operand_and_the_rule() {
    let target = Target::V6E;
    let op = tessera_kernels::find("scaled_mm_blockwise").unwrap();
    let call = |a: Type, b: Type, sa: Type, sb: Type, statics: &str| op.plan_for(&[Some(a), Some(b), Some(sa), Some(sb)], &op.statics(statics).unwrap(), &target).map(|_| ()).expect_err("must be refused");
    let f = DType::F32;
    // K not a multiple of 128.
    let e = call(ty(E4, &[64, 200]), ty(E4, &[200, 256]), ty(f, &[64, 2]), ty(f, &[2, 2]), "");
    assert_eq!((e.kernel.as_str(), e.rule), ("scaled_mm_blockwise", "operand-shape"), "{e}");
    assert!(e.to_string().contains("`a`") && e.to_string().contains("multiple of 128") && e.to_string().contains("256"), "{e}");
    // scale_a / scale_b of the wrong shape.
    let e = call(ty(E4, &[64, 256]), ty(E4, &[256, 300]), ty(f, &[64, 3]), ty(f, &[2, 3]), "");
    assert!(e.rule == "operand-shape" && e.to_string().contains("scale_a") && e.to_string().contains("[64, 2]"), "{e}");
    let e = call(ty(E4, &[64, 256]), ty(E4, &[256, 300]), ty(f, &[64, 2]), ty(f, &[2, 2]), "");
    assert!(e.rule == "operand-shape" && e.to_string().contains("scale_b") && e.to_string().contains("[2, 3]"), "{e}");
    let e = call(ty(E4, &[64, 256]), ty(E4, &[300, 256]), ty(f, &[64, 2]), ty(f, &[2, 3]), "transpose_rhs=True");
    assert!(e.rule == "operand-shape" && e.to_string().contains("scale_b") && e.to_string().contains("[3, 2]"), "{e}");
    // dtypes: fp8 with bf16, bf16 scales.
    let e = call(ty(E4, &[64, 256]), ty(DType::BF16, &[256, 256]), ty(f, &[64, 2]), ty(f, &[2, 2]), "");
    assert!(e.rule == "operand-dtype" && e.to_string().contains("float8"), "{e}");
    let e = call(ty(E4, &[64, 256]), ty(E4, &[256, 256]), ty(DType::BF16, &[64, 2]), ty(f, &[2, 2]), "");
    assert!(e.rule == "operand-dtype" && e.to_string().contains("scale_a"), "{e}");
    // wgrad: M not a multiple of 128; quantizers likewise.
    let w = tessera_kernels::find("scaled_mm_blockwise_wgrad").unwrap();
    let e = w.plan_for(&[Some(ty(E4, &[200, 128])), Some(ty(E4, &[200, 128])), Some(ty(f, &[1, 128])), Some(ty(f, &[1, 128]))], &w.statics("").unwrap(), &target).map(|_| ()).unwrap_err();
    assert!(e.rule == "operand-shape" && e.to_string().contains("multiple of 128"), "{e}");
    for (name, shape) in [("quantize_fp8_1x128", [64, 200]), ("quantize_fp8_128x1", [200, 64])] {
        let q = tessera_kernels::find(name).unwrap();
        let e = q.plan_for(&[Some(ty(f, &shape))], &q.statics("").unwrap(), &target).map(|_| ()).unwrap_err();
        assert!(e.kernel == name && e.rule == "operand-shape" && e.to_string().contains("`x`"), "{e}");
    }
}

fn library_kernels(target: &Target) -> Vec<Kernel> {
    let f = DType::F32;
    let up = |d: DType| !target.matmul_dtypes.contains(&d);
    vec![
        scaled_mm_blockwise_kernel(ty(E4, &[512, 1024]), ty(E4, &[1024, 1024]), ty(f, &[512, 8]), ty(f, &[8, 8]), ty(DType::BF16, &[512, 1024]), 512, 512, 1024, false, up(E4)).unwrap(),
        scaled_mm_blockwise_kernel(ty(E5, &[200, 384]), ty(E5, &[600, 384]), ty(f, &[200, 3]), ty(f, &[5, 3]), ty(DType::BF16, &[200, 600]), 200, 512, 384, true, up(E5)).unwrap(),
        scaled_mm_blockwise_wgrad_kernel(ty(E4, &[1024, 512]), ty(E5, &[1024, 512]), ty(f, &[8, 512]), ty(f, &[8, 512]), ty(DType::BF16, &[512, 512]), 512, 512, 512, up(E4)).unwrap(),
        quantize_fp8_1x128_kernel(ty(DType::BF16, &[512, 1024]), ty(E4, &[512, 1024]), ty(f, &[512, 8]), 512).unwrap(),
        quantize_fp8_128x1_kernel(ty(DType::BF16, &[1024, 512]), ty(E4, &[1024, 512]), ty(f, &[8, 512]), 512).unwrap(),
    ]
}

#[test]
fn fp8_is_native_on_tpu7x_and_up_converted_elsewhere() {
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for k in library_kernels(&target) {
            let warnings = verify::check(&k, &target).unwrap_or_else(|e| panic!("{} on {target}: {e}", k.name));
            assert!(!warnings.iter().any(|w| w.rule == "matmul-emulated"), "{} on {target}: {warnings:?}", k.name);
        }
        let mosaic = tessera_codegen::lower(&library_kernels(&target)[0], &target).unwrap().mosaic;
        let fp8_dot = mosaic.lines().any(|l| l.contains("matmul") && l.contains("f8E4M3FN"));
        assert_eq!(fp8_dot, target.name == "tpu7x", "{target}: the dot's operands");
    }
}

#[test]
fn libtpu_compiles_the_scaled_mm_kernels_for_v5e_v6e_tpu7x() {
    if !tessera_tests::oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (and TESSERA_PYTHON) for the libtpu tier");
        return;
    }
    // One configuration of each kernel (forward, dgrad, wgrad, both quantizers) on each
    // generation: up-converted fp8 on v5e and v6e, native on tpu7x.
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        assert_libtpu_accepts(&library_kernels(&target), &target);
    }
}
