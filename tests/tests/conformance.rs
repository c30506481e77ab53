//! One conformance suite, instantiated per CPU backend (the interpreter included, as
//! cranelift runs the same `; run:` lines under `test interpret` and `test run`): every
//! library op in f32 and bf16 on its default and alternative shapes against the
//! interpreter (on the JIT every case; LLVM and the interpreter's self-check a stable
//! sample, see `runs_case`); poison and DMA-misuse cases whose errors must be the interpreter's; the
//! parallel-revisit rule; and random kernels (`tessera_tests::conformance::random_case`),
//! bit for bit in the compiled backends' exact mode and within the ulp-derived tolerance in
//! their fast mode. `TESSERA_FUZZ_CASES` sets the random-kernel count per backend and mode
//! (default 10,000; 250 for LLVM; 1,000 for the interpreter against itself).
//!
//! Tolerances in fast mode come from the backends' bounds: transcendentals within 3 ulp
//! (`cpu::cranelift::vector`), dots in another summation order (relative `k * 2^-24` of the
//! sum of magnitudes), everything else bit-exact (sums are in the interpreter's fixed
//! order). For library outputs: f32 `1e-5` of the output's max magnitude, bf16 one bf16 ulp
//! (`2^-7`) of it, since a last-bit difference in f32 can round a bf16 the other way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use tessera_codegen::cpu::{Backend, Compiled};
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, DType, Executor, Interpreter, Target};
use tessera_kernels::{harness, Case, Op};
use tessera_tests::conformance::{check_case, check_kernel, compare, random_case, GenOptions, Tolerance};

/// Random kernels per backend and mode: `TESSERA_FUZZ_CASES`, else 10,000 (250 for LLVM,
/// whose O3 compile of each costs 30-65 ms, so 500 programs a run keep the test command in
/// its budget; its input is the JIT's Cranelift IR, which the JIT's 20,000 already cover;
/// 1,000 for the interpreter, which is compared with itself there: a determinism check, as
/// its library instantiation runs only the small cases; set `TESSERA_FUZZ_CASES` for a
/// longer soak).
fn fuzz_cases(backend: &str) -> u64 {
    let default = match backend {
        "llvm" => 250,
        "interp" => 1_000,
        _ => 10_000,
    };
    std::env::var("TESSERA_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn library_tolerance(dtype: DType) -> Tolerance {
    match dtype {
        DType::BF16 => Tolerance::Scaled(1.0 / 128.0),
        _ => Tolerance::Scaled(1e-5),
    }
}

/// Compiled backends must have compiled everything they ran (no fallback to the interpreter).
fn no_fallbacks(exec: &dyn Executor) {
    if exec.name() != "interp" {
        let s = tessera_codegen::cpu::cache_stats();
        assert_eq!(s.fallbacks, 0, "kernels fell back to the interpreter: {s:?}");
        assert!(s.misses > 0, "nothing was compiled: {s:?}");
    }
}

type OpResult = Result<Vec<Array>, tessera_dsl::KernelError>;
type CaseRun = (Vec<Array>, tessera_kernels::Statics, OpResult);

/// One library op case, run: its inputs (from a fixed seed) and the interpreter's results,
/// computed once per test binary (the three instantiations compare against the same).
fn interp_result(op: &'static Op, case: &'static Case, dtype: DType, target: &Target) -> Arc<CaseRun> {
    static MEMO: OnceLock<Mutex<HashMap<String, Arc<CaseRun>>>> = OnceLock::new();
    let key = format!("{} {} {dtype}", op.name, case.name);
    let memo = MEMO.get_or_init(Default::default);
    if let Some(r) = memo.lock().unwrap().get(&key) {
        return r.clone();
    }
    let statics = op.case_statics(case).unwrap_or_else(|e| panic!("{} case {}: {e}", op.name, case.name));
    let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(7);
    let inputs = harness::inputs_for(op, &shapes, dtype, &statics, &mut rng);
    let given: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
    let want = op.run(&Interpreter, &given, &statics, target);
    let r = Arc::new((inputs, statics, want));
    memo.lock().unwrap().insert(key, r.clone());
    r
}

/// Which library cases an instantiation runs. The JIT runs every case in both dtypes; where
/// a full pass adds little the suite samples stably (by op and case name), so the test
/// command stays in budget: the interpreter against itself a third (a determinism check, on
/// its small cases only), and LLVM a sixth of the cases in each dtype, a different sixth per
/// dtype (its input is the JIT's Cranelift IR, which the JIT runs on every case; its O3
/// compiles are most of this suite's time). `TESSERA_CONFORMANCE_ALL=1` runs every case on
/// every backend.
fn runs_case(backend: &str, dtype: DType, op: &str, case: &str) -> bool {
    if std::env::var_os("TESSERA_CONFORMANCE_ALL").is_some_and(|v| v == "1") {
        return true;
    }
    let one_in = |key: String, every| tessera_tests::oracle::in_stable_sample(&key, every);
    match backend {
        "interp" => case != "default" && one_in(format!("{op}-{case}"), 3),
        "llvm" => one_in(format!("{op}-{case}-{dtype}"), 6),
        _ => true,
    }
}

/// Every case (shape set and statics) of every library op on `exec` vs the interpreter.
fn library(exec: &'static dyn Executor, dtype: DType) {
    let target = Target::V5E;
    let mut failures = Vec::new();
    let mut ran = 0;
    for op in tessera_kernels::library() {
        for case in op.cases {
            if !runs_case(exec.name(), dtype, op.name, case.name) {
                continue;
            }
            let r = interp_result(op, case, dtype, &target);
            let (inputs, statics, want) = (&r.0, &r.1, &r.2);
            let given: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
            let got = op.run(exec, &given, statics, &target);
            ran += 1;
            let what = format!("{} case {} {dtype}", op.name, case.name);
            match (got, want) {
                (Ok(g), Ok(w)) => {
                    for (i, (g, w)) in g.iter().zip(w).enumerate() {
                        let tol = if g.dtype.is_float() { library_tolerance(g.dtype) } else { Tolerance::Exact };
                        if let Err(e) = compare(&format!("output {i}"), g, w, tol) {
                            failures.push(format!("{what}: {e}"));
                        }
                    }
                }
                (Err(g), Err(w)) if g.to_string() == w.to_string() => {}
                (g, w) => failures.push(format!("{what}: {} gives {:?}, interp {:?}", exec.name(), g.err().map(|e| e.to_string()), w.as_ref().err().map(|e| e.to_string()))),
            }
        }
    }
    assert!(ran >= 10, "only {ran} library cases ran");
    eprintln!("{ran} library cases in {dtype} on {}", exec.name());
    assert!(failures.is_empty(), "{} of {ran} cases differ on {}:\n{}", failures.len(), exec.name(), failures.join("\n"));
    no_fallbacks(exec);
}

/// Random kernels on `exec` vs the interpreter.
fn fuzz(exec: &dyn Executor, smooth: bool, tol: Tolerance, seed0: u64) {
    let n = fuzz_cases(exec.name());
    let mut verified = 0;
    for i in 0..n {
        let seed = seed0.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let case = random_case(seed, GenOptions { smooth });
        if tessera_dsl::verify::verify(&case.kernel, &tessera_tests::conformance::target()).is_ok() {
            verified += 1;
        }
        if let Err(e) = check_case(exec, &case, tol) {
            panic!("random kernel {i} (seed {seed:#x}) on {}: {e}", exec.name());
        }
    }
    assert!(n < 100 || verified * 4 >= n, "only {verified} of {n} random kernels pass the verifier");
    eprintln!("{n} random kernels on {} ({verified} verified for {})", exec.name(), tessera_tests::conformance::target());
    no_fallbacks(exec);
}

macro_rules! conformance {
    ($name:ident, $backend:expr) => {
        mod $name {
            use super::*;

            fn exec() -> &'static dyn Executor {
                $backend.executor()
            }

            fn exact() -> &'static dyn Executor {
                static EXACT: std::sync::OnceLock<Compiled> = std::sync::OnceLock::new();
                if $backend == Backend::Interp {
                    return &Interpreter;
                }
                EXACT.get_or_init(|| Compiled { backend: $backend, exact: true, threads: None })
            }

            #[test]
            fn library_f32_every_case() {
                library(exec(), DType::F32);
            }

            #[test]
            fn library_bf16_every_case() {
                library(exec(), DType::BF16);
            }

            #[test]
            fn random_kernels_exact() {
                fuzz(exact(), false, Tolerance::Exact, 1);
            }

            #[test]
            fn random_kernels_fast() {
                fuzz(exec(), true, Tolerance::Abs(1.0 / 64.0), 2);
            }

            #[test]
            fn poison_and_dma_misuse() {
                for (k, args) in super::cases::misuse() {
                    let refs: Vec<&Array> = args.iter().collect();
                    check_kernel(exec(), &k, &refs, Tolerance::Exact).unwrap_or_else(|e| panic!("{}: {e}", k.name));
                }
            }

            #[test]
            fn wrong_operands_are_errors_not_ub() {
                use tessera_dsl::interp::{HostMut, HostRef};
                let k = super::cases::copy();
                let ok_in = vec![0f32; 16 * 128];
                let short = vec![0f32; 100];
                let ints = vec![0i32; 16 * 128];
                let mut out = vec![0f32; 16 * 128];
                let mut out_short = vec![0f32; 10];
                let shape_in: &[usize] = &[16, 128];
                let shape_out: &[usize] = &[16, 128];
                let cases: Vec<(&str, Vec<HostRef<'_>>, bool)> = vec![
                    ("argument-count", vec![], false),
                    ("argument-shape", vec![HostRef::new(shape_in, &short[..])], false),
                    ("argument-dtype", vec![HostRef::new(shape_in, &ints[..])], false),
                    ("argument-shape", vec![HostRef::new(&[8, 128][..], &ok_in[..1024])], false),
                    ("output-shape", vec![HostRef::new(shape_in, &ok_in[..])], true),
                ];
                for (rule, ins, short_out) in cases {
                    let mut outs = if short_out { vec![HostMut::new(shape_out, &mut out_short[..])] } else { vec![HostMut::new(shape_out, &mut out[..])] };
                    let want = tessera_dsl::interp::run_into(&k, &ins, &mut outs).expect_err("interp rejects");
                    let got = exec().run_into(&k, &ins, &mut outs).expect_err("the backend rejects");
                    assert_eq!(got.rule, rule, "{got}");
                    assert_eq!(got.to_string(), want.to_string());
                }
            }

            /// The backends' unsafe code (block copies, the GEMMs, compiled loads and stores)
            /// indexes by the IR's shapes: IR edited after `finish()` so that it lies about
            /// them is an error on every backend, never an out-of-bounds access.
            #[test]
            fn edited_ir_is_an_error_not_ub() {
                let x = Array::from_f32(&[8, 128], vec![1.0; 1024]);
                let y = Array::from_f32(&[128, 128], vec![0.5; 128 * 128]);
                for edit in 0..5 {
                    let mut k = super::cases::matmul_block();
                    let load = k.insts.iter().position(|d| matches!(d.inst, tessera_dsl::Inst::Load { .. })).unwrap();
                    let loaded = k.insts[load].results[0];
                    match edit {
                        0 => k.values[loaded.index()].ty.shape = vec![16, 128], // the load's result claims more rows
                        1 => k.refs[0].dtype = DType::BF16,                     // the input's dtype changed under its loads
                        2 => k.refs[0].shape = vec![8, 64],                     // the array narrower than its block
                        3 => {
                            k.refs.remove(1);                                    // a ref the body uses is gone
                        }
                        _ => k.grid[0].extent = usize::MAX,                      // a grid no program_id can count
                    }
                    let args: Vec<&Array> = if edit == 3 { vec![&x] } else { vec![&x, &y] };
                    let e = exec::run(exec(), &k, &args).expect_err("edited IR must be rejected");
                    assert!(!e.rule.is_empty() && e.to_string().contains(&k.name), "edit {edit}: {e}");
                    eprintln!("edit {edit}: {}", e.to_string().lines().next().unwrap_or(""));
                }
            }

            #[test]
            fn sums_do_not_lose_precision_with_width() {
                use tessera_dsl::{BlockSpec, IndexExpr, KernelBuilder, ReduceOp, Semantics};
                let n = 1 << 20;
                let mut b = KernelBuilder::new("wide_sum");
                b.grid(&[(1, Semantics::Arbitrary)]);
                // One [1, 2^20] f32 row pads to 8 sublanes: 32 MiB per buffer, so ask for more
                // than the default scoped VMEM (v5e and v6e have 128 MiB).
                b.vmem_limit_bytes(96 << 20);
                let spec = |c: usize| BlockSpec { block_shape: vec![Some(1), Some(c)], index_map: vec![IndexExpr::Const(0), IndexExpr::Const(0)] };
                let x = b.input("x", DType::F32, &[1, n], spec(n));
                let o = b.output("o", DType::F32, &[1, 1], spec(1));
                let v = b.load(x, &[]);
                let r = b.reduce(ReduceOp::Sum, v, 1);
                b.store(o, &[], r);
                let k = b.finish().unwrap();
                let xs: Vec<f32> = (0..n).map(|i| 0.1 + (i % 7) as f32 * 1e-3).collect();
                let exact: f64 = xs.iter().map(|&x| x as f64).sum();
                let got = exec::run(exec(), &k, &[&Array::from_f32(&[1, n], xs)]).unwrap().remove(0).to_f64_vec()[0];
                let rel = (got - exact).abs() / exact;
                // A sequential f32 sum is off by ~1e-3 here; the pairwise order keeps ~1e-7.
                assert!(rel < 1e-6, "sum of {n} elements: relative error {rel:e}");
            }

            #[test]
            fn parallel_revisit_is_an_error() {
                let (k, args) = super::cases::racy();
                let refs: Vec<&Array> = args.iter().collect();
                let e = exec::run(exec(), &k, &refs).expect_err("a racy parallel dim must be rejected");
                assert_eq!(e.rule, "parallel-revisit", "{e}");
                let msg = e.to_string();
                assert!(msg.contains(&k.name) && msg.contains("`o`") && msg.contains("grid dim 0"), "{msg}");
            }
        }
    };
}

conformance!(interp, Backend::Interp);
conformance!(jit, Backend::Jit);
#[cfg(feature = "llvm")]
conformance!(llvm, Backend::Llvm);

/// Hand-written kernels whose outcome is an error or poison.
mod cases {
    use tessera_dsl::interp::Array;
    use tessera_dsl::{ds, BlockSpec, DType, Index, IndexExpr, Kernel, KernelBuilder, MemorySpace, RefKind, Semantics};

    fn blocked(rows: usize, cols: usize) -> BlockSpec {
        BlockSpec { block_shape: vec![Some(rows), Some(cols)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] }
    }

    fn x(n: usize) -> Array {
        Array::from_f32(&[16, n], (0..16 * n).map(|i| i as f32 * 0.5 - 3.0).collect())
    }

    /// Kernels that read poison, go out of bounds, or misuse DMA.
    pub fn misuse() -> Vec<(Kernel, Vec<Array>)> {
        let mut out = Vec::new();
        // Never writes its second block: those elements stay poison (NaN).
        let mut b = KernelBuilder::new("half_written");
        b.grid(&[(2, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let pid = b.program_id(0);
        let zero = b.i32(0);
        let first = b.cmp(tessera_dsl::CmpOp::Eq, pid, zero);
        b.when(first, |b| {
            let v = b.load(xi, &[]);
            b.store(o, &[], v);
        });
        out.push((b.finish().unwrap(), vec![x(128)]));
        // Reads its output window before writing it: poison flows into the result.
        let mut b = KernelBuilder::new("reads_output_first");
        b.grid(&[(2, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let prev = b.load(o, &[]);
        let v = b.load(xi, &[]);
        let s = b.add(prev, v);
        b.store(o, &[], s);
        out.push((b.finish().unwrap(), vec![x(128)]));
        // Scratch read before it is written.
        let mut b = KernelBuilder::new("uninit_scratch");
        b.grid(&[(2, Semantics::Arbitrary)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let acc = b.scratch("acc", DType::F32, &[8, 128], MemorySpace::Vmem);
        let a = b.load(acc, &[]);
        let v = b.load(xi, &[]);
        let s = b.add(a, v);
        b.store(o, &[], s);
        out.push((b.finish().unwrap(), vec![x(128)]));
        // A dynamic slice past the block.
        let mut b = KernelBuilder::new("slice_oob");
        b.grid(&[(2, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let pid = b.program_id(0);
        let start = b.mul(pid, 5);
        let row = b.load(xi, &[ds(start, 4), Index::Full]);
        b.store(o, &[ds(0i32, 4), Index::Full], row);
        out.push((b.finish().unwrap(), vec![x(128)]));
        // A store past the block from a loop.
        let mut b = KernelBuilder::new("loop_store_oob");
        b.grid(&[(1, Semantics::Arbitrary)]);
        let o = b.output("o", DType::F32, &[8, 128], blocked(8, 128));
        let lo = b.i32(0);
        let hi = b.i32(9);
        b.for_range(lo, hi, 1, &[], |b, i, _| {
            let z = b.zeros(&[1, 128], DType::F32);
            b.store(o, &[ds(i, 1), Index::Full], z);
            vec![]
        });
        out.push((b.finish().unwrap(), vec![]));
        // DMA: waiting with nothing in flight.
        let mut b = KernelBuilder::new("wait_without_start");
        b.grid(&[(1, Semantics::Arbitrary)]);
        let src = b.unblocked(RefKind::Input, "src", DType::F32, &[8, 128], MemorySpace::Any);
        let o = b.output("o", DType::F32, &[8, 128], blocked(8, 128));
        let buf = b.scratch("buf", DType::F32, &[8, 128], MemorySpace::Vmem);
        let sem = b.semaphores("sem", 2);
        b.dma_wait(src, &[], buf, &[], sem, 1i32);
        let v = b.load(buf, &[]);
        b.store(o, &[], v);
        out.push((b.finish().unwrap(), vec![Array::from_f32(&[8, 128], vec![1.0; 1024])]));
        // DMA: never waited for.
        let mut b = KernelBuilder::new("unwaited");
        b.grid(&[(2, Semantics::Parallel)]);
        let src = b.unblocked(RefKind::Input, "src", DType::F32, &[8, 128], MemorySpace::Any);
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let buf = b.scratch("buf", DType::F32, &[8, 128], MemorySpace::Vmem);
        let sem = b.semaphores("sem", 1);
        b.dma_start(src, &[], buf, &[], sem, 0i32);
        let v = b.load(buf, &[]);
        b.store(o, &[], v);
        out.push((b.finish().unwrap(), vec![Array::from_f32(&[8, 128], vec![1.0; 1024])]));
        // DMA: reading the destination before the wait sees poison; then the data.
        let mut b = KernelBuilder::new("read_before_wait");
        b.grid(&[(1, Semantics::Arbitrary)]);
        let src = b.unblocked(RefKind::Input, "src", DType::F32, &[2, 8, 128], MemorySpace::Any);
        let o = b.output("o", DType::F32, &[8, 128], blocked(8, 128));
        let buf = b.scratch("buf", DType::F32, &[8, 128], MemorySpace::Vmem);
        let sem = b.semaphores("sem", 1);
        b.dma_start(src, &[ds(1i32, 1), Index::Full, Index::Full], buf, &[], sem, 0i32);
        let early = b.load(buf, &[ds(0i32, 4), Index::Full]);
        b.dma_wait(src, &[ds(1i32, 1), Index::Full, Index::Full], buf, &[], sem, 0i32);
        let late = b.load(buf, &[ds(4i32, 4), Index::Full]);
        b.store(o, &[ds(0i32, 4), Index::Full], early);
        b.store(o, &[ds(4i32, 4), Index::Full], late);
        out.push((b.finish().unwrap(), vec![Array::from_f32(&[2, 8, 128], (0..2048).map(|i| i as f32).collect())]));
        // DMA: a semaphore index past the array.
        let mut b = KernelBuilder::new("bad_semaphore");
        b.grid(&[(2, Semantics::Arbitrary)]);
        let src = b.unblocked(RefKind::Input, "src", DType::F32, &[8, 128], MemorySpace::Any);
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let buf = b.scratch("buf", DType::F32, &[8, 128], MemorySpace::Vmem);
        let sem = b.semaphores("sem", 1);
        let pid = b.program_id(0);
        b.dma_start(src, &[], buf, &[], sem, pid);
        b.dma_wait(src, &[], buf, &[], sem, pid);
        let v = b.load(buf, &[]);
        b.store(o, &[], v);
        out.push((b.finish().unwrap(), vec![Array::from_f32(&[8, 128], vec![2.0; 1024])]));
        // A prefetch value that points past the blocks.
        let mut b = KernelBuilder::new("prefetch_oob");
        b.grid(&[(2, Semantics::Parallel)]);
        let p = b.prefetch("p", &[2]);
        let xi = b.input("x", DType::F32, &[16, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::Prefetch { array: p, index: vec![IndexExpr::grid(0)] }, IndexExpr::Const(0)] });
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let v = b.load(xi, &[]);
        b.store(o, &[], v);
        out.push((b.finish().unwrap(), vec![Array::from_i32(&[2], vec![1, 2]), x(128)]));
        // Wrong operands.
        let mut b = KernelBuilder::new("wrong_shape");
        b.grid(&[(2, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let v = b.load(xi, &[]);
        b.store(o, &[], v);
        out.push((b.finish().unwrap(), vec![x(64)]));
        out
    }

    /// `o = x @ y` for one [8, 128] x [128, 128] block.
    pub fn matmul_block() -> Kernel {
        let mut b = KernelBuilder::new("matmul_block");
        b.grid(&[(1, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[8, 128], blocked(8, 128));
        let yi = b.input("y", DType::F32, &[128, 128], blocked(128, 128));
        let o = b.output("o", DType::F32, &[8, 128], blocked(8, 128));
        let (xv, yv) = (b.load(xi, &[]), b.load(yi, &[]));
        let r = b.dot(xv, yv, false, false);
        b.store(o, &[], r);
        b.finish().unwrap()
    }

    /// `o = x` over two [8, 128] blocks.
    pub fn copy() -> Kernel {
        let mut b = KernelBuilder::new("copy");
        b.grid(&[(2, Semantics::Parallel)]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let o = b.output("o", DType::F32, &[16, 128], blocked(8, 128));
        let v = b.load(xi, &[]);
        b.store(o, &[], v);
        b.finish().unwrap()
    }

    /// Two parallel steps write the same output block, through a data-dependent index map
    /// (a scalar-prefetch table of [0, 0]) that no verifier can see through: a static map
    /// of that kind is the verifier's `reduction-axis-semantics`.
    pub fn racy() -> (Kernel, Vec<Array>) {
        let mut b = KernelBuilder::new("racy_sum");
        b.grid(&[(2, Semantics::Parallel)]);
        let table = b.prefetch("block_of", &[2]);
        let xi = b.input("x", DType::F32, &[16, 128], blocked(8, 128));
        let by_table = IndexExpr::Prefetch { array: table, index: vec![IndexExpr::grid(0)] };
        let o = b.output("o", DType::F32, &[16, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![by_table, IndexExpr::Const(0)] });
        let v = b.load(xi, &[]);
        b.store(o, &[], v);
        (b.finish().unwrap(), vec![Array::from_i32(&[2], vec![0, 0]), x(128)])
    }
}

/// Results do not depend on the thread count (library ops whose grids have several units).
#[test]
fn jit_results_identical_on_1_and_n_threads() {
    let one = Compiled { backend: Backend::Jit, exact: false, threads: Some(1) };
    let many = Compiled { backend: Backend::Jit, exact: false, threads: Some(4) };
    let target = Target::V5E;
    let mut ran = 0;
    for name in ["matmul", "softmax", "rmsnorm", "flash_attention_fwd", "gmm", "gelu_affine"] {
        let Some(op) = tessera_kernels::find(name) else { continue };
        let Some(case) = op.cases.first() else { continue };
        let statics = op.case_statics(case).unwrap();
        let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
        let inputs = harness::inputs_for(op, &shapes, DType::F32, &statics, &mut rng);
        let given: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
        let a = op.run(&one, &given, &statics, &target).unwrap();
        let b = op.run(&many, &given, &statics, &target).unwrap();
        for (x, y) in a.iter().zip(&b) {
            compare(name, y, x, Tolerance::Exact).unwrap();
        }
        ran += 1;
    }
    assert!(ran >= 4, "only {ran} ops ran");
}

/// The transcendentals' documented ulp bounds, over a dense sweep and the edge values.
#[test]
fn transcendental_ulp_bounds() {
    use tessera_dsl::{BlockSpec, IndexExpr, KernelBuilder, Semantics, UnaryOp};
    let mut xs: Vec<f32> = vec![0.0, -0.0, 1e-45, -1e-45, 1e-38, 1.17e-38, f32::MIN_POSITIVE, 1.0, -1.0, 0.5, 0.625, -0.625, 0.9999, 1.0001, 3.9, 4.0, 9.0, 44.0, 88.0, 88.72, 89.0, -87.0, -103.0, -104.0, -110.0, 1e30, -1e30, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
    let mut s: u32 = 12345;
    for i in 0..200_000 {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let x = match i % 4 {
            0 => f32::from_bits(s), // every exponent
            1 => (s as f32 / u32::MAX as f32) * 20.0 - 10.0,
            2 => (s as f32 / u32::MAX as f32) * 200.0 - 100.0,
            _ => (s as f32 / u32::MAX as f32) * 2.0 - 1.0,
        };
        xs.push(x);
    }
    let n = xs.len().div_ceil(1024) * 1024;
    xs.resize(n, 0.25);
    let bounds = [
        (UnaryOp::Exp, 2u32),
        (UnaryOp::Log, 2),
        (UnaryOp::Tanh, 3),
        (UnaryOp::Erf, 3),
        (UnaryOp::Sqrt, 0),
        (UnaryOp::Rsqrt, 0),
        (UnaryOp::Log1p, 0),
        (UnaryOp::Expm1, 0),
        (UnaryOp::Sin, 0),
        (UnaryOp::Cos, 0),
        (UnaryOp::Floor, 0),
        (UnaryOp::Ceil, 0),
        (UnaryOp::Round, 0),
        (UnaryOp::Sign, 0),
    ];
    let ulps = |a: f32, b: f32| -> u32 {
        if a.is_nan() && b.is_nan() || a == b {
            return 0;
        }
        if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() {
            return u32::MAX;
        }
        let key = |x: f32| -> i64 {
            let b = x.to_bits() as i32 as i64;
            if b < 0 { i32::MIN as i64 - b } else { b }
        };
        (key(a) - key(b)).unsigned_abs() as u32
    };
    for (op, bound) in bounds {
        let mut b = KernelBuilder::new(&format!("ulp_{}", op.name()));
        b.grid(&[(n / 128 / 8, Semantics::Parallel)]);
        let spec = BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
        let rows = n / 128;
        let grid_rows = rows / 8 * 8;
        let _ = grid_rows;
        let xi = b.input("x", DType::F32, &[rows, 128], spec.clone());
        let o = b.output("o", DType::F32, &[rows, 128], spec);
        let v = b.load(xi, &[]);
        let r = b.unary(op, v);
        b.store(o, &[], r);
        let k = b.finish().unwrap();
        let input = Array::from_f32(&[rows, 128], xs.clone());
        let want = tessera_dsl::interp::run(&k, &[&input]).unwrap().remove(0);
        let got = exec::run(Backend::Jit.executor(), &k, &[&input]).unwrap().remove(0);
        let (w, g) = (want.as_f32().unwrap(), got.as_f32().unwrap());
        let mut worst = (0u32, 0.0f32);
        for i in 0..rows / 8 * 8 * 128 {
            let u = ulps(g[i], w[i]);
            if u > worst.0 {
                worst = (u, xs[i]);
            }
        }
        assert!(worst.0 <= bound, "{}: {} ulp at x = {:e} ({:e} vs interp {:e}); bound {bound}", op.name(), worst.0, worst.1, g[xs.iter().position(|&x| x.to_bits() == worst.1.to_bits()).unwrap()], w[xs.iter().position(|&x| x.to_bits() == worst.1.to_bits()).unwrap()]);
        eprintln!("{}: max {} ulp (bound {bound})", op.name(), worst.0);
    }
}

/// Cranelift compile time per library kernel (every case, f32 and bf16): median and max.
#[test]
fn jit_compile_time_per_library_kernel() {
    let target = Target::V5E;
    let mut times = Vec::new();
    for op in tessera_kernels::library() {
        for case in op.cases {
            for dtype in [DType::F32, DType::BF16] {
                let Ok(statics) = op.case_statics(case) else { continue };
                let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
                let Ok(plan) = op.plan_for(&op.types(&shapes, dtype), &statics, &target) else { continue };
                for l in &plan.launches {
                    let k = &l.kernel;
                    let modes = tessera_codegen::cpu::layout::default_modes(k, &[]);
                    let t = std::time::Instant::now();
                    tessera_codegen::cpu::cranelift::compile(k, &modes, false).unwrap_or_else(|e| panic!("{}: {}", k.name, e.0));
                    times.push((t.elapsed().as_secs_f64() * 1e3, format!("{} ({} {})", k.name, op.name, case.name)));
                }
            }
        }
    }
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    let median = times[times.len() / 2].0;
    let max = times.last().unwrap();
    eprintln!("cranelift compile time over {} library kernels: median {median:.2} ms, max {:.2} ms ({})", times.len(), max.0, max.1);
    assert!(median <= 20.0, "median compile time {median:.1} ms");
}
