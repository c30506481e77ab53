//! Tessera for kernel authors: the one crate a kernel crate depends on.
//!
//! It re-exports `#[tpu_kernel]` and the DSL, and has the few calls a kernel author needs:
//!
//! - host arrays from slices, `half::bf16` values or a shape ([`array`], [`array_as`],
//!   [`random`], [`zeros`], [`type_of`]);
//! - [`run`] a kernel on a CPU backend ([`Backend::Interp`], [`Backend::Jit`],
//!   [`Backend::Llvm`] with the `llvm` feature), or [`run_op`] an op of a table;
//! - [`allclose`] against a reference, with a report of the mismatches (index, got, want);
//! - [`verify`] for a list of targets, [`emit`] StableHLO + Mosaic to a folder, and
//!   [`tpu_compile`] with the real TPU compiler (libtpu, in a child process);
//! - [`testing`]: one-line snapshot, numerics and verify/compile tests;
//! - [`cli`]: the `tessera list / run / emit / check / table` commands over your ops
//!   beside the library's (`tessera::cli::main(MY_OPS)` in your own binary).
//!
//! The tutorial is `interop/TUTORIAL.md`.

// `Error::Kernel` carries a `KernelError` by value; errors are cold.
#![allow(clippy::result_large_err)]

mod compare;
mod emit;
mod host;
mod tpu;

pub mod cli;
pub mod testing;

pub use compare::{allclose, Mismatch, Tolerance};
pub use emit::{emit, emit_kernel, verify, Emitted};
pub use host::{array, array_as, array_fp8_bits, random, type_of, zeros, Element};
pub use tpu::{libtpu_version, python, tpu_compile, tpu_profile, tpu_ready, Verdict};

pub use half::bf16;
/// fp8 host elements (the `float8` crate's `F8E4M3` = `float8_e4m3fn`, `F8E5M2`) and
/// torch's conversions to and from f32 (`fp8::to_e4m3fn`, `fp8::e4m3fn_to_f32`, ...).
pub use tessera_dsl::fp8::{self, F8E4M3, F8E5M2};
pub use tessera_codegen as codegen;
pub use tessera_codegen::cpu::Backend;
pub use tessera_codegen::{lower, Lowered};
pub use tessera_dsl as dsl;
pub use tessera_dsl::interp::Array;
pub use tessera_dsl::{DType, Kernel, KernelError, Target, Type, Warning};
pub use tessera_kernels as kernels;
pub use tessera_kernels::plan::{result, single, Launch, Operand};
pub use tessera_kernels::tune::{self, Knob};
pub use tessera_kernels::{library, Call, Case, Input, Kind, Op, Output, Plan, Static, Statics};
pub use tessera_macros::{tpu_fn, tpu_kernel};

use std::fmt;

/// What can go wrong outside a kernel's own rules: a [`KernelError`] (builder, verifier,
/// interpreter), a lowering the Mosaic backend cannot express, a file, or the TPU compiler
/// not being there.
#[derive(Debug)]
pub enum Error {
    Kernel(KernelError),
    Lower(tessera_codegen::CodegenError),
    /// A file or folder could not be written (the message names the path).
    Io(String),
    /// The TPU compiler could not be run: no Python, no jax/libtpu, the script failed.
    Tpu(String),
    /// A CPU backend this build does not have.
    Backend(String),
    /// A host array whose values do not fill its shape.
    Host(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Kernel(e) => e.fmt(f),
            Error::Lower(e) => e.fmt(f),
            Error::Io(m) | Error::Tpu(m) | Error::Backend(m) | Error::Host(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

impl From<KernelError> for Error {
    fn from(e: KernelError) -> Error {
        Error::Kernel(e)
    }
}

impl From<tessera_codegen::CodegenError> for Error {
    fn from(e: tessera_codegen::CodegenError) -> Error {
        match e {
            tessera_codegen::CodegenError::Verify(k) => Error::Kernel(k),
            other => Error::Lower(other),
        }
    }
}

/// `backend`, or an error saying how to get it into the build.
fn executor(backend: Backend) -> Result<&'static dyn dsl::Executor, Error> {
    if backend.available() {
        Ok(backend.executor())
    } else {
        Err(Error::Backend(format!("this build has no {backend} CPU backend: enable the `llvm` feature of the `tessera` crate (needs LLVM 22, scripts/setup-llvm.sh)")))
    }
}

/// The CPU backends this build has: the interpreter, the JIT, and LLVM with the `llvm`
/// feature.
pub fn backends() -> Vec<Backend> {
    Backend::ALL.into_iter().filter(|b| b.available()).collect()
}

/// Runs `kernel` on `backend` with `inputs` (prefetch and input operands in signature
/// order); returns its outputs. Every CPU backend first checks that some TPU generation
/// accepts the kernel, then runs it with the interpreter's semantics (fresh outputs are
/// NaN-poisoned, so a block never written shows up as NaN).
pub fn run(kernel: &Kernel, backend: Backend, inputs: &[&Array]) -> Result<Vec<Array>, Error> {
    Ok(dsl::exec::run(executor(backend)?, kernel, inputs)?)
}

/// Runs op `op` (an entry of your table or the library's) on `backend`: its plan for these
/// inputs and `statics` (`name=value, ...`, the rest default), kernels built and verified
/// for `target`.
pub fn run_op(op: &Op, backend: Backend, inputs: &[&Array], statics: &str, target: &Target) -> Result<Vec<Array>, Error> {
    let given: Vec<Option<&Array>> = inputs.iter().map(|&a| Some(a)).collect();
    Ok(op.run(executor(backend)?, &given, &op.statics(statics)?, target)?)
}
