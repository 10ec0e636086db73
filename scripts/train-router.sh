#!/usr/bin/env bash
# Trains the default router heads (R2R, CITER, Co-LLM) for the shipped Qwen pair into
# routers/ (git-ignored), from the SLM's own generations: prompts are the signatures and
# docstrings of the local Python standard library's functions (scripts/stdlib-prompts.py;
# none named like a HumanEval problem when datasets/HumanEval.jsonl is there), the 0.5B
# completes 400 of them, the 1.5B labels each position of the completions where it would
# have written something else and that changes what it goes on to write, and the heads are
# fitted on CPU. About 35 minutes on 2 cores the first time; the labelled completions are
# kept in routers/cache, so retraining takes minutes. Needs the models
# (scripts/fetch-models.sh) and python3. Extra arguments go to `tokenrouter train-router`
# (e.g. --texts 40 for a quick run).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
exclude=()
[ -f datasets/HumanEval.jsonl ] && exclude=(--exclude datasets/HumanEval.jsonl)
python3 scripts/stdlib-prompts.py routers/stdlib-prompts.jsonl "${exclude[@]}"
cargo run --release -- train-router --config config.toml \
  --prompts routers/stdlib-prompts.jsonl --texts 400 --max-new 128 \
  --out routers --name qwen-pair "$@"
