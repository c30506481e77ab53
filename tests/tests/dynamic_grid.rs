//! The dynamic grid extent (issue 16 item 5): a grid dim declared `dynamic(bound, n)` runs
//! `n[0]` steps at run time, at most `bound` (Pallas: a traced grid entry, as megablox
//! gmm's active tile count; Mosaic: `INT64_MIN` in `iteration_bounds` plus a leading
//! custom-call operand). Shown here on the interpreter and the compiled backends against
//! references written from the definition:
//!
//! - a step counter: the kernel adds 1 per step it runs, and the backends' own step counts
//!   agree, for every extent from 0 to the bound: the inactive steps are skipped;
//! - numerics of a dynamic parallel dim (`num_programs` reads the extent) and of a dynamic
//!   reduction dim behind a parallel one;
//! - the errors: an extent above the bound or negative at run time, an extent operand that
//!   is not an int32 `[1]` scalar prefetch, `num_programs` of a dynamic dim in raw IR;
//! - the emitted Mosaic and StableHLO, and (libtpu tier) that libtpu compiles it all.

use tessera_codegen::cpu::{cache_stats, Backend};
use tessera_dsl::interp::{Array, HostMut, HostRef, RunStats};
use tessera_dsl::verify::verify;
use tessera_dsl::{DType, Kernel, KernelBuilder, KernelError, MemorySpace, RefKind, Semantics, Target};
use tessera_macros::tpu_kernel;
use tessera_tests::backends::{all as backends, ty};

/// Runs `k` on `be`, returning the outputs and the backend's run statistics.
fn run(be: Backend, k: &Kernel, args: &[&Array]) -> Result<(Vec<Array>, RunStats), KernelError> {
    let inputs: Vec<HostRef<'_>> = args.iter().map(|a| a.as_host()).collect();
    let mut outputs: Vec<Array> = k.refs_of(RefKind::Output).map(|(_, d)| Array::poison(d.dtype, &d.shape)).collect();
    let mut views: Vec<HostMut<'_>> = outputs.iter_mut().map(Array::as_host_mut).collect();
    let stats = be.executor().run_into(k, &inputs, &mut views)?;
    drop(views);
    Ok((outputs, stats))
}

fn extent(n: i32) -> Array {
    Array::from_i32(&[1], vec![n])
}

fn f32s(a: &Array) -> Vec<f32> {
    a.to_f64_vec().iter().map(|&x| x as f32).collect()
}

// ---- kernels ------------------------------------------------------------------------------

/// Adds 1 to an accumulator at every step it runs: the count of executed steps.
#[tpu_kernel(grid = [dynamic(8, n), 2], semantics = [arbitrary, arbitrary], count = block([8, 128], |i, j| [0, 0]))]
fn step_counter(n: Prefetch<1>, count: Out<8, 128>) {
    if program_id(0) + program_id(1) == 0 {
        count[..] = zeros([8, 128], f32);
    }
    count[..] = count[..] + 1.0;
}

/// Row block `i < n` of `o` is `x * n + i` (`num_programs` is the run-time extent); the
/// blocks past it are never visited.
#[tpu_kernel(grid = [dynamic(r / 8, n)], x = block([8, c], |i| [i, 0]), o = block([8, c], |i| [i, 0]))]
fn scale_rows(n: Prefetch<1>, x: In<r, c>, o: Out<r, c>) {
    let steps = num_programs(0).cast(f32);
    let i = program_id(0).cast(f32);
    o[..] = (x[..].cast(f32) * steps + i).cast(o.dtype);
}

/// `o[rows] = sum of the first n column blocks of x[rows]`: a dynamic reduction dim behind
/// a parallel one.
#[tpu_kernel(grid = [r / 8, dynamic(c / 128, n)], semantics = [parallel, arbitrary], x = block([8, 128], |i, j| [i, j]), o = block([8, 128], |i, j| [i, 0]))]
fn col_block_sum(n: Prefetch<1>, x: In<r, c>, o: Out<r, 128>) {
    if program_id(1) == 0 {
        o[..] = zeros([8, 128], f32);
    }
    o[..] = o[..] + x[..];
}

/// An extent operand of the wrong shape.
#[tpu_kernel(grid = [dynamic(4, n)], o = block([8, 128], |i| [i, 0]))]
fn extent_of_two(n: Prefetch<2>, o: Out<r, 128>) {
    o[..] = zeros([8, 128], f32);
}

fn counter() -> Kernel {
    step_counter(ty(DType::I32, &[1]), ty(DType::F32, &[8, 128])).unwrap()
}

// ---- skipping -------------------------------------------------------------------------------

#[test]
fn steps_past_the_dynamic_extent_do_not_run() {
    let k = counter();
    assert_eq!(k.grid[0].extent, 8);
    assert!(k.grid[0].dynamic.is_some());
    for be in backends() {
        for n in 0..=8 {
            let (out, stats) = run(be, &k, &[&extent(n)]).unwrap_or_else(|e| panic!("{be:?} n={n}: {e}"));
            // Independent reference: the grid is n x 2, one increment per step.
            assert_eq!(stats.grid_steps, 2 * n as usize, "{be:?} n={n}: steps run");
            let got = f32s(&out[0]);
            if n == 0 {
                // No step ran: the output was never written (TPU memory is uninitialised).
                assert!(got.iter().all(|x| x.is_nan()), "{be:?}: an empty grid writes nothing");
            } else {
                assert!(got.iter().all(|&x| x == 2.0 * n as f32), "{be:?} n={n}: count {:?}", &got[..4]);
            }
        }
    }
}

#[test]
fn one_compiled_kernel_serves_every_extent() {
    let k = counter();
    let before = cache_stats();
    for n in [1, 5, 8, 3] {
        run(Backend::Jit, &k, &[&extent(n)]).unwrap();
    }
    let after = cache_stats();
    // One kernel, one key: every run after the first is a hit (other tests only add).
    assert!(after.hits - before.hits >= 3, "{} cache hits for four runs of one kernel", after.hits - before.hits);
    assert_eq!(after.fallbacks, before.fallbacks, "the JIT fell back to the interpreter");
}

// ---- numerics -------------------------------------------------------------------------------

#[test]
fn a_dynamic_parallel_dim_matches_its_reference() {
    let (r, c) = (64, 256);
    for dtype in [DType::F32, DType::BF16] {
        let k = scale_rows(ty(DType::I32, &[1]), ty(dtype, &[r, c]), ty(dtype, &[r, c])).unwrap();
        let xs: Vec<f32> = (0..r * c).map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0).collect();
        let x = Array::from_f32_in(dtype, &[r, c], xs.clone());
        let xv = x.to_f64_vec();
        for n in [0usize, 1, 5, 8] {
            for be in backends() {
                let (out, stats) = run(be, &k, &[&extent(n as i32), &x]).unwrap_or_else(|e| panic!("{be:?}: {e}"));
                assert_eq!(stats.grid_steps, n);
                let got = out[0].to_f64_vec();
                for row in 0..r {
                    for col in 0..c {
                        let g = got[row * c + col];
                        if row / 8 < n {
                            let want = xv[row * c + col] * n as f64 + (row / 8) as f64;
                            let tol = if dtype == DType::BF16 { want.abs() / 128.0 + 1e-6 } else { 1e-6 * want.abs().max(1.0) };
                            assert!((g - want).abs() <= tol, "{be:?} {dtype} n={n} [{row}, {col}]: {g} vs {want}");
                        } else {
                            assert!(g.is_nan(), "{be:?} {dtype} n={n}: row {row} past the extent was written ({g})");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_dynamic_reduction_dim_matches_its_reference() {
    let (r, c) = (32, 1024);
    let k = col_block_sum(ty(DType::I32, &[1]), ty(DType::F32, &[r, c]), ty(DType::F32, &[r, 128])).unwrap();
    let xs: Vec<f32> = (0..r * c).map(|i| ((i * 13 % 29) as f32 - 14.0) / 8.0).collect();
    let x = Array::from_f32(&[r, c], xs.clone());
    for n in [1usize, 3, 8] {
        // Reference: plain loops over the first n column blocks.
        let mut want = vec![0.0f64; r * 128];
        for row in 0..r {
            for j in 0..n {
                for l in 0..128 {
                    want[row * 128 + l] += xs[row * c + j * 128 + l] as f64;
                }
            }
        }
        for be in backends() {
            let (out, stats) = run(be, &k, &[&extent(n as i32), &x]).unwrap_or_else(|e| panic!("{be:?}: {e}"));
            assert_eq!(stats.grid_steps, (r / 8) * n, "{be:?}");
            let got = out[0].to_f64_vec();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-4, "{be:?} n={n} at {i}: {g} vs {w}");
            }
        }
    }
}

// ---- errors ---------------------------------------------------------------------------------

#[test]
fn an_extent_outside_the_bound_is_a_run_time_error_on_every_backend() {
    let k = counter();
    for be in backends() {
        for n in [9, 100, -1, i32::MIN] {
            let e = run(be, &k, &[&extent(n)]).expect_err("out-of-range extent ran");
            assert_eq!(e.rule, "grid-dynamic-extent", "{be:?} n={n}: {e}");
            let text = e.to_string();
            assert!(text.contains(&format!("extent is {n}")) && text.contains("0..=8") && text.contains("`n`"), "{be:?}: {text}");
        }
    }
}

#[test]
fn the_extent_operand_is_an_int32_scalar_prefetch() {
    let k = extent_of_two(ty(DType::I32, &[2]), ty(DType::F32, &[32, 128])).unwrap();
    let e = verify(&k, &Target::V5E).expect_err("a [2] extent operand verified");
    assert_eq!(e.rule, "grid-dynamic-extent");
    assert!(e.to_string().contains("int32 [1]"), "{e}");
    // Through the builder: an input, not a scalar prefetch.
    let mut b = KernelBuilder::new("extent_is_input");
    b.grid(&[(4, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", DType::I32, &[1], MemorySpace::Smem);
    b.grid_extent_from(0, x);
    let o = b.output("o", DType::F32, &[32, 128], tessera_dsl::BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![tessera_dsl::IndexExpr::grid(0), 0.into()] });
    let z = b.zeros(&[8, 128], DType::F32);
    b.store(o, &[tessera_dsl::Index::Full, tessera_dsl::Index::Full], z);
    let k = b.finish().unwrap();
    let e = verify(&k, &Target::V6E).expect_err("an input as extent verified");
    assert_eq!(e.rule, "grid-dynamic-extent", "{e}");
    // A dim the grid does not have.
    let mut b = KernelBuilder::new("missing_dim");
    b.grid(&[(4, Semantics::Parallel)]);
    let n = b.prefetch("n", &[1]);
    b.grid_extent_from(3, n);
    assert_eq!(b.finish().unwrap_err().rule, "grid-axis");
}

#[test]
fn num_programs_of_a_dynamic_dim_reads_the_extent() {
    // The builder lowers it to a load of the operand; raw IR asking for it is refused.
    let k = scale_rows(ty(DType::I32, &[1]), ty(DType::F32, &[16, 128]), ty(DType::F32, &[16, 128])).unwrap();
    let mut has_np = false;
    k.walk(k.body, &mut |_, d| has_np |= matches!(d.inst, tessera_dsl::Inst::NumPrograms(_)));
    assert!(!has_np, "num_programs(0) of a dynamic dim should be a load of its extent");
    let mut raw = k.clone();
    let load = raw.insts.iter().position(|d| matches!(&d.inst, tessera_dsl::Inst::Load { src, .. } if raw.refs[src.index()].name == "n")).unwrap();
    raw.insts[load].inst = tessera_dsl::Inst::NumPrograms(0);
    let e = verify(&raw, &Target::V5E).expect_err("num_programs of a dynamic dim verified");
    assert_eq!(e.rule, "grid-dynamic-extent", "{e}");
}

// ---- emission -------------------------------------------------------------------------------

#[test]
fn mosaic_marks_the_dim_dynamic_and_stablehlo_leads_with_the_extent() {
    let k = col_block_sum(ty(DType::I32, &[1]), ty(DType::F32, &[32, 1024]), ty(DType::F32, &[32, 128])).unwrap();
    let lowered = tessera_codegen::lower(&k, &Target::V6E).unwrap();
    assert!(lowered.mosaic.contains("iteration_bounds = array<i64: 4, -9223372036854775808>"), "{}", lowered.mosaic);
    assert!(lowered.mosaic.contains("scalar_prefetch = 1 : i64"));
    let hlo = &lowered.stablehlo;
    assert!(hlo.contains("%extent1 = stablehlo.reshape %arg0 : (tensor<1xi32>) -> tensor<i32>"), "{hlo}");
    assert!(hlo.contains("stablehlo.custom_call @tpu_custom_call(%extent1, %arg0, %arg1)"), "{hlo}");
    assert!(hlo.contains("operand_layouts = [dense<> : tensor<0xindex>, dense<0> : tensor<1xindex>, dense<[1, 0]> : tensor<2xindex>]"), "{hlo}");
    assert!(hlo.contains(": (tensor<i32>, tensor<1xi32>, tensor<32x1024xf32>) -> tensor<32x128xf32>"), "{hlo}");
}

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`): the kernels above compile for v5e, v6e and
/// tpu7x.
#[test]
fn libtpu_compiles_dynamic_grids_for_v5e_v6e_tpu7x() {
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let mut kernels = vec![counter(), col_block_sum(ty(DType::I32, &[1]), ty(DType::F32, &[32, 1024]), ty(DType::F32, &[32, 128])).unwrap()];
    for dtype in [DType::F32, DType::BF16] {
        kernels.push(scale_rows(ty(DType::I32, &[1]), ty(dtype, &[64, 256]), ty(dtype, &[64, 256])).unwrap());
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        tessera_tests::backends::assert_libtpu_accepts(&kernels, &target);
    }
}
