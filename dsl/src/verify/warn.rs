//! Warnings: the kernel compiles (libtpu accepts it) but runs below what the generation can
//! do, or does something that is legal but rarely meant (a grid that never reads the end of
//! an input). Reported by the CLI and the torch path once per kernel; never an error.

use crate::error::Warning;
use crate::ir::*;
use crate::target::{DotSupport, Target};
use crate::types::MemorySpace;

/// Every performance warning for `k` on `target` (assumes `k` verifies).
pub fn warnings(k: &Kernel, target: &Target) -> Vec<Warning> {
    let mut out = Vec::new();
    let warn = |subject: String, rule: &'static str, message: String, help: String| Warning { kernel: k.name.clone(), subject, rule, message, help };
    for r in &k.refs {
        let Some(b) = &r.block else { continue };
        let rank = r.shape.len();
        if r.memory != MemorySpace::Vmem || rank < 2 || r.dtype.bits() == 32 {
            continue;
        }
        let (native, _) = target.native_tile(r.dtype);
        let rows = b.window()[rank - 2];
        if rows % native != 0 && rows != r.shape[rank - 2] {
            out.push(warn(
                format!("{} `{}`", r.kind.name(), r.name),
                "block-native-tiling",
                format!("block {:?} of {}: {rows} rows is not a multiple of the packed native tile of {native} rows, so vregs are partly empty and loads and stores need relayouts", b.window(), r.dtype),
                format!("use a multiple of {native} rows if the shapes allow it"),
            ));
        }
    }
    // An input whose trailing blocks along a dim no grid step reads: a grid of `k / bk`
    // steps where `k` is not a multiple of `bk` drops the rest of a contraction, silently.
    let v = super::Verifier { k, t: target };
    for r in k.refs.iter().filter(|r| r.kind == RefKind::Input) {
        let Some(b) = &r.block else { continue };
        let Ok(Some(visited)) = v.visited_blocks(b) else { continue };
        for (d, (&n, &full)) in b.window().iter().zip(&r.shape).enumerate() {
            let blocks = full.div_ceil(n) as i64;
            let last = visited.iter().map(|idx| idx[d]).max().unwrap_or(0);
            if last + 1 < blocks {
                out.push(warn(
                    format!("input `{}`", r.name),
                    "input-unread",
                    format!("no grid step reads past block {last} of dim {d} ({} of {full} elements in blocks of {n}): the rest of the input never reaches the kernel", (last + 1) * n as i64),
                    format!("if the whole input is meant, give that dim's grid axis {blocks} steps (`{full}.div_ceil({n})`, masking the partial last block) or a block that divides {full}"),
                ));
            }
        }
    }
    k.walk(k.body, &mut |_, d| {
        if let Inst::Dot { lhs, rhs, .. } = &d.inst {
            let (dl, dr) = (k.ty(*lhs).dtype, k.ty(*rhs).dtype);
            let dt = if target.dot_support(dl) == DotSupport::Compiles { dl } else { dr };
            if target.dot_support(dt) == DotSupport::Compiles {
                out.push(warn(
                    "instruction `dot`".to_string(),
                    "matmul-emulated",
                    format!("{dt} x {dt} matmul compiles for {target}, but its MXU has no {dt} mode: it may run emulated"),
                    format!("for speed on {target}, multiply in one of: {}", target.matmul_dtypes.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")),
                ));
            }
        }
    });
    out
}
