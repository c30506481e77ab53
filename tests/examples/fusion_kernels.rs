//! The kernels DeferAndFuse generates for `scripts/bench_fusion.py`'s two workloads (the
//! 8-op elementwise chain and RMSNorm in plain ops, [4096, 4096] f32), timed alone (into preallocated outputs) on each
//! CPU backend (medians and minima of 7 after a warm-up that compiles, the CPU time a call of all threads, the compile time): the kernel's share of the
//! Python figure, without recording, planning or torch.
//! `cargo run --release -p tessera-tests --example fusion_kernels [--features llvm]`.
use std::time::Instant;

use tessera_codegen::cpu::Backend;
use tessera_dsl::interp::{Array, HostMut, HostRef};
use tessera_dsl::{DType, Target};
use tessera_kernels::fusion::{Binary, Graph, NodeId, Operand, Program, RowOp, Unary};
use tessera_kernels::harness::random_array;

const N: usize = 4096;

/// `bench_fusion.chain` as the front-end records it.
fn chain() -> (Graph, NodeId) {
    let mut g = Graph::new();
    let x = g.input(DType::F32, &[N, N]).unwrap();
    let s = |v: f64| Operand::Scalar(v);
    let n = Operand::Node;
    let y = g.binary(Binary::Mul, n(x), s(1.5)).unwrap();
    let y = g.binary(Binary::Add, n(y), s(0.25)).unwrap();
    let y = g.unary(Unary::Tanh, y).unwrap();
    let y = g.binary(Binary::Mul, n(y), n(y)).unwrap();
    let y = g.unary(Unary::Neg, y).unwrap();
    let y = g.unary(Unary::Exp, y).unwrap();
    let y = g.binary(Binary::Maximum, n(y), n(x)).unwrap();
    let y = g.unary(Unary::Sigmoid, y).unwrap();
    let y = g.binary(Binary::Sub, n(y), s(0.5)).unwrap();
    let y = g.clamp(y, Some(-0.2), Some(0.4)).unwrap();
    (g, y)
}

fn rmsnorm() -> (Graph, NodeId) {
    let mut g = Graph::new();
    let x = g.input(DType::F32, &[N, N]).unwrap();
    let w = g.input(DType::F32, &[N]).unwrap();
    let sq = g.binary(Binary::Pow, Operand::Node(x), Operand::Scalar(2.0)).unwrap();
    let ms = g.row(RowOp::Mean, sq, true).unwrap();
    let e = g.binary(Binary::Add, Operand::Node(ms), Operand::Scalar(1e-6)).unwrap();
    let r = g.unary(Unary::Rsqrt, e).unwrap();
    let y = g.binary(Binary::Mul, Operand::Node(x), Operand::Node(r)).unwrap();
    let out = g.binary(Binary::Mul, Operand::Node(y), Operand::Node(w)).unwrap();
    (g, out)
}

fn main() {
    let mut rng: rand::rngs::StdRng = rand::SeedableRng::seed_from_u64(7);
    let x = random_array(DType::F32, &[N, N], &mut rng);
    let w = random_array(DType::F32, &[N], &mut rng);
    let only = std::env::args().nth(1);
    for (name, (g, out), inputs) in [("chain8", chain(), vec![&x]), ("rmsnorm", rmsnorm(), vec![&x, &w])] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let p = Program::build(&g, &[out], &Target::V5E).unwrap();
        let mut line = format!("{name:8}");
        for b in Backend::ALL.into_iter().filter(|b| b.available() && *b != Backend::Interp) {
            let exec = b.executor();
            let before = tessera_codegen::cpu::cache_stats().compile_time;
            let mut out: Vec<Array> = p.run(exec, &inputs).unwrap();
            let compile = (tessera_codegen::cpu::cache_stats().compile_time - before).as_secs_f64() * 1e3;
            let ins: Vec<HostRef<'_>> = inputs.iter().map(|a| a.as_host()).collect();
            let cpu0 = cpu_ns();
            let mut ts: Vec<f64> = (0..7)
                .map(|_| {
                    let mut outs: Vec<HostMut<'_>> = out.iter_mut().map(Array::as_host_mut).collect();
                    let t = Instant::now();
                    p.run_into(exec, &ins, &mut outs).unwrap();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            let cpu = (cpu_ns() - cpu0) as f64 / 7e6;
            ts.sort_by(f64::total_cmp);
            line += &format!("   {b} {:7.1} ms (min {:.1}; CPU {cpu:.1} ms a call; compiled in {compile:.0} ms)", ts[3], ts[0]);
        }
        println!("{line}");
    }
}

/// CPU time of all of this process's threads so far, in ns (Linux: the sum of each
/// thread's `/proc/self/task/*/schedstat` run time; 0 elsewhere). Unlike wall time it
/// does not count the time other jobs on a shared machine take from this one.
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return 0 };
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok()).filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok()).sum()
}
