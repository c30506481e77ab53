//! Tessera's TPU backend: lowers a verified block-IR [`Kernel`] to
//!
//! - a Mosaic TPU kernel module in the stable serialized text form ([`mosaic::emit`]),
//! - a StableHLO module holding it in a `tpu_custom_call` ([`stablehlo::emit`]), which
//!   libtpu compiles for a TPU (and TorchTPU registers as a custom kernel),
//! - a static [`CostEstimate`] for XLA's scheduler ([`cost::estimate`]).
//!
//! [`lower`] runs the verifier first and does all three.
//!
//! [`cpu`] holds the CPU backends (the interpreter, the Cranelift JIT and LLVM) behind one
//! [`tessera_dsl::Executor`] contract.

// `CodegenError::Verify` carries the verifier's `KernelError` by value (the error callers
// already match on); it is large, but errors are cold.
#![allow(clippy::result_large_err)]

pub mod cost;
pub mod cpu;
pub mod mosaic;
pub mod stablehlo;
mod text;

pub use cost::{estimate, ring_step, roofline, CostEstimate, RingStep, Roofline, StaticProfile};
use tessera_dsl::verify::{verify, vmem_bytes, vmem_limit, vmem_need};
use tessera_dsl::{Kernel, KernelError, Target};

/// Everything the TPU path needs for one kernel on one target.
#[derive(Clone, Debug, PartialEq)]
pub struct Lowered {
    /// The Mosaic kernel module (stable serialized generic text).
    pub mosaic: String,
    /// The StableHLO module with the `tpu_custom_call` (body = base64 of `mosaic`).
    pub stablehlo: String,
    pub cost: CostEstimate,
    /// VMEM the kernel's buffers take (double-buffered blocks plus scratch, tile-padded).
    pub vmem_bytes: usize,
    /// All the VMEM it needs by the verifier's count (`verify::vmem_need`: the buffers plus
    /// Mosaic's internal scratch and the margin).
    pub vmem_need: usize,
    /// The scoped VMEM limit written into the backend_config.
    pub vmem_limit_bytes: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The kernel breaks a rule the verifier checks.
    #[error(transparent)]
    Verify(#[from] KernelError),
    /// The kernel is valid IR but this backend cannot express part of it.
    #[error("kernel `{kernel}`: cannot lower {what} to Mosaic for {target}\n  help: {help}")]
    Unsupported { kernel: String, target: String, what: String, help: String },
}

impl CodegenError {
    pub(crate) fn unsupported(k: &Kernel, target: &Target, what: impl Into<String>, help: impl Into<String>) -> CodegenError {
        CodegenError::Unsupported { kernel: k.name.clone(), target: target.name.to_string(), what: what.into(), help: help.into() }
    }
}

/// Verifies `kernel` for `target`, then emits its Mosaic module, StableHLO wrapper and cost.
pub fn lower(kernel: &Kernel, target: &Target) -> Result<Lowered, CodegenError> {
    verify(kernel, target)?;
    let mosaic = mosaic::emit(kernel, target)?;
    let cost = estimate(kernel);
    let limit = vmem_limit(kernel, target);
    let stablehlo = stablehlo::wrap(kernel, &mosaic, &cost, limit);
    Ok(Lowered { mosaic, stablehlo, cost, vmem_bytes: vmem_bytes(kernel, target), vmem_need: vmem_need(kernel, target), vmem_limit_bytes: limit })
}
