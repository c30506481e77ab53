//! Paged attention for decoding (one query token per sequence), torch_xla's
//! `paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block)`.
//!
//! - `q: [B, H, D]`; `k_pages`, `v_pages: [Hkv, num_pages, page_size, D]` stay in HBM;
//!   `lengths: [B]` i32 and `page_indices: [B, pages_per_seq]` i32 are scalar prefetch.
//!   Sequence `b`'s token `t` lives in page `page_indices[b, t / page_size]`, row
//!   `t % page_size`. Contract, checked on the host before the kernel runs:
//!   `0 <= lengths[b] <= pages_per_seq * page_size`, and the entries of the pages holding a
//!   sequence's first `lengths[b]` tokens are valid pages. Entries past a sequence's end
//!   may be anything (padding such as -1): the kernel clamps every fetched page index into
//!   the cache, and zeroes the cache rows past the length before `p @ v`.
//! - No softmax scale (as in torch_xla and JAX): pre-scale `q`. No logit soft-cap.
//! - GQA: `H = Hkv * G`; the `G` query heads of one kv head are one `[G, D]` block (the
//!   host reshapes `q` to `[B, Hkv, G, D]`, a free row-major view).
//! - Grid `(B, Hkv)`, both parallel. Each step walks its sequence in compute blocks of
//!   `pages_per_compute_block` pages: the pages of block `i + 1` are copied (manual DMA,
//!   one copy per page for K and for V) into the other slot of a two-slot VMEM buffer
//!   while block `i` is computed, with an online softmax across blocks; positions
//!   `>= length` are masked. Every copy is waited for within its grid step.
//! - An empty sequence (`length == 0`) attends to nothing: its output is zeros.
//! - NaN and inf follow torch's math attention over the visible keys: a NaN in q or a
//!   visible k, a +inf logit, or visible logits all -inf make the row NaN; a nonfinite v
//!   value reaches the entries that see it as `p * inf` (NaN where `p = 0`); keys past a
//!   length, and pages a sequence does not use, never reach it.
//!
//! # Quantized caches
//!
//! `k_pages` / `v_pages` may be stored as int8, `float8_e4m3fn` or `float8_e5m2` (both of
//! one dtype), with the keys and values they stand for `k = k_scale * k_token_scales[t] *
//! k_pages[t]` (likewise v):
//! - `k_scale`, `v_scale` (floats, default 1): per-tensor scales, torch_xla's and vLLM's
//!   `k_scale` / `v_scale`. They cost nothing in the loop: `k_scale` multiplies the logits,
//!   `v_scale` the output.
//! - `k_token_scales`, `v_token_scales` (float32 `[Hkv, num_pages, page_size]`, both or
//!   neither): one scale per cached token and kv head (int8 KV caches quantised as they are
//!   written), paged like the cache: each page's scales are one more DMA beside its K / V
//!   copy, into a `[page_size, 1]` column per page that scales the tile's rows.
//! Per-head scales are per-token scales constant along a head's tokens.
//!
//! The pages travel from HBM in their stored dtype (a quarter of f32's bytes for int8 and
//! fp8: the decode step is HBM-bound, so that is the point) and are converted to q's dtype
//! in VMEM, so the MXU sees f32 or bf16 on every generation (also on tpu7x, whose MXU has
//! native fp8: that path is not used here). A NaN or inf scale reaches exactly the logits
//! (k) or output entries (v) its tokens reach, as dequantising then attending would.

use rand::rngs::StdRng;
use rand::Rng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};
use tessera_macros::tpu_kernel;

use crate::harness;
use crate::op::{Call, Case, Input, Kind, Op, Output};
use crate::plan::{host, single, Operand, Plan};

/// Attention of one decode token per sequence over its pages (see the module docs);
/// `q` is `[B, Hkv, G, D]`, the output likewise. `k_scales` / `v_scales` are the per-token
/// scales `[Hkv, num_pages, page_size, 1]` when `per_token`, else 1-element dummies that
/// are never read; `k_scale` / `v_scale` are the per-tensor scales.
#[tpu_kernel(
    grid = [b, hkv],
    (q, o) = block([None, None, g, d], |bi, hi| [bi, hi, 0, 0]),
    (k_buf, v_buf) = scratch([2, ppcb, ps, d], k_pages.dtype),
    (ks_buf, vs_buf) = scratch([2, if per_token { ppcb } else { 1 }, sps, 1], f32),
    sem = semaphores(8),
)]
#[allow(clippy::too_many_arguments)]
#[rustfmt::skip]
pub fn paged_attention_kernel(
    lengths: Prefetch<b>, page_indices: Prefetch<b, pps>,
    q: In<b, hkv, g, d>, k_pages: Any<hkv, np, ps, d>, v_pages: Any<hkv, np, ps, d>,
    k_scales: Any<_, _, sps, 1>, v_scales: Any<_, _, sps, 1>, o: Out<b, hkv, g, d>,
    k_buf: Scratch, v_buf: Scratch, ks_buf: Scratch, vs_buf: Scratch, sem: Scratch,
    ppcb: usize, per_token: bool, k_scale: f32, v_scale: f32,
) {
    let bi = program_id(0);
    let h = program_id(1);
    let len = lengths[bi];
    let bs = ppcb * ps;
    let nblocks = (len + (bs - 1)) / bs;
    // Slot `s` uses semaphores 4s (K), 4s + 1 (V), 4s + 2 and 4s + 3 (their per-token
    // scales); one copy per page on each.
    if nblocks > 0 {
        for j in 0..ppcb {
            let page = page_indices[(bi, j.min(pps - 1))].max(0).min(np - 1);
            dma_start(k_pages[(h, page)], k_buf[(0, j)], sem[0]);
            dma_start(v_pages[(h, page)], v_buf[(0, j)], sem[1]);
            if per_token {
                dma_start(k_scales[(h, page)], ks_buf[(0, j)], sem[2]);
                dma_start(v_scales[(h, page)], vs_buf[(0, j)], sem[3]);
            }
        }
    }
    let qv = q[..];
    let mut m = full([g, 1], f32, f32::NEG_INFINITY);
    let mut l = zeros([g, 1], f32);
    let mut acc = zeros([g, d], f32);
    for i in 0..nblocks {
        let slot = i % 2;
        let next = 1 - slot;
        if i + 1 < nblocks {
            // Prefetch block i + 1 into the other slot before computing on this one.
            for j in 0..ppcb {
                let page = page_indices[(bi, ((i + 1) * ppcb + j).min(pps - 1))].max(0).min(np - 1);
                dma_start(k_pages[(h, page)], k_buf[(next, j)], sem[4 * next]);
                dma_start(v_pages[(h, page)], v_buf[(next, j)], sem[4 * next + 1]);
                if per_token {
                    dma_start(k_scales[(h, page)], ks_buf[(next, j)], sem[4 * next + 2]);
                    dma_start(v_scales[(h, page)], vs_buf[(next, j)], sem[4 * next + 3]);
                }
            }
        }
        for j in 0..ppcb {
            let page = page_indices[(bi, (i * ppcb + j).min(pps - 1))].max(0).min(np - 1);
            dma_wait(k_pages[(h, page)], k_buf[(slot, j)], sem[4 * slot]);
            dma_wait(v_pages[(h, page)], v_buf[(slot, j)], sem[4 * slot + 1]);
            if per_token {
                dma_wait(k_scales[(h, page)], ks_buf[(slot, j)], sem[4 * slot + 2]);
                dma_wait(v_scales[(h, page)], vs_buf[(slot, j)], sem[4 * slot + 3]);
            }
        }
        // Stored pages of another dtype (int8, fp8) go to the MXU in q's dtype, each row times
        // its token's scale (a `[bs, 1]` column, broadcast along the lanes) when per_token.
        let k = k_buf[(slot, .., .., ..)].reshape([bs, d]);
        let v = v_buf[(slot, .., .., ..)].reshape([bs, d]);
        let k = if per_token { k.cast(f32) * ks_buf[(slot, .., .., ..)].reshape([bs, 1]) } else { k };
        let v = if per_token { v.cast(f32) * vs_buf[(slot, .., .., ..)].reshape([bs, 1]) } else { v };
        let k = k.cast(q.dtype);
        let v = v.cast(q.dtype);
        // Cache rows past the length are whatever the pages hold (uninitialised on a TPU):
        // zero them, or `0 * NaN` in `p @ v` would leak into the output.
        let v = select(iota([bs, 1], 0) + i * bs < len, v, 0.0);
        let s = dot_t(qv, k);
        let s = if k_scale != 1.0 { s * k_scale } else { s };
        let pos = iota([g, bs], 1) + i * bs;
        let s = select(pos < len, s, f32::NEG_INFINITY);
        // All G rows see the same keys, so a masked key (its v row zeroed above) meets only
        // zero weights of zero values: `p @ v` is math attention's product over the
        // visible keys, nonfinite values included (`p * inf`, NaN where `p = 0`).
        let m_new = m.max(s.reduce_max(1));
        // Logits all -inf so far (-inf data): exp(s - 0) = 0, not exp(-inf + inf) = NaN.
        let m_use = select(m_new == f32::NEG_INFINITY, 0.0, m_new);
        let p = (s - m_use).exp();
        let alpha = (m - m_use).exp();
        l = alpha * l + p.sum(1);
        acc = alpha * acc + dot(p.cast(q.dtype), v);
        m = m_new;
    }
    // An empty sequence saw no key: zeros. Otherwise acc / l is torch's softmax product: a
    // NaN in q or a visible k, a +inf logit, or visible logits all -inf (0 / 0) give NaN.
    if len == 0 {
        o[..] = zeros([g, d], o.dtype);
    } else if v_scale != 1.0 {
        o[..] = (acc / l * v_scale).cast(o.dtype);
    } else {
        o[..] = (acc / l).cast(o.dtype);
    }
}

/// Default compute block: twice the MXU edge in tokens — 256 on v5e/v5p, 512 on
/// v6e/tpu7x — so each `[G, D] x [D, tokens]` score matmul fills the systolic array's
/// width twice (at least one page, at most all of a sequence's pages). Double-buffered K
/// and V blocks then take `4 * tokens * D * bytes`: 1 MiB at 512 x 128 f32, far inside
/// every generation's scoped VMEM.
pub fn default_pages_per_compute_block(page_size: usize, pages_per_seq: usize, target: &Target) -> usize {
    (2 * target.mxu / page_size.max(1)).clamp(1, pages_per_seq.max(1))
}

fn err(subject: &str, rule: &'static str, message: String, help: &str) -> KernelError {
    KernelError::new("paged_attention", subject, rule, message, help)
}

/// Checks the op's operand types and returns `(B, H, D, Hkv)`.
fn check(q: &Type, k: &Type, v: &Type, lengths: &Type, pages: &Type) -> Result<(usize, usize, usize, usize), KernelError> {
    let (&[b, h, d], &[hkv, _, _, dk]) = (q.shape.as_slice(), k.shape.as_slice()) else {
        return Err(err("operands", "operand-shape", format!("q is {q} and k_pages {k}"), "q is [B, H, D]; k_pages and v_pages are [Hkv, num_pages, page_size, D]"));
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
    if dk != d || hkv == 0 || h % hkv != 0 {
        return Err(err("input `k_pages`", "operand-shape", format!("q {q} against k_pages {k}"), "the head dims must agree and H must be a multiple of Hkv (GQA)"));
    }
    if lengths.shape != [b] || pages.rank() != 2 || pages.shape[0] != b || lengths.dtype != DType::I32 || pages.dtype != DType::I32 {
        return Err(err("metadata operands", "operand-shape", format!("lengths {lengths}, page_indices {pages} for a batch of {b}"), "lengths is [B] i32 and page_indices [B, pages_per_seq] i32"));
    }
    Ok((b, h, d, hkv))
}

/// How the cache's stored values become keys and values: `k = k_scale * k_token_scales[t] *
/// k_pages[t]` (likewise v), either factor left out when not given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    /// Per-tensor scales (torch_xla's `k_scale`, `v_scale`).
    pub k_scale: f32,
    pub v_scale: f32,
    /// Per-token scales `[Hkv, num_pages, page_size]` (one per cached token and kv head,
    /// paged like the cache) are given.
    pub per_token: bool,
}

impl KvScales {
    pub const NONE: KvScales = KvScales { k_scale: 1.0, v_scale: 1.0, per_token: false };
}

/// A compute block of `ppcb` pages of `page_size` tokens (static `arg` of op `op`): at
/// least one page, and its token count within the kernels' i32 offsets.
pub(crate) fn check_compute_block(op: &str, arg: &str, ppcb: usize, page_size: usize) -> Result<(), KernelError> {
    let most = i32::MAX as usize / page_size.max(1);
    if ppcb == 0 || ppcb > most {
        return Err(KernelError::new(op, format!("argument `{arg}`"), "block-shape", format!("{arg} = {ppcb} pages of {page_size} tokens"), format!("use 1 to {most} pages per compute block (its tokens are i32 offsets), or None for the default")));
    }
    Ok(())
}

/// The kernels' two scale operands' type: per-token scales `[Hkv, num_pages, page_size]`
/// (`given`, checked) seen as `[.., 1]` columns, else a 1-element dummy that is never read.
pub(crate) fn scale_type(op: &str, scales: KvScales, k: &Type, given: &[Type]) -> Result<Type, KernelError> {
    if !scales.per_token {
        return Ok(Type::vector(DType::F32, &[1, 1, 1, 1]));
    }
    let (hkv, np, ps) = (k.shape[0], k.shape[1], k.shape[2]);
    let token_scales = Type::vector(DType::F32, &[hkv, np, ps]);
    for (name, t) in ["k_token_scales", "v_token_scales"].iter().zip(given) {
        if *t != token_scales {
            return Err(KernelError::new(op, format!("input `{name}`"), "operand-shape", format!("{name} is {t} for k_pages {k}"), format!("pass {name} as {token_scales}: one float32 scale per cached token and kv head")));
        }
    }
    Ok(Type::vector(DType::F32, &[hkv, np, ps, 1]))
}

/// Builds the kernel for op-order types `(q, k_pages, v_pages, lengths, page_indices)`,
/// plus `(k_token_scales, v_token_scales)` when `scales.per_token`; `None` takes `target`'s
/// default compute block.
pub fn build(inputs: &[Type], pages_per_compute_block: Option<usize>, scales: KvScales, target: &Target) -> Result<Kernel, KernelError> {
    let (q, k, v, lengths, pages) = match (inputs, scales.per_token) {
        ([q, k, v, l, p], false) | ([q, k, v, l, p, _, _], true) => (q, k, v, l, p),
        _ => return Err(err("inputs", "input-count", format!("{} inputs given", inputs.len()), "pass q, k_pages, v_pages, lengths, page_indices (and k_token_scales, v_token_scales when per-token scales are given)")),
    };
    let (b, h, d, hkv) = check(q, k, v, lengths, pages)?;
    let scale_ty = scale_type("paged_attention", scales, k, &inputs[5..])?;
    let ppcb = pages_per_compute_block.unwrap_or_else(|| default_pages_per_compute_block(k.shape[2], pages.shape[1], target));
    check_compute_block("paged_attention", "pages_per_compute_block", ppcb, k.shape[2])?;
    let q4 = Type::vector(q.dtype, &[b, hkv, h / hkv, d]);
    paged_attention_kernel(lengths.clone(), pages.clone(), q4.clone(), k.clone(), v.clone(), scale_ty.clone(), scale_ty, q4, ppcb, scales.per_token, scales.k_scale, scales.v_scale)
}

/// Paged attention: `(q, k_pages, v_pages, lengths, page_indices) -> o [b, h, d]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(exec: &dyn Executor, q: &Array, k: &Array, v: &Array, lengths: &Array, page_indices: &Array, pages_per_compute_block: Option<usize>, target: &Target) -> Result<Array, KernelError> {
    let statics = pages_per_compute_block.map_or(String::new(), |p| format!("pages_per_compute_block={p}"));
    crate::run1(exec, "paged_attention", &[q, k, v, lengths, page_indices], &statics, target)
}

/// Runs an already built paged-attention kernel without scales (e.g. a modified one in a test).
#[allow(clippy::too_many_arguments)]
pub fn run_kernel(exec: &dyn Executor, kernel: &Kernel, q: &Array, k: &Array, v: &Array, lengths: &Array, page_indices: &Array) -> Result<Array, KernelError> {
    let (b, h, d, hkv) = (q.shape[0], q.shape[1], q.shape[2], k.shape[0]);
    let q4 = Array { shape: vec![b, hkv, h / hkv, d], ..q.clone() };
    let dummy = Array::from_f32(&[1, 1, 1, 1], vec![1.0]);
    let mut out = tessera_dsl::exec::run(exec, kernel, &[lengths, page_indices, &q4, k, v, &dummy, &dummy])?.remove(0);
    out.shape = vec![b, h, d];
    Ok(out)
}

/// A call's scales: `k_scale` / `v_scale` statics (default 1) and per-token scale tensors,
/// both or neither (shared with `ragged_paged_attention`).
pub(crate) fn kv_scales(c: &Call) -> Result<KvScales, KernelError> {
    let per_token = match (c.given("k_token_scales"), c.given("v_token_scales")) {
        (a, b) if a == b => a,
        _ => return Err(c.err("input `k_token_scales`", "kv-scales", "only one of k_token_scales and v_token_scales is given", "pass both per-token scale tensors or neither")),
    };
    // A NaN or infinite scale (or one beyond f32) makes every score or output NaN.
    let scale = |name: &str| match c.statics.f64(name) {
        None => Ok(1.0),
        Some(s) if (s as f32).is_finite() => Ok(s as f32),
        Some(s) => Err(c.err(format!("argument `{name}`"), "option-value", format!("{name} = {s}"), format!("pass a finite {name} (the cache's per-tensor dequantisation scale; default 1)"))),
    };
    Ok(KvScales { k_scale: scale("k_scale")?, v_scale: scale("v_scale")?, per_token })
}

/// The given per-token scale tensors' types (none without per-token scales).
pub(crate) fn token_scale_types(c: &Call, scales: KvScales) -> Result<Vec<Type>, KernelError> {
    if !scales.per_token {
        return Ok(Vec::new());
    }
    Ok(vec![c.tensor("k_token_scales")?.clone(), c.tensor("v_token_scales")?.clone()])
}

/// The plan's two scale operands: the per-token tensors as `ty` columns, or host arrays 0
/// and 1 (dummies: [`with_dummy_scales`]).
pub(crate) fn scale_operands(c: &Call, scales: KvScales, ty: Type) -> Result<[Operand; 2], KernelError> {
    if scales.per_token {
        Ok([c.input("k_token_scales", ty.clone())?, c.input("v_token_scales", ty)?])
    } else {
        Ok([host(0, ty.clone()), host(1, ty)])
    }
}

/// `plan` with the dummy scale arrays as its host arrays 0 and 1 when there are no per-token
/// scales.
pub(crate) fn with_dummy_scales(plan: Plan, scales: KvScales) -> Plan {
    if scales.per_token {
        return plan;
    }
    plan.with_host(vec![Array::from_f32(&[1, 1, 1, 1], vec![1.0]), Array::from_f32(&[1, 1, 1, 1], vec![1.0])])
}

fn plan_paged_attention(c: &Call) -> Result<Plan, KernelError> {
    let names = ["q", "k_pages", "v_pages", "lengths", "page_indices"];
    let scales = kv_scales(c)?;
    let mut types: Vec<Type> = names.iter().map(|n| c.tensor(n).cloned()).collect::<Result<_, _>>()?;
    types.extend(token_scale_types(c, scales)?);
    let kernel = build(&types, c.usize_opt("pages_per_compute_block")?, scales, c.target)?;
    let (q, k) = (&types[0], &types[1]);
    let (b, h, d, hkv) = (q.shape[0], q.shape[1], q.shape[2], k.shape[0]);
    let (np, ps) = (k.shape[1], k.shape[2]);
    let q4 = Type::vector(q.dtype, &[b, hkv, h / hkv, d]);
    let mut args = vec![c.input("lengths", types[3].clone())?, c.input("page_indices", types[4].clone())?, c.input("q", q4)?, c.input("k_pages", types[1].clone())?, c.input("v_pages", types[2].clone())?];
    args.extend(scale_operands(c, scales, scale_type("paged_attention", scales, k, &types[5..])?)?);
    let check: crate::plan::CheckFn = Box::new(move |v| {
        let (lengths, pages) = (ints(v[0]), ints(v[1]));
        let pps = v[1].shape[1];
        for (seq, &len) in lengths.iter().enumerate() {
            check_length("paged_attention", "lengths", seq, len, pps * ps)?;
            check_page_table("paged_attention", seq, len as usize, &pages[seq * pps..(seq + 1) * pps], ps, np)?;
        }
        Ok(())
    });
    let plan = single(c, kernel, args, &[Some(q.shape.clone())]).with_check(&[c.index("lengths")?, c.index("page_indices")?], check);
    Ok(with_dummy_scales(plan, scales))
}

/// An int32 array's elements (plans check dtypes before their checks run).
pub(crate) fn ints(a: &Array) -> &[i32] {
    a.as_i32().unwrap_or(&[])
}

/// `len` (element `seq` of `what`) is a token count in `[0, capacity]`.
pub(crate) fn check_length(op: &str, what: &str, seq: usize, len: i32, capacity: usize) -> Result<(), KernelError> {
    if len < 0 || len as usize > capacity {
        return Err(KernelError::new(op, format!("input `{what}`"), "length-range", format!("sequence {seq} has length {len}, but its page table holds {capacity} tokens"), format!("pass lengths in [0, {capacity}] (pages_per_seq * page_size)")));
    }
    Ok(())
}

/// The page-table row of sequence `seq` maps its first `len` tokens to pages of the cache.
pub(crate) fn check_page_table(op: &str, seq: usize, len: usize, row: &[i32], page_size: usize, num_pages: usize) -> Result<(), KernelError> {
    for (p, &page) in row.iter().enumerate().take(len.div_ceil(page_size.max(1))) {
        if page < 0 || page as usize >= num_pages {
            return Err(KernelError::new(op, "input `page_indices`", "page-range", format!("sequence {seq}'s page {p} (holding tokens {}..) is {page}, but the cache has {num_pages} pages", p * page_size), format!("point the pages a sequence uses at pages in [0, {num_pages})")));
        }
    }
    Ok(())
}

/// Replaces the K / V pages at `inputs[first]`, `inputs[first + 1]` by a random cache stored as
/// `cache` (int8 codes spanning -127..=127, or fp8 of unit-range values), and with
/// `per_token` appends per-token scales `[Hkv, num_pages, page_size]` around 1/127 (as for
/// unit-range data quantised to int8). Shared by the random inputs and the tests of both
/// paged kernels.
pub fn quantize_cache(inputs: &mut Vec<Array>, first: usize, cache: DType, per_token: bool, rng: &mut StdRng) {
    let shape = inputs[first].shape.clone();
    let n: usize = shape.iter().product();
    for i in [first, first + 1] {
        inputs[i] = if cache == DType::I8 {
            Array::from_i8(&shape, (0..n).map(|_| rng.gen_range(-127..=127)).collect())
        } else {
            Array::from_f32_as_fp8(cache, &shape, &(0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect::<Vec<_>>())
        };
    }
    if per_token {
        for _ in 0..2 {
            inputs.push(Array::from_f32(&shape[..3], (0..n / shape[3]).map(|_| rng.gen_range(0.5f32..1.5) / 127.0).collect()));
        }
    }
}

/// The reference for a call's arrays (the per-token scales, when given, are arrays 5 and 6).
fn reference_of_call(a: &[Array], statics: &crate::op::Statics) -> Vec<Vec<f64>> {
    let scales = (statics.f64("k_scale").unwrap_or(1.0), statics.f64("v_scale").unwrap_or(1.0));
    let token_scales = (a.len() == 7).then(|| (&a[5], &a[6]));
    vec![reference::paged_attention_quantized(&a[0], &a[1], &a[2], &a[3], &a[4], scales, token_scales)]
}

/// Random valid inputs: uniform q, k, v; lengths from 0 to the capacity, with sequence 0
/// empty and sequence 1 a single token when the batch allows; random page tables.
pub fn random_inputs(shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let q = harness::random_array(dtype, &shapes[0], rng);
    let k = harness::random_array(dtype, &shapes[1], rng);
    let v = harness::random_array(dtype, &shapes[2], rng);
    let (b, pps) = (shapes[4][0], shapes[4][1]);
    let (num_pages, ps) = (shapes[1][1], shapes[1][2]);
    let lengths: Vec<i32> = (0..b)
        .map(|i| match i {
            0 => 0,
            1 => 1,
            _ => rng.gen_range(0..=pps * ps) as i32,
        })
        .collect();
    let pages: Vec<i32> = (0..b * pps).map(|_| rng.gen_range(0..num_pages) as i32).collect();
    let mut inputs = vec![q, k, v, Array::from_i32(&[b], lengths), Array::from_i32(&[b, pps], pages)];
    if shapes.len() == 7 {
        // Per-token scales given: an int8 cache, each token quantised with its own scale.
        quantize_cache(&mut inputs, 1, DType::I8, true, rng);
    }
    inputs
}

/// This module's ops.
pub const OPS: &[Op] = &[Op {
                             name: "paged_attention", doc: "decode attention over a paged KV cache (q pre-scaled): pages fetched by manual DMA into double-buffered VMEM, online softmax, GQA, length masking; empty sequences give zeros; int8 / fp8 caches dequantised in VMEM with per-tensor (k_scale, v_scale) and per-token scales", schema: "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, Tensor page_indices, int? pages_per_compute_block=None, float? k_scale=None, float? v_scale=None, Tensor? k_token_scales=None, Tensor? v_token_scales=None) -> Tensor", plan: plan_paged_attention, reference: Some(reference_of_call), knobs: crate::tune::PAGED_ATTENTION,
                             inputs: &[ Input { name: "q", dims: "[b, h, d]", kind: Kind::Float }, Input { name: "k_pages", dims: "[hkv, num_pages, page_size, d]", kind: Kind::KvCache }, Input { name: "v_pages", dims: "[hkv, num_pages, page_size, d]", kind: Kind::KvCache }, Input { name: "lengths", dims: "[b]", kind: Kind::Int32 }, Input { name: "page_indices", dims: "[b, pages_per_seq]", kind: Kind::Int32 }, Input { name: "k_token_scales", dims: "[hkv, num_pages, page_size]", kind: Kind::Float32 }, Input { name: "v_token_scales", dims: "[hkv, num_pages, page_size]", kind: Kind::Float32 }, ], outputs: &[Output { name: "out", shape: "q", dtype: "q" }],
                             cases: &[ Case { name: "default", statics: "", shapes: &[&[8, 32, 128], &[4, 128, 16, 128], &[4, 128, 16, 128], &[8], &[8, 16]] }, Case { name: "alt", statics: "", shapes: &[&[3, 8, 128], &[8, 40, 32, 128], &[8, 40, 32, 128], &[3], &[3, 5]] }, Case { name: "int8", statics: "k_scale=0.5, v_scale=2.0", shapes: &[&[5, 16, 128], &[4, 64, 16, 128], &[4, 64, 16, 128], &[5], &[5, 6], &[4, 64, 16], &[4, 64, 16]] }, ], random: Some(|shapes, dtype, _, rng| random_inputs(shapes, dtype, rng)), ..Op::EMPTY
                         }];

/// Independent f64 reference: gathers each sequence's keys and values token by token
/// from the page table, dequantises them (`k = k_scale * k_token_scale * stored`), and runs
/// an explicit (two-pass) softmax.
pub mod reference {
    use tessera_dsl::interp::Array;

    /// A cache's stored `[Hkv, num_pages, page_size, D]` pages as the values they stand for:
    /// `stored * scale * token_scales[token]` (the per-token scales `[Hkv, num_pages,
    /// page_size]` when given). Shared by both paged kernels' references.
    pub fn dequantize(pages: &Array, scale: f64, token_scales: Option<&Array>) -> Vec<f64> {
        let d = pages.shape[3];
        let tokens = token_scales.map(Array::to_f64_vec);
        pages.to_f64_vec().iter().enumerate().map(|(i, x)| x * scale * tokens.as_ref().map_or(1.0, |t| t[i / d])).collect()
    }

    pub fn paged_attention(q: &Array, k: &Array, v: &Array, lengths: &Array, page_indices: &Array) -> Vec<f64> {
        paged_attention_quantized(q, k, v, lengths, page_indices, (1.0, 1.0), None)
    }

    /// `scales` are the per-tensor `(k_scale, v_scale)`; `token_scales` the per-token
    /// `[Hkv, num_pages, page_size]` arrays.
    pub fn paged_attention_quantized(q: &Array, k: &Array, v: &Array, lengths: &Array, page_indices: &Array, scales: (f64, f64), token_scales: Option<(&Array, &Array)>) -> Vec<f64> {
        let qs = q.to_f64_vec();
        let ks = dequantize(k, scales.0, token_scales.map(|t| t.0));
        let vs = dequantize(v, scales.1, token_scales.map(|t| t.1));
        let (b, h, d) = (q.shape[0], q.shape[1], q.shape[2]);
        let (hkv, num_pages, ps) = (k.shape[0], k.shape[1], k.shape[2]);
        let pps = page_indices.shape[1];
        let (lens, table) = (lengths.as_i32().unwrap(), page_indices.as_i32().unwrap());
        let group = h / hkv;
        let mut out = vec![0.0; b * h * d];
        for s in 0..b {
            let len = lens[s].max(0) as usize;
            for head in 0..h {
                let kv = head / group;
                // The cache token of sequence s at position t: its index among [Hkv, pages, ps].
                let token = |t: usize| (kv * num_pages + table[s * pps + t / ps] as usize) * ps + t % ps;
                let key = |t: usize, e: usize| ks[token(t) * d + e];
                let value = |t: usize, e: usize| vs[token(t) * d + e];
                let qrow = &qs[(s * h + head) * d..][..d];
                let scores: Vec<f64> = (0..len).map(|t| (0..d).map(|e| qrow[e] * key(t, e)).sum()).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (t, w) in weights.iter().enumerate() {
                    for e in 0..d {
                        out[(s * h + head) * d + e] += w / total * value(t, e);
                    }
                }
            }
        }
        out
    }
}
