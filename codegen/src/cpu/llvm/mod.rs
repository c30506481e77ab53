//! The LLVM backend (feature `llvm`): the same lowering as the Cranelift backend (its
//! Cranelift IR, translated to LLVM IR by [`lower`]), optimised by LLVM at O3 for the host
//! CPU (no fast-math: LLVM may not reassociate or contract floating point) and compiled
//! with MCJIT. It shares the driver, the schedule and the cache with the Cranelift backend.

pub mod lower;

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::memory_buffer::MemoryBuffer;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::OptimizationLevel;
use tessera_dsl::Kernel;

use super::cranelift::{build_clif, new_module, Unsupported};
use super::layout::{layouts, MemMode};
use super::runtime::{Program, StepFn};

/// A kernel compiled by LLVM: the program, and the context and engine owning its code.
pub struct Compiled {
    pub program: Program,
    pub compile_time: Duration,
    /// The IR handed to LLVM (for inspection).
    pub ir: String,
    engine: ManuallyDrop<ExecutionEngine<'static>>,
    context: *mut Context,
}

// SAFETY: after compilation the engine and context are only dropped (in `drop`, with
// `&mut self`); the machine code they own is immutable and reentrant.
unsafe impl Send for Compiled {}
unsafe impl Sync for Compiled {}

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: the engine borrows the context, so it goes first; the context was
        // leaked from a `Box` in `compile` and is freed exactly once here.
        unsafe {
            ManuallyDrop::drop(&mut self.engine);
            drop(Box::from_raw(self.context));
        }
    }
}

/// Compiles `k` for memory `modes` with LLVM.
pub fn compile(k: &Kernel, modes: &[MemMode], exact: bool) -> Result<Compiled, Unsupported> {
    let start = Instant::now();
    let layouts = layouts(k, modes);
    let err = |e: String| Unsupported(format!("llvm: {e}"));
    // The one lowering, as Cranelift IR (the module only provides declarations).
    let mut module = new_module(exact)?;
    let clif = build_clif(&mut module, k, &layouts, exact);
    // SAFETY: nothing was compiled into this module.
    unsafe { module.free_memory() };
    let (ctx, _, frame_bytes, sites, table) = clif?;
    let helpers: HashMap<_, _> = table.iter().map(|&(r, p)| (r, p as usize)).collect();
    Target::initialize_native(&InitializationConfig::default()).map_err(err)?;
    let cpu = TargetMachine::get_host_cpu_name().to_string();
    let features = TargetMachine::get_host_cpu_features().to_string();
    let attrs = format!("\"target-cpu\"=\"{cpu}\" \"target-features\"=\"{features}\"");
    let ir = lower::translate(&ctx.func, &helpers, &attrs)?;
    let context = Box::into_raw(Box::new(Context::create()));
    let result = (|| {
        // SAFETY: `context` stays alive until `Compiled` is dropped (or freed below on error).
        let c: &'static Context = unsafe { &*context };
        let buf = MemoryBuffer::create_from_memory_range_copy(ir.as_bytes(), "tessera");
        let m = c.create_module_from_ir(buf).map_err(|e| err(format!("{e}\n{ir}")))?;
        let triple = TargetMachine::get_default_triple();
        let target = Target::from_triple(&triple).map_err(|e| err(e.to_string()))?;
        let tm = target.create_target_machine(&triple, &cpu, &features, OptimizationLevel::Aggressive, RelocMode::Default, CodeModel::JITDefault).ok_or_else(|| err("no target machine for the host".into()))?;
        m.set_triple(&triple);
        m.set_data_layout(&tm.get_target_data().get_data_layout());
        m.verify().map_err(|e| err(format!("invalid IR: {e}")))?;
        m.run_passes("default<O3>", &tm, PassBuilderOptions::create()).map_err(|e| err(e.to_string()))?;
        let engine = m.create_jit_execution_engine(OptimizationLevel::Aggressive).map_err(|e| err(e.to_string()))?;
        let addr = engine.get_function_address("step").map_err(|e| err(e.to_string()))?;
        Ok((engine, addr))
    })();
    match result {
        Ok((engine, addr)) => {
            // SAFETY: `step` is `i32 (ptr)` in the C calling convention, i.e. `StepFn`.
            let step: StepFn = unsafe { std::mem::transmute::<usize, StepFn>(addr) };
            Ok(Compiled { program: Program { step, frame_bytes, layouts, sites }, compile_time: start.elapsed(), ir, engine: ManuallyDrop::new(engine), context })
        }
        Err(e) => {
            // SAFETY: nothing borrows the context any more.
            unsafe { drop(Box::from_raw(context)) };
            Err(e)
        }
    }
}
