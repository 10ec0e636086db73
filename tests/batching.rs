//! Batched decoding must give each sequence exactly the tokens it gets alone: sequences of
//! different lengths, joining the batch at different steps (so prefills, and decodes share
//! forward passes), on a tiny random model and on the real Qwen2.5 0.5B (quantized, as shipped).

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use common::*;
use tokenrouter::model::tiny::{write_gguf, TinySpec};
use tokenrouter::model::{Architecture, LoadedModel};

#[test]
fn tiny_model_batched_decoding_matches_each_sequence_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let spec = TinySpec::new(Architecture::Qwen2);
    write_gguf(
        &spec,
        &path,
        &[GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q5_0],
    )
    .unwrap();
    let lm = LoadedModel::load(&path, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = [5usize, 17, 40, 1]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n as u32)
                .map(|i| (i * 7 + k as u32 * 13) % 250)
                .collect()
        })
        .collect();
    let diff = check_batch_invariance(&lm.model, &prompts, 12, 1e-3);
    assert!(diff < 1e-3, "logits moved by {diff} when batched");
}

#[test]
fn qwen2_05b_batched_decoding_matches_each_sequence_alone() {
    let lm = load(&real_model(QWEN_05B));
    let texts = [
        "def quicksort(arr):",
        "The capital of France is",
        "Here is a long story about a small robot who wanted to learn how to paint. Every morning it",
        "1, 2, 3,",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| lm.encode(t).unwrap()).collect();
    // Quantized weights: batching changes which matmul path runs, and activation
    // re-quantization turns last-bit differences into up to ~0.5 in the logits (the same spread
    // the reference shows between its own prefill and incremental evaluation); the dequantized
    // run in `reference_real_exact.rs` holds this to 1e-3.
    let diff = check_batch_invariance(&lm.model, &prompts, 12, QUANT_TIE_TOLERANCE);
    assert!(
        diff < QUANT_MAX_LOGIT_DIFF,
        "logits moved by {diff} when batched"
    );
}
