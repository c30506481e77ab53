//! A launch plan: what one call of a torch op runs, for concrete input types and static
//! arguments. Both backends execute the same plan:
//!
//! - the emulator (CPU tensors, and the emulated host-memory `tpu` device) runs each
//!   launch's kernel on the interpreter ([`execute`]);
//! - the TorchTPU path submits each launch's StableHLO module ([`Launch::module`]) through
//!   `register_custom_kernel` / `call_custom_kernel` (the Python side walks the plan).
//!
//! A plan depends on types and static arguments only, so it is built once and cached. The
//! few ops whose host-side preparation reads input *values* (gmm's group metadata, MoE
//! routing, RoPE tables) get those arrays per call from [`Plan::host_arrays`].

use std::sync::OnceLock;

use tessera_dsl::interp::{self, Array, Data};
use tessera_dsl::ir::RefKind;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};

/// Where a kernel operand or an op result comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The op's `i`-th tensor input.
    Input(usize),
    /// The `i`-th array the host side prepared for this call.
    Host(usize),
    /// Output `output` of launch `launch`.
    Result { launch: usize, output: usize },
}

/// How the source's elements are laid out for their consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The same row-major elements seen with another shape (free for contiguous memory).
    View,
    /// Token-major `[T, Hkv * G, D]` to head-major `[Hkv, G, Tp, D]`, the tokens
    /// zero-padded to `Tp` (ragged paged attention's q); as a result layout, the inverse
    /// (padding rows dropped).
    HeadMajor { hkv: usize, group: usize, padded_tokens: usize },
}

/// A value with its layout and the type its consumer sees.
#[derive(Clone, Debug)]
pub struct Operand {
    pub source: Source,
    pub layout: Layout,
    pub ty: Type,
}

impl Operand {
    pub fn view(source: Source, ty: Type) -> Operand {
        Operand { source, layout: Layout::View, ty }
    }
}

/// One kernel launch.
pub struct Launch {
    pub kernel: Kernel,
    /// The kernel's prefetch and input operands, in signature order.
    pub args: Vec<Operand>,
    /// The kernel's output types, in signature order.
    pub outputs: Vec<Type>,
    module: OnceLock<Result<String, String>>,
}

impl Launch {
    pub fn new(kernel: Kernel, args: Vec<Operand>) -> Launch {
        let outputs = kernel.refs_of(RefKind::Output).map(|(_, r)| Type::vector(r.dtype, &r.shape)).collect();
        Launch { kernel, args, outputs, module: OnceLock::new() }
    }

    /// The StableHLO module (with the `tpu_custom_call`) TorchTPU compiles, lowered once.
    pub fn module(&self, target: &Target) -> Result<&str, String> {
        let lowered = self.module.get_or_init(|| tessera_codegen::lower(&self.kernel, target).map(|l| l.stablehlo).map_err(|e| e.to_string()));
        lowered.as_deref().map_err(Clone::clone)
    }
}

/// Prepares the per-call host arrays from the values of the op's host-read inputs.
pub type HostFn = Box<dyn Fn(&[&Array]) -> Result<Vec<Array>, KernelError> + Send + Sync>;

/// Everything one op call runs.
pub struct Plan {
    pub op: &'static str,
    pub target: Target,
    pub launches: Vec<Launch>,
    /// The op's results.
    pub results: Vec<Operand>,
    /// The op inputs whose values [`Plan::host_arrays`] reads, in its argument order.
    pub host_reads: Vec<usize>,
    host: Option<HostFn>,
}

impl Plan {
    pub fn new(op: &'static str, target: &Target, launches: Vec<Launch>, results: Vec<Operand>) -> Plan {
        Plan { op, target: *target, launches, results, host_reads: Vec::new(), host: None }
    }

    /// Adds host-side preparation reading the values of inputs `reads`.
    pub fn with_host(mut self, reads: &[usize], host: HostFn) -> Plan {
        self.host_reads = reads.to_vec();
        self.host = Some(host);
        self
    }

    /// The host arrays for one call, from the values of the `host_reads` inputs.
    pub fn host_arrays(&self, values: &[&Array]) -> Result<Vec<Array>, KernelError> {
        match &self.host {
            Some(host) => host(values),
            None => Ok(Vec::new()),
        }
    }
}

/// Runs `plan` on the interpreter: `inputs` are the op's tensor inputs (`None` for an
/// absent optional one); returns the op's results.
pub fn execute(plan: &Plan, inputs: &[Option<Array>]) -> Result<Vec<Array>, KernelError> {
    let input = |i: usize| -> Result<&Array, KernelError> {
        inputs.get(i).and_then(Option::as_ref).ok_or_else(|| KernelError::new(plan.op, format!("input {i}"), "missing-input", "the plan reads an input that was not given", "pass every tensor the op needs"))
    };
    let values = plan.host_reads.iter().map(|&i| input(i)).collect::<Result<Vec<_>, _>>()?;
    let host = plan.host_arrays(&values)?;
    let mut results: Vec<Vec<Array>> = Vec::with_capacity(plan.launches.len());
    let fetch = |op: &Operand, results: &[Vec<Array>]| -> Result<Array, KernelError> {
        let array = match op.source {
            Source::Input(i) => input(i)?,
            Source::Host(i) => &host[i],
            Source::Result { launch, output } => &results[launch][output],
        };
        relayout(plan.op, array, op)
    };
    for launch in &plan.launches {
        let args = launch.args.iter().map(|a| fetch(a, &results)).collect::<Result<Vec<_>, _>>()?;
        results.push(interp::run(&launch.kernel, &args.iter().collect::<Vec<_>>())?);
    }
    plan.results.iter().map(|r| fetch(r, &results)).collect()
}

/// `array` in the operand's layout and shape.
fn relayout(op: &str, array: &Array, to: &Operand) -> Result<Array, KernelError> {
    if array.len() != to.ty.num_elements() && to.layout == Layout::View {
        return Err(KernelError::new(op, "operand", "operand-shape", format!("{} elements seen as {}", array.len(), to.ty), "report this as a Tessera bug"));
    }
    match to.layout {
        Layout::View => Ok(Array { shape: to.ty.shape.clone(), ..array.clone() }),
        Layout::HeadMajor { hkv, group, padded_tokens } => {
            let d = *array.shape.last().unwrap_or(&1);
            let to_kernel = to.ty.shape.len() == 4;
            let t = if to_kernel { array.shape[0] } else { to.ty.shape[0] };
            let shape = &to.ty.shape;
            let data = match &array.data {
                Data::F32(x) => Data::F32(head_major(x, t, hkv * group, padded_tokens, d, to_kernel)),
                Data::BF16(x) => Data::BF16(head_major(x, t, hkv * group, padded_tokens, d, to_kernel)),
                Data::I32(x) => Data::I32(head_major(x, t, hkv * group, padded_tokens, d, to_kernel)),
                Data::I8(x) => Data::I8(head_major(x, t, hkv * group, padded_tokens, d, to_kernel)),
                Data::Bool(x) => Data::Bool(head_major(x, t, hkv * group, padded_tokens, d, to_kernel)),
            };
            Ok(Array::new(shape, data))
        }
    }
}

/// `[t, heads, d]` <-> `[heads, tp, d]` (tokens zero-padded to `tp` one way, dropped back).
fn head_major<T: Copy + Default>(x: &[T], t: usize, heads: usize, tp: usize, d: usize, to_kernel: bool) -> Vec<T> {
    let mut out = vec![T::default(); if to_kernel { heads * tp * d } else { t * heads * d }];
    for tok in 0..t {
        for head in 0..heads {
            let token_major = (tok * heads + head) * d;
            let head_major = (head * tp + tok) * d;
            let (src, dst) = if to_kernel { (token_major, head_major) } else { (head_major, token_major) };
            out[dst..dst + d].copy_from_slice(&x[src..src + d]);
        }
    }
    out
}

/// The element type torch calls `name` (`float32`, `bfloat16`, `int32`, `int8`, `bool`).
pub fn dtype_from_torch(name: &str) -> Option<DType> {
    match name {
        "float32" => Some(DType::F32),
        "bfloat16" => Some(DType::BF16),
        "int32" => Some(DType::I32),
        "int8" => Some(DType::I8),
        "bool" => Some(DType::Bool),
        _ => None,
    }
}

/// The torch name of `dtype`.
pub fn dtype_to_torch(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::I32 => "int32",
        DType::I8 => "int8",
        DType::Bool => "bool",
    }
}
