//! Hot loops on plain slices: paged attention, rotary embedding, quantized matmul and the
//! per-batch routing features (softmax entropy).
//!
//! Kernels know nothing of models, requests or tensors: they take slices, shapes and block
//! tables, and write into caller-owned outputs. Each one has a scalar reference in its tests.

pub mod attention;
pub mod parallel;
pub mod qmatmul;
pub mod rope;
pub mod routing_features;

pub use attention::{paged_attention, AttentionSeq, PagedKv};
pub use rope::{RopeStyle, RotaryAngles};

/// Dot product with eight independent accumulators, so the loop vectorises.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `acc += w * x`, element-wise.
#[inline]
pub(crate) fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}
