//! Tessera's kernels beside the Pallas kernels shipped in JAX, judged by libtpu's static
//! estimate at the same shapes and blocks (issue 14):
//! `TESSERA_PYTHON=.venv/bin/python cargo run --release -p tessera-tests --example tpu_vs_pallas [-- v5e v6e] [--only TEXT]`
//! (`--only` keeps the pairs whose name contains TEXT, e.g. `--only "fwd causal"`).
//! Tessera's side through `tpu_compile.py --profile` (tests/src/oracle.rs), Pallas's through
//! `scripts/pallas_cost.py`; both read with the same parser. Prints cycles (the custom call,
//! plus what XLA adds around it) and the ratio Tessera / Pallas, with the geometric mean.
use std::process::Command;

use tessera_codegen::StaticProfile;
use tessera_dsl::{DType, Kernel, Target, Type};
use tessera_kernels::{library, Statics};
use tessera_tests::oracle;

struct Pair {
    name: String,
    kernels: Vec<Kernel>,
    pallas: String,
}

fn op_kernels(op_name: &str, shapes: &[&[usize]], statics: &str, target: &Target) -> Vec<Kernel> {
    let op = library().find(|op| op.name == op_name).unwrap();
    let shapes: Vec<Vec<usize>> = shapes.iter().map(|s| s.to_vec()).collect();
    let statics = Statics::parse(&op.parsed().unwrap(), statics).unwrap();
    op.plan_for(&op.types(&shapes, DType::BF16), &statics, target).unwrap_or_else(|e| panic!("{op_name}: {e}")).launches.into_iter().map(|l| l.kernel).collect()
}

fn pairs(target: &Target) -> Vec<Pair> {
    let mut out = Vec::new();
    for (m, bm, bk, bn) in [(4096, 512, 1024, 1024), (2048, 256, 512, 256)] {
        let t = Type::vector(DType::BF16, &[m, m]);
        let k = tessera_kernels::matmul::matmul_kernel(t.clone(), t.clone(), t, bm, bn, bk, m, false, false).unwrap();
        out.push(Pair { name: format!("matmul {m}^3 @ {bm}x{bk}x{bn}"), kernels: vec![k], pallas: format!("matmul:m={m},k={m},n={m},bm={bm},bk={bk},bn={bn},dtype=bf16") });
    }
    let qkv: &[&[usize]] = &[&[1, 8, 2048, 128], &[1, 8, 2048, 128], &[1, 8, 2048, 128]];
    for causal in [true, false] {
        for b in [128, 256, 512] {
            let statics = format!("causal={}, block_q={b}, block_kv={b}", if causal { "True" } else { "False" });
            let mask = if causal { "causal" } else { "non-causal" };
            // `flash_attention` (o alone: the kernel without lse) beside Pallas' inference
            // forward (o only); `flash_attention_fwd` (o and lse) beside its training forward
            // (o and the residuals l, m its backward reads).
            let case = format!("b=1,h=8,s=2048,d=128,causal={},bq={b},bk={b},dtype=bf16", u8::from(causal));
            out.push(Pair { name: format!("flash fwd {mask} B1 H8 S2048 D128 @ {b}^2 vs inference (o)"), kernels: op_kernels("flash_attention", qkv, &statics, target), pallas: format!("flash:{case}") });
            out.push(Pair { name: format!("flash fwd {mask} B1 H8 S2048 D128 @ {b}^2 vs training (o, l, m)"), kernels: op_kernels("flash_attention_fwd", qkv, &statics, target), pallas: format!("flash_res:{case}") });
        }
    }
    // A training step's attention: the forward (with lse) and the backward (di, dkv, dq)
    // beside Pallas' jax.grad of its kernel (forward with residuals, dkv, dq, and what XLA
    // adds around them), every block the same.
    let train: &[&[usize]] = &[&[1, 8, 2048, 128], &[1, 8, 2048, 128], &[1, 8, 2048, 128], &[1, 8, 2048, 128], &[1, 8, 2048], &[1, 8, 2048, 128]];
    for causal in [true, false] {
        for b in [128, 256, 512] {
            let statics = format!("causal={}, block_q={b}, block_kv={b}", if causal { "True" } else { "False" });
            let mut kernels = op_kernels("flash_attention_fwd", qkv, &statics, target);
            kernels.extend(op_kernels("flash_attention_bwd", train, &statics, target));
            out.push(Pair {
                name: format!("flash fwd+bwd {} B1 H8 S2048 D128 @ {b}^2", if causal { "causal" } else { "non-causal" }),
                kernels,
                pallas: format!("flash_train:b=1,h=8,s=2048,d=128,causal={},bq={b},dtype=bf16", u8::from(causal)),
            });
        }
    }
    out
}

fn total(p: &StaticProfile) -> u64 {
    p.cycles + p.outside_cycles
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let only = args.iter().position(|a| a == "--only").map(|at| {
        let text = args.get(at + 1).cloned().unwrap_or_else(|| panic!("--only needs the text a pair's name must contain"));
        args.drain(at..at + 2);
        text
    });
    let targets: Vec<Target> = if args.is_empty() { vec![Target::V5E, Target::V6E] } else { args.iter().map(|a| Target::by_name(a).unwrap_or_else(|| panic!("unknown target {a}"))).collect() };
    println!("| target | kernel | Tessera cycles (+outside) | Pallas cycles (+outside) | Tessera / Pallas |");
    println!("|---|---|---|---|---|");
    for target in targets {
        let pairs: Vec<Pair> = pairs(&target).into_iter().filter(|p| only.as_ref().is_none_or(|t| p.name.contains(t.as_str()))).collect();
        let modules: Vec<(String, String)> = pairs.iter().flat_map(|p| p.kernels.iter().enumerate().map(move |(i, k)| (format!("{}#{i}", p.name), tessera_codegen::lower(k, &target).unwrap().stablehlo))).collect();
        let ours = oracle::profile(&modules, target.name);
        let out = Command::new(oracle::python()).arg(oracle::repo().join("scripts/pallas_cost.py")).arg("--target").arg(target.name).args(pairs.iter().map(|p| &p.pallas)).output().expect("run scripts/pallas_cost.py");
        let theirs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let mut logs = Vec::new();
        for (p, pallas) in pairs.iter().zip(&theirs) {
            let mine: Vec<Option<StaticProfile>> = ours.iter().filter(|v| v.name.starts_with(&format!("{}#", p.name))).map(|v| v.profile.filter(|p| p.estimated)).collect();
            let mine = mine.iter().try_fold(StaticProfile::default(), |acc, p| p.map(|p| StaticProfile { cycles: acc.cycles + p.cycles, outside_cycles: acc.outside_cycles + p.outside_cycles, ..acc }));
            let pallas_profile = StaticProfile::from_report(pallas).filter(|p| p.estimated);
            let cell = |p: Option<StaticProfile>| p.map(|p| format!("{} (+{})", p.cycles, p.outside_cycles)).unwrap_or_else(|| "no estimate (profiler aborted)".into());
            let ratio = match (mine, pallas_profile) {
                (Some(a), Some(b)) if total(&b) > 0 => {
                    let r = total(&a) as f64 / total(&b) as f64;
                    logs.push(r.ln());
                    format!("{r:.2}")
                }
                _ => "-".into(),
            };
            println!("| {} | {} | {} | {} | {ratio} |", target.name, p.name, cell(mine), cell(pallas_profile));
        }
        if !logs.is_empty() {
            println!("| {} | geometric mean over {} pairs | | | {:.2} |", target.name, logs.len(), (logs.iter().sum::<f64>() / logs.len() as f64).exp());
        }
    }
}
