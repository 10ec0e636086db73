//! What the LM head costs a step for a prefill chunk that does not end its prompt: the same
//! forward pass run with that chunk's row asking for logits (as every sequence of a batch
//! once did) and not, interleaved over 5 rounds, for a chunk alone and beside 8 decoding
//! sequences. Printed per variant: the median step time and the median time inside the LM
//! head (the profile's breakdown), which is what skipping the row saves.
//!
//! `cargo run --example lm_head_rows -- models/Qwen2.5-Coder-0.5B-Instruct.gguf [CHUNK...]`
//! (chunk sizes, default 16 and 64).

use std::time::Instant;

use candle_core::Device;
use tokenrouter::model::profile::warm_up;
use tokenrouter::model::timing::{set_breakdown, take_breakdown};
use tokenrouter::model::{KvDtype, LoadedModel, SeqInput};
use tokenrouter::scheduler::{BlockPool, Blocks};

const ROUNDS: usize = 5;
const DECODES: usize = 8;
/// Tokens each decoding sequence already holds.
const CONTEXT: usize = 64;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: lm_head_rows MODEL.gguf [CHUNK...]"))?;
    let mut chunks: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    if chunks.is_empty() {
        chunks = vec![16, 64];
    }
    let lm = LoadedModel::load(path.as_ref(), &Device::Cpu)?;
    let model = &lm.model;
    warm_up(model)?;
    set_breakdown(true);
    let mut kv = model.kv_cache_for(16, 4096, KvDtype::default())?;
    let pool = BlockPool::new(kv.num_blocks());
    println!(
        "{path} (vocab {}, LM head {:.0} MB)",
        model.config().vocab_size,
        model.lm_head_bytes() as f64 / 1e6
    );
    println!("chunk  decodes  chunk's logits  step ms  LM head ms");
    for &chunk in &chunks {
        for decodes in [0, DECODES] {
            let tokens: Vec<u32> = (0..chunk as u32).map(|t| 100 + t).collect();
            let mut tables: Vec<Blocks> = (0..=decodes).map(|_| Blocks::default()).collect();
            pool.grow(&mut tables[0], (2 * chunk).div_ceil(16))?;
            for table in &mut tables[1..] {
                pool.grow(table, (CONTEXT + 1).div_ceil(16))?;
            }
            // (step ms, LM head ms) per round, with the chunk's logits and without.
            let mut times = [Vec::new(), Vec::new()];
            for _ in 0..ROUNDS {
                for (with, times) in [true, false].into_iter().zip(&mut times) {
                    // The chunk is the first of its prompt's two; the decodes' earlier K/V are
                    // whatever the cache holds (their values do not change the work).
                    let mut batch = vec![SeqInput {
                        tokens: &tokens,
                        start_pos: 0,
                        blocks: tables[0].ids(),
                        logits: usize::from(with),
                    }];
                    batch.extend(tables[1..].iter().map(|t| SeqInput {
                        tokens: &tokens[..1],
                        start_pos: CONTEXT,
                        blocks: t.ids(),
                        logits: 1,
                    }));
                    take_breakdown();
                    let started = Instant::now();
                    let out = model.forward(&batch, &mut kv, false)?;
                    let step = started.elapsed().as_secs_f64() * 1e3;
                    let head = take_breakdown().map_or(0.0, |b| b.lm_head * 1e3);
                    times.push((step, head));
                    assert_eq!(out.logits.dims()[0], decodes + with as usize);
                }
            }
            for (with, times) in [true, false].into_iter().zip(times) {
                let (steps, heads): (Vec<f64>, Vec<f64>) = times.into_iter().unzip();
                println!(
                    "{chunk:>5}  {decodes:>7}  {:>14}  {:>7.1}  {:>10.1}",
                    if with { "computed" } else { "skipped" },
                    median(steps),
                    median(heads)
                );
            }
        }
    }
    Ok(())
}
