//! Grouped matmul on the CPU, side by side with JAX in one run: `cargo bench -p tessera-tests --features bench --bench gmm`.
//!
//! gmm with m = 4096, k = n = 1024, 8 groups (random sizes with an empty group and
//! unaligned boundaries), bf16: Tessera's interpreter at 128^3 blocks (megablox's default
//! tiling) and at its v5e default blocks, vs megablox `gmm` under Pallas `interpret=True`
//! at both tilings and a per-group XLA-CPU `jnp.dot` (`scripts/bench_gmm.py`, same group
//! sizes). Ratios of medians are printed and written to `target/bench_gmm.json`.

use criterion::{black_box, Criterion};
use tessera_tests::bench::{criterion_median, run_jax_script, summary_path};
use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target};
use tessera_kernels::gmm::{self, GmmBlocks};
use tessera_kernels::harness::random_array;

const M: usize = 4096;
const K: usize = 1024;
const N: usize = 1024;
const G: usize = 8;



fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut rng = StdRng::seed_from_u64(0);
    let sizes = gmm::random_group_sizes(M, G, &mut rng);
    let (lhs, rhs) = (random_array(DType::BF16, &[M, K], &mut rng), random_array(DType::BF16, &[G, K, N], &mut rng));
    let gs = Array::from_i32(&[G], sizes.clone());
    let target = Target::V5E;
    let small = GmmBlocks { tm: 128, tk: 128, tn: 128 };
    let default = gmm::gmm_blocks(M, K, N, DType::BF16, &target);

    let mut g = c.benchmark_group("gmm");
    g.sample_size(10);
    g.bench_function("interp_blocks128", |b| b.iter(|| black_box(gmm::gmm_with_blocks(&tessera_dsl::Interpreter, &lhs, &rhs, &gs, false, small, &target).unwrap())));
    g.bench_function("interp_default_blocks", |b| b.iter(|| black_box(gmm::gmm_with_blocks(&tessera_dsl::Interpreter, &lhs, &rhs, &gs, false, default, &target).unwrap())));
    g.finish();
    c.final_summary();

    let ours = |id: &str| criterion_median(id).unwrap_or(f64::NAN);
    let (t128, tdef) = (ours("gmm/interp_blocks128"), ours("gmm/interp_default_blocks"));
    println!("\ngmm m={M} k={K} n={N} g={G} bf16, group sizes {sizes:?}");
    println!("  tessera interp: {:.1} ms (128^3 blocks), {:.1} ms (v5e default blocks {default:?})", t128 * 1e3, tdef * 1e3);
    let list = |v: Vec<String>| v.join(",");
    let args = [
        "--m".to_string(), M.to_string(), "--k".to_string(), K.to_string(), "--n".to_string(), N.to_string(),
        "--group-sizes".to_string(), list(sizes.iter().map(i32::to_string).collect()),
        "--tiling".to_string(), list([default.tm, default.tk, default.tn].map(|b| b.to_string()).to_vec()),
    ];
    let Some(jax) = run_jax_script("bench_gmm.py", &args) else { return };
    let j = |k: &str| jax[k].as_f64().unwrap_or(f64::NAN);
    let (p128, pdef, xla) = (j("interpret_gmm_128"), j("interpret_gmm_blocks"), j("xla_per_group"));
    println!("  megablox gmm, pallas interpret=True: {:.1} ms (128^3), {:.1} ms (same blocks as ours)", p128 * 1e3, pdef * 1e3);
    println!("  xla-cpu per-group jnp.dot: {:.1} ms", xla * 1e3);
    println!("  interp vs pallas interpret: {:.1}x faster at 128^3, {:.1}x faster at default blocks", p128 / t128, pdef / tdef);
    println!("  interp time over xla-cpu per-group dot: {:.2}x (128^3), {:.2}x (default blocks)", t128 / xla, tdef / xla);
    let summary = serde_json::json!({
        "problem": {"m": M, "k": K, "n": N, "g": G, "dtype": "bf16", "group_sizes": sizes, "default_blocks": [default.tm, default.tk, default.tn]},
        "tessera_interp_blocks128_s": t128, "tessera_interp_default_s": tdef, "jax": jax,
        "ratio_pallas_interpret_over_interp_128": p128 / t128,
        "ratio_pallas_interpret_over_interp_default": pdef / tdef,
        "ratio_interp_over_xla_per_group_128": t128 / xla,
        "ratio_interp_over_xla_per_group_default": tdef / xla,
    });
    let path = summary_path("bench_gmm");
    let _ = std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap());
    println!("  written to {}", path.display());
}
