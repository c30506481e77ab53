//! The rulebook is complete: every rule id the crate can put in a `KernelError` or a
//! `Warning` is in `rules::RULES`, and every rule there is still produced somewhere.
//!
//! Rule ids are kebab-case with at least two words (`rules.rs` checks that), so a rule id
//! in the sources is any string literal of that form; the few such literals that are not
//! rule ids are listed below.

use std::collections::BTreeSet;
use std::path::Path;

use tessera_dsl::rules::{self, RETIRED, RULES};

/// Kebab-case literals in `dsl/src` that are message text, not rule ids.
const NOT_RULES: &[&str] = &["second-to-last"];

/// Every `"..."` literal of a Rust source (good enough for this crate: no raw strings).
fn literals(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = src.chars().peekable();
    let mut in_comment = false;
    let mut prev = ' ';
    while let Some(c) = chars.next() {
        if in_comment {
            in_comment = c != '\n';
        } else if c == '/' && chars.peek() == Some(&'/') {
            in_comment = true;
        } else if c == '\'' && prev != '\\' {
            // A char literal such as '"' must not open a string.
            let mut lookahead = chars.clone();
            let (a, b) = (lookahead.next(), lookahead.next());
            if b == Some('\'') || (a == Some('\\') && lookahead.next() == Some('\'')) {
                chars.next();
                chars.next();
                if a == Some('\\') {
                    chars.next();
                }
            }
        } else if c == '"' {
            let mut s = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        chars.next();
                    }
                    '"' => break,
                    c => s.push(c),
                }
            }
            out.push(s);
        }
        prev = c;
    }
    out
}

fn is_rule_shaped(s: &str) -> bool {
    s.contains('-') && s.split('-').all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()))
}

fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("rules.rs") {
            out.push((path.display().to_string(), std::fs::read_to_string(&path).unwrap()));
        }
    }
}

fn used_ids() -> BTreeSet<(String, String)> {
    let mut files = Vec::new();
    sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    let mut ids = BTreeSet::new();
    for (path, text) in files {
        for lit in literals(&text) {
            if is_rule_shaped(&lit) && !NOT_RULES.contains(&lit.as_str()) {
                ids.insert((lit, path.clone()));
            }
        }
    }
    ids
}

#[test]
fn every_rule_id_in_the_sources_is_in_the_rulebook() {
    let used = used_ids();
    assert!(used.len() >= 60, "the scan found only {} rule ids: is it still reading dsl/src?", used.len());
    let missing: Vec<String> = used.iter().filter(|(id, _)| rules::find(id).is_none()).map(|(id, path)| format!("`{id}` in {path}")).collect();
    assert!(missing.is_empty(), "rule ids used but not in dsl/src/rules.rs (add them, with their evidence):\n{}", missing.join("\n"));
    let retired: Vec<&String> = used.iter().map(|(id, _)| id).filter(|id| RETIRED.iter().any(|(r, _)| r == id)).collect();
    assert!(retired.is_empty(), "retired rule ids are never produced again: {retired:?}");
}

#[test]
fn every_rule_in_the_rulebook_is_produced() {
    let used: BTreeSet<String> = used_ids().into_iter().map(|(id, _)| id).collect();
    let dead: Vec<&str> = RULES.iter().map(|r| r.id).filter(|id| !used.contains(*id)).collect();
    assert!(dead.is_empty(), "rules in the table that no code produces (retire them in RETIRED): {dead:?}");
}

#[test]
fn the_literal_scanner_sees_strings_not_chars_or_comments() {
    let src = r#"let a = '"'; // "not-this"
        f("rule-one", "message with-hyphen words", "x"); let b = "esc\"aped-id";"#;
    let lits = literals(src);
    assert_eq!(lits, vec!["rule-one".to_string(), "message with-hyphen words".to_string(), "x".to_string(), "esc\"aped-id".replace('"', "")]);
}
