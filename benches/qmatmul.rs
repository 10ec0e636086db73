//! Quantized matmul throughput per format and batch size, in GB/s of weights read, next to
//! candle's quantized matmul on the same weights and input in the same run.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tokenrouter::kernels::qmatmul::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, QuantMatrix, WeightBlock,
};

/// The 0.5B model's FFN up-projection shape.
const ROWS: usize = 4864;
const COLS: usize = 896;

fn bench_format<B: WeightBlock>(c: &mut Criterion, dtype: GgmlDType) {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (ROWS, COLS), &dev).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let ours = QuantMatrix::<B>::from_bytes(ROWS, COLS, &q.data().unwrap()).unwrap();
    let candle = QMatMul::from_qtensor(q).unwrap();
    let mut group = c.benchmark_group(format!("qmatmul_{}", B::NAME));
    group.throughput(Throughput::Bytes(ours.storage_bytes() as u64));
    for batch in [1usize, 4, 16] {
        let x = Tensor::randn(0f32, 1.0, (batch, COLS), &dev).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut out = vec![0f32; batch * ROWS];
        group.bench_with_input(BenchmarkId::new("ours", batch), &batch, |b, _| {
            b.iter(|| ours.matmul(&xs, &mut out))
        });
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
}

criterion_group!(benches, formats);
criterion_main!(benches);
