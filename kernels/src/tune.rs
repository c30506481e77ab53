//! What `tessera tune` varies and where its results live. An op's knobs ([`Op::knobs`]) are
//! its block statics and the values a TPU engineer would try (the MXU edge and its multiples
//! for attention blocks, power-of-two page counts for paged attention, gmm's `(tm, tk, tn)`
//! tilings); a user's op declares its own the same way. The tuner enumerates the product of
//! an op's knobs, lets the plan builder and the verifier prune what cannot run (tiling rules,
//! VMEM with the calibrated margin), and ranks the survivors by libtpu's static cost beside
//! the op's own block rule (the baseline: when it wins, the entry's `best` is null, so a call
//! keeps the rule's blocks; ties go to the knob values).
//!
//! A knob names an int static of the op's schema (a test holds every library knob to that);
//! an op with no knobs has nothing to tune (its blocks follow from the shapes).
//!
//! # Tables
//!
//! `tessera tune --save FILE` writes a format-1 table: each entry the op, case, target,
//! dtype, input shapes, the other statics, the libtpu version and every candidate's figures,
//! so a run can be repeated and compared. A call whose op, target, float dtype, input shapes and
//! statics (the tuned knobs left unset, any knob the run fixed given) are exactly an entry's
//! takes that entry's best blocks ([`Op::plan_for`]); any other call keeps the op's own defaults. Exact
//! keys, as serving stacks' tuned block tables are: a shape the table does not hold is never
//! guessed from a neighbour. `--save` replaces an entry of the same key (statics included).
//! An entry sets only the op's knobs: a `best` naming another static (`causal=False`) is
//! refused at the lookup (`tuning-table`), and blocks that do not verify name the table. An
//! entry whose `best` is null (the op's own rule won the run) holds the call too: it keeps the
//! rule's blocks over any later table's entry. A malformed entry (a field missing or of the
//! wrong type, a negative dim) makes the whole table an error naming the entry, never a
//! silently skipped line.
//!
//! Where entries come from, first match wins:
//! 1. tables added at run time, the latest first: [`add_table`] (a user crate embedding its
//!    own `tuned.json`), [`load_table_file`] (`tessera.load_tuning_table(path)` in Python);
//! 2. the files listed in `TESSERA_TUNING_TABLES` (`:`-separated), read at the first lookup;
//! 3. the library's shipped table, `kernels/tuned.json`.

use std::sync::{OnceLock, RwLock};

use tessera_dsl::{Kernel, KernelError, Type};

use crate::op::{Op, Statics};

/// One static the tuner varies, and its candidate values (schema literals).
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    pub name: &'static str,
    pub values: &'static [&'static str],
}

/// Flash attention's `block_q` x `block_kv`.
pub const ATTENTION: &[Knob] = &[
    Knob { name: "block_q", values: &["128", "256", "512", "1024"] },
    Knob { name: "block_kv", values: &["128", "256", "512", "1024"] },
];

/// gmm's and tgmm's `(tm, tk, tn)` tiling.
pub const GMM: &[Knob] = &[Knob {
    name: "tiling",
    values: &["[128, 128, 128]", "[256, 256, 256]", "[512, 256, 256]", "[256, 512, 512]", "[512, 512, 512]", "[512, 1024, 1024]", "[1024, 512, 512]"],
}];

/// matmul's `block_m` x `block_k` x `block_n`: MXU multiples from where the grid-step
/// overhead is amortised (DESIGN §6) up to what VMEM holds.
pub const MATMUL: &[Knob] = &[
    Knob { name: "block_m", values: &["256", "512", "1024", "2048"] },
    Knob { name: "block_k", values: &["512", "1024", "2048"] },
    Knob { name: "block_n", values: &["512", "1024", "2048"] },
];

/// Paged attention's pages per compute block.
pub const PAGED_ATTENTION: &[Knob] = &[Knob { name: "pages_per_compute_block", values: &["1", "2", "4", "8", "16", "32", "64"] }];

/// Ragged paged attention's query and kv-page blocks.
pub const RAGGED_PAGED_ATTENTION: &[Knob] = &[
    Knob { name: "num_queries_per_block", values: &["16", "32", "64", "128"] },
    Knob { name: "num_kv_pages_per_block", values: &["4", "8", "16", "32"] },
];

/// Every combination of `op`'s knob values as `name=value, ...` statics (in knob order,
/// the last knob varying fastest); a knob `fixed` already sets (`--statics`) is left out.
pub fn candidates(op: &Op, fixed: &[&str]) -> Vec<String> {
    let knobs: Vec<&Knob> = op.knobs.iter().filter(|k| !fixed.contains(&k.name)).collect();
    if knobs.is_empty() {
        return Vec::new();
    }
    let mut out = vec![String::new()];
    for k in knobs {
        out = out.iter().flat_map(|prefix| k.values.iter().map(move |v| if prefix.is_empty() { format!("{}={v}", k.name) } else { format!("{prefix}, {}={v}", k.name) })).collect();
    }
    out
}

/// Whether the launches `a` only pad what `b`'s cover: the same kernels with the same grids,
/// every block of `a` at least `b`'s, and wherever they differ `b`'s block already spans
/// the whole array dim (so `a` runs the same steps over the same data and computes more
/// padding). The tuner prunes such an `a` (`block_cols=2048` over 1024 columns beside
/// `block_cols=1024`) instead of spending a libtpu compile on it. A block larger than
/// its array that changes the grid (1024 rows over 1000, one step instead of two) is not
/// pruned.
pub fn pads_only(a: &[Kernel], b: &[Kernel]) -> bool {
    let mut differs = false;
    let same_shape = a.len() == b.len()
        && a.iter().zip(b).all(|(ka, kb)| {
            let grids = ka.grid.len() == kb.grid.len() && ka.grid.iter().zip(&kb.grid).all(|(x, y)| x.extent == y.extent);
            grids
                && ka.name == kb.name
                && ka.refs.len() == kb.refs.len()
                && ka.refs.iter().zip(&kb.refs).all(|(ra, rb)| match (&ra.block, &rb.block) {
                    (None, None) => true,
                    (Some(ba), Some(bb)) if ra.shape == rb.shape && ba.block_shape.len() == bb.block_shape.len() => {
                        ba.window().iter().zip(bb.window()).zip(&ra.shape).all(|((&wa, wb), &n)| {
                            differs |= wa != wb;
                            wa == wb || (wa > wb && wb >= n)
                        })
                    }
                    _ => false,
                })
        });
    same_shape && differs
}

/// One entry of a tuning table: its key and its best statics.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub op: String,
    pub target: String,
    /// The run's float dtype (`bf16`, `f32`).
    pub dtype: String,
    /// Input shapes by input name.
    pub shapes: Vec<(String, Vec<usize>)>,
    /// The call's statics with the knobs unset (`Statics`' display).
    pub statics: String,
    /// The winning knobs (`name=value, ...`); `None` when the op's own block rule won.
    pub best: Option<String>,
    /// The table it came from (its path, `TESSERA_TUNING_TABLES: path`, or the shipped one).
    pub source: String,
}

/// The shipped table's entries.
pub fn table() -> &'static [Tuned] {
    static TABLE: OnceLock<Vec<Tuned>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let entries = parse(include_str!("../tuned.json")).expect("kernels/tuned.json is a format-1 tuning table");
        entries.into_iter().map(|e| Tuned { source: "kernels/tuned.json".to_string(), ..e }).collect()
    })
}

/// Tables added at run time, in the order they were added.
static ADDED: RwLock<Vec<Tuned>> = RwLock::new(Vec::new());

/// Bumped by every [`add_table`]: plan caches keyed on it drop plans made before.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many tables were added at run time: a plan cache that remembers it can tell its
/// plans may predate a table's blocks.
pub fn generation() -> u64 {
    GENERATION.load(std::sync::atomic::Ordering::Acquire)
}

/// Adds the entries of a format-1 table (the text `tessera tune --save` wrote; `source`
/// names it in errors) ahead of every table added before and of the shipped one. Returns
/// how many entries set blocks (the others keep the op's own rule for their call).
pub fn add_table(text: &str, source: &str) -> Result<usize, KernelError> {
    let entries = parse(text).map_err(|m| KernelError::new("tessera tune", source, "tuning-table", format!("not a tuning table: {m}"), "pass a file `tessera tune --save FILE` wrote (format 1), or fix the entry named"))?;
    let entries: Vec<Tuned> = entries.into_iter().map(|e| Tuned { source: source.to_string(), ..e }).collect();
    let n = entries.iter().filter(|e| e.best.is_some()).count();
    let mut added = ADDED.write().unwrap_or_else(|e| e.into_inner());
    // Latest first: prepend.
    let mut all = entries;
    all.append(&mut added);
    *added = all;
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    Ok(n)
}

/// [`add_table`] of a file.
pub fn load_table_file(path: &std::path::Path) -> Result<usize, KernelError> {
    let text = std::fs::read_to_string(path).map_err(|e| KernelError::new("tessera tune", path.display().to_string(), "tuning-table", format!("cannot read the tuning table: {e}"), "pass the path of a file `tessera tune --save FILE` wrote"))?;
    add_table(&text, &path.display().to_string())
}

/// The tables of `TESSERA_TUNING_TABLES`, read once.
fn env_tables() -> Result<&'static [Tuned], KernelError> {
    static ENV: OnceLock<Result<Vec<Tuned>, KernelError>> = OnceLock::new();
    ENV.get_or_init(|| {
        let Some(paths) = std::env::var_os("TESSERA_TUNING_TABLES") else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for path in std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()) {
            let bad = |m: String| KernelError::new("tessera tune", format!("TESSERA_TUNING_TABLES: {}", path.display()), "tuning-table", m, "list files `tessera tune --save FILE` wrote, separated by `:`, or unset TESSERA_TUNING_TABLES");
            let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot read the tuning table: {e}")))?;
            let source = format!("TESSERA_TUNING_TABLES: {}", path.display());
            out.extend(parse(&text).map_err(|m| bad(format!("not a tuning table: {m}")))?.into_iter().map(|e| Tuned { source: source.clone(), ..e }));
        }
        Ok(out)
    })
    .as_deref()
    .map_err(Clone::clone)
}

/// The entries of a format-1 table (their `source` left empty), or what is wrong with it.
fn parse(text: &str) -> Result<Vec<Tuned>, String> {
    let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if doc["format"] != 1 {
        return Err(format!("format {} (this tessera reads format 1)", doc["format"]));
    }
    let entries = doc["entries"].as_array().ok_or("no `entries` list")?;
    entries.iter().enumerate().map(|(i, e)| entry(e).map_err(|m| format!("entry {i}{}: {m}", e["op"].as_str().map(|op| format!(" (`{op}`)")).unwrap_or_default()))).collect()
}

/// One entry of a table.
fn entry(e: &serde_json::Value) -> Result<Tuned, String> {
    let text = |key: &str| e[key].as_str().map(str::to_string).ok_or_else(|| format!("`{key}` is {}, not a string", e[key]));
    let shapes = e["shapes"].as_object().ok_or_else(|| format!("`shapes` is {}, not an object of input name to dims", e["shapes"]))?;
    let shapes = shapes
        .iter()
        .map(|(name, dims)| {
            let dims = dims.as_array().and_then(|d| d.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect::<Option<Vec<_>>>());
            dims.map(|d| (name.clone(), d)).ok_or_else(|| format!("the shape of `{name}` is not a list of dims (non-negative integers)"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let best = if e["best"].is_null() { None } else { Some(text("best")?) };
    if let Some(best) = &best {
        let mut names = Vec::new();
        for part in best.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let name = part.split_once('=').map(|(n, _)| n.trim()).ok_or_else(|| format!("`best` part `{part}` is not `name=value`"))?;
            if names.contains(&name) {
                return Err(format!("`best` sets `{name}` twice"));
            }
            names.push(name);
        }
    }
    let (target, dtype) = (text("target")?, text("dtype")?);
    if tessera_dsl::Target::by_name(&target).is_none() {
        return Err(format!("`target` {target:?} is not a TPU generation (v5e, v5p, v6e, tpu7x)"));
    }
    if !matches!(tessera_dsl::DType::parse(&dtype), Some(d) if d.is_float()) {
        return Err(format!("`dtype` {dtype:?} is not a float dtype (bf16, f32)"));
    }
    Ok(Tuned { op: text("op")?, target, dtype, shapes, statics: text("statics")?, best, source: String::new() })
}

/// The best knobs (`name=value, ...`) the tables hold for a call of `op` with these input
/// types and statics on `target`, when a table holds exactly this call; `None` otherwise.
/// The statics compare whole: an entry tuned with a knob fixed (`--statics block_cols=256`)
/// serves calls that give that value and leave the tuned knobs unset. An error only when
/// `TESSERA_TUNING_TABLES` names a bad file.
pub fn tuned_statics(op: &Op, inputs: &[Option<Type>], statics: &Statics, target: &str) -> Result<Option<String>, KernelError> {
    Ok(tuned_entry(op, inputs, statics, target)?.and_then(|e| e.best))
}

/// The table entry that holds this call, the first match (its `source` names the table; its
/// `best` is `None` when it keeps the op's own rule).
pub fn tuned_entry(op: &Op, inputs: &[Option<Type>], statics: &Statics, target: &str) -> Result<Option<Tuned>, KernelError> {
    if op.knobs.is_empty() {
        return Ok(None);
    }
    // The run's float dtype (the CLI's `--dtype`): its first float input's.
    let Some(dtype) = op.inputs.iter().zip(inputs).find(|(i, _)| i.kind == crate::op::Kind::Float || i.kind == crate::op::Kind::AnyFloat).and_then(|(_, t)| t.as_ref()).map(|t| t.dtype.name()) else { return Ok(None) };
    let statics = statics.to_string();
    // An alias (`flash_attention`) plans as its source op: it takes the source's entries, and
    // an entry tuned through the alias serves both.
    let name = op.alias_of.map_or(op.name, |(of, _)| of);
    let aliases: Vec<&str> = crate::library().filter(|o| o.alias_of.is_some_and(|(of, _)| of == name)).map(|o| o.name).collect();
    let matches = |e: &&Tuned| {
        (e.op == name || e.op == op.name || aliases.contains(&e.op.as_str()))
            && e.target == target
            && e.dtype == dtype
            && e.statics == statics
            && e.shapes.len() == op.inputs.iter().zip(inputs).filter(|(_, t)| t.is_some()).count()
            && e.shapes.iter().all(|(name, shape)| op.inputs.iter().position(|i| i.name == name).and_then(|i| inputs.get(i)?.as_ref()).is_some_and(|t| &t.shape == shape))
    };
    let added = ADDED.read().unwrap_or_else(|e| e.into_inner());
    let entry = match added.iter().find(matches) {
        Some(e) => Some(e.clone()),
        None => env_tables()?.iter().chain(table()).find(matches).cloned(),
    };
    let Some(e) = entry else { return Ok(None) };
    // A table sets blocks, nothing else: a `best` that names another static (`causal=False`,
    // hand-edited) would change what the op computes.
    let knobs: Vec<&str> = op.knobs.iter().map(|k| k.name).collect();
    for part in e.best.iter().flat_map(|b| b.split(',')).map(str::trim).filter(|p| !p.is_empty()) {
        let key = part.split('=').next().unwrap_or("").trim();
        if !knobs.contains(&key) {
            return Err(KernelError::new(
                op.name,
                format!("tuning table {}", e.source),
                "tuning-table",
                format!("the entry for this call sets `{part}`, which is not one of `{name}`'s tuned blocks ({})", knobs.join(", ")),
                "a table's `best` may set only the op's knobs: re-run `tessera tune --save` for this call, or remove the entry",
            ));
        }
    }
    Ok(Some(e))
}

#[cfg(test)]
mod tests {
    use tessera_dsl::{DType, Kernel, Type};

    use super::pads_only;
    use crate::elementwise::gelu_affine_kernel;

    fn gelu(rows: usize, cols: usize, bm: usize, bn: usize) -> Vec<Kernel> {
        let x = Type::vector(DType::F32, &[rows, cols]);
        let row = Type::vector(DType::F32, &[1, cols]);
        vec![gelu_affine_kernel(x.clone(), row.clone(), row, x, bm, bn).unwrap()]
    }

    #[test]
    fn a_block_past_the_array_at_the_same_grid_only_pads() {
        // 2048 columns over 1024 pad what 1024 covers; 32 rows over 16 pad what 16 cover.
        assert!(pads_only(&gelu(16, 1024, 16, 2048), &gelu(16, 1024, 16, 1024)));
        assert!(pads_only(&gelu(16, 1024, 32, 2048), &gelu(16, 1024, 16, 1024)));
        assert!(!pads_only(&gelu(16, 1024, 16, 1024), &gelu(16, 1024, 16, 2048)), "the smaller block is never the padded one");
        assert!(!pads_only(&gelu(16, 1024, 16, 1024), &gelu(16, 1024, 16, 1024)), "a twin is not padding");
        // A larger block that changes the grid is a real choice: 1024 rows over 1000 is one
        // step, 512 two; 1024 columns over 1024 beside 512 is fewer steps too.
        assert!(!pads_only(&gelu(1000, 256, 1024, 256), &gelu(1000, 256, 512, 256)));
        assert!(!pads_only(&gelu(16, 1024, 16, 1024), &gelu(16, 1024, 16, 512)));
        // Blocks that differ where neither spans the array are other tilings.
        assert!(!pads_only(&gelu(64, 1024, 32, 1024), &gelu(64, 1024, 16, 1024)));
        // Other shapes are other problems.
        assert!(!pads_only(&gelu(16, 2048, 16, 2048), &gelu(16, 1024, 16, 1024)));
    }
}
