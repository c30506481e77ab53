//! The two fp8 formats, as PyTorch converts them (`tensor.to(torch.float8_e4m3fn)`,
//! `torch.float8_e5m2`; measured on torch 2.15, the fixture `tests/fixtures/fp8_torch.txt`
//! holds its answers):
//!
//! - f32 -> fp8 rounds to nearest-even, subnormals included;
//! - **e4m3fn saturates**: every finite value beyond 448, and +-infinity, becomes +-448
//!   (e4m3fn has no infinity; torch never produces its NaN from a number);
//! - **e5m2 overflows to infinity**: |x| >= 61440 (the midpoint of 57344 and 65536, which
//!   rounds to even = up) becomes +-inf, as IEEE rounding does;
//! - NaN becomes `sign | 0x7F` in both formats (the input's sign kept, payload dropped);
//! - bf16 -> fp8 is bf16 -> f32 (exact) -> fp8: torch's direct conversion agrees on all
//!   65536 bf16 values;
//! - fp8 -> f32 / bf16 is exact; a NaN code decodes to the quiet NaN of its sign.
//!
//! The ml_dtypes (JAX) conversion differs on e4m3fn overflow (NaN instead of 448) and
//! the `float8` crate's `from_f32` on e5m2 overflow (57344 instead of inf): Tessera's
//! interpreter, JIT and host arrays follow torch, whose users are Tessera's. The
//! TPU's own conversion of values out of range is not observable compile-only.
//!
//! The host element types are the `float8` crate's ([`F8E4M3`] is e4m3fn), used only as
//! byte containers: every conversion Tessera makes goes through this module.

pub use float8::{F8E4M3, F8E5M2};

use crate::types::DType;

/// f32 -> e4m3fn code (torch: round to nearest-even, saturate to +-448, NaN -> `s|0x7F`).
pub fn e4m3fn_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7fff_ffff;
    let code = if a > 0x7f80_0000 {
        0x7f
    } else if a > 448f32.to_bits() {
        0x7e
    } else if a < 0x3c80_0000 {
        // Below the smallest normal 2^-6: multiples of 2^-9, rounded by the FPU's
        // nearest-even addition (the ulp of 2^14 is 2^-9).
        ((f32::from_bits(a) + 16384.0).to_bits() - 16384f32.to_bits()) as u8
    } else {
        let r = a + 0x7_ffff + ((a >> 20) & 1);
        ((r >> 20) - ((127 - 7) << 3)) as u8
    };
    sign | code
}

/// f32 -> e5m2 code (torch: round to nearest-even, |x| >= 61440 -> +-inf, NaN -> `s|0x7F`).
pub fn e5m2_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7fff_ffff;
    let code = if a > 0x7f80_0000 {
        0x7f
    } else if a >= 61440f32.to_bits() {
        0x7c
    } else if a < 0x3880_0000 {
        // Below the smallest normal 2^-14: multiples of 2^-16 (the ulp of 128).
        ((f32::from_bits(a) + 128.0).to_bits() - 128f32.to_bits()) as u8
    } else {
        let r = a + 0xf_ffff + ((a >> 21) & 1);
        ((r >> 21) - ((127 - 15) << 2)) as u8
    };
    sign | code
}

/// e4m3fn code -> f32 (exact; `0x7F`/`0xFF` -> NaN of that sign).
pub fn e4m3fn_to_f32(c: u8) -> f32 {
    let sign = ((c & 0x80) as u32) << 24;
    let m = c & 0x7f;
    let mag = if m == 0x7f {
        0x7fc0_0000
    } else if m >> 3 == 0 {
        ((m & 7) as f32 * (1.0 / 512.0)).to_bits()
    } else {
        ((m as u32) << 20) + ((127 - 7) << 23)
    };
    f32::from_bits(sign | mag)
}

/// e5m2 code -> f32 (exact; `0x7C` inf, `0x7D..=0x7F` NaN, signed).
pub fn e5m2_to_f32(c: u8) -> f32 {
    let sign = ((c & 0x80) as u32) << 24;
    let m = c & 0x7f;
    let mag = if m > 0x7c {
        0x7fc0_0000
    } else if m == 0x7c {
        0x7f80_0000
    } else if m >> 2 == 0 {
        ((m & 3) as f32 * (1.0 / 65536.0)).to_bits()
    } else {
        ((m as u32) << 21) + ((127 - 15) << 23)
    };
    f32::from_bits(sign | mag)
}

/// f32 -> the code of `dtype` (an fp8 type).
///
/// # Panics
/// If `dtype` is not an fp8 type.
pub fn encode(dtype: DType, x: f32) -> u8 {
    match dtype {
        DType::F8E4M3FN => e4m3fn_from_f32(x),
        DType::F8E5M2 => e5m2_from_f32(x),
        d => panic!("fp8::encode: {d} is not an fp8 type"),
    }
}

/// The code of `dtype` (an fp8 type) -> f32.
///
/// # Panics
/// If `dtype` is not an fp8 type.
pub fn decode(dtype: DType, c: u8) -> f32 {
    match dtype {
        DType::F8E4M3FN => e4m3fn_to_f32(c),
        DType::F8E5M2 => e5m2_to_f32(c),
        d => panic!("fp8::decode: {d} is not an fp8 type"),
    }
}

/// `x` rounded to `dtype` (an fp8 type) and back: the value an fp8 result holds.
pub fn round(dtype: DType, x: f32) -> f32 {
    decode(dtype, encode(dtype, x))
}

/// The largest finite value of an fp8 type.
pub fn max_finite(dtype: DType) -> f64 {
    if dtype == DType::F8E4M3FN { 448.0 } else { 57344.0 }
}

/// Host element of e4m3fn from f32, as torch converts.
pub fn to_e4m3fn(x: f32) -> F8E4M3 {
    F8E4M3::from_bits(e4m3fn_from_f32(x))
}

/// Host element of e5m2 from f32, as torch converts.
pub fn to_e5m2(x: f32) -> F8E5M2 {
    F8E5M2::from_bits(e5m2_from_f32(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_code() {
        for c in 0..=255u8 {
            for d in [DType::F8E4M3FN, DType::F8E5M2] {
                let x = decode(d, c);
                if !x.is_nan() {
                    assert_eq!(encode(d, x), c, "{d} code {c:#x}");
                }
            }
        }
    }
}
