//! NaN / inf propagation checks (issue 9): run a library op on inputs holding nonfinite
//! values and compare with its independent f64 reference element by element: NaN exactly
//! where the reference is NaN, the same infinity where it is infinite, elsewhere finite and
//! within a max-norm relative tolerance.

use tessera_dsl::interp::Array;
use tessera_dsl::{Interpreter, Target};
use tessera_kernels::find;

/// The op's outputs and its reference's on `inputs` (schema order, `None` for absent).
pub fn run_and_reference(op: &str, inputs: &[Option<&Array>], statics: &str, target: &Target) -> (Vec<Array>, Vec<Vec<f64>>) {
    let entry = find(op).unwrap_or_else(|| panic!("no op {op}"));
    let statics = entry.statics(statics).unwrap_or_else(|e| panic!("{op}: {e}"));
    let got = entry.run(&Interpreter, inputs, &statics, target).unwrap_or_else(|e| panic!("{op}: {e}"));
    let source = entry.alias_of.map_or(entry, |(name, _)| find(name).expect("aliased op"));
    let given: Vec<Array> = inputs.iter().flatten().map(|a| (*a).clone()).collect();
    let mut want = (source.reference.expect("a reference"))(&given, &statics);
    if let Some((_, i)) = entry.alias_of {
        want = want.into_iter().skip(i).take(1).collect();
    }
    (got, want)
}

/// `Err` naming the first element where `got` and `want` disagree on NaN / inf, or the
/// worst relative error if it exceeds `tol`.
pub fn compare(got: &Array, want: &[f64], tol: f64) -> Result<(), String> {
    let g = got.to_f64_vec();
    if g.len() != want.len() {
        return Err(format!("{} elements, the reference has {}", g.len(), want.len()));
    }
    if !got.dtype.is_float() {
        return match g.iter().zip(want).position(|(a, w)| a != w) {
            Some(i) => Err(format!("integer element {i} is {}, the reference is {}", g[i], want[i])),
            None => Ok(()),
        };
    }
    let scale = want.iter().filter(|w| w.is_finite()).fold(0.0f64, |m, w| m.max(w.abs())).max(1e-6);
    let mut worst = 0.0f64;
    for (i, (&a, &w)) in g.iter().zip(want).enumerate() {
        if w.is_nan() != a.is_nan() {
            return Err(format!("element {i} is {a}, the reference is {w}"));
        }
        if w.is_infinite() && a != w {
            return Err(format!("element {i} is {a}, the reference is {w}"));
        }
        if w.is_finite() {
            if !a.is_finite() {
                return Err(format!("element {i} is {a}, the reference is {w}"));
            }
            worst = worst.max((a - w).abs() / scale);
        }
    }
    if worst > tol {
        return Err(format!("max-norm relative error {worst:.3e} > {tol:.1e}"));
    }
    Ok(())
}

/// Runs `op` and asserts every output matches the reference ([`compare`]); returns the
/// outputs and the reference's for further checks.
pub fn assert_matches(what: &str, op: &str, inputs: &[Option<&Array>], statics: &str, target: &Target, tol: f64) -> (Vec<Array>, Vec<Vec<f64>>) {
    let (got, want) = run_and_reference(op, inputs, statics, target);
    assert_eq!(got.len(), want.len(), "{what}: {op} outputs");
    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
        if let Err(why) = compare(g, w, tol) {
            panic!("{what}: {op} output {j} ({}{:?}) on {target}: {why}", g.dtype, g.shape);
        }
    }
    (got, want)
}

/// Indices of the NaN elements of `x`.
pub fn nan_at(x: &[f64]) -> Vec<usize> {
    x.iter().enumerate().filter(|(_, v)| v.is_nan()).map(|(i, _)| i).collect()
}
