//! The real TPU compiler as a test oracle: writes StableHLO modules to a temp dir and
//! compiles them with libtpu (compile-only topologies) through
//! `interop/python/tpu_compile.py` in the project venv. Each compile runs in a child
//! process, so a libtpu crash is a rejection, not a test-runner crash.
//!
//! [`compile_cached`] keeps every verdict under `target/tpu-verdicts/`, keyed by a hash of
//! the module text, the target and the libtpu version, so a rerun compiles only what changed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The oracle's verdict on one module.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub name: String,
    pub target: String,
    pub ok: bool,
    pub error: String,
    /// libtpu's static profile ([`profile`] only).
    pub profile: Option<tessera_codegen::StaticProfile>,
}

/// Whether the oracle tier is enabled (`TESSERA_TPU_ORACLE=1`, set by `scripts/test.sh`).
/// When it is not, tests print why they skip; when it is, a missing venv is a failure.
pub fn enabled() -> bool {
    std::env::var("TESSERA_TPU_ORACLE").is_ok_and(|v| v == "1")
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn python() -> PathBuf {
    std::env::var_os("TESSERA_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// Whether the venv with libtpu is there (for commands that can run without it).
pub fn available() -> bool {
    python().exists()
}

/// Compiles each `(name, stablehlo text)` for `target` (`v5e`, `v6e`, `tpu7x`, `v5p`).
pub fn compile(modules: &[(String, String)], target: &str) -> Vec<Verdict> {
    run_oracle(modules, target, false)
}

/// [`compile`] with libtpu's static LLO profile of each module (`tpu_compile.py --profile`).
pub fn profile(modules: &[(String, String)], target: &str) -> Vec<Verdict> {
    run_oracle(modules, target, true)
}

fn run_oracle(modules: &[(String, String)], target: &str, profile: bool) -> Vec<Verdict> {
    if modules.is_empty() {
        return Vec::new();
    }
    let python = python();
    assert!(python.exists(), "TESSERA_TPU_ORACLE=1 but {} is missing: run scripts/setup-venv.sh", python.display());
    let dir = std::env::temp_dir().join(format!("tessera-oracle-{}-{target}-{}", std::process::id(), rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    // Numbered file names: probe names may be long or repeat across callers.
    let files: Vec<PathBuf> = modules
        .iter()
        .enumerate()
        .map(|(i, (_, text))| {
            let p = dir.join(format!("m{i}.stablehlo.mlir"));
            std::fs::write(&p, text).unwrap();
            p
        })
        .collect();
    let out = Command::new(&python)
        .arg(repo().join("interop/python/tpu_compile.py"))
        .arg("--target")
        .arg(target)
        .env("TPU_COMPILE_PYTHON", &python)
        .args(&files)
        .args(profile.then_some("--profile"))
        .output()
        .expect("run tpu_compile.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut verdicts = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).expect("oracle prints JSON lines");
        let file = v["file"].as_str().unwrap_or_default();
        let stem = Path::new(file).file_name().and_then(|f| f.to_str()).unwrap_or_default().trim_end_matches(".stablehlo.mlir");
        let i: usize = stem.trim_start_matches('m').parse().expect("oracle echoes the file name");
        verdicts.push(Verdict { name: modules[i].0.clone(), target: target.to_string(), ok: v["ok"].as_bool() == Some(true), error: v["error"].as_str().unwrap_or_default().to_string(), profile: tessera_codegen::StaticProfile::from_report(&v) });
    }
    assert_eq!(verdicts.len(), modules.len(), "the oracle answered {} of {} modules; stderr:\n{}", verdicts.len(), modules.len(), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    verdicts
}

/// The installed libtpu's version (`0.0.52`), read once per process.
pub fn libtpu_version() -> String {
    static V: OnceLock<String> = OnceLock::new();
    V.get_or_init(|| {
        let out = Command::new(python()).args(["-c", "import importlib.metadata as m; print(m.version('libtpu'))"]).output();
        match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
            _ => "unknown".to_string(),
        }
    })
    .clone()
}

/// Whether the item `name` is in the stable sample of the expensive libtpu sweeps: one in
/// `TESSERA_LIBTPU_SAMPLE` (default `default_every`; `1` is every item), chosen by a hash of
/// the name, so a rerun judges the same items and a new item is in or out for good.
pub fn sampled(name: &str, default_every: u64) -> bool {
    in_stable_sample(name, sample_every(default_every))
}

/// Whether `name` is in the stable one-in-`every` sample (a hash of the name: the same
/// items on every run).
pub fn in_stable_sample(name: &str, every: u64) -> bool {
    fnv1a(name.as_bytes(), 0xcbf2_9ce4_8422_2325) % every.max(1) == 0
}

/// The sampling period of [`sampled`]: `TESSERA_LIBTPU_SAMPLE`, else `default_every`.
pub fn sample_every(default_every: u64) -> u64 {
    std::env::var("TESSERA_LIBTPU_SAMPLE").ok().and_then(|s| s.parse().ok()).filter(|&n| n >= 1).unwrap_or(default_every)
}

/// FNV-1a over `bytes` from a given offset basis; two bases give a 128-bit key.
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    bytes.iter().fold(basis, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn cache_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo().join("target"));
    target.join("tpu-verdicts")
}

fn cache_key(text: &str, target: &str, version: &str) -> String {
    let key = format!("{version}\n{target}\n{text}");
    format!("{:016x}{:016x}", fnv1a(key.as_bytes(), 0xcbf2_9ce4_8422_2325), fnv1a(key.as_bytes(), 0x6c62_272e_07bb_0142))
}

/// [`compile`] with a verdict cache under `target/tpu-verdicts/` (key: module text, target,
/// libtpu version). The pending modules compile at once, in chunks of one target's modules
/// (about one worker process more than there are cores).
pub fn compile_cached(jobs: &[(String, String, String)]) -> Vec<Verdict> {
    let version = libtpu_version();
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let keys: Vec<String> = jobs.iter().map(|(_, target, text)| cache_key(text, target, &version)).collect();
    let mut out: Vec<Option<Verdict>> = jobs
        .iter()
        .zip(&keys)
        .map(|((name, target, _), key)| {
            let text = std::fs::read_to_string(dir.join(key)).ok()?;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            Some(Verdict { name: name.clone(), target: target.clone(), ok: v["ok"].as_bool()?, error: v["error"].as_str().unwrap_or_default().to_string(), profile: None })
        })
        .collect();
    // The pending modules in worker-sized chunks of one target each, all compiled at once: a
    // worker per target left one core idle behind the target with the most modules (the
    // libtpu tier compiles every bf16 kernel for v5e, a sixth of them for the others).
    let pending: Vec<usize> = (0..jobs.len()).filter(|&i| out[i].is_none()).collect();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let per_worker = pending.len().div_ceil(workers).max(4);
    let mut chunks: Vec<(&str, Vec<usize>)> = Vec::new();
    let mut targets: Vec<&str> = pending.iter().map(|&i| jobs[i].1.as_str()).collect();
    targets.sort();
    targets.dedup();
    for t in targets {
        let idx: Vec<usize> = pending.iter().copied().filter(|&i| jobs[i].1 == t).collect();
        chunks.extend(idx.chunks(per_worker).map(|c| (t, c.to_vec())));
    }
    let results: Vec<(Vec<usize>, Vec<Verdict>)> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|(t, idx)| {
                let modules: Vec<(String, String)> = idx.iter().map(|&i| (jobs[i].0.clone(), jobs[i].2.clone())).collect();
                s.spawn(move || {
                    let verdicts = compile(&modules, t);
                    (idx, verdicts)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("oracle thread")).collect()
    });
    for (idx, verdicts) in results {
        for (i, v) in idx.into_iter().zip(verdicts) {
            // A timeout or a worker that did not start says nothing about the module.
            if !v.ok && (v.error.starts_with("timeout") || v.error.contains("failed to start")) {
                out[i] = Some(v);
                continue;
            }
            let record = serde_json::json!({ "ok": v.ok, "error": v.error, "libtpu": version, "target": v.target });
            let _ = std::fs::write(dir.join(&keys[i]), record.to_string());
            out[i] = Some(v);
        }
    }
    out.into_iter().map(|v| v.expect("every job has a verdict")).collect()
}

/// [`assert_accepted`] for `(name, target, module)` jobs of several targets: compiled all
/// targets at once and cached by module text ([`compile_cached`]).
pub fn assert_all_accepted(jobs: &[(String, String, String)]) {
    let verdicts = compile_cached(jobs);
    for v in &verdicts {
        eprintln!("{:<6} {:<44} {}", v.target, v.name, if v.ok { "accept" } else { "REJECT" });
    }
    let rejected: Vec<String> = verdicts.iter().filter(|v| !v.ok).map(|v| format!("{} on {}: {}", v.name, v.target, v.error)).collect();
    assert!(rejected.is_empty(), "libtpu rejected:\n{}", rejected.join("\n"));
}

/// Compiles `modules` for `target` (through the verdict cache, [`compile_cached`]), prints
/// each verdict, and fails listing every module libtpu rejected.
pub fn assert_accepted(modules: &[(String, String)], target: &str) {
    let jobs: Vec<(String, String, String)> = modules.iter().map(|(name, text)| (name.clone(), target.to_string(), text.clone())).collect();
    assert_all_accepted(&jobs);
}
