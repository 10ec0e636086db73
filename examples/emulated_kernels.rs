//! The quantized matmul's instruction-set paths as a C library, for running them on an
//! emulated CPU that has instruction sets this machine lacks (AVX-512 VNNI, AVX-VNNI): the harness
//! (`tests/python/emulated_isa.py`, driven by `tests/emulated_isa.rs`) prepares each case
//! natively, runs [`emu_run`] on the emulated CPU over this process's own memory, and checks
//! the result natively against the portable path and, for the interleaved kernels, bit for bit
//! against the native AVX2 path.
//!
//! `emu_run` must not make system calls: it runs on one thread (a one-thread pool, installed
//! for the call) over buffers and a scratch area that [`emu_prepare`] already sized natively.
//!
//! Built by `cargo test` (and `cargo build --example emulated_kernels`); x86-64 Linux only.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use tokenrouter::kernels::parallel::{with_pool, ComputePool, DisjointOut};
use tokenrouter::kernels::qmatmul::{
    quantize_row, ActFormat, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0,
    Interleaved, Isa, PackedMatrix, QuantKernel, QuantMatrix, WeightBlock,
};
use tokenrouter::kernels::qmatmul::{
    BlockQ4Kx8, BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ6Kx8, BlockQ8_0x8,
};

/// One multiplication: a matrix, quantized activations, and the two results.
pub struct Case {
    name: String,
    isa: Isa,
    m: usize,
    kernel: Box<dyn Erased>,
    pool: Arc<ComputePool>,
    /// The portable path's result, computed natively.
    want: Vec<f32>,
    /// For the interleaved kernels, the AVX2 path's result computed natively (where this CPU
    /// has AVX2): every SIMD path must give its bits exactly.
    bits: Option<Vec<f32>>,
    /// What the run under test wrote (NaN until then).
    got: Vec<f32>,
}

/// A kernel with its activations, behind one object type for every format.
trait Erased {
    /// # Safety
    /// The CPU running it (emulated or not) supports `isa`; `out` holds `m` rows.
    unsafe fn run(&self, isa: Isa, m: usize, out: &mut [f32]);
}

struct WithActs<K: QuantKernel> {
    kernel: K,
    acts: Vec<K::Act>,
}

impl<K: QuantKernel> Erased for WithActs<K> {
    unsafe fn run(&self, isa: Isa, m: usize, out: &mut [f32]) {
        self.kernel
            .matmul_quantized(&self.acts, m, DisjointOut::new(out), isa)
    }
}

/// The formats, each as ggml's block (row-major kernels) and interleaved.
const FORMATS: [&str; 6] = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"];
/// (weight rows, row blocks, activation rows): rows that are not a multiple of 8 take the
/// row-major kernels, the others the interleaved ones; the batches pass through every tile
/// height and leave tails (16 rows: Q6_K's tiles of eight, which take assembly passes with
/// AVX-512 VNNI, as Q4_K's of four do).
const SHAPES: [(usize, usize, usize); 6] = [
    (7, 2, 1),
    (33, 3, 5),
    (16, 2, 1),
    (24, 3, 5),
    (8, 1, 17),
    (8, 1, 16),
];

/// The SIMD instruction sets, in the order of [`emu_isa`]'s numbers.
const ISAS: [Isa; 3] = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

/// Number of cases (formats × shapes × SIMD instruction sets).
#[no_mangle]
pub extern "C" fn emu_cases() -> usize {
    FORMATS.len() * SHAPES.len() * ISAS.len()
}

/// The instruction set of case `i`: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI.
#[no_mangle]
pub extern "C" fn emu_isa(i: usize) -> usize {
    i % ISAS.len()
}

/// Prepares case `i`: weights and activations from a seeded generator, the portable result
/// (and for the interleaved kernels the AVX2 one) computed here, the output buffer and this
/// thread's scratch sized.
#[no_mangle]
pub extern "C" fn emu_prepare(i: usize) -> *mut Case {
    let isa = ISAS[emu_isa(i)];
    let shape = i / ISAS.len();
    let (format, (rows, blocks, m)) = (FORMATS[shape / SHAPES.len()], SHAPES[shape % SHAPES.len()]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shape as u64);
    let case = match format {
        "Q4_0" => build::<BlockQ4_0, BlockQ4_0x8>(GgmlDType::Q4_0, rows, blocks, m, &mut rng),
        "Q4_1" => build::<BlockQ4_1, BlockQ4_1x8>(GgmlDType::Q4_1, rows, blocks, m, &mut rng),
        "Q5_0" => build::<BlockQ5_0, BlockQ5_0x8>(GgmlDType::Q5_0, rows, blocks, m, &mut rng),
        "Q8_0" => build::<BlockQ8_0, BlockQ8_0x8>(GgmlDType::Q8_0, rows, blocks, m, &mut rng),
        "Q4_K" => build::<BlockQ4K, BlockQ4Kx8>(GgmlDType::Q4K, rows, blocks, m, &mut rng),
        "Q6_K" => build::<BlockQ6K, BlockQ6Kx8>(GgmlDType::Q6K, rows, blocks, m, &mut rng),
        _ => unreachable!(),
    };
    let (kernel, want, cols) = case;
    let interleaved = rows.is_multiple_of(8);
    let layout = if interleaved {
        "interleaved"
    } else {
        "row-major"
    };
    let bits = (interleaved && Isa::Avx2.is_available()).then(|| {
        let mut out = vec![f32::NAN; want.len()];
        // SAFETY: this CPU has AVX2; `out` holds `m` rows.
        unsafe { kernel.run(Isa::Avx2, m, &mut out) };
        out
    });
    Box::into_raw(Box::new(Case {
        name: format!("{format} {layout} {rows}x{cols} batch {m} {isa:?}"),
        isa,
        m,
        kernel,
        pool: ComputePool::new(1, "emulated"),
        got: vec![f32::NAN; want.len()],
        want,
        bits,
    }))
}

fn build<B: WeightBlock, P: Interleaved<Source = B>>(
    dtype: GgmlDType,
    rows: usize,
    blocks: usize,
    m: usize,
    rng: &mut impl Rng,
) -> (Box<dyn Erased>, Vec<f32>, usize) {
    let cols = blocks * B::Act::LEN;
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-0.1..0.1))
        .collect();
    let w = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    let bytes = QTensor::quantize(&w, dtype)
        .unwrap()
        .data()
        .unwrap()
        .to_vec();
    let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-3.0..3.0)).collect();
    let mut acts = vec![B::Act::ZERO; m * blocks];
    for (row, a) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(blocks)) {
        quantize_row(row, a);
    }
    let kernel: Box<dyn Erased> = if rows.is_multiple_of(8) {
        let kernel = PackedMatrix::<P>::from_bytes(rows, cols, &bytes).unwrap();
        Box::new(WithActs { kernel, acts })
    } else {
        let kernel = QuantMatrix::<B>::from_bytes(rows, cols, &bytes).unwrap();
        Box::new(WithActs { kernel, acts })
    };
    let mut want = vec![0f32; m * rows];
    // SAFETY: every CPU runs the portable path; `want` holds `m` rows.
    unsafe { kernel.run(Isa::Scalar, m, &mut want) };
    (kernel, want, cols)
}

/// The run under test: the case's instruction set on one thread. Makes no system call. (A run
/// that faults in the emulator never returns, so `with_pool` leaves the one-thread pool
/// installed on this thread: later native preparation then runs on one thread, harmlessly.)
///
/// # Safety
/// `case` comes from [`emu_prepare`] and is not freed; the CPU running this (the emulated one,
/// or the native one in [`emu_run_native`]) supports the case's instruction set.
#[no_mangle]
pub unsafe extern "C" fn emu_run(case: *mut Case) {
    let case = &mut *case;
    let (isa, m) = (case.isa, case.m);
    let (kernel, out) = (&case.kernel, &mut case.got);
    out.fill(f32::NAN);
    with_pool(&case.pool, || kernel.run(isa, m, out));
}

/// Runs the case natively (for instruction sets this CPU has: checks the harness itself).
///
/// # Safety
/// As [`emu_run`].
#[no_mangle]
pub unsafe extern "C" fn emu_run_native(case: *mut Case) -> bool {
    if !(*case).isa.is_available() {
        return false;
    }
    emu_run(case);
    true
}

/// Writes the case's name and verdict (a NUL-terminated line) to `msg`; true when the result
/// matches the portable path within rounding of the float sums and, for the interleaved
/// kernels, the native AVX2 path bit for bit.
///
/// # Safety
/// `case` as in [`emu_run`]; `msg` points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn emu_check(case: *const Case, msg: *mut u8, len: usize) -> bool {
    let case = &*case;
    let scale = case.want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-3);
    let worst = case
        .got
        .iter()
        .zip(&case.want)
        .map(|(g, w)| {
            if g.is_nan() {
                f32::INFINITY
            } else {
                (g - w).abs()
            }
        })
        .fold(0f32, f32::max);
    let close = worst <= 1e-5 * scale;
    let same_bits = case.bits.as_ref().is_none_or(|bits| {
        bits.iter()
            .zip(&case.got)
            .all(|(b, g)| b.to_bits() == g.to_bits())
    });
    let ok = close && same_bits;
    let verdict = match (close, same_bits) {
        (true, true) => "ok",
        (true, false) => "BITS DIFFER from the native AVX2 path",
        (false, _) => "MISMATCH",
    };
    let line = format!(
        "{}: {verdict} (largest difference {worst:e}, largest value {scale:e})",
        case.name
    );
    // At most `len - 1` bytes and the terminating NUL.
    let bytes = &line.as_bytes()[..line.len().min(len.saturating_sub(1))];
    std::ptr::copy_nonoverlapping(bytes.as_ptr(), msg, bytes.len());
    if len > 0 {
        *msg.add(bytes.len()) = 0;
    }
    ok
}

/// Frees a case.
///
/// # Safety
/// `case` comes from [`emu_prepare`] and is not used again.
#[no_mangle]
pub unsafe extern "C" fn emu_free(case: *mut Case) {
    drop(Box::from_raw(case));
}

/// This thread's FS base (its thread-local storage), for the emulated CPU.
#[no_mangle]
pub extern "C" fn emu_fs_base() -> u64 {
    let base: u64;
    // SAFETY: on x86-64 Linux `fs:0` holds the thread control block's own address.
    unsafe { std::arch::asm!("mov {}, fs:0", out(reg) base) };
    base
}
