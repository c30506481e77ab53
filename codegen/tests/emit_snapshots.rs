//! Snapshots of the emitted Mosaic and StableHLO for hand-built kernels (v5e).
//! A change to generated code is a reviewed snapshot diff.

mod common;

use tessera_codegen::{lower, stablehlo};
use tessera_dsl::Target;

/// The StableHLO text with the base64 body replaced by a note, after checking that the
/// body decodes to exactly the Mosaic snapshot.
fn redact_body(stablehlo: &str, mosaic: &str) -> String {
    assert_eq!(stablehlo::decode_body(stablehlo).as_deref(), Some(mosaic), "body must be the base64 of the Mosaic text");
    stablehlo::redact_body(stablehlo).unwrap()
}

macro_rules! snap {
    ($name:ident) => {
        #[test]
        fn $name() {
            let k = common::$name();
            let l = lower(&k, &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
            insta::assert_snapshot!(concat!(stringify!($name), "_mosaic"), l.mosaic);
            insta::assert_snapshot!(concat!(stringify!($name), "_stablehlo"), redact_body(&l.stablehlo, &l.mosaic));
        }
    };
}

snap!(matmul_f32);
snap!(gelu_affine);
snap!(softmax_bf16);
snap!(prefetch_loop);
snap!(op_zoo);
snap!(unblocked_operands);
snap!(dma_double_buffer);

/// `main` keeps the kernel's signature (callers pass every operand); the custom call and
/// the Mosaic function take only the inputs a live instruction reads, and moves no bytes
/// for the others.
#[test]
fn unread_inputs_are_not_passed() {
    let k = common::unread_inputs();
    let l = lower(&k, &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
    assert!(l.stablehlo.contains("func.func public @main(%arg0: tensor<2x8x128xi32>, %arg1: tensor<16x128xf32>, %arg2: tensor<16x128xf32>)"), "{}", l.stablehlo);
    assert!(l.stablehlo.contains("stablehlo.custom_call @tpu_custom_call(%arg1) {"), "{}", l.stablehlo);
    assert!(l.mosaic.contains("^bb0(%arg0: i32, %arg1: memref<8x128xf32, #tpu.memory_space<vmem>>, %arg2: memref<8x128xf32, #tpu.memory_space<vmem>>):"), "{}", l.mosaic);
    assert_eq!(l.mosaic.matches("vector.load").count(), 1, "the dead load is not emitted:\n{}", l.mosaic);
    assert_eq!(l.mosaic.matches("window_bounds").count(), 2, "{}", l.mosaic);
    assert_eq!(l.cost.bytes_accessed, 2 * 2 * 8 * 128 * 4, "x and o move, `unused` and `dead` do not");
    assert_eq!(l.cost.flops, 2, "the dead multiply of `dead`'s block is not counted, only a compare per grid step");
}

#[test]
fn matmul_cost() {
    let c = tessera_codegen::estimate(&common::matmul_f32());
    assert_eq!(c.flops, 2 * 512 * 512 * 512 + 512 * 512 * 4 + 64 * 2); // dots + acc adds + 2 scalar cmps per step
    assert_eq!(c.transcendentals, 0);
    // x and y change block every step (K is innermost); o changes every 4 steps.
    assert_eq!(c.bytes_accessed, (64 + 64 + 16) * 128 * 128 * 4);
}

#[test]
fn every_target_lowers() {
    for k in common::all() {
        for t in [Target::V5E, Target::V6E, Target::TPU7X] {
            lower(&k, &t).unwrap_or_else(|e| panic!("{} on {}: {e}", k.name, t.name));
        }
    }
}
