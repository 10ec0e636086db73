#!/usr/bin/env python3
"""The quality-speed frontier from scripts/eval-routing.sh's runs: a Markdown table and an SVG
plot of pass@1 against output tokens per second, one point per configuration.

For each run: pass@1 with its 95 % interval, the paired difference to the LLM alone on the
same problems with its two-sided p-value, the share of the LLM-over-SLM gap it recovers, its
LLM token share and its output tok/s; with --single, the output tok/s of the same
configuration's concurrency-1 run (scripts/eval-routing.sh with RUNS=runs/c1 CONCURRENCY=1,
usually on fewer problems); with --against LABEL, the paired difference to that run as well;
with --speed-from DIR, the tok/s of the run of the same label in DIR instead of the run's own
(sampled runs made while the machine did other work, beside greedy runs timed on a quiet one).

Runs of one completion per problem (greedy) take Wilson's interval and the exact McNemar test.
Runs of several samples per problem (SAMPLES=n) score each problem by the share of its samples
that pass, and take a bootstrap over problems for the interval and a paired sign-flip
permutation test over problems for the p-value, both seeded.

Usage: frontier.py [--runs runs] [--single runs/c1] [--against query-level-0.10]
                   [--speed-from runs] [--table docs/frontier.md] [--plot docs/frontier.svg]
"""
import argparse
import glob
import json
import math
import os
import random
import sys

# What a label's suffix says about the heads (scripts/eval-routing.sh's TAG).
TAGS = {
    "conf": "heads that also read the SLM's confidence, with standardised inputs\n"
            "([perf-notes/router-training.md](perf-notes/router-training.md))",
    "210": "such heads trained on 210 completions rather than 105",
}

# Plot colours by algorithm family (the label's first word).
COLOURS = {
    "llm": "#d62728", "slm": "#1f77b4", "query": "#7f7f7f", "r": "#9467bd",
    "r2r": "#2ca02c", "citer": "#ff7f0e", "co": "#8c564b", "speculative": "#e377c2",
}


def wilson(passed, n, z=1.96):
    if n == 0:
        return 0.0, 0.0
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def mcnemar(b, c):
    """Two-sided exact McNemar p-value for b and c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def rates(data):
    """Each problem's share of passing samples, by task id."""
    passed, total = {}, {}
    for r in data["results"]:
        passed[r["task_id"]] = passed.get(r["task_id"], 0) + r["passed"]
        total[r["task_id"]] = total.get(r["task_id"], 0) + 1
    return {task: passed[task] / total[task] for task in total}


def bootstrap(values, draws=10000, seed=0):
    """95 % percentile interval of the mean of `values` over problems resampled."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def sign_flip(diffs, draws=20000, seed=0):
    """Two-sided p-value of a paired sign-flip permutation test of mean(diffs) = 0."""
    rng = random.Random(seed)
    observed = abs(sum(diffs))
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed - 1e-12
               for _ in range(draws))
    return (hits + 1) / (draws + 1)


def paired(run, other):
    """(mean difference, p-value) of `run` against `other` over the problems both scored."""
    tasks = [t for t in run["rates"] if t in other["rates"]]
    diffs = [run["rates"][t] - other["rates"][t] for t in tasks]
    if run["samples"] == 1 and other["samples"] == 1:
        b = sum(1 for d in diffs if d < 0)
        c = sum(1 for d in diffs if d > 0)
        return (c - b) / len(tasks), mcnemar(b, c)
    return sum(diffs) / len(tasks), sign_flip(diffs)


def load(runs):
    out = {}
    for path in sorted(glob.glob(os.path.join(runs, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if "summary" in data and "results" in data:
            out[data["summary"]["label"]] = data
    return out


def family(label):
    return label.split("-")[0]


def svg(rows, path):
    w, h, m = 720, 440, 60
    xs = [r["tok_s"] for r in rows]
    ys = [r["pass"] for r in rows]
    x0, x1 = 0.0, max(xs) * 1.1
    y0, y1 = max(0.0, min(ys) - 0.05), min(1.0, max(ys) + 0.05)
    px = lambda x: m + (x - x0) / (x1 - x0) * (w - 2 * m)
    py = lambda y: h - m - (y - y0) / (y1 - y0) * (h - 2 * m)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">output tok/s (all requests)</text>',
             f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" '
             f'text-anchor="middle">HumanEval pass@1</text>']
    for i in range(6):
        x = x0 + (x1 - x0) * i / 5
        y = y0 + (y1 - y0) * i / 5
        parts.append(f'<text x="{px(x):.0f}" y="{h - m + 15}" text-anchor="middle">{x:.0f}</text>')
        parts.append(f'<text x="{m - 5}" y="{py(y) + 4:.0f}" text-anchor="end">{y:.2f}</text>')
    for r in rows:
        colour = COLOURS.get(family(r["label"]), "black")
        lo, hi = r["interval"]
        parts.append(f'<line x1="{px(r["tok_s"]):.1f}" y1="{py(max(lo, y0)):.1f}" '
                     f'x2="{px(r["tok_s"]):.1f}" y2="{py(min(hi, y1)):.1f}" stroke="{colour}" '
                     f'stroke-opacity="0.35"/>')
        parts.append(f'<circle cx="{px(r["tok_s"]):.1f}" cy="{py(r["pass"]):.1f}" r="4" '
                     f'fill="{colour}"/>')
        parts.append(f'<text x="{px(r["tok_s"]) + 6:.1f}" y="{py(r["pass"]) - 4:.1f}" '
                     f'fill="{colour}">{r["label"]} ({100 * r["share"]:.0f} %)</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs")
    parser.add_argument("--table", default="docs/frontier.md")
    parser.add_argument("--plot", default="docs/frontier.svg")
    parser.add_argument("--single", default="runs/c1",
                        help="runs at concurrency 1, for their tok/s (absent: left out)")
    parser.add_argument("--against", help="a run's label: the paired difference to it too")
    parser.add_argument("--speed-from", help="runs whose tok/s to show, by label")
    args = parser.parse_args()
    runs = load(args.runs)
    single = load(args.single) if os.path.isdir(args.single) else {}
    single_n = {len(d["results"]) for d in single.values()}
    if "llm" not in runs or "slm" not in runs:
        sys.exit(f"frontier: {args.runs} needs llm.json and slm.json (scripts/eval-routing.sh)")
    if args.against and args.against not in runs:
        sys.exit(f"frontier: no run labelled {args.against} in {args.runs}")
    timed = runs
    if args.speed_from:
        timed = load(args.speed_from)
        missing = sorted(set(runs) - set(timed))
        if missing:
            sys.exit(f"frontier: {args.speed_from} has no run labelled {', '.join(missing)}")
    scored = {}
    for label, data in runs.items():
        scored[label] = {"rates": rates(data),
                         "samples": data["summary"].get("samples", 1)}
    slm_pass, llm_pass = (mean(scored[label]["rates"].values()) for label in ("slm", "llm"))
    gap = llm_pass - slm_pass
    rows = []
    for label, data in runs.items():
        run = scored[label]
        values = list(run["rates"].values())
        n = len(values)
        pass_at_1 = mean(values)
        interval = (wilson(round(sum(values)), n) if run["samples"] == 1
                    else bootstrap(values))
        diff, p = paired(run, scored["llm"])
        rows.append({
            "label": label, "n": n, "samples": run["samples"], "pass": pass_at_1,
            "interval": interval, "diff": diff, "p": p,
            "against": paired(run, scored[args.against]) if args.against else None,
            "recovered": (pass_at_1 - slm_pass) / gap if gap > 0 else float("nan"),
            "share": data["summary"]["llm_token_share"] if label != "llm" else 1.0,
            "tok_s": timed[label]["summary"]["output_tok_s"],
            "tok_s_1": single[label]["summary"]["output_tok_s"] if label in single else None,
        })
    rows.sort(key=lambda r: (r["label"] != "llm", r["label"] != "slm", r["share"]))
    concurrency = {timed[label]["summary"].get("concurrency") for label in runs} - {None}
    at = f" at c = {concurrency.pop()}" if len(concurrency) == 1 else ""
    against = f" vs {args.against} (paired) | p |" if args.against else ""
    lines = ["| configuration | problems | pass@1 | 95 % interval | vs LLM (paired) | p "
             f"| gap recovered | LLM tokens | output tok/s{at} |"
             + (" tok/s at c = 1 |" if single else "") + against,
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if single else "")
             + ("---|---|" if args.against else "")]
    for r in rows:
        lo, hi = r["interval"]
        one = "" if not single else (
            f" {r['tok_s_1']:.1f} |" if r["tok_s_1"] is not None else " - |")
        versus = "" if r["against"] is None else (
            f" {100 * r['against'][0]:+.1f} pts | {r['against'][1]:.3f} |")
        lines.append(f"| {r['label']} | {r['n']} | {r['pass']:.3f} | {lo:.3f}-{hi:.3f} "
                     f"| {100 * r['diff']:+.1f} pts | {r['p']:.3f} | {100 * r['recovered']:.0f} % "
                     f"| {100 * r['share']:.1f} % | {r['tok_s']:.1f} |{one}{versus}")
    table = "\n".join(lines) + "\n"
    print(table)
    samples = {r["samples"] for r in rows}
    temperatures = {d["summary"].get("temperature", 0) for d in runs.values()}
    if samples == {1} and temperatures <= {0}:
        decoding = "greedy"
        tests = "the exact McNemar test's p"
        interval = "Wilson's interval"
    else:
        decoding = (f"{'/'.join(map(str, sorted(samples)))} samples a problem at temperature "
                    f"{'/'.join(map(str, sorted(temperatures)))}, top-p 0.95, the same request "
                    "seeds in every configuration; a problem scores the share of its samples "
                    "that pass")
        tests = "a paired sign-flip permutation test's p over problems"
        interval = "a bootstrap over problems"
    if args.table:
        with open(args.table, "w") as f:
            plot = os.path.basename(args.plot)
            f.write("# HumanEval frontier of the shipped pair"
                    + ("" if decoding == "greedy" else ", sampled") + "\n\n"
                    "Written by `scripts/frontier.py` from the runs of `scripts/eval-routing.sh`\n"
                    f"({decoding}; 192 tokens at most, HumanEval's stop strings). The interval is\n"
                    f"{interval}. \"vs LLM\" is the paired difference in pass@1 to the LLM alone\n"
                    f"on the same problems, with {tests}; \"gap recovered\" is\n"
                    "(pass@1 - SLM) / (LLM - SLM)."
                    + (f" \"vs {args.against}\" is the paired difference to that run."
                       if args.against else "")
                    + (f" The tok/s are those of the greedy runs of the same configurations\n"
                       f"(`{args.speed_from}`), timed on a machine doing nothing else."
                       if args.speed_from else "")
                    + (" \"tok/s at c = 1\" is one request at a time over the first "
                       f"{'/'.join(map(str, sorted(single_n)))}\nproblems." if single else "")
                    + "".join(f" Labels ending in `-{tag}` are {what}."
                              for tag, what in TAGS.items()
                              if any(label.endswith(f"-{tag}") for label in runs))
                    + " The plot is\n"
                    f"[{plot}]({plot}); what it shows is summed up in\n"
                    "[benchmarks.md](benchmarks.md#routing-quality-humaneval).\n\n" + table)
    if args.plot:
        svg(rows, args.plot)


if __name__ == "__main__":
    main()
