//! Index-map closures (`|i, j, kk| [i, kk]`) to `::tessera_dsl::IndexExpr` constructors.
//!
//! Grid index names become `IndexExpr::Grid(n)`, prefetch reads `p[e]` become
//! `IndexExpr::Prefetch`, `+ - * / %`, `min`/`max` become `IndexExpr::Bin`, and any
//! subexpression that mentions neither is a static Rust value, `IndexExpr::Const`.

use std::collections::HashMap;

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{BinOp, Expr, ExprClosure, Ident, Pat, UnOp};

pub struct IndexMapCx<'a> {
    /// Grid index name -> grid dim.
    grid: HashMap<String, usize>,
    /// Prefetch operand name -> the generated `RefId` variable.
    prefetch: &'a HashMap<String, Ident>,
}

/// Lowers a closure to the `Vec<IndexExpr>` expression of a block spec. `grid_rank` is
/// the number of grid dims; `block_rank` the number of block dims.
pub fn lower_index_map(closure: &ExprClosure, grid_rank: usize, block_rank: usize, prefetch: &HashMap<String, Ident>) -> syn::Result<TokenStream> {
    if closure.inputs.len() != grid_rank {
        let (or1, inputs, or2) = (&closure.or1_token, &closure.inputs, &closure.or2_token);
        return Err(syn::Error::new_spanned(
            quote!(#or1 #inputs #or2),
            format!(
                "the index map takes {} parameter(s), but the grid has {} dim(s); it receives one index per grid dim",
                closure.inputs.len(),
                grid_rank
            ),
        ));
    }
    let mut grid = HashMap::new();
    for (n, p) in closure.inputs.iter().enumerate() {
        match p {
            Pat::Ident(pi) if pi.by_ref.is_none() && pi.mutability.is_none() && pi.subpat.is_none() => {
                grid.insert(pi.ident.to_string(), n);
            }
            Pat::Wild(_) => {}
            _ => return Err(syn::Error::new_spanned(p, "index map parameters are plain names (or `_`)")),
        }
    }
    let Expr::Array(body) = strip_parens(&closure.body) else {
        return Err(syn::Error::new_spanned(&closure.body, "the index map returns an array of block indices, e.g. `|i, j| [i, 0]`"));
    };
    if body.elems.len() != block_rank {
        return Err(syn::Error::new_spanned(
            body,
            format!("the index map returns {} block indices, but the block shape has {} dims", body.elems.len(), block_rank),
        ));
    }
    let cx = IndexMapCx { grid, prefetch };
    let elems = body.elems.iter().map(|e| cx.lower(e)).collect::<syn::Result<Vec<_>>>()?;
    Ok(quote!(::std::vec![#(#elems),*]))
}

fn strip_parens(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => strip_parens(&p.expr),
        Expr::Group(g) => strip_parens(&g.expr),
        e => e,
    }
}

impl IndexMapCx<'_> {
    /// Whether `e` depends on grid indices or prefetch values.
    fn is_dynamic(&self, e: &Expr) -> bool {
        struct V<'c, 'a>(&'c IndexMapCx<'a>, bool);
        impl<'ast> Visit<'ast> for V<'_, '_> {
            fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
                if let Some(i) = p.path.get_ident() {
                    let s = i.to_string();
                    self.1 |= self.0.grid.contains_key(&s) || self.0.prefetch.contains_key(&s);
                }
            }
        }
        let mut v = V(self, false);
        v.visit_expr(e);
        v.1
    }

    fn lower(&self, e: &Expr) -> syn::Result<TokenStream> {
        let span = e.span();
        if !self.is_dynamic(e) {
            // An unsuffixed literal needs no cast (and a cast would trip clippy in user code).
            if let Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(l), .. }) = e {
                if l.suffix().is_empty() {
                    return Ok(quote!(::tessera_dsl::IndexExpr::Const(#l)));
                }
            }
            return Ok(quote_spanned!(span=> ::tessera_dsl::IndexExpr::Const((#e) as i64)));
        }
        let bin = |op: TokenStream, a: &Expr, b: &Expr| -> syn::Result<TokenStream> {
            let (a, b) = (self.lower(a)?, self.lower(b)?);
            Ok(quote!(::tessera_dsl::IndexExpr::Bin(::tessera_dsl::IndexOp::#op, ::std::boxed::Box::new(#a), ::std::boxed::Box::new(#b))))
        };
        match e {
            Expr::Paren(p) => self.lower(&p.expr),
            Expr::Group(g) => self.lower(&g.expr),
            Expr::Path(p) => {
                let name = p.path.get_ident().map(|i| i.to_string()).unwrap_or_default();
                match self.grid.get(&name) {
                    Some(n) => Ok(quote!(::tessera_dsl::IndexExpr::Grid(#n))),
                    None => Err(syn::Error::new_spanned(e, format!("prefetch operand `{name}` is read with an index, e.g. `{name}[i]`"))),
                }
            }
            Expr::Binary(b) => {
                let op = match b.op {
                    BinOp::Add(_) => quote!(Add),
                    BinOp::Sub(_) => quote!(Sub),
                    BinOp::Mul(_) => quote!(Mul),
                    BinOp::Div(_) => quote!(Div),
                    BinOp::Rem(_) => quote!(Rem),
                    _ => return Err(syn::Error::new_spanned(b.op, "index maps support `+ - * / %`, `min(a, b)` and `max(a, b)`")),
                };
                bin(op, &b.left, &b.right)
            }
            Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => {
                let x = self.lower(&u.expr)?;
                Ok(quote!(::tessera_dsl::IndexExpr::Bin(::tessera_dsl::IndexOp::Sub, ::std::boxed::Box::new(::tessera_dsl::IndexExpr::Const(0)), ::std::boxed::Box::new(#x))))
            }
            Expr::Call(c) => {
                let f = match &*c.func {
                    Expr::Path(p) => p.path.get_ident().map(|i| i.to_string()),
                    _ => None,
                };
                let op = match f.as_deref() {
                    Some("min") => quote!(Min),
                    Some("max") => quote!(Max),
                    _ => return Err(syn::Error::new_spanned(&c.func, "index maps can call only `min(a, b)` and `max(a, b)`")),
                };
                if c.args.len() != 2 {
                    return Err(syn::Error::new_spanned(c, "`min`/`max` take two arguments"));
                }
                bin(op, &c.args[0], &c.args[1])
            }
            // `if flag { a } else { b }` on a static condition (a kernel parameter, not a
            // grid index): chosen when the kernel is built, so one kernel body serves
            // variants that differ only in a flag (e.g. a transposed operand).
            Expr::If(ei) if !self.is_dynamic(&ei.cond) => {
                let branch = |b: &syn::Block| -> syn::Result<TokenStream> {
                    match b.stmts.as_slice() {
                        [syn::Stmt::Expr(e, None)] => self.lower(e),
                        _ => Err(syn::Error::new_spanned(b, "each branch of an index-map `if` is a single index expression")),
                    }
                };
                let Some((_, else_branch)) = &ei.else_branch else {
                    return Err(syn::Error::new_spanned(ei, "an index-map `if` needs an `else` branch"));
                };
                let else_expr = match &**else_branch {
                    Expr::Block(b) => branch(&b.block)?,
                    other => self.lower(other)?,
                };
                let (cond, then_expr) = (&ei.cond, branch(&ei.then_branch)?);
                Ok(quote_spanned!(span=> if #cond { #then_expr } else { #else_expr }))
            }
            Expr::Index(ix) => {
                let name = match strip_parens(&ix.expr) {
                    Expr::Path(p) => p.path.get_ident().map(|i| i.to_string()),
                    _ => None,
                };
                let Some(array) = name.as_ref().and_then(|n| self.prefetch.get(n)) else {
                    return Err(syn::Error::new_spanned(&ix.expr, "only scalar-prefetch operands (`name: Prefetch<..>`) can be indexed in an index map"));
                };
                let idx: Vec<&Expr> = match strip_parens(&ix.index) {
                    Expr::Tuple(t) => t.elems.iter().collect(),
                    i => vec![i],
                };
                let idx = idx.into_iter().map(|i| self.lower(i)).collect::<syn::Result<Vec<_>>>()?;
                Ok(quote!(::tessera_dsl::IndexExpr::Prefetch { array: #array, index: ::std::vec![#(#idx),*] }))
            }
            _ => Err(syn::Error::new_spanned(
                e,
                "unsupported index-map expression; use grid indices, integer literals, static values, \
                 `+ - * / %`, `min(a, b)`, `max(a, b)` and prefetch reads `p[i]`",
            )),
        }
    }
}
