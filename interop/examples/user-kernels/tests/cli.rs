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
