//! The op table's types: one [`Op`] per library op, declared once and read by everything
//! that needs to know the op — the CLI (`list`, `run`, `emit`, `check`, `table`), the
//! torch package (schema, CPU and `tpu` kernels, fake shapes, autograd), the tests and the
//! docs tables.
//!
//! An op is
//!
//! - a **schema** in torch's schema language (`(Tensor x, Tensor weight, float eps=1e-06)
//!   -> Tensor`): the tensor inputs, the static arguments with their defaults, the results;
//! - its **inputs** (what each tensor holds and its symbolic dims) and **outputs** (a
//!   shape expression and a dtype, from which the fake / meta kernel is derived, see
//!   [`eval_shape`]);
//! - a **plan builder** ([`Call`] -> [`Plan`]): the kernel launches of one call and where
//!   each operand comes from, for concrete input types and statics;
//! - optionally its **backward** ([`Backward`]: another op of the table and how its
//!   arguments and results map to the forward's), its **cases** (named statics and shapes
//!   the CLI and the tests run), random inputs that satisfy its contract, and an
//!   independent f64 **reference**.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock, RwLock};

use rand::rngs::StdRng;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Executor, KernelError, Target, Type};

use crate::plan::{Operand, Plan, Source};

// ---- the table entry ----------------------------------------------------------------------

/// What a tensor input holds, for building types from shapes (`emit`, `check`) and for
/// default random inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Floating point data of the run's dtype (f32 or bf16).
    Float,
    /// int32 data (group sizes, ids, labels, lengths...).
    Int32,
    /// int8 data (quantized weights).
    Int8,
    /// f32 whatever the run's dtype (scales, statistics).
    Float32,
    /// Any float dtype, the fp8 storage types included (`float8_e4m3fn`, `float8_e5m2`):
    /// for ops whose kernels convert their inputs to f32 themselves (user ops; the library's
    /// take [`Kind::Float`]).
    AnyFloat,
    /// A KV cache's stored values: the run's float dtype, or a quantized cache's int8,
    /// `float8_e4m3fn` or `float8_e5m2` (dequantised by the kernel with its scales).
    KvCache,
}

impl Kind {
    /// The element type of such an input in a run whose float dtype is `float`.
    pub fn dtype(self, float: DType) -> DType {
        match self {
            Kind::Float | Kind::AnyFloat | Kind::KvCache => float,
            Kind::Int32 => DType::I32,
            Kind::Int8 => DType::I8,
            Kind::Float32 => DType::F32,
        }
    }
}

/// A tensor input: its name (as in the schema), symbolic dims and contents. Both are a
/// contract checked for every call before the plan builder runs ([`crate::contract`]):
/// the dtype by `kind`, the rank and sizes by `dims`.
#[derive(Clone, Copy, Debug)]
pub struct Input {
    pub name: &'static str,
    /// `[item, ...]`: names shared across inputs (`[m, k]`, `[k, n]`), integers, leading
    /// `...`, expressions (`t*k`, `s + 1`), `flag ? a : b` on a bool static, optional
    /// dims such as `1?` (grammar in [`crate::contract`]).
    pub dims: &'static str,
    pub kind: Kind,
}

/// A result: its name, shape expression and dtype (see [`eval_shape`] / [`eval_dtype`]).
#[derive(Clone, Copy, Debug)]
pub struct Output {
    pub name: &'static str,
    /// `x` (x's shape), `x | y` (x's shape, y's when optional x is not given), or
    /// `[item, ...]` with items `*x` (all of x's dims), `*x[a:b]`,
    /// `x.i` (dim i, negative from the end), an integer static's name, an integer,
    /// products `a * b`, a quotient by an integer `a / 128` (rounded down) and `flag ? a : b`
    /// on a bool static.
    pub shape: &'static str,
    /// A tensor input's name (its dtype) or a dtype name (`f32`, `i32`, ...).
    pub dtype: &'static str,
}

/// [`Backward::op`] of an op whose gradient is a torch composite of other ops, written in
/// the torch package (`tessera/_autograd.py`), not a kernel of its own.
pub const COMPOSITE: &str = "composite";

/// How an op's gradient is computed: by another op of the table.
#[derive(Clone, Copy, Debug)]
pub struct Backward {
    /// The backward op's name.
    pub op: &'static str,
    /// Its arguments in order, comma-separated: names of the forward's inputs, outputs or
    /// statics, or `d_<output>` for the gradient flowing into a forward output (zeros when
    /// nothing flows).
    pub args: &'static str,
    /// For each result of the backward op, the forward input(s) it is the gradient of,
    /// space-separated when one result is the gradient of several inputs.
    pub grads: &'static [&'static str],
}

/// A named configuration the CLI and the tests run: statics (`name=value, ...`, parsed
/// against the schema; the rest keep their defaults) and one shape per tensor input
/// (trailing optional tensors may be left out).
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub name: &'static str,
    pub statics: &'static str,
    pub shapes: &'static [&'static [usize]],
}

/// Random inputs that satisfy the op's contract, for shapes, a float dtype and statics.
pub type RandomFn = fn(&[Vec<usize>], DType, &Statics, &mut StdRng) -> Vec<Array>;
/// The independent f64 reference: one vector per result.
pub type ReferenceFn = fn(&[Array], &Statics) -> Vec<Vec<f64>>;
/// The plan builder.
pub type PlanFn = fn(&Call) -> Result<Plan, KernelError>;

/// One op of the table. See the module docs.
#[derive(Clone, Copy)]
pub struct Op {
    pub name: &'static str,
    pub doc: &'static str,
    /// The torch schema after the name.
    pub schema: &'static str,
    /// The tensor inputs, in schema order.
    pub inputs: &'static [Input],
    pub outputs: &'static [Output],
    pub plan: PlanFn,
    pub backward: Option<Backward>,
    /// The first case is the op's default (what `emit` and `check` lower).
    pub cases: &'static [Case],
    /// `None`: uniform floats in [-1, 1) and small non-negative ints.
    pub random: Option<RandomFn>,
    pub reference: Option<ReferenceFn>,
    /// An op that is result `.1` of op `.0` under the same schema (its plan is that op's):
    /// `flash_attention` is `flash_attention_fwd`'s `o`.
    pub alias_of: Option<(&'static str, usize)>,
    /// An alias's own plan, which computes only its result (`flash_attention` skips the
    /// lse its `o` does not need). `None`: the aliased op's plan, the other results
    /// dropped. Gradients flow through the aliased op either way.
    pub alias_plan: Option<PlanFn>,
    /// The block statics `tessera tune` varies, with the values to try (empty: nothing to
    /// tune, the blocks follow from the shapes). Each names an `int` static of the schema.
    pub knobs: &'static [crate::tune::Knob],
}

impl Op {
    /// An op with nothing but a name; fill the rest with struct-update syntax
    /// (`Op { name, schema, plan, ..Op::EMPTY }`).
    pub const EMPTY: Op = Op {
        name: "",
        doc: "",
        schema: "() -> Tensor",
        inputs: &[],
        outputs: &[],
        plan: no_plan,
        backward: None,
        cases: &[],
        random: None,
        reference: None,
        alias_of: None,
        alias_plan: None,
        knobs: &[],
    };

    /// The parsed schema (parsed once per op name and cached).
    pub fn parsed(&self) -> Result<Arc<Schema>, KernelError> {
        type Cache = RwLock<HashMap<(&'static str, &'static str), Arc<Schema>>>;
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let key = (self.name, self.schema);
        if let Some(s) = cache.read().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(s.clone());
        }
        let schema = Arc::new(Schema::parse(self.schema).map_err(|m| KernelError::new(self.name, "schema", "op-schema", m, "fix the op's schema string"))?);
        cache.write().unwrap_or_else(|e| e.into_inner()).insert(key, schema.clone());
        Ok(schema)
    }

    /// The statics of case `case` (the schema defaults, overridden by the case's).
    pub fn case_statics(&self, case: &Case) -> Result<Statics, KernelError> {
        Statics::parse(&*self.parsed()?, case.statics).map_err(|m| KernelError::new(self.name, format!("case `{}`", case.name), "op-case", m, "fix the case's statics"))
    }

    /// The case called `name`.
    pub fn case(&self, name: &str) -> Option<&'static Case> {
        self.cases.iter().find(|c| c.name == name)
    }

    /// The input types of `shapes` with floats of `dtype`.
    pub fn types(&self, shapes: &[Vec<usize>], dtype: DType) -> Vec<Option<Type>> {
        let mut types: Vec<Option<Type>> = self.inputs.iter().zip(shapes).map(|(i, s)| Some(Type::vector(i.kind.dtype(dtype), s))).collect();
        types.resize(self.inputs.len(), None);
        types
    }

    /// The plan of one call: the op's plan builder on these input types and statics, after
    /// the inputs are checked against the op's contract ([`crate::contract::check_inputs`]),
    /// its results bounded by the target's HBM.
    /// Block statics left unset take a tuning table's blocks when one holds this exact call
    /// ([`crate::tune::tuned_statics`]).
    pub fn plan_for(&self, inputs: &[Option<Type>], statics: &Statics, target: &Target) -> Result<Plan, KernelError> {
        // An entry whose `best` is null keeps the rule's blocks (and stops the lookup there).
        let entry = crate::tune::tuned_entry(self, inputs, statics, target.name)?.and_then(|t| Some((t.best?, t.source)));
        // A table's blocks that cannot run (a hand-edited entry) say where they came from.
        let from_table = |mut e: KernelError| {
            if let Some((best, source)) = &entry {
                e.message = format!("{} (blocks `{best}` from the tuning table {source})", e.message);
            }
            e
        };
        let tuned = entry.as_ref().map(|(best, _)| self.statics(&format!("{statics}, {best}"))).transpose().map_err(from_table)?;
        let plan = self.plan_by_rule(inputs, tuned.as_ref().unwrap_or(statics), target).map_err(from_table)?;
        if entry.is_some() {
            // Verified here, so that an error names the table, not only the kernel.
            plan.launches.iter().try_for_each(|l| tessera_dsl::verify::verify(&l.kernel, target)).map_err(from_table)?;
        }
        Ok(plan)
    }

    /// [`Self::plan_for`] with the op's own block rule for unset blocks, never a tuning
    /// table's (the tuner's baseline).
    pub fn plan_by_rule(&self, inputs: &[Option<Type>], statics: &Statics, target: &Target) -> Result<Plan, KernelError> {
        let mut plan = self.unchecked_plan(inputs, statics, target)?;
        self.check_results(&plan, target)?;
        plan.inputs = inputs.to_vec();
        plan.input_names = self.inputs.iter().map(|i| i.name).collect();
        Ok(plan)
    }

    fn unchecked_plan(&self, inputs: &[Option<Type>], statics: &Statics, target: &Target) -> Result<Plan, KernelError> {
        let schema = self.parsed()?;
        if inputs.len() != self.inputs.len() {
            return Err(KernelError::new(
                self.name,
                "inputs",
                "input-count",
                format!("{} tensors given, the op takes {} ({})", inputs.len(), self.inputs.len(), self.inputs.iter().map(|i| i.name).collect::<Vec<_>>().join(", ")),
                "pass one tensor (or None for an optional one) per tensor argument",
            ));
        }
        for (i, t) in inputs.iter().enumerate() {
            if t.is_none() && !schema.tensor(i).is_some_and(|p| p.optional) {
                let name = self.inputs[i].name;
                return Err(KernelError::new(self.name, format!("input `{name}`"), "missing-input", format!("`{name}` is required"), format!("pass a tensor for `{name}`")));
            }
        }
        crate::contract::check_inputs(self, inputs, statics, target)?;
        if let (Some(_), Some(plan)) = (self.alias_of, self.alias_plan) {
            return plan(&Call { op: self.name, schema: &schema, inputs, statics, target });
        }
        if let Some((of, result)) = self.alias_of {
            // Errors of the aliased op's plan are reported as the op the caller named.
            let mut plan = crate::op_named(of)?.plan_for(inputs, statics, target).map_err(|e| if e.kernel == of { KernelError { kernel: self.name.to_string(), ..e } } else { e })?;
            if result >= plan.results.len() {
                return Err(KernelError::new(self.name, "op", "op-alias", format!("`{of}` has no result {result}"), "fix the op table"));
            }
            plan.results = vec![plan.results.swap_remove(result)];
            plan.op = self.name;
            return Ok(plan);
        }
        (self.plan)(&Call { op: self.name, schema: &schema, inputs, statics, target })
    }

    /// The results live in HBM too (a host-computed one such as `permute`'s group sizes
    /// reaches no kernel, so the verifier never sees it): bounded like the operands.
    fn check_results(&self, plan: &Plan, target: &Target) -> Result<(), KernelError> {
        let mut total = 0usize;
        for (r, res) in plan.results.iter().enumerate() {
            let name = self.outputs.get(r).map_or_else(|| format!("result {r}"), |o| format!("result `{}`", o.name));
            let Some((_, bytes)) = crate::contract::counts(res.ty.dtype, &res.ty.shape) else {
                return Err(KernelError::new(self.name, name, "shape-overflow", format!("the result would be {:?} of {}: its byte count overflows", res.ty.shape, res.ty.dtype), "check the shapes and static arguments that size it"));
            };
            total = total.saturating_add(bytes);
            if total > target.hbm_usable_bytes {
                return Err(KernelError::new(
                    self.name,
                    name,
                    "hbm-budget",
                    format!("the results take more than the {:.2} GiB of HBM a {target} device can use (this one is {})", target.hbm_usable_bytes as f64 / (1u64 << 30) as f64, res.ty),
                    "check the shapes and static arguments that size the results, or split the work",
                ));
            }
        }
        Ok(())
    }

    /// The statics of `name=value, ...` (the others take their defaults).
    pub fn statics(&self, assignments: &str) -> Result<Statics, KernelError> {
        Statics::parse(&*self.parsed()?, assignments).map_err(|m| KernelError::new(self.name, "static arguments", "option-value", m, format!("see the schema: {}{}", self.name, self.schema)))
    }

    /// Runs the op with `exec` on `inputs` (one per tensor argument; missing trailing
    /// ones are absent), each launch verified for `target` first.
    pub fn run(&self, exec: &dyn Executor, inputs: &[Option<&Array>], statics: &Statics, target: &Target) -> Result<Vec<Array>, KernelError> {
        let mut inputs = inputs.to_vec();
        if inputs.len() < self.inputs.len() {
            inputs.resize(self.inputs.len(), None);
        }
        crate::contract::check_arrays(self, &inputs)?;
        let types: Vec<Option<Type>> = inputs.iter().map(|a| a.map(|a| Type::vector(a.dtype, &a.shape))).collect();
        let plan = self.plan_for(&types, statics, target)?;
        for launch in &plan.launches {
            tessera_dsl::verify::verify(&launch.kernel, target)?;
        }
        crate::plan::execute(&plan, exec, &inputs)
    }
}

fn no_plan(c: &Call) -> Result<Plan, KernelError> {
    Err(c.err("op", "op-plan", "this op has no plan of its own", "call the op it is an alias of"))
}

// ---- schemas ------------------------------------------------------------------------------------

/// The type of a schema argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    Tensor,
    Bool,
    Int,
    Float,
    Str,
    /// `int[]`.
    Ints,
}

/// One argument of a schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: String,
    pub ty: ArgType,
    /// `T?`: may be `None`.
    pub optional: bool,
    pub default: Option<Static>,
}

/// A parsed torch schema: the arguments in order and the number of results.
#[derive(Clone, Debug, PartialEq)]
pub struct Schema {
    pub params: Vec<Param>,
    pub results: usize,
}

impl Schema {
    /// Parses `(Tensor x, float eps=1e-06, int? k=None) -> (Tensor, Tensor)`.
    pub fn parse(text: &str) -> Result<Schema, String> {
        let text = text.trim();
        let (args, ret) = text.rsplit_once("->").ok_or_else(|| format!("schema `{text}` has no `->`"))?;
        let args = args.trim();
        let inner = args.strip_prefix('(').and_then(|a| a.strip_suffix(')')).ok_or_else(|| format!("schema arguments `{args}` are not parenthesised"))?;
        let mut params = Vec::new();
        for arg in split_top(inner) {
            let arg = arg.trim();
            if arg.is_empty() {
                continue;
            }
            let (decl, default) = match arg.split_once('=') {
                Some((d, v)) => (d.trim(), Some(v.trim())),
                None => (arg, None),
            };
            let (ty, name) = decl.rsplit_once(' ').ok_or_else(|| format!("argument `{arg}` needs a type and a name"))?;
            let (ty, optional) = match ty.trim().strip_suffix('?') {
                Some(t) => (t, true),
                None => (ty.trim(), false),
            };
            let ty = match ty {
                "Tensor" => ArgType::Tensor,
                "bool" => ArgType::Bool,
                "int" => ArgType::Int,
                "float" => ArgType::Float,
                "str" => ArgType::Str,
                "int[]" => ArgType::Ints,
                other => return Err(format!("argument `{arg}`: unsupported type `{other}`")),
            };
            let default = default.map(|v| Static::parse_literal(v, ty)).transpose().map_err(|e| format!("argument `{arg}`: {e}"))?;
            params.push(Param { name: name.trim().to_string(), ty, optional, default });
        }
        let ret = ret.trim();
        let results = if ret.starts_with('(') { split_top(ret.trim_start_matches('(').trim_end_matches(')')).len() } else { 1 };
        Ok(Schema { params, results })
    }

    /// The tensor arguments, in order.
    pub fn tensors(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| p.ty == ArgType::Tensor)
    }

    /// The static (non-tensor) arguments, in order.
    pub fn statics(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| p.ty != ArgType::Tensor)
    }

    /// Tensor argument `i`.
    pub fn tensor(&self, i: usize) -> Option<&Param> {
        self.tensors().nth(i)
    }

    /// The index of tensor argument `name` among the tensors.
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensors().position(|p| p.name == name)
    }
}

/// Splits on commas outside brackets and quotes.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut quoted, mut start, mut out) = (0i32, false, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '(' | '[' if !quoted => depth += 1,
            ')' | ']' if !quoted => depth -= 1,
            ',' if depth == 0 && !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !s[start..].trim().is_empty() {
        out.push(&s[start..]);
    }
    out
}

// ---- static arguments ---------------------------------------------------------------------------

/// A static (non-tensor) argument's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Static {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Ints(Vec<i64>),
}

impl Static {
    /// A literal in schema / case syntax: `True`, `None`, `3`, `1e-06`, `"softmax"`, `[1, 2]`.
    pub fn parse_literal(v: &str, ty: ArgType) -> Result<Static, String> {
        let v = v.trim();
        Ok(match (v, ty) {
            ("None", _) => Static::None,
            ("True" | "true", ArgType::Bool) => Static::Bool(true),
            ("False" | "false", ArgType::Bool) => Static::Bool(false),
            (_, ArgType::Int) => Static::Int(v.parse().map_err(|_| format!("`{v}` is not an int"))?),
            (_, ArgType::Float) => Static::Float(v.parse().map_err(|_| format!("`{v}` is not a float"))?),
            (_, ArgType::Str) => Static::Str(v.trim_matches('"').trim_matches('\'').to_string()),
            (_, ArgType::Ints) => {
                let inner = v.trim_start_matches('[').trim_end_matches(']');
                Static::Ints(inner.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().map_err(|_| format!("`{s}` is not an int"))).collect::<Result<_, _>>()?)
            }
            _ => return Err(format!("`{v}` is not a {ty:?} literal")),
        })
    }

    fn type_name(&self) -> &'static str {
        match self {
            Static::None => "None",
            Static::Bool(_) => "bool",
            Static::Int(_) => "int",
            Static::Float(_) => "float",
            Static::Str(_) => "str",
            Static::Ints(_) => "int[]",
        }
    }
}

impl fmt::Display for Static {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Static::None => f.write_str("None"),
            Static::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Static::Int(i) => write!(f, "{i}"),
            Static::Float(x) => write!(f, "{x:?}"),
            Static::Str(s) => write!(f, "{s:?}"),
            Static::Ints(v) => write!(f, "[{}]", v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")),
        }
    }
}

/// A call's static arguments by name, in schema order, defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Statics {
    names: Vec<String>,
    values: Vec<Static>,
}

impl Statics {
    /// The statics of `schema` from values in schema order (a missing trailing one takes
    /// its default), each checked against its declared type.
    pub fn from_values(schema: &Schema, values: Vec<Static>) -> Result<Statics, String> {
        let params: Vec<&Param> = schema.statics().collect();
        if values.len() > params.len() {
            return Err(format!("{} static arguments given, the op takes {}", values.len(), params.len()));
        }
        let mut out = Statics { names: Vec::with_capacity(params.len()), values: Vec::with_capacity(params.len()) };
        let mut given = values.into_iter();
        for p in params {
            let v = match given.next() {
                Some(v) => v,
                None => p.default.clone().ok_or_else(|| format!("`{}` is required", p.name))?,
            };
            out.names.push(p.name.clone());
            out.values.push(check_static(p, v)?);
        }
        Ok(out)
    }

    /// The statics of `schema` from `name=value, ...` (the others take their defaults). A
    /// name assigned again overrides its earlier value (a case's statics, then overrides);
    /// a caller taking a user's text that should refuse a repeat checks [`Statics::assignments`].
    pub fn parse(schema: &Schema, assignments: &str) -> Result<Statics, String> {
        let mut values: Vec<Option<Static>> = schema.statics().map(|_| None).collect();
        for a in split_top(assignments) {
            let a = a.trim();
            if a.is_empty() {
                continue;
            }
            let (name, v) = a.split_once('=').ok_or_else(|| format!("`{a}`: expected name=value"))?;
            let i = schema.statics().position(|p| p.name == name.trim()).ok_or_else(|| format!("`{}` is not a static argument of the op", name.trim()))?;
            let p = schema.statics().nth(i).expect("position found it");
            values[i] = Some(Static::parse_literal(v, p.ty)?);
        }
        let mut out = Vec::new();
        for (p, v) in schema.statics().zip(values) {
            out.push(match v.or_else(|| p.default.clone()) {
                Some(v) => v,
                None => return Err(format!("`{}` is required", p.name)),
            });
        }
        Statics::from_values(schema, out)
    }

    /// The `(name, value)` pairs of `name=value, ...` in order, trimmed, repeats included
    /// (an item without `=` is left out: [`Statics::parse`] refuses it).
    pub fn assignments(assignments: &str) -> Vec<(&str, &str)> {
        split_top(assignments).into_iter().filter_map(|a| a.split_once('=')).map(|(n, v)| (n.trim(), v.trim())).collect()
    }

    /// The value of `name` (`Static::None` for a name the schema does not have).
    pub fn get(&self, name: &str) -> &Static {
        self.names.iter().position(|n| n == name).map_or(&Static::None, |i| &self.values[i])
    }

    pub fn values(&self) -> &[Static] {
        &self.values
    }

    pub fn bool(&self, name: &str) -> bool {
        matches!(self.get(name), Static::Bool(true))
    }

    pub fn f64(&self, name: &str) -> Option<f64> {
        match self.get(name) {
            Static::Float(x) => Some(*x),
            Static::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn i64(&self, name: &str) -> Option<i64> {
        match self.get(name) {
            Static::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn str(&self, name: &str) -> &str {
        match self.get(name) {
            Static::Str(s) => s,
            _ => "",
        }
    }

    pub fn ints(&self, name: &str) -> Option<&[i64]> {
        match self.get(name) {
            Static::Ints(v) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for Statics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items: Vec<String> = self.names.iter().zip(&self.values).map(|(n, v)| format!("{n}={v}")).collect();
        f.write_str(&items.join(", "))
    }
}

fn check_static(p: &Param, v: Static) -> Result<Static, String> {
    let ok = match (&v, p.ty) {
        (Static::None, _) => p.optional || p.default == Some(Static::None),
        (Static::Bool(_), ArgType::Bool) | (Static::Int(_), ArgType::Int) | (Static::Str(_), ArgType::Str) | (Static::Ints(_), ArgType::Ints) => true,
        (Static::Float(_), ArgType::Float) => true,
        (Static::Int(i), ArgType::Float) => return Ok(Static::Float(*i as f64)),
        _ => false,
    };
    if ok {
        Ok(v)
    } else {
        Err(format!("`{}` is {} ({v}), the schema declares {:?}{}", p.name, v.type_name(), p.ty, if p.optional { "?" } else { "" }))
    }
}

// ---- one call ---------------------------------------------------------------------------------------

/// One call of an op, as its plan builder sees it: input types and statics.
pub struct Call<'a> {
    pub op: &'static str,
    pub schema: &'a Schema,
    /// The tensor inputs in schema order (`None`: an optional tensor not given).
    pub inputs: &'a [Option<Type>],
    pub statics: &'a Statics,
    pub target: &'a Target,
}

impl Call<'_> {
    pub fn err(&self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        KernelError::new(self.op, subject, rule, message, help)
    }

    /// The index of tensor input `name` (a name the schema lacks is a bug in the op).
    pub fn index(&self, name: &str) -> Result<usize, KernelError> {
        self.schema.tensor_index(name).ok_or_else(|| self.err("op", "op-schema", format!("the plan reads a tensor `{name}` that the schema does not declare"), "report this as a Tessera bug"))
    }

    /// Whether optional tensor `name` was given.
    pub fn given(&self, name: &str) -> bool {
        self.index(name).ok().and_then(|i| self.inputs.get(i)).is_some_and(Option::is_some)
    }

    /// Tensor input `name`, which must be given.
    pub fn tensor(&self, name: &str) -> Result<&Type, KernelError> {
        let i = self.index(name)?;
        self.inputs.get(i).and_then(Option::as_ref).ok_or_else(|| self.err(format!("input `{name}`"), "missing-input", format!("`{name}` is required"), format!("pass a tensor for `{name}`")))
    }

    /// Tensor input `name`, of rank `rank`: its dims.
    pub fn dims(&self, name: &str, rank: usize) -> Result<&[usize], KernelError> {
        let t = self.tensor(name)?;
        if t.rank() != rank {
            return Err(self.err(format!("input `{name}`"), "operand-rank", format!("{name} is {t}, rank {}", t.rank()), format!("pass {name} with {rank} dims")));
        }
        Ok(&t.shape)
    }

    /// Tensor input `name` seen as `[rows, last dim]` (any rank >= 1).
    pub fn rows(&self, name: &str) -> Result<Type, KernelError> {
        let t = self.tensor(name)?;
        let Some((&n, lead)) = t.shape.split_last() else {
            return Err(self.err(format!("input `{name}`"), "operand-rank", format!("{name} is a scalar"), format!("pass {name} with at least one dim")));
        };
        Ok(Type::vector(t.dtype, &[lead.iter().product(), n]))
    }

    /// Tensor input `name` seen as a `[1, n]` row (from `[n]` or `[1, n]`; the library's
    /// ops declare such inputs `[1?, n]`).
    pub fn row_vector(&self, name: &str, n: usize) -> Result<Type, KernelError> {
        let t = self.tensor(name)?;
        if t.num_elements() != n || t.rank() > 2 || (t.rank() == 2 && t.shape[0] != 1) {
            return Err(self.err(format!("input `{name}`"), "operand-shape", format!("{name} is {t}"), format!("pass {name} of shape [{n}]")));
        }
        Ok(Type::vector(t.dtype, &[1, n]))
    }

    /// Checks that tensor input `name` holds f32 or bf16.
    pub fn float(&self, name: &str) -> Result<(), KernelError> {
        let t = self.tensor(name)?;
        if matches!(t.dtype, DType::F32 | DType::BF16) {
            return Ok(());
        }
        Err(self.err(format!("input `{name}`"), "operand-dtype", format!("{name} is {}", t.dtype), "pass float32 or bfloat16"))
    }

    /// Static `name` as a non-negative integer, if given.
    pub fn usize_opt(&self, name: &str) -> Result<Option<usize>, KernelError> {
        match self.statics.get(name) {
            Static::Int(x) if *x >= 0 => Ok(Some(*x as usize)),
            Static::Int(x) => Err(self.err(format!("argument `{name}`"), "option-value", format!("{name} = {x}"), format!("pass a non-negative {name}"))),
            _ => Ok(None),
        }
    }

    /// Block static `name`: its value when given (a zero block is an error), else `default`
    /// (the op's own rule; a tuning table's entry arrives as a given value).
    pub fn block(&self, name: &str, default: usize) -> Result<usize, KernelError> {
        match self.statics.get(name) {
            Static::Int(x) if *x <= 0 => Err(self.err(format!("argument `{name}`"), "option-value", format!("{name} = {x}"), format!("pass a positive {name}, or leave it unset for the default blocks"))),
            _ => Ok(self.usize_opt(name)?.unwrap_or(default)),
        }
    }

    /// Static `name` as a non-negative integer, which must be given.
    pub fn usize(&self, name: &str) -> Result<usize, KernelError> {
        self.usize_opt(name)?.ok_or_else(|| self.err(format!("argument `{name}`"), "missing-argument", format!("{name} is not given"), format!("pass {name}")))
    }

    /// The operand "tensor input `name` seen as `ty`".
    pub fn input(&self, name: &str, ty: Type) -> Result<Operand, KernelError> {
        Ok(Operand::view(Source::Input(self.index(name)?), ty))
    }
}

// ---- shape and dtype expressions ---------------------------------------------------------------------

/// The shape of a result from its [`Output::shape`] expression, the input types and
/// statics. The torch package evaluates the same expressions on symbolic shapes (its fake
/// kernels); a test checks them against every plan.
pub fn eval_shape(expr: &str, names: &[&str], inputs: &[Option<Type>], statics: &Statics) -> Result<Vec<usize>, String> {
    let tensor = |n: &str| -> Result<&Type, String> {
        let i = names.iter().position(|x| *x == n).ok_or_else(|| format!("`{n}` is not a tensor input"))?;
        inputs.get(i).and_then(Option::as_ref).ok_or_else(|| format!("`{n}` is not given"))
    };
    let expr = expr.trim();
    let Some(inner) = expr.strip_prefix('[').and_then(|e| e.strip_suffix(']')) else {
        // `x | y`: the first given of the names.
        let names: Vec<&str> = expr.split('|').map(str::trim).collect();
        let given = names.iter().copied().find(|&n| tensor(n).is_ok()).unwrap_or(names[0]);
        return Ok(tensor(given)?.shape.clone());
    };
    let mut out = Vec::new();
    for item in split_top(inner) {
        let item = item.trim();
        if let Some(rest) = item.strip_prefix('*') {
            let (name, range) = match rest.split_once('[') {
                Some((n, r)) => (n.trim(), Some(r.trim_end_matches(']'))),
                None => (rest.trim(), None),
            };
            let shape = &tensor(name)?.shape;
            let (lo, hi) = match range {
                Some(r) => {
                    let (a, b) = r.split_once(':').ok_or_else(|| format!("`{item}`: expected [a:b]"))?;
                    let bound = |s: &str, dflt: usize| -> Result<usize, String> {
                        let s = s.trim();
                        if s.is_empty() {
                            return Ok(dflt);
                        }
                        let v: i64 = s.parse().map_err(|_| format!("`{item}`: `{s}` is not an integer"))?;
                        Ok(if v < 0 { shape.len().saturating_sub(v.unsigned_abs() as usize) } else { (v as usize).min(shape.len()) })
                    };
                    (bound(a, 0)?, bound(b, shape.len())?)
                }
                None => (0, shape.len()),
            };
            out.extend_from_slice(&shape[lo.min(hi)..hi]);
        } else {
            out.push(eval_dim(item, &tensor, statics)?);
        }
    }
    Ok(out)
}

fn eval_dim<'t>(item: &str, tensor: &impl Fn(&str) -> Result<&'t Type, String>, statics: &Statics) -> Result<usize, String> {
    if let Some((cond, rest)) = item.split_once('?') {
        let (a, b) = rest.split_once(':').ok_or_else(|| format!("`{item}`: expected flag ? a : b"))?;
        let pick = if statics.bool(cond.trim()) { a } else { b };
        return eval_dim(pick, tensor, statics);
    }
    if let Some((num, den)) = item.rsplit_once('/') {
        let den: usize = den.trim().parse().ok().filter(|&d| d > 0).ok_or_else(|| format!("`{item}`: `{den}` is not a positive integer divisor"))?;
        return Ok(eval_dim(num, tensor, statics)? / den);
    }
    let mut product = 1usize;
    for atom in item.split('*') {
        let atom = atom.trim();
        let v = if let Ok(n) = atom.parse::<usize>() {
            n
        } else if let Some((name, d)) = atom.split_once('.') {
            let shape = &tensor(name.trim())?.shape;
            let d: i64 = d.trim().parse().map_err(|_| format!("`{atom}`: `{d}` is not a dim index"))?;
            let idx = if d < 0 { shape.len() as i64 + d } else { d };
            *shape.get(usize::try_from(idx).map_err(|_| format!("`{atom}`: dim {d} of rank {}", shape.len()))?).ok_or_else(|| format!("`{atom}`: dim {d} of rank {}", shape.len()))?
        } else {
            let v = statics.i64(atom).ok_or_else(|| format!("`{atom}` is neither an input dim nor an int static"))?;
            usize::try_from(v).map_err(|_| format!("`{atom}` = {v} is negative"))?
        };
        product = product.checked_mul(v).ok_or_else(|| format!("`{item}` overflows"))?;
    }
    Ok(product)
}

/// The dtype of a result from its [`Output::dtype`]: a tensor input's, or a named dtype.
pub fn eval_dtype(expr: &str, names: &[&str], inputs: &[Option<Type>]) -> Result<DType, String> {
    if let Some(d) = DType::parse(expr) {
        return Ok(d);
    }
    let i = names.iter().position(|n| *n == expr).ok_or_else(|| format!("`{expr}` is neither a dtype nor a tensor input"))?;
    inputs.get(i).and_then(Option::as_ref).map(|t| t.dtype).ok_or_else(|| format!("`{expr}` is not given"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schemas_and_statics() {
        let s = Schema::parse("(Tensor x, Tensor? y=None, float eps=1e-06, int? k=None, str gate=\"softmax\", int[]? tiling=None) -> (Tensor, Tensor)").unwrap();
        assert_eq!(s.results, 2);
        assert_eq!(s.tensors().count(), 2);
        assert!(s.tensor(1).unwrap().optional);
        let st = Statics::parse(&s, "k=3, tiling=[128, 256, 512]").unwrap();
        assert_eq!(st.f64("eps"), Some(1e-6));
        assert_eq!(st.i64("k"), Some(3));
        assert_eq!(st.str("gate"), "softmax");
        assert_eq!(st.ints("tiling"), Some(&[128, 256, 512][..]));
        assert!(Statics::parse(&s, "nope=1").is_err());
        // A later assignment overrides an earlier one (a case's statics, then overrides);
        // `assignments` lists each, for callers that refuse a repeat.
        assert_eq!(Statics::parse(&s, "k=3, k=4").unwrap().i64("k"), Some(4));
        assert_eq!(Statics::assignments(" k=3, tiling=[1, 2], gate=\"a,b\", ,k = 4"), vec![("k", "3"), ("tiling", "[1, 2]"), ("gate", "\"a,b\""), ("k", "4")]);
        assert!(Statics::from_values(&s, vec![Static::Str("x".into())]).is_err());
    }

    #[test]
    fn evaluates_shape_expressions() {
        let s = Schema::parse("(Tensor a, Tensor b, bool t=False, int k=2) -> Tensor").unwrap();
        let st = Statics::parse(&s, "t=True").unwrap();
        let inputs = [Some(Type::vector(DType::F32, &[4, 5, 6])), Some(Type::vector(DType::I32, &[7, 3]))];
        let names = ["a", "b"];
        assert_eq!(eval_shape("a", &names, &inputs, &st).unwrap(), vec![4, 5, 6]);
        assert_eq!(eval_shape("[*a[:2], b.0 * b.1, k]", &names, &inputs, &st).unwrap(), vec![4, 5, 21, 2]);
        assert_eq!(eval_shape("[a.-1, t ? b.0 : b.1]", &names, &inputs, &st).unwrap(), vec![6, 7]);
        let (some, none) = ([inputs[0].clone(), inputs[1].clone(), None], ["a", "b", "c"]);
        assert_eq!(eval_shape("c | b", &none, &some, &st).unwrap(), vec![7, 3]);
        assert_eq!(eval_shape("b | a", &none, &some, &st).unwrap(), vec![7, 3]);
        assert!(eval_shape("c", &none, &some, &st).is_err());
        assert_eq!(eval_dtype("b", &names, &inputs).unwrap(), DType::I32);
        assert_eq!(eval_dtype("f32", &names, &inputs).unwrap(), DType::F32);
    }
}
