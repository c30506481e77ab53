//! Anchor kernels: a matmul with its fused epilogue, and the copies that move elements
//! between rows (transpose of the last two dims, [`Gather`] views; `cat` over the last dim
//! is a row-kernel node, see [`super::generate`]).
//! Each is built with [`KernelBuilder`]; blocks are chosen here and verified (VMEM
//! included) before the kernel is returned.
//!
//! **Matmul.** Grid `(batch, m / bm, n / bn, k / bk)`, the last axis `arbitrary`: an f32
//! `[bm, bn]` accumulator scratch is zeroed at `k = 0` and the output block written at the
//! last `k` step (with one `k` block the dot's value is used directly). Operands are 3-d
//! `[batch or 1, rows, cols]` blocks with the batch squeezed (an operand without batch dims
//! is read at batch 0 by every step); a transposed operand is read in its stored layout and
//! the dot contracts its first dim (`dot_tn` / `dot_t`). Blocks: the largest multiple of
//! the dim's alignment that divides it (`bm` sublanes, or 128 when it is a transposed `a`'s
//! lane dim; `bk`, `bn` 128) up to (256, 512, 512), else the whole dim; halved while the
//! verifier refuses the kernel for VMEM. The epilogue runs in the output block's space
//! `[bm, bn]`: an epilogue read is `[bm or 1, bn or 1]` at block `(row block or 0, j or 0)`.
//! Sibling matmuls (rule 13) are more dots in the same grid steps: the shared operand's block
//! is loaded once, each product has its own accumulator, and the epilogue sees them all.
//!
//! **Copies.** A [`Gather`] copies one slab `[L, d]` per step (`L` the result's
//! second-to-last dim) when the source dim it walks can be blocked that way (block-aligned
//! start, sublane-aligned or whole `L`, the source's last dim lane-aligned or the source's
//! trailing dims all of it), a broadcast row when that dim is a broadcast, else one row
//! per step; the column window is a static slice of the loaded block. A transpose loads
//! one whole `[r, c]` matrix per batch step.

use std::collections::HashMap;

use tessera_dsl::{ds, BlockSpec, CmpOp, DType, Index, IndexExpr, IndexOp, Kernel, KernelBuilder, KernelError, MemorySpace, Semantics, Target, Value};

use super::generate::{memory_dtype, Gen};
use super::graph::{Gather, Graph, NodeId, NodeOp, Operand};
use super::planner::Partition;
use super::sublanes;
use crate::blocks::fit_vmem_limit;

fn add(a: IndexExpr, b: IndexExpr) -> IndexExpr {
    match (&a, &b) {
        (IndexExpr::Const(0), _) => b,
        (_, IndexExpr::Const(0)) => a,
        _ => IndexExpr::Bin(IndexOp::Add, Box::new(a), Box::new(b)),
    }
}

fn mul(a: IndexExpr, k: usize) -> IndexExpr {
    match (&a, k) {
        (_, 1) => a,
        (IndexExpr::Const(c), _) => IndexExpr::Const(c * k as i64),
        _ => IndexExpr::Bin(IndexOp::Mul, Box::new(a), Box::new(IndexExpr::Const(k as i64))),
    }
}

/// The largest multiple of `align` that divides `dim`, at most `pref`; else the whole dim.
fn pick(dim: usize, pref: usize, align: usize) -> usize {
    let mut b = pref.min(dim) / align * align;
    while b >= align {
        if dim.is_multiple_of(b) {
            return b;
        }
        b -= align;
    }
    dim
}

fn node_id(a: &Operand) -> NodeId {
    match a {
        Operand::Node(n) => *n,
        Operand::Scalar(_) => unreachable!("anchors take tensor operands"),
    }
}

fn verified(k: Kernel, target: &Target) -> Result<Kernel, KernelError> {
    let k = fit_vmem_limit(k, target);
    tessera_dsl::verify::verify(&k, target)?;
    Ok(k)
}

/// The kernel of anchor partition `p` (number `index` of its program) for `target`.
pub fn kernel(g: &Graph, p: &Partition, index: usize, target: &Target) -> Result<Kernel, KernelError> {
    let id = p.anchor.expect("an anchor partition");
    let name = format!("fused{index}");
    match &g.node(id).op {
        NodeOp::Matmul { transpose_a, transpose_b, repeat } => matmul(g, p, &name, *transpose_a, *transpose_b, *repeat, target),
        NodeOp::Transpose => verified(transpose(g, id, &name)?, target),
        NodeOp::Gather(gather) => verified(gather_kernel(g, id, gather, &name, target)?, target),
        op => unreachable!("{op:?} is not an anchor"),
    }
}

// ---- matmul ------------------------------------------------------------------------------------

struct Mm {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    /// Batch of each operand (1: shared by every batch).
    batch_a: usize,
    batch_b: usize,
}

fn mm_dims(g: &Graph, id: NodeId, ta: bool, tb: bool) -> Mm {
    let n = g.node(id);
    let (a, b) = (&g.node(node_id(&n.args[0])).shape, &g.node(node_id(&n.args[1])).shape);
    let r = n.shape.len();
    let (m, nn) = (n.shape[r - 2], n.shape[r - 1]);
    let k = if ta { a[a.len() - 2] } else { a[a.len() - 1] };
    let _ = tb;
    Mm { batch: n.shape[..r - 2].iter().product(), m, n: nn, k, batch_a: a[..a.len() - 2].iter().product(), batch_b: b[..b.len() - 2].iter().product() }
}

fn matmul(g: &Graph, p: &Partition, name: &str, ta: bool, tb: bool, repeat: [usize; 2], target: &Target) -> Result<Kernel, KernelError> {
    let id = p.anchor.expect("an anchor partition");
    let d = mm_dims(g, id, ta, tb);
    let dtypes = p.reads.iter().map(|r| g.node(r.storage).dtype).chain(p.outputs.iter().map(|&o| g.node(o).dtype)).map(memory_dtype);
    let sub = sublanes(dtypes, target);
    let (align_m, lane) = (if ta { 128 } else { sub }, 128);
    // A row op in the epilogue needs whole rows: bn = n (the planner admits it for n <= 512).
    let (mut bm, mut bn, mut bk) = (pick(d.m, 256, align_m), if p.has_row_op { d.n } else { pick(d.n, 512, lane) }, pick(d.k, 512, lane));
    loop {
        let k = verified(matmul_kernel(g, p, name, &d, ta, tb, repeat, bm, bn, bk)?, target);
        match k {
            Ok(k) => return Ok(k),
            Err(e) if e.rule.contains("vmem") => {
                let halve = |b: usize, dim: usize, align: usize| (b / 2).is_multiple_of(align) && b / 2 >= align && dim.is_multiple_of(b / 2);
                if halve(bk, d.k, lane) {
                    bk /= 2;
                } else if halve(bn, d.n, lane) && !p.has_row_op {
                    bn /= 2;
                } else if (bm / 2 / align_m * align_m).max(align_m) < bm {
                    // A row block that does not divide m leaves a partial last block: its rows
                    // past the end are padding, computed per row and never stored.
                    bm = (bm / 2 / align_m * align_m).max(align_m);
                } else {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs `f` on `gen` inside `if cond { .. }` (the builder's `when` takes the builder itself).
fn when(gen: &mut Gen<'_>, cond: Value, f: impl FnOnce(&mut Gen<'_>)) {
    let mut outer = std::mem::replace(&mut gen.b, KernelBuilder::new("_"));
    outer.when(cond, |kb| {
        std::mem::swap(kb, &mut gen.b);
        f(gen);
        std::mem::swap(kb, &mut gen.b);
    });
    gen.b = outer;
}

#[allow(clippy::too_many_arguments)]
fn matmul_kernel(g: &Graph, p: &Partition, name: &str, d: &Mm, ta: bool, tb: bool, repeat: [usize; 2], bm: usize, bn: usize, bk: usize) -> Result<Kernel, KernelError> {
    let id = p.anchor.expect("an anchor partition");
    let node = g.node(id).clone();
    let mut b = KernelBuilder::new(name);
    let nk = d.k / bk;
    let mb = d.m.div_ceil(bm);
    let bidx = |shared: usize, rep: usize| match (shared, rep) {
        (1, _) => IndexExpr::Const(0),
        (_, 1) => IndexExpr::Grid(0),
        _ => IndexExpr::Bin(IndexOp::Div, Box::new(IndexExpr::Grid(0)), Box::new(IndexExpr::Const(rep as i64))),
    };
    let (gi, gj, gk) = (IndexExpr::Grid(1), IndexExpr::Grid(2), IndexExpr::Grid(3));
    let a_spec = if ta {
        (vec![d.batch_a, d.k, d.m], BlockSpec { block_shape: vec![None, Some(bk), Some(bm)], index_map: vec![bidx(d.batch_a, repeat[0]), gk.clone(), gi.clone()] })
    } else {
        (vec![d.batch_a, d.m, d.k], BlockSpec { block_shape: vec![None, Some(bm), Some(bk)], index_map: vec![bidx(d.batch_a, repeat[0]), gi.clone(), gk.clone()] })
    };
    let b_spec = if tb {
        (vec![d.batch_b, d.n, d.k], BlockSpec { block_shape: vec![None, Some(bn), Some(bk)], index_map: vec![bidx(d.batch_b, repeat[1]), gj.clone(), gk.clone()] })
    } else {
        (vec![d.batch_b, d.k, d.n], BlockSpec { block_shape: vec![None, Some(bk), Some(bn)], index_map: vec![bidx(d.batch_b, repeat[1]), gk.clone(), gj.clone()] })
    };
    // The anchor's operands, then each sibling's own (rule 13): `[a, b, bias?]`, then
    // `[b or a, bias?]` per sibling (the shared one read once), or `[a, b, bias?]` when
    // they share none.
    enum Role {
        A,
        B,
        Bias,
    }
    // Each read is its own operand (the runtime passes `p.reads` in order), so a storage two
    // products read in the same role (two linears sharing a weight and a bias) is named by its
    // read the second time.
    let mut names = std::collections::HashSet::new();
    let mut input = |b: &mut KernelBuilder, role: Role, read: usize| {
        let r = p.reads[read];
        let dt = memory_dtype(g.node(r.storage).dtype);
        let role_name = match role {
            Role::A => "a",
            Role::B => "b",
            Role::Bias => "bias",
        };
        let mut name = format!("{role_name}_n{}", r.storage);
        if !names.insert(name.clone()) {
            name = format!("{role_name}_n{}_r{read}", r.storage);
        }
        match role {
            Role::A => b.input(&name, dt, &a_spec.0, a_spec.1.clone()),
            Role::B => b.input(&name, dt, &b_spec.0, b_spec.1.clone()),
            Role::Bias => b.input(&name, dt, &[1, d.n], BlockSpec { block_shape: vec![Some(1), Some(bn)], index_map: vec![IndexExpr::Const(0), gj.clone()] }),
        }
    };
    let bias = node.args.len() == 3;
    let a0 = input(&mut b, Role::A, 0);
    let b0 = input(&mut b, Role::B, 1);
    let mut products = vec![(id, a0, b0, bias.then(|| input(&mut b, Role::Bias, 2)))];
    let mut at = 2 + usize::from(bias);
    for &sib in &p.siblings {
        // The sibling's own reads, in `args` order (the planner's order).
        let mut own = |b: &mut KernelBuilder, role: Role| {
            at += 1;
            input(b, role, at - 1)
        };
        let sa = if p.shared.arg() == Some(0) { a0 } else { own(&mut b, Role::A) };
        let sb = if p.shared.arg() == Some(1) { b0 } else { own(&mut b, Role::B) };
        let bias_ref = bias.then(|| own(&mut b, Role::Bias));
        products.push((sib, sa, sb, bias_ref));
    }
    debug_assert_eq!(at, p.anchor_reads);
    // Epilogue operands and results in the output space: `[batch, m, n or 1]` blocks
    // `[bm, bn or 1]` (the batch squeezed, so `m` need not be a multiple of the sublanes), or
    // one row `[1, n or 1]`.
    let rows = d.batch * d.m;
    let space = |r: usize, c: usize| -> (Vec<usize>, BlockSpec) {
        let (bc, jc) = if c == d.n { (bn, IndexExpr::Grid(2)) } else { (1, IndexExpr::Const(0)) };
        if r == rows {
            (vec![d.batch, d.m, c], BlockSpec { block_shape: vec![None, Some(bm), Some(bc)], index_map: vec![IndexExpr::Grid(0), IndexExpr::Grid(1), jc] })
        } else if r == d.m {
            // One batch's rows, shared by every batch (a causal mask).
            (vec![d.m, c], BlockSpec { block_shape: vec![Some(bm), Some(bc)], index_map: vec![IndexExpr::Grid(1), jc] })
        } else {
            (vec![1, c], BlockSpec { block_shape: vec![Some(1), Some(bc)], index_map: vec![IndexExpr::Const(0), jc] })
        }
    };
    let mut epi_refs = Vec::new();
    for (i, r) in p.reads[p.anchor_reads..].iter().enumerate() {
        let (shape, spec) = space(r.rows, r.cols);
        let rid = b.input(&format!("in{i}_n{}", r.storage), memory_dtype(g.node(r.storage).dtype), &shape, spec);
        epi_refs.push((*r, rid));
    }
    let mut out_refs = Vec::new();
    // A grid dim that some result's block does not move along (a 0-d or one-row value of the
    // epilogue) writes that block at every step along it: those steps run in order.
    let mut revisited = [false; 3];
    for &o in &p.outputs {
        let (r, c) = g.node(o).layout();
        let (shape, spec) = space(r, c);
        for (dim, seen) in revisited.iter_mut().enumerate() {
            *seen |= !spec.index_map.iter().any(|e| matches!(e, IndexExpr::Grid(i) if *i == dim));
        }
        out_refs.push((o, b.output(&format!("out_n{o}"), memory_dtype(g.node(o).dtype), &shape, spec)));
    }
    let sem = |dim: usize| if revisited[dim] { Semantics::Arbitrary } else { Semantics::Parallel };
    b.grid(&[(d.batch, sem(0)), (mb, sem(1)), (d.n / bn, sem(2)), (nk, Semantics::Arbitrary)]);
    let accs: Vec<_> = (0..products.len()).filter(|_| nk > 1).map(|i| b.scratch(&format!("acc{i}"), DType::F32, &[bm, bn], MemorySpace::Vmem)).collect();
    let mut dots = Vec::new();
    let mut loaded_operands: HashMap<tessera_dsl::RefId, Value> = HashMap::new();
    for &(_, a_ref, b_ref, _) in &products {
        let mut load = |b: &mut KernelBuilder, r| *loaded_operands.entry(r).or_insert_with(|| b.load(r, &[Index::Full, Index::Full]));
        let av = load(&mut b, a_ref);
        let bv = load(&mut b, b_ref);
        dots.push(b.dot(av, bv, ta, tb));
    }
    let mut gen = Gen { g, p, b, vals: HashMap::new(), loaded: HashMap::new(), bm, bn, acc: HashMap::new(), cat: HashMap::new() };
    let epilogue = move |gen: &mut Gen<'_>, values: Vec<Value>| {
        for (&(mm, _, _, bias_ref), v) in products.iter().zip(values) {
            let mut v = v;
            if let Some(bias) = bias_ref {
                let bv = gen.b.load(bias, &[Index::Full, Index::Full]);
                let bv = if node.dtype == DType::BF16 { gen.b.cast(bv, DType::F32) } else { bv };
                v = gen.b.add(v, bv);
            }
            let v = gen.round(v, node.dtype);
            gen.vals.insert(mm, v);
        }
        for (r, rid) in &epi_refs {
            let x = gen.b.load(*rid, &[Index::Full, Index::Full]);
            let x = match g.node(r.storage).dtype {
                DType::Bool => gen.b.cmp(CmpOp::Ne, x, 0),
                DType::BF16 => gen.b.cast(x, DType::F32),
                _ => x,
            };
            gen.loaded.insert(*r, x);
        }
        for &n in p.nodes[1..].iter().filter(|n| !p.siblings.contains(n)) {
            gen.node(n);
        }
        for (o, r) in &out_refs {
            let v = gen.vals[o];
            let v = match g.node(*o).dtype {
                DType::Bool => {
                    let shape = gen.b.ty(v).shape.clone();
                    let one = gen.b.full(&shape, DType::I8, 1);
                    gen.b.select(v, one, 0)
                }
                dt => gen.b.cast(v, dt),
            };
            gen.b.store(*r, &[Index::Full, Index::Full], v);
        }
    };
    if accs.is_empty() {
        epilogue(&mut gen, dots);
    } else {
        let pid = gen.b.program_id(3);
        let first = gen.b.cmp(CmpOp::Eq, pid, 0);
        gen.b.when(first, |b| {
            for &acc in &accs {
                b.store(acc, &[Index::Full, Index::Full], 0.0);
            }
        });
        for (&acc, &dot) in accs.iter().zip(&dots) {
            let old = gen.b.load(acc, &[Index::Full, Index::Full]);
            let new = gen.b.add(old, dot);
            gen.b.store(acc, &[Index::Full, Index::Full], new);
        }
        let last = gen.b.cmp(CmpOp::Eq, pid, (nk - 1) as i64);
        when(&mut gen, last, |gen| {
            let values = accs.iter().map(|&acc| gen.b.load(acc, &[Index::Full, Index::Full])).collect();
            epilogue(gen, values)
        });
    }
    gen.b.finish()
}

// ---- copies ------------------------------------------------------------------------------------

fn source(g: &Graph, id: NodeId) -> (NodeId, Vec<usize>, DType) {
    let n = g.node(id);
    let s = node_id(&n.args[0]);
    (g.storage(s), g.node(s).shape.clone(), memory_dtype(n.dtype))
}

fn transpose(g: &Graph, id: NodeId, name: &str) -> Result<Kernel, KernelError> {
    let (storage, src, dt) = source(g, id);
    let r = src.len();
    let (rows, cols) = (src[r - 2], src[r - 1]);
    let batch: usize = src[..r - 2].iter().product();
    let mut b = KernelBuilder::new(name);
    b.grid(&[(batch, Semantics::Parallel)]);
    let spec = |x: usize, y: usize| BlockSpec { block_shape: vec![None, Some(x), Some(y)], index_map: vec![IndexExpr::Grid(0), IndexExpr::Const(0), IndexExpr::Const(0)] };
    let i = b.input(&format!("in_n{storage}"), dt, &[batch, rows, cols], spec(rows, cols));
    let o = b.output(&format!("out_n{id}"), dt, &[batch, cols, rows], spec(cols, rows));
    let v = b.load(i, &[Index::Full, Index::Full]);
    let t = b.transpose(v);
    b.store(o, &[Index::Full, Index::Full], t);
    b.finish()
}

fn gather_kernel(g: &Graph, id: NodeId, gt: &Gather, name: &str, target: &Target) -> Result<Kernel, KernelError> {
    let (storage, src, dt) = source(g, id);
    let out = g.node(id).shape.clone();
    let (p, r) = (src.len(), out.len());
    let (d_src, d) = (src[p - 1], out[r - 1]);
    let sub = target.tiling(dt).0;
    // How the result's second-to-last dim (`L`) is copied: a slab of the source dim it
    // walks, a broadcast row, or (else) one row per grid step.
    enum Mode {
        Slab(usize),
        Broadcast,
        Rows,
    }
    let mode = if r < 2 {
        Mode::Rows
    } else {
        let l = out[r - 2];
        match gt.walks[r - 2] {
            None => Mode::Broadcast,
            Some(q) => {
                let lane_whole = src[q + 1..p - 1].iter().all(|&s| s == 1);
                if gt.start[q].is_multiple_of(l) && (l.is_multiple_of(sub) || l == src[q]) && (lane_whole || d_src.is_multiple_of(128)) {
                    Mode::Slab(q)
                } else {
                    Mode::Rows
                }
            }
        }
    };
    // Grid axes: the result's leading dims, but `L` in the slab and broadcast modes.
    let axes: Vec<usize> = match mode {
        Mode::Rows => (0..r.saturating_sub(1)).collect(),
        _ => (0..r - 2).collect(),
    };
    let mut b = KernelBuilder::new(name);
    let grid: Vec<(usize, Semantics)> = if axes.is_empty() { vec![(1, Semantics::Parallel)] } else { axes.iter().map(|&i| (out[i], Semantics::Parallel)).collect() };
    b.grid(&grid);
    let src_index = |q: usize| -> IndexExpr {
        let walked = gt.walks.iter().position(|&w| w == Some(q)).and_then(|i| axes.iter().position(|&a| a == i));
        match walked {
            Some(ax) => add(IndexExpr::Const(gt.start[q] as i64), IndexExpr::Grid(ax)),
            None => IndexExpr::Const(gt.start[q] as i64),
        }
    };
    let (in_shape, in_spec, out_shape, out_spec, rows) = match mode {
        Mode::Slab(q) => {
            let l = out[r - 2];
            let lane: usize = src[q + 1..].iter().product();
            let mut lane_idx = IndexExpr::Const(0);
            for j in q + 1..p - 1 {
                let stride: usize = src[j + 1..p - 1].iter().product();
                lane_idx = add(lane_idx, mul(src_index(j), stride));
            }
            let mut shape = src[..=q].to_vec();
            shape.push(lane);
            let mut block: Vec<Option<usize>> = vec![None; q];
            block.extend([Some(l), Some(d_src)]);
            let mut index: Vec<IndexExpr> = (0..q).map(src_index).collect();
            index.extend([IndexExpr::Const((gt.start[q] / l) as i64), lane_idx]);
            let mut oblock: Vec<Option<usize>> = vec![None; r - 2];
            oblock.extend([Some(l), Some(d)]);
            let mut oindex: Vec<IndexExpr> = (0..r - 2).map(IndexExpr::Grid).collect();
            oindex.extend([IndexExpr::Const(0), IndexExpr::Const(0)]);
            (shape, BlockSpec { block_shape: block, index_map: index }, out.clone(), BlockSpec { block_shape: oblock, index_map: oindex }, l)
        }
        Mode::Broadcast | Mode::Rows => {
            let mut shape = src[..p - 1].to_vec();
            shape.extend([1, d_src]);
            let mut block: Vec<Option<usize>> = vec![None; p - 1];
            block.extend([Some(1), Some(d_src)]);
            let mut index: Vec<IndexExpr> = (0..p - 1).map(src_index).collect();
            index.extend([IndexExpr::Const(0), IndexExpr::Const(0)]);
            let in_spec = BlockSpec { block_shape: block, index_map: index };
            if matches!(mode, Mode::Broadcast) {
                let l = out[r - 2];
                let mut oblock: Vec<Option<usize>> = vec![None; r - 2];
                oblock.extend([Some(l), Some(d)]);
                let mut oindex: Vec<IndexExpr> = (0..r - 2).map(IndexExpr::Grid).collect();
                oindex.extend([IndexExpr::Const(0), IndexExpr::Const(0)]);
                (shape, in_spec, out.clone(), BlockSpec { block_shape: oblock, index_map: oindex }, l)
            } else {
                let mut oshape = out[..r - 1].to_vec();
                oshape.extend([1, d]);
                let mut oblock: Vec<Option<usize>> = vec![None; r - 1];
                oblock.extend([Some(1), Some(d)]);
                let mut oindex: Vec<IndexExpr> = (0..r - 1).map(IndexExpr::Grid).collect();
                oindex.extend([IndexExpr::Const(0), IndexExpr::Const(0)]);
                (shape, in_spec, oshape, BlockSpec { block_shape: oblock, index_map: oindex }, 1)
            }
        }
    };
    let i = b.input(&format!("in_n{storage}"), dt, &in_shape, in_spec);
    let o = b.output(&format!("out_n{id}"), dt, &out_shape, out_spec);
    let cols = if gt.col_start == 0 && d == d_src { Index::Full } else { ds(gt.col_start as i64, d) };
    let v = b.load(i, &[Index::Full, cols]);
    let v = if b.ty(v).shape[0] != rows { b.broadcast(v, &[rows, d]) } else { v };
    b.store(o, &[Index::Full, Index::Full], v);
    b.finish()
}
