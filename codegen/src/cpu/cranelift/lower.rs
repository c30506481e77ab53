//! Block IR -> Cranelift IR: the body of one grid step as one function
//! `step(ctx: *mut StepCtx) -> i32`.
//!
//! # How values are kept
//!
//! - Scalars (rank 0) are SSA registers, computed where the IR computes them.
//! - A vector value is either *materialised* into a slot of the frame (row-major, 4 bytes
//!   an element: f32 for floats, i32 for integers, an all-ones/zero i32 mask for bools), or
//!   *fused*: computed element by element inside the loop nest of its consumer, so no block
//!   is written for it. An elementwise op with a single consumer in the same IR block is
//!   fused into that consumer when the consumer is elementwise, a store, a reduction or a
//!   yield. Constants, iotas and broadcasts of scalars or of materialised values are
//!   recomputed at every use. Loads are fused into their consumers when no write to the
//!   same ref comes between the load and the consumer's loop (then they are reads of
//!   memory at the consumer). Everything else is materialised: reductions, dots,
//!   transposes, reshapes (an alias of the operand's slot), loop-carried vectors, `if`
//!   results, and values used by several consumers or in nested blocks.
//! - A fused loop nest walks the consumer's shape with the last dim innermost, four lanes
//!   at a time (f32x4 / i32x4), [`UNROLL`] chunks an iteration, evaluated together
//!   (`eval_n`: every chunk's loads before any chunk's store, so `interleave` can alternate
//!   their chains), with a partial vector at the end of a row.
//!   Every op has one vector implementation, also used for partial vectors and (on a
//!   splat) for scalars, so an element's value never depends on where it was computed.
//!
//! Anything the lowering does not support returns [`Unsupported`] and the kernel runs on
//! the interpreter instead (see [`crate::cpu`]).

// Loop bodies are `&mut dyn FnMut(&mut Self, ...)` so emitters can nest without boxing.
#![allow(clippy::type_complexity)]

use std::collections::HashMap;

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, F64, I32, I32X4, I64, I8};
use cranelift_codegen::ir::{Block as CB, BlockArg, Endianness, FuncRef, InstBuilder, MemFlagsData, StackSlotData, StackSlotKind, Type as CT, Value as CV};
use cranelift_frontend::FunctionBuilder;
use half::bf16;
use tessera_dsl::{BinaryOp, BlockId, CmpOp, DType, Inst, InstId, Kernel, MemorySpace, ReduceOp, RefId, RefKind, Scalar, Slice, UnaryOp, Value, ValueDef};

use super::vector::{self as vx, fsplat, isplat, mflags, vselect};
use crate::cpu::layout::{DmaSite, RefLayout, SliceSite, Sites};
use crate::cpu::runtime::{CTX_FRAME, CTX_GRID, CTX_REFS, CTX_RT};

/// Why a kernel cannot be compiled (it then runs on the interpreter).
#[derive(Debug, Clone)]
pub struct Unsupported(pub String);

type R<T> = Result<T, Unsupported>;

fn unsupported<T>(msg: impl Into<String>) -> R<T> {
    Err(Unsupported(msg.into()))
}

/// The functions compiled code calls.
pub struct Helpers {
    pub fail_slice: FuncRef,
    pub dma: FuncRef,
    pub dot_f32: FuncRef,
    pub dot_i32: FuncRef,
    pub fmod: FuncRef,
    pub pow: FuncRef,
    pub i2bf: FuncRef,
    pub exp: FuncRef,
    pub log: FuncRef,
    pub tanh: FuncRef,
    pub erf: FuncRef,
    pub dot_bf16: FuncRef,
    pub log1p: FuncRef,
    pub expm1: FuncRef,
    pub sin: FuncRef,
    pub cos: FuncRef,
    pub cumsum: FuncRef,
    pub prng_seed: FuncRef,
    pub prng_bits: FuncRef,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum How {
    Scalar,
    /// Computed inside its single consumer's loop.
    Fused,
    /// Recomputed at every use (cheap leaves, and loads read at their consumers).
    Dup,
    Slot,
}

/// Element class of a value in registers: f32 lanes, i32 lanes, or i32 mask lanes (bool).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Class {
    F,
    I,
    B,
}

fn class(d: DType) -> Class {
    match d {
        DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2 => Class::F,
        DType::I32 | DType::I8 => Class::I,
        DType::Bool => Class::B,
    }
}

/// Where the loop nest evaluating a value stands: per dim of the value's shape the index
/// (`None` = 0, after a broadcast), whether the four lanes run along the last dim
/// (otherwise they all hold the same element), and how many lanes are live.
#[derive(Clone)]
struct At {
    idx: Vec<Option<CV>>,
    lane: bool,
    lanes: u8,
}

/// What a fused loop nest writes to.
#[derive(Clone, Copy)]
enum Sink {
    /// A frame slot (row-major, 4-byte elements).
    Slot(usize),
    /// A ref's memory: element pointer of the box origin, the ref, and the slices'
    /// strides (`None`: all 1).
    Ref(CV, RefId, Option<InstId>),
}

pub struct Lower<'a, 'b> {
    k: &'a Kernel,
    layouts: &'a [RefLayout],
    pub b: FunctionBuilder<'b>,
    h: Helpers,
    exact: bool,
    how: Vec<How>,
    slot: Vec<usize>,
    scalar: Vec<Option<CV>>,
    pub frame_bytes: usize,
    pub sites: Sites,
    frame: CV,
    rt: CV,
    grid: CV,
    refs: Vec<Option<CV>>,
    fail: CB,
    pos: HashMap<InstId, (BlockId, usize)>,
    /// `ref[s] = ref[s] + dot(a, b)` (f32, fast mode): the store's dot, computed by a GEMM
    /// that accumulates straight into the ref instead of at the dot's own position.
    acc_dots: HashMap<InstId, InstId>,
}

/// Chunks of four lanes per iteration of a fused loop. Their chains are independent, and
/// [`super::interleave`] alternates them, so a long chain's latencies overlap. On the 8-op
/// chain of `scripts/bench_fusion.py` (one thread): 2 chunks 102 ms, 4 chunks 78 ms,
/// 8 chunks 92 ms (16 xmm registers do not hold eight chains: spills).
const UNROLL: usize = 4;

impl<'a, 'b> Lower<'a, 'b> {
    pub fn new(k: &'a Kernel, layouts: &'a [RefLayout], mut b: FunctionBuilder<'b>, h: Helpers, exact: bool) -> R<Self> {
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let ctx = b.block_params(entry)[0];
        let refs_arr = b.ins().load(I64, mflags(), ctx, CTX_REFS);
        let grid = b.ins().load(I64, mflags(), ctx, CTX_GRID);
        let frame = b.ins().load(I64, mflags(), ctx, CTX_FRAME);
        let rt = b.ins().load(I64, mflags(), ctx, CTX_RT);
        let mut refs = Vec::with_capacity(k.refs.len());
        for (i, decl) in k.refs.iter().enumerate() {
            refs.push(if decl.memory == MemorySpace::Semaphore { None } else { Some(b.ins().load(I64, mflags(), refs_arr, (i * 8) as i32)) });
        }
        let fail = b.create_block();
        let n = k.values.len();
        let mut l = Lower { k, layouts, b, h, exact, how: vec![How::Slot; n], slot: vec![usize::MAX; n], scalar: vec![None; n], frame_bytes: 0, sites: Sites::default(), frame, rt, grid, refs, fail, pos: HashMap::new(), acc_dots: HashMap::new() };
        l.analyze()?;
        Ok(l)
    }

    /// Lowers the kernel body and finishes the function.
    pub fn lower(mut self, config: cranelift_codegen::isa::TargetFrontendConfig) -> R<(usize, Sites)> {
        let yields = self.emit_block(self.k.body)?;
        if !yields.is_empty() {
            return unsupported("the kernel body yields values");
        }
        let zero = self.b.ins().iconst(I32, 0);
        self.b.ins().return_(&[zero]);
        self.b.switch_to_block(self.fail);
        let one = self.b.ins().iconst(I32, 1);
        self.b.ins().return_(&[one]);
        self.b.seal_all_blocks();
        self.b.finalize(config);
        Ok((self.frame_bytes, self.sites))
    }

    // ---- analysis ------------------------------------------------------------------------

    fn inst_of(&self, v: Value) -> Option<InstId> {
        match self.k.value(v).def {
            ValueDef::Result(i, _) => Some(i),
            ValueDef::Param(..) => None,
        }
    }

    fn block_of_value(&self, v: Value) -> Option<BlockId> {
        match self.k.value(v).def {
            ValueDef::Result(i, _) => self.pos.get(&i).map(|p| p.0),
            ValueDef::Param(b, _) => Some(b),
        }
    }

    fn writes(&self, i: InstId, out: &mut Vec<RefId>) {
        match &self.k.inst(i).inst {
            Inst::Store { dst, .. } => out.push(*dst),
            Inst::DmaStart { dst, .. } | Inst::DmaWait { dst, .. } => out.push(dst.r),
            Inst::If { then_block, else_block, .. } => {
                for blk in [*then_block, *else_block] {
                    for &j in &self.k.block(blk).insts {
                        self.writes(j, out);
                    }
                }
            }
            Inst::For { body, .. } => {
                for &j in &self.k.block(*body).insts {
                    self.writes(j, out);
                }
            }
            _ => {}
        }
    }

    fn same_const(&self, a: Value, b: Value) -> bool {
        a == b || matches!((self.k.as_const(a), self.k.as_const(b)), (Some(Scalar::Int(x)), Some(Scalar::Int(y))) if x == y)
    }

    fn analyze(&mut self) -> R<()> {
        let k = self.k;
        // Positions and uses.
        let mut stack = vec![k.body];
        let mut uses: Vec<Vec<InstId>> = vec![Vec::new(); k.values.len()];
        while let Some(blk) = stack.pop() {
            let Some(bd) = k.blocks.get(blk.index()) else { return unsupported("a block that does not exist") };
            for (p, &i) in bd.insts.iter().enumerate() {
                if i.index() >= k.insts.len() {
                    return unsupported("an instruction that does not exist");
                }
                self.pos.insert(i, (blk, p));
                for v in k.inst(i).inst.operands() {
                    if v.index() >= k.values.len() {
                        return unsupported("a value that does not exist");
                    }
                    uses[v.index()].push(i);
                }
                match &k.inst(i).inst {
                    Inst::If { then_block, else_block, .. } => {
                        stack.push(*then_block);
                        stack.push(*else_block);
                    }
                    Inst::For { body, .. } => stack.push(*body),
                    _ => {}
                }
            }
        }
        // Values first decided by their definition and single consumer.
        for vi in 0..k.values.len() {
            let v = Value(vi as u32);
            let ty = k.ty(v);
            if ty.is_scalar() {
                self.how[vi] = How::Scalar;
                continue;
            }
            let Some(i) = self.inst_of(v) else {
                self.how[vi] = How::Slot;
                continue;
            };
            let elementwise_fused = |s: &Self| -> How {
                let u = &uses[vi];
                // `x * x` (a binary op or comparison with `v` on both sides) is one consumer:
                // `eval` computes `v` once for both operands.
                let one_consumer = u.len() == 1 || u.len() == 2 && u[0] == u[1] && matches!(k.inst(u[0]).inst, Inst::Binary(..) | Inst::Cmp(..));
                if one_consumer && s.pos.get(&u[0]).map(|p| p.0) == s.block_of_value(v) {
                    let fusible = match &k.inst(u[0]).inst {
                        Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } | Inst::Cast(_) | Inst::Bitcast(_) => true,
                        Inst::Store { value, .. } => *value == v,
                        Inst::Reduce { .. } | Inst::Yield(_) => true,
                        _ => false,
                    };
                    if fusible {
                        return How::Fused;
                    }
                }
                How::Slot
            };
            self.how[vi] = match &k.inst(i).inst {
                Inst::Const(_) | Inst::Iota { .. } => How::Dup,
                Inst::Load { .. } => How::Dup, // decided below
                Inst::Cast(x) if free_cast(k.ty(*x).dtype, ty.dtype) && self.leaf_like(*x) => How::Dup,
                Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } | Inst::Cast(_) | Inst::Bitcast(_) => {
                    let h = elementwise_fused(self);
                    // Cheap values used several times are recomputed rather than stored.
                    if h == How::Slot && self.cheap(i, 4).is_some() && self.all_uses_fusible(v, &uses) {
                        How::Dup
                    } else {
                        h
                    }
                }
                Inst::Broadcast(x) => {
                    let xd = k.value(*x).def;
                    let x_is_load = matches!(xd, ValueDef::Result(j, _) if matches!(k.inst(j).inst, Inst::Load { .. })) && !k.ty(*x).is_scalar();
                    if x_is_load {
                        elementwise_fused(self)
                    } else {
                        How::Dup // of a scalar, a leaf or a slot; `x` itself is decided on its own
                    }
                }
                _ => How::Slot,
            };
        }
        // A broadcast operand that is not a leaf must be materialised.
        for vi in 0..k.values.len() {
            let v = Value(vi as u32);
            if let Some(i) = self.inst_of(v) {
                if let Inst::Broadcast(x) = k.inst(i).inst {
                    if !k.ty(x).is_scalar() && self.how[x.index()] == How::Fused {
                        self.how[x.index()] = How::Slot;
                    }
                }
            }
        }
        // Loads: read at each consumer if every consumer allows it and nothing writes the
        // ref in between.
        for vi in 0..k.values.len() {
            let v = Value(vi as u32);
            let Some(i) = self.inst_of(v) else { continue };
            let Inst::Load { src, slices } = &k.inst(i).inst else { continue };
            if self.how[vi] == How::Scalar {
                continue;
            }
            let (lblk, lpos) = self.pos[&i];
            let dtype = k.ref_decl(*src).dtype;
            let mut ok = !uses[vi].is_empty();
            for &u in &uses[vi] {
                let (ublk, _) = self.pos[&u];
                if ublk != lblk {
                    ok = false;
                    break;
                }
                let consumer_ok = match &k.inst(u).inst {
                    Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } | Inst::Cast(_) | Inst::Bitcast(_) | Inst::Broadcast(_) => true,
                    Inst::Store { value, .. } => *value == v,
                    Inst::Reduce { .. } | Inst::Yield(_) => true,
                    Inst::Dot { .. } => matches!(dtype, DType::F32 | DType::I32 | DType::BF16),
                    _ => false,
                };
                if !consumer_ok {
                    ok = false;
                    break;
                }
                let mut roots = Vec::new();
                self.roots_of(u, &uses, &mut roots);
                for root in roots {
                let (rblk, rpos) = self.pos[&root];
                if rblk != lblk {
                    ok = false;
                    break;
                }
                let insts = &k.block(lblk).insts;
                for &j in &insts[lpos + 1..=rpos.min(insts.len() - 1)] {
                    let mut w = Vec::new();
                    self.writes(j, &mut w);
                    if !w.contains(src) {
                        continue;
                    }
                    // `ref[s] = f(ref[s])` reads each element before writing it.
                    let same_box = j == root
                        && matches!(&k.inst(j).inst, Inst::Store { dst, slices: ss, .. } if dst == src && ss.len() == slices.len() && ss.iter().zip(slices).all(|(a, b)| a.len == b.len && a.stride == b.stride && self.same_const(a.start, b.start)));
                    if !same_box {
                        ok = false;
                    }
                }
                }
                if !ok {
                    break;
                }
            }
            if !ok {
                self.how[vi] = How::Slot;
            }
        }
        if !self.exact {
            self.find_acc_dots(&uses);
        }
        Ok(())
    }

    /// Finds `store(r[s], load(r[s]) + dot(a, b))` where nothing between the dot and the
    /// store writes memory, `r` is f32 and the dot has no other use.
    fn find_acc_dots(&mut self, uses: &[Vec<InstId>]) {
        let k = self.k;
        for (idx, d) in k.insts.iter().enumerate() {
            let st = InstId(idx as u32);
            let Inst::Store { dst, slices, value } = &d.inst else { continue };
            // The in-place GEMM writes rows `strides[0]` apart: not for a strided store.
            if !self.pos.contains_key(&st) || k.ref_decl(*dst).dtype != DType::F32 || slices.len() != 2 || self.layouts[dst.index()].strides.len() != 2 || slices.iter().any(|s| s.stride != 1) {
                continue;
            }
            let Some(add) = self.inst_of(*value) else { continue };
            let Inst::Binary(tessera_dsl::BinaryOp::Add, x, y) = k.inst(add).inst else { continue };
            if uses[value.index()].len() != 1 {
                continue;
            }
            let is_dot = |v: Value| self.inst_of(v).filter(|&i| matches!(k.inst(i).inst, Inst::Dot { .. }) && uses[v.index()].len() == 1 && k.ty(v).dtype == DType::F32);
            let is_self_load = |v: Value| {
                self.inst_of(v).is_some_and(|i| match &k.inst(i).inst {
                    Inst::Load { src, slices: ls } => src == dst && uses[v.index()].len() == 1 && self.how[v.index()] == How::Dup && ls.len() == slices.len() && ls.iter().zip(slices).all(|(a, b)| a.len == b.len && a.stride == b.stride && self.same_const(a.start, b.start)),
                    _ => false,
                })
            };
            let dot = match (is_dot(x), is_dot(y)) {
                (Some(dt), _) if is_self_load(y) => dt,
                (_, Some(dt)) if is_self_load(x) => dt,
                _ => continue,
            };
            // The GEMM writes `dst` while reading its operands: they must not be `dst`.
            let Inst::Dot { lhs, rhs, .. } = k.inst(dot).inst else { continue };
            let reads_dst = [lhs, rhs].iter().any(|&o| self.inst_of(o).is_some_and(|i| matches!(&k.inst(i).inst, Inst::Load { src, .. } if src == dst)));
            if reads_dst {
                continue;
            }
            let (Some(&(db, dp)), Some(&(sb, sp))) = (self.pos.get(&dot), self.pos.get(&st)) else { continue };
            if db != sb || dp >= sp {
                continue;
            }
            let quiet = k.block(sb).insts[dp + 1..sp].iter().all(|&j| !matches!(k.inst(j).inst, Inst::Store { .. } | Inst::DmaStart { .. } | Inst::DmaWait { .. } | Inst::If { .. } | Inst::For { .. }));
            if quiet {
                self.acc_dots.insert(st, dot);
            }
        }
    }

    /// Whether `v` costs nothing to re-read at each use: a load, a leaf or a slot.
    fn leaf_like(&self, v: Value) -> bool {
        if self.k.ty(v).is_scalar() {
            return true;
        }
        match self.how[v.index()] {
            How::Dup | How::Slot => true,
            How::Scalar => true,
            How::Fused => false,
        }
    }

    /// The number of cheap ops `i` and its fused operands take, if at most `budget` and
    /// none is expensive (transcendentals, divisions, per-lane helpers).
    fn cheap(&self, i: InstId, budget: usize) -> Option<usize> {
        use tessera_dsl::BinaryOp as B;
        let k = self.k;
        let own = match &k.inst(i).inst {
            Inst::Unary(UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Not, _) => 1,
            Inst::Binary(B::Add | B::Sub | B::Mul | B::Max | B::Min | B::And | B::Or | B::Xor, ..) => 1,
            Inst::Unary(UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round, _) => 1,
            Inst::Unary(UnaryOp::Sign, _) => 3,
            Inst::Cmp(..) | Inst::Select { .. } | Inst::Cast(_) | Inst::Bitcast(_) | Inst::Broadcast(_) => 1,
            Inst::Load { .. } | Inst::Const(_) | Inst::Iota { .. } => 0,
            _ => return None,
        };
        let mut total = own;
        for x in k.inst(i).inst.operands() {
            if k.ty(x).is_scalar() {
                continue;
            }
            match self.how[x.index()] {
                How::Fused => total += self.cheap(self.inst_of(x)?, budget)?,
                How::Dup | How::Slot | How::Scalar => {}
            }
            if total > budget {
                return None;
            }
        }
        (total <= budget).then_some(total)
    }

    fn all_uses_fusible(&self, v: Value, uses: &[Vec<InstId>]) -> bool {
        let blk = self.block_of_value(v);
        uses[v.index()].iter().all(|&u| {
            self.pos.get(&u).map(|p| p.0) == blk
                && match &self.k.inst(u).inst {
                    Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } | Inst::Cast(_) | Inst::Bitcast(_) => true,
                    Inst::Store { value, .. } => *value == v,
                    Inst::Reduce { .. } | Inst::Yield(_) => true,
                    _ => false,
                }
        })
    }

    /// The instructions whose loop nests evaluate a value consumed by `u`.
    fn roots_of(&self, u: InstId, uses: &[Vec<InstId>], out: &mut Vec<InstId>) {
        let d = self.k.inst(u);
        if let [r] = d.results.as_slice() {
            if matches!(self.how[r.index()], How::Fused | How::Dup) && !self.k.ty(*r).is_scalar() {
                for &j in &uses[r.index()] {
                    self.roots_of(j, uses, out);
                }
                return;
            }
        }
        out.push(u);
    }

    // ---- small helpers -----------------------------------------------------------------

    fn alloc(&mut self, bytes: usize) -> usize {
        let off = self.frame_bytes;
        self.frame_bytes += bytes.div_ceil(64) * 64;
        off
    }

    fn shape(&self, v: Value) -> Vec<usize> {
        self.k.ty(v).shape.clone()
    }

    fn scalar(&self, v: Value) -> R<CV> {
        self.scalar.get(v.index()).copied().flatten().ok_or_else(|| Unsupported(format!("{v} is read before it is defined")))
    }

    fn iconst64(&mut self, x: i64) -> CV {
        self.b.ins().iconst(I64, x)
    }

    fn vty(c: Class) -> CT {
        if c == Class::F { F32X4 } else { I32X4 }
    }

    /// Rounds / wraps a vector of `dtype` values.
    fn norm(&mut self, v: CV, dtype: DType) -> CV {
        match dtype {
            DType::BF16 => vx::round_bf16(&mut self.b, v),
            DType::I8 => vx::wrap_i8(&mut self.b, v),
            DType::F8E4M3FN | DType::F8E5M2 => vx::round_fp8(&mut self.b, v, dtype == DType::F8E5M2),
            _ => v,
        }
    }

    fn norm_scalar(&mut self, v: CV, dtype: DType) -> CV {
        match dtype {
            DType::BF16 => vx::via_vector(&mut self.b, v, vx::round_bf16),
            DType::I8 => vx::wrap_i8_scalar(&mut self.b, v),
            DType::F8E4M3FN | DType::F8E5M2 => vx::via_vector(&mut self.b, v, |b, x| vx::round_fp8(b, x, dtype == DType::F8E5M2)),
            _ => v,
        }
    }

    fn counted(&mut self, lo: i64, hi: i64, step: i64, body: &mut dyn FnMut(&mut Self, CV) -> R<()>) -> R<()> {
        if hi <= lo {
            return Ok(());
        }
        if hi - lo <= step {
            let i = self.iconst64(lo);
            return body(self, i);
        }
        let header = self.b.create_block();
        self.b.append_block_param(header, I64);
        let bodyb = self.b.create_block();
        let exit = self.b.create_block();
        let lo_v = self.iconst64(lo);
        self.b.ins().jump(header, &[BlockArg::Value(lo_v)]);
        self.b.switch_to_block(header);
        let i = self.b.block_params(header)[0];
        let c = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, i, hi);
        self.b.ins().brif(c, bodyb, &[], exit, &[]);
        self.b.switch_to_block(bodyb);
        body(self, i)?;
        let n = self.b.ins().iadd_imm_s(i, step);
        self.b.ins().jump(header, &[BlockArg::Value(n)]);
        self.b.switch_to_block(exit);
        Ok(())
    }

    /// A counted loop carrying `init` (SSA values); returns the final carries.
    fn counted_carry(&mut self, lo: i64, hi: i64, step: i64, init: Vec<CV>, body: &mut dyn FnMut(&mut Self, CV, &[CV]) -> R<Vec<CV>>) -> R<Vec<CV>> {
        if hi <= lo {
            return Ok(init);
        }
        if hi - lo <= step {
            let i = self.iconst64(lo);
            return body(self, i, &init);
        }
        let header = self.b.create_block();
        self.b.append_block_param(header, I64);
        let exit = self.b.create_block();
        for &v in &init {
            let t = self.b.func.dfg.value_type(v);
            self.b.append_block_param(header, t);
            self.b.append_block_param(exit, t);
        }
        let bodyb = self.b.create_block();
        let lo_v = self.iconst64(lo);
        let mut args = vec![BlockArg::Value(lo_v)];
        args.extend(init.iter().map(|&v| BlockArg::Value(v)));
        self.b.ins().jump(header, &args);
        self.b.switch_to_block(header);
        let params = self.b.block_params(header).to_vec();
        let c = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, params[0], hi);
        let exit_args: Vec<BlockArg> = params[1..].iter().map(|&v| BlockArg::Value(v)).collect();
        self.b.ins().brif(c, bodyb, &[], exit, &exit_args);
        self.b.switch_to_block(bodyb);
        let next = body(self, params[0], &params[1..])?;
        let n = self.b.ins().iadd_imm_s(params[0], step);
        let mut args = vec![BlockArg::Value(n)];
        args.extend(next.iter().map(|&v| BlockArg::Value(v)));
        self.b.ins().jump(header, &args);
        self.b.switch_to_block(exit);
        Ok(self.b.block_params(exit).to_vec())
    }

    /// Visits every index of `dims` (outer loops), then calls `inner(idx, js, lanes)` for
    /// the last dim `n` in chunks of four lanes (`js` the first lane's index of each chunk:
    /// [`UNROLL`] chunks at a time, then the whole chunks left, then a partial one).
    fn loop_nest(&mut self, outer: &[usize], n: usize, body: &mut dyn FnMut(&mut Self, &[CV], &[CV], u8) -> R<()>) -> R<()> {
        let mut idx = Vec::new();
        self.loop_outer(outer, &mut idx, n, body)
    }

    fn loop_outer(&mut self, outer: &[usize], idx: &mut Vec<CV>, n: usize, body: &mut dyn FnMut(&mut Self, &[CV], &[CV], u8) -> R<()>) -> R<()> {
        if idx.len() == outer.len() {
            let idx = idx.clone();
            return self.loop_inner(&idx, n, body);
        }
        let extent = outer[idx.len()];
        let mut run = |s: &mut Self, i: CV| -> R<()> {
            idx.push(i);
            let r = s.loop_outer(outer, idx, n, body);
            idx.pop();
            r
        };
        self.counted(0, extent as i64, 1, &mut run)
    }

    fn loop_inner(&mut self, idx: &[CV], n: usize, body: &mut dyn FnMut(&mut Self, &[CV], &[CV], u8) -> R<()>) -> R<()> {
        let w = 4 * UNROLL;
        let main = n / w * w;
        if main > 0 {
            let mut f = |s: &mut Self, j: CV| -> R<()> {
                let js: Vec<CV> = (0..UNROLL).map(|u| s.b.ins().iadd_imm_s(j, (u * 4) as i64)).collect();
                body(s, idx, &js, 4)
            };
            self.counted(0, main as i64, w as i64, &mut f)?;
        }
        let mut j = main;
        if j + 4 <= n {
            let js: Vec<CV> = (j..n - 3).step_by(4).map(|j| self.iconst64(j as i64)).collect();
            body(self, idx, &js, 4)?;
            j += 4 * js.len();
        }
        if j < n {
            let jv = self.iconst64(j as i64);
            body(self, idx, &[jv], (n - j) as u8)?;
        }
        Ok(())
    }

    // ---- memory access -------------------------------------------------------------------

    /// `base + sum(idx[d] * strides[d]) * esize`.
    fn addr(&mut self, base: CV, idx: &[Option<CV>], strides: &[usize], esize: usize) -> CV {
        let mut a = base;
        for (i, &s) in idx.iter().zip(strides) {
            if let Some(i) = i {
                let off = self.b.ins().imul_imm_s(*i, (s * esize) as i64);
                a = self.b.ins().iadd(a, off);
            }
        }
        a
    }

    /// Loads the lanes of `at` from memory of `dtype` at element address `addr` (lanes
    /// along consecutive elements). `slot` memory stores bools as i32 masks.
    fn load_lanes(&mut self, addr: CV, dtype: DType, slot: bool, at: &At) -> CV {
        let c = class(dtype);
        let esize = if slot { 4 } else { dtype.bytes() };
        if at.lane && at.lanes == 4 {
            return match (dtype, slot) {
                (DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2, true) | (DType::F32, false) => self.b.ins().load(F32X4, mflags(), addr, 0),
                (_, true) | (DType::I32, false) => self.b.ins().load(I32X4, mflags(), addr, 0),
                (DType::BF16, false) => vx::load_bf16x4(&mut self.b, addr),
                (DType::F8E4M3FN | DType::F8E5M2, false) => {
                    let c = vx::load_bytes4(&mut self.b, addr, false);
                    vx::decode_fp8(&mut self.b, c, dtype == DType::F8E5M2)
                }
                (DType::I8, false) => vx::load_bytes4(&mut self.b, addr, true),
                (DType::Bool, false) => {
                    let v = vx::load_bytes4(&mut self.b, addr, false);
                    self.b.ins().icmp_imm_s(IntCC::NotEqual, v, 0)
                }
            };
        }
        let n = if at.lane { at.lanes } else { 1 };
        let mut out = if c == Class::F { fsplat(&mut self.b, 0.0) } else { isplat(&mut self.b, 0) };
        for lane in 0..n {
            let x = self.load_scalar_at(addr, (lane as usize * esize) as i32, dtype, slot);
            let x = if c == Class::B { self.b.ins().bmask(I32, x) } else { x };
            if at.lane {
                out = self.b.ins().insertlane(out, x, lane);
            } else {
                out = self.b.ins().splat(Self::vty(c), x);
            }
        }
        out
    }

    /// One element as a scalar register (f32; i32; bool as i8 0/1).
    fn load_scalar_at(&mut self, addr: CV, off: i32, dtype: DType, slot: bool) -> CV {
        match (dtype, slot) {
            (DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2, true) | (DType::F32, false) => self.b.ins().load(F32, mflags(), addr, off),
            (DType::F8E4M3FN | DType::F8E5M2, false) => {
                let c = self.b.ins().uload8(I32, mflags(), addr, off);
                vx::via_vector(&mut self.b, c, |b, v| vx::decode_fp8(b, v, dtype == DType::F8E5M2))
            }
            (DType::I32 | DType::I8, true) | (DType::I32, false) => self.b.ins().load(I32, mflags(), addr, off),
            (DType::Bool, true) => {
                let m = self.b.ins().load(I32, mflags(), addr, off);
                self.b.ins().icmp_imm_s(IntCC::NotEqual, m, 0)
            }
            (DType::BF16, false) => {
                let h = self.b.ins().uload16(I32, mflags(), addr, off);
                let s = self.b.ins().ishl_imm_s(h, 16);
                self.b.ins().bitcast(F32, mflags(), s)
            }
            (DType::I8, false) => self.b.ins().sload8(I32, mflags(), addr, off),
            (DType::Bool, false) => {
                let x = self.b.ins().uload8(I32, mflags(), addr, off);
                self.b.ins().icmp_imm_s(IntCC::NotEqual, x, 0)
            }
        }
    }

    /// Stores the live lanes of `v` (class of `dtype`) at `addr`.
    fn store_lanes(&mut self, v: CV, addr: CV, dtype: DType, slot: bool, lanes: u8) {
        let esize = if slot { 4 } else { dtype.bytes() };
        if lanes == 4 {
            match (dtype, slot) {
                (_, true) | (DType::F32 | DType::I32, false) => {
                    self.b.ins().store(mflags(), v, addr, 0);
                }
                (DType::BF16, false) => vx::store_bf16x4(&mut self.b, v, addr),
                (DType::I8, false) => vx::store_bytes4(&mut self.b, v, addr),
                (DType::F8E4M3FN | DType::F8E5M2, false) => {
                    // Codes 128..=255 as i8 (-128..=-1), so the saturating narrows keep them.
                    let c = vx::encode_fp8(&mut self.b, v, dtype == DType::F8E5M2);
                    let c = vx::wrap_i8(&mut self.b, c);
                    vx::store_bytes4(&mut self.b, c, addr)
                }
                (DType::Bool, false) => {
                    let one = isplat(&mut self.b, 1);
                    let x = self.b.ins().band(v, one);
                    vx::store_bytes4(&mut self.b, x, addr);
                }
            }
            return;
        }
        for lane in 0..lanes {
            let x = self.b.ins().extractlane(v, lane);
            let off = (lane as usize * esize) as i32;
            self.store_scalar_at(x, addr, off, dtype, slot, true);
        }
    }

    /// Stores one element register (`mask`: a bool is an i32 mask, else i8 0/1).
    fn store_scalar_at(&mut self, x: CV, addr: CV, off: i32, dtype: DType, slot: bool, mask: bool) {
        match (dtype, slot) {
            (DType::Bool, true) => {
                let m = if mask { x } else { self.b.ins().bmask(I32, x) };
                self.b.ins().store(mflags(), m, addr, off);
            }
            (_, true) | (DType::F32 | DType::I32, false) => {
                self.b.ins().store(mflags(), x, addr, off);
            }
            (DType::BF16, false) => {
                let bits = self.b.ins().bitcast(I32, mflags(), x);
                let hi = self.b.ins().ushr_imm_s(bits, 16);
                self.b.ins().istore16(mflags(), hi, addr, off);
            }
            (DType::I8, false) => {
                self.b.ins().istore8(mflags(), x, addr, off);
            }
            (DType::F8E4M3FN | DType::F8E5M2, false) => {
                let c = vx::via_vector(&mut self.b, x, |b, v| vx::encode_fp8(b, v, dtype == DType::F8E5M2));
                self.b.ins().istore8(mflags(), c, addr, off);
            }
            (DType::Bool, false) => {
                let x = if mask { self.b.ins().band_imm_s(x, 1) } else { x };
                self.b.ins().istore8(mflags(), x, addr, off);
            }
        }
    }

    fn ref_base(&self, r: RefId) -> R<CV> {
        self.refs.get(r.index()).copied().flatten().ok_or_else(|| Unsupported(format!("{r} has no memory")))
    }

    /// The element pointer of `ref[starts]` (the box origin).
    fn ref_origin(&mut self, r: RefId, slices: &[Slice]) -> R<CV> {
        let base = self.ref_base(r)?;
        let l = &self.layouts[r.index()];
        let (strides, esize) = (l.strides.clone(), l.dtype.bytes());
        let mut a = base;
        for (s, st) in slices.iter().zip(strides) {
            if let Some(Scalar::Int(0)) = self.k.as_const(s.start) {
                continue;
            }
            let st32 = self.scalar(s.start)?;
            let s64 = self.b.ins().sextend(I64, st32);
            let off = self.b.ins().imul_imm_s(s64, (st * esize) as i64);
            a = self.b.ins().iadd(a, off);
        }
        Ok(a)
    }

    /// Bounds checks of a dynamic access at its program point.
    fn check_slices(&mut self, what: &str, r: RefId, slices: &[Slice], loc: &Option<tessera_dsl::SourceLoc>) -> R<()> {
        let decl = self.k.ref_decl(r);
        let view = self.layouts[r.index()].view.clone();
        if slices.len() != view.len() {
            return unsupported(format!("{} slices for a view of rank {}", slices.len(), view.len()));
        }
        let subject = format!("{what} of {} `{}`", decl.kind.name(), decl.name);
        // The lanes of a vector are consecutive elements: a lane-dim stride (which no TPU
        // generation compiles, rule strided-access) is left to the interpreter.
        if slices.last().is_some_and(|s| s.stride != 1) && !view.is_empty() {
            return unsupported("a stride on the last dim");
        }
        for (dim, (s, &extent)) in slices.iter().zip(&view).enumerate() {
            if s.stride == 0 || s.len == 0 {
                return unsupported("a zero slice length or stride");
            }
            let span = s.span();
            if span > extent {
                return unsupported("a slice longer than its dim");
            }
            if let Some(Scalar::Int(c)) = self.k.as_const(s.start) {
                if c >= 0 && c as usize + span <= extent {
                    continue;
                }
            }
            let start = self.scalar(s.start)?;
            let bad_lo = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, start, 0);
            let bad_hi = self.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, start, (extent - span) as i64);
            let bad = self.b.ins().bor(bad_lo, bad_hi);
            let site = self.sites.slices.len();
            self.sites.slices.push(SliceSite { subject: subject.clone(), dim, len: s.len, stride: s.stride, extent, loc: loc.clone() });
            self.fail_if(bad, site as i64, start);
        }
        Ok(())
    }

    fn fail_if(&mut self, bad: CV, site: i64, start: CV) {
        let fail_here = self.b.create_block();
        let cont = self.b.create_block();
        self.b.ins().brif(bad, fail_here, &[], cont, &[]);
        self.b.switch_to_block(fail_here);
        let site = self.b.ins().iconst(I32, site);
        self.b.ins().call(self.h.fail_slice, &[self.rt, site, start]);
        self.b.ins().jump(self.fail, &[]);
        self.b.switch_to_block(cont);
    }

    // ---- vectors -------------------------------------------------------------------------

    fn slot_of(&self, v: Value) -> R<usize> {
        match self.slot.get(v.index()) {
            Some(&s) if s != usize::MAX => Ok(s),
            _ => unsupported(format!("{v} has no slot")),
        }
    }

    fn slot_addr(&mut self, off: usize) -> CV {
        self.b.ins().iadd_imm_s(self.frame, off as i64)
    }

    /// `v`'s slot, materialising it now if it is recomputed at each use.
    fn ensure_slot(&mut self, v: Value) -> R<usize> {
        match self.how[v.index()] {
            How::Slot => self.slot_of(v),
            How::Dup | How::Fused => {
                let shape = self.shape(v);
                let off = self.alloc(shape.iter().product::<usize>() * 4);
                self.emit_group(v, Sink::Slot(off))?;
                Ok(off)
            }
            How::Scalar => unsupported("a scalar where a vector is needed"),
        }
    }

    /// A loop nest over `v`'s shape writing every element to `sink`.
    fn emit_group(&mut self, v: Value, sink: Sink) -> R<()> {
        let shape = self.shape(v);
        let dtype = self.k.ty(v).dtype;
        let (&n, outer) = shape.split_last().ok_or_else(|| Unsupported("a rank-0 vector".into()))?;
        let (sink_strides, sink_esize, slot, base) = match sink {
            Sink::Slot(off) => {
                let base = self.slot_addr(off);
                (crate::cpu::layout::row_major(&shape), 4, true, base)
            }
            Sink::Ref(origin, r, store) => {
                let l = &self.layouts[r.index()];
                let mut strides = l.strides.clone();
                if let Some(Inst::Store { slices, .. }) = store.map(|i| &self.k.inst(i).inst) {
                    for (st, sl) in strides.iter_mut().zip(slices) {
                        *st *= sl.stride;
                    }
                }
                (strides, l.dtype.bytes(), false, origin)
            }
        };
        let outer = outer.to_vec();
        let mut body = |s: &mut Self, idx: &[CV], js: &[CV], lanes: u8| -> R<()> {
            let ats: Vec<At> = js
                .iter()
                .map(|&j| {
                    let mut full: Vec<Option<CV>> = idx.iter().map(|&i| Some(i)).collect();
                    full.push(Some(j));
                    At { idx: full, lane: true, lanes }
                })
                .collect();
            let xs = s.eval_n(v, &ats)?;
            for (x, at) in xs.into_iter().zip(&ats) {
                let addr = s.addr(base, &at.idx, &sink_strides, sink_esize);
                s.store_lanes(x, addr, dtype, slot, lanes);
            }
            Ok(())
        };
        self.loop_nest(&outer, n, &mut body)
    }

    /// Evaluates vector value `v` at `at`: a vector register (f32x4 / i32x4 / mask).
    fn eval(&mut self, v: Value, at: &At) -> R<CV> {
        let mut r = self.eval_n(v, std::slice::from_ref(at))?;
        Ok(r.swap_remove(0))
    }

    /// Evaluates vector value `v` at each of `ats` (the chunks of one loop iteration). The
    /// chunks' loads all come before the caller's stores of their results: a load after
    /// another chunk's store would be ordered after it ([`super::interleave`] keeps memory
    /// in order), and the chunks' chains could not overlap.
    fn eval_n(&mut self, v: Value, ats: &[At]) -> R<Vec<CV>> {
        let k = self.k;
        let ty = k.ty(v).clone();
        match self.how[v.index()] {
            How::Scalar => {
                let s = self.scalar(v)?;
                let x = self.splat_scalar(s, ty.dtype);
                return Ok(vec![x; ats.len()]);
            }
            How::Slot => {
                let off = self.slot_of(v)?;
                let base = self.slot_addr(off);
                let strides = crate::cpu::layout::row_major(&ty.shape);
                return Ok(ats
                    .iter()
                    .map(|at| {
                        let addr = self.addr(base, &at.idx, &strides, 4);
                        self.load_lanes(addr, ty.dtype, true, at)
                    })
                    .collect());
            }
            How::Fused | How::Dup => {}
        }
        let Some(i) = self.inst_of(v) else { return unsupported("a block parameter without a slot") };
        let d = k.inst(i);
        let r = match &d.inst {
            Inst::Const(s) => vec![self.const_vec(*s, ty.dtype); ats.len()],
            Inst::Iota { dim } => {
                let mut r = Vec::with_capacity(ats.len());
                for at in ats {
                    let Some(Some(ix)) = at.idx.get(*dim).copied() else {
                        r.push(isplat(&mut self.b, 0));
                        continue;
                    };
                    let i32v = self.b.ins().ireduce(I32, ix);
                    let sp = self.b.ins().splat(I32X4, i32v);
                    r.push(if at.lane && *dim + 1 == ty.shape.len() {
                        let lanes = self.lane_iota();
                        self.b.ins().iadd(sp, lanes)
                    } else {
                        sp
                    });
                }
                r
            }
            Inst::Load { src, slices } => {
                let origin = self.ref_origin(*src, slices)?;
                let l = &self.layouts[src.index()];
                let (mut strides, esize, dtype) = (l.strides.clone(), l.dtype.bytes(), l.dtype);
                for (st, sl) in strides.iter_mut().zip(slices) {
                    *st *= sl.stride;
                }
                ats.iter()
                    .map(|at| {
                        let addr = self.addr(origin, &at.idx, &strides, esize);
                        self.load_lanes(addr, dtype, false, at)
                    })
                    .collect()
            }
            Inst::Broadcast(x) => {
                let xt = k.ty(*x).clone();
                if xt.is_scalar() {
                    let s = self.scalar(*x)?;
                    vec![self.splat_scalar(s, xt.dtype); ats.len()]
                } else {
                    let at2s: Vec<At> = ats
                        .iter()
                        .map(|at| {
                            let idx: Vec<Option<CV>> = xt.shape.iter().zip(&ty.shape).zip(&at.idx).map(|((&xs, &ts), &i)| if xs == 1 && ts != 1 { None } else { i }).collect();
                            let lane = at.lane && xt.shape.last() == ty.shape.last();
                            At { idx, lane, lanes: at.lanes }
                        })
                        .collect();
                    self.eval_n(*x, &at2s)?
                }
            }
            Inst::Unary(op, x) => {
                let xs = self.eval_n(*x, ats)?;
                let c = class(k.ty(*x).dtype);
                let mut r = Vec::with_capacity(ats.len());
                for xv in xs {
                    let y = self.unary_vec(*op, c, xv)?;
                    r.push(self.norm(y, ty.dtype));
                }
                r
            }
            Inst::Binary(op, a, bb) => {
                let avs = self.eval_n(*a, ats)?;
                let bvs = if a == bb { avs.clone() } else { self.eval_n(*bb, ats)? };
                let c = class(k.ty(*a).dtype);
                let mut r = Vec::with_capacity(ats.len());
                for (av, bv) in avs.into_iter().zip(bvs) {
                    let y = if op.is_shift() && c == Class::I {
                        vx::shift_lanes(&mut self.b, *op, av, bv, ty.dtype.bits() as u32)
                    } else if let (Class::F, BinaryOp::Max | BinaryOp::Min, Some((cv, xv))) = (c, op, self.nonzero_const_side(*a, *bb, av, bv)) {
                        // Against a constant that is neither zero nor NaN, IEEE `maximum`
                        // (NaN wins, -0 < +0) is the hardware's `max(c, x)` (x when NaN).
                        if *op == BinaryOp::Max { vx::max_over_const(&mut self.b, cv, xv) } else { vx::min_under_const(&mut self.b, cv, xv) }
                    } else {
                        self.binary_vec(*op, c, av, bv)?
                    };
                    r.push(self.norm(y, ty.dtype));
                }
                r
            }
            Inst::Cmp(op, a, bb) => {
                let avs = self.eval_n(*a, ats)?;
                let bvs = if a == bb { avs.clone() } else { self.eval_n(*bb, ats)? };
                let c = class(k.ty(*a).dtype);
                avs.into_iter().zip(bvs).map(|(av, bv)| self.cmp_vec(*op, c, av, bv)).collect()
            }
            Inst::Select { cond, on_true, on_false } => {
                let cs = self.eval_n(*cond, ats)?;
                let ts = self.eval_n(*on_true, ats)?;
                let fs = self.eval_n(*on_false, ats)?;
                cs.into_iter().zip(ts).zip(fs).map(|((c, t), f)| vselect(&mut self.b, c, t, f)).collect()
            }
            Inst::Cast(x) => {
                let xs = self.eval_n(*x, ats)?;
                let from = k.ty(*x).dtype;
                xs.into_iter().map(|xv| self.cast_vec(xv, from, ty.dtype)).collect()
            }
            Inst::Bitcast(x) => {
                let xs = self.eval_n(*x, ats)?;
                // Lanes keep their order: the byte order only matters to Cranelift's verifier.
                let flags = MemFlagsData::new().with_endianness(Endianness::Little);
                let t = if ty.dtype == DType::F32 { F32X4 } else { I32X4 };
                xs.into_iter().map(|xv| self.b.ins().bitcast(t, flags, xv)).collect()
            }
            _ => return unsupported(format!("{v} is not elementwise")),
        };
        Ok(r)
    }

    fn lane_iota(&mut self) -> CV {
        let bytes: Vec<u8> = [0i32, 1, 2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
        let c = self.b.func.dfg.constants.insert(bytes.into());
        self.b.ins().vconst(I32X4, c)
    }

    fn splat_scalar(&mut self, s: CV, dtype: DType) -> CV {
        match class(dtype) {
            Class::F => self.b.ins().splat(F32X4, s),
            Class::I => self.b.ins().splat(I32X4, s),
            Class::B => {
                let m = self.b.ins().bmask(I32, s);
                self.b.ins().splat(I32X4, m)
            }
        }
    }

    /// A float constant (or a broadcast of one) that is neither ±0 nor NaN.
    fn nonzero_float_const(&self, v: Value) -> bool {
        let k = self.k;
        let s = k.as_const(v).or_else(|| match self.inst_of(v).map(|i| &k.inst(i).inst) {
            Some(Inst::Broadcast(x)) => k.as_const(*x),
            _ => None,
        });
        s.is_some_and(|s| {
            let c = Self::const_f32(s, k.ty(v).dtype);
            c != 0.0 && !c.is_nan()
        })
    }

    /// `(constant, other)` of a binary op's evaluated operands when one side is a
    /// [`Self::nonzero_float_const`].
    fn nonzero_const_side(&self, a: Value, b: Value, av: CV, bv: CV) -> Option<(CV, CV)> {
        if self.nonzero_float_const(b) {
            Some((bv, av))
        } else if self.nonzero_float_const(a) {
            Some((av, bv))
        } else {
            None
        }
    }

    fn const_f32(s: Scalar, dtype: DType) -> f32 {
        let x = match s {
            Scalar::Float(x) => x,
            Scalar::Int(i) => i as f64,
            Scalar::Bool(b) => b as u8 as f64,
        };
        match dtype {
            DType::BF16 => bf16::from_f64(x).to_f32(),
            // Through f32 is exact enough: f32 keeps more than 2 * 4 + 2 bits.
            DType::F8E4M3FN | DType::F8E5M2 => tessera_dsl::fp8::round(dtype, x as f32),
            _ => x as f32,
        }
    }

    fn const_i32(s: Scalar, dtype: DType) -> i32 {
        let i = match s {
            Scalar::Int(i) => i as i32,
            Scalar::Float(x) => x as i32,
            Scalar::Bool(b) => b as i32,
        };
        if dtype == DType::I8 { i as i8 as i32 } else { i }
    }

    fn const_bool(s: Scalar) -> bool {
        match s {
            Scalar::Float(x) => x != 0.0,
            Scalar::Int(i) => i != 0,
            Scalar::Bool(b) => b,
        }
    }

    fn const_vec(&mut self, s: Scalar, dtype: DType) -> CV {
        match class(dtype) {
            Class::F => fsplat(&mut self.b, Self::const_f32(s, dtype)),
            Class::I => isplat(&mut self.b, Self::const_i32(s, dtype)),
            Class::B => isplat(&mut self.b, if Self::const_bool(s) { -1 } else { 0 }),
        }
    }

    fn unary_vec(&mut self, op: UnaryOp, c: Class, x: CV) -> R<CV> {
        use UnaryOp::*;
        let b = &mut self.b;
        Ok(match (c, op) {
            (Class::F, Neg) => b.ins().fneg(x),
            (Class::F, Abs) => b.ins().fabs(x),
            (Class::F, Sqrt) => b.ins().sqrt(x),
            (Class::F, Rsqrt) => vx::rsqrt(b, x),
            (Class::F, Exp) if self.exact => vx::per_lane(b, self.h.exp, &[x], F32X4),
            (Class::F, Log) if self.exact => vx::per_lane(b, self.h.log, &[x], F32X4),
            (Class::F, Tanh) if self.exact => vx::per_lane(b, self.h.tanh, &[x], F32X4),
            (Class::F, Erf) if self.exact => vx::per_lane(b, self.h.erf, &[x], F32X4),
            (Class::F, Log1p) => vx::per_lane(b, self.h.log1p, &[x], F32X4),
            (Class::F, Expm1) => vx::per_lane(b, self.h.expm1, &[x], F32X4),
            (Class::F, Sin) => vx::per_lane(b, self.h.sin, &[x], F32X4),
            (Class::F, Cos) => vx::per_lane(b, self.h.cos, &[x], F32X4),
            (Class::F, Floor) => b.ins().floor(x),
            (Class::F, Ceil) => b.ins().ceil(x),
            (Class::F, Round) => b.ins().nearest(x),
            (Class::F, Sign) => vx::sign(b, x),
            (Class::F, Exp) => vx::exp(b, x),
            (Class::F, Log) => vx::log(b, x),
            (Class::F, Tanh) => vx::tanh(b, x),
            (Class::F, Erf) => vx::erf(b, x),
            (Class::I, Neg) => b.ins().ineg(x),
            (Class::I, Abs) => b.ins().iabs(x),
            (Class::I | Class::B, Not) => b.ins().bnot(x),
            _ => return unsupported(format!("`{}` of this dtype", op.name())),
        })
    }

    fn binary_vec(&mut self, op: BinaryOp, c: Class, a: CV, y: CV) -> R<CV> {
        use BinaryOp::*;
        let b = &mut self.b;
        Ok(match (c, op) {
            (Class::F, Add) => b.ins().fadd(a, y),
            (Class::F, Sub) => b.ins().fsub(a, y),
            (Class::F, Mul) => b.ins().fmul(a, y),
            (Class::F, Div) => b.ins().fdiv(a, y),
            (Class::F, Max) => b.ins().fmax(a, y),
            (Class::F, Min) => b.ins().fmin(a, y),
            (Class::F, Rem) => vx::per_lane(b, self.h.fmod, &[a, y], F32X4),
            (Class::F, Pow) => vx::per_lane(b, self.h.pow, &[a, y], F32X4),
            (Class::I, Add) => b.ins().iadd(a, y),
            (Class::I, Sub) => b.ins().isub(a, y),
            (Class::I, Mul) => b.ins().imul(a, y),
            (Class::I, Div) => vx::idiv_lanes(b, a, y, false),
            (Class::I, Rem) => vx::idiv_lanes(b, a, y, true),
            (Class::I, Max) => b.ins().smax(a, y),
            (Class::I, Min) => b.ins().smin(a, y),
            (Class::I | Class::B, And) => b.ins().band(a, y),
            (Class::I | Class::B, Or) => b.ins().bor(a, y),
            (Class::I | Class::B, Xor) => b.ins().bxor(a, y),
            _ => return unsupported(format!("`{}` of this dtype", op.name())),
        })
    }

    fn cmp_vec(&mut self, op: CmpOp, c: Class, a: CV, y: CV) -> CV {
        match c {
            Class::F => self.b.ins().fcmp(float_cc(op), a, y),
            Class::I => self.b.ins().icmp(int_cc(op, true), a, y),
            Class::B => self.b.ins().icmp(int_cc(op, false), a, y),
        }
    }

    fn cast_vec(&mut self, x: CV, from: DType, to: DType) -> CV {
        let b = &mut self.b;
        match (class(from), to) {
            (Class::F, DType::F32) => x,
            (Class::F, DType::BF16) => vx::round_bf16(b, x),
            (Class::F, DType::F8E4M3FN | DType::F8E5M2) => vx::round_fp8(b, x, to == DType::F8E5M2),
            (Class::F, DType::I32) => b.ins().fcvt_to_sint_sat(I32X4, x),
            (Class::F, DType::I8) => {
                let i = b.ins().fcvt_to_sint_sat(I32X4, x);
                let lo = isplat(b, -128);
                let hi = isplat(b, 127);
                let i = b.ins().smax(i, lo);
                b.ins().smin(i, hi)
            }
            (Class::F, DType::Bool) => {
                let z = fsplat(b, 0.0);
                b.ins().fcmp(FloatCC::NotEqual, x, z)
            }
            (Class::I, DType::F32) => b.ins().fcvt_from_sint(F32X4, x),
            (Class::I, DType::BF16) => vx::per_lane(b, self.h.i2bf, &[x], F32X4),
            (Class::I, DType::F8E4M3FN | DType::F8E5M2) => {
                let f = b.ins().fcvt_from_sint(F32X4, x);
                vx::round_fp8(b, f, to == DType::F8E5M2)
            }
            (Class::I, DType::I32) => x,
            (Class::I, DType::I8) => vx::wrap_i8(b, x),
            (Class::I, DType::Bool) => b.ins().icmp_imm_s(IntCC::NotEqual, x, 0),
            (Class::B, DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2) => {
                let one = fsplat(b, 1.0);
                let zero = fsplat(b, 0.0);
                vselect(b, x, one, zero)
            }
            (Class::B, DType::I32 | DType::I8) => {
                let one = isplat(b, 1);
                b.ins().band(x, one)
            }
            (Class::B, DType::Bool) => x,
        }
    }

    // ---- scalars -------------------------------------------------------------------------

    fn emit_scalar(&mut self, i: InstId) -> R<CV> {
        let k = self.k;
        let d = k.inst(i);
        let ty = k.ty(d.results[0]).clone();
        let dt = ty.dtype;
        Ok(match &d.inst {
            Inst::Const(s) => match class(dt) {
                Class::F => self.b.ins().f32const(Self::const_f32(*s, dt)),
                Class::I => self.b.ins().iconst(I32, Self::const_i32(*s, dt) as i64),
                Class::B => self.b.ins().iconst(I8, Self::const_bool(*s) as i64),
            },
            Inst::ProgramId(a) => {
                if *a >= k.grid.len() {
                    return unsupported("program_id of a missing grid axis");
                }
                self.b.ins().load(I32, mflags(), self.grid, (*a * 4) as i32)
            }
            Inst::NumPrograms(a) => {
                let Some(g) = k.grid.get(*a) else { return unsupported("num_programs of a missing grid axis") };
                self.b.ins().iconst(I32, g.extent as i64)
            }
            Inst::Load { src, slices } => {
                self.check_slices("load", *src, slices, &d.loc)?;
                let origin = self.ref_origin(*src, slices)?;
                let x = self.load_scalar_at(origin, 0, k.ref_decl(*src).dtype, false);
                x
            }
            Inst::Unary(op, x) => {
                let xv = self.scalar(*x)?;
                let r = self.unary_scalar(*op, class(k.ty(*x).dtype), xv)?;
                self.norm_scalar(r, dt)
            }
            Inst::Binary(op, a, bb) => {
                let (av, bv) = (self.scalar(*a)?, self.scalar(*bb)?);
                let r = if op.is_shift() && class(k.ty(*a).dtype) == Class::I {
                    vx::shift_scalar(&mut self.b, *op, av, bv, dt.bits() as u32)
                } else {
                    self.binary_scalar(*op, class(k.ty(*a).dtype), av, bv)?
                };
                self.norm_scalar(r, dt)
            }
            Inst::Cmp(op, a, bb) => {
                let (av, bv) = (self.scalar(*a)?, self.scalar(*bb)?);
                match class(k.ty(*a).dtype) {
                    Class::F => self.b.ins().fcmp(float_cc(*op), av, bv),
                    Class::I => self.b.ins().icmp(int_cc(*op, true), av, bv),
                    Class::B => self.b.ins().icmp(int_cc(*op, false), av, bv),
                }
            }
            Inst::Select { cond, on_true, on_false } => {
                let (c, t, f) = (self.scalar(*cond)?, self.scalar(*on_true)?, self.scalar(*on_false)?);
                self.b.ins().select(c, t, f)
            }
            Inst::Cast(x) => {
                let xv = self.scalar(*x)?;
                self.cast_scalar(xv, k.ty(*x).dtype, dt)
            }
            Inst::Bitcast(x) => {
                let xv = self.scalar(*x)?;
                self.b.ins().bitcast(if dt == DType::F32 { F32 } else { I32 }, MemFlagsData::new(), xv)
            }
            Inst::Item(x) => {
                let off = self.ensure_slot(*x)?;
                let addr = self.slot_addr(off);
                self.load_scalar_at(addr, 0, k.ty(*x).dtype, true)
            }
            _ => return unsupported(format!("a scalar `{}`", d.inst.name())),
        })
    }

    fn unary_scalar(&mut self, op: UnaryOp, c: Class, x: CV) -> R<CV> {
        use UnaryOp::*;
        Ok(match (c, op) {
            (Class::F, Neg) => self.b.ins().fneg(x),
            (Class::F, Abs) => self.b.ins().fabs(x),
            (Class::F, Sqrt) => self.b.ins().sqrt(x),
            (Class::F, Rsqrt) => {
                let dd = self.b.ins().fpromote(F64, x);
                let s = self.b.ins().sqrt(dd);
                let one = self.b.ins().f64const(1.0);
                let q = self.b.ins().fdiv(one, s);
                self.b.ins().fdemote(F32, q)
            }
            (Class::F, Floor) => self.b.ins().floor(x),
            (Class::F, Ceil) => self.b.ins().ceil(x),
            (Class::F, Round) => self.b.ins().nearest(x),
            (Class::F, Exp | Log | Tanh | Erf | Log1p | Expm1 | Sin | Cos | Sign) => {
                let v = self.b.ins().splat(F32X4, x);
                let r = self.unary_vec(op, Class::F, v)?;
                self.b.ins().extractlane(r, 0)
            }
            (Class::I, Neg) => self.b.ins().ineg(x),
            (Class::I, Abs) => self.b.ins().iabs(x),
            (Class::I, Not) => self.b.ins().bnot(x),
            (Class::B, Not) => self.b.ins().bxor_imm_s(x, 1),
            _ => return unsupported(format!("`{}` of this dtype", op.name())),
        })
    }

    fn binary_scalar(&mut self, op: BinaryOp, c: Class, a: CV, y: CV) -> R<CV> {
        use BinaryOp::*;
        let call = |s: &mut Self, f: FuncRef| {
            let inst = s.b.ins().call(f, &[a, y]);
            s.b.inst_results(inst)[0]
        };
        Ok(match (c, op) {
            (Class::F, Add) => self.b.ins().fadd(a, y),
            (Class::F, Sub) => self.b.ins().fsub(a, y),
            (Class::F, Mul) => self.b.ins().fmul(a, y),
            (Class::F, Div) => self.b.ins().fdiv(a, y),
            (Class::F, Max) => self.b.ins().fmax(a, y),
            (Class::F, Min) => self.b.ins().fmin(a, y),
            (Class::F, Rem) => call(self, self.h.fmod),
            (Class::F, Pow) => call(self, self.h.pow),
            (Class::I, Add) => self.b.ins().iadd(a, y),
            (Class::I, Sub) => self.b.ins().isub(a, y),
            (Class::I, Mul) => self.b.ins().imul(a, y),
            (Class::I, Div) => vx::idiv_scalar(&mut self.b, a, y, false),
            (Class::I, Rem) => vx::idiv_scalar(&mut self.b, a, y, true),
            (Class::I, Max) => self.b.ins().smax(a, y),
            (Class::I, Min) => self.b.ins().smin(a, y),
            (Class::I | Class::B, And) => self.b.ins().band(a, y),
            (Class::I | Class::B, Or) => self.b.ins().bor(a, y),
            (Class::I | Class::B, Xor) => self.b.ins().bxor(a, y),
            _ => return unsupported(format!("`{}` of this dtype", op.name())),
        })
    }

    fn cast_scalar(&mut self, x: CV, from: DType, to: DType) -> CV {
        match (class(from), to) {
            (Class::F, DType::F32) => x,
            (Class::F, DType::BF16) => vx::via_vector(&mut self.b, x, vx::round_bf16),
            (Class::F, DType::F8E4M3FN | DType::F8E5M2) => vx::via_vector(&mut self.b, x, |b, v| vx::round_fp8(b, v, to == DType::F8E5M2)),
            (Class::F, DType::I32) => self.b.ins().fcvt_to_sint_sat(I32, x),
            (Class::F, DType::I8) => {
                let i = self.b.ins().fcvt_to_sint_sat(I32, x);
                let lo = self.b.ins().iconst(I32, -128);
                let hi = self.b.ins().iconst(I32, 127);
                let i = self.b.ins().smax(i, lo);
                self.b.ins().smin(i, hi)
            }
            (Class::F, DType::Bool) => {
                let z = self.b.ins().f32const(0.0);
                self.b.ins().fcmp(FloatCC::NotEqual, x, z)
            }
            (Class::I, DType::F32) => self.b.ins().fcvt_from_sint(F32, x),
            (Class::I, DType::BF16) => {
                let inst = self.b.ins().call(self.h.i2bf, &[x]);
                self.b.inst_results(inst)[0]
            }
            (Class::I, DType::F8E4M3FN | DType::F8E5M2) => {
                let f = self.b.ins().fcvt_from_sint(F32, x);
                vx::via_vector(&mut self.b, f, |b, v| vx::round_fp8(b, v, to == DType::F8E5M2))
            }
            (Class::I, DType::I32) => x,
            (Class::I, DType::I8) => vx::wrap_i8_scalar(&mut self.b, x),
            (Class::I, DType::Bool) => self.b.ins().icmp_imm_s(IntCC::NotEqual, x, 0),
            (Class::B, DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2) => {
                let w = self.b.ins().uextend(I32, x);
                self.b.ins().fcvt_from_uint(F32, w)
            }
            (Class::B, DType::I32 | DType::I8) => self.b.ins().uextend(I32, x),
            (Class::B, DType::Bool) => x,
        }
    }

    // ---- instructions --------------------------------------------------------------------

    /// Emits `blk`; returns the values its `Yield` yields.
    fn emit_block(&mut self, blk: BlockId) -> R<Vec<Value>> {
        let k = self.k;
        for &i in &k.block(blk).insts {
            let d = k.inst(i);
            match &d.inst {
                Inst::Yield(vs) => return Ok(vs.clone()),
                Inst::Store { dst, slices, value } => self.emit_store(i, *dst, slices, *value)?,
                // Devices talking to each other run on the interpreter, which simulates the mesh.
                Inst::DmaStart { remote: Some(_), .. } | Inst::DmaWait { remote: Some(_), .. } | Inst::SemSignal { .. } | Inst::SemWait { .. } | Inst::DeviceId => {
                    return unsupported("communication between devices (remote copies, semaphores, device ids)")
                }
                Inst::DmaStart { src, dst, sem, sem_index, .. } => self.emit_dma(i, true, src, dst, *sem, *sem_index)?,
                Inst::DmaWait { src, dst, sem, sem_index, .. } => self.emit_dma(i, false, src, dst, *sem, *sem_index)?,
                Inst::PrngSeed(seeds) => self.emit_prng_seed(seeds)?,
                Inst::If { cond, then_block, else_block } => self.emit_if(i, *cond, *then_block, *else_block)?,
                Inst::For { lo, hi, step, init, body } => self.emit_for(i, *lo, *hi, *step, init, *body)?,
                _ => {
                    let &[r] = d.results.as_slice() else { return unsupported("an op without exactly one result") };
                    if self.how[r.index()] == How::Scalar {
                        let v = self.emit_scalar(i)?;
                        self.scalar[r.index()] = Some(v);
                        continue;
                    }
                    if let Inst::Load { src, slices } = &d.inst {
                        if k.ref_decl(*src).memory == MemorySpace::Any {
                            return unsupported("a load from an ANY operand");
                        }
                        self.check_slices("load", *src, slices, &d.loc)?;
                    }
                    if self.how[r.index()] == How::Slot {
                        self.materialise(i, r)?;
                    }
                }
            }
        }
        Ok(Vec::new())
    }

    fn materialise(&mut self, i: InstId, r: Value) -> R<()> {
        let k = self.k;
        let shape = self.shape(r);
        let n: usize = shape.iter().product();
        match &k.inst(i).inst {
            Inst::Reshape(x) => {
                let off = self.ensure_slot(*x)?;
                self.slot[r.index()] = off;
            }
            Inst::Reduce { op, axis, x } => {
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                self.emit_reduce(*op, *axis, *x, off, k.ty(r).dtype)?;
            }
            Inst::Dot { .. } if self.acc_dots.values().any(|&d| d == i) => {} // at its store
            Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs } => {
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                let c = self.slot_addr(off);
                let nn = shape[1] as i64;
                self.emit_dot(*lhs, *rhs, *transpose_lhs, *transpose_rhs, c, nn, false)?;
            }
            Inst::Transpose(x) => {
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                self.emit_transpose(*x, off)?;
            }
            Inst::Concat { axis, parts } => {
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                self.emit_concat(parts, *axis, &shape, off)?;
            }
            Inst::Cumsum { axis, x } => {
                let xt = k.ty(*x).clone();
                if *axis >= xt.rank() || xt.shape != shape {
                    return unsupported("a malformed cumsum");
                }
                let kind = match xt.dtype {
                    DType::F32 => 0,
                    DType::BF16 => 1,
                    DType::I32 => 2,
                    _ => return unsupported("a cumsum of a dtype other than f32, bf16, i32"),
                };
                let src = self.ensure_slot(*x)?;
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                let (outer, len, inner) = (shape[..*axis].iter().product::<usize>(), shape[*axis], shape[*axis + 1..].iter().product::<usize>());
                let (sa, da) = (self.slot_addr(src), self.slot_addr(off));
                let args = [sa, da, self.iconst64(outer as i64), self.iconst64(len as i64), self.iconst64(inner as i64), self.b.ins().iconst(I32, kind)];
                self.b.ins().call(self.h.cumsum, &args);
            }
            Inst::PrngRandomBits => {
                let off = self.alloc(n * 4);
                self.slot[r.index()] = off;
                let da = self.slot_addr(off);
                let site = self.b.ins().iconst(I32, i.index() as i64);
                let count = self.iconst64(n as i64);
                let call = self.b.ins().call(self.h.prng_bits, &[self.rt, site, da, count]);
                let status = self.b.inst_results(call)[0];
                let cont = self.b.create_block();
                self.b.ins().brif(status, self.fail, &[], cont, &[]);
                self.b.switch_to_block(cont);
            }
            _ => {
                // Elementwise (or a load) computed once into its slot.
                let off = self.alloc(n * 4);
                self.how[r.index()] = How::Fused;
                self.emit_group(r, Sink::Slot(off))?;
                self.how[r.index()] = How::Slot;
                self.slot[r.index()] = off;
            }
        }
        Ok(())
    }

    fn emit_store(&mut self, i: InstId, dst: RefId, slices: &[Slice], value: Value) -> R<()> {
        let k = self.k;
        let decl = k.ref_decl(dst);
        if matches!(decl.kind, RefKind::Input | RefKind::Prefetch) {
            return unsupported("a store to an input");
        }
        if decl.memory == MemorySpace::Any {
            return unsupported("a store to an ANY operand");
        }
        self.check_slices("store", dst, slices, &k.inst(i).loc)?;
        let origin = self.ref_origin(dst, slices)?;
        if let Some(&dot) = self.acc_dots.get(&i) {
            if let Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs } = k.inst(dot).inst {
                let rsc = self.layouts[dst.index()].strides[0] as i64;
                return self.emit_dot(lhs, rhs, transpose_lhs, transpose_rhs, origin, rsc, true);
            }
        }
        let vt = k.ty(value).clone();
        if vt.dtype != decl.dtype {
            return unsupported("a store of another dtype");
        }
        if vt.is_scalar() {
            let x = self.scalar(value)?;
            self.store_scalar_at(x, origin, 0, decl.dtype, false, false);
            return Ok(());
        }
        let lens: Vec<usize> = slices.iter().map(|s| s.len).collect();
        if lens != vt.shape {
            return unsupported("a store whose value shape differs from the slice");
        }
        let strided = slices.iter().any(|s| s.stride != 1);
        self.emit_group(value, Sink::Ref(origin, dst, strided.then_some(i)))
    }

    fn emit_dma(&mut self, i: InstId, start: bool, src: &tessera_dsl::DmaRef, dst: &tessera_dsl::DmaRef, sem: RefId, sem_index: Value) -> R<()> {
        let k = self.k;
        let dd = k.ref_decl(dst.r);
        if matches!(dd.kind, RefKind::Input | RefKind::Prefetch) {
            return unsupported("a DMA into an input");
        }
        if k.ref_decl(sem).memory != MemorySpace::Semaphore || dd.memory == MemorySpace::Semaphore || k.ref_decl(src.r).memory == MemorySpace::Semaphore {
            return unsupported("a DMA with a bad semaphore or side");
        }
        if k.ref_decl(src.r).dtype != dd.dtype || dma_box(&src.shape()) != dma_box(&dst.shape()) {
            return unsupported("a DMA between different boxes or dtypes");
        }
        if src.slices.len() != self.layouts[src.r.index()].view.len() || dst.slices.len() != self.layouts[dst.r.index()].view.len() {
            return unsupported("a DMA side with the wrong number of slices");
        }
        if src.slices.iter().chain(&dst.slices).any(|s| s.stride != 1) {
            return unsupported("a strided DMA side");
        }
        let site = self.sites.dmas.len();
        self.sites.dmas.push(DmaSite { start, src: src.r, src_lens: src.shape(), dst: dst.r, dst_lens: dst.shape(), sem, loc: k.inst(i).loc.clone() });
        let mut args = vec![self.scalar(sem_index)?];
        for s in src.slices.iter().chain(&dst.slices) {
            args.push(self.scalar(s.start)?);
        }
        let ss = self.b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, (args.len() * 4) as u32, 2));
        for (j, &a) in args.iter().enumerate() {
            self.b.ins().stack_store(I64, a, ss, (j * 4) as i32);
        }
        let addr = self.b.ins().stack_addr(I64, ss, 0);
        let site_v = self.b.ins().iconst(I32, site as i64);
        let call = self.b.ins().call(self.h.dma, &[self.rt, site_v, addr]);
        let status = self.b.inst_results(call)[0];
        let cont = self.b.create_block();
        self.b.ins().brif(status, self.fail, &[], cont, &[]);
        self.b.switch_to_block(cont);
        Ok(())
    }

    /// `prng_seed(seeds)`: the seeds on the stack, handed to the runtime's generator.
    fn emit_prng_seed(&mut self, seeds: &[Value]) -> R<()> {
        if seeds.is_empty() {
            return unsupported("a prng_seed without seeds");
        }
        let mut args = Vec::with_capacity(seeds.len());
        for &v in seeds {
            args.push(self.scalar(v)?);
        }
        let ss = self.b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, (args.len() * 4) as u32, 2));
        for (j, &a) in args.iter().enumerate() {
            self.b.ins().stack_store(I32, a, ss, (j * 4) as i32);
        }
        let addr = self.b.ins().stack_addr(I64, ss, 0);
        let count = self.iconst64(args.len() as i64);
        self.b.ins().call(self.h.prng_seed, &[self.rt, addr, count]);
        Ok(())
    }

    /// Copies vector `v` (any representation) into the slot at `off`.
    fn write_slot(&mut self, v: Value, off: usize) -> R<()> {
        if self.how[v.index()] == How::Slot && self.slot_of(v)? == off {
            return Ok(());
        }
        self.emit_group(v, Sink::Slot(off))
    }

    fn emit_if(&mut self, i: InstId, cond: Value, then_b: BlockId, else_b: BlockId) -> R<()> {
        let k = self.k;
        let results = k.inst(i).results.clone();
        let c = self.scalar(cond)?;
        let merge = self.b.create_block();
        let mut slots = Vec::new();
        for &r in &results {
            let t = k.ty(r);
            if t.is_scalar() {
                let ct = match class(t.dtype) {
                    Class::F => F32,
                    Class::I => I32,
                    Class::B => I8,
                };
                self.b.append_block_param(merge, ct);
                slots.push(None);
            } else {
                slots.push(Some(self.alloc(t.num_elements() * 4)));
            }
        }
        let (tb, eb) = (self.b.create_block(), self.b.create_block());
        self.b.ins().brif(c, tb, &[], eb, &[]);
        for (blk, cb) in [(then_b, tb), (else_b, eb)] {
            self.b.switch_to_block(cb);
            let ys = self.emit_block(blk)?;
            if ys.len() != results.len() {
                return unsupported("an `if` branch yields the wrong number of values");
            }
            let mut args = Vec::new();
            for (&y, s) in ys.iter().zip(&slots) {
                match s {
                    None => args.push(BlockArg::Value(self.scalar(y)?)),
                    Some(off) => self.write_slot(y, *off)?,
                }
            }
            self.b.ins().jump(merge, &args);
        }
        self.b.switch_to_block(merge);
        let params = self.b.block_params(merge).to_vec();
        let mut p = params.into_iter();
        for (&r, s) in results.iter().zip(&slots) {
            match s {
                None => self.scalar[r.index()] = p.next(),
                Some(off) => {
                    self.how[r.index()] = How::Slot;
                    self.slot[r.index()] = *off;
                }
            }
        }
        Ok(())
    }

    fn emit_for(&mut self, i: InstId, lo: Value, hi: Value, step: i64, init: &[Value], body: BlockId) -> R<()> {
        let k = self.k;
        if step <= 0 {
            return unsupported("a loop step that is not positive");
        }
        let results = k.inst(i).results.clone();
        let params = k.block(body).params.clone();
        if params.len() != init.len() + 1 || results.len() != init.len() {
            return unsupported("a loop whose parameters do not match its carries");
        }
        let lo64 = {
            let v = self.scalar(lo)?;
            self.b.ins().sextend(I64, v)
        };
        let hi64 = {
            let v = self.scalar(hi)?;
            self.b.ins().sextend(I64, v)
        };
        // Vector carries live in slots; scalars are block parameters.
        let mut pslots: Vec<Option<usize>> = Vec::new();
        let mut scalar_init = Vec::new();
        for &v in init {
            let t = k.ty(v);
            if t.is_scalar() {
                scalar_init.push(self.scalar(v)?);
                pslots.push(None);
            } else {
                let off = self.alloc(t.num_elements() * 4);
                self.write_slot(v, off)?;
                pslots.push(Some(off));
            }
        }
        let header = self.b.create_block();
        self.b.append_block_param(header, I64);
        let exit = self.b.create_block();
        for &v in &scalar_init {
            let t = self.b.func.dfg.value_type(v);
            self.b.append_block_param(header, t);
            self.b.append_block_param(exit, t);
        }
        let bodyb = self.b.create_block();
        let mut args = vec![BlockArg::Value(lo64)];
        args.extend(scalar_init.iter().map(|&v| BlockArg::Value(v)));
        self.b.ins().jump(header, &args);
        self.b.switch_to_block(header);
        let hp = self.b.block_params(header).to_vec();
        let c = self.b.ins().icmp(IntCC::SignedLessThan, hp[0], hi64);
        let exit_args: Vec<BlockArg> = hp[1..].iter().map(|&v| BlockArg::Value(v)).collect();
        self.b.ins().brif(c, bodyb, &[], exit, &exit_args);
        self.b.switch_to_block(bodyb);
        let iv = self.b.ins().ireduce(I32, hp[0]);
        self.scalar[params[0].index()] = Some(iv);
        let mut sp = hp[1..].iter();
        for (&p, s) in params[1..].iter().zip(&pslots) {
            match s {
                None => self.scalar[p.index()] = sp.next().copied(),
                Some(off) => {
                    self.how[p.index()] = How::Slot;
                    self.slot[p.index()] = *off;
                }
            }
        }
        let ys = self.emit_block(body)?;
        if ys.len() != init.len() {
            return unsupported("a loop body yields the wrong number of values");
        }
        // Next carries: computed first (into temporaries where they alias this loop's
        // parameters), then copied in.
        let param_offs: Vec<usize> = pslots.iter().flatten().copied().collect();
        let mut sources = Vec::new();
        for (&y, s) in ys.iter().zip(&pslots) {
            if s.is_none() {
                sources.push(None);
                continue;
            }
            let direct = if self.how[y.index()] == How::Slot { self.slot_of(y).ok().filter(|o| !param_offs.contains(o)) } else { None };
            let src = match direct {
                Some(o) => o,
                None => {
                    let n = self.k.ty(y).num_elements();
                    let tmp = self.alloc(n * 4);
                    self.emit_group(y, Sink::Slot(tmp))?;
                    tmp
                }
            };
            sources.push(Some(src));
        }
        let mut next_scalars = Vec::new();
        for ((&y, s), src) in ys.iter().zip(&pslots).zip(&sources) {
            match (s, src) {
                (None, _) => next_scalars.push(self.scalar(y)?),
                (Some(dst), Some(src)) => {
                    let n = self.k.ty(y).num_elements();
                    self.copy_words(*src, *dst, n)?;
                }
                _ => {}
            }
        }
        let n = self.b.ins().iadd_imm_s(hp[0], step);
        let mut args = vec![BlockArg::Value(n)];
        args.extend(next_scalars.iter().map(|&v| BlockArg::Value(v)));
        self.b.ins().jump(header, &args);
        self.b.switch_to_block(exit);
        let ep = self.b.block_params(exit).to_vec();
        let mut e = ep.into_iter();
        for (&r, s) in results.iter().zip(&pslots) {
            match s {
                None => self.scalar[r.index()] = e.next(),
                Some(off) => {
                    self.how[r.index()] = How::Slot;
                    self.slot[r.index()] = *off;
                }
            }
        }
        Ok(())
    }

    /// Copies `n` 4-byte words between frame slots.
    fn copy_words(&mut self, src: usize, dst: usize, n: usize) -> R<()> {
        let (s, d) = (self.slot_addr(src), self.slot_addr(dst));
        let mut body = |me: &mut Self, _idx: &[CV], js: &[CV], lanes: u8| -> R<()> {
            for &j in js {
                let off = me.b.ins().imul_imm_s(j, 4);
                let sa = me.b.ins().iadd(s, off);
                let da = me.b.ins().iadd(d, off);
                let at = At { idx: vec![], lane: true, lanes };
                let v = me.load_lanes(sa, DType::I32, true, &at);
                me.store_lanes(v, da, DType::I32, true, lanes);
            }
            Ok(())
        };
        self.loop_nest(&[], n, &mut body)
    }

    fn emit_transpose(&mut self, x: Value, off: usize) -> R<()> {
        let shape = self.shape(x);
        if shape.len() < 2 {
            return unsupported("a transpose below rank 2");
        }
        let src = self.ensure_slot(x)?;
        let r = shape.len();
        let (rows, cols) = (shape[r - 2], shape[r - 1]);
        let batch: usize = shape[..r - 2].iter().product();
        let (s, d) = (self.slot_addr(src), self.slot_addr(off));
        let mut outer = |me: &mut Self, bi: CV| -> R<()> {
            let mut rowf = |me: &mut Self, i: CV| -> R<()> {
                let mut colf = |me: &mut Self, j: CV| -> R<()> {
                    let base = me.b.ins().imul_imm_s(bi, (rows * cols * 4) as i64);
                    let si = me.b.ins().imul_imm_s(i, (cols * 4) as i64);
                    let sj = me.b.ins().imul_imm_s(j, 4);
                    let so = me.b.ins().iadd(base, si);
                    let so = me.b.ins().iadd(so, sj);
                    let sa = me.b.ins().iadd(s, so);
                    let x = me.b.ins().load(I32, mflags(), sa, 0);
                    let dj = me.b.ins().imul_imm_s(j, (rows * 4) as i64);
                    let di = me.b.ins().imul_imm_s(i, 4);
                    let dof = me.b.ins().iadd(base, dj);
                    let dof = me.b.ins().iadd(dof, di);
                    let da = me.b.ins().iadd(d, dof);
                    me.b.ins().store(mflags(), x, da, 0);
                    Ok(())
                };
                me.counted(0, cols as i64, 1, &mut colf)
            };
            me.counted(0, rows as i64, 1, &mut rowf)
        };
        self.counted(0, batch as i64, 1, &mut outer)
    }

    /// `parts` joined along `axis` into the slot at `off` (result shape `shape`): for every
    /// index of the dims before `axis`, each part's contiguous run copied in turn.
    fn emit_concat(&mut self, parts: &[Value], axis: usize, shape: &[usize], off: usize) -> R<()> {
        let outer: usize = shape[..axis].iter().product();
        let total: usize = shape[axis..].iter().product();
        let d = self.slot_addr(off);
        let mut at = 0usize;
        for &p in parts {
            let run: usize = self.shape(p)[axis..].iter().product();
            let src = self.ensure_slot(p)?;
            let s = self.slot_addr(src);
            let mut outerf = |me: &mut Self, o: CV| -> R<()> {
                let mut elemf = |me: &mut Self, e: CV| -> R<()> {
                    let so = me.b.ins().imul_imm_s(o, (run * 4) as i64);
                    let se = me.b.ins().imul_imm_s(e, 4);
                    let so = me.b.ins().iadd(so, se);
                    let sa = me.b.ins().iadd(s, so);
                    let x = me.b.ins().load(I32, mflags(), sa, 0);
                    let dof = me.b.ins().imul_imm_s(o, (total * 4) as i64);
                    let dof = me.b.ins().iadd_imm_s(dof, (at * 4) as i64);
                    let dof = me.b.ins().iadd(dof, se);
                    let da = me.b.ins().iadd(d, dof);
                    me.b.ins().store(mflags(), x, da, 0);
                    Ok(())
                };
                me.counted(0, run as i64, 1, &mut elemf)
            };
            self.counted(0, outer as i64, 1, &mut outerf)?;
            at += run;
        }
        Ok(())
    }

    /// A dot operand read straight from a ref (a load fused into the dot), if it is one
    /// of `dtype`: pointer, row stride, column stride (elements).
    fn dot_memview(&mut self, v: Value, dtype: DType) -> R<Option<(CV, i64, i64)>> {
        if self.how[v.index()] != How::Dup {
            return Ok(None);
        }
        let Some(i) = self.inst_of(v) else { return Ok(None) };
        if let Inst::Load { src, slices } = &self.k.inst(i).inst {
            let l = &self.layouts[src.index()];
            if l.dtype == dtype && l.strides.len() == 2 && slices.len() == 2 {
                let (rs, cs) = ((l.strides[0] * slices[0].stride) as i64, (l.strides[1] * slices[1].stride) as i64);
                let p = self.ref_origin(*src, slices)?;
                return Ok(Some((p, rs, cs)));
            }
        }
        Ok(None)
    }

    /// A dot operand as f32 (or i32) memory: pointer, row stride, column stride (elements).
    fn dot_operand(&mut self, v: Value, float: bool) -> R<(CV, i64, i64)> {
        let shape = self.shape(v);
        if shape.len() != 2 {
            return unsupported("a dot operand that is not rank 2");
        }
        if let Some(m) = self.dot_memview(v, if float { DType::F32 } else { DType::I32 })? {
            return Ok(m);
        }
        let off = self.ensure_slot(v)?;
        Ok((self.slot_addr(off), shape[1] as i64, 1))
    }

    /// `c (+)= lhs @ rhs` into f32/i32 memory at `c` with row stride `rsc` elements.
    #[allow(clippy::too_many_arguments)]
    fn emit_dot(&mut self, lhs: Value, rhs: Value, ta: bool, tb: bool, c: CV, rsc: i64, accumulate: bool) -> R<()> {
        let (ls, rs) = (self.shape(lhs), self.shape(rhs));
        if ls.len() != 2 || rs.len() != 2 {
            return unsupported("a dot of operands that are not rank 2");
        }
        let float = class(self.k.ty(lhs).dtype) == Class::F;
        if class(self.k.ty(rhs).dtype) != class(self.k.ty(lhs).dtype) || class(self.k.ty(lhs).dtype) == Class::B {
            return unsupported("a dot of these dtypes");
        }
        let (m, kk) = if ta { (ls[1], ls[0]) } else { (ls[0], ls[1]) };
        let (k2, n) = if tb { (rs[1], rs[0]) } else { (rs[0], rs[1]) };
        if kk != k2 {
            return unsupported("a dot whose contracting dims differ");
        }
        // bf16 operands both read from bf16 memory: the bf16 GEMM, without widening copies.
        let bf = if float && self.k.ty(lhs).dtype == DType::BF16 && self.k.ty(rhs).dtype == DType::BF16 {
            match (self.dot_memview(lhs, DType::BF16)?, self.dot_memview(rhs, DType::BF16)?) {
                (Some(a), Some(b)) => Some((a, b)),
                _ => None,
            }
        } else {
            None
        };
        let ((a, mut rsa, mut csa), (bp, mut rsb, mut csb), f) = match bf {
            Some((a, b)) => (a, b, self.h.dot_bf16),
            None => {
                let a = self.dot_operand(lhs, float)?;
                let b = self.dot_operand(rhs, float)?;
                (a, b, if float { self.h.dot_f32 } else { self.h.dot_i32 })
            }
        };
        if ta {
            std::mem::swap(&mut rsa, &mut csa);
        }
        if tb {
            std::mem::swap(&mut rsb, &mut csb);
        }
        let vals = [m as i64, kk as i64, n as i64];
        let mut args = vec![self.rt];
        for x in vals {
            args.push(self.iconst64(x));
        }
        args.push(a);
        args.push(self.iconst64(rsa));
        args.push(self.iconst64(csa));
        args.push(bp);
        args.push(self.iconst64(rsb));
        args.push(self.iconst64(csb));
        args.push(c);
        args.push(self.iconst64(rsc));
        args.push(self.b.ins().iconst(I32, accumulate as i64));
        self.b.ins().call(f, &args);
        Ok(())
    }

    // ---- reductions ----------------------------------------------------------------------

    fn combine(&mut self, op: ReduceOp, c: Class, a: CV, y: CV) -> CV {
        let b = &mut self.b;
        match (op, c) {
            (ReduceOp::Sum, Class::F) => b.ins().fadd(a, y),
            (ReduceOp::Sum, _) => b.ins().iadd(a, y),
            (ReduceOp::Max, Class::F) => b.ins().fmax(a, y),
            (ReduceOp::Max, Class::I) => b.ins().smax(a, y),
            (ReduceOp::Max, Class::B) => b.ins().bor(a, y),
            (ReduceOp::Min, Class::F) => b.ins().fmin(a, y),
            (ReduceOp::Min, Class::I) => b.ins().smin(a, y),
            (ReduceOp::Min, Class::B) => b.ins().band(a, y),
        }
    }

    fn emit_reduce(&mut self, op: ReduceOp, axis: usize, x: Value, off: usize, dtype: DType) -> R<()> {
        let xs = self.shape(x);
        let r = xs.len();
        if axis >= r || xs.contains(&0) {
            return unsupported("a reduction along a missing axis");
        }
        let c = class(self.k.ty(x).dtype);
        if op == ReduceOp::Sum && c == Class::B {
            return unsupported("a sum of bools");
        }
        let n = xs[axis];
        let mut out_shape = xs.clone();
        out_shape[axis] = 1;
        let out_strides = crate::cpu::layout::row_major(&out_shape);
        let base = self.slot_addr(off);
        let nchunks = n.div_ceil(interp_chunk());
        let sums = if nchunks > 1 { Some(self.alloc(nchunks * 16)) } else { None };
        if axis + 1 == r {
            // Along the lanes: one scalar result per row.
            let outer = xs[..r - 1].to_vec();
            let mut row = |me: &mut Self, idx: &[CV]| -> R<()> {
                let idx: Vec<Option<CV>> = idx.iter().map(|&i| Some(i)).collect();
                let s = me.reduce_minor(op, c, x, &idx, n, sums)?;
                let s = me.finish_reduce_scalar(s, dtype);
                let mut oi = idx.clone();
                oi.push(None);
                let addr = me.addr(base, &oi, &out_strides, 4);
                me.b.ins().store(mflags(), s, addr, 0);
                Ok(())
            };
            self.for_each_index(&outer, &mut Vec::new(), &mut row)
        } else {
            // Along an outer dim: lanes run along the last dim.
            let before = xs[..axis].to_vec();
            let between = xs[axis + 1..r - 1].to_vec();
            let last = xs[r - 1];
            let mut dims = before.clone();
            dims.extend(&between);
            let mut per = |me: &mut Self, idx: &[CV]| -> R<()> {
                let (pre, mid) = idx.split_at(before.len());
                let (pre, mid) = (pre.to_vec(), mid.to_vec());
                let mut lanes_f = |me: &mut Self, _o: &[CV], js: &[CV], lanes: u8| -> R<()> {
                    for &j in js {
                        let mut at_of = |k: Option<CV>| {
                            let mut v: Vec<Option<CV>> = pre.iter().map(|&i| Some(i)).collect();
                            v.push(k);
                            v.extend(mid.iter().map(|&i| Some(i)));
                            v.push(Some(j));
                            v
                        };
                        let s = me.reduce_outer(op, c, x, &mut at_of, lanes, n, sums)?;
                        let s = me.norm(s, dtype);
                        let oi = at_of(None);
                        let addr = me.addr(base, &oi, &out_strides, 4);
                        me.store_lanes(s, addr, dtype, true, lanes);
                    }
                    Ok(())
                };
                me.loop_nest(&[], last, &mut lanes_f)
            };
            self.for_each_index(&dims, &mut Vec::new(), &mut per)
        }
    }

    fn for_each_index(&mut self, dims: &[usize], idx: &mut Vec<CV>, f: &mut dyn FnMut(&mut Self, &[CV]) -> R<()>) -> R<()> {
        if idx.len() == dims.len() {
            let idx = idx.clone();
            return f(self, &idx);
        }
        let extent = dims[idx.len()];
        let mut run = |s: &mut Self, i: CV| -> R<()> {
            idx.push(i);
            let r = s.for_each_index(dims, idx, f);
            idx.pop();
            r
        };
        self.counted(0, extent as i64, 1, &mut run)
    }

    fn finish_reduce_scalar(&mut self, s: CV, dtype: DType) -> CV {
        match dtype {
            DType::BF16 => vx::via_vector(&mut self.b, s, vx::round_bf16),
            DType::I8 => vx::wrap_i8_scalar(&mut self.b, s),
            DType::F8E4M3FN | DType::F8E5M2 => vx::via_vector(&mut self.b, s, |b, v| vx::round_fp8(b, v, dtype == DType::F8E5M2)),
            _ => s,
        }
    }

    /// Element `k` (i64) of the reduced row as a scalar register (bools as i32 masks).
    fn row_elem(&mut self, x: Value, idx: &[Option<CV>], k: CV) -> R<CV> {
        let mut full = idx.to_vec();
        full.push(Some(k));
        let v = self.eval(x, &At { idx: full, lane: true, lanes: 1 })?;
        Ok(self.b.ins().extractlane(v, 0))
    }

    fn row_vec(&mut self, x: Value, idx: &[Option<CV>], k: CV) -> R<CV> {
        let mut full = idx.to_vec();
        full.push(Some(k));
        self.eval(x, &At { idx: full, lane: true, lanes: 4 })
    }

    /// One reduced row in the interpreter's order (`interp::pairwise_sum`).
    fn reduce_minor(&mut self, op: ReduceOp, c: Class, x: Value, idx: &[Option<CV>], n: usize, sums: Option<usize>) -> R<CV> {
        let chunk = interp_chunk();
        let full_chunks = n / chunk;
        let tail = n % chunk;
        let Some(sums) = sums else {
            let z = self.iconst64(0);
            return self.chunk_minor(op, c, x, idx, z, n);
        };
        let sums_addr = self.slot_addr(sums);
        if full_chunks > 0 {
            let mut f = |me: &mut Self, ci: CV| -> R<()> {
                let start = me.b.ins().imul_imm_s(ci, chunk as i64);
                let s = me.chunk_minor(op, c, x, idx, start, chunk)?;
                let a = me.b.ins().imul_imm_s(ci, 16);
                let a = me.b.ins().iadd(sums_addr, a);
                me.b.ins().store(mflags(), s, a, 0);
                Ok(())
            };
            self.counted(0, full_chunks as i64, 1, &mut f)?;
        }
        if tail > 0 {
            let start = self.iconst64((full_chunks * chunk) as i64);
            let s = self.chunk_minor(op, c, x, idx, start, tail)?;
            self.b.ins().store(mflags(), s, sums_addr, (full_chunks * 16) as i32);
        }
        let st = if c == Class::F { F32 } else { I32 };
        self.pairwise(op, c, sums_addr, n.div_ceil(chunk), st)
    }

    /// Combines `count` partial results (16 bytes apart) at `addr` in passes; returns the
    /// result (of type `ty`: a scalar or a vector).
    fn pairwise(&mut self, op: ReduceOp, c: Class, addr: CV, mut count: usize, ty: CT) -> R<CV> {
        while count > 1 {
            let half = count / 2;
            let mut f = |me: &mut Self, i: CV| -> R<()> {
                let o = me.b.ins().imul_imm_s(i, 32);
                let a = me.b.ins().iadd(addr, o);
                let x = me.b.ins().load(ty, mflags(), a, 0);
                let y = me.b.ins().load(ty, mflags(), a, 16);
                let s = me.combine(op, c, x, y);
                let o = me.b.ins().imul_imm_s(i, 16);
                let d = me.b.ins().iadd(addr, o);
                me.b.ins().store(mflags(), s, d, 0);
                Ok(())
            };
            self.counted(0, half as i64, 1, &mut f)?;
            if count % 2 == 1 {
                let x = self.b.ins().load(ty, mflags(), addr, ((count - 1) * 16) as i32);
                self.b.ins().store(mflags(), x, addr, (half * 16) as i32);
            }
            count = count.div_ceil(2);
        }
        Ok(self.b.ins().load(ty, mflags(), addr, 0))
    }

    fn chunk_minor(&mut self, op: ReduceOp, c: Class, x: Value, idx: &[Option<CV>], start: CV, len: usize) -> R<CV> {
        if len < 8 {
            let mut s = self.row_elem(x, idx, start)?;
            for j in 1..len {
                let k = self.b.ins().iadd_imm_s(start, j as i64);
                let e = self.row_elem(x, idx, k)?;
                s = self.combine(op, c, s, e);
            }
            return Ok(s);
        }
        // Sums keep the interpreter's two accumulators (its order is the result). A max or
        // min is the same in any order (IEEE maximum / minimum: NaN wins, -0 < +0), so it
        // takes four: a float `fmax` is a sequence of ~8 dependent instructions, and with
        // two chains the loop waits on their latency.
        let k = if op != ReduceOp::Sum && len >= 16 { 4 } else { 2 };
        let w = 4 * k;
        let mut init = Vec::with_capacity(k);
        for i in 0..k {
            let at = self.b.ins().iadd_imm_s(start, 4 * i as i64);
            init.push(self.row_vec(x, idx, at)?);
        }
        let groups = len / w;
        let idx_v = idx.to_vec();
        let mut body = |me: &mut Self, t: CV, acc: &[CV]| -> R<Vec<CV>> {
            let base = me.b.ins().iadd(start, t);
            let mut next = Vec::with_capacity(acc.len());
            for (i, &a) in acc.iter().enumerate() {
                let at = me.b.ins().iadd_imm_s(base, 4 * i as i64);
                let v = me.row_vec(x, &idx_v, at)?;
                next.push(me.combine(op, c, a, v));
            }
            Ok(next)
        };
        let acc = self.counted_carry(w as i64, (groups * w) as i64, w as i64, init, &mut body)?;
        let (mut lo, mut hi) = (acc[0], acc[1]);
        let mut done = groups * w;
        if k == 4 {
            lo = self.combine(op, c, lo, acc[2]);
            hi = self.combine(op, c, hi, acc[3]);
            if done + 8 <= len {
                let at = self.b.ins().iadd_imm_s(start, done as i64);
                let v = self.row_vec(x, idx, at)?;
                lo = self.combine(op, c, lo, v);
                let at = self.b.ins().iadd_imm_s(start, done as i64 + 4);
                let v = self.row_vec(x, idx, at)?;
                hi = self.combine(op, c, hi, v);
                done += 8;
            }
        }
        let t = self.combine(op, c, lo, hi);
        let l: Vec<CV> = (0..4u8).map(|i| self.b.ins().extractlane(t, i)).collect();
        let u0 = self.combine(op, c, l[0], l[2]);
        let u1 = self.combine(op, c, l[1], l[3]);
        let mut s = self.combine(op, c, u0, u1);
        for j in done..len {
            let k = self.b.ins().iadd_imm_s(start, j as i64);
            let e = self.row_elem(x, idx, k)?;
            s = self.combine(op, c, s, e);
        }
        Ok(s)
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce_outer(&mut self, op: ReduceOp, c: Class, x: Value, at_of: &mut dyn FnMut(Option<CV>) -> Vec<Option<CV>>, lanes: u8, n: usize, sums: Option<usize>) -> R<CV> {
        let chunk = interp_chunk();
        let full_chunks = n / chunk;
        let tail = n % chunk;
        let Some(sums) = sums else {
            let z = self.iconst64(0);
            return self.chunk_outer(op, c, x, at_of, lanes, z, n);
        };
        let sums_addr = self.slot_addr(sums);
        if full_chunks > 0 {
            let mut f = |me: &mut Self, ci: CV| -> R<()> {
                let start = me.b.ins().imul_imm_s(ci, chunk as i64);
                let s = me.chunk_outer(op, c, x, at_of, lanes, start, chunk)?;
                let a = me.b.ins().imul_imm_s(ci, 16);
                let a = me.b.ins().iadd(sums_addr, a);
                me.b.ins().store(mflags(), s, a, 0);
                Ok(())
            };
            self.counted(0, full_chunks as i64, 1, &mut f)?;
        }
        if tail > 0 {
            let start = self.iconst64((full_chunks * chunk) as i64);
            let s = self.chunk_outer(op, c, x, at_of, lanes, start, tail)?;
            self.b.ins().store(mflags(), s, sums_addr, (full_chunks * 16) as i32);
        }
        let vt = Self::vty(c);
        self.pairwise(op, c, sums_addr, n.div_ceil(chunk), vt)
    }

    #[allow(clippy::too_many_arguments)]
    fn chunk_outer(&mut self, op: ReduceOp, c: Class, x: Value, at_of: &mut dyn FnMut(Option<CV>) -> Vec<Option<CV>>, lanes: u8, start: CV, len: usize) -> R<CV> {
        let elem = |me: &mut Self, at_of: &mut dyn FnMut(Option<CV>) -> Vec<Option<CV>>, k: CV| -> R<CV> {
            let idx = at_of(Some(k));
            me.eval(x, &At { idx, lane: true, lanes })
        };
        if len < 8 {
            let mut s = elem(self, at_of, start)?;
            for j in 1..len {
                let k = self.b.ins().iadd_imm_s(start, j as i64);
                let e = elem(self, at_of, k)?;
                s = self.combine(op, c, s, e);
            }
            return Ok(s);
        }
        let mut init = Vec::with_capacity(8);
        for j in 0..8 {
            let k = self.b.ins().iadd_imm_s(start, j);
            init.push(elem(self, at_of, k)?);
        }
        let groups = len / 8;
        let mut body = |me: &mut Self, t: CV, acc: &[CV]| -> R<Vec<CV>> {
            let base = me.b.ins().iadd(start, t);
            let mut out = Vec::with_capacity(8);
            for (j, &a) in acc.iter().enumerate() {
                let k = me.b.ins().iadd_imm_s(base, j as i64);
                let e = elem(me, at_of, k)?;
                out.push(me.combine(op, c, a, e));
            }
            Ok(out)
        };
        let r = self.counted_carry(8, (groups * 8) as i64, 8, init, &mut body)?;
        let a = self.combine(op, c, r[0], r[4]);
        let bb = self.combine(op, c, r[2], r[6]);
        let p = self.combine(op, c, a, bb);
        let a = self.combine(op, c, r[1], r[5]);
        let bb = self.combine(op, c, r[3], r[7]);
        let q = self.combine(op, c, a, bb);
        let mut s = self.combine(op, c, p, q);
        for j in groups * 8..len {
            let k = self.b.ins().iadd_imm_s(start, j as i64);
            let e = elem(self, at_of, k)?;
            s = self.combine(op, c, s, e);
        }
        Ok(s)
    }
}

/// A cast that changes nothing in registers (same storage class, no rounding or wrapping).
fn free_cast(from: DType, to: DType) -> bool {
    matches!((from, to), (DType::F32 | DType::BF16, DType::F32) | (DType::BF16, DType::BF16) | (DType::I8 | DType::I32, DType::I32) | (DType::I8, DType::I8) | (DType::Bool, DType::Bool))
}

fn interp_chunk() -> usize {
    tessera_dsl::interp::SUM_CHUNK
}

fn dma_box(shape: &[usize]) -> Vec<usize> {
    tessera_dsl::dma_box(shape).to_vec()
}

fn float_cc(op: CmpOp) -> FloatCC {
    match op {
        CmpOp::Eq => FloatCC::Equal,
        CmpOp::Ne => FloatCC::NotEqual,
        CmpOp::Lt => FloatCC::LessThan,
        CmpOp::Le => FloatCC::LessThanOrEqual,
        CmpOp::Gt => FloatCC::GreaterThan,
        CmpOp::Ge => FloatCC::GreaterThanOrEqual,
    }
}

fn int_cc(op: CmpOp, signed: bool) -> IntCC {
    match (op, signed) {
        (CmpOp::Eq, _) => IntCC::Equal,
        (CmpOp::Ne, _) => IntCC::NotEqual,
        (CmpOp::Lt, true) => IntCC::SignedLessThan,
        (CmpOp::Le, true) => IntCC::SignedLessThanOrEqual,
        (CmpOp::Gt, true) => IntCC::SignedGreaterThan,
        (CmpOp::Ge, true) => IntCC::SignedGreaterThanOrEqual,
        (CmpOp::Lt, false) => IntCC::UnsignedLessThan,
        (CmpOp::Le, false) => IntCC::UnsignedLessThanOrEqual,
        (CmpOp::Gt, false) => IntCC::UnsignedGreaterThan,
        (CmpOp::Ge, false) => IntCC::UnsignedGreaterThanOrEqual,
    }
}
