//! Flash attention forward on the CPU, side by side with JAX in one run:
//! `cargo bench -p tessera-tests --features bench --bench attention`.
//!
//! B 1, H 8, S 1024, D 128, f32, sm_scale = 1/sqrt(D), non-causal (DESIGN §6's anchor:
//! Pallas interpret 1.7 s, XLA-CPU 0.1 s) and causal: Tessera's interpreter at its v5e
//! default blocks (256 x 256) and at Pallas' default (128 x 128), vs Pallas'
//! `flash_attention` under `interpret=True` at both block sizes and an XLA-CPU reference
//! attention (`scripts/bench_attention.py`). Ratios of medians are printed and written to
//! `target/bench_attention.json`.

use criterion::{black_box, Criterion};
use tessera_tests::bench::{criterion_median, run_jax_script, summary_path};
use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::{DType, Target, Type};
use tessera_kernels::attention::{self, AttentionBlocks, AttentionParams};
use tessera_kernels::harness::random_array;

const B: usize = 1;
const H: usize = 8;
const S: usize = 1024;
const D: usize = 128;



fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut rng = StdRng::seed_from_u64(0);
    let [q, k, v] = [0; 3].map(|_| random_array(DType::F32, &[B, H, S, D], &mut rng));
    let target = Target::V5E;
    let default = attention::default_forward_blocks(&Type::vector(DType::F32, &q.shape), &Type::vector(DType::F32, &k.shape), false, &target);
    let small = AttentionBlocks { block_q: 128, block_kv: 128 };

    let mut g = c.benchmark_group("attention");
    g.sample_size(10);
    for causal in [false, true] {
        let params = AttentionParams::new(D, causal);
        let tag = if causal { "causal" } else { "noncausal" };
        for (name, blocks) in [("default_blocks", default), ("blocks128", small)] {
            g.bench_function(format!("interp_{tag}_{name}"), |b| b.iter(|| black_box(attention::flash_attention_with_blocks(&tessera_dsl::Interpreter, &q, &k, &v, None, &params, blocks, &target).unwrap())));
        }
    }
    g.finish();
    c.final_summary();

    let ours = |id: &str| criterion_median(&format!("attention/{id}")).unwrap_or(f64::NAN);
    println!("\nflash attention forward B{B} H{H} S{S} D{D} f32, v5e default blocks {default:?}");
    let args = [("--b", B), ("--h", H), ("--s", S), ("--d", D), ("--block", default.block_q)].map(|(flag, v)| [flag.to_string(), v.to_string()]).concat();
    let jax = run_jax_script("bench_attention.py", &args);
    let mut summary = serde_json::json!({
        "problem": {"b": B, "h": H, "s": S, "d": D, "dtype": "f32", "default_blocks": [default.block_q, default.block_kv]},
        "jax": jax,
    });
    for tag in ["noncausal", "causal"] {
        let (tdef, t128) = (ours(&format!("interp_{tag}_default_blocks")), ours(&format!("interp_{tag}_blocks128")));
        println!("  {tag}: tessera interp {:.1} ms (default blocks), {:.1} ms (128 x 128)", tdef * 1e3, t128 * 1e3);
        summary[format!("tessera_interp_{tag}_default_s")] = tdef.into();
        summary[format!("tessera_interp_{tag}_blocks128_s")] = t128.into();
        let Some(j) = jax.as_ref().map(|j| &j[tag]) else { continue };
        let f = |key: &str| j[key].as_f64().unwrap_or(f64::NAN);
        let (pdef, p128, xla) = (f("pallas_interpret_blocks"), f("pallas_interpret_128"), f("xla_reference"));
        println!("  {tag}: pallas flash_attention interpret=True {:.1} ms (same blocks), {:.1} ms (128 x 128); xla-cpu reference {:.1} ms", pdef * 1e3, p128 * 1e3, xla * 1e3);
        println!("  {tag}: interp vs pallas interpret: {:.1}x faster (same blocks), {:.1}x (128 x 128); interp over xla-cpu: {:.2}x", pdef / tdef, p128 / t128, tdef / xla);
        summary[format!("ratio_pallas_interpret_over_interp_{tag}_default")] = (pdef / tdef).into();
        summary[format!("ratio_pallas_interpret_over_interp_{tag}_128")] = (p128 / t128).into();
        summary[format!("ratio_interp_over_xla_{tag}_default")] = (tdef / xla).into();
    }
    let path = summary_path("bench_attention");
    let _ = std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap());
    println!("  written to {}", path.display());
}
