//! Quantized matmul throughput per format and batch size, in GB/s of weights read, next to
//! candle's quantized matmul on the same weights and input in the same run; and a feed-forward
//! layer's gate/up with SiLU·gate applied in the kernel against the stacked matmul and a
//! SiLU·gate pass after it.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tokenrouter::kernels::qmatmul::{
    ActFormat, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0, QuantKernel,
    QuantMatrix, WeightBlock,
};
use tokenrouter::kernels::silu_mul_rows;
use tokenrouter::model::{gated_kernel, packed_kernel};

/// The 0.5B model's FFN up-projection shape, for the 32-value formats.
const SHAPE: (usize, usize) = (4864, 896);
/// The 1.5B model's FFN up-projection shape, for the K-quants (rows of 256-value blocks).
const SHAPE_K: (usize, usize) = (8960, 1536);

fn bench_format<B: WeightBlock>(c: &mut Criterion, dtype: GgmlDType) {
    let (rows, cols) = if B::Act::LEN > 32 { SHAPE_K } else { SHAPE };
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (rows, cols), &dev).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let bytes = q.data().unwrap().to_vec();
    let ours = QuantMatrix::<B>::from_bytes(rows, cols, &bytes).unwrap();
    // The K-quants' eight-row interleaved layout, as the model loader uses it.
    let packed = packed_kernel(dtype, rows, cols, &bytes);
    let candle = QMatMul::from_qtensor(q).unwrap();
    let mut group = c.benchmark_group(format!("qmatmul_{}", B::NAME));
    group.throughput(Throughput::Bytes(ours.storage_bytes() as u64));
    for batch in [1usize, 4, 16] {
        let x = Tensor::randn(0f32, 1.0, (batch, cols), &dev).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut out = vec![0f32; batch * rows];
        group.bench_with_input(BenchmarkId::new("ours", batch), &batch, |b, _| {
            b.iter(|| ours.matmul(&xs, &mut out))
        });
        if let Some(packed) = &packed {
            group.bench_with_input(BenchmarkId::new("ours_x8", batch), &batch, |b, _| {
                b.iter(|| packed.matmul(&xs, &mut out))
            });
        }
        group.bench_with_input(BenchmarkId::new("candle", batch), &batch, |b, _| {
            b.iter(|| candle.forward(&x).unwrap())
        });
    }
    group.finish();
}

/// Gate and up of `(rows, cols)` each in `dtype`: the fused kernel (`gated`) against the
/// stacked matrix and [`silu_mul_rows`] after (`stacked`), GB/s of both matrices' weights.
fn bench_gate_up(c: &mut Criterion, dtype: GgmlDType, name: &str, (rows, cols): (usize, usize)) {
    let dev = Device::Cpu;
    let quantized = |seed: f32| {
        let w = (Tensor::randn(0f32, 0.05, (rows, cols), &dev).unwrap() + seed as f64).unwrap();
        QTensor::quantize(&w, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec()
    };
    let (gate, up) = (quantized(0.0), quantized(0.01));
    let gated = gated_kernel(dtype, rows, cols, &gate, &up).unwrap();
    let stacked = packed_kernel(dtype, 2 * rows, cols, &[gate.clone(), up].concat()).unwrap();
    let mut group = c.benchmark_group(format!("gate_up_{name}"));
    group.throughput(Throughput::Bytes(2 * gate.len() as u64));
    for batch in [1usize, 16] {
        let xs = Tensor::randn(0f32, 1.0, (batch, cols), &dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut out = vec![0f32; batch * rows];
        group.bench_with_input(BenchmarkId::new("gated", batch), &batch, |b, _| {
            b.iter(|| gated.matmul(&xs, &mut out))
        });
        let mut both = vec![0f32; batch * 2 * rows];
        group.bench_with_input(BenchmarkId::new("stacked", batch), &batch, |b, _| {
            b.iter(|| {
                stacked.matmul(&xs, &mut both);
                silu_mul_rows(&mut out, rows, |r| {
                    let row = &both[r * 2 * rows..(r + 1) * 2 * rows];
                    (&row[..rows], &row[rows..])
                })
            })
        });
    }
    group.finish();
}

fn formats(c: &mut Criterion) {
    bench_format::<BlockQ4_0>(c, GgmlDType::Q4_0);
    bench_format::<BlockQ4_1>(c, GgmlDType::Q4_1);
    bench_format::<BlockQ5_0>(c, GgmlDType::Q5_0);
    bench_format::<BlockQ8_0>(c, GgmlDType::Q8_0);
    bench_format::<BlockQ4K>(c, GgmlDType::Q4K);
    bench_format::<BlockQ6K>(c, GgmlDType::Q6K);
    // SmolLM2's shape (Q4_1) and the 1.5B's (Q4_K).
    bench_gate_up(c, GgmlDType::Q4_1, "Q4_1", (1536, 576));
    bench_gate_up(c, GgmlDType::Q4K, "Q4_K", SHAPE_K);
}

criterion_group!(benches, formats);
criterion_main!(benches);
