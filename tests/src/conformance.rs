//! The conformance suite's machinery, shared by `tests/tests/conformance.rs` and the long
//! fuzz runner (`src/bin/fuzz_backends.rs`): comparing a backend's run with the
//! interpreter's, and a generator of random well-typed kernels.

use std::fmt::Write as _;

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_dsl::interp::{self, Array, Data};
use tessera_dsl::{ds, exec, BlockSpec, CmpOp, DType, Executor, Index, IndexExpr, Kernel, KernelBuilder, MemorySpace, ReduceOp, RefKind, Semantics, Target, Type, UnaryOp, Value};

/// How closely a backend must match the interpreter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Bit for bit (NaNs of any payload are equal).
    Exact,
    /// Float outputs within `max|a - b| <= tol * max(max|b|, 1e-30)` per output; integer
    /// and bool outputs exact; NaN at the same places.
    Scaled(f64),
    /// As `Scaled`, with the scale at least 1: for random programs over O(1) values, where
    /// a sum that cancels leaves an output far smaller than the values that made it.
    Abs(f64),
}

/// Compares one output with the interpreter's; `Err` says where they differ.
pub fn compare(name: &str, got: &Array, want: &Array, tol: Tolerance) -> Result<(), String> {
    if got.dtype != want.dtype || got.shape != want.shape {
        return Err(format!("{name}: {:?}{:?} vs interp {:?}{:?}", got.dtype, got.shape, want.dtype, want.shape));
    }
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let float = got.dtype.is_float();
    let floor = if let Tolerance::Abs(_) = tol { 1.0 } else { 1e-30 };
    let scale = w.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs())).max(floor);
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        if a.is_nan() || b.is_nan() {
            if a.is_nan() != b.is_nan() {
                return Err(format!("{name}[{i}]: {a} vs interp {b} (NaN at different places)"));
            }
            continue;
        }
        // Exact mode tells -0 from +0; otherwise equal values are the same.
        let same = if float && tol != Tolerance::Exact { a == b } else { a.to_bits() == b.to_bits() };
        if same {
            continue;
        }
        match tol {
            Tolerance::Exact => return Err(format!("{name}[{i}]: {a:e} vs interp {b:e} (bits {:#x} vs {:#x})", (a as f32).to_bits(), (b as f32).to_bits())),
            Tolerance::Scaled(t) | Tolerance::Abs(t) => {
                if !float || a.is_infinite() || b.is_infinite() {
                    return Err(format!("{name}[{i}]: {a} vs interp {b}"));
                }
                let e = (a - b).abs() / scale;
                if e > t && worst.is_none_or(|(_, we)| e > we) {
                    worst = Some((i, e));
                }
            }
        }
    }
    if let Some((i, e)) = worst {
        return Err(format!("{name}[{i}]: {} vs interp {} (scaled error {e:.3e} > {:?})", g[i], w[i], tol));
    }
    Ok(())
}

/// Runs `k` on `exec` and on the interpreter; both must fail with the same error or give
/// outputs within `tol`.
pub fn check_kernel(exec: &dyn Executor, k: &Kernel, args: &[&Array], tol: Tolerance) -> Result<(), String> {
    let want = interp::run(k, args);
    let got = exec::run(exec, k, args);
    match (got, want) {
        (Ok(g), Ok(w)) => {
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                compare(&format!("{} output {i}", k.name), g, w, tol)?;
            }
            Ok(())
        }
        (Err(g), Err(w)) => {
            if g.rule != w.rule || g.to_string() != w.to_string() {
                return Err(format!("different errors:\n  {}: {g}\n  interp: {w}", exec.name()));
            }
            Ok(())
        }
        (Ok(_), Err(w)) => Err(format!("{} succeeded, the interpreter failed: {w}", exec.name())),
        (Err(g), Ok(_)) => Err(format!("{} failed, the interpreter succeeded: {g}", exec.name())),
    }
}

// ---- random kernels -----------------------------------------------------------------------

/// A random kernel with its inputs.
pub struct Case {
    pub kernel: Kernel,
    pub inputs: Vec<Array>,
    /// The generator only combined ops whose results vary continuously with their inputs
    /// after any inexact op (so a tolerance comparison is meaningful in fast mode).
    pub smooth: bool,
}

/// Options of the generator.
#[derive(Clone, Copy, Debug)]
pub struct GenOptions {
    /// Restrict to programs a tolerance can judge (see [`Case::smooth`]).
    pub smooth: bool,
}

fn special(rng: &mut StdRng) -> f32 {
    match rng.gen_range(0..10) {
        0 => 0.0,
        1 => -0.0,
        2 => f32::NAN,
        3 => f32::INFINITY,
        4 => f32::NEG_INFINITY,
        5 => 1e-40,
        6 => -3e38,
        7 => 1.0,
        8 => -1.0,
        _ => 0.5,
    }
}

fn random_array(rng: &mut StdRng, dtype: DType, shape: &[usize], specials: bool) -> Array {
    let n: usize = shape.iter().product();
    let f = |rng: &mut StdRng| -> f32 { if specials && rng.gen_bool(0.03) { special(rng) } else { rng.gen_range(-2.0f32..2.0) } };
    let data = match dtype {
        DType::F32 => Data::F32((0..n).map(|_| f(rng)).collect()),
        DType::BF16 => Data::BF16((0..n).map(|_| bf16::from_f32(f(rng))).collect()),
        DType::I32 => Data::I32((0..n).map(|_| if rng.gen_bool(0.05) { [0, -1, i32::MIN, i32::MAX][rng.gen_range(0..4)] } else { rng.gen_range(-50..50) }).collect()),
        DType::I8 => Data::I8((0..n).map(|_| rng.gen_range(-128i32..128) as i8).collect()),
        DType::Bool => Data::Bool((0..n).map(|_| rng.gen_bool(0.5)).collect()),
        // Every code, NaNs included, equally likely.
        DType::F8E4M3FN | DType::F8E5M2 => return Array::from_fp8_bits(dtype, shape, &(0..n).map(|_| rng.gen::<u8>()).collect::<Vec<_>>()),
    };
    Array { dtype, shape: shape.to_vec(), data }
}

/// A value in the body, with what the generator knows of it.
#[derive(Clone, Copy)]
struct V {
    v: Value,
    /// Passed through an inexact op (transcendental or dot) in fast mode.
    inexact: bool,
}

struct Gen<'a> {
    rng: &'a mut StdRng,
    smooth: bool,
}

impl Gen<'_> {
    /// A random elementwise expression of `shape` and `dtype` over `leaves`.
    fn expr(&mut self, b: &mut KernelBuilder, leaves: &[V], depth: usize) -> V {
        if depth == 0 || leaves.is_empty() || self.rng.gen_bool(0.25) {
            return leaves[self.rng.gen_range(0..leaves.len())];
        }
        let x = self.expr(b, leaves, depth - 1);
        let dt = b.ty(x.v).dtype;
        let smooth = self.smooth;
        match self.rng.gen_range(0..17) {
            14 => {
                // Attention-like: softmax(x y^T) y, the transpose explicit or in the dot.
                let y = self.expr(b, leaves, depth - 1);
                let y = if b.ty(y.v).dtype != dt { V { v: b.cast(y.v, dt), ..y } } else { y };
                let s = if self.rng.gen_bool(0.5) {
                    b.dot(x.v, y.v, false, true)
                } else {
                    let yt = b.transpose(y.v);
                    b.dot(x.v, yt, false, false)
                };
                let m = b.reduce(ReduceOp::Max, s, 1);
                let shape = b.ty(s).shape.clone();
                let mb = b.broadcast(m, &shape);
                let d = b.sub(s, mb);
                let d = b.unary(UnaryOp::Tanh, d);
                let p = b.unary(UnaryOp::Exp, d);
                let l = b.reduce(ReduceOp::Sum, p, 1);
                let yf = b.cast(y.v, DType::F32);
                let o = b.dot(p, yf, false, false);
                let oshape = b.ty(o).shape.clone();
                let lb = b.broadcast(l, &oshape);
                let o = b.div(o, lb);
                V { v: b.cast(o, dt), inexact: true }
            }
            15 => {
                // Through a reshape: the mean of the whole block.
                let shape = b.ty(x.v).shape.clone();
                let n: usize = shape.iter().product();
                let r = b.reshape(x.v, &[1, n]);
                let rf = b.cast(r, DType::F32);
                let s = b.reduce(ReduceOp::Sum, rf, 1);
                let s = b.mul(s, 1.0 / n as f64);
                let s = b.cast(s, dt);
                let one = vec![1; shape.len()];
                let s = b.reshape(s, &one);
                let sb = b.broadcast(s, &shape);
                V { v: b.sub(x.v, sb), ..x }
            }
            16 if !smooth || !x.inexact => {
                // Bools through memory-free logic.
                let shape = b.ty(x.v).shape.clone();
                let z = b.full(&shape, dt, 0.0);
                let c1 = b.cmp(CmpOp::Gt, x.v, z);
                let io = b.iota(DType::I32, &shape, shape.len() - 1);
                let two = b.full(&shape, DType::I32, 2i64);
                let par = b.binary(tessera_dsl::BinaryOp::Rem, io, two);
                let zi = b.full(&shape, DType::I32, 0i64);
                let c2 = b.cmp(CmpOp::Eq, par, zi);
                let c = b.binary(tessera_dsl::BinaryOp::Xor, c1, c2);
                let c = b.unary(UnaryOp::Not, c);
                let f = b.cast(c, dt);
                V { v: b.add(x.v, f), ..x }
            }
            0..=3 => {
                let y = self.expr(b, leaves, depth - 1);
                let y = if b.ty(y.v).dtype != dt { V { v: b.cast(y.v, dt), ..y } } else { y };
                let ops = [tessera_dsl::BinaryOp::Add, tessera_dsl::BinaryOp::Sub, tessera_dsl::BinaryOp::Mul, tessera_dsl::BinaryOp::Max, tessera_dsl::BinaryOp::Min, tessera_dsl::BinaryOp::Div];
                let op = ops[self.rng.gen_range(0..if smooth { 5 } else { 6 })];
                V { v: b.binary(op, x.v, y.v), inexact: x.inexact || y.inexact }
            }
            4 => V { v: b.unary(UnaryOp::Neg, x.v), ..x },
            5 => {
                // Abs, or (on exact values only in fast mode: they jump at integers and 0)
                // the rounding ops and sign.
                let ops = [UnaryOp::Abs, UnaryOp::Floor, UnaryOp::Ceil, UnaryOp::Round, UnaryOp::Sign];
                let op = if smooth && x.inexact { UnaryOp::Abs } else { ops[self.rng.gen_range(0..ops.len())] };
                V { v: b.unary(op, x.v), ..x }
            }
            6 => {
                let ops = [UnaryOp::Tanh, UnaryOp::Erf, UnaryOp::Sin, UnaryOp::Cos, UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sqrt, UnaryOp::Rsqrt, UnaryOp::Log1p, UnaryOp::Expm1];
                let op = ops[self.rng.gen_range(0..if smooth { 4 } else { ops.len() })];
                V { v: b.unary(op, x.v), inexact: true }
            }
            7 => {
                // exp of something bounded, as softmax does.
                let t = b.unary(UnaryOp::Tanh, x.v);
                V { v: b.unary(UnaryOp::Exp, t), inexact: true }
            }
            8 => {
                let y = self.expr(b, leaves, depth - 1);
                if smooth && (x.inexact || y.inexact) {
                    return x;
                }
                let y = if b.ty(y.v).dtype != dt { b.cast(y.v, dt) } else { y.v };
                let ops = [CmpOp::Lt, CmpOp::Le, CmpOp::Gt, CmpOp::Ge, CmpOp::Eq, CmpOp::Ne];
                let c = b.cmp(ops[self.rng.gen_range(0..6)], x.v, y);
                let z = self.expr(b, leaves, depth - 1);
                let z = if b.ty(z.v).dtype != dt { b.cast(z.v, dt) } else { z.v };
                V { v: b.select(c, x.v, z), inexact: x.inexact }
            }
            9 => {
                // Through the other float type and back.
                let to = if dt == DType::F32 { DType::BF16 } else { DType::F32 };
                let y = b.cast(x.v, to);
                V { v: b.cast(y, dt), ..x }
            }
            10 if !smooth || !x.inexact => {
                // Through the integers and back.
                let i = b.cast(x.v, DType::I32);
                let c = b.i32(self.rng.gen_range(-3..4));
                use tessera_dsl::BinaryOp as B;
                // Shifts by -3..4: negative amounts take the out-of-range rule.
                let ops = [B::Add, B::Mul, B::Div, B::Rem, B::Max, B::Xor, B::And, B::Or, B::Shl, B::Shr, B::ShrLogical];
                let j = b.binary(ops[self.rng.gen_range(0..ops.len())], i, c);
                let j = if self.rng.gen_bool(0.2) { b.unary(UnaryOp::Not, j) } else { j };
                let j = if self.rng.gen_bool(0.3) { b.cast(j, DType::I8) } else { j };
                V { v: b.cast(j, dt), inexact: false }
            }
            11 => {
                // A reduction broadcast back.
                let shape = b.ty(x.v).shape.clone();
                let axis = self.rng.gen_range(0..shape.len());
                let scannable = axis + 2 >= shape.len() && matches!(b.ty(x.v).dtype, DType::F32 | DType::BF16 | DType::I32);
                if scannable && !(smooth && x.inexact) && self.rng.gen_bool(0.15) {
                    // A prefix sum (sequential f32 additions, the same on every backend).
                    return V { v: b.cumsum(x.v, axis), ..x };
                }
                if !(smooth && x.inexact) && self.rng.gen_bool(0.25) {
                    // An index (ties and NaNs make it jump, hence exact values only in fast mode).
                    let r = if self.rng.gen_bool(0.5) { b.argmax(x.v, axis) } else { b.argmin(x.v, axis) };
                    let r = b.cast(r, dt);
                    return V { v: b.broadcast(r, &shape), ..x };
                }
                let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][self.rng.gen_range(0..3)];
                let r = b.reduce(op, x.v, axis);
                V { v: b.broadcast(r, &shape), ..x }
            }
            12 => {
                let shape = b.ty(x.v).shape.clone();
                let dim = self.rng.gen_range(0..shape.len());
                let io = b.iota(DType::I32, &shape, dim);
                let f = b.cast(io, dt);
                V { v: b.add(x.v, f), ..x }
            }
            _ => {
                let c = b.full(&b.ty(x.v).shape.clone(), dt, self.rng.gen_range(-2.0f64..2.0));
                V { v: b.mul(x.v, c), ..x }
            }
        }
    }
}

/// A random kernel: grid, blocked inputs (some with prefetch-driven index maps), an
/// elementwise DAG with reductions, broadcasts, casts, `if` on the program id, a `for`
/// loop with carried values and dynamic slices, optional dots, an optional DMA from an ANY
/// operand, scratch accumulation over an `arbitrary` dim, and one or two outputs.
pub fn random_case(seed: u64, opts: GenOptions) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let rng = &mut rng;
    let mut b = KernelBuilder::new(&format!("fuzz_{seed:x}"));
    let g0 = rng.gen_range(1..=3usize);
    let reduce_dim = rng.gen_bool(0.3);
    let g1 = if reduce_dim { rng.gen_range(1..=3usize) } else { 1 };
    let sem0 = if rng.gen_bool(0.6) { Semantics::Parallel } else { Semantics::Arbitrary };
    let mut grid = vec![(g0, sem0)];
    if reduce_dim {
        grid.push((g1, Semantics::Arbitrary));
    }
    b.grid(&grid);
    let rows = [1usize, 8, 8, 16][rng.gen_range(0..4)];
    let cols = [1usize, 3, 4, 5, 8, 13, 128, 130][rng.gen_range(0..8)];
    let ragged = rng.gen_bool(0.1) && rows > 1;
    let total_rows = if ragged { rows * g0 - rows / 2 } else { rows * g0 };
    let dt = if rng.gen_bool(0.3) { DType::BF16 } else { DType::F32 };
    let use_prefetch = rng.gen_bool(0.3);
    let grid_map = |k: usize| -> Vec<IndexExpr> { vec![IndexExpr::grid(0), IndexExpr::Const(k as i64)] };
    let mut inputs = Vec::new();
    let pf = if use_prefetch {
        let p = b.prefetch("perm", &[g0]);
        let mut perm: Vec<i32> = (0..g0 as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.gen_range(0..=i));
        }
        inputs.push(Array::from_i32(&[g0], perm));
        Some(p)
    } else {
        None
    };
    let n_in = rng.gen_range(1..=3);
    let mut in_refs = Vec::new();
    for i in 0..n_in {
        let d = if i == 0 || rng.gen_bool(0.5) { dt } else { DType::F32 };
        let map = match (pf, i) {
            (Some(p), 0) => vec![IndexExpr::Prefetch { array: p, index: vec![IndexExpr::grid(0)] }, IndexExpr::Const(0)],
            _ => grid_map(0),
        };
        let r = b.input(&format!("x{i}"), d, &[total_rows, cols], BlockSpec { block_shape: vec![Some(rows), Some(cols)], index_map: map });
        in_refs.push(r);
        inputs.push(random_array(rng, d, &[total_rows, cols], !opts.smooth));
    }
    // A row vector broadcast over rows.
    let wvec = b.input("w", dt, &[1, cols], BlockSpec { block_shape: vec![Some(1), Some(cols)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] });
    inputs.push(random_array(rng, dt, &[1, cols], false));
    let use_dot = rng.gen_bool(0.25);
    let wmat = if use_dot {
        let r = b.input("m", DType::F32, &[cols, cols], BlockSpec { block_shape: vec![Some(cols), Some(cols)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] });
        inputs.push(random_array(rng, DType::F32, &[cols, cols], false));
        Some(r)
    } else {
        None
    };
    let use_dma = rng.gen_bool(0.15);
    let any_in = if use_dma {
        let r = b.unblocked(RefKind::Input, "hbm", dt, &[rows, cols], MemorySpace::Any);
        inputs.push(random_array(rng, dt, &[rows, cols], false));
        Some(r)
    } else {
        None
    };
    let out_map = vec![IndexExpr::grid(0), IndexExpr::Const(0)];
    let out = b.output("o", dt, &[total_rows, cols], BlockSpec { block_shape: vec![Some(rows), Some(cols)], index_map: out_map.clone() });
    let second = rng.gen_bool(0.3);
    let out2 = if second { Some(b.output("o2", DType::F32, &[total_rows, 1], BlockSpec { block_shape: vec![Some(rows), Some(1)], index_map: out_map })) } else { None };
    let int_out = rng.gen_bool(0.2);
    let out3 = if int_out { Some(b.output("o3", DType::I32, &[total_rows, 1], BlockSpec { block_shape: vec![Some(rows), Some(1)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] })) } else { None };
    let acc = if reduce_dim { Some(b.scratch("acc", DType::F32, &[rows, cols], MemorySpace::Vmem)) } else { None };
    let (dma_buf, sem) = if use_dma { (Some(b.scratch("buf", dt, &[rows, cols], MemorySpace::Vmem)), Some(b.semaphores("sem", 1))) } else { (None, None) };

    let mut g = Gen { rng, smooth: opts.smooth };
    let mut leaves: Vec<V> = in_refs.iter().map(|&r| V { v: b.load(r, &[]), inexact: false }).collect();
    for l in leaves.iter_mut() {
        if b.ty(l.v).dtype != dt {
            l.v = b.cast(l.v, dt);
        }
    }
    let w = b.load(wvec, &[]);
    leaves.push(V { v: b.broadcast(w, &[rows, cols]), inexact: false });
    if let (Some(src), Some(buf), Some(sem)) = (any_in, dma_buf, sem) {
        b.dma_start(src, &[], buf, &[], sem, 0i32);
        b.dma_wait(src, &[], buf, &[], sem, 0i32);
        leaves.push(V { v: b.load(buf, &[]), inexact: false });
    }
    let depth = g.rng.gen_range(1..5);
    let mut y = g.expr(&mut b, &leaves, depth);
    if let Some(m) = wmat {
        let m = b.load(m, &[]);
        let yf = b.cast(y.v, DType::F32);
        let d = b.dot(yf, m, false, false);
        let d = b.cast(d, dt);
        y = V { v: d, inexact: true };
    }
    // `if` on the program id.
    if g.rng.gen_bool(0.3) {
        let pid = b.program_id(0);
        let two = b.i32(2);
        let r = b.binary(tessera_dsl::BinaryOp::Rem, pid, two);
        let zero = b.i32(0);
        let c = b.cmp(CmpOp::Eq, r, zero);
        let yv = y.v;
        let leaves2 = leaves.clone();
        let then_v = { b.if_else(c, |b| vec![b.unary(UnaryOp::Neg, yv)], |b| vec![b.add(yv, leaves2[0].v)]) };
        y = V { v: then_v[0], ..y };
    }
    // A loop over rows with dynamic slices, carrying a row accumulator.
    if rows > 1 && g.rng.gen_bool(0.3) {
        let yv = y.v;
        let scratch = b.scratch("rows", dt, &[rows, cols], MemorySpace::Vmem);
        b.store(scratch, &[], yv);
        let init = b.zeros(&[1, cols], dt);
        let lo = b.i32(0);
        let hi = b.i32(rows as i32);
        let res = b.for_range(lo, hi, 1, &[init], |b, i, c| {
            let row = b.load(scratch, &[ds(i, 1), Index::Full]);
            let s = b.add(c[0], row);
            vec![b.mul(s, 0.5)]
        });
        let bc = b.broadcast(res[0], &[rows, cols]);
        y = V { v: b.add(yv, bc), ..y };
    }
    // A scalar loop over the prefetch table (SMEM reads with a dynamic index).
    if let Some(p) = pf {
        if g.rng.gen_bool(0.4) {
            let lo = b.i32(0);
            let hi = b.i32(g0 as i32);
            let zero = b.i32(0);
            let r = b.for_range(lo, hi, 1, &[zero], |b, i, c| {
                let v = b.load(p, &[ds(i, 1)]);
                let t = b.mul(v, 3);
                vec![b.add(c[0], t)]
            });
            let f = b.cast(r[0], dt);
            let shape = b.ty(y.v).shape.clone();
            let fb = b.broadcast(f, &shape);
            y = V { v: b.add(y.v, fb), ..y };
        }
    }
    // Integer results: how many elements of each row are positive (not where a tolerance
    // judges: a last-bit difference flips a count).
    if let Some(o3) = out3.filter(|_| !(opts.smooth && y.inexact)) {
        let shape = b.ty(y.v).shape.clone();
        let z = b.full(&shape, dt, 0.0);
        let pos = b.cmp(CmpOp::Gt, y.v, z);
        let i = b.cast(pos, DType::I32);
        let cnt = b.reduce(ReduceOp::Sum, i, 1);
        b.store(o3, &[], cnt);
    }
    match acc {
        Some(acc) => {
            let k = b.program_id(1);
            let zero = b.i32(0);
            let first = b.cmp(CmpOp::Eq, k, zero);
            b.when(first, |b| {
                let z = b.zeros(&[rows, cols], DType::F32);
                b.store(acc, &[], z);
            });
            let cur = b.load(acc, &[]);
            let yf = b.cast(y.v, DType::F32);
            let s = b.add(cur, yf);
            b.store(acc, &[], s);
            let last = b.cmp(CmpOp::Eq, k, (g1 - 1) as i32);
            b.when(last, |b| {
                let a = b.load(acc, &[]);
                let a = b.cast(a, dt);
                b.store(out, &[], a);
            });
            if let Some(o2) = out2 {
                let yf = b.cast(y.v, DType::F32);
                let r = b.reduce(ReduceOp::Sum, yf, 1);
                b.store(o2, &[], r);
            }
        }
        None => {
            b.store(out, &[], y.v);
            if let Some(o2) = out2 {
                let yf = b.cast(y.v, DType::F32);
                let r = b.reduce(ReduceOp::Max, yf, 1);
                b.store(o2, &[], r);
            }
        }
    }
    let _ = Type::scalar(DType::F32);
    let kernel = b.finish().unwrap_or_else(|e| panic!("generator built an invalid kernel (seed {seed}): {e}"));
    Case { kernel, inputs, smooth: opts.smooth }
}

/// Checks one random case on `exec` (exact: bit for bit, else within `tol`); verifies it
/// first for `target` unless it has ragged edge blocks (which the verifier rejects but the
/// backends must run as the interpreter does).
pub fn check_case(exec: &dyn Executor, case: &Case, tol: Tolerance) -> Result<(), String> {
    let args: Vec<&Array> = case.inputs.iter().collect();
    check_kernel(exec, &case.kernel, &args, tol).map_err(|e| {
        let mut s = e;
        let _ = write!(s, "\n{}", case.kernel);
        s
    })
}

/// The target random kernels are verified for.
pub fn target() -> Target {
    Target::V5E
}
