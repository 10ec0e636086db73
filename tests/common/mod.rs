//! Shared helpers for integration tests: locating the fetched real models, running our decoder
//! step by step, and comparing greedy decoding against a reference implementation.
#![allow(dead_code)]

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use tokenrouter::model::runner::{logits_row, step, Sequence};
use tokenrouter::model::sampler::argmax;
use tokenrouter::model::{KvCache, LoadedModel, Model};

pub const QWEN_05B: &str = "Qwen2.5-Coder-0.5B-Instruct.gguf";
pub const QWEN_15B: &str = "Qwen2.5-Coder-1.5B-Instruct.gguf";
pub const SMOLLM2: &str = "SmolLM2-135M-Instruct-Q4_1.gguf";

/// Path of a fetched real model; fails the test with the fix if it is missing.
pub fn real_model(name: &str) -> PathBuf {
    let dir = std::env::var_os("TOKENROUTER_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"));
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-models.sh first",
        path.display()
    );
    path
}

pub fn load(path: &std::path::Path) -> LoadedModel {
    LoadedModel::load(path, &Device::Cpu).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// Our decoder behind the "whole context in, next-token logits out" interface.
pub struct Ours<'a> {
    model: &'a Model,
    kv: KvCache,
    seq: Sequence,
}

impl<'a> Ours<'a> {
    pub fn new(model: &'a Model, capacity: usize) -> Self {
        Self {
            model,
            kv: KvCache::with_capacity(model.config(), 16, capacity).unwrap(),
            seq: Sequence::new(Vec::new()),
        }
    }

    pub fn next_logits(&mut self, context: &[u32]) -> Vec<f32> {
        assert!(context.starts_with(&self.seq.tokens));
        self.seq.tokens = context.to_vec();
        let out = step(self.model, &mut self.kv, &mut [&mut self.seq], false).unwrap();
        logits_row(&out.logits, 0).unwrap()
    }
}

/// A reference model with candle-transformers' `forward(input [1, n], index_pos)` interface.
pub struct Reference<F: FnMut(&Tensor, usize) -> candle_core::Result<Tensor>> {
    forward: F,
    pos: usize,
}

impl<F: FnMut(&Tensor, usize) -> candle_core::Result<Tensor>> Reference<F> {
    pub fn new(forward: F) -> Self {
        Self { forward, pos: 0 }
    }

    pub fn next_logits(&mut self, context: &[u32]) -> Vec<f32> {
        let new = &context[self.pos..];
        let input = Tensor::new(new, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let logits = (self.forward)(&input, self.pos).unwrap();
        self.pos = context.len();
        logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
}

/// Gap between the two largest logits.
pub fn top2_gap(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

pub struct Comparison {
    pub tokens: Vec<u32>,
    pub max_abs_diff: f32,
    pub divergences: usize,
}

/// Greedy decoding of `steps` tokens by both implementations in lock step, both fed the
/// reference's tokens. A step where the argmaxes differ is accepted only if the reference's top
/// two logits are closer than `tie_tolerance` (a near-tie that float summation order can flip).
pub fn compare_greedy(
    label: &str,
    prompt: &[u32],
    steps: usize,
    tie_tolerance: f32,
    mut ours: impl FnMut(&[u32]) -> Vec<f32>,
    mut reference: impl FnMut(&[u32]) -> Vec<f32>,
) -> Comparison {
    let mut context = prompt.to_vec();
    let mut max_abs_diff = 0f32;
    let mut divergences = 0;
    let mut diffs = Vec::new();
    for i in 0..steps {
        let a = ours(&context);
        let b = reference(&context);
        assert_eq!(a.len(), b.len(), "{label}: vocabulary sizes differ");
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        max_abs_diff = max_abs_diff.max(diff);
        diffs.push(format!("{diff:.4}"));
        let (ta, tb) = (argmax(&a), argmax(&b));
        if ta != tb {
            let gap = top2_gap(&b);
            assert!(
                gap < tie_tolerance,
                "{label}: step {i} picks {ta}, reference picks {tb}, but the reference's top-2 gap {gap} is not a near-tie (< {tie_tolerance})"
            );
            println!("{label}: step {i}: near-tie (top-2 gap {gap:.5}) resolved differently");
            divergences += 1;
        }
        context.push(tb);
    }
    println!("{label}: max |logit diff| per step: [{}]", diffs.join(", "));
    println!("{label}: max |logit diff| overall {max_abs_diff:.5}, {divergences} near-tie divergences");
    Comparison {
        tokens: context[prompt.len()..].to_vec(),
        max_abs_diff,
        divergences,
    }
}
