//! Paged attention (decode): numerics against the f64 reference (f32, bf16; GQA 1/4/8;
//! lengths that are not multiples of the page size, empty and single-token sequences;
//! several compute-block sizes), the interpreter catching a missing DMA wait and a wrong
//! page, and libtpu acceptance of a large-block configuration.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Inst, Kernel, Target, Type};
use tessera_kernels::harness::check_output;
use tessera_kernels::paged_attention::{self as pa, reference};
use tessera_kernels::types_of;
use tessera_tests::oracle;

/// (B, H, Hkv, D, num_pages, page_size, pages_per_seq, pages_per_compute_block).
type Set = (usize, usize, usize, usize, usize, usize, usize, usize);

const SHAPES: &[Set] = &[
    (4, 8, 2, 128, 16, 16, 4, 2),   // GQA 4, two compute blocks
    (3, 8, 8, 128, 12, 16, 5, 2),   // MHA (group 1), pages_per_seq not a multiple of the block
    (5, 8, 1, 128, 20, 16, 6, 4),   // GQA 8 (MQA)
    (2, 4, 1, 128, 8, 32, 3, 1),    // one page per block, 32-token pages
    (6, 16, 4, 128, 30, 16, 8, 3),  // GQA 4, three pages per block
    (3, 2, 2, 256, 9, 16, 4, 4),    // D = 256, everything in one block
];

fn shapes(&(b, h, hkv, d, np, ps, pps, _): &Set) -> Vec<Vec<usize>> {
    vec![vec![b, h, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![b], vec![b, pps]]
}

fn inputs(set: usize, dtype: DType, seed: u64) -> Vec<Array> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut a = pa::random_inputs(&shapes(&SHAPES[set]), dtype, &mut rng);
    // Make sure some lengths end mid-page.
    let (ps, pps) = (SHAPES[set].5, SHAPES[set].6);
    if let tessera_dsl::interp::Data::I32(l) = &mut a[3].data {
        if l.len() > 2 {
            l[2] = (pps * ps - ps / 2 - 1) as i32;
        }
    }
    a
}

#[test]
fn matches_the_reference_f32_and_bf16() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let a = inputs(set, dtype, 7 + set as u64);
            let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], Some(sh.7), &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
            let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
            let check = check_output(&out, &want);
            assert!(check.passed(), "set {set} {dtype}: {check:?}; lengths {:?}", a[3].as_i32().unwrap());
            // Sequence 0 is empty: zeros. Sequence 1 has one token: its value row.
            let (h, d) = (a[0].shape[1], a[0].shape[2]);
            assert!(out.to_f64_vec()[..h * d].iter().all(|&x| x == 0.0), "set {set}: empty sequence");
        }
    }
}

/// The default compute block follows the MXU: 256 tokens on v5e, 512 on v6e.
#[test]
fn default_compute_block_is_per_generation() {
    assert_eq!(pa::default_pages_per_compute_block(16, 64, &Target::V5E), 16);
    assert_eq!(pa::default_pages_per_compute_block(16, 64, &Target::V6E), 32);
    assert_eq!(pa::default_pages_per_compute_block(16, 8, &Target::TPU7X), 8);
}

#[test]
fn single_token_sequences_return_their_value_row() {
    let a = inputs(0, DType::F32, 3);
    assert_eq!(a[3].as_i32().unwrap()[1], 1);
    let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], None, &Target::V5E).unwrap().to_f64_vec();
    let (h, d, hkv, np, ps) = (8, 128, 2, 16, 16);
    let page = a[4].as_i32().unwrap()[4] as usize; // sequence 1, page 0
    let v = a[2].to_f64_vec();
    for head in 0..h {
        let kv = head / (h / hkv);
        let row = &v[((kv * np + page) * ps) * d..][..d];
        let got = &out[(h + head) * d..][..d];
        assert!(row.iter().zip(got).all(|(x, y)| (x - y).abs() < 1e-6), "head {head}");
    }
}

#[test]
fn every_compute_block_size_agrees() {
    let a = inputs(4, DType::F32, 11);
    let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
    for ppcb in 1..=9 {
        let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], Some(ppcb), &Target::V5E).unwrap();
        assert!(check_output(&out, &want).passed(), "pages_per_compute_block {ppcb}");
    }
}

fn kernel_for(a: &[Array], ppcb: usize) -> Kernel {
    pa::build(&types_of(a), Some(ppcb), pa::KvScales::NONE, &Target::V5E).unwrap()
}

fn ref_named(k: &Kernel, name: &str) -> tessera_dsl::RefId {
    k.find_ref(name).unwrap()
}

#[test]
fn removing_a_dma_wait_fails_loudly() {
    let a = inputs(0, DType::F32, 5);
    let mut k = kernel_for(&a, 2);
    let v_buf = ref_named(&k, "v_buf");
    let waits: Vec<_> = k.insts.iter().enumerate().filter(|(_, d)| matches!(&d.inst, Inst::DmaWait { dst, .. } if dst.r == v_buf)).map(|(i, _)| tessera_dsl::InstId(i as u32)).collect();
    assert_eq!(waits.len(), 1);
    for b in &mut k.blocks {
        b.insts.retain(|i| !waits.contains(i));
    }
    let e = pa::run_kernel(&Interpreter, &k, &a[0], &a[1], &a[2], &a[3], &a[4]).unwrap_err();
    assert_eq!(e.rule, "dma-unwaited", "{e}");
    assert!(e.message.contains("v_buf"), "{e}");
}

#[test]
fn copying_the_wrong_page_is_caught() {
    let a = inputs(0, DType::F32, 5);
    let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
    let mut k = kernel_for(&a, 2);
    let k_buf = ref_named(&k, "k_buf");
    // Every K copy fetches page (kv head index) instead of the page table's entry; the
    // waits still balance, so only the numbers can tell.
    for d in &mut k.insts {
        if let Inst::DmaStart { src, dst, .. } = &mut d.inst {
            if dst.r == k_buf {
                src.slices[1].start = src.slices[0].start;
            }
        }
    }
    let out = pa::run_kernel(&Interpreter, &k, &a[0], &a[1], &a[2], &a[3], &a[4]).unwrap();
    assert!(!check_output(&out, &want).passed());
}

#[test]
fn verifies_on_every_target() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let t: Vec<Type> = shapes(sh).iter().enumerate().map(|(i, s)| Type::vector(if i < 3 { dtype } else { DType::I32 }, s)).collect();
            let k = pa::build(&t, Some(sh.7), pa::KvScales::NONE, &Target::V5E).unwrap();
            for target in [Target::V5E, Target::V6E, Target::TPU7X] {
                tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("set {set} {dtype} {target}: {e}"));
            }
        }
    }
}

/// Every numerics shape set (GQA 1/4/8, D 128/256) plus a large compute block (32 pages
/// of 16 tokens = 512 tokens) over a big cache, f32 and bf16.
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
                let t: Vec<Type> = shapes(sh).iter().enumerate().map(|(i, s)| Type::vector(if i < 3 { dtype } else { DType::I32 }, s)).collect();
                let l = tessera_codegen::lower(&pa::build(&t, Some(sh.7), pa::KvScales::NONE, &Target::V5E).unwrap(), &target).unwrap_or_else(|e| panic!("{e}"));
                modules.push((format!("paged_attention_set{set}_{dtype}"), l.stablehlo));
            }
            let (b, h, hkv, d, np, ps, pps) = (16, 32, 8, 128, 1024, 16, 64);
            let t = vec![
                Type::vector(dtype, &[b, h, d]),
                Type::vector(dtype, &[hkv, np, ps, d]),
                Type::vector(dtype, &[hkv, np, ps, d]),
                Type::vector(DType::I32, &[b]),
                Type::vector(DType::I32, &[b, pps]),
            ];
            let k = pa::build(&t, Some(32), pa::KvScales::NONE, &Target::V5E).unwrap();
            let l = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{e}"));
            modules.push((format!("paged_attention_large_{dtype}"), l.stablehlo));
        }
        jobs.extend(modules.into_iter().map(|(name, text)| (name, target.name.to_string(), text)));
    }
    oracle::assert_all_accepted(&jobs);
}

/// NaN and inf as torch's math attention over each sequence's visible keys: a NaN / inf
/// in q or a visible key's k or v reaches only its own sequence's rows (v: only its column,
/// `p * inf` = inf); a value past the length in a used page, or in a page the sequence does
/// not use (but another does), never reaches it; a whole first compute block of -inf logits
/// followed by finite ones is finite (weight 0), and an empty sequence stays 0. Two compute
/// blocks, GQA 2, f32 and bf16.
#[test]
fn nonfinite_values_reach_only_their_sequence() {
    use rand::Rng;
    use tessera_tests::nonfinite::assert_matches;
    let (b, h, hkv, d, np, ps, pps) = (3, 4, 2, 16, 8, 8, 4);
    let mut rng = StdRng::seed_from_u64(31);
    let mut base = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (q0, k0, v0) = (base(b * h * d), base(hkv * np * ps * d), base(hkv * np * ps * d));
    // Sequence 0: 13 tokens on pages 2, 5 (2 pages per compute block); 1: 30 tokens on
    // pages 1, 3, 4, 6; 2: empty.
    let lengths = Array::from_i32(&[b], vec![13, 30, 0]);
    let pages = Array::from_i32(&[b, pps], vec![2, 5, 7, 7, 1, 3, 4, 6, 0, 0, 0, 0]);
    let at = |head: usize, page: usize, row: usize, e: usize| ((head * np + page) * ps + row) * d + e;
    let cases: Vec<(&str, usize, f32)> = vec![
        ("q", 4 * d + 3, f32::NAN),                  // sequence 1, head 0
        ("q", d + 5, f32::NEG_INFINITY),             // sequence 0, head 1
        ("k", at(0, 5, 2, 1), f32::NAN),             // sequence 0 token 10 (kv head 0)
        ("k", at(1, 3, 1, 0), f32::INFINITY),        // sequence 1 token 9 (kv head 1)
        ("v", at(0, 2, 4, 6), f32::INFINITY),        // sequence 0 token 4
        ("v", at(1, 6, 5, 2), f32::NEG_INFINITY),    // sequence 1 token 29
        ("v", at(0, 5, 6, 7), f32::NAN),             // sequence 0 token 14: past its length
        ("v", at(0, 7, 0, 1), f32::INFINITY),        // page 7: nobody's visible token
        ("k", at(1, 0, 3, 2), f32::NAN),             // page 0: only the empty sequence's
    ];
    for dtype in [DType::F32, DType::BF16] {
        let tol = if dtype == DType::BF16 { 3e-2 } else { 2e-5 };
        let run = |what: &str, q: &[f32], k: &[f32], v: &[f32]| {
            let (q, k, v) = (Array::from_f32_in(dtype, &[b, h, d], q.to_vec()), Array::from_f32_in(dtype, &[hkv, np, ps, d], k.to_vec()), Array::from_f32_in(dtype, &[hkv, np, ps, d], v.to_vec()));
            let (got, _) = assert_matches(&format!("{what} {dtype}"), "paged_attention", &[Some(&q), Some(&k), Some(&v), Some(&lengths), Some(&pages)], "pages_per_compute_block=2", &Target::V5E, tol);
            assert!(got[0].to_f64_vec()[2 * h * d..].iter().all(|&x| x == 0.0), "{what}: the empty sequence is 0");
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
        // Sequence 1's first compute block (tokens 0..16, pages 1 and 3) all at -inf for
        // kv head 0 (k lane 0 = -inf, q lane 0 > 0 for both of its query heads), the
        // second block finite: finite rows.
        let (mut q, mut k) = (q0.clone(), k0.clone());
        for page in [1, 3] {
            for row in 0..ps {
                k[at(0, page, row, 0)] = f32::NEG_INFINITY;
            }
        }
        q[4 * d] = 0.5;
        q[5 * d] = 0.25;
        run("a first block of -inf logits", &q, &k, &v0);
        let (got, _) = tessera_tests::nonfinite::run_and_reference("paged_attention", &[Some(&Array::from_f32_in(dtype, &[b, h, d], q)), Some(&Array::from_f32_in(dtype, &[hkv, np, ps, d], k)), Some(&Array::from_f32_in(dtype, &[hkv, np, ps, d], v0.clone())), Some(&lengths), Some(&pages)], "pages_per_compute_block=2", &Target::V5E);
        assert!(got[0].to_f64_vec()[4 * d..6 * d].iter().all(|x| x.is_finite()), "{dtype}: -inf logits weigh 0");
    }
}

// ---- quantized caches ---------------------------------------------------------------------

/// A cache of `dtype` for shape set `set`: stored values of that dtype (int8 codes in
/// -127..=127; fp8 values of unit range), per-token scales `[Hkv, num_pages, page_size]`
/// around 1/127 when `per_token`; q in `q_dtype`.
fn quantized_inputs(set: usize, q_dtype: DType, cache: DType, per_token: bool, seed: u64) -> Vec<Array> {
    let mut a = inputs(set, q_dtype, seed);
    pa::quantize_cache(&mut a, 1, cache, per_token, &mut StdRng::seed_from_u64(seed ^ 0x5eed));
    a
}

/// int8 caches with per-token scales, fp8 (e4m3fn, e5m2) caches with per-tensor scales and
/// both kinds of scale together, over every shape set (GQA 1/4/8, lengths mid-page, empty
/// and one-token sequences), q in f32 and bf16, on every backend of this build against the
/// dequantise-then-attend f64 reference.
#[test]
fn quantized_caches_match_the_reference_on_every_backend() {
    // (cache dtype, per-token scales, k_scale, v_scale).
    let configs: &[(DType, bool, Option<f64>, Option<f64>)] = &[
        (DType::I8, true, None, None),
        (DType::I8, true, Some(0.5), Some(3.0)),
        (DType::F8E4M3FN, false, Some(0.25), Some(2.0)),
        (DType::F8E5M2, false, None, Some(0.5)),
        (DType::F8E4M3FN, true, Some(2.0), None),
    ];
    for (set, sh) in SHAPES.iter().enumerate() {
        for (c, &(cache, per_token, k_scale, v_scale)) in configs.iter().enumerate() {
            let q_dtype = if (set + c) % 2 == 0 { DType::F32 } else { DType::BF16 };
            let a = quantized_inputs(set, q_dtype, cache, per_token, 100 + (set * 8 + c) as u64);
            let mut statics = format!("pages_per_compute_block={}", sh.7);
            for (name, s) in [("k_scale", k_scale), ("v_scale", v_scale)] {
                if let Some(s) = s {
                    statics += &format!(", {name}={s}");
                }
            }
            let scales = (k_scale.unwrap_or(1.0), v_scale.unwrap_or(1.0));
            let want = reference::paged_attention_quantized(&a[0], &a[1], &a[2], &a[3], &a[4], scales, per_token.then(|| (&a[5], &a[6])));
            let refs: Vec<&Array> = a.iter().collect();
            for be in tessera_tests::backends::all() {
                let out = tessera_kernels::run1(be.executor(), "paged_attention", &refs, &statics, &Target::V5E).unwrap_or_else(|e| panic!("set {set} {cache} {be:?}: {e}"));
                let check = check_output(&out, &want);
                assert!(check.passed(), "set {set}, {cache} cache (per_token {per_token}, {statics}), q {q_dtype}, {be:?}: {check:?}");
            }
        }
    }
}

/// Bad scale operands are errors naming the op, the operand and the rule.
#[test]
fn quantized_cache_misuse_is_a_clear_error() {
    let a = quantized_inputs(0, DType::F32, DType::I8, true, 9);
    let refs: Vec<&Array> = a.iter().collect();
    let run = |arrays: &[&Array]| tessera_kernels::run(&Interpreter, "paged_attention", arrays, "", &Target::V5E).unwrap_err();
    // One per-token scale tensor without the other.
    let e = run(&refs[..6]);
    assert_eq!((e.rule, e.kernel.as_str()), ("kv-scales", "paged_attention"), "{e}");
    // Scales of the wrong shape (per page instead of per token).
    let per_page = Array::from_f32(&a[5].shape[..2], vec![1.0; a[5].shape[0] * a[5].shape[1]]);
    let mut bad = refs.clone();
    bad[5] = &per_page;
    let e = run(&bad);
    assert!(e.to_string().contains("k_token_scales"), "{e}");
    // int8 keys with fp8 values.
    let fp8 = Array::from_f32_as_fp8(DType::F8E4M3FN, &a[2].shape, &vec![0.5; a[2].data.len()]);
    let mut bad = refs.clone();
    bad[2] = &fp8;
    let e = run(&bad);
    assert_eq!(e.rule, "operand-dtype", "{e}");
    assert!(e.to_string().contains("k_pages"), "{e}");
}

/// libtpu compiles the quantized variants: int8 with per-token scales, and fp8 with
/// per-tensor scales (q bf16), on v5e, v6e and tpu7x.
#[test]
fn quantized_caches_compile_with_libtpu() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let mut kernels = Vec::new();
    for (cache, per_token) in [(DType::I8, true), (DType::F8E4M3FN, false), (DType::F8E5M2, true)] {
        let a = quantized_inputs(4, DType::BF16, cache, per_token, 3);
        let scales = pa::KvScales { k_scale: 0.5, v_scale: 2.0, per_token };
        kernels.push(pa::build(&types_of(&a), Some(SHAPES[4].7), scales, &Target::V5E).unwrap_or_else(|e| panic!("{e}")));
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}
