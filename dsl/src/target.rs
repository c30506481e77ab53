//! The TPU generations Tessera compiles for, and the limits the verifier enforces.
//!
//! Figures are per TensorCore, from DESIGN.md §3 (measured against libtpu and the public
//! TPU docs). The default scoped VMEM limit is what Mosaic uses when a kernel does not ask
//! for more via `vmem_limit_bytes`.

use crate::types::DType;

const MIB: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Generation {
    V5e,
    V5p,
    V6e,
    Tpu7x,
}

/// One TPU generation's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Target {
    pub generation: Generation,
    /// Name used on the command line and in topology names (`v5e`, `v5p`, `v6e`, `tpu7x`).
    pub name: &'static str,
    /// Physical VMEM per TensorCore.
    pub vmem_bytes: usize,
    /// Scoped VMEM limit Mosaic applies when the kernel sets none.
    pub default_scoped_vmem_bytes: usize,
    pub smem_bytes: usize,
    /// Systolic array edge: 128 (v5e, v5p) or 256 (v6e, tpu7x).
    pub mxu: usize,
    /// TensorCores per chip that a `parallel` grid axis can be split across.
    pub cores_per_chip: usize,
    /// Peak dense bf16 matmul throughput per chip, TFLOP/s.
    pub peak_bf16_tflops: f64,
    /// Input dtype pairs the MXU multiplies natively.
    pub matmul_dtypes: &'static [DType],
}

impl Target {
    pub const V5E: Target = Target {
        generation: Generation::V5e,
        name: "v5e",
        vmem_bytes: 128 * MIB,
        default_scoped_vmem_bytes: 16 * MIB,
        smem_bytes: MIB,
        mxu: 128,
        cores_per_chip: 1,
        peak_bf16_tflops: 197.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
    };
    pub const V5P: Target = Target {
        generation: Generation::V5p,
        name: "v5p",
        vmem_bytes: 64 * MIB,
        default_scoped_vmem_bytes: 16 * MIB,
        smem_bytes: MIB,
        mxu: 128,
        cores_per_chip: 2,
        peak_bf16_tflops: 459.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
    };
    pub const V6E: Target = Target {
        generation: Generation::V6e,
        name: "v6e",
        vmem_bytes: 128 * MIB,
        default_scoped_vmem_bytes: 32 * MIB,
        smem_bytes: MIB,
        mxu: 256,
        cores_per_chip: 1,
        peak_bf16_tflops: 920.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
    };
    /// Ironwood. Its MXU has no int8 x int8 mode (it multiplies fp8 instead).
    pub const TPU7X: Target = Target {
        generation: Generation::Tpu7x,
        name: "tpu7x",
        vmem_bytes: 64 * MIB,
        default_scoped_vmem_bytes: 32 * MIB,
        smem_bytes: MIB,
        mxu: 256,
        cores_per_chip: 2,
        peak_bf16_tflops: 2310.0,
        matmul_dtypes: &[DType::F32, DType::BF16],
    };

    pub const ALL: [Target; 4] = [Target::V5E, Target::V5P, Target::V6E, Target::TPU7X];

    pub fn by_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name == name)
    }

    /// The native tile of a VMEM array of `dtype`: (sublanes, lanes). A block's last dim
    /// must be a multiple of the lane count and its second-to-last a multiple of the
    /// sublane count, unless the block spans the whole array dim. Narrow types pack
    /// several rows per 32-bit sublane.
    pub fn tiling(&self, dtype: DType) -> (usize, usize) {
        let sublanes = match dtype {
            DType::F32 | DType::I32 => 8,
            DType::BF16 if self.generation == Generation::Tpu7x => 16,
            DType::BF16 => 8,
            DType::I8 | DType::Bool => 32,
        };
        (sublanes, 128)
    }

    /// The VMEM footprint of an array of `shape`: dims padded to the native tile.
    pub fn padded_bytes(&self, dtype: DType, shape: &[usize]) -> usize {
        let (sub, lane) = self.tiling(dtype);
        let r = shape.len();
        let mut n = dtype.bytes();
        for (d, &x) in shape.iter().enumerate() {
            n *= if d + 1 == r { x.div_ceil(lane) * lane } else if d + 2 == r { x.div_ceil(sub) * sub } else { x };
        }
        n
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}
