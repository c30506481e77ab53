//! The crate's own binary (`src/main.rs`, `tessera::cli::main(OPS)`) serves its ops beside
//! the library's through the `tessera` commands.
use std::process::Command;

fn cli(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_user-kernels")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "user-kernels {args:?} failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn lists_its_ops_beside_the_library() {
    let out = cli(&["list"]);
    let at = |s: &str| out.find(s).unwrap_or_else(|| panic!("`{s}` not listed:\n{out}"));
    assert!(at("residual_layernorm(Tensor x") < at("long_softmax(Tensor x)"));
    assert!(at("long_softmax(Tensor x)") < at("== the library's ops ==") && at("== the library's ops ==") < at("matmul(Tensor x"));
}

#[test]
fn runs_against_the_reference() {
    let out = cli(&["run", "long_softmax", "--backend", "interp", "--dtype", "bf16"]);
    assert_eq!(out.lines().filter(|l| l.starts_with("long_softmax") && l.ends_with(" ok")).count(), 2, "{out}");
    assert!(cli(&["run", "residual_layernorm"]).lines().any(|l| l.starts_with("residual_layernorm ") && l.ends_with(" ok")));
}

#[test]
fn emits() {
    let dir = std::env::temp_dir().join(format!("user-kernels-cli-{}", std::process::id()));
    let out = cli(&["emit", "long_softmax", "--case", "short", "--target", "tpu7x", "--out", dir.to_str().unwrap()]);
    for stem in ["long_softmax_short-softmax_stats_kernel", "long_softmax_short-softmax_apply_kernel"] {
        assert!(out.contains(stem), "{out}");
        assert!(dir.join(format!("{stem}.stablehlo.mlir")).exists() && dir.join(format!("{stem}.mosaic.mlir")).exists());
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn checks_with_libtpu() {
    if !tessera::testing::oracle_enabled() {
        return; // the libtpu tier (TESSERA_TPU_ORACLE=1)
    }
    let out = cli(&["check", "residual_layernorm", "--target", "v5e", "--target", "tpu7x"]);
    assert_eq!(out.matches(" accept ").count(), 2, "{out}");
}

/// `tune` refuses what it cannot tune, naming why; with libtpu it ranks the candidates of a
/// small flash attention and saves a table that records them.
#[test]
fn tunes_block_statics() {
    let fail = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_user-kernels")).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?} should be refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(fail(&["tune", "rmsnorm"]).contains("no block statics"));
    assert!(fail(&["tune", "flash_attention_fwd", "--case", "causal", "--statics", "block_q=128, block_kv=128"]).contains("every knob (block_q, block_kv) is fixed"));
    assert!(fail(&["tune", "--all"]).contains("one op at a time"));
    if !tessera::testing::oracle_enabled() {
        return; // the libtpu tier (TESSERA_TPU_ORACLE=1)
    }
    let table = std::env::temp_dir().join(format!("user-kernels-tune-{}.json", std::process::id()));
    let shapes = ["--shape", "q=1x2x256x128", "--shape", "k=1x2x256x128", "--shape", "v=1x2x256x128"];
    let mut args = vec!["tune", "flash_attention_fwd", "--case", "causal", "--dtype", "bf16", "--target", "v5e", "--statics", "block_q=128", "--save", table.to_str().unwrap()];
    args.extend(shapes);
    let out = cli(&args);
    // block_kv 128 and 256 fit the 256 keys and are ranked; 512 and 1024 are listed as pruned.
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("block_kv=") && !l.starts_with("best")).collect();
    assert_eq!((rows.len(), rows.iter().filter(|l| l.contains("pruned: block-shape")).count()), (4, 2), "{out}");
    assert!(out.contains("best: block_kv="), "{out}");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&table).unwrap()).unwrap();
    let entry = &saved["entries"][0];
    // The four knob values and the op's own block rule, the baseline a table entry must beat.
    assert!(out.lines().any(|l| l.contains("(the op's own block rule)") && !l.contains("pruned")), "{out}");
    assert_eq!((entry["op"].as_str(), entry["target"].as_str(), entry["candidates"].as_array().map(Vec::len)), (Some("flash_attention_fwd"), Some("v5e"), Some(5)), "{saved}");
    assert!(saved["libtpu"].as_str().is_some_and(|v| v != "unknown"), "{saved}");
    std::fs::remove_file(table).unwrap();
}
