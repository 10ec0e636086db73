//! Attention's inputs in one launch after the q/k/v projection (`qkv_rotary_write_f16`), and
//! attention over a step's tiles of tokens (`paged_attention_tiles_f16`, then
//! `attention_merge` where the context is split): how the tiles and splits are cut, and the
//! launches.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::step::TILE_ROWS;
use super::{device_err, int_count, launch, per_row, Cuda, DeviceNorm, DeviceRows, Step, NULL};
use crate::model::backend::QkvSpec;
use crate::model::error::Result;
use crate::model::kv_cache::DeviceKv;
use crate::model::timing::{timed, Part};

/// Threads of a `paged_attention_tiles_f16` CTA (`PT_THREADS`).
const TILE_THREADS: u32 = 128;
/// Fewest positions a split of the context covers (`PT_MIN_SPLIT`): two of a CTA's runs.
const MIN_SPLIT_POSITIONS: usize = 64;
/// Most splits of a recorded pass's contexts, whose lengths are not known when it is
/// recorded: contexts up to 64 splits of [`MIN_SPLIT_POSITIONS`] split evenly.
const MOST_SPLITS: usize = 64;

/// Splits of the context for `ctas` tile CTAs (`paged_attention_tiles_f16`) on a device of
/// `multiprocessors` SMs, over contexts of at most `longest` positions (`None`: any, for a
/// pass recorded to be replayed). Enough splits for two CTAs an SM where the tiles alone are
/// fewer (a decode step, or an extend, over long contexts: a CTA walks its positions 32 at a
/// time, each run a round trip to memory), none shorter than [`MIN_SPLIT_POSITIONS`] (the
/// kernel cuts each tile's own context into that many runs); 1: no split.
pub(super) fn context_splits(ctas: usize, multiprocessors: usize, longest: Option<usize>) -> usize {
    let wanted = (2 * multiprocessors).div_ceil(ctas.max(1));
    let most = longest.map_or(MOST_SPLITS, |l| l.div_ceil(MIN_SPLIT_POSITIONS));
    wanted.min(most).max(1)
}

/// Warps (one a head) of a `qkv_rotary_write_f16` CTA.
const QKV_WARPS: usize = 4;

impl Cuda {
    /// [`Backend::attention_inputs`] as one projection and one `qkv_rotary_write_f16`
    /// launch, where q, k and v are stacked in one matrix, the head size is one the kernel
    /// takes (a multiple of 32 up to 256; of 64 with neox rotary) and the norms are per head:
    /// q; `None` elsewhere (the caller goes op by op).
    pub(super) fn qkv_in_one_launch(
        &self,
        spec: &QkvSpec<'_, Self>,
        x: &DeviceRows,
        rows: usize,
        step: &Step<'_>,
        kv: &mut DeviceKv,
    ) -> Result<Option<DeviceRows>> {
        let hd = kv.head_dim;
        let widths = [spec.heads * hd, spec.kv_heads * hd, spec.kv_heads * hd];
        let [(matrix, bias, stacked)] = spec.qkv.groups.as_slice() else {
            return Ok(None);
        };
        let per_head = |n: Option<&DeviceNorm>| n.is_none_or(|n| n.len == hd);
        let fits = hd.is_multiple_of(32) && hd <= 256 && (!step.neox || hd.is_multiple_of(64));
        if stacked[..] != widths || !fits || !per_head(spec.q_norm) || !per_head(spec.k_norm) {
            return Ok(None);
        }
        let qkv = timed(Part::Qkv, || -> Result<DeviceRows> {
            let mut y = matrix.multiply(self, x, rows)?;
            if let Some(bias) = bias {
                self.add_bias(&mut y, bias)?;
            }
            Ok(y)
        })?;
        let mut q = self.alloc(rows, widths[0])?;
        let heads = rows * (spec.heads + 2 * spec.kv_heads);
        if heads == 0 {
            return Ok(Some(q));
        }
        let norm = |n: Option<&DeviceNorm>| n.map_or((NULL, 0.0), |n| (self.ptr(&n.weight), n.eps));
        let ((qn, q_eps), (kn, k_eps)) = (norm(spec.q_norm), norm(spec.k_norm));
        let (stride, neox) = (int_count(qkv.width)?, step.neox as i32);
        let (tokens, h, kvh, hd_i, bs) = (
            int_count(rows)?,
            spec.heads as i32,
            spec.kv_heads as i32,
            hd as i32,
            kv.block_size as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (heads.div_ceil(QKV_WARPS) as u32, 1, 1),
            block_dim: (32 * QKV_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (kc, vc) = (&mut kv.k[spec.layer], &mut kv.v[spec.layer]);
        timed(Part::RotaryKvWrite, || {
            launch!(
                self,
                "qkv_rotary_write_f16",
                cfg,
                &qkv.buf,
                &stride,
                &qn,
                &q_eps,
                &kn,
                &k_eps,
                &step.positions,
                &step.inv_freq,
                &neox,
                &step.token_block,
                &step.token_slot,
                &mut q.buf,
                kc,
                vc,
                &tokens,
                &h,
                &kvh,
                &hd_i,
                &bs
            )
        })?;
        Ok(Some(q))
    }

    /// Causal attention of `q` (`[tokens, heads, head_dim]`) over layer `layer`'s cache into
    /// `out`, through the step's tiles `(first token of each, count)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_in_tiles(
        &self,
        kv: &DeviceKv,
        layer: usize,
        step: &Step<'_>,
        (tile_first, tiles): (u64, usize),
        q: &DeviceRows,
        heads: usize,
        scale: f32,
        out: &mut DeviceRows,
    ) -> Result<()> {
        let parts = (heads / kv.num_kv_heads).div_ceil(TILE_ROWS);
        let ctas = tiles * kv.num_kv_heads * parts;
        let splits = context_splits(ctas, self.multiprocessors, step.longest);
        // The splits' states, merged into `out` after; none without splits.
        let part = match splits {
            1 => None,
            _ => Some(self.alloc(step.tokens * heads * splits, kv.head_dim + 2)?),
        };
        let part_ptr = part.as_ref().map_or(NULL, |p| self.ptr(&p.buf));
        let cfg = LaunchConfig {
            grid_dim: ((ctas * splits) as u32, 1, 1),
            block_dim: (TILE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tokens, n_tiles, n_splits) = (int_count(step.tokens)?, tiles as i32, splits as i32);
        let (heads_i, kvh, hd, bs) = (
            heads as i32,
            kv.num_kv_heads as i32,
            kv.head_dim as i32,
            kv.block_size as i32,
        );
        launch!(
            self,
            "paged_attention_tiles_f16",
            cfg,
            &q.buf,
            &kv.k[layer],
            &kv.v[layer],
            &mut out.buf,
            &part_ptr,
            &step.block_tables,
            &step.table_start,
            &step.positions,
            &step.token_seq,
            &tile_first,
            &n_tiles,
            &n_splits,
            &tokens,
            &heads_i,
            &kvh,
            &hd,
            &bs,
            &scale
        )?;
        if let Some(part) = &part {
            let rows = int_count(step.tokens * heads)?;
            launch!(
                self,
                "attention_merge",
                per_row(step.tokens * heads, 128),
                &part.buf,
                &mut out.buf,
                &rows,
                &n_splits,
                &hd
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_tiles_split_long_contexts() {
        // A batch-1 decode of the 8B (eight KV heads) at 516 positions on 132 SMs: 33
        // splits wanted, at most 9 of 64 positions.
        assert_eq!(context_splits(8, 132, Some(516)), 9);
        // Contexts of 2000 positions: 33 wanted, at most 32 of 64 positions.
        assert_eq!(context_splits(8, 132, Some(2000)), 32);
        assert_eq!(context_splits(8, 132, Some(3000)), 33);
        // 100 positions: two.
        assert_eq!(context_splits(8, 132, Some(100)), 2);
        // Enough tiles, or a context too short to split: none.
        assert_eq!(context_splits(1024, 132, Some(512)), 1);
        assert_eq!(context_splits(8, 132, Some(64)), 1);
        assert_eq!(context_splits(8, 132, Some(0)), 1);
        // A recorded pass: the splits wanted, whatever its contexts, up to 64.
        assert_eq!(context_splits(8, 132, None), 33);
        assert_eq!(context_splits(1, 132, None), 64);
        assert_eq!(context_splits(1024, 132, None), 1);
    }
}
