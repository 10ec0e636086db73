//! Paged KV cache storage: a pool of fixed-size blocks per model, shared by all its sequences.
//!
//! The cache is owned by the caller of the forward pass (a model actor), never by the model.
//! It is storage only: which blocks a sequence holds is the block allocator's business
//! (`scheduler::BlockPool`), and a forward pass is told each sequence's block ids in order.
//! Layout of one layer: V `[block][kv_head][slot][head_dim]`, K
//! `[block][kv_head][head_dim][slot]` (see `kernels::attention`), in `f16` by default (half the
//! memory and half the bytes attention reads) or `f32` ([`KvDtype`]).

use half::f16;

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use crate::kernels::attention::{paged_attention, AttentionSeq, PagedKv, MAX_BLOCK_SIZE};
use crate::kernels::large_buf::LargeBuf;
use crate::kernels::KvElem;

/// What the cache stores K and V as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE half precision: half the memory of `f32`, about three significant digits.
    #[default]
    F16,
    /// Single precision, as the model computes.
    F32,
}

impl KvDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// One layer's K and V (on huge pages where the OS offers them: a head's rows of one block
/// are a few KB, and a sequence's blocks lie anywhere in the pool).
struct LayerStore<T: Copy> {
    k: LargeBuf<T>,
    v: LargeBuf<T>,
}

/// Every layer's storage, in the cache's element type.
enum Layers {
    F16(Vec<LayerStore<f16>>),
    F32(Vec<LayerStore<f32>>),
}

/// K/V storage for `num_blocks` blocks of `block_size` positions, in every layer.
pub struct KvCache {
    block_size: usize,
    num_blocks: usize,
    store: KvStore,
}

/// Where a cache's K/V live: the device of the model that reads them.
pub enum KvStore {
    Host(HostKv),
    #[cfg(feature = "cuda")]
    Cuda(DeviceKv),
}

/// Every layer's K and V in GPU memory, `[block][kv_head][slot][head_dim]` in `f16` (the CUDA
/// backend's ops read and write it).
#[cfg(feature = "cuda")]
pub struct DeviceKv {
    pub(in crate::model) k: Vec<cudarc::driver::CudaSlice<u16>>,
    pub(in crate::model) v: Vec<cudarc::driver::CudaSlice<u16>>,
    pub(in crate::model) block_size: usize,
    pub(in crate::model) num_kv_heads: usize,
    pub(in crate::model) head_dim: usize,
}

/// Every layer's K/V in host memory.
pub struct HostKv {
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    layers: Layers,
}

impl KvCache {
    /// Storage for `num_blocks` blocks of `block_size` positions for every layer of `config`,
    /// as `dtype`.
    pub fn new(
        config: &ModelConfig,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(ModelError::InvalidBatch(format!(
                "KV block size {block_size} must be in 1..={MAX_BLOCK_SIZE}"
            )));
        }
        let per_layer = num_blocks * block_size * config.kv_dim();
        /// Every element written here, so the whole pool is backed by memory from the start
        /// (a pool that does not fit fails now, not mid-request, and no step pays the page
        /// faults).
        fn zeroed<T: KvElem>(layers: usize, len: usize) -> Vec<LayerStore<T>> {
            let committed = || LargeBuf::from_fn(len, |_| T::default());
            (0..layers)
                .map(|_| LayerStore {
                    k: committed(),
                    v: committed(),
                })
                .collect()
        }
        let layers = match dtype {
            KvDtype::F16 => Layers::F16(zeroed(config.num_layers, per_layer)),
            KvDtype::F32 => Layers::F32(zeroed(config.num_layers, per_layer)),
        };
        let store = KvStore::Host(HostKv {
            block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            layers,
        });
        Ok(Self::from_store(block_size, num_blocks, store))
    }

    /// `num_blocks` blocks of `block_size` positions over storage made for them.
    pub fn from_store(block_size: usize, num_blocks: usize, store: KvStore) -> Self {
        Self {
            block_size,
            num_blocks,
            store,
        }
    }

    pub fn store(&self) -> &KvStore {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut KvStore {
        &mut self.store
    }

    /// Storage for at least `tokens` positions.
    pub fn with_capacity(
        config: &ModelConfig,
        block_size: usize,
        tokens: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        Self::new(
            config,
            block_size,
            tokens.div_ceil(block_size.max(1)),
            dtype,
        )
    }

    /// Bytes of cache one position costs across all layers (K and V) when stored as `dtype`.
    pub fn bytes_per_token(config: &ModelConfig, dtype: KvDtype) -> usize {
        2 * config.num_layers * config.kv_dim() * dtype.size_in_bytes()
    }

    pub fn dtype(&self) -> KvDtype {
        match &self.store {
            KvStore::Host(host) => host.dtype(),
            #[cfg(feature = "cuda")]
            KvStore::Cuda(_) => KvDtype::F16,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

impl HostKv {
    pub fn dtype(&self) -> KvDtype {
        match self.layers {
            Layers::F16(_) => KvDtype::F16,
            Layers::F32(_) => KvDtype::F32,
        }
    }

    /// Read view of one layer in its stored type.
    fn view<'a, T: KvElem>(&self, store: &'a LayerStore<T>) -> PagedKv<'a, T> {
        PagedKv {
            k: &store.k,
            v: &store.v,
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Paged attention of `q` (`[tokens, num_heads, head_dim]`, sequences in order) over
    /// layer `layer`'s cache, into `out` (see [`paged_attention`]).
    pub fn attention(
        &self,
        layer: usize,
        q: &[f32],
        num_heads: usize,
        seqs: &[AttentionSeq],
        scale: f32,
        out: &mut [f32],
    ) {
        match &self.layers {
            Layers::F16(l) => {
                paged_attention(q, num_heads, &self.view(&l[layer]), seqs, scale, out)
            }
            Layers::F32(l) => {
                paged_attention(q, num_heads, &self.view(&l[layer]), seqs, scale, out)
            }
        }
    }

    /// Writes the K/V rows of the new tokens (`[tokens, kv_heads, head_dim]`, sequences in
    /// order) at their positions, converted to the cache's type.
    pub fn write(&mut self, layer: usize, seqs: &[AttentionSeq], k: &[f32], v: &[f32]) {
        let shape = self.shape();
        match &mut self.layers {
            Layers::F16(l) => write_rows(&mut l[layer], shape, seqs, k, v),
            Layers::F32(l) => write_rows(&mut l[layer], shape, seqs, k, v),
        }
    }

    /// Requests into the caches the lines that [`write`](Self::write) will store the new
    /// tokens' K/V rows of layer `layer` to (those of the first `PREFETCH_SLOT_ROWS` rows; a K
    /// row is spread over its block's K, so all of that).
    /// A decode step's slots are cold, the weights having streamed through the caches since
    /// the last write, and each store to a missing line would wait for it in turn (about
    /// 2 µs a layer for SmolLM2's twelve lines); requested before the q/k/v projection, the
    /// lines arrive while it runs.
    pub fn prefetch_slots(&self, layer: usize, seqs: &[AttentionSeq]) {
        fn request<T: KvElem>(store: &LayerStore<T>, shape: Shape, seqs: &[AttentionSeq]) {
            let hd = shape.0;
            let bs = shape.2;
            for (region, slot) in slots(shape, seqs).take(PREFETCH_SLOT_ROWS) {
                let k = &store.k[region..region + hd * bs];
                let v = &store.v[region + slot * hd..][..hd];
                for lines in [k, v] {
                    crate::kernels::prefetch_lines(lines.as_ptr(), std::mem::size_of_val(lines));
                }
            }
        }
        let shape = self.shape();
        match &self.layers {
            Layers::F16(l) => request(&l[layer], shape, seqs),
            Layers::F32(l) => request(&l[layer], shape, seqs),
        }
    }

    fn shape(&self) -> Shape {
        (self.head_dim, self.num_kv_heads, self.block_size)
    }
}

/// Most K/V rows (each of K and V) [`KvCache::prefetch_slots`] requests: a decode batch's,
/// not a long prefill's, whose stores are a small part of its work.
const PREFETCH_SLOT_ROWS: usize = 256;

/// `(head_dim, kv_heads, block_size)` of a cache.
type Shape = (usize, usize, usize);

/// Where each new token's row of each KV head goes in a layer's K and V: the offset of its
/// (block, KV head) region and its slot there; tokens in sequence order, a token's heads
/// together (the order of the rows [`KvCache::write`] takes).
fn slots<'a>(
    (hd, kvh, bs): Shape,
    seqs: &'a [AttentionSeq],
) -> impl Iterator<Item = (usize, usize)> + 'a {
    seqs.iter().flat_map(move |seq| {
        (seq.start_pos..seq.start_pos + seq.num_tokens).flat_map(move |pos| {
            let block = seq.blocks[pos / bs] as usize;
            (0..kvh).map(move |head| ((block * kvh + head) * bs * hd, pos % bs))
        })
    })
}

/// [`KvCache::write`] into one layer of `T`.
fn write_rows<T: KvElem>(
    store: &mut LayerStore<T>,
    shape: Shape,
    seqs: &[AttentionSeq],
    k: &[f32],
    v: &[f32],
) {
    let hd = shape.0;
    let values = seqs.iter().map(|s| s.num_tokens).sum::<usize>() * shape.1 * hd;
    assert!(
        k.len() == values && v.len() == values,
        "K/V rows match the batch"
    );
    let bs = shape.2;
    let rows = k.chunks_exact(hd).zip(v.chunks_exact(hd));
    for ((k_row, v_row), (region, slot)) in rows.zip(slots(shape, seqs)) {
        let k_column = store.k[region + slot..].iter_mut().step_by(bs);
        for (dst, &x) in k_column.zip(k_row) {
            *dst = T::from_f32(x);
        }
        T::from_f32_slice(&mut store.v[region + slot * hd..][..hd], v_row);
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

    /// K and V of `layer` at `offset..offset + len`, as `f32`.
    fn stored(cache: &HostKv, layer: usize, offset: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        fn read<T: KvElem>(store: &LayerStore<T>, at: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
            let f32s = |x: &[T]| x[at..at + len].iter().map(|e| e.to_f32()).collect();
            (f32s(&store.k), f32s(&store.v))
        }
        match &cache.layers {
            Layers::F16(l) => read(&l[layer], offset, len),
            Layers::F32(l) => read(&l[layer], offset, len),
        }
    }

    #[test]
    fn write_places_rows_at_their_positions() {
        let cfg = config();
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut cache = KvCache::new(&cfg, 2, 4, dtype).unwrap();
            assert_eq!(cache.dtype(), dtype);
            // Three positions in blocks 3 and 1 of the four.
            let blocks = [3u32, 1];
            let k: Vec<f32> = (0..12).map(|x| x as f32 + 0.5).collect();
            let v: Vec<f32> = (0..12).map(|x| -(x as f32)).collect();
            let seqs = [AttentionSeq {
                blocks: &blocks,
                start_pos: 0,
                num_tokens: 3,
            }];
            // The decoder requests the slots' lines first; a hint that changes nothing.
            #[allow(irrefutable_let_patterns)]
            let KvStore::Host(host) = cache.store_mut() else {
                unreachable!("a cache made by KvCache::new is in host memory")
            };
            host.prefetch_slots(1, &seqs);
            host.write(1, &seqs, &k, &v);
            // Position 2 is the first slot of the second block (block size 2, one KV head):
            // V's row, and K's column (its elements a block size apart).
            let third = (blocks[1] as usize * 2) * 4;
            let (k3, _) = stored(host, 1, third, 8);
            let (_, v3) = stored(host, 1, third, 4);
            assert_eq!(
                k3.iter().step_by(2).collect::<Vec<_>>(),
                [&8.5, &9.5, &10.5, &11.5]
            );
            assert_eq!(v3, [-8.0, -9.0, -10.0, -11.0], "{dtype:?}");
            // Position 1 is the second slot of the first block.
            let (k1, _) = stored(host, 1, blocks[0] as usize * 8 + 1, 7);
            assert_eq!(
                k1.iter().step_by(2).collect::<Vec<_>>(),
                [&4.5, &5.5, &6.5, &7.5]
            );
            let (k0, v0) = stored(host, 0, 0, 4 * 2 * 4);
            assert!(k0.iter().chain(&v0).all(|&x| x == 0.0), "{dtype:?}");
        }
    }

    #[test]
    fn slots_follow_the_block_head_layout() {
        // Head size 4, two KV heads, blocks of two positions: region `(block, head)` starts
        // at `(block · 2 + head) · 2 · 4`.
        let a = AttentionSeq {
            blocks: &[3, 1],
            start_pos: 1,
            num_tokens: 2,
        };
        let b = AttentionSeq {
            blocks: &[0],
            start_pos: 0,
            num_tokens: 1,
        };
        let got: Vec<(usize, usize)> = slots((4, 2, 2), &[a, b]).collect();
        // a: position 1 (block 3, slot 1), position 2 (block 1, slot 0); b: block 0, slot 0.
        assert_eq!(got, [(48, 1), (56, 1), (16, 0), (24, 0), (0, 0), (8, 0)]);
    }

    #[test]
    fn f16_halves_the_bytes_per_token() {
        let cfg = config();
        assert_eq!(
            KvCache::bytes_per_token(&cfg, KvDtype::F32),
            2 * KvCache::bytes_per_token(&cfg, KvDtype::F16)
        );
        assert_eq!(KvCache::bytes_per_token(&cfg, KvDtype::F32), 2 * 2 * 4 * 4);
    }
}
