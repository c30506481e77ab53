//! A static cost estimate for XLA's scheduler (`cost_estimate` in the custom call's
//! backend_config). It is an estimate, not a measurement:
//!
//! - the body is walked once and multiplied by the number of grid steps; only live
//!   instructions count ([`Kernel::live_insts`]: the ones Mosaic is given);
//! - a `for` loop with constant bounds counts its static trip count; a loop with a dynamic
//!   bound counts one trip;
//! - an `if` counts the costlier branch (each field separately), as if it were always taken;
//! - `dot` is 2·m·n·k flops; elementwise arithmetic, compares, selects and reductions
//!   1 flop per element; exp/log/tanh/erf/sqrt/rsqrt 1 transcendental per element;
//! - `bytes_accessed`: each blocked operand moves its window once per grid step at which its
//!   block index changes (the pipeline skips the copy when it does not; index maps that read
//!   scalar prefetch are assumed to change every step); unblocked operands move once; an
//!   input no instruction touches is not passed (`mosaic::passed_refs`) and moves nothing;
//! - `remote_bytes_transferred`: the boxes of remote copies this device starts (counted like
//!   flops: per grid step, loops by their static trip count), what it sends over the
//!   interconnect.

use tessera_dsl::ir::*;
use tessera_dsl::verify::eval_static;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostEstimate {
    pub flops: u64,
    pub transcendentals: u64,
    pub bytes_accessed: u64,
    pub remote_bytes_transferred: u64,
}

impl CostEstimate {
    fn scaled(self, n: u64) -> CostEstimate {
        CostEstimate { flops: self.flops * n, transcendentals: self.transcendentals * n, bytes_accessed: self.bytes_accessed * n, remote_bytes_transferred: self.remote_bytes_transferred * n }
    }

    fn add(&mut self, o: CostEstimate) {
        self.flops += o.flops;
        self.transcendentals += o.transcendentals;
        self.bytes_accessed += o.bytes_accessed;
        self.remote_bytes_transferred += o.remote_bytes_transferred;
    }

    fn max(self, o: CostEstimate) -> CostEstimate {
        CostEstimate {
            flops: self.flops.max(o.flops),
            transcendentals: self.transcendentals.max(o.transcendentals),
            bytes_accessed: self.bytes_accessed.max(o.bytes_accessed),
            remote_bytes_transferred: self.remote_bytes_transferred.max(o.remote_bytes_transferred),
        }
    }
}

pub fn estimate(kernel: &Kernel) -> CostEstimate {
    let live = kernel.live_insts();
    let mut c = block_cost(kernel, kernel.body, &live).scaled(kernel.grid_steps() as u64);
    c.bytes_accessed = bytes_accessed(kernel);
    c
}

fn block_cost(k: &Kernel, b: BlockId, live: &[bool]) -> CostEstimate {
    let mut c = CostEstimate::default();
    for &i in k.block(b).insts.iter().filter(|i| live[i.index()]) {
        let d = k.inst(i);
        let elems = d.results.first().map_or(0, |&r| k.ty(r).num_elements().max(1) as u64);
        match &d.inst {
            Inst::Unary(op, _) if op.is_transcendental() => c.transcendentals += elems,
            Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } => c.flops += elems,
            Inst::Reduce { x, .. } => c.flops += k.ty(*x).num_elements() as u64,
            // The Hillis-Steele scan Mosaic runs: ceil(log2 n) adds per element.
            Inst::Cumsum { axis, x } => {
                let t = k.ty(*x);
                let n = t.shape.get(*axis).copied().unwrap_or(1).max(1) as u64;
                c.flops += t.num_elements() as u64 * (u64::BITS - (n - 1).leading_zeros()) as u64;
            }
            Inst::Dot { lhs, transpose_lhs, .. } => {
                let s = &k.ty(*lhs).shape;
                let kdim = if *transpose_lhs { s[0] } else { s[1] };
                c.flops += 2 * elems * kdim as u64;
            }
            Inst::DmaStart { dst, remote: Some(_), .. } => c.remote_bytes_transferred += (k.ref_decl(dst.r).dtype.bytes() * dst.shape().iter().product::<usize>()) as u64,
            Inst::If { then_block, else_block, .. } => c.add(block_cost(k, *then_block, live).max(block_cost(k, *else_block, live))),
            Inst::For { lo, hi, step, body, .. } => c.add(block_cost(k, *body, live).scaled(trip_count(k, *lo, *hi, *step))),
            _ => {}
        }
    }
    c
}

/// Static trip count of `lo..hi step`, or 1 when a bound is dynamic.
fn trip_count(k: &Kernel, lo: Value, hi: Value, step: i64) -> u64 {
    match (k.as_const(lo), k.as_const(hi)) {
        (Some(Scalar::Int(l)), Some(Scalar::Int(h))) if step > 0 => {
            if h <= l {
                0
            } else {
                ((h - l) as u64).div_ceil(step as u64)
            }
        }
        _ => 1,
    }
}

fn bytes_accessed(k: &Kernel) -> u64 {
    let passed = crate::mosaic::passed_refs(k);
    k.operands()
        .filter(|(id, _)| passed[id.index()])
        .map(|(_, r)| {
            let Some(b) = &r.block else {
                return (r.dtype.bytes() * r.shape.iter().product::<usize>()) as u64;
            };
            let window = (r.dtype.bytes() * b.window().iter().product::<usize>()) as u64;
            window * block_changes(k, b)
        })
        .sum()
}

/// How many grid steps load a new block (the first step always does).
fn block_changes(k: &Kernel, b: &BlockSpec) -> u64 {
    let steps = k.grid_steps();
    if steps > 1 << 22 {
        return steps as u64; // too many to enumerate cheaply: assume every step
    }
    let mut idx = vec![0i64; k.grid.len()];
    let mut prev: Option<Vec<i64>> = None;
    let mut changes = 0u64;
    for _ in 0..steps {
        let Some(cur) = b.index_map.iter().map(|e| eval_static(e, &idx)).collect::<Option<Vec<i64>>>() else {
            return steps as u64; // reads scalar prefetch: assume every step
        };
        if prev.as_ref() != Some(&cur) {
            changes += 1;
        }
        prev = Some(cur);
        // Lexicographic order, last grid dim fastest (Pallas order).
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if (idx[d] as usize) < k.grid[d].extent {
                break;
            }
            idx[d] = 0;
        }
    }
    changes
}

/// libtpu's static LLO profile of one compiled kernel (`tpu_compile.py --profile`, DESIGN §9).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StaticProfile {
    /// The custom call's `estimated_cycles`: the compiler's cost model over its scheduled
    /// bundles, every grid step.
    pub cycles: u64,
    /// What XLA adds around the call (layout copies of operands or results), cycles.
    pub outside_cycles: u64,
    pub bundles: u64,
    /// Vector spill loads and stores (VMEM spill slots), scalar ones (SMEM).
    pub vector_spills: u64,
    pub scalar_spills: u64,
    /// The end of the highest VMEM allocation, spill slots included.
    pub vmem_bytes: u64,
    /// Whether libtpu estimated the cycles. Kernels with a dynamic grid dim are profiled
    /// without the estimate (`tpu_compile.py --llo-only`: it cannot know the trip count, and
    /// takes minutes on them), and so are kernels its profiler aborts on; their `cycles` are
    /// 0, the rest are the LLO's.
    pub estimated: bool,
}

impl StaticProfile {
    /// The custom calls' figures (summed over the program's calls), and the cycles of what
    /// XLA adds around them, from one result line of `tpu_compile.py --profile` or
    /// `scripts/pallas_cost.py`; `None` when the compile failed or gave no profile.
    pub fn from_report(report: &serde_json::Value) -> Option<StaticProfile> {
        if report["ok"].as_bool() != Some(true) {
            return None;
        }
        let ops = report["profile"]["ops"].as_array()?;
        let n = |op: &serde_json::Value, key: &str| op[key].as_u64().unwrap_or(0);
        let is_call = |op: &&serde_json::Value| op["custom_call"].as_bool() == Some(true);
        // A program of several custom calls (a forward and its backward kernels) sums them;
        // VMEM is the largest call's.
        let calls: Vec<&serde_json::Value> = ops.iter().filter(is_call).collect();
        if calls.is_empty() {
            return None;
        }
        let sum = |key: &str| calls.iter().map(|op| n(op, key)).sum();
        Some(StaticProfile {
            cycles: sum("cycles"),
            outside_cycles: ops.iter().filter(|op| !is_call(op)).map(|op| n(op, "cycles")).sum(),
            bundles: sum("bundles"),
            vector_spills: sum("vector_spills"),
            scalar_spills: sum("scalar_spills"),
            vmem_bytes: calls.iter().map(|op| n(op, "vmem_bytes")).max().unwrap_or(0),
            estimated: calls.iter().all(|op| op["cycles"].is_u64()),
        })
    }
}

/// A kernel's time on one TensorCore, from libtpu's estimate and from the IR's own count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// libtpu's cycles (custom call and what XLA adds) at the target's clock.
    pub estimate_us: f64,
    /// The IR's flops at the core's bf16 MXU peak (a floor for straight-line kernels: f32
    /// and VPU work run slower; but the IR counts every `if` as taken).
    pub mxu_us: f64,
    /// The IR's HBM bytes at the device's bandwidth (libtpu's model omits HBM stalls).
    pub hbm_us: f64,
    /// `max(estimate, hbm)`, or `max(mxu, hbm)` when the estimate is blind.
    pub time_us: f64,
    /// What `time_us` is set by: `"compute"` (libtpu's estimate) or `"hbm"`.
    pub bound: &'static str,
    /// The kernel's index maps read scalar prefetch and libtpu's estimate is below the
    /// IR's MXU floor: the static model did not see the prefetch-driven trip counts
    /// (megablox gmm), so the time is the IR's explicit model instead. Also set for a
    /// kernel with a dynamic grid dim, whose trip count libtpu's model cannot know (its
    /// estimate for gmm's visit dim is 3-4x the same kernel's at the static bound); the
    /// IR's model then counts the dim at its bound. And set when libtpu gave no estimate
    /// (`StaticProfile::estimated`).
    pub blind: bool,
}

impl Roofline {
    /// The roofline's share of the time: `max(mxu, hbm) / time`, 1.0 at the roofline. Read
    /// it for kernels whose every grid step runs (matmul, the norms): the IR counts the
    /// flops of every `if` as taken, so a kernel that skips blocks (causal attention) shows
    /// more than it does. Meaningless when the time is the IR's own model (`blind`).
    pub fn efficiency(&self) -> f64 {
        self.mxu_us.max(self.hbm_us) / self.time_us
    }
}

/// [`Roofline`] of `kernel` on `target` from its profile.
pub fn roofline(kernel: &Kernel, profile: &StaticProfile, target: &tessera_dsl::Target) -> Roofline {
    let est = estimate(kernel);
    let estimate_us = (profile.cycles + profile.outside_cycles) as f64 / (target.clock_ghz() * 1e3);
    let splits = kernel.grid.iter().any(|g| g.semantics == tessera_dsl::Semantics::Parallel && g.extent > 1);
    let mxu_us = est.flops as f64 / (target.device_peak_tflops(splits) * 1e6);
    let hbm_us = est.bytes_accessed as f64 / (target.hbm_gbps * 1e3);
    let reads_prefetch = kernel.refs.iter().any(|r| r.kind == RefKind::Prefetch);
    let dynamic = kernel.grid.iter().any(|g| g.dynamic.is_some());
    let blind = !profile.estimated || dynamic || reads_prefetch && estimate_us < mxu_us;
    let compute_us = if blind { mxu_us } else { estimate_us };
    let (time_us, bound) = if hbm_us > compute_us { (hbm_us, "hbm") } else { (compute_us, "compute") };
    Roofline { estimate_us, mxu_us, hbm_us, time_us, bound, blind }
}

/// One step of a ring collective whose copy runs under its compute (the all-gather matmul):
/// `bytes` to the next device over one ICI link in one direction, `flops` at one TensorCore's
/// bf16 MXU peak. A step takes the longer of the two. Figures, not measurements: the link
/// rate is the spec sheet's (`Target::ici_link_gbps`), and the MXU rate a ceiling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingStep {
    pub copy_us: f64,
    pub compute_us: f64,
    pub step_us: f64,
    /// `"ici"` when the copy is the longer, else `"compute"`.
    pub bound: &'static str,
}

pub fn ring_step(bytes: u64, flops: u64, target: &tessera_dsl::Target) -> RingStep {
    let copy_us = bytes as f64 / (target.ici_link_gbps() * 1e3);
    let compute_us = flops as f64 / (target.core_peak_tflops() * 1e6);
    let (step_us, bound) = if copy_us > compute_us { (copy_us, "ici") } else { (compute_us, "compute") };
    RingStep { copy_us, compute_us, step_us, bound }
}
