//! `#[tpu_fn]`: a kernel fragment, a function written in kernel syntax that kernels (and
//! other fragments) call. Its parameters typed `Value` are IR values, the others static;
//! it returns nothing, a `Value` or a tuple of them. It expands to a function that
//! appends its ops to the caller's builder:
//!
//! ```text
//! #[tpu_fn]
//! fn scores(q: Value, k: Value, scale: f32) -> Value { dot_t(q, k) * scale }
//! // expands to
//! fn scores(__tessera_b: &mut KernelBuilder, q: Value, k: Value, scale: f32) -> Value
//! ```
//!
//! A kernel calls it like any function, `let s = scores(q[..], k[..], sm_scale);`, with at
//! least one IR argument (that is how the call is recognised as a fragment call).

use proc_macro2::TokenStream;
use quote::quote;
use syn::{FnArg, ItemFn, Pat, ReturnType, Type};

use crate::lower::Lowerer;

fn is_value(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Value"))
}

pub fn expand(func: ItemFn) -> syn::Result<TokenStream> {
    let sig = &func.sig;
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(&sig.generics, "fragments cannot be generic; use static parameters"));
    }
    let mut ir = Vec::new();
    let mut statics = Vec::new();
    let mut params = Vec::new();
    for arg in &sig.inputs {
        let FnArg::Typed(pt) = arg else { return Err(syn::Error::new_spanned(arg, "fragments take no `self`")) };
        let Pat::Ident(pi) = &*pt.pat else { return Err(syn::Error::new_spanned(&pt.pat, "fragment parameters are plain names")) };
        let (name, ty) = (&pi.ident, &pt.ty);
        if is_value(ty) {
            ir.push(name.clone());
            params.push(quote!(#name: ::tessera_dsl::Value));
        } else {
            statics.push(name.to_string());
            params.push(quote!(#name: #ty));
        }
    }
    let (results, ret) = match &sig.output {
        ReturnType::Default => (0, quote!()),
        ReturnType::Type(_, t) if is_value(t) => (1, quote!(-> ::tessera_dsl::Value)),
        ReturnType::Type(_, t) => match &**t {
            Type::Tuple(tu) if !tu.elems.is_empty() && tu.elems.iter().all(is_value) => {
                let n = tu.elems.len();
                let tys = (0..n).map(|_| quote!(::tessera_dsl::Value));
                (n, quote!(-> (#(#tys),*)))
            }
            other => return Err(syn::Error::new_spanned(other, "a fragment returns nothing, a `Value` or a tuple of `Value`s")),
        },
    };
    let refs = Default::default();
    let (body, errors) = Lowerer::new(&refs, statics).with_ir_params(&ir).lower_fragment(&func.block, results);
    errors.finish()?;
    let (vis, name, attrs) = (&func.vis, &sig.ident, &func.attrs);
    Ok(quote! {
        #(#attrs)*
        #[allow(clippy::too_many_arguments)]
        #vis fn #name(__tessera_b: &mut ::tessera_dsl::KernelBuilder, #(#params),*) #ret {
            #body
        }
    })
}
