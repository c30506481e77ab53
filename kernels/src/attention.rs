//! Flash attention, forward and backward, for TPU: `q [B, H, Sq, D]`, `k`/`v [B, Hkv, Skv, D]`
//! with `H % Hkv == 0` (GQA/MQA: query head `h` reads kv head `h / (H / Hkv)`).
//!
//! `logits = softcap(sm_scale * q @ k^T)`, `softcap(x) = cap * tanh(x / cap)` when a cap is
//! given, masked by the causal rule (query row `r` sees key `c` iff `c <= r`, top-left
//! aligned as Pallas' `flash_attention`, also when `Sq != Skv`), by a sliding window, and by
//! segment ids (a query sees only keys of its own segment); `o = softmax(logits) @ v`, `lse =
//! logsumexp(logits)`.
//!
//! # Sliding window
//!
//! `window_left` / `window_right` (`int?`, default None = unbounded, as flash-attn's
//! `window_size=(left, right)`): row `r` sees key `c` iff (`c <= r` if causal) and `r - c <=
//! window_left` (when given) and `c - r <= window_right` (when given), and the segment rule;
//! `r` and `c` count from 0 in q and in k (the causal rule's top-left alignment, also when
//! `Sq != Skv`). Causal is the right extent 0, so with `causal=True` `window_right` is moot.
//! A negative extent is an `option-value` error; one at least the sequence's length cuts
//! nothing and builds the unwindowed kernel ([`AttentionParams::extents`]).
//!
//! transformers' `sliding_window = w` (Mistral, Gemma 2/3's sliding layers; `masking_utils.
//! sliding_window_overlay`: `kv_idx > q_idx - w`, under `causal_mask_function`'s `kv_idx <=
//! q_idx`) keeps `w` keys, the query's own included: it is `causal=True, window_left = w - 1`.
//! JAX splash's `LocalMask(window_size=(l, r))` (`q - l <= k <= q + r`) is `window_left = l,
//! window_right = r`, and ragged_paged_attention's `sliding_window` is HF's.
//!
//! A left window whose band is narrower than the keys (some q block's walk skips kv blocks)
//! runs splash attention's kernels ([`crate::splash`]) over the band's block metadata, built
//! once per plan from the extents alone (no input is read): their grid walks only the band's
//! blocks, where the kernels below step through every kv block and skip most (at S = 32k, a
//! 4096-key window and 512 blocks: 64 x 9 steps per head instead of 64 x 64, each skipped
//! step still paying the grid step's fixed cost). libtpu's static estimate cannot compare the
//! two: it does not see splash's data-dependent branch (see `kernels/README.md`).
//! The kernels below serve the rest (causal and full attention, windows as wide as the keys,
//! q blocks other than multiples of 32 rows).
//!
//! Blocks entirely outside the window are skipped like the causal ones, on both sides: the
//! body is under `if` on the block test (some key at most `right` after a query of the block
//! and at most `left` before one), and the k/v index maps clamp the kv block into the q
//! block's band, `min(max(j, lo), hi)` with `lo = (max(q_start, left) - left) / bk` (clamped
//! to the last block) and `hi = (q_end + right) / bk`, so a skipped step maps to a block
//! already resident and issues no DMA; the dkv kernel clamps the q block into the kv
//! block's band (`[kv_start - right, kv_end + left]`) the same way. Only the blocks the
//! window's edges cut build the iota mask; blocks fully inside need none. At S = 2048,
//! `window_left = 255` and 128 blocks, a q block fetches 3 kv blocks, not 16 (counted in
//! tests/tests/attention.rs). A row that sees no key (e.g. `Sq > Skv + window_left`) gets
//! `o = 0`, `lse = -inf`, as the empty rows below.
//!
//! # Forward
//!
//! Grid `(B, H, q blocks, kv blocks)`, the kv axis last and `arbitrary`. B and H are
//! squeezed from the block specs, so the body sees `[bq, D]` / `[bk, D]` blocks. The online
//! softmax state (running max `m`, running sum `l`, accumulator `acc`) lives in f32 VMEM
//! scratch: set at kv block 0, folded into `o` and `lse` at the last kv block. `m` and `l`
//! are `[bq, 128]`, lane-replicated (Pallas' layout), when `bk` and `D` are multiples of 128:
//! used against the scores or the accumulator they are repeated whole vregs ([`widen`],
//! `tpu.concatenate`), where a `[bq, 1]` column is a lane broadcast per use and a masked
//! one-lane store per write. bf16 inputs
//! go to the MXU as bf16 (the probabilities are cast to v's dtype for `p @ v`), f32 inputs
//! as f32; both accumulate in f32.
//!
//! Causal blocks entirely above the diagonal are skipped: the body is under `if kv_start <=
//! q_end`, and the k/v index maps clamp the kv block to the last one the q block needs
//! (`min(j, q_end / bk)`), so a skipped step maps to the block already resident and no DMA
//! is issued. Masks (iota compares) are built only for blocks that need them: the diagonal
//! blocks, the last kv block when `Skv % bk != 0`, and every block with segment ids. A
//! kernel none of whose blocks can be cut (not causal, no window or segment ids, the blocks
//! dividing the lengths) has neither test: its steps run the plain body unconditionally.
//!
//! # Layouts
//!
//! - `lse` (and the backward's `di = rowsum(do * o)`) are f32 `[B, H, Sq, 1]` in the
//!   kernels: a `[bq, 1]` column block broadcasts along lanes against the `[bq, bk]` scores
//!   with no relayout (it occupies `[bq, 128]` of VMEM). The public functions and library
//!   ops show it as `[B, H, Sq]` (the same bytes).
//! - Segment ids are int32 `[B, Sq]` / `[B, Skv]`, passed to the kernels as `[B, Sq, 1]` (a
//!   column block) and `[B, 1, Skv]` (a row block), so their compare broadcasts to the
//!   score tile. Without segment ids the kernels take 1-element dummies (one kernel body
//!   serves both cases) that no live instruction reads, so the TPU never sees them: the
//!   custom call leaves them out (`Kernel::touched_refs`), which saves the per-step window
//!   bookkeeping of two operands (libtpu: 0.7-2% of the forward's cycles).
//!
//! # Backward
//!
//! Three kernels: `di = rowsum(do * o)` (f32 `[B, H, Sq, 1]`); the dkv kernel, grid `(B,
//! Hkv, kv blocks, G, q blocks)` with `G = H / Hkv`, whose two inner `arbitrary` axes walk the
//! group's query heads and the q blocks while `dk`, `dv` accumulate in f32 scratch (so the
//! GQA sum over a kv head's query heads happens in VMEM, not on the host); and the dq
//! kernel, grid `(B, H, q blocks, kv blocks)` like the forward. Both recompute `p =
//! exp(logits - lse)` and skip causal blocks with clamped index maps (the dkv kernel clamps
//! the q block up to the first one that sees its keys).
//!
//! # Edges
//!
//! Sequence lengths need not be multiples of the blocks. Reads past the end of an array are
//! undefined (NaN in the interpreter), and `0 * NaN` is NaN, so the edge blocks zero the
//! rows past the end of every operand that a dot contracts over, and mask the scores.
//! Writes past the end are dropped.
//!
//! # NaN and inf
//!
//! The forward is torch's math attention over the *visible* keys: masking selects, it
//! never multiplies a masked key's value by zero. A NaN in q, or in a visible k, makes
//! the rows that see it NaN; a logit of +inf makes its row NaN (`exp(inf - inf)`), one of
//! -inf weighs 0, and a row whose visible logits are all -inf is NaN (`0 / 0`); a NaN
//! `sm_scale` gives NaN rows, and so does ±inf unless a soft cap bounds the logits (to
//! ±cap, as torch's formula does). A nonfinite v value reaches exactly the
//! (row, column) entries that see it: `p * inf` is inf, NaN where `p = 0`, and `inf -
//! inf` is NaN. In a block without masks `p @ v` is that product itself; a masked block
//! multiplies v with its nonfinite values zeroed, and if it held any ([`holds_nonfinite`],
//! a reduction moved to a scalar with `item()`, which only this fix-up waits for) adds them
//! back through one exact bf16 product of visibility codes ([`nonfinite_fixup`],
//! [`add_nonfinite`]), so a masked key never reaches a query that may not see it. A finite v
//! skips that product. `lse` is torch's `logsumexp` over the visible logits: NaN
//! with a NaN, +inf with a +inf, -inf when they are all -inf.
//!
//! A query row that sees no key at all (possible with segment ids or a window), or whose visible
//! logits are all -inf, gets `o = 0` and `lse = -inf`, as torch's SDPA gives (its math
//! backend's safe softmax, and its CPU kernels). The backward takes weights 0 for a row
//! with `lse = -inf` ([`no_weight_past`]), so such a row's gradients are SDPA's.
//!
//! The backward selects its weights and `ds` in masked blocks, so a nonfinite `dp`, `di`
//! or logit never crosses a mask. What it does not restore is a nonfinite *operand row*
//! of a masked block's products: a NaN / inf row of q reaches dk, of k reaches dq, and of
//! do reaches dv, of that block's positions that do not see it (a zero weight times the
//! raw value). Nothing leaves the masked blocks that hold the value (the causal diagonal,
//! segment ids, the window's edges, the ragged edge); unmasked blocks and a nonfinite v are
//! exact. torch's
//! math-SDPA autograd multiplies masked weights by zero for every pair, so its NaN set
//! contains ours.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::blocks::{fit_blocks, fit_vmem_limit};
use crate::harness;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output, Statics};
use crate::plan::{host, result, single, Launch, Operand, Plan};

/// How far past a q block's first row its keys can reach: `bq - 1 + right` (`bq - 1` when
/// causal), or past the end when the right extent is unbounded (`right >= skv`: the block
/// test is always true and the index-map clamp the identity).
fn reach(right: usize, bq: usize, skv: usize) -> usize {
    if right >= skv { skv } else { bq - 1 + right }
}

/// How far before a kv block's first key its queries can reach: `bk - 1 + left`.
fn back_reach(left: usize, bk: usize) -> usize {
    bk - 1 + left
}

// ---- kernel fragments -----------------------------------------------------------------------

/// The logits of a block pair: `softcap(sm_scale * q @ k^T)`, `softcap(x) = cap * tanh(x / cap)`
/// when `soft_cap > 0`.
#[tpu_fn]
pub(crate) fn logits(q: Value, k: Value, sm_scale: f32, soft_cap: f32) -> Value {
    let s = dot_t(q, k) * sm_scale;
    if soft_cap > 0.0 { (s * (1.0 / soft_cap)).tanh() * soft_cap } else { s }
}

/// The first query row and key column of block pair `(i, j)`.
#[tpu_fn]
fn block_origin(i: Value, j: Value, bq: usize, bk: usize) -> (Value, Value) {
    (i * (bq as i32), j * (bk as i32))
}

/// The gradient through the soft cap: `d softcap(x) / dx = 1 - tanh^2 = 1 - (s / cap)^2`.
#[tpu_fn]
fn uncap(ds: Value, s: Value, soft_cap: f32) -> Value {
    if soft_cap > 0.0 {
        let t = s * (1.0 / soft_cap);
        ds * (1.0 - t * t)
    } else {
        ds
    }
}

/// Which logits of the `[bq, bk]` block at `(q_start, kv_start)` count: keys inside the
/// array, queries inside it (with `rows`), and the window: `c - r <= right` (the causal
/// rule is `right = 0`) when `right < skv`, `r - c <= left` when `left < sq` (segments are
/// the caller's).
#[tpu_fn]
pub(crate) fn visible(q_start: Value, kv_start: Value, bq: usize, bk: usize, sq: usize, skv: usize, rows: bool, left: usize, right: usize) -> Value {
    // Each test only where it can fail: keys past the array only when `skv` is not a
    // multiple of `bk` (the last block), queries past it only when `sq` is not one of `bq`.
    // The row index is built once, when a test needs it.
    let col = iota([bq, bk], 1) + kv_start;
    let ragged_rows = rows && !sq.is_multiple_of(bq);
    if right < skv || left < sq || ragged_rows {
        let row = iota([bq, bk], 0) + q_start;
        let mut keep = if right < skv {
            let mut k = if right == 0 { col <= row } else { col <= row + (right as i32) };
            if !skv.is_multiple_of(bk) {
                k = k & (col < (skv as i32));
            }
            k
        } else {
            col < (skv as i32)
        };
        if ragged_rows {
            keep = keep & (row < (sq as i32));
        }
        if left < sq {
            keep = keep & (col + (left as i32) >= row);
        }
        keep
    } else {
        col < (skv as i32)
    }
}

/// `x * m + c` without a multiplication by 1 or an addition of 0.
#[tpu_fn]
fn scaled(x: Value, m: usize, c: usize) -> Value {
    let y = if m == 1 { x } else { x * (m as i32) };
    if c == 0 { y } else { y + (c as i32) }
}

/// [`visible`] (without the `rows` test) by another op graph, for the fix-up of a masked
/// forward step: the window tests read `c - r` (one subtraction of iotas and one broadcast
/// offset), not `c` and `r`. An identical recomputation is merged with the step's mask by
/// libtpu's value numbering, which then keeps every mask vreg of the step live (spilled)
/// across the branch into the fix-up, in every masked step (v6e, causal 512^2: 131 bundles
/// a masked step, 3.3% of the kernel's cycles).
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
fn visible_again(q_start: Value, kv_start: Value, bq: usize, bk: usize, sq: usize, skv: usize, left: usize, right: usize) -> Value {
    let gap = iota([bq, bk], 1) - iota([bq, bk], 0) + (kv_start - q_start);
    let in_array = iota([bq, bk], 1) + kv_start < (skv as i32);
    let mut keep = if right < skv { gap <= (right as i32) } else { in_array };
    if right < skv && !skv.is_multiple_of(bk) {
        keep = keep & in_array;
    }
    if left < sq {
        keep = keep & (gap >= -(left as i32));
    }
    keep
}

/// Whether the block pair at `(q_start, kv_start)` has a visible pair at all: some key at
/// most `right` past a query (`kv_start <= q_end + right`) and, with a left extent, at most
/// `left` before one (`q_start <= kv_end + left`). A block that fails is skipped.
#[tpu_fn]
fn block_live(i: Value, j: Value, q_start: Value, kv_start: Value, bq: usize, bk: usize, sq: usize, skv: usize, left: usize, right: usize) -> Value {
    // In block indices where kv blocks tile q blocks: `j <= i` for a causal 128^2 kernel,
    // where the row form is a shift, an add and a shift more per step.
    let mut live = if bq.is_multiple_of(bk) { j <= scaled(i, bq / bk, reach(right, bq, skv) / bk) } else { kv_start <= q_start + (reach(right, bq, skv) as i32) };
    if left < sq {
        live = live & (q_start <= kv_start + (back_reach(left, bk) as i32));
    }
    live
}

/// Whether the window cuts through the block pair (some pair inside it is outside the
/// window), so that the block needs the iota mask; blocks fully inside need none. The right
/// extent's test is in block indices where kv blocks tile q blocks, as [`block_live`]'s
/// (`c - r > right` for some pair iff `j * bk + bk - 1 - right > i * bq`).
#[tpu_fn]
fn window_cuts(needs_mask: Value, i: Value, j: Value, q_start: Value, kv_start: Value, bq: usize, bk: usize, sq: usize, skv: usize, left: usize, right: usize) -> Value {
    let mut m = needs_mask;
    if right < skv {
        m = m | if bq.is_multiple_of(bk) { j >= scaled(i, bq / bk, (right + 1) / bk) } else { kv_start + (bk as i32 - 1 - right as i32) > q_start };
    }
    if left < sq {
        m = m | (q_start + (bq as i32 - 1 - left as i32) > kv_start);
    }
    m
}

/// The lanes of the forward's running max and sum: 128 when the kv block and the head dim
/// are multiples of 128, so that they are lane-replicated `[bq, 128]` (Pallas' layout): a
/// use against the `[bq, bk]` scores or the `[bq, d]` accumulator tiles whole vregs
/// ([`widen`]) instead of broadcasting a column along lanes, and a write stores whole vregs
/// instead of one masked lane. Else 1 (a `[bq, 1]` column).
pub(crate) fn state_lanes(bk: usize, d: usize) -> usize {
    if bk.is_multiple_of(128) && d.is_multiple_of(128) { 128 } else { 1 }
}

/// Lane-replicated state (`[rows, lanes]`) as wide as `width`: the same vregs repeated
/// (`jnp.tile`); a `[rows, 1]` column broadcasts where it is used.
#[tpu_fn]
fn widen(x: Value, lanes: usize, width: usize) -> Value {
    if lanes == 1 || width == lanes { x } else { concat([x; width / lanes], 1) }
}

/// The online softmax step of one block: the new running max, sum and accumulator, and
/// the block's weights `p`, with the running max and sum as `[bq, lanes]` state
/// ([`state_lanes`]). The running max starts at `f32::MIN`, not -inf ([`SOFTMAX_MAX_START`]),
/// so a row whose logits so far are all -inf (masked, or -inf data) keeps `m = f32::MIN` and
/// takes `exp(-inf - f32::MIN) = 0`, not `exp(-inf + inf) = NaN`, with nothing between the
/// row max and the exponent on the step's critical path (a `max(m, f32::MIN)` there cost
/// 0.4% of the non-causal 256^2 forward's cycles on v6e and 1.0% at 512^2, libtpu).
#[tpu_fn]
pub(crate) fn online_softmax(s: Value, v: Value, m_old: Value, l_old: Value, acc_old: Value, v_dtype: DType, lanes: usize, bk: usize, d: usize) -> (Value, Value, Value, Value) {
    let m_new = m_old.max(s.reduce_max(1));
    let alpha = (m_old - m_new).exp();
    let p = (s - widen(m_new, lanes, bk)).exp();
    let acc_new = widen(alpha, lanes, d) * acc_old + dot(p.cast(v_dtype), v);
    (m_new, alpha * l_old + p.sum(1), acc_new, p)
}

/// Where [`online_softmax`]'s running max starts: the least finite f32, which every finite
/// logit reaches and -inf does not.
pub(crate) const SOFTMAX_MAX_START: f32 = f32::MIN;

/// The forward's output at the last kv step, `acc / l` in f32 from the running state: a row
/// with `l = 0` saw no key, or only -inf logits (else its largest logit adds `exp(0) = 1`:
/// `l >= 1`, or NaN); torch's SDPA (its safe softmax) gives o = 0 there, not 0 / 0.
#[tpu_fn]
pub(crate) fn finish_o(l_run: Value, acc: Value, lanes: usize, d: usize) -> Value {
    let l = widen(l_run, lanes, d);
    select(l == 0.0, 0.0, acc / l)
}

/// `lse = m + log l` of `[bq, 1]` columns of the running state, torch's logsumexp: -inf over
/// all -inf (or nothing: `f32::MIN + log 0`), +inf if a logit is +inf, NaN with a NaN.
#[tpu_fn]
pub(crate) fn finish_lse(m_col: Value, l_col: Value) -> Value {
    select(m_col == f32::INFINITY, f32::INFINITY, m_col + l_col.log())
}

/// The radix of the nonfinite code of a block of `keys` keys: a power of two above `keys`
/// (a digit counts keys), at most 4096 so that two digits stay exact in f32.
pub(crate) fn nonfinite_radix(keys: usize) -> f32 {
    (keys + 1).next_power_of_two().clamp(2, 4096) as f32
}

/// Masking selects, it does not multiply by zero: in a masked block, `p @ v` would carry a
/// nonfinite value of a v row into every query through `0 * inf`, also into the queries
/// that may not see that key. So a masked block multiplies `v` with its nonfinite values
/// zeroed and carries their class ([`nonfinite_class`]) to [`add_nonfinite`].
#[tpu_fn]
pub(crate) fn zero_nonfinite(v: Value) -> Value {
    select((v - v) == 0.0, v, 0.0)
}

/// The class of each value of `v` in bf16: +inf 1, -inf `r`, NaN `r^2`, finite 0.
#[tpu_fn]
pub(crate) fn nonfinite_class(v: Value, r: f32) -> Value {
    select((v - v) == 0.0, 0.0, select(v > 0.0, 1.0, select(v < 0.0, r, r * r))).cast(bf16)
}

/// `keep` and, if `segmented`, equal segment ids.
#[tpu_fn]
pub(crate) fn segment_keep(keep: Value, q_seg: Value, kv_seg: Value, segmented: bool) -> Value {
    if segmented {
        keep & (q_seg == kv_seg)
    } else {
        keep
    }
}

/// A `[rows, cols]` block starting at row `start` with the rows at or past `end` (the
/// array's length) zeroed: a read past the end is undefined, and a dot contracting over
/// those rows, or a zero weight times one, would carry a NaN. A no-op when blocks tile
/// the array.
#[tpu_fn]
pub(crate) fn rows_before(x: Value, start: Value, rows: usize, cols: usize, end: usize) -> Value {
    if end.is_multiple_of(rows) {
        x
    } else {
        select(iota([rows, cols], 0) + start < (end as i32), x, 0.0)
    }
}

/// Whether the block holds a nonfinite value, a scalar for a branch: `v - v` is NaN exactly
/// there, and a sum with a NaN is NaN (rows first and in v's dtype: adding vregs is cheaper
/// than reducing across lanes, and a bf16 sum of zeros is exact). A finite v (the usual case)
/// then pays a reduction instead of [`add_nonfinite`]'s product.
#[tpu_fn]
pub(crate) fn holds_nonfinite(v: Value) -> Value {
    (v - v).sum(0).cast(f32).sum(1).item() != 0.0
}

/// The second half of a masked step over `v` with its nonfinite values zeroed (the
/// first is [`online_softmax`], which left the running max `m_run` and accumulator `acc`):
/// [`add_nonfinite`] with the step's weights, recomputed from `m_run` as that step computed
/// them. The step does not wait for [`holds_nonfinite`]'s reduction, and its weights do not
/// stay live across the branch that calls this (a finite v, the usual case, skips it).
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn nonfinite_fixup(s: Value, keep: Value, v: Value, m_run: Value, acc: Value, lanes: usize, bk: usize) -> Value {
    let r = nonfinite_radix(bk);
    let p = (select(keep, s, f32::NEG_INFINITY) - widen(m_run, lanes, bk)).exp();
    add_nonfinite(acc, p, keep, nonfinite_class(v, r), r)
}

/// `acc` plus what the block's nonfinite v values give the queries that see them, as in
/// math attention over the visible keys: `p * inf` is inf for `p > 0` and NaN for `p = 0`,
/// `inf - inf` and NaN are NaN. One exact bf16 product counts, per (query, column), the
/// visible keys of each kind: a visible weight codes as 1 (`p > 0`) or `r^2` (`p = 0` or
/// NaN), so +inf terms land on digit 0, -inf on digit 1 and NaN at `r^2` and above.
#[tpu_fn]
pub(crate) fn add_nonfinite(acc: Value, p: Value, keep: Value, class: Value, r: f32) -> Value {
    // The weights' code by arithmetic, not a select of constants: libtpu's v5e lowering fuses
    // that select into a masked bf16 matmul which its own LLO type check rejects.
    let weight = (r * r + (1.0 - r * r) * (p > 0.0).cast(f32)) * keep.cast(f32);
    let code = dot(weight.cast(bf16), class);
    let nan = code >= r * r;
    let digits = select(nan, 0.0, code).cast(i32);
    let plus = (digits & ((r as i32) - 1)) != 0;
    let minus = digits >= (r as i32);
    let fix = select(nan | (plus & minus), f32::NAN, select(plus, f32::INFINITY, f32::NEG_INFINITY));
    select(code == 0.0, acc, acc + fix)
}

/// The backward's weights are `exp(s - lse)`; a row with `lse = -inf` (it saw no key, or
/// only -inf logits) has weights 0, as SDPA's safe softmax gives it, not `exp(-inf + inf)`.
#[tpu_fn]
fn no_weight_past(lse: Value) -> Value {
    select(lse == f32::NEG_INFINITY, f32::INFINITY, lse)
}

/// A backward block's weights `p = exp(logits - lse)` and `ds = p * (do @ v^T - di)` through
/// the soft cap ([`uncap`]), before any masking.
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn weights_and_ds(q: Value, k: Value, v: Value, dout: Value, lse: Value, di: Value, sm_scale: f32, soft_cap: f32) -> (Value, Value) {
    let s = logits(q, k, sm_scale, soft_cap);
    let p = (s - no_weight_past(lse)).exp();
    (p, uncap(p * (dot_t(dout, v) - di), s, soft_cap))
}

/// The dk and dv increments of a dkv block every pair of which counts (flash and splash
/// attention).
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkv_step(q: Value, k: Value, v: Value, dout: Value, lse: Value, di: Value, dtype: DType, sm_scale: f32, soft_cap: f32) -> (Value, Value) {
    let (p, ds) = weights_and_ds(q, k, v, dout, lse, di, sm_scale, soft_cap);
    let dv = dot_tn(p.cast(dtype), dout);
    (dot_tn((ds * sm_scale).cast(dtype), q), dv)
}

/// The dq increment of a dq block every pair of which counts (flash and splash attention).
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_step(q: Value, k: Value, v: Value, dout: Value, lse: Value, di: Value, dtype: DType, sm_scale: f32, soft_cap: f32) -> Value {
    let (_p, ds) = weights_and_ds(q, k, v, dout, lse, di, sm_scale, soft_cap);
    dot((ds * sm_scale).cast(dtype), k)
}

/// The dk and dv increments of a masked dkv block (flash and splash attention), over the
/// pairs `keep` admits. The dots contract over q rows and kv rows, so the undefined rows
/// past the ends are zeroed first (masking p alone leaves 0 * NaN); both p and ds are
/// selected, since `p * (dp - di)` would carry a NaN of dp, di or s into pairs that do not
/// see each other.
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_dkv_step(q: Value, k: Value, v: Value, dout: Value, lse: Value, di: Value, keep: Value, q_start: Value, kv_start: Value, dtype: DType, bq: usize, bk: usize, d: usize, sq: usize, skv: usize, sm_scale: f32, soft_cap: f32) -> (Value, Value) {
    let qb = rows_before(q, q_start, bq, d, sq);
    let dob = rows_before(dout, q_start, bq, d, sq);
    let kb = rows_before(k, kv_start, bk, d, skv);
    let vb = rows_before(v, kv_start, bk, d, skv);
    let (p, ds) = weights_and_ds(qb, kb, vb, dob, rows_before(lse, q_start, bq, 1, sq), rows_before(di, q_start, bq, 1, sq), sm_scale, soft_cap);
    let dv = dot_tn(select(keep, p, 0.0).cast(dtype), dob);
    (dot_tn((select(keep, ds, 0.0) * sm_scale).cast(dtype), qb), dv)
}

/// The dq increment of a masked dq block (flash and splash attention), over the pairs
/// `keep` admits. `ds @ k` contracts over kv rows: the undefined rows past the end are
/// zeroed (rows past Sq are independent here, and their writes are dropped).
#[tpu_fn]
#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_dq_step(q: Value, k: Value, v: Value, dout: Value, lse: Value, di: Value, keep: Value, kv_start: Value, dtype: DType, bk: usize, d: usize, skv: usize, sm_scale: f32, soft_cap: f32) -> Value {
    let kb = rows_before(k, kv_start, bk, d, skv);
    let (_p, ds) = weights_and_ds(q, kb, rows_before(v, kv_start, bk, d, skv), dout, lse, di, sm_scale, soft_cap);
    dot((select(keep, ds, 0.0) * sm_scale).cast(dtype), kb)
}

// ---- kernels ------------------------------------------------------------------------------

#[tpu_kernel(
    grid = [bsz, heads, sq.div_ceil(bq), skv.div_ceil(bk)],
    semantics = [parallel, parallel, parallel, arbitrary],
    (q, o) = block([None, None, bq, d], |b, h, i, j| [b, h, i, 0]),
    (k, v) = block([None, None, bk, d], |b, h, i, j| [b, h / (heads / kv_heads), min(if left < sq { max(j, min((max(i * bq, left) - left) / bk, skv.div_ceil(bk) - 1)) } else { j }, (i * bq + reach(right, bq, skv)) / bk), 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, h, i, j| [b * usize::from(segmented), i * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, h, i, j| [b * usize::from(segmented), 0, min(if left < sq { max(j, min((max(i * bq, left) - left) / bk, skv.div_ceil(bk) - 1)) } else { j }, (i * bq + reach(right, bq, skv)) / bk) * usize::from(segmented)]),
    lse = block([None, None, bq, 1], |b, h, i, j| [b, h, i, 0]),
    (m_run, l_run) = scratch([bq, state_lanes(bk, d)], f32),
    acc = scratch([bq, d], f32),
)]
#[rustfmt::skip]
pub fn flash_attention_fwd_kernel(
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    o: Out<bsz, heads, sq, d>, lse: Out<bsz, heads, sq, 1>, m_run: Scratch, l_run: Scratch, acc: Scratch,
    bq: usize, bk: usize, left: usize, right: usize, segmented: bool, sm_scale: f32, soft_cap: f32, save_lse: bool,
) {
    let i = program_id(2);
    let j = program_id(3);
    let lanes = state_lanes(bk, d);
    if j == 0 {
        m_run[..] = full([bq, lanes], f32, SOFTMAX_MAX_START);
        l_run[..] = zeros([bq, lanes], f32);
        acc[..] = zeros([bq, d], f32);
    }
    let (q_start, kv_start) = block_origin(i, j, bq, bk);
    // Whether any block of this kernel can hold a pair a query may not see (static).
    let maskable = segmented || !skv.is_multiple_of(bk) || right < skv || left < sq;
    // Causal with square blocks of at least two rows (static): block (i, j) is live iff
    // j <= i and cut iff j >= i (a one-row block on the diagonal is not cut, c = r is
    // visible), so the masked block is the diagonal, each row's last live block (it exists
    // for every row when sq <= skv), and the finish runs inside its step, from its values, not
    // in a region of its own after each row's last grid step (libtpu, B1 H8 S2048 D128 bf16,
    // o and lse: v6e 128^2 1114277 -> 1097149 cycles, 256^2 337163 -> 332651; v5e 128^2
    // 1276097 -> 1261253, but 512^2 172216 -> 174093, where the masked step spills more).
    let diagonal_finish = right == 0 && left >= sq && bq == bk && bk > 1 && sq <= skv && !segmented;
    // No block is masked and a row has few kv steps (static): the row's last step is a branch
    // of its own that finishes from its values, in its region. The branch costs every step
    // and the finish region it saves is one a row, larger with lse (its log and store), so it
    // pays up to 4 steps a row for o alone and 8 with lse (libtpu, B1 H8 S2048 D128 bf16, o
    // only: 512^2 v6e 157400 -> 155992 cycles, v5e 208359 -> 206271; 1024^2 -3.5% / -6.9%;
    // but 256^2 on v6e +0.6%, 128^2 +1.1%. With lse: 256^2 -0.3% / -0.6%, S4096 512^2 -0.7% /
    // -1.0%, but 128^2 +0.6% / +0.1%).
    let last_step_finish = !maskable && skv.div_ceil(bk) <= if save_lse { 8 } else { 4 };
    if last_step_finish {
        if j == num_programs(3) - 1 {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let (m_new, l_new, acc_new, _p) = online_softmax(s, v[..], m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            o[..] = finish_o(l_new, acc_new, lanes, d).cast(o.dtype);
            if save_lse {
                m_run[..] = m_new;
                l_run[..] = l_new;
                lse[..] = finish_lse(m_run[(.., 0..1)], l_run[(.., 0..1)]);
            }
        } else {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let (m_new, l_new, acc_new, _p) = online_softmax(s, v[..], m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            m_run[..] = m_new;
            l_run[..] = l_new;
            acc[..] = acc_new;
        }
    } else if !maskable {
        // Every block is live and none is cut: no branch before the step, so libtpu schedules
        // the last step's test into the step's tail, as in Pallas' kernel (v6e, non-causal
        // 128^2: 1.03 -> 1.00 of Pallas' cycles; the always-true live test cost ~17 bundles
        // a step).
        let s = logits(q[..], k[..], sm_scale, soft_cap);
        let (m_new, l_new, acc_new, _p) = online_softmax(s, v[..], m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
        m_run[..] = m_new;
        l_run[..] = l_new;
        acc[..] = acc_new;
    } else if block_live(i, j, q_start, kv_start, bq, bk, sq, skv, left, right) {
        // A block the window, the segments or the array's end cut masks with selects and
        // steps over v with its nonfinite values zeroed; if it held any,
        // [`nonfinite_fixup`] adds what they give the queries that see them (only that
        // fix-up waits for the reduction). A block they do not cut steps plainly (Pallas
        // masks every live block of a causal kernel: libtpu, 0.5-2% of the forward's
        // cycles). Each branch computes from the refs, so no score tile stays live across it.
        let needs_mask = segmented | (!skv.is_multiple_of(bk) & (j == (skv.div_ceil(bk) - 1) as i32));
        let needs_mask = window_cuts(needs_mask, i, j, q_start, kv_start, bq, bk, sq, skv, left, right);
        if needs_mask {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let keep = segment_keep(visible(q_start, kv_start, bq, bk, sq, skv, false, left, right), q_seg[..], kv_seg[..], segmented);
            let vb = rows_before(v[..], kv_start, bk, d, skv);
            let (m_new, l_new, acc_new, _p) = online_softmax(select(keep, s, f32::NEG_INFINITY), zero_nonfinite(vb), m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            m_run[..] = m_new;
            l_run[..] = l_new;
            acc[..] = acc_new;
            if diagonal_finish {
                // The row's last live block: finish from the step's own values, in its region.
                o[..] = finish_o(l_new, acc_new, lanes, d).cast(o.dtype);
                if save_lse {
                    lse[..] = finish_lse(m_run[(.., 0..1)], l_run[(.., 0..1)]);
                }
            }
            if holds_nonfinite(vb) {
                // From the refs again: no tile of the step stays live across the branch.
                let keep = segment_keep(visible_again(q_start, kv_start, bq, bk, sq, skv, left, right), q_seg[..], kv_seg[..], segmented);
                acc[..] = nonfinite_fixup(logits(q[..], k[..], sm_scale, soft_cap), keep, rows_before(v[..], kv_start, bk, d, skv), m_run[..], acc[..], lanes, bk);
                if diagonal_finish {
                    o[..] = finish_o(l_run[..], acc[..], lanes, d).cast(o.dtype);
                }
            }
        } else {
            let s = logits(q[..], k[..], sm_scale, soft_cap);
            let (m_new, l_new, acc_new, _p) = online_softmax(s, v[..], m_run[..], l_run[..], acc[..], v.dtype, lanes, bk, d);
            m_run[..] = m_new;
            l_run[..] = l_new;
            acc[..] = acc_new;
        }
    }
    if !diagonal_finish && !last_step_finish {
        if j == num_programs(3) - 1 {
            o[..] = finish_o(l_run[..], acc[..], lanes, d).cast(o.dtype);
            if save_lse {
                lse[..] = finish_lse(m_run[(.., 0..1)], l_run[(.., 0..1)]);
            }
        }
    }
}

/// `di = rowsum(do * o)` in f32, the backward's softmax correction term.
#[tpu_kernel(
    grid = [bsz, heads, sq.div_ceil(bq)],
    semantics = [parallel, parallel, parallel],
    (o, dout) = block([None, None, bq, d], |b, h, i| [b, h, i, 0]),
    di = block([None, None, bq, 1], |b, h, i| [b, h, i, 0]),
)]
pub fn flash_attention_di_kernel(o: In<bsz, heads, sq, d>, dout: In<bsz, heads, sq, d>, di: Out<bsz, heads, sq, 1>, bq: usize) {
    di[..] = (o[..].cast(f32) * dout[..].cast(f32)).sum(1);
}

/// dk, dv: kv blocks outside, the group's query heads and the q blocks inside (`arbitrary`).
/// The q-side index maps clamp the q block into the band of rows that see kv block `j`,
/// `[j * bk - right, j * bk + bk - 1 + left]`: the lower end is spelled `j * bk / bq` when
/// causal and `j * 0 / bq` when unbounded, so those kernels are the ones from before windows.
#[tpu_kernel(
    grid = [bsz, kv_heads, skv.div_ceil(bk), heads / kv_heads, sq.div_ceil(bq)],
    semantics = [parallel, parallel, parallel, arbitrary, arbitrary],
    (q, dout) = block([None, None, bq, d], |b, kh, j, g, i| [b, kh * (heads / kv_heads) + g, min(max(i, if right == 0 || right >= skv { j * (if right == 0 { bk } else { 0 }) / bq } else { (max(j * bk, right) - right) / bq }), if left < sq { min((j * bk + back_reach(left, bk)) / bq, sq.div_ceil(bq) - 1) } else { sq.div_ceil(bq) - 1 }), 0]),
    (k, v, dk, dv) = block([None, None, bk, d], |b, kh, j, g, i| [b, kh, j, 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, kh, j, g, i| [b * usize::from(segmented), min(max(i, if right == 0 || right >= skv { j * (if right == 0 { bk } else { 0 }) / bq } else { (max(j * bk, right) - right) / bq }), if left < sq { min((j * bk + back_reach(left, bk)) / bq, sq.div_ceil(bq) - 1) } else { sq.div_ceil(bq) - 1 }) * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, kh, j, g, i| [b * usize::from(segmented), 0, j * usize::from(segmented)]),
    (lse, di) = block([None, None, bq, 1], |b, kh, j, g, i| [b, kh * (heads / kv_heads) + g, min(max(i, if right == 0 || right >= skv { j * (if right == 0 { bk } else { 0 }) / bq } else { (max(j * bk, right) - right) / bq }), if left < sq { min((j * bk + back_reach(left, bk)) / bq, sq.div_ceil(bq) - 1) } else { sq.div_ceil(bq) - 1 }), 0]),
    (dk_acc, dv_acc) = scratch([bk, d], f32),
)]
#[rustfmt::skip]
pub fn flash_attention_dkv_kernel(
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    dout: In<bsz, heads, sq, d>, lse: In<bsz, heads, sq, 1>, di: In<bsz, heads, sq, 1>,
    dk: Out<bsz, kv_heads, skv, d>, dv: Out<bsz, kv_heads, skv, d>, dk_acc: Scratch, dv_acc: Scratch,
    bq: usize, bk: usize, left: usize, right: usize, segmented: bool, sm_scale: f32, soft_cap: f32,
) {
    let j = program_id(2);
    let g = program_id(3);
    let i = program_id(4);
    if (g == 0) & (i == 0) {
        dk_acc[..] = zeros([bk, d], f32);
        dv_acc[..] = zeros([bk, d], f32);
    }
    let (q_start, kv_start) = block_origin(i, j, bq, bk);
    // As the forward: with no block cut (static), every block is live and steps plainly.
    let maskable = segmented || !sq.is_multiple_of(bq) || !skv.is_multiple_of(bk) || right < skv || left < sq;
    if !maskable {
        let (dk_inc, dv_inc) = dkv_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
        dv_acc[..] += dv_inc;
        dk_acc[..] += dk_inc;
    } else if block_live(i, j, q_start, kv_start, bq, bk, sq, skv, left, right) {
        let ragged_q = !sq.is_multiple_of(bq) & (i == (sq.div_ceil(bq) - 1) as i32);
        let ragged_kv = !skv.is_multiple_of(bk) & (j == (skv.div_ceil(bk) - 1) as i32);
        let needs_mask = segmented | ragged_q | ragged_kv;
        let needs_mask = window_cuts(needs_mask, i, j, q_start, kv_start, bq, bk, sq, skv, left, right);
        // Each branch computes from the refs, so no weight tile stays live across it.
        if needs_mask {
            let keep = segment_keep(visible(q_start, kv_start, bq, bk, sq, skv, true, left, right), q_seg[..], kv_seg[..], segmented);
            let (dk_inc, dv_inc) = masked_dkv_step(q[..], k[..], v[..], dout[..], lse[..], di[..], keep, q_start, kv_start, q.dtype, bq, bk, d, sq, skv, sm_scale, soft_cap);
            dv_acc[..] += dv_inc;
            dk_acc[..] += dk_inc;
        } else {
            let (dk_inc, dv_inc) = dkv_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
            dv_acc[..] += dv_inc;
            dk_acc[..] += dk_inc;
        }
    }
    // Every step: the dk, dv blocks stay resident across the inner axes and are written back
    // once, and the casts and stores hide under the step's dots, where a last-step branch ran
    // them alone (libtpu, v5e fwd+bwd at 128^2: -0.7% non-causal, -1.3% causal; +0.3% at
    // 512^2). dq keeps its last-step store: every step cost it more than it saved.
    dk[..] = dk_acc[..].cast(dk.dtype);
    dv[..] = dv_acc[..].cast(dv.dtype);
}

/// dq: q blocks outside, kv blocks inside (`arbitrary`), as the forward.
#[tpu_kernel(
    grid = [bsz, heads, sq.div_ceil(bq), skv.div_ceil(bk)],
    semantics = [parallel, parallel, parallel, arbitrary],
    (q, dout, dq) = block([None, None, bq, d], |b, h, i, j| [b, h, i, 0]),
    (k, v) = block([None, None, bk, d], |b, h, i, j| [b, h / (heads / kv_heads), min(if left < sq { max(j, min((max(i * bq, left) - left) / bk, skv.div_ceil(bk) - 1)) } else { j }, (i * bq + reach(right, bq, skv)) / bk), 0]),
    q_seg = block([None, if segmented { bq } else { 1 }, 1], |b, h, i, j| [b * usize::from(segmented), i * usize::from(segmented), 0]),
    kv_seg = block([None, 1, if segmented { bk } else { 1 }], |b, h, i, j| [b * usize::from(segmented), 0, min(if left < sq { max(j, min((max(i * bq, left) - left) / bk, skv.div_ceil(bk) - 1)) } else { j }, (i * bq + reach(right, bq, skv)) / bk) * usize::from(segmented)]),
    (lse, di) = block([None, None, bq, 1], |b, h, i, j| [b, h, i, 0]),
    dq_acc = scratch([bq, d], f32),
)]
#[rustfmt::skip]
pub fn flash_attention_dq_kernel(
    q: In<bsz, heads, sq, d>, k: In<bsz, kv_heads, skv, d>, v: In<bsz, kv_heads, skv, d>, q_seg: In<_, _, 1>, kv_seg: In<_, 1, _>,
    dout: In<bsz, heads, sq, d>, lse: In<bsz, heads, sq, 1>, di: In<bsz, heads, sq, 1>, dq: Out<bsz, heads, sq, d>, dq_acc: Scratch,
    bq: usize, bk: usize, left: usize, right: usize, segmented: bool, sm_scale: f32, soft_cap: f32,
) {
    let i = program_id(2);
    let j = program_id(3);
    if j == 0 {
        dq_acc[..] = zeros([bq, d], f32);
    }
    let (q_start, kv_start) = block_origin(i, j, bq, bk);
    // As the forward: with no block cut (static), every block is live and steps plainly.
    let maskable = segmented || !skv.is_multiple_of(bk) || right < skv || left < sq;
    if !maskable {
        dq_acc[..] += dq_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
    } else if block_live(i, j, q_start, kv_start, bq, bk, sq, skv, left, right) {
        let needs_mask = segmented | (!skv.is_multiple_of(bk) & (j == (skv.div_ceil(bk) - 1) as i32));
        let needs_mask = window_cuts(needs_mask, i, j, q_start, kv_start, bq, bk, sq, skv, left, right);
        // Each branch computes from the refs, so no weight tile stays live across it.
        if needs_mask {
            let keep = segment_keep(visible(q_start, kv_start, bq, bk, sq, skv, false, left, right), q_seg[..], kv_seg[..], segmented);
            dq_acc[..] += masked_dq_step(q[..], k[..], v[..], dout[..], lse[..], di[..], keep, kv_start, q.dtype, bk, d, skv, sm_scale, soft_cap);
        } else {
            dq_acc[..] += dq_step(q[..], k[..], v[..], dout[..], lse[..], di[..], q.dtype, sm_scale, soft_cap);
        }
    }
    if j == num_programs(3) - 1 {
        dq[..] = dq_acc[..].cast(dq.dtype);
    }
}

// ---- parameters and block sizes -------------------------------------------------------------

/// The static options of an attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    pub causal: bool,
    /// Multiplies `q @ k^T` (usually `1 / sqrt(D)`).
    pub sm_scale: f32,
    /// `logits = cap * tanh(logits / cap)` (Gemma 2 style), applied after `sm_scale`.
    pub soft_cap: Option<f32>,
    /// The sliding window's left extent: query row `r` sees key `c` only if `r - c <=
    /// left` (HF's `sliding_window = w` is `left = w - 1`). `None`: unbounded.
    pub window_left: Option<usize>,
    /// The right extent: `r` sees `c` only if `c - r <= right`. `None`: unbounded (the
    /// causal rule is `right = 0`, and with `causal` this extent is moot).
    pub window_right: Option<usize>,
}

impl AttentionParams {
    /// `sm_scale = 1 / sqrt(head_dim)`, no soft cap.
    pub fn new(head_dim: usize, causal: bool) -> Self {
        AttentionParams { causal, sm_scale: 1.0 / (head_dim as f32).sqrt(), soft_cap: None, window_left: None, window_right: None }
    }

    /// A sliding window of `left` / `right` extents (see the fields).
    pub fn with_window(self, left: Option<usize>, right: Option<usize>) -> Self {
        AttentionParams { window_left: left, window_right: right, ..self }
    }

    /// The kernels' `(left, right)` statics for `sq` queries and `skv` keys: the right
    /// extent is 0 when causal; an extent that cuts nothing becomes the "unbounded" value
    /// (`left = sq`, `right = skv`: no row is `sq` rows past a key, nor a key `skv` past a
    /// row), so a window at least as long as the sequence builds the unwindowed kernel.
    pub fn extents(&self, sq: usize, skv: usize) -> (usize, usize) {
        let left = self.window_left.map_or(sq, |l| l.min(sq));
        let right = if self.causal { 0 } else { self.window_right.map_or(skv, |r| r.min(skv)) };
        (left, right)
    }

    pub fn with_soft_cap(self, cap: f32) -> Self {
        AttentionParams { soft_cap: Some(cap), ..self }
    }
}

/// Segment ids: int32 `q [B, Sq]` and `kv [B, Skv]`; a query attends only to keys with its id.
#[derive(Clone, Debug)]
pub struct SegmentIds {
    pub q: Array,
    pub kv: Array,
}

/// Rows per q block and per kv block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBlocks {
    pub block_q: usize,
    pub block_kv: usize,
}

/// `[bq, bk]` f32 temporaries a step keeps live (scores, probabilities, mask, `ds`...):
/// Mosaic places them in its internal VMEM scratch, inside the scoped limit.
const FWD_TEMPS: usize = 4;
const BWD_TEMPS: usize = 6;

/// VMEM of one step at blocks `(bq, bk)`: windows double-buffered, scratch, temporaries.
fn vmem_estimate(bq: usize, bk: usize, d: usize, dtype: DType, segmented: bool, backward: bool, target: &Target) -> usize {
    let t = target;
    let qb = t.padded_bytes(dtype, &[bq, d]);
    let kb = t.padded_bytes(dtype, &[bk, d]);
    let col = t.padded_bytes(DType::F32, &[bq, 1]);
    let seg = if segmented { t.padded_bytes(DType::I32, &[bq, 1]) + t.padded_bytes(DType::I32, &[1, bk]) } else { 0 };
    let scores = t.padded_bytes(DType::F32, &[bq, bk]);
    if backward {
        // dkv kernel (the larger): q, do, lse, di, k, v in; dk, dv out; two f32 accumulators.
        2 * (2 * qb + 2 * col + 4 * kb + seg) + 2 * t.padded_bytes(DType::F32, &[bk, d]) + BWD_TEMPS * scores
    } else {
        2 * (2 * qb + 2 * kb + col + seg) + 2 * col + t.padded_bytes(DType::F32, &[bq, d]) + FWD_TEMPS * scores
    }
}

/// Default blocks for attention over `sq` queries and `skv` keys of head dim `d` on `target`.
///
/// Rule: `2 x MXU` rows per block, i.e. 256 on v5e/v5p (128-wide MXU) and 512 on v6e/tpu7x
/// (256-wide): the `[bq, bk]` score tile is then 2 x 2 MXU passes per `D` chunk, enough
/// that the MXU work per step hides the VPU/EUP softmax work on the previous tile and the
/// ~0.35 us step overhead, while causal skipping still drops nearly half the tiles. A
/// sequence shorter than that takes one whole-length block (always legal); a longer one
/// need not be a multiple (the edge block is masked). Then halve `bk`, then `bq` (never
/// below 128) until the step's VMEM ([`vmem_estimate`]: double-buffered windows, scratch
/// and the `[bq, bk]` f32 temporaries) fits 3/4 of the default scoped VMEM. The backward
/// uses the same rule with its larger footprint.
pub fn default_blocks(sq: usize, skv: usize, d: usize, dtype: DType, segmented: bool, backward: bool, target: &Target) -> AttentionBlocks {
    let base = 2 * target.mxu;
    let mut bq = sq.min(base);
    let mut bk = skv.min(base);
    let budget = target.default_scoped_vmem_bytes * 3 / 4;
    fit_blocks(&mut [(&mut bk, skv.next_multiple_of(base)), (&mut bq, sq.next_multiple_of(base))], budget, |b| vmem_estimate(b[1], b[0], d, dtype, segmented, backward, target));
    AttentionBlocks { block_q: bq, block_kv: bk }
}

// ---- checks ---------------------------------------------------------------------------------

fn err(op: &str, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
    KernelError::new(op, subject, rule, message, help)
}

/// `(B, H, Hkv, Sq, Skv, D)` of `q`, `k`, `v`, checked.
pub(crate) fn dims(op: &str, q: &Type, k: &Type, v: &Type) -> Result<(usize, usize, usize, usize, usize, usize), KernelError> {
    let (&[b, h, sq, d], &[bk, hkv, skv, dk]) = (&q.shape[..], &k.shape[..]) else {
        return Err(err(op, "operands `q`, `k`", "operand-shape", format!("q is {:?} and k is {:?}", q.shape, k.shape), "pass q as [B, H, Sq, D] and k, v as [B, Hkv, Skv, D]"));
    };
    if v.shape != k.shape {
        return Err(err(op, "operand `v`", "operand-shape", format!("v is {:?}, k is {:?}", v.shape, k.shape), "pass k and v of the same shape [B, Hkv, Skv, D]"));
    }
    if bk != b || dk != d {
        return Err(err(op, "operand `k`", "operand-shape", format!("q is {:?} and k is {:?}", q.shape, k.shape), "k needs q's batch and head dim: [B, Hkv, Skv, D]"));
    }
    if hkv == 0 || h % hkv != 0 {
        return Err(err(op, "operand `k`", "operand-shape", format!("{h} query heads over {hkv} kv heads"), "the number of query heads must be a multiple of the number of kv heads (GQA)"));
    }
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(err(op, "operands `q`, `k`, `v`", "operand-dtype", format!("q is {}, k is {}, v is {}", q.dtype, k.dtype, v.dtype), "pass f32 or bf16 q, k, v of one dtype"));
    }
    Ok((b, h, hkv, sq, skv, d))
}

fn check_blocks(op: &str, blocks: AttentionBlocks, sq: usize, skv: usize) -> Result<(), KernelError> {
    // Named as the op's statics `block_q` / `block_kv`, which set explicit blocks.
    let AttentionBlocks { block_q, block_kv } = blocks;
    for (name, block, len, dim) in [("block_q", block_q, sq, "Sq"), ("block_kv", block_kv, skv, "Skv")] {
        if block == 0 || block > len {
            return Err(err(op, format!("argument `{name}`"), "block-shape", format!("{name} = {block} for {dim} = {len}"), format!("use a {name} between 1 and {len} (the sequence length), or None for the defaults")));
        }
    }
    Ok(())
}

/// The kernels' segment-id operand types: `[B, Sq, 1]`, `[B, 1, Skv]`, or 1-element dummies.
pub(crate) fn segment_types(segmented: bool, b: usize, sq: usize, skv: usize) -> (Type, Type) {
    if segmented {
        (Type::vector(DType::I32, &[b, sq, 1]), Type::vector(DType::I32, &[b, 1, skv]))
    } else {
        (Type::vector(DType::I32, &[1, 1, 1]), Type::vector(DType::I32, &[1, 1, 1]))
    }
}

pub(crate) fn cap_of(params: &AttentionParams) -> f32 {
    params.soft_cap.unwrap_or(0.0)
}

pub(crate) fn check_cap(op: &str, params: &AttentionParams) -> Result<(), KernelError> {
    match params.soft_cap {
        Some(c) if !(c > 0.0 && c.is_finite()) => Err(err(op, "soft_cap", "soft-cap", format!("soft cap {c}"), "use a positive, finite soft cap, or None")),
        _ => Ok(()),
    }
}

// ---- building -------------------------------------------------------------------------------

/// The dims, segment-id types and blocks of a checked attention problem.
struct Checked {
    b: usize,
    h: usize,
    sq: usize,
    qs: Type,
    ks: Type,
    bq: usize,
    bk: usize,
}

/// Checks the operand types, blocks and soft cap of op `op`.
fn checked(op: &str, q: &Type, k: &Type, v: &Type, segmented: bool, params: &AttentionParams, blocks: AttentionBlocks) -> Result<Checked, KernelError> {
    let (b, h, _, sq, skv, _) = dims(op, q, k, v)?;
    check_blocks(op, blocks, sq, skv)?;
    check_cap(op, params)?;
    let (qs, ks) = segment_types(segmented, b, sq, skv);
    Ok(Checked { b, h, sq, qs, ks, bq: blocks.block_q, bk: blocks.block_kv })
}

/// The forward kernel for these types and blocks: outputs `o` of q's dtype and, with
/// `save_lse`, `lse` f32 `[B, H, Sq, 1]` (what the backward reads). Without it the kernel has
/// `o` alone: no lse store, no lse window to pipeline, no XLA copy of it (libtpu: 1-5% of the
/// forward's cycles, measured on the 2048-token problems of `tpu_vs_pallas`).
#[allow(clippy::too_many_arguments)]
pub fn build_flash_attention(q: &Type, k: &Type, v: &Type, segmented: bool, params: &AttentionParams, blocks: AttentionBlocks, save_lse: bool, target: &Target) -> Result<Kernel, KernelError> {
    let Checked { b, h, sq, qs, ks, bq, bk, .. } = checked("flash_attention", q, k, v, segmented, params, blocks)?;
    let (left, right) = params.extents(sq, k.shape[2]);
    let kernel = flash_attention_fwd_kernel(
        q.clone(),
        k.clone(),
        v.clone(),
        qs,
        ks,
        q.clone(),
        Type::vector(DType::F32, &[b, h, sq, 1]),
        bq,
        bk,
        left,
        right,
        segmented,
        params.sm_scale,
        cap_of(params),
        save_lse,
    )?;
    Ok(fit_vmem_limit(lse_kept(kernel, save_lse)?, target))
}

/// A forward kernel (flash or splash) as built, or without its lse output when `save_lse`
/// is off (its static flag removed the store: [`Kernel::without_output`]).
pub(crate) fn lse_kept(kernel: Kernel, save_lse: bool) -> Result<Kernel, KernelError> {
    if save_lse {
        return Ok(kernel);
    }
    let name = kernel.name.clone();
    kernel.without_output("lse").ok_or_else(|| err(&name, "output `lse`", "plan-consistency", "the kernel still writes lse", "report this as a Tessera bug"))
}

/// A forward plan's result shapes: `o` as the kernel writes it and, with `save_lse`, lse
/// reshaped from the kernel's `[b, h, sq, 1]` column to `[b, h, sq]`.
pub(crate) fn forward_results(save_lse: bool, b: usize, h: usize, sq: usize) -> Vec<Option<Vec<usize>>> {
    if save_lse { vec![None, Some(vec![b, h, sq])] } else { vec![None] }
}

/// The `di` kernel for `q`'s shape and dtype (`col`: di's f32 `[b, h, sq, 1]`). It streams
/// rows and its cost is per grid step, so its block is not the attention's `bq` but as many
/// rows as 4 MiB of double-buffered windows hold (o and do, di padded to 128 lanes), or all
/// of sq: libtpu, v5e `[1, 8, 2048, 128]` bf16, 89.8k cycles at 128 rows, 13.0k at 2048.
pub(crate) fn build_di(q: &Type, col: &Type) -> Result<Kernel, KernelError> {
    let (sq, d) = (q.shape[2], q.shape[3]);
    let per_row = 2 * (2 * d.next_multiple_of(128) * q.dtype.bytes() + 128 * 4);
    let cap = ((4 << 20) / per_row).max(8) / 8 * 8;
    flash_attention_di_kernel(q.clone(), q.clone(), col.clone(), sq.min(cap))
}

/// The three backward kernels (di, dkv, dq) for these types and blocks.
pub fn build_flash_attention_bwd(q: &Type, k: &Type, v: &Type, segmented: bool, params: &AttentionParams, blocks: AttentionBlocks, target: &Target) -> Result<Vec<Kernel>, KernelError> {
    let Checked { b, h, sq, qs, ks, bq, bk } = checked("flash_attention_bwd", q, k, v, segmented, params, blocks)?;
    let col = Type::vector(DType::F32, &[b, h, sq, 1]);
    let (left, right) = params.extents(sq, k.shape[2]);
    let (scale, cap) = (params.sm_scale, cap_of(params));
    let di = build_di(q, &col)?;
    let dkv = flash_attention_dkv_kernel(q.clone(), k.clone(), v.clone(), qs.clone(), ks.clone(), q.clone(), col.clone(), col.clone(), k.clone(), v.clone(), bq, bk, left, right, segmented, scale, cap)?;
    let dq = flash_attention_dq_kernel(q.clone(), k.clone(), v.clone(), qs, ks, q.clone(), col.clone(), col, q.clone(), bq, bk, left, right, segmented, scale, cap)?;
    Ok(vec![fit_vmem_limit(di, target), fit_vmem_limit(dkv, target), fit_vmem_limit(dq, target)])
}

/// The default forward blocks for these types.
pub fn default_forward_blocks(q: &Type, k: &Type, segmented: bool, target: &Target) -> AttentionBlocks {
    let at = |t: &Type, i: usize| t.shape.get(i).copied().unwrap_or(1).max(1);
    default_blocks(at(q, 2), at(k, 2), at(q, 3), q.dtype, segmented, false, target)
}

/// The default backward blocks for these types.
pub fn default_backward_blocks(q: &Type, k: &Type, segmented: bool, target: &Target) -> AttentionBlocks {
    let at = |t: &Type, i: usize| t.shape.get(i).copied().unwrap_or(1).max(1);
    default_blocks(at(q, 2), at(k, 2), at(q, 3), q.dtype, segmented, true, target)
}

// ---- running (through the op table) -----------------------------------------------------------

fn flag(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// The statics string of `params` (and `blocks`, when given).
fn statics_of(params: &AttentionParams, blocks: Option<AttentionBlocks>) -> String {
    let mut s = format!("causal={}, sm_scale={:?}", flag(params.causal), params.sm_scale as f64);
    if let Some(cap) = params.soft_cap {
        s += &format!(", soft_cap={:?}", cap as f64);
    }
    if let Some(l) = params.window_left {
        s += &format!(", window_left={l}");
    }
    if let Some(r) = params.window_right {
        s += &format!(", window_right={r}");
    }
    if let Some(b) = blocks {
        s += &format!(", block_q={}, block_kv={}", b.block_q, b.block_kv);
    }
    s
}

#[allow(clippy::too_many_arguments)]
fn forward(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, blocks: Option<AttentionBlocks>, target: &Target) -> Result<(Array, Array), KernelError> {
    let op = crate::op_named("flash_attention_fwd")?;
    let mut inputs = vec![Some(q), Some(k), Some(v)];
    inputs.extend(segment_ids.map_or([None, None], |s| [Some(&s.q), Some(&s.kv)]));
    let mut out = op.run(exec, &inputs, &op.statics(&statics_of(params, blocks))?, target)?.into_iter();
    out.next().zip(out.next()).ok_or_else(|| err(op.name, "outputs", "output-count", "expected 2 results", "report this as a library bug"))
}

/// Flash attention with explicit blocks: `(o, lse)`, `o` of q's dtype `[B, H, Sq, D]`,
/// `lse` f32 `[B, H, Sq]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_with_blocks(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, blocks: AttentionBlocks, target: &Target) -> Result<(Array, Array), KernelError> {
    forward(exec, q, k, v, segment_ids, params, Some(blocks), target)
}

/// Flash attention with `target`'s default blocks.
pub fn flash_attention(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, target: &Target) -> Result<(Array, Array), KernelError> {
    forward(exec, q, k, v, segment_ids, params, None, target)
}

#[allow(clippy::too_many_arguments)]
fn backward(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, o: &Array, lse: &Array, dout: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, blocks: Option<AttentionBlocks>, target: &Target) -> Result<(Array, Array, Array), KernelError> {
    let op = crate::op_named("flash_attention_bwd")?;
    let mut inputs = vec![Some(q), Some(k), Some(v), Some(o), Some(lse), Some(dout)];
    inputs.extend(segment_ids.map_or([None, None], |s| [Some(&s.q), Some(&s.kv)]));
    let mut out = op.run(exec, &inputs, &op.statics(&statics_of(params, blocks))?, target)?.into_iter();
    match (out.next(), out.next(), out.next()) {
        (Some(dq), Some(dk), Some(dv)) => Ok((dq, dk, dv)),
        _ => Err(err(op.name, "outputs", "output-count", "expected 3 results", "report this as a library bug")),
    }
}

/// The gradients `(dq, dk, dv)` of `sum(o * do)` with explicit blocks, from the forward's
/// `o` and `lse` (`[B, H, Sq]` or `[B, H, Sq, 1]`).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_bwd_with_blocks(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, o: &Array, lse: &Array, dout: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, blocks: AttentionBlocks, target: &Target) -> Result<(Array, Array, Array), KernelError> {
    backward(exec, q, k, v, o, lse, dout, segment_ids, params, Some(blocks), target)
}

/// The backward with `target`'s default (backward) blocks.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_bwd(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, o: &Array, lse: &Array, dout: &Array, segment_ids: Option<&SegmentIds>, params: &AttentionParams, target: &Target) -> Result<(Array, Array, Array), KernelError> {
    backward(exec, q, k, v, o, lse, dout, segment_ids, params, None, target)
}

// ---- ops ------------------------------------------------------------------------------------

/// The attention statics `(causal, sm_scale, soft_cap, window_left, window_right)` of a
/// call (a negative extent is an `option-value` error naming the argument).
fn attention_params(c: &Call, q: &Type) -> Result<AttentionParams, KernelError> {
    let d = q.shape.get(3).copied().unwrap_or(1);
    let mut params = AttentionParams::new(d, c.statics.bool("causal"));
    if let Some(s) = c.statics.f64("sm_scale") {
        params.sm_scale = finite_scale(c, s)?;
    }
    params.soft_cap = c.statics.f64("soft_cap").map(|x| x as f32);
    params.window_left = c.usize_opt("window_left")?;
    params.window_right = c.usize_opt("window_right")?;
    Ok(params)
}

/// `sm_scale` as the kernels' f32: a NaN or infinite scale (or one beyond f32) makes every
/// score NaN or infinite, which no softmax can mean.
pub(crate) fn finite_scale(c: &Call, s: f64) -> Result<f32, KernelError> {
    let f = s as f32;
    if !f.is_finite() {
        return Err(c.err("argument `sm_scale`", "option-value", format!("sm_scale = {s}"), "pass a finite softmax scale (default 1/sqrt(head_dim))"));
    }
    Ok(f)
}

/// The kernels' segment-id operands: the given ids as a `[B, Sq, 1]` column and a
/// `[B, 1, Skv]` row, or the host's 1-element dummies (host arrays 0 and 1).
pub(crate) fn segment_operands(c: &Call, b: usize, sq: usize, skv: usize) -> Result<(bool, [Operand; 2]), KernelError> {
    match (c.given("q_segment_ids"), c.given("kv_segment_ids")) {
        (false, false) => {
            let dummy = Type::vector(DType::I32, &[1, 1, 1]);
            Ok((false, [host(0, dummy.clone()), host(1, dummy)]))
        }
        // Their dtype and `[b, sq]` / `[b, skv]` shapes are the op's contract, checked.
        (true, true) => Ok((true, [c.input("q_segment_ids", Type::vector(DType::I32, &[b, sq, 1]))?, c.input("kv_segment_ids", Type::vector(DType::I32, &[b, 1, skv]))?])),
        _ => Err(c.err("input `q_segment_ids`", "segment-ids", "only one of q_segment_ids and kv_segment_ids is given", "pass both or neither")),
    }
}

/// Host arrays 0 and 1: the kernels' placeholder segment ids when none are given.
pub(crate) fn dummy_segments() -> Vec<Array> {
    vec![Array::from_i32(&[1, 1, 1], vec![0]), Array::from_i32(&[1, 1, 1], vec![0])]
}

/// q, k and v (`[b, h, sq, d]` and `[b, hkv, skv, d]`: the op's contract, checked).
fn qkv(c: &Call) -> Result<(Type, Type, Type), KernelError> {
    Ok((c.tensor("q")?.clone(), c.tensor("k")?.clone(), c.tensor("v")?.clone()))
}

/// `block_q` / `block_kv` from the statics, else `default`.
fn blocks_of(c: &Call, default: AttentionBlocks) -> Result<AttentionBlocks, KernelError> {
    Ok(AttentionBlocks { block_q: c.usize_opt("block_q")?.unwrap_or(default.block_q), block_kv: c.usize_opt("block_kv")?.unwrap_or(default.block_kv) })
}

/// A sliding window's band as splash metadata, when walking the band instead of every kv
/// block saves grid steps ([`crate::splash::band_info`]): the blocks are checked first, as
/// flash attention's own kernels check them.
fn band(c: &Call, params: &AttentionParams, blocks: AttentionBlocks, sq: usize, skv: usize) -> Result<Option<crate::splash::MaskInfo>, KernelError> {
    check_blocks(c.op, blocks, sq, skv)?;
    let (left, right) = params.extents(sq, skv);
    crate::splash::band_info(sq, skv, blocks.block_q, blocks.block_kv, left, right)
}

fn plan_flash_attention_fwd(c: &Call) -> Result<Plan, KernelError> {
    plan_forward(c, true)
}

/// `flash_attention`'s own plan: `o` alone, from a kernel that does not write lse.
fn plan_flash_attention(c: &Call) -> Result<Plan, KernelError> {
    plan_forward(c, false)
}

fn plan_forward(c: &Call, save_lse: bool) -> Result<Plan, KernelError> {
    let (q, k, v) = qkv(c)?;
    let params = attention_params(c, &q)?;
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    let (segmented, [qs, ks]) = segment_operands(c, b, sq, k.shape[2])?;
    let blocks = blocks_of(c, default_forward_blocks(&q, &k, segmented, c.target))?;
    if let Some(info) = band(c, &params, blocks, sq, k.shape[2])? {
        return crate::splash::plan_band_fwd(c, &params, &info, save_lse);
    }
    let kernel = build_flash_attention(&q, &k, &v, segmented, &params, blocks, save_lse, c.target)?;
    let plan = single(c, kernel, vec![c.input("q", q)?, c.input("k", k)?, c.input("v", v)?, qs, ks], &forward_results(save_lse, b, h, sq));
    Ok(if segmented { plan } else { plan.with_host(dummy_segments()) })
}

fn plan_flash_attention_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (q, k, v) = qkv(c)?;
    let params = attention_params(c, &q)?;
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    // Shapes (lse `[b, h, sq]` or `[b, h, sq, 1]`, float32) are the op's contract; o and do
    // are also read with q's dtype.
    for name in ["o", "do"] {
        let t = c.tensor(name)?;
        if t.dtype != q.dtype {
            return Err(c.err(format!("input `{name}`"), "operand-dtype", format!("{name} is {t}, q is {q}"), format!("pass {name} of q's dtype ({})", q.dtype)));
        }
    }
    let (segmented, [qs, ks]) = segment_operands(c, b, sq, k.shape[2])?;
    let blocks = blocks_of(c, default_backward_blocks(&q, &k, segmented, c.target))?;
    if let Some(info) = band(c, &params, blocks, sq, k.shape[2])? {
        return crate::splash::plan_band_bwd(c, &params, &info);
    }
    let kernels = build_flash_attention_bwd(&q, &k, &v, segmented, &params, blocks, c.target)?;
    let col = Type::vector(DType::F32, &[b, h, sq, 1]);
    let (o, lse, dout) = (c.input("o", q.clone())?, c.input("lse", col.clone())?, c.input("do", q.clone())?);
    let di = result(0, 0, col);
    let main = vec![c.input("q", q.clone())?, c.input("k", k.clone())?, c.input("v", v.clone())?, qs, ks, dout.clone(), lse, di];
    let [di_k, dkv_k, dq_k]: [Kernel; 3] = kernels.try_into().map_err(|_| c.err("kernels", "plan-consistency", "the backward builds three kernels", "report this as a Tessera bug"))?;
    let launches = vec![Launch::new(di_k, vec![o, dout]), Launch::new(dkv_k, main.clone()), Launch::new(dq_k, main)];
    let results = vec![result(2, 0, q), result(1, 0, k), result(1, 1, v)];
    let plan = Plan::new(c.op, c.target, launches, results);
    Ok(if segmented { plan } else { plan.with_host(dummy_segments()) })
}

/// Segment ids for `b` sequences: ids that increase along the sequence in random runs, the
/// same segmentation of positions for queries and keys, every boundary below
/// `min(Sq, Skv)` so each query sees at least one key (its segment's first position) under
/// the causal rule too.
pub fn random_segment_ids(b: usize, sq: usize, skv: usize, rng: &mut StdRng) -> SegmentIds {
    let span = sq.min(skv).max(1);
    let (mut qs, mut ks) = (Vec::with_capacity(b * sq), Vec::with_capacity(b * skv));
    for _ in 0..b {
        // No boundary fits below a span of 1 (a one-key sequence): one segment.
        let n_cuts = if span >= 2 { rng.gen_range(1..=4) } else { 0 };
        let mut cuts: Vec<usize> = (0..n_cuts).map(|_| rng.gen_range(1..span)).collect();
        cuts.sort_unstable();
        let seg = |p: usize| cuts.iter().filter(|&&c| c <= p).count() as i32;
        qs.extend((0..sq).map(seg));
        ks.extend((0..skv).map(seg));
    }
    SegmentIds { q: Array::from_i32(&[b, sq], qs), kv: Array::from_i32(&[b, skv], ks) }
}

/// q, k in [-2, 2) (logits spread enough to exercise the running max), v in [-1, 1);
/// segment ids from [`random_segment_ids`] when their shapes are given.
fn forward_inputs(shapes: &[Vec<usize>], dtype: DType, _: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let n = |s: &Vec<usize>| s.iter().product::<usize>();
    let mut a = vec![
        Array::from_f32_in(dtype, &shapes[0], harness::uniform(n(&shapes[0]), 2.0, rng)),
        Array::from_f32_in(dtype, &shapes[1], harness::uniform(n(&shapes[1]), 2.0, rng)),
        Array::from_f32_in(dtype, &shapes[2], harness::uniform(n(&shapes[2]), 1.0, rng)),
    ];
    if shapes.len() > 3 {
        let s = random_segment_ids(shapes[0][0], shapes[0][2], shapes[1][2], rng);
        a.extend([s.q, s.kv]);
    }
    a
}

/// The reference problem of forward inputs `(q, k, v, [segments])` or backward inputs
/// `(q, k, v, o, lse, do, [segments])`.
fn reference_params(a: &[Array], s: &Statics, segmented: bool) -> reference::Attention {
    let (q, k) = (&a[0].shape, &a[1].shape);
    let seg = |i: usize| segmented.then(|| a[i].as_i32().unwrap_or(&[]).to_vec());
    let at = a.len().saturating_sub(2);
    reference::Attention {
        b: q[0],
        h: q[1],
        hkv: k[1],
        sq: q[2],
        skv: k[2],
        d: q[3],
        causal: s.bool("causal"),
        sm_scale: s.f64("sm_scale").map_or(1.0 / (q[3] as f64).sqrt(), |x| x as f32 as f64),
        soft_cap: s.f64("soft_cap").map(|x| x as f32 as f64),
        q_segments: seg(at),
        kv_segments: seg(at + 1),
        window_left: s.i64("window_left").map(|x| x as usize),
        window_right: s.i64("window_right").map(|x| x as usize),
        mask: None,
    }
}

/// Forward inputs plus the reference forward's `o` (rounded to the dtype), `lse` (f32) and
/// a random `do`; segment ids last.
fn backward_inputs(shapes: &[Vec<usize>], dtype: DType, s: &Statics, rng: &mut StdRng) -> Vec<Array> {
    let segmented = shapes.len() > 6;
    let fwd_shapes: Vec<Vec<usize>> = shapes[..3].iter().chain(shapes.get(6..).unwrap_or(&[])).cloned().collect();
    let mut fwd = forward_inputs(&fwd_shapes, dtype, s, rng);
    let cfg = reference_params(&fwd, s, segmented);
    let (o, lse) = reference::forward(&cfg, &fwd[0].to_f64_vec(), &fwd[1].to_f64_vec(), &fwd[2].to_f64_vec());
    let q_shape = shapes[0].clone();
    let seg: Vec<Array> = fwd.drain(3..).collect();
    fwd.push(Array::from_f32_in(dtype, &q_shape, o.iter().map(|&x| x as f32).collect()));
    // lse as requested: `[b, h, sq]` or `[b, h, sq, 1]`.
    fwd.push(Array::from_f32(&shapes[4], lse.iter().map(|&x| x as f32).collect()));
    fwd.push(Array::from_f32_in(dtype, &q_shape, harness::uniform(q_shape.iter().product(), 1.0, rng)));
    fwd.extend(seg);
    fwd
}

fn ref_forward(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let cfg = reference_params(a, s, a.len() > 3);
    let (o, lse) = reference::forward(&cfg, &a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec());
    vec![o, lse]
}

fn ref_backward(a: &[Array], s: &Statics) -> Vec<Vec<f64>> {
    let cfg = reference_params(a, s, a.len() > 6);
    let (dq, dk, dv) = reference::backward(&cfg, &a[0].to_f64_vec(), &a[1].to_f64_vec(), &a[2].to_f64_vec(), &a[5].to_f64_vec());
    vec![dq, dk, dv]
}

const Q: Input = Input { name: "q", dims: "[b, h, sq, d]", kind: Kind::Float };
const K: Input = Input { name: "k", dims: "[b, hkv, skv, d]", kind: Kind::Float };
const V: Input = Input { name: "v", dims: "[b, hkv, skv, d]", kind: Kind::Float };
const Q_SEG: Input = Input { name: "q_segment_ids", dims: "[b, sq]", kind: Kind::Int32 };
const KV_SEG: Input = Input { name: "kv_segment_ids", dims: "[b, skv]", kind: Kind::Int32 };
const FWD_SCHEMA: &str = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None, int? window_left=None, int? window_right=None, int? block_q=None, int? block_kv=None) -> (Tensor, Tensor)";
const FWD_DOC: &str = "flash attention: (o [b, h, sq, d], float32 lse [b, h, sq]); q [b, h, sq, d], k and v [b, hkv, skv, d] (GQA: h % hkv == 0); online softmax in f32 VMEM scratch over the kv axis, causal and sliding-window blocks skipped (body and DMA), soft cap, segment ids, window_left / window_right (query r sees key c iff r - c <= window_left and c - r <= window_right; HF's sliding_window w is window_left = w - 1)";
const FWD_OUTPUTS: &[Output] = &[Output { name: "o", shape: "q", dtype: "q" }, Output { name: "lse", shape: "[*q[:3]]", dtype: "f32" }];
/// Default shapes `[1, 8, 1024, 128]`; alt: GQA 4:1, D = 64, Sq != Skv and neither a
/// multiple of the blocks; segmented: `[2, 8, 1024, 128]` over 2 kv heads, soft cap 50
/// (Gemma 2's); window: a causal sliding window of 301 keys (no multiple of the blocks) over
/// 2 kv heads (the backward's: non-causal, 300 keys left and 100 right).
const FWD_CASES: &[Case] = &[
    Case { name: "causal", statics: "causal=True", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128]] },
    Case { name: "causal_alt", statics: "causal=True", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64]] },
    Case { name: "noncausal", statics: "", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128]] },
    Case { name: "noncausal_alt", statics: "", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64]] },
    Case { name: "segmented", statics: "causal=True, soft_cap=50.0", shapes: &[&[2, 8, 1024, 128], &[2, 2, 1024, 128], &[2, 2, 1024, 128], &[2, 1024], &[2, 1024]] },
    Case { name: "segmented_alt", statics: "causal=True, soft_cap=50.0", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[2, 700], &[2, 1000]] },
    Case { name: "window", statics: "causal=True, window_left=300", shapes: &[&[1, 8, 1024, 128], &[1, 2, 1024, 128], &[1, 2, 1024, 128]] },
];
const BWD_CASES: &[Case] = &[
    Case { name: "causal", statics: "causal=True", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024], &[1, 8, 1024, 128]] },
    Case { name: "causal_alt", statics: "causal=True", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[2, 8, 700, 64], &[2, 8, 700], &[2, 8, 700, 64]] },
    Case { name: "noncausal", statics: "", shapes: &[&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024], &[1, 8, 1024, 128]] },
    Case { name: "noncausal_alt", statics: "", shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[2, 8, 700, 64], &[2, 8, 700], &[2, 8, 700, 64]] },
    Case {
        name: "segmented",
        statics: "causal=True, soft_cap=50.0",
        shapes: &[&[2, 8, 1024, 128], &[2, 2, 1024, 128], &[2, 2, 1024, 128], &[2, 8, 1024, 128], &[2, 8, 1024], &[2, 8, 1024, 128], &[2, 1024], &[2, 1024]],
    },
    Case {
        name: "segmented_alt",
        statics: "causal=True, soft_cap=50.0",
        shapes: &[&[2, 8, 700, 64], &[2, 2, 1000, 64], &[2, 2, 1000, 64], &[2, 8, 700, 64], &[2, 8, 700], &[2, 8, 700, 64], &[2, 700], &[2, 1000]],
    },
    Case { name: "window", statics: "window_left=300, window_right=100", shapes: &[&[1, 8, 1024, 128], &[1, 2, 1024, 128], &[1, 2, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024], &[1, 8, 1024, 128]] },
];

/// This module's ops.
pub const OPS: &[Op] = &[
    Op {
        name: "flash_attention_fwd", doc: FWD_DOC, schema: FWD_SCHEMA, plan: plan_flash_attention_fwd, reference: Some(ref_forward), knobs: crate::tune::ATTENTION,
        inputs: &[Q, K, V, Q_SEG, KV_SEG], outputs: FWD_OUTPUTS,
        backward: Some(Backward { op: "flash_attention_bwd", args: "q, k, v, o, lse, d_o, causal, sm_scale, soft_cap, q_segment_ids, kv_segment_ids, window_left, window_right", grads: &["q", "k", "v"] }),
        cases: FWD_CASES, random: Some(forward_inputs), ..Op::EMPTY
    },
    Op {
        name: "flash_attention_bwd", doc: "(dq, dk, dv) of flash attention: di = rowsum(do * o), a dkv kernel summing a kv head's query heads in VMEM, a dq kernel", schema: "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None, int? window_left=None, int? window_right=None, int? block_q=None, int? block_kv=None) -> (Tensor, Tensor, Tensor)", plan: plan_flash_attention_bwd, reference: Some(ref_backward), knobs: crate::tune::ATTENTION,
        inputs: &[Q, K, V, Input { name: "o", dims: "[b, h, sq, d]", kind: Kind::Float }, Input { name: "lse", dims: "[b, h, sq, 1?]", kind: Kind::Float32 }, Input { name: "do", dims: "[b, h, sq, d]", kind: Kind::Float }, Q_SEG, KV_SEG], outputs: &[Output { name: "dq", shape: "q", dtype: "q" }, Output { name: "dk", shape: "k", dtype: "k" }, Output { name: "dv", shape: "v", dtype: "v" }],
        cases: BWD_CASES, random: Some(backward_inputs), ..Op::EMPTY
    },
    Op {
        name: "flash_attention", doc: "flash attention's output o (differentiable; torch_xla's signature), flash_attention_fwd's first result", schema: "(Tensor q, Tensor k, Tensor v, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None, int? window_left=None, int? window_right=None, int? block_q=None, int? block_kv=None) -> Tensor",
        inputs: &[Q, K, V, Q_SEG, KV_SEG], outputs: &[Output { name: "o", shape: "q", dtype: "q" }],
        alias_of: Some(("flash_attention_fwd", 0)), alias_plan: Some(plan_flash_attention), knobs: crate::tune::ATTENTION, ..Op::EMPTY
    },
];

/// Independent f64 references: explicit scores, mask, softmax and weighted sum per query
/// row, and the explicit backward formulas. They share no code with the kernels.
pub mod reference {
    /// An attention problem: shapes and options. `q_segments`/`kv_segments` are `[b, sq]` /
    /// `[b, skv]` ids when given.
    #[derive(Clone, Debug)]
    pub struct Attention {
        pub b: usize,
        pub h: usize,
        pub hkv: usize,
        pub sq: usize,
        pub skv: usize,
        pub d: usize,
        pub causal: bool,
        pub sm_scale: f64,
        pub soft_cap: Option<f64>,
        pub q_segments: Option<Vec<i32>>,
        pub kv_segments: Option<Vec<i32>>,
        /// Row `r` sees key `c` only if `r - c <= left` / `c - r <= right`, when given.
        pub window_left: Option<usize>,
        pub window_right: Option<usize>,
        /// An explicit mask `(heads, [heads, sq, skv])` (splash attention's): `heads` is 1
        /// (shared) or `h` (one per query head).
        pub mask: Option<(usize, Vec<bool>)>,
    }

    impl Attention {
        fn visible(&self, b: usize, h: usize, r: usize, c: usize) -> bool {
            let mask_ok = self.mask.as_ref().is_none_or(|(heads, m)| m[((if *heads == 1 { 0 } else { h }) * self.sq + r) * self.skv + c]);
            let causal_ok = !self.causal || c <= r;
            let (ri, ci) = (r as i64, c as i64);
            let window_ok = self.window_left.is_none_or(|l| ri - ci <= l as i64) && self.window_right.is_none_or(|w| ci - ri <= w as i64);
            let seg_ok = match (&self.q_segments, &self.kv_segments) {
                (Some(qs), Some(ks)) => qs[b * self.sq + r] == ks[b * self.skv + c],
                _ => true,
            };
            mask_ok && causal_ok && window_ok && seg_ok
        }

        fn q_row(&self, b: usize, h: usize, r: usize) -> usize {
            ((b * self.h + h) * self.sq + r) * self.d
        }

        fn kv_row(&self, b: usize, h: usize, c: usize) -> usize {
            let kh = h / (self.h / self.hkv);
            ((b * self.hkv + kh) * self.skv + c) * self.d
        }

        /// The raw product `x = sm_scale * q.k` and the logit `z = cap * tanh(x / cap)`
        /// (or `x`) with `dz/dx`, for every key of one query row; `None` when masked.
        fn logits(&self, q: &[f64], k: &[f64], b: usize, h: usize, r: usize) -> Vec<Option<(f64, f64)>> {
            let qr = &q[self.q_row(b, h, r)..][..self.d];
            (0..self.skv)
                .map(|c| {
                    if !self.visible(b, h, r, c) {
                        return None;
                    }
                    let kr = &k[self.kv_row(b, h, c)..][..self.d];
                    let x = self.sm_scale * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                    Some(match self.soft_cap {
                        Some(cap) => {
                            let t = (x / cap).tanh();
                            (cap * t, 1.0 - t * t)
                        }
                        None => (x, 1.0),
                    })
                })
                .collect()
        }

        /// Softmax probabilities of one row (0 where masked) and its logsumexp, as torch's
        /// SDPA's safe softmax and logsumexp over the visible logits: with a NaN logit or a
        /// max of +inf (`exp(inf - inf)`), every visible probability is NaN, the logsumexp
        /// NaN or +inf. No visible key, or all visible logits -inf: probabilities 0, lse -inf.
        fn probs(&self, z: &[Option<(f64, f64)>]) -> (Vec<f64>, f64) {
            let vis: Vec<f64> = z.iter().flatten().map(|p| p.0).collect();
            if vis.is_empty() {
                return (vec![0.0; z.len()], f64::NEG_INFINITY);
            }
            let nan_row = |lse: f64| (z.iter().map(|p| if p.is_some() { f64::NAN } else { 0.0 }).collect(), lse);
            if vis.iter().any(|x| x.is_nan()) {
                return nan_row(f64::NAN);
            }
            let m = vis.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                // All visible logits -inf: SDPA's safe softmax gives the row 0.
                return (vec![0.0; z.len()], m);
            }
            if m.is_infinite() {
                return nan_row(m);
            }
            let e: Vec<f64> = z.iter().map(|p| p.map_or(0.0, |(zz, _)| (zz - m).exp())).collect();
            let sum: f64 = e.iter().sum();
            (e.iter().map(|x| x / sum).collect(), m + sum.ln())
        }
    }

    /// `(o [b, h, sq, d], lse [b, h, sq])`, summing over the visible keys only (a masked
    /// key's value never reaches the row); a row with no visible key gets `o = 0`, `lse =
    /// -inf`.
    pub fn forward(a: &Attention, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let mut o = vec![0.0; a.b * a.h * a.sq * a.d];
        let mut lse = vec![0.0; a.b * a.h * a.sq];
        for b in 0..a.b {
            for h in 0..a.h {
                for r in 0..a.sq {
                    let z = a.logits(q, k, b, h, r);
                    let (p, l) = a.probs(&z);
                    lse[(b * a.h + h) * a.sq + r] = l;
                    let out = &mut o[a.q_row(b, h, r)..][..a.d];
                    for (c, &pc) in p.iter().enumerate() {
                        if z[c].is_none() {
                            continue;
                        }
                        let vr = &v[a.kv_row(b, h, c)..][..a.d];
                        for (x, &vv) in out.iter_mut().zip(vr) {
                            *x += pc * vv;
                        }
                    }
                }
            }
        }
        (o, lse)
    }

    /// Gradients of `sum(o * do)`: with `P = softmax(Z)`, `dV = P^T dO`, `dP = dO V^T`,
    /// `dZ = P (dP - rowsum(P dP))`, `dX = dZ dz/dx`, `dQ = sm_scale dX K`, `dK = sm_scale
    /// dX^T Q`; dK, dV of a kv head summed over its query heads. Only visible (query, key)
    /// pairs contribute (select semantics, as the forward).
    pub fn backward(a: &Attention, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut dq = vec![0.0; q.len()];
        let mut dk = vec![0.0; k.len()];
        let mut dv = vec![0.0; v.len()];
        for b in 0..a.b {
            for h in 0..a.h {
                for r in 0..a.sq {
                    let z = a.logits(q, k, b, h, r);
                    let (p, _) = a.probs(&z);
                    let dor = &dout[a.q_row(b, h, r)..][..a.d];
                    let dp: Vec<f64> = (0..a.skv).map(|c| v[a.kv_row(b, h, c)..][..a.d].iter().zip(dor).map(|(x, y)| x * y).sum()).collect();
                    let pdp: f64 = (0..a.skv).filter(|&c| z[c].is_some()).map(|c| p[c] * dp[c]).sum();
                    for c in 0..a.skv {
                        let Some((_, dzdx)) = z[c] else { continue };
                        let kv = a.kv_row(b, h, c);
                        let dx = p[c] * (dp[c] - pdp) * dzdx * a.sm_scale;
                        let qr = a.q_row(b, h, r);
                        for e in 0..a.d {
                            dq[qr + e] += dx * k[kv + e];
                            dk[kv + e] += dx * q[qr + e];
                            dv[kv + e] += p[c] * dor[e];
                        }
                    }
                }
            }
        }
        (dq, dk, dv)
    }
}
