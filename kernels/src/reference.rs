//! Independent references for the library kernels: the plainest possible f64 loops over
//! row-major data. They share no code with the interpreter or the kernels, so a test
//! that compares the two catches a wrong kernel, a wrong interpreter, or both.

/// `x[m, k] @ y[k, n]`.
pub fn matmul(x: &[f64], y: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let a = x[i * k + p];
            for j in 0..n {
                out[i * n + j] += a * y[p * n + j];
            }
        }
    }
    out
}

/// `gelu_tanh(x * a + b)`, `a` and `b` of length `n` broadcast over rows.
pub fn gelu_affine(x: &[f64], a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
    x.iter()
        .enumerate()
        .map(|(idx, &v)| {
            let z = v * a[idx % n] + b[idx % n];
            0.5 * z * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (z + 0.044715 * z.powi(3))).tanh())
        })
        .collect()
}

/// Softmax of each length-`n` row.
pub fn softmax(x: &[f64], n: usize) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|row| {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            exps.into_iter().map(move |e| e / sum)
        })
        .collect()
}

/// `dx` of `y = softmax(x)` from `y`: `y * (dy - sum(dy * y))` per length-`n` row.
pub fn softmax_bwd(y: &[f64], dy: &[f64], n: usize) -> Vec<f64> {
    y.chunks(n)
        .zip(dy.chunks(n))
        .flat_map(|(p, g)| {
            let dot: f64 = p.iter().zip(g).map(|(a, b)| a * b).sum();
            p.iter().zip(g).map(move |(a, b)| a * (b - dot)).collect::<Vec<_>>()
        })
        .collect()
}

/// `(dx, da, db)` of `gelu_tanh(x * a + b)`; `da`, `db` summed over rows.
pub fn gelu_affine_bwd(x: &[f64], a: &[f64], b: &[f64], dy: &[f64], n: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let (mut dx, mut da, mut db) = (vec![0.0; x.len()], vec![0.0; n], vec![0.0; n]);
    for (idx, (&v, &g)) in x.iter().zip(dy).enumerate() {
        let j = idx % n;
        let z = v * a[j] + b[j];
        let t = (k * (z + 0.044715 * z.powi(3))).tanh();
        let dz = g * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z));
        dx[idx] = dz * a[j];
        da[j] += dz * v;
        db[j] += dz;
    }
    (dx, da, db)
}

/// RMSNorm of each length-`n` row, scaled by `w`.
pub fn rmsnorm(x: &[f64], w: &[f64], n: usize, eps: f64) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter().zip(w).map(move |(v, wi)| v * r * wi)
        })
        .collect()
}
