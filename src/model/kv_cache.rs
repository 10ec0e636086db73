//! Paged KV cache storage: a pool of fixed-size blocks per model, shared by all its sequences.
//!
//! The cache is owned by the caller of the forward pass (a model actor), never by the model.
//! Each sequence owns a [`BlockTable`]: the block ids that hold its positions in order. Layout of
//! one layer: `[block][kv_head][slot][head_dim]` in `f32` (see `kernels::attention`).
//! Guarantees: allocation and release are O(blocks moved); a block is in at most one table;
//! [`KvCache::reserve`] either grows a table to the requested length or changes nothing.

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use crate::kernels::attention::{AttentionSeq, PagedKv, MAX_BLOCK_SIZE};

/// The block ids holding one sequence's positions, in order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

struct LayerStore {
    k: Vec<f32>,
    v: Vec<f32>,
}

pub struct KvCache {
    block_size: usize,
    num_blocks: usize,
    num_kv_heads: usize,
    head_dim: usize,
    layers: Vec<LayerStore>,
    free: Vec<u32>,
}

impl KvCache {
    /// A pool of `num_blocks` blocks of `block_size` positions for every layer of `config`.
    pub fn new(config: &ModelConfig, block_size: usize, num_blocks: usize) -> Result<Self> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(ModelError::InvalidBatch(format!(
                "KV block size {block_size} must be in 1..={MAX_BLOCK_SIZE}"
            )));
        }
        let per_layer = num_blocks * block_size * config.kv_dim();
        let layers = (0..config.num_layers)
            .map(|_| LayerStore {
                k: vec![0.0; per_layer],
                v: vec![0.0; per_layer],
            })
            .collect();
        Ok(Self {
            block_size,
            num_blocks,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            layers,
            free: (0..num_blocks as u32).rev().collect(),
        })
    }

    /// A pool large enough for `tokens` positions.
    pub fn with_capacity(config: &ModelConfig, block_size: usize, tokens: usize) -> Result<Self> {
        Self::new(config, block_size, tokens.div_ceil(block_size.max(1)))
    }

    /// Bytes of cache one position costs across all layers (K and V).
    pub fn bytes_per_token(config: &ModelConfig) -> usize {
        2 * config.num_layers * config.kv_dim() * std::mem::size_of::<f32>()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Positions `table` can hold without growing.
    pub fn capacity(&self, table: &BlockTable) -> usize {
        table.blocks.len() * self.block_size
    }

    /// Grows `table` so it holds at least `num_tokens` positions; all or nothing.
    pub fn reserve(&mut self, table: &mut BlockTable, num_tokens: usize) -> Result<()> {
        let needed = num_tokens
            .div_ceil(self.block_size)
            .saturating_sub(table.blocks.len());
        if needed > self.free.len() {
            return Err(ModelError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - needed;
        table.blocks.extend(self.free.drain(at..).rev());
        Ok(())
    }

    /// Returns every block of `table` to the pool and empties it.
    pub fn release(&mut self, table: &mut BlockTable) {
        self.free.extend(table.blocks.drain(..).rev());
    }

    /// Read view of one layer for the attention kernel.
    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        let store = &self.layers[layer];
        PagedKv {
            k: &store.k,
            v: &store.v,
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Writes the K/V rows of the new tokens (`[tokens, kv_heads, head_dim]`, sequences in
    /// order) at their positions.
    pub fn write(&mut self, layer: usize, seqs: &[AttentionSeq], k: &[f32], v: &[f32]) {
        let (hd, kvh, bs) = (self.head_dim, self.num_kv_heads, self.block_size);
        let store = &mut self.layers[layer];
        let mut rows = k.chunks_exact(hd).zip(v.chunks_exact(hd));
        for seq in seqs {
            for pos in seq.start_pos..seq.start_pos + seq.num_tokens {
                let block = seq.blocks[pos / bs] as usize;
                for head in 0..kvh {
                    let (k_row, v_row) = rows.next().expect("K/V rows match the batch");
                    let dst = ((block * kvh + head) * bs + pos % bs) * hd;
                    store.k[dst..dst + hd].copy_from_slice(k_row);
                    store.v[dst..dst + hd].copy_from_slice(v_row);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Architecture, RopeStyle};

    fn config() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 16,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            context_length: 64,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_style: RopeStyle::Neox,
            qkv_bias: false,
            qk_norm: false,
            tied_embeddings: true,
        }
    }

    #[test]
    fn reserve_grows_by_whole_blocks() {
        let mut cache = KvCache::new(&config(), 4, 8).unwrap();
        let mut table = BlockTable::default();
        cache.reserve(&mut table, 5).unwrap();
        assert_eq!(table.blocks().len(), 2);
        cache.reserve(&mut table, 8).unwrap();
        assert_eq!(table.blocks().len(), 2);
        cache.reserve(&mut table, 9).unwrap();
        assert_eq!(table.blocks().len(), 3);
        assert_eq!(cache.num_free_blocks(), 5);
    }

    #[test]
    fn failed_reserve_changes_nothing() {
        let mut cache = KvCache::new(&config(), 4, 3).unwrap();
        let mut table = BlockTable::default();
        cache.reserve(&mut table, 4).unwrap();
        let err = cache.reserve(&mut table, 17).unwrap_err();
        assert!(matches!(
            err,
            ModelError::OutOfBlocks { needed: 4, free: 2 }
        ));
        assert_eq!(table.blocks().len(), 1);
        assert_eq!(cache.num_free_blocks(), 2);
    }

    #[test]
    fn released_blocks_are_reused_and_never_shared() {
        let mut cache = KvCache::new(&config(), 2, 4).unwrap();
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        cache.reserve(&mut a, 4).unwrap();
        cache.reserve(&mut b, 4).unwrap();
        assert!(a.blocks().iter().all(|x| !b.blocks().contains(x)));
        cache.release(&mut a);
        assert!(a.is_empty());
        assert_eq!(cache.num_free_blocks(), 2);
        let mut c = BlockTable::default();
        cache.reserve(&mut c, 3).unwrap();
        assert!(c.blocks().iter().all(|x| !b.blocks().contains(x)));
    }

    #[test]
    fn write_places_rows_at_their_positions() {
        let cfg = config();
        let mut cache = KvCache::new(&cfg, 2, 4).unwrap();
        let mut table = BlockTable::default();
        cache.reserve(&mut table, 3).unwrap();
        let k: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..12).map(|x| -(x as f32)).collect();
        let seqs = [AttentionSeq {
            blocks: table.blocks(),
            start_pos: 0,
            num_tokens: 3,
        }];
        cache.write(1, &seqs, &k, &v);
        let view = cache.layer(1);
        let third = view.block_offset(table.blocks()[1], 0);
        assert_eq!(&view.k[third..third + 4], &[8.0, 9.0, 10.0, 11.0]);
        assert_eq!(&view.v[third..third + 4], &[-8.0, -9.0, -10.0, -11.0]);
        assert!(cache.layer(0).k.iter().all(|&x| x == 0.0));
    }
}
