//! Two-pass long-row softmax: snapshots of both passes, the op's numerics against its f64
//! reference on every CPU backend, verification (and libtpu) on three generations.
use tessera::testing::{self, float_dtypes, prop, Strategy};
use tessera::{DType, Target, Type};
use user_kernels::{long_softmax, OPS};

const TARGETS: [Target; 3] = [Target::V5E, Target::V6E, Target::TPU7X];

#[test]
fn snapshots() {
    for pass in 0..2 {
        tessera::assert_snapshots!(|_: &Target| Ok(long_softmax(&Type::vector(DType::BF16, &[16, 8192]))?[pass].clone()), [Target::V5E, Target::V6E]);
    }
}

#[test]
fn verifies_and_compiles() {
    for pass in 0..2 {
        testing::assert_verifies(|_: &Target| Ok(long_softmax(&Type::vector(DType::BF16, &[64, 65536]))?[pass].clone()), &TARGETS);
    }
}

#[test]
fn numerics() {
    // Rows of 1 to 40, 128 to 12288 columns (one block up to 4096, then several).
    let cases = (1usize..40, prop::sample::select(vec![1usize, 3, 8, 24, 96]), float_dtypes()).prop_map(|(m, k, dt)| (vec![vec![m, 128 * k]], dt));
    testing::assert_op_numerics(&OPS[1], "", &Target::V6E, cases);
}
