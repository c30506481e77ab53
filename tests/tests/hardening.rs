//! The bad-input battery of issue 9 (hardening): generated cases that feed Tessera wrong,
//! weird and edge-case inputs on its Rust surfaces, and the issue's examples as named
//! regression tests.
//!
//! Three generated surfaces, each at least 1,000 cases (proptest strategies drawn from a
//! fixed seed, so every run sees the same cases; `TESSERA_HARDENING_SCALE=2` doubles them):
//!
//! - `builder_battery`: random `KernelBuilder` programs (templates of real kernels with
//!   random mutations: ranks, dtypes, static slices, huge / zero / overflowing shapes and
//!   grids, literals out of their dtype's range, broadcasting stores, bad index maps,
//!   reductions on bad axes, dot mismatches...), then `finish()`, `verify` on every target,
//!   `lower` where it verifies, and `interp::run` with right and wrong arguments;
//! - `op_battery`: every op of `tessera_kernels::library()` with valid random inputs at
//!   small odd shapes (`harness::run_case` against the op's reference) and with wrong ones
//!   (ranks, mismatched / zero / huge dims, dtypes, statics, input counts, inconsistent
//!   arrays, metadata values outside the contract);
//! - `cli_battery`: random argument vectors for the `tessera` binary.
//!
//! Every case must match the reference or fail with a clear error (kernel / op, subject,
//! rule, message): never a panic, an abort, a hang, an accepted invalid input or a wrong
//! result. The builder and op cases run in supervised child processes under an
//! address-space limit (`tessera_tests::hardening`), so a crash is a counted failure.
//!
//!     cargo test --release -p tessera-tests --test hardening -- --nocapture
//!
//! prints one summary per surface (`hardening[<surface>]: N generated cases ...`) and
//! writes the full failure lists to `target/tmp/hardening-<surface>.txt`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_dsl::interp::{self, Array, Data, HostMut, HostRef};
use tessera_dsl::{ds, BinaryOp, BlockSpec, CmpOp, DType, Executor, Index, IndexExpr, Interpreter, Kernel, KernelBuilder, KernelError, MemorySpace, ReduceOp, RefId, RefKind, Semantics, Target, Type, UnaryOp, Value};
use tessera_kernels::{harness, library, Op, Statics};
use tessera_tests::hardening::{self as h, Summary, Verdict};

const TMP: &str = env!("CARGO_TARGET_TMPDIR");

/// Cases per surface, scaled by `TESSERA_HARDENING_SCALE`.
fn scaled(n: usize) -> usize {
    let s: f64 = std::env::var("TESSERA_HARDENING_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
    ((n as f64) * s).round().max(1.0) as usize
}

/// `n` values of `strategy` from the fixed seed `seed` (the same every run).
fn generate<S: Strategy>(strategy: S, n: usize, seed: u8) -> Vec<S::Value> {
    let mut runner = TestRunner::new_with_rng(Config { failure_persistence: None, ..Config::default() }, TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]));
    (0..n).map(|_| strategy.new_tree(&mut runner).expect("a case").current()).collect()
}

/// More than any TPU's HBM (192 GiB on tpu7x): an operand this large can never run.
const BEYOND_HBM: u128 = 1 << 38;

fn bytes_of(dtype: DType, shape: &[usize]) -> u128 {
    shape.iter().fold(dtype.bytes() as u128, |a, &d| a.saturating_mul(d as u128))
}

fn elems(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// `Ok` if `e` is a clear error, else the failure verdict.
fn judge_error(e: &KernelError) -> Result<String, Verdict> {
    judge(e, false)
}

/// [`judge_error`]; `edited`: the IR was edited after `finish()`, so `malformed-ir` is the
/// right answer.
fn judge(e: &KernelError, edited: bool) -> Result<String, Verdict> {
    if let Err(why) = h::clear_error(e) {
        return Err(Verdict::fail("unclear-error", why));
    }
    if edited && e.rule == "malformed-ir" {
        return Ok(e.rule.to_string());
    }
    if h::is_internal(e) {
        return Err(Verdict::fail("internal-error", format!("a user input reached an internal rule: {e}")));
    }
    Ok(e.rule.to_string())
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").chars().take(300).collect()
}

// =====================================================================================
// 1. The builder, the verifier, lowering and the interpreter
// =====================================================================================

#[derive(Clone, Debug)]
enum Lit {
    I(i64),
    F(f64),
    B(bool),
}

#[derive(Clone, Debug)]
enum Opnd {
    /// A value made earlier (index modulo the number of values).
    V(usize),
    L(Lit),
}

#[derive(Clone, Debug)]
enum Ix {
    Full,
    At(Opnd, usize),
}

#[derive(Clone, Debug)]
enum IdxE {
    G(usize),
    C(i64),
    GPlus(usize, i64),
    DivZero(usize),
    /// `prefetch ref r [element]`.
    Pre(usize, i64),
}

#[derive(Clone, Debug)]
struct RefSpec {
    kind: RefKind,
    dtype: DType,
    shape: Vec<usize>,
    mem: MemorySpace,
    block: Option<(Vec<Option<usize>>, Vec<IdxE>)>,
    name: String,
}

#[derive(Clone, Debug)]
enum BOp {
    Load(usize, Vec<Ix>),
    Store(usize, Vec<Ix>, Opnd),
    Full(Vec<usize>, DType, Lit),
    Bin(BinaryOp, Opnd, Opnd),
    Un(UnaryOp, Opnd),
    Cmp(CmpOp, Opnd, Opnd),
    Select(usize, Opnd, Opnd),
    Cast(usize, DType),
    Bcast(usize, Vec<usize>),
    Reduce(ReduceOp, usize, usize),
    Dot(usize, usize, bool, bool),
    Transpose(usize),
    Reshape(usize, Vec<usize>),
    Iota(DType, Vec<usize>, usize),
    Pid(usize),
    Nprog(usize),
    /// `for i in lo..hi step`, carrying value `carry`, running the nested ops.
    For(Opnd, Opnd, i64, usize, Vec<BOp>),
    When(Opnd, Vec<BOp>),
    /// `dma_start` (and `dma_wait` if the flag) of `src[ix] -> dst[ix]` on `sem[i]`.
    Dma(usize, Vec<Ix>, usize, Vec<Ix>, usize, Opnd, bool),
}

/// How the built kernel is run.
#[derive(Clone, Debug)]
enum RunMode {
    Correct,
    TooFew,
    TooMany,
    WrongDtype(usize),
    WrongShape(usize),
    /// An `Array` whose data is shorter than its shape says.
    ShortData(usize),
    /// An `Array` whose `dtype` field disagrees with its data.
    DtypeField(usize),
    /// `run_into` with output buffer `i` of the wrong length.
    OutputLen(usize),
}

/// Edits of the finished IR (its fields are public): the verifier and the interpreter must
/// reject what the builder would not have produced, never panic on it.
#[derive(Clone, Debug)]
enum IrEdit {
    RefShape(usize, Vec<usize>),
    RefDtype(usize, DType),
    Grid(Vec<usize>),
    DropRef(usize),
    BlockOf(usize, Vec<Option<usize>>),
}

#[derive(Clone, Debug)]
struct Prog {
    template: &'static str,
    grid: Vec<(usize, bool)>,
    refs: Vec<RefSpec>,
    body: Vec<BOp>,
    vmem_limit: Option<usize>,
    mutations: Vec<String>,
    ir_edits: Vec<IrEdit>,
    run: RunMode,
}

fn rs(name: &str, kind: RefKind, dtype: DType, shape: &[usize], mem: MemorySpace, block: Option<(Vec<Option<usize>>, Vec<IdxE>)>) -> RefSpec {
    RefSpec { kind, dtype, shape: shape.to_vec(), mem, block, name: name.to_string() }
}

fn blk(shape: &[usize], map: Vec<IdxE>) -> Option<(Vec<Option<usize>>, Vec<IdxE>)> {
    Some((shape.iter().map(|&d| Some(d)).collect(), map))
}

/// Real-looking kernels the mutations start from.
fn template(kind: u8, dtype: DType, a: usize, b: usize, c: usize) -> Prog {
    use BOp::*;
    use Opnd::V;
    let (rows, cols) = (8 * a, 128 * b);
    let (bm, grid_m) = (8, a);
    let vm = MemorySpace::Vmem;
    let p = |template, grid: Vec<(usize, bool)>, refs, body| Prog { template, grid, refs, body, vmem_limit: None, mutations: vec![], ir_edits: vec![], run: RunMode::Correct };
    match kind % 6 {
        // out = exp(x) + 1 (or x * 2 for ints), row blocks.
        0 => p(
            "elementwise",
            vec![(grid_m, true)],
            vec![rs("x", RefKind::Input, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])), rs("out", RefKind::Output, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)]))],
            if dtype.is_float() { vec![Load(0, vec![]), Un(UnaryOp::Exp, V(0)), Bin(BinaryOp::Add, V(1), Opnd::L(Lit::F(1.0))), Store(1, vec![], V(2))] } else { vec![Load(0, vec![]), Bin(BinaryOp::Mul, V(0), Opnd::L(Lit::I(2))), Store(1, vec![], V(1))] },
        ),
        // Row sums over column tiles into an f32 scratch accumulator.
        1 => p(
            "row-sum",
            vec![(grid_m, true), (b, false)],
            vec![
                rs("x", RefKind::Input, dtype, &[rows, cols], vm, blk(&[bm, 128], vec![IdxE::G(0), IdxE::G(1)])),
                rs("out", RefKind::Output, DType::F32, &[rows, 128], vm, blk(&[bm, 128], vec![IdxE::G(0), IdxE::C(0)])),
                rs("acc", RefKind::Scratch, DType::F32, &[bm, 128], vm, None),
            ],
            vec![
                Pid(1),
                Cmp(CmpOp::Eq, V(0), Opnd::L(Lit::I(0))),
                When(V(1), vec![Store(2, vec![], Opnd::L(Lit::F(0.0)))]),
                Load(0, vec![]),
                Cast(2, DType::F32),
                Reduce(ReduceOp::Sum, 3, 1),
                Load(2, vec![]),
                Bin(BinaryOp::Add, V(5), V(4)),
                Store(2, vec![], V(6)),
                Store(1, vec![], V(6)),
            ],
        ),
        // A matmul tile with f32 accumulation.
        2 => p(
            "matmul",
            vec![(grid_m, true), (c, true)],
            vec![
                rs("x", RefKind::Input, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])),
                rs("y", RefKind::Input, dtype, &[cols, 128 * c], vm, blk(&[cols, 128], vec![IdxE::C(0), IdxE::G(1)])),
                rs("out", RefKind::Output, DType::F32, &[rows, 128 * c], vm, blk(&[bm, 128], vec![IdxE::G(0), IdxE::G(1)])),
            ],
            vec![Load(0, vec![]), Load(1, vec![]), Dot(0, 1, false, false), Store(2, vec![], V(2))],
        ),
        // Scalar-prefetch gather: out block i = x block idx[i].
        3 => p(
            "prefetch-gather",
            vec![(c, true)],
            vec![
                rs("idx", RefKind::Prefetch, DType::I32, &[c], MemorySpace::Smem, None),
                rs("x", RefKind::Input, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::Pre(0, -1), IdxE::C(0)])),
                rs("out", RefKind::Output, dtype, &[bm * c, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])),
            ],
            vec![Load(1, vec![]), Store(2, vec![], V(0))],
        ),
        // Manual DMA of a row block from HBM into VMEM scratch.
        4 => p(
            "dma",
            vec![(grid_m, false)],
            vec![
                rs("x", RefKind::Input, dtype, &[rows, cols], MemorySpace::Any, None),
                rs("out", RefKind::Output, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])),
                rs("buf", RefKind::Scratch, dtype, &[bm, cols], vm, None),
                rs("sem", RefKind::Scratch, DType::I32, &[2], MemorySpace::Semaphore, None),
            ],
            vec![Pid(0), Bin(BinaryOp::Mul, V(0), Opnd::L(Lit::I(bm as i64))), Dma(0, vec![Ix::At(V(1), bm)], 2, vec![], 3, Opnd::L(Lit::I(0)), true), Load(2, vec![]), Store(1, vec![], V(2))],
        ),
        // A loop and an SMEM table read.
        _ => p(
            "loop-smem",
            vec![(grid_m, true)],
            vec![
                rs("table", RefKind::Input, DType::I32, &[grid_m.max(1)], MemorySpace::Smem, None),
                rs("x", RefKind::Input, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])),
                rs("out", RefKind::Output, dtype, &[rows, cols], vm, blk(&[bm, cols], vec![IdxE::G(0), IdxE::C(0)])),
            ],
            vec![
                Pid(0),
                Load(0, vec![Ix::At(V(0), 1)]),
                Load(1, vec![]),
                For(Opnd::L(Lit::I(0)), Opnd::L(Lit::I(3)), 1, 2, vec![Bin(BinaryOp::Add, V(usize::MAX), V(usize::MAX))]),
                Store(2, vec![], V(3)),
            ],
        ),
    }
}

/// A literal that is out of range for `dtype` (when the literal takes that dtype).
fn lit_out_of_range(lit: &Lit, dtype: DType) -> Option<String> {
    match (lit, dtype) {
        (Lit::I(i), DType::I8) if *i < i8::MIN as i64 || *i > i8::MAX as i64 => Some(format!("int literal {i} as i8")),
        (Lit::I(i), DType::I32) if *i < i32::MIN as i64 || *i > i32::MAX as i64 => Some(format!("int literal {i} as i32")),
        (Lit::F(x), DType::F32) if x.is_finite() && x.abs() > f32::MAX as f64 => Some(format!("float literal {x:e} as f32 (overflows to inf)")),
        (Lit::F(x), DType::BF16) if x.is_finite() && x.abs() > half::bf16::MAX.to_f64() => Some(format!("float literal {x:e} as bf16 (overflows to inf)")),
        _ => None,
    }
}

fn arg_of(l: &Lit) -> tessera_dsl::Arg {
    match l {
        Lit::I(i) => tessera_dsl::Arg::Int(*i),
        Lit::F(x) => tessera_dsl::Arg::Float(*x),
        Lit::B(b) => tessera_dsl::Arg::Bool(*b),
    }
}

/// What the battery knows the builder must reject while it builds a program.
#[derive(Default)]
struct Expect {
    build: Vec<String>,
}

struct Builder<'a> {
    b: KernelBuilder,
    refs: Vec<RefId>,
    specs: &'a [RefSpec],
    vals: Vec<Value>,
    exp: Expect,
    depth: usize,
}

impl Builder<'_> {
    fn val(&self, i: usize) -> Option<Value> {
        if self.vals.is_empty() {
            None
        } else if i == usize::MAX {
            self.vals.last().copied()
        } else {
            Some(self.vals[i % self.vals.len()])
        }
    }

    fn dtype_of(&self, o: &Opnd) -> Option<DType> {
        match o {
            Opnd::V(i) => self.val(*i).map(|v| self.b.ty(v).dtype),
            Opnd::L(_) => None,
        }
    }

    /// The operand as a builder argument, noting a weak literal that takes the dtype
    /// `like` out of range.
    fn arg(&mut self, o: &Opnd, like: Option<DType>) -> tessera_dsl::Arg {
        match o {
            Opnd::V(i) => match self.val(*i) {
                Some(v) => tessera_dsl::Arg::Val(v),
                None => tessera_dsl::Arg::Float(0.0),
            },
            Opnd::L(l) => {
                let d = match (l, like) {
                    (Lit::F(_), Some(d)) if d.is_float() => d,
                    (Lit::F(_), _) => DType::F32,
                    (Lit::I(_), Some(d)) => d,
                    (Lit::I(_), None) => DType::I32,
                    (Lit::B(_), _) => DType::Bool,
                };
                if let Some(why) = lit_out_of_range(l, d) {
                    self.exp.build.push(format!("weak literal out of range: {why}"));
                }
                arg_of(l)
            }
        }
    }

    fn index(&mut self, ix: &[Ix]) -> Vec<Index> {
        ix.iter()
            .map(|i| match i {
                Ix::Full => Index::Full,
                Ix::At(o, len) => {
                    let a = self.arg(o, Some(DType::I32));
                    ds(a, *len)
                }
            })
            .collect()
    }

    fn r(&self, i: usize) -> Option<(RefId, &RefSpec)> {
        if self.refs.is_empty() {
            None
        } else {
            let k = i % self.refs.len();
            Some((self.refs[k], &self.specs[k]))
        }
    }

    fn push(&mut self, v: Value) {
        self.vals.push(v);
    }

    fn ops(&mut self, ops: &[BOp]) {
        for op in ops {
            self.op(op);
        }
    }

    fn op(&mut self, op: &BOp) {
        use BOp::*;
        match op {
            Load(r, ix) => {
                if let Some((id, _)) = self.r(*r) {
                    let ix = self.index(ix);
                    let v = self.b.load(id, &ix);
                    self.push(v);
                }
            }
            Store(r, ix, v) => {
                let Some((id, spec)) = self.r(*r) else { return };
                let spec = spec.clone();
                let view: Vec<usize> = match &spec.block {
                    Some((bs, _)) => bs.iter().flatten().copied().collect(),
                    None => spec.shape.clone(),
                };
                if let Opnd::V(i) = v {
                    if let Some(val) = self.val(*i) {
                        let t = self.b.ty(val).clone();
                        let slice: Option<Vec<usize>> = if ix.is_empty() {
                            Some(view.clone())
                        } else if ix.len() == view.len() {
                            Some(ix.iter().zip(&view).map(|(i, &e)| if let Ix::At(_, l) = i { *l } else { e }).collect())
                        } else {
                            None
                        };
                        if let Some(slice) = slice {
                            if !t.is_scalar() && t.shape != slice && spec.mem != MemorySpace::Smem {
                                self.exp.build.push(format!("store of a {t} value into a {slice:?} slice of `{}` (implicit broadcast)", spec.name));
                            }
                        }
                    }
                }
                let ix = self.index(ix);
                let a = self.arg(v, Some(spec.dtype));
                self.b.store(id, &ix, a);
            }
            Full(shape, dtype, lit) => {
                if let Some(why) = lit_out_of_range(lit, *dtype) {
                    self.exp.build.push(format!("full(): {why}"));
                }
                let v = self.b.full(shape, *dtype, arg_of(lit));
                self.push(v);
            }
            Bin(o, a, b) => {
                let (da, db) = (self.dtype_of(a), self.dtype_of(b));
                let (a, b) = (self.arg(a, db), self.arg(b, da));
                let v = self.b.binary(*o, a, b);
                self.push(v);
            }
            Un(o, a) => {
                let a = self.arg(a, None);
                let v = self.b.unary(*o, a);
                self.push(v);
            }
            Cmp(o, a, b) => {
                let (da, db) = (self.dtype_of(a), self.dtype_of(b));
                let (a, b) = (self.arg(a, db), self.arg(b, da));
                let v = self.b.cmp(*o, a, b);
                self.push(v);
            }
            Select(c, a, b) => {
                let Some(c) = self.val(*c) else { return };
                let (da, db) = (self.dtype_of(a), self.dtype_of(b));
                let (a, b) = (self.arg(a, db), self.arg(b, da));
                let v = self.b.select(c, a, b);
                self.push(v);
            }
            Cast(v, d) => {
                if let Some(x) = self.val(*v) {
                    let v = self.b.cast(x, *d);
                    self.push(v);
                }
            }
            Bcast(v, shape) => {
                if let Some(x) = self.val(*v) {
                    let v = self.b.broadcast(x, shape);
                    self.push(v);
                }
            }
            Reduce(o, v, axis) => {
                if let Some(x) = self.val(*v) {
                    let v = self.b.reduce(*o, x, *axis);
                    self.push(v);
                }
            }
            Dot(a, b, ta, tb) => {
                if let (Some(a), Some(b)) = (self.val(*a), self.val(*b)) {
                    let v = self.b.dot(a, b, *ta, *tb);
                    self.push(v);
                }
            }
            Transpose(v) => {
                if let Some(x) = self.val(*v) {
                    let v = self.b.transpose(x);
                    self.push(v);
                }
            }
            Reshape(v, shape) => {
                if let Some(x) = self.val(*v) {
                    let v = self.b.reshape(x, shape);
                    self.push(v);
                }
            }
            Iota(d, shape, dim) => {
                let v = self.b.iota(*d, shape, *dim);
                self.push(v);
            }
            Pid(a) => {
                let v = self.b.program_id(*a);
                self.push(v);
            }
            Nprog(a) => {
                let v = self.b.num_programs(*a);
                self.push(v);
            }
            For(lo, hi, step, carry, body) => {
                if self.depth > 2 {
                    return;
                }
                let Some(init) = self.val(*carry) else { return };
                let (lo, hi) = (self.arg(lo, Some(DType::I32)), self.arg(hi, Some(DType::I32)));
                let specs = self.specs;
                let refs = self.refs.clone();
                let outer = self.vals.clone();
                let mut exp = std::mem::take(&mut self.exp);
                let depth = self.depth;
                let res = self.b.for_range(lo, hi, *step, &[init], |kb, i, carries| {
                    let mut inner = Builder { b: std::mem::replace(kb, KernelBuilder::new("scratch")), refs, specs, vals: outer, exp: std::mem::take(&mut exp), depth: depth + 1 };
                    inner.vals.push(i);
                    inner.vals.extend_from_slice(carries);
                    inner.ops(body);
                    let last = *inner.vals.last().expect("the carry is a value");
                    *kb = inner.b;
                    exp = inner.exp;
                    vec![last]
                });
                self.exp = exp;
                self.vals.extend(res);
            }
            When(c, body) => {
                if self.depth > 2 {
                    return;
                }
                let c = self.arg(c, Some(DType::Bool));
                let specs = self.specs;
                let refs = self.refs.clone();
                let outer = self.vals.clone();
                let mut exp = std::mem::take(&mut self.exp);
                let depth = self.depth;
                self.b.when(c, |kb| {
                    let mut inner = Builder { b: std::mem::replace(kb, KernelBuilder::new("scratch")), refs, specs, vals: outer, exp: std::mem::take(&mut exp), depth: depth + 1 };
                    inner.ops(body);
                    *kb = inner.b;
                    exp = inner.exp;
                });
                self.exp = exp;
            }
            Dma(src, si, dst, di, sem, semi, wait) => {
                let (Some((s, _)), Some((d, _)), Some((m, _))) = (self.r(*src), self.r(*dst), self.r(*sem)) else { return };
                let (si, di) = (self.index(si), self.index(di));
                let a = self.arg(semi, Some(DType::I32));
                self.b.dma_start(s, &si, d, &di, m, a);
                if *wait {
                    self.b.dma_wait(s, &si, d, &di, m, a);
                }
            }
        }
    }
}

fn index_expr(e: &IdxE, refs: &[RefId]) -> IndexExpr {
    match e {
        IdxE::G(g) => IndexExpr::Grid(*g),
        IdxE::C(c) => IndexExpr::Const(*c),
        IdxE::GPlus(g, c) => IndexExpr::Grid(*g) + IndexExpr::Const(*c),
        IdxE::DivZero(g) => IndexExpr::Grid(*g) / IndexExpr::Const(0),
        IdxE::Pre(r, at) => {
            let array = refs.get(*r).copied().unwrap_or(RefId(*r as u32));
            let index = if *at < 0 { vec![IndexExpr::Grid(0)] } else { vec![IndexExpr::Const(*at)] };
            IndexExpr::Prefetch { array, index }
        }
    }
}

/// Builds the program; the expectations it found on the way.
fn build_prog(p: &Prog) -> (Result<Kernel, KernelError>, Expect) {
    let mut b = KernelBuilder::new(&format!("battery_{}", p.template.replace('-', "_")));
    b.grid(&p.grid.iter().map(|&(e, par)| (e, if par { Semantics::Parallel } else { Semantics::Arbitrary })).collect::<Vec<_>>());
    if let Some(v) = p.vmem_limit {
        b.vmem_limit_bytes(v);
    }
    let mut refs = Vec::new();
    for r in &p.refs {
        let id = match (r.kind, &r.block, r.mem) {
            (RefKind::Prefetch, _, _) => b.prefetch(&r.name, &r.shape),
            (RefKind::Scratch, _, MemorySpace::Semaphore) => b.semaphores(&r.name, r.shape.first().copied().unwrap_or(0)),
            (RefKind::Scratch, _, m) => b.scratch(&r.name, r.dtype, &r.shape, m),
            (RefKind::Input, Some((bs, map)), _) => {
                let spec = BlockSpec { block_shape: bs.clone(), index_map: map.iter().map(|e| index_expr(e, &refs)).collect() };
                b.input(&r.name, r.dtype, &r.shape, spec)
            }
            (RefKind::Output, Some((bs, map)), _) => {
                let spec = BlockSpec { block_shape: bs.clone(), index_map: map.iter().map(|e| index_expr(e, &refs)).collect() };
                b.output(&r.name, r.dtype, &r.shape, spec)
            }
            (k, None, m) => b.unblocked(k, &r.name, r.dtype, &r.shape, m),
        };
        refs.push(id);
    }
    let mut bb = Builder { b, refs, specs: &p.refs, vals: vec![], exp: Expect::default(), depth: 0 };
    bb.ops(&p.body);
    let exp = bb.exp;
    (bb.b.finish(), exp)
}

fn apply_ir_edits(k: &mut Kernel, edits: &[IrEdit]) {
    for e in edits {
        match e {
            IrEdit::RefShape(r, s) if !k.refs.is_empty() => {
                let n = k.refs.len();
                k.refs[r % n].shape = s.clone();
            }
            IrEdit::RefDtype(r, d) if !k.refs.is_empty() => {
                let n = k.refs.len();
                k.refs[r % n].dtype = *d;
            }
            IrEdit::Grid(g) => {
                for (d, &e) in g.iter().enumerate() {
                    if let Some(dim) = k.grid.get_mut(d) {
                        dim.extent = e;
                    }
                }
            }
            IrEdit::DropRef(r) if !k.refs.is_empty() => {
                let n = k.refs.len();
                k.refs.remove(r % n);
            }
            IrEdit::BlockOf(r, bs) if !k.refs.is_empty() => {
                let n = k.refs.len();
                if let Some(b) = k.refs[r % n].block.as_mut() {
                    b.block_shape = bs.clone();
                }
            }
            _ => {}
        }
    }
}

/// Arguments for `k`'s prefetch and input operands (None if one would be too large).
fn args_for(k: &Kernel, rng: &mut StdRng) -> Option<Vec<Array>> {
    let mut out = Vec::new();
    for r in k.refs.iter().filter(|r| matches!(r.kind, RefKind::Prefetch | RefKind::Input)) {
        let n = elems(&r.shape)?;
        if n > 1 << 20 {
            return None;
        }
        out.push(match r.dtype {
            DType::I32 if r.kind == RefKind::Prefetch => Array::from_i32(&r.shape, (0..n).map(|_| rng.gen_range(0..2)).collect()),
            d => harness::random_array(d, &r.shape, rng),
        });
    }
    Some(out)
}

fn other_dtype(d: DType) -> DType {
    match d {
        DType::F32 => DType::BF16,
        DType::BF16 => DType::I32,
        DType::I32 => DType::F32,
        DType::I8 => DType::Bool,
        DType::Bool => DType::I8,
        DType::F8E4M3FN => DType::F8E5M2,
        DType::F8E5M2 => DType::F32,
    }
}

/// Target-independent verifier rules (the interpreter runs no target's rules, but what
/// every target rejects for a reason that is not about one target's limits must not run).
fn target_independent(rule: &str) -> bool {
    !matches!(rule, "vmem-budget" | "vmem-limit" | "smem-budget" | "matmul-dtype" | "block-tiling" | "hbm-budget" | "operand-too-large")
}

fn run_builder_case(p: &Prog, seed: u64) -> Verdict {
    let (built, exp) = build_prog(p);
    let mut kernel = match built {
        Err(e) => {
            return match judge_error(&e) {
                Ok(rule) => Verdict::pass("build-error", rule),
                Err(v) => v,
            }
        }
        Ok(k) => k,
    };
    if let Some(why) = exp.build.first() {
        return Verdict::fail("builder-accepted", format!("finish() accepted {why}"));
    }
    apply_ir_edits(&mut kernel, &p.ir_edits);
    let edited = !p.ir_edits.is_empty();
    // The verifier on every target, and lowering where it verifies.
    let mut rules = Vec::new();
    for t in Target::ALL {
        match h::catch(|| tessera_dsl::verify::verify(&kernel, &t)) {
            Err(panic) => return Verdict::fail("panic", format!("verify on {t}: {panic}")),
            Ok(Err(e)) => {
                if let Err(v) = judge(&e, edited) {
                    return v;
                }
                rules.push(Some(e.rule));
            }
            Ok(Ok(())) => {
                rules.push(None);
                match h::catch(|| tessera_codegen::lower(&kernel, &t)) {
                    Err(panic) => return Verdict::fail("panic", format!("lower on {t}: {panic}")),
                    Ok(Err(e)) if e.to_string().trim().is_empty() => return Verdict::fail("unclear-error", format!("lower on {t}: empty error")),
                    _ => {}
                }
            }
        }
    }
    // What the verifier must reject on every target.
    let mut must_reject = Vec::new();
    for (d, g) in kernel.grid.iter().enumerate() {
        if g.extent >= 1 << 31 {
            must_reject.push(format!("grid dim {d} has {} steps, beyond program_id's i32 range", g.extent));
        }
    }
    if kernel.grid.iter().try_fold(1usize, |a, g| a.checked_mul(g.extent)).is_none() {
        must_reject.push("the grid's step count overflows usize".to_string());
    }
    for r in &kernel.refs {
        if elems(&r.shape).is_none() {
            must_reject.push(format!("{} `{}` {:?}: element count overflows usize", r.kind.name(), r.name, r.shape));
        } else if bytes_of(r.dtype, &r.shape) > BEYOND_HBM && r.memory != MemorySpace::Semaphore {
            must_reject.push(format!("{} `{}` {:?} {} is {} GiB, more than any TPU's HBM", r.kind.name(), r.name, r.shape, r.dtype, bytes_of(r.dtype, &r.shape) >> 30));
        }
    }
    if let (Some(why), true) = (must_reject.first(), rules.iter().any(Option::is_none)) {
        let ok: Vec<&str> = Target::ALL.iter().zip(&rules).filter(|(_, r)| r.is_none()).map(|(t, _)| t.name).collect();
        return Verdict::fail("verifier-accepted", format!("verify accepted on {} a kernel with {why}", ok.join(", ")));
    }
    let everywhere: Option<&str> = match rules.first() {
        Some(Some(r)) if rules.iter().all(|x| x == &Some(*r)) && target_independent(r) => Some(r),
        _ => None,
    };
    // The interpreter, when the run is small enough to finish.
    let steps = kernel.grid.iter().try_fold(1usize, |a, g| a.checked_mul(g.extent));
    if steps.is_none_or(|s| s > 4096) || kernel.refs.iter().any(|r| elems(&r.shape).is_none_or(|n| n > 1 << 20)) {
        return Verdict::pass(if rules.iter().all(Option::is_some) { "verify-error" } else { "verified" }, "not run (large)");
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let Some(mut args) = args_for(&kernel, &mut rng) else { return Verdict::pass("verified", "not run (large)") };
    let mut wrong_args = true;
    match &p.run {
        RunMode::Correct => wrong_args = false,
        RunMode::TooFew => {
            args.pop();
            if args.is_empty() {
                wrong_args = kernel.refs.iter().any(|r| matches!(r.kind, RefKind::Prefetch | RefKind::Input));
            }
        }
        RunMode::TooMany => args.push(Array::from_f32(&[8, 128], vec![0.0; 1024])),
        RunMode::WrongDtype(i) if !args.is_empty() => {
            let n = args.len();
            let a = &args[i % n];
            let d = other_dtype(a.dtype);
            args[i % n] = harness::random_array(d, &a.shape.clone(), &mut rng);
        }
        RunMode::WrongShape(i) if !args.is_empty() => {
            let n = args.len();
            let a = &args[i % n];
            let mut s = a.shape.clone();
            match s.first_mut() {
                Some(x) => *x += 1,
                None => s.push(2),
            }
            args[i % n] = harness::random_array(a.dtype, &s, &mut rng);
        }
        RunMode::ShortData(i) if !args.is_empty() => {
            let n = args.len();
            let a = &mut args[i % n];
            a.data = match std::mem::replace(&mut a.data, Data::Bool(vec![])) {
                Data::F32(mut v) => {
                    v.pop();
                    Data::F32(v)
                }
                Data::BF16(mut v) => {
                    v.pop();
                    Data::BF16(v)
                }
                Data::I32(mut v) => {
                    v.pop();
                    Data::I32(v)
                }
                Data::I8(mut v) => {
                    v.pop();
                    Data::I8(v)
                }
                Data::Bool(mut v) => {
                    v.pop();
                    Data::Bool(v)
                }
                Data::F8E4M3FN(mut v) => {
                    v.pop();
                    Data::F8E4M3FN(v)
                }
                Data::F8E5M2(mut v) => {
                    v.pop();
                    Data::F8E5M2(v)
                }
            };
        }
        RunMode::DtypeField(i) if !args.is_empty() => {
            let n = args.len();
            let a = &mut args[i % n];
            a.dtype = other_dtype(a.dtype);
        }
        RunMode::OutputLen(i) => {
            let outs: Vec<&tessera_dsl::RefDecl> = kernel.refs.iter().filter(|r| r.kind == RefKind::Output).collect();
            if outs.is_empty() {
                wrong_args = false;
            } else {
                let j = i % outs.len();
                let mut bufs: Vec<Array> = outs
                    .iter()
                    .enumerate()
                    .map(|(n, d)| {
                        let mut s = d.shape.clone();
                        if n == j {
                            match s.first_mut() {
                                Some(x) => *x += 1,
                                None => s.push(2),
                            }
                        }
                        Array::zeros(d.dtype, &s)
                    })
                    .collect();
                let ins: Vec<HostRef<'_>> = args.iter().map(Array::as_host).collect();
                let mut views: Vec<HostMut<'_>> = bufs.iter_mut().map(Array::as_host_mut).collect();
                return match h::catch(|| Interpreter.run_into(&kernel, &ins, &mut views)) {
                    Err(panic) => Verdict::fail("panic", format!("run_into with a wrong output buffer: {panic}")),
                    Ok(Ok(_)) => Verdict::fail("accepted-invalid", "run_into accepted an output buffer of the wrong shape"),
                    Ok(Err(e)) => judge(&e, edited).map_or_else(|v| v, |r| Verdict::pass("run-error", r)),
                };
            }
        }
        _ => wrong_args = false,
    }
    let refs: Vec<&Array> = args.iter().collect();
    match h::catch(|| interp::run(&kernel, &refs)) {
        Err(panic) => Verdict::fail("panic", format!("interp::run: {panic}")),
        Ok(Err(e)) => judge(&e, edited).map_or_else(|v| v, |r| Verdict::pass("run-error", r)),
        Ok(Ok(_)) if wrong_args => Verdict::fail("accepted-invalid", format!("interp::run accepted wrong arguments ({:?})", p.run)),
        Ok(Ok(_)) => match everywhere {
            Some(rule) => Verdict::fail("interp-runs-unverifiable", format!("interp::run ran a kernel every target's verifier rejects ({rule})")),
            None => Verdict::pass("ran", if rules.iter().all(Option::is_some) { "verifier rejected on every target (target limits)" } else { "" }),
        },
    }
}

// ---- strategies ------------------------------------------------------------------------------

fn dtype_s() -> impl Strategy<Value = DType> {
    prop_oneof![4 => Just(DType::F32), 2 => Just(DType::BF16), 2 => Just(DType::I32), 1 => Just(DType::I8), 1 => Just(DType::Bool)]
}

fn huge_s() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), Just(3), Just(7), Just(1 << 31), Just((1 << 31) - 1), Just((1 << 32) + 5), Just(1 << 40), Just(usize::MAX), Just(usize::MAX / 2 + 1), Just(99_999_999_999), 1usize..2000]
}

fn lit_s() -> impl Strategy<Value = Lit> {
    prop_oneof![
        Just(Lit::I(300)),
        Just(Lit::I(-129)),
        Just(Lit::I(128)),
        Just(Lit::I(3_000_000_000)),
        Just(Lit::I(i64::MAX)),
        Just(Lit::I(i64::MIN)),
        Just(Lit::I(-1)),
        Just(Lit::I(0)),
        Just(Lit::I(7)),
        Just(Lit::F(1e39)),
        Just(Lit::F(-1e39)),
        Just(Lit::F(3.5e38)),
        Just(Lit::F(f64::INFINITY)),
        Just(Lit::F(f64::NAN)),
        Just(Lit::F(-0.0)),
        Just(Lit::F(1e-46)),
        Just(Lit::F(0.5)),
        Just(Lit::F(1e300)),
        Just(Lit::B(true)),
        (-1000i64..1000).prop_map(Lit::I),
        (-1e6f64..1e6).prop_map(Lit::F),
    ]
}

fn opnd_s() -> impl Strategy<Value = Opnd> {
    prop_oneof![3 => (0usize..12).prop_map(Opnd::V), 2 => lit_s().prop_map(Opnd::L)]
}

fn small_shape_s() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        Just(vec![8, 128]),
        Just(vec![8, 1]),
        Just(vec![1, 128]),
        Just(vec![]),
        Just(vec![128]),
        Just(vec![8, 128, 2]),
        Just(vec![0, 128]),
        Just(vec![16, 256]),
        Just(vec![1 << 20, 1 << 20]),
        Just(vec![usize::MAX, 2]),
        prop::collection::vec(1usize..300, 1..4)
    ]
}

fn ix_s() -> impl Strategy<Value = Vec<Ix>> {
    prop_oneof![
        3 => Just(vec![]),
        1 => Just(vec![Ix::Full, Ix::Full]),
        2 => (opnd_s(), 0usize..20, opnd_s(), 0usize..300).prop_map(|(a, la, b, lb)| vec![Ix::At(a, la), Ix::At(b, lb)]),
        1 => (opnd_s(), 0usize..20).prop_map(|(a, la)| vec![Ix::At(a, la), Ix::Full]),
        1 => (opnd_s(), 0usize..20).prop_map(|(a, la)| vec![Ix::At(a, la)]),
        1 => Just(vec![Ix::Full, Ix::Full, Ix::Full])
    ]
}

fn unary_s() -> impl Strategy<Value = UnaryOp> {
    prop_oneof![Just(UnaryOp::Neg), Just(UnaryOp::Abs), Just(UnaryOp::Exp), Just(UnaryOp::Log), Just(UnaryOp::Tanh), Just(UnaryOp::Erf), Just(UnaryOp::Sqrt), Just(UnaryOp::Rsqrt), Just(UnaryOp::Not)]
}

fn binary_s() -> impl Strategy<Value = BinaryOp> {
    prop_oneof![Just(BinaryOp::Add), Just(BinaryOp::Sub), Just(BinaryOp::Mul), Just(BinaryOp::Div), Just(BinaryOp::Rem), Just(BinaryOp::Max), Just(BinaryOp::Min), Just(BinaryOp::Pow), Just(BinaryOp::And), Just(BinaryOp::Or), Just(BinaryOp::Xor)]
}

fn cmp_s() -> impl Strategy<Value = CmpOp> {
    prop_oneof![Just(CmpOp::Eq), Just(CmpOp::Ne), Just(CmpOp::Lt), Just(CmpOp::Le), Just(CmpOp::Gt), Just(CmpOp::Ge)]
}

fn reduce_s() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Max), Just(ReduceOp::Min)]
}

/// A (usually wrong) body op.
fn bop_s() -> impl Strategy<Value = BOp> {
    let leaf = prop_oneof![
        (0usize..6, ix_s()).prop_map(|(r, i)| BOp::Load(r, i)),
        (0usize..6, ix_s(), opnd_s()).prop_map(|(r, i, v)| BOp::Store(r, i, v)),
        (small_shape_s(), dtype_s(), lit_s()).prop_map(|(s, d, l)| BOp::Full(s, d, l)),
        (binary_s(), opnd_s(), opnd_s()).prop_map(|(o, a, b)| BOp::Bin(o, a, b)),
        (unary_s(), opnd_s()).prop_map(|(o, a)| BOp::Un(o, a)),
        (cmp_s(), opnd_s(), opnd_s()).prop_map(|(o, a, b)| BOp::Cmp(o, a, b)),
        (0usize..12, opnd_s(), opnd_s()).prop_map(|(c, a, b)| BOp::Select(c, a, b)),
        (0usize..12, dtype_s()).prop_map(|(v, d)| BOp::Cast(v, d)),
        (0usize..12, small_shape_s()).prop_map(|(v, s)| BOp::Bcast(v, s)),
        (reduce_s(), 0usize..12, 0usize..4).prop_map(|(o, v, a)| BOp::Reduce(o, v, a)),
        (0usize..12, 0usize..12, any::<bool>(), any::<bool>()).prop_map(|(a, b, x, y)| BOp::Dot(a, b, x, y)),
        (0usize..12).prop_map(BOp::Transpose),
        (0usize..12, small_shape_s()).prop_map(|(v, s)| BOp::Reshape(v, s)),
        (dtype_s(), small_shape_s(), 0usize..4).prop_map(|(d, s, a)| BOp::Iota(d, s, a)),
        (0usize..4).prop_map(BOp::Pid),
        (0usize..4).prop_map(BOp::Nprog),
        (0usize..6, ix_s(), 0usize..6, ix_s(), 0usize..6, opnd_s(), any::<bool>()).prop_map(|(a, ai, b, bi, s, si, w)| BOp::Dma(a, ai, b, bi, s, si, w)),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            (opnd_s(), opnd_s(), prop_oneof![Just(1i64), Just(0), Just(-1), Just(2)], 0usize..12, prop::collection::vec(inner.clone(), 0..3)).prop_map(|(lo, hi, st, c, b)| {
                // Keep loops short enough to run: huge literal bounds still reach the builder.
                let clamp = |o: Opnd| match o {
                    Opnd::L(Lit::I(i)) if (0..=64).contains(&i) => Opnd::L(Lit::I(i)),
                    Opnd::L(Lit::I(i)) if i.unsigned_abs() > 1 << 31 => Opnd::L(Lit::I(i)),
                    Opnd::L(Lit::I(_)) => Opnd::L(Lit::I(4)),
                    other => other,
                };
                BOp::For(clamp(lo), clamp(hi), st, c, b)
            }),
            (opnd_s(), prop::collection::vec(inner, 0..3)).prop_map(|(c, b)| BOp::When(c, b)),
        ]
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    GridExtent(usize, usize),
    GridFlip(usize),
    GridEmpty,
    GridAddDim(usize),
    RefShape(usize, usize, usize),
    RefRankDrop(usize),
    RefRankAdd(usize, usize),
    RefDtype(usize, DType),
    RefMem(usize, MemorySpace),
    RefKind(usize, RefKind),
    RefDupName(usize),
    BlockDim(usize, usize, Option<usize>),
    BlockRankDrop(usize),
    IndexMap(usize, usize, IdxE),
    IndexMapDrop(usize),
    Insert(usize, BOp),
    Remove(usize),
    VmemLimit(usize),
    Ir(IrEdit),
}

fn mem_s() -> impl Strategy<Value = MemorySpace> {
    prop_oneof![Just(MemorySpace::Vmem), Just(MemorySpace::Smem), Just(MemorySpace::Any), Just(MemorySpace::Semaphore)]
}

fn mutation_s() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (0usize..3, huge_s()).prop_map(|(d, e)| Mutation::GridExtent(d, e)),
        1 => (0usize..3).prop_map(Mutation::GridFlip),
        1 => Just(Mutation::GridEmpty),
        1 => huge_s().prop_map(Mutation::GridAddDim),
        4 => (0usize..6, 0usize..3, huge_s()).prop_map(|(r, d, v)| Mutation::RefShape(r, d, v)),
        1 => (0usize..6).prop_map(Mutation::RefRankDrop),
        1 => (0usize..6, 1usize..9).prop_map(|(r, v)| Mutation::RefRankAdd(r, v)),
        2 => (0usize..6, dtype_s()).prop_map(|(r, d)| Mutation::RefDtype(r, d)),
        1 => (0usize..6, mem_s()).prop_map(|(r, m)| Mutation::RefMem(r, m)),
        1 => (0usize..6, prop_oneof![Just(RefKind::Prefetch), Just(RefKind::Input), Just(RefKind::Output), Just(RefKind::Scratch)]).prop_map(|(r, k)| Mutation::RefKind(r, k)),
        1 => (0usize..6).prop_map(Mutation::RefDupName),
        3 => (0usize..6, 0usize..3, prop_oneof![Just(None), Just(Some(0usize)), Just(Some(3)), Just(Some(1)), Just(Some(1 << 40)), Just(Some(129)), (1usize..300).prop_map(Some)]).prop_map(|(r, d, v)| Mutation::BlockDim(r, d, v)),
        1 => (0usize..6).prop_map(Mutation::BlockRankDrop),
        3 => (0usize..6, 0usize..3, prop_oneof![(0usize..5).prop_map(IdxE::G), prop_oneof![Just(-1i64), Just(1 << 40), Just(i64::MIN), Just(3), Just(1)].prop_map(IdxE::C), (0usize..3, prop_oneof![Just(-1i64), Just(1), Just(i64::MAX)]).prop_map(|(g, c)| IdxE::GPlus(g, c)), (0usize..3).prop_map(IdxE::DivZero), (0usize..6, prop_oneof![Just(-1i64), Just(0), Just(99)]).prop_map(|(r, a)| IdxE::Pre(r, a))]).prop_map(|(r, d, e)| Mutation::IndexMap(r, d, e)),
        1 => (0usize..6).prop_map(Mutation::IndexMapDrop),
        6 => (0usize..12, bop_s()).prop_map(|(at, op)| Mutation::Insert(at, op)),
        1 => (0usize..12).prop_map(Mutation::Remove),
        1 => prop_oneof![Just(0usize), Just(1 << 40), Just(usize::MAX), Just(64 << 20), Just(100 << 20)].prop_map(Mutation::VmemLimit),
        2 => prop_oneof![
            (0usize..6, small_shape_s()).prop_map(|(r, s)| IrEdit::RefShape(r, s)),
            (0usize..6, dtype_s()).prop_map(|(r, d)| IrEdit::RefDtype(r, d)),
            prop::collection::vec(huge_s(), 1..3).prop_map(IrEdit::Grid),
            (0usize..6).prop_map(IrEdit::DropRef),
            (0usize..6, prop::collection::vec(prop_oneof![Just(None), (0usize..300).prop_map(Some)], 0..4)).prop_map(|(r, b)| IrEdit::BlockOf(r, b)),
        ]
        .prop_map(Mutation::Ir),
    ]
}

fn run_mode_s() -> impl Strategy<Value = RunMode> {
    prop_oneof![
        8 => Just(RunMode::Correct),
        1 => Just(RunMode::TooFew),
        1 => Just(RunMode::TooMany),
        1 => (0usize..4).prop_map(RunMode::WrongDtype),
        1 => (0usize..4).prop_map(RunMode::WrongShape),
        1 => (0usize..4).prop_map(RunMode::ShortData),
        1 => (0usize..4).prop_map(RunMode::DtypeField),
        1 => (0usize..4).prop_map(RunMode::OutputLen),
    ]
}

fn apply(mut p: Prog, muts: &[Mutation]) -> Prog {
    let nr = p.refs.len().max(1);
    for m in muts {
        p.mutations.push(format!("{m:?}"));
        match m {
            Mutation::GridExtent(d, e) => {
                if !p.grid.is_empty() {
                    let n = p.grid.len();
                    p.grid[d % n].0 = *e;
                }
            }
            Mutation::GridFlip(d) => {
                if !p.grid.is_empty() {
                    let n = p.grid.len();
                    p.grid[d % n].1 ^= true;
                }
            }
            Mutation::GridEmpty => p.grid.clear(),
            Mutation::GridAddDim(e) => p.grid.push((*e, false)),
            Mutation::RefShape(r, d, v) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    if !s.shape.is_empty() {
                        let n = s.shape.len();
                        s.shape[d % n] = *v;
                    }
                }
            }
            Mutation::RefRankDrop(r) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    s.shape.pop();
                }
            }
            Mutation::RefRankAdd(r, v) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    s.shape.insert(0, *v);
                }
            }
            Mutation::RefDtype(r, d) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    s.dtype = *d;
                }
            }
            Mutation::RefMem(r, mm) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    s.mem = *mm;
                    if *mm != MemorySpace::Vmem {
                        s.block = None;
                    }
                }
            }
            Mutation::RefKind(r, k) => {
                if let Some(s) = p.refs.get_mut(r % nr) {
                    s.kind = *k;
                }
            }
            Mutation::RefDupName(r) => {
                if p.refs.len() > 1 {
                    let name = p.refs[0].name.clone();
                    let i = 1 + r % (p.refs.len() - 1);
                    p.refs[i].name = name;
                }
            }
            Mutation::BlockDim(r, d, v) => {
                if let Some(Some((bs, _))) = p.refs.get_mut(r % nr).map(|s| s.block.as_mut()) {
                    if !bs.is_empty() {
                        let n = bs.len();
                        bs[d % n] = *v;
                    }
                }
            }
            Mutation::BlockRankDrop(r) => {
                if let Some(Some((bs, _))) = p.refs.get_mut(r % nr).map(|s| s.block.as_mut()) {
                    bs.pop();
                }
            }
            Mutation::IndexMap(r, d, e) => {
                if let Some(Some((_, map))) = p.refs.get_mut(r % nr).map(|s| s.block.as_mut()) {
                    if !map.is_empty() {
                        let n = map.len();
                        map[d % n] = e.clone();
                    }
                }
            }
            Mutation::IndexMapDrop(r) => {
                if let Some(Some((_, map))) = p.refs.get_mut(r % nr).map(|s| s.block.as_mut()) {
                    map.pop();
                }
            }
            Mutation::Insert(at, op) => {
                let n = p.body.len();
                p.body.insert(at % (n + 1), op.clone());
            }
            Mutation::Remove(at) => {
                if !p.body.is_empty() {
                    let n = p.body.len();
                    p.body.remove(at % n);
                }
            }
            Mutation::VmemLimit(v) => p.vmem_limit = Some(*v),
            Mutation::Ir(e) => p.ir_edits.push(e.clone()),
        }
    }
    p
}

fn prog_s() -> impl Strategy<Value = Prog> {
    (0u8..6, dtype_s(), 1usize..5, 1usize..4, 1usize..4, prop::collection::vec(mutation_s(), 0..4), run_mode_s()).prop_map(|(t, d, a, b, c, muts, run)| {
        let mut p = apply(template(t, d, a, b, c), &muts);
        p.run = run;
        p
    })
}

fn builder_cases() -> Vec<Prog> {
    generate(prog_s(), scaled(20000), 1)
}

fn describe_prog(p: &Prog) -> String {
    let refs: Vec<String> = p
        .refs
        .iter()
        .map(|r| {
            let block = r.block.as_ref().map_or(String::new(), |(b, m)| format!(" block {b:?} map {m:?}"));
            format!("{} {} {} {:?} {:?}{block}", r.kind.name(), r.name, r.dtype, r.shape, r.mem)
        })
        .collect();
    format!("template {} grid {:?} refs [{}] body {:?} mutations [{}] run {:?}", p.template, p.grid, refs.join("; "), p.body, p.mutations.join(", "), p.run)
}

#[test]
fn builder_battery() {
    if h::in_child() {
        return;
    }
    let cases = builder_cases();
    let start = Instant::now();
    let verdicts = h::supervise("battery_child_builder", "builder", cases.len(), Duration::from_secs(20));
    Summary::new("builder", &verdicts, |i| describe_prog(&cases[i]), start.elapsed()).finish(TMP);
}

#[test]
fn battery_child_builder() {
    let Some(start) = h::child_start("builder") else { return };
    let cases = builder_cases();
    h::child_loop(start, cases.len(), |i| {
        let p = &cases[i];
        match run_builder_case(p, i as u64) {
            // A panic on IR edited after `finish()` (public fields) is its own class.
            Verdict::Fail(c, d) if c == "panic" && !p.ir_edits.is_empty() => Verdict::Fail("panic-on-edited-ir".into(), d),
            v => v,
        }
    });
}

// =====================================================================================
// 2. Library ops through the op table
// =====================================================================================

/// My reading of each op's contract: per tensor input, its dims (`R..` = any number of
/// leading dims, equal across the inputs that have them; `t*k` a product; `s+1`; `1?` an
/// optional trailing 1). The battery judges a mutated call against it: shapes that break
/// it must be rejected, shapes that keep it are valid calls.
fn contract(op: &str, transpose_rhs: bool) -> &'static [&'static str] {
    match op {
        "matmul" => &["m k", "k n"],
        "matmul_bwd" => &["m k", "k n", "m n"],
        "gelu_affine" | "layernorm" => &["R.. n", "n", "n"],
        "softmax" => &["R.. n"],
        "softmax_bwd" => &["R.. n", "R.. n"],
        "gelu_affine_bwd" => &["R.. n", "n", "n", "R.. n"],
        "layernorm_bwd" => &["R.. n", "n", "R.. n"],
        "rmsnorm" => &["R.. n", "n"],
        "rmsnorm_residual" => &["R.. n", "R.. n", "n"],
        "rmsnorm_residual_bwd" => &["R.. n", "n", "R.. n", "R.. n"],
        "rmsnorm_bwd" => &["R.. n", "n", "R.. n"],
        "swiglu" | "geglu" => &["R.. n", "R.. n"],
        "swiglu_bwd" | "geglu_bwd" => &["R.. n", "R.. n", "R.. n"],
        "rope" | "rope_bwd" => &["t h dh", "t"],
        "cross_entropy" | "cross_entropy_with_grad" => &["t v", "t"],
        "cross_entropy_bwd" => &["t v", "t", "t 1?", "t"],
        "quantized_matmul" => &["m k", "n k", "n"],
        "quantized_matmul_dx" => &["m n", "n k", "n"],
        "matmul_int4" | "matmul_mxfp4" => &["m k", "kh n", "ks n"],
        "matmul_nvfp4" => &["m k", "kh n", "ks n", "1"],
        "matmul_int4_dx" | "matmul_mxfp4_dx" => &["m n", "kh n", "ks n"],
        "matmul_nvfp4_dx" => &["m n", "kh n", "ks n", "1"],
        "int_mm" => &["m k", "k n"],
        "scaled_mm_blockwise" if transpose_rhs => &["m k", "n k", "m kb", "nb kb"],
        "scaled_mm_blockwise" => &["m k", "k n", "m kb", "kb nb"],
        "scaled_mm_blockwise_wgrad" => &["m k", "m n", "mb k", "mb n"],
        "quantize_fp8_1x128" => &["m k"],
        "quantize_fp8_128x1" => &["m n"],
        "gmm" if transpose_rhs => &["m k", "g n k", "g"],
        "gmm" => &["m k", "g k n", "g"],
        "tgmm" => &["m k", "m n", "g"],
        "gmm_bwd" if transpose_rhs => &["m k", "g n k", "g", "m n"],
        "gmm_bwd" => &["m k", "g k n", "g", "m n"],
        "router_topk" => &["t e"],
        "permute" => &["t d", "t k"],
        "permute_bwd" => &["t*k d", "t k"],
        "combine" => &["t*k d", "t k", "t k"],
        "flash_attention_fwd" | "flash_attention" => &["b h sq d", "b hkv skv d", "b hkv skv d", "b sq", "b skv"],
        "flash_attention_bwd" => &["b h sq d", "b hkv skv d", "b hkv skv d", "b h sq d", "b h sq 1?", "b h sq d", "b sq", "b skv"],
        "splash_attention_fwd" | "splash_attention" => &["b h sq d", "b hkv skv d", "b hkv skv d", "nb bq bk", "3 hm nq steps", "3 hm nk stepsq", "b sq", "b skv"],
        "splash_attention_bwd" => &["b h sq d", "b hkv skv d", "b hkv skv d", "b h sq d", "b h sq 1?", "b h sq d", "nb bq bk", "3 hm nq steps", "3 hm nk stepsq", "b sq", "b skv"],
        "paged_attention" => &["b h d", "hkv np ps d", "hkv np ps d", "b", "b pps", "hkv np ps", "hkv np ps"],
        "ragged_paged_attention" => &["t h d", "hkv np ps d", "hkv np ps d", "s", "s pps", "s+1", "1", "hkv np ps", "hkv np ps"],
        _ => &[],
    }
}

/// Whether `shapes` keep the contract (and the op's divisibility rules).
fn keeps_contract(op: &str, statics: &Statics, shapes: &[Vec<usize>]) -> bool {
    let spec = contract(op, statics.bool("transpose_rhs"));
    let mut env: HashMap<&str, usize> = HashMap::new();
    let mut lead: Option<Vec<usize>> = None;
    let mut later: Vec<(&str, usize)> = Vec::new();
    for (s, shape) in spec.iter().zip(shapes) {
        let mut toks: Vec<&str> = s.split(' ').collect();
        let mut shape: &[usize] = shape;
        if toks[0] == "R.." {
            toks.remove(0);
            if shape.len() < toks.len() {
                return false;
            }
            let (l, rest) = shape.split_at(shape.len() - toks.len());
            if lead.as_deref().is_some_and(|x| x != l) {
                return false;
            }
            lead = Some(l.to_vec());
            shape = rest;
        }
        // A row op's `[n]` vector may also be given as `[1, n]` (documented: `Call::row_vector`).
        if toks == ["n"] && shape.len() == 2 && shape[0] == 1 {
            shape = &shape[1..];
        }
        if toks.last() == Some(&"1?") {
            toks.pop();
            if shape.len() == toks.len() + 1 && shape.last() == Some(&1) {
                shape = &shape[..toks.len()];
            }
        }
        if shape.len() != toks.len() {
            return false;
        }
        for (t, &d) in toks.iter().zip(shape) {
            if let Ok(n) = t.parse::<usize>() {
                if n != d {
                    return false;
                }
            } else if t.contains('*') || t.contains('+') {
                later.push((t, d));
            } else if *env.entry(t).or_insert(d) != d {
                return false;
            }
        }
    }
    for (t, d) in later {
        let v = if let Some((a, b)) = t.split_once('*') {
            env.get(a).zip(env.get(b)).map(|(x, y)| x * y)
        } else if let Some((a, b)) = t.split_once('+') {
            env.get(a).map(|x| x + b.parse::<usize>().unwrap_or(0))
        } else {
            None
        };
        if v.is_some_and(|v| v != d) {
            return false;
        }
    }
    let get = |n: &str| env.get(n).copied().unwrap_or(1);
    match op {
        "flash_attention_fwd" | "flash_attention" | "flash_attention_bwd" | "paged_attention" | "ragged_paged_attention" => get("hkv") > 0 && get("h") % get("hkv").max(1) == 0,
        // The walks: one per q block (per kv block), shared or one set per query head.
        "splash_attention_fwd" | "splash_attention" | "splash_attention_bwd" => {
            let (nq, nk) = (get("sq").div_ceil(get("bq").max(1)), get("skv").div_ceil(get("bk").max(1)));
            get("hkv") > 0 && get("h") % get("hkv").max(1) == 0 && (get("hm") == 1 || get("hm") == get("h")) && get("nq") == nq && get("nk") == nk
        }
        "rope" | "rope_bwd" => get("dh") % 2 == 0,
        "router_topk" => statics.i64("k").is_some_and(|k| k >= 1 && k as usize <= get("e")),
        // The blockwise fp8 recipe: the contraction in 128-blocks, one scale per block.
        "scaled_mm_blockwise" => get("k") % 128 == 0 && get("kb") == get("k") / 128 && get("nb") == get("n").div_ceil(128),
        "scaled_mm_blockwise_wgrad" => get("m") % 128 == 0 && get("mb") == get("m") / 128,
        "quantize_fp8_1x128" => get("k") % 128 == 0,
        "quantize_fp8_128x1" => get("m") % 128 == 0,
        // 4-bit weights: two codes per byte of w [k/2, n] in 32-row nibble planes, a scale per group.
        "matmul_int4" | "matmul_mxfp4" | "matmul_nvfp4" | "matmul_int4_dx" | "matmul_mxfp4_dx" | "matmul_nvfp4_dx" => {
            let k = if op.ends_with("_dx") { get("kh") * 2 } else { get("k") };
            let ks = get("ks");
            let groups = match op.trim_end_matches("_dx") {
                "matmul_mxfp4" => ks * 32 == k,
                "matmul_nvfp4" => ks * 16 == k,
                _ => ks > 0 && k % ks == 0 && (k / ks) % 32 == 0,
            };
            k % 64 == 0 && get("kh") * 2 == k && groups
        }
        _ => true,
    }
}

/// The op whose cases, random inputs and reference serve `op` (an alias's source).
fn source_of(op: &'static Op) -> &'static Op {
    op.alias_of.and_then(|(of, _)| tessera_kernels::find(of)).unwrap_or(op)
}

/// A small dim: mostly odd and tiny, sometimes around a block edge.
fn dim(rng: &mut StdRng, max: usize) -> usize {
    let v = match rng.gen_range(0..10) {
        0 => 1,
        1..=5 => rng.gen_range(1..=max.min(24)),
        6 | 7 => rng.gen_range(1..=max),
        8 => [7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129][rng.gen_range(0..11)],
        _ => rng.gen_range(1..=max) | 1,
    };
    v.clamp(1, max.max(1))
}

fn rows_shape(rng: &mut StdRng, n: usize) -> Vec<usize> {
    match rng.gen_range(0..6) {
        0 => vec![n],
        1 => vec![dim(rng, 6), dim(rng, 9), n],
        _ => vec![dim(rng, 70), n],
    }
}

/// Small random valid shapes and statics for `op` (its source op's contract).
fn valid_call(op: &str, rng: &mut StdRng) -> (Vec<Vec<usize>>, String) {
    let mut st: Vec<String> = Vec::new();
    let shapes: Vec<Vec<usize>> = match op {
        "matmul" => {
            let (m, k, n) = (dim(rng, 300), dim(rng, 300), dim(rng, 300));
            vec![vec![m, k], vec![k, n]]
        }
        "matmul_bwd" => {
            let (m, k, n) = (dim(rng, 200), dim(rng, 200), dim(rng, 200));
            vec![vec![m, k], vec![k, n], vec![m, n]]
        }
        "gelu_affine" | "layernorm" => {
            let n = dim(rng, 700);
            if op == "layernorm" && rng.gen_bool(0.3) {
                st.push(format!("eps={:?}", [1e-5, 1e-3, 1e-12, 0.5][rng.gen_range(0..4)]));
            }
            vec![rows_shape(rng, n), vec![n], vec![n]]
        }
        "softmax" => {
            let n = dim(rng, 1500);
            vec![rows_shape(rng, n)]
        }
        "softmax_bwd" => {
            let n = dim(rng, 1500);
            let x = rows_shape(rng, n);
            vec![x.clone(), x]
        }
        "gelu_affine_bwd" => {
            let n = dim(rng, 700);
            let x = rows_shape(rng, n);
            vec![x.clone(), vec![n], vec![n], x]
        }
        "layernorm_bwd" => {
            // n >= 8, as the other norms' backward: no ill-conditioned rows.
            let n = dim(rng, 700).max(8);
            let x = rows_shape(rng, n);
            vec![x.clone(), vec![n], x]
        }
        "rmsnorm" => {
            let n = dim(rng, 700);
            vec![rows_shape(rng, n), vec![n]]
        }
        "rmsnorm_residual" => {
            let n = dim(rng, 700);
            let x = rows_shape(rng, n);
            vec![x.clone(), x, vec![n]]
        }
        "rmsnorm_residual_bwd" => {
            // n >= 8: at n = 1 dx = w dy eps / (x^2 + eps)^1.5 is a cancellation in any f32 code.
            let n = dim(rng, 700).max(8);
            let x = rows_shape(rng, n);
            vec![x.clone(), vec![n], x.clone(), x]
        }
        "rmsnorm_bwd" => {
            let n = dim(rng, 700).max(8);
            let x = rows_shape(rng, n);
            vec![x.clone(), vec![n], x]
        }
        "swiglu" | "geglu" => {
            let n = dim(rng, 700);
            let x = rows_shape(rng, n);
            vec![x.clone(), x]
        }
        "swiglu_bwd" | "geglu_bwd" => {
            let n = dim(rng, 700);
            let x = rows_shape(rng, n);
            vec![x.clone(), x.clone(), x]
        }
        "rope" | "rope_bwd" => {
            let t = dim(rng, 80);
            if rng.gen_bool(0.5) {
                st.push("interleaved=True".into());
            }
            if rng.gen_bool(0.3) {
                st.push(format!("theta={:?}", [500000.0, 10.0, 1e6][rng.gen_range(0..3)]));
            }
            vec![vec![t, dim(rng, 5), 2 * dim(rng, 64)], vec![t]]
        }
        "cross_entropy" | "cross_entropy_with_grad" => {
            let t = dim(rng, 60);
            vec![vec![t, dim(rng, 2000)], vec![t]]
        }
        "cross_entropy_bwd" => {
            let t = dim(rng, 60);
            let lse = if rng.gen_bool(0.3) { vec![t, 1] } else { vec![t] };
            vec![vec![t, dim(rng, 2000)], vec![t], lse, vec![t]]
        }
        "quantized_matmul" => {
            let (m, k, n) = (dim(rng, 200), dim(rng, 300), dim(rng, 200));
            vec![vec![m, k], vec![n, k], vec![n]]
        }
        "quantized_matmul_dx" => {
            let (m, k, n) = (dim(rng, 200), dim(rng, 300), dim(rng, 200));
            vec![vec![m, n], vec![n, k], vec![n]]
        }
        "matmul_int4" | "matmul_mxfp4" | "matmul_nvfp4" | "matmul_int4_dx" | "matmul_mxfp4_dx" | "matmul_nvfp4_dx" => {
            let (m, n, k) = (dim(rng, 40), dim(rng, 200), 64 * rng.gen_range(1..=5));
            let g = match op.trim_end_matches("_dx") {
                "matmul_mxfp4" => 32,
                "matmul_nvfp4" => 16,
                _ => {
                    let choices: Vec<usize> = [32, 64, 128].into_iter().filter(|g| k % g == 0).collect();
                    choices[rng.gen_range(0..choices.len())]
                }
            };
            let first = if op.ends_with("_dx") { vec![m, n] } else { vec![m, k] };
            let mut shapes = vec![first, vec![k / 2, n], vec![k / g, n]];
            if op.starts_with("matmul_nvfp4") {
                shapes.push(vec![1]);
            }
            shapes
        }
        "int_mm" => {
            let (m, k, n) = (dim(rng, 100), dim(rng, 300), dim(rng, 200));
            vec![vec![m, k], vec![k, n]]
        }
        "scaled_mm_blockwise" => {
            let (m, k, n) = (dim(rng, 200), 128 * rng.gen_range(1..=3), dim(rng, 300));
            if rng.gen_bool(0.4) {
                st.push("transpose_rhs=True".into());
                vec![vec![m, k], vec![n, k], vec![m, k / 128], vec![n.div_ceil(128), k / 128]]
            } else {
                vec![vec![m, k], vec![k, n], vec![m, k / 128], vec![k / 128, n.div_ceil(128)]]
            }
        }
        "scaled_mm_blockwise_wgrad" => {
            let (m, k, n) = (128 * rng.gen_range(1..=2), dim(rng, 200), dim(rng, 200));
            vec![vec![m, k], vec![m, n], vec![m / 128, k], vec![m / 128, n]]
        }
        "quantize_fp8_1x128" => vec![vec![dim(rng, 200), 128 * rng.gen_range(1..=3)]],
        "quantize_fp8_128x1" => vec![vec![128 * rng.gen_range(1..=2), dim(rng, 300)]],
        "gmm" | "gmm_bwd" => {
            let (m, k, n, g) = (dim(rng, 300), dim(rng, 200), dim(rng, 200), rng.gen_range(1..=6));
            let t = rng.gen_bool(0.4);
            if t {
                st.push("transpose_rhs=True".into());
            }
            let rhs = if t { vec![g, n, k] } else { vec![g, k, n] };
            let mut s = vec![vec![m, k], rhs, vec![g]];
            if op == "gmm_bwd" {
                s.push(vec![m, n]);
            }
            s
        }
        "tgmm" => {
            let (m, k, n, g) = (dim(rng, 300), dim(rng, 200), dim(rng, 200), rng.gen_range(1..=6));
            vec![vec![m, k], vec![m, n], vec![g]]
        }
        "router_topk" => {
            let e = dim(rng, 40);
            let k = rng.gen_range(1..=e.min(6));
            st.push(format!("k={k}"));
            if rng.gen_bool(0.3) {
                st.push("gate=\"sigmoid\"".into());
            }
            if rng.gen_bool(0.3) {
                st.push("normalize=False".into());
            }
            vec![vec![dim(rng, 80), e]]
        }
        "permute" | "permute_bwd" | "combine" => {
            let (t, k, d) = (dim(rng, 50), rng.gen_range(1..=3), dim(rng, 200));
            st.push(format!("num_experts={}", k + 1 + rng.gen_range(0..6)));
            match op {
                "permute" => vec![vec![t, d], vec![t, k]],
                "permute_bwd" => vec![vec![t * k, d], vec![t, k]],
                _ => vec![vec![t * k, d], vec![t, k], vec![t, k]],
            }
        }
        "flash_attention_fwd" | "flash_attention" | "flash_attention_bwd" => {
            let (b, hkv, g) = (rng.gen_range(1..=2), rng.gen_range(1..=2), rng.gen_range(1..=3));
            let (sq, skv) = (dim(rng, 200), dim(rng, 200));
            let d = [8, 16, 32, 64, 128, 40, 3][rng.gen_range(0..7)];
            if rng.gen_bool(0.5) {
                st.push("causal=True".into());
            }
            if rng.gen_bool(0.3) {
                st.push(format!("soft_cap={:?}", [50.0, 5.0, 1.0][rng.gen_range(0..3)]));
            }
            if rng.gen_bool(0.3) {
                st.push(format!("sm_scale={:?}", [0.5, 1.0, 0.01][rng.gen_range(0..3)]));
            }
            // Sliding windows: below a block, past the sequence, right extents (moot when causal).
            // Drawn from a copy of the generator, so the cases without one stay as they were.
            let mut w = StdRng::seed_from_u64(rng.clone().gen::<u64>());
            if w.gen_bool(0.3) {
                st.push(format!("window_left={}", w.gen_range(0..=sq + 8)));
            }
            if w.gen_bool(0.2) {
                st.push(format!("window_right={}", w.gen_range(0..=skv + 8)));
            }
            let (q, kv) = (vec![b, hkv * g, sq, d], vec![b, hkv, skv, d]);
            let mut s = if op == "flash_attention_bwd" { vec![q.clone(), kv.clone(), kv, q.clone(), vec![b, hkv * g, sq], q] } else { vec![q, kv.clone(), kv] };
            if rng.gen_bool(0.3) {
                s.extend([vec![b, sq], vec![b, skv]]);
            }
            s
        }
        "splash_attention_fwd" | "splash_attention" | "splash_attention_bwd" => {
            let (b, hkv, g) = (rng.gen_range(1..=2), rng.gen_range(1..=2), rng.gen_range(1..=3));
            let (sq, skv) = (dim(rng, 200), dim(rng, 200));
            let d = [8, 16, 32, 64, 128, 40][rng.gen_range(0..6)];
            if rng.gen_bool(0.3) {
                st.push(format!("soft_cap={:?}", [50.0, 5.0, 1.0][rng.gen_range(0..3)]));
            }
            if rng.gen_bool(0.3) {
                st.push(format!("sm_scale={:?}", [0.5, 1.0, 0.01][rng.gen_range(0..3)]));
            }
            // Metadata shapes of a mask at legal blocks (random walks fill them).
            let (bq, bk) = ([32, 64, 128][rng.gen_range(0..3)].min(sq), [128, 256][rng.gen_range(0..2)].min(skv));
            let (nq, nk) = (sq.div_ceil(bq), skv.div_ceil(bk));
            let heads = if rng.gen_bool(0.3) { hkv * g } else { 1 };
            let meta = [vec![rng.gen_range(1..=4), bq, bk], vec![3, heads, nq, rng.gen_range(1..=nk)], vec![3, heads, nk, rng.gen_range(1..=nq)]];
            let (q, kv) = (vec![b, hkv * g, sq, d], vec![b, hkv, skv, d]);
            let mut s = if op == "splash_attention_bwd" { vec![q.clone(), kv.clone(), kv, q.clone(), vec![b, hkv * g, sq], q] } else { vec![q, kv.clone(), kv] };
            s.extend(meta);
            if rng.gen_bool(0.3) {
                s.extend([vec![b, sq], vec![b, skv]]);
            }
            s
        }
        "paged_attention" => {
            let (b, hkv, g, np, pps) = (dim(rng, 5), rng.gen_range(1..=2), rng.gen_range(1..=4), rng.gen_range(1..=6), rng.gen_range(1..=4));
            let ps = [8, 16, 32, 5][rng.gen_range(0..4)];
            let d = [128, 64, 256, 32][rng.gen_range(0..4)];
            let mut s = vec![vec![b, hkv * g, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![b], vec![b, pps]];
            if rng.gen_bool(0.3) {
                // A quantized (int8) cache with per-token scales.
                s.extend([vec![hkv, np, ps], vec![hkv, np, ps]]);
            }
            s
        }
        "ragged_paged_attention" => {
            let (t, hkv, g, np, pps, s) = (dim(rng, 60), rng.gen_range(1..=2), rng.gen_range(1..=3), rng.gen_range(1..=6), rng.gen_range(1..=4), rng.gen_range(1..=5));
            let ps = [8, 16, 32][rng.gen_range(0..3)];
            let d = [128, 64][rng.gen_range(0..2)];
            st.push(format!("sm_scale={:?}", 1.0 / (d as f64).sqrt()));
            if rng.gen_bool(0.3) {
                st.push(format!("sliding_window={}", rng.gen_range(1..40)));
            }
            if rng.gen_bool(0.3) {
                st.push("soft_cap=30.0".into());
            }
            vec![vec![t, hkv * g, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![s], vec![s, pps], vec![s + 1], vec![1]]
        }
        other => panic!("the battery has no generator for op `{other}`: add one (a new op in the table)"),
    };
    (shapes, st.join(", "))
}

#[derive(Clone, Debug)]
enum DimTo {
    Plus1,
    Minus1,
    Double,
    Zero,
    One,
    Set(usize),
}

#[derive(Clone, Debug)]
enum OpMut {
    Valid,
    Dim(usize, usize, DimTo),
    DropDim(usize),
    AddDim(usize, usize),
    Dtype(usize, DType),
    DropInput(usize),
    ExtraInput,
    /// Extra static assignments.
    Static(String),
    /// An op-specific metadata value mutation (kind, which element).
    Meta(u8, usize),
    ShortData(usize),
    DtypeField(usize),
    /// NaN (or an infinity) at one element of a float input.
    Special(usize, f32, usize),
}

#[derive(Clone, Debug)]
struct OpCase {
    op: usize,
    seed: u64,
    target: usize,
    bf16: bool,
    m: OpMut,
}

fn ops() -> Vec<&'static Op> {
    library().collect()
}

fn op_mut_s() -> impl Strategy<Value = OpMut> {
    let to = prop_oneof![Just(DimTo::Plus1), Just(DimTo::Minus1), Just(DimTo::Double), Just(DimTo::Zero), Just(DimTo::One), prop_oneof![Just(1usize << 40), Just(usize::MAX), Just(1 << 31), Just(usize::MAX / 3), Just(1 << 33)].prop_map(DimTo::Set)];
    prop_oneof![
        10 => Just(OpMut::Valid),
        5 => (0usize..8, 0usize..4, to).prop_map(|(i, d, t)| OpMut::Dim(i, d, t)),
        1 => (0usize..8).prop_map(OpMut::DropDim),
        1 => (0usize..8, prop_oneof![Just(1usize), Just(2), Just(3)]).prop_map(|(i, d)| OpMut::AddDim(i, d)),
        3 => (0usize..8, prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::I32), Just(DType::I8), Just(DType::Bool)]).prop_map(|(i, d)| OpMut::Dtype(i, d)),
        1 => (0usize..8).prop_map(OpMut::DropInput),
        1 => Just(OpMut::ExtraInput),
        3 => prop_oneof![
            Just("nope=1"), Just("eps=nan"), Just("eps=-1.0"), Just("eps=inf"), Just("eps=\"x\""), Just("eps=True"), Just("eps=None"),
            Just("theta=nan"), Just("theta=0.0"), Just("theta=-10.0"), Just("interleaved=3"),
            Just("tiling=[0, 128, 128]"), Just("tiling=[128, 128]"), Just("tiling=[-128, 128, 128]"), Just("tiling=[3, 5, 7]"), Just("tiling=[8, 128, 128]"), Just("tiling=[1099511627776, 128, 128]"), Just("transpose_rhs=1"),
            Just("k=0"), Just("k=-1"), Just("k=1000"), Just("k=99999999999999999999"), Just("gate=\"relu\""), Just("gate=\"\""),
            Just("num_experts=0"), Just("num_experts=-1"), Just("num_experts=1"), Just("num_experts=3000000000"),
            Just("block_q=0"), Just("block_q=-1"), Just("block_q=3"), Just("block_kv=1099511627776"), Just("sm_scale=nan"), Just("soft_cap=0.0"), Just("soft_cap=-1.0"), Just("soft_cap=nan"), Just("causal=2"),
            Just("pages_per_compute_block=0"), Just("pages_per_compute_block=-1"), Just("pages_per_compute_block=1000"),
            Just("sliding_window=0"), Just("sliding_window=-1"), Just("num_queries_per_block=0"), Just("num_queries_per_block=5"), Just("num_kv_pages_per_block=0"), Just("sm_scale=inf")
        ]
        .prop_map(|s| OpMut::Static(s.to_string())),
        6 => (0u8..12, any::<usize>()).prop_map(|(k, w)| OpMut::Meta(k, w)),
        1 => (0usize..8).prop_map(OpMut::ShortData),
        1 => (0usize..8).prop_map(OpMut::DtypeField),
        2 => (0usize..8, prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)], any::<usize>()).prop_map(|(i, v, at)| OpMut::Special(i, v, at)),
    ]
}

fn op_cases() -> Vec<OpCase> {
    let n_ops = ops().len();
    // The same number of cases for every op (the op of case i is i mod the number of ops).
    let per_op = scaled(160);
    let strategy = (0usize..n_ops, any::<u64>(), 0usize..4, prop::bool::weighted(0.3), op_mut_s()).prop_map(|(op, seed, target, bf16, m)| OpCase { op, seed, target, bf16, m });
    let mut cases = generate(strategy, per_op * n_ops, 2);
    for (i, c) in cases.iter_mut().enumerate() {
        c.op = i % n_ops;
    }
    cases
}

/// What a mutated call must do.
#[derive(Clone, Debug, PartialEq)]
enum Expect2 {
    /// A valid call: the result must match the reference.
    Valid,
    /// Must be rejected with a clear error (why).
    Reject(String),
    /// Either a clear error or a result that matches the reference (NaN where it is NaN).
    Any(String),
}

/// The values of a call and what it must do.
struct Call2 {
    inputs: Vec<Option<Array>>,
    statics: Result<Statics, KernelError>,
    statics_text: String,
    expect: Expect2,
    /// Inputs whose shape field lies about (huge shapes with tiny data): nothing may be
    /// allocated for them.
    huge: bool,
    what: String,
}

fn shape_huge(dtype: DType, shape: &[usize]) -> bool {
    elems(shape).is_none() || bytes_of(dtype, shape) > BEYOND_HBM
}

fn float_inputs(op: &Op) -> Vec<usize> {
    op.inputs.iter().enumerate().filter(|(_, i)| matches!(i.kind, tessera_kernels::Kind::Float | tessera_kernels::Kind::Float32)).map(|(n, _)| n).collect()
}

fn set_i32(a: &mut Array, at: usize, v: i32) {
    if let Data::I32(d) = &mut a.data {
        if !d.is_empty() {
            let n = d.len();
            d[at % n] = v;
        }
    }
}

fn i32s(a: &Array) -> Vec<i32> {
    a.as_i32().map(|v| v.to_vec()).unwrap_or_default()
}

/// The op-specific metadata mutation `kind` on valid inputs; None if the op has none of that kind.
fn mutate_meta(op: &str, kind: u8, w: usize, inputs: &mut [Array], statics: &Statics) -> Option<(Expect2, String)> {
    let rej = |s: String| Some((Expect2::Reject(s.clone()), s));
    match op {
        "gmm" | "tgmm" | "gmm_bwd" => {
            let m = inputs[0].shape[0] as i64;
            let gi = 2;
            let mut s = i32s(&inputs[gi]);
            let g = s.len();
            let what = match kind % 6 {
                0 if g >= 2 => {
                    let old = s[0];
                    s[0] = -1;
                    s[g - 1] += old + 1;
                    "a negative group size (sum kept)"
                }
                0 => {
                    s[0] = -1;
                    "a group size of -1"
                }
                1 => {
                    let i = s.iter().position(|&x| x > 0)?;
                    s[i] -= 1;
                    "group sizes summing to m - 1"
                }
                2 => {
                    s[w % g] += 1;
                    "group sizes summing to m + 1"
                }
                3 => {
                    s[w % g] = i32::MAX;
                    "a group size of 2^31 - 1"
                }
                4 if g >= 3 => {
                    s = vec![0; g];
                    s[0] = i32::MAX;
                    s[1] = i32::MAX;
                    s[2] = (m + 2) as i32;
                    "group sizes [2^31-1, 2^31-1, m+2, ..] whose i32 sum wraps to m"
                }
                4 if g == 2 => {
                    s = vec![(i32::MIN as i64 + m) as i32, i32::MIN];
                    "group sizes [-2^31 + m, -2^31] whose i32 sum wraps to m"
                }
                _ => {
                    s[w % g] = i32::MIN;
                    "a group size of -2^31"
                }
            };
            inputs[gi] = Array::from_i32(&[g], s);
            rej(what.to_string())
        }
        "permute" | "permute_bwd" | "combine" => {
            let at = if op == "combine" { 2 } else { 1 };
            let e = statics.i64("num_experts").unwrap_or(0);
            let (v, what) = match kind % 5 {
                0 => (e, "an expert id == num_experts"),
                1 => (-1, "an expert id of -1"),
                2 => (i32::MAX as i64, "an expert id of 2^31 - 1"),
                3 => (i32::MIN as i64, "an expert id of -2^31"),
                _ => (e + 5, "an expert id of num_experts + 5"),
            };
            set_i32(&mut inputs[at], w, v as i32);
            rej(what.to_string())
        }
        "cross_entropy" | "cross_entropy_with_grad" | "cross_entropy_bwd" => {
            let v = inputs[0].shape.get(1).copied().unwrap_or(1) as i64;
            let (x, what, valid) = match kind % 7 {
                0 => (v, "a label == vocab", false),
                1 => (v + 7, "a label == vocab + 7", false),
                2 => (-1, "a label of -1", false),
                3 => (i32::MAX as i64, "a label of 2^31 - 1", false),
                4 => (i32::MIN as i64, "a label of -2^31", false),
                _ => (-100, "a label of -100 (ignore_index: loss 0)", true),
            };
            set_i32(&mut inputs[1], w, x as i32);
            if valid {
                Some((Expect2::Valid, what.to_string()))
            } else {
                rej(format!("{what} (torch raises; only ignore_index=-100 is ignored)"))
            }
        }
        "rope" | "rope_bwd" => {
            let n = inputs[1].len().max(1);
            if let Data::I32(d) = &mut inputs[1].data {
                for (i, p) in d.iter_mut().enumerate() {
                    if i % n == w % n || kind.is_multiple_of(2) {
                        *p = -*p - 1;
                    }
                }
            }
            Some((Expect2::Any("negative positions (a rotation by a negative angle)".into()), "negative positions".into()))
        }
        "paged_attention" => {
            let (np, ps) = (inputs[1].shape[1], inputs[1].shape[2]);
            let pps = inputs[4].shape[1];
            let b = inputs[3].len();
            let s = w % b;
            let cap = (pps * ps) as i32;
            let what = match kind % 8 {
                0 => {
                    set_i32(&mut inputs[3], s, cap + 1);
                    "a length of pages_per_seq * page_size + 1"
                }
                1 => {
                    set_i32(&mut inputs[3], s, -1);
                    "a length of -1"
                }
                2 => {
                    set_i32(&mut inputs[3], s, i32::MAX);
                    "a length of 2^31 - 1"
                }
                3 => {
                    set_i32(&mut inputs[3], s, i32::MIN);
                    "a length of -2^31"
                }
                4 | 5 => {
                    set_i32(&mut inputs[3], s, cap.max(1));
                    set_i32(&mut inputs[4], s * pps, if kind % 8 == 4 { np as i32 } else { -1 });
                    "a page index out of range in a sequence's used pages"
                }
                _ => {
                    set_i32(&mut inputs[3], s, cap.max(1));
                    set_i32(&mut inputs[4], s * pps, i32::MAX);
                    "a page index of 2^31 - 1 in a sequence's used pages"
                }
            };
            rej(what.to_string())
        }
        "ragged_paged_attention" => {
            let t = inputs[0].shape[0] as i32;
            let (np, ps) = (inputs[1].shape[1], inputs[1].shape[2]);
            let (ms, pps) = (inputs[4].shape[0], inputs[4].shape[1]);
            let cap = (pps * ps) as i32;
            let ns = i32s(&inputs[6])[0].clamp(0, ms as i32) as usize;
            let mut cu = i32s(&inputs[5]);
            let kv = i32s(&inputs[3]);
            let live = if ns > 0 { w % ns } else { 0 };
            let q_len = |cu: &[i32], s: usize| cu[s + 1] - cu[s];
            let what = match kind % 11 {
                0 if ns >= 2 && cu[1] != cu[2] => {
                    cu.swap(1, 2);
                    inputs[5] = Array::from_i32(&[ms + 1], cu);
                    "non-monotone cu_q_lens"
                }
                1 if ns >= 1 => {
                    for c in cu.iter_mut().skip(ns) {
                        *c = t + 1;
                    }
                    inputs[5] = Array::from_i32(&[ms + 1], cu);
                    "cu_q_lens[num_seqs] beyond the number of tokens"
                }
                2 => {
                    cu[0] = if w.is_multiple_of(2) { -1 } else { 1 };
                    inputs[5] = Array::from_i32(&[ms + 1], cu);
                    "cu_q_lens[0] != 0"
                }
                3 if ns >= 1 => {
                    set_i32(&mut inputs[3], live, cap + 1);
                    "a kv_len beyond pages_per_seq * page_size"
                }
                4 if ns >= 1 => {
                    set_i32(&mut inputs[3], live, -1);
                    "a kv_len of -1"
                }
                5 => {
                    inputs[6] = Array::from_i32(&[1], vec![ms as i32 + 1]);
                    "num_seqs above max_seqs"
                }
                6 => {
                    inputs[6] = Array::from_i32(&[1], vec![-1]);
                    "num_seqs of -1"
                }
                7 => {
                    inputs[6] = Array::from_i32(&[1], vec![i32::MAX]);
                    "num_seqs of 2^31 - 1"
                }
                8 => {
                    let s = (0..ns).find(|&s| q_len(&cu, s) >= 1)?;
                    set_i32(&mut inputs[3], s, q_len(&cu, s) - 1);
                    "q_len > kv_len"
                }
                9 => {
                    let s = (0..ns).find(|&s| kv[s] >= 1)?;
                    set_i32(&mut inputs[4], s * pps, if w.is_multiple_of(2) { np as i32 } else { -1 });
                    "a page index out of range in a sequence's used pages"
                }
                _ => {
                    let s = (1..=ns).find(|&s| cu[s] > 0)?;
                    cu[s] = -cu[s];
                    inputs[5] = Array::from_i32(&[ms + 1], cu);
                    "a negative cu_q_lens entry"
                }
            };
            rej(what.to_string())
        }
        _ => None,
    }
}

/// Which statics an op's schema has.
fn has_static(op: &Op, name: &str) -> bool {
    op.parsed().map(|s| s.statics().any(|p| p.name == name)).unwrap_or(false)
}

/// The expectation for extra statics `text` on a valid call of `op`.
fn static_expect(op: &Op, text: &str) -> Expect2 {
    let (name, value) = text.split_once('=').unwrap_or((text, ""));
    if !has_static(op, name) {
        return Expect2::Reject(format!("`{name}` is not a static of the op"));
    }
    let any = |why: &str| Expect2::Any(why.to_string());
    let rej = |why: &str| Expect2::Reject(why.to_string());
    match (name, value) {
        (_, "nan") | (_, "inf") => any("a NaN / inf float static"),
        ("eps", "-1.0") | ("theta", _) => any("an unusual float static"),
        ("tiling", "[3, 5, 7]") | ("tiling", "[8, 128, 128]") | ("block_q", "3") | ("num_queries_per_block", "5") | ("pages_per_compute_block", "1000") | ("block_kv", _) | ("tiling", "[1099511627776, 128, 128]") => any("unusual block sizes"),
        ("soft_cap", _) if op.name != "ragged_paged_attention" => any("an unusual soft cap"),
        ("k", "0") => any("k = 0"),
        ("num_experts", "3000000000") => rej("num_experts beyond i32"),
        _ => rej("a static out of its contract"),
    }
}

fn special_at(a: &mut Array, at: usize, v: f32) -> bool {
    let n = a.len();
    if n == 0 {
        return false;
    }
    match &mut a.data {
        Data::F32(d) => d[at % n] = v,
        Data::BF16(d) => d[at % n] = half::bf16::from_f32(v),
        _ => return false,
    }
    true
}

fn short(a: &mut Array) {
    a.data = match std::mem::replace(&mut a.data, Data::Bool(vec![])) {
        Data::F32(mut v) => {
            v.pop();
            Data::F32(v)
        }
        Data::BF16(mut v) => {
            v.pop();
            Data::BF16(v)
        }
        Data::I32(mut v) => {
            v.pop();
            Data::I32(v)
        }
        Data::I8(mut v) => {
            v.pop();
            Data::I8(v)
        }
        Data::Bool(mut v) => {
            v.pop();
            Data::Bool(v)
        }
        Data::F8E4M3FN(mut v) => {
            v.pop();
            Data::F8E4M3FN(v)
        }
        Data::F8E5M2(mut v) => {
            v.pop();
            Data::F8E5M2(v)
        }
    };
}

/// An array of `shape` whose data is one element (for shapes that must never be allocated).
fn lying(dtype: DType, shape: &[usize]) -> Array {
    let mut a = Array::zeros(dtype, &[1]);
    a.shape = shape.to_vec();
    a
}

/// Builds the call of case `c`.
fn make_call(op: &'static Op, c: &OpCase) -> Result<Call2, Verdict> {
    let src = source_of(op);
    let mut rng = StdRng::seed_from_u64(c.seed);
    let dtype = if c.bf16 { DType::BF16 } else { DType::F32 };
    let (mut shapes, st) = valid_call(op.name, &mut rng);
    let mut statics_text = st;
    let statics0 = op.statics(&statics_text).map_err(|e| Verdict::fail("battery-bug", format!("valid statics `{statics_text}` rejected: {e}")))?;
    let gen = |shapes: &[Vec<usize>], statics: &Statics, rng: &mut StdRng| h::catch(|| harness::inputs_for(src, shapes, dtype, statics, rng)).map_err(|p| Verdict::fail("panic", format!("the op's random-input generator (reachable via `tessera run`): {p}")));
    let n = op.inputs.len();
    let mut expect = Expect2::Valid;
    let mut what = String::new();
    let mut huge = false;
    let mut inputs: Vec<Option<Array>>;
    match &c.m {
        OpMut::Valid => {
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
        }
        OpMut::Dim(i, d, to) => {
            let i = i % shapes.len();
            let mut s = shapes.clone();
            if s[i].is_empty() {
                return Err(Verdict::pass("n/a", "a rank-0 input"));
            }
            let d = d % s[i].len();
            let old = s[i][d];
            s[i][d] = match to {
                DimTo::Plus1 => old + 1,
                DimTo::Minus1 => old.saturating_sub(1),
                DimTo::Double => old * 2,
                DimTo::Zero => 0,
                DimTo::One => 1,
                DimTo::Set(v) => *v,
            };
            what = format!("input `{}` dim {d}: {old} -> {}", op.inputs[i].name, s[i][d]);
            let kind_dtype = op.inputs[i].kind.dtype(dtype);
            if !shape_huge(kind_dtype, &s[i]) && elems(&s[i]).is_some_and(|n| n > 1 << 22) {
                // Too large for the battery to allocate, not beyond a TPU: the type-level path only.
                let mut types: Vec<Option<Type>> = op.inputs.iter().zip(&shapes).map(|(inp, sh)| Some(Type::vector(inp.kind.dtype(dtype), sh))).collect();
                types[i] = Some(Type::vector(kind_dtype, &s[i]));
                for t in Target::ALL {
                    match h::catch(|| op.plan_for(&types, &statics0, &t).and_then(|p| p.launches.iter().try_for_each(|l| tessera_dsl::verify::verify(&l.kernel, &t)))) {
                        Err(p) => return Err(Verdict::fail("panic", format!("plan/verify of {what} on {t}: {p}"))),
                        Ok(Err(e)) => {
                            judge_error(&e)?;
                        }
                        Ok(Ok(())) => {}
                    }
                }
                return Err(Verdict::pass("plan-only", "a large shape: plan + verify only"));
            }
            if shape_huge(kind_dtype, &s[i]) {
                huge = true;
                expect = Expect2::Reject(format!("{what}: an operand beyond any TPU's memory (or overflowing usize)"));
                let base = gen(&shapes, &statics0, &mut rng)?;
                inputs = base.into_iter().map(Some).collect();
                inputs[i] = Some(lying(kind_dtype, &s[i]));
            } else if s[i].contains(&0) {
                expect = Expect2::Any(format!("{what}: a zero-size dim"));
                let base = gen(&shapes, &statics0, &mut rng)?;
                inputs = base.into_iter().map(Some).collect();
                inputs[i] = Some(harness::random_array(kind_dtype, &s[i], &mut rng));
            } else if keeps_contract(op.name, &statics0, &s) {
                // Still a valid call, at other shapes.
                shapes = s;
                inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            } else {
                expect = Expect2::Reject(format!("{what}: shapes inconsistent with the op's contract"));
                let base = gen(&shapes, &statics0, &mut rng)?;
                inputs = base.into_iter().map(Some).collect();
                let mut fresh = harness::random_array(kind_dtype, &s[i], &mut rng);
                if kind_dtype == DType::I32 {
                    fresh = Array::from_i32(&s[i], vec![0; s[i].iter().product()]);
                }
                inputs[i] = Some(fresh);
            }
        }
        OpMut::DropDim(i) | OpMut::AddDim(i, _) => {
            let i = i % shapes.len();
            let mut s = shapes.clone();
            match &c.m {
                OpMut::DropDim(_) => {
                    s[i].pop();
                }
                OpMut::AddDim(_, v) => s[i].insert(0, *v),
                _ => unreachable!(),
            }
            what = format!("input `{}` of rank {} ({:?})", op.inputs[i].name, s[i].len(), s[i]);
            let base = gen(&shapes, &statics0, &mut rng)?;
            inputs = base.into_iter().map(Some).collect();
            let kind_dtype = op.inputs[i].kind.dtype(dtype);
            let mut fresh = harness::random_array(kind_dtype, &s[i], &mut rng);
            if kind_dtype == DType::I32 {
                fresh = Array::from_i32(&s[i], vec![0; s[i].iter().product()]);
            }
            // A backward's derived inputs (`o`, `lse`) keep their values when only their rank
            // changes ([t] <-> [t, 1]): the references recompute them, so fresh random values
            // would be judged as a wrong result of a valid call.
            let derived = matches!(op.inputs[i].name, "o" | "lse");
            if let Some(base) = inputs[i].as_ref().filter(|a| derived && elems(&s[i]) == Some(a.len())) {
                fresh = Array { shape: s[i].clone(), ..base.clone() };
            }
            inputs[i] = Some(fresh);
            expect = if keeps_contract(op.name, &statics0, &s) { Expect2::Any(format!("{what}: another rank the contract allows")) } else { Expect2::Reject(format!("{what}: a rank the contract does not allow")) };
        }
        OpMut::Dtype(i, to) => {
            let i = i % n.min(shapes.len());
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            let a = inputs[i].as_ref().expect("generated");
            let to = if a.dtype == *to { &DType::I8 } else { to };
            if a.dtype == *to {
                return Err(Verdict::pass("n/a", "same dtype"));
            }
            let converted = match to {
                DType::F32 => Array::from_f32(&a.shape, a.to_f32_vec()),
                DType::BF16 => Array::from_f32_as_bf16(&a.shape, &a.to_f32_vec()),
                DType::I32 => Array::from_i32(&a.shape, a.to_f32_vec().iter().map(|&x| x as i32).collect()),
                DType::I8 => Array::from_i8(&a.shape, a.to_f32_vec().iter().map(|&x| x as i8).collect()),
                DType::Bool => Array::from_bool(&a.shape, a.to_f32_vec().iter().map(|&x| x != 0.0).collect()),
                DType::F8E4M3FN | DType::F8E5M2 => Array::from_f32_as_fp8(*to, &a.shape, &a.to_f32_vec()),
            };
            what = format!("input `{}` as {to} (was {})", op.inputs[i].name, a.dtype);
            expect = if a.dtype.is_float() == to.is_float() && *to != DType::Bool {
                Expect2::Any(format!("{what}: another dtype of the same kind"))
            } else {
                Expect2::Reject(format!("{what}: a dtype of the wrong kind"))
            };
            inputs[i] = Some(converted);
        }
        OpMut::DropInput(i) => {
            let i = i % n;
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            inputs.resize(n, None);
            let optional = op.parsed().ok().and_then(|s| s.tensor(i).map(|p| p.optional)).unwrap_or(false);
            what = format!("input `{}` not given", op.inputs[i].name);
            expect = if optional { Expect2::Any(what.clone()) } else { Expect2::Reject(what.clone()) };
            inputs[i] = None;
        }
        OpMut::ExtraInput => {
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            inputs.resize(n, None);
            inputs.push(Some(Array::from_f32(&[2, 2], vec![1.0; 4])));
            what = "one tensor more than the schema".into();
            expect = Expect2::Reject(what.clone());
        }
        OpMut::Static(text) => {
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            statics_text = if statics_text.is_empty() { text.clone() } else { format!("{statics_text}, {text}") };
            what = format!("static {text}");
            expect = static_expect(op, text);
            // Routing ids must stay in range when num_experts changes.
            if text.starts_with("num_experts") {
                expect = Expect2::Reject(format!("{what}: ids must stay below num_experts"));
                if text == "num_experts=1" && inputs.iter().flatten().filter(|a| a.dtype == DType::I32).all(|a| i32s(a).iter().all(|&x| x == 0)) {
                    expect = Expect2::Any(what.clone());
                }
            }
            if text.starts_with("k=") && op.name == "router_topk" {
                let e = shapes[0][1] as i64;
                let k: i64 = text[2..].parse().unwrap_or(i64::MAX);
                expect = if k == 0 { Expect2::Any("k = 0".into()) } else if (1..=e).contains(&k) { Expect2::Valid } else { Expect2::Reject(format!("k = {} for {e} experts", &text[2..])) };
            }
        }
        OpMut::Meta(kind, w) => {
            let mut v = gen(&shapes, &statics0, &mut rng)?;
            // An op without metadata of this kind: a valid call instead.
            if let Some((e, wh)) = mutate_meta(op.name, *kind, *w, &mut v, &statics0) {
                expect = e;
                what = wh;
            }
            inputs = v.into_iter().map(Some).collect();
        }
        OpMut::ShortData(i) | OpMut::DtypeField(i) => {
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            let i = i % inputs.len();
            let a = inputs[i].as_mut().expect("generated");
            if matches!(c.m, OpMut::ShortData(_)) {
                short(a);
                what = format!("input `{}`: an Array with one element less than its shape", op.inputs[i].name);
            } else {
                a.dtype = other_dtype(a.dtype);
                what = format!("input `{}`: an Array whose dtype field ({}) disagrees with its data", op.inputs[i].name, a.dtype);
            }
            expect = Expect2::Reject(what.clone());
        }
        OpMut::Special(..) if matches!(op.name, "cross_entropy_bwd" | "flash_attention_bwd" | "splash_attention_bwd") => {
            // Their lse / o inputs derive from the others: a NaN elsewhere makes them stale,
            // and the references recompute them. (Valid call instead.)
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
        }
        OpMut::Special(i, v, at) => {
            inputs = gen(&shapes, &statics0, &mut rng)?.into_iter().map(Some).collect();
            let fl = float_inputs(op);
            // Not the derived inputs of backward ops (o, lse): the references recompute them.
            let fl: Vec<usize> = fl.into_iter().filter(|&k| k < inputs.len() && !matches!(op.inputs[k].name, "o" | "lse")).collect();
            if fl.is_empty() {
                return Err(Verdict::pass("n/a", "no float input"));
            }
            let k = fl[i % fl.len()];
            if !special_at(inputs[k].as_mut().expect("generated"), *at, *v) {
                return Err(Verdict::pass("n/a", "empty input"));
            }
            what = format!("{v} at element {} of input `{}`", at % inputs[k].as_ref().map_or(1, |a| a.len().max(1)), op.inputs[k].name);
            expect = Expect2::Any(format!("{what}: the result must be NaN / inf exactly where the reference is"));
        }
    }
    Ok(Call2 { inputs, statics: op.statics(&statics_text), statics_text, expect, huge, what })
}

/// `got` vs the reference `want`: NaN exactly where the reference is NaN, infinities
/// where it is infinite, elsewhere finite and within `tol` (max-norm relative).
fn compare(got: &Array, want: &[f64], tol: f64) -> Result<(), String> {
    let g = got.to_f64_vec();
    if g.len() != want.len() {
        return Err(format!("{} elements, the reference has {}", g.len(), want.len()));
    }
    if !got.dtype.is_float() {
        let bad = g.iter().zip(want).filter(|(a, b)| a != b).count();
        return if bad == 0 { Ok(()) } else { Err(format!("{bad} of {} integer elements differ", g.len())) };
    }
    // A (near) zero reference is judged by absolute error (as tests/python/test_ops.py does).
    let scale = want.iter().filter(|w| w.is_finite()).fold(0.0f64, |m, w| m.max(w.abs()));
    let scale = if scale > 1e-6 { scale } else { 1.0 };
    let mut worst = 0.0f64;
    for (i, (a, w)) in g.iter().zip(want).enumerate() {
        if w.is_nan() {
            if !a.is_nan() {
                return Err(format!("element {i} is {a}, the reference is NaN"));
            }
        } else if w.is_infinite() {
            if a != w {
                return Err(format!("element {i} is {a}, the reference is {w}"));
            }
        } else if !a.is_finite() {
            return Err(format!("element {i} is {a} where the reference is finite ({w})"));
        } else {
            worst = worst.max((a - w).abs() / scale);
        }
    }
    if worst > tol {
        return Err(format!("max-norm relative error {worst:.3e} > {tol:.1e}"));
    }
    Ok(())
}

fn same_bits(a: &[Array], b: &[Array]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.shape == y.shape && x.to_f64_vec().iter().zip(y.to_f64_vec()).all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan())))
}

fn run_op_case(c: &OpCase) -> Verdict {
    let all = ops();
    let op = all[c.op];
    let target = Target::ALL[c.target];
    let dtype = if c.bf16 { DType::BF16 } else { DType::F32 };
    let call = match make_call(op, c) {
        Ok(call) => call,
        Err(v) => return v,
    };
    let statics = match &call.statics {
        Ok(s) => s.clone(),
        Err(e) => {
            return match (&call.expect, judge_error(e)) {
                (_, Err(v)) => v,
                (Expect2::Valid, Ok(rule)) => Verdict::fail("rejected-valid-static", format!("statics `{}` rejected ({rule}): {}", call.statics_text, first_line(&e.to_string()))),
                (_, Ok(rule)) => Verdict::pass("clean-error", rule),
            }
        }
    };
    // Huge shapes: the type-level path (plan + verify, as `tessera emit`) must refuse them
    // on every target, and running must refuse before allocating anything.
    if call.huge {
        let types: Vec<Option<Type>> = call.inputs.iter().map(|a| a.as_ref().map(|a| Type::vector(a.dtype, &a.shape))).collect();
        for t in Target::ALL {
            match h::catch(|| op.plan_for(&types, &statics, &t).and_then(|p| p.launches.iter().try_for_each(|l| tessera_dsl::verify::verify(&l.kernel, &t)))) {
                Err(p) => return Verdict::fail("panic", format!("plan/verify of {} on {t}: {p}", call.what)),
                Ok(Ok(())) => return Verdict::fail("accepted-invalid", format!("plan + verify accepted on {t}: {}", call.what)),
                Ok(Err(e)) => {
                    if let Err(v) = judge_error(&e) {
                        return v;
                    }
                }
            }
        }
    }
    let refs: Vec<Option<&Array>> = call.inputs.iter().map(Option::as_ref).collect();
    let run = || op.run(&Interpreter, &refs, &statics, &target);
    let out = match h::catch(run) {
        Err(p) => return Verdict::fail("panic", format!("op.run ({}): {p}", call.what)),
        Ok(r) => r,
    };
    let outputs = match out {
        Err(e) => {
            return match judge_error(&e) {
                Err(v) => v,
                Ok(rule) => match call.expect {
                    Expect2::Valid => Verdict::pass("rejected-valid", rule),
                    _ => Verdict::pass("clean-error", rule),
                },
            }
        }
        Ok(o) => o,
    };
    if let Expect2::Reject(why) = &call.expect {
        let nans: usize = outputs.iter().map(|o| o.to_f64_vec().iter().filter(|v| v.is_nan()).count()).sum();
        // A wrong shape with the right number of elements (e.g. a [] weight for n = 1) is a
        // lenient reading of the shape rather than a wrong call: its own class.
        let reshaped = matches!(c.m, OpMut::Dim(..) | OpMut::DropDim(_) | OpMut::AddDim(..)) && {
            let mut rng = StdRng::seed_from_u64(c.seed);
            let (base, _) = valid_call(op.name, &mut rng);
            base.iter().zip(&call.inputs).all(|(s, a)| a.as_ref().is_none_or(|a| elems(s) == elems(&a.shape)))
        };
        let class = if reshaped { "accepted-reshaped" } else { "accepted-invalid" };
        return Verdict::fail(class, format!("{why}: returned Ok ({} outputs, {nans} NaN elements)", outputs.len()));
    }
    // A result: compare with the independent reference.
    let src = source_of(op);
    let Some(reference) = src.reference else { return Verdict::pass("ok-unverified", "no reference") };
    let arrays: Vec<Array> = call.inputs.iter().flatten().cloned().collect();
    let expected = match h::catch(|| reference(&arrays, &statics)) {
        Ok(mut e) => {
            if let Some((_, i)) = op.alias_of {
                e = e.into_iter().skip(i).take(1).collect();
            }
            e
        }
        Err(p) => {
            return if call.expect == Expect2::Valid { Verdict::fail("reference-panic", format!("the op's reference panicked on a valid call: {p}")) } else { Verdict::pass("ok-unverified", "the reference cannot judge this input") };
        }
    };
    if expected.len() != outputs.len() {
        return Verdict::fail("wrong-result", format!("{} outputs, the reference has {}", outputs.len(), expected.len()));
    }
    let mixed = matches!(c.m, OpMut::Dtype(..));
    for (j, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        // Attention's f32 gradients carry the cancellation of `ds = p * (dp - di)`: 2e-5, as
        // tests/tests/attention.rs holds them to.
        let tol = if mixed || got.dtype == DType::BF16 || dtype == DType::BF16 {
            2e-2
        } else if matches!(op.name, "flash_attention_bwd" | "splash_attention_bwd") {
            2e-5
        } else {
            harness::tolerance(got.dtype)
        };
        if let Err(why) = compare(got, want, tol) {
            let class = if matches!(c.m, OpMut::Special(..)) { "nan-propagation" } else { "wrong-result" };
            return Verdict::fail(class, format!("output {j} ({}{:?}): {why} [{}]", got.dtype, got.shape, call.what));
        }
    }
    // The same call again: the same bits (nothing uninitialised, nothing cached wrongly).
    if c.seed.is_multiple_of(3) {
        match h::catch(run) {
            Ok(Ok(again)) if !same_bits(&outputs, &again) => return Verdict::fail("nondeterministic", format!("a second identical call gave different results [{}]", call.what)),
            Ok(Err(e)) => return Verdict::fail("nondeterministic", format!("a second identical call failed: {e}")),
            Err(p) => return Verdict::fail("panic", format!("second call: {p}")),
            _ => {}
        }
    }
    Verdict::pass(if call.expect == Expect2::Valid { "ok" } else { "ok-matches-reference" }, "")
}

fn describe_op_case(c: &OpCase) -> String {
    let op = ops()[c.op];
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (shapes, st) = valid_call(op.name, &mut rng);
    format!("op `{}` target {} dtype {} base shapes {:?} statics `{}` mutation {:?} (seed {})", op.name, Target::ALL[c.target], if c.bf16 { "bf16" } else { "f32" }, shapes, st, c.m, c.seed)
}

#[test]
fn op_battery() {
    if h::in_child() {
        return;
    }
    let cases = op_cases();
    let start = Instant::now();
    let verdicts = h::supervise("battery_child_ops", "ops", cases.len(), Duration::from_secs(30));
    Summary::new("ops", &verdicts, |i| describe_op_case(&cases[i]), start.elapsed()).finish(TMP);
}

#[test]
fn battery_child_ops() {
    let Some(start) = h::child_start("ops") else { return };
    let cases = op_cases();
    h::child_loop(start, cases.len(), |i| run_op_case(&cases[i]));
}

// =====================================================================================
// 3. The `tessera` CLI
// =====================================================================================

/// The `tessera` binary of this workspace, built (release) on first use.
fn tessera_bin() -> &'static std::path::Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        // target/<profile>/deps/hardening-*  ->  target/<profile>/tessera
        let exe = std::env::current_exe().expect("the test binary");
        let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
        let bin = dir.join("tessera");
        let profile = dir.file_name().and_then(|n| n.to_str()).unwrap_or("release").to_string();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "-q", "-p", "tessera-cli"]).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        if profile == "release" {
            cmd.arg("--release");
        } else if profile != "debug" {
            cmd.args(["--profile", &profile]);
        }
        let status = cmd.status().expect("run cargo build -p tessera-cli");
        assert!(status.success() && bin.exists(), "cannot build the tessera CLI at {}", bin.display());
        bin
    })
    .as_path()
}

#[derive(Clone, Debug)]
struct CliCase {
    args: Vec<String>,
    /// Why it must fail (exit code 1 or 2 with a message), if it must.
    must_fail: Option<String>,
    /// A `run` that must succeed (exit 0) unless it gives a clear error.
    expect_ok: bool,
}

/// Ops whose default cases take seconds in the interpreter: `run` always gets small shapes.
fn heavy(op: &str) -> bool {
    matches!(op, "matmul" | "matmul_bwd" | "quantized_matmul" | "quantized_matmul_dx" | "gmm" | "gmm_bwd" | "cross_entropy" | "cross_entropy_bwd" | "cross_entropy_with_grad" | "flash_attention_fwd" | "flash_attention_bwd" | "flash_attention" | "splash_attention_fwd" | "splash_attention_bwd" | "splash_attention" | "ragged_paged_attention")
}

fn dims_text(s: &[usize]) -> String {
    s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

const BAD_SHAPES: &[(&str, bool)] = &[
    // (dims text, must fail)
    ("0x5", false),
    ("5x0", false),
    ("99999999999x99999999999", true),
    ("18446744073709551615x2", true),
    ("4294967296x4294967296", true),
    ("1099511627776x1024", true),
    ("-1x3", true),
    ("axb", true),
    ("", true),
    ("4x", true),
    ("x4", true),
    ("4xx4", true),
    ("4 x 4", true),
    ("+4x4", false),
    ("4.0x4", true),
    ("0x0", false),
    ("1", false),
    ("1x1x1x1x1", false),
    ("65536x1", false),
    ("1x65537", false),
];

fn cli_case(sub: u8, op_pick: u8, seed: u64, knobs: [u8; 8]) -> CliCase {
    let all = ops();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut args: Vec<String> = Vec::new();
    let mut must_fail: Vec<String> = Vec::new();
    let mut any = false; // the outcome may legitimately be an error or a success
    let sub = ["run", "run", "run", "run", "emit", "emit", "emit", "check", "list", "table", "table-ops", "bogus", "none", "help", "version", "run-all"][sub as usize % 16];
    match sub {
        "list" => return CliCase { args: vec!["list".into()], must_fail: None, expect_ok: false },
        "table" => {
            let d = ["bf16", "f32", "i32", "f64", ""][knobs[0] as usize % 5];
            let bad = !matches!(d, "bf16" | "f32");
            return CliCase { args: vec!["table".into(), "--dtype".into(), d.into()], must_fail: bad.then(|| format!("--dtype {d:?}")), expect_ok: false };
        }
        "table-ops" => return CliCase { args: vec!["table".into(), "--ops".into()], must_fail: None, expect_ok: false },
        "bogus" => return CliCase { args: vec![["frobnicate", "", "RUN", "run2"][knobs[0] as usize % 4].into()], must_fail: Some("unknown subcommand".into()), expect_ok: false },
        "none" => return CliCase { args: vec![], must_fail: Some("no subcommand".into()), expect_ok: false },
        "help" => return CliCase { args: vec![["--help", "run", "emit"][knobs[0] as usize % 3].into(), "--help".into()].into_iter().take(if knobs[0].is_multiple_of(3) { 1 } else { 2 }).collect(), must_fail: None, expect_ok: false },
        "version" => return CliCase { args: vec!["--version".into()], must_fail: None, expect_ok: false },
        _ => {}
    }
    let subcommand = if sub == "run-all" { "run" } else { sub };
    args.push(subcommand.into());
    // The op.
    let op = &all[op_pick as usize % all.len()];
    let src = source_of(op);
    let (mut shapes, st) = valid_call(op.name, &mut rng);
    let valid_op = match (sub, knobs[0] % 12) {
        ("run-all", _) => {
            // `run --all` runs every op: only with a bad flag, so it stops early.
            args.push("--all".into());
            args.extend(["--dtype".into(), "f64".into()]);
            must_fail.push("--all with --dtype f64".into());
            false
        }
        (_, 0) => {
            let bad = ["nope", "", "MATMUL", "matmul ", "flash-attention", "ß", "--", "softmax;rm"][knobs[1] as usize % 8];
            args.push(bad.into());
            must_fail.push(format!("unknown op {bad:?}"));
            false
        }
        ("emit", 1) => {
            args.push("--all".into());
            any = true;
            false
        }
        ("emit", 2) | ("run", 2) => false, // no op at all
        _ => {
            args.push(op.name.into());
            true
        }
    };
    if !valid_op && args.len() == 1 {
        must_fail.push("neither an op nor --all".into());
    }
    if valid_op {
        // The case: matching the statics (so a run stays small), sometimes wrong.
        let case_name = match op.name {
            "flash_attention_fwd" | "flash_attention" | "flash_attention_bwd" => {
                if shapes.len() > 6 || (shapes.len() == 5 && op.name != "flash_attention_bwd") {
                    "segmented"
                } else if st.contains("causal=True") {
                    "causal"
                } else {
                    "noncausal"
                }
            }
            _ => src.cases.first().map_or("default", |c| c.name),
        };
        match knobs[2] % 10 {
            0 => {
                let bad = ["nope", "", "DEFAULT", "alt2"][knobs[3] as usize % 4];
                args.extend(["--case".into(), bad.into()]);
                must_fail.push(format!("unknown case {bad:?}"));
            }
            1 if !heavy(op.name) => {} // every case of the op
            _ => args.extend(["--case".into(), case_name.into()]),
        }
        if case_name == "segmented" && !st.contains("causal=True") {
            // The segmented case is causal with a soft cap; keep the generated statics.
        }
        // The shapes: the valid small ones, one possibly malformed.
        let names: Vec<&str> = op.inputs.iter().map(|i| i.name).collect();
        let mut specs: Vec<String> = names.iter().zip(&shapes).map(|(n, s)| format!("{n}={}", dims_text(s))).collect();
        if heavy(op.name) || !knobs[4].is_multiple_of(3) {
            match knobs[5] % 12 {
                0..=2 => {
                    let i = rng.gen_range(0..specs.len());
                    let (text, fails) = BAD_SHAPES[rng.gen_range(0..BAD_SHAPES.len())];
                    specs[i] = format!("{}={text}", names[i]);
                    if fails {
                        must_fail.push(format!("--shape {}", specs[i]));
                    } else {
                        let parsed: Option<Vec<usize>> = text.split('x').map(|d| d.parse().ok()).collect();
                        match parsed {
                            Some(p) if p.contains(&0) => any = true,
                            Some(p) => {
                                shapes[i] = p;
                                if keeps_contract(op.name, &op.statics(&st).unwrap_or_else(|_| op.statics("").expect("defaults")), &shapes) {
                                    any = true;
                                } else {
                                    must_fail.push(format!("--shape {} (breaks the op's contract)", specs[i]));
                                }
                            }
                            None => any = true,
                        }
                    }
                }
                3 => {
                    let i = rng.gen_range(0..specs.len());
                    specs.push(specs[i].clone());
                    any = true; // a repeated --shape (the last one wins, or an error)
                }
                4 => {
                    specs.push(["nope=4x4", "=4x4", "x4x4", "q=8", "X=1x1"][rng.gen_range(0..5)].to_string());
                    if !specs.last().unwrap().starts_with("q=") || !names.contains(&"q") {
                        must_fail.push(format!("--shape {}", specs.last().unwrap()));
                    } else {
                        specs.pop();
                    }
                }
                5 => {
                    let i = rng.gen_range(0..specs.len());
                    let mut s = shapes[i].clone();
                    if rng.gen_bool(0.5) {
                        s.pop();
                    } else {
                        s.insert(0, 2);
                    }
                    specs[i] = format!("{}={}", names[i], dims_text(&s));
                    shapes[i] = s;
                    let statics = op.statics(&st).unwrap_or_else(|_| op.statics("").expect("defaults"));
                    if keeps_contract(op.name, &statics, &shapes) {
                        any = true;
                    } else {
                        must_fail.push(format!("--shape {} (a rank the op does not take)", specs[i]));
                    }
                }
                _ => {}
            }
            for s in specs {
                args.extend(["--shape".into(), s]);
            }
        }
        // Statics.
        match knobs[6] % 8 {
            0 => {
                let bad = ["nope=1", "causal=maybe", "eps=abc", "k=-1", "k=99999999999999999999", "eps=nan", "eps=inf", "tiling=[1, 2", "gate=\"relu\"", "tiling=[0, 0, 0]", "num_experts=-3", "pages_per_compute_block=0", "=", ",,,", "eps", "theta=1e999"][rng.gen_range(0..16)];
                let text = if st.is_empty() { bad.to_string() } else { format!("{st}, {bad}") };
                args.extend(["--statics".into(), text]);
                match bad {
                    ",,," => {
                        if !st.is_empty() {
                            any = true;
                        }
                    }
                    "theta=1e999" => any = true,
                    _ => match static_expect(op, bad) {
                        Expect2::Reject(why) => must_fail.push(format!("--statics {bad}: {why}")),
                        _ => any = true,
                    },
                }
            }
            _ if !st.is_empty() => args.extend(["--statics".into(), st.clone()]),
            _ => {}
        }
    }
    // dtype, target, seed, out.
    match knobs[7] % 6 {
        0 => {
            let d = ["i32", "f64", "", "F32", "float32", "bool"][rng.gen_range(0..6)];
            args.extend(["--dtype".into(), d.into()]);
            must_fail.push(format!("--dtype {d:?}"));
        }
        1 => args.extend(["--dtype".into(), "bf16".into()]),
        _ => {}
    }
    match rng.gen_range(0..6) {
        0 => {
            let t = ["v4", "", "TPU7X", "v5e ", "cpu"][rng.gen_range(0..5)];
            args.extend(["--target".into(), t.into()]);
            must_fail.push(format!("--target {t:?}"));
        }
        1 => args.extend(["--target".into(), Target::ALL[rng.gen_range(0..4)].name.into()]),
        _ => {}
    }
    if subcommand == "run" && rng.gen_bool(0.3) {
        let s = ["7", "-1", "99999999999999999999999", "x", "18446744073709551615"][rng.gen_range(0..5)];
        args.extend(["--seed".into(), s.into()]);
        if matches!(s, "-1" | "99999999999999999999999" | "x") {
            must_fail.push(format!("--seed {s}"));
        }
    }
    if subcommand == "emit" {
        let (out, bad) = match rng.gen_range(0..8) {
            0 => ("/proc/tessera-battery/out".to_string(), true),
            1 => ("/etc/passwd/out".to_string(), true),
            2 => ("/dev/null/out".to_string(), true),
            3 => (String::new(), true),
            _ => (format!("{TMP}/hardening-cli-emit/{seed}"), false),
        };
        args.extend(["--out".into(), out.clone()]);
        if bad {
            must_fail.push(format!("--out {out:?} (unwritable)"));
        }
    }
    if subcommand == "check" {
        // TESSERA_PYTHON points nowhere (set by the runner): the command must say so.
        must_fail.push("check without the venv".into());
    }
    let expect_ok = must_fail.is_empty() && !any && valid_op;
    CliCase { args, must_fail: must_fail.first().cloned(), expect_ok }
}

fn cli_cases() -> Vec<CliCase> {
    let s = (0u8..16, any::<u8>(), any::<u64>(), any::<[u8; 8]>()).prop_map(|(sub, op, seed, knobs)| cli_case(sub, op, seed, knobs));
    generate(s, scaled(1000), 3)
}

fn run_cli_case(c: &CliCase) -> Verdict {
    let bin = tessera_bin();
    let mut cmd = h::limited(bin, &c.args, h::CHILD_MEMORY_KIB);
    cmd.env("TESSERA_PYTHON", "/nonexistent/tessera-battery/python").env("RUST_BACKTRACE", "0").stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Verdict::fail("battery-bug", format!("cannot spawn the CLI: {e}")),
    };
    let (mut out, mut err) = (child.stdout.take().expect("stdout"), child.stderr.take().expect("stderr"));
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > Duration::from_secs(60) => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            _ => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let (stdout, stderr) = (t_out.join().unwrap_or_default(), t_err.join().unwrap_or_default());
    let Some(status) = status else { return Verdict::fail("hang", "no exit within 60 s (killed)") };
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        return Verdict::fail("abort", format!("killed by signal {sig} ({}); stderr: {}", h::signal_name(sig), first_line(&stderr)));
    }
    let code = status.code().unwrap_or(-1);
    if code == 101 || stderr.contains("panicked at") {
        let line = stderr.lines().find(|l| l.contains("panicked at")).map(String::from).unwrap_or_else(|| first_line(&stderr));
        let msg = stderr.lines().skip_while(|l| !l.contains("panicked at")).nth(1).unwrap_or("");
        return Verdict::fail("panic", format!("exit {code}: {line} {msg}"));
    }
    if !(0..=2).contains(&code) {
        return Verdict::fail("bad-exit-code", format!("exit code {code}; stderr: {}", first_line(&stderr)));
    }
    if code == 2 && stderr.trim().is_empty() {
        return Verdict::fail("no-message", "exit code 2 with nothing on stderr");
    }
    if code == 1 {
        let fail = stdout.lines().find(|l| l.contains("FAIL")).unwrap_or("").trim().to_string();
        return match &c.must_fail {
            Some(why) if fail.is_empty() => Verdict::pass("clean-error", format!("exit 1 ({why})")),
            Some(why) => Verdict::fail("accepted-invalid", format!("{why}: ran and reported {fail}")),
            None => Verdict::fail("run-reported-FAIL", if fail.is_empty() { format!("exit 1; stderr: {}", first_line(&stderr)) } else { fail }),
        };
    }
    if code == 0 {
        if let Some(why) = &c.must_fail {
            return Verdict::fail("accepted-invalid", format!("exit 0 for {why}; stdout: {}", stdout.lines().nth(1).unwrap_or("").trim()));
        }
        return Verdict::pass("ok", "");
    }
    // exit 2: a clear message on stderr.
    let text = stderr.trim();
    if text.starts_with("error[") {
        let rule = text.trim_start_matches("error[").split(']').next().unwrap_or("");
        if rule.is_empty() || !text.contains("kernel `") {
            return Verdict::fail("unclear-error", first_line(text));
        }
        if matches!(rule, "plan-consistency" | "malformed-ir") || text.contains("report this as a Tessera bug") {
            return Verdict::fail("internal-error", first_line(text));
        }
        return Verdict::pass(if c.expect_ok { "rejected-valid" } else { "clean-error" }, rule.to_string());
    }
    Verdict::pass(if c.expect_ok { "rejected-valid" } else { "clean-error" }, first_line(text).chars().filter(|c| !c.is_ascii_digit()).take(60).collect::<String>())
}

fn shell_quote(args: &[String]) -> String {
    args.iter().map(|a| if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "\"'$;&|<>*?()[]{}\\".contains(c)) { format!("'{}'", a.replace('\'', "'\\''")) } else { a.clone() }).collect::<Vec<_>>().join(" ")
}

#[test]
fn cli_battery() {
    if h::in_child() {
        return;
    }
    h::quiet_panics();
    let cases = cli_cases();
    let _ = tessera_bin();
    let start = Instant::now();
    // A worker per core: each CLI process is single-threaded.
    let verdicts: Vec<Verdict> = tessera_tests::par_map(&cases, run_cli_case);
    let _ = std::fs::remove_dir_all(format!("{TMP}/hardening-cli-emit"));
    Summary::new("cli", &verdicts, |i| format!("tessera {}{}", shell_quote(&cases[i].args), cases[i].must_fail.as_ref().map_or(String::new(), |w| format!("   [must fail: {w}]"))), start.elapsed()).finish(TMP);
}

// =====================================================================================
// 4. The issue's examples, as named regression tests
// =====================================================================================

/// A test whose body runs in a supervised child (an abort, a signal or a hang fails the
/// test instead of ending the run).
macro_rules! isolated_test {
    ($(#[$m:meta])* $name:ident, $secs:expr, $body:block) => {
        $(#[$m])*
        #[test]
        fn $name() {
            if std::env::var_os(h::CHILD_ENV).is_some() {
                return;
            }
            h::isolated(stringify!($name), Duration::from_secs($secs), || $body);
        }
    };
}

/// Runs the CLI with `args`: (exit code, stdout, stderr); a signal is a test failure.
fn cli(args: &[&str]) -> (i32, String, String) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = h::limited(tessera_bin(), &args, h::CHILD_MEMORY_KIB).env("RUST_BACKTRACE", "0").output().expect("run the CLI");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = out.status.signal() {
        panic!("`tessera {}` was killed by signal {sig} ({}):\n{stderr}", args.join(" "), h::signal_name(sig));
    }
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

/// A CLI call that must fail with a clear message (exit 2, no panic) mentioning `needles`.
fn cli_rejects(args: &[&str], needles: &[&str]) {
    let (code, stdout, stderr) = cli(args);
    assert!(!stderr.contains("panicked"), "`tessera {}` panicked:\n{stderr}", args.join(" "));
    assert_eq!(code, 2, "`tessera {}` must fail with a message (exit 2), got exit {code}\nstdout: {stdout}\nstderr: {stderr}", args.join(" "));
    for n in needles {
        assert!(stderr.contains(n), "`tessera {}`: the message should mention `{n}`:\n{stderr}", args.join(" "));
    }
}

/// An error that names its kernel/op, subject and rule: returns it.
fn clear(r: Result<impl std::fmt::Debug, KernelError>, what: &str) -> KernelError {
    match r {
        Ok(v) => panic!("{what}: accepted (expected a clear error), got {}", format!("{v:?}").chars().take(200).collect::<String>()),
        Err(e) => {
            if let Err(why) = h::clear_error(&e) {
                panic!("{what}: {why}");
            }
            assert!(!h::is_internal(&e), "{what}: an internal rule for a user error: {e}");
            e
        }
    }
}

/// Runs `op` on `inputs` (statics `statics`, v6e): must be a clear error.
fn op_rejects(op: &str, inputs: &[Array], statics: &str, what: &str) -> KernelError {
    let r = tessera_kernels::run(&Interpreter, op, &inputs.iter().collect::<Vec<_>>(), statics, &Target::V6E);
    clear(r.map(|o| o.iter().map(|a| a.shape.clone()).collect::<Vec<_>>()), &format!("{op}: {what}"))
}

/// The op's valid random inputs for `shapes` (f32).
fn inputs_of(op: &str, shapes: &[&[usize]], statics: &str, seed: u64) -> Vec<Array> {
    let op = tessera_kernels::find(op).expect("op");
    let shapes: Vec<Vec<usize>> = shapes.iter().map(|s| s.to_vec()).collect();
    harness::inputs_for(source_of(op), &shapes, DType::F32, &op.statics(statics).expect("statics"), &mut StdRng::seed_from_u64(seed))
}

/// Runs op `name` on valid random inputs of `shapes` and checks every result against the
/// op's reference (`Err` with what went wrong).
fn run_valid(name: &str, shapes: &[Vec<usize>], statics: &str, dtype: DType, target: &Target, seed: u64) -> Result<(), String> {
    let op = tessera_kernels::find(name).ok_or("no such op")?;
    let st = op.statics(statics).map_err(|e| e.to_string())?;
    let inputs = harness::inputs_for(source_of(op), shapes, dtype, &st, &mut StdRng::seed_from_u64(seed));
    let refs: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
    let out = op.run(&Interpreter, &refs, &st, target).map_err(|e| e.to_string())?;
    let mut want = (source_of(op).reference.ok_or("no reference")?)(&inputs, &st);
    if let Some((_, i)) = op.alias_of {
        want = want.into_iter().skip(i).take(1).collect();
    }
    for (j, (g, w)) in out.iter().zip(&want).enumerate() {
        let tol = if dtype == DType::BF16 { 2e-2 } else { harness::tolerance(g.dtype) };
        compare(g, w, tol).map_err(|e| format!("output {j}: {e}"))?;
    }
    Ok(())
}

// ---- the CLI (issue class 4) ----

#[test]
fn regression_cli_matmul_rank1_shape() {
    // Was: index out of bounds in the kernel's host code.
    cli_rejects(&["run", "matmul", "--shape", "x=1024"], &["matmul", "`x`"]);
}

#[test]
fn regression_cli_usize_overflowing_shapes() {
    // Was: a panic in the interpreter; `emit` wrote files with GFLOP 0.000 and VMEM 0.00 MiB.
    for sub in ["run", "emit"] {
        let out = format!("{TMP}/hardening-regression-emit-{sub}");
        let _ = std::fs::remove_dir_all(&out);
        for shape in ["x=18446744073709551615x2", "x=4294967296x4294967296", "x=4294967297x4294967295"] {
            let mut args = vec![sub, "softmax", "--shape", shape];
            if sub == "emit" {
                args.extend(["--out", out.as_str()]);
            }
            cli_rejects(&args, &["softmax"]);
        }
        let written = std::fs::read_dir(&out).map(|d| d.count()).unwrap_or(0);
        assert_eq!(written, 0, "`tessera {sub}` wrote {written} files for shapes that cannot exist");
    }
}

#[test]
fn regression_cli_terabyte_shapes() {
    // Was: `memory allocation of ... failed` and SIGABRT.
    cli_rejects(&["run", "softmax", "--shape", "x=1048576x1048576"], &["softmax"]);
    cli_rejects(&["run", "matmul", "--shape", "x=1048576x1048576", "--shape", "y=1048576x1048576"], &["matmul"]);
    cli_rejects(&["run", "permute_bwd", "--shape", "dout=8x1", "--shape", "expert_ids=1099511627776x1024", "--statics", "num_experts=5"], &["permute_bwd"]);
}

#[test]
fn regression_cli_shape_overrides_are_used_or_rejected() {
    // `tessera run` printed `ok` for labels of shape [2^64 - 1, 2] (it ran with labels of
    // the logits' rows): a --shape must be used as given, or rejected.
    cli_rejects(&["run", "cross_entropy", "--shape", "logits=46x1432", "--shape", "labels=18446744073709551615x2"], &["labels"]);
    cli_rejects(&["run", "cross_entropy", "--shape", "logits=15x22", "--shape", "labels=2x15"], &["labels"]);
}

// ---- the builder (issue class 5) ----

fn row_kernel(name: &str, n: usize) -> (KernelBuilder, RefId, RefId) {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Parallel)]);
    let spec = || BlockSpec { block_shape: vec![Some(8), Some(n)], index_map: vec![IndexExpr::Grid(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[16, n], spec());
    let out = b.output("out", DType::F32, &[16, n], spec());
    (b, x, out)
}

#[test]
fn regression_store_broadcast_is_an_error() {
    // Was: a store of a [bm, 1] value into a [bm, n] block broadcast silently.
    let (mut b, x, out) = row_kernel("store_broadcast", 128);
    let v = b.load(x, &[]);
    let s = b.reduce(ReduceOp::Sum, v, 1);
    b.store(out, &[], s);
    let e = clear(b.finish(), "storing f32[8,1] into an [8, 128] block");
    assert!(e.to_string().contains("out"), "the error should name the output: {e}");
}

#[test]
fn regression_weak_literals_out_of_range() {
    // Was: `full(.., i8, 300)` gave 44, 3_000_000_000 wrapped as i32, 1e39 became inf.
    let mut b = KernelBuilder::new("i8_300");
    b.grid(&[(1, Semantics::Parallel)]);
    b.full(&[32, 128], DType::I8, 300i64);
    clear(b.finish(), "full(.., i8, 300)");

    let mut b = KernelBuilder::new("i32_3e9");
    b.grid(&[(1, Semantics::Parallel)]);
    let p = b.program_id(0);
    b.add(p, 3_000_000_000usize);
    clear(b.finish(), "program_id + 3_000_000_000usize (an i32 weak literal)");

    let mut b = KernelBuilder::new("f32_1e39");
    b.grid(&[(1, Semantics::Parallel)]);
    b.full(&[8, 128], DType::F32, 1e39);
    clear(b.finish(), "full(.., f32, 1e39)");

    let (mut b, x, out) = row_kernel("f32_weak_1e39", 128);
    let v = b.load(x, &[]);
    let y = b.mul(v, 1e39);
    b.store(out, &[], y);
    clear(b.finish(), "x * 1e39 (an f32 weak literal)");
}

isolated_test!(
    /// Was: the interpreter ran kernels the verifier rejects on every target.
    regression_interpreter_rejects_unverifiable_kernels, 60, {
    // An output block never written (output-coverage): the interpreter left poison.
    let mut b = KernelBuilder::new("uncovered");
    b.grid(&[(1, Semantics::Parallel)]);
    let spec = |map: Vec<IndexExpr>| BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: map };
    let x = b.input("x", DType::F32, &[16, 128], spec(vec![IndexExpr::Grid(0), IndexExpr::Const(0)]));
    let out = b.output("out", DType::F32, &[16, 128], spec(vec![IndexExpr::Grid(0), IndexExpr::Const(0)]));
    let v = b.load(x, &[]);
    b.store(out, &[], v);
    let k = b.finish().expect("builds");
    for t in Target::ALL {
        assert!(tessera_dsl::verify::verify(&k, &t).is_err(), "{t} accepts an uncovered output");
    }
    let x = Array::from_f32(&[16, 128], vec![1.0; 2048]);
    clear(interp::run(&k, &[&x]), "interp::run of a kernel that leaves half its output unwritten");
    // A grid of 0 steps.
    let (mut b, x, out) = row_kernel("zero_grid", 128);
    b.grid(&[(0, Semantics::Parallel)]);
    let v = b.load(x, &[]);
    b.store(out, &[], v);
    let k = b.finish().expect("builds");
    let x = Array::from_f32(&[16, 128], vec![1.0; 2048]);
    clear(interp::run(&k, &[&x]), "interp::run of a kernel with a 0-step grid");
});

#[test]
fn regression_grid_beyond_program_id_range() {
    // Grids are bounded by the i32 range of program_id.
    for extent in [1usize << 31, (1 << 32) + 1, usize::MAX] {
        let mut b = KernelBuilder::new("huge_grid");
        b.grid(&[(extent, Semantics::Arbitrary)]);
        let spec = || BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] };
        let x = b.input("x", DType::F32, &[8, 128], spec());
        let out = b.output("out", DType::F32, &[8, 128], spec());
        let v = b.load(x, &[]);
        b.store(out, &[], v);
        let k = b.finish();
        if let Ok(k) = k {
            for t in Target::ALL {
                clear(tessera_dsl::verify::verify(&k, &t), &format!("verify on {t} of a grid of {extent} steps"));
            }
        }
    }
}

#[test]
fn regression_operands_bounded_by_hbm() {
    // Operands bounded by the target's HBM (a verifier rule).
    for shape in [vec![1usize << 40, 128], vec![1 << 33, 1 << 10], vec![usize::MAX / 2, 4]] {
        let mut b = KernelBuilder::new("huge_operand");
        b.grid(&[(1, Semantics::Parallel)]);
        let x = b.input("x", DType::F32, &shape, BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] });
        let out = b.output("out", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] });
        let v = b.load(x, &[]);
        b.store(out, &[], v);
        if let Ok(k) = b.finish() {
            for t in Target::ALL {
                clear(tessera_dsl::verify::verify(&k, &t), &format!("verify on {t} of an input {shape:?} f32"));
            }
        }
    }
}

isolated_test!(
    /// Was: a panic in the interpreter for shapes whose element count overflows usize, and an
    /// abort for a scratch buffer of terabytes.
    regression_interpreter_huge_shapes, 60, {
    // An operand of 2^64 elements, a tiny array passed for it.
    let mut b = KernelBuilder::new("overflowing_input");
    b.grid(&[(1, Semantics::Parallel)]);
    let spec = || BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[1 << 32, 1 << 32], spec());
    let out = b.output("out", DType::F32, &[8, 128], spec());
    let v = b.load(x, &[]);
    b.store(out, &[], v);
    if let Ok(k) = b.finish() {
        let x = Array::from_f32(&[8, 128], vec![0.0; 1024]);
        clear(interp::run(&k, &[&x]), "interp::run of a kernel whose input has 2^64 elements");
    }
    // A 4 TiB VMEM scratch with small operands: an error, never an allocation.
    let (mut b, x, out) = row_kernel("terabyte_scratch", 128);
    let acc = b.scratch("acc", DType::F32, &[1 << 20, 1 << 20], MemorySpace::Vmem);
    let v = b.load(x, &[]);
    b.store(acc, &[ds(0, 8), ds(0, 128)], v);
    b.store(out, &[], v);
    if let Ok(k) = b.finish() {
        let x = Array::from_f32(&[16, 128], vec![0.0; 2048]);
        clear(interp::run(&k, &[&x]), "interp::run of a kernel with a 4 TiB scratch buffer");
    }
});

isolated_test!(
    /// Was: `memory allocation ... failed` (SIGABRT) when an op's outputs were terabytes.
    regression_op_terabyte_outputs, 60, {
    let op = tessera_kernels::find("softmax").unwrap();
    let x = lying(DType::F32, &[1 << 20, 1 << 20]);
    clear(op.run(&Interpreter, &[Some(&x)], &op.statics("").unwrap(), &Target::V6E).map(|o| o.len()), "softmax of a [2^20, 2^20] (4 TiB) array");
    let types = vec![Some(Type::vector(DType::F32, &[1 << 20, 1 << 20]))];
    for t in Target::ALL {
        clear(op.plan_for(&types, &op.statics("").unwrap(), &t).and_then(|p| p.launches.iter().try_for_each(|l| tessera_dsl::verify::verify(&l.kernel, &t))), &format!("plan + verify of softmax [2^20, 2^20] on {t}"));
    }
});

// ---- metadata (issue class 2) ----

#[test]
fn regression_gmm_group_sizes() {
    let base = inputs_of("gmm", &[&[64, 128], &[4, 128, 128], &[4]], "", 1);
    for (sizes, what) in [
        (vec![i32::MAX, i32::MAX, 66, 0], "group sizes whose i32 sum wraps to m (2^32 + 64)"),
        (vec![-1, 33, 16, 16], "a negative group size"),
        (vec![16, 16, 16, 15], "group sizes summing to m - 1"),
        (vec![16, 16, 16, 17], "group sizes summing to m + 1"),
        (vec![i32::MAX, 0, 0, 0], "a group size of 2^31 - 1"),
    ] {
        let mut a = base.clone();
        a[2] = Array::from_i32(&[4], sizes);
        op_rejects("gmm", &a, "", what);
        op_rejects("tgmm", &[a[0].clone(), Array::from_f32(&[64, 128], vec![0.5; 64 * 128]), a[2].clone()], "", what);
    }
}

#[test]
fn regression_routing_expert_ids() {
    let base = inputs_of("permute", &[&[16, 128], &[16, 2]], "num_experts=5", 1);
    for bad in [5, -1, i32::MAX, i32::MIN] {
        let mut a = base.clone();
        set_i32(&mut a[1], 3, bad);
        op_rejects("permute", &a, "num_experts=5", &format!("an expert id of {bad} with 5 experts"));
    }
}

#[test]
fn regression_paged_attention_lengths_and_pages() {
    // q [2, 4, 128], 2 kv heads, 4 pages of 16 tokens, 2 pages per sequence: capacity 32.
    let base = inputs_of("paged_attention", &[&[2, 4, 128], &[2, 4, 16, 128], &[2, 4, 16, 128], &[2], &[2, 2]], "", 3);
    for (len, what) in [(33, "a length beyond pages_per_seq * page_size"), (-1, "a negative length"), (i32::MAX, "a length of 2^31 - 1"), (i32::MIN, "a length of -2^31")] {
        let mut a = base.clone();
        a[3] = Array::from_i32(&[2], vec![len, 5]);
        op_rejects("paged_attention", &a, "", what);
    }
    for (page, what) in [(4, "a page index == num_pages"), (-1, "a negative page index"), (i32::MAX, "a page index of 2^31 - 1")] {
        let mut a = base.clone();
        a[3] = Array::from_i32(&[2], vec![20, 5]);
        a[4] = Array::from_i32(&[2, 2], vec![0, page, 1, 2]);
        op_rejects("paged_attention", &a, "", what);
    }
}

#[test]
fn regression_ragged_paged_attention_metadata() {
    // 3 sequences of at most 2 pages of 16 tokens; T = 24 tokens.
    let shapes: &[&[usize]] = &[&[24, 4, 128], &[2, 6, 16, 128], &[2, 6, 16, 128], &[3], &[3, 2], &[4], &[1]];
    let base = inputs_of("ragged_paged_attention", shapes, "sm_scale=0.08838834764831845", 5);
    let valid = |a: &mut Vec<Array>| {
        // seq 0: 8 prefill tokens of 8; seq 1: 1 decode token of 20; seq 2: 10 of 30.
        a[3] = Array::from_i32(&[3], vec![8, 20, 30]);
        a[4] = Array::from_i32(&[3, 2], vec![0, 1, 2, 3, 4, 5]);
        a[5] = Array::from_i32(&[4], vec![0, 8, 9, 19]);
        a[6] = Array::from_i32(&[1], vec![3]);
    };
    let mut ok = base.clone();
    valid(&mut ok);
    tessera_kernels::run(&Interpreter, "ragged_paged_attention", &ok.iter().collect::<Vec<_>>(), "sm_scale=0.08838834764831845", &Target::V6E).expect("the valid metadata runs");
    let cases: Vec<(usize, Vec<i32>, &str)> = vec![
        (5, vec![0, 9, 8, 19], "non-monotone cu_q_lens"),
        (5, vec![0, 8, 9, 25], "cu_q_lens beyond the 24 tokens"),
        (5, vec![1, 8, 9, 19], "cu_q_lens[0] != 0"),
        (5, vec![0, -8, 9, 19], "a negative cu_q_lens entry"),
        (3, vec![8, 20, 33], "a kv_len beyond pages_per_seq * page_size (32)"),
        (3, vec![8, -1, 30], "a negative kv_len"),
        (3, vec![8, 20, 5], "q_len (10) > kv_len (5)"),
        (6, vec![4], "num_seqs above max_seqs (3)"),
        (6, vec![-1], "a negative num_seqs"),
        (6, vec![i32::MAX], "num_seqs of 2^31 - 1"),
        (4, vec![0, 1, 2, 3, 4, 6], "a page index == num_pages in a used page"),
        (4, vec![0, 1, -1, 3, 4, 5], "a negative page index in a used page"),
    ];
    for (at, values, what) in cases {
        let mut a = ok.clone();
        a[at] = Array::from_i32(&a[at].shape.clone(), values);
        op_rejects("ragged_paged_attention", &a, "sm_scale=0.08838834764831845", what);
    }
}

#[test]
fn regression_cross_entropy_labels() {
    // torch raises for labels >= vocab or -1, and ignores only ignore_index (default -100).
    let base = inputs_of("cross_entropy", &[&[8, 100], &[8]], "", 2);
    for (label, what) in [(100, "a label == vocab"), (1000, "a label > vocab"), (-1, "a label of -1"), (i32::MIN, "a label of -2^31")] {
        let mut a = base.clone();
        set_i32(&mut a[1], 2, label);
        for op in ["cross_entropy", "cross_entropy_with_grad"] {
            op_rejects(op, &a, "", what);
        }
    }
    let mut a = base.clone();
    set_i32(&mut a[1], 2, -100);
    let out = tessera_kernels::run(&Interpreter, "cross_entropy", &a.iter().collect::<Vec<_>>(), "", &Target::V6E).expect("label -100 (ignore_index) runs");
    assert_eq!(out[0].to_f64_vec()[2], 0.0, "an ignored label has loss 0");
    // `ignore_index` is an argument of torch's cross_entropy: it should be one here.
    let op = tessera_kernels::find("cross_entropy").unwrap();
    assert!(has_static(op, "ignore_index"), "cross_entropy has no `ignore_index` argument: {}", op.schema);
}

// ---- numerics (issue class 3) ----

/// q, k, v [1, 1, 8, 128] of small random values.
fn attention_inputs() -> Vec<Array> {
    let mut rng = StdRng::seed_from_u64(9);
    (0..3).map(|_| Array::from_f32(&[1, 1, 8, 128], harness::uniform(1024, 1.0, &mut rng))).collect()
}

fn row_nan(o: &Array, row: usize) -> (usize, usize) {
    let v = o.to_f64_vec();
    let r = &v[row * 128..(row + 1) * 128];
    (r.iter().filter(|x| x.is_nan()).count(), r.len())
}

fn flash(a: &[Array], statics: &str) -> Array {
    tessera_kernels::run(&Interpreter, "flash_attention_fwd", &a.iter().collect::<Vec<_>>(), statics, &Target::V6E).expect("flash attention runs").remove(0)
}

#[test]
fn regression_flash_attention_nan_in_q_and_visible_k() {
    // torch gives NaN: a NaN in q row 3 makes that row's scores NaN; a NaN in key 2 makes
    // the scores of every row that sees key 2 NaN.
    let mut a = attention_inputs();
    if let Data::F32(q) = &mut a[0].data {
        q[3 * 128] = f32::NAN;
    }
    let o = flash(&a, "causal=False");
    assert_eq!(row_nan(&o, 3), (128, 128), "NaN in q row 3: o row 3 must be NaN (torch), got {:?} NaN", row_nan(&o, 3));
    let mut a = attention_inputs();
    if let Data::F32(k) = &mut a[1].data {
        k[2 * 128 + 5] = f32::NAN;
    }
    let o = flash(&a, "causal=True");
    for row in 0..8 {
        let want = if row >= 2 { 128 } else { 0 };
        assert_eq!(row_nan(&o, row).0, want, "NaN in key 2 (causal): row {row} sees it: {}", row >= 2);
    }
}

#[test]
fn regression_flash_attention_nan_in_masked_v_stays_masked() {
    // Masking must select, not multiply by zero: a NaN in v at a position no query of a
    // row sees must not reach that row.
    let mut a = attention_inputs();
    if let Data::F32(v) = &mut a[2].data {
        v[6 * 128 + 1] = f32::NAN;
    }
    let o = flash(&a, "causal=True");
    for row in 0..6 {
        assert_eq!(row_nan(&o, row).0, 0, "causal row {row} does not see v[6] but has NaN");
    }
    assert!(row_nan(&o, 6).0 > 0 && row_nan(&o, 7).0 > 0, "rows 6 and 7 see v[6]: NaN");
}

#[test]
fn regression_layernorm_large_mean() {
    // Rows of a constant 100.3: (x - mean) is exactly 0 and the output exactly the bias
    // (torch's error 0; a one-pass variance gave errors up to 0.06).
    let (r, n) = (16, 1024);
    let x = Array::from_f32(&[r, n], vec![100.3; r * n]);
    let w = Array::from_f32(&[n], vec![1.0; n]);
    let b = Array::from_f32(&[n], (0..n).map(|i| i as f32 / n as f32).collect());
    let out = tessera_kernels::run1(&Interpreter, "layernorm", &[&x, &w, &b], "", &Target::V6E).expect("layernorm runs");
    let err = out.to_f64_vec().iter().zip(b.to_f64_vec().iter().cycle()).map(|(o, b)| (o - b).abs()).fold(0.0, f64::max);
    assert!(err <= 1e-6, "layernorm of constant rows 100.3: max error {err:.3e} (torch: 0)");
    // Random rows of mean 1e4 (std 1): within 4x of an f32 two-pass layernorm's error.
    let mut rng = StdRng::seed_from_u64(4);
    let xs: Vec<f32> = (0..r * n).map(|_| 1e4 + rng.gen_range(-1.7f32..1.7)).collect();
    let x = Array::from_f32(&[r, n], xs.clone());
    let out = tessera_kernels::run1(&Interpreter, "layernorm", &[&x, &w, &b], "", &Target::V6E).expect("layernorm runs").to_f64_vec();
    let (mut worst, mut worst_f32) = (0.0f64, 0.0f64);
    for (row, xr) in xs.chunks(n).enumerate() {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let mean32 = xr.iter().sum::<f32>() / n as f32;
        let var32 = xr.iter().map(|&v| (v - mean32) * (v - mean32)).sum::<f32>() / n as f32;
        for (j, &v) in xr.iter().enumerate() {
            let want = (v as f64 - mean) / (var + 1e-5).sqrt() + b.to_f64_vec()[j];
            let f32_two_pass = ((v - mean32) / (var32 + 1e-5).sqrt() + b.to_f32_vec()[j]) as f64;
            worst = worst.max((out[row * n + j] - want).abs());
            worst_f32 = worst_f32.max((f32_two_pass - want).abs());
        }
    }
    assert!(worst <= 4.0 * worst_f32.max(1e-7), "layernorm at mean 1e4: max error {worst:.3e}, an f32 two-pass layernorm {worst_f32:.3e}");
}

#[test]
fn regression_softmax_wide_rows() {
    // Softmax's f32 error grew with the row width (1e-5 at 4097, 2.3e-5 at 16384; torch
    // 1.5e-7): within 4x of a straightforward f32 softmax (max, exp, pairwise sum).
    for n in [4097usize, 16384, 65536] {
        let mut rng = StdRng::seed_from_u64(n as u64);
        let xs: Vec<f32> = (0..2 * n).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
        let x = Array::from_f32(&[2, n], xs.clone());
        let out = tessera_kernels::run1(&Interpreter, "softmax", &[&x], "", &Target::V6E).unwrap_or_else(|e| panic!("softmax [2, {n}]: {e}")).to_f64_vec();
        let (mut worst, mut worst_f32) = (0.0f64, 0.0f64);
        for (row, xr) in xs.chunks(n).enumerate() {
            let m = xr.iter().cloned().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let s: f64 = xr.iter().map(|&v| (v as f64 - m).exp()).sum();
            let m32 = xr.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e32: Vec<f32> = xr.iter().map(|&v| (v - m32).exp()).collect();
            fn pairwise(v: &[f32]) -> f32 {
                if v.len() <= 8 { v.iter().sum() } else { let (a, b) = v.split_at(v.len() / 2); pairwise(a) + pairwise(b) }
            }
            let s32 = pairwise(&e32);
            for (j, &v) in xr.iter().enumerate() {
                let want = (v as f64 - m).exp() / s;
                worst = worst.max((out[row * n + j] - want).abs());
                worst_f32 = worst_f32.max(((e32[j] / s32) as f64 - want).abs());
            }
        }
        assert!(worst <= 4.0 * worst_f32.max(1e-12), "softmax [2, {n}]: max abs error {worst:.3e}, an f32 pairwise softmax {worst_f32:.3e}");
    }
}

// ---- layouts (issue class 6) ----

/// The row ops and the shapes of their inputs for rows `[r.., n]`.
fn row_op_shapes(op: &str, x: &[usize]) -> Vec<Vec<usize>> {
    let n = vec![*x.last().unwrap()];
    let x = x.to_vec();
    match op {
        "softmax" => vec![x],
        "rmsnorm" => vec![x, n],
        "layernorm" | "gelu_affine" => vec![x, n.clone(), n],
        "rmsnorm_residual" => vec![x.clone(), x, n],
        "rmsnorm_bwd" => vec![x.clone(), n, x],
        "rmsnorm_residual_bwd" => vec![x.clone(), n, x.clone(), x],
        "swiglu" | "geglu" => vec![x.clone(), x],
        _ => vec![x.clone(), x.clone(), x],
    }
}

const ROW_OPS: &[&str] = &["softmax", "rmsnorm", "layernorm", "gelu_affine", "rmsnorm_residual", "rmsnorm_bwd", "rmsnorm_residual_bwd", "swiglu", "geglu", "swiglu_bwd", "geglu_bwd"];

isolated_test!(
    /// Was: `softmax(randn(65536, 2))` (512 KiB) failed with `vmem-budget ... needs 128.00 MiB`:
    /// the row rule ignored lane padding (2 -> 128).
    regression_softmax_65536x2, 120, {
    for t in Target::ALL {
        run_valid("softmax", &[vec![65536, 2]], "", DType::F32, &t, 1).unwrap_or_else(|e| panic!("softmax [65536, 2] on {t}: {e}"));
    }
});

isolated_test!(
    /// Every row op works on [65536, 1], [65536, 2], [65536, 8] and [1, 1 << 20].
    regression_row_ops_narrow_and_wide_rows, 600, {
    let mut failures = Vec::new();
    for op in ROW_OPS {
        for x in [vec![65536usize, 1], vec![65536, 2], vec![65536, 8], vec![1, 1 << 20]] {
            let shapes = row_op_shapes(op, &x);
            // The plan verifies on every target; it runs (and matches) on v6e, torch's default.
            let o = tessera_kernels::find(op).unwrap();
            let types: Vec<Option<Type>> = shapes.iter().map(|s| Some(Type::vector(DType::F32, s))).collect();
            for t in Target::ALL {
                if let Err(e) = o.plan_for(&types, &o.statics("").unwrap(), &t).and_then(|p| p.launches.iter().try_for_each(|l| tessera_dsl::verify::verify(&l.kernel, &t))) {
                    failures.push(format!("{op} {x:?} on {t}: {}", first_line(&e.to_string())));
                }
            }
            if let Err(e) = run_valid(op, &shapes, "", DType::F32, &Target::V6E, 7) {
                failures.push(format!("{op} {x:?} run on v6e: {}", first_line(&e)));
            }
        }
    }
    assert!(failures.is_empty(), "{} row-op shapes fail:\n  {}", failures.len(), failures.join("\n  "));
});
