//! Ragged paged attention: numerics against the f64 reference (f32, bf16; GQA 1/4/8;
//! mixed decode / prefill / chunked-prefill batches with empty and single-token sequences
//! and `num_seqs < max_seqs`; causal, sliding window, soft cap; several block sizes), the
//! interpreter catching a missing DMA wait, and libtpu acceptance of a large-block config.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Inst, Target, Type};
use tessera_kernels::harness::check_output;
use tessera_kernels::ragged_paged_attention::{self as rpa, reference, Options};
use tessera_tests::oracle;
use tessera_codegen::cpu::Backend;

/// (T, H, Hkv, D, num_pages, page_size, max_seqs, pages_per_seq, block_q, pages_per_compute_block).
type Set = (usize, usize, usize, usize, usize, usize, usize, usize, usize, usize);
const SHAPES: &[Set] = &[
    (64, 8, 2, 128, 24, 16, 6, 4, 16, 2),   // GQA 4, several q blocks
    (50, 4, 4, 128, 16, 16, 5, 5, 16, 2),   // MHA, T not a multiple of the block
    (40, 8, 1, 128, 20, 16, 4, 6, 16, 4),   // GQA 8 (MQA)
    (96, 2, 2, 128, 12, 32, 7, 3, 32, 1),   // 32-token pages, one page per block
    (33, 16, 4, 128, 30, 16, 3, 8, 48, 3),  // one q block larger than T, 3 pages per block
    (24, 2, 1, 256, 9, 16, 4, 4, 16, 4),    // D = 256
];

fn shapes(&(t, h, hkv, d, np, ps, ms, pps, ..): &Set) -> Vec<Vec<usize>> {
    vec![vec![t, h, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![ms], vec![ms, pps], vec![ms + 1], vec![1]]
}

fn types(set: &Set, dtype: DType) -> Vec<Type> {
    shapes(set).iter().enumerate().map(|(i, s)| Type::vector(if i < 3 { dtype } else { DType::I32 }, s)).collect()
}

fn inputs(set: usize, dtype: DType, seed: u64) -> Vec<Array> {
    rpa::random_inputs(&shapes(&SHAPES[set]), dtype, &mut StdRng::seed_from_u64(seed))
}

fn opts(set: &Set, d: usize) -> Options {
    Options { sm_scale: 1.0 / (d as f32).sqrt(), block_q: Some(set.8), pages_per_compute_block: Some(set.9), ..Options::default() }
}

fn check(a: &[Array], o: Options, what: &str) {
    let out = rpa::ragged_paged_attention(&Interpreter, a, &o, &Target::V5E).unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = reference::ragged_paged_attention(a, o.sm_scale as f64, o.sliding_window, o.soft_cap.map(f64::from));
    let c = check_output(&out, &want);
    assert!(c.passed(), "{what}: {c:?}; kv_lens {:?} cu_q_lens {:?}", a[3].as_i32().unwrap(), a[5].as_i32().unwrap());
}

#[test]
fn matches_the_reference_f32_and_bf16() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            for seed in 0..3 {
                let a = inputs(set, dtype, 100 * set as u64 + seed);
                check(&a, opts(sh, sh.3), &format!("set {set} {dtype} seed {seed}"));
            }
        }
    }
}

#[test]
fn sliding_window_and_soft_cap() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let a = inputs(set, dtype, 7 + set as u64);
            let base = opts(sh, sh.3);
            for window in [1, 5, 16, 37] {
                check(&a, Options { sliding_window: Some(window), ..base }, &format!("set {set} {dtype} window {window}"));
            }
            check(&a, Options { soft_cap: Some(2.0), sm_scale: 1.0, ..base }, &format!("set {set} {dtype} soft cap"));
            check(&a, Options { soft_cap: Some(3.0), sliding_window: Some(9), ..base }, &format!("set {set} {dtype} both"));
        }
    }
}

/// Hand-built batch: empty sequences (no queries; no queries and no cache), decode tokens,
/// a full prefill and a chunked prefill that straddle q-block and page boundaries, padding
/// tokens, and garbage metadata past `num_seqs`.
#[test]
fn hand_built_mixed_batch() {
    let (t, h, hkv, d, np, ps, pps) = (45, 8, 2, 128, 40, 16, 6);
    let mut rng = StdRng::seed_from_u64(1);
    let mut a = rpa::random_inputs(&[vec![t, h, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![8], vec![8, pps], vec![9], vec![1]], DType::F32, &mut rng);
    // (q_len, kv_len) per sequence.
    let seqs = [(0, 0), (1, 1), (17, 17), (0, 30), (1, 77), (20, 50), (3, 3)];
    let mut cu = vec![0i32];
    let mut lens = vec![];
    for &(ql, kl) in &seqs {
        cu.push(cu.last().unwrap() + ql);
        lens.push(kl);
    }
    assert!(*cu.last().unwrap() as usize <= t - 3, "leaves padding tokens");
    lens.push(9999);
    cu.push(-5);
    a[3] = Array::from_i32(&[8], lens);
    a[5] = Array::from_i32(&[9], cu.clone());
    a[6] = Array::from_i32(&[1], vec![seqs.len() as i32]);
    for bq in [16, 32, 48] {
        for ppcb in [1, 2, 5] {
            let o = Options { sm_scale: 0.125, block_q: Some(bq), pages_per_compute_block: Some(ppcb), ..Options::default() };
            check(&a, o, &format!("bq {bq} ppcb {ppcb}"));
            check(&a, Options { sliding_window: Some(7), soft_cap: Some(1.5), ..o }, &format!("bq {bq} ppcb {ppcb} window + cap"));
        }
    }
    // The single-token, single-key sequence returns its value row; padding tokens are zero.
    let out = rpa::ragged_paged_attention(&Interpreter, &a, &Options { sm_scale: 0.125, ..Options::default() }, &Target::V5E).unwrap().to_f64_vec();
    let page = a[4].as_i32().unwrap()[pps] as usize;
    let v = a[2].to_f64_vec();
    for head in 0..h {
        let kv = head / (h / hkv);
        let row = &v[(kv * np + page) * ps * d..][..d];
        assert!(row.iter().zip(&out[head * d..][..d]).all(|(x, y)| (x - y).abs() < 1e-6), "head {head}");
    }
    let used = *cu.last().unwrap() as usize;
    assert!(out[cu[seqs.len()] as usize * h * d..].iter().all(|&x| x == 0.0), "padding after token {used}");
}

#[test]
fn num_seqs_zero_gives_zeros() {
    let mut a = inputs(0, DType::F32, 3);
    a[6] = Array::from_i32(&[1], vec![0]);
    let out = rpa::ragged_paged_attention(&Interpreter, &a, &Options::default(), &Target::V5E).unwrap();
    assert!(out.to_f64_vec().iter().all(|&x| x == 0.0));
}

#[test]
fn default_blocks_and_bad_options() {
    assert_eq!(rpa::default_block_q(1000, 1), 128);
    assert_eq!(rpa::default_block_q(1000, 4), 32);
    assert_eq!(rpa::default_block_q(1000, 8), 16);
    assert_eq!(rpa::default_block_q(5, 1), 16);
    let a = inputs(0, DType::F32, 3);
    check(&a, Options { sm_scale: 0.1, ..Options::default() }, "default blocks");
    let t = tessera_kernels::types_of(&a);
    for (o, rule) in [
        (Options { block_q: Some(24), ..Options::default() }, "block-shape"),
        (Options { pages_per_compute_block: Some(0), ..Options::default() }, "block-shape"),
        (Options { sliding_window: Some(0), ..Options::default() }, "option-value"),
        (Options { soft_cap: Some(-1.0), ..Options::default() }, "option-value"),
    ] {
        assert_eq!(rpa::build(&t, &o, &Target::V5E).unwrap_err().rule, rule, "{o:?}");
    }
    assert_eq!(rpa::build(&t[..6], &Options::default(), &Target::V5E).unwrap_err().rule, "input-count");
    let mut bad = t.clone();
    bad[5] = Type::vector(DType::I32, &[3]);
    assert_eq!(rpa::build(&bad, &Options::default(), &Target::V5E).unwrap_err().rule, "operand-shape");
}

#[test]
fn removing_a_dma_wait_fails_loudly() {
    let a = inputs(0, DType::F32, 5);
    let mut k = rpa::build(&tessera_kernels::types_of(&a), &opts(&SHAPES[0], 128), &Target::V5E).unwrap();
    let v_buf = k.find_ref("v_buf").unwrap();
    let waits: Vec<_> = k.insts.iter().enumerate().filter(|(_, d)| matches!(&d.inst, Inst::DmaWait { dst, .. } if dst.r == v_buf)).map(|(i, _)| tessera_dsl::InstId(i as u32)).collect();
    assert_eq!(waits.len(), 1);
    for b in &mut k.blocks {
        b.insts.retain(|i| !waits.contains(i));
    }
    let e = rpa::run_kernel(&Interpreter, &k, &a).unwrap_err();
    assert_eq!(e.rule, "dma-unwaited", "{e}");
}

#[test]
fn verifies_on_every_target() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let k = rpa::build(&types(sh, dtype), &Options { sliding_window: Some(64), soft_cap: Some(30.0), ..opts(sh, sh.3) }, &Target::V5E).unwrap();
            for target in [Target::V5E, Target::V6E, Target::TPU7X] {
                tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("set {set} {dtype} {target}: {e}"));
            }
        }
    }
}

/// Every shape set (with window and cap on) plus a large configuration: 2048 tokens in
/// 128-token q blocks (MHA rows) / GQA 8 with 64-token blocks, 32-page (512-token) compute
/// blocks over a big cache, f32 and bf16.
#[test]
fn shape_sets_and_a_large_block_config_compile_with_libtpu() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    // Every target's modules in one batch: the oracle compiles the targets in parallel.
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let mut modules = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            for (set, sh) in SHAPES.iter().enumerate() {
                let o = Options { sliding_window: Some(64), soft_cap: Some(30.0), ..opts(sh, sh.3) };
                let l = tessera_codegen::lower(&rpa::build(&types(sh, dtype), &o, &target).unwrap(), &target).unwrap_or_else(|e| panic!("{e}"));
                modules.push((format!("ragged_paged_attention_set{set}_{dtype}"), l.stablehlo));
            }
            for (h, hkv, bq) in [(32, 32, 128), (32, 4, 64)] {
                let (t, d, np, ps, ms, pps) = (2048, 128, 1024, 16, 64, 128);
                let sh: Set = (t, h, hkv, d, np, ps, ms, pps, bq, 32);
                let k = rpa::build(&types(&sh, dtype), &opts(&sh, d), &Target::V5E).unwrap();
                let l = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{e}"));
                modules.push((format!("ragged_paged_attention_large_h{h}_hkv{hkv}_{dtype}"), l.stablehlo));
            }
        }
        jobs.extend(modules.into_iter().map(|(name, text)| (name, target.name.to_string(), text)));
    }
    oracle::assert_all_accepted(&jobs);
}

/// The library entry (sm_scale = 1/sqrt(d)) at every case's shapes, as the CLI runs it.
#[test]
fn library_entry_matches_its_reference() {
    let op = tessera_kernels::find("ragged_paged_attention").unwrap();
    for case in op.cases {
        let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
        for dtype in [DType::F32, DType::BF16] {
            let r = tessera_kernels::harness::run_case(op, &op.case_statics(case).unwrap(), &shapes, dtype, &Target::V6E, 3, &Interpreter).unwrap_or_else(|e| panic!("{e}"));
            assert!(r.passed(), "{} {shapes:?} {dtype}: {:?}", case.name, r.worst());
        }
    }
}

/// NaN and inf as torch's math attention over each query's visible keys: a nonfinite v
/// value reaches exactly the (row, column) entries that see it (`p * inf` = inf) and never
/// a causally earlier query, another sequence's tokens, padding or a key outside the
/// window; cache rows past kv_len never reach anyone; a NaN in q or a visible k makes the
/// rows that see it NaN; a row whose visible logits are all -inf is NaN. A prefill (with
/// unmasked kv blocks), a decode and a chunked prefill in one batch, 8-token kv blocks,
/// GQA 2; plain, sliding window and soft cap; f32 and bf16.
#[test]
fn nonfinite_values_reach_only_the_queries_that_see_them() {
    use rand::Rng;
    use tessera_tests::nonfinite::assert_matches;
    let (t, h, hkv, d, np, ps, ms, pps) = (48, 4, 2, 16, 16, 8, 4, 6);
    let mut rng = StdRng::seed_from_u64(41);
    let mut base = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (q0, k0, v0) = (base(t * h * d), base(hkv * np * ps * d), base(hkv * np * ps * d));
    // s0: prefill of 32 (tokens 0..32, pages 0..4); s1: decode over 20 keys (token 32,
    // pages 5..8); s2: 10 new tokens over 30 keys (tokens 33..43, pages 8..12); 43..48 pad.
    let kv_lens = Array::from_i32(&[ms], vec![32, 20, 30, 0]);
    let pages = Array::from_i32(&[ms, pps], vec![0, 1, 2, 3, 0, 0, 5, 6, 7, 0, 0, 0, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0]);
    let cu = Array::from_i32(&[ms + 1], vec![0, 32, 33, 43, 43]);
    let ns = Array::from_i32(&[1], vec![3]);
    let kv = |head: usize, page: usize, row: usize, e: usize| ((head * np + page) * ps + row) * d + e;
    let cases: Vec<(&str, usize, f32)> = vec![
        ("v", kv(0, 0, 5, 3), f32::NAN),             // s0 key 5
        ("v", kv(1, 2, 4, 1), f32::INFINITY),        // s0 key 20
        ("v", kv(0, 11, 1, 2), f32::NEG_INFINITY),   // s2 key 25
        ("v", kv(0, 7, 6, 4), f32::NAN),             // s1 key 22: past its kv_len
        ("v", kv(1, 6, 0, 0), f32::INFINITY),        // s1 key 8
        ("k", kv(1, 5, 3, 5), f32::NAN),             // s1 key 3
        ("k", kv(0, 8, 5, 6), f32::INFINITY),        // s2 key 5
        ("q", (40 * h + 1) * d + 7, f32::NAN),       // token 40 (s2), head 1
        ("q", (10 * h + 2) * d + 1, f32::NEG_INFINITY), // token 10 (s0), head 2
    ];
    for dtype in [DType::F32, DType::BF16] {
        let tol = if dtype == DType::BF16 { 3e-2 } else { 2e-5 };
        for statics in ["sm_scale=0.25", "sm_scale=0.25, sliding_window=6", "sm_scale=0.25, soft_cap=5.0"] {
            let statics = format!("{statics}, num_queries_per_block=16, num_kv_pages_per_block=1");
            let run = |what: &str, q: &[f32], k: &[f32], v: &[f32]| {
                let (q, k, v) = (Array::from_f32_in(dtype, &[t, h, d], q.to_vec()), Array::from_f32_in(dtype, &[hkv, np, ps, d], k.to_vec()), Array::from_f32_in(dtype, &[hkv, np, ps, d], v.to_vec()));
                let inputs = [Some(&q), Some(&k), Some(&v), Some(&kv_lens), Some(&pages), Some(&cu), Some(&ns)];
                let (got, _) = assert_matches(&format!("{what} {dtype} {statics}"), "ragged_paged_attention", &inputs, &statics, &Target::V5E, tol);
                assert!(got[0].to_f64_vec()[43 * h * d..].iter().all(|&x| x == 0.0), "{what}: padding tokens are 0");
            };
            for &(name, i, val) in &cases {
                let (mut q, mut k, mut v) = (q0.clone(), k0.clone(), v0.clone());
                match name {
                    "q" => q[i] = val,
                    "k" => k[i] = val,
                    _ => v[i] = val,
                }
                run(&format!("{val} in {name}[{i}]"), &q, &k, &v);
            }
            // Token 35 (s2) head 0: every visible logit -inf (k lane 0 = 1 on s2's pages
            // for kv head 0, q lane 0 = -inf).
            let (mut q, mut k) = (q0.clone(), k0.clone());
            for page in 8..12 {
                for row in 0..ps {
                    k[kv(0, page, row, 0)] = 1.0;
                }
            }
            q[(35 * h) * d] = f32::NEG_INFINITY;
            run("all -inf logits", &q, &k, &v0);
        }
    }
}

// ---- quantized caches ---------------------------------------------------------------------

/// int8 caches with per-token scales and fp8 (e4m3fn, e5m2) caches with per-tensor scales,
/// over every shape set (mixed decode / prefill batches, GQA 1/4/8), with and without a
/// sliding window, q in f32 and bf16, on every backend of this build against the
/// dequantise-then-attend f64 reference.
#[test]
fn quantized_caches_match_the_reference_on_every_backend() {
    // (cache dtype, per-token scales, k_scale, v_scale, sliding window).
    let configs: &[(DType, bool, f32, f32, Option<usize>)] = &[
        (DType::I8, true, 1.0, 1.0, None),
        (DType::I8, true, 0.5, 3.0, Some(20)),
        (DType::F8E4M3FN, false, 0.25, 2.0, None),
        (DType::F8E5M2, false, 1.0, 0.5, Some(7)),
        (DType::F8E4M3FN, true, 2.0, 1.0, None),
    ];
    // Every (shape set, config) pair is independent: a thread per core takes them in turn.
    let pairs: Vec<(usize, usize)> = (0..SHAPES.len()).flat_map(|set| (0..configs.len()).map(move |c| (set, c))).collect();
    tessera_tests::par_map(&pairs, |&(set, c)| {
        let sh = &SHAPES[set];
        let (cache, per_token, k_scale, v_scale, window) = configs[c];
        let q_dtype = if (set + c) % 2 == 0 { DType::F32 } else { DType::BF16 };
        let mut a = inputs(set, q_dtype, 500 + (set * 8 + c) as u64);
        tessera_kernels::paged_attention::quantize_cache(&mut a, 1, cache, per_token, &mut StdRng::seed_from_u64(set as u64 * 31 + c as u64));
        let scales = tessera_kernels::paged_attention::KvScales { k_scale, v_scale, per_token };
        let o = Options { sliding_window: window, scales, ..opts(sh, sh.3) };
        let want = reference::ragged_paged_attention_quantized(&a, o.sm_scale as f64, window, None, (k_scale as f64, v_scale as f64));
        // The JIT runs every config; the interpreter and LLVM take turns (over the shape
        // sets each sees every cache config with both q dtypes), halving their share of
        // the test's time.
        let turn = (set + c + set / 2) % 2;
        for be in tessera_tests::backends::all() {
            match be {
                Backend::Interp if turn == 1 => continue,
                Backend::Llvm if turn == 0 => continue,
                _ => {}
            }
            let out = rpa::ragged_paged_attention(be.executor(), &a, &o, &Target::V5E).unwrap_or_else(|e| panic!("set {set} {cache} {be:?}: {e}"));
            let check = check_output(&out, &want);
            assert!(check.passed(), "set {set}, {cache} cache (per_token {per_token}, k_scale {k_scale}, v_scale {v_scale}, window {window:?}), q {q_dtype}, {be:?}: {check:?}");
        }
    });
}

/// libtpu compiles the quantized variants (int8 with per-token scales, fp8 e4m3fn with
/// per-tensor scales and a window; q bf16) on v5e, v6e and tpu7x.
#[test]
fn quantized_caches_compile_with_libtpu() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let sh = &SHAPES[0];
    let mut kernels = Vec::new();
    for (cache, per_token) in [(DType::I8, true), (DType::F8E4M3FN, false)] {
        let mut t = types(sh, DType::BF16);
        t[1].dtype = cache;
        t[2].dtype = cache;
        if per_token {
            t.extend([Type::vector(DType::F32, &t[1].shape[..3]), Type::vector(DType::F32, &t[1].shape[..3])]);
        }
        let scales = tessera_kernels::paged_attention::KvScales { k_scale: 0.5, v_scale: 2.0, per_token };
        let o = Options { sliding_window: (!per_token).then_some(24), scales, ..opts(sh, sh.3) };
        kernels.push(rpa::build(&t, &o, &Target::V5E).unwrap_or_else(|e| panic!("{e}")));
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}
