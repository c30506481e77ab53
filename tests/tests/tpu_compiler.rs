//! The real TPU compiler tier (enabled by `TESSERA_TPU_ORACLE=1`, which `scripts/test.sh`
//! sets): every library op's kernels at the shapes of each of its cases compile with libtpu
//! for v5e, v6e and tpu7x, in bf16 (every kernel on v5e, a stable sixth on v6e and on tpu7x)
//! and f32 (a stable twelfth on each target, chosen by name: `oracle::sampled`;
//! `TESSERA_LIBTPU_SAMPLE=1` compiles all); and the broken kernels
//! that libtpu can judge are rejected by it too when forced past our verifier.

use tessera_dsl::{DType, Target};
use tessera_kernels::library;
use tessera_tests::{broken, oracle};

const TARGETS: [Target; 3] = [Target::V5E, Target::V6E, Target::TPU7X];

fn skip() -> bool {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return true;
    }
    false
}

#[test]
fn every_library_kernel_compiles_for_v5e_v6e_tpu7x() {
    if skip() {
        return;
    }
    // Every target's modules in one batch: the oracle compiles the targets in parallel.
    let mut jobs: Vec<(String, String, String)> = Vec::new();
    for target in TARGETS {
        let mut seen = std::collections::HashSet::new();
        // An alias with a plan of its own (flash_attention's o-only kernel) runs its op's cases.
        for op in library().filter(|op| op.alias_of.is_none() || op.alias_plan.is_some()) {
            let source = op.alias_of.and_then(|(of, _)| tessera_kernels::find(of)).unwrap_or(op);
            for case in source.cases {
                let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
                let statics = source.case_statics(case).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    // bf16 is the harder half (packed sublanes, bf16 VPU rules on v5e): all of
                    // it on v5e, a stable sixth on v6e and on tpu7x; f32 a stable twelfth on
                    // each (the test command's budget: about 250 modules, 0.6 s each). The
                    // sample is drawn per target and dtype, so the targets' shares differ.
                    let every = match dtype {
                        DType::F32 => 12,
                        _ if target == Target::V5E => 1,
                        _ => 6,
                    };
                    // An alias's own plan (the forward without lse) is its op's kernel less a
                    // store: a third of its cases.
                    let every = if op.alias_of.is_some() { every * 3 } else { every };
                    if every > 1 && !oracle::sampled(&format!("{}-{}-{}-{dtype}", op.name, case.name, target.name), every) {
                        continue;
                    }
                    let plan = op.plan_for(&op.types(&shapes, dtype), &statics, &target).unwrap_or_else(|e| panic!("{} {}: {e}", op.name, case.name));
                    for launch in plan.launches {
                        let lowered = tessera_codegen::lower(&launch.kernel, &target).unwrap_or_else(|e| panic!("{}: {e}", op.name));
                        // Cases share kernels (a backward op reuses its forward's): compile each module once.
                        if seen.insert(lowered.stablehlo.clone()) {
                            jobs.push((format!("{}-{}-{}-{dtype}", op.name, case.name, launch.kernel.name), target.name.to_string(), lowered.stablehlo));
                        }
                    }
                }
            }
        }
    }
    oracle::assert_all_accepted(&jobs);
}

#[test]
fn libtpu_rejects_the_broken_kernels_it_can_judge() {
    if skip() {
        return;
    }
    let judged: Vec<broken::Broken> = broken::all().into_iter().filter(|b| b.libtpu_rejects.is_some()).collect();
    assert!(judged.len() >= 4);
    // Forced through: emitted without our verifier; all in one batch.
    let jobs: Vec<(String, String, String)> = judged
        .iter()
        .map(|b| {
            let kernel = b.kernel.as_ref().expect("libtpu-judged cases pass the builder");
            let text = tessera_codegen::stablehlo::emit(kernel, &b.target).unwrap_or_else(|e| panic!("{}: {e}", b.name));
            (b.name.to_string(), b.target.name.to_string(), text)
        })
        .collect();
    for (b, v) in judged.iter().zip(&oracle::compile_cached(&jobs)) {
        eprintln!("{:<24} ours: {:<20} libtpu: {}", b.name, b.rule, if v.ok { "accepts".to_string() } else { format!("rejects: {}", v.error.lines().next().unwrap_or("")) });
        assert_eq!(!v.ok, b.libtpu_rejects.unwrap(), "{}: libtpu verdict differs from the expectation", b.name);
    }
}

/// Large matmuls on v6e take the HBM-bound rule's tall tile with bk 1024 (2048 x 1024 x 1024
/// in bf16: 34 MiB with Mosaic's scratch, past the 32 MiB default scoped VMEM), so their
/// kernels raise their VMEM limit; libtpu compiles them, forward and backward, in both
/// dtypes. (The library's cases are too small to reach the rule; the static estimate at
/// 8192^3 bf16, 92% of MXU peak, is `tessera cost matmul --target v6e --dtype bf16 --shape
/// x=8192x8192 --shape y=8192x8192`, minutes of profiling, so not here.)
#[test]
fn large_matmuls_raise_their_vmem_limit_and_compile_for_v6e() {
    if skip() {
        return;
    }
    let target = Target::V6E;
    let mut jobs: Vec<(String, String, String)> = Vec::new();
    for (name, m) in [("matmul", 8192), ("matmul", 4096), ("matmul_bwd", 4096)] {
        for dtype in [DType::BF16, DType::F32] {
            let op = library().find(|op| op.name == name).unwrap();
            let mut shapes = vec![vec![m, m], vec![m, m]];
            if name == "matmul_bwd" {
                shapes.push(vec![m, m]);
            }
            let plan = op.plan_for(&op.types(&shapes, dtype), &op.case_statics(&op.cases[0]).unwrap(), &target).unwrap();
            for launch in plan.launches {
                let k = &launch.kernel;
                if name == "matmul" && m == 8192 && dtype == DType::BF16 {
                    let limit = k.vmem_limit_bytes.expect("the tall tile raises its VMEM limit");
                    assert!(limit > target.default_scoped_vmem_bytes && limit <= target.vmem_bytes, "{limit}");
                }
                let lowered = tessera_codegen::lower(k, &target).unwrap_or_else(|e| panic!("{name} {m} {dtype}: {e}"));
                jobs.push((format!("{name}-{m}-{}-{dtype}", k.name), target.name.to_string(), lowered.stablehlo));
            }
        }
    }
    oracle::assert_all_accepted(&jobs);
}
