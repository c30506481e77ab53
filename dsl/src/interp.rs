//! The reference CPU interpreter. It defines what the block IR means: every backend
//! (Mosaic, JIT) is tested against it.
//!
//! # Execution model (Pallas TPU)
//!
//! - The grid runs sequentially in lexicographic order, last dim fastest. A dynamic dim
//!   ([`GridDim::dynamic`]) runs the extent its operand holds at run time ([`run_extents`]:
//!   `0..=bound`, else `grid-dynamic-extent`); the steps past it do not run at all.
//! - At each step every blocked operand's index map gives a block index. An input's block
//!   is copied into its VMEM window only when the index changed since the previous step
//!   (as the real pipeline does). An output's window is written back to the array when
//!   its index changes and at the end of the grid; a freshly entered output window is
//!   *not* loaded from the array but filled with poison, exactly as real TPU output
//!   buffers are uninitialised. Output arrays start poisoned too.
//! - Poison is NaN for floats, `MIN` for integers and `false` for bools, so a kernel
//!   that reads an output before writing it, or never writes a block, produces NaN.
//! - Scratch buffers persist across grid steps and start poisoned.
//! - Async copies (`dma_start` / `dma_wait`) are simulated so that a missing or wrong wait
//!   fails loudly instead of passing by luck:
//!   - `dma_start` reads the source box *at start* (the snapshot is what lands; a DMA
//!     engine may read its source any time before completion, so writing the source while
//!     the copy is in flight is a race whose outcome the kernel must not rely on), poisons
//!     the destination box at once, and records the copy as pending on its semaphore;
//!   - `dma_wait` on a semaphore completes its oldest pending copy (semaphores count, and
//!     completion order on one semaphore is issue order here), writing the snapshot into
//!     the destination. A wait with nothing pending is `dma-wait-without-start`; a wait
//!     whose descriptor moves a different number of bytes than the copy it completes is
//!     `dma-wait-mismatch`;
//!   - so reading a destination before its wait reads poison (NaN), and a copy never
//!     waited for is `dma-unwaited`: at the end of the kernel always, and at the end of a
//!     grid step unless every grid dim is `arbitrary` (only then do consecutive steps run on
//!     one core in order, which cross-step prefetching relies on).
//! - A kernel on a mesh of devices runs on every one of them ([`run_devices`]): each its own
//!   memories, stepped round-robin; remote copies land in the peer's memory, waits block
//!   until a peer signals or sends (`interp/devices.rs` has the model and its errors).
//! - Grid steps that differ in a `parallel` dim may run concurrently (on a chip's cores;
//!   in the compiled CPU backends, on threads), so they must not write the same output
//!   block: an output whose index map gives one block to two steps that differ in a
//!   `parallel` dim is `parallel-revisit`, reported when the second of them starts.
//! - Unblocked operands (no block spec) are seen whole by the kernel.
//! - The operand arrays are the caller's memory ([`run_into`]): input blocks, body reads
//!   of whole (unblocked) inputs and DMA sources are read straight from the borrowed input
//!   slices, and output blocks written straight into the output slices, converting
//!   between the host dtype and the interpreter's storage (below) one box at a time; no
//!   operand is copied whole. [`run`] is `run_into` on `Array`s (outputs allocated).
//! - A block that extends past the end of the array (array dim not a multiple of the
//!   block dim, or a block larger than a small array; both compile with libtpu) is read
//!   with poison padding and written back clipped.
//!
//! # Numerics
//!
//! - bf16 values are kept as f32 and rounded to bf16 (nearest-even) after every op whose
//!   result is bf16; i8 values are kept as i32 and wrapped to the i8 range after every op
//!   whose result is i8. fp8 values (`float8_e4m3fn`, `float8_e5m2`) are kept as f32 and
//!   rounded to their format after every op whose result is fp8, as torch converts
//!   ([`crate::fp8`]: nearest-even; e4m3fn saturates to +-448, e5m2 overflows to inf).
//! - Float arithmetic is IEEE f32. Transcendentals (exp, log, tanh, erf, sqrt, rsqrt,
//!   pow) are computed in f64 and rounded once, so the reference is correctly rounded in
//!   practice and does not depend on the platform's libm.
//! - `max`/`min` propagate NaN (like `jnp.maximum`) and order `-0 < +0` (IEEE 754-2019
//!   `maximum`/`minimum`), so they are commutative and associative. Float comparisons are IEEE: every
//!   comparison with a NaN operand is false except `ne`, which is true (Mosaic `cmpf une`).
//! - Integer `add`/`sub`/`mul`/`neg`/`abs` wrap. Integer `div` truncates toward zero and
//!   `rem` takes the sign of the dividend (C / `lax.div`, `lax.rem`); division by zero is
//!   defined as 0 and `x rem 0` as `x` (so `x == (x / y) * y + x rem y` still holds).
//!   Float `rem` is `fmod`.
//! - Casts: float -> int truncates toward zero and saturates (NaN -> 0); int -> int wraps;
//!   anything -> bf16 rounds to nearest-even; bool -> number is 0/1; number -> bool is
//!   `x != 0`.
//! - `dot` of f32/bf16 operands accumulates in f32 (through `matrixmultiply::sgemm`);
//!   of i8/i32 operands in wrapping i32. A mixed bf16 x f32 `dot` promotes the bf16
//!   operand to f32 (exactly: every bf16 is an f32) and multiplies in f32, as libtpu
//!   compiles it. The order of a dot's additions is not part of the contract (backends
//!   call other GEMMs): compare dots with a tolerance.
//! - Float `sum` reductions add in a fixed order that keeps the error from growing with
//!   the width (about `(22 + log2(n / 128)) * eps` relative to the sum of magnitudes, where a
//!   sequential sum grows as `n * eps`) and that SIMD code reproduces exactly
//!   ([`pairwise_sum`]): the `n` elements are cut into chunks of 128 (the last one shorter);
//!   a chunk of fewer than 8 elements is folded in order from its first element; otherwise
//!   lane `j` (0..8) sums elements `j, j + 8, j + 16, ...` of the chunk's first `8 * floor(len / 8)`
//!   in order, the lanes are combined as `((r0 + r4) + (r2 + r6)) + ((r1 + r5) + (r3 + r7))`,
//!   and the remaining `len % 8` elements are added to that in order. The chunk sums are
//!   then combined in passes: each pass replaces `s[i]` by `s[2i] + s[2i+1]`, an odd last
//!   one moving up unchanged, until one is left. Integer sums wrap (order-free); `max`/`min`
//!   are order-free (below).
//! - `iota` counts in i32; an i8 iota wraps like every i8 result (index 128 is -128).

use std::rc::Rc;
use std::time::{Duration, Instant};

use half::bf16;

use crate::fp8::{self, F8E4M3, F8E5M2};

use crate::error::{KernelError, Result};
use crate::ir::*;
use crate::types::{DType, MemorySpace};
use crate::verify::eval_index;

mod devices;
use devices::Fabric;
pub use devices::{run_devices, run_devices_into};

// ---- public arrays ------------------------------------------------------------------------

/// The elements of an [`Array`], row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    I8(Vec<i8>),
    Bool(Vec<bool>),
    /// `float8_e4m3fn` elements (the `float8` crate's byte type).
    F8E4M3FN(Vec<F8E4M3>),
    /// `float8_e5m2` elements.
    F8E5M2(Vec<F8E5M2>),
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::I32(_) => DType::I32,
            Data::I8(_) => DType::I8,
            Data::Bool(_) => DType::Bool,
            Data::F8E4M3FN(_) => DType::F8E4M3FN,
            Data::F8E5M2(_) => DType::F8E5M2,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::I8(v) => v.len(),
            Data::Bool(v) => v.len(),
            Data::F8E4M3FN(v) => v.len(),
            Data::F8E5M2(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`Array::try_filled`] fills an array with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    Zero,
    /// NaN, `MIN`, `false`: what the interpreter's unwritten memory reads as.
    Poison,
}

/// An array that cannot be allocated on the host: its element count overflows, or the
/// allocation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocError {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bytes = self.shape.iter().try_fold(self.dtype.bits().div_ceil(8) as u128, |a, &d| a.checked_mul(d as u128));
        match bytes {
            Some(b) => write!(f, "{}{:?} needs {:.2} GiB of host memory, which could not be allocated", self.dtype, self.shape, b as f64 / (1u64 << 30) as f64),
            None => write!(f, "the size of {}{:?} overflows", self.dtype, self.shape),
        }
    }
}

/// A host array: a kernel argument or result.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Array {
    /// An array of `shape` holding `data`.
    ///
    /// # Panics
    /// If `data` does not have `shape.iter().product()` elements.
    pub fn new(shape: &[usize], data: Data) -> Array {
        Array::try_new(shape, data).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Array {
        Array::new(shape, Data::F32(data))
    }

    pub fn from_bf16(shape: &[usize], data: Vec<bf16>) -> Array {
        Array::new(shape, Data::BF16(data))
    }

    /// A bf16 array from f32 values, rounded to nearest-even.
    pub fn from_f32_as_bf16(shape: &[usize], data: &[f32]) -> Array {
        Array::new(shape, Data::BF16(data.iter().map(|&x| bf16::from_f32(x)).collect()))
    }

    /// An fp8 array (`float8_e4m3fn` or `float8_e5m2`) from f32 values, converted as torch's
    /// `.to(dtype)` ([`crate::fp8`]).
    ///
    /// # Panics
    /// If `dtype` is not an fp8 type or `data` does not have the shape's element count.
    pub fn from_f32_as_fp8(dtype: DType, shape: &[usize], data: &[f32]) -> Array {
        let d = match dtype {
            DType::F8E4M3FN => Data::F8E4M3FN(data.iter().map(|&x| fp8::to_e4m3fn(x)).collect()),
            DType::F8E5M2 => Data::F8E5M2(data.iter().map(|&x| fp8::to_e5m2(x)).collect()),
            other => panic!("from_f32_as_fp8: {other} is not an fp8 dtype"),
        };
        Array::new(shape, d)
    }

    /// An fp8 array from its raw codes (bytes), one per element.
    ///
    /// # Panics
    /// If `dtype` is not an fp8 type or `codes` does not have the shape's element count.
    pub fn from_fp8_bits(dtype: DType, shape: &[usize], codes: &[u8]) -> Array {
        let d = match dtype {
            DType::F8E4M3FN => Data::F8E4M3FN(codes.iter().map(|&c| F8E4M3::from_bits(c)).collect()),
            DType::F8E5M2 => Data::F8E5M2(codes.iter().map(|&c| F8E5M2::from_bits(c)).collect()),
            other => panic!("from_fp8_bits: {other} is not an fp8 dtype"),
        };
        Array::new(shape, d)
    }

    /// The raw codes of an fp8 array, `None` for other dtypes.
    pub fn fp8_bits(&self) -> Option<Vec<u8>> {
        match &self.data {
            Data::F8E4M3FN(v) => Some(v.iter().map(|x| x.to_bits()).collect()),
            Data::F8E5M2(v) => Some(v.iter().map(|x| x.to_bits()).collect()),
            _ => None,
        }
    }

    /// A float array of `dtype` from f32 values: f32 as given, bf16 rounded to nearest-even,
    /// fp8 converted as torch does.
    ///
    /// # Panics
    /// If `dtype` is not a float type.
    pub fn from_f32_in(dtype: DType, shape: &[usize], data: Vec<f32>) -> Array {
        match dtype {
            DType::F32 => Array::from_f32(shape, data),
            DType::BF16 => Array::from_f32_as_bf16(shape, &data),
            DType::F8E4M3FN | DType::F8E5M2 => Array::from_f32_as_fp8(dtype, shape, &data),
            other => panic!("from_f32_in: {other} is not a float dtype"),
        }
    }

    pub fn from_i32(shape: &[usize], data: Vec<i32>) -> Array {
        Array::new(shape, Data::I32(data))
    }

    pub fn from_i8(shape: &[usize], data: Vec<i8>) -> Array {
        Array::new(shape, Data::I8(data))
    }

    pub fn from_bool(shape: &[usize], data: Vec<bool>) -> Array {
        Array::new(shape, Data::Bool(data))
    }

    /// An array of zeros.
    ///
    /// # Panics
    /// If the element count overflows or the memory cannot be allocated (use
    /// [`Array::try_filled`] to get an error instead).
    pub fn zeros(dtype: DType, shape: &[usize]) -> Array {
        Array::try_filled(dtype, shape, Fill::Zero).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An array filled with the interpreter's poison (NaN, `MIN`, `false`).
    ///
    /// # Panics
    /// As [`Array::zeros`].
    pub fn poison(dtype: DType, shape: &[usize]) -> Array {
        Array::try_filled(dtype, shape, Fill::Poison).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An array of `shape` filled with zeros or poison, or why it cannot exist: an element
    /// count that overflows, or host memory that cannot be allocated (never an abort).
    pub fn try_filled(dtype: DType, shape: &[usize], fill: Fill) -> std::result::Result<Array, AllocError> {
        let too_big = || AllocError { dtype, shape: shape.to_vec() };
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(too_big)?;
        n.checked_mul(dtype.bits().div_ceil(8).max(1)).ok_or_else(too_big)?;
        fn filled<T: Clone>(n: usize, v: T) -> Option<Vec<T>> {
            let mut data = Vec::new();
            data.try_reserve_exact(n).ok()?;
            data.resize(n, v);
            Some(data)
        }
        let poison = fill == Fill::Poison;
        let data = match dtype {
            DType::F32 => filled(n, if poison { f32::NAN } else { 0.0 }).map(Data::F32),
            DType::BF16 => filled(n, if poison { bf16::NAN } else { bf16::ZERO }).map(Data::BF16),
            DType::I32 => filled(n, if poison { i32::MIN } else { 0 }).map(Data::I32),
            DType::I8 => filled(n, if poison { i8::MIN } else { 0 }).map(Data::I8),
            DType::Bool => filled(n, false).map(Data::Bool),
            DType::F8E4M3FN => filled(n, F8E4M3::from_bits(if poison { 0x7f } else { 0 })).map(Data::F8E4M3FN),
            DType::F8E5M2 => filled(n, F8E5M2::from_bits(if poison { 0x7f } else { 0 })).map(Data::F8E5M2),
        }
        .ok_or_else(too_big)?;
        Ok(Array { dtype, shape: shape.to_vec(), data })
    }

    /// An array of `shape` holding `data`, or an error when the element counts differ.
    pub fn try_new(shape: &[usize], data: Data) -> std::result::Result<Array, String> {
        match shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
            Some(n) if n == data.len() => Ok(Array { dtype: data.dtype(), shape: shape.to_vec(), data }),
            Some(n) => Err(format!("an array of shape {shape:?} has {n} elements, the data {}", data.len())),
            None => Err(format!("the element count of shape {shape:?} overflows")),
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Every element as f32 (bools as 0/1).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            Data::F32(v) => v.clone(),
            Data::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f32).collect(),
            Data::I8(v) => v.iter().map(|&x| x as f32).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f32).collect(),
            Data::F8E4M3FN(v) => v.iter().map(|x| fp8::e4m3fn_to_f32(x.to_bits())).collect(),
            Data::F8E5M2(v) => v.iter().map(|x| fp8::e5m2_to_f32(x.to_bits())).collect(),
        }
    }

    /// Every element as f64 (bools as 0/1); exact for every dtype.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
            Data::F8E4M3FN(v) => v.iter().map(|x| fp8::e4m3fn_to_f32(x.to_bits()) as f64).collect(),
            Data::F8E5M2(v) => v.iter().map(|x| fp8::e5m2_to_f32(x.to_bits()) as f64).collect(),
        }
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        if let Data::F32(v) = &self.data { Some(v) } else { None }
    }

    pub fn as_bf16(&self) -> Option<&[bf16]> {
        if let Data::BF16(v) = &self.data { Some(v) } else { None }
    }

    pub fn as_i32(&self) -> Option<&[i32]> {
        if let Data::I32(v) = &self.data { Some(v) } else { None }
    }

    pub fn as_i8(&self) -> Option<&[i8]> {
        if let Data::I8(v) = &self.data { Some(v) } else { None }
    }

    pub fn as_bool(&self) -> Option<&[bool]> {
        if let Data::Bool(v) = &self.data { Some(v) } else { None }
    }
}

/// What a run cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunStats {
    pub grid_steps: usize,
    /// Input blocks copied into VMEM windows (skipped when the block index repeats).
    pub block_loads: usize,
    /// Output windows written back to their arrays.
    pub block_writebacks: usize,
    pub elapsed: Duration,
}

/// Runs `kernel` on `args` (the prefetch and input operands, in signature order) and
/// returns its outputs in signature order.
///
/// A thin wrapper over [`run_into`]: the inputs are borrowed, the outputs allocated here.
pub fn run(kernel: &Kernel, args: &[&Array]) -> Result<Vec<Array>> {
    run_with_stats(kernel, args).map(|(outputs, _)| outputs)
}

/// [`run`], also reporting grid steps, block traffic and wall time.
pub fn run_with_stats(kernel: &Kernel, args: &[&Array]) -> Result<(Vec<Array>, RunStats)> {
    let start = Instant::now();
    // An `Array` states its dtype twice; [`run_into`] sees only the data, so check they agree.
    if args.len() == inputs_of(kernel).count() {
        for (decl, a) in inputs_of(kernel).zip(args) {
            if a.dtype != a.data.dtype() {
                let subject = format!("{} `{}`", decl.kind.name(), decl.name);
                return Err(KernelError::new(&kernel.name, subject, "argument-dtype", format!("expected {} elements, got an array of {} (holding {} data)", decl.dtype, a.dtype, a.data.dtype()), format!("pass a {} array", decl.dtype)));
            }
        }
    }
    crate::verify::runnable(kernel)?;
    let inputs: Vec<HostRef<'_>> = args.iter().map(|a| a.as_host()).collect();
    // Allocated poisoned, so the machine need not poison them again.
    let mut outputs = Vec::new();
    for d in outputs_of(kernel) {
        let a = Array::try_filled(d.dtype, &d.shape, Fill::Poison).map_err(|e| KernelError::new(&kernel.name, format!("output `{}`", d.name), "host-memory", e.to_string(), "run a smaller shape, or on a machine with more memory"))?;
        outputs.push(a);
    }
    let mut views: Vec<HostMut<'_>> = outputs.iter_mut().map(Array::as_host_mut).collect();
    let mut stats = run_host(kernel, &inputs, &mut views, OutputState::Poisoned)?;
    drop(views);
    stats.elapsed = start.elapsed();
    Ok((outputs, stats))
}

/// Runs `kernel` directly on caller-owned memory: `inputs` are the prefetch and input
/// operands and `outputs` the output operands, each in signature order.
///
/// Nothing is copied whole: every input block (pipeline window, scalar-prefetch or SMEM
/// read, DMA source in an ANY/HBM operand) is read straight from the borrowed input
/// slices, converted to the interpreter's storage per block, and every output block is
/// written straight into the output slices (rounded to bf16 / wrapped to i8 as its dtype
/// says). Every output element is first filled with poison (NaN, `MIN`, `false`), so the
/// parts of the outputs the kernel never writes read as poison, exactly as with [`run`];
/// the previous contents of `outputs` are never read.
///
/// The operand counts, each operand's dtype, shape and data length are checked against
/// the kernel's declarations before anything is written: a mismatch is a [`KernelError`]
/// (`argument-count` / `argument-dtype` / `argument-shape` for inputs, `output-count` /
/// `output-dtype` / `output-shape` for outputs). On any error the outputs may hold poison
/// or partial results.
pub fn run_into(kernel: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<RunStats> {
    crate::verify::runnable(kernel)?;
    run_host(kernel, inputs, outputs, OutputState::Unknown)
}

/// What the output memory holds when a run starts.
#[derive(Clone, Copy, PartialEq)]
enum OutputState {
    /// Anything: poison it first.
    Unknown,
    /// Already poison everywhere (freshly allocated by [`run_with_stats`]).
    Poisoned,
}

/// [`run_into`], told whether the outputs still need poisoning.
fn run_host(kernel: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>], state: OutputState) -> Result<RunStats> {
    let start = Instant::now();
    if let Some(n) = kernel.collective.as_ref().map(Collective::devices).filter(|&n| n != 1) {
        return Err(KernelError::new(&kernel.name, "mesh", "mesh-run", format!("the kernel runs on a mesh of {n} devices and was run on one"), "run it on every device of its mesh: interp::run_devices, one set of operands per device"));
    }
    let mut m = Machine::new(kernel, inputs, outputs, state)?;
    m.start(run_extents(kernel, inputs)?);
    let mut fab = Fabric::new(1, false);
    devices::run_machines(kernel, std::slice::from_mut(&mut m), &mut fab)?;
    m.stats.elapsed = start.elapsed();
    Ok(m.stats)
}

/// The declarations of the operands passed as inputs (prefetch and inputs), in order.
fn inputs_of(k: &Kernel) -> impl Iterator<Item = &RefDecl> {
    k.refs.iter().filter(|r| matches!(r.kind, RefKind::Prefetch | RefKind::Input))
}

/// The declarations of the output operands, in order.
fn outputs_of(k: &Kernel) -> impl Iterator<Item = &RefDecl> {
    k.refs.iter().filter(|r| r.kind == RefKind::Output)
}

// ---- borrowed host memory -------------------------------------------------------------------

/// Borrowed, contiguous row-major elements of one operand (a [`run_into`] input).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostData<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    I32(&'a [i32]),
    I8(&'a [i8]),
    Bool(&'a [bool]),
    F8E4M3FN(&'a [F8E4M3]),
    F8E5M2(&'a [F8E5M2]),
}

/// Mutably borrowed, contiguous row-major elements of one operand (a [`run_into`] output).
#[derive(Debug, PartialEq)]
pub enum HostDataMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    I32(&'a mut [i32]),
    I8(&'a mut [i8]),
    Bool(&'a mut [bool]),
    F8E4M3FN(&'a mut [F8E4M3]),
    F8E5M2(&'a mut [F8E5M2]),
}

/// One input operand of [`run_into`]: its shape and its borrowed row-major elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostRef<'a> {
    pub shape: &'a [usize],
    pub data: HostData<'a>,
}

/// One output operand of [`run_into`]: its shape and the row-major memory to write.
#[derive(Debug, PartialEq)]
pub struct HostMut<'a> {
    pub shape: &'a [usize],
    pub data: HostDataMut<'a>,
}

impl<'a> HostRef<'a> {
    /// `data` (a slice of f32, bf16, i32, i8 or bool) seen as an array of `shape`.
    pub fn new(shape: &'a [usize], data: impl Into<HostData<'a>>) -> Self {
        HostRef { shape, data: data.into() }
    }
}

impl<'a> HostMut<'a> {
    /// `data` (a mutable slice of f32, bf16, i32, i8 or bool) seen as an array of `shape`.
    pub fn new(shape: &'a [usize], data: impl Into<HostDataMut<'a>>) -> Self {
        HostMut { shape, data: data.into() }
    }
}

impl HostData<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::BF16(_) => DType::BF16,
            HostData::I32(_) => DType::I32,
            HostData::I8(_) => DType::I8,
            HostData::Bool(_) => DType::Bool,
            HostData::F8E4M3FN(_) => DType::F8E4M3FN,
            HostData::F8E5M2(_) => DType::F8E5M2,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::I8(v) => v.len(),
            HostData::Bool(v) => v.len(),
            HostData::F8E4M3FN(v) => v.len(),
            HostData::F8E5M2(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HostDataMut<'_> {
    pub fn dtype(&self) -> DType {
        self.reborrow().dtype()
    }

    pub fn len(&self) -> usize {
        self.reborrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shared view of the same elements.
    pub fn reborrow(&self) -> HostData<'_> {
        match self {
            HostDataMut::F32(v) => HostData::F32(v),
            HostDataMut::BF16(v) => HostData::BF16(v),
            HostDataMut::I32(v) => HostData::I32(v),
            HostDataMut::I8(v) => HostData::I8(v),
            HostDataMut::Bool(v) => HostData::Bool(v),
            HostDataMut::F8E4M3FN(v) => HostData::F8E4M3FN(v),
            HostDataMut::F8E5M2(v) => HostData::F8E5M2(v),
        }
    }

    /// A shorter-lived mutable view of the same elements.
    pub fn reborrow_mut(&mut self) -> HostDataMut<'_> {
        match self {
            HostDataMut::F32(v) => HostDataMut::F32(v),
            HostDataMut::BF16(v) => HostDataMut::BF16(v),
            HostDataMut::I32(v) => HostDataMut::I32(v),
            HostDataMut::I8(v) => HostDataMut::I8(v),
            HostDataMut::Bool(v) => HostDataMut::Bool(v),
            HostDataMut::F8E4M3FN(v) => HostDataMut::F8E4M3FN(v),
            HostDataMut::F8E5M2(v) => HostDataMut::F8E5M2(v),
        }
    }

    /// Fills every element with the interpreter's poison (NaN, `MIN`, `false`).
    pub fn fill_poison(&mut self) {
        match self {
            HostDataMut::F32(v) => v.fill(f32::NAN),
            HostDataMut::BF16(v) => v.fill(bf16::from_f32(f32::NAN)),
            HostDataMut::I32(v) => v.fill(i32::MIN),
            HostDataMut::I8(v) => v.fill(i8::MIN),
            HostDataMut::Bool(v) => v.fill(false),
            HostDataMut::F8E4M3FN(v) => v.fill(F8E4M3::from_bits(0x7f)),
            HostDataMut::F8E5M2(v) => v.fill(F8E5M2::from_bits(0x7f)),
        }
    }
}

macro_rules! host_from_slices {
    ($($t:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a [$t]> for HostData<'a> {
            fn from(v: &'a [$t]) -> Self {
                HostData::$variant(v)
            }
        }
        impl<'a> From<&'a mut [$t]> for HostDataMut<'a> {
            fn from(v: &'a mut [$t]) -> Self {
                HostDataMut::$variant(v)
            }
        }
    )*};
}
host_from_slices!(f32 => F32, bf16 => BF16, i32 => I32, i8 => I8, bool => Bool, F8E4M3 => F8E4M3FN, F8E5M2 => F8E5M2);

impl Data {
    /// The elements, borrowed for [`run_into`].
    pub fn as_host(&self) -> HostData<'_> {
        match self {
            Data::F32(v) => HostData::F32(v),
            Data::BF16(v) => HostData::BF16(v),
            Data::I32(v) => HostData::I32(v),
            Data::I8(v) => HostData::I8(v),
            Data::Bool(v) => HostData::Bool(v),
            Data::F8E4M3FN(v) => HostData::F8E4M3FN(v),
            Data::F8E5M2(v) => HostData::F8E5M2(v),
        }
    }

    /// The elements, mutably borrowed for [`run_into`].
    pub fn as_host_mut(&mut self) -> HostDataMut<'_> {
        match self {
            Data::F32(v) => HostDataMut::F32(v),
            Data::BF16(v) => HostDataMut::BF16(v),
            Data::I32(v) => HostDataMut::I32(v),
            Data::I8(v) => HostDataMut::I8(v),
            Data::Bool(v) => HostDataMut::Bool(v),
            Data::F8E4M3FN(v) => HostDataMut::F8E4M3FN(v),
            Data::F8E5M2(v) => HostDataMut::F8E5M2(v),
        }
    }
}

impl Array {
    /// The array borrowed as a [`run_into`] input.
    pub fn as_host(&self) -> HostRef<'_> {
        HostRef { shape: &self.shape, data: self.data.as_host() }
    }

    /// The array borrowed as a [`run_into`] output.
    pub fn as_host_mut(&mut self) -> HostMut<'_> {
        HostMut { shape: &self.shape, data: self.data.as_host_mut() }
    }
}

// ---- runtime values -------------------------------------------------------------------------

/// Element storage inside the interpreter: floats (f32 and bf16) as f32, integers (i32
/// and i8) as i32, so each op has one loop per storage class, not per dtype.
#[derive(Clone, Debug)]
enum Buf {
    F(Vec<f32>),
    I(Vec<i32>),
    B(Vec<bool>),
}

impl Buf {
    fn poison(dtype: DType, n: usize) -> Buf {
        match dtype {
            DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2 => Buf::F(vec![f32::NAN; n]),
            DType::I32 => Buf::I(vec![i32::MIN; n]),
            DType::I8 => Buf::I(vec![i8::MIN as i32; n]),
            DType::Bool => Buf::B(vec![false; n]),
        }
    }

    /// A buffer of `n` zeros in the same storage class.
    fn zeros_like(&self, n: usize) -> Buf {
        match self {
            Buf::F(_) => Buf::F(vec![0.0; n]),
            Buf::I(_) => Buf::I(vec![0; n]),
            Buf::B(_) => Buf::B(vec![false; n]),
        }
    }

    fn len(&self) -> usize {
        match self {
            Buf::F(v) => v.len(),
            Buf::I(v) => v.len(),
            Buf::B(v) => v.len(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Buf::F(_) => "float",
            Buf::I(_) => "integer",
            Buf::B(_) => "bool",
        }
    }

    /// Rounds/wraps to `dtype` after an op produced it at storage precision.
    fn normalize(&mut self, dtype: DType) {
        match (self, dtype) {
            (Buf::F(v), DType::BF16) => v.iter_mut().for_each(|x| *x = round_bf16(*x)),
            (Buf::F(v), d @ (DType::F8E4M3FN | DType::F8E5M2)) => v.iter_mut().for_each(|x| *x = fp8::round(d, *x)),
            (Buf::I(v), DType::I8) => v.iter_mut().for_each(|x| *x = *x as i8 as i32),
            _ => {}
        }
    }

    /// Fills every element with `dtype`'s poison.
    fn fill_poison(&mut self, dtype: DType) {
        match self {
            Buf::F(v) => v.fill(f32::NAN),
            Buf::I(v) => v.fill(if dtype == DType::I8 { i8::MIN as i32 } else { i32::MIN }),
            Buf::B(v) => v.fill(false),
        }
    }
}

fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// An SSA value at run time: a scalar (empty shape) or a whole vector.
#[derive(Clone, Debug)]
struct Val {
    shape: Vec<usize>,
    buf: Buf,
}

/// Memory the machine reads and writes a box at a time: its own buffer (windows, scratch)
/// or the caller's borrowed operand arrays, converted per box to / from storage precision.
enum Store<'h> {
    Buf(Buf),
    /// A prefetch or input operand: read-only.
    In(HostData<'h>),
    /// An output operand, written in place.
    Out(HostDataMut<'h>),
}

/// Why [`Store::write_box`] refused.
enum WriteError {
    /// The value's storage class differs from the memory's.
    Class,
    /// The memory is a read-only input operand.
    ReadOnly,
}

impl Store<'_> {
    /// The storage class: `float`, `integer` or `bool`.
    fn kind(&self) -> &'static str {
        match self {
            Store::Buf(b) => b.kind(),
            Store::In(h) => host_kind(*h),
            Store::Out(h) => host_kind(h.reborrow()),
        }
    }

    /// A buffer of `n` zeros in this memory's storage class.
    fn zeros_like(&self, n: usize) -> Buf {
        match self {
            Store::Buf(b) => b.zeros_like(n),
            Store::In(h) => host_zeros(*h, n),
            Store::Out(h) => host_zeros(h.reborrow(), n),
        }
    }

    /// Copies the `region` box at `origin` of this memory (row-major `shape`) to
    /// `dst_origin` of `dst` (row-major `dst_shape`); `false` if the storage classes differ.
    fn read_box(&self, shape: &[usize], origin: &[usize], dst: &mut Buf, dst_shape: &[usize], dst_origin: &[usize], region: &[usize]) -> bool {
        match self {
            Store::Buf(b) => copy_box_buf(b, shape, origin, dst, dst_shape, dst_origin, region),
            Store::In(h) => read_host(*h, shape, origin, dst, dst_shape, dst_origin, region),
            Store::Out(h) => read_host(h.reborrow(), shape, origin, dst, dst_shape, dst_origin, region),
        }
    }

    /// Copies the `region` box at `src_origin` of `src` (row-major `src_shape`) into this
    /// memory (row-major `shape`) at `origin`.
    fn write_box(&mut self, shape: &[usize], origin: &[usize], src: &Buf, src_shape: &[usize], src_origin: &[usize], region: &[usize]) -> std::result::Result<(), WriteError> {
        let ok = match self {
            Store::Buf(b) => copy_box_buf(src, src_shape, src_origin, b, shape, origin, region),
            Store::In(_) => return Err(WriteError::ReadOnly),
            Store::Out(h) => write_host(src, src_shape, src_origin, h, shape, origin, region),
        };
        if ok { Ok(()) } else { Err(WriteError::Class) }
    }

    /// Element `flat` as an i32, if this is integer memory with that element.
    fn int_at(&self, flat: usize) -> Option<i32> {
        match self {
            Store::Buf(Buf::I(v)) => v.get(flat).copied(),
            Store::In(HostData::I32(v)) => v.get(flat).copied(),
            Store::In(HostData::I8(v)) => v.get(flat).map(|&x| x as i32),
            Store::Out(HostDataMut::I32(v)) => v.get(flat).copied(),
            Store::Out(HostDataMut::I8(v)) => v.get(flat).map(|&x| x as i32),
            _ => None,
        }
    }

    /// The interpreter's own buffer (windows and scratch always are).
    fn buf_mut(&mut self) -> Option<&mut Buf> {
        match self {
            Store::Buf(b) => Some(b),
            _ => None,
        }
    }
}

fn host_kind(h: HostData<'_>) -> &'static str {
    match h {
        HostData::F32(_) | HostData::BF16(_) | HostData::F8E4M3FN(_) | HostData::F8E5M2(_) => "float",
        HostData::I32(_) | HostData::I8(_) => "integer",
        HostData::Bool(_) => "bool",
    }
}

fn host_zeros(h: HostData<'_>, n: usize) -> Buf {
    match h {
        HostData::F32(_) | HostData::BF16(_) | HostData::F8E4M3FN(_) | HostData::F8E5M2(_) => Buf::F(vec![0.0; n]),
        HostData::I32(_) | HostData::I8(_) => Buf::I(vec![0; n]),
        HostData::Bool(_) => Buf::B(vec![false; n]),
    }
}

/// [`copy_box`] from host elements into an interpreter buffer, widening bf16 to f32 and
/// i8 to i32; `false` if the storage classes differ.
fn read_host(src: HostData<'_>, src_shape: &[usize], src_origin: &[usize], dst: &mut Buf, dst_shape: &[usize], dst_origin: &[usize], region: &[usize]) -> bool {
    match (src, dst) {
        (HostData::F32(s), Buf::F(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (HostData::BF16(s), Buf::F(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, |x| x.to_f32()),
        (HostData::F8E4M3FN(s), Buf::F(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, |x| fp8::e4m3fn_to_f32(x.to_bits())),
        (HostData::F8E5M2(s), Buf::F(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, |x| fp8::e5m2_to_f32(x.to_bits())),
        (HostData::I32(s), Buf::I(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (HostData::I8(s), Buf::I(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, |x| x as i32),
        (HostData::Bool(s), Buf::B(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        _ => return false,
    }
    true
}

/// [`copy_box`] from an interpreter buffer into host elements, rounding f32 to bf16
/// (nearest-even) and wrapping i32 to i8; `false` if the storage classes differ.
fn write_host(src: &Buf, src_shape: &[usize], src_origin: &[usize], dst: &mut HostDataMut<'_>, dst_shape: &[usize], dst_origin: &[usize], region: &[usize]) -> bool {
    match (src, dst) {
        (Buf::F(s), HostDataMut::F32(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (Buf::F(s), HostDataMut::BF16(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, bf16::from_f32),
        (Buf::F(s), HostDataMut::F8E4M3FN(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, fp8::to_e4m3fn),
        (Buf::F(s), HostDataMut::F8E5M2(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, fp8::to_e5m2),
        (Buf::I(s), HostDataMut::I32(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (Buf::I(s), HostDataMut::I8(d)) => copy_box_map(s, src_shape, src_origin, d, dst_shape, dst_origin, region, |x| x as i8),
        (Buf::B(s), HostDataMut::Bool(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        _ => return false,
    }
    true
}

/// A ref's memory as the kernel sees it: the VMEM/SMEM window (or whole array), row-major
/// in the view shape (squeezed dims have size 1, so dropping them keeps the layout).
struct Mem<'h> {
    view: Vec<usize>,
    buf: Store<'h>,
}

/// State of a blocked operand: its whole array (the caller's) and the block currently in
/// its window.
struct Blocked<'h> {
    r: RefId,
    array: Store<'h>,
    current: Option<Vec<usize>>,
}

/// `'h` is the lifetime of the borrowed operand memory.
struct Machine<'k, 'h> {
    k: &'k Kernel,
    vals: Vec<Option<Rc<Val>>>,
    /// Per ref; `None` for ANY/HBM refs, which the body cannot load or store.
    mems: Vec<Option<Mem<'h>>>,
    blocked: Vec<Blocked<'h>>,
    grid: Vec<usize>,
    stats: RunStats,
    /// Per blocked operand (outputs only): the grid step that first entered each block,
    /// for the `parallel-revisit` check.
    first_visit: Vec<std::collections::HashMap<Vec<usize>, Vec<usize>>>,
    /// The random generator's state in this grid step (`None` until `prng_seed`).
    prng: Option<Prng>,
    /// This machine's logical device id in the mesh (0 when run alone).
    device: usize,
    /// Where the current grid step is: the blocks being run, innermost last. A wait that
    /// cannot complete yet leaves them as they are, so the step resumes there.
    frames: Vec<Frame>,
    /// The run-time grid extents, the number of steps, and the next step to start.
    extents: Vec<usize>,
    steps: usize,
    step: usize,
    /// Instructions executed so far: the scheduler's measure of progress.
    executed: u64,
}

/// A block being run: its next instruction, and what its yield goes to.
struct Frame {
    block: BlockId,
    pc: usize,
    owner: Owner,
}

enum Owner {
    /// The kernel body of a grid step.
    Step,
    /// A branch of this `If`.
    If(InstId),
    /// An iteration `i` of this `For`, up to `hi`.
    For { inst: InstId, i: i64, hi: i64, step: i64 },
}

/// How far [`Machine::run`] got.
enum Flow {
    /// The kernel ended on this device.
    Done,
    /// A wait that cannot complete until another device acts.
    Blocked(devices::Blocked),
}

fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Calls `f` with every index of `shape` in row-major order (once with `[]` for rank 0).
fn for_each_index(shape: &[usize], mut f: impl FnMut(&[usize])) {
    if shape.contains(&0) {
        return;
    }
    let mut idx = vec![0; shape.len()];
    loop {
        f(&idx);
        if !next_index(&mut idx, shape) {
            return;
        }
    }
}

/// Steps `idx` to the next index of `shape` in row-major order; `false` (and `idx` back
/// at all zeros) after the last one. Shared with the compiled backends' window copies.
#[inline]
pub fn next_index(idx: &mut [usize], shape: &[usize]) -> bool {
    for d in (0..idx.len()).rev() {
        idx[d] += 1;
        if idx[d] < shape[d] {
            return true;
        }
        idx[d] = 0;
    }
    false
}

/// Copies the `region` box at `src_origin` of a row-major `src_shape` array to
/// `dst_origin` of a row-major `dst_shape` array, one contiguous row at a time. All
/// shapes have the same rank; the caller guarantees the box fits in both.
fn copy_box<T: Copy>(src: &[T], src_shape: &[usize], src_origin: &[usize], dst: &mut [T], dst_shape: &[usize], dst_origin: &[usize], region: &[usize]) {
    copy_box_rows(src, src_shape, src_origin, dst, dst_shape, dst_origin, region, |s, d| d.copy_from_slice(s));
}

/// [`copy_box`], converting every element with `f`.
#[allow(clippy::too_many_arguments)]
fn copy_box_map<S: Copy, D>(src: &[S], src_shape: &[usize], src_origin: &[usize], dst: &mut [D], dst_shape: &[usize], dst_origin: &[usize], region: &[usize], f: impl Fn(S) -> D) {
    copy_box_rows(src, src_shape, src_origin, dst, dst_shape, dst_origin, region, |s, d| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s)));
}

/// The loop of [`copy_box`]: calls `row(src_row, dst_row)` on every pair of matching
/// contiguous rows of the box.
#[allow(clippy::too_many_arguments)]
fn copy_box_rows<S, D>(src: &[S], src_shape: &[usize], src_origin: &[usize], dst: &mut [D], dst_shape: &[usize], dst_origin: &[usize], region: &[usize], mut row: impl FnMut(&[S], &mut [D])) {
    let Some((&len, outer)) = region.split_last() else {
        row(&src[..1], &mut dst[..1]);
        return;
    };
    let (ss, ds) = (row_major_strides(src_shape), row_major_strides(dst_shape));
    for_each_index(outer, |idx| {
        let mut so = src_origin[outer.len()];
        let mut dof = dst_origin[outer.len()];
        for (d, &i) in idx.iter().enumerate() {
            so += (src_origin[d] + i) * ss[d];
            dof += (dst_origin[d] + i) * ds[d];
        }
        row(&src[so..so + len], &mut dst[dof..dof + len]);
    });
}

/// [`copy_box`] on interpreter buffers; `false` if their storage classes differ.
fn copy_box_buf(src: &Buf, src_shape: &[usize], src_origin: &[usize], dst: &mut Buf, dst_shape: &[usize], dst_origin: &[usize], region: &[usize]) -> bool {
    match (src, dst) {
        (Buf::F(s), Buf::F(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (Buf::I(s), Buf::I(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        (Buf::B(s), Buf::B(d)) => copy_box(s, src_shape, src_origin, d, dst_shape, dst_origin, region),
        _ => return false,
    }
    true
}

fn map<T: Copy, U>(v: &[T], f: impl Fn(T) -> U) -> Vec<U> {
    v.iter().map(|&x| f(x)).collect()
}

fn zip_map<T: Copy, U>(a: &[T], b: &[T], f: impl Fn(T, T) -> U) -> Vec<U> {
    a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
}

/// NaN-propagating max/min (`jnp.maximum`, IEEE 754-2019 `maximum`/`minimum`): if either
/// side is NaN the result is NaN, and `-0 < +0`. So both are commutative and associative,
/// and a reduction's result does not depend on its order.
pub fn fmax(x: f32, y: f32) -> f32 {
    if x > y {
        x
    } else if y > x {
        y
    } else if x == y {
        // Equal: only the signs of two zeros can differ; +0 wins.
        if x.is_sign_negative() { y } else { x }
    } else {
        f32::NAN
    }
}

pub fn fmin(x: f32, y: f32) -> f32 {
    if x < y {
        x
    } else if y < x {
        y
    } else if x == y {
        // Equal: only the signs of two zeros can differ; -0 wins.
        if x.is_sign_negative() { x } else { y }
    } else {
        f32::NAN
    }
}

/// `jnp.sign`: -1, 0 or 1; both zeros give +0 and NaN stays NaN.
pub fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else if x == 0.0 {
        0.0
    } else {
        x
    }
}

/// A shift of a `bits`-wide integer held sign-extended in an i32, with XLA's meaning for
/// an amount outside `0..bits`: 0 for `shl` and `shr_logical`, the sign fill for `shr`.
pub fn shift(op: BinaryOp, x: i32, n: i32, bits: u32) -> i32 {
    let in_range = (n as u32) < bits;
    let mask = if bits >= 32 { u32::MAX } else { (1u32 << bits) - 1 };
    match op {
        BinaryOp::Shl if in_range => ((x as u32) << n) as i32,
        BinaryOp::Shr if in_range => x >> n,
        BinaryOp::Shr => x >> 31,
        BinaryOp::ShrLogical if in_range => ((x as u32 & mask) >> n) as i32,
        _ => 0,
    }
}

/// f64 evaluation rounded once to f32.
fn via_f64(x: f32, f: impl Fn(f64) -> f64) -> f32 {
    f(x as f64) as f32
}

fn broadcast<T: Copy>(src: &[T], src_shape: &[usize], dst_shape: &[usize]) -> Option<Vec<T>> {
    let n: usize = dst_shape.iter().product();
    if src.len() == 1 {
        return Some(vec![src[0]; n]);
    }
    if src_shape.len() != dst_shape.len() || src_shape.iter().zip(dst_shape).any(|(&s, &d)| s != d && s != 1) {
        return None;
    }
    let Some((&row, outer)) = dst_shape.split_last() else { return Some(src.to_vec()) };
    let mut strides = row_major_strides(src_shape);
    for (st, (&s, &d)) in strides.iter_mut().zip(src_shape.iter().zip(dst_shape)) {
        if s == 1 && d != 1 {
            *st = 0;
        }
    }
    let row_stride = strides[outer.len()];
    let mut out = Vec::with_capacity(n);
    for_each_index(outer, |idx| {
        let off: usize = idx.iter().zip(&strides).map(|(i, s)| i * s).sum();
        if row_stride == 0 {
            out.extend(std::iter::repeat_n(src[off], row));
        } else {
            out.extend_from_slice(&src[off..off + row]);
        }
    });
    Some(out)
}

/// Calls `f(memory origin, box origin, region)` once per contiguous piece of a strided
/// access: the whole box when every stride is 1, else one piece per position along the
/// strided dims (region 1 there), the memory origin stepped by the stride.
fn for_each_strided_row(origin: &[usize], lens: &[usize], strides: &[usize], mut f: impl FnMut(&[usize], &[usize], &[usize])) {
    if strides.iter().all(|&s| s == 1) {
        f(origin, &vec![0; lens.len()], lens);
        return;
    }
    let outer: Vec<usize> = lens.iter().zip(strides).map(|(&l, &s)| if s == 1 { 1 } else { l }).collect();
    let region: Vec<usize> = lens.iter().zip(strides).map(|(&l, &s)| if s == 1 { l } else { 1 }).collect();
    let mut idx = vec![0; lens.len()];
    loop {
        let mem: Vec<usize> = origin.iter().zip(&idx).zip(strides).map(|((&o, &i), &s)| o + i * s).collect();
        f(&mem, &idx, &region);
        if !next_index(&mut idx, &outer) {
            break;
        }
    }
}

/// Inclusive prefix sums of `v` (row-major `shape`) along `axis`, added in f32 in index
/// order; `bf16` rounds each output (not the running sum) to bf16.
fn cumsum_f32(v: &[f32], shape: &[usize], axis: usize, bf16_out: bool) -> Vec<f32> {
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0.0f32;
            for j in 0..n {
                let at = (o * n + j) * inner + i;
                acc += v[at];
                out[at] = if bf16_out { round_bf16(acc) } else { acc };
            }
        }
    }
    out
}

/// Inclusive prefix sums of i32 values along `axis`, wrapping.
fn cumsum_i32(v: &[i32], shape: &[usize], axis: usize) -> Vec<i32> {
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out = vec![0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0i32;
            for j in 0..n {
                let at = (o * n + j) * inner + i;
                acc = acc.wrapping_add(v[at]);
                out[at] = acc;
            }
        }
    }
    out
}

/// The CPU backends' random generator (`prng_seed` / `prng_random_bits`): counter-based,
/// SplitMix64. Seeding folds each seed (as u32) into a 64-bit key,
/// `key = mix(key ^ seed)` from `key = 0x9E37_79B9_7F4A_7C15`, and resets the counter;
/// element `i` of a draw is the high 32 bits of `mix(key + (counter + i + 1) * 0x9E37_79B9_7F4A_7C15)`, and the
/// counter then advances by the element count. `mix` is SplitMix64's finaliser. The bits
/// of a TPU's hardware generator differ (as in Pallas' interpret mode): kernels may rely
/// on the distribution, never on the exact bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prng {
    pub key: u64,
    pub counter: u64,
}

const PRNG_GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Prng {
    pub fn seeded(seeds: &[i32]) -> Prng {
        let key = seeds.iter().fold(PRNG_GOLDEN, |k, &s| splitmix_mix(k ^ (s as u32 as u64)));
        Prng { key, counter: 0 }
    }

    /// The next `n` words (as i32 bit patterns), in row-major order of the drawn vector.
    pub fn draw(&mut self, n: usize) -> Vec<i32> {
        let out = (0..n as u64).map(|i| (splitmix_mix(self.key.wrapping_add(self.counter.wrapping_add(i + 1).wrapping_mul(PRNG_GOLDEN))) >> 32) as u32 as i32).collect();
        self.counter = self.counter.wrapping_add(n as u64);
        out
    }
}

/// Reduces `v` (row-major `shape`) along `axis` with `f`, keeping the axis as size 1.
/// The caller guarantees every dim is non-zero.
fn reduce<T: Copy>(v: &[T], shape: &[usize], axis: usize, f: impl Fn(T, T) -> T) -> Vec<T> {
    let outer: usize = shape[..axis].iter().product();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        let base = o * n * inner;
        if inner == 1 {
            // Reducing the minor axis: fold a contiguous row.
            let row = &v[base..base + n];
            out.push(row[1..].iter().fold(row[0], |a, &b| f(a, b)));
            continue;
        }
        let start = out.len();
        out.extend_from_slice(&v[base..base + inner]);
        for k in 1..n {
            let row = &v[base + k * inner..base + (k + 1) * inner];
            out[start..].iter_mut().zip(row).for_each(|(a, &b)| *a = f(*a, b));
        }
    }
    out
}

/// The elements of one float `sum` (`n` of them, the `k`-th at `at(k)`) added in the order
/// the module docs define: chunks of [`SUM_CHUNK`] elements, each summed in 8 interleaved
/// lanes combined by a fixed tree plus its remainder in order, then the chunk sums combined
/// pairwise. Every CPU backend adds in exactly this order, so sums are bit-identical.
pub fn pairwise_sum(n: usize, at: impl Fn(usize) -> f32) -> f32 {
    let chunk_sum = |start: usize, len: usize| -> f32 {
        if len < 8 {
            return (1..len).fold(at(start), |a, k| a + at(start + k));
        }
        let mut r = [0f32; 8];
        for (j, r) in r.iter_mut().enumerate() {
            *r = at(start + j);
        }
        let full = len - len % 8;
        for t in (8..full).step_by(8) {
            for (j, r) in r.iter_mut().enumerate() {
                *r += at(start + t + j);
            }
        }
        let mut s = ((r[0] + r[4]) + (r[2] + r[6])) + ((r[1] + r[5]) + (r[3] + r[7]));
        for k in full..len {
            s += at(start + k);
        }
        s
    };
    let chunks = n.div_ceil(SUM_CHUNK);
    // Up to 64 chunks (n <= 8192) on the stack.
    let mut small = [0f32; 64];
    let mut large = Vec::new();
    let sums: &mut [f32] = if chunks <= small.len() {
        &mut small[..chunks]
    } else {
        large.resize(chunks, 0.0);
        &mut large
    };
    for (c, s) in sums.iter_mut().enumerate() {
        *s = chunk_sum(c * SUM_CHUNK, SUM_CHUNK.min(n - c * SUM_CHUNK));
    }
    let mut count = sums.len();
    while count > 1 {
        for i in 0..count / 2 {
            sums[i] = sums[2 * i] + sums[2 * i + 1];
        }
        if count % 2 == 1 {
            sums[count / 2] = sums[count - 1];
        }
        count = count.div_ceil(2);
    }
    sums[0]
}

/// The chunk length of [`pairwise_sum`].
pub const SUM_CHUNK: usize = 128;

/// A float `sum` along `axis` of `v` (row-major `shape`), keeping the axis as size 1, in
/// [`pairwise_sum`]'s order.
fn reduce_sum_f32(v: &[f32], shape: &[usize], axis: usize) -> Vec<f32> {
    let outer: usize = shape[..axis].iter().product();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            out.push(pairwise_sum(n, |k| v[base + k * inner]));
        }
    }
    out
}

/// Swaps the last two dims of a rank >= 2 row-major array.
/// Row-major `parts` (each with its shape) joined along `axis`: for every index of the
/// dims before `axis`, each part's contiguous run in turn.
fn concat<T: Copy>(parts: &[(&[T], &[usize])], axis: usize) -> Vec<T> {
    let outer: usize = parts[0].1[..axis].iter().product();
    let mut out = Vec::with_capacity(parts.iter().map(|(v, _)| v.len()).sum());
    for o in 0..outer {
        for (v, shape) in parts {
            let run: usize = shape[axis..].iter().product();
            out.extend_from_slice(&v[o * run..(o + 1) * run]);
        }
    }
    out
}

fn transpose<T: Copy>(v: &[T], shape: &[usize]) -> Vec<T> {
    let r = shape.len();
    let (rows, cols) = (shape[r - 2], shape[r - 1]);
    if rows * cols == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(v.len());
    for m in v.chunks_exact(rows * cols) {
        for c in 0..cols {
            out.extend((0..rows).map(|i| m[i * cols + c]));
        }
    }
    out
}

fn iota(shape: &[usize], dim: usize) -> Vec<i32> {
    let outer: usize = shape[..dim].iter().product();
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * n * inner);
    for _ in 0..outer {
        for i in 0..n {
            out.extend(std::iter::repeat_n(i as i32, inner));
        }
    }
    out
}

/// `[m, k] x [k, n]` in wrapping i32; `a(i, p)` and `b(p, j)` index the logical operands.
fn dot_i32(m: usize, k: usize, n: usize, a: impl Fn(usize, usize) -> i32, b: &[i32], b_row: usize, b_col: usize) -> Vec<i32> {
    let mut c = vec![0i32; m * n];
    for i in 0..m {
        let crow = &mut c[i * n..(i + 1) * n];
        for p in 0..k {
            let x = a(i, p);
            for (j, acc) in crow.iter_mut().enumerate() {
                *acc = acc.wrapping_add(x.wrapping_mul(b[p * b_row + j * b_col]));
            }
        }
    }
    c
}

// ---- the machine --------------------------------------------------------------------------

impl<'k, 'h> Machine<'k, 'h> {
    fn err(&self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        KernelError::new(&self.k.name, subject, rule, message, help)
    }

    /// An IR inconsistency the builder would not produce (wrong types, missing values).
    fn malformed(&self, d: &InstData, message: impl Into<String>) -> KernelError {
        self.err(format!("instruction `{}`", d.inst.name()), "malformed-ir", message, "build kernels with KernelBuilder, which type-checks every op").at(d.loc.clone())
    }

    /// Checks the operands against the kernel, poisons the outputs and sets up the memory
    /// of every ref (borrowing the operands, allocating windows and scratch).
    fn new(k: &'k Kernel, inputs: &[HostRef<'h>], outputs: &'h mut [HostMut<'_>], state: OutputState) -> Result<Self> {
        let mut m = Machine {
            k,
            vals: vec![None; k.values.len()],
            mems: Vec::with_capacity(k.refs.len()),
            blocked: Vec::new(),
            grid: vec![0; k.grid.len()],
            stats: RunStats::default(),
            first_visit: Vec::new(),
            prng: None,
            device: 0,
            frames: Vec::new(),
            extents: Vec::new(),
            steps: 0,
            step: 0,
            executed: 0,
        };
        // Check everything before writing anything.
        let expected = inputs_of(k).count();
        if inputs.len() != expected {
            let names: Vec<&str> = inputs_of(k).map(|r| r.name.as_str()).collect();
            return Err(m.err("arguments", "argument-count", format!("{} arguments given, the kernel takes {expected} ({})", inputs.len(), names.join(", ")), "pass the prefetch and input operands in signature order"));
        }
        let expected = outputs_of(k).count();
        if outputs.len() != expected {
            let names: Vec<&str> = outputs_of(k).map(|r| r.name.as_str()).collect();
            return Err(m.err("outputs", "output-count", format!("{} outputs given, the kernel has {expected} ({})", outputs.len(), names.join(", ")), "pass one output buffer per output operand, in signature order"));
        }
        let (mut next_in, mut next_out) = (inputs.iter(), outputs.iter());
        for decl in &k.refs {
            let subject = format!("{} `{}`", decl.kind.name(), decl.name);
            m.check_block_spec(decl, &subject)?;
            if decl.block.is_some() && matches!(decl.kind, RefKind::Prefetch | RefKind::Scratch) {
                return Err(m.err(&subject, "blocked-memory-space", format!("a {} with a block spec", decl.kind.name()), "scalar prefetch and scratch buffers are seen whole; drop the block spec"));
            }
            match decl.kind {
                RefKind::Prefetch | RefKind::Input => {
                    let a = next_in.next().expect("input count checked above");
                    m.check_operand(decl, &subject, a.shape, a.data.dtype(), a.data.len())?;
                }
                RefKind::Output => {
                    let o = next_out.next().expect("output count checked above");
                    m.check_operand(decl, &subject, o.shape, o.data.dtype(), o.data.len())?;
                }
                RefKind::Scratch => {}
            }
        }
        // Output memory is uninitialised on a TPU: poison it (a write, not a copy).
        if state == OutputState::Unknown {
            outputs.iter_mut().for_each(|o| o.data.fill_poison());
        }
        let mut next_in = inputs.iter();
        let mut next_out = outputs.iter_mut().map(|o| o.data.reborrow_mut());
        for (i, decl) in k.refs.iter().enumerate() {
            let n: usize = decl.shape.iter().product();
            let array = match decl.kind {
                RefKind::Prefetch | RefKind::Input => Store::In(next_in.next().expect("input count checked above").data),
                RefKind::Output => Store::Out(next_out.next().expect("output count checked above")),
                RefKind::Scratch => Store::Buf(Buf::poison(decl.dtype, n)),
            };
            let mem = match &decl.block {
                Some(b) => {
                    let window: usize = b.window().iter().product();
                    m.blocked.push(Blocked { r: RefId(i as u32), array, current: None });
                    Some(Mem { view: b.view(), buf: Store::Buf(Buf::poison(decl.dtype, window)) })
                }
                None if decl.memory == MemorySpace::Any => {
                    // The body cannot touch it; an ANY output keeps its poison.
                    m.blocked.push(Blocked { r: RefId(i as u32), array, current: None });
                    None
                }
                None => Some(Mem { view: decl.shape.clone(), buf: array }),
            };
            m.mems.push(mem);
        }
        Ok(m)
    }

    /// Checks one operand's dtype, shape and data length against its declaration.
    fn check_operand(&self, decl: &RefDecl, subject: &str, shape: &[usize], dtype: DType, len: usize) -> Result<()> {
        let (role, rule_dtype, rule_shape) = if decl.kind == RefKind::Output { ("output", "output-dtype", "output-shape") } else { ("argument", "argument-dtype", "argument-shape") };
        if dtype != decl.dtype {
            return Err(self.err(subject, rule_dtype, format!("expected {} elements, got {dtype} data", decl.dtype), format!("pass a {} {role}", decl.dtype)));
        }
        if shape != decl.shape.as_slice() {
            return Err(self.err(subject, rule_shape, format!("expected shape {:?}, got {shape:?}", decl.shape), format!("pass an {role} of shape {:?} or rebuild the kernel for this shape", decl.shape)));
        }
        let n: usize = decl.shape.iter().product();
        if len != n {
            return Err(self.err(subject, rule_shape, format!("shape {shape:?} has {n} elements but the data holds {len}"), "make the data length match the shape"));
        }
        Ok(())
    }

    /// The checks the grid loop relies on to index safely (the verifier checks more).
    fn check_block_spec(&self, decl: &RefDecl, subject: &str) -> Result<()> {
        let Some(b) = &decl.block else { return Ok(()) };
        let rank = decl.shape.len();
        if b.block_shape.len() != rank || b.index_map.len() != rank {
            return Err(self.err(
                subject,
                "block-rank",
                format!("block shape has {} dims and the index map {} results, the array {:?} has {rank} dims", b.block_shape.len(), b.index_map.len(), decl.shape),
                "give one block dim and one index-map result per array dim",
            ));
        }
        for (d, (&blk, &full)) in b.block_shape.iter().zip(&decl.shape).enumerate() {
            // A block may be larger than its array dim (libtpu compiles it): the excess is
            // padding, read as poison and dropped on write-back, as for a partial edge block.
            let n = blk.unwrap_or(1);
            if n == 0 {
                return Err(self.err(subject, "block-shape", format!("block dim {d} is 0 (the array dim is {full})"), "use block dims of at least 1"));
            }
        }
        Ok(())
    }

    /// Sets the run-time grid `extents` ([`run_extents`]) the machine walks.
    fn start(&mut self, extents: Vec<usize>) {
        self.steps = extents.iter().product();
        self.extents = extents;
    }

    /// Walks the grid (lexicographic order, last dim fastest) from where it stopped, until
    /// the kernel ends or a wait blocks on something only another device can do.
    fn run(&mut self, fab: &mut Fabric) -> Result<Flow> {
        let k = self.k;
        loop {
            if self.frames.is_empty() {
                if self.step == self.steps {
                    return Ok(Flow::Done);
                }
                if self.step > 0 {
                    for d in (0..self.extents.len()).rev() {
                        self.grid[d] += 1;
                        if self.grid[d] < self.extents[d] {
                            break;
                        }
                        self.grid[d] = 0;
                    }
                }
                self.enter_blocks()?;
                // Each grid step starts unseeded (steps may run on different cores/threads).
                self.prng = None;
                self.frames.push(Frame { block: k.body, pc: 0, owner: Owner::Step });
            }
            if let Flow::Blocked(b) = self.resume(fab)? {
                return Ok(Flow::Blocked(b));
            }
            // The step's body has run.
            self.step += 1;
            self.stats.grid_steps += 1;
            let last = self.step == self.steps;
            let sequential = k.grid.iter().all(|g| g.semantics == crate::types::Semantics::Arbitrary);
            if !sequential || last {
                self.check_no_pending_dma(fab, last)?;
            }
            if last {
                // The end of the grid flushes every output window still resident.
                for i in 0..self.blocked.len() {
                    if k.ref_decl(self.blocked[i].r).kind == RefKind::Output && self.blocked[i].current.is_some() {
                        self.write_back(i);
                    }
                }
            }
        }
    }

    /// Evaluates every blocked operand's index map for the current grid step and moves the
    /// windows whose block changed: inputs are loaded, outputs written back and re-poisoned.
    fn enter_blocks(&mut self) -> Result<()> {
        let k = self.k;
        for i in 0..self.blocked.len() {
            let decl = k.ref_decl(self.blocked[i].r);
            let (Some(spec), RefKind::Input | RefKind::Output) = (&decl.block, decl.kind) else { continue };
            let index = self.block_index(decl, spec)?;
            if decl.kind == RefKind::Output {
                self.check_parallel_revisit(i, decl, &index)?;
            }
            if self.blocked[i].current.as_ref() == Some(&index) {
                continue;
            }
            let r = self.blocked[i].r.index();
            let window = spec.window();
            let origin: Vec<usize> = index.iter().zip(&window).map(|(b, w)| b * w).collect();
            let region: Vec<usize> = origin.iter().zip(&window).zip(&decl.shape).map(|((o, w), full)| (*w).min(full - o)).collect();
            if decl.kind == RefKind::Output && self.blocked[i].current.is_some() {
                self.write_back(i);
            }
            let win = self.mems[r].as_mut().and_then(|m| m.buf.buf_mut()).expect("blocked operands have a window buffer");
            if decl.kind == RefKind::Input {
                if region != window {
                    win.fill_poison(decl.dtype); // the padding of a partial edge block
                }
                // Straight from the caller's array; the operand checks made the classes match.
                self.blocked[i].array.read_box(&decl.shape, &origin, win, &window, &vec![0; window.len()], &region);
                self.stats.block_loads += 1;
            } else {
                // Output buffers are uninitialised on a TPU: never load the array.
                win.fill_poison(decl.dtype);
            }
            self.blocked[i].current = Some(index);
        }
        Ok(())
    }

    /// `parallel-revisit`: an output block entered by two grid steps that differ in a
    /// `parallel` dim. Such steps may run on different cores (or threads, in the compiled
    /// CPU backends), so both would write the block: a race.
    fn check_parallel_revisit(&mut self, i: usize, decl: &RefDecl, index: &[usize]) -> Result<()> {
        if self.first_visit.len() <= i {
            self.first_visit.resize_with(self.blocked.len(), Default::default);
        }
        let first = self.first_visit[i].entry(index.to_vec()).or_insert_with(|| self.grid.clone());
        let Some(d) = (0..self.grid.len()).find(|&d| self.k.grid[d].semantics == crate::types::Semantics::Parallel && first[d] != self.grid[d]) else { return Ok(()) };
        let first = first.clone();
        Err(parallel_revisit(self.k, decl, index, &first, &self.grid, d))
    }

    /// Copies output window `i` (the part inside the array) back to its array.
    fn write_back(&mut self, i: usize) {
        let b = &mut self.blocked[i];
        let (Some(index), Some(Mem { buf: Store::Buf(win), .. })) = (&b.current, &self.mems[b.r.index()]) else { return };
        let decl = self.k.ref_decl(b.r);
        let Some(spec) = &decl.block else { return };
        let window = spec.window();
        let origin: Vec<usize> = index.iter().zip(&window).map(|(b, w)| b * w).collect();
        let region: Vec<usize> = origin.iter().zip(&window).zip(&decl.shape).map(|((o, w), full)| (*w).min(full - o)).collect();
        // Only outputs are written back, and the operand checks made the classes match.
        let _ = b.array.write_box(&decl.shape, &origin, win, &window, &vec![0; window.len()], &region);
        self.stats.block_writebacks += 1;
    }

    /// The block index of `decl` at the current grid step, checked against the array.
    fn block_index(&self, decl: &RefDecl, spec: &BlockSpec) -> Result<Vec<usize>> {
        let subject = format!("{} `{}`", decl.kind.name(), decl.name);
        let grid: Vec<i64> = self.grid.iter().map(|&g| g as i64).collect();
        let mut index = Vec::with_capacity(spec.index_map.len());
        for e in &spec.index_map {
            let mut prefetch_err = None;
            let v = eval_index(e, &grid, &mut |array, at| match self.read_prefetch(array, at) {
                Ok(v) => Some(v),
                Err(msg) => {
                    prefetch_err.get_or_insert(msg);
                    None
                }
            });
            match (v, prefetch_err) {
                (Some(v), _) => index.push(v),
                (None, Some(msg)) => {
                    return Err(self.err(&subject, "prefetch-out-of-bounds", format!("at grid step {:?} the index map {msg}", self.grid), "keep the values that index scalar-prefetch arrays inside them"));
                }
                (None, None) => {
                    return Err(self.err(&subject, "index-map-eval", format!("at grid step {:?} the index map `{e}` divides by zero or reads a grid index the grid does not have", self.grid), "fix the index map"));
                }
            }
        }
        let window = spec.window();
        let mut out = Vec::with_capacity(index.len());
        for (d, &i) in index.iter().enumerate() {
            let blocks = decl.shape[d].div_ceil(window[d]);
            if i < 0 || i as usize >= blocks {
                return Err(self.err(
                    &subject,
                    "index-out-of-bounds",
                    format!("at grid step {:?} the index map gives block index {index:?}, but dim {d} has {blocks} blocks (array dim {} / block dim {})", self.grid, decl.shape[d], window[d]),
                    "fix the index map, the grid or the scalar-prefetch values so block indices stay below the number of blocks",
                ));
            }
            out.push(i as usize);
        }
        Ok(out)
    }

    fn read_prefetch(&self, array: RefId, at: &[i64]) -> std::result::Result<i64, String> {
        let decl = self.k.refs.get(array.index()).ok_or_else(|| format!("reads {array}, which does not exist"))?;
        let Some(Mem { buf: data, .. }) = self.mems[array.index()].as_ref().filter(|m| decl.kind == RefKind::Prefetch && m.buf.kind() == "integer") else {
            return Err(format!("reads `{}`, which is not a scalar-prefetch operand", decl.name));
        };
        let inside = at.len() == decl.shape.len() && at.iter().zip(&decl.shape).all(|(&i, &n)| i >= 0 && (i as usize) < n);
        if !inside {
            return Err(format!("reads `{}`{at:?}, outside its shape {:?}", decl.name, decl.shape));
        }
        let flat: usize = at.iter().zip(row_major_strides(&decl.shape)).map(|(&i, s)| i as usize * s).sum();
        data.int_at(flat).map(i64::from).ok_or_else(|| format!("reads `{}`{at:?}, outside its data", decl.name))
    }

    // ---- body --------------------------------------------------------------------------

    fn get(&self, v: Value, d: &InstData) -> Result<Rc<Val>> {
        self.vals.get(v.index()).cloned().flatten().ok_or_else(|| self.malformed(d, format!("reads {v} before it is defined")))
    }

    fn bind(&mut self, v: Value, val: Rc<Val>, d: &InstData) -> Result<()> {
        let ty = &self.k.ty(v);
        if val.buf.len() != ty.num_elements() {
            return Err(self.malformed(d, format!("{v} has type {ty} but the op produced {} elements", val.buf.len())));
        }
        self.vals[v.index()] = Some(val);
        Ok(())
    }

    fn scalar_i32(&self, v: Value, d: &InstData) -> Result<i32> {
        match &self.get(v, d)?.buf {
            Buf::I(x) if x.len() == 1 => Ok(x[0]),
            _ => Err(self.malformed(d, format!("{v} should be an i32 scalar"))),
        }
    }

    fn scalar_bool(&self, v: Value, d: &InstData) -> Result<bool> {
        match &self.get(v, d)?.buf {
            Buf::B(x) if x.len() == 1 => Ok(x[0]),
            _ => Err(self.malformed(d, format!("{v} should be a bool scalar"))),
        }
    }

    /// Runs the current grid step's frames until the step's body ends (`Done`) or a wait
    /// blocks; a blocked wait is retried from the same instruction on the next call.
    fn resume(&mut self, fab: &mut Fabric) -> Result<Flow> {
        let k = self.k;
        while let Some(top) = self.frames.last() {
            let Some(&i) = k.block(top.block).insts.get(top.pc) else {
                // A block that ends without `Yield` (the kernel body) yields nothing.
                self.end_frame(Vec::new())?;
                continue;
            };
            let d = k.inst(i);
            let pc = top.pc;
            self.frames.last_mut().expect("a frame is running").pc = pc + 1;
            self.executed += 1;
            match &d.inst {
                Inst::Yield(vs) => {
                    let vals = vs.iter().map(|&v| self.get(v, d)).collect::<Result<Vec<_>>>()?;
                    self.end_frame(vals)?;
                }
                Inst::Store { dst, slices, value } => self.store(d, fab, *dst, slices, *value)?,
                Inst::PrngSeed(seeds) => {
                    let seeds: Vec<i32> = seeds.iter().map(|&v| self.scalar_i32(v, d)).collect::<Result<_>>()?;
                    self.prng = Some(Prng::seeded(&seeds));
                }
                Inst::PrngRandomBits => {
                    let &[result] = d.results.as_slice() else { return Err(self.malformed(d, "expected exactly one result")) };
                    let shape = k.ty(result).shape.clone();
                    let Some(prng) = self.prng.as_mut() else {
                        return Err(self
                            .err(
                                "instruction `prng_random_bits`",
                                "prng-unseeded",
                                format!("at grid step {:?} random bits are drawn before any prng_seed in this grid step", self.grid),
                                "seed the generator at the start of every grid step, e.g. prng_seed(seed, program_id(0)); each step starts unseeded (steps may run on different cores)",
                            )
                            .at(d.loc.clone()));
                    };
                    let bits = prng.draw(shape.iter().product());
                    self.bind(result, Rc::new(Val { shape, buf: Buf::I(bits) }), d)?;
                }
                Inst::DmaStart { src, dst, sem, sem_index, remote } => self.dma_start(d, fab, src, dst, *sem, *sem_index, remote.as_ref())?,
                Inst::DmaWait { src, dst, sem, sem_index, remote } => {
                    if let Some(b) = self.dma_wait(d, fab, src, dst, *sem, *sem_index, remote.as_ref())? {
                        return self.block_at(pc, b);
                    }
                }
                Inst::SemSignal { sem, amount, device } => self.sem_signal(d, fab, sem, *amount, *device)?,
                Inst::SemWait { sem, amount } => {
                    if let Some(b) = self.sem_wait(d, fab, sem, *amount)? {
                        return self.block_at(pc, b);
                    }
                }
                Inst::If { cond, then_block, else_block } => {
                    let taken = if self.scalar_bool(*cond, d)? { *then_block } else { *else_block };
                    self.frames.push(Frame { block: taken, pc: 0, owner: Owner::If(i) });
                }
                Inst::For { lo, hi, step, init, body } => {
                    if *step <= 0 {
                        return Err(self.err("`for` loop", "loop-step", format!("step {step}"), "use a positive step").at(d.loc.clone()));
                    }
                    let (lo, hi) = (self.scalar_i32(*lo, d)? as i64, self.scalar_i32(*hi, d)? as i64);
                    let carries: Vec<Rc<Val>> = init.iter().map(|&v| self.get(v, d)).collect::<Result<_>>()?;
                    if k.block(*body).params.len() != carries.len() + 1 {
                        return Err(self.malformed(d, format!("the body takes {} parameters for {} carries", k.block(*body).params.len(), carries.len())));
                    }
                    if lo < hi {
                        self.enter_iteration(d, *body, lo, carries)?;
                        self.frames.push(Frame { block: *body, pc: 0, owner: Owner::For { inst: i, i: lo, hi, step: *step } });
                    } else {
                        self.bind_all(d, carries)?;
                    }
                }
                _ => {
                    if let Inst::Load { src, slices } = &d.inst {
                        if fab.has_remote() {
                            let (origin, lens) = self.slice_box(d, "load", *src, slices)?;
                            fab.check_access(self, d, "load", *src, &origin, &lens)?;
                        }
                    }
                    let &[result] = d.results.as_slice() else { return Err(self.malformed(d, "expected exactly one result")) };
                    let ty = k.ty(result);
                    let mut val = self.eval(d, ty)?;
                    val.buf.normalize(ty.dtype);
                    self.bind(result, Rc::new(val), d)?;
                }
            }
        }
        Ok(Flow::Done)
    }

    /// Leaves the wait at `pc` to run again when the machine resumes.
    fn block_at(&mut self, pc: usize, b: devices::Blocked) -> Result<Flow> {
        self.frames.last_mut().expect("a frame is running").pc = pc;
        self.executed -= 1;
        Ok(Flow::Blocked(b))
    }

    /// Binds a loop body's induction variable and carries.
    fn enter_iteration(&mut self, d: &InstData, body: BlockId, i: i64, carries: Vec<Rc<Val>>) -> Result<()> {
        let params = self.k.block(body).params.clone();
        self.bind(params[0], Rc::new(Val { shape: Vec::new(), buf: Buf::I(vec![i as i32]) }), d)?;
        for (&p, c) in params[1..].iter().zip(carries) {
            self.bind(p, c, d)?;
        }
        Ok(())
    }

    /// The innermost block yielded `vals`: they go to its owner (an `If`'s results, the next
    /// iteration of a `For` or its results).
    fn end_frame(&mut self, vals: Vec<Rc<Val>>) -> Result<()> {
        let k = self.k;
        let frame = self.frames.pop().expect("a frame is running");
        match frame.owner {
            Owner::Step => Ok(()),
            Owner::If(inst) => self.bind_all(k.inst(inst), vals),
            Owner::For { inst, i, hi, step } => {
                let d = k.inst(inst);
                let params = k.block(frame.block).params.len();
                if vals.len() != params - 1 {
                    return Err(self.malformed(d, format!("the body yields {} values for {} carries", vals.len(), params - 1)));
                }
                let next = i + step;
                if next < hi {
                    self.enter_iteration(d, frame.block, next, vals)?;
                    self.frames.push(Frame { block: frame.block, pc: 0, owner: Owner::For { inst, i: next, hi, step } });
                    Ok(())
                } else {
                    self.bind_all(d, vals)
                }
            }
        }
    }

    fn bind_all(&mut self, d: &InstData, outs: Vec<Rc<Val>>) -> Result<()> {
        if outs.len() != d.results.len() {
            return Err(self.malformed(d, format!("{} values yielded for {} results", outs.len(), d.results.len())));
        }
        for (&r, v) in d.results.iter().zip(outs) {
            self.bind(r, v, d)?;
        }
        Ok(())
    }

    /// Evaluates the dynamic slice starts of an access to `r` and checks them against its
    /// view; returns the box origin and shape.
    fn slice_box(&self, d: &InstData, what: &str, r: RefId, slices: &[Slice]) -> Result<(Vec<usize>, Vec<usize>)> {
        let decl = self.k.refs.get(r.index()).ok_or_else(|| self.malformed(d, format!("{r} does not exist")))?;
        let subject = format!("{what} of {} `{}`", decl.kind.name(), decl.name);
        let Some(mem) = &self.mems[r.index()] else {
            return Err(self
                .err(&subject, "hbm-direct-access", "the operand stays in HBM (memory space ANY) and cannot be loaded or stored directly", "copy it into VMEM scratch with a DMA")
                .at(d.loc.clone()));
        };
        self.eval_box(d, subject, &mem.view, slices)
    }

    /// Evaluates slice starts against `view`; returns the box origin and shape.
    fn eval_box(&self, d: &InstData, subject: String, view: &[usize], slices: &[Slice]) -> Result<(Vec<usize>, Vec<usize>)> {
        if slices.len() != view.len() {
            return Err(self.malformed(d, format!("{} slices for a view of rank {}", slices.len(), view.len())));
        }
        let mut origin = Vec::with_capacity(slices.len());
        for (dim, (s, &extent)) in slices.iter().zip(view).enumerate() {
            let start = self.scalar_i32(s.start, d)? as i64;
            if s.stride == 0 {
                return Err(self.malformed(d, format!("dim {dim}: stride 0")));
            }
            let span = i64::try_from(s.span()).unwrap_or(i64::MAX);
            if start < 0 || start.saturating_add(span) > extent as i64 {
                let elems = if s.stride == 1 { format!("elements {start}..{}", start.saturating_add(span)) } else { format!("{} elements {start}, {}, .., {} (stride {})", s.len, start.saturating_add(s.stride as i64), start.saturating_add(span) - 1, s.stride) };
                return Err(self
                    .err(
                        subject,
                        "slice-out-of-bounds",
                        format!("at grid step {:?}, dim {dim}: {elems} of a block of {extent}", self.grid),
                        "keep dynamic slices inside the block (clamp the start or fix the loop bounds)",
                    )
                    .at(d.loc.clone()));
            }
            origin.push(start as usize);
        }
        Ok((origin, slices.iter().map(|s| s.len).collect()))
    }

    // ---- async copies ----

    /// The memory a DMA side reads or writes: the window / whole array of a VMEM or SMEM
    /// ref, or the HBM array of an ANY operand; with the shape it is laid out in.
    fn dma_mem(&mut self, r: RefId) -> Option<(&mut Store<'h>, Vec<usize>)> {
        if let Some(mem) = self.mems.get_mut(r.index())?.as_mut() {
            return Some((&mut mem.buf, mem.view.clone()));
        }
        let shape = self.k.refs.get(r.index())?.shape.clone();
        let b = self.blocked.iter_mut().find(|b| b.r == r)?;
        Some((&mut b.array, shape))
    }

    fn dma_side_box(&mut self, d: &InstData, side: &str, dr: &DmaRef) -> Result<(Vec<usize>, Vec<usize>)> {
        let decl = self.k.refs.get(dr.r.index()).ok_or_else(|| self.malformed(d, format!("{} does not exist", dr.r)))?;
        let subject = format!("DMA {side} {} `{}`", decl.kind.name(), decl.name);
        let Some((_, view)) = self.dma_mem(dr.r) else { return Err(self.malformed(d, format!("{} has no memory", dr.r))) };
        self.eval_box(d, subject, &view, &dr.slices)
    }

    /// The semaphore `sem[index]`, checked against the array.
    fn semaphore(&self, d: &InstData, sem: RefId, index: Value) -> Result<(RefId, usize)> {
        let decl = self.k.refs.get(sem.index()).ok_or_else(|| self.malformed(d, format!("{sem} does not exist")))?;
        if decl.memory != MemorySpace::Semaphore {
            return Err(self.malformed(d, format!("`{}` is not a semaphore array", decl.name)));
        }
        let i = self.scalar_i32(index, d)?;
        let n: usize = decl.shape.iter().product();
        if i < 0 || i as usize >= n {
            return Err(self
                .err(format!("semaphore `{}`", decl.name), "slice-out-of-bounds", format!("at grid step {:?}: semaphore {i} of an array of {n}", self.grid), "keep semaphore indices inside the array")
                .at(d.loc.clone()));
        }
        Ok((sem, i as usize))
    }

    fn sem_name(&self, sem: (RefId, usize)) -> String {
        format!("`{}[{}]`", self.k.refs[sem.0.index()].name, sem.1)
    }

    /// Writes a copy's data into this machine's `r` at `origin` (a landing).
    fn write_dma(&mut self, r: RefId, origin: &[usize], lens: &[usize], data: &Buf) {
        if let Some((mem, shape)) = self.dma_mem(r) {
            // `dma_start` checked the destination takes a buffer of its dtype.
            let _ = mem.write_box(&shape, origin, data, lens, &vec![0; lens.len()], lens);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn dma_start(&mut self, d: &InstData, fab: &mut Fabric, src: &DmaRef, dst: &DmaRef, sem: RefId, sem_index: Value, remote: Option<&RemoteDma>) -> Result<()> {
        let recv_sem = self.semaphore(d, sem, sem_index)?;
        let (src_origin, src_lens) = self.dma_side_box(d, "source", src)?;
        // Every device runs the same kernel, so the peer's `dst` has this view too.
        let (origin, lens) = self.dma_side_box(d, "destination", dst)?;
        if dma_box(&src_lens) != dma_box(&lens) {
            return Err(self.malformed(d, format!("copying a {src_lens:?} box into a {lens:?} box")));
        }
        let (to, send_sem) = match remote {
            None => (self.device, None),
            Some(r) => (fab.device_id(self, d, r.device)?, Some(self.semaphore(d, r.send_sem, r.send_index)?)),
        };
        let dtype = self.k.refs[dst.r.index()].dtype;
        let count: usize = lens.iter().product();
        let mut data = Buf::poison(dtype, count);
        let (mem, shape) = self.dma_mem(src.r).expect("checked by dma_side_box");
        if !mem.read_box(&shape, &src_origin, &mut data, &src_lens, &vec![0; src_lens.len()], &src_lens) {
            return Err(self.malformed(d, "source and destination dtypes differ"));
        }
        let mut issued = d.loc.as_ref().map_or_else(|| "dma_start".to_string(), |l| format!("dma_start at {l}"));
        if fab.multi {
            issued += &format!(" on device {} at grid step {:?}", self.device, self.grid);
        }
        let t = devices::Transfer {
            from: self.device,
            to,
            remote: remote.is_some(),
            recv_sem,
            send_sem,
            src: devices::Region { r: src.r, origin: src_origin, lens: src_lens },
            dst: devices::Region { r: dst.r, origin, lens },
            data,
            bytes: count * dtype.bytes(),
            issued,
            landed: false,
            recv_done: false,
            send_done: false,
        };
        if t.remote || fab.has_remote() {
            fab.check_start(self, d, &t)?;
        }
        // In flight: the destination holds garbage until the copy lands.
        let poison = Buf::poison(dtype, count);
        if to == self.device {
            let (mem, shape) = self.dma_mem(dst.r).expect("checked by dma_side_box");
            if let Err(e) = mem.write_box(&shape, &t.dst.origin, &poison, &t.dst.lens, &vec![0; t.dst.lens.len()], &t.dst.lens) {
                return Err(self.write_error(d, e, dst.r, "dma-destination", poison.kind()));
            }
        } else {
            fab.write_to(to, &t.dst, poison);
        }
        fab.transfers.push(t);
        Ok(())
    }

    /// A wait for one end of a copy: `Some` if it must wait for another device.
    #[allow(clippy::too_many_arguments)]
    fn dma_wait(&mut self, d: &InstData, fab: &mut Fabric, src: &DmaRef, dst: &DmaRef, sem: RefId, sem_index: Value, remote: Option<&RemoteWait>) -> Result<Option<devices::Blocked>> {
        let sem = self.semaphore(d, sem, sem_index)?;
        let (_, lens) = self.dma_side_box(d, "destination", dst)?;
        self.dma_side_box(d, "source", src)?;
        if let Some(r) = remote {
            fab.device_id(self, d, r.device)?;
        }
        let side = remote.map_or(DmaSide::Recv, |r| r.side);
        let bytes = lens.iter().product::<usize>() * self.k.refs[dst.r.index()].dtype.bytes();
        let Some(pos) = fab.oldest(self.device, side, sem) else {
            // Only this device starts its own sends; a peer may still send to it.
            if side == DmaSide::Recv && fab.multi {
                return Ok(Some(devices::Blocked { what: format!("a copy to land on semaphore {}", self.sem_name(sem)), wait: d.inst.name(), loc: d.loc.clone(), grid: self.grid.clone() }));
            }
            let what = if side == DmaSide::Send { "remote_copy_wait_send finds no remote copy of this device in flight on this send semaphore" } else { "dma_wait finds no copy in flight on this semaphore" };
            return Err(self
                .err(
                    format!("semaphore {}", self.sem_name(sem)),
                    "dma-wait-without-start",
                    format!("at grid step {:?} a {what}", self.grid),
                    "start the copy (dma_start with the same semaphore) before waiting for it; on a TPU this wait would hang",
                )
                .at(d.loc.clone()));
        };
        if fab.transfers[pos].bytes != bytes {
            let p = &fab.transfers[pos];
            return Err(self
                .err(
                    format!("semaphore {}", self.sem_name(sem)),
                    "dma-wait-mismatch",
                    format!("at grid step {:?} the wait describes {bytes} bytes but the oldest copy on this semaphore ({}) moves {}", self.grid, p.issued, p.bytes),
                    "wait with the same descriptor (source, destination, semaphore) the copy was started with",
                )
                .at(d.loc.clone()));
        }
        fab.complete(self, pos, side);
        Ok(None)
    }

    /// `dma-unwaited` if a copy this device started is still in flight at the end of a grid
    /// step or the kernel (a local copy not waited, or a remote copy whose send is not).
    fn check_no_pending_dma(&self, fab: &Fabric, end_of_kernel: bool) -> Result<()> {
        let me = self.device;
        let pending: Vec<&devices::Transfer> = fab.transfers.iter().filter(|t| t.from == me && if t.remote { !t.send_done } else { !t.recv_done }).collect();
        let Some(p) = pending.first() else { return Ok(()) };
        let when = if end_of_kernel { "the kernel ends" } else { "the grid step ends" };
        let why = if end_of_kernel { "" } else { " (copies may stay in flight across grid steps only when every grid dim is `arbitrary`)" };
        let (sem, wait) = match p.send_sem {
            Some(s) if p.remote => (s, "remote_copy_wait_send"),
            _ => (p.recv_sem, "dma_wait"),
        };
        Err(self.err(
            format!("{}semaphore {}", fab.device_prefix(me), self.sem_name(sem)),
            "dma-unwaited",
            format!("{when} at grid step {:?} with {} copy(ies) in flight; the first was issued by {} into `{}`{why}", self.grid, pending.len(), p.issued, self.k.refs[p.dst.r.index()].name),
            format!("wait for every copy you start ({wait} with the same descriptor) before its destination is read and before the step ends"),
        ))
    }

    /// The counting semaphore `sem`, checked.
    fn counting_sem(&self, d: &InstData, sem: &SemaphoreRef) -> Result<devices::SemKey> {
        match sem {
            SemaphoreRef::Barrier => Ok(devices::SemKey::Barrier),
            SemaphoreRef::Array { sem, index } => {
                let decl = self.k.refs.get(sem.index()).ok_or_else(|| self.malformed(d, format!("{sem} does not exist")))?;
                if decl.memory != MemorySpace::RegularSemaphore {
                    return Err(self.malformed(d, format!("`{}` is not a counting semaphore array", decl.name)));
                }
                let i = self.scalar_i32(*index, d)?;
                let n: usize = decl.shape.iter().product();
                if i < 0 || i as usize >= n {
                    return Err(self
                        .err(format!("semaphore `{}`", decl.name), "slice-out-of-bounds", format!("at grid step {:?}: semaphore {i} of an array of {n}", self.grid), "keep semaphore indices inside the array")
                        .at(d.loc.clone()));
                }
                Ok(devices::SemKey::Array(*sem, i as usize))
            }
        }
    }

    fn sem_amount(&self, d: &InstData, amount: Value) -> Result<i64> {
        let a = self.scalar_i32(amount, d)?;
        if a < 0 {
            return Err(self.err(format!("instruction `{}`", d.inst.name()), "semaphore-amount", format!("at grid step {:?} the amount is {a}", self.grid), "signal and wait with amounts of at least 0").at(d.loc.clone()));
        }
        Ok(a as i64)
    }

    fn sem_signal(&mut self, d: &InstData, fab: &mut Fabric, sem: &SemaphoreRef, amount: Value, device: Option<Value>) -> Result<()> {
        let key = self.counting_sem(d, sem)?;
        let amount = self.sem_amount(d, amount)?;
        let to = match device {
            Some(v) => fab.device_id(self, d, v)?,
            None => self.device,
        };
        *fab.counts.entry((to, key)).or_default() += amount;
        Ok(())
    }

    fn sem_wait(&mut self, d: &InstData, fab: &mut Fabric, sem: &SemaphoreRef, amount: Value) -> Result<Option<devices::Blocked>> {
        let key = self.counting_sem(d, sem)?;
        let amount = self.sem_amount(d, amount)?;
        let count = fab.counts.entry((self.device, key)).or_default();
        if *count >= amount {
            *count -= amount;
            return Ok(None);
        }
        let name = key.name(self.k);
        if fab.multi {
            return Ok(Some(devices::Blocked { what: format!("semaphore {name} to reach {amount} (it holds {count})"), wait: d.inst.name(), loc: d.loc.clone(), grid: self.grid.clone() }));
        }
        Err(self
            .err(
                format!("semaphore {name}"),
                "wait-never-satisfied",
                format!("at grid step {:?} the wait needs {amount} and the semaphore holds {count}; no other device runs to signal it", self.grid),
                "signal before waiting, or run the kernel on its mesh (interp::run_devices)",
            )
            .at(d.loc.clone()))
    }

    fn store(&mut self, d: &InstData, fab: &Fabric, dst: RefId, slices: &[Slice], value: Value) -> Result<()> {
        let (origin, lens) = self.slice_box(d, "store", dst, slices)?;
        if fab.has_remote() {
            let span: Vec<usize> = slices.iter().map(Slice::span).collect();
            fab.check_access(self, d, "store", dst, &origin, &span)?;
        }
        let v = self.get(value, d)?;
        if v.buf.len() != lens.iter().product::<usize>() {
            return Err(self.malformed(d, format!("storing {} elements into a slice of shape {lens:?}", v.buf.len())));
        }
        let mem = self.mems[dst.index()].as_mut().expect("slice_box checked the ref is accessible");
        let strides: Vec<usize> = slices.iter().map(|s| s.stride).collect();
        let mut result = Ok(());
        for_each_strided_row(&origin, &lens, &strides, |dst_origin, src_origin, region| {
            if result.is_ok() {
                result = mem.buf.write_box(&mem.view, dst_origin, &v.buf, &lens, src_origin, region);
            }
        });
        match result {
            Ok(()) => Ok(()),
            Err(e) => Err(self.write_error(d, e, dst, "store-to-input", v.buf.kind())),
        }
    }

    /// The error for `d` refusing to write `value_kind` values into `r`: `read_only_rule`
    /// when `r` is an input (the builder rejects such IR), else `malformed-ir`.
    fn write_error(&self, d: &InstData, e: WriteError, r: RefId, read_only_rule: &'static str, value_kind: &str) -> KernelError {
        let decl = &self.k.refs[r.index()];
        match e {
            WriteError::ReadOnly => self
                .err(format!("{} to {} `{}`", d.inst.name(), decl.kind.name(), decl.name), read_only_rule, "inputs are read-only", "write to an output or a scratch buffer")
                .at(d.loc.clone()),
            WriteError::Class => {
                let kind = Buf::poison(decl.dtype, 0).kind();
                self.malformed(d, format!("writing {value_kind} values into the {kind} ref `{}`", decl.name))
            }
        }
    }

    /// Evaluates a single-result instruction whose result has type `ty`.
    fn eval(&self, d: &InstData, ty: &crate::types::Type) -> Result<Val> {
        let shape = ty.shape.clone();
        let n = ty.num_elements();
        let buf = match &d.inst {
            Inst::Const(s) => const_buf(*s, ty.dtype, n),
            Inst::ProgramId(axis) | Inst::NumPrograms(axis) => {
                let Some(g) = self.k.grid.get(*axis) else { return Err(self.malformed(d, format!("grid axis {axis} of a rank-{} grid", self.k.grid.len()))) };
                let v = if matches!(d.inst, Inst::ProgramId(_)) { self.grid[*axis] } else { g.extent };
                Buf::I(vec![v as i32])
            }
            Inst::Load { src, slices } => {
                let (origin, lens) = self.slice_box(d, "load", *src, slices)?;
                let mem = self.mems[src.index()].as_ref().expect("slice_box checked the ref is accessible");
                let mut out = mem.buf.zeros_like(lens.iter().product());
                let strides: Vec<usize> = slices.iter().map(|s| s.stride).collect();
                for_each_strided_row(&origin, &lens, &strides, |src_origin, dst_origin, region| {
                    mem.buf.read_box(&mem.view, src_origin, &mut out, &lens, dst_origin, region);
                });
                out
            }
            Inst::Unary(op, x) => self.unary(d, *op, &*self.get(*x, d)?)?,
            Inst::Binary(op, a, b) => {
                let (a, b) = (self.get(*a, d)?, self.get(*b, d)?);
                if a.buf.len() != b.buf.len() {
                    return Err(self.malformed(d, format!("operand shapes {:?} and {:?} differ", a.shape, b.shape)));
                }
                self.binary(d, *op, &a.buf, &b.buf)?
            }
            Inst::Cmp(op, a, b) => {
                let (a, b) = (self.get(*a, d)?, self.get(*b, d)?);
                if a.buf.len() != b.buf.len() {
                    return Err(self.malformed(d, format!("operand shapes {:?} and {:?} differ", a.shape, b.shape)));
                }
                self.compare(d, *op, &a.buf, &b.buf)?
            }
            Inst::Select { cond, on_true, on_false } => {
                let (c, t, f) = (self.get(*cond, d)?, self.get(*on_true, d)?, self.get(*on_false, d)?);
                let Buf::B(c) = &c.buf else { return Err(self.malformed(d, "the condition is not bool")) };
                if c.len() != t.buf.len() || c.len() != f.buf.len() {
                    return Err(self.malformed(d, "condition and branches have different shapes"));
                }
                match (&t.buf, &f.buf) {
                    (Buf::F(t), Buf::F(f)) => Buf::F(c.iter().zip(t.iter().zip(f)).map(|(&c, (&t, &f))| if c { t } else { f }).collect()),
                    (Buf::I(t), Buf::I(f)) => Buf::I(c.iter().zip(t.iter().zip(f)).map(|(&c, (&t, &f))| if c { t } else { f }).collect()),
                    (Buf::B(t), Buf::B(f)) => Buf::B(c.iter().zip(t.iter().zip(f)).map(|(&c, (&t, &f))| if c { t } else { f }).collect()),
                    _ => return Err(self.malformed(d, "branches have different dtypes")),
                }
            }
            Inst::Cast(x) => cast(&self.get(*x, d)?.buf, ty.dtype),
            Inst::Bitcast(x) => match &self.get(*x, d)?.buf {
                Buf::F(v) => Buf::I(map(v, |x| x.to_bits() as i32)),
                Buf::I(v) => Buf::F(map(v, |x| f32::from_bits(x as u32))),
                Buf::B(_) => return Err(self.malformed(d, "bitcast of a bool")),
            },
            Inst::Broadcast(x) => {
                let x = self.get(*x, d)?;
                let out = match &x.buf {
                    Buf::F(v) => broadcast(v, &x.shape, &shape).map(Buf::F),
                    Buf::I(v) => broadcast(v, &x.shape, &shape).map(Buf::I),
                    Buf::B(v) => broadcast(v, &x.shape, &shape).map(Buf::B),
                };
                out.ok_or_else(|| self.malformed(d, format!("cannot broadcast {:?} to {shape:?}", x.shape)))?
            }
            Inst::Iota { dim } => {
                if *dim >= shape.len() {
                    return Err(self.malformed(d, format!("iota along dim {dim} of {shape:?}")));
                }
                Buf::I(iota(&shape, *dim))
            }
            Inst::Reduce { op, axis, x } => self.reduce(d, *op, *axis, &*self.get(*x, d)?)?,
            Inst::Cumsum { axis, x } => {
                let x = self.get(*x, d)?;
                if *axis >= x.shape.len() || x.shape.contains(&0) {
                    return Err(self.malformed(d, format!("cumsum along axis {axis} of {:?}", x.shape)));
                }
                match &x.buf {
                    Buf::F(v) => Buf::F(cumsum_f32(v, &x.shape, *axis, ty.dtype == DType::BF16)),
                    Buf::I(v) if ty.dtype == DType::I32 => Buf::I(cumsum_i32(v, &x.shape, *axis)),
                    _ => return Err(self.malformed(d, format!("cumsum of {}", ty.dtype))),
                }
            }
            Inst::PrngSeed(_) | Inst::PrngRandomBits => return Err(self.malformed(d, "executed by exec_block")),
            Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs } => self.dot(d, &*self.get(*lhs, d)?, &*self.get(*rhs, d)?, *transpose_lhs, *transpose_rhs)?,
            Inst::Transpose(x) => {
                let x = self.get(*x, d)?;
                if x.shape.len() < 2 {
                    return Err(self.malformed(d, format!("transpose of rank {}", x.shape.len())));
                }
                match &x.buf {
                    Buf::F(v) => Buf::F(transpose(v, &x.shape)),
                    Buf::I(v) => Buf::I(transpose(v, &x.shape)),
                    Buf::B(v) => Buf::B(transpose(v, &x.shape)),
                }
            }
            // Row-major reshape keeps the element order; `bind` checks the count.
            Inst::Reshape(x) => self.get(*x, d)?.buf.clone(),
            // The builder checks that `x` holds one element.
            Inst::Item(x) => self.get(*x, d)?.buf.clone(),
            Inst::Concat { axis, parts } => {
                let parts = parts.iter().map(|p| self.get(*p, d)).collect::<Result<Vec<_>>>()?;
                let mixed = || self.malformed(d, "concat of parts of different kinds");
                match &parts[0].buf {
                    Buf::F(_) => Buf::F(concat(&parts.iter().map(|p| if let Buf::F(v) = &p.buf { Ok((v.as_slice(), p.shape.as_slice())) } else { Err(mixed()) }).collect::<Result<Vec<_>>>()?, *axis)),
                    Buf::I(_) => Buf::I(concat(&parts.iter().map(|p| if let Buf::I(v) = &p.buf { Ok((v.as_slice(), p.shape.as_slice())) } else { Err(mixed()) }).collect::<Result<Vec<_>>>()?, *axis)),
                    Buf::B(_) => Buf::B(concat(&parts.iter().map(|p| if let Buf::B(v) = &p.buf { Ok((v.as_slice(), p.shape.as_slice())) } else { Err(mixed()) }).collect::<Result<Vec<_>>>()?, *axis)),
                }
            }
            Inst::DeviceId => Buf::I(vec![self.device as i32]),
            Inst::Store { .. } | Inst::DmaStart { .. } | Inst::DmaWait { .. } | Inst::SemSignal { .. } | Inst::SemWait { .. } | Inst::If { .. } | Inst::For { .. } | Inst::Yield(_) => {
                return Err(self.malformed(d, "not a single-result op"))
            }
        };
        Ok(Val { shape, buf })
    }

    fn unary(&self, d: &InstData, op: UnaryOp, x: &Val) -> Result<Buf> {
        use UnaryOp::*;
        Ok(match &x.buf {
            Buf::F(v) => Buf::F(match op {
                Neg => map(v, |x| -x),
                Abs => map(v, f32::abs),
                Exp => map(v, |x| via_f64(x, f64::exp)),
                Log => map(v, |x| via_f64(x, f64::ln)),
                Tanh => map(v, |x| via_f64(x, f64::tanh)),
                Erf => map(v, |x| via_f64(x, libm::erf)),
                Sqrt => map(v, |x| via_f64(x, f64::sqrt)),
                Rsqrt => map(v, |x| via_f64(x, |y| 1.0 / y.sqrt())),
                Log1p => map(v, |x| via_f64(x, f64::ln_1p)),
                Expm1 => map(v, |x| via_f64(x, f64::exp_m1)),
                Sin => map(v, |x| via_f64(x, f64::sin)),
                Cos => map(v, |x| via_f64(x, f64::cos)),
                Floor => map(v, f32::floor),
                Ceil => map(v, f32::ceil),
                Round => map(v, f32::round_ties_even),
                Sign => map(v, sign),
                Not => return Err(self.malformed(d, "`not` of a float")),
            }),
            Buf::I(v) => Buf::I(match op {
                Neg => map(v, i32::wrapping_neg),
                Abs => map(v, i32::wrapping_abs),
                Not => map(v, |x| !x),
                _ => return Err(self.malformed(d, format!("`{}` of an integer", op.name()))),
            }),
            Buf::B(v) => match op {
                Not => Buf::B(map(v, |x| !x)),
                _ => return Err(self.malformed(d, format!("`{}` of a bool", op.name()))),
            },
        })
    }

    fn binary(&self, d: &InstData, op: BinaryOp, a: &Buf, b: &Buf) -> Result<Buf> {
        use BinaryOp::*;
        let bad = || self.malformed(d, format!("`{}` is not defined for {} operands", op.name(), a.kind()));
        Ok(match (a, b) {
            (Buf::F(a), Buf::F(b)) => Buf::F(match op {
                Add => zip_map(a, b, |x, y| x + y),
                Sub => zip_map(a, b, |x, y| x - y),
                Mul => zip_map(a, b, |x, y| x * y),
                Div => zip_map(a, b, |x, y| x / y),
                Rem => zip_map(a, b, |x, y| x % y),
                Max => zip_map(a, b, fmax),
                Min => zip_map(a, b, fmin),
                Pow => zip_map(a, b, |x, y| (x as f64).powf(y as f64) as f32),
                And | Or | Xor | Shl | Shr | ShrLogical => return Err(bad()),
            }),
            (Buf::I(a), Buf::I(b)) => Buf::I(match op {
                Add => zip_map(a, b, i32::wrapping_add),
                Sub => zip_map(a, b, i32::wrapping_sub),
                Mul => zip_map(a, b, i32::wrapping_mul),
                Div => zip_map(a, b, |x, y| if y == 0 { 0 } else { x.wrapping_div(y) }),
                Rem => zip_map(a, b, |x, y| if y == 0 { x } else { x.wrapping_rem(y) }),
                Max => zip_map(a, b, i32::max),
                Min => zip_map(a, b, i32::min),
                And => zip_map(a, b, |x, y| x & y),
                Or => zip_map(a, b, |x, y| x | y),
                Xor => zip_map(a, b, |x, y| x ^ y),
                // i8 values are held sign-extended; `normalize` wraps the result back.
                Shl | Shr | ShrLogical => {
                    let bits = d.results.first().map_or(32, |&r| self.k.ty(r).dtype.bits()) as u32;
                    zip_map(a, b, |x, n| shift(op, x, n, bits))
                }
                Pow => return Err(bad()),
            }),
            (Buf::B(a), Buf::B(b)) => Buf::B(match op {
                And => zip_map(a, b, |x, y| x & y),
                Or => zip_map(a, b, |x, y| x | y),
                Xor => zip_map(a, b, |x, y| x ^ y),
                _ => return Err(bad()),
            }),
            _ => return Err(self.malformed(d, format!("operands are {} and {}", a.kind(), b.kind()))),
        })
    }

    fn compare(&self, d: &InstData, op: CmpOp, a: &Buf, b: &Buf) -> Result<Buf> {
        fn cmp<T: Copy + PartialOrd>(op: CmpOp, a: &[T], b: &[T]) -> Vec<bool> {
            match op {
                CmpOp::Eq => zip_map(a, b, |x, y| x == y),
                // IEEE `!=` (Mosaic `cmpf une`): true when either side is NaN, so `x != x` finds NaNs.
                CmpOp::Ne => zip_map(a, b, |x, y| x != y),
                CmpOp::Lt => zip_map(a, b, |x, y| x < y),
                CmpOp::Le => zip_map(a, b, |x, y| x <= y),
                CmpOp::Gt => zip_map(a, b, |x, y| x > y),
                CmpOp::Ge => zip_map(a, b, |x, y| x >= y),
            }
        }
        Ok(Buf::B(match (a, b) {
            (Buf::F(a), Buf::F(b)) => cmp(op, a, b),
            (Buf::I(a), Buf::I(b)) => cmp(op, a, b),
            (Buf::B(a), Buf::B(b)) => cmp(op, a, b),
            _ => return Err(self.malformed(d, format!("operands are {} and {}", a.kind(), b.kind()))),
        }))
    }

    fn reduce(&self, d: &InstData, op: ReduceOp, axis: usize, x: &Val) -> Result<Buf> {
        if axis >= x.shape.len() || x.shape.contains(&0) {
            return Err(self.malformed(d, format!("reduce along axis {axis} of {:?}", x.shape)));
        }
        let s = &x.shape;
        Ok(match (&x.buf, op) {
            (Buf::F(v), ReduceOp::Sum) => Buf::F(reduce_sum_f32(v, s, axis)),
            (Buf::F(v), ReduceOp::Max) => Buf::F(reduce(v, s, axis, fmax)),
            (Buf::F(v), ReduceOp::Min) => Buf::F(reduce(v, s, axis, fmin)),
            (Buf::I(v), ReduceOp::Sum) => Buf::I(reduce(v, s, axis, i32::wrapping_add)),
            (Buf::I(v), ReduceOp::Max) => Buf::I(reduce(v, s, axis, i32::max)),
            (Buf::I(v), ReduceOp::Min) => Buf::I(reduce(v, s, axis, i32::min)),
            // max/min of bools are any/all; a bool sum has no bool result.
            (Buf::B(v), ReduceOp::Max) => Buf::B(reduce(v, s, axis, |a, b| a | b)),
            (Buf::B(v), ReduceOp::Min) => Buf::B(reduce(v, s, axis, |a, b| a & b)),
            (Buf::B(_), ReduceOp::Sum) => return Err(self.malformed(d, "sum of bools; cast to i32 first")),
        })
    }

    fn dot(&self, d: &InstData, a: &Val, b: &Val, ta: bool, tb: bool) -> Result<Buf> {
        let (&[ar, ac], &[br, bc]) = (a.shape.as_slice(), b.shape.as_slice()) else {
            return Err(self.malformed(d, format!("dot of {:?} and {:?}; both must be rank 2", a.shape, b.shape)));
        };
        let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
        let (k2, n) = if tb { (bc, br) } else { (br, bc) };
        if k != k2 {
            return Err(self.malformed(d, format!("contracting dims differ: {:?} x {:?}", a.shape, b.shape)));
        }
        // Row and column strides of the logical (possibly transposed) operands, so that
        // transposes cost nothing.
        let (rsa, csa) = if ta { (1, ac) } else { (ac, 1) };
        let (rsb, csb) = if tb { (1, bc) } else { (bc, 1) };
        Ok(match (&a.buf, &b.buf) {
            (Buf::F(av), Buf::F(bv)) => {
                // What the unsafe call below relies on, checked here rather than trusted from
                // the IR's types (hand-edited IR may lie about them).
                if av.len() != ar * ac || bv.len() != br * bc {
                    return Err(self.malformed(d, format!("dot operands hold {} and {} elements, their types say {:?} and {:?}", av.len(), bv.len(), a.shape, b.shape)));
                }
                let mut c = vec![0.0f32; m * n];
                if m * n > 0 && k > 0 {
                    // SAFETY: `av` holds ar*ac = m*k elements and `bv` br*bc = k*n (checked just
                    // above); with the strides above every (i, p) / (p, j) index stays inside
                    // them, and `c` is m*n row-major.
                    unsafe {
                        matrixmultiply::sgemm(m, k, n, 1.0, av.as_ptr(), rsa as isize, csa as isize, bv.as_ptr(), rsb as isize, csb as isize, 0.0, c.as_mut_ptr(), n as isize, 1);
                    }
                }
                Buf::F(c)
            }
            (Buf::I(av), Buf::I(bv)) => Buf::I(dot_i32(m, k, n, |i, p| av[i * rsa + p * csa], bv, rsb, csb)),
            _ => return Err(self.malformed(d, format!("dot of {} and {} operands", a.buf.kind(), b.buf.kind()))),
        })
    }
}

/// The grid's extents for one run: a dynamic dim's ([`GridDim::dynamic`]) is element 0 of
/// its extent operand, which must lie in `0..=bound`, else `grid-dynamic-extent`. `inputs`
/// are the prefetch and input operands in signature order, already checked against the
/// kernel. Every CPU backend walks these extents, so the steps past a dynamic extent do
/// not run.
pub fn run_extents(k: &Kernel, inputs: &[HostRef<'_>]) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(k.grid.len());
    for (d, g) in k.grid.iter().enumerate() {
        let Some(r) = g.dynamic else {
            out.push(g.extent);
            continue;
        };
        let decl = k.ref_decl(r);
        let subject = format!("{} `{}`", decl.kind.name(), decl.name);
        let at = k.refs[..r.index()].iter().filter(|x| matches!(x.kind, RefKind::Prefetch | RefKind::Input)).count();
        let value = match inputs.get(at).map(|h| h.data) {
            Some(HostData::I32(v)) if !v.is_empty() => v[0] as i64,
            _ => return Err(KernelError::new(&k.name, subject, "grid-dynamic-extent", format!("grid dim {d} reads its extent from `{}`, which holds no int32 element", decl.name), "pass an int32 [1] array")),
        };
        if value < 0 || value as usize > g.extent {
            return Err(KernelError::new(
                &k.name,
                subject,
                "grid-dynamic-extent",
                format!("grid dim {d}'s extent is {value} at run time, outside 0..={} (the static bound it was compiled for)", g.extent),
                format!("pass an extent between 0 and {}, or build the kernel with a larger bound", g.extent),
            ));
        }
        out.push(value as usize);
    }
    Ok(out)
}

/// The `parallel-revisit` error: `decl`'s block `index`, first entered at grid step `first`,
/// entered again at `step`, which differs from it in the `parallel` dim `dim`. Every CPU
/// backend reports this same error.
pub fn parallel_revisit(k: &Kernel, decl: &RefDecl, index: &[usize], first: &[usize], step: &[usize], dim: usize) -> KernelError {
    KernelError::new(
        &k.name,
        format!("output `{}`", decl.name),
        "parallel-revisit",
        format!("grid steps {first:?} and {step:?} both write block {index:?}, but they differ in grid dim {dim}, which is `parallel`: parallel steps may run on different cores, so this is a race"),
        format!("mark grid dim {dim} `arbitrary` (its steps then run in order on one core), or give each of its indices its own output block"),
    )
}

fn const_buf(s: Scalar, dtype: DType, n: usize) -> Buf {
    let as_f64 = match s {
        Scalar::Float(x) => x,
        Scalar::Int(i) => i as f64,
        Scalar::Bool(b) => b as u8 as f64,
    };
    match dtype {
        DType::F32 => Buf::F(vec![as_f64 as f32; n]),
        // Round once from f64, avoiding f64 -> f32 -> bf16 double rounding.
        DType::BF16 => Buf::F(vec![bf16::from_f64(as_f64).to_f32(); n]),
        // f64 -> f32 -> fp8 rounds as f64 -> fp8 would: f32 keeps more than 2 * 4 + 2 bits.
        DType::F8E4M3FN | DType::F8E5M2 => Buf::F(vec![fp8::round(dtype, as_f64 as f32); n]),
        DType::I32 | DType::I8 => {
            let i = match s {
                Scalar::Int(i) => i as i32, // wraps; `normalize` wraps i8
                Scalar::Float(x) => x as i32,
                Scalar::Bool(b) => b as i32,
            };
            Buf::I(vec![i; n])
        }
        DType::Bool => Buf::B(vec![as_f64 != 0.0; n]),
    }
}

/// Converts between storage classes; the caller's `normalize` then rounds to bf16 or
/// wraps to i8.
fn cast(x: &Buf, to: DType) -> Buf {
    match (x, to) {
        (Buf::F(v), DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2) => Buf::F(v.clone()),
        // `as` truncates toward zero, saturates, and maps NaN to 0.
        (Buf::F(v), DType::I32) => Buf::I(map(v, |x| x as i32)),
        (Buf::F(v), DType::I8) => Buf::I(map(v, |x| x as i8 as i32)),
        (Buf::F(v), DType::Bool) => Buf::B(map(v, |x| x != 0.0)),
        (Buf::I(v), DType::F32) => Buf::F(map(v, |x| x as f32)),
        (Buf::I(v), DType::BF16) => Buf::F(map(v, |x| bf16::from_f64(x as f64).to_f32())),
        (Buf::I(v), DType::F8E4M3FN | DType::F8E5M2) => Buf::F(map(v, |x| x as f32)),
        (Buf::I(v), DType::I32 | DType::I8) => Buf::I(v.clone()),
        (Buf::I(v), DType::Bool) => Buf::B(map(v, |x| x != 0)),
        (Buf::B(v), DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2) => Buf::F(map(v, |x| x as u8 as f32)),
        (Buf::B(v), DType::I32 | DType::I8) => Buf::I(map(v, |x| x as i32)),
        (Buf::B(v), DType::Bool) => Buf::B(v.clone()),
    }
}

