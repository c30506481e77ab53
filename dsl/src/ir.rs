//! The tiled block IR: a kernel is a grid of program instances, each running `body` on
//! blocks of its operands chosen by the operands' index maps (the Pallas TPU model).
//!
//! Values, instructions and blocks live in arenas inside [`Kernel`] and are named by small
//! copyable handles ([`Value`], [`InstId`], [`BlockId`], [`RefId`]).

use crate::types::{DType, MemorySpace, Semantics, Type};

macro_rules! entity {
    ($(#[$m:meta])* $name:ident, $prefix:literal) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);
        impl $name {
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

entity!(/// An SSA value.
    Value, "%");
entity!(/// An instruction in the kernel's arena.
    InstId, "inst");
entity!(/// A region body: a list of instructions with block parameters.
    BlockId, "^bb");
entity!(/// A kernel operand or scratch buffer, in signature order.
    RefId, "@");

/// One grid dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct GridDim {
    /// The number of steps; for a dynamic dim, the static upper bound (what budgets,
    /// range checks and the verifier's grid walks use).
    pub extent: usize,
    pub semantics: Semantics,
    /// A dynamic extent (Pallas: a traced grid entry, as megablox gmm's active tile
    /// count): the scalar-prefetch operand, an int32 `[1]`, whose element 0 is the dim's
    /// extent at run time, in `0..=extent`. Steps at indices past it do not run. In
    /// Mosaic the dim is `INT64_MIN` in `iteration_bounds` and the value is a leading
    /// operand of the custom call.
    pub dynamic: Option<RefId>,
}

/// The role a ref plays in the kernel signature. Signature order is
/// prefetch, inputs, outputs, scratch (the Mosaic and Pallas convention).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefKind {
    /// int32 array copied to SMEM before the grid runs; readable by index maps.
    Prefetch,
    Input,
    Output,
    /// Lives across grid steps; never visible outside the kernel.
    Scratch,
}

impl RefKind {
    pub fn name(self) -> &'static str {
        match self {
            RefKind::Prefetch => "prefetch",
            RefKind::Input => "input",
            RefKind::Output => "output",
            RefKind::Scratch => "scratch",
        }
    }
}

/// An affine-or-not integer expression over grid indices and scalar-prefetch values,
/// used for block index maps. Evaluated per grid step; lowered to a Mosaic `transform_i`.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexExpr {
    /// The index of grid dimension `n`.
    Grid(usize),
    Const(i64),
    /// `prefetch[index...]`, a read of a scalar-prefetch operand.
    Prefetch { array: RefId, index: Vec<IndexExpr> },
    Bin(IndexOp, Box<IndexExpr>, Box<IndexExpr>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexOp {
    Add,
    Sub,
    Mul,
    /// Floor-free C-style division (operands are expected to be non-negative).
    Div,
    Rem,
    Min,
    Max,
}

impl IndexExpr {
    /// Convenience: the index of grid dimension `n`.
    pub fn grid(n: usize) -> IndexExpr {
        IndexExpr::Grid(n)
    }

    pub fn min(self, other: impl Into<IndexExpr>) -> IndexExpr {
        IndexExpr::Bin(IndexOp::Min, Box::new(self), Box::new(other.into()))
    }

    pub fn max(self, other: impl Into<IndexExpr>) -> IndexExpr {
        IndexExpr::Bin(IndexOp::Max, Box::new(self), Box::new(other.into()))
    }

    /// Visits every grid index and prefetch read in the expression.
    pub fn for_each_leaf(&self, f: &mut impl FnMut(&IndexExpr)) {
        match self {
            IndexExpr::Grid(_) | IndexExpr::Const(_) => f(self),
            IndexExpr::Prefetch { index, .. } => {
                f(self);
                index.iter().for_each(|e| e.for_each_leaf(f));
            }
            IndexExpr::Bin(_, a, b) => {
                a.for_each_leaf(f);
                b.for_each_leaf(f);
            }
        }
    }
}

impl IndexExpr {
    /// The closed range `(lo, hi)` the expression takes while grid dim `g` runs over
    /// `0..extents[g]`; `i64::MIN` / `i64::MAX` stand for unbounded (a prefetch read, or a
    /// bound that overflowed). Operands are i32 on every backend, so any bound past `i32`
    /// is as good as unbounded.
    pub fn range(&self, extents: &[usize]) -> (i64, i64) {
        const ANY: (i64, i64) = (i64::MIN, i64::MAX);
        match self {
            IndexExpr::Grid(g) => extents.get(*g).map_or(ANY, |&e| (0, (e as i64 - 1).max(0))),
            IndexExpr::Const(c) => (*c, *c),
            IndexExpr::Prefetch { .. } => ANY,
            IndexExpr::Bin(op, a, b) => {
                let ((alo, ahi), (blo, bhi)) = (a.range(extents), b.range(extents));
                match op {
                    IndexOp::Add => (alo.saturating_add(blo), ahi.saturating_add(bhi)),
                    IndexOp::Sub => (alo.saturating_sub(bhi), ahi.saturating_sub(blo)),
                    IndexOp::Mul => {
                        let p = [alo.saturating_mul(blo), alo.saturating_mul(bhi), ahi.saturating_mul(blo), ahi.saturating_mul(bhi)];
                        (*p.iter().min().unwrap(), *p.iter().max().unwrap())
                    }
                    // Truncating division by a positive constant is monotone.
                    IndexOp::Div if blo == bhi && blo > 0 => (alo / blo, ahi / blo),
                    IndexOp::Rem if blo == bhi && blo > 0 && alo >= 0 => (0, ahi.min(blo - 1)),
                    IndexOp::Div | IndexOp::Rem => ANY,
                    IndexOp::Min => (alo.min(blo), ahi.min(bhi)),
                    IndexOp::Max => (alo.max(blo), ahi.max(bhi)),
                }
            }
        }
    }

    /// The same map over the grid `extents`, with what cannot change its value at any grid
    /// point removed: a subexpression whose [`range`](Self::range) is one value becomes that
    /// constant (constants fold, `x * 0` is 0), `x + 0`, `x - 0`, `x * 1` and `x / 1` become
    /// `x`, a `min` / `max` whose one side bounds the other over the whole grid (a causal
    /// clamp that a non-causal kernel never reaches) becomes that side, and a division by a
    /// constant goes through a multiple of it ([`divided`](Self::divided): a causal kernel's
    /// last kv block `(i * 128 + 127) / 128` is `i`). Mosaic evaluates a window's map on the
    /// scalar unit at every grid step to find the next block, so each operation left is paid
    /// per step (libtpu, v6e causal flash forward at 128^2: the shift, add and shift of that
    /// one map cost 3.4% of the kernel's cycles).
    pub fn simplified(&self, extents: &[usize]) -> IndexExpr {
        match self {
            IndexExpr::Prefetch { array, index } => IndexExpr::Prefetch { array: *array, index: index.iter().map(|e| e.simplified(extents)).collect() },
            IndexExpr::Bin(op, a, b) => {
                // `range` is sound, so a range of one value is the value (a bound at the
                // i64 limits only says the bound overflowed).
                match self.range(extents) {
                    (lo, hi) if lo == hi && lo != i64::MIN && lo != i64::MAX => return IndexExpr::Const(lo),
                    _ => {}
                }
                let (a, b) = (a.simplified(extents), b.simplified(extents));
                let (ra, rb) = (a.range(extents), b.range(extents));
                let is = |r: (i64, i64), c: i64| r == (c, c);
                if let (IndexOp::Div, IndexExpr::Const(d)) = (op, &b) {
                    if let Some(q) = a.divided(*d, extents) {
                        return q.simplified(extents);
                    }
                }
                let side = match op {
                    IndexOp::Add if is(rb, 0) => Some(&a),
                    IndexOp::Add if is(ra, 0) => Some(&b),
                    IndexOp::Sub if is(rb, 0) => Some(&a),
                    IndexOp::Mul | IndexOp::Div if is(rb, 1) => Some(&a),
                    IndexOp::Mul if is(ra, 1) => Some(&b),
                    IndexOp::Min if ra.1 <= rb.0 => Some(&a),
                    IndexOp::Min if rb.1 <= ra.0 => Some(&b),
                    IndexOp::Max if ra.0 >= rb.1 => Some(&a),
                    IndexOp::Max if rb.0 >= ra.1 => Some(&b),
                    _ => None,
                };
                match side {
                    Some(kept) => kept.clone(),
                    None => IndexExpr::Bin(*op, Box::new(a), Box::new(b)),
                }
            }
            other => other.clone(),
        }
    }
}

impl IndexExpr {
    /// `self / d` (truncating) without the division, where that is exact at every grid point:
    /// `(x * k) / d` is `x * (k / d)` when `d` divides `k` (any sign), and `x / (d / k)` when
    /// `k` divides `d` and `x >= 0`; `(m + y) / d` is `m / d + y / d` when `d` divides `m`
    /// and both are non-negative (truncation is then the floor, and a multiple of `d` adds a
    /// whole quotient). `None` when no rule applies, or for `d <= 0`.
    fn divided(&self, d: i64, extents: &[usize]) -> Option<IndexExpr> {
        if d <= 0 {
            return None;
        }
        if let Some(q) = self.exact_quotient(d) {
            return Some(q);
        }
        let non_negative = |e: &IndexExpr| e.range(extents).0 >= 0;
        match self {
            IndexExpr::Bin(IndexOp::Mul, ..) => match self.scaled() {
                Some((x, k)) if k > 0 && d % k == 0 && non_negative(x) => Some(x.clone() / (d / k)),
                _ => None,
            },
            IndexExpr::Bin(IndexOp::Add, a, b) if non_negative(a) && non_negative(b) => {
                let split = |m: &IndexExpr, y: &IndexExpr| m.exact_quotient(d).map(|q| q + (y.clone() / d));
                split(a, b).or_else(|| split(b, a))
            }
            _ => None,
        }
    }

    /// `x * k` or `k * x` for a constant `k`: `(x, k)`.
    fn scaled(&self) -> Option<(&IndexExpr, i64)> {
        let IndexExpr::Bin(IndexOp::Mul, a, b) = self else { return None };
        match (&**a, &**b) {
            (x, IndexExpr::Const(k)) | (IndexExpr::Const(k), x) => Some((x, *k)),
            _ => None,
        }
    }

    /// `self / d` where `d` divides every value `self` can take, read off its form: a constant
    /// multiple of `d`, `x * k` with `d | k`, or a sum or difference of such.
    fn exact_quotient(&self, d: i64) -> Option<IndexExpr> {
        match self {
            IndexExpr::Const(c) if c % d == 0 => Some(IndexExpr::Const(c / d)),
            IndexExpr::Bin(IndexOp::Mul, ..) => match self.scaled() {
                Some((x, k)) if k % d == 0 => Some(x.clone() * (k / d)),
                _ => None,
            },
            IndexExpr::Bin(op @ (IndexOp::Add | IndexOp::Sub), a, b) => Some(IndexExpr::Bin(*op, Box::new(a.exact_quotient(d)?), Box::new(b.exact_quotient(d)?))),
            _ => None,
        }
    }
}

impl From<i64> for IndexExpr {
    fn from(v: i64) -> Self {
        IndexExpr::Const(v)
    }
}
impl From<i32> for IndexExpr {
    fn from(v: i32) -> Self {
        IndexExpr::Const(v as i64)
    }
}
impl From<usize> for IndexExpr {
    fn from(v: usize) -> Self {
        IndexExpr::Const(v as i64)
    }
}

macro_rules! index_binop {
    ($tr:ident, $method:ident, $op:ident) => {
        impl<T: Into<IndexExpr>> std::ops::$tr<T> for IndexExpr {
            type Output = IndexExpr;
            fn $method(self, rhs: T) -> IndexExpr {
                IndexExpr::Bin(IndexOp::$op, Box::new(self), Box::new(rhs.into()))
            }
        }
    };
}
index_binop!(Add, add, Add);
index_binop!(Sub, sub, Sub);
index_binop!(Mul, mul, Mul);
index_binop!(Div, div, Div);
index_binop!(Rem, rem, Rem);

/// How an operand is cut into blocks: the block shape (a `None` dim is squeezed: size 1,
/// dropped from the kernel's view) and the index map from grid indices to *block* indices.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSpec {
    pub block_shape: Vec<Option<usize>>,
    pub index_map: Vec<IndexExpr>,
}

impl BlockSpec {
    /// The block's shape in memory, squeezed dims as 1.
    pub fn window(&self) -> Vec<usize> {
        self.block_shape.iter().map(|d| d.unwrap_or(1)).collect()
    }

    /// The shape the kernel body sees: squeezed dims dropped.
    pub fn view(&self) -> Vec<usize> {
        self.block_shape.iter().flatten().copied().collect()
    }
}

/// A kernel operand (prefetch, input, output) or a scratch buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct RefDecl {
    pub name: String,
    pub kind: RefKind,
    pub dtype: DType,
    /// The full array shape (for scratch: the buffer's shape).
    pub shape: Vec<usize>,
    pub memory: MemorySpace,
    /// How the array is blocked. `None` means the kernel sees the whole array (scratch,
    /// scalar prefetch, SMEM tables and ANY/HBM operands).
    pub block: Option<BlockSpec>,
    /// Where the user declared the operand (the `#[tpu_kernel]` argument), if known:
    /// verifier errors about the operand carry it.
    pub loc: Option<SourceLoc>,
}

impl RefDecl {
    /// The shape the kernel body indexes: the block view, or the whole array.
    pub fn view(&self) -> Vec<usize> {
        match &self.block {
            Some(b) => b.view(),
            None => self.shape.clone(),
        }
    }

    /// The shape of the memory window the kernel's ref points at (squeezed dims as 1).
    pub fn window(&self) -> Vec<usize> {
        match &self.block {
            Some(b) => b.window(),
            None => self.shape.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Tanh,
    Erf,
    Sqrt,
    Rsqrt,
    /// Logical/bitwise not (bool or integer).
    Not,
    /// `ln(1 + x)`, accurate near 0.
    Log1p,
    /// `exp(x) - 1`, accurate near 0.
    Expm1,
    Sin,
    Cos,
    Floor,
    Ceil,
    /// Round to the nearest integer, ties to even (`torch.round`, `jnp.round`).
    Round,
    /// -1, 0 or 1 by the sign of `x`; `sign(±0) = +0`, `sign(NaN) = NaN` (`jnp.sign`).
    Sign,
}

impl UnaryOp {
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Erf => "erf",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Not => "not",
            UnaryOp::Log1p => "log1p",
            UnaryOp::Expm1 => "expm1",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Round => "round",
            UnaryOp::Sign => "sign",
        }
    }

    /// Transcendental ops count toward the cost estimate's `transcendentals`.
    pub fn is_transcendental(self) -> bool {
        matches!(self, UnaryOp::Exp | UnaryOp::Log | UnaryOp::Tanh | UnaryOp::Erf | UnaryOp::Rsqrt | UnaryOp::Sqrt | UnaryOp::Log1p | UnaryOp::Expm1 | UnaryOp::Sin | UnaryOp::Cos)
    }

    pub fn float_only(self) -> bool {
        !matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Not)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Max,
    Min,
    Pow,
    And,
    Or,
    Xor,
    /// `x << n` on integers. An amount outside `0..bits` (negative, or at least the
    /// dtype's width: 32 for i32, 8 for i8) gives 0, as `jax.lax.shift_left` (XLA).
    Shl,
    /// `x >> n`, arithmetic (sign-filling) on the signed integer dtypes. An amount
    /// outside `0..bits` gives the sign fill: -1 for negative `x`, else 0 (XLA's
    /// `shift_right_arithmetic`).
    Shr,
    /// `x >> n`, logical (zero-filling): the bits are read as unsigned. An amount outside
    /// `0..bits` gives 0 (XLA's `shift_right_logical`).
    ShrLogical,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Rem => "rem",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Pow => "pow",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::Shl => "shl",
            BinaryOp::Shr => "shr",
            BinaryOp::ShrLogical => "shr_logical",
        }
    }

    /// Shifts: integer-only, with the out-of-range amounts defined as XLA does.
    pub fn is_shift(self) -> bool {
        matches!(self, BinaryOp::Shl | BinaryOp::Shr | BinaryOp::ShrLogical)
    }

    pub fn is_bitwise(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// A scalar constant. Floats are stored as f64 and rounded to the value's dtype.
#[derive(Clone, Copy, Debug)]
pub enum Scalar {
    Float(f64),
    Int(i64),
    Bool(bool),
}

/// Structural equality: floats compare by their bits, so a kernel holding a NaN constant
/// equals its rebuild (the compile caches match kernels by `==`) and `-0.0` stays apart from `0.0`.
impl PartialEq for Scalar {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Scalar::Float(a), Scalar::Float(b)) => a.to_bits() == b.to_bits(),
            (Scalar::Int(a), Scalar::Int(b)) => a == b,
            (Scalar::Bool(a), Scalar::Bool(b)) => a == b,
            _ => false,
        }
    }
}

/// One dimension of a ref access: the `len` elements `start, start + stride, ...,
/// start + (len - 1) * stride` (Pallas `pl.ds(start, len, stride)`). `start` is an i32
/// scalar value; `stride` is static and at least 1 (1 for a plain slice).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slice {
    pub start: Value,
    pub len: usize,
    pub stride: usize,
}

impl Slice {
    /// The elements the slice spans, first to last inclusive: `(len - 1) * stride + 1`.
    pub fn span(&self) -> usize {
        self.len.saturating_sub(1).saturating_mul(self.stride).saturating_add(1)
    }
}

/// One side of an async copy: `ref[slices]`, one slice per dim of the ref's view (for the
/// usual ANY operands and scratch buffers, the whole array).
#[derive(Clone, Debug, PartialEq)]
pub struct DmaRef {
    pub r: RefId,
    pub slices: Vec<Slice>,
}

impl DmaRef {
    /// The copied box's shape (the slice lengths).
    pub fn shape(&self) -> Vec<usize> {
        self.slices.iter().map(|s| s.len).collect()
    }
}

/// The shape both sides of a copy must agree on: `shape` without its leading 1s, so that
/// `buf[slot]` (`[1, 8, 128]`) and `x[p]` (`[1, 1, 8, 128]`) describe the same `[8, 128]`
/// box, as Pallas' integer indexing squeezes them.
pub fn dma_box(shape: &[usize]) -> &[usize] {
    let lead = shape.iter().take_while(|&&d| d == 1).count().min(shape.len().saturating_sub(1));
    &shape[lead..]
}

/// The peer side of a copy into another device's buffer (Pallas `make_async_remote_copy`):
/// `dst` names the buffer of that name on device `device`, and the copy's semaphore
/// (`DmaStart::sem`) is the receive semaphore there.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteDma {
    /// The destination device's logical id: an i32 scalar, usually computed from mesh
    /// coordinates (`(axis_index + 1) % n`).
    pub device: Value,
    /// The sender's semaphore, signalled once the source has been read (`wait_send`).
    pub send_sem: RefId,
    pub send_index: Value,
}

/// Which end of a remote copy a wait is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaSide {
    /// The sender waits until its source has been read (Pallas `.wait_send()`).
    Send,
    /// The receiver waits until a copy has landed in its buffer (Pallas `.wait_recv()`).
    Recv,
}

/// A wait for one end of a remote copy: `DmaWait::sem` is the send semaphore (`Send`) or
/// the receive semaphore (`Recv`) of the copy's descriptor.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteWait {
    /// The descriptor's peer device (what the copy was started with).
    pub device: Value,
    pub side: DmaSide,
}

/// A counting semaphore: one of a `regular_semaphores(n)` array, or the kernel's barrier
/// semaphore (Pallas `get_barrier_semaphore()`, shared by every kernel of one
/// `collective_id`).
#[derive(Clone, Debug, PartialEq)]
pub enum SemaphoreRef {
    Array { sem: RefId, index: Value },
    Barrier,
}

/// One axis of a device mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshAxis {
    pub name: String,
    pub size: usize,
}

/// What a kernel that talks to other devices declares: the mesh it runs on and Mosaic's
/// `collective_id` (which barrier semaphore it gets). Every device runs the same kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    /// Major to minor: a device's logical id is its coordinates read row-major over the
    /// axes (as JAX numbers the devices of a `Mesh`; Pallas' `axis_index` reads it so).
    pub mesh: Vec<MeshAxis>,
    pub collective_id: u32,
}

impl Collective {
    /// The number of devices in the mesh (saturating; the verifier bounds it).
    pub fn devices(&self) -> usize {
        self.mesh.iter().fold(1usize, |n, a| n.saturating_mul(a.size))
    }

    /// The logical-id stride of `axis` (the product of the sizes after it).
    pub fn stride(&self, axis: usize) -> usize {
        self.mesh.iter().skip(axis + 1).fold(1usize, |n, a| n.saturating_mul(a.size))
    }

    pub fn axis(&self, name: &str) -> Option<usize> {
        self.mesh.iter().position(|a| a.name == name)
    }
}

/// The instructions of the block IR. Vectors are whole blocks: every op works on
/// the entire value at once.
#[derive(Clone, Debug, PartialEq)]
pub enum Inst {
    /// A scalar or a splatted vector constant (the result type says which).
    Const(Scalar),
    ProgramId(usize),
    NumPrograms(usize),
    /// Read `ref[slices]`. The result is a vector with the slice lengths as shape, or a
    /// scalar when the ref lives in SMEM (all lengths 1).
    Load { src: RefId, slices: Vec<Slice> },
    /// Write `value` to `ref[slices]`.
    Store { dst: RefId, slices: Vec<Slice>, value: Value },
    Unary(UnaryOp, Value),
    /// Operands have identical types (the builder inserts broadcasts).
    Binary(BinaryOp, Value, Value),
    Cmp(CmpOp, Value, Value),
    Select { cond: Value, on_true: Value, on_false: Value },
    Cast(Value),
    /// The same bits read as the result dtype (`arith.bitcast`, `jax.lax.bitcast_convert_type`):
    /// i32 <-> f32 only.
    Bitcast(Value),
    /// Numpy-style broadcast of a scalar, or of a vector with 1-sized dims, to the result shape.
    Broadcast(Value),
    /// Indices along `dim` of the result shape.
    Iota { dim: usize },
    /// Reduce along `axis`, keeping it with size 1.
    Reduce { op: ReduceOp, axis: usize, x: Value },
    /// Inclusive prefix sum along `axis` (`jnp.cumsum`): same type as `x`; f32 and bf16
    /// add in f32 in index order (bf16 rounds each output once), i32 wraps.
    Cumsum { axis: usize, x: Value },
    /// Seeds the core's random generator with i32 scalars (`pltpu.prng_seed(*seeds)`,
    /// Mosaic `tpu.prng_set_seed_32`). The state lives until the next seed.
    PrngSeed(Vec<Value>),
    /// A vector of random i32 bits from the generator (`pltpu.prng_random_bits`,
    /// Mosaic `tpu.prng_random_bits`). The CPU backends draw a documented counter-based
    /// stream (`interp::prng_bits`); a TPU's hardware bits differ.
    PrngRandomBits,
    /// Matrix product of two rank-2 vectors with f32 (i32 for integers) accumulation.
    /// `transpose_rhs` contracts the last dims of both (`a @ b.T`).
    Dot { lhs: Value, rhs: Value, transpose_lhs: bool, transpose_rhs: bool },
    /// Swap the last two dims.
    Transpose(Value),
    Reshape(Value),
    /// The one element of a 32-bit vector whose dims are all 1, as a scalar (Pallas `x[0, 0]`
    /// of a value, `jnp.sum(x)` used in `pl.when`; Mosaic `vector.extract`, a vector-to-scalar
    /// move in the LLO): a vector reduction that decides a branch, without a DMA to SMEM.
    Item(Value),
    /// The parts joined along `axis` (Mosaic `tpu.concatenate`): equal dtypes and ranks,
    /// equal sizes but on `axis`. Parts repeated are `jnp.tile` (a lane-replicated `[r, 128]`
    /// column tiled to a `[r, 512]` score tile).
    Concat { axis: usize, parts: Vec<Value> },
    /// Results are the values yielded by the taken branch.
    If { cond: Value, then_block: BlockId, else_block: BlockId },
    /// `for i in lo..hi (step)`, with loop-carried values. The body's parameters are the
    /// induction variable (i32) then the carries; it yields the next carries.
    For { lo: Value, hi: Value, step: i64, init: Vec<Value>, body: BlockId },
    /// Starts an async copy `src -> dst` that signals `sem[sem_index]` when done (Pallas
    /// `make_async_copy(...).start()`). `dst` is not written until the matching wait.
    /// With `remote`, `dst` and `sem` are another device's (`make_async_remote_copy`).
    DmaStart { src: DmaRef, dst: DmaRef, sem: RefId, sem_index: Value, remote: Option<RemoteDma> },
    /// Waits on `sem[sem_index]` for a copy of the described size (Pallas `.wait()`, which
    /// takes the same descriptor as the start); with `remote`, for one end of a remote copy.
    DmaWait { src: DmaRef, dst: DmaRef, sem: RefId, sem_index: Value, remote: Option<RemoteWait> },
    /// This device's logical id in the mesh (Mosaic `tpu.device_id`), an i32.
    DeviceId,
    /// Adds `amount` (i32) to a counting semaphore, on this device or on `device`
    /// (Pallas `semaphore_signal(sem, amount, device_id=...)`).
    SemSignal { sem: SemaphoreRef, amount: Value, device: Option<Value> },
    /// Blocks until the semaphore holds at least `amount`, then subtracts it
    /// (Pallas `semaphore_wait`).
    SemWait { sem: SemaphoreRef, amount: Value },
    /// Ends an `If` branch or a `For` body.
    Yield(Vec<Value>),
}

impl Inst {
    /// The instruction's name in errors and printed IR (`load`, `add`, `dot`...).
    pub fn name(&self) -> &'static str {
        match self {
            Inst::Const(_) => "const",
            Inst::ProgramId(_) => "program_id",
            Inst::NumPrograms(_) => "num_programs",
            Inst::Load { .. } => "load",
            Inst::Store { .. } => "store",
            Inst::Unary(op, _) => op.name(),
            Inst::Binary(op, ..) => op.name(),
            Inst::Cmp(op, ..) => op.name(),
            Inst::Select { .. } => "select",
            Inst::Cast(_) => "cast",
            Inst::Bitcast(_) => "bitcast",
            Inst::Broadcast(_) => "broadcast",
            Inst::Iota { .. } => "iota",
            Inst::Reduce { op, .. } => op.name(),
            Inst::Cumsum { .. } => "cumsum",
            Inst::PrngSeed(_) => "prng_seed",
            Inst::PrngRandomBits => "prng_random_bits",
            Inst::Dot { .. } => "dot",
            Inst::Transpose(_) => "transpose",
            Inst::Reshape(_) => "reshape",
            Inst::Item(_) => "item",
            Inst::Concat { .. } => "concat",
            Inst::If { .. } => "if",
            Inst::For { .. } => "for",
            Inst::DmaStart { .. } => "dma_start",
            Inst::DmaWait { .. } => "dma_wait",
            Inst::DeviceId => "device_id",
            Inst::SemSignal { .. } => "semaphore_signal",
            Inst::SemWait { .. } => "semaphore_wait",
            Inst::Yield(_) => "yield",
        }
    }

    /// Every value the instruction reads (not those read inside its nested blocks).
    pub fn operands(&self) -> Vec<Value> {
        match self {
            Inst::Const(_) | Inst::ProgramId(_) | Inst::NumPrograms(_) | Inst::Iota { .. } | Inst::PrngRandomBits | Inst::DeviceId => vec![],
            Inst::PrngSeed(seeds) => seeds.clone(),
            Inst::Concat { parts, .. } => parts.clone(),
            Inst::Load { slices, .. } => slices.iter().map(|s| s.start).collect(),
            Inst::Store { slices, value, .. } => {
                let mut v: Vec<Value> = slices.iter().map(|s| s.start).collect();
                v.push(*value);
                v
            }
            Inst::Unary(_, x) | Inst::Cast(x) | Inst::Bitcast(x) | Inst::Broadcast(x) | Inst::Transpose(x) | Inst::Reshape(x) | Inst::Item(x) => vec![*x],
            Inst::Reduce { x, .. } | Inst::Cumsum { x, .. } => vec![*x],
            Inst::Binary(_, a, b) | Inst::Cmp(_, a, b) => vec![*a, *b],
            Inst::Dot { lhs, rhs, .. } => vec![*lhs, *rhs],
            Inst::Select { cond, on_true, on_false } => vec![*cond, *on_true, *on_false],
            Inst::If { cond, .. } => vec![*cond],
            Inst::For { lo, hi, init, .. } => {
                let mut v = vec![*lo, *hi];
                v.extend(init);
                v
            }
            Inst::DmaStart { src, dst, sem_index, remote, .. } => {
                let peer = remote.iter().flat_map(|r| [r.device, r.send_index]);
                src.slices.iter().chain(&dst.slices).map(|s| s.start).chain([*sem_index]).chain(peer).collect()
            }
            Inst::DmaWait { src, dst, sem_index, remote, .. } => {
                src.slices.iter().chain(&dst.slices).map(|s| s.start).chain([*sem_index]).chain(remote.iter().map(|r| r.device)).collect()
            }
            Inst::SemSignal { sem, amount, device } => sem.index().into_iter().chain([*amount]).chain(*device).collect(),
            Inst::SemWait { sem, amount } => sem.index().into_iter().chain([*amount]).collect(),
            Inst::Yield(vals) => vals.clone(),
        }
    }
}

impl Inst {
    /// The refs the instruction reads, writes, copies or signals through.
    pub fn refs(&self) -> Vec<RefId> {
        match self {
            Inst::Load { src, .. } => vec![*src],
            Inst::Store { dst, .. } => vec![*dst],
            Inst::DmaStart { src, dst, sem, remote, .. } => [src.r, dst.r, *sem].into_iter().chain(remote.iter().map(|r| r.send_sem)).collect(),
            Inst::DmaWait { src, dst, sem, .. } => vec![src.r, dst.r, *sem],
            Inst::SemSignal { sem: SemaphoreRef::Array { sem, .. }, .. } | Inst::SemWait { sem: SemaphoreRef::Array { sem, .. }, .. } => vec![*sem],
            _ => vec![],
        }
    }

    /// The refs of [`Inst::refs`], to rewrite in place.
    fn refs_mut(&mut self) -> Vec<&mut RefId> {
        match self {
            Inst::Load { src, .. } => vec![src],
            Inst::Store { dst, .. } => vec![dst],
            Inst::DmaStart { src, dst, sem, remote, .. } => [&mut src.r, &mut dst.r, sem].into_iter().chain(remote.iter_mut().map(|r| &mut r.send_sem)).collect(),
            Inst::DmaWait { src, dst, sem, .. } => vec![&mut src.r, &mut dst.r, sem],
            Inst::SemSignal { sem: SemaphoreRef::Array { sem, .. }, .. } | Inst::SemWait { sem: SemaphoreRef::Array { sem, .. }, .. } => vec![sem],
            _ => vec![],
        }
    }
}

impl SemaphoreRef {
    /// The index value of an array semaphore.
    pub fn index(&self) -> Option<Value> {
        match self {
            SemaphoreRef::Array { index, .. } => Some(*index),
            SemaphoreRef::Barrier => None,
        }
    }
}

impl Inst {
    /// Whether the instruction talks to another device (what `has_communication` declares).
    pub fn communicates(&self) -> bool {
        matches!(self, Inst::DmaStart { remote: Some(_), .. } | Inst::SemSignal { device: Some(_), .. })
            || matches!(self, Inst::SemSignal { sem: SemaphoreRef::Barrier, .. } | Inst::SemWait { sem: SemaphoreRef::Barrier, .. })
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ValueDef {
    /// Result `n` of an instruction.
    Result(InstId, usize),
    /// Parameter `n` of a block (loop induction variable and carries).
    Param(BlockId, usize),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValueData {
    pub ty: Type,
    pub def: ValueDef,
}

#[derive(Clone, Debug, PartialEq)]
pub struct InstData {
    pub inst: Inst,
    pub results: Vec<Value>,
    /// Where in the user's source the instruction came from (`file:line:col`), if known.
    pub loc: Option<SourceLoc>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLoc {
    pub file: &'static str,
    pub line: u32,
    pub column: u32,
}

impl std::fmt::Display for SourceLoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockData {
    pub params: Vec<Value>,
    pub insts: Vec<InstId>,
}

/// A complete kernel: signature, grid, and body. Built with [`crate::KernelBuilder`],
/// checked with [`crate::verify`], run with [`crate::interp`], lowered by `tessera-codegen`.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    pub name: String,
    pub grid: Vec<GridDim>,
    /// In signature order: prefetch, inputs, outputs, scratch.
    pub refs: Vec<RefDecl>,
    pub values: Vec<ValueData>,
    pub insts: Vec<InstData>,
    pub blocks: Vec<BlockData>,
    pub body: BlockId,
    /// Scoped VMEM limit requested by the kernel (bytes); `None` = the target's default.
    pub vmem_limit_bytes: Option<usize>,
    /// The mesh and `collective_id` of a kernel that talks to other devices.
    pub collective: Option<Collective>,
}

impl Kernel {
    pub fn value(&self, v: Value) -> &ValueData {
        &self.values[v.index()]
    }

    pub fn ty(&self, v: Value) -> &Type {
        &self.values[v.index()].ty
    }

    pub fn inst(&self, i: InstId) -> &InstData {
        &self.insts[i.index()]
    }

    pub fn block(&self, b: BlockId) -> &BlockData {
        &self.blocks[b.index()]
    }

    pub fn ref_decl(&self, r: RefId) -> &RefDecl {
        &self.refs[r.index()]
    }

    pub fn refs_of(&self, kind: RefKind) -> impl Iterator<Item = (RefId, &RefDecl)> {
        self.refs.iter().enumerate().filter(move |(_, r)| r.kind == kind).map(|(i, r)| (RefId(i as u32), r))
    }

    /// Operands visible outside the kernel (prefetch, inputs, outputs), in order.
    pub fn operands(&self) -> impl Iterator<Item = (RefId, &RefDecl)> {
        self.refs.iter().enumerate().filter(|(_, r)| r.kind != RefKind::Scratch).map(|(i, r)| (RefId(i as u32), r))
    }

    /// Per instruction (indexed by `InstId`), whether it is live: it has an effect (a store,
    /// a copy, a semaphore, the random generator's state, control flow and what branches
    /// yield) or a live instruction uses a result of it. A builder evaluates its arguments
    /// eagerly, so a `#[tpu_fn]` that ignores one under a static flag leaves a dead load
    /// behind (flash attention's segment ids without segments).
    pub fn live_insts(&self) -> Vec<bool> {
        let effect = |i: &Inst| {
            matches!(
                i,
                Inst::Store { .. } | Inst::DmaStart { .. } | Inst::DmaWait { .. } | Inst::SemSignal { .. } | Inst::SemWait { .. } | Inst::PrngSeed(_) | Inst::PrngRandomBits | Inst::If { .. } | Inst::For { .. } | Inst::Yield(_)
            )
        };
        let mut live = vec![false; self.insts.len()];
        let mut work: Vec<usize> = (0..self.insts.len()).filter(|&i| effect(&self.insts[i].inst)).collect();
        work.iter().for_each(|&i| live[i] = true);
        while let Some(i) = work.pop() {
            for v in self.insts[i].inst.operands() {
                if let ValueDef::Result(def, _) = self.value(v).def {
                    if !std::mem::replace(&mut live[def.index()], true) {
                        work.push(def.index());
                    }
                }
            }
        }
        live
    }

    /// Per ref (indexed by `RefId`), whether a live instruction ([`Kernel::live_insts`])
    /// touches it. An input none touches is not passed to Mosaic: the TPU would fetch its
    /// block at every grid step for nothing.
    pub fn touched_refs(&self) -> Vec<bool> {
        let mut touched = vec![false; self.refs.len()];
        let live = self.live_insts();
        for r in self.insts.iter().zip(live).filter(|(_, l)| *l).flat_map(|(i, _)| i.inst.refs()) {
            touched[r.index()] = true;
        }
        touched
    }

    pub fn find_ref(&self, name: &str) -> Option<RefId> {
        self.refs.iter().position(|r| r.name == name).map(|i| RefId(i as u32))
    }

    /// The kernel without output `name`, which no instruction touches: a kernel whose
    /// static flag turned off every store to an output (flash attention's lse when no
    /// gradient needs it) drops it, so that no backend allocates, pipelines or returns it.
    /// `None` if there is no such output or an instruction still touches it.
    pub fn without_output(mut self, name: &str) -> Option<Kernel> {
        let out = self.find_ref(name).filter(|&r| self.ref_decl(r).kind == RefKind::Output)?;
        if self.insts.iter().any(|i| i.inst.refs().contains(&out)) {
            return None;
        }
        self.refs.remove(out.index());
        // Outputs follow the prefetch arrays and inputs, so no index map (prefetch reads)
        // or dynamic grid extent names a ref past it: only instructions need renumbering.
        for r in self.insts.iter_mut().flat_map(|i| i.inst.refs_mut()) {
            if r.0 > out.0 {
                r.0 -= 1;
            }
        }
        Some(self)
    }

    /// The total number of grid steps (at the upper bound of dynamic dims).
    /// Saturates at `usize::MAX` (the verifier refuses grids of more than `2^31 - 2` steps).
    pub fn grid_steps(&self) -> usize {
        self.grid.iter().fold(1, |n: usize, g| n.saturating_mul(g.extent))
    }

    /// Whether any instruction talks to another device (remote copies, signals to a peer,
    /// the barrier semaphore): Mosaic's `has_communication`.
    pub fn communicates(&self) -> bool {
        let mut any = false;
        self.walk(self.body, &mut |_, d| any |= d.inst.communicates());
        any
    }

    /// If `v` is defined by a `Const` instruction, its scalar.
    pub fn as_const(&self, v: Value) -> Option<Scalar> {
        match self.value(v).def {
            ValueDef::Result(i, 0) => match self.inst(i).inst {
                Inst::Const(s) => Some(s),
                _ => None,
            },
            _ => None,
        }
    }

    /// Visits every instruction of `block` and of the blocks nested in it, in order.
    pub fn walk(&self, block: BlockId, f: &mut impl FnMut(InstId, &InstData)) {
        for &i in &self.block(block).insts {
            let data = self.inst(i);
            f(i, data);
            match &data.inst {
                Inst::If { then_block, else_block, .. } => {
                    self.walk(*then_block, f);
                    self.walk(*else_block, f);
                }
                Inst::For { body, .. } => self.walk(*body, f),
                _ => {}
            }
        }
    }
}
