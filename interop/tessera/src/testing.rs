//! One-line tests for a kernel crate: snapshots of what a kernel lowers to, numerics
//! against your own reference on every CPU backend over a proptest strategy, and
//! verification (plus libtpu compilation with `TESSERA_TPU_ORACLE=1`) on each target.
//!
//! Each helper takes the kernel as a closure from a [`Target`] (block sizes are usually
//! chosen per generation) and panics with a message naming the kernel, the target or
//! backend and what differs: they are test assertions.
//!
//! ```ignore
//! use tessera::testing::{self, float_dtypes, prop};
//! use tessera::Target;
//!
//! #[test]
//! fn snapshots() {
//!     tessera::assert_snapshots!(|t: &Target| my_kernel_for(&[64, 1024], t), [Target::V5E, Target::V6E]);
//! }
//! ```

use std::fmt::Debug;

use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Kernel, KernelError, Target};

use crate::{allclose, Op, Tolerance};

pub use insta;
pub use proptest;
pub use proptest::prelude::{prop, Just, Strategy};

/// Whether the libtpu tier is on (`TESSERA_TPU_ORACLE=1`, as `scripts/test.sh` sets it).
pub fn oracle_enabled() -> bool {
    std::env::var("TESSERA_TPU_ORACLE").is_ok_and(|v| v == "1")
}

/// f32 or bf16.
pub fn float_dtypes() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::BF16])
}

#[track_caller]
fn built(kernel: &impl Fn(&Target) -> Result<Kernel, KernelError>, target: &Target) -> Kernel {
    match kernel(target) {
        Ok(k) => k,
        Err(e) => panic!("building the kernel for {target}:\n{e}"),
    }
}

/// The texts [`assert_snapshots!`](crate::assert_snapshots) records for each target, named
/// `<kernel>_<target>_{ir,mosaic,stablehlo}`: the block IR, the Mosaic module, and the
/// StableHLO wrapper with its base64 body (the Mosaic module again) elided.
pub fn snapshot_texts(kernel: impl Fn(&Target) -> Result<Kernel, KernelError>, targets: &[Target]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in targets {
        let k = built(&kernel, t);
        let lowered = tessera_codegen::lower(&k, t).unwrap_or_else(|e| panic!("lowering `{}` for {t}:\n{e}", k.name));
        let wrapper = tessera_codegen::stablehlo::redact_body(&lowered.stablehlo).unwrap_or(lowered.stablehlo);
        let stem = format!("{}_{}", k.name, t.name);
        out.push((format!("{stem}_ir"), k.to_string()));
        out.push((format!("{stem}_mosaic"), lowered.mosaic));
        out.push((format!("{stem}_stablehlo"), wrapper));
    }
    out
}

/// Snapshot tests (insta) of a kernel's IR, Mosaic and StableHLO for each target:
/// `tessera::assert_snapshots!(|t: &Target| my_kernel(.., t), [Target::V5E, Target::V6E])`.
/// The snapshots live in `snapshots/` beside the test file; review changes with
/// `cargo insta review` (or `INSTA_UPDATE=always`).
#[macro_export]
macro_rules! assert_snapshots {
    ($kernel:expr, $targets:expr $(,)?) => {
        for (name, text) in $crate::testing::snapshot_texts($kernel, &$targets) {
            $crate::testing::insta::assert_snapshot!(name, text);
        }
    };
}

/// Checks `kernel` on every CPU backend of this build ([`crate::backends`]) against
/// `reference` for cases drawn from `strategy` (shapes, dtypes, parameters: anything
/// `Debug`). `kernel` builds the kernel and its inputs for a case; `reference` computes
/// the expected outputs (one row-major `Vec<f64>` per output) from the same inputs. Each
/// output is compared with [`allclose`] at [`Tolerance::of`] its dtype. A failure is
/// shrunk to a minimal case and reported with the backend and the mismatching elements.
///
/// The number of cases is `PROPTEST_CASES`, default 8 (each new shape is a JIT compile).
#[track_caller]
pub fn assert_numerics<S>(strategy: S, kernel: impl Fn(&S::Value) -> Result<(Kernel, Vec<Array>), KernelError>, reference: impl Fn(&S::Value, &[Array]) -> Vec<Vec<f64>>)
where
    S: Strategy,
    S::Value: Debug,
{
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let name = std::sync::Mutex::new(String::new());
    let result = runner.run(&strategy, |case| {
        let (k, inputs) = kernel(&case).map_err(|e| TestCaseError::fail(format!("building the kernel:\n{e}")))?;
        name.lock().unwrap_or_else(|e| e.into_inner()).clone_from(&k.name);
        let want = reference(&case, &inputs);
        let args: Vec<&Array> = inputs.iter().collect();
        for backend in crate::backends() {
            let got = crate::run(&k, backend, &args).map_err(|e| TestCaseError::fail(format!("on {backend}:\n{e}")))?;
            if got.len() != want.len() {
                return Err(TestCaseError::fail(format!("the kernel has {} outputs, the reference returned {}", got.len(), want.len())));
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                allclose(g, w, Tolerance::of(g.dtype)).map_err(|m| TestCaseError::fail(format!("on {backend}, output {i}: {m}")))?;
            }
        }
        Ok(())
    });
    let name = name.into_inner().unwrap_or_else(|e| e.into_inner());
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, case)) => panic!("kernel `{name}` differs from the reference\n  minimal failing case: {case:?}\n  {why}"),
        Err(TestError::Abort(why)) => panic!("kernel `{name}`: the numerics check stopped: {why}"),
    }
}

/// Verifies the kernel for each target (an error names the kernel, the operand, the rule
/// and, for operands declared in `#[tpu_kernel]`, `--> file:line:col` of the declaration);
/// with `TESSERA_TPU_ORACLE=1` also compiles it with libtpu for each target and fails on a
/// rejection, or when the TPU compiler is not there.
#[track_caller]
pub fn assert_verifies(kernel: impl Fn(&Target) -> Result<Kernel, KernelError>, targets: &[Target]) {
    for t in targets {
        let k = built(&kernel, t);
        if let Err(e) = crate::verify(&k, std::slice::from_ref(t)) {
            panic!("{e}");
        }
        if oracle_enabled() {
            let verdicts = match crate::tpu_compile(&[(k.name.clone(), k)], t) {
                Ok(v) => v,
                Err(e) => panic!("TESSERA_TPU_ORACLE=1: {e}"),
            };
            for v in &verdicts {
                if !v.ok {
                    panic!("libtpu rejected `{}` for {t}:\n{}", v.stem, v.error);
                }
                eprintln!("libtpu accepts `{}` for {t} ({:.2} s)", v.stem, v.seconds);
            }
        } else {
            eprintln!("`{}` verifies for {t} (libtpu not run: set TESSERA_TPU_ORACLE=1)", k.name);
        }
    }
}

/// Checks op `op` (an entry of your table, with its own independent `reference`) with
/// `statics` on every CPU backend of this build, for `(shapes, dtype)` cases drawn from
/// `strategy` (one shape per tensor input; random inputs as `tessera run` draws them),
/// kernels built for `target`: the same check as `tessera run`, shrunk to a minimal case
/// on failure.
#[track_caller]
pub fn assert_op_numerics<S>(op: &Op, statics: &str, target: &Target, strategy: S)
where
    S: Strategy<Value = (Vec<Vec<usize>>, DType)>,
{
    let statics = op.statics(statics).unwrap_or_else(|e| panic!("{e}"));
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&strategy, |(shapes, dtype)| {
        for backend in crate::backends() {
            let r = tessera_kernels::harness::run_case(op, &statics, &shapes, dtype, target, 0, backend.executor()).map_err(|e| TestCaseError::fail(format!("on {backend}:\n{e}")))?;
            if !r.passed() {
                return Err(TestCaseError::fail(format!("on {backend}: {}", crate::cli::verdict(&r))));
            }
        }
        Ok(())
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, case)) => panic!("op `{}` differs from its reference\n  minimal failing case (shapes, dtype): {case:?}\n  {why}", op.name),
        Err(TestError::Abort(why)) => panic!("op `{}`: the numerics check stopped: {why}", op.name),
    }
}
