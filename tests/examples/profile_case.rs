//! Runs one case of the CPU-backends bench in a loop, for a profiler to watch:
//! `cargo run --release -p tessera-tests --example profile_case -- gmm jit 10`
//! (case: matmul | attention | attention_causal | gmm | rmsnorm; backend: interp | jit | llvm;
//! seconds), e.g. under `perf record -g`. Prints the median time per call.
use std::time::Instant;

use rand::{rngs::StdRng, SeedableRng};
use tessera_codegen::cpu::Backend;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target, Type};
use tessera_kernels::attention::{self, AttentionParams};
use tessera_kernels::gmm;
use tessera_kernels::harness::random_array;
use tessera_kernels::matmul::{matmul_blocks, matmul_kernel};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let case = args.first().map(String::as_str).unwrap_or("gmm");
    let backend = args.get(1).and_then(|s| Backend::parse(s)).unwrap_or(Backend::Jit);
    let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10.0);
    let e = backend.executor();
    let target = Target::V5E;
    let mut rng = StdRng::seed_from_u64(0);
    let mut call: Box<dyn FnMut()> = match case {
        "matmul" => {
            let t = Type::vector(DType::F32, &[1024, 1024]);
            let (bm, bk, bn) = matmul_blocks(1024, 1024, 1024, DType::F32, DType::F32, &target);
            let mm = matmul_kernel(t.clone(), t.clone(), t, bm, bn, bk, 1024, false, false).unwrap();
            let (x, y) = (random_array(DType::F32, &[1024, 1024], &mut rng), random_array(DType::F32, &[1024, 1024], &mut rng));
            let mut out = Array::zeros(DType::F32, &[1024, 1024]);
            Box::new(move || drop(e.run_into(&mm, &[x.as_host(), y.as_host()], &mut [out.as_host_mut()]).unwrap()))
        }
        "attention" | "attention_causal" => {
            let causal = case == "attention_causal";
            let [q, k, v] = [0; 3].map(|_| random_array(DType::F32, &[1, 8, 1024, 128], &mut rng));
            let blocks = attention::default_forward_blocks(&Type::vector(DType::F32, &q.shape), &Type::vector(DType::F32, &k.shape), causal, &target);
            let params = AttentionParams::new(128, causal);
            Box::new(move || drop(attention::flash_attention_with_blocks(e, &q, &k, &v, None, &params, blocks, &target).unwrap()))
        }
        "gmm" => {
            let sizes = gmm::random_group_sizes(4096, 8, &mut rng);
            let (lhs, rhs) = (random_array(DType::BF16, &[4096, 1024], &mut rng), random_array(DType::BF16, &[8, 1024, 1024], &mut rng));
            let gs = Array::from_i32(&[8], sizes);
            let blocks = gmm::gmm_blocks(4096, 1024, 1024, DType::BF16, &target);
            Box::new(move || drop(gmm::gmm_with_blocks(e, &lhs, &rhs, &gs, false, blocks, &target).unwrap()))
        }
        "rmsnorm" => {
            let (x, w) = (random_array(DType::F32, &[4096, 4096], &mut rng), random_array(DType::F32, &[1, 4096], &mut rng));
            let k = tessera_kernels::rmsnorm(&Type::vector(DType::F32, &[4096, 4096]), &Type::vector(DType::F32, &[1, 4096]), tessera_kernels::RMSNORM_EPS, &target).unwrap();
            let mut out = Array::zeros(DType::F32, &[4096, 4096]);
            Box::new(move || drop(e.run_into(&k, &[x.as_host(), w.as_host()], &mut [out.as_host_mut()]).unwrap()))
        }
        other => {
            eprintln!("unknown case `{other}`: matmul | attention | attention_causal | gmm | rmsnorm");
            std::process::exit(2);
        }
    };
    call(); // compile
    let (t0, mut times) = (Instant::now(), Vec::new());
    while t0.elapsed().as_secs_f64() < seconds || times.len() < 5 {
        let t = Instant::now();
        call();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let stats = tessera_codegen::cpu::cache_stats();
    println!("{case} on {backend}: median {:.2} ms over {} calls ({} compiles, {:.0} ms compiling)", times[times.len() / 2] * 1e3, times.len(), stats.misses, stats.compile_time.as_secs_f64() * 1e3);
}
