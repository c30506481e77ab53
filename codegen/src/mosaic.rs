//! Block IR -> Mosaic TPU kernel module, in the *stable serialized* generic text form
//! that libtpu deserializes when `"serialization_format": 1` is set (DESIGN.md §3):
//!
//! ```text
//! "builtin.module"() ({
//!   "stable_mosaic.func.func"() ({ ^bb0(grid..., prefetch..., inputs..., outputs..., scratch...): ... })
//!       {dimension_semantics, function_type, iteration_bounds, scalar_prefetch, scratch_operands,
//!        sym_name, tpu.core_type, window_params} : () -> ()
//!   "stable_mosaic.func.func"() ({ ^bb0(grid..., prefetch...): ... }) {sym_name = "transform_i"} ...
//! }) {stable_mosaic.version = 11 : i64} : () -> ()
//! ```
//!
//! The op spellings follow what JAX 0.10.2 Pallas emits (see `/work/shared/reference/mosaic`).

use std::collections::HashMap;

use tessera_dsl::ir::*;
use tessera_dsl::{DType, MemorySpace, Target, Type};

use crate::text::{dense_array, float_lit, memref_ty, mlir_string, result_list, signature, ty, vector_ty, Ssa, Text};
use crate::CodegenError;

/// The stable Mosaic version we declare. JAX 0.10.2 (the jaxlib paired with libtpu 0.0.52)
/// serializes version 11; libtpu 0.0.52 accepts 1..=20 and upgrades older versions itself.
/// Declaring 11 means the op syntax we write is exactly the syntax of that version (e.g.
/// `tpu.matmul` with `transpose_lhs`/`transpose_rhs`), so newer compilers keep upgrading it.
pub const STABLE_MOSAIC_VERSION: u32 = 11;

const FASTMATH: &str = "fastmath = #arith.fastmath<none>";
const OVERFLOW: &str = "overflowFlags = #arith.overflow<none>";

/// Emits the Mosaic kernel module for `kernel` (assumed verified for `target`).
pub fn emit(kernel: &Kernel, target: &Target) -> Result<String, CodegenError> {
    let mut t = Text::new();
    t.line("\"builtin.module\"() ({");
    t.indent();
    let passed = passed_refs(kernel);
    emit_kernel_func(kernel, &passed, target, &mut t)?;
    for (n, r) in window_operands(kernel, &passed) {
        if let Some(map) = index_map(r) {
            emit_transform(kernel, n, &map, &mut t);
        }
    }
    t.dedent();
    t.line(&format!("}}) {{stable_mosaic.version = {STABLE_MOSAIC_VERSION} : i64}} : () -> ()"));
    Ok(t.finish())
}

/// Per ref (indexed by `RefId`), whether Mosaic sees it: every ref but the inputs no
/// instruction touches ([`Kernel::touched_refs`]), which the StableHLO wrapper also leaves
/// out of the custom call's operands.
pub(crate) fn passed_refs(k: &Kernel) -> Vec<bool> {
    k.refs.iter().zip(k.touched_refs()).map(|(r, touched)| r.kind != RefKind::Input || touched).collect()
}

/// The passed inputs and outputs in order, numbered as Pallas numbers its window params.
fn window_operands<'k>(k: &'k Kernel, passed: &'k [bool]) -> impl Iterator<Item = (usize, &'k RefDecl)> {
    k.refs.iter().zip(passed).filter(|(r, &p)| p && matches!(r.kind, RefKind::Input | RefKind::Output)).map(|(r, _)| r).enumerate()
}

/// The index map a window operand gets: its block map, or all zeros for an operand the
/// kernel sees whole in VMEM/SMEM. ANY (HBM) operands get no window (`{}`).
fn index_map(r: &RefDecl) -> Option<Vec<IndexExpr>> {
    match (&r.block, r.memory) {
        (Some(b), _) => Some(b.index_map.clone()),
        (None, MemorySpace::Any) => None,
        (None, _) => Some(vec![IndexExpr::Const(0); r.shape.len()]),
    }
}

fn ref_ty(r: &RefDecl) -> String {
    memref_ty(r.dtype, &r.window(), r.memory)
}

/// `(i32, ..., memref<...>, ...)` types of the grid indices and scalar-prefetch memrefs.
fn grid_and_prefetch_types(k: &Kernel) -> Vec<String> {
    let mut v: Vec<String> = k.grid.iter().map(|_| "i32".to_string()).collect();
    v.extend(k.refs_of(RefKind::Prefetch).map(|(_, r)| ref_ty(r)));
    v
}

fn block_header(args: &[Ssa]) -> String {
    let a: Vec<String> = args.iter().map(|a| format!("{}: {}", a.name, a.ty)).collect();
    format!("^bb0({}):", a.join(", "))
}

// ---- the kernel function ----------------------------------------------------------------

fn emit_kernel_func(k: &Kernel, passed: &[bool], target: &Target, t: &mut Text) -> Result<(), CodegenError> {
    let mut arg_types = grid_and_prefetch_types(k);
    arg_types.extend(k.refs.iter().zip(passed).filter(|(r, &p)| p && r.kind != RefKind::Prefetch).map(|(r, _)| ref_ty(r)));
    let args: Vec<Ssa> = arg_types.iter().enumerate().map(|(i, ty)| Ssa::new(format!("%arg{i}"), ty.clone())).collect();
    let ngrid = k.grid.len();
    let grid = args[..ngrid].to_vec();
    // Refs in kernel order (prefetch, inputs, outputs, scratch) follow the grid args; an
    // input that is not passed has no argument (no instruction names it).
    let mut memrefs = args[ngrid..].iter();
    let refs: Vec<Ssa> = passed.iter().map(|&p| if p { memrefs.next().expect("one argument per passed ref").clone() } else { Ssa::new("%unpassed", "none") }).collect();

    t.line("\"stable_mosaic.func.func\"() ({");
    t.line(&block_header(&args));
    t.indent();
    let multiples = tessera_dsl::verify::Multiples::of(k);
    let mut lower = Lower { k, target, t, grid, refs, vals: HashMap::new(), multiples, live: k.live_insts() };
    lower.block(k.body)?;
    lower.t.op0("func.return", &[], "");
    t.dedent();

    let sems: Vec<String> = k.grid.iter().map(|g| format!("#tpu.dimension_semantics<{}>", g.semantics.name())).collect();
    let windows: Vec<String> = window_operands(k, passed)
        .map(|(n, r)| match index_map(r) {
            None => "{}".to_string(),
            Some(_) => {
                let bounds = dense_array("i64", r.window().iter().map(|&d| d as i64));
                format!("{{transform_indices = @transform_{n}, window_bounds = {bounds}}}")
            }
        })
        .collect();
    let attrs = [
        format!("dimension_semantics = [{}]", sems.join(", ")),
        format!("function_type = {}", signature(arg_types.iter().map(String::as_str), &[])),
        // A dynamic dim is INT64_MIN; its extent is a leading custom-call operand.
        format!("iteration_bounds = {}", dense_array("i64", k.grid.iter().map(|g| if g.dynamic.is_some() { i64::MIN } else { g.extent as i64 }))),
        format!("scalar_prefetch = {} : i64", k.refs_of(RefKind::Prefetch).count()),
        format!("scratch_operands = {} : i64", k.refs_of(RefKind::Scratch).count()),
        format!("sym_name = {}", mlir_string(&k.name)),
        "tpu.core_type = #tpu.core_type<tc>".to_string(),
        format!("window_params = [{}]", windows.join(", ")),
    ];
    t.line(&format!("}}) {{{}}} : () -> ()", attrs.join(", ")));
    Ok(())
}

// ---- transform (index map) functions ------------------------------------------------------

fn emit_transform(k: &Kernel, n: usize, map: &[IndexExpr], t: &mut Text) {
    let arg_types = grid_and_prefetch_types(k);
    let args: Vec<Ssa> = arg_types.iter().enumerate().map(|(i, ty)| Ssa::new(format!("%arg{i}"), ty.clone())).collect();
    // Prefetch ref id -> its memref argument.
    let prefetch: HashMap<RefId, Ssa> = k.refs_of(RefKind::Prefetch).zip(&args[k.grid.len()..]).map(|((id, _), a)| (id, a.clone())).collect();
    t.line("\"stable_mosaic.func.func\"() ({");
    t.line(&block_header(&args));
    t.indent();
    // Simplified over the grid: Mosaic evaluates the map on the scalar unit at every step.
    let extents: Vec<usize> = k.grid.iter().map(|g| g.extent).collect();
    let outs: Vec<Ssa> = map.iter().map(|e| index_expr(&e.simplified(&extents), &args, &prefetch, t)).collect();
    let refs: Vec<&Ssa> = outs.iter().collect();
    t.op0("func.return", &refs, "");
    t.dedent();
    let results = vec!["i32".to_string(); map.len()];
    let fty = format!("({}) -> {}", arg_types.join(", "), result_list(&results));
    t.line(&format!("}}) {{function_type = {fty}, sym_name = \"transform_{n}\"}} : () -> ()"));
}

fn index_expr(e: &IndexExpr, args: &[Ssa], prefetch: &HashMap<RefId, Ssa>, t: &mut Text) -> Ssa {
    match e {
        IndexExpr::Grid(g) => args[*g].clone(),
        IndexExpr::Const(c) => t.op1("arith.constant", &[], &format!("value = {c} : i32"), "i32".into()),
        IndexExpr::Prefetch { array, index } => {
            let mut idx = Vec::with_capacity(index.len());
            for i in index {
                let v = index_expr(i, args, prefetch, t);
                idx.push(t.op1("arith.index_cast", &[&v], "", "index".into()));
            }
            let mem = &prefetch[array];
            let mut ops = vec![mem];
            ops.extend(idx.iter());
            t.op1("memref.load", &ops, "", "i32".into())
        }
        IndexExpr::Bin(op, a, b) => {
            let (a, b) = (index_expr(a, args, prefetch, t), index_expr(b, args, prefetch, t));
            let (name, attrs) = match op {
                IndexOp::Add => ("arith.addi", OVERFLOW),
                IndexOp::Sub => ("arith.subi", OVERFLOW),
                IndexOp::Mul => ("arith.muli", OVERFLOW),
                IndexOp::Div => ("arith.divsi", ""),
                IndexOp::Rem => ("arith.remsi", ""),
                IndexOp::Min => ("arith.minsi", ""),
                IndexOp::Max => ("arith.maxsi", ""),
            };
            t.op1(name, &[&a, &b], attrs, "i32".into())
        }
    }
}

/// The per-memref-dim strides of a strided access (squeezed dims 1), or `None` when
/// every stride is 1.
fn memref_strides(r: &RefDecl, slices: &[Slice]) -> Option<Vec<i64>> {
    if slices.iter().all(|s| s.stride == 1) {
        return None;
    }
    let mut sl = slices.iter();
    let out = match &r.block {
        Some(b) => b.block_shape.iter().map(|d| if d.is_none() { 1 } else { sl.next().map_or(1, |s| s.stride as i64) }).collect(),
        None => sl.map(|s| s.stride as i64).collect(),
    };
    Some(out)
}

// ---- the body ----------------------------------------------------------------------------------

struct Lower<'a> {
    k: &'a Kernel,
    target: &'a Target,
    t: &'a mut Text,
    grid: Vec<Ssa>,
    /// Memref arguments, indexed by `RefId`.
    refs: Vec<Ssa>,
    vals: HashMap<Value, Ssa>,
    /// What the verifier's divisibility analysis proves of each i32 value: passed on to
    /// Mosaic as `tpu.assume_multiple` on dynamic offsets, so libtpu accepts exactly the
    /// offsets the verifier accepts (rule `vector-offset-align`, `dma-align`).
    multiples: tessera_dsl::verify::Multiples,
    /// Which instructions to emit ([`Kernel::live_insts`]): a dead one may read an input
    /// that is not passed.
    live: Vec<bool>,
}

impl Lower<'_> {
    fn v(&self, v: Value) -> Ssa {
        self.vals[&v].clone()
    }

    fn ty(&self, v: Value) -> &Type {
        self.k.ty(v)
    }

    fn unsupported(&self, what: impl Into<String>, help: impl Into<String>) -> CodegenError {
        CodegenError::unsupported(self.k, self.target, what, help)
    }

    fn block(&mut self, b: BlockId) -> Result<(), CodegenError> {
        let k = self.k;
        for &i in &k.block(b).insts {
            if self.live[i.index()] {
                self.inst(i)?;
            }
        }
        Ok(())
    }

    fn inst(&mut self, id: InstId) -> Result<(), CodegenError> {
        let d = self.k.inst(id);
        let result_ty = d.results.first().map(|&r| self.ty(r).clone());
        let out = match &d.inst {
            Inst::Const(s) => Some(self.constant(*s, result_ty.as_ref().unwrap())),
            Inst::ProgramId(a) => Some(self.grid[*a].clone()),
            Inst::NumPrograms(a) => Some(self.t.op1("arith.constant", &[], &format!("value = {} : i32", self.k.grid[*a].extent), "i32".into())),
            Inst::Load { src, slices } => Some(self.load(*src, slices)),
            Inst::Store { dst, slices, value } => {
                self.store(*dst, slices, *value);
                None
            }
            Inst::Unary(op, x) => Some(self.unary(*op, *x)?),
            Inst::Binary(op, a, b) => Some(self.binary(*op, *a, *b)),
            Inst::Cmp(op, a, b) => Some(self.cmp(*op, *a, *b)),
            Inst::Select { cond, on_true, on_false } => {
                let (c, a, b) = (self.v(*cond), self.v(*on_true), self.v(*on_false));
                Some(self.t.op1("arith.select", &[&c, &a, &b], "", a.ty.clone()))
            }
            Inst::Cast(x) => Some(self.cast(*x, result_ty.as_ref().unwrap())),
            Inst::Bitcast(x) => {
                let x = self.v(*x);
                Some(self.t.op1("arith.bitcast", &[&x], "", ty(result_ty.as_ref().unwrap())))
            }
            Inst::Broadcast(x) => {
                let x = self.v(*x);
                Some(self.t.op1("vector.broadcast", &[&x], "", ty(result_ty.as_ref().unwrap())))
            }
            Inst::Iota { dim } => Some(self.iota(*dim, result_ty.as_ref().unwrap())),
            Inst::Reduce { op, axis, x } => Some(self.reduce(*op, *axis, *x)),
            Inst::Cumsum { axis, x } => Some(self.cumsum(*axis, *x)),
            Inst::PrngSeed(seeds) => {
                let vs: Vec<Ssa> = seeds.iter().map(|&v| self.v(v)).collect();
                let refs: Vec<&Ssa> = vs.iter().collect();
                // As Pallas lowers `pltpu.prng_seed`.
                self.t.op0("tpu.prng_set_seed_32", &refs, "");
                None
            }
            Inst::PrngRandomBits => Some(self.t.op1("tpu.prng_random_bits", &[], "", ty(result_ty.as_ref().unwrap()))),
            Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs } => Some(self.dot(*lhs, *rhs, *transpose_lhs, *transpose_rhs, result_ty.as_ref().unwrap())),
            Inst::Transpose(x) => {
                let r = self.ty(*x).rank() as i64;
                let perm: Vec<i64> = (0..r - 2).chain([r - 1, r - 2]).collect();
                let x = self.v(*x);
                Some(self.t.op1("tpu.transpose", &[&x], &format!("permutation = {}", dense_array("i64", perm)), ty(result_ty.as_ref().unwrap())))
            }
            Inst::Reshape(x) => {
                let x = self.v(*x);
                Some(self.t.op1("vector.shape_cast", &[&x], "", ty(result_ty.as_ref().unwrap())))
            }
            Inst::Item(x) => {
                let at = dense_array("i64", vec![0i64; self.ty(*x).rank()]);
                let x = self.v(*x);
                Some(self.t.op1("vector.extract", &[&x], &format!("static_position = {at}"), ty(result_ty.as_ref().unwrap())))
            }
            Inst::Concat { axis, parts } => {
                let parts: Vec<_> = parts.iter().map(|p| self.v(*p)).collect();
                let refs: Vec<&_> = parts.iter().collect();
                Some(self.t.op1("tpu.concatenate", &refs, &format!("dimension = {axis} : i32"), ty(result_ty.as_ref().unwrap())))
            }
            Inst::If { cond, then_block, else_block } => {
                self.if_else(&d.results, *cond, *then_block, *else_block)?;
                None
            }
            Inst::For { lo, hi, step, init, body } => {
                self.for_loop(&d.results, *lo, *hi, *step, init, *body)?;
                None
            }
            Inst::DmaStart { src, dst, sem, sem_index, remote: None } => {
                let (s, d, m) = self.dma_operands(src, dst, *sem, *sem_index);
                let attrs = "operandSegmentSizes = array<i32: 1, 0, 1, 1, 0, 0>, priority = 0 : i32, strict_ordering = false";
                self.t.op0("tpu.enqueue_dma", &[&s, &d, &m], attrs);
                None
            }
            // As Pallas writes `make_async_remote_copy(...).start()` (tests/fixtures/collective/):
            // source, source (send) semaphore, target, target (receive) semaphore, device id.
            Inst::DmaStart { src, dst, sem, sem_index, remote: Some(r) } => {
                let (s, d, recv) = self.dma_operands(src, dst, *sem, *sem_index);
                let send = self.semaphore_at(r.send_sem, r.send_index);
                let device = self.v(r.device);
                let attrs = "operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>, priority = 0 : i32, strict_ordering = false";
                self.t.op0("tpu.enqueue_dma", &[&s, &send, &d, &recv, &device], attrs);
                None
            }
            Inst::DmaWait { src, dst, sem, sem_index, remote } => {
                let (s, d, m) = self.dma_operands(src, dst, *sem, *sem_index);
                match remote {
                    None => self.t.op0("tpu.wait_dma2", &[&m, &s, &d], "operandSegmentSizes = array<i32: 1, 1, 1, 0, 0>, strict_ordering = false"),
                    // `.wait_recv()`: the descriptor's device id.
                    Some(RemoteWait { device, side: DmaSide::Recv }) => {
                        let device = self.v(*device);
                        self.t.op0("tpu.wait_dma2", &[&m, &s, &d, &device], "operandSegmentSizes = array<i32: 1, 1, 1, 1, 0>, strict_ordering = false")
                    }
                    // `.wait_send()`: JAX 0.10.2 passes device 0 and core 0 with the local send semaphore.
                    Some(RemoteWait { side: DmaSide::Send, .. }) => {
                        let zero = self.const_i32(0);
                        self.t.op0("tpu.wait_dma2", &[&m, &s, &d, &zero, &zero], "operandSegmentSizes = array<i32: 1, 1, 1, 1, 1>, strict_ordering = false")
                    }
                }
                None
            }
            Inst::DeviceId => Some(self.t.op1("tpu.device_id", &[], "", "i32".into())),
            Inst::SemSignal { sem, amount, device } => {
                let m = self.counting_semaphore(sem);
                let amount = self.v(*amount);
                match device {
                    None => self.t.op0("tpu.sem_signal", &[&m, &amount], "operandSegmentSizes = array<i32: 1, 1, 0, 0>"),
                    Some(dev) => {
                        let dev = self.v(*dev);
                        self.t.op0("tpu.sem_signal", &[&m, &amount, &dev], "operandSegmentSizes = array<i32: 1, 1, 1, 0>")
                    }
                }
                None
            }
            Inst::SemWait { sem, amount } => {
                let m = self.counting_semaphore(sem);
                let amount = self.v(*amount);
                self.t.op0("tpu.sem_wait", &[&m, &amount], "");
                None
            }
            Inst::Yield(vals) => {
                let vs: Vec<Ssa> = vals.iter().map(|&v| self.v(v)).collect();
                let refs: Vec<&Ssa> = vs.iter().collect();
                self.t.op0("scf.yield", &refs, "");
                None
            }
        };
        if let (Some(o), Some(&r)) = (out, d.results.first()) {
            self.vals.insert(r, o);
        }
        Ok(())
    }

    // ---- constants ----

    fn constant(&mut self, s: Scalar, t: &Type) -> Ssa {
        let lit = match s {
            Scalar::Float(x) => float_lit(x, t.dtype),
            Scalar::Int(i) => i.to_string(),
            Scalar::Bool(b) => b.to_string(),
        };
        let value = if t.is_scalar() {
            if t.dtype == DType::Bool { lit } else { format!("{lit} : {}", t.dtype.mlir()) }
        } else {
            format!("dense<{lit}> : {}", ty(t))
        };
        self.t.op1("arith.constant", &[], &format!("value = {value}"), ty(t))
    }

    fn const_i32(&mut self, v: i64) -> Ssa {
        self.t.op1("arith.constant", &[], &format!("value = {v} : i32"), "i32".into())
    }

    /// A memory index: a constant `index` when the i32 value is static, else `index_cast`
    /// (`tiled`: of a vector access along one of the two tiled dims, where Mosaic needs the
    /// multiple the analysis proves).
    fn index(&mut self, v: Value, tiled: bool) -> Ssa {
        match self.k.as_const(v) {
            Some(Scalar::Int(i)) => self.t.op1("arith.constant", &[], &format!("value = {i} : index"), "index".into()),
            _ => {
                let x = self.v(v);
                let i = self.t.op1("arith.index_cast", &[&x], "", "index".into());
                if tiled { self.assume_multiple(i, v) } else { i }
            }
        }
    }

    /// `x` marked with the largest power of two the analysis proves `v` a multiple of
    /// (`x` itself when nothing is known). Mosaic trusts the mark; the analysis is exact
    /// under i32 wrap-around (`tessera_dsl::verify::align`).
    fn assume_multiple(&mut self, x: Ssa, v: Value) -> Ssa {
        let m = self.multiples.multiple(v).min(1 << 30);
        if m <= 1 || self.k.as_const(v).is_some() {
            return x;
        }
        let ty = x.ty.clone();
        self.t.op1("tpu.assume_multiple", &[&x], &format!("multiple = {m} : i32"), ty)
    }

    // ---- memory ----

    /// One index per memref dim: squeezed block dims get a constant 0.
    fn indices(&mut self, r: &RefDecl, slices: &[Slice]) -> (Vec<Ssa>, Vec<usize>) {
        let squeezed: Vec<bool> = match &r.block {
            Some(b) => b.block_shape.iter().map(|d| d.is_none()).collect(),
            None => vec![false; r.shape.len()],
        };
        let mut idx = Vec::with_capacity(squeezed.len());
        let mut shape = Vec::with_capacity(squeezed.len());
        let mut s = slices.iter();
        let rank = squeezed.len();
        for (d, sq) in squeezed.into_iter().enumerate() {
            if sq {
                idx.push(self.t.op1("arith.constant", &[], "value = 0 : index", "index".into()));
                shape.push(1);
            } else {
                let sl = *s.next().expect("verified: one slice per view dim");
                let tiled = r.memory == MemorySpace::Vmem && d + 2 >= rank;
                idx.push(self.index(sl.start, tiled));
                shape.push(sl.len);
            }
        }
        (idx, shape)
    }

    fn load(&mut self, src: RefId, slices: &[Slice]) -> Ssa {
        let r = self.k.ref_decl(src).clone();
        let mem = self.refs[src.index()].clone();
        let (idx, shape) = self.indices(&r, slices);
        let mut ops = vec![&mem];
        ops.extend(idx.iter());
        if r.memory == MemorySpace::Smem {
            return self.t.op1("memref.load", &ops, "", r.dtype.mlir().into());
        }
        let loaded = match memref_strides(&r, slices) {
            // `pl.ds(start, len, stride)`, as Pallas lowers a strided ref read.
            Some(strides) => self.t.op1("tpu.strided_load", &ops, &format!("strides = {}", dense_array("i32", strides)), vector_ty(r.dtype, &shape)),
            None => self.t.op1("vector.load", &ops, "", vector_ty(r.dtype, &shape)),
        };
        let view: Vec<usize> = slices.iter().map(|s| s.len).collect();
        if view == shape {
            loaded
        } else {
            self.t.op1("vector.shape_cast", &[&loaded], "", vector_ty(r.dtype, &view))
        }
    }

    /// The memrefs a DMA names (source, destination, one semaphore), as Pallas builds them:
    /// `tpu.memref_slice` at i32 offsets, then `tpu.memref_squeeze` of the leading 1s that
    /// make one side's rank exceed the other's (integer indices such as `buf[slot]`).
    fn dma_operands(&mut self, src: &DmaRef, dst: &DmaRef, sem: RefId, sem_index: Value) -> (Ssa, Ssa, Ssa) {
        let (ss, ds) = (self.memref_box(src), self.memref_box(dst));
        let rank = ss.len().min(ds.len());
        let s = self.dma_side(src, &ss[ss.len() - rank..]);
        let d = self.dma_side(dst, &ds[ds.len() - rank..]);
        let m = self.semaphore_at(sem, sem_index);
        (s, d, m)
    }

    /// One semaphore of an array, `sem[index]`, as a rank-0 memref (slice, then squeeze).
    fn semaphore_at(&mut self, sem: RefId, index: Value) -> Ssa {
        let r = self.k.ref_decl(sem).clone();
        let mem = self.refs[sem.index()].clone();
        let i = self.v(index);
        let one = self.t.op1("tpu.memref_slice", &[&mem, &i], "operandSegmentSizes = array<i32: 1, 1, 0>", memref_ty(r.dtype, &[1], r.memory));
        self.t.op1("tpu.memref_squeeze", &[&one], "", memref_ty(r.dtype, &[], r.memory))
    }

    /// A counting semaphore: one of an array, or the barrier (`tpu.sem_barrier`, as Pallas'
    /// `get_barrier_semaphore()` lowers at each use).
    fn counting_semaphore(&mut self, sem: &SemaphoreRef) -> Ssa {
        match sem {
            SemaphoreRef::Array { sem, index } => self.semaphore_at(*sem, *index),
            SemaphoreRef::Barrier => self.t.op1("tpu.sem_barrier", &[], "", memref_ty(DType::I32, &[], MemorySpace::RegularSemaphore)),
        }
    }

    /// The shape of a DMA side over the whole memref (squeezed block dims as 1).
    fn memref_box(&self, dr: &DmaRef) -> Vec<usize> {
        let r = self.k.ref_decl(dr.r);
        let mut lens = dr.slices.iter().map(|s| s.len);
        match &r.block {
            Some(b) => b.block_shape.iter().map(|d| if d.is_none() { 1 } else { lens.next().unwrap_or(1) }).collect(),
            None => lens.collect(),
        }
    }

    /// `ref[slices]` as a memref of `shape` (the slice box without leading 1s to drop).
    fn dma_side(&mut self, dr: &DmaRef, shape: &[usize]) -> Ssa {
        let r = self.k.ref_decl(dr.r).clone();
        let mem = self.refs[dr.r.index()].clone();
        let lens = self.memref_box(dr);
        let squeezed: Vec<bool> = match &r.block {
            Some(b) => b.block_shape.iter().map(|d| d.is_none()).collect(),
            None => vec![false; r.shape.len()],
        };
        let whole = lens == r.window() && dr.slices.iter().all(|s| self.k.as_const(s.start) == Some(Scalar::Int(0)));
        let sliced = if whole {
            mem
        } else {
            let mut starts = Vec::with_capacity(lens.len());
            let mut sl = dr.slices.iter();
            let rank = squeezed.len();
            for (d, sq) in squeezed.into_iter().enumerate() {
                let v = if sq { None } else { sl.next().map(|s| s.start) };
                starts.push(match v {
                    // Only the two tiled dims need a proven alignment.
                    Some(v) if d + 2 >= rank => {
                        let x = self.v(v);
                        self.assume_multiple(x, v)
                    }
                    Some(v) => self.v(v),
                    None => self.const_i32(0),
                });
            }
            let mut ops = vec![&mem];
            ops.extend(starts.iter());
            let attrs = format!("operandSegmentSizes = {}", dense_array("i32", [1, starts.len() as i64, 0]));
            self.t.op1("tpu.memref_slice", &ops, &attrs, memref_ty(r.dtype, &lens, r.memory))
        };
        if lens == shape {
            sliced
        } else {
            self.t.op1("tpu.memref_squeeze", &[&sliced], "", memref_ty(r.dtype, shape, r.memory))
        }
    }

    fn store(&mut self, dst: RefId, slices: &[Slice], value: Value) {
        let r = self.k.ref_decl(dst).clone();
        let mem = self.refs[dst.index()].clone();
        let (idx, shape) = self.indices(&r, slices);
        let mut val = self.v(value);
        if r.memory == MemorySpace::Smem {
            let mut ops = vec![&val, &mem];
            ops.extend(idx.iter());
            self.t.op0("memref.store", &ops, "");
            return;
        }
        let full = vector_ty(r.dtype, &shape);
        if val.ty != full {
            val = self.t.op1("vector.shape_cast", &[&val], "", full);
        }
        let mut ops = vec![&val, &mem];
        ops.extend(idx.iter());
        if let Some(strides) = memref_strides(&r, slices) {
            self.t.op0("tpu.strided_store", &ops, &format!("strides = {}", dense_array("i32", strides)));
            return;
        }
        let attrs = format!("add = false, operandSegmentSizes = {}, strides = array<i32>", dense_array("i32", [1, 1, idx.len() as i64, 0]));
        self.t.op0("tpu.vector_store", &ops, &attrs);
    }

    // ---- elementwise ----

    fn unary(&mut self, op: UnaryOp, x: Value) -> Result<Ssa, CodegenError> {
        let t = self.ty(x).clone();
        let xv = self.v(x);
        let float = t.dtype.is_float();
        let name = match op {
            UnaryOp::Exp => "math.exp",
            UnaryOp::Log => "math.log",
            UnaryOp::Tanh => "math.tanh",
            UnaryOp::Erf => "math.erf",
            UnaryOp::Sqrt => "math.sqrt",
            UnaryOp::Rsqrt => "math.rsqrt",
            UnaryOp::Abs if float => "math.absf",
            UnaryOp::Abs => "math.absi",
            // As Pallas lowers lax.log1p / sin / cos / floor / ceil / round (ROUND_TO_EVEN).
            UnaryOp::Log1p => "math.log1p",
            // libtpu 0.0.52 has no `math.expm1` ("failed to legalize", every generation).
            UnaryOp::Expm1 => return Ok(self.expm1(&xv, &t)),
            UnaryOp::Sin => "math.sin",
            UnaryOp::Cos => "math.cos",
            UnaryOp::Floor => "math.floor",
            UnaryOp::Ceil => "math.ceil",
            UnaryOp::Round => "math.roundeven",
            UnaryOp::Sign => return Ok(self.sign(&xv, &t)),
            // Pallas writes -x as 0 - x; do the same for floats and ints.
            UnaryOp::Neg => {
                let zero = self.constant(if float { Scalar::Float(0.0) } else { Scalar::Int(0) }, &t);
                return Ok(self.arith2(if float { "arith.subf" } else { "arith.subi" }, &zero, &xv));
            }
            // Bitwise/logical not: x xor all-ones.
            UnaryOp::Not => {
                if float {
                    return Err(self.unsupported(format!("`not` of {t}"), "`not` applies to bool and integer values"));
                }
                let ones = self.constant(if t.dtype == DType::Bool { Scalar::Bool(true) } else { Scalar::Int(-1) }, &t);
                return Ok(self.t.op1("arith.xori", &[&xv, &ones], "", xv.ty.clone()));
            }
        };
        let attrs = if name == "math.absi" { "" } else { FASTMATH };
        Ok(self.t.op1(name, &[&xv], attrs, xv.ty.clone()))
    }

    /// `sign(x)` as selects on comparisons: `x > 0 ? 1 : x < 0 ? -1 : x == x ? 0 : x`
    /// (both zeros give +0, NaN stays NaN), in the value's own dtype.
    fn sign(&mut self, x: &Ssa, t: &Type) -> Ssa {
        let bool_t = ty(&t.with_dtype(DType::Bool));
        let zero = self.constant(Scalar::Float(0.0), t);
        let one = self.constant(Scalar::Float(1.0), t);
        let minus_one = self.constant(Scalar::Float(-1.0), t);
        let cmp = |s: &mut Self, p: i64| s.t.op1("arith.cmpf", &[x, &zero], &format!("{FASTMATH}, predicate = {p} : i64"), bool_t.clone());
        let (pos, neg) = (cmp(self, 2), cmp(self, 4));
        let ordered = self.t.op1("arith.cmpf", &[x, x], &format!("{FASTMATH}, predicate = 1 : i64"), bool_t.clone());
        let z = self.t.op1("arith.select", &[&ordered, &zero, x], "", x.ty.clone());
        let n = self.t.op1("arith.select", &[&neg, &minus_one, &z], "", x.ty.clone());
        self.t.op1("arith.select", &[&pos, &one, &n], "", x.ty.clone())
    }

    /// `expm1(x)` from `exp` and `log` (Kahan's formulation, accurate near 0 without a
    /// polynomial): `u = exp(x)`, then `x` where `u == 1`, `-1` where `u - 1 == -1`, `u`
    /// where it overflowed, else `(u - 1) * (x / log(u))`; in f32 (bf16 goes through f32,
    /// as the interpreter computes it, rounded once at the end). NaN propagates.
    fn expm1(&mut self, x: &Ssa, t: &Type) -> Ssa {
        let f = t.with_dtype(DType::F32);
        let xf = if t.dtype == DType::BF16 { self.convert(x.clone(), DType::BF16, DType::F32, t) } else { x.clone() };
        let bool_t = ty(&f.with_dtype(DType::Bool));
        let u = self.t.op1("math.exp", &[&xf], FASTMATH, xf.ty.clone());
        let one = self.constant(Scalar::Float(1.0), &f);
        let d = self.arith2("arith.subf", &u, &one);
        let l = self.t.op1("math.log", &[&u], FASTMATH, xf.ty.clone());
        let q = self.arith2("arith.divf", &xf, &l);
        let r = self.arith2("arith.mulf", &d, &q);
        let zero = self.constant(Scalar::Float(0.0), &f);
        let minus_one = self.constant(Scalar::Float(-1.0), &f);
        let inf = self.constant(Scalar::Float(f64::INFINITY), &f);
        let is = |s: &mut Self, a: &Ssa, b: &Ssa| s.t.op1("arith.cmpf", &[a, b], &format!("{FASTMATH}, predicate = 1 : i64"), bool_t.clone());
        let (tiny, low, high) = (is(self, &d, &zero), is(self, &d, &minus_one), is(self, &u, &inf));
        let r = self.t.op1("arith.select", &[&tiny, &xf, &r], "", xf.ty.clone());
        let r = self.t.op1("arith.select", &[&low, &minus_one, &r], "", xf.ty.clone());
        let r = self.t.op1("arith.select", &[&high, &u, &r], "", xf.ty.clone());
        if t.dtype == DType::BF16 { self.convert(r, DType::F32, DType::BF16, &f) } else { r }
    }

    /// The constant a value is, seen through a broadcast (a weak literal's splat).
    fn splat_const(&self, v: Value) -> Option<Scalar> {
        if let ValueDef::Result(i, 0) = self.k.value(v).def {
            if let Inst::Broadcast(x) = self.k.inst(i).inst {
                return self.k.as_const(x);
            }
        }
        self.k.as_const(v)
    }

    /// `arith.shli` / `shrsi` / `shrui` (as Pallas lowers lax's shifts), with the IR's
    /// meaning for amounts outside `0..bits` made explicit, since MLIR leaves them
    /// undefined: 0 for `shl` and `shr_logical`, the sign fill (a shift by `bits - 1`) for
    /// `shr`. A constant amount in range needs no guard.
    fn shift(&mut self, op: BinaryOp, a: Value, b: Value) -> Ssa {
        let t = self.ty(a).clone();
        let bits = t.dtype.bits() as i64;
        let name = match op {
            BinaryOp::Shl => "arith.shli",
            BinaryOp::Shr => "arith.shrsi",
            _ => "arith.shrui",
        };
        let in_range = matches!(self.splat_const(b), Some(Scalar::Int(c)) if (0..bits).contains(&c));
        let (av, bv) = (self.v(a), self.v(b));
        if in_range {
            return self.t.op1(name, &[&av, &bv], "", av.ty.clone());
        }
        // Unsigned `n < bits` is false for negative amounts too.
        let width = self.constant(Scalar::Int(bits), &t);
        let ok = self.t.op1("arith.cmpi", &[&bv, &width], "predicate = 6 : i64", ty(&t.with_dtype(DType::Bool)));
        if op == BinaryOp::Shr {
            let fill = self.constant(Scalar::Int(bits - 1), &t);
            let n = self.t.op1("arith.select", &[&ok, &bv, &fill], "", bv.ty.clone());
            return self.t.op1(name, &[&av, &n], "", av.ty.clone());
        }
        let shifted = self.t.op1(name, &[&av, &bv], "", av.ty.clone());
        let zero = self.constant(Scalar::Int(0), &t);
        self.t.op1("arith.select", &[&ok, &shifted, &zero], "", av.ty.clone())
    }

    /// A two-operand arith op with the attributes Mosaic's stable form carries.
    fn arith2(&mut self, name: &str, a: &Ssa, b: &Ssa) -> Ssa {
        let attrs = match name {
            "arith.addi" | "arith.subi" | "arith.muli" => OVERFLOW,
            n if n.ends_with('f') || n.starts_with("math.") => FASTMATH,
            _ => "",
        };
        self.t.op1(name, &[a, b], attrs, a.ty.clone())
    }

    fn binary(&mut self, op: BinaryOp, a: Value, b: Value) -> Ssa {
        if op == BinaryOp::Pow && self.ty(a).is_scalar() {
            // Mosaic legalizes no scalar `math.powf`: one vreg of it, then element 0.
            let dtype = self.ty(a).dtype;
            let vreg = Type::vector(dtype, &[8, 128]);
            let (av, bv) = (self.v(a), self.v(b));
            let va = self.t.op1("vector.broadcast", &[&av], "", ty(&vreg));
            let vb = self.t.op1("vector.broadcast", &[&bv], "", ty(&vreg));
            let p = self.arith2("math.powf", &va, &vb);
            return self.t.op1("vector.extract", &[&p], &format!("static_position = {}", dense_array("i64", [0, 0])), ty(&Type::scalar(dtype)));
        }
        let float = self.ty(a).dtype.is_float();
        let name = match (op, float) {
            (BinaryOp::Add, true) => "arith.addf",
            (BinaryOp::Add, false) => "arith.addi",
            (BinaryOp::Sub, true) => "arith.subf",
            (BinaryOp::Sub, false) => "arith.subi",
            (BinaryOp::Mul, true) => "arith.mulf",
            (BinaryOp::Mul, false) => "arith.muli",
            (BinaryOp::Div, true) => "arith.divf",
            (BinaryOp::Div, false) => "arith.divsi",
            (BinaryOp::Rem, true) => "arith.remf",
            (BinaryOp::Rem, false) => "arith.remsi",
            (BinaryOp::Max, true) => "arith.maximumf",
            (BinaryOp::Max, false) => "arith.maxsi",
            (BinaryOp::Min, true) => "arith.minimumf",
            (BinaryOp::Min, false) => "arith.minsi",
            (BinaryOp::Pow, _) => "math.powf",
            (BinaryOp::And, _) => "arith.andi",
            (BinaryOp::Or, _) => "arith.ori",
            (BinaryOp::Xor, _) => "arith.xori",
            (BinaryOp::Shl | BinaryOp::Shr | BinaryOp::ShrLogical, _) => return self.shift(op, a, b),
        };
        let (a, b) = (self.v(a), self.v(b));
        self.arith2(name, &a, &b)
    }

    fn cmp(&mut self, op: CmpOp, a: Value, b: Value) -> Ssa {
        let t = self.ty(a).clone();
        let (av, bv) = (self.v(a), self.v(b));
        let out = ty(&t.with_dtype(DType::Bool));
        if t.dtype.is_float() {
            // arith.CmpFPredicate, ordered. Mosaic rejects the unordered `une`/`uno`
            // ("Unsupported comparison direction"), and `one` is false on NaN, so `!=` is
            // `not(oeq)`: true when either side is NaN, as in Rust and numpy.
            let p = match op {
                CmpOp::Eq => 1,
                CmpOp::Gt => 2,
                CmpOp::Ge => 3,
                CmpOp::Lt => 4,
                CmpOp::Le => 5,
                CmpOp::Ne => return self.float_ne(&av, &bv, &t),
            };
            self.t.op1("arith.cmpf", &[&av, &bv], &format!("{FASTMATH}, predicate = {p} : i64"), out)
        } else {
            // arith.CmpIPredicate: signed for integers, unsigned for bools (false < true).
            let unsigned = t.dtype == DType::Bool;
            let p = match op {
                CmpOp::Eq => 0,
                CmpOp::Ne => 1,
                CmpOp::Lt => if unsigned { 6 } else { 2 },
                CmpOp::Le => if unsigned { 7 } else { 3 },
                CmpOp::Gt => if unsigned { 8 } else { 4 },
                CmpOp::Ge => if unsigned { 9 } else { 5 },
            };
            self.t.op1("arith.cmpi", &[&av, &bv], &format!("predicate = {p} : i64"), out)
        }
    }

    /// `a != b` on floats as `not(a oeq b)`.
    fn float_ne(&mut self, a: &Ssa, b: &Ssa, t: &Type) -> Ssa {
        let bool_t = t.with_dtype(DType::Bool);
        let eq = self.t.op1("arith.cmpf", &[a, b], &format!("{FASTMATH}, predicate = 1 : i64"), ty(&bool_t));
        let yes = self.constant(Scalar::Bool(true), &bool_t);
        self.t.op1("arith.xori", &[&eq, &yes], "", ty(&bool_t))
    }

    /// Casts go through f32 / i32 where MLIR has no direct op (e.g. i8 -> bf16).
    fn cast(&mut self, x: Value, to: &Type) -> Ssa {
        let from = self.ty(x).clone();
        let xv = self.v(x);
        self.convert(xv, from.dtype, to.dtype, &from)
    }

    fn convert(&mut self, x: Ssa, from: DType, to: DType, shape: &Type) -> Ssa {
        use DType::*;
        let tt = |d: DType| ty(&shape.with_dtype(d));
        match (from, to) {
            _ if from == to => x,
            (F32, BF16) => self.t.op1("arith.truncf", &[&x], "", tt(BF16)),
            // fp8 converts to and from f32 and bf16 only (libtpu 0.0.52); the builder routes
            // every other fp8 cast through f32, and so does this.
            (F32 | BF16, F8E4M3FN | F8E5M2) => self.t.op1("arith.truncf", &[&x], "", tt(to)),
            (F8E4M3FN | F8E5M2, F32 | BF16) => self.t.op1("arith.extf", &[&x], "", tt(to)),
            (F8E4M3FN | F8E5M2, _) => {
                let f = self.convert(x, from, F32, shape);
                self.convert(f, F32, to, shape)
            }
            (_, F8E4M3FN | F8E5M2) => {
                let f = self.convert(x, from, F32, shape);
                self.convert(f, F32, to, shape)
            }
            (BF16, F32) => self.t.op1("arith.extf", &[&x], "", tt(F32)),
            (I8, I32) => self.t.op1("arith.extsi", &[&x], "", tt(I32)),
            (I32, I8) => self.t.op1("arith.trunci", &[&x], OVERFLOW, tt(I8)),
            (Bool, I32 | I8) => self.t.op1("arith.extui", &[&x], "", tt(to)),
            (I32, F32) => self.t.op1("arith.sitofp", &[&x], "", tt(F32)),
            (F32, I32) => self.t.op1("arith.fptosi", &[&x], "", tt(I32)),
            (I8, F32 | BF16) | (Bool, F32 | BF16) => {
                let i = self.convert(x, from, I32, shape);
                self.convert(i, I32, to, shape)
            }
            (I32, BF16) => {
                let f = self.convert(x, I32, F32, shape);
                self.convert(f, F32, BF16, shape)
            }
            (BF16, I32 | I8) | (F32, I8) => {
                let f = self.convert(x, from, F32, shape);
                let i = self.convert(f, F32, I32, shape);
                self.convert(i, I32, to, shape)
            }
            // `x != 0`, so NaN casts to true (as in Rust and numpy).
            (F32 | BF16, Bool) => {
                let zero = self.constant(Scalar::Float(0.0), &shape.with_dtype(from));
                self.float_ne(&x, &zero, &shape.with_dtype(from))
            }
            (I32 | I8, Bool) => {
                let zero = self.constant(Scalar::Int(0), &shape.with_dtype(from));
                self.t.op1("arith.cmpi", &[&x, &zero], "predicate = 1 : i64", tt(Bool))
            }
            _ => unreachable!("all dtype pairs are covered"),
        }
    }

    // ---- structure ----

    /// `tpu.iota`, which Mosaic has from rank 2 up: a rank-1 iota is a [1, n] row.
    fn iota(&mut self, dim: usize, out: &Type) -> Ssa {
        if out.rank() == 1 {
            let row = Type::vector(out.dtype, &[1, out.shape[0]]);
            let r = self.t.op1("tpu.iota", &[], &format!("dimensions = {}", dense_array("i32", [1])), ty(&row));
            return self.t.op1("vector.shape_cast", &[&r], "", ty(out));
        }
        self.t.op1("tpu.iota", &[], &format!("dimensions = {}", dense_array("i32", [dim as i64])), ty(out))
    }

    /// The inclusive prefix sum along `axis` (Mosaic has no scan op): Hillis-Steele,
    /// ceil(log2 n) steps of `y += select(iota >= s, rotate(y, s), 0)` for s = 1, 2, 4..,
    /// with `tpu.dynamic_rotate` along the lane or sublane axis (as Pallas lowers
    /// `pltpu.roll`). bf16 scans in f32 and rounds once, as the interpreter does.
    fn cumsum(&mut self, axis: usize, x: Value) -> Ssa {
        let t0 = self.ty(x).clone();
        let mut xv = self.v(x);
        let (mut t, mut axis) = (t0.clone(), axis);
        if t.rank() == 1 {
            t = Type::vector(t.dtype, &[1, t.shape[0]]);
            xv = self.t.op1("vector.shape_cast", &[&xv], "", ty(&t));
            axis = 1;
        }
        let work = if t.dtype == DType::BF16 { DType::F32 } else { t.dtype };
        let wt = t.with_dtype(work);
        let mut y = self.convert(xv, t.dtype, work, &t);
        let n = t.shape[axis];
        let it = t.with_dtype(DType::I32);
        let index = self.t.op1("tpu.iota", &[], &format!("dimensions = {}", dense_array("i32", [axis as i64])), ty(&it));
        let zero = self.constant(if work.is_float() { Scalar::Float(0.0) } else { Scalar::Int(0) }, &wt);
        let add = if work.is_float() { "arith.addf" } else { "arith.addi" };
        let mut shift = 1usize;
        while shift < n {
            let amount = self.const_i32(shift as i64);
            let rolled = self.t.op1("tpu.dynamic_rotate", &[&y, &amount], &format!("dimension = {axis} : si32"), ty(&wt));
            let bound = self.constant(Scalar::Int(shift as i64), &it);
            let live = self.t.op1("arith.cmpi", &[&index, &bound], "predicate = 5 : i64", ty(&t.with_dtype(DType::Bool)));
            let part = self.t.op1("arith.select", &[&live, &rolled, &zero], "", ty(&wt));
            y = self.arith2(add, &y, &part);
            shift *= 2;
        }
        let out = self.convert(y, work, t.dtype, &wt);
        if t0.rank() == 1 {
            self.t.op1("vector.shape_cast", &[&out], "", ty(&t0))
        } else {
            out
        }
    }

    /// `vector.multi_reduction` drops the axis; a `shape_cast` puts it back as size 1.
    fn reduce(&mut self, op: ReduceOp, axis: usize, x: Value) -> Ssa {
        let mut t = self.ty(x).clone();
        let mut xv = self.v(x);
        let mut axis = axis;
        // Mosaic reduces only to vectors: a rank-1 vector is reduced as a [1, n] row.
        let rank1 = t.rank() == 1;
        if rank1 {
            t = Type::vector(t.dtype, &[1, t.shape[0]]);
            xv = self.t.op1("vector.shape_cast", &[&xv], "", ty(&t));
            axis = 1;
        }
        // A bool max / min (any / all) reduces its 0 / 1 extension in i32 (Mosaic has no i1
        // reduction) and compares back.
        let bool_in = t.dtype == DType::Bool;
        if bool_in {
            t = Type::vector(DType::I32, &t.shape);
            xv = self.t.op1("arith.extui", &[&xv], "", ty(&t));
        }
        let float = t.dtype.is_float();
        let mut dropped = t.shape.clone();
        dropped.remove(axis);
        let acc_t = Type::vector(t.dtype, &dropped);
        let (kind, init) = match (op, float) {
            (ReduceOp::Sum, true) => ("add", Scalar::Float(0.0)),
            (ReduceOp::Sum, false) => ("add", Scalar::Int(0)),
            (ReduceOp::Max, true) => ("maximumf", Scalar::Float(f64::NEG_INFINITY)),
            (ReduceOp::Max, false) => ("maxsi", Scalar::Int(int_min(t.dtype))),
            (ReduceOp::Min, true) => ("minimumf", Scalar::Float(f64::INFINITY)),
            (ReduceOp::Min, false) => ("minsi", Scalar::Int(-1 - int_min(t.dtype))),
        };
        let acc = self.constant(init, &acc_t);
        let attrs = format!("kind = #vector.kind<{kind}>, reduction_dims = {}", dense_array("i64", [axis as i64]));
        let red = self.t.op1("vector.multi_reduction", &[&xv, &acc], &attrs, ty(&acc_t));
        let kept: Vec<usize> = if rank1 { vec![1] } else { t.shape.iter().enumerate().map(|(d, &n)| if d == axis { 1 } else { n }).collect() };
        let out = self.t.op1("vector.shape_cast", &[&red], "", vector_ty(t.dtype, &kept));
        if !bool_in {
            return out;
        }
        let zero = self.constant(Scalar::Int(0), &Type::vector(DType::I32, &kept));
        self.t.op1("arith.cmpi", &[&out, &zero], "predicate = 1 : i64", vector_ty(DType::Bool, &kept))
    }

    /// `tpu.matmul` with explicit dimension numbers; a transposed operand is expressed by
    /// its contracting dim (as Pallas does for `q @ k.T`), not by a separate transpose.
    fn dot(&mut self, lhs: Value, rhs: Value, tl: bool, tr: bool, out: &Type) -> Ssa {
        let (l, r) = (self.v(lhs), self.v(rhs));
        let (lc, ln) = if tl { (0, 1) } else { (1, 0) };
        let (rc, rn) = if tr { (1, 0) } else { (0, 1) };
        let acc = self.constant(if out.dtype.is_float() { Scalar::Float(0.0) } else { Scalar::Int(0) }, out);
        let attrs = format!(
            "dimension_numbers = #tpu.dot_dimension_numbers<[{lc}], [{rc}], [{ln}], [{rn}], [0, {ln}, 1, {rn}], [], []>, transpose_lhs = false, transpose_rhs = false"
        );
        self.t.op1("tpu.matmul", &[&l, &r, &acc], &attrs, ty(out))
    }

    fn result_names(&mut self, results: &[Value]) -> Vec<Ssa> {
        results.iter().map(|&r| Ssa::new(self.t.fresh(), ty(self.k.ty(r)))).collect()
    }

    fn head(&self, name: &str, operands: &[&Ssa], results: &[Ssa]) -> String {
        crate::text::op_head(name, operands, results)
    }

    fn if_else(&mut self, results: &[Value], cond: Value, then_b: BlockId, else_b: BlockId) -> Result<(), CodegenError> {
        let c = self.v(cond);
        let res = self.result_names(results);
        let head = self.head("scf.if", &[&c], &res);
        self.t.line(&format!("{head} ({{"));
        self.t.indent();
        self.block(then_b)?;
        self.t.dedent();
        self.t.line("}, {");
        self.t.indent();
        self.block(else_b)?;
        self.t.dedent();
        let tys: Vec<String> = res.iter().map(|r| r.ty.clone()).collect();
        self.t.line(&format!("}}) : (i1) -> {}", result_list(&tys)));
        for (&v, s) in results.iter().zip(res) {
            self.vals.insert(v, s);
        }
        Ok(())
    }

    /// `scf.for` over i32 bounds, as Pallas emits for `fori_loop`.
    fn for_loop(&mut self, results: &[Value], lo: Value, hi: Value, step: i64, init: &[Value], body: BlockId) -> Result<(), CodegenError> {
        let (lo, hi) = (self.v(lo), self.v(hi));
        let step = self.const_i32(step);
        let inits: Vec<Ssa> = init.iter().map(|&v| self.v(v)).collect();
        let res = self.result_names(results);
        let mut ops = vec![&lo, &hi, &step];
        ops.extend(inits.iter());
        let head = self.head("scf.for", &ops, &res);
        let operand_tys: Vec<&str> = ops.iter().map(|o| o.ty.as_str()).collect();
        self.t.line(&format!("{head} ({{"));
        let params: Vec<Ssa> = self.k.block(body).params.iter().map(|&p| Ssa::new(self.t.fresh(), ty(self.k.ty(p)))).collect();
        self.t.line(&block_header(&params));
        for (&p, s) in self.k.block(body).params.iter().zip(&params) {
            self.vals.insert(p, s.clone());
        }
        self.t.indent();
        self.block(body)?;
        self.t.dedent();
        let tys: Vec<String> = res.iter().map(|r| r.ty.clone()).collect();
        self.t.line(&format!("}}) : {}", signature(operand_tys.into_iter(), &tys)));
        for (&v, s) in results.iter().zip(res) {
            self.vals.insert(v, s);
        }
        Ok(())
    }
}

fn int_min(d: DType) -> i64 {
    match d {
        DType::I8 => i8::MIN as i64,
        _ => i32::MIN as i64,
    }
}
