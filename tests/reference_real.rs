//! The real shipped models against candle-transformers' own GGUF implementations
//! (`quantized_qwen2`, `quantized_llama`): greedy decoding must agree token for token, except at
//! near-ties, and the largest logit difference per step is printed.

mod common;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use candle_transformers::models::{quantized_llama, quantized_qwen2};
use common::*;
use tokenrouter::model::ChatMessage;

const STEPS: usize = 32;
/// Top-2 logit gap below which float summation order may legitimately flip the argmax.
const TIE_TOLERANCE: f32 = 0.05;
/// Largest logit difference accepted at any step (logits are O(10)).
const MAX_LOGIT_DIFF: f32 = 0.1;

const PROMPTS: &[&str] = &[
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences what a hash map is.",
    "List three colours of the rainbow.",
];

fn read_content(path: &std::path::Path) -> (gguf_file::Content, std::fs::File) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    (content, file)
}

fn check_model(name: &str, reference_forward: &mut dyn FnMut(usize) -> Box<dyn FnMut(&[u32]) -> Vec<f32>>) {
    let path = real_model(name);
    let lm = load(&path);
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let ids = lm.encode_chat(&[ChatMessage::new("user", prompt)]).unwrap();
        let mut ours = Ours::new(&lm.model, ids.len() + STEPS + 16);
        let mut reference = reference_forward(i);
        let cmp = compare_greedy(
            &format!("{name} prompt {i}"),
            &ids,
            STEPS,
            TIE_TOLERANCE,
            |ctx| ours.next_logits(ctx),
            |ctx| reference(ctx),
        );
        assert!(
            cmp.max_abs_diff < MAX_LOGIT_DIFF,
            "{name} prompt {i}: max logit difference {} exceeds {MAX_LOGIT_DIFF}",
            cmp.max_abs_diff
        );
        println!("{name} prompt {i}: {:?}", lm.decode(&cmp.tokens).unwrap());
    }
}

#[test]
fn qwen2_05b_matches_candle_transformers_quantized_qwen2() {
    let path = real_model(QWEN_05B);
    check_model(QWEN_05B, &mut |_| {
        let (content, mut file) = read_content(&path);
        let mut m = quantized_qwen2::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let mut r = Reference::new(move |x, pos| m.forward(x, pos));
        Box::new(move |ctx| r.next_logits(ctx))
    });
}

#[test]
fn smollm2_matches_candle_transformers_quantized_llama() {
    let path = real_model(SMOLLM2);
    check_model(SMOLLM2, &mut |_| {
        let (content, mut file) = read_content(&path);
        let mut m = quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let mut r = Reference::new(move |x, pos| m.forward(x, pos));
        Box::new(move |ctx| r.next_logits(ctx))
    });
}
