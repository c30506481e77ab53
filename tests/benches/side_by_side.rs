//! Side-by-side benchmarks against JAX, in one run: `cargo bench -p tessera-tests --features bench`.
//!
//! 1. Lowering: Tessera builds + verifies + emits the tiled matmul (512^3 f32, 128 blocks)
//!    as StableHLO text, vs `jax.export` of the same Pallas kernel for TPU.
//! 2. CPU execution: Tessera's interpreter on matmul 1024^3 f32 with 128^3 blocks (and at
//!    its default v5e blocks), vs Pallas `interpret=True` (same blocks) and XLA-CPU `jnp.dot`.
//!
//! Criterion measures the Rust side; `scripts/bench_jax.py` (run in the project venv)
//! the JAX side; the ratios of medians are printed at the end and written to
//! `target/side_by_side.json`.

use criterion::{black_box, Criterion};
use tessera_tests::bench::{criterion_median, run_jax_script, summary_path};
use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::{interp, DType, Target, Type};
use tessera_kernels::harness::random_array;
use tessera_kernels::matmul::{matmul_blocks, matmul_kernel};

fn lower_matmul_512() -> String {
    let t = Type::vector(DType::F32, &[512, 512]);
    let k = matmul_kernel(t.clone(), t.clone(), t, 128, 128, 128, 512, false, false).unwrap();
    tessera_codegen::lower(&k, &Target::V5E).unwrap().stablehlo
}

fn benches(c: &mut Criterion) {
    c.bench_function("lower_matmul_512", |b| b.iter(|| black_box(lower_matmul_512())));

    let t = Type::vector(DType::F32, &[1024, 1024]);
    let mut rng = StdRng::seed_from_u64(0);
    let (x, y) = (random_array(DType::F32, &[1024, 1024], &mut rng), random_array(DType::F32, &[1024, 1024], &mut rng));
    let mut g = c.benchmark_group("interp");
    g.sample_size(10);
    let k128 = matmul_kernel(t.clone(), t.clone(), t.clone(), 128, 128, 128, 1024, false, false).unwrap();
    g.bench_function("matmul_1024_blocks128", |b| b.iter(|| black_box(interp::run(&k128, &[&x, &y]).unwrap())));
    let (bm, bk, bn) = matmul_blocks(1024, 1024, 1024, DType::F32, DType::F32, &Target::V5E);
    let kdef = matmul_kernel(t.clone(), t.clone(), t, bm, bn, bk, 1024, false, false).unwrap();
    g.bench_function("matmul_1024_default_blocks", |b| b.iter(|| black_box(interp::run(&kdef, &[&x, &y]).unwrap())));
    g.finish();
}



fn main() {
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
    let ours = |id: &str| criterion_median(id).unwrap_or(f64::NAN);
    let lower = ours("lower_matmul_512");
    let interp128 = ours("interp/matmul_1024_blocks128");
    let interp_def = ours("interp/matmul_1024_default_blocks");
    let Some(jax) = run_jax_script("bench_jax.py", &[]) else { return };
    let j = |k: &str| jax[k].as_f64().unwrap_or(f64::NAN);
    println!("\nside by side (medians)");
    println!("  lowering matmul 512^3 -> StableHLO: tessera {:.1} us, jax.export {:.1} ms (warm), {:.1} ms (first in process): {:.0}x / {:.0}x faster", lower * 1e6, j("export_matmul_warm") * 1e3, j("export_matmul_first") * 1e3, j("export_matmul_warm") / lower, j("export_matmul_first") / lower);
    println!("  matmul 1024^3 f32 on the CPU: tessera interp {:.1} ms (128 blocks), {:.1} ms (default blocks); pallas interpret=True {:.1} ms; xla jnp.dot {:.1} ms", interp128 * 1e3, interp_def * 1e3, j("interpret_matmul") * 1e3, j("xla_dot") * 1e3);
    println!("    interp vs pallas interpret: {:.1}x faster (same 128 blocks); vs xla-cpu dot: {:.2}x the time", j("interpret_matmul") / interp128, interp128 / j("xla_dot"));
    let summary = serde_json::json!({
        "tessera_lower_matmul_512_s": lower, "tessera_interp_matmul_1024_blocks128_s": interp128, "tessera_interp_matmul_1024_default_s": interp_def, "jax": jax,
        "ratio_lowering_vs_jax_export_warm": j("export_matmul_warm") / lower,
        "ratio_interp_vs_pallas_interpret": j("interpret_matmul") / interp128,
        "ratio_interp_time_over_xla_dot": interp128 / j("xla_dot"),
    });
    let path = summary_path("side_by_side");
    let _ = std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap());
    println!("  written to {}", path.display());
}
