//! Tessera's tiled block IR.
//!
//! A [`Kernel`] is a Pallas-style program: a grid of program instances, each of which
//! sees one block of every operand (chosen by the operand's [`BlockSpec`] index map) and
//! runs the kernel body on whole blocks. This crate holds the IR ([`ir`]), the
//! [`KernelBuilder`] that constructs it, a text printer, the TPU [`target`] model, the
//! [`verify`] pass that checks a kernel against a target, and the reference CPU
//! interpreter ([`interp`]) that defines what every op means.

pub mod builder;
pub mod error;
pub mod exec;
pub mod fp8;
pub mod interp;
pub mod ir;
pub mod pipeline;
pub mod print;
pub mod rules;
pub mod target;
pub mod types;
pub mod verify;

pub use builder::{ds, ds_strided, Arg, Index, KernelBuilder, RemoteCopy, Sem};
pub use error::{KernelError, Result, Warning};
pub use exec::{Executor, Interpreter};
pub use ir::*;
pub use pipeline::{Pipe, PipeBlock};
pub use target::Target;
pub use types::{DType, MemorySpace, Semantics, Type};
