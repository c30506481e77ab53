//! The kernel function's parameters: operands (`In<..>`, `Out<..>`, `Prefetch<..>`,
//! `Smem<..>`), scratch buffers (`Scratch`) and static build-time parameters.

use quote::ToTokens;
use syn::{FnArg, GenericArgument, Ident, Pat, PathArguments, Signature, Type};

use crate::attr::Errors;

/// What a kernel parameter is. The order of the variants is the signature order the
/// builder requires (prefetch, inputs, outputs, scratch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RefKind {
    Prefetch,
    /// `In<..>` (blocked, VMEM) or `Smem<..>` (whole, SMEM).
    Input,
    Output,
    Scratch,
}

/// One dim of an operand's declared shape.
#[derive(Clone)]
pub enum Dim {
    /// Bound to the actual extent at build time (and checked against earlier bindings).
    Name(Ident),
    /// Checked against the actual extent.
    Lit(syn::LitInt),
    /// Anything.
    Any,
}

/// Where an operand lives: blocked in VMEM, or seen whole in SMEM or HBM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Vmem,
    /// `Smem<..>` inputs and prefetch operands live whole in SMEM.
    Smem,
    /// `Any<..>` inputs stay whole in HBM (Pallas `ANY`); the body moves them by DMA.
    Any,
}

pub struct RefParam {
    pub name: Ident,
    pub kind: RefKind,
    pub place: Place,
    /// The declared operand shape (empty for scratch, which is declared in the attribute).
    pub dims: Vec<Dim>,
}

impl RefParam {
    /// Whether the operand takes a block spec (`In<..>`, `Out<..>`).
    pub fn blocked(&self) -> bool {
        matches!(self.kind, RefKind::Output | RefKind::Input) && self.place == Place::Vmem
    }

    /// The parameter kind as written by the user.
    pub fn wrapper(&self) -> &'static str {
        match (self.kind, self.place) {
            (RefKind::Prefetch, _) => "Prefetch",
            (RefKind::Input, Place::Vmem) => "In",
            (RefKind::Input, Place::Smem) => "Smem",
            (RefKind::Input, Place::Any) => "Any",
            (RefKind::Output, Place::Any) => "AnyOut",
            (RefKind::Output, _) => "Out",
            (RefKind::Scratch, _) => "Scratch",
        }
    }

    /// `input `x``: the subject of a `KernelError` about this operand.
    pub fn subject(&self) -> String {
        let kind = match self.kind {
            RefKind::Prefetch => "prefetch",
            RefKind::Input => "input",
            RefKind::Output => "output",
            RefKind::Scratch => "scratch",
        };
        format!("{kind} `{}`", self.name)
    }

    /// The type as written, e.g. `In<m, 128>`.
    pub fn decl_text(&self) -> String {
        let d = self.dims_text();
        format!("{}<{}>", self.wrapper(), &d[1..d.len() - 1])
    }

    /// `[m, 128, _]`.
    pub fn dims_text(&self) -> String {
        let d: Vec<String> = self
            .dims
            .iter()
            .map(|d| match d {
                Dim::Name(i) => i.to_string(),
                Dim::Lit(l) => l.to_string(),
                Dim::Any => "_".to_string(),
            })
            .collect();
        format!("[{}]", d.join(", "))
    }
}

/// A plain parameter kept in the generated signature.
pub struct StaticParam {
    pub name: Ident,
    pub arg: FnArg,
    pub ty: Type,
}

pub enum Param {
    Ref(RefParam),
    Static(Box<StaticParam>),
}

const PARAM_HELP: &str = "kernel parameters are `In<dims..>`, `Out<dims..>`, `Prefetch<dims..>`, `Smem<dims..>`, `Any<dims..>`, \
`Scratch`, or plain build-time values (`usize`, `f32`, `bool`, ...); dims are names, integer literals or `_`, \
e.g. `x: In<m, k>`";

pub fn parse_params(sig: &Signature) -> syn::Result<Vec<Param>> {
    let mut errors = Errors::default();
    let mut params = Vec::new();
    if let Some(r) = &sig.receiver() {
        errors.push(syn::Error::new_spanned(r, "a kernel cannot take `self`"));
    }
    for arg in &sig.inputs {
        let FnArg::Typed(pt) = arg else { continue };
        let name = match &*pt.pat {
            Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => p.ident.clone(),
            other => {
                errors.push(syn::Error::new_spanned(other, "kernel parameters must be plain names"));
                continue;
            }
        };
        match classify(&pt.ty) {
            Ok(Some((kind, place, dims))) => {
                if let Pat::Ident(p) = &*pt.pat {
                    if p.mutability.is_some() {
                        errors.push(syn::Error::new_spanned(p.mutability, "operands are refs and cannot be `mut`; stores go through `name[..] = value`"));
                    }
                }
                params.push(Param::Ref(RefParam { name, kind, place, dims }))
            }
            Ok(None) => params.push(Param::Static(Box::new(StaticParam { name, arg: arg.clone(), ty: (*pt.ty).clone() }))),
            Err(e) => errors.push(e),
        }
    }
    // The builder numbers refs in declaration order; require that order in the source
    // so the generated signature matches what the user wrote.
    let mut last: Option<&RefParam> = None;
    for p in &params {
        let Param::Ref(r) = p else { continue };
        if let Some(prev) = last {
            if prev.kind > r.kind {
                errors.push(syn::Error::new_spanned(
                    &r.name,
                    format!(
                        "`{}: {}` comes after `{}: {}`; kernel operands must be declared in the order \
                         Prefetch, inputs (In/Smem), outputs (Out), Scratch",
                        r.name,
                        r.wrapper(),
                        prev.name,
                        prev.wrapper()
                    ),
                ));
            }
        }
        last = Some(r);
    }
    errors.finish()?;
    Ok(params)
}

/// `Some((kind, place, dims))` for a ref parameter, `None` for a static one.
fn classify(ty: &Type) -> syn::Result<Option<(RefKind, Place, Vec<Dim>)>> {
    let Type::Path(tp) = ty else {
        return match ty {
            // A `&'static str` is a static parameter like any `Copy` value (a mesh axis name).
            Type::Reference(r) if r.mutability.is_none() && r.lifetime.as_ref().is_some_and(|l| l.ident == "static") && matches!(&*r.elem, Type::Path(p) if p.path.is_ident("str")) => Ok(None),
            Type::Reference(_) | Type::Ptr(_) => Err(syn::Error::new_spanned(ty, format!("reference and pointer parameters are not supported; {PARAM_HELP}"))),
            Type::ImplTrait(_) | Type::TraitObject(_) | Type::Infer(_) | Type::Macro(_) | Type::Never(_) => {
                Err(syn::Error::new_spanned(ty, format!("unsupported parameter type; {PARAM_HELP}")))
            }
            _ => Ok(None),
        };
    };
    if tp.qself.is_some() || tp.path.segments.len() != 1 {
        return Ok(None);
    }
    let seg = &tp.path.segments[0];
    let (kind, place) = match seg.ident.to_string().as_str() {
        "In" => (RefKind::Input, Place::Vmem),
        "Smem" => (RefKind::Input, Place::Smem),
        "Any" => (RefKind::Input, Place::Any),
        "Out" => (RefKind::Output, Place::Vmem),
        "AnyOut" => (RefKind::Output, Place::Any),
        "Prefetch" => (RefKind::Prefetch, Place::Smem),
        "Scratch" => {
            if !seg.arguments.is_none() {
                return Err(syn::Error::new_spanned(&seg.arguments, "`Scratch` takes no dims: declare the buffer in the attribute, e.g. `acc = scratch([bm, bn], f32)`"));
            }
            return Ok(Some((RefKind::Scratch, Place::Vmem, Vec::new())));
        }
        _ => return Ok(None),
    };
    let dims = match &seg.arguments {
        PathArguments::AngleBracketed(a) => a.args.iter().map(dim).collect::<syn::Result<Vec<_>>>()?,
        PathArguments::None => {
            return Err(syn::Error::new_spanned(ty, format!("`{}` needs the operand's dims, e.g. `{}<m, k>`", seg.ident, seg.ident)));
        }
        PathArguments::Parenthesized(p) => return Err(syn::Error::new_spanned(p, PARAM_HELP)),
    };
    Ok(Some((kind, place, dims)))
}

fn dim(arg: &GenericArgument) -> syn::Result<Dim> {
    let bad = || syn::Error::new_spanned(arg, "a dim is a name (bound to the operand's extent), an integer literal, or `_`");
    match arg {
        GenericArgument::Type(Type::Path(p)) if p.qself.is_none() => p.path.get_ident().map(|i| Dim::Name(i.clone())).ok_or_else(bad),
        GenericArgument::Type(Type::Infer(_)) => Ok(Dim::Any),
        GenericArgument::Const(syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(l), .. })) => Ok(Dim::Lit(l.clone())),
        _ => Err(bad()),
    }
}

/// `matmul(x: In[m, k], y: In[k, n], out: Out[m, n]; bm: usize, bn: usize, bk: usize)`.
pub fn signature_text(name: &Ident, params: &[Param]) -> String {
    let refs: Vec<String> = params
        .iter()
        .filter_map(|p| match p {
            Param::Ref(r) if r.kind != RefKind::Scratch => Some(format!("{}: {}{}", r.name, r.wrapper(), r.dims_text())),
            _ => None,
        })
        .collect();
    let statics: Vec<String> = params
        .iter()
        .filter_map(|p| match p {
            Param::Static(s) => Some(format!("{}: {}", s.name, type_text(&s.ty))),
            _ => None,
        })
        .collect();
    let mut s = format!("{name}({}", refs.join(", "));
    if !statics.is_empty() {
        s.push_str("; ");
        s.push_str(&statics.join(", "));
    }
    s.push(')');
    s
}

/// A type as a user would write it (`Option<usize>`, not `Option < usize >`).
fn type_text(ty: &Type) -> String {
    let s = ty.to_token_stream().to_string();
    let mut out = String::with_capacity(s.len());
    for (i, c) in s.char_indices() {
        let prev = s[..i].chars().last();
        let next = s[i + 1..].chars().next();
        let drop_space = c == ' '
            && (matches!(next, Some('<' | '>' | ',' | ':' | ';' | ']' | ')')) || matches!(prev, Some('<' | ':' | '[' | '(' | '&')));
        if !drop_space {
            out.push(c);
        }
    }
    out
}
