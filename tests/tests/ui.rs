//! Compile-time checks of `#[recovery_unit]`: every rejected input has a pinned message
//! (`ui/fail/*.rs` + `.stderr`), and every supported shape of unit compiles and runs
//! (`ui/pass/*.rs`). Regenerate the messages with `TRYBUILD=overwrite` and review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
