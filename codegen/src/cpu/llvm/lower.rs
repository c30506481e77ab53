//! Cranelift IR of a grid step (the one lowering, `cpu::cranelift::lower`) -> LLVM IR text.
//!
//! The lowering is written once, against Cranelift's IR; this module translates the
//! function it produced, instruction by instruction, into LLVM IR with the same semantics
//! (Cranelift's `fmax`/`fmin` are LLVM's `maximum`/`minimum`, `fcvt_to_sint_sat` is
//! `fptosi.sat`, `snarrow` is a clamp and a truncation, block parameters become phis),
//! so the two backends cannot drift apart. LLVM then optimises it at O3 (no fast-math).

use std::collections::HashMap;
use std::fmt::Write;

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F64, I16, I32, I64, I8};
use cranelift_codegen::ir::{self, Function, InstructionData, Opcode, Type, Value};

use crate::cpu::cranelift::Unsupported;

type R<T> = Result<T, Unsupported>;

fn bad<T>(msg: impl Into<String>) -> R<T> {
    Err(Unsupported(msg.into()))
}

fn lty(t: Type) -> R<String> {
    let lane = t.lane_type();
    let l = match lane {
        I8 => "i8",
        I16 => "i16",
        I32 => "i32",
        I64 => "i64",
        F32 => "float",
        F64 => "double",
        _ => return bad(format!("llvm: type {t}")),
    };
    Ok(if t.is_vector() { format!("<{} x {l}>", t.lane_count()) } else { l.to_string() })
}

fn mangle(t: Type) -> R<String> {
    let lane = t.lane_type();
    let l = match lane {
        I8 => "i8",
        I16 => "i16",
        I32 => "i32",
        I64 => "i64",
        F32 => "f32",
        F64 => "f64",
        _ => return bad(format!("llvm: type {t}")),
    };
    Ok(if t.is_vector() { format!("v{}{l}", t.lane_count()) } else { l.to_string() })
}

/// A splat constant `c` of integer vector or scalar type `t`.
fn int_splat(t: Type, c: i64) -> R<String> {
    let l = lty(t.lane_type())?;
    if !t.is_vector() {
        return Ok(c.to_string());
    }
    let items: Vec<String> = (0..t.lane_count()).map(|_| format!("{l} {c}")).collect();
    Ok(format!("<{}>", items.join(", ")))
}

fn icc(cc: IntCC) -> &'static str {
    match cc {
        IntCC::Equal => "eq",
        IntCC::NotEqual => "ne",
        IntCC::SignedLessThan => "slt",
        IntCC::SignedLessThanOrEqual => "sle",
        IntCC::SignedGreaterThan => "sgt",
        IntCC::SignedGreaterThanOrEqual => "sge",
        IntCC::UnsignedLessThan => "ult",
        IntCC::UnsignedLessThanOrEqual => "ule",
        IntCC::UnsignedGreaterThan => "ugt",
        IntCC::UnsignedGreaterThanOrEqual => "uge",
    }
}

fn fcc(cc: FloatCC) -> &'static str {
    match cc {
        FloatCC::Ordered => "ord",
        FloatCC::Unordered => "uno",
        FloatCC::Equal => "oeq",
        FloatCC::NotEqual => "une",
        FloatCC::OrderedNotEqual => "one",
        FloatCC::UnorderedOrEqual => "ueq",
        FloatCC::LessThan => "olt",
        FloatCC::LessThanOrEqual => "ole",
        FloatCC::GreaterThan => "ogt",
        FloatCC::GreaterThanOrEqual => "oge",
        FloatCC::UnorderedOrLessThan => "ult",
        FloatCC::UnorderedOrLessThanOrEqual => "ule",
        FloatCC::UnorderedOrGreaterThan => "ugt",
        FloatCC::UnorderedOrGreaterThanOrEqual => "uge",
    }
}

struct Tx<'f> {
    f: &'f Function,
    out: String,
    ops: HashMap<Value, String>,
    tmp: usize,
    decls: std::collections::BTreeSet<String>,
    consts: HashMap<Value, i64>,
    helpers: &'f HashMap<ir::FuncRef, usize>,
}

impl Tx<'_> {
    fn ty(&self, v: Value) -> Type {
        self.f.dfg.value_type(self.f.dfg.resolve_aliases(v))
    }

    fn op(&self, v: Value) -> R<String> {
        let v = self.f.dfg.resolve_aliases(v);
        self.ops.get(&v).cloned().ok_or_else(|| Unsupported(format!("llvm: {v} used before its definition")))
    }

    fn typed(&self, v: Value) -> R<String> {
        Ok(format!("{} {}", lty(self.ty(v))?, self.op(v)?))
    }

    fn fresh(&mut self) -> String {
        self.tmp += 1;
        format!("%t{}", self.tmp)
    }

    fn emit(&mut self, line: String) {
        self.out.push_str("  ");
        self.out.push_str(&line);
        self.out.push('\n');
    }

    fn intrinsic(&mut self, name: &str, ret: Type, args: &[(Type, String)], extra: &str) -> R<String> {
        let m = mangle(ret)?;
        let full = format!("llvm.{name}.{m}");
        let params: Vec<String> = args.iter().map(|(t, _)| lty(*t)).collect::<R<_>>()?;
        let extra_decl = if extra.is_empty() { String::new() } else { ", i1".to_string() };
        self.decls.insert(format!("declare {} @{full}({}{extra_decl})", lty(ret)?, params.join(", ")));
        let t = self.fresh();
        let a: Vec<String> = args.iter().map(|(ty, s)| Ok(format!("{} {s}", lty(*ty)?))).collect::<R<_>>()?;
        let extra_arg = if extra.is_empty() { String::new() } else { format!(", {extra}") };
        self.emit(format!("{t} = call {} @{full}({}{extra_arg})", lty(ret)?, a.join(", ")));
        Ok(t)
    }

    fn ptr(&mut self, addr: Value, offset: i32) -> R<String> {
        let a = self.op(addr)?;
        let p = self.fresh();
        if offset != 0 {
            let s = self.fresh();
            self.emit(format!("{s} = add i64 {a}, {offset}"));
            self.emit(format!("{p} = inttoptr i64 {s} to ptr"));
        } else {
            self.emit(format!("{p} = inttoptr i64 {a} to ptr"));
        }
        Ok(p)
    }

    /// Clamps lanes of `x` (type `t`) to `[lo, hi]` and truncates them to `nt`'s lanes.
    fn clamp_trunc(&mut self, x: &str, t: Type, lo: i64, hi: i64, half: Type) -> R<String> {
        let lo_s = int_splat(t, lo)?;
        let hi_s = int_splat(t, hi)?;
        let a = self.intrinsic("smax", t, &[(t, x.to_string()), (t, lo_s)], "")?;
        let b = self.intrinsic("smin", t, &[(t, a), (t, hi_s)], "")?;
        let r = self.fresh();
        self.emit(format!("{r} = trunc {} {b} to {}", lty(t)?, lty(half)?));
        Ok(r)
    }
}

/// Translates `f` into the text of an LLVM function `step`, plus the declarations it needs.
/// `helpers` gives the address of each called function.
pub fn translate(f: &Function, helpers: &HashMap<ir::FuncRef, usize>, attrs: &str) -> R<String> {
    let mut tx = Tx { f, out: String::new(), ops: HashMap::new(), tmp: 0, decls: Default::default(), consts: HashMap::new(), helpers };
    let entry = f.layout.entry_block().ok_or_else(|| Unsupported("llvm: empty function".into()))?;
    // Incoming edges of every block: (predecessor block, argument values).
    let mut incoming: HashMap<ir::Block, Vec<(ir::Block, Vec<Value>)>> = HashMap::new();
    for block in f.layout.blocks() {
        for inst in f.layout.block_insts(block) {
            let calls: Vec<ir::BlockCall> = match f.dfg.insts[inst] {
                InstructionData::Jump { destination, .. } => vec![destination],
                InstructionData::Brif { blocks, .. } => blocks.to_vec(),
                _ => continue,
            };
            for bc in calls {
                let target = bc.block(&f.dfg.value_lists);
                let mut args = Vec::new();
                for a in bc.args(&f.dfg.value_lists) {
                    match a {
                        ir::BlockArg::Value(v) => args.push(v),
                        _ => return bad("llvm: a block argument that is not a value"),
                    }
                }
                incoming.entry(target).or_default().push((block, args));
            }
        }
    }
    // Stack slots become allocas in a preamble block.
    writeln!(tx.out, "define i32 @step(ptr %ctx) #0 {{").ok();
    writeln!(tx.out, "pre:").ok();
    for (ss, data) in f.sized_stack_slots.iter() {
        tx.emit(format!("%ss{} = alloca [{} x i8], align 16", ss.as_u32(), data.size.max(1)));
    }
    tx.emit("%ctxi = ptrtoint ptr %ctx to i64".to_string());
    tx.emit(format!("br label %b{}", entry.as_u32()));
    incoming.entry(entry).or_default().push((entry, vec![]));
    // Values defined by block parameters get their names up front.
    for block in f.layout.blocks() {
        for &p in f.dfg.block_params(block) {
            tx.ops.insert(p, format!("%v{}", p.as_u32()));
        }
    }
    for block in f.layout.blocks() {
        writeln!(tx.out, "b{}:", block.as_u32()).ok();
        let params = f.dfg.block_params(block).to_vec();
        if block == entry {
            // The entry's only parameter is the context pointer.
            if let [p] = params.as_slice() {
                tx.emit(format!("%v{} = add i64 %ctxi, 0", p.as_u32()));
            }
        } else {
            for (i, &p) in params.iter().enumerate() {
                let edges = incoming.get(&block).cloned().unwrap_or_default();
                let mut parts = Vec::new();
                for (pred, args) in &edges {
                    let Some(&a) = args.get(i) else { return bad("llvm: a branch with too few block arguments") };
                    parts.push(format!("[ %v{}, %b{}_end ]", f.dfg.resolve_aliases(a).as_u32(), pred.as_u32()));
                }
                tx.emit(format!("%v{} = phi {} {}", p.as_u32(), lty(f.dfg.value_type(p))?, parts.join(", ")));
            }
        }
        for inst in f.layout.block_insts(block) {
            translate_inst(&mut tx, inst, block)?;
        }
    }
    writeln!(tx.out, "}}").ok();
    writeln!(tx.out, "attributes #0 = {{ nounwind {attrs} }}").ok();
    let mut text = String::new();
    for d in &tx.decls {
        writeln!(text, "{d}").ok();
    }
    text.push_str(&tx.out);
    // Every block's last instruction is a branch or return; give each an `_end` label so
    // phis name the edge's source even when a block was split.
    Ok(text)
}

fn translate_inst(tx: &mut Tx<'_>, inst: ir::Inst, block: ir::Block) -> R<()> {
    let f = tx.f;
    let data = f.dfg.insts[inst];
    let op = data.opcode();
    let results: Vec<Value> = f.dfg.inst_results(inst).to_vec();
    let res = results.first().copied();
    let rname = |v: Option<Value>| v.map(|v| format!("%v{}", v.as_u32())).unwrap_or_default();
    let r = rname(res);
    let rty = res.map(|v| f.dfg.value_type(v));
    let args: Vec<Value> = f.dfg.inst_args(inst).to_vec();
    // Every result is named `%v<n>` (phis refer to values by that name).
    let own = r.clone();
    let set = move |tx: &mut Tx<'_>, s: String| {
        if let Some(v) = res {
            if s != own {
                let t = lty(f.dfg.value_type(v)).unwrap_or_default();
                tx.emit(format!("{own} = bitcast {t} {s} to {t}"));
            }
            tx.ops.insert(v, own.clone());
        }
    };
    match (op, data) {
        (Opcode::Iconst, InstructionData::UnaryImm { imm, .. }) => {
            let t = rty.unwrap();
            let v: i64 = imm.bits();
            let v = match t.bits() {
                8 => v as i8 as i64,
                16 => v as i16 as i64,
                32 => v as i32 as i64,
                _ => v,
            };
            tx.consts.insert(res.unwrap(), v);
            tx.emit(format!("{r} = add {} 0, {v}", lty(t)?));
            set(tx, r);
        }
        (Opcode::F32const, InstructionData::UnaryIeee32 { imm, .. }) => {
            tx.emit(format!("{r} = bitcast i32 {} to float", imm.bits() as i32));
            set(tx, r);
        }
        (Opcode::F64const, InstructionData::UnaryIeee64 { imm, .. }) => {
            tx.emit(format!("{r} = bitcast i64 {} to double", imm.bits() as i64));
            set(tx, r);
        }
        (Opcode::Vconst, InstructionData::UnaryConst { constant_handle, .. }) => {
            let t = rty.unwrap();
            let bytes = f.dfg.constants.get(constant_handle).as_slice().to_vec();
            let lb = (t.lane_bits() / 8) as usize;
            let it = Type::int(t.lane_bits() as u16).unwrap().by(t.lane_count()).unwrap();
            let l = lty(it.lane_type())?;
            let mut items = Vec::new();
            for i in 0..t.lane_count() as usize {
                let mut b = [0u8; 8];
                b[..lb].copy_from_slice(&bytes[i * lb..(i + 1) * lb]);
                let raw = u64::from_le_bytes(b);
                let s = match lb {
                    1 => (raw as u8 as i8).to_string(),
                    2 => (raw as u16 as i16).to_string(),
                    4 => (raw as u32 as i32).to_string(),
                    _ => (raw as i64).to_string(),
                };
                items.push(format!("{l} {s}"));
            }
            let lit = format!("<{}>", items.join(", "));
            if it == t {
                tx.emit(format!("{r} = add {} zeroinitializer, {lit}", lty(t)?));
            } else {
                tx.emit(format!("{r} = bitcast {} {lit} to {}", lty(it)?, lty(t)?));
            }
            set(tx, r);
        }
        (Opcode::Iadd | Opcode::Isub | Opcode::Imul | Opcode::Sdiv | Opcode::Srem | Opcode::Band | Opcode::Bor | Opcode::Bxor | Opcode::Fadd | Opcode::Fsub | Opcode::Fmul | Opcode::Fdiv, _) => {
            let name = match op {
                Opcode::Iadd => "add",
                Opcode::Isub => "sub",
                Opcode::Imul => "mul",
                Opcode::Sdiv => "sdiv",
                Opcode::Srem => "srem",
                Opcode::Band => "and",
                Opcode::Bor => "or",
                Opcode::Bxor => "xor",
                Opcode::Fadd => "fadd",
                Opcode::Fsub => "fsub",
                Opcode::Fmul => "fmul",
                _ => "fdiv",
            };
            let t = rty.unwrap();
            if t.lane_type().is_float() && matches!(op, Opcode::Band | Opcode::Bor | Opcode::Bxor) {
                return bad("llvm: bitwise ops on floats");
            }
            let (a, b) = (tx.op(args[0])?, tx.op(args[1])?);
            tx.emit(format!("{r} = {name} {} {a}, {b}", lty(t)?));
            set(tx, r);
        }
        (Opcode::Ishl | Opcode::Ushr | Opcode::Sshr, _) => {
            let t = rty.unwrap();
            let name = match op {
                Opcode::Ishl => "shl",
                Opcode::Ushr => "lshr",
                _ => "ashr",
            };
            let amt = f.dfg.resolve_aliases(args[1]);
            let a = tx.op(args[0])?;
            if let Some(&k) = tx.consts.get(&amt) {
                let k = k.rem_euclid(t.lane_bits() as i64);
                tx.emit(format!("{r} = {name} {} {a}, {}", lty(t)?, int_splat(t, k)?));
            } else {
                // Cranelift takes the amount modulo the lane width; LLVM makes an amount
                // at least that wide poison, so mask it. Scalars only: a vector shift's
                // amount is a scalar, which LLVM would need splatted.
                if t.is_vector() || tx.ty(args[1]) != t {
                    return Err(Unsupported("llvm: a vector shift by a non-constant amount".into()));
                }
                let m = tx.fresh();
                tx.emit(format!("{m} = and {} {}, {}", lty(t)?, tx.op(args[1])?, t.lane_bits() - 1));
                tx.emit(format!("{r} = {name} {} {a}, {m}", lty(t)?));
            }
            set(tx, r);
        }
        (Opcode::Ineg, _) => {
            let t = rty.unwrap();
            tx.emit(format!("{r} = sub {} {}, {}", lty(t)?, int_splat(t, 0)?, tx.op(args[0])?));
            set(tx, r);
        }
        (Opcode::Bnot, _) => {
            let t = rty.unwrap();
            tx.emit(format!("{r} = xor {} {}, {}", lty(t)?, tx.op(args[0])?, int_splat(t, -1)?));
            set(tx, r);
        }
        (Opcode::Fneg, _) => {
            let t = rty.unwrap();
            tx.emit(format!("{r} = fneg {} {}", lty(t)?, tx.op(args[0])?));
            set(tx, r);
        }
        (Opcode::Iabs, _) => {
            let t = rty.unwrap();
            let x = tx.op(args[0])?;
            let s = tx.intrinsic("abs", t, &[(t, x)], "i1 false")?;
            set(tx, s);
        }
        (Opcode::Smax | Opcode::Smin | Opcode::Fmax | Opcode::Fmin, _) => {
            let t = rty.unwrap();
            let name = match op {
                Opcode::Smax => "smax",
                Opcode::Smin => "smin",
                Opcode::Fmax => "maximum",
                _ => "minimum",
            };
            let (a, b) = (tx.op(args[0])?, tx.op(args[1])?);
            let s = tx.intrinsic(name, t, &[(t, a), (t, b)], "")?;
            set(tx, s);
        }
        (Opcode::Fma, _) => {
            let t = rty.unwrap();
            let (a, b, c) = (tx.op(args[0])?, tx.op(args[1])?, tx.op(args[2])?);
            let s = tx.intrinsic("fma", t, &[(t, a), (t, b), (t, c)], "")?;
            set(tx, s);
        }
        (Opcode::Fabs | Opcode::Sqrt | Opcode::Floor | Opcode::Ceil | Opcode::Nearest, _) => {
            let t = rty.unwrap();
            let name = match op {
                Opcode::Fabs => "fabs",
                Opcode::Sqrt => "sqrt",
                Opcode::Ceil => "ceil",
                Opcode::Nearest => "roundeven",
                _ => "floor",
            };
            let x = tx.op(args[0])?;
            let s = tx.intrinsic(name, t, &[(t, x)], "")?;
            set(tx, s);
        }
        (Opcode::FcvtToSintSat, _) => {
            let t = rty.unwrap();
            let st = tx.ty(args[0]);
            let full = format!("llvm.fptosi.sat.{}.{}", mangle(t)?, mangle(st)?);
            tx.decls.insert(format!("declare {} @{full}({})", lty(t)?, lty(st)?));
            let x = tx.typed(args[0])?;
            tx.emit(format!("{r} = call {} @{full}({x})", lty(t)?));
            set(tx, r);
        }
        (Opcode::FcvtFromSint | Opcode::FcvtFromUint | Opcode::Fpromote | Opcode::Fdemote | Opcode::Sextend | Opcode::Uextend | Opcode::Ireduce, _) => {
            let name = match op {
                Opcode::FcvtFromSint => "sitofp",
                Opcode::FcvtFromUint => "uitofp",
                Opcode::Fpromote => "fpext",
                Opcode::Fdemote => "fptrunc",
                Opcode::Sextend => "sext",
                Opcode::Uextend => "zext",
                _ => "trunc",
            };
            let x = tx.typed(args[0])?;
            tx.emit(format!("{r} = {name} {x} to {}", lty(rty.unwrap())?));
            set(tx, r);
        }
        (Opcode::Bitcast, _) => {
            let x = tx.typed(args[0])?;
            tx.emit(format!("{r} = bitcast {x} to {}", lty(rty.unwrap())?));
            set(tx, r);
        }
        (Opcode::Icmp, InstructionData::IntCompare { .. }) | (Opcode::Fcmp, InstructionData::FloatCompare { .. }) => {
            let at = tx.ty(args[0]);
            let c = tx.fresh();
            let (a, b) = (tx.op(args[0])?, tx.op(args[1])?);
            match data {
                InstructionData::IntCompare { cond, .. } => tx.emit(format!("{c} = icmp {} {} {a}, {b}", icc(cond), lty(at)?)),
                InstructionData::FloatCompare { cond, .. } => tx.emit(format!("{c} = fcmp {} {} {a}, {b}", fcc(cond), lty(at)?)),
                _ => unreachable!(),
            }
            let t = rty.unwrap();
            let i1 = if at.is_vector() { format!("<{} x i1>", at.lane_count()) } else { "i1".to_string() };
            let ext = if t.is_vector() { "sext" } else { "zext" };
            tx.emit(format!("{r} = {ext} {i1} {c} to {}", lty(t)?));
            set(tx, r);
        }
        (Opcode::Select, _) => {
            let ct = tx.ty(args[0]);
            if ct.is_vector() {
                return bad("llvm: select with a vector condition");
            }
            let c = tx.fresh();
            tx.emit(format!("{c} = icmp ne {} {}, 0", lty(ct)?, tx.op(args[0])?));
            let (a, b) = (tx.typed(args[1])?, tx.typed(args[2])?);
            tx.emit(format!("{r} = select i1 {c}, {a}, {b}"));
            set(tx, r);
        }
        (Opcode::Bitselect, _) => {
            let t = rty.unwrap();
            let it = Type::int(t.lane_bits() as u16).unwrap().by(t.lane_count()).unwrap();
            let mut ints = Vec::new();
            for &a in &args {
                let at = tx.ty(a);
                let s = tx.op(a)?;
                if at == it {
                    ints.push(s);
                } else {
                    let c = tx.fresh();
                    tx.emit(format!("{c} = bitcast {} {s} to {}", lty(at)?, lty(it)?));
                    ints.push(c);
                }
            }
            let l = lty(it)?;
            let (x, y, nc, z, o) = (tx.fresh(), tx.fresh(), tx.fresh(), tx.fresh(), tx.fresh());
            tx.emit(format!("{x} = and {l} {}, {}", ints[1], ints[0]));
            tx.emit(format!("{nc} = xor {l} {}, {}", ints[0], int_splat(it, -1)?));
            tx.emit(format!("{y} = and {l} {}, {nc}", ints[2]));
            tx.emit(format!("{z} = or {l} {x}, {y}"));
            if it == t {
                set(tx, z);
            } else {
                tx.emit(format!("{o} = bitcast {l} {z} to {}", lty(t)?));
                set(tx, o);
            }
        }
        (Opcode::Bmask, _) => {
            let at = tx.ty(args[0]);
            let c = tx.fresh();
            tx.emit(format!("{c} = icmp ne {} {}, {}", lty(at)?, tx.op(args[0])?, int_splat(at, 0)?));
            let i1 = if at.is_vector() { format!("<{} x i1>", at.lane_count()) } else { "i1".to_string() };
            tx.emit(format!("{r} = sext {i1} {c} to {}", lty(rty.unwrap())?));
            set(tx, r);
        }
        (Opcode::Load | Opcode::Uload8 | Opcode::Sload8 | Opcode::Uload16 | Opcode::Uload16x4, InstructionData::Load { offset, .. }) => {
            let p = tx.ptr(args[0], offset.into())?;
            let t = rty.unwrap();
            let (mem, ext) = match op {
                Opcode::Load => (lty(t)?, None),
                Opcode::Uload8 => ("i8".to_string(), Some("zext")),
                Opcode::Sload8 => ("i8".to_string(), Some("sext")),
                Opcode::Uload16 => ("i16".to_string(), Some("zext")),
                _ => ("<4 x i16>".to_string(), Some("zext")),
            };
            match ext {
                None => tx.emit(format!("{r} = load {mem}, ptr {p}, align 1")),
                Some(e) => {
                    let l = tx.fresh();
                    tx.emit(format!("{l} = load {mem}, ptr {p}, align 1"));
                    tx.emit(format!("{r} = {e} {mem} {l} to {}", lty(t)?));
                }
            }
            set(tx, r);
        }
        (Opcode::Store | Opcode::Istore8 | Opcode::Istore16, InstructionData::Store { offset, .. }) => {
            let p = tx.ptr(args[1], offset.into())?;
            let vt = tx.ty(args[0]);
            let v = tx.op(args[0])?;
            match op {
                Opcode::Store => tx.emit(format!("store {} {v}, ptr {p}, align 1", lty(vt)?)),
                _ => {
                    let nt = if op == Opcode::Istore8 { "i8" } else { "i16" };
                    let t = tx.fresh();
                    tx.emit(format!("{t} = trunc {} {v} to {nt}", lty(vt)?));
                    tx.emit(format!("store {nt} {t}, ptr {p}, align 1"));
                }
            }
        }
        (Opcode::StackAddr, InstructionData::StackAddr { stack_slot, offset, .. }) => {
            let off: i32 = offset.into();
            let t = tx.fresh();
            tx.emit(format!("{t} = ptrtoint ptr %ss{} to i64", stack_slot.as_u32()));
            tx.emit(format!("{r} = add i64 {t}, {off}"));
            set(tx, r);
        }
        (Opcode::Splat, _) => {
            let t = rty.unwrap();
            let x = tx.typed(args[0])?;
            let i = tx.fresh();
            tx.emit(format!("{i} = insertelement {} poison, {x}, i32 0", lty(t)?));
            tx.emit(format!("{r} = shufflevector {} {i}, {} poison, <{} x i32> zeroinitializer", lty(t)?, lty(t)?, t.lane_count()));
            set(tx, r);
        }
        (Opcode::ScalarToVector, _) => {
            let t = rty.unwrap();
            let x = tx.typed(args[0])?;
            tx.emit(format!("{r} = insertelement {} zeroinitializer, {x}, i32 0", lty(t)?));
            set(tx, r);
        }
        (Opcode::Extractlane, InstructionData::BinaryImm8 { imm, .. }) => {
            let x = tx.typed(args[0])?;
            tx.emit(format!("{r} = extractelement {x}, i32 {}", imm));
            set(tx, r);
        }
        (Opcode::Insertlane, InstructionData::TernaryImm8 { imm, .. }) => {
            let (v, x) = (tx.typed(args[0])?, tx.typed(args[1])?);
            tx.emit(format!("{r} = insertelement {v}, {x}, i32 {}", imm));
            set(tx, r);
        }
        (Opcode::SwidenLow | Opcode::UwidenLow, _) => {
            let st = tx.ty(args[0]);
            let t = rty.unwrap();
            let n = t.lane_count();
            let half = format!("<{n} x {}>", lty(st.lane_type())?);
            let idx: Vec<String> = (0..n).map(|i| format!("i32 {i}")).collect();
            let s = tx.fresh();
            tx.emit(format!("{s} = shufflevector {} {}, {} poison, <{n} x i32> <{}>", lty(st)?, tx.op(args[0])?, lty(st)?, idx.join(", ")));
            let e = if op == Opcode::SwidenLow { "sext" } else { "zext" };
            tx.emit(format!("{r} = {e} {half} {s} to {}", lty(t)?));
            set(tx, r);
        }
        (Opcode::Snarrow | Opcode::Unarrow, _) => {
            let st = tx.ty(args[0]);
            let t = rty.unwrap();
            let bits = t.lane_bits();
            let (lo, hi) = if op == Opcode::Snarrow { (-(1i64 << (bits - 1)), (1i64 << (bits - 1)) - 1) } else { (0, (1i64 << bits) - 1) };
            let n = st.lane_count();
            let half = Type::int(bits as u16).unwrap().by(n).unwrap();
            let (a, b) = (tx.op(args[0])?, tx.op(args[1])?);
            let x = tx.clamp_trunc(&a, st, lo, hi, half)?;
            let y = tx.clamp_trunc(&b, st, lo, hi, half)?;
            let idx: Vec<String> = (0..2 * n).map(|i| format!("i32 {i}")).collect();
            tx.emit(format!("{r} = shufflevector {} {x}, {} {y}, <{} x i32> <{}>", lty(half)?, lty(half)?, 2 * n, idx.join(", ")));
            set(tx, r);
        }
        (Opcode::Call, InstructionData::Call { func_ref, .. }) => {
            let Some(&addr) = tx.helpers.get(&func_ref) else { return bad("llvm: a call to an unknown function") };
            let sig = &f.dfg.signatures[f.dfg.ext_funcs[func_ref].signature];
            let ret = match sig.returns.first() {
                Some(p) => lty(p.value_type)?,
                None => "void".to_string(),
            };
            let a: Vec<String> = args.iter().map(|&v| tx.typed(v)).collect::<R<_>>()?;
            let fp = tx.fresh();
            tx.emit(format!("{fp} = inttoptr i64 {addr} to ptr"));
            if ret == "void" {
                tx.emit(format!("call void {fp}({})", a.join(", ")));
            } else {
                tx.emit(format!("{r} = call {ret} {fp}({})", a.join(", ")));
                set(tx, r);
            }
        }
        (Opcode::Jump, InstructionData::Jump { destination, .. }) => {
            let target = destination.block(&f.dfg.value_lists);
            // Phis read the arguments: make sure they are named values here.
            tx.out.push_str(&format!("  br label %b{}_end\nb{}_end:\n  br label %b{}\n", block.as_u32(), block.as_u32(), target.as_u32()));
        }
        (Opcode::Brif, InstructionData::Brif { arg, blocks, .. }) => {
            let ct = tx.ty(arg);
            let c = tx.fresh();
            tx.emit(format!("{c} = icmp ne {} {}, 0", lty(ct)?, tx.op(arg)?));
            let (a, b) = (blocks[0].block(&f.dfg.value_lists), blocks[1].block(&f.dfg.value_lists));
            tx.out.push_str(&format!("  br label %b{}_end\nb{}_end:\n  br i1 {c}, label %b{}, label %b{}\n", block.as_u32(), block.as_u32(), a.as_u32(), b.as_u32()));
        }
        (Opcode::Return, _) => {
            let v = tx.typed(args[0])?;
            tx.emit(format!("ret {v}"));
        }
        _ => return bad(format!("llvm: cranelift op `{op}`")),
    }
    let _ = results;
    Ok(())
}
