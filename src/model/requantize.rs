//! Quantizing a model's layer matrices again at load, to a format of fewer bits than the
//! checkpoint stores: each decode step then streams fewer bytes, at some cost in accuracy. A
//! draft model of speculative decoding loses only acceptance to it, never output quality.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::error::Result;
use super::timing::projection_of;
use super::weights::{MatmulBackend, Weight, WeightSource};

/// A format the layer matrices can be quantized to (each one our CPU kernels multiply).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
pub enum Quantize {
    #[serde(rename = "q4_0")]
    #[value(name = "q4_0")]
    Q4_0,
    #[serde(rename = "q4_1")]
    #[value(name = "q4_1")]
    Q4_1,
    #[serde(rename = "q5_0")]
    #[value(name = "q5_0")]
    Q5_0,
    #[serde(rename = "q8_0")]
    #[value(name = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_k")]
    #[value(name = "q4_k")]
    Q4K,
    #[serde(rename = "q6_k")]
    #[value(name = "q6_k")]
    Q6K,
}

impl Quantize {
    fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// The format for a matrix of `cols` columns: a K-quant's 256-wide super-blocks must
    /// divide the row, and where they do not, the 32-wide format of the next size up stands in
    /// (as llama.cpp's quantizer does).
    fn dtype_for(self, cols: usize) -> GgmlDType {
        let dtype = self.dtype();
        if cols.is_multiple_of(dtype.block_size()) {
            return dtype;
        }
        match self {
            Self::Q4K => GgmlDType::Q5_0,
            Self::Q6K => GgmlDType::Q8_0,
            _ => dtype,
        }
    }
}

/// Stored bytes of a `[rows, cols]` matrix in `dtype`.
fn bytes_of(dtype: GgmlDType, rows: usize, cols: usize) -> usize {
    rows * cols / dtype.block_size() * dtype.type_size()
}

/// `w` (a `[rows, cols]` matrix) in `to`'s format, where that stores it in fewer bytes and
/// its blocks divide a row; otherwise `w` as it is.
pub fn requantize(w: Weight, to: Quantize, rows: usize, cols: usize) -> Result<Weight> {
    let dtype = to.dtype_for(cols);
    if !cols.is_multiple_of(dtype.block_size()) || bytes_of(dtype, rows, cols) >= w.storage_bytes()
    {
        return Ok(w);
    }
    let dense = match &w {
        Weight::Quantized(q) => q.dequantize(&Device::Cpu)?,
        Weight::Dense(t) => t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
    };
    Ok(Weight::Quantized(Arc::new(quantize_rows(&dense, dtype)?)))
}

/// Quantizes a `[rows, cols]` f32 matrix, a band of rows on each core (candle's quantizer
/// runs on one thread).
fn quantize_rows(dense: &Tensor, dtype: GgmlDType) -> Result<QTensor> {
    let (rows, cols) = dense.dims2()?;
    let values: Vec<f32> = dense.flatten_all()?.to_vec1()?;
    let values = &values;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let band = rows.div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..rows)
            .step_by(band)
            .map(|start| {
                let n = band.min(rows - start);
                s.spawn(move || -> Result<Vec<u8>> {
                    let band = &values[start * cols..(start + n) * cols];
                    let band = Tensor::from_slice(band, (n, cols), &Device::Cpu)?;
                    let q = QTensor::quantize(&band, dtype)?;
                    Ok(q.data()?.into_owned())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a quantizing thread panicked"))
            .collect()
    });
    let mut bytes = Vec::with_capacity(bytes_of(dtype, rows, cols));
    for part in parts {
        bytes.extend_from_slice(&part?);
    }
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes),
        &Device::Cpu,
        dtype,
    )?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

/// A [`WeightSource`] whose layer matrices (the projections of every decoder layer; not the
/// embedding or the LM head, where 4-bit rounding costs the most) come quantized to `to`.
pub struct Requantized<'a> {
    pub inner: &'a mut dyn WeightSource,
    pub to: Option<Quantize>,
}

impl WeightSource for Requantized<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let w = self.inner.matrix(name, rows, cols)?;
        match self.to {
            Some(to) if projection_of(name).is_some() => requantize(w, to, rows, cols),
            _ => Ok(w),
        }
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        self.inner.vector(name, len)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn backend(&self) -> MatmulBackend {
        self.inner.backend()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn matrix(rows: usize, cols: usize, dtype: GgmlDType) -> (Weight, Vec<f32>) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let t = Tensor::from_vec(xs.clone(), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        (Weight::Quantized(Arc::new(q)), xs)
    }

    fn dtype_of(w: &Weight) -> GgmlDType {
        match w {
            Weight::Quantized(q) => q.dtype(),
            Weight::Dense(_) => GgmlDType::F32,
        }
    }

    #[test]
    fn q8_0_becomes_q4_1_within_its_rounding() {
        let (rows, cols) = (40, 96);
        let (w, xs) = matrix(rows, cols, GgmlDType::Q8_0);
        let q = requantize(w, Quantize::Q4_1, rows, cols).unwrap();
        assert_eq!(dtype_of(&q), GgmlDType::Q4_1);
        assert_eq!(q.storage_bytes(), rows * cols / 32 * 20);
        let Weight::Quantized(q) = q else { panic!() };
        let back: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Q4_1 over a block spanning [-1, 1] steps by 2/15; rounding to the nearest step is
        // off by at most half of one, plus Q8_0's own rounding (1/127) and f16 scales.
        let worst = xs
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1.0 / 15.0 + 1.0 / 127.0 + 1e-3,
            "worst error {worst}"
        );
        assert!(worst > 1e-3, "nothing was rounded: {worst}");
    }

    #[test]
    fn a_k_quant_that_does_not_divide_the_row_falls_back() {
        let (w, _) = matrix(8, 96, GgmlDType::Q8_0);
        assert_eq!(
            dtype_of(&requantize(w, Quantize::Q4K, 8, 96).unwrap()),
            GgmlDType::Q5_0
        );
        let (w, _) = matrix(8, 256, GgmlDType::Q8_0);
        assert_eq!(
            dtype_of(&requantize(w, Quantize::Q4K, 8, 256).unwrap()),
            GgmlDType::Q4K
        );
    }

    #[test]
    fn a_wider_format_is_left_alone() {
        let (w, _) = matrix(8, 64, GgmlDType::Q4_0);
        let bytes = w.storage_bytes();
        let q = requantize(w, Quantize::Q8_0, 8, 64).unwrap();
        assert_eq!(dtype_of(&q), GgmlDType::Q4_0);
        assert_eq!(q.storage_bytes(), bytes);
    }

    #[test]
    fn only_layer_matrices_are_requantized() {
        struct One(Weight);
        impl WeightSource for One {
            fn matrix(&mut self, _: &str, _: usize, _: usize) -> Result<Weight> {
                Ok(match &self.0 {
                    Weight::Quantized(q) => Weight::Quantized(q.clone()),
                    Weight::Dense(t) => Weight::Dense(t.clone()),
                })
            }
            fn vector(&mut self, _: &str, _: usize) -> Result<Tensor> {
                unreachable!()
            }
            fn contains(&self, _: &str) -> bool {
                true
            }
        }
        let mut inner = One(matrix(8, 64, GgmlDType::Q8_0).0);
        let mut src = Requantized {
            inner: &mut inner,
            to: Some(Quantize::Q4_0),
        };
        let layer = src.matrix("blk.3.ffn_down.weight", 8, 64).unwrap();
        assert_eq!(dtype_of(&layer), GgmlDType::Q4_0);
        let head = src.matrix("output.weight", 8, 64).unwrap();
        assert_eq!(dtype_of(&head), GgmlDType::Q8_0);
    }
}
