//! Splash attention against the independent f64 reference with the *explicit* dense mask
//! (the reference never sees the block metadata): causal, sliding windows smaller and larger
//! than a block, chunked, prefix-LM, a mask per head and an arbitrary random mask, f32 and
//! bf16, forward and backward, GQA 1/4/8, lengths that are not multiples of the blocks, on
//! every CPU backend of the build. Then the metadata itself (decoding gives the mask back,
//! partial blocks are shared), block skipping counted as DMAs, and bad metadata refused.

use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{DType, Executor, Interpreter, Target, Type};
use tessera_kernels::attention::{random_segment_ids, reference, AttentionParams, SegmentIds};
use tessera_kernels::harness::{check_output, random_array};
use tessera_kernels::splash::{self, MaskInfo};

/// `(B, H, Hkv, Sq, Skv, D)`.
type Shape = (usize, usize, usize, usize, usize, usize);

/// A mask as a predicate `(head, query, key) -> visible`, with how many heads it has.
struct Mask {
    name: &'static str,
    heads: usize,
    visible: Box<dyn Fn(usize, usize, usize) -> bool>,
}

fn mask(name: &'static str, heads: usize, f: impl Fn(usize, usize, usize) -> bool + 'static) -> Mask {
    Mask { name, heads, visible: Box::new(f) }
}

/// The masks each shape runs with (`h` query heads).
fn masks(h: usize, seed: u64) -> Vec<Mask> {
    let mut rng = StdRng::seed_from_u64(seed);
    let random: Vec<bool> = (0..512 * 512).map(|_| rng.gen_bool(0.3)).collect();
    vec![
        mask("causal", 1, |_, r, c| c <= r),
        // Smaller than a block (HF sliding_window 41) and larger than one, both sides.
        mask("local 40", 1, |_, r, c| c <= r && r - c <= 40),
        mask("local 150/60", 1, |_, r, c| r <= c + 150 && c <= r + 60),
        // Llama 4's chunked attention: causal inside chunks of 96.
        mask("chunked 96", 1, |_, r, c| r / 96 == c / 96 && c <= r),
        mask("prefix-lm 50", 1, |_, r, c| c <= r || c < 50),
        // A window per head (each head its own metadata rows).
        mask("per-head windows", h, |hh, r, c| c <= r && r - c <= 16 + 48 * hh),
        // An arbitrary mask: independent bits, most blocks partial, some rows see nothing.
        mask("random", 1, move |_, r, c| random[(r % 512) * 512 + c % 512]),
    ]
}

/// GQA 1, 4, 8; aligned and ragged lengths; Sq < Skv and Sq > Skv; D 32 / 64 / 128.
const SHAPES: [Shape; 5] = [(1, 2, 2, 256, 256, 128), (2, 4, 1, 200, 333, 64), (1, 8, 1, 130, 130, 32), (1, 4, 1, 384, 200, 64), (2, 2, 2, 77, 300, 64)];

/// Blocks: several per axis for every shape (skips, partial and full blocks, ragged edges).
const BQ: usize = 32;
const BK: usize = 128;

fn tol(dtype: DType, backward: bool) -> f64 {
    match (dtype, backward) {
        (DType::BF16, false) => 1.6e-2,
        (DType::BF16, true) => 3e-2,
        (_, false) => 1e-5,
        _ => 2e-5,
    }
}

fn assert_close(what: &str, got: &Array, want: &[f64], tol: f64) {
    let c = check_output(got, want);
    assert!(c.nan_count == 0 && c.scaled_err <= tol && c.nonfinite == 0, "{what}: scaled error {:.3e} (tolerance {tol:.1e}), {} NaN, {} infinities unlike the reference", c.scaled_err, c.nan_count, c.nonfinite);
}

struct Problem {
    q: Array,
    k: Array,
    v: Array,
    seg: Option<SegmentIds>,
    info: MaskInfo,
    cfg: reference::Attention,
}

fn problem(shape: Shape, dtype: DType, m: &Mask, segmented: bool, soft_cap: Option<f32>, blocks: (usize, usize), seed: u64) -> Problem {
    let (b, h, hkv, sq, skv, d) = shape;
    let mut rng = StdRng::seed_from_u64(seed);
    let scaled = |a: Array, s: f32| Array::from_f32_in(dtype, &a.shape, a.to_f32_vec().iter().map(|x| x * s).collect());
    let q = scaled(random_array(dtype, &[b, h, sq, d], &mut rng), 2.0);
    let k = scaled(random_array(dtype, &[b, hkv, skv, d], &mut rng), 2.0);
    let v = random_array(dtype, &[b, hkv, skv, d], &mut rng);
    let seg = segmented.then(|| random_segment_ids(b, sq, skv, &mut rng));
    let info = MaskInfo::build(m.heads, sq, skv, blocks.0, blocks.1, &m.visible).unwrap();
    let dense: Vec<bool> = (0..m.heads).flat_map(|hh| (0..sq).flat_map(move |r| (0..skv).map(move |c| (hh, r, c)))).map(|(hh, r, c)| (m.visible)(hh, r, c)).collect();
    let cfg = reference::Attention {
        b,
        h,
        hkv,
        sq,
        skv,
        d,
        causal: false,
        sm_scale: 1.0 / (d as f64).sqrt() as f32 as f64,
        soft_cap: soft_cap.map(f64::from),
        q_segments: seg.as_ref().map(|s| s.q.as_i32().unwrap().to_vec()),
        kv_segments: seg.as_ref().map(|s| s.kv.as_i32().unwrap().to_vec()),
        window_left: None,
        window_right: None,
        mask: Some((m.heads, dense)),
    };
    Problem { q, k, v, seg, info, cfg }
}

fn params(d: usize, soft_cap: Option<f32>) -> AttentionParams {
    let p = AttentionParams::new(d, false);
    match soft_cap {
        Some(c) => p.with_soft_cap(c),
        None => p,
    }
}

#[allow(clippy::too_many_arguments)]
fn check_case(exec: &dyn Executor, shape: Shape, dtype: DType, m: &Mask, segmented: bool, soft_cap: Option<f32>, target: &Target, seed: u64) {
    let p = problem(shape, dtype, m, segmented, soft_cap, (BQ, BK), seed);
    let prm = params(shape.5, soft_cap);
    let what = format!("{} {shape:?} {dtype} seg={segmented} cap={soft_cap:?} on {target}", m.name);
    let (q, k, v) = (p.q.to_f64_vec(), p.k.to_f64_vec(), p.v.to_f64_vec());
    let (o_ref, lse_ref) = reference::forward(&p.cfg, &q, &k, &v);
    let (o, lse) = splash::splash_attention(exec, &p.q, &p.k, &p.v, &p.info, p.seg.as_ref(), &prm, target).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_close(&format!("o of {what}"), &o, &o_ref, tol(dtype, false));
    assert_close(&format!("lse of {what}"), &lse, &lse_ref, tol(DType::F32, false));

    let o_in = Array::from_f32_in(dtype, &p.q.shape, o_ref.iter().map(|&x| x as f32).collect());
    let lse_in = Array::from_f32(&p.q.shape[..3], lse_ref.iter().map(|&x| x as f32).collect());
    let dout = random_array(dtype, &p.q.shape, &mut StdRng::seed_from_u64(seed + 1000));
    let (dq, dk, dv) = splash::splash_attention_bwd(exec, &p.q, &p.k, &p.v, &o_in, &lse_in, &dout, &p.info, p.seg.as_ref(), &prm, target).unwrap_or_else(|e| panic!("{what}: {e}"));
    let (dq_ref, dk_ref, dv_ref) = reference::backward(&p.cfg, &q, &k, &v, &dout.to_f64_vec());
    assert_close(&format!("dq of {what}"), &dq, &dq_ref, tol(dtype, true));
    assert_close(&format!("dk of {what}"), &dk, &dk_ref, tol(dtype, true));
    assert_close(&format!("dv of {what}"), &dv, &dv_ref, tol(dtype, true));
}

/// Every mask on three of the five shapes (rotating, so each shape meets most masks) in f32 on
/// the interpreter; segment ids and a soft cap on some.
#[test]
fn masks_match_the_reference() {
    for (s, &shape) in SHAPES.iter().enumerate() {
        for (n, m) in masks(shape.1, s as u64).iter().enumerate() {
            if (s + n) % 5 >= 3 {
                continue;
            }
            let target = [Target::V5E, Target::V6E, Target::TPU7X][(s + n) % 3];
            let segmented = (s + n) % 4 == 1;
            let cap = ((s + n) % 3 == 2).then_some(5.0);
            check_case(&Interpreter, shape, DType::F32, m, segmented, cap, &target, (10 * s + n) as u64);
        }
    }
}

/// bf16 and f32 on every CPU backend of the build (the compiled ones included).
#[test]
fn masks_match_the_reference_on_every_backend() {
    for be in tessera_tests::backends::all() {
        let before = tessera_codegen::cpu::cache_stats().fallbacks;
        for dtype in [DType::F32, DType::BF16] {
            for (s, &shape) in SHAPES.iter().enumerate() {
                let ms = masks(shape.1, s as u64);
                let m = &ms[(s + usize::from(dtype == DType::BF16) * 3) % ms.len()];
                check_case(be.executor(), shape, dtype, m, s == 2, (s == 3).then_some(5.0), &Target::V6E, 50 + s as u64);
            }
        }
        assert_eq!(tessera_codegen::cpu::cache_stats().fallbacks, before, "{be:?} fell back to the interpreter");
    }
}

/// The metadata describes the mask exactly (decoding it gives every pair back), partial
/// blocks are deduplicated (a causal mask at square blocks has one), and the walks are as
/// long as the longest row / column of visited blocks.
#[test]
fn metadata_describes_the_mask() {
    for (sq, skv, bq, bk) in [(256, 256, 64, 64), (200, 333, 32, 128), (77, 300, 77, 128), (130, 130, 128, 128)] {
        for m in masks(3, 7) {
            let info = MaskInfo::build(m.heads, sq, skv, bq, bk, &m.visible).unwrap();
            let (heads, dense) = splash::decode(&info.mask_blocks, &info.fwd_info, sq, skv).expect("decodes");
            assert_eq!(heads, m.heads);
            for hh in 0..heads {
                for r in 0..sq {
                    for c in 0..skv {
                        assert_eq!(dense[(hh * sq + r) * skv + c], (m.visible)(hh, r, c), "{} at ({hh}, {r}, {c}), {sq}x{skv} blocks {bq}x{bk}", m.name);
                    }
                }
            }
            // The backward's walks are the transpose: the same (head, q block, kv block) set.
            let pairs = |info: &Array, transpose: bool| {
                let (n_own, steps) = (info.shape[2], info.shape[3]);
                let rows = info.shape[1] * n_own;
                let x = info.as_i32().unwrap();
                assert_eq!(n_own, if transpose { skv.div_ceil(bk) } else { sq.div_ceil(bq) });
                let mut out = Vec::new();
                for w in 0..rows {
                    for s in 0..steps {
                        if x[(rows + w) * steps + s] != splash::SKIP {
                            let (hh, own, other) = (w / n_own, w % n_own, x[w * steps + s] as usize);
                            out.push(if transpose { (hh, other, own, x[(rows + w) * steps + s]) } else { (hh, own, other, x[(rows + w) * steps + s]) });
                        }
                    }
                }
                out.sort_unstable();
                out
            };
            assert_eq!(pairs(&info.fwd_info, false), pairs(&info.bwd_info, true), "{}", m.name);
        }
    }
    let causal = MaskInfo::build(1, 1024, 1024, 128, 128, |_, r, c| c <= r).unwrap();
    assert_eq!(causal.mask_blocks.shape, vec![1, 128, 128], "the 8 diagonal blocks share one partial block");
    assert_eq!(causal.fwd_info.shape, vec![3, 1, 8, 8]);
    let full = MaskInfo::build(1, 512, 512, 128, 128, |_, _, _| true).unwrap();
    assert_eq!(full.mask_blocks.shape, vec![1, 128, 128], "no partial block: one all-zero placeholder");
    assert!(full.fwd_info.as_i32().unwrap()[16..32].iter().all(|&k| k == splash::FULL));
}

/// Fully masked blocks are neither computed nor fetched, full blocks need no mask window:
/// S = 2048, blocks 128, a causal window of 256 keys: each q block visits 3 kv blocks (2 at
/// the start), counted as DMAs by the interpreter, and the output is the reference's.
#[test]
fn masked_blocks_are_never_fetched() {
    let (s, d) = (2048, 64);
    let m = mask("local 255", 1, |_, r, c| c <= r && r - c <= 255);
    let p = problem((1, 1, 1, s, s, d), DType::F32, &m, false, None, (128, 128), 3);
    assert_eq!(p.info.fwd_info.shape, vec![3, 1, 16, 3], "walks of at most 3 kv blocks");
    // Partial blocks: the diagonal one and the window's far edge, shared by every q block.
    assert_eq!(p.info.mask_blocks.shape[0], 2);
    let t = |a: &Array| Type::vector(a.dtype, &a.shape);
    let kernel = splash::build_splash_attention(&t(&p.q), &t(&p.k), &t(&p.v), &t(&p.info.mask_blocks), &t(&p.info.fwd_info), &t(&p.info.bwd_info), false, &params(d, None), true, &Target::V5E).unwrap();
    let dummy = Array::from_i32(&[1, 1, 1], vec![0]);
    let args = [&p.info.fwd_info, &p.q, &p.k, &p.v, &p.info.mask_blocks, &dummy, &dummy];
    let (out, stats) = interp::run_with_stats(&kernel, &args).unwrap();
    // q: 16 blocks. k, v: q block i visits kv blocks max(i-2, 0)..=i, a DMA whenever the
    // block changes: 1 (i = 0) + 1 (i = 1: block 0 still resident) + 3 x 14 = 44 each (a
    // full causal walk: 136, non-causal: 256). The mask window: block 0 (the diagonal's)
    // first, then per q block from i = 2 the far edge's and the diagonal's again, 1 + 2 x 14
    // (full blocks and padding steps keep the resident window). The segment dummies: once.
    let kv = 1 + 1 + 3 * 14;
    let masks = 1 + 2 * 14;
    assert_eq!(stats.block_loads, 16 + 2 * kv + masks + 2, "{stats:?}");
    let (o_ref, _) = reference::forward(&p.cfg, &p.q.to_f64_vec(), &p.k.to_f64_vec(), &p.v.to_f64_vec());
    assert_close("o (block skipping)", &out[0], &o_ref, 1e-5);
}

/// Metadata that does not fit the problem is refused by name before any kernel runs.
#[test]
fn mismatched_metadata_is_refused() {
    let m = mask("causal", 1, |_, r, c| c <= r);
    let p = problem((1, 4, 2, 256, 256, 64), DType::F32, &m, false, None, (64, 128), 1);
    let other = MaskInfo::build(1, 512, 256, 64, 128, |_, r, c| c <= r).unwrap();
    let swapped = MaskInfo { fwd_info: other.fwd_info.clone(), ..p.info.clone() };
    let e = splash::splash_attention(&Interpreter, &p.q, &p.k, &p.v, &swapped, None, &params(64, None), &Target::V6E).unwrap_err().to_string();
    assert!(e.contains("fwd_info") && e.contains("splash_attention"), "{e}");
    let wrong_bwd = MaskInfo { bwd_info: p.info.fwd_info.clone(), ..p.info.clone() };
    let e = splash::splash_attention(&Interpreter, &p.q, &p.k, &p.v, &wrong_bwd, None, &params(64, None), &Target::V6E).unwrap_err().to_string();
    assert!(e.contains("bwd_info"), "{e}");
    assert!(MaskInfo::build(1, 0, 256, 64, 128, |_, _, _| true).is_err());
    // A shared mask over 256 queries has 4 q-block walks, as many as a per-head mask of 2
    // heads over 128 queries would have: the head count in the shape tells them apart.
    let p2 = problem((1, 2, 2, 128, 256, 64), DType::F32, &m, false, None, (64, 128), 2);
    let long = MaskInfo::build(1, 256, 256, 64, 128, |_, r, c| c <= r).unwrap();
    let e = splash::splash_attention(&Interpreter, &p2.q, &p2.k, &p2.v, &long, None, &params(64, None), &Target::V6E).unwrap_err().to_string();
    assert!(e.contains("fwd_info") && e.contains("128 queries"), "{e}");
}

/// libtpu compiles the forward and the backward at large blocks (1024) for every target, with
/// a per-head mask over GQA 4:1, in bf16 (tpu_compiler.rs compiles the library
/// cases in f32 too).
#[test]
fn libtpu_compiles_large_blocks() {
    if !tessera_tests::oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let mut jobs = Vec::new();
    let block = 1024;
    let info = MaskInfo::build(8, 4096, 4096, block, block, |h, r, c| c <= r && r - c <= 700 + 300 * h).unwrap();
    let t = |a: &Array| Type::vector(a.dtype, &a.shape);
    let (mb, fi, bi) = (t(&info.mask_blocks), t(&info.fwd_info), t(&info.bwd_info));
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let q = Type::vector(DType::BF16, &[1, 8, 4096, 128]);
        let kv = Type::vector(DType::BF16, &[1, 2, 4096, 128]);
        let params = AttentionParams::new(128, false);
        let mut kernels = vec![splash::build_splash_attention(&q, &kv, &kv, &mb, &fi, &bi, false, &params, true, &target).unwrap()];
        kernels.extend(splash::build_splash_attention_bwd(&q, &kv, &kv, &mb, &fi, &bi, false, &params, &target).unwrap());
        for kernel in kernels {
            let lowered = tessera_codegen::lower(&kernel, &target).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
            jobs.push((format!("{}-bf16-{block}", kernel.name), target.name.to_string(), lowered.stablehlo));
        }
    }
    tessera_tests::oracle::assert_all_accepted(&jobs);
}

/// A NaN or inf in v reaches exactly the (row, column) entries whose query sees that key, as
/// math attention over the visible keys gives it (`p * inf`, NaN with `inf - inf`), never a
/// query the mask hides it from, including queries in the same partial block. Keys in
/// partial, full and ragged blocks, a causal and a window mask, on every CPU backend.
#[test]
fn nonfinite_v_reaches_only_the_queries_that_see_it() {
    use tessera_tests::nonfinite::compare;
    let shape: Shape = (1, 2, 1, 130, 300, 32);
    let (sq, skv, d) = (shape.3, shape.4, shape.5);
    let kv_at = |key: usize, e: usize| key * d + e;
    // key 20: in a partial block of the causal diagonal; key 5: in a full block for the later
    // query blocks; key 290: in the ragged last kv block (seen by no query when causal).
    let injections = [(kv_at(20, 5), f32::NAN), (kv_at(20, 5), f32::INFINITY), (kv_at(5, 3), f32::NEG_INFINITY), (kv_at(290, 8), f32::NAN)];
    let window = mask("local 40", 1, |_, r, c| c <= r && r - c <= 40);
    for m in [mask("causal", 1, |_, r, c| c <= r), window] {
        for dtype in [DType::F32, DType::BF16] {
            let p = problem(shape, dtype, &m, false, None, (BQ, BK), 91);
            for &(at, val) in &injections {
                let mut v = p.v.to_f32_vec();
                v[at] = val;
                let v = Array::from_f32_in(dtype, &p.v.shape, v);
                let (o_ref, _) = reference::forward(&p.cfg, &p.q.to_f64_vec(), &p.k.to_f64_vec(), &v.to_f64_vec());
                let seen = (0..sq).any(|r| (m.visible)(0, r, at / d));
                assert_eq!(o_ref.iter().any(|x| !x.is_finite()), seen, "{val} at v[{at}]: the reference");
                for be in tessera_tests::backends::all() {
                    let (o, _) = splash::splash_attention(be.executor(), &p.q, &p.k, &v, &p.info, None, &params(d, None), &Target::V5E).unwrap();
                    if let Err(why) = compare(&o, &o_ref, tol(dtype, false)) {
                        panic!("{val} at v[{at}], {} {dtype} {sq}x{skv} on {be:?}: {why}", m.name);
                    }
                }
            }
        }
    }
}

/// `splash_attention` (o alone) plans the forward kernel without its lse output; its o is
/// `splash_attention_fwd`'s bit for bit on the interpreter and the JIT, over each mask family, with and
/// without segment ids and a soft cap.
#[test]
fn o_only_forward_drops_lse_and_keeps_o() {
    let (fwd, o_only) = (tessera_kernels::find("splash_attention_fwd").unwrap(), tessera_kernels::find("splash_attention").unwrap());
    let shape: Shape = (2, 4, 2, 100, 260, 64);
    for (n, m) in masks(shape.1, 9).iter().enumerate() {
        let (segmented, cap) = (n % 2 == 1, if n % 3 == 0 { "soft_cap=4.0" } else { "" });
        let p = problem(shape, DType::BF16, m, segmented, None, (BQ, BK), 70 + n as u64);
        let inputs = [Some(&p.q), Some(&p.k), Some(&p.v), Some(&p.info.mask_blocks), Some(&p.info.fwd_info), Some(&p.info.bwd_info), p.seg.as_ref().map(|s| &s.q), p.seg.as_ref().map(|s| &s.kv)];
        let types: Vec<Option<Type>> = inputs.iter().map(|a| a.map(|a| Type::vector(a.dtype, &a.shape))).collect();
        let statics = o_only.statics(cap).unwrap();
        let plan = o_only.plan_for(&types, &statics, &Target::V6E).unwrap();
        let outputs: Vec<&str> = plan.launches[0].kernel.refs_of(tessera_dsl::ir::RefKind::Output).map(|(_, r)| r.name.as_str()).collect();
        assert_eq!((plan.results.len(), outputs), (1, vec!["o"]), "{}", m.name);
        // The interpreter and the JIT (the test command's budget; the kernel is the forward's
        // less one store, which every backend runs in the tests above).
        for be in [tessera_codegen::cpu::Backend::Interp, tessera_codegen::cpu::Backend::Jit] {
            let want = &fwd.run(be.executor(), &inputs, &statics, &Target::V6E).unwrap()[0];
            let got = o_only.run(be.executor(), &inputs, &statics, &Target::V6E).unwrap();
            assert_eq!(tessera_tests::backends::bits(&got[0]), tessera_tests::backends::bits(want), "{be:?} {}: o differs from splash_attention_fwd's", m.name);
        }
    }
}
