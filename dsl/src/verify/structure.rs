//! The IR is well formed: every id an instruction names exists, and every access agrees with the ref it touches (one slice per view dim, the ref's dtype,
//! the slice's shape). `KernelBuilder` only makes such IR; this guards kernels edited or
//! assembled by hand (the `Kernel` fields are public), so that the other checks, the
//! backends and the emitters can index without panicking. Violations are `malformed-ir`.

use super::Verifier;
use crate::error::Result;
use crate::ir::*;
use crate::types::DType;

impl Verifier<'_> {
    pub(super) fn structure(&self) -> Result<()> {
        let k = self.k;
        let bad = |what: String| Err(self.err("IR", "malformed-ir", what, "build kernels with KernelBuilder (or keep hand edits consistent)"));
        // The name becomes an MLIR symbol and the stem of emitted files (`<dir>/<target>/<name>.*`).
        let ident = k.name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && k.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(self.err("name", "kernel-name", format!("the kernel is named {:?}", k.name), "name kernels like Rust identifiers: ASCII letters, digits and `_`, not starting with a digit"));
        }
        if k.body.index() >= k.blocks.len() {
            return bad(format!("the body is block {} of {}", k.body.index(), k.blocks.len()));
        }
        for (i, d) in k.insts.iter().enumerate() {
            let name = || format!("instruction {i} (`{}`)", d.inst.name());
            for v in d.inst.operands().into_iter().chain(d.results.iter().copied()) {
                if v.index() >= k.values.len() {
                    return bad(format!("{} names value {} of {}", name(), v.index(), k.values.len()));
                }
            }
            match &d.inst {
                Inst::Load { src, slices } => {
                    let r = self.ref_of(*src, &name())?;
                    self.slices_match(r, slices, &name())?;
                    if let Some(&out) = d.results.first() {
                        let ty = k.ty(out);
                        let lens: Vec<usize> = slices.iter().map(|s| s.len).collect();
                        if ty.dtype != r.dtype || (!ty.is_scalar() && ty.shape != lens) {
                            return bad(format!("{} loads {ty} from `{}` ({}, slice {lens:?})", name(), r.name, r.dtype));
                        }
                    }
                }
                Inst::Store { dst, slices, value } => {
                    let r = self.ref_of(*dst, &name())?;
                    self.slices_match(r, slices, &name())?;
                    let ty = k.ty(*value);
                    let lens: Vec<usize> = slices.iter().map(|s| s.len).collect();
                    if ty.dtype != r.dtype || (!ty.is_scalar() && ty.shape != lens) {
                        return bad(format!("{} stores {ty} into `{}` ({}, slice {lens:?})", name(), r.name, r.dtype));
                    }
                }
                Inst::DmaStart { src, dst, sem, .. } | Inst::DmaWait { src, dst, sem, .. } => {
                    for side in [src, dst] {
                        let r = self.ref_of(side.r, &name())?;
                        self.slices_match(r, &side.slices, &name())?;
                    }
                    self.ref_of(*sem, &name())?;
                    if let Inst::DmaStart { remote: Some(r), .. } = &d.inst {
                        self.ref_of(r.send_sem, &name())?;
                    }
                }
                Inst::SemSignal { sem: SemaphoreRef::Array { sem, .. }, .. } | Inst::SemWait { sem: SemaphoreRef::Array { sem, .. }, .. } => {
                    self.ref_of(*sem, &name())?;
                }
                Inst::If { then_block, else_block, .. } => {
                    for b in [then_block, else_block] {
                        if b.index() >= k.blocks.len() {
                            return bad(format!("{} names block {} of {}", name(), b.index(), k.blocks.len()));
                        }
                    }
                }
                Inst::For { body, .. } if body.index() >= k.blocks.len() => return bad(format!("{} names block {} of {}", name(), body.index(), k.blocks.len())),
                Inst::ProgramId(a) | Inst::NumPrograms(a) if *a >= k.grid.len() => return bad(format!("{} reads grid axis {a} of {}", name(), k.grid.len())),
                // What the compiled backends' shift and rounding lowerings rely on.
                Inst::Binary(op, a, b) if op.is_shift() && !(k.ty(*a).dtype.is_int() && k.ty(*b).dtype == k.ty(*a).dtype) => {
                    return bad(format!("{} shifts {} by {}; shifts take integers of one dtype", name(), k.ty(*a), k.ty(*b)))
                }
                Inst::Cumsum { axis, x } if *axis >= k.ty(*x).rank() || !matches!(k.ty(*x).dtype, DType::F32 | DType::BF16 | DType::I32) || d.results.first().map(|&r| k.ty(r)) != Some(k.ty(*x)) => {
                    return bad(format!("{} is a cumsum along axis {axis} of {}; cumsum keeps the type of an f32, bf16 or i32 vector", name(), k.ty(*x)))
                }
                Inst::PrngSeed(seeds) if seeds.is_empty() || seeds.iter().any(|&v| k.ty(v) != &crate::types::Type::scalar(DType::I32)) => {
                    return bad(format!("{} seeds with {} values; seeds are one or more i32 scalars", name(), seeds.len()))
                }
                Inst::PrngRandomBits if d.results.len() != 1 || d.results.first().is_some_and(|&r| k.ty(r).dtype != DType::I32 || k.ty(r).rank() < 2) => {
                    return bad(format!("{} must give one i32 vector of rank >= 2", name()))
                }
                Inst::Bitcast(x) if !matches!((k.ty(*x).dtype, d.results.first().map(|&r| k.ty(r).dtype)), (DType::I32, Some(DType::F32)) | (DType::F32, Some(DType::I32))) => {
                    return bad(format!("{} bitcasts {} to another dtype than i32 <-> f32", name(), k.ty(*x)))
                }
                Inst::Item(x) if k.ty(*x).is_scalar() || k.ty(*x).num_elements() != 1 || !matches!(k.ty(*x).dtype, DType::F32 | DType::I32) || d.results.first().map(|&r| k.ty(r)) != Some(&crate::types::Type::scalar(k.ty(*x).dtype)) => {
                    return bad(format!("{} takes the item of {}; `item` moves the one element of an f32 or i32 vector to a scalar", name(), k.ty(*x)))
                }
                Inst::Unary(op @ (UnaryOp::Log1p | UnaryOp::Expm1 | UnaryOp::Sin | UnaryOp::Cos | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Sign), x) if !k.ty(*x).dtype.is_float() => {
                    return bad(format!("{} applies `{}` to {}, a float op", name(), op.name(), k.ty(*x)))
                }
                _ => {}
            }
        }
        // A vector value lives in vregs and VMEM: one larger than the core's VMEM cannot
        // exist (even if Mosaic might drop an unused one, every CPU backend materialises it).
        for (i, v) in k.values.iter().enumerate() {
            let bytes = v.ty.shape.iter().try_fold(v.ty.dtype.bits().div_ceil(8), |a, &d| a.checked_mul(d));
            if bytes.is_none_or(|b| b > self.t.vmem_bytes) {
                let loc = k.insts.iter().find(|d| d.results.contains(&Value(i as u32))).and_then(|d| d.loc.clone());
                return Err(self
                    .err(format!("value %{i}"), "value-size", format!("a {} value is larger than {}'s {} MiB of VMEM", v.ty, self.t.name, self.t.vmem_bytes >> 20), "work on blocks: a value must fit the core's VMEM")
                    .at(loc));
            }
        }
        for b in &k.blocks {
            for &i in &b.insts {
                if i.index() >= k.insts.len() {
                    return bad(format!("a block lists instruction {} of {}", i.index(), k.insts.len()));
                }
            }
            if let Some(p) = b.params.iter().find(|p| p.index() >= k.values.len()) {
                return bad(format!("a block parameter is value {} of {}", p.index(), k.values.len()));
            }
        }
        Ok(())
    }

    fn ref_of(&self, r: RefId, what: &str) -> Result<&RefDecl> {
        self.k.refs.get(r.index()).ok_or_else(|| self.err("IR", "malformed-ir", format!("{what} names ref {} of {}", r.index(), self.k.refs.len()), "build kernels with KernelBuilder (or keep hand edits consistent)"))
    }

    fn slices_match(&self, r: &RefDecl, slices: &[Slice], what: &str) -> Result<()> {
        let view = r.view();
        if slices.len() != view.len() {
            return Err(self.err("IR", "malformed-ir", format!("{what} gives {} slices for `{}`, whose view {view:?} has {} dims", slices.len(), r.name, view.len()), "build kernels with KernelBuilder (or keep hand edits consistent)"));
        }
        if slices.iter().any(|s| s.stride == 0 || s.len == 0) {
            return Err(self.err("IR", "malformed-ir", format!("{what} slices `{}` with a zero length or stride", r.name), "build kernels with KernelBuilder (or keep hand edits consistent)"));
        }
        Ok(())
    }
}
