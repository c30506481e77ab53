//! VMEM and SMEM budgets (`verify/budget.rs`).

use tessera_dsl::{DType, Target};

use super::{Pair, ALL_TARGETS};
use crate::kit::{self, Built};

/// A copy whose four double-buffered [rows, 512] blocks take `pct`% of the default limit.
fn copy_at(t: &Target, dtype: DType, pct: usize) -> Built {
    let rows = (t.default_scoped_vmem_bytes * pct / 100 / 4 / (512 * dtype.bytes())) / 16 * 16;
    kit::copy("p", dtype, &[rows * 4, 512], &[rows, 512])
}

/// The bf16 matmul (f32 accumulator, bk = 1024, bn = 512) with the largest bm whose
/// estimated need stays under `pct`% of the default limit.
fn matmul_at(t: &Target, pct: usize) -> Built {
    let limit = t.default_scoped_vmem_bytes * pct / 100;
    let bm = (8..=4096).step_by(8).take_while(|&bm| kit::matmul("p", DType::BF16, [bm * 2, 2048, 1024], [bm, 1024, 512], None).is_ok_and(|k| tessera_dsl::verify::vmem_need(&k, t) <= limit)).last().unwrap_or(8);
    kit::matmul("p", DType::BF16, [bm * 2, 2048, 1024], [bm, 1024, 512], None)
}

const WORDS: usize = (1 << 20) / 4;

pub fn pairs() -> Vec<Pair> {
    vec![
        Pair {
            rule: "vmem-budget",
            edge: "copy",
            differs: "a copy whose double-buffered blocks fill 100% of the default scoped limit vs 103%",
            targets: ALL_TARGETS,
            inside: |t| copy_at(t, DType::F32, 100),
            outside: |t| copy_at(t, DType::F32, 103),
        },
        Pair {
            rule: "vmem-budget",
            edge: "bf16-matmul",
            differs: "a bf16 matmul with an f32 accumulator at 95% of the limit by our count (buffers + Mosaic's matmul scratch + margin) vs 103%",
            targets: &[Target::V5E, Target::V5P],
            inside: |t| matmul_at(t, 95),
            outside: |t| matmul_at(t, 103),
        },
        Pair {
            rule: "smem-budget",
            edge: "table",
            differs: "a scalar-prefetch table of 1 MiB - 3 KiB vs 1 MiB - 3 KiB + 4 bytes (padded to 1 MiB - 2.5 KiB)",
            targets: &[Target::V5E, Target::V6E, Target::V5P],
            inside: |_| kit::smem_fill("p", WORDS - 768, 0),
            outside: |_| kit::smem_fill("p", WORDS - 767, 0),
        },
        Pair {
            rule: "smem-budget",
            edge: "table-tpu7x",
            differs: "a scalar-prefetch table of 1 MiB - 2 KiB vs 1 MiB - 1.75 KiB",
            targets: &[Target::TPU7X],
            inside: |_| kit::smem_fill("p", WORDS - 512, 0),
            outside: |_| kit::smem_fill("p", WORDS - 448, 0),
        },
    ]
}
