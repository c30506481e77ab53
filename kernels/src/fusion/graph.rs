//! The fusion graph: tensor ops in recording order, each node with torch's result shape
//! and dtype (broadcasting and type promotion done here, for f32, bf16 and bool).
//!
//! Building a node checks everything the planner and the generator rely on, so an op the
//! engine cannot take is refused here, when it is recorded (the front-end then runs it
//! eagerly), never later as a wrong result. Refusals are [`KernelError`]s of kernel
//! `fusion`, naming the op and operand and one of the rule ids listed in the module docs
//! of [`crate::fusion`].

use std::fmt;

/// Comparisons are the IR's own.
pub use tessera_dsl::CmpOp;
use tessera_dsl::{DType, KernelError};

/// A node of a [`Graph`]: its index in recording order.
pub type NodeId = usize;

/// Rows of more than this many elements are not fused (a block of whole rows must fit
/// VMEM with its temporaries: 16 sublanes x 32768 f32 lanes is 2 MiB).
pub const MAX_ROW: usize = 32768;

/// A transpose as a value holds one whole matrix in VMEM: at most this many elements.
pub const MAX_TRANSPOSE: usize = 1 << 20;

/// At most this many pieces in one `cat`.
pub const MAX_CAT: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Neg,
    Abs,
    Exp,
    Log,
    Tanh,
    Sqrt,
    Rsqrt,
    Erf,
    Sigmoid,
    Relu,
    Silu,
    /// The exact (erf) GELU, torch's default.
    Gelu,
    Reciprocal,
    Sin,
    Cos,
    Log1p,
    Expm1,
    Floor,
    Ceil,
    /// Ties to even, as `torch.round`.
    Round,
    /// `torch.sign`: -1, 0 or 1, and 0 for NaN (torch's, unlike the IR's NaN).
    Sign,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Pow,
}

/// An op over the last dim, one row at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowOp {
    Sum,
    Mean,
    Amax,
    Amin,
    Softmax,
    LogSoftmax,
}

impl RowOp {
    /// Whether the result keeps the row (softmax) rather than reducing it to one column.
    pub fn keeps_row(self) -> bool {
        matches!(self, RowOp::Softmax | RowOp::LogSoftmax)
    }
}

/// An operand: a node, or a Python number (weak: it takes the other operand's dtype).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Operand {
    Node(NodeId),
    Scalar(f64),
}

#[derive(Clone, Debug, PartialEq)]
pub enum NodeOp {
    /// Graph input `i` (a tensor the caller passes at run time).
    Input(usize),
    Unary(Unary),
    Binary(Binary),
    Compare(CmpOp),
    /// `where(cond, a, b)`: args `[cond, a, b]`.
    Where,
    /// `clamp(x, min, max)`.
    Clamp(Option<f64>, Option<f64>),
    Cast(DType),
    /// Over the last dim, keepdim (a non-keepdim reduction is this and a [`NodeOp::View`]).
    Row(RowOp),
    /// The sum over every dim but the last (`x.sum(0)` of `[m, n]`): one row, `[n]` or keepdim.
    ColSum,
    /// A reshape of a contiguous tensor: the same elements, another shape.
    View,
    /// `x.expand(shape)` as a value (torch's is a stride-0 view; here the broadcast copy,
    /// which reads the same as long as the source is not written, and the front-end
    /// never defers a write to a tensor that has views).
    Expand,
    /// `a @ b` over the last two dims, batched over the leading ones (`mm`, `bmm`, `addmm`):
    /// args `[a, b]` or `[a, b, bias]` (a `[n]` bias added in f32 before the one rounding,
    /// as torch's `addmm`). A transposed operand is read in place: `a` stored `[.., k, m]`
    /// with `transpose_a`, `b` stored `[.., n, k]` with `transpose_b`. An operand without
    /// batch dims is shared by every batch. f32 accumulation; bf16 operands stay bf16.
    /// `repeat[i] > 1`: operand `i` is read for batch `g` at its batch `g / repeat[i]` (a
    /// GQA `repeat_kv` expand read in place instead of copied).
    Matmul { transpose_a: bool, transpose_b: bool, repeat: [usize; 2] },
    /// The last two dims swapped, as a value (`x.transpose(-1, -2)` / `t()`; a matmul reads
    /// it in place instead).
    Transpose,
    /// A strided view of the source's memory as a value: see [`Gather`].
    Gather(Gather),
    /// `torch.cat` over the last dim: args are the pieces.
    CatCols,
}

/// A view that picks rows (and a window of columns) of a contiguous source: result element
/// `(i_0, .., i_{r-2}, j)` is source element `(start_q + i_w(q))_q, col_start + j)` where
/// `i_w(q)` is the index of the result dim walking source dim `q` (0 if none). Covers
/// `permute`/`transpose` of leading dims, `slice`/`select`/`narrow` (step 1), `unsqueeze`,
/// an `expand` over inner dims (stride 0), and a column window of the last dim.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gather {
    /// For each leading dim of the result: the source dim it walks (`None`: a broadcast or
    /// size-1 dim).
    pub walks: Vec<Option<usize>>,
    /// For each leading dim of the source: the index of the result's first row.
    pub start: Vec<usize>,
    /// The first column of the source's last dim the result takes.
    pub col_start: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: NodeOp,
    pub args: Vec<Operand>,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Node {
    /// The node as rows: `(elements before the last dim, the last dim)`; `(1, 1)` for a
    /// 0-dim tensor. A contiguous tensor is exactly this row-major matrix.
    pub fn layout(&self) -> (usize, usize) {
        layout(&self.shape)
    }
}

pub fn layout(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&c, lead)) => (lead.iter().product(), c),
    }
}

/// A graph of tensor ops in recording order (a node's operands come before it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
    inputs: usize,
}

fn err(op: &str, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
    KernelError::new("fusion", format!("op `{op}`, {}", subject.into()), rule, message, help)
}

/// A Python number the kernels can hold: f32 math, so a finite number past f32's range
/// (which torch would keep in double for a moment) is refused, not rounded to infinity.
fn scalar_ok(op: &str, name: &str, x: f64) -> Result<(), KernelError> {
    if x.is_finite() && (x as f32).is_infinite() {
        return Err(err(op, format!("operand `{name}`"), "fusion-scalar", format!("the number {x:e} is beyond f32's range"), "numbers within f32's range fuse; this op runs eagerly"));
    }
    Ok(())
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Torch's broadcast of two shapes (right-aligned), or `None`.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let at = |s: &[usize], i: usize| if i + s.len() >= r { s[i + s.len() - r] } else { 1 };
    (0..r)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// How an operand of `shape` reaches a result of `out` (already a valid broadcast), as
/// rows: its leading dims are all the result's (every row), all 1 (one row repeated), or
/// 1s then the result's (a bias or mask `[b, n]` broadcast over `[a, b, n]`, HF RoPE's cos
/// `[1, 1, s, d]` over `[b, h, s, d]`: result row `r` reads operand row `r % rows`, any
/// number of rows; a row kernel's blocks then divide them, see [`crate::fusion`]).
fn row_broadcast_ok(shape: &[usize], out: &[usize]) -> bool {
    if out.is_empty() {
        return true;
    }
    let pad = out.len() - shape.len();
    let padded: Vec<usize> = std::iter::repeat_n(1, pad).chain(shape.iter().copied()).collect();
    let (lead, olead) = (&padded[..out.len() - 1], &out[..out.len() - 1]);
    if lead == olead || lead.iter().all(|&d| d == 1) {
        return true;
    }
    (1..lead.len()).any(|k| lead[..k].iter().all(|&d| d == 1) && lead[k..] == olead[k..])
}

/// Promotion class: dimensioned tensors beat 0-dim tensors beat Python numbers, within a
/// category (bool < float); a higher category always wins (torch's `result_type`).
#[derive(Clone, Copy)]
struct Part {
    dtype: Option<DType>, // None: a Python float
    rank0: bool,
}

fn category(d: Option<DType>) -> u8 {
    match d {
        Some(DType::Bool) => 0,
        _ => 1,
    }
}

fn promote(parts: &[Part]) -> DType {
    let top = parts.iter().map(|p| category(p.dtype)).max().unwrap_or(1);
    let in_top = |p: &&Part| category(p.dtype) == top;
    let pick = |sel: &dyn Fn(&Part) -> bool| -> Option<DType> {
        let ds: Vec<DType> = parts.iter().filter(in_top).filter(|p| sel(p)).filter_map(|p| p.dtype).collect();
        if ds.is_empty() {
            None
        } else if ds.contains(&DType::F32) {
            Some(DType::F32)
        } else {
            Some(ds[0])
        }
    };
    pick(&|p| !p.rank0 && p.dtype.is_some())
        .or_else(|| pick(&|p| p.rank0 && p.dtype.is_some()))
        // Only Python floats in the top category, or a float number over bool tensors:
        // torch's default dtype.
        .unwrap_or(if top == 0 { DType::Bool } else { DType::F32 })
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// How many graph inputs [`Graph::input`] declared.
    pub fn num_inputs(&self) -> usize {
        self.inputs
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }

    fn push(&mut self, op: NodeOp, args: Vec<Operand>, dtype: DType, shape: Vec<usize>) -> NodeId {
        self.nodes.push(Node { op, args, dtype, shape });
        self.nodes.len() - 1
    }

    fn operand(&self, op: &str, which: &str, a: Operand) -> Result<Option<&Node>, KernelError> {
        match a {
            Operand::Scalar(_) => Ok(None),
            Operand::Node(id) => self
                .nodes
                .get(id)
                .map(Some)
                .ok_or_else(|| err(op, format!("operand `{which}`"), "fusion-operand", format!("node {id} does not exist (the graph has {})", self.nodes.len()), "pass nodes returned by this graph")),
        }
    }

    fn check_row(op: &str, shape: &[usize]) -> Result<(), KernelError> {
        // Checked first: `layout` multiplies the leading dims.
        if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none_or(|n| n > i32::MAX as usize) {
            return Err(err(op, "result", "fusion-size", format!("shape {} has too many elements", shape_str(shape)), "tensors of at most 2^31 - 1 elements fuse"));
        }
        let (_, c) = layout(shape);
        if c > MAX_ROW {
            return Err(err(op, "result", "fusion-row-width", format!("rows of {c} elements (shape {})", shape_str(shape)), format!("rows of at most {MAX_ROW} elements fuse; wider ones run eagerly")));
        }
        if shape.contains(&0) {
            return Err(err(op, "result", "fusion-empty", format!("shape {} has no elements", shape_str(shape)), "empty tensors run eagerly"));
        }
        Ok(())
    }

    /// A graph input of `dtype` (f32, bf16 or bool) and `shape` (contiguous).
    pub fn input(&mut self, dtype: DType, shape: &[usize]) -> Result<NodeId, KernelError> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::Bool) {
            return Err(err("input", "the tensor", "fusion-dtype", format!("a {dtype} tensor"), "float32, bfloat16 and bool tensors fuse; others run eagerly"));
        }
        Self::check_row("input", shape)?;
        self.inputs += 1;
        Ok(self.push(NodeOp::Input(self.inputs - 1), vec![], dtype, shape.to_vec()))
    }

    /// The result shape of `args` broadcast together, each checked for the row rule.
    fn broadcast(&self, op: &str, names: &[&str], args: &[Operand]) -> Result<Vec<usize>, KernelError> {
        let mut out: Vec<usize> = Vec::new();
        for (&a, name) in args.iter().zip(names) {
            if let Some(n) = self.operand(op, name, a)? {
                out = broadcast_shapes(&out, &n.shape).ok_or_else(|| {
                    err(op, format!("operand `{name}`"), "fusion-broadcast", format!("shape {} does not broadcast with {}", shape_str(&n.shape), shape_str(&out)), "torch raises for these shapes too")
                })?;
            }
        }
        for (&a, name) in args.iter().zip(names) {
            if let Some(n) = self.operand(op, name, a)? {
                if !row_broadcast_ok(&n.shape, &out) {
                    return Err(err(
                        op,
                        format!("operand `{name}`"),
                        "fusion-broadcast-rows",
                        format!("shape {} broadcasts into {} over some leading dims but not all", shape_str(&n.shape), shape_str(&out)),
                        "an operand's leading dims must be all the result's, all 1, or 1s then the result's; expand it first or let it run eagerly",
                    ));
                }
            }
        }
        Self::check_row(op, &out)?;
        Ok(out)
    }

    fn parts(&self, args: &[Operand]) -> Vec<Part> {
        args.iter()
            .map(|&a| match a {
                Operand::Scalar(_) => Part { dtype: None, rank0: true },
                Operand::Node(id) => Part { dtype: Some(self.nodes[id].dtype), rank0: self.nodes[id].shape.is_empty() },
            })
            .collect()
    }

    /// The dtype torch computes a binary op, comparison or `where` of `args` in (its
    /// "common dtype"): every tensor operand is cast to it first, so an f32 0-dim tensor
    /// meeting a bf16 tensor is rounded to bf16.
    pub fn common_dtype(&self, args: &[Operand]) -> DType {
        promote(&self.parts(args))
    }

    fn float_operand(&self, op: &str, name: &str, a: Operand) -> Result<(), KernelError> {
        if let Operand::Scalar(x) = a {
            return scalar_ok(op, name, x);
        }
        if let Some(n) = self.operand(op, name, a)? {
            if n.dtype == DType::Bool {
                return Err(err(op, format!("operand `{name}`"), "fusion-dtype", "a bool tensor", "cast it to a float dtype first; bool arithmetic runs eagerly"));
            }
        }
        Ok(())
    }

    fn node_arg(&self, op: &str, name: &str, x: Operand) -> Result<NodeId, KernelError> {
        match x {
            Operand::Node(id) => self.operand(op, name, x).map(|_| id),
            Operand::Scalar(_) => Err(err(op, format!("operand `{name}`"), "fusion-operand", "a number where a tensor is required", "pass a tensor")),
        }
    }

    pub fn unary(&mut self, op: Unary, x: NodeId) -> Result<NodeId, KernelError> {
        let name = format!("{op:?}").to_lowercase();
        self.float_operand(&name, "x", Operand::Node(x))?;
        let n = self.operand(&name, "x", Operand::Node(x))?.expect("a node");
        let (dtype, shape) = (n.dtype, n.shape.clone());
        Ok(self.push(NodeOp::Unary(op), vec![Operand::Node(x)], dtype, shape))
    }

    pub fn binary(&mut self, op: Binary, a: Operand, b: Operand) -> Result<NodeId, KernelError> {
        let name = format!("{op:?}").to_lowercase();
        if a == b && matches!(a, Operand::Scalar(_)) || matches!((a, b), (Operand::Scalar(_), Operand::Scalar(_))) {
            return Err(err(&name, "operands", "fusion-operand", "two numbers", "at least one operand must be a tensor"));
        }
        self.float_operand(&name, "self", a)?;
        self.float_operand(&name, "other", b)?;
        let shape = self.broadcast(&name, &["self", "other"], &[a, b])?;
        let dtype = promote(&self.parts(&[a, b]));
        Ok(self.push(NodeOp::Binary(op), vec![a, b], dtype, shape))
    }

    pub fn compare(&mut self, op: CmpOp, a: Operand, b: Operand) -> Result<NodeId, KernelError> {
        let name = format!("{op:?}").to_lowercase();
        if matches!((a, b), (Operand::Scalar(_), Operand::Scalar(_))) {
            return Err(err(&name, "operands", "fusion-operand", "two numbers", "at least one operand must be a tensor"));
        }
        self.float_operand(&name, "self", a)?;
        self.float_operand(&name, "other", b)?;
        let shape = self.broadcast(&name, &["self", "other"], &[a, b])?;
        Ok(self.push(NodeOp::Compare(op), vec![a, b], DType::Bool, shape))
    }

    /// `where(cond, a, b)`; `a` and `b` promote as a binary op's operands.
    pub fn where_(&mut self, cond: NodeId, a: Operand, b: Operand) -> Result<NodeId, KernelError> {
        let c = self.node_arg("where", "condition", Operand::Node(cond))?;
        if self.nodes[c].dtype != DType::Bool {
            return Err(err("where", "operand `condition`", "fusion-dtype", format!("a {} condition", self.nodes[c].dtype), "torch.where takes a bool condition"));
        }
        if matches!((a, b), (Operand::Scalar(_), Operand::Scalar(_))) {
            return Err(err("where", "operands", "fusion-operand", "two numbers", "at least one of self and other must be a tensor"));
        }
        self.float_operand("where", "self", a)?;
        self.float_operand("where", "other", b)?;
        let shape = self.broadcast("where", &["condition", "self", "other"], &[Operand::Node(cond), a, b])?;
        let dtype = promote(&self.parts(&[a, b]));
        Ok(self.push(NodeOp::Where, vec![Operand::Node(cond), a, b], dtype, shape))
    }

    pub fn clamp(&mut self, x: NodeId, lo: Option<f64>, hi: Option<f64>) -> Result<NodeId, KernelError> {
        self.float_operand("clamp", "self", Operand::Node(x))?;
        if lo.is_none() && hi.is_none() {
            return Err(err("clamp", "min and max", "fusion-operand", "neither bound is given", "torch raises for this too"));
        }
        for (name, b) in [("min", lo), ("max", hi)] {
            if let Some(b) = b {
                scalar_ok("clamp", name, b)?;
            }
        }
        let n = &self.nodes[self.node_arg("clamp", "self", Operand::Node(x))?];
        let (dtype, shape) = (n.dtype, n.shape.clone());
        Ok(self.push(NodeOp::Clamp(lo, hi), vec![Operand::Node(x)], dtype, shape))
    }

    pub fn cast(&mut self, x: NodeId, to: DType) -> Result<NodeId, KernelError> {
        let n = &self.nodes[self.node_arg("to", "self", Operand::Node(x))?];
        if !matches!(to, DType::F32 | DType::BF16 | DType::Bool) {
            return Err(err("to", "dtype", "fusion-dtype", format!("a cast to {to}"), "casts to float32, bfloat16 and bool fuse; others run eagerly"));
        }
        let shape = n.shape.clone();
        // A copy of a copy between rows (`.contiguous()` / `clone()` of a transposed or
        // expanded view) is that copy again, so one kernel makes it, not two.
        let mut c = x;
        while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[c].op, self.nodes[c].args.first()) {
            if self.nodes[src].shape != shape {
                break;
            }
            c = src;
        }
        let n = &self.nodes[c];
        if to == n.dtype && matches!(n.op, NodeOp::Transpose | NodeOp::Gather(_)) {
            let (op, args, dtype) = (n.op.clone(), n.args.clone(), n.dtype);
            return Ok(self.push(op, args, dtype, shape));
        }
        Ok(self.push(NodeOp::Cast(to), vec![Operand::Node(x)], to, shape))
    }

    /// A row op over the last dim. With `keepdim == false` a reduction's result drops the
    /// last dim (a [`NodeOp::View`] of the keepdim result).
    pub fn row(&mut self, op: RowOp, x: NodeId, keepdim: bool) -> Result<NodeId, KernelError> {
        let name = format!("{op:?}").to_lowercase();
        self.float_operand(&name, "self", Operand::Node(x))?;
        let n = &self.nodes[self.node_arg(&name, "self", Operand::Node(x))?];
        if n.shape.is_empty() {
            return Err(err(&name, "operand `self`", "fusion-shape", "a 0-dim tensor", "row ops take tensors of at least one dim"));
        }
        let (dtype, shape) = (n.dtype, n.shape.clone());
        if op.keeps_row() {
            return Ok(self.push(NodeOp::Row(op), vec![Operand::Node(x)], dtype, shape));
        }
        let mut kept = shape.clone();
        *kept.last_mut().expect("rank >= 1") = 1;
        let r = self.push(NodeOp::Row(op), vec![Operand::Node(x)], dtype, kept);
        if keepdim {
            Ok(r)
        } else {
            self.view(r, &shape[..shape.len() - 1])
        }
    }

    /// `x.expand(shape)`: `x` broadcast to `shape` (torch's broadcasting rules).
    pub fn expand(&mut self, x: NodeId, shape: &[usize]) -> Result<NodeId, KernelError> {
        let n = &self.nodes[self.node_arg("expand", "self", Operand::Node(x))?];
        if broadcast_shapes(&n.shape, shape).as_deref() != Some(shape) {
            return Err(err("expand", "shape", "fusion-broadcast", format!("{} does not expand to {}", shape_str(&n.shape), shape_str(shape)), "torch raises for these shapes too"));
        }
        if !row_broadcast_ok(&n.shape, shape) {
            return Err(err("expand", "operand `self`", "fusion-broadcast-rows", format!("shape {} expands into {} over some leading dims but not all", shape_str(&n.shape), shape_str(shape)), "an operand's leading dims must be all the result's or all 1"));
        }
        Self::check_row("expand", shape)?;
        if n.shape == shape {
            // matmul expands its operands to the shapes they have: the same value.
            return self.view(x, shape);
        }
        let dtype = n.dtype;
        Ok(self.push(NodeOp::Expand, vec![Operand::Node(x)], dtype, shape.to_vec()))
    }

    /// `x.sum(dims)` over every dim but the last (a column sum): `[n]`, or `[1, .., 1, n]`
    /// with `keepdim`.
    pub fn col_sum(&mut self, x: NodeId, keepdim: bool) -> Result<NodeId, KernelError> {
        self.float_operand("sum", "self", Operand::Node(x))?;
        let n = &self.nodes[self.node_arg("sum", "self", Operand::Node(x))?];
        if n.shape.len() < 2 {
            return Err(err("sum", "operand `self`", "fusion-shape", format!("a column sum of a rank-{} tensor", n.shape.len()), "column sums take tensors of at least two dims (a 1-d sum is a row op)"));
        }
        let c = *n.shape.last().expect("rank >= 2");
        let shape = if keepdim { n.shape.iter().enumerate().map(|(i, &d)| if i + 1 == n.shape.len() { d } else { 1 }).collect() } else { vec![c] };
        let dtype = n.dtype;
        Ok(self.push(NodeOp::ColSum, vec![Operand::Node(x)], dtype, shape))
    }

    /// `x.sum(lo..=hi, keepdim)` over adjacent dims before the last, when `x` is (through
    /// reshapes, and maybe transposed) a batched matmul whose batches those dims index (GQA's
    /// `dV = P^T @ dO` viewed `[b, hkv, rep, s, d]` and summed over `rep`; `dK`, the
    /// transpose of `Q^T @ dS`): one matmul whose contraction runs
    /// over the summed batches too, `k' = r * k` (operand `a` read transposed as
    /// `[lead, r * k, m]`, `b` as `[lead, r * k, n]`: both plain views). f32 accumulation and
    /// one rounding (torch rounds each batch's product before summing: the bf16 results may
    /// differ by that rounding). Any other sum is refused (`sum-dim`): the front-end then
    /// sums with a matmul by a row of ones.
    pub fn sum_matmul_batches(&mut self, x: NodeId, lo: usize, hi: usize, keepdim: bool) -> Result<NodeId, KernelError> {
        let xs = self.nodes[self.node_arg("sum", "self", Operand::Node(x))?].shape.clone();
        let refuse = |why: &str| err("sum", "operand `self`", "sum-dim", why.to_string(), "sums over the last dim, all dims but the last, or the batches of a matmul fuse");
        if lo > hi || hi + 1 >= xs.len() {
            return Err(refuse("not a run of dims before the last"));
        }
        let mut y = x;
        while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[y].op, self.nodes[y].args.first()) {
            y = src;
        }
        // The matmul's result transposed (autograd's dK = (Q^T @ dS)^T): the sum of the
        // transposed products is the product of the operands swapped, `dS^T @ Q`.
        let flip = matches!(self.nodes[y].op, NodeOp::Transpose);
        if let (true, Some(&Operand::Node(src))) = (flip, self.nodes[y].args.first()) {
            y = src;
            while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[y].op, self.nodes[y].args.first()) {
                let (ys, ss) = (&self.nodes[y].shape, &self.nodes[src].shape);
                if ys.len() < 2 || ss.len() < 2 || ys[ys.len() - 2..] != ss[ss.len() - 2..] {
                    break;
                }
                y = src;
            }
        }
        let (NodeOp::Matmul { transpose_a: true, transpose_b: false, repeat: [1, 1] }, [Operand::Node(a), Operand::Node(b)]) = (&self.nodes[y].op, &self.nodes[y].args[..]) else {
            return Err(refuse("its operand is not a batched matmul (a read transposed, b not, no bias)"));
        };
        // The product's operands, each stored `[.., k, cols]`: the first read transposed.
        let (lhs, rhs) = if flip { (*b, *a) } else { (*a, *b) };
        let (lead, r, rest) = (xs[..lo].iter().product::<usize>(), xs[lo..=hi].iter().product::<usize>(), xs[hi + 1..].iter().product::<usize>());
        let batches = |s: &[usize]| s[..s.len() - 2].iter().product::<usize>();
        let (sl, sr) = (self.nodes[lhs].shape.clone(), self.nodes[rhs].shape.clone());
        let (k, m, n) = (sl[sl.len() - 2], sl[sl.len() - 1], sr[sr.len() - 1]);
        if rest != m * n || sl.len() < 3 || sr.len() < 3 || batches(&sl) != lead * r || batches(&sr) != lead * r {
            return Err(refuse("the summed dims are not batch dims of the matmul"));
        }
        let lv = self.view(lhs, &[lead, r * k, m])?;
        let lt = self.transpose(lv)?;
        let rv = self.view(rhs, &[lead, r * k, n])?;
        let s = self.matmul(lt, rv, None)?;
        let mut out = xs[..lo].to_vec();
        if keepdim {
            out.extend(std::iter::repeat_n(1, hi + 1 - lo));
        }
        out.extend_from_slice(&xs[hi + 1..]);
        self.view(s, &out)
    }

    /// `x.view(shape)` / `reshape` of a contiguous tensor.
    pub fn view(&mut self, x: NodeId, shape: &[usize]) -> Result<NodeId, KernelError> {
        let n = &self.nodes[self.node_arg("view", "self", Operand::Node(x))?];
        Self::check_row("view", shape)?;
        let (have, want) = (n.shape.iter().product::<usize>(), shape.iter().product::<usize>());
        if have != want {
            return Err(err("view", "shape", "fusion-shape", format!("{} has {have} elements, {} has {want}", shape_str(&n.shape), shape_str(shape)), "keep the element count"));
        }
        let dtype = n.dtype;
        Ok(self.push(NodeOp::View, vec![Operand::Node(x)], dtype, shape.to_vec()))
    }

    /// `a @ b` (see [`NodeOp::Matmul`]); a [`NodeOp::Transpose`] operand is read in place
    /// (its flag flips), so `x @ w.t()` and `q @ k.transpose(-1, -2)` copy nothing.
    pub fn matmul(&mut self, a: NodeId, b: NodeId, bias: Option<NodeId>) -> Result<NodeId, KernelError> {
        let (mut a, mut b) = (self.node_arg("matmul", "self", Operand::Node(a))?, self.node_arg("matmul", "mat2", Operand::Node(b))?);
        let (mut ta, mut tb) = (false, false);
        for (x, t) in [(&mut a, &mut ta), (&mut b, &mut tb)] {
            // Through reshapes of the batch dims (matmul's `[b, h, ..] -> [b * h, ..]`).
            let mut y = *x;
            while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[y].op, self.nodes[y].args.first()) {
                let (ys, ss) = (&self.nodes[y].shape, &self.nodes[src].shape);
                if ys.len() < 2 || ss.len() < 2 || ys[ys.len() - 2..] != ss[ss.len() - 2..] {
                    break;
                }
                y = src;
            }
            if let (NodeOp::Transpose, Some(&Operand::Node(src))) = (&self.nodes[y].op, self.nodes[y].args.first()) {
                let mut shape = self.nodes[*x].shape.clone();
                let r = shape.len();
                shape.swap(r - 1, r - 2);
                *x = if self.nodes[src].shape == shape { src } else { self.view(src, &shape)? };
                *t = true;
            }
        }
        let (na, nb) = (&self.nodes[a], &self.nodes[b]);
        for (n, name) in [(na, "self"), (nb, "mat2")] {
            if !matches!(n.dtype, DType::F32 | DType::BF16) {
                return Err(err("matmul", format!("operand `{name}`"), "fusion-dtype", format!("a {} operand", n.dtype), "float32 and bfloat16 matmuls fuse; others run eagerly"));
            }
            if n.shape.len() < 2 {
                return Err(err("matmul", format!("operand `{name}`"), "fusion-shape", format!("a rank-{} operand", n.shape.len()), "matmuls of rank-2 or batched operands fuse (torch's 1-d matmul runs eagerly)"));
            }
        }
        if na.dtype != nb.dtype {
            return Err(err("matmul", "operand `mat2`", "fusion-dtype", format!("self is {} and mat2 {}", na.dtype, nb.dtype), "torch raises for mixed dtypes too"));
        }
        let dims = |s: &[usize], t: bool| {
            let (r, c) = (s[s.len() - 2], s[s.len() - 1]);
            if t {
                (c, r)
            } else {
                (r, c)
            }
        };
        let ((m, k), (kb, n)) = (dims(&na.shape, ta), dims(&nb.shape, tb));
        if k != kb {
            return Err(err("matmul", "operand `mat2`", "fusion-shape", format!("contracting dims differ: {} x {} (k = {k} and {kb})", shape_str(&na.shape), shape_str(&nb.shape)), "torch raises for these shapes too"));
        }
        let (ba, bb) = (&na.shape[..na.shape.len() - 2], &nb.shape[..nb.shape.len() - 2]);
        let batch = if ba == bb || bb.is_empty() {
            ba.to_vec()
        } else if ba.is_empty() {
            bb.to_vec()
        } else {
            return Err(err("matmul", "operand `mat2`", "fusion-broadcast", format!("batch dims {} and {}", shape_str(ba), shape_str(bb)), "batch dims must be equal or absent on one side; expand first"));
        };
        let dtype = na.dtype;
        let mut shape = batch;
        shape.extend([m, n]);
        Self::check_row("matmul", &shape)?;
        if k == 0 {
            return Err(err("matmul", "operand `self`", "fusion-empty", "k = 0", "empty contractions run eagerly"));
        }
        if k > MAX_ROW {
            return Err(err("matmul", "operand `self`", "fusion-row-width", format!("k = {k}"), format!("contractions of at most {MAX_ROW} fuse; longer ones run eagerly")));
        }
        // An operand that repeats each batch of its source over an inner batch dim is read
        // from the source (its batch index divided by the repeat).
        let mut repeat = [1usize, 1];
        for (i, x) in [&mut a, &mut b].into_iter().enumerate() {
            if let Some((src, rep)) = self.batch_repeat(*x) {
                let s = &self.nodes[*x].shape;
                let (r, c) = (s[s.len() - 2], s[s.len() - 1]);
                let batch: usize = s[..s.len() - 2].iter().product();
                *x = self.view(src, &[batch / rep, r, c])?;
                repeat[i] = rep;
            }
        }
        let mut args = vec![Operand::Node(a), Operand::Node(b)];
        if let Some(c) = bias {
            let nc = &self.nodes[self.node_arg("addmm", "bias", Operand::Node(c))?];
            if nc.dtype != dtype || nc.shape != [n] {
                return Err(err("addmm", "operand `bias`", "fusion-shape", format!("a {}{} bias for a {dtype} [.., {n}] result", nc.dtype, shape_str(&nc.shape)), "a bias of the result's dtype and shape [n] fuses; add others separately"));
            }
            args.push(Operand::Node(c));
        }
        Ok(self.push(NodeOp::Matmul { transpose_a: ta, transpose_b: tb, repeat }, args, dtype, shape))
    }

    /// Whether matmul operand `x` (through reshapes of its batch dims) is a [`Gather`] that
    /// repeats its source over the innermost batch dim (`k[:, :, None].expand(.., rep, s, d)`):
    /// the source and the repeat.
    fn batch_repeat(&self, x: NodeId) -> Option<(NodeId, usize)> {
        let mut y = x;
        while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[y].op, self.nodes[y].args.first()) {
            let (ys, ss) = (&self.nodes[y].shape, &self.nodes[src].shape);
            if ys.len() < 2 || ss.len() < 2 || ys[ys.len() - 2..] != ss[ss.len() - 2..] {
                break;
            }
            y = src;
        }
        let n = &self.nodes[y];
        let (NodeOp::Gather(gt), Some(&Operand::Node(src))) = (&n.op, n.args.first()) else { return None };
        let r = n.shape.len();
        let ss = &self.nodes[src].shape;
        if r < 4 || ss.len() != r - 1 || gt.col_start != 0 || gt.start.iter().any(|&v| v != 0) || ss[ss.len() - 1] != n.shape[r - 1] {
            return None;
        }
        let j = r - 3;
        let pattern = (0..r - 1).all(|i| match i.cmp(&j) {
            std::cmp::Ordering::Less => gt.walks[i] == Some(i) || (n.shape[i] == 1 && gt.walks[i].is_none()),
            std::cmp::Ordering::Equal => gt.walks[i].is_none(),
            std::cmp::Ordering::Greater => gt.walks[i] == Some(i - 1),
        });
        (pattern && n.shape[j] > 1 && ss[..j] == n.shape[..j] && ss[j..] == n.shape[j + 1..]).then_some((src, n.shape[j]))
    }

    /// `x.transpose(-1, -2)` as a value.
    pub fn transpose(&mut self, x: NodeId) -> Result<NodeId, KernelError> {
        let n = &self.nodes[self.node_arg("transpose", "self", Operand::Node(x))?];
        if n.shape.len() < 2 {
            return Err(err("transpose", "operand `self`", "fusion-shape", format!("a rank-{} tensor", n.shape.len()), "transposes of the last two dims take rank >= 2"));
        }
        let mut shape = n.shape.clone();
        let r = shape.len();
        shape.swap(r - 1, r - 2);
        if shape[r - 1] * shape[r - 2] > MAX_TRANSPOSE {
            return Err(err("transpose", "operand `self`", "fusion-transpose-size", format!("a {}x{} transpose", shape[r - 1], shape[r - 2]), format!("transposes of at most {MAX_TRANSPOSE} elements per matrix fuse as values (a matmul reads any transposed operand in place)")));
        }
        Self::check_row("transpose", &shape)?;
        let dtype = n.dtype;
        Ok(self.push(NodeOp::Transpose, vec![Operand::Node(x)], dtype, shape))
    }

    /// The view of `x`'s memory (contiguous, `x`'s shape) with torch's `shape`, `strides` and
    /// `offset` (elements): a reshape, a transpose of the last two dims, a [`Gather`], or
    /// refused (`fusion-strided-view`: the front-end runs it eagerly).
    pub fn strided(&mut self, x: NodeId, shape: &[usize], strides: &[usize], offset: usize) -> Result<NodeId, KernelError> {
        let src = self.nodes[self.node_arg("as_strided", "self", Operand::Node(x))?].shape.clone();
        Self::check_row("as_strided", shape)?;
        if shape.len() != strides.len() {
            return Err(err("as_strided", "strides", "fusion-shape", format!("{} strides for shape {}", strides.len(), shape_str(shape)), "one stride per dim"));
        }
        let contiguous = |s: &[usize]| -> Vec<usize> {
            let mut c = vec![1; s.len()];
            for i in (0..s.len().saturating_sub(1)).rev() {
                c[i] = c[i + 1] * s[i + 1];
            }
            c
        };
        let same = |a: &[usize], b: &[usize], dims: &[usize]| dims.iter().zip(a.iter().zip(b)).all(|(&d, (x, y))| d == 1 || x == y);
        let total: usize = src.iter().product();
        if offset == 0 && shape.iter().product::<usize>() == total && same(strides, &contiguous(shape), shape) {
            return self.view(x, shape);
        }
        let refuse = |why: String| err("as_strided", "the view", "fusion-strided-view", why, "views that pick rows (permute/slice/select of leading dims, expand), a column window, or swap the last two dims fuse; this one runs eagerly");
        // See the memory as the dims the view's strides name (`[b * s, h * d]` read as
        // `[b, s, h, d]` by a head transpose): every stride of the view is then one of them.
        let mut steps: Vec<usize> = shape.iter().zip(strides).filter(|&(&n, &st)| n > 1 && st > 0).map(|(_, &st)| st).collect();
        steps.push(1);
        steps.sort_unstable_by(|a, b| b.cmp(a));
        steps.dedup();
        let mut fact = Vec::new();
        let mut prev = total;
        for &st in &steps {
            if st > prev || !prev.is_multiple_of(st) {
                return Err(refuse(format!("stride {st} does not divide the source's {prev} elements")));
            }
            fact.push(prev / st);
            prev = st;
        }
        let (x, src) = if fact != src { (self.view(x, &fact)?, fact) } else { (x, src) };
        let r = shape.len();
        if r >= 2 && r == src.len() && offset == 0 {
            let mut t = src.clone();
            t.swap(r - 1, r - 2);
            let mut ts = contiguous(&src);
            ts.swap(r - 1, r - 2);
            if t == shape && same(strides, &ts, shape) {
                return self.transpose(x);
            }
        }
        let p = src.len();
        if p == 0 || r == 0 {
            return Err(refuse("a 0-dim source or result".into()));
        }
        let cs = contiguous(&src);
        if shape[r - 1] != 1 && strides[r - 1] != 1 {
            return Err(refuse(format!("the last dim has stride {}", strides[r - 1])));
        }
        let start: Vec<usize> = (0..p).map(|q| (offset / cs[q]) % src[q]).collect();
        if start.iter().zip(&cs).map(|(s, c)| s * c).sum::<usize>() != offset {
            return Err(refuse(format!("offset {offset} is not an element of the source")));
        }
        let mut walks = Vec::new();
        let mut used = vec![false; p];
        for i in 0..r - 1 {
            if shape[i] == 1 || strides[i] == 0 {
                walks.push(None);
                continue;
            }
            let Some(q) = (0..p - 1).find(|&q| cs[q] == strides[i] && src[q] > 1 && !used[q]) else {
                return Err(refuse(format!("dim {i} has stride {}, no leading dim of the source", strides[i])));
            };
            if start[q] + shape[i] > src[q] {
                return Err(refuse(format!("dim {i} runs past the source's dim {q}")));
            }
            used[q] = true;
            walks.push(Some(q));
        }
        let col_start = start[p - 1];
        if col_start + shape[r - 1] > src[p - 1] {
            return Err(refuse("the columns run past the source's last dim".into()));
        }
        let gather = Gather { walks, start: start[..p - 1].to_vec(), col_start };
        let dtype = self.nodes[x].dtype;
        Ok(self.push(NodeOp::Gather(gather), vec![Operand::Node(x)], dtype, shape.to_vec()))
    }

    /// A [`Gather`] that keeps every row of its source and takes a window of its columns
    /// (`x[..., a:b]`), or a rows-keeping view of one (`x[i].view(1, n)`): the source
    /// (through views) and the window's first column.
    pub fn col_window(&self, id: NodeId) -> Option<(NodeId, usize)> {
        let n = &self.nodes[self.same_rows_source(id)];
        let (NodeOp::Gather(gt), Some(&Operand::Node(src))) = (&n.op, n.args.first()) else { return None };
        let s = &self.nodes[src].shape;
        let lead = &n.shape[..n.shape.len().saturating_sub(1)];
        let keeps_rows = n.shape.len() == s.len() && lead == &s[..s.len() - 1] && gt.start.iter().all(|&x| x == 0) && gt.walks.iter().enumerate().all(|(i, w)| *w == Some(i) || (lead[i] == 1 && w.is_none()));
        keeps_rows.then_some((src, gt.col_start))
    }

    /// `torch.cat(xs, -1)`: pieces of one dtype and leading shape.
    pub fn cat_cols(&mut self, xs: &[NodeId]) -> Result<NodeId, KernelError> {
        if xs.is_empty() || xs.len() > MAX_CAT {
            return Err(err("cat", "tensors", "fusion-operand", format!("{} pieces", xs.len()), format!("cat of 1 to {MAX_CAT} pieces fuses")));
        }
        let first = self.nodes[self.node_arg("cat", "tensors[0]", Operand::Node(xs[0]))?].clone();
        if first.shape.is_empty() {
            return Err(err("cat", "tensors[0]", "fusion-shape", "a 0-dim tensor", "torch raises for this too"));
        }
        let lead = &first.shape[..first.shape.len() - 1];
        let mut cols = 0;
        for (i, &x) in xs.iter().enumerate() {
            let n = &self.nodes[self.node_arg("cat", &format!("tensors[{i}]"), Operand::Node(x))?];
            if n.dtype != first.dtype || n.shape.len() != first.shape.len() || &n.shape[..n.shape.len() - 1] != lead {
                return Err(err("cat", format!("tensors[{i}]"), "fusion-shape", format!("a {}{} piece after a {}{} one", n.dtype, shape_str(&n.shape), first.dtype, shape_str(&first.shape)), "pieces of one dtype and leading shape fuse; others run eagerly"));
            }
            cols += n.shape[n.shape.len() - 1];
        }
        let mut shape = lead.to_vec();
        shape.push(cols);
        Self::check_row("cat", &shape)?;
        Ok(self.push(NodeOp::CatCols, xs.iter().map(|&x| Operand::Node(x)).collect(), first.dtype, shape))
    }

    /// Follows views whose rows are the source's rows: the node whose value this is, in
    /// the same layout (a view that changes the layout stops here).
    pub fn same_rows_source(&self, mut id: NodeId) -> NodeId {
        while let NodeOp::View = self.nodes[id].op {
            let Operand::Node(src) = self.nodes[id].args[0] else { break };
            if self.nodes[src].layout() != self.nodes[id].layout() {
                break;
            }
            id = src;
        }
        id
    }

    /// Follows every view: the node whose memory this is.
    pub fn storage(&self, mut id: NodeId) -> NodeId {
        while let (NodeOp::View, Some(&Operand::Node(src))) = (&self.nodes[id].op, self.nodes[id].args.first()) {
            id = src;
        }
        id
    }

    /// A structural key: every node's op, operands (numbers by their bits), dtype and shape.
    pub fn key(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.nodes.iter().enumerate() {
            let args: Vec<String> = n
                .args
                .iter()
                .map(|a| match a {
                    Operand::Node(id) => format!("%{id}"),
                    // Bits, so that the key tells -0.0 from 0.0 and NaN payloads apart.
                    Operand::Scalar(x) => format!("{x:e}#{:x}", x.to_bits()),
                })
                .collect();
            let op = match &n.op {
                NodeOp::Clamp(lo, hi) => format!("Clamp({:?},{:?})", lo.map(f64::to_bits), hi.map(f64::to_bits)),
                o => format!("{o:?}"),
            };
            writeln!(f, "%{i} = {op}({}) : {}{:?}", args.join(", "), n.dtype, n.shape)?;
        }
        Ok(())
    }
}
