//! The structure as drawn from imports: no source file of the crate imports, directly or
//! through others, a file that imports it back (`scripts/import-cycles.py`, which resolves
//! `crate::`, `super::` and `self::` paths to the files that define what they name).

use std::process::Command;

#[test]
fn no_source_file_imports_itself_through_others() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/import-cycles.py"))
        .arg(format!("{root}/src"))
        .output()
        .expect("python3 runs the import-cycle script");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The script read the whole tree (not an empty or wrong directory).
    let files: usize = report
        .split_whitespace()
        .rev()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(files > 100, "{report}");
}
