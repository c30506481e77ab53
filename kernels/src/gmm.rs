//! Grouped matmuls for mixture-of-experts layers (the megablox pair):
//!
//! - `gmm`:  `out[rows_g] = lhs[rows_g] @ rhs[g]` for every group `g`, `lhs [m, k]` with rows
//!   sorted by group, `rhs [g, k, n]` (or `[g, n, k]` with `transpose_rhs`);
//! - `tgmm`: `out[g] = lhs[rows_g]^T @ grad[rows_g]`, `out [g, k, n]` (the weight gradient).
//!
//! # Group metadata (computed on the device, passed as scalar prefetch)
//!
//! Rows are cut into m-tiles of `tm` rows. A *visit* is one (m-tile, group) pair whose row
//! ranges overlap; the grid walks the visits in row order, so a tile shared by two groups
//! is visited twice in a row. Four i32 arrays (plus two flags for `tgmm`) list them, read
//! by the index maps and the body. [`group_metadata_kernel`] computes them on the device,
//! a launch before the grouped kernel, so no call reads `group_sizes` back to the host
//! (on a TPU that read would stall every MoE layer and cut a deferred graph);
//! [`group_metadata`] is the same list computed sequentially on the host, its reference:
//!
//! | array | per visit |
//! |---|---|
//! | `visits` (`[1]`) | the number of visits: the visit dim's run-time extent |
//! | `group` | the group, selects the `rhs` block (`gmm`) or the `out` block (`tgmm`) |
//! | `tile` | the m-tile, selects the `lhs`/`grad` block (and `out` for `gmm`) |
//! | `row_lo`, `row_hi` | the group's rows `[lo, hi)`; rows of the tile outside are masked |
//! | `first`, `last` (`tgmm`) | first / last visit of the group: zero / store the accumulator |
//!
//! Non-empty groups overlap at most `tiles_m + G - 1` tiles in total (each group boundary
//! inside a tile adds one visit), so the visit axis has that static bound and the arrays
//! have static shapes: kernels are built from types alone, one compiled kernel per shape
//! whatever the group sizes. The visit axis is a *dynamic* grid dim (`dynamic(v, visits)`,
//! megablox's `num_active_tiles`): its run-time extent is the visit count, a fifth `[1]`
//! array passed first, so the steps past the last visit do not run at all (no step
//! overhead, no index-map evaluation). The arrays are still padded to the bound, the
//! padding repeating the last visit's tile and group with an empty row range (`lo == hi`)
//! and both flags 0, so a padded entry would be a no-op were it ever run.
//!
//! `tgmm` must write zeros for a group with no rows (the interpreter poisons, and a TPU
//! leaves garbage in, any output block never written), so its metadata also visits each
//! empty group once, with an empty row range, on the tile where the group would start
//! (as megablox's `visit_empty_groups`). `gmm` skips empty groups: they own no output rows.
//!
//! # Why the output stays correct when groups share a tile
//!
//! `gmm`'s grid is `[n-tiles, visits, k-tiles]`: for a fixed n-tile the visits run in row
//! order, so the visits of one output tile are consecutive and its window stays resident
//! across them. Each visit writes only its group's rows (`select(mask, new, old)`); the
//! window starts uninitialised, but every row of the tile belongs to a non-empty group
//! that visits it, so all rows are written before the window moves on. Rows past `m` in a
//! partial last tile are dropped on write-back. `tgmm`'s grid is `[k-tiles, n-tiles,
//! visits]` with the visits (the M reduction) last and `arbitrary`: a group's visits are
//! consecutive, so its output block is revisited only consecutively. The verifier cannot
//! check these maps (they read prefetch), so this ordering is the kernels' contract.

use rand::{rngs::StdRng, Rng};
use tessera_dsl::interp::Array;
use tessera_dsl::target::Generation;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::blocks::{fit_blocks, fit_vmem_limit, pick_block};
use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{result, Launch, Operand, Plan};

// ---- kernels ------------------------------------------------------------------------------

#[tpu_kernel(
    grid = [n.div_ceil(tn), dynamic(v, visits), k / tk],
    semantics = [parallel, arbitrary, arbitrary],
    lhs = block([tm, tk], |j, t, kk| [tile[t], kk]),
    rhs = block([None, if transpose_rhs { tn } else { tk }, if transpose_rhs { tk } else { tn }], |j, t, kk| [group[t], if transpose_rhs { j } else { kk }, if transpose_rhs { kk } else { j }]),
    out = block([tm, tn], |j, t, kk| [tile[t], j]),
    acc = scratch([tm, tn], f32),
)]
pub fn gmm_kernel(
    visits: Prefetch<1>,
    group: Prefetch<v>,
    tile: Prefetch<v>,
    row_lo: Prefetch<v>,
    row_hi: Prefetch<v>,
    lhs: In<m, k>,
    rhs: In<g, _, _>,
    out: Out<m, n>,
    acc: Scratch,
    tm: usize,
    tk: usize,
    tn: usize,
    transpose_rhs: bool,
) {
    let t = program_id(1);
    // Only the active visits run (the visit dim's extent is `visits`), and each owns rows.
    if program_id(2) == 0 {
        acc[..] = zeros([tm, tn], f32);
    }
    // `rhs` is `[g, k, n]`, or `[g, n, k]` stored transposed.
    if transpose_rhs {
        acc[..] += dot_t(lhs[..], rhs[..]);
    } else {
        acc[..] += dot(lhs[..], rhs[..]);
    }
    if program_id(2) == num_programs(2) - 1 {
        let row = iota([tm, tn], 0) + tile[t] * tm;
        // Rows of other groups keep what their own visit writes (or wrote).
        out[..] = select((row >= row_lo[t]) & (row < row_hi[t]), acc[..].cast(out.dtype), out[..]);
    }
}

#[tpu_kernel(
    grid = [k.div_ceil(tk), n.div_ceil(tn), dynamic(v, visits)],
    semantics = [parallel, parallel, arbitrary],
    lhs = block([tm, tk], |i, j, t| [tile[t], i]),
    grad = block([tm, tn], |i, j, t| [tile[t], j]),
    out = block([None, tk, tn], |i, j, t| [group[t], i, j]),
    acc = scratch([tk, tn], f32),
)]
pub fn tgmm_kernel(
    visits: Prefetch<1>,
    group: Prefetch<v>,
    tile: Prefetch<v>,
    row_lo: Prefetch<v>,
    row_hi: Prefetch<v>,
    first: Prefetch<v>,
    last: Prefetch<v>,
    lhs: In<m, k>,
    grad: In<m, n>,
    out: Out<g, k, n>,
    acc: Scratch,
    tm: usize,
    tk: usize,
    tn: usize,
) {
    let t = program_id(2);
    if first[t] == 1 {
        acc[..] = zeros([tk, tn], f32);
    }
    let lo = row_lo[t];
    let hi = row_hi[t];
    if lo < hi {
        // Zero the rows outside the group in both operands: M is contracted here, so a
        // foreign row would leak into the sum, and the rows past `m` of a partial last
        // tile are undefined (NaN * 0 is still NaN, hence both sides).
        let row0 = tile[t] * tm;
        let rk = iota([tm, tk], 0) + row0;
        let rn = iota([tm, tn], 0) + row0;
        let x = select((rk >= lo) & (rk < hi), lhs[..], 0.0);
        let dy = select((rn >= lo) & (rn < hi), grad[..], 0.0);
        acc[..] += dot_tn(x, dy);
    }
    if last[t] == 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

/// The visit list of `group_sizes` (`[1, g]`) computed on the device, so a call reads no
/// value back to the host: the same arrays as [`group_metadata`] for valid sizes, as
/// `[cap, 1]` columns plus the visit count `[1, 1]` (`first`/`last` are `tgmm`'s flags;
/// `gmm` ignores them).
///
/// Vectorised over a block of `bt` visits against all `g` groups, with no scan over
/// groups: per group its clamped row range `[start, end)` (prefix sums of the sizes), its
/// tile range and visit count `n`, and the prefix sums of `n` (`vin`, `vex` exclusive).
/// Visit `t` belongs to the group whose `[vex, vin)` holds it, which is the count of
/// groups with `vin <= t`; its other fields are picked from that group by a one-hot
/// lane sum. Work is `cap x g` per call (about 400 x 128 for 64k rows and 128 experts).
///
/// Sizes outside the contract (negative, or not summing to `m`) give metadata that stays
/// in bounds (negative sizes count as 0, ranges are clamped to `[0, m]`, tiles and groups
/// to theirs): wrong rows, never an out-of-bounds block. The CPU path refuses such sizes
/// (`check_sizes`); a device call cannot without a host read.
#[tpu_kernel(
    grid = [cap.div_ceil(bt)],
    semantics = [arbitrary],
    sizes = block([1, g], |i| [0, 0]),
    visits = block([1, 1], |i| [0, 0]),
    (group, tile, row_lo, row_hi, first, last) = block([bt, 1], |i| [i, 0]),
)]
pub fn group_metadata_kernel(
    sizes: In<1, g>,
    visits: Out<1, 1>,
    group: Out<cap, 1>,
    tile: Out<cap, 1>,
    row_lo: Out<cap, 1>,
    row_hi: Out<cap, 1>,
    first: Out<cap, 1>,
    last: Out<cap, 1>,
    m: usize,
    tm: usize,
    bt: usize,
    visit_empty: bool,
) {
    let s = sizes[..].max(0);
    let incl = s.cumsum(1);
    let end = incl.max(0).min(m as i32);
    let start = (incl - s).max(0).min(end);
    // Tile of a row: floor(row / tm) through f32 (no vector integer division on the VPU),
    // then corrected by one either way, exact for rows < 2^23 * tm.
    let inv = 1.0 / tm as f32;
    let q0 = (start.cast(f32) * inv).cast(i32);
    let q0 = select(q0 * (tm as i32) > start, q0 - 1, q0);
    let t0 = select((q0 + 1) * (tm as i32) <= start, q0 + 1, q0);
    let last_row = (end - 1).max(0);
    let q1 = (last_row.cast(f32) * inv).cast(i32);
    let q1 = select(q1 * (tm as i32) > last_row, q1 - 1, q1);
    let t1 = select((q1 + 1) * (tm as i32) <= last_row, q1 + 1, q1);
    let empty_visits = if visit_empty { 1 } else { 0 };
    let n = select(end > start, t1 - t0 + 1, empty_visits);
    let vin = n.cumsum(1);
    let vex = vin - n;
    let total = n.sum(1);
    visits[..] = total;
    let t = iota([bt, 1], 0) + program_id(0) * (bt as i32);
    // Padding visits repeat the last one's group and tile, with no rows and no flags.
    let tc = t.min((total - 1).max(0));
    let live = t < total;
    let owner = select(vin <= tc, 1, 0).sum(1).min(g as i32 - 1);
    let onehot = iota([bt, g], 1) == owner;
    let first_visit = select(onehot, vex.broadcast_to([bt, g]), 0).sum(1);
    let tile_of = select(onehot, t0.broadcast_to([bt, g]), 0).sum(1) + tc - first_visit;
    group[..] = owner;
    tile[..] = tile_of.max(0).min(m.div_ceil(tm) as i32 - 1);
    row_lo[..] = select(live, select(onehot, start.broadcast_to([bt, g]), 0).sum(1), 0);
    row_hi[..] = select(live, select(onehot, end.broadcast_to([bt, g]), 0).sum(1), 0);
    first[..] = select(live & (tc == first_visit), 1, 0);
    last[..] = select(live & (tc == select(onehot, vin.broadcast_to([bt, g]), 0).sum(1) - 1), 1, 0);
}

// ---- block sizes ----------------------------------------------------------------------------

/// Block sizes of a grouped matmul: `tm` rows per m-tile, `tk` of the contraction (`gmm`) or
/// of the output rows (`tgmm`), `tn` output columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GmmBlocks {
    pub tm: usize,
    pub tk: usize,
    pub tn: usize,
}

/// HBM bandwidth per chip (GB/s), for the m-tile rule.
fn hbm_gbps(target: &Target) -> f64 {
    match target.generation {
        Generation::V5e => 819.0,
        Generation::V5p => 2765.0,
        Generation::V6e => 1640.0,
        Generation::Tpu7x => 7370.0,
    }
}

/// The m-tile: the largest power-of-two multiple of 128 up to 1.5x the target's bf16
/// roofline ridge (peak flop/s over HBM byte/s: v5e 240, v5p 166, v6e 561, tpu7x 313), so
/// v5e 256, v5p 128, v6e 512, tpu7x 256. Each visit streams
/// a `[k, n]` expert block for `2 * tm` flops per element, so a smaller tile leaves the MXU
/// waiting on HBM, while a larger one only adds waste: every group boundary inside a tile
/// costs one extra tile of compute. A problem smaller than that takes all rows.
fn m_tile(m: usize, target: &Target) -> usize {
    let ridge = target.peak_bf16_tflops * 1e12 / (hbm_gbps(target) * 1e9);
    let mut tm = 128;
    while (2 * tm) as f64 <= ridge * 1.5 && tm < 1024 {
        tm *= 2;
    }
    if m <= tm { m } else { tm }
}

/// Blocks for `gmm` on `target`.
///
/// Rule: `tm` from the roofline ridge ([`m_tile`]); `tk`, `tn` as `matmul`: up to 1024,
/// multiples of the MXU edge dividing the problem (the contraction must divide exactly:
/// a partial K block would add undefined values to every row). Then halve `tk`, `tn`,
/// `tm` in turn until the double-buffered `lhs`, `rhs` and `out` windows plus the f32
/// `[tm, tn]` accumulator fit 3/4 of the default scoped VMEM.
pub fn gmm_blocks(m: usize, k: usize, n: usize, dtype: DType, target: &Target) -> GmmBlocks {
    grouped_blocks(m, k, n, dtype, false, target)
}

/// Blocks for `tgmm` on `target`: `tm` as `gmm`; the `[tk, tn]` output tile up to
/// 1024 x 1024 (its reuse of each streamed row grows with both); halve `tk`, `tn`, `tm`
/// until the double-buffered `lhs`, `grad`, `out` windows plus the f32 `[tk, tn]`
/// accumulator fit 3/4 of the default scoped VMEM.
pub fn tgmm_blocks(m: usize, k: usize, n: usize, dtype: DType, target: &Target) -> GmmBlocks {
    grouped_blocks(m, k, n, dtype, true, target)
}

/// The rule of both: the windows are `[tm, tk]`, `[tk, tn]` and `[tm, tn]` either way; the
/// accumulator is the output tile, `[tm, tn]` for gmm and `[tk, tn]` for tgmm (`acc_tk`).
fn grouped_blocks(m: usize, k: usize, n: usize, dtype: DType, acc_tk: bool, target: &Target) -> GmmBlocks {
    let lane = target.tiling(dtype).1;
    let mut tm = m_tile(m, target);
    let mut tk = pick_block(k, 1024, lane.max(target.mxu.min(k)));
    let mut tn = pick_block(n, 1024, lane.max(target.mxu.min(n)));
    let vmem = |tm: usize, tk: usize, tn: usize| {
        let windows = target.padded_bytes(dtype, &[tm, tk]) + target.padded_bytes(dtype, &[tk, tn]) + target.padded_bytes(dtype, &[tm, tn]);
        2 * windows + target.padded_bytes(DType::F32, &[if acc_tk { tk } else { tm }, tn])
    };
    fit_blocks(&mut [(&mut tk, k), (&mut tn, n), (&mut tm, m.next_multiple_of(128))], target.default_scoped_vmem_bytes * 3 / 4, |b| vmem(b[2], b[0], b[1]));
    GmmBlocks { tm, tk, tn }
}

// ---- host-side metadata -------------------------------------------------------------------

/// The visit list of a grouped matmul (see the module docs), padded to [`visit_capacity`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMetadata {
    pub group: Vec<i32>,
    pub tile: Vec<i32>,
    pub row_lo: Vec<i32>,
    pub row_hi: Vec<i32>,
    pub first: Vec<i32>,
    pub last: Vec<i32>,
    /// Visits that do work (the rest are padding).
    pub visits: usize,
}

impl GroupMetadata {
    fn push(&mut self, group: usize, tile: usize, lo: usize, hi: usize, first: bool, last: bool) {
        self.group.push(group as i32);
        self.tile.push(tile as i32);
        self.row_lo.push(lo as i32);
        self.row_hi.push(hi as i32);
        self.first.push(first as i32);
        self.last.push(last as i32);
    }

    /// The arrays as kernel arguments: the visit count (`[1]`, the visit dim's run-time
    /// extent), the four shared arrays, plus the flags for `tgmm`.
    pub fn arrays(&self, with_flags: bool) -> Vec<Array> {
        let n = self.group.len();
        let mut v = vec![self.group.clone(), self.tile.clone(), self.row_lo.clone(), self.row_hi.clone()];
        if with_flags {
            v.extend([self.first.clone(), self.last.clone()]);
        }
        let count = Array::from_i32(&[1], vec![self.visits as i32]);
        std::iter::once(count).chain(v.into_iter().map(|a| Array::from_i32(&[n], a))).collect()
    }
}

/// The static length of the visit axis: `tiles_m + groups - 1` bounds the visits of both
/// kernels (`tgmm`'s empty-group visits included, since at least one group is non-empty).
pub fn visit_capacity(m: usize, groups: usize, tm: usize) -> usize {
    m.div_ceil(tm) + groups.max(1) - 1
}

/// The visits of `group_sizes` (non-negative, summing to `m`) over m-tiles of `tm` rows;
/// `visit_empty` adds one empty visit per group without rows (`tgmm`).
pub fn group_metadata(group_sizes: &[i32], m: usize, tm: usize, visit_empty: bool) -> GroupMetadata {
    let tiles = m.div_ceil(tm);
    let cap = visit_capacity(m, group_sizes.len(), tm);
    let mut md = GroupMetadata { group: Vec::with_capacity(cap), tile: Vec::with_capacity(cap), row_lo: Vec::new(), row_hi: Vec::new(), first: Vec::new(), last: Vec::new(), visits: 0 };
    let mut start = 0usize;
    for (g, &size) in group_sizes.iter().enumerate() {
        let end = start + size.max(0) as usize;
        if end > start {
            let (t0, t1) = (start / tm, (end - 1) / tm);
            for t in t0..=t1 {
                md.push(g, t, start, end, t == t0, t == t1);
            }
        } else if visit_empty {
            md.push(g, (start / tm).min(tiles - 1), start, start, true, true);
        }
        start = end;
    }
    md.visits = md.group.len();
    debug_assert!(md.visits <= cap, "{} visits exceed the bound {cap}", md.visits);
    let (g, t) = (md.group.last().copied().unwrap_or(0), md.tile.last().copied().unwrap_or(0));
    while md.group.len() < cap {
        md.push(g as usize, t as usize, 0, 0, false, false);
    }
    md
}

// ---- input checks ---------------------------------------------------------------------------

fn err(op: &str, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
    KernelError::new(op, subject, rule, message, help)
}

/// Checks the types of a grouped matmul: `a [m, k]`, `b` rank `b_rank`, `group_sizes [g]`
/// int32, float dtypes equal. Returns `(m, g)`.
fn check_types(op: &str, a: (&str, &Type), b: (&str, &Type), b_rank: usize, group_sizes: &Type) -> Result<(usize, usize), KernelError> {
    let (an, at) = a;
    let (bn, bt) = b;
    if at.rank() != 2 {
        return Err(err(op, format!("operand `{an}`"), "operand-shape", format!("`{an}` has shape {:?}", at.shape), format!("pass `{an}` as a 2-D [rows, features] array")));
    }
    if bt.rank() != b_rank {
        return Err(err(op, format!("operand `{bn}`"), "operand-shape", format!("`{bn}` has shape {:?}, rank {b_rank} expected", bt.shape), "see the op's signature"));
    }
    if !at.dtype.is_float() || at.dtype != bt.dtype {
        return Err(err(op, format!("operand `{bn}`"), "operand-dtype", format!("`{an}` is {} and `{bn}` is {}", at.dtype, bt.dtype), "pass f32 or bf16 operands of one dtype"));
    }
    if group_sizes.dtype != DType::I32 || group_sizes.rank() != 1 || group_sizes.shape[0] == 0 {
        return Err(err(op, "operand `group_sizes`", "operand-dtype", format!("`group_sizes` is {group_sizes}"), "pass group sizes as a non-empty 1-D int32 array"));
    }
    Ok((at.shape[0], group_sizes.shape[0]))
}

/// The host check on the values: sizes are non-negative and sum to `m`.
pub fn check_sizes(op: &str, group_sizes: &Array, m: usize) -> Result<Vec<i32>, KernelError> {
    let sizes = group_sizes.as_i32().ok_or_else(|| err(op, "input `group_sizes`", "operand-dtype", format!("holds {} data", group_sizes.dtype), "pass an int32 array"))?.to_vec();
    if let Some((g, s)) = sizes.iter().enumerate().find(|(_, &s)| s < 0) {
        return Err(err(op, "input `group_sizes`", "group-sizes", format!("group {g} has size {s}"), "group sizes are row counts, >= 0"));
    }
    let total: i64 = sizes.iter().map(|&s| s as i64).sum();
    if total != m as i64 {
        return Err(err(op, "input `group_sizes`", "group-sizes", format!("the group sizes sum to {total}, but `lhs` has {m} rows"), "make sum(group_sizes) equal the number of rows (rows sorted by group); sharded over experts (DTensor lhs rows Shard(0) with group_sizes and rhs Shard(0)), each rank's rows must be exactly its experts' groups"));
    }
    Ok(sizes)
}

/// Blocks are positive, the in-kernel contraction block (`gmm`'s `tk`) divides its dim, and
/// each block is a multiple of the block tile (rows for `tm`, columns for `tk` and `tn`, as
/// the `[tm, tk]`, `[tk, tn]` and `[tm, tn]` windows take them) or its whole dim of
/// `[m, k, n]`. Errors name the op's static `tiling` (what sets explicit blocks).
fn check_blocks(op: &str, blocks: GmmBlocks, [m, k, n]: [usize; 3], (sub, lane): (usize, usize), contraction: Option<(&str, usize, usize)>) -> Result<(), KernelError> {
    if blocks.tm == 0 || blocks.tk == 0 || blocks.tn == 0 {
        return Err(err(op, "argument `tiling`", "block-shape", format!("{} has a zero block", tiling(blocks)), "use positive block sizes [tm, tk, tn]"));
    }
    if let Some((name, dim, block)) = contraction.filter(|&(_, dim, block)| dim % block != 0) {
        return Err(err(op, "argument `tiling`", "block-shape", format!("{}: the contraction dim {name} = {dim} is not a multiple of tk = {block}", tiling(blocks)), format!("use a tk that divides {dim} (a partial contraction block would add undefined values), or tiling=None for the defaults")));
    }
    for (name, block, dim, tile) in [("tm", blocks.tm, m, sub), ("tk", blocks.tk, k, lane), ("tn", blocks.tn, n, lane)] {
        if !block.is_multiple_of(tile) && block != dim {
            let d = &name[1..];
            return Err(err(op, "argument `tiling`", "block-tiling", format!("{}: {name} = {block} is neither a multiple of {tile} nor {d} = {dim}", tiling(blocks)), format!("use a {name} that is a multiple of {tile}, or {dim}; or tiling=None for the defaults")));
        }
    }
    Ok(())
}

fn meta_types(cap: usize, n: usize) -> Vec<Type> {
    vec![Type::vector(DType::I32, &[cap]); n]
}

// ---- building and running -----------------------------------------------------------------

/// The `gmm` kernel for these types and blocks (metadata shapes depend on types only).
pub fn build_gmm(lhs: &Type, rhs: &Type, group_sizes: &Type, transpose_rhs: bool, blocks: GmmBlocks, target: &Target) -> Result<Kernel, KernelError> {
    let (m, g) = check_types("gmm", ("lhs", lhs), ("rhs", rhs), 3, group_sizes)?;
    let k = lhs.shape[1];
    let (k_rhs, n) = if transpose_rhs { (rhs.shape[2], rhs.shape[1]) } else { (rhs.shape[1], rhs.shape[2]) };
    if rhs.shape[0] != g || k_rhs != k {
        let layout = if transpose_rhs { "[g, n, k]" } else { "[g, k, n]" };
        return Err(err("gmm", "operand `rhs`", "operand-shape", format!("`rhs` {:?} does not match `lhs` {:?} and {g} groups", rhs.shape, lhs.shape), format!("pass rhs as {layout} with g = len(group_sizes) and k = lhs.shape[1]")));
    }
    check_blocks("gmm", blocks, [m, k, n], target.block_tile(lhs.dtype), Some(("k", k, blocks.tk)))?;
    let md = meta_types(visit_capacity(m, g, blocks.tm), 4);
    let out = Type::vector(lhs.dtype, &[m, n]);
    let GmmBlocks { tm, tk, tn } = blocks;
    let kernel = gmm_kernel(Type::vector(DType::I32, &[1]), md[0].clone(), md[1].clone(), md[2].clone(), md[3].clone(), lhs.clone(), rhs.clone(), out, tm, tk, tn, transpose_rhs)?;
    Ok(fit_vmem_limit(kernel, target))
}

/// The `tgmm` kernel for these types and blocks.
pub fn build_tgmm(lhs: &Type, grad: &Type, group_sizes: &Type, blocks: GmmBlocks, target: &Target) -> Result<Kernel, KernelError> {
    let (m, g) = check_types("tgmm", ("lhs", lhs), ("grad", grad), 2, group_sizes)?;
    if grad.shape[0] != m {
        return Err(err("tgmm", "operand `grad`", "operand-shape", format!("`grad` has {} rows, `lhs` {m}", grad.shape[0]), "pass lhs [m, k] and grad [m, n] with the same rows"));
    }
    let (k, n) = (lhs.shape[1], grad.shape[1]);
    check_blocks("tgmm", blocks, [m, k, n], target.block_tile(lhs.dtype), None)?;
    let md = meta_types(visit_capacity(m, g, blocks.tm), 6);
    let out = Type::vector(lhs.dtype, &[g, k, n]);
    let GmmBlocks { tm, tk, tn } = blocks;
    let kernel = tgmm_kernel(Type::vector(DType::I32, &[1]), md[0].clone(), md[1].clone(), md[2].clone(), md[3].clone(), md[4].clone(), md[5].clone(), lhs.clone(), grad.clone(), out, tm, tk, tn)?;
    Ok(fit_vmem_limit(kernel, target))
}

/// The default blocks of `gmm` for these types.
pub fn default_gmm_blocks(lhs: &Type, rhs: &Type, transpose_rhs: bool, target: &Target) -> GmmBlocks {
    let n = rhs.shape.get(if transpose_rhs { 1 } else { 2 }).copied().unwrap_or(1);
    gmm_blocks(lhs.shape.first().copied().unwrap_or(1), lhs.shape.get(1).copied().unwrap_or(1), n, lhs.dtype, target)
}

/// The default blocks of `tgmm` for these types.
pub fn default_tgmm_blocks(lhs: &Type, grad: &Type, target: &Target) -> GmmBlocks {
    tgmm_blocks(lhs.shape.first().copied().unwrap_or(1), lhs.shape.get(1).copied().unwrap_or(1), grad.shape.get(1).copied().unwrap_or(1), lhs.dtype, target)
}

fn tiling(blocks: GmmBlocks) -> String {
    format!("tiling=[{}, {}, {}]", blocks.tm, blocks.tk, blocks.tn)
}

fn flag(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// `gmm` with explicit blocks.
pub fn gmm_with_blocks(exec: &dyn Executor, lhs: &Array, rhs: &Array, group_sizes: &Array, transpose_rhs: bool, blocks: GmmBlocks, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "gmm", &[lhs, rhs, group_sizes], &format!("transpose_rhs={}, {}", flag(transpose_rhs), tiling(blocks)), target)
}

/// `gmm(lhs, rhs, group_sizes)`: `out[rows_g] = lhs[rows_g] @ rhs[g]` (`rhs[g]^T` with
/// `transpose_rhs`), with `target`'s default blocks.
pub fn gmm(exec: &dyn Executor, lhs: &Array, rhs: &Array, group_sizes: &Array, transpose_rhs: bool, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "gmm", &[lhs, rhs, group_sizes], &format!("transpose_rhs={}", flag(transpose_rhs)), target)
}

/// `tgmm` with explicit blocks.
pub fn tgmm_with_blocks(exec: &dyn Executor, lhs: &Array, grad: &Array, group_sizes: &Array, blocks: GmmBlocks, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "tgmm", &[lhs, grad, group_sizes], &tiling(blocks), target)
}

/// `tgmm(lhs, grad, group_sizes)`: `out[g] = lhs[rows_g]^T @ grad[rows_g]`, `[g, k, n]`
/// (zeros for a group without rows), with default blocks.
pub fn tgmm(exec: &dyn Executor, lhs: &Array, grad: &Array, group_sizes: &Array, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "tgmm", &[lhs, grad, group_sizes], "", target)
}

// ---- ops ------------------------------------------------------------------------------------

/// The `tiling=[tm, tk, tn]` static (torch_xla's name), or `default`.
fn blocks_of(c: &Call, default: GmmBlocks) -> Result<GmmBlocks, KernelError> {
    match c.statics.ints("tiling") {
        None => Ok(default),
        // Block sizes are i32 literals in the kernels.
        Some(&[tm, tk, tn]) if [tm, tk, tn].iter().all(|&b| (1..=i32::MAX as i64).contains(&b)) => Ok(GmmBlocks { tm: tm as usize, tk: tk as usize, tn: tn as usize }),
        Some(other) => Err(c.err("argument `tiling`", "option-value", format!("tiling = {other:?}"), "pass three block sizes [tm, tk, tn] in 1..=2^31 - 1, or None for the target's defaults")),
    }
}

/// The visit block of the metadata kernel: all visits when they are few, else a multiple
/// of 8 keeping each `[bt, g]` i32 temporary near 512 KiB of VMEM.
fn metadata_block(cap: usize, groups: usize) -> usize {
    let lanes = groups.div_ceil(128) * 128;
    let bt = ((128 << 10) / lanes / 8 * 8).max(8);
    if cap <= bt { cap } else { bt }
}

/// The kernel computing the visits of `groups` groups over `m` rows in m-tiles of `tm`
/// (`visit_empty`: `tgmm`'s, one visit per empty group) on the device.
pub fn build_group_metadata(m: usize, groups: usize, tm: usize, visit_empty: bool, target: &Target) -> Result<Kernel, KernelError> {
    if m == 0 || groups == 0 || tm == 0 {
        return Err(err("group_metadata", "input `group_sizes`", "operand-shape", format!("{m} rows, {groups} groups, m-tile {tm}"), "pass at least one row, one group and a positive m-tile"));
    }
    let cap = visit_capacity(m, groups, tm);
    let col = Type::vector(DType::I32, &[cap, 1]);
    let kernel = group_metadata_kernel(
        Type::vector(DType::I32, &[1, groups]),
        Type::vector(DType::I32, &[1, 1]),
        col.clone(),
        col.clone(),
        col.clone(),
        col.clone(),
        col.clone(),
        col,
        m,
        tm,
        metadata_block(cap, groups),
        visit_empty,
    )?;
    Ok(fit_vmem_limit(kernel, target))
}

/// A launch of the metadata kernel for `a` (`[m, _]`) at m-tile `tm`.
fn metadata_launch(c: &Call, m: usize, sizes: &Type, tm: usize, visit_empty: bool) -> Result<Launch, KernelError> {
    let groups = sizes.shape[0];
    let kernel = build_group_metadata(m, groups, tm, visit_empty, c.target)?;
    Ok(Launch::new(kernel, vec![c.input("group_sizes", Type::vector(DType::I32, &[1, groups]))?]))
}

/// Launch `meta`'s outputs as a grouped kernel's prefetch operands: the visit count, then
/// `arrays` of the visit arrays.
fn meta_operands(meta: usize, arrays: usize, cap: usize) -> Vec<Operand> {
    std::iter::once(result(meta, 0, Type::vector(DType::I32, &[1]))).chain((1..=arrays).map(|i| result(meta, i, Type::vector(DType::I32, &[cap])))).collect()
}

/// A `gmm` launch of `a @ b[g]` (`b[g]^T`), its metadata launch `meta`'s outputs.
fn gmm_launch(c: &Call, a: (&str, &Type), b: (&str, &Type), sizes: &Type, transpose_rhs: bool, blocks: GmmBlocks, meta: usize) -> Result<Launch, KernelError> {
    let kernel = build_gmm(a.1, b.1, sizes, transpose_rhs, blocks, c.target)?;
    let cap = visit_capacity(a.1.shape[0], sizes.shape[0], blocks.tm);
    let mut args = meta_operands(meta, 4, cap);
    args.extend([c.input(a.0, a.1.clone())?, c.input(b.0, b.1.clone())?]);
    Ok(Launch::new(kernel, args))
}

/// A `tgmm` launch of `a^T @ b` per group, its metadata launch `meta`'s outputs.
fn tgmm_launch(c: &Call, a: (&str, &Type), b: (&str, &Type), sizes: &Type, blocks: GmmBlocks, meta: usize) -> Result<Launch, KernelError> {
    let kernel = build_tgmm(a.1, b.1, sizes, blocks, c.target)?;
    let cap = visit_capacity(a.1.shape[0], sizes.shape[0], blocks.tm);
    let mut args = meta_operands(meta, 6, cap);
    args.extend([c.input(a.0, a.1.clone())?, c.input(b.0, b.1.clone())?]);
    Ok(Launch::new(kernel, args))
}

/// The plan's check of `group_sizes` where values are at hand (CPU tensors): the device
/// path computes the metadata without reading them (see [`group_metadata_kernel`]).
fn sizes_check(c: &Call, plan: Plan, m: usize) -> Result<Plan, KernelError> {
    let op = c.op;
    Ok(plan.with_check(&[c.index("group_sizes")?], Box::new(move |v| check_sizes(op, v[0], m).map(|_| ()))))
}

/// Ranks, dtypes and the shared dims (`m`, `k`, `n`, `g`) are the op's contract, checked
/// before the plan builders run; the kernel builders check what is left (one float dtype,
/// at least one group, blocks).
fn plan_gmm(c: &Call) -> Result<Plan, KernelError> {
    let (lhs, rhs, sizes) = (c.tensor("lhs")?.clone(), c.tensor("rhs")?.clone(), c.tensor("group_sizes")?.clone());
    let transpose = c.statics.bool("transpose_rhs");
    let blocks = blocks_of(c, default_gmm_blocks(&lhs, &rhs, transpose, c.target))?;
    let meta = metadata_launch(c, lhs.shape[0], &sizes, blocks.tm, false)?;
    let launch = gmm_launch(c, ("lhs", &lhs), ("rhs", &rhs), &sizes, transpose, blocks, 0)?;
    grouped_plan(c, meta, launch, lhs.shape[0])
}

/// The plan of one grouped launch after its metadata launch.
fn grouped_plan(c: &Call, meta: Launch, launch: Launch, m: usize) -> Result<Plan, KernelError> {
    let results = vec![result(1, 0, launch.outputs[0].clone())];
    sizes_check(c, Plan::new(c.op, c.target, vec![meta, launch], results), m)
}

fn plan_tgmm(c: &Call) -> Result<Plan, KernelError> {
    let (lhs, grad, sizes) = (c.tensor("lhs")?.clone(), c.tensor("grad")?.clone(), c.tensor("group_sizes")?.clone());
    let blocks = blocks_of(c, default_tgmm_blocks(&lhs, &grad, c.target))?;
    let meta = metadata_launch(c, lhs.shape[0], &sizes, blocks.tm, true)?;
    let launch = tgmm_launch(c, ("lhs", &lhs), ("grad", &grad), &sizes, blocks, 0)?;
    grouped_plan(c, meta, launch, lhs.shape[0])
}

/// `dlhs = gmm(dout, rhs, !transpose_rhs)`; `drhs = tgmm(lhs, dout)` (`tgmm(dout, lhs)`
/// for a transposed rhs), each after its own metadata launch (their m-tiles and tgmm's
/// empty-group visits differ).
fn plan_gmm_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (lhs, rhs, sizes, dout) = (c.tensor("lhs")?.clone(), c.tensor("rhs")?.clone(), c.tensor("group_sizes")?.clone(), c.tensor("dout")?.clone());
    let t = c.statics.bool("transpose_rhs");
    if dout.dtype != lhs.dtype {
        return Err(c.err("input `dout`", "operand-dtype", format!("dout is {dout}, lhs is {lhs}"), format!("pass the gradient of gmm's output, of lhs's dtype ({})", lhs.dtype)));
    }
    let m = lhs.shape[0];
    let gb = default_gmm_blocks(&dout, &rhs, !t, c.target);
    let (a, b) = if t { (("dout", &dout), ("lhs", &lhs)) } else { (("lhs", &lhs), ("dout", &dout)) };
    let tb = default_tgmm_blocks(a.1, b.1, c.target);
    let launches = vec![
        metadata_launch(c, m, &sizes, gb.tm, false)?,
        gmm_launch(c, ("dout", &dout), ("rhs", &rhs), &sizes, !t, gb, 0)?,
        metadata_launch(c, m, &sizes, tb.tm, true)?,
        tgmm_launch(c, a, b, &sizes, tb, 2)?,
    ];
    let results = vec![result(1, 0, launches[1].outputs[0].clone()), result(3, 0, launches[3].outputs[0].clone())];
    sizes_check(c, Plan::new(c.op, c.target, launches, results), m)
}

// ---- library entries ------------------------------------------------------------------------

/// Random group sizes summing to `m`: uniform cut points (so boundaries fall anywhere in
/// a tile), and with three or more groups one group emptied (its rows go to a neighbour).
pub fn random_group_sizes(m: usize, groups: usize, rng: &mut StdRng) -> Vec<i32> {
    let mut cuts: Vec<usize> = (0..groups.saturating_sub(1)).map(|_| rng.gen_range(0..=m)).collect();
    cuts.sort_unstable();
    let mut sizes: Vec<i32> = Vec::with_capacity(groups);
    let mut prev = 0;
    for c in cuts.into_iter().chain([m]) {
        sizes.push((c - prev) as i32);
        prev = c;
    }
    if groups >= 3 {
        let e = rng.gen_range(0..groups);
        let into = if e + 1 < groups { e + 1 } else { e - 1 };
        sizes[into] += sizes[e];
        sizes[e] = 0;
    }
    sizes
}

fn random_inputs(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let a = harness::random_array(dtype, &shapes[0], rng);
    let b = harness::random_array(dtype, &shapes[1], rng);
    let groups = shapes[2][0];
    let sizes = random_group_sizes(shapes[0][0], groups, rng);
    vec![a, b, Array::from_i32(&[groups], sizes)]
}

fn sizes_of(a: &Array) -> Vec<usize> {
    a.as_i32().unwrap_or(&[]).iter().map(|&s| s.max(0) as usize).collect()
}

fn ref_gmm(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let t = s.bool("transpose_rhs");
    let n = a[1].shape[if t { 1 } else { 2 }];
    vec![reference::gmm(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &sizes_of(&a[2]), a[0].shape[1], n, t)]
}

fn ref_tgmm(a: &[Array], _: &Statics) -> Vec<Vec<f64>> {
    vec![reference::tgmm(&a[0].to_f64_vec(), &a[1].to_f64_vec(), &sizes_of(&a[2]), a[0].shape[1], a[1].shape[1])]
}

/// [`random_inputs`] plus a random `dout [m, n]`.
fn random_bwd_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let mut a = random_inputs(shapes, dtype, s, rng);
    a.push(harness::random_array(dtype, &shapes[3], rng));
    a
}

/// `dlhs[r] = dout[r] @ rhs[g]^T`; `drhs[g] = lhs[rows_g]^T @ dout[rows_g]` (transposed
/// for a transposed rhs), from the forward references' definitions.
fn ref_gmm_bwd(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let t = s.bool("transpose_rhs");
    let (lhs, rhs, sizes, dout) = (a[0].to_f64_vec(), a[1].to_f64_vec(), sizes_of(&a[2]), a[3].to_f64_vec());
    let (m, k) = (a[0].shape[0], a[0].shape[1]);
    let n = a[3].shape[1];
    let dlhs = reference::gmm(&dout, &rhs, &sizes, n, k, !t);
    let drhs = if t { reference::tgmm(&dout, &lhs, &sizes, n, k) } else { reference::tgmm(&lhs, &dout, &sizes, k, n) };
    debug_assert_eq!(dlhs.len(), m * k);
    vec![dlhs, drhs]
}

const LHS: Input = Input { name: "lhs", dims: "[m, k]", kind: Kind::Float };
const GROUP_SIZES: Input = Input { name: "group_sizes", dims: "[g]", kind: Kind::Int32 };
/// `[g, k, n]`, or `[g, n, k]` with `transpose_rhs`.
const RHS: Input = Input { name: "rhs", dims: "[g, transpose_rhs ? n : k, transpose_rhs ? k : n]", kind: Kind::Float };
const GMM_CASES: &[Case] = &[
    Case { name: "default", statics: "", shapes: &[&[1024, 512], &[8, 512, 512], &[8]] },
    Case { name: "alt", statics: "", shapes: &[&[1000, 768], &[6, 768, 384], &[6]] },
    Case { name: "transposed", statics: "transpose_rhs=True", shapes: &[&[1024, 512], &[8, 384, 512], &[8]] },
];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "gmm", doc: "grouped matmul (MoE experts): out[rows of group g] = lhs[rows] @ rhs[g] (rhs[g]^T with transpose_rhs, rhs [g, n, k]); group metadata computed on the device as scalar prefetch, visits only (m-tile, group) pairs that own rows", schema: "(Tensor lhs, Tensor rhs, Tensor group_sizes, bool transpose_rhs=False, int[]? tiling=None) -> Tensor", plan: plan_gmm, reference: Some(ref_gmm), knobs: crate::tune::GMM,
        inputs: &[LHS, RHS, GROUP_SIZES], outputs: &[Output { name: "out", shape: "[lhs.0, transpose_rhs ? rhs.1 : rhs.2]", dtype: "lhs" }],
        backward: Some(Backward { op: "gmm_bwd", args: "lhs, rhs, group_sizes, d_out, transpose_rhs", grads: &["lhs", "rhs"] }),
        cases: GMM_CASES, random: Some(random_inputs), ..Op::EMPTY
    },
    Op {
        name: "tgmm", doc: "transposed grouped matmul (MoE weight gradient): out[g] = lhs[rows of g]^T @ grad[rows of g], zeros for empty groups; m-tiles are the reduction axis", schema: "(Tensor lhs, Tensor grad, Tensor group_sizes, int[]? tiling=None) -> Tensor", plan: plan_tgmm, reference: Some(ref_tgmm), knobs: crate::tune::GMM,
        inputs: &[LHS, Input { name: "grad", dims: "[m, n]", kind: Kind::Float }, GROUP_SIZES], outputs: &[Output { name: "out", shape: "[group_sizes.0, lhs.1, grad.1]", dtype: "lhs" }],
        cases: &[Case { name: "default", statics: "", shapes: &[&[1024, 512], &[1024, 512], &[8]] }, Case { name: "alt", statics: "", shapes: &[&[1000, 768], &[1000, 384], &[6]] }], random: Some(random_inputs), ..Op::EMPTY
    },
    Op {
        name: "gmm_bwd", doc: "(dlhs, drhs) of gmm: dlhs = gmm(dout, rhs) with the other transpose, drhs = tgmm(lhs, dout) (tgmm(dout, lhs) for a transposed rhs)", schema: "(Tensor lhs, Tensor rhs, Tensor group_sizes, Tensor dout, bool transpose_rhs=False) -> (Tensor, Tensor)", plan: plan_gmm_bwd, reference: Some(ref_gmm_bwd),
        inputs: &[LHS, RHS, GROUP_SIZES, Input { name: "dout", dims: "[m, n]", kind: Kind::Float }], outputs: &[Output { name: "dlhs", shape: "lhs", dtype: "lhs" }, Output { name: "drhs", shape: "rhs", dtype: "rhs" }],
        cases: &[ Case { name: "default", statics: "", shapes: &[&[1024, 512], &[8, 512, 384], &[8], &[1024, 384]] }, Case { name: "transposed", statics: "transpose_rhs=True", shapes: &[&[1000, 768], &[6, 384, 768], &[6], &[1000, 384]] }, ], random: Some(random_bwd_inputs), ..Op::EMPTY
    },
];

/// Independent f64 references: per-group loops over row-major data, sharing nothing with
/// the kernels or their metadata.
pub mod reference {
    /// `out[r] = lhs[r] @ rhs[g(r)]` (`rhs[g(r)]^T` if `transpose_rhs`), `rhs` of
    /// `[g, k, n]` (or `[g, n, k]`), rows of group `g` consecutive in order.
    pub fn gmm(lhs: &[f64], rhs: &[f64], group_sizes: &[usize], k: usize, n: usize, transpose_rhs: bool) -> Vec<f64> {
        let m = lhs.len() / k;
        let mut out = vec![0.0; m * n];
        let mut row = 0;
        for (g, &size) in group_sizes.iter().enumerate() {
            let w = &rhs[g * k * n..(g + 1) * k * n];
            for r in row..row + size {
                for j in 0..n {
                    let mut s = 0.0;
                    for p in 0..k {
                        let b = if transpose_rhs { w[j * k + p] } else { w[p * n + j] };
                        s += lhs[r * k + p] * b;
                    }
                    out[r * n + j] = s;
                }
            }
            row += size;
        }
        out
    }

    /// `out[g] = lhs[rows_g]^T @ grad[rows_g]`, `[g, k, n]`; zeros for empty groups.
    pub fn tgmm(lhs: &[f64], grad: &[f64], group_sizes: &[usize], k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; group_sizes.len() * k * n];
        let mut row = 0;
        for (g, &size) in group_sizes.iter().enumerate() {
            let o = &mut out[g * k * n..(g + 1) * k * n];
            for r in row..row + size {
                for p in 0..k {
                    let a = lhs[r * k + p];
                    for j in 0..n {
                        o[p * n + j] += a * grad[r * n + j];
                    }
                }
            }
            row += size;
        }
        out
    }
}
