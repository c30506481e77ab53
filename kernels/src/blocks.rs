//! The block-size rules shared by the library kernels.

/// The largest block `<= max` that divides `dim` and is a multiple of `align`; the whole
/// dim when it is small or nothing aligned divides it (a full-dim block is always legal).
pub fn pick_block(dim: usize, max: usize, align: usize) -> usize {
    if dim <= max {
        return dim;
    }
    let mut b = max / align * align;
    while b >= align {
        if dim.is_multiple_of(b) {
            return b;
        }
        b -= align;
    }
    dim
}

/// Halves blocks (each given with the dim it tiles) until `vmem(current blocks) <= budget`
/// or none can shrink: always the first in the list that can, so list them in the order
/// you would rather give up. A block only shrinks to a half that still divides its dim
/// and stays a multiple of 128.
pub fn fit_blocks(blocks: &mut [(&mut usize, usize)], budget: usize, vmem: impl Fn(&[usize]) -> usize) {
    loop {
        let current: Vec<usize> = blocks.iter().map(|(b, _)| **b).collect();
        if vmem(&current) <= budget {
            return;
        }
        let shrinkable = blocks.iter_mut().find(|(b, dim)| {
            let half = **b / 2;
            half >= 128 && half % 128 == 0 && dim % half == 0
        });
        match shrinkable {
            Some((b, _)) => **b /= 2,
            None => return, // the verifier reports the overflow with the numbers
        }
    }
}

/// Raises `kernel`'s scoped VMEM limit when its blocks need more than the default: to
/// the verifier's estimate of what libtpu needs (`verify::vmem_need`: padded buffers,
/// Mosaic's internal scratch, the calibrated margin) rounded up to a MiB, at most the
/// core's VMEM (past that the verifier reports the overflow).
pub fn fit_vmem_limit(mut kernel: tessera_dsl::Kernel, target: &tessera_dsl::Target) -> tessera_dsl::Kernel {
    let need = tessera_dsl::verify::vmem_need(&kernel, target);
    if need > tessera_dsl::verify::vmem_limit(&kernel, target) {
        kernel.vmem_limit_bytes = Some(need.next_multiple_of(1 << 20).min(target.vmem_bytes));
    }
    kernel
}

/// Lanes of a vreg: a block's last dim is padded to a multiple of this in VMEM.
pub const LANES: usize = 128;

/// Preferred f32 bytes per row block: large enough to amortise the per-step overhead,
/// small enough that a few temporaries of the block stay well inside VMEM.
pub const ROW_BLOCK_BYTES: usize = 1 << 20;

/// How a row op tiles `[m, n]`: `bm` rows by `bn` columns. `bn == n` is whole rows (a
/// row's reductions stay in one block); `bn < n` splits rows into column blocks of a
/// multiple of 128 lanes, for rows too wide for VMEM (see `wide_rows.rs`). The grid is
/// `m.div_ceil(bm)` (by `n.div_ceil(bn)`): a partial last block is legal, its rows
/// past `m` are garbage on read and dropped on write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTiles {
    pub bm: usize,
    pub bn: usize,
}

impl RowTiles {
    /// Blocks of about `target` f32 bytes *as laid out* (lanes padded to 128; a narrow
    /// `[m, 2]` costs 128 lanes a row, not 2), whole rows while `sub` of them fit in
    /// `limit` bytes. `bm` is a multiple of `sub` or all of `m`.
    pub fn new(m: usize, n: usize, sub: usize, target: usize, limit: usize) -> RowTiles {
        // Saturating: an absurd width must reach the verifier (shape-overflow), not panic here.
        let row_bytes = n.max(1).checked_next_multiple_of(LANES).unwrap_or(usize::MAX).saturating_mul(4);
        if sub.saturating_mul(row_bytes) <= limit {
            let rows = (target / row_bytes).max(sub) / sub * sub;
            RowTiles { bm: if m <= rows { m } else { rows }, bn: n }
        } else {
            let bn = (target / (4 * sub)).max(LANES) / LANES * LANES;
            RowTiles { bm: m.min(sub), bn }
        }
    }

    /// Whether a block spans whole rows of `n` columns.
    pub fn whole_rows(&self, n: usize) -> bool {
        self.bn >= n
    }
}

/// The tiles of a row op over `x: [m, n]` with `streams` operands blocked like `x`
/// (inputs and outputs): each is double-buffered by the pipeline and the body keeps
/// about as many f32 temporaries again, so `4 * streams` blocks must fit the target's
/// default scoped VMEM.
pub fn row_tiles(x: &tessera_dsl::Type, streams: usize, target: &tessera_dsl::Target) -> RowTiles {
    let m = x.shape.first().copied().unwrap_or(0);
    let n = x.shape.get(1).copied().unwrap_or(0);
    let limit = target.default_scoped_vmem_bytes / (4 * streams.max(1));
    RowTiles::new(m, n, target.tiling(x.dtype).0, ROW_BLOCK_BYTES.min(limit), limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_largest_aligned_divisor() {
        assert_eq!(pick_block(4096, 1024, 128), 1024);
        assert_eq!(pick_block(384, 1024, 128), 384);
        assert_eq!(pick_block(1536, 1024, 128), 768);
        assert_eq!(pick_block(1000, 512, 128), 1000);
    }

    #[test]
    fn row_tiles_pad_lanes_and_split_wide_rows() {
        let mib = 1 << 20;
        // [65536, 2] pads to 128 lanes: 512 B a row, so 2048 rows per 1 MiB block.
        assert_eq!(RowTiles::new(65536, 2, 8, mib, 2 * mib), RowTiles { bm: 2048, bn: 2 });
        assert_eq!(RowTiles::new(1024, 1024, 8, mib, 2 * mib), RowTiles { bm: 256, bn: 1024 });
        // Not a divisor: a partial last block rather than one block of every row.
        assert_eq!(RowTiles::new(1000, 1024, 8, mib, 2 * mib), RowTiles { bm: 256, bn: 1024 });
        assert_eq!(RowTiles::new(300, 640, 8, mib, 2 * mib), RowTiles { bm: 300, bn: 640 });
        // 8 rows of 65536 f32 are 2 MiB: still whole rows under a 2 MiB limit ...
        assert_eq!(RowTiles::new(64, 65536, 8, mib, 2 * mib), RowTiles { bm: 8, bn: 65536 });
        // ... but a [1, 1 << 20] row (32 MiB at 8 sublanes) is split into 32768-lane blocks.
        let t = RowTiles::new(1, 1 << 20, 8, mib, 2 * mib);
        assert_eq!(t, RowTiles { bm: 1, bn: 32768 });
        assert!(!t.whole_rows(1 << 20));
    }

    #[test]
    fn shrinks_until_budget() {
        let (mut a, mut b) = (1024, 1024);
        fit_blocks(&mut [(&mut a, 4096), (&mut b, 4096)], 512 * 1024, |x| x[0] * x[1]);
        assert_eq!((a, b), (512, 1024));
    }
}
