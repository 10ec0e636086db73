//! How much KV cache each model gets: every model the same number of blocks (a request's
//! tokens are cached in every model), as many as the tightest memory allows. The models on
//! CPUs share `memory.kv_budget_mb`; the models on a GPU share what is free of its memory
//! once they are loaded and warmed up, less the part `memory.gpu_memory_utilization` leaves
//! to everything else on it (vLLM's rule).

use super::{KvShare, RuntimeError};
use crate::config::{Config, DeviceSpec};
use crate::model::{KvCache, LoadedModel};

/// Memory KV caches draw on: the bytes it may hold, the bytes a token takes in all the
/// models drawing on it, and how a start-up error names it.
#[derive(Debug)]
struct KvPool {
    budget: usize,
    per_token: usize,
    name: String,
}

/// Blocks of `block_size` tokens every model can hold: the tightest pool's. An error names
/// a pool that cannot hold one.
fn common_blocks(pools: &[KvPool], block_size: usize) -> Result<usize, String> {
    let mut blocks = usize::MAX;
    for p in pools.iter().filter(|p| p.per_token > 0) {
        let here = p.budget / (p.per_token * block_size);
        if here == 0 {
            return Err(format!(
                "{} cannot hold one block of {block_size} tokens for every model; raise it",
                p.name
            ));
        }
        blocks = blocks.min(here);
    }
    Ok(if blocks == usize::MAX { 0 } else { blocks })
}

/// The KV caches' part of a GPU with `free` of `total` bytes free when its models are
/// loaded: what is free beyond the `1 - utilization` of it left to others.
pub fn gpu_kv_budget(free: usize, total: usize, utilization: f64) -> usize {
    free.saturating_sub(((1.0 - utilization) * total as f64).round() as usize)
}

/// Each model's share at `blocks` blocks of `block_size` tokens.
pub(super) fn shares_at(
    bytes_per_token: &[usize],
    block_size: usize,
    blocks: usize,
) -> Vec<KvShare> {
    bytes_per_token
        .iter()
        .map(|b| KvShare {
            blocks,
            tokens: blocks * block_size,
            bytes: blocks * block_size * b,
        })
        .collect()
}

/// The KV share of each of `models` (their entries in `config`, and the loaded models), in
/// order. Read after the models have run (their GPUs' free memory is what is left then).
pub(super) fn kv_shares(
    config: &Config,
    models: &[(usize, &LoadedModel)],
) -> Result<Vec<KvShare>, RuntimeError> {
    let block_size = config.kv_cache.block_size;
    let bytes: Vec<usize> = models
        .iter()
        .map(|(_, m)| KvCache::bytes_per_token(m.model.config(), config.kv_cache.dtype))
        .collect();
    // By device: `None` for the CPUs, the ordinal for a GPU.
    let mut pools: Vec<(Option<usize>, KvPool)> = Vec::new();
    for (&(index, lm), &b) in models.iter().zip(&bytes) {
        let gpu = match config.models[index].device {
            DeviceSpec::Cuda(n) => Some(n),
            _ => None,
        };
        if let Some((_, pool)) = pools.iter_mut().find(|(d, _)| *d == gpu) {
            pool.per_token += b;
            continue;
        }
        let pool = match (gpu, lm.model.device_memory()) {
            (Some(n), Ok(Some((free, total)))) => {
                let u = config.memory.gpu_memory_utilization;
                let budget = gpu_kv_budget(free, total, u);
                tracing::info!(
                    device = n,
                    free_mib = free >> 20,
                    total_mib = total >> 20,
                    kv_mib = budget >> 20,
                    "KV caches' memory on the GPU"
                );
                KvPool {
                    budget,
                    per_token: b,
                    name: format!(
                        "cuda:{n} ({} of {} MiB free, memory.gpu_memory_utilization = {u})",
                        free >> 20,
                        total >> 20
                    ),
                }
            }
            (_, Err(error)) => {
                return Err(RuntimeError::Model {
                    name: config.models[index].name.clone(),
                    path: config.models[index].path.clone(),
                    error: Box::new(error),
                })
            }
            _ => KvPool {
                budget: (config.memory.kv_budget_mb * (1 << 20) as f64) as usize,
                per_token: b,
                name: format!("memory.kv_budget_mb = {}", config.memory.kv_budget_mb),
            },
        };
        pools.push((gpu, pool));
    }
    let pools: Vec<KvPool> = pools.into_iter().map(|(_, p)| p).collect();
    let blocks = common_blocks(&pools, block_size).map_err(RuntimeError::Config)?;
    Ok(shares_at(&bytes, block_size, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(budget: usize, per_token: usize) -> KvPool {
        KvPool {
            budget,
            per_token,
            name: format!("pool of {budget}"),
        }
    }

    #[test]
    fn every_model_gets_the_tightest_pools_blocks() {
        // 16-token blocks: the CPU pool holds 10 blocks of its models' 100 bytes a token, a
        // GPU's 4 of its 1000.
        let pools = [pool(16_000, 100), pool(64_000 + 999, 1000)];
        assert_eq!(common_blocks(&pools, 16), Ok(4));
        assert_eq!(common_blocks(&pools[..1], 16), Ok(10));
        // A pool without models does not limit; none at all: no blocks.
        assert_eq!(common_blocks(&[pool(0, 0), pool(16_000, 100)], 16), Ok(10));
        assert_eq!(common_blocks(&[], 16), Ok(0));
        // One that cannot hold a block is named.
        let err = common_blocks(&[pool(16_000, 100), pool(15_999, 1000)], 16).unwrap_err();
        assert!(
            err.starts_with("pool of 15999 cannot hold one block"),
            "{err}"
        );
    }

    #[test]
    fn a_gpus_kv_memory_is_what_is_free_beyond_the_rest() {
        let gib = 1usize << 30;
        // 140 GiB, 100 free after the weights: at 0.9, 14 GiB stay for others.
        assert_eq!(gpu_kv_budget(100 * gib, 140 * gib, 0.9), 86 * gib);
        assert_eq!(gpu_kv_budget(100 * gib, 140 * gib, 1.0), 100 * gib);
        // Less free than the part left to others: none.
        assert_eq!(gpu_kv_budget(10 * gib, 140 * gib, 0.9), 0);
    }

    #[test]
    fn shares_hold_the_same_tokens() {
        let s = shares_at(&[100, 300], 16, 5);
        assert_eq!(s[0].tokens, 80);
        assert_eq!(s[1].tokens, 80);
        assert_eq!((s[0].bytes, s[1].bytes), (8_000, 24_000));
    }
}
