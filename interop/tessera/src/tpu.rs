//! Compiling kernels with the real TPU compiler: libtpu, compile-only, driven by
//! `interop/python/tpu_compile.py` in a child process of the project venv's Python. Emission
//! itself never needs Python; only this check does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use tessera_dsl::{Kernel, Target};

use crate::Error;

/// The oracle script ships inside the crate so a check works from any directory.
const TPU_COMPILE_PY: &str = include_str!("../../python/tpu_compile.py");

/// The Python that runs the TPU compiler: `$TESSERA_PYTHON`, else the Tessera checkout's
/// `.venv/bin/python` (made by `scripts/setup-venv.sh`).
pub fn python() -> PathBuf {
    // Set but empty (`TESSERA_PYTHON= cmd`) is unset.
    std::env::var_os("TESSERA_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from).unwrap_or_else(|| {
        // interop/tessera -> the checkout's root.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap_or(Path::new("."));
        root.join(".venv/bin/python")
    })
}

/// The Python of [`python`] if it exists and has jax, jaxlib and libtpu; otherwise an
/// error saying what is missing and how to get it.
pub fn tpu_ready() -> Result<PathBuf, Error> {
    let py = python();
    if !py.exists() {
        return Err(Error::Tpu(format!("the TPU compiler check needs Python with jax and libtpu: {} not found; create the venv with scripts/setup-venv.sh or set TESSERA_PYTHON to a Python that has them", py.display())));
    }
    let probe = "import importlib.util as u; print(' '.join(m for m in ('jax', 'jaxlib', 'libtpu') if u.find_spec(m) is None))";
    let out = Command::new(&py).args(["-c", probe]).output().map_err(|e| Error::Tpu(format!("cannot run {} as Python (TESSERA_PYTHON, else the checkout's .venv/bin/python): {e}", py.display())))?;
    let missing = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || !missing.is_empty() {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let what = if !missing.is_empty() {
            format!("it has no {missing}")
        } else if stderr.is_empty() {
            format!("it is not a Python that runs `-c` ({}, nothing printed)", out.status)
        } else {
            stderr
        };
        return Err(Error::Tpu(format!("the TPU compiler check needs jax, jaxlib and libtpu in {}: {what}; run scripts/setup-venv.sh or set TESSERA_PYTHON to a Python that has them", py.display())));
    }
    Ok(py)
}

/// The installed libtpu's version (`0.0.52`), or `unknown`.
pub fn libtpu_version() -> String {
    let out = tpu_ready().ok().and_then(|py| Command::new(py).args(["-c", "import importlib.metadata as m; print(m.version('libtpu'))"]).output().ok());
    match out {
        Some(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => "unknown".to_string(),
    }
}

/// libtpu's verdict on one kernel for one target.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub stem: String,
    pub target: Target,
    pub ok: bool,
    /// The compiler's message when it refused the kernel.
    pub error: String,
    pub seconds: f64,
    /// libtpu's static LLO profile ([`tpu_profile`] only; `None` where the profiler gave
    /// none, with the reason in `profile_note`; without `estimated` cycles where the profiler
    /// aborted, with the reason there too, or the grid is dynamic).
    pub profile: Option<tessera_codegen::StaticProfile>,
    pub profile_note: String,
    /// libtpu gave no answer within the time limit (`TESSERA_TPU_TIMEOUT`): not a verdict on
    /// the kernel (`ok` is false, `error` says so).
    pub timed_out: bool,
}

/// Seconds libtpu may take per kernel: `TESSERA_TPU_TIMEOUT`, else `tpu_compile.py`'s default
/// (120 s); a loaded machine may need more.
fn timeout_arg() -> Result<Option<String>, Error> {
    let Ok(text) = std::env::var("TESSERA_TPU_TIMEOUT") else { return Ok(None) };
    match text.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(Some(format!("{s}"))),
        _ => Err(Error::Tpu(format!("TESSERA_TPU_TIMEOUT={text:?} is not a positive number of seconds; set one (the default is 120) or unset it"))),
    }
}

/// Verifies and lowers every `(stem, kernel)` for `target` and compiles the StableHLO
/// modules with libtpu (compile-only: no TPU needed). A refused kernel is a [`Verdict`]
/// with `ok == false`; an `Err` means the compiler could not be run, or a kernel failed
/// Tessera's own verifier first.
pub fn tpu_compile(kernels: &[(String, Kernel)], target: &Target) -> Result<Vec<Verdict>, Error> {
    compile(kernels, target, false)
}

/// [`tpu_compile`] with libtpu's static LLO profile of each kernel (estimated cycles,
/// bundles, spills, VMEM: `tessera cost`, DESIGN.md §9).
pub fn tpu_profile(kernels: &[(String, Kernel)], target: &Target) -> Result<Vec<Verdict>, Error> {
    compile(kernels, target, true)
}

fn compile(kernels: &[(String, Kernel)], target: &Target, profile: bool) -> Result<Vec<Verdict>, Error> {
    let python = tpu_ready()?;
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("tessera-check-{}-{}", std::process::id(), CALLS.fetch_add(1, Ordering::Relaxed)));
    let result = compile_in(&dir, &python, kernels, target, profile);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn compile_in(dir: &Path, python: &Path, kernels: &[(String, Kernel)], target: &Target, profile: bool) -> Result<Vec<Verdict>, Error> {
    let io = |e: std::io::Error| Error::Io(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let script = dir.join("tpu_compile.py");
    std::fs::write(&script, TPU_COMPILE_PY).map_err(io)?;
    let mut stems = HashMap::new();
    let mut files = Vec::new();
    // A dynamic grid dim's trip count is data: libtpu's estimate cannot see it (the roofline
    // takes the IR's model there), and its profiler spends a minute or more on such a kernel
    // (gmm: ~65 s a target, against a 0.3 s compile). Bundles, spills and VMEM only.
    let mut llo_only = Vec::new();
    for (i, (stem, kernel)) in kernels.iter().enumerate() {
        let lowered = tessera_codegen::lower(kernel, target)?;
        let path = dir.join(format!("{i}.{}.stablehlo.mlir", target.name));
        std::fs::write(&path, &lowered.stablehlo).map_err(io)?;
        stems.insert(path.display().to_string(), stem.clone());
        if profile && kernel.grid.iter().any(|g| g.dynamic.is_some()) {
            llo_only.extend([std::ffi::OsString::from("--llo-only"), path.clone().into_os_string()]);
        }
        files.push(path);
    }
    let timeout = timeout_arg()?;
    let mut child = Command::new(python)
        .env("TPU_COMPILE_PYTHON", python)
        .arg(&script)
        .arg("--target")
        .arg(target.name)
        .args(timeout.iter().flat_map(|t| ["--timeout", t.as_str()]))
        .args(&files)
        .args(profile.then_some("--profile"))
        .args(&llo_only)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::Tpu(format!("cannot run {}: {e}", python.display())))?;
    // stderr drained beside stdout (a full pipe would stall the child); stdout read as the
    // verdicts come, so a long run reports progress.
    let mut stderr = child.stderr.take().expect("piped");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let started = std::time::Instant::now();
    let mut reported = started;
    let mut verdicts = Vec::new();
    for line in std::io::BufRead::lines(stdout).map_while(Result::ok).filter(|l| l.starts_with('{')) {
        let Ok(report) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
        let Some(stem) = report.get("file").and_then(|f| f.as_str()).and_then(|f| stems.get(f)) else { continue };
        let error = report.get("error").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        let parsed = tessera_codegen::StaticProfile::from_report(&report);
        verdicts.push(Verdict {
            stem: stem.clone(),
            target: *target,
            ok: report.get("ok").and_then(|v| v.as_bool()) == Some(true),
            timed_out: error.starts_with("timeout after"),
            error,
            seconds: report.get("seconds").and_then(|v| v.as_f64()).unwrap_or_default(),
            profile: parsed,
            // Why the estimate is missing: the profiler's error. A profile asked for without
            // cycles (a dynamic grid: `--llo-only`) has none, and needs no note.
            profile_note: report["profile"]["error"].as_str().unwrap_or(if profile && parsed.is_none() { "libtpu gave no static profile for the custom call" } else { "" }).to_string(),
        });
        // Progress on stderr for long runs (every 10 s), with an ETA from the rate so far.
        if reported.elapsed().as_secs() >= 10 && verdicts.len() < files.len() {
            reported = std::time::Instant::now();
            let (done, elapsed) = (verdicts.len(), started.elapsed().as_secs_f64());
            eprintln!("  [{done}/{}] compiled for {target} by libtpu, {elapsed:.0} s elapsed, ETA {:.0} s", files.len(), elapsed / done as f64 * (files.len() - done) as f64);
        }
    }
    let _ = child.wait();
    let stderr = stderr.join().unwrap_or_default();
    if verdicts.len() != files.len() {
        let why = if stderr.trim().is_empty() { format!("{} printed nothing on stderr (is it a Python with jax and libtpu? TESSERA_PYTHON names it)", python.display()) } else { stderr };
        return Err(Error::Tpu(format!("tpu_compile.py reported {} of {} kernels for {target}: {why}", verdicts.len(), files.len())));
    }
    Ok(verdicts)
}
