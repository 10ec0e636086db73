use super::*;

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(params).unwrap()
}

#[test]
fn greedy_picks_the_largest_logit() {
    let mut s = sampler(SamplingParams::greedy());
    assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0], &[], &[]), 1);
}

/// Against the plain definition (the first index of the largest non-NaN value) on
/// random logits with ties, infinities and NaN, at lengths around the lane count.
#[test]
fn argmax_is_the_first_largest_value() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for len in [0usize, 1, 2, 15, 16, 17, 33, 1000, 49_152] {
        for case in 0..4 {
            // Few distinct values, so the largest repeats.
            let mut logits: Vec<f32> = (0..len)
                .map(|_| rng.random_range(0..8) as f32 - 4.0)
                .collect();
            if len > 0 {
                match case {
                    1 => logits[rng.random_range(0..len)] = f32::NAN,
                    2 => logits[rng.random_range(0..len)] = f32::INFINITY,
                    3 => logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
                    _ => {}
                }
            }
            let expected = logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .fold(None, |best: Option<(usize, f32)>, (i, &l)| match best {
                    Some((_, b)) if b >= l => best,
                    _ => Some((i, l)),
                })
                .map_or(0, |(i, _)| i);
            assert_eq!(argmax(&logits) as usize, expected, "len {len}, case {case}");
        }
    }
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
    assert_eq!(argmax(&[f32::NAN; 40]), 0);
}

/// The penalties as plainly defined: applied to a copy of the whole row.
fn penalise_copy(
    params: &SamplingParams,
    logits: &[f32],
    prompt: &[u32],
    output: &[u32],
) -> Vec<f32> {
    let mut logits = logits.to_vec();
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
            *l = if *l > 0.0 {
                *l / params.repetition_penalty
            } else {
                *l * params.repetition_penalty
            };
        }
    }
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in output {
        *counts.entry(t).or_default() += 1;
    }
    for (t, n) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= params.presence_penalty + params.frequency_penalty * n as f32;
        }
    }
    logits
}

/// Greedy with penalties reads the row in place; it must pick what the argmax of a
/// penalised copy picks, ties, NaN, infinities and out-of-vocabulary ids included.
#[test]
fn greedy_with_penalties_picks_the_argmax_of_the_penalised_row() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for case in 0..400 {
        let len = [1usize, 2, 17, 100, 1000][case % 5];
        // Few distinct values, so ties between penalised and untouched entries occur.
        let mut logits: Vec<f32> = (0..len)
            .map(|_| rng.random_range(0..6) as f32 - 2.0)
            .collect();
        match case % 7 {
            1 => logits[rng.random_range(0..len)] = f32::NAN,
            2 => logits[rng.random_range(0..len)] = f32::INFINITY,
            3 => logits.iter_mut().for_each(|l| *l = f32::NAN),
            _ => {}
        }
        let ids = |rng: &mut ChaCha8Rng, most: usize| -> Vec<u32> {
            let n = rng.random_range(0..most);
            (0..n)
                .map(|_| rng.random_range(0..len as u32 + 2))
                .collect()
        };
        let prompt = ids(&mut rng, 2 * len);
        let output = ids(&mut rng, len + 1);
        let params = SamplingParams {
            repetition_penalty: [1.0, 2.0, 0.5][case % 3],
            presence_penalty: [0.0, 0.5, -1.0][(case / 3) % 3],
            frequency_penalty: [0.0, 1.0, -0.5][(case / 9) % 3],
            ..SamplingParams::greedy()
        };
        let expected = argmax(&penalise_copy(&params, &logits, &prompt, &output));
        let got = sampler(params.clone()).sample(&logits, &prompt, &output);
        assert_eq!(got, expected, "case {case}: {params:?}");
    }
}

#[test]
fn same_seed_gives_same_draws() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(42),
        ..SamplingParams::default()
    };
    let draw = |params: &SamplingParams| {
        let mut s = sampler(params.clone());
        (0..20)
            .map(|_| s.sample(&logits, &[], &[]))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(&params), draw(&params));
    let other = SamplingParams {
        seed: Some(43),
        ..params.clone()
    };
    assert_ne!(draw(&params), draw(&other));
}

#[test]
fn top_k_one_is_greedy() {
    let mut s = sampler(SamplingParams {
        top_k: 1,
        seed: Some(1),
        ..SamplingParams::default()
    });
    for _ in 0..10 {
        assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[], &[]), 1);
    }
}

#[test]
fn top_p_keeps_only_the_nucleus() {
    // Token 0 has ~88% of the mass; top_p = 0.5 keeps only it.
    let mut s = sampler(SamplingParams {
        top_p: 0.5,
        seed: Some(3),
        ..SamplingParams::default()
    });
    for _ in 0..50 {
        assert_eq!(s.sample(&[3.0, 1.0, 0.0], &[], &[]), 0);
    }
}

#[test]
fn min_p_drops_unlikely_tokens() {
    let mut s = sampler(SamplingParams {
        min_p: 0.5,
        seed: Some(5),
        ..SamplingParams::default()
    });
    // p(1)/p(0) = e^-0.1 stays; token 2 is far below half of the top probability.
    let mut seen = [0; 3];
    for _ in 0..200 {
        seen[s.sample(&[2.0, 1.9, -3.0], &[], &[]) as usize] += 1;
    }
    assert!(seen[0] > 0 && seen[1] > 0);
    assert_eq!(seen[2], 0);
}

#[test]
fn sampling_follows_the_distribution() {
    let mut s = sampler(SamplingParams {
        seed: Some(9),
        ..SamplingParams::default()
    });
    let logits = [0.0f32, (3.0f32).ln()];
    let ones = (0..4000)
        .filter(|_| s.sample(&logits, &[], &[]) == 1)
        .count();
    // Expected 3000 (p = 0.75); 5 standard deviations is ±137.
    assert!((2863..=3137).contains(&ones), "{ones}");
}

/// Draws `n` tokens; how often each came.
fn histogram(s: &mut Sampler, logits: &[f32], output: &[u32], n: usize) -> Vec<usize> {
    let mut seen = vec![0; logits.len()];
    for _ in 0..n {
        seen[s.sample(logits, &[], output) as usize] += 1;
    }
    seen
}

/// Each token's count within five standard deviations of `n` draws at its probability
/// (plus three, for the tokens that should (almost) never come).
fn assert_follows(seen: &[usize], probs: &[f64], n: usize) {
    for (token, (&count, &p)) in seen.iter().zip(probs).enumerate() {
        let expected = n as f64 * p;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (count as f64 - expected).abs() <= 5.0 * sd + 3.0,
            "token {token}: {count} draws, expected {expected:.1} (p = {p:.3e})"
        );
    }
}

/// A row longer than several blocks, with NaN, -inf, ties, a penalised entry and a wide
/// spread of logits.
fn spread_row() -> (Vec<f32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let mut logits: Vec<f32> = (0..300).map(|_| rng.random_range(-6.0..2.0)).collect();
    for (i, l) in [(3, 4.0), (70, 4.0), (150, 3.5), (299, 3.0), (64, 2.5)] {
        logits[i] = l;
    }
    logits[10] = f32::NAN;
    logits[11] = f32::NEG_INFINITY;
    // Token 70 appears twice in the output: 4.0 - 2 * 0.5 = 3.0.
    (logits, vec![70, 70])
}

/// The softmax of `logits / temperature` in f64, token 70 penalised as `spread_row` says.
fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let scaled: Vec<f64> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| match i {
            70 => (l as f64 - 1.0) / temperature,
            _ if l.is_nan() => f64::NEG_INFINITY,
            _ => l as f64 / temperature,
        })
        .collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scaled.iter().map(|v| (v - max).exp()).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|w| w / total).collect()
}

/// Top-p 1 scans the softmax in token order instead of sorting it: the token each draw
/// maps to changed, so the distribution itself is checked, against probabilities
/// computed here independently.
#[test]
fn temperature_sampling_follows_the_softmax() {
    let (logits, output) = spread_row();
    let n = 200_000;
    for (temperature, seed) in [(1.0, 1), (0.7, 2)] {
        let mut s = sampler(SamplingParams {
            temperature,
            frequency_penalty: 0.5,
            seed: Some(seed),
            ..SamplingParams::default()
        });
        let seen = histogram(&mut s, &logits, &output, n);
        assert_eq!(seen[10] + seen[11], 0, "NaN and -inf are never drawn");
        assert_follows(&seen, &softmax(&logits, temperature as f64), n);
    }
}

/// The probabilities min-p and then top-p leave of `probs`, renormalised, by their
/// definitions over the sorted softmax in f64; also how many tokens they keep.
fn defined_nucleus(probs: &[f64], min_p: f32, top_p: f32) -> (Vec<f64>, usize) {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let top = probs[order[0]];
    let mut keep = order
        .iter()
        .take_while(|&&i| probs[i] >= min_p as f64 * top)
        .count();
    let mut cum = 0.0;
    for (k, &i) in order[..keep].iter().enumerate() {
        cum += probs[i];
        if cum >= top_p as f64 {
            // Far from the boundary, so rounding cannot move it.
            assert!(cum - top_p as f64 > 1e-5 && cum - probs[i] < top_p as f64 - 1e-5);
            keep = k + 1;
            break;
        }
    }
    let mass: f64 = order[..keep].iter().map(|&i| probs[i]).sum();
    let kept: std::collections::HashSet<usize> = order[..keep].iter().copied().collect();
    let out = (0..probs.len())
        .map(|i| {
            if kept.contains(&i) {
                probs[i] / mass
            } else {
                0.0
            }
        })
        .collect();
    (out, keep)
}

/// A flat row of 1000 logits, whose nucleus holds hundreds of tokens.
fn flat_row() -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    (0..1000).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Min-p, top-p and both, by their definitions over the sorted softmax in f64; the
/// nucleus of the flat row holds hundreds of tokens, so it is sorted in several rounds.
/// The sampler's whole distribution keeps the same tokens with the same probabilities.
#[test]
fn min_p_and_top_p_keep_the_defined_tokens() {
    let (logits, output) = spread_row();
    let flat = flat_row();
    for (row, min_p, top_p) in [
        (&logits, 0.0f32, 0.9f32),
        (&logits, 0.1, 1.0),
        (&logits, 0.05, 0.8),
        (&flat, 0.0, 0.9),
    ] {
        let n = 50_000;
        let output: &[u32] = if row.len() == 300 { &output } else { &[] };
        let softmaxed = if row.len() == 300 {
            softmax(row, 1.0)
        } else {
            let w: Vec<f64> = row.iter().map(|&l| (l as f64).exp()).collect();
            let total: f64 = w.iter().sum();
            w.iter().map(|w| w / total).collect()
        };
        let (probs, keep) = defined_nucleus(&softmaxed, min_p, top_p);
        let mut s = sampler(SamplingParams {
            min_p,
            top_p,
            frequency_penalty: 0.5,
            seed: Some(8),
            ..SamplingParams::default()
        });
        let dist = s.distribution(row, &[], output);
        assert_eq!(dist.entries().len(), keep, "min_p {min_p}, top_p {top_p}");
        for (t, &p) in probs.iter().enumerate() {
            let got = dist.prob(t as u32) as f64;
            assert!((got - p).abs() < 1e-6, "token {t}: {got} against {p}");
        }
        let seen = histogram(&mut s, row, output, n);
        let drawn = seen.iter().filter(|&&c| c > 0).count();
        assert!(
            drawn <= keep,
            "min_p {min_p}, top_p {top_p}: {drawn} tokens drawn, {keep} kept"
        );
        assert_follows(&seen, &probs, n);
    }
}

#[test]
fn repetition_penalty_demotes_seen_tokens() {
    let mut s = sampler(SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        ..SamplingParams::default()
    });
    // 2.0 / 2 = 1.0 < 1.5: the unseen token wins.
    assert_eq!(s.sample(&[2.0, 1.5], &[0], &[]), 1);
}

#[test]
fn frequency_and_presence_penalties_count_output_tokens() {
    let mut s = sampler(SamplingParams {
        temperature: 0.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    });
    // Token 0 appeared twice: 3.0 - 0.5 - 1.0 = 1.5 < 2.0.
    assert_eq!(s.sample(&[3.0, 2.0], &[], &[0, 0]), 1);
    // Prompt tokens are not penalised by these.
    assert_eq!(s.sample(&[3.0, 2.0], &[0, 0], &[]), 0);
}

#[test]
fn invalid_values_name_the_field() {
    let err = Sampler::new(SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("top_p"));
    let err = Sampler::new(SamplingParams {
        temperature: -1.0,
        ..SamplingParams::default()
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("temperature"));
}

/// The whole distribution equals the softmax computed here independently, with penalties
/// and temperature, and top-k keeps the k largest, renormalised.
#[test]
fn the_distribution_is_the_one_sampling_draws_from() {
    let (logits, output) = spread_row();
    for temperature in [1.0f32, 0.7] {
        let s = sampler(SamplingParams {
            temperature,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        });
        let want = softmax(&logits, temperature as f64);
        let dist = s.distribution(&logits, &[], &output);
        for (t, &p) in want.iter().enumerate() {
            let got = dist.prob(t as u32) as f64;
            assert!((got - p).abs() < 1e-6, "token {t}: {got} against {p}");
        }
    }
    let s = sampler(SamplingParams {
        top_k: 3,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    });
    let want = softmax(&logits, 1.0);
    let mut order: Vec<usize> = (0..want.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let mass: f64 = order[..3].iter().map(|&i| want[i]).sum();
    let dist = s.distribution(&logits, &[], &output);
    assert_eq!(dist.entries().len(), 3);
    for &i in &order[..3] {
        assert!((dist.prob(i as u32) as f64 - want[i] / mass).abs() < 1e-6);
    }
    let greedy = sampler(SamplingParams::greedy());
    assert_eq!(greedy.distribution(&logits, &[], &[]).entries(), [(3, 1.0)]);
}

/// Speculative sampling: tokens drafted from `q` and verified against `p` (accepted, or
/// replaced from the residual) follow `p`, whatever `q` is, and drafts from `p` itself are
/// always accepted.
#[test]
fn verified_drafts_follow_the_verifiers_distribution() {
    let (logits, output) = spread_row();
    let params = |seed| SamplingParams {
        frequency_penalty: 0.5,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let mut verifier = sampler(params(3));
    let p = verifier.distribution(&logits, &[], &output);
    let probs = softmax(&logits, 1.0);
    let shifted: Vec<f32> = logits.iter().rev().copied().collect();
    let flat = vec![0.0f32; logits.len()];
    let n = 100_000;
    for (name, draft_row) in [("reversed", &shifted), ("flat", &flat), ("same", &logits)] {
        let mut drafter = sampler(params(4));
        let q = drafter.distribution(draft_row, &[], &output);
        let mut seen = vec![0; logits.len()];
        let mut rejected = 0;
        for _ in 0..n {
            let draft = drafter.draw(&q);
            let token = match verifier.verify(&p, &q, draft) {
                None => draft,
                Some(t) => {
                    rejected += 1;
                    t
                }
            };
            seen[token as usize] += 1;
        }
        assert_follows(&seen, &probs, n);
        if name == "same" {
            assert_eq!(rejected, 0, "a draft from the verifier's own distribution");
        } else {
            assert!(rejected > 0, "{name}: some drafts must be rejected");
        }
    }
}
