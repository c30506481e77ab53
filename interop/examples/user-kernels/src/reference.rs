//! Independent references in plain f64 loops (no Tessera code): what the kernels are
//! tested against.

/// `(y, h)` of residual + LayerNorm over rows of `n`: `h = x + r`,
/// `y = (h - mean) / sqrt(var + eps) * w + b` with the biased variance.
pub fn residual_layernorm(x: &[f64], r: &[f64], w: &[f64], b: &[f64], n: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let h: Vec<f64> = x.iter().zip(r).map(|(a, b)| a + b).collect();
    let mut y = vec![0.0; h.len()];
    for (row, out) in h.chunks(n).zip(y.chunks_mut(n)) {
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for j in 0..n {
            out[j] = (row[j] - mean) * inv * w[j] + b[j];
        }
    }
    (y, h)
}

/// Softmax over rows of `n`.
pub fn softmax(x: &[f64], n: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for (row, o) in x.chunks(n).zip(out.chunks_mut(n)) {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
        for j in 0..n {
            o[j] = (row[j] - max).exp() / sum;
        }
    }
    out
}
