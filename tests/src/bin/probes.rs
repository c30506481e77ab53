//! The probe set and the evidence pairs through our verifier and libtpu.
//!
//! ```text
//! cargo run --release -p tessera-tests --bin probes                 # agreement report -> tests/verdicts/report.md
//! cargo run --release -p tessera-tests --bin probes -- bless        # also re-record tests/verdicts/libtpu.json
//! cargo run --release -p tessera-tests --bin probes -- vmem         # VMEM estimate vs libtpu's need -> tests/verdicts/vmem.md
//! cargo run --release -p tessera-tests --bin probes -- list FILTER  # one line per matching kernel, with both verdicts
//! cargo run --release -p tessera-tests --bin probes -- rules        # the rulebook table (for tests/src/rulebook/README.md)
//! ```
//!
//! Needs the venv (`TESSERA_PYTHON`, default `.venv/bin/python`). Verdicts are cached under
//! `target/tpu-verdicts/`, so a rerun compiles only what changed.

use std::collections::BTreeMap;

use tessera_dsl::{DType, Target, Type};
use tessera_tests::agreement::{self, Class, Item, Recorded, Row};
use tessera_tests::{oracle, probes, rulebook, vmem};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("rules") {
        print!("{}", agreement::rules_table());
        return;
    }
    if !oracle::available() {
        eprintln!("needs the venv with libtpu: {} not found (scripts/setup-venv.sh, or set TESSERA_PYTHON)", oracle::python().display());
        std::process::exit(2);
    }
    match args.first().map(String::as_str) {
        None | Some("report") => judge_all(false, None),
        Some("bless") => judge_all(true, None),
        Some("list") => judge_all(false, Some(args.get(1).cloned().unwrap_or_default())),
        Some("vmem") => vmem_table(),
        Some(other) => {
            eprintln!("unknown command `{other}`: report, bless, list FILTER, vmem, rules");
            std::process::exit(2);
        }
    }
}

/// Every probe and evidence half, judged by us and by libtpu.
fn judge_all(bless: bool, filter: Option<String>) {
    let started = std::time::Instant::now();
    let probes = probes::all();
    let halves = rulebook::halves();
    let mut items: Vec<(String, &str, Item)> = Vec::new();
    for p in &probes {
        items.push((p.name.clone(), p.family, Item { name: &p.name, target: p.target, kernel: &p.kernel }));
    }
    for h in &halves {
        items.push((h.name.clone(), "rulebook", Item { name: &h.name, target: h.target, kernel: &h.kernel }));
    }
    if let Some(f) = &filter {
        items.retain(|(name, _, _)| name.contains(f.as_str()));
    }
    let plain: Vec<Item> = items.iter().map(|(_, _, it)| Item { name: it.name, target: it.target, kernel: it.kernel }).collect();
    let libtpu = agreement::compile(&plain);
    let version = oracle::libtpu_version();
    let rows: Vec<Row> = items
        .iter()
        .zip(libtpu)
        .map(|((name, family, it), l)| {
            let ours = agreement::ours(it.kernel, &it.target);
            Row { name: name.clone(), family: family.to_string(), target: it.target.name, ours, class: agreement::classify(ours, l.as_ref(), &it.target), libtpu: l }
        })
        .collect();
    if filter.is_some() {
        for r in &rows {
            let ours = r.ours.map_or_else(|rule| format!("reject {rule}"), |_| "accept".into());
            let lib = r.libtpu.as_ref().map_or("none".to_string(), |l| if l.ok { "accept".into() } else { format!("reject: {}", l.error) });
            println!("{:<13} {:<56} ours {ours:<30} libtpu {lib}", format!("{:?}", r.class), r.name);
        }
        return;
    }
    let report = agreement::report(&rows, &version);
    print!("{report}");
    std::fs::create_dir_all(oracle::repo().join("tests/verdicts")).unwrap();
    std::fs::write(oracle::repo().join("tests/verdicts/report.md"), &report).unwrap();
    if bless {
        let recorded: BTreeMap<String, Recorded> = rows.iter().filter_map(|r| r.libtpu.clone().map(|l| (r.name.clone(), l))).collect();
        agreement::save(&version, &recorded);
        eprintln!("recorded {} verdicts in {}", recorded.len(), agreement::verdicts_path().display());
    }
    let fa = rows.iter().filter(|r| r.class == Class::FalseAccept).count();
    eprintln!("{} kernels in {:.0} s; report in tests/verdicts/report.md", rows.len(), started.elapsed().as_secs_f64());
    if fa > 0 {
        std::process::exit(1);
    }
}

/// The calibration set of the VMEM model: every library kernel at default shapes, the
/// library's large-block configurations, matmuls, and the near-limit probes.
fn vmem_jobs() -> Vec<vmem::Job> {
    use tessera_kernels::{attention, gmm};
    let mut jobs = Vec::new();
    let targets = [Target::V5E, Target::V6E, Target::TPU7X];
    for target in targets {
        // Every op's default case (its first), each distinct kernel once.
        let mut seen = std::collections::HashSet::new();
        for op in tessera_kernels::library().filter(|op| op.alias_of.is_none()) {
            let Some(case) = op.cases.first() else { continue };
            let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
            let Ok(statics) = op.case_statics(case) else { continue };
            for dtype in [DType::F32, DType::BF16] {
                let Ok(plan) = op.plan_for(&op.types(&shapes, dtype), &statics, &target) else { continue };
                for launch in plan.launches {
                    if seen.insert(format!("{}", launch.kernel)) {
                        jobs.push(vmem::Job { name: format!("{}/{}/{dtype}@{}", op.name, launch.kernel.name, target.name), target, kernel: launch.kernel });
                    }
                }
            }
        }
        for dtype in [DType::F32, DType::BF16] {
            for (bm, bk, bn) in [(512, 512, 512), (1024, 512, 512), (512, 1024, 1024), (256, 2048, 256), (128, 128, 128), (1024, 1024, 1024), (2048, 512, 256), (256, 512, 2048), (512, 256, 1024), (1024, 2048, 512)] {
                if let Ok(kernel) = tessera_tests::kit::matmul("mm", dtype, [bm * 2, bk * 2, bn * 2], [bm, bk, bn], None) {
                    jobs.push(vmem::Job { name: format!("matmul/{bm}x{bk}x{bn}/{dtype}@{}", target.name), target, kernel });
                }
            }
            // q @ k.T (a transposed rhs) straight into a bf16/f32 output, no accumulator.
            for (m, k, n) in [(512, 128, 512), (1024, 256, 1024), (2048, 128, 1024)] {
                let z = vec![tessera_dsl::IndexExpr::Const(0), tessera_dsl::IndexExpr::Const(0)];
                let mut b = tessera_dsl::KernelBuilder::new("qk");
                b.grid(&[(1, tessera_dsl::Semantics::Parallel)]);
                let x = b.input("q", dtype, &[m, k], tessera_tests::kit::spec(&[m, k], z.clone()));
                let y = b.input("k", dtype, &[n, k], tessera_tests::kit::spec(&[n, k], z.clone()));
                let o = b.output("s", dtype, &[m, n], tessera_tests::kit::spec(&[m, n], z));
                let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
                let p = b.dot(xv, yv, false, true);
                let p = b.cast(p, dtype);
                b.store(o, &[], p);
                if let Ok(kernel) = b.finish() {
                    jobs.push(vmem::Job { name: format!("qk-t/{m}x{k}x{n}/{dtype}@{}", target.name), target, kernel });
                }
            }
            let blocks = gmm::GmmBlocks { tm: 512, tk: 1024, tn: 1024 };
            let (lhs, rhs, gs) = (Type::vector(dtype, &[4096, 2048]), Type::vector(dtype, &[8, 2048, 2048]), Type::vector(DType::I32, &[8]));
            for t in [false, true] {
                if let Ok(kernel) = gmm::build_gmm(&lhs, &rhs, &gs, t, blocks, &target) {
                    jobs.push(vmem::Job { name: format!("gmm-large/t{t}/{dtype}@{}", target.name), target, kernel });
                }
            }
            if let Ok(kernel) = gmm::build_tgmm(&lhs, &Type::vector(dtype, &[4096, 2048]), &gs, blocks, &target) {
                jobs.push(vmem::Job { name: format!("tgmm-large/{dtype}@{}", target.name), target, kernel });
            }
            let q = Type::vector(dtype, &[1, 4, 2048, 128]);
            for (bq, bk) in [(512, 512), (1024, 512), (1024, 1024)] {
                let params = attention::AttentionParams::new(128, true);
                if let Ok(kernel) = attention::build_flash_attention(&q, &q, &q, false, &params, attention::AttentionBlocks { block_q: bq, block_kv: bk }, true, &target) {
                    jobs.push(vmem::Job { name: format!("flash-fwd/{bq}x{bk}/{dtype}@{}", target.name), target, kernel });
                }
            }
        }
    }
    for p in probes::all() {
        if ["vmem-copy", "vmem-matmul", "vmem-held"].contains(&p.family) && targets.contains(&p.target) {
            if let Ok(kernel) = p.kernel {
                jobs.push(vmem::Job { name: p.name.clone(), target: p.target, kernel });
            }
        }
    }
    jobs
}

fn vmem_table() {
    let jobs = vmem_jobs();
    let measured = vmem::measure(&jobs);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut rows = Vec::new();
    let mut worst: Option<(i64, String)> = None;
    let mut near = 0;
    for (j, m) in jobs.iter().zip(&measured) {
        let e = tessera_dsl::verify::vmem_estimate(&j.kernel, &j.target);
        let limit = tessera_dsl::verify::vmem_limit(&j.kernel, &j.target);
        let Some(m) = *m else {
            rows.push(format!("| `{}` | {:.3} | {:.3} | {:.3} | {:.3} | ? | |", j.name, mib(e.buffers), mib(e.internal), mib(e.margin), mib(e.total())));
            continue;
        };
        // The margin is for what the model misses: what libtpu needs beyond the modelled parts.
        let under = m as i64 - (e.buffers + e.internal) as i64;
        if worst.as_ref().is_none_or(|(w, _)| under > *w) {
            worst = Some((under, j.name.clone()));
        }
        near += usize::from(m * 10 >= limit * 8);
        rows.push(format!("| `{}` | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:+.1} |", j.name, mib(e.buffers), mib(e.internal), mib(e.margin), mib(e.total()), mib(m), under as f64 / 1024.0));
    }
    let (w, wname) = worst.unwrap_or_default();
    let mut s = String::new();
    s.push_str(&format!("# VMEM: the verifier's estimate vs libtpu {}'s need\n\n", oracle::libtpu_version()));
    s.push_str("Written by `cargo run --release -p tessera-tests --bin probes -- vmem`. libtpu's need is the smallest scoped VMEM limit under which it compiles the kernel, found by compiling under limits it cannot meet and stepping up by the excess its E1001 message reports (`tests/src/vmem.rs`), to about 256 bytes. *Under* is libtpu's need minus our modelled buffers and internal scratch (positive: the model alone would under-estimate); the margin must cover the largest under.\n\n");
    s.push_str(&format!(
        "**{} kernels measured ({} of them at >= 80% of their scoped limit); largest under-estimate {:.1} KiB (`{wname}`), margin {} KiB: {}.**\n\n",
        jobs.len(),
        near,
        w as f64 / 1024.0,
        tessera_dsl::verify::VMEM_MARGIN >> 10,
        if w <= tessera_dsl::verify::VMEM_MARGIN as i64 { "none above the margin" } else { "ABOVE THE MARGIN" }
    ));
    s.push_str("| kernel | buffers MiB | internal MiB | margin MiB | estimate MiB | libtpu MiB | under KiB |\n|---|---|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&r);
        s.push('\n');
    }
    print!("{s}");
    std::fs::create_dir_all(oracle::repo().join("tests/verdicts")).unwrap();
    std::fs::write(oracle::repo().join("tests/verdicts/vmem.md"), s).unwrap();
}
