//! The reference interpreter against plain-loop computations written here.

use half::bf16;
use tessera_dsl::interp::{self, Array, Data};
use tessera_dsl::verify::verify;
use tessera_dsl::*;

const PAR: Semantics = Semantics::Parallel;
const ARB: Semantics = Semantics::Arbitrary;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn spec(block: &[usize], map: Vec<IndexExpr>) -> BlockSpec {
    BlockSpec { block_shape: block.iter().map(|&b| Some(b)).collect(), index_map: map }
}

fn g(n: usize) -> IndexExpr {
    IndexExpr::grid(n)
}

fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(err <= tol * w.abs().max(1.0), "element {i}: got {g}, want {w} (err {err})");
    }
}

/// Tiled matmul: grid (M/bm, N/bn, K/bk), K last and `arbitrary`, f32 accumulator scratch
/// zeroed at k == 0 and written out at the last k.
fn matmul(m: usize, k: usize, n: usize, (bm, bk, bn): (usize, usize, usize), dtype: DType) -> Kernel {
    let mut b = KernelBuilder::new("matmul");
    b.grid(&[(m / bm, PAR), (n / bn, PAR), (k / bk, ARB)]);
    let x = b.input("x", dtype, &[m, k], spec(&[bm, bk], vec![g(0), g(2)]));
    let y = b.input("y", dtype, &[k, n], spec(&[bk, bn], vec![g(2), g(1)]));
    let o = b.output("o", DType::F32, &[m, n], spec(&[bm, bn], vec![g(0), g(1)]));
    let acc = b.scratch("acc", DType::F32, &[bm, bn], MemorySpace::Vmem);
    let kk = b.program_id(2);
    let first = b.cmp(CmpOp::Eq, kk, 0);
    b.when(first, |b| {
        let z = b.zeros(&[bm, bn], DType::F32);
        b.store(acc, &[], z);
    });
    let xv = b.load(x, &[]);
    let yv = b.load(y, &[]);
    let p = b.dot(xv, yv, false, false);
    let cur = b.load(acc, &[]);
    let sum = b.add(cur, p);
    b.store(acc, &[], sum);
    let nk = b.num_programs(2);
    let last = b.sub(nk, 1);
    let is_last = b.cmp(CmpOp::Eq, kk, last);
    b.when(is_last, |b| {
        let v = b.load(acc, &[]);
        b.store(o, &[], v);
    });
    b.finish().unwrap()
}

fn matmul_ref(x: &[f32], y: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| x[i * k + p] as f64 * y[p * n + j] as f64).sum();
        }
    }
    out
}

#[test]
fn tiled_matmul_f32() {
    let (m, k, n) = (64, 384, 256);
    let kern = matmul(m, k, n, (16, 128, 128), DType::F32);
    verify(&kern, &Target::V5E).unwrap();
    let (xs, ys) = (values(m * k, 1), values(k * n, 2));
    let (x, y) = (Array::from_f32(&[m, k], xs.clone()), Array::from_f32(&[k, n], ys.clone()));
    let (out, stats) = interp::run_with_stats(&kern, &[&x, &y]).unwrap();
    assert_eq!(stats.grid_steps, 4 * 2 * 3);
    assert_eq!(stats.block_writebacks, 4 * 2);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].shape, vec![m, n]);
    assert_close(out[0].as_f32().unwrap(), &matmul_ref(&xs, &ys, m, k, n), 1e-5);
}

#[test]
fn tiled_matmul_bf16_inputs_accumulate_in_f32() {
    let (m, k, n) = (32, 256, 128);
    let kern = matmul(m, k, n, (16, 128, 128), DType::BF16);
    verify(&kern, &Target::V5E).unwrap();
    let x = Array::from_f32_as_bf16(&[m, k], &values(m * k, 3));
    let y = Array::from_f32_as_bf16(&[k, n], &values(k * n, 4));
    let out = interp::run(&kern, &[&x, &y]).unwrap();
    // Products of bf16 values are exact in f32; only the f32 accumulation rounds.
    let want = matmul_ref(&x.to_f32_vec(), &y.to_f32_vec(), m, k, n);
    assert_close(out[0].as_f32().unwrap(), &want, 1e-5);
}

#[test]
fn dot_transposed_operands() {
    // o = x^T @ y^T with x: [k, m], y: [n, k], one block.
    let (m, k, n) = (8, 16, 24);
    let mut b = KernelBuilder::new("dot_t");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::F32, &[k, m], spec(&[k, m], vec![0.into(), 0.into()]));
    let y = b.input("y", DType::F32, &[n, k], spec(&[n, k], vec![0.into(), 0.into()]));
    let o = b.output("o", DType::F32, &[m, n], spec(&[m, n], vec![0.into(), 0.into()]));
    let xv = b.load(x, &[]);
    let yv = b.load(y, &[]);
    let p = b.dot(xv, yv, true, true);
    b.store(o, &[], p);
    let kern = b.finish().unwrap();
    let (xs, ys) = (values(k * m, 5), values(n * k, 6));
    let out = interp::run(&kern, &[&Array::from_f32(&[k, m], xs.clone()), &Array::from_f32(&[n, k], ys.clone())]).unwrap();
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k).map(|p| xs[p * m + i] as f64 * ys[j * k + p] as f64).sum();
        }
    }
    assert_close(out[0].as_f32().unwrap(), &want, 1e-5);
}

#[test]
fn int8_dot_accumulates_in_i32() {
    let mut b = KernelBuilder::new("dot_i8");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::I8, &[4, 8], spec(&[4, 8], vec![0.into(), 0.into()]));
    let y = b.input("y", DType::I8, &[8, 3], spec(&[8, 3], vec![0.into(), 0.into()]));
    let o = b.output("o", DType::I32, &[4, 3], spec(&[4, 3], vec![0.into(), 0.into()]));
    let xv = b.load(x, &[]);
    let yv = b.load(y, &[]);
    let p = b.dot(xv, yv, false, false);
    b.store(o, &[], p);
    let kern = b.finish().unwrap();
    let xs: Vec<i8> = (0..32).map(|i| (i * 37 % 255 - 127) as i8).collect();
    let ys: Vec<i8> = (0..24).map(|i| (i * 91 % 255 - 127) as i8).collect();
    let out = interp::run(&kern, &[&Array::from_i8(&[4, 8], xs.clone()), &Array::from_i8(&[8, 3], ys.clone())]).unwrap();
    let want: Vec<i32> = (0..12).map(|ij| (0..8).map(|p| xs[ij / 3 * 8 + p] as i32 * ys[p * 3 + ij % 3] as i32).sum()).collect();
    assert_eq!(out[0].as_i32().unwrap(), want.as_slice());
}

#[test]
fn elementwise_math() {
    // o = max(tanh(x) * exp(-x*x) + erf(x), rsqrt(|x| + 1) - 0.5), blocked by rows.
    let (r, c) = (32, 256);
    let mut b = KernelBuilder::new("elementwise");
    b.grid(&[(r / 8, PAR)]);
    let x = b.input("x", DType::F32, &[r, c], spec(&[8, c], vec![g(0), 0.into()]));
    let o = b.output("o", DType::F32, &[r, c], spec(&[8, c], vec![g(0), 0.into()]));
    let xv = b.load(x, &[]);
    let t = b.unary(UnaryOp::Tanh, xv);
    let sq = b.mul(xv, xv);
    let nsq = b.unary(UnaryOp::Neg, sq);
    let e = b.unary(UnaryOp::Exp, nsq);
    let te = b.mul(t, e);
    let erf = b.unary(UnaryOp::Erf, xv);
    let lhs = b.add(te, erf);
    let a = b.unary(UnaryOp::Abs, xv);
    let a1 = b.add(a, 1.0);
    let rs = b.unary(UnaryOp::Rsqrt, a1);
    let rhs = b.sub(rs, 0.5);
    let res = b.max(lhs, rhs);
    b.store(o, &[], res);
    let kern = b.finish().unwrap();
    verify(&kern, &Target::V5E).unwrap();
    let xs = values(r * c, 7).iter().map(|v| v * 3.0).collect::<Vec<_>>();
    let out = interp::run(&kern, &[&Array::from_f32(&[r, c], xs.clone())]).unwrap();
    let want: Vec<f64> = xs
        .iter()
        .map(|&x| {
            let x = x as f64;
            let lhs = x.tanh() * (-x * x).exp() + erf_ref(x);
            let rhs = 1.0 / (x.abs() + 1.0).sqrt() - 0.5;
            lhs.max(rhs)
        })
        .collect();
    assert_close(out[0].as_f32().unwrap(), &want, 1e-6);
}

/// erf by its Maclaurin series (|x| <= 3 here), independent of the interpreter's libm.
fn erf_ref(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn bf16_results_are_rounded_after_every_op() {
    let mut b = KernelBuilder::new("bf16_add");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::BF16, &[16, 128], spec(&[16, 128], vec![0.into(), 0.into()]));
    let o = b.output("o", DType::BF16, &[16, 128], spec(&[16, 128], vec![0.into(), 0.into()]));
    let xv = b.load(x, &[]);
    let y = b.add(xv, 1.0);
    let z = b.sub(y, 1.0);
    b.store(o, &[], z);
    let kern = b.finish().unwrap();
    let x = Array::from_f32_as_bf16(&[16, 128], &values(16 * 128, 8));
    let out = interp::run(&kern, &[&x]).unwrap();
    let want: Vec<bf16> = x.as_bf16().unwrap().iter().map(|v| bf16::from_f32(bf16::from_f32(v.to_f32() + 1.0).to_f32() - 1.0)).collect();
    assert_eq!(out[0].as_bf16().unwrap(), want.as_slice());
}

#[test]
fn integer_and_cast_semantics() {
    let mut b = KernelBuilder::new("ints");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::I32, &[1, 8], spec(&[1, 8], vec![0.into(), 0.into()]));
    let y = b.input("y", DType::I32, &[1, 8], spec(&[1, 8], vec![0.into(), 0.into()]));
    let q = b.output("q", DType::I32, &[1, 8], spec(&[1, 8], vec![0.into(), 0.into()]));
    let r = b.output("r", DType::I32, &[1, 8], spec(&[1, 8], vec![0.into(), 0.into()]));
    let f = b.output("f", DType::I8, &[1, 8], spec(&[1, 8], vec![0.into(), 0.into()]));
    let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
    let qv = b.div(xv, yv);
    b.store(q, &[], qv);
    let rv = b.binary(BinaryOp::Rem, xv, yv);
    b.store(r, &[], rv);
    // i32 -> f32 -> *0.5 -> i8: truncates toward zero and saturates.
    let xf = b.cast(xv, DType::F32);
    let half_x = b.mul(xf, 0.5);
    let xi8 = b.cast(half_x, DType::I8);
    b.store(f, &[], xi8);
    let kern = b.finish().unwrap();
    let xs = vec![7, -7, 7, -7, 5, i32::MIN, 1000, -1001];
    let ys = vec![2, 2, -2, -2, 0, -1, 3, 3];
    let out = interp::run(&kern, &[&Array::from_i32(&[1, 8], xs), &Array::from_i32(&[1, 8], ys)]).unwrap();
    assert_eq!(out[0].as_i32().unwrap(), &[3, -3, -3, 3, 0, i32::MIN, 333, -333]);
    assert_eq!(out[1].as_i32().unwrap(), &[1, -1, 1, -1, 5, 0, 1, -2]);
    assert_eq!(out[2].as_i8().unwrap(), &[3, -3, 3, -3, 2, -128, 127, -128]);
}

#[test]
fn row_reduction_sum_and_max() {
    let (r, c) = (64, 512);
    let mut b = KernelBuilder::new("rowreduce");
    b.grid(&[(r / 16, PAR)]);
    let x = b.input("x", DType::F32, &[r, c], spec(&[16, c], vec![g(0), 0.into()]));
    let s = b.output("s", DType::F32, &[r, 1], spec(&[16, 1], vec![g(0), 0.into()]));
    let m = b.output("m", DType::F32, &[r, 1], spec(&[16, 1], vec![g(0), 0.into()]));
    // One [1, c] row per step, in a squeezed leading dim (a [1, c] block of [r / 16, c] breaks the tiling).
    let cm = b.output("cm", DType::F32, &[r / 16, 1, c], BlockSpec { block_shape: vec![None, Some(1), Some(c)], index_map: vec![g(0), 0.into(), 0.into()] });
    let xv = b.load(x, &[]);
    let sv = b.reduce(ReduceOp::Sum, xv, 1);
    b.store(s, &[], sv);
    let mv = b.reduce(ReduceOp::Max, xv, 1);
    b.store(m, &[], mv);
    let colmin = b.reduce(ReduceOp::Min, xv, 0);
    b.store(cm, &[], colmin);
    let kern = b.finish().unwrap();
    let xs = values(r * c, 9);
    let out = interp::run(&kern, &[&Array::from_f32(&[r, c], xs.clone())]).unwrap();
    let rows: Vec<&[f32]> = xs.chunks(c).collect();
    let sums: Vec<f64> = rows.iter().map(|row| row.iter().map(|&v| v as f64).sum()).collect();
    let maxs: Vec<f64> = rows.iter().map(|row| row.iter().fold(f64::MIN, |a, &v| a.max(v as f64))).collect();
    let xr = &xs;
    let mins: Vec<f64> = (0..r / 16).flat_map(|blk| (0..c).map(move |j| (0..16).map(|i| xr[(blk * 16 + i) * c + j] as f64).fold(f64::MAX, f64::min))).collect();
    assert_close(out[0].as_f32().unwrap(), &sums, 1e-5);
    assert_close(out[1].as_f32().unwrap(), &maxs, 0.0);
    assert_close(out[2].as_f32().unwrap(), &mins, 0.0);
}

#[test]
fn for_loop_with_carries_and_dynamic_slices() {
    // Per row block: acc = sum over 128-wide chunks (loaded with a dynamic slice) of
    // x[:, chunk] * (i + 1); count = number of iterations. The result is stored through a
    // dynamic slice too: o[:, ds(count*0, 128)].
    let (r, c, w) = (16, 512, 128);
    let mut b = KernelBuilder::new("chunked");
    b.grid(&[(r / 8, PAR)]);
    let x = b.input("x", DType::F32, &[r, c], spec(&[8, c], vec![g(0), 0.into()]));
    let o = b.output("o", DType::F32, &[r, 2 * w], spec(&[8, 2 * w], vec![g(0), 0.into()]));
    let acc0 = b.zeros(&[8, w], DType::F32);
    let n0 = b.i32(0);
    let outs = b.for_range(0, (c / w) as i64, 1, &[acc0, n0], |b, i, carries| {
        let start = b.mul(i, w as i64);
        let chunk = b.load(x, &[Index::Full, ds(start, w)]);
        let i1 = b.add(i, 1);
        let scale = b.cast(i1, DType::F32);
        let scaled = b.mul(chunk, scale);
        let acc = b.add(carries[0], scaled);
        let n = b.add(carries[1], 1);
        vec![acc, n]
    });
    // A zero-trip loop returns its init.
    let zero_trip = b.for_range(5, 5, 1, &[outs[1]], |b, _, carries| vec![b.add(carries[0], 100)]);
    let off = b.sub(zero_trip[0], (c / w) as i64 - 1); // == 1
    let col = b.mul(off, w as i64);
    b.store(o, &[Index::Full, ds(col, w)], outs[0]);
    let first = b.zeros(&[8, w], DType::F32);
    b.store(o, &[Index::Full, ds(0, w)], first);
    let kern = b.finish().unwrap();
    let xs = values(r * c, 10);
    let out = interp::run(&kern, &[&Array::from_f32(&[r, c], xs.clone())]).unwrap();
    let mut want = vec![0.0f64; r * 2 * w];
    for i in 0..r {
        for j in 0..w {
            want[i * 2 * w + w + j] = (0..c / w).map(|q| xs[i * c + q * w + j] as f64 * (q + 1) as f64).sum();
        }
    }
    assert_close(out[0].as_f32().unwrap(), &want, 1e-5);
}

#[test]
fn if_else_iota_select_transpose_reshape() {
    let mut b = KernelBuilder::new("misc");
    b.grid(&[(2, PAR)]);
    let o = b.output("o", DType::I32, &[2, 8, 16], BlockSpec { block_shape: vec![None, Some(8), Some(16)], index_map: vec![g(0), 0.into(), 0.into()] });
    let pid = b.program_id(0);
    let is0 = b.cmp(CmpOp::Eq, pid, 0);
    let res = b.if_else(
        is0,
        |b| {
            // rows index along dim 0 of a [16, 8] iota, transposed to [8, 16].
            let it = b.iota(DType::I32, &[16, 8], 0);
            vec![b.transpose(it)]
        },
        |b| {
            let it = b.iota(DType::I32, &[1, 128], 1);
            let r = b.reshape(it, &[8, 16]);
            let even = b.binary(BinaryOp::Rem, r, 2);
            let is_even = b.cmp(CmpOp::Eq, even, 0);
            let neg = b.unary(UnaryOp::Neg, r);
            vec![b.select(is_even, r, neg)]
        },
    );
    b.store(o, &[], res[0]);
    let kern = b.finish().unwrap();
    let out = interp::run(&kern, &[]).unwrap();
    let got = out[0].as_i32().unwrap();
    for i in 0..8 {
        for j in 0..16 {
            assert_eq!(got[i * 16 + j], j as i32);
            let flat = (i * 16 + j) as i32;
            assert_eq!(got[128 + i * 16 + j], if flat % 2 == 0 { flat } else { -flat });
        }
    }
}

#[test]
fn nan_semantics_of_max_min_and_compares() {
    let mut b = KernelBuilder::new("nan");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::F32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    let y = b.input("y", DType::F32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    let mx = b.output("mx", DType::F32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    let mn = b.output("mn", DType::F32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    // Masks are stored as i32 (no bool memory: Mosaic has no i1 memrefs).
    let ne = b.output("ne", DType::I32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    let lt = b.output("lt", DType::I32, &[1, 4], spec(&[1, 4], vec![0.into(), 0.into()]));
    let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
    let v = b.max(xv, yv);
    b.store(mx, &[], v);
    let v = b.min(xv, yv);
    b.store(mn, &[], v);
    let v = b.cmp(CmpOp::Ne, xv, yv);
    let v = b.cast(v, DType::I32);
    b.store(ne, &[], v);
    let v = b.cmp(CmpOp::Lt, xv, yv);
    let v = b.cast(v, DType::I32);
    b.store(lt, &[], v);
    let kern = b.finish().unwrap();
    let xs = Array::from_f32(&[1, 4], vec![f32::NAN, 1.0, 2.0, f32::NAN]);
    let ys = Array::from_f32(&[1, 4], vec![1.0, f32::NAN, 3.0, f32::NAN]);
    let out = interp::run(&kern, &[&xs, &ys]).unwrap();
    let (mx, mn) = (out[0].as_f32().unwrap(), out[1].as_f32().unwrap());
    assert!(mx[0].is_nan() && mx[1].is_nan() && mx[2] == 3.0 && mx[3].is_nan());
    assert!(mn[0].is_nan() && mn[1].is_nan() && mn[2] == 2.0 && mn[3].is_nan());
    // IEEE: `ne` is true when either side is NaN; every other comparison is false.
    assert_eq!(out[2].as_i32().unwrap(), &[1, 1, 1, 1]);
    assert_eq!(out[3].as_i32().unwrap(), &[0, 0, 1, 0]);
}

/// out block i = x block perm[i] (a gather driven by scalar prefetch).
fn gather_kernel(nblocks: usize) -> Kernel {
    let mut b = KernelBuilder::new("gather");
    b.grid(&[(nblocks, PAR)]);
    let perm = b.prefetch("perm", &[nblocks]);
    let x = b.input("x", DType::F32, &[nblocks * 8, 128], spec(&[8, 128], vec![IndexExpr::Prefetch { array: perm, index: vec![g(0)] }, 0.into()]));
    let o = b.output("o", DType::F32, &[nblocks * 8, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let v = b.load(x, &[]);
    // Also read the table from the body (SMEM scalar load) and add it.
    let pid = b.program_id(0);
    let p = b.load(perm, &[ds(pid, 1)]);
    let pf = b.cast(p, DType::F32);
    let s = b.add(v, pf);
    b.store(o, &[], s);
    b.finish().unwrap()
}

#[test]
fn prefetch_driven_index_map() {
    let kern = gather_kernel(4);
    let perm = Array::from_i32(&[4], vec![2, 0, 3, 2]);
    let xs = values(32 * 128, 11);
    let (out, stats) = interp::run_with_stats(&kern, &[&perm, &Array::from_f32(&[32, 128], xs.clone())]).unwrap();
    assert_eq!(stats.block_loads, 4);
    let got = out[0].as_f32().unwrap();
    for (i, &p) in [2usize, 0, 3, 2].iter().enumerate() {
        for e in 0..8 * 128 {
            assert_eq!(got[i * 1024 + e], xs[p * 1024 + e] + p as f32);
        }
    }
}

#[test]
fn input_block_is_reloaded_only_when_its_index_changes() {
    let kern = gather_kernel(4);
    let perm = Array::from_i32(&[4], vec![1, 1, 1, 0]);
    let x = Array::from_f32(&[32, 128], values(32 * 128, 12));
    let (_, stats) = interp::run_with_stats(&kern, &[&perm, &x]).unwrap();
    assert_eq!(stats.block_loads, 2);
}

#[test]
fn error_block_index_out_of_bounds_from_prefetch() {
    let kern = gather_kernel(4);
    let perm = Array::from_i32(&[4], vec![0, 1, 4, 2]);
    let e = interp::run(&kern, &[&perm, &Array::from_f32(&[32, 128], values(32 * 128, 13))]).unwrap_err();
    assert_eq!(e.rule, "index-out-of-bounds");
    assert!(e.subject.contains("`x`"), "{e}");
    assert!(e.message.contains("[2]") && e.message.contains("[4, 0]"), "{e}");
}

#[test]
fn error_prefetch_read_out_of_range() {
    let mut b = KernelBuilder::new("bad_prefetch");
    b.grid(&[(4, PAR)]);
    let perm = b.prefetch("perm", &[3]);
    let x = b.input("x", DType::F32, &[32, 128], spec(&[8, 128], vec![IndexExpr::Prefetch { array: perm, index: vec![g(0)] }, 0.into()]));
    let o = b.output("o", DType::F32, &[32, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    let kern = b.finish().unwrap();
    let e = interp::run(&kern, &[&Array::from_i32(&[3], vec![0, 1, 2]), &Array::zeros(DType::F32, &[32, 128])]).unwrap_err();
    assert_eq!(e.rule, "prefetch-out-of-bounds", "{e}");
}

#[test]
fn error_dynamic_slice_out_of_bounds() {
    let mut b = KernelBuilder::new("slice_oob");
    b.grid(&[(2, PAR)]);
    let x = b.input("x", DType::F32, &[8, 256], spec(&[8, 256], vec![0.into(), 0.into()]));
    let o = b.output("o", DType::F32, &[8, 256], spec(&[8, 128], vec![0.into(), g(0)]));
    let pid = b.program_id(0);
    let start = b.mul(pid, 256); // 0 then 256 (aligned, as TPUs need): 256 + 128 > 256
    b.at("kernel.rs", 42, 7);
    let v = b.load(x, &[Index::Full, ds(start, 128)]);
    b.store(o, &[], v);
    let kern = b.finish().unwrap();
    let e = interp::run(&kern, &[&Array::zeros(DType::F32, &[8, 256])]).unwrap_err();
    assert_eq!(e.rule, "slice-out-of-bounds");
    assert!(e.message.contains("256..384"), "{e}");
    assert_eq!(e.loc.as_ref().map(|l| l.line), Some(42));
    assert!(e.to_string().contains("kernel.rs:42:7"));
}

#[test]
fn error_wrong_arguments() {
    let kern = matmul(32, 128, 128, (16, 128, 128), DType::F32);
    let x = Array::zeros(DType::F32, &[32, 128]);
    let bad = Array::zeros(DType::F32, &[64, 128]);
    let e = interp::run(&kern, &[&x, &bad]).unwrap_err();
    assert_eq!(e.rule, "argument-shape");
    assert!(e.subject.contains("`y`") && e.message.contains("[128, 128]"), "{e}");

    let wrong_dtype = Array::zeros(DType::BF16, &[128, 128]);
    let e = interp::run(&kern, &[&x, &wrong_dtype]).unwrap_err();
    assert_eq!(e.rule, "argument-dtype");

    let e = interp::run(&kern, &[&x]).unwrap_err();
    assert_eq!(e.rule, "argument-count");

    // Inconsistent data length behind a correct-looking shape: an error, not a panic.
    let lying = Array { dtype: DType::F32, shape: vec![128, 128], data: Data::F32(vec![0.0; 5]) };
    let e = interp::run(&kern, &[&x, &lying]).unwrap_err();
    assert_eq!(e.rule, "argument-shape");
}

#[test]
fn output_block_never_written_stays_nan() {
    let mut b = KernelBuilder::new("partial");
    b.grid(&[(2, PAR)]);
    let x = b.input("x", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let o = b.output("o", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let pid = b.program_id(0);
    let is0 = b.cmp(CmpOp::Eq, pid, 0);
    b.when(is0, |b| {
        let v = b.load(x, &[]);
        b.store(o, &[], v);
    });
    let kern = b.finish().unwrap();
    let xs = values(16 * 128, 14);
    let out = interp::run(&kern, &[&Array::from_f32(&[16, 128], xs.clone())]).unwrap();
    let got = out[0].as_f32().unwrap();
    assert_eq!(&got[..1024], &xs[..1024]);
    assert!(got[1024..].iter().all(|v| v.is_nan()));
}

#[test]
fn reading_an_output_before_writing_it_gives_nan() {
    // o += x, without initialising o: output windows are never loaded from HBM.
    let mut b = KernelBuilder::new("read_output");
    b.grid(&[(2, PAR)]);
    let x = b.input("x", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let o = b.output("o", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), 0.into()]));
    let cur = b.load(o, &[]);
    let v = b.load(x, &[]);
    let s = b.add(cur, v);
    b.store(o, &[], s);
    let kern = b.finish().unwrap();
    let out = interp::run(&kern, &[&Array::from_f32(&[16, 128], values(16 * 128, 15))]).unwrap();
    assert!(out[0].as_f32().unwrap().iter().all(|v| v.is_nan()));
}

#[test]
fn squeezed_block_dims_are_dropped_from_the_view() {
    // x: [4, 8, 128] with block (None, 8, 128): the body sees [8, 128] slabs.
    let mut b = KernelBuilder::new("squeeze");
    b.grid(&[(4, PAR)]);
    let bs = BlockSpec { block_shape: vec![None, Some(8), Some(128)], index_map: vec![g(0), 0.into(), 0.into()] };
    let x = b.input("x", DType::F32, &[4, 8, 128], bs.clone());
    let o = b.output("o", DType::F32, &[4, 8, 128], bs);
    let v = b.load(x, &[]);
    assert_eq!(b.ty(v).shape, vec![8, 128]);
    let pid = b.program_id(0);
    let pf = b.cast(pid, DType::F32);
    let s = b.mul(v, pf);
    b.store(o, &[], s);
    let kern = b.finish().unwrap();
    let xs = values(4 * 1024, 16);
    let out = interp::run(&kern, &[&Array::from_f32(&[4, 8, 128], xs.clone())]).unwrap();
    let want: Vec<f64> = xs.iter().enumerate().map(|(i, &v)| (v * (i / 1024) as f32) as f64).collect();
    assert_close(out[0].as_f32().unwrap(), &want, 0.0);
}

/// `cargo test --release -p tessera-dsl --test interp -- --ignored --nocapture matmul_1024`
#[test]
#[ignore = "timing; run in release"]
fn matmul_1024_f32_timing() {
    let n = 1024;
    let kern = matmul(n, n, n, (128, 128, 128), DType::F32);
    let (xs, ys) = (values(n * n, 17), values(n * n, 18));
    let (x, y) = (Array::from_f32(&[n, n], xs.clone()), Array::from_f32(&[n, n], ys.clone()));
    let mut best = f64::MAX;
    for _ in 0..3 {
        let (out, stats) = interp::run_with_stats(&kern, &[&x, &y]).unwrap();
        best = best.min(stats.elapsed.as_secs_f64());
        assert_eq!(stats.grid_steps, 512);
        // Spot-check a few entries against f64.
        let got = out[0].as_f32().unwrap();
        for &(i, j) in &[(0, 0), (517, 3), (1023, 1023)] {
            let want: f64 = (0..n).map(|p| xs[i * n + p] as f64 * ys[p * n + j] as f64).sum();
            assert!((got[i * n + j] as f64 - want).abs() < 1e-3);
        }
    }
    println!("matmul 1024^3 f32, 128^3 blocks, 512 grid steps: best of 3 = {:.3} s", best);
}

/// What libtpu compiles and the builder now allows (rulebook `block-shape`, `iota-dtype`,
/// `dtype-mismatch`): a block larger than its array, an int8 iota and a mixed bf16 x f32
/// dot, each with the meaning the interpreter's module doc gives it.
#[test]
fn blocks_past_small_arrays_int8_iotas_and_mixed_dots() {
    // out = x + iota(i8) over an [8, 128] array in a [16, 128] block: rows 8.. are padding.
    let mut b = KernelBuilder::new("small");
    b.grid(&[(1, PAR)]);
    let x = b.input("x", DType::I32, &[8, 128], spec(&[16, 128], vec![g(0), 0.into()]));
    let o = b.output("out", DType::I32, &[8, 128], spec(&[16, 128], vec![g(0), 0.into()]));
    let v = b.load(x, &[]);
    let i = b.iota(DType::I8, &[16, 128], 1);
    let i = b.cast(i, DType::I32);
    let v = b.add(v, i);
    b.store(o, &[], v);
    let k = b.finish().unwrap();
    verify(&k, &Target::V5E).unwrap();
    let xs: Vec<i32> = (0..8 * 128).map(|e| e as i32).collect();
    let out = interp::run(&k, &[&Array::from_i32(&[8, 128], xs.clone())]).unwrap();
    let Data::I32(got) = &out[0].data else { panic!("i32 output") };
    for (e, (&g, &x)) in got.iter().zip(&xs).enumerate() {
        let lane = (e % 128) as i32;
        assert_eq!(g, x + lane as i8 as i32, "element {e}: an i8 iota wraps past 127");
    }

    // A bf16 x f32 dot promotes the bf16 operand exactly and multiplies in f32.
    let mut b = KernelBuilder::new("mixed_dot");
    b.grid(&[(1, PAR)]);
    let z = || vec![IndexExpr::Const(0), IndexExpr::Const(0)];
    let a = b.input("a", DType::BF16, &[8, 128], spec(&[8, 128], z()));
    let w = b.input("w", DType::F32, &[128, 128], spec(&[128, 128], z()));
    let o = b.output("out", DType::F32, &[8, 128], spec(&[8, 128], z()));
    let (av, wv) = (b.load(a, &[]), b.load(w, &[]));
    let p = b.dot(av, wv, false, false);
    b.store(o, &[], p);
    let k = b.finish().unwrap();
    verify(&k, &Target::V6E).unwrap();
    let av: Vec<bf16> = values(8 * 128, 1).iter().map(|&v| bf16::from_f32(v)).collect();
    let wv = values(128 * 128, 2);
    let out = interp::run(&k, &[&Array::from_bf16(&[8, 128], av.clone()), &Array::from_f32(&[128, 128], wv.clone())]).unwrap();
    let want: Vec<f64> = (0..8 * 128).map(|e| (0..128).map(|p| av[e / 128 * 128 + p].to_f64() * wv[p * 128 + e % 128] as f64).sum()).collect();
    assert_close(out[0].as_f32().unwrap(), &want, 1e-5);
}

/// `Kernel::without_output`: an output no instruction touches leaves the kernel and the refs
/// after it (another output, scratch) are renumbered, so the kernel still computes the same
/// values; an output that is written, an input or an unknown name is refused.
#[test]
fn an_unwritten_output_is_removed_and_the_refs_after_it_renumbered() {
    let build = |write_unused: bool| {
        let mut b = KernelBuilder::new("two_outputs");
        b.grid(&[(2, ARB)]);
        let x = b.input("x", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), IndexExpr::Const(0)]));
        let unused = b.output("unused", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), IndexExpr::Const(0)]));
        let y = b.output("y", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), IndexExpr::Const(0)]));
        let acc = b.scratch("acc", DType::F32, &[8, 128], MemorySpace::Vmem);
        let v = b.load(x, &[]);
        let doubled = b.mul(v, 2.0);
        b.store(acc, &[], doubled);
        if write_unused {
            b.store(unused, &[], v);
        }
        let back = b.load(acc, &[]);
        let out = b.add(back, 1.0);
        b.store(y, &[], out);
        b.finish().unwrap()
    };
    let k = build(false).without_output("unused").expect("nothing touches `unused`");
    verify(&k, &Target::V5E).unwrap();
    let names: Vec<&str> = k.refs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["x", "y", "acc"]);
    let xs = values(16 * 128, 3);
    let out = interp::run(&k, &[&Array::from_f32(&[16, 128], xs.clone())]).unwrap();
    assert_eq!(out.len(), 1);
    let want: Vec<f64> = xs.iter().map(|&v| (v * 2.0 + 1.0) as f64).collect();
    assert_close(out[0].as_f32().unwrap(), &want, 0.0);
    assert!(build(true).without_output("unused").is_none(), "a written output stays");
    assert!(build(false).without_output("x").is_none(), "an input is not an output");
    assert!(build(false).without_output("nope").is_none());
}
