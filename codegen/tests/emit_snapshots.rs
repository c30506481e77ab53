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
