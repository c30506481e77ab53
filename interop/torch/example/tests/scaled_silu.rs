//! The kernel behind `torch.ops.tpu.scaled_silu`, tested in Rust: snapshots per target,
//! numerics against the f64 reference on every CPU backend (the kernel alone, and the op
//! with `x` of any rank), verification (and libtpu with TESSERA_TPU_ORACLE=1).
use tessera::testing::{self, float_dtypes, prop, Strategy};
use tessera::{random, DType, Kernel, KernelError, Target, Type};
use tessera_example::{blocks, reference, scaled_silu_kernel, OPS};

fn kernel(m: usize, n: usize, dt: DType, beta: f32) -> impl Fn(&Target) -> Result<Kernel, KernelError> {
    move |t| {
        let (x, scale) = (Type::vector(dt, &[m, n]), Type::vector(dt, &[1, n]));
        let b = blocks(&x, t);
        scaled_silu_kernel(x.clone(), scale, x, b.bm, b.bn, beta)
    }
}

#[test]
fn snapshots() {
    tessera::assert_snapshots!(kernel(512, 1024, DType::BF16, 1.702), [Target::V5E, Target::V6E]);
}

#[test]
fn verifies_and_compiles() {
    testing::assert_verifies(kernel(4096, 8192, DType::BF16, 1.0), &[Target::V5E, Target::V6E, Target::TPU7X]);
}

#[test]
fn kernel_numerics() {
    let cases = (1usize..300, prop::sample::select(vec![128usize, 200, 1024]), float_dtypes(), -2.0f32..2.0);
    testing::assert_numerics(
        cases,
        |&(m, n, dt, beta)| Ok((kernel(m, n, dt, beta)(&Target::V6E)?, vec![random(dt, &[m, n], 7), random(dt, &[1, n], 8)])),
        |&(_, _, _, beta), a| vec![reference(&a[0].to_f64_vec(), &a[1].to_f64_vec(), beta as f64)],
    );
}

#[test]
fn op_numerics() {
    // x of rank 1 to 3 over rows of n; scale [n].
    let cases = (prop::collection::vec(1usize..9, 0..3), prop::sample::select(vec![128usize, 640]), float_dtypes());
    let cases = cases.prop_map(|(mut lead, n, dt)| {
        lead.push(n);
        (vec![lead, vec![n]], dt)
    });
    testing::assert_op_numerics(&OPS[0], "beta=0.5", &Target::V5E, cases);
}
