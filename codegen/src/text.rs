//! A tiny writer for MLIR's generic op syntax: SSA naming, indentation, type spelling.
//!
//! Every op is written as `%r = "stable_mosaic.<dialect>.<op>"(%a, %b) {attrs} : (A, B) -> R`.
//! Attribute dictionaries are plain `{...}` — never the `<{...}>` property syntax, which
//! crashes libtpu when it deserializes the stable form.

use tessera_dsl::{DType, MemorySpace, Type};

/// An SSA value as text: its name and its MLIR type.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ssa {
    pub name: String,
    pub ty: String,
}

impl Ssa {
    pub fn new(name: impl Into<String>, ty: impl Into<String>) -> Ssa {
        Ssa { name: name.into(), ty: ty.into() }
    }
}

/// Accumulates the module text.
pub(crate) struct Text {
    out: String,
    indent: usize,
    next: usize,
}

impl Text {
    pub fn new() -> Text {
        Text { out: String::new(), indent: 0, next: 0 }
    }

    pub fn finish(self) -> String {
        self.out
    }

    pub fn fresh(&mut self) -> String {
        let n = self.next;
        self.next += 1;
        format!("%{n}")
    }

    pub fn line(&mut self, s: &str) {
        for _ in 0..self.indent {
            self.out.push_str("  ");
        }
        self.out.push_str(s);
        self.out.push('\n');
    }

    pub fn indent(&mut self) {
        self.indent += 1;
    }

    pub fn dedent(&mut self) {
        self.indent -= 1;
    }

    /// Writes one op with `results.len()` results and returns them.
    pub fn op(&mut self, name: &str, operands: &[&Ssa], attrs: &str, results: &[String]) -> Vec<Ssa> {
        let res: Vec<Ssa> = results.iter().map(|ty| Ssa::new(self.fresh(), ty.clone())).collect();
        let head = op_head(name, operands, &res);
        let attrs = if attrs.is_empty() { String::new() } else { format!(" {{{attrs}}}") };
        let sig = signature(operands.iter().map(|o| o.ty.as_str()), results);
        self.line(&format!("{head}{attrs} : {sig}"));
        res
    }

    /// Writes a one-result op.
    pub fn op1(&mut self, name: &str, operands: &[&Ssa], attrs: &str, result: String) -> Ssa {
        self.op(name, operands, attrs, &[result]).remove(0)
    }

    /// Writes a zero-result op.
    pub fn op0(&mut self, name: &str, operands: &[&Ssa], attrs: &str) {
        self.op(name, operands, attrs, &[]);
    }
}

/// `%a, %b = "stable_mosaic.x.y"(%o1, %o2)`.
pub(crate) fn op_head(name: &str, operands: &[&Ssa], results: &[Ssa]) -> String {
    let lhs = if results.is_empty() { String::new() } else { format!("{} = ", results.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")) };
    let ops: Vec<&str> = operands.iter().map(|o| o.name.as_str()).collect();
    format!("{lhs}\"stable_mosaic.{name}\"({})", ops.join(", "))
}

/// `(A, B) -> R`, `-> ()` for no results, `-> (R, S)` for several.
pub(crate) fn signature<'a>(operands: impl Iterator<Item = &'a str>, results: &[String]) -> String {
    format!("({}) -> {}", operands.collect::<Vec<_>>().join(", "), result_list(results))
}

pub(crate) fn result_list(results: &[String]) -> String {
    match results {
        [one] => one.clone(),
        _ => format!("({})", results.join(", ")),
    }
}

/// `f32`, or `vector<8x128xf32>`.
pub(crate) fn ty(t: &Type) -> String {
    if t.is_scalar() {
        t.dtype.mlir().to_string()
    } else {
        vector_ty(t.dtype, &t.shape)
    }
}

pub(crate) fn vector_ty(dtype: DType, shape: &[usize]) -> String {
    format!("vector<{}>", shaped(dtype, shape))
}

/// A memref type; in semaphore memory the element is `!tpu.dma_semaphore` whatever `dtype`.
pub(crate) fn memref_ty(dtype: DType, shape: &[usize], memory: MemorySpace) -> String {
    let dims = || shape.iter().map(|d| format!("{d}x")).collect::<String>();
    let (elems, space) = match memory {
        MemorySpace::Semaphore => (dims() + "!tpu.dma_semaphore", "semaphore_mem"),
        // Both kinds live in Mosaic's `semaphore_mem`; the element type tells them apart.
        MemorySpace::RegularSemaphore => (dims() + "!tpu.semaphore", "semaphore_mem"),
        _ => (shaped(dtype, shape), memory.name()),
    };
    format!("memref<{elems}, #tpu.memory_space<{space}>>")
}

/// `8x128xf32`; a rank-0 shape is just the element type.
pub(crate) fn shaped(dtype: DType, shape: &[usize]) -> String {
    let mut s = String::new();
    for d in shape {
        s.push_str(&format!("{d}x"));
    }
    s.push_str(dtype.mlir());
    s
}

/// `array<i64: 1, 2>` (also for `i32`).
pub(crate) fn dense_array(elt: &str, vals: impl IntoIterator<Item = i64>) -> String {
    let v: Vec<String> = vals.into_iter().map(|x| x.to_string()).collect();
    if v.is_empty() {
        format!("array<{elt}>")
    } else {
        format!("array<{elt}: {}>", v.join(", "))
    }
}

/// An MLIR float literal of `dtype`, rounded to that dtype. Finite values print as decimal
/// with a `.` (MLIR requires one); inf/nan print as the bit pattern in hex.
pub(crate) fn float_lit(x: f64, dtype: DType) -> String {
    let (v, hex) = match dtype {
        DType::BF16 => {
            let b = half::bf16::from_f64(x);
            (b.to_f32(), format!("0x{:04X}", b.to_bits()))
        }
        DType::F8E4M3FN | DType::F8E5M2 => {
            let c = tessera_dsl::fp8::encode(dtype, x as f32);
            (tessera_dsl::fp8::decode(dtype, c), format!("0x{c:02X}"))
        }
        _ => {
            let f = x as f32;
            (f, format!("0x{:08X}", f.to_bits()))
        }
    };
    if !v.is_finite() {
        return hex;
    }
    let mut s = format!("{v:?}");
    if !s.contains('.') {
        match s.find('e') {
            Some(e) => s.insert_str(e, ".0"),
            None => s.push_str(".0"),
        }
    }
    s
}

/// Escapes `s` for an MLIR string attribute: quotes become `\22` (as JAX writes them).
pub(crate) fn mlir_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\22"),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\0A"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A symbol reference `@name`, quoted when `name` is not a bare identifier.
pub(crate) fn symbol(name: &str) -> String {
    let bare = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && name.chars().all(|c| c.is_ascii_alphanumeric() || "_$.".contains(c));
    if bare {
        format!("@{name}")
    } else {
        format!("@{}", mlir_string(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_have_a_dot() {
        assert_eq!(float_lit(1.0, DType::F32), "1.0");
        assert_eq!(float_lit(1e-7, DType::F32), "1.0e-7");
        assert_eq!(float_lit(0.5, DType::BF16), "0.5");
        assert_eq!(float_lit(f64::NEG_INFINITY, DType::F32), "0xFF800000");
        assert_eq!(float_lit(f64::INFINITY, DType::BF16), "0x7F80");
        assert_eq!(float_lit(0.3, DType::F8E4M3FN), "0.3125");
        assert_eq!(float_lit(f64::INFINITY, DType::F8E5M2), "0x7C");
        assert_eq!(float_lit(f64::NAN, DType::F8E4M3FN), "0x7F");
    }

    #[test]
    fn types() {
        assert_eq!(vector_ty(DType::F32, &[8, 128]), "vector<8x128xf32>");
        assert_eq!(memref_ty(DType::I32, &[4], MemorySpace::Smem), "memref<4xi32, #tpu.memory_space<smem>>");
        assert_eq!(memref_ty(DType::I32, &[2], MemorySpace::Semaphore), "memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>");
        assert_eq!(memref_ty(DType::I32, &[], MemorySpace::Semaphore), "memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>");
        assert_eq!(memref_ty(DType::I32, &[1], MemorySpace::RegularSemaphore), "memref<1x!tpu.semaphore, #tpu.memory_space<semaphore_mem>>");
        assert_eq!(symbol("a.b"), "@a.b");
        assert_eq!(symbol("1x"), "@\"1x\"");
    }
}
