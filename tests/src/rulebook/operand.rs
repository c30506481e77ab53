//! Block specs and operands (`verify/operand.rs`).

use tessera_dsl::{IndexExpr as I, *};

use super::{Pair, ALL_TARGETS};
use crate::kit::{self, spec, Built};

/// `out = x` on a [96, 128] array whose input block's index map returns `n` results.
fn arity(n: usize) -> Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(12, Semantics::Parallel)]);
    let map = if n == 2 { vec![I::Grid(0), I::Const(0)] } else { vec![I::Grid(0)] };
    let x = b.input("x", DType::F32, &[96, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: map });
    let o = b.output("out", DType::F32, &[96, 128], spec(&[8, 128], vec![I::Grid(0), I::Const(0)]));
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    b.finish()
}

/// A copy whose input and output together take `bytes` of HBM (f32 rows of 4096 lanes).
fn hbm(bytes: usize) -> Built {
    let rows = (bytes / 2 / (4 * 4096)) / 512 * 512;
    kit::copy("p", DType::F32, &[rows, 4096], &[512, 4096])
}

/// `x` copied on one [8, 128] block into an output, or (`to_output` false) into a VMEM
/// scratch, leaving the kernel without outputs.
fn copy_into(to_output: bool) -> Built {
    let mut b = KernelBuilder::new("p");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.input("x", DType::F32, &[8, 128], spec(&[8, 128], vec![I::Const(0), I::Const(0)]));
    let dst = if to_output { b.output("out", DType::F32, &[8, 128], spec(&[8, 128], vec![I::Const(0), I::Const(0)])) } else { b.scratch("s", DType::F32, &[8, 128], MemorySpace::Vmem) };
    let v = b.load(x, &[]);
    b.store(dst, &[], v);
    b.finish()
}

pub fn pairs() -> Vec<Pair> {
    vec![
        Pair {
            rule: "kernel-outputs",
            edge: "outputs",
            differs: "a copy into an output vs the same copy into a VMEM scratch (no output)",
            targets: ALL_TARGETS,
            inside: |_| copy_into(true),
            outside: |_| copy_into(false),
        },
        Pair {
            rule: "block-tiling",
            edge: "f32-rows",
            differs: "an f32 [8, 128] block of a [96, 128] array vs [12, 128]",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::F32, &[96, 128], &[8, 128]),
            outside: |_| kit::copy("p", DType::F32, &[96, 128], &[12, 128]),
        },
        Pair {
            rule: "block-tiling",
            edge: "bf16-rows",
            differs: "a bf16 [8, 128] block (half the packed tile) vs [4, 128]",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::BF16, &[96, 128], &[8, 128]),
            outside: |_| kit::copy("p", DType::BF16, &[96, 128], &[4, 128]),
        },
        Pair {
            rule: "block-tiling",
            edge: "i8-rows",
            differs: "an int8 [24, 128] block vs [12, 128]",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::I8, &[96, 128], &[24, 128]),
            outside: |_| kit::copy("p", DType::I8, &[96, 128], &[12, 128]),
        },
        Pair {
            rule: "block-tiling",
            edge: "lanes",
            differs: "an f32 [32, 256] block of a [64, 768] array vs [32, 192]",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::F32, &[64, 768], &[32, 256]),
            outside: |_| kit::copy("p", DType::F32, &[64, 768], &[32, 192]),
        },
        Pair {
            rule: "block-tiling-1d",
            edge: "bf16",
            differs: "a bf16 rank-1 block of 256 of 4096 vs 128",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::BF16, &[4096], &[256]),
            outside: |_| kit::copy("p", DType::BF16, &[4096], &[128]),
        },
        Pair {
            rule: "block-tiling-1d",
            edge: "i8",
            differs: "an int8 rank-1 block of 512 of 4096 vs 256",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::I8, &[4096], &[512]),
            outside: |_| kit::copy("p", DType::I8, &[4096], &[256]),
        },
        Pair {
            rule: "index-map-arity",
            edge: "results",
            differs: "a rank-2 input whose index map returns 2 block indices vs 1",
            targets: ALL_TARGETS,
            inside: |_| arity(2),
            outside: |_| arity(1),
        },
        Pair {
            rule: "hbm-budget",
            edge: "operands",
            differs: "operands of half the usable HBM vs 9/8 of the chip's HBM",
            targets: &[Target::V6E, Target::TPU7X],
            inside: |t| hbm(t.hbm_usable_bytes / 2),
            outside: |t| hbm(t.hbm_bytes / (if t.name == "tpu7x" { 2 } else { 1 }) * 9 / 8),
        },
        Pair {
            rule: "block-native-tiling",
            edge: "bf16-rows",
            differs: "a bf16 [16, 128] block (the packed native tile) vs [8, 128] (compiles, half-filled vregs)",
            targets: ALL_TARGETS,
            inside: |_| kit::copy("p", DType::BF16, &[96, 128], &[16, 128]),
            outside: |_| kit::copy("p", DType::BF16, &[96, 128], &[8, 128]),
        },
    ]
}
