//! Nested pipelining inside a kernel, as Pallas' `pltpu.emit_pipeline`: a loop over
//! sub-blocks of operands left in HBM (memory space ANY), with the double-buffered DMA
//! generated for the user. [`KernelBuilder::emit_pipeline`] expands to IR the rest of
//! Tessera already knows (VMEM scratch of two slots per operand, DMA semaphores, a `for`
//! loop with `dma_start`/`dma_wait`), so the verifier (DMA tiling and bounds, the VMEM
//! budget of the buffers), the interpreter, the compiled CPU backends and Mosaic all
//! handle it with no pipeline-specific code.
//!
//! For `steps` steps `i = 0..steps`, with `slot = i % 2`:
//!
//! ```text
//! prologue:  start in[idx(0)] -> in_buf[0]                        (every input)
//! step i:    start in[idx(i+1)] -> in_buf[1 - slot]  if i + 1 < steps
//!            wait  in[idx(i)] -> in_buf[slot]
//!            wait  out_buf[slot] -> out[idx(i-2)]     if i >= 2   (the slot's last write-back)
//!            body(i, blocks)                          (reads in_buf[slot], writes out_buf[slot])
//!            start out_buf[slot] -> out[idx(i)]
//! epilogue:  wait the last two write-backs
//! ```
//!
//! The copies run while the body computes: the next input sub-block lands in the other
//! slot, and an output sub-block's write-back overlaps the next step. Everything is
//! waited for before the pipeline returns, so it can sit in any grid step.

use crate::builder::{ds, Arg, Index, KernelBuilder};
use crate::ir::*;
use crate::types::{DType, MemorySpace};

/// The index map of one pipelined operand: the block indices of step `i` (an i32
/// value); a sub-block starts at `index * block` elements in each dim.
pub type PipeIndexMap<'a> = &'a dyn Fn(&mut KernelBuilder, Value) -> Vec<Arg>;

/// One operand of a nested pipeline (`emit_pipeline`'s `in_specs` / `out_specs` entry): an
/// ANY input or output, the sub-block shape (one dim per operand dim) and its index map.
pub struct Pipe<'a> {
    pub operand: RefId,
    pub block: Vec<usize>,
    pub index_map: PipeIndexMap<'a>,
}

impl<'a> Pipe<'a> {
    pub fn new(operand: RefId, block: &[usize], index_map: PipeIndexMap<'a>) -> Self {
        Pipe { operand, block: block.to_vec(), index_map }
    }
}

/// The current sub-block of one pipelined operand inside the body: slot `slot` of `buf`
/// (`[2, block..]` VMEM scratch). Read it with [`KernelBuilder::pipe_load`], write an
/// output's with [`KernelBuilder::pipe_store`].
#[derive(Clone, Debug, PartialEq)]
pub struct PipeBlock {
    pub buf: RefId,
    pub slot: Value,
    pub block: Vec<usize>,
}

impl KernelBuilder {
    /// A pipelined loop of `steps` steps over sub-blocks of `pipes` (see the module docs),
    /// carrying `init`: `body(b, i, blocks, carries)` gets the step, one [`PipeBlock`] per
    /// pipe (in order) and the carries, and returns the next carries; the results are the
    /// last carries. Inputs are read-only in the body; every element of an output's
    /// sub-block must be written each step (it is copied back whole).
    pub fn emit_pipeline(&mut self, name: &str, steps: usize, pipes: &[Pipe<'_>], init: &[Value], body: impl FnOnce(&mut Self, Value, &[PipeBlock], &[Value]) -> Vec<Value>) -> Vec<Value> {
        let subject = format!("pipeline `{name}`");
        if steps == 0 || steps > i32::MAX as usize {
            self.fail(&subject, "pipeline-operand", format!("{steps} steps"), "a pipeline runs 1..=2^31 - 1 steps");
            return init.to_vec();
        }
        if pipes.is_empty() {
            self.fail(&subject, "pipeline-operand", "no operands", "pass at least one ANY input or output to pipeline over");
            return init.to_vec();
        }
        for p in pipes {
            let d = self.ref_decl(p.operand).clone();
            let what = format!("{} `{}` of {subject}", d.kind.name(), d.name);
            if !matches!(d.kind, RefKind::Input | RefKind::Output) || d.memory != MemorySpace::Any || d.block.is_some() {
                self.fail(
                    &what,
                    "pipeline-operand",
                    format!("a {} in {} memory; a pipeline streams operands left in HBM", d.kind.name(), d.memory.name()),
                    "declare the operand `Any<..>` (memory space ANY, no block spec): the pipeline moves its sub-blocks itself",
                );
                return init.to_vec();
            }
            if p.block.len() != d.shape.len() || p.block.iter().zip(&d.shape).any(|(&b, &n)| b == 0 || b > n) {
                self.fail(&what, "pipeline-operand", format!("sub-block {:?} of an array {:?}", p.block, d.shape), "give one sub-block dim per array dim, each in 1..=the array dim");
                return init.to_vec();
            }
        }
        // Generated names are unique even when a name repeats (a fragment called twice).
        let mut name = name.to_string();
        let base = name.clone();
        let mut n = 1;
        while self.has_ref(&format!("{name}_sem")) {
            n += 1;
            name = format!("{base}_{n}");
        }
        // Two VMEM slots per operand, two semaphores per operand (one per slot).
        let bufs: Vec<RefId> = pipes
            .iter()
            .enumerate()
            .map(|(n, p)| {
                let d = self.ref_decl(p.operand).clone();
                let shape: Vec<usize> = std::iter::once(2).chain(p.block.iter().copied()).collect();
                self.scratch(&format!("{name}_{}_buf{n}", d.name), d.dtype, &shape, MemorySpace::Vmem)
            })
            .collect();
        let sems = self.semaphores(&format!("{name}_sem"), 2 * pipes.len());
        let is_input: Vec<bool> = pipes.iter().map(|p| self.ref_decl(p.operand).kind == RefKind::Input).collect();

        // The operand's side of step `i`'s copy: `ds(index * block, block)` per dim.
        let hbm = |b: &mut Self, p: &Pipe<'_>, i: Value| -> Vec<Index> {
            let idx = (p.index_map)(b, i);
            if idx.len() != p.block.len() {
                let d = b.ref_decl(p.operand).name.clone();
                b.fail(format!("pipeline operand `{d}`"), "pipeline-operand", format!("the index map gives {} indices for a rank-{} sub-block", idx.len(), p.block.len()), "return one block index per operand dim");
            }
            idx.into_iter().zip(&p.block).map(|(x, &n)| {
                let x = b.lift(x, Some(DType::I32));
                let start = b.mul(x, n as i64);
                ds(start, n)
            }).collect()
        };
        let slot_of = |slot: Value| -> Vec<Index> { vec![ds(slot, 1)] };
        let copy_in = |b: &mut Self, n: usize, i: Value, slot: Value, start: bool| {
            let src = hbm(b, &pipes[n], i);
            let sem = b.add(slot, (2 * n) as i64);
            if start {
                b.dma_start(pipes[n].operand, &src, bufs[n], &slot_of(slot), sems, sem);
            } else {
                b.dma_wait(pipes[n].operand, &src, bufs[n], &slot_of(slot), sems, sem);
            }
        };
        let copy_out = |b: &mut Self, n: usize, i: Value, slot: Value, start: bool| {
            let dst = hbm(b, &pipes[n], i);
            let sem = b.add(slot, (2 * n) as i64);
            if start {
                b.dma_start(bufs[n], &slot_of(slot), pipes[n].operand, &dst, sems, sem);
            } else {
                b.dma_wait(bufs[n], &slot_of(slot), pipes[n].operand, &dst, sems, sem);
            }
        };

        // Prologue: every input's first sub-block into slot 0.
        let (zero, first) = (self.i32(0), self.i32(0));
        for n in (0..pipes.len()).filter(|&n| is_input[n]) {
            copy_in(self, n, first, zero, true);
        }
        let mut body = Some(body);
        let results = self.for_range(0, steps as i64, 1, init, |b, i, carries| {
            let slot = b.binary(BinaryOp::Rem, i, 2);
            let next = b.sub(1, slot);
            let i1 = b.add(i, 1);
            let more = b.cmp(CmpOp::Lt, i1, steps as i64);
            b.when(more, |b| {
                for n in (0..pipes.len()).filter(|&n| is_input[n]) {
                    copy_in(b, n, i1, next, true);
                }
            });
            for n in (0..pipes.len()).filter(|&n| is_input[n]) {
                copy_in(b, n, i, slot, false);
            }
            if steps > 2 {
                // The slot's previous write-back (step i - 2) must land before it is reused.
                let reuse = b.cmp(CmpOp::Ge, i, 2);
                b.when(reuse, |b| {
                    let back = b.sub(i, 2);
                    for n in (0..pipes.len()).filter(|&n| !is_input[n]) {
                        copy_out(b, n, back, slot, false);
                    }
                });
            }
            let blocks: Vec<PipeBlock> = pipes.iter().zip(&bufs).map(|(p, &buf)| PipeBlock { buf, slot, block: p.block.clone() }).collect();
            let next_carries = (body.take().expect("the body is lowered once"))(b, i, &blocks, carries);
            for n in (0..pipes.len()).filter(|&n| !is_input[n]) {
                copy_out(b, n, i, slot, true);
            }
            next_carries
        });
        // Epilogue: the write-backs still in flight (the last two steps').
        for back in steps.saturating_sub(2)..steps {
            let (i, slot) = (self.i32(back as i32), self.i32((back % 2) as i32));
            for n in (0..pipes.len()).filter(|&n| !is_input[n]) {
                copy_out(self, n, i, slot, false);
            }
        }
        results
    }

    /// The current sub-block of a pipelined operand, of the pipe's block shape.
    pub fn pipe_load(&mut self, blk: &PipeBlock) -> Value {
        let mut index = vec![ds(blk.slot, 1)];
        index.extend(blk.block.iter().map(|_| Index::Full));
        let v = self.load(blk.buf, &index);
        self.reshape(v, &blk.block)
    }

    /// Writes `value` (of the pipe's block shape, or a scalar) into the current sub-block
    /// of a pipelined output; it is copied back to HBM after the step's body.
    pub fn pipe_store(&mut self, blk: &PipeBlock, value: impl Into<Arg>) {
        let mut index = vec![ds(blk.slot, 1)];
        index.extend(blk.block.iter().map(|_| Index::Full));
        let mut shape = vec![1];
        shape.extend(&blk.block);
        let v = self.lift(value.into(), Some(self.ref_decl(blk.buf).dtype));
        let v = if self.ty(v).is_scalar() { v } else { self.reshape(v, &shape) };
        self.store(blk.buf, &index, v);
    }
}
