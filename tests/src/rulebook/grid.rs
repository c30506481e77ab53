//! Grid bounds (`verify/grid.rs`).

use super::{Pair, ALL_TARGETS};
use crate::kit;

const G: usize = 1 << 31;

pub fn pairs() -> Vec<Pair> {
    vec![
        Pair {
            rule: "grid-extent-range",
            edge: "extent",
            differs: "a 1-D grid of 2^31 - 130 steps vs 2^31 - 129",
            targets: ALL_TARGETS,
            inside: |_| kit::copy_on_grid("p", &[G - 130]),
            outside: |_| kit::copy_on_grid("p", &[G - 129]),
        },
        Pair {
            rule: "grid-steps",
            edge: "steps",
            differs: "a [2, 2^30 - 64] grid vs [2, 2^30]",
            targets: ALL_TARGETS,
            inside: |_| kit::copy_on_grid("p", &[2, (1 << 30) - 64]),
            outside: |_| kit::copy_on_grid("p", &[2, 1 << 30]),
        },
    ]
}
