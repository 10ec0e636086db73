//! The CUDA kernels: CUDA C sources embedded in the binary, compiled by NVRTC at start-up for
//! the device's compute capability (a CUBIN, so nothing is left to the driver's JIT), and
//! cached on disk under a hash of the source, the architecture and NVRTC's version.
//!
//! The sources include no header: the runtime machine needs the driver and `libnvrtc` only.
//! Each file is compiled after [`PRELUDE`] (half-precision conversions, reductions).

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

/// Shared definitions every source is compiled after.
pub const PRELUDE: &str = include_str!("prelude.cuh");

/// The kernel files, by name.
pub const SOURCES: [(&str, &str); 4] = [
    ("quant", include_str!("quant.cu")),
    ("ops", include_str!("ops.cu")),
    ("attention", include_str!("attention.cu")),
    ("sampling", include_str!("sampling.cu")),
];

/// What stands between this build and compiling its kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "NVRTC (libnvrtc.so.13) was not found: install it (pip install nvidia-cuda-nvrtc==13.0.*) \
         and put its lib folder on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("NVRTC failed on {file}.cu for sm_{arch}: {log}")]
    Compile {
        file: String,
        arch: u32,
        log: String,
    },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
}

/// Whether NVRTC's library can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    if !nvrtc_present() {
        return Err(KernelError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| KernelError::Nvrtc(format!("{e:?}")))?;
    Ok((major, minor))
}

/// The full text NVRTC compiles for source `file`.
pub fn full_source(body: &str) -> String {
    format!("{PRELUDE}\n{body}")
}

/// Compiles `body` (one of [`SOURCES`]) to a CUBIN for `sm_{arch}` (`90` for compute
/// capability 9.0).
pub fn compile_cubin(file: &str, body: &str, arch: u32) -> Result<Vec<u8>, KernelError> {
    if !nvrtc_present() {
        return Err(KernelError::NoNvrtc);
    }
    let err = |e: nvrtc::NvrtcError| KernelError::Nvrtc(format!("{file}.cu: {e:?}"));
    let src = CString::new(full_source(body)).expect("kernel sources hold no NUL byte");
    let name = CString::new(format!("{file}.cu")).expect("file names hold no NUL byte");
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(err)?;
    let options = [
        format!("-arch=sm_{arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
    ];
    // SAFETY: `prog` was created above and is destroyed once, below.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let result = match compiled {
        Ok(()) => cubin_of(prog).map_err(err),
        Err(_) => {
            // SAFETY: as above.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|log| c_chars_to_string(&log))
                .unwrap_or_default();
            Err(KernelError::Compile {
                file: file.to_string(),
                arch,
                log,
            })
        }
    };
    // SAFETY: as above; nothing reads `prog` after this.
    unsafe { nvrtc::destroy_program(prog) }.map_err(err)?;
    result
}

fn cubin_of(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the buffer is sized as NVRTC says.
    unsafe {
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
        let mut cubin = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result()?;
        Ok(cubin)
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

static CACHE_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Keeps compiled kernels in `dir` between runs (without it, every start compiles them anew);
/// only the first call counts.
pub fn set_cache_dir(dir: PathBuf) {
    let _ = CACHE_DIR.set(dir);
}

fn cache_dir() -> Option<PathBuf> {
    CACHE_DIR.get().cloned()
}

/// [`compile_cubin`], read from the disk cache when this source was compiled before for this
/// architecture by this NVRTC. A cache that cannot be read or written is skipped.
pub fn cached_cubin(file: &str, body: &str, arch: u32) -> Result<Vec<u8>, KernelError> {
    let version = nvrtc_version()?;
    let key = fnv1a(format!("{version:?} sm_{arch} {}", full_source(body)).as_bytes());
    let path = cache_dir().map(|d| d.join(format!("{file}-sm_{arch}-{key:016x}.cubin")));
    if let Some(cubin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(cubin);
    }
    let cubin = compile_cubin(file, body, arch)?;
    if let Some(path) = path {
        let written = path
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| {
                // Written aside and renamed, so a concurrent start never reads half a file.
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, &cubin)?;
                std::fs::rename(&tmp, &path)
            });
        if let Err(e) = written {
            tracing::debug!("kernel cache {}: {e}", path.display());
        }
    }
    Ok(cubin)
}

/// 64-bit FNV-1a: a stable hash for cache keys (not for security).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The formats of stored matrices, by the suffix their kernels carry.
pub const FORMATS: [&str; 9] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k",
];

/// Every kernel the CUDA backend launches, by source file.
pub fn kernels() -> Vec<(&'static str, Vec<String>)> {
    let per_format = |prefix: &str, skip: &[&str]| -> Vec<String> {
        FORMATS
            .iter()
            .filter(|f| !skip.contains(f))
            .map(|f| format!("{prefix}_{f}"))
            .collect()
    };
    let mut quant = per_format("dequant_rows", &[]);
    quant.extend(per_format("dequant_f16", &["f16"]));
    quant.extend(per_format("matvec", &[]));
    quant.extend(per_format("matmul_tc", &[]));
    quant.extend(["f32_to_f16", "f32_to_bf16", "f16_to_f32", "sum_slices"].map(String::from));
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        ("quant", quant),
        (
            "ops",
            names(&[
                "rms_norm",
                "add_rms_norm",
                "add_in_place",
                "add_bias",
                "silu_mul",
                "rotary",
                "copy_columns",
                "gather_rows",
            ]),
        ),
        (
            "attention",
            names(&[
                "kv_write_f16",
                "qkv_rotary_write_f16",
                "paged_attention_f16",
                "paged_attention_tiles_f16",
                "attention_merge",
            ]),
        ),
        ("sampling", names(&["row_softmax_stats"])),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_differ_by_content() {
        assert_ne!(fnv1a(b"sm_80 x"), fnv1a(b"sm_90 x"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
