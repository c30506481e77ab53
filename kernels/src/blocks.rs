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

/// Rows per block for a row-wise kernel over `[m, n]`: about `target_bytes` of f32 per
/// block, a multiple of `sub` that divides `m` (or all of `m`).
pub fn row_block(m: usize, n: usize, sub: usize, target_bytes: usize) -> usize {
    let rows = (target_bytes / (4 * n.max(1))).max(sub);
    pick_block(m, rows, sub)
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
    fn shrinks_until_budget() {
        let (mut a, mut b) = (1024, 1024);
        fit_blocks(&mut [(&mut a, 4096), (&mut b, 4096)], 512 * 1024, |x| x[0] * x[1]);
        assert_eq!((a, b), (512, 1024));
    }
}
