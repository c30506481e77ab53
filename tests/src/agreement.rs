//! Our verdict vs libtpu's on the evidence pairs and the probes: the recorded verdicts
//! (`tests/verdicts/libtpu.json`, so machines without libtpu still see the evidence), the
//! classification of each kernel, and the agreement report (`tests/verdicts/report.md`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use tessera_dsl::rules;
use tessera_dsl::Target;

use crate::kit::Built;
use crate::oracle;

/// A kernel to judge: its verdict key, target and kernel.
pub struct Item<'a> {
    pub name: &'a str,
    pub target: Target,
    pub kernel: &'a Built,
}

/// libtpu's verdict as recorded: accepted, or rejected with the first line of its message.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub ok: bool,
    pub error: String,
}

pub fn verdicts_path() -> PathBuf {
    oracle::repo().join("tests/verdicts/libtpu.json")
}

/// The recorded verdicts and the libtpu version they were recorded with.
pub fn load() -> (String, BTreeMap<String, Recorded>) {
    let Ok(text) = std::fs::read_to_string(verdicts_path()) else { return (String::new(), BTreeMap::new()) };
    let v: serde_json::Value = serde_json::from_str(&text).expect("tests/verdicts/libtpu.json is JSON");
    let version = v["libtpu"].as_str().unwrap_or_default().to_string();
    let map = v["verdicts"]
        .as_object()
        .map(|m| m.iter().map(|(k, r)| (k.clone(), Recorded { ok: r["ok"].as_bool() == Some(true), error: r["error"].as_str().unwrap_or_default().to_string() })).collect())
        .unwrap_or_default();
    (version, map)
}

pub fn save(version: &str, verdicts: &BTreeMap<String, Recorded>) {
    let map: serde_json::Map<String, serde_json::Value> = verdicts.iter().map(|(k, r)| (k.clone(), serde_json::json!({ "ok": r.ok, "error": r.error }))).collect();
    let doc = serde_json::json!({ "libtpu": version, "note": "written by `cargo run --release -p tessera-tests --bin probes -- bless`; one entry per evidence-pair half and probe", "verdicts": map });
    std::fs::create_dir_all(verdicts_path().parent().unwrap()).unwrap();
    std::fs::write(verdicts_path(), serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
}

/// Our verdict: accepted, or the rule of the first error (builder or verifier).
pub fn ours(kernel: &Built, target: &Target) -> Result<(), &'static str> {
    match kernel {
        Err(e) => Err(e.rule),
        Ok(k) => tessera_dsl::verify::verify(k, target).map_err(|e| e.rule),
    }
}

/// The StableHLO module libtpu is asked about: the kernel lowered *without* our verifier.
/// None when the builder refused it or the emitter cannot express it.
pub fn module(kernel: &Built, target: &Target) -> Option<String> {
    tessera_codegen::stablehlo::emit(kernel.as_ref().ok()?, target).ok()
}

/// The first meaningful line of a libtpu message (what the snapshot keeps), without the
/// pids and timestamps of a crash report.
pub fn first_line(error: &str) -> String {
    if let Some(rest) = error.strip_prefix("compiler crashed (") {
        let signal = rest.split(')').next().unwrap_or_default();
        let check = error.split("Check failed: ").nth(1).and_then(|c| c.lines().next()).map(|c| format!(": Check failed: {}", c.trim())).unwrap_or_default();
        return format!("compiler crashed ({signal}){check}");
    }
    let line = error.lines().map(str::trim).find(|l| !l.is_empty() && !l.ends_with(':')).unwrap_or(error);
    let line = line.split("HLO name `name.1`: ").last().unwrap_or(line);
    line.chars().take(200).collect()
}

/// libtpu's verdicts now (cached under target/tpu-verdicts), None where it gave none (a
/// timeout, or no module).
pub fn compile(items: &[Item]) -> Vec<Option<Recorded>> {
    let mut jobs = Vec::new();
    let mut idx = Vec::new();
    for (i, it) in items.iter().enumerate() {
        if let Some(text) = module(it.kernel, &it.target) {
            jobs.push((it.name.to_string(), it.target.name.to_string(), text));
            idx.push(i);
        }
    }
    let mut out = vec![None; items.len()];
    for (i, v) in idx.into_iter().zip(oracle::compile_cached(&jobs)) {
        if v.ok || !(v.error.starts_with("timeout") || v.error.contains("failed to start")) {
            out[i] = Some(Recorded { ok: v.ok, error: if v.ok { String::new() } else { first_line(&v.error) } });
        }
    }
    out
}

/// How our verdict compares with libtpu's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    Agree,
    /// We accept, libtpu rejects: the user meets a Mosaic error.
    FalseAccept,
    /// We reject by a rule libtpu judges, libtpu accepts.
    FalseReject,
    /// We reject by a rule that is ours by design here (semantic, or libtpu does not
    /// judge it on this generation), libtpu accepts.
    OursByDesign,
    /// libtpu gave no verdict (no module to compile, or it timed out).
    Unjudged,
}

pub fn classify(ours: Result<(), &'static str>, libtpu: Option<&Recorded>, target: &Target) -> Class {
    let Some(l) = libtpu else { return Class::Unjudged };
    match (ours, l.ok) {
        (Ok(()), true) | (Err(_), false) => Class::Agree,
        (Ok(()), false) => Class::FalseAccept,
        (Err(rule), true) => {
            if rules::find(rule).is_some_and(|r| r.libtpu_judges(target.name)) {
                Class::FalseReject
            } else {
                Class::OursByDesign
            }
        }
    }
}

/// One judged kernel, for the report.
pub struct Row {
    pub name: String,
    pub family: String,
    pub target: &'static str,
    pub ours: Result<(), &'static str>,
    pub libtpu: Option<Recorded>,
    pub class: Class,
}

/// The agreement report as markdown: counts per family and target, then every
/// disagreement.
pub fn report(rows: &[Row], libtpu: &str) -> String {
    let targets = ["v5e", "v6e", "tpu7x", "v5p"];
    let count = |f: &dyn Fn(&Row) -> bool, c: Class| rows.iter().filter(|r| f(r) && r.class == c).count();
    let mut s = String::new();
    s.push_str(&format!("# Verifier vs libtpu {libtpu}: agreement\n\n"));
    s.push_str("Written by `cargo run --release -p tessera-tests --bin probes` (every probe and evidence-pair half, each judged by our verifier and by libtpu compile-only; `tests/src/probes.rs`, `tests/src/rulebook/`). A *false accept*: we accept, libtpu rejects. A *false reject*: we reject by a rule libtpu judges, libtpu accepts. *Ours by design*: we reject by a semantic rule (or one libtpu does not judge on that generation) that libtpu compiles.\n\n");
    let total = |c| count(&|_| true, c);
    let judged = rows.iter().filter(|r| r.class != Class::Unjudged && r.class != Class::OursByDesign).count();
    s.push_str(&format!(
        "**{} kernels x generations: {} agree, {} false accepts, {} false rejects, {} ours by design, {} unjudged; agreement on the pairs libtpu judges: {}/{} ({:.1}%).**\n\n",
        rows.len(),
        total(Class::Agree),
        total(Class::FalseAccept),
        total(Class::FalseReject),
        total(Class::OursByDesign),
        total(Class::Unjudged),
        total(Class::Agree),
        judged,
        100.0 * total(Class::Agree) as f64 / judged.max(1) as f64
    ));
    s.push_str("| family | ");
    s.push_str(&targets.iter().map(|t| format!("{t} agree / FA / FR / ours")).collect::<Vec<_>>().join(" | "));
    s.push_str(" |\n|---|");
    s.push_str(&"---|".repeat(targets.len()));
    s.push('\n');
    let mut families: Vec<&str> = rows.iter().map(|r| r.family.as_str()).collect();
    families.dedup();
    let mut seen = std::collections::BTreeSet::new();
    for f in families {
        if !seen.insert(f) {
            continue;
        }
        s.push_str(&format!("| {f} |"));
        for t in targets {
            let sel = |r: &Row| r.family == f && r.target == t;
            s.push_str(&format!(" {} / {} / {} / {} |", count(&sel, Class::Agree), count(&sel, Class::FalseAccept), count(&sel, Class::FalseReject), count(&sel, Class::OursByDesign)));
        }
        s.push('\n');
    }
    s.push_str("\n## Disagreements\n\n");
    let mut any = false;
    for r in rows.iter().filter(|r| r.class != Class::Agree) {
        any = true;
        let ours = match r.ours {
            Ok(()) => "accept".to_string(),
            Err(rule) => format!("reject `{rule}`"),
        };
        let lib = match &r.libtpu {
            None => "no verdict".to_string(),
            Some(l) if l.ok => "accept".to_string(),
            Some(l) => format!("reject: {}", l.error.replace('|', "/")),
        };
        s.push_str(&format!("- {:?} `{}`: ours {ours}; libtpu {lib}\n", r.class, r.name));
    }
    if !any {
        s.push_str("None.\n");
    }
    s
}

/// The rulebook as a markdown table (the README shows it; a test keeps the two equal).
pub fn rules_table() -> String {
    use tessera_dsl::rules::{Checker, Kind, RULES};
    let mut s = String::from("| id | kind | checked by | rule | generations | evidence |\n|---|---|---|---|---|---|\n");
    for r in RULES {
        let kind = match r.kind {
            Kind::Tpu => "tpu",
            Kind::Semantic => "semantic",
            Kind::Warning => "warning",
        };
        let by: Vec<&str> = r.checkers.iter().map(|c| match c {
            Checker::Builder => "builder",
            Checker::Verifier => "verifier",
            Checker::Interpreter => "interpreter",
        }).collect();
        s.push_str(&format!("| `{}` | {kind} | {} | {} | {} | {} |\n", r.id, by.join(", "), r.statement, r.generations, r.evidence.replace('|', "/")));
    }
    s
}
