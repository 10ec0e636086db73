//! Training data from the SLM's own generations, as the R2R recipe builds it: the SLM
//! completes each prompt greedily ([`generate`]); the LLM reads prompt and completion in one
//! teacher-forced pass; at each completion position where the two models' greedy tokens
//! differ, [`Labels`] says whether the difference matters. With
//! [`Labels::Continuation`] the LLM continues greedily both ways, from the SLM's token and
//! from its own, and the difference matters unless both continuations write the same code
//! (whitespace inside a line aside): what the SLM's token changes is then what the LLM itself
//! would have written next.

use serde::{Deserialize, Serialize};

use super::{Dataset, TrainError};
use crate::model::runner::{step, with_f32_values, Sequence};
use crate::model::sampler::argmax;
use crate::model::{KvCache, KvDtype, Model, SeqInput};
use crate::scheduler::BlockPool;

const BLOCK: usize = 16;

/// How a position where the models' greedy tokens differ is labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Labels {
    /// Every difference is a position for the LLM.
    Disagreement,
    /// The LLM continues `horizon` tokens both ways; the difference is a position for the LLM
    /// unless the two continuations write the same code.
    Continuation { horizon: usize },
}

/// Counts of what labelling found over the completions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelCounts {
    /// Completion positions (each one a training row).
    pub positions: usize,
    /// Positions where the greedy tokens differ.
    pub differences: usize,
    /// Differences labelled as mattering.
    pub matter: usize,
}

/// What collecting from generations needs besides the models and prompts (with them, what
/// the collected data depends on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CollectSettings {
    /// Tokens the SLM generates per prompt at most.
    pub max_new: usize,
    /// Prompts generated together.
    pub batch: usize,
    /// Largest SLM logits kept per position (the R2R head's input).
    pub top_k: usize,
    pub labels: Labels,
}

/// The completions, their rows and what labelling found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Collected {
    pub completions: Vec<Vec<u32>>,
    pub data: Dataset,
    pub counts: LabelCounts,
}

/// The SLM completes every prompt (until `finished`, as for [`generate`]), and each
/// completion is labelled against the LLM. `progress` counts completions generated, then
/// labelled.
pub fn collect_generated(
    slm: &Model,
    llm: &Model,
    prompts: &[Vec<u32>],
    finished: &dyn Fn(&[u32]) -> bool,
    settings: &CollectSettings,
    decode: &dyn Fn(&[u32]) -> String,
    mut progress: impl FnMut(usize),
) -> Result<Collected, TrainError> {
    let completions = generate(
        slm,
        prompts,
        settings.max_new,
        finished,
        settings.batch,
        &mut progress,
    )?;
    let mut data = Dataset::new(slm.config().hidden_size, settings.top_k);
    let mut counts = LabelCounts::default();
    for (i, (prompt, completion)) in prompts.iter().zip(&completions).enumerate() {
        let c = append_completion(
            slm,
            llm,
            prompt,
            completion,
            i,
            settings.labels,
            decode,
            &mut data,
        )?;
        counts.positions += c.positions;
        counts.differences += c.differences;
        counts.matter += c.matter;
        progress(prompts.len() + i + 1);
    }
    Ok(Collected {
        completions,
        data,
        counts,
    })
}

/// Greedy completions of `prompts` by `model`, `batch` prompts decoding together, each up to
/// `max_new` tokens or until `finished` says it is (given the completion so far: an
/// end-of-sequence token, a stop string).
pub fn generate(
    model: &Model,
    prompts: &[Vec<u32>],
    max_new: usize,
    finished: &dyn Fn(&[u32]) -> bool,
    batch: usize,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Vec<u32>>, TrainError> {
    let batch = batch.max(1);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let per_seq = (longest + max_new).div_ceil(BLOCK) * BLOCK;
    let mut kv = model.kv_cache_for(BLOCK, batch * per_seq, KvDtype::default())?;
    let pool = BlockPool::new(kv.num_blocks());
    let mut out = Vec::with_capacity(prompts.len());
    for group in prompts.chunks(batch) {
        let mut seqs: Vec<Sequence> = group.iter().map(|p| Sequence::new(p.clone())).collect();
        let mut live: Vec<usize> = (0..seqs.len()).filter(|_| max_new > 0).collect();
        while !live.is_empty() {
            let mut refs: Vec<&mut Sequence> = seqs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, s)| s)
                .collect();
            let logits = step(model, &mut kv, &pool, &mut refs, false)?.logits;
            let vocab = model.config().vocab_size;
            let next = with_f32_values(&logits, |v| {
                v.chunks(vocab).map(argmax).collect::<Vec<u32>>()
            })?;
            let mut still = Vec::with_capacity(live.len());
            for (&i, token) in live.iter().zip(next) {
                let s = &mut seqs[i];
                s.tokens.push(token);
                if s.output().len() < max_new && !finished(s.output()) {
                    still.push(i);
                }
            }
            live = still;
        }
        out.extend(seqs.iter().map(|s| s.output().to_vec()));
        progress(out.len());
    }
    Ok(out)
}

/// Appends the rows of one completion to `data`: features from the SLM, labels from where
/// the LLM's greedy tokens differ (and, for [`Labels::Continuation`], whether that matters).
/// `decode` turns tokens into text for comparing continuations.
#[allow(clippy::too_many_arguments)]
pub fn append_completion(
    slm: &Model,
    llm: &Model,
    prompt: &[u32],
    completion: &[u32],
    text_id: usize,
    labels: Labels,
    decode: &dyn Fn(&[u32]) -> String,
    data: &mut Dataset,
) -> Result<LabelCounts, TrainError> {
    if prompt.is_empty() || completion.is_empty() {
        return Ok(LabelCounts::default());
    }
    let text: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    // Positions `first..text.len() - 1` predict the completion's tokens.
    let rows = completion.len();
    let first = prompt.len() - 1;
    let horizon = match labels {
        Labels::Continuation { horizon } => horizon.max(1),
        Labels::Disagreement => 0,
    };
    let vocab = slm.config().vocab_size.min(llm.config().vocab_size);
    let (slm_logits, hidden) = last_rows(slm, &text, rows + 1, true, None)?;
    let slm_vocab = slm.config().vocab_size;
    let llm_vocab = llm.config().vocab_size;
    let branch_stride = (BLOCK + 1 + horizon).div_ceil(BLOCK);
    let text_blocks = text.len().div_ceil(BLOCK);
    let mut kv = llm.kv_cache(
        BLOCK,
        text_blocks + GROUP * 2 * branch_stride,
        KvDtype::default(),
    )?;
    let (llm_logits, _) = last_rows(llm, &text, rows + 1, false, Some(&mut kv))?;
    let mut differ = Vec::new();
    // Against the token the SLM wrote (a near-tie may break the other way in a full pass).
    for (r, &s) in completion.iter().enumerate() {
        let l = argmax(&llm_logits[r * llm_vocab..r * llm_vocab + vocab]);
        if s != l {
            differ.push((first + r, s, l));
        }
    }
    let mut row_labels = vec![0.0f32; rows];
    let mut counts = LabelCounts {
        positions: rows,
        differences: differ.len(),
        matter: 0,
    };
    for group in differ.chunks(GROUP) {
        let matter: Vec<bool> = match labels {
            Labels::Disagreement => vec![true; group.len()],
            Labels::Continuation { .. } => {
                let branches: Vec<(usize, u32)> = group
                    .iter()
                    .flat_map(|&(t, s, l)| [(t, s), (t, l)])
                    .collect();
                let ends = continuations(llm, &mut kv, &text, text_blocks, &branches, horizon)?;
                group
                    .iter()
                    .zip(ends.chunks(2))
                    .map(|(&(t, _, _), pair)| {
                        // The same few tokens of context before both, so that a line's
                        // indentation reads the same way in each.
                        let context = &text[(t + 1).saturating_sub(8)..=t];
                        let write = |branch: &[u32]| {
                            let tokens: Vec<u32> = context.iter().chain(branch).copied().collect();
                            decode(&tokens)
                        };
                        !same_code(&decode(context), &write(&pair[0]), &write(&pair[1]))
                    })
                    .collect()
            }
        };
        for (&(t, _, _), m) in group.iter().zip(matter) {
            row_labels[t - first] = f32::from(u8::from(m));
            counts.matter += usize::from(m);
        }
    }
    super::push_rows(
        data,
        slm,
        &slm_logits[..rows * slm_vocab],
        &hidden[..rows * slm.config().hidden_size],
        completion,
        &row_labels,
        text_id,
    )?;
    Ok(counts)
}

/// Divergences whose branches the LLM continues in one batch (two branches each).
const GROUP: usize = 8;

/// Logits (and hidden states) of the last `rows` positions of `text` from one pass on a fresh
/// cache, or on `kv` (whose first blocks then hold the text) when given.
fn last_rows(
    model: &Model,
    text: &[u32],
    rows: usize,
    want_hidden: bool,
    kv: Option<&mut KvCache>,
) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
    let mut own;
    let kv = match kv {
        Some(kv) => kv,
        None => {
            own = model.kv_cache_for(BLOCK, text.len(), KvDtype::default())?;
            &mut own
        }
    };
    let blocks: Vec<u32> = (0..text.len().div_ceil(BLOCK) as u32).collect();
    let input = SeqInput {
        tokens: text,
        start_pos: 0,
        blocks: &blocks,
        logits: rows,
    };
    let out = model.forward(&[input], kv, want_hidden)?;
    let logits = with_f32_values(&out.logits, <[f32]>::to_vec)?;
    let hidden = match &out.hidden {
        Some(h) => with_f32_values(h, <[f32]>::to_vec)?,
        None => Vec::new(),
    };
    Ok((logits, hidden))
}

/// The LLM's greedy continuation of `horizon` tokens after each branch `(t, token)`, that is
/// `text[..=t]` followed by `token`, returned with `token` first. `kv`'s first `text_blocks`
/// blocks hold the text; each branch shares the text's blocks that end at or before its
/// token, recomputes the rest of its last block into blocks of its own after them, and
/// writes nothing into the text's.
fn continuations(
    llm: &Model,
    kv: &mut KvCache,
    text: &[u32],
    text_blocks: usize,
    branches: &[(usize, u32)],
    horizon: usize,
) -> Result<Vec<Vec<u32>>, TrainError> {
    let stride = (BLOCK + 1 + horizon).div_ceil(BLOCK);
    let vocab = llm.config().vocab_size;
    let tables: Vec<Vec<u32>> = branches
        .iter()
        .enumerate()
        .map(|(i, &(t, _))| {
            let own = text_blocks + i * stride;
            (0..(t + 1) / BLOCK)
                .chain(own..own + stride)
                .map(|b| b as u32)
                .collect()
        })
        .collect();
    let firsts: Vec<Vec<u32>> = branches
        .iter()
        .map(|&(t, tok)| {
            let start = (t + 1) / BLOCK * BLOCK;
            text[start..=t].iter().copied().chain([tok]).collect()
        })
        .collect();
    let mut written: Vec<Vec<u32>> = branches.iter().map(|&(_, tok)| vec![tok]).collect();
    for n in 0..horizon {
        let inputs: Vec<SeqInput> = branches
            .iter()
            .enumerate()
            .map(|(i, &(t, _))| {
                if n == 0 {
                    SeqInput {
                        tokens: &firsts[i],
                        start_pos: (t + 1) / BLOCK * BLOCK,
                        blocks: &tables[i],
                        logits: 1,
                    }
                } else {
                    SeqInput {
                        tokens: &written[i][n..=n],
                        start_pos: t + 1 + n,
                        blocks: &tables[i],
                        logits: 1,
                    }
                }
            })
            .collect();
        let logits = llm.forward(&inputs, kv, false)?.logits;
        let next = with_f32_values(&logits, |v| {
            v.chunks(vocab).map(argmax).collect::<Vec<u32>>()
        })?;
        for (w, token) in written.iter_mut().zip(next) {
            w.push(token);
        }
    }
    Ok(written)
}

/// Whether two continuations of `context` (each written after it) write the same code: line
/// by line, with each line's indentation kept, the whitespace inside it and its `#` comment
/// dropped, blank lines skipped, and one of them possibly ending part-way through the other
/// (both have the same number of tokens, not of characters). One that adds no code to the
/// context (a comment to the end) shows nothing to compare, and is not the same.
pub fn same_code(context: &str, a: &str, b: &str) -> bool {
    let before = normalise(context).len();
    let (a, b) = (normalise(a), normalise(b));
    a.len() > before && b.len() > before && (a.starts_with(&b) || b.starts_with(&a))
}

fn normalise(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let line = without_comment(line);
        let body = line.trim_start();
        if body.trim().is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&line[..line.len() - body.len()]);
        out.extend(body.chars().filter(|c| !c.is_whitespace()));
    }
    out
}

/// `line` up to its `#` comment, if any (a `#` inside a string literal is not one).
fn without_comment(line: &str) -> &str {
    let mut quote = None;
    let mut escaped = false;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            _ if escaped => escaped = false,
            (Some(_), '\\') => escaped = true,
            (Some(q), c) if c == q => quote = None,
            (None, '"' | '\'') => quote = Some(c),
            (None, '#') => return &line[..i],
            _ => {}
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::random::{shape, RandomSource};
    use crate::model::runner::score_text;
    use crate::model::{ComputeTarget, MatmulBackend};

    /// A one-layer model of random weights.
    fn model(seed: u64) -> Model {
        let mut config = shape("qwen3-0.6b").unwrap();
        config.num_layers = 1;
        config.vocab_size = 256;
        let mut src = RandomSource::new(&config, candle_core::quantized::GgmlDType::Q8_0, seed);
        Model::load_on(config, &mut src, ComputeTarget::Cpu(MatmulBackend::Native)).unwrap()
    }

    #[test]
    fn code_is_the_same_up_to_whitespace_inside_lines() {
        assert!(same_code(
            "",
            "x = a+b\n    return x",
            "x=a + b\n\n    return x"
        ));
        // One ends part-way through the other's line.
        assert!(same_code("", "return sor", "return sorted(l)\n"));
        // Indentation is code in Python.
        assert!(!same_code("", "x = 1\n    y", "x = 1\n        y"));
        assert!(!same_code("", "return x + 1", "return x - 1"));
        // Comments are not code; a `#` in a string is not a comment.
        assert!(same_code(
            "",
            "x = 1  # one\n    # the sum\n    y",
            "x = 1  # the first\n    y"
        ));
        assert!(!same_code("", "s = '#a'", "s = '#b'"));
        // A branch that only comments after the context shows no code to compare.
        let context = "    else:\n";
        assert!(!same_code(
            context,
            "    else:\n        raise TypeError(x)",
            "    else:\n        # Return the data as it"
        ));
    }

    /// The greedy tokens a from-scratch pass over the whole text predicts after `prefix`.
    fn oracle(model: &Model, prefix: &[u32], n: usize) -> Vec<u32> {
        let mut text = prefix.to_vec();
        for _ in 0..n {
            let out = score_text(model, &text).unwrap();
            let row = out
                .logits
                .get(text.len() - 1)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            text.push(argmax(&row));
        }
        text[prefix.len()..].to_vec()
    }

    #[test]
    fn batched_generation_is_the_models_greedy_decoding() {
        let model = model(1);
        let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], (4..25).collect(), vec![9]];
        let got = generate(&model, &prompts, 6, &|_| false, 2, |_| {}).unwrap();
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &oracle(&model, p, 6));
        }
        // A completion ends with the token that finishes it.
        let stop = got[1][2];
        let finished = |out: &[u32]| out.last() == Some(&stop);
        let stopped = generate(&model, &prompts[1..2], 6, &finished, 1, |_| {}).unwrap();
        let at = got[1].iter().position(|&t| t == stop).unwrap();
        assert_eq!(stopped[0], got[1][..=at]);
    }

    #[test]
    fn branches_continue_as_a_from_scratch_pass_without_touching_the_text() {
        let model = model(1);
        let text: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
        let text_blocks = text.len().div_ceil(BLOCK);
        let horizon = 5;
        let stride = (BLOCK + 1 + horizon).div_ceil(BLOCK);
        let branches = [(14, 9), (15, 11), (16, 2), (31, 40), (38, 1)];
        let mut kv = model
            .kv_cache(
                BLOCK,
                text_blocks + branches.len() * stride,
                KvDtype::default(),
            )
            .unwrap();
        let (before, _) = last_rows(&model, &text, 3, false, Some(&mut kv)).unwrap();
        let got = continuations(&model, &mut kv, &text, text_blocks, &branches, horizon).unwrap();
        for (&(t, tok), g) in branches.iter().zip(&got) {
            let prefix: Vec<u32> = text[..=t].iter().copied().chain([tok]).collect();
            assert_eq!(g[0], tok);
            assert_eq!(
                g[1..],
                oracle(&model, &prefix, horizon)[..],
                "branch at {t}"
            );
        }
        // The text's cache is as it was: its last rows read the same logits again.
        let blocks: Vec<u32> = (0..text_blocks as u32).collect();
        let again = model
            .forward(
                &[SeqInput {
                    tokens: &text[37..],
                    start_pos: 37,
                    blocks: &blocks,
                    logits: 3,
                }],
                &mut kv,
                false,
            )
            .unwrap();
        let again = with_f32_values(&again.logits, <[f32]>::to_vec).unwrap();
        for (a, b) in before.iter().zip(&again) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    /// Rows and labels against full-pass references: a row per completion token, features
    /// of the SLM at the position before it, a label of 1 exactly where the models' greedy
    /// tokens differ (`Disagreement`), and with `Continuation` only at some of those.
    #[test]
    fn completions_are_labelled_where_the_models_differ() {
        let (slm, llm) = (model(1), model(2));
        let prompts: Vec<Vec<u32>> = vec![(1..20).collect(), vec![7, 3, 9, 4]];
        let decode = |tokens: &[u32]| format!("{tokens:?}");
        let settings = CollectSettings {
            max_new: 12,
            batch: 2,
            top_k: 5,
            labels: Labels::Disagreement,
        };
        let got = collect_generated(&slm, &llm, &prompts, &|_| false, &settings, &decode, |_| {})
            .unwrap();
        let hidden = slm.config().hidden_size;
        let mut want_labels = Vec::new();
        let mut row = 0;
        for (p, c) in prompts.iter().zip(&got.completions) {
            let text: Vec<u32> = p.iter().chain(c).copied().collect();
            let small = score_text(&slm, &text).unwrap();
            let large = score_text(&llm, &text).unwrap();
            let all_hidden = small.hidden.unwrap().to_vec2::<f32>().unwrap();
            for t in p.len() - 1..text.len() - 1 {
                let s = argmax(&small.logits.get(t).unwrap().to_vec1::<f32>().unwrap());
                let l = argmax(&large.logits.get(t).unwrap().to_vec1::<f32>().unwrap());
                assert_eq!(s, text[t + 1], "the completion is the SLM's greedy one");
                want_labels.push(f32::from(u8::from(s != l)));
                let features = &got.data.hidden[row * hidden..(row + 1) * hidden];
                for (a, b) in features.iter().zip(&all_hidden[t]) {
                    assert!((a - b).abs() < 1e-3, "hidden state of row {row}");
                }
                row += 1;
            }
        }
        assert_eq!(got.data.labels, want_labels);
        assert_eq!(got.data.rows(), 24);
        assert_eq!(got.counts.positions, 24);
        let differences = want_labels.iter().filter(|&&l| l > 0.5).count();
        assert!(differences > 0, "two random models differ somewhere");
        assert_eq!(
            (got.counts.differences, got.counts.matter),
            (differences, differences)
        );
        // Continuation labels: the same positions, a subset of the differences marked.
        let settings = CollectSettings {
            labels: Labels::Continuation { horizon: 4 },
            ..settings
        };
        let cont = collect_generated(&slm, &llm, &prompts, &|_| false, &settings, &decode, |_| {})
            .unwrap();
        assert_eq!(cont.completions, got.completions);
        assert_eq!(cont.counts.differences, differences);
        for (c, d) in cont.data.labels.iter().zip(&want_labels) {
            assert!(c <= d);
        }
        let marked = cont.data.labels.iter().filter(|&&l| l > 0.5).count();
        assert_eq!(marked, cont.counts.matter);
    }
}
