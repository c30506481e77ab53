//! MoE routing ops (`router_topk`, `permute`, `combine`) on the CPU interpreter against
//! their independent f64 references, in f32 and bf16, on shape sets that cover k = 1, 2,
//! 4, 8, expert counts that are not powers of two, token counts that are not multiples of
//! the tiles (partial edge blocks) and experts that receive no tokens; plus the host-side
//! plan, tie-breaking, the permute -> combine round trip, an MoE-style composition, and
//! the errors users get for bad parameters.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target};
use tessera_kernels::harness::{check_output, random_array, run_case};
use tessera_kernels::routing::{self, reference, Gate, Routing};

const TARGETS: [Target; 2] = [Target::V5E, Target::TPU7X];
const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

fn library_op(name: &str, sets: &[&[&[usize]]]) {
    assert!(sets.len() >= 5);
    let op = tessera_kernels::find(name).unwrap();
    for dtype in DTYPES {
        for target in TARGETS {
            for (i, set) in sets.iter().enumerate() {
                let shapes: Vec<Vec<usize>> = set.iter().map(|s| s.to_vec()).collect();
                // permute and combine take the expert count; random routings draw from 2k + 3.
                let statics = match shapes.last() {
                    Some(ids) if name != "router_topk" => format!("num_experts={}", routing::random_routing_experts(ids[1])),
                    _ => String::new(),
                };
                let r = run_case(op, &op.statics(&statics).unwrap(), &shapes, dtype, &target, i as u64, &Interpreter).unwrap_or_else(|e| panic!("{name} {shapes:?} {dtype}: {e}"));
                assert!(r.passed(), "{name} {shapes:?} {dtype} on {target} (grid {:?}): {:?}", r.grid, r.outputs);
            }
        }
    }
}

/// (T, E, k, gate, normalize): T = 1000 and 300 are not multiples of the 256-row block.
const ROUTER_CASES: &[(usize, usize, usize, Gate, bool)] = &[
    (512, 8, 2, Gate::Softmax, true),
    (1000, 60, 4, Gate::Softmax, false),
    (37, 6, 1, Gate::Sigmoid, false),
    (300, 8, 8, Gate::Softmax, true),
    (96, 128, 8, Gate::Sigmoid, true),
    (5, 3, 3, Gate::Softmax, false),
];

#[test]
fn router_topk_matches_reference() {
    for dtype in DTYPES {
        for target in TARGETS {
            for (n, &(t, e, k, gate, normalize)) in ROUTER_CASES.iter().enumerate() {
                let mut rng = StdRng::seed_from_u64(n as u64);
                // Spread the logits so softmax weights are far from uniform.
                let logits = random_array(DType::F32, &[t, e], &mut rng).to_f32_vec().iter().map(|v| 4.0 * v).collect::<Vec<_>>();
                let logits = Array::from_f32_in(dtype, &[t, e], logits);
                let (w, ids) = routing::route(&Interpreter, &logits, k, gate, normalize, &target).unwrap_or_else(|err| panic!("{t}x{e} k={k}: {err}"));
                assert_eq!((w.dtype, &w.shape[..], ids.dtype, &ids.shape[..]), (dtype, &[t, k][..], DType::I32, &[t, k][..]));
                let (want_w, want_ids) = reference::router_topk(&logits.to_f64_vec(), e, k, gate == Gate::Sigmoid, normalize);
                let want_ids: Vec<f64> = want_ids.into_iter().map(|i| i as f64).collect();
                let (cw, ci) = (check_output(&w, &want_w), check_output(&ids, &want_ids));
                assert!(cw.passed() && ci.passed(), "{t}x{e} k={k} {gate:?} normalize={normalize} {dtype} on {target}: weights {cw:?}, ids {ci:?}");
                if normalize {
                    for row in w.to_f64_vec().chunks(k) {
                        assert!((row.iter().sum::<f64>() - 1.0).abs() < 4.0 * harness_tol(dtype), "normalised weights sum to {}", row.iter().sum::<f64>());
                    }
                }
            }
        }
    }
}

fn harness_tol(dtype: DType) -> f64 {
    tessera_kernels::harness::tolerance(dtype)
}

#[test]
fn router_topk_ties_go_to_the_lowest_expert() {
    let rows: [[f32; 5]; 3] = [
        [1.0, 3.0, 3.0, 0.0, 3.0],
        [f32::NEG_INFINITY; 5], // all tied: still k distinct experts
        [2.0, 2.0, 2.0, 2.0, 2.0],
    ];
    let logits = Array::from_f32(&[3, 5], rows.iter().flatten().copied().collect());
    let (w, ids) = routing::route(&Interpreter, &logits, 3, Gate::Softmax, true, &Target::V5E).unwrap();
    assert_eq!(ids.as_i32().unwrap(), &[1, 2, 4, 0, 1, 2, 0, 1, 2]);
    let w = w.as_f32().unwrap();
    assert!(w[..3].iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-6), "{w:?}");
    assert!(w[6..].iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-6), "{w:?}");
}

#[test]
fn permute_matches_reference() {
    // [x: T x D], [expert_ids: T x k]; tiles are 512: T = 1000, T*k = 4000 and D = 640
    // leave partial edge blocks, and random routings always leave expert 1 empty.
    library_op(
        "permute",
        &[
            &[&[512, 512], &[512, 2]],
            &[&[1000, 384], &[1000, 4]],
            &[&[37, 200], &[37, 1]],
            &[&[300, 128], &[300, 8]],
            &[&[128, 640], &[128, 2]],
            &[&[600, 256], &[600, 1]],
        ],
    );
}

#[test]
fn combine_matches_reference() {
    // [y: T*k x D], [weights: T x k], [expert_ids: T x k].
    library_op(
        "combine",
        &[
            &[&[1024, 512], &[512, 2], &[512, 2]],
            &[&[4000, 384], &[1000, 4], &[1000, 4]],
            &[&[37, 200], &[37, 1], &[37, 1]],
            &[&[2400, 128], &[300, 8], &[300, 8]],
            &[&[256, 640], &[128, 2], &[128, 2]],
            &[&[600, 256], &[600, 1], &[600, 1]],
        ],
    );
}

#[test]
fn router_topk_library_entry_matches_reference() {
    library_op("router_topk", &[&[&[512, 8]], &[&[1000, 60]], &[&[37, 6]], &[&[300, 128]], &[&[8, 2]]]);
}

#[test]
fn plan_sorts_stably_by_expert_and_counts_empty_groups() {
    // T = 4, k = 2, E = 6: experts 1, 4 and 5 get nothing.
    let ids = Array::from_i32(&[4, 2], vec![3, 0, 0, 2, 3, 2, 0, 3]);
    let r = routing::plan(&ids, 6).unwrap();
    assert_eq!(r.group_sizes, vec![3, 0, 2, 3, 0, 0]);
    // Sorted pairs (t*k + j): expert 0: 1, 2, 6; expert 2: 3, 5; expert 3: 0, 4, 7.
    assert_eq!(r.src, vec![0, 1, 3, 1, 2, 0, 2, 3]);
    assert_eq!(r.pos, vec![5, 0, 1, 3, 6, 4, 2, 7]);
    let order = reference::sorted_order(&[3, 0, 0, 2, 3, 2, 0, 3]);
    for (row, n) in order.into_iter().enumerate() {
        assert_eq!(r.pos[n] as usize, row);
    }
}

#[test]
fn plan_rejects_out_of_range_ids() {
    let ids = Array::from_i32(&[2, 2], vec![0, 1, 7, 2]);
    let e = routing::plan(&ids, 4).unwrap_err();
    assert_eq!(e.rule, "expert-id-range");
    assert!(e.message.contains("token 1 slot 0") && e.message.contains("expert 7"), "{e}");
    let e = routing::plan(&Array::from_f32(&[2, 2], vec![0.0; 4]), 4).unwrap_err();
    assert_eq!(e.rule, "operand-shape");
}

#[test]
fn permute_then_combine_is_the_identity() {
    for dtype in DTYPES {
        for &(t, d, k) in &[(37usize, 200usize, 1usize), (600, 256, 2), (300, 128, 4)] {
            let mut rng = StdRng::seed_from_u64(t as u64);
            let x = random_array(dtype, &[t, d], &mut rng);
            let ids = routing::random_expert_ids(t, k, &mut rng);
            let r = routing::plan(&ids, routing::random_routing_experts(k)).unwrap();
            assert_eq!(r.group_sizes[1], 0, "expert 1 receives no tokens");
            let xs = routing::permute(&Interpreter, &x, &ids, routing::random_routing_experts(k), &Target::V6E).unwrap().0;
            // Weights 1/k are exact in bf16, and so is the f32 sum of k halves/quarters.
            let w = random_array(dtype, &[t, k], &mut rng);
            let w = Array { data: filled(&w, 1.0 / k as f32), ..w };
            let back = routing::combine(&Interpreter, &xs, &w, &ids, routing::random_routing_experts(k), &Target::V6E).unwrap();
            assert_eq!(back, x, "{t}x{d} k={k} {dtype}");
        }
    }
}

fn filled(like: &Array, v: f32) -> tessera_dsl::interp::Data {
    let n = like.len();
    match like.dtype {
        DType::BF16 => Array::from_f32_as_bf16(&[n], &vec![v; n]).data,
        _ => Array::from_f32(&[n], vec![v; n]).data,
    }
}

#[test]
fn moe_layer_composition_matches_a_direct_loop() {
    // route -> plan -> permute -> per-expert scale (a stand-in for gmm) -> combine, with
    // experts 2 and 5 of 7 never chosen.
    let (t, e, d, k) = (300usize, 7usize, 256usize, 2usize);
    let mut rng = StdRng::seed_from_u64(7);
    let mut logits = random_array(DType::F32, &[t, e], &mut rng).to_f32_vec();
    for row in logits.chunks_mut(e) {
        row[2] = -10.0;
        row[5] = -10.0;
    }
    let logits = Array::from_f32(&[t, e], logits);
    let x = random_array(DType::F32, &[t, d], &mut rng);
    let target = Target::V5E;
    let (w, ids) = routing::route(&Interpreter, &logits, k, Gate::Softmax, true, &target).unwrap();
    let r: Routing = routing::plan(&ids, e).unwrap();
    assert_eq!((r.group_sizes[2], r.group_sizes[5]), (0, 0));
    assert_eq!(r.group_sizes.iter().sum::<i32>() as usize, t * k);
    let xs = routing::permute(&Interpreter, &x, &ids, e, &target).unwrap().0.to_f32_vec();
    // Expert `g` multiplies by (g + 1): walk the groups in sorted order.
    let mut ys = Vec::with_capacity(xs.len());
    let mut rows = xs.chunks(d);
    for (g, &size) in r.group_sizes.iter().enumerate() {
        for row in rows.by_ref().take(size as usize) {
            ys.extend(row.iter().map(|v| v * (g + 1) as f32));
        }
    }
    let out = routing::combine(&Interpreter, &Array::from_f32(&[t * k, d], ys), &w, &ids, e, &target).unwrap();
    let (wv, iv, xv) = (w.to_f64_vec(), ids.as_i32().unwrap(), x.to_f64_vec());
    let mut want = vec![0.0; t * d];
    for tok in 0..t {
        for j in 0..k {
            let scale = wv[tok * k + j] * (iv[tok * k + j] + 1) as f64;
            for c in 0..d {
                want[tok * d + c] += scale * xv[tok * d + c];
            }
        }
    }
    let check = check_output(&out, &want);
    assert!(check.passed(), "{check:?}");
}

#[test]
fn bad_parameters_are_errors_not_panics() {
    let logits = Array::from_f32(&[16, 4], vec![0.0; 64]);
    for k in [0, 5, 9] {
        let e = routing::route(&Interpreter, &logits, k, Gate::Softmax, true, &Target::V5E).unwrap_err();
        assert_eq!((e.kernel.as_str(), e.rule), ("router_topk", "top-k"), "{e}");
    }
    let e = routing::route(&Interpreter, &Array::from_i32(&[16, 4], vec![0; 64]), 2, Gate::Softmax, true, &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "operand-dtype");
    let ids = Array::from_i32(&[4, 2], vec![0, 1, 1, 0, 2, 0, 1, 2]);
    let e = routing::permute(&Interpreter, &Array::from_f32(&[5, 128], vec![0.0; 640]), &ids, 3, &Target::V5E).unwrap_err();
    assert_eq!((e.kernel.as_str(), e.rule), ("permute", "operand-shape"), "{e}");
    let y = Array::from_f32(&[8, 128], vec![0.0; 1024]);
    let e = routing::combine(&Interpreter, &y, &Array::from_f32(&[4, 3], vec![0.0; 12]), &ids, 3, &Target::V5E).unwrap_err();
    assert_eq!((e.kernel.as_str(), e.rule), ("combine", "operand-shape"), "{e}");
    // A negative id is an error too.
    let e = routing::permute(&Interpreter, &Array::from_f32(&[2, 128], vec![0.0; 256]), &Array::from_i32(&[2, 1], vec![0, -1]), 4, &Target::V5E).unwrap_err();
    assert_eq!((e.kernel.as_str(), e.rule), ("permute", "expert-id-range"), "{e}");
}

#[test]
fn routing_kernels_verify_on_every_generation() {
    for target in Target::ALL {
        for dtype in DTYPES {
            let x = tessera_dsl::Type::vector(dtype, &[1000, 640]);
            let k = routing::router_topk(&tessera_dsl::Type::vector(dtype, &[1000, 60]), 8, Gate::Sigmoid, true, &target).unwrap();
            tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
            // permute: the routing's inverse, then a gather of x's rows (k = 1 index per row).
            let k = routing::invert_positions(1000, 4).unwrap();
            tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
            let k = routing::gather_rows("permute", &tessera_dsl::Type::vector(DType::I32, &[4000, 1]), None, &x, &target).unwrap();
            tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
            for (t, k, e) in [(1000, 4, 64), (16384, 8, 128), (37, 1, 3), (4096, 2, 300)] {
                let m = routing::routing_metadata(&tessera_dsl::Type::vector(DType::I32, &[t, k]), e, &target).unwrap();
                tessera_dsl::verify::verify(&m, &target).unwrap_or_else(|err| panic!("{target} t{t} k{k} e{e}: {err}"));
            }
            let w = tessera_dsl::Type::vector(dtype, &[1000, 4]);
            let p = tessera_dsl::Type::vector(DType::I32, &[1000, 4]);
            let k = routing::gather_rows("combine", &p, Some(&w), &tessera_dsl::Type::vector(dtype, &[4000, 640]), &target).unwrap();
            tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("{target}: {e}"));
        }
    }
}

#[test]
fn libtpu_compiles_router_variants_and_ragged_tiles() {
    if !tessera_tests::oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    use tessera_dsl::Type;
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let mut modules = Vec::new();
        for dtype in DTYPES {
            for &(t, e, k, gate, normalize) in ROUTER_CASES {
                let kernel = routing::router_topk(&Type::vector(dtype, &[t, e]), k, gate, normalize, &target).unwrap();
                modules.push((format!("router_{t}x{e}_k{k}_{gate:?}_{normalize}_{dtype}"), kernel));
            }
            // T = 37 (one partial tile; x padded to 38 rows as the plan pads an odd bf16 source)
            // and 600 x k 8 (several tiles, a ragged last one).
            modules.push((format!("invert_37x1_{dtype}"), routing::invert_positions(37, 1).unwrap()));
            modules.push((format!("invert_600x8_{dtype}"), routing::invert_positions(600, 8).unwrap()));
            modules.push((format!("permute_37x640_k1_{dtype}"), routing::gather_rows("permute", &Type::vector(DType::I32, &[37, 1]), None, &Type::vector(dtype, &[38, 640]), &target).unwrap()));
            if dtype == DTYPES[0] {
                for (t, k, e) in [(37, 1, 3), (16384, 8, 128), (4096, 2, 300)] {
                    modules.push((format!("routing_metadata_{t}x{k}_e{e}"), routing::routing_metadata(&Type::vector(DType::I32, &[t, k]), e, &target).unwrap()));
                }
            }
            let (w, p) = (Type::vector(dtype, &[600, 8]), Type::vector(DType::I32, &[600, 8]));
            modules.push((format!("combine_600x640_k8_{dtype}"), routing::gather_rows("combine", &p, Some(&w), &Type::vector(dtype, &[4800, 640]), &target).unwrap()));
        }
        jobs.extend(modules.into_iter().map(|(n, k)| (n, target.name.to_string(), tessera_codegen::lower(&k, &target).unwrap().stablehlo)));
    }
    // Every target in one batch: the oracle compiles the targets in parallel.
    tessera_tests::oracle::assert_all_accepted(&jobs);
}

/// A NaN or inf in x (permute), dout (permute_bwd) or y / weights (combine) reaches only
/// the rows torch's gather / weighted sum gives it: NaN exactly where the reference is NaN, the same infinities. Two token
/// tiles (T = 600 > 512), negative and zero weights, and a token whose two slots meet +inf
/// and -inf in one column (NaN).
#[test]
fn nonfinite_values_reach_only_their_rows() {
    use tessera_tests::nonfinite::assert_matches;
    let (t, k, d, experts) = (600, 2, 12, 5);
    let mut rng = StdRng::seed_from_u64(3);
    let ids = routing::random_expert_ids_over(t, k, experts, &mut rng);
    let statics = format!("num_experts={experts}");
    let pos = routing::plan(&ids, experts).unwrap().pos;
    for dtype in DTYPES {
        for target in TARGETS {
            let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-6 };
            let mut x = random_array(DType::F32, &[t, d], &mut rng).to_f32_vec();
            x[3 * d + 1] = f32::NAN;
            x[550 * d + 2] = f32::INFINITY;
            x[7 * d + 2] = f32::NEG_INFINITY;
            let x = Array::from_f32_in(dtype, &[t, d], x);
            let (got, _) = assert_matches("permute", "permute", &[Some(&x), Some(&ids)], &statics, &target, tol);
            let v = got[0].to_f64_vec();
            assert_eq!(v.iter().filter(|x| x.is_nan()).count(), k, "{dtype}: one NaN per slot of token 3");
            assert_eq!(v.iter().filter(|x| x.is_infinite()).count(), 2 * k, "{dtype}: the infs, once per slot");

            let mut y = random_array(DType::F32, &[t * k, d], &mut rng).to_f32_vec();
            let row = |tok: usize, j: usize| pos[tok * k + j] as usize;
            y[row(10, 0) * d + 4] = f32::INFINITY;
            y[row(10, 1) * d + 4] = f32::NEG_INFINITY; // token 10, column 4: inf - inf
            y[row(20, 1) * d] = f32::NAN;
            y[row(590, 0) * d + 5] = f32::NEG_INFINITY;
            y[row(30, 0) * d + 6] = f32::INFINITY; // meets a zero weight: NaN
            y[row(40, 1) * d + 7] = f32::INFINITY; // meets a negative weight: -inf
            let y = Array::from_f32_in(dtype, &[t * k, d], y);
            let (got, want) = assert_matches("permute_bwd", "permute_bwd", &[Some(&y), Some(&ids)], &statics, &target, tol);
            assert!(want[0][10 * d + 4].is_nan() && got[0].to_f64_vec()[10 * d + 4].is_nan());

            let mut w = random_array(DType::F32, &[t, k], &mut rng).to_f32_vec().iter().map(|v| v.abs() + 0.1).collect::<Vec<f32>>();
            w[30 * k] = 0.0;
            w[40 * k + 1] = -0.5;
            w[50 * k] = f32::NAN;
            w[60 * k + 1] = f32::INFINITY;
            let w = Array::from_f32_in(dtype, &[t, k], w);
            let (got, want) = assert_matches("combine", "combine", &[Some(&y), Some(&w), Some(&ids)], &statics, &target, tol);
            let (g, wv) = (got[0].to_f64_vec(), &want[0]);
            assert!(g[30 * d + 6].is_nan() && g[40 * d + 7] == f64::NEG_INFINITY && g[590 * d + 5] == f64::NEG_INFINITY, "{dtype}");
            assert!((0..d).all(|c| g[50 * d + c].is_nan()), "{dtype}: a NaN weight makes its token's row NaN");
            assert_eq!(g.iter().filter(|x| x.is_nan()).count(), wv.iter().filter(|x| x.is_nan()).count());
        }
    }
}

/// NaN logits rank above every number (torch.topk / torch.sort): picked first, lowest
/// expert first among NaNs, with NaN weights as torch's softmax / sigmoid give; +inf and
/// -inf logits are numbers (an all -inf row still yields distinct experts).
#[test]
fn router_topk_ranks_nan_first() {
    use tessera_tests::nonfinite::assert_matches;
    let (t, e) = (5, 6);
    let mut logits = vec![0.5f32; t * e];
    for (i, v) in logits.iter_mut().enumerate() {
        *v = ((i * 7) % 11) as f32 / 4.0;
    }
    logits[4] = f32::NAN; // row 0: NaN at expert 4
    logits[e + 1] = f32::NAN; // row 1: NaNs at 1 and 3, +inf at 5
    logits[e + 3] = f32::NAN;
    logits[e + 5] = f32::INFINITY;
    logits[2 * e] = -f32::NAN; // row 2: a negative NaN is a NaN too
    for v in &mut logits[3 * e..4 * e] {
        *v = f32::NEG_INFINITY; // row 3: all -inf
    }
    for dtype in DTYPES {
        let x = Array::from_f32_in(dtype, &[t, e], logits.clone());
        for statics in ["k=3", "k=3, gate=\"sigmoid\", normalize=False", "k=1, normalize=False"] {
            let (got, _) = assert_matches(statics, "router_topk", &[Some(&x)], statics, &Target::V5E, 1e-2);
            let ids = got[1].to_f64_vec();
            let k = ids.len() / t;
            assert_eq!(ids[0], 4.0, "{statics}: row 0 takes its NaN first");
            assert_eq!(&ids[k..k + k.min(2)], &[1.0, 3.0][..k.min(2)], "{statics}: row 1, NaNs by index");
            assert_eq!(ids[2 * k], 0.0, "{statics}: row 2, the negative NaN");
        }
    }
}

/// The device routing gives the host's stable sort ([`routing::plan`]) on the interpreter
/// and the JIT: positions and group sizes equal, for one and many token blocks, k 1..8,
/// expert counts below and above a lane width, skewed and empty experts. Out-of-range ids
/// route nowhere (row -1) and leave the other pairs' rows as the sort of the valid ones.
#[test]
fn device_routing_matches_the_host_sort() {
    use rand::Rng;
    use tessera_codegen::cpu::Backend;
    let mut rng = StdRng::seed_from_u64(17);
    for (t, k, e) in [(1, 1, 1), (37, 1, 3), (600, 8, 64), (1000, 2, 300), (2049, 4, 16)] {
        let kernel = routing::routing_metadata(&tessera_dsl::Type::vector(DType::I32, &[t, k]), e, &Target::V6E).unwrap();
        for skew in [false, true] {
            // Distinct experts per token (as top-k gives), skewed towards the low ids.
            let ids: Vec<i32> = (0..t)
                .flat_map(|_| {
                    let mut row: Vec<i32> = Vec::new();
                    while row.len() < k.min(e) {
                        let x = if skew { rng.gen_range(0..e.min(4).max(k)) as i32 } else { rng.gen_range(0..e) as i32 };
                        if !row.contains(&x) {
                            row.push(x);
                        }
                    }
                    row.resize(k, row[0]);
                    row
                })
                .collect();
            let ids = Array::from_i32(&[t, k], ids);
            let want = routing::plan(&ids, e).unwrap();
            for be in [Backend::Interp, Backend::Jit] {
                let out = tessera_dsl::exec::run(be.executor(), &kernel, &[&ids]).unwrap_or_else(|err| panic!("{be:?} t{t} k{k} e{e}: {err}"));
                assert_eq!(out[0].as_i32().unwrap(), &want.pos[..], "{be:?} t{t} k{k} e{e}: positions");
                assert_eq!(out[1].as_i32().unwrap(), &want.group_sizes[..], "{be:?} t{t} k{k} e{e}: group sizes");
            }
        }
    }
    let kernel = routing::routing_metadata(&tessera_dsl::Type::vector(DType::I32, &[3, 2]), 4, &Target::V6E).unwrap();
    let out = tessera_dsl::exec::run(&Interpreter, &kernel, &[&Array::from_i32(&[3, 2], vec![1, 9, -1, 1, 0, i32::MAX])]).unwrap();
    assert_eq!(out[0].as_i32().unwrap(), &[1, -1, -1, 2, 0, -1]);
    assert_eq!(out[1].as_i32().unwrap(), &[1, 2, 0, 0]);
}
