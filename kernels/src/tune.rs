//! What `tessera tune` varies: per op, the block statics and the values a TPU engineer would
//! try (the MXU edge and its multiples for attention blocks, power-of-two page counts for
//! paged attention, gmm's `(tm, tk, tn)` tilings). The tuner enumerates the product of an
//! op's knobs, lets the plan builder and the verifier prune what cannot run (tiling rules,
//! VMEM with the calibrated margin), and ranks the survivors by libtpu's static cost.
//!
//! A knob names a static of the op's schema (a test holds every knob to that); an op with
//! no knobs has nothing to tune (its blocks follow from the shapes).
//!
//! # The shipped table
//!
//! `kernels/tuned.json` is a table `tessera tune --save` wrote (format 1: each entry the op,
//! case, target, dtype, input shapes, the other statics, the libtpu version and every
//! candidate's figures, so a run can be repeated and compared). A call whose knobs are all
//! left unset and whose op, target, float dtype, input shapes and other statics are exactly
//! an entry's takes that entry's best blocks ([`Op::plan_for`]); any other call keeps the
//! op's own defaults. Exact keys, as serving stacks' tuned block tables are: a shape the
//! table does not hold is never guessed from a neighbour.

use std::sync::OnceLock;

use tessera_dsl::Type;

use crate::op::{Op, Static, Statics};

/// One static the tuner varies, and its candidate values (schema literals).
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    pub name: &'static str,
    pub values: &'static [&'static str],
}

const ATTENTION: &[Knob] = &[
    Knob { name: "block_q", values: &["128", "256", "512", "1024"] },
    Knob { name: "block_kv", values: &["128", "256", "512", "1024"] },
];

const GMM: &[Knob] = &[Knob {
    name: "tiling",
    values: &["[128, 128, 128]", "[256, 256, 256]", "[512, 256, 256]", "[256, 512, 512]", "[512, 512, 512]", "[512, 1024, 1024]", "[1024, 512, 512]"],
}];

/// The knobs of op `name` (empty: nothing to tune).
pub fn knobs(name: &str) -> &'static [Knob] {
    match name {
        "flash_attention_fwd" | "flash_attention_bwd" | "flash_attention" => ATTENTION,
        "gmm" | "tgmm" => GMM,
        "paged_attention" => &[Knob { name: "pages_per_compute_block", values: &["1", "2", "4", "8", "16", "32", "64"] }],
        "ragged_paged_attention" => &[
            Knob { name: "num_queries_per_block", values: &["16", "32", "64", "128"] },
            Knob { name: "num_kv_pages_per_block", values: &["4", "8", "16", "32"] },
        ],
        _ => &[],
    }
}

/// Every combination of `op`'s knob values as `name=value, ...` statics (in knob order,
/// the last knob varying fastest); a knob `fixed` already sets (`--statics`) is left out.
pub fn candidates(op: &Op, fixed: &[&str]) -> Vec<String> {
    let knobs: Vec<&Knob> = knobs(op.name).iter().filter(|k| !fixed.contains(&k.name)).collect();
    if knobs.is_empty() {
        return Vec::new();
    }
    let mut out = vec![String::new()];
    for k in knobs {
        out = out.iter().flat_map(|prefix| k.values.iter().map(move |v| if prefix.is_empty() { format!("{}={v}", k.name) } else { format!("{prefix}, {}={v}", k.name) })).collect();
    }
    out
}

/// One entry of the shipped table: its key and its best statics.
#[derive(Debug)]
pub struct Tuned {
    pub op: String,
    pub target: String,
    /// The run's float dtype (`bf16`, `f32`).
    pub dtype: String,
    /// Input shapes by input name.
    pub shapes: Vec<(String, Vec<usize>)>,
    /// The call's statics with the knobs unset (`Statics`' display).
    pub statics: String,
    pub best: String,
}

/// The shipped table's entries.
pub fn table() -> &'static [Tuned] {
    static TABLE: OnceLock<Vec<Tuned>> = OnceLock::new();
    TABLE.get_or_init(|| parse(include_str!("../tuned.json")).expect("kernels/tuned.json is a format-1 tuning table"))
}

/// The entries of a format-1 table with a best candidate.
fn parse(text: &str) -> Result<Vec<Tuned>, String> {
    let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if doc["format"] != 1 {
        return Err(format!("format {}", doc["format"]));
    }
    let str_of = |v: &serde_json::Value| v.as_str().map(str::to_string);
    let entries = doc["entries"].as_array().ok_or("no entries")?;
    Ok(entries
        .iter()
        .filter_map(|e| {
            let shapes = e["shapes"].as_object()?.iter().map(|(n, s)| Some((n.clone(), s.as_array()?.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<_>>>()?))).collect::<Option<Vec<_>>>()?;
            Some(Tuned { op: str_of(&e["op"])?, target: str_of(&e["target"])?, dtype: str_of(&e["dtype"])?, shapes, statics: str_of(&e["statics"])?, best: str_of(&e["best"])? })
        })
        .collect())
}

/// The shipped table's best knobs (`name=value, ...`) for a call of `op` with these input
/// types and statics on `target`, when every knob is unset and the table holds exactly this
/// call; `None` otherwise.
pub fn tuned_statics(op: &Op, inputs: &[Option<Type>], statics: &Statics, target: &str) -> Option<&'static str> {
    let knobs = knobs(op.name);
    if knobs.is_empty() || knobs.iter().any(|k| !matches!(statics.get(k.name), Static::None)) {
        return None;
    }
    // The run's float dtype (the CLI's `--dtype`): its first float input's.
    let dtype = op.inputs.iter().zip(inputs).find(|(i, _)| i.kind == crate::op::Kind::Float).and_then(|(_, t)| t.as_ref()).map(|t| t.dtype.name())?;
    let statics = statics.to_string();
    // An alias (`flash_attention`) plans as its source op: it takes the source's entries.
    let name = op.alias_of.map_or(op.name, |(of, _)| of);
    table()
        .iter()
        .find(|e| {
            e.op == name
                && e.target == target
                && e.dtype == dtype
                && e.statics == statics
                && e.shapes.len() == op.inputs.iter().zip(inputs).filter(|(_, t)| t.is_some()).count()
                && e.shapes.iter().all(|(name, shape)| op.inputs.iter().position(|i| i.name == name).and_then(|i| inputs.get(i)?.as_ref()).is_some_and(|t| &t.shape == shape))
        })
        .map(|e| e.best.as_str())
}
