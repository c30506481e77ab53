//! More ops for kernel authors (issue 16 item 4), written with `#[tpu_kernel]`: `cumsum`,
//! strided loads and stores (`pl.ds(start, len, stride)`), the in-kernel random generator
//! (`pltpu.prng_seed` / `prng_random_bits`), and integer bitwise ops on i32 / i8 (int4
//! unpacking with masks). Each runs on the interpreter and the Cranelift JIT (and LLVM
//! with the feature), checked against references written here (f64 prefix sums, index
//! arithmetic on plain vectors, a SplitMix64 written from its definition, statistics); the
//! compiled backends must match the interpreter bit for bit and compile everything.

use half::bf16;
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, DType, Kernel, KernelError, Target};
use tessera_macros::tpu_kernel;
use tessera_tests::backends::{all as backends, run_all, ty};

fn lcg(seed: u32) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (s >> 8) as f32 / (1u32 << 24) as f32
    }
}

fn expect_err(r: Result<Kernel, KernelError>, rule: &str, words: &[&str]) {
    let e = r.expect_err("the builder must refuse this kernel");
    assert_eq!(e.rule, rule, "{e}");
    assert!(e.loc.as_ref().is_some_and(|l| l.file.ends_with("dsl_ops_scan.rs") && l.line > 0), "no source line: {e}");
    let text = e.to_string();
    for w in words {
        assert!(text.contains(w), "`{w}` missing from: {text}");
    }
}

fn run_err(k: &Kernel, inputs: &[&Array], rule: &str, words: &[&str]) {
    for be in backends() {
        let e = exec::run(be.executor(), k, inputs).expect_err("the run must fail");
        assert_eq!(e.rule, rule, "{be:?}: {e}");
        let text = e.to_string();
        for w in words {
            assert!(text.contains(w), "{be:?}: `{w}` missing from: {text}");
        }
    }
}

// ---- cumsum -------------------------------------------------------------------------------

/// Prefix sums along the lanes (axis 1) and down the sublanes (axis 0) of one block.
#[tpu_kernel(grid = [1], x = block([r, c], |i| [0, 0]), (lanes, rows) = block([r, c], |i| [0, 0]))]
fn cumsum2(x: In<r, c>, lanes: Out<r, c>, rows: Out<r, c>) {
    let v = x[..];
    lanes[..] = v.cumsum(1);
    rows[..] = v.cumsum(0);
}

/// The exact (f64) inclusive prefix sums of `x` (row-major `[r, c]`) along `axis`, with
/// the absolute prefix sums (for the f32 error bound).
fn cumsum_ref(x: &[f64], r: usize, c: usize, axis: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut abs) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (outer, n, step) = if axis == 1 { (r, c, 1) } else { (c, r, c) };
    for o in 0..outer {
        let (mut s, mut a) = (0.0f64, 0.0f64);
        for j in 0..n {
            let at = if axis == 1 { o * c + j } else { j * step + o };
            s += x[at];
            a += x[at].abs();
            out[at] = s;
            abs[at] = a;
        }
    }
    (out, abs)
}

#[test]
fn cumsum_matches_f64_prefix_sums_on_every_backend() {
    for (r, c) in [(8, 2048), (256, 128), (16, 256), (8, 200), (3, 128)] {
        for dtype in [DType::F32, DType::BF16] {
            let t = ty(dtype, &[r, c]);
            let k = cumsum2(t.clone(), t.clone(), t).unwrap();
            let mut rnd = lcg(r as u32 * 31 + c as u32);
            let xs: Vec<f32> = (0..r * c).map(|_| rnd() * 2.0 - 1.0).collect();
            let x = Array::from_f32_in(dtype, &[r, c], xs);
            let xin = x.to_f64_vec();
            let outs = run_all(&k, &[&x]);
            for (axis, out) in [(1, &outs[0]), (0, &outs[1])] {
                let (want, abs) = cumsum_ref(&xin, r, c, axis);
                let n = if axis == 1 { c } else { r };
                let got = out.to_f64_vec();
                for i in 0..got.len() {
                    // Sequential f32 additions: |error| <= (n - 1) eps sum |x| (Higham's bound);
                    // bf16 adds one rounding of the result (half a bf16 ulp, 2^-8 relative).
                    let f32_bound = (n as f64 - 1.0) * f32::EPSILON as f64 * abs[i];
                    let bound = match dtype {
                        DType::F32 => f32_bound,
                        _ => f32_bound * (1.0 + 1.0 / 256.0) + want[i].abs() / 256.0,
                    };
                    assert!((got[i] - want[i]).abs() <= bound + 1e-30, "{dtype} [{r}, {c}] axis {axis} element {i}: got {}, want {} (bound {bound:e})", got[i], want[i]);
                }
            }
        }
    }
}

/// A rank-3 block scanned along its last two axes.
#[tpu_kernel(grid = [1], x = block([a, r, c], |i| [0, 0, 0]), (lanes, rows) = block([a, r, c], |i| [0, 0, 0]))]
fn cumsum3(x: In<a, r, c>, lanes: Out<a, r, c>, rows: Out<a, r, c>) {
    let v = x[..];
    lanes[..] = v.cumsum(2);
    rows[..] = v.cumsum(1);
}

#[test]
fn cumsum_of_rank3_blocks_scans_each_matrix() {
    let (a, r, c) = (3, 16, 256);
    for dtype in [DType::F32, DType::I32] {
        let t = ty(dtype, &[a, r, c]);
        let k = cumsum3(t.clone(), t.clone(), t).unwrap();
        let xs: Vec<f32> = (0..a * r * c).map(|i| ((i * 7919) % 201) as f32 - 100.0).collect();
        let x = match dtype {
            DType::I32 => Array::from_i32(&[a, r, c], xs.iter().map(|&v| v as i32).collect()),
            _ => Array::from_f32(&[a, r, c], xs.clone()),
        };
        let outs = run_all(&k, &[&x]);
        let m = r * c;
        for p in 0..a {
            let xin: Vec<f64> = xs[p * m..(p + 1) * m].iter().map(|&v| v as f64).collect();
            for (axis, out) in [(1usize, &outs[0]), (0, &outs[1])] {
                // Small integers: every partial sum is exact in f32.
                let (want, _) = cumsum_ref(&xin, r, c, axis);
                assert_eq!(&out.to_f64_vec()[p * m..(p + 1) * m], &want[..], "{dtype} matrix {p} axis {}", axis + 1);
            }
        }
    }
}

#[test]
fn cumsum_bf16_adds_in_f32_as_torch_does() {
    // torch.cumsum(torch.ones(2048, dtype=torch.bfloat16)) gives 256 at index 255, 258 at
    // 257 and 2048 at the end (f32 accumulation, each output rounded once); a bf16 running
    // sum would stop at 256.
    let t = ty(DType::BF16, &[8, 2048]);
    let k = cumsum2(t.clone(), t.clone(), t).unwrap();
    let x = Array::from_bf16(&[8, 2048], vec![bf16::ONE; 8 * 2048]);
    let outs = run_all(&k, &[&x]);
    let row = &outs[0].to_f64_vec()[..2048];
    assert_eq!((row[255], row[256], row[257], row[1000], row[2047]), (256.0, 256.0, 258.0, 1000.0, 2048.0));
}

#[test]
fn cumsum_propagates_nan_and_inf_as_torch() {
    let (r, c) = (8, 128);
    let t = ty(DType::F32, &[r, c]);
    let k = cumsum2(t.clone(), t.clone(), t).unwrap();
    let mut xs = vec![1.0f32; r * c];
    // Row 0: NaN at 3. Row 1: +inf at 2, then -inf at 5 (inf - inf = NaN). Row 2: -inf.
    xs[3] = f32::NAN;
    xs[c + 2] = f32::INFINITY;
    xs[c + 5] = f32::NEG_INFINITY;
    xs[2 * c + 7] = f32::NEG_INFINITY;
    let outs = run_all(&k, &[&Array::from_f32(&[r, c], xs)]);
    let g = outs[0].to_f64_vec();
    assert_eq!(g[2], 3.0);
    assert!(g[3..c].iter().all(|v| v.is_nan()), "NaN propagates to the end of its row");
    assert_eq!(g[c + 1], 2.0);
    assert!(g[c + 2..c + 5].iter().all(|&v| v == f64::INFINITY));
    assert!(g[c + 5..2 * c].iter().all(|v| v.is_nan()), "inf + -inf is NaN from there on");
    assert!(g[2 * c + 7..3 * c].iter().all(|&v| v == f64::NEG_INFINITY));
    assert_eq!(g[3 * c + 127], 128.0);
}

#[test]
fn cumsum_i32_wraps_on_every_backend() {
    let (r, c) = (16, 256);
    let t = ty(DType::I32, &[r, c]);
    let k = cumsum2(t.clone(), t.clone(), t).unwrap();
    let mut rnd = lcg(5);
    let xs: Vec<i32> = (0..r * c).map(|i| if i % 97 == 0 { i32::MAX } else { (rnd() * 2e6) as i32 - 1_000_000 }).collect();
    let outs = run_all(&k, &[&Array::from_i32(&[r, c], xs.clone())]);
    for (axis, out) in [(1usize, &outs[0]), (0, &outs[1])] {
        let got = out.as_i32().unwrap();
        let (outer, n) = if axis == 1 { (r, c) } else { (c, r) };
        for o in 0..outer {
            let mut s: i64 = 0;
            for j in 0..n {
                let at = if axis == 1 { o * c + j } else { j * c + o };
                s += xs[at] as i64;
                assert_eq!(got[at], s as i32, "axis {axis} at {at}: wrapped i64 sum");
            }
        }
    }
}

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn cumsum_i8(x: In<8, 128>, out: Out<8, 128>) {
    out[..] = x[..].cumsum(1);
}

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn cumsum_bad_axis(x: In<8, 128>, out: Out<8, 128>) {
    out[..] = x[..].cumsum(2);
}

#[tpu_kernel(grid = [1], x = block([2, 8, 128], |i| [0, 0, 0]), out = block([2, 8, 128], |i| [0, 0, 0]))]
fn cumsum_leading(x: In<2, 8, 128>, out: Out<2, 8, 128>) {
    out[..] = x[..].cumsum(0);
}

#[test]
fn cumsum_misuse_is_a_clear_error() {
    let i8t = ty(DType::I8, &[8, 128]);
    expect_err(cumsum_i8(i8t.clone(), i8t), "op-dtype", &["cumsum", "i8", "cast to i32"]);
    let f = ty(DType::F32, &[8, 128]);
    expect_err(cumsum_bad_axis(f.clone(), f), "reduce-axis", &["axis 2", "below 2"]);
    // A leading-axis scan runs on the interpreter's semantics but Mosaic's lowering scans
    // only the last two axes: the verifier says so for every generation.
    let t3 = ty(DType::F32, &[2, 8, 128]);
    let k = cumsum_leading(t3.clone(), t3).unwrap();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let e = tessera_dsl::verify::verify(&k, &target).unwrap_err();
        assert_eq!(e.rule, "cumsum-axis", "{e}");
        assert!(e.to_string().contains("last two axes"), "{e}");
    }
}

// ---- strided slices -----------------------------------------------------------------------

/// Even rows (static `step_by`), odd rows (`ds(1, 8, 2)`), every third row from a dynamic
/// start, written back through a strided store into the rows 0, 2, .. of `inter`.
#[tpu_kernel(grid = [r / 24], x = block([24, c], |i| [i, 0]), (even, odd, third) = block([8, c], |i| [i, 0]), inter = block([16, c], |i| [i, 0]))]
fn strided(x: In<r, c>, even: Out<e, c>, odd: Out<e, c>, third: Out<e, c>, inter: Out<m, c>) {
    let e = x[((0..16).step_by(2), ..)];
    even[..] = e;
    odd[..] = x[(ds(1, 8, 2), ..)];
    let s = program_id(0) % 3;
    third[..] = x[(ds(s, 8, 3), ..)];
    inter[..] = 0;
    inter[((0..16).step_by(2), ..)] = e + e;
    inter[(ds(1, 8, 2), ..)] = x[(ds(1, 8, 2), ..)] + 1;
}

/// A stride on the leading dim of a rank-3 block.
#[tpu_kernel(grid = [1], x = block([4, 8, 128], |i| [0, 0, 0]), out = block([2, 8, 128], |i| [0, 0, 0]))]
fn strided_leading(x: In<4, 8, 128>, out: Out<2, 8, 128>) {
    out[..] = x[((1..4).step_by(2), .., ..)];
}

#[test]
fn strided_loads_and_stores_match_index_arithmetic_on_every_backend() {
    for dtype in [DType::F32, DType::I32, DType::BF16] {
        let (n, c) = (4, 128);
        let rows = 24 * n;
        let mut rnd = lcg(11);
        let xs: Vec<f32> = (0..rows * c).map(|_| (rnd() * 200.0 - 100.0).round()).collect();
        let x = match dtype {
            DType::I32 => Array::from_i32(&[rows, c], xs.iter().map(|&v| v as i32).collect()),
            _ => Array::from_f32_in(dtype, &[rows, c], xs.clone()),
        };
        let xt = ty(dtype, &[rows, c]);
        let ot = ty(dtype, &[8 * n, c]);
        let k = match strided(xt, ot.clone(), ot.clone(), ot, ty(dtype, &[16 * n, c])) {
            Ok(k) => k,
            Err(e) => panic!("{e}"),
        };
        if dtype == DType::BF16 {
            // bf16 strided stores do not compile on any generation (strided-access).
            let e = tessera_dsl::verify::verify(&k, &Target::V5E).unwrap_err();
            assert_eq!(e.rule, "strided-access", "{e}");
            assert!(e.to_string().contains("32-bit"), "{e}");
            continue;
        }
        let outs = run_all(&k, &[&x]);
        let got: Vec<Vec<f64>> = outs.iter().map(|o| o.to_f64_vec()).collect();
        let at = |r: usize, j: usize| xs[r * c + j] as f64;
        for b in 0..n {
            for i in 0..8 {
                for j in 0..c {
                    let o = (b * 8 + i) * c + j;
                    assert_eq!(got[0][o], at(24 * b + 2 * i, j), "even row {i} of block {b}");
                    assert_eq!(got[1][o], at(24 * b + 1 + 2 * i, j), "odd row {i} of block {b}");
                    assert_eq!(got[2][o], at(24 * b + b % 3 + 3 * i, j), "every third row from {} of block {b}", b % 3);
                }
            }
            for i in 0..16 {
                for j in 0..c {
                    let want = if i % 2 == 0 { 2.0 * at(24 * b + i, j) } else { at(24 * b + i, j) + 1.0 };
                    assert_eq!(got[3][(b * 16 + i) * c + j], want, "interleaved row {i} of block {b}");
                }
            }
        }
    }
    let t = ty(DType::F32, &[4, 8, 128]);
    let k = strided_leading(t, ty(DType::F32, &[2, 8, 128])).unwrap();
    let xs: Vec<f32> = (0..4 * 8 * 128).map(|i| i as f32).collect();
    let outs = run_all(&k, &[&Array::from_f32(&[4, 8, 128], xs.clone())]);
    let g = outs[0].to_f64_vec();
    for (p, src) in [(0usize, 1usize), (1, 3)] {
        for e in 0..8 * 128 {
            assert_eq!(g[p * 1024 + e], xs[src * 1024 + e] as f64);
        }
    }
}

/// A dynamic strided start past the block: a run-time `slice-out-of-bounds` on every backend.
#[tpu_kernel(grid = [2], x = block([16, 128], |i| [0, 0]), out = block([8, 128], |i| [i, 0]))]
fn strided_overrun(x: In<16, 128>, out: Out<16, 128>) {
    // Rows p, p + 2, .., p + 14: past the block at p = 2 (step 1).
    let p = program_id(0) * 2;
    out[..] = x[(ds(p, 8, 2), ..)];
}

#[tpu_kernel(grid = [1], x = block([16, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn strided_static_overrun(x: In<16, 128>, out: Out<8, 128>) {
    out[..] = x[((2..18).step_by(2), ..)];
}

#[tpu_kernel(grid = [1], x = block([8, 256], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn strided_lanes(x: In<8, 256>, out: Out<8, 128>) {
    out[..] = x[(.., (0..256).step_by(2))];
}

#[tpu_kernel(grid = [1], x = block([16, 128], |i| [0, 0]), out = block([16, 128], |i| [0, 0]))]
fn strided_zero(x: In<16, 128>, out: Out<16, 128>) {
    out[..] = x[(ds(0, 16, 0), ..)];
}

#[test]
fn strided_misuse_is_a_clear_error() {
    let x = Array::from_f32(&[16, 128], (0..16 * 128).map(|i| i as f32).collect());
    let k = strided_overrun(ty(DType::F32, &[16, 128]), ty(DType::F32, &[16, 128])).unwrap();
    tessera_dsl::verify::verify(&k, &Target::V5E).unwrap();
    run_err(&k, &[&x], "slice-out-of-bounds", &["dim 0", "8 elements 2, 4, .., 16 (stride 2)", "block of 16"]);
    expect_err(strided_static_overrun(ty(DType::F32, &[16, 128]), ty(DType::F32, &[8, 128])), "static-out-of-bounds", &["stride 2", "block of 16"]);
    expect_err(strided_zero(ty(DType::F32, &[16, 128]), ty(DType::F32, &[16, 128])), "slice-stride", &["stride 0"]);
    let k = strided_lanes(ty(DType::F32, &[8, 256]), ty(DType::F32, &[8, 128])).unwrap();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let e = tessera_dsl::verify::verify(&k, &target).unwrap_err();
        assert_eq!(e.rule, "strided-access", "{e}");
        assert!(e.to_string().contains("last (lane) dim"), "{e}");
    }
    // No CPU backend runs what no generation compiles.
    for be in backends() {
        assert!(exec::run(be.executor(), &k, &[&Array::from_f32(&[8, 256], vec![0.0; 2048])]).is_err());
    }
}

// ---- the random generator -----------------------------------------------------------------

/// One block of random bits per grid step, the generator seeded with the user's seed and
/// the step (`pltpu.prng_seed(seed, pl.program_id(0))`); `twice` draws again after a
/// reseed with the same values, which must repeat the first draw.
#[tpu_kernel(grid = [r / 8], out = block([8, c], |i| [i, 0]), again = block([8, c], |i| [i, 0]))]
fn random_bits(seed: Prefetch<1>, out: Out<r, c>, again: Out<r, c>) {
    prng_seed(seed[0], program_id(0));
    out[..] = prng_random_bits([8, c]);
    prng_seed(seed[0], program_id(0));
    again[..] = prng_random_bits([8, c]);
}

/// SplitMix64 as `tessera_dsl::interp::Prng` documents it, written from the definition.
fn splitmix_ref(seeds: &[i32], n: usize) -> Vec<i32> {
    const G: u64 = 0x9E37_79B9_7F4A_7C15;
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut key = G;
    for &s in seeds {
        key = mix(key ^ s as u32 as u64);
    }
    (1..=n as u64).map(|i| (mix(key.wrapping_add(i.wrapping_mul(G))) >> 32) as u32 as i32).collect()
}

fn chi_square_16(words: &[i32]) -> f64 {
    let mut counts = [0usize; 16];
    for &w in words {
        counts[(w as u32 >> 28) as usize] += 1;
    }
    let e = words.len() as f64 / 16.0;
    counts.iter().map(|&c| (c as f64 - e).powi(2) / e).sum()
}

#[test]
fn prng_is_deterministic_per_seed_differs_per_step_and_is_uniform() {
    let (n, c) = (8, 256);
    let t = ty(DType::I32, &[8 * n, c]);
    let k = random_bits(ty(DType::I32, &[1]), t.clone(), t).unwrap();
    let per_step = 8 * c;
    let mut first_words = Vec::new();
    for seed in [0, 1, 42, -7] {
        let outs = run_all(&k, &[&Array::from_i32(&[1], vec![seed])]);
        let (a, b) = (outs[0].as_i32().unwrap().to_vec(), outs[1].as_i32().unwrap().to_vec());
        assert_eq!(a, b, "reseeding with the same values repeats the stream");
        // The documented generator, step by step.
        for s in 0..n {
            assert_eq!(&a[s * per_step..(s + 1) * per_step], &splitmix_ref(&[seed, s as i32], per_step)[..], "seed {seed}, step {s}");
        }
        // Steps seeded with their program id differ.
        for s in 1..n {
            let same = (0..per_step).filter(|&i| a[i] == a[s * per_step + i]).count();
            assert!(same < 4, "steps 0 and {s} share {same} words");
        }
        // Uniform top nibbles: chi-square with 15 degrees of freedom, p = 0.001 at 37.7.
        let chi = chi_square_16(&a);
        assert!(chi < 37.7, "seed {seed}: chi-square {chi:.1} over 16 buckets of {} words", a.len());
        // Each bit is one half of the time, within 5 sigma.
        let sigma = 0.5 / (a.len() as f64).sqrt();
        for bit in 0..32 {
            let ones = a.iter().filter(|&&w| (w as u32 >> bit) & 1 == 1).count() as f64 / a.len() as f64;
            assert!((ones - 0.5).abs() < 5.0 * sigma, "seed {seed}: bit {bit} is set in {ones:.4} of the words");
        }
        first_words.push(a[0]);
    }
    first_words.dedup();
    assert_eq!(first_words.len(), 4, "different seeds, different streams");
}

/// Dropout with keep probability `1 - p`: a word's top 24 bits against `p * 2^24`.
#[tpu_kernel(grid = [r / 8, c / 128], x = block([8, 128], |i, j| [i, j]), out = block([8, 128], |i, j| [i, j]))]
fn dropout(seed: Prefetch<1>, x: In<r, c>, out: Out<r, c>, p: f32) {
    prng_seed(seed[0], program_id(0) * num_programs(1) + program_id(1));
    let bits = prng_random_bits([8, 128]);
    let threshold = (p as f64 * 16_777_216.0) as i32;
    let keep = bits.shr_logical(8) >= threshold;
    out[..] = select(keep, x[..] * (1.0 / (1.0 - p)), 0.0);
}

#[test]
fn dropout_keeps_the_expected_fraction_on_every_backend() {
    let (r, c) = (64, 512);
    for dtype in [DType::F32, DType::BF16] {
        for p in [0.1f32, 0.5, 0.9] {
            let k = dropout(ty(DType::I32, &[1]), ty(dtype, &[r, c]), ty(dtype, &[r, c]), p).unwrap();
            let x = Array::from_f32_in(dtype, &[r, c], vec![1.0; r * c]);
            let outs = run_all(&k, &[&Array::from_i32(&[1], vec![1234]), &x]);
            let got = outs[0].to_f64_vec();
            let scale = match dtype {
                DType::F32 => (1.0 / (1.0 - p)) as f64,
                _ => bf16::from_f32(1.0 / (1.0 - p)).to_f64(),
            };
            let kept = got.iter().filter(|&&v| v != 0.0).count();
            assert!(got.iter().all(|&v| v == 0.0 || v == scale), "kept values are x / (1 - p)");
            let n = got.len() as f64;
            let rate = kept as f64 / n;
            let sigma = ((1.0 - p as f64) * p as f64 / n).sqrt();
            assert!((rate - (1.0 - p as f64)).abs() < 5.0 * sigma, "{dtype} p = {p}: kept {rate:.4}, want {:.4} +- {:.4}", 1.0 - p, 5.0 * sigma);
            // Every (8, 128) tile draws its own stream: no two tiles keep the same mask.
            let tile = |t: usize| -> Vec<bool> { (0..8).flat_map(|i| (0..128).map(move |j| (i, j))).map(|(i, j)| got[((t / 4) * 8 + i) * c + (t % 4) * 128 + j] != 0.0).collect() };
            assert_ne!(tile(0), tile(1));
            assert_ne!(tile(0), tile(4));
        }
    }
}

#[tpu_kernel(grid = [1], out = block([8, 128], |i| [0, 0]))]
fn unseeded(out: Out<8, 128>) {
    out[..] = prng_random_bits([8, 128]);
}

#[tpu_kernel(grid = [1], out = block([8, 128], |i| [0, 0]))]
fn three_seeds(out: Out<8, 128>) {
    prng_seed(1, 2, 3);
    out[..] = prng_random_bits([8, 128]);
}

#[tpu_kernel(grid = [1], out = block([8, 128], |i| [0, 0]))]
fn seed_f32(out: Out<8, 128>) {
    prng_seed(1.5);
    out[..] = prng_random_bits([8, 128]);
}

#[tpu_kernel(grid = [1], out = block([8, 128], |i| [0, 0]))]
fn bits_1d(out: Out<8, 128>) {
    prng_seed(1);
    out[..] = prng_random_bits([1024]).reshape([8, 128]);
}

#[test]
fn prng_misuse_is_a_clear_error() {
    let o = ty(DType::I32, &[8, 128]);
    let k = unseeded(o.clone()).unwrap();
    run_err(&k, &[], "prng-unseeded", &["before any prng_seed", "grid step [0]"]);
    let k = three_seeds(o.clone()).unwrap();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let e = tessera_dsl::verify::verify(&k, &target).unwrap_err();
        assert_eq!(e.rule, "prng-seed-count", "{e}");
    }
    expect_err(seed_f32(o.clone()), "prng-seed", &["seed 0 has type f32", "i32"]);
    expect_err(bits_1d(o), "prng-shape", &["[1024]", "rank 2"]);
}

// ---- integer bitwise ops ------------------------------------------------------------------

/// int4 unpacking with masks, as a quantised-weight loader writes it: the low and high
/// nibbles of each byte as unsigned values (`x & 0xF`, `(x >> 4) & 0xF`), and the bitwise
/// identities `!x`, `x & y`, `x | y`, `x ^ y`.
#[tpu_kernel(grid = [r / 32], (x, y) = block([32, c], |i| [i, 0]), (lo, hi, not, and, or, xor) = block([32, c], |i| [i, 0]))]
fn bitwise(x: In<r, c>, y: In<r, c>, lo: Out<r, c>, hi: Out<r, c>, not: Out<r, c>, and: Out<r, c>, or: Out<r, c>, xor: Out<r, c>) {
    let v = x[..];
    let w = y[..];
    lo[..] = v & 0xF;
    hi[..] = (v >> 4) & 0xF;
    not[..] = !v;
    and[..] = v & w;
    or[..] = v | w;
    xor[..] = v ^ w;
}

#[test]
fn bitwise_ops_and_masked_int4_unpacking_match_plain_integers() {
    let (r, c) = (32, 256);
    let len = r * c;
    for dtype in [DType::I32, DType::I8] {
        let mut rnd = lcg(3);
        let wrap = |v: i64| if dtype == DType::I8 { v as i8 as i64 } else { v as i32 as i64 };
        let xs: Vec<i64> = (0..len).map(|i| if i < 256 { wrap(i as i64 - 128) } else { wrap((rnd() * 4e9) as i64 - 2_000_000_000) }).collect();
        let ys: Vec<i64> = (0..len).map(|_| wrap((rnd() * 4e9) as i64 - 2_000_000_000)).collect();
        let arr = |v: &[i64]| if dtype == DType::I8 { Array::from_i8(&[r, c], v.iter().map(|&x| x as i8).collect()) } else { Array::from_i32(&[r, c], v.iter().map(|&x| x as i32).collect()) };
        let t = ty(dtype, &[r, c]);
        let k = bitwise(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t).unwrap();
        let outs = run_all(&k, &[&arr(&xs), &arr(&ys)]);
        let got: Vec<Vec<i64>> = outs.iter().map(|o| o.to_f64_vec().iter().map(|&v| v as i64).collect()).collect();
        for i in 0..len {
            let (x, y) = (xs[i], ys[i]);
            // Bytes and words as unsigned bit patterns, nibbles by division.
            let u = if dtype == DType::I8 { x as u8 as u64 } else { x as u32 as u64 };
            assert_eq!(got[0][i], (u % 16) as i64, "{dtype}: {x} & 0xF");
            // An arithmetic shift then the mask: bits 4..8 of the pattern.
            assert_eq!(got[1][i], ((u / 16) % 16) as i64, "{dtype}: ({x} >> 4) & 0xF");
            assert_eq!(got[2][i], -x - 1, "{dtype}: !{x}");
            assert_eq!(got[3][i], wrap(x & y), "{dtype}: {x} & {y}");
            assert_eq!(got[4][i], wrap(x | y), "{dtype}: {x} | {y}");
            assert_eq!(got[5][i], wrap(x ^ y), "{dtype}: {x} ^ {y}");
        }
    }
}

// ---- libtpu ---------------------------------------------------------------------------------

/// The libtpu tier (`TESSERA_TPU_ORACLE=1`): the kernels above that verify, in the dtypes
/// they ran in, compile for v5e, v6e and tpu7x.
#[test]
fn libtpu_compiles_cumsum_strided_and_prng_for_v5e_v6e_tpu7x() {
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let mut kernels: Vec<Kernel> = Vec::new();
    for (r, c) in [(8, 2048), (256, 128), (16, 256), (8, 200), (3, 128)] {
        for dtype in [DType::F32, DType::BF16, DType::I32] {
            let t = ty(dtype, &[r, c]);
            kernels.push(cumsum2(t.clone(), t.clone(), t).unwrap());
        }
    }
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        let t = ty(dtype, &[2, 16, 256]);
        kernels.push(cumsum3(t.clone(), t.clone(), t).unwrap());
    }
    for dtype in [DType::F32, DType::I32] {
        let ot = ty(dtype, &[32, 128]);
        kernels.push(strided(ty(dtype, &[96, 128]), ot.clone(), ot.clone(), ot, ty(dtype, &[64, 128])).unwrap());
    }
    kernels.push(strided_leading(ty(DType::F32, &[4, 8, 128]), ty(DType::F32, &[2, 8, 128])).unwrap());
    kernels.push(random_bits(ty(DType::I32, &[1]), ty(DType::I32, &[64, 256]), ty(DType::I32, &[64, 256])).unwrap());
    for dtype in [DType::F32, DType::BF16] {
        kernels.push(dropout(ty(DType::I32, &[1]), ty(dtype, &[64, 512]), ty(dtype, &[64, 512]), 0.5).unwrap());
    }
    for dtype in [DType::I32, DType::I8] {
        let t = ty(dtype, &[64, 256]);
        kernels.push(bitwise(t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t.clone(), t).unwrap());
    }
    // Every target in one batch: the oracle compiles the targets in parallel.
    let mut jobs = Vec::new();
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        for (i, k) in kernels.iter().enumerate() {
            tessera_dsl::verify::verify(k, &target).unwrap_or_else(|e| panic!("{} on {}: {e}", k.name, target.name));
            let lowered = tessera_codegen::lower(k, &target).unwrap_or_else(|e| panic!("{} on {}: {e}", k.name, target.name));
            jobs.push((format!("{}-{i}", k.name), target.name.to_string(), lowered.stablehlo));
        }
    }
    oracle::assert_all_accepted(&jobs);
}

/// The alternative lowering of a lane cumsum: a matmul with the upper-triangular ones
/// matrix on the MXU (measured against the rotation scan below; not used).
#[tpu_kernel(grid = [1], x = block([r, c], |i| [0, 0]), o = block([r, c], |i| [0, 0]))]
fn cumsum_by_matmul(x: In<r, c>, o: Out<r, c>) {
    let row = iota([c, c], 0);
    let col = iota([c, c], 1);
    let u = select(row <= col, 1.0, 0.0);
    o[..] = dot(x[..], u);
}

#[tpu_kernel(grid = [1], x = block([r, c], |i| [0, 0]), o = block([r, c], |i| [0, 0]))]
fn cumsum_lanes(x: In<r, c>, o: Out<r, c>) {
    o[..] = x[..].cumsum(1);
}

#[tpu_kernel(grid = [1], x = block([r, c], |i| [0, 0]), o = block([r, c], |i| [0, 0]))]
fn cumsum_rows(x: In<r, c>, o: Out<r, c>) {
    o[..] = x[..].cumsum(0);
}

/// libtpu's static cycle estimate of the rotation scan against the triangular matmul, per
/// generation: a measurement that asserts nothing (the evidence behind the lowering's choice),
/// so not in the test command (`TESSERA_TPU_ORACLE=1 cargo test --release -p tessera-tests
/// --test dsl_ops_scan cumsum_lowering_costs -- --ignored --nocapture`). That every cumsum
/// lowering compiles is `libtpu_compiles_cumsum_strided_and_prng_for_v5e_v6e_tpu7x`'s test.
#[test]
#[ignore = "a libtpu measurement (prints the cycles), not a check: run with --ignored --nocapture"]
fn cumsum_lowering_costs() {
    use tessera_tests::oracle;
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to profile with libtpu");
        return;
    }
    let mut modules = Vec::new();
    for (r, c) in [(8, 128), (8, 512), (8, 2048), (256, 128), (256, 512)] {
        let t = ty(DType::F32, &[r, c]);
        modules.push((format!("scan-lanes-{r}x{c}"), cumsum_lanes(t.clone(), t.clone()).unwrap()));
        modules.push((format!("scan-rows-{r}x{c}"), cumsum_rows(t.clone(), t.clone()).unwrap()));
        modules.push((format!("matmul-lanes-{r}x{c}"), cumsum_by_matmul(t.clone(), t).unwrap()));
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let mut m: Vec<(String, String)> = Vec::new();
        for (n, k) in &modules {
            match tessera_codegen::lower(k, &target) {
                Ok(l) => m.push((n.clone(), l.stablehlo)),
                Err(e) => println!("{:6} {n:22} not lowered: {}", target.name, e.to_string().chars().take(100).collect::<String>()),
            }
        }
        for v in oracle::profile(&m, target.name) {
            let p = v.profile.map(|p| format!("{} cycles, {} bundles, {} spills, {} KiB VMEM", p.cycles, p.bundles, p.vector_spills, p.vmem_bytes / 1024)).unwrap_or_default();
            println!("{:6} {:22} {} {}", target.name, v.name, if v.ok { "ok" } else { "REJECTED" }, if v.ok { p } else { v.error.chars().take(120).collect() });
        }
    }
}

/// A matmul accumulated into every other row: the JIT's in-place GEMM must not take a
/// strided destination for a dense one.
#[tpu_kernel(grid = [1], a = block([8, 128], |i| [0, 0]), b = block([128, 128], |i| [0, 0]), o = block([16, 128], |i| [0, 0]))]
fn strided_dot_acc(a: In<8, 128>, b: In<128, 128>, o: Out<16, 128>) {
    o[..] = 1.0;
    o[(ds(0, 8, 2), ..)] += dot(a[..], b[..]);
}

#[test]
fn a_dot_accumulated_into_strided_rows_lands_on_them() {
    let k = strided_dot_acc(ty(DType::F32, &[8, 128]), ty(DType::F32, &[128, 128]), ty(DType::F32, &[16, 128])).unwrap();
    let mut rnd = lcg(17);
    let a: Vec<f32> = (0..8 * 128).map(|_| rnd() - 0.5).collect();
    let b: Vec<f32> = (0..128 * 128).map(|_| rnd() - 0.5).collect();
    let (xa, xb) = (Array::from_f32(&[8, 128], a.clone()), Array::from_f32(&[128, 128], b.clone()));
    for be in backends() {
        let out = exec::run(be.executor(), &k, &[&xa, &xb]).unwrap_or_else(|e| panic!("{be:?}: {e}"));
        let g = out[0].to_f64_vec();
        for r in 0..16 {
            for j in 0..128 {
                let want = if r % 2 == 0 { 1.0 + (0..128).map(|p| a[(r / 2) * 128 + p] as f64 * b[p * 128 + j] as f64).sum::<f64>() } else { 1.0 };
                assert!((g[r * 128 + j] - want).abs() < 1e-4, "{be:?} row {r} col {j}: got {}, want {want}", g[r * 128 + j]);
            }
        }
    }
}
