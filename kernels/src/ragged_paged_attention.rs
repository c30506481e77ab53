//! Ragged paged attention: prefill, chunked prefill and decode sequences mixed in one
//! batch over a paged KV cache (torch_xla's `ragged_paged_attention`, the vLLM-TPU shape).
//!
//! # Operands
//!
//! - `q: [T, H, D]`: the batch's query tokens, sequence after sequence; sequence `s` owns
//!   tokens `cu_q_lens[s] .. cu_q_lens[s + 1]`. Tokens from `cu_q_lens[num_seqs]` on are
//!   padding: their output is zeros.
//! - `k_pages`, `v_pages: [Hkv, num_pages, page_size, D]`, left in HBM. We take separate
//!   K and V caches (as `paged_attention`) rather than torch_xla's combined `kv_pages`:
//!   a page of one kv head is then one contiguous DMA per cache, with no strided copy to
//!   de-interleave K from V.
//! - Scalar prefetch (all i32, all in SMEM): `kv_lens: [S]`, `page_indices: [S,
//!   pages_per_seq]`, `cu_q_lens: [S + 1]`, `num_seqs: [1]`. Sequences `>= num_seqs` are
//!   ignored. Sequence `s`'s key `t` lives in page `page_indices[s, t / page_size]`, row
//!   `t % page_size`. Contract: `cu_q_lens` is non-decreasing up to `num_seqs` with
//!   `cu_q_lens[num_seqs] <= T`, `q_len_s <= kv_len_s <= pages_per_seq * page_size`, and the
//!   table entries of the pages holding a sequence's first `kv_len` keys are valid pages
//!   (later entries are never read).
//! - Static: `sm_scale` (scores are `sm_scale * q.k`), optional `sliding_window` (a query
//!   at position `p` sees keys `p - window < k <= p`), optional `soft_cap` (scores become
//!   `cap * tanh(score / cap)` before masking).
//! - A quantized cache, as `paged_attention`'s (see its module docs): int8 / fp8 pages,
//!   per-tensor `k_scale` (folded into `sm_scale`) and `v_scale` (on the output), and
//!   per-token `k_token_scales`, `v_token_scales: [Hkv, num_pages, page_size]` f32 copied
//!   beside each page and applied to the tile's rows in VMEM.
//! - Causal within a sequence: its query `i` sits at position `kv_len - q_len + i`, so a
//!   decode token (q_len 1) sees the whole cache, a prefill (q_len = kv_len) is plain
//!   causal attention and a chunked prefill continues a cached prefix. Every query sees
//!   at least its own position (the plan rejects `q_len > kv_len`).
//! - NaN and inf follow torch's math attention over each query's visible keys: a NaN in
//!   q or a visible k, a +inf logit, or visible logits all -inf make the row NaN; a
//!   nonfinite v value reaches exactly the (row, column) entries that see it (`p * inf`,
//!   NaN where `p = 0`), never another token's row, a causally earlier query or a key
//!   outside the window (see the masked blocks in the design notes).
//!
//! # Design
//!
//! Grid `(T / bq, Hkv)`, both parallel. The host views `q` as `[Hkv, G, Tp, D]` (GQA
//! group `G = H / Hkv` next to the tokens, `T` zero-padded to `Tp`, a multiple of `bq`),
//! so one step's block `[G, bq, D]` reshapes for free to `G * bq` score rows: the query
//! heads of one kv head share every K/V page fetched. A step walks `s = 0 .. num_seqs`
//! (a scalar loop over SMEM) and, for each sequence whose tokens overlap the block, its
//! kv compute blocks (`pages_per_compute_block` pages) that any of those tokens can see:
//! up to the last token's position (causal), from the first token's window start
//! (sliding window). Pages are copied by manual DMA into a two-slot VMEM buffer, block
//! `i + 1` in flight while block `i` is computed (as `paged_attention`). One online
//! softmax state per score row runs across all sequences of the block: a row outside the
//! sequence is masked (its weights are exactly 0 and its running max unchanged), so each
//! row only ever accumulates its own sequence. A kv block that every row of the q block
//! sees whole (all rows in the sequence, inside the causal reach and the window: long
//! prefills) runs without masks; any other whose pages hold a nonfinite v value
//! (`attention::holds_nonfinite`) multiplies v with those values zeroed and adds them back
//! for the rows that see them through one exact bf16 product of visibility codes
//! (`attention::add_nonfinite`), since a zero weight times an inf is NaN.
//!
//! # Cost
//!
//! - MXU: every visited kv block costs `4 * G * bq * bs * D` flops whatever the number
//!   of block rows in the sequence, so a decode token (1 row of `bq`) pays for `bq` rows.
//!   The default `bq` fills 128 score rows (`bq = 128 / G`, at least 16): 16 rows for
//!   GQA 8, 128 for MHA. Decode-heavy batches are memory-bound, so this mostly trades
//!   idle MXU cycles; a smaller `bq` helps pure decode, a larger one long prefills.
//! - HBM: a sequence's visible pages are read once per q block it overlaps (a prefill of
//!   `n` tokens reads its causal prefix `n / bq` times, as flash attention re-reads K/V),
//!   once per kv head; pages of the last compute block past `kv_len` are clamped to the
//!   sequence's last page (re-read, masked).
//! - Pipelining is per sequence: the first compute block of each sequence is not
//!   prefetched behind the previous sequence's last one (one exposed DMA per sequence
//!   and step). The scalar walk over `num_seqs` is SMEM-only and cheap.
//! - Host: `q` is transposed (and padded) into the kernel layout and the output back:
//!   `2 * T * H * D` elements each way, small next to the KV cache.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::{Array, Data};
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::attention::{add_nonfinite, holds_nonfinite, nonfinite_class, nonfinite_radix, zero_nonfinite};
use crate::harness;
use crate::op::{Call, Case, Input, Kind, Op, Output};
use crate::plan::{Launch, Layout, Operand, Plan, Source};

/// Attention of the query tokens of `q` (`[Hkv, G, Tp, D]`, the host layout of the module
/// docs) over their sequences' pages; the output has `q`'s layout.
#[tpu_kernel(
    grid = [tp / bq, hkv],
    (q, o) = block([None, g, bq, d], |qi, hi| [hi, 0, qi, 0]),
    (k_buf, v_buf) = scratch([2, ppcb, ps, d], k_pages.dtype),
    (ks_buf, vs_buf) = scratch([2, if per_token { ppcb } else { 1 }, sps, 1], f32),
    sem = semaphores(8),
)]
#[allow(clippy::too_many_arguments)]
#[rustfmt::skip]
pub fn ragged_paged_attention_kernel(
    kv_lens: Prefetch<ms>, page_indices: Prefetch<ms, pps>, cu_q_lens: Prefetch<ms1>, num_seqs: Prefetch<1>,
    q: In<hkv, g, tp, d>, k_pages: Any<hkv, np, ps, d>, v_pages: Any<hkv, np, ps, d>,
    k_scales: Any<_, _, sps, 1>, v_scales: Any<_, _, sps, 1>, o: Out<hkv, g, tp, d>,
    k_buf: Scratch, v_buf: Scratch, ks_buf: Scratch, vs_buf: Scratch, sem: Scratch,
    bq: usize,
    ppcb: usize,
    sm_scale: f32,
    window: usize,
    soft_cap: f32,
    per_token: bool,
    v_scale: f32,
) {
    let h = program_id(1);
    let q0 = program_id(0) * bq;
    let q1 = q0 + bq;
    let rows = g * bq;
    let bs = ppcb * ps;
    // Without a window every earlier key is visible: a reach far beyond any cache.
    let reach = if window > 0 { window as i32 } else { 1 << 30 };
    let qv = q[..].reshape([rows, d]);
    // Score row r is query head r / bq of token q0 + r % bq; column c is key c of a block.
    let tok = iota([rows, bs], 0) % bq + q0;
    let col = iota([rows, bs], 1);
    let mut m = full([rows, 1], f32, f32::MIN);
    let mut l = zeros([rows, 1], f32);
    let mut acc = zeros([rows, d], f32);
    for s in 0..num_seqs[0].min(ms) {
        let start = cu_q_lens[s];
        let end = cu_q_lens[s + 1];
        let kv_len = kv_lens[s];
        // Token t of the sequence is at position t - start + kv_len - q_len = t + shift.
        let shift = kv_len - end;
        let lo = start.max(q0);
        let hi = end.min(q1);
        // Keys visible to tokens lo .. hi: from lo's window start to hi - 1's position.
        let kv_end = (hi + shift).min(kv_len);
        let first = (lo + shift + 1 - reach).max(0) / bs;
        let last = (kv_end + (bs - 1)) / bs;
        // Pages past the end of the visible keys repeat the sequence's last one (masked).
        let last_page = ((kv_end + (ps - 1)) / ps - 1).min(pps - 1);
        if hi > lo && last > first {
            for j in 0..ppcb {
                let page = page_indices[(s, (first * ppcb + j).min(last_page))].max(0).min(np - 1);
                dma_start(k_pages[(h, page)], k_buf[(0, j)], sem[0]);
                dma_start(v_pages[(h, page)], v_buf[(0, j)], sem[1]);
                if per_token {
                    dma_start(k_scales[(h, page)], ks_buf[(0, j)], sem[2]);
                    dma_start(v_scales[(h, page)], vs_buf[(0, j)], sem[3]);
                }
            }
            for i in first..last {
                // Slot `sl` uses semaphores 4 sl (K), 4 sl + 1 (V), 4 sl + 2 and 4 sl + 3
                // (their per-token scales), one copy per page.
                let sl = (i - first) % 2;
                let next = 1 - sl;
                if i + 1 < last {
                    for j in 0..ppcb {
                        let page = page_indices[(s, ((i + 1) * ppcb + j).min(last_page))].max(0).min(np - 1);
                        dma_start(k_pages[(h, page)], k_buf[(next, j)], sem[4 * next]);
                        dma_start(v_pages[(h, page)], v_buf[(next, j)], sem[4 * next + 1]);
                        if per_token {
                            dma_start(k_scales[(h, page)], ks_buf[(next, j)], sem[4 * next + 2]);
                            dma_start(v_scales[(h, page)], vs_buf[(next, j)], sem[4 * next + 3]);
                        }
                    }
                }
                for j in 0..ppcb {
                    let page = page_indices[(s, (i * ppcb + j).min(last_page))].max(0).min(np - 1);
                    dma_wait(k_pages[(h, page)], k_buf[(sl, j)], sem[4 * sl]);
                    dma_wait(v_pages[(h, page)], v_buf[(sl, j)], sem[4 * sl + 1]);
                    if per_token {
                        dma_wait(k_scales[(h, page)], ks_buf[(sl, j)], sem[4 * sl + 2]);
                        dma_wait(v_scales[(h, page)], vs_buf[(sl, j)], sem[4 * sl + 3]);
                    }
                }
                // A quantized cache's pages go to the MXU in q's dtype, each row times its
                // token's scale when per_token (the per-tensor k scale is in sm_scale).
                let k = k_buf[(sl, .., .., ..)].reshape([bs, d]);
                let v = v_buf[(sl, .., .., ..)].reshape([bs, d]);
                let k = if per_token { k.cast(f32) * ks_buf[(sl, .., .., ..)].reshape([bs, 1]) } else { k };
                let v = if per_token { v.cast(f32) * vs_buf[(sl, .., .., ..)].reshape([bs, 1]) } else { v };
                let k = k.cast(q.dtype);
                let v = v.cast(q.dtype);
                let mut sc = dot_t(qv, k) * sm_scale;
                if soft_cap > 0.0 {
                    sc = (sc / soft_cap).tanh() * soft_cap;
                }
                // Every row of the block is a token of this sequence and sees every key of
                // this kv block (inside its causal reach and window): no mask, and `p @ v` is
                // math attention's product itself, nonfinite values included.
                let unmasked = (lo == q0) & (hi == q1) & (i * bs + (bs - 1) <= q0 + shift) & (i * bs > q1 - 1 + shift - reach);
                if unmasked {
                    let m_new = m.max(sc.reduce_max(1));
                    let p = (sc - m_new).exp();
                    let alpha = (m - m_new).exp();
                    l = alpha * l + p.sum(1);
                    acc = alpha * acc + dot(p.cast(q.dtype), v);
                    m = m_new;
                } else {
                    let qpos = tok + shift;
                    let kpos = col + i * bs;
                    // tok < hi also bounds qpos below kv_len, so kpos <= qpos is in the cache.
                    let visible = (tok >= lo) & (tok < hi) & (kpos <= qpos) & (kpos > qpos - reach);
                    // Masked scores are f32::MIN, not -inf, so no `-inf - -inf` NaN can arise;
                    // their weights are then zeroed exactly.
                    let sc = select(visible, sc, f32::MIN);
                    let m_new = m.max(sc.reduce_max(1));
                    let p = select(visible, (sc - m_new).exp(), 0.0);
                    let alpha = (m - m_new).exp();
                    l = alpha * l + p.sum(1);
                    // A masked key's value (another token's, or cache rows past kv_len, which
                    // hold whatever the pages do) must not meet a zero weight: if the pages
                    // hold a nonfinite value, it enters as 0 and comes back only for the rows
                    // that see it.
                    let r = nonfinite_radix(bs);
                    acc = if holds_nonfinite(v) { add_nonfinite(alpha * acc + dot(p.cast(q.dtype), zero_nonfinite(v)), p, visible, nonfinite_class(v, r), r) } else { alpha * acc + dot(p.cast(q.dtype), v) };
                    m = m_new;
                }
            }
        }
    }
    // A row with l = 0 saw no weight: a padding token (zeros), or a real token whose visible
    // logits were all -inf (every real token sees its own position): torch's 0 / 0, NaN.
    let real = iota([rows, 1], 0) % bq + q0 < cu_q_lens[num_seqs[0].min(ms)];
    let out = select(l == 0.0, select(real, f32::NAN, 0.0), acc / l);
    let out = if v_scale != 1.0 { out * v_scale } else { out };
    o[..] = out.reshape([g, bq, d]).cast(o.dtype);
}

/// Static options of the op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub sm_scale: f32,
    /// Keys with `q_pos - window < k_pos` only.
    pub sliding_window: Option<usize>,
    /// `cap * tanh(score / cap)`.
    pub soft_cap: Option<f32>,
    /// Query tokens per block (a multiple of 16); default [`default_block_q`].
    pub block_q: Option<usize>,
    /// Pages per kv compute block; default: 256 tokens' worth, as `paged_attention`.
    pub pages_per_compute_block: Option<usize>,
    /// A quantized cache's scales, as `paged_attention`'s.
    pub scales: crate::paged_attention::KvScales,
}

impl Default for Options {
    fn default() -> Self {
        Options { sm_scale: 1.0, sliding_window: None, soft_cap: None, block_q: None, pages_per_compute_block: None, scales: crate::paged_attention::KvScales::NONE }
    }
}

/// Default q block: enough tokens that the `G` heads fill 128 score rows (one MXU pass
/// on v5e, half of one on v6e/tpu7x), a multiple of 16 (the bf16 sublane tiling, so the
/// `[G, bq, D] -> [G * bq, D]` reshape is free), at least 16, at most the padded batch.
pub fn default_block_q(total_tokens: usize, group: usize) -> usize {
    let bq = (128 / group.max(1)) / 16 * 16;
    bq.max(16).min(total_tokens.max(1).next_multiple_of(16))
}

fn err(subject: &str, rule: &'static str, message: String, help: &str) -> KernelError {
    KernelError::new("ragged_paged_attention", subject, rule, message, help)
}

/// The checked dims of the op's operands.
struct Dims {
    t: usize,
    h: usize,
    d: usize,
    hkv: usize,
}

fn check(inputs: &[Type]) -> Result<Dims, KernelError> {
    let [q, k, v, kv_lens, pages, cu, ns] = inputs else {
        return Err(err("inputs", "input-count", format!("{} inputs given", inputs.len()), "pass q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs"));
    };
    let (&[t, h, d], &[hkv, _, _, dk]) = (q.shape.as_slice(), k.shape.as_slice()) else {
        return Err(err("operands", "operand-shape", format!("q is {q} and k_pages {k}"), "q is [T, H, D]; k_pages and v_pages are [Hkv, num_pages, page_size, D]"));
    };
    if v.shape != k.shape {
        return Err(err("input `v_pages`", "operand-shape", format!("v_pages is {v}, k_pages {k}"), "pass k_pages and v_pages of one shape"));
    }
    if !matches!(q.dtype, DType::F32 | DType::BF16) {
        return Err(err("input `q`", "operand-dtype", format!("q is {q}"), "pass q as float32 or bfloat16"));
    }
    if v.dtype != k.dtype || !(k.dtype == q.dtype || k.dtype == DType::I8 || k.dtype.is_fp8()) {
        return Err(err("input `k_pages`", "operand-dtype", format!("q {q}, k_pages {k}, v_pages {v}"), "pass k_pages and v_pages of one dtype: q's, or a quantized cache (int8, float8_e4m3fn, float8_e5m2) with its scales"));
    }
    if t == 0 || dk != d || hkv == 0 || h % hkv != 0 {
        return Err(err(if t == 0 { "input `q`" } else { "input `k_pages`" }, "operand-shape", format!("q {q} against k_pages {k}"), "at least one token, equal head dims, and H a multiple of Hkv (GQA)"));
    }
    let ms = kv_lens.shape.first().copied().unwrap_or(0);
    let ints = [kv_lens, pages, cu, ns].iter().all(|x| x.dtype == DType::I32);
    if !ints || kv_lens.rank() != 1 || pages.rank() != 2 || pages.shape[0] != ms || cu.shape != [ms + 1] || ns.shape != [1] {
        return Err(err(
            "metadata operands",
            "operand-shape",
            format!("kv_lens {kv_lens}, page_indices {pages}, cu_q_lens {cu}, num_seqs {ns}"),
            "kv_lens is [S] i32, page_indices [S, pages_per_seq] i32, cu_q_lens [S + 1] i32 and num_seqs [1] i32",
        ));
    }
    Ok(Dims { t, h, d, hkv })
}

/// `(bq, Tp)`: the q block and the padded token count.
fn q_blocking(dims: &Dims, opts: &Options) -> Result<(usize, usize), KernelError> {
    let bq = opts.block_q.unwrap_or_else(|| default_block_q(dims.t, dims.h / dims.hkv));
    // At most the tokens rounded up to 16 (the default's cap): a larger block is padding.
    let most = dims.t.max(1).next_multiple_of(16);
    if bq == 0 || !bq.is_multiple_of(16) || bq > most {
        return Err(err("argument `num_queries_per_block`", "block-shape", format!("num_queries_per_block = {bq} for {} query tokens", dims.t), &format!("use a multiple of 16 query tokens per block, from 16 to {most}, or None for the default")));
    }
    Ok((bq, dims.t.next_multiple_of(bq)))
}

/// Builds the kernel for op-order types `(q, k_pages, v_pages, kv_lens, page_indices,
/// cu_q_lens, num_seqs)`; an unset compute block takes `target`'s default (as
/// `paged_attention`: twice the MXU edge in tokens).
pub fn build(inputs: &[Type], opts: &Options, target: &Target) -> Result<Kernel, KernelError> {
    let (inputs, token_scales) = inputs.split_at(inputs.len().min(7));
    let dims = check(inputs)?;
    if token_scales.len() != if opts.scales.per_token { 2 } else { 0 } {
        return Err(err("inputs", "input-count", format!("{} inputs given", inputs.len() + token_scales.len()), "pass q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs (and k_token_scales, v_token_scales when per-token scales are given)"));
    }
    let scale_ty = crate::paged_attention::scale_type("ragged_paged_attention", opts.scales, &inputs[1], token_scales)?;
    let (bq, tp) = q_blocking(&dims, opts)?;
    let (k, pages) = (&inputs[1], &inputs[4]);
    let ppcb = opts.pages_per_compute_block.unwrap_or_else(|| crate::paged_attention::default_pages_per_compute_block(k.shape[2], pages.shape[1], target));
    crate::paged_attention::check_compute_block("ragged_paged_attention", "num_kv_pages_per_block", ppcb, k.shape[2])?;
    let window = match opts.sliding_window {
        Some(0) => return Err(err("argument `sliding_window`", "option-value", "a window of 0 keys".into(), "use a window of at least 1 key, or none")),
        Some(w) => w.min(1 << 29),
        None => 0,
    };
    let soft_cap = match opts.soft_cap {
        Some(c) if !(c > 0.0 && c.is_finite()) => return Err(err("argument `soft_cap`", "option-value", format!("soft_cap = {c}"), "use a positive finite cap, or none")),
        Some(c) => c,
        None => 0.0,
    };
    let qk = Type::vector(inputs[0].dtype, &[dims.hkv, dims.h / dims.hkv, tp, dims.d]);
    #[rustfmt::skip]
    let kernel = ragged_paged_attention_kernel(
        inputs[3].clone(), inputs[4].clone(), inputs[5].clone(), inputs[6].clone(),
        qk.clone(), inputs[1].clone(), inputs[2].clone(), scale_ty.clone(), scale_ty, qk,
        bq, ppcb, opts.sm_scale * opts.scales.k_scale, window, soft_cap, opts.scales.per_token, opts.scales.v_scale,
    );
    kernel
}

/// Moves `q` between the op layout `[T, Hkv * G, D]` and the kernel layout `[Hkv, G, Tp,
/// D]` (zero padding; rows past `T` dropped on the way back).
pub fn relayout(a: &Array, t: usize, hkv: usize, g: usize, tp: usize, d: usize, to_kernel: bool) -> Array {
    fn go<T: Copy + Default>(x: &[T], t: usize, hkv: usize, g: usize, tp: usize, d: usize, to_kernel: bool) -> Vec<T> {
        let mut out = vec![T::default(); if to_kernel { hkv * g * tp * d } else { t * hkv * g * d }];
        for tok in 0..t {
            for head in 0..hkv * g {
                let op = (tok * hkv * g + head) * d;
                let kp = (head * tp + tok) * d;
                let (src, dst) = if to_kernel { (op, kp) } else { (kp, op) };
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
        out
    }
    let data = match &a.data {
        Data::F32(x) => Data::F32(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::BF16(x) => Data::BF16(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::I32(x) => Data::I32(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::I8(x) => Data::I8(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::Bool(x) => Data::Bool(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::F8E4M3FN(x) => Data::F8E4M3FN(go(x, t, hkv, g, tp, d, to_kernel)),
        Data::F8E5M2(x) => Data::F8E5M2(go(x, t, hkv, g, tp, d, to_kernel)),
    };
    let shape = if to_kernel { vec![hkv, g, tp, d] } else { vec![t, hkv * g, d] };
    Array::new(&shape, data)
}

impl Options {
    /// The op's statics for these options.
    fn statics(&self) -> String {
        let mut s = format!("sm_scale={:?}", self.sm_scale as f64);
        let opt = |name: &str, v: Option<String>| v.map_or(String::new(), |v| format!(", {name}={v}"));
        s += &opt("sliding_window", self.sliding_window.map(|w| w.to_string()));
        s += &opt("soft_cap", self.soft_cap.map(|c| format!("{:?}", c as f64)));
        s += &opt("num_queries_per_block", self.block_q.map(|b| b.to_string()));
        s += &opt("num_kv_pages_per_block", self.pages_per_compute_block.map(|p| p.to_string()));
        s += &opt("k_scale", (self.scales.k_scale != 1.0).then(|| format!("{:?}", self.scales.k_scale as f64)));
        s += &opt("v_scale", (self.scales.v_scale != 1.0).then(|| format!("{:?}", self.scales.v_scale as f64)));
        s
    }
}

/// Ragged paged attention on op-order arrays `(q, k_pages, v_pages, kv_lens,
/// page_indices, cu_q_lens, num_seqs[, k_token_scales, v_token_scales]) -> o: [T, H, D]`
/// (`opts.scales.per_token` is read from the arrays given).
pub fn ragged_paged_attention(exec: &dyn Executor, args: &[Array], opts: &Options, target: &Target) -> Result<Array, KernelError> {
    crate::run1(exec, "ragged_paged_attention", &args.iter().collect::<Vec<_>>(), &opts.statics(), target)
}

/// Runs an already built kernel without per-token scales (e.g. a modified one in a test)
/// on op-order arrays.
pub fn run_kernel(exec: &dyn Executor, kernel: &Kernel, args: &[Array]) -> Result<Array, KernelError> {
    let types: Vec<Type> = args.iter().map(|a| Type::vector(a.dtype, &a.shape)).collect();
    let dims = check(&types)?;
    let (hkv, g, tp) = (dims.hkv, dims.h / dims.hkv, kernel.find_ref("q").map_or(dims.t, |r| kernel.refs[r.0 as usize].shape.get(2).copied().unwrap_or(dims.t)));
    let qk = relayout(&args[0], dims.t, hkv, g, tp, dims.d, true);
    let dummy = Array::from_f32(&[1, 1, 1, 1], vec![1.0]);
    let out = tessera_dsl::exec::run(exec, kernel, &[&args[3], &args[4], &args[5], &args[6], &qk, &args[1], &args[2], &dummy, &dummy])?.remove(0);
    Ok(relayout(&out, dims.t, hkv, g, tp, dims.d, false))
}

fn plan_ragged_paged_attention(c: &Call) -> Result<Plan, KernelError> {
    const NAMES: [&str; 7] = ["q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"];
    let scales = crate::paged_attention::kv_scales(c)?;
    let mut types: Vec<Type> = NAMES.iter().map(|n| c.tensor(n).cloned()).collect::<Result<_, _>>()?;
    types.extend(crate::paged_attention::token_scale_types(c, scales)?);
    let opts = Options {
        sm_scale: crate::attention::finite_scale(c, c.statics.f64("sm_scale").unwrap_or(1.0))?,
        sliding_window: c.usize_opt("sliding_window")?,
        soft_cap: c.statics.f64("soft_cap").map(|x| x as f32),
        block_q: c.usize_opt("num_queries_per_block")?,
        pages_per_compute_block: c.usize_opt("num_kv_pages_per_block")?,
        scales,
    };
    let kernel = build(&types, &opts, c.target)?;
    let q = &types[0];
    let hkv = types[1].shape[0];
    let qk = kernel.ref_decl(kernel.find_ref("q").ok_or_else(|| c.err("kernel", "plan-consistency", "the kernel has no `q`", "report this as a Tessera bug"))?).shape.clone();
    let layout = Layout::HeadMajor { hkv, group: qk[1], padded_tokens: qk[2] };
    let q_arg = Operand { source: Source::Input(c.index("q")?), layout, ty: Type::vector(q.dtype, &qk) };
    let mut args: Vec<Operand> = NAMES[3..].iter().zip(&types[3..]).map(|(n, t)| c.input(n, t.clone())).collect::<Result<_, _>>()?;
    args.extend([q_arg, c.input("k_pages", types[1].clone())?, c.input("v_pages", types[2].clone())?]);
    args.extend(crate::paged_attention::scale_operands(c, scales, crate::paged_attention::scale_type("ragged_paged_attention", scales, &types[1], &types[7..])?)?);
    let launch = Launch::new(kernel, args);
    let out = Operand { source: Source::Result { launch: 0, output: 0 }, layout, ty: q.clone() };
    let (t, np, ps) = (q.shape[0], types[1].shape[1], types[1].shape[2]);
    let reads: Vec<usize> = NAMES[3..].iter().map(|n| c.index(n)).collect::<Result<_, _>>()?;
    let plan = Plan::new(c.op, c.target, vec![launch], vec![out]).with_check(&reads, Box::new(move |v| check_metadata(v, t, ps, np)));
    Ok(crate::paged_attention::with_dummy_scales(plan, scales))
}

/// The contract of the metadata (see the module docs), checked on the host: `num_seqs`
/// in `[0, S]`; `cu_q_lens` non-decreasing from 0 up to
/// `cu_q_lens[num_seqs] <= T`; each sequence's `q_len <= kv_len <= pages_per_seq *
/// page_size`; the pages holding its first `kv_len` keys valid. Sequences past `num_seqs`
/// are ignored.
fn check_metadata(v: &[&Array], t: usize, ps: usize, np: usize) -> Result<(), KernelError> {
    use crate::paged_attention::{check_length, check_page_table, ints};
    let (kv_lens, pages, cu, ns) = (ints(v[0]), ints(v[1]), ints(v[2]), ints(v[3]));
    let (ms, pps) = (v[1].shape[0], v[1].shape[1]);
    let bad = |what: &str, rule: &'static str, message: String, help: &str| Err(KernelError::new("ragged_paged_attention", format!("input `{what}`"), rule, message, help));
    let num_seqs = ns.first().copied().unwrap_or(0);
    if num_seqs < 0 || num_seqs as usize > ms {
        return bad("num_seqs", "num-seqs-range", format!("num_seqs is {num_seqs}, the metadata describes {ms} sequences"), &format!("pass num_seqs in [0, {ms}]"));
    }
    let ns = num_seqs as usize;
    if cu[0] != 0 {
        return bad("cu_q_lens", "cu-q-lens", format!("cu_q_lens starts at {}, not 0 (the query tokens before it would belong to no sequence)", cu[0]), "start cu_q_lens at 0");
    }
    // The offsets first, whole: a bad one makes every length derived from it meaningless.
    for s in 0..ns {
        let (start, end) = (cu[s], cu[s + 1]);
        if end < start {
            return bad("cu_q_lens", "cu-q-lens", format!("cu_q_lens decreases at sequence {s}: {start} then {end}"), "pass non-decreasing offsets (each sequence's queries follow the previous one's)");
        }
        if end as usize > t {
            return bad("cu_q_lens", "cu-q-lens", format!("sequence {s} ends at query token {end}, but q has {t} tokens"), &format!("keep cu_q_lens[num_seqs] <= {t}"));
        }
    }
    for s in 0..ns {
        let (q_len, kv_len) = (cu[s + 1] - cu[s], kv_lens[s]);
        check_length("ragged_paged_attention", "kv_lens", s, kv_len, pps * ps)?;
        if q_len > kv_len {
            return bad("kv_lens", "q-len-exceeds-kv-len", format!("sequence {s} has {q_len} queries but {kv_len} keys"), "a sequence's keys include its new queries' own: kv_len >= q_len");
        }
        check_page_table("ragged_paged_attention", s, kv_len as usize, &pages[s * pps..(s + 1) * pps], ps, np)?;
    }
    Ok(())
}

/// Random valid inputs: uniform q, k, v; `num_seqs` one less than `S` when `S > 2` (the
/// last sequence's metadata is garbage that must be ignored); sequence 0 empty (no
/// queries, no cache), sequence 1 a decode token, sequence 2 (if any) a decode step with
/// no query scheduled, the others a random mix of decode, prefill and chunked prefill,
/// as many tokens as `T` allows; trailing tokens are padding. Random page tables.
pub fn random_inputs(shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let q = harness::random_array(dtype, &shapes[0], rng);
    let k = harness::random_array(dtype, &shapes[1], rng);
    let v = harness::random_array(dtype, &shapes[2], rng);
    let t = shapes[0][0];
    let (num_pages, ps) = (shapes[1][1], shapes[1][2]);
    let (ms, pps) = (shapes[4][0], shapes[4][1]);
    let cap = pps * ps;
    let ns = if ms > 2 { ms - 1 } else { ms };
    let (mut kv_lens, mut cu) = (vec![0i32; ms], vec![0i32; ms + 1]);
    let mut used = 0;
    for s in 0..ns {
        let left = t - used;
        let (q_len, kv_len) = match s {
            0 => (0, 0),
            1 => (left.min(1), rng.gen_range(1..=cap)),
            2 => (0, rng.gen_range(1..=cap)),
            _ => match rng.gen_range(0..3) {
                0 => (left.min(1), rng.gen_range(1..=cap)),
                1 => {
                    let n = rng.gen_range(1..=cap).min(left);
                    (n, n)
                }
                _ => {
                    let kv = rng.gen_range(1..=cap);
                    (rng.gen_range(1..=kv).min(left), kv)
                }
            },
        };
        used += q_len;
        kv_lens[s] = kv_len.max(q_len) as i32;
        cu[s + 1] = used as i32;
    }
    for s in ns..ms {
        kv_lens[s] = cap as i32 + 7;
        cu[s + 1] = (t + 3) as i32;
    }
    let pages: Vec<i32> = (0..ms * pps).map(|_| rng.gen_range(0..num_pages) as i32).collect();
    let mut inputs = vec![q, k, v, Array::from_i32(&[ms], kv_lens), Array::from_i32(&[ms, pps], pages), Array::from_i32(&[ms + 1], cu), Array::from_i32(&[1], vec![ns as i32])];
    if shapes.len() == 9 {
        // Per-token scales given: an int8 cache.
        crate::paged_attention::quantize_cache(&mut inputs, 1, DType::I8, true, rng);
    }
    inputs
}

const fn int(name: &'static str, dims: &'static str) -> Input {
    Input { name, dims, kind: Kind::Int32 }
}

/// `1 / sqrt(128)`, the cases' softmax scale (both shape sets have D = 128).
const CASES: &[Case] = &[
    Case { name: "default", statics: "sm_scale=0.08838834764831845", shapes: &[&[256, 32, 128], &[8, 128, 16, 128], &[8, 128, 16, 128], &[8], &[8, 32], &[9], &[1]] },
    Case { name: "alt", statics: "sm_scale=0.08838834764831845", shapes: &[&[100, 12, 128], &[3, 40, 32, 128], &[3, 40, 32, 128], &[5], &[5, 7], &[6], &[1]] },
    Case { name: "window", statics: "sm_scale=0.08838834764831845, sliding_window=40, soft_cap=30.0", shapes: &[&[100, 12, 128], &[3, 40, 32, 128], &[3, 40, 32, 128], &[5], &[5, 7], &[6], &[1]] },
    Case { name: "int8", statics: "sm_scale=0.08838834764831845, k_scale=0.5, v_scale=2.0", shapes: &[&[100, 12, 128], &[3, 40, 32, 128], &[3, 40, 32, 128], &[5], &[5, 7], &[6], &[1], &[3, 40, 32], &[3, 40, 32]] },
];

/// This module's ops.
pub const OPS: &[Op] = &[Op {
                             name: "ragged_paged_attention", doc: "mixed prefill/chunked-prefill/decode attention over a paged KV cache: q blocks x kv heads, sequences walked from scalar-prefetched cu_q_lens, pages by double-buffered DMA, causal + optional sliding window and soft cap, GQA; int8 / fp8 caches dequantised in VMEM with per-tensor (k_scale, v_scale) and per-token scales", schema: "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor kv_lens, Tensor page_indices, Tensor cu_q_lens, Tensor num_seqs, float sm_scale=1.0, int? sliding_window=None, float? soft_cap=None, int? num_queries_per_block=None, int? num_kv_pages_per_block=None, float? k_scale=None, float? v_scale=None, Tensor? k_token_scales=None, Tensor? v_token_scales=None) -> Tensor", plan: plan_ragged_paged_attention, knobs: crate::tune::RAGGED_PAGED_ATTENTION, reference: Some(|a, s| vec![reference::ragged_paged_attention_quantized(a, s.f64("sm_scale").unwrap_or(1.0) as f32 as f64, s.i64("sliding_window").map(|w| w as usize), s.f64("soft_cap").map(|c| c as f32 as f64), (s.f64("k_scale").unwrap_or(1.0), s.f64("v_scale").unwrap_or(1.0)))]),
                             inputs: &[ Input { name: "q", dims: "[t, h, d]", kind: Kind::Float }, Input { name: "k_pages", dims: "[hkv, num_pages, page_size, d]", kind: Kind::KvCache }, Input { name: "v_pages", dims: "[hkv, num_pages, page_size, d]", kind: Kind::KvCache }, int("kv_lens", "[s]"), int("page_indices", "[s, pages_per_seq]"), int("cu_q_lens", "[s + 1]"), int("num_seqs", "[1]"), Input { name: "k_token_scales", dims: "[hkv, num_pages, page_size]", kind: Kind::Float32 }, Input { name: "v_token_scales", dims: "[hkv, num_pages, page_size]", kind: Kind::Float32 }, ], outputs: &[Output { name: "out", shape: "q", dtype: "q" }],
                             cases: CASES, random: Some(|shapes, dtype, _, rng| random_inputs(shapes, dtype, rng)), ..Op::EMPTY
                         }];

/// Independent f64 reference: for each sequence, each query token and each head, gathers
/// the visible keys token by token from the page table and runs an explicit softmax.
pub mod reference {
    use tessera_dsl::interp::Array;

    /// `a` = `(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)`; returns
    /// the `[T, H, D]` output (zeros for padding tokens and rows that see no key).
    pub fn ragged_paged_attention(a: &[Array], sm_scale: f64, sliding_window: Option<usize>, soft_cap: Option<f64>) -> Vec<f64> {
        ragged_paged_attention_quantized(a, sm_scale, sliding_window, soft_cap, (1.0, 1.0))
    }

    /// [`ragged_paged_attention`] over a cache dequantised first: stored * `scales` (the
    /// per-tensor `(k_scale, v_scale)`) * the per-token scales `a[7]`, `a[8]` when given.
    pub fn ragged_paged_attention_quantized(a: &[Array], sm_scale: f64, sliding_window: Option<usize>, soft_cap: Option<f64>, scales: (f64, f64)) -> Vec<f64> {
        use crate::paged_attention::reference::dequantize;
        let (qs, ks, vs) = (a[0].to_f64_vec(), dequantize(&a[1], scales.0, a.get(7)), dequantize(&a[2], scales.1, a.get(8)));
        let (t, h, d) = (a[0].shape[0], a[0].shape[1], a[0].shape[2]);
        let (hkv, num_pages, ps) = (a[1].shape[0], a[1].shape[1], a[1].shape[2]);
        let pps = a[4].shape[1];
        let (kv_lens, table, cu) = (a[3].as_i32().unwrap(), a[4].as_i32().unwrap(), a[5].as_i32().unwrap());
        let num_seqs = a[6].as_i32().unwrap()[0] as usize;
        let group = h / hkv;
        let mut out = vec![0.0; t * h * d];
        for s in 0..num_seqs.min(kv_lens.len()) {
            let (first, last) = (cu[s] as usize, cu[s + 1] as usize);
            let kv_len = kv_lens[s] as i64;
            let q_len = (last - first) as i64;
            for i in 0..last - first {
                let pos = kv_len - q_len + i as i64;
                let keys: Vec<usize> = (0..kv_len.max(0))
                    .filter(|&kp| kp <= pos && sliding_window.is_none_or(|w| kp > pos - w as i64))
                    .map(|kp| kp as usize)
                    .collect();
                for head in 0..h {
                    let kv = head / group;
                    let row = |kp: usize| ((kv * num_pages + table[s * pps + kp / ps] as usize) * ps + kp % ps) * d;
                    let o = ((first + i) * h + head) * d;
                    let qrow = &qs[o..o + d];
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&kp| {
                            let x = sm_scale * (0..d).map(|e| qrow[e] * ks[row(kp) + e]).sum::<f64>();
                            soft_cap.map_or(x, |c| c * (x / c).tanh())
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for (&kp, w) in keys.iter().zip(&weights) {
                        for e in 0..d {
                            out[o + e] += w / total * vs[row(kp) + e];
                        }
                    }
                }
            }
        }
        out
    }
}
