//! `tessera._native`: the Rust side of the `tessera` Python package.
//!
//! It serves an op table (the library's, [`tessera_kernels::library`], or a user crate's:
//! [`init_module`]), turns a call into a cached [`Plan`] (built by the op's entry), runs
//! plans on a CPU backend over tensor memory (CPU tensors and the emulated host-memory
//! `tpu` device), and hands the Python side each launch's StableHLO module for TorchTPU.
//! The Python side registers every op from [`op_table`]: schema, fake shapes, autograd.
//!
//! Tensors cross as their `data_ptr()`; see [`TensorRef`] for the contract.

use std::sync::{Arc, Mutex};

mod collective;
mod dispatch;
mod fusion;
mod splash;
mod tensor;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use tensor::{check_disjoint, Described, Refused, TensorRef};
use tessera_dsl::interp::{Array, HostMut, HostRef};
use tessera_dsl::{Executor, KernelError, Target, Type};

pub use tessera_kernels::op::{ArgType, Backward, Call, Case, Input, Kind, Op, Output, Static, Statics};
pub use tessera_kernels::plan::{self, Launch, Operand, Plan};
use tessera_kernels::plan::{Layout, Source};

/// Kernel errors reach Python as `ValueError` carrying the full diagnostic (kernel,
/// operand, rule and what to change).
fn py_err(e: KernelError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn target_named(name: &str) -> PyResult<Target> {
    Target::by_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown TPU target {name:?}; use v5e, v5p, v6e or tpu7x"
        ))
    })
}

// ---- statics and the plan cache -------------------------------------------------------------

/// A Python static argument as a [`Static`].
fn static_of(v: &Bound<'_, PyAny>) -> PyResult<Static> {
    Ok(if v.is_none() {
        Static::None
    } else if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
        Static::Bool(b.is_true())
    } else if let Ok(i) = v.extract::<i64>() {
        Static::Int(i)
    } else if let Ok(x) = v.extract::<f64>() {
        Static::Float(x)
    } else if let Ok(s) = v.extract::<String>() {
        Static::Str(s)
    } else if let Ok(v) = v.extract::<Vec<i64>>() {
        Static::Ints(v)
    } else {
        return Err(PyValueError::new_err(format!("tessera: unsupported static argument {v}")));
    })
}

/// The statics of a call of `op` (schema order, defaults for missing trailing ones).
fn statics_of(op: &Op, t: &Bound<'_, PyTuple>) -> PyResult<Statics> {
    let values = t.iter().map(|v| static_of(&v)).collect::<PyResult<Vec<_>>>()?;
    let schema = op.parsed().map_err(py_err)?;
    Statics::from_values(&schema, values).map_err(|m| py_err(KernelError::new(op.name, "static arguments", "option-value", m, format!("see the schema: {}{}", op.name, op.schema))))
}

type PlanKey = (&'static str, String, Vec<Option<Type>>, &'static str);

/// Plans by op, statics, input types and target, built once and shared, in an LRU of
/// `TESSERA_PLAN_CACHE` entries (default [`PLAN_CACHE_DEFAULT`]): a long run with many
/// distinct shapes keeps the most recent plans, not all of them.
struct PlanCache {
    plans: lru::LruCache<PlanKey, Arc<Plan>>,
    hits: u64,
    misses: u64,
}

/// Plans kept by default: a plan holds its kernels' IR and, once built, their lowered
/// modules (tens of KiB for the attention kernels).
const PLAN_CACHE_DEFAULT: usize = 256;

static PLANS: Mutex<Option<PlanCache>> = Mutex::new(None);

/// A cache capacity from environment variable `var` (a positive integer), or `default`.
fn capacity_from_env(var: &str, default: usize) -> Result<std::num::NonZeroUsize, String> {
    let text = match std::env::var(var) {
        Ok(t) => t,
        Err(_) => return Ok(std::num::NonZeroUsize::new(default).expect("defaults are positive")),
    };
    text.trim().parse::<std::num::NonZeroUsize>().map_err(|_| format!("tessera: {var}={text:?} is not a positive integer (the number of entries the cache keeps)"))
}

fn with_plans<R>(f: impl FnOnce(&mut PlanCache) -> R) -> Result<R, String> {
    // A panic while the lock was held cannot leave the LRU half-updated in a way that
    // matters (entries are immutable Arcs): keep using it.
    let mut guard = PLANS.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        let capacity = capacity_from_env("TESSERA_PLAN_CACHE", PLAN_CACHE_DEFAULT)?;
        *guard = Some(PlanCache { plans: lru::LruCache::new(capacity), hits: 0, misses: 0 });
    }
    Ok(f(guard.as_mut().expect("initialised above")))
}

fn plan_for(op: &'static Op, statics: &Statics, inputs: &[Option<Type>], target: &Target) -> PyResult<Arc<Plan>> {
    plan_for_call(op, statics, inputs, target).map_err(py_err)
}

/// [`plan_for`] without Python (the natively dispatched kernels' path).
fn plan_for_call(op: &'static Op, statics: &Statics, inputs: &[Option<Type>], target: &Target) -> Result<Arc<Plan>, KernelError> {
    // The common case, the same call again: this thread's last plan of the op, found by a
    // comparison instead of formatting and hashing the LRU key.
    let tables = tessera_kernels::tune::generation();
    let memo_hit = LAST_PLANS.with(|m| {
        m.borrow().iter().find(|e| std::ptr::eq(e.op, op) && e.tables == tables && e.target == target.name && e.inputs == inputs && same_statics(&e.statics, statics)).map(|e| e.plan.clone())
    });
    if let Some(plan) = memo_hit {
        MEMO_HITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Ok(plan);
    }
    let plan = plan_from_cache(op, statics, inputs, target)?;
    LAST_PLANS.with(|m| {
        let mut m = m.borrow_mut();
        m.retain(|e| !std::ptr::eq(e.op, op));
        m.push(LastPlan { op, tables, target: target.name, inputs: inputs.to_vec(), statics: statics.clone(), plan: plan.clone() });
    });
    Ok(plan)
}

/// One op's last plan on a thread ([`plan_for_call`]'s memo: at most one per op).
struct LastPlan {
    op: &'static Op,
    /// The tuning tables' generation the plan was made under (a table added since may
    /// change its blocks).
    tables: u64,
    target: &'static str,
    inputs: Vec<Option<Type>>,
    statics: Statics,
    plan: Arc<Plan>,
}

thread_local! {
    static LAST_PLANS: std::cell::RefCell<Vec<LastPlan>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Plan-cache hits served by the memo (reported with the LRU's).
static MEMO_HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Equal statics, floats by their bits (as the LRU key tells `-0.0` from `0.0`, and a NaN
/// from itself).
fn same_statics(a: &Statics, b: &Statics) -> bool {
    let same = |x: &Static, y: &Static| match (x, y) {
        (Static::Float(p), Static::Float(q)) => p.to_bits() == q.to_bits(),
        _ => x == y,
    };
    a.values().len() == b.values().len() && a.values().iter().zip(b.values()).all(|(x, y)| same(x, y))
}

/// The LRU path of [`plan_for_call`].
fn plan_from_cache(op: &'static Op, statics: &Statics, inputs: &[Option<Type>], target: &Target) -> Result<Arc<Plan>, KernelError> {
    let cache_err = |m: String| KernelError::new(op.name, "plan cache", "option-value", m, "set TESSERA_PLAN_CACHE to a positive integer");
    let key: PlanKey = (op.name, format!("{statics:?}"), inputs.to_vec(), target.name);
    if let Some(p) = with_plans(|c| {
        let found = c.plans.get(&key).cloned();
        if found.is_some() {
            c.hits += 1;
        }
        found
    })
    .map_err(cache_err)?
    {
        return Ok(p);
    }
    let plan = Arc::new(op.plan_for(inputs, statics, target)?);
    for launch in &plan.launches {
        tessera_dsl::verify::verify(&launch.kernel, target)?;
    }
    with_plans(|c| {
        c.misses += 1;
        c.plans.put(key, plan.clone());
    })
    .map_err(cache_err)?;
    Ok(plan)
}

/// Adds the tuning table at `path` (what `tessera tune --save` wrote) ahead of the ones
/// this module already reads, and drops the cached plans, so the next call of an op the
/// table holds takes its blocks. Returns the number of tuned entries in the file.
#[pyfunction]
fn load_tuning_table(path: std::path::PathBuf) -> PyResult<usize> {
    let n = tessera_kernels::tune::load_table_file(&path).map_err(py_err)?;
    with_plans(|c| c.plans.clear()).map_err(PyValueError::new_err)?;
    Ok(n)
}

/// `{"plans": {...}, "cpu_code": {...}}`: each cache's entries, capacity, hits and misses
/// (the compiled CPU backend's also its compile time and interpreter fallbacks).
#[pyfunction]
fn cache_info(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    let plans = PyDict::new(py);
    with_plans(|c| -> PyResult<()> {
        plans.set_item("entries", c.plans.len())?;
        plans.set_item("capacity", c.plans.cap().get())?;
        plans.set_item("hits", c.hits + MEMO_HITS.load(std::sync::atomic::Ordering::Relaxed))?;
        plans.set_item("misses", c.misses)?;
        Ok(())
    })
    .map_err(PyValueError::new_err)??;
    d.set_item("plans", plans)?;
    let s = tessera_codegen::cpu::cache_stats();
    let code = PyDict::new(py);
    code.set_item("entries", s.entries)?;
    code.set_item("capacity", s.capacity)?;
    code.set_item("hits", s.hits)?;
    code.set_item("misses", s.misses)?;
    code.set_item("compile_seconds", s.compile_time.as_secs_f64())?;
    code.set_item("fallbacks", s.fallbacks)?;
    d.set_item("cpu_code", code)?;
    Ok(d.unbind())
}

/// The tensors of a call of op `op` (`None` for an absent optional one), their metadata
/// checked (`tensor.rs`); `host_device`: a device besides `cpu` whose memory is host memory.
fn describe<'py>(op: &str, inputs: &Bound<'py, PyList>, host_device: Option<&str>) -> PyResult<Vec<Option<Described<'py>>>> {
    let names = op_named(op).map(tensor_names).unwrap_or_default();
    inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_none() {
                return Ok(None);
            }
            TensorRef::describe(&t, host_device).map(Some).map_err(|r| refusal(op, names.get(i).copied(), i, r))
        })
        .collect()
}

/// Borrows described tensors (contiguous copies, int64 narrowing): after the call's plan
/// verified, so that a call the verifier refuses copies nothing.
fn borrow<'py>(op: &str, described: Vec<Option<Described<'py>>>) -> PyResult<Vec<Option<TensorRef<'py>>>> {
    let names = op_named(op).map(tensor_names).unwrap_or_default();
    described.into_iter().enumerate().map(|(i, d)| d.map(|d| d.borrow().map_err(|r| refusal(op, names.get(i).copied(), i, r))).transpose()).collect()
}

/// [`borrow`] of [`describe`].
fn tensor_refs<'py>(op: &str, inputs: &Bound<'py, PyList>, host_device: Option<&str>) -> PyResult<Vec<Option<TensorRef<'py>>>> {
    borrow(op, describe(op, inputs, host_device)?)
}

/// A refused tensor as the op's error, naming the operand.
fn refusal(op: &str, name: Option<&str>, i: usize, r: Refused) -> PyErr {
    let operand = name.map_or(format!("tensor input {i}"), |n| format!("input `{n}`"));
    py_err(KernelError::new(op, operand, r.rule, r.message, r.help))
}

/// Mutable views of output tensors allocated for this call.
fn outputs_of<'a>(op: &str, outs: &'a mut [TensorRef<'_>]) -> PyResult<Vec<HostMut<'a>>> {
    outs.iter_mut().map(|o| o.host_mut().ok_or_else(|| py_err(KernelError::new(op, "outputs", "output-dtype", "a bool result cannot be written in place", "report this as a Tessera bug")))).collect()
}

/// The names of an op's tensor arguments, in schema order.
fn tensor_names(op: &Op) -> Vec<&'static str> {
    op.inputs.iter().map(|i| i.name).collect()
}

// ---- the Python API ---------------------------------------------------------------------------

/// The ops this extension module serves: the library's, or a user crate's (see
/// [`init_module`]). Each extension module (cdylib) has its own.
static TABLE: std::sync::OnceLock<Vec<&'static Op>> = std::sync::OnceLock::new();

fn table() -> &'static [&'static Op] {
    TABLE.get().map(Vec::as_slice).unwrap_or_default()
}

fn op_named(name: &str) -> PyResult<&'static Op> {
    table().iter().copied().find(|o| o.name == name).ok_or_else(|| PyValueError::new_err(format!("tessera: no op named {name:?} in this module")))
}

/// Every op of this module as a dict: `name`, `schema`, `doc`, `outputs` (`[(name, shape
/// expression, dtype expression)]`, from which the Python side derives the fake kernel),
/// `inputs` and `input_dims` (each tensor input's name and dims contract), `backward`
/// (`None` or `(op, [args], [[input names] per result])`), `alias_of` (`None` or `(op,
/// result)`: the op is that result of op) and `alias_plan` (whether such an alias has a
/// plan of its own; else it runs as a composite of op), in registration order.
#[pyfunction]
fn op_table(py: Python<'_>) -> PyResult<Vec<Bound<'_, pyo3::types::PyDict>>> {
    table()
        .iter()
        .map(|op| {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("name", op.name)?;
            d.set_item("schema", op.schema)?;
            d.set_item("doc", op.doc)?;
            d.set_item("inputs", op.inputs.iter().map(|i| i.name).collect::<Vec<_>>())?;
            // Each input's dims contract (`[b, h, sq, d]`, `[..., n]`): tessera.dtensor derives
            // the sharding rules' placements from the dim names.
            d.set_item("input_dims", op.inputs.iter().map(|i| i.dims).collect::<Vec<_>>())?;
            d.set_item("outputs", op.outputs.iter().map(|o| (o.name, o.shape, o.dtype)).collect::<Vec<_>>())?;
            let backward = op.backward.map(|b| {
                let args: Vec<&str> = b.args.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
                let grads: Vec<Vec<&str>> = b.grads.iter().map(|g| g.split_whitespace().collect()).collect();
                (b.op, args, grads)
            });
            d.set_item("backward", backward)?;
            d.set_item("alias_of", op.alias_of)?;
            d.set_item("alias_plan", op.alias_plan.is_some())?;
            Ok(d)
        })
        .collect()
}

/// A call's tensors and its (cached) plan.
fn call<'py>(
    name: &str,
    statics: &Bound<'py, PyTuple>,
    inputs: &Bound<'py, PyList>,
    target: &str,
) -> PyResult<(Vec<Option<TensorRef<'py>>>, Arc<Plan>)> {
    let target = target_named(target)?;
    let op = op_named(name)?;
    let described = describe(name, inputs, None)?;
    let types: Vec<Option<Type>> = described.iter().map(|d| d.as_ref().map(|d| d.ty.clone())).collect();
    let plan = plan_for(op, &statics_of(op, statics)?, &types, &target)?;
    Ok((borrow(name, described)?, plan))
}

/// Runs op `name` on the interpreter over host-memory tensors (`None` for an absent
/// optional tensor) and returns fresh result tensors on `device`.
#[pyfunction]
fn run<'py>(
    py: Python<'py>,
    name: &str,
    statics: &Bound<'py, PyTuple>,
    inputs: &Bound<'py, PyList>,
    device: &Bound<'py, PyAny>,
    target: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let (refs, plan) = call(name, statics, inputs, target)?;
    let (tensors, mut outs): (Vec<_>, Vec<_>) = plan
        .results
        .iter()
        .map(|r| TensorRef::empty(py, &r.ty, device))
        .collect::<PyResult<Vec<_>>>()?
        .into_iter()
        .unzip();
    let ins: Vec<Option<HostRef<'_>>> = refs
        .iter()
        .map(|r| r.as_ref().map(TensorRef::host))
        .collect();
    let mut views = outputs_of(name, &mut outs)?;
    plan::execute_into(&plan, backend()?, &ins, &mut views).map_err(py_err)?;
    Ok(tensors)
}

/// The median seconds of `iters` executions of op `name`'s plan on the interpreter, over
/// inputs already in host arrays: the kernels' own time, without the torch call around
/// it (for the per-call overhead benchmark).
#[pyfunction]
fn time_plan(
    name: &str,
    statics: &Bound<'_, PyTuple>,
    inputs: &Bound<'_, PyList>,
    target: &str,
    iters: usize,
) -> PyResult<f64> {
    let (refs, plan) = call(name, statics, inputs, target)?;
    let ins: Vec<Option<HostRef<'_>>> = refs
        .iter()
        .map(|r| r.as_ref().map(TensorRef::host))
        .collect();
    let mut outs: Vec<Array> = plan
        .results
        .iter()
        .map(|r| Array::zeros(r.ty.dtype, &r.ty.shape))
        .collect();
    let mut times = (0..iters.max(1))
        .map(|_| {
            let start = std::time::Instant::now();
            let mut views: Vec<HostMut<'_>> = outs.iter_mut().map(Array::as_host_mut).collect();
            plan::execute_into(&plan, backend()?, &ins, &mut views).map_err(py_err)?;
            Ok(start.elapsed().as_secs_f64())
        })
        .collect::<PyResult<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

// ---- the op table's cases, for table-driven tests -----------------------------------------------

/// The op whose cases and reference serve `op` (an alias uses the aliased op's).
fn case_source(op: &'static Op) -> &'static Op {
    op.alias_of.and_then(|(of, _)| table().iter().copied().find(|o| o.name == of)).unwrap_or(op)
}

fn case_named(op: &'static Op, case: &str) -> PyResult<&'static Case> {
    case_source(op).case(case).ok_or_else(|| PyValueError::new_err(format!("tessera: op {} has no case {case:?}", op.name)))
}

/// A case as Python sees it: `(name, statics, shapes)`.
type CaseTuple = (&'static str, &'static str, Vec<Vec<usize>>);

/// `[(case, statics, shapes)]` of op `name` (an alias: the aliased op's cases).
#[pyfunction]
fn op_cases(name: &str) -> PyResult<Vec<CaseTuple>> {
    let op = case_source(op_named(name)?);
    Ok(op.cases.iter().map(|c| (c.name, c.statics, c.shapes.iter().map(|s| s.to_vec()).collect())).collect())
}

fn static_to_py<'py>(py: Python<'py>, s: &Static) -> PyResult<Bound<'py, PyAny>> {
    Ok(match s {
        Static::None => py.None().into_bound(py),
        Static::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Static::Int(i) => i.into_pyobject(py)?.into_any(),
        Static::Float(x) => x.into_pyobject(py)?.into_any(),
        Static::Str(s) => s.into_pyobject(py)?.into_any(),
        Static::Ints(v) => PyList::new(py, v)?.into_any(),
    })
}

/// A sample's `(tensors, statics)`.
type Sample<'py> = (Vec<Bound<'py, PyAny>>, Vec<Bound<'py, PyAny>>);

/// Random inputs of case `case` of op `name` for float `dtype` (`float32`/`bfloat16`):
/// `(tensors, statics)` in schema order, the tensors fresh CPU tensors (the op's own
/// contract-respecting generator, seeded by `seed`). `shapes` replaces the case's shapes
/// (its statics kept); they are checked by building the op's plan first.
#[pyfunction]
#[pyo3(signature = (name, case, dtype, seed, shapes=None))]
fn sample<'py>(py: Python<'py>, name: &str, case: &str, dtype: &str, seed: u64, shapes: Option<Vec<Vec<usize>>>) -> PyResult<Sample<'py>> {
    use rand::SeedableRng;
    let op = op_named(name)?;
    let case = case_named(op, case)?;
    let source = case_source(op);
    let dtype = plan::dtype_from_torch(dtype).filter(|d| d.is_float()).ok_or_else(|| PyValueError::new_err(format!("tessera: sample dtype {dtype:?}: use float32 or bfloat16")))?;
    let statics = source.case_statics(case).map_err(py_err)?;
    let shapes: Vec<Vec<usize>> = match shapes {
        Some(shapes) => {
            // The generators assume shapes the contract accepts: the plan checks them.
            source.plan_for(&source.types(&shapes, dtype), &statics, &Target::V6E).map_err(py_err)?;
            shapes
        }
        None => case.shapes.iter().map(|s| s.to_vec()).collect(),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let arrays = tessera_kernels::harness::inputs_for(source, &shapes, dtype, &statics, &mut rng);
    let cpu = py.import("torch")?.getattr("device")?.call1(("cpu",))?;
    let tensors = arrays
        .iter()
        .map(|a| {
            host_tensor(py, a, &cpu)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let statics = statics.values().iter().map(|s| static_to_py(py, s)).collect::<PyResult<Vec<_>>>()?;
    Ok((tensors, statics))
}

/// The independent f64 reference of op `name` under case `case`'s statics on `inputs`
/// (CPU tensors, as `sample` gives them): one `(little-endian f64 bytes, shape)` per result.
#[pyfunction]
fn reference<'py>(py: Python<'py>, name: &str, case: &str, inputs: &Bound<'py, PyList>) -> PyResult<Vec<(Bound<'py, pyo3::types::PyBytes>, Vec<usize>)>> {
    let op = op_named(name)?;
    let case = case_named(op, case)?;
    let source = case_source(op);
    let statics = source.case_statics(case).map_err(py_err)?;
    let refs = tensor_refs(name, inputs, None)?;
    let arrays: Vec<Array> = refs.iter().flatten().map(|r| plan::to_array(r.host())).collect();
    let types: Vec<Option<Type>> = refs.iter().map(|r| r.as_ref().map(|r| r.ty.clone())).collect();
    let Some(reference) = source.reference else {
        return Err(PyValueError::new_err(format!("tessera: op {} has no reference", source.name)));
    };
    let plan = source.plan_for(&types, &statics, &Target::V6E).map_err(py_err)?;
    let mut values = reference(&arrays, &statics);
    let mut shapes: Vec<Vec<usize>> = plan.results.iter().map(|r| r.ty.shape.clone()).collect();
    if let Some((_, i)) = op.alias_of {
        values = values.into_iter().skip(i).take(1).collect();
        shapes = shapes.into_iter().skip(i).take(1).collect();
    }
    Ok(values
        .iter()
        .zip(shapes)
        .map(|(v, shape)| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (pyo3::types::PyBytes::new(py, &bytes), shape)
        })
        .collect())
}

/// A fresh CPU tensor holding `a`.
fn host_tensor<'py>(py: Python<'py>, a: &Array, device: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let (t, mut r) = TensorRef::empty(py, &Type::vector(a.dtype, &a.shape), device)?;
    let mut out = r.host_mut().ok_or_else(|| PyRuntimeError::new_err("tessera: bool arrays are not returned as tensors"))?;
    plan::copy_into(a.as_host().data, &mut out.data).map_err(PyRuntimeError::new_err)?;
    Ok(t)
}

/// A plan, for the Python side of the TorchTPU path.
#[pyclass(frozen, name = "Plan")]
struct PyPlan(Arc<Plan>);

/// A layout for `_tpu._layout`: none (a view), `(hkv, group, padded_tokens)` (head-major),
/// or `(0, 0, rows)` (rows zero-padded to `rows`).
fn layout_tuple(l: Layout) -> Option<(usize, usize, usize)> {
    match l {
        Layout::View => None,
        Layout::HeadMajor {
            hkv,
            group,
            padded_tokens,
        } => Some((hkv, group, padded_tokens)),
        Layout::PadRows { rows } => Some((0, 0, rows)),
    }
}

type OperandTuple = (
    &'static str,
    usize,
    usize,
    Option<(usize, usize, usize)>,
    Vec<usize>,
    &'static str,
);

fn operand_tuple(o: &plan::Operand) -> OperandTuple {
    let (kind, a, b) = match o.source {
        Source::Input(i) => ("input", i, 0),
        Source::Host(i) => ("host", i, 0),
        Source::Result { launch, output } => ("result", launch, output),
    };
    (
        kind,
        a,
        b,
        layout_tuple(o.layout),
        o.ty.shape.clone(),
        plan::dtype_to_torch(o.ty.dtype),
    )
}

#[pymethods]
impl PyPlan {
    /// The plan's identity: plans are cached for the life of the process, so equal ids
    /// are the same plan (Python caches per-launch work under it).
    #[getter]
    fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// The number of kernel launches.
    fn __len__(&self) -> usize {
        self.0.launches.len()
    }

    /// Launch `i`'s kernel as IR text: its grid, operands with their blocks, and body.
    fn kernel_ir(&self, i: usize) -> PyResult<String> {
        Ok(self.launch(i)?.kernel.to_string())
    }

    /// Launch `i`'s kernel name (unique within the op).
    fn kernel_name(&self, i: usize) -> PyResult<String> {
        Ok(format!(
            "tessera.{}.{}",
            self.0.op,
            self.launch(i)?.kernel.name
        ))
    }

    /// Launch `i`'s StableHLO module text (lowered on first use).
    fn module(&self, i: usize) -> PyResult<String> {
        let target = self.0.target;
        let launch = self.launch(i)?;
        let lowered = launch.module.get_or_init(|| tessera_codegen::lower(&launch.kernel, &target).map(|l| l.stablehlo).map_err(|e| e.to_string()));
        lowered.clone().map_err(PyRuntimeError::new_err)
    }

    /// Launch `i`'s operands: `(kind, index, output, layout, shape, dtype)` with kind
    /// `input`/`host`/`result`, layout `None` or `(hkv, group, padded_tokens)`.
    fn args(&self, i: usize) -> PyResult<Vec<OperandTuple>> {
        Ok(self.launch(i)?.args.iter().map(operand_tuple).collect())
    }

    /// Launch `i`'s outputs as `(shape, dtype)`.
    fn outputs(&self, i: usize) -> PyResult<Vec<(Vec<usize>, &'static str)>> {
        Ok(self
            .launch(i)?
            .outputs
            .iter()
            .map(|t| (t.shape.clone(), plan::dtype_to_torch(t.dtype)))
            .collect())
    }

    /// The op's results, as operands.
    fn results(&self) -> Vec<OperandTuple> {
        self.0.results.iter().map(operand_tuple).collect()
    }

    /// The plan's host arrays (built with the plan from types and statics alone), as
    /// fresh CPU tensors.
    fn host_arrays<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let cpu = py.import("torch")?.getattr("device")?.call1(("cpu",))?;
        self.0.host.iter().map(|a| host_tensor(py, a, &cpu)).collect()
    }

    /// Runs launch `i`'s kernel on the CPU backend: `inputs` are its operands (already in
    /// kernel layout) and `outputs` fresh tensors of its output types, on the CPU or on
    /// `host_device` (the emulated `tpu`, whose memory is host memory). Outputs that
    /// overlap an input or each other are refused.
    #[pyo3(signature = (i, inputs, outputs, host_device=None))]
    fn emulate(&self, i: usize, inputs: &Bound<'_, PyList>, outputs: &Bound<'_, PyList>, host_device: Option<&str>) -> PyResult<()> {
        let launch = self.launch(i)?;
        let ins = tensor_refs(self.0.op, inputs, host_device)?;
        let outs = tensor_refs(self.0.op, outputs, host_device)?;
        check_disjoint(&ins, &outs).map_err(|r| refusal(self.0.op, Some("outputs"), 0, r))?;
        let ins: Vec<HostRef<'_>> = ins.iter().flatten().map(TensorRef::host).collect();
        let mut outs: Vec<TensorRef<'_>> = outs.into_iter().flatten().collect();
        let mut outs = outputs_of(self.0.op, &mut outs)?;
        backend()?.run_into(&launch.kernel, &ins, &mut outs).map_err(py_err)?;
        Ok(())
    }
}

impl PyPlan {
    fn launch(&self, i: usize) -> PyResult<&plan::Launch> {
        self.0.launches.get(i).ok_or_else(|| {
            PyValueError::new_err(format!("launch {i} of {}", self.0.launches.len()))
        })
    }
}

/// The plan of op `name` for inputs given as `(dtype, shape)` (or `None`) and statics.
#[pyfunction]
fn make_plan(
    name: &str,
    statics: &Bound<'_, PyTuple>,
    inputs: Vec<Option<(String, Vec<usize>)>>,
    target: &str,
) -> PyResult<PyPlan> {
    let target = target_named(target)?;
    let op = op_named(name)?;
    let names = tensor_names(op);
    let types = inputs
        .into_iter()
        .enumerate()
        .map(|(i, input)| {
            input
                .map(|(dtype, shape)| {
                    plan::dtype_from_torch(&dtype).map(|d| Type::vector(d, &shape)).ok_or_else(|| {
                        // As the CPU path's bridge names it (`tensor.rs`).
                        let r = Refused { rule: "operand-dtype", message: format!("tensors of {dtype} are not supported"), help: "pass float32, bfloat16, int32, int8 or bool tensors (index tensors may be int64)".into() };
                        refusal(op.name, names.get(i).copied(), i, r)
                    })
                })
                .transpose()
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyPlan(plan_for(op, &statics_of(op, statics)?, &types, &target)?))
}

/// Fills a Python extension module serving `ops`: the library's `tessera._native`, or a
/// user crate's own module, which `tessera.register_ops(module)` then registers as
/// `torch.ops.tpu.*` exactly like the library (see `interop/torch/example`).
pub fn init_module(m: &Bound<'_, PyModule>, ops: impl IntoIterator<Item = &'static Op>) -> PyResult<()> {
    let ops: Vec<&'static Op> = ops.into_iter().collect();
    let names = |t: &[&Op]| t.iter().map(|o| o.name).collect::<Vec<_>>();
    if TABLE.get().is_some_and(|t| names(t) != names(&ops)) {
        return Err(PyRuntimeError::new_err("tessera: this extension module was initialised with another op table"));
    }
    let _ = TABLE.set(ops);
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(op_table, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(load_tuning_table, m)?)?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(set_target, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_backend_name, m)?)?;
    m.add_function(wrap_pyfunction!(register_cpu_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(init_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(call_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(make_plan, m)?)?;
    m.add_function(wrap_pyfunction!(time_plan, m)?)?;
    m.add_function(wrap_pyfunction!(op_cases, m)?)?;
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(reference, m)?)?;
    m.add_function(wrap_pyfunction!(collective::run_collective, m)?)?;
    m.add_function(wrap_pyfunction!(splash::splash_mask_info, m)?)?;
    m.add_function(wrap_pyfunction!(splash::splash_default_blocks, m)?)?;
    m.add_class::<PyPlan>()?;
    m.add_class::<fusion::FusionGraph>()?;
    m.add_function(wrap_pyfunction!(fusion::fusion_cache_info, m)?)?;
    Ok(())
}

#[pymodule]
#[pyo3(name = "_native")]
fn native_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_module(m, tessera_kernels::library())
}

/// The CPU backend plans run on: `TESSERA_BACKEND` (`jit`, the default; `interp`; `llvm`
/// in builds with that feature).
fn backend() -> PyResult<&'static dyn Executor> {
    cpu_backend().map_err(PyValueError::new_err)
}

/// The CPU backend `TESSERA_BACKEND` names (`jit` by default); an error naming the variable
/// when it names none, or one this build lacks.
#[pyfunction]
fn cpu_backend_name() -> PyResult<&'static str> {
    Ok(backend()?.name())
}

/// [`backend`] without Python.
fn cpu_backend() -> Result<&'static dyn Executor, String> {
    use tessera_codegen::cpu::Backend;
    let backend = match std::env::var("TESSERA_BACKEND") {
        Err(_) => Backend::Jit,
        Ok(name) => Backend::parse(&name).ok_or_else(|| format!("tessera: TESSERA_BACKEND={name:?} is not a CPU backend; use jit, interp or llvm"))?,
    };
    if !backend.available() {
        return Err(format!("tessera: TESSERA_BACKEND={backend}: this build has no {backend} backend (build with the `llvm` feature), use jit or interp"));
    }
    Ok(backend.executor())
}

/// The generation whose blocks natively dispatched calls use (`tessera.set_target`).
static TARGET: std::sync::RwLock<Target> = std::sync::RwLock::new(Target::V6E);

fn current_target() -> Target {
    *TARGET.read().unwrap_or_else(|e| e.into_inner())
}

/// Sets the generation the natively dispatched CPU kernels plan for.
#[pyfunction]
fn set_target(name: &str) -> PyResult<()> {
    *TARGET.write().unwrap_or_else(|e| e.into_inner()) = target_named(name)?;
    Ok(())
}

/// Loads libtorch's stable-ABI shim for the CPU kernels ([`call_cpu`]): `libtorch_path` is
/// the running torch's `libtorch_cpu.so`, `version` its `(major, minor)`.
#[pyfunction]
fn init_cpu(libtorch_path: &str, version: (u64, u64)) -> PyResult<()> {
    if version < (2, 14) {
        return Err(PyRuntimeError::new_err(format!("tessera needs torch >= 2.14 (found {}.{})", version.0, version.1)));
    }
    dispatch::load(libtorch_path, version).map(|_| ()).map_err(PyRuntimeError::new_err)
}

/// The CPU kernel of op number `slot` (in [`op_table`] order) on the dispatcher's `args`
/// (schema order, trailing defaults dropped): tensors cross as libtorch handles
/// (`dispatch.rs`), results come back as new tensors, one or a tuple.
#[pyfunction]
fn call_cpu<'py>(py: Python<'py>, slot: usize, args: &Bound<'py, PyTuple>) -> PyResult<Bound<'py, PyAny>> {
    let shim = dispatch::SHIM.get().ok_or_else(|| PyRuntimeError::new_err("tessera: call_cpu before init_cpu"))?;
    let op = *table().get(slot).ok_or_else(|| PyValueError::new_err(format!("tessera: no op {slot} in this module")))?;
    let schema = op.parsed().map_err(py_err)?;
    let (mut tensors, mut statics) = (Vec::with_capacity(op.inputs.len()), Vec::new());
    for (i, p) in schema.params.iter().enumerate() {
        let arg = args.get_item(i).ok();
        if p.ty != ArgType::Tensor {
            if let Some(a) = arg {
                statics.push(static_of(&a)?);
            }
            continue;
        }
        let t = match arg {
            Some(a) if !a.is_none() => {
                // SAFETY: a live object; the GIL is held (`py`).
                let t = unsafe { dispatch::tensor_from_py(shim, a.as_ptr().cast()) };
                Some(t.map_err(|m| py_err(KernelError::new(op.name, format!("input `{}`", p.name), "operand-type", m, "pass a torch.Tensor")))?)
            }
            _ => None,
        };
        tensors.push(t);
    }
    let outs = dispatch::run_call(shim, op, &schema, tensors, statics).map_err(PyValueError::new_err)?;
    let mut objects = Vec::with_capacity(outs.len());
    for o in outs {
        let handle = o.into_aten().ok_or_else(|| PyRuntimeError::new_err("tessera: a result is not a libtorch tensor"))?;
        // SAFETY: the GIL is held; `tensor_to_py` returns a new, non-null reference, which
        // `from_owned_ptr` takes over.
        let obj = unsafe { dispatch::tensor_to_py(shim, &handle) }.map_err(PyRuntimeError::new_err)?;
        objects.push(unsafe { Bound::from_owned_ptr(py, obj.cast()) });
    }
    if objects.len() == 1 {
        Ok(objects.pop().expect("one result"))
    } else {
        Ok(PyTuple::new(py, objects)?.into_any())
    }
}

/// Registers this module's CPU kernels with the dispatcher natively (`dispatch.rs`):
/// `libtorch_path` is the running torch's `libtorch_cpu.so`, `version` its `(major,
/// minor)`. `False` when this torch is too old for it (the Python kernels stay).
#[pyfunction]
fn register_cpu_kernels(namespace: &str, libtorch_path: &str, version: (u64, u64)) -> PyResult<bool> {
    dispatch::register(namespace, libtorch_path, version).map_err(PyRuntimeError::new_err)
}
