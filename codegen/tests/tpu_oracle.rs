//! The ground truth: every emitted kernel must compile with the real TPU compiler
//! (libtpu through JAX's compile-only topologies, DESIGN.md §4) for v5e, v6e and tpu7x.
//!
//! Runs only when `TESSERA_TPU_ORACLE=1` and a venv with jax + libtpu exists at
//! `$TESSERA_VENV` or `<workspace>/.venv`; otherwise it prints why it skipped.
//! Set `TESSERA_ORACLE_KEEP=DIR` to keep the generated StableHLO files in DIR.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_codegen::lower;
use tessera_dsl::Target;

const TARGETS: [Target; 3] = [Target::V5E, Target::V6E, Target::TPU7X];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn oracle() -> Option<(PathBuf, PathBuf)> {
    if std::env::var("TESSERA_TPU_ORACLE").as_deref() != Ok("1") {
        eprintln!("note: TPU compiler oracle skipped (set TESSERA_TPU_ORACLE=1 to run it)");
        return None;
    }
    let venv = std::env::var_os("TESSERA_VENV").map(PathBuf::from).unwrap_or_else(|| workspace().join(".venv"));
    let python = venv.join("bin/python");
    let script = workspace().join("interop/python/tpu_compile.py");
    if !python.exists() || !script.exists() {
        eprintln!("note: TPU compiler oracle skipped: need {} and {}", python.display(), script.display());
        return None;
    }
    Some((python, script))
}

#[test]
fn every_kernel_compiles_for_every_target() {
    let Some((python, script)) = oracle() else { return };
    let dir = match std::env::var_os("TESSERA_ORACLE_KEEP") {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("tessera-oracle-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for t in TARGETS {
        let mut files = Vec::new();
        for k in common::all() {
            let l = lower(&k, &t).unwrap_or_else(|e| panic!("{e}"));
            let f = dir.join(format!("{}.{}.stablehlo.mlir", k.name, t.name));
            std::fs::write(&f, &l.stablehlo).unwrap();
            std::fs::write(dir.join(format!("{}.{}.mosaic.mlir", k.name, t.name)), &l.mosaic).unwrap();
            files.push(f);
        }
        let out = Command::new(&python).arg(&script).arg("--target").arg(t.name).args(&files).output().expect("run tpu_compile.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut seen = 0;
        for line in stdout.lines().filter(|l| l.starts_with('{')) {
            seen += 1;
            println!("{line}");
            if !line.contains("\"ok\": true") {
                failures.push(line.to_string());
            }
        }
        if seen != files.len() {
            failures.push(format!("{}: expected {} results, got {seen}; stderr: {}", t.name, files.len(), String::from_utf8_lossy(&out.stderr)));
        }
    }
    if std::env::var_os("TESSERA_ORACLE_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(failures.is_empty(), "the TPU compiler rejected generated kernels:\n{}", failures.join("\n"));
}
