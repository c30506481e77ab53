//! `torch.ops.tpu.*` on CPU tensors with no Python in the call: every op's CPU kernel is
//! registered with PyTorch's dispatcher from Rust, through libtorch's stable C ABI
//! (`torch/csrc/stable/c/shim.h` and `torch/csrc/inductor/aoti_torch/c/shim.h`), so a call
//! goes dispatcher -> [`kernel`] -> plan cache -> CPU backend, the GIL never taken.
//!
//! The shim's functions are looked up at run time in the process's `libtorch_cpu.so` (the
//! Python side passes its path), so the extension links no libtorch and one abi3 wheel
//! serves every torch the package takes. Registration needs torch >= 2.13 (the ownership
//! rules below are 2.13's); before that the Python kernel stays (`tessera._ops`).
//!
//! A boxed kernel receives the call's arguments as `StableIValue`s (`u64`s) and owns them:
//! tensor handles (freed by `aoti_torch_delete_tensor_object`), the boxes of present
//! optionals (`torch_delete_stable_ivalue`), strings (`torch_delete_string`) and lists
//! (`torch_delete_list`). [`take_args`] moves each into a Rust owner at once, so every
//! one is freed however the call ends. The kernel leaves new tensor handles for its
//! results in the stack's first slots; the dispatcher owns those.
//!
//! Errors: a kernel error (the same text as on every other path: kernel, operand, rule,
//! what to change) is raised with `aoti_torch_check(false, ..)`, which throws a
//! `c10::Error` that PyTorch turns into a Python `RuntimeError`, as its own CPU kernels'
//! checks are. That C++ exception unwinds only through [`kernel`]'s frame, declared
//! `extern "C-unwind"` for it and holding no Rust value with a destructor by then; a Rust
//! panic is caught before and reported the same way, never unwinding into C++.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

use tessera_dsl::interp::{Array, Data, HostMut, HostRef};
use tessera_dsl::{DType, KernelError, Type};
use tessera_kernels::op::{ArgType, Op, Schema, Static, Statics};
use tessera_kernels::plan;

use crate::tensor::{Refused, TensorRef};

type StableIValue = u64;
type AtenTensorHandle = *mut c_void;
type Opaque = *mut c_void;
type BoxedKernel = unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64);

/// The libtorch functions the kernels call, resolved from `libtorch_cpu.so`.
pub struct Shim {
    /// Keeps the library mapped (it is torch's own, loaded before us; this only counts a
    /// reference).
    _lib: libloading::Library,
    init_impl: unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u32, *mut Opaque) -> i32,
    library_impl: unsafe extern "C" fn(Opaque, *const c_char, BoxedKernel, u64) -> i32,
    dim: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> i32,
    sizes: unsafe extern "C" fn(AtenTensorHandle, *mut *const i64) -> i32,
    strides: unsafe extern "C" fn(AtenTensorHandle, *mut *const i64) -> i32,
    dtype: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> i32,
    device_type: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> i32,
    layout: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> i32,
    data_ptr: unsafe extern "C" fn(AtenTensorHandle, *mut *mut c_void) -> i32,
    storage_offset: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> i32,
    storage_size: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> i32,
    empty_strided: unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut AtenTensorHandle) -> i32,
    delete_tensor: unsafe extern "C" fn(AtenTensorHandle) -> i32,
    delete_ivalue: unsafe extern "C" fn(*mut StableIValue) -> i32,
    string_length: unsafe extern "C" fn(Opaque, *mut usize) -> i32,
    string_c_str: unsafe extern "C" fn(Opaque, *mut *const c_char) -> i32,
    delete_string: unsafe extern "C" fn(Opaque) -> i32,
    list_size: unsafe extern "C" fn(Opaque, *mut usize) -> i32,
    list_get_item: unsafe extern "C" fn(Opaque, usize, *mut StableIValue) -> i32,
    delete_list: unsafe extern "C" fn(Opaque) -> i32,
    /// `torch_tensor_from_pyobject` / `torch_tensor_to_pyobject` (2.14+; GIL held).
    from_py: Option<unsafe extern "C" fn(*mut c_void, *mut AtenTensorHandle) -> i32>,
    to_py: Option<unsafe extern "C" fn(AtenTensorHandle, *mut c_void, *mut *mut c_void) -> i32>,
    /// Throws `c10::Error(msg)` when `cond` is false.
    check: unsafe extern "C-unwind" fn(bool, *const c_char, *const c_char, u32, *const c_char),
    /// libtorch's codes (`aoti_torch_dtype_*()` and friends), read once.
    codes: Codes,
}

struct Codes {
    dtypes: [(i32, DType); 7],
    int64: i32,
    /// Other dtypes, by name, for the refusal message.
    others: [(i32, &'static str); 5],
    cpu: i32,
    strided: i32,
}

pub static SHIM: OnceLock<Shim> = OnceLock::new();

/// The extension build version passed with each registration: the stable ABI's encoding
/// `(major << 56) | (minor << 48)` of the running torch.
fn abi_version(major: u64, minor: u64) -> u64 {
    (major << 56) | (minor << 48)
}

impl Shim {
    /// # Safety
    /// `path` is the `libtorch_cpu.so` of the torch this process imported, of a version
    /// whose shim has the signatures declared on [`Shim`] (2.13 to 2.15, checked by the
    /// caller).
    unsafe fn load(path: &str) -> Result<Shim, String> {
        // SAFETY: loading torch's own library, already loaded by `import torch`: no
        // initialisers run again.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("cannot open {path}: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's C signature in shim.h is the field's type (the
                // caller's contract on the version).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{path} lacks {}: {e}", $name))?
            };
        }
        let code = |f: unsafe extern "C" fn() -> i32| unsafe { f() };
        let dtype = |f| code(f);
        let codes = Codes {
            dtypes: [
                (dtype(sym!("aoti_torch_dtype_float32")), DType::F32),
                (dtype(sym!("aoti_torch_dtype_bfloat16")), DType::BF16),
                (dtype(sym!("aoti_torch_dtype_int32")), DType::I32),
                (dtype(sym!("aoti_torch_dtype_int8")), DType::I8),
                (dtype(sym!("aoti_torch_dtype_bool")), DType::Bool),
                (dtype(sym!("aoti_torch_dtype_float8_e4m3fn")), DType::F8E4M3FN),
                (dtype(sym!("aoti_torch_dtype_float8_e5m2")), DType::F8E5M2),
            ],
            int64: code(sym!("aoti_torch_dtype_int64")),
            others: [
                (code(sym!("aoti_torch_dtype_float64")), "float64"),
                (code(sym!("aoti_torch_dtype_float16")), "float16"),
                (code(sym!("aoti_torch_dtype_int16")), "int16"),
                (code(sym!("aoti_torch_dtype_uint8")), "uint8"),
                (code(sym!("aoti_torch_dtype_complex64")), "complex64"),
            ],
            cpu: code(sym!("aoti_torch_device_type_cpu")),
            strided: code(sym!("aoti_torch_layout_strided")),
        };
        Ok(Shim {
            init_impl: sym!("aoti_torch_library_init_impl"),
            library_impl: sym!("torch_library_impl"),
            dim: sym!("aoti_torch_get_dim"),
            sizes: sym!("aoti_torch_get_sizes"),
            strides: sym!("aoti_torch_get_strides"),
            dtype: sym!("aoti_torch_get_dtype"),
            device_type: sym!("aoti_torch_get_device_type"),
            layout: sym!("aoti_torch_get_layout"),
            data_ptr: sym!("aoti_torch_get_data_ptr"),
            storage_offset: sym!("aoti_torch_get_storage_offset"),
            storage_size: sym!("aoti_torch_get_storage_size"),
            empty_strided: sym!("aoti_torch_empty_strided"),
            delete_tensor: sym!("aoti_torch_delete_tensor_object"),
            delete_ivalue: sym!("torch_delete_stable_ivalue"),
            string_length: sym!("torch_string_length"),
            string_c_str: sym!("torch_string_c_str"),
            delete_string: sym!("torch_delete_string"),
            list_size: sym!("torch_list_size"),
            list_get_item: sym!("torch_list_get_item"),
            delete_list: sym!("torch_delete_list"),
            check: sym!("aoti_torch_check"),
            // SAFETY: as `sym!`; absent before torch 2.14.
            from_py: unsafe { lib.get(b"torch_tensor_from_pyobject\0") }.ok().map(|f| *f),
            to_py: unsafe { lib.get(b"torch_tensor_to_pyobject\0") }.ok().map(|f| *f),
            codes,
            _lib: lib,
        })
    }
}

fn ok(code: i32, what: &str) -> Result<(), String> {
    if code == 0 {
        Ok(())
    } else {
        Err(format!("tessera: libtorch's {what} failed (error {code})"))
    }
}

// ---- registration ---------------------------------------------------------------------------

/// One boxed kernel per op slot: the dispatcher passes no user data, so the op is the
/// function's const parameter (slot `I` serves `table()[I]`).
macro_rules! slots {
    ($($i:literal)*) => { [$(kernel::<$i> as BoxedKernel),*] };
}
const SLOTS: [BoxedKernel; 128] = slots![
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
    32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
    64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95
    96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127
];

/// The shim, loaded from `libtorch_path` on first use (torch `version` >= 2.13).
pub fn load(libtorch_path: &str, version: (u64, u64)) -> Result<&'static Shim, String> {
    if let Some(s) = SHIM.get() {
        return Ok(s);
    }
    if version < (2, 13) {
        return Err(format!("tessera: torch {}.{} predates the stable-ABI functions the CPU kernels use (2.13)", version.0, version.1));
    }
    // SAFETY: the path is the running torch's libtorch_cpu.so (the caller's contract),
    // of a version checked above.
    let s = unsafe { Shim::load(libtorch_path) }?;
    Ok(SHIM.get_or_init(|| s))
}

/// Registers the CPU kernel of every op of this module's table in `namespace` (whose
/// schemas the Python side defined), resolving libtorch's shim from `libtorch_path`.
/// `torch_version`: the running torch's `(major, minor)`; below 2.13 nothing is registered
/// and `Ok(false)` says the Python kernels stay.
pub fn register(namespace: &str, libtorch_path: &str, torch_version: (u64, u64)) -> Result<bool, String> {
    if torch_version < (2, 13) {
        return Ok(false);
    }
    let ops = crate::table();
    if ops.len() > SLOTS.len() {
        return Err(format!("tessera: {} ops in one module; native CPU dispatch serves at most {} (split the table)", ops.len(), SLOTS.len()));
    }
    let shim = load(libtorch_path, torch_version)?;
    let ns = CString::new(namespace).map_err(|e| e.to_string())?;
    let mut lib: Opaque = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings and an out-pointer; the library object this
    // creates is never deleted (deleting it would unregister the kernels), one per module.
    ok(unsafe { (shim.init_impl)(ns.as_ptr(), c"CPU".as_ptr(), c"interop/torch/src/dispatch.rs".as_ptr(), line!(), &mut lib) }, "library init")?;
    let version = abi_version(torch_version.0, torch_version.1.min(15));
    for (i, op) in ops.iter().enumerate() {
        if op.alias_of.is_some() && op.alias_plan.is_none() {
            continue; // a composite of the aliased op (registered in Python)
        }
        let name = CString::new(op.name).map_err(|e| e.to_string())?;
        // SAFETY: `lib` came from `init_impl`; `SLOTS[i]` is a kernel with the boxed
        // signature the dispatcher calls.
        ok(unsafe { (shim.library_impl)(lib, name.as_ptr(), SLOTS[i], version) }, "kernel registration")?;
    }
    Ok(true)
}

// ---- the kernel -----------------------------------------------------------------------------

/// The boxed CPU kernel of op `table()[I]`.
///
/// # Safety
/// Called by the dispatcher with `stack` holding `num_args` arguments of the op's schema
/// (room for its results), as `torch_library_impl` promises.
unsafe extern "C-unwind" fn kernel<const I: usize>(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    // SAFETY: forwarded from the dispatcher's contract.
    let outcome = std::panic::catch_unwind(|| unsafe { call(I, stack, num_args as usize, num_outputs as usize) });
    let message = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(message)) => message,
        Err(panic) => format!("tessera: internal error (a panic) in a CPU kernel: {}; please report it", panic_text(&panic)),
    };
    raise(message);
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}

thread_local! {
    /// The message of the error being raised on this thread (alive until the next one:
    /// the exception copies it while unwinding).
    static RAISED: RefCell<CString> = RefCell::new(CString::default());
}

/// Throws `message` as a `c10::Error` (Python `RuntimeError`). Nothing with a destructor
/// is alive in this frame at the throw.
fn raise(message: String) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let ptr = RAISED.with(|cell| {
        *cell.borrow_mut() = text;
        cell.borrow().as_ptr()
    });
    let shim = SHIM.get().expect("kernels run only after registration loaded the shim");
    // SAFETY: NUL-terminated strings alive across the call (the message in this thread's
    // cell); `check` throws, and `kernel`'s C-unwind frame lets the exception through.
    unsafe { (shim.check)(false, c"tessera".as_ptr(), c"interop/torch/src/dispatch.rs".as_ptr(), line!(), ptr) };
}

/// A tensor handle the kernel owns, freed on drop.
pub struct AtenTensor(AtenTensorHandle);

impl Drop for AtenTensor {
    fn drop(&mut self) {
        if let Some(shim) = SHIM.get() {
            // SAFETY: an owned handle from the dispatcher or `empty_strided`, freed once.
            unsafe { (shim.delete_tensor)(self.0) };
        }
    }
}

// SAFETY: a handle is a heap `at::Tensor` (refcounted, thread-safe); the kernel moves
// it, never shares it.
unsafe impl Send for AtenTensor {}

enum Arg {
    Tensor(Option<AtenTensor>),
    Static(Static),
}

/// Takes ownership of the call's arguments (see the module docs), by the schema.
///
/// # Safety
/// `stack[..n]` holds the arguments of `op`'s schema as the dispatcher encodes them.
unsafe fn take_args(shim: &Shim, op: &Op, schema: &Schema, stack: *mut StableIValue, n: usize) -> Result<Vec<Arg>, String> {
    if n > schema.params.len() {
        return Err(format!("tessera: kernel `{}` got {n} arguments, its schema has {}", op.name, schema.params.len()));
    }
    let mut args = Vec::with_capacity(n);
    let mut first_error = None;
    for (i, p) in schema.params.iter().take(n).enumerate() {
        // SAFETY: `i < n`, within the stack.
        let mut v = unsafe { *stack.add(i) };
        if p.optional {
            if v == 0 {
                args.push(if p.ty == ArgType::Tensor { Arg::Tensor(None) } else { Arg::Static(Static::None) });
                continue;
            }
            // A present optional is a box holding the value; the kernel frees the box.
            let boxed = v as *mut StableIValue;
            // SAFETY: a live box from `torch_new_stable_ivalue`, read then freed once.
            unsafe {
                v = *boxed;
                (shim.delete_ivalue)(boxed);
            }
        }
        // SAFETY (each arm): `v` encodes a value of `p.ty`, owned by the kernel.
        let arg = match p.ty {
            ArgType::Tensor => Arg::Tensor(Some(AtenTensor(v as AtenTensorHandle))),
            ArgType::Int => Arg::Static(Static::Int(v as i64)),
            ArgType::Float => Arg::Static(Static::Float(f64::from_bits(v))),
            ArgType::Bool => Arg::Static(Static::Bool(v & 0xff != 0)),
            ArgType::Str => match unsafe { take_string(shim, v as Opaque) } {
                Ok(s) => Arg::Static(Static::Str(s)),
                Err(e) => {
                    first_error.get_or_insert(e);
                    Arg::Static(Static::None)
                }
            },
            ArgType::Ints => match unsafe { take_ints(shim, v as Opaque) } {
                Ok(l) => Arg::Static(Static::Ints(l)),
                Err(e) => {
                    first_error.get_or_insert(e);
                    Arg::Static(Static::None)
                }
            },
        };
        args.push(arg);
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(args),
    }
}

/// # Safety
/// `h` is an owned `StringHandle`.
unsafe fn take_string(shim: &Shim, h: Opaque) -> Result<String, String> {
    let (mut len, mut data) = (0usize, std::ptr::null::<c_char>());
    // SAFETY: a live handle; `data` points at `len` bytes until the handle is freed.
    let read = unsafe { ok((shim.string_length)(h, &mut len), "string length").and_then(|_| ok((shim.string_c_str)(h, &mut data), "string data")) };
    let text = read.map(|_| if data.is_null() { String::new() } else { String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(data as *const u8, len) }).into_owned() });
    // SAFETY: freed once, after the last read.
    unsafe { (shim.delete_string)(h) };
    text
}

/// # Safety
/// `h` is an owned `StableListHandle` of int64 values.
unsafe fn take_ints(shim: &Shim, h: Opaque) -> Result<Vec<i64>, String> {
    let mut n = 0usize;
    // SAFETY: a live list handle, read then freed once.
    let read = unsafe {
        ok((shim.list_size)(h, &mut n), "list size").and_then(|_| {
            (0..n)
                .map(|i| {
                    let mut v = 0u64;
                    ok((shim.list_get_item)(h, i, &mut v), "list item").map(|_| v as i64)
                })
                .collect()
        })
    };
    unsafe { (shim.delete_list)(h) };
    read
}

/// Runs op `table()[slot]` on the call in `stack`.
///
/// # Safety
/// As [`kernel`].
unsafe fn call(slot: usize, stack: *mut StableIValue, num_args: usize, num_outputs: usize) -> Result<(), String> {
    let shim = SHIM.get().ok_or("tessera: native dispatch used before registration")?;
    let op: &'static Op = crate::table().get(slot).copied().ok_or("tessera: no op in this kernel slot")?;
    let schema = op.parsed().map_err(|e| e.to_string())?;
    // SAFETY: the dispatcher's contract.
    let args = unsafe { take_args(shim, op, &schema, stack, num_args) }?;
    let (mut tensors, mut statics) = (Vec::new(), Vec::new());
    for a in args {
        match a {
            Arg::Tensor(t) => tensors.push(t),
            Arg::Static(s) => statics.push(s),
        }
    }
    let outs = run_call(shim, op, &schema, tensors, statics)?;
    if outs.len() != num_outputs {
        return Err(format!("tessera: kernel `{}` returns {} results, its schema {num_outputs}", op.name, outs.len()));
    }
    for (j, o) in outs.into_iter().enumerate() {
        let handle = o.into_aten().ok_or("tessera: an output is not a libtorch tensor")?;
        // SAFETY: `j < num_outputs` (checked above), slots the dispatcher reads back; the
        // handle's ownership passes to it (hence `forget`).
        unsafe { *stack.add(j) = handle.0 as StableIValue };
        std::mem::forget(handle);
    }
    Ok(())
}

/// Runs `op` on CPU tensors (owned handles, `None` for an absent optional) and statics
/// (schema order; missing trailing ones take their defaults): its results as fresh tensors.
/// Errors are the full diagnostic text.
pub fn run_call(shim: &Shim, op: &'static Op, schema: &Schema, tensors: Vec<Option<AtenTensor>>, statics: Vec<Static>) -> Result<Vec<TensorRef<'static>>, String> {
    let err = |e: KernelError| e.to_string();
    let names: Vec<&str> = op.inputs.iter().map(|i| i.name).collect();
    let statics = Statics::from_values(schema, statics).map_err(|m| err(KernelError::new(op.name, "static arguments", "option-value", m, format!("see the schema: {}{}", op.name, op.schema))))?;
    let refusal = |i: usize, r: Refused| {
        let operand = names.get(i).map_or(format!("tensor input {i}"), |n| format!("input `{n}`"));
        err(KernelError::new(op.name, operand, r.rule, r.message, r.help))
    };
    let described = tensors
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.map(|t| describe(shim, t).map_err(|r| refusal(i, r))).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let types: Vec<Option<Type>> = described.iter().map(|d| d.as_ref().map(|d| d.ty.clone())).collect();
    let target = crate::current_target();
    let plan = crate::plan_for_call(op, &statics, &types, &target).map_err(err)?;
    let ins = described.into_iter().enumerate().map(|(i, d)| d.map(|d| d.borrow().map_err(|r| refusal(i, r))).transpose()).collect::<Result<Vec<_>, _>>()?;
    let mut outs = plan.results.iter().map(|r| empty(shim, &r.ty)).collect::<Result<Vec<_>, _>>()?;
    {
        let ins: Vec<Option<HostRef<'_>>> = ins.iter().map(|r| r.as_ref().map(TensorRef::host)).collect();
        let mut views: Vec<HostMut<'_>> = outs
            .iter_mut()
            .map(|o| o.host_mut().ok_or_else(|| err(KernelError::new(op.name, "outputs", "output-dtype", "a bool result cannot be written in place", "report this as a Tessera bug"))))
            .collect::<Result<_, _>>()?;
        let backend = crate::cpu_backend()?;
        plan::execute_into(&plan, backend, &ins, &mut views).map_err(err)?;
    }
    Ok(outs)
}

// ---- the Python kernel's side (the default) --------------------------------------------------

/// The tensor `obj` (a `torch.Tensor` PyObject) as an owned handle sharing its TensorImpl.
///
/// # Safety
/// `obj` is a live Python object and the GIL is held.
pub unsafe fn tensor_from_py(shim: &Shim, obj: *mut c_void) -> Result<AtenTensor, String> {
    let from_py = shim.from_py.ok_or("tessera: this torch lacks torch_tensor_from_pyobject (2.14+)")?;
    let mut h: AtenTensorHandle = std::ptr::null_mut();
    // SAFETY: the caller's contract; the out-pointer receives a new reference.
    ok(unsafe { from_py(obj, &mut h) }, "torch_tensor_from_pyobject (is the argument a tensor?)")?;
    Ok(AtenTensor(h))
}

/// A new Python reference to a `torch.Tensor` for `t` (the handle stays ours, freed on drop).
///
/// # Safety
/// The GIL is held.
pub unsafe fn tensor_to_py(shim: &Shim, t: &AtenTensor) -> Result<*mut c_void, String> {
    let to_py = shim.to_py.ok_or("tessera: this torch lacks torch_tensor_to_pyobject (2.14+)")?;
    let mut obj: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live handle; a null type means torch.Tensor; `obj` receives a new reference.
    ok(unsafe { to_py(t.0, std::ptr::null_mut(), &mut obj) }, "torch_tensor_to_pyobject")?;
    if obj.is_null() {
        return Err("tessera: torch_tensor_to_pyobject gave no object".into());
    }
    Ok(obj)
}

/// A tensor argument's metadata checked (see `tensor.rs` for the facts), nothing read.
pub struct NativeDescribed {
    pub ty: Type,
    handle: AtenTensor,
    int64: bool,
    sizes: Vec<usize>,
    strides: Vec<isize>,
    ptr: usize,
    contiguous: bool,
}

fn describe(shim: &Shim, t: AtenTensor) -> Result<NativeDescribed, Refused> {
    let h = t.0;
    let fail = |what: &str| Refused { rule: "operand-memory", message: format!("libtorch could not report the tensor's {what}"), help: "pass a plain dense CPU tensor".into() };
    let (mut layout, mut device, mut dtype, mut dim) = (0i32, 0i32, 0i32, 0i64);
    let (mut sizes, mut strides) = (std::ptr::null::<i64>(), std::ptr::null::<i64>());
    let (mut ptr, mut offset, mut storage) = (std::ptr::null_mut::<c_void>(), 0i64, 0i64);
    // SAFETY: `h` is a live tensor handle; each call writes its out-parameter; `sizes`
    // and `strides` point at `dim` values borrowed from the tensor, copied below.
    unsafe {
        if (shim.layout)(h, &mut layout) != 0 || (shim.device_type)(h, &mut device) != 0 || (shim.dtype)(h, &mut dtype) != 0 || (shim.dim)(h, &mut dim) != 0 {
            return Err(fail("metadata"));
        }
        if layout != shim.codes.strided {
            return Err(Refused { rule: "operand-layout", message: "a sparse (non-strided) tensor".into(), help: "pass a dense (strided) tensor, e.g. x.to_dense()".into() });
        }
        if device != shim.codes.cpu {
            return Err(Refused { rule: "operand-device", message: "a tensor on another device, whose memory the CPU kernels cannot read".into(), help: "move the tensor to the CPU (`.cpu()`), or call the op with all tensors on one tpu device".into() });
        }
        if (shim.sizes)(h, &mut sizes) != 0 || (shim.strides)(h, &mut strides) != 0 || (shim.data_ptr)(h, &mut ptr) != 0 || (shim.storage_offset)(h, &mut offset) != 0 || (shim.storage_size)(h, &mut storage) != 0 {
            return Err(fail("sizes, strides or data"));
        }
    }
    let dim = usize::try_from(dim).map_err(|_| fail("rank"))?;
    // SAFETY: as above, `dim` values each (none when `dim` is 0: a scalar).
    let (sizes, strides): (&[i64], &[i64]) = if dim == 0 { (&[], &[]) } else { unsafe { (std::slice::from_raw_parts(sizes, dim), std::slice::from_raw_parts(strides, dim)) } };
    let int64 = dtype == shim.codes.int64;
    let dtype = match shim.codes.dtypes.iter().find(|(c, _)| *c == dtype) {
        Some(&(_, d)) => d,
        None if int64 => DType::I32,
        None => {
            let name = shim.codes.others.iter().find(|(c, _)| *c == dtype).map_or("this dtype", |&(_, n)| n);
            return Err(Refused { rule: "operand-dtype", message: format!("tensors of {name} are not supported"), help: "pass float32, bfloat16, int32, int8 or bool tensors (index tensors may be int64; a user op of floats also float8_e4m3fn / float8_e5m2)".into() });
        }
    };
    let shape: Vec<usize> = sizes.iter().map(|&s| usize::try_from(s).map_err(|_| fail("sizes"))).collect::<Result<_, _>>()?;
    let strides: Vec<isize> = strides.iter().map(|&s| isize::try_from(s).map_err(|_| fail("strides"))).collect::<Result<_, _>>()?;
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| Refused { rule: "shape-overflow", message: format!("shape {shape:?} has more elements than fit in memory"), help: "pass a smaller tensor".into() })?;
    let elem = if int64 { 8 } else { dtype.bytes() };
    if n > 0 {
        // Every element the view addresses lies inside its storage (torch guarantees it for
        // a valid tensor; checked, since the kernels read raw memory).
        let last = shape.iter().zip(&strides).try_fold(0isize, |acc, (&s, &st)| (st >= 0).then(|| acc.checked_add(st.checked_mul(s as isize - 1)?)).flatten());
        let fits = last.and_then(|l| usize::try_from(offset).ok()?.checked_add(l as usize)?.checked_add(1)?.checked_mul(elem)).is_some_and(|end| end as i64 <= storage);
        if !fits || ptr.is_null() {
            return Err(Refused { rule: "operand-memory", message: "the tensor's data lies outside its storage, or its pointer is null".into(), help: "pass a tensor with storage (e.g. .clone() it)".into() });
        }
    }
    // A misaligned pointer (`frombuffer` at an odd offset) cannot be a slice of the
    // element type: such a tensor is read through a copy, like a strided one.
    let contiguous = is_contiguous(&shape, &strides) && (ptr as usize).is_multiple_of(elem);
    Ok(NativeDescribed { ty: Type::vector(dtype, &shape), handle: t, int64, sizes: shape, strides, ptr: ptr as usize, contiguous })
}

/// torch's definition: strides of row-major order, ignoring dims of size 1 (and any
/// tensor of no elements).
fn is_contiguous(shape: &[usize], strides: &[isize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1isize;
    for (&s, &st) in shape.iter().zip(strides).rev() {
        if s != 1 {
            if st != expected {
                return false;
            }
            expected = expected.saturating_mul(s as isize);
        }
    }
    true
}

impl NativeDescribed {
    /// The tensor's elements for the kernels: its own memory when contiguous, else a
    /// row-major copy; int64 narrowed to int32 and bool bytes checked (as `tensor.rs`).
    pub fn borrow(self) -> Result<TensorRef<'static>, Refused> {
        let NativeDescribed { ty, handle, int64, sizes, strides, ptr, contiguous } = self;
        // SAFETY (all reads below): `describe` checked that every offset the view
        // addresses lies inside the storage of the live tensor `handle`, from a non-null
        // `ptr` (aligned when `contiguous`; `gather` reads unaligned); nothing writes it
        // during the call.
        let copy = || -> Result<Data, Refused> {
            Ok(if int64 {
                let wide: Vec<i64> = unsafe { gather(ptr as *const i64, &sizes, &strides) }?;
                let narrow = wide.iter().enumerate().map(|(i, &v)| i32::try_from(v).map_err(|_| Refused { rule: "index-range", message: format!("element {i} is {v}, outside the int32 range the kernels index with"), help: "pass index values in [-2^31, 2^31)".into() })).collect::<Result<_, _>>()?;
                Data::I32(narrow)
            } else {
                match ty.dtype {
                    DType::F32 => Data::F32(unsafe { gather(ptr as *const f32, &sizes, &strides) }?),
                    DType::BF16 => Data::BF16(unsafe { gather(ptr as *const half::bf16, &sizes, &strides) }?),
                    DType::I32 => Data::I32(unsafe { gather(ptr as *const i32, &sizes, &strides) }?),
                    DType::I8 => Data::I8(unsafe { gather(ptr as *const i8, &sizes, &strides) }?),
                    // One byte per element; every byte is a valid fp8 code.
                    DType::F8E4M3FN => Data::F8E4M3FN(unsafe { gather(ptr as *const tessera_dsl::fp8::F8E4M3, &sizes, &strides) }?),
                    DType::F8E5M2 => Data::F8E5M2(unsafe { gather(ptr as *const tessera_dsl::fp8::F8E5M2, &sizes, &strides) }?),
                    DType::Bool => {
                        let bytes: Vec<u8> = unsafe { gather(ptr as *const u8, &sizes, &strides) }?;
                        let bools = bytes.iter().map(|&b| (b <= 1).then_some(b == 1)).collect::<Option<Vec<bool>>>();
                        Data::Bool(bools.ok_or_else(|| Refused { rule: "operand-memory", message: "a bool tensor holds bytes other than 0 and 1".into(), help: "build masks with comparisons, not by viewing other dtypes as bool".into() })?)
                    }
                }
            })
        };
        if contiguous && !int64 && ty.dtype != DType::Bool {
            return Ok(TensorRef::native(ty, ptr, handle));
        }
        let array = Array::try_new(&ty.shape, copy()?).map_err(|e| Refused { rule: "operand-memory", message: e.to_string(), help: "report this as a Tessera bug".into() })?;
        Ok(TensorRef::native_copy(ty, array, handle))
    }
}

/// The elements of a strided view in row-major order, in a fallibly allocated vector.
///
/// # Safety
/// For every index `i < sizes` (elementwise), `base + Σ i_d * strides_d` is a valid,
/// initialised `T` (not necessarily aligned) that stays unmutated during the call.
unsafe fn gather<T: Copy>(base: *const T, sizes: &[usize], strides: &[isize]) -> Result<Vec<T>, Refused> {
    let n: usize = sizes.iter().product();
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| Refused { rule: "host-memory", message: format!("the kernels read a contiguous copy of this tensor ({n} elements), which could not be allocated"), help: "pass a contiguous tensor, or a smaller one".into() })?;
    if n == 0 {
        return Ok(out);
    }
    let mut index = vec![0usize; sizes.len()];
    let mut offset = 0isize;
    for _ in 0..n {
        // SAFETY: the caller's contract, `offset` being `Σ index_d * strides_d`.
        out.push(unsafe { base.offset(offset).read_unaligned() });
        for d in (0..sizes.len()).rev() {
            index[d] += 1;
            offset += strides[d];
            if index[d] < sizes[d] {
                break;
            }
            offset -= strides[d] * sizes[d] as isize;
            index[d] = 0;
        }
    }
    Ok(out)
}

/// A fresh contiguous CPU tensor of `ty`, as an output.
fn empty(shim: &Shim, ty: &Type) -> Result<TensorRef<'static>, String> {
    let code = shim.codes.dtypes.iter().find(|(_, d)| *d == ty.dtype).map(|&(c, _)| c).ok_or("tessera: no torch dtype for a result")?;
    let sizes: Vec<i64> = ty.shape.iter().map(|&d| d as i64).collect();
    let mut strides = vec![1i64; sizes.len()];
    for d in (0..sizes.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(sizes[d + 1]);
    }
    let mut h: AtenTensorHandle = std::ptr::null_mut();
    // SAFETY: `sizes`/`strides` hold `len` values; the out-pointer receives an owned handle.
    ok(unsafe { (shim.empty_strided)(sizes.len() as i64, sizes.as_ptr(), strides.as_ptr(), code, shim.codes.cpu, 0, &mut h) }, "empty_strided (allocating a result)")?;
    let handle = AtenTensor(h);
    let mut ptr = std::ptr::null_mut::<c_void>();
    // SAFETY: a live handle.
    ok(unsafe { (shim.data_ptr)(h, &mut ptr) }, "data_ptr")?;
    if ty.num_elements() > 0 && (ptr.is_null() || !(ptr as usize).is_multiple_of(ty.dtype.bytes())) {
        return Err("tessera: torch gave a null or misaligned result buffer".into());
    }
    Ok(TensorRef::native(ty.clone(), ptr as usize, handle))
}
