use super::trace::{multi_turn, shared_prefix, TraceShape};
use super::*;

fn shape() -> ServerShape {
    ServerShape {
        cache_blocks: 160,
        max_batch: 16,
        latency: LatencyModel {
            prefill_per_token: 1e-3,
            decode_base: 10e-3,
            decode_per_seq: 1e-3,
        },
    }
}

fn trace_shape(servers: usize) -> TraceShape {
    TraceShape {
        requests: 60 * servers,
        groups: 3 * servers,
        prefix_tokens: 512,
        question_tokens: 16,
        output_tokens: 8,
        block_size: 16,
        seed: 5,
    }
}

fn run(trace: &trace::Trace, servers: usize, name: &str) -> FleetResult {
    let policy = build_policy(name, KvAwareSettings::default(), 1).unwrap();
    simulate(trace, servers, shape(), &policy, name)
}

/// Three prefixes per server and room for about four: routing that keeps each group on one
/// server reuses its prefix; round robin spreads every group everywhere and evicts.
#[test]
fn cache_affinity_beats_round_robin_when_caches_cannot_hold_every_prefix() {
    let trace = shared_prefix(trace_shape(4), 200.0);
    let rr = run(&trace, 4, "round_robin");
    let exact = run(&trace, 4, "cache_aware+exact");
    let tree = run(&trace, 4, "cache_aware");
    assert_eq!(
        (rr.requests, exact.requests),
        (240, 240),
        "every request ends"
    );
    assert!(exact.hit_rate > rr.hit_rate + 0.3, "{exact:?} vs {rr:?}");
    assert!(
        exact.throughput > 1.5 * rr.throughput,
        "{exact:?} vs {rr:?}"
    );
    assert!(tree.hit_rate > rr.hit_rate, "{tree:?} vs {rr:?}");
    assert_eq!(
        exact.index_agrees,
        Some(true),
        "events kept the index exact"
    );
    assert_eq!(rr.index_agrees, None);
}

#[test]
fn runs_repeat_exactly_and_multi_turn_reuses_history() {
    let trace = multi_turn(trace_shape(2), 50.0);
    let a = run(&trace, 2, "cache_aware+exact");
    let b = run(&trace, 2, "cache_aware+exact");
    assert_eq!(a.throughput, b.throughput);
    assert_eq!(a.ttft_p90, b.ttft_p90);
    assert!(a.hit_rate > 0.5, "{a:?}");
    assert_eq!(a.index_agrees, Some(true));
}

#[test]
fn the_latency_model_fits_bench_model_lines() {
    let lines = r#"{"batch":1,"decode_tok_s":100.0,"prefill_tok_s":500.0}
{"batch":4,"decode_tok_s":250.0,"prefill_tok_s":500.0}"#;
    let m = LatencyModel::fit(lines, 1.0).unwrap();
    // Steps of 10 ms at batch 1 and 16 ms at batch 4: 8 ms + 2 ms per sequence.
    assert!((m.decode_base - 8e-3).abs() < 1e-9 && (m.decode_per_seq - 2e-3).abs() < 1e-9);
    assert!((m.prefill_per_token - 2e-3).abs() < 1e-12);
    let half = LatencyModel::fit(lines, 0.5).unwrap();
    assert!((half.decode_base - 16e-3).abs() < 1e-9);
    let err = LatencyModel::fit("{\"batch\": 1}", 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("decode_tok_s") || err.contains("prefill_tok_s"),
        "{err}"
    );
}
