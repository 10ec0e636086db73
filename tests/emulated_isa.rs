//! The quantized matmul's SIMD paths for instruction sets this machine may lack (AVX-512 VNNI,
//! AVX-VNNI) run on emulated CPUs (Bochs' Sapphire Rapids and Arrow Lake models, through the
//! PyPI package `bochscpu-python`) and must match the portable path; the AVX2 path runs both
//! emulated and natively, as a check of the harness itself. See
//! `tests/python/emulated_isa.py`.
//!
//! Needs `python3 -m pip install bochscpu-python==0.4.0` (the CI script installs it) and the
//! `emulated_kernels` example library, which `cargo test` builds with the other targets.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The example library beside this test binary's directory (`target/<profile>/examples`),
/// refused when a source file is newer (`cargo test --test emulated_isa` alone does not
/// rebuild examples).
fn example_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let lib = profile_dir.join("examples/libemulated_kernels.so");
    let rebuild = "run `cargo build --example emulated_kernels` (plain `cargo test` builds it)";
    let built = std::fs::metadata(&lib)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {rebuild}", lib.display()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let newest = newest_source(&root.join("src")).max(newest_source(&root.join("examples")));
    assert!(
        newest <= built,
        "{} is older than the sources: {rebuild}",
        lib.display()
    );
    lib
}

/// The latest modification time of the `.rs` files under `dir`.
fn newest_source(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let time = if path.is_dir() {
            newest_source(&path)
        } else if path.extension().is_some_and(|e| e == "rs") {
            entry.metadata().and_then(|m| m.modified()).unwrap()
        } else {
            continue;
        };
        newest = newest.max(time);
    }
    newest
}

/// Runs the harness on one emulated CPU model and returns its report.
fn run_harness(cpu: &str) -> String {
    let probe = Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; exit(u.find_spec('bochscpu') is None)",
        ])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "the `bochscpu` Python package is missing: run \
         `python3 -m pip install bochscpu-python==0.4.0`"
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/emulated_isa.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(example_library())
        .arg(cpu)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Lines of `report` for emulated cases of `format` in `layout` with `isa` that end in `verdict`.
fn count(report: &str, format: &str, layout: &str, isa: &str, verdict: &str) -> usize {
    let prefix = format!("emulated {format} {layout}");
    report
        .lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&format!("{isa}: {verdict}")))
        .count()
}

const FORMATS: [&str; 6] = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"];
/// Cases per format and instruction set: two row-major shapes and four interleaved ones
/// (`SHAPES` in `examples/emulated_kernels.rs`).
const LAYOUTS: [(&str, usize); 2] = [("row-major", 2), ("interleaved", 4)];

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn every_simd_path_matches_the_portable_one_on_an_emulated_sapphire_rapids() {
    let report = run_harness("sapphire_rapids");
    for format in FORMATS {
        for (layout, cases) in LAYOUTS {
            for isa in ["Avx512Vnni", "AvxVnni", "Avx2"] {
                let passed = count(&report, format, layout, isa, "ok");
                assert_eq!(passed, cases, "{format} {layout} {isa}\n{report}");
            }
        }
    }
}

/// On a CPU without one of the VNNI forms, its interleaved kernels stop at their first
/// `vpdpbusd`: the emulator enforces the instruction set, so the passes on the other form
/// ran the instructions they claim.
fn check_one_vnni_form(cpu: &str, present: &str, absent: &str) {
    let report = run_harness(cpu);
    for format in FORMATS {
        for (layout, cases) in LAYOUTS {
            let passed = count(&report, format, layout, present, "ok");
            assert_eq!(
                passed, cases,
                "{cpu}: {format} {layout} {present}\n{report}"
            );
        }
        let faulted = count(&report, format, "interleaved", absent, "invalid opcode");
        let interleaved = LAYOUTS[1].1;
        assert_eq!(
            faulted, interleaved,
            "{cpu}: {format} interleaved {absent}\n{report}"
        );
    }
}

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn avx_vnni_paths_match_on_an_emulated_arrow_lake_where_avx512_ones_fault() {
    check_one_vnni_form("arrow_lake", "AvxVnni", "Avx512Vnni");
}

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn avx512_vnni_paths_match_on_an_emulated_tiger_lake_where_avx_vnni_ones_fault() {
    check_one_vnni_form("tigerlake", "Avx512Vnni", "AvxVnni");
}
