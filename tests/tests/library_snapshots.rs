//! Snapshots of every library kernel's IR, Mosaic and StableHLO at default shapes on v5e
//! and v6e: a change to generated code shows up as a reviewed snapshot diff.

use tessera_dsl::{DType, Target, Type};
use tessera_kernels::library;

#[test]
fn library_kernels() {
    for target in [Target::V5E, Target::V6E] {
        for k in library() {
            let types: Vec<Type> = k.inputs.iter().map(|o| Type::vector(o.kind.dtype(DType::F32), o.default_shape)).collect();
            let kernels = (k.build)(&types, &target).unwrap();
            for kernel in &kernels {
                let lowered = tessera_codegen::lower(kernel, &target).unwrap();
                // One-kernel ops keep the op's name; ops of several kernels add the kernel's.
                let name = if kernels.len() == 1 { format!("{}_{}", k.name, target.name) } else { format!("{}_{}_{}", k.name, kernel.name, target.name) };
                insta::assert_snapshot!(format!("{name}_ir"), kernel.to_string());
                insta::assert_snapshot!(format!("{name}_mosaic"), lowered.mosaic);
                // The body is the Mosaic snapshot: check it, then show the wrapper alone.
                assert_eq!(tessera_codegen::stablehlo::decode_body(&lowered.stablehlo).as_deref(), Some(lowered.mosaic.as_str()));
                insta::assert_snapshot!(format!("{name}_stablehlo"), tessera_codegen::stablehlo::redact_body(&lowered.stablehlo).unwrap());
            }
        }
    }
}
