//! 128-bit SIMD building blocks in Cranelift IR: constants, bf16 rounding, i8 wrapping,
//! memory conversions, and the vectorised f32 transcendentals.
//!
//! # Error bounds of the transcendentals (measured by `tests/tests/conformance.rs`'s
//! `transcendental_ulp_bounds` against the interpreter's correctly rounded results, over
//! every float of a dense sweep plus edge values: 0, -0, denormals, ±inf, NaN, huge)
//!
//! | op | bound | method |
//! |---|---|---|
//! | exp | 2 ulp | Cephes: `n` = `x log2 e` rounded to nearest (a magic add), two-constant `ln 2`, degree-5 polynomial, scaled by `2^n` in two steps (so denormal results round once) |
//! | log | 2 ulp | Cephes: mantissa in `[sqrt(1/2), sqrt(2))`, degree-8 polynomial, denormals scaled by `2^23` first |
//! | tanh | 3 ulp | Cephes polynomial below 0.625, `1 - 2 / (exp(2|x|) + 1)` above |
//! | erf | 3 ulp | Cephes polynomial `x P(x^2)` below 1; `1 - exp(-x^2) Q(1/x) / x` above (degree-8 `Q` fitted to `x erfc(x) e^{x^2}` on `[1, 4]`), 1 from 4 |
//! | sqrt | exact | the hardware's correctly rounded `sqrt` |
//! | rsqrt | exact | per lane in f64, as the interpreter |
//! | pow | exact | per lane through the host's f64 `pow`, as the interpreter (not vectorised) |
//! | log1p, expm1, sin, cos | exact | per lane through the host's f64 `ln_1p`, `exp_m1`, `sin`, `cos`, rounded once, as the interpreter (not vectorised: a call per lane) |
//! | floor, ceil, round | exact | the hardware's `roundps` (`floor`, `ceil`, `nearest`: ties to even) |
//! | sign | exact | compares and selects (both zeros give +0, NaN stays NaN) |
//!
//! The polynomials (Horner) and exp's reduction use fused multiply-adds where the host has
//! them ([`native_fma`]): fewer instructions and one rounding a step.
//!
//! Special values follow the interpreter: NaN in, NaN out; `exp(-inf) = 0`, `exp(inf) = inf`,
//! `log(0) = -inf`, `log(x < 0) = NaN`, `tanh(±inf) = ±1`, signed zeros kept.

// The polynomial coefficients are written as published (Cephes) or as fitted; `1.1283792`
// is a Cephes coefficient that happens to be close to 2/sqrt(pi).
#![allow(clippy::excessive_precision, clippy::approx_constant)]

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, F64, I32, I32X4, I64X2, I8X16};
use cranelift_codegen::ir::{Endianness, FuncRef, InstBuilder, MemFlagsData, Value};
use cranelift_frontend::FunctionBuilder;

pub fn vflags() -> MemFlagsData {
    MemFlagsData::new().with_endianness(Endianness::Little)
}

pub fn mflags() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}

pub fn fsplat(b: &mut FunctionBuilder, c: f32) -> Value {
    let s = b.ins().f32const(c);
    b.ins().splat(F32X4, s)
}

pub fn isplat(b: &mut FunctionBuilder, c: i32) -> Value {
    let s = b.ins().iconst(I32, c as i64);
    b.ins().splat(I32X4, s)
}

pub fn as_i(b: &mut FunctionBuilder, v: Value) -> Value {
    if b.func.dfg.value_type(v) == I32X4 { v } else { b.ins().bitcast(I32X4, vflags(), v) }
}

pub fn as_f(b: &mut FunctionBuilder, v: Value) -> Value {
    if b.func.dfg.value_type(v) == F32X4 { v } else { b.ins().bitcast(F32X4, vflags(), v) }
}

/// `select(mask, t, f)` lane-wise on vectors of one type.
pub fn vselect(b: &mut FunctionBuilder, mask: Value, t: Value, f: Value) -> Value {
    let ty = b.func.dfg.value_type(t);
    let m = if ty == F32X4 { as_f(b, mask) } else { mask };
    b.ins().bitselect(m, t, f)
}

/// Rounds f32 lanes to bf16 (nearest-even; NaN stays a quiet NaN), as `half::bf16::from_f32`.
pub fn round_bf16(b: &mut FunctionBuilder, v: Value) -> Value {
    let bits = as_i(b, v);
    let lsb = b.ins().ushr_imm_s(bits, 16);
    let one = isplat(b, 1);
    let lsb = b.ins().band(lsb, one);
    let bias = isplat(b, 0x7fff);
    let r = b.ins().iadd(bits, bias);
    let r = b.ins().iadd(r, lsb);
    let hi = isplat(b, 0xffff_0000u32 as i32);
    let r = b.ins().band(r, hi);
    let quiet = isplat(b, 0x0040_0000);
    let q = b.ins().bor(bits, quiet);
    let q = b.ins().band(q, hi);
    let nan = b.ins().fcmp(FloatCC::Unordered, v, v);
    let out = b.ins().bitselect(nan, q, r);
    as_f(b, out)
}

/// Wraps i32 lanes to the i8 range.
pub fn wrap_i8(b: &mut FunctionBuilder, v: Value) -> Value {
    let s = b.ins().ishl_imm_s(v, 24);
    b.ins().sshr_imm_s(s, 24)
}

/// Scalar i32 wrapped to the i8 range.
pub fn wrap_i8_scalar(b: &mut FunctionBuilder, v: Value) -> Value {
    let s = b.ins().ishl_imm_s(v, 24);
    b.ins().sshr_imm_s(s, 24)
}

/// 4 x i8 (or bool bytes) at `addr` widened to i32 lanes (signed for i8, unsigned for bools).
pub fn load_bytes4(b: &mut FunctionBuilder, addr: Value, signed: bool) -> Value {
    let w = b.ins().load(I32, mflags(), addr, 0);
    let v = b.ins().scalar_to_vector(I32X4, w);
    let v = b.ins().bitcast(I8X16, vflags(), v);
    let (h, s) = if signed {
        let h = b.ins().swiden_low(v);
        (h, b.ins().swiden_low(h))
    } else {
        let h = b.ins().uwiden_low(v);
        (h, b.ins().uwiden_low(h))
    };
    let _ = h;
    s
}

/// Stores the low byte of each i32 lane (values already in the byte's range) at `addr`.
pub fn store_bytes4(b: &mut FunctionBuilder, v: Value, addr: Value) {
    let n16 = b.ins().snarrow(v, v);
    let n8 = b.ins().snarrow(n16, n16);
    let w = b.ins().bitcast(I32X4, vflags(), n8);
    let x = b.ins().extractlane(w, 0);
    b.ins().store(mflags(), x, addr, 0);
}

/// 4 bf16 at `addr` as f32 lanes.
pub fn load_bf16x4(b: &mut FunctionBuilder, addr: Value) -> Value {
    let v = b.ins().uload16x4(mflags(), addr, 0);
    let v = b.ins().ishl_imm_s(v, 16);
    as_f(b, v)
}

/// Stores f32 lanes holding bf16 values as 4 bf16 at `addr`.
pub fn store_bf16x4(b: &mut FunctionBuilder, v: Value, addr: Value) {
    let bits = as_i(b, v);
    let hi = b.ins().ushr_imm_s(bits, 16);
    let n = b.ins().unarrow(hi, hi);
    let w = b.ins().bitcast(I64X2, vflags(), n);
    let x = b.ins().extractlane(w, 0);
    b.ins().store(mflags(), x, addr, 0);
}

/// `c > x ? c : x` lane-wise: IEEE `maximum(x, c)` for a `c` that is neither ±0 nor NaN
/// (a NaN `x` is kept). The pattern the x64 backend lowers to one `maxps c, x`.
pub fn max_over_const(b: &mut FunctionBuilder, c: Value, x: Value) -> Value {
    let gt = b.ins().fcmp(FloatCC::LessThan, x, c);
    vselect(b, gt, c, x)
}

/// `c < x ? c : x` lane-wise: IEEE `minimum(x, c)` for a `c` that is neither ±0 nor NaN
/// (a NaN `x` is kept): one `minps c, x` on x64.
pub fn min_under_const(b: &mut FunctionBuilder, c: Value, x: Value) -> Value {
    let lt = b.ins().fcmp(FloatCC::LessThan, c, x);
    vselect(b, lt, c, x)
}

/// Whether the host fuses multiply-adds in hardware (x86-64 with FMA3; every aarch64).
/// Where it does not, Cranelift would call `fmaf` per lane, so the polynomials multiply
/// and add instead (both within the bounds above).
pub fn native_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(target_arch = "aarch64")]
    {
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// `a * x + c`: one rounding with a native FMA, else two.
fn mul_add(b: &mut FunctionBuilder, a: Value, x: Value, c: Value) -> Value {
    if native_fma() {
        b.ins().fma(a, x, c)
    } else {
        let m = b.ins().fmul(a, x);
        b.ins().fadd(m, c)
    }
}

fn poly(b: &mut FunctionBuilder, x: Value, coeffs: &[f32]) -> Value {
    // Horner, highest degree first.
    let mut acc = fsplat(b, coeffs[0]);
    for &c in &coeffs[1..] {
        let cv = fsplat(b, c);
        acc = mul_add(b, acc, x, cv);
    }
    acc
}

fn copysign(b: &mut FunctionBuilder, mag: Value, sign_of: Value) -> Value {
    let m = as_i(b, mag);
    let s = as_i(b, sign_of);
    let abs_mask = isplat(b, 0x7fff_ffff);
    let m = b.ins().band(m, abs_mask);
    let sign_mask = isplat(b, i32::MIN);
    let s = b.ins().band(s, sign_mask);
    let r = b.ins().bor(m, s);
    as_f(b, r)
}

pub fn exp(b: &mut FunctionBuilder, x: Value) -> Value {
    // A NaN passes both clamps (and makes the polynomial NaN).
    let lo = fsplat(b, -104.0);
    let hi = fsplat(b, 89.0);
    let xc = max_over_const(b, lo, x);
    let xc = min_under_const(b, hi, xc);
    // n = x log2 e rounded to nearest by the magic add: `t = x log2 e + 1.5 * 2^23` holds
    // the integer in its low mantissa bits (|x log2 e| < 2^22), so `t - 1.5 * 2^23` is
    // `n` as a float, exactly, and the difference of the bits is `n` as an integer.
    let log2e = fsplat(b, std::f32::consts::LOG2_E);
    let magic = fsplat(b, 12_582_912.0);
    let t = mul_add(b, xc, log2e, magic);
    let fx = b.ins().fsub(t, magic);
    // r = x - fx ln 2 in two steps (`fx * c1` is exact: c1 has 10 significant bits).
    let c1 = fsplat(b, -0.693_359_4);
    let c2 = fsplat(b, 2.121_944_4e-4);
    let r = mul_add(b, fx, c1, xc);
    let r = mul_add(b, fx, c2, r);
    let z = b.ins().fmul(r, r);
    let p = poly(b, r, &[1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1]);
    let p = mul_add(b, p, z, r);
    let one = fsplat(b, 1.0);
    let p = b.ins().fadd(p, one);
    // `n` is an integer in [-150, 128] (garbage for a NaN `x`, whose NaN `p` wins below).
    // 2^n as 2^n1 * 2^n2 with n1 = floor(n / 2), n2 = n - n1 (each factor normal, so a
    // denormal result is rounded once, by the last product). With m = n + 2 * 127 (the
    // bits of `t` minus the magic's, bias folded in), m >> 1 = n1 + 127 and
    // m - (m >> 1) = n2 + 127: the factors' biased exponents.
    let magic_bits = isplat(b, 0x4b40_0000 - 2 * 127);
    let t = as_i(b, t);
    let m = b.ins().isub(t, magic_bits);
    let m1 = b.ins().sshr_imm_s(m, 1);
    let m2 = b.ins().isub(m, m1);
    let e1 = b.ins().ishl_imm_s(m1, 23);
    let e2 = b.ins().ishl_imm_s(m2, 23);
    let s1 = as_f(b, e1);
    let s2 = as_f(b, e2);
    // NaN in, NaN out: the clamps keep a NaN, so `p` is NaN and so is the product.
    let y = b.ins().fmul(p, s1);
    b.ins().fmul(y, s2)
}

pub fn log(b: &mut FunctionBuilder, x: Value) -> Value {
    let min_normal = fsplat(b, f32::MIN_POSITIVE);
    let den = b.ins().fcmp(FloatCC::LessThan, x, min_normal);
    let scale = fsplat(b, 8_388_608.0);
    let xs = b.ins().fmul(x, scale);
    let xs = vselect(b, den, xs, x);
    let m23 = isplat(b, -23);
    let zero_i = isplat(b, 0);
    let eadj = b.ins().bitselect(den, m23, zero_i);
    let bits = as_i(b, xs);
    let e = b.ins().ushr_imm_s(bits, 23);
    let ff = isplat(b, 0xff);
    let e = b.ins().band(e, ff);
    let c126 = isplat(b, 126);
    let e = b.ins().isub(e, c126);
    let e = b.ins().iadd(e, eadj);
    let mm = isplat(b, 0x807f_ffffu32 as i32);
    let m = b.ins().band(bits, mm);
    let half_bits = isplat(b, 0x3f00_0000);
    let m = b.ins().bor(m, half_bits);
    let m = as_f(b, m);
    let sqrthf = fsplat(b, std::f32::consts::FRAC_1_SQRT_2);
    let small = b.ins().fcmp(FloatCC::LessThan, m, sqrthf);
    let e = b.ins().iadd(e, small); // mask is -1 where small
    let m2 = b.ins().fadd(m, m);
    let m = vselect(b, small, m2, m);
    let one = fsplat(b, 1.0);
    let m = b.ins().fsub(m, one);
    let z = b.ins().fmul(m, m);
    let p = poly(b, m, &[7.037_683_6e-2, -1.151_461e-1, 1.167_699_9e-1, -1.242_014_1e-1, 1.424_932_3e-1, -1.666_805_8e-1, 2.000_071_4e-1, -2.499_999_4e-1, 3.333_333_1e-1]);
    let y = b.ins().fmul(p, m);
    let y = b.ins().fmul(y, z);
    let fe = b.ins().fcvt_from_sint(F32X4, e);
    let q1 = fsplat(b, -2.121_944_4e-4);
    let t = b.ins().fmul(fe, q1);
    let y = b.ins().fadd(y, t);
    let half = fsplat(b, 0.5);
    let t = b.ins().fmul(z, half);
    let y = b.ins().fsub(y, t);
    let r = b.ins().fadd(m, y);
    let q2 = fsplat(b, 0.693_359_4);
    let t = b.ins().fmul(fe, q2);
    let r = b.ins().fadd(r, t);
    // Specials.
    let zero = fsplat(b, 0.0);
    let is_zero = b.ins().fcmp(FloatCC::Equal, x, zero);
    let ninf = fsplat(b, f32::NEG_INFINITY);
    let r = vselect(b, is_zero, ninf, r);
    let inf = fsplat(b, f32::INFINITY);
    let is_inf = b.ins().fcmp(FloatCC::Equal, x, inf);
    let r = vselect(b, is_inf, inf, r);
    let bad = b.ins().fcmp(FloatCC::UnorderedOrLessThan, x, zero);
    let nan = fsplat(b, f32::NAN);
    vselect(b, bad, nan, r)
}

pub fn tanh(b: &mut FunctionBuilder, x: Value) -> Value {
    let a = b.ins().fabs(x);
    // |x| < 0.625: odd polynomial.
    let z = b.ins().fmul(x, x);
    let p = poly(b, z, &[-5.704_988_7e-3, 2.063_908_9e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328_2e-1]);
    let p = b.ins().fmul(p, z);
    let p = b.ins().fmul(p, x);
    let small = b.ins().fadd(p, x);
    // Otherwise 1 - 2 / (exp(2|x|) + 1), with x's sign.
    let two = fsplat(b, 2.0);
    let a2 = b.ins().fmul(a, two);
    let s = exp(b, a2);
    let one = fsplat(b, 1.0);
    let s1 = b.ins().fadd(s, one);
    let q = b.ins().fdiv(two, s1);
    let large = b.ins().fsub(one, q);
    let lim = fsplat(b, 0.625);
    let is_small = b.ins().fcmp(FloatCC::LessThan, a, lim);
    let r = vselect(b, is_small, small, large);
    // x's sign: `large` is |tanh x|, `small` already has it (|x p z| < |x|) except that
    // -0 gives +0; a NaN (which takes `large`) stays NaN.
    copysign(b, r, x)
}

pub fn erf(b: &mut FunctionBuilder, x: Value) -> Value {
    let a = b.ins().fabs(x);
    let z = b.ins().fmul(x, x);
    let p = poly(b, z, &[7.853_861_4e-5, -8.010_193_6e-4, 5.188_327_7e-3, -2.685_381_2e-2, 1.128_358_5e-1, -3.761_262_6e-1, 1.128_379_2]);
    let small = b.ins().fmul(x, p);
    let one = fsplat(b, 1.0);
    let t = b.ins().fdiv(one, a);
    let q = poly(b, t, &[0.054_865_383, -0.314_059_26, 0.762_702_05, -0.982_770_56, 0.621_802_4, 0.016_594_797, -0.298_699_23, 0.003_170_531_2, 0.563_977_54]);
    let nz = b.ins().fneg(z);
    let e = exp(b, nz);
    let eq = b.ins().fmul(e, q);
    let eqt = b.ins().fmul(eq, t);
    let large = b.ins().fsub(one, eqt);
    let four = fsplat(b, 4.0);
    let huge = b.ins().fcmp(FloatCC::GreaterThanOrEqual, a, four);
    let large = vselect(b, huge, one, large);
    let large = copysign(b, large, x);
    let lim = fsplat(b, 1.0);
    let is_small = b.ins().fcmp(FloatCC::LessThan, a, lim);
    let r = vselect(b, is_small, small, large);
    let nan = b.ins().fcmp(FloatCC::Unordered, x, x);
    vselect(b, nan, x, r)
}

/// Applies a scalar helper `f(lanes of the args) -> lane` to each of the 4 lanes.
pub fn per_lane(b: &mut FunctionBuilder, f: FuncRef, args: &[Value], out_ty: cranelift_codegen::ir::Type) -> Value {
    let zero = match out_ty {
        F32X4 => fsplat(b, 0.0),
        _ => isplat(b, 0),
    };
    let mut out = zero;
    for lane in 0..4u8 {
        let xs: Vec<Value> = args.iter().map(|&a| b.ins().extractlane(a, lane)).collect();
        let call = b.ins().call(f, &xs);
        let r = b.inst_results(call)[0];
        out = b.ins().insertlane(out, r, lane);
    }
    out
}

/// `1 / sqrt(x)` per lane in f64, rounded once to f32 (as the interpreter).
pub fn rsqrt(b: &mut FunctionBuilder, x: Value) -> Value {
    let mut out = fsplat(b, 0.0);
    for lane in 0..4u8 {
        let v = b.ins().extractlane(x, lane);
        let d = b.ins().fpromote(F64, v);
        let s = b.ins().sqrt(d);
        let one = b.ins().f64const(1.0);
        let q = b.ins().fdiv(one, s);
        let r = b.ins().fdemote(F32, q);
        out = b.ins().insertlane(out, r, lane);
    }
    out
}

/// Integer division / remainder per lane with the interpreter's rules: `x / 0 = 0`,
/// `x rem 0 = x`, `MIN / -1 = MIN` (wrapping), `x rem -1 = 0`.
pub fn idiv_lanes(b: &mut FunctionBuilder, x: Value, y: Value, rem: bool) -> Value {
    let mut out = isplat(b, 0);
    for lane in 0..4u8 {
        let xl = b.ins().extractlane(x, lane);
        let yl = b.ins().extractlane(y, lane);
        let r = idiv_scalar(b, xl, yl, rem);
        out = b.ins().insertlane(out, r, lane);
    }
    out
}

pub fn idiv_scalar(b: &mut FunctionBuilder, x: Value, y: Value, rem: bool) -> Value {
    let zero = b.ins().iconst(I32, 0);
    let one = b.ins().iconst(I32, 1);
    let is0 = b.ins().icmp_imm_s(IntCC::Equal, y, 0);
    let ism1 = b.ins().icmp_imm_s(IntCC::Equal, y, -1);
    let special = b.ins().bor(is0, ism1);
    let ys = b.ins().select(special, one, y);
    if rem {
        let r = b.ins().srem(x, ys);
        let r = b.ins().select(ism1, zero, r);
        b.ins().select(is0, x, r)
    } else {
        let q = b.ins().sdiv(x, ys);
        let neg = b.ins().ineg(x);
        let q = b.ins().select(ism1, neg, q);
        b.ins().select(is0, zero, q)
    }
}

/// A shift per lane (amounts differ per lane; Cranelift's vector shifts take one amount)
/// with the interpreter's rules for `bits`-wide integers held sign-extended in i32 lanes:
/// see [`shift_scalar`].
pub fn shift_lanes(b: &mut FunctionBuilder, op: tessera_dsl::BinaryOp, x: Value, y: Value, bits: u32) -> Value {
    let mut out = isplat(b, 0);
    for lane in 0..4u8 {
        let xl = b.ins().extractlane(x, lane);
        let yl = b.ins().extractlane(y, lane);
        let r = shift_scalar(b, op, xl, yl, bits);
        out = b.ins().insertlane(out, r, lane);
    }
    out
}

/// `x << n`, `x >> n` (arithmetic) or logical `x >> n` of a `bits`-wide integer (8 or 32)
/// held sign-extended in an i32, as `tessera_dsl::interp::shift`: an amount outside
/// `0..bits` gives 0 (the sign fill for the arithmetic shift), where Cranelift's own
/// shifts would take it modulo 32. The caller wraps i8 results.
pub fn shift_scalar(b: &mut FunctionBuilder, op: tessera_dsl::BinaryOp, x: Value, n: Value, bits: u32) -> Value {
    use tessera_dsl::BinaryOp;
    let ok = b.ins().icmp_imm_s(IntCC::UnsignedLessThan, n, bits as i64);
    let zero = b.ins().iconst(I32, 0);
    match op {
        BinaryOp::Shl => {
            let r = b.ins().ishl(x, n);
            b.ins().select(ok, r, zero)
        }
        BinaryOp::Shr => {
            let fill = b.ins().iconst(I32, 31);
            let n = b.ins().select(ok, n, fill);
            b.ins().sshr(x, n)
        }
        _ => {
            let x = if bits < 32 { b.ins().band_imm_s(x, (1i64 << bits) - 1) } else { x };
            let r = b.ins().ushr(x, n);
            b.ins().select(ok, r, zero)
        }
    }
}

/// `sign(x)` on f32 lanes: -1, 0 or 1; both zeros give +0, NaN stays NaN.
pub fn sign(b: &mut FunctionBuilder, x: Value) -> Value {
    let zero = fsplat(b, 0.0);
    let one = fsplat(b, 1.0);
    let minus_one = fsplat(b, -1.0);
    let pos = b.ins().fcmp(FloatCC::GreaterThan, x, zero);
    let neg = b.ins().fcmp(FloatCC::LessThan, x, zero);
    let nan = b.ins().fcmp(FloatCC::Unordered, x, x);
    let r = vselect(b, nan, x, zero);
    let r = vselect(b, neg, minus_one, r);
    vselect(b, pos, one, r)
}

/// Lane 0 of a vector op applied to a splat: scalar math with exactly the vector's numerics.
pub fn via_vector(b: &mut FunctionBuilder, x: Value, f: impl FnOnce(&mut FunctionBuilder, Value) -> Value) -> Value {
    let ty = b.func.dfg.value_type(x);
    let vty = if ty == F32 { F32X4 } else { I32X4 };
    let v = b.ins().splat(vty, x);
    let r = f(b, v);
    b.ins().extractlane(r, 0)
}

/// The fp8 format of `dtype`: (exponent bias adjustment to f32, mantissa shift from f32,
/// largest magnitude that does not overflow (bits), overflow code, smallest normal (bits),
/// subnormal rounding constant (a power of two whose ulp is the smallest subnormal)).
struct Fp8 {
    shift: i32,
    rebias: i32,
    sat_bits: i32,
    sat_inclusive: bool,
    sat_code: i32,
    min_normal_bits: i32,
    sub_magic: f32,
}

fn fp8_format(e5m2: bool) -> Fp8 {
    if e5m2 {
        // |x| >= 61440 rounds to inf (0x7C).
        Fp8 { shift: 21, rebias: (127 - 15) << 2, sat_bits: 61440f32.to_bits() as i32, sat_inclusive: true, sat_code: 0x7c, min_normal_bits: 0x3880_0000, sub_magic: 128.0 }
    } else {
        // |x| > 448 saturates to 448 (0x7E): e4m3fn has no infinity (torch's conversion).
        Fp8 { shift: 20, rebias: (127 - 7) << 3, sat_bits: 448f32.to_bits() as i32, sat_inclusive: false, sat_code: 0x7e, min_normal_bits: 0x3c80_0000, sub_magic: 16384.0 }
    }
}

/// f32 lanes -> fp8 codes in i32 lanes (0..=255), as `tessera_dsl::fp8::{e4m3fn,e5m2}_from_f32`
/// (torch's conversion): nearest-even, subnormals by the FPU's rounding of `|x| + 2^k`,
/// e4m3fn saturating, e5m2 overflowing to inf, NaN -> `sign | 0x7F`.
pub fn encode_fp8(b: &mut FunctionBuilder, v: Value, e5m2: bool) -> Value {
    let f = fp8_format(e5m2);
    let bits = as_i(b, v);
    let abs_mask = isplat(b, 0x7fff_ffff);
    let a = b.ins().band(bits, abs_mask);
    // Normal range: round the f32 bits to the fp8 mantissa, nearest-even.
    let lsb = b.ins().ushr_imm_s(a, f.shift as i64);
    let one = isplat(b, 1);
    let lsb = b.ins().band(lsb, one);
    let half = isplat(b, (1 << (f.shift - 1)) - 1);
    let r = b.ins().iadd(a, half);
    let r = b.ins().iadd(r, lsb);
    let r = b.ins().ushr_imm_s(r, f.shift as i64);
    let rebias = isplat(b, f.rebias);
    let normal = b.ins().isub(r, rebias);
    // Subnormal range.
    let af = as_f(b, a);
    let magic = fsplat(b, f.sub_magic);
    let s = b.ins().fadd(af, magic);
    let s = as_i(b, s);
    let magic_bits = isplat(b, f.sub_magic.to_bits() as i32);
    let sub = b.ins().isub(s, magic_bits);
    let min_normal = isplat(b, f.min_normal_bits);
    let is_sub = b.ins().icmp(IntCC::SignedLessThan, a, min_normal);
    let code = b.ins().bitselect(is_sub, sub, normal);
    let sat = isplat(b, f.sat_bits);
    let cc = if f.sat_inclusive { IntCC::SignedGreaterThanOrEqual } else { IntCC::SignedGreaterThan };
    let over = b.ins().icmp(cc, a, sat);
    let sat_code = isplat(b, f.sat_code);
    let code = b.ins().bitselect(over, sat_code, code);
    let inf = isplat(b, 0x7f80_0000);
    let nan = b.ins().icmp(IntCC::SignedGreaterThan, a, inf);
    let nan_code = isplat(b, 0x7f);
    let code = b.ins().bitselect(nan, nan_code, code);
    let sign = b.ins().ushr_imm_s(bits, 31);
    let sign = b.ins().ishl_imm_s(sign, 7);
    b.ins().bor(code, sign)
}

/// fp8 codes in i32 lanes (0..=255) -> f32 lanes (exact; NaN codes -> quiet NaN of their
/// sign, e5m2's 0x7C -> inf), as `tessera_dsl::fp8::{e4m3fn,e5m2}_to_f32`.
pub fn decode_fp8(b: &mut FunctionBuilder, c: Value, e5m2: bool) -> Value {
    let f = fp8_format(e5m2);
    let low7 = isplat(b, 0x7f);
    let m = b.ins().band(c, low7);
    let normal = b.ins().ishl_imm_s(m, f.shift as i64);
    let rebias = isplat(b, f.rebias << f.shift);
    let normal = b.ins().iadd(normal, rebias);
    // Subnormals (exponent field 0): mantissa x the smallest subnormal, exactly.
    let mant_mask = isplat(b, if e5m2 { 3 } else { 7 });
    let mant = b.ins().band(m, mant_mask);
    let mf = b.ins().fcvt_from_sint(F32X4, mant);
    let unit = fsplat(b, if e5m2 { 1.0 / 65536.0 } else { 1.0 / 512.0 });
    let sub = b.ins().fmul(mf, unit);
    let sub = as_i(b, sub);
    let first_normal = isplat(b, if e5m2 { 4 } else { 8 });
    let is_sub = b.ins().icmp(IntCC::SignedLessThan, m, first_normal);
    let mag = b.ins().bitselect(is_sub, sub, normal);
    let qnan = isplat(b, 0x7fc0_0000);
    let mag = if e5m2 {
        let inf_code = isplat(b, 0x7c);
        let is_inf = b.ins().icmp(IntCC::Equal, m, inf_code);
        let inf = isplat(b, 0x7f80_0000);
        let mag = b.ins().bitselect(is_inf, inf, mag);
        let is_nan = b.ins().icmp(IntCC::SignedGreaterThan, m, inf_code);
        b.ins().bitselect(is_nan, qnan, mag)
    } else {
        let is_nan = b.ins().icmp(IntCC::Equal, m, low7);
        b.ins().bitselect(is_nan, qnan, mag)
    };
    let sign_bit = isplat(b, 0x80);
    let sign = b.ins().band(c, sign_bit);
    let sign = b.ins().ishl_imm_s(sign, 24);
    let out = b.ins().bor(mag, sign);
    as_f(b, out)
}

/// Rounds f32 lanes to fp8 values (kept as f32), as `tessera_dsl::fp8::round`.
pub fn round_fp8(b: &mut FunctionBuilder, v: Value, e5m2: bool) -> Value {
    let c = encode_fp8(b, v, e5m2);
    decode_fp8(b, c, e5m2)
}
