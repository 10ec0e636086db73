//! Driving the decoder outside the actor runtime: per-sequence state ([`Sequence`]) and one
//! batched step over many sequences ([`step`]), for profiling, scoring and tests; how a
//! request ends ([`FinishReason`]). Blocks come from the one allocator, `scheduler::BlockPool`,
//! as in serving.

use candle_core::{DType, Storage, Tensor};

use super::batch::SeqInput;
use super::decoder::{ForwardOutput, Model};
use super::error::{ModelError, Result};
use super::kv_cache::{KvCache, KvDtype};
use crate::scheduler::{BlockPool, Blocks};

/// A sequence's tokens, how many of them the KV cache already holds, and its blocks (returned
/// to their pool when the sequence is dropped).
#[derive(Debug)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens `..computed` have their K/V in the cache.
    pub computed: usize,
    pub blocks: Blocks,
}

impl Sequence {
    pub fn new(prompt: Vec<u32>) -> Self {
        Self {
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: Blocks::default(),
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Returns the sequence's blocks to their pool.
    pub fn release(&mut self) {
        self.blocks.clear();
        self.computed = 0;
    }
}

/// One forward pass over every sequence's not-yet-computed tokens (prefill, extend or decode),
/// growing their blocks from `pool` (which allocates `kv`'s blocks) first. Every sequence gets
/// logits: row `i` belongs to `seqs[i]`.
pub fn step(
    model: &Model,
    kv: &mut KvCache,
    pool: &BlockPool,
    seqs: &mut [&mut Sequence],
    want_hidden: bool,
) -> Result<ForwardOutput> {
    for s in seqs.iter_mut() {
        if s.computed >= s.tokens.len() {
            return Err(ModelError::InvalidBatch(
                "a sequence has no new tokens".into(),
            ));
        }
        pool.grow(&mut s.blocks, s.tokens.len().div_ceil(kv.block_size()))?;
    }
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .map(|s| SeqInput {
            tokens: &s.tokens[s.computed..],
            start_pos: s.computed,
            blocks: s.blocks.ids(),
            logits: 1,
        })
        .collect();
    let out = model.forward(&inputs, kv, want_hidden)?;
    for s in seqs.iter_mut() {
        s.computed = s.tokens.len();
    }
    Ok(out)
}

/// Logits and hidden states at every position of `tokens`, from a fresh cache (the whole
/// text in one pass): what position `t` predicts for position `t + 1`.
pub fn score_text(model: &Model, tokens: &[u32]) -> Result<ForwardOutput> {
    let mut kv = model.kv_cache_for(16, tokens.len(), KvDtype::default())?;
    // The cache holds this text alone: its blocks in order.
    let blocks: Vec<u32> = (0..kv.num_blocks() as u32).collect();
    let input = SeqInput {
        tokens,
        start_pos: 0,
        blocks: &blocks,
        logits: 1,
    };
    model.forward_all_positions(&[input], &mut kv)
}

/// Logits row `i` as a `Vec<f32>`.
pub fn logits_row(logits: &Tensor, i: usize) -> Result<Vec<f32>> {
    Ok(logits.get(i)?.to_vec1::<f32>()?)
}

/// `f` of the values of `t` (any shape, row-major) as one `f32` slice: borrowed in place from
/// a contiguous `f32` tensor in memory (a step's logits, 0.6 MB a row for a 152k vocabulary, are
/// read where the LM head wrote them), else a copy.
pub fn with_f32_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            if let Ok(values) = cpu.as_slice::<f32>() {
                return Ok(f(&values[start..end]));
            }
        }
    }
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(f(&values))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// An end-of-sequence token was produced.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    /// Why a request ends with `token`, its `generated`-th output token, or `None` when it
    /// goes on: the stop rule of every model and of the request itself.
    pub fn after(
        token: u32,
        generated: usize,
        stop_ids: &[u32],
        max_tokens: usize,
    ) -> Option<Self> {
        if stop_ids.contains(&token) {
            Some(Self::Stop)
        } else if generated >= max_tokens {
            Some(Self::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::with_f32_values;

    #[test]
    fn f32_values_come_row_major_in_place_or_copied() {
        let values: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let t = Tensor::from_vec(values.clone(), (2, 3), &Device::Cpu).unwrap();
        // In place: the slice is the tensor's own storage.
        let (storage, _) = t.storage_and_layout();
        let own = match &*storage {
            candle_core::Storage::Cpu(cpu) => cpu.as_slice::<f32>().unwrap().as_ptr(),
            _ => unreachable!("a CPU tensor"),
        };
        drop(storage);
        let seen = with_f32_values(&t, |v| (v.as_ptr(), v.to_vec())).unwrap();
        assert_eq!(seen, (own, values.clone()));
        // A row of it: its own range of the storage.
        let row = t.get(1).unwrap();
        assert_eq!(
            with_f32_values(&row, |v| v.to_vec()).unwrap(),
            [3.0, 4.0, 5.0]
        );
        // Not contiguous, or not f32: copied, row-major.
        let tt = t.t().unwrap();
        assert_eq!(
            with_f32_values(&tt, |v| v.to_vec()).unwrap(),
            [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        let half = t.to_dtype(DType::F16).unwrap();
        assert_eq!(with_f32_values(&half, |v| v.to_vec()).unwrap(), values);
    }
}
