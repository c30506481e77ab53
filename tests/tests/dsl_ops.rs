//! The ops added for kernel authors (issue 16 item 4), written with `#[tpu_kernel]`:
//! float math (`log1p expm1 sin cos floor ceil round sign`), integer shifts and bitwise
//! ops (`<< >> shr_logical & | ^ !`, int4 unpacking), `argmax` / `argmin`. Each runs on
//! the interpreter, the Cranelift JIT (and LLVM with the feature) and is checked against
//! a reference written here from std's f64 math and plain integer arithmetic; the
//! compiled backends must also match the interpreter bit for bit (their new ops are
//! exact: `cpu::cranelift::vector`'s table) and compile everything (no fallback).

use half::bf16;
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, DType, Kernel, KernelError};
use tessera_macros::tpu_kernel;
use tessera_tests::backends::{all as backends, run_all, ty};

#[tpu_kernel(grid = [r / 8], x = block([8, c], |i| [i, 0]),
             (o_log1p, o_expm1, o_sin, o_cos, o_floor, o_ceil, o_round, o_sign) = block([8, c], |i| [i, 0]))]
fn float_math(
    x: In<r, c>,
    o_log1p: Out<r, c>,
    o_expm1: Out<r, c>,
    o_sin: Out<r, c>,
    o_cos: Out<r, c>,
    o_floor: Out<r, c>,
    o_ceil: Out<r, c>,
    o_round: Out<r, c>,
    o_sign: Out<r, c>,
) {
    let v = x[..];
    o_log1p[..] = v.log1p();
    o_expm1[..] = v.expm1();
    o_sin[..] = v.sin();
    o_cos[..] = v.cos();
    o_floor[..] = v.floor();
    o_ceil[..] = v.ceil();
    o_round[..] = v.round();
    o_sign[..] = v.sign();
}

/// Round half to even, from `trunc` and the fraction (not `round_ties_even`).
fn round_even(x: f64) -> f64 {
    let t = x.trunc();
    let frac = (x - t).abs();
    if frac > 0.5 || (frac == 0.5 && t % 2.0 != 0.0) {
        t + x.signum()
    } else if x.is_nan() || x.is_infinite() {
        x
    } else {
        t.copysign(x)
    }
}

fn sign_ref(x: f64) -> f64 {
    if x.is_nan() {
        x
    } else if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// Edge values plus a sweep: zeros, tiny and huge magnitudes, halves (for rounding),
/// infinities, NaN, values near -1 (log1p) and large (sin, cos).
fn float_inputs(n: usize) -> Vec<f32> {
    let mut xs = vec![
        0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 1e-8, -1e-8, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, -0.49999997, 0.49999997, 8388607.5, -8388607.5, 1e7, -1.0,
        -0.9999999, -1.0000001, -2.0, 88.0, 89.0, -88.0, -104.0, 1e4, -1e4, 3.0e6, 1e30, -1e30, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1.0, std::f32::consts::PI, -std::f32::consts::PI,
    ];
    let mut s: u32 = 7;
    while xs.len() < n {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let u = (s >> 8) as f32 / (1u32 << 24) as f32;
        xs.push(match xs.len() % 3 {
            0 => u * 20.0 - 10.0,
            1 => (u * 200.0 - 100.0).round() / 2.0, // halves
            _ => f32::from_bits(s),
        });
    }
    xs.truncate(n);
    xs
}

#[test]
fn float_math_matches_std_on_every_backend() {
    type Reference = (&'static str, fn(f64) -> f64);
    let refs: [Reference; 8] = [
        ("log1p", f64::ln_1p),
        ("expm1", f64::exp_m1),
        ("sin", f64::sin),
        ("cos", f64::cos),
        ("floor", f64::floor),
        ("ceil", f64::ceil),
        ("round", round_even),
        ("sign", sign_ref),
    ];
    let (r, c) = (16, 256);
    let xs = float_inputs(r * c);
    for dtype in [DType::F32, DType::BF16] {
        let t = ty(dtype, &[r, c]);
        let k = float_math(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t).unwrap();
        let x = Array::from_f32_in(dtype, &[r, c], xs.clone());
        let outs = run_all(&k, &[&x]);
        let inputs: Vec<f32> = x.to_f64_vec().iter().map(|&v| v as f32).collect();
        for ((name, f), out) in refs.iter().zip(&outs) {
            let got = out.to_f64_vec();
            for (i, (&xi, &g)) in inputs.iter().zip(&got).enumerate() {
                let exact = f(xi as f64);
                // Correctly rounded to f32; bf16 is the f32 result rounded again (the
                // interpreter's bf16 arithmetic rounds each op's f32 result), so within
                // one bf16 ulp of the exact value's bf16.
                let want = exact as f32;
                let ok = match dtype {
                    DType::F32 => want.to_bits() == (g as f32).to_bits() || (want.is_nan() && g.is_nan()),
                    _ => {
                        let w = bf16::from_f64(exact);
                        let gb = bf16::from_f64(g);
                        w == gb || (w.is_nan() && gb.is_nan()) || (w.to_bits() as i32 - gb.to_bits() as i32).abs() == 1 && !w.is_infinite()
                    }
                };
                assert!(ok, "{name}({xi:e}) in {dtype}: got {g:e}, want {exact:e} (element {i})");
            }
        }
        // The special values torch / jnp give.
        let at = |out: &Array, x: f32| out.to_f64_vec()[inputs.iter().position(|&v| v.to_bits() == x.to_bits()).unwrap()];
        assert!(at(&outs[7], f32::NAN).is_nan(), "sign(NaN) is NaN");
        assert_eq!(at(&outs[7], -0.0).to_bits(), 0.0f64.to_bits(), "sign(-0) is +0");
        assert_eq!(at(&outs[6], 2.5), 2.0);
        assert_eq!(at(&outs[6], -0.5).to_bits(), (-0.0f64).to_bits(), "round(-0.5) is -0");
        assert!(at(&outs[0], -1.0).is_infinite() && at(&outs[0], -2.0).is_nan());
        assert_eq!(at(&outs[1], f32::NEG_INFINITY), -1.0);
    }
}

#[tpu_kernel(grid = [r / 32], (x, n) = block([32, c], |i| [i, 0]),
             (o_shl, o_shr, o_shrl, o_bits) = block([32, c], |i| [i, 0]))]
fn int_ops(x: In<r, c>, n: In<r, c>, o_shl: Out<r, c>, o_shr: Out<r, c>, o_shrl: Out<r, c>, o_bits: Out<r, c>) {
    let v = x[..];
    let s = n[..];
    o_shl[..] = v << s;
    o_shr[..] = v >> s;
    o_shrl[..] = v.shr_logical(s);
    let mut w = (v & s) | (!v ^ s);
    w <<= 1;
    o_bits[..] = w;
}

/// Four signed nibbles per i32 from packed bytes, as an int4 weight loader would.
#[tpu_kernel(grid = [r / 32], x = block([32, c], |i| [i, 0]), (lo, hi) = block([32, c], |i| [i, 0]))]
fn int4_unpack(x: In<r, c>, lo: Out<r, c>, hi: Out<r, c>) {
    let p = x[..];
    lo[..] = (p << 4) >> 4;
    hi[..] = p >> 4;
}

/// XLA's shifts of a `bits`-wide integer, from std's checked shifts.
fn shl_ref(x: i64, n: i64, bits: u32) -> i64 {
    if bits == 8 {
        u32::try_from(n).ok().and_then(|n| (x as i8).checked_shl(n)).map_or(0, |v| v as i64)
    } else {
        u32::try_from(n).ok().and_then(|n| (x as i32).checked_shl(n)).map_or(0, |v| v as i64)
    }
}
fn shr_ref(x: i64, n: i64, bits: u32) -> i64 {
    let fill = if x < 0 { -1 } else { 0 };
    if bits == 8 {
        u32::try_from(n).ok().and_then(|n| (x as i8).checked_shr(n)).map_or(fill, |v| v as i64)
    } else {
        u32::try_from(n).ok().and_then(|n| (x as i32).checked_shr(n)).map_or(fill, |v| v as i64)
    }
}
fn shrl_ref(x: i64, n: i64, bits: u32) -> i64 {
    if bits == 8 {
        u32::try_from(n).ok().and_then(|n| (x as u8).checked_shr(n)).map_or(0, |v| v as i8 as i64)
    } else {
        u32::try_from(n).ok().and_then(|n| (x as u32).checked_shr(n)).map_or(0, |v| v as i32 as i64)
    }
}

#[test]
fn shifts_and_bitwise_match_reference_on_every_backend() {
    let (r, c) = (32, 128);
    let len = r * c;
    let mut s: u32 = 99;
    let mut rnd = || {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        s
    };
    for dtype in [DType::I32, DType::I8] {
        let bits = dtype.bits() as u32;
        let xs: Vec<i64> = (0..len)
            .map(|i| match i % 5 {
                0 => [0, 1, -1, i64::from(i32::MIN), i64::from(i32::MAX), -128, 127, 0x55][i / 5 % 8],
                _ => rnd() as i32 as i64,
            })
            .map(|x| if bits == 8 { x as i8 as i64 } else { x as i32 as i64 })
            .collect();
        // Every amount from -2 to 40 (in and out of range for both widths), then extremes.
        let ns: Vec<i64> = (0..len).map(|i| if i % 11 == 10 { [i64::from(i32::MIN), i64::from(i32::MAX), 127, -128][i / 11 % 4] } else { (i % 43) as i64 - 2 }).collect();
        let ns: Vec<i64> = ns.into_iter().map(|n| if bits == 8 { n as i8 as i64 } else { n }).collect();
        let arr = |v: &[i64]| if bits == 8 { Array::from_i8(&[r, c], v.iter().map(|&x| x as i8).collect()) } else { Array::from_i32(&[r, c], v.iter().map(|&x| x as i32).collect()) };
        let t = ty(dtype, &[r, c]);
        let k = int_ops(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone()).unwrap();
        let outs = run_all(&k, &[&arr(&xs), &arr(&ns)]);
        let got: Vec<Vec<i64>> = outs.iter().map(|o| o.to_f64_vec().iter().map(|&v| v as i64).collect()).collect();
        let wrap = |v: i64| if bits == 8 { v as i8 as i64 } else { v as i32 as i64 };
        for i in 0..len {
            let (x, n) = (xs[i], ns[i]);
            assert_eq!(got[0][i], shl_ref(x, n, bits), "{dtype}: {x} << {n}");
            assert_eq!(got[1][i], shr_ref(x, n, bits), "{dtype}: {x} >> {n}");
            assert_eq!(got[2][i], shrl_ref(x, n, bits), "{dtype}: {x}.shr_logical({n})");
            let w = wrap((x & n) | (!x ^ n));
            assert_eq!(got[3][i], shl_ref(w, 1, bits), "{dtype}: ((x & n) | (!x ^ n)) << 1 at x = {x}, n = {n}");
        }
        // Nibbles of every byte value.
        let bytes: Vec<i64> = (0..len).map(|i| wrap((i % 256) as i64 - 128)).collect();
        let k = int4_unpack(t.clone(), t.clone(), t.clone()).unwrap();
        let outs = run_all(&k, &[&arr(&bytes)]);
        let (lo, hi) = (outs[0].to_f64_vec(), outs[1].to_f64_vec());
        for i in 0..len {
            let b = bytes[i];
            if bits == 8 {
                let u = b as u8;
                let nib = |v: u8| if v >= 8 { v as i64 - 16 } else { v as i64 };
                assert_eq!(lo[i] as i64, nib(u & 15), "low nibble of {b}");
                assert_eq!(hi[i] as i64, nib(u >> 4), "high nibble of {b}");
            }
        }
    }
}

#[tpu_kernel(grid = [1], x = block([r, c], |i| [0, 0]), (amax, amin) = block([1, c], |i| [0, 0]), (rmax, rmin) = block([r, 1], |i| [0, 0]))]
fn arg_reduce(x: In<r, c>, amax: Out<1, c>, amin: Out<1, c>, rmax: Out<r, 1>, rmin: Out<r, 1>) {
    let v = x[..];
    amax[..] = v.argmax(0);
    amin[..] = v.argmin(0);
    rmax[..] = v.argmax(1);
    rmin[..] = v.argmin(1);
}

/// torch's argmax / argmin along `axis` of a row-major [r, c]: the first index of the
/// extreme, where any NaN is the extreme.
fn arg_ref(x: &[f64], r: usize, c: usize, axis: usize, max: bool) -> Vec<i64> {
    let (outer, len) = if axis == 0 { (c, r) } else { (r, c) };
    (0..outer)
        .map(|o| {
            let at = |j: usize| if axis == 0 { x[j * c + o] } else { x[o * c + j] };
            let mut best = 0;
            for j in 1..len {
                let (b, v) = (at(best), at(j));
                if b.is_nan() {
                    break;
                }
                if v.is_nan() || (max && v > b) || (!max && v < b) {
                    best = j;
                }
            }
            best as i64
        })
        .collect()
}

#[test]
fn argmax_argmin_match_torch_rules_on_every_backend() {
    let (r, c) = (8, 128);
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        // Few distinct values, so ties are common; NaNs in some rows and columns.
        let mut s: u32 = 5;
        let xs: Vec<f64> = (0..r * c)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = ((s >> 20) % 7) as f64 - 3.0;
                if dtype.is_float() && (i % 37 == 5 || i % 128 == 77) {
                    f64::NAN
                } else if dtype.is_float() && i % 41 == 0 {
                    -0.0
                } else {
                    v
                }
            })
            .collect();
        let x = match dtype {
            DType::I32 => Array::from_i32(&[r, c], xs.iter().map(|&v| v as i32).collect()),
            d => Array::from_f32_in(d, &[r, c], xs.iter().map(|&v| v as f32).collect()),
        };
        let k = arg_reduce(ty(dtype, &[r, c]), ty(DType::I32, &[1, c]), ty(DType::I32, &[1, c]), ty(DType::I32, &[r, 1]), ty(DType::I32, &[r, 1])).unwrap();
        let outs = run_all(&k, &[&x]);
        let got: Vec<Vec<i64>> = outs.iter().map(|o| o.to_f64_vec().iter().map(|&v| v as i64).collect()).collect();
        assert_eq!(got[0], arg_ref(&xs, r, c, 0, true), "{dtype} argmax(0)");
        assert_eq!(got[1], arg_ref(&xs, r, c, 0, false), "{dtype} argmin(0)");
        assert_eq!(got[2], arg_ref(&xs, r, c, 1, true), "{dtype} argmax(1)");
        assert_eq!(got[3], arg_ref(&xs, r, c, 1, false), "{dtype} argmin(1)");
    }
}

/// `bitcast` both ways, and an E8M0 scale byte decoded by building the f32's exponent field
/// (as `quant4`'s MXFP4 kernel does).
#[tpu_kernel(grid = [r / 8], (f, i) = block([8, c], |b| [b, 0]), (as_int, as_float, pow2) = block([8, c], |b| [b, 0]))]
fn bit_views(f: In<r, c>, i: In<r, c>, as_int: Out<r, c>, as_float: Out<r, c>, pow2: Out<r, c>) {
    as_int[..] = f[..].bitcast(i32);
    as_float[..] = i[..].bitcast(f32);
    pow2[..] = ((i[..] & 255) << 23).bitcast(f32);
}

#[test]
fn bitcast_reads_the_same_bits_on_every_backend() {
    let (r, c) = (16, 128);
    let specials = [0.0f32, -0.0, 1.0, -1.5, f32::MIN_POSITIVE, 1e-45, -1e-45, f32::MAX, f32::INFINITY, f32::NEG_INFINITY, 3.0e-39, 0.1];
    let fs: Vec<f32> = (0..r * c).map(|e| if e < specials.len() { specials[e] } else { (e as f32 * 0.37).sin() * 2f32.powi((e % 60) as i32 - 30) }).collect();
    let is: Vec<i32> = (0..(r * c) as i32).map(|e| e.wrapping_mul(0x9E37_79B9u32 as i32) ^ (e << 7)).collect();
    let k = bit_views(ty(DType::F32, &[r, c]), ty(DType::I32, &[r, c]), ty(DType::I32, &[r, c]), ty(DType::F32, &[r, c]), ty(DType::F32, &[r, c])).unwrap();
    let out = run_all(&k, &[&Array::from_f32(&[r, c], fs.clone()), &Array::from_i32(&[r, c], is.clone())]);
    let (ints, floats, pows) = (out[0].to_f64_vec(), out[1].to_f64_vec(), out[2].to_f64_vec());
    for e in 0..r * c {
        assert_eq!(ints[e] as i64, fs[e].to_bits() as i32 as i64, "bits of {}", fs[e]);
        let want = f32::from_bits(is[e] as u32);
        assert!(floats[e] as f32 == want || (want.is_nan() && floats[e].is_nan()), "f32 of bits {:#x}: {} vs {want}", is[e], floats[e]);
        let byte = is[e] & 255;
        let want = if byte == 255 { f32::INFINITY } else if byte == 0 { 0.0 } else { 2f32.powi(byte - 127) };
        assert_eq!(pows[e] as f32, want, "2^({byte} - 127)");
    }
    // Only the equal-width unpacked pair is a bitcast.
    let mut b = tessera_dsl::KernelBuilder::new("bad_bitcast");
    let x = b.zeros(&[8, 128], DType::BF16);
    b.bitcast(x, DType::I32);
    let e = b.finish().expect_err("bf16 bits are not i32 bits");
    assert_eq!(e.rule, "bitcast-dtype", "{e}");
}


#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 128], || [0, 0]))]
fn shift_float(x: In<8, 128>, out: Out<8, 128>) {
    out[..] = x[..] << 2;
}

#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 1], || [0, 0]))]
fn argmax_bad_axis(x: In<8, 128>, out: Out<8, 1>) {
    out[..] = x[..].argmax(2);
}

#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 128], || [0, 0]))]
fn round_int(x: In<8, 128>, out: Out<8, 128>) {
    out[..] = x[..].round();
}

fn expect_err(r: Result<Kernel, KernelError>, rule: &str, words: &[&str]) {
    let e = r.expect_err("the builder must refuse this kernel");
    assert_eq!(e.rule, rule, "{e}");
    assert!(e.loc.as_ref().is_some_and(|l| l.file.ends_with("dsl_ops.rs") && l.line > 0), "no source line: {e}");
    let text = e.to_string();
    for w in words {
        assert!(text.contains(w), "`{w}` missing from: {text}");
    }
}

#[test]
fn misuse_is_a_builder_error_with_the_line() {
    let f = ty(DType::F32, &[8, 128]);
    expect_err(shift_float(f.clone(), f.clone()), "op-dtype", &["shift", "f32", "i32"]);
    expect_err(argmax_bad_axis(f.clone(), ty(DType::I32, &[8, 1])), "reduce-axis", &["axis 2", "below 2"]);
    let i = ty(DType::I32, &[8, 128]);
    expect_err(round_int(i.clone(), i), "op-dtype", &["round", "cast to f32"]);
}

/// `concat` (Mosaic `tpu.concatenate`): two different parts along the lanes and along the
/// sublanes, and a column tiled (`[x; n]`, `jnp.tile`) as flash attention widens its
/// lane-replicated state.
#[tpu_kernel(grid = [1], (a, b) = block([8, 128], |i| [0, 0]), (lanes, rows) = block([8, 256], |i| [0, 0]), rows_out = block([16, 128], |i| [0, 0]))]
fn concat_parts(a: In<8, 128>, b: In<8, 128>, lanes: Out<8, 256>, rows: Out<8, 256>, rows_out: Out<16, 128>) {
    let x = a[..];
    let y = b[..];
    lanes[..] = concat([x, y], 1);
    rows[..] = concat([x.reduce_max(1).broadcast_to([8, 128]); 2], 1);
    rows_out[..] = concat([y, x], 0);
}

#[test]
fn concat_joins_parts_on_every_backend() {
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        let av: Vec<f32> = (0..8 * 128).map(|i| (i % 97) as f32 - 40.0).collect();
        let bv: Vec<f32> = (0..8 * 128).map(|i| (i % 13) as f32 * 3.0).collect();
        let array = |v: &[f32]| if dtype == DType::I32 { Array::from_i32(&[8, 128], v.iter().map(|&x| x as i32).collect()) } else { Array::from_f32_in(dtype, &[8, 128], v.to_vec()) };
        let (a, b) = (array(&av), array(&bv));
        let k = concat_parts(ty(dtype, &[8, 128]), ty(dtype, &[8, 128]), ty(dtype, &[8, 256]), ty(dtype, &[8, 256]), ty(dtype, &[16, 128])).unwrap();
        let out = run_all(&k, &[&a, &b]);
        let f32s = |a: &Array| a.to_f64_vec().into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let (lanes, rows, stacked) = (f32s(&out[0]), f32s(&out[1]), f32s(&out[2]));
        for r in 0..8 {
            let row_max = av[r * 128..(r + 1) * 128].iter().cloned().fold(f32::MIN, f32::max);
            for c in 0..256 {
                let want = if c < 128 { av[r * 128 + c] } else { bv[r * 128 + c - 128] };
                assert_eq!(lanes[r * 256 + c], want, "{dtype} lanes [{r}, {c}]");
                assert_eq!(rows[r * 256 + c], row_max, "{dtype} tiled [{r}, {c}]");
            }
        }
        assert_eq!(&stacked[..8 * 128], &bv[..], "{dtype}: the first part's rows first");
        assert_eq!(&stacked[8 * 128..], &av[..], "{dtype}");
    }
    // Parts that do not join name the rule.
    let mut b = tessera_dsl::KernelBuilder::new("bad_concat");
    let x = b.zeros(&[8, 128], DType::F32);
    let y = b.zeros(&[16, 128], DType::F32);
    b.concat(&[x, y], 1);
    let e = b.finish().expect_err("parts of different rows along the lanes");
    assert_eq!(e.rule, "concat-parts", "{e}");
}

/// `item()`: a block reduced to one element decides a branch (as flash attention asks
/// whether a v block holds a nonfinite value), in i32 and in f32.
#[tpu_kernel(grid = [r / 8], x = block([8, c], |i| [i, 0]), (out, total) = block([8, c], |i| [i, 0]))]
fn item_branch(x: In<r, c>, out: Out<r, c>, total: Out<r, c>) {
    let v = x[..];
    let nans = select(v != v, 1, 0).sum(1).sum(0).item();
    let sum = v.sum(1).sum(0).item();
    total[..] = full([8, c], f32, 0.0) + sum;
    if nans > 0 {
        out[..] = full([8, c], f32, -1.0);
    } else {
        out[..] = v * 2.0;
    }
}

#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 128], || [0, 0]))]
fn item_of_a_block(x: In<8, 128>, out: Out<8, 128>) {
    let s = x[..].item();
    out[..] = full([8, 128], f32, 0.0) + s;
}

#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 128], || [0, 0]))]
fn item_of_bools(x: In<8, 128>, out: Out<8, 128>) {
    let any = (x[..] > 0.0).reduce_max(1).reduce_max(0).item();
    if any {
        out[..] = x[..];
    }
}

/// Bool reductions are any (`reduce_max`) and all (`reduce_min`), also down to a scalar, and
/// a scalar `pow` of one (Mosaic lowers neither directly; found by a user-side probe).
#[tpu_kernel(grid = [r / 8], x = block([8, c], |i| [i, 0]), (any_row, all_row) = block([8, 1], |i| [i, 0]), powed = block([8, c], |i| [i, 0]))]
fn bool_reductions(x: In<r, c>, any_row: Out<r, 1>, all_row: Out<r, 1>, powed: Out<r, c>) {
    let pos = x[..] > 0.0;
    any_row[..] = select(pos.reduce_max(1), 1, 0);
    all_row[..] = select(pos.reduce_min(1), 1, 0);
    let n = select(pos, 1, 0).sum(0).sum(1).item();
    let half = n.cast(f32).pow(0.5);
    if pos.reduce_max(1).reduce_max(0).cast(i32).item() > 0 {
        powed[..] = full([8, c], f32, 0.0) + half;
    } else {
        powed[..] = full([8, c], f32, -1.0);
    }
}

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 1], |i| [0, 0]))]
fn bool_sum(x: In<8, 128>, out: Out<8, 1>) {
    out[..] = (x[..] > 0.0).sum(1).cast(i32);
}

#[test]
fn bools_reduce_as_any_and_all_on_every_backend() {
    let (r, c) = (24, 128);
    // Rows 0..8: mixed; 8..16: all positive; 16..24: none positive.
    let xs: Vec<f32> = (0..r * c).map(|e| match e / (8 * c) { 0 => if e % 3 == 0 { 1.0 } else { -1.0 }, 1 => 2.0, _ => -0.0 }).collect();
    let k = bool_reductions(ty(DType::F32, &[r, c]), ty(DType::I32, &[r, 1]), ty(DType::I32, &[r, 1]), ty(DType::F32, &[r, c])).unwrap();
    let out = run_all(&k, &[&Array::from_f32(&[r, c], xs.clone())]);
    let (any, all, powed) = (out[0].to_f64_vec(), out[1].to_f64_vec(), out[2].to_f64_vec());
    for row in 0..r {
        let vals = &xs[row * c..(row + 1) * c];
        assert_eq!(any[row], f64::from(u8::from(vals.iter().any(|&v| v > 0.0))), "any of row {row}");
        assert_eq!(all[row], f64::from(u8::from(vals.iter().all(|&v| v > 0.0))), "all of row {row}");
    }
    for blk in 0..r / 8 {
        let n = xs[blk * 8 * c..(blk + 1) * 8 * c].iter().filter(|&&v| v > 0.0).count();
        let want = if n > 0 { (n as f32).powf(0.5) as f64 } else { -1.0 };
        assert!((powed[blk * 8 * c] - want).abs() <= 1e-6 * want.abs(), "block {blk}: {} vs {want}", powed[blk * 8 * c]);
    }
    let e = tessera_dsl::verify::verify(&bool_sum(ty(DType::F32, &[8, 128]), ty(DType::I32, &[8, 1])).unwrap(), &tessera_dsl::Target::V5E).unwrap_err();
    assert_eq!(e.rule, "reduce-dtype", "{e}");
    assert!(e.to_string().contains("cast(i32)"), "{e}");
}

#[test]
fn item_moves_a_reduced_block_to_a_scalar_on_every_backend() {
    let (r, c) = (32, 128);
    // Block 1 holds a NaN, block 3 an inf (not a NaN: no branch), the rest are finite.
    let mut xs: Vec<f32> = (0..r * c).map(|e| ((e * 37) % 101) as f32 / 64.0 - 0.75).collect();
    xs[8 * c + 5] = f32::NAN;
    xs[24 * c + 17] = f32::INFINITY;
    let k = item_branch(ty(DType::F32, &[r, c]), ty(DType::F32, &[r, c]), ty(DType::F32, &[r, c])).unwrap();
    let out = run_all(&k, &[&Array::from_f32(&[r, c], xs.clone())]);
    let (got, totals) = (out[0].to_f64_vec(), out[1].to_f64_vec());
    for blk in 0..r / 8 {
        let block = &xs[blk * 8 * c..(blk + 1) * 8 * c];
        let has_nan = block.iter().any(|x| x.is_nan());
        let sum: f64 = block.iter().map(|&x| x as f64).sum();
        for e in blk * 8 * c..(blk + 1) * 8 * c {
            let want = if has_nan { -1.0 } else { xs[e] as f64 * 2.0 };
            assert_eq!(got[e], want, "block {blk} element {e}");
            if has_nan {
                assert!(totals[e].is_nan(), "block {blk}: a sum with a NaN is NaN");
            } else if sum.is_infinite() {
                assert_eq!(totals[e], sum, "block {blk}");
            } else {
                assert!((totals[e] - sum).abs() <= 1e-3 * (1.0 + sum.abs()), "block {blk}: sum {} vs {sum}", totals[e]);
            }
        }
    }
    let f = ty(DType::F32, &[8, 128]);
    expect_err(item_of_a_block(f.clone(), f.clone()), "item-operand", &["item", "f32[8,128]", "one f32 or i32 element", "reduce the value to one element first"]);
    expect_err(item_of_bools(f.clone(), f), "item-operand", &["item", "bool", "cast to f32 or i32 before reducing"]);
}

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`): the kernels above, in every dtype they were
/// run in, verify and compile for v5e, v6e and tpu7x.
#[test]
fn libtpu_compiles_the_new_ops_for_v5e_v6e_tpu7x() {
    use tessera_dsl::Target;
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let mut kernels: Vec<Kernel> = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let t = ty(dtype, &[16, 256]);
        kernels.push(float_math(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t).unwrap());
    }
    for dtype in [DType::I32, DType::I8] {
        let t = ty(dtype, &[64, 256]);
        kernels.push(int_ops(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone()).unwrap());
        kernels.push(int4_unpack(t.clone(), t.clone(), t).unwrap());
    }
    kernels.push(bit_views(ty(DType::F32, &[16, 128]), ty(DType::I32, &[16, 128]), ty(DType::I32, &[16, 128]), ty(DType::F32, &[16, 128]), ty(DType::F32, &[16, 128])).unwrap());
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        kernels.push(concat_parts(ty(dtype, &[8, 128]), ty(dtype, &[8, 128]), ty(dtype, &[8, 256]), ty(dtype, &[8, 256]), ty(dtype, &[16, 128])).unwrap());
    }
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        let (r, c) = (16, 256);
        kernels.push(arg_reduce(ty(dtype, &[r, c]), ty(DType::I32, &[1, c]), ty(DType::I32, &[1, c]), ty(DType::I32, &[r, 1]), ty(DType::I32, &[r, 1])).unwrap());
    }
    kernels.push(bool_reductions(ty(DType::F32, &[24, 128]), ty(DType::I32, &[24, 1]), ty(DType::I32, &[24, 1]), ty(DType::F32, &[24, 128])).unwrap());
    kernels.push(item_branch(ty(DType::F32, &[32, 256]), ty(DType::F32, &[32, 256]), ty(DType::F32, &[32, 256])).unwrap());
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}

/// IR edited after `finish()` so that a shift takes floats (and a rounding op an integer):
/// the verifier calls it `malformed-ir`, and no backend panics or runs it.
#[test]
fn hand_edited_ir_with_ill_typed_new_ops_is_refused() {
    let t = ty(DType::I32, &[32, 128]);
    let mut k = int_ops(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t).unwrap();
    for v in &mut k.values {
        if v.ty.dtype == DType::I32 && v.ty.rank() == 2 {
            v.ty.dtype = DType::F32;
        }
    }
    for r in &mut k.refs {
        r.dtype = DType::F32;
    }
    let e = tessera_dsl::verify::verify(&k, &tessera_dsl::Target::V5E).unwrap_err();
    assert_eq!(e.rule, "malformed-ir", "{e}");
    assert!(e.to_string().contains("shifts take integers"), "{e}");
    let x = Array::from_f32(&[32, 128], vec![1.0; 32 * 128]);
    for be in backends() {
        let r = exec::run(be.executor(), &k, &[&x, &x]);
        assert!(r.is_err(), "{be:?} ran an ill-typed shift");
    }
    assert!(tessera_codegen::lower(&k, &tessera_dsl::Target::V5E).is_err());
}
