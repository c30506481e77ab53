//! Hand-built kernels shared by the codegen tests.
#![allow(dead_code)]

use tessera_dsl::ir::{BlockSpec, CmpOp, IndexExpr, ReduceOp, UnaryOp};
use tessera_dsl::{ds, DType, Index, Kernel, KernelBuilder, MemorySpace, Semantics};

fn g(n: usize) -> IndexExpr {
    IndexExpr::grid(n)
}

fn c(v: i64) -> IndexExpr {
    IndexExpr::Const(v)
}

fn spec(block: &[usize], map: Vec<IndexExpr>) -> BlockSpec {
    BlockSpec { block_shape: block.iter().map(|&d| Some(d)).collect(), index_map: map }
}

/// Pallas' tiled matmul (reference/mosaic/pallas_sources.py): 512^3 f32, 128^3 blocks,
/// K innermost and `arbitrary`, accumulating in a VMEM scratch.
pub fn matmul_f32() -> Kernel {
    let mut b = KernelBuilder::new("tiled_matmul");
    b.grid(&[(4, Semantics::Parallel), (4, Semantics::Parallel), (4, Semantics::Arbitrary)]);
    let x = b.input("x", DType::F32, &[512, 512], spec(&[128, 128], vec![g(0), g(2)]));
    let y = b.input("y", DType::F32, &[512, 512], spec(&[128, 128], vec![g(2), g(1)]));
    let o = b.output("o", DType::F32, &[512, 512], spec(&[128, 128], vec![g(0), g(1)]));
    let acc = b.scratch("acc", DType::F32, &[128, 128], MemorySpace::Vmem);
    let k = b.program_id(2);
    let first = b.cmp(CmpOp::Eq, k, 0);
    b.when(first, |b| {
        let z = b.zeros(&[128, 128], DType::F32);
        b.store(acc, &[], z);
    });
    let a = b.load(acc, &[]);
    let xv = b.load(x, &[]);
    let yv = b.load(y, &[]);
    let p = b.dot(xv, yv, false, false);
    let s = b.add(a, p);
    b.store(acc, &[], s);
    let last = b.cmp(CmpOp::Eq, k, 3);
    b.when(last, |b| {
        let v = b.load(acc, &[]);
        b.store(o, &[], v);
    });
    b.finish().unwrap()
}

/// gelu(x * a + b) with the tanh approximation; a and b are broadcast rows.
pub fn gelu_affine() -> Kernel {
    let mut b = KernelBuilder::new("fused_gelu");
    b.grid(&[(4, Semantics::Parallel)]);
    let x = b.input("x", DType::F32, &[512, 1024], spec(&[128, 1024], vec![g(0), c(0)]));
    let a = b.input("a", DType::F32, &[1, 1024], spec(&[1, 1024], vec![c(0), c(0)]));
    let bias = b.input("b", DType::F32, &[1, 1024], spec(&[1, 1024], vec![c(0), c(0)]));
    let o = b.output("o", DType::F32, &[512, 1024], spec(&[128, 1024], vec![g(0), c(0)]));
    let xv = b.load(x, &[]);
    let av = b.load(a, &[]);
    let bv = b.load(bias, &[]);
    let m = b.mul(xv, av);
    let y = b.add(m, bv);
    let y2 = b.mul(y, y);
    let y3 = b.mul(y, y2);
    let t = b.mul(0.044715, y3);
    let inner = b.add(y, t);
    let scaled = b.mul(0.7978845608028654, inner);
    let th = b.unary(UnaryOp::Tanh, scaled);
    let one = b.add(1.0, th);
    let half = b.mul(0.5, one);
    let out = b.mul(y, half);
    b.store(o, &[], out);
    b.finish().unwrap()
}

/// Row softmax of a bf16 matrix, computed in f32.
pub fn softmax_bf16() -> Kernel {
    let mut b = KernelBuilder::new("softmax");
    b.grid(&[(2, Semantics::Parallel)]);
    let x = b.input("x", DType::BF16, &[256, 512], spec(&[128, 512], vec![g(0), c(0)]));
    let o = b.output("o", DType::BF16, &[256, 512], spec(&[128, 512], vec![g(0), c(0)]));
    let xv = b.load(x, &[]);
    let xf = b.cast(xv, DType::F32);
    let m = b.reduce(ReduceOp::Max, xf, 1);
    let d = b.sub(xf, m);
    let e = b.unary(UnaryOp::Exp, d);
    let s = b.reduce(ReduceOp::Sum, e, 1);
    let p = b.div(e, s);
    let out = b.cast(p, DType::BF16);
    b.store(o, &[], out);
    b.finish().unwrap()
}

/// A prefetch-driven index map (rows gathered by `perm`), an SMEM read in the body, a
/// counted loop with two carries, a squeezed block dim and an `if` with results.
pub fn prefetch_loop() -> Kernel {
    let mut b = KernelBuilder::new("prefetch_loop");
    b.grid(&[(4, Semantics::Parallel)]);
    let perm = b.prefetch("perm", &[4]);
    let x = b.input(
        "x",
        DType::F32,
        &[4, 128, 256],
        BlockSpec { block_shape: vec![None, Some(128), Some(256)], index_map: vec![IndexExpr::Prefetch { array: perm, index: vec![g(0)] }, c(0), c(0)] },
    );
    let o = b.output("o", DType::F32, &[512, 256], spec(&[128, 256], vec![g(0), c(0)]));
    let i = b.program_id(0);
    let src = b.load(perm, &[ds(i, 1)]);
    let xv = b.load(x, &[]);
    let zero = b.zeros(&[128, 256], DType::F32);
    let n0 = b.i32(0);
    let res = b.for_range(0, 4, 1, &[zero, n0], |b, it, carry| {
        let (acc, n) = (carry[0], carry[1]);
        let step = b.add(it, src);
        let sf = b.cast(step, DType::F32);
        let term = b.mul(xv, sf);
        let half = b.mul(acc, 0.5);
        let acc2 = b.add(half, term);
        let n2 = b.add(n, it);
        vec![acc2, n2]
    });
    let big = b.cmp(CmpOp::Gt, res[1], 3);
    let out = b.if_else(big, |_| vec![res[0]], |b| vec![b.unary(UnaryOp::Neg, res[0])]);
    b.store(o, &[Index::Full, Index::Full], out[0]);
    b.finish().unwrap()
}

/// Every remaining op family once: transposes, transposed dots, iota, compares, selects,
/// math, integer and bool ops, casts through bf16/i8/bool, min-reduce, reshape, SMEM
/// scratch, dynamic slices, num_programs, and two outputs.
pub fn op_zoo() -> Kernel {
    use tessera_dsl::ir::BinaryOp;
    let mut b = KernelBuilder::new("op_zoo");
    b.grid(&[(2, Semantics::Arbitrary)]);
    let x = b.input("x", DType::F32, &[128, 256], spec(&[128, 256], vec![c(0), c(0)]));
    let w = b.input("w", DType::BF16, &[256, 128], spec(&[128, 128], vec![g(0), c(0)]));
    let o = b.output("o", DType::F32, &[128, 128], spec(&[128, 128], vec![c(0), c(0)]));
    let oi = b.output("oi", DType::I32, &[128, 128], spec(&[128, 128], vec![c(0), c(0)]));
    let cnt = b.scratch("cnt", DType::I32, &[4], MemorySpace::Smem);
    let j = b.program_id(0);
    let np = b.num_programs(0);
    let xv = b.load(x, &[]);
    // dots: x[:, 128*j : +128] (dynamic slice) against itself transposed both ways
    let col = b.mul(j, 128);
    let xs = b.load(x, &[Index::Full, ds(col, 128)]);
    let d1 = b.dot(xs, xs, false, true);
    let d2 = b.dot(xs, xs, true, false);
    let wv = b.load(w, &[]);
    let wt = b.transpose(wv);
    let wtf = b.cast(wt, DType::F32);
    let ws = b.load(w, &[]);
    let d3 = b.dot(ws, ws, true, false); // bf16 x bf16 -> f32
    let t1 = b.add(d1, d2);
    let t2 = b.add(t1, d3);
    let t3 = b.add(t2, wtf);
    // math
    let a = b.unary(UnaryOp::Abs, t3);
    let a1 = b.add(a, 1.0);
    let l = b.unary(UnaryOp::Log, a1);
    let r = b.unary(UnaryOp::Rsqrt, a1);
    let e = b.unary(UnaryOp::Erf, r);
    let sq = b.unary(UnaryOp::Sqrt, a1);
    let pw = b.binary(BinaryOp::Pow, a1, 0.5);
    let mn = b.min(l, e);
    let mx = b.max(sq, pw);
    let f = b.sub(mx, mn);
    let f = b.div(f, a1);
    // iota, integer ops, compares, select, bool logic
    let io = b.iota(DType::I32, &[128, 128], 1);
    let ir = b.iota(DType::I32, &[128, 128], 0);
    let q = b.div(io, 3);
    let rm = b.binary(BinaryOp::Rem, ir, 7);
    let band = b.binary(BinaryOp::And, q, rm);
    let bor = b.binary(BinaryOp::Or, band, 1);
    let bx = b.binary(BinaryOp::Xor, bor, io);
    let nb = b.unary(UnaryOp::Not, bx);
    let ng = b.unary(UnaryOp::Neg, nb);
    let ia = b.unary(UnaryOp::Abs, ng);
    let imx = b.max(ia, q);
    let imn = b.min(imx, 1000);
    let lt = b.cmp(CmpOp::Lt, io, ir);
    let ge = b.cmp(CmpOp::Ge, f, 0.25);
    let ne = b.cmp(CmpOp::Ne, f, 0.5);
    let both = b.binary(BinaryOp::And, lt, ge);
    let either = b.binary(BinaryOp::Or, both, ne);
    let flip = b.unary(UnaryOp::Not, either);
    let sel = b.select(flip, f, 0.0);
    // casts: f32 -> bf16 -> f32, i32 -> i8 -> i32, bool -> i32/f32, f32 -> i32
    let h = b.cast(sel, DType::BF16);
    let hf = b.cast(h, DType::F32);
    let i8v = b.cast(imn, DType::I8);
    let i32v = b.cast(i8v, DType::I32);
    let bi = b.cast(flip, DType::I32);
    let bf = b.cast(lt, DType::F32);
    let fi = b.cast(hf, DType::I32);
    let isum = b.add(i32v, bi);
    let isum = b.add(isum, fi);
    let fsum = b.add(hf, bf);
    // reductions on both axes, reshape, broadcast back
    let cmin = b.reduce(ReduceOp::Min, fsum, 0);
    let imax = b.reduce(ReduceOp::Max, isum, 1);
    let rs = b.reshape(fsum, &[1, 128, 128]);
    let rs = b.reshape(rs, &[128, 128]);
    let out = b.sub(rs, cmin);
    let npf = b.cast(np, DType::F32);
    let out = b.mul(out, npf);
    let isum2 = b.sub(isum, imax);
    b.store(o, &[], out);
    b.store(oi, &[], isum2);
    // SMEM scratch: scalar read-modify-write
    let cur = b.load(cnt, &[ds(0, 1)]);
    let nxt = b.add(cur, j);
    b.store(cnt, &[ds(0, 1)], nxt);
    let _ = xv;
    b.finish().unwrap()
}

/// Operands that are not blocked: an SMEM table, a whole-array VMEM input, an ANY (HBM)
/// input left untouched (so not passed: `main` takes it, the custom call does not), an i8
/// input; scalar float math on the scalar unit; float rem and an integer sum; a 2-D prefetch
/// read in an index map; loop bounds read from SMEM.
pub fn unblocked_operands() -> Kernel {
    use tessera_dsl::ir::{BinaryOp, RefKind};
    let mut b = KernelBuilder::new("unblocked_operands");
    b.grid(&[(2, Semantics::Parallel), (2, Semantics::Arbitrary)]);
    let tbl = b.prefetch("tbl", &[2, 2]);
    let scale = b.unblocked(RefKind::Input, "scale", DType::F32, &[4], MemorySpace::Smem);
    let bias = b.unblocked(RefKind::Input, "bias", DType::F32, &[8, 128], MemorySpace::Vmem);
    let _hbm = b.unblocked(RefKind::Input, "hbm", DType::F32, &[64, 128], MemorySpace::Any);
    let q = b.input("q", DType::I8, &[2, 64, 128], BlockSpec { block_shape: vec![None, Some(64), Some(128)], index_map: vec![g(0), c(0), c(0)] });
    let x = b.input(
        "x",
        DType::F32,
        &[32, 128],
        spec(&[8, 128], vec![IndexExpr::Prefetch { array: tbl, index: vec![g(0), g(1)] } + g(1) * 2, c(0)]),
    );
    let o = b.output("o", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), c(0)]));
    let os = b.output("osum", DType::I32, &[2, 1, 128], BlockSpec { block_shape: vec![None, Some(1), Some(128)], index_map: vec![g(0), c(0), c(0)] });
    let j = b.program_id(1);
    let s0 = b.load(scale, &[ds(j, 1)]);
    let s1 = b.unary(UnaryOp::Exp, s0);
    let s2 = b.mul(s1, 2.0);
    let xv = b.load(x, &[]);
    let bv = b.load(bias, &[]);
    let y = b.mul(xv, s2);
    let y = b.add(y, bv);
    let y = b.binary(BinaryOp::Rem, y, 3.0);
    let qv = b.load(q, &[ds(0, 32), Index::Full]);
    let qi = b.cast(qv, DType::I32);
    let qs = b.reduce(ReduceOp::Sum, qi, 0);
    let hi = b.load(tbl, &[ds(0, 1), ds(1, 1)]);
    let acc = b.for_range(0, hi, 2, &[y], |b, _, c| vec![b.mul(c[0], 0.5)]);
    b.store(o, &[], acc[0]);
    b.store(os, &[], qs);
    b.finish().unwrap()
}

/// Double-buffered paged gather: each grid step sums `n` 16x128 pages of an HBM array
/// `x[h, page]` picked by a prefetch table, through a [2, 16, 128] VMEM buffer (the next
/// page's copy starts before the current one is used); a second copy goes into a
/// [2, 1, 16, 128] buffer, so one side keeps its leading 1s and one is squeezed.
pub fn dma_double_buffer() -> Kernel {
    use tessera_dsl::ir::{BinaryOp, RefKind};
    let (n, steps) = (4usize, 3usize);
    let mut b = KernelBuilder::new("dma_double_buffer");
    b.grid(&[(steps, Semantics::Parallel)]);
    let idx = b.prefetch("idx", &[steps * n]);
    let x = b.unblocked(RefKind::Input, "x", DType::BF16, &[2, 8, 16, 128], MemorySpace::Any);
    let o = b.output("o", DType::F32, &[steps, 16, 128], BlockSpec { block_shape: vec![None, Some(16), Some(128)], index_map: vec![g(0), c(0), c(0)] });
    let buf = b.scratch("buf", DType::BF16, &[2, 16, 128], MemorySpace::Vmem);
    let buf4 = b.scratch("buf4", DType::BF16, &[2, 1, 16, 128], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 3);
    let page = |b: &mut KernelBuilder, j: tessera_dsl::Value| {
        let i = b.program_id(0);
        let base = b.mul(i, n as i64);
        let at = b.add(base, j);
        b.load(idx, &[ds(at, 1)])
    };
    let zero = b.i32(0);
    let p0 = page(&mut b, zero);
    b.dma_start(x, &[ds(1, 1), ds(p0, 1)], buf, &[ds(0, 1)], sem, 0);
    let acc0 = b.zeros(&[16, 128], DType::F32);
    let acc = b.for_range(0, n as i64, 1, &[acc0], |b, j, cs| {
        let slot = b.binary(BinaryOp::Rem, j, 2);
        let other = b.sub(1, slot);
        let next = b.add(j, 1);
        let more = b.cmp(CmpOp::Lt, next, n as i64);
        b.when(more, |b| {
            let p = page(b, next);
            b.dma_start(x, &[ds(1, 1), ds(p, 1)], buf, &[ds(other, 1)], sem, other);
        });
        let p = page(b, j);
        b.dma_wait(x, &[ds(1, 1), ds(p, 1)], buf, &[ds(slot, 1)], sem, slot);
        let t = b.load(buf, &[ds(slot, 1), Index::Full, Index::Full]);
        let t = b.reshape(t, &[16, 128]);
        let t = b.cast(t, DType::F32);
        vec![b.add(cs[0], t)]
    });
    // Same-rank sides: no squeeze.
    b.dma_start(x, &[ds(0, 1), ds(p0, 1)], buf4, &[ds(1, 1), ds(0, 1)], sem, 2);
    b.dma_wait(x, &[ds(0, 1), ds(p0, 1)], buf4, &[ds(1, 1), ds(0, 1)], sem, 2);
    let t = b.load(buf4, &[ds(1, 1), ds(0, 1), Index::Full, Index::Full]);
    let t = b.reshape(t, &[16, 128]);
    let t = b.cast(t, DType::F32);
    let out = b.add(acc[0], t);
    b.store(o, &[], out);
    b.finish().unwrap()
}

/// Inputs Mosaic never sees: `unused` is not read, `dead` only by a load whose value
/// nothing uses (what a `#[tpu_fn]` leaves behind when a static flag ignores an argument);
/// `x` is read only inside a branch, whose yielded value is stored.
pub fn unread_inputs() -> Kernel {
    let mut b = KernelBuilder::new("unread_inputs");
    b.grid(&[(2, Semantics::Parallel)]);
    let _unused = b.input("unused", DType::I32, &[2, 8, 128], BlockSpec { block_shape: vec![None, Some(8), Some(128)], index_map: vec![g(0), c(0), c(0)] });
    let x = b.input("x", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), c(0)]));
    let dead = b.input("dead", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), c(0)]));
    let o = b.output("o", DType::F32, &[16, 128], spec(&[8, 128], vec![g(0), c(0)]));
    let d = b.load(dead, &[]);
    let _ = b.mul(d, 2.0);
    let i = b.program_id(0);
    let first = b.cmp(CmpOp::Eq, i, 0);
    let y = b.if_else(first, |b| vec![b.load(x, &[])], |b| vec![b.zeros(&[8, 128], DType::F32)]);
    b.store(o, &[], y[0]);
    b.finish().unwrap()
}

pub fn all() -> Vec<Kernel> {
    vec![matmul_f32(), gelu_affine(), softmax_bf16(), prefetch_loop(), op_zoo(), unblocked_operands(), dma_double_buffer(), unread_inputs()]
}
