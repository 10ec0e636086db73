//! The real models with every weight dequantized to f32 (candle's `CANDLE_DEQUANTIZE_ALL`),
//! for ours and for the reference alike. With no 8-bit activation rounding in the way, the two
//! implementations differ only in float summation order: greedy tokens must be identical and
//! logits within 1e-3 at every step, and batching must not move the logits either.
//!
//! Every test here sets the variable before loading anything; they live in their own test
//! binary so no quantized test shares the process.

mod common;

use common::*;

fn dequantize_all() {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
}

#[test]
fn dequantized_smollm2_matches_reference_exactly() {
    dequantize_all();
    check_against_reference(
        SMOLLM2,
        PROMPTS,
        32,
        EXACT_TOLERANCE,
        EXACT_TOLERANCE,
        &mut || candle_reference(SMOLLM2),
    );
}

#[test]
fn dequantized_qwen2_05b_matches_reference_exactly() {
    dequantize_all();
    check_against_reference(
        QWEN_05B,
        &PROMPTS[..1],
        32,
        EXACT_TOLERANCE,
        EXACT_TOLERANCE,
        &mut || candle_reference(QWEN_05B),
    );
}

#[test]
fn dequantized_batched_decoding_matches_alone_exactly() {
    dequantize_all();
    let lm = load(&real_model(SMOLLM2));
    let texts = [
        "def quicksort(arr):",
        "The capital of France is",
        "Once upon a time, a small robot",
        "1, 2, 3,",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| lm.encode(t).unwrap()).collect();
    let diff = check_batch_invariance(&lm.model, &prompts, 12, EXACT_TOLERANCE);
    assert!(
        diff < EXACT_TOLERANCE,
        "logits moved by {diff} when batched"
    );
}
