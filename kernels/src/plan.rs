//! A launch plan: what one call of an op runs, for concrete input types and static
//! arguments (built by the op's [`crate::op::Op::plan`]). Every way of running an op
//! executes the same plan:
//!
//! - on the CPU (the CLI, the tests, CPU tensors and the emulated host-memory `tpu`
//!   device), [`execute_into`] runs each launch's kernel on a CPU backend
//!   ([`tessera_dsl::Executor`]: the interpreter or a compiled emulator);
//! - the TorchTPU path submits each launch's StableHLO module (lowered once into
//!   [`Launch::module`] by `interop/torch`, since this crate does not depend on codegen)
//!   through `register_custom_kernel` / `call_custom_kernel`.
//!
//! A plan depends on types and static arguments only, so it is built once and cached, and
//! so are its host arrays ([`Plan::host`]: placeholders, constant tables, a window's band
//! metadata). No plan reads an input's *values* to prepare a call: what depends on them
//! (gmm's tile visits, MoE routing order, RoPE angles) is computed by kernels, so a call
//! on a device never waits for a read back to the host. Value checks
//! ([`Plan::with_check`]) run where the values already are (CPU tensors).

use std::sync::OnceLock;

use tessera_dsl::interp::{Array, Data, HostData, HostDataMut, HostMut, HostRef};
use tessera_dsl::ir::RefKind;
use tessera_dsl::{DType, Executor, Kernel, KernelError, Target, Type};

use crate::ragged_paged_attention;

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
    /// `[n, ...]` float rows with zero rows after them, to `rows` (an operand layout only:
    /// a bf16 gather source of odd `n`, whose DMAs move row pairs).
    PadRows {
        rows: usize,
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
    /// The launch's StableHLO module for the plan's target, lowered on first use by the
    /// TPU path (`interop/torch`); the error text if lowering failed.
    pub module: OnceLock<Result<String, String>>,
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
}

/// Checks the values of metadata inputs against the op's contract (lengths within the
/// page table, monotone offsets, labels in range...) before any kernel reads them.
pub type CheckFn = Box<dyn Fn(&[&Array]) -> Result<(), KernelError> + Send + Sync>;

/// Everything one op call runs.
pub struct Plan {
    pub op: &'static str,
    pub target: Target,
    pub launches: Vec<Launch>,
    /// The op's results.
    pub results: Vec<Operand>,
    /// Arrays built with the plan from types and statics alone, the same for every call
    /// (operands [`host`]`(i, ..)`): a device keeps them.
    pub host: Vec<Array>,
    /// The op inputs whose values [`Plan::check`] reads, in its argument order.
    pub check_reads: Vec<usize>,
    check: Option<CheckFn>,
    /// The input types the plan was built for and the inputs' names (set by
    /// [`crate::op::Op::plan_for`]; empty for a plan built by hand): [`execute_into`]
    /// checks what it is given against them.
    pub inputs: Vec<Option<Type>>,
    pub input_names: Vec<&'static str>,
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
            host: Vec::new(),
            check_reads: Vec::new(),
            check: None,
            inputs: Vec::new(),
            input_names: Vec::new(),
        }
    }

    /// How errors name op input `i`.
    fn input_subject(&self, i: usize) -> String {
        self.input_names.get(i).map_or_else(|| format!("tensor input {i}"), |n| format!("input `{n}`"))
    }

    /// The given inputs against the types the plan was built for: each array consistent
    /// with its own shape, and of the planned dtype and shape. A mismatch is the caller's
    /// (`argument-dtype` / `argument-shape` naming the input), caught before any read.
    fn check_given(&self, inputs: &[Option<HostRef<'_>>]) -> Result<(), KernelError> {
        for (i, given) in inputs.iter().enumerate() {
            let Some(h) = given else { continue };
            let subject = self.input_subject(i);
            crate::contract::check_array(self.op, &subject, h.data.dtype(), h.shape, h.data.dtype(), h.data.len())?;
            let Some(t) = self.inputs.get(i).and_then(Option::as_ref) else { continue };
            if t.dtype != h.data.dtype() || t.shape != h.shape {
                let rule = if t.dtype != h.data.dtype() { "argument-dtype" } else { "argument-shape" };
                return Err(KernelError::new(self.op, subject, rule, format!("the array is {}{:?}, the plan was built for {t}", h.data.dtype(), h.shape), "build the plan for the inputs' own types (Op::plan_for), or pass arrays of the planned types"));
            }
        }
        if !self.inputs.is_empty() {
            if let Some(i) = (0..self.inputs.len().max(inputs.len())).find(|&i| self.inputs.get(i).is_some_and(Option::is_some) != inputs.get(i).is_some_and(Option::is_some)) {
                let given = inputs.get(i).is_some_and(Option::is_some);
                return Err(KernelError::new(self.op, self.input_subject(i), if given { "input-count" } else { "missing-input" }, if given { "given, but the plan was built without it" } else { "the plan was built for this input, which is not given" }, "pass the inputs the plan was built for"));
            }
        }
        Ok(())
    }

    /// Sets the plan's host arrays (see [`Plan::host`]).
    pub fn with_host(mut self, arrays: Vec<Array>) -> Plan {
        self.host = arrays;
        self
    }

    /// Adds a check of the values of inputs `reads` (see [`CheckFn`]).
    pub fn with_check(mut self, reads: &[usize], check: CheckFn) -> Plan {
        self.check_reads = reads.to_vec();
        self.check = Some(check);
        self
    }

    /// Checks one call's metadata, from the values of the `check_reads` inputs.
    pub fn check(&self, values: &[&Array]) -> Result<(), KernelError> {
        match &self.check {
            Some(check) => check(values),
            None => Ok(()),
        }
    }
}

/// Runs `plan` with `exec` over borrowed memory: `inputs` are the op's tensor
/// inputs (`None` for an absent optional one), `outputs` the op's results (of the plan's
/// result types), written in full.
///
/// Inputs seen through a view are read in place (no copy); the last launch writes the
/// results it produces straight into `outputs`. Only intermediates (earlier launches'
/// outputs), relayouts and results that are not a last-launch output are owned copies.
pub fn execute_into(plan: &Plan, exec: &dyn Executor, inputs: &[Option<HostRef<'_>>], outputs: &mut [HostMut<'_>]) -> Result<(), KernelError> {
    if outputs.len() != plan.results.len() {
        return Err(bug(plan, format!("{} output buffers for {} results", outputs.len(), plan.results.len())));
    }
    for (r, (res, out)) in plan.results.iter().zip(outputs.iter()).enumerate() {
        if res.ty.dtype != out.data.dtype() || res.ty.num_elements() != out.data.len() {
            return Err(bug(plan, format!("result {r} is {} but its buffer holds {} {} elements", res.ty, out.data.len(), out.data.dtype())));
        }
    }
    plan.check_given(inputs)?;
    let input = |i: usize| -> Result<HostRef<'_>, KernelError> {
        inputs.get(i).copied().flatten().ok_or_else(|| KernelError::new(plan.op, plan.input_subject(i), "missing-input", "the plan reads an input that was not given", "pass every tensor the op needs"))
    };
    let copy = |i: usize| input(i).and_then(|h| try_to_array(plan.op, &plan.input_subject(i), h));
    let checked = plan.check_reads.iter().map(|&i| copy(i)).collect::<Result<Vec<_>, _>>()?;
    plan.check(&checked.iter().collect::<Vec<_>>())?;
    let host = &plan.host;
    let last = plan.launches.len().saturating_sub(1);
    // results[l][j]: launch l's output j, unless the last launch wrote it into `outputs`.
    let mut results: Vec<Vec<Option<Array>>> = Vec::with_capacity(plan.launches.len());
    let mut direct = vec![false; plan.results.len()];
    for (l, launch) in plan.launches.iter().enumerate() {
        let mut targets: Vec<Option<usize>> = vec![None; launch.outputs.len()];
        if l == last {
            // The last launch's outputs that are results seen as-is go straight to `outputs`.
            for (r, res) in plan.results.iter().enumerate() {
                if let (Source::Result { launch, output }, Layout::View) = (res.source, res.layout) {
                    if launch == l && output < targets.len() && targets[output].is_none() && launch_output_fits(&launch_output(plan, l, output), res) {
                        targets[output] = Some(r);
                        direct[r] = true;
                    }
                }
            }
        }
        // The other outputs are owned, allocated poisoned (run_into poisons them anyway).
        let mut owned: Vec<Option<Array>> = launch.outputs.iter().zip(&targets).map(|(t, target)| target.is_none().then(|| try_poison(plan.op, &format!("an intermediate of kernel `{}`", launch.kernel.name), t)).transpose()).collect::<Result<_, _>>()?;
        {
            let relaid: Vec<Option<Array>> = launch
                .args
                .iter()
                .map(|a| {
                    Ok(match a.layout {
                        Layout::View => None,
                        Layout::HeadMajor { .. } | Layout::PadRows { .. } => Some(relayout(plan.op, &try_to_array(plan.op, "an operand", source(plan, a, &input, &host, &results)?)?, a)?),
                    })
                })
                .collect::<Result<_, KernelError>>()?;
            let args = launch.args.iter().zip(&relaid).map(|(a, r)| match r {
                Some(array) => Ok(array.as_host()),
                None => source(plan, a, &input, &host, &results).and_then(|data| {
                    if data.data.len() != a.ty.num_elements() || data.data.dtype() != a.ty.dtype {
                        return Err(bug(plan, format!("an operand of {} {} elements is seen as {}", data.data.len(), data.data.dtype(), a.ty)));
                    }
                    Ok(HostRef { shape: &a.ty.shape, data: data.data })
                }),
            });
            let args = args.collect::<Result<Vec<_>, KernelError>>()?;
            let mut by_result: Vec<Option<&mut HostMut<'_>>> = outputs.iter_mut().map(Some).collect();
            let mut views: Vec<HostMut<'_>> = Vec::with_capacity(launch.outputs.len());
            for ((ty, target), slot) in launch.outputs.iter().zip(&targets).zip(owned.iter_mut()) {
                let view = match (*target, slot.as_mut()) {
                    (Some(r), _) => HostMut { shape: &ty.shape, data: by_result[r].take().ok_or_else(|| bug(plan, "one result written twice"))?.data.reborrow_mut() },
                    (None, Some(array)) => array.as_host_mut(),
                    (None, None) => return Err(bug(plan, "a launch output has no destination")),
                };
                views.push(view);
            }
            exec.run_into(&launch.kernel, &args, &mut views)?;
        }
        results.push(owned);
    }
    for (r, res) in plan.results.iter().enumerate() {
        if !direct[r] {
            let value = relayout(plan.op, &try_to_array(plan.op, "a result", source(plan, res, &input, &host, &results)?)?, res)?;
            copy_into(value.as_host().data, &mut outputs[r].data).map_err(|m| bug(plan, m))?;
        }
    }
    Ok(())
}

/// Runs `plan` with `exec` on `inputs` (`None` for an absent optional tensor) and returns
/// the results, allocated here.
pub fn execute(plan: &Plan, exec: &dyn Executor, inputs: &[Option<&Array>]) -> Result<Vec<Array>, KernelError> {
    for (i, a) in inputs.iter().enumerate() {
        if let Some(a) = a {
            crate::contract::check_array(plan.op, &plan.input_subject(i), a.dtype, &a.shape, a.data.dtype(), a.data.len())?;
        }
    }
    let mut outputs: Vec<Array> = plan.results.iter().enumerate().map(|(r, res)| try_poison(plan.op, &format!("result {r}"), &res.ty)).collect::<Result<_, _>>()?;
    let ins: Vec<Option<HostRef<'_>>> = inputs.iter().map(|a| a.map(Array::as_host)).collect();
    let mut views: Vec<HostMut<'_>> = outputs.iter_mut().map(Array::as_host_mut).collect();
    execute_into(plan, exec, &ins, &mut views)?;
    drop(views);
    Ok(outputs)
}

/// An inconsistent plan: a bug in an op's plan builder, not in the caller's input.
fn bug(plan: &Plan, message: impl Into<String>) -> KernelError {
    KernelError::new(plan.op, "plan", "plan-consistency", message, "report this as a Tessera bug")
}

fn launch_output(plan: &Plan, launch: usize, output: usize) -> Type {
    plan.launches[launch].outputs[output].clone()
}

/// Whether a launch output can be written straight into a result's buffer.
fn launch_output_fits(out: &Type, res: &Operand) -> bool {
    out.dtype == res.ty.dtype && out.num_elements() == res.ty.num_elements()
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
        Source::Host(i) => host.get(i).map(Array::as_host).ok_or_else(|| bug(plan, format!("host array {i} of {}", host.len()))),
        Source::Result { launch, output } => match results.get(launch).and_then(|r| r.get(output)) {
            Some(Some(a)) => Ok(a.as_host()),
            Some(None) => Err(bug(plan, "an operand reads a result written straight to the op's outputs")),
            None => Err(bug(plan, format!("an operand reads output {output} of launch {launch}, which has not run"))),
        },
    }
}

/// An owned copy of borrowed memory.
///
/// # Panics
/// If `h`'s data does not have one element per index of its shape; see [`try_to_array`].
pub fn to_array(h: HostRef<'_>) -> Array {
    let data = match h.data {
        HostData::F32(v) => Data::F32(v.to_vec()),
        HostData::BF16(v) => Data::BF16(v.to_vec()),
        HostData::I32(v) => Data::I32(v.to_vec()),
        HostData::I8(v) => Data::I8(v.to_vec()),
        HostData::Bool(v) => Data::Bool(v.to_vec()),
        HostData::F8E4M3FN(v) => Data::F8E4M3FN(v.to_vec()),
        HostData::F8E5M2(v) => Data::F8E5M2(v.to_vec()),
    };
    Array::new(h.shape, data)
}

/// [`to_array`] without panics: an inconsistent `h` is an `argument-shape` error and a
/// failed allocation a `host-allocation` error, both naming `what` of op `op`.
pub fn try_to_array(op: &str, what: &str, h: HostRef<'_>) -> Result<Array, KernelError> {
    let dtype = h.data.dtype();
    crate::contract::check_array(op, what, dtype, h.shape, dtype, h.data.len())?;
    fn copy<T: Copy>(op: &str, what: &str, v: &[T], dtype: DType) -> Result<Vec<T>, KernelError> {
        let mut out = try_vec(op, what, v.len(), dtype)?;
        out.extend_from_slice(v);
        Ok(out)
    }
    let data = match h.data {
        HostData::F32(v) => Data::F32(copy(op, what, v, dtype)?),
        HostData::BF16(v) => Data::BF16(copy(op, what, v, dtype)?),
        HostData::I32(v) => Data::I32(copy(op, what, v, dtype)?),
        HostData::I8(v) => Data::I8(copy(op, what, v, dtype)?),
        HostData::Bool(v) => Data::Bool(copy(op, what, v, dtype)?),
        HostData::F8E4M3FN(v) => Data::F8E4M3FN(copy(op, what, v, dtype)?),
        HostData::F8E5M2(v) => Data::F8E5M2(copy(op, what, v, dtype)?),
    };
    Ok(Array { dtype, shape: h.shape.to_vec(), data })
}

/// An empty vector with room for `n` elements of `dtype`, or a `host-allocation` error
/// naming `what` and the bytes (an allocation failure must not abort the process).
pub fn try_vec<T>(op: &str, what: &str, n: usize, dtype: DType) -> Result<Vec<T>, KernelError> {
    let mut v = Vec::new();
    match v.try_reserve_exact(n) {
        Ok(()) => Ok(v),
        Err(_) => Err(alloc_error(op, what, n.checked_mul(dtype.bytes()))),
    }
}

/// The error of a host allocation of `bytes` (`None`: more than a 64-bit count) for `what`.
pub fn alloc_error(op: &str, what: &str, bytes: Option<usize>) -> KernelError {
    let size = bytes.map_or_else(|| "more bytes than a 64-bit count holds".to_string(), |b| format!("{b} bytes ({:.2} GiB)", b as f64 / (1u64 << 30) as f64));
    KernelError::new(op, what, "host-allocation", format!("cannot allocate {size} of host memory"), "use smaller shapes, or free memory")
}

/// An array of `ty` filled with the interpreter's poison (NaN, `MIN`, `false`), allocated
/// fallibly (see [`try_vec`]).
pub fn try_poison(op: &str, what: &str, ty: &Type) -> Result<Array, KernelError> {
    let n = crate::contract::counts(ty.dtype, &ty.shape).ok_or_else(|| alloc_error(op, what, None))?.0;
    fn filled<T: Clone>(op: &str, what: &str, n: usize, dtype: DType, v: T) -> Result<Vec<T>, KernelError> {
        let mut out = try_vec(op, what, n, dtype)?;
        out.resize(n, v);
        Ok(out)
    }
    let data = match ty.dtype {
        DType::F32 => Data::F32(filled(op, what, n, ty.dtype, f32::NAN)?),
        DType::BF16 => Data::BF16(filled(op, what, n, ty.dtype, half::bf16::from_f32(f32::NAN))?),
        DType::I32 => Data::I32(filled(op, what, n, ty.dtype, i32::MIN)?),
        DType::I8 => Data::I8(filled(op, what, n, ty.dtype, i8::MIN)?),
        DType::Bool => Data::Bool(filled(op, what, n, ty.dtype, false)?),
        DType::F8E4M3FN => Data::F8E4M3FN(filled(op, what, n, ty.dtype, tessera_dsl::fp8::F8E4M3::from_bits(0x7f))?),
        DType::F8E5M2 => Data::F8E5M2(filled(op, what, n, ty.dtype, tessera_dsl::fp8::F8E5M2::from_bits(0x7f))?),
    };
    Ok(Array { dtype: ty.dtype, shape: ty.shape.clone(), data })
}

/// Copies `src` into `dst`; an error if their dtypes or lengths differ.
pub fn copy_into(src: HostData<'_>, dst: &mut HostDataMut<'_>) -> Result<(), String> {
    if src.len() != dst.len() {
        return Err(format!("copying {} elements into {}", src.len(), dst.len()));
    }
    match (src, dst) {
        (HostData::F32(s), HostDataMut::F32(d)) => d.copy_from_slice(s),
        (HostData::BF16(s), HostDataMut::BF16(d)) => d.copy_from_slice(s),
        (HostData::I32(s), HostDataMut::I32(d)) => d.copy_from_slice(s),
        (HostData::I8(s), HostDataMut::I8(d)) => d.copy_from_slice(s),
        (HostData::Bool(s), HostDataMut::Bool(d)) => d.copy_from_slice(s),
        (HostData::F8E4M3FN(s), HostDataMut::F8E4M3FN(d)) => d.copy_from_slice(s),
        (HostData::F8E5M2(s), HostDataMut::F8E5M2(d)) => d.copy_from_slice(s),
        (s, d) => return Err(format!("copying {} data into {} memory", s.dtype(), d.dtype())),
    }
    Ok(())
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
        Layout::PadRows { rows } => {
            let row: usize = array.shape.iter().skip(1).product();
            let extra = rows.saturating_sub(array.shape.first().copied().unwrap_or(0)) * row;
            let data = match &array.data {
                Data::F32(v) => Data::F32(v.iter().copied().chain(std::iter::repeat_n(0.0, extra)).collect()),
                Data::BF16(v) => Data::BF16(v.iter().copied().chain(std::iter::repeat_n(half::bf16::ZERO, extra)).collect()),
                other => return Err(KernelError::new(op, "operand", "plan-consistency", format!("rows of {} padded", other.dtype()), "report this as a Tessera bug")),
            };
            Ok(Array::new(&to.ty.shape, data))
        }
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

/// The element type torch calls `name` (`float32`, `bfloat16`, `int32`, `int8`, `bool`,
/// `float8_e4m3fn`, `float8_e5m2`).
pub fn dtype_from_torch(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_to_torch(d) == name)
}

/// The torch name of `dtype`.
pub fn dtype_to_torch(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::I32 => "int32",
        DType::I8 => "int8",
        DType::Bool => "bool",
        DType::F8E4M3FN => "float8_e4m3fn",
        DType::F8E5M2 => "float8_e5m2",
    }
}

// ---- building plans -------------------------------------------------------------------------

/// The `i`-th host-prepared array seen as `ty`.
pub fn host(i: usize, ty: Type) -> Operand {
    Operand::view(Source::Host(i), ty)
}

/// Output `output` of launch `launch` seen as `ty`.
pub fn result(launch: usize, output: usize, ty: Type) -> Operand {
    Operand::view(Source::Result { launch, output }, ty)
}

/// A plan of one kernel whose results are its outputs, each seen with `shapes[j]`
/// (`None` or missing: as the kernel writes it).
pub fn single(c: &crate::op::Call, kernel: Kernel, args: Vec<Operand>, shapes: &[Option<Vec<usize>>]) -> Plan {
    let launch = Launch::new(kernel, args);
    let results = launch
        .outputs
        .iter()
        .enumerate()
        .map(|(j, t)| {
            let shape = shapes.get(j).cloned().flatten().unwrap_or_else(|| t.shape.clone());
            result(0, j, Type::vector(t.dtype, &shape))
        })
        .collect();
    Plan::new(c.op, c.target, vec![launch], results)
}
