//! Per-call overhead of each CPU backend on a tiny kernel (an [8, 128] add, one grid step)
//! and on the library's softmax at [8, 128]: `cargo run --release -p tessera-tests --example call_overhead`.
use std::time::Instant;

use tessera_codegen::cpu::Backend;
use tessera_dsl::interp::Array;
use tessera_dsl::{BlockSpec, DType, IndexExpr, KernelBuilder, Semantics, Target, Type};

fn main() {
    let mut b = KernelBuilder::new("tiny_add");
    b.grid(&[(1, Semantics::Parallel)]);
    let spec = BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[8, 128], spec.clone());
    let y = b.input("y", DType::F32, &[8, 128], spec.clone());
    let o = b.output("o", DType::F32, &[8, 128], spec);
    let (a, c) = (b.load(x, &[]), b.load(y, &[]));
    let s = b.add(a, c);
    b.store(o, &[], s);
    let tiny = b.finish().unwrap();
    let softmax = tessera_kernels::softmax(&Type::vector(DType::F32, &[8, 128]), &Target::V5E).unwrap();
    let xa = Array::from_f32(&[8, 128], vec![0.5; 1024]);
    let mut out = Array::zeros(DType::F32, &[8, 128]);
    for backend in Backend::ALL.into_iter().filter(|b| b.available()) {
        let e = backend.executor();
        for (name, k, args) in [("add 8x128", &tiny, vec![&xa, &xa]), ("softmax 8x128", &softmax, vec![&xa])] {
            let ins: Vec<_> = args.iter().map(|a| a.as_host()).collect();
            e.run_into(k, &ins, &mut [out.as_host_mut()]).unwrap(); // compile
            let n = 20_000;
            let t = Instant::now();
            for _ in 0..n {
                e.run_into(k, &ins, &mut [out.as_host_mut()]).unwrap();
            }
            println!("{backend:<6} {name:<14} {:.2} us per call", t.elapsed().as_secs_f64() / n as f64 * 1e6);
        }
    }
}
