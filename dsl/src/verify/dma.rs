//! Async copy descriptors: real refs on both sides, a semaphore array, same dtype and
//! box, slices inside the arrays, and slices that libtpu can address: tile-aligned offsets
//! and tile-sized lengths along the tiled (last two) dims.

use super::align::Multiples;
use super::body::memref_dims;
use super::Verifier;
use crate::error::Result;
use crate::ir::*;
use crate::types::MemorySpace;

impl Verifier<'_> {
    pub(super) fn dma(&self, src: &DmaRef, dst: &DmaRef, sem: RefId, m: &Multiples) -> Result<()> {
        let (sd, dd, md) = (self.k.ref_decl(src.r), self.k.ref_decl(dst.r), self.k.ref_decl(sem));
        let subject = format!("DMA `{}` -> `{}`", sd.name, dd.name);
        if md.memory != MemorySpace::Semaphore {
            return Err(self.err(&subject, "dma-semaphore", format!("`{}` is not a DMA semaphore array", md.name), "declare semaphores with `semaphores(n)`"));
        }
        for (side, r) in [("source", sd), ("destination", dd)] {
            if r.memory.is_semaphore() {
                return Err(self.err(&subject, "semaphore-access", format!("the {side} `{}` is a semaphore array", r.name), "copy between HBM (ANY), VMEM and SMEM refs"));
            }
        }
        if matches!(dd.kind, RefKind::Input | RefKind::Prefetch) {
            return Err(self.err(&subject, "dma-destination", format!("the destination is {} `{}`, which is read-only", dd.kind.name(), dd.name), "copy into a scratch buffer or an output"));
        }
        if sd.dtype != dd.dtype {
            return Err(self.err(&subject, "dma-dtype", format!("copying {} into {}", sd.dtype, dd.dtype), "make source and destination the same dtype"));
        }
        if dma_box(&src.shape()) != dma_box(&dst.shape()) {
            return Err(self.err(&subject, "dma-shape", format!("the source slice is {:?} and the destination slice {:?}", src.shape(), dst.shape()), "copy boxes of the same shape"));
        }
        for (side, r, d) in [("source", sd, src), ("destination", dd, dst)] {
            let view = r.view();
            if d.slices.len() != view.len() {
                return Err(self.err(&subject, "index-rank", format!("{} slices for the {side} `{}` of rank {}", d.slices.len(), r.name, view.len()), "give one slice per dim"));
            }
            for (dim, (s, &extent)) in d.slices.iter().zip(&view).enumerate() {
                let start = match self.k.as_const(s.start) {
                    Some(Scalar::Int(i)) => i,
                    _ => 0,
                };
                if s.len == 0 || start < 0 || start as usize + s.len > extent {
                    return Err(self.err(
                        &subject,
                        "dma-out-of-bounds",
                        format!("the {side} slice of `{}` covers elements {start}..{} of dim {dim}, which has {extent}", r.name, start + s.len as i64),
                        "keep DMA slices inside the array",
                    ));
                }
            }
            self.dma_tiles(&subject, side, r, d, m)?;
        }
        Ok(())
    }

    /// libtpu slices a tiled memref only at tile boundaries (0.0.52, every generation):
    ///
    /// - last dim: offset and length aligned per generation ([`Target::dma_lane_alignment`]:
    ///   128 and 128 on v5e, 8 and 8 on v6e and v5p, 128 and 8 on tpu7x), or the whole dim;
    /// - second-to-last dim, a slice of at most 8 rows: offset and length multiples of the
    ///   packing (1 for 32-bit types, 2 for bf16, 4 for int8);
    /// - second-to-last dim, longer slices: offset a multiple of 8 (32 for 8-bit types),
    ///   length a multiple of 8 or the whole dim.
    ///
    /// Offsets count when libtpu can *prove* them (the same divisibility analysis as loads).
    fn dma_tiles(&self, subject: &str, side: &str, r: &RefDecl, d: &DmaRef, m: &Multiples) -> Result<()> {
        let memref = r.window();
        let rank = memref.len();
        if rank < 2 || r.memory == MemorySpace::Smem {
            return Ok(());
        }
        let packing = 32 / r.dtype.bits().min(32);
        for (s, &dim) in d.slices.iter().zip(&memref_dims(r)) {
            let full = memref[dim];
            let (lane_offset, lane_len) = self.t.dma_lane_alignment();
            let (offset, length_ok, length_rule) = if dim + 1 == rank {
                (lane_offset, s.len % lane_len == 0 || s.len == full, format!("a multiple of {lane_len} lanes"))
            } else if dim + 2 == rank && s.len <= 8 {
                (packing, s.len % packing == 0 || s.len == full, format!("a multiple of {packing} rows ({} packs {packing} rows per sublane)", r.dtype))
            } else if dim + 2 == rank {
                (self.t.sublane_alignment(r.dtype), s.len % 8 == 0 || s.len == full, "at most 8 rows or a multiple of 8 rows".to_string())
            } else {
                continue;
            };
            if !length_ok {
                return Err(self.err(
                    subject,
                    "dma-slice-size",
                    format!("the {side} slice of `{}` is {} long in dim {dim} (of {full}); libtpu copies {} of a {} memref only in {length_rule} or the whole dim", r.name, s.len, if dim + 1 == rank { "lanes" } else { "rows" }, r.dtype),
                    format!("copy {length_rule} (or the whole dim, {full}), and slice the rest in VMEM"),
                ));
            }
            if !m.proves(s.start, offset) {
                let what = if dim + 1 == rank { "lane (last-dim) offset" } else { "row (second-to-last-dim) offset" };
                let known = m.multiple(s.start);
                let value = match self.k.as_const(s.start) {
                    Some(Scalar::Int(c)) => format!("the constant {c}"),
                    _ if known > 1 => format!("only known to be a multiple of {known}"),
                    _ => "of unknown divisibility".to_string(),
                };
                return Err(self.err(
                    subject,
                    "dma-align",
                    format!("the {side} slice of `{}` starts at a {what} in dim {dim} that is {value}; libtpu needs a proven multiple of {offset} there ({} on {})", r.name, r.dtype, self.t),
                    format!("start the slice at a multiple of {offset}: a constant, `program_id(0) * {offset}`, sums of such multiples, or a loop variable whose start and step are multiples of {offset}"),
                ));
            }
        }
        Ok(())
    }
}
