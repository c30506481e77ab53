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

/// A contraction whose grid drops the input's last block (`k / bk` steps, `k` not a multiple
/// of `bk`) verifies (it is legal) but warns `input-unread`; no library kernel at any of its
/// cases and dtypes leaves an input's end unread.
#[test]
fn an_input_whose_end_no_step_reads_warns_and_no_library_kernel_does() {
    let (k, bk) = (500, 128);
    let mut b = KernelBuilder::new("truncated_sum");
    b.grid(&[(k / bk, Semantics::Arbitrary)]);
    let x = b.input("x", DType::F32, &[8, k], BlockSpec { block_shape: vec![Some(8), Some(bk)], index_map: vec![I::Const(0), I::Grid(0)] });
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![I::Const(0), I::Const(0)] });
    let v = b.load(x, &[Index::Full, Index::Full]);
    b.store(o, &[Index::Full, Index::Full], v);
    let kernel = b.finish().unwrap();
    verify::verify(&kernel, &Target::V5E).unwrap();
    let w = verify::warnings(&kernel, &Target::V5E);
    assert!(w.iter().any(|w| w.rule == "input-unread" && w.subject == "input `x`" && w.help.contains("500.div_ceil(128)")), "{w:?}");

    let mut checked = 0;
    for op in tessera_kernels::library() {
        let schema = op.parsed().unwrap();
        for case in op.cases {
            for dtype in [DType::F32, DType::BF16] {
                let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
                let statics = tessera_kernels::Statics::parse(&schema, case.statics).unwrap();
                let Ok(plan) = op.plan_for(&op.types(&shapes, dtype), &statics, &Target::V6E) else { continue };
                for l in &plan.launches {
                    let unread: Vec<_> = verify::warnings(&l.kernel, &Target::V6E).into_iter().filter(|w| w.rule == "input-unread").collect();
                    assert!(unread.is_empty(), "{} case {} {dtype}: {unread:?}", op.name, case.name);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "{checked}");
    eprintln!("{checked} library kernels checked");
}

/// A bool array in memory (Mosaic has no i1 memrefs) and a kernel name that is not an
/// identifier (it names MLIR symbols and emitted files: `../x` would write outside the
/// output dir) are refused by the verifier, so the CPU backends refuse them too.
#[test]
fn bool_memory_and_bad_kernel_names_are_refused_before_lowering() {
    let kernel = |name: &str, out: DType| {
        let mut b = KernelBuilder::new(name);
        b.grid(&[(1, Semantics::Parallel)]);
        let spec = || BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![I::Const(0), I::Const(0)] };
        let x = b.input("x", DType::F32, &[8, 128], spec());
        let o = b.output("out", out, &[8, 128], spec());
        let v = b.load(x, &[Index::Full, Index::Full]);
        let v = if out == DType::Bool { b.cmp(CmpOp::Gt, v, 0.0) } else { v };
        b.store(o, &[Index::Full, Index::Full], v);
        b.finish().unwrap()
    };
    let e = verify::verify(&kernel("positive", DType::Bool), &Target::V5E).unwrap_err();
    assert_eq!((e.rule, e.kernel.as_str()), ("memory-dtype", "positive"), "{e}");
    assert!(e.to_string().contains("output `out`") && e.to_string().contains("help: "), "{e}");
    assert!(verify::runnable(&kernel("positive", DType::Bool)).is_err());
    for name in ["../escaped", "", "a b", "9lives", "x\"y"] {
        let e = verify::verify(&kernel(name, DType::F32), &Target::V5E).unwrap_err();
        assert_eq!(e.rule, "kernel-name", "{name:?}: {e}");
    }
    verify::verify(&kernel("ok_name_2", DType::F32), &Target::V5E).unwrap();
}
