//! Compile-fail tests: unsupported kernel syntax must give a clear error at the right span.
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p tessera-macros --test ui`
//! and review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
