//! The kernel behind `torch.ops.tpu.scaled_silu`, tested in Rust: snapshots per target,
//! numerics against the f64 reference on every CPU backend (the kernel alone, and the op
//! with `x` of any rank), verification (and libtpu with TESSERA_TPU_ORACLE=1).
use tessera::testing::{self, float_dtypes, prop, Strategy};
use tessera::{random, DType, Kernel, KernelError, Target, Type};
use tessera_example::{blocks, reference, scaled_silu_kernel, OPS};

fn kernel(m: usize, n: usize, dt: DType, beta: f32) -> impl Fn(&Target) -> Result<Kernel, KernelError> {
    move |t| {
        let (x, scale) = (Type::vector(dt, &[m, n]), Type::vector(dt, &[1, n]));
        let b = blocks(&x, t);
        scaled_silu_kernel(x.clone(), scale, x, b.bm, b.bn, beta)
    }
}

#[test]
fn snapshots() {
    tessera::assert_snapshots!(kernel(512, 1024, DType::BF16, 1.702), [Target::V5E, Target::V6E]);
}

#[test]
fn verifies_and_compiles() {
    testing::assert_verifies(kernel(4096, 8192, DType::BF16, 1.0), &[Target::V5E, Target::V6E, Target::TPU7X]);
}

#[test]
fn kernel_numerics() {
    let cases = (1usize..300, prop::sample::select(vec![128usize, 200, 1024]), float_dtypes(), -2.0f32..2.0);
    testing::assert_numerics(
        cases,
        |&(m, n, dt, beta)| Ok((kernel(m, n, dt, beta)(&Target::V6E)?, vec![random(dt, &[m, n], 7), random(dt, &[1, n], 8)])),
        |&(_, _, _, beta), a| vec![reference(&a[0].to_f64_vec(), &a[1].to_f64_vec(), beta as f64)],
    );
}

#[test]
fn op_numerics() {
    // x of rank 1 to 3 over rows of n; scale [n].
    let cases = (prop::collection::vec(1usize..9, 0..3), prop::sample::select(vec![128usize, 640]), float_dtypes());
    let cases = cases.prop_map(|(mut lead, n, dt)| {
        lead.push(n);
        (vec![lead, vec![n]], dt)
    });
    testing::assert_op_numerics(&OPS[0], "beta=0.5", &Target::V5E, cases);
}

/// The blocks of the op's plan (rows, cols) for `x [m, n]` and `scale [n]`.
fn planned_blocks(x: &[usize], dtype: DType, statics: &str, target: &Target) -> Result<String, KernelError> {
    let op = &OPS[0];
    let plan = op.plan_for(&op.types(&[x.to_vec(), vec![x[x.len() - 1]]], dtype), &op.statics(statics)?, target)?;
    let ir = plan.launches[0].kernel.to_string();
    // `@0 x: input bf16[512,1024] vmem block [256,1024] at (g0, g1)`
    Ok(ir.lines().find(|l| l.contains("@0 x:")).and_then(|l| l.split("block ").nth(1)).and_then(|b| b.split(' ').next()).unwrap_or_default().to_string())
}

/// The crate's shipped table (`tuned.json`, written by `tessera-example tune --save`) sets
/// the blocks of exactly the calls it holds once added; explicit blocks and other shapes
/// are left alone; block statics are validated.
#[test]
fn tuning_table_sets_the_blocks_of_the_calls_it_holds() {
    let doc: serde_json::Value = serde_json::from_str(tessera_example::TUNED).unwrap();
    let entries = doc["entries"].as_array().unwrap();
    assert!(entries.len() >= 2, "tuned.json holds v5e and v6e entries");
    let n = tessera::tune::add_table(tessera_example::TUNED, "tuned.json").unwrap();
    assert_eq!(n, entries.len());
    for e in entries {
        let target = Target::by_name(e["target"].as_str().unwrap()).unwrap();
        let dtype = DType::parse(e["dtype"].as_str().unwrap()).unwrap();
        let x: Vec<usize> = e["shapes"]["x"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let best = e["best"].as_str().unwrap();
        let by_table = planned_blocks(&x, dtype, e["statics"].as_str().unwrap(), &target).unwrap();
        let by_hand = planned_blocks(&x, dtype, &format!("{}, {best}", e["statics"].as_str().unwrap()), &target).unwrap();
        assert_eq!(by_table, by_hand, "{target}: the table's best ({best}) is not what the plan uses");
        // Given blocks win over the table; another shape keeps the row rule.
        assert_eq!(planned_blocks(&x, dtype, &format!("{}, block_rows=8, block_cols=128", e["statics"].as_str().unwrap()), &target).unwrap(), "[8,128]");
        let mut other = x.clone();
        other[0] += 8;
        let rule = blocks(&Type::vector(dtype, &other), &target);
        assert_eq!(planned_blocks(&other, dtype, e["statics"].as_str().unwrap(), &target).unwrap(), format!("[{},{}]", rule.bm, rule.bn));
    }
    let err = planned_blocks(&[64, 256], DType::F32, "block_rows=0", &Target::V6E).unwrap_err();
    assert_eq!((err.rule, err.subject.as_str()), ("option-value", "argument `block_rows`"), "{err}");
    // A file that is not a table is a clear error naming it.
    let err = tessera::tune::add_table("{\"format\": 2}", "old.json").unwrap_err();
    assert!(err.to_string().contains("old.json") && err.to_string().contains("format 2"), "{err}");
}
