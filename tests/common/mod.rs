//! Shared helpers for integration tests: locating the fetched real models, running our decoder
//! step by step, and comparing greedy decoding against a reference implementation.
#![allow(dead_code)]

pub mod heads;
pub mod mock_worker;
pub mod oracle;
pub mod runtime;
pub mod server;

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use tokenrouter::model::runner::{logits_row, step, Sequence};
use tokenrouter::model::sampler::argmax;
use tokenrouter::model::{KvCache, KvDtype, LoadedModel, MatmulBackend, Model};
use tokenrouter::scheduler::BlockPool;

/// Real quantized models: activations are re-quantized to 8 bits before every matmul, so two
/// evaluations that differ only in float summation order land on different rounding of the
/// activations. The reference itself differs by ~0.5 in the logits between evaluating 40
/// tokens at once and one by one; a greedy divergence is accepted only where the top two
/// logits are closer than this.
pub const QUANT_TIE_TOLERANCE: f32 = 0.5;
/// Largest per-step logit difference accepted for quantized real models (logits are O(10–30)).
pub const QUANT_MAX_LOGIT_DIFF: f32 = 3.0;
/// Float evaluation (weights dequantized): only summation order differs.
pub const EXACT_TOLERANCE: f32 = 1e-3;

pub const QWEN_05B: &str = "Qwen2.5-Coder-0.5B-Instruct.gguf";
pub const QWEN_15B: &str = "Qwen2.5-Coder-1.5B-Instruct.gguf";
pub const SMOLLM2: &str = "SmolLM2-135M-Instruct-Q4_1.gguf";

/// Path of a fetched real model; fails the test with the fix if it is missing.
/// The KV cache type of our side of a comparison: `f32` when every weight is dequantized
/// (`CANDLE_DEQUANTIZE_ALL`, where logits must agree to float precision), else the default
/// (`f16`), as served.
pub fn kv_dtype() -> KvDtype {
    match std::env::var("CANDLE_DEQUANTIZE_ALL") {
        Ok(v) if !v.is_empty() && v != "0" => KvDtype::F32,
        _ => KvDtype::default(),
    }
}

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

/// The quantized kernels of our side of a comparison: candle's when every weight is
/// dequantized (`CANDLE_DEQUANTIZE_ALL`, which only candle's kernels honour), else ours.
pub fn matmul_backend() -> MatmulBackend {
    match kv_dtype() {
        KvDtype::F32 => MatmulBackend::Candle,
        _ => MatmulBackend::Native,
    }
}

pub fn load(path: &std::path::Path) -> LoadedModel {
    LoadedModel::load_with(path, &Device::Cpu, matmul_backend())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// Our decoder behind the "whole context in, next-token logits out" interface.
pub struct Ours<'a> {
    model: &'a Model,
    kv: KvCache,
    pool: BlockPool,
    seq: Sequence,
}

impl<'a> Ours<'a> {
    pub fn new(model: &'a Model, capacity: usize) -> Self {
        Self::with_kv_dtype(model, capacity, kv_dtype())
    }

    pub fn with_kv_dtype(model: &'a Model, capacity: usize, dtype: KvDtype) -> Self {
        let kv = KvCache::with_capacity(model.config(), 16, capacity, dtype).unwrap();
        Self {
            model,
            pool: BlockPool::new(kv.num_blocks()),
            kv,
            seq: Sequence::new(Vec::new()),
        }
    }

    pub fn next_logits(&mut self, context: &[u32]) -> Vec<f32> {
        assert!(context.starts_with(&self.seq.tokens));
        self.seq.tokens = context.to_vec();
        let out = step(
            self.model,
            &mut self.kv,
            &self.pool,
            &mut [&mut self.seq],
            false,
        )
        .unwrap();
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
        let input = Tensor::new(new, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
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
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
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
    println!(
        "{label}: max |logit diff| overall {max_abs_diff:.5}, {divergences} near-tie divergences"
    );
    Comparison {
        tokens: context[prompt.len()..].to_vec(),
        max_abs_diff,
        divergences,
    }
}

/// Greedy tokens and per-step logits of each prompt, run together. Prompt `i` joins the batch
/// at step `join[i]` and then decodes `steps` tokens.
pub fn greedy_together(
    model: &Model,
    prompts: &[Vec<u32>],
    join: &[usize],
    steps: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let capacity: usize = prompts.iter().map(|p| p.len() + steps + 16).sum();
    let mut kv = KvCache::with_capacity(model.config(), 16, capacity, kv_dtype()).unwrap();
    let pool = BlockPool::new(kv.num_blocks());
    let mut seqs: Vec<Sequence> = prompts.iter().map(|p| Sequence::new(p.clone())).collect();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut tick = 0;
    while logits.iter().any(|l| l.len() < steps) {
        let active: Vec<usize> = (0..prompts.len())
            .filter(|&i| join[i] <= tick && logits[i].len() < steps)
            .collect();
        tick += 1;
        if active.is_empty() {
            continue;
        }
        let mut batch: Vec<&mut Sequence> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| active.contains(i))
            .map(|(_, s)| s)
            .collect();
        let out = step(model, &mut kv, &pool, &mut batch, false).unwrap();
        for (row, &i) in active.iter().enumerate() {
            let l = logits_row(&out.logits, row).unwrap();
            seqs[i].tokens.push(argmax(&l));
            logits[i].push(l);
        }
    }
    seqs.iter()
        .zip(logits)
        .map(|(s, l)| (s.output().to_vec(), l))
        .collect()
}

/// Compares batched against alone; a divergence is accepted only at a near-tie, after which
/// the two runs continue from different contexts and are not compared further.
pub fn check_batch_invariance(
    model: &Model,
    prompts: &[Vec<u32>],
    steps: usize,
    tie_tolerance: f32,
) -> f32 {
    let join: Vec<usize> = (0..prompts.len()).map(|i| i * 2).collect();
    let together = greedy_together(model, prompts, &join, steps);
    let mut max_diff = 0f32;
    for (i, prompt) in prompts.iter().enumerate() {
        let (alone_tokens, alone_logits) =
            greedy_together(model, std::slice::from_ref(prompt), &[0], steps).remove(0);
        let (tokens, logits) = &together[i];
        for s in 0..steps {
            let d = alone_logits[s]
                .iter()
                .zip(&logits[s])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            max_diff = max_diff.max(d);
            if alone_tokens[s] != tokens[s] {
                let gap = top2_gap(&alone_logits[s]);
                assert!(
                    gap < tie_tolerance,
                    "sequence {i} step {s}: batched token {} differs from alone {} at top-2 gap {gap}",
                    tokens[s],
                    alone_tokens[s]
                );
                println!("sequence {i}: near-tie at step {s} (gap {gap:.5}); stopping the comparison there");
                break;
            }
        }
    }
    println!("max |logit diff| batched vs alone: {max_diff:.6}");
    max_diff
}

/// A model behind the "whole context in, next-token logits out" interface.
pub type LogitsFn = Box<dyn FnMut(&[u32]) -> Vec<f32>>;
/// candle-transformers' `forward(input [1, n], index_pos)`.
pub type CandleForward = Box<dyn FnMut(&Tensor, usize) -> candle_core::Result<Tensor>>;
/// Makes a fresh reference model.
pub type ReferenceFactory<'a> = dyn FnMut() -> LogitsFn + 'a;

/// Greedy decoding of `steps` tokens after each chat prompt, ours against a fresh reference.
pub fn check_against_reference(
    name: &str,
    prompts: &[&str],
    steps: usize,
    tie_tolerance: f32,
    max_logit_diff: f32,
    make_reference: &mut ReferenceFactory,
) {
    let lm = load(&real_model(name));
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = lm
            .encode_chat(&[tokenrouter::model::ChatMessage::new("user", prompt)])
            .unwrap();
        let mut ours = Ours::new(&lm.model, ids.len() + steps + 16);
        let mut reference = make_reference();
        let label = format!("{name} prompt {i}");
        let cmp = compare_greedy(
            &label,
            &ids,
            steps,
            tie_tolerance,
            |c| ours.next_logits(c),
            |c| reference(c),
        );
        assert!(
            cmp.max_abs_diff < max_logit_diff,
            "{label}: max logit difference {} exceeds {max_logit_diff}",
            cmp.max_abs_diff
        );
        println!("{label}: {:?}", lm.decode(&cmp.tokens).unwrap());
    }
}

/// candle-transformers' GGUF model for the fetched real model `name`.
pub fn candle_reference(name: &str) -> LogitsFn {
    candle_gguf_model(&real_model(name))
}

/// candle-transformers' own GGUF implementation of the architecture in `path`.
pub fn candle_gguf_model(path: &std::path::Path) -> LogitsFn {
    use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
    let mut file = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let arch = ct.metadata["general.architecture"]
        .to_string()
        .unwrap()
        .clone();
    let dev = Device::Cpu;
    let forward: CandleForward = match arch.as_str() {
        "qwen2" => {
            let mut m = quantized_qwen2::ModelWeights::from_gguf(ct, &mut file, &dev).unwrap();
            Box::new(move |x, p| m.forward(x, p))
        }
        "llama" => {
            let mut m = quantized_llama::ModelWeights::from_gguf(ct, &mut file, &dev).unwrap();
            Box::new(move |x, p| m.forward(x, p))
        }
        "qwen3" => {
            let mut m = quantized_qwen3::ModelWeights::from_gguf(ct, &mut file, &dev).unwrap();
            Box::new(move |x, p| m.forward(x, p))
        }
        other => panic!("no reference for {other}"),
    };
    let mut r = Reference::new(forward);
    Box::new(move |ctx| r.next_logits(ctx))
}

pub const PROMPTS: &[&str] = &[
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences what a hash map is.",
    "List three colours of the rainbow.",
];
