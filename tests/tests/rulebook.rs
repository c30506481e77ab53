//! The rulebook's evidence, checked.
//!
//! Without libtpu (every machine): every rule libtpu judges has an evidence pair; our
//! verifier accepts each pair's inside half and rejects its outside half with the pair's
//! rule (warnings: warns on the outside half only); the recorded libtpu verdicts
//! (`tests/verdicts/libtpu.json`) back every pair (inside accepted, outside rejected); and
//! our verdict on every probe agrees with libtpu's recorded one (0 false accepts; the
//! false rejects are the known ones below, each explained).
//!
//! With `TESSERA_TPU_ORACLE=1` (the libtpu tier of `scripts/test.sh`): libtpu judges every
//! pair half and a stable sixth of the probes again (`TESSERA_LIBTPU_SAMPLE=1` for all of
//! them, about 2 min cold; cached by module text and libtpu version under
//! `target/tpu-verdicts/`), and the test fails loudly if any verdict moved from the recorded
//! one, e.g. after a libtpu upgrade: re-record with `probes -- bless` and fix the rules.

use std::collections::BTreeMap;

use tessera_dsl::rules::{Kind, RULES};
use tessera_tests::agreement::{self, Class, Item, Recorded};
use tessera_tests::{oracle, probes, rulebook};

/// Disagreements we keep, with the reason (each is a false reject: we are stricter).
const KNOWN_FALSE_REJECTS: &[(&str, &str)] = &[(
    "vmem-held/bf16/103pct@tpu7x",
    "tpu7x sometimes single-buffers blocks; the VMEM estimate always counts two buffers, so it is high there (never low)",
)];

fn recorded() -> BTreeMap<String, Recorded> {
    let (version, map) = agreement::load();
    assert!(!map.is_empty(), "tests/verdicts/libtpu.json is missing: record it with `cargo run --release -p tessera-tests --bin probes -- bless` (needs the venv)");
    assert!(!version.is_empty());
    map
}

#[test]
fn every_rule_libtpu_judges_has_an_evidence_pair() {
    let pairs = rulebook::pairs();
    for r in RULES.iter().filter(|r| r.kind != Kind::Semantic) {
        assert!(pairs.iter().any(|p| p.rule == r.id), "rule `{}` ({:?}) has no evidence pair in tests/src/rulebook/", r.id, r.kind);
    }
    for p in &pairs {
        let rule = tessera_dsl::rules::find(p.rule).unwrap_or_else(|| panic!("pair for unknown rule `{}`", p.rule));
        assert_ne!(rule.kind, Kind::Semantic, "`{}` is semantic: libtpu cannot judge it, a pair proves nothing", p.rule);
        for t in p.targets {
            assert!(rule.kind == Kind::Warning || rule.libtpu_judges(t.name), "pair {}/{} on {t}: libtpu does not judge the rule there", p.rule, p.edge);
        }
    }
}

#[test]
fn our_verifier_puts_each_pair_on_its_side_of_the_edge() {
    for h in rulebook::halves() {
        let kernel = h.kernel.as_ref().unwrap_or_else(|e| panic!("{}: the builder refused it: {e}", h.name));
        let warning = tessera_dsl::rules::find(h.rule).unwrap().kind == Kind::Warning;
        let verdict = tessera_dsl::verify::check(kernel, &h.target);
        match (h.inside, warning, verdict) {
            (true, _, Ok(w)) => assert!(!w.iter().any(|w| w.rule == h.rule), "{}: warns {}", h.name, h.rule),
            (false, true, Ok(w)) => assert!(w.iter().any(|w| w.rule == h.rule), "{}: expected warning {}, got {w:?}", h.name, h.rule),
            (false, false, Err(e)) => {
                assert_eq!(e.rule, h.rule, "{}: rejected by the wrong rule:\n{e}", h.name);
                assert!(!e.help.is_empty(), "{}: the message must say what to change:\n{e}", h.name);
            }
            (_, _, other) => panic!("{}: inside = {}, our verdict {other:?}", h.name, h.inside),
        }
    }
}

#[test]
fn recorded_libtpu_verdicts_back_every_pair() {
    let rec = recorded();
    for h in rulebook::halves() {
        let r = rec.get(&h.name).unwrap_or_else(|| panic!("{}: no recorded libtpu verdict; run `probes -- bless`", h.name));
        let warning = tessera_dsl::rules::find(h.rule).unwrap().kind == Kind::Warning;
        let want = h.inside || warning;
        assert_eq!(r.ok, want, "{}: libtpu {} it (recorded: {}); the evidence no longer shows the edge", h.name, if r.ok { "accepts" } else { "rejects" }, r.error);
    }
}

/// Our verdicts against libtpu's (`now`: freshly compiled; else the recorded ones).
fn check_probes(libtpu: &BTreeMap<String, Recorded>) {
    let all = probes::all();
    assert!(all.len() >= 300 * 3, "the probe set shrank to {}", all.len());
    let mut counts: BTreeMap<Class, usize> = BTreeMap::new();
    let mut bad = Vec::new();
    for p in &all {
        let l = libtpu.get(&p.name);
        assert!(l.is_some() || agreement::module(&p.kernel, &p.target).is_none(), "{}: no libtpu verdict; run `probes -- bless`", p.name);
        let class = agreement::classify(agreement::ours(&p.kernel, &p.target), l, &p.target);
        *counts.entry(class).or_default() += 1;
        let known = KNOWN_FALSE_REJECTS.iter().any(|(n, _)| *n == p.name);
        if class == Class::FalseAccept || (class == Class::FalseReject && !known) {
            bad.push(format!("{class:?} {}: ours {:?}, libtpu {:?}", p.name, agreement::ours(&p.kernel, &p.target), l));
        }
    }
    eprintln!("{} probes: {counts:?}", all.len());
    assert!(bad.is_empty(), "disagreements with libtpu:\n{}", bad.join("\n"));
}

#[test]
fn our_verdict_on_every_probe_matches_the_recorded_libtpu_verdict() {
    check_probes(&recorded());
}

#[test]
fn libtpu_still_judges_the_evidence_and_the_probes_as_recorded() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (scripts/test.sh does) to compile with libtpu");
        return;
    }
    let started = std::time::Instant::now();
    let rec = recorded();
    let probes = probes::all();
    let halves = rulebook::halves();
    // Every evidence half; of the probes, a stable sample (one in six by default: libtpu is
    // pinned, so a probe whose text did not change keeps its verdict; the sample watches for
    // emission changes).
    let mut items: Vec<Item> = probes.iter().filter(|p| oracle::sampled(&p.name, 6)).map(|p| Item { name: &p.name, target: p.target, kernel: &p.kernel }).collect();
    items.extend(halves.iter().map(|h| Item { name: &h.name, target: h.target, kernel: &h.kernel }));
    let now = agreement::compile(&items);
    let mut moved = Vec::new();
    // Probes outside the sample keep their recorded verdicts.
    let mut fresh = rec.clone();
    for (it, v) in items.iter().zip(now) {
        let Some(v) = v else { continue };
        if let Some(r) = rec.get(it.name) {
            if r.ok != v.ok {
                moved.push(format!("{}: recorded {}, libtpu {} now ({})", it.name, if r.ok { "accept" } else { "reject" }, if v.ok { "accepts" } else { "rejects" }, v.error));
            }
        }
        fresh.insert(it.name.to_string(), v);
    }
    eprintln!(
        "libtpu {} judged {} kernels in {:.0} s ({} evidence halves, 1 in {} of {} probes; TESSERA_LIBTPU_SAMPLE=1 for every probe)",
        oracle::libtpu_version(),
        items.len(),
        started.elapsed().as_secs_f64(),
        halves.len(),
        oracle::sample_every(6),
        probes.len()
    );
    assert!(moved.is_empty(), "libtpu moved {} edges (re-record with `probes -- bless`, then fix the rules):\n{}", moved.len(), moved.join("\n"));
    check_probes(&fresh);
}

#[test]
fn the_readme_shows_the_rulebook_as_it_is() {
    let readme = std::fs::read_to_string(oracle::repo().join("tests/src/rulebook/README.md")).unwrap();
    let table = agreement::rules_table();
    assert!(readme.contains(&table), "tests/src/rulebook/README.md is out of date: regenerate its table with `cargo run -p tessera-tests --bin probes -- rules`");
}
