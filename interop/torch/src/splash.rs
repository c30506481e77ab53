//! Splash attention's host side: the block metadata of a mask ([`MaskInfo::build`]), built
//! once per mask by `tessera.splash.make_mask`, and the default blocks it is built at.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tessera_dsl::interp::Array;
use tessera_dsl::DType;
use tessera_kernels::splash::{self, MaskInfo};

use crate::{current_target, py_err};

/// An array's little-endian bytes and shape.
fn bytes_of<'py>(py: Python<'py>, a: &Array) -> (Bound<'py, PyBytes>, Vec<usize>) {
    let raw: Vec<u8> = match (a.as_i8(), a.as_i32()) {
        (Some(x), _) => x.iter().map(|&b| b as u8).collect(),
        (_, Some(x)) => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => Vec::new(),
    };
    (PyBytes::new(py, &raw), a.shape.clone())
}

/// `(mask_blocks, fwd_info, bwd_info)` as `(bytes, shape)` of the dense mask `bits` (one byte
/// per pair, nonzero = visible, `[heads, sq, skv]` row-major) at blocks `bq x bk`.
#[pyfunction]
pub fn splash_mask_info<'py>(py: Python<'py>, bits: &[u8], heads: usize, sq: usize, skv: usize, bq: usize, bk: usize) -> PyResult<Vec<(Bound<'py, PyBytes>, Vec<usize>)>> {
    let want = heads.checked_mul(sq).and_then(|n| n.checked_mul(skv));
    if want != Some(bits.len()) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "tessera splash_attention: the mask has {} elements, [heads={heads}, q_len={sq}, kv_len={skv}] needs {want:?}",
            bits.len()
        )));
    }
    let info = py.detach(|| MaskInfo::build(heads, sq, skv, bq, bk, |h, r, c| bits[(h * sq + r) * skv + c] != 0)).map_err(py_err)?;
    Ok([&info.mask_blocks, &info.fwd_info, &info.bwd_info].into_iter().map(|a| bytes_of(py, a)).collect())
}

/// The default `(block_q, block_kv)` of a mask over `sq` x `skv` for head dim `d` and
/// `dtype` (`"float32"` / `"bfloat16"`) on the current target.
#[pyfunction]
pub fn splash_default_blocks(sq: usize, skv: usize, d: usize, dtype: &str) -> (usize, usize) {
    let dtype = if dtype == "float32" { DType::F32 } else { DType::BF16 };
    splash::default_blocks(sq.max(1), skv.max(1), d.max(1), dtype, &current_target())
}
