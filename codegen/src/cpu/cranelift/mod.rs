//! The Cranelift backend: compiles a kernel's grid-step body ([`lower`]) to native code
//! with `cranelift-jit`, one module per compiled kernel so that evicting it from the cache
//! frees its code.

pub mod interleave;
pub(crate) mod lower;
pub mod vector;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cranelift_codegen::ir::types::{F32, I32, I64};
use cranelift_codegen::ir::{AbiParam, UserFuncName};
use cranelift_codegen::isa::OwnedTargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};
use tessera_dsl::Kernel;

pub use lower::Unsupported;
use lower::{Helpers, Lower};

use super::layout::{layouts, MemMode};
use super::runtime::{self as rt, Program, StepFn};

/// A compiled kernel: the program the driver runs, and the code memory behind it.
pub struct Compiled {
    pub program: Program,
    pub compile_time: Duration,
    module: Option<JITModule>,
}

// SAFETY: the module is never touched after compilation except to free it in `drop`, which
// needs `&mut self` (so no other reference exists); its code is immutable once finalised.
unsafe impl Send for Compiled {}
unsafe impl Sync for Compiled {}

impl Drop for Compiled {
    fn drop(&mut self) {
        if let Some(m) = self.module.take() {
            // SAFETY: `Compiled` owns the module; the step function pointer dies with
            // `self`, and every run holds an `Arc<Compiled>` for as long as it calls it.
            unsafe { m.free_memory() };
        }
    }
}

/// The host ISA, built once per process for each use: `speed` runs the mid-end in
/// [`optimize`]; the module's has it off, so that its backend keeps the order
/// [`interleave`] chose.
fn isa(speed: bool) -> Result<OwnedTargetIsa, Unsupported> {
    static ISAS: [OnceLock<Result<OwnedTargetIsa, Unsupported>>; 2] = [OnceLock::new(), OnceLock::new()];
    ISAS[usize::from(speed)].get_or_init(|| host_isa(if speed { "speed" } else { "none" })).clone()
}

fn host_isa(opt_level: &str) -> Result<OwnedTargetIsa, Unsupported> {
    let mut flags = settings::builder();
    let set = |f: &mut settings::Builder, k: &str, v: &str| f.set(k, v).map_err(|e| Unsupported(format!("cranelift flag {k}: {e}")));
    set(&mut flags, "opt_level", opt_level)?;
    set(&mut flags, "use_colocated_libcalls", "false")?;
    set(&mut flags, "is_pic", "false")?;
    set(&mut flags, "enable_verifier", if cfg!(debug_assertions) { "true" } else { "false" })?;
    let isa_builder = cranelift_native::builder().map_err(|e| Unsupported(format!("host not supported by cranelift: {e}")))?;
    isa_builder.finish(settings::Flags::new(flags)).map_err(|e| Unsupported(format!("cranelift isa: {e}")))
}

/// The helpers compiled code calls, by symbol name: (name, address) in the order of
/// [`Helpers`]' fields.
pub fn helper_symbols(exact: bool) -> [(&'static str, *const u8); 19] {
    [
        ("tessera_fail_slice", rt::helper_fail_slice as *const u8),
        ("tessera_dma", rt::helper_dma as *const u8),
        ("tessera_dot_f32", if exact { rt::helper_dot_f32_exact as *const u8 } else { rt::helper_dot_f32 as *const u8 }),
        ("tessera_dot_i32", rt::helper_dot_i32 as *const u8),
        ("tessera_fmod", rt::helper_fmod as *const u8),
        ("tessera_pow", rt::helper_pow as *const u8),
        ("tessera_i2bf", rt::helper_i32_to_bf16 as *const u8),
        ("tessera_exp", rt::helper_exp as *const u8),
        ("tessera_log", rt::helper_log as *const u8),
        ("tessera_tanh", rt::helper_tanh as *const u8),
        ("tessera_erf", rt::helper_erf as *const u8),
        ("tessera_dot_bf16", if exact { rt::helper_dot_bf16_exact as *const u8 } else { rt::helper_dot_bf16 as *const u8 }),
        ("tessera_log1p", rt::helper_log1p as *const u8),
        ("tessera_expm1", rt::helper_expm1 as *const u8),
        ("tessera_sin", rt::helper_sin as *const u8),
        ("tessera_cos", rt::helper_cos as *const u8),
        ("tessera_cumsum", rt::helper_cumsum as *const u8),
        ("tessera_prng_seed", rt::helper_prng_seed as *const u8),
        ("tessera_prng_bits", rt::helper_prng_bits as *const u8),
    ]
}

/// The grid-step function of `k` as Cranelift IR, built in `module` (which declares the
/// helpers): the function, its frame size, its failure sites, and each helper's `FuncRef`
/// with its address.
pub(crate) type Clif = (cranelift_codegen::Context, cranelift_module::FuncId, usize, super::layout::Sites, Vec<(cranelift_codegen::ir::FuncRef, *const u8)>);

pub(crate) fn build_clif(module: &mut JITModule, k: &Kernel, layouts: &[super::layout::RefLayout], exact: bool) -> Result<Clif, Unsupported> {
    let ptr = module.target_config().pointer_type();
    let sig = |m: &JITModule, params: &[cranelift_codegen::ir::Type], ret: Option<cranelift_codegen::ir::Type>| {
        let mut s = m.make_signature();
        s.params.extend(params.iter().map(|&t| AbiParam::new(t)));
        if let Some(r) = ret {
            s.returns.push(AbiParam::new(r));
        }
        s
    };
    let sig_fail = sig(module, &[ptr, I32, I32], Some(I32));
    let sig_dma = sig(module, &[ptr, I32, ptr], Some(I32));
    let sig_dot = sig(module, &[ptr, I64, I64, I64, ptr, I64, I64, ptr, I64, I64, ptr, I64, I32], None);
    let sig_ff = sig(module, &[F32, F32], Some(F32));
    let sig_if = sig(module, &[I32], Some(F32));
    let sig_f = sig(module, &[F32], Some(F32));
    let sig_step = sig(module, &[ptr], Some(I32));
    let sig_cumsum = sig(module, &[ptr, ptr, I64, I64, I64, I32], None);
    let sig_seed = sig(module, &[ptr, ptr, I64], None);
    let sig_bits = sig(module, &[ptr, I32, ptr, I64], Some(I32));
    let err = |e: cranelift_module::ModuleError| Unsupported(format!("cranelift: {e}"));
    let sigs = [&sig_fail, &sig_dma, &sig_dot, &sig_dot, &sig_ff, &sig_ff, &sig_if, &sig_f, &sig_f, &sig_f, &sig_f, &sig_dot, &sig_f, &sig_f, &sig_f, &sig_f, &sig_cumsum, &sig_seed, &sig_bits];
    let syms = helper_symbols(exact);
    let mut ids = Vec::new();
    for ((name, _), s) in syms.iter().zip(sigs) {
        ids.push(module.declare_function(name, Linkage::Import, s).map_err(err)?);
    }
    let step_id = module.declare_function("step", Linkage::Local, &sig_step).map_err(err)?;
    let mut ctx = module.make_context();
    ctx.func.signature = sig_step;
    ctx.func.name = UserFuncName::user(0, step_id.as_u32());
    let mut fctx = FunctionBuilderContext::new();
    let mut table = Vec::new();
    let (frame_bytes, sites) = {
        let b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
        let mut refs = Vec::new();
        for (id, (_, addr)) in ids.iter().zip(syms) {
            let r = module.declare_func_in_func(*id, b.func);
            refs.push(r);
            table.push((r, addr));
        }
        let h = Helpers { fail_slice: refs[0], dma: refs[1], dot_f32: refs[2], dot_i32: refs[3], fmod: refs[4], pow: refs[5], i2bf: refs[6], exp: refs[7], log: refs[8], tanh: refs[9], erf: refs[10], dot_bf16: refs[11], log1p: refs[12], expm1: refs[13], sin: refs[14], cos: refs[15], cumsum: refs[16], prng_seed: refs[17], prng_bits: refs[18] };
        let l = Lower::new(k, layouts, b, h, exact)?;
        l.lower(module.target_config())?
    };
    Ok((ctx, step_id, frame_bytes, sites, table))
}

/// Cranelift's mid-end (the e-graph pass: GVN, LICM, constant folding, simplification),
/// then [`interleave`]'s order; the module compiles the result with the mid-end off.
fn optimize(ctx: &mut cranelift_codegen::Context) -> Result<(), Unsupported> {
    ctx.optimize(&*isa(true)?, &mut Default::default()).map_err(|e| Unsupported(format!("cranelift mid-end: {e:?}")))?;
    interleave::interleave(&mut ctx.func);
    Ok(())
}

/// `TESSERA_JIT_DUMP=DIR`: writes the step function of `k` as optimised Cranelift IR
/// (`<kernel>.clif`) and as machine code (`<kernel>.s`), to see what a kernel costs per
/// element. Best effort: a dump that cannot be written is reported, never fatal.
fn write_dump(dir: &std::path::Path, k: &Kernel, ctx: &cranelift_codegen::Context) {
    let asm = ctx.compiled_code().and_then(|c| c.vcode.clone()).unwrap_or_default();
    let name: String = k.name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    let written = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(dir.join(format!("{name}.clif")), ctx.func.display().to_string()))
        .and_then(|_| std::fs::write(dir.join(format!("{name}.s")), asm));
    if let Err(e) = written {
        eprintln!("tessera: TESSERA_JIT_DUMP: could not write `{name}` to {}: {e}", dir.display());
    }
}

/// A JIT module for the host with the helpers' symbols.
pub(crate) fn new_module(exact: bool) -> Result<JITModule, Unsupported> {
    let mut jb = JITBuilder::with_isa(isa(false)?, default_libcall_names());
    for (name, p) in helper_symbols(exact) {
        jb.symbol(name, p);
    }
    Ok(JITModule::new(jb))
}

/// Compiles `k` for memory `modes` (one per ref); `exact` computes transcendentals and
/// dots exactly as the interpreter does (a checking mode for the fuzzer).
pub fn compile(k: &Kernel, modes: &[MemMode], exact: bool) -> Result<Compiled, Unsupported> {
    let start = Instant::now();
    let layouts = layouts(k, modes);
    let mut module = new_module(exact)?;
    let result = (|| {
        let (mut ctx, step_id, frame_bytes, sites, _) = build_clif(&mut module, k, &layouts, exact)?;
        let err = |e: cranelift_module::ModuleError| Unsupported(format!("cranelift: {e}"));
        optimize(&mut ctx)?;
        let dump = std::env::var_os("TESSERA_JIT_DUMP");
        ctx.set_disasm(dump.is_some());
        module.define_function(step_id, &mut ctx).map_err(|e| Unsupported(format!("cranelift could not compile `{}`: {e:?}", k.name)))?;
        if let Some(dir) = dump {
            write_dump(std::path::Path::new(&dir), k, &ctx);
        }
        module.clear_context(&mut ctx);
        module.finalize_definitions().map_err(err)?;
        let code = module.get_finalized_function(step_id);
        // SAFETY: `step` was defined with `sig_step`, i.e. `extern "C" fn(*mut StepCtx) -> i32`
        // in the host's default calling convention.
        let step: StepFn = unsafe { std::mem::transmute::<*const u8, StepFn>(code) };
        Ok((step, frame_bytes, sites))
    })();
    match result {
        Ok((step, frame_bytes, sites)) => Ok(Compiled { program: Program { step, frame_bytes, layouts, sites }, compile_time: start.elapsed(), module: Some(module) }),
        Err(e) => {
            // SAFETY: nothing compiled in this module is referenced.
            unsafe { module.free_memory() };
            Err(e)
        }
    }
}
