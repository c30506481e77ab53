//! RoPE (both variants) and fused cross-entropy, forward and backward: the kernels on the
//! interpreter against the independent f64 references (f32 and bf16, edge shapes), the
//! backward references against central finite differences of the forward references.
//! (libtpu compiles every registered op, both RoPE variants included, in tpu_compiler.rs.)

use rand::{rngs::StdRng, Rng, SeedableRng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Interpreter, Target, Type};
use tessera_kernels::harness::{run_case, Report};
use tessera_kernels::rope_ce::{self, reference};
use tessera_kernels::{find, Op};

fn check(op: &Op, statics: &str, shapes: &[Vec<usize>], dtype: DType, target: &Target, seed: u64) -> Report {
    let r = run_case(op, &op.statics(statics).unwrap(), shapes, dtype, target, seed, &Interpreter).unwrap_or_else(|e| panic!("{} {shapes:?} {dtype}: {e}", op.name));
    assert!(r.passed(), "{} {shapes:?} {dtype} on {target} (grid {:?}): {:?}", op.name, r.grid, r.outputs);
    r
}

fn fixed_with(op: &Op, statics: &str, sets: &[Vec<Vec<usize>>]) {
    assert!(sets.len() >= 5);
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::TPU7X] {
            for (i, shapes) in sets.iter().enumerate() {
                check(op, statics, shapes, dtype, &target, i as u64);
            }
        }
    }
}

fn fixed(op: &Op, sets: &[Vec<Vec<usize>>]) {
    fixed_with(op, "", sets)
}

/// `[t, h, dh]` + `[t]` shape sets: dh 128 / 64 / 256 / 96 (chunk = whole row), T not a
/// multiple of 8, and T past one row block (the last block partial).
fn rope_sets() -> Vec<Vec<Vec<usize>>> {
    [(8, 2, 128), (13, 3, 64), (40, 2, 256), (21, 5, 96), (2053, 1, 128), (100, 1, 2)].iter().map(|&(t, h, dh)| vec![vec![t, h, dh], vec![t]]).collect()
}

/// `[t, v]` + `[t]` (+ `[t, 1]`, `[t]` for the backward): vocabularies below, at and past
/// one tile, not multiples of it (50257 = GPT-2), T not a multiple of 8 and past a row tile.
fn ce_sets(bwd: bool) -> Vec<Vec<Vec<usize>>> {
    [(8, 128), (5, 1000), (37, 2048), (16, 5000), (130, 4097), (3, 50257)]
        .iter()
        .map(|&(t, v)| if bwd { vec![vec![t, v], vec![t], vec![t, 1], vec![t]] } else { vec![vec![t, v], vec![t]] })
        .collect()
}

#[test]
fn rope_rotate_half() {
    fixed(find("rope").unwrap(), &rope_sets());
}

#[test]
fn rope_rotate_half_bwd() {
    fixed(find("rope_bwd").unwrap(), &rope_sets());
}

#[test]
fn rope_interleaved() {
    fixed_with(find("rope").unwrap(), "interleaved=True", &rope_sets());
}

#[test]
fn rope_interleaved_bwd() {
    fixed_with(find("rope_bwd").unwrap(), "interleaved=True", &rope_sets());
}

#[test]
fn cross_entropy() {
    fixed(find("cross_entropy").unwrap(), &ce_sets(false));
}

#[test]
fn cross_entropy_bwd() {
    fixed(find("cross_entropy_bwd").unwrap(), &ce_sets(true));
}

/// The chunk rule: lane-aligned chunks of whole heads, else the whole row.
#[test]
fn cross_entropy_with_grad() {
    fixed(find("cross_entropy_with_grad").unwrap(), &ce_sets(false));
}

#[test]
fn rope_chunks() {
    assert_eq!(rope_ce::rope_chunk(8 * 128, 128), 128);
    assert_eq!(rope_ce::rope_chunk(8 * 64, 64), 128);
    assert_eq!(rope_ce::rope_chunk(3 * 64, 64), 192);
    assert_eq!(rope_ce::rope_chunk(4 * 256, 256), 256);
    assert_eq!(rope_ce::rope_chunk(32 * 96, 96), 384);
    assert_eq!(rope_ce::rope_chunk(5 * 96, 96), 480);
}

fn randn(n: usize, rng: &mut StdRng) -> Vec<f64> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn dotp(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `grad` against central differences of `f` at `x`, coordinate by coordinate.
fn assert_fd(f: impl Fn(&[f64]) -> f64, x: &[f64], grad: &[f64], what: &str) {
    let eps = 1e-5;
    for k in 0..x.len() {
        let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
        xp[k] += eps;
        xm[k] -= eps;
        let fd = (f(&xp) - f(&xm)) / (2.0 * eps);
        assert!((fd - grad[k]).abs() < 1e-7 * (1.0 + fd.abs()), "{what}: d/dx[{k}] finite difference {fd}, backward {}", grad[k]);
    }
}

#[test]
fn rope_bwd_reference_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(7);
    for interleaved in [false, true] {
        for (t, h, dh) in [(3, 2, 8), (2, 1, 6)] {
            let pos: Vec<f64> = (0..t).map(|_| rng.gen_range(0..5000) as f64).collect();
            let x = randn(t * h * dh, &mut rng);
            let dy = randn(t * h * dh, &mut rng);
            let f = |x: &[f64]| dotp(&dy, &reference::rope(x, &pos, t, h, dh, 10000.0, interleaved));
            let grad = reference::rope_bwd(&dy, &pos, t, h, dh, 10000.0, interleaved);
            assert_fd(f, &x, &grad, &format!("rope interleaved={interleaved}"));
        }
    }
}

#[test]
fn cross_entropy_bwd_reference_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(8);
    let (t, v) = (4, 7);
    let logits: Vec<f64> = randn(t * v, &mut rng).iter().map(|z| 3.0 * z).collect();
    // Row 2 is ignored (ignore_index = -100): its loss and gradient are 0.
    let labels = [3i64, 0, -100, 6];
    let dloss = randn(t, &mut rng);
    let f = |x: &[f64]| dotp(&dloss, &reference::cross_entropy(x, &labels, v).0);
    let grad = reference::cross_entropy_bwd(&logits, &labels, &dloss, v);
    assert_fd(f, &logits, &grad, "cross_entropy");
    assert!(grad[2 * v..3 * v].iter().all(|&g| g == 0.0));
}

/// The public functions compose: the forward's f32 `lse` feeds the backward, rows labelled
/// `ignore_index` (-100) are ignored, and labels outside the vocabulary or a too-short
/// label array are error values.
#[test]
fn cross_entropy_public_functions() {
    let (t, v) = (11, 3000);
    let mut rng = StdRng::seed_from_u64(9);
    let logits_f: Vec<f32> = (0..t * v).map(|_| rng.gen_range(-4.0..4.0)).collect();
    let logits = Array::from_f32(&[t, v], logits_f.clone());
    let labels_i: Vec<i32> = (0..t).map(|i| if i == 4 || i == 7 { -100 } else { rng.gen_range(0..v as i32) }).collect();
    let labels = Array::from_i32(&[t], labels_i.clone());
    let target = Target::V6E;
    let (loss, lse) = rope_ce::cross_entropy(&Interpreter, &logits, &labels, &target).unwrap();
    assert_eq!((loss.shape.as_slice(), lse.shape.as_slice(), lse.dtype), (&[t][..], &[t][..], DType::F32));
    let x64: Vec<f64> = logits_f.iter().map(|&z| z as f64).collect();
    let l64: Vec<i64> = labels_i.iter().map(|&l| l as i64).collect();
    let (want_loss, want_lse) = reference::cross_entropy(&x64, &l64, v);
    for (got, want) in [(&loss, &want_loss), (&lse, &want_lse)] {
        for (g, w) in got.to_f64_vec().iter().zip(want) {
            assert!((g - w).abs() < 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
        }
    }
    assert_eq!(loss.to_f64_vec()[4], 0.0);
    assert_eq!(loss.to_f64_vec()[7], 0.0);
    let dloss = Array::from_f32(&[t], vec![1.0; t]);
    let d = rope_ce::cross_entropy_bwd(&Interpreter, &logits, &labels, &lse, &dloss, &target).unwrap();
    let want = reference::cross_entropy_bwd(&x64, &l64, &vec![1.0; t], v);
    let err = d.to_f64_vec().iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
    assert!(err < 1e-6, "dlogits max error {err}");

    let e = rope_ce::cross_entropy(&Interpreter, &logits, &Array::from_i32(&[t - 1], vec![0; t - 1]), &target).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("operand-shape", "input `labels`"));
    for bad in [v as i32, -1, i32::MIN] {
        let mut l = labels_i.clone();
        l[3] = bad;
        let e = rope_ce::cross_entropy(&Interpreter, &logits, &Array::from_i32(&[t], l), &target).unwrap_err();
        assert_eq!((e.rule, e.subject.as_str()), ("label-range", "input `labels`"), "{e}");
        assert!(e.to_string().contains(&format!("row 3 has label {bad}")), "{e}");
    }
}

/// `rope` then `rope_bwd` is the identity (rotations are orthogonal), with positions far
/// from 0..T; odd head dims are an error value.
#[test]
fn rope_public_functions() {
    let (t, h, dh) = (19, 4, 64);
    let mut rng = StdRng::seed_from_u64(10);
    let xs: Vec<f32> = (0..t * h * dh).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let x = Array::from_f32(&[t, h, dh], xs.clone());
    let pos = Array::from_i32(&[t], (0..t).map(|i| 100_000 - 37 * i as i32).collect());
    for interleaved in [false, true] {
        let y = rope_ce::rope(&Interpreter, &x, &pos, 500000.0, interleaved, &Target::V5E).unwrap();
        assert_eq!(y.shape, x.shape);
        let back = rope_ce::rope_bwd(&Interpreter, &y, &pos, 500000.0, interleaved, &Target::V5E).unwrap();
        let err = back.to_f64_vec().iter().zip(&xs).map(|(a, &b)| (a - b as f64).abs()).fold(0.0, f64::max);
        assert!(err < 1e-6, "interleaved={interleaved}: round trip error {err}");
    }
    let e = rope_ce::build_rope(&Type::vector(DType::F32, &[8, 2, 7]), false, false, &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "operand-shape");
}

/// A rotary base of 0, below 0, NaN or inf would make NaN (or meaningless) angles: an
/// `option-value` error naming `theta`, forward and backward, before anything runs.
#[test]
fn rope_theta_must_be_finite_and_positive() {
    let x = Array::from_f32(&[4, 2, 64], vec![0.5; 4 * 2 * 64]);
    let pos = Array::from_i32(&[4], vec![0, 1, 2, 3]);
    for theta in [0.0, -0.0, -10000.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        for (name, result) in [("rope", rope_ce::rope(&Interpreter, &x, &pos, theta, false, &Target::V5E)), ("rope_bwd", rope_ce::rope_bwd(&Interpreter, &x, &pos, theta, true, &Target::V5E))] {
            let e = result.err().unwrap_or_else(|| panic!("{name} theta={theta}: accepted"));
            assert_eq!((e.kernel.as_str(), e.rule, e.subject.as_str()), (name, "option-value", "argument `theta`"), "{e}");
            assert!(e.to_string().contains("finite positive"), "{e}");
        }
    }
    // A small positive base is a base (every angle is the position).
    assert!(rope_ce::rope(&Interpreter, &x, &pos, 1.0, false, &Target::V5E).is_ok());
}

/// The in-kernel angles hold for any i32 position, far past what a plain f32
/// `position * inv_freq` gets right: negative, 2^17, 2^24 + 3, the i32 extremes, against
/// the f64 reference at f32's tolerance, on the interpreter and the JIT, both variants and
/// a small and a large base.
#[test]
fn rope_angles_are_exact_across_the_position_range() {
    use tessera_codegen::cpu::Backend;
    let positions = [0, 1, 7, 8191, 65_535, 131_071, 1 << 20, (1 << 24) + 3, 300_000_007, i32::MAX, -1, -4096, i32::MIN];
    let (t, h, dh) = (positions.len(), 3, 128);
    let mut rng = StdRng::seed_from_u64(21);
    let xs: Vec<f32> = (0..t * h * dh).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let x = Array::from_f32(&[t, h, dh], xs.clone());
    let pos = Array::from_i32(&[t], positions.to_vec());
    let posf: Vec<f64> = positions.iter().map(|&p| p as f64).collect();
    for theta in [10000.0, 1e6] {
        for interleaved in [false, true] {
            let want = reference::rope(&x.to_f64_vec(), &posf, t, h, dh, theta, interleaved);
            for be in [Backend::Interp, Backend::Jit] {
                let y = rope_ce::rope(be.executor(), &x, &pos, theta, interleaved, &Target::V6E).unwrap();
                let err = y.to_f64_vec().iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(err < 4e-6, "{be:?} theta={theta} interleaved={interleaved}: max error {err}");
            }
        }
    }
}

/// A NaN or inf in x (or dy) reaches exactly the two outputs of its pair, as torch's
/// `x * cos + rotate(x) * sin` (at position 0, `sin = 0` and `inf * 0` makes the partner
/// NaN too), never the rest of the head or chunk: both variants, several heads per chunk
/// (dh 64), a whole-row chunk (dh 2), f32 and bf16.
#[test]
fn rope_nonfinite_stays_in_its_pair() {
    use tessera_tests::nonfinite::{assert_matches, nan_at};
    for (t, h, dh) in [(9, 4, 64), (5, 4, 2), (3, 2, 128)] {
        for interleaved in [false, true] {
            for op in ["rope", "rope_bwd"] {
                for dtype in [DType::F32, DType::BF16] {
                    let mut rng = StdRng::seed_from_u64(5);
                    let mut xs: Vec<f32> = (0..t * h * dh).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    // Token 0 at position 0, token 1 at 7; head 1, lanes 3 (NaN) and 0 (inf).
                    let at = |tok: usize, lane: usize| (tok * h + 1) * dh + lane;
                    xs[at(0, 0)] = f32::INFINITY;
                    xs[at(1, 1)] = f32::NAN;
                    xs[at(1, 0)] = f32::NEG_INFINITY;
                    let x = Array::from_f32_in(dtype, &[t, h, dh], xs);
                    let pos = Array::from_i32(&[t], (0..t as i32).map(|i| 7 * i).collect());
                    let statics = if interleaved { "interleaved=True" } else { "" };
                    let what = format!("{op} [{t}, {h}, {dh}] {dtype} interleaved={interleaved}");
                    let (got, want) = assert_matches(&what, op, &[Some(&x), Some(&pos)], statics, &Target::V5E, if dtype == DType::BF16 { 1e-2 } else { 1e-6 });
                    // Independently of the reference: NaN only inside the two touched pairs.
                    let partner = |lane: usize| if interleaved { lane ^ 1 } else { (lane + dh / 2) % dh };
                    let allowed = [at(0, 0), at(0, partner(0)), at(1, 0), at(1, partner(0)), at(1, 1), at(1, partner(1))];
                    let nans = nan_at(&got[0].to_f64_vec());
                    assert!(nans.iter().all(|i| allowed.contains(i)), "{what}: NaN at {nans:?}, allowed {allowed:?}");
                    assert!(nans.contains(&at(1, 1)) && nans.contains(&at(1, partner(1))), "{what}: the NaN's pair must be NaN: {nans:?}");
                    assert_eq!(nan_at(&want[0]), nans);
                }
            }
        }
    }
}
