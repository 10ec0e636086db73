//! Every CUDA kernel compiles with NVRTC to a CUBIN for Ampere (sm_80) and Hopper (sm_90), and
//! each CUBIN defines every kernel the backend launches from it. Needs no GPU: NVRTC is a
//! library (`pip install nvidia-cuda-nvrtc==13.0.*`, its lib folder on `LD_LIBRARY_PATH`).

use tokenrouter::kernels::cuda::{compile_cubin, kernels, nvrtc_version, SOURCES};

/// Whether `haystack` holds `needle` as a NUL-terminated name (an ELF string table entry).
fn defines(haystack: &[u8], needle: &str) -> bool {
    let mut name = needle.as_bytes().to_vec();
    name.push(0);
    haystack.windows(name.len()).any(|w| w == name)
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let version = nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        version.0, 13,
        "NVRTC 13.x, which a CUDA 13.0 driver accepts"
    );
    let wanted = kernels();
    assert_eq!(
        wanted.len(),
        SOURCES.len(),
        "every source has kernels the backend launches"
    );
    for (file, names) in &wanted {
        let body = SOURCES
            .iter()
            .find(|(f, _)| f == file)
            .map(|(_, b)| *b)
            .unwrap_or_else(|| panic!("{file}.cu is not embedded"));
        for arch in [80, 90] {
            let cubin = compile_cubin(file, body, arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{file}.cu sm_{arch}: a CUBIN is an ELF image"
            );
            for name in names {
                assert!(
                    defines(&cubin, name),
                    "{file}.cu sm_{arch} does not define {name}"
                );
            }
        }
    }
}

#[test]
fn a_broken_kernel_is_reported_with_the_compiler_log() {
    let err = compile_cubin(
        "broken",
        "extern \"C\" __global__ void k() { undefined_call(); }",
        80,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("broken.cu") && err.contains("sm_80"), "{err}");
    assert!(
        err.contains("undefined_call"),
        "the log names the problem: {err}"
    );
}
