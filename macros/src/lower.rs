//! Lowering of the kernel body: Rust statements to `KernelBuilder` calls.
//!
//! Every expression is either *static* (a build-time Rust value: literals, static
//! parameters, dims, `r.dtype`, `r.shape`, ...) and emitted verbatim, or *dynamic* (it
//! mentions an IR value, a ref access or a builtin such as `program_id`) and turned into
//! builder calls that produce a `::tessera_dsl::Value`. Builder calls are never nested
//! as arguments of one another (that would borrow `__tessera_b` mutably twice); each operand is
//! bound to a temporary first.

use std::collections::HashMap;

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{BinOp, Block, Expr, ExprIf, ExprIndex, Ident, Member, Pat, RangeLimits, Stmt, UnOp};

use crate::attr::Errors;

/// A ref visible in the body (operand or scratch).
pub struct RefInfo {
    /// The generated `RefId` variable.
    pub var: Ident,
    /// The generated `Type` variable (the caller's operand type, or the scratch type).
    pub ty_var: Ident,
}

#[derive(Clone, Copy)]
enum Var {
    /// An IR value (`::tessera_dsl::Value`).
    Ir { mutable: bool },
    /// A build-time Rust value; `depth` is the dynamic nesting depth where it was declared.
    Static { depth: usize },
}

const BUILTINS: &[&str] = &[
    "concat",
    "dot",
    "dot_t",
    "dot_tn",
    "select",
    "iota",
    "zeros",
    "full",
    "program_id",
    "num_programs",
    "sigmoid",
    "ds",
    "dma_start",
    "dma_wait",
    "pipe_in",
    "pipe_out",
    "prng_seed",
    "prng_random_bits",
    "device_id",
    "axis_index",
    "axis_size",
    "remote_copy_start",
    "remote_copy_wait_send",
    "remote_copy_wait_recv",
    "semaphore_signal",
    "semaphore_wait",
    "barrier_semaphore",
    "mesh_device",
];
const UNARY_METHODS: &[(&str, &str)] = &[
    ("exp", "Exp"),
    ("log", "Log"),
    ("tanh", "Tanh"),
    ("erf", "Erf"),
    ("sqrt", "Sqrt"),
    ("rsqrt", "Rsqrt"),
    ("abs", "Abs"),
    ("log1p", "Log1p"),
    ("expm1", "Expm1"),
    ("sin", "Sin"),
    ("cos", "Cos"),
    ("floor", "Floor"),
    ("ceil", "Ceil"),
    ("round", "Round"),
    ("sign", "Sign"),
];
const METHODS_HELP: &str = "supported methods on IR values: exp, log, tanh, erf, sqrt, rsqrt, abs, log1p, expm1, sin, cos, floor, ceil, round, sign, \
max(b), min(b), pow(b), shr_logical(n), cast(dtype), sum(axis), reduce_max(axis), reduce_min(axis), argmax(axis), argmin(axis), cumsum(axis), t(), reshape([dims]), broadcast_to([dims]), item()";
const BUILTINS_HELP: &str = "builtin functions: dot(a, b), dot_t(a, b), dot_tn(a, b), select(cond, a, b), concat([a, b], axis) or concat([x; n], axis), iota([dims], dim), zeros([dims], dtype), \
full([dims], dtype, value), program_id(axis), num_programs(axis), sigmoid(x), dma_start(src[..], dst[..], sem[i]), dma_wait(src[..], dst[..], sem[i]), \
prng_seed(seed, ..) (one or two i32 scalars), prng_random_bits([dims]); in a kernel with a `mesh`: device_id(), axis_index(\"x\"), \
axis_size(\"x\"), mesh_device(c0, ..), remote_copy_start(src[..], dst[..], send[i], recv[i], device) (and remote_copy_wait_send / remote_copy_wait_recv with the same \
arguments), semaphore_signal(sem[i] or barrier_semaphore(), amount[, device]), semaphore_wait(sem[i] or barrier_semaphore(), amount); ds(start, len), ds(start, len, stride) and (a..b).step_by(s) inside ref indices; \
in a `for i in pipeline(steps)` loop, pipe_in(x, [block], [indices]) and pipe_out(o, [block], [indices], value); \
any other function called with IR values is a `#[tpu_fn]` fragment";
const DTYPES: &[(&str, &str)] = &[("f32", "F32"), ("bf16", "BF16"), ("i32", "I32"), ("i8", "I8"), ("bool", "Bool"), ("float8_e4m3fn", "F8E4M3FN"), ("float8_e5m2", "F8E5M2")];

pub struct Lowerer<'a> {
    refs: &'a HashMap<String, RefInfo>,
    scopes: Vec<HashMap<String, Var>>,
    /// How many dynamic `if`/`for` bodies enclose the current statement.
    dyn_depth: usize,
    errors: Errors,
    /// The operands of the enclosing `for i in pipeline(..)` loops, innermost last: the
    /// ref names in the order of their [`tessera_dsl::PipeBlock`]s.
    pipelines: Vec<Vec<String>>,
    /// Pipeline loops lowered so far (each names its buffers `pipe<n>_..`).
    npipes: usize,
}

fn ident_of(e: &Expr) -> Option<&Ident> {
    match e {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
        Expr::Paren(p) => ident_of(&p.expr),
        Expr::Group(g) => ident_of(&g.expr),
        _ => None,
    }
}

fn strip(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => strip(&p.expr),
        Expr::Group(g) => strip(&g.expr),
        e => e,
    }
}

fn err<T>(tokens: impl ToTokens, msg: impl std::fmt::Display) -> syn::Result<T> {
    Err(syn::Error::new_spanned(tokens, msg))
}

/// `__tessera_b.at(file!(), line!(), column!())` carrying `span`, so the IR records the user's line.
pub(crate) fn at(span: Span) -> TokenStream {
    let loc = quote_spanned!(span=> ::core::file!(), ::core::line!(), ::core::column!());
    quote!(__tessera_b.at(#loc);)
}

impl<'a> Lowerer<'a> {
    /// `statics`: names bound before the body runs (static parameters, dims).
    pub fn new(refs: &'a HashMap<String, RefInfo>, statics: impl IntoIterator<Item = String>) -> Self {
        let globals = statics.into_iter().map(|s| (s, Var::Static { depth: 0 })).collect();
        Lowerer { refs, scopes: vec![globals], dyn_depth: 0, errors: Errors::default(), pipelines: Vec::new(), npipes: 0 }
    }

    /// Lowers the function body; returns the statements and every error found.
    pub fn lower_body(mut self, body: &Block) -> (TokenStream, Errors) {
        let stmts = self.stmts(&body.stmts);
        (stmts, self.errors)
    }

    /// Declares the IR-valued parameters of a `#[tpu_fn]` fragment.
    pub fn with_ir_params(mut self, names: &[Ident]) -> Self {
        for n in names {
            self.declare(n, Var::Ir { mutable: false });
        }
        self
    }

    /// Lowers a fragment's body: its statements, then its tail expression as `results`
    /// values (`0`: no tail; `1`: a `Value`; `n`: a tuple of `n` values).
    pub fn lower_fragment(mut self, body: &Block, results: usize) -> (TokenStream, Errors) {
        let (init, tail) = match body.stmts.split_last() {
            Some((Stmt::Expr(tail, None), init)) if results > 0 => (init, Some(tail)),
            _ => (&body.stmts[..], None),
        };
        let stmts = self.stmts(init);
        let tail = match (tail, results) {
            (None, 0) => Ok(quote!()),
            (None, _) => err(body, format!("the fragment returns {results} value(s): end its body with them (an expression without `;`)")),
            (Some(t), 1) => self.value(t),
            (Some(t), n) => match strip(t) {
                Expr::Tuple(tu) if tu.elems.len() == n => {
                    let vals = tu.elems.iter().map(|e| self.value(e)).collect::<syn::Result<Vec<_>>>();
                    vals.map(|v| {
                        let names: Vec<Ident> = (0..n).map(|i| format_ident!("__tessera_r{i}")).collect();
                        quote!({ #(let #names = #v;)* (#(#names),*) })
                    })
                }
                other => err(other, format!("the fragment returns {n} values: end its body with a tuple of {n} IR values")),
            },
        };
        let tail = tail.unwrap_or_else(|e| {
            self.errors.push(e);
            quote!(::core::unreachable!())
        });
        (quote!(#stmts #tail), self.errors)
    }

    // ---- environment -------------------------------------------------------------------

    fn lookup(&self, name: &str) -> Option<Var> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    fn declare(&mut self, name: &Ident, var: Var) {
        self.scopes.last_mut().unwrap().insert(name.to_string(), var);
    }

    fn ref_of(&self, e: &Expr) -> Option<&'a RefInfo> {
        let name = ident_of(e)?.to_string();
        if self.lookup(&name).is_some() {
            return None; // shadowed by a local
        }
        self.refs.get(&name)
    }

    fn scoped<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        self.scopes.push(HashMap::new());
        let r = f(self);
        self.scopes.pop();
        r
    }

    /// Whether `e` must be evaluated in the IR (see the module docs).
    fn is_dynamic(&self, e: &Expr) -> bool {
        struct V<'c, 'a>(&'c Lowerer<'a>, bool);
        impl<'ast> Visit<'ast> for V<'_, '_> {
            fn visit_expr(&mut self, e: &'ast Expr) {
                match e {
                    Expr::Path(_) => {
                        if let Some(i) = ident_of(e) {
                            let s = i.to_string();
                            self.1 |= match self.0.lookup(&s) {
                                Some(Var::Ir { .. }) => true,
                                Some(Var::Static { .. }) => false,
                                None => self.0.refs.contains_key(&s),
                            };
                        }
                    }
                    // `r.dtype` / `r.shape` are static facts about a ref.
                    Expr::Field(f) if self.0.ref_of(&f.base).is_some() && matches!(&f.member, Member::Named(m) if m == "dtype" || m == "shape") => {}
                    Expr::Call(c) => {
                        if ident_of(&c.func).is_some_and(|f| BUILTINS.contains(&f.to_string().as_str())) {
                            self.1 = true;
                        }
                        syn::visit::visit_expr(self, e);
                    }
                    _ => syn::visit::visit_expr(self, e),
                }
            }
        }
        let mut v = V(self, false);
        v.visit_expr(e);
        v.1
    }

    /// A static expression, rewritten: dtype names (`f32`) become `DType`s, `r.dtype` and
    /// `r.shape` the ref's dtype and shape (`&[usize]`).
    fn static_expr(&self, e: &Expr) -> syn::Result<Expr> {
        struct R<'c, 'a>(&'c Lowerer<'a>, Errors);
        impl VisitMut for R<'_, '_> {
            fn visit_expr_mut(&mut self, e: &mut Expr) {
                match e {
                    Expr::Path(_) => {
                        let Some(i) = ident_of(e) else { return };
                        let s = i.to_string();
                        if self.0.lookup(&s).is_none() {
                            if let Some((_, v)) = DTYPES.iter().find(|(n, _)| *n == s) {
                                let v = format_ident!("{}", v, span = i.span());
                                *e = syn::parse_quote_spanned!(i.span()=> ::tessera_dsl::DType::#v);
                            }
                        }
                    }
                    Expr::Field(f) => {
                        if let Some(r) = self.0.ref_of(&f.base) {
                            let ty = &r.ty_var;
                            match &f.member {
                                Member::Named(m) if m == "dtype" => *e = syn::parse_quote_spanned!(m.span()=> #ty.dtype),
                                Member::Named(m) if m == "shape" => *e = syn::parse_quote_spanned!(m.span()=> #ty.shape.as_slice()),
                                m => self.1.push(syn::Error::new_spanned(m, "a ref has the static fields `dtype` and `shape`")),
                            }
                        } else {
                            syn::visit_mut::visit_expr_mut(self, e);
                        }
                    }
                    Expr::Macro(m) => self.1.push(syn::Error::new_spanned(m, "macros are not supported in kernel bodies")),
                    Expr::Closure(c) => self.1.push(syn::Error::new_spanned(c, "closures are not supported in kernel bodies")),
                    _ => syn::visit_mut::visit_expr_mut(self, e),
                }
            }
        }
        let mut r = R(self, Errors::default());
        // Outer parentheses go: the expression is always embedded in a call or `let`.
        let mut e = strip(e).clone();
        r.visit_expr_mut(&mut e);
        r.1.finish()?;
        Ok(e)
    }

    /// A static expression, or an error saying `what` must be static.
    fn require_static(&self, e: &Expr, what: &str) -> syn::Result<Expr> {
        if self.is_dynamic(e) {
            return err(e, format!("{what} must be a static (build-time) value, not an IR value"));
        }
        self.static_expr(e)
    }

    fn static_usize(&self, e: &Expr, what: &str) -> syn::Result<TokenStream> {
        let s = self.require_static(e, what)?;
        Ok(quote_spanned!(e.span()=> ::core::convert::identity::<usize>(#s)))
    }

    pub fn dtype(&self, e: &Expr) -> syn::Result<TokenStream> {
        // A dtype name of another framework (`f16`, `float32`) would reach rustc as a type
        // name ("`f16` is unstable"): name the dtypes a kernel has instead.
        if let Some(i) = ident_of(e).filter(|i| self.lookup(&i.to_string()).is_none()) {
            const OTHER: &[&str] = &["f16", "f64", "i16", "i64", "u8", "u16", "u32", "u64", "half", "float", "double", "float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8"];
            if OTHER.contains(&i.to_string().as_str()) {
                let names: Vec<&str> = DTYPES.iter().map(|(n, _)| *n).collect();
                return err(e, format!("`{i}` is not a dtype of Tessera kernels; use one of {}", names.join(", ")));
            }
        }
        let s = self.require_static(e, "a dtype")?;
        Ok(quote_spanned!(e.span()=> ::core::convert::identity::<::tessera_dsl::DType>(#s)))
    }

    /// A static shape as `&[usize]`: `[d0, d1]` or any static expression (`r.shape`).
    pub fn shape(&self, e: &Expr) -> syn::Result<TokenStream> {
        match strip(e) {
            Expr::Array(a) => {
                let dims = a.elems.iter().map(|d| self.require_static(d, "a shape dim")).collect::<syn::Result<Vec<_>>>()?;
                Ok(quote_spanned!(e.span()=> ::core::convert::identity::<&[usize]>(&[#(#dims),*])))
            }
            _ => {
                let s = self.require_static(e, "a shape")?;
                Ok(quote_spanned!(e.span()=> ::core::convert::AsRef::<[usize]>::as_ref(&(#s))))
            }
        }
    }

    // ---- expressions -------------------------------------------------------------------

    /// An operand for builder calls taking `impl Into<Arg>`: a `Value` or a static `Arg`.
    fn arg(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        if self.is_dynamic(e) {
            self.dyn_value(e)
        } else {
            let s = self.static_expr(e)?;
            Ok(quote_spanned!(e.span()=> ::tessera_dsl::Arg::from(#s)))
        }
    }

    /// An expression of type `Value`; a static operand is lifted (weak literal typing).
    fn value(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        if self.is_dynamic(e) {
            self.dyn_value(e)
        } else {
            let a = self.arg(e)?;
            Ok(quote!({ let __tessera_a = #a; __tessera_b.lift(__tessera_a, ::core::option::Option::None) }))
        }
    }

    fn dyn_value(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        match e {
            Expr::Paren(p) => self.value(&p.expr),
            Expr::Group(g) => self.value(&g.expr),
            Expr::Path(_) => {
                let i = ident_of(e).expect("dynamic paths are single names");
                if self.refs.contains_key(&i.to_string()) && self.lookup(&i.to_string()).is_none() {
                    return err(e, format!("`{i}` is a ref: read it with `{i}[..]` (or `{i}[(.., ds(start, len))]`)"));
                }
                Ok(quote!(#i))
            }
            Expr::Index(ix) => self.load(ix),
            Expr::Binary(b) => self.binary(b),
            Expr::Unary(u) => {
                let op = match u.op {
                    UnOp::Neg(_) => quote!(Neg),
                    UnOp::Not(_) => quote!(Not),
                    _ => return err(u.op, "references and dereferences are not supported in kernel bodies; IR values are used by value"),
                };
                let x = self.value(&u.expr)?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.unary(::tessera_dsl::UnaryOp::#op, __tessera_x) }))
            }
            Expr::MethodCall(m) => self.method(m),
            Expr::Call(c) => self.call(c),
            Expr::If(i) => self.if_expr(i, true),
            Expr::Cast(c) => err(c, "`as` casts of IR values are not supported; use `.cast(dtype)`, e.g. `x.cast(f32)`"),
            Expr::Field(f) => err(f, "IR values have no fields; refs have the static fields `dtype` and `shape`"),
            Expr::Block(b) => {
                let b = &b.block;
                self.scoped(|l| l.value_block(b))
            }
            other => err(other, unsupported(other)),
        }
    }

    fn binary(&mut self, b: &syn::ExprBinary) -> syn::Result<TokenStream> {
        enum K {
            Bin(TokenStream),
            Cmp(TokenStream),
        }
        let k = match b.op {
            BinOp::Add(_) => K::Bin(quote!(Add)),
            BinOp::Sub(_) => K::Bin(quote!(Sub)),
            BinOp::Mul(_) => K::Bin(quote!(Mul)),
            BinOp::Div(_) => K::Bin(quote!(Div)),
            BinOp::Rem(_) => K::Bin(quote!(Rem)),
            BinOp::BitAnd(_) | BinOp::And(_) => K::Bin(quote!(And)),
            BinOp::BitOr(_) | BinOp::Or(_) => K::Bin(quote!(Or)),
            BinOp::BitXor(_) => K::Bin(quote!(Xor)),
            BinOp::Eq(_) => K::Cmp(quote!(Eq)),
            BinOp::Ne(_) => K::Cmp(quote!(Ne)),
            BinOp::Lt(_) => K::Cmp(quote!(Lt)),
            BinOp::Le(_) => K::Cmp(quote!(Le)),
            BinOp::Gt(_) => K::Cmp(quote!(Gt)),
            BinOp::Ge(_) => K::Cmp(quote!(Ge)),
            BinOp::Shl(_) => K::Bin(quote!(Shl)),
            BinOp::Shr(_) => K::Bin(quote!(Shr)),
            _ => return err(b, "compound assignment is a statement; write it on its own line"),
        };
        let l = self.arg(&b.left)?;
        let r = self.arg(&b.right)?;
        let call = match k {
            K::Bin(op) => quote!(__tessera_b.binary(::tessera_dsl::BinaryOp::#op, __tessera_l, __tessera_r)),
            K::Cmp(op) => quote!(__tessera_b.cmp(::tessera_dsl::CmpOp::#op, __tessera_l, __tessera_r)),
        };
        Ok(quote!({ let __tessera_l = #l; let __tessera_r = #r; #call }))
    }

    fn method(&mut self, m: &syn::ExprMethodCall) -> syn::Result<TokenStream> {
        let name = m.method.to_string();
        if let Some(t) = &m.turbofish {
            return err(t, format!("`.{name}()` on an IR value takes no generic arguments; a dtype is an argument, as in `.cast(i32)`"));
        }
        let args: Vec<&Expr> = m.args.iter().collect();
        let arity = |n: usize| -> syn::Result<()> {
            if args.len() != n {
                return err(m, format!("`.{name}()` takes {n} argument(s)"));
            }
            Ok(())
        };
        if let Some((_, op)) = UNARY_METHODS.iter().find(|(n, _)| *n == name) {
            arity(0)?;
            let op = format_ident!("{}", op);
            let x = self.value(&m.receiver)?;
            return Ok(quote!({ let __tessera_x = #x; __tessera_b.unary(::tessera_dsl::UnaryOp::#op, __tessera_x) }));
        }
        match name.as_str() {
            "max" | "min" | "pow" | "shr_logical" => {
                arity(1)?;
                let op = format_ident!("{}", match name.as_str() {
                    "max" => "Max",
                    "min" => "Min",
                    "pow" => "Pow",
                    _ => "ShrLogical",
                });
                let l = self.arg(&m.receiver)?;
                let r = self.arg(args[0])?;
                Ok(quote!({ let __tessera_l = #l; let __tessera_r = #r; __tessera_b.binary(::tessera_dsl::BinaryOp::#op, __tessera_l, __tessera_r) }))
            }
            "cast" => {
                arity(1)?;
                let x = self.value(&m.receiver)?;
                let d = self.dtype(args[0])?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.cast(__tessera_x, #d) }))
            }
            "bitcast" => {
                arity(1)?;
                let x = self.value(&m.receiver)?;
                let d = self.dtype(args[0])?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.bitcast(__tessera_x, #d) }))
            }
            "sum" | "reduce_max" | "reduce_min" => {
                arity(1)?;
                let op = format_ident!("{}", if name == "sum" { "Sum" } else if name == "reduce_max" { "Max" } else { "Min" });
                let x = self.value(&m.receiver)?;
                let axis = self.static_usize(args[0], "a reduction axis")?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.reduce(::tessera_dsl::ReduceOp::#op, __tessera_x, #axis) }))
            }
            "cumsum" => {
                arity(1)?;
                let x = self.value(&m.receiver)?;
                let axis = self.static_usize(args[0], "a cumsum axis")?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.cumsum(__tessera_x, #axis) }))
            }
            "argmax" | "argmin" => {
                arity(1)?;
                let f = format_ident!("{}", name);
                let x = self.value(&m.receiver)?;
                let axis = self.static_usize(args[0], "an argmax/argmin axis")?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.#f(__tessera_x, #axis) }))
            }
            "item" => {
                arity(0)?;
                let x = self.value(&m.receiver)?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.item(__tessera_x) }))
            }
            "t" => {
                arity(0)?;
                let x = self.value(&m.receiver)?;
                Ok(quote!({ let __tessera_x = #x; __tessera_b.transpose(__tessera_x) }))
            }
            "reshape" | "broadcast_to" => {
                arity(1)?;
                let x = self.value(&m.receiver)?;
                let s = self.shape(args[0])?;
                let f = format_ident!("{}", if name == "reshape" { "reshape" } else { "broadcast" });
                Ok(quote!({ let __tessera_x = #x; __tessera_b.#f(__tessera_x, #s) }))
            }
            _ => err(&m.method, format!("unknown method `.{name}()` on an IR value; {METHODS_HELP}")),
        }
    }

    fn call(&mut self, c: &syn::ExprCall) -> syn::Result<TokenStream> {
        let Some(f) = ident_of(&c.func) else {
            return err(&c.func, format!("only builtin functions can take IR values; {BUILTINS_HELP}"));
        };
        let name = f.to_string();
        let args: Vec<&Expr> = c.args.iter().collect();
        if name == "prng_seed" {
            if args.is_empty() {
                return err(c, "`prng_seed` takes one or more i32 seeds, e.g. `prng_seed(seed, program_id(0))`");
            }
        } else if name == "mesh_device" {
            if args.is_empty() {
                return err(c, "`mesh_device` takes one coordinate per mesh axis, major to minor: `mesh_device(row, col)`");
            }
        } else if name == "semaphore_signal" {
            if !(2..=3).contains(&args.len()) {
                return err(c, "`semaphore_signal` takes a semaphore, an amount and optionally a device: `semaphore_signal(ready[0], 1, peer)`");
            }
        } else if BUILTINS.contains(&name.as_str()) {
            let want = match name.as_str() {
                "device_id" | "barrier_semaphore" => 0,
                "program_id" | "num_programs" | "sigmoid" | "prng_random_bits" | "axis_index" | "axis_size" => 1,
                "remote_copy_start" | "remote_copy_wait_send" | "remote_copy_wait_recv" => 5,
                "semaphore_wait" => 2,
                "dma_start" | "dma_wait" | "pipe_in" => 3,
                "pipe_out" => 4,
                "dot" | "dot_t" | "dot_tn" | "iota" | "zeros" | "ds" | "concat" => 2,
                _ => 3,
            };
            if args.len() != want {
                return err(c, format!("`{name}` takes {want} argument(s); {BUILTINS_HELP}"));
            }
        }
        match name.as_str() {
            "dot" | "dot_t" | "dot_tn" => {
                let (a, b) = (self.value(args[0])?, self.value(args[1])?);
                // dot_t = a @ b.T, dot_tn = a.T @ b: the transposed operand is expressed by
                // its contracting dim, not by a separate transpose.
                let (tl, tr) = (name == "dot_tn", name == "dot_t");
                Ok(quote!({ let __tessera_l = #a; let __tessera_r = #b; __tessera_b.dot(__tessera_l, __tessera_r, #tl, #tr) }))
            }
            "select" => {
                let cond = self.value(args[0])?;
                let (a, b) = (self.arg(args[1])?, self.arg(args[2])?);
                Ok(quote!({ let __tessera_c = #cond; let __tessera_l = #a; let __tessera_r = #b; __tessera_b.select(__tessera_c, __tessera_l, __tessera_r) }))
            }
            "concat" => {
                // `concat([a, b, ..], axis)`, or `concat([x; n], axis)` (`jnp.tile` along `axis`).
                let axis = self.static_usize(args[1], "the concat axis")?;
                let parts = match strip(args[0]) {
                    Expr::Array(a) => {
                        let vals = a.elems.iter().map(|e| self.value(e)).collect::<syn::Result<Vec<_>>>()?;
                        quote!(::std::vec![#(#vals),*])
                    }
                    Expr::Repeat(r) => {
                        let v = self.value(&r.expr)?;
                        let n = self.static_usize(&r.len, "the number of repeats")?;
                        quote!({ let __tessera_v = #v; ::std::vec![__tessera_v; #n] })
                    }
                    e => return err(e, "`concat` takes an array of values, `[a, b]`, or a repeat, `[x; n]`, then the axis"),
                };
                Ok(quote!({ let __tessera_p: ::std::vec::Vec<::tessera_dsl::Value> = #parts; __tessera_b.concat(&__tessera_p, #axis) }))
            }
            "iota" => {
                let s = self.shape(args[0])?;
                let d = self.static_usize(args[1], "the iota dim")?;
                Ok(quote!(__tessera_b.iota(::tessera_dsl::DType::I32, #s, #d)))
            }
            "zeros" => {
                let (s, d) = (self.shape(args[0])?, self.dtype(args[1])?);
                Ok(quote!(__tessera_b.zeros(#s, #d)))
            }
            "full" => {
                let (s, d) = (self.shape(args[0])?, self.dtype(args[1])?);
                let v = self.arg(args[2])?;
                Ok(quote!({ let __tessera_v = #v; __tessera_b.full(#s, #d, __tessera_v) }))
            }
            "program_id" | "num_programs" => {
                let axis = self.static_usize(args[0], "a grid axis")?;
                let f = format_ident!("{}", name);
                Ok(quote!(__tessera_b.#f(#axis)))
            }
            "sigmoid" => {
                // 1 / (1 + exp(-x)); the literals take x's dtype.
                let x = self.value(args[0])?;
                Ok(quote!({
                    let __tessera_x = #x;
                    let __tessera_n = __tessera_b.unary(::tessera_dsl::UnaryOp::Neg, __tessera_x);
                    let __tessera_e = __tessera_b.unary(::tessera_dsl::UnaryOp::Exp, __tessera_n);
                    let __tessera_d = __tessera_b.binary(::tessera_dsl::BinaryOp::Add, ::tessera_dsl::Arg::Float(1.0), __tessera_e);
                    __tessera_b.binary(::tessera_dsl::BinaryOp::Div, ::tessera_dsl::Arg::Float(1.0), __tessera_d)
                }))
            }
            "dma_start" | "dma_wait" => {
                let (src, src_idx) = self.dma_side(args[0])?;
                let (dst, dst_idx) = self.dma_side(args[1])?;
                let sem_err = "the third argument of a DMA is one semaphore: `sem[i]`, with `sem = semaphores(n)` declared in the attribute";
                let Expr::Index(sem_ix) = strip(args[2]) else { return err(args[2], sem_err) };
                let Some(sem) = self.ref_of(&sem_ix.expr) else { return err(args[2], sem_err) };
                let sem = &sem.var;
                let i = self.arg(&sem_ix.index)?;
                let f = format_ident!("{}", name);
                Ok(quote!({
                    let __tessera_src: ::std::vec::Vec<::tessera_dsl::Index> = #src_idx;
                    let __tessera_dst: ::std::vec::Vec<::tessera_dsl::Index> = #dst_idx;
                    let __tessera_s = #i;
                    __tessera_b.#f(#src, &__tessera_src, #dst, &__tessera_dst, #sem, __tessera_s)
                }))
            }
            "device_id" => Ok(quote!(__tessera_b.device_id())),
            "mesh_device" => {
                let mut lets = TokenStream::new();
                let mut passed = Vec::new();
                for (k, a) in args.iter().enumerate() {
                    let t = format_ident!("__tessera_c{k}");
                    let v = self.arg(a)?;
                    lets.extend(quote!(let #t: ::tessera_dsl::Arg = ::std::convert::Into::into(#v);));
                    passed.push(t);
                }
                Ok(quote!({ #lets __tessera_b.mesh_device(&[#(#passed),*]) }))
            }
            "axis_index" | "axis_size" => {
                let axis = self.require_static(args[0], "a mesh axis name")?;
                let f = format_ident!("{}", name);
                Ok(quote!(__tessera_b.#f(#axis)))
            }
            "remote_copy_start" | "remote_copy_wait_send" | "remote_copy_wait_recv" => {
                let (src, src_idx) = self.dma_side(args[0])?;
                let (dst, dst_idx) = self.dma_side(args[1])?;
                let what = "of a remote copy is one DMA semaphore: `sem[i]`, with `sem = semaphores(n)` declared in the attribute";
                let (send, send_i) = self.semaphore_ix(args[2], &format!("the third argument (the send semaphore) {what}"))?;
                let (recv, recv_i) = self.semaphore_ix(args[3], &format!("the fourth argument (the receive semaphore) {what}"))?;
                let device = self.arg(args[4])?;
                let f = format_ident!("{}", name);
                Ok(quote!({
                    let __tessera_src: ::std::vec::Vec<::tessera_dsl::Index> = #src_idx;
                    let __tessera_dst: ::std::vec::Vec<::tessera_dsl::Index> = #dst_idx;
                    let __tessera_si: ::tessera_dsl::Arg = ::std::convert::Into::into(#send_i);
                    let __tessera_ri: ::tessera_dsl::Arg = ::std::convert::Into::into(#recv_i);
                    let __tessera_dev: ::tessera_dsl::Arg = ::std::convert::Into::into(#device);
                    __tessera_b.#f(&::tessera_dsl::RemoteCopy { src: #src, src_index: &__tessera_src, dst: #dst, dst_index: &__tessera_dst, send_sem: (#send, __tessera_si), recv_sem: (#recv, __tessera_ri), device: __tessera_dev })
                }))
            }
            "semaphore_signal" | "semaphore_wait" => {
                let sem = self.counting_semaphore(args[0])?;
                let amount = self.arg(args[1])?;
                if name == "semaphore_wait" {
                    return Ok(quote!({ let __tessera_s = #sem; let __tessera_a: ::tessera_dsl::Arg = ::std::convert::Into::into(#amount); __tessera_b.semaphore_wait(__tessera_s, __tessera_a) }));
                }
                let device = match args.get(2) {
                    Some(d) => {
                        let d = self.arg(d)?;
                        quote!(::core::option::Option::Some(::std::convert::Into::<::tessera_dsl::Arg>::into(#d)))
                    }
                    None => quote!(::core::option::Option::None),
                };
                Ok(quote!({ let __tessera_s = #sem; let __tessera_a: ::tessera_dsl::Arg = ::std::convert::Into::into(#amount); let __tessera_d = #device; __tessera_b.semaphore_signal(__tessera_s, __tessera_a, __tessera_d) }))
            }
            "barrier_semaphore" => err(c, "`barrier_semaphore()` names the barrier only as the semaphore of semaphore_signal / semaphore_wait"),
            "pipe_in" | "pipe_out" => {
                let Some(r) = ident_of(args[0]) else { return err(args[0], format!("`{name}` takes the pipelined operand's name first")) };
                let Some(k) = self.pipelines.last().and_then(|p| p.iter().position(|n| n == &r.to_string())) else {
                    return err(c, format!("`{name}` is only valid directly in the body of a `for i in pipeline(steps) {{ .. }}` loop"));
                };
                if name == "pipe_in" {
                    Ok(quote!(__tessera_b.pipe_load(&__tessera_blocks[#k])))
                } else {
                    let v = self.arg(args[3])?;
                    Ok(quote!({ let __tessera_v = #v; __tessera_b.pipe_store(&__tessera_blocks[#k], __tessera_v) }))
                }
            }
            "prng_seed" => {
                let mut lets = TokenStream::new();
                let mut passed = Vec::new();
                for (k, a) in args.iter().enumerate() {
                    let t = format_ident!("__tessera_s{k}");
                    let v = self.arg(a)?;
                    lets.extend(quote!(let #t: ::tessera_dsl::Arg = ::std::convert::Into::into(#v);));
                    passed.push(t);
                }
                Ok(quote_spanned!(c.span()=> { #lets __tessera_b.prng_seed(&[#(#passed),*]) }))
            }
            "prng_random_bits" => {
                let s = self.shape(args[0])?;
                Ok(quote!(__tessera_b.prng_random_bits(#s)))
            }
            "ds" => err(c, "`ds(start, len)` is a slice and only valid inside a ref index, e.g. `x[(.., ds(i * 8, 8))]`"),
            "max" | "min" | "pow" | "exp" | "log" | "tanh" | "erf" | "sqrt" | "rsqrt" | "abs" | "log1p" | "expm1" | "sin" | "cos" | "floor" | "ceil" | "round" | "sign" => {
                let hint = if matches!(name.as_str(), "max" | "min" | "pow") { format!("write `a.{name}(b)`") } else { format!("write `x.{name}()`") };
                err(f, format!("`{name}` is a method on IR values: {hint}; {BUILTINS_HELP}"))
            }
            _ => {
                // A `#[tpu_fn]` fragment: IR arguments lowered to values, static ones as
                // written; it appends its ops to this builder.
                let mut lets = TokenStream::new();
                let mut passed = Vec::new();
                for (k, a) in args.iter().enumerate() {
                    let t = format_ident!("__tessera_f{k}");
                    let v = if self.is_dynamic(a) { self.value(a)? } else { self.static_expr(a)?.to_token_stream() };
                    lets.extend(quote!(let #t = #v;));
                    passed.push(t);
                }
                Ok(quote_spanned!(f.span()=> { #lets #f(__tessera_b, #(#passed),*) }))
            }
        }
    }

    // ---- refs --------------------------------------------------------------------------

    /// The index of a ref access: `(let statements, [Index variables])`.
    fn index(&mut self, index: &Expr) -> syn::Result<(TokenStream, Vec<Ident>)> {
        let dims: Vec<&Expr> = match strip(index) {
            Expr::Range(r) if r.start.is_none() && r.end.is_none() => return Ok((quote!(), vec![])),
            Expr::Tuple(t) => t.elems.iter().collect(),
            e => vec![e],
        };
        let mut lets = TokenStream::new();
        let mut names = Vec::new();
        for (n, d) in dims.into_iter().enumerate() {
            let v = format_ident!("__tessera_i{}", n);
            let ix = match strip(d) {
                Expr::Range(r) if r.start.is_none() && r.end.is_none() => quote!(::tessera_dsl::Index::Full),
                Expr::Range(r) => {
                    let (Some(end), RangeLimits::HalfOpen(_)) = (&r.end, &r.limits) else {
                        return err(r, "a ref dim is indexed with `..`, `a..b` (static), `ds(start, len)` or a single index");
                    };
                    let end = self.require_static(end, "a range bound (use `ds(start, len)` for dynamic starts)")?;
                    let start = match &r.start {
                        Some(s) => self.require_static(s, "a range bound (use `ds(start, len)` for dynamic starts)")?.into_token_stream(),
                        None => quote!(0),
                    };
                    quote!({ let __tessera_s: usize = #start; let __tessera_e: usize = #end; ::tessera_dsl::ds(__tessera_s, __tessera_e - __tessera_s) })
                }
                Expr::Call(c) if ident_of(&c.func).is_some_and(|f| f == "ds") => {
                    if c.args.len() != 2 && c.args.len() != 3 {
                        return err(c, "`ds(start, len)` takes 2 arguments, `ds(start, len, stride)` 3 (`pl.ds`)");
                    }
                    let start = self.arg(&c.args[0])?;
                    let len = self.static_usize(&c.args[1], "a slice length")?;
                    if c.args.len() == 3 {
                        let stride = self.static_usize(&c.args[2], "a slice stride")?;
                        quote_spanned!(c.span()=> { let __tessera_s = #start; ::tessera_dsl::ds_strided(__tessera_s, #len, #stride) })
                    } else {
                        quote!({ let __tessera_s = #start; ::tessera_dsl::ds(__tessera_s, #len) })
                    }
                }
                // `(a..b).step_by(s)`: the elements a, a + s, .. below b (static bounds).
                Expr::MethodCall(m) if matches!(strip(&m.receiver), Expr::Range(_)) => {
                    let Expr::Range(r) = strip(&m.receiver) else { unreachable!() };
                    if m.method != "step_by" || m.args.len() != 1 {
                        return err(m, "a range in a ref index takes only `.step_by(stride)`: `x[((0..16).step_by(2), ..)]`, or write `ds(start, len, stride)`");
                    }
                    let (Some(end), RangeLimits::HalfOpen(_)) = (&r.end, &r.limits) else {
                        return err(r, "a strided ref index is `(a..b).step_by(s)` with both bounds (`ds(start, len, stride)` for dynamic starts)");
                    };
                    let end = self.require_static(end, "a range bound (use `ds(start, len, stride)` for dynamic starts)")?;
                    let start = match &r.start {
                        Some(s) => self.require_static(s, "a range bound (use `ds(start, len, stride)` for dynamic starts)")?.into_token_stream(),
                        None => quote!(0),
                    };
                    let stride = self.static_usize(&m.args[0], "a step_by stride")?;
                    quote_spanned!(m.span()=> {
                        let __tessera_s: usize = #start;
                        let __tessera_e: usize = #end;
                        let __tessera_k: usize = #stride;
                        // A zero step is refused by the builder (`slice-stride`).
                        let __tessera_n: usize = if __tessera_k == 0 { 1 } else { __tessera_e.saturating_sub(__tessera_s).div_ceil(__tessera_k) };
                        ::tessera_dsl::ds_strided(__tessera_s, __tessera_n, __tessera_k)
                    })
                }
                single => {
                    let start = self.arg(single)?;
                    quote!({ let __tessera_s = #start; ::tessera_dsl::ds(__tessera_s, 1) })
                }
            };
            lets.extend(quote!(let #v: ::tessera_dsl::Index = #ix;));
            names.push(v);
        }
        Ok((lets, names))
    }

    fn ref_access(&mut self, ix: &ExprIndex) -> syn::Result<(&'a RefInfo, TokenStream, Vec<Ident>)> {
        let Some(r) = self.ref_of(&ix.expr) else {
            return err(&ix.expr, "only refs (kernel operands and scratch buffers) can be indexed; IR values are whole blocks");
        };
        let (lets, names) = self.index(&ix.index)?;
        Ok((r, lets, names))
    }

    /// `sem[i]`: the semaphore array's ref variable and the index as an `Arg`.
    fn semaphore_ix(&mut self, e: &Expr, message: &str) -> syn::Result<(Ident, TokenStream)> {
        let Expr::Index(ix) = strip(e) else { return err(e, message) };
        let Some(sem) = self.ref_of(&ix.expr) else { return err(e, message) };
        let var = sem.var.clone();
        Ok((var, self.arg(&ix.index)?))
    }

    /// A counting semaphore: `sem[i]` of `regular_semaphores(n)`, or `barrier_semaphore()`.
    fn counting_semaphore(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        if let Expr::Call(c) = strip(e) {
            if ident_of(&c.func).is_some_and(|f| f == "barrier_semaphore") && c.args.is_empty() {
                return Ok(quote!(::tessera_dsl::Sem::Barrier));
            }
        }
        let (var, i) = self.semaphore_ix(e, "a semaphore signal or wait names `sem[i]` (`sem = regular_semaphores(n)` in the attribute) or `barrier_semaphore()`")?;
        Ok(quote!(::tessera_dsl::Sem::at(#var, #i)))
    }

    /// One side of a DMA: `x[index]` (a prefix of the dims; the rest are whole) or a bare
    /// ref (all of it). Returns the ref variable and an expression for its `Vec<Index>`.
    fn dma_side(&mut self, e: &Expr) -> syn::Result<(Ident, TokenStream)> {
        if let Some(r) = self.ref_of(e) {
            return Ok((r.var.clone(), quote!(::std::vec::Vec::new())));
        }
        let Expr::Index(ix) = strip(e) else {
            return err(e, "a DMA source or destination is a ref or a ref slice, e.g. `k_hbm[(h, ds(p * 16, 16))]` or `buf[slot]`");
        };
        let (r, lets, idx) = self.ref_access(ix)?;
        Ok((r.var.clone(), quote!({ #lets ::std::vec![#(#idx),*] })))
    }

    fn load(&mut self, ix: &ExprIndex) -> syn::Result<TokenStream> {
        let (r, lets, idx) = self.ref_access(ix)?;
        let var = &r.var;
        Ok(quote!({ #lets __tessera_b.load(#var, &[#(#idx),*]) }))
    }

    // ---- statements --------------------------------------------------------------------

    fn stmts(&mut self, stmts: &[Stmt]) -> TokenStream {
        let mut out = TokenStream::new();
        for s in stmts {
            match self.stmt(s) {
                Ok(t) => out.extend(t),
                Err(e) => self.errors.push(e),
            }
        }
        out
    }

    /// A block in value position: its statements, then its tail expression as a `Value`.
    fn value_block(&mut self, b: &Block) -> syn::Result<TokenStream> {
        let Some((Stmt::Expr(tail, None), init)) = b.stmts.split_last() else {
            return err(b, "this block must end with the value it produces (an expression without `;`)");
        };
        let stmts = self.stmts(init);
        let tail = self.value(tail)?;
        Ok(quote!({ #stmts #tail }))
    }

    fn stmt(&mut self, s: &Stmt) -> syn::Result<TokenStream> {
        let loc = at(s.span());
        let body = match s {
            Stmt::Local(l) => self.local(l)?,
            Stmt::Expr(e, _) => self.expr_stmt(e)?,
            Stmt::Macro(m) => return err(m, "macros are not supported in kernel bodies"),
            Stmt::Item(i) => return err(i, "items (fn, const, use, ...) cannot be declared inside a kernel body; declare them outside"),
        };
        Ok(quote!(#loc #body))
    }

    fn local(&mut self, l: &syn::Local) -> syn::Result<TokenStream> {
        let (pat, ty) = match &l.pat {
            Pat::Type(pt) => (&*pt.pat, Some(&pt.ty)),
            p => (p, None),
        };
        if let (Pat::Tuple(t), Some(init)) = (pat, &l.init) {
            // `let (a, b) = fragment(..)`: a fragment returning several IR values.
            let names = t.elems.iter().map(|p| match p {
                Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => Ok((&pi.ident, &pi.mutability)),
                other => err(other, "destructure a fragment's values into plain names: `let (a, b) = f(..);`"),
            });
            let names = names.collect::<syn::Result<Vec<_>>>()?;
            if !self.is_dynamic(&init.expr) {
                return err(pat, "only `let name = ...` and `let mut name = ...` are supported (tuples destructure a fragment's IR values)");
            }
            let v = self.value(&init.expr)?;
            let tys = names.iter().map(|_| quote!(::tessera_dsl::Value));
            let pats = names.iter().map(|(n, m)| quote!(#m #n));
            for (n, m) in &names {
                self.declare(n, Var::Ir { mutable: m.is_some() });
            }
            return Ok(quote!(let (#(#pats),*): (#(#tys),*) = #v;));
        }
        let Pat::Ident(pi) = pat else {
            return err(pat, "only `let name = ...` and `let mut name = ...` are supported (no patterns)");
        };
        if pi.by_ref.is_some() || pi.subpat.is_some() {
            return err(pi, "only `let name = ...` and `let mut name = ...` are supported (no patterns)");
        }
        let name = &pi.ident;
        let mutability = &pi.mutability;
        if self.refs.contains_key(&name.to_string()) {
            return err(name, format!("`{name}` is an operand or scratch name; pick another name"));
        }
        let Some(init) = &l.init else {
            return err(l, "declare variables with a value: `let x = ...;`");
        };
        if let Some((_, d)) = &init.diverge {
            return err(d, "`let ... else` is not supported in kernel bodies");
        }
        let e = &*init.expr;
        if self.is_dynamic(e) {
            if let Some(ty) = ty {
                return err(ty, "IR values take no type annotation; their dtype and shape are tracked by the builder");
            }
            let v = self.value(e)?;
            self.declare(name, Var::Ir { mutable: mutability.is_some() });
            Ok(quote!(let #mutability #name: ::tessera_dsl::Value = #v;))
        } else {
            let s = self.static_expr(e)?;
            let ty = ty.map(|t| quote!(: #t));
            self.declare(name, Var::Static { depth: self.dyn_depth });
            Ok(quote!(let #mutability #name #ty = #s;))
        }
    }

    fn expr_stmt(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        match e {
            Expr::Assign(a) => self.assign(&a.left, None, &a.right),
            Expr::Binary(b) => {
                let op = match b.op {
                    BinOp::AddAssign(_) => Some(quote!(Add)),
                    BinOp::SubAssign(_) => Some(quote!(Sub)),
                    BinOp::MulAssign(_) => Some(quote!(Mul)),
                    BinOp::DivAssign(_) => Some(quote!(Div)),
                    BinOp::RemAssign(_) => Some(quote!(Rem)),
                    BinOp::BitAndAssign(_) => Some(quote!(And)),
                    BinOp::BitOrAssign(_) => Some(quote!(Or)),
                    BinOp::BitXorAssign(_) => Some(quote!(Xor)),
                    BinOp::ShlAssign(_) => Some(quote!(Shl)),
                    BinOp::ShrAssign(_) => Some(quote!(Shr)),
                    _ => None,
                };
                match op {
                    Some(op) => self.assign(&b.left, Some((op, b.op)), &b.right),
                    None => self.plain_expr_stmt(e),
                }
            }
            Expr::If(i) => self.if_expr(i, false).map(|t| quote!(#t;)),
            Expr::ForLoop(f) => self.for_loop(f),
            Expr::Block(b) if b.label.is_none() => {
                let stmts = self.scoped(|l| l.stmts(&b.block.stmts));
                Ok(quote!({ #stmts }))
            }
            other => self.plain_expr_stmt(other),
        }
    }

    fn plain_expr_stmt(&mut self, e: &Expr) -> syn::Result<TokenStream> {
        if let Some(msg) = unsupported_stmt(e) {
            return err(e, msg);
        }
        if self.is_dynamic(e) {
            let v = self.value(e)?;
            Ok(quote!(let _ = #v;))
        } else {
            let s = self.static_expr(e)?;
            Ok(quote!(#s;))
        }
    }

    /// `lhs = rhs` or, with `op`, `lhs op= rhs`.
    fn assign(&mut self, lhs: &Expr, op: Option<(TokenStream, BinOp)>, rhs: &Expr) -> syn::Result<TokenStream> {
        if let Expr::Index(ix) = strip(lhs) {
            if self.ref_of(&ix.expr).is_some() {
                return self.store(ix, op.map(|(o, _)| o), rhs);
            }
        }
        let Some(name) = ident_of(lhs) else {
            return err(lhs, "you can assign to a variable (`x = ...`) or store to a ref (`r[..] = ...`)");
        };
        match self.lookup(&name.to_string()) {
            None if self.refs.contains_key(&name.to_string()) => err(lhs, format!("`{name}` is a ref; store to it with `{name}[..] = value`")),
            None => err(lhs, format!("assignment to undeclared variable `{name}`; declare it first with `let mut {name} = ...;`")),
            Some(Var::Ir { mutable: false }) => err(lhs, format!("cannot assign twice to immutable variable `{name}`; declare it with `let mut {name}`")),
            Some(Var::Ir { mutable: true }) => {
                let v = match op {
                    Some((op, _)) => {
                        let r = self.arg(rhs)?;
                        quote!({ let __tessera_r = #r; __tessera_b.binary(::tessera_dsl::BinaryOp::#op, #name, __tessera_r) })
                    }
                    None if self.is_dynamic(rhs) => self.value(rhs)?,
                    None => {
                        // A static value assigned to an IR variable takes the variable's dtype.
                        let s = self.arg(rhs)?;
                        quote!({ let __tessera_a = #s; let __tessera_d = __tessera_b.ty(#name).dtype; __tessera_b.lift(__tessera_a, ::core::option::Option::Some(__tessera_d)) })
                    }
                };
                Ok(quote!(#name = #v;))
            }
            Some(Var::Static { depth }) => {
                if self.is_dynamic(rhs) {
                    return err(
                        lhs,
                        format!(
                            "`{name}` holds a static (build-time) value and cannot be assigned an IR value; \
                             bind it to an IR value from the start, e.g. `let mut {name} = full([], f32, 0.0);`"
                        ),
                    );
                }
                if depth < self.dyn_depth {
                    return err(
                        lhs,
                        format!(
                            "static variable `{name}` is assigned inside a dynamic `if`/`for`, whose body is traced once at \
                             build time; make `{name}` an IR value (e.g. `let mut {name} = full([], i32, 0);`)"
                        ),
                    );
                }
                let s = self.static_expr(rhs)?;
                match op {
                    Some((_, bop)) => Ok(quote!(#name #bop #s;)),
                    None => Ok(quote!(#name = #s;)),
                }
            }
        }
    }

    fn store(&mut self, ix: &ExprIndex, op: Option<TokenStream>, rhs: &Expr) -> syn::Result<TokenStream> {
        let (r, lets, idx) = self.ref_access(ix)?;
        let var = &r.var;
        let v = self.arg(rhs)?;
        Ok(match op {
            None => quote!({ #lets let __tessera_v = #v; __tessera_b.store(#var, &[#(#idx),*], __tessera_v); }),
            Some(op) => quote!({
                #lets
                let __tessera_old = __tessera_b.load(#var, &[#(#idx),*]);
                let __tessera_v = #v;
                let __tessera_new = __tessera_b.binary(::tessera_dsl::BinaryOp::#op, __tessera_old, __tessera_v);
                __tessera_b.store(#var, &[#(#idx),*], __tessera_new);
            }),
        })
    }

    // ---- control flow ------------------------------------------------------------------

    /// Outer IR variables assigned anywhere in `stmts`/`tail`: the values a dynamic `if`
    /// must yield or a `for` must carry.
    fn assigned_ir_vars<'e>(&self, exprs: impl IntoIterator<Item = &'e Expr>, blocks: impl IntoIterator<Item = &'e Block>) -> Vec<Ident> {
        #[derive(Default)]
        struct A(Vec<Ident>);
        impl<'ast> Visit<'ast> for A {
            fn visit_expr(&mut self, e: &'ast Expr) {
                let target = match e {
                    Expr::Assign(a) => Some(&*a.left),
                    Expr::Binary(b) if is_assign_op(&b.op) => Some(&*b.left),
                    _ => None,
                };
                if let Some(i) = target.and_then(ident_of) {
                    if !self.0.contains(i) {
                        self.0.push(i.clone());
                    }
                }
                syn::visit::visit_expr(self, e);
            }
        }
        let mut a = A::default();
        exprs.into_iter().for_each(|e| a.visit_expr(e));
        blocks.into_iter().for_each(|b| a.visit_block(b));
        a.0.into_iter().filter(|i| matches!(self.lookup(&i.to_string()), Some(Var::Ir { .. }))).collect()
    }

    /// Lowers one branch of a dynamic `if` (or a loop body) as a closure body: copies of
    /// the carried variables, the statements, then `vec![value?, carries...]`.
    fn branch(&mut self, carries: &[Ident], restore: &TokenStream, body: Branch<'_>, want_value: bool) -> syn::Result<TokenStream> {
        self.scoped(|l| {
            for c in carries {
                l.declare(c, Var::Ir { mutable: true });
            }
            // Each branch starts from the carried values; one that overwrites a carry before
            // reading it leaves its copy unread (rustc's `unused_assignments`), harmlessly.
            let copies = carries.iter().map(|c| quote!(#[allow(unused_mut, unused_assignments)] let mut #c = #c;));
            let inner = l.scoped(|l| -> syn::Result<TokenStream> {
                Ok(match (body, want_value) {
                    (Branch::Block(b), true) => l.value_block(b)?,
                    (Branch::Block(b), false) => {
                        let s = l.stmts(&b.stmts);
                        quote!({ #s })
                    }
                    (Branch::If(i), w) => l.if_expr(i, w)?,
                    (Branch::Empty, _) => quote!({}),
                })
            })?;
            let body = if want_value {
                quote!(let __tessera_y = #inner; #restore ::std::vec![__tessera_y, #(#carries),*])
            } else {
                quote!(#inner #restore ::std::vec![#(#carries),*])
            };
            Ok(quote!({ #(#copies)* #body }))
        })
    }

    /// An `if`: a Rust `if` when the condition is static (build-time specialisation),
    /// `__tessera_b.if_else` when it is dynamic. With `want_value`, evaluates to the `Value` of
    /// the taken branch.
    fn if_expr(&mut self, i: &ExprIf, want_value: bool) -> syn::Result<TokenStream> {
        if want_value && i.else_branch.is_none() {
            return err(i, "an `if` used as a value needs an `else` branch");
        }
        let else_branch = match &i.else_branch {
            None => Branch::Empty,
            Some((_, e)) => match &**e {
                Expr::If(ei) => Branch::If(ei),
                Expr::Block(b) => Branch::Block(&b.block),
                other => return err(other, "expected a block or `else if`"),
            },
        };
        if !self.is_dynamic(&i.cond) {
            let cond = self.static_expr(&i.cond)?;
            let then = self.scoped(|l| -> syn::Result<TokenStream> {
                if want_value {
                    l.value_block(&i.then_branch)
                } else {
                    let s = l.stmts(&i.then_branch.stmts);
                    Ok(quote!({ #s }))
                }
            })?;
            let otherwise = match else_branch {
                Branch::Empty => return Ok(quote!(if #cond #then)),
                Branch::If(ei) => {
                    let t = self.if_expr(ei, want_value)?;
                    quote!({ #t })
                }
                Branch::Block(b) => self.scoped(|l| -> syn::Result<TokenStream> {
                    if want_value {
                        l.value_block(b)
                    } else {
                        let s = l.stmts(&b.stmts);
                        Ok(quote!({ #s }))
                    }
                })?,
            };
            return Ok(quote!(if #cond #then else #otherwise));
        }

        let cond = self.arg(&i.cond)?;
        // Carries: outer IR variables assigned in the then block or anywhere in the
        // else branch (including an `else if` chain).
        let else_expr: Option<&Expr> = i.else_branch.as_ref().map(|(_, e)| &**e);
        let carries = self.assigned_ir_vars(else_expr, [&i.then_branch]);
        let restore = at(i.if_token.span);
        self.dyn_depth += 1;
        let then = self.branch(&carries, &restore, Branch::Block(&i.then_branch), want_value);
        let otherwise = self.branch(&carries, &restore, else_branch, want_value);
        self.dyn_depth -= 1;
        let (then, otherwise) = (then?, otherwise?);
        let off = usize::from(want_value);
        let assign_back = carries.iter().enumerate().map(|(k, c)| {
            let k = k + off;
            quote!(#c = __tessera_res[#k];)
        });
        let result = want_value.then(|| quote!(__tessera_res[0]));
        Ok(quote!({
            let __tessera_cond = #cond;
            let __tessera_res = __tessera_b.if_else(
                __tessera_cond,
                |__tessera_b: &mut ::tessera_dsl::KernelBuilder| #then,
                |__tessera_b: &mut ::tessera_dsl::KernelBuilder| #otherwise,
            );
            #(#assign_back)*
            #result
        }))
    }

    /// `for i in lo..hi { .. }` / `for i in (lo..hi).step_by(s) { .. }` -> `__tessera_b.for_range`,
    /// carrying the outer IR variables the body assigns.
    fn for_loop(&mut self, f: &syn::ExprForLoop) -> syn::Result<TokenStream> {
        if let Some(l) = &f.label {
            return err(l, "loop labels are not supported in kernel bodies");
        }
        if let Expr::Call(c) = strip(&f.expr) {
            if ident_of(&c.func).is_some_and(|n| n == "pipeline") {
                return self.pipeline_loop(f, c);
            }
        }
        let (range, step) = match strip(&f.expr) {
            Expr::MethodCall(m) if m.method == "step_by" && m.args.len() == 1 => {
                let s = self.require_static(&m.args[0], "a loop step")?;
                let step = match &s {
                    Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(l), .. }) if l.suffix().is_empty() => quote!(#l),
                    _ => quote_spanned!(m.args[0].span()=> ((#s) as i64)),
                };
                (strip(&m.receiver), step)
            }
            e => (e, quote!(1i64)),
        };
        let Expr::Range(r) = range else {
            return err(&f.expr, "kernel `for` loops iterate over `lo..hi` or `(lo..hi).step_by(s)`");
        };
        let (Some(lo), Some(hi), RangeLimits::HalfOpen(_)) = (&r.start, &r.end, &r.limits) else {
            return err(r, "kernel `for` loops iterate over a half-open range `lo..hi`");
        };
        let iv = match &*f.pat {
            Pat::Ident(pi) if pi.by_ref.is_none() && pi.mutability.is_none() && pi.subpat.is_none() => pi.ident.clone(),
            Pat::Wild(w) => Ident::new("__tessera_iv", w.span()),
            p => return err(p, "the loop variable is a plain name (or `_`)"),
        };
        let (lo, hi) = (self.arg(lo)?, self.arg(hi)?);
        let carries = self.assigned_ir_vars(None, [&f.body]);
        let restore = at(f.for_token.span);
        self.dyn_depth += 1;
        let body = self.scoped(|l| {
            l.declare(&iv, Var::Ir { mutable: false });
            for c in &carries {
                l.declare(c, Var::Ir { mutable: true });
            }
            let stmts = l.scoped(|l| l.stmts(&f.body.stmts));
            let copies = carries.iter().enumerate().map(|(k, c)| quote!(#[allow(unused_mut)] let mut #c = __tessera_c[#k];));
            quote!({ #(#copies)* { #stmts } #restore ::std::vec![#(#carries),*] })
        });
        self.dyn_depth -= 1;
        let assign_back = carries.iter().enumerate().map(|(k, c)| quote!(#c = __tessera_res[#k];));
        Ok(quote!({
            let __tessera_lo = #lo;
            let __tessera_hi = #hi;
            let __tessera_res = __tessera_b.for_range(
                __tessera_lo,
                __tessera_hi,
                #step,
                &[#(#carries),*],
                |__tessera_b: &mut ::tessera_dsl::KernelBuilder, #iv: ::tessera_dsl::Value, __tessera_c: &[::tessera_dsl::Value]| #body,
            );
            #(#assign_back)*
        }))
    }

    /// `for i in pipeline(steps) { .. pipe_in(x, [block], [idx]) .. pipe_out(o, [block],
    /// [idx], v) .. }` -> `__tessera_b.emit_pipeline` (Pallas `pltpu.emit_pipeline`): every
    /// operand named by a `pipe_in` / `pipe_out` in the body is streamed in sub-blocks of
    /// `block` at block indices `idx` (over `i` and values from outside the loop), double
    /// buffered; `pipe_in` reads the current sub-block, `pipe_out` writes it.
    fn pipeline_loop(&mut self, f: &syn::ExprForLoop, c: &syn::ExprCall) -> syn::Result<TokenStream> {
        if c.args.len() != 1 {
            return err(c, "`pipeline(steps)` takes the static number of steps");
        }
        let steps = self.static_usize(&c.args[0], "a pipeline's step count")?;
        let iv = match &*f.pat {
            Pat::Ident(pi) if pi.by_ref.is_none() && pi.mutability.is_none() && pi.subpat.is_none() => pi.ident.clone(),
            Pat::Wild(w) => Ident::new("__tessera_iv", w.span()),
            p => return err(p, "the loop variable is a plain name (or `_`)"),
        };
        // The pipelined operands, in order of first use.
        struct Uses<'e>(Vec<(String, &'e Expr, &'e Expr, &'e Expr)>);
        impl<'ast> Visit<'ast> for Uses<'ast> {
            fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
                if let Some(n) = ident_of(&c.func) {
                    if (n == "pipe_in" && c.args.len() == 3) || (n == "pipe_out" && c.args.len() == 4) {
                        if let Some(r) = ident_of(&c.args[0]) {
                            if !self.0.iter().any(|u| u.0 == r.to_string()) {
                                self.0.push((r.to_string(), &c.args[0], &c.args[1], &c.args[2]));
                            }
                        }
                    }
                }
                syn::visit::visit_expr_call(self, c);
            }
        }
        let mut uses = Uses(Vec::new());
        uses.visit_block(&f.body);
        if uses.0.is_empty() {
            return err(&f.expr, "a pipeline loop streams the operands its body names with `pipe_in(x, [block], [indices])` / `pipe_out(o, [block], [indices], value)`; this one names none");
        }
        let mut pipes = Vec::new();
        for (name, r, shape, idx) in &uses.0 {
            let Some(info) = self.ref_of(r) else { return err(r, format!("`{name}` is not an operand of the kernel (pipelines stream `Any<..>` operands)")) };
            let var = info.var.clone();
            let shape = self.shape(shape)?;
            let Expr::Array(a) = strip(idx) else { return err(idx, "the block indices are an array, one per operand dim: `[i, 0]`") };
            let elems: Vec<&Expr> = a.elems.iter().collect();
            let lowered = self.scoped(|l| {
                l.declare(&iv, Var::Ir { mutable: false });
                elems.iter().map(|e| l.arg(e)).collect::<syn::Result<Vec<_>>>()
            })?;
            let lets: Vec<TokenStream> = lowered.iter().enumerate().map(|(k, t)| {
                let n = format_ident!("__tessera_x{k}");
                quote!(let #n = ::tessera_dsl::Arg::from(#t);)
            }).collect();
            let names = (0..lowered.len()).map(|k| format_ident!("__tessera_x{k}"));
            pipes.push(quote!(::tessera_dsl::Pipe::new(#var, #shape, &|__tessera_b: &mut ::tessera_dsl::KernelBuilder, #iv: ::tessera_dsl::Value| -> ::std::vec::Vec<::tessera_dsl::Arg> {
                let _ = &__tessera_b;
                #(#lets)*
                ::std::vec![#(#names),*]
            })));
        }
        let name = format!("pipe{}", self.npipes);
        self.npipes += 1;
        let carries = self.assigned_ir_vars(None, [&f.body]);
        let restore = at(f.for_token.span);
        self.dyn_depth += 1;
        self.pipelines.push(uses.0.iter().map(|u| u.0.clone()).collect());
        let body = self.scoped(|l| {
            l.declare(&iv, Var::Ir { mutable: false });
            for c in &carries {
                l.declare(c, Var::Ir { mutable: true });
            }
            let stmts = l.scoped(|l| l.stmts(&f.body.stmts));
            let copies = carries.iter().enumerate().map(|(k, c)| quote!(#[allow(unused_mut)] let mut #c = __tessera_c[#k];));
            // The step may be used only by the index maps.
            quote!({ let _ = #iv; #(#copies)* { #stmts } #restore ::std::vec![#(#carries),*] })
        });
        self.pipelines.pop();
        self.dyn_depth -= 1;
        let assign_back = carries.iter().enumerate().map(|(k, c)| quote!(#c = __tessera_res[#k];));
        Ok(quote!({
            let __tessera_res = __tessera_b.emit_pipeline(
                #name,
                #steps,
                &[#(#pipes),*],
                &[#(#carries),*],
                |__tessera_b: &mut ::tessera_dsl::KernelBuilder, #iv: ::tessera_dsl::Value, __tessera_blocks: &[::tessera_dsl::PipeBlock], __tessera_c: &[::tessera_dsl::Value]| #body,
            );
            #(#assign_back)*
        }))
    }
}

#[derive(Clone, Copy)]
enum Branch<'e> {
    Block(&'e Block),
    If(&'e ExprIf),
    Empty,
}

fn is_assign_op(op: &BinOp) -> bool {
    matches!(
        op,
        BinOp::AddAssign(_)
            | BinOp::SubAssign(_)
            | BinOp::MulAssign(_)
            | BinOp::DivAssign(_)
            | BinOp::RemAssign(_)
            | BinOp::BitAndAssign(_)
            | BinOp::BitOrAssign(_)
            | BinOp::BitXorAssign(_)
            | BinOp::ShlAssign(_)
            | BinOp::ShrAssign(_)
    )
}

/// Control flow that kernel bodies cannot express, with what to write instead.
fn unsupported_stmt(e: &Expr) -> Option<&'static str> {
    Some(match e {
        Expr::While(_) => "`while` loops are not supported in kernels (the IR has counted loops only); use `for i in lo..hi`",
        Expr::Loop(_) => "`loop` is not supported in kernels (the IR has counted loops only); use `for i in lo..hi`",
        Expr::Match(_) => "`match` is not supported in kernel bodies; use `if`/`else if`, or `select(cond, a, b)` for values",
        Expr::Return(_) => "`return` is not supported in kernel bodies; the kernel ends at the end of the function (use `if` to skip work)",
        Expr::Break(_) | Expr::Continue(_) => "`break`/`continue` are not supported in kernel loops",
        Expr::Closure(_) => "closures are not supported in kernel bodies",
        Expr::Macro(_) => "macros are not supported in kernel bodies",
        Expr::Reference(_) => "references are not supported in kernel bodies; IR values are used by value",
        Expr::Unsafe(_) | Expr::Async(_) | Expr::Await(_) | Expr::TryBlock(_) | Expr::Yield(_) | Expr::Try(_) => "this expression is not supported in kernel bodies",
        _ => return None,
    })
}

fn unsupported(e: &Expr) -> String {
    unsupported_stmt(e).map(str::to_string).unwrap_or_else(|| {
        "unsupported expression on IR values; kernel bodies use arithmetic, comparisons, ref accesses `r[..]`, \
         methods (exp, cast, sum, ...), builtins (dot, select, ...), `if` and `for`"
            .to_string()
    })
}
