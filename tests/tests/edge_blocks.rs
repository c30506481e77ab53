//! Arrays whose dims are not multiples of the block dims (Pallas' partial edge blocks):
//! the verifier accepts them, the interpreter computes the valid region exactly, and
//! libtpu compiles them.

use tessera_dsl::interp::{self, Array};
use tessera_dsl::{BlockSpec, DType, IndexExpr as I, KernelBuilder, Kernel, Semantics, Target};
use tessera_tests::oracle;

/// `out = 2 * x` on `[1000, 200]` in `[128, 128]` blocks: the last row block holds 104
/// valid rows and the last column block 72 valid columns.
fn double(dtype: DType) -> Kernel {
    let spec = || BlockSpec { block_shape: vec![Some(128), Some(128)], index_map: vec![I::Grid(0), I::Grid(1)] };
    let mut b = KernelBuilder::new("double_edge");
    b.grid(&[(8, Semantics::Parallel), (2, Semantics::Parallel)]);
    let x = b.input("x", dtype, &[1000, 200], spec());
    let o = b.output("out", dtype, &[1000, 200], spec());
    let v = b.load(x, &[]);
    let v = b.mul(v, 2.0);
    b.store(o, &[], v);
    b.finish().unwrap()
}

#[test]
fn interpreter_computes_the_valid_region() {
    let k = double(DType::F32);
    tessera_dsl::verify::verify(&k, &Target::V5E).unwrap();
    let xs: Vec<f32> = (0..200_000).map(|i| (i % 977) as f32 * 0.5).collect();
    let out = interp::run(&k, &[&Array::from_f32(&[1000, 200], xs.clone())]).unwrap();
    let got = out[0].as_f32().unwrap();
    assert!(got.iter().zip(&xs).all(|(g, x)| *g == 2.0 * x), "edge blocks must write exactly the valid region");
}

#[test]
fn libtpu_compiles_partial_edge_blocks() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for d in [DType::F32, DType::BF16] {
            jobs.push((format!("double_edge_{d}"), target.name.to_string(), tessera_codegen::lower(&double(d), &target).unwrap().stablehlo));
        }
    }
    oracle::assert_all_accepted(&jobs);
}
