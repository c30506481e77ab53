//! The grid: at least one dimension, every extent positive and within what libtpu
//! compiles, and a step count `program_id` arithmetic cannot overflow.

use super::Verifier;
use crate::error::Result;
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
}
