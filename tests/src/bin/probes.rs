//! Runs the probe set through our verifier and libtpu and prints the agreement report.
use tessera_tests::{oracle, probes};

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    if filter == "vmem" {
        return vmem_main();
    }
    let all: Vec<probes::Probe> = probes::all().into_iter().filter(|p| p.name.contains(&filter)).collect();
    let mut jobs = Vec::new();
    let mut idx = Vec::new();
    for (i, p) in all.iter().enumerate() {
        if let Ok(k) = &p.kernel {
            if let Ok(text) = tessera_codegen::stablehlo::emit(k, &p.target) {
                jobs.push((p.name.clone(), p.target.name.to_string(), text));
                idx.push(i);
            }
        }
    }
    let verdicts = oracle::compile_cached(&jobs);
    let mut lib = vec![None; all.len()];
    for (i, v) in idx.into_iter().zip(verdicts) {
        lib[i] = Some(v);
    }
    for (p, v) in all.iter().zip(&lib) {
        let ours = match &p.kernel {
            Err(e) => Err(e.clone()),
            Ok(k) => tessera_dsl::verify::verify(k, &p.target),
        };
        let o = match &ours { Ok(()) => "ok".to_string(), Err(e) => format!("rej[{}]", e.rule) };
        let l = match v { None => "n/a".to_string(), Some(v) if v.ok => "ok".into(), Some(v) => format!("REJ {}", v.error.lines().filter(|l| !l.trim().is_empty()).take(3).collect::<Vec<_>>().join(" | ").chars().take(300).collect::<String>()) };
        let agree = match v { None => "?", Some(v) => if v.ok == ours.is_ok() { "=" } else if v.ok { "FR" } else { "FA" } };
        println!("{agree:<2} {:<48} ours={o:<28} libtpu={l}", p.name);
    }
}
fn vmem_main() {
    use tessera_dsl::{DType, Type, Target};
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for op in tessera_kernels::library().filter(|op| op.alias_of.is_none()) {
            let Some(case) = op.cases.first() else { continue };
            let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
            let Ok(statics) = op.case_statics(case) else { continue };
            for dtype in [DType::F32, DType::BF16] {
                if let Ok(plan) = op.plan_for(&op.types(&shapes, dtype), &statics, &target) {
                    for launch in plan.launches {
                        jobs.push(tessera_tests::vmem::Job { name: format!("{}-{}-{dtype}@{}", op.name, launch.kernel.name, target.name), target, kernel: launch.kernel });
                    }
                }
            }
        }
        for dtype in [DType::F32, DType::BF16] {
            for (bm, bk, bn) in [(512, 512, 512), (1024, 512, 512), (512, 1024, 1024), (256, 2048, 256), (128, 128, 128)] {
                if let Ok(kernel) = tessera_tests::kit::matmul("mm", dtype, [bm * 2, bk * 2, bn * 2], [bm, bk, bn], None) {
                    jobs.push(tessera_tests::vmem::Job { name: format!("matmul-{bm}x{bk}x{bn}-{dtype}@{}", target.name), target, kernel });
                }
            }
        }
    }
    // Library kernels at large blocks (what tests/tests/gmm.rs and attention.rs compile).
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        use tessera_kernels::{attention, gmm};
        for dtype in [DType::F32, DType::BF16] {
            let blocks = gmm::GmmBlocks { tm: 512, tk: 1024, tn: 1024 };
            let (lhs, rhs, gs) = (Type::vector(dtype, &[4096, 2048]), Type::vector(dtype, &[8, 2048, 2048]), Type::vector(DType::I32, &[8]));
            for t in [false, true] {
                if let Ok(kernel) = gmm::build_gmm(&lhs, &rhs, &gs, t, blocks, &target) {
                    jobs.push(tessera_tests::vmem::Job { name: format!("gmm-large-t{t}-{dtype}@{}", target.name), target, kernel });
                }
            }
            if let Ok(kernel) = gmm::build_tgmm(&lhs, &Type::vector(dtype, &[4096, 2048]), &gs, blocks, &target) {
                jobs.push(tessera_tests::vmem::Job { name: format!("tgmm-large-{dtype}@{}", target.name), target, kernel });
            }
            let q = Type::vector(dtype, &[1, 4, 2048, 128]);
            for (bq, bk) in [(512, 512), (1024, 512), (1024, 1024)] {
                let params = attention::AttentionParams::new(128, true);
                if let Ok(kernel) = attention::build_flash_attention(&q, &q, &q, false, &params, attention::AttentionBlocks { block_q: bq, block_kv: bk }, &target) {
                    jobs.push(tessera_tests::vmem::Job { name: format!("flash-fwd-{bq}x{bk}-{dtype}@{}", target.name), target, kernel });
                }
            }
        }
    }
    for p in tessera_tests::probes::all() {
        if ["vmem-copy", "vmem-matmul", "vmem-held"].contains(&p.family) && p.target.name != "v5p" {
            if let Ok(kernel) = p.kernel {
                jobs.push(tessera_tests::vmem::Job { name: p.name.clone(), target: p.target, kernel });
            }
        }
    }
    let measured = tessera_tests::vmem::measure(&jobs);
    for (j, m) in jobs.iter().zip(measured) {
        let e = tessera_dsl::verify::vmem_estimate(&j.kernel, &j.target);
        match m {
            Some(m) => println!("{:<60} buf {:>9} int {:>9} libtpu {:>9} resid {:>+9}", j.name, e.buffers, e.internal, m, m as i64 - (e.buffers + e.internal) as i64),
            None => println!("{:<60} buf {:>9} int {:>9} libtpu ?", j.name, e.buffers, e.internal),
        }
    }
}
