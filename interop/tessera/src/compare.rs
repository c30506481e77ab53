//! Comparing a kernel's output with a reference, elementwise as numpy's `allclose`, with a
//! report that says where and by how much.

use std::fmt;

use tessera_dsl::interp::Array;
use tessera_dsl::DType;

/// `|got - want| <= atol + rtol * |want|` per element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
}

impl Tolerance {
    /// The default for an output of `dtype`: f32 kernels compute in f32 (about 1e-7 per op,
    /// growing with reduction length); a bf16 output is rounded to 8 bits of mantissa
    /// (relative step 2^-8) after an f32 computation on bf16 inputs; an fp8 output to 3
    /// (e4m3fn: half-step 2^-4) or 2 (e5m2: 2^-3) mantissa bits; integers exactly.
    pub fn of(dtype: DType) -> Tolerance {
        match dtype {
            DType::F32 => Tolerance { rtol: 1e-5, atol: 1e-5 },
            DType::F8E4M3FN => Tolerance { rtol: 6.25e-2, atol: 1.0 / 512.0 },
            DType::F8E5M2 => Tolerance { rtol: 1.25e-1, atol: 1.0 / 65536.0 },
            d if d.is_float() => Tolerance { rtol: 1.6e-2, atol: 1.6e-2 },
            _ => Tolerance { rtol: 0.0, atol: 0.0 },
        }
    }
}

/// One element of a mismatch report.
#[derive(Clone, Debug, PartialEq)]
pub struct Element {
    /// Its index in the array's shape.
    pub index: Vec<usize>,
    pub got: f64,
    pub want: f64,
}

/// Where an output and its reference differ.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub tolerance: Tolerance,
    /// Elements outside the tolerance (NaN where the reference is not counts, as does an
    /// infinity that differs).
    pub count: usize,
    pub total: usize,
    /// The reference's length when it is not the output's (then nothing else is compared).
    pub want_len: Option<usize>,
    /// The first few mismatches in row-major order.
    pub first: Vec<Element>,
    /// The largest `|got - want|` among the finite mismatches.
    pub worst: Option<Element>,
}

const SHOWN: usize = 5;

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(n) = self.want_len {
            return write!(f, "the output {} {:?} has {} elements, the reference {n}: compute the reference for the output's shape", self.dtype, self.shape, self.total);
        }
        let Tolerance { rtol, atol } = self.tolerance;
        write!(f, "{} of {} elements of the {} {:?} output differ from the reference (|got - want| > {atol:e} + {rtol:e} * |want|)", self.count, self.total, self.dtype, self.shape)?;
        let line = |f: &mut fmt::Formatter<'_>, what: &str, e: &Element| {
            let note = if e.got.is_nan() && !e.want.is_nan() { "  (NaN: a block never written, or read before written?)" } else { "" };
            write!(f, "\n  {what} {:?}: got {}, want {}, diff {:.3e}{note}", e.index, e.got, e.want, (e.got - e.want).abs())
        };
        for e in &self.first {
            line(f, "at", e)?;
        }
        if self.count > self.first.len() {
            write!(f, "\n  ... {} more", self.count - self.first.len())?;
        }
        if let Some(w) = &self.worst {
            line(f, "worst at", w)?;
        }
        Ok(())
    }
}

impl std::error::Error for Mismatch {}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            index[i] = flat % d;
            flat /= d;
        }
    }
    index
}

/// Compares `got` with `want` (row-major, one value per element) elementwise: within
/// `tol`, NaN where the reference is NaN, the same infinity where it is infinite.
pub fn allclose(got: &Array, want: &[f64], tol: Tolerance) -> Result<(), Mismatch> {
    let values = got.to_f64_vec();
    let mut m = Mismatch { shape: got.shape.clone(), dtype: got.dtype, tolerance: tol, count: 0, total: values.len(), want_len: None, first: Vec::new(), worst: None };
    if values.len() != want.len() {
        m.want_len = Some(want.len());
        return Err(m);
    }
    for (i, (&g, &w)) in values.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() || g.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol.atol + tol.rtol * w.abs()
        };
        if ok {
            continue;
        }
        m.count += 1;
        let e = || Element { index: unravel(i, &got.shape), got: g, want: w };
        if m.first.len() < SHOWN {
            m.first.push(e());
        }
        let diff = (g - w).abs();
        if diff.is_finite() && m.worst.as_ref().is_none_or(|x| diff > (x.got - x.want).abs()) {
            m.worst = Some(e());
        }
    }
    if m.count == 0 {
        Ok(())
    } else {
        Err(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_index_got_want() {
        let got = Array::from_f32(&[2, 3], vec![0.0, 1.0, 2.0, 3.0, f32::NAN, 5.5]);
        let want = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let m = allclose(&got, &want, Tolerance::of(DType::F32)).unwrap_err();
        assert_eq!(m.count, 2);
        assert_eq!(m.first[0].index, vec![1, 1]);
        assert_eq!(m.worst.as_ref().unwrap().index, vec![1, 2]);
        let text = m.to_string();
        assert!(text.starts_with("2 of 6 elements of the f32 [2, 3] output differ"), "{text}");
        assert!(text.contains("at [1, 1]: got NaN, want 4, diff NaN  (NaN: a block never written"), "{text}");
        assert!(text.contains("worst at [1, 2]: got 5.5, want 5, diff 5.000e-1"), "{text}");
        assert!(allclose(&got, &want[..5], Tolerance::of(DType::F32)).unwrap_err().to_string().contains("has 6 elements, the reference 5"));
        assert!(allclose(&Array::from_f32(&[1], vec![1.0]), &[1.0 + 1e-6], Tolerance::of(DType::F32)).is_ok());
    }
}
