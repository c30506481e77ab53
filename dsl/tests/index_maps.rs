//! `IndexExpr::simplified` keeps every index map's value at every grid point: random maps
//! over random grids, each evaluated before and after at every point (the verifier's own
//! evaluator is the reference), plus the simplifications the flash kernels rely on.
use proptest::prelude::*;
use tessera_dsl::verify::eval_static;
use tessera_dsl::{IndexExpr, IndexOp};

fn expr(grid_rank: usize) -> impl Strategy<Value = IndexExpr> {
    let leaf = prop_oneof![(0..grid_rank).prop_map(IndexExpr::Grid), (-3i64..700).prop_map(IndexExpr::Const), Just(IndexExpr::Const(0)), Just(IndexExpr::Const(1))];
    leaf.prop_recursive(4, 24, 2, |inner| {
        let op = prop_oneof![Just(IndexOp::Add), Just(IndexOp::Sub), Just(IndexOp::Mul), Just(IndexOp::Div), Just(IndexOp::Rem), Just(IndexOp::Min), Just(IndexOp::Max)];
        (op, inner.clone(), inner).prop_map(|(op, a, b)| IndexExpr::Bin(op, Box::new(a), Box::new(b)))
    })
}

/// Divisions the simplifier can take through: `(x * k + y) / d` and `(x * k) / d` with `k`
/// a multiple of `d` or `d` of `k` (some of each sign), `y` any map.
fn division(grid_rank: usize) -> impl Strategy<Value = IndexExpr> {
    (expr(grid_rank), expr(grid_rank), 1i64..5, 1i64..5, -1i64..2, any::<bool>()).prop_map(|(x, y, a, b, sign, with_y)| {
        let (k, d) = if a % 2 == 0 { (a * b * 8, b * 8) } else { (a * 8, a * b * 8) };
        let m = x * (k * if sign < 0 { -1 } else { 1 });
        let n = if with_y { m + y } else { m };
        n / d
    })
}

fn points(extents: &[usize]) -> Vec<Vec<i64>> {
    extents.iter().fold(vec![vec![]], |acc, &e| acc.into_iter().flat_map(|p| (0..e as i64).map(move |i| [p.clone(), vec![i]].concat())).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn simplified_maps_agree_everywhere_on_the_grid((extents, e) in prop::collection::vec(1usize..6, 1..4).prop_flat_map(|x| (Just(x.clone()), prop_oneof![expr(x.len()), division(x.len())]))) {
        let s = e.simplified(&extents);
        let (lo, hi) = e.range(&extents);
        for p in points(&extents) {
            let before = eval_static(&e, &p);
            // A map that divides by zero somewhere is refused by the verifier; elsewhere
            // the simplified map gives the same block index.
            if let Some(v) = before {
                prop_assert_eq!(eval_static(&s, &p), Some(v), "{} -> {} at {:?}", e, s, p);
                prop_assert!(lo <= v && v <= hi, "{} = {} at {:?} outside its range {:?}", e, v, p, (lo, hi));
            }
        }
    }
}

#[test]
fn a_clamp_the_grid_never_reaches_a_unit_divisor_and_a_divisible_division_go() {
    let (b, h, i, j) = (IndexExpr::Grid(0), IndexExpr::Grid(1), IndexExpr::Grid(2), IndexExpr::Grid(3));
    let extents = [1, 8, 4, 4];
    // Non-causal flash attention's kv block: min(j, (i * 512 + 2048) / 512) is j.
    assert_eq!(j.clone().min((i.clone() * 512i64 + 2048i64) / 512i64).simplified(&extents), j);
    // Causal: min(j, (i * 512 + 511) / 512) is min(j, i); with 256-row kv blocks,
    // min(j, i * 2 + 1).
    let causal = j.clone().min((i.clone() * 512i64 + 511i64) / 512i64);
    assert_eq!(causal.simplified(&extents), j.clone().min(i.clone()));
    let causal = j.clone().min((i.clone() * 512i64 + 511i64) / 256i64);
    assert_eq!(causal.simplified(&extents), j.clone().min(i.clone() * 2i64 + 1i64));
    // The backward's first q block of kv block j: (j * 128) / 256 is j / 2; a negative
    // numerator keeps its division (truncation is not the floor there).
    assert_eq!(((j.clone() * 128i64) / 256i64).simplified(&extents), j.clone() / 2i64);
    let below = (j.clone() * 128i64 - 300i64) / 256i64;
    assert_eq!(below.simplified(&extents), below);
    // One kv head per query head: h / (8 / 8) is h; an unused segment operand's b * 0 is 0.
    assert_eq!((h.clone() / 1i64).simplified(&extents), h);
    assert_eq!(IndexExpr::Bin(IndexOp::Mul, Box::new(b), Box::new(IndexExpr::Const(0))).simplified(&extents), IndexExpr::Const(0));
}
