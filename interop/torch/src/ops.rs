//! The torch ops: each library op's schema in the `tpu` namespace and how a call of it
//! becomes a [`Plan`] (which kernels, fed by which inputs, through which views).
//!
//! Tensors are seen as their kernels want them: `rmsnorm`'s `x [..., n]` is the kernel's
//! `[m, n]` and its `weight [n]` the kernel's `[1, n]`, views of the same memory.

use tessera_dsl::interp::Array;
use tessera_dsl::{DType, KernelError, Target, Type};
use tessera_kernels::attention::{self, AttentionParams};
use tessera_kernels::routing::{self, Gate};
use tessera_kernels::{
    elementwise, gmm, matmul, norms, paged_attention, quant, ragged_paged_attention as rpa, rope_ce,
};

use crate::plan::{Launch, Layout, Operand, Plan, Source};

/// A static (non-tensor) argument, as the schema declares it.
#[derive(Clone, Debug, PartialEq)]
pub enum Static {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

/// One call's types and static arguments.
pub struct Call<'a> {
    pub op: &'static str,
    /// The tensor inputs in schema order (`None`: an optional tensor not given).
    pub inputs: &'a [Option<Type>],
    /// The static arguments in schema order.
    pub statics: &'a [Static],
    pub target: &'a Target,
}

/// A torch op backed by Tessera kernels.
pub struct OpDef {
    pub name: &'static str,
    /// The schema after the name, in torch's schema language.
    pub schema: &'static str,
    pub doc: &'static str,
    pub plan: fn(&Call) -> Result<Plan, KernelError>,
}

impl Call<'_> {
    pub fn err(
        &self,
        subject: impl Into<String>,
        rule: &'static str,
        message: impl Into<String>,
        help: impl Into<String>,
    ) -> KernelError {
        KernelError::new(self.op, subject, rule, message, help)
    }

    /// Tensor input `i`, which must be given.
    pub fn input(&self, i: usize) -> Result<&Type, KernelError> {
        self.inputs.get(i).and_then(Option::as_ref).ok_or_else(|| {
            self.err(
                format!("tensor input {i}"),
                "missing-input",
                "a required tensor is missing",
                "pass every required tensor",
            )
        })
    }

    /// Tensor input `i` of rank `rank` (its dims) and, if given, dtype class.
    pub fn dims(&self, i: usize, name: &str, rank: usize) -> Result<&[usize], KernelError> {
        let t = self.input(i)?;
        if t.rank() != rank {
            return Err(self.err(
                format!("input `{name}`"),
                "operand-rank",
                format!("{name} is {t}, rank {}", t.rank()),
                format!("pass {name} with {rank} dims"),
            ));
        }
        Ok(&t.shape)
    }

    /// Tensor input `i` seen as `[rows, last dim]` (any rank >= 1).
    pub fn rows(&self, i: usize, name: &str) -> Result<Type, KernelError> {
        let t = self.input(i)?;
        let Some((&n, lead)) = t.shape.split_last() else {
            return Err(self.err(
                format!("input `{name}`"),
                "operand-rank",
                format!("{name} is a scalar"),
                format!("pass {name} with at least one dim"),
            ));
        };
        Ok(Type::vector(t.dtype, &[lead.iter().product(), n]))
    }

    /// Tensor input `i` seen as a `[1, n]` row (from `[n]` or `[1, n]`).
    pub fn row_vector(&self, i: usize, name: &str, n: usize) -> Result<Type, KernelError> {
        let t = self.input(i)?;
        if t.num_elements() != n || t.rank() > 2 || (t.rank() == 2 && t.shape[0] != 1) {
            return Err(self.err(
                format!("input `{name}`"),
                "operand-shape",
                format!("{name} is {t}"),
                format!("pass {name} of shape [{n}]"),
            ));
        }
        Ok(Type::vector(t.dtype, &[1, n]))
    }

    pub fn bool(&self, i: usize) -> bool {
        matches!(self.statics.get(i), Some(Static::Bool(true)))
    }

    pub fn f64_opt(&self, i: usize) -> Option<f64> {
        match self.statics.get(i) {
            Some(Static::Float(x)) => Some(*x),
            Some(Static::Int(x)) => Some(*x as f64),
            _ => None,
        }
    }

    pub fn usize_opt(&self, i: usize, name: &str) -> Result<Option<usize>, KernelError> {
        match self.statics.get(i) {
            Some(Static::Int(x)) if *x >= 0 => Ok(Some(*x as usize)),
            Some(Static::Int(x)) => Err(self.err(
                format!("argument `{name}`"),
                "option-value",
                format!("{name} = {x}"),
                format!("pass a non-negative {name}"),
            )),
            _ => Ok(None),
        }
    }

    pub fn usize(&self, i: usize, name: &str) -> Result<usize, KernelError> {
        self.usize_opt(i, name)?.ok_or_else(|| {
            self.err(
                format!("argument `{name}`"),
                "missing-argument",
                format!("{name} is not given"),
                format!("pass {name}"),
            )
        })
    }

    pub fn str(&self, i: usize) -> &str {
        match self.statics.get(i) {
            Some(Static::Str(s)) => s,
            _ => "",
        }
    }
}

pub fn input(i: usize, ty: Type) -> Operand {
    Operand::view(Source::Input(i), ty)
}

pub fn host(i: usize, ty: Type) -> Operand {
    Operand::view(Source::Host(i), ty)
}

pub fn result(launch: usize, output: usize, ty: Type) -> Operand {
    Operand::view(Source::Result { launch, output }, ty)
}

/// A plan of one kernel whose results are its outputs seen with `shapes` (`None`: as is).
pub fn single(
    c: &Call,
    kernel: tessera_dsl::Kernel,
    args: Vec<Operand>,
    shapes: &[Option<Vec<usize>>],
) -> Plan {
    let launch = Launch::new(kernel, args);
    let results = launch.outputs.iter().enumerate().map(|(j, t)| {
        let shape = shapes
            .get(j)
            .cloned()
            .flatten()
            .unwrap_or_else(|| t.shape.clone());
        result(0, j, Type::vector(t.dtype, &shape))
    });
    let results = results.collect();
    Plan::new(c.op, c.target, vec![launch], results)
}

fn same_shape(c: &Call, i: usize) -> Result<Option<Vec<usize>>, KernelError> {
    Ok(Some(c.input(i)?.shape.clone()))
}

fn float_input(c: &Call, i: usize, name: &str) -> Result<(), KernelError> {
    let t = c.input(i)?;
    if t.dtype.is_float() {
        return Ok(());
    }
    Err(c.err(
        format!("input `{name}`"),
        "operand-dtype",
        format!("{name} is {}", t.dtype),
        "pass float32 or bfloat16",
    ))
}

// ---- basic and norms ----------------------------------------------------------------------

fn plan_matmul(c: &Call) -> Result<Plan, KernelError> {
    let (x, y) = (c.dims(0, "x", 2)?, c.dims(1, "y", 2)?);
    if x[1] != y[0] {
        return Err(c.err(
            "input `y`",
            "operand-shape",
            format!("x is [{}, {}] and y [{}, {}]", x[0], x[1], y[0], y[1]),
            "the contraction dims must agree: x [m, k] @ y [k, n]",
        ));
    }
    float_input(c, 0, "x")?;
    let (x, y) = (c.input(0)?.clone(), c.input(1)?.clone());
    Ok(single(
        c,
        matmul::matmul(&x, &y, c.target)?,
        vec![input(0, x), input(1, y)],
        &[],
    ))
}

fn plan_gelu_affine(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows(0, "x")?;
    let (a, b) = (
        c.row_vector(1, "a", x.shape[1])?,
        c.row_vector(2, "b", x.shape[1])?,
    );
    let kernel = elementwise::gelu_affine(&x, &a, &b, c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, a), input(2, b)],
        &[same_shape(c, 0)?],
    ))
}

fn plan_softmax(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows(0, "x")?;
    Ok(single(
        c,
        elementwise::softmax(&x, c.target)?,
        vec![input(0, x)],
        &[same_shape(c, 0)?],
    ))
}

fn eps(c: &Call, i: usize) -> f32 {
    c.f64_opt(i).unwrap_or(1e-6) as f32
}

fn plan_rmsnorm(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows(0, "x")?;
    let w = c.row_vector(1, "weight", x.shape[1])?;
    let kernel = elementwise::rmsnorm(&x, &w, eps(c, 0), c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, w)],
        &[same_shape(c, 0)?],
    ))
}

fn plan_rmsnorm_residual(c: &Call) -> Result<Plan, KernelError> {
    let (x, r) = (c.rows(0, "x")?, c.rows(1, "residual")?);
    let w = c.row_vector(2, "weight", x.shape[1])?;
    let kernel = norms::build::rmsnorm_residual(&x, &r, &w, eps(c, 0), c.target)?;
    let shape = same_shape(c, 0)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, r), input(2, w)],
        &[shape.clone(), shape],
    ))
}

fn plan_layernorm(c: &Call) -> Result<Plan, KernelError> {
    let x = c.rows(0, "x")?;
    let (w, b) = (
        c.row_vector(1, "weight", x.shape[1])?,
        c.row_vector(2, "bias", x.shape[1])?,
    );
    let kernel =
        norms::build::layernorm(&x, &w, &b, c.f64_opt(0).unwrap_or(1e-5) as f32, c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, w), input(2, b)],
        &[same_shape(c, 0)?],
    ))
}

fn plan_rmsnorm_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (x, dy) = (c.rows(0, "x")?, c.rows(2, "dy")?);
    let w = c.row_vector(1, "weight", x.shape[1])?;
    let kernel = norms::build::rmsnorm_bwd(&x, &w, &dy, eps(c, 0), c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, w), input(2, dy)],
        &[same_shape(c, 0)?, same_shape(c, 1)?],
    ))
}

fn plan_swiglu(c: &Call) -> Result<Plan, KernelError> {
    let (a, b) = (c.rows(0, "a")?, c.rows(1, "b")?);
    Ok(single(
        c,
        norms::build::swiglu(&a, &b, c.target)?,
        vec![input(0, a), input(1, b)],
        &[same_shape(c, 0)?],
    ))
}

fn plan_swiglu_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (a, b, dy) = (c.rows(0, "a")?, c.rows(1, "b")?, c.rows(2, "dy")?);
    let kernel = norms::build::swiglu_bwd(&a, &b, &dy, c.target)?;
    let shape = same_shape(c, 0)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, a), input(1, b), input(2, dy)],
        &[shape.clone(), shape],
    ))
}

// ---- RoPE and cross-entropy -----------------------------------------------------------------

fn plan_rope(c: &Call, backward: bool) -> Result<Plan, KernelError> {
    let x = c.input(0)?.clone();
    let kernel = rope_ce::build_rope(&x, c.bool(1), backward, c.target)?;
    let (t, h, dh) = (x.shape[0], x.shape[1], x.shape[2]);
    let positions = c.input(1)?;
    if positions.dtype != DType::I32 || positions.shape != [t] {
        return Err(c.err(
            "input `position_ids`",
            "operand-shape",
            format!("position_ids is {positions}, x has {t} tokens"),
            format!("pass int32 position ids of shape [{t}]"),
        ));
    }
    let w = rope_ce::rope_chunk(h * dh, dh);
    let table = Type::vector(DType::F32, &[t, w]);
    let args = vec![
        input(0, Type::vector(x.dtype, &[t, h * dh])),
        host(0, table.clone()),
        host(1, table),
    ];
    let (theta, interleaved) = (c.f64_opt(0).unwrap_or(10000.0), c.bool(1));
    Ok(single(c, kernel, args, &[Some(x.shape.clone())]).with_host(
        &[1],
        Box::new(move |v| {
            let positions = v[0].as_i32().unwrap_or_default();
            let (cos, sin) = rope_ce::rope_tables(positions, dh, w, theta, interleaved);
            Ok(vec![cos, sin])
        }),
    ))
}

/// `a` (`[t]` or `[t, 1]`) as a `[t, 1]` column of `dtype` class (`None`: any float).
fn column(c: &Call, i: usize, name: &str, t: usize, int: bool) -> Result<Operand, KernelError> {
    let a = c.input(i)?;
    let ok = a.num_elements() == t
        && a.rank() <= 2
        && (a.dtype == DType::I32) == int
        && (int || a.dtype.is_float());
    if !ok {
        let want = if int { "int32" } else { "float" };
        return Err(c.err(
            format!("input `{name}`"),
            "operand-shape",
            format!("{name} is {a}, the logits have {t} rows"),
            format!("pass {want} {name} of shape [{t}]"),
        ));
    }
    Ok(input(i, Type::vector(a.dtype, &[t, 1])))
}

fn plan_cross_entropy(c: &Call) -> Result<Plan, KernelError> {
    let logits = c.input(0)?.clone();
    let kernel = rope_ce::build_cross_entropy(&logits, c.target)?;
    let t = logits.shape[0];
    let args = vec![input(0, logits), column(c, 1, "labels", t, true)?];
    Ok(single(c, kernel, args, &[Some(vec![t]), Some(vec![t])]))
}

fn plan_cross_entropy_bwd(c: &Call) -> Result<Plan, KernelError> {
    let logits = c.input(0)?.clone();
    let t = logits.shape.first().copied().unwrap_or(0);
    let (labels, lse, dloss) = (
        column(c, 1, "labels", t, true)?,
        column(c, 2, "lse", t, false)?,
        column(c, 3, "dloss", t, false)?,
    );
    let kernel = rope_ce::build_cross_entropy_bwd(&logits, lse.ty.dtype, dloss.ty.dtype, c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, logits), labels, lse, dloss],
        &[],
    ))
}

fn plan_cross_entropy_with_grad(c: &Call) -> Result<Plan, KernelError> {
    let logits = c.input(0)?.clone();
    let forward = rope_ce::build_cross_entropy(&logits, c.target)?;
    let t = logits.shape[0];
    let labels = column(c, 1, "labels", t, true)?;
    let col = Type::vector(DType::F32, &[t, 1]);
    let backward = rope_ce::build_cross_entropy_bwd(&logits, DType::F32, DType::F32, c.target)?;
    let launches = vec![
        Launch::new(forward, vec![input(0, logits.clone()), labels.clone()]),
        Launch::new(
            backward,
            vec![
                input(0, logits.clone()),
                labels,
                result(0, 1, col.clone()),
                host(0, col),
            ],
        ),
    ];
    let results = vec![
        result(0, 0, Type::vector(DType::F32, &[t])),
        result(1, 0, logits),
    ];
    Ok(Plan::new(c.op, c.target, launches, results).with_host(
        &[],
        Box::new(move |_| Ok(vec![Array::from_f32(&[t, 1], vec![1.0; t])])),
    ))
}

// ---- quantized matmul, grouped matmul, routing ---------------------------------------------

fn plan_quantized_matmul(c: &Call) -> Result<Plan, KernelError> {
    c.dims(0, "x", 2)?;
    let w = c.dims(1, "w", 2)?.to_vec();
    let scale = c.row_vector(2, "scale", w[0])?;
    let (x, w) = (c.input(0)?.clone(), c.input(1)?.clone());
    let kernel = quant::quantized_matmul(&x, &w, &scale, c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(0, x), input(1, w), input(2, scale)],
        &[],
    ))
}

fn group_sizes(c: &Call, i: usize) -> Result<usize, KernelError> {
    let g = c.input(i)?;
    if g.rank() != 1 || g.dtype != DType::I32 {
        return Err(c.err(
            "input `group_sizes`",
            "operand-shape",
            format!("group_sizes is {g}"),
            "pass int32 group sizes of shape [groups]",
        ));
    }
    Ok(g.shape[0])
}

fn plan_gmm(c: &Call) -> Result<Plan, KernelError> {
    c.dims(0, "lhs", 2)?;
    c.dims(1, "rhs", 3)?;
    group_sizes(c, 2)?;
    let (lhs, rhs, sizes) = (
        c.input(0)?.clone(),
        c.input(1)?.clone(),
        c.input(2)?.clone(),
    );
    let transpose = c.bool(0);
    let blocks = gmm::default_gmm_blocks(&lhs, &rhs, transpose, c.target);
    let kernel = gmm::build_gmm(&lhs, &rhs, &sizes, transpose, blocks, c.target)?;
    let cap = gmm::visit_capacity(lhs.shape[0], sizes.shape[0], blocks.tm);
    let mut args: Vec<Operand> = (0..4)
        .map(|i| host(i, Type::vector(DType::I32, &[cap])))
        .collect();
    args.extend([input(0, lhs.clone()), input(1, rhs)]);
    let m = lhs.shape[0];
    Ok(single(c, kernel, args, &[]).with_host(
        &[2],
        Box::new(move |v| {
            let sizes = gmm::check_sizes("gmm", v[0], m)?;
            Ok(gmm::group_metadata(&sizes, m, blocks.tm, false).arrays(false))
        }),
    ))
}

fn plan_tgmm(c: &Call) -> Result<Plan, KernelError> {
    c.dims(0, "lhs", 2)?;
    c.dims(1, "grad", 2)?;
    group_sizes(c, 2)?;
    let (lhs, grad, sizes) = (
        c.input(0)?.clone(),
        c.input(1)?.clone(),
        c.input(2)?.clone(),
    );
    let blocks = gmm::default_tgmm_blocks(&lhs, &grad, c.target);
    let kernel = gmm::build_tgmm(&lhs, &grad, &sizes, blocks, c.target)?;
    let cap = gmm::visit_capacity(lhs.shape[0], sizes.shape[0], blocks.tm);
    let mut args: Vec<Operand> = (0..6)
        .map(|i| host(i, Type::vector(DType::I32, &[cap])))
        .collect();
    args.extend([input(0, lhs.clone()), input(1, grad)]);
    let m = lhs.shape[0];
    Ok(single(c, kernel, args, &[]).with_host(
        &[2],
        Box::new(move |v| {
            let sizes = gmm::check_sizes("tgmm", v[0], m)?;
            Ok(gmm::group_metadata(&sizes, m, blocks.tm, true).arrays(true))
        }),
    ))
}

fn plan_router_topk(c: &Call) -> Result<Plan, KernelError> {
    let logits = c.input(0)?.clone();
    let gate = match c.str(1) {
        "softmax" => Gate::Softmax,
        "sigmoid" => Gate::Sigmoid,
        other => {
            return Err(c.err(
                "argument `gate`",
                "option-value",
                format!("gate = {other:?}"),
                "use \"softmax\" or \"sigmoid\"",
            ))
        }
    };
    let kernel = routing::router_topk(&logits, c.usize(0, "k")?, gate, c.bool(2), c.target)?;
    Ok(single(c, kernel, vec![input(0, logits)], &[]))
}

/// The `[t, k]` int32 expert ids of a routing call.
fn expert_ids(c: &Call, i: usize) -> Result<(usize, usize), KernelError> {
    let ids = c.input(i)?;
    match ids.shape[..] {
        [t, k] if ids.dtype == DType::I32 => Ok((t, k)),
        _ => Err(c.err(
            "input `expert_ids`",
            "operand-shape",
            format!("expert_ids is {ids}"),
            "pass the [tokens, k] int32 expert ids from router_topk",
        )),
    }
}

/// The MoE routing order of `ids`, errors reported as op `op`'s.
fn routing_plan(op: &str, ids: &Array, experts: usize) -> Result<routing::Routing, KernelError> {
    routing::plan(ids, experts).map_err(|e| KernelError {
        kernel: op.to_string(),
        ..e
    })
}

fn plan_permute(c: &Call) -> Result<Plan, KernelError> {
    let x = c.input(0)?.clone();
    let (t, k) = expert_ids(c, 1)?;
    let experts = c.usize(0, "num_experts")?;
    if x.shape.first() != Some(&t) {
        return Err(c.err(
            "input `x`",
            "routing-shape",
            format!("x is {x}, expert_ids has {t} tokens"),
            format!("pass x of shape [{t}, d]"),
        ));
    }
    let kernel = routing::permute_for(&x, t * k, c.target)?;
    let launch = Launch::new(
        kernel,
        vec![host(0, Type::vector(DType::I32, &[t * k, 1])), input(0, x)],
    );
    let results = vec![
        result(0, 0, launch.outputs[0].clone()),
        host(1, Type::vector(DType::I32, &[experts])),
    ];
    Ok(Plan::new(c.op, c.target, vec![launch], results).with_host(
        &[1],
        Box::new(move |v| {
            let r = routing_plan("permute", v[0], experts)?;
            Ok(vec![
                Array::from_i32(&[t * k, 1], r.src),
                Array::from_i32(&[experts], r.group_sizes),
            ])
        }),
    ))
}

fn plan_combine(c: &Call) -> Result<Plan, KernelError> {
    let (y, weights) = (c.input(0)?.clone(), c.input(1)?.clone());
    let (t, k) = expert_ids(c, 2)?;
    let experts = c.usize(0, "num_experts")?;
    if weights.shape != [t, k] || y.shape.first() != Some(&(t * k)) {
        return Err(c.err(
            "input `y`",
            "routing-shape",
            format!("y is {y} and weights {weights}, expert_ids is [{t}, {k}]"),
            format!("pass y [{}, d] and weights [{t}, {k}]", t * k),
        ));
    }
    let pos = Type::vector(DType::I32, &[t, k]);
    let kernel = routing::combine_for(&weights, &pos, &y, c.target)?;
    Ok(single(
        c,
        kernel,
        vec![input(1, weights), host(0, pos), input(0, y)],
        &[],
    )
    .with_host(
        &[2],
        Box::new(move |v| {
            let r = routing_plan("combine", v[0], experts)?;
            Ok(vec![Array::from_i32(&[t, k], r.pos)])
        }),
    ))
}

// ---- attention --------------------------------------------------------------------------------

/// The attention statics `(causal, sm_scale, soft_cap)`, the first three of both ops.
fn attention_params(c: &Call, q: &Type) -> AttentionParams {
    let d = q.shape.get(3).copied().unwrap_or(1);
    let mut params = AttentionParams::new(d, c.bool(0));
    if let Some(s) = c.f64_opt(1) {
        params.sm_scale = s as f32;
    }
    params.soft_cap = c.f64_opt(2).map(|x| x as f32);
    params
}

fn segment_operands(
    c: &Call,
    seg: usize,
    b: usize,
    sq: usize,
    skv: usize,
) -> Result<(bool, [Operand; 2]), KernelError> {
    let given = (
        c.inputs.get(seg).is_some_and(Option::is_some),
        c.inputs.get(seg + 1).is_some_and(Option::is_some),
    );
    match given {
        (false, false) => {
            let dummy = Type::vector(DType::I32, &[1, 1, 1]);
            Ok((false, [host(0, dummy.clone()), host(1, dummy)]))
        }
        (true, true) => {
            for (i, name, n) in [(seg, "q_segment_ids", sq), (seg + 1, "kv_segment_ids", skv)] {
                let t = c.input(i)?;
                if t.dtype != DType::I32 || t.shape != [b, n] {
                    return Err(c.err(
                        format!("input `{name}`"),
                        "operand-shape",
                        format!("{name} is {t}"),
                        format!("pass int32 segment ids of shape [{b}, {n}]"),
                    ));
                }
            }
            Ok((
                true,
                [
                    input(seg, Type::vector(DType::I32, &[b, sq, 1])),
                    input(seg + 1, Type::vector(DType::I32, &[b, 1, skv])),
                ],
            ))
        }
        _ => Err(c.err(
            "input `q_segment_ids`",
            "segment-ids",
            "only one of q_segment_ids and kv_segment_ids is given",
            "pass both or neither",
        )),
    }
}

/// Host arrays 0 and 1: the kernels' placeholder segment ids when none are given.
fn dummy_segments() -> crate::plan::HostFn {
    Box::new(|_| {
        Ok(vec![
            Array::from_i32(&[1, 1, 1], vec![0]),
            Array::from_i32(&[1, 1, 1], vec![0]),
        ])
    })
}

fn qkv(c: &Call) -> Result<(Type, Type, Type), KernelError> {
    for (i, name) in [(0, "q"), (1, "k"), (2, "v")] {
        c.dims(i, name, 4)?;
    }
    Ok((
        c.input(0)?.clone(),
        c.input(1)?.clone(),
        c.input(2)?.clone(),
    ))
}

fn plan_flash_attention_fwd(c: &Call) -> Result<Plan, KernelError> {
    let (q, k, v) = qkv(c)?;
    let params = attention_params(c, &q);
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    let (segmented, seg) = segment_operands(c, 3, b, sq, k.shape[2])?;
    let blocks = attention::default_forward_blocks(&q, &k, segmented, c.target);
    let kernel =
        attention::build_flash_attention(&q, &k, &v, segmented, &params, blocks, c.target)?;
    let [qs, ks] = seg;
    let plan = single(
        c,
        kernel,
        vec![input(0, q), input(1, k), input(2, v), qs, ks],
        &[None, Some(vec![b, h, sq])],
    );
    Ok(if segmented {
        plan
    } else {
        plan.with_host(&[], dummy_segments())
    })
}

fn plan_flash_attention_bwd(c: &Call) -> Result<Plan, KernelError> {
    let (q, k, v) = qkv(c)?;
    let params = attention_params(c, &q);
    let (b, h, sq) = (q.shape[0], q.shape[1], q.shape[2]);
    for (i, name) in [(3, "o"), (5, "do")] {
        let t = c.input(i)?;
        if *t != q {
            return Err(c.err(
                format!("input `{name}`"),
                "operand-shape",
                format!("{name} is {t}, q is {q}"),
                format!("pass {name} with q's shape and dtype"),
            ));
        }
    }
    let lse = c.input(4)?;
    if lse.dtype != DType::F32 || lse.num_elements() != b * h * sq {
        return Err(c.err(
            "input `lse`",
            "operand-shape",
            format!("lse is {lse}"),
            format!("pass the forward's float32 lse of shape [{b}, {h}, {sq}]"),
        ));
    }
    let (segmented, [qs, ks]) = segment_operands(c, 6, b, sq, k.shape[2])?;
    let blocks = attention::default_backward_blocks(&q, &k, segmented, c.target);
    let kernels =
        attention::build_flash_attention_bwd(&q, &k, &v, segmented, &params, blocks, c.target)?;
    let col = Type::vector(DType::F32, &[b, h, sq, 1]);
    let (o, lse, dout) = (
        input(3, q.clone()),
        input(4, col.clone()),
        input(5, q.clone()),
    );
    let di = result(0, 0, col);
    let main = vec![
        input(0, q.clone()),
        input(1, k.clone()),
        input(2, v.clone()),
        qs,
        ks,
        dout.clone(),
        lse,
        di,
    ];
    let mut kernels = kernels.into_iter();
    let mut next = || kernels.next().expect("three backward kernels");
    let launches = vec![
        Launch::new(next(), vec![o, dout]),
        Launch::new(next(), main.clone()),
        Launch::new(next(), main),
    ];
    let results = vec![result(2, 0, q), result(1, 0, k), result(1, 1, v)];
    let plan = Plan::new(c.op, c.target, launches, results);
    Ok(if segmented {
        plan
    } else {
        plan.with_host(&[], dummy_segments())
    })
}

fn plan_paged_attention(c: &Call) -> Result<Plan, KernelError> {
    let types: Vec<Type> = (0..5)
        .map(|i| c.input(i).cloned())
        .collect::<Result<_, _>>()?;
    let kernel =
        paged_attention::build(&types, c.usize_opt(0, "pages_per_compute_block")?, c.target)?;
    let (q, k) = (&types[0], &types[1]);
    let (b, h, d, hkv) = (q.shape[0], q.shape[1], q.shape[2], k.shape[0]);
    let q4 = Type::vector(q.dtype, &[b, hkv, h / hkv, d]);
    let args = vec![
        input(3, types[3].clone()),
        input(4, types[4].clone()),
        input(0, q4),
        input(1, types[1].clone()),
        input(2, types[2].clone()),
    ];
    Ok(single(c, kernel, args, &[Some(q.shape.clone())]))
}

fn plan_ragged_paged_attention(c: &Call) -> Result<Plan, KernelError> {
    let types: Vec<Type> = (0..7)
        .map(|i| c.input(i).cloned())
        .collect::<Result<_, _>>()?;
    let opts = rpa::Options {
        sm_scale: c.f64_opt(0).unwrap_or(1.0) as f32,
        sliding_window: c.usize_opt(1, "sliding_window")?,
        soft_cap: c.f64_opt(2).map(|x| x as f32),
        block_q: c.usize_opt(3, "num_queries_per_block")?,
        pages_per_compute_block: c.usize_opt(4, "num_kv_pages_per_block")?,
    };
    let kernel = rpa::build(&types, &opts, c.target)?;
    let q = &types[0];
    let hkv = types[1].shape[0];
    let qk = kernel
        .ref_decl(kernel.find_ref("q").expect("the kernel has q"))
        .shape
        .clone();
    let layout = Layout::HeadMajor {
        hkv,
        group: qk[1],
        padded_tokens: qk[2],
    };
    let q_arg = Operand {
        source: Source::Input(0),
        layout,
        ty: Type::vector(q.dtype, &qk),
    };
    let args = vec![
        input(3, types[3].clone()),
        input(4, types[4].clone()),
        input(5, types[5].clone()),
        input(6, types[6].clone()),
        q_arg,
        input(1, types[1].clone()),
        input(2, types[2].clone()),
    ];
    let launch = Launch::new(kernel, args);
    let out = Operand {
        source: Source::Result {
            launch: 0,
            output: 0,
        },
        layout,
        ty: q.clone(),
    };
    Ok(Plan::new(c.op, c.target, vec![launch], vec![out]))
}

/// Every op, in registration order.
pub const OPS: &[OpDef] = &[
    OpDef { name: "matmul", schema: "(Tensor x, Tensor y) -> Tensor", doc: "x [m, k] @ y [k, n]", plan: plan_matmul },
    OpDef { name: "gelu_affine", schema: "(Tensor x, Tensor a, Tensor b) -> Tensor", doc: "gelu(x * a + b) (tanh approximation); a, b [n] broadcast over rows", plan: plan_gelu_affine },
    OpDef { name: "softmax", schema: "(Tensor x) -> Tensor", doc: "softmax over the last dim", plan: plan_softmax },
    OpDef { name: "rmsnorm", schema: "(Tensor x, Tensor weight, float eps=1e-06) -> Tensor", doc: "x * rsqrt(mean(x^2) + eps) * weight over the last dim", plan: plan_rmsnorm },
    OpDef {
        name: "rmsnorm_residual",
        schema: "(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)",
        doc: "h = x + residual; (rmsnorm(h) * weight, h)",
        plan: plan_rmsnorm_residual,
    },
    OpDef { name: "layernorm", schema: "(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> Tensor", doc: "LayerNorm over the last dim (biased variance)", plan: plan_layernorm },
    OpDef { name: "rmsnorm_bwd", schema: "(Tensor x, Tensor weight, Tensor dy, float eps=1e-06) -> (Tensor, Tensor)", doc: "(dx, dweight) of rmsnorm", plan: plan_rmsnorm_bwd },
    OpDef { name: "swiglu", schema: "(Tensor a, Tensor b) -> Tensor", doc: "silu(a) * b", plan: plan_swiglu },
    OpDef { name: "swiglu_bwd", schema: "(Tensor a, Tensor b, Tensor dy) -> (Tensor, Tensor)", doc: "(da, db) of swiglu", plan: plan_swiglu_bwd },
    OpDef {
        name: "rope",
        schema: "(Tensor x, Tensor position_ids, float theta=10000.0, bool interleaved=False) -> Tensor",
        doc: "rotary embedding of x [tokens, heads, head_dim] at int32 position_ids [tokens]",
        plan: |c| plan_rope(c, false),
    },
    OpDef {
        name: "rope_bwd",
        schema: "(Tensor dy, Tensor position_ids, float theta=10000.0, bool interleaved=False) -> Tensor",
        doc: "gradient of rope (the inverse rotation)",
        plan: |c| plan_rope(c, true),
    },
    OpDef {
        name: "cross_entropy",
        schema: "(Tensor logits, Tensor labels) -> (Tensor, Tensor)",
        doc: "(loss [t], lse [t]) in float32 for logits [t, v] and int32 labels [t]",
        plan: plan_cross_entropy,
    },
    OpDef {
        name: "cross_entropy_bwd",
        schema: "(Tensor logits, Tensor labels, Tensor lse, Tensor dloss) -> Tensor",
        doc: "dlogits = (softmax - onehot) * dloss",
        plan: plan_cross_entropy_bwd,
    },
    OpDef {
        name: "cross_entropy_with_grad",
        schema: "(Tensor logits, Tensor labels) -> (Tensor, Tensor)",
        doc: "(loss, dlogits of sum(loss)) in one pass pair",
        plan: plan_cross_entropy_with_grad,
    },
    OpDef {
        name: "quantized_matmul",
        schema: "(Tensor x, Tensor w, Tensor scale) -> Tensor",
        doc: "x [m, k] @ (int8 w [n, k] * float32 scale [n])^T",
        plan: plan_quantized_matmul,
    },
    OpDef {
        name: "gmm",
        schema: "(Tensor lhs, Tensor rhs, Tensor group_sizes, bool transpose_rhs=False) -> Tensor",
        doc: "grouped matmul: out[rows of group g] = lhs[rows] @ rhs[g]",
        plan: plan_gmm,
    },
    OpDef { name: "tgmm", schema: "(Tensor lhs, Tensor grad, Tensor group_sizes) -> Tensor", doc: "out[g] = lhs[rows of g]^T @ grad[rows of g]", plan: plan_tgmm },
    OpDef {
        name: "router_topk",
        schema: "(Tensor logits, int k=2, str gate=\"softmax\", bool normalize=True) -> (Tensor, Tensor)",
        doc: "MoE router: (weights [t, k], int32 expert_ids [t, k])",
        plan: plan_router_topk,
    },
    OpDef {
        name: "permute",
        schema: "(Tensor x, Tensor expert_ids, int num_experts) -> (Tensor, Tensor)",
        doc: "MoE dispatch: (x rows in expert-sorted order [t*k, d], int32 group_sizes [num_experts])",
        plan: plan_permute,
    },
    OpDef {
        name: "combine",
        schema: "(Tensor y, Tensor weights, Tensor expert_ids, int num_experts) -> Tensor",
        doc: "MoE combine: out[t] = sum_j weights[t, j] * y[row of (t, j)]",
        plan: plan_combine,
    },
    OpDef {
        name: "flash_attention_fwd",
        schema: "(Tensor q, Tensor k, Tensor v, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> (Tensor, Tensor)",
        doc: "flash attention: (o [b, h, sq, d], float32 lse [b, h, sq]); q [b, h, sq, d], k and v [b, hkv, skv, d]",
        plan: plan_flash_attention_fwd,
    },
    OpDef {
        name: "flash_attention_bwd",
        schema: "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool causal=False, float? sm_scale=None, float? soft_cap=None, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> (Tensor, Tensor, Tensor)",
        doc: "(dq, dk, dv) of flash attention",
        plan: plan_flash_attention_bwd,
    },
    OpDef {
        name: "paged_attention",
        schema: "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, Tensor page_indices, int? pages_per_compute_block=None) -> Tensor",
        doc: "decode attention over a paged KV cache (q pre-scaled)",
        plan: plan_paged_attention,
    },
    OpDef {
        name: "ragged_paged_attention",
        schema: "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor kv_lens, Tensor page_indices, Tensor cu_q_lens, Tensor num_seqs, float sm_scale=1.0, int? sliding_window=None, float? soft_cap=None, int? num_queries_per_block=None, int? num_kv_pages_per_block=None) -> Tensor",
        doc: "mixed prefill/decode attention over a paged KV cache",
        plan: plan_ragged_paged_attention,
    },
];
