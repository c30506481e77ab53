//! Checks a kernel against a TPU generation before any compiler sees it, so that a user
//! gets an error in their own terms (kernel, operand, rule, fix) instead of a late,
//! cryptic Mosaic failure, and a warning where the kernel compiles but runs poorly.
//!
//! Every rule is in the rulebook ([`crate::rules::RULES`]) with its evidence: a pair of
//! kernels on either side of the edge, judged by libtpu, for the rules libtpu can judge
//! (`tests/src/rulebook/`). The checks are split by what they look at:
//!
//! - [`structure`]: the IR is well formed (ids exist, accesses agree with their refs);
//! - [`grid`]: the grid's rank and extents;
//! - [`operand`]: each operand's shape, memory space, block spec, tiling and index map,
//!   and the output-revisit rules of the grid order;
//! - [`budget`]: VMEM and SMEM, with Mosaic's padding and internal scratch modelled;
//! - [`body`]: the instructions (op x dtype support per generation, vector access alignment);
//! - [`dma`]: async copy descriptors;
//! - [`collective`]: the mesh, remote copies and semaphores of kernels that talk to other devices;
//! - [`align`]: the divisibility analysis that proves dynamic offsets aligned;
//! - [`warn`]: performance warnings (never errors).

pub mod align;
mod body;
pub mod budget;
pub mod collective;
mod dma;
mod grid;
mod operand;
mod structure;
mod warn;

pub use align::Multiples;
pub use budget::{smem_bytes, vmem_bytes, vmem_estimate, vmem_limit, vmem_need, VmemEstimate, VMEM_MARGIN};
pub use warn::warnings;

use crate::error::{KernelError, Result, Warning};
use crate::ir::*;
use crate::target::Target;

/// Runs every check; returns the first violation.
pub fn verify(k: &Kernel, target: &Target) -> Result<()> {
    let v = Verifier { k, t: target };
    v.structure()?;
    v.collective()?;
    v.grid()?;
    v.has_output()?;
    for r in &k.refs {
        // Block-spec, tiling, bounds and index-map errors point at the operand's declaration.
        v.operand(r).map_err(|e| e.or_at(&r.loc))?;
    }
    v.hbm()?;
    v.output_revisits()?;
    v.memory_budget()?;
    v.body()?;
    Ok(())
}

/// Whether some TPU generation accepts the kernel: what every CPU backend checks before
/// running one (a CPU result for a kernel no TPU compiles could not be reproduced). The
/// generations are tried from the most permissive (largest VMEM limits) down; when none
/// accepts, the error is the first one's.
pub fn runnable(k: &Kernel) -> Result<()> {
    let mut first = None;
    for t in [Target::V6E, Target::TPU7X, Target::V5P, Target::V5E] {
        match verify(k, &t) {
            Ok(()) => return Ok(()),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    Err(first.expect("four targets were tried"))
}

/// [`verify`], then the performance warnings of a kernel that passes: what the CLI and the
/// torch path show (once per kernel) before compiling.
pub fn check(k: &Kernel, target: &Target) -> Result<Vec<Warning>> {
    verify(k, target)?;
    Ok(warnings(k, target))
}

pub(crate) struct Verifier<'a> {
    pub k: &'a Kernel,
    pub t: &'a Target,
}

impl Verifier<'_> {
    pub(crate) fn err(&self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        KernelError::new(&self.k.name, subject, rule, message, help)
    }

    /// [`Self::err`] about operand `r`, at its declaration.
    pub(crate) fn err_at(&self, r: &RefDecl, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        self.err(subject, rule, message, help).at(r.loc.clone())
    }
}

/// Evaluates an index map with no prefetch reads at the given grid indices.
pub fn eval_static(e: &IndexExpr, grid: &[i64]) -> Option<i64> {
    eval_index(e, grid, &mut |_, _| None)
}

/// Evaluates an index map; `prefetch(array, indices)` reads a scalar-prefetch operand.
pub fn eval_index(e: &IndexExpr, grid: &[i64], prefetch: &mut dyn FnMut(RefId, &[i64]) -> Option<i64>) -> Option<i64> {
    Some(match e {
        IndexExpr::Grid(g) => *grid.get(*g)?,
        IndexExpr::Const(c) => *c,
        IndexExpr::Prefetch { array, index } => {
            let mut at = Vec::with_capacity(index.len());
            for i in index {
                at.push(eval_index(i, grid, prefetch)?);
            }
            prefetch(*array, &at)?
        }
        IndexExpr::Bin(op, a, b) => {
            let (a, b) = (eval_index(a, grid, prefetch)?, eval_index(b, grid, prefetch)?);
            match op {
                IndexOp::Add => a.wrapping_add(b),
                IndexOp::Sub => a.wrapping_sub(b),
                IndexOp::Mul => a.wrapping_mul(b),
                IndexOp::Div => a.checked_div(b)?,
                IndexOp::Rem => a.checked_rem(b)?,
                IndexOp::Min => a.min(b),
                IndexOp::Max => a.max(b),
            }
        }
    })
}
