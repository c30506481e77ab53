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

use tessera_dsl::interp::{self, Array, Data, HostData, HostDataMut, HostMut, HostRef};
use tessera_dsl::ir::RefKind;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_kernels::ragged_paged_attention;

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
    HeadMajor {
        hkv: usize,
        group: usize,
        padded_tokens: usize,
    },
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
        Operand {
            source,
            layout: Layout::View,
            ty,
        }
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
        let outputs = kernel
            .refs_of(RefKind::Output)
            .map(|(_, r)| Type::vector(r.dtype, &r.shape))
            .collect();
        Launch {
            kernel,
            args,
            outputs,
            module: OnceLock::new(),
        }
    }

    /// The StableHLO module (with the `tpu_custom_call`) TorchTPU compiles, lowered once.
    pub fn module(&self, target: &Target) -> Result<&str, String> {
        let lowered = self.module.get_or_init(|| {
            tessera_codegen::lower(&self.kernel, target)
                .map(|l| l.stablehlo)
                .map_err(|e| e.to_string())
        });
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
    pub fn new(
        op: &'static str,
        target: &Target,
        launches: Vec<Launch>,
        results: Vec<Operand>,
    ) -> Plan {
        Plan {
            op,
            target: *target,
            launches,
            results,
            host_reads: Vec::new(),
            host: None,
        }
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

/// Runs `plan` on the interpreter over borrowed memory: `inputs` are the op's tensor
/// inputs (`None` for an absent optional one), `outputs` the op's results (of the plan's
/// result types), written in full.
///
/// Inputs seen through a view are read in place (no copy); the last launch writes the
/// results it produces straight into `outputs`. Only intermediates (earlier launches'
/// outputs), relayouts and results that are not a last-launch output are owned copies.
pub fn execute_into(
    plan: &Plan,
    inputs: &[Option<HostRef<'_>>],
    outputs: &mut [HostMut<'_>],
) -> Result<(), KernelError> {
    let input = |i: usize| -> Result<HostRef<'_>, KernelError> {
        inputs.get(i).copied().flatten().ok_or_else(|| {
            KernelError::new(
                plan.op,
                format!("input {i}"),
                "missing-input",
                "the plan reads an input that was not given",
                "pass every tensor the op needs",
            )
        })
    };
    let values = plan
        .host_reads
        .iter()
        .map(|&i| input(i).map(to_array))
        .collect::<Result<Vec<_>, _>>()?;
    let host = plan.host_arrays(&values.iter().collect::<Vec<_>>())?;
    let last = plan.launches.len().saturating_sub(1);
    // results[l][j]: launch l's output j, unless the last launch wrote it into `outputs`.
    let mut results: Vec<Vec<Option<Array>>> = Vec::with_capacity(plan.launches.len());
    let mut direct = vec![false; plan.results.len()];
    for (l, launch) in plan.launches.iter().enumerate() {
        let mut targets: Vec<Option<usize>> = vec![None; launch.outputs.len()];
        if l == last {
            // The last launch's outputs that are results seen as-is go straight to `outputs`.
            for (r, res) in plan.results.iter().enumerate() {
                if let (Source::Result { launch, output }, Layout::View) = (res.source, res.layout)
                {
                    if launch == l
                        && targets[output].is_none()
                        && res.ty.dtype == outputs[r].data.dtype()
                        && res.ty.num_elements() == outputs[r].data.len()
                    {
                        targets[output] = Some(r);
                        direct[r] = true;
                    }
                }
            }
        }
        // The other outputs are owned, allocated poisoned (run_into poisons them anyway).
        let mut owned: Vec<Option<Array>> = launch
            .outputs
            .iter()
            .zip(&targets)
            .map(|(t, target)| target.is_none().then(|| Array::poison(t.dtype, &t.shape)))
            .collect();
        {
            let relaid: Vec<Option<Array>> = launch
                .args
                .iter()
                .map(|a| {
                    Ok(match a.layout {
                        Layout::View => None,
                        Layout::HeadMajor { .. } => Some(relayout(
                            plan.op,
                            &to_array(source(plan, a, &input, &host, &results)?),
                            a,
                        )?),
                    })
                })
                .collect::<Result<_, KernelError>>()?;
            let args = launch.args.iter().zip(&relaid).map(|(a, r)| match r {
                Some(array) => Ok(array.as_host()),
                None => source(plan, a, &input, &host, &results).map(|data| HostRef {
                    shape: &a.ty.shape,
                    data: data.data,
                }),
            });
            let args = args.collect::<Result<Vec<_>, KernelError>>()?;
            let mut by_result: Vec<Option<&mut HostMut<'_>>> =
                outputs.iter_mut().map(Some).collect();
            let mut views: Vec<HostMut<'_>> = Vec::with_capacity(launch.outputs.len());
            for ((ty, target), slot) in launch.outputs.iter().zip(&targets).zip(owned.iter_mut()) {
                let view = match (*target, slot.as_mut()) {
                    (Some(r), _) => HostMut {
                        shape: &ty.shape,
                        data: by_result[r]
                            .take()
                            .expect("one launch output per result")
                            .data
                            .reborrow_mut(),
                    },
                    (None, Some(array)) => array.as_host_mut(),
                    (None, None) => unreachable!("every launch output has a destination"),
                };
                views.push(view);
            }
            interp::run_into(&launch.kernel, &args, &mut views)?;
        }
        results.push(owned);
    }
    for (r, res) in plan.results.iter().enumerate() {
        if !direct[r] {
            let value = relayout(
                plan.op,
                &to_array(source(plan, res, &input, &host, &results)?),
                res,
            )?;
            copy_into(value.as_host().data, &mut outputs[r].data);
        }
    }
    Ok(())
}

/// The memory an operand's source holds (before its layout).
fn source<'a, 'b: 'a>(
    plan: &Plan,
    op: &Operand,
    input: &impl Fn(usize) -> Result<HostRef<'b>, KernelError>,
    host: &'a [Array],
    results: &'a [Vec<Option<Array>>],
) -> Result<HostRef<'a>, KernelError> {
    match op.source {
        Source::Input(i) => input(i),
        Source::Host(i) => Ok(host[i].as_host()),
        Source::Result { launch, output } => results[launch][output]
            .as_ref()
            .map(Array::as_host)
            .ok_or_else(|| {
                KernelError::new(
                    plan.op,
                    "plan",
                    "plan-order",
                    "an operand reads a result written straight to the op's outputs",
                    "report this as a Tessera bug",
                )
            }),
    }
}

/// An owned copy of borrowed memory.
pub fn to_array(h: HostRef<'_>) -> Array {
    let data = match h.data {
        HostData::F32(v) => Data::F32(v.to_vec()),
        HostData::BF16(v) => Data::BF16(v.to_vec()),
        HostData::I32(v) => Data::I32(v.to_vec()),
        HostData::I8(v) => Data::I8(v.to_vec()),
        HostData::Bool(v) => Data::Bool(v.to_vec()),
    };
    Array::new(h.shape, data)
}

/// Copies `src` into `dst` (same dtype and length, which plans guarantee).
pub fn copy_into(src: HostData<'_>, dst: &mut HostDataMut<'_>) {
    match (src, dst) {
        (HostData::F32(s), HostDataMut::F32(d)) => d.copy_from_slice(s),
        (HostData::BF16(s), HostDataMut::BF16(d)) => d.copy_from_slice(s),
        (HostData::I32(s), HostDataMut::I32(d)) => d.copy_from_slice(s),
        (HostData::I8(s), HostDataMut::I8(d)) => d.copy_from_slice(s),
        (HostData::Bool(s), HostDataMut::Bool(d)) => d.copy_from_slice(s),
        (s, d) => panic!(
            "plan result of {} copied into {} memory",
            s.dtype(),
            d.dtype()
        ),
    }
}

/// `array` in the operand's layout and shape.
fn relayout(op: &str, array: &Array, to: &Operand) -> Result<Array, KernelError> {
    if array.len() != to.ty.num_elements() && to.layout == Layout::View {
        return Err(KernelError::new(
            op,
            "operand",
            "operand-shape",
            format!("{} elements seen as {}", array.len(), to.ty),
            "report this as a Tessera bug",
        ));
    }
    match to.layout {
        Layout::View => Ok(Array {
            shape: to.ty.shape.clone(),
            ..array.clone()
        }),
        Layout::HeadMajor {
            hkv,
            group,
            padded_tokens,
        } => {
            // The op's own relayout (ragged paged attention's q and o).
            let d = *array.shape.last().unwrap_or(&1);
            let to_kernel = to.ty.shape.len() == 4;
            let t = if to_kernel {
                array.shape[0]
            } else {
                to.ty.shape[0]
            };
            Ok(ragged_paged_attention::relayout(
                array,
                t,
                hkv,
                group,
                padded_tokens,
                d,
                to_kernel,
            ))
        }
    }
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
