//! `#[tpu_kernel]`: turns a Rust function into a function that builds Tessera's block IR
//! through `::tessera_dsl::KernelBuilder`. See the crate README for the syntax.
//!
//! The expansion is split into attribute parsing ([`attr`]), the kernel signature
//! ([`sig`]), index-map closures ([`index_map`]), body lowering ([`lower`]) and the
//! assembly of the generated function ([`expand`]).

use proc_macro::TokenStream;

mod attr;
mod dsl_path;
mod expand;
mod fragment;
mod index_map;
mod lower;
mod sig;

/// Declares a Tessera TPU kernel. See the crate README for the full syntax.
///
/// ```ignore
/// #[tpu_kernel(
///     grid = [m / bm, n / bn],
///     x = block([bm, n], |i, j| [i, 0]),
///     out = block([bm, bn], |i, j| [i, j]),
/// )]
/// pub fn scale(x: In<m, n>, out: Out<m, n>, bm: usize, bn: usize, s: f32) {
///     out[..] = x[..] * s;
/// }
/// // expands to
/// // pub fn scale(x: Type, out: Type, bm: usize, bn: usize, s: f32) -> Result<Kernel, KernelError>
/// // pub const SCALE_SIGNATURE: &str = "scale(x: In[m, n], out: Out[m, n]; bm: usize, bn: usize, s: f32)";
/// ```
#[proc_macro_attribute]
pub fn tpu_kernel(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = match syn::parse::<attr::KernelAttr>(attr) {
        Ok(a) => a,
        // Emit only the error: the function body is kernel syntax, and compiling it as
        // plain Rust would bury the real problem under unrelated type errors.
        Err(e) => return e.to_compile_error().into(),
    };
    let func = match syn::parse::<syn::ItemFn>(item) {
        Ok(f) => f,
        Err(e) => return e.to_compile_error().into(),
    };
    match expand::expand(attr, func) {
        Ok(t) => dsl_path::resolve(t).into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// Declares a kernel fragment: a function in kernel syntax that kernels call. Parameters
/// typed `Value` are IR values, the others static; it returns nothing, a `Value` or a
/// tuple of `Value`s. See the crate README.
///
/// ```ignore
/// #[tpu_fn]
/// fn capped(s: Value, cap: f32) -> Value {
///     if cap > 0.0 { (s * (1.0 / cap)).tanh() * cap } else { s }
/// }
/// ```
#[proc_macro_attribute]
pub fn tpu_fn(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new(proc_macro2::Span::call_site(), "`#[tpu_fn]` takes no arguments").to_compile_error().into();
    }
    let func = match syn::parse::<syn::ItemFn>(item) {
        Ok(f) => f,
        Err(e) => return e.to_compile_error().into(),
    };
    match fragment::expand(func) {
        Ok(t) => dsl_path::resolve(t).into(),
        Err(e) => e.to_compile_error().into(),
    }
}
