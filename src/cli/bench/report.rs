//! Benchmark results: per (mode, concurrency) level throughput and latency percentiles, as a
//! table, JSON, and SVG plots (throughput vs concurrency, end-to-end latency CDF).

use serde::Serialize;

use super::client::Sample;

#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    fn of(values: &[f64]) -> Self {
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| {
            v.get(((v.len().max(1) - 1) as f64 * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        Self {
            mean: v.iter().fold(0.0, |a, b| a + b) / v.len().max(1) as f64,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LinkLevel {
    pub model: String,
    pub frames: u64,
    pub bytes: u64,
    pub rtt_us: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LevelResult {
    pub mode: String,
    pub concurrency: usize,
    pub requests: usize,
    pub failed: usize,
    pub seconds: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    /// Mean over requests of output tokens ÷ that request's end-to-end time.
    pub per_user_tok_s: f64,
    pub ttft_s: Percentiles,
    pub inter_token_s: Percentiles,
    pub e2e_s: Percentiles,
    pub llm_token_share: f64,
    /// Speculative decoding: the share of drafted tokens accepted, and the mean accepted per
    /// verification (`None` without speculative decoding).
    pub acceptance_rate: Option<f64>,
    pub mean_accepted_length: Option<f64>,
    /// The servers' own prefix-cache hit rate over this level (hit ÷ looked-up tokens).
    pub prefix_hit_rate: Option<f64>,
    /// Per remote model, its link's traffic over this level and last round trip.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkLevel>,
    /// Every request's end-to-end seconds (for the CDF plot).
    pub e2e_samples: Vec<f64>,
    /// Output tok/s of each repetition (`--repeat`), in run order; this result is the median
    /// one's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repetitions: Vec<f64>,
}

/// One result per (mode, concurrency), in first-seen order: the repetition with the median
/// output throughput (the upper middle of an even count), with every repetition's figure.
pub fn medians(results: Vec<LevelResult>) -> Vec<LevelResult> {
    let mut groups: Vec<Vec<LevelResult>> = Vec::new();
    for r in results {
        match groups
            .iter_mut()
            .find(|g| g[0].mode == r.mode && g[0].concurrency == r.concurrency)
        {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|mut g| {
            let runs: Vec<f64> = g.iter().map(|r| r.output_tok_s).collect();
            g.sort_by(|a, b| a.output_tok_s.total_cmp(&b.output_tok_s));
            let mut median = g.swap_remove(g.len() / 2);
            if runs.len() > 1 {
                median.repetitions = runs;
            }
            median
        })
        .collect()
}

pub fn summarize(
    mode: &str,
    concurrency: usize,
    samples: &[Sample],
    failed: usize,
    seconds: f64,
) -> LevelResult {
    let output: usize = samples.iter().map(|s| s.completion_tokens).sum();
    let input: usize = samples.iter().map(|s| s.prompt_tokens).sum();
    let e2e: Vec<f64> = samples.iter().map(|s| s.e2e).collect();
    let gaps: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.gaps.iter().copied())
        .collect();
    let per_user: Vec<f64> = samples
        .iter()
        .map(|s| s.completion_tokens as f64 / s.e2e.max(1e-9))
        .collect();
    let drafted: u64 = samples.iter().map(|s| s.drafted).sum();
    let accepted: u64 = samples.iter().map(|s| s.accepted).sum();
    let verifications: u64 = samples.iter().map(|s| s.verifications).sum();
    LevelResult {
        mode: mode.to_string(),
        concurrency,
        requests: samples.len(),
        failed,
        seconds,
        output_tok_s: output as f64 / seconds.max(1e-9),
        total_tok_s: (output + input) as f64 / seconds.max(1e-9),
        per_user_tok_s: per_user.iter().fold(0.0, |a, b| a + b) / per_user.len().max(1) as f64,
        ttft_s: Percentiles::of(&samples.iter().map(|s| s.ttft).collect::<Vec<_>>()),
        inter_token_s: Percentiles::of(&gaps),
        e2e_s: Percentiles::of(&e2e),
        llm_token_share: samples.iter().fold(0.0, |a, s| a + s.llm_tokens) / output.max(1) as f64,
        acceptance_rate: (drafted > 0).then(|| accepted as f64 / drafted as f64),
        mean_accepted_length: (verifications > 0).then(|| accepted as f64 / verifications as f64),
        prefix_hit_rate: None,
        links: Vec::new(),
        e2e_samples: e2e,
        repetitions: Vec::new(),
    }
}

/// A Markdown table; with several modes, each row's throughput ratio to `sync` (or to the
/// first mode) at the same concurrency, and to `llm-alone` when that baseline ran.
pub fn table(results: &[LevelResult]) -> String {
    let base_mode = if results.iter().any(|r| r.mode == "sync") {
        "sync"
    } else {
        results.first().map_or("", |r| r.mode.as_str())
    };
    let of = |mode: &str, c: usize| {
        results
            .iter()
            .find(|r| r.mode == mode && r.concurrency == c)
            .map(|r| r.output_tok_s)
    };
    let alone = results.iter().any(|r| r.mode == "llm-alone");
    let speculative = results.iter().any(|r| r.acceptance_rate.is_some());
    let (spec_head, spec_rule) = if speculative {
        (" drafts accepted (mean length) |", "---|")
    } else {
        ("", "")
    };
    let (alone_head, alone_rule) = if alone {
        (" vs llm-alone |", "---|")
    } else {
        ("", "")
    };
    let mut out = format!(
        "| mode | concurrency | requests | output tok/s | vs {base_mode} |{alone_head} total tok/s | per-user tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 s | LLM share |{spec_head} prefix hit |\n|---|---|---|---|---|{alone_rule}---|---|---|---|---|---|{spec_rule}---|\n"
    );
    for r in results {
        let ms =
            |p: &Percentiles| format!("{:.0}/{:.0}/{:.0}", p.p50 * 1e3, p.p90 * 1e3, p.p99 * 1e3);
        let ratio = |mode: &str| {
            of(mode, r.concurrency).map_or("–".into(), |b| {
                format!("{:.2}×", r.output_tok_s / b.max(1e-9))
            })
        };
        let vs_alone = if alone {
            format!(" {} |", ratio("llm-alone"))
        } else {
            String::new()
        };
        let range = match r.repetitions.iter().copied().reduce(f64::min) {
            Some(lo) => {
                let hi = r.repetitions.iter().copied().fold(lo, f64::max);
                format!(" ({lo:.1}–{hi:.1})")
            }
            None => String::new(),
        };
        let spec = match (speculative, r.acceptance_rate, r.mean_accepted_length) {
            (false, ..) => String::new(),
            (true, Some(rate), Some(mean)) => format!(" {:.0}% ({mean:.2}) |", rate * 100.0),
            (true, ..) => " – |".into(),
        };
        out.push_str(&format!(
            "| {} | {} | {}{} | {:.1}{range} | {} |{vs_alone} {:.1} | {:.2} | {} | {} | {:.1}/{:.1}/{:.1} | {:.0}% |{spec} {} |\n",
            r.mode, r.concurrency, r.requests,
            if r.failed > 0 { format!(" ({} failed)", r.failed) } else { String::new() },
            r.output_tok_s, ratio(base_mode), r.total_tok_s, r.per_user_tok_s, ms(&r.ttft_s),
            ms(&r.inter_token_s), r.e2e_s.p50, r.e2e_s.p90, r.e2e_s.p99,
            r.llm_token_share * 100.0,
            r.prefix_hit_rate.map_or("–".into(), |h| format!("{:.0}%", h * 100.0)),
        ));
    }
    out
}

const COLOURS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
const W: f64 = 640.0;
const H: f64 = 400.0;
const PAD: f64 = 60.0;

fn modes(results: &[LevelResult]) -> Vec<String> {
    let mut modes: Vec<String> = Vec::new();
    for r in results {
        if !modes.contains(&r.mode) {
            modes.push(r.mode.clone());
        }
    }
    modes
}

/// An SVG line chart: one polyline per series of `(x, y)` points, axes from 0.
pub(crate) fn chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let max_x = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(1e-9, f64::max);
    let max_y = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1e-9, f64::max)
        * 1.1;
    let sx = |x: f64| PAD + x / max_x * (W - 2.0 * PAD);
    let sy = |y: f64| H - PAD - y / max_y * (H - 2.0 * PAD);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\n\
         <line x1=\"{PAD}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text>\n\
         <text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">{y_label}</text>\n",
        W / 2.0, H - PAD, W - PAD, H - PAD, H - PAD, W / 2.0, H - 15.0, H / 2.0, H / 2.0
    );
    for k in 0..=4 {
        let (x, y) = (max_x * k as f64 / 4.0, max_y * k as f64 / 4.0);
        svg.push_str(&format!(
            "<text x=\"{:.0}\" y=\"{}\" text-anchor=\"middle\">{x:.3}</text>\n",
            sx(x),
            H - PAD + 16.0
        ));
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{:.0}\" text-anchor=\"end\">{y:.3}</text>\n",
            PAD - 4.0,
            sy(y) + 4.0
        ));
    }
    for (i, (name, points)) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
            path.join(" ")
        ));
        for &(x, y) in points {
            svg.push_str(&format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>\n",
                sx(x),
                sy(y)
            ));
        }
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{colour}\">{name}</text>\n",
            W - PAD - 100.0,
            PAD + 16.0 * i as f64
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

/// Output tokens/s against concurrency, one line per mode.
pub fn throughput_svg(results: &[LevelResult]) -> String {
    let series: Vec<_> = modes(results)
        .into_iter()
        .map(|m| {
            let points = results
                .iter()
                .filter(|r| r.mode == m)
                .map(|r| (r.concurrency as f64, r.output_tok_s))
                .collect();
            (m, points)
        })
        .collect();
    chart(
        "Output throughput",
        "concurrency",
        "output tokens/s",
        &series,
    )
}

/// The CDF of end-to-end latency at the highest concurrency, one line per mode.
pub fn latency_svg(results: &[LevelResult]) -> String {
    let top = results.iter().map(|r| r.concurrency).max().unwrap_or(1);
    let series: Vec<_> = results
        .iter()
        .filter(|r| r.concurrency == top)
        .map(|r| {
            let mut v = r.e2e_samples.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len().max(1) as f64;
            (
                r.mode.clone(),
                v.iter()
                    .enumerate()
                    .map(|(i, &x)| (x, (i + 1) as f64 / n))
                    .collect(),
            )
        })
        .collect();
    chart(
        &format!("End-to-end latency CDF at concurrency {top}"),
        "seconds",
        "fraction of requests",
        &series,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(e2e: f64, tokens: usize) -> Sample {
        Sample {
            completion_tokens: tokens,
            prompt_tokens: 10,
            ttft: e2e / 4.0,
            e2e,
            gaps: vec![0.01; tokens.saturating_sub(1)],
            llm_tokens: tokens as f64 / 2.0,
            ..Sample::default()
        }
    }

    #[test]
    fn speculative_levels_report_acceptance() {
        let spec: Vec<_> = (1..=4)
            .map(|i| Sample {
                drafted: 10,
                accepted: 8,
                verifications: 4,
                ..sample(i as f64, 10)
            })
            .collect();
        let r = summarize("delayed", 1, &spec, 0, 10.0);
        assert_eq!(r.acceptance_rate, Some(0.8));
        assert_eq!(r.mean_accepted_length, Some(2.0));
        let plain = summarize("llm-alone", 1, &[sample(1.0, 10)], 0, 10.0);
        assert_eq!(plain.acceptance_rate, None);
        let table = table(&[r, plain]);
        assert!(table.contains("drafts accepted (mean length)"), "{table}");
        assert!(
            table.contains("| 80% (2.00) |") && table.contains("| – |"),
            "{table}"
        );
    }

    #[test]
    fn levels_summarize_throughput_percentiles_and_shares() {
        let samples: Vec<_> = (1..=100).map(|i| sample(i as f64, 10)).collect();
        let r = summarize("sync", 4, &samples, 0, 50.0);
        assert_eq!(r.output_tok_s, 20.0);
        assert_eq!(r.total_tok_s, 40.0);
        assert_eq!(r.e2e_s.p50, 51.0);
        assert_eq!(r.e2e_s.p99, 99.0);
        assert_eq!(r.llm_token_share, 0.5);
        let svg = throughput_svg(&[
            r.clone(),
            LevelResult {
                mode: "eager".into(),
                ..r
            },
        ]);
        assert!(
            svg.starts_with("<svg")
                && svg.contains("eager")
                && svg.matches("<polyline").count() == 2
        );
    }

    #[test]
    fn repetitions_reduce_to_the_median_with_the_range_shown() {
        let samples: Vec<_> = (1..=10).map(|i| sample(i as f64, 10)).collect();
        let at = |mode: &str, seconds: f64| summarize(mode, 4, &samples, 0, seconds);
        let runs = vec![
            at("sync", 10.0),
            at("llm-alone", 20.0),
            at("sync", 5.0),
            at("llm-alone", 25.0),
            at("sync", 20.0),
            at("llm-alone", 10.0),
        ];
        let m = medians(runs);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].mode.as_str(), m[0].output_tok_s), ("sync", 10.0));
        assert_eq!(m[0].repetitions, vec![10.0, 20.0, 5.0]);
        assert_eq!((m[1].mode.as_str(), m[1].output_tok_s), ("llm-alone", 5.0));
        let t = table(&m);
        assert!(t.contains("| vs sync | vs llm-alone |"), "{t}");
        assert!(
            t.contains("| sync | 4 | 10 | 10.0 (5.0–20.0) | 1.00× | 2.00× |"),
            "{t}"
        );
    }
}
