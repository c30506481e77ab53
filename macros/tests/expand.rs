//! Kernels written with `#[tpu_kernel]`: they must build, and the IR must say what the
//! source says.

use tessera_dsl::{DType, Inst, Kernel, KernelError, RefKind, Semantics, Type};
use tessera_macros::tpu_kernel;

fn f32s(shape: &[usize]) -> Type {
    Type::vector(DType::F32, shape)
}

/// Every instruction of the kernel, in order (nested blocks included).
fn insts(k: &Kernel) -> Vec<Inst> {
    let mut v = Vec::new();
    k.walk(k.body, &mut |_, d| v.push(d.inst.clone()));
    v
}

fn count(k: &Kernel, pred: impl Fn(&Inst) -> bool) -> usize {
    insts(k).iter().filter(|i| pred(i)).count()
}

/// Tiled matmul with an f32 accumulator.
#[tpu_kernel(
    grid = [m / bm, n / bn, k / bk],
    semantics = [parallel, parallel, arbitrary],
    x = block([bm, bk], |i, j, kk| [i, kk]),
    y = block([bk, bn], |i, j, kk| [kk, j]),
    out = block([bm, bn], |i, j, kk| [i, j]),
    acc = scratch([bm, bn], f32),
    vmem_limit_bytes = 64 * 1024 * 1024,
)]
pub fn matmul(x: In<m, k>, y: In<k, n>, out: Out<m, n>, acc: Scratch, bm: usize, bn: usize, bk: usize) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, bn], f32);
    }
    acc[..] += dot(x[..], y[..]);
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

#[test]
fn matmul_builds() {
    let k = matmul(f32s(&[256, 512]), f32s(&[512, 384]), f32s(&[256, 384]), 128, 128, 256).unwrap();
    let text = format!("{k}");
    println!("{text}");
    assert_eq!(k.name, "matmul");
    assert_eq!(k.grid.iter().map(|g| g.extent).collect::<Vec<_>>(), vec![2, 3, 2]);
    assert_eq!(k.grid.iter().map(|g| g.semantics).collect::<Vec<_>>(), vec![Semantics::Parallel, Semantics::Parallel, Semantics::Arbitrary]);
    assert_eq!(k.vmem_limit_bytes, Some(64 << 20));
    let kinds: Vec<_> = k.refs.iter().map(|r| (r.name.as_str(), r.kind)).collect();
    assert_eq!(kinds, vec![("x", RefKind::Input), ("y", RefKind::Input), ("out", RefKind::Output), ("acc", RefKind::Scratch)]);
    assert!(text.contains("@0 x: input f32[256,512] vmem block [128,256] at (g0, g2)"), "{text}");
    assert!(text.contains("@1 y: input f32[512,384] vmem block [256,128] at (g2, g1)"), "{text}");
    assert!(text.contains("@2 out: output f32[256,384] vmem block [128,128] at (g0, g1)"), "{text}");
    assert!(text.contains("@3 acc: scratch f32[128,128] vmem"), "{text}");
    assert_eq!(count(&k, |i| matches!(i, Inst::Dot { transpose_rhs: false, .. })), 1);
    assert_eq!(count(&k, |i| matches!(i, Inst::If { .. })), 2);
    assert_eq!(count(&k, |i| matches!(i, Inst::Store { .. })), 3);
    // Every instruction carries the user's source location.
    assert!(k.insts.iter().all(|d| d.loc.as_ref().is_some_and(|l| l.file.ends_with("expand.rs"))));
    // The instruction of `acc[..] += dot(..)` points at that line.
    let dot = k.insts.iter().find(|d| matches!(d.inst, Inst::Dot { .. })).unwrap();
    let line = include_str!("expand.rs").lines().position(|l| l.contains("acc[..] += dot(x[..], y[..]);")).unwrap() + 1;
    assert_eq!(dot.loc.as_ref().unwrap().line as usize, line);
}

#[test]
fn signature_const_and_shape_errors() {
    assert_eq!(MATMUL_SIGNATURE, "matmul(x: In[m, k], y: In[k, n], out: Out[m, n]; bm: usize, bn: usize, bk: usize)");
    // `k` disagrees between x and y.
    let e: KernelError = matmul(f32s(&[256, 512]), f32s(&[256, 384]), f32s(&[256, 384]), 128, 128, 256).unwrap_err();
    assert_eq!(e.rule, "operand-shape");
    assert_eq!(e.subject, "input `y`");
    assert!(e.message.contains("`k`") && e.message.contains("256") && e.message.contains("512"), "{e}");
    // Wrong rank.
    let e = matmul(f32s(&[256]), f32s(&[256, 384]), f32s(&[256, 384]), 128, 128, 256).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("operand-shape", "input `x`"));
    assert!(e.message.contains("rank 2"), "{e}");
    // A zero block size is an error, not a division by zero.
    let e = matmul(f32s(&[256, 512]), f32s(&[512, 384]), f32s(&[256, 384]), 0, 128, 256).unwrap_err();
    assert_eq!(e.rule, "grid-extent");
    // An operand smaller than its block gives an empty grid dim.
    let e = matmul(f32s(&[64, 512]), f32s(&[512, 384]), f32s(&[64, 384]), 128, 128, 256).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("grid-extent", "grid"));
}

/// Elementwise with static scalars, methods, sigmoid and a squeezed dim.
#[tpu_kernel(
    grid = [b, r / br],
    x = block([None, br, 128], |i, j| [i, j, 0]),
    out = block([None, br, 128], |i, j| [i, j, 0]),
)]
fn gelu_ish(x: In<b, r, 128>, out: Out<b, r, _>, br: usize, scale: f32) {
    let v = x[..].cast(f32);
    let inv = 1.0 / (br as f32).sqrt(); // static: evaluated by Rust at build time
    let y = v * sigmoid(v * 1.702) * scale + inv;
    let z = y.max(0.0).min(6.0).exp().tanh();
    out[..] = (z - y.abs()).cast(out.dtype);
}

#[test]
fn elementwise() {
    let k = gelu_ish(f32s(&[2, 64, 128]), f32s(&[2, 64, 128]), 16, 0.5).unwrap();
    println!("{k}");
    assert_eq!(k.grid.iter().map(|g| g.extent).collect::<Vec<_>>(), vec![2, 4]);
    assert!(format!("{k}").contains("block [squeezed,16,128] at (g0, g1, 0)"));
    // sigmoid = neg, exp, add, div
    assert_eq!(count(&k, |i| matches!(i, Inst::Unary(tessera_dsl::UnaryOp::Exp, _))), 2);
    assert_eq!(count(&k, |i| matches!(i, Inst::Unary(tessera_dsl::UnaryOp::Neg, _))), 1);
    assert_eq!(count(&k, |i| matches!(i, Inst::Unary(tessera_dsl::UnaryOp::Tanh, _))), 1);
    // The static `inv` is one constant, not IR arithmetic.
    let inv = 1.0 / 16f64.sqrt();
    assert!(k.insts.iter().any(|d| matches!(d.inst, Inst::Const(tessera_dsl::Scalar::Float(c)) if (c - inv).abs() < 1e-6)));
    // The literal 128 dim is checked.
    let e = gelu_ish(f32s(&[2, 64, 100]), f32s(&[2, 64, 100]), 16, 0.5).unwrap_err();
    assert!(e.message.contains("requires 128"), "{e}");
}

/// Row softmax: reductions with keepdims, broadcasting.
#[tpu_kernel(grid = [r / br], x = block([br, c], |i| [i, 0]), out = block([br, c], |i| [i, 0]))]
fn softmax(x: In<r, c>, out: Out<r, c>, br: usize) {
    let v = x[..];
    let m = v.reduce_max(1);
    let e = (v - m).exp();
    out[..] = e / e.sum(1);
}

#[test]
fn reductions() {
    let k = softmax(f32s(&[64, 256]), f32s(&[64, 256]), 8).unwrap();
    let text = format!("{k}");
    println!("{text}");
    assert!(text.contains("f32[8,1] = reduce.max"), "{text}");
    assert!(text.contains("f32[8,1] = reduce.sum"), "{text}");
    assert_eq!(count(&k, |i| matches!(i, Inst::Broadcast(_))), 2);
}

/// A loop over column chunks carrying two IR variables, with a dynamic `if` inside,
/// a value-producing `if`, and a static `if` (build-time specialisation).
#[tpu_kernel(grid = [r / 8], x = block([8, c], |i| [i, 0]), out = block([8, 128], |i| [i, 0]))]
fn chunked(x: In<r, c>, out: Out<r, 128>, use_max: bool) {
    let mut acc = zeros([8, 128], f32);
    let mut hits = full([], i32, 0);
    let nchunks = c / 128;
    for j in 0..nchunks {
        let blk = x[(.., ds(j * 128, 128))];
        if use_max {
            acc = acc.max(blk);
        } else {
            acc += blk;
        }
        if j % 2 == 0 {
            hits += 1;
        }
    }
    let bonus = if program_id(0) == 0 { hits.cast(f32) } else { full([], f32, 0.0) };
    out[..] = acc + bonus;
}

#[test]
fn loops_and_ifs() {
    let k = chunked(f32s(&[16, 512]), f32s(&[16, 128]), false).unwrap();
    let text = format!("{k}");
    println!("{text}");
    let fors: Vec<_> = insts(&k).into_iter().filter_map(|i| if let Inst::For { init, step, .. } = i { Some((init.len(), step)) } else { None }).collect();
    assert_eq!(fors, vec![(2, 1)], "one loop carrying acc and hits");
    // The static `if use_max` picked `+=`; no max instruction in the loop.
    assert_eq!(count(&k, |i| matches!(i, Inst::Binary(tessera_dsl::BinaryOp::Max, ..))), 0);
    let k2 = chunked(f32s(&[16, 512]), f32s(&[16, 128]), true).unwrap();
    assert_eq!(count(&k2, |i| matches!(i, Inst::Binary(tessera_dsl::BinaryOp::Max, ..))), 1);
    // The dynamic `if j % 2 == 0` yields the updated `hits`; the value `if` yields `bonus`.
    let ifs: Vec<usize> = k.insts.iter().filter(|d| matches!(d.inst, Inst::If { .. })).map(|d| d.results.len()).collect();
    assert_eq!(ifs, vec![1, 1]);
    assert!(text.contains("step 1 carry ("), "{text}");
}

/// Scalar prefetch in index maps and in the body, an SMEM table, SMEM scratch,
/// a stepped loop with dynamic bounds, `dot_t`, `iota`, `select`, else-if chains.
#[tpu_kernel(
    grid = [g, n / bn],
    semantics = [arbitrary, parallel],
    q = block([bm, d], |i, j| [ids[i], 0]),
    k = block([bn, d], |i, j| [min(j + offs[(i, 0)], n / bn - 1), 0]),
    out = block([bm, bn], |i, j| [ids[i], j]),
    cnt = scratch_smem([4], i32),
)]
fn gather(ids: Prefetch<g>, offs: Prefetch<g, 2>, table: Smem<4>, q: In<_, d>, k: In<n, d>, out: Out<_, n>, cnt: Scratch, bm: usize, bn: usize) {
    let lim = ids[program_id(0)] + table[2];
    cnt[0] = lim;
    let s = dot_t(q[..], k[..]) * (1.0 / (d as f32).sqrt());
    let col = iota([bm, bn], 1);
    let mut s2 = select(col < lim, s, -1e30);
    for t in (0..lim).step_by(2) {
        if t == 0 {
            s2 = s2 * 2.0;
        } else if t == 2 {
            s2 = s2 - 1.0;
        } else {
            cnt[1] = t;
        }
    }
    out[..] = s2;
}

#[test]
fn prefetch_smem_and_control_flow() {
    let i32s = |s: &[usize]| Type::vector(DType::I32, s);
    let k = gather(i32s(&[3]), i32s(&[3, 2]), i32s(&[4]), f32s(&[32, 128]), f32s(&[256, 128]), f32s(&[32, 256]), 8, 128).unwrap();
    let text = format!("{k}");
    println!("{text}");
    assert!(text.contains("@0 ids: prefetch i32[3] smem"), "{text}");
    assert!(text.contains("@2 table: input i32[4] smem"), "{text}");
    assert!(text.contains("at (@0[g0], 0)"), "{text}");
    assert!(text.contains("at (min((g1 + @1[g0, 0]), 1), 0)"), "{text}");
    assert!(text.contains("@6 cnt: scratch i32[4] smem"), "{text}");
    assert!(text.contains("dot %"), "{text}");
    assert_eq!(count(&k, |i| matches!(i, Inst::Dot { transpose_rhs: true, .. })), 1);
    assert_eq!(count(&k, |i| matches!(i, Inst::Select { .. })), 1);
    assert_eq!(count(&k, |i| matches!(i, Inst::For { step: 2, .. })), 1);
    assert_eq!(count(&k, |i| matches!(i, Inst::If { .. })), 2);
    assert_eq!(GATHER_SIGNATURE, "gather(ids: Prefetch[g], offs: Prefetch[g, 2], table: Smem[4], q: In[_, d], k: In[n, d], out: Out[_, n]; bm: usize, bn: usize)");
    // Prefetch operands must be i32.
    let e = gather(f32s(&[3]), i32s(&[3, 2]), i32s(&[4]), f32s(&[32, 128]), f32s(&[256, 128]), f32s(&[32, 256]), 8, 128).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("operand-dtype", "prefetch `ids`"));
}

/// `dot_tn(a, b)` is `a.T @ b`: a dot with a transposed lhs, contracting the rows.
#[tpu_kernel(grid = [1], a = block([16, 128], |i| [0, 0]), b = block([16, 256], |i| [0, 0]), out = block([128, 256], |i| [0, 0]))]
fn gram(a: In<r, k>, b: In<r, n>, out: Out<k, n>) {
    out[..] = dot_tn(a[..], b[..]);
}

#[test]
fn dot_tn_transposes_lhs() {
    let k = gram(f32s(&[16, 128]), f32s(&[16, 256]), f32s(&[128, 256])).unwrap();
    assert_eq!(count(&k, |i| matches!(i, Inst::Dot { transpose_lhs: true, transpose_rhs: false, .. })), 1);
}

/// Builder type errors surface from the generated function with the user's line.
#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn bad_types(x: In<8, 128>, out: Out<8, 128>) {
    let v = x[..];
    out[..] = v.sum(5);
}

#[test]
fn builder_errors_carry_locations() {
    let e = bad_types(f32s(&[8, 128]), f32s(&[8, 128])).unwrap_err();
    assert_eq!(e.rule, "reduce-axis");
    let line = include_str!("expand.rs").lines().position(|l| l.contains("out[..] = v.sum(5);")).unwrap() + 1;
    assert_eq!(e.loc.unwrap().line as usize, line);
}

/// No grid (one program instance), `r.shape`, static value `if`, static annotated
/// `let`, nested blocks and `_` loop variables.
#[tpu_kernel(x = block([8, 128], || [0, 0]), out = block([8, 128], || [0, 0]))]
fn misc(x: In<8, 128>, out: Out<8, 128>, double: bool) {
    let rows: usize = x.shape[0];
    let factor = if double { 2.0 } else { 1.0 };
    let v = if rows > 4 { x[..] * factor } else { x[..] };
    let mut w = v;
    {
        let t = w.t().t();
        w = t.reshape([1024]).reshape([8, 128]);
    }
    for _ in 1..(rows / 2) {
        w = w - v;
    }
    let scale = x[(0..1, ..)].broadcast_to([8, 128]);
    out[..] = w * scale;
}

#[test]
fn misc_features() {
    assert_eq!(MISC_SIGNATURE, "misc(x: In[8, 128], out: Out[8, 128]; double: bool)");
    let k = misc(f32s(&[8, 128]), f32s(&[8, 128]), true).unwrap();
    let text = format!("{k}");
    println!("{text}");
    assert!(k.grid.is_empty());
    assert!(text.contains("const 2.0"), "{text}");
    assert_eq!(count(&k, |i| matches!(i, Inst::Transpose(_))), 2);
    assert_eq!(count(&k, |i| matches!(i, Inst::Reshape(_))), 2);
    assert_eq!(count(&k, |i| matches!(i, Inst::For { .. })), 1);
    assert!(text.contains("f32[1,128] = load @0["), "{text}");
}

/// Double-buffered gather of pages from an HBM (`Any`) operand through VMEM scratch, with
/// DMA semaphores: `o[s] = sum_j x[idx[s * n + j]]`.
#[tpu_kernel(
    grid = [steps],
    o = block([None, r, d], |s| [s, 0, 0]),
    buf = scratch([2, r, d], f32),
    sem = semaphores(2),
)]
pub fn gather_pages(idx: Prefetch<_>, x: Any<p, r, d>, o: Out<steps, r, d>, buf: Scratch, sem: Scratch, n: usize) {
    let base = program_id(0) * n;
    dma_start(x[idx[base]], buf[0], sem[0]);
    let mut acc = zeros([r, d], f32);
    for j in 0..n {
        let slot = j % 2;
        if j + 1 < n {
            dma_start(x[idx[base + j + 1]], buf[1 - slot], sem[1 - slot]);
        }
        dma_wait(x[idx[base + j]], buf[slot], sem[slot]);
        acc = acc + buf[(slot, .., ..)].reshape([r, d]);
    }
    o[..] = acc;
}

#[test]
fn dma_kernel_builds_and_runs() {
    use tessera_dsl::interp::{self, Array};
    use tessera_dsl::MemorySpace;
    let (pages, steps, n) = (5usize, 3usize, 3usize);
    let k = gather_pages(Type::vector(DType::I32, &[steps * n]), f32s(&[pages, 8, 128]), f32s(&[steps, 8, 128]), n).unwrap();
    let text = format!("{k}");
    assert!(text.contains("@1 x: input f32[5,8,128] any"), "{text}");
    assert!(text.contains("@4 sem: scratch i32[2] semaphore_mem"), "{text}");
    assert_eq!(k.refs[4].memory, MemorySpace::Semaphore);
    assert_eq!(count(&k, |i| matches!(i, Inst::DmaStart { .. })), 2);
    assert_eq!(count(&k, |i| matches!(i, Inst::DmaWait { .. })), 1);
    tessera_dsl::verify::verify(&k, &tessera_dsl::Target::V6E).unwrap();
    let idx: Vec<i32> = (0..steps * n).map(|i| ((i * 2 + 1) % pages) as i32).collect();
    let x: Vec<f32> = (0..pages * 8 * 128).map(|e| (e % 13) as f32).collect();
    let out = interp::run(&k, &[&Array::from_i32(&[steps * n], idx.clone()), &Array::from_f32(&[pages, 8, 128], x.clone())]).unwrap();
    let got = out[0].to_f32_vec();
    for s in 0..steps {
        for e in 0..8 * 128 {
            let want: f32 = (0..n).map(|j| x[idx[s * n + j] as usize * 1024 + e]).sum();
            assert_eq!(got[s * 1024 + e], want);
        }
    }
}

// ---- fragments (#[tpu_fn]) ----------------------------------------------------------------

mod fragments {
    use tessera_dsl::interp::{self, Array};
    use tessera_dsl::{DType, Type};
    use tessera_macros::{tpu_fn, tpu_kernel};

    /// `x * scale + shift`, a static parameter and two IR values.
    #[tpu_fn]
    fn affine(x: Value, shift: Value, scale: f32) -> Value {
        x * scale + shift
    }

    /// Two results, and a fragment calling another one.
    #[tpu_fn]
    fn both(x: Value, y: Value) -> (Value, Value) {
        let a = affine(x, y, 2.0);
        (a, x.max(y))
    }

    #[tpu_kernel(
        grid = [m / bm],
        x = block([bm, n], |i| [i, 0]),
        y = block([bm, n], |i| [i, 0]),
        out = block([bm, n], |i| [i, 0]),
        top = block([bm, n], |i| [i, 0]),
    )]
    fn uses_fragments(x: In<m, n>, y: In<m, n>, out: Out<m, n>, top: Out<m, n>, bm: usize) {
        // At the top level of the body, and inside a dynamic branch.
        let (a, b) = both(x[..], y[..]);
        out[..] = a;
        top[..] = b;
        if program_id(0) == 1 {
            out[..] = affine(x[..], y[..], 3.0);
        }
    }

    #[test]
    fn fragments_inline_into_the_caller() {
        let t = Type::vector(DType::F32, &[16, 128]);
        let k = uses_fragments(t.clone(), t.clone(), t.clone(), t, 8).unwrap();
        let x: Vec<f32> = (0..16 * 128).map(|i| (i % 7) as f32).collect();
        let y: Vec<f32> = (0..16 * 128).map(|i| (i % 5) as f32).collect();
        let out = interp::run(&k, &[&Array::from_f32(&[16, 128], x.clone()), &Array::from_f32(&[16, 128], y.clone())]).unwrap();
        let (o, t) = (out[0].as_f32().unwrap(), out[1].as_f32().unwrap());
        for i in 0..16 * 128 {
            let scale = if i >= 8 * 128 { 3.0 } else { 2.0 };
            assert_eq!(o[i], x[i] * scale + y[i], "element {i}");
            assert_eq!(t[i], x[i].max(y[i]));
        }
    }
}

/// A user's names may be anything a Rust name may be: a static and a local called like the
/// macro's own internals once were (`__b`, `__x`) build and compute as written.
#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
pub fn user_names(x: In<8, 128>, out: Out<8, 128>, __b: f32) {
    let __x = x[..] * __b;
    out[..] = __x;
}

#[test]
fn user_names_that_look_internal_build() {
    let k = user_names(f32s(&[8, 128]), f32s(&[8, 128]), 2.0).unwrap();
    let x = tessera_dsl::interp::Array::from_f32(&[8, 128], (0..1024).map(|i| i as f32).collect());
    let out = tessera_dsl::interp::run(&k, &[&x]).unwrap();
    assert_eq!(out[0].as_f32().unwrap()[5], 10.0);
}
