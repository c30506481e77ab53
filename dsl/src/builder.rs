//! [`KernelBuilder`]: the one way to construct a [`Kernel`]. `#[tpu_kernel]` expands to
//! calls on it; hand-written kernels and the fusion engine use it directly.
//!
//! Type errors do not stop construction: the first one is recorded (with the source
//! location the macro set) and returned by [`KernelBuilder::finish`], and the offending
//! op yields a placeholder value so the caller's code needs no `?` per op.

use crate::error::KernelError;
use crate::ir::*;
use crate::types::{DType, MemorySpace, Semantics, Type};

/// An operand of an arithmetic op: an IR value or a Rust literal. Literals are "weak":
/// they take the dtype of the other operand, as Python scalars do in JAX.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Val(Value),
    Float(f64),
    Int(i64),
    Bool(bool),
}

impl From<Value> for Arg {
    fn from(v: Value) -> Arg {
        Arg::Val(v)
    }
}
impl From<f64> for Arg {
    fn from(v: f64) -> Arg {
        Arg::Float(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg::Float(v as f64)
    }
}
impl From<bool> for Arg {
    fn from(v: bool) -> Arg {
        Arg::Bool(v)
    }
}
macro_rules! int_arg {
    ($($t:ty),*) => {$(
        impl From<$t> for Arg {
            fn from(v: $t) -> Arg {
                // Beyond i64 saturates: out of every IR dtype's range, so `constant` says so.
                Arg::Int(i64::try_from(v).unwrap_or(i64::MAX))
            }
        }
    )*};
}
int_arg!(i8, i32, i64, u32, u64, usize);

/// Why a literal does not fit `dtype` (a wrapped integer, or a finite float that would
/// round to infinity), if it does not. NaN and infinite literals are what they say.
fn out_of_range(value: Scalar, dtype: DType) -> Option<String> {
    match (value, dtype) {
        (Scalar::Int(i), DType::I8) if i8::try_from(i).is_err() => Some("i8 holds -128..=127; it would wrap".into()),
        (Scalar::Int(i), DType::I32) if i32::try_from(i).is_err() => Some(format!("i32 holds {}..={}; it would wrap", i32::MIN, i32::MAX)),
        (Scalar::Float(x), DType::F32) if x.is_finite() && (x as f32).is_infinite() => Some(format!("beyond f32's largest finite value {:e}, it would round to infinity", f32::MAX)),
        (Scalar::Float(x), DType::BF16) if x.is_finite() && half::bf16::from_f64(x).is_infinite() => {
            Some(format!("beyond bf16's largest finite value {:e}, it would round to infinity", f64::from(half::bf16::MAX)))
        }
        // Beyond the midpoint above the largest finite value: e4m3fn saturates (448 and 464
        // round to 448), e5m2 rounds to infinity.
        (Scalar::Float(x), DType::F8E4M3FN) if x.is_finite() && x.abs() > 464.0 => Some("beyond float8_e4m3fn's largest finite value 448, it would saturate to 448 (e4m3fn has no infinity)".into()),
        (Scalar::Float(x), DType::F8E5M2) if x.is_finite() && x.abs() >= 61440.0 => Some("beyond float8_e5m2's largest finite value 57344, it would round to infinity".into()),
        _ => None,
    }
}

/// One dimension of a ref access in the builder: the whole dim, or `len` elements from
/// a (possibly dynamic) start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Index {
    Full,
    /// `pl.ds(start, len)`.
    Slice(Arg, usize),
    /// `pl.ds(start, len, stride)`: `len` elements `stride` apart (a strided load/store).
    Strided(Arg, usize, usize),
}

/// `pl.ds(start, len)`: a dynamic slice of `len` elements.
pub fn ds(start: impl Into<Arg>, len: usize) -> Index {
    Index::Slice(start.into(), len)
}

/// `pl.ds(start, len, stride)`: `len` elements from `start`, `stride` apart (the macro's
/// `x_ref[(a..b).step_by(s), ..]` and `ds(start, len, stride)`).
pub fn ds_strided(start: impl Into<Arg>, len: usize, stride: usize) -> Index {
    Index::Strided(start.into(), len, stride)
}

/// A copy into another device's buffer, as Pallas `make_async_remote_copy` describes it:
/// `src[src_index]` here to `dst[dst_index]` on `device`, with this device's send
/// semaphore and the peer's receive semaphore (each `(array, index)` of `semaphores(n)`).
#[derive(Clone, Copy, Debug)]
pub struct RemoteCopy<'a> {
    pub src: RefId,
    pub src_index: &'a [Index],
    pub dst: RefId,
    pub dst_index: &'a [Index],
    pub send_sem: (RefId, Arg),
    pub recv_sem: (RefId, Arg),
    /// The peer's logical id (see [`KernelBuilder::mesh_device`], [`KernelBuilder::axis_index`]).
    pub device: Arg,
}

/// A counting semaphore operand: one of a `regular_semaphores(n)` array, or the barrier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sem {
    At(RefId, Arg),
    /// The kernel's barrier semaphore (Pallas `get_barrier_semaphore()`).
    Barrier,
}

impl Sem {
    pub fn at(sem: RefId, index: impl Into<Arg>) -> Sem {
        Sem::At(sem, index.into())
    }
}

pub struct KernelBuilder {
    k: Kernel,
    /// The block being appended to, innermost last.
    cursor: Vec<BlockId>,
    error: Option<KernelError>,
    loc: Option<SourceLoc>,
}

impl KernelBuilder {
    pub fn new(name: &str) -> Self {
        let k = Kernel {
            name: name.to_string(),
            grid: Vec::new(),
            refs: Vec::new(),
            values: Vec::new(),
            insts: Vec::new(),
            blocks: vec![BlockData::default()],
            body: BlockId(0),
            vmem_limit_bytes: None,
            collective: None,
        };
        KernelBuilder { k, cursor: vec![BlockId(0)], error: None, loc: None }
    }

    pub fn name(&self) -> &str {
        &self.k.name
    }

    /// Records an error unless one is already recorded; construction goes on.
    pub fn fail(&mut self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) {
        if self.error.is_none() {
            self.error = Some(KernelError::new(&self.k.name, subject, rule, message, help).at(self.loc.clone()));
        }
    }

    pub fn has_error(&self) -> bool {
        self.error.is_some()
    }

    /// Sets the user source location attached to the instructions that follow.
    pub fn at(&mut self, file: &'static str, line: u32, column: u32) {
        self.loc = Some(SourceLoc { file, line, column });
    }

    // ---- signature -------------------------------------------------------------------

    pub fn grid(&mut self, dims: &[(usize, Semantics)]) {
        self.k.grid = dims.iter().map(|&(extent, semantics)| GridDim { extent, semantics, dynamic: None }).collect();
    }

    /// Makes grid dim `dim` dynamic: `extent` (a scalar-prefetch operand, int32 `[1]`)
    /// holds its run-time extent, at most the static bound given to [`Self::grid`]; the
    /// steps past it do not run (Pallas: a grid entry traced from a scalar, as megablox
    /// gmm's active tile count). The verifier checks the operand; the CPU backends check
    /// the value when the kernel runs (`grid-dynamic-extent`).
    pub fn grid_extent_from(&mut self, dim: usize, extent: RefId) {
        match self.k.grid.get_mut(dim) {
            Some(g) => g.dynamic = Some(extent),
            None => {
                let rank = self.k.grid.len();
                self.fail("grid", "grid-axis", format!("dynamic extent for grid dim {dim}, but the grid has {rank} dim(s)"), "declare the grid first, then make one of its dims dynamic")
            }
        }
    }

    pub fn vmem_limit_bytes(&mut self, bytes: usize) {
        self.k.vmem_limit_bytes = Some(bytes);
    }

    /// Declares an operand; it records the current source location (the macro sets it to
    /// the attribute argument that declared the operand) so verifier errors point there.
    fn add_ref(&mut self, mut decl: RefDecl) -> RefId {
        decl.loc = self.loc.clone();
        if self.k.refs.iter().any(|r| r.name == decl.name) {
            self.fail(format!("operand `{}`", decl.name), "duplicate-operand", "two operands have this name", "rename one of them");
        }
        if let Some(last) = self.k.refs.last() {
            if last.kind > decl.kind {
                self.fail(
                    format!("{} `{}`", decl.kind.name(), decl.name),
                    "operand-order",
                    format!("declared after {} `{}`", last.kind.name(), last.name),
                    "declare operands in the order prefetch, inputs, outputs, scratch",
                );
            }
        }
        self.k.refs.push(decl);
        RefId(self.k.refs.len() as u32 - 1)
    }

    /// A scalar-prefetch operand: an int32 array placed in SMEM before the grid runs,
    /// readable by the body and by index maps ([`IndexExpr::Prefetch`]).
    pub fn prefetch(&mut self, name: &str, shape: &[usize]) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Prefetch, dtype: DType::I32, shape: shape.to_vec(), memory: MemorySpace::Smem, block: None, loc: None })
    }

    /// A blocked input in VMEM.
    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize], block: BlockSpec) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Input, dtype, shape: shape.to_vec(), memory: MemorySpace::Vmem, block: Some(block), loc: None })
    }

    /// A blocked output in VMEM.
    pub fn output(&mut self, name: &str, dtype: DType, shape: &[usize], block: BlockSpec) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Output, dtype, shape: shape.to_vec(), memory: MemorySpace::Vmem, block: Some(block), loc: None })
    }

    /// An operand the kernel sees whole, in `memory` (SMEM tables, ANY/HBM for manual DMA).
    pub fn unblocked(&mut self, kind: RefKind, name: &str, dtype: DType, shape: &[usize], memory: MemorySpace) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind, dtype, shape: shape.to_vec(), memory, block: None, loc: None })
    }

    /// A scratch buffer that lives across grid steps.
    pub fn scratch(&mut self, name: &str, dtype: DType, shape: &[usize], memory: MemorySpace) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Scratch, dtype, shape: shape.to_vec(), memory, block: None, loc: None })
    }

    /// `n` DMA semaphores (Pallas `SemaphoreType.DMA((n,))`), a scratch operand.
    pub fn semaphores(&mut self, name: &str, n: usize) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Scratch, dtype: DType::I32, shape: vec![n], memory: MemorySpace::Semaphore, block: None, loc: None })
    }

    /// `n` counting semaphores (Pallas `SemaphoreType.REGULAR((n,))`), a scratch operand
    /// for [`Self::semaphore_signal`] / [`Self::semaphore_wait`].
    pub fn regular_semaphores(&mut self, name: &str, n: usize) -> RefId {
        self.add_ref(RefDecl { name: name.into(), kind: RefKind::Scratch, dtype: DType::I32, shape: vec![n], memory: MemorySpace::RegularSemaphore, block: None, loc: None })
    }

    /// Declares the device mesh the kernel runs on (axes major to minor, as a JAX `Mesh`)
    /// and Mosaic's `collective_id`: required before any remote copy, signal to a peer or
    /// barrier (`collective-undeclared`). Every device of the mesh runs the kernel.
    pub fn mesh(&mut self, axes: &[(&str, usize)], collective_id: u32) {
        let mesh = axes.iter().map(|&(name, size)| MeshAxis { name: name.to_string(), size }).collect();
        self.k.collective = Some(Collective { mesh, collective_id });
    }

    pub fn ref_decl(&self, r: RefId) -> &RefDecl {
        self.k.ref_decl(r)
    }

    /// Whether an operand or scratch buffer named `name` is declared.
    pub fn has_ref(&self, name: &str) -> bool {
        self.k.find_ref(name).is_some()
    }

    pub fn ty(&self, v: Value) -> &Type {
        self.k.ty(v)
    }

    // ---- arena plumbing ----------------------------------------------------------------

    fn new_value(&mut self, ty: Type, def: ValueDef) -> Value {
        self.k.values.push(ValueData { ty, def });
        Value(self.k.values.len() as u32 - 1)
    }

    fn push(&mut self, inst: Inst, result_types: Vec<Type>) -> Vec<Value> {
        let id = InstId(self.k.insts.len() as u32);
        let results: Vec<Value> = result_types.into_iter().enumerate().map(|(n, ty)| self.new_value(ty, ValueDef::Result(id, n))).collect();
        self.k.insts.push(InstData { inst, results: results.clone(), loc: self.loc.clone() });
        let cur = *self.cursor.last().expect("builder cursor is never empty");
        self.k.blocks[cur.index()].insts.push(id);
        results
    }

    fn push1(&mut self, inst: Inst, ty: Type) -> Value {
        self.push(inst, vec![ty])[0]
    }

    fn new_block(&mut self, param_types: Vec<Type>) -> BlockId {
        let id = BlockId(self.k.blocks.len() as u32);
        self.k.blocks.push(BlockData::default());
        let params = param_types.into_iter().enumerate().map(|(n, ty)| self.new_value(ty, ValueDef::Param(id, n))).collect();
        self.k.blocks[id.index()].params = params;
        id
    }

    /// A placeholder returned by an op that failed to type-check.
    fn poison(&mut self, ty: Type) -> Value {
        let s = if ty.dtype.is_float() { Scalar::Float(0.0) } else if ty.dtype == DType::Bool { Scalar::Bool(false) } else { Scalar::Int(0) };
        self.push1(Inst::Const(s), ty)
    }

    // ---- scalars and constants -----------------------------------------------------------

    /// A constant of type `ty` (a splat when `ty` is a vector).
    pub fn constant(&mut self, value: Scalar, ty: Type) -> Value {
        let value = match (value, ty.dtype) {
            (Scalar::Int(i), d) if d.is_float() => Scalar::Float(i as f64),
            (Scalar::Float(x), d) if d.is_int() => {
                self.fail("constant", "constant-type", format!("float literal {x} used as {d}"), "write an integer literal or cast the other operand to a float type");
                Scalar::Int(x as i64)
            }
            (Scalar::Bool(b), d) if d != DType::Bool => Scalar::Int(b as i64),
            (v, DType::Bool) => match v {
                Scalar::Bool(b) => Scalar::Bool(b),
                Scalar::Int(i) => Scalar::Bool(i != 0),
                Scalar::Float(x) => Scalar::Bool(x != 0.0),
            },
            (v, _) => v,
        };
        if let Some(range) = out_of_range(value, ty.dtype) {
            self.fail(
                "constant",
                "literal-range",
                format!("literal {value} does not fit {}: {range}", ty.dtype),
                "write a value in range, or make the other operand (or the `full`/`zeros` dtype) a wider type",
            );
        }
        self.push1(Inst::Const(value), ty)
    }

    pub fn f32(&mut self, x: f32) -> Value {
        self.constant(Scalar::Float(x as f64), Type::scalar(DType::F32))
    }

    pub fn i32(&mut self, x: i32) -> Value {
        self.constant(Scalar::Int(x as i64), Type::scalar(DType::I32))
    }

    pub fn full(&mut self, shape: &[usize], dtype: DType, value: impl Into<Arg>) -> Value {
        let s = match value.into() {
            Arg::Float(x) => Scalar::Float(x),
            Arg::Int(i) => Scalar::Int(i),
            Arg::Bool(b) => Scalar::Bool(b),
            Arg::Val(v) => {
                let v = self.cast(v, dtype);
                return self.broadcast(v, shape);
            }
        };
        self.constant(s, Type::vector(dtype, shape))
    }

    pub fn zeros(&mut self, shape: &[usize], dtype: DType) -> Value {
        self.full(shape, dtype, 0i64)
    }

    /// Turns an [`Arg`] into a value; a weak literal takes `like`'s dtype (as a scalar).
    pub fn lift(&mut self, a: Arg, like: Option<DType>) -> Value {
        match a {
            Arg::Val(v) => v,
            Arg::Float(x) => {
                let d = like.filter(|d| d.is_float()).unwrap_or(DType::F32);
                self.constant(Scalar::Float(x), Type::scalar(d))
            }
            Arg::Int(i) => {
                let d = like.unwrap_or(DType::I32);
                self.constant(Scalar::Int(i), Type::scalar(d))
            }
            Arg::Bool(b) => self.constant(Scalar::Bool(b), Type::scalar(DType::Bool)),
        }
    }

    pub fn program_id(&mut self, axis: usize) -> Value {
        if axis >= self.k.grid.len() {
            self.fail(format!("program_id({axis})"), "grid-axis", format!("the grid has {} dims", self.k.grid.len()), "use an axis below the grid rank");
        }
        self.push1(Inst::ProgramId(axis), Type::scalar(DType::I32))
    }

    pub fn num_programs(&mut self, axis: usize) -> Value {
        if axis >= self.k.grid.len() {
            self.fail(format!("num_programs({axis})"), "grid-axis", format!("the grid has {} dims", self.k.grid.len()), "use an axis below the grid rank");
        }
        // A dynamic dim's extent is its operand's value: read it (every backend can).
        if let Some(r) = self.k.grid.get(axis).and_then(|g| g.dynamic) {
            let zero = self.i32(0);
            return self.load(r, &[Index::Slice(Arg::Val(zero), 1)]);
        }
        self.push1(Inst::NumPrograms(axis), Type::scalar(DType::I32))
    }

    // ---- memory ------------------------------------------------------------------------------

    fn slices(&mut self, r: RefId, what: &str, index: &[Index]) -> Option<Vec<Slice>> {
        let decl = self.k.ref_decl(r).clone();
        if decl.memory.is_semaphore() {
            self.fail(
                format!("{} of {} `{}`", what, decl.kind.name(), decl.name),
                "semaphore-access",
                "semaphores cannot be loaded, stored or copied",
                "name the semaphore as the last argument of dma_start / dma_wait",
            );
            return None;
        }
        let view = decl.view();
        if index.len() != view.len() && !index.is_empty() {
            self.fail(
                format!("{} of {} `{}`", what, decl.kind.name(), decl.name),
                "index-rank",
                format!("{} indices given, the ref's view {:?} has rank {}", index.len(), view, view.len()),
                "give one index per dimension of the block (use `..` for a whole dim)",
            );
            return None;
        }
        let mut out = Vec::with_capacity(view.len());
        for (d, &extent) in view.iter().enumerate() {
            let (start, len, stride) = match index.get(d).copied().unwrap_or(Index::Full) {
                Index::Full => (Arg::Int(0), extent, 1),
                Index::Slice(s, len) => (s, len, 1),
                Index::Strided(s, len, stride) => (s, len, stride),
            };
            if stride == 0 {
                self.fail(format!("{} of `{}`", what, decl.name), "slice-stride", format!("dim {d}: stride 0"), "use a stride of at least 1");
                return None;
            }
            let span = Slice { start: Value(0), len, stride }.span();
            let start = self.lift(start, Some(DType::I32));
            if self.ty(start) != &Type::scalar(DType::I32) {
                let t = self.ty(start).clone();
                self.fail(format!("{} of `{}`", what, decl.name), "index-type", format!("index of dim {d} has type {t}"), "indices are i32 scalars; cast with .cast(i32)");
            }
            if let Some(Scalar::Int(s)) = self.k.as_const(start) {
                if s < 0 || (s as u64).saturating_add(span as u64) > extent as u64 {
                    let (len64, stride64, span64) = (len as i64, stride as i64, i64::try_from(span).unwrap_or(i64::MAX));
                    let what_elems = if stride == 1 { format!("elements {s}..{}", s.saturating_add(len64)) } else { format!("{len} elements {s}, {}, .., {} (stride {stride})", s.saturating_add(stride64), s.saturating_add(span64) - 1) };
                    self.fail(
                        format!("{} of {} `{}`", what, decl.kind.name(), decl.name),
                        "static-out-of-bounds",
                        format!("dim {d}: {what_elems} of a block of {extent}"),
                        "keep static slices inside the block",
                    );
                }
            }
            if len == 0 || span > extent {
                let msg = if stride == 1 { format!("dim {d}: slice length {len} for a block of {extent}") } else { format!("dim {d}: {len} elements with stride {stride} span {span} of a block of {extent}") };
                self.fail(format!("{} of `{}`", what, decl.name), "slice-length", msg, "use a length between 1 and the block dim (with a stride: (len - 1) * stride + 1 at most the dim)");
            }
            out.push(Slice { start, len, stride });
        }
        Some(out)
    }

    /// `ref[index]`: a vector (VMEM) or, from an SMEM ref, a scalar.
    pub fn load(&mut self, r: RefId, index: &[Index]) -> Value {
        let decl = self.k.ref_decl(r).clone();
        let Some(slices) = self.slices(r, "load", index) else { return self.poison(Type::scalar(decl.dtype)) };
        let ty = if decl.memory == MemorySpace::Smem {
            if slices.iter().any(|s| s.len != 1) {
                self.fail(format!("load of `{}`", decl.name), "smem-scalar-access", "SMEM refs are read one scalar at a time", "index every dim with a single element: ds(i, 1)");
            }
            Type::scalar(decl.dtype)
        } else {
            if decl.memory == MemorySpace::Any {
                self.fail(format!("load of `{}`", decl.name), "hbm-direct-access", "the operand stays in HBM (memory space ANY) and cannot be loaded directly", "copy it to a VMEM scratch buffer with a DMA, or give it a VMEM block spec");
            }
            Type::vector(decl.dtype, &slices.iter().map(|s| s.len).collect::<Vec<_>>())
        };
        self.push1(Inst::Load { src: r, slices }, ty)
    }

    /// `ref[index] = value`. A scalar or lower-rank value is broadcast to the slice.
    pub fn store(&mut self, r: RefId, index: &[Index], value: impl Into<Arg>) {
        let decl = self.k.ref_decl(r).clone();
        if decl.kind == RefKind::Input || decl.kind == RefKind::Prefetch {
            self.fail(format!("store to {} `{}`", decl.kind.name(), decl.name), "store-to-input", "inputs are read-only", "write to an output or a scratch buffer");
        }
        let Some(slices) = self.slices(r, "store", index) else { return };
        let mut value = self.lift(value.into(), Some(decl.dtype));
        let vt = self.ty(value).clone();
        if vt.dtype != decl.dtype {
            self.fail(
                format!("store to `{}`", decl.name),
                "store-dtype",
                format!("storing {vt} into a {} ref", decl.dtype),
                format!("cast the value first: .cast({})", decl.dtype),
            );
        }
        if decl.memory == MemorySpace::Smem {
            if !vt.is_scalar() {
                self.fail(format!("store to `{}`", decl.name), "smem-scalar-access", "SMEM refs are written one scalar at a time", "store a scalar");
            }
        } else {
            let shape: Vec<usize> = slices.iter().map(|s| s.len).collect();
            if vt.is_scalar() && !shape.is_empty() {
                // A scalar fills the slice (Pallas: `ref[...] = 0.0`).
                value = self.broadcast(value, &shape);
            } else if vt.shape != shape {
                // Pallas rejects it too; a silent broadcast would hide a missing reduction
                // or a wrong block shape.
                self.fail(
                    format!("store to `{}`", decl.name),
                    "store-shape",
                    format!("storing {vt} into a {shape:?} slice"),
                    "store a value of the slice's shape: broadcast it explicitly (e.g. `v + zeros(..)`) or fix the block shape",
                );
            }
        }
        self.push(Inst::Store { dst: r, slices, value }, vec![]);
    }

    // ---- async copies ----------------------------------------------------------------------

    /// Starts the async copy `src[src_index] -> dst[dst_index]` (an index may name a prefix
    /// of the dims; the rest are whole), signalling `sem[sem_index]`
    /// on completion (Pallas `make_async_copy(src.at[..], dst.at[..], sem.at[i]).start()`).
    /// The destination must not be read until [`KernelBuilder::dma_wait`] with the same
    /// descriptor.
    pub fn dma_start(&mut self, src: RefId, src_index: &[Index], dst: RefId, dst_index: &[Index], sem: RefId, sem_index: impl Into<Arg>) {
        if let Some((src, dst, sem_index)) = self.dma_descriptor("dma_start", src, src_index, dst, dst_index, sem, sem_index.into()) {
            self.push(Inst::DmaStart { src, dst, sem, sem_index, remote: None }, vec![]);
        }
    }

    /// Waits until the copy described by the same arguments as its [`KernelBuilder::dma_start`]
    /// has landed in `dst` (Pallas `.wait()`).
    pub fn dma_wait(&mut self, src: RefId, src_index: &[Index], dst: RefId, dst_index: &[Index], sem: RefId, sem_index: impl Into<Arg>) {
        if let Some((src, dst, sem_index)) = self.dma_descriptor("dma_wait", src, src_index, dst, dst_index, sem, sem_index.into()) {
            self.push(Inst::DmaWait { src, dst, sem, sem_index, remote: None }, vec![]);
        }
    }

    /// Checks and lowers a copy descriptor: slices in bounds, same dtype, same box shape
    /// (up to leading 1s), a writable destination, and one semaphore of a semaphore array.
    #[allow(clippy::too_many_arguments)]
    fn dma_descriptor(&mut self, what: &str, src: RefId, src_index: &[Index], dst: RefId, dst_index: &[Index], sem: RefId, sem_index: Arg) -> Option<(DmaRef, DmaRef, Value)> {
        let (sd, dd, sem_decl) = (self.k.ref_decl(src).clone(), self.k.ref_decl(dst).clone(), self.k.ref_decl(sem).clone());
        let subject = format!("{what} `{}` -> `{}`", sd.name, dd.name);
        if sem_decl.memory != MemorySpace::Semaphore {
            self.fail(
                &subject,
                "dma-semaphore",
                format!("{} `{}` is not a DMA semaphore array", sem_decl.kind.name(), sem_decl.name),
                "declare semaphores with `semaphores(n)` and pass one of them, e.g. `sem[slot]`",
            );
            return None;
        }
        if matches!(dd.kind, RefKind::Input | RefKind::Prefetch) {
            self.fail(&subject, "dma-destination", format!("the destination is {} `{}`, which is read-only", dd.kind.name(), dd.name), "copy into a scratch buffer or an output");
        }
        if sd.dtype != dd.dtype {
            self.fail(&subject, "dma-dtype", format!("copying {} into {}", sd.dtype, dd.dtype), "DMA copies bytes as they are: make source and destination the same dtype (cast after the copy)");
        }
        // As with Pallas' `ref.at[i]`, trailing dims left out are taken whole.
        let pad = |index: &[Index], rank: usize| -> Vec<Index> { index.iter().copied().chain(std::iter::repeat(Index::Full)).take(rank.max(index.len())).collect() };
        let src_slices = self.slices(src, what, &pad(src_index, sd.view().len()))?;
        let dst_slices = self.slices(dst, what, &pad(dst_index, dd.view().len()))?;
        if src_slices.iter().chain(&dst_slices).any(|s| s.stride != 1) {
            self.fail(&subject, "dma-stride", "a DMA side is a strided slice", "copy a contiguous box (slices without a stride) and take the strided elements from VMEM with a strided load");
            return None;
        }
        let (src, dst) = (DmaRef { r: src, slices: src_slices }, DmaRef { r: dst, slices: dst_slices });
        let (ss, ds) = (src.shape(), dst.shape());
        if dma_box(&ss) != dma_box(&ds) {
            self.fail(
                &subject,
                "dma-shape",
                format!("the source slice is {ss:?} and the destination slice {ds:?}"),
                "copy boxes of the same shape (leading size-1 dims are ignored, so `buf[slot]` matches `x[page]`)",
            );
        }
        let sem_index = self.lift(sem_index, Some(DType::I32));
        if self.ty(sem_index) != &Type::scalar(DType::I32) {
            let t = self.ty(sem_index).clone();
            self.fail(&subject, "index-type", format!("the semaphore index has type {t}"), "semaphore indices are i32 scalars");
        }
        let count: usize = sem_decl.shape.iter().product();
        if let Some(Scalar::Int(i)) = self.k.as_const(sem_index) {
            if i < 0 || i as usize >= count {
                self.fail(&subject, "static-out-of-bounds", format!("semaphore {i} of `{}`, which has {count}", sem_decl.name), "use a semaphore index below the array's length");
            }
        }
        Some((src, dst, sem_index))
    }

    // ---- devices and communication ------------------------------------------------------------

    /// This device's logical id in the mesh (Mosaic `tpu.device_id`).
    pub fn device_id(&mut self) -> Value {
        self.push1(Inst::DeviceId, Type::scalar(DType::I32))
    }

    /// The mesh axis named `axis`, or an error (`mesh-axis`) and `None`.
    fn mesh_axis(&mut self, what: &str, axis: &str) -> Option<(usize, usize)> {
        let Some(c) = self.k.collective.clone() else {
            self.fail(what, "collective-undeclared", format!("`{axis}` names a mesh axis, and the kernel declares no mesh"), "declare the mesh first: `mesh(&[(\"x\", n)], collective_id)` (#[tpu_kernel(mesh = ...)])");
            return None;
        };
        match c.axis(axis) {
            Some(i) => Some((c.stride(i), c.mesh[i].size)),
            None => {
                let names: Vec<&str> = c.mesh.iter().map(|a| a.name.as_str()).collect();
                self.fail(what, "mesh-axis", format!("the mesh has no axis `{axis}` (its axes: {})", names.join(", ")), "name one of the mesh's axes");
                None
            }
        }
    }

    /// This device's coordinate along mesh axis `axis` (Pallas `lax.axis_index`), computed
    /// from the logical id as Pallas lowers it: `(device_id / stride) % size`.
    pub fn axis_index(&mut self, axis: &str) -> Value {
        let Some((stride, size)) = self.mesh_axis("axis_index", axis) else { return self.poison(Type::scalar(DType::I32)) };
        let id = self.device_id();
        let major = self.div(id, stride as i64);
        self.binary(BinaryOp::Rem, major, size as i64)
    }

    /// The number of devices along mesh axis `axis` (Pallas `lax.axis_size`), a constant.
    pub fn axis_size(&mut self, axis: &str) -> Value {
        let size = self.mesh_axis("axis_size", axis).map_or(1, |(_, n)| n);
        self.constant(Scalar::Int(size as i64), Type::scalar(DType::I32))
    }

    /// The logical id of the device at mesh coordinates `coords` (one per axis, major to
    /// minor; Pallas `device_id=(..)` with `DeviceIdType.MESH`): `sum(coord * stride)`.
    pub fn mesh_device(&mut self, coords: &[Arg]) -> Value {
        let Some(c) = self.k.collective.clone() else {
            self.fail("mesh_device", "collective-undeclared", "device coordinates, and the kernel declares no mesh", "declare the mesh first: `mesh(&[(\"x\", n)], collective_id)`");
            return self.poison(Type::scalar(DType::I32));
        };
        if coords.len() != c.mesh.len() {
            self.fail("mesh_device", "mesh-axis", format!("{} coordinates for a mesh of {} axes", coords.len(), c.mesh.len()), "give one coordinate per mesh axis, major to minor");
            return self.poison(Type::scalar(DType::I32));
        }
        let mut id = self.i32(0);
        for (axis, &coord) in coords.iter().enumerate() {
            let term = self.mul(coord, c.stride(axis) as i64);
            id = self.add(id, term);
        }
        id
    }

    /// An i32 scalar operand of a communication op (`what`), or an `index-type` error.
    fn i32_scalar(&mut self, subject: &str, what: &str, a: Arg) -> Value {
        let v = self.lift(a, Some(DType::I32));
        if self.ty(v) != &Type::scalar(DType::I32) {
            let t = self.ty(v).clone();
            self.fail(subject, "index-type", format!("the {what} has type {t}"), format!("the {what} is an i32 scalar"));
        }
        v
    }

    /// Starts the copy `src[src_index]` -> `dst[dst_index]` *on device `device`*
    /// (Pallas `make_async_remote_copy(...).start()`): the peer's `recv_sem` signals when
    /// the data has landed there, this device's `send_sem` once the source has been read.
    pub fn remote_copy_start(&mut self, c: &RemoteCopy<'_>) {
        let Some((src, dst, sem_index)) = self.dma_descriptor("remote_copy_start", c.src, c.src_index, c.dst, c.dst_index, c.recv_sem.0, c.recv_sem.1) else { return };
        let subject = format!("remote_copy_start `{}` -> `{}`", self.k.ref_decl(c.src).name, self.k.ref_decl(c.dst).name);
        let (send_sem, send_index) = match self.semaphore_arg(&subject, c.send_sem.0, c.send_sem.1) {
            Some(s) => s,
            None => return,
        };
        let device = self.i32_scalar(&subject, "device id", c.device);
        self.push(Inst::DmaStart { src, dst, sem: c.recv_sem.0, sem_index, remote: Some(RemoteDma { device, send_sem, send_index }) }, vec![]);
    }

    /// Waits until this device's source of `c` has been read (Pallas `.wait_send()`).
    pub fn remote_copy_wait_send(&mut self, c: &RemoteCopy<'_>) {
        self.remote_wait(c, DmaSide::Send);
    }

    /// Waits until a copy described by `c` has landed in *this* device's `dst` (Pallas
    /// `.wait_recv()`: the peer that sends to us uses the same descriptor).
    pub fn remote_copy_wait_recv(&mut self, c: &RemoteCopy<'_>) {
        self.remote_wait(c, DmaSide::Recv);
    }

    fn remote_wait(&mut self, c: &RemoteCopy<'_>, side: DmaSide) {
        let (what, sem) = match side {
            DmaSide::Send => ("remote_copy_wait_send", c.send_sem),
            DmaSide::Recv => ("remote_copy_wait_recv", c.recv_sem),
        };
        let Some((src, dst, sem_index)) = self.dma_descriptor(what, c.src, c.src_index, c.dst, c.dst_index, sem.0, sem.1) else { return };
        let subject = format!("{what} `{}` -> `{}`", self.k.ref_decl(c.src).name, self.k.ref_decl(c.dst).name);
        let device = self.i32_scalar(&subject, "device id", c.device);
        self.push(Inst::DmaWait { src, dst, sem: sem.0, sem_index, remote: Some(RemoteWait { device, side }) }, vec![]);
    }

    /// One DMA semaphore `sem[index]`, checked like the copy's own.
    fn semaphore_arg(&mut self, subject: &str, sem: RefId, index: Arg) -> Option<(RefId, Value)> {
        let decl = self.k.ref_decl(sem).clone();
        if decl.memory != MemorySpace::Semaphore {
            self.fail(subject, "dma-semaphore", format!("{} `{}` is not a DMA semaphore array", decl.kind.name(), decl.name), "declare semaphores with `semaphores(n)` and pass one of them, e.g. `sem[slot]`");
            return None;
        }
        let index = self.i32_scalar(subject, "semaphore index", index);
        self.check_semaphore_index(subject, &decl, index);
        Some((sem, index))
    }

    fn check_semaphore_index(&mut self, subject: &str, decl: &RefDecl, index: Value) {
        let count: usize = decl.shape.iter().product();
        if let Some(Scalar::Int(i)) = self.k.as_const(index) {
            if i < 0 || i as usize >= count {
                self.fail(subject, "static-out-of-bounds", format!("semaphore {i} of `{}`, which has {count}", decl.name), "use a semaphore index below the array's length");
            }
        }
    }

    /// A counting semaphore: the checks every signal and wait makes.
    fn counting_semaphore(&mut self, subject: &str, sem: Sem) -> Option<SemaphoreRef> {
        match sem {
            Sem::Barrier => Some(SemaphoreRef::Barrier),
            Sem::At(r, index) => {
                let decl = self.k.ref_decl(r).clone();
                if decl.memory != MemorySpace::RegularSemaphore {
                    self.fail(subject, "semaphore-kind", format!("{} `{}` is not a counting semaphore array", decl.kind.name(), decl.name), "signal and wait on `regular_semaphores(n)` or the barrier semaphore; DMA semaphores are signalled by copies");
                    return None;
                }
                let index = self.i32_scalar(subject, "semaphore index", index);
                self.check_semaphore_index(subject, &decl, index);
                Some(SemaphoreRef::Array { sem: r, index })
            }
        }
    }

    /// Adds `amount` to a counting semaphore on this device, or on `device` (Pallas
    /// `semaphore_signal(sem, amount, device_id=...)`).
    pub fn semaphore_signal(&mut self, sem: Sem, amount: impl Into<Arg>, device: Option<Arg>) {
        let Some(sem) = self.counting_semaphore("semaphore_signal", sem) else { return };
        let amount = self.i32_scalar("semaphore_signal", "amount", amount.into());
        let device = device.map(|d| self.i32_scalar("semaphore_signal", "device id", d));
        self.push(Inst::SemSignal { sem, amount, device }, vec![]);
    }

    /// Blocks until the semaphore holds `amount`, then takes it (Pallas `semaphore_wait`).
    pub fn semaphore_wait(&mut self, sem: Sem, amount: impl Into<Arg>) {
        let Some(sem) = self.counting_semaphore("semaphore_wait", sem) else { return };
        let amount = self.i32_scalar("semaphore_wait", "amount", amount.into());
        self.push(Inst::SemWait { sem, amount }, vec![]);
    }

    // ---- elementwise -----------------------------------------------------------------------

    /// Numpy broadcasting of a scalar, or of a same-rank vector with 1-sized dims, to `shape`.
    pub fn broadcast(&mut self, x: Value, shape: &[usize]) -> Value {
        let t = self.ty(x).clone();
        if t.shape == shape {
            return x;
        }
        let ok = t.is_scalar() || (t.rank() == shape.len() && t.shape.iter().zip(shape).all(|(&a, &b)| a == b || a == 1));
        if !ok {
            self.fail("broadcast", "broadcast-shape", format!("cannot broadcast {t} to {:?}", shape), "broadcast from a scalar or from a vector of the same rank whose dims are 1 or equal to the target");
            return self.poison(Type::vector(t.dtype, shape));
        }
        self.push1(Inst::Broadcast(x), Type::vector(t.dtype, shape))
    }

    /// Lifts both operands (weak literals take the other side's dtype) and broadcasts them
    /// to a common shape.
    fn unify(&mut self, what: &str, a: Arg, b: Arg) -> Option<(Value, Value)> {
        let da = if let Arg::Val(v) = a { Some(self.ty(v).dtype) } else { None };
        let db = if let Arg::Val(v) = b { Some(self.ty(v).dtype) } else { None };
        let a = self.lift(a, db);
        let b = self.lift(b, da);
        let (ta, tb) = (self.ty(a).clone(), self.ty(b).clone());
        if ta.dtype != tb.dtype {
            self.fail(format!("instruction `{what}`"), "dtype-mismatch", format!("operands are {ta} and {tb}"), "cast one side with .cast(dtype) so both have the same dtype");
            return None;
        }
        if ta.shape == tb.shape {
            return Some((a, b));
        }
        let shape = if ta.is_scalar() {
            tb.shape.clone()
        } else if tb.is_scalar() || ta.rank() != tb.rank() {
            ta.shape.clone()
        } else {
            ta.shape.iter().zip(&tb.shape).map(|(&x, &y)| x.max(y)).collect()
        };
        let compatible = |t: &Type| t.is_scalar() || (t.rank() == shape.len() && t.shape.iter().zip(&shape).all(|(&x, &y)| x == y || x == 1));
        if !compatible(&ta) || !compatible(&tb) {
            self.fail(format!("instruction `{what}`"), "broadcast-shape", format!("operands {ta} and {tb} do not broadcast"), "make the shapes equal, or use 1 in the dims to broadcast (e.g. reduce with keepdims)");
            return None;
        }
        Some((self.broadcast(a, &shape), self.broadcast(b, &shape)))
    }

    pub fn binary(&mut self, op: BinaryOp, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        let Some((a, b)) = self.unify(op.name(), a.into(), b.into()) else { return self.poison(Type::scalar(DType::F32)) };
        let t = self.ty(a).clone();
        let ok = match op {
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => !t.dtype.is_float(),
            BinaryOp::Pow => t.dtype.is_float(),
            BinaryOp::Shl | BinaryOp::Shr | BinaryOp::ShrLogical => t.dtype.is_int(),
            _ => t.dtype != DType::Bool,
        };
        if !ok && op.is_shift() {
            self.fail(
                format!("instruction `{}`", op.name()),
                "op-dtype",
                format!("`{}` shifts integers, and its operands are {t}", op.name()),
                "shift i32 or i8 values (the amount has the value's dtype; a literal amount takes it): e.g. `(x.cast(i32) >> 4) & 15`",
            );
        } else if !ok {
            self.fail(format!("instruction `{}`", op.name()), "op-dtype", format!("`{}` is not defined for {}", op.name(), t.dtype), "cast the operands to a dtype the op supports");
        }
        self.push1(Inst::Binary(op, a, b), t)
    }

    pub fn add(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Div, a, b)
    }
    pub fn max(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Max, a, b)
    }
    pub fn min(&mut self, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        self.binary(BinaryOp::Min, a, b)
    }

    pub fn unary(&mut self, op: UnaryOp, x: impl Into<Arg>) -> Value {
        let x = self.lift(x.into(), None);
        let t = self.ty(x).clone();
        let ok = match op {
            UnaryOp::Not => !t.dtype.is_float(),
            _ if op.float_only() => t.dtype.is_float(),
            _ => t.dtype != DType::Bool,
        };
        if !ok {
            self.fail(format!("instruction `{}`", op.name()), "op-dtype", format!("`{}` is not defined for {t}", op.name()), "cast to f32 first: .cast(f32)");
        }
        self.push1(Inst::Unary(op, x), t)
    }

    pub fn cmp(&mut self, op: CmpOp, a: impl Into<Arg>, b: impl Into<Arg>) -> Value {
        let Some((a, b)) = self.unify(op.name(), a.into(), b.into()) else { return self.poison(Type::scalar(DType::Bool)) };
        let t = self.ty(a).with_dtype(DType::Bool);
        self.push1(Inst::Cmp(op, a, b), t)
    }

    /// `where(cond, on_true, on_false)`.
    pub fn select(&mut self, cond: Value, on_true: impl Into<Arg>, on_false: impl Into<Arg>) -> Value {
        let Some((t, f)) = self.unify("select", on_true.into(), on_false.into()) else { return self.poison(Type::scalar(DType::F32)) };
        let ct = self.ty(cond).clone();
        let vt = self.ty(t).clone();
        if ct.dtype != DType::Bool {
            self.fail("instruction `select`", "select-condition", format!("condition has type {ct}"), "use a comparison (a bool) as the condition");
            return t;
        }
        let shape = if vt.is_scalar() { ct.shape.clone() } else { vt.shape.clone() };
        let cond = self.broadcast(cond, &shape);
        let t = self.broadcast(t, &shape);
        let f = self.broadcast(f, &shape);
        let ty = self.ty(t).clone();
        self.push1(Inst::Select { cond, on_true: t, on_false: f }, ty)
    }

    /// Converts `x` to `to`. Mosaic converts fp8 to and from f32 and bf16 only (libtpu
    /// 0.0.52); a cast between fp8 and any other dtype (i32, i8, bool, the other fp8
    /// format) is built as two casts through f32, which is exact on the fp8 side.
    pub fn cast(&mut self, x: Value, to: DType) -> Value {
        let t = self.ty(x).clone();
        if t.dtype == to {
            return x;
        }
        let direct = |a: DType, b: DType| !a.is_fp8() || matches!(b, DType::F32 | DType::BF16);
        if !direct(t.dtype, to) || !direct(to, t.dtype) {
            let f = self.push1(Inst::Cast(x), t.with_dtype(DType::F32));
            return self.push1(Inst::Cast(f), t.with_dtype(to));
        }
        self.push1(Inst::Cast(x), t.with_dtype(to))
    }

    /// `x`'s bits read as `to` (`jax.lax.bitcast_convert_type`): i32 <-> f32, the one pair
    /// of equal widths every backend holds unpacked (f32 bits of a NaN keep their payload).
    pub fn bitcast(&mut self, x: Value, to: DType) -> Value {
        let t = self.ty(x).clone();
        if t.dtype == to {
            return x;
        }
        if !matches!((t.dtype, to), (DType::I32, DType::F32) | (DType::F32, DType::I32)) {
            self.fail("instruction `bitcast`", "bitcast-dtype", format!("{t} to {to}"), "bitcast converts between i32 and f32 only; use .cast(dtype) to convert values");
            return self.poison(t.with_dtype(to));
        }
        self.push1(Inst::Bitcast(x), t.with_dtype(to))
    }

    pub fn iota(&mut self, dtype: DType, shape: &[usize], dim: usize) -> Value {
        if dim >= shape.len() {
            self.fail("instruction `iota`", "iota-dim", format!("iota of {dtype}{:?} along dim {dim}", shape), "count along a dim of the iota's shape");
        }
        // libtpu 0.0.52 compiles i32 and i8 iotas; floats are cast from them.
        if !dtype.is_int() {
            self.fail("instruction `iota`", "iota-dtype", format!("iota of {dtype}{:?}", shape), "iota produces integers (i32 or i8); cast afterwards, e.g. .cast(f32)");
        }
        self.push1(Inst::Iota { dim }, Type::vector(dtype, shape))
    }

    // ---- structure ------------------------------------------------------------------------------

    /// Reduce along `axis`, keeping it with size 1 (`keepdims=True`).
    pub fn reduce(&mut self, op: ReduceOp, x: Value, axis: usize) -> Value {
        let t = self.ty(x).clone();
        if axis >= t.rank() {
            self.fail(format!("instruction `{}`", op.name()), "reduce-axis", format!("axis {axis} of {t}"), "reduce along an existing axis");
            return self.poison(t);
        }
        let mut shape = t.shape.clone();
        shape[axis] = 1;
        self.push1(Inst::Reduce { op, axis, x }, Type::vector(t.dtype, &shape))
    }

    /// The index (i32) of the largest element along `axis`, keeping it with size 1: the
    /// first one on ties, the first NaN if there is one (`torch.argmax`). Built from
    /// ops every backend has: `m = max(x)`, then the smallest index where `x == m` or
    /// `x` is NaN (`max` propagates NaN, so then only NaNs match).
    pub fn argmax(&mut self, x: Value, axis: usize) -> Value {
        self.arg_reduce(ReduceOp::Max, "argmax", x, axis)
    }

    /// The index (i32) of the smallest element along `axis` (first on ties, NaN wins, as
    /// `torch.argmin`); see [`Self::argmax`].
    pub fn argmin(&mut self, x: Value, axis: usize) -> Value {
        self.arg_reduce(ReduceOp::Min, "argmin", x, axis)
    }

    fn arg_reduce(&mut self, op: ReduceOp, name: &str, x: Value, axis: usize) -> Value {
        let t = self.ty(x).clone();
        if axis >= t.rank() {
            let help = if t.rank() == 0 { "take it of a vector (a scalar has no axes)".to_string() } else { format!("use an axis below {}", t.rank()) };
            self.fail(format!("instruction `{name}`"), "reduce-axis", format!("axis {axis} of {t}"), help);
            return self.poison(t.with_dtype(DType::I32));
        }
        if t.dtype == DType::Bool {
            self.fail(format!("instruction `{name}`"), "op-dtype", format!("`{name}` of {t}"), "cast the bools to i32 first: .cast(i32)");
            let mut shape = t.shape.clone();
            shape[axis] = 1;
            return self.poison(Type::vector(DType::I32, &shape));
        }
        let m = self.reduce(op, x, axis);
        let hit = self.cmp(CmpOp::Eq, x, m);
        let hit = if t.dtype.is_float() {
            let nan = self.cmp(CmpOp::Ne, x, x);
            self.binary(BinaryOp::Or, hit, nan)
        } else {
            hit
        };
        let index = self.iota(DType::I32, &t.shape, axis);
        let n = i64::try_from(t.shape[axis]).unwrap_or(i64::MAX).min(i32::MAX as i64);
        let masked = self.select(hit, index, Arg::Int(n));
        self.reduce(ReduceOp::Min, masked, axis)
    }

    /// The inclusive prefix sum along `axis` (`jnp.cumsum(x, axis)`, `torch.cumsum`): the
    /// result has `x`'s type. f32 and bf16 add in f32 (as torch's CPU cumsum accumulates
    /// bf16 in f32), so a bf16 output is rounded once per element, not once per step; i32
    /// wraps. NaN and infinities propagate from their index on, as in torch.
    pub fn cumsum(&mut self, x: Value, axis: usize) -> Value {
        let t = self.ty(x).clone();
        if t.is_scalar() || axis >= t.rank() {
            let help = if t.rank() == 0 { "take it of a vector (a scalar has no axes)".to_string() } else { format!("use an axis below {}", t.rank()) };
            self.fail("instruction `cumsum`", "reduce-axis", format!("axis {axis} of {t}"), help);
            return self.poison(t);
        }
        if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::I32) {
            self.fail(
                "instruction `cumsum`",
                "op-dtype",
                format!("`cumsum` of {t}: prefix sums are defined for f32, bf16 and i32"),
                "cast to i32 (or f32) first: .cast(i32); an i8 running sum would overflow",
            );
            return self.poison(t);
        }
        self.push1(Inst::Cumsum { axis, x }, t)
    }

    /// Seeds the core's random generator (`pltpu.prng_seed(*seeds)`): one or more i32
    /// scalars, e.g. a user seed and `program_id(0)` so grid steps draw different bits.
    pub fn prng_seed(&mut self, seeds: &[Arg]) {
        if seeds.is_empty() {
            self.fail("instruction `prng_seed`", "prng-seed", "no seed given", "pass at least one i32 scalar: prng_seed(seed) or prng_seed(seed, program_id(0))");
            return;
        }
        let mut vals = Vec::with_capacity(seeds.len());
        for (n, &a) in seeds.iter().enumerate() {
            let v = self.lift(a, Some(DType::I32));
            if self.ty(v) != &Type::scalar(DType::I32) {
                let t = self.ty(v).clone();
                self.fail("instruction `prng_seed`", "prng-seed", format!("seed {n} has type {t}"), "seeds are i32 scalars: cast with .cast(i32), or take one element of a vector");
                return;
            }
            vals.push(v);
        }
        self.push(Inst::PrngSeed(vals), vec![]);
    }

    /// A vector of `shape` random i32 bits (`pltpu.prng_random_bits(shape)`), drawn from
    /// the generator [`Self::prng_seed`] set. Every bit pattern is equally likely; e.g.
    /// keep with probability `p`: `bits.shr_logical(8) < (p * 2^24) as i32`.
    pub fn prng_random_bits(&mut self, shape: &[usize]) -> Value {
        if shape.len() < 2 || shape.contains(&0) {
            self.fail(
                "instruction `prng_random_bits`",
                "prng-shape",
                format!("shape {shape:?}"),
                "draw a vector of rank 2 or more with no zero dims (Mosaic vectors are at least 2-D), e.g. [8, 128]; reshape afterwards",
            );
            return self.poison(Type::vector(DType::I32, &[1, 1]));
        }
        self.push1(Inst::PrngRandomBits, Type::vector(DType::I32, shape))
    }

    /// Matrix product with f32 accumulation (i32 for integer inputs).
    pub fn dot(&mut self, lhs: Value, rhs: Value, transpose_lhs: bool, transpose_rhs: bool) -> Value {
        let (tl, tr) = (self.ty(lhs).clone(), self.ty(rhs).clone());
        if tl.rank() != 2 || tr.rank() != 2 {
            self.fail("instruction `dot`", "dot-rank", format!("operands are {tl} and {tr}"), "dot takes two rank-2 blocks; reshape first");
            return self.poison(Type::vector(DType::F32, &[1, 1]));
        }
        // A mixed bf16 x f32 dot compiles (libtpu 0.0.52) and means promote to f32; ints
        // and floats never mix.
        if tl.dtype != tr.dtype && !(tl.dtype.is_float() && tr.dtype.is_float()) {
            self.fail("instruction `dot`", "dtype-mismatch", format!("operands are {tl} and {tr}"), "cast one operand so both have the same dtype");
        }
        let (m, kl) = if transpose_lhs { (tl.shape[1], tl.shape[0]) } else { (tl.shape[0], tl.shape[1]) };
        let (kr, n) = if transpose_rhs { (tr.shape[1], tr.shape[0]) } else { (tr.shape[0], tr.shape[1]) };
        if kl != kr {
            self.fail("instruction `dot`", "dot-contraction", format!("contracting dims differ: {tl} x {tr} (lhs k = {kl}, rhs k = {kr})"), "make the contracted dims equal (or transpose an operand)");
        }
        let acc = if tl.dtype.is_float() { DType::F32 } else { DType::I32 };
        self.push1(Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs }, Type::vector(acc, &[m, n]))
    }

    /// Swap the last two dims.
    pub fn transpose(&mut self, x: Value) -> Value {
        let t = self.ty(x).clone();
        if t.rank() < 2 {
            self.fail("instruction `transpose`", "transpose-rank", format!("operand is {t}"), "transpose needs at least 2 dims");
            return x;
        }
        let mut shape = t.shape.clone();
        let r = shape.len();
        shape.swap(r - 1, r - 2);
        self.push1(Inst::Transpose(x), Type::vector(t.dtype, &shape))
    }

    /// `parts` joined along `axis` (`jnp.concatenate`; the same value repeated is
    /// `jnp.tile`): one dtype and rank, equal sizes but on `axis`.
    pub fn concat(&mut self, parts: &[Value], axis: usize) -> Value {
        let Some(&first) = parts.first() else {
            self.fail("instruction `concat`", "concat-parts", "no parts", "pass at least one value");
            return self.constant(Scalar::Float(0.0), Type::scalar(DType::F32));
        };
        let t = self.ty(first).clone();
        if axis >= t.rank() {
            self.fail("instruction `concat`", "concat-axis", format!("axis {axis} of {t}"), "join along one of the parts' dims");
            return first;
        }
        let mut shape = t.shape.clone();
        for &p in &parts[1..] {
            let u = self.ty(p).clone();
            let same_but_axis = u.rank() == t.rank() && u.shape.iter().zip(&t.shape).enumerate().all(|(d, (a, b))| d == axis || a == b);
            if u.dtype != t.dtype || !same_but_axis {
                self.fail("instruction `concat`", "concat-parts", format!("{u} does not join {t} along axis {axis}"), "give every part the same dtype and rank, and the same sizes but on the joined axis");
                return first;
            }
            shape[axis] += u.shape[axis];
        }
        self.push1(Inst::Concat { axis, parts: parts.to_vec() }, Type::vector(t.dtype, &shape))
    }

    pub fn reshape(&mut self, x: Value, shape: &[usize]) -> Value {
        let t = self.ty(x).clone();
        if t.num_elements() != shape.iter().product::<usize>() || shape.is_empty() {
            self.fail("instruction `reshape`", "reshape-size", format!("{t} has {} elements, {:?} has {}", t.num_elements(), shape, shape.iter().product::<usize>()), "keep the element count");
            return self.poison(Type::vector(t.dtype, shape));
        }
        if t.shape == shape {
            return x;
        }
        self.push1(Inst::Reshape(x), Type::vector(t.dtype, shape))
    }

    /// The scalar held by `x`, a vector of one f32 or i32 element (`r.sum(0).sum(1).item()`).
    pub fn item(&mut self, x: Value) -> Value {
        let t = self.ty(x).clone();
        let dtype_ok = matches!(t.dtype, DType::F32 | DType::I32);
        let help = if t.is_scalar() {
            Some("it is a scalar already: drop the `.item()`")
        } else if !dtype_ok {
            Some("cast to f32 or i32 before reducing (`.cast(i32)` counts bools), then reduce to one element")
        } else if t.num_elements() != 1 {
            Some("reduce the value to one element first, one axis at a time (`.sum(0).sum(1)`, `.reduce_max(..)`)")
        } else {
            None
        };
        if let Some(help) = help {
            self.fail("instruction `item`", "item-operand", format!("`item` of {t}: it takes a vector of one f32 or i32 element"), help);
            return self.poison(Type::scalar(if dtype_ok { t.dtype } else { DType::I32 }));
        }
        self.push1(Inst::Item(x), Type::scalar(t.dtype))
    }

    // ---- control flow ---------------------------------------------------------------------------

    fn in_block(&mut self, block: BlockId, f: impl FnOnce(&mut Self) -> Vec<Value>) -> Vec<Value> {
        self.cursor.push(block);
        let yields = f(self);
        self.push(Inst::Yield(yields.clone()), vec![]);
        self.cursor.pop();
        yields
    }

    /// `if cond { then } else { otherwise }`; each branch returns the values it yields
    /// (same types in both), which become the results.
    pub fn if_else(&mut self, cond: impl Into<Arg>, then: impl FnOnce(&mut Self) -> Vec<Value>, otherwise: impl FnOnce(&mut Self) -> Vec<Value>) -> Vec<Value> {
        let cond = self.lift(cond.into(), Some(DType::Bool));
        if self.ty(cond) != &Type::scalar(DType::Bool) {
            let t = self.ty(cond).clone();
            self.fail("`if`", "if-condition", format!("condition has type {t}"), "branch on a scalar comparison (vector conditions: use select)");
        }
        let then_block = self.new_block(vec![]);
        let else_block = self.new_block(vec![]);
        let ty_then: Vec<Type> = self.in_block(then_block, then).iter().map(|&v| self.ty(v).clone()).collect();
        let ty_else: Vec<Type> = self.in_block(else_block, otherwise).iter().map(|&v| self.ty(v).clone()).collect();
        if ty_then != ty_else {
            self.fail("`if`", "if-branch-types", format!("branches yield {:?} and {:?}", ty_then, ty_else), "make both branches give values of the same types");
        }
        self.push(Inst::If { cond, then_block, else_block }, ty_then)
    }

    /// `if cond { then }` with no results.
    pub fn when(&mut self, cond: impl Into<Arg>, then: impl FnOnce(&mut Self)) {
        self.if_else(
            cond,
            |b| {
                then(b);
                vec![]
            },
            |_| vec![],
        );
    }

    /// `for i in (lo..hi).step_by(step)` carrying `init`; the body gets the induction
    /// variable and the current carries and returns the next carries.
    pub fn for_range(&mut self, lo: impl Into<Arg>, hi: impl Into<Arg>, step: i64, init: &[Value], body: impl FnOnce(&mut Self, Value, &[Value]) -> Vec<Value>) -> Vec<Value> {
        let lo = self.lift(lo.into(), Some(DType::I32));
        let hi = self.lift(hi.into(), Some(DType::I32));
        for (what, v) in [("start", lo), ("end", hi)] {
            if self.ty(v) != &Type::scalar(DType::I32) {
                let t = self.ty(v).clone();
                self.fail("`for` loop", "loop-bounds", format!("the {what} bound has type {t}"), "loop bounds are i32 scalars");
            }
        }
        if step <= 0 {
            self.fail("`for` loop", "loop-step", format!("step {step}"), "use a positive step");
        }
        let carry_types: Vec<Type> = init.iter().map(|&v| self.ty(v).clone()).collect();
        let mut params = vec![Type::scalar(DType::I32)];
        params.extend(carry_types.iter().cloned());
        let block = self.new_block(params);
        let block_params = self.k.block(block).params.clone();
        let yields = self.in_block(block, |b| body(b, block_params[0], &block_params[1..]));
        let yield_types: Vec<Type> = yields.iter().map(|&v| self.ty(v).clone()).collect();
        if yield_types != carry_types {
            self.fail("`for` loop", "loop-carry-types", format!("the loop starts with {:?} and its body yields {:?}", carry_types, yield_types), "keep each loop-carried variable's type and shape the same across iterations");
        }
        self.push(Inst::For { lo, hi, step, init: init.to_vec(), body: block }, carry_types)
    }

    /// The finished kernel, or the first error recorded while building it.
    pub fn finish(self) -> Result<Kernel, KernelError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.k),
        }
    }
}
