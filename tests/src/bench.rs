//! Shared plumbing of the side-by-side benchmarks (`tests/benches/`): read criterion's
//! medians, and run a JAX-side script in the project venv.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Criterion's median estimate in seconds for a benchmark id like `interp/matmul_1024`.
pub fn criterion_median(id: &str) -> Option<f64> {
    let path = repo().join("target/criterion").join(id).join("new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    Some(v["median"]["point_estimate"].as_f64()? * 1e-9)
}

/// Runs `scripts/<script>` with `args` in the venv's Python and parses the last JSON line
/// it prints. `None` (with a note) when the venv is missing or the script fails.
pub fn run_jax_script(script: &str, args: &[String]) -> Option<serde_json::Value> {
    let python = std::env::var_os("TESSERA_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"));
    if !python.exists() {
        eprintln!("no venv at {}: run scripts/setup-venv.sh for the JAX side", python.display());
        return None;
    }
    let out = Command::new(python).arg(repo().join("scripts").join(script)).args(args).output().ok()?;
    let line = String::from_utf8_lossy(&out.stdout).lines().rfind(|l| l.starts_with('{')).map(str::to_string);
    if line.is_none() {
        eprintln!("{script} printed no result:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_str(&line?).ok()
}

/// Where a bench writes its summary: `target/<name>.json`.
pub fn summary_path(name: &str) -> PathBuf {
    repo().join("target").join(format!("{name}.json"))
}
