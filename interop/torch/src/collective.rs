//! The collective ops on the CPU (`tessera.distributed`: `torch.ops.tpu.all_gather`,
//! `reduce_scatter`, `all_gather_matmul`, `ragged_all_to_all`): the library's ring kernels
//! ([`tessera_kernels::collective`]) on the interpreter's N-device simulation.
//!
//! A process (one gloo rank) passes the operands of every device of the group, gathered on
//! the Python side with one `torch.distributed` all-gather, and keeps its own device's
//! results. The kernel's remote DMAs, semaphores and waits run as written, device by
//! device, so a kernel bug is an error naming the device and step (`device-deadlock`,
//! `remote-buffer-race`, ...), never a wrong tensor. It is a correctness path: every rank
//! simulates the whole group (the work of all N devices on each), and the wire carries each
//! operand once to every rank rather than the ring's neighbour-to-neighbour traffic.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{Kernel, KernelError};
use tessera_kernels::collective::{self, Broken};

use crate::tensor::TensorRef;
use crate::{host_tensor, py_err, target_named};

/// Device `d`'s operands as arrays (contiguous copies of the tensors).
fn arrays(op: &str, operands: &Bound<'_, PyList>, device: usize) -> PyResult<Vec<Array>> {
    operands
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let refused = |r: crate::tensor::Refused| py_err(KernelError::new(op, format!("device {device}: tensor {i}"), r.rule, r.message, r.help));
            let r = TensorRef::describe(&t, None).map_err(refused)?.borrow().map_err(refused)?;
            Ok(tessera_kernels::plan::to_array(r.host()))
        })
        .collect()
}

fn dims<const N: usize>(op: &str, what: &str, a: &Array) -> PyResult<[usize; N]> {
    <[usize; N]>::try_from(a.shape.as_slice()).map_err(|_| PyValueError::new_err(format!("tessera {op}: {what} must have {N} dims, got shape {:?}", a.shape)))
}

/// The kernel of collective `name` over `nd` devices for device 0's operands.
fn kernel_for(name: &str, nd: usize, first: &[Array], out_rows: Option<usize>) -> PyResult<Kernel> {
    let built = match (name, first) {
        ("all_gather", [x]) => {
            let [m, k] = dims(name, "x", x)?;
            collective::ring_all_gather(nd, m, k, x.dtype, Broken::No)
        }
        ("reduce_scatter", [x]) => {
            let [n, m, k] = dims(name, "x", x)?;
            if n != nd {
                return Err(PyValueError::new_err(format!("tessera reduce_scatter: x has {n} chunks for a group of {nd}")));
            }
            collective::ring_reduce_scatter(nd, m, k, x.dtype, Broken::No)
        }
        ("all_gather_matmul", [x, w]) => {
            let [m, k] = dims(name, "x", x)?;
            let [kw, n] = dims(name, "w", w)?;
            if kw != k || w.dtype != x.dtype {
                return Err(PyValueError::new_err(format!("tessera all_gather_matmul: x {:?} {} and w {:?} {} do not multiply", x.shape, x.dtype, w.shape, w.dtype)));
            }
            collective::all_gather_matmul(nd, m, k, n, x.dtype, Broken::No)
        }
        ("ragged_all_to_all", [_, _, _, _, x]) => {
            let [t, h] = dims(name, "x", x)?;
            let tout = out_rows.ok_or_else(|| PyValueError::new_err("tessera ragged_all_to_all: out_rows is required"))?;
            collective::ragged_all_to_all(nd, t, tout, h, x.dtype)
        }
        _ => return Err(PyValueError::new_err(format!("tessera: no collective {name:?} taking {} operand(s)", first.len()))),
    };
    built.map_err(py_err)
}

/// Runs collective `name` for a group of `len(operands)` devices and returns device `me`'s
/// results as fresh CPU tensors. `operands[d]`: device `d`'s tensors (ragged_all_to_all:
/// `input_offsets, send_sizes, output_offsets, recv_sizes` (int32 `[nd]`), then `x`), all
/// devices' of the same shapes and dtypes; `out_rows`: ragged_all_to_all's output rows. The
/// kernel is verified for `target` first (what runs here also fits that TPU generation).
#[pyfunction]
#[pyo3(signature = (name, operands, me, target, out_rows=None))]
pub fn run_collective<'py>(py: Python<'py>, name: &str, operands: Vec<Bound<'py, PyList>>, me: usize, target: &str, out_rows: Option<usize>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let nd = operands.len();
    if me >= nd {
        return Err(PyValueError::new_err(format!("tessera {name}: device {me} of a group of {nd}; pass one operand list per device and a device below {nd}")));
    }
    let per_device: Vec<Vec<Array>> = operands.iter().enumerate().map(|(d, o)| arrays(name, o, d)).collect::<PyResult<_>>()?;
    for (d, ops) in per_device.iter().enumerate().skip(1) {
        let differ = ops.len() != per_device[0].len() || ops.iter().zip(&per_device[0]).any(|(a, b)| a.shape != b.shape || a.dtype != b.dtype);
        if differ {
            let show = |v: &[Array]| v.iter().map(|a| format!("{}{:?}", a.dtype, a.shape)).collect::<Vec<_>>().join(", ");
            return Err(PyValueError::new_err(format!(
                "tessera {name}: device {d}'s operands ({}) differ from device 0's ({}); every device of the group runs the same kernel, so pass the same shapes and dtypes on every rank",
                show(ops),
                show(&per_device[0])
            )));
        }
    }
    let kernel = kernel_for(name, nd, &per_device[0], out_rows)?;
    tessera_dsl::verify::verify(&kernel, &target_named(target)?).map_err(py_err)?;
    let args: Vec<Vec<&Array>> = per_device.iter().map(|v| v.iter().collect()).collect();
    let mut outs = interp::run_devices(&kernel, &args).map_err(py_err)?;
    let cpu = py.import("torch")?.getattr("device")?.call1(("cpu",))?;
    std::mem::take(&mut outs[me]).iter().map(|a| host_tensor(py, a, &cpu)).collect()
}
