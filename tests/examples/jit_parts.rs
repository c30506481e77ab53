//! Times single ops on [256, 256] blocks on each backend (a profiling aid):
//! `cargo run --release -p tessera-tests --example jit_parts`.
use std::time::Instant;

use tessera_codegen::cpu::{Backend, Compiled};
use tessera_dsl::interp::Array;
use tessera_dsl::{BlockSpec, DType, Executor, IndexExpr, Kernel, KernelBuilder, ReduceOp, Semantics, UnaryOp};

fn kernel(name: &str, f: impl Fn(&mut KernelBuilder, tessera_dsl::Value) -> tessera_dsl::Value) -> Kernel {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(64, Semantics::Parallel)]);
    let spec = BlockSpec { block_shape: vec![Some(256), Some(256)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[64 * 256, 256], spec.clone());
    let o = b.output("o", DType::F32, &[64 * 256, 256], spec);
    let v = b.load(x, &[]);
    let r = f(&mut b, v);
    let r = b.broadcast(r, &[256, 256]);
    b.store(o, &[], r);
    b.finish().unwrap()
}

fn main() {
    let ks = vec![
        kernel("copy", |_, v| v),
        kernel("exp", |b, v| b.unary(UnaryOp::Exp, v)),
        kernel("max_rows", |b, v| b.reduce(ReduceOp::Max, v, 1)),
        kernel("sum_cols", |b, v| b.reduce(ReduceOp::Sum, v, 0)),
        kernel("softmax", |b, v| {
            let m = b.reduce(ReduceOp::Max, v, 1);
            let mb = b.broadcast(m, &[256, 256]);
            let d = b.sub(v, mb);
            let e = b.unary(UnaryOp::Exp, d);
            let s = b.reduce(ReduceOp::Sum, e, 1);
            let sb = b.broadcast(s, &[256, 256]);
            b.div(e, sb)
        }),
    ];
    let x = Array::from_f32(&[64 * 256, 256], (0..64 * 256 * 256).map(|i| ((i % 1000) as f32) * 1e-3).collect());
    let mut out = Array::zeros(DType::F32, &[64 * 256, 256]);
    let one = Compiled { backend: Backend::Jit, exact: false, threads: Some(1) };
    let two = Compiled { backend: Backend::Jit, exact: false, threads: Some(2) };
    let execs: Vec<(&str, &dyn Executor)> = vec![("interp", &tessera_dsl::Interpreter), ("jit", Backend::Jit.executor()), ("jit 1 thread", &one), ("jit 2 threads", &two), ("jit 1 thread", &one)];
    for k in &ks {
        for (name, e) in &execs {
            e.run_into(k, &[x.as_host()], &mut [out.as_host_mut()]).unwrap();
            let t = Instant::now();
            for _ in 0..5 {
                e.run_into(k, &[x.as_host()], &mut [out.as_host_mut()]).unwrap();
            }
            println!("{:<10} {name:<12} {:.2} ms", k.name, t.elapsed().as_secs_f64() / 5.0 * 1e3);
        }
    }
}
