//! A broken block spec in this crate points at the attribute argument that declared the
//! operand: `src/lib.rs` line 21, column 6 is the `x` of `(x, residual, y, h) = block(..)`.
use tessera::{DType, Target, Type};

#[test]
fn a_broken_block_spec_points_at_its_attribute_argument() {
    // 100 rows of a 1000-row f32 array: not a multiple of 8 (line 21, column 6 of src/lib.rs).
    let x = Type::vector(DType::F32, &[1000, 256]);
    let w = Type::vector(DType::F32, &[1, 256]);
    let k = user_kernels::residual_layernorm_kernel(x.clone(), x.clone(), w.clone(), w, x.clone(), x, 100, 1e-5).unwrap();
    let e = tessera::verify(&k, &[Target::V5E]).unwrap_err().to_string();
    assert!(e.starts_with("error[block-tiling]: kernel `residual_layernorm_kernel`, input `x`"), "{e}");
    assert!(e.contains("src/lib.rs:21:6\n"), "{e}");
}
