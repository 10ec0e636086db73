//! Our quantized matmul against candle's on the same weights, interleaved (min of 30 rounds of
//! 5 calls each), so drift on a shared machine hits both sides alike. The criterion bench
//! (`benches/qmatmul.rs`) measures each side on its own.
//!
//! `cargo run --release --example qmatmul_vs_candle [k|simple|big|stream|cached]`, `BATCH=16`
//! for one batch size. `stream` measures one activation row against enough copies of each
//! matrix to overflow every cache (as a decode step streams its weights), each round paired
//! with a plain read of as many bytes: the kernels' share of the memory bandwidth. `cached`
//! runs one row against one matrix that stays in the caches (best of 7 rounds of 2000 calls):
//! the kernel's own rate, with `THREADS=1` one core's. `FORMAT=Q4_K` picks one
//! format for either.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tokenrouter::kernels::large_buf::LargeBuf;
use tokenrouter::kernels::parallel::for_each_range;
use tokenrouter::kernels::qmatmul::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0, Isa, QuantKernel, QuantMatrix,
    WeightBlock,
};
use tokenrouter::model::{packed_kernel, OwnKernel};

/// One of our kernels on one weight matrix: `out = x · Wᵀ`.
type Kernel<'a> = Box<dyn Fn(&[f32], &mut [f32]) + 'a>;

fn compare<B: WeightBlock>(dtype: GgmlDType, rows: usize, cols: usize, batches: &[usize]) {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (rows, cols), &dev).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let bytes = q.data().unwrap().to_vec();
    let ours = QuantMatrix::<B>::from_bytes(rows, cols, &bytes).unwrap();
    // The eight-row interleaved K-quant kernels, on their own repacked copy.
    let packed = packed_kernel(dtype, rows, cols, &bytes);
    let candle = QMatMul::from_qtensor(q).unwrap();
    let gb = ours.storage_bytes() as f64 / 1e9;
    let mut contenders: Vec<(String, Kernel)> = Isa::available()
        .into_iter()
        .filter(|&isa| isa != Isa::Scalar)
        .map(|isa| {
            let ours = &ours;
            let run: Kernel = Box::new(move |x, out| ours.matmul_with(isa, x, out));
            (format!("ours {isa:?}"), run)
        })
        .collect();
    if let Some(p) = &packed {
        contenders.push(("ours x8".into(), Box::new(|x, out| p.matmul(x, out))));
    }
    for &batch in batches {
        let x = Tensor::randn(0f32, 1.0, (batch, cols), &dev).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut out = vec![0f32; batch * rows];
        let mut best_ours = vec![f64::MAX; contenders.len()];
        let mut best_candle = f64::MAX;
        for _ in 0..30 {
            for ((_, run), best) in contenders.iter().zip(best_ours.iter_mut()) {
                let t = Instant::now();
                for _ in 0..5 {
                    run(&xs, &mut out);
                }
                *best = best.min(t.elapsed().as_secs_f64() / 5.0);
            }
            let t = Instant::now();
            for _ in 0..5 {
                candle.forward(&x).unwrap();
            }
            best_candle = best_candle.min(t.elapsed().as_secs_f64() / 5.0);
        }
        let mut line = format!("{} {rows}x{cols} batch {batch:>2}:", B::NAME);
        for ((name, _), best) in contenders.iter().zip(&best_ours) {
            line += &format!(
                "  {name} {:>6.0} µs ({:>4.1} GB/s, {:.2}x candle)",
                best * 1e6,
                gb / best,
                best_candle / best
            );
        }
        line += &format!(
            "  candle {:>6.0} µs ({:>4.1} GB/s)",
            best_candle * 1e6,
            gb / best_candle
        );
        println!("{line}");
    }
}

/// One row through copies of a `[rows, cols]` matrix worth ~600 MB, against a plain read of as
/// many bytes; the median of 15 paired rounds. Skipped unless `FORMAT` (when set) names the format.
/// Whether `FORMAT` (when set) names `B`.
fn wanted<B: WeightBlock>() -> bool {
    !std::env::var("FORMAT").is_ok_and(|f| f != B::NAME)
}

/// A random `rows × cols` matrix quantized to `dtype`, as ggml's bytes.
fn quantized_bytes(dtype: GgmlDType, rows: usize, cols: usize) -> Vec<u8> {
    let w = Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype)
        .unwrap()
        .data()
        .unwrap()
        .to_vec()
}

/// Our kernel for `bytes`, as a model loads it (repacked where the format has an interleaved
/// layout).
fn own_kernel<B: WeightBlock>(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Box<dyn OwnKernel> {
    packed_kernel(dtype, rows, cols, bytes)
        .unwrap_or_else(|| Box::new(QuantMatrix::<B>::from_bytes(rows, cols, bytes).unwrap()))
}

fn stream<B: WeightBlock>(dtype: GgmlDType, rows: usize, cols: usize) {
    if !wanted::<B>() {
        return;
    }
    let bytes = quantized_bytes(dtype, rows, cols);
    let copies = (600 << 20) / bytes.len();
    let kernels: Vec<_> = (0..copies)
        .map(|_| own_kernel::<B>(dtype, rows, cols, &bytes))
        .collect();
    let gb = (bytes.len() * copies) as f64 / 1e9;
    // On huge pages where the OS offers them, as the repacked weights are.
    let words = LargeBuf::from_fn(bytes.len() * copies / 8, |i| i as u64);
    let chunk = 1 << 14;
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0f32; rows];
    // Paired rounds (ours, then a plain read of as many bytes): the median of their ratios
    // cancels the drift of a shared machine's bandwidth, which moves over seconds.
    let mut rounds = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        for k in &kernels {
            k.matmul(&x, &mut out);
        }
        let ours = gb / t.elapsed().as_secs_f64();
        let total = AtomicU64::new(0);
        let t = Instant::now();
        for_each_range(words.len() / chunk, |c| {
            let part = words[c.start * chunk..c.end * chunk]
                .iter()
                .fold(0u64, |a, &x| a.wrapping_add(x));
            total.fetch_add(part, Ordering::Relaxed);
        });
        let plain = (words.len() / chunk * chunk * 8) as f64 / 1e9 / t.elapsed().as_secs_f64();
        std::hint::black_box(total.load(Ordering::Relaxed));
        rounds.push((ours / plain, ours, plain));
    }
    rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (ratio, ours, plain) = rounds[rounds.len() / 2];
    println!(
        "{} {rows}x{cols} one row, from memory: {ours:.1} GB/s, plain read {plain:.1} GB/s ({:.0} %, median of {} paired rounds)",
        B::NAME,
        100.0 * ratio,
        rounds.len()
    );
}

/// One activation row against one matrix that stays in the caches: the kernel's own rate,
/// with no memory stream to wait for.
fn cached<B: WeightBlock>(dtype: GgmlDType, rows: usize, cols: usize) {
    if !wanted::<B>() {
        return;
    }
    let bytes = quantized_bytes(dtype, rows, cols);
    let kernel = own_kernel::<B>(dtype, rows, cols, &bytes);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0f32; rows];
    let calls = 2000;
    let mut best = 0f64;
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..calls {
            kernel.matmul(&x, &mut out);
        }
        best = best.max((bytes.len() * calls) as f64 / 1e9 / t.elapsed().as_secs_f64());
    }
    println!(
        "{} {rows}x{cols} one row, in cache: {best:.1} GB/s ({:.2} us a call)",
        B::NAME,
        bytes.len() as f64 / best / 1e3
    );
}

fn main() {
    if let Ok(n) = std::env::var("THREADS") {
        let n = n.parse().expect("THREADS is a number");
        tokenrouter::kernels::parallel::limit_cores(n).unwrap();
    }
    let which = std::env::args().nth(1).unwrap_or_default();
    let batches: Vec<usize> = match std::env::var("BATCH") {
        Ok(b) => vec![b.parse().expect("BATCH is a number")],
        Err(_) => vec![1, 4, 8, 12, 16],
    };
    if which.is_empty() || which == "k" {
        // The 1.5B model's FFN up-projection.
        compare::<BlockQ4K>(GgmlDType::Q4K, 8960, 1536, &batches);
        compare::<BlockQ6K>(GgmlDType::Q6K, 8960, 1536, &batches);
        // Its down-projection: long rows, activations no longer fit in L1.
        compare::<BlockQ4K>(GgmlDType::Q4K, 1536, 8960, &batches);
        compare::<BlockQ6K>(GgmlDType::Q6K, 1536, 8960, &batches);
    }
    if which == "big" {
        // The 1.5B model's output projection (191 MB of Q6_K, far beyond any cache): what a
        // decode step's weight streaming sees.
        compare::<BlockQ6K>(GgmlDType::Q6K, 151936, 1536, &batches);
        compare::<BlockQ4K>(GgmlDType::Q4K, 151936, 1536, &batches);
    }
    if which == "stream" {
        // The 1.5B model's FFN matrices, the 0.5B's and its output projection.
        stream::<BlockQ4K>(GgmlDType::Q4K, 8960, 1536);
        stream::<BlockQ6K>(GgmlDType::Q6K, 8960, 1536);
        stream::<BlockQ4K>(GgmlDType::Q4K, 1536, 8960);
        stream::<BlockQ6K>(GgmlDType::Q6K, 1536, 8960);
        // Its attention matrices: q/k/v together, and o.
        stream::<BlockQ4K>(GgmlDType::Q4K, 2048, 1536);
        stream::<BlockQ4K>(GgmlDType::Q4K, 1536, 1536);
        stream::<BlockQ5_0>(GgmlDType::Q5_0, 4864, 896);
        // The 0.5B's q/k together, and o.
        stream::<BlockQ5_0>(GgmlDType::Q5_0, 1024, 896);
        stream::<BlockQ5_0>(GgmlDType::Q5_0, 896, 896);
        stream::<BlockQ8_0>(GgmlDType::Q8_0, 4864, 896);
        stream::<BlockQ8_0>(GgmlDType::Q8_0, 151936, 896);
        stream::<BlockQ4_1>(GgmlDType::Q4_1, 1536, 576);
        // SmolLM2's other layer matrices: o, q/k/v together, gate/up together, down.
        stream::<BlockQ4_1>(GgmlDType::Q4_1, 576, 576);
        stream::<BlockQ4_1>(GgmlDType::Q4_1, 960, 576);
        stream::<BlockQ4_1>(GgmlDType::Q4_1, 3072, 576);
        stream::<BlockQ4_1>(GgmlDType::Q4_1, 576, 1536);
    }
    if which == "cached" {
        cached::<BlockQ5_0>(GgmlDType::Q5_0, 1024, 896);
        cached::<BlockQ8_0>(GgmlDType::Q8_0, 1024, 896);
        cached::<BlockQ4_1>(GgmlDType::Q4_1, 1024, 896);
        cached::<BlockQ4K>(GgmlDType::Q4K, 1024, 1536);
        // The 1.5B's q/k/v.
        cached::<BlockQ4K>(GgmlDType::Q4K, 2048, 1536);
        cached::<BlockQ6K>(GgmlDType::Q6K, 1024, 1536);
    }
    if which.is_empty() || which == "simple" {
        // The 0.5B model's FFN up-projection.
        compare::<BlockQ4_0>(GgmlDType::Q4_0, 4864, 896, &batches);
        compare::<BlockQ4_1>(GgmlDType::Q4_1, 4864, 896, &batches);
        compare::<BlockQ5_0>(GgmlDType::Q5_0, 4864, 896, &batches);
        compare::<BlockQ8_0>(GgmlDType::Q8_0, 4864, 896, &batches);
    }
}
