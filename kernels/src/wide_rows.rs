//! Row ops over rows too wide for one VMEM block (`[1, 1 << 20]` f32 is 32 MiB once its
//! single row is padded to 8 sublanes): two passes over column blocks of the rows.
//!
//! The first pass (`*_stats`, grid `[rows, columns]` with the column axis `arbitrary`)
//! folds each row's column blocks into per-row statistics held in f32 VMEM scratch and
//! writes them once, `[m, 1]` f32, at the row's last column block. The second pass
//! (`*_apply`, both axes `parallel`) maps every block with its rows' statistics. It reads
//! the input twice from HBM where the whole-row kernel reads it once: the price of any
//! row length. Columns past `n` in the last block are garbage on read: masked before
//! every reduction, and their writes are dropped. The plans choose these kernels only
//! when [`RowTiles`] says whole rows do not fit.
//!
//! RMSNorm of a shape the blocks divide runs both passes in one launch instead
//! ([`rmsnorm_pipelined_kernel`]): the row stays in HBM and two nested pipelines
//! (`for j in pipeline(..)`, Pallas' `emit_pipeline`) stream its column sub-blocks, the
//! statistics kept in vregs between them.
//!
//! Numerics as in the whole-row kernels: f32 math, pairwise sums within a block,
//! blocks combined in order; LayerNorm merges per-block (count, mean, M2) with Chan's
//! update, so a large row mean does not cancel (no E[x^2] - E[x]^2).

use tessera_dsl::{KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::blocks::RowTiles;
use crate::op::Call;
use crate::plan::{result, Launch, Operand, Plan};

/// A finite "minus infinity" for masked columns: `exp(MASKED - m)` is 0 and never NaN.
const MASKED: f32 = f32::MIN;

// ---- statistics (first pass) --------------------------------------------------------------

/// Which lanes of column block `j` lie inside the `n` columns.
#[tpu_fn]
fn inside(j: Value, bm: usize, bn: usize, n: usize) -> Value {
    iota([bm, bn], 1) + j * (bn as i32) < (n as i32)
}

/// Per row: the maximum `mx` and `sum(exp(x - mx))`, online over column blocks.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    x = block([bm, bn], |i, j| [i, j]),
    (mx, sum) = block([bm, 1], |i, j| [i, 0]),
    (m_run, s_run) = scratch([bm, 1], f32),
)]
pub fn softmax_stats_kernel(x: In<m, n>, mx: Out<m, 1>, sum: Out<m, 1>, m_run: Scratch, s_run: Scratch, bm: usize, bn: usize) {
    let j = program_id(1);
    if j == 0 {
        m_run[..] = full([bm, 1], f32, MASKED);
        s_run[..] = zeros([bm, 1], f32);
    }
    let mut v = x[..].cast(f32);
    if !n.is_multiple_of(bn) {
        v = select(inside(j, bm, bn, n), v, MASKED);
    }
    let m_old = m_run[..];
    let m_new = m_old.max(v.reduce_max(1));
    s_run[..] = s_run[..] * (m_old - m_new).exp() + (v - m_new).exp().sum(1);
    m_run[..] = m_new;
    if j == num_programs(1) - 1 {
        mx[..] = m_run[..];
        sum[..] = s_run[..];
    }
}

/// Per row: `sum(x^2)`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    x = block([bm, bn], |i, j| [i, j]),
    sum_sq = block([bm, 1], |i, j| [i, 0]),
    acc = scratch([bm, 1], f32),
)]
pub fn sum_sq_kernel(x: In<m, n>, sum_sq: Out<m, 1>, acc: Scratch, bm: usize, bn: usize) {
    let j = program_id(1);
    if j == 0 {
        acc[..] = zeros([bm, 1], f32);
    }
    let mut v = x[..].cast(f32);
    if !n.is_multiple_of(bn) {
        v = select(inside(j, bm, bn, n), v, 0.0);
    }
    acc[..] += (v * v).sum(1);
    if j == num_programs(1) - 1 {
        sum_sq[..] = acc[..];
    }
}

/// Per row: a shift, the mean of the shifted row and `rsqrt(var + eps)` (biased
/// variance). Each column block's (count, mean, M2) is merged into the running ones
/// (Chan et al.), of values shifted by the row's first block mean: the running mean is
/// then small, so f32 holds it to far below one ulp of the row mean, and the apply pass
/// subtracts in two steps, `(x - shift) - mean` (torch's single f32 mean is off by up
/// to half an ulp of the row mean).
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    x = block([bm, bn], |i, j| [i, j]),
    (shift, mean, rstd) = block([bm, 1], |i, j| [i, 0]),
    (shift_run, mean_run, m2_run) = scratch([bm, 1], f32),
)]
pub fn moments_kernel(x: In<m, n>, shift: Out<m, 1>, mean: Out<m, 1>, rstd: Out<m, 1>, shift_run: Scratch, mean_run: Scratch, m2_run: Scratch, bm: usize, bn: usize, eps: f32) {
    let j = program_id(1);
    // Columns merged before this block, and this block's (the last may be partial).
    let seen = (j * (bn as i32)).cast(f32);
    let count = ((n as i32) - j * (bn as i32)).min(bn as i32).cast(f32);
    let partial = !n.is_multiple_of(bn);
    let mut v = x[..].cast(f32);
    if partial {
        v = select(inside(j, bm, bn, n), v, 0.0);
    }
    if j == 0 {
        shift_run[..] = v.sum(1) / count;
        mean_run[..] = zeros([bm, 1], f32);
        m2_run[..] = zeros([bm, 1], f32);
    }
    // The block's mean and centred values by the corrected two-pass algorithm (as
    // `norms::centre`), on the shifted values, lanes past `n` kept at 0.
    let mut y = v - shift_run[..];
    if partial {
        y = select(inside(j, bm, bn, n), y, 0.0);
    }
    let rough = y.sum(1) / count;
    let mut first = y - rough;
    if partial {
        first = select(inside(j, bm, bn, n), first, 0.0);
    }
    let fix = first.sum(1) / count;
    let block_mean = rough + fix;
    let mut centred = first - fix;
    if partial {
        centred = select(inside(j, bm, bn, n), centred, 0.0);
    }
    let total = seen + count;
    let delta = block_mean - mean_run[..];
    mean_run[..] = mean_run[..] + delta * (count / total);
    m2_run[..] = m2_run[..] + (centred * centred).sum(1) + delta * delta * (seen * count / total);
    if j == num_programs(1) - 1 {
        shift[..] = shift_run[..];
        mean[..] = mean_run[..];
        rstd[..] = (m2_run[..] * (1.0 / n as f32) + eps).rsqrt();
    }
}

/// Per row of `rmsnorm_bwd`: `r = rsqrt(mean(x^2) + eps)` and `c = mean(dy * w * x)`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    (x, dy) = block([bm, bn], |i, j| [i, j]),
    w = block([1, bn], |i, j| [0, j]),
    (r, c) = block([bm, 1], |i, j| [i, 0]),
    (ss_run, c_run) = scratch([bm, 1], f32),
)]
pub fn rmsnorm_bwd_stats_kernel(x: In<m, n>, w: In<1, n>, dy: In<m, n>, r: Out<m, 1>, c: Out<m, 1>, ss_run: Scratch, c_run: Scratch, bm: usize, bn: usize, eps: f32) {
    let j = program_id(1);
    if j == 0 {
        ss_run[..] = zeros([bm, 1], f32);
        c_run[..] = zeros([bm, 1], f32);
    }
    let mut v = x[..].cast(f32);
    let mut gw = dy[..].cast(f32) * w[..].cast(f32);
    if !n.is_multiple_of(bn) {
        let keep = inside(j, bm, bn, n);
        v = select(keep, v, 0.0);
        gw = select(keep, gw, 0.0);
    }
    ss_run[..] += (v * v).sum(1);
    c_run[..] += (gw * v).sum(1);
    if j == num_programs(1) - 1 {
        r[..] = (ss_run[..] * (1.0 / n as f32) + eps).rsqrt();
        c[..] = c_run[..] * (1.0 / n as f32);
    }
}

// ---- apply (second pass) ------------------------------------------------------------------

#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, parallel],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    (mx, sum) = block([bm, 1], |i, j| [i, 0]),
)]
pub fn softmax_apply_kernel(x: In<m, n>, mx: In<m, 1>, sum: In<m, 1>, out: Out<m, n>, bm: usize, bn: usize) {
    out[..] = ((x[..].cast(f32) - mx[..]).exp() / sum[..]).cast(out.dtype);
}

/// `x * rsqrt(sum_sq / n + eps) * w`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, parallel],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    w = block([1, bn], |i, j| [0, j]),
    sum_sq = block([bm, 1], |i, j| [i, 0]),
)]
pub fn rmsnorm_apply_kernel(x: In<m, n>, sum_sq: In<m, 1>, w: In<1, n>, out: Out<m, n>, bm: usize, bn: usize, eps: f32) {
    let r = (sum_sq[..] * (1.0 / n as f32) + eps).rsqrt();
    out[..] = (x[..].cast(f32) * r * w[..].cast(f32)).cast(out.dtype);
}

/// `((x - shift) - mean) * rstd * w + b`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, parallel],
    (x, out) = block([bm, bn], |i, j| [i, j]),
    (w, b) = block([1, bn], |i, j| [0, j]),
    (shift, mean, rstd) = block([bm, 1], |i, j| [i, 0]),
)]
pub fn layernorm_apply_kernel(x: In<m, n>, shift: In<m, 1>, mean: In<m, 1>, rstd: In<m, 1>, w: In<1, n>, b: In<1, n>, out: Out<m, n>, bm: usize, bn: usize) {
    let centred = (x[..].cast(f32) - shift[..]) - mean[..];
    out[..] = (centred * rstd[..] * w[..].cast(f32) + b[..].cast(f32)).cast(out.dtype);
}

/// `dx = r * dy * w - x * r^3 * c` per block, and `dw = sum over rows of dy * x * r`
/// accumulated along the (inner, `arbitrary`) row axis for each column block.
#[tpu_kernel(
    grid = [n.div_ceil(bn), m.div_ceil(bm)],
    semantics = [parallel, arbitrary],
    (x, dy, dx) = block([bm, bn], |j, i| [i, j]),
    (w, dw) = block([1, bn], |j, i| [0, j]),
    (r, c) = block([bm, 1], |j, i| [i, 0]),
    dw_acc = scratch([1, bn], f32),
)]
pub fn rmsnorm_bwd_apply_kernel(x: In<m, n>, w: In<1, n>, dy: In<m, n>, r: In<m, 1>, c: In<m, 1>, dx: Out<m, n>, dw: Out<1, n>, dw_acc: Scratch, bm: usize, bn: usize) {
    let i = program_id(1);
    let v = x[..].cast(f32);
    let g = dy[..].cast(f32);
    let rr = r[..];
    dx[..] = (rr * g * w[..].cast(f32) - v * (rr * rr * rr) * c[..]).cast(dx.dtype);
    if i == 0 {
        dw_acc[..] = zeros([1, bn], f32);
    }
    let mut part = g * v * rr;
    if !m.is_multiple_of(bm) {
        // Rows past `m` in the last row block are garbage: keep them out of the sum.
        part = select(iota([bm, bn], 0) + i * (bm as i32) < (m as i32), part, 0.0);
    }
    dw_acc[..] += part.sum(0);
    if i == num_programs(1) - 1 {
        dw[..] = dw_acc[..].cast(dw.dtype);
    }
}

/// Per row of `layernorm_bwd`, from the moments: `c1 = mean(dy * w)` and
/// `c2 = mean(dy * w * xhat)`, `xhat = ((x - shift) - mean) * rstd`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    (x, dy) = block([bm, bn], |i, j| [i, j]),
    w = block([1, bn], |i, j| [0, j]),
    (shift, mean, rstd, c1, c2) = block([bm, 1], |i, j| [i, 0]),
    (c1_run, c2_run) = scratch([bm, 1], f32),
)]
pub fn layernorm_bwd_stats_kernel(x: In<m, n>, w: In<1, n>, dy: In<m, n>, shift: In<m, 1>, mean: In<m, 1>, rstd: In<m, 1>, c1: Out<m, 1>, c2: Out<m, 1>, c1_run: Scratch, c2_run: Scratch, bm: usize, bn: usize) {
    let j = program_id(1);
    if j == 0 {
        c1_run[..] = zeros([bm, 1], f32);
        c2_run[..] = zeros([bm, 1], f32);
    }
    let xhat = ((x[..].cast(f32) - shift[..]) - mean[..]) * rstd[..];
    let mut gw = dy[..].cast(f32) * w[..].cast(f32);
    let mut gx = gw * xhat;
    if !n.is_multiple_of(bn) {
        let keep = inside(j, bm, bn, n);
        gw = select(keep, gw, 0.0);
        gx = select(keep, gx, 0.0);
    }
    c1_run[..] += gw.sum(1);
    c2_run[..] += gx.sum(1);
    if j == num_programs(1) - 1 {
        c1[..] = c1_run[..] * (1.0 / n as f32);
        c2[..] = c2_run[..] * (1.0 / n as f32);
    }
}

/// `dx = rstd * (dy * w - c1 - xhat * c2)` per block, and `dw`, `db` (sums over rows of
/// `dy * xhat`, `dy`) accumulated along the (inner, `arbitrary`) row axis per column block.
#[tpu_kernel(
    grid = [n.div_ceil(bn), m.div_ceil(bm)],
    semantics = [parallel, arbitrary],
    (x, dy, dx) = block([bm, bn], |j, i| [i, j]),
    (w, dw, db) = block([1, bn], |j, i| [0, j]),
    (shift, mean, rstd, c1, c2) = block([bm, 1], |j, i| [i, 0]),
    (dw_acc, db_acc) = scratch([1, bn], f32),
)]
pub fn layernorm_bwd_apply_kernel(x: In<m, n>, w: In<1, n>, dy: In<m, n>, shift: In<m, 1>, mean: In<m, 1>, rstd: In<m, 1>, c1: In<m, 1>, c2: In<m, 1>, dx: Out<m, n>, dw: Out<1, n>, db: Out<1, n>, dw_acc: Scratch, db_acc: Scratch, bm: usize, bn: usize) {
    let i = program_id(1);
    let xhat = ((x[..].cast(f32) - shift[..]) - mean[..]) * rstd[..];
    let mut g = dy[..].cast(f32);
    dx[..] = (rstd[..] * (g * w[..].cast(f32) - c1[..] - xhat * c2[..])).cast(dx.dtype);
    if i == 0 {
        dw_acc[..] = zeros([1, bn], f32);
        db_acc[..] = zeros([1, bn], f32);
    }
    let mut part = g * xhat;
    if !m.is_multiple_of(bm) {
        // Rows past `m` in the last row block are garbage: keep them out of the sums.
        let live = iota([bm, bn], 0) + i * (bm as i32) < (m as i32);
        part = select(live, part, 0.0);
        g = select(live, g, 0.0);
    }
    dw_acc[..] += part.sum(0);
    db_acc[..] += g.sum(0);
    if i == num_programs(1) - 1 {
        dw[..] = dw_acc[..].cast(dw.dtype);
        db[..] = db_acc[..].cast(db.dtype);
    }
}

/// Per row: `sum(dy * y)` (softmax's backward statistic).
#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, arbitrary],
    (y, dy) = block([bm, bn], |i, j| [i, j]),
    dot = block([bm, 1], |i, j| [i, 0]),
    acc = scratch([bm, 1], f32),
)]
pub fn softmax_bwd_stats_kernel(y: In<m, n>, dy: In<m, n>, dot: Out<m, 1>, acc: Scratch, bm: usize, bn: usize) {
    let j = program_id(1);
    if j == 0 {
        acc[..] = zeros([bm, 1], f32);
    }
    let mut v = y[..].cast(f32) * dy[..].cast(f32);
    if !n.is_multiple_of(bn) {
        v = select(inside(j, bm, bn, n), v, 0.0);
    }
    acc[..] += v.sum(1);
    if j == num_programs(1) - 1 {
        dot[..] = acc[..];
    }
}

#[tpu_kernel(
    grid = [m.div_ceil(bm), n.div_ceil(bn)],
    semantics = [parallel, parallel],
    (y, dy, dx) = block([bm, bn], |i, j| [i, j]),
    dot = block([bm, 1], |i, j| [i, 0]),
)]
pub fn softmax_bwd_apply_kernel(y: In<m, n>, dy: In<m, n>, dot: In<m, 1>, dx: Out<m, n>, bm: usize, bn: usize) {
    dx[..] = (y[..].cast(f32) * (dy[..].cast(f32) - dot[..])).cast(dx.dtype);
}

// ---- plans ----------------------------------------------------------------------------------

fn stats(x: &Type) -> Type {
    Type::vector(tessera_dsl::DType::F32, &[x.shape[0], 1])
}

fn check_split(op: &str, tiles: RowTiles, x: &Type) -> Result<(usize, usize), KernelError> {
    if tiles.bn >= x.shape[1] {
        return Err(KernelError::new(op, "blocks", "row-tiles", format!("column block {} spans the whole row of {x}", tiles.bn), "use the whole-row kernel (report this as a library bug)"));
    }
    Ok((tiles.bm, tiles.bn))
}

/// `softmax(x)` over rows split into column blocks; `x: [m, n]` (given as `x_in`).
pub fn softmax(c: &Call, x: &Type, x_in: Operand, tiles: RowTiles, shape: Vec<usize>) -> Result<Plan, KernelError> {
    let (bm, bn) = check_split(c.op, tiles, x)?;
    let s = stats(x);
    let stats = Launch::new(softmax_stats_kernel(x.clone(), s.clone(), s.clone(), bm, bn)?, vec![x_in.clone()]);
    let apply = Launch::new(softmax_apply_kernel(x.clone(), s.clone(), s.clone(), x.clone(), bm, bn)?, vec![x_in, result(0, 0, s.clone()), result(0, 1, s)]);
    Ok(Plan::new(c.op, c.target, vec![stats, apply], vec![result(1, 0, Type::vector(x.dtype, &shape))]))
}

/// The three launches of `layernorm_bwd` over column blocks (moments, per-row statistics,
/// apply), appended to `launches`; returns the index of the launch whose outputs are
/// `(dx, dw, db)`.
pub fn layernorm_bwd_launches(launches: &mut Vec<Launch>, x: &Type, ins: [Operand; 3], w: &Type, eps: f32, tiles: RowTiles, op: &str) -> Result<usize, KernelError> {
    let (bm, bn) = check_split(op, tiles, x)?;
    let s = stats(x);
    let [x_in, w_in, dy_in] = ins;
    let first = launches.len();
    launches.push(Launch::new(moments_kernel(x.clone(), s.clone(), s.clone(), s.clone(), bm, bn, eps)?, vec![x_in.clone()]));
    let moments = |k: usize| result(first, k, s.clone());
    let stats_kernel = layernorm_bwd_stats_kernel(x.clone(), w.clone(), x.clone(), s.clone(), s.clone(), s.clone(), s.clone(), s.clone(), bm, bn)?;
    launches.push(Launch::new(stats_kernel, vec![x_in.clone(), w_in.clone(), dy_in.clone(), moments(0), moments(1), moments(2)]));
    let apply = layernorm_bwd_apply_kernel(x.clone(), w.clone(), x.clone(), s.clone(), s.clone(), s.clone(), s.clone(), s.clone(), x.clone(), w.clone(), w.clone(), bm, bn)?;
    launches.push(Launch::new(apply, vec![x_in, w_in, dy_in, moments(0), moments(1), moments(2), result(first + 1, 0, s.clone()), result(first + 1, 1, s)]));
    Ok(first + 2)
}

/// softmax's `dx` from `(y, dy)` over rows split into column blocks.
pub fn softmax_bwd(c: &Call, y: &Type, ins: [Operand; 2], tiles: RowTiles, shape: Vec<usize>) -> Result<Plan, KernelError> {
    let (bm, bn) = check_split(c.op, tiles, y)?;
    let s = stats(y);
    let [y_in, dy_in] = ins;
    let dot = Launch::new(softmax_bwd_stats_kernel(y.clone(), y.clone(), s.clone(), bm, bn)?, vec![y_in.clone(), dy_in.clone()]);
    let apply = Launch::new(softmax_bwd_apply_kernel(y.clone(), y.clone(), s.clone(), y.clone(), bm, bn)?, vec![y_in, dy_in, result(0, 0, s)]);
    Ok(Plan::new(c.op, c.target, vec![dot, apply], vec![result(1, 0, Type::vector(y.dtype, &shape))]))
}

/// `rmsnorm(x) * w` of rows too wide for VMEM in one launch, HBM to HBM: per row block,
/// a nested pipeline over column sub-blocks sums the squares, a second scales the row
/// (the same ops in the same order as `sum_sq_kernel` + `rmsnorm_apply_kernel`, so the
/// same bits). Saves the second launch, the `[m, 1]` round trip through HBM and the
/// apply pass's spills: libtpu's static estimate, bf16 `[8, 262144]`, two launches
/// 28,354 cycles (with what XLA adds around them) vs 23,934 on v5e, 19,495 vs 16,134 on
/// v6e. Needs `bm | m` and `bn | n` (no partial sub-blocks).
#[tpu_kernel(grid = [m / bm])]
pub fn rmsnorm_pipelined_kernel(x: Any<m, n>, w: Any<one, n>, out: AnyOut<m, n>, bm: usize, bn: usize, eps: f32) {
    let i = program_id(0);
    let mut ss = zeros([bm, 1], f32);
    for j in pipeline(n / bn) {
        let v = pipe_in(x, [bm, bn], [i, j]).cast(f32);
        ss = ss + (v * v).sum(1);
    }
    let r = (ss * (1.0 / n as f32) + eps).rsqrt();
    for j in pipeline(n / bn) {
        let v = pipe_in(x, [bm, bn], [i, j]).cast(f32);
        let g = pipe_in(w, [1, bn], [0, j]).cast(f32);
        pipe_out(out, [bm, bn], [i, j], (v * r * g).cast(out.dtype));
    }
}

/// The launches of `rmsnorm(x) * w` over column blocks, appended to `launches` (`x` may be
/// an earlier launch's result); returns the output operand (launch-relative). One
/// pipelined launch ([`rmsnorm_pipelined_kernel`]) when the blocks divide the shape and it
/// verifies for `target`, else two (`sum_sq_kernel`, then `rmsnorm_apply_kernel`).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_launches(launches: &mut Vec<Launch>, x: &Type, x_in: Operand, w: &Type, w_in: Operand, eps: f32, tiles: RowTiles, op: &str, target: &Target) -> Result<usize, KernelError> {
    let (bm, bn) = check_split(op, tiles, x)?;
    let first = launches.len();
    if x.shape[0] % bm == 0 && x.shape[1] % bn == 0 {
        let k = crate::blocks::fit_vmem_limit(rmsnorm_pipelined_kernel(x.clone(), w.clone(), x.clone(), bm, bn, eps)?, target);
        if tessera_dsl::verify::verify(&k, target).is_ok() {
            launches.push(Launch::new(k, vec![x_in, w_in]));
            return Ok(first);
        }
    }
    let s = stats(x);
    launches.push(Launch::new(sum_sq_kernel(x.clone(), s.clone(), bm, bn)?, vec![x_in.clone()]));
    launches.push(Launch::new(rmsnorm_apply_kernel(x.clone(), s.clone(), w.clone(), x.clone(), bm, bn, eps)?, vec![x_in, result(first, 0, s), w_in]));
    Ok(first + 1)
}

/// `layernorm(x) * w + b` over column blocks.
pub fn layernorm(c: &Call, x: &Type, ins: [Operand; 3], w: &Type, eps: f32, tiles: RowTiles, shape: Vec<usize>) -> Result<Plan, KernelError> {
    let (bm, bn) = check_split(c.op, tiles, x)?;
    let s = stats(x);
    let [x_in, w_in, b_in] = ins;
    let moments = Launch::new(moments_kernel(x.clone(), s.clone(), s.clone(), s.clone(), bm, bn, eps)?, vec![x_in.clone()]);
    let apply = layernorm_apply_kernel(x.clone(), s.clone(), s.clone(), s.clone(), w.clone(), w.clone(), x.clone(), bm, bn)?;
    let apply = Launch::new(apply, vec![x_in, result(0, 0, s.clone()), result(0, 1, s.clone()), result(0, 2, s), w_in, b_in]);
    Ok(Plan::new(c.op, c.target, vec![moments, apply], vec![result(1, 0, Type::vector(x.dtype, &shape))]))
}

/// The two launches of `rmsnorm_bwd` over column blocks, appended to `launches`; returns
/// the index of the launch whose outputs are `(dx, dw)`.
pub fn rmsnorm_bwd_launches(launches: &mut Vec<Launch>, x: &Type, ins: [Operand; 3], w: &Type, eps: f32, tiles: RowTiles, op: &str) -> Result<usize, KernelError> {
    let (bm, bn) = check_split(op, tiles, x)?;
    let s = stats(x);
    let [x_in, w_in, dy_in] = ins;
    let first = launches.len();
    launches.push(Launch::new(rmsnorm_bwd_stats_kernel(x.clone(), w.clone(), x.clone(), s.clone(), s.clone(), bm, bn, eps)?, vec![x_in.clone(), w_in.clone(), dy_in.clone()]));
    let apply = rmsnorm_bwd_apply_kernel(x.clone(), w.clone(), x.clone(), s.clone(), s.clone(), x.clone(), w.clone(), bm, bn)?;
    launches.push(Launch::new(apply, vec![x_in, w_in, dy_in, result(first, 0, s.clone()), result(first, 1, s)]));
    Ok(first + 1)
}
