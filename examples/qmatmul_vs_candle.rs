//! Our quantized matmul against candle's on the same weights, interleaved (min of 30 rounds of
//! 5 calls each), so drift on a shared machine hits both sides alike. The criterion bench
//! (`benches/qmatmul.rs`) measures each side on its own.
//!
//! `cargo run --release --example qmatmul_vs_candle [k|simple]`, `BATCH=16` for one batch size.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tokenrouter::kernels::qmatmul::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0, Isa, QuantMatrix, WeightBlock,
};

fn compare<B: WeightBlock>(dtype: GgmlDType, rows: usize, cols: usize, batches: &[usize]) {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (rows, cols), &dev).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let ours = QuantMatrix::<B>::from_bytes(rows, cols, &q.data().unwrap()).unwrap();
    let candle = QMatMul::from_qtensor(q).unwrap();
    let gb = ours.storage_bytes() as f64 / 1e9;
    for &batch in batches {
        let x = Tensor::randn(0f32, 1.0, (batch, cols), &dev).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut out = vec![0f32; batch * rows];
        let isas: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|&isa| isa != Isa::Scalar)
            .collect();
        let mut best_ours = vec![f64::MAX; isas.len()];
        let mut best_candle = f64::MAX;
        for _ in 0..30 {
            for (isa, best) in isas.iter().zip(best_ours.iter_mut()) {
                let t = Instant::now();
                for _ in 0..5 {
                    ours.matmul_with(*isa, &xs, &mut out);
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
        for (isa, best) in isas.iter().zip(&best_ours) {
            line += &format!(
                "  ours {isa:?} {:>6.0} µs ({:>4.1} GB/s, {:.2}x candle)",
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

fn main() {
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
    if which.is_empty() || which == "simple" {
        // The 0.5B model's FFN up-projection.
        compare::<BlockQ4_0>(GgmlDType::Q4_0, 4864, 896, &batches);
        compare::<BlockQ4_1>(GgmlDType::Q4_1, 4864, 896, &batches);
        compare::<BlockQ5_0>(GgmlDType::Q5_0, 4864, 896, &batches);
        compare::<BlockQ8_0>(GgmlDType::Q8_0, 4864, 896, &batches);
    }
}
