//! Splash attention: flash attention over a block-sparse mask built on the host once per
//! mask (JAX's `splash_attention`'s design), forward and backward.
//!
//! # The mask and its metadata
//!
//! A mask says which key each query sees: `visible(h, r, c)` over `[Hm, Sq, Skv]`, `Hm` 1
//! (one mask for every head) or `H` (a mask per query head). [`MaskInfo::build`] cuts it into
//! `[bq, bk]` blocks and classifies each: **skip** (no visible pair: never fetched, never
//! computed), **full** (every pair visible: no mask is built or applied), **partial** (its
//! bits are one of the `mask_blocks`, deduplicated: a causal mask at `bq = bk` has one). The
//! kernels read three arrays, the op's tensors:
//!
//! - `mask_blocks`: int8 `[nb, bq, bk]`, the distinct partial blocks (1 = visible); their
//!   shape gives the kernels' blocks. At least one block (all zeros when none is partial).
//! - `fwd_info`: int32 `[3, Hm, nq, steps]`, for each (mask head, q block) the kv blocks to
//!   visit in order: plane 0 the kv block, plane 1 its kind (1 partial, 2 full, 0 a padding
//!   step), plane 2 the partial block's index in `mask_blocks`. `steps` is the most kv blocks
//!   any q block visits: the grid's last axis. Padding steps and full blocks repeat the
//!   previous step's kv block / mask block, so the pipeline issues no DMA for them.
//! - `bwd_info`: int32 `[3, Hm, nk, steps_q]`, the transpose: for each (mask head, kv
//!   block) the q blocks that see it (the dkv kernel's walk).
//!
//! All three are scalar prefetch (SMEM) or plain inputs: no value is read on the host per
//! call. The index maps clamp every block index into its array, so metadata that was not
//! built by [`MaskInfo::build`] can give wrong values but never reads outside an operand.
//!
//! Array bounds are the kernels', not the mask's: keys past `Skv` of a ragged last kv block
//! and queries past `Sq` are masked (or zeroed) in-kernel whatever the metadata says, as in
//! [`crate::attention`].
//!
//! # Kernels
//!
//! The forward and the dq kernel walk grid `(B, H, nq, steps)`, the dkv kernel `(B, Hkv, nk,
//! G, steps_q)`; their bodies are flash attention's ([`crate::attention`]: lane-replicated
//! softmax state, NaN/inf semantics of math attention over the visible keys, segment ids,
//! soft cap, GQA) with the block pair and its kind taken from the metadata. A full block
//! without segment ids takes the unmasked path (no iota, no select, no nonfinite
//! bookkeeping); a partial one reads its int8 bits.
//!
//! # Limits
//!
//! The metadata lives in SMEM (1 MiB on every generation, see the `smem-budget` rule): a
//! per-head mask over long sequences at small blocks can exceed it, and the verifier says so.
//! [`MaskInfo::build`] evaluates the mask at every (head, query, key): `Hm * Sq * Skv` calls,
//! once per mask.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::attention::{
    cap_of, check_cap, dkv_step, dq_step, dummy_segments, finish_lse, finish_o, finite_scale, holds_nonfinite, logits, masked_dkv_step, masked_dq_step, nonfinite_fixup, online_softmax, rows_before, segment_keep, segment_operands, state_lanes, visible, SOFTMAX_MAX_START, zero_nonfinite, AttentionParams, SegmentIds,
};
use crate::blocks::fit_vmem_limit;
use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{host, result, single, Launch, Operand, Plan};

/// A block's kind in the metadata.
pub const SKIP: i32 = 0;
pub const PARTIAL: i32 = 1;
pub const FULL: i32 = 2;

// ---- kernels ------------------------------------------------------------------------------

/// Which logits of a visited block count: the pairs inside the arrays (and, with `rows`, the
/// queries too) whose bit is set. `bits + (kind - 1)` is the bits in a partial block and
/// nonzero everywhere in a full one, whose `mask` window is a stale block, never a
/// meaningful one. (Segment ids are the caller's.)
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
fn keep_of(bits: Value, kind: Value, q_start: Value, kv_start: Value, bq: usize, bk: usize, sq: usize, skv: usize, rows: bool) -> Value {
    visible(q_start, kv_start, bq, bk, sq, skv, rows, sq, skv) & ((bits.cast(i32) + (kind - 1)) != 0)
}

#[tpu_kernel(
    grid = [bsz, heads, sq.div_ceil(bq), steps],
    semantics = [parallel, parallel, parallel, arbitrary],
    (q, o) = block([None, None, bq, d], |b, h, i, j| [b, h, i, 0]),
    (k, v) = block([None, None, bk, d], |b, h, i, j| [b, h / (heads / kv_heads), min(max(info[(0, h * usize::from(per_head), i, j)], 0), skv.div_ceil(bk) - 1), 0]),
    mask = block([None, bq, bk], |b, h, i, j| [min(max(info[(2, h * usize::from(per_head), i, j)], 0), nb - 1), 0, 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, h, i, j| [b * usize::from(segmented), i * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, h, i, j| [b * usize::from(segmented), 0, min(max(info[(0, h * usize::from(per_head), i, j)], 0), skv.div_ceil(bk) - 1) * usize::from(segmented)]),
    lse = block([None, None, bq, 1], |b, h, i, j| [b, h, i, 0]),
    (m_run, l_run) = scratch([bq, state_lanes(bk, d)], f32),
    acc = scratch([bq, d], f32),
)]
#[rustfmt::skip]
pub fn splash_attention_fwd_kernel(
    info: Prefetch<3, hm, nblk, steps>,
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, mask: In<nb, bq, bk>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    o: Out<bsz, heads, sq, d>, lse: Out<bsz, heads, sq, 1>, m_run: Scratch, l_run: Scratch, acc: Scratch,
    per_head: bool, segmented: bool, sm_scale: f32, soft_cap: f32, save_lse: bool,
) {
    let h = program_id(1);
    let i = program_id(2);
    let j = program_id(3);
    let lanes = state_lanes(bk, d);
    if j == 0 {
        m_run[..] = full([bq, lanes], f32, SOFTMAX_MAX_START);
        l_run[..] = zeros([bq, lanes], f32);
        acc[..] = zeros([bq, d], f32);
    }
    let mh = h * i32::from(per_head);
    let kind = info[(1, mh, i, j)];
    if kind > 0 {
        let kv_block = info[(0, mh, i, j)];
        let q_start = i * (bq as i32);
        let kv_start = kv_block * (bk as i32);
        let ragged_kv = !skv.is_multiple_of(bk) & (kv_block == (skv.div_ceil(bk) - 1) as i32);
        let needs_mask = segmented | (kind == PARTIAL) | ragged_kv;
        // A masked block steps over v with its nonfinite values zeroed; if it held any,
        // [`nonfinite_fixup`] adds what they give the queries that see them (the reduction is
        // paid by masked blocks only, and the step does not wait for it). Each branch
        // computes from the refs, so no score tile stays live across it.
        if needs_mask {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let keep = segment_keep(keep_of(mask[..], kind, q_start, kv_start, bq, bk, sq, skv, false), q_seg[..], kv_seg[..], segmented);
            let vb = rows_before(v[..], kv_start, bk, d, skv);
            let (m_new, l_new, acc_new, _p) = online_softmax(select(keep, s, f32::NEG_INFINITY), zero_nonfinite(vb), m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            m_run[..] = m_new;
            l_run[..] = l_new;
            acc[..] = acc_new;
            if holds_nonfinite(vb) {
                let keep = segment_keep(keep_of(mask[..], kind, q_start, kv_start, bq, bk, sq, skv, false), q_seg[..], kv_seg[..], segmented);
                acc[..] = nonfinite_fixup(logits(q[..], k[..], sm_scale, soft_cap), keep, rows_before(v[..], kv_start, bk, d, skv), m_run[..], acc[..], lanes, bk);
            }
        } else {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let (m_new, l_new, acc_new, _p) = online_softmax(s, v[..], m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            m_run[..] = m_new;
            l_run[..] = l_new;
            acc[..] = acc_new;
        }
    }
    if j == num_programs(3) - 1 {
        o[..] = finish_o(l_run[..], acc[..], lanes, d).cast(o.dtype);
        if save_lse {
            lse[..] = finish_lse(m_run[(.., 0..1)], l_run[(.., 0..1)]);
        }
    }
}

/// dk, dv: kv blocks outside; the group's query heads and the q blocks that see the kv block
/// (`bwd_info`) inside.
#[tpu_kernel(
    grid = [bsz, kv_heads, skv.div_ceil(bk), heads / kv_heads, steps],
    semantics = [parallel, parallel, parallel, arbitrary, arbitrary],
    (q, dout) = block([None, None, bq, d], |b, kh, j, g, t| [b, kh * (heads / kv_heads) + g, min(max(info[(0, (kh * (heads / kv_heads) + g) * usize::from(per_head), j, t)], 0), sq.div_ceil(bq) - 1), 0]),
    (k, v, dk, dv) = block([None, None, bk, d], |b, kh, j, g, t| [b, kh, j, 0]),
    mask = block([None, bq, bk], |b, kh, j, g, t| [min(max(info[(2, (kh * (heads / kv_heads) + g) * usize::from(per_head), j, t)], 0), nb - 1), 0, 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, kh, j, g, t| [b * usize::from(segmented), min(max(info[(0, (kh * (heads / kv_heads) + g) * usize::from(per_head), j, t)], 0), sq.div_ceil(bq) - 1) * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, kh, j, g, t| [b * usize::from(segmented), 0, j * usize::from(segmented)]),
    (lse, di) = block([None, None, bq, 1], |b, kh, j, g, t| [b, kh * (heads / kv_heads) + g, min(max(info[(0, (kh * (heads / kv_heads) + g) * usize::from(per_head), j, t)], 0), sq.div_ceil(bq) - 1), 0]),
    (dk_acc, dv_acc) = scratch([bk, d], f32),
)]
#[rustfmt::skip]
pub fn splash_attention_dkv_kernel(
    info: Prefetch<3, hm, nblk, steps>,
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, mask: In<nb, bq, bk>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    dout: In<bsz, heads, sq, d>, lse: In<bsz, heads, sq, 1>, di: In<bsz, heads, sq, 1>,
    dk: Out<bsz, kv_heads, skv, d>, dv: Out<bsz, kv_heads, skv, d>, dk_acc: Scratch, dv_acc: Scratch,
    per_head: bool, segmented: bool, sm_scale: f32, soft_cap: f32,
) {
    let kh = program_id(1);
    let j = program_id(2);
    let g = program_id(3);
    let t = program_id(4);
    if (g == 0) & (t == 0) {
        dk_acc[..] = zeros([bk, d], f32);
        dv_acc[..] = zeros([bk, d], f32);
    }
    let mh = (kh * ((heads / kv_heads) as i32) + g) * i32::from(per_head);
    let kind = info[(1, mh, j, t)];
    if kind > 0 {
        let q_block = info[(0, mh, j, t)];
        let q_start = q_block * (bq as i32);
        let kv_start = j * (bk as i32);
        let ragged_q = !sq.is_multiple_of(bq) & (q_block == (sq.div_ceil(bq) - 1) as i32);
        let ragged_kv = !skv.is_multiple_of(bk) & (j == (skv.div_ceil(bk) - 1) as i32);
        let needs_mask = segmented | (kind == PARTIAL) | ragged_q | ragged_kv;
        // Each branch computes from the refs, so no weight tile stays live across it.
        if needs_mask {
            let keep = segment_keep(keep_of(mask[..], kind, q_start, kv_start, bq, bk, sq, skv, true), q_seg[..], kv_seg[..], segmented);
            let (dk_inc, dv_inc) = masked_dkv_step(q[..], k[..], v[..], dout[..], lse[..], di[..], keep, q_start, kv_start, q.dtype, bq, bk, d, sq, skv, sm_scale, soft_cap);
            dv_acc[..] += dv_inc;
            dk_acc[..] += dk_inc;
        } else {
            let (dk_inc, dv_inc) = dkv_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
            dv_acc[..] += dv_inc;
            dk_acc[..] += dk_inc;
        }
    }
    // Every step, as flash's dkv kernel: the dk, dv blocks stay resident across g and t.
    dk[..] = dk_acc[..].cast(dk.dtype);
    dv[..] = dv_acc[..].cast(dv.dtype);
}

/// dq: q blocks outside, the kv blocks of `fwd_info` inside, as the forward.
#[tpu_kernel(
    grid = [bsz, heads, sq.div_ceil(bq), steps],
    semantics = [parallel, parallel, parallel, arbitrary],
    (q, dout, dq) = block([None, None, bq, d], |b, h, i, j| [b, h, i, 0]),
    (k, v) = block([None, None, bk, d], |b, h, i, j| [b, h / (heads / kv_heads), min(max(info[(0, h * usize::from(per_head), i, j)], 0), skv.div_ceil(bk) - 1), 0]),
    mask = block([None, bq, bk], |b, h, i, j| [min(max(info[(2, h * usize::from(per_head), i, j)], 0), nb - 1), 0, 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, h, i, j| [b * usize::from(segmented), i * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, h, i, j| [b * usize::from(segmented), 0, min(max(info[(0, h * usize::from(per_head), i, j)], 0), skv.div_ceil(bk) - 1) * usize::from(segmented)]),
    (lse, di) = block([None, None, bq, 1], |b, h, i, j| [b, h, i, 0]),
    dq_acc = scratch([bq, d], f32),
)]
#[rustfmt::skip]
pub fn splash_attention_dq_kernel(
    info: Prefetch<3, hm, nblk, steps>,
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, mask: In<nb, bq, bk>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    dout: In<bsz, heads, sq, d>, lse: In<bsz, heads, sq, 1>, di: In<bsz, heads, sq, 1>, dq: Out<bsz, heads, sq, d>, dq_acc: Scratch,
    per_head: bool, segmented: bool, sm_scale: f32, soft_cap: f32,
) {
    let h = program_id(1);
    let i = program_id(2);
    let j = program_id(3);
    if j == 0 {
        dq_acc[..] = zeros([bq, d], f32);
    }
    let mh = h * i32::from(per_head);
    let kind = info[(1, mh, i, j)];
    if kind > 0 {
        let kv_block = info[(0, mh, i, j)];
        let q_start = i * (bq as i32);
        let kv_start = kv_block * (bk as i32);
        let ragged_kv = !skv.is_multiple_of(bk) & (kv_block == (skv.div_ceil(bk) - 1) as i32);
        let needs_mask = segmented | (kind == PARTIAL) | ragged_kv;
        // Each branch computes from the refs, so no weight tile stays live across it.
        if needs_mask {
            let keep = segment_keep(keep_of(mask[..], kind, q_start, kv_start, bq, bk, sq, skv, false), q_seg[..], kv_seg[..], segmented);
            dq_acc[..] += masked_dq_step(q[..], k[..], v[..], dout[..], lse[..], di[..], keep, kv_start, q.dtype, bk, d, skv, sm_scale, soft_cap);
        } else {
            dq_acc[..] += dq_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
        }
    }
    if j == num_programs(3) - 1 {
        dq[..] = dq_acc[..].cast(dq.dtype);
    }
}

// ---- the host-side mask metadata ------------------------------------------------------------

/// A mask cut into blocks: the three arrays the kernels read (see the module docs).
#[derive(Clone, Debug)]
pub struct MaskInfo {
    /// int8 `[nb, bq, bk]`.
    pub mask_blocks: Array,
    /// int32 `[3, heads, nq, steps]`.
    pub fwd_info: Array,
    /// int32 `[3, heads, nk, steps_q]`.
    pub bwd_info: Array,
}

/// One visited block of a walk: the other axis's block, its kind, its partial block.
type Visit = (i32, i32, i32);

impl MaskInfo {
    /// The metadata of mask `visible(h, r, c)` over `heads` mask heads (1, or one per query
    /// head), `sq` queries and `skv` keys at blocks `bq x bk`. Pairs past the ends are not
    /// asked (the kernels mask them).
    pub fn build(heads: usize, sq: usize, skv: usize, bq: usize, bk: usize, visible: impl Fn(usize, usize, usize) -> bool) -> Result<MaskInfo, KernelError> {
        Self::build_with(heads, sq, skv, bq, bk, |_, _, _| None, visible)
    }

    /// The metadata of a band: query `r` sees key `c` iff `c - r <= right` and `r - c <=
    /// left` (flash attention's extents, [`crate::attention::AttentionParams::extents`]:
    /// causal is `right = 0`, an extent as long as the sequence is unbounded). Blocks are
    /// classified from their corners, so only the band's edge blocks are evaluated pair by
    /// pair: `O(nq * nk)` plus the edges, not `O(sq * skv)`.
    pub fn band(sq: usize, skv: usize, bq: usize, bk: usize, left: usize, right: usize) -> Result<MaskInfo, KernelError> {
        let (l, rt) = (left as i64, right as i64);
        let visible = move |r: i64, c: i64| c - r <= rt && r - c <= l;
        let classify = move |_: usize, i: usize, j: usize| {
            let (r0, r1) = ((i * bq) as i64, (((i + 1) * bq).min(sq) - 1) as i64);
            let (c0, c1) = ((j * bk) as i64, (((j + 1) * bk).min(skv) - 1) as i64);
            // The band is convex along both axes: the block's extreme differences decide.
            if c0 - r1 > rt || r0 - c1 > l {
                Some(SKIP)
            } else if c1 - r0 <= rt && r1 - c0 <= l {
                Some(FULL)
            } else {
                None
            }
        };
        Self::build_with(1, sq, skv, bq, bk, classify, move |_, r, c| visible(r as i64, c as i64))
    }

    /// [`MaskInfo::build`] with a classifier that settles some blocks without visiting their
    /// pairs (`Some(SKIP)` / `Some(FULL)`; `None`: evaluate them).
    pub fn build_with(
        heads: usize,
        sq: usize,
        skv: usize,
        bq: usize,
        bk: usize,
        classify: impl Fn(usize, usize, usize) -> Option<i32>,
        visible: impl Fn(usize, usize, usize) -> bool,
    ) -> Result<MaskInfo, KernelError> {
        let err = |m: String| KernelError::new("splash_attention", "mask", "mask-shape", m, "pass a mask of at least one head, query and key, and blocks of at least 1");
        if heads == 0 || sq == 0 || skv == 0 || bq == 0 || bk == 0 {
            return Err(err(format!("{heads} heads, {sq} queries, {skv} keys at blocks {bq} x {bk}")));
        }
        let (nq, nk) = (sq.div_ceil(bq), skv.div_ceil(bk));
        let mut ids: HashMap<Vec<i8>, i32> = HashMap::new();
        let mut blocks: Vec<Vec<i8>> = Vec::new();
        // Per (head, q block), the kv blocks with their kind and partial id.
        let mut rows: Vec<Vec<Visit>> = vec![Vec::new(); heads * nq];
        let mut bits = vec![0i8; bq * bk];
        for h in 0..heads {
            for i in 0..nq {
                for j in 0..nk {
                    match classify(h, i, j) {
                        Some(SKIP) => continue,
                        Some(_) => {
                            rows[h * nq + i].push((j as i32, FULL, -1));
                            continue;
                        }
                        None => {}
                    }
                    let (mut seen, mut total) = (0usize, 0usize);
                    bits.fill(0);
                    for r in i * bq..((i + 1) * bq).min(sq) {
                        for c in j * bk..((j + 1) * bk).min(skv) {
                            total += 1;
                            if visible(h, r, c) {
                                seen += 1;
                                bits[(r - i * bq) * bk + (c - j * bk)] = 1;
                            }
                        }
                    }
                    let visit = if seen == 0 {
                        continue;
                    } else if seen == total {
                        (j as i32, FULL, -1)
                    } else {
                        let next = blocks.len() as i32;
                        let id = *ids.entry(bits.clone()).or_insert_with(|| {
                            blocks.push(bits.clone());
                            next
                        });
                        (j as i32, PARTIAL, id)
                    };
                    rows[h * nq + i].push(visit);
                }
            }
        }
        let mut cols: Vec<Vec<Visit>> = vec![Vec::new(); heads * nk];
        for (hr, row) in rows.iter().enumerate() {
            let (h, i) = (hr / nq, hr % nq);
            for &(j, kind, id) in row {
                cols[h * nk + j as usize].push((i as i32, kind, id));
            }
        }
        let nb = blocks.len().max(1);
        let mut flat = Vec::with_capacity(nb * bq * bk);
        for b in &blocks {
            flat.extend_from_slice(b);
        }
        flat.resize(nb * bq * bk, 0);
        Ok(MaskInfo { mask_blocks: Array::from_i8(&[nb, bq, bk], flat), fwd_info: walks(&rows, heads, 1), bwd_info: walks(&cols, heads, 1) })
    }

}

/// int32 `[3, heads, n, steps]` of `heads * n` walks (steps at least `min_steps` and the
/// longest walk): each walk's visits, then padding steps of kind [`SKIP`] that repeat the last
/// visit's blocks; a full visit's mask block is the previous partial one's (or 0), so neither
/// issues a DMA.
fn walks(walks: &[Vec<Visit>], heads: usize, min_steps: usize) -> Array {
    let steps = walks.iter().map(Vec::len).max().unwrap_or(0).max(min_steps);
    let n = walks.len();
    let mut out = vec![0i32; 3 * n * steps];
    for (w, visits) in walks.iter().enumerate() {
        let (mut block, mut mask) = (0, 0);
        for s in 0..steps {
            let kind = match visits.get(s) {
                Some(&(b, kind, id)) => {
                    block = b;
                    if kind == PARTIAL {
                        mask = id;
                    }
                    kind
                }
                None => SKIP,
            };
            out[w * steps + s] = block;
            out[(n + w) * steps + s] = kind;
            out[(2 * n + w) * steps + s] = mask;
        }
    }
    Array::from_i32(&[3, heads, n / heads.max(1), steps], out)
}

/// The dense mask `[heads, sq, skv]` that metadata describes, read from `fwd_info` alone (the
/// independent decoding the references and tests use): a pair is visible iff its block is
/// visited as full, or as partial with its bit set. `None` when the metadata is malformed
/// (an index out of range, a kind other than 0/1/2).
pub fn decode(mask_blocks: &Array, fwd_info: &Array, sq: usize, skv: usize) -> Option<(usize, Vec<bool>)> {
    let (nb, bq, bk) = (mask_blocks.shape[0], mask_blocks.shape[1], mask_blocks.shape[2]);
    let (heads, steps) = (fwd_info.shape[1], fwd_info.shape[3]);
    let nq = sq.div_ceil(bq);
    let nk = skv.div_ceil(bk);
    if fwd_info.shape[2] != nq {
        return None;
    }
    let rows = heads * nq;
    let info = fwd_info.as_i32()?;
    let bits = mask_blocks.as_i8()?;
    let mut out = vec![false; heads * sq * skv];
    for hr in 0..rows {
        let (h, i) = (hr / nq, hr % nq);
        for s in 0..steps {
            let at = |plane: usize| info[(plane * rows + hr) * steps + s];
            let (j, kind, id) = (at(0), at(1), at(2));
            if kind == SKIP {
                continue;
            }
            if !(0..nk as i32).contains(&j) || (kind != FULL && kind != PARTIAL) || (kind == PARTIAL && !(0..nb as i32).contains(&id)) {
                return None;
            }
            let j = j as usize;
            for r in i * bq..((i + 1) * bq).min(sq) {
                for c in j * bk..((j + 1) * bk).min(skv) {
                    if kind == FULL || bits[(id as usize * bq + r - i * bq) * bk + c - j * bk] != 0 {
                        out[(h * sq + r) * skv + c] = true;
                    }
                }
            }
        }
    }
    Some((heads, out))
}

/// Random metadata for `[nb, bq, bk]` mask blocks and `[3, heads, nq, steps]` / `[3, heads,
/// nk, steps_q]` walks: each (mask head, q block) visits a random subset of kv
/// blocks (random kinds and partial blocks, random bits), no walk longer than its array
/// allows. Arbitrary block-sparse masks for the op's random inputs; structured masks come
/// from [`MaskInfo::build`].
pub fn random_mask_info(shapes: [&[usize]; 3], rng: &mut StdRng) -> MaskInfo {
    let (nb, bq, bk) = (shapes[0][0].max(1), shapes[0][1].max(1), shapes[0][2].max(1));
    // The walks the shapes ask for (a contract-breaking shape makes metadata the op refuses).
    let (nq, nk) = (shapes[1][2].max(1), shapes[2][2].max(1));
    let heads = shapes[1][1].max(1);
    let (steps, steps_q) = (shapes[1][3].max(1), shapes[2][3].max(1));
    // Bits visible with probability 0.6; block 0 all zero when there are several (a partial
    // block may hide every key of some rows: those rows must come out 0 / -inf).
    let mut flat: Vec<i8> = (0..nb * bq * bk).map(|_| i8::from(rng.gen_bool(0.6))).collect();
    if nb > 1 {
        flat[..bq * bk].fill(0);
    }
    let mut rows: Vec<Vec<Visit>> = vec![Vec::new(); heads * nq];
    let mut col_count = vec![0usize; heads * nk];
    for h in 0..heads {
        for row in rows[h * nq..(h + 1) * nq].iter_mut() {
            let mut js: Vec<usize> = (0..nk).collect();
            js.shuffle(rng);
            let want = rng.gen_range(0..=nk.min(steps));
            let mut picked: Vec<usize> = js.into_iter().filter(|&j| col_count[h * nk + j] < steps_q).take(want).collect();
            picked.sort_unstable();
            for j in picked {
                col_count[h * nk + j] += 1;
                let kind = if rng.gen_bool(0.5) { FULL } else { PARTIAL };
                row.push((j as i32, kind, if kind == PARTIAL { rng.gen_range(0..nb) as i32 } else { -1 }));
            }
        }
    }
    let mut cols: Vec<Vec<Visit>> = vec![Vec::new(); heads * nk];
    for (hr, row) in rows.iter().enumerate() {
        for &(j, kind, id) in row {
            cols[(hr / nq) * nk + j as usize].push(((hr % nq) as i32, kind, id));
        }
    }
    MaskInfo { mask_blocks: Array::from_i8(&[nb, bq, bk], flat), fwd_info: walks(&rows, heads, steps), bwd_info: walks(&cols, heads, steps_q) }
}

// ---- building -----------------------------------------------------------------------------

/// The checked geometry of a call: a mask per head (or one shared).
struct Geometry {
    per_head: bool,
}

/// Checks q/k/v, the metadata's shapes against them and each other, and the soft cap.
#[allow(clippy::too_many_arguments)]
fn geometry(op: &str, q: &Type, k: &Type, v: &Type, blocks: &Type, fwd: &Type, bwd: &Type, params: &AttentionParams) -> Result<Geometry, KernelError> {
    let e = |subject: &str, m: String, help: String| KernelError::new(op, subject, "splash-metadata", m, help);
    let (_, h, _, sq, skv, _) = crate::attention::dims(op, q, k, v)?;
    check_cap(op, params)?;
    let (bq, bk) = (blocks.shape[1], blocks.shape[2]);
    if bq == 0 || bk == 0 || blocks.shape[0] == 0 {
        return Err(e("input `mask_blocks`", format!("mask_blocks is {blocks}"), "pass the mask_blocks of tessera.splash.make_mask (at least one [bq, bk] block)".into()));
    }
    let (nq, nk) = (sq.div_ceil(bq), skv.div_ceil(bk));
    let (hm, fq) = (fwd.shape[1], fwd.shape[2]);
    if fq != nq || (hm != 1 && hm != h) {
        return Err(e(
            "input `fwd_info`",
            format!("fwd_info walks {hm} mask head(s) x {fq} q blocks; {sq} queries at block_q = {bq} are {nq} q blocks, over 1 mask head (shared) or {h} (one per query head)"),
            "build the metadata for this q length and these heads (tessera.splash.make_mask)".into(),
        ));
    }
    let per_head = hm == h && h > 1;
    if bwd.shape[1] != hm || bwd.shape[2] != nk {
        return Err(e(
            "input `bwd_info`",
            format!("bwd_info walks {} mask head(s) x {} kv blocks; fwd_info's mask needs {hm} x {nk} ({skv} keys at block_kv = {bk})", bwd.shape[1], bwd.shape[2]),
            "pass the bwd_info built with fwd_info".into(),
        ));
    }
    Ok(Geometry { per_head })
}

/// The forward kernel: `o` and, with `save_lse`, `lse` (without it the kernel has no lse
/// output, as flash attention's: [`crate::attention::build_flash_attention`]).
#[allow(clippy::too_many_arguments)]
pub fn build_splash_attention(q: &Type, k: &Type, v: &Type, blocks: &Type, fwd: &Type, bwd: &Type, segmented: bool, params: &AttentionParams, save_lse: bool, target: &Target) -> Result<Kernel, KernelError> {
    let g = geometry("splash_attention", q, k, v, blocks, fwd, bwd, params)?;
    let (b, h, sq, skv) = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]);
    let (qs, ks) = crate::attention::segment_types(segmented, b, sq, skv);
    let kernel = splash_attention_fwd_kernel(fwd.clone(), q.clone(), k.clone(), v.clone(), blocks.clone(), qs, ks, q.clone(), Type::vector(DType::F32, &[b, h, sq, 1]), g.per_head, segmented, params.sm_scale, cap_of(params), save_lse)?;
    Ok(fit_vmem_limit(crate::attention::lse_kept(kernel, save_lse)?, target))
}

/// The three backward kernels (di, dkv, dq).
#[allow(clippy::too_many_arguments)]
pub fn build_splash_attention_bwd(q: &Type, k: &Type, v: &Type, blocks: &Type, fwd: &Type, bwd: &Type, segmented: bool, params: &AttentionParams, target: &Target) -> Result<Vec<Kernel>, KernelError> {
    let g = geometry("splash_attention_bwd", q, k, v, blocks, fwd, bwd, params)?;
    let (b, h, sq, skv) = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]);
    let (qs, ks) = crate::attention::segment_types(segmented, b, sq, skv);
    let col = Type::vector(DType::F32, &[b, h, sq, 1]);
    let (scale, cap) = (params.sm_scale, cap_of(params));
    let di = crate::attention::build_di(q, &col)?;
    let dkv = splash_attention_dkv_kernel(bwd.clone(), q.clone(), k.clone(), v.clone(), blocks.clone(), qs.clone(), ks.clone(), q.clone(), col.clone(), col.clone(), k.clone(), v.clone(), g.per_head, segmented, scale, cap)?;
    let dq = splash_attention_dq_kernel(fwd.clone(), q.clone(), k.clone(), v.clone(), blocks.clone(), qs, ks, q.clone(), col.clone(), col, q.clone(), g.per_head, segmented, scale, cap)?;
    Ok(vec![fit_vmem_limit(di, target), fit_vmem_limit(dkv, target), fit_vmem_limit(dq, target)])
}

/// Default blocks for a mask over `sq` x `skv` with head dim `d`: flash attention's backward
/// blocks (the metadata serves the forward and the backward, so it takes the blocks that
/// fit both; see [`crate::attention::default_blocks`]).
pub fn default_blocks(sq: usize, skv: usize, d: usize, dtype: DType, target: &Target) -> (usize, usize) {
    let b = crate::attention::default_blocks(sq, skv, d, dtype, false, true, target);
    (b.block_q, b.block_kv)
}

// ---- flash attention's sliding windows --------------------------------------------------------

/// Flash attention's window as splash metadata at blocks `bq x bk`, when a walk over it is
/// shorter than the kv axis (a band narrower than the keys: flash's grid would step through
/// every kv block, most of them skipped; splash's grid is the band's). `None` for no left
/// window (causal or full attention, whose walks are as long as the keys), and for q blocks
/// other than a multiple of 32 rows (int8's packing; libtpu's rulebook accepts int8 blocks of
/// 8 rows, but these kernels were compiled at 32 and up only) or all of `sq`.
pub(crate) fn band_info(sq: usize, skv: usize, bq: usize, bk: usize, left: usize, right: usize) -> Result<Option<MaskInfo>, KernelError> {
    if left >= sq || !(bq.is_multiple_of(32) || bq == sq) {
        return Ok(None);
    }
    let info = MaskInfo::band(sq, skv, bq, bk, left, right)?;
    Ok((info.fwd_info.shape[3] < skv.div_ceil(bk)).then_some(info))
}

/// Where a plan's metadata and segment ids come from, with the host arrays they need.
struct Metadata {
    /// `mask_blocks`, `fwd_info`, `bwd_info`.
    walks: [Operand; 3],
    segmented: bool,
    segments: [Operand; 2],
    host: Vec<Array>,
}

impl Metadata {
    /// The op's own metadata inputs; without segment ids, the 1-element placeholders as host
    /// arrays 0 and 1.
    fn inputs(c: &Call) -> Result<Metadata, KernelError> {
        let (q, k) = (c.tensor("q")?, c.tensor("k")?);
        let (segmented, segments) = segment_operands(c, q.shape[0], q.shape[2], k.shape[2])?;
        let walks = [c.input("mask_blocks", c.tensor("mask_blocks")?.clone())?, c.input("fwd_info", c.tensor("fwd_info")?.clone())?, c.input("bwd_info", c.tensor("bwd_info")?.clone())?];
        Ok(Metadata { walks, segmented, segments, host: if segmented { Vec::new() } else { dummy_segments() } })
    }

    /// A band's metadata, built at plan time, as host arrays 0 to 2 (the same arrays every
    /// call); without segment ids, the placeholders as host arrays 3 and 4.
    fn band(c: &Call, info: &MaskInfo) -> Result<Metadata, KernelError> {
        let (q, k) = (c.tensor("q")?, c.tensor("k")?);
        let (segmented, given) = segment_operands(c, q.shape[0], q.shape[2], k.shape[2])?;
        let dummy = Type::vector(DType::I32, &[1, 1, 1]);
        let segments = if segmented { given } else { [host(3, dummy.clone()), host(4, dummy)] };
        let arrays = [info.mask_blocks.clone(), info.fwd_info.clone(), info.bwd_info.clone()];
        let walks = [0, 1, 2].map(|i| host(i, Type::vector(arrays[i].dtype, &arrays[i].shape)));
        let mut host = arrays.to_vec();
        host.extend(dummy_segments());
        Ok(Metadata { walks, segmented, segments, host })
    }

    fn attach(self, plan: Plan) -> Plan {
        if self.host.is_empty() { plan } else { plan.with_host(self.host) }
    }
}

/// `flash_attention_fwd`'s plan over a band ([`band_info`]): splash's forward kernel (`o`
/// alone without `save_lse`, `flash_attention`'s).
pub(crate) fn plan_band_fwd(c: &Call, params: &AttentionParams, info: &MaskInfo, save_lse: bool) -> Result<Plan, KernelError> {
    forward_plan(c, params, Metadata::band(c, info)?, save_lse)
}

/// `flash_attention_bwd`'s plan over a band: splash's di, dkv and dq kernels.
pub(crate) fn plan_band_bwd(c: &Call, params: &AttentionParams, info: &MaskInfo) -> Result<Plan, KernelError> {
    backward_plan(c, params, Metadata::band(c, info)?)
}

/// The forward launch over metadata `m` (results `o` and, with `save_lse`, `lse`).
fn forward_plan(c: &Call, params: &AttentionParams, m: Metadata, save_lse: bool) -> Result<Plan, KernelError> {
    let [q, k, v] = [c.tensor("q")?.clone(), c.tensor("k")?.clone(), c.tensor("v")?.clone()];
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    let [blocks, fwd, bwd] = m.walks.clone();
    let [qs, ks] = m.segments.clone();
    let kernel = build_splash_attention(&q, &k, &v, &blocks.ty, &fwd.ty, &bwd.ty, m.segmented, params, save_lse, c.target)?;
    let args = vec![fwd, c.input("q", q)?, c.input("k", k)?, c.input("v", v)?, blocks, qs, ks];
    Ok(m.attach(single(c, kernel, args, &crate::attention::forward_results(save_lse, b, h, sq))))
}

/// The backward launches (di, dkv over `bwd_info`, dq over `fwd_info`) over metadata `m`.
fn backward_plan(c: &Call, params: &AttentionParams, m: Metadata) -> Result<Plan, KernelError> {
    let [q, k, v] = [c.tensor("q")?.clone(), c.tensor("k")?.clone(), c.tensor("v")?.clone()];
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    let [blocks, fwd, bwd] = m.walks.clone();
    let [qs, ks] = m.segments.clone();
    let kernels = build_splash_attention_bwd(&q, &k, &v, &blocks.ty, &fwd.ty, &bwd.ty, m.segmented, params, c.target)?;
    let col = Type::vector(DType::F32, &[b, h, sq, 1]);
    let (o, lse, dout) = (c.input("o", q.clone())?, c.input("lse", col.clone())?, c.input("do", q.clone())?);
    let di = result(0, 0, col);
    let tail = |walks: Operand| -> Result<Vec<_>, KernelError> {
        Ok(vec![walks, c.input("q", q.clone())?, c.input("k", k.clone())?, c.input("v", v.clone())?, blocks.clone(), qs.clone(), ks.clone(), dout.clone(), lse.clone(), di.clone()])
    };
    let [di_k, dkv_k, dq_k]: [Kernel; 3] = kernels.try_into().map_err(|_| c.err("kernels", "plan-consistency", "the backward builds three kernels", "report this as a Tessera bug"))?;
    let launches = vec![Launch::new(di_k, vec![o, dout.clone()]), Launch::new(dkv_k, tail(bwd)?), Launch::new(dq_k, tail(fwd)?)];
    let results = vec![result(2, 0, q), result(1, 0, k), result(1, 1, v)];
    Ok(m.attach(Plan::new(c.op, c.target, launches, results)))
}

// ---- running (through the op table) -----------------------------------------------------------

fn statics_of(params: &AttentionParams) -> String {
    let mut s = format!("sm_scale={:?}", params.sm_scale as f64);
    if let Some(cap) = params.soft_cap {
        s += &format!(", soft_cap={:?}", cap as f64);
    }
    s
}

/// Splash attention `(o, lse)` of `q [B, H, Sq, D]`, `k`, `v [B, Hkv, Skv, D]` under the mask
/// `info` describes (its blocks are the kernels'); `params`' `sm_scale` and `soft_cap` apply,
/// its causal flag and window do not (they are the mask's business).
#[allow(clippy::too_many_arguments)]
pub fn splash_attention(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, info: &MaskInfo, segment_ids: Option<&SegmentIds>, params: &AttentionParams, target: &Target) -> Result<(Array, Array), KernelError> {
    let op = crate::op_named("splash_attention_fwd")?;
    let mut inputs = vec![Some(q), Some(k), Some(v), Some(&info.mask_blocks), Some(&info.fwd_info), Some(&info.bwd_info)];
    inputs.extend(segment_ids.map_or([None, None], |s| [Some(&s.q), Some(&s.kv)]));
    let mut out = op.run(exec, &inputs, &op.statics(&statics_of(params))?, target)?.into_iter();
    out.next().zip(out.next()).ok_or_else(|| KernelError::new(op.name, "outputs", "output-count", "expected 2 results", "report this as a library bug"))
}

/// The gradients `(dq, dk, dv)` of `sum(o * do)` from the forward's `o` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn splash_attention_bwd(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, o: &Array, lse: &Array, dout: &Array, info: &MaskInfo, segment_ids: Option<&SegmentIds>, params: &AttentionParams, target: &Target) -> Result<(Array, Array, Array), KernelError> {
    let op = crate::op_named("splash_attention_bwd")?;
    let mut inputs = vec![Some(q), Some(k), Some(v), Some(o), Some(lse), Some(dout), Some(&info.mask_blocks), Some(&info.fwd_info), Some(&info.bwd_info)];
    inputs.extend(segment_ids.map_or([None, None], |s| [Some(&s.q), Some(&s.kv)]));
    let mut out = op.run(exec, &inputs, &op.statics(&statics_of(params))?, target)?.into_iter();
    match (out.next(), out.next(), out.next()) {
        (Some(dq), Some(dk), Some(dv)) => Ok((dq, dk, dv)),
        _ => Err(KernelError::new(op.name, "outputs", "output-count", "expected 3 results", "report this as a library bug")),
    }
}

// ---- ops ------------------------------------------------------------------------------------

fn params_of(c: &Call, q: &Type) -> Result<AttentionParams, KernelError> {
    let mut params = AttentionParams::new(q.shape.get(3).copied().unwrap_or(1), false);
    if let Some(s) = c.statics.f64("sm_scale") {
        params.sm_scale = finite_scale(c, s)?;
    }
    params.soft_cap = c.statics.f64("soft_cap").map(|x| x as f32);
    Ok(params)
}

fn plan_fwd(c: &Call) -> Result<Plan, KernelError> {
    let params = params_of(c, c.tensor("q")?)?;
    forward_plan(c, &params, Metadata::inputs(c)?, true)
}

/// `splash_attention`'s own plan: `o` alone, from a kernel that does not write lse.
fn plan_o(c: &Call) -> Result<Plan, KernelError> {
    let params = params_of(c, c.tensor("q")?)?;
    forward_plan(c, &params, Metadata::inputs(c)?, false)
}

fn plan_bwd(c: &Call) -> Result<Plan, KernelError> {
    let q = c.tensor("q")?;
    let params = params_of(c, q)?;
    // Shapes are the op's contract; o and do are also read with q's dtype.
    for name in ["o", "do"] {
        let t = c.tensor(name)?;
        if t.dtype != q.dtype {
            return Err(c.err(format!("input `{name}`"), "operand-dtype", format!("{name} is {t}, q is {q}"), format!("pass {name} of q's dtype ({})", q.dtype)));
        }
    }
    backward_plan(c, &params, Metadata::inputs(c)?)
}

/// q, k in [-2, 2), v in [-1, 1), random block-sparse metadata ([`random_mask_info`]) for the
/// given metadata shapes, segment ids when their shapes are given.
fn forward_inputs(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let n = |s: &Vec<usize>| s.iter().product::<usize>();
    let (sq, skv) = (shapes[0][2], shapes[1][2]);
    let mut a = vec![
        Array::from_f32_in(dtype, &shapes[0], harness::uniform(n(&shapes[0]), 2.0, rng)),
        Array::from_f32_in(dtype, &shapes[1], harness::uniform(n(&shapes[1]), 2.0, rng)),
        Array::from_f32_in(dtype, &shapes[2], harness::uniform(n(&shapes[2]), 1.0, rng)),
    ];
    let info = random_mask_info([&shapes[3], &shapes[4], &shapes[5]], rng);
    a.extend([info.mask_blocks, info.fwd_info, info.bwd_info]);
    if shapes.len() > 6 {
        let s = crate::attention::random_segment_ids(shapes[0][0], sq, skv, rng);
        a.extend([s.q, s.kv]);
    }
    a
}

/// The reference problem of inputs `(q, k, v, [o, lse, do,] mask_blocks, fwd_info, bwd_info,
/// [segments])`: the dense mask decoded from the metadata.
fn reference_params(a: &[Array], s: &Statics, meta: usize) -> Option<crate::attention::reference::Attention> {
    let (q, k) = (&a[0].shape, &a[1].shape);
    let (heads, mask) = decode(&a[meta], &a[meta + 1], q[2], k[2])?;
    let segmented = a.len() > meta + 3;
    let seg = |i: usize| segmented.then(|| a[i].as_i32().unwrap_or(&[]).to_vec());
    Some(crate::attention::reference::Attention {
        b: q[0],
        h: q[1],
        hkv: k[1],
        sq: q[2],
        skv: k[2],
        d: q[3],
        causal: false,
        sm_scale: s.f64("sm_scale").map_or(1.0 / (q[3] as f64).sqrt(), |x| x as f32 as f64),
        soft_cap: s.f64("soft_cap").map(|x| x as f32 as f64),
        q_segments: seg(meta + 3),
        kv_segments: seg(meta + 4),
        window_left: None,
        window_right: None,
        mask: Some((heads, mask)),
    })
}

/// Forward inputs with the reference forward's `o`, `lse` and a random `do` inserted after v.
fn backward_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let fwd_shapes: Vec<Vec<usize>> = shapes[..3].iter().chain(&shapes[6..]).cloned().collect();
    let mut fwd = forward_inputs(&fwd_shapes, dtype, s, rng);
    let cfg = reference_params(&fwd, s, 3).expect("random metadata decodes");
    let (o, lse) = crate::attention::reference::forward(&cfg, &fwd[0].to_f64_vec(), &fwd[1].to_f64_vec(), &fwd[2].to_f64_vec());
    let q_shape = shapes[0].clone();
    let rest: Vec<Array> = fwd.drain(3..).collect();
    fwd.push(Array::from_f32_in(dtype, &q_shape, o.iter().map(|&x| x as f32).collect()));
    fwd.push(Array::from_f32(&shapes[4], lse.iter().map(|&x| x as f32).collect()));
    fwd.push(Array::from_f32_in(dtype, &q_shape, harness::uniform(q_shape.iter().product(), 1.0, rng)));
    fwd.extend(rest);
    fwd
}

fn ref_forward(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let Some(cfg) = reference_params(a, s, 3) else { return vec![] };
    let (o, lse) = crate::attention::reference::forward(&cfg, &a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec());
    vec![o, lse]
}

fn ref_backward(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let Some(cfg) = reference_params(a, s, 6) else { return vec![] };
    let (dq, dk, dv) = crate::attention::reference::backward(&cfg, &a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[5].to_f64_vec());
    vec![dq, dk, dv]
}

const Q: Input = Input { name: "q", dims: "[b, h, sq, d]", kind: Kind::Float };
const K: Input = Input { name: "k", dims: "[b, hkv, skv, d]", kind: Kind::Float };
const V: Input = Input { name: "v", dims: "[b, hkv, skv, d]", kind: Kind::Float };
const MASK_BLOCKS: Input = Input { name: "mask_blocks", dims: "[nb, bq, bk]", kind: Kind::Int8 };
const FWD_INFO: Input = Input { name: "fwd_info", dims: "[3, hm, nq, steps]", kind: Kind::Int32 };
const BWD_INFO: Input = Input { name: "bwd_info", dims: "[3, hm, nk, steps_q]", kind: Kind::Int32 };
const Q_SEG: Input = Input { name: "q_segment_ids", dims: "[b, sq]", kind: Kind::Int32 };
const KV_SEG: Input = Input { name: "kv_segment_ids", dims: "[b, skv]", kind: Kind::Int32 };
const FWD_SCHEMA: &str = "(Tensor q, Tensor k, Tensor v, Tensor mask_blocks, Tensor fwd_info, Tensor bwd_info, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> (Tensor, Tensor)";
const FWD_DOC: &str = "splash attention: flash attention over a block-sparse mask whose metadata (mask_blocks int8 [nb, bq, bk], fwd_info / bwd_info int32 [3, mask heads, q / kv blocks, steps]) tessera.splash.make_mask builds on the host once per mask; fully masked blocks are never fetched, full blocks apply no mask; (o, float32 lse [b, h, sq]); GQA, soft cap, segment ids";

/// Cases: a 1024-long sequence at 256 blocks (4 x 4 blocks, every walk as long as the
/// sequence, 16 distinct partial blocks allowed), per-head metadata over GQA 4:1 and ragged
/// lengths, and segment ids with a soft cap.
const FWD_CASES: &[Case] = &[
    Case { name: "default", statics: "", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[16, 256, 256], &[3, 1, 4, 4], &[3, 1, 4, 4]] },
    Case { name: "per_head_alt", statics: "", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[6, 256, 256], &[3, 8, 3, 4], &[3, 8, 4, 3]] },
    Case { name: "segmented", statics: "soft_cap=50.0", shapes: &[&[2, 4, 512, 128], &[2, 2, 512, 128], &[2, 2, 512, 128], &[4, 128, 128], &[3, 1, 4, 4], &[3, 1, 4, 4], &[2, 512], &[2, 512]] },
];
const BWD_CASES: &[Case] = &[
    Case { name: "default", statics: "", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024], &[1, 8, 1024, 128], &[16, 256, 256], &[3, 1, 4, 4], &[3, 1, 4, 4]] },
    Case { name: "per_head_alt", statics: "", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[2, 8, 700, 64], &[2, 8, 700], &[2, 8, 700, 64], &[6, 256, 256], &[3, 8, 3, 4], &[3, 8, 4, 3]] },
    Case {
        name: "segmented",
        statics: "soft_cap=50.0",
        shapes: &[&[2, 4, 512, 128], &[2, 2, 512, 128], &[2, 2, 512, 128], &[2, 4, 512, 128], &[2, 4, 512], &[2, 4, 512, 128], &[4, 128, 128], &[3, 1, 4, 4], &[3, 1, 4, 4], &[2, 512], &[2, 512]],
    },
];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "splash_attention_fwd", doc: FWD_DOC, schema: FWD_SCHEMA, plan: plan_fwd, reference: Some(ref_forward),
        inputs: &[Q, K, V, MASK_BLOCKS, FWD_INFO, BWD_INFO, Q_SEG, KV_SEG], outputs: &[Output { name: "o", shape: "q", dtype: "q" }, Output { name: "lse", shape: "[*q[:3]]", dtype: "f32" }],
        backward: Some(Backward { op: "splash_attention_bwd", args: "q, k, v, o, lse, d_o, mask_blocks, fwd_info, bwd_info, sm_scale, soft_cap, q_segment_ids, kv_segment_ids", grads: &["q", "k", "v"] }),
        cases: FWD_CASES, random: Some(forward_inputs), ..Op::EMPTY
    },
    Op {
        name: "splash_attention_bwd", doc: "(dq, dk, dv) of splash attention: di = rowsum(do * o), a dkv kernel walking bwd_info (the q blocks that see each kv block, the group's query heads summed in VMEM), a dq kernel walking fwd_info",
        schema: "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor mask_blocks, Tensor fwd_info, Tensor bwd_info, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> (Tensor, Tensor, Tensor)",
        plan: plan_bwd, reference: Some(ref_backward),
        inputs: &[Q, K, V, Input { name: "o", dims: "[b, h, sq, d]", kind: Kind::Float }, Input { name: "lse", dims: "[b, h, sq, 1?]", kind: Kind::Float32 }, Input { name: "do", dims: "[b, h, sq, d]", kind: Kind::Float }, MASK_BLOCKS, FWD_INFO, BWD_INFO, Q_SEG, KV_SEG],
        outputs: &[Output { name: "dq", shape: "q", dtype: "q" }, Output { name: "dk", shape: "k", dtype: "k" }, Output { name: "dv", shape: "v", dtype: "v" }],
        cases: BWD_CASES, random: Some(backward_inputs), ..Op::EMPTY
    },
    Op {
        name: "splash_attention", doc: "splash attention's output o (differentiable), splash_attention_fwd's first result (from a kernel that writes no lse)", schema: FWD_SCHEMA_O,
        inputs: &[Q, K, V, MASK_BLOCKS, FWD_INFO, BWD_INFO, Q_SEG, KV_SEG], outputs: &[Output { name: "o", shape: "q", dtype: "q" }],
        alias_of: Some(("splash_attention_fwd", 0)), alias_plan: Some(plan_o), ..Op::EMPTY
    },
];

const FWD_SCHEMA_O: &str = "(Tensor q, Tensor k, Tensor v, Tensor mask_blocks, Tensor fwd_info, Tensor bwd_info, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> Tensor";
