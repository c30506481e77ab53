//! Verifier errors about an operand point at the `#[tpu_kernel]` argument that declared it
//! (`--> file:line:col` of the operand's name there), as builder errors point at their
//! statement. The line and column numbers below are this file's: keep the kernels in place.

use tessera_dsl::verify::verify;
use tessera_dsl::{DType, Target, Type};
use tessera_macros::tpu_kernel;

#[tpu_kernel(
    grid = [m / bm],
    x = block([bm, n], |i| [i, 0]),
    out = block([bm, n], |i| [i + 1, 0]),
)]
pub fn copy_rows(x: In<m, n>, out: Out<m, n>, bm: usize) {
    out[..] = x[..];
}

#[tpu_kernel(grid = [m / bm], (x, out) = block([bm, n], |i| [i, 0]))]
pub fn copy_grouped(x: In<m, n>, out: Out<m, n>, bm: usize) {
    out[..] = x[..];
}

fn at(e: &tessera_dsl::KernelError) -> (&'static str, u32, u32) {
    let loc = e.loc.clone().unwrap_or_else(|| panic!("no location on: {e}"));
    (loc.file, loc.line, loc.column)
}

#[test]
fn block_tiling_points_at_the_block_argument() {
    let t = Type::vector(DType::F32, &[1000, 128]);
    let e = verify(&copy_rows(t.clone(), t, 100).unwrap(), &Target::V5E).unwrap_err();
    assert_eq!(e.rule, "block-tiling");
    assert_eq!(at(&e), ("macros/tests/spans.rs", 11, 5));
    assert!(e.to_string().contains("\n  --> macros/tests/spans.rs:11:5\n"), "{e}");
}

#[test]
fn index_map_errors_point_at_their_operand() {
    // `out`'s map `[i + 1, 0]` steps past the last block: block-bounds, on `out`'s line.
    let t = Type::vector(DType::F32, &[64, 128]);
    let e = verify(&copy_rows(t.clone(), t, 8).unwrap(), &Target::V5E).unwrap_err();
    assert!(e.subject.contains("out"), "{e}");
    assert_eq!(at(&e), ("macros/tests/spans.rs", 12, 5));
}

#[test]
fn grouped_declarations_point_at_each_name() {
    let t = Type::vector(DType::F32, &[1000, 128]);
    // The error is about `x`, the first name of the group: its column, not the paren's.
    let e = verify(&copy_grouped(t.clone(), t, 100).unwrap(), &Target::V6E).unwrap_err();
    assert_eq!((e.rule, at(&e)), ("block-tiling", ("macros/tests/spans.rs", 18, 32)));
}
