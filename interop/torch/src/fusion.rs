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
