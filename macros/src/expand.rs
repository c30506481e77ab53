//! Assembles the generated builder function from the attribute, the signature and the
//! lowered body.

use std::collections::HashMap;

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Ident, ItemFn};

use crate::attr::{Errors, KernelAttr, ScratchMemory};
use crate::index_map::lower_index_map;
use crate::lower::{Lowerer, RefInfo};
use crate::sig::{parse_params, signature_text, Dim, Param, Place, RefKind, RefParam};

pub fn expand(attr: KernelAttr, func: ItemFn) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let sig = &func.sig;
    if let Some(c) = &sig.constness {
        errors.push(syn::Error::new_spanned(c, "a kernel cannot be `const`"));
    }
    if let Some(a) = &sig.asyncness {
        errors.push(syn::Error::new_spanned(a, "a kernel cannot be `async`"));
    }
    if let Some(u) = &sig.unsafety {
        errors.push(syn::Error::new_spanned(u, "a kernel cannot be `unsafe`"));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push(syn::Error::new_spanned(&sig.generics, "kernels cannot be generic; use static parameters instead"));
    }
    if let syn::ReturnType::Type(_, t) = &sig.output {
        errors.push(syn::Error::new_spanned(t, "a kernel returns nothing; the macro makes it return `Result<Kernel, KernelError>`"));
    }
    let params = match parse_params(sig) {
        Ok(p) => p,
        Err(e) => {
            errors.push(e);
            errors.finish()?;
            unreachable!()
        }
    };
    let refs: Vec<&RefParam> = params.iter().filter_map(|p| if let Param::Ref(r) = p { Some(r) } else { None }).collect();

    // Attribute entries must name parameters of the right kind, and every blocked
    // operand / scratch parameter needs its entry.
    let find = |name: &Ident| refs.iter().find(|r| &r.name == name).copied();
    for (key, spec) in &attr.blocks {
        match find(key) {
            Some(r) if r.blocked() => {
                if spec.shape.len() != r.dims.len() {
                    errors.push(syn::Error::new(
                        spec.shape_span,
                        format!("the block shape has {} dims, but `{}` is declared `{}` ({} dims)", spec.shape.len(), r.name, r.decl_text(), r.dims.len()),
                    ));
                }
            }
            Some(r) => errors.push(syn::Error::new_spanned(key, format!("`{}: {}` takes no block spec (only `In<..>` and `Out<..>` operands are blocked)", r.name, r.wrapper()))),
            None => errors.push(syn::Error::new_spanned(key, format!("`{key}` is not a parameter of the kernel"))),
        }
    }
    for (key, _) in &attr.scratch {
        match find(key) {
            Some(r) if r.kind == RefKind::Scratch => {}
            Some(r) => errors.push(syn::Error::new_spanned(key, format!("`{}` is declared `{}`, not `Scratch`", r.name, r.wrapper()))),
            None => errors.push(syn::Error::new_spanned(key, format!("scratch buffer `{key}` needs a parameter `{key}: Scratch` in the kernel signature"))),
        }
    }
    for r in &refs {
        let blocked = r.blocked();
        if blocked && !attr.blocks.iter().any(|(k, _)| k == &r.name) {
            errors.push(syn::Error::new_spanned(
                &r.name,
                format!("operand `{0}` has no block spec; add `{0} = block([block dims], |grid indices| [block indices])` to `#[tpu_kernel(..)]`", r.name),
            ));
        }
        if r.kind == RefKind::Scratch && !attr.scratch.iter().any(|(k, _)| k == &r.name) {
            errors.push(syn::Error::new_spanned(&r.name, format!("scratch `{0}` is not declared; add `{0} = scratch([dims], dtype)` to `#[tpu_kernel(..)]`", r.name)));
        }
    }
    for n in attr.grid_dynamic.iter().flatten() {
        match find(n) {
            Some(r) if r.kind == RefKind::Prefetch => {}
            Some(r) => errors.push(syn::Error::new_spanned(n, format!("a dynamic grid extent is a scalar-prefetch operand (`{}: Prefetch<1>`), but `{}` is declared `{}`", n, r.name, r.wrapper()))),
            None => errors.push(syn::Error::new_spanned(n, format!("`{n}` is not a parameter of the kernel; declare the extent as `{n}: Prefetch<1>`"))),
        }
    }
    if let Some((span, sem)) = &attr.semantics {
        if sem.len() != attr.grid.len() {
            errors.push(syn::Error::new(*span, format!("{} semantics for a grid of {} dims", sem.len(), attr.grid.len())));
        }
    }

    // Names the body sees as static values: static parameters and operand dims.
    let statics: Vec<Ident> = params.iter().filter_map(|p| if let Param::Static(s) = p { Some(s.name.clone()) } else { None }).collect();
    let mut dim_names: Vec<Ident> = Vec::new();
    for r in &refs {
        for d in &r.dims {
            if let Dim::Name(i) = d {
                if refs.iter().any(|o| &o.name == i) {
                    errors.push(syn::Error::new_spanned(i, format!("dim name `{i}` is also an operand name")));
                }
                if !dim_names.contains(i) && !statics.contains(i) {
                    dim_names.push(i.clone());
                }
            }
        }
    }

    let ref_infos: HashMap<String, RefInfo> = refs
        .iter()
        .map(|r| (r.name.to_string(), RefInfo { var: format_ident!("__tessera_ref_{}", r.name), ty_var: format_ident!("__tessera_ty_{}", r.name) }))
        .collect();
    let lowerer = Lowerer::new(&ref_infos, statics.iter().chain(&dim_names).map(|i| i.to_string()));

    let shapes = bind_shapes(&refs, &statics);
    let grid = grid_and_blocks(&attr, &refs);
    let mut decls = declare_refs(&attr, &refs, &lowerer, &mut errors);
    for (d, n) in attr.grid_dynamic.iter().enumerate() {
        if let Some(n) = n {
            let var = format_ident!("__tessera_ref_{}", n);
            decls.extend(crate::lower::at(n.span()));
            decls.extend(quote!(__tessera_b.grid_extent_from(#d, #var);));
        }
    }
    let (body, body_errors) = lowerer.lower_body(&func.block);
    if let Err(e) = body_errors.finish() {
        errors.push(e);
    }
    errors.finish()?;

    // The generated function.
    let name = &sig.ident;
    let vis = &func.vis;
    let attrs = &func.attrs;
    let sig_text = signature_text(name, &params);
    let inputs = params.iter().filter_map(|p| match p {
        Param::Ref(r) if r.kind == RefKind::Scratch => None,
        Param::Ref(r) => {
            let n = &r.name;
            Some(quote!(#n: ::tessera_dsl::Type))
        }
        Param::Static(s) => Some(s.arg.to_token_stream()),
    });
    let grid_text = attr
        .grid
        .iter()
        .zip(&attr.grid_dynamic)
        .map(|(g, n)| match n {
            Some(n) => format!("dynamic({}, {n})", g.to_token_stream()),
            None => g.to_token_stream().to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ");
    let doc = format!(
        " # Tessera kernel\n\n `{sig_text}`, grid `[{grid_text}]`.\n\n Generated by `#[tpu_kernel]`: builds the kernel's block IR. Pass each operand's \
         `Type` (dtype and full shape) and the static parameters; shape mismatches are returned as a `KernelError`."
    );
    let const_name = format_ident!("{}_SIGNATURE", name.to_string().trim_start_matches("r#").to_uppercase());
    let const_doc = format!(" The signature of the `{name}` kernel, for listings.");
    let name_str = name.to_string();
    let kernel_name = match &attr.name {
        Some(e) => quote_spanned!(e.span()=> #[allow(non_snake_case)] let __tessera_KERNEL: &'static str = #e;),
        None => quote!(const __tessera_KERNEL: &str = #name_str;),
    };
    Ok(quote! {
        #(#attrs)*
        #[doc = ""]
        #[doc = #doc]
        #[allow(clippy::too_many_arguments)]
        #vis fn #name(#(#inputs),*) -> ::core::result::Result<::tessera_dsl::Kernel, ::tessera_dsl::KernelError> {
            #kernel_name
            #shapes
            let mut __tessera_builder = ::tessera_dsl::KernelBuilder::new(__tessera_KERNEL);
            // The body (its branches and fragments too) appends through `&mut KernelBuilder`.
            let __tessera_b = &mut __tessera_builder;
            #grid
            #decls
            #body
            __tessera_builder.finish()
        }

        #[doc = #const_doc]
        #vis const #const_name: &str = #sig_text;
    })
}

/// `return Err(KernelError::new(..))` for an operand-level error found at build time.
fn fail(subject: &str, rule: &str, message: TokenStream, help: &str) -> TokenStream {
    quote!(return ::core::result::Result::Err(::tessera_dsl::KernelError::new(__tessera_KERNEL, #subject, #rule, #message, #help));)
}

/// Binds each operand's `Type` and every dim name (as a `usize`), checking ranks,
/// literal dims and that a dim name means the same extent everywhere.
fn bind_shapes(refs: &[&RefParam], statics: &[Ident]) -> TokenStream {
    let mut out = TokenStream::new();
    let mut bound: HashMap<String, String> = HashMap::new();
    for r in refs.iter().filter(|r| r.kind != RefKind::Scratch) {
        let (name, ty) = (&r.name, format_ident!("__tessera_ty_{}", r.name));
        let subject = r.subject();
        let rank = r.dims.len();
        let decl = r.decl_text();
        // A clone: attribute expressions may still read the parameter (`x.shape[0]`).
        out.extend(quote!(let #ty: ::tessera_dsl::Type = ::core::clone::Clone::clone(&#name);));
        let msg = quote!(::std::format!("declared `{}` (rank {}), but the array passed is {}", #decl, #rank, #ty));
        let rank_err = fail(&subject, "operand-shape", msg, "pass an array with the declared rank");
        out.extend(quote!(if #ty.shape.len() != #rank { #rank_err }));
        if r.kind == RefKind::Prefetch {
            let msg = quote!(::std::format!("scalar-prefetch operands are i32 arrays, got {}", #ty));
            let e = fail(&subject, "operand-dtype", msg, "cast the prefetch array to int32");
            out.extend(quote!(if #ty.dtype != ::tessera_dsl::DType::I32 { #e }));
        }
        for (i, d) in r.dims.iter().enumerate() {
            match d {
                Dim::Any => {}
                Dim::Lit(l) => {
                    let msg = quote!(::std::format!("dim {} is {}, but `{}` requires {}", #i, #ty.shape[#i], #decl, #l));
                    let e = fail(&subject, "operand-shape", msg, "pass an array with the declared shape");
                    out.extend(quote!(if #ty.shape[#i] != #l { #e }));
                }
                Dim::Name(n) => {
                    let ns = n.to_string();
                    if statics.contains(n) {
                        // The dim must equal the static parameter of the same name.
                        let msg = quote!(::std::format!("dim {} (`{}`) is {}, but the parameter `{}` is {}", #i, #ns, #ty.shape[#i], #ns, #n));
                        let e = fail(&subject, "operand-shape", msg, "pass an array whose shape matches the kernel's parameters");
                        out.extend(quote!(if #ty.shape[#i] != (#n as usize) { #e }));
                    } else if let Some(first) = bound.get(&ns) {
                        let msg = quote!(::std::format!("dim {} (`{}`) is {}, but {} has `{}` = {}", #i, #ns, #ty.shape[#i], #first, #ns, #n));
                        let help = format!("operands that share the dim name `{ns}` must have the same extent there");
                        let e = fail(&subject, "operand-shape", msg, &help);
                        out.extend(quote!(if #ty.shape[#i] != #n { #e }));
                    } else {
                        bound.insert(ns, subject.clone());
                        out.extend(quote!(#[allow(unused_variables)] let #n: usize = #ty.shape[#i];));
                    }
                }
            }
        }
    }
    out
}

/// Evaluates block shapes (rejecting zero-sized blocks, which would divide by zero in
/// the grid), then the grid extents, and declares the grid.
fn grid_and_blocks(attr: &KernelAttr, refs: &[&RefParam]) -> TokenStream {
    let mut out = TokenStream::new();
    for (key, spec) in &attr.blocks {
        let Some(r) = refs.iter().find(|r| &r.name == key) else { continue };
        let var = format_ident!("__tessera_blk_{}", key);
        let dims = spec.shape.iter().map(|d| match d {
            None => quote!(::core::option::Option::None),
            Some(e) => quote_spanned!(e.span()=> ::core::option::Option::Some::<usize>(#e)),
        });
        let subject = r.subject();
        let msg = quote!(::std::format!("block dim {} of {} is 0", __tessera_d, #subject));
        let e = fail(&subject, "grid-extent", msg, "block sizes must be positive");
        out.extend(quote! {
            let #var: ::std::vec::Vec<::core::option::Option<usize>> = ::std::vec![#(#dims),*];
            for (__tessera_d, __tessera_e) in #var.iter().enumerate() {
                if *__tessera_e == ::core::option::Option::Some(0) { #e }
            }
        });
    }
    let n = attr.grid.len();
    let extents = attr.grid.iter().map(|g| quote_spanned!(g.span()=> ::core::convert::identity::<usize>(#g)));
    let texts = attr.grid.iter().map(|g| g.to_token_stream().to_string());
    let sems = (0..n).map(|i| {
        let arbitrary = attr.semantics.as_ref().and_then(|(_, s)| s.get(i)).is_some_and(|s| s == "arbitrary");
        if arbitrary {
            quote!(::tessera_dsl::Semantics::Arbitrary)
        } else {
            quote!(::tessera_dsl::Semantics::Parallel)
        }
    });
    let idx = 0..n;
    let texts = quote!(<[&str; #n]>::from([#(#texts),*]));
    let e = fail("grid", "grid-extent", quote!(::std::format!("grid dim {} (`{}`) has extent 0", __tessera_d, #texts[__tessera_d])), "make each grid extent at least 1 (is an operand smaller than its block?)");
    out.extend(quote! {
        let __tessera_grid: [usize; #n] = [#(#extents),*];
        for (__tessera_d, &__tessera_e) in __tessera_grid.iter().enumerate() {
            if __tessera_e == 0 { #e }
        }
        __tessera_b.grid(&[#((__tessera_grid[#idx], #sems)),*]);
    });
    if let Some(v) = &attr.vmem_limit_bytes {
        out.extend(quote_spanned!(v.span()=> __tessera_b.vmem_limit_bytes(::core::convert::identity::<usize>(#v));));
    }
    if let Some(mesh) = &attr.mesh {
        let axes = mesh.elems.iter();
        let id = attr.collective_id.clone().map_or(quote!(0u32), |e| quote!(#e));
        out.extend(quote_spanned!(mesh.span()=> {
            let __tessera_axes: ::std::vec::Vec<(&str, usize)> = ::std::vec![#(#axes),*];
            __tessera_b.mesh(&__tessera_axes, ::core::convert::identity::<u32>(#id));
        }));
    }
    out
}

/// Declares the refs with the builder in signature order; index maps are lowered here.
fn declare_refs(attr: &KernelAttr, refs: &[&RefParam], lowerer: &Lowerer, errors: &mut Errors) -> TokenStream {
    let mut out = TokenStream::new();
    let prefetch: HashMap<String, Ident> = refs.iter().filter(|r| r.kind == RefKind::Prefetch).map(|r| (r.name.to_string(), format_ident!("__tessera_ref_{}", r.name))).collect();
    for r in refs {
        let (var, ty, name) = (format_ident!("__tessera_ref_{}", r.name), format_ident!("__tessera_ty_{}", r.name), r.name.to_string());
        // The operand's source location is the attribute argument that declared it (its
        // name there), else its parameter: verifier errors about it point at that.
        let declared = attr.blocks.iter().map(|(k, _)| k).chain(attr.scratch.iter().map(|(k, _)| k)).find(|k| *k == &r.name).unwrap_or(&r.name);
        out.extend(crate::lower::at(declared.span()));
        let decl = match (r.kind, r.place) {
            (RefKind::Prefetch, _) => quote!(__tessera_b.prefetch(#name, &#ty.shape)),
            (RefKind::Input, Place::Smem) => quote!(__tessera_b.unblocked(::tessera_dsl::RefKind::Input, #name, #ty.dtype, &#ty.shape, ::tessera_dsl::MemorySpace::Smem)),
            (RefKind::Input, Place::Any) => quote!(__tessera_b.unblocked(::tessera_dsl::RefKind::Input, #name, #ty.dtype, &#ty.shape, ::tessera_dsl::MemorySpace::Any)),
            (RefKind::Output, Place::Any) => quote!(__tessera_b.unblocked(::tessera_dsl::RefKind::Output, #name, #ty.dtype, &#ty.shape, ::tessera_dsl::MemorySpace::Any)),
            (RefKind::Input | RefKind::Output, _) => {
                let Some((_, spec)) = attr.blocks.iter().find(|(k, _)| k == &r.name) else { continue };
                if spec.shape.len() != r.dims.len() {
                    continue; // already reported
                }
                let map = match lower_index_map(&spec.index_map, attr.grid.len(), spec.shape.len(), &prefetch) {
                    Ok(m) => m,
                    Err(e) => {
                        errors.push(e);
                        continue;
                    }
                };
                let blk = format_ident!("__tessera_blk_{}", r.name);
                let f = if r.kind == RefKind::Input { quote!(input) } else { quote!(output) };
                quote!(__tessera_b.#f(#name, #ty.dtype, &#ty.shape, ::tessera_dsl::BlockSpec { block_shape: #blk, index_map: #map }))
            }
            (RefKind::Scratch, _) => {
                let Some((_, s)) = attr.scratch.iter().find(|(k, _)| k == &r.name) else { continue };
                if matches!(s.memory, ScratchMemory::Semaphore | ScratchMemory::RegularSemaphore) {
                    let n = &s.shape[0];
                    let f = if s.memory == ScratchMemory::Semaphore { quote!(semaphores) } else { quote!(regular_semaphores) };
                    out.extend(quote!(let #ty = ::tessera_dsl::Type::vector(::tessera_dsl::DType::I32, &[#n]);));
                    out.extend(quote!(let #var: ::tessera_dsl::RefId = __tessera_b.#f(#name, #ty.shape[0]);));
                    continue;
                }
                let Some(dtype) = &s.dtype else { continue };
                let dtype = match lowerer.dtype(dtype) {
                    Ok(d) => d,
                    Err(e) => {
                        errors.push(e);
                        continue;
                    }
                };
                let dims = &s.shape;
                let mem = if s.memory == ScratchMemory::Smem { quote!(Smem) } else { quote!(Vmem) };
                out.extend(quote!(let #ty = ::tessera_dsl::Type::vector(#dtype, &[#(#dims),*]);));
                quote!(__tessera_b.scratch(#name, #ty.dtype, &#ty.shape, ::tessera_dsl::MemorySpace::#mem))
            }
        };
        out.extend(quote!(let #var: ::tessera_dsl::RefId = #decl;));
    }
    out
}
