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
    ]
}
