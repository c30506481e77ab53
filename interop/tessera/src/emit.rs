//! Verifying kernels for targets and writing their StableHLO and Mosaic modules.

use std::path::{Path, PathBuf};
use std::time::Instant;

use tessera_codegen::Lowered;
use tessera_dsl::{Kernel, KernelError, Target, Warning};

use crate::Error;

/// Verifies `kernel` for each of `targets`; returns the performance warnings of each (the
/// kernel compiles but leaves speed on the table), or the first error, its message naming
/// the target that refused it.
pub fn verify(kernel: &Kernel, targets: &[Target]) -> Result<Vec<(Target, Vec<Warning>)>, KernelError> {
    targets
        .iter()
        .map(|t| match tessera_dsl::verify::check(kernel, t) {
            Ok(w) => Ok((*t, w)),
            // Most verifier messages name the generation already ("f32 tiling on v5e").
            Err(e) if e.message.contains(t.name) => Err(e),
            Err(e) => Err(KernelError { message: format!("on {t}: {}", e.message), ..e }),
        })
        .collect()
}

/// One kernel written by [`emit`].
#[derive(Clone, Debug)]
pub struct Emitted {
    /// The file stem: `<stem>.stablehlo.mlir` and `<stem>.mosaic.mlir`.
    pub stem: String,
    pub kernel: Kernel,
    pub lowered: Lowered,
    /// Time to verify and lower it.
    pub lower_ms: f64,
    pub stablehlo: PathBuf,
    pub mosaic: PathBuf,
}

/// Verifies and lowers every `(stem, kernel)` for `target`, then writes
/// `<dir>/<stem>.stablehlo.mlir` (the module with the `tpu_custom_call` libtpu and TorchTPU
/// compile) and `<dir>/<stem>.mosaic.mlir` (its Mosaic body). Everything is lowered before
/// anything is written: a rejected kernel leaves no partial output.
pub fn emit(kernels: Vec<(String, Kernel)>, target: &Target, dir: &Path) -> Result<Vec<Emitted>, Error> {
    let mut out = Vec::new();
    for (stem, kernel) in kernels {
        let start = Instant::now();
        let lowered = tessera_codegen::lower(&kernel, target)?;
        let lower_ms = start.elapsed().as_secs_f64() * 1e3;
        let (stablehlo, mosaic) = (dir.join(format!("{stem}.stablehlo.mlir")), dir.join(format!("{stem}.mosaic.mlir")));
        out.push(Emitted { stem, kernel, lowered, lower_ms, stablehlo, mosaic });
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("cannot create {}: {e}", dir.display())))?;
    for e in &out {
        for (path, text) in [(&e.stablehlo, &e.lowered.stablehlo), (&e.mosaic, &e.lowered.mosaic)] {
            std::fs::write(path, text).map_err(|err| Error::Io(format!("cannot write {}: {err}", path.display())))?;
        }
    }
    Ok(out)
}

/// [`emit`] of one kernel, under its own name, into `<dir>/<target>/` (the modules differ by
/// target, so emitting for several targets into one `dir` keeps each).
pub fn emit_kernel(kernel: &Kernel, target: &Target, dir: &Path) -> Result<Emitted, Error> {
    let mut v = emit(vec![(kernel.name.clone(), kernel.clone())], target, &dir.join(target.name))?;
    Ok(v.remove(0))
}
