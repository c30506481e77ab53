//! Errors name the kernel and say what to change.

mod common;

use tessera_codegen::{lower, CodegenError};
use tessera_dsl::ir::{BlockSpec, IndexExpr};
use tessera_dsl::{DType, KernelBuilder, Semantics, Target};

#[test]
fn verifier_errors_are_wrapped() {
    let mut b = KernelBuilder::new("bad_tiles");
    b.grid(&[(1, Semantics::Parallel)]);
    let spec = || BlockSpec { block_shape: vec![Some(100), Some(100)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[200, 200], spec());
    let o = b.output("o", DType::F32, &[200, 200], spec());
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    let k = b.finish().unwrap();
    let e = lower(&k, &Target::V5E).unwrap_err();
    assert!(matches!(&e, CodegenError::Verify(ke) if ke.rule == "block-tiling"), "{e}");
    assert!(e.to_string().contains("bad_tiles"), "{e}");
}

#[test]
fn bool_operands_are_rejected_with_a_fix() {
    let mut b = KernelBuilder::new("mask_out");
    b.grid(&[(1, Semantics::Parallel)]);
    let spec = || BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[8, 128], spec());
    let o = b.output("o", DType::Bool, &[8, 128], spec());
    let v = b.load(x, &[]);
    let m = b.cmp(tessera_dsl::ir::CmpOp::Gt, v, 0.0);
    b.store(o, &[], m);
    let k = b.finish().unwrap();
    let e = lower(&k, &Target::V6E).unwrap_err();
    let msg = e.to_string();
    // The verifier's rule (so the CPU backends refuse it too), before Mosaic is emitted.
    assert!(matches!(&e, CodegenError::Verify(ke) if ke.rule == "memory-dtype"), "{e}");
    assert!(msg.contains("mask_out") && msg.contains("output `o`") && msg.contains("help:"), "{msg}");
}
