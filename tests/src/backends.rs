//! The CPU backends a test runs a kernel on, and the bitwise comparison the op tests hold
//! the compiled backends to (shared by tests/tests/{dsl_ops,dsl_ops_scan,fp8,dynamic_grid,
//! nested_pipeline}.rs).

use tessera_codegen::cpu::{cache_stats, Backend};
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, DType, Kernel, Target, Type};

use crate::oracle;

/// The interpreter, the Cranelift JIT, and LLVM in builds with the `llvm` feature.
pub fn all() -> Vec<Backend> {
    let mut v = vec![Backend::Interp, Backend::Jit];
    if cfg!(feature = "llvm") {
        v.push(Backend::Llvm);
    }
    v
}

/// Runs `k` on every backend: the interpreter's outputs, after checking that each compiled
/// backend gives the same bits, every NaN counting as one (arithmetic's NaN payloads and
/// signs are unspecified, `dsl/README.md`), and compiled it (no fallback to the interpreter).
pub fn run_all(k: &Kernel, inputs: &[&Array]) -> Vec<Array> {
    let want = exec::run(Backend::Interp.executor(), k, inputs).unwrap_or_else(|e| panic!("interp: {e}"));
    for be in all().into_iter().skip(1) {
        let before = cache_stats().fallbacks;
        let got = exec::run(be.executor(), k, inputs).unwrap_or_else(|e| panic!("{be:?}: {e}"));
        assert_eq!(cache_stats().fallbacks, before, "{be:?} fell back to the interpreter for `{}`", k.name);
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(bits(w), bits(g), "{be:?} differs from the interpreter on `{}`", k.name);
        }
    }
    want
}

/// An array's elements as comparable bits (every NaN one value).
pub fn bits(a: &Array) -> Vec<u64> {
    let f = |x: f32| if x.is_nan() { u64::MAX } else { x.to_bits() as u64 };
    if let Some(v) = a.as_f32() {
        v.iter().map(|&x| f(x)).collect()
    } else if let Some(v) = a.as_bf16() {
        v.iter().map(|&x| f(x.to_f32())).collect()
    } else if let Some(v) = a.as_i32() {
        v.iter().map(|&x| x as u32 as u64).collect()
    } else if let Some(v) = a.as_i8() {
        v.iter().map(|&x| x as u8 as u64).collect()
    } else if let Some(v) = a.fp8_bits() {
        v.iter().map(|&x| x as u64).collect()
    } else {
        a.as_bool().map(|v| v.iter().map(|&x| x as u64).collect()).unwrap_or_default()
    }
}

/// A vector type.
pub fn ty(dtype: DType, shape: &[usize]) -> Type {
    Type { dtype, shape: shape.to_vec() }
}

/// Lowers each kernel for `target` and asserts libtpu compiles every module (the libtpu
/// tier; names are `<kernel>-<index>`).
pub fn assert_libtpu_accepts(kernels: &[Kernel], target: &Target) {
    let modules: Vec<(String, String)> = kernels
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let lowered = tessera_codegen::lower(k, target).unwrap_or_else(|e| panic!("{} on {}: {e}", k.name, target.name));
            (format!("{}-{i}", k.name), lowered.stablehlo)
        })
        .collect();
    oracle::assert_accepted(&modules, target.name);
}
