//! The input contract of an op, read from its table entry and checked for every call
//! before its plan builder runs ([`crate::op::Op::plan_for`]): each given tensor against
//! its [`Input`]'s `kind` (dtype) and `dims` (rank and named dims, which must agree across
//! the inputs), element counts without overflow, and all of them within the target's HBM.
//! Plan builders can then index dims without re-checking them, and every op gets the same
//! errors (`operand-dtype`, `operand-rank`, `operand-shape`, `shape-overflow`,
//! `hbm-budget`) naming the op, the input, the rule and the shape to pass. Empty inputs
//! (a zero dim) are refused too: no kernel takes an empty operand.
//!
//! The dims grammar (an [`Input::dims`] string): `[item, ...]`, one item per dim:
//!
//! - a name (`t`, `num_pages`): binds the dim; every input naming it must agree;
//! - an integer (`1`): exactly that size;
//! - `...` (first item only): any number of leading dims, the same for every input that
//!   has them (`[..., n]`: rows of any rank);
//! - an expression of names and integers with `+` and `*` (`t*k`, `s + 1`): checked once
//!   its names are bound by other items;
//! - `flag ? a : b`: item `a` if the bool static `flag` is set, else `b`;
//! - `item?` (`1?`): a dim that may be left out; the rank decides (all of an input's
//!   optional items are present, or none): `[t, 1?]` is `[t]` or `[t, 1]`, `[1?, n]` is
//!   `[n]` or `[1, n]`.
//!
//! [`check_arrays`] checks the values themselves (an [`Array`]'s data against its shape and
//! dtype fields) for callers that pass arrays ([`crate::op::Op::run`]).

use std::collections::HashMap;

use tessera_dsl::interp::Array;
use tessera_dsl::{DType, KernelError, Target, Type};

use crate::op::{Input, Kind, Op, Statics};

const GIB: f64 = (1u64 << 30) as f64;

/// How an item of a dims string matches dims.
#[derive(Clone, Debug, PartialEq)]
enum Item {
    /// `...`: any number of leading dims.
    Rest,
    /// One dim: a name, an integer or an expression (conditionals already resolved).
    Dim(String),
    /// A dim that may be absent (all of an input's optional dims are present or none).
    Optional(String),
}

/// The items of `dims` with conditionals resolved against `statics`.
fn parse(dims: &str, statics: &Statics) -> Result<Vec<Item>, String> {
    let inner = dims.trim().strip_prefix('[').and_then(|d| d.strip_suffix(']')).ok_or_else(|| format!("dims `{dims}` are not bracketed"))?;
    let mut items = Vec::new();
    for (i, raw) in inner.split(',').map(str::trim).enumerate() {
        if raw.is_empty() {
            if inner.trim().is_empty() {
                break; // `[]`: a scalar
            }
            return Err(format!("dims `{dims}` have an empty item"));
        }
        let item = if raw == "..." {
            if i != 0 {
                return Err(format!("dims `{dims}`: `...` must come first"));
            }
            Item::Rest
        } else if let Some(opt) = raw.strip_suffix('?') {
            Item::Optional(resolve(opt.trim(), statics)?)
        } else {
            Item::Dim(resolve(raw, statics)?)
        };
        items.push(item);
    }
    if items.contains(&Item::Rest) && items.iter().any(|x| matches!(x, Item::Optional(_))) {
        return Err(format!("dims `{dims}`: `...` and an optional item are ambiguous together"));
    }
    Ok(items)
}

/// `flag ? a : b` resolved by the bool static `flag`; anything else as is.
fn resolve(item: &str, statics: &Statics) -> Result<String, String> {
    match item.split_once('?') {
        Some((flag, rest)) => {
            let (a, b) = rest.split_once(':').ok_or_else(|| format!("`{item}`: expected flag ? a : b"))?;
            resolve(if statics.bool(flag.trim()) { a.trim() } else { b.trim() }, statics)
        }
        None => Ok(item.trim().to_string()),
    }
}

fn is_name(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The value of expression `e` (sums of products of names and integers), `None` if a name
/// is unbound; `Err` if it overflows.
fn eval(e: &str, env: &HashMap<String, Bound>) -> Result<Option<usize>, String> {
    let mut sum = 0usize;
    for term in e.split('+') {
        let mut product = 1usize;
        for atom in term.split('*').map(str::trim) {
            let v = match atom.parse::<usize>() {
                Ok(n) => n,
                Err(_) if is_name(atom) => match env.get(atom) {
                    Some(b) => b.value,
                    None => return Ok(None),
                },
                Err(_) => return Err(format!("`{atom}` is neither a dim name nor an integer")),
            };
            product = product.checked_mul(v).ok_or_else(|| format!("`{e}` overflows"))?;
        }
        sum = sum.checked_add(product).ok_or_else(|| format!("`{e}` overflows"))?;
    }
    Ok(Some(sum))
}

/// Where a dim name got its value.
#[derive(Clone, Debug)]
struct Bound {
    value: usize,
    input: &'static str,
    ty: Type,
}

/// The torch names of the dtypes an input of `kind` takes.
fn kind_text(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32 or bfloat16",
        Kind::Float32 => "float32",
        Kind::AnyFloat => "float32, bfloat16, float8_e4m3fn or float8_e5m2",
        Kind::KvCache => "float32, bfloat16, int8, float8_e4m3fn or float8_e5m2",
        Kind::Int32 => "int32",
        Kind::Int8 => "int8",
    }
}

fn kind_accepts(kind: Kind, dtype: DType) -> bool {
    match kind {
        Kind::Float => matches!(dtype, DType::F32 | DType::BF16),
        Kind::AnyFloat => dtype.is_float(),
        Kind::KvCache => dtype.is_float() || dtype == DType::I8,
        Kind::Float32 => dtype == DType::F32,
        Kind::Int32 => dtype == DType::I32,
        Kind::Int8 => dtype == DType::I8,
    }
}

/// Element and byte counts of `shape`, `None` if either overflows.
pub fn counts(dtype: DType, shape: &[usize]) -> Option<(usize, usize)> {
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    Some((n, n.checked_mul(dtype.bytes())?))
}

/// One call's inputs against the op's contract (see the module docs). `inputs` are in
/// schema order, `None` for an absent optional tensor; counts and presence are checked by
/// the caller.
pub fn check_inputs(op: &Op, inputs: &[Option<Type>], statics: &Statics, target: &Target) -> Result<(), KernelError> {
    let err = |name: &str, rule: &'static str, message: String, help: String| KernelError::new(op.name, format!("input `{name}`"), rule, message, help);
    let bug = |m: String| KernelError::new(op.name, "op", "op-schema", m, "fix the op's `dims` strings (report this as a Tessera bug)");
    let contract = || {
        let items: Vec<String> = op.inputs.iter().zip(inputs).filter(|(_, t)| t.is_some()).map(|(i, _)| format!("{}: {}", i.name, i.dims)).collect();
        format!("the op takes {}", items.join(", "))
    };
    let mut env: HashMap<String, Bound> = HashMap::new();
    let mut lead: Option<(Vec<usize>, &'static str, Type)> = None;
    // Expressions, checked once every simple name is bound: (input, its type, dim, expr).
    let mut deferred: Vec<(&Input, &Type, usize, String)> = Vec::new();
    let mut total: usize = 0;
    let mut largest: Option<(&'static str, &Type, usize)> = None;
    for (input, ty) in op.inputs.iter().zip(inputs) {
        let Some(ty) = ty else { continue };
        let name = input.name;
        if !kind_accepts(input.kind, ty.dtype) {
            return Err(err(name, "operand-dtype", format!("`{name}` is {ty}; the op takes {}", kind_text(input.kind)), format!("pass `{name}` as {}", kind_text(input.kind))));
        }
        let Some((_, bytes)) = counts(ty.dtype, &ty.shape) else {
            return Err(err(name, "shape-overflow", format!("`{name}` has shape {:?}: its {} count overflows a 64-bit count", ty.shape, ty.dtype), "check the shape: no array has that many elements".into()));
        };
        // Every input reaches a kernel (or shares its dims with one that does), and the
        // kernels take no empty operands (the verifier's operand-shape): say so here, in the
        // input's terms, rather than as a zero block or grid of some kernel.
        if let Some(d) = ty.shape.iter().position(|&x| x == 0) {
            return Err(err(name, "operand-shape", format!("`{name}` is {ty}: dim {d} is 0, an empty array"), "pass non-empty inputs (skip the call for an empty batch)".into()));
        }
        total = total.saturating_add(bytes);
        if largest.is_none_or(|(_, _, b)| bytes > b) {
            largest = Some((name, ty, bytes));
        }
        let items = parse(input.dims, statics).map_err(bug)?;
        let fixed = items.iter().filter(|i| matches!(i, Item::Dim(_))).count();
        let optional = items.iter().filter(|i| matches!(i, Item::Optional(_))).count();
        let rest = items.first() == Some(&Item::Rest);
        let rank = ty.rank();
        let rank_ok = if rest { rank >= fixed } else { rank == fixed || rank == fixed + optional };
        if !rank_ok {
            let want = if rest {
                format!("at least {fixed}")
            } else if optional > 0 {
                format!("{fixed} or {}", fixed + optional)
            } else {
                fixed.to_string()
            };
            let unit = if want == "1" { "dim" } else { "dims" };
            return Err(err(name, "operand-rank", format!("`{name}` is {ty}, rank {rank}; the op takes `{name}` as {} ({want} {unit})", input.dims), format!("pass `{name}` with {want} {unit}; {}", contract())));
        }
        // The dims each item matches: leading dims for `...`, then one per item.
        let (lead_dims, own) = ty.shape.split_at(if rest { rank - fixed } else { 0 });
        if rest {
            match &lead {
                Some((l, src, src_ty)) if l.as_slice() != lead_dims => {
                    return Err(err(
                        name,
                        "operand-shape",
                        format!("`{name}` is {ty}: its leading dims {lead_dims:?} differ from `{src}`'s {l:?} ({src_ty})"),
                        format!("pass `{name}` of shape {}; {}", expected(&items, &env, Some(l)), contract()),
                    ));
                }
                Some(_) => {}
                None => lead = Some((lead_dims.to_vec(), name, ty.clone())),
            }
        }
        // Optional items take dims only when the rank has room for all of them.
        let with_optional = rank > fixed;
        let exprs = items.iter().filter_map(|i| match i {
            Item::Rest => None,
            Item::Dim(e) => Some(e),
            Item::Optional(e) => with_optional.then_some(e),
        });
        for (d, (e, &got)) in exprs.zip(own).enumerate() {
            let at = d + lead_dims.len();
            if let Ok(n) = e.parse::<usize>() {
                if n != got {
                    return Err(err(name, "operand-shape", format!("`{name}` is {ty}: its dim {at} is {got}, the op takes {n} there ({})", input.dims), format!("pass `{name}` of shape {}; {}", expected(&items, &env, lead.as_ref().map(|l| &l.0)), contract())));
                }
            } else if is_name(e) {
                match env.get(e.as_str()) {
                    Some(b) if b.value != got => {
                        return Err(err(
                            name,
                            "operand-shape",
                            format!("`{name}` is {ty}: its dim {at} (`{e}` of {}) is {got}, but `{e}` is {} in `{}` ({})", input.dims, b.value, b.input, b.ty),
                            format!("pass `{name}` of shape {}; {}", expected(&items, &env, lead.as_ref().map(|l| &l.0)), contract()),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        env.insert(e.clone(), Bound { value: got, input: name, ty: ty.clone() });
                    }
                }
            } else {
                deferred.push((input, ty, at, e.clone()));
            }
        }
    }
    for (input, ty, at, e) in deferred {
        let name = input.name;
        let want = eval(&e, &env).map_err(|m| err(name, "shape-overflow", format!("`{name}` is {ty}: {m}"), "check the shapes of the inputs that set its dims".into()))?;
        if let Some(want) = want.filter(|&w| w != ty.shape[at]) {
            let items = parse(input.dims, statics).map_err(bug)?;
            let from: Vec<String> = names_in(&e).filter_map(|n| env.get(n).map(|b| format!("`{n}` = {} in `{}`", b.value, b.input))).collect();
            return Err(err(
                name,
                "operand-shape",
                format!("`{name}` is {ty}: its dim {at} (`{e}` of {}) is {}, but `{e}` is {want} ({})", input.dims, ty.shape[at], from.join(", ")),
                format!("pass `{name}` of shape {}; {}", expected(&items, &env, lead.as_ref().map(|l| &l.0)), contract()),
            ));
        }
    }
    // Every input is device memory on a TPU: together they must fit one device's HBM.
    if let Some((big, big_ty, _)) = largest.filter(|_| total > target.hbm_usable_bytes) {
        return Err(KernelError::new(
            op.name,
            format!("input `{big}`"),
            "hbm-budget",
            format!("the inputs take {:.2} GiB together, more than the {:.2} GiB of HBM a {target} device can use; the largest is `{big}` ({big_ty})", total as f64 / GIB, target.hbm_usable_bytes as f64 / GIB),
            "split the work across calls or devices, or use a smaller dtype",
        ));
    }
    Ok(())
}

/// The names an expression reads.
fn names_in(e: &str) -> impl Iterator<Item = &str> {
    e.split(['+', '*']).map(str::trim).filter(|a| is_name(a))
}

/// The shape an input should have, as far as the bound names tell: `[8, n]`.
fn expected(items: &[Item], env: &HashMap<String, Bound>, lead: Option<&Vec<usize>>) -> String {
    let mut out: Vec<String> = Vec::new();
    for item in items {
        match item {
            Item::Rest => match lead {
                Some(l) => out.extend(l.iter().map(|d| d.to_string())),
                None => out.push("...".into()),
            },
            // The canonical shape: optional dims left out.
            Item::Optional(_) => {}
            Item::Dim(e) => out.push(eval(e, env).ok().flatten().map_or_else(|| e.clone(), |v| v.to_string())),
        }
    }
    format!("[{}]", out.join(", "))
}

/// Arrays given to an op (`None`: absent) against their own fields: the data's dtype is
/// the array's `dtype` and its length the product of its `shape`. A caller's inconsistent
/// array is its mistake (`argument-dtype` / `argument-shape` naming the input), found
/// before anything reads it.
pub fn check_arrays(op: &Op, arrays: &[Option<&Array>]) -> Result<(), KernelError> {
    for (i, a) in arrays.iter().enumerate() {
        let Some(a) = a else { continue };
        let name = op.inputs.get(i).map_or_else(|| format!("tensor input {i}"), |inp| format!("input `{}`", inp.name));
        check_array(op.name, &name, a.dtype, &a.shape, a.data.dtype(), a.data.len())?;
    }
    Ok(())
}

/// One array's fields: `dtype` / `shape` as declared, `data_dtype` / `len` of its data.
pub fn check_array(op: &str, subject: &str, dtype: DType, shape: &[usize], data_dtype: DType, len: usize) -> Result<(), KernelError> {
    if data_dtype != dtype {
        return Err(KernelError::new(op, subject, "argument-dtype", format!("the array says {dtype} but its data is {data_dtype}"), "pass an array whose dtype field is its data's (the Array constructors set both)"));
    }
    match shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
        Some(n) if n == len => Ok(()),
        Some(n) => Err(KernelError::new(op, subject, "argument-shape", format!("the array's shape {shape:?} has {n} elements but its data holds {len}"), "pass an array with one data element per index of its shape")),
        None => Err(KernelError::new(op, subject, "argument-shape", format!("the array's shape {shape:?} has more elements than a 64-bit count holds (its data holds {len})"), "pass an array with one data element per index of its shape")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Schema;

    fn statics(schema: &str, text: &str) -> Statics {
        Statics::parse(&Schema::parse(schema).unwrap(), text).unwrap()
    }

    #[test]
    fn parses_dims() {
        let s = statics("(Tensor a, bool t=False) -> Tensor", "t=True");
        assert_eq!(parse("[..., n]", &s).unwrap(), vec![Item::Rest, Item::Dim("n".into())]);
        assert_eq!(parse("[g, t ? n : k, t ? k : n]", &s).unwrap(), vec![Item::Dim("g".into()), Item::Dim("n".into()), Item::Dim("k".into())]);
        assert_eq!(parse("[t, 1?]", &s).unwrap(), vec![Item::Dim("t".into()), Item::Optional("1".into())]);
        assert_eq!(parse("[]", &s).unwrap(), vec![]);
        assert_eq!(parse("[1?, n]", &s).unwrap(), vec![Item::Optional("1".into()), Item::Dim("n".into())]);
        assert!(parse("[n, ...]", &s).is_err());
        assert!(parse("[..., n, 1?]", &s).is_err());
        assert!(parse("n", &s).is_err());
    }

    #[test]
    fn evaluates_expressions() {
        let mut env = HashMap::new();
        for (n, v) in [("t", 6), ("k", 2)] {
            env.insert(n.to_string(), Bound { value: v, input: "x", ty: Type::vector(DType::F32, &[1]) });
        }
        assert_eq!(eval("t*k", &env), Ok(Some(12)));
        assert_eq!(eval("t + 1", &env), Ok(Some(7)));
        assert_eq!(eval("s + 1", &env), Ok(None));
        env.insert("big".into(), Bound { value: usize::MAX, input: "x", ty: Type::vector(DType::F32, &[1]) });
        assert!(eval("big * k", &env).is_err());
    }
}
