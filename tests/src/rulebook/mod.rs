//! The rulebook's evidence: for every rule libtpu judges, pairs of minimal kernels that
//! differ in one thing, one just inside the rule's edge (libtpu accepts it) and one just
//! outside (libtpu rejects it), per generation where the edge differs. Performance
//! warnings have pairs too: libtpu accepts both halves, ours warns on the outside one.
//! Principles: `README.md` next to this file. The checks: `tests/tests/rulebook.rs`.
//!
//! The modules mirror the verifier's (`dsl/src/verify/`).

mod body;
mod budget;
mod dma;
mod grid;
mod operand;

use tessera_dsl::Target;

use crate::kit::Built;

/// One evidence pair.
pub struct Pair {
    /// The rule (`dsl/src/rules.rs`) the outside half breaks.
    pub rule: &'static str,
    /// A short name for the edge, unique within the rule (`rows`, `lanes`...).
    pub edge: &'static str,
    /// What the halves differ in, for a reader.
    pub differs: &'static str,
    /// The generations this pair is evidence for (its edge may sit elsewhere on others).
    pub targets: &'static [Target],
    pub inside: fn(&Target) -> Built,
    pub outside: fn(&Target) -> Built,
}

/// One half of a pair, built for one target.
pub struct Half {
    /// `rulebook/<rule>/<edge>/<inside|outside>@<target>`: the key of its recorded verdict.
    pub name: String,
    pub rule: &'static str,
    pub inside: bool,
    pub target: Target,
    pub kernel: Built,
}

pub const ALL_TARGETS: &[Target] = &[Target::V5E, Target::V6E, Target::TPU7X, Target::V5P];

/// Every pair.
pub fn pairs() -> Vec<Pair> {
    let mut out = Vec::new();
    out.extend(grid::pairs());
    out.extend(operand::pairs());
    out.extend(budget::pairs());
    out.extend(body::pairs());
    out.extend(dma::pairs());
    out
}

/// Every half of every pair on every target it applies to.
pub fn halves() -> Vec<Half> {
    let mut out = Vec::new();
    for p in pairs() {
        for t in p.targets {
            for (inside, f) in [(true, p.inside), (false, p.outside)] {
                let side = if inside { "inside" } else { "outside" };
                let kernel = f(t).map(|mut k| {
                    k.name = "evidence".into();
                    k
                });
                out.push(Half { name: format!("rulebook/{}/{}/{side}@{}", p.rule, p.edge, t.name), rule: p.rule, inside, target: *t, kernel });
            }
        }
    }
    out
}
