//! Snapshots of every library op's kernels (IR, Mosaic and StableHLO) for each of its
//! cases at their shapes (the `alt` shape sets excepted) on v5e and v6e: a change to
//! generated code shows up as a reviewed snapshot diff.

use tessera_dsl::{DType, Target};
use tessera_kernels::library;

#[test]
fn library_kernels() {
    for target in [Target::V5E, Target::V6E] {
        for op in library().filter(|op| op.alias_of.is_none()) {
            for case in op.cases.iter().filter(|c| !c.name.ends_with("alt")) {
                let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
                let statics = op.case_statics(case).unwrap();
                let plan = op.plan_for(&op.types(&shapes, DType::F32), &statics, &target).unwrap();
                // The op's name, `_<case>` unless it is the default case, `_<kernel>` for
                // plans of several kernels.
                let stem = if case.name == "default" { op.name.to_string() } else { format!("{}_{}", op.name, case.name) };
                for (i, launch) in plan.launches.iter().enumerate() {
                    let kernel = &launch.kernel;
                    let lowered = tessera_codegen::lower(kernel, &target).unwrap();
                    // A kernel launched twice in one plan (matmul_bwd) is numbered.
                    let repeated = plan.launches.iter().filter(|l| l.kernel.name == kernel.name).count() > 1;
                    let kernel_name = if repeated { format!("{}{i}", kernel.name) } else { kernel.name.clone() };
                    let name = if plan.launches.len() == 1 { format!("{stem}_{}", target.name) } else { format!("{stem}_{kernel_name}_{}", target.name) };
                    insta::assert_snapshot!(format!("{name}_ir"), kernel.to_string());
                    insta::assert_snapshot!(format!("{name}_mosaic"), lowered.mosaic);
                    // The body is the Mosaic snapshot: check it, then show the wrapper alone.
                    assert_eq!(tessera_codegen::stablehlo::decode_body(&lowered.stablehlo).as_deref(), Some(lowered.mosaic.as_str()));
                    insta::assert_snapshot!(format!("{name}_stablehlo"), tessera_codegen::stablehlo::redact_body(&lowered.stablehlo).unwrap());
                }
            }
        }
    }
}
