//! The grid: at least one dimension, every extent positive and within what libtpu
//! compiles, and a step count `program_id` arithmetic cannot overflow. A dynamic dim is
//! checked at its static bound; its extent operand is an int32 `[1]` scalar prefetch.

use super::Verifier;
use crate::error::Result;
use crate::ir::{Inst, RefKind};
use crate::types::DType;
use crate::target::{MAX_GRID_EXTENT, MAX_GRID_STEPS};

impl Verifier<'_> {
    pub(super) fn grid(&self) -> Result<()> {
        if self.k.grid.is_empty() {
            return Err(self.err("grid", "grid-rank", "the grid has no dimensions", "give the kernel a grid of at least one dimension, e.g. grid = [1]"));
        }
        for (d, g) in self.k.grid.iter().enumerate() {
            // libtpu compiles a zero extent, but then the body never runs and every output
            // is left uninitialised: ours to refuse.
            if g.extent == 0 {
                return Err(self.err("grid", "grid-extent", format!("dimension {d} has extent 0"), "every grid dimension needs at least one step; check the shapes you passed"));
            }
            if g.extent > MAX_GRID_EXTENT {
                return Err(self.err(
                    "grid",
                    "grid-extent-range",
                    format!("dimension {d} has extent {}; libtpu takes extents up to {MAX_GRID_EXTENT} (2^31 - 130)", g.extent),
                    "use larger blocks so the grid has fewer steps, or split the work over several grid dimensions",
                ));
            }
        }
        self.dynamic_extents()?;
        let steps = self.k.grid.iter().try_fold(1usize, |n, g| n.checked_mul(g.extent));
        match steps {
            Some(n) if n <= MAX_GRID_STEPS => Ok(()),
            _ => {
                let dims: Vec<String> = self.k.grid.iter().map(|g| g.extent.to_string()).collect();
                Err(self.err(
                    "grid",
                    "grid-steps",
                    format!("the grid [{}] has more than {MAX_GRID_STEPS} (2^31 - 128) steps, the most libtpu runs (`program_id` is an i32)", dims.join(", ")),
                    "use larger blocks so the grid has fewer steps",
                ))
            }
        }
    }

    /// Each dynamic dim's extent operand: a scalar-prefetch int32 `[1]` (the leading
    /// custom-call operand is its one element), and `num_programs` of the dim reads it.
    fn dynamic_extents(&self) -> Result<()> {
        for (d, g) in self.k.grid.iter().enumerate() {
            let Some(r) = g.dynamic else { continue };
            let help = "declare the extent as a scalar-prefetch operand of shape [1] (`n: Prefetch<1>`) and name it: grid = [.., dynamic(bound, n), ..]";
            let Some(decl) = self.k.refs.get(r.index()) else {
                return Err(self.err("grid", "grid-dynamic-extent", format!("dimension {d} takes its extent from {r}, which does not exist"), help));
            };
            if decl.kind != RefKind::Prefetch || decl.dtype != DType::I32 || decl.shape != [1] {
                return Err(self.err_at(
                    decl,
                    "grid",
                    "grid-dynamic-extent",
                    format!("dimension {d} takes its extent from {} `{}` ({} {:?}), not an int32 [1] scalar-prefetch operand", decl.kind.name(), decl.name, decl.dtype, decl.shape),
                    help,
                ));
            }
        }
        let mut bad = None;
        self.k.walk(self.k.body, &mut |_, data| {
            if let Inst::NumPrograms(a) = data.inst {
                if self.k.grid.get(a).is_some_and(|g| g.dynamic.is_some()) && bad.is_none() {
                    bad = Some((a, data.loc.clone()));
                }
            }
        });
        if let Some((a, loc)) = bad {
            return Err(self
                .err(format!("num_programs({a})"), "grid-dynamic-extent", format!("grid dim {a} is dynamic: its extent is known only at run time"), "read the extent operand instead (KernelBuilder::num_programs does)")
                .at(loc));
        }
        Ok(())
    }
}
