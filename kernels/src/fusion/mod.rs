//! DeferAndFuse's engine, independent of torch: a graph of tensor ops ([`graph`]), a
//! planner that cuts it into row kernels and anchors ([`planner`]), generators that build
//! each kernel with the dsl builder ([`generate`] for row kernels, [`anchor`] for matmuls
//! with their epilogue and copies between rows), and a [`Program`] that picks blocks,
//! verifies every kernel, runs them on a CPU backend, and is cached by structure.
//! A program also runs launch by launch on a device: each [`Launch`] names its buffers
//! ([`Buf`]), so the torch front-end's `tpu` path walks them with device memory and submits
//! each kernel lowered by `tessera_codegen` (one TorchTPU custom kernel per launch).
//!
//! # What a graph holds
//!
//! Pointwise ops (unary, binary with torch broadcasting, comparisons, `where`, `clamp`,
//! casts) over f32, bf16 and bool tensors with torch's type promotion (dimensioned
//! tensors beat 0-dim tensors beat Python numbers within a category, float beats bool);
//! row ops over the last dim (`sum`, `mean`, `amax`, `amin` with or without keepdim,
//! `softmax`, `log_softmax`); column sums (over every dim but the last); views (reshapes of contiguous tensors). Every tensor is
//! seen as rows: `shape[..-1]` flattened by the last dim (a contiguous tensor is exactly
//! that row-major matrix).
//!
//! # The rules (Inductor / XLA style)
//!
//! 1. **Pointwise chains fuse**: a pointwise node joins the open kernel when its values
//!    broadcast with the kernel's row space (every value is `rows or 1` by `cols or 1`; a
//!    buffer it reads may also have rows dividing the kernel's, read periodically: a
//!    `[b, n]` bias or mask of an `[a, b, n]` result, HF RoPE's cos `[1, 1, s, d]` of a
//!    `[b, h, s, d]` one; the kernel's blocks then divide `b`, see *Blocks* below).
//!    The space may grow from 1 (a `[m, 1]` chain meeting `[m, n]` values becomes `[m, n]`).
//! 2. **A row op fuses with its producers and its same-row-space consumers**: a kernel
//!    walks blocks of whole rows, so a row op over the kernel's `cols` sees every element
//!    of its rows. RMSNorm `x * rsqrt(mean(x^2) + eps) * w` is one kernel; so is softmax
//!    written as `exp(x - amax) / sum(exp(x - amax))`, and any number of row ops over the
//!    same rows (there is no "one reduction per kernel" limit: the rows are in VMEM).
//! 3. **Nothing is computed twice**: each node is in exactly one kernel; a value a later
//!    kernel reads is stored once and read from memory.
//! 4. **A view that keeps the rows is free** (`[4, 3, 8] -> [12, 8]`): inside a kernel it
//!    is the same value. A view that changes the rows (a non-keepdim reduction's `[m]`,
//!    `[m, n] -> [m * n]`) is a reinterpretation of stored memory: its source is stored,
//!    and a node reading the view starts a new kernel when the source is computed by the
//!    open one.
//! 5. **Caps**: at most [`planner::MAX_READS`] buffers read and [`planner::MAX_NODES`]
//!    nodes per kernel; a full kernel ends and the next node starts a new one.
//! 6. **A column sum** (`x.sum(0)` of `[m, n]`, over every dim but the last: bias and norm
//!    weight gradients) fuses with its producers in the kernel's row space: an f32 `[1, n]`
//!    accumulator over the row blocks, so that kernel's grid runs in order (`arbitrary`),
//!    its rows are fixed, and a node reading the sum starts the next kernel (the sum is
//!    whole only after the last block). Rows past the end of a partial last block are masked.
//! 7. **Only stored values cost memory**: a node is stored when a later kernel reads it or
//!    the caller takes it (`live`); every other value lives only in the kernel's vregs.
//!    Nodes no live result needs are not computed at all (so no kernel is without outputs).
//!
//! 8. **A matmul is an anchor** (`mm`, `bmm`, `addmm`, batched over leading dims; see
//!    [`anchor`]): it starts its own kernel, reads its operands whole from memory (a
//!    [`NodeOp::Transpose`] operand in place, through batch reshapes: `linear`'s `w.t()` and
//!    attention's `k.transpose(-1, -2)` copy nothing; a GQA `repeat_kv` expand in place, at
//!    batch `g / repeat`), accumulates in f32 (bf16 operands stay bf16 on the MXU; a `[n]`
//!    bias is added in f32 before the one rounding, as `addmm`), and takes an **epilogue**:
//!    the following pointwise nodes in its output space `[batch * m, n]` (bias, activation,
//!    residual, scale, casts, a second matmul's `silu(a) * b` reading the first from memory),
//!    whose reads are all of the space, one row, or one batch's `[m, n]` (a causal mask);
//!    and a row op over `n` when `n` fits one column block ([`planner::MAX_EPILOGUE_ROW`],
//!    512: the block then holds whole rows), with the row's column values after it
//!    (scores + mask + softmax, o_proj + residual + RMSNorm are one kernel each).
//! 9. **Views that move elements between rows** are values of the source's memory
//!    ([`Graph::strided`] classifies torch's shape/strides/offset): a reshape (free), a
//!    transpose of the last two dims, or a [`graph::Gather`] (permutes of leading dims,
//!    slice/select of leading dims, inner-dim expands, a column window). A gather or
//!    transpose is a copy kernel of its own (an anchor with no epilogue; the slab / row
//!    copies of [`anchor`]); a column window that keeps the rows (`x[..., a:b]`, or a
//!    rows-keeping view of one) is read by row kernels and `cat` straight from the source's memory (a lane slice of the loaded
//!    block), never copied. A copy of a copy (`clone` / `contiguous` of a gathered view) is
//!    one copy.
//! 10. **A pointwise kernel is sunk into its one reader**: when the greedy pass closed a
//!     row kernel of pointwise nodes (no row op or column sum, no live result) whose results
//!     only one later row kernel over the same rows reads, in their own layout and through
//!     rows-keeping views, its nodes move into that kernel and nothing is stored (`x * 2`,
//!     closed by a transpose's copy kernel, joins `x * 2 + t` of the transposed `t`).
//! 11. **A sum over a run of dims before the last is a matmul** (GQA `repeat_kv`'s
//!     backward, `[b, hkv, rep, s, d].sum(2)`): when the summed dims are the batches of a
//!     matmul (through reshapes, maybe transposed: autograd's dV and dK),
//!     [`Graph::sum_matmul_batches`] folds them into its contraction (`k' = rep * k`, both
//!     operands plain views; one f32 accumulation and one rounding where torch rounds each
//!     batch's product first), so the per-head products never exist; otherwise the
//!     front-end records `ones[1, r] @ x.view(lead, r, rest)` (a matmul whose shared
//!     operand is a row of ones). The front-end also joins `slice_backward(g1, .., 0, c) +
//!     slice_backward(g2, .., c, n)` (RoPE's two halves) into one `cat(g1, g2)`.
//! 12. **`cat` over the last dim is a row-kernel node**: its pieces are always read from
//!     memory (a window of a source, a negated one: rotate_half's `-x[..., d/2:]`, or one
//!     broadcast element: `slice_backward`'s zeros), each stored at its column offset of an
//!     f32 VMEM scratch `[bm, cols]` that is then the node's value; only the result must be
//!     in the kernel's row space. A piece the open kernel computes ends the kernel (it must
//!     be stored first). So RoPE's `q * cos + rotate_half(q) * sin` is one kernel.
//!
//! 13. **Matmuls sharing an operand are one kernel** (horizontal fusion): a matmul of the
//!     same kind (transposes, batch, bias or not) and output shape as a recent anchor (up
//!     to [`planner::SIBLING_REACH`] kernels back), one operand the same memory in the same
//!     shape and the other alike, or both alike and neither shared, joins that anchor's
//!     kernel as a sibling when both its operands are ready before that kernel runs. The shared block is read once per grid
//!     step and the epilogue sees every product: a SwiGLU MLP's gate and up projections and
//!     `silu(gate) * up` are one kernel, `k` and `v` join `q`'s across the head split's copy
//!     (when GQA makes `q` wider, `k` and `v` still pair), and the backward's weight
//!     gradients `g1^T @ x`, `g2^T @ x` pair on `x`; products sharing nothing pair too, so
//!     the backward's `dx = g_gate @ w1 + g_up @ w3` is one kernel with its sum (tiny Llama
//!     fwd+bwd: 100 kernels to 94; MoE block 69 to 65). Products of different shapes do not pair
//!     (one grid walks them all), nor a linear's `dx = g @ w` with its `dw = g^T @ x`.
//! 14. **A node that the last kernel refuses joins an earlier one it fits** (up to
//!     [`planner::JOIN_REACH`] kernels back, the nearest first), by rules 1-8 as if that
//!     kernel were open, when every operand is computed by that kernel or stored before it
//!     runs. Autograd records a matmul's backward between the pointwise nodes of the
//!     gradient they share: SwiGLU's backward `g * up`, `g * silu(gate)` and the silu
//!     derivative join the epilogue of the matmul that makes `g`, so the weight gradients
//!     then pair as siblings (rule 13) and nothing between is stored (tiny Llama fwd+bwd:
//!     117 kernels to 100; the MoE block of `test_fusion_models.py` 86 to 69).
//!
//! Cases that deliberately do not fuse (the open kernel ends, the node starts the next,
//! unless rule 14 finds it an earlier kernel):
//! a matmul or copy after anything (each starts a kernel); a `cat` of a piece the open
//! kernel computes; anything after a copy kernel (it
//! reads the copy from memory); into a matmul epilogue: a row op over a tiled `n` (more
//! than 512 columns: a block would see part of its row), a column sum, an `expand`, a
//! periodic read other than one batch's `[m, n]`, a column window (read from memory by the
//! next row kernel instead), and a second matmul (the anchor's inputs are whole tensors; a
//! sibling, rule 13, is computed beside the anchor, not from its epilogue);
//! reading a column sum the open kernel computes;
//! a row op over a different row length than the kernel's (`x.sum(-1)` then a row op over
//! a `[m, 1]` column); a node whose values do not broadcast with the kernel's row space
//! (`[m, n]` values after `[k, n]` ones); reading a row-changing view of a value the open
//! kernel computes. Refused when recorded (the front-end runs the op eagerly, the reason
//! is the error's rule): dtypes other than f32/bf16/bool (`fusion-dtype`), broadcasts
//! over inner leading dims (`[4, 1, 8]` into `[4, 3, 8]`:
//! `fusion-broadcast-rows`; `[3, 8]` into `[4, 3, 8]` fuses, read periodically; for a
//! pointwise op the front-end then expands the operand by a gather copy, a stride-0
//! [`Graph::strided`] view, unless it broadcasts over the last dim too: a causal mask
//! `[b, 1, s, s]` plus scores `[b, h, s, s]`), rows wider than [`graph::MAX_ROW`] (`fusion-row-width`),
//! empty tensors (`fusion-empty`), bool arithmetic, Python numbers f32 cannot hold
//! (`fusion-scalar`), reductions over other dims than the last (but the sums of rules 6 and
//! 11; a sum over dims that are not one run, `x.sum((0, 2))`, is `sum-dim`), matmuls of mixed dtypes or
//! 1-d operands, batch dims that differ on both sides (`fusion-broadcast`), contractions
//! over more than [`graph::MAX_ROW`], views whose last dim is strided or whose strides are
//! not dims of the source (`fusion-strided-view`: diagonals, steps), transposes of more
//! than [`graph::MAX_TRANSPOSE`] elements per matrix as values (`fusion-transpose-size`),
//! `cat` over other dims (the front-end records a `cat` of one piece and empty ones as a
//! copy), and indexing, which the front-end does not record: `embedding`, `index`,
//! `index_select`, `index_add`, `index_put`, `scatter`, `topk`, `nll_loss` and their
//! backwards, integer (int64) index arithmetic, and `nonzero`, whose result's shape depends
//! on the values (it always flushes). (The front-end does record `select_backward` of a
//! leading dim, as a `where` of a row mask, and a float tensor times a bool one, the bool
//! cast to the float dtype.)
//!
//! # Numerics
//!
//! f32 math for every float (bf16 is upcast on load; sums accumulate in f32); a bf16 node
//! rounds to bf16 after its op as torch's CPU kernels do; NaN propagates as in torch
//! (`max`/`min`/`amax`/`clamp`/`relu` are NaN-propagating). Sums are pairwise per row,
//! torch's are cascaded: they differ by rounding only.
//!
//! # Blocks, verification, cache
//!
//! A kernel's block is `bm` whole rows: [`RowTiles`] (about 1 MiB f32 blocks, sublanes
//! of the widest-tiled dtype it touches) for `reads + stored + 2` streams, lowered to a
//! multiple of the sublanes dividing the rows when one is at least half of it (no partial
//! last block). With periodic reads the block divides their rows: a multiple of the
//! sublanes when one does, else the largest divisor of the period that fits, and then every
//! many-row operand is declared *stacked*, `[rows / bm, bm, cols]` in blocks
//! `[1 (squeezed), bm, cols]` (the same memory; a block whole in its last two dims tiles for
//! any `bm`, so a cos of `s = 20` rows needs no copy). The scoped VMEM
//! limit is raised to what the verifier counts (`fit_vmem_limit`); a kernel the verifier
//! still refuses for VMEM is retried with half the rows, any other refusal is the
//! program's error (the front-end falls back to eager and reports it). Programs are
//! cached by their structural key (every node's op, operands, dtype and shape; the live
//! nodes; the target) in an LRU of [`cache_capacity`] entries (`TESSERA_FUSION_CACHE`,
//! default 256); failures are cached too, a panic while planning among them (an engine bug,
//! reported as `fusion-internal` so the front-end runs the ops eagerly instead of crashing).

pub mod anchor;
pub mod generate;
pub mod graph;
pub mod planner;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use tessera_dsl::interp::{Array, Fill, HostData, HostMut, HostRef};
use tessera_dsl::{DType, Executor, Kernel, KernelError, RefKind, Target, Type};

pub use graph::{Binary, CmpOp, Graph, Node, NodeId, NodeOp, Operand, RowOp, Unary};
pub use planner::{Partition, Partitioning, Read};

use crate::blocks::{fit_vmem_limit, RowTiles, ROW_BLOCK_BYTES};
use generate::memory_dtype;

/// Where a kernel operand's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// Graph input `i`.
    Input(usize),
    /// The caller's output `k` (`live[k]`).
    Output(usize),
    /// A buffer the program allocates for the run (read by a later kernel only).
    Temp(usize),
}

#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: Kernel,
    pub inputs: Vec<(Buf, Vec<usize>)>,
    pub outputs: Vec<(Buf, Vec<usize>)>,
}

/// A planned, generated and verified graph, ready to run.
#[derive(Clone, Debug)]
pub struct Program {
    pub graph: Graph,
    pub live: Vec<NodeId>,
    pub target: Target,
    pub partitioning: Partitioning,
    pub launches: Vec<Launch>,
    /// Dtype (in memory) and element count of each temporary.
    pub temps: Vec<(DType, usize)>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The largest multiple of `sub` at most `bm` that divides `rows`, when it is at least half
/// of `bm`; else `bm`. Whole blocks only: the CPU backends then read and write the caller's
/// memory in place (a partial last block sends the operand through copied windows, which
/// made RMSNorm over 4096 rows in 48-row blocks several times slower), and the TPU has no
/// masked last step.
fn dividing_block(rows: usize, bm: usize, sub: usize) -> usize {
    if rows.is_multiple_of(bm) || sub == 0 {
        return bm;
    }
    (bm / 2..=bm).rev().find(|&d| d > 0 && d.is_multiple_of(sub) && rows.is_multiple_of(d)).unwrap_or(bm)
}

fn sublanes(dtypes: impl Iterator<Item = DType>, target: &Target) -> usize {
    dtypes.map(|d| target.tiling(d).0).max().unwrap_or(8)
}

impl Program {
    /// Plans `graph` for the results `live` (each a distinct memory: no two live nodes
    /// may be views of one another), generates and verifies every kernel for `target`.
    pub fn build(graph: &Graph, live: &[NodeId], target: &Target) -> Result<Program, KernelError> {
        let mut roots = Vec::new();
        for &l in live {
            if l >= graph.len() {
                return Err(KernelError::new("fusion", format!("live node %{l}"), "fusion-operand", format!("the graph has {} nodes", graph.len()), "name nodes of this graph"));
            }
            let r = graph.storage(l);
            if roots.contains(&r) {
                return Err(KernelError::new("fusion", format!("live node %{l}"), "fusion-output-alias", format!("its memory is that of another live node (node %{r})"), "take one tensor per memory; its views share it"));
            }
            roots.push(r);
        }
        let partitioning = planner::partition(graph, live)?;
        let mut bufs: HashMap<NodeId, Buf> = HashMap::new();
        for (i, n) in graph.nodes.iter().enumerate() {
            if let NodeOp::Input(k) = n.op {
                bufs.insert(i, Buf::Input(k));
            }
        }
        for (k, &r) in roots.iter().enumerate() {
            bufs.insert(r, Buf::Output(k));
        }
        let mut temps = Vec::new();
        for p in &partitioning.parts {
            for &o in &p.outputs {
                bufs.entry(o).or_insert_with(|| {
                    let n = graph.node(o);
                    temps.push((memory_dtype(n.dtype), n.shape.iter().product()));
                    Buf::Temp(temps.len() - 1)
                });
            }
        }
        let mut launches = Vec::new();
        for (i, p) in partitioning.parts.iter().enumerate() {
            let kernel = if p.anchor.is_some() { anchor::kernel(graph, p, i, target)? } else { Self::kernel(graph, p, i, target)? };
            // Each buffer is passed in the shape its kernel declares (rows for row kernels,
            // batched or N-d for anchors).
            let inputs = p.reads.iter().zip(kernel.refs_of(RefKind::Input)).map(|(r, (_, d))| (bufs[&r.storage], d.shape.clone())).collect();
            let outputs = p.outputs.iter().zip(kernel.refs_of(RefKind::Output)).map(|(&o, (_, d))| (bufs[&o], d.shape.clone())).collect();
            launches.push(Launch { kernel, inputs, outputs });
        }
        Ok(Program { graph: graph.clone(), live: live.to_vec(), target: *target, partitioning, launches, temps })
    }

    /// Generates partition `p`'s kernel with the largest block of whole rows that the
    /// verifier accepts.
    fn kernel(g: &Graph, p: &Partition, index: usize, target: &Target) -> Result<Kernel, KernelError> {
        let dtypes = p.reads.iter().map(|r| g.node(r.storage).dtype).chain(p.outputs.iter().map(|&o| g.node(o).dtype)).map(memory_dtype);
        let sub = sublanes(dtypes, target);
        let streams = p.reads.len() + p.outputs.len() + 2;
        let limit = target.default_scoped_vmem_bytes / (4 * streams);
        let tiles = RowTiles::new(p.rows, p.cols, sub, ROW_BLOCK_BYTES.min(limit), limit);
        let mut bm = dividing_block(p.rows, tiles.bm, sub);
        // Periodic reads (rows dividing the kernel's): blocks divide them. A block of a
        // multiple of the sublanes when one divides the period, else the largest divisor
        // of the period that fits, every operand then stacked `[rows / bm, bm, cols]`
        // (a block `[bm, cols]` of whole dims, which any `bm` tiles).
        let period = p.reads.iter().filter(|r| r.rows != p.rows && r.rows != 1).fold(0, |g, r| gcd(g, r.rows));
        let mut stacked = false;
        if period > 0 {
            let cap = bm.max(sub).min(period);
            match (1..=cap).rev().find(|&d| period.is_multiple_of(d) && d.is_multiple_of(sub)) {
                Some(d) => bm = d,
                None => {
                    bm = (1..=cap).rev().find(|&d| period.is_multiple_of(d)).unwrap_or(1);
                    stacked = true;
                }
            }
        }
        loop {
            let k = generate::kernel(g, p, index, bm, stacked)?;
            let k = fit_vmem_limit(k, target);
            let step = if stacked { 1 } else { sub };
            match tessera_dsl::verify::verify(&k, target) {
                Ok(()) => return Ok(k),
                Err(e) if e.rule.contains("vmem") && bm > step && (bm / 2).is_multiple_of(step) && bm.is_multiple_of(2) && (period == 0 || period.is_multiple_of(bm / 2)) => bm /= 2,
                Err(e) => return Err(e),
            }
        }
    }

    /// The memory dtype and shape the caller passes for each graph input (bool as i8).
    pub fn input_types(&self) -> Vec<Type> {
        self.graph.nodes.iter().filter(|n| matches!(n.op, NodeOp::Input(_))).map(|n| Type::vector(memory_dtype(n.dtype), &n.shape)).collect()
    }

    /// The memory dtype and shape of each output (`live[k]`'s; bool as i8).
    pub fn output_types(&self) -> Vec<Type> {
        self.live
            .iter()
            .map(|&l| {
                let n = self.graph.node(l);
                Type::vector(memory_dtype(n.dtype), &n.shape)
            })
            .collect()
    }

    fn check(what: &str, i: usize, want: &Type, dtype: DType, len: usize) -> Result<(), KernelError> {
        let rule = if what == "input" { ("argument-dtype", "argument-shape") } else { ("output-dtype", "output-shape") };
        if dtype != want.dtype {
            return Err(KernelError::new("fusion", format!("{what} {i}"), rule.0, format!("a {dtype} buffer for {want}"), format!("pass {} memory (bool as i8)", want.dtype)));
        }
        if len != want.num_elements() {
            return Err(KernelError::new("fusion", format!("{what} {i}"), rule.1, format!("{len} elements for {want}"), "pass a contiguous tensor of the recorded shape"));
        }
        Ok(())
    }

    /// Runs every kernel with `exec`: `inputs` are the graph inputs, `outputs` the live
    /// nodes' memory (both as [`Program::input_types`] / [`Program::output_types`]; any
    /// shape of the right element count). Outputs must not overlap inputs.
    pub fn run_into(&self, exec: &dyn Executor, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<(), KernelError> {
        let (it, ot) = (self.input_types(), self.output_types());
        if inputs.len() != it.len() || outputs.len() != ot.len() {
            return Err(KernelError::new(
                "fusion",
                "arguments",
                "argument-count",
                format!("{} inputs and {} outputs for a program of {} and {}", inputs.len(), outputs.len(), it.len(), ot.len()),
                "pass one buffer per graph input and per live node",
            ));
        }
        for (i, (a, t)) in inputs.iter().zip(&it).enumerate() {
            Self::check("input", i, t, a.data.dtype(), a.data.len())?;
        }
        for (i, (a, t)) in outputs.iter().zip(&ot).enumerate() {
            Self::check("output", i, t, a.data.dtype(), a.data.len())?;
        }
        let mut temps: Vec<Option<Array>> = Vec::new();
        for &(d, n) in &self.temps {
            let a = Array::try_filled(d, &[n], Fill::Poison).map_err(|e| KernelError::new("fusion", "a temporary", "host-memory", e.to_string(), "use smaller tensors"))?;
            temps.push(Some(a));
        }
        let mut outs: Vec<Option<&mut HostMut<'_>>> = outputs.iter_mut().map(Some).collect();
        for l in &self.launches {
            // Take this launch's destinations out, then borrow the rest to read.
            let mut dst_out: Vec<(usize, &mut HostMut<'_>)> = Vec::new();
            let mut dst_tmp: Vec<(usize, Array)> = Vec::new();
            for (b, _) in &l.outputs {
                match *b {
                    Buf::Output(k) => dst_out.push((k, outs[k].take().expect("each output is written by one kernel"))),
                    Buf::Temp(t) => dst_tmp.push((t, temps[t].take().expect("each temporary is written by one kernel"))),
                    Buf::Input(_) => unreachable!("inputs are never written"),
                }
            }
            let result = {
                let ins: Vec<HostRef<'_>> = l
                    .inputs
                    .iter()
                    .map(|(b, shape)| {
                        let data: HostData<'_> = match *b {
                            Buf::Input(i) => inputs[i].data,
                            Buf::Output(k) => outs[k].as_deref().expect("read after written").data.reborrow(),
                            Buf::Temp(t) => temps[t].as_ref().expect("read after written").as_host().data,
                        };
                        HostRef { shape, data }
                    })
                    .collect();
                let (mut oi, mut ti) = (dst_out.iter_mut(), dst_tmp.iter_mut());
                let mut views: Vec<HostMut<'_>> = l
                    .outputs
                    .iter()
                    .map(|(b, shape)| match b {
                        Buf::Output(_) => HostMut { shape, data: oi.next().expect("one per output").1.data.reborrow_mut() },
                        _ => HostMut { shape, data: ti.next().expect("one per temporary").1.as_host_mut().data },
                    })
                    .collect();
                exec.run_into(&l.kernel, &ins, &mut views)
            };
            for (k, o) in dst_out {
                outs[k] = Some(o);
            }
            for (t, a) in dst_tmp {
                temps[t] = Some(a);
            }
            result?;
        }
        Ok(())
    }

    /// [`Program::run_into`] allocating the outputs.
    pub fn run(&self, exec: &dyn Executor, inputs: &[&Array]) -> Result<Vec<Array>, KernelError> {
        let mut outs = Vec::new();
        for t in self.output_types() {
            outs.push(Array::try_filled(t.dtype, &t.shape, Fill::Poison).map_err(|e| KernelError::new("fusion", "an output", "host-memory", e.to_string(), "use smaller tensors"))?);
        }
        let ins: Vec<HostRef<'_>> = inputs.iter().map(|a| a.as_host()).collect();
        let mut views: Vec<HostMut<'_>> = outs.iter_mut().map(Array::as_host_mut).collect();
        self.run_into(exec, &ins, &mut views)?;
        drop(views);
        Ok(outs)
    }

    /// The graph, its partition (with why each kernel starts) and each kernel's IR.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# graph (live: {:?}, target {})\n{}", self.live.iter().map(|l| format!("%{l}")).collect::<Vec<_>>(), self.target.name, self.graph);
        for (i, (p, l)) in self.partitioning.parts.iter().zip(&self.launches).enumerate() {
            let _ = writeln!(
                s,
                "# kernel {i}: nodes {:?} over {}x{} rows (started: {}); reads {:?}; stores {:?}",
                p.nodes,
                p.rows,
                p.cols,
                p.cut,
                p.reads.iter().map(|r| format!("%{}[{}x{}]", r.storage, r.rows, r.cols)).collect::<Vec<_>>(),
                p.outputs.iter().map(|o| format!("%{o}")).collect::<Vec<_>>()
            );
            let _ = writeln!(s, "{}", l.kernel);
        }
        s
    }
}

// ---- the program cache -----------------------------------------------------------------------

type Entry = (Result<Arc<Program>, KernelError>, u64);

struct Cache {
    map: HashMap<String, Entry>,
    tick: u64,
    hits: u64,
    misses: u64,
    capacity: usize,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// Hits, misses, entries and capacity of the program cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: usize,
    pub capacity: usize,
}

fn default_capacity() -> usize {
    std::env::var("TESSERA_FUSION_CACHE").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(256)
}

fn with_cache<R>(f: impl FnOnce(&mut Cache) -> R) -> R {
    let mut g = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let c = g.get_or_insert_with(|| Cache { map: HashMap::new(), tick: 0, hits: 0, misses: 0, capacity: default_capacity() });
    f(c)
}

pub fn cache_capacity() -> usize {
    with_cache(|c| c.capacity)
}

pub fn cache_stats() -> CacheStats {
    with_cache(|c| CacheStats { hits: c.hits, misses: c.misses, entries: c.map.len(), capacity: c.capacity })
}

pub fn clear_cache() {
    with_cache(|c| {
        c.map.clear();
        c.hits = 0;
        c.misses = 0;
    })
}

/// The structural key of a program: the graph, the live nodes and the target.
pub fn key(graph: &Graph, live: &[NodeId], target: &Target) -> String {
    format!("{}live {live:?}\ntarget {}", graph.key(), target.name)
}

/// The cached program for (`graph`, `live`, `target`), built on a miss; and whether it
/// was a hit.
/// `f`'s result, with a panic inside it (a bug in the engine, never the user's input) turned
/// into a `fusion-internal` error, so that a caller such as the torch front-end runs the ops
/// eagerly and reports why instead of crashing. `f` must leave nothing half-updated when it
/// unwinds ([`Program::build`] reads its graph and returns a value).
fn unpanicked<T>(f: impl FnOnce() -> Result<T, KernelError>) -> Result<T, KernelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned()).unwrap_or_default();
        Err(KernelError::new(
            "fusion",
            "the planner",
            "fusion-internal",
            format!("internal error while planning this graph: {what}"),
            "this is a bug in Tessera's fusion engine: the ops run eagerly; please report it with the graph (TESSERA_DUMP_FUSION=DIR writes it)",
        ))
    })
}

pub fn program(graph: &Graph, live: &[NodeId], target: &Target) -> (Result<Arc<Program>, KernelError>, bool) {
    let k = key(graph, live, target);
    let found = with_cache(|c| {
        c.tick += 1;
        let t = c.tick;
        match c.map.get_mut(&k) {
            Some(e) => {
                e.1 = t;
                c.hits += 1;
                Some(e.0.clone())
            }
            None => {
                c.misses += 1;
                None
            }
        }
    });
    if let Some(r) = found {
        return (r, true);
    }
    let built = unpanicked(|| Program::build(graph, live, target)).map(Arc::new);
    with_cache(|c| {
        while c.map.len() >= c.capacity {
            let Some(oldest) = c.map.iter().min_by_key(|(_, e)| e.1).map(|(k, _)| k.clone()) else { break };
            c.map.remove(&oldest);
        }
        c.tick += 1;
        c.map.insert(k, (built.clone(), c.tick));
    });
    (built, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_planning_is_a_fusion_internal_error() {
        let r: Result<(), _> = unpanicked(|| panic!("no entry found for key"));
        let e = r.unwrap_err();
        assert_eq!(e.rule, "fusion-internal", "{e}");
        assert!(e.to_string().contains("no entry found for key") && e.to_string().contains("eagerly"), "{e}");
        let fine: Result<u32, KernelError> = unpanicked(|| Ok(7));
        assert_eq!(fine.unwrap(), 7);
    }
}
