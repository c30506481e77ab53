//! The CPU backends side by side with JAX, in one run:
//! `cargo bench -p tessera-tests --features bench --bench cpu_backends` (add `--features llvm` for the LLVM
//! column; `TESSERA_PYTHON` names the venv's Python for the JAX columns).
//!
//! Cases, each at the same blocks on every side (Tessera's v5e defaults):
//! matmul 1024^3 f32; flash attention forward B1 H8 S1024 D128 f32, non-causal and causal;
//! gmm M4096 K=N=1024 G8 bf16 (random group sizes, shared with the JAX side); RMSNorm
//! 4096x4096 f32; an 8-op elementwise kernel on 4096x4096 f32. Tessera's interpreter, JIT
//! (Cranelift) and LLVM are measured by criterion (medians of >= 10 samples); Pallas
//! `interpret=True` and XLA-CPU by `scripts/bench_{jax,attention,gmm,cpu}.py` (medians of
//! >= 3 / 5). The table and ratios are printed and written to `target/bench_cpu_backends.json`.

use criterion::{black_box, Criterion};
use rand::{rngs::StdRng, SeedableRng};
use tessera_codegen::cpu::Backend;
use tessera_dsl::interp::Array;
use tessera_dsl::{BlockSpec, DType, IndexExpr, Kernel, KernelBuilder, Semantics, Target, Type};
use tessera_kernels::attention::{self, AttentionParams};
use tessera_kernels::gmm;
use tessera_kernels::harness::random_array;
use tessera_kernels::matmul::{matmul_blocks, matmul_kernel};
use tessera_tests::bench::{criterion_median, run_jax_script, summary_path};

/// `max(x * 1.5 + 0.5, 0) * x - x / (1 + |x|)`: mul, add, max, mul, abs, add, div, sub.
fn elementwise_kernel(m: usize, n: usize, bm: usize, bn: usize) -> Kernel {
    let mut b = KernelBuilder::new("elementwise8");
    b.grid(&[(m / bm, Semantics::Parallel), (n / bn, Semantics::Parallel)]);
    let spec = BlockSpec { block_shape: vec![Some(bm), Some(bn)], index_map: vec![IndexExpr::grid(0), IndexExpr::grid(1)] };
    let x = b.input("x", DType::F32, &[m, n], spec.clone());
    let o = b.output("o", DType::F32, &[m, n], spec);
    let v = b.load(x, &[]);
    let t = b.mul(v, 1.5);
    let t = b.add(t, 0.5);
    let t = b.max(t, 0.0);
    let t = b.mul(t, v);
    let a = b.unary(tessera_dsl::UnaryOp::Abs, v);
    let d = b.add(a, 1.0);
    let q = b.div(v, d);
    let r = b.sub(t, q);
    b.store(o, &[], r);
    b.finish().unwrap()
}

fn backends() -> Vec<Backend> {
    Backend::ALL.into_iter().filter(|b| b.available()).collect()
}

fn main() {
    let mut c = Criterion::default().configure_from_args().sample_size(10).measurement_time(std::time::Duration::from_secs(4)).warm_up_time(std::time::Duration::from_secs(1));
    let target = Target::V5E;
    let mut rng = StdRng::seed_from_u64(0);

    // matmul
    let t = Type::vector(DType::F32, &[1024, 1024]);
    let (bm, bk, bn) = matmul_blocks(1024, 1024, 1024, DType::F32, DType::F32, &target);
    let mm = matmul_kernel(t.clone(), t.clone(), t, bm, bn, bk, 1024, false, false).unwrap();
    let (x, y) = (random_array(DType::F32, &[1024, 1024], &mut rng), random_array(DType::F32, &[1024, 1024], &mut rng));
    // attention
    let [q, k, v] = [0; 3].map(|_| random_array(DType::F32, &[1, 8, 1024, 128], &mut rng));
    let ablocks = attention::default_forward_blocks(&Type::vector(DType::F32, &q.shape), &Type::vector(DType::F32, &k.shape), false, &target);
    // gmm
    let sizes = gmm::random_group_sizes(4096, 8, &mut rng);
    let (lhs, rhs) = (random_array(DType::BF16, &[4096, 1024], &mut rng), random_array(DType::BF16, &[8, 1024, 1024], &mut rng));
    let gs = Array::from_i32(&[8], sizes.clone());
    let gblocks = gmm::gmm_blocks(4096, 1024, 1024, DType::BF16, &target);
    // rmsnorm
    let (rx, rw) = (random_array(DType::F32, &[4096, 4096], &mut rng), random_array(DType::F32, &[1, 4096], &mut rng));
    let rms = tessera_kernels::rmsnorm(&Type::vector(DType::F32, &[4096, 4096]), &Type::vector(DType::F32, &[1, 4096]), tessera_kernels::RMSNORM_EPS, &target).unwrap();
    let rms_rows = rms.refs[0].block.as_ref().unwrap().block_shape[0].unwrap();
    // elementwise
    let (ebm, ebn) = (256, 4096);
    let ew = elementwise_kernel(4096, 4096, ebm, ebn);

    let mut g = c.benchmark_group("cpu");
    for be in backends() {
        let e = be.executor();
        let n = be.name();
        // Outputs preallocated once (as the torch path passes its output tensors, and as
        // XLA reuses its pooled buffers): the run, not the page faults of a fresh 64 MiB.
        let run_into = |k: &Kernel, args: &[&Array], out: &mut Array| {
            let ins: Vec<_> = args.iter().map(|a| a.as_host()).collect();
            e.run_into(k, &ins, &mut [out.as_host_mut()]).unwrap();
        };
        let mut out = Array::zeros(DType::F32, &[1024, 1024]);
        g.bench_function(format!("matmul_{n}"), |b| b.iter(|| run_into(&mm, &[&x, &y], black_box(&mut out))));
        for causal in [false, true] {
            let params = AttentionParams::new(128, causal);
            let tag = if causal { "causal" } else { "noncausal" };
            g.bench_function(format!("attention_{tag}_{n}"), |b| b.iter(|| black_box(attention::flash_attention_with_blocks(e, &q, &k, &v, None, &params, ablocks, &target).unwrap())));
        }
        g.bench_function(format!("gmm_{n}"), |b| b.iter(|| black_box(gmm::gmm_with_blocks(e, &lhs, &rhs, &gs, false, gblocks, &target).unwrap())));
        let mut big = Array::zeros(DType::F32, &[4096, 4096]);
        g.bench_function(format!("rmsnorm_{n}"), |b| b.iter(|| run_into(&rms, &[&rx, &rw], black_box(&mut big))));
        g.bench_function(format!("elementwise_{n}"), |b| b.iter(|| run_into(&ew, &[&rx], black_box(&mut big))));
    }
    g.finish();
    c.final_summary();

    let ours = |id: &str| criterion_median(&format!("cpu/{id}")).unwrap_or(f64::NAN);
    let list = |v: Vec<String>| v.join(",");
    let cpu = run_jax_script("bench_cpu.py", &["--mm-blocks".into(), format!("{bm},{bn},{bk}"), "--rms-rows".into(), rms_rows.to_string(), "--ew-block".into(), format!("{ebm},{ebn}")]);
    let att = run_jax_script("bench_attention.py", &["--block".into(), ablocks.block_q.to_string()]);
    let gargs = ["--group-sizes".to_string(), list(sizes.iter().map(i32::to_string).collect()), "--tiling".to_string(), list([gblocks.tm, gblocks.tk, gblocks.tn].map(|b| b.to_string()).to_vec())];
    let gj = run_jax_script("bench_gmm.py", &gargs);
    let f = |j: &Option<serde_json::Value>, path: &[&str]| -> f64 {
        let mut v = match j {
            Some(v) => v,
            None => return f64::NAN,
        };
        for p in path {
            v = &v[*p];
        }
        v.as_f64().unwrap_or(f64::NAN)
    };
    let rows: Vec<(&str, String, f64, f64)> = vec![
        ("matmul 1024^3 f32", format!("blocks {bm}x{bk}x{bn}"), f(&cpu, &["matmul_interpret"]), f(&cpu, &["matmul_xla"])),
        ("attention B1 H8 S1024 D128 non-causal", format!("blocks {}x{}", ablocks.block_q, ablocks.block_kv), f(&att, &["noncausal", "pallas_interpret_blocks"]), f(&att, &["noncausal", "xla_reference"])),
        ("attention B1 H8 S1024 D128 causal", format!("blocks {}x{}", ablocks.block_q, ablocks.block_kv), f(&att, &["causal", "pallas_interpret_blocks"]), f(&att, &["causal", "xla_reference"])),
        ("gmm M4096 K=N=1024 G8 bf16", format!("tiling {}x{}x{}", gblocks.tm, gblocks.tk, gblocks.tn), f(&gj, &["interpret_gmm_blocks"]), f(&gj, &["xla_per_group"])),
        ("RMSNorm 4096x4096 f32", format!("{rms_rows} rows"), f(&cpu, &["rmsnorm_interpret"]), f(&cpu, &["rmsnorm_xla"])),
        ("8-op elementwise 4096x4096 f32", format!("blocks {ebm}x{ebn}"), f(&cpu, &["elementwise_interpret"]), f(&cpu, &["elementwise_xla"])),
    ];
    let ids = ["matmul", "attention_noncausal", "attention_causal", "gmm", "rmsnorm", "elementwise"];
    println!("\nCPU backends, medians in ms (ratios: time over XLA-CPU's)");
    println!("| case | blocks | interp | jit | llvm | pallas interpret | xla-cpu | jit/xla | llvm/xla | interp/xla |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut summary = serde_json::json!({ "cases": [] });
    for ((name, blocks, pi, xla), id) in rows.iter().zip(ids) {
        let (ti, tj, tl) = (ours(&format!("{id}_interp")), ours(&format!("{id}_jit")), ours(&format!("{id}_llvm")));
        println!("| {name} | {blocks} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |", ti * 1e3, tj * 1e3, tl * 1e3, pi * 1e3, xla * 1e3, tj / xla, tl / xla, ti / xla);
        summary["cases"].as_array_mut().unwrap().push(serde_json::json!({"case": name, "blocks": blocks, "interp_s": ti, "jit_s": tj, "llvm_s": tl, "pallas_interpret_s": pi, "xla_cpu_s": xla}));
    }
    let path = summary_path("bench_cpu_backends");
    let _ = std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap());
    println!("written to {}", path.display());
}
