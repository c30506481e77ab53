//! Grouped matmuls (`gmm`, `tgmm`): numerics on the interpreter against the independent
//! per-group f64 references, through the library harness (random group sizes with an
//! empty group and unaligned boundaries) and through direct calls with chosen group
//! sizes; host-side errors; the metadata's visit bound; and, with
//! `TESSERA_TPU_ORACLE=1`, libtpu compiles of a large-block configuration.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target, Type};
use tessera_kernels::gmm::{self, group_metadata, reference, visit_capacity, GmmBlocks};
use tessera_codegen::cpu::Backend;
use tessera_kernels::harness::{check_output, random_array, run_against_reference};
use tessera_tests::oracle;

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

fn harness(name: &str, sets: &[[&[usize]; 3]]) {
    assert!(sets.len() >= 5);
    let op = tessera_kernels::find(name).unwrap();
    for dtype in DTYPES {
        for target in [Target::V5E, Target::V6E] {
            for (i, set) in sets.iter().enumerate() {
                let shapes: Vec<Vec<usize>> = set.iter().map(|s| s.to_vec()).collect();
                let r = run_against_reference(op, &shapes, dtype, &target, 17 + i as u64).unwrap_or_else(|e| panic!("{name} {shapes:?} {dtype}: {e}"));
                assert!(r.passed(), "{name} {shapes:?} {dtype} on {target} (grid {:?}): {:?}", r.grid, r.outputs);
            }
        }
    }
}

#[test]
fn gmm_against_reference_random_groups() {
    harness(
        "gmm",
        &[
            [&[1024, 512], &[8, 512, 512], &[8]],
            [&[1000, 768], &[6, 768, 384], &[6]],
            [&[256, 128], &[1, 128, 256], &[1]],
            [&[200, 256], &[4, 256, 128], &[4]],
            [&[64, 128], &[3, 128, 128], &[3]],
            [&[520, 384], &[16, 384, 256], &[16]],
        ],
    );
}

#[test]
fn tgmm_against_reference_random_groups() {
    harness(
        "tgmm",
        &[
            [&[1024, 512], &[1024, 512], &[8]],
            [&[1000, 768], &[1000, 384], &[6]],
            [&[256, 128], &[256, 256], &[1]],
            [&[200, 256], &[200, 128], &[4]],
            [&[64, 128], &[64, 128], &[3]],
            [&[520, 384], &[520, 256], &[16]],
        ],
    );
}

/// Chosen group sizes for `m` rows: empty groups at both ends and inside, one group with
/// every row, boundaries off the tile grid, and sizes that are multiples of the tile.
fn cases(m: usize) -> Vec<Vec<i32>> {
    let m = m as i32;
    vec![
        vec![m],
        vec![0, 0, m, 0],
        vec![0, 1, m - 2, 0, 1, 0],
        vec![m / 3, 0, m / 3, m - 2 * (m / 3)],
        vec![7, 121, 0, 0, m - 128 - 5, 5],
        vec![m / 2, m - m / 2],
    ]
}

fn inputs(dtype: DType, shapes: &[&[usize]; 2], seed: u64) -> (Array, Array) {
    let mut rng = StdRng::seed_from_u64(seed);
    (random_array(dtype, shapes[0], &mut rng), random_array(dtype, shapes[1], &mut rng))
}

fn assert_close(what: &str, got: &Array, want: &[f64]) {
    let c = check_output(got, want);
    assert!(c.passed(), "{what}: {c:?}");
}

fn sizes_usize(s: &[i32]) -> Vec<usize> {
    s.iter().map(|&v| v as usize).collect()
}

/// Blocks small enough that groups share tiles, and the target's defaults.
fn block_choices(m: usize, k: usize, n: usize, dtype: DType, target: &Target) -> Vec<GmmBlocks> {
    vec![GmmBlocks { tm: 128.min(m), tk: 128, tn: 128 }, gmm::gmm_blocks(m, k, n, dtype, target)]
}

#[test]
fn gmm_direct_calls_chosen_groups() {
    let target = Target::V5E;
    for dtype in DTYPES {
        for (m, k, n) in [(640, 256, 256), (300, 128, 384), (1024, 512, 256), (136, 256, 128), (520, 384, 128)] {
            for (c, sizes) in cases(m).into_iter().enumerate() {
                let g = sizes.len();
                let gs = Array::from_i32(&[g], sizes.clone());
                for transpose_rhs in [false, true] {
                    let rhs_shape: &[usize] = if transpose_rhs { &[g, n, k] } else { &[g, k, n] };
                    let (lhs, rhs) = inputs(dtype, &[&[m, k], rhs_shape], c as u64);
                    let want = reference::gmm(&lhs.to_f64_vec(), &rhs.to_f64_vec(), &sizes_usize(&sizes), k, n, transpose_rhs);
                    for blocks in block_choices(m, k, n, dtype, &target) {
                        let out = gmm::gmm_with_blocks(&Interpreter, &lhs, &rhs, &gs, transpose_rhs, blocks, &target).unwrap_or_else(|e| panic!("{e}"));
                        assert_eq!(out.shape, vec![m, n]);
                        assert_eq!(out.dtype, dtype);
                        assert_close(&format!("gmm m={m} k={k} n={n} {sizes:?} t={transpose_rhs} {blocks:?} {dtype}"), &out, &want);
                    }
                    let out = gmm::gmm(&Interpreter, &lhs, &rhs, &gs, transpose_rhs, &Target::V6E).unwrap();
                    assert_close(&format!("gmm v6e defaults m={m} {sizes:?} t={transpose_rhs} {dtype}"), &out, &want);
                }
            }
        }
    }
}

#[test]
fn tgmm_direct_calls_chosen_groups() {
    let target = Target::V5E;
    for dtype in DTYPES {
        for (m, k, n) in [(640, 256, 256), (300, 128, 384), (1024, 512, 256), (136, 256, 128), (520, 384, 128)] {
            for (c, sizes) in cases(m).into_iter().enumerate() {
                let g = sizes.len();
                let gs = Array::from_i32(&[g], sizes.clone());
                let (lhs, grad) = inputs(dtype, &[&[m, k], &[m, n]], 100 + c as u64);
                let want = reference::tgmm(&lhs.to_f64_vec(), &grad.to_f64_vec(), &sizes_usize(&sizes), k, n);
                for blocks in block_choices(m, k, n, dtype, &target) {
                    let out = gmm::tgmm_with_blocks(&Interpreter, &lhs, &grad, &gs, blocks, &target).unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(out.shape, vec![g, k, n]);
                    assert_close(&format!("tgmm m={m} k={k} n={n} {sizes:?} {blocks:?} {dtype}"), &out, &want);
                    // Empty groups are exactly zero, not merely small.
                    let vals = out.to_f64_vec();
                    for (gi, _) in sizes.iter().enumerate().filter(|(_, &s)| s == 0) {
                        assert!(vals[gi * k * n..(gi + 1) * k * n].iter().all(|&v| v == 0.0), "tgmm group {gi} of {sizes:?} is not zero");
                    }
                }
            }
        }
    }
}

#[test]
fn host_checks_are_kernel_errors() {
    let t = Target::V5E;
    let (lhs, rhs) = inputs(DType::F32, &[&[256, 128], &[2, 128, 128]], 0);
    let sum_off = gmm::gmm(&Interpreter, &lhs, &rhs, &Array::from_i32(&[2], vec![100, 100]), false, &t).unwrap_err();
    assert_eq!((sum_off.kernel.as_str(), sum_off.rule, sum_off.subject.as_str()), ("gmm", "group-sizes", "input `group_sizes`"));
    assert!(sum_off.message.contains("sum to 200") && sum_off.message.contains("256 rows"), "{sum_off}");
    let negative = gmm::gmm(&Interpreter, &lhs, &rhs, &Array::from_i32(&[2], vec![300, -44]), false, &t).unwrap_err();
    assert_eq!(negative.rule, "group-sizes");
    let groups_off = gmm::gmm(&Interpreter, &lhs, &rhs, &Array::from_i32(&[3], vec![100, 100, 56]), false, &t).unwrap_err();
    assert_eq!((groups_off.rule, groups_off.subject.as_str()), ("operand-shape", "input `group_sizes`"));
    let bf = Array::zeros(DType::BF16, &[2, 128, 128]);
    let mixed = gmm::gmm(&Interpreter, &lhs, &bf, &Array::from_i32(&[2], vec![128, 128]), false, &t).unwrap_err();
    assert_eq!(mixed.rule, "operand-dtype");
    let float_sizes = gmm::gmm(&Interpreter, &lhs, &rhs, &Array::zeros(DType::F32, &[2]), false, &t).unwrap_err();
    assert_eq!(float_sizes.subject, "input `group_sizes`");
    let bad_tk = gmm::gmm_with_blocks(&Interpreter, &lhs, &rhs, &Array::from_i32(&[2], vec![128, 128]), false, GmmBlocks { tm: 128, tk: 96, tn: 128 }, &t).unwrap_err();
    assert_eq!(bad_tk.rule, "block-shape");
    let grad = Array::zeros(DType::F32, &[200, 128]);
    let rows_off = gmm::tgmm(&Interpreter, &lhs, &grad, &Array::from_i32(&[2], vec![128, 128]), &t).unwrap_err();
    assert_eq!((rows_off.kernel.as_str(), rows_off.subject.as_str()), ("tgmm", "input `grad`"));
    let grad = Array::zeros(DType::F32, &[256, 128]);
    let tsum = gmm::tgmm(&Interpreter, &lhs, &grad, &Array::from_i32(&[2], vec![1, 2]), &t).unwrap_err();
    assert_eq!((tsum.kernel.as_str(), tsum.rule), ("tgmm", "group-sizes"));
}

#[test]
fn metadata_stays_within_the_static_visit_bound() {
    let mut rng = StdRng::seed_from_u64(5);
    for (m, g, tm) in [(1024, 8, 128), (1000, 6, 256), (100, 3, 100), (4096, 64, 512), (520, 16, 128), (128, 1, 128)] {
        let cap = visit_capacity(m, g, tm);
        for _ in 0..50 {
            let sizes = gmm::random_group_sizes(m, g, &mut rng);
            assert_eq!(sizes.iter().sum::<i32>() as usize, m);
            if g >= 3 {
                assert!(sizes.contains(&0), "{sizes:?}");
            }
            for visit_empty in [false, true] {
                let md = group_metadata(&sizes, m, tm, visit_empty);
                assert_eq!(md.group.len(), cap);
                assert!(md.visits <= cap);
                // Tiles never go back (output windows are revisited only consecutively).
                assert!(md.tile.windows(2).all(|w| w[0] <= w[1]), "{:?}", md.tile);
                // Padding repeats the last visit with an empty range and no flags.
                for v in md.visits..cap {
                    assert_eq!((md.group[v], md.tile[v]), (md.group[md.visits - 1], md.tile[md.visits - 1]));
                    assert!(md.row_lo[v] >= md.row_hi[v] && md.first[v] == 0 && md.last[v] == 0);
                }
                let groups_seen = md.group[..md.visits].iter().collect::<std::collections::BTreeSet<_>>().len();
                let nonempty = sizes.iter().filter(|&&s| s > 0).count();
                assert_eq!(groups_seen, if visit_empty { g } else { nonempty });
            }
        }
    }
}

/// The default blocks follow the documented rule.
#[test]
fn default_blocks() {
    let b = |t: &Target| gmm::gmm_blocks(4096, 1024, 1024, DType::BF16, t);
    assert_eq!(b(&Target::V5E), GmmBlocks { tm: 256, tk: 1024, tn: 1024 });
    assert_eq!(b(&Target::V6E).tm, 512);
    assert_eq!(b(&Target::TPU7X).tm, 256);
    assert_eq!(b(&Target::V5P).tm, 128);
    // Fewer rows than a tile: one full-height tile.
    assert_eq!(gmm::gmm_blocks(100, 256, 256, DType::F32, &Target::V5E).tm, 100);
}

/// Large blocks (512 x 1024 x 1024) build, verify with a raised scoped VMEM limit, and,
/// with the oracle on, compile with libtpu on v5e, v6e and tpu7x.
#[test]
fn large_block_gmm_compiles() {
    let blocks = GmmBlocks { tm: 512, tk: 1024, tn: 1024 };
    let mut modules = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for dtype in DTYPES {
            let (lhs, rhs, gs) = (Type::vector(dtype, &[4096, 2048]), Type::vector(dtype, &[8, 2048, 2048]), Type::vector(DType::I32, &[8]));
            for transpose_rhs in [false, true] {
                let k = gmm::build_gmm(&lhs, &rhs, &gs, transpose_rhs, blocks, &target).unwrap_or_else(|e| panic!("{e}"));
                let need = tessera_dsl::verify::vmem_bytes(&k, &target);
                assert!(need <= tessera_dsl::verify::vmem_limit(&k, &target));
                let lowered = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{target} {dtype}: {e}"));
                modules.push((target, format!("gmm-large-{dtype}-t{transpose_rhs}"), lowered.stablehlo));
            }
            let grad = Type::vector(dtype, &[4096, 2048]);
            if dtype == DTYPES[0] {
                // The metadata kernel over many visit blocks and more groups than lanes.
                for (m, g, tm) in [(65536, 256, 512), (9000, 300, 8)] {
                    let k = gmm::build_group_metadata(m, g, tm, true, &target).unwrap_or_else(|e| panic!("{e}"));
                    let lowered = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
                    modules.push((target, format!("group-metadata-m{m}-g{g}-tm{tm}"), lowered.stablehlo));
                }
            }
            let k = gmm::build_tgmm(&lhs, &grad, &gs, blocks, &target).unwrap_or_else(|e| panic!("{e}"));
            let lowered = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{target} {dtype}: {e}"));
            modules.push((target, format!("tgmm-large-{dtype}"), lowered.stablehlo));
        }
    }
    if !oracle::enabled() {
        eprintln!("libtpu part skipped: set TESSERA_TPU_ORACLE=1");
        return;
    }
    // Every target in one batch: the oracle compiles the targets in parallel.
    let jobs: Vec<(String, String, String)> = modules.iter().map(|m| (m.1.clone(), m.0.name.to_string(), m.2.clone())).collect();
    oracle::assert_all_accepted(&jobs);
}

/// The visit axis is a dynamic grid dim: a call runs `n-tiles x visits x k-tiles` steps,
/// not the static bound's, and one compiled kernel serves every `group_sizes` of a shape
/// (the kernel is built from types; the visit count is a run-time operand). Checked on the
/// interpreter and the JIT, numerics against the f64 reference.
#[test]
fn gmm_runs_only_the_active_visits_with_one_compile() {
    use tessera_codegen::cpu::cache_stats;
    use tessera_dsl::interp::HostMut;
    let (m, k, n, g) = (512, 256, 256, 8);
    let target = Target::V5E;
    let blocks = GmmBlocks { tm: 128, tk: 128, tn: 128 };
    let (lt, rt, gt) = (Type::vector(DType::F32, &[m, k]), Type::vector(DType::F32, &[g, k, n]), Type::vector(DType::I32, &[g]));
    let kernel = gmm::build_gmm(&lt, &rt, &gt, false, blocks, &target).unwrap();
    let cap = visit_capacity(m, g, blocks.tm);
    assert_eq!(kernel.grid[1].extent, cap);
    assert!(kernel.grid[1].dynamic.is_some());
    let mut rng = StdRng::seed_from_u64(3);
    let lhs = random_array(DType::F32, &[m, k], &mut rng);
    let rhs = random_array(DType::F32, &[g, k, n], &mut rng);
    let (tiles_n, tiles_k) = (n / blocks.tn, k / blocks.tk);
    // All rows in one group, groups aligned to tiles, boundaries inside tiles, random.
    let sets: Vec<Vec<i32>> = vec![vec![0, 0, 512, 0, 0, 0, 0, 0], vec![64; 8], vec![128, 0, 128, 0, 128, 0, 128, 0], gmm::random_group_sizes(m, g, &mut rng)];
    let misses = cache_stats().misses;
    let mut skipped = Vec::new();
    for sizes in &sets {
        let md = group_metadata(sizes, m, blocks.tm, false);
        let arrays = md.arrays(false);
        let mut args: Vec<&Array> = arrays.iter().collect();
        args.extend([&lhs, &rhs]);
        let want = reference::gmm(&lhs.to_f64_vec(), &rhs.to_f64_vec(), &sizes.iter().map(|&s| s as usize).collect::<Vec<_>>(), k, n, false);
        // Rebuilt per call as a plan would be: the same kernel whatever the sizes.
        assert_eq!(gmm::build_gmm(&lt, &rt, &gt, false, blocks, &target).unwrap(), kernel);
        for be in [Backend::Interp, Backend::Jit] {
            let inputs: Vec<_> = args.iter().map(|a| a.as_host()).collect();
            let mut out = Array::poison(DType::F32, &[m, n]);
            let stats = {
                let mut views: Vec<HostMut<'_>> = vec![out.as_host_mut()];
                be.executor().run_into(&kernel, &inputs, &mut views).unwrap_or_else(|e| panic!("{be:?} {sizes:?}: {e}"))
            };
            assert_eq!(stats.grid_steps, tiles_n * md.visits * tiles_k, "{be:?} {sizes:?}: steps");
            let got = out.to_f64_vec();
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert!(err <= 1e-3, "{be:?} {sizes:?}: max error {err}");
        }
        skipped.push((md.visits, cap));
    }
    assert_eq!(cache_stats().misses - misses, 1, "one JIT compile for {} group-size sets", sets.len());
    // One group: 4 visits of 11; tile-aligned pairs: 4; boundaries inside tiles: 8.
    assert_eq!(skipped[0], (4, 11));
    assert_eq!(skipped[1], (8, 11));
    assert_eq!(skipped[2], (4, 11));
    eprintln!("visits run / bound per call: {skipped:?}");
}

/// The device metadata kernel gives the host list ([`group_metadata`], a sequential walk)
/// on the interpreter and the JIT: every live visit equal, padding a no-op. Shapes cover
/// one and several visit blocks, odd group counts, m-tiles that are not powers of two,
/// empty groups at both ends and all rows in one group.
#[test]
fn device_metadata_matches_the_host_walk() {
    let target = Target::V5E;
    let mut rng = StdRng::seed_from_u64(11);
    for (m, g, tm) in [(1024, 8, 128), (1000, 6, 256), (100, 3, 100), (4096, 64, 512), (520, 13, 96), (128, 1, 128), (9000, 300, 8), (777, 5, 1000)] {
        let cap = visit_capacity(m, g, tm);
        let mut sets = vec![gmm::random_group_sizes(m, g, &mut rng), gmm::random_group_sizes(m, g, &mut rng)];
        let mut one = vec![0; g];
        one[g - 1] = m as i32;
        sets.push(one);
        let mut front = vec![0; g];
        front[0] = m as i32;
        sets.push(front);
        for visit_empty in [false, true] {
            let kernel = gmm::build_group_metadata(m, g, tm, visit_empty, &target).unwrap();
            for sizes in &sets {
                let want = group_metadata(sizes, m, tm, visit_empty);
                let input = Array::from_i32(&[1, g], sizes.clone());
                for be in [Backend::Interp, Backend::Jit] {
                    let out = tessera_dsl::exec::run(be.executor(), &kernel, &[&input]).unwrap_or_else(|e| panic!("{be:?} m{m} g{g} tm{tm}: {e}"));
                    let field = |i: usize| out[i].as_i32().unwrap().to_vec();
                    let what = format!("{be:?} m{m} g{g} tm{tm} empty={visit_empty} {sizes:?}");
                    assert_eq!(field(0), vec![want.visits as i32], "{what}: visits");
                    let v = want.visits;
                    for (i, (name, host)) in [("group", &want.group), ("tile", &want.tile), ("row_lo", &want.row_lo), ("row_hi", &want.row_hi), ("first", &want.first), ("last", &want.last)].into_iter().enumerate() {
                        let got = field(i + 1);
                        assert_eq!(got.len(), cap);
                        assert_eq!(&got[..v], &host[..v], "{what}: {name}");
                    }
                    for t in v..cap {
                        assert!(field(3)[t] == field(4)[t] && field(5)[t] == 0 && field(6)[t] == 0, "{what}: padding visit {t} is not a no-op");
                    }
                }
            }
        }
    }
}

/// Sizes outside the contract (negative, too many rows, a sum that wraps i32) give metadata
/// that stays inside every operand: groups, tiles and row ranges in range, the visit count
/// within the static bound.
#[test]
fn device_metadata_stays_in_bounds_for_bad_sizes() {
    let target = Target::V5E;
    let (m, g, tm) = (1000, 6, 128);
    let cap = visit_capacity(m, g, tm);
    let tiles = m.div_ceil(tm) as i32;
    for sizes in [vec![-5, 300, -1000, 2000, 7, 0], vec![i32::MAX, i32::MAX, 1, 1, -1, 5], vec![0; 6], vec![1; 6], vec![5000, 0, 0, 0, 0, 0]] {
        for visit_empty in [false, true] {
            let kernel = gmm::build_group_metadata(m, g, tm, visit_empty, &target).unwrap();
            let out = tessera_dsl::exec::run(&Interpreter, &kernel, &[&Array::from_i32(&[1, g], sizes.clone())]).unwrap();
            let f = |i: usize| out[i].as_i32().unwrap().to_vec();
            let visits = f(0)[0];
            assert!((0..=cap as i32).contains(&visits), "{sizes:?}: {visits} visits, bound {cap}");
            assert!(f(1).iter().all(|x| (0..g as i32).contains(x)), "{sizes:?}: groups {:?}", f(1));
            assert!(f(2).iter().all(|x| (0..tiles).contains(x)), "{sizes:?}: tiles {:?}", f(2));
            assert!(f(3).iter().zip(f(4)).all(|(&lo, hi)| 0 <= lo && lo <= hi && hi <= m as i32), "{sizes:?}: rows");
        }
    }
}
