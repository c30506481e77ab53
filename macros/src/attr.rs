//! Parsing of the `#[tpu_kernel(...)]` arguments: grid, semantics, block specs, scratch
//! declarations and compiler parameters. Everything here is syntax only; checking the
//! arguments against the function signature happens in `expand`.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprArray, ExprClosure, Ident, Token};

/// The parsed attribute.
pub struct KernelAttr {
    /// Grid extents (Rust `usize` expressions); empty = no grid (the verifier's `grid-rank`).
    pub grid: Vec<Expr>,
    /// Span of the `grid = [...]` array, for arity errors.
    pub grid_span: Span,
    /// Per grid dim: `dynamic(bound, n)` names the scalar-prefetch operand `n` holding the
    /// dim's run-time extent (`grid` then holds `bound`, the static upper bound).
    pub grid_dynamic: Vec<Option<Ident>>,
    pub semantics: Option<(Span, Vec<Ident>)>,
    pub blocks: Vec<(Ident, BlockAttr)>,
    pub scratch: Vec<(Ident, ScratchAttr)>,
    pub vmem_limit_bytes: Option<Expr>,
    /// `mesh = [("x", n), ..]`: the device mesh (axis names and sizes, major to minor) of
    /// a kernel that talks to other devices.
    pub mesh: Option<ExprArray>,
    /// `collective_id = id` (default 0): which barrier semaphore the kernel gets.
    pub collective_id: Option<Expr>,
    /// `name = expr`: the kernel's name from a `&'static str` expression over the static
    /// parameters (a family of kernels sharing one body, each under its own name).
    pub name: Option<Expr>,
}

/// `name = block([dims], |grid idx...| [block idx...])`.
pub struct BlockAttr {
    /// `None` entries are squeezed dims.
    pub shape: Vec<Option<Expr>>,
    pub shape_span: Span,
    pub index_map: ExprClosure,
}

/// `name = scratch([dims], dtype)`, `scratch_smem(...)` or `semaphores(n)`.
pub struct ScratchAttr {
    pub shape: Vec<Expr>,
    /// `None` for semaphores.
    pub dtype: Option<Expr>,
    pub memory: ScratchMemory,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ScratchMemory {
    Vmem,
    Smem,
    /// DMA semaphores (`semaphores(n)`).
    Semaphore,
    /// Counting semaphores (`regular_semaphores(n)`).
    RegularSemaphore,
}

/// `key = value`, or `(a, b, ..) = value` for operands that share one declaration.
struct Item {
    keys: Vec<Ident>,
    value: Expr,
}

impl Parse for Item {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let keys = if input.peek(syn::token::Paren) {
            let inner;
            syn::parenthesized!(inner in input);
            let names = Punctuated::<Ident, Token![,]>::parse_terminated(&inner)?;
            if names.is_empty() {
                return Err(inner.error("name the operands that share this declaration: `(k, v) = block(..)`"));
            }
            names.into_iter().collect()
        } else {
            vec![input.parse()?]
        };
        input.parse::<Token![=]>()?;
        Ok(Item { keys, value: input.parse()? })
    }
}

const ATTR_HELP: &str = "expected `grid = [..]`, `semantics = [..]`, `vmem_limit_bytes = ..`, `name = \"..\"`, or \
`<operand> = block([dims], |grid indices| [block indices])`, `<name> = scratch([dims], dtype)`, \
`<name> = scratch_smem([dims], dtype)`, `<name> = semaphores(n)`, `<name> = regular_semaphores(n)`, \
`mesh = [(\"x\", n), ..]`, `collective_id = id`; operands sharing a declaration \
can be grouped: `(k, v) = block(..)`";

impl Parse for KernelAttr {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let items = Punctuated::<Item, Token![,]>::parse_terminated(input)?;
        let mut attr = KernelAttr {
            grid: Vec::new(),
            grid_span: Span::call_site(),
            grid_dynamic: Vec::new(),
            semantics: None,
            blocks: Vec::new(),
            scratch: Vec::new(),
            vmem_limit_bytes: None,
            mesh: None,
            collective_id: None,
            name: None,
        };
        let mut errors = Errors::default();
        let mut seen: Vec<Ident> = Vec::new();
        for Item { keys, value } in items {
            if let Some(dup) = keys.iter().find(|k| seen.contains(k)) {
                errors.push(syn::Error::new_spanned(dup, format!("`{dup}` is given twice")));
                continue;
            }
            seen.extend(keys.iter().cloned());
            if keys.len() > 1 {
                // A shared declaration: the same block spec (or scratch) for each operand.
                let res = keys.iter().try_for_each(|key| {
                    parse_operand(key, value.clone()).map(|spec| match spec {
                        OperandAttr::Block(b) => attr.blocks.push((key.clone(), b)),
                        OperandAttr::Scratch(s) => attr.scratch.push((key.clone(), s)),
                    })
                });
                if let Err(e) = res {
                    errors.push(e);
                }
                continue;
            }
            let key = keys.into_iter().next().expect("one key");
            let res = match key.to_string().as_str() {
                "grid" => array(&value, "grid").and_then(|a| {
                    attr.grid_span = a.span();
                    for e in a.elems {
                        let (bound, dynamic) = grid_entry(e)?;
                        attr.grid.push(bound);
                        attr.grid_dynamic.push(dynamic);
                    }
                    Ok(())
                }),
                "semantics" => parse_semantics(&value).map(|s| attr.semantics = Some(s)),
                "vmem_limit_bytes" => {
                    attr.vmem_limit_bytes = Some(value);
                    Ok(())
                }
                "name" => {
                    attr.name = Some(value);
                    Ok(())
                }
                "mesh" => array(&value, "mesh").map(|a| attr.mesh = Some(a)),
                "collective_id" => {
                    attr.collective_id = Some(value);
                    Ok(())
                }
                _ => parse_operand(&key, value).map(|spec| match spec {
                    OperandAttr::Block(b) => attr.blocks.push((key.clone(), b)),
                    OperandAttr::Scratch(s) => attr.scratch.push((key.clone(), s)),
                }),
            };
            if let Err(e) = res {
                errors.push(e);
            }
        }
        errors.finish()?;
        Ok(attr)
    }
}

fn array(e: &Expr, what: &str) -> syn::Result<ExprArray> {
    match e {
        Expr::Array(a) => Ok(a.clone()),
        _ => Err(syn::Error::new_spanned(e, format!("`{what}` must be an array literal `[..]`"))),
    }
}

fn parse_semantics(e: &Expr) -> syn::Result<(Span, Vec<Ident>)> {
    let a = array(e, "semantics")?;
    let mut out = Vec::new();
    for el in &a.elems {
        match el {
            Expr::Path(p) if p.path.is_ident("parallel") || p.path.is_ident("arbitrary") => out.push(p.path.get_ident().unwrap().clone()),
            _ => return Err(syn::Error::new_spanned(el, "a grid dimension's semantics is `parallel` or `arbitrary`")),
        }
    }
    Ok((a.span(), out))
}

enum OperandAttr {
    Block(BlockAttr),
    Scratch(ScratchAttr),
}

fn parse_operand(key: &Ident, value: Expr) -> syn::Result<OperandAttr> {
    let Expr::Call(call) = &value else {
        return Err(syn::Error::new_spanned(&value, format!("unexpected value for `{key}`; {ATTR_HELP}")));
    };
    let func = match &*call.func {
        Expr::Path(p) => p.path.get_ident().map(|i| i.to_string()),
        _ => None,
    };
    let args: Vec<&Expr> = call.args.iter().collect();
    match func.as_deref() {
        Some("block") => {
            let [shape, map] = args[..] else {
                return Err(syn::Error::new_spanned(call, "expected `block([dims], |grid indices| [block indices])`"));
            };
            let shape_arr = array(shape, "block shape")?;
            let shape_dims = shape_arr
                .elems
                .iter()
                .map(|d| match d {
                    Expr::Path(p) if p.path.is_ident("None") => None,
                    d => Some(d.clone()),
                })
                .collect();
            let Expr::Closure(index_map) = map else {
                return Err(syn::Error::new_spanned(map, "the index map is a closure from grid indices to block indices, e.g. `|i, j| [i, 0]`"));
            };
            Ok(OperandAttr::Block(BlockAttr { shape: shape_dims, shape_span: shape_arr.span(), index_map: index_map.clone() }))
        }
        Some(f @ ("scratch" | "scratch_smem")) => {
            let [shape, dtype] = args[..] else {
                return Err(syn::Error::new_spanned(call, format!("expected `{f}([dims], dtype)`")));
            };
            let shape = array(shape, "scratch shape")?.elems.into_iter().collect();
            let memory = if f == "scratch_smem" { ScratchMemory::Smem } else { ScratchMemory::Vmem };
            Ok(OperandAttr::Scratch(ScratchAttr { shape, dtype: Some(dtype.clone()), memory }))
        }
        Some(f @ ("semaphores" | "regular_semaphores")) => {
            let [n] = args[..] else {
                return Err(syn::Error::new_spanned(call, format!("expected `{f}(n)`: an array of n semaphores")));
            };
            let memory = if f == "semaphores" { ScratchMemory::Semaphore } else { ScratchMemory::RegularSemaphore };
            Ok(OperandAttr::Scratch(ScratchAttr { shape: vec![n.clone()], dtype: None, memory }))
        }
        _ => Err(syn::Error::new_spanned(&call.func, format!("unknown operand declaration; {ATTR_HELP}"))),
    }
}

/// Collects several `syn::Error`s into one, so a user sees every problem at once.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    pub fn finish(self) -> syn::Result<()> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One `grid = [..]` entry: an extent, or `dynamic(bound, n)`: a dim of at most `bound`
/// steps whose run-time extent is the scalar-prefetch operand `n` (Pallas: a grid entry
/// traced from a scalar, as megablox gmm's active tile count).
fn grid_entry(e: Expr) -> syn::Result<(Expr, Option<Ident>)> {
    let Expr::Call(call) = &e else { return Ok((e, None)) };
    let Expr::Path(f) = &*call.func else { return Ok((e, None)) };
    if !f.path.is_ident("dynamic") {
        return Ok((e, None));
    }
    let usage = "expected `dynamic(bound, n)`: the static upper bound of the dim, then the scalar-prefetch operand (`n: Prefetch<1>`) holding its run-time extent";
    if call.args.len() != 2 {
        return Err(syn::Error::new_spanned(call, usage));
    }
    let bound = call.args[0].clone();
    match &call.args[1] {
        Expr::Path(p) if p.path.get_ident().is_some() => Ok((bound, p.path.get_ident().cloned())),
        other => Err(syn::Error::new_spanned(other, usage)),
    }
}
