//! The real TPU compiler tier (enabled by `TESSERA_TPU_ORACLE=1`, which `scripts/test.sh`
//! sets): every library kernel, f32 and bf16, at default shapes and at a second shape set,
//! compiles with libtpu for v5e, v6e and tpu7x; and the broken kernels that libtpu can
//! judge are rejected by it too when forced past our verifier.

use tessera_dsl::{DType, Target, Type};
use tessera_kernels::library;
use tessera_tests::{broken, oracle};

const TARGETS: [Target; 3] = [Target::V5E, Target::V6E, Target::TPU7X];

fn skip() -> bool {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return true;
    }
    false
}

/// Input types of an op: float operands take `dtype`, the others are int32.
fn op_types(k: &tessera_kernels::LibraryKernel, shapes: &[Vec<usize>], dtype: DType) -> Vec<Type> {
    k.inputs.iter().zip(shapes).map(|(o, s)| Type::vector(o.kind.dtype(dtype), s)).collect()
}

#[test]
fn every_library_kernel_compiles_for_v5e_v6e_tpu7x() {
    if skip() {
        return;
    }
    for target in TARGETS {
        let mut modules = Vec::new();
        for k in library() {
            let defaults: Vec<Vec<usize>> = k.inputs.iter().map(|o| o.default_shape.to_vec()).collect();
            for (set, shapes) in [("default", defaults), ("alt", k.alt_shapes.iter().map(|s| s.to_vec()).collect())] {
                for dtype in [DType::F32, DType::BF16] {
                    for kernel in (k.build)(&op_types(k, &shapes, dtype), &target).unwrap_or_else(|e| panic!("{}: {e}", k.name)) {
                        let lowered = tessera_codegen::lower(&kernel, &target).unwrap_or_else(|e| panic!("{}: {e}", k.name));
                        modules.push((format!("{}-{}-{set}-{dtype}", k.name, kernel.name), lowered.stablehlo));
                    }
                }
            }
        }
        oracle::assert_accepted(&modules, target.name);
    }
}

#[test]
fn libtpu_rejects_the_broken_kernels_it_can_judge() {
    if skip() {
        return;
    }
    let judged: Vec<broken::Broken> = broken::all().into_iter().filter(|b| b.libtpu_rejects.is_some()).collect();
    assert!(judged.len() >= 4);
    for b in &judged {
        let kernel = b.kernel.as_ref().expect("libtpu-judged cases pass the builder");
        // Forced through: emit without our verifier.
        let text = tessera_codegen::stablehlo::emit(kernel, &b.target).unwrap_or_else(|e| panic!("{}: {e}", b.name));
        let v = &oracle::compile(&[(b.name.to_string(), text)], b.target.name)[0];
        eprintln!("{:<24} ours: {:<20} libtpu: {}", b.name, b.rule, if v.ok { "accepts".to_string() } else { format!("rejects: {}", v.error.lines().next().unwrap_or("")) });
        assert_eq!(!v.ok, b.libtpu_rejects.unwrap(), "{}: libtpu verdict differs from the expectation", b.name);
    }
}
