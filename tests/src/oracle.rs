//! The real TPU compiler as a test oracle: writes StableHLO modules to a temp dir and
//! compiles them with libtpu (compile-only topologies) through
//! `interop/python/tpu_compile.py` in the project venv. Each compile runs in a child
//! process, so a libtpu crash is a rejection, not a test-runner crash.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The oracle's verdict on one module.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub name: String,
    pub target: String,
    pub ok: bool,
    pub error: String,
}

/// Whether the oracle tier is enabled (`TESSERA_TPU_ORACLE=1`, set by `scripts/test.sh`).
/// When it is not, tests print why they skip; when it is, a missing venv is a failure.
pub fn enabled() -> bool {
    std::env::var("TESSERA_TPU_ORACLE").is_ok_and(|v| v == "1")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    std::env::var_os("TESSERA_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// Compiles each `(name, stablehlo text)` for `target` (`v5e`, `v6e`, `tpu7x`, `v5p`).
pub fn compile(modules: &[(String, String)], target: &str) -> Vec<Verdict> {
    let python = python();
    assert!(python.exists(), "TESSERA_TPU_ORACLE=1 but {} is missing: run scripts/setup-venv.sh", python.display());
    let dir = std::env::temp_dir().join(format!("tessera-oracle-{}-{target}-{}", std::process::id(), rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    let files: Vec<PathBuf> = modules
        .iter()
        .map(|(name, text)| {
            let p = dir.join(format!("{name}.stablehlo.mlir"));
            std::fs::write(&p, text).unwrap();
            p
        })
        .collect();
    let out = Command::new(&python).arg(repo().join("interop/python/tpu_compile.py")).arg("--target").arg(target).args(&files).output().expect("run tpu_compile.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut verdicts = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).expect("oracle prints JSON lines");
        let file = v["file"].as_str().unwrap_or_default();
        let name = Path::new(file).file_name().and_then(|f| f.to_str()).unwrap_or_default().trim_end_matches(".stablehlo.mlir").to_string();
        verdicts.push(Verdict { name, target: target.to_string(), ok: v["ok"].as_bool() == Some(true), error: v["error"].as_str().unwrap_or_default().to_string() });
    }
    assert_eq!(verdicts.len(), modules.len(), "the oracle answered {} of {} modules; stderr:\n{}", verdicts.len(), modules.len(), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    verdicts
}

/// Compiles `modules` for `target`, prints each verdict, and fails listing every module
/// libtpu rejected.
pub fn assert_accepted(modules: &[(String, String)], target: &str) {
    let verdicts = compile(modules, target);
    for v in &verdicts {
        eprintln!("{:<6} {:<44} {}", v.target, v.name, if v.ok { "accept" } else { "REJECT" });
    }
    let rejected: Vec<String> = verdicts.iter().filter(|v| !v.ok).map(|v| format!("{} on {}: {}", v.name, v.target, v.error)).collect();
    assert!(rejected.is_empty(), "libtpu rejected:\n{}", rejected.join("\n"));
}
