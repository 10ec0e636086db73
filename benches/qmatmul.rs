//! Quantized matmul throughput per format and batch size, in GB/s of weights read, next to
//! candle's quantized matmul on the same weights and input in the same run.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tokenrouter::kernels::qmatmul::{
    ActFormat, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8_0, QuantKernel,
    QuantMatrix, WeightBlock,
};
use tokenrouter::model::packed_kernel;

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

fn formats(c: &mut Criterion) {
    bench_format::<BlockQ4_0>(c, GgmlDType::Q4_0);
    bench_format::<BlockQ4_1>(c, GgmlDType::Q4_1);
    bench_format::<BlockQ5_0>(c, GgmlDType::Q5_0);
    bench_format::<BlockQ8_0>(c, GgmlDType::Q8_0);
    bench_format::<BlockQ4K>(c, GgmlDType::Q4K);
    bench_format::<BlockQ6K>(c, GgmlDType::Q6K);
}

criterion_group!(benches, formats);
criterion_main!(benches);
