#!/usr/bin/env bash
# Routed serving with the models in subserver processes, against the same two models in one
# process: the shipped pair (config.toml), the SLM on core 0 and the LLM on core 1 in every
# layout, `tokenrouter bench`'s short workload. Layouts, alternated ROUNDS times: `local` (one
# process), `remote` (the LLM in a subserver), `tls` (the same over mutual TLS, the front
# authenticated by its certificate), `both` (each model in a subserver of its own, the front
# computing none). Prints each run's output tok/s, handoffs and the LLM link's
# frames, bytes and last round trip, then each layout's median against `local` and the cost
# per handoff that the difference implies.
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
SLM_PORT=$((PORT + 2))
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
sed -e "s#^name = \"slm\"#name = \"slm\"\nremote = \"127.0.0.1:$SLM_PORT\"\nsecret_file = \"secret\"#" \
  "$work/front.toml" >"$work/both.toml"
sed -e "s#^name = \"llm\"#name = \"llm\"\nremote = \"127.0.0.1:$SUB_PORT\"\ntls_ca = \"ca.pem\"\ntls_cert = \"front.pem\"\ntls_key = \"front.key\"#" \
  "$work/local.toml" >"$work/tls.toml"

# A CA, the subserver's certificate (for 127.0.0.1) and the front's.
cert() { # $1 = name, $2 = extensions
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -keyout "$work/$1.key" -out "$work/$1.csr" 2>/dev/null
  printf '%s\n' "$2" >"$work/$1.ext"
  openssl x509 -req -in "$work/$1.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" -days 1 \
    -extfile "$work/$1.ext" -out "$work/$1.pem" 2>/dev/null
}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=bench-ca \
  -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
cert sub "subjectAltName=IP:127.0.0.1
extendedKeyUsage=serverAuth"
cert front "extendedKeyUsage=clientAuth"

wait_health() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.2
  done
  echo "the server did not come up" >&2
  exit 1
}

metrics() { curl -s "http://127.0.0.1:$PORT/metrics"; }

subserver() { # $1 = model, $2 = port, then how fronts are authenticated
  local model=$1 port=$2
  shift 2
  "$BIN" subserver --config "$work/local.toml" --model "$model" --listen "127.0.0.1:$port" \
    "$@" >"$work/sub-$model.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do grep -q listening "$work/sub-$model.log" && break; sleep 0.2; done
}

secret=(--secret-file "$work/secret")
tls=(--tls-cert "$work/sub.pem" --tls-key "$work/sub.key" --tls-client-ca "$work/ca.pem")

# One run: $1 = local | remote | tls | both. Appends "layout tok/s tokens handoffs frames bytes rtt_us".
run() {
  local layout=$1
  pids=()
  case $layout in
    local) config=$work/local.toml ;;
    remote) subserver llm "$SUB_PORT" "${secret[@]}"; config=$work/front.toml ;;
    tls) subserver llm "$SUB_PORT" "${tls[@]}"; config=$work/tls.toml ;;
    both)
      subserver llm "$SUB_PORT" "${secret[@]}"
      subserver slm "$SLM_PORT" "${secret[@]}"
      config=$work/both.toml
      ;;
  esac
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
  run tls
  run both
done
python3 - "$work/runs" <<'EOF'
import statistics, sys
runs = [line.split() for line in open(sys.argv[1])]
def med(layout, i):
    return statistics.median(float(r[i]) for r in runs if r[0] == layout)
local = med("local", 1)
print(f"median output tok/s in one process: {local:.1f}")
for layout, what in [("remote", "the LLM in a subserver"), ("tls", "the LLM in a subserver, over mutual TLS"),
                     ("both", "each model in a subserver")]:
    tps = med(layout, 1)
    tokens, handoffs = med(layout, 2), med(layout, 3)
    print(f"{what}: {tps:.1f} ({tps / local:.2f}x)")
    if handoffs:
        per = (1 / tps - 1 / local) * tokens / handoffs * 1e6
        frames, size = med(layout, 4), med(layout, 5)
        print(f"  implied cost per handoff: {per:.0f} us ({handoffs:.0f} handoffs, {tokens:.0f} tokens);"
              f" the LLM's link: {frames / handoffs:.1f} frames and {size / handoffs:.0f} bytes per handoff")
EOF
