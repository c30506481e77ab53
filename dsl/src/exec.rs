//! The contract every CPU backend implements: run a kernel over caller-owned memory with
//! the interpreter's semantics ([`crate::interp`]'s module docs are the spec).
//!
//! The interpreter is one implementation ([`Interpreter`]); the compiled emulators in
//! `tessera-codegen` (`cpu::Cranelift`, `cpu::Llvm`) are others. Code that runs kernels
//! (library plans, the CLI, tests) takes a `&dyn Executor`, so the backend is a parameter
//! and never a hard-wired call.

use crate::error::Result;
use crate::interp::{self, HostMut, HostRef, RunStats};
use crate::ir::Kernel;

/// A CPU backend: runs `kernel` on `inputs` (prefetch and input operands, signature order)
/// writing `outputs` (output operands, signature order), exactly as [`interp::run_into`].
pub trait Executor: Send + Sync {
    /// A short name for messages and reports (`interp`, `jit`, `llvm`).
    fn name(&self) -> &'static str;

    /// Runs the kernel; the same contract and errors as [`interp::run_into`].
    fn run_into(&self, kernel: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<RunStats>;
}

/// The reference interpreter as an [`Executor`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Interpreter;

impl Executor for Interpreter {
    fn name(&self) -> &'static str {
        "interp"
    }

    fn run_into(&self, kernel: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<RunStats> {
        interp::run_into(kernel, inputs, outputs)
    }
}

/// Runs `kernel` on `args` with `exec`, allocating the outputs (as [`interp::run`]).
pub fn run(exec: &dyn Executor, kernel: &Kernel, args: &[&interp::Array]) -> Result<Vec<interp::Array>> {
    let inputs: Vec<HostRef<'_>> = args.iter().map(|a| a.as_host()).collect();
    let mut outputs: Vec<interp::Array> = kernel.refs_of(crate::ir::RefKind::Output).map(|(_, d)| interp::Array::poison(d.dtype, &d.shape)).collect();
    let mut views: Vec<HostMut<'_>> = outputs.iter_mut().map(interp::Array::as_host_mut).collect();
    exec.run_into(kernel, &inputs, &mut views)?;
    drop(views);
    Ok(outputs)
}
