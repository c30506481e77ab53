//! A static cost estimate for XLA's scheduler (`cost_estimate` in the custom call's
//! backend_config). It is an estimate, not a measurement:
//!
//! - the body is walked once and multiplied by the number of grid steps;
//! - a `for` loop with constant bounds counts its static trip count; a loop with a dynamic
//!   bound counts one trip;
//! - an `if` counts the costlier branch (each field separately), as if it were always taken;
//! - `dot` is 2·m·n·k flops; elementwise arithmetic, compares, selects and reductions
//!   1 flop per element; exp/log/tanh/erf/sqrt/rsqrt 1 transcendental per element;
//! - `bytes_accessed`: each blocked operand moves its window once per grid step at which its
//!   block index changes (the pipeline skips the copy when it does not; index maps that read
//!   scalar prefetch are assumed to change every step); unblocked operands move once.

use tessera_dsl::ir::*;
use tessera_dsl::verify::eval_static;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostEstimate {
    pub flops: u64,
    pub transcendentals: u64,
    pub bytes_accessed: u64,
}

impl CostEstimate {
    fn scaled(self, n: u64) -> CostEstimate {
        CostEstimate { flops: self.flops * n, transcendentals: self.transcendentals * n, bytes_accessed: self.bytes_accessed * n }
    }

    fn add(&mut self, o: CostEstimate) {
        self.flops += o.flops;
        self.transcendentals += o.transcendentals;
        self.bytes_accessed += o.bytes_accessed;
    }

    fn max(self, o: CostEstimate) -> CostEstimate {
        CostEstimate { flops: self.flops.max(o.flops), transcendentals: self.transcendentals.max(o.transcendentals), bytes_accessed: self.bytes_accessed.max(o.bytes_accessed) }
    }
}

pub fn estimate(kernel: &Kernel) -> CostEstimate {
    let mut c = block_cost(kernel, kernel.body).scaled(kernel.grid_steps() as u64);
    c.bytes_accessed = bytes_accessed(kernel);
    c
}

fn block_cost(k: &Kernel, b: BlockId) -> CostEstimate {
    let mut c = CostEstimate::default();
    for &i in &k.block(b).insts {
        let d = k.inst(i);
        let elems = d.results.first().map_or(0, |&r| k.ty(r).num_elements().max(1) as u64);
        match &d.inst {
            Inst::Unary(op, _) if op.is_transcendental() => c.transcendentals += elems,
            Inst::Unary(..) | Inst::Binary(..) | Inst::Cmp(..) | Inst::Select { .. } => c.flops += elems,
            Inst::Reduce { x, .. } => c.flops += k.ty(*x).num_elements() as u64,
            Inst::Dot { lhs, transpose_lhs, .. } => {
                let s = &k.ty(*lhs).shape;
                let kdim = if *transpose_lhs { s[0] } else { s[1] };
                c.flops += 2 * elems * kdim as u64;
            }
            Inst::If { then_block, else_block, .. } => c.add(block_cost(k, *then_block).max(block_cost(k, *else_block))),
            Inst::For { lo, hi, step, body, .. } => c.add(block_cost(k, *body).scaled(trip_count(k, *lo, *hi, *step))),
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
    k.operands()
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
