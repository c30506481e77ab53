//! Memory budgets: VMEM (the scoped limit) and SMEM, as libtpu counts them.
//!
//! **VMEM** is the kernel's buffers plus Mosaic's *internal scratch*, which libtpu
//! allocates inside the same scoped limit and which the buffers do not show:
//!
//! - **buffers**: every blocked VMEM operand twice (the pipeline double-buffers it) and
//!   every VMEM scratch once, padded to XLA's memory tiles ([`Target::memory_tile`]);
//! - **held vector values**: Mosaic computes elementwise chains one vreg at a time, but a
//!   whole-block value still needed after an op that consumes whole vectors (a reduction,
//!   a matmul, a transpose, a store, a copy) is kept in scratch: softmax's `exp(x - max)`
//!   across its sum. A loaded value is re-read from its window instead, unless a write
//!   came in between. The estimate is the peak over the body, in program order;
//! - **matmuls** stage part of their result, and relayout packed operands ([`dot_scratch`]);
//! - **lane iotas and loaded-column broadcasts** are materialised whole;
//! - **a margin**, [`VMEM_MARGIN`], for kernels that compute (pure data movement needs
//!   exactly its buffers).
//!
//! Calibration: `cargo run --release -p tessera-tests --bin probes -- vmem` measures
//! libtpu's need for 408 kernels (every library kernel in f32 and bf16 on v5e, v6e and
//! tpu7x, large-block configurations, matmuls, near-limit probes) as the smallest scoped
//! limit under which each compiles (`tests/src/vmem.rs`). Every term above is a pattern in
//! those figures; the margin covers the largest amount by which libtpu needed more than
//! the modelled terms (88 KiB, `tests/verdicts/vmem.md`).
//!
//! **SMEM**: every SMEM array in 32-bit words padded to 128 words (rank >= 2: last dim to
//! 128, second-to-last to 8), plus what libtpu keeps for itself
//! ([`Target::smem_reserved_bytes`]: 3 KiB, 2 KiB on tpu7x).

use super::Verifier;
use crate::error::Result;
use crate::ir::*;
use crate::target::{Generation, Target};
use crate::types::{DType, MemorySpace};

const MIB: f64 = (1 << 20) as f64;

/// What libtpu needed beyond our buffers and the modelled internal scratch, at most, over
/// the calibration set (88 KiB, `tests/verdicts/vmem.md`), rounded up.
pub const VMEM_MARGIN: usize = 128 << 10;

/// The VMEM a kernel needs, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmemEstimate {
    /// Blocked VMEM operands twice, VMEM scratch once, padded to the memory tile.
    pub buffers: usize,
    /// Mosaic's internal scratch: held vector values, matmuls, lane iotas, broadcasts.
    pub internal: usize,
    /// [`VMEM_MARGIN`] for a kernel that computes, 0 for one that only moves data.
    pub margin: usize,
}

impl VmemEstimate {
    pub fn total(&self) -> usize {
        self.buffers.saturating_add(self.internal).saturating_add(self.margin)
    }
}

/// VMEM the kernel's own buffers take on `target`: blocked VMEM operands twice (the
/// pipeline double-buffers them) plus VMEM scratch once, each padded to the memory tile.
/// Not the whole need: see [`vmem_need`].
pub fn vmem_bytes(k: &Kernel, target: &Target) -> usize {
    k.refs
        .iter()
        .filter(|r| r.memory == MemorySpace::Vmem)
        .map(|r| {
            let bytes = target.padded_bytes(r.dtype, &r.window());
            if r.block.is_some() { bytes.saturating_mul(2) } else { bytes }
        })
        .fold(0, usize::saturating_add)
}

/// The kernel's VMEM need by part: buffers, Mosaic's internal scratch, margin.
pub fn vmem_estimate(k: &Kernel, target: &Target) -> VmemEstimate {
    let internal = internal_scratch(k, target);
    VmemEstimate { buffers: vmem_bytes(k, target), internal: internal.scratch, margin: if internal.computes { VMEM_MARGIN } else { 0 } }
}

/// All the VMEM the kernel needs under its scoped limit (what rule `vmem-budget` checks).
pub fn vmem_need(k: &Kernel, target: &Target) -> usize {
    vmem_estimate(k, target).total()
}

/// The scoped VMEM limit the kernel runs under on `target`.
pub fn vmem_limit(k: &Kernel, target: &Target) -> usize {
    k.vmem_limit_bytes.unwrap_or(target.default_scoped_vmem_bytes)
}

/// SMEM a kernel needs: prefetch arrays, SMEM operands and SMEM scratch, padded as libtpu
/// lays them out, plus what libtpu reserves.
pub fn smem_bytes(k: &Kernel, target: &Target) -> usize {
    // tpu7x keeps 512 more bytes per scalar-prefetch table after the first (one table of
    // `1 MiB - 2 KiB` compiles; three of `1 MiB - 2.5 KiB` together do not).
    let tables = k.refs_of(RefKind::Prefetch).count().saturating_sub(1);
    let per_table = if target.generation == Generation::Tpu7x { 512 } else { 0 };
    k.refs
        .iter()
        .filter(|r| r.memory == MemorySpace::Smem)
        .map(|r| target.smem_padded_bytes(&r.shape).unwrap_or(usize::MAX))
        .fold(target.smem_reserved_bytes + tables * per_table, usize::saturating_add)
}

/// The padded bytes of a vector value (masks as 32-bit words).
fn value_bytes(k: &Kernel, t: &Target, v: Value) -> usize {
    let ty = k.ty(v);
    if ty.is_scalar() {
        return 0;
    }
    let dtype = if ty.dtype == DType::Bool { DType::I32 } else { ty.dtype };
    t.padded_bytes(dtype, &ty.shape)
}

/// Program order of the body: a position per instruction, only vector instructions taking
/// a step (the scalar index arithmetic between two vector ops does not make the first
/// one's result wait), and the span of every loop.
struct Order {
    pos: Vec<usize>,
    /// `(start, end)` of each loop, by the position of its `For`.
    spans: Vec<(usize, usize)>,
    /// For each instruction, its enclosing loops (indices into `spans`, outermost first).
    loops: Vec<Vec<usize>>,
    len: usize,
}

fn order(k: &Kernel) -> Order {
    fn visit(k: &Kernel, b: BlockId, stack: &mut Vec<usize>, o: &mut Order) {
        for &i in &k.block(b).insts {
            let p = o.len;
            if touches_vectors(k, k.inst(i)) {
                o.len += 1;
            }
            o.pos[i.index()] = p;
            o.loops[i.index()] = stack.clone();
            match &k.inst(i).inst {
                Inst::If { then_block, else_block, .. } => {
                    visit(k, *then_block, stack, o);
                    visit(k, *else_block, stack, o);
                }
                Inst::For { body, .. } => {
                    o.spans.push((p, 0));
                    stack.push(o.spans.len() - 1);
                    visit(k, *body, stack, o);
                    let span = stack.pop().expect("pushed above");
                    o.spans[span].1 = o.len;
                }
                _ => {}
            }
        }
    }
    let n = k.insts.len();
    let mut o = Order { pos: vec![usize::MAX; n], spans: Vec::new(), loops: vec![Vec::new(); n], len: 0 };
    visit(k, k.body, &mut Vec::new(), &mut o);
    o
}

/// The internal scratch of one `dot`, as measured with libtpu 0.0.52 (`tests/verdicts/vmem.md`):
/// part of the f32 result is staged in scratch (a quarter on v5e/v5p, half on v6e, all of
/// it on tpu7x); a packed (bf16, int8) operand adds the lhs, relaid out for the MXU, and a
/// quarter of the result on every generation; a transposed lhs adds a quarter of itself
/// (tgmm measures 0.13-0.35 MiB for 1-2 MiB operands).
fn dot_scratch(k: &Kernel, t: &Target, lhs: Value, rhs: Value, transpose_lhs: bool, out: Value) -> usize {
    let (l, result) = (value_bytes(k, t, lhs), value_bytes(k, t, out));
    let packed = k.ty(lhs).dtype != DType::F32 || k.ty(rhs).dtype != DType::F32;
    let staged = if packed {
        l + result / 4
    } else {
        match t.generation {
            Generation::V5e | Generation::V5p => result / 4,
            Generation::V6e => result / 2,
            Generation::Tpu7x => result,
        }
    };
    staged + if transpose_lhs { l / 4 } else { 0 }
}

fn touches_vectors(k: &Kernel, d: &InstData) -> bool {
    matches!(d.inst, Inst::If { .. } | Inst::For { .. }) || d.results.iter().chain(d.inst.operands().iter()).any(|&v| !k.ty(v).is_scalar())
}

/// Mosaic's internal scratch (module doc): the peak of held vector values, the largest
/// matmul's scratch, lane iotas and the largest loaded-column broadcast.
fn internal_scratch(k: &Kernel, t: &Target) -> Internal {
    let o = order(k);
    let nv = k.values.len();
    let mut def = vec![usize::MAX; nv];
    let mut last = vec![0usize; nv];
    let mut uses = vec![0usize; nv];
    let mut cheap = vec![false; nv];
    let mut loaded = vec![false; nv];
    let mut writes = Vec::new();
    let mut barriers = Vec::new();
    let mut computes = false;
    let mut iotas = std::collections::HashSet::new();
    let mut iota_bytes = 0usize;
    let mut broadcast_bytes = 0usize;
    let mut dot = 0usize;
    for (i, d) in k.insts.iter().enumerate() {
        let p = o.pos[i];
        if p == usize::MAX {
            continue; // not reachable from the body
        }
        for &r in &d.results {
            def[r.index()] = p;
            cheap[r.index()] = match &d.inst {
                Inst::Const(_) | Inst::Iota { .. } => true,
                Inst::Broadcast(x) => k.ty(*x).is_scalar(),
                _ => false,
            };
            loaded[r.index()] = matches!(d.inst, Inst::Load { .. });
        }
        let writes_memory = matches!(d.inst, Inst::Store { .. } | Inst::DmaStart { .. } | Inst::DmaWait { .. });
        if writes_memory {
            writes.push(p);
        }
        if writes_memory || matches!(d.inst, Inst::Reduce { .. } | Inst::Dot { .. } | Inst::Transpose(_)) {
            barriers.push(p);
        }
        if let Inst::For { body, .. } = &d.inst {
            // Carries live through the loop.
            for &pv in &k.block(*body).params {
                def[pv.index()] = p;
            }
        }
        match &d.inst {
            // A lane iota (counting along the last dim) is materialised whole, once per
            // shape; a sublane iota is not (cross_entropy_bwd's [tm, tv] column index
            // measures so, gmm's row index does not).
            Inst::Iota { dim } if *dim + 1 == k.ty(d.results[0]).rank() => {
                let ty = k.ty(d.results[0]);
                if iotas.insert(ty.shape.clone()) {
                    iota_bytes += t.padded_bytes(DType::I32, &ty.shape);
                }
            }
            // So is a lane broadcast of a column loaded from memory (`label`, `lse` in
            // cross_entropy_bwd), one at a time; a column a reduction made is already
            // replicated across lanes (softmax's max measures free).
            Inst::Broadcast(x) => {
                let (from, to) = (k.ty(*x), k.ty(d.results[0]));
                let loaded = matches!(k.value(*x).def, ValueDef::Result(i, _) if matches!(k.inst(i).inst, Inst::Load { .. }));
                if loaded && from.rank() >= 2 && from.shape.last() == Some(&1) && to.shape.last() > Some(&1) {
                    broadcast_bytes = broadcast_bytes.max(value_bytes(k, t, d.results[0]));
                }
            }
            _ => {}
        }
        if let Inst::Dot { lhs, rhs, transpose_lhs, .. } = &d.inst {
            dot = dot.max(dot_scratch(k, t, *lhs, *rhs, *transpose_lhs, d.results[0]));
        }
        computes |= !matches!(d.inst, Inst::Load { .. } | Inst::Store { .. } | Inst::DmaStart { .. } | Inst::DmaWait { .. } | Inst::Const(_) | Inst::Yield(_) | Inst::If { .. } | Inst::For { .. })
            && touches_vectors(k, d);
    }
    for (i, d) in k.insts.iter().enumerate() {
        let p = o.pos[i];
        if p == usize::MAX {
            continue;
        }
        for v in d.inst.operands() {
            let vi = v.index();
            uses[vi] += 1;
            // A value defined outside a loop and used inside is needed until the loop ends.
            let end = o.loops[i].iter().map(|&l| o.spans[l]).find(|(start, _)| def[vi] < *start).map_or(p, |s| s.1);
            last[vi] = last[vi].max(end.max(p));
        }
    }
    // Sweep: +bytes after the definition, -bytes after the last use.
    let mut delta = vec![0i64; o.len + 2];
    for v in 0..nv {
        let between = |ps: &[usize]| ps.iter().any(|&p| def[v] < p && p < last[v]);
        if def[v] == usize::MAX || cheap[v] || uses[v] == 0 {
            continue;
        }
        // A loaded value is re-read from its window, unless a write in between may have
        // changed the window (libtpu then keeps it: rmsnorm_bwd measures so). Any other
        // value is held whole only across an op that needs a whole operand first.
        if if loaded[v] { !between(&writes) } else { !between(&barriers) } {
            continue;
        }
        let bytes = value_bytes(k, t, Value(v as u32)) as i64;
        delta[def[v] + 1] += bytes;
        delta[last[v].min(o.len) + 1] -= bytes;
    }
    let (mut live, mut peak) = (0i64, 0i64);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    Internal { scratch: (peak as usize).saturating_add(dot).saturating_add(iota_bytes).saturating_add(broadcast_bytes), computes }
}

/// What [`internal_scratch`] finds.
struct Internal {
    scratch: usize,
    /// Whether the body computes on vectors at all (a copy or a gather does not, and
    /// libtpu then needs exactly our buffers).
    computes: bool,
}

impl Verifier<'_> {
    pub(super) fn memory_budget(&self) -> Result<()> {
        let est = vmem_estimate(self.k, self.t);
        let need = est.total();
        let limit = vmem_limit(self.k, self.t);
        if limit > self.t.vmem_bytes {
            return Err(self.err(
                "compiler params",
                "vmem-limit",
                format!("vmem_limit_bytes is {:.2} MiB, {} has {:.0} MiB of VMEM per core", limit as f64 / MIB, self.t, self.t.vmem_bytes as f64 / MIB),
                format!("ask for at most {} bytes", self.t.vmem_bytes),
            ));
        }
        if need > limit {
            let biggest = self
                .k
                .refs
                .iter()
                .filter(|r| r.memory == MemorySpace::Vmem)
                .max_by_key(|r| self.t.padded_bytes(r.dtype, &r.window()))
                .map(|r| format!("{} `{}` {:?} {}", r.kind.name(), r.name, r.window(), r.dtype))
                .unwrap_or_default();
            let raise = if need <= self.t.vmem_bytes { format!(", or raise vmem_limit_bytes to at least {need} (the core has {:.0} MiB)", self.t.vmem_bytes as f64 / MIB) } else { String::new() };
            return Err(self.err(
                "VMEM",
                "vmem-budget",
                format!(
                    "the kernel needs {:.2} MiB of VMEM ({:.2} MiB of buffers: blocked operands double-buffered, plus scratch; {:.2} MiB of Mosaic internal scratch for held vector values and matmuls; {:.2} MiB margin) but the limit on {} is {:.2} MiB; the largest buffer is {biggest}",
                    need as f64 / MIB,
                    est.buffers as f64 / MIB,
                    est.internal as f64 / MIB,
                    est.margin as f64 / MIB,
                    self.t,
                    limit as f64 / MIB
                ),
                format!("use smaller blocks{raise}"),
            ));
        }
        let smem = smem_bytes(self.k, self.t);
        if smem > self.t.smem_bytes {
            return Err(self.err(
                "SMEM",
                "smem-budget",
                format!(
                    "{smem} bytes of SMEM needed (prefetch tables and SMEM buffers padded to 128 words, plus {} bytes libtpu reserves), {} has {} (1 MiB)",
                    self.t.smem_reserved_bytes, self.t, self.t.smem_bytes
                ),
                format!("keep prefetch tables and SMEM buffers under {} bytes: pass large tables as ANY operands and copy the part you need by DMA", self.t.smem_bytes - self.t.smem_reserved_bytes),
            ));
        }
        Ok(())
    }
}
