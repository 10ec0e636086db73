#!/usr/bin/env bash
# Routed serving with the LLM in a subserver process, against the same two models in one
# process: the shipped pair (config.toml), the SLM on core 0 and the LLM on core 1 in both
# layouts, `tokenrouter bench`'s short workload, the two layouts alternated ROUNDS times.
# Prints each run's output tok/s, handoffs and (remote) the link's frames, bytes and last round
# trip, then the ratio of the medians and the cost per handoff that the difference implies.
#
#   scripts/remote-bench.sh [ROUNDS]          # default 3; CONCURRENCY=16 NUM_REQUESTS=32 MAX_TOKENS=64
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
C=${CONCURRENCY:-16}
N=${NUM_REQUESTS:-32}
MAX=${MAX_TOKENS:-64}
BIN=${BIN:-target/release/tokenrouter}
PORT=${PORT:-31300}
SUB_PORT=$((PORT + 1))
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
head -c 32 /dev/urandom | base64 >"$work/secret"

# The shipped config with absolute model paths and a core per model; the front's copy names
# the subserver for the LLM.
sed -e "s#path = \"models/#path = \"$PWD/models/#" \
  -e 's#^name = "slm"#name = "slm"\ndevice = "cpu:0"#' \
  -e 's#^name = "llm"#name = "llm"\ndevice = "cpu:1"#' config.toml >"$work/local.toml"
sed -e "s#^name = \"llm\"#name = \"llm\"\nremote = \"127.0.0.1:$SUB_PORT\"\nsecret_file = \"secret\"#" \
  "$work/local.toml" >"$work/front.toml"

wait_health() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.2
  done
  echo "the server did not come up" >&2
  exit 1
}

metrics() { curl -s "http://127.0.0.1:$PORT/metrics"; }

# One run: $1 = local | remote. Appends "layout tok/s tokens handoffs frames bytes rtt_us".
run() {
  local layout=$1
  pids=()
  if [ "$layout" = remote ]; then
    "$BIN" subserver --config "$work/local.toml" --model llm --listen "127.0.0.1:$SUB_PORT" \
      --secret-file "$work/secret" >"$work/sub.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do grep -q listening "$work/sub.log" && break; sleep 0.2; done
    config=$work/front.toml
  else
    config=$work/local.toml
  fi
  "$BIN" serve --config "$config" --port "$PORT" >"$work/serve.log" 2>&1 &
  pids+=($!)
  wait_health
  "$BIN" bench --url "http://127.0.0.1:$PORT" --workload short --concurrency "$C" \
    --num-requests "$N" --max-tokens "$MAX" >"$work/bench.out" 2>"$work/bench.err"
  local tps
  tps=$(grep -o '[0-9.]* output tok/s' "$work/bench.err" | head -1 | cut -d' ' -f1)
  metrics | python3 -c '
import sys
v = {}
for line in sys.stdin:
    if line.startswith("#") or not line.strip():
        continue
    key, _, value = line.rpartition(" ")
    v[key] = float(value)
get = lambda k: v.get(k, 0.0)
tokens = sum(x for k, x in v.items() if k.startswith("tokenrouter_generated_tokens_total"))
print(sys.argv[1], sys.argv[2], int(tokens), int(get("tokenrouter_handoffs_total")),
      int(get("tokenrouter_link{counter=\"frames_in\",model=\"llm\"}") + get("tokenrouter_link{counter=\"frames_out\",model=\"llm\"}")),
      int(get("tokenrouter_link{counter=\"bytes_in\",model=\"llm\"}") + get("tokenrouter_link{counter=\"bytes_out\",model=\"llm\"}")),
      round(get("tokenrouter_link_rtt_seconds{model=\"llm\"}") * 1e6))
' "$layout" "$tps" | tee -a "$work/runs"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  pids=()
}

echo "layout tok/s tokens handoffs link_frames link_bytes rtt_us"
for _ in $(seq "$ROUNDS"); do
  run local
  run remote
done
python3 - "$work/runs" <<'EOF'
import statistics, sys
runs = [line.split() for line in open(sys.argv[1])]
def med(layout, i):
    return statistics.median(float(r[i]) for r in runs if r[0] == layout)
local, remote = med("local", 1), med("remote", 1)
tokens, handoffs = med("remote", 2), med("remote", 3)
print(f"median output tok/s: in-process {local:.1f}, LLM in a subserver {remote:.1f}: {remote / local:.2f}x")
if handoffs:
    per = (1 / remote - 1 / local) * tokens / handoffs * 1e6
    print(f"implied cost per handoff: {per:.0f} us ({handoffs:.0f} handoffs, {tokens:.0f} tokens)")
    frames, size = med("remote", 4), med("remote", 5)
    print(f"link: {frames / handoffs:.1f} frames and {size / handoffs:.0f} bytes per handoff")
EOF
