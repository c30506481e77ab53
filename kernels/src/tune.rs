//! What `tessera tune` varies: per op, the block statics and the values a TPU engineer would
//! try (the MXU edge and its multiples for attention blocks, power-of-two page counts for
//! paged attention, gmm's `(tm, tk, tn)` tilings). The tuner enumerates the product of an
//! op's knobs, lets the plan builder and the verifier prune what cannot run (tiling rules,
//! VMEM with the calibrated margin), and ranks the survivors by libtpu's static cost.
//!
//! A knob names a static of the op's schema (a test holds every knob to that); an op with
//! no knobs has nothing to tune (its blocks follow from the shapes).

use crate::op::Op;

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
