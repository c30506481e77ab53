//! int8 weight-only quantized matmul on the interpreter vs its f64 reference, f32 and
//! bf16 activations, several shape sets (full-dim small blocks, non-power-of-two dims,
//! a single row), at the blocks v5e and v6e pick.

use tessera_dsl::{DType, Target};
use tessera_kernels::harness::run_against_reference;

#[test]
fn quantized_matmul_matches_reference() {
    let op = tessera_kernels::find("quantized_matmul").unwrap();
    let sets: [[&[usize]; 3]; 6] = [
        [&[128, 256], &[128, 256], &[1, 128]],
        [&[512, 2048], &[2048, 2048], &[1, 2048]],
        [&[8, 4096], &[1024, 4096], &[1, 1024]],
        [&[1, 512], &[384, 512], &[1, 384]],
        [&[40, 96], &[24, 96], &[1, 24]],
        [&[384, 1536], &[640, 1536], &[1, 640]],
    ];
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::V6E] {
            for (seed, set) in sets.iter().enumerate() {
                let shapes: Vec<Vec<usize>> = set.iter().map(|s| s.to_vec()).collect();
                let r = run_against_reference(op, &shapes, dtype, &target, seed as u64).unwrap_or_else(|e| panic!("{shapes:?}: {e}"));
                assert!(r.passed(), "{shapes:?} {dtype} on {target}: {:?}", r.outputs);
            }
        }
    }
}
