//! Every row op on narrow and very wide rows (issue 9): `[65536, 1]`, `[65536, 2]`,
//! `[65536, 8]` (a row is 1-8 lanes but occupies 128 in VMEM), `[1, 1 << 20]` (one row
//! wider than VMEM at 8 sublanes: the two-pass column-block kernels) and ragged shapes
//! whose rows or columns no block divides, each against the op's independent f64
//! reference, in f32 and bf16, on the target with the least VMEM.

use tessera_dsl::exec::Interpreter;
use tessera_dsl::{DType, Target};
use tessera_kernels::{find, harness, Op};

/// The row ops: their first input is `[rows, width]`, the others `[width]` or `[rows]`.
const ROW_OPS: &[&str] = &[
    "gelu_affine", "softmax", "rmsnorm", "rmsnorm_residual", "rmsnorm_residual_bwd", "layernorm", "rmsnorm_bwd",
    "swiglu", "swiglu_bwd", "geglu", "geglu_bwd", "cross_entropy", "cross_entropy_bwd", "cross_entropy_with_grad",
];

/// Input shapes of `op` for rows `[m, n]`, from the table's dims (`[..., n]`, `[t, v]` are
/// the rows; a 1-d input named by the width is `[n]`, by the row count `[m]`; optional
/// dims such as `1?` left out).
fn shapes(op: &Op, m: usize, n: usize) -> Vec<Vec<usize>> {
    let items = |dims: &'static str| -> Vec<&'static str> { dims.trim_start_matches('[').trim_end_matches(']').split(", ").filter(|d| !d.ends_with('?')).collect() };
    let width = *items(op.inputs[0].dims).last().unwrap();
    op.inputs
        .iter()
        .map(|i| match items(i.dims)[..] {
            [_, _, ..] => vec![m, n],
            [d] if d == width => vec![n],
            _ => vec![m],
        })
        .collect()
}

fn check(m: usize, n: usize, dtypes: &[DType]) {
    for name in ROW_OPS {
        let op = find(name).unwrap();
        let shapes = shapes(op, m, n);
        let statics = op.statics("").unwrap();
        for &dtype in dtypes {
            let r = harness::run_case(op, &statics, &shapes, dtype, &Target::V5E, 5, &Interpreter).unwrap_or_else(|e| panic!("{name} {shapes:?} {dtype}: {e}"));
            assert!(r.passed(), "{name} {shapes:?} {dtype}: {:?}", r.worst());
        }
    }
}

#[test]
fn narrow_rows() {
    for n in [1, 2, 8] {
        check(65536, n, &[DType::F32]);
    }
    check(65536, 2, &[DType::BF16]);
}

#[test]
fn one_row_wider_than_vmem() {
    check(1, 1 << 20, &[DType::F32, DType::BF16]);
}

#[test]
fn ragged_rows_and_columns() {
    // Rows no sublane multiple divides; wide rows whose last column block is partial.
    check(1001, 384, &[DType::F32, DType::BF16]);
    check(9, 100_003, &[DType::F32]);
}
