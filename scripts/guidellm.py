#!/usr/bin/env python3
"""guidellm (PyPI package `guidellm`) against `tokenrouter serve` and against the gateway of
`serve --dp-size 2`: a synchronous run, a throughput run and a concurrency sweep, each for a
bounded time, then each server's leftovers and resident memory.

Builds the tokenizer guidellm counts tokens with from the first model's GGUF file (with
`transformers` and `gguf`, no download), starts each target on CONFIG, runs

    guidellm run --profile kind=synchronous | kind=throughput | kind=concurrent (STREAMS)

with synthetic prompts of PROMPT tokens asking for OUTPUT tokens, and writes guidellm's JSON
reports and a Markdown summary to OUT.

    scripts/guidellm.py [--config config.toml] [--seconds 40] [--streams 1,4,16] [--out DIR]
        [--only throughput] [--throughput-concurrency 16]

Exits non-zero on any errored request or a leak (active requests or KV blocks left in use).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import leftovers, rss_mib  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="config.toml")
    p.add_argument("--binary", default=os.environ.get("BIN", "target/release/tokenrouter"))
    p.add_argument("--port", type=int, default=31500)
    p.add_argument("--seconds", type=int, default=40, help="length of each benchmark")
    p.add_argument("--streams", default="1,4,16", help="concurrency levels of the sweep")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--output", type=int, default=32, help="output tokens")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="target/guidellm")
    p.add_argument("--targets", default="serve,gateway")
    p.add_argument("--only", help="comma-separated loads to run (synchronous, throughput, "
                   "concurrent-N); default all")
    p.add_argument("--throughput-concurrency", type=int, default=16,
                   help="requests in flight in the throughput run")
    return p.parse_args()


def first_model(config):
    """The first model's path, resolved against the config's directory."""
    import tomllib

    with open(config, "rb") as f:
        path = tomllib.load(f)["models"][0]["path"]
    return os.path.join(os.path.dirname(os.path.abspath(config)), path)


def tokenizer_dir(gguf, into):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(into)
    return into


def wait_up(port, proc):
    import http.client

    for _ in range(2400):
        if proc.poll() is not None:
            sys.exit(f"the server exited early ({proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    sys.exit("the server did not come up")


def tree_pids(pid):
    """`pid` and its children (the servers `--dp-size` starts)."""
    pids = [pid]
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        pids += tree_pids(int(child))
    return pids


def run_guidellm(args, target, tokenizer, profile, name, out, seed):
    report = os.path.join(out, f"{name}.json")
    cmd = [
        "guidellm", "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{target}",
        "--profile", profile,
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt},output_tokens={args.output}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = open(os.path.join(out, f"{name}.log"), "w")
    subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return json.load(open(report))


def rows(report, target):
    for b in report["benchmarks"]:
        m = b["metrics"]
        s = b["config"]["strategy"]
        kind = s["type_"]
        label = f"{kind}@{s['streams']}" if kind == "concurrent" else kind
        totals = m["request_totals"]
        ok = lambda key: m[key]["successful"]  # noqa: E731
        yield {
            "target": target,
            "strategy": label,
            "requests": totals["successful"],
            "errored": totals["errored"],
            "cut at the end": totals["incomplete"],
            "req/s": ok("requests_per_second")["mean"],
            "output tok/s": ok("output_tokens_per_second")["mean"],
            "TTFT p50 ms": ok("time_to_first_token_ms")["median"],
            "TTFT p95 ms": ok("time_to_first_token_ms")["percentiles"]["p95"],
            "ITL p50 ms": ok("inter_token_latency_ms")["median"],
            "E2E p50 s": ok("request_latency")["median"],
            "E2E p95 s": ok("request_latency")["percentiles"]["p95"],
        }


def table(all_rows):
    keys = list(all_rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in all_rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp()
    tokenizer = tokenizer_dir(first_model(args.config), os.path.join(scratch, "tokenizer"))
    # One guidellm run per load, each with prompts of its own seed: a later run sending the
    # same prompts would find them in the prefix cache.
    profiles = [("synchronous", "kind=synchronous"), ("throughput", f"kind=throughput,max_concurrency={args.throughput_concurrency}")]
    profiles += [(f"concurrent-{n}", f"kind=concurrent,streams={n}") for n in args.streams.split(",")]
    if args.only:
        profiles = [p for p in profiles if p[0] in args.only.split(",")]
    all_rows, checks, failed = [], [], False
    for target in args.targets.split(","):
        dp = ["--dp-size", "2"] if target == "gateway" else []
        server = subprocess.Popen(
            [args.binary, "serve", "--config", args.config, "--port", str(args.port), *dp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # `--dp-size 2` puts the gateway on the port and its servers on the two after it.
        servers = [args.port + 1, args.port + 2] if dp else [args.port]
        try:
            wait_up(args.port, server)
            for port in servers:
                wait_up(port, server)
            rss_before = sum(rss_mib(p) for p in tree_pids(server.pid))
            for i, (name, profile) in enumerate(profiles):
                name = f"{target}-{name}"
                report = run_guidellm(args, args.port, tokenizer, profile, name, args.out, args.seed + i)
                all_rows += rows(report, target)
            # Requests guidellm cut off at each run's end are cancelled once a server sees their
            # connection gone; a leak is what is still there a minute later.
            ended = time.time()
            while True:
                left = [leftovers(p) for p in servers]
                if all(a == 0 and b == 0 for a, b in left) or time.time() > ended + 60:
                    break
                time.sleep(0.2)
            drained = time.time() - ended
            rss_after = sum(rss_mib(p) for p in tree_pids(server.pid))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        active = sum(a for a, _ in left)
        blocks = sum(b for _, b in left)
        checks.append(f"{target}: left over {active:.0f} active requests, {blocks:.0f} KV blocks "
                      f"in use ({drained:.1f} s after the last run); resident memory {rss_before:.0f} MiB before, {rss_after:.0f} MiB "
                      f"after ({rss_after - rss_before:+.0f} MiB)")
        failed |= active > 0 or blocks > 0
    failed |= any(r["errored"] for r in all_rows)
    summary = table(all_rows) + "\n\n" + "\n".join(f"* {c}" for c in checks) + "\n"
    open(os.path.join(args.out, "summary.md"), "w").write(summary)
    print(summary)
    if failed:
        sys.exit("FAILED: errored requests or leftovers")


if __name__ == "__main__":
    main()
