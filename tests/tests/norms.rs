//! Norms and SwiGLU (forward and backward): the library ops on the CPU interpreter against
//! their independent f64 references, f32 and bf16, on shape sets that cover full-dim row
//! blocks, odd row lengths, a single row, long rows and multi-step grids; and the
//! hand-derived backward formulas (the references and the kernels) against central
//! differences of the forward references.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{DType, Target, Type};
use tessera_kernels::harness::{random_array, run_against_reference};
use tessera_kernels::norms::{self, reference};
use tessera_kernels::RMSNORM_EPS;

/// Every shape set in f32 and bf16 on v5e, v6e and tpu7x (bf16 row tiling differs there).
fn fixed(name: &str, sets: &[Vec<Vec<usize>>]) {
    assert!(sets.len() >= 5);
    let op = tessera_kernels::find(name).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        for target in [Target::V5E, Target::V6E, Target::TPU7X] {
            for (i, shapes) in sets.iter().enumerate() {
                let r = run_against_reference(op, shapes, dtype, &target, i as u64).unwrap_or_else(|e| panic!("{name} {shapes:?} {dtype}: {e}"));
                assert!(r.passed(), "{name} {shapes:?} {dtype} on {target} (grid {:?}): {:?}", r.grid, r.outputs);
            }
        }
    }
}

/// Shape sets for ops over `[t, d]` operands and `[1, d]` weights, in operand order
/// (`r` = row-blocked, `w` = weight).
fn sets(layout: &[char]) -> Vec<Vec<Vec<usize>>> {
    [
        (8, 128),    // one tile
        (20, 200),   // t not a multiple of 8 (full-dim block), d not a multiple of 128
        (1, 640),    // a single row
        (512, 1024), // several grid steps
        (16, 8192),  // long rows: few rows per block
        (2048, 384), // many rows, several steps
    ]
    .iter()
    .map(|&(t, d)| layout.iter().map(|c| if *c == 'w' { vec![1, d] } else { vec![t, d] }).collect())
    .collect()
}

#[test]
fn rmsnorm_residual_fixed_shapes() {
    fixed("rmsnorm_residual", &sets(&['r', 'r', 'w']));
}

#[test]
fn layernorm_fixed_shapes() {
    fixed("layernorm", &sets(&['r', 'w', 'w']));
}

#[test]
fn rmsnorm_bwd_fixed_shapes() {
    fixed("rmsnorm_bwd", &sets(&['r', 'w', 'r']));
}

#[test]
fn swiglu_fixed_shapes() {
    fixed("swiglu", &sets(&['r', 'r']));
}

#[test]
fn swiglu_bwd_fixed_shapes() {
    fixed("swiglu_bwd", &sets(&['r', 'r', 'r']));
}

/// `rmsnorm_bwd` accumulates `dw` across grid steps: make sure the default blocks really
/// give a multi-step grid at the default shape (otherwise the accumulator is untested).
#[test]
fn rmsnorm_bwd_default_grid_has_several_steps() {
    let op = tessera_kernels::find("rmsnorm_bwd").unwrap();
    let shapes: Vec<Vec<usize>> = op.cases[0].shapes.iter().map(|s| s.to_vec()).collect();
    for target in [Target::V5E, Target::TPU7X] {
        let r = run_against_reference(op, &shapes, DType::F32, &target, 7).unwrap();
        assert!(r.grid[0] > 1, "grid {:?} on {target}", r.grid);
        assert!(r.passed(), "{:?}", r.outputs);
    }
}

// ---- finite differences -------------------------------------------------------------------

/// `d/dp sum(f(p) * dy)` by central differences in f64, for every element of `p`.
fn numerical_grad(p: &[f64], dy: &[f64], f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let h = 1e-6;
    let loss = |q: &[f64]| f(q).iter().zip(dy).map(|(y, g)| y * g).sum::<f64>();
    let mut q = p.to_vec();
    (0..p.len())
        .map(|i| {
            q[i] = p[i] + h;
            let up = loss(&q);
            q[i] = p[i] - h;
            let down = loss(&q);
            q[i] = p[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// `max|a - b| / max|b|`.
fn scaled_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    err / b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(f64::MIN_POSITIVE)
}

fn inputs(shapes: &[&[usize]], seed: u64) -> Vec<Array> {
    let mut rng = StdRng::seed_from_u64(seed);
    shapes.iter().map(|s| random_array(DType::F32, s, &mut rng)).collect()
}

/// Small shapes (finite differences cost (t * d)^2): odd sizes, several rows, one row.
const FD_SHAPES: [(usize, usize); 3] = [(3, 5), (24, 40), (1, 130)];

#[test]
fn rmsnorm_bwd_matches_finite_differences() {
    let eps = RMSNORM_EPS as f64;
    for (seed, &(t, d)) in FD_SHAPES.iter().enumerate() {
        let a = inputs(&[&[t, d], &[1, d], &[t, d]], seed as u64);
        let (x, w, dy) = (a[0].to_f64_vec(), a[1].to_f64_vec(), a[2].to_f64_vec());
        let forward = |x: &[f64], w: &[f64]| reference::rmsnorm_residual(x, &vec![0.0; x.len()], w, d, eps).0;
        let dx_fd = numerical_grad(&x, &dy, |x| forward(x, &w));
        let dw_fd = numerical_grad(&w, &dy, |w| forward(&x, w));

        let (dx_ref, dw_ref) = reference::rmsnorm_bwd(&x, &w, &dy, d, eps);
        assert!(scaled_err(&dx_ref, &dx_fd) < 1e-7, "reference dx vs finite differences, [{t}, {d}]");
        assert!(scaled_err(&dw_ref, &dw_fd) < 1e-7, "reference dw vs finite differences, [{t}, {d}]");

        let (dx, dw) = norms::rmsnorm_bwd(&Interpreter, &a[0], &a[1], &a[2], RMSNORM_EPS, &Target::V5E).unwrap();
        assert!(scaled_err(&dx.to_f64_vec(), &dx_fd) < 1e-5, "kernel dx vs finite differences, [{t}, {d}]");
        assert!(scaled_err(&dw.to_f64_vec(), &dw_fd) < 1e-5, "kernel dw vs finite differences, [{t}, {d}]");

        // Small shapes fit one default block; 8-row blocks make dw accumulate across steps.
        if t % 8 == 0 {
            let ty = |a: &Array| Type::vector(a.dtype, &a.shape);
            let k = norms::rmsnorm_bwd_kernel(ty(&a[0]), ty(&a[1]), ty(&a[2]), ty(&a[0]), ty(&a[1]), 8, RMSNORM_EPS).unwrap();
            assert!(k.grid[0].extent > 1);
            let out = interp::run(&k, &[&a[0], &a[1], &a[2]]).unwrap();
            assert!(scaled_err(&out[0].to_f64_vec(), &dx_fd) < 1e-5, "8-row kernel dx, [{t}, {d}]");
            assert!(scaled_err(&out[1].to_f64_vec(), &dw_fd) < 1e-5, "8-row kernel dw, [{t}, {d}]");
        }
    }
}

#[test]
fn swiglu_bwd_matches_finite_differences() {
    for (seed, &(t, f)) in FD_SHAPES.iter().enumerate() {
        let arr = inputs(&[&[t, f], &[t, f], &[t, f]], 100 + seed as u64);
        let (a, b, dy) = (arr[0].to_f64_vec(), arr[1].to_f64_vec(), arr[2].to_f64_vec());
        // swiglu is elementwise, so a perturbed element only moves its own output; the full
        // loss is still summed to keep the check independent of that structure.
        let da_fd = numerical_grad(&a, &dy, |a| reference::swiglu(a, &b));
        let db_fd = numerical_grad(&b, &dy, |b| reference::swiglu(&a, b));

        let (da_ref, db_ref) = reference::swiglu_bwd(&a, &b, &dy);
        assert!(scaled_err(&da_ref, &da_fd) < 1e-7, "reference da vs finite differences, [{t}, {f}]");
        assert!(scaled_err(&db_ref, &db_fd) < 1e-7, "reference db vs finite differences, [{t}, {f}]");

        let (da, db) = norms::swiglu_bwd(&Interpreter, &arr[0], &arr[1], &arr[2], &Target::V6E).unwrap();
        assert!(scaled_err(&da.to_f64_vec(), &da_fd) < 1e-5, "kernel da vs finite differences, [{t}, {f}]");
        assert!(scaled_err(&db.to_f64_vec(), &db_fd) < 1e-5, "kernel db vs finite differences, [{t}, {f}]");
    }
}

/// The forward ops' array functions agree with the library entries' references (they are
/// what the MoE / decoder tests compose).
#[test]
fn array_functions_match_references() {
    let t = Target::TPU7X;
    let a = inputs(&[&[16, 256], &[16, 256], &[1, 256], &[1, 256]], 9);
    let f = |i: usize| a[i].to_f64_vec();

    let (out, h) = norms::rmsnorm_residual(&Interpreter, &a[0], &a[1], &a[2], RMSNORM_EPS, &t).unwrap();
    let (out_ref, h_ref) = reference::rmsnorm_residual(&f(0), &f(1), &f(2), 256, RMSNORM_EPS as f64);
    assert!(scaled_err(&out.to_f64_vec(), &out_ref) < 1e-5);
    assert!(scaled_err(&h.to_f64_vec(), &h_ref) < 1e-6);

    let ln = norms::layernorm(&Interpreter, &a[0], &a[2], &a[3], norms::LAYERNORM_EPS, &t).unwrap();
    assert!(scaled_err(&ln.to_f64_vec(), &reference::layernorm(&f(0), &f(2), &f(3), 256, norms::LAYERNORM_EPS as f64)) < 1e-5);

    let s = norms::swiglu(&Interpreter, &a[0], &a[1], &t).unwrap();
    assert!(scaled_err(&s.to_f64_vec(), &reference::swiglu(&f(0), &f(1))) < 1e-5);
}

/// Mismatched operands are errors, not panics.
#[test]
fn shape_mismatch_is_an_error() {
    let a = inputs(&[&[8, 128], &[8, 256]], 1);
    let err = norms::swiglu(&Interpreter, &a[0], &a[1], &Target::V5E).unwrap_err();
    assert_eq!(err.rule, "operand-shape", "{err}");
    let w = inputs(&[&[1, 64]], 2);
    assert!(norms::rmsnorm_residual(&Interpreter, &a[0], &a[0], &w[0], RMSNORM_EPS, &Target::V5E).is_err());
}
