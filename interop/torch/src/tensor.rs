//! Tensors across the FFI boundary: a torch tensor becomes a [`TensorRef`], whose memory
//! the kernels read in place, only after every fact that reading relies on is checked:
//!
//! - it is a dense (`torch.strided`) tensor, with no lazy negation or conjugation bit;
//! - its memory is host memory: a CPU tensor, or (for the emulated `tpu` device, when the
//!   caller says so) a tensor of the one device whose allocator is host memory; a `meta`,
//!   `cuda` or real `tpu` tensor is refused, never read;
//! - its dtype is one the kernels take; int64 index tensors are narrowed to int32 with a
//!   range check (a value outside int32 is an error, not a wrap), and bool tensors are
//!   copied byte by byte so that a byte other than 0 or 1 is an error, not an invalid
//!   `bool`;
//! - it is contiguous (else read through a contiguous copy), its element count is its
//!   shape's product (checked, no overflow), and its data pointer is non-null and aligned
//!   for the element type (else read through an aligned copy).
//!
//! Outputs are fresh tensors allocated here ([`TensorRef::empty`]), or, for the emulator
//! path, tensors the caller passes: those are checked not to overlap any input or each
//! other before they are written ([`check_disjoint`]).

use half::bf16;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;
use tessera_dsl::interp::{Array, HostData, HostDataMut, HostMut, HostRef};
use tessera_dsl::{DType, Type};

/// Why a tensor cannot cross: the message (the caller names the op and operand).
#[derive(Debug)]
pub struct Refused {
    pub rule: &'static str,
    pub message: String,
    pub help: String,
}

fn refused(rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> Refused {
    Refused { rule, message: message.into(), help: help.into() }
}

/// The torch dtypes the kernels take, in [`DType`] order of `TORCH_DTYPES`.
pub const TORCH_DTYPES: [(&str, DType); 7] = [
    ("float32", DType::F32),
    ("bfloat16", DType::BF16),
    ("int32", DType::I32),
    ("int8", DType::I8),
    ("bool", DType::Bool),
    ("float8_e4m3fn", DType::F8E4M3FN),
    ("float8_e5m2", DType::F8E5M2),
];

/// `torch.float32` ... `torch.bool`, then `torch.int64` and `torch.strided`, looked up once
/// and compared by identity.
fn torch_objects(py: Python<'_>) -> PyResult<&'static [Py<PyAny>]> {
    static CELL: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();
    CELL.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        TORCH_DTYPES.iter().map(|(name, _)| *name).chain(["int64", "strided"]).map(|name| Ok(torch.getattr(name)?.unbind())).collect()
    })
    .map(Vec::as_slice)
}

const INT64: usize = TORCH_DTYPES.len();
const STRIDED: usize = TORCH_DTYPES.len() + 1;

fn torch_empty(py: Python<'_>) -> PyResult<&'static Py<PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    CELL.get_or_try_init(py, || Ok(py.import("torch")?.getattr("empty")?.unbind()))
}

/// The torch dtype object of `dtype`.
pub fn torch_dtype_of(py: Python<'_>, dtype: DType) -> PyResult<Bound<'_, PyAny>> {
    let i = TORCH_DTYPES.iter().position(|(_, d)| *d == dtype).unwrap_or(0);
    Ok(torch_objects(py)?[i].bind(py).clone())
}

/// Where a tensor's elements are.
enum Mem {
    /// In the tensor (or the owner's copy): contiguous, aligned, `ty.num_elements()` long.
    Ptr(usize),
    /// Narrowed from int64.
    I32(Vec<i32>),
    /// Copied from bytes checked to be 0 or 1.
    Bool(Vec<bool>),
    /// A row-major copy (of a strided view, narrowed or checked), made natively.
    Copy(Array),
}

/// What keeps a [`TensorRef`]'s memory alive: the Python tensor (or its copy), or the
/// libtorch handle a natively dispatched kernel owns (`dispatch.rs`).
enum Owner<'py> {
    Py(#[allow(dead_code)] Bound<'py, PyAny>),
    Aten(crate::dispatch::AtenTensor),
}

/// A tensor as the native side sees it (see the module docs for what is checked).
pub struct TensorRef<'py> {
    pub ty: Type,
    mem: Mem,
    /// Keeps the tensor, or the contiguous / aligned copy `mem` points into, alive.
    owner: Owner<'py>,
}

impl<'py> TensorRef<'py> {
    /// Checks what `t` is, from its metadata only (layout, device, dtype, shape): nothing is
    /// copied, so a caller can plan and verify a call (and refuse a 4 TiB stride-0 view by
    /// the target's HBM) before any contiguous copy is made. `host_device`: besides `cpu`,
    /// the one device type whose tensors are host memory for this call (the emulated `tpu`).
    pub fn describe(t: &Bound<'py, PyAny>, host_device: Option<&str>) -> Result<Described<'py>, Refused> {
        let py = t.py();
        let objects = torch_objects(py).map_err(|e| refused("torch", e.to_string(), "import torch first"))?;
        let attr = |t: &Bound<'py, PyAny>, name: &str| t.getattr(name).map_err(|_| refused("operand-type", format!("a {} is not a tensor", type_name(t)), "pass a torch.Tensor"));
        let layout = attr(t, "layout")?;
        if !layout.is(objects[STRIDED].bind(py)) {
            return Err(refused("operand-layout", format!("a {} tensor", layout.str().map(|s| s.to_string()).unwrap_or_default()), "pass a dense (strided) tensor, e.g. x.to_dense()"));
        }
        let is_cpu = attr(t, "is_cpu")?.is_truthy().unwrap_or(false);
        if !is_cpu {
            let device: String = attr(&attr(t, "device")?, "type")?.extract().unwrap_or_default();
            if host_device != Some(device.as_str()) {
                let help = if device == "meta" { "meta tensors have no data: run the op on real tensors (fake/meta kernels give shapes only)".to_string() } else { "move the tensor to the CPU (`.cpu()`), or call the op with all tensors on one tpu device".to_string() };
                return Err(refused("operand-device", format!("a tensor on device `{device}`, whose memory the CPU kernels cannot read"), help));
            }
        }
        let t = t.clone();
        let dtype_obj = attr(&t, "dtype")?;
        let int64 = dtype_obj.is(objects[INT64].bind(py));
        let dtype = match objects[..TORCH_DTYPES.len()].iter().position(|d| d.bind(py).is(&dtype_obj)) {
            Some(i) => TORCH_DTYPES[i].1,
            None if int64 => DType::I32,
            None => {
                let name = dtype_obj.str().map(|s| s.to_string()).unwrap_or_default();
                return Err(refused("operand-dtype", format!("tensors of {} are not supported", name.trim_start_matches("torch.")), "pass float32, bfloat16, int32, int8 or bool tensors (index tensors may be int64)"));
            }
        };
        let shape: Vec<usize> = attr(&t, "shape")?.extract().map_err(|e: PyErr| refused("operand-shape", e.to_string(), "pass a tensor with a concrete shape"))?;
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| refused("shape-overflow", format!("shape {shape:?} has more elements than fit in memory"), "pass a smaller tensor"))?;
        Ok(Described { tensor: t, ty: Type::vector(dtype, &shape), int64, n })
    }
}

/// A tensor whose metadata [`TensorRef::describe`] checked, not yet borrowed.
pub struct Described<'py> {
    tensor: Bound<'py, PyAny>,
    pub ty: Type,
    int64: bool,
    n: usize,
}

impl<'py> Described<'py> {
    /// Borrows the tensor's memory: through a contiguous (and aligned) copy when needed,
    /// int64 narrowed and bool bytes checked (see the module docs).
    pub fn borrow(self) -> Result<TensorRef<'py>, Refused> {
        let Described { tensor: mut t, ty, int64, n } = self;
        let dtype = ty.dtype;
        let call = |t: &Bound<'py, PyAny>, m: &str| t.call_method0(m).map_err(|e| refused("operand-memory", e.to_string(), "pass a tensor with storage (not a fake or functional tensor)"));
        // A lazily negated / conjugated view's memory does not hold its values.
        if call(&t, "is_neg")?.is_truthy().unwrap_or(false) {
            t = t.call_method0("resolve_neg").map_err(|e| refused("operand-layout", e.to_string(), "pass a plain tensor"))?;
        }
        if !call(&t, "is_contiguous")?.is_truthy().unwrap_or(false) {
            let bytes = n as f64 * if int64 { 8.0 } else { dtype.bytes() as f64 };
            t = t.call_method0("contiguous").map_err(|_| {
                refused("host-memory", format!("the kernels read a contiguous copy of this non-contiguous tensor, {:.2} GiB, which could not be allocated", bytes / (1u64 << 30) as f64), "pass a contiguous tensor, or a smaller one")
            })?;
        }
        let elem = if int64 { 8 } else { dtype.bytes() };
        let mut ptr: usize = call(&t, "data_ptr")?.extract().unwrap_or(0);
        if n > 0 && (ptr == 0 || !ptr.is_multiple_of(elem)) {
            // Null means no storage; a misaligned pointer (`frombuffer` at an odd offset)
            // cannot be read as a slice of the element type: read an aligned copy.
            t = call(&t, "clone")?;
            ptr = call(&t, "data_ptr")?.extract().unwrap_or(0);
            if ptr == 0 || !ptr.is_multiple_of(elem) {
                return Err(refused("operand-memory", "the tensor's data pointer is null or misaligned", "pass a tensor with storage"));
            }
        }
        let mem = if int64 {
            // SAFETY: `t` is a contiguous, strided CPU/host tensor of int64 with `n`
            // elements at `ptr`, non-null and 8-aligned (checked above), alive while `t` is.
            let wide: &[i64] = unsafe { slice_of(ptr, n) };
            let mut narrow = Vec::with_capacity(n);
            for (i, &v) in wide.iter().enumerate() {
                narrow.push(i32::try_from(v).map_err(|_| refused("index-range", format!("element {i} is {v}, outside the int32 range the kernels index with"), "pass index values in [-2^31, 2^31)"))?);
            }
            Mem::I32(narrow)
        } else if dtype == DType::Bool {
            // SAFETY: as above, `n` bytes at `ptr` (bool tensors are one byte per element),
            // read as `u8` (any byte is a valid u8) before checking they are 0 or 1.
            let bytes: &[u8] = unsafe { slice_of(ptr, n) };
            let bools = bytes.iter().map(|&b| (b <= 1).then_some(b == 1)).collect::<Option<Vec<bool>>>();
            Mem::Bool(bools.ok_or_else(|| refused("operand-memory", "a bool tensor holds bytes other than 0 and 1", "build masks with comparisons, not by viewing other dtypes as bool"))?)
        } else {
            Mem::Ptr(ptr)
        };
        Ok(TensorRef { ty, mem, owner: Owner::Py(t) })
    }
}

impl TensorRef<'static> {
    /// A natively dispatched kernel's tensor whose own memory the kernels use: `ptr` holds
    /// `ty.num_elements()` contiguous, aligned elements of `ty.dtype` (never bool), alive
    /// while `handle` is (checked by `dispatch::describe`, or a fresh `empty_strided`).
    pub fn native(ty: Type, ptr: usize, handle: crate::dispatch::AtenTensor) -> TensorRef<'static> {
        TensorRef { ty, mem: Mem::Ptr(ptr), owner: Owner::Aten(handle) }
    }

    /// A natively dispatched kernel's tensor read through a copy.
    pub fn native_copy(ty: Type, copy: Array, handle: crate::dispatch::AtenTensor) -> TensorRef<'static> {
        TensorRef { ty, mem: Mem::Copy(copy), owner: Owner::Aten(handle) }
    }

    /// The libtorch handle of a native result (to hand to the dispatcher).
    pub fn into_aten(self) -> Option<crate::dispatch::AtenTensor> {
        match self.owner {
            Owner::Aten(h) => Some(h),
            Owner::Py(_) => None,
        }
    }
}

impl<'py> TensorRef<'py> {
    /// The tensor's elements, borrowed.
    pub fn host(&self) -> HostRef<'_> {
        let n = self.ty.num_elements();
        let data = match &self.mem {
            Mem::I32(v) => HostData::I32(v),
            Mem::Bool(v) => HostData::Bool(v),
            Mem::Copy(a) => return a.as_host(),
            // SAFETY: `borrow` (or `dispatch::describe`) checked the facts `slice_of` relies on (contiguous,
            // aligned, non-null host memory of `n` elements of `ty.dtype`; bool and int64
            // never take this path), and `owner` keeps the memory alive for `'_`.
            Mem::Ptr(p) => unsafe {
                match self.ty.dtype {
                    DType::F32 => HostData::F32(slice_of(*p, n)),
                    DType::BF16 => HostData::BF16(slice_of::<bf16>(*p, n)),
                    DType::I32 => HostData::I32(slice_of(*p, n)),
                    DType::I8 => HostData::I8(slice_of(*p, n)),
                    // One byte per element, and every byte is a valid fp8 code.
                    DType::F8E4M3FN => HostData::F8E4M3FN(slice_of(*p, n)),
                    DType::F8E5M2 => HostData::F8E5M2(slice_of(*p, n)),
                    DType::Bool => HostData::Bool(&[]),
                }
            },
        };
        HostRef { shape: &self.ty.shape, data }
    }

    /// The tensor's elements, mutably borrowed; `None` unless they are the tensor's own
    /// memory (outputs are never narrowed or copied). Only for outputs the call owns (see
    /// [`check_disjoint`]).
    pub fn host_mut(&mut self) -> Option<HostMut<'_>> {
        let n = self.ty.num_elements();
        let Mem::Ptr(p) = self.mem else { return None };
        // SAFETY: as in `host`, plus: outputs are fresh tensors allocated by
        // `TensorRef::empty`, or caller tensors checked by `check_disjoint` to share no
        // byte with any other operand of the call, so this is the only reference.
        let data = unsafe {
            match self.ty.dtype {
                DType::F32 => HostDataMut::F32(slice_of_mut(p, n)),
                DType::BF16 => HostDataMut::BF16(slice_of_mut::<bf16>(p, n)),
                DType::I32 => HostDataMut::I32(slice_of_mut(p, n)),
                DType::I8 => HostDataMut::I8(slice_of_mut(p, n)),
                DType::F8E4M3FN => HostDataMut::F8E4M3FN(slice_of_mut(p, n)),
                DType::F8E5M2 => HostDataMut::F8E5M2(slice_of_mut(p, n)),
                DType::Bool => return None,
            }
        };
        Some(HostMut { shape: &self.ty.shape, data })
    }

    /// The byte range the tensor's elements occupy (empty for copies).
    fn bytes(&self) -> std::ops::Range<usize> {
        match self.mem {
            Mem::Ptr(p) => p..p + self.ty.num_elements() * self.ty.dtype.bytes(),
            _ => 0..0,
        }
    }

    /// A fresh, contiguous tensor of `ty` on `device`, with its `TensorRef`.
    pub fn empty(py: Python<'py>, ty: &Type, device: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, TensorRef<'py>)> {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("dtype", torch_dtype_of(py, ty.dtype)?)?;
        kwargs.set_item("device", device)?;
        let t = torch_empty(py)?.bind(py).call((PyTuple::new(py, &ty.shape)?,), Some(&kwargs))?;
        let ptr: usize = t.call_method0("data_ptr")?.extract()?;
        let mem = if ty.dtype == DType::Bool { Mem::Bool(vec![false; ty.num_elements()]) } else { Mem::Ptr(ptr) };
        if ty.num_elements() > 0 && (ptr == 0 || !ptr.is_multiple_of(ty.dtype.bytes())) {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("tessera: torch.empty gave a null or misaligned buffer"));
        }
        Ok((t.clone(), TensorRef { ty: ty.clone(), mem, owner: Owner::Py(t) }))
    }
}

/// Refuses outputs that share memory with an input or another output (writing them
/// would alias a Rust `&mut` with another reference).
pub fn check_disjoint(inputs: &[Option<TensorRef<'_>>], outputs: &[Option<TensorRef<'_>>]) -> Result<(), Refused> {
    let outs: Vec<_> = outputs.iter().flatten().map(TensorRef::bytes).filter(|r| !r.is_empty()).collect();
    for (i, o) in outs.iter().enumerate() {
        let overlaps = |r: &std::ops::Range<usize>| r.start < o.end && o.start < r.end;
        if inputs.iter().flatten().map(TensorRef::bytes).any(|r| overlaps(&r)) || outs[..i].iter().any(overlaps) {
            return Err(refused("output-aliasing", "an output tensor shares memory with another operand", "pass fresh output tensors"));
        }
    }
    for o in outputs.iter().flatten() {
        if !matches!(o.mem, Mem::Ptr(_)) {
            return Err(refused("output-dtype", format!("an output of {} cannot be written in place", o.ty.dtype), "outputs are float32, bfloat16, int32 or int8 tensors"));
        }
    }
    Ok(())
}

fn type_name(t: &Bound<'_, PyAny>) -> String {
    t.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "value".into())
}

/// `n` elements of `T` at `ptr`.
///
/// # Safety
/// `ptr` addresses `n` contiguous, initialised, valid values of `T` (aligned, non-null when
/// `n > 0`) that stay alive and unmutated for `'a`. A zero-size tensor may have a null
/// pointer, so it is never turned into a slice.
unsafe fn slice_of<'a, T>(ptr: usize, n: usize) -> &'a [T] {
    if n == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr as *const T, n) }
    }
}

/// [`slice_of`], mutable.
///
/// # Safety
/// As [`slice_of`], and no other reference to the memory exists for `'a`.
unsafe fn slice_of_mut<'a, T>(ptr: usize, n: usize) -> &'a mut [T] {
    if n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, n) }
    }
}
