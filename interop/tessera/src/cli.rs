//! The `tessera` command line (`list / run / emit / check / cost / tune / table`) over an op table: the
//! library's, and a user crate's beside it. The `tessera` binary is `main(&[])`; a user
//! crate's binary is `fn main() -> ExitCode { tessera::cli::main(my_crate::OPS) }`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tessera_codegen::cpu::{self, Backend};
use tessera_dsl::{DType, Kernel, Target};
use tessera_kernels::{harness, library, Case, Op, Statics};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera: TPU kernels in Rust. Emit Mosaic, run on the CPU, check with the real TPU compiler.")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every op (this binary's, then the library's) with its schema, cases and backward.
    List,
    /// Write `<kernel>.stablehlo.mlir` and `<kernel>.mosaic.mlir` for a target.
    Emit {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value = "v5e")]
        target: String,
        #[arg(long, default_value = "out")]
        out: PathBuf,
    },
    /// Run ops on a CPU backend with random inputs against their independent references.
    Run {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Target whose default block sizes to use.
        #[arg(long, default_value = "v5e")]
        target: String,
        /// CPU backend: `interp` (the reference interpreter), `jit` (Cranelift) or `llvm`.
        #[arg(long, default_value = "jit")]
        backend: String,
    },
    /// A markdown table of every library kernel's VMEM use, grid and flops per
    /// generation at default shapes and blocks (what the kernels' README shows), or with
    /// `--ops` the op table (name, schema, backward; what the torch package's README shows).
    Table {
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long)]
        ops: bool,
    },
    /// Compile every emitted kernel with the real TPU compiler (compile-only; needs the
    /// project venv with jax, jaxlib and libtpu: `scripts/setup-venv.sh`).
    Check {
        #[command(flatten)]
        select: Select,
        /// Targets to compile for (repeatable).
        #[arg(long = "target", default_values = ["v5e", "v6e", "tpu7x"])]
        targets: Vec<String>,
    },
    /// libtpu's static cost of each kernel (compile-only, as `check`): estimated cycles,
    /// bundles, spills and VMEM, beside a roofline time from the IR's flops and HBM bytes.
    Cost {
        #[command(flatten)]
        select: Select,
        /// Targets to estimate for (repeatable).
        #[arg(long = "target", default_values = ["v5e", "v6e", "tpu7x"])]
        targets: Vec<String>,
    },
    /// Tune an op's block statics for a target: every combination of its knobs
    /// (`tessera_kernels::tune`), pruned by the plan builder and the verifier (tiling, VMEM),
    /// ranked by libtpu's static cost (the `cost` figures). `--save` writes the run as JSON
    /// (op, case, dtype, shapes, statics, libtpu version, every candidate's figures) so it
    /// can be reproduced and compared. Tunes one named op at a time.
    Tune {
        /// Op name (see `list`): this binary's or the library's.
        kernel: Option<String>,
        /// Not an option of `tune` (hidden): taken only to refuse it with the reason.
        #[arg(long, hide = true)]
        all: bool,
        #[command(flatten)]
        opts: CaseOpts,
        /// The TPU generation to tune for (v5e, v5p, v6e, tpu7x); the table's entries are
        /// per generation.
        #[arg(long, default_value = "v6e")]
        target: String,
        /// Write (or update) this JSON table with the run.
        #[arg(long)]
        save: Option<PathBuf>,
        /// Candidates compiled per libtpu process (progress is reported per batch).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
    },
}

#[derive(Args)]
struct Select {
    /// Op name (see `list`): this binary's or the library's.
    kernel: Option<String>,
    /// Every op (each of its cases, except the `alt` shape sets; with `--case`, that case
    /// of each op that has it).
    #[arg(long, conflicts_with = "kernel")]
    all: bool,
    #[command(flatten)]
    opts: CaseOpts,
}

/// The case, statics, shapes and dtype of a selection (`tune` takes them for its one op).
#[derive(Args)]
struct CaseOpts {
    /// One case of the op (see `list`); default: every case of a named op but the `alt`
    /// shape sets.
    #[arg(long)]
    case: Option<String>,
    /// Override static arguments, e.g. `--statics "causal=True, soft_cap=30.0"`.
    #[arg(long)]
    statics: Option<String>,
    /// Override an input's shape, e.g. `--shape x=512x256` (repeatable).
    #[arg(long = "shape", value_name = "NAME=DxD")]
    shapes: Vec<String>,
    /// Element type of the inputs.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

type CliResult<T> = Result<T, String>;

/// The ops a command sees: the caller's, then the library's.
struct Table {
    ops: Vec<&'static Op>,
    /// How many of `ops` are the caller's (they come first).
    own: usize,
}

impl Table {
    fn new(own: &'static [Op]) -> CliResult<Table> {
        for op in own {
            if let Some(dup) = tessera_kernels::find(op.name) {
                return Err(format!("op `{}` of this binary has the name of a library op ({}{}); rename it", op.name, dup.name, dup.schema));
            }
            if own.iter().filter(|o| o.name == op.name).count() > 1 {
                return Err(format!("this binary's table has two ops named `{}`; rename one", op.name));
            }
        }
        Ok(Table { ops: own.iter().chain(library()).collect(), own: own.len() })
    }

    fn find(&self, name: &str) -> Option<&'static Op> {
        self.ops.iter().copied().find(|op| op.name == name)
    }
}

/// Runs the command line (`std::env::args`) over `own` (a user crate's ops; `&[]` for
/// the library alone) beside the library's ops. Exit codes: 0 all good; 1 a kernel failed
/// (numerics off, or libtpu rejected it); 2 bad usage or a kernel the verifier rejected.
pub fn main(own: &'static [Op]) -> ExitCode {
    // Rust ignores SIGPIPE, so a reader that closes early (`tessera emit --all | head`) made
    // every `println!` after it panic; a command-line tool is killed by it quietly instead.
    #[cfg(unix)]
    // SAFETY: `signal` with SIG_DFL installs no handler code; it runs before the CLI starts
    // any thread, and only changes what a write to a closed pipe does to this process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = Table::new(own).and_then(|t| match cli.command {
        Cmd::List => list(&t),
        Cmd::Emit { select, target, out } => emit(&t, &select, &target, &out),
        Cmd::Run { select, seed, target, backend } => run(&t, &select, seed, &target, &backend),
        Cmd::Check { select, targets } => check(&t, &select, &targets),
        Cmd::Cost { select, targets } => cost(&t, &select, &targets),
        Cmd::Tune { kernel, all, opts, target, save, batch } => match kernel {
            Some(kernel) if !all => tune(&t, &Select { kernel: Some(kernel), all: false, opts }, &target, save.as_deref(), batch as usize),
            _ => Err("tune one op at a time: name it (`tune flash_attention_fwd --case causal`)".into()),
        },
        Cmd::Table { dtype, ops } => if ops { op_table(&t) } else { table(&t, &dtype) },
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}

fn list(t: &Table) -> CliResult<bool> {
    for (i, op) in t.ops.iter().enumerate() {
        if i == 0 && t.own > 0 {
            println!("== the ops of this binary ==\n");
        }
        if i == t.own && t.own > 0 {
            println!("== the library's ops ==\n");
        }
        println!("{}{}\n    {}", op.name, op.schema, op.doc);
        if let Some((of, i)) = op.alias_of {
            println!("    alias: result {i} of {of}{}", if op.alias_plan.is_some() { " (with a plan of its own: only this result is computed)" } else { "" });
        }
        if let Some(b) = op.backward {
            println!("    backward: {}", b.op);
        }
        for c in op.cases {
            let shapes: Vec<String> = op.inputs.iter().zip(c.shapes).map(|(i, s)| format!("{}={}", i.name, dims(s))).collect();
            let statics = if c.statics.is_empty() { String::new() } else { format!(" [{}]", c.statics) };
            println!("    case {:<16} {}{statics}", c.name, shapes.join(" "));
        }
        println!();
    }
    Ok(true)
}

fn dims(shape: &[usize]) -> String {
    shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

fn target(name: &str) -> CliResult<Target> {
    Target::by_name(name).ok_or_else(|| format!("unknown target `{name}`; choose one of: {}", Target::ALL.map(|t| t.name).join(", ")))
}

/// One op case to run or lower: the op, the case, its statics and input shapes (the
/// case's, overridden by `--shape` / `--statics`).
struct Selected {
    op: &'static Op,
    case: &'static Case,
    statics: Statics,
    shapes: Vec<Vec<usize>>,
}

/// `--target` values, each generation once (a repeated one would compile everything twice).
fn targets_once(names: &[String]) -> CliResult<Vec<Target>> {
    let mut out: Vec<Target> = Vec::new();
    for name in names {
        let t = target(name)?;
        if !out.iter().any(|o| o.name == t.name) {
            out.push(t);
        }
    }
    Ok(out)
}

/// A case whose name ends in `alt` repeats another at other shapes (the libtpu tier
/// compiles them too); `--all` and a bare op name skip them.
fn is_alt(c: &Case) -> bool {
    c.name.ends_with("alt")
}

/// The op whose cases `op` runs: the op it is an alias of, or itself.
fn source(t: &Table, op: &'static Op) -> &'static Op {
    op.alias_of.and_then(|(of, _)| t.find(of)).unwrap_or(op)
}

/// The op cases `sel` names, its arguments checked (each `--shape` and `--statics` used as
/// given or refused) before any command prints. With `--all --case NAME` the ops without
/// that case are skipped (said on stderr); none having it is an error.
fn selection(t: &Table, sel: &Select) -> CliResult<Vec<Selected>> {
    let s = &sel.opts;
    let mut ops: Vec<&'static Op> = match (&sel.kernel, sel.all) {
        (Some(name), _) => vec![t.find(name).ok_or_else(|| {
            let near: Vec<&str> = t.ops.iter().map(|op| op.name).filter(|op| strsim::damerau_levenshtein(op, name) <= 2.max(name.len() / 5) || (name.len() >= 4 && op.contains(name))).take(5).collect();
            let hint = if near.is_empty() { String::new() } else { format!("did you mean {}? ", near.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")) };
            format!("unknown op `{name}`; {hint}`list` shows the ops")
        })?],
        (None, true) => t.ops.iter().copied().filter(|op| op.alias_of.is_none()).collect(),
        (None, false) => return Err("name an op or pass --all".into()),
    };
    if let (true, Some(case)) = (sel.all, &s.case) {
        let every = ops.len();
        ops.retain(|op| source(t, op).case(case).is_some());
        if ops.is_empty() {
            return Err(format!("--case `{case}`: no op has a case `{case}` (`list` shows each op's cases)"));
        }
        if ops.len() < every {
            eprintln!("--case `{case}`: skipped {} of {every} ops, which have no case `{case}`", every - ops.len());
        }
    }
    // Each static once: a repeat would silently take the last value.
    if let Some(extra) = &s.statics {
        let given = Statics::assignments(extra);
        for (i, (name, value)) in given.iter().enumerate() {
            if let Some((_, first)) = given[..i].iter().find(|(n, _)| n == name) {
                return Err(format!("--statics `{extra}`: `{name}` is given twice (`{name}={first}`, then `{name}={value}`); give each static argument once"));
            }
        }
    }
    // Every --shape is used as given or refused: parsed once, one per input name, and
    // (with --all) naming an input of some op.
    let mut specs: Vec<(&str, &str, Vec<usize>)> = Vec::new();
    for spec in &s.shapes {
        let (name, d) = spec.split_once('=').ok_or_else(|| format!("--shape `{spec}`: expected NAME=DxD, e.g. x=512x256"))?;
        let parsed: Result<Vec<usize>, _> = d.split('x').map(str::parse).collect();
        let parsed = parsed.map_err(|_| format!("--shape `{spec}`: dims must be non-negative integers separated by `x`"))?;
        if let Some((_, first, _)) = specs.iter().find(|(n, _, _)| *n == name) {
            return Err(format!("--shape `{spec}`: `{name}` already has a shape (`{first}`); give each input one --shape"));
        }
        if sel.all && !ops.iter().any(|op| op.inputs.iter().any(|i| i.name == name)) {
            return Err(format!("--shape `{spec}`: no selected op has an input `{name}`"));
        }
        specs.push((name, spec.as_str(), parsed));
    }
    let mut out = Vec::new();
    for op in ops {
        let source = source(t, op);
        let cases: Vec<&'static Case> = match &s.case {
            Some(name) => vec![source.case(name).ok_or_else(|| format!("`{}` has no case `{name}` (cases: {})", op.name, source.cases.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")))?],
            None => source.cases.iter().filter(|c| !is_alt(c)).collect(),
        };
        for case in cases {
            let mut assignments = case.statics.to_string();
            if let Some(extra) = &s.statics {
                assignments = format!("{assignments}, {extra}");
            }
            let statics = op.statics(&assignments).map_err(|e| e.to_string())?;
            let mut shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
            for (name, spec, parsed) in &specs {
                match op.inputs.iter().position(|i| i.name == *name) {
                    Some(i) if i < shapes.len() => shapes[i] = parsed.clone(),
                    Some(_) => return Err(format!("--shape `{spec}`: case `{}` of `{}` does not pass `{name}`", case.name, op.name)),
                    None if sel.all => {} // another op's input
                    None => return Err(format!("--shape `{spec}`: `{}` has no input `{name}` (inputs: {})", op.name, op.inputs.iter().map(|i| i.name).collect::<Vec<_>>().join(", "))),
                }
            }
            out.push(Selected { op, case, statics, shapes });
        }
    }
    Ok(out)
}

fn dtype(s: &Select) -> CliResult<DType> {
    let s = &s.opts;
    match DType::parse(&s.dtype) {
        Some(d @ (DType::F32 | DType::BF16 | DType::F8E4M3FN | DType::F8E5M2)) => Ok(d),
        _ => Err(format!("--dtype `{}`: the library kernels take f32 or bf16 (float8_e4m3fn or float8_e5m2 for the ops whose operands may be fp8, such as scaled_mm_blockwise)", s.dtype)),
    }
}

/// The name a case's kernels are written and reported under: the op, `_<case>` unless it
/// is the `default` case, and `-<kernel>` for ops of several kernels.
fn stem(sel: &Selected) -> String {
    if sel.case.name == "default" { sel.op.name.to_string() } else { format!("{}_{}", sel.op.name, sel.case.name) }
}

/// The kernels of a case's plan for float inputs of `dtype`, each with its file stem.
fn build(sel: &Selected, dtype: DType, target: &Target) -> CliResult<Vec<(String, Kernel)>> {
    let plan = sel.op.plan_for(&sel.op.types(&sel.shapes, dtype), &sel.statics, target).map_err(|e| e.to_string())?;
    let single = plan.launches.len() == 1;
    let base = stem(sel);
    // Launches of one kernel (matmul_bwd's two matmuls) get `-2`, `-3`... after the first,
    // so each writes and reports under its own name.
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    Ok(plan
        .launches
        .into_iter()
        .map(|l| {
            if single {
                return (base.clone(), l.kernel);
            }
            let n = seen.entry(l.kernel.name.clone()).or_insert(0);
            *n += 1;
            let name = if *n == 1 { format!("{base}-{}", l.kernel.name) } else { format!("{base}-{}-{n}", l.kernel.name) };
            (name, l.kernel)
        })
        .collect())
}

/// The kernels of every selected case. With `--shape` and no `--case` the shapes go to each
/// case of the op: a case that cannot take them, or that then gives the same kernels as an
/// earlier case, is skipped, saying so (an error only when no case is left).
fn build_selected(selected: &[Selected], s: &Select, dtype: DType, target: &Target) -> CliResult<Vec<(String, Kernel)>> {
    let lenient = s.opts.case.is_none() && !s.opts.shapes.is_empty();
    let mut out: Vec<(String, Kernel)> = Vec::new();
    let mut seen: Vec<(String, String)> = Vec::new(); // (kernels' text, stem)
    let mut skipped = Vec::new();
    for sel in selected {
        let kernels = match build_and_warn(sel, dtype, target) {
            Ok(k) => k,
            Err(e) if lenient => {
                eprintln!("{}: skipped, the case cannot take these inputs: {}", stem(sel), e.lines().next().unwrap_or(""));
                skipped.push((stem(sel), e));
                continue;
            }
            Err(e) => return Err(e),
        };
        if lenient {
            let text: String = kernels.iter().map(|(_, k)| format!("{k}")).collect();
            if let Some((_, first)) = seen.iter().find(|(t, _)| *t == text) {
                eprintln!("{}: skipped, the same kernels as `{first}` with these inputs", stem(sel));
                continue;
            }
            seen.push((text, stem(sel)));
        }
        out.extend(kernels);
    }
    if out.is_empty() && !skipped.is_empty() {
        // One case: its own error (with its help) says what to change.
        if let [(_, only)] = &skipped[..] {
            return Err(only.clone());
        }
        let names: Vec<&str> = skipped.iter().map(|(n, _)| n.as_str()).collect();
        return Err(format!("no case could take these inputs ({}); the first says:\n{}", names.join(", "), skipped[0].1));
    }
    Ok(out)
}

/// [`build`], printing each kernel's performance warnings (`verify::warnings`) once, on
/// stderr, for the commands that compile or run it.
fn build_and_warn(sel: &Selected, dtype: DType, target: &Target) -> CliResult<Vec<(String, Kernel)>> {
    let kernels = build(sel, dtype, target)?;
    for (_, kernel) in &kernels {
        for w in tessera_dsl::verify::warnings(kernel, target) {
            eprintln!("{w} (on {target})");
        }
    }
    Ok(kernels)
}

/// Names, on stderr, the blocks a tuning table gives a selected call (not the op's rule):
/// what `emit` writes and `cost` measures depends on them.
fn say_tuned(selected: &[Selected], dtype: DType, target: &Target) {
    for sel in selected {
        if let Ok(Some(e)) = tessera_kernels::tune::tuned_entry(sel.op, &sel.op.types(&sel.shapes, dtype), &sel.statics, target.name) {
            let blocks = e.best.map_or("the op's own block rule".to_string(), |b| format!("blocks `{b}`"));
            eprintln!("{} on {}: {blocks} from the tuning table {}", stem(sel), target.name, e.source);
        }
    }
}

fn emit(t: &Table, s: &Select, target_name: &str, out: &Path) -> CliResult<bool> {
    let target = target(target_name)?;
    let dtype = dtype(s)?;
    // An alias op (`flash_attention`) emits the kernels of the op it is an alias of (its
    // plan is that op's), under its own name.
    let selected = selection(t, s)?;
    say_tuned(&selected, dtype, &target);
    let kernels = build_selected(&selected, s, dtype, &target)?;
    if kernels.is_empty() {
        return Err("the selection has no kernels to emit".into());
    }
    let emitted = crate::emit(kernels, &target, out).map_err(|e| e.to_string())?;
    println!("{:<44} {:<16} {:>10} {:>10} {:>10} {:>14} {:>8}", "kernel", "grid", "vmem MiB", "need MiB", "limit MiB", "GFLOP", "ms");
    for e in emitted {
        let grid: Vec<String> = e.kernel.grid.iter().map(|g| g.extent.to_string()).collect();
        let l = &e.lowered;
        println!(
            "{:<44} {:<16} {:>10.2} {:>10.2} {:>10.2} {:>14.3} {:>8.2}",
            e.stem,
            grid.join("x"),
            l.vmem_bytes as f64 / (1 << 20) as f64,
            l.vmem_need as f64 / (1 << 20) as f64,
            l.vmem_limit_bytes as f64 / (1 << 20) as f64,
            l.cost.flops as f64 / 1e9,
            e.lower_ms
        );
    }
    println!("wrote {}", out.display());
    Ok(true)
}

fn run(t: &Table, s: &Select, seed: u64, target_name: &str, backend_name: &str) -> CliResult<bool> {
    let target = target(target_name)?;
    let dtype = dtype(s)?;
    let backend = Backend::parse(backend_name).ok_or_else(|| format!("--backend `{backend_name}`: choose interp, jit or llvm"))?;
    let exec = crate::executor(backend).map_err(|e| format!("--backend {backend}: {e}"))?;
    // Every case selected and planned (its shapes and statics checked) before the first
    // line of the table, so a bad argument prints nothing but its error.
    let selected = selection(t, s)?;
    for sel in &selected {
        build_and_warn(sel, dtype, &target)?;
    }
    let mut all_ok = true;
    println!("backend: {backend}");
    println!("{:<40} {:<40} {:<5} {:>12} {:>10} {:>10} {:>10} {:>10}  result", "op", "shapes", "dtype", "grid", "max err", "tolerance", "ms", "compile ms");
    for sel in selected {
        let before = cpu::cache_stats();
        let r = harness::run_case(sel.op, &sel.statics, &sel.shapes, dtype, &target, seed, exec).map_err(|e| e.to_string())?;
        let after = cpu::cache_stats();
        let compile_ms = after.compile_time.saturating_sub(before.compile_time).as_secs_f64() * 1e3;
        let fell_back = after.fallbacks > before.fallbacks;
        let shape_txt: Vec<String> = sel.shapes.iter().map(|s| dims(s)).collect();
        let worst = r.worst();
        let mut verdict = verdict(&r);
        if fell_back {
            verdict.push_str(" (some kernels ran on the interpreter: the compiler refused them)");
        }
        all_ok &= r.passed();
        println!(
            "{:<40} {:<40} {:<5} {:>12} {:>10.2e} {:>10.1e} {:>10.2} {:>10.2}  {verdict}",
            stem(&sel),
            shape_txt.join(","),
            dtype.name(),
            dims(&r.grid),
            worst.scaled_err,
            worst.tolerance,
            r.run_time.as_secs_f64() * 1e3,
            compile_ms
        );
    }
    if backend != Backend::Interp {
        let st = cpu::cache_stats();
        println!("{backend}: {} kernels compiled in {:.1} ms, {} cache hits, {} fallbacks to the interpreter", st.misses, st.compile_time.as_secs_f64() * 1e3, st.hits, st.fallbacks);
    }
    Ok(all_ok)
}

fn table(t: &Table, dtype_name: &str) -> CliResult<bool> {
    let select = Select { kernel: None, all: true, opts: CaseOpts { case: None, statics: None, shapes: vec![], dtype: dtype_name.to_string() } };
    let dtype = dtype(&select)?;
    println!("| kernel | default inputs ({dtype_name}) | {} |", Target::ALL.map(|t| format!("{t}: grid, VMEM MiB, GFLOP")).join(" | "));
    println!("|---|---|{}", "---|".repeat(Target::ALL.len()));
    for sel in selection(t, &select)? {
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        for target in Target::ALL {
            for (i, (stem, kernel)) in build(&sel, dtype, &target)?.into_iter().enumerate() {
                let lowered = tessera_codegen::lower(&kernel, &target).map_err(|e| e.to_string())?;
                let grid: Vec<String> = kernel.grid.iter().map(|g| g.extent.to_string()).collect();
                let cell = format!("{}, {:.2}, {:.3}", grid.join("x"), lowered.vmem_bytes as f64 / (1 << 20) as f64, lowered.cost.flops as f64 / 1e9);
                match rows.get_mut(i) {
                    Some(row) => row.1.push(cell),
                    None => rows.push((stem, vec![cell])),
                }
            }
        }
        let inputs: Vec<String> = sel.op.inputs.iter().zip(&sel.shapes).map(|(i, s)| format!("{}={}", i.name, dims(s))).collect();
        for (stem, cells) in rows {
            println!("| `{stem}` | {} | {} |", inputs.join(" "), cells.join(" | "));
        }
    }
    Ok(true)
}

/// The op table as markdown: what `torch.ops.tpu.*` and the CLI serve.
fn op_table(t: &Table) -> CliResult<bool> {
    print!("{}", tessera_kernels::op_table_markdown_of(t.ops.iter().copied()));
    Ok(true)
}

fn check(t: &Table, s: &Select, targets: &[String]) -> CliResult<bool> {
    let dtype = dtype(s)?;
    let targets = targets_once(targets)?;
    let selected = selection(t, s)?;
    let mut all_ok = true;
    for target in targets {
        let kernels = build_selected(&selected, s, dtype, &target)?;
        for v in crate::tpu_compile(&kernels, &target).map_err(|e| e.to_string())? {
            all_ok &= v.ok;
            if v.ok {
                println!("{:<8} {:<20} {:<5} accept  ({:.2} s)", target.name, v.stem, dtype.name(), v.seconds);
            } else if v.timed_out {
                println!("{:<8} {:<20} {:<5} TIMEOUT {} (no verdict; TESSERA_TPU_TIMEOUT=SECONDS gives libtpu longer)", target.name, v.stem, dtype.name(), v.error);
            } else {
                println!("{:<8} {:<20} {:<5} REJECT  {}", target.name, v.stem, dtype.name(), v.error);
            }
        }
    }
    Ok(all_ok)
}

fn cost(t: &Table, s: &Select, targets: &[String]) -> CliResult<bool> {
    let dtype = dtype(s)?;
    let targets = targets_once(targets)?;
    let selected = selection(t, s)?;
    let mut per_target = Vec::new();
    for target in &targets {
        say_tuned(&selected, dtype, target);
        per_target.push(build_selected(&selected, s, dtype, target)?);
    }
    println!("libtpu's static estimate (compile-only, one device: a TensorCore, or both of a v5p chip's as one megacore device) beside the IR's flops and HBM bytes; time = max(estimate, HBM); roofline % = max(MXU, HBM) / time (the IR counts every `if` as taken: read it for kernels that run every step)");
    println!("{:<8} {:<44} {:<5} {:>10} {:>8} {:>8} {:>7} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}  bound", "target", "kernel", "dtype", "cycles", "+outside", "bundles", "vspill", "sspill", "VMEM MiB", "est us", "MXU us", "HBM us", "time us", "roofline %");
    let mut all_ok = true;
    for (target, kernels) in targets.iter().zip(&per_target) {
        eprintln!("compiling {} kernels for {} (libtpu, with the static profile)...", kernels.len(), target.name);
        for ((_, kernel), v) in kernels.iter().zip(crate::tpu_profile(kernels, target).map_err(|e| e.to_string())?) {
            let head = format!("{:<8} {:<44} {:<5}", target.name, v.stem, dtype.name());
            // A row with no estimate: the IR's model, and why.
            let model_row = |why: &str| {
                let r = tessera_codegen::roofline(kernel, &Default::default(), target);
                println!("{head} {:>10} {:>8} {:>8} {:>7} {:>6} {:>8} {:>10} {:>10.1} {:>10.1} {:>10.1} {:>10}  no estimate (the IR's model): {why}", "-", "-", "-", "-", "-", "-", "-", r.mxu_us, r.hbm_us, r.time_us, "-");
            };
            if v.timed_out {
                // No answer in time (a loaded machine): not a rejection.
                model_row(&format!("libtpu {}; TESSERA_TPU_TIMEOUT=SECONDS gives it longer", v.error));
                continue;
            }
            if !v.ok {
                all_ok = false;
                println!("{head} REJECT  {}", v.error.lines().next().unwrap_or(""));
                continue;
            }
            let Some(p) = v.profile else {
                // Accepted, but the profiler gave nothing: say so.
                model_row(&v.profile_note.lines().next().unwrap_or("").chars().take(160).collect::<String>());
                continue;
            };
            let r = tessera_codegen::roofline(kernel, &p, target);
            let bound = match (r.blind, v.profile_note.lines().next()) {
                // The profiler aborted: bundles, spills and VMEM from the LLO, and why no estimate.
                (true, Some(why)) if !p.estimated && !why.is_empty() => format!("{} (time from the IR's model: {})", r.bound, why.chars().take(160).collect::<String>()),
                (true, _) => format!("{} (libtpu's estimate cannot see prefetch-driven or dynamic-grid trip counts; time from the IR's model)", r.bound),
                (false, _) => r.bound.to_string(),
            };
            // No VMEM figure in the profile (libtpu did not attribute one): `-`, not 0.
            let mib = if p.vmem_bytes == 0 { "-".to_string() } else { format!("{:.2}", p.vmem_bytes as f64 / (1 << 20) as f64) };
            let efficiency = if r.blind { "-".to_string() } else { format!("{:.1}", 100.0 * r.efficiency()) };
            // Profiled without the estimate (a dynamic grid: `tpu::compile`): `-`, not 0.
            let (cycles, outside, est) = if p.estimated { (p.cycles.to_string(), p.outside_cycles.to_string(), format!("{:.1}", r.estimate_us)) } else { ("-".into(), "-".into(), "-".into()) };
            println!("{head} {cycles:>10} {outside:>8} {:>8} {:>7} {:>6} {mib:>8} {est:>10} {:>10.1} {:>10.1} {:>10.1} {efficiency:>10}  {bound}", p.bundles, p.vector_spills, p.scalar_spills, r.mxu_us, r.hbm_us, r.time_us);
        }
    }
    println!("clock (GHz) = bf16 peak / cores / (MXUs x mxu^2 x 2): {}", Target::ALL.map(|t| format!("{} {:.2}", t.name, t.clock_ghz())).join(", "));
    Ok(all_ok)
}

/// One tuning candidate: its statics, and why it was pruned or what it costs.
struct Candidate {
    statics: String,
    outcome: Result<Figures, String>,
}

/// A candidate's libtpu figures, summed over its plan's launches.
#[derive(Default)]
struct Figures {
    /// libtpu's estimate summed over the launches; `None` if a launch has none (a dynamic
    /// grid, or the profiler gave nothing).
    cycles: Option<u64>,
    bundles: u64,
    spills: u64,
    vmem_bytes: u64,
    time_us: f64,
    /// Some launch's estimate cannot see its trip counts: its time is the IR's model.
    blind: bool,
}

fn tune(t: &Table, s: &Select, target_name: &str, save: Option<&Path>, batch: usize) -> CliResult<bool> {
    let target = target(target_name)?;
    let dtype = dtype(s)?;
    if let Some(path) = save {
        // A table that cannot be added to, or written, fails now, not after the compiles.
        read_tuning(path)?;
        writable(path)?;
    }
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    for sel in selection(t, s)? {
        let knobs = sel.op.knobs;
        let fixed: Vec<&str> = knobs.iter().filter(|k| !matches!(sel.statics.get(k.name), tessera_kernels::Static::None)).map(|k| k.name).collect();
        let all = tessera_kernels::tune::candidates(sel.op, &fixed);
        if all.is_empty() {
            let why = if knobs.is_empty() { "it has no block statics (its blocks follow from the shapes)".to_string() } else { format!("every knob ({}) is fixed by the case or --statics", fixed.join(", ")) };
            return Err(format!("`{}`: nothing to tune: {why}", sel.op.name));
        }
        // The op's own block rule is the baseline: a table entry only ever replaces it with
        // something libtpu estimates faster. A case that cannot take the shapes at all is
        // skipped (every candidate would fail the same way).
        let types = sel.op.types(&sel.shapes, dtype);
        if let Err(e) = sel.op.plan_by_rule(&types, &sel.statics, &target) {
            if !matches!(e.rule, "vmem-budget" | "block-tiling" | "block-shape") {
                eprintln!("{}: skipped, the case cannot take these inputs: {}: {}", stem(&sel), e.rule, e.message.lines().next().unwrap_or(""));
                skipped.push(stem(&sel));
                continue;
            }
        }
        // Prune by the plan builder and the verifier (tiling, VMEM with its margin).
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut survivors: Vec<(usize, Vec<Kernel>)> = Vec::new();
        // (The rule last: it loses ties, so a table entry is written for them.)
        for c in all.into_iter().chain(std::iter::once(String::new())) {
            let built = sel.op.statics(&format!("{}, {c}", sel.statics)).and_then(|st| sel.op.plan_by_rule(&types, &st, &target)).and_then(|plan| {
                let kernels: Vec<Kernel> = plan.launches.into_iter().map(|l| l.kernel).collect();
                kernels.iter().try_for_each(|k| tessera_dsl::verify::verify(k, &target)).map(|_| kernels)
            });
            let outcome = match built {
                Ok(kernels) => {
                    survivors.push((candidates.len(), kernels));
                    Err("not compiled".to_string())
                }
                Err(e) => Err(format!("pruned: {} ({})", e.rule, e.message.lines().next().unwrap_or(""))),
            };
            candidates.push(Candidate { statics: if c.is_empty() { DEFAULT_RULE.to_string() } else { c }, outcome });
        }
        let verified = survivors.len();
        // A candidate whose blocks only pad what a smaller one covers (same grid) is pruned
        // too; the op's own rule (last) is the baseline and always compiles.
        let rule = candidates.len() - 1;
        let pads: Vec<bool> = survivors.iter().map(|(i, ks)| *i != rule && survivors.iter().any(|(j, other)| j != i && tessera_kernels::tune::pads_only(ks, other))).collect();
        // Each pruned one names a twin that is kept (padding is transitive, so one exists).
        let padded: Vec<(usize, usize)> = survivors.iter().zip(&pads).filter(|(_, &p)| p).filter_map(|((i, ks), _)| survivors.iter().zip(&pads).find(|((j, other), &p)| !p && j != i && tessera_kernels::tune::pads_only(ks, other)).map(|((j, _), _)| (*i, *j))).collect();
        for &(i, j) in &padded {
            candidates[i].outcome = Err(format!("pruned: block-padding (its blocks only pad what {}'s cover, at the same grid)", candidates[j].statics));
        }
        survivors.retain(|(i, _)| !padded.iter().any(|(p, _)| p == i));
        eprintln!("{} on {target}: {} candidates, {} pruned by the plan and the verifier, {} pruned as padding, {} to compile with libtpu", stem(&sel), candidates.len(), candidates.len() - verified, verified - survivors.len(), survivors.len());
        // Compile the survivors in batches (one libtpu process each), with progress.
        let started = std::time::Instant::now();
        let mut done = 0;
        for chunk in survivors.chunks(batch) {
            let mut kernels = Vec::new();
            for (i, ks) in chunk {
                kernels.extend(ks.iter().enumerate().map(|(j, k)| (format!("c{i}-{j}"), k.clone())));
            }
            let verdicts = crate::tpu_profile(&kernels, &target).map_err(|e| e.to_string())?;
            for (i, ks) in chunk {
                let mut f = Figures { cycles: Some(0), ..Figures::default() };
                let mut rejected = None;
                for (j, k) in ks.iter().enumerate() {
                    let Some(v) = verdicts.iter().find(|v| v.stem == format!("c{i}-{j}")) else { continue };
                    if !v.ok {
                        let first = v.error.lines().next().unwrap_or("");
                        rejected = Some(if v.timed_out { format!("libtpu gave no answer ({first}; TESSERA_TPU_TIMEOUT=SECONDS gives it longer)") } else { format!("libtpu rejects it: {first}") });
                        break;
                    }
                    let p = v.profile.clone().unwrap_or_default();
                    let r = tessera_codegen::roofline(k, &p, &target);
                    // No profile, or one without libtpu's estimate: `r` is the IR's model.
                    f.blind |= r.blind;
                    f.cycles = f.cycles.filter(|_| p.estimated).map(|c| c + p.cycles + p.outside_cycles);
                    f.bundles += p.bundles;
                    f.spills += p.vector_spills + p.scalar_spills;
                    f.vmem_bytes = f.vmem_bytes.max(p.vmem_bytes);
                    f.time_us += r.time_us;
                }
                candidates[*i].outcome = match rejected {
                    Some(why) => Err(why),
                    None => Ok(f),
                };
            }
            done += chunk.len();
            let elapsed = started.elapsed().as_secs_f64();
            let eta = elapsed / done as f64 * (survivors.len() - done) as f64;
            eprintln!("  [{done}/{}] compiled, {elapsed:.0} s elapsed, ETA {eta:.0} s", survivors.len());
        }
        let mut ranked: Vec<&Candidate> = candidates.iter().collect();
        ranked.sort_by(|a, b| match (&a.outcome, &b.outcome) {
            (Ok(x), Ok(y)) => x.time_us.total_cmp(&y.time_us),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
            _ => std::cmp::Ordering::Equal,
        });
        println!("{} on {}, {}, shapes {}: ranked by time = max(libtpu's estimate, HBM) summed over the plan's launches", stem(&sel), target.name, dtype.name(), shapes_text(&sel));
        println!("{:<4} {:<44} {:>10} {:>10} {:>8} {:>7} {:>8}", "rank", "statics", "time us", "cycles", "bundles", "spills", "VMEM MiB");
        for (rank, c) in ranked.iter().enumerate() {
            match &c.outcome {
                Ok(f) => println!("{:<4} {:<44} {:>10.1} {:>10} {:>8} {:>7} {:>8.2}{}", rank + 1, c.statics, f.time_us, f.cycles.map_or("-".to_string(), |c| c.to_string()), f.bundles, f.spills, f.vmem_bytes as f64 / (1 << 20) as f64, if f.blind { "  (time from the IR's model: libtpu's estimate cannot see the trip counts)" } else { "" }),
                Err(why) => println!("{:<4} {:<44} {why}", "-", c.statics),
            }
        }
        let Some(winner) = ranked.first().filter(|c| c.outcome.is_ok()) else {
            return Err(format!("{}: no candidate compiled (the op's own blocks included); nothing saved", stem(&sel)));
        };
        // The rule winning is an entry too: it replaces an older table's blocks for this call.
        let best = (winner.statics != DEFAULT_RULE).then(|| winner.statics.clone());
        match &best {
            Some(b) => println!("best: {b}"),
            None => println!("best: the op's own block rule (the entry keeps it: `best` null)"),
        }
        entries.push(serde_json::json!({
            "op": sel.op.name,
            "case": sel.case.name,
            "target": target.name,
            "dtype": dtype.name(),
            "shapes": sel.op.inputs.iter().zip(&sel.shapes).map(|(i, s)| (i.name.to_string(), serde_json::json!(s))).collect::<serde_json::Map<_, _>>(),
            "statics": sel.statics.to_string(),
            "best": best,
            "candidates": candidates.iter().map(|c| match &c.outcome {
                Ok(f) => serde_json::json!({"statics": c.statics, "time_us": f.time_us, "cycles": f.cycles, "bundles": f.bundles, "spills": f.spills, "vmem_bytes": f.vmem_bytes, "blind": f.blind}),
                Err(why) => serde_json::json!({"statics": c.statics, "skipped": why}),
            }).collect::<Vec<_>>(),
        }));
    }
    if entries.is_empty() {
        return Err(format!("no case could take these inputs ({}); nothing tuned", skipped.join(", ")));
    }
    if let Some(path) = save {
        save_tuning(path, entries)?;
        println!("saved to {}", path.display());
    }
    Ok(true)
}

/// How the tuner names the baseline: the op's blocks with the knobs left unset.
const DEFAULT_RULE: &str = "(the op's own block rule)";

/// The table at `path`, or a new empty one when there is no file; an error for anything that
/// is not a format-1 table (so `--save` never overwrites another file).
fn read_tuning(path: &Path) -> CliResult<serde_json::Value> {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes).map_err(|_| format!("{}: not a tuning table (not UTF-8 text); pick another --save path", path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(serde_json::json!({"format": 1, "entries": []})),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let table = serde_json::from_str::<serde_json::Value>(&text).map_err(|e| format!("{}: not a tuning table: {e}", path.display()))?;
    if table["format"] != 1 {
        return Err(format!("{}: tuning table format {} (this tessera reads and writes format 1); pick another --save path", path.display(), table["format"]));
    }
    if !table["entries"].is_array() {
        return Err(format!("{}: a format-1 tuning table without an `entries` list; pick another --save path", path.display()));
    }
    Ok(table)
}

/// Whether `--save` can write `path`: the file opened for appending (not changed) when it
/// exists, else a probe file created and removed beside it.
fn writable(path: &Path) -> CliResult<()> {
    let cannot = |e: std::io::Error| format!("--save {}: cannot write the tuning table there: {e}; pick another path", path.display());
    if path.exists() {
        return std::fs::OpenOptions::new().append(true).open(path).map(drop).map_err(cannot);
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let probe = dir.join(format!(".tessera-tune-probe-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(cannot)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn shapes_text(sel: &Selected) -> String {
    sel.op.inputs.iter().zip(&sel.shapes).map(|(i, s)| format!("{}={}", i.name, dims(s))).collect::<Vec<_>>().join(" ")
}

/// Adds `entries` to the tuning table at `path` (created if missing), replacing any entry of
/// the same op, case, target, dtype, shapes and statics. Each new entry records the libtpu and
/// tessera versions its figures came from (a table gathers runs over time); the table's own
/// `libtpu` is the latest run's.
fn save_tuning(path: &Path, mut entries: Vec<serde_json::Value>) -> CliResult<()> {
    let mut table = read_tuning(path)?;
    let libtpu = serde_json::json!(crate::libtpu_version());
    for e in &mut entries {
        e["libtpu"] = libtpu.clone();
        e["tessera"] = serde_json::json!(env!("CARGO_PKG_VERSION"));
    }
    table["libtpu"] = libtpu;
    let key = |e: &serde_json::Value| (e["op"].clone(), e["case"].clone(), e["target"].clone(), e["dtype"].clone(), e["shapes"].clone(), e["statics"].clone());
    let list = table["entries"].as_array_mut().ok_or_else(|| format!("{}: `entries` is not a list", path.display()))?;
    for e in entries {
        list.retain(|old| key(old) != key(&e));
        list.push(e);
    }
    std::fs::write(path, serde_json::to_string_pretty(&table).map_err(|e| e.to_string())? + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// `ok`, or what made a run against the reference fail.
pub(crate) fn verdict(r: &harness::Report) -> String {
    let worst = r.worst();
    if r.passed() {
        "ok".to_string()
    } else if worst.nan_count > 0 {
        format!("FAIL: {} NaN output elements (blocks never written?)", worst.nan_count)
    } else if worst.mismatches > 0 {
        format!("FAIL: {} integer output elements differ", worst.mismatches)
    } else if worst.nonfinite > 0 {
        format!("FAIL: {} output elements infinite where the reference is finite, or the other way", worst.nonfinite)
    } else {
        format!("FAIL: error {:.2e} above the tolerance {:.1e} (max |got - want| / max |want|)", worst.scaled_err, worst.tolerance)
    }
}
