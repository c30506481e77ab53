//! Snapshots of the emitted Mosaic and StableHLO for hand-built kernels (v5e).
//! A change to generated code is a reviewed snapshot diff.

mod common;

use base64::Engine;
use tessera_codegen::lower;
use tessera_dsl::Target;

/// The StableHLO text with the base64 body replaced by a note (the body is the Mosaic
/// snapshot; the test checks that it decodes to exactly that).
fn redact_body(stablehlo: &str, mosaic: &str) -> String {
    let start = stablehlo.find("\\22body\\22: \\22").expect("body field") + "\\22body\\22: \\22".len();
    let len = stablehlo[start..].find("\\22").unwrap();
    let b64 = &stablehlo[start..start + len];
    let decoded = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
    assert_eq!(String::from_utf8(decoded).unwrap(), mosaic, "body must be the base64 of the Mosaic text");
    format!("{}<base64 of the mosaic snapshot, {} bytes>{}", &stablehlo[..start], b64.len(), &stablehlo[start + len..])
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
