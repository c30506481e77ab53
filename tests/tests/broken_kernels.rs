//! Deliberately broken kernels. Each must be rejected by Tessera's own verifier (or the
//! builder) before any TPU compiler sees it, with a message that names the kernel, the
//! operand and the rule and says what to change. Where libtpu can judge the mistake,
//! `forced_through_libtpu` (in tpu_compiler.rs) shows the real compiler rejects it too.

use tessera_dsl::{IndexExpr as I, *};
use tessera_tests::broken::{self, Broken};

fn check(b: &Broken) {
    let err = broken::error_of(b).unwrap_or_else(|| panic!("`{}` was accepted, expected rule {}", b.name, b.rule));
    let text = err.to_string();
    assert_eq!(err.rule, b.rule, "{}: wrong rule, message was:\n{text}", b.name);
    assert_eq!(err.kernel, b.name, "{}: the message must name the kernel:\n{text}", b.name);
    assert!(text.contains(b.subject), "{}: the message must name `{}`:\n{text}", b.name, b.subject);
    assert!(text.contains("help: "), "{}: the message must say what to change:\n{text}", b.name);
    for needle in b.mentions {
        assert!(text.contains(needle), "{}: the message should mention `{needle}`:\n{text}", b.name);
    }
}

#[test]
fn every_broken_kernel_is_rejected_with_a_helpful_message() {
    let all = broken::all();
    assert!(all.len() >= 10);
    for b in &all {
        check(b);
    }
}

#[test]
fn messages_read_well() {
    // One full message pinned, as a user sees it.
    let b = broken::all().into_iter().find(|b| b.name == "bad_sublane_tiling").unwrap();
    insta::assert_snapshot!(broken::error_of(&b).unwrap().to_string());
}

#[test]
fn the_matmul_vmem_message_gives_numbers() {
    let b = broken::all().into_iter().find(|b| b.name == "vmem_overflow").unwrap();
    let text = broken::error_of(&b).unwrap().to_string();
    assert!(text.contains("MiB"), "{text}");
    assert!(text.contains("vmem_limit_bytes"), "{text}");
}

#[test]
fn builder_errors_carry_the_source_location() {
    let mut b = KernelBuilder::new("loc");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.input("x", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![I::Grid(0), I::Const(0)] });
    b.at("kernels/src/mine.rs", 12, 5);
    let v = b.load(x, &[]);
    let bad = b.iota(DType::I32, &[8, 128], 0);
    b.add(v, bad);
    let err = b.finish().unwrap_err();
    assert_eq!(err.rule, "dtype-mismatch");
    assert!(err.to_string().contains("kernels/src/mine.rs:12:5"), "{err}");
}

#[test]
fn tiling_help_never_suggests_a_block_breaking_its_rule() {
    // A [8, 1] block of an [8, 100] array: the next multiple of 128 passes the array, so the
    // help leads with the full dim (was "use a multiple of 128 (e.g. 100) or 100").
    let mut b = KernelBuilder::new("narrow_lane_block");
    b.grid(&[(100, Semantics::Parallel)]);
    let spec = || BlockSpec { block_shape: vec![Some(8), Some(1)], index_map: vec![I::Const(0), I::Grid(0)] };
    let x = b.input("x", DType::F32, &[8, 100], spec());
    let o = b.output("out", DType::F32, &[8, 100], spec());
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    let err = verify::verify(&b.finish().unwrap(), &Target::V5E).unwrap_err();
    assert_eq!(err.rule, "block-tiling", "{err}");
    assert_eq!(err.help, "use the full dim 100 (or 128, a multiple of 128 that pads past it)", "{err}");
}
