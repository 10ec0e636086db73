//! The quantized matmul's SIMD paths for instruction sets this machine may lack (AVX-512 VNNI)
//! run on an emulated Sapphire Rapids (Bochs' CPU through the PyPI package `bochscpu-python`)
//! and must match the portable path; the AVX2 path runs both emulated and natively, as a check
//! of the harness itself. See `tests/python/emulated_isa.py`.
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

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn every_simd_path_matches_the_portable_one_on_an_emulated_avx512_vnni_cpu() {
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
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every case ran on the emulated CPU with AVX-512 VNNI, for both layouts and every format.
    for format in ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"] {
        for layout in ["row-major", "interleaved"] {
            let prefix = format!("emulated {format} {layout}");
            let passed = stdout
                .lines()
                .filter(|l| l.starts_with(&prefix) && l.contains("Avx512Vnni: ok"))
                .count();
            assert!(
                passed >= 2,
                "{prefix}: {passed} AVX-512 VNNI cases passed\n{stdout}"
            );
        }
    }
}
