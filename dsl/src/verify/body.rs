//! The body's instructions: what each generation's Mosaic can lower (op x dtype), which
//! memory a load or store may touch, and whether its dynamic offsets are provably aligned.

use super::align::Multiples;
use super::Verifier;
use crate::error::{KernelError, Result};
use crate::ir::*;
use crate::target::DotSupport;
use crate::types::{DType, MemorySpace};

impl Verifier<'_> {
    pub(super) fn body(&self) -> Result<()> {
        let m = Multiples::of(self.k);
        let mut result = Ok(());
        self.k.walk(self.k.body, &mut |_, d| {
            if result.is_ok() {
                result = self.inst(d, &m).map_err(|e| e.at(d.loc.clone()));
            }
        });
        result
    }

    fn inst(&self, d: &InstData, m: &Multiples) -> Result<()> {
        self.fp8_op(&d.inst)?;
        match &d.inst {
            Inst::Dot { lhs, rhs, .. } => {
                for v in [*lhs, *rhs] {
                    let dt = self.k.ty(v).dtype;
                    if self.t.dot_support(dt) == DotSupport::Rejected {
                        let ok: Vec<&str> = self.t.matmul_dtypes.iter().map(|d| d.name()).collect();
                        return Err(self.err("instruction `dot`", "matmul-dtype", format!("{dt} x {dt} matmul is not supported by the {} MXU", self.t), format!("cast the operands to one of: {}", ok.join(", "))));
                    }
                }
                Ok(())
            }
            Inst::Binary(BinaryOp::Rem, a, _) if self.k.ty(*a).dtype == DType::BF16 && !self.k.ty(*a).is_scalar() => Err(self.err(
                "instruction `rem`",
                "vector-op-dtype",
                format!("`rem` of bf16 vectors ({}): Mosaic has no bf16 remainder (`failed to legalize arith.remf`) on any generation", self.k.ty(*a)),
                "cast to f32 first (.cast(f32)), take the remainder, and cast the result back to bf16",
            )),
            // Shifts of int8 vectors compile (probes op-more/shl-*-i8, every generation).
            Inst::Binary(op, a, _) => self.int8_op(op.name(), *a, !op.is_bitwise() && !op.is_shift()),
            Inst::Unary(op @ (UnaryOp::Neg | UnaryOp::Abs), x) => self.int8_op(op.name(), *x, true),
            Inst::Select { cond, on_true, on_false } => {
                // Mosaic canonicalizes `where(a < b, a, b)` into a min (max): an int8 min.
                if let ValueDef::Result(c, 0) = self.k.value(*cond).def {
                    if let Inst::Cmp(op, a, b) = self.k.inst(c).inst {
                        let same = (a, b) == (*on_true, *on_false) || (a, b) == (*on_false, *on_true);
                        if same && !matches!(op, CmpOp::Eq | CmpOp::Ne) {
                            return self.int8_op("select (a min or max)", *on_true, true);
                        }
                    }
                }
                Ok(())
            }
            Inst::Reduce { op, x, .. } => {
                let t = self.k.ty(*x);
                if t.dtype == DType::Bool && *op == ReduceOp::Sum {
                    return Err(self.err(
                        format!("instruction `{}`", op.name()),
                        "reduce-dtype",
                        format!("a sum of a bool vector {t} (bools take max and min, any and all)"),
                        "count with .cast(i32) first, then sum",
                    ));
                }
                if t.dtype == DType::I8 && !t.is_scalar() {
                    return Err(self.err(
                        format!("instruction `{}`", op.name()),
                        "reduce-dtype",
                        format!("a {} reduction of an int8 vector {t}: Mosaic reduces 32-bit (and some 16-bit) vectors only", op.name()),
                        "cast the vector to i32 first: .cast(i32), then reduce",
                    ));
                }
                Ok(())
            }
            Inst::Load { src, slices } => {
                self.strided("load", *src, slices)?;
                self.access("load", *src, slices, m)
            }
            Inst::Store { dst, slices, .. } => {
                self.strided("store", *dst, slices)?;
                self.access("store", *dst, slices, m)
            }
            Inst::Cumsum { axis, x } => {
                let t = self.k.ty(*x);
                if *axis + 2 < t.rank() {
                    return Err(self.err(
                        "instruction `cumsum`",
                        "cumsum-axis",
                        format!("a cumsum along axis {axis} of {t}: Tessera lowers cumsum to Mosaic as lane or sublane rotations, so only the last two axes scan"),
                        format!("scan along axis {} or {} (move the axis there with a reshape or transpose), or loop over the leading index", t.rank().saturating_sub(2), t.rank().saturating_sub(1)),
                    ));
                }
                Ok(())
            }
            Inst::PrngSeed(seeds) if seeds.len() > 2 => Err(self.err(
                "instruction `prng_seed`",
                "prng-seed-count",
                format!("{} seeds: Mosaic sets the hardware generator from at most 2 values on every generation (`Setting seed with more than 2 values is not supported`)", seeds.len()),
                "combine the seeds into at most two i32 values first, e.g. prng_seed(seed, program_id(0) * n1 + program_id(1))",
            )),
            Inst::DmaStart { src, dst, .. } | Inst::DmaWait { src, dst, .. } if src.slices.iter().chain(&dst.slices).any(|s| s.stride != 1) => Err(self.err(
                format!("instruction `{}`", d.inst.name()),
                "dma-stride",
                "a DMA side is a strided slice: copies move contiguous boxes",
                "copy a contiguous box and take the strided elements from VMEM with a strided load",
            )),
            Inst::DmaStart { src, dst, sem, .. } | Inst::DmaWait { src, dst, sem, .. } => self.dma(src, dst, *sem, m),
            _ => Ok(()),
        }
    }

    /// What Mosaic's `tpu.strided_load` / `tpu.strided_store` take (libtpu 0.0.52, the same
    /// on v5e, v6e and tpu7x): a stride on any dim but the last (lane) one, of a window at
    /// most 128 lanes wide; a strided store of 32-bit data only; a strided load of packed
    /// data (bf16, i8) at static starts from a memref whose second-minor dim is a multiple
    /// of the packing factor (2, 4).
    fn strided(&self, what: &str, r: RefId, slices: &[Slice]) -> Result<()> {
        if slices.iter().all(|s| s.stride == 1) {
            return Ok(());
        }
        let decl = self.k.ref_decl(r);
        let subject = format!("strided {what} of {} `{}`", decl.kind.name(), decl.name);
        let dims = memref_dims(decl);
        let window = decl.window();
        let rank = window.len();
        for (s, &dim) in slices.iter().zip(&dims) {
            if s.stride != 1 && dim + 1 == rank {
                return Err(self.err(
                    subject,
                    "strided-access",
                    format!("a stride of {} on the last (lane) dim: Mosaic strides only the sublane and leading dims (`Stride on last dim is not 1`, every generation)", s.stride),
                    "load the lanes contiguously and select them afterwards, or transpose so the strided axis is the second-to-last",
                ));
            }
        }
        if decl.memory != MemorySpace::Vmem {
            return Ok(());
        }
        if rank >= 1 && window[rank - 1] > 128 {
            return Err(self.err(
                subject,
                "strided-access",
                format!("a strided {what} of a window {} lanes wide: Mosaic strides only refs at most one lane tile (128) wide (`The last dim size is not 128 in original base memref`, every generation)", window[rank - 1]),
                "make the block's last dim 128 (or less), e.g. a grid over lane tiles, or copy the lane tile into a [.., 128] scratch first",
            ));
        }
        let bits = decl.dtype.bits();
        if what == "store" && bits != 32 {
            return Err(self.err(
                subject,
                "strided-access",
                format!("a strided store of {} data: Mosaic stores with a stride only 32-bit data (`Strided store with non 32-bit data`, every generation)", decl.dtype),
                "store into an f32/i32 buffer (cast first), or store contiguous rows one at a time",
            ));
        }
        let packing = (32 / bits.max(1)).max(1);
        if packing > 1 && slices.iter().any(|s| self.k.as_const(s.start).is_none()) {
            return Err(self.err(
                subject,
                "strided-access",
                format!("a strided {} load at a dynamic start: Mosaic takes only static indices for packed types (`Only static indices are supported for packed types`, every generation)", decl.dtype),
                "use static starts (e.g. unroll over the few offsets with `if`), or load as 32-bit data",
            ));
        }
        if packing > 1 && rank >= 2 && window[rank - 2] % packing != 0 {
            return Err(self.err(
                subject,
                "strided-access",
                format!("a strided {} load from a window of {} rows: Mosaic needs the second-to-last dim of a packed ref to be a multiple of the packing factor {packing} (`Unsupported strided load for packed type`)", decl.dtype, window[rank - 2]),
                format!("make the block's second-to-last dim a multiple of {packing}, or load as 32-bit data"),
            ));
        }
        Ok(())
    }

    /// fp8 values are storage: Mosaic (libtpu 0.0.52, v5e / v5p / v6e / tpu7x alike)
    /// loads, stores, converts (to and from f32 / bf16), selects, broadcasts, transposes,
    /// reshapes and multiplies (`dot`) them, and legalizes no arithmetic, comparison or reduction
    /// of them (`failed to legalize operation 'arith.addf'`, `Target does not support this
    /// comparison`, `Unsupported element type for the selected reduction`).
    fn fp8_op(&self, inst: &Inst) -> Result<()> {
        let (what, x) = match inst {
            Inst::Binary(op, a, _) => (op.name(), *a),
            Inst::Unary(op, a) => (op.name(), *a),
            Inst::Cmp(op, a, _) => (op.name(), *a),
            Inst::Reduce { op, x, .. } => (op.name(), *x),
            _ => return Ok(()),
        };
        let t = self.k.ty(x);
        if !t.dtype.is_fp8() {
            return Ok(());
        }
        Err(self.err(
            format!("instruction `{what}`"),
            "fp8-op",
            format!("`{what}` of {t}: fp8 is a storage type, and Mosaic does no arithmetic, comparison or reduction of fp8 values on any generation (`failed to legalize operation 'arith.addf'`)"),
            format!("cast to f32 (or bf16) first: .cast(f32), compute, and cast the result back with .cast({}) to store it; a dot takes fp8 operands as they are", t.dtype),
        ))
    }

    /// Int8 vectors support bitwise ops, shifts, compares and selects, but no arithmetic
    /// ("Only vector<i16> and vector<i32> are supported", "failed to legalize arith.maxsi").
    fn int8_op(&self, op: &str, operand: Value, arithmetic: bool) -> Result<()> {
        let t = self.k.ty(operand);
        if !arithmetic || t.dtype != DType::I8 || t.is_scalar() {
            return Ok(());
        }
        Err(self.err(
            format!("instruction `{op}`"),
            "vector-op-dtype",
            format!("`{op}` of int8 vectors ({t}): Mosaic does int8 vector arithmetic on no TPU generation (only bitwise ops, shifts, compares and selects)"),
            "cast to i32 first (.cast(i32)), compute, and cast the result back to i8",
        ))
    }

    fn access(&self, what: &str, r: RefId, slices: &[Slice], m: &Multiples) -> Result<()> {
        let decl = self.k.ref_decl(r);
        match decl.memory {
            MemorySpace::Any => Err(self.err(
                format!("operand `{}`", decl.name),
                "hbm-direct-access",
                "the operand stays in HBM (memory space ANY) and cannot be loaded or stored directly",
                "copy it into VMEM scratch with a DMA",
            )),
            MemorySpace::Semaphore | MemorySpace::RegularSemaphore => Err(self.err(format!("{} `{}`", decl.kind.name(), decl.name), "semaphore-access", "semaphores cannot be loaded or stored", "use them only in copies (DMA semaphores) or semaphore_signal / semaphore_wait")),
            MemorySpace::Vmem => self.vector_offsets(what, decl, slices, m),
            MemorySpace::Smem => Ok(()),
        }
    }

    /// Mosaic loads and stores a vector at a *dynamic* offset only where it can prove the
    /// offset aligned to the memory tile: lane offsets to 128, sublane offsets to 8 (32 for
    /// 8-bit types; any for 32-bit types in a ref one lane tile wide or for one row), rank-1
    /// offsets to `128 * (32 / bits)`. Static offsets may be anything.
    fn vector_offsets(&self, what: &str, decl: &RefDecl, slices: &[Slice], m: &Multiples) -> Result<()> {
        let memref = decl.window();
        let dims = memref_dims(decl);
        let rank = memref.len();
        for (s, &dim) in slices.iter().zip(&dims) {
            if self.k.as_const(s.start).is_some() {
                continue;
            }
            let (need, which) = if rank == 1 {
                (self.t.block_tile_1d(decl.dtype), "offset")
            } else if dim + 1 == rank {
                (128, "lane (last-dim) offset")
            } else if dim + 2 == rank {
                let narrow = decl.dtype.bits() == 32 && (memref[rank - 1] <= 128 || s.len == 1);
                (if narrow { 1 } else { self.t.sublane_alignment(decl.dtype) }, "sublane (second-to-last-dim) offset")
            } else {
                (1, "")
            };
            if !m.proves(s.start, need) {
                return Err(self.unproven("vector-offset-align", format!("the {what} of {} `{}`", decl.kind.name(), decl.name), which, dim, need, decl.dtype, m.multiple(s.start)));
            }
        }
        Ok(())
    }

    /// The error for a dynamic offset we cannot prove a multiple of `need`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn unproven(&self, rule: &'static str, subject: String, which: &str, dim: usize, need: usize, dtype: DType, known: u64) -> KernelError {
        let known = if known > 1 { format!("it is only known to be a multiple of {known}") } else { "nothing is known about its divisibility".to_string() };
        self.err(
            subject,
            rule,
            format!("the {which} in dim {dim} is dynamic and not provably a multiple of {need} ({dtype} on {}): {known}, and Mosaic refuses offsets it cannot prove aligned (E2003)", self.t),
            format!(
                "compute the offset so its alignment is visible: a multiple of {need} times anything (`program_id(0) * {need}`), sums of such multiples, or a loop variable whose start and step are multiples of {need}; or access the whole block and slice statically"
            ),
        )
    }
}

/// For each dim of a ref's view, the dim of its memref (window) it indexes.
pub(super) fn memref_dims(decl: &RefDecl) -> Vec<usize> {
    match &decl.block {
        Some(b) => b.block_shape.iter().enumerate().filter(|(_, d)| d.is_some()).map(|(i, _)| i).collect(),
        None => (0..decl.shape.len()).collect(),
    }
}
