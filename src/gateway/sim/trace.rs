//! The requests a simulated fleet serves: generated shared-prefix and multi-turn traces, or a
//! published trace read from a file (the Mooncake trace's JSONL: `timestamp` in ms,
//! `input_length`, `output_length` and `hash_ids`, one id per block of the prompt, equal ids
//! for equal prefixes). Every request carries its prompt as chained block hashes (as the
//! servers' prefix caches key them) and as the routing text an approximate tree would see.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::gateway::kv_index::block_hashes;
use crate::scheduler::{chain_hash, PrefixHash};

/// One request of a trace.
#[derive(Debug, Clone)]
pub struct TraceRequest {
    /// Seconds from the start of the trace.
    pub arrival: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Chained hashes of the prompt's full blocks.
    pub blocks: Vec<PrefixHash>,
    /// The prompt as text for the approximate tree: one word per block, then the tail.
    pub text: String,
}

/// A whole trace and the block size its hashes chain.
#[derive(Debug, Clone)]
pub struct Trace {
    pub name: String,
    pub block_size: usize,
    pub requests: Vec<TraceRequest>,
}

/// Full blocks as routing text: one word per block hash.
fn block_text(blocks: &[PrefixHash]) -> String {
    blocks.iter().map(|h| format!("{h:016x} ")).collect()
}

fn request(arrival: f64, tokens: &[u32], output: usize, block_size: usize) -> TraceRequest {
    let blocks = block_hashes(tokens, block_size);
    let mut text = block_text(&blocks);
    for t in &tokens[blocks.len() * block_size..] {
        text.push_str(&format!("{t} "));
    }
    TraceRequest {
        arrival,
        prompt_tokens: tokens.len(),
        output_tokens: output.max(1),
        blocks,
        text,
    }
}

/// Shape of the generated traces.
#[derive(Debug, Clone, Copy)]
pub struct TraceShape {
    pub requests: usize,
    /// Shared-prefix: groups (system prompts); multi-turn: concurrent conversations.
    pub groups: usize,
    /// Shared-prefix: tokens of each group's prefix; multi-turn: of each conversation's
    /// system prompt.
    pub prefix_tokens: usize,
    /// Tokens of each request's own question.
    pub question_tokens: usize,
    pub output_tokens: usize,
    pub block_size: usize,
    pub seed: u64,
}

fn tokens(rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..150_000)).collect()
}

/// Requests arrive one every `1 / rate` s on average (Poisson, seeded), in the order built.
fn arrivals(rng: &mut ChaCha8Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += -u.ln() / rate;
            t
        })
        .collect()
}

/// Groups of requests sharing a long prefix, each request drawing its group at random.
pub fn shared_prefix(shape: TraceShape, rate: f64) -> Trace {
    let mut rng = ChaCha8Rng::seed_from_u64(shape.seed);
    let groups = shape.groups.max(1);
    let prefixes: Vec<Vec<u32>> = (0..groups)
        .map(|_| tokens(&mut rng, shape.prefix_tokens))
        .collect();
    let times = arrivals(&mut rng, shape.requests, rate);
    let requests = times
        .into_iter()
        .map(|t| {
            let mut prompt = prefixes[rng.random_range(0..groups)].clone();
            prompt.extend(tokens(&mut rng, shape.question_tokens));
            request(t, &prompt, shape.output_tokens, shape.block_size)
        })
        .collect();
    Trace {
        name: "shared-prefix".into(),
        block_size: shape.block_size,
        requests,
    }
}

/// Conversations that resend their growing history each turn: turn k of a conversation is
/// its system prompt, the earlier questions and answers, and a new question. Turns of all
/// conversations interleave; each conversation's turns keep their order.
pub fn multi_turn(shape: TraceShape, rate: f64) -> Trace {
    let mut rng = ChaCha8Rng::seed_from_u64(shape.seed);
    let conversations = shape.groups.max(1);
    let mut history: Vec<Vec<u32>> = (0..conversations)
        .map(|_| tokens(&mut rng, shape.prefix_tokens))
        .collect();
    let times = arrivals(&mut rng, shape.requests, rate);
    let mut requests = Vec::with_capacity(shape.requests);
    for t in times {
        let c = rng.random_range(0..conversations);
        let question = tokens(&mut rng, shape.question_tokens);
        history[c].extend(&question);
        requests.push(request(
            t,
            &history[c],
            shape.output_tokens,
            shape.block_size,
        ));
        let answer = tokens(&mut rng, shape.output_tokens);
        history[c].extend(answer);
        // A conversation that outgrows a long context starts over.
        if history[c].len() > 32 * 1024 {
            history[c] = tokens(&mut rng, shape.prefix_tokens);
        }
    }
    Trace {
        name: "multi-turn".into(),
        block_size: shape.block_size,
        requests,
    }
}

#[derive(serde::Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

/// A Mooncake-format trace (`block_size` tokens per hash id; 512 in the published traces);
/// `time_scale` stretches (> 1) or compresses (< 1) its timestamps.
pub fn mooncake(path: &Path, block_size: usize, time_scale: f64) -> anyhow::Result<Trace> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the trace {} ({e})", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let r: MooncakeLine = serde_json::from_str(line).map_err(|e| {
            anyhow::anyhow!(
                "{} line {}: not a Mooncake request ({e}); each line needs timestamp, \
                 input_length, output_length and hash_ids",
                path.display(),
                n + 1
            )
        })?;
        // The ids name whole prefixes already; chaining them keeps the servers' rule that a
        // block is only reused after its parent.
        let mut parent = None;
        let blocks: Vec<PrefixHash> = (r.hash_ids.iter())
            .take(r.input_length / block_size)
            .map(|&id| {
                let h = chain_hash(parent, &[id as u32, (id >> 32) as u32]);
                parent = Some(h);
                h
            })
            .collect();
        let text = block_text(&blocks);
        requests.push(TraceRequest {
            arrival: r.timestamp / 1000.0 * time_scale,
            prompt_tokens: r.input_length.max(1),
            output_tokens: r.output_length.max(1),
            blocks,
            text: text + &format!("#{n}"),
        });
    }
    if requests.is_empty() {
        anyhow::bail!("the trace {} has no requests", path.display());
    }
    requests.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
    let start = requests[0].arrival;
    for r in &mut requests {
        r.arrival -= start;
    }
    Ok(Trace {
        name: path
            .file_stem()
            .map_or("trace".into(), |s| s.to_string_lossy().into()),
        block_size,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> TraceShape {
        TraceShape {
            requests: 50,
            groups: 3,
            prefix_tokens: 64,
            question_tokens: 8,
            output_tokens: 4,
            block_size: 16,
            seed: 3,
        }
    }

    #[test]
    fn shared_prefix_requests_share_their_groups_blocks() {
        let trace = shared_prefix(shape(), 10.0);
        assert_eq!(trace.requests.len(), 50);
        let firsts: std::collections::HashSet<_> =
            trace.requests.iter().map(|r| r.blocks[0]).collect();
        assert_eq!(firsts.len(), 3, "one first block per group");
        for r in &trace.requests {
            assert_eq!((r.prompt_tokens, r.blocks.len()), (72, 4));
        }
        assert!(trace
            .requests
            .windows(2)
            .all(|w| w[0].arrival < w[1].arrival));
    }

    #[test]
    fn a_conversations_turns_extend_its_earlier_prompt() {
        let trace = multi_turn(shape(), 10.0);
        let extends = |a: &TraceRequest, b: &TraceRequest| b.blocks.starts_with(&a.blocks);
        let r = &trace.requests;
        let later = (1..r.len())
            .find(|&j| r[j].blocks[0] == r[0].blocks[0])
            .unwrap();
        assert!(extends(&r[0], &r[later]) && r[later].prompt_tokens > r[0].prompt_tokens);
    }

    #[test]
    fn mooncake_lines_are_read_and_bad_ones_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 2000, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
             {\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 7, \"hash_ids\": [1, 4]}\n",
        )
        .unwrap();
        let trace = mooncake(&path, 512, 1.0).unwrap();
        let r = &trace.requests;
        assert_eq!((r[0].arrival, r[1].arrival), (0.0, 1.0));
        assert_eq!((r[0].blocks.len(), r[1].blocks.len()), (1, 2));
        assert_eq!(r[0].blocks[0], r[1].blocks[0], "shared first block");
        std::fs::write(&path, "{\"timestamp\": 1}\n").unwrap();
        let err = mooncake(&path, 512, 1.0).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("hash_ids"), "{err}");
    }
}
