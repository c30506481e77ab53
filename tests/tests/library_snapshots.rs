//! Snapshots of every library kernel's IR, Mosaic and StableHLO at default shapes on v5e
//! and v6e: a change to generated code shows up as a reviewed snapshot diff.

use tessera_dsl::{DType, Target, Type};
use tessera_kernels::LIBRARY;

#[test]
fn library_kernels() {
    for target in [Target::V5E, Target::V6E] {
        for k in LIBRARY {
            let types: Vec<Type> = k.inputs.iter().map(|o| Type::vector(DType::F32, o.default_shape)).collect();
            let kernel = (k.build)(&types, &target).unwrap();
            let lowered = tessera_codegen::lower(&kernel, &target).unwrap();
            let name = format!("{}_{}", k.name, target.name);
            insta::assert_snapshot!(format!("{name}_ir"), kernel.to_string());
            insta::assert_snapshot!(format!("{name}_mosaic"), lowered.mosaic);
            insta::assert_snapshot!(format!("{name}_stablehlo"), lowered.stablehlo);
        }
    }
}
