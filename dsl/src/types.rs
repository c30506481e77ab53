//! Element types and value types of the block IR.

use std::fmt;

/// Element type of an array, vector or scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    I32,
    I8,
    Bool,
    /// `torch.float8_e4m3fn`: 4 exponent bits (bias 7), 3 mantissa bits, no infinity,
    /// NaN = `S.1111.111`, largest finite 448. A storage type: see [`crate::fp8`].
    F8E4M3FN,
    /// `torch.float8_e5m2`: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like
    /// (infinities, NaNs), largest finite 57344. A storage type: see [`crate::fp8`].
    F8E5M2,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::BF16, DType::I32, DType::I8, DType::Bool, DType::F8E4M3FN, DType::F8E5M2];

    /// Storage width in bits (bool is stored as one byte in memory, one bit in registers).
    pub fn bits(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 32,
            DType::BF16 => 16,
            DType::I8 | DType::Bool | DType::F8E4M3FN | DType::F8E5M2 => 8,
        }
    }

    pub fn bytes(self) -> usize {
        self.bits() / 8
    }

    /// Floats, fp8 included (their values are kept as f32 on the CPU, like bf16).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2)
    }

    /// One of the two fp8 formats: storage types that Mosaic loads, stores, converts,
    /// selects, moves and multiplies (`dot`) but does no arithmetic on.
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3FN | DType::F8E5M2)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I8)
    }

    /// The MLIR spelling: `f32`, `bf16`, `i32`, `i8`, `i1`, `f8E4M3FN`, `f8E5M2`.
    pub fn mlir(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I8 => "i8",
            DType::Bool => "i1",
            DType::F8E4M3FN => "f8E4M3FN",
            DType::F8E5M2 => "f8E5M2",
        }
    }

    /// The user-facing name (`f32`, `bf16`, `i32`, `i8`, `bool`, and torch's
    /// `float8_e4m3fn`, `float8_e5m2`).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            d => d.mlir(),
        }
    }

    /// A dtype from its name ([`DType::name`]); the fp8 types also by their MLIR
    /// spelling (`f8E4M3FN`, `f8E5M2`) and with a `torch.` prefix.
    pub fn parse(s: &str) -> Option<DType> {
        let s = s.strip_prefix("torch.").unwrap_or(s);
        DType::ALL.into_iter().find(|d| d.name() == s || (d.is_fp8() && d.mlir() == s))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The type of an SSA value: a scalar (empty shape) or a vector of `shape`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Type {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Type {
    pub fn scalar(dtype: DType) -> Type {
        Type { dtype, shape: Vec::new() }
    }

    pub fn vector(dtype: DType, shape: &[usize]) -> Type {
        Type { dtype, shape: shape.to_vec() }
    }

    pub fn is_scalar(&self) -> bool {
        self.shape.is_empty()
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn with_dtype(&self, dtype: DType) -> Type {
        Type { dtype, shape: self.shape.clone() }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.shape.is_empty() {
            write!(f, "{}", self.dtype)
        } else {
            write!(f, "{}[{}]", self.dtype, join(&self.shape, ","))
        }
    }
}

pub(crate) fn join<T: fmt::Display>(items: &[T], sep: &str) -> String {
    items.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(sep)
}

/// Where a ref lives on the TensorCore.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemorySpace {
    /// Vector memory: the default for blocks of inputs, outputs and scratch.
    Vmem,
    /// Scalar memory: scalar-prefetch operands, small int tables, semaphores.
    Smem,
    /// Left in HBM (Pallas `ANY`): the kernel sees the whole array and moves data by DMA.
    Any,
    /// DMA semaphores (Mosaic `semaphore_mem`): a scratch array of `!tpu.dma_semaphore`,
    /// named by [`crate::Inst::DmaStart`] / [`crate::Inst::DmaWait`] and never loaded or
    /// stored. Its `RefDecl` dtype is `i32` (the semaphore counter) and takes no memory.
    Semaphore,
    /// Counting semaphores (Pallas `SemaphoreType.REGULAR`, Mosaic `!tpu.semaphore` in
    /// `semaphore_mem`): a scratch array named by [`crate::Inst::SemSignal`] /
    /// [`crate::Inst::SemWait`], signalled by this device or a peer. Dtype `i32`, no memory.
    RegularSemaphore,
}

impl MemorySpace {
    pub fn name(self) -> &'static str {
        match self {
            MemorySpace::Vmem => "vmem",
            MemorySpace::Smem => "smem",
            MemorySpace::Any => "any",
            MemorySpace::Semaphore => "semaphore_mem",
            MemorySpace::RegularSemaphore => "regular_semaphore_mem",
        }
    }

    /// Either kind of semaphore array: holds counters, not data.
    pub fn is_semaphore(self) -> bool {
        matches!(self, MemorySpace::Semaphore | MemorySpace::RegularSemaphore)
    }
}

/// How the grid iterates along one dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Semantics {
    /// Iterations are independent; may be split across TensorCores.
    Parallel,
    /// Iterations carry state (reductions, accumulators); run in order on one core.
    Arbitrary,
}

impl Semantics {
    pub fn name(self) -> &'static str {
        match self {
            Semantics::Parallel => "parallel",
            Semantics::Arbitrary => "arbitrary",
        }
    }
}
