use super::super::{optimize, ChainInputs};
use super::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// `L(b) = base + per_request * b` for batches 1..=max.
fn linear(base: f64, per_request: f64, max: usize) -> Vec<f64> {
    (1..=max).map(|b| base + per_request * b as f64).collect()
}

#[test]
fn one_model_runs_every_request_in_one_batch() {
    let inputs = ChainInputs {
        concurrency: 4,
        routing: vec![vec![1.0]],
        drops: vec![false],
        latency: vec![linear(0.1, 0.01, 8)],
        // A quantum of 10 ms represents every latency exactly.
        resolution: 11,
        shared_compute: false,
        arrival_s: Vec::new(),
        extend_s: Vec::new(),
        request_s: (0.0, 0.0),
    };
    let p = solve(&inputs, &[1]).unwrap();
    assert!(close(p.tokens_per_s, 4.0 / 0.14), "{p:?}");
    assert_eq!(p.states, 1);
    // The default, coarser quantum rounds the 140 ms step to 137.5 ms.
    let coarse = solve(
        &ChainInputs {
            resolution: 4,
            ..inputs
        },
        &[1],
    )
    .unwrap();
    assert!(
        (coarse.tokens_per_s / p.tokens_per_s - 1.0).abs() < 0.03,
        "{coarse:?}"
    );
}

#[test]
fn with_p_zero_the_second_model_is_never_used() {
    let mut inputs =
        ChainInputs::two_models(6, 0.0, 0.0, [linear(0.05, 0.01, 8), linear(0.2, 0.02, 8)]);
    inputs.resolution = 6;
    let p = solve(&inputs, &[1, 1]).unwrap();
    assert!(close(p.tokens_per_s, 6.0 / 0.11), "{p:?}");
}

#[test]
fn with_p_one_requests_alternate_and_dropped_tokens_do_not_count() {
    let flat = vec![0.1; 4];
    let mut inputs = ChainInputs::two_models(1, 1.0, 1.0, [flat.clone(), flat.clone()]);
    inputs.drops = vec![false, false];
    assert!(close(solve(&inputs, &[1, 1]).unwrap().tokens_per_s, 10.0));
    inputs.drops = vec![true, false];
    // Every other step's token is dropped.
    assert!(close(solve(&inputs, &[1, 1]).unwrap().tokens_per_s, 5.0));
    let mut two = ChainInputs::two_models(2, 1.0, 1.0, [flat.clone(), flat]);
    two.drops = vec![false, false];
    assert!(close(solve(&two, &[1, 1]).unwrap().tokens_per_s, 20.0));
}

#[test]
fn mirroring_the_models_does_not_change_the_answer() {
    let (fast, slow) = (linear(0.05, 0.01, 8), linear(0.15, 0.005, 8));
    let mut a = ChainInputs::two_models(4, 0.3, 0.6, [fast.clone(), slow.clone()]);
    a.drops = vec![false, false];
    let mut b = a.clone();
    b.routing = vec![vec![0.4, 0.6], vec![0.3, 0.7]];
    b.latency = vec![slow, fast];
    for (ta, tb) in [([1, 1], [1, 1]), ([2, 1], [1, 2]), ([1, 3], [3, 1])] {
        let (pa, pb) = (solve(&a, &ta).unwrap(), solve(&b, &tb).unwrap());
        assert!(
            close(pa.tokens_per_s, pb.tokens_per_s),
            "{ta:?}: {pa:?} vs {pb:?}"
        );
    }
    // Symmetric models with symmetric routing and no drops: never faster than every request
    // stepping alone at the fastest rate, never slower than one batch of all at the slowest.
    let l = linear(0.05, 0.01, 8);
    let mut sym = ChainInputs::two_models(4, 0.3, 0.3, [l.clone(), l]);
    sym.drops = vec![false, false];
    let t = solve(&sym, &[1, 1]).unwrap().tokens_per_s;
    assert!((4.0 / 0.09 - 1e-9..=4.0 / 0.06 + 1e-9).contains(&t), "{t}");
}

#[test]
fn a_shared_device_runs_one_step_at_a_time_and_adds_the_catch_up() {
    // Two requests that split between the models: on separate devices both steps overlap; on
    // one device they run one after the other, so the same tokens take longer.
    let mut split = ChainInputs::two_models(2, 0.5, 0.5, [vec![0.1; 2], vec![0.1; 2]]);
    split.drops = vec![false, false];
    let separate = solve(&split, &[1, 1]).unwrap().tokens_per_s;
    split.shared_compute = true;
    let shared = solve(&split, &[1, 1]).unwrap().tokens_per_s;
    assert!(
        shared < separate - 1e-9 && shared >= separate / 2.0 - 1e-9,
        "{shared} vs {separate}"
    );
    // One request bouncing every step: each 0.1 s step commits a token, and each arrival
    // costs its model 0.05 s of catch-up, worked out by hand.
    let mut bounce = ChainInputs::two_models(1, 1.0, 1.0, [vec![0.1], vec![0.1]]);
    bounce.drops = vec![false, false];
    bounce.shared_compute = true;
    assert!(close(solve(&bounce, &[1, 1]).unwrap().tokens_per_s, 10.0));
    bounce.arrival_s = vec![0.05, 0.05];
    assert!(close(
        solve(&bounce, &[1, 1]).unwrap().tokens_per_s,
        1.0 / 0.15
    ));
}

#[test]
fn on_a_shared_device_a_model_below_its_threshold_still_runs_when_nothing_else_can() {
    // Thresholds that deadlock separate devices are fine on a shared one: it never idles.
    let l = linear(0.05, 0.01, 8);
    let mut inputs = ChainInputs::two_models(4, 0.5, 0.5, [l.clone(), l]);
    inputs.shared_compute = true;
    let waiting = solve(&inputs, &[3, 3]).unwrap().tokens_per_s;
    let eager = solve(&inputs, &[1, 1]).unwrap().tokens_per_s;
    assert!(waiting > 0.0 && eager > 0.0);
    // With every request on one model, the device serves that model alone, in full batches.
    let mut one =
        ChainInputs::two_models(4, 0.0, 0.0, [linear(0.05, 0.01, 8), linear(0.2, 0.02, 8)]);
    one.shared_compute = true;
    assert!(close(
        solve(&one, &[1, 4]).unwrap().tokens_per_s,
        4.0 / 0.09
    ));
}

#[test]
fn thresholds_that_can_deadlock_are_rejected() {
    let l = linear(0.05, 0.01, 8);
    let inputs = ChainInputs::two_models(4, 0.5, 0.5, [l.clone(), l]);
    let err = solve(&inputs, &[3, 3]).unwrap_err();
    assert!(matches!(err, ChainError::Deadlock { .. }), "{err}");
    assert!(solve(&inputs, &[1, 1]).is_ok(), "eager never deadlocks");
}

#[test]
fn the_optimizer_picks_a_feasible_vector_at_least_as_good_as_eager() {
    // A slow LLM whose step barely grows with the batch: waiting for a bigger batch pays.
    let inputs =
        ChainInputs::two_models(6, 0.2, 0.5, [linear(0.02, 0.002, 8), linear(0.2, 0.001, 8)]);
    let (all, best) = optimize(&inputs);
    assert_eq!(all.len(), 36);
    let best = best.expect("eager is always feasible");
    let score = |b: &[usize]| {
        all.iter()
            .find(|(v, _)| v == b)
            .unwrap()
            .1
            .as_ref()
            .unwrap()
            .tokens_per_s
    };
    assert!(score(&best) >= score(&[1, 1]) - 1e-9);
    assert!(all.iter().any(|(_, r)| r.is_err()), "some vectors deadlock");
}

#[test]
fn splits_are_multinomial() {
    let s = splits(3, &[0.5, 0.5]);
    assert_eq!(s.len(), 4);
    let total: f64 = s.iter().map(|(p, _)| p).sum();
    assert!(close(total, 1.0));
    assert!(close(s[1].0, 3.0 / 8.0));
}

#[test]
fn catch_up_costs_the_visit_elsewhere_at_the_step_slope_or_the_measured_extend() {
    // The SLM leaves with probability 0.25 (4 steps, the last token dropped: 3 tokens); the
    // LLM with 0.5 (2 tokens). Slopes: 0.01 and 0.02 s per row; measured extends, where
    // given, 4 and 7 ms a token.
    for (extend_s, per_token) in [(vec![], [0.01, 0.02]), (vec![0.004, 0.007], [0.004, 0.007])] {
        let mut inputs =
            ChainInputs::two_models(4, 0.25, 0.5, [linear(0.05, 0.01, 4), linear(0.2, 0.02, 4)]);
        inputs.extend_s = extend_s;
        let arrival = inputs.with_catch_up().arrival_s;
        assert!(close(arrival[0], 2.0 * per_token[0]), "{arrival:?}");
        assert!(close(arrival[1], 3.0 * per_token[1]), "{arrival:?}");
    }
}

#[test]
fn extends_add_their_seconds_per_committed_token_on_a_shared_device() {
    // One model, one request at a time: 10 tokens a request at 0.1 s a step, and a 20-token
    // prompt at 5 ms a token: 1 s of steps and 0.1 s of prefill per request.
    let mut inputs = ChainInputs {
        concurrency: 1,
        routing: vec![vec![1.0]],
        drops: vec![false],
        latency: vec![vec![0.1]],
        resolution: 1,
        shared_compute: true,
        arrival_s: Vec::new(),
        extend_s: vec![0.005],
        request_s: (0.0, 0.0),
    };
    inputs.request_s = (20.0 * 0.005, 10.0);
    let p = solve(&inputs, &[1]).unwrap();
    assert!(close(p.tokens_per_s, 10.0 / 1.1), "{p:?}");
    // Two models: each model's extends at its own cost.
    let mut two = ChainInputs::two_models(2, 0.1, 0.5, [vec![0.02, 0.03], vec![0.05, 0.08]]);
    two.extend_s = vec![0.002, 0.006];
    let two = two.with_extends(&[30.0, 20.0], 64.0);
    assert!(close(two.request_s.0, 30.0 * 0.002 + 20.0 * 0.006));
    assert!(close(two.request_s.1, 64.0));
    // Separate devices overlap prefills with the other model's steps: not charged.
    let mut separate = inputs.clone();
    separate.shared_compute = false;
    let q = solve(&separate, &[1]).unwrap();
    assert!(close(q.tokens_per_s, 10.0), "{q:?}");
}
