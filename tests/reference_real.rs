//! The real shipped models, quantized as shipped, against candle-transformers' own GGUF
//! implementations (`quantized_qwen2`, `quantized_llama`): greedy decoding of 32 tokens on three
//! prompts must agree token for token except at near-ties, and the largest logit difference of
//! every step is printed. `reference_real_exact.rs` runs the same comparison dequantized, where
//! the difference must be below 1e-3.

mod common;

use common::*;

#[test]
fn qwen2_05b_matches_candle_transformers_quantized_qwen2() {
    check_against_reference(
        QWEN_05B,
        PROMPTS,
        32,
        QUANT_TIE_TOLERANCE,
        QUANT_MAX_LOGIT_DIFF,
        &mut || candle_reference(QWEN_05B),
    );
}

#[test]
fn smollm2_matches_candle_transformers_quantized_llama() {
    check_against_reference(
        SMOLLM2,
        PROMPTS,
        32,
        QUANT_TIE_TOLERANCE,
        QUANT_MAX_LOGIT_DIFF,
        &mut || candle_reference(SMOLLM2),
    );
}
