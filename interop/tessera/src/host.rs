//! Host arrays for kernel inputs: from slices of any element type the DSL has, from f32
//! values rounded to a dtype, random, or zeros.

use half::bf16;
use rand::{rngs::StdRng, SeedableRng};
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

/// An array of `shape` holding `values` (row-major); the dtype is the element type's.
pub fn array<T: Element>(shape: &[usize], values: &[T]) -> Result<Array, Error> {
    Array::try_new(shape, T::data(values.to_vec())).map_err(|m| Error::Host(format!("host array of shape {shape:?}: {m}; give one value per element of the shape, row-major")))
}

/// An array of `dtype` and `shape` from f32 `values`, rounded to `dtype` (f32 or bf16; ints
/// are truncated).
pub fn array_as(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Array, Error> {
    array(shape, values)?; // the length check, with its message
    Ok(Array::from_f32_in(dtype, shape, values.to_vec()))
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
