//! Frame bytes of each library kernel's compiled grid step, first case, f32 (a profiling aid):
//! `cargo run --release -p tessera-tests --example frame_sizes`.
use tessera_codegen::cpu::layout::default_modes;
use tessera_dsl::{DType, Target};
fn main() {
    for op in tessera_kernels::library() {
        let Some(case) = op.cases.first() else { continue };
        let Ok(statics) = op.case_statics(case) else { continue };
        let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
        let Ok(plan) = op.plan_for(&op.types(&shapes, DType::F32), &statics, &Target::V5E) else { continue };
        for l in &plan.launches {
            let k = &l.kernel;
            let c = tessera_codegen::cpu::cranelift::compile(k, &default_modes(k, &[]), false).unwrap();
            println!("{:<40} frame {:>8} KiB", k.name, c.program.frame_bytes / 1024);
        }
    }
}
