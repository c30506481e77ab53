//! Operands: shapes (and their byte counts, without overflow), memory spaces, block specs,
//! the tiling libtpu requires of blocks, index maps (static bounds and output coverage),
//! and the grid-order rules for revisiting output blocks.

use std::collections::HashSet;

use super::Verifier;
use crate::error::Result;
use crate::ir::*;
use crate::types::{DType, MemorySpace, Semantics};

const GIB: f64 = (1u64 << 30) as f64;

/// The largest grid whose output index maps the verifier walks for `parallel-revisit` (a
/// fraction of a millisecond); larger grids are checked by every CPU backend at run time.
pub const STATIC_REVISIT_STEPS: usize = 1 << 13;

impl Verifier<'_> {
    /// A kernel writes at least one output: a custom call with no results is refused by
    /// Mosaic (`expected named operation to have at least 1 result`), and its work is lost.
    pub(super) fn has_output(&self) -> Result<()> {
        if self.k.refs_of(RefKind::Output).next().is_none() {
            return Err(self.err("outputs", "kernel-outputs", "the kernel has no output", "declare at least one output and store the kernel's result into it (scratch is dropped at the end)"));
        }
        Ok(())
    }

    pub(super) fn operand(&self, r: &RefDecl) -> Result<()> {
        let subject = format!("{} `{}`", r.kind.name(), r.name);
        if r.shape.is_empty() || r.shape.contains(&0) {
            return Err(self.err(&subject, "operand-shape", format!("shape {:?} is empty", r.shape), "operands are arrays of rank >= 1 with non-zero dims"));
        }
        // Element and byte counts must fit a usize (and the padded VMEM footprint too);
        // everything below multiplies shapes.
        let bytes = r.shape.iter().try_fold(r.dtype.bytes(), |n, &d| n.checked_mul(d));
        let padded = self.t.checked_padded_bytes(r.dtype, &r.window());
        let Some(bytes) = bytes.filter(|_| padded.is_some()) else {
            return Err(self.err(&subject, "shape-overflow", format!("shape {:?} of {} has more bytes than a 64-bit count holds", r.shape, r.dtype), "check the shape: its element count overflows"));
        };
        let _ = bytes; // the total is checked by `hbm`
        if r.dtype == DType::Bool {
            // Masks are values in a kernel, not memory: Mosaic has no i1 memrefs.
            return Err(self.err(&subject, "memory-dtype", format!("an array of {} in {}", r.dtype, r.memory.name()), "store masks as int8 or int32 (`mask.cast(i32)`) and compare on load"));
        }
        if r.kind == RefKind::Prefetch && (r.dtype != DType::I32 || r.memory != MemorySpace::Smem) {
            return Err(self.err(&subject, "prefetch-dtype", format!("scalar prefetch is {} in {}", r.dtype, r.memory.name()), "scalar-prefetch operands are int32 arrays in SMEM"));
        }
        if r.memory.is_semaphore() && (r.kind != RefKind::Scratch || r.shape.len() != 1 || r.shape[0] == 0 || r.block.is_some()) {
            return Err(self.err(&subject, "semaphore-decl", format!("a {} in semaphore memory of shape {:?}", r.kind.name(), r.shape), "semaphores are non-empty rank-1 scratch arrays: declare them with `semaphores(n)` / `regular_semaphores(n)`"));
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
                return Err(self.err(&subject, "index-map-operand", format!("the index map {msg}"), "index maps take the grid indices and scalar-prefetch operands only"));
            }
        }
        for (d, &blk) in b.block_shape.iter().enumerate() {
            if blk == Some(0) {
                return Err(self.err(&subject, "block-shape", format!("block dim {d} is 0"), "use block dims of at least 1"));
            }
        }
        self.block_tiling(r, b, &subject)?;
        self.block_bounds(r, b, &subject)
    }

    /// The operands live in HBM together: their bytes must fit what one device may use
    /// (libtpu checks on v6e and tpu7x, `E1000 CompileTimeHbmOom`).
    pub(super) fn hbm(&self) -> Result<()> {
        let operands = self.k.refs.iter().filter(|r| r.kind != RefKind::Scratch);
        let total = operands.clone().map(|r| r.shape.iter().try_fold(r.dtype.bytes(), |n, &d| n.checked_mul(d))).try_fold(0usize, |n, b| n.checked_add(b?));
        let usable = self.t.hbm_usable_bytes;
        if total.is_some_and(|t| t <= usable) {
            return Ok(());
        }
        let biggest = operands.max_by_key(|r| r.shape.iter().fold(r.dtype.bytes(), |n, &d| n.saturating_mul(d))).map(|r| format!("{} `{}` {:?} {}", r.kind.name(), r.name, r.shape, r.dtype)).unwrap_or_default();
        Err(self.err(
            "HBM",
            "hbm-budget",
            format!(
                "the operands take {:.2} GiB together, more than the {:.2} GiB of HBM a {} device can use; the largest is {biggest}",
                total.map_or(f64::INFINITY, |t| t as f64 / GIB),
                usable as f64 / GIB,
                self.t
            ),
            "split the work across calls or devices, or use a smaller dtype",
        ))
    }

    /// libtpu's window rule (E2002): a block dim spans its array dim or is a multiple of
    /// the block tile; a block may be larger than a small array (the excess is padding).
    fn block_tiling(&self, r: &RefDecl, b: &BlockSpec, subject: &str) -> Result<()> {
        let rank = r.shape.len();
        if rank == 1 {
            let (n, full) = (b.window()[0], r.shape[0]);
            let tile = self.t.block_tile_1d(r.dtype);
            if n % tile != 0 && n != full {
                return Err(self.err(
                    subject,
                    "block-tiling-1d",
                    format!("rank-1 block [{n}] of {}: neither a multiple of {tile} (128 x 32 / {} bits) nor the full dim {full}", r.dtype, r.dtype.bits()),
                    tiling_help(n, tile, full),
                ));
            }
            return Ok(());
        }
        let (sub, lane) = self.t.block_tile(r.dtype);
        for (d, (&blk, &full)) in b.block_shape.iter().zip(&r.shape).enumerate() {
            let n = blk.unwrap_or(1);
            let tile = if d + 1 == rank { lane } else if d + 2 == rank { sub } else { 1 };
            let squeezed_ok = blk.is_none() && d + 2 < rank;
            if tile > 1 && n % tile != 0 && n != full && !squeezed_ok {
                let which = if d + 1 == rank { "last" } else { "second-to-last" };
                return Err(self.err(
                    subject,
                    "block-tiling",
                    format!("block {:?}: the {which} dim is {n}, which is neither a multiple of {tile} ({} tiling on {}) nor the full dim {full}", b.window(), r.dtype, self.t),
                    tiling_help(n, tile, full),
                ));
            }
        }
        Ok(())
    }

    /// Every block index the grid can produce must be inside the array; outputs must be
    /// covered. An array dim need not be a multiple of its block dim (nor larger than it):
    /// as in Pallas, the last block then reaches past the end, reads there are undefined
    /// (the interpreter poisons them) and writes there are dropped, so the kernel masks
    /// with iota. libtpu cannot judge any of this: the rules are ours.
    fn block_bounds(&self, r: &RefDecl, b: &BlockSpec, subject: &str) -> Result<()> {
        let blocks: Vec<usize> = b.window().iter().zip(&r.shape).map(|(&n, &full)| full.div_ceil(n)).collect();
        let Some(visited) = self.visited_blocks(b)? else { return Ok(()) };
        for idx in &visited {
            for (d, (&i, &nb)) in idx.iter().zip(&blocks).enumerate() {
                if i < 0 || i as usize >= nb {
                    return Err(self.err(
                        subject,
                        "index-out-of-bounds",
                        format!("the index map gives block index {i} in dim {d}, but the array has {nb} blocks there (ceil({} / {}))", r.shape[d], b.window()[d]),
                        "fix the index map or the grid so block indices stay below the number of blocks",
                    ));
                }
            }
        }
        if r.kind == RefKind::Output {
            let total = blocks.iter().try_fold(1usize, |n, &b| n.checked_mul(b)).unwrap_or(usize::MAX);
            let seen: HashSet<&Vec<i64>> = visited.iter().collect();
            if seen.len() < total {
                return Err(self.err(
                    subject,
                    "output-coverage",
                    format!("the grid writes {} of the output's {total} blocks; the rest would be left uninitialised", seen.len()),
                    "make the grid and index map visit every output block",
                ));
            }
        }
        Ok(())
    }

    /// All block indices an index map produces over the grid, when that is cheap to know
    /// statically (no prefetch reads, grid of at most 2^20 steps).
    pub(super) fn visited_blocks(&self, b: &BlockSpec) -> Result<Option<Vec<Vec<i64>>>> {
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
                row.push(super::eval_static(e, &ids).ok_or_else(|| self.err("index map", "index-map-division", format!("`{e}` divides by zero"), "divide by a non-zero constant"))?);
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
    pub(super) fn output_revisits(&self) -> Result<()> {
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
                    return Err(self.err_at(r,
                        &subject,
                        "reduction-axis-semantics",
                        format!("grid dim {d} is `parallel` but the output's index map does not depend on it, so steps along it write the same block"),
                        format!("mark grid dim {d} `arbitrary` (it is a reduction axis)"),
                    ));
                }
                if let Some(later) = (d + 1..used.len()).find(|&e| used[e] && self.k.grid[e].extent > 1) {
                    return Err(self.err_at(r,
                        &subject,
                        "reduction-axis-order",
                        format!("reduction grid dim {d} comes before dim {later}, which the output's index map uses, so each output block is visited in separate runs"),
                        "put reduction (arbitrary) axes last in the grid",
                    ));
                }
            }
            self.parallel_revisit(r, b)?;
        }
        Ok(())
    }

    /// `parallel-revisit` before any run, for an output whose index map reads no scalar
    /// prefetch: the interpreter's own check (an output block entered by two grid steps that
    /// differ in a `parallel` dim), walking the steps in its order without running the body.
    /// Grids above [`STATIC_REVISIT_STEPS`] steps are left to the run-time check.
    fn parallel_revisit(&self, r: &RefDecl, b: &BlockSpec) -> Result<()> {
        let k = self.k;
        let steps = k.grid.iter().try_fold(1usize, |n, g| n.checked_mul(g.extent));
        if !steps.is_some_and(|n| n <= STATIC_REVISIT_STEPS) || k.grid.iter().all(|g| g.semantics != Semantics::Parallel) {
            return Ok(());
        }
        let mut first: std::collections::HashMap<Vec<i64>, Vec<usize>> = std::collections::HashMap::new();
        let extents: Vec<usize> = k.grid.iter().map(|g| g.extent).collect();
        let mut step = vec![0usize; k.grid.len()];
        loop {
            let at: Vec<i64> = step.iter().map(|&s| s as i64).collect();
            // A map that does not evaluate here is the index-map rules' business.
            let Some(index) = b.index_map.iter().map(|e| super::eval_static(e, &at)).collect::<Option<Vec<i64>>>() else { return Ok(()) };
            let seen = first.entry(index.clone()).or_insert_with(|| step.clone());
            if let Some(d) = (0..step.len()).find(|&d| k.grid[d].semantics == Semantics::Parallel && seen[d] != step[d]) {
                let index: Vec<usize> = index.iter().map(|&i| i.max(0) as usize).collect();
                return Err(crate::interp::parallel_revisit(k, r, &index, seen, &step, d).at(r.loc.clone()));
            }
            // Row-major, the last grid dim fastest, as the pipeline runs.
            if !crate::interp::next_index(&mut step, &extents) {
                return Ok(());
            }
        }
    }
}

/// The help of a block dim `n` that is neither a multiple of `tile` nor the full dim `full`:
/// the next multiple of the tile, or (when that passes the array) the full dim first.
fn tiling_help(n: usize, tile: usize, full: usize) -> String {
    let up = n.div_ceil(tile) * tile;
    if up > full {
        format!("use the full dim {full} (or {up}, a multiple of {tile} that pads past it)")
    } else {
        format!("use a multiple of {tile} (e.g. {up}) or {full}")
    }
}
