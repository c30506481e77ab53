//! Async copy slices (`verify/dma.rs`).

use tessera_dsl::{DType, Target};

use super::{Pair, ALL_TARGETS};
use crate::kit::{self, Start};

const ROW0: (Start, usize) = (Start::Static(0), 8);

pub fn pairs() -> Vec<Pair> {
    vec![
        Pair {
            rule: "dma-align",
            edge: "rows",
            differs: "an f32 copy of 16 rows from row program_id * 8 vs program_id * 3",
            targets: ALL_TARGETS,
            inside: |_| kit::dma_slice("p", DType::F32, [64, 256], (Start::Pid { mul: 8, add: 0 }, 16), (Start::Static(0), 128)),
            outside: |_| kit::dma_slice("p", DType::F32, [64, 256], (Start::Pid { mul: 3, add: 0 }, 16), (Start::Static(0), 128)),
        },
        Pair {
            rule: "dma-align",
            edge: "bf16-small-rows",
            differs: "a bf16 copy of 4 rows from row 2 vs row 1 (packed rows come in pairs)",
            targets: ALL_TARGETS,
            inside: |_| kit::dma_slice("p", DType::BF16, [64, 256], (Start::Static(2), 4), (Start::Static(0), 128)),
            outside: |_| kit::dma_slice("p", DType::BF16, [64, 256], (Start::Static(1), 4), (Start::Static(0), 128)),
        },
        Pair {
            rule: "dma-align",
            edge: "lanes",
            differs: "an f32 copy of 64 lanes from lane 128 vs lane 64",
            targets: &[Target::V5E, Target::TPU7X],
            inside: |t| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(128), if t.name == "v5e" { 128 } else { 64 })),
            outside: |t| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(64), if t.name == "v5e" { 128 } else { 64 })),
        },
        Pair {
            rule: "dma-align",
            edge: "lanes-v6e",
            differs: "an f32 copy of 8 lanes from lane 8 vs lane 5",
            targets: &[Target::V6E, Target::V5P],
            inside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(8), 8)),
            outside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(5), 8)),
        },
        Pair {
            rule: "dma-slice-size",
            edge: "rows",
            differs: "an f32 copy of 16 rows vs 12",
            targets: ALL_TARGETS,
            inside: |_| kit::dma_slice("p", DType::F32, [64, 256], (Start::Static(0), 16), (Start::Static(0), 128)),
            outside: |_| kit::dma_slice("p", DType::F32, [64, 256], (Start::Static(0), 12), (Start::Static(0), 128)),
        },
        Pair {
            rule: "dma-slice-size",
            edge: "lanes-v5e",
            differs: "an f32 copy of 128 of 256 lanes vs 64",
            targets: &[Target::V5E],
            inside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(0), 128)),
            outside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(0), 64)),
        },
        Pair {
            rule: "dma-slice-size",
            edge: "lanes",
            differs: "an f32 copy of 16 of 256 lanes vs 12",
            targets: &[Target::V6E, Target::TPU7X, Target::V5P],
            inside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(0), 16)),
            outside: |_| kit::dma_slice("p", DType::F32, [64, 256], ROW0, (Start::Static(0), 12)),
        },
    ]
}
