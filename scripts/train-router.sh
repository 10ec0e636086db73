#!/usr/bin/env bash
# Trains the default router heads (R2R, CITER, Co-LLM) for the shipped Qwen pair into
# routers/ (git-ignored): both models read chunks of the local Python installation's own
# sources, positions where their greedy tokens differ are labelled, and the heads are fitted
# on CPU. About 20 minutes on 2 cores. Needs the models (scripts/fetch-models.sh) and python3.
# Extra arguments go to `tokenrouter train-router` (e.g. --texts 40 for a quick run).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
corpus="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
[ -d "$corpus" ] || { echo "train-router: no Python standard library at '$corpus'" >&2; exit 1; }
cargo run --release -- train-router --config config.toml --corpus "$corpus" \
  --out routers --name qwen-pair --texts 200 --text-tokens 128 "$@"
