//! `tessera._native.FusionGraph`: the DeferAndFuse front-end's handle on a
//! [`tessera_kernels::fusion::Graph`]. The Python side records one node per deferred op
//! (a refusal is a `ValueError` whose text names the op, operand and rule: the op then
//! runs eagerly) and at a flush runs the cached [`Program`] over the graph inputs and the
//! live results' memory.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tessera_dsl::{DType, KernelError};
use tessera_kernels::fusion::{self, Binary, CmpOp, Graph, NodeId, Operand, RowOp, Unary};

use crate::tensor::{check_disjoint, TensorRef};
use crate::{backend, py_err, target_named};

fn dtype_named(s: &str) -> PyResult<DType> {
    match s {
        "float32" => Ok(DType::F32),
        "bfloat16" => Ok(DType::BF16),
        "bool" => Ok(DType::Bool),
        other => Err(py_err(KernelError::new("fusion", "dtype", "fusion-dtype", format!("a {other} tensor"), "float32, bfloat16 and bool tensors fuse; others run eagerly"))),
    }
}

fn operand(a: &Bound<'_, PyAny>) -> PyResult<Operand> {
    // A Python int is a node id; a float is a number (the Python side passes numbers as
    // floats).
    if a.is_instance_of::<pyo3::types::PyFloat>() {
        return Ok(Operand::Scalar(a.extract()?));
    }
    Ok(Operand::Node(a.extract::<usize>()?))
}

fn unknown(kind: &str, name: &str) -> PyErr {
    py_err(KernelError::new("fusion", format!("op `{name}`"), "fusion-op", format!("no {kind} op `{name}`"), "see tessera.fusion's op table"))
}

#[pyclass(module = "tessera._native")]
pub struct FusionGraph {
    graph: Graph,
}

#[pymethods]
impl FusionGraph {
    #[new]
    fn new() -> Self {
        FusionGraph { graph: Graph::new() }
    }

    fn __len__(&self) -> usize {
        self.graph.len()
    }

    /// A graph input: its node id.
    fn input(&mut self, dtype: &str, shape: Vec<usize>) -> PyResult<usize> {
        self.graph.input(dtype_named(dtype)?, &shape).map_err(py_err)
    }

    /// Records an op: `kind` (`unary`, `binary`, `compare`, `where`, `clamp`, `cast`, `row`,
    /// `view`, `expand`, `colsum`, `matmul`, `strided`, `cat`), its `name` and `args`; returns (node id, shape, dtype name).
    fn op(&mut self, kind: &str, name: &str, args: &Bound<'_, PyList>) -> PyResult<(usize, Vec<usize>, &'static str)> {
        let g = &mut self.graph;
        let arg = |i: usize| -> PyResult<Bound<'_, PyAny>> { args.get_item(i) };
        let node = |i: usize| -> PyResult<NodeId> { arg(i)?.extract::<usize>() };
        let id = match kind {
            "unary" => {
                let op = match name {
                    "neg" => Unary::Neg,
                    "abs" => Unary::Abs,
                    "exp" => Unary::Exp,
                    "log" => Unary::Log,
                    "tanh" => Unary::Tanh,
                    "sqrt" => Unary::Sqrt,
                    "rsqrt" => Unary::Rsqrt,
                    "erf" => Unary::Erf,
                    "sigmoid" => Unary::Sigmoid,
                    "relu" => Unary::Relu,
                    "silu" => Unary::Silu,
                    "gelu" => Unary::Gelu,
                    "reciprocal" => Unary::Reciprocal,
                    "sin" => Unary::Sin,
                    "cos" => Unary::Cos,
                    "log1p" => Unary::Log1p,
                    "expm1" => Unary::Expm1,
                    "floor" => Unary::Floor,
                    "ceil" => Unary::Ceil,
                    "round" => Unary::Round,
                    "sign" => Unary::Sign,
                    _ => return Err(unknown(kind, name)),
                };
                g.unary(op, node(0)?)
            }
            "binary" => {
                let op = match name {
                    "add" => Binary::Add,
                    "sub" => Binary::Sub,
                    "mul" => Binary::Mul,
                    "div" => Binary::Div,
                    "maximum" => Binary::Maximum,
                    "minimum" => Binary::Minimum,
                    "pow" => Binary::Pow,
                    _ => return Err(unknown(kind, name)),
                };
                g.binary(op, operand(&arg(0)?)?, operand(&arg(1)?)?)
            }
            "compare" => {
                let op = match name {
                    "eq" => CmpOp::Eq,
                    "ne" => CmpOp::Ne,
                    "lt" => CmpOp::Lt,
                    "le" => CmpOp::Le,
                    "gt" => CmpOp::Gt,
                    "ge" => CmpOp::Ge,
                    _ => return Err(unknown(kind, name)),
                };
                g.compare(op, operand(&arg(0)?)?, operand(&arg(1)?)?)
            }
            "where" => g.where_(node(0)?, operand(&arg(1)?)?, operand(&arg(2)?)?),
            "clamp" => g.clamp(node(0)?, arg(1)?.extract()?, arg(2)?.extract()?),
            "cast" => g.cast(node(0)?, dtype_named(&arg(1)?.extract::<String>()?)?),
            "row" => {
                let op = match name {
                    "sum" => RowOp::Sum,
                    "mean" => RowOp::Mean,
                    "amax" => RowOp::Amax,
                    "amin" => RowOp::Amin,
                    "softmax" => RowOp::Softmax,
                    "log_softmax" => RowOp::LogSoftmax,
                    _ => return Err(unknown(kind, name)),
                };
                g.row(op, node(0)?, arg(1)?.extract()?)
            }
            "view" => g.view(node(0)?, &arg(1)?.extract::<Vec<usize>>()?),
            "expand" => g.expand(node(0)?, &arg(1)?.extract::<Vec<usize>>()?),
            "colsum" => g.col_sum(node(0)?, arg(1)?.extract()?),
            // `[x, lo, hi, keepdim]`: a sum over the batches of a matmul, folded into it.
            "summatmul" => g.sum_matmul_batches(node(0)?, arg(1)?.extract()?, arg(2)?.extract()?, arg(3)?.extract()?),
            // `[a, b, bias or None]`: a transposed operand node is read in place.
            "matmul" => g.matmul(node(0)?, node(1)?, arg(2)?.extract::<Option<usize>>()?),
            // `[x, shape, strides, offset]`: a view of `x`'s (contiguous) memory.
            "strided" => g.strided(node(0)?, &arg(1)?.extract::<Vec<usize>>()?, &arg(2)?.extract::<Vec<usize>>()?, arg(3)?.extract()?),
            "cat" => g.cat_cols(&arg(0)?.extract::<Vec<usize>>()?),
            _ => return Err(unknown("kind of", kind)),
        }
        .map_err(py_err)?;
        let n = self.graph.node(id);
        Ok((id, n.shape.clone(), tessera_kernels::plan::dtype_to_torch(n.dtype)))
    }

    /// The node whose memory node `id` is (views followed).
    fn storage(&self, id: usize) -> PyResult<usize> {
        if id >= self.graph.len() {
            return Err(PyValueError::new_err(format!("tessera.fusion: no node {id}")));
        }
        Ok(self.graph.storage(id))
    }

    fn __str__(&self) -> String {
        self.graph.to_string()
    }

    /// The cached program for the results `live` on `target` (`cached=False`: built afresh,
    /// the cache and its counters untouched), and whether it was a cache hit; a program that
    /// cannot be built is a `ValueError` saying why.
    #[pyo3(signature = (live, target, cached=true))]
    fn program(&self, live: Vec<usize>, target: &str, cached: bool) -> PyResult<(FusionProgram, bool)> {
        let target = target_named(target)?;
        let (program, hit) = if cached { fusion::program(&self.graph, &live, &target) } else { (fusion::Program::build(&self.graph, &live, &target).map(std::sync::Arc::new), false) };
        let program = program.map_err(py_err)?;
        let key = fusion::key(&self.graph, &live, &target);
        let digest = format!("{:016x}{:08x}", fnv1a(key.as_bytes(), 0xcbf2_9ce4_8422_2325), fnv1a(key.as_bytes(), 0x6c62_272e_07bb_0142) as u32);
        let lowered = program.launches.iter().map(|_| std::sync::OnceLock::new()).collect();
        Ok((FusionProgram { program, digest, lowered }, hit))
    }

    /// Runs the graph for the results `live` (node ids, one per memory) writing
    /// `outputs[k]` (contiguous tensors; bool ones viewed as int8) from `inputs` (one per
    /// graph input, bool ones viewed as int8). `dump`: a file to write the graph, its
    /// partition, each kernel's IR and Mosaic to. Returns `{"hit", "kernels", "temps"}`;
    /// a program that cannot be built or run is a `ValueError` saying why.
    #[pyo3(signature = (live, inputs, outputs, target, dump=None))]
    fn run<'py>(&self, py: Python<'py>, live: Vec<usize>, inputs: &Bound<'py, PyList>, outputs: &Bound<'py, PyList>, target: &str, dump: Option<String>) -> PyResult<Bound<'py, PyDict>> {
        let target = target_named(target)?;
        let (program, hit) = fusion::program(&self.graph, &live, &target);
        if let Some(path) = &dump {
            let mut text = match &program {
                Ok(p) => p.describe(),
                Err(e) => format!("# graph (live {live:?})\n{}\n# not built: {e}\n", self.graph),
            };
            if let Ok(p) = &program {
                for l in &p.launches {
                    match tessera_codegen::mosaic::emit(&l.kernel, &target) {
                        Ok(m) => text.push_str(&format!("# mosaic of {} for {}\n{m}\n", l.kernel.name, target.name)),
                        Err(e) => text.push_str(&format!("# no mosaic for {}: {e}\n", l.kernel.name)),
                    }
                }
            }
            std::fs::write(path, text).map_err(|e| PyValueError::new_err(format!("tessera: TESSERA_DUMP_FUSION: cannot write {path}: {e}")))?;
        }
        let program = program.map_err(py_err)?;
        let refused = |what: &str, i: usize, r: crate::tensor::Refused| py_err(KernelError::new("fusion", format!("{what} {i}"), r.rule, r.message, r.help));
        let mut ins: Vec<Option<TensorRef<'py>>> = Vec::new();
        for (i, t) in inputs.iter().enumerate() {
            ins.push(Some(TensorRef::describe(&t, None).and_then(|d| d.borrow()).map_err(|r| refused("input", i, r))?));
        }
        let mut outs: Vec<Option<TensorRef<'py>>> = Vec::new();
        for (i, t) in outputs.iter().enumerate() {
            outs.push(Some(TensorRef::describe(&t, None).and_then(|d| d.borrow()).map_err(|r| refused("output", i, r))?));
        }
        check_disjoint(&ins, &outs).map_err(|r| refused("output", 0, r))?;
        let in_views: Vec<_> = ins.iter().flatten().map(TensorRef::host).collect();
        let mut out_views = Vec::new();
        for (i, o) in outs.iter_mut().flatten().enumerate() {
            out_views.push(o.host_mut().ok_or_else(|| py_err(KernelError::new("fusion", format!("output {i}"), "output-dtype", "this output cannot be written in place", "pass contiguous float32, bfloat16 or int8 tensors")))?);
        }
        let exec = backend()?;
        program.run_into(exec, &in_views, &mut out_views).map_err(py_err)?;
        let d = PyDict::new(py);
        d.set_item("hit", hit)?;
        d.set_item("kernels", program.launches.len())?;
        d.set_item("temps", program.temps.len())?;
        Ok(d)
    }
}

/// The program cache's counters.
#[pyfunction]
pub fn fusion_cache_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = fusion::cache_stats();
    let d = PyDict::new(py);
    d.set_item("hits", s.hits)?;
    d.set_item("misses", s.misses)?;
    d.set_item("entries", s.entries)?;
    d.set_item("capacity", s.capacity)?;
    Ok(d)
}

// ---- programs for a device's execution path ---------------------------------------------------

/// A built [`fusion::Program`] for the `tpu` device's path (`tessera._fusion_device`):
/// Python walks its launches, allocating temporaries on the device, and submits each
/// launch through a runner (`tessera._tpu`'s TorchTPU or emulator runner), which sees it
/// as it sees a library plan: `id`, `kernel_name(i)`, `module(i)`, `emulate(...)`.
#[pyclass(frozen, module = "tessera._native")]
pub struct FusionProgram {
    program: std::sync::Arc<fusion::Program>,
    /// A digest of the structural key (graph, live nodes, target): equal programs share it.
    digest: String,
    lowered: Vec<std::sync::OnceLock<Result<tessera_codegen::Lowered, String>>>,
}

fn buf_tuple(b: &fusion::Buf, shape: &[usize]) -> (&'static str, usize, Vec<usize>) {
    match *b {
        fusion::Buf::Input(i) => ("input", i, shape.to_vec()),
        fusion::Buf::Output(k) => ("output", k, shape.to_vec()),
        fusion::Buf::Temp(t) => ("temp", t, shape.to_vec()),
    }
}

fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    bytes.iter().fold(basis, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

impl FusionProgram {
    fn launch(&self, i: usize) -> PyResult<&fusion::Launch> {
        self.program.launches.get(i).ok_or_else(|| PyValueError::new_err(format!("tessera.fusion: launch {i} of {}", self.program.launches.len())))
    }

    fn lowered(&self, i: usize) -> PyResult<&tessera_codegen::Lowered> {
        let launch = self.launch(i)?;
        let target = self.program.target;
        self.lowered[i]
            .get_or_init(|| tessera_codegen::lower(&launch.kernel, &target).map_err(|e| format!("tessera.fusion: {} does not lower for {}: {e}", launch.kernel.name, target.name)))
            .as_ref()
            .map_err(|e| PyValueError::new_err(e.clone()))
    }
}

#[pymethods]
impl FusionProgram {
    /// The structural key's digest: the same graph, live nodes and target give the same id
    /// (so TorchTPU's module cache and registrations are shared by equal programs).
    #[getter]
    fn id(&self) -> String {
        self.digest.clone()
    }

    #[getter]
    fn target(&self) -> &'static str {
        self.program.target.name
    }

    fn __len__(&self) -> usize {
        self.program.launches.len()
    }

    /// Launch `i`'s kernel name, unique per program structure:
    /// `tessera.fusion.<digest>.fused<i>`.
    fn kernel_name(&self, i: usize) -> PyResult<String> {
        Ok(format!("tessera.fusion.{}.{}", self.digest, self.launch(i)?.kernel.name))
    }

    /// Launch `i`'s StableHLO module (holding its Mosaic `tpu_custom_call`), lowered once.
    fn module(&self, i: usize) -> PyResult<String> {
        Ok(self.lowered(i)?.stablehlo.clone())
    }

    /// Launch `i`'s cost estimate (`tessera_codegen`'s: `flops`, `transcendentals`,
    /// `bytes_accessed`, the HBM bytes its blocks move).
    fn cost<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyDict>> {
        let c = self.lowered(i)?.cost;
        let d = PyDict::new(py);
        d.set_item("flops", c.flops)?;
        d.set_item("transcendentals", c.transcendentals)?;
        d.set_item("bytes_accessed", c.bytes_accessed)?;
        Ok(d)
    }

    /// Launch `i`'s Mosaic text.
    fn mosaic(&self, i: usize) -> PyResult<String> {
        Ok(self.lowered(i)?.mosaic.clone())
    }

    /// Launch `i`'s operands as `(kind, index, shape)`: kind `input` (graph input),
    /// `output` (the caller's `live[index]`) or `temp` (a buffer of the run), each seen as
    /// the kernel's `[rows, cols]`.
    fn args(&self, i: usize) -> PyResult<Vec<(&'static str, usize, Vec<usize>)>> {
        Ok(self.launch(i)?.inputs.iter().map(|(b, s)| buf_tuple(b, s)).collect())
    }

    /// Launch `i`'s results, as [`FusionProgram::args`].
    fn outputs(&self, i: usize) -> PyResult<Vec<(&'static str, usize, Vec<usize>)>> {
        Ok(self.launch(i)?.outputs.iter().map(|(b, s)| buf_tuple(b, s)).collect())
    }

    /// The temporaries: `(dtype, elements)` each (bool as int8).
    #[getter]
    fn temps(&self) -> Vec<(&'static str, usize)> {
        self.program.temps.iter().map(|&(d, n)| (tessera_kernels::plan::dtype_to_torch(d), n)).collect()
    }

    /// The graph, its partition and each kernel's IR (what `TESSERA_DUMP_FUSION` writes).
    fn describe(&self) -> String {
        self.program.describe()
    }

    /// Runs launch `i`'s kernel on the CPU backend over `inputs` and `outputs` (contiguous
    /// tensors of its operand and result types, on the CPU or on `host_device`, the emulated
    /// `tpu`, whose memory is host memory).
    #[pyo3(signature = (i, inputs, outputs, host_device=None))]
    fn emulate(&self, i: usize, inputs: &Bound<'_, PyList>, outputs: &Bound<'_, PyList>, host_device: Option<&str>) -> PyResult<()> {
        let launch = self.launch(i)?;
        let ins = crate::tensor_refs("fusion", inputs, host_device)?;
        let outs = crate::tensor_refs("fusion", outputs, host_device)?;
        check_disjoint(&ins, &outs).map_err(|r| py_err(KernelError::new("fusion", "outputs", r.rule, r.message, r.help)))?;
        let ins: Vec<_> = ins.iter().flatten().map(TensorRef::host).collect();
        let mut outs: Vec<TensorRef<'_>> = outs.into_iter().flatten().collect();
        let mut outs = crate::outputs_of("fusion", &mut outs)?;
        backend()?.run_into(&launch.kernel, &ins, &mut outs).map(|_| ()).map_err(py_err)
    }
}
