//! `tessera-example tune` (the crate's CLI, `--features cli`) on the crate's own op: the
//! table it writes is the table the op then plans with. Compiles with libtpu, so it runs
//! with TESSERA_TPU_ORACLE=1 (scripts/test.sh sets it).
#![cfg(feature = "cli")]

use std::process::Command;

use tessera::{DType, Target};
use tessera_example::OPS;

#[test]
fn tune_writes_a_table_the_op_then_uses() {
    if std::env::var("TESSERA_TPU_ORACLE").as_deref() != Ok("1") {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let path = std::env::temp_dir().join(format!("tessera-example-tuned-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let args = ["tune", "scaled_silu", "--target", "v6e", "--dtype", "f32", "--shape", "x=1024x256", "--shape", "scale=256", "--statics", "beta=0.5, block_cols=256", "--save", path.to_str().unwrap()];
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-example")).args(args).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tune failed:\n{stdout}\n{stderr}");
    // Progress with an ETA on stderr; the ranking and the winner on stdout.
    assert!(stderr.contains("ETA"), "{stderr}");
    let best = stdout.lines().find_map(|l| l.strip_prefix("best: ")).unwrap_or_else(|| panic!("no winner:\n{stdout}")).to_string();
    assert!(best.starts_with("block_rows="), "the fixed knob stays out of the candidates: {best}");

    let table: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let entry = &table["entries"][0];
    assert_eq!((entry["op"].as_str(), entry["target"].as_str(), entry["dtype"].as_str(), entry["best"].as_str()), (Some("scaled_silu"), Some("v6e"), Some("f32"), Some(best.as_str())));
    assert_eq!(entry["candidates"].as_array().unwrap().len(), OPS[0].knobs[0].values.len() + 1, "one candidate per block_rows value, and the op's own rule");
    assert!(table["libtpu"].is_string(), "the table records the compiler that ranked it");

    // The op plans with the table's winner once the table is loaded, not before. At this
    // shape the row rule takes all 1024 rows (1 MiB of f32), which no candidate is.
    let op = &OPS[0];
    let types = op.types(&[vec![1024, 256], vec![256]], DType::F32);
    let call = op.statics("beta=0.5, block_cols=256").unwrap();
    let explicit = op.statics(&format!("beta=0.5, block_cols=256, {best}")).unwrap();
    let blocks = |s| op.plan_for(&types, s, &Target::V6E).unwrap().launches[0].kernel.to_string().lines().find(|l| l.contains("@0 x:")).unwrap().to_string();
    let before = blocks(&call);
    assert!(before.contains("block [1024,256]"), "{before}");
    tessera::tune::load_table_file(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(blocks(&call), blocks(&explicit), "after loading the table the call takes its best ({best})");
    assert_ne!(blocks(&call), before);
    // Another beta is another call: not in the table.
    assert!(blocks(&op.statics("beta=0.25, block_cols=256").unwrap()).contains("block [1024,256]"));
}
