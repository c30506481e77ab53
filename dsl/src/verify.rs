//! Checks a kernel against a TPU generation before any compiler sees it, so that a user
//! gets an error in their own terms (kernel, operand, rule, fix) instead of a late,
//! cryptic Mosaic failure. The rules are those of DESIGN.md §3.

use crate::error::{KernelError, Result};
use crate::ir::*;
use crate::target::Target;
use crate::types::{DType, MemorySpace, Semantics};

const MIB: f64 = (1 << 20) as f64;

/// VMEM a kernel needs on `target`: blocked VMEM operands twice (the pipeline
/// double-buffers them) plus VMEM scratch once, each padded to the native tiling.
pub fn vmem_bytes(k: &Kernel, target: &Target) -> usize {
    k.refs
        .iter()
        .filter(|r| r.memory == MemorySpace::Vmem)
        .map(|r| {
            let bytes = target.padded_bytes(r.dtype, &r.window());
            if r.block.is_some() { 2 * bytes } else { bytes }
        })
        .sum()
}

/// SMEM a kernel needs: prefetch arrays, SMEM operands and SMEM scratch.
pub fn smem_bytes(k: &Kernel) -> usize {
    k.refs.iter().filter(|r| r.memory == MemorySpace::Smem).map(|r| r.dtype.bytes() * r.shape.iter().product::<usize>()).sum()
}

/// The scoped VMEM limit the kernel runs under on `target`.
pub fn vmem_limit(k: &Kernel, target: &Target) -> usize {
    k.vmem_limit_bytes.unwrap_or(target.default_scoped_vmem_bytes)
}

/// Runs every check; returns the first violation.
pub fn verify(k: &Kernel, target: &Target) -> Result<()> {
    let v = Verifier { k, t: target };
    v.grid()?;
    for (i, r) in k.refs.iter().enumerate() {
        v.operand(RefId(i as u32), r)?;
    }
    v.output_revisits()?;
    v.memory_budget()?;
    v.body()?;
    Ok(())
}

struct Verifier<'a> {
    k: &'a Kernel,
    t: &'a Target,
}

impl Verifier<'_> {
    fn err(&self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        KernelError::new(&self.k.name, subject, rule, message, help)
    }

    fn grid(&self) -> Result<()> {
        if self.k.grid.is_empty() {
            return Err(self.err("grid", "grid-rank", "the grid has no dimensions", "give the kernel a grid of at least one dimension, e.g. grid = [1]"));
        }
        for (d, g) in self.k.grid.iter().enumerate() {
            if g.extent == 0 {
                return Err(self.err("grid", "grid-extent", format!("dimension {d} has extent 0"), "every grid dimension needs at least one step; check the shapes you passed"));
            }
        }
        Ok(())
    }

    fn operand(&self, id: RefId, r: &RefDecl) -> Result<()> {
        let subject = format!("{} `{}`", r.kind.name(), r.name);
        if r.shape.is_empty() || r.shape.contains(&0) {
            return Err(self.err(&subject, "operand-shape", format!("shape {:?} is empty", r.shape), "operands are arrays of rank >= 1 with non-zero dims"));
        }
        if r.kind == RefKind::Prefetch && (r.dtype != DType::I32 || r.memory != MemorySpace::Smem) {
            return Err(self.err(&subject, "prefetch-dtype", format!("scalar prefetch is {} in {}", r.dtype, r.memory.name()), "scalar-prefetch operands are int32 arrays in SMEM"));
        }
        if r.memory == MemorySpace::Vmem && r.kind == RefKind::Scratch && r.shape.len() < 2 {
            // A 1-D VMEM buffer is legal but lays out poorly; Mosaic wants >= 2-D vectors.
            return Err(self.err(&subject, "vmem-rank", format!("VMEM scratch of rank {}", r.shape.len()), "give VMEM scratch at least 2 dims, e.g. [1, n]"));
        }
        if r.memory == MemorySpace::Semaphore && (r.kind != RefKind::Scratch || r.shape.len() != 1 || r.block.is_some()) {
            return Err(self.err(&subject, "semaphore-decl", format!("a {} in semaphore memory of shape {:?}", r.kind.name(), r.shape), "DMA semaphores are rank-1 scratch arrays: declare them with `semaphores(n)`"));
        }
        let Some(b) = &r.block else { return Ok(()) };
        if r.memory != MemorySpace::Vmem {
            return Err(self.err(&subject, "blocked-memory-space", format!("a block spec in {}", r.memory.name()), "blocked operands live in VMEM; ANY/SMEM operands take the whole array"));
        }
        let rank = r.shape.len();
        if b.block_shape.len() != rank {
            return Err(self.err(&subject, "block-rank", format!("block shape has {} dims, the array {:?} has {rank}", b.block_shape.len(), r.shape), "give one block dim per array dim (None to squeeze a dim)"));
        }
        if b.index_map.len() != rank {
            return Err(self.err(
                &subject,
                "index-map-arity",
                format!("the index map returns {} block indices, the array has {rank} dims", b.index_map.len()),
                format!("return one block index per array dim ({rank} values)"),
            ));
        }
        for e in &b.index_map {
            let mut bad = None;
            e.for_each_leaf(&mut |leaf| match leaf {
                IndexExpr::Grid(g) if *g >= self.k.grid.len() => bad = Some(format!("uses grid index {g}, the grid has {} dims", self.k.grid.len())),
                IndexExpr::Prefetch { array, .. } if self.k.refs.get(array.index()).map(|p| p.kind) != Some(RefKind::Prefetch) => {
                    bad = Some(format!("reads {array}, which is not a scalar-prefetch operand"))
                }
                _ => {}
            });
            if let Some(msg) = bad {
                return Err(self.err(&subject, "index-map-arity", format!("the index map {msg}"), "index maps take the grid indices and scalar-prefetch operands only"));
            }
        }
        // Tiling: the last two block dims must match the native tile or span the array.
        let (sub, lane) = self.t.tiling(r.dtype);
        for (d, (&blk, &full)) in b.block_shape.iter().zip(&r.shape).enumerate() {
            let n = blk.unwrap_or(1);
            if n == 0 || n > full {
                return Err(self.err(&subject, "block-shape", format!("block dim {d} is {n}, the array dim is {full}"), "use block dims between 1 and the array dim"));
            }
            let tile = if d + 1 == rank { lane } else if d + 2 == rank { sub } else { 1 };
            let squeezed_ok = blk.is_none() && d + 2 < rank;
            if tile > 1 && n % tile != 0 && n != full && !squeezed_ok {
                let which = if d + 1 == rank { "last" } else { "second-to-last" };
                let suggestion = (n.div_ceil(tile) * tile).min(full);
                return Err(self.err(
                    &subject,
                    "block-tiling",
                    format!("block {:?}: the {which} dim is {n}, which is neither a multiple of {tile} ({} tiling on {}) nor the full dim {full}", b.window(), r.dtype, self.t),
                    format!("use a multiple of {tile} (e.g. {suggestion}) or {full}"),
                ));
            }
        }
        // Every block index the grid can produce must be inside the array; outputs must be
        // covered. An array dim need not be a multiple of its block dim: as in Pallas, the
        // last block then reaches past the end, reads there are undefined (the interpreter
        // poisons them) and writes there are dropped, so the kernel masks with iota.
        let blocks: Vec<usize> = b.window().iter().zip(&r.shape).map(|(&n, &full)| full.div_ceil(n)).collect();
        if let Some(visited) = self.visited_blocks(b)? {
            for idx in &visited {
                for (d, (&i, &nb)) in idx.iter().zip(&blocks).enumerate() {
                    if i < 0 || i as usize >= nb {
                        return Err(self.err(
                            &subject,
                            "index-out-of-bounds",
                            format!("the index map gives block index {i} in dim {d}, but the array has {nb} blocks there (ceil({} / {}))", r.shape[d], b.window()[d]),
                            "fix the index map or the grid so block indices stay below the number of blocks",
                        ));
                    }
                }
            }
            if r.kind == RefKind::Output {
                let total: usize = blocks.iter().product();
                let mut seen = std::collections::HashSet::new();
                for idx in &visited {
                    seen.insert(idx.clone());
                }
                if seen.len() < total {
                    return Err(self.err(
                        &subject,
                        "output-coverage",
                        format!("the grid writes {} of the output's {total} blocks; the rest would be left uninitialised", seen.len()),
                        "make the grid and index map visit every output block",
                    ));
                }
            }
        }
        let _ = id;
        Ok(())
    }

    /// All block indices an index map produces over the grid, when that is cheap to know
    /// statically (no prefetch reads, grid of at most 2^20 steps).
    fn visited_blocks(&self, b: &BlockSpec) -> Result<Option<Vec<Vec<i64>>>> {
        let mut uses_prefetch = false;
        for e in &b.index_map {
            e.for_each_leaf(&mut |l| uses_prefetch |= matches!(l, IndexExpr::Prefetch { .. }));
        }
        let steps = self.k.grid_steps();
        if uses_prefetch || steps > 1 << 20 {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(steps);
        let mut idx = vec![0usize; self.k.grid.len()];
        for _ in 0..steps {
            let ids: Vec<i64> = idx.iter().map(|&i| i as i64).collect();
            let mut row = Vec::with_capacity(b.index_map.len());
            for e in &b.index_map {
                row.push(eval_static(e, &ids).ok_or_else(|| self.err("index map", "index-map-division", format!("`{e}` divides by zero"), "divide by a non-zero constant"))?);
            }
            out.push(row);
            // Lexicographic increment, last dim fastest (Pallas order).
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < self.k.grid[d].extent {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(Some(out))
    }

    /// An output block stays in VMEM while consecutive grid steps map to it and is written
    /// back when the index changes. Revisiting it after leaving (or from parallel steps
    /// that may run on another core) loses data, so a grid dim the output's index map
    /// ignores must be `arbitrary` and come after every dim the map uses.
    fn output_revisits(&self) -> Result<()> {
        for (_, r) in self.k.refs_of(RefKind::Output) {
            let Some(b) = &r.block else { continue };
            let mut used = vec![false; self.k.grid.len()];
            let mut uses_prefetch = false;
            for e in &b.index_map {
                e.for_each_leaf(&mut |l| match l {
                    IndexExpr::Grid(g) if *g < used.len() => used[*g] = true,
                    IndexExpr::Prefetch { .. } => uses_prefetch = true,
                    _ => {}
                });
            }
            if uses_prefetch {
                continue; // data-dependent maps (e.g. grouped matmul) are the kernel author's contract
            }
            let subject = format!("output `{}`", r.name);
            for (d, g) in self.k.grid.iter().enumerate() {
                if used[d] || g.extent == 1 {
                    continue;
                }
                if g.semantics == Semantics::Parallel {
                    return Err(self.err(
                        &subject,
                        "reduction-axis-semantics",
                        format!("grid dim {d} is `parallel` but the output's index map does not depend on it, so steps along it write the same block"),
                        format!("mark grid dim {d} `arbitrary` (it is a reduction axis)"),
                    ));
                }
                if let Some(later) = (d + 1..used.len()).find(|&e| used[e] && self.k.grid[e].extent > 1) {
                    return Err(self.err(
                        &subject,
                        "reduction-axis-order",
                        format!("reduction grid dim {d} comes before dim {later}, which the output's index map uses, so each output block is visited in separate runs"),
                        "put reduction (arbitrary) axes last in the grid",
                    ));
                }
            }
        }
        Ok(())
    }

    fn memory_budget(&self) -> Result<()> {
        let need = vmem_bytes(self.k, self.t);
        let limit = vmem_limit(self.k, self.t);
        if limit > self.t.vmem_bytes {
            return Err(self.err(
                "compiler params",
                "vmem-limit",
                format!("vmem_limit_bytes is {:.2} MiB, {} has {:.0} MiB of VMEM per core", limit as f64 / MIB, self.t, self.t.vmem_bytes as f64 / MIB),
                format!("ask for at most {} bytes", self.t.vmem_bytes),
            ));
        }
        if need > limit {
            let biggest = self
                .k
                .refs
                .iter()
                .filter(|r| r.memory == MemorySpace::Vmem)
                .max_by_key(|r| self.t.padded_bytes(r.dtype, &r.window()))
                .map(|r| format!("{} `{}` {:?} {}", r.kind.name(), r.name, r.window(), r.dtype))
                .unwrap_or_default();
            let raise = if need <= self.t.vmem_bytes { format!(", or raise vmem_limit_bytes to at least {need} (the core has {:.0} MiB)", self.t.vmem_bytes as f64 / MIB) } else { String::new() };
            return Err(self.err(
                "VMEM",
                "vmem-budget",
                format!(
                    "the kernel needs {:.2} MiB of VMEM (blocked operands double-buffered, plus scratch) but the limit on {} is {:.2} MiB; the largest buffer is {biggest}",
                    need as f64 / MIB,
                    self.t,
                    limit as f64 / MIB
                ),
                format!("use smaller blocks{raise}"),
            ));
        }
        let smem = smem_bytes(self.k);
        if smem > self.t.smem_bytes {
            return Err(self.err("SMEM", "smem-budget", format!("{smem} bytes of SMEM requested, {} has {}", self.t, self.t.smem_bytes), "keep prefetch tables and SMEM buffers under 1 MiB"));
        }
        Ok(())
    }

    fn body(&self) -> Result<()> {
        let mut result = Ok(());
        self.k.walk(self.k.body, &mut |_, d| {
            if result.is_err() {
                return;
            }
            let at = d.loc.clone();
            match &d.inst {
                Inst::Dot { lhs, .. } => {
                    let dt = self.k.ty(*lhs).dtype;
                    if !self.t.matmul_dtypes.contains(&dt) {
                        let ok: Vec<&str> = self.t.matmul_dtypes.iter().map(|d| d.name()).collect();
                        result = Err(self
                            .err("instruction `dot`", "matmul-dtype", format!("{dt} x {dt} matmul is not supported by the {} MXU", self.t), format!("cast the operands to one of: {}", ok.join(", ")))
                            .at(at));
                    }
                }
                Inst::Load { src, .. } | Inst::Store { dst: src, .. } => {
                    let r = self.k.ref_decl(*src);
                    if r.memory == MemorySpace::Any {
                        result = Err(self
                            .err(format!("operand `{}`", r.name), "hbm-direct-access", "the operand stays in HBM (memory space ANY) and cannot be loaded or stored directly", "copy it into VMEM scratch with a DMA")
                            .at(at));
                    } else if r.memory == MemorySpace::Semaphore {
                        result = Err(self.err(format!("{} `{}`", r.kind.name(), r.name), "semaphore-access", "DMA semaphores cannot be loaded or stored", "use them only in dma_start / dma_wait").at(at));
                    }
                }
                Inst::DmaStart { src, dst, sem, .. } | Inst::DmaWait { src, dst, sem, .. } => {
                    result = self.dma(src, dst, *sem).map_err(|e| e.at(at));
                }
                _ => {}
            }
            for &v in &d.results {
                let t = self.k.ty(v);
                if t.rank() == 1 {
                    result = Err(self
                        .err("instruction result", "vector-rank", format!("a rank-1 vector {t}: TPU vectors are at least 2-D"), "keep a leading or trailing dim of 1 (reductions keep their axis)")
                        .at(d.loc.clone()));
                }
            }
        });
        result
    }
}

impl Verifier<'_> {
    /// A copy descriptor: real refs on both sides, a semaphore array, same dtype and box,
    /// and slices that are not statically out of bounds.
    fn dma(&self, src: &DmaRef, dst: &DmaRef, sem: RefId) -> Result<()> {
        let (sd, dd, md) = (self.k.ref_decl(src.r), self.k.ref_decl(dst.r), self.k.ref_decl(sem));
        let subject = format!("DMA `{}` -> `{}`", sd.name, dd.name);
        if md.memory != MemorySpace::Semaphore {
            return Err(self.err(&subject, "dma-semaphore", format!("`{}` is not a DMA semaphore array", md.name), "declare semaphores with `semaphores(n)`"));
        }
        for (side, r) in [("source", sd), ("destination", dd)] {
            if r.memory == MemorySpace::Semaphore {
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
        }
        Ok(())
    }
}

/// Evaluates an index map with no prefetch reads at the given grid indices.
pub fn eval_static(e: &IndexExpr, grid: &[i64]) -> Option<i64> {
    eval_index(e, grid, &mut |_, _| None)
}

/// Evaluates an index map; `prefetch(array, indices)` reads a scalar-prefetch operand.
pub fn eval_index(e: &IndexExpr, grid: &[i64], prefetch: &mut dyn FnMut(RefId, &[i64]) -> Option<i64>) -> Option<i64> {
    Some(match e {
        IndexExpr::Grid(g) => *grid.get(*g)?,
        IndexExpr::Const(c) => *c,
        IndexExpr::Prefetch { array, index } => {
            let mut at = Vec::with_capacity(index.len());
            for i in index {
                at.push(eval_index(i, grid, prefetch)?);
            }
            prefetch(*array, &at)?
        }
        IndexExpr::Bin(op, a, b) => {
            let (a, b) = (eval_index(a, grid, prefetch)?, eval_index(b, grid, prefetch)?);
            match op {
                IndexOp::Add => a.wrapping_add(b),
                IndexOp::Sub => a.wrapping_sub(b),
                IndexOp::Mul => a.wrapping_mul(b),
                IndexOp::Div => a.checked_div(b)?,
                IndexOp::Rem => a.checked_rem(b)?,
                IndexOp::Min => a.min(b),
                IndexOp::Max => a.max(b),
            }
        }
    })
}
