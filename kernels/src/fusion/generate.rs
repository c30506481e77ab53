//! The generator: one [`Partition`] as a row kernel, built with [`KernelBuilder`].
//!
//! The kernel's grid walks blocks of `bm` whole rows of the partition's row space
//! `rows x cols`. Every read and every stored node is an operand `[r, c]` with `r` the
//! partition's rows or 1 and `c` its cols or 1: blocks `[bm or 1, c]`, index map
//! `(i, 0)` or `(0, 0)`. In the body every float value is f32 (bf16 memory is upcast on
//! load, so sums accumulate in f32); a bf16 node is rounded to bf16 after its op, as
//! torch's CPU kernels round each op's result; bool memory is i8 (0 or 1).

use std::collections::HashMap;

use tessera_dsl::{Arg, BinaryOp, BlockSpec, CmpOp, DType, Index, IndexExpr, IndexOp, KernelBuilder, KernelError, ReduceOp, RefId, Semantics, UnaryOp, Value};

use super::graph::{Binary, Graph, NodeId, NodeOp, Operand, RowOp, Unary};
use super::planner::{Partition, Read};

/// How a node's dtype is held in memory: bool as i8.
pub fn memory_dtype(d: DType) -> DType {
    if d == DType::Bool {
        DType::I8
    } else {
        d
    }
}

/// Rows `[bm, cols]` at block `(i, 0)` (every row), `[1, cols]` at `(0, 0)` (one row), or a
/// periodic read: `[bm, cols]` at `(i % (rows / bm), 0)` (`bm` divides `rows`).
fn spec(rows: usize, cols: usize, part_rows: usize, bm: usize) -> BlockSpec {
    let (block, index) = if rows == part_rows {
        (bm, IndexExpr::Grid(0))
    } else if rows == 1 {
        (1, IndexExpr::Const(0))
    } else {
        let blocks = (rows / bm.max(1)) as i64;
        (bm, IndexExpr::Bin(IndexOp::Rem, Box::new(IndexExpr::Grid(0)), Box::new(IndexExpr::Const(blocks))))
    };
    BlockSpec { block_shape: vec![Some(block), Some(cols)], index_map: vec![index, IndexExpr::Const(0)] }
}

struct Gen<'a> {
    g: &'a Graph,
    p: &'a Partition,
    b: KernelBuilder,
    vals: HashMap<NodeId, Value>,
    loaded: HashMap<Read, Value>,
    bm: usize,
    /// The f32 `[1, c]` accumulator of each column sum (`c`: its columns).
    acc: HashMap<NodeId, RefId>,
}

impl Gen<'_> {
    fn round(&mut self, v: Value, dtype: DType) -> Value {
        if dtype == DType::BF16 {
            let r = self.b.cast(v, DType::BF16);
            self.b.cast(r, DType::F32)
        } else {
            v
        }
    }

    fn arg(&self, a: Operand) -> Arg {
        match a {
            Operand::Scalar(x) => Arg::Float(x),
            Operand::Node(o) => {
                let s = self.g.same_rows_source(o);
                if let Some(&v) = self.vals.get(&s) {
                    return Arg::Val(v);
                }
                let (rows, cols) = self.g.node(o).layout();
                Arg::Val(self.loaded[&Read { storage: self.g.storage(o), rows, cols }])
            }
        }
    }

    /// The operands of a binary op, comparison or `where`'s values, each cast to the op's common dtype as torch does.
    /// Torch's CPU `mul` and `div` read a 0-dim operand as an unrounded f32 scalar (the
    /// others cast it to the common dtype): `exact_scalars` says so.
    fn common_args(&mut self, args: &[Operand], exact_scalars: bool) -> Vec<Arg> {
        let common = self.g.common_dtype(args);
        args.iter()
            .map(|&a| {
                let v = self.arg(a);
                match (v, a) {
                    (Arg::Val(v), Operand::Node(o)) if common == DType::BF16 && self.g.node(o).dtype == DType::F32 && !(exact_scalars && self.g.node(o).shape.is_empty()) => {
                        Arg::Val(self.round(v, DType::BF16))
                    }
                    _ => v,
                }
            })
            .collect()
    }

    fn val(&self, a: Operand) -> Value {
        match self.arg(a) {
            Arg::Val(v) => v,
            _ => unreachable!("the graph builder gives these ops tensor operands"),
        }
    }

    fn node(&mut self, id: NodeId) {
        let n = self.g.node(id).clone();
        let v = match n.op {
            NodeOp::Input(_) | NodeOp::View => return,
            NodeOp::Unary(op) => {
                let x = self.val(n.args[0]);
                let b = &mut self.b;
                match op {
                    Unary::Neg => b.unary(UnaryOp::Neg, x),
                    Unary::Sin => b.unary(UnaryOp::Sin, x),
                    Unary::Cos => b.unary(UnaryOp::Cos, x),
                    Unary::Log1p => b.unary(UnaryOp::Log1p, x),
                    Unary::Expm1 => b.unary(UnaryOp::Expm1, x),
                    Unary::Floor => b.unary(UnaryOp::Floor, x),
                    Unary::Ceil => b.unary(UnaryOp::Ceil, x),
                    Unary::Round => b.unary(UnaryOp::Round, x),
                    Unary::Sign => {
                        let s = b.unary(UnaryOp::Sign, x);
                        let nan = b.cmp(tessera_dsl::CmpOp::Ne, x, x);
                        b.select(nan, 0.0, s)
                    }
                    Unary::Abs => b.unary(UnaryOp::Abs, x),
                    Unary::Exp => b.unary(UnaryOp::Exp, x),
                    Unary::Log => b.unary(UnaryOp::Log, x),
                    Unary::Tanh => b.unary(UnaryOp::Tanh, x),
                    Unary::Sqrt => b.unary(UnaryOp::Sqrt, x),
                    Unary::Rsqrt => b.unary(UnaryOp::Rsqrt, x),
                    Unary::Erf => b.unary(UnaryOp::Erf, x),
                    Unary::Sigmoid => {
                        let e = b.unary(UnaryOp::Neg, x);
                        let e = b.unary(UnaryOp::Exp, e);
                        let d = b.add(e, 1.0);
                        b.div(1.0, d)
                    }
                    Unary::Relu => b.max(x, 0.0),
                    Unary::Silu => {
                        let e = b.unary(UnaryOp::Neg, x);
                        let e = b.unary(UnaryOp::Exp, e);
                        let d = b.add(e, 1.0);
                        b.div(x, d)
                    }
                    Unary::Gelu => {
                        let t = b.mul(x, std::f64::consts::FRAC_1_SQRT_2);
                        let t = b.unary(UnaryOp::Erf, t);
                        let t = b.add(t, 1.0);
                        let t = b.mul(t, x);
                        b.mul(t, 0.5)
                    }
                    Unary::Reciprocal => b.div(1.0, x),
                }
            }
            NodeOp::Binary(op) => {
                let xy = self.common_args(&n.args, matches!(op, Binary::Mul | Binary::Div));
                let (x, y) = (xy[0], xy[1]);
                let b = &mut self.b;
                match op {
                    Binary::Add => b.add(x, y),
                    Binary::Sub => b.sub(x, y),
                    Binary::Mul => b.mul(x, y),
                    Binary::Div => b.div(x, y),
                    Binary::Maximum => b.max(x, y),
                    Binary::Minimum => b.min(x, y),
                    Binary::Pow => match (x, y) {
                        (Arg::Val(v), Arg::Float(e)) => pow_scalar(b, v, e),
                        (x, y) => b.binary(BinaryOp::Pow, x, y),
                    },
                }
            }
            NodeOp::Compare(op) => {
                let xy = self.common_args(&n.args, false);
                let (x, y) = (xy[0], xy[1]);
                self.b.cmp(op, x, y)
            }
            NodeOp::Where => {
                // `select` takes its shape from the values: broadcast all three first.
                let (r, c) = n.layout();
                let shape = [if r == self.p.rows { self.bm } else { 1 }, c];
                let cond = self.val(n.args[0]);
                let cond = self.b.broadcast(cond, &shape);
                let xy = self.common_args(&n.args[1..], false);
                let side = |a: Arg, g: &mut Self| match a {
                    Arg::Val(v) => Arg::Val(g.b.broadcast(v, &shape)),
                    lit => lit,
                };
                let (x, y) = (side(xy[0], self), side(xy[1], self));
                self.b.select(cond, x, y)
            }
            NodeOp::Expand => {
                let (r, c) = n.layout();
                let shape = [if r == self.p.rows { self.bm } else { 1 }, c];
                let v = self.val(n.args[0]);
                self.b.broadcast(v, &shape)
            }
            NodeOp::Clamp(lo, hi) => {
                let mut v = self.val(n.args[0]);
                if let Some(lo) = lo {
                    v = self.b.max(v, lo);
                }
                if let Some(hi) = hi {
                    v = self.b.min(v, hi);
                }
                v
            }
            NodeOp::Cast(to) => {
                let Operand::Node(src) = n.args[0] else { unreachable!("casts take a node") };
                let from = self.g.node(src).dtype;
                let x = self.val(n.args[0]);
                match (from == DType::Bool, to == DType::Bool) {
                    (false, false) => x,
                    (false, true) => self.b.cmp(CmpOp::Ne, x, 0.0),
                    (true, false) => {
                        let shape = self.b.ty(x).shape.clone();
                        let one = self.b.full(&shape, DType::F32, 1.0);
                        self.b.select(x, one, 0.0)
                    }
                    (true, true) => x,
                }
            }
            NodeOp::ColSum => {
                // acc = 0 at the first block; acc += this block's rows (rows past the end of
                // a partial last block masked); the node is the running sum, stored every
                // step of the in-order grid, so the last store is the whole sum.
                let mut x = self.val(n.args[0]);
                let acc = self.acc[&id];
                let b = &mut self.b;
                let pid = b.program_id(0);
                let first = b.cmp(CmpOp::Eq, pid, 0);
                b.when(first, |b| b.store(acc, &[Index::Full, Index::Full], 0.0));
                let (rows, bm) = (self.p.rows, self.bm);
                if !rows.is_multiple_of(bm) {
                    let r = b.iota(DType::I32, &[bm, 1], 0);
                    let off = b.mul(pid, bm as i64);
                    let r = b.add(r, off);
                    let inside = b.cmp(CmpOp::Lt, r, rows as i64);
                    x = b.select(inside, x, 0.0);
                }
                let part = b.reduce(ReduceOp::Sum, x, 0);
                let old = b.load(acc, &[Index::Full, Index::Full]);
                let new = b.add(old, part);
                b.store(acc, &[Index::Full, Index::Full], new);
                new
            }
            NodeOp::Row(op) => {
                let x = self.val(n.args[0]);
                let cols = self.p.cols;
                let b = &mut self.b;
                match op {
                    RowOp::Sum => b.reduce(ReduceOp::Sum, x, 1),
                    RowOp::Mean => {
                        let s = b.reduce(ReduceOp::Sum, x, 1);
                        b.div(s, cols as f64)
                    }
                    RowOp::Amax => b.reduce(ReduceOp::Max, x, 1),
                    RowOp::Amin => b.reduce(ReduceOp::Min, x, 1),
                    RowOp::Softmax | RowOp::LogSoftmax => {
                        let mx = b.reduce(ReduceOp::Max, x, 1);
                        let d = b.sub(x, mx);
                        let e = b.unary(UnaryOp::Exp, d);
                        let s = b.reduce(ReduceOp::Sum, e, 1);
                        if op == RowOp::Softmax {
                            b.div(e, s)
                        } else {
                            let l = b.unary(UnaryOp::Log, s);
                            b.sub(d, l)
                        }
                    }
                }
            }
        };
        let v = if n.dtype == DType::Bool { v } else { self.round(v, n.dtype) };
        self.vals.insert(id, v);
    }
}

/// `v ** e` for a number `e`: torch computes the exponents 1, 2, 3, 0.5, -0.5, -1, -2 by
/// multiplications, sqrt and rsqrt, not `pow`; so do we.
fn pow_scalar(b: &mut KernelBuilder, v: Value, e: f64) -> Value {
    if e == 1.0 {
        b.add(v, 0.0)
    } else if e == 2.0 {
        b.mul(v, v)
    } else if e == 3.0 {
        let sq = b.mul(v, v);
        b.mul(sq, v)
    } else if e == 0.5 {
        b.unary(UnaryOp::Sqrt, v)
    } else if e == -0.5 {
        b.unary(UnaryOp::Rsqrt, v)
    } else if e == -1.0 {
        b.div(1.0, v)
    } else if e == -2.0 {
        let sq = b.mul(v, v);
        b.div(1.0, sq)
    } else {
        b.binary(BinaryOp::Pow, v, e)
    }
}

/// The kernel of partition `p` (number `index` of its program), `bm` rows a block.
pub fn kernel(g: &Graph, p: &Partition, index: usize, bm: usize) -> Result<tessera_dsl::Kernel, KernelError> {
    let mut b = KernelBuilder::new(&format!("fused{index}"));
    // A stored node of one row while the grid walks many: every step writes the same
    // block, so the steps must run in order.
    let revisits = p.has_col_sum || p.outputs.iter().any(|&o| g.node(o).layout().0 != p.rows);
    b.grid(&[(p.rows.div_ceil(bm), if revisits { Semantics::Arbitrary } else { Semantics::Parallel })]);
    let mut in_refs: Vec<(Read, RefId)> = Vec::new();
    for (i, r) in p.reads.iter().enumerate() {
        let dtype = memory_dtype(g.node(r.storage).dtype);
        let id = b.input(&format!("in{i}_n{}", r.storage), dtype, &[r.rows, r.cols], spec(r.rows, r.cols, p.rows, bm));
        in_refs.push((*r, id));
    }
    let mut out_refs: Vec<(NodeId, RefId)> = Vec::new();
    for &o in &p.outputs {
        let n = g.node(o);
        let (rows, cols) = n.layout();
        let id = b.output(&format!("out_n{o}"), memory_dtype(n.dtype), &[rows, cols], spec(rows, cols, p.rows, bm));
        out_refs.push((o, id));
    }
    let mut acc = HashMap::new();
    for &id in &p.nodes {
        if matches!(g.node(id).op, NodeOp::ColSum) {
            acc.insert(id, b.scratch(&format!("acc_n{id}"), DType::F32, &[1, g.node(id).layout().1], tessera_dsl::MemorySpace::Vmem));
        }
    }
    let mut gen = Gen { g, p, b, vals: HashMap::new(), loaded: HashMap::new(), bm, acc };
    for (r, id) in &in_refs {
        let v = gen.b.load(*id, &[Index::Full, Index::Full]);
        let v = match g.node(r.storage).dtype {
            DType::Bool => gen.b.cmp(CmpOp::Ne, v, 0),
            DType::BF16 => gen.b.cast(v, DType::F32),
            _ => v,
        };
        gen.loaded.insert(*r, v);
    }
    for &id in &p.nodes {
        gen.node(id);
    }
    for (o, r) in out_refs {
        let v = gen.vals[&o];
        let dtype = g.node(o).dtype;
        let v = match dtype {
            DType::Bool => {
                let shape = gen.b.ty(v).shape.clone();
                let one = gen.b.full(&shape, DType::I8, 1);
                gen.b.select(v, one, 0)
            }
            d => gen.b.cast(v, d),
        };
        gen.b.store(r, &[Index::Full, Index::Full], v);
    }
    gen.b.finish()
}
