//! Flash attention forward and backward on the interpreter against the independent f64
//! reference (f32 and bf16; GQA ratios 1, 4, 8; causal on and off; soft cap; segment ids;
//! Sq != Skv; lengths that are not multiples of the blocks), the reference backward
//! against central finite differences of the reference forward, causal block skipping
//! (no DMA for skipped blocks), block-size rules and overrides, and libtpu on large blocks.
//! (libtpu compiles every registered attention op at default and alt shapes in
//! tpu_compiler.rs.)

use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{DType, Executor, Target, Type};
use tessera_kernels::attention::{self, reference, AttentionBlocks, AttentionParams, SegmentIds};
use tessera_kernels::harness::{check_output, random_array, run_case};
use tessera_kernels::find;
use tessera_tests::oracle;

/// One problem: `(B, H, Hkv, Sq, Skv, D)`.
type Shape = (usize, usize, usize, usize, usize, usize);

/// GQA 1, 4, 8; aligned and ragged lengths; Sq < Skv and Sq > Skv; D 32 / 64 / 128.
const SHAPES: [Shape; 5] = [(1, 2, 2, 256, 256, 128), (2, 4, 1, 200, 333, 64), (1, 8, 1, 130, 130, 32), (1, 4, 1, 384, 200, 128), (2, 2, 2, 77, 300, 64)];

/// Small blocks so that every shape has several q and kv blocks (the defaults would take
/// one whole-length block): online softmax across kv blocks, causal skips, edge blocks.
const SMALL: AttentionBlocks = AttentionBlocks { block_q: 32, block_kv: 128 };

struct Case {
    q: Array,
    k: Array,
    v: Array,
    seg: Option<SegmentIds>,
    cfg: reference::Attention,
}

fn case(shape: Shape, dtype: DType, params: &AttentionParams, segmented: bool, seed: u64) -> Case {
    let (b, h, hkv, sq, skv, d) = shape;
    let mut rng = StdRng::seed_from_u64(seed);
    let scaled = |a: Array, s: f32| {
        let v: Vec<f32> = a.to_f32_vec().iter().map(|x| x * s).collect();
        Array::from_f32_in(dtype, &a.shape, v)
    };
    let q = scaled(random_array(dtype, &[b, h, sq, d], &mut rng), 2.0);
    let k = scaled(random_array(dtype, &[b, hkv, skv, d], &mut rng), 2.0);
    let v = random_array(dtype, &[b, hkv, skv, d], &mut rng);
    let seg = segmented.then(|| attention::random_segment_ids(b, sq, skv, &mut rng));
    let cfg = reference::Attention {
        b,
        h,
        hkv,
        sq,
        skv,
        d,
        causal: params.causal,
        sm_scale: params.sm_scale as f64,
        soft_cap: params.soft_cap.map(f64::from),
        q_segments: seg.as_ref().map(|s| s.q.as_i32().unwrap().to_vec()),
        kv_segments: seg.as_ref().map(|s| s.kv.as_i32().unwrap().to_vec()),
        window_left: params.window_left,
        window_right: params.window_right,
        mask: None,
    };
    Case { q, k, v, seg, cfg }
}

fn assert_close(what: &str, got: &Array, want: &[f64], tol: f64) {
    let c = check_output(got, want);
    assert!(c.nan_count == 0 && c.scaled_err <= tol, "{what}: scaled error {:.3e} (tolerance {tol:.1e}), {} NaN", c.scaled_err, c.nan_count);
}

/// bf16 rounds q, k, v, the probabilities fed to `p @ v` and `ds` fed to the gradient dots.
fn tol(dtype: DType, backward: bool) -> f64 {
    match (dtype, backward) {
        (DType::BF16, false) => 1.6e-2,
        (DType::BF16, true) => 3e-2,
        (_, false) => 1e-5,
        _ => 2e-5,
    }
}

fn forward_case(shape: Shape, dtype: DType, params: &AttentionParams, segmented: bool, blocks: AttentionBlocks, target: &Target, seed: u64) {
    forward_case_on(&Interpreter, shape, dtype, params, segmented, blocks, target, seed)
}

#[allow(clippy::too_many_arguments)]
fn forward_case_on(exec: &dyn Executor, shape: Shape, dtype: DType, params: &AttentionParams, segmented: bool, blocks: AttentionBlocks, target: &Target, seed: u64) {
    let c = case(shape, dtype, params, segmented, seed);
    let (o, lse) = attention::flash_attention_with_blocks(exec, &c.q, &c.k, &c.v, c.seg.as_ref(), params, blocks, target).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    let (o_ref, lse_ref) = reference::forward(&c.cfg, &c.q.to_f64_vec(), &c.k.to_f64_vec(), &c.v.to_f64_vec());
    let what = format!("{shape:?} {dtype} {params:?} seg={segmented} {blocks:?} on {target}");
    assert_eq!(o.dtype, dtype);
    assert_eq!(lse.shape, vec![shape.0, shape.1, shape.3]);
    assert_close(&format!("o of {what}"), &o, &o_ref, tol(dtype, false));
    assert_close(&format!("lse of {what}"), &lse, &lse_ref, tol(DType::F32, false));
    // Rows that see no key (a window past the keys): o = 0 and lse = -inf, as the reference.
    for (name, got, want) in [("o", &o, &o_ref), ("lse", &lse, &lse_ref)] {
        let nonfinite = check_output(got, want).nonfinite;
        assert_eq!(nonfinite, 0, "{name} of {what}: {nonfinite} infinities where the reference differs");
    }
}

fn backward_case(shape: Shape, dtype: DType, params: &AttentionParams, segmented: bool, blocks: AttentionBlocks, target: &Target, seed: u64) {
    backward_case_on(&Interpreter, shape, dtype, params, segmented, blocks, target, seed)
}

#[allow(clippy::too_many_arguments)]
fn backward_case_on(exec: &dyn Executor, shape: Shape, dtype: DType, params: &AttentionParams, segmented: bool, blocks: AttentionBlocks, target: &Target, seed: u64) {
    let c = case(shape, dtype, params, segmented, seed);
    let (q, k, v) = (c.q.to_f64_vec(), c.k.to_f64_vec(), c.v.to_f64_vec());
    let (o_ref, lse_ref) = reference::forward(&c.cfg, &q, &k, &v);
    let round = |x: &[f64], shape: &[usize]| {
        let f: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        Array::from_f32_in(dtype, shape, f)
    };
    let o = round(&o_ref, &c.q.shape);
    let lse = Array::from_f32(&c.q.shape[..3], lse_ref.iter().map(|&x| x as f32).collect());
    let mut rng = StdRng::seed_from_u64(seed + 1000);
    let dout = random_array(dtype, &c.q.shape, &mut rng);
    let (dq, dk, dv) = attention::flash_attention_bwd_with_blocks(exec, &c.q, &c.k, &c.v, &o, &lse, &dout, c.seg.as_ref(), params, blocks, target).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    let (dq_ref, dk_ref, dv_ref) = reference::backward(&c.cfg, &q, &k, &v, &dout.to_f64_vec());
    let what = format!("{shape:?} {dtype} {params:?} seg={segmented} {blocks:?} on {target}");
    assert_close(&format!("dq of {what}"), &dq, &dq_ref, tol(dtype, true));
    assert_close(&format!("dk of {what}"), &dk, &dk_ref, tol(dtype, true));
    assert_close(&format!("dv of {what}"), &dv, &dv_ref, tol(dtype, true));
}

/// The option combinations each shape runs with.
fn option_sets(d: usize) -> Vec<(AttentionParams, bool)> {
    vec![
        (AttentionParams::new(d, true), false),
        (AttentionParams::new(d, false), false),
        (AttentionParams::new(d, true).with_soft_cap(2.0), false),
        (AttentionParams::new(d, true), true),
        (AttentionParams::new(d, false).with_soft_cap(5.0), true),
    ]
}

#[test]
fn forward_matches_reference() {
    for dtype in [DType::F32, DType::BF16] {
        for (n, &shape) in SHAPES.iter().enumerate() {
            for (m, (params, seg)) in option_sets(shape.5).into_iter().enumerate() {
                let target = if (n + m) % 2 == 0 { Target::V5E } else { Target::TPU7X };
                forward_case(shape, dtype, &params, seg, SMALL, &target, (10 * n + m) as u64);
            }
        }
    }
}

#[test]
fn backward_matches_reference() {
    for dtype in [DType::F32, DType::BF16] {
        for (n, &shape) in SHAPES.iter().enumerate() {
            for (m, (params, seg)) in option_sets(shape.5).into_iter().enumerate() {
                let target = if (n + m) % 2 == 0 { Target::V6E } else { Target::TPU7X };
                backward_case(shape, dtype, &params, seg, SMALL, &target, (10 * n + m) as u64);
            }
        }
    }
}

/// Blocks that are not powers of two or that leave one partial block per axis.
#[test]
fn odd_blocks() {
    let shape = (1, 4, 2, 200, 300, 64);
    for blocks in [AttentionBlocks { block_q: 48, block_kv: 256 }, AttentionBlocks { block_q: 200, block_kv: 300 }, AttentionBlocks { block_q: 8, block_kv: 8 }] {
        for causal in [true, false] {
            let params = AttentionParams::new(64, causal);
            forward_case(shape, DType::F32, &params, false, blocks, &Target::V5E, 7);
            backward_case(shape, DType::F32, &params, false, blocks, &Target::V5E, 7);
        }
    }
    // One-row sequences in 1 x 1 blocks: the causal diagonal block is not cut there, so the
    // forward must not finish rows in a masked diagonal step (the op battery found o unwritten).
    let one = AttentionBlocks { block_q: 1, block_kv: 1 };
    for params in [AttentionParams::new(64, true), AttentionParams::new(64, true).with_window(Some(3), None), AttentionParams::new(64, false)] {
        forward_case((2, 2, 1, 1, 1, 64), DType::F32, &params, false, one, &Target::V5E, 8);
        backward_case((2, 2, 1, 1, 1, 64), DType::F32, &params, false, one, &Target::V5E, 8);
    }
}

/// The library entries at their default blocks (one whole-length block at these sizes on
/// v6e, two on v5e) through the shared harness.
#[test]
fn library_entries_match_reference() {
    let fwd = |q: [usize; 4], kv: [usize; 4]| vec![q.to_vec(), kv.to_vec(), kv.to_vec()];
    let bwd = |q: [usize; 4], kv: [usize; 4]| vec![q.to_vec(), kv.to_vec(), kv.to_vec(), q.to_vec(), q[..3].to_vec(), q.to_vec()];
    let seg = |mut s: Vec<Vec<usize>>, q: [usize; 4], kv: [usize; 4]| {
        s.extend([vec![q[0], q[2]], vec![kv[0], kv[2]]]);
        s
    };
    let (q, kv) = ([1, 4, 300, 64], [1, 1, 420, 64]);
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::V6E] {
            for (name, case, shapes) in [
                ("flash_attention_fwd", "causal", fwd(q, kv)),
                ("flash_attention_fwd", "noncausal", fwd(q, kv)),
                ("flash_attention_fwd", "segmented", seg(fwd(q, kv), q, kv)),
                ("flash_attention_fwd", "window", fwd(q, kv)),
                ("flash_attention_bwd", "causal", bwd(q, kv)),
                ("flash_attention_bwd", "noncausal", bwd(q, kv)),
                ("flash_attention_bwd", "segmented", seg(bwd(q, kv), q, kv)),
                ("flash_attention_bwd", "window", bwd(q, kv)),
            ] {
                let op = find(name).unwrap();
                let statics = op.case_statics(op.case(case).unwrap()).unwrap();
                let r = run_case(op, &statics, &shapes, dtype, &target, 3, &Interpreter).unwrap_or_else(|e| panic!("{name}: {e}"));
                let bwd_bf16 = dtype == DType::BF16 && name.ends_with("bwd");
                let ok = r.outputs.iter().all(|o| o.nan_count == 0 && o.scaled_err <= if bwd_bf16 { tol(dtype, true) } else { o.tolerance });
                assert!(ok, "{name} {dtype} on {target} (grid {:?}): {:?}", r.grid, r.outputs);
            }
        }
    }
}

/// Causal: skipped blocks are neither computed nor fetched. The forward at 4 x 4 blocks
/// fetches k and v only for blocks on or below the diagonal, and gives the same output as
/// with blocks that skip nothing (one kv block).
#[test]
fn causal_skips_blocks_and_their_dma() {
    let (b, h, s, d) = (1, 1, 512, 128);
    let params = AttentionParams::new(d, true);
    let c = case((b, h, h, s, s, d), DType::F32, &params, false, 1);
    let blocks = AttentionBlocks { block_q: 128, block_kv: 128 };
    let kernel = attention::build_flash_attention(&Type::vector(DType::F32, &c.q.shape), &Type::vector(DType::F32, &c.k.shape), &Type::vector(DType::F32, &c.v.shape), false, &params, blocks, true, &Target::V5E).unwrap();
    let dummy = Array::from_i32(&[1, 1, 1], vec![0]);
    let (out, stats) = interp::run_with_stats(&kernel, &[&c.q, &c.k, &c.v, &dummy, &dummy]).unwrap();
    // q: 4 blocks. k, v: q block i maps kv steps 0..4 to blocks min(j, i); a window is
    // fetched only when its block changes: 1 + 1 + 3 + 4 fetches each (the 10 visible
    // blocks, less two that are still resident). The two dummies: once each.
    assert_eq!(stats.block_loads, 4 + 2 * 9 + 2, "{stats:?}");
    let full = attention::flash_attention_with_blocks(&Interpreter, &c.q, &c.k, &c.v, None, &params, AttentionBlocks { block_q: 128, block_kv: 512 }, &Target::V5E).unwrap().0;
    let (o_ref, _) = reference::forward(&c.cfg, &c.q.to_f64_vec(), &c.k.to_f64_vec(), &c.v.to_f64_vec());
    assert_close("o (skipping)", &out[0], &o_ref, 1e-5);
    assert_close("o (one kv block)", &full, &o_ref, 1e-5);

    // The dkv kernel clamps the q block up to the first one that sees its keys.
    let bwd = attention::build_flash_attention_bwd(&Type::vector(DType::F32, &c.q.shape), &Type::vector(DType::F32, &c.k.shape), &Type::vector(DType::F32, &c.v.shape), false, &params, blocks, &Target::V5E).unwrap();
    let col = Array::from_f32(&[b, h, s, 1], vec![0.0; s]);
    let (_, stats) = interp::run_with_stats(&bwd[1], &[&c.q, &c.k, &c.v, &dummy, &dummy, &c.q, &col, &col]).unwrap();
    // k, v: 4 blocks each. q, do, lse, di: kv block j maps q steps 0..4 to blocks
    // max(i, j): 4 + 3 + 2 + 0 fetches each (the 10 visible blocks, less the resident
    // ones). The dummies: once each.
    assert_eq!(stats.block_loads, 2 * 4 + 4 * 9 + 2, "{stats:?}");
}

#[test]
fn reference_backward_matches_finite_differences() {
    // Tiny: B 1, H 2 over 1 kv head, Sq 3, Skv 4, D 2, causal with a soft cap and segments.
    let cfg = reference::Attention {
        b: 1,
        h: 2,
        hkv: 1,
        sq: 3,
        skv: 4,
        d: 2,
        causal: true,
        sm_scale: 0.7,
        soft_cap: Some(1.5),
        q_segments: Some(vec![0, 0, 1]),
        kv_segments: Some(vec![0, 0, 1, 1]),
        window_left: Some(1),
        window_right: None,
        mask: None,
    };
    let mut rng = StdRng::seed_from_u64(5);
    let mut draw = |n: usize| (0..n).map(|_| rng.gen_range(-1.5..1.5)).collect::<Vec<f64>>();
    let (q, k, v, dout) = (draw(12), draw(8), draw(8), draw(12));
    let loss = |q: &[f64], k: &[f64], v: &[f64]| reference::forward(&cfg, q, k, v).0.iter().zip(&dout).map(|(o, g)| o * g).sum::<f64>();
    let (dq, dk, dv) = reference::backward(&cfg, &q, &k, &v, &dout);
    let eps = 1e-6;
    for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
        for i in 0..grad.len() {
            let mut args = [q.clone(), k.clone(), v.clone()];
            args[which][i] += eps;
            let up = loss(&args[0], &args[1], &args[2]);
            args[which][i] -= 2.0 * eps;
            let down = loss(&args[0], &args[1], &args[2]);
            let fd = (up - down) / (2.0 * eps);
            assert!((fd - grad[i]).abs() < 1e-7, "operand {which} element {i}: finite difference {fd}, formula {}", grad[i]);
        }
    }
}

#[test]
fn default_blocks_follow_the_generation() {
    let b = |sq, skv, t: &Target| attention::default_blocks(sq, skv, 128, DType::BF16, false, false, t);
    assert_eq!(b(4096, 4096, &Target::V5E), AttentionBlocks { block_q: 256, block_kv: 256 });
    assert_eq!(b(4096, 4096, &Target::V5P), AttentionBlocks { block_q: 256, block_kv: 256 });
    assert_eq!(b(4096, 4096, &Target::V6E), AttentionBlocks { block_q: 512, block_kv: 512 });
    assert_eq!(b(4096, 4096, &Target::TPU7X), AttentionBlocks { block_q: 512, block_kv: 512 });
    // A short sequence is one block; a long one need not be a multiple.
    assert_eq!(b(100, 1000, &Target::V6E), AttentionBlocks { block_q: 100, block_kv: 512 });
    // Every default kernel fits the default scoped VMEM (no raised limit).
    for t in [Target::V5E, Target::V6E, Target::TPU7X] {
        let q = Type::vector(DType::F32, &[1, 8, 8192, 256]);
        for (name, causal) in [("flash_attention_fwd", "causal=True"), ("flash_attention_fwd", ""), ("flash_attention_bwd", "causal=True"), ("flash_attention_bwd", "")] {
            let op = find(name).unwrap();
            let mut types = vec![Some(q.clone()), Some(q.clone()), Some(q.clone())];
            if name.ends_with("bwd") {
                types.extend([Some(q.clone()), Some(Type::vector(DType::F32, &[1, 8, 8192])), Some(q.clone())]);
            }
            types.resize(op.inputs.len(), None);
            for launch in op.plan_for(&types, &op.statics(causal).unwrap(), &t).unwrap().launches {
                let kernel = launch.kernel;
                assert_eq!(kernel.vmem_limit_bytes, None, "{name} {} on {t}", kernel.name);
                tessera_dsl::verify::verify(&kernel, &t).unwrap();
            }
        }
    }
}

#[test]
fn rejected_override_names_the_operand() {
    let c = case((1, 2, 2, 256, 256, 128), DType::F32, &AttentionParams::new(128, true), false, 0);
    let bad = AttentionBlocks { block_q: 100, block_kv: 128 };
    let e = attention::flash_attention_with_blocks(&Interpreter, &c.q, &c.k, &c.v, None, &AttentionParams::new(128, true), bad, &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "block-tiling", "{e}");
    assert!(e.subject.contains("`q`"), "{e}");
    assert!(e.to_string().contains("100"), "{e}");
    // Segment ids put bk in the lane dim of the kv segment block: 64 is not a multiple of 128.
    let c = case((1, 2, 2, 256, 256, 128), DType::F32, &AttentionParams::new(128, true), true, 0);
    let e = attention::flash_attention_with_blocks(&Interpreter, &c.q, &c.k, &c.v, c.seg.as_ref(), &AttentionParams::new(128, true), AttentionBlocks { block_q: 64, block_kv: 64 }, &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "block-tiling", "{e}");
    assert!(e.subject.contains("kv_seg"), "{e}");
    // Shapes: H not a multiple of Hkv.
    let q = random_array(DType::F32, &[1, 3, 16, 8], &mut StdRng::seed_from_u64(0));
    let k = random_array(DType::F32, &[1, 2, 16, 8], &mut StdRng::seed_from_u64(0));
    let e = attention::flash_attention(&Interpreter, &q, &k, &k, None, &AttentionParams::new(8, true), &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "operand-shape", "{e}");
}

/// Large blocks (1024 x 1024, vmem_limit raised by the builder where the default scoped
/// VMEM is too small) build for all three targets, forward and backward, f32 and bf16, and
/// the bf16 kernels (the tuned defaults' dtype) compile with libtpu on each. (These are
/// libtpu's slowest compiles, ~8 s each on this machine: f32 on every target too doubled
/// the test's time for no new edge. `TESSERA_LIBTPU_SAMPLE=1` compiles the f32 ones as well.)
#[test]
fn libtpu_compiles_large_blocks() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let blocks = AttentionBlocks { block_q: 1024, block_kv: 1024 };
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for dtype in [DType::F32, DType::BF16] {
            let q = Type::vector(dtype, &[1, 8, 4096, 128]);
            let kv = Type::vector(dtype, &[1, 2, 4096, 128]);
            let params = AttentionParams::new(128, true);
            let mut kernels = vec![attention::build_flash_attention(&q, &kv, &kv, false, &params, blocks, true, &target).unwrap()];
            kernels.extend(attention::build_flash_attention_bwd(&q, &kv, &kv, false, &params, blocks, &target).unwrap());
            for kernel in kernels {
                // v5e's 16 MiB default scoped VMEM is too small for these tiles.
                if target == Target::V5E && !kernel.name.contains("di") {
                    assert!(kernel.vmem_limit_bytes.is_some(), "{} needs a raised limit on v5e", kernel.name);
                }
                if dtype == DType::BF16 || oracle::sample_every(2) == 1 {
                    let lowered = tessera_codegen::lower(&kernel, &target).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
                    jobs.push((format!("{}-{dtype}-1024", kernel.name), target.name.to_string(), lowered.stablehlo));
                }
            }
        }
    }
    oracle::assert_all_accepted(&jobs);
}

/// NaN and inf as torch's math attention over the *visible* keys (masking selects): a NaN
/// in q makes its row NaN; a NaN or inf in a visible k makes the rows that see it NaN (or,
/// for -inf logits, weight 0); a nonfinite v value reaches exactly the (row, column)
/// entries that see it (`p * inf` = inf, NaN where `p = 0` or with `inf - inf`), never a
/// row that may not see it; `sm_scale` NaN / ±inf gives NaN rows (lse NaN / ±inf, torch's
/// logsumexp); a row whose visible logits are all -inf is NaN with lse -inf, a row with no
/// visible key (segment ids) o = 0, lse = -inf. Several q and kv blocks, ragged edges,
/// GQA 2, causal and not, with and without segment ids, f32 and bf16.
#[test]
fn nonfinite_inputs_propagate_like_math_attention() {
    use tessera_tests::nonfinite::assert_matches;
    let (b, h, hkv, sq, skv, d) = (1, 2, 1, 40, 300, 16);
    let mut rng = StdRng::seed_from_u64(21);
    let base = |n: usize, rng: &mut StdRng| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (q0, k0, v0) = (base(b * h * sq * d, &mut rng), base(b * hkv * skv * d, &mut rng), base(b * hkv * skv * d, &mut rng));
    // Segments: query rows 30..35 are in segment 9, which no key has (they see nothing).
    let q_seg: Vec<i32> = (0..sq).map(|r| if (30..35).contains(&r) { 9 } else { (r / 20) as i32 }).collect();
    let kv_seg: Vec<i32> = (0..skv).map(|c| (c / 20).min(1) as i32).collect();
    let (qs, ks) = (Array::from_i32(&[b, sq], q_seg), Array::from_i32(&[b, skv], kv_seg));
    // (tensor, element, value): q row 5; key 20 (seen by rows >= 20 when causal); key 3; key
    // 50 (seen by no row when causal); key 290 (in the ragged last kv block).
    let q_at = |head: usize, row: usize, e: usize| (head * sq + row) * d + e;
    let kv_at = |key: usize, e: usize| key * d + e;
    let injections: Vec<(&str, usize, f32)> = vec![
        ("q", q_at(0, 5, 2), f32::NAN),
        ("q", q_at(1, 22, 0), f32::NEG_INFINITY),
        ("q", q_at(1, 7, 3), f32::INFINITY),
        ("k", kv_at(20, 1), f32::NAN),
        ("k", kv_at(20, 1), f32::INFINITY),
        ("k", kv_at(3, 4), f32::NEG_INFINITY),
        ("v", kv_at(20, 5), f32::NAN),
        ("v", kv_at(20, 5), f32::INFINITY),
        ("v", kv_at(3, 6), f32::NEG_INFINITY),
        ("v", kv_at(50, 7), f32::INFINITY),
        ("v", kv_at(290, 8), f32::NAN),
        ("k", kv_at(290, 9), f32::INFINITY),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let tol = if dtype == DType::BF16 { 3e-2 } else { 2e-5 };
        for causal in [false, true] {
            for segmented in [false, true] {
                // Blocks 16 x 128, and without segments (their kv blocks tile by 128) square
                // 32 x 32 blocks, ragged at both ends, where a causal kernel finishes each row
                // inside its diagonal step, fix-up included.
                let run = |what: String, q: &[f32], k: &[f32], v: &[f32], extra: &str| {
                    let (q, k, v) = (Array::from_f32_in(dtype, &[b, h, sq, d], q.to_vec()), Array::from_f32_in(dtype, &[b, hkv, skv, d], k.to_vec()), Array::from_f32_in(dtype, &[b, hkv, skv, d], v.to_vec()));
                    let seg = if segmented { [Some(&qs), Some(&ks)] } else { [None, None] };
                    for (bq, bk) in [(16, 128), (32, 32)].into_iter().take(if segmented { 1 } else { 2 }) {
                        let statics = format!("causal={}, block_q={bq}, block_kv={bk}{extra}", if causal { "True" } else { "False" });
                        assert_matches(&format!("{what} {dtype} causal={causal} segmented={segmented} blocks {bq}x{bk}"), "flash_attention_fwd", &[Some(&q), Some(&k), Some(&v), seg[0], seg[1]], &statics, &Target::V5E, tol);
                    }
                };
                for &(name, at, val) in &injections {
                    let (mut q, mut k, mut v) = (q0.clone(), k0.clone(), v0.clone());
                    match name {
                        "q" => q[at] = val,
                        "k" => k[at] = val,
                        _ => v[at] = val,
                    }
                    run(format!("{val} in {name}[{at}]"), &q, &k, &v, "");
                    if name == "v" {
                        // A window cuts more blocks: the fix-up's mask is recomputed there
                        // (`visible_again`), and must admit the same pairs as the step's.
                        run(format!("{val} in {name}[{at}], window_left=25"), &q, &k, &v, ", window_left=25");
                        run(format!("{val} in {name}[{at}], window 25/40"), &q, &k, &v, ", window_left=25, window_right=40");
                    }
                }
                // A nonfinite sm_scale is an option error (it would turn every row NaN).
                let entry = tessera_kernels::find("flash_attention_fwd").unwrap();
                let (q, k, v) = (Array::from_f32_in(dtype, &[b, h, sq, d], q0.clone()), Array::from_f32_in(dtype, &[b, hkv, skv, d], k0.clone()), Array::from_f32_in(dtype, &[b, hkv, skv, d], v0.clone()));
                for scale in ["nan", "inf", "-inf"] {
                    let statics = entry.statics(&format!("causal=true, sm_scale={scale}")).unwrap();
                    let e = entry.run(&tessera_dsl::Interpreter, &[Some(&q), Some(&k), Some(&v), None, None], &statics, &Target::V5E).err().map(|e| e.to_string()).unwrap_or_default();
                    assert!(e.contains("sm_scale") && e.contains("option-value"), "sm_scale={scale}: {e}");
                }
                // Every visible logit of query row 12 is -inf: q row 12 = -inf * (k > 0 in lane 0).
                let (mut q, mut k) = (q0.clone(), k0.clone());
                for c in 0..skv {
                    k[kv_at(c, 0)] = 1.0;
                }
                q[q_at(0, 12, 0)] = f32::NEG_INFINITY;
                run("all -inf logits in row 12".into(), &q, &k, &v0, "");
            }
        }
    }
}

/// The backward with a NaN / inf in q, k, v or do (o and lse from the forward on the same
/// inputs, as autograd passes them), against the select-semantics reference (only visible
/// (query, key) pairs contribute): exact for v everywhere and for every input when no block
/// needs a mask; in masked blocks (the causal diagonal) a nonfinite q row, k row or do row
/// may also reach dk, dq or dv of that block's positions that do not see it (the raw
/// operand meets a zero weight in the block's product, as in torch's math-SDPA autograd,
/// which does so for every pair), never anything outside those blocks, and is NaN wherever
/// the reference is.
#[test]
fn backward_nonfinite_inputs() {
    use tessera_tests::nonfinite::{compare, run_and_reference};
    let (b, h, hkv, sq, skv, d) = (1, 2, 1, 64, 256, 16);
    let (bq, bk) = (16, 128);
    let mut rng = StdRng::seed_from_u64(22);
    let base = |n: usize, rng: &mut StdRng| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (q0, k0, v0, do0) = (base(b * h * sq * d, &mut rng), base(b * hkv * skv * d, &mut rng), base(b * hkv * skv * d, &mut rng), base(b * h * sq * d, &mut rng));
    let q_at = |head: usize, row: usize, e: usize| (head * sq + row) * d + e;
    let kv_at = |key: usize, e: usize| key * d + e;
    let cases = [("q", q_at(0, 5, 2), f32::NAN), ("k", kv_at(20, 1), f32::NAN), ("v", kv_at(20, 5), f32::NAN), ("v", kv_at(20, 5), f32::INFINITY), ("v", kv_at(40, 2), f32::NEG_INFINITY), ("do", q_at(1, 25, 3), f32::NAN)];
    for causal in [false, true] {
        for &(name, at, val) in &cases {
            let (mut q, mut k, mut v, mut dout) = (q0.clone(), k0.clone(), v0.clone(), do0.clone());
            match name {
                "q" => q[at] = val,
                "k" => k[at] = val,
                "v" => v[at] = val,
                _ => dout[at] = val,
            }
            let (qa, ka, va, da) = (Array::from_f32(&[b, h, sq, d], q), Array::from_f32(&[b, hkv, skv, d], k), Array::from_f32(&[b, hkv, skv, d], v), Array::from_f32(&[b, h, sq, d], dout));
            let statics = format!("causal={}, block_q={bq}, block_kv={bk}", if causal { "True" } else { "False" });
            let fwd = find("flash_attention_fwd").unwrap();
            let out = fwd.run(&Interpreter, &[Some(&qa), Some(&ka), Some(&va), None, None], &fwd.statics(&statics).unwrap(), &Target::V5E).unwrap();
            let (got, want) = run_and_reference("flash_attention_bwd", &[Some(&qa), Some(&ka), Some(&va), Some(&out[0]), Some(&out[1]), Some(&da), None, None], &statics, &Target::V5E);
            for (j, grad) in ["dq", "dk", "dv"].iter().enumerate() {
                let what = format!("{val} in {name}[{at}], causal={causal}: {grad}");
                // Which operand may leak into this gradient inside masked blocks.
                let leaky = causal && matches!((name, *grad), ("q", "dk") | ("k", "dq") | ("do", "dv"));
                if !leaky {
                    compare(&got[j], &want[j], 1e-4).unwrap_or_else(|e| panic!("{what}: {e}"));
                    continue;
                }
                let g = got[j].to_f64_vec();
                // The kv blocks that q block `qb` meets on the causal diagonal (masked).
                let diagonal = |qb: usize| (qb * bq) / bk..=(qb * bq + bq - 1) / bk;
                let pos = |i: usize| if *grad == "dq" { (i / d) % sq } else { (i / d) % skv };
                let src = (at / d) % if name == "k" { skv } else { sq };
                let in_source_blocks = |p: usize| if *grad == "dq" { diagonal(p / bq).contains(&(src / bk)) } else { diagonal(src / bq).contains(&(p / bk)) };
                for (i, (&a, &w)) in g.iter().zip(&want[j]).enumerate() {
                    if w.is_nan() {
                        assert!(a.is_nan(), "{what}: element {i} is {a}, the reference is NaN");
                    } else if !a.is_nan() {
                        assert!((a - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: element {i} is {a}, the reference {w}");
                    } else {
                        // A leak: only inside a masked (diagonal) block pair of the source.
                        assert!(in_source_blocks(pos(i)), "{what}: element {i} (position {}) is NaN outside the source's masked blocks", pos(i));
                    }
                }
            }
        }
    }
}

/// Sliding windows `(window_left, window_right)`, each with its causal flag and segment ids,
/// on a shape set: smaller than a block (blocks are 32 x 128 here), larger than one, larger
/// than the sequence (the unwindowed kernel), left + right without causal, left 0 (the
/// diagonal only), and rows that see no key (Sq > Skv + left: o = 0, lse = -inf).
fn window_sets() -> Vec<(Shape, AttentionParams, bool)> {
    let p = |d: usize, causal: bool, l: Option<usize>, r: Option<usize>| AttentionParams::new(d, causal).with_window(l, r);
    vec![
        // GQA 1, aligned; causal, a window smaller than a block (HF sliding_window 41).
        ((1, 2, 2, 256, 256, 32), p(32, true, Some(40), None), false),
        // GQA 4, ragged Sq < Skv, non-causal left + right, both larger than bq; soft cap.
        ((2, 4, 1, 200, 333, 64), p(64, false, Some(150), Some(60)).with_soft_cap(5.0), false),
        // GQA 8, ragged; a window longer than the sequence: the unwindowed kernel.
        ((1, 8, 1, 130, 130, 32), p(32, true, Some(300), None), false),
        // GQA 4, Sq > Skv: rows 300.. see no key; causal, a window of a block and a bit.
        ((1, 4, 1, 384, 200, 32), p(32, true, Some(100), None), false),
        // GQA 1 over 2 kv heads, segment ids with a right-only window, non-causal.
        ((2, 2, 2, 77, 300, 64), p(64, false, None, Some(5)), true),
        // The diagonal alone (left 0, causal) with segment ids.
        ((1, 4, 1, 96, 160, 32), p(32, true, Some(0), None), true),
    ]
}

/// The window against the f64 reference with its explicit mask, forward and backward, f32
/// and bf16, on every CPU backend of the build (the interpreter and the compiled ones).
#[test]
fn window_matches_reference_on_every_backend() {
    for be in tessera_tests::backends::all() {
        let before = tessera_codegen::cpu::cache_stats().fallbacks;
        for dtype in [DType::F32, DType::BF16] {
            for (n, (shape, params, seg)) in window_sets().into_iter().enumerate() {
                let target = [Target::V5E, Target::V6E, Target::TPU7X][n % 3];
                forward_case_on(be.executor(), shape, dtype, &params, seg, SMALL, &target, 100 + n as u64);
                backward_case_on(be.executor(), shape, dtype, &params, seg, SMALL, &target, 100 + n as u64);
            }
        }
        assert_eq!(tessera_codegen::cpu::cache_stats().fallbacks, before, "{be:?} fell back to the interpreter");
    }
}

/// Sliding window: blocks entirely outside the window are neither computed nor fetched.
/// S = 2048, window_left = 255 (HF's sliding_window 256), causal, blocks 128: each q block
/// meets 3 kv blocks (its own and the two before), not 16; the dkv kernel fetches, per kv
/// block, the 3 q blocks that see its keys. Counted as DMAs by the interpreter, and the
/// output is the reference's.
#[test]
fn window_skips_blocks_and_their_dma() {
    let (b, h, s, d) = (1, 1, 2048, 64);
    let params = AttentionParams::new(d, true).with_window(Some(255), None);
    let c = case((b, h, h, s, s, d), DType::F32, &params, false, 2);
    let blocks = AttentionBlocks { block_q: 128, block_kv: 128 };
    let t = Type::vector(DType::F32, &c.q.shape);
    let kernel = attention::build_flash_attention(&t, &t, &t, false, &params, blocks, true, &Target::V5E).unwrap();
    let dummy = Array::from_i32(&[1, 1, 1], vec![0]);
    let (out, stats) = interp::run_with_stats(&kernel, &[&c.q, &c.k, &c.v, &dummy, &dummy]).unwrap();
    // q: 16 blocks. k, v: q block i sees kv blocks max(i - 2, 0)..=i, fetched when the block
    // changes: 1 (i = 0) + 1 (i = 1: block 0 still resident) + 3 x 14, i.e. 44 <= 3 per q
    // block (an unwindowed causal kernel: 136; non-causal: 256). The dummies: once each.
    let kv_fetches = 1 + 1 + 3 * 14;
    assert_eq!(stats.block_loads, 16 + 2 * kv_fetches + 2, "{stats:?}");
    assert!(kv_fetches <= 3 * 16);
    let (o_ref, _) = reference::forward(&c.cfg, &c.q.to_f64_vec(), &c.k.to_f64_vec(), &c.v.to_f64_vec());
    assert_close("o (window skipping)", &out[0], &o_ref, 1e-5);

    let bwd = attention::build_flash_attention_bwd(&t, &t, &t, false, &params, blocks, &Target::V5E).unwrap();
    let col = Array::from_f32(&[b, h, s, 1], vec![0.0; s]);
    let (_, stats) = interp::run_with_stats(&bwd[1], &[&c.q, &c.k, &c.v, &dummy, &dummy, &c.q, &col, &col]).unwrap();
    // k, v: 16 blocks each. q, do, lse, di: kv block j is seen by q blocks j..=min(j + 2,
    // 15), fetched when the block changes (the previous kv block's last is j + 1, not j):
    // 3 x 14 + 2 (j = 14) + 0 (j = 15: block 15 still resident) = 44, not 16 x 16.
    assert_eq!(stats.block_loads, 2 * 16 + 4 * (3 * 14 + 2) + 2, "{stats:?}");
    let (_, stats) = interp::run_with_stats(&bwd[2], &[&c.q, &c.k, &c.v, &dummy, &dummy, &c.q, &col, &col]).unwrap();
    // The dq kernel walks kv blocks as the forward: q, do, lse, di 16 each, k, v 44 each.
    assert_eq!(stats.block_loads, 4 * 16 + 2 * kv_fetches + 2, "{stats:?}");
}

/// A negative window is an option error naming the op and the argument, never a panic.
#[test]
fn negative_window_is_an_option_error() {
    let q = random_array(DType::F32, &[1, 2, 16, 8], &mut StdRng::seed_from_u64(0));
    for (name, arg) in [("flash_attention_fwd", "window_left"), ("flash_attention_fwd", "window_right"), ("flash_attention_bwd", "window_left")] {
        let op = find(name).unwrap();
        let inputs: Vec<Option<&Array>> = if name.ends_with("bwd") {
            vec![Some(&q), Some(&q), Some(&q), Some(&q), None, Some(&q), None, None]
        } else {
            vec![Some(&q), Some(&q), Some(&q), None, None]
        };
        let lse = Array::from_f32(&[1, 2, 16], vec![0.0; 32]);
        let mut inputs = inputs;
        if name.ends_with("bwd") {
            inputs[4] = Some(&lse);
        }
        let e = op.run(&Interpreter, &inputs, &op.statics(&format!("causal=True, {arg}=-3")).unwrap(), &Target::V5E).unwrap_err();
        let text = e.to_string();
        assert!(e.rule == "option-value" && text.contains(arg) && text.contains(name), "{name} {arg}: {text}");
    }
}

/// A narrow sliding window runs splash attention's kernels over the band: the forward's grid
/// walks the band's kv blocks only (2 per q block for a 16-key causal window at 128 blocks,
/// not all 8), and the backward's too; a window as wide as the keys keeps flash's kernels.
#[test]
fn narrow_windows_walk_only_the_band() {
    let op = find("flash_attention_fwd").unwrap();
    let t = Type::vector(DType::BF16, &[1, 4, 1024, 128]);
    let types = vec![Some(t.clone()), Some(t.clone()), Some(t.clone()), None, None];
    let plan = |statics: &str| op.plan_for(&types, &op.statics(statics).unwrap(), &Target::V6E).unwrap();
    let narrow = plan("causal=True, window_left=15, block_q=128, block_kv=128");
    let k = &narrow.launches[0].kernel;
    assert_eq!(k.name, "splash_attention_fwd_kernel");
    let extents = |k: &tessera_dsl::Kernel| k.grid.iter().map(|g| g.extent).collect::<Vec<_>>();
    assert_eq!(extents(k), vec![1, 4, 8, 2], "8 q blocks x 2 kv steps");
    let wide = plan("causal=True, window_left=2000, block_q=128, block_kv=128");
    assert_eq!(wide.launches[0].kernel.name, "flash_attention_fwd_kernel");
    let bwd = find("flash_attention_bwd").unwrap();
    let col = Type::vector(DType::F32, &[1, 4, 1024]);
    let btypes = vec![Some(t.clone()), Some(t.clone()), Some(t.clone()), Some(t.clone()), Some(col), Some(t.clone()), None, None];
    let plan = bwd.plan_for(&btypes, &bwd.statics("causal=True, window_left=15, block_q=128, block_kv=128").unwrap(), &Target::V6E).unwrap();
    let names: Vec<&str> = plan.launches.iter().map(|l| l.kernel.name.as_str()).collect();
    assert_eq!(names, ["flash_attention_di_kernel", "splash_attention_dkv_kernel", "splash_attention_dq_kernel"]);
    assert_eq!(extents(&plan.launches[1].kernel), vec![1, 4, 8, 1, 2], "each kv block is seen by 2 q blocks");
}

/// `flash_attention` (o alone, what a call without gradients needs) plans a kernel without
/// the lse output: one launch, one output, no lse in the custom call's results; its o is
/// `flash_attention_fwd`'s o bit for bit on the interpreter and the JIT (causal or not, GQA, ragged
/// lengths, segment ids, soft cap, a NaN and an inf in v), and a window narrow enough for
/// splash's kernels runs splash's forward without lse too.
#[test]
fn o_only_forward_drops_lse_and_keeps_o() {
    let (fwd, o_only) = (find("flash_attention_fwd").unwrap(), find("flash_attention").unwrap());
    let problems: [(Shape, &str, bool); 5] = [
        ((1, 2, 2, 256, 256, 128), "causal=True, block_q=64, block_kv=128", false),
        ((2, 4, 1, 200, 333, 64), "block_q=32, block_kv=128", false),
        ((2, 2, 2, 77, 300, 64), "causal=True, soft_cap=5.0, block_q=16, block_kv=128", true),
        ((1, 4, 1, 130, 130, 32), "causal=True, window_left=300, block_q=32, block_kv=128", false),
        ((1, 2, 1, 512, 512, 128), "causal=True, window_left=15, block_q=128, block_kv=128", false),
    ];
    for (n, ((b, h, hkv, sq, skv, d), statics, segmented)) in problems.into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(40 + n as u64);
        let (q, k) = (random_array(DType::BF16, &[b, h, sq, d], &mut rng), random_array(DType::BF16, &[b, hkv, skv, d], &mut rng));
        let mut v: Vec<f32> = random_array(DType::F32, &[b, hkv, skv, d], &mut rng).to_f32_vec();
        v[3 * d + 1] = f32::NAN;
        v[(skv - 1) * d + 2] = f32::INFINITY;
        let v = Array::from_f32_in(DType::BF16, &[b, hkv, skv, d], v);
        let seg = segmented.then(|| (Array::from_i32(&[b, sq], (0..b * sq).map(|r| ((r % sq) / 30) as i32).collect()), Array::from_i32(&[b, skv], (0..b * skv).map(|c| ((c % skv) / 100) as i32).collect())));
        let inputs = [Some(&q), Some(&k), Some(&v), seg.as_ref().map(|s| &s.0), seg.as_ref().map(|s| &s.1)];
        let types: Vec<Option<Type>> = inputs.iter().map(|a| a.map(|a| Type::vector(a.dtype, &a.shape))).collect();
        let statics = o_only.statics(statics).unwrap();
        let plan = o_only.plan_for(&types, &statics, &Target::V6E).unwrap();
        assert_eq!(plan.results.len(), 1, "{statics:?}");
        for launch in &plan.launches {
            let outputs: Vec<&str> = launch.kernel.refs_of(tessera_dsl::ir::RefKind::Output).map(|(_, r)| r.name.as_str()).collect();
            assert_eq!(outputs, ["o"], "{} {statics:?}", launch.kernel.name);
            let lowered = tessera_codegen::lower(&launch.kernel, &Target::V6E).unwrap();
            assert!(lowered.stablehlo.contains(&format!("-> (tensor<{b}x{h}x{sq}x{d}xbf16>) {{")), "main returns o alone:\n{}", lowered.stablehlo);
        }
        // The interpreter and the JIT (the test command's budget; the kernel is the forward's
        // less one store, which every backend runs in the suites above).
        for be in [tessera_codegen::cpu::Backend::Interp, tessera_codegen::cpu::Backend::Jit] {
            let want = &fwd.run(be.executor(), &inputs, &statics, &Target::V6E).unwrap()[0];
            let got = o_only.run(be.executor(), &inputs, &statics, &Target::V6E).unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(tessera_tests::backends::bits(&got[0]), tessera_tests::backends::bits(want), "{be:?} {statics:?}: o differs from flash_attention_fwd's");
        }
    }
}
