//! Nested pipelining (issue 16 item 5, Pallas `pltpu.emit_pipeline`):
//! `KernelBuilder::emit_pipeline` streams sub-blocks of ANY operands through
//! double-buffered VMEM with the DMA generated. Shown on the interpreter and the compiled
//! backends against f64 references written here: a matmul streaming a long K dimension of
//! an HBM weight (an input pipe with a loop carry), an elementwise map from HBM to HBM
//! (an input and an output pipe, 1..=5 steps so the prologue and epilogue edge cases run),
//! the builder's and verifier's errors (not ANY, sub-block shape, sub-block tiling, VMEM
//! budget), and (libtpu tier) that libtpu compiles them for v5e, v6e and tpu7x.

use tessera_codegen::cpu::{cache_stats, Backend};
use tessera_dsl::interp::Array;
use tessera_dsl::verify::verify;
use tessera_macros::tpu_kernel;
use tessera_dsl::{exec, ds, BlockSpec, DType, Index, IndexExpr, Kernel, KernelBuilder, KernelError, MemorySpace, Pipe, RefKind, Semantics, Target};

fn backends() -> Vec<Backend> {
    let mut v = vec![Backend::Interp, Backend::Jit];
    if cfg!(feature = "llvm") {
        v.push(Backend::Llvm);
    }
    v
}

/// Runs on every backend (the compiled ones must not fall back) and returns each result.
fn run_all(k: &Kernel, args: &[&Array]) -> Vec<(Backend, Vec<Array>)> {
    backends()
        .into_iter()
        .map(|be| {
            let before = cache_stats().fallbacks;
            let out = exec::run(be.executor(), k, args).unwrap_or_else(|e| panic!("{be:?}: {e}"));
            assert_eq!(cache_stats().fallbacks, before, "{be:?} fell back to the interpreter for `{}`", k.name);
            (be, out)
        })
        .collect()
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 32.0).collect()
}

/// `o = x @ w`, grid over row blocks of `tm`; `w [k, n]` stays in HBM and is streamed in
/// `[tk, n]` sub-blocks, `x`'s matching columns sliced from its VMEM block.
fn streamed_matmul(m: usize, k: usize, n: usize, tm: usize, tk: usize, dtype: DType) -> Result<Kernel, KernelError> {
    let mut b = KernelBuilder::new("streamed_matmul");
    b.grid(&[(m / tm, Semantics::Parallel)]);
    let x = b.input("x", dtype, &[m, k], BlockSpec { block_shape: vec![Some(tm), Some(k)], index_map: vec![IndexExpr::grid(0), 0.into()] });
    let w = b.unblocked(RefKind::Input, "w", dtype, &[k, n], MemorySpace::Any);
    let o = b.output("o", dtype, &[m, n], BlockSpec { block_shape: vec![Some(tm), Some(n)], index_map: vec![IndexExpr::grid(0), 0.into()] });
    let acc = b.zeros(&[tm, n], DType::F32);
    let map = |_: &mut KernelBuilder, i: tessera_dsl::Value| -> Vec<tessera_dsl::Arg> { vec![i.into(), 0.into()] };
    let out = b.emit_pipeline("wk", k / tk, &[Pipe::new(w, &[tk, n], &map)], &[acc], |b, i, blocks, carries| {
        let start = b.mul(i, tk as i64);
        let xs = b.load(x, &[Index::Full, ds(start, tk)]);
        let wb = b.pipe_load(&blocks[0]);
        let d = b.dot(xs, wb, false, false);
        vec![b.add(carries[0], d)]
    });
    let r = b.cast(out[0], dtype);
    b.store(o, &[Index::Full, Index::Full], r);
    b.finish()
}

/// `o[i-th row block] = x[i-th row block] * 2 + i`, HBM to HBM, in `[rb, c]` sub-blocks,
/// one pipeline per grid step over `steps` sub-blocks of that step's rows.
fn streamed_map(steps: usize, grid: usize, rb: usize, c: usize, dtype: DType) -> Result<Kernel, KernelError> {
    let r = steps * grid * rb;
    let mut b = KernelBuilder::new("streamed_map");
    b.grid(&[(grid, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", dtype, &[r, c], MemorySpace::Any);
    let o = b.unblocked(RefKind::Output, "o", dtype, &[r, c], MemorySpace::Any);
    let g = b.program_id(0);
    let base = b.mul(g, steps as i64);
    let map = move |b: &mut KernelBuilder, i: tessera_dsl::Value| -> Vec<tessera_dsl::Arg> { vec![b.add(base, i).into(), 0.into()] };
    b.emit_pipeline("rows", steps, &[Pipe::new(x, &[rb, c], &map), Pipe::new(o, &[rb, c], &map)], &[], |b, i, blocks, _| {
        let v = b.pipe_load(&blocks[0]);
        let v = b.cast(v, DType::F32);
        let step = b.cast(i, DType::F32);
        let y = b.mul(v, 2.0);
        let y = b.add(y, step);
        let y = b.cast(y, dtype);
        b.pipe_store(&blocks[1], y);
        vec![]
    });
    b.finish()
}

/// The macro form of [`streamed_matmul`]: `for j in pipeline(steps)` with `pipe_in`.
#[tpu_kernel(grid = [m / tm], x = block([tm, k], |i| [i, 0]), o = block([tm, n], |i| [i, 0]))]
fn streamed_matmul_macro(x: In<m, k>, w: Any<k, n>, o: Out<m, n>, tm: usize, tk: usize) {
    let mut acc = zeros([tm, n], f32);
    for j in pipeline(k / tk) {
        acc = acc + dot(x[(.., ds(j * tk, tk))], pipe_in(w, [tk, n], [j, 0]));
    }
    o[..] = acc.cast(o.dtype);
}

/// The macro form of [`streamed_map`]: HBM to HBM with `pipe_in` and `pipe_out`.
#[tpu_kernel(grid = [grid])]
fn streamed_map_macro(x: Any<r, c>, o: AnyOut<r, c>, steps: usize, grid: usize, rb: usize) {
    let base = program_id(0) * steps;
    for i in pipeline(steps) {
        let v = pipe_in(x, [rb, c], [base + i, 0]).cast(f32);
        pipe_out(o, [rb, c], [base + i, 0], (v * 2.0 + i.cast(f32)).cast(o.dtype));
    }
}

#[test]
fn the_macro_form_builds_the_same_pipelines() {
    for dtype in [DType::F32, DType::BF16] {
        let (m, k, n, tm, tk) = (32, 1024, 256, 16, 256);
        let t = |s: &[usize]| tessera_dsl::Type { dtype, shape: s.to_vec() };
        let mac = streamed_matmul_macro(t(&[m, k]), t(&[k, n]), t(&[m, n]), tm, tk).unwrap();
        let x = Array::from_f32_in(dtype, &[m, k], data(m * k, 1));
        let w = Array::from_f32_in(dtype, &[k, n], data(k * n, 2));
        let want = exec::run(Backend::Interp.executor(), &streamed_matmul(m, k, n, tm, tk, dtype).unwrap(), &[&x, &w]).unwrap();
        for (be, out) in run_all(&mac, &[&x, &w]) {
            assert_eq!(out[0].to_f64_vec(), want[0].to_f64_vec(), "{be:?} {dtype}: macro and builder pipelines differ");
        }
        for steps in [1, 3, 4] {
            let (grid, rb, c) = (2, 8, 256);
            let r = steps * grid * rb;
            let mac = streamed_map_macro(t(&[r, c]), t(&[r, c]), steps, grid, rb).unwrap();
            let x = Array::from_f32_in(dtype, &[r, c], data(r * c, steps));
            let want = exec::run(Backend::Interp.executor(), &streamed_map(steps, grid, rb, c, dtype).unwrap(), &[&x]).unwrap();
            for (be, out) in run_all(&mac, &[&x]) {
                assert_eq!(out[0].to_f64_vec(), want[0].to_f64_vec(), "{be:?} {dtype} steps={steps}: macro and builder pipelines differ");
            }
        }
    }
}

#[test]
fn a_streamed_k_dimension_matches_the_reference() {
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, tm, tk) in [(16, 512, 128, 8, 128), (32, 1024, 256, 16, 256), (8, 128, 128, 8, 128)] {
            let kern = streamed_matmul(m, k, n, tm, tk, dtype).unwrap();
            verify(&kern, &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
            let x = Array::from_f32_in(dtype, &[m, k], data(m * k, 1));
            let w = Array::from_f32_in(dtype, &[k, n], data(k * n, 2));
            let (xv, wv) = (x.to_f64_vec(), w.to_f64_vec());
            for (be, out) in run_all(&kern, &[&x, &w]) {
                let got = out[0].to_f64_vec();
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|p| xv[i * k + p] * wv[p * n + j]).sum();
                        let tol = if dtype == DType::BF16 { want.abs() / 64.0 + 0.05 } else { 1e-3 };
                        let g = got[i * n + j];
                        assert!((g - want).abs() <= tol, "{be:?} {dtype} {m}x{k}x{n} [{i}, {j}]: {g} vs {want}");
                    }
                }
            }
        }
    }
}

#[test]
fn an_hbm_to_hbm_map_covers_every_step_count() {
    for dtype in [DType::F32, DType::BF16] {
        for steps in 1..=5 {
            let (grid, rb, c) = (2, 8, 256);
            let kern = streamed_map(steps, grid, rb, c, dtype).unwrap();
            verify(&kern, &Target::V6E).unwrap_or_else(|e| panic!("{e}"));
            let r = steps * grid * rb;
            let x = Array::from_f32_in(dtype, &[r, c], data(r * c, steps));
            let xv = x.to_f64_vec();
            for (be, out) in run_all(&kern, &[&x]) {
                let got = out[0].to_f64_vec();
                for row in 0..r {
                    let i = (row / rb) % steps;
                    for col in 0..c {
                        let want = xv[row * c + col] * 2.0 + i as f64;
                        let tol = if dtype == DType::BF16 { want.abs() / 128.0 + 1e-6 } else { 1e-6 };
                        let g = got[row * c + col];
                        assert!((g - want).abs() <= tol, "{be:?} {dtype} steps={steps} [{row}, {col}]: {g} vs {want}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_generated_ir_is_double_buffered() {
    let k = streamed_map(4, 1, 8, 128, DType::F32).unwrap();
    let buf = &k.refs[k.find_ref("rows_x_buf0").unwrap().index()];
    assert_eq!((buf.kind, buf.memory, buf.shape.clone()), (RefKind::Scratch, MemorySpace::Vmem, vec![2, 8, 128]));
    let sem = &k.refs[k.find_ref("rows_sem").unwrap().index()];
    assert_eq!((sem.memory, sem.shape.clone()), (MemorySpace::Semaphore, vec![4]));
    let (mut starts, mut waits) = (0, 0);
    k.walk(k.body, &mut |_, d| match d.inst {
        tessera_dsl::Inst::DmaStart { .. } => starts += 1,
        tessera_dsl::Inst::DmaWait { .. } => waits += 1,
        _ => {}
    });
    // Input: prologue start, next start, current wait; output: slot-reuse wait, start,
    // two epilogue waits.
    assert_eq!((starts, waits), (3, 4));
}

#[test]
fn pipeline_mistakes_are_clear_errors() {
    // Not ANY: a blocked VMEM input.
    let mut b = KernelBuilder::new("vmem_pipe");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.input("x", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let map = |_: &mut KernelBuilder, i: tessera_dsl::Value| -> Vec<tessera_dsl::Arg> { vec![i.into(), 0.into()] };
    b.emit_pipeline("p", 1, &[Pipe::new(x, &[8, 128], &map)], &[], |_, _, _, _| vec![]);
    let z = b.zeros(&[8, 128], DType::F32);
    b.store(o, &[Index::Full, Index::Full], z);
    let e = b.finish().unwrap_err();
    assert_eq!(e.rule, "pipeline-operand");
    assert!(e.to_string().contains("Any<..>"), "{e}");
    // A sub-block of the wrong rank, and one larger than the array.
    for block in [vec![8], vec![16, 128]] {
        let mut b = KernelBuilder::new("bad_block");
        b.grid(&[(1, Semantics::Parallel)]);
        let x = b.unblocked(RefKind::Input, "x", DType::F32, &[8, 128], MemorySpace::Any);
        b.emit_pipeline("p", 1, &[Pipe::new(x, &block, &map)], &[], |_, _, _, _| vec![]);
        assert_eq!(b.finish().unwrap_err().rule, "pipeline-operand");
    }
    // Zero steps.
    let mut b = KernelBuilder::new("no_steps");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[8, 128], MemorySpace::Any);
    b.emit_pipeline("p", 0, &[Pipe::new(x, &[8, 128], &map)], &[], |_, _, _, _| vec![]);
    assert_eq!(b.finish().unwrap_err().rule, "pipeline-operand");
}

#[test]
fn the_verifier_checks_sub_block_tiling_and_the_buffers_budget() {
    // 100 lanes: not a multiple of 128, not the whole dim (the generated DMA's rule).
    let k = {
        let mut b = KernelBuilder::new("lanes");
        b.grid(&[(1, Semantics::Parallel)]);
        let x = b.unblocked(RefKind::Input, "x", DType::F32, &[16, 256], MemorySpace::Any);
        let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
        let map = |_: &mut KernelBuilder, i: tessera_dsl::Value| -> Vec<tessera_dsl::Arg> { vec![i.into(), 0.into()] };
        b.emit_pipeline("p", 2, &[Pipe::new(x, &[8, 100], &map)], &[], |_, _, _, _| vec![]);
        let z = b.zeros(&[8, 128], DType::F32);
        b.store(o, &[Index::Full, Index::Full], z);
        b.finish().unwrap()
    };
    let e = verify(&k, &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "dma-slice-size", "{e}");
    // Two slots of a 4096 x 2048 f32 sub-block: 64 MiB, past every default scoped limit.
    let mut b = KernelBuilder::new("huge");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[8192, 2048], MemorySpace::Any);
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let map = |_: &mut KernelBuilder, i: tessera_dsl::Value| -> Vec<tessera_dsl::Arg> { vec![i.into(), 0.into()] };
    b.emit_pipeline("p", 2, &[Pipe::new(x, &[4096, 2048], &map)], &[], |_, _, _, _| vec![]);
    let z = b.zeros(&[8, 128], DType::F32);
    b.store(o, &[Index::Full, Index::Full], z);
    let k = b.finish().unwrap();
    for t in [Target::V5E, Target::V6E, Target::TPU7X] {
        let e = verify(&k, &t).unwrap_err();
        assert_eq!(e.rule, "vmem-budget", "{t}: {e}");
    }
}

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`): the pipelines above compile for v5e, v6e
/// and tpu7x.
#[test]
fn libtpu_compiles_nested_pipelines_for_v5e_v6e_tpu7x() {
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let mut kernels = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        kernels.push(streamed_matmul(32, 1024, 256, 16, 256, dtype).unwrap());
        kernels.push(streamed_matmul(16, 512, 128, 16, 128, dtype).unwrap());
        for steps in [1, 2, 5] {
            kernels.push(streamed_map(steps, 2, 16, 256, dtype).unwrap());
        }
        let t = |s: &[usize]| tessera_dsl::Type { dtype, shape: s.to_vec() };
        kernels.push(streamed_matmul_macro(t(&[32, 1024]), t(&[1024, 256]), t(&[32, 256]), 16, 256).unwrap());
        kernels.push(streamed_map_macro(t(&[96, 256]), t(&[96, 256]), 3, 2, 16).unwrap());
        kernels.push(rmsnorm_two_pass(t(&[16, 4096]), t(&[16, 4096]), 8, 512).unwrap());
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        // The library's pipelined wide RMSNorm, as its plans build it for this target.
        let mut kernels = kernels.clone();
        let op = tessera_kernels::find("rmsnorm").unwrap();
        for dtype in [DType::F32, DType::BF16] {
            for (m, n) in [(8, 262144), (32, 262144)] {
                let plan = op.plan_for(&op.types(&[vec![m, n], vec![n]], dtype), &op.statics("").unwrap(), &target).unwrap();
                kernels.extend(plan.launches.into_iter().map(|l| l.kernel).filter(|k| k.name == "rmsnorm_pipelined_kernel"));
            }
        }
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}

/// Two pipelines in one kernel: RMSNorm of rows too wide for VMEM, HBM to HBM, in one
/// launch (sum of squares over column sub-blocks, then the scaled row).
#[tpu_kernel(grid = [m / bm])]
fn rmsnorm_two_pass(x: Any<m, n>, o: AnyOut<m, n>, bm: usize, bn: usize) {
    let i = program_id(0);
    let mut ss = zeros([bm, 1], f32);
    for j in pipeline(n / bn) {
        let v = pipe_in(x, [bm, bn], [i, j]).cast(f32);
        ss = ss + (v * v).sum(1);
    }
    let r = (ss * (1.0 / n as f32) + 1e-6).rsqrt();
    for j in pipeline(n / bn) {
        let v = pipe_in(x, [bm, bn], [i, j]).cast(f32);
        pipe_out(o, [bm, bn], [i, j], (v * r).cast(o.dtype));
    }
}

#[test]
fn two_pipelines_in_one_kernel_match_the_reference() {
    for dtype in [DType::F32, DType::BF16] {
        let (m, n, bm, bn) = (16, 4096, 8, 512);
        let t = |s: &[usize]| tessera_dsl::Type { dtype, shape: s.to_vec() };
        let k = rmsnorm_two_pass(t(&[m, n]), t(&[m, n]), bm, bn).unwrap();
        assert!(k.find_ref("pipe0_sem").is_some() && k.find_ref("pipe1_sem").is_some());
        verify(&k, &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
        let x = Array::from_f32_in(dtype, &[m, n], data(m * n, 5));
        let xv = x.to_f64_vec();
        for (be, out) in run_all(&k, &[&x]) {
            let got = out[0].to_f64_vec();
            for row in 0..m {
                let ms: f64 = (0..n).map(|c| xv[row * n + c] * xv[row * n + c]).sum::<f64>() / n as f64;
                let r = 1.0 / (ms + 1e-6).sqrt();
                for c in 0..n {
                    let want = xv[row * n + c] * r;
                    let tol = if dtype == DType::BF16 { want.abs() / 128.0 + 1e-6 } else { 1e-5 * want.abs().max(1.0) };
                    assert!((got[row * n + c] - want).abs() <= tol, "{be:?} {dtype} [{row}, {c}]: {} vs {want}", got[row * n + c]);
                }
            }
        }
    }
}

/// The library's use: `rmsnorm` (and `rmsnorm_residual`'s norm) of rows too wide for VMEM
/// whose blocks divide the shape runs as one pipelined launch, against the op's f64
/// reference on the interpreter and the JIT.
#[test]
fn wide_rmsnorm_is_one_pipelined_launch() {
    use tessera_kernels::harness::run_case;
    let op = tessera_kernels::find("rmsnorm").unwrap();
    for (target, m, n) in [(Target::V5E, 8, 262144), (Target::V6E, 16, 262144)] {
        for dtype in [DType::F32, DType::BF16] {
            let shapes = vec![vec![m, n], vec![n]];
            let plan = op.plan_for(&op.types(&shapes, dtype), &op.statics("").unwrap(), &target).unwrap();
            let names: Vec<&str> = plan.launches.iter().map(|l| l.kernel.name.as_str()).collect();
            assert_eq!(names, ["rmsnorm_pipelined_kernel"], "{target} {dtype} {m}x{n}");
            for be in [Backend::Interp, Backend::Jit] {
                let r = run_case(op, &op.statics("").unwrap(), &shapes, dtype, &target, 7, be.executor()).unwrap_or_else(|e| panic!("{be:?}: {e}"));
                assert!(r.passed(), "{be:?} {target} {dtype}: {:?}", r.outputs);
            }
        }
    }
    // A shape the blocks do not divide keeps the two launches.
    let shapes = vec![vec![6, 300_000], vec![300_000]];
    let plan = op.plan_for(&op.types(&shapes, DType::F32), &op.statics("").unwrap(), &Target::V5E).unwrap();
    assert_eq!(plan.launches.len(), 2);
}
