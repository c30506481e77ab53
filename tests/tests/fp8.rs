//! The fp8 dtypes (`float8_e4m3fn`, `float8_e5m2`; issue 16 item 4).
//!
//! - Conversions against PyTorch's own answers (`tests/fixtures/fp8_torch.txt`, written by
//!   `scripts/gen_fp8_fixture.py` with torch 2.15): all 256 codes of each format decoded,
//!   and f32 -> fp8 on 8410 chosen values (every fp8 value, every tie between neighbours and
//!   the f32 on each side of it, overflow edges, infinities, NaNs, f32 subnormals, random
//!   bits and magnitudes, both signs) — by `tessera_dsl::fp8`, and by cast kernels on the
//!   interpreter and the JIT (which has its own bit-manipulation lowering).
//! - bf16 <-> fp8 on all 65536 bf16 values (torch: bf16 -> fp8 equals bf16 -> f32 -> fp8,
//!   measured on all of them) and casts through f32 (fp8 <-> i32, e4m3fn <-> e5m2).
//! - fp8 dots (both formats, mixed, fp8 x bf16) against an f64 reference on each backend.
//! - What libtpu does not lower (arithmetic, compares, reductions of fp8) is `fp8-op` on
//!   every generation; fp8 x fp8 dots are native on tpu7x and `matmul-emulated` warnings
//!   elsewhere; out-of-range fp8 literals are `literal-range`.
//! - The libtpu tier: the kernels here compile for v5e, v6e and tpu7x.

use half::bf16;
use tessera_codegen::cpu::{cache_stats, Backend};
use tessera_dsl::fp8;
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, verify, DType, Kernel, KernelError, Target};
use tessera_macros::tpu_kernel;
use tessera_tests::backends::{all as backends, ty};

const E4: DType = DType::F8E4M3FN;
const E5: DType = DType::F8E5M2;

/// Runs `k` on `be`, checking a compiled backend compiled it (no interpreter fallback).
fn run_on(be: Backend, k: &Kernel, inputs: &[&Array]) -> Vec<Array> {
    let before = cache_stats().fallbacks;
    let out = exec::run(be.executor(), k, inputs).unwrap_or_else(|e| panic!("{be:?}: {e}"));
    assert_eq!(cache_stats().fallbacks, before, "{be:?} fell back to the interpreter for `{}`", k.name);
    out
}

struct Fixture {
    /// (code, torch's f32 for e4m3fn, for e5m2).
    decode: Vec<(u8, u32, u32)>,
    /// (f32 bits, torch's e4m3fn code, e5m2 code).
    encode: Vec<(u32, u8, u8)>,
}

fn fixture() -> Fixture {
    let text = include_str!("../fixtures/fp8_torch.txt");
    let (mut decode, mut encode) = (Vec::new(), Vec::new());
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let h = |s: &str| u32::from_str_radix(s, 16).unwrap();
        match f[0] {
            "decode" => decode.push((h(f[1]) as u8, h(f[2]), h(f[3]))),
            "encode" => encode.push((h(f[1]), h(f[2]) as u8, h(f[3]) as u8)),
            other => panic!("bad fixture line kind {other}"),
        }
    }
    assert_eq!(decode.len(), 256);
    assert!(encode.len() > 8000);
    Fixture { decode, encode }
}

/// Same value, NaNs of the same sign equal whatever their payload (torch's decoded NaNs
/// carry payloads; Tessera's are quiet).
fn same_f32(got: f32, want: f32) -> bool {
    if want.is_nan() { got.is_nan() && got.is_sign_negative() == want.is_sign_negative() } else { got.to_bits() == want.to_bits() }
}

#[test]
fn conversions_match_torch_on_every_code_and_the_chosen_values() {
    let fx = fixture();
    for &(c, w4, w5) in &fx.decode {
        assert!(same_f32(fp8::e4m3fn_to_f32(c), f32::from_bits(w4)), "e4m3fn code {c:#04x}: {} vs torch {}", fp8::e4m3fn_to_f32(c), f32::from_bits(w4));
        assert!(same_f32(fp8::e5m2_to_f32(c), f32::from_bits(w5)), "e5m2 code {c:#04x}: {} vs torch {}", fp8::e5m2_to_f32(c), f32::from_bits(w5));
    }
    let mut ties = 0;
    for &(b, c4, c5) in &fx.encode {
        let x = f32::from_bits(b);
        assert_eq!(fp8::e4m3fn_from_f32(x), c4, "{x:e} ({b:#010x}) -> e4m3fn");
        assert_eq!(fp8::e5m2_from_f32(x), c5, "{x:e} ({b:#010x}) -> e5m2");
        // A tie: exactly between two neighbours of e4m3fn.
        let lo = fp8::e4m3fn_to_f32(c4);
        ties += (x.is_finite() && x != lo && ((x - lo).abs() * 2.0).to_bits() & 0x7fff == 0) as usize;
    }
    assert!(ties > 0);
    // The edges torch shows, spelled out.
    assert_eq!(fp8::e4m3fn_from_f32(464.0), 0x7e, "464 is a tie: to even, 448");
    assert_eq!(fp8::e4m3fn_from_f32(1e9), 0x7e, "e4m3fn saturates");
    assert_eq!(fp8::e4m3fn_from_f32(f32::NEG_INFINITY), 0xfe, "-inf saturates to -448");
    assert_eq!(fp8::e5m2_from_f32(61440.0), 0x7c, "61440 is a tie: to even, inf");
    assert_eq!(fp8::e5m2_from_f32(61439.996), 0x7b);
    assert_eq!(fp8::e4m3fn_from_f32(-f32::NAN), 0xff, "NaN keeps its sign");
    assert_eq!(fp8::e4m3fn_from_f32(2f32.powi(-10)), 0x00, "the tie below the smallest subnormal goes to 0");
}

#[tpu_kernel(grid = [r / 8], x = block([8, c], |i| [i, 0]), (e4, e5) = block([8, c], |i| [i, 0]))]
fn to_fp8(x: In<r, c>, e4: Out<r, c>, e5: Out<r, c>) {
    let v = x[..];
    e4[..] = v.cast(float8_e4m3fn);
    e5[..] = v.cast(float8_e5m2);
}

#[tpu_kernel(grid = [r / 8], (a, b) = block([8, c], |i| [i, 0]), (fa, fb, ha, hb) = block([8, c], |i| [i, 0]))]
fn from_fp8(a: In<r, c>, b: In<r, c>, fa: Out<r, c>, fb: Out<r, c>, ha: Out<r, c>, hb: Out<r, c>) {
    fa[..] = a[..].cast(f32);
    fb[..] = b[..].cast(f32);
    ha[..] = a[..].cast(bf16);
    hb[..] = b[..].cast(bf16);
}

/// Casts the builder routes through f32, and the moves Mosaic does on fp8 (select,
/// transpose, broadcast, constants).
#[tpu_kernel(grid = [1], (a, b) = block([c, c], |i| [0, 0]), (a5, b4, ai, t, s, z) = block([c, c], |i| [0, 0]))]
fn fp8_moves(a: In<c, c>, b: In<c, c>, a5: Out<c, c>, b4: Out<c, c>, ai: Out<c, c>, t: Out<c, c>, s: Out<c, c>, z: Out<c, c>) {
    let x = a[..];
    a5[..] = x.cast(float8_e5m2);
    b4[..] = b[..].cast(float8_e4m3fn);
    ai[..] = x.cast(i32);
    t[..] = x.t();
    s[..] = select(x.cast(f32) > 0.0, x, b[..].cast(float8_e4m3fn));
    z[..] = full([c, c], float8_e4m3fn, 1.5);
}

/// `f32` / `bf16` inputs, laid out as a [r, 128] array (padded with zeros).
fn as_rows(dtype: DType, xs: &[f32]) -> Array {
    let c = 128;
    let r = xs.len().div_ceil(c * 8) * 8;
    let mut v = xs.to_vec();
    v.resize(r * c, 0.0);
    Array::from_f32_in(dtype, &[r, c], v)
}

#[test]
fn cast_kernels_match_torch_on_interp_and_jit() {
    let fx = fixture();
    let xs: Vec<f32> = fx.encode.iter().map(|&(b, _, _)| f32::from_bits(b)).collect();
    let x = as_rows(DType::F32, &xs);
    let t = ty(DType::F32, &x.shape);
    let k = to_fp8(t.clone(), t.with_dtype(E4), t.with_dtype(E5)).unwrap();
    // All 256 codes (twice each), decoded to f32 and bf16.
    let codes: Vec<u8> = (0..2048).map(|i| i as u8).collect();
    let (ca, cb) = (Array::from_fp8_bits(E4, &[16, 128], &codes), Array::from_fp8_bits(E5, &[16, 128], &codes));
    let ct = ty(E4, &[16, 128]);
    let kd = from_fp8(ct.clone(), ct.with_dtype(E5), ct.with_dtype(DType::F32), ct.with_dtype(DType::F32), ct.with_dtype(DType::BF16), ct.with_dtype(DType::BF16)).unwrap();
    for be in backends() {
        let out = run_on(be, &k, &[&x]);
        let (g4, g5) = (out[0].fp8_bits().unwrap(), out[1].fp8_bits().unwrap());
        for (i, &(b, c4, c5)) in fx.encode.iter().enumerate() {
            assert_eq!(g4[i], c4, "{be:?}: {:e} ({b:#010x}) -> e4m3fn", f32::from_bits(b));
            assert_eq!(g5[i], c5, "{be:?}: {:e} ({b:#010x}) -> e5m2", f32::from_bits(b));
        }
        let out = run_on(be, &kd, &[&ca, &cb]);
        let (fa, fb) = (out[0].as_f32().unwrap(), out[1].as_f32().unwrap());
        let (ha, hb) = (out[2].as_bf16().unwrap(), out[3].as_bf16().unwrap());
        for (i, &c) in codes.iter().enumerate() {
            let (w4, w5) = (f32::from_bits(fx.decode[c as usize].1), f32::from_bits(fx.decode[c as usize].2));
            assert!(same_f32(fa[i], w4), "{be:?}: e4m3fn {c:#04x} -> f32 {} (torch {w4})", fa[i]);
            assert!(same_f32(fb[i], w5), "{be:?}: e5m2 {c:#04x} -> f32 {} (torch {w5})", fb[i]);
            assert!(same_f32(ha[i].to_f32(), w4) && same_f32(hb[i].to_f32(), w5), "{be:?}: code {c:#04x} -> bf16");
        }
    }
}

#[test]
fn every_bf16_value_converts_as_through_f32_on_interp_and_jit() {
    let all: Vec<f32> = (0..=u16::MAX).map(|b| bf16::from_bits(b).to_f32()).collect();
    let x = as_rows(DType::BF16, &all);
    let t = ty(DType::BF16, &x.shape);
    let k = to_fp8(t.clone(), t.with_dtype(E4), t.with_dtype(E5)).unwrap();
    let fx = fixture();
    for be in backends() {
        let out = run_on(be, &k, &[&x]);
        let (g4, g5) = (out[0].fp8_bits().unwrap(), out[1].fp8_bits().unwrap());
        for (i, &v) in all.iter().enumerate() {
            assert_eq!(g4[i], fp8::e4m3fn_from_f32(v), "{be:?}: bf16 {v:e} -> e4m3fn");
            assert_eq!(g5[i], fp8::e5m2_from_f32(v), "{be:?}: bf16 {v:e} -> e5m2");
        }
        // And torch's own answers where the fixture has the value.
        for &(b, c4, c5) in &fx.encode {
            if b & 0xffff == 0 {
                let i = (b >> 16) as usize;
                assert_eq!((g4[i], g5[i]), (c4, c5), "{be:?}: bf16 {:e}", f32::from_bits(b));
            }
        }
    }
}

#[test]
fn casts_through_f32_and_moves_on_interp_and_jit() {
    let c = 128;
    let codes: Vec<u8> = (0..c * c).map(|i| (i * 37 % 256) as u8).collect();
    let a = Array::from_fp8_bits(E4, &[c, c], &codes);
    let b = Array::from_fp8_bits(E5, &[c, c], &codes);
    let t = ty(E4, &[c, c]);
    let k = fp8_moves(t.clone(), t.with_dtype(E5), t.with_dtype(E5), t.clone(), t.with_dtype(DType::I32), t.clone(), t.clone(), t.clone()).unwrap();
    for be in backends() {
        let out = run_on(be, &k, &[&a, &b]);
        let (a5, b4, ai, tr, s, z) = (out[0].fp8_bits().unwrap(), out[1].fp8_bits().unwrap(), out[2].as_i32().unwrap(), out[3].fp8_bits().unwrap(), out[4].fp8_bits().unwrap(), out[5].fp8_bits().unwrap());
        for i in 0..c * c {
            let x = fp8::e4m3fn_to_f32(codes[i]);
            let y = fp8::e5m2_to_f32(codes[i]);
            assert_eq!(a5[i], fp8::e5m2_from_f32(x), "{be:?}: e4m3fn {x} -> e5m2");
            assert_eq!(b4[i], fp8::e4m3fn_from_f32(y), "{be:?}: e5m2 {y} -> e4m3fn");
            // f32 -> i32 truncates and saturates, NaN -> 0 (the interpreter's rule).
            assert_eq!(ai[i], if x.is_nan() { 0 } else { x as i32 }, "{be:?}: e4m3fn {x} -> i32");
            let (r, col) = (i / c, i % c);
            assert_eq!(tr[i], codes[col * c + r], "{be:?}: transpose");
            let want = if x > 0.0 { codes[i] } else { fp8::e4m3fn_from_f32(y) };
            assert_eq!(s[i], want, "{be:?}: select");
            assert_eq!(z[i], 0x3c, "{be:?}: full(1.5)");
        }
    }
}

#[tpu_kernel(grid = [m / 128], a = block([128, k], |i| [i, 0]), b = block([k, n], |i| [0, 0]), o = block([128, n], |i| [i, 0]))]
fn fp8_dot(a: In<m, k>, b: In<k, n>, o: Out<m, n>) {
    o[..] = dot(a[..], b[..]);
}

#[tpu_kernel(grid = [m / 128], a = block([128, k], |i| [i, 0]), b = block([n, k], |i| [0, 0]), o = block([128, n], |i| [i, 0]))]
fn fp8_dot_t(a: In<m, k>, b: In<n, k>, o: Out<m, n>) {
    o[..] = dot_t(a[..], b[..]);
}

/// Finite fp8 values of `dtype` in about [-4, 4], from a simple generator.
fn values(dtype: DType, n: usize, seed: u32) -> Array {
    let mut s = seed;
    let xs: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((s >> 8) as f32 / (1u32 << 24) as f32) * 8.0 - 4.0
        })
        .collect();
    Array::from_f32_in(dtype, &[n], xs)
}

#[test]
fn fp8_dots_match_an_f64_reference_on_interp_and_jit() {
    let (m, k, n) = (256, 384, 256);
    for (da, db) in [(E4, E4), (E5, E5), (E4, E5), (E4, DType::BF16), (E5, DType::F32)] {
        for transpose in [false, true] {
            let a = Array { shape: vec![m, k], ..values(da, m * k, 1) };
            let bshape = if transpose { vec![n, k] } else { vec![k, n] };
            let b = Array { shape: bshape.clone(), ..values(db, k * n, 2) };
            let (ta, tb, to) = (ty(da, &[m, k]), ty(db, &bshape), ty(DType::F32, &[m, n]));
            let kern = if transpose { fp8_dot_t(ta, tb, to) } else { fp8_dot(ta, tb, to) }.unwrap();
            let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
            for be in backends() {
                let out = run_on(be, &kern, &[&a, &b]);
                let got = out[0].as_f32().unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for l in 0..k {
                            let y = if transpose { bv[j * k + l] } else { bv[l * n + j] };
                            want += av[i * k + l] * y;
                            mag += (av[i * k + l] * y).abs();
                        }
                        // Each product is exact in f32; the f32 sum of k of them errs by at
                        // most about k * eps * the sum of magnitudes.
                        let tol = mag * k as f64 * f32::EPSILON as f64 + 1e-6;
                        let g = got[i * n + j] as f64;
                        assert!((g - want).abs() <= tol, "{be:?} {da} x {db} (transpose {transpose}) [{i},{j}]: {g} vs {want}");
                    }
                }
            }
        }
    }
}

#[tpu_kernel(grid = [1], x = block([32, 128], |i| [0, 0]), o = block([32, 128], |i| [0, 0]))]
fn fp8_add(x: In<32, 128>, o: Out<32, 128>) {
    o[..] = x[..] + x[..];
}

#[tpu_kernel(grid = [1], x = block([32, 128], |i| [0, 0]), o = block([32, 1], |i| [0, 0]))]
fn fp8_rowmax(x: In<32, 128>, o: Out<32, 1>) {
    o[..] = x[..].reduce_max(1).cast(f32);
}

#[tpu_kernel(grid = [1], x = block([32, 128], |i| [0, 0]), o = block([32, 128], |i| [0, 0]))]
fn fp8_big_literal(x: In<32, 128>, o: Out<32, 128>) {
    o[..] = select(x[..].cast(f32) > 0.0, x[..], full([32, 128], float8_e4m3fn, 500.0));
}

#[tpu_kernel(grid = [1], x = block([32, 128], |i| [0, 0]), o = block([32, 128], |i| [0, 0]))]
fn fp8_upcast_add(x: In<32, 128>, o: Out<32, 128>) {
    o[..] = (x[..].cast(f32) + 1.0).cast(o.dtype);
}

/// A weak literal next to an fp8 value takes its dtype (a scalar fp8 constant, broadcast).
#[tpu_kernel(grid = [1], x = block([32, 128], |i| [0, 0]), o = block([32, 128], |i| [0, 0]))]
fn fp8_relu_select(x: In<32, 128>, o: Out<32, 128>) {
    o[..] = select(x[..].cast(f32) > 0.0, x[..], 0.0);
}

#[test]
fn a_literal_beside_fp8_is_fp8_on_interp_and_jit() {
    let codes: Vec<u8> = (0..32 * 128).map(|i| (i % 256) as u8).collect();
    let x = Array::from_fp8_bits(E5, &[32, 128], &codes);
    let k = fp8_relu_select(ty(E5, &[32, 128]), ty(E5, &[32, 128])).unwrap();
    for be in backends() {
        let got = run_on(be, &k, &[&x])[0].fp8_bits().unwrap();
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(got[i], if fp8::e5m2_to_f32(c) > 0.0 { c } else { 0 }, "{be:?}: code {c:#04x}");
        }
    }
}

#[test]
fn what_libtpu_does_not_lower_is_an_error_on_every_generation() {
    for dtype in [E4, E5] {
        let t = ty(dtype, &[32, 128]);
        let k = fp8_add(t.clone(), t.clone()).unwrap();
        let k2 = fp8_rowmax(t.clone(), ty(DType::F32, &[32, 1])).unwrap();
        for target in Target::ALL {
            for (k, what) in [(&k, "add"), (&k2, "max")] {
                let e = verify::verify(k, &target).expect_err("fp8 arithmetic must be rejected");
                assert_eq!(e.rule, "fp8-op", "{what} on {target}: {e}");
                let text = e.to_string();
                assert!(text.contains(what) && text.contains(".cast(f32)") && text.contains(dtype.name()), "{text}");
            }
            // The way the message says works.
            let ok = fp8_upcast_add(t.clone(), t.clone()).unwrap();
            verify::verify(&ok, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
        }
        // No CPU backend runs what no generation accepts.
        let x = Array::from_fp8_bits(dtype, &[32, 128], &[0x38; 32 * 128]);
        for be in backends() {
            let e = exec::run(be.executor(), &k, &[&x]).expect_err("fp8 add must not run");
            assert_eq!(e.rule, "fp8-op", "{be:?}");
        }
    }
    let e: KernelError = fp8_big_literal(ty(E4, &[32, 128]), ty(E4, &[32, 128])).unwrap_err();
    assert_eq!(e.rule, "literal-range", "{e}");
    assert!(e.to_string().contains("448"), "{e}");
}

#[test]
fn fp8_dots_are_native_on_tpu7x_and_a_warning_elsewhere() {
    let k = fp8_dot(ty(E4, &[256, 256]), ty(E5, &[256, 256]), ty(DType::F32, &[256, 256])).unwrap();
    for target in Target::ALL {
        verify::verify(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
        let w = verify::warnings(&k, &target);
        let emulated = w.iter().any(|w| w.rule == "matmul-emulated");
        assert_eq!(emulated, target.name != "tpu7x", "{target}: {w:?}");
    }
}

#[test]
fn emitted_mosaic_and_stablehlo_name_the_fp8_types() {
    let t = ty(DType::F32, &[16, 128]);
    let k = to_fp8(t.clone(), t.with_dtype(E4), t.with_dtype(E5)).unwrap();
    let lowered = tessera_codegen::lower(&k, &Target::TPU7X).unwrap();
    for needle in ["vector<8x128xf8E4M3FN>", "vector<8x128xf8E5M2>", "arith.truncf"] {
        assert!(lowered.mosaic.contains(needle), "Mosaic lacks {needle}:\n{}", lowered.mosaic);
    }
    assert!(lowered.stablehlo.contains("tensor<16x128xf8E4M3FN>") && lowered.stablehlo.contains("tensor<16x128xf8E5M2>"), "{}", lowered.stablehlo);
    // Cost: an fp8 element is one byte.
    assert_eq!(lowered.cost.bytes_accessed, (16 * 128 * (4 + 1 + 1)) as u64);
}

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`): every kernel above that verifies compiles for
/// v5e, v6e and tpu7x.
#[test]
fn libtpu_compiles_the_fp8_kernels_for_v5e_v6e_tpu7x() {
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let mut kernels: Vec<Kernel> = Vec::new();
    for src in [DType::F32, DType::BF16] {
        let t = ty(src, &[64, 256]);
        kernels.push(to_fp8(t.clone(), t.with_dtype(E4), t.with_dtype(E5)).unwrap());
    }
    let ct = ty(E4, &[64, 256]);
    kernels.push(from_fp8(ct.clone(), ct.with_dtype(E5), ct.with_dtype(DType::F32), ct.with_dtype(DType::F32), ct.with_dtype(DType::BF16), ct.with_dtype(DType::BF16)).unwrap());
    let t = ty(E4, &[128, 128]);
    kernels.push(fp8_moves(t.clone(), t.with_dtype(E5), t.with_dtype(E5), t.clone(), t.with_dtype(DType::I32), t.clone(), t.clone(), t.clone()).unwrap());
    for (da, db) in [(E4, E4), (E5, E5), (E4, E5), (E4, DType::BF16)] {
        kernels.push(fp8_dot(ty(da, &[256, 256]), ty(db, &[256, 256]), ty(DType::F32, &[256, 256])).unwrap());
        kernels.push(fp8_dot_t(ty(da, &[256, 256]), ty(db, &[256, 256]), ty(DType::F32, &[256, 256])).unwrap());
    }
    kernels.push(fp8_upcast_add(ty(E5, &[32, 128]), ty(E5, &[32, 128])).unwrap());
    kernels.push(fp8_relu_select(ty(E4, &[32, 128]), ty(E4, &[32, 128])).unwrap());
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}
