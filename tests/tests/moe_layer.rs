//! A whole MoE layer assembled from library kernels on the CPU interpreter —
//! router (matmul + top-k) -> permute -> gmm gate/up -> SwiGLU -> gmm down -> combine —
//! against a straightforward f64 per-token reference, in output and in the expert-weight
//! gradients (tgmm, with gmm(transpose_rhs) and swiglu_bwd for the chain rule).

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, Interpreter, Target};
use tessera_kernels::routing::{self, Gate};
use tessera_kernels::harness::{check_output, uniform};
use tessera_kernels::{gmm, norms};

const E: usize = 4;
const K: usize = 2;

struct Layer {
    x: Array,
    router: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    dout: Array,
}

fn random(dtype: DType, shape: &[usize], scale: f32, rng: &mut StdRng) -> Array {
    Array::from_f32_in(dtype, shape, uniform(shape.iter().product(), scale, rng))
}

fn layer(t: usize, d: usize, f: usize, dtype: DType, seed: u64) -> Layer {
    let mut rng = StdRng::seed_from_u64(seed);
    Layer {
        x: random(dtype, &[t, d], 1.0, &mut rng),
        router: random(dtype, &[d, E], 1.0, &mut rng),
        w_gate: random(dtype, &[E, d, f], 0.2, &mut rng),
        w_up: random(dtype, &[E, d, f], 0.2, &mut rng),
        w_down: random(dtype, &[E, f, d], 0.2, &mut rng),
        dout: random(dtype, &[t, d], 1.0, &mut rng),
    }
}

/// Output and expert-weight gradients `(out, dW_gate, dW_up, dW_down)` from the kernels.
fn with_kernels(l: &Layer, target: &Target) -> (Array, Array, Array, Array) {
    let ex: &dyn Executor = &Interpreter;
    let logits = tessera_kernels::run1(ex, "matmul", &[&l.x, &l.router], "", target).unwrap();
    let (weights, ids) = routing::route(ex, &logits, K, Gate::Softmax, true, target).unwrap();
    let plan = routing::plan(&ids, E).unwrap();

    let (xs, group_sizes) = routing::permute(ex, &l.x, &ids, E, target).unwrap();
    assert_eq!(group_sizes.as_i32().unwrap(), plan.group_sizes);
    let gate = gmm::gmm(ex, &xs, &l.w_gate, &group_sizes, false, target).unwrap();
    let up = gmm::gmm(ex, &xs, &l.w_up, &group_sizes, false, target).unwrap();
    let h = norms::swiglu(ex, &gate, &up, target).unwrap();
    let y = gmm::gmm(ex, &h, &l.w_down, &group_sizes, false, target).unwrap();
    let out = routing::combine(ex, &y, &weights, &ids, E, target).unwrap();

    // Backward. dy for sorted row i = weight(i) * dout[token(i)]: the permute kernel
    // gathers dout; scaling each row by its routing weight is host glue.
    let douts = routing::permute(ex, &l.dout, &ids, E, target).unwrap().0;
    let w = weights.to_f32_vec();
    let mut row_weight = vec![0f32; plan.src.len()];
    for (n, &row) in plan.pos.iter().enumerate() {
        row_weight[row as usize] = w[n];
    }
    let d = l.dout.shape[1];
    let dy: Vec<f32> = douts.to_f32_vec().iter().enumerate().map(|(i, v)| v * row_weight[i / d]).collect();
    let dy = Array::from_f32_in(l.x.dtype, &douts.shape, dy);
    let dw_down = gmm::tgmm(ex, &h, &dy, &group_sizes, target).unwrap();
    let dh = gmm::gmm(ex, &dy, &l.w_down, &group_sizes, true, target).unwrap();
    let (dgate, dup) = norms::swiglu_bwd(ex, &gate, &up, &dh, target).unwrap();
    let dw_gate = gmm::tgmm(ex, &xs, &dgate, &group_sizes, target).unwrap();
    let dw_up = gmm::tgmm(ex, &xs, &dup, &group_sizes, target).unwrap();
    (out, dw_gate, dw_up, dw_down)
}

/// The same layer token by token in f64: softmax router, top-k renormalised, each
/// expert's SwiGLU MLP, weighted sum; gradients by the chain rule written out.
fn reference(l: &Layer) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, d) = (l.x.shape[0], l.x.shape[1]);
    let f = l.w_gate.shape[2];
    let (x, r, wg, wu, wd, g) = (l.x.to_f64_vec(), l.router.to_f64_vec(), l.w_gate.to_f64_vec(), l.w_up.to_f64_vec(), l.w_down.to_f64_vec(), l.dout.to_f64_vec());
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let mut out = vec![0.0; t * d];
    let (mut dwg, mut dwu, mut dwd) = (vec![0.0; E * d * f], vec![0.0; E * d * f], vec![0.0; E * f * d]);
    for tok in 0..t {
        let xt = &x[tok * d..(tok + 1) * d];
        let logits: Vec<f64> = (0..E).map(|e| (0..d).map(|i| xt[i] * r[i * E + e]).sum()).collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits.iter().map(|v| (v - max).exp()).collect();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &order[..K];
        let norm: f64 = top.iter().map(|&e| p[e]).sum();
        for &e in top {
            let w = p[e] / norm;
            let a: Vec<f64> = (0..f).map(|j| (0..d).map(|i| xt[i] * wg[(e * d + i) * f + j]).sum()).collect();
            let b: Vec<f64> = (0..f).map(|j| (0..d).map(|i| xt[i] * wu[(e * d + i) * f + j]).sum()).collect();
            let h: Vec<f64> = (0..f).map(|j| a[j] * sigmoid(a[j]) * b[j]).collect();
            for o in 0..d {
                out[tok * d + o] += w * (0..f).map(|j| h[j] * wd[(e * f + j) * d + o]).sum::<f64>();
            }
            // Gradients of w * h @ W_down with upstream dout[tok].
            let dy: Vec<f64> = (0..d).map(|o| w * g[tok * d + o]).collect();
            let dh: Vec<f64> = (0..f).map(|j| (0..d).map(|o| dy[o] * wd[(e * f + j) * d + o]).sum()).collect();
            for j in 0..f {
                for o in 0..d {
                    dwd[(e * f + j) * d + o] += h[j] * dy[o];
                }
                let s = sigmoid(a[j]);
                let da = dh[j] * b[j] * s * (1.0 + a[j] * (1.0 - s));
                let db = dh[j] * a[j] * s;
                for i in 0..d {
                    dwg[(e * d + i) * f + j] += xt[i] * da;
                    dwu[(e * d + i) * f + j] += xt[i] * db;
                }
            }
        }
    }
    (out, dwg, dwu, dwd)
}

fn check(t: usize, d: usize, f: usize, dtype: DType, tolerance: f64, seed: u64) {
    let l = layer(t, d, f, dtype, seed);
    let (out, dwg, dwu, dwd) = with_kernels(&l, &Target::V5E);
    let (r_out, r_dwg, r_dwu, r_dwd) = reference(&l);
    for (name, got, want) in [("out", &out, &r_out), ("dW_gate", &dwg, &r_dwg), ("dW_up", &dwu, &r_dwu), ("dW_down", &dwd, &r_dwd)] {
        let c = check_output(got, want);
        assert!(c.nan_count == 0 && c.scaled_err <= tolerance, "{name} ({t}x{d}, f={f}, {dtype}): relative error {:.3e} > {tolerance:.1e}, {} NaN", c.scaled_err, c.nan_count);
    }
}

#[test]
fn moe_layer_f32_matches_reference() {
    check(64, 128, 256, DType::F32, 1e-4, 1);
    check(200, 128, 384, DType::F32, 1e-4, 2);
}

/// bf16 storage between kernels rounds every intermediate to 8 bits of mantissa.
#[test]
fn moe_layer_bf16_matches_reference() {
    check(64, 128, 256, DType::BF16, 4e-2, 3);
}
