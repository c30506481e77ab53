//! The static cost tier (enabled by `TESSERA_TPU_ORACLE=1`): libtpu's static LLO profile of
//! a sample of library kernels, pinned in `tests/verdicts/cost.json` within a band, so a
//! code-generation change that costs cycles, bundles, spills or VMEM fails here with the
//! delta. The sample (bf16, five ops' chosen cases, v5e and v6e) is ~25 s of profiling with
//! the two targets' workers side by side; `tessera cost --all` gives the whole table.
//!
//! A kernel libtpu accepts but its static profiler aborts on (the DMA gathers, libtpu
//! 0.0.52) would be pinned with zero cycles and the bundles, spills and VMEM of its LLO.
//!
//! After an intended change: `TESSERA_TPU_ORACLE=1 TESSERA_COST_BLESS=1 cargo test --release
//! -p tessera-tests --test tpu_cost` rewrites the file (review its diff like a snapshot's).

use std::collections::BTreeMap;

use tessera_codegen::StaticProfile;
use tessera_dsl::{DType, Target};
use tessera_kernels::library;
use tessera_tests::oracle;

/// (op, case) pairs: a matmul (MXU-bound), a row norm (HBM-bound), flash and splash
/// attention (VPU and spill-heavy: where issue 14's work lands), cross-entropy (a row
/// reduction over a wide vocabulary). Not gmm: its estimate is blind to the prefetch-driven
/// visit count, and libtpu's profiler spends ~65 s per target on its dynamic grid (its
/// compile alone is 0.3 s, and `tpu_compiler.rs` does that).
const SAMPLE: [(&str, &str); 5] = [("matmul", "default"), ("rmsnorm", "default"), ("flash_attention_fwd", "causal"), ("splash_attention_fwd", "default"), ("cross_entropy", "default")];
const TARGETS: [Target; 2] = [Target::V5E, Target::V6E];

/// Relative band on cycles and bundles; spills get an absolute slack too (a few
/// spill slots move with any scheduling change).
const BAND: f64 = 0.02;
const SPILL_SLACK: u64 = 16;

fn pins_path() -> std::path::PathBuf {
    oracle::repo().join("tests/verdicts/cost.json")
}

#[test]
fn library_kernels_cost_what_is_pinned() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let modules_for = |target: &Target| {
        let mut modules = Vec::new();
        for (name, case_name) in SAMPLE {
            let op = library().find(|op| op.name == name).unwrap_or_else(|| panic!("no op {name}"));
            let case = op.cases.iter().find(|c| c.name == case_name).unwrap_or_else(|| panic!("{name} has no case {case_name}"));
            let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
            let plan = op.plan_for(&op.types(&shapes, DType::BF16), &op.case_statics(case).unwrap(), target).unwrap();
            for launch in plan.launches {
                let lowered = tessera_codegen::lower(&launch.kernel, target).unwrap();
                modules.push((format!("{}/{name}-{case_name}-{}-bf16", target.name, launch.kernel.name), lowered.stablehlo));
            }
        }
        modules
    };
    // One profiling worker per target, side by side.
    let verdicts: Vec<oracle::Verdict> = std::thread::scope(|s| {
        let handles: Vec<_> = TARGETS.iter().map(|target| s.spawn(move || oracle::profile(&modules_for(target), target.name))).collect();
        handles.into_iter().flat_map(|h| h.join().expect("profiling thread")).collect()
    });
    let mut measured: BTreeMap<String, StaticProfile> = BTreeMap::new();
    for v in verdicts {
        assert!(v.ok, "{}: libtpu rejects it: {}", v.name, v.error);
        // Accepted, but libtpu's profiler aborts on it (it does on some kernels): pinned
        // with zero cycles, so a kernel it starts to profile shows up here too.
        let p = v.profile.unwrap_or_default();
        eprintln!("{:<56} cycles {:>9} (+{} outside)  bundles {:>6}  spills {}v/{}s  VMEM {:.2} MiB", v.name, p.cycles, p.outside_cycles, p.bundles, p.vector_spills, p.scalar_spills, p.vmem_bytes as f64 / (1 << 20) as f64);
        measured.insert(v.name, p);
    }
    let version = oracle::libtpu_version();
    let to_json = |p: &StaticProfile| serde_json::json!({"cycles": p.cycles, "outside_cycles": p.outside_cycles, "bundles": p.bundles, "vector_spills": p.vector_spills, "scalar_spills": p.scalar_spills, "vmem_bytes": p.vmem_bytes});
    if std::env::var_os("TESSERA_COST_BLESS").is_some() {
        let kernels: serde_json::Map<String, serde_json::Value> = measured.iter().map(|(k, p)| (k.clone(), to_json(p))).collect();
        let doc = serde_json::json!({"libtpu": version, "kernels": kernels});
        std::fs::write(pins_path(), serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
        eprintln!("wrote {}", pins_path().display());
        return;
    }
    let pins: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(pins_path()).expect("tests/verdicts/cost.json")).expect("cost.json is JSON");
    if pins["libtpu"].as_str() != Some(version.as_str()) {
        eprintln!("skipped: the pins are for libtpu {} and this is {version}; bless them (see the file's docs)", pins["libtpu"]);
        return;
    }
    let mut failures = Vec::new();
    for (name, p) in &measured {
        let Some(pin) = pins["kernels"].get(name) else {
            failures.push(format!("{name}: not pinned (bless to add it)"));
            continue;
        };
        let pinned = |key: &str| pin[key].as_u64().unwrap_or(0);
        let mut check = |key: &str, got: u64, slack: u64| {
            let want = pinned(key);
            let allowed = (want as f64 * BAND).ceil() as u64 + slack;
            if got.abs_diff(want) > allowed {
                failures.push(format!("{name}: {key} {got}, pinned {want} ({:+} = {:+.1}%; band ±{allowed})", got as i64 - want as i64, (got as f64 / want.max(1) as f64 - 1.0) * 100.0));
            }
        };
        check("cycles", p.cycles, 0);
        check("outside_cycles", p.outside_cycles, 0);
        check("bundles", p.bundles, 0);
        check("vector_spills", p.vector_spills, SPILL_SLACK);
        check("scalar_spills", p.scalar_spills, SPILL_SLACK);
        check("vmem_bytes", p.vmem_bytes, 0);
    }
    assert!(failures.is_empty(), "static cost moved outside its band (if intended, bless: see this file's docs):\n{}", failures.join("\n"));
}

/// The roofline's MXU floor is one device's: on v5p (megacore) a kernel with a `parallel`
/// axis splits across the chip's two TensorCores, and libtpu's estimate counts both (its
/// 4096^3 bf16 matmul estimate, 322 us, was below a one-core floor of 599 us: a time under
/// its own floor); elsewhere, and for a kernel with nothing to split, one core's.
#[test]
fn the_mxu_floor_is_one_devices() {
    let t = tessera_dsl::Type::vector(DType::BF16, &[4096, 4096]);
    let mm = tessera_kernels::matmul::matmul_kernel(t.clone(), t.clone(), t, 512, 1024, 1024, 4096, false, false).unwrap();
    let flops = 2.0 * 4096f64.powi(3);
    let floor = |k: &tessera_dsl::Kernel, target: &Target| tessera_codegen::roofline(k, &StaticProfile::default(), target).mxu_us;
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-3;
    assert!(close(floor(&mm, &Target::V5P), flops / 459e6), "{}", floor(&mm, &Target::V5P));
    assert!(close(floor(&mm, &Target::TPU7X), flops / (2310e6 / 2.0)), "{}", floor(&mm, &Target::TPU7X));
    assert!(close(floor(&mm, &Target::V6E), flops / 920e6));
    let mut serial = mm.clone();
    serial.grid.iter_mut().for_each(|g| g.semantics = tessera_dsl::Semantics::Arbitrary);
    assert!(close(floor(&serial, &Target::V5P), flops / (459e6 / 2.0)));
}
