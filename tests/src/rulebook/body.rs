//! The body's instructions (`verify/body.rs`, `verify/warn.rs`).

use tessera_dsl::*;

use super::{Pair, ALL_TARGETS};
use crate::kit::{self, Start};

pub fn pairs() -> Vec<Pair> {
    vec![
        Pair {
            rule: "matmul-dtype",
            edge: "int",
            differs: "an int8 x int8 dot vs int32 x int32",
            targets: ALL_TARGETS,
            inside: |_| kit::elementwise("p", DType::I8, 128, 128, |b, x, y| b.dot(x, y, false, false)),
            outside: |_| kit::elementwise("p", DType::I32, 128, 128, |b, x, y| b.dot(x, y, false, false)),
        },
        Pair {
            rule: "matmul-emulated",
            edge: "int8-tpu7x",
            differs: "a bf16 dot vs an int8 dot on tpu7x (compiles; its MXU has no int8 mode)",
            targets: &[Target::TPU7X],
            inside: |_| kit::elementwise("p", DType::BF16, 128, 128, |b, x, y| b.dot(x, y, false, false)),
            outside: |_| kit::elementwise("p", DType::I8, 128, 128, |b, x, y| b.dot(x, y, false, false)),
        },
        Pair {
            rule: "matmul-emulated",
            edge: "fp8-v5e-v6e",
            differs: "a bf16 dot vs a float8_e4m3fn dot on v5e, v5p and v6e (compiles; their MXUs have no fp8 mode)",
            targets: &[Target::V5E, Target::V5P, Target::V6E],
            inside: |_| kit::elementwise("p", DType::BF16, 128, 128, |b, x, y| b.dot(x, y, false, false)),
            outside: |_| kit::elementwise("p", DType::F8E4M3FN, 128, 128, |b, x, y| b.dot(x, y, false, false)),
        },
        Pair {
            rule: "fp8-op",
            edge: "fp8-add",
            differs: "fp8 vectors converted to f32 and back vs added",
            targets: ALL_TARGETS,
            inside: |_| {
                kit::elementwise("p", DType::F8E4M3FN, 32, 128, |b, x, _| {
                    let f = b.cast(x, DType::F32);
                    b.cast(f, DType::F8E4M3FN)
                })
            },
            outside: |_| kit::elementwise("p", DType::F8E4M3FN, 32, 128, |b, x, y| b.add(x, y)),
        },
        Pair {
            rule: "vector-op-dtype",
            edge: "int8-add",
            differs: "int8 vectors xor-ed vs added",
            targets: ALL_TARGETS,
            inside: |_| kit::elementwise("p", DType::I8, 32, 128, |b, x, y| b.binary(BinaryOp::Xor, x, y)),
            outside: |_| kit::elementwise("p", DType::I8, 32, 128, |b, x, y| b.add(x, y)),
        },
        Pair {
            rule: "vector-op-dtype",
            edge: "int8-shift",
            differs: "int8 vectors shifted right (arithmetic, by a vector of amounts) vs multiplied",
            targets: ALL_TARGETS,
            inside: |_| kit::elementwise("p", DType::I8, 32, 128, |b, x, y| b.binary(BinaryOp::Shr, x, y)),
            outside: |_| kit::elementwise("p", DType::I8, 32, 128, |b, x, y| b.mul(x, y)),
        },
        Pair {
            rule: "vector-op-dtype",
            edge: "bf16-rem",
            differs: "the remainder of f32 vectors vs of bf16 vectors",
            targets: ALL_TARGETS,
            inside: |_| kit::elementwise("p", DType::F32, 16, 256, |b, x, y| b.binary(BinaryOp::Rem, x, y)),
            outside: |_| kit::elementwise("p", DType::BF16, 16, 256, |b, x, y| b.binary(BinaryOp::Rem, x, y)),
        },
        Pair {
            rule: "reduce-dtype",
            edge: "int8-sum",
            differs: "a row sum of an i32 vector vs of an int8 vector",
            targets: ALL_TARGETS,
            inside: |_| kit::elementwise("p", DType::I32, 32, 128, |b, x, _| b.reduce(ReduceOp::Sum, x, 1)),
            outside: |_| kit::elementwise("p", DType::I8, 32, 128, |b, x, _| b.reduce(ReduceOp::Sum, x, 1)),
        },
        Pair {
            rule: "vector-offset-align",
            edge: "bf16-rows",
            differs: "a bf16 load of 16 rows at program_id * 8 vs program_id * 3",
            targets: ALL_TARGETS,
            inside: |_| kit::sliced_load("p", DType::BF16, [64, 256], (Start::Pid { mul: 8, add: 0 }, 16), (Start::Static(0), 128)),
            outside: |_| kit::sliced_load("p", DType::BF16, [64, 256], (Start::Pid { mul: 3, add: 0 }, 16), (Start::Static(0), 128)),
        },
        Pair {
            rule: "vector-offset-align",
            edge: "i8-rows",
            differs: "an int8 load of 16 rows at program_id * 32 vs program_id * 8",
            targets: ALL_TARGETS,
            inside: |_| kit::sliced_load("p", DType::I8, [64, 256], (Start::Pid { mul: 32, add: 0 }, 16), (Start::Static(0), 128)),
            outside: |_| kit::sliced_load("p", DType::I8, [64, 256], (Start::Pid { mul: 8, add: 0 }, 16), (Start::Static(0), 128)),
        },
        Pair {
            rule: "vector-offset-align",
            edge: "lanes",
            differs: "an f32 load of 128 lanes at program_id * 128 vs program_id * 64",
            targets: ALL_TARGETS,
            inside: |_| kit::sliced_load("p", DType::F32, [32, 512], (Start::Static(0), 32), (Start::Pid { mul: 128, add: 0 }, 128)),
            outside: |_| kit::sliced_load("p", DType::F32, [32, 512], (Start::Static(0), 32), (Start::Pid { mul: 64, add: 0 }, 128)),
        },
        Pair {
            rule: "vector-offset-align",
            edge: "proof-by-sum",
            differs: "an f32 store of 16 rows at program_id * 8 + 8 vs program_id * 8 + 4 (the analysis proves sums of multiples)",
            targets: ALL_TARGETS,
            inside: |_| kit::sliced_store("p", DType::F32, [64, 256], (Start::Pid { mul: 8, add: 8 }, 16), (Start::Static(0), 128)),
            outside: |_| kit::sliced_store("p", DType::F32, [64, 256], (Start::Pid { mul: 8, add: 4 }, 16), (Start::Static(0), 128)),
        },
        Pair {
            rule: "vector-offset-align",
            edge: "proof-by-loop",
            differs: "a bf16 load of 16 rows at a loop variable from 0 by 8 vs from 0 by 4",
            targets: ALL_TARGETS,
            inside: |_| kit::sliced_load("p", DType::BF16, [64, 256], (Start::Loop { lo: 0, step: 8 }, 16), (Start::Static(0), 128)),
            outside: |_| kit::sliced_load("p", DType::BF16, [64, 256], (Start::Loop { lo: 0, step: 4 }, 16), (Start::Static(0), 128)),
        },
            Pair {
            rule: "strided-access",
            edge: "lanes",
            differs: "an f32 load of every other row vs of every other lane",
            targets: ALL_TARGETS,
            inside: |_| strided_load(DType::F32, [16, 128], [Index::Strided(Arg::Int(0), 8, 2), Index::Full]),
            outside: |_| strided_load(DType::F32, [8, 256], [Index::Full, Index::Strided(Arg::Int(0), 128, 2)]),
        },
        Pair {
            rule: "strided-access",
            edge: "width",
            differs: "an f32 load of every other row of a 128-lane vs a 256-lane window",
            targets: ALL_TARGETS,
            inside: |_| strided_load(DType::F32, [16, 128], [Index::Strided(Arg::Int(1), 7, 2), Index::Full]),
            outside: |_| strided_load(DType::F32, [16, 256], [Index::Strided(Arg::Int(1), 7, 2), Index::Full]),
        },
        Pair {
            rule: "strided-access",
            edge: "store-dtype",
            differs: "a strided store of f32 vs of bf16 rows",
            targets: ALL_TARGETS,
            inside: |_| strided_store(DType::F32),
            outside: |_| strided_store(DType::BF16),
        },
        Pair {
            rule: "strided-access",
            edge: "packed-rows",
            differs: "a strided bf16 load from a 16-row vs a 17-row window",
            targets: ALL_TARGETS,
            inside: |_| strided_load(DType::BF16, [16, 128], [Index::Strided(Arg::Int(1), 8, 2), Index::Full]),
            outside: |_| strided_load(DType::BF16, [17, 128], [Index::Strided(Arg::Int(1), 8, 2), Index::Full]),
        },
        Pair {
            rule: "strided-access",
            edge: "packed-dynamic",
            differs: "a strided bf16 load at a static vs a dynamic (program_id * 8) start",
            targets: ALL_TARGETS,
            inside: |_| strided_pid_load(DType::BF16, 0),
            outside: |_| strided_pid_load(DType::BF16, 8),
        },
        Pair {
            rule: "prng-seed-count",
            edge: "three",
            differs: "prng_seed with two seeds vs three",
            targets: ALL_TARGETS,
            inside: |_| prng(2),
            outside: |_| prng(3),
        },
]
}

/// `out = x[index]` of one `[rows, lanes]` block (a strided load).
fn strided_load(dtype: DType, src: [usize; 2], index: [Index; 2]) -> kit::Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(1, Semantics::Parallel)]);
    let zero = || vec![IndexExpr::Const(0), IndexExpr::Const(0)];
    let x = b.input("x", dtype, &src, kit::spec(&src, zero()));
    let lens: Vec<usize> = index.iter().zip(src).map(|(i, d)| match *i {
        Index::Strided(_, len, _) | Index::Slice(_, len) => len,
        Index::Full => d,
    }).collect();
    let o = b.output("out", dtype, &lens, kit::spec(&lens, zero()));
    let v = b.load(x, &index);
    b.store(o, &[], v);
    b.finish()
}

/// `out[1, 3, .., 15] = x` (8 rows at stride 2 of a 16-row output).
fn strided_store(dtype: DType) -> kit::Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(1, Semantics::Parallel)]);
    let zero = || vec![IndexExpr::Const(0), IndexExpr::Const(0)];
    let x = b.input("x", dtype, &[8, 128], kit::spec(&[8, 128], zero()));
    let o = b.output("out", dtype, &[16, 128], kit::spec(&[16, 128], zero()));
    b.store(o, &[], 0i64);
    let v = b.load(x, &[]);
    b.store(o, &[Index::Strided(Arg::Int(1), 8, 2), Index::Full], v);
    b.finish()
}

/// 8 rows at stride 2 from row `program_id * mul` of a 32-row window (grid of 2).
fn strided_pid_load(dtype: DType, mul: i64) -> kit::Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(2, Semantics::Arbitrary)]);
    let zero = || vec![IndexExpr::Const(0), IndexExpr::Const(0)];
    let x = b.input("x", dtype, &[32, 128], kit::spec(&[32, 128], zero()));
    let o = b.output("out", dtype, &[8, 128], kit::spec(&[8, 128], zero()));
    let start = if mul == 0 {
        Arg::Int(0)
    } else {
        let p = b.program_id(0);
        Arg::Val(b.mul(p, mul))
    };
    let v = b.load(x, &[Index::Strided(start, 8, 2), Index::Full]);
    b.store(o, &[], v);
    b.finish()
}

/// `out = prng_random_bits` after seeding with `n` seeds.
fn prng(n: usize) -> kit::Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(1, Semantics::Parallel)]);
    let o = b.output("out", DType::I32, &[8, 128], kit::spec(&[8, 128], vec![IndexExpr::Const(0), IndexExpr::Const(0)]));
    let seeds: Vec<Arg> = (0..n as i64).map(|i| Arg::Int(i + 1)).collect();
    b.prng_seed(&seeds);
    let v = b.prng_random_bits(&[8, 128]);
    b.store(o, &[], v);
    b.finish()
}
