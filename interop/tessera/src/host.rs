//! Host arrays for kernel inputs: from slices of any element type the DSL has, from f32
//! values rounded to a dtype, random, or zeros. fp8 arrays hold the `float8` crate's
//! `F8E4M3` (= `float8_e4m3fn`) and `F8E5M2` elements; build them from f32 values with
//! [`array_as`] (converted as torch's `.to(torch.float8_e4m3fn)`: nearest-even, e4m3fn
//! saturating at +-448, e5m2 overflowing to inf) or from raw codes with [`array_fp8_bits`].

use half::bf16;
use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::fp8::{F8E4M3, F8E5M2};
use tessera_dsl::interp::{Array, Data};
use tessera_dsl::{DType, Type};

use crate::Error;

/// An element type a host array can hold.
pub trait Element: Copy {
    fn data(values: Vec<Self>) -> Data;
}

impl Element for f32 {
    fn data(v: Vec<f32>) -> Data {
        Data::F32(v)
    }
}
impl Element for bf16 {
    fn data(v: Vec<bf16>) -> Data {
        Data::BF16(v)
    }
}
impl Element for i32 {
    fn data(v: Vec<i32>) -> Data {
        Data::I32(v)
    }
}
impl Element for i8 {
    fn data(v: Vec<i8>) -> Data {
        Data::I8(v)
    }
}
impl Element for bool {
    fn data(v: Vec<bool>) -> Data {
        Data::Bool(v)
    }
}
/// `float8_e4m3fn` elements (give the bits you have: `F8E4M3::from_bits`; to convert f32
/// values as torch does, use [`array_as`] or `tessera::fp8::to_e4m3fn`).
impl Element for F8E4M3 {
    fn data(v: Vec<F8E4M3>) -> Data {
        Data::F8E4M3FN(v)
    }
}
/// `float8_e5m2` elements.
impl Element for F8E5M2 {
    fn data(v: Vec<F8E5M2>) -> Data {
        Data::F8E5M2(v)
    }
}

/// An array of `shape` holding `values` (row-major); the dtype is the element type's.
pub fn array<T: Element>(shape: &[usize], values: &[T]) -> Result<Array, Error> {
    Array::try_new(shape, T::data(values.to_vec())).map_err(|m| Error::Host(format!("host array of shape {shape:?}: {m}; give one value per element of the shape, row-major")))
}

/// An array of a float `dtype` and `shape` from f32 `values`: f32 as given, bf16 rounded to
/// nearest-even, fp8 converted as torch's `.to(dtype)` does.
pub fn array_as(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Array, Error> {
    array(shape, values)?; // the length check, with its message
    if !dtype.is_float() {
        return Err(Error::Host(format!("array_as converts f32 values to a float dtype, not {dtype}; build integer arrays with `array(shape, &[i32 or i8 values])`")));
    }
    Ok(Array::from_f32_in(dtype, shape, values.to_vec()))
}

/// An fp8 array (`DType::F8E4M3FN` or `DType::F8E5M2`) of `shape` from raw codes, one byte
/// per element (e.g. the bytes of a `torch.float8_e4m3fn` tensor, `t.view(torch.uint8)`).
pub fn array_fp8_bits(dtype: DType, shape: &[usize], codes: &[u8]) -> Result<Array, Error> {
    if !dtype.is_fp8() {
        return Err(Error::Host(format!("array_fp8_bits builds float8_e4m3fn or float8_e5m2 arrays, not {dtype}")));
    }
    array(shape, codes.iter().map(|&c| c as i8).collect::<Vec<_>>().as_slice())?; // the length check
    Ok(Array::from_fp8_bits(dtype, shape, codes))
}

/// Uniform values in [-1, 1) rounded to `dtype` (ints: scaled by 100), from `seed`:
/// reproducible test inputs.
pub fn random(dtype: DType, shape: &[usize], seed: u64) -> Array {
    tessera_kernels::harness::random_array(dtype, shape, &mut StdRng::seed_from_u64(seed))
}

/// Zeros of `dtype` and `shape`.
pub fn zeros(dtype: DType, shape: &[usize]) -> Array {
    Array::zeros(dtype, shape)
}

/// The [`Type`] a kernel builder takes for an operand like `a`.
pub fn type_of(a: &Array) -> Type {
    Type::vector(a.dtype, &a.shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_arrays_from_f32_bits_and_elements() {
        let a = array_as(DType::F8E4M3FN, &[4], &[1.0, 1000.0, -f32::INFINITY, 0.3]).unwrap();
        assert_eq!(a.fp8_bits().unwrap(), vec![0x38, 0x7e, 0xfe, 0x2a]);
        let b = array_as(DType::F8E5M2, &[2], &[1.0, 1e6]).unwrap();
        assert_eq!(b.fp8_bits().unwrap(), vec![0x3c, 0x7c]);
        let c = array(&[2], &[F8E4M3::from_bits(0x38), F8E4M3::from_bits(0x40)]).unwrap();
        assert_eq!((c.dtype, c.to_f32_vec()), (DType::F8E4M3FN, vec![1.0, 2.0]));
        let d = array_fp8_bits(DType::F8E5M2, &[2], &[0x3c, 0x40]).unwrap();
        assert_eq!(d.to_f32_vec(), vec![1.0, 2.0]);
        assert!(array_fp8_bits(DType::F8E5M2, &[3], &[0x3c]).unwrap_err().to_string().contains("shape [3]"));
        assert!(array_fp8_bits(DType::BF16, &[1], &[0]).is_err());
        assert!(array_as(DType::I32, &[1], &[1.0]).is_err());
    }
}
