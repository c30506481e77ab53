//! The fusion engine's anchors (`tessera_kernels::fusion::anchor`): matmuls with fused
//! epilogues and the copies between rows (transpose, gather views, cat), against an
//! independent f64 reference written here, on every CPU backend; every generated kernel
//! lowers to Mosaic on v5e, v6e and tpu7x (and, with `TESSERA_TPU_ORACLE=1`, compiles with
//! libtpu).
//!
//! The reference computes each node in f64 from its operands and rounds to the node's
//! dtype (a matmul: the exact sum of products of its operands, plus the bias, rounded
//! once, as torch's `addmm`). Tolerance: f32 `1e-4`, bf16 `2^-6` of the output's largest
//! magnitude.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_codegen::cpu::Backend;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target};
use tessera_kernels::fusion::{Binary, Graph, NodeId, NodeOp, Operand, Program, RowOp, Unary};

#[derive(Clone, Debug)]
struct T {
    shape: Vec<usize>,
    v: Vec<f64>,
}

fn round(x: f64, d: DType) -> f64 {
    match d {
        DType::F32 => x as f32 as f64,
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

fn unravel(mut f: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = f % shape[d];
        f /= shape[d];
    }
    idx
}

/// Element `idx` of `out` read from `t` broadcast to `out` (right-aligned).
fn bcast(t: &T, out: &[usize], idx: &[usize]) -> f64 {
    let pad = out.len() - t.shape.len();
    let mut off = 0;
    for (d, &n) in t.shape.iter().enumerate() {
        off = off * n + if n == 1 { 0 } else { idx[d + pad] };
    }
    t.v[off]
}

fn reference(g: &Graph, inputs: &[T]) -> Vec<T> {
    let mut vals: Vec<T> = Vec::new();
    for n in &g.nodes {
        let arg = |k: usize| match n.args[k] {
            Operand::Node(id) => vals[id].clone(),
            Operand::Scalar(x) => T { shape: vec![], v: vec![x] },
        };
        let count: usize = n.shape.iter().product();
        let map = |f: &dyn Fn(&[f64]) -> f64| -> T {
            let args: Vec<T> = (0..n.args.len()).map(arg).collect();
            let v = (0..count)
                .map(|i| {
                    let idx = unravel(i, &n.shape);
                    let xs: Vec<f64> = args.iter().map(|t| bcast(t, &n.shape, &idx)).collect();
                    round(f(&xs), n.dtype)
                })
                .collect();
            T { shape: n.shape.clone(), v }
        };
        let t = match &n.op {
            NodeOp::Input(i) => inputs[*i].clone(),
            NodeOp::View => T { shape: n.shape.clone(), v: arg(0).v },
            NodeOp::Unary(op) => map(&|x: &[f64]| {
                let x = x[0];
                match op {
                    Unary::Neg => -x,
                    Unary::Relu => x.max(0.0),
                    Unary::Silu => x / (1.0 + (-x).exp()),
                    Unary::Gelu => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
                    Unary::Tanh => x.tanh(),
                    Unary::Exp => x.exp(),
                    Unary::Rsqrt => 1.0 / x.sqrt(),
                    other => unimplemented!("{other:?}"),
                }
            }),
            NodeOp::Binary(op) => {
                let common = g.common_dtype(&n.args);
                let args: Vec<T> = (0..2).map(|k| {
                    let mut t = arg(k);
                    if matches!(n.args[k], Operand::Node(_)) {
                        t.v.iter_mut().for_each(|x| *x = round(*x, common));
                    }
                    t
                }).collect();
                let v = (0..count)
                    .map(|i| {
                        let idx = unravel(i, &n.shape);
                        let (a, b) = (bcast(&args[0], &n.shape, &idx), bcast(&args[1], &n.shape, &idx));
                        round(
                            match op {
                                Binary::Add => a + b,
                                Binary::Sub => a - b,
                                Binary::Mul => a * b,
                                Binary::Div => a / b,
                                other => unimplemented!("{other:?}"),
                            },
                            n.dtype,
                        )
                    })
                    .collect();
                T { shape: n.shape.clone(), v }
            }
            NodeOp::Cast(_) => map(&|x: &[f64]| x[0]),
            NodeOp::Expand => map(&|x: &[f64]| x[0]),
            NodeOp::Row(RowOp::Softmax) => {
                let x = arg(0);
                let c = *x.shape.last().unwrap();
                let mut v = Vec::new();
                for row in x.v.chunks(c) {
                    let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let s: f64 = row.iter().map(|y| (y - mx).exp()).sum();
                    v.extend(row.iter().map(|y| round((y - mx).exp() / s, n.dtype)));
                }
                T { shape: n.shape.clone(), v }
            }
            NodeOp::Matmul { transpose_a, transpose_b, repeat } => {
                let (a, b) = (arg(0), arg(1));
                let r = n.shape.len();
                let (m, nn) = (n.shape[r - 2], n.shape[r - 1]);
                let k = if *transpose_a { a.shape[a.shape.len() - 2] } else { a.shape[a.shape.len() - 1] };
                let batch: usize = n.shape[..r - 2].iter().product();
                let (ba, bb): (usize, usize) = (a.shape[..a.shape.len() - 2].iter().product(), b.shape[..b.shape.len() - 2].iter().product());
                let bias = (n.args.len() == 3).then(|| arg(2));
                let mut v = Vec::with_capacity(count);
                for bi in 0..batch {
                    let (oa, ob) = (if ba == 1 { 0 } else { bi / repeat[0] * m * k }, if bb == 1 { 0 } else { bi / repeat[1] * k * nn });
                    for i in 0..m {
                        for j in 0..nn {
                            let mut s = 0.0;
                            for p in 0..k {
                                let x = if *transpose_a { a.v[oa + p * m + i] } else { a.v[oa + i * k + p] };
                                let y = if *transpose_b { b.v[ob + j * k + p] } else { b.v[ob + p * nn + j] };
                                s += x * y;
                            }
                            if let Some(c) = &bias {
                                s += c.v[j];
                            }
                            v.push(round(s, n.dtype));
                        }
                    }
                }
                T { shape: n.shape.clone(), v }
            }
            NodeOp::Transpose => {
                let x = arg(0);
                let r = x.shape.len();
                let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
                let mut v = vec![0.0; count];
                for (f, &y) in x.v.iter().enumerate() {
                    let (b, i, j) = (f / (rows * cols), (f / cols) % rows, f % cols);
                    v[b * rows * cols + j * rows + i] = y;
                }
                T { shape: n.shape.clone(), v }
            }
            NodeOp::Gather(gt) => {
                let x = arg(0);
                let r = n.shape.len();
                let v = (0..count)
                    .map(|f| {
                        let idx = unravel(f, &n.shape);
                        let mut sidx: Vec<usize> = gt.start.clone();
                        for (i, w) in gt.walks.iter().enumerate() {
                            if let Some(q) = w {
                                sidx[*q] += idx[i];
                            }
                        }
                        sidx.push(gt.col_start + idx[r - 1]);
                        let mut off = 0;
                        for (d, &s) in x.shape.iter().enumerate() {
                            off = off * s + sidx[d];
                        }
                        x.v[off]
                    })
                    .collect();
                T { shape: n.shape.clone(), v }
            }
            NodeOp::CatCols => {
                let pieces: Vec<T> = (0..n.args.len()).map(arg).collect();
                let cols = *n.shape.last().unwrap();
                let rows = count / cols;
                let mut v = Vec::with_capacity(count);
                for row in 0..rows {
                    for p in &pieces {
                        let c = *p.shape.last().unwrap();
                        v.extend_from_slice(&p.v[row * c..(row + 1) * c]);
                    }
                }
                T { shape: n.shape.clone(), v }
            }
            other => unimplemented!("{other:?}"),
        };
        vals.push(t);
    }
    vals
}

fn backends() -> Vec<Backend> {
    Backend::ALL.into_iter().filter(|b| b.available()).collect()
}

struct Case {
    name: String,
    graph: Graph,
    live: Vec<NodeId>,
    inputs: Vec<Array>,
}

impl Case {
    fn new(name: impl Into<String>) -> Case {
        Case { name: name.into(), graph: Graph::new(), live: vec![], inputs: vec![] }
    }

    fn input(&mut self, dtype: DType, shape: &[usize], rng: &mut StdRng) -> NodeId {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        self.inputs.push(Array::from_f32_in(dtype, shape, v));
        self.graph.input(dtype, shape).unwrap()
    }

    /// Builds, runs on every backend and compares with the reference; returns the program.
    fn check(&self) -> Program {
        let program = Program::build(&self.graph, &self.live, &Target::V5E).unwrap_or_else(|e| panic!("{}: {e}\n{}", self.name, self.graph));
        let ins: Vec<T> = self.inputs.iter().map(|a| T { shape: a.shape.clone(), v: a.to_f64_vec() }).collect();
        let want = reference(&self.graph, &ins);
        let refs: Vec<&Array> = self.inputs.iter().collect();
        for b in backends() {
            let outs = program.run(b.executor(), &refs).unwrap_or_else(|e| panic!("{} on {b}: {e}\n{}", self.name, program.describe()));
            for (&l, got) in self.live.iter().zip(&outs) {
                let w = &want[l];
                // A bf16 value anywhere upstream rounds differently after a last-bit f32 difference.
                let tol = if self.graph.nodes.iter().any(|n| n.dtype == DType::BF16) { 1.0 / 64.0 } else { 1e-4 };
                let scale = w.v.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                for (i, (g_, w_)) in got.to_f64_vec().iter().zip(&w.v).enumerate() {
                    assert!((g_ - w_).abs() <= tol * scale, "{} on {b}: node %{l}[{i}] = {g_}, want {w_}\n{}", self.name, program.describe());
                }
            }
        }
        program
    }
}

/// A random matmul (`m, k, n` from a set with non-multiples, transposed operands, batched or
/// not, a bias or not) and a random epilogue chain.
fn random_matmul(seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let dims = [8, 16, 77, 96, 128, 200, 256];
    let (m, k, n) = (dims[rng.gen_range(0..dims.len())], dims[rng.gen_range(0..dims.len())], dims[rng.gen_range(0..dims.len())]);
    let dtype = if rng.gen_bool(0.5) { DType::F32 } else { DType::BF16 };
    let batch: Vec<usize> = match rng.gen_range(0..3) {
        0 => vec![],
        1 => vec![3],
        _ => vec![2, 2],
    };
    let (ta, tb) = (rng.gen_bool(0.3), rng.gen_bool(0.4));
    let shared_b = !batch.is_empty() && rng.gen_bool(0.3);
    let mut c = Case::new(format!("seed {seed}: {dtype} batch {batch:?} m {m} k {k} n {n} ta {ta} tb {tb} shared_b {shared_b}"));
    let with = |lead: &[usize], r: usize, cc: usize| lead.iter().copied().chain([r, cc]).collect::<Vec<_>>();
    let a = c.input(dtype, &with(&batch, if ta { k } else { m }, if ta { m } else { k }), &mut rng);
    let b = c.input(dtype, &with(if shared_b { &[] } else { &batch }, if tb { n } else { k }, if tb { k } else { n }), &mut rng);
    let a = if ta { c.graph.transpose(a).unwrap() } else { a };
    let b = if tb { c.graph.transpose(b).unwrap() } else { b };
    let bias = (batch.is_empty() && rng.gen_bool(0.5)).then(|| c.input(dtype, &[n], &mut rng));
    let mut y = c.graph.matmul(a, b, bias).unwrap();
    let out_shape = c.graph.node(y).shape.clone();
    for _ in 0..rng.gen_range(0..4) {
        y = match rng.gen_range(0..6) {
            0 => c.graph.unary(Unary::Silu, y).unwrap(),
            1 => c.graph.unary(Unary::Gelu, y).unwrap(),
            2 => {
                let r = c.input(dtype, &out_shape, &mut rng);
                c.graph.binary(Binary::Add, Operand::Node(y), Operand::Node(r)).unwrap()
            }
            3 => {
                let w = c.input(DType::F32, &[n], &mut rng);
                c.graph.binary(Binary::Mul, Operand::Node(y), Operand::Node(w)).unwrap()
            }
            4 => c.graph.binary(Binary::Div, Operand::Node(y), Operand::Scalar(3.0)).unwrap(),
            _ => c.graph.cast(y, if dtype == DType::F32 { DType::BF16 } else { DType::F32 }).unwrap(),
        };
    }
    c.live = vec![y];
    c
}

#[test]
fn random_matmuls_with_epilogues_match_the_f64_reference_in_one_kernel() {
    let cases: u64 = std::env::var("TESSERA_FUSION_MATMUL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    for seed in 0..cases {
        let c = random_matmul(seed);
        let p = c.check();
        assert_eq!(p.launches.len(), 1, "{}: the epilogue fuses into the matmul\n{}", c.name, p.describe());
    }
}

#[test]
fn a_long_contraction_accumulates_over_k_blocks() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(3);
        let mut c = Case::new(format!("k blocks {dtype}"));
        let x = c.input(dtype, &[64, 1536], &mut rng);
        let w = c.input(dtype, &[256, 1536], &mut rng);
        let wt = c.graph.transpose(w).unwrap();
        let y = c.graph.matmul(x, wt, None).unwrap();
        let s = c.graph.unary(Unary::Silu, y).unwrap();
        c.live = vec![s, y];
        let p = c.check();
        assert_eq!(p.launches.len(), 1);
        assert!(p.launches[0].kernel.grid[3].extent > 1, "{}", p.describe());
        assert!(p.temps.is_empty(), "the transposed weight is read in place, not copied");
    }
}

#[test]
fn epilogue_boundaries_are_where_the_rules_say() {
    for (n, kernels) in [(256, 2), (1024, 3)] {
        let mut rng = StdRng::seed_from_u64(4);
        let mut c = Case::new(format!("boundaries n {n}"));
        let x = c.input(DType::F32, &[2, 64, 128], &mut rng);
        let w = c.input(DType::F32, &[128, n], &mut rng);
        let y = c.graph.matmul(x, w, None).unwrap();
        // A [64, n] mask shared by both batches, then a row op over n: in the epilogue
        // when n is one column block, a kernel of its own when n is tiled.
        let mask = c.input(DType::F32, &[64, n], &mut rng);
        let t = c.graph.binary(Binary::Add, Operand::Node(y), Operand::Node(mask)).unwrap();
        let s = c.graph.row(RowOp::Softmax, t, true).unwrap();
        // A matmul of the result starts another kernel.
        let w2 = c.input(DType::F32, &[n, 32], &mut rng);
        let z = c.graph.matmul(s, w2, None).unwrap();
        c.live = vec![z];
        let p = c.check();
        assert_eq!(p.launches.len(), kernels, "{}", p.describe());
        assert!(p.partitioning.parts.last().unwrap().cut.contains("matmul"));
        if n > 512 {
            assert!(p.partitioning.parts[1].cut.contains("row op over the matmul's"), "{}", p.partitioning.parts[1].cut);
        }
    }
}

/// The views a transformer block takes: the head split transpose(1, 2) both ways (slab and
/// row copies), a column window and `cat` (rotate_half), select / slice of leading dims,
/// repeat_kv's inner expand, and a standalone transpose.
fn view_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (dtype, d) in [(DType::F32, 128), (DType::BF16, 128), (DType::F32, 48)] {
        let mut rng = StdRng::seed_from_u64(d as u64);
        let (b, s, h) = (2, 16, 4);
        let mut c = Case::new(format!("heads {dtype} d {d}"));
        let x = c.input(dtype, &[b, s, h, d], &mut rng);
        // [b, s, h, d] -> [b, h, s, d]: strides of the view.
        let q = c.graph.strided(x, &[b, h, s, d], &[s * h * d, d, h * d, 1], 0).unwrap();
        assert!(matches!(c.graph.node(q).op, NodeOp::Gather(_)));
        // rotate_half: cat(-x[..., d/2:], x[..., :d/2]).
        let qs = [h * s * d, s * d, d, 1];
        let x1 = c.graph.strided(q, &[b, h, s, d / 2], &qs, 0).unwrap();
        let x2 = c.graph.strided(q, &[b, h, s, d / 2], &qs, d / 2).unwrap();
        let n2 = c.graph.unary(Unary::Neg, x2).unwrap();
        let rot = c.graph.cat_cols(&[n2, x1]).unwrap();
        // Back: [b, h, s, d] -> [b, s, h, d].
        let back = c.graph.strided(rot, &[b, s, h, d], &[h * s * d, d, s * d, 1], 0).unwrap();
        // select(1, 3) and slice(1, 4, 12) of the sequence dim.
        let sel = c.graph.strided(x, &[b, h, d], &[s * h * d, d, 1], 3 * h * d).unwrap();
        let sl = c.graph.strided(x, &[b, 8, h, d], &[s * h * d, h * d, d, 1], 4 * h * d).unwrap();
        // repeat_kv: [b, h, s, d] -> [b, h, 2, s, d] (stride 0).
        let rep = c.graph.strided(q, &[b, h, 2, s, d], &[h * s * d, s * d, 0, d, 1], 0).unwrap();
        let tr = c.graph.transpose(x).unwrap();
        // slice_backward's zeros: a broadcast 0-dim tensor as a piece of a cat.
        let zero = c.input(dtype, &[], &mut rng);
        let zeros = c.graph.expand(zero, &[b, h, s, 8]).unwrap();
        let padded = c.graph.cat_cols(&[zeros, x1, zeros]).unwrap();
        c.live = vec![back, sel, sl, rep, tr, padded];
        out.push(c);
    }
    // HF RoPE: cos and sin `[1, 1, s, d]` over q `[b, h, s, d]` read periodically (s = 20: no
    // multiple of the sublanes divides it, so the operands are stacked), the cat of
    // rotate_half in the same kernel, and the cat's piece computed by the open kernel (`q * 2`:
    // stored first, the cat starts the next kernel).
    for (dtype, s) in [(DType::F32, 24), (DType::BF16, 24), (DType::F32, 20), (DType::BF16, 20)] {
        let mut rng = StdRng::seed_from_u64(s as u64);
        let (b, h, d) = (2, 4, 16);
        let mut c = Case::new(format!("hf rope {dtype} s {s}"));
        let q = c.input(dtype, &[b, h, s, d], &mut rng);
        let cos = c.input(dtype, &[1, 1, s, d], &mut rng);
        let sin = c.input(dtype, &[1, 1, s, d], &mut rng);
        let rope = |c: &mut Case, q: NodeId| {
            let qs = [h * s * d, s * d, d, 1];
            let x1 = c.graph.strided(q, &[b, h, s, d / 2], &qs, 0).unwrap();
            let x2 = c.graph.strided(q, &[b, h, s, d / 2], &qs, d / 2).unwrap();
            let n2 = c.graph.unary(Unary::Neg, x2).unwrap();
            let qc = c.graph.binary(Binary::Mul, Operand::Node(q), Operand::Node(cos)).unwrap();
            let rot = c.graph.cat_cols(&[n2, x1]).unwrap();
            let rs = c.graph.binary(Binary::Mul, Operand::Node(rot), Operand::Node(sin)).unwrap();
            c.graph.binary(Binary::Add, Operand::Node(qc), Operand::Node(rs)).unwrap()
        };
        let y = rope(&mut c, q);
        let q2 = c.graph.binary(Binary::Mul, Operand::Node(q), Operand::Scalar(2.0)).unwrap();
        let y2 = rope(&mut c, q2);
        c.live = vec![y, y2];
        out.push(c);
    }
    out
}

/// Matmuls sharing an operand (rule 13), each with the kernels the rule gives:
/// - a SwiGLU MLP (`silu(x @ w1^T) * (x @ w3^T) @ w2^T`, the projections' outputs live as
///   autograd keeps them): gate and up share `x`, one kernel with their epilogue, then down;
/// - q / k / v projections with the head split's copy between them (`k` and `v` join `q`'s
///   kernel across it, as HF's attention records them);
/// - weight gradients `g1^T @ x`, `g2^T @ x` sharing `x` (b), over several `k` blocks, with a bias;
/// - two products sharing no operand, of one shape, summed (a SwiGLU backward's `dx`);
/// - a second product whose operand the first kernel computes (`(x * 2) @ w` after `x @ w`,
///   `x * 2` in the first's epilogue): not ready before that kernel ends, so it stays apart.
fn sibling_cases() -> Vec<(Case, usize)> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(13);
        let (m, d, f) = (40, 64, 96);
        let mut c = Case::new(format!("swiglu siblings {dtype}"));
        let x = c.input(dtype, &[2, m / 2, d], &mut rng);
        let ws: Vec<NodeId> = [[f, d], [f, d], [d, f]].iter().map(|s| c.input(dtype, s, &mut rng)).collect();
        let wt: Vec<NodeId> = ws.iter().map(|&w| c.graph.transpose(w).unwrap()).collect();
        let a = c.graph.matmul(x, wt[0], None).unwrap();
        let s = c.graph.unary(Unary::Silu, a).unwrap();
        let b = c.graph.matmul(x, wt[1], None).unwrap();
        let h = c.graph.binary(Binary::Mul, Operand::Node(s), Operand::Node(b)).unwrap();
        let y = c.graph.matmul(h, wt[2], None).unwrap();
        c.live = vec![y, a, b, h];
        out.push((c, 2));

        let mut c = Case::new(format!("qkv siblings across the head split {dtype}"));
        let (bsz, seq, heads, hd) = (2, 16, 2, 32);
        let x = c.input(dtype, &[bsz, seq, heads * hd], &mut rng);
        let mut outs = Vec::new();
        for _ in 0..3 {
            let w = c.input(dtype, &[heads * hd, heads * hd], &mut rng);
            let wt = c.graph.transpose(w).unwrap();
            let p = c.graph.matmul(x, wt, None).unwrap();
            // [b, s, h, hd] -> [b, h, s, hd]: a copy kernel between the projections.
            let split = c.graph.strided(p, &[bsz, heads, seq, hd], &[seq * heads * hd, hd, heads * hd, 1], 0).unwrap();
            outs.push(c.graph.binary(Binary::Mul, Operand::Node(split), Operand::Scalar(0.5)).unwrap());
        }
        c.live = outs;
        // One projection kernel, then per head split a copy and a row kernel.
        out.push((c, 7));

        let mut c = Case::new(format!("weight-gradient siblings over k blocks {dtype}"));
        let (tokens, n_out, n_in) = (1536, 64, 128);
        let x = c.input(dtype, &[tokens, n_in], &mut rng);
        let mut outs = Vec::new();
        for _ in 0..2 {
            let g = c.input(dtype, &[tokens, n_out], &mut rng);
            let gt = c.graph.transpose(g).unwrap();
            let bias = c.input(dtype, &[n_in], &mut rng);
            let dw = c.graph.matmul(gt, x, Some(bias)).unwrap();
            outs.push(c.graph.unary(Unary::Neg, dw).unwrap());
        }
        c.live = outs;
        out.push((c, 1));

        let mut c = Case::new(format!("independent products of one shape, summed {dtype}"));
        // A SwiGLU backward's `dx = g_gate @ w1 + g_up @ w3`: no operand shared, both ready,
        // over several k blocks; the sum is their epilogue.
        let (tokens, f, d) = (48, 1024, 64);
        let gs: Vec<NodeId> = (0..2).map(|_| c.input(dtype, &[tokens, f], &mut rng)).collect();
        let ws: Vec<NodeId> = (0..2).map(|_| c.input(dtype, &[f, d], &mut rng)).collect();
        let y1 = c.graph.matmul(gs[0], ws[0], None).unwrap();
        let y2 = c.graph.matmul(gs[1], ws[1], None).unwrap();
        let z = c.graph.binary(Binary::Add, Operand::Node(y1), Operand::Node(y2)).unwrap();
        c.live = vec![z];
        out.push((c, 1));

        let mut c = Case::new(format!("an operand computed after the first product {dtype}"));
        let x = c.input(dtype, &[32, 64], &mut rng);
        let w = c.input(dtype, &[64, 64], &mut rng);
        let y1 = c.graph.matmul(x, w, None).unwrap();
        let x2 = c.graph.binary(Binary::Mul, Operand::Node(x), Operand::Scalar(2.0)).unwrap();
        let y2 = c.graph.matmul(x2, w, None).unwrap();
        let z = c.graph.binary(Binary::Add, Operand::Node(y1), Operand::Node(y2)).unwrap();
        c.live = vec![z];
        // `x * 2` joins the first product's epilogue, so the second product starts a kernel.
        out.push((c, 2));
    }
    out
}

#[test]
fn matmuls_sharing_an_operand_are_one_kernel() {
    for (c, kernels) in sibling_cases() {
        let p = c.check();
        assert_eq!(p.launches.len(), kernels, "{}\n{}", c.name, p.describe());
        let joined: usize = p.partitioning.parts.iter().map(|part| part.siblings.len()).sum();
        let matmuls = c.graph.nodes.iter().filter(|n| matches!(n.op, NodeOp::Matmul { .. })).count();
        let anchors = p.partitioning.parts.iter().filter(|part| part.anchor.is_some_and(|a| matches!(c.graph.node(a).op, NodeOp::Matmul { .. }))).count();
        assert_eq!(anchors + joined, matmuls, "{}: every matmul is an anchor or a sibling", c.name);
    }
}

#[test]
fn hf_rope_reads_cos_periodically_and_fuses_its_cat() {
    for c in view_cases().into_iter().filter(|c| c.name.starts_with("hf rope")) {
        let p = c.check();
        assert_eq!(p.launches.len(), 2, "{}: rope of q, q * 2 and q * 2 * cos; the cat of q * 2's halves (read from memory) and the rest\n{}", c.name, p.describe());
        let stacked = p.launches.iter().any(|l| l.kernel.refs.iter().any(|r| r.shape.len() == 3 && r.block.as_ref().is_some_and(|b| b.block_shape[0].is_none())));
        assert_eq!(stacked, c.name.ends_with("s 20"), "{}: stacked operands only where no sublane multiple divides s\n{}", c.name, p.describe());
    }
}

#[test]
fn transformer_views_copy_the_right_elements() {
    for c in view_cases() {
        let p = c.check();
        assert!(p.launches.iter().all(|l| !l.outputs.is_empty()));
    }
}

#[test]
fn refusals_name_the_op_operand_and_rule() {
    let mut g = Graph::new();
    let a = g.input(DType::F32, &[4, 8]).unwrap();
    let b = g.input(DType::BF16, &[8, 4]).unwrap();
    let c = g.input(DType::F32, &[9, 4]).unwrap();
    let e = g.matmul(a, b, None).unwrap_err();
    assert!(e.rule == "fusion-dtype" && e.to_string().contains("mat2"), "{e}");
    let e = g.matmul(a, c, None).unwrap_err();
    assert!(e.rule == "fusion-shape" && e.to_string().contains("contracting"), "{e}");
    let x = g.input(DType::F32, &[4, 8, 16]).unwrap();
    // A view whose last dim is strided (a diagonal) is refused.
    let e = g.strided(x, &[4, 8], &[128, 17], 0).unwrap_err();
    assert_eq!(e.rule, "fusion-strided-view", "{e}");
}

fn every_case() -> Vec<(String, Graph, Vec<NodeId>)> {
    let mut all: Vec<(String, Graph, Vec<NodeId>)> = (0..24).map(random_matmul).map(|c| (c.name, c.graph, c.live)).collect();
    all.extend(view_cases().into_iter().map(|c| (c.name, c.graph, c.live)));
    all.extend(sibling_cases().into_iter().map(|(c, _)| (c.name, c.graph, c.live)));
    all
}

#[test]
fn every_anchor_kernel_lowers_to_mosaic_on_v5e_v6e_tpu7x() {
    let mut kernels = 0;
    for (name, g, live) in every_case() {
        for target in [Target::V5E, Target::V6E, Target::TPU7X] {
            let p = Program::build(&g, &live, &target).unwrap_or_else(|e| panic!("{name} on {}: {e}", target.name));
            for l in &p.launches {
                let lowered = tessera_codegen::lower(&l.kernel, &target).unwrap_or_else(|e| panic!("{name}, {} on {}: {e}\n{}", l.kernel.name, target.name, l.kernel));
                assert!(lowered.mosaic.contains("func.func"));
                kernels += 1;
            }
        }
    }
    assert!(kernels > 80, "{kernels}");
}

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`).
#[test]
fn anchor_kernels_compile_with_libtpu() {
    if !tessera_tests::oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let mut jobs: Vec<(String, String, String)> = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let mut seen = std::collections::HashSet::new();
        for (name, g, live) in every_case() {
            let p = Program::build(&g, &live, &target).unwrap();
            for l in &p.launches {
                let lowered = tessera_codegen::lower(&l.kernel, &target).unwrap_or_else(|e| panic!("{name}: {e}"));
                if seen.insert(lowered.stablehlo.clone()) {
                    jobs.push((format!("{}-{}", name.replace([' ', ':', ',', '[', ']'], "_"), l.kernel.name), target.name.to_string(), lowered.stablehlo));
                }
            }
        }
    }
    tessera_tests::oracle::assert_all_accepted(&jobs);
    eprintln!("{} anchor kernels accepted by libtpu (v5e, v6e, tpu7x)", jobs.len());
}

#[test]
fn a_repeat_kv_operand_is_read_in_place() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(9);
        let mut c = Case::new(format!("repeat_kv {dtype}"));
        let (b, kvh, rep, s, d) = (2, 2, 3, 32, 16);
        let q = c.input(dtype, &[b * kvh * rep, 8, d], &mut rng);
        let k = c.input(dtype, &[b, kvh, s, d], &mut rng);
        // k[:, :, None].expand(b, kvh, rep, s, d).reshape(b * kvh * rep, s, d), transposed.
        let kr = c.graph.strided(k, &[b, kvh, rep, s, d], &[kvh * s * d, s * d, 0, d, 1], 0).unwrap();
        let kr = c.graph.view(kr, &[b * kvh * rep, s, d]).unwrap();
        let kt = c.graph.transpose(kr).unwrap();
        let y = c.graph.matmul(q, kt, None).unwrap();
        assert!(matches!(c.graph.node(y).op, NodeOp::Matmul { transpose_b: true, repeat: [1, 3], .. }), "{}", c.graph);
        c.live = vec![y];
        let p = c.check();
        assert_eq!(p.launches.len(), 1, "{}", p.describe());
        for target in [Target::V5E, Target::V6E, Target::TPU7X] {
            let p = Program::build(&c.graph, &c.live, &target).unwrap();
            tessera_codegen::lower(&p.launches[0].kernel, &target).unwrap();
        }
    }
}

/// A kernel closed by a row-changing view of its value is not sunk into the reader of
/// that view (the reader must load it from memory): the regression of the sinking pass.
#[test]
fn a_value_read_back_through_a_row_changing_view_is_stored() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut c = Case::new("row-changing view");
    let x = c.input(DType::F32, &[192, 1], &mut rng);
    let y = c.input(DType::F32, &[192, 6], &mut rng);
    let a = c.graph.binary(Binary::Mul, Operand::Node(x), Operand::Scalar(2.0)).unwrap();
    let v1 = c.graph.view(a, &[192]).unwrap();
    let v2 = c.graph.view(v1, &[192, 1]).unwrap();
    let e = c.graph.expand(v2, &[192, 6]).unwrap();
    let out = c.graph.binary(Binary::Add, Operand::Node(e), Operand::Node(y)).unwrap();
    c.live = vec![out];
    c.check();
}

/// A pointwise kernel closed by a copy and sunk into its one reader: `x * 2`, then a
/// transpose (a copy kernel), then `x * 2 + t` (reads both): two kernels.
#[test]
fn a_pointwise_kernel_is_sunk_into_its_one_reader() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut c = Case::new("sink");
    let x = c.input(DType::F32, &[64, 32], &mut rng);
    let y = c.input(DType::F32, &[32, 64], &mut rng);
    let x2 = c.graph.binary(Binary::Mul, Operand::Node(x), Operand::Scalar(2.0)).unwrap();
    let t = c.graph.transpose(y).unwrap();
    let out = c.graph.binary(Binary::Add, Operand::Node(x2), Operand::Node(t)).unwrap();
    c.live = vec![out];
    let p = c.check();
    assert_eq!(p.launches.len(), 2, "the transpose, then x * 2 + t\n{}", p.describe());
}

/// Rule 14: a node the last kernel refuses (a copy kernel) joins the nearest earlier
/// kernel it fits, only where its operands are ready: `g * m` reads the second product's
/// value, so it joins that kernel, not the first product's.
#[test]
fn a_node_the_last_kernel_refuses_joins_an_earlier_one_where_its_operands_are_ready() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(17);
        let mut c = Case::new(format!("reach back {dtype}"));
        let (a, w) = (c.input(dtype, &[32, 64], &mut rng), c.input(dtype, &[64, 96], &mut rng));
        let (b, v) = (c.input(dtype, &[32, 48], &mut rng), c.input(dtype, &[48, 96], &mut rng));
        let g = c.graph.matmul(a, w, None).unwrap();
        let m = c.graph.matmul(b, v, None).unwrap();
        let t = c.input(dtype, &[40, 24], &mut rng);
        let copy = c.graph.transpose(t).unwrap();
        let gm = c.graph.binary(Binary::Mul, Operand::Node(g), Operand::Node(m)).unwrap();
        let g3 = c.graph.binary(Binary::Mul, Operand::Node(g), Operand::Scalar(3.0)).unwrap();
        let out = c.graph.binary(Binary::Add, Operand::Node(gm), Operand::Node(g3)).unwrap();
        c.live = vec![copy, out];
        let p = c.check();
        let parts = &p.partitioning.parts;
        assert_eq!(p.launches.len(), 3, "{}", p.describe());
        let home = |n: NodeId| p.partitioning.assigned[n];
        assert_eq!((home(g), home(m), home(copy)), (Some(0), Some(1), Some(2)), "{}", p.describe());
        assert_eq!((home(gm), home(g3), home(out)), (Some(1), Some(1), Some(1)), "the epilogue of the product that computes m\n{}", p.describe());
        assert_eq!(parts[0].outputs, vec![g], "g is stored for the later kernel");
    }
}

/// A rows-keeping view of a column window (`y[10].view(1, n)`, seen as a window of `y`
/// flattened): a row kernel reads it from `y`'s memory, a matmul from the window's copy
/// (found by the random graphs' backward tier: the window was read but never computed).
#[test]
fn a_view_of_a_column_window_is_read_by_row_kernels_and_matmuls() {
    let mut rng = StdRng::seed_from_u64(14);
    let mut c = Case::new("view of a window");
    let x = c.input(DType::F32, &[64, 128], &mut rng);
    let w = c.input(DType::F32, &[128, 8], &mut rng);
    let y = c.graph.binary(Binary::Sub, Operand::Scalar(1.0), Operand::Node(x)).unwrap();
    let row = c.graph.strided(y, &[128], &[1], 10 * 128).unwrap();
    let v = c.graph.view(row, &[1, 128]).unwrap();
    let scaled = c.graph.binary(Binary::Mul, Operand::Node(v), Operand::Scalar(12.0)).unwrap();
    let m = c.graph.matmul(v, w, None).unwrap();
    c.live = vec![y, scaled, m];
    c.check();
}

/// GQA repeat_kv's backward, `[b, hkv, rep, s, d].sum(2)`, as the front-end records a sum
/// over inner dims: `x` viewed `[b * hkv, rep, s * d]`, summed by a `[1, rep]` row of ones
/// (a matmul shared by every batch); checked against the sum over `rep` computed here in
/// f64. (The scaling reads the sum through a row-changing view: its own kernel.)
#[test]
fn a_sum_over_an_inner_dim_is_a_matmul_by_ones() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(13);
        let mut c = Case::new(format!("inner-dim sum {dtype}"));
        let (b, kvh, rep, s, d) = (2, 2, 3, 40, 16);
        let x = c.input(dtype, &[b, kvh, rep, s, d], &mut rng);
        c.inputs.push(Array::from_f32_in(dtype, &[1, rep], vec![1.0; rep]));
        let ones = c.graph.input(dtype, &[1, rep]).unwrap();
        let xv = c.graph.view(x, &[b * kvh, rep, s * d]).unwrap();
        let sum = c.graph.matmul(ones, xv, None).unwrap();
        let sum = c.graph.view(sum, &[b, kvh, s, d]).unwrap();
        let y = c.graph.binary(Binary::Mul, Operand::Node(sum), Operand::Scalar(0.5)).unwrap();
        c.live = vec![y];
        let p = c.check();
        assert_eq!(p.launches.len(), 2, "{}", p.describe());
        let xs = c.inputs[0].to_f64_vec();
        let refs: Vec<&Array> = c.inputs.iter().collect();
        let got = p.run(backends()[0].executor(), &refs).unwrap()[0].to_f64_vec();
        let tol = if dtype == DType::BF16 { 1.0 / 64.0 } else { 1e-5 };
        for g in 0..b * kvh {
            for e in 0..s * d {
                let want: f64 = 0.5 * (0..rep).map(|r| xs[(g * rep + r) * s * d + e]).sum::<f64>();
                let have = got[g * s * d + e];
                assert!((have - want).abs() <= tol * want.abs().max(1.0), "{}: [{g}, {e}] = {have}, want {want}", c.name);
            }
        }
    }
}

/// GQA's `dV = P^T @ dO` per query head, viewed `[b, hkv, rep, s, d]` and summed over `rep`
/// (repeat_kv's backward): one matmul whose contraction runs over the repeats, with no
/// kernel for the per-head products and its epilogue in the same kernel; checked against that sum computed here in f64.
#[test]
fn a_sum_over_matmul_batches_folds_into_the_contraction() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = StdRng::seed_from_u64(14);
        let mut c = Case::new(format!("folded sum {dtype}"));
        let (b, kvh, rep, s, d) = (2, 2, 3, 24, 16);
        let p = c.input(dtype, &[b * kvh * rep, s, s], &mut rng);
        let go = c.input(dtype, &[b * kvh * rep, s, d], &mut rng);
        let pt = c.graph.transpose(p).unwrap();
        let dv = c.graph.matmul(pt, go, None).unwrap();
        let dv = c.graph.view(dv, &[b, kvh, rep, s, d]).unwrap();
        let sum = c.graph.sum_matmul_batches(dv, 2, 2, false).unwrap();
        assert_eq!(c.graph.node(sum).shape, [b, kvh, s, d]);
        let y = c.graph.binary(Binary::Mul, Operand::Node(sum), Operand::Scalar(0.5)).unwrap();
        // dK's form: (dO^T @ P)^T, kept dim, is the same sum.
        let got = c.graph.transpose(go).unwrap();
        let gp = c.graph.matmul(got, p, None).unwrap();
        let gp = c.graph.view(gp, &[b, kvh, rep, d, s]).unwrap();
        let pg = c.graph.transpose(gp).unwrap();
        let sum2 = c.graph.sum_matmul_batches(pg, 2, 2, true).unwrap();
        assert_eq!(c.graph.node(sum2).shape, [b, kvh, 1, s, d]);
        let y2 = c.graph.binary(Binary::Mul, Operand::Node(sum2), Operand::Scalar(0.5)).unwrap();
        c.live = vec![y, y2];
        let prog = c.check();
        assert_eq!(prog.launches.len(), 2, "each folded matmul with its epilogue\n{}", prog.describe());
        let (pv, gv) = (c.inputs[0].to_f64_vec(), c.inputs[1].to_f64_vec());
        let refs: Vec<&Array> = c.inputs.iter().collect();
        let outs = prog.run(backends()[0].executor(), &refs).unwrap();
        let tol = if dtype == DType::BF16 { 1.0 / 32.0 } else { 1e-4 };
        for (got, g) in outs.iter().map(|o| o.to_f64_vec()).flat_map(|o| (0..b * kvh).map(move |g| (o.clone(), g))) {
            for (i, j) in (0..s).flat_map(|i| (0..d).map(move |j| (i, j))) {
                // sum over the repeats r and query rows q of P[g, r][q, i] * dO[g, r][q, j]
                let want: f64 = 0.5 * (0..rep).flat_map(|r| (0..s).map(move |q| (r, q))).map(|(r, q)| pv[((g * rep + r) * s + q) * s + i] * gv[((g * rep + r) * s + q) * d + j]).sum::<f64>();
                let have = got[(g * s + i) * d + j];
                assert!((have - want).abs() <= tol * want.abs().max(1.0), "{}: [{g}, {i}, {j}] = {have}, want {want}", c.name);
            }
        }
    }
    // Dims that are not the matmul's batches are refused with the rule.
    let mut g = Graph::new();
    let x = g.input(DType::F32, &[4, 3, 8]).unwrap();
    let e = g.sum_matmul_batches(x, 1, 1, false).unwrap_err();
    assert!(e.to_string().contains("sum-dim"), "{e}");
}
