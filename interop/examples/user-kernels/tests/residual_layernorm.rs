//! residual + LayerNorm: snapshots, numerics against the f64 reference on every CPU backend,
//! verification (and libtpu with TESSERA_TPU_ORACLE=1) on three generations, emission.
use tessera::testing::{self, float_dtypes, prop};
use tessera::{random, DType, Kernel, KernelError, Target, Type};
use user_kernels::{reference, residual_layernorm};

fn kernel(m: usize, n: usize, dt: DType) -> impl Fn(&Target) -> Result<Kernel, KernelError> {
    move |t| residual_layernorm(&Type::vector(dt, &[m, n]), &Type::vector(dt, &[1, n]), 1e-5, t)
}

#[test]
fn snapshots() {
    tessera::assert_snapshots!(kernel(64, 1024, DType::BF16), [Target::V5E, Target::V6E]);
}

#[test]
fn verifies_compiles_and_emits() {
    testing::assert_verifies(kernel(2048, 4096, DType::BF16), &[Target::V5E, Target::V6E, Target::TPU7X]);
    let dir = std::env::temp_dir().join(format!("user-kernels-emit-{}", std::process::id()));
    let e = tessera::emit_kernel(&kernel(256, 1024, DType::F32)(&Target::V6E).unwrap(), &Target::V6E, &dir).unwrap();
    assert!(std::fs::read_to_string(&e.stablehlo).unwrap().contains("@tpu_custom_call"));
    assert!(e.stablehlo.starts_with(dir.join("v6e")), "one folder per target: {}", e.stablehlo.display());
}

#[test]
fn numerics() {
    let cases = (1usize..40, prop::sample::select(vec![128usize, 384, 1024]), float_dtypes());
    let inputs = |m, n, dt| vec![random(dt, &[m, n], 1), random(dt, &[m, n], 2), random(dt, &[1, n], 3), random(dt, &[1, n], 4)];
    testing::assert_numerics(cases, |&(m, n, dt)| Ok((kernel(m, n, dt)(&Target::V6E)?, inputs(m, n, dt))), |&(_, n, _), a| {
        let (y, h) = reference::residual_layernorm(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[3].to_f64_vec(), n, 1e-5);
        vec![y, h]
    });
}
