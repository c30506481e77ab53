//! The TPU generations Tessera compiles for, and the limits the verifier enforces.
//!
//! Figures are per TensorCore, from DESIGN.md §3 (measured against libtpu and the public
//! TPU docs). The default scoped VMEM limit is what Mosaic uses when a kernel does not ask
//! for more via `vmem_limit_bytes`.

use crate::types::DType;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Largest grid extent libtpu 0.0.52 compiles: beyond `2^31 - 130` it rejects the bound or
/// mistakes it for a dynamic one (rulebook `grid-extent-range`).
pub const MAX_GRID_EXTENT: usize = (1 << 31) - 130;
/// Most grid steps in all: libtpu 0.0.52 compiles `[2, 2^30 - 64]` and refuses `2^31`
/// steps (`count < int32 max`); between, it hangs or aborts (`[2, 2^30 - 1]`), so the
/// rule stops at the last measured success (rulebook `grid-steps`).
pub const MAX_GRID_STEPS: usize = (1 << 31) - 128;


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
    /// The chip's TensorCores are one device (megacore, v5p): a kernel's `parallel` grid
    /// axes are split across them, and libtpu's static estimate counts both (a v5p bf16
    /// matmul at 4096^3 estimates 322 us, 93% of the chip's peak and 1.9x one core's).
    /// Otherwise each TensorCore is a device of its own (tpu7x) or the only one.
    pub megacore: bool,
    /// Peak dense bf16 matmul throughput per chip, TFLOP/s.
    pub peak_bf16_tflops: f64,
    /// MXUs per TensorCore (4 on every generation here: v5e's 4 is Google's figure; for
    /// v5p, v6e and tpu7x it is assumed, and only enters [`Target::clock_ghz`]).
    pub mxus_per_core: usize,
    /// HBM bandwidth of one device (what one compile-only device of the topology owns), GB/s.
    pub hbm_gbps: f64,
    /// Input dtypes the MXU multiplies natively. Others that libtpu still compiles
    /// (int8 on tpu7x) are a performance warning, see [`Target::dot_support`].
    pub matmul_dtypes: &'static [DType],
    /// HBM per chip.
    pub hbm_bytes: usize,
    /// HBM one device's operands may take (rule `hbm-budget`): what libtpu 0.0.52 reports
    /// available (`E1000 ... exceeds available HBM (31.24G)`) where it checks, the chip's
    /// HBM where compile-only libtpu does not check (v5e, v5p).
    pub hbm_usable_bytes: usize,
    /// SMEM libtpu keeps for itself (rule `smem-budget`), measured: padded SMEM arrays
    /// filling `1 MiB - 3 KiB` compile and 512 bytes more do not, with one or three prefetch
    /// tables; tpu7x keeps 2 KiB (`1 MiB - 2 KiB` compiles, `1 MiB - 1.75 KiB` does not).
    pub smem_reserved_bytes: usize,
    /// Bidirectional inter-chip interconnect bandwidth per chip, GB/s (Google Cloud's TPU
    /// spec tables: v5e 400, v5p 1200, v6e 800, tpu7x 1200).
    pub ici_gbps: f64,
    /// ICI links per chip: 4 on the 2D tori of v5e and v6e (the spec tables' "ICI ports per
    /// chip"), 6 on the 3D tori of v5p and tpu7x (one per torus neighbour; assumed, the tables
    /// give no port count). One link carries `ici_gbps / (2 * links)` each way.
    pub ici_links: usize,
}

/// How a generation's compiler treats a `dot` of one operand dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotSupport {
    /// The MXU multiplies it natively.
    Native,
    /// libtpu compiles it, but the MXU has no such mode (it may be emulated).
    Compiles,
    /// libtpu rejects it.
    Rejected,
}

impl Target {
    /// TensorCore clock, GHz, derived from the bf16 peak: `peak / cores / (MXUs x mxu^2 x 2
    /// flops)`. v5e gives 1.50 GHz (Google's figure: 1.5 GHz); the others depend on the
    /// assumed MXU count (v5p 1.75, v6e 1.75, tpu7x 2.20). It turns libtpu's cycle estimates
    /// into time (`tessera cost`).
    pub fn clock_ghz(&self) -> f64 {
        self.peak_bf16_tflops * 1e3 / self.cores_per_chip as f64 / (self.mxus_per_core * self.mxu * self.mxu * 2) as f64
    }

    /// One ICI link's bandwidth in one direction, GB/s: what a one-directional ring step
    /// gets to its neighbour.
    pub fn ici_link_gbps(&self) -> f64 {
        self.ici_gbps / (2 * self.ici_links) as f64
    }

    /// Peak bf16 matmul throughput of one device running a kernel, TFLOP/s: the chip's on a
    /// megacore target when the kernel has a `parallel` grid axis to split, else one core's.
    pub fn device_peak_tflops(&self, splits_across_cores: bool) -> f64 {
        if self.megacore && splits_across_cores { self.peak_bf16_tflops } else { self.core_peak_tflops() }
    }

    /// Peak bf16 matmul throughput of one TensorCore, TFLOP/s.
    pub fn core_peak_tflops(&self) -> f64 {
        self.peak_bf16_tflops / self.cores_per_chip as f64
    }

    pub const V5E: Target = Target {
        generation: Generation::V5e,
        name: "v5e",
        vmem_bytes: 128 * MIB,
        default_scoped_vmem_bytes: 16 * MIB,
        smem_bytes: MIB,
        mxu: 128,
        cores_per_chip: 1,
        megacore: false,
        peak_bf16_tflops: 197.0,
        mxus_per_core: 4,
        // 819 GB/s (cloud.google.com/tpu/docs/v5e).
        hbm_gbps: 819.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
        // 16 GiB HBM2 per chip (cloud.google.com/tpu/docs/v5e).
        hbm_bytes: 16 * GIB,
        hbm_usable_bytes: 16 * GIB,
        smem_reserved_bytes: 3 << 10,
        ici_gbps: 400.0,
        ici_links: 4,
    };
    pub const V5P: Target = Target {
        generation: Generation::V5p,
        name: "v5p",
        vmem_bytes: 64 * MIB,
        default_scoped_vmem_bytes: 16 * MIB,
        smem_bytes: MIB,
        mxu: 128,
        cores_per_chip: 2,
        megacore: true,
        peak_bf16_tflops: 459.0,
        mxus_per_core: 4,
        // 2,765 GB/s (cloud.google.com/tpu/docs/v5p).
        hbm_gbps: 2765.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
        // 95 GiB HBM2e per chip (cloud.google.com/tpu/docs/v5p).
        hbm_bytes: 95 * GIB,
        hbm_usable_bytes: 95 * GIB,
        smem_reserved_bytes: 3 << 10,
        ici_gbps: 1200.0,
        ici_links: 6,
    };
    pub const V6E: Target = Target {
        generation: Generation::V6e,
        name: "v6e",
        vmem_bytes: 128 * MIB,
        default_scoped_vmem_bytes: 32 * MIB,
        smem_bytes: MIB,
        mxu: 256,
        cores_per_chip: 1,
        megacore: false,
        peak_bf16_tflops: 920.0,
        mxus_per_core: 4,
        // 1,640 GB/s (cloud.google.com/tpu/docs/v6e).
        hbm_gbps: 1640.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::I8],
        // 32 GiB HBM per chip (cloud.google.com/tpu/docs/v6e).
        hbm_bytes: 32 * GIB,
        hbm_usable_bytes: (31.24 * GIB as f64) as usize,
        smem_reserved_bytes: 3 << 10,
        ici_gbps: 800.0,
        ici_links: 4,
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
        megacore: false,
        peak_bf16_tflops: 2310.0,
        mxus_per_core: 4,
        // 7.37 TB/s per chip (cloud.google.com/tpu/docs/tpu7x), half for each of its two devices.
        hbm_gbps: 3685.0,
        matmul_dtypes: &[DType::F32, DType::BF16, DType::F8E4M3FN, DType::F8E5M2],
        // 192 GiB HBM3e per chip (cloud.google.com/tpu/docs/tpu7x, Ironwood), 96 GiB for
        // each of its two devices.
        hbm_bytes: 192 * GIB,
        hbm_usable_bytes: (94.74 * GIB as f64) as usize,
        smem_reserved_bytes: 2 << 10,
        ici_gbps: 1200.0,
        ici_links: 6,
    };

    pub const ALL: [Target; 4] = [Target::V5E, Target::V5P, Target::V6E, Target::TPU7X];

    pub fn by_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name == name)
    }

    /// The preferred tile of a VMEM block of `dtype`: (sublanes, lanes). Narrow types pack
    /// several rows per 32-bit sublane, so blocks whose rows are a multiple of this use
    /// whole vregs; the library picks its row blocks from it. Not the compile rule
    /// ([`Target::block_tile`]) and not the memory layout ([`Target::memory_tile`]).
    pub fn tiling(&self, dtype: DType) -> (usize, usize) {
        let sublanes = match dtype {
            DType::F32 | DType::I32 => 8,
            DType::BF16 if self.generation == Generation::Tpu7x => 16,
            DType::BF16 => 8,
            DType::I8 | DType::Bool | DType::F8E4M3FN | DType::F8E5M2 => 32,
        };
        (sublanes, 128)
    }

    /// The packed native tile, `(8 * 32 / bits, 128)`: blocks whose rows are not a multiple
    /// of it compile but use partly filled vregs (warning `block-native-tiling`).
    pub fn native_tile(&self, dtype: DType) -> (usize, usize) {
        (8 * 32 / dtype.bits().min(32), 128)
    }

    /// What a block dim must be a multiple of, unless it is the whole array dim (rule
    /// `block-tiling`): `(8, 128)` for every dtype and generation of libtpu 0.0.52.
    pub fn block_tile(&self, _dtype: DType) -> (usize, usize) {
        (8, 128)
    }

    /// Rank-1 blocks are tiled by `128 * (32 / bits)` elements (rule `block-tiling-1d`).
    pub fn block_tile_1d(&self, dtype: DType) -> usize {
        128 * 32 / dtype.bits().min(32)
    }

    /// The tile of a VMEM array in memory: what each buffer is padded to. XLA lays out
    /// 32- and 16-bit arrays in `T(8,128)` tiles (bf16 as `T(8,128)(2,1)`) and 8-bit ones in
    /// `T(32,128)` on every generation (libtpu 0.0.52's E1001 and E2002 messages).
    pub fn memory_tile(&self, dtype: DType) -> (usize, usize) {
        (if dtype.bits() == 8 { 32 } else { 8 }, 128)
    }

    /// The alignment a *dynamic* offset needs on the second-to-last dim of a vector load,
    /// a store or a DMA slice: 8 rows for 32- and 16-bit types, 32 for 8-bit ones (rules
    /// `load-align`, `dma-align`).
    pub fn sublane_alignment(&self, dtype: DType) -> usize {
        if dtype.bits() == 8 { 32 } else { 8 }
    }

    /// The VMEM footprint of an array of `shape`: dims padded to the memory tile (rank 1:
    /// to the rank-1 tile).
    pub fn padded_bytes(&self, dtype: DType, shape: &[usize]) -> usize {
        self.checked_padded_bytes(dtype, shape).unwrap_or(usize::MAX)
    }

    /// [`Target::padded_bytes`], `None` on overflow.
    pub fn checked_padded_bytes(&self, dtype: DType, shape: &[usize]) -> Option<usize> {
        let (sub, lane) = self.memory_tile(dtype);
        let r = shape.len();
        let mut n = dtype.bytes();
        for (d, &x) in shape.iter().enumerate() {
            let padded = if r == 1 {
                x.div_ceil(self.block_tile_1d(dtype)).checked_mul(self.block_tile_1d(dtype))?
            } else if d + 1 == r {
                x.div_ceil(lane).checked_mul(lane)?
            } else if d + 2 == r {
                x.div_ceil(sub).checked_mul(sub)?
            } else {
                x
            };
            n = n.checked_mul(padded)?;
        }
        Some(n)
    }

    /// The SMEM footprint of an array: 32-bit words, rank 1 padded to 128 words, higher
    /// ranks with the last dim padded to 128 and the second-to-last to 8 (measured with
    /// libtpu 0.0.52: a `[1019, 256]` i32 scratch takes 1 MiB).
    pub fn smem_padded_bytes(&self, shape: &[usize]) -> Option<usize> {
        let r = shape.len();
        let mut n = 4usize;
        for (d, &x) in shape.iter().enumerate() {
            let padded = if d + 1 == r { x.div_ceil(128) * 128 } else if d + 2 == r { x.div_ceil(8) * 8 } else { x };
            n = n.checked_mul(padded)?;
        }
        Some(n)
    }

    /// What a DMA slice along the last (lane) dim needs on this generation: `(offset
    /// alignment, length alignment)`, a length may also be the whole dim (rule
    /// `dma-align`, `dma-slice-size`; probes `dma-align/*/lanes*`): v5e copies whole
    /// 128-lane tiles only; v6e and v5p any 8-lane-aligned part of a tile; tpu7x any
    /// length, but only from a tile boundary.
    pub fn dma_lane_alignment(&self) -> (usize, usize) {
        match self.generation {
            Generation::V5e => (128, 128),
            Generation::V6e | Generation::V5p => (8, 8),
            Generation::Tpu7x => (128, 8),
        }
    }

    /// How this generation's compiler treats a `dot` of `dtype` operands (probes
    /// `op-dtype/dot-*`: int8 compiles on all four, int32 on none; fp8 compiles on all
    /// four — libtpu widens it where the MXU has no fp8 mode — and is native on tpu7x).
    pub fn dot_support(&self, dtype: DType) -> DotSupport {
        if self.matmul_dtypes.contains(&dtype) {
            DotSupport::Native
        } else if dtype == DType::I8 || dtype.is_fp8() {
            DotSupport::Compiles
        } else {
            DotSupport::Rejected
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}
