//! The CPU backend: activations are plain row-major `Vec<f32>`s in host memory, matmuls run our
//! quantized kernels (or candle's, for formats ours do not take) over the calling thread's
//! compute pool, and the KV cache is [`HostKv`].

mod layers;

use candle_core::Tensor;

use super::{Backend, Pass};
use crate::kernels::add_in_place;
use crate::kernels::attention::AttentionSeq;
use crate::kernels::rope::RotaryAngles;
use crate::model::error::{ModelError, Result};
use crate::model::kv_cache::{HostKv, KvCache, KvStore};
use crate::model::weights::{MatmulBackend, Weight};
use layers::{FusedLinear, GateUp, RmsNorm};

/// The CPU and the quantized kernels that multiply on it.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    pub matmul: MatmulBackend,
}

/// Where the embedding lookup reads its rows.
pub enum Embedding {
    /// The token-embedding matrix as loaded.
    Weight(Weight),
    /// The tied LM head's own repacked copy (the loaded matrix is dropped rather than held
    /// twice: 30 MB for SmolLM2's Q8_0 vocabulary).
    Head,
}

/// One forward pass's sequences as attention reads them, and their rotary angles.
pub struct Step<'a> {
    seqs: Vec<AttentionSeq<'a>>,
    angles: RotaryAngles,
}

impl Backend for Cpu {
    type Rows = Vec<f32>;
    type Linear = FusedLinear;
    type GateUp = GateUp;
    type Norm = RmsNorm;
    type Embedding = Embedding;
    type Kv = HostKv;
    type Step<'a> = Step<'a>;

    fn describe(&self) -> String {
        format!("cpu ({} kernels)", self.matmul.kernels())
    }

    fn linear(
        &self,
        weights: &[Weight],
        biases: &[Tensor],
        widths: &[usize],
    ) -> Result<FusedLinear> {
        FusedLinear::from_weights(weights, biases, widths, self.matmul)
    }

    fn gate_up(&self, gate: Weight, up: Weight, rows: usize, cols: usize) -> Result<GateUp> {
        GateUp::from_weights([gate, up], rows, cols, self.matmul)
    }

    fn norm(&self, weight: &Tensor, eps: f64) -> Result<RmsNorm> {
        RmsNorm::new(weight, eps)
    }

    fn embedding(&self, table: Weight, tied_head: Option<&FusedLinear>) -> Result<Embedding> {
        // A tied head with rows of its own serves the lookup too; the loaded copy is dropped.
        let head_has_rows = tied_head
            .and_then(|h| h.own_kernel())
            .is_some_and(|k| k.dequantize_row(0, &mut vec![0f32; k.in_features()]));
        Ok(match head_has_rows {
            true => Embedding::Head,
            false => Embedding::Weight(table),
        })
    }

    fn embeds_from_head(&self, embedding: &Embedding) -> bool {
        matches!(embedding, Embedding::Head)
    }

    fn kv<'c>(&self, cache: &'c mut KvCache) -> Result<&'c mut HostKv> {
        match cache.store_mut() {
            KvStore::Host(host) => Ok(host),
            #[allow(unreachable_patterns)]
            _ => Err(ModelError::InvalidBatch(
                "the KV cache is on another device than the model".into(),
            )),
        }
    }

    fn begin_step<'a>(&self, pass: &Pass<'_, 'a>) -> Result<Step<'a>> {
        let batch = pass.batch;
        let seqs: Vec<AttentionSeq> = batch
            .iter()
            .map(|s| AttentionSeq {
                blocks: s.blocks,
                start_pos: s.start_pos,
                num_tokens: s.tokens.len(),
            })
            .collect();
        let positions: Vec<u32> = batch
            .iter()
            .flat_map(|s| (s.start_pos..s.start_pos + s.tokens.len()).map(|p| p as u32))
            .collect();
        Ok(Step {
            seqs,
            angles: RotaryAngles::new(&positions, pass.inv_freq, pass.config.rope_style),
        })
    }

    fn embed(
        &self,
        e: &Embedding,
        head: &FusedLinear,
        ids: &[u32],
        _step: Option<&Step<'_>>,
    ) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let head = match e {
            Embedding::Weight(w) => {
                let ids = Tensor::from_slice(ids, ids.len(), &candle_core::Device::Cpu)?;
                let rows = w.rows(&ids)?.to_dtype(candle_core::DType::F32)?;
                return Ok(rows.flatten_all()?.to_vec1::<f32>()?);
            }
            Embedding::Head => head.own_kernel().expect("checked at load"),
        };
        let hidden = head.in_features();
        let mut out = vec![0f32; ids.len() * hidden];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(hidden)) {
            if id as usize >= head.out_features() {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: head.out_features(),
                });
            }
            head.dequantize_row(id as usize, row);
        }
        Ok(out)
    }

    fn zeros(&self, rows: usize, width: usize) -> Result<Vec<f32>> {
        Ok(vec![0f32; rows * width])
    }

    fn add_norm(
        &self,
        n: &RmsNorm,
        x: &mut Vec<f32>,
        add: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        n.add_forward(x, add.map(|a| a.as_slice()), out);
        Ok(())
    }

    fn norm_in_place(&self, n: &RmsNorm, x: &mut Vec<f32>) -> Result<()> {
        n.forward_in_place(x);
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        add_in_place(x, y);
        Ok(())
    }

    fn project(&self, l: &FusedLinear, x: &Vec<f32>, rows: usize) -> Result<Vec<Vec<f32>>> {
        l.forward_parts(x, rows)
    }

    fn gate_up_forward(
        &self,
        g: &GateUp,
        x: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        g.forward_into(x, rows, out)
    }

    fn rotary(&self, step: &Step<'_>, x: &mut Vec<f32>, heads: usize) -> Result<()> {
        step.angles.apply(x, heads);
        Ok(())
    }

    fn kv_write(
        &self,
        kv: &mut HostKv,
        layer: usize,
        step: &Step<'_>,
        k: &Vec<f32>,
        v: &Vec<f32>,
    ) -> Result<()> {
        kv.write(layer, &step.seqs, k, v);
        Ok(())
    }

    fn attention(
        &self,
        kv: &HostKv,
        layer: usize,
        step: &Step<'_>,
        q: &Vec<f32>,
        heads: usize,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0f32; q.len()];
        kv.attention(layer, q, heads, &step.seqs, scale, &mut out);
        Ok(out)
    }

    fn select_rows(
        &self,
        x: &Vec<f32>,
        _step: &Step<'_>,
        rows: &[usize],
        width: usize,
    ) -> Result<Vec<f32>> {
        Ok(rows
            .iter()
            .flat_map(|&r| &x[r * width..(r + 1) * width])
            .copied()
            .collect())
    }

    fn to_host(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        Ok(x)
    }

    fn prefetch(&self, l: &FusedLinear) {
        l.prefetch_ahead()
    }

    fn prefetch_gate_up(&self, g: &GateUp) {
        g.prefetch_ahead()
    }

    fn prefetch_kv(&self, kv: &HostKv, layer: usize, step: &Step<'_>) {
        kv.prefetch_slots(layer, &step.seqs)
    }
}
