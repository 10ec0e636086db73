//! Generated, seeded workloads: the conversations a benchmark client sends.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Short prompts, short answers.
    Short,
    /// Short prompts, long answers.
    Long,
    /// Multi-turn agentic sessions: each turn resends the growing conversation.
    Agentic,
    /// Groups of requests sharing a long system prompt; each session draws its group at
    /// random (seeded), so groups arrive interleaved as real traffic does.
    SharedPrefix,
}

/// The shared system prompts of the shared-prefix workload.
#[derive(Debug, Clone, Copy)]
pub struct PrefixShape {
    /// Words in each group's system prompt.
    pub words: usize,
    pub groups: usize,
}

const TOPICS: &[&str] = &[
    "a binary search",
    "a linked list",
    "a hash map",
    "an LRU cache",
    "a thread pool",
    "a JSON parser",
    "merge sort",
    "a rate limiter",
    "a trie",
    "Dijkstra's algorithm",
    "a bloom filter",
    "a ring buffer",
    "quicksort",
    "a priority queue",
    "an interval tree",
];
const LANGUAGES: &[&str] = &["Python", "Rust", "C", "Go", "Java", "TypeScript"];
const WORDS: &[&str] = &[
    "service", "request", "latency", "cache", "token", "model", "router", "queue", "batch",
    "memory", "thread", "socket", "buffer", "policy", "schema", "index", "shard", "replica",
];

/// One conversation: the user turns, sent one after the other, each with the replies so far.
#[derive(Debug, Clone)]
pub struct Session {
    pub system: Option<String>,
    pub turns: Vec<String>,
    pub max_tokens: usize,
}

impl Workload {
    /// Session `i` of this workload; the same seed and index give the same session.
    pub fn session(
        self,
        i: usize,
        seed: u64,
        max_tokens: Option<usize>,
        prefix: PrefixShape,
    ) -> Session {
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let group = rng.random_range(0..prefix.groups.max(1));
        let mut question = || {
            let topic = TOPICS[rng.random_range(0..TOPICS.len())];
            let lang = LANGUAGES[rng.random_range(0..LANGUAGES.len())];
            format!("Implement {topic} in {lang}.")
        };
        match self {
            Self::Short => Session {
                system: None,
                turns: vec![question()],
                max_tokens: max_tokens.unwrap_or(32),
            },
            Self::Long => Session {
                system: None,
                turns: vec![format!("{} Explain every step in detail.", question())],
                max_tokens: max_tokens.unwrap_or(256),
            },
            Self::Agentic => Session {
                system: Some("You are a coding agent. Work step by step.".into()),
                turns: vec![
                    question(),
                    "Now add tests for it.".into(),
                    "Make it handle errors.".into(),
                ],
                max_tokens: max_tokens.unwrap_or(64),
            },
            Self::SharedPrefix => Session {
                system: Some(system_prompt(group, seed, prefix.words)),
                turns: vec![question()],
                max_tokens: max_tokens.unwrap_or(32),
            },
        }
    }
}

/// A long system prompt shared by every session of `group`.
fn system_prompt(group: usize, seed: u64, words: usize) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(group as u64 * 7919));
    let words: Vec<&str> = (0..words)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    format!(
        "You are assistant number {group}. House rules follow. {}",
        words.join(" ")
    )
}

/// The chat request body of `turn` given the replies to the earlier turns.
pub fn chat_body(session: &Session, turn: usize, replies: &[String]) -> Value {
    let mut messages = Vec::new();
    if let Some(system) = &session.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    for (k, user) in session.turns[..=turn].iter().enumerate() {
        messages.push(json!({"role": "user", "content": user}));
        if let Some(reply) = replies.get(k).filter(|_| k < turn) {
            messages.push(json!({"role": "assistant", "content": reply}));
        }
    }
    json!({
        "model": "tokenrouter", "messages": messages, "max_tokens": session.max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    })
}
