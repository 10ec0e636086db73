//! The quantized matmul's SIMD paths for instruction sets this machine may lack (AVX-512 VNNI,
//! AVX-VNNI) run on emulated CPUs (Bochs' Sapphire Rapids and Arrow Lake models, through the
//! PyPI package `bochscpu-python`) and must match the portable path; the AVX2 path runs both
//! emulated and natively, as a check of the harness itself. See
//! `tests/python/emulated_isa.py`.
//!
//! Needs `python3 -m pip install bochscpu-python==0.4.0` (the CI script installs it) and the
//! `emulated_kernels` example library, which `cargo test` builds with the other targets.

use std::path::PathBuf;
use std::process::Command;

/// The example library beside this test binary's directory (`target/<profile>/examples`).
fn example_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let lib = profile_dir.join("examples/libemulated_kernels.so");
    assert!(
        lib.exists(),
        "{} is missing: run `cargo build --example emulated_kernels` (plain `cargo test` builds it)",
        lib.display()
    );
    lib
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

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn every_simd_path_matches_the_portable_one_on_an_emulated_sapphire_rapids() {
    let report = run_harness("sapphire_rapids");
    for format in FORMATS {
        for layout in ["row-major", "interleaved"] {
            for isa in ["Avx512Vnni", "AvxVnni", "Avx2"] {
                let passed = count(&report, format, layout, isa, "ok");
                assert!(
                    passed >= 2,
                    "{format} {layout} {isa}: {passed} cases passed\n{report}"
                );
            }
        }
    }
}

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn avx_vnni_paths_match_on_an_emulated_arrow_lake_where_avx512_ones_fault() {
    let report = run_harness("arrow_lake");
    for format in FORMATS {
        for layout in ["row-major", "interleaved"] {
            let passed = count(&report, format, layout, "AvxVnni", "ok");
            assert!(
                passed >= 2,
                "{format} {layout} AVX-VNNI: {passed} cases passed\n{report}"
            );
        }
        // The interleaved AVX-512 kernels stop at their first `vpdpbusd`: the emulator
        // enforces the instruction set, so the passes above ran the AVX-VNNI encoding.
        let faulted = count(
            &report,
            format,
            "interleaved",
            "Avx512Vnni",
            "invalid opcode",
        );
        assert!(
            faulted >= 2,
            "{format}: {faulted} AVX-512 cases faulted\n{report}"
        );
    }
}
