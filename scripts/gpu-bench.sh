#!/usr/bin/env bash
# Token-routed serving on one GPU, measured as the published system measured itself, for a
# machine with an NVIDIA GPU and its CUDA 13 libraries but no Rust toolchain or network. It
# runs the binary scripts/gpu-bundle.sh built (beside this script), serving random-weight
# models of the published pair's shapes (Qwen3-0.6B as SLM, Qwen3-32B at Q4_K as LLM; the
# weights are made in memory at start-up, the tokenizer comes from vocab.gguf beside this
# script) routed by the seeded `bernoulli` router, and drives them with `tokenrouter bench`:
#   (1) ablation at concurrency 8 and 16: lock-step (`sync`) → asynchronous (`eager`) →
#       asynchronous + delayed batching (`delayed`, thresholds solved at start-up);
#   (2) scaling: throughput and per-user speed at concurrency 1, 4, 16, 64 (delayed);
#   (3) routed at p = 0.05, 0.10, 0.20 against the LLM alone and the SLM alone (concurrency 16);
#   (4) output length 2048 → 8192 (delayed, concurrency 16; LONG_MODES=delayed,sync adds
#       lock-step, which alone takes minutes at 8192 tokens).
# Each experiment writes its bench JSON and SVG plots under OUT_DIR; the summary prints one
# table per experiment beside the published figures and checks the goals.
#
# Usage: gpu-bundle/gpu-bench.sh [OUT_DIR]. Every setting below can be overridden from the
# environment; a CPU dry run of the plumbing, for example:
#   DEVICE=cpu SLM=qwen2.5-0.5b:q4_0 LLM=qwen2.5-1.5b:q4_k MAX_TOKENS=8 ABLATION=2 \
#   SCALING=1,2 SHARE_CONCURRENCY=2 LONG_TOKENS=8,16 LONG_CONCURRENCY=2 KV_MB=512 \
#   VOCAB=gpu-bundle/vocab.gguf TOKENROUTER=target/release/tokenrouter scripts/gpu-bench.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-${OUT:-$here/gpu-bench-out}}"
mkdir -p "$out"
bin="${TOKENROUTER:-$here/tokenrouter}"
[ -x "$bin" ] || bin="$here/../target/release/tokenrouter"
vocab="${VOCAB:-$here/vocab.gguf}"
[ -f "$vocab" ] || { echo "gpu-bench: no $vocab (scripts/gpu-bundle.sh writes it)"; exit 2; }
device="${DEVICE:-cuda:0}"
slm="${SLM:-qwen3-0.6b:bf16}"
llm="${LLM:-qwen3-32b:q4_k}"
max_tokens="${MAX_TOKENS:-256}"
ablation="${ABLATION:-8,16}"
scaling="${SCALING:-1,4,16,64}"
shares="${SHARES:-0.05 0.10 0.20}"
# The share the baselines run beside, and the 3x goal reads.
goal_p="${GOAL_P:-0.10}"
share_c="${SHARE_CONCURRENCY:-16}"
long_tokens="${LONG_TOKENS:-2048,8192}"
long_c="${LONG_CONCURRENCY:-16}"
long_modes="${LONG_MODES:-delayed}"
# KV for every model: the published pair holds 368 KiB per token, so 16 requests of 8192
# tokens need about 48 GiB.
kv_mb="${KV_MB:-64000}"
# Seconds each experiment may take.
limit="${BENCH_TIMEOUT:-600}"
export TOKENROUTER_KERNEL_CACHE="${TOKENROUTER_KERNEL_CACHE:-$out/cache}"

. "$here/gpu-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | tee "$out/gpu.txt"

# config P [EAGER]: the pair on $device, routed by bernoulli with LLM share P; EAGER = true:
# both run every decode step launch by launch (no CUDA graphs).
config() {
  local eager="${2:-false}"
  local file="$out/config-$1-$eager.toml"
  cat > "$file" <<EOF
[[models]]
name = "slm"
role = "slm"
path = "$vocab"
random = "$slm"
device = "$device"
enforce_eager = $eager

[[models]]
name = "llm"
role = "llm"
path = "$vocab"
random = "$llm"
device = "$device"
enforce_eager = $eager

[routing]
algorithm = "bernoulli"
p = $1
seed = 1

[scheduler]
thresholds = "auto"
max_wait_ms = 20
max_batch_tokens = 2048
max_batch_requests = 64

[memory]
kv_budget_mb = $kv_mb
EOF
  echo "$file"
}

# bench NAME ARGS...: one experiment, its JSON and plots named NAME.
bench() {
  local name=$1
  shift
  echo "== $name: tokenrouter bench $*"
  timeout "$limit" "$bin" bench --compare-modes --workload short --output "$out/$name.json" \
    --plot-dir "$out/$name" "$@" 2>"$out/$name.err" | tee "$out/$name.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "$name failed:"; tail -5 "$out/$name.err"; }
}

bench ablation-no-graphs --config "$(config "$goal_p" true)" --modes sync \
  --concurrency "$ablation" --max-tokens "$max_tokens"
bench ablation --config "$(config "$goal_p")" --modes sync,eager,delayed --concurrency "$ablation" \
  --max-tokens "$max_tokens"
bench scaling --config "$(config "$goal_p")" --modes delayed --concurrency "$scaling" \
  --max-tokens "$max_tokens"
for p in $shares; do
  extra=()
  [ "$p" = "$goal_p" ] && extra=(--baselines)
  bench "share-$p" --config "$(config "$p")" --modes delayed --concurrency "$share_c" \
    --max-tokens "$max_tokens" ${extra[@]+"${extra[@]}"}
done
for n in ${long_tokens//,/ }; do
  bench "long-$n" --config "$(config "$goal_p")" --modes "$long_modes" --concurrency "$long_c" \
    --num-requests "$long_c" --max-tokens "$n"
done

echo "== summary"
python3 - "$out" "$ablation" "$scaling" "$shares" "$share_c" "$long_tokens" "$long_c" "$goal_p" \
  <<'PY' | tee "$out/summary.txt"
import json, os, sys
out, ablation, scaling, shares, share_c, long_tokens, long_c, goal_p = sys.argv[1:]
share_c, long_c = int(share_c), int(long_c)

def load(name):
    path = os.path.join(out, f"{name}.json")
    return json.load(open(path)) if os.path.exists(path) else []

def level(rows, mode, c):
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == c), None)

def tok(r):
    return f"{r['output_tok_s']:.1f}" if r else "no result"

ok = True
def goal(text, met):
    global ok
    ok &= bool(met)
    print(f"  {text}: {'met' if met else 'NOT met'}")

print("(1) ablation: output tok/s (published, Qwen3-0.6B + Qwen3-32B at concurrency 8:")
print("    lock-step 132.78, + CUDA graphs 230.79, async 296.86, async + delayed 372.48)")
rows, plain = load("ablation"), load("ablation-no-graphs")
print(f"{'concurrency':>11} {'sync':>10} {'+ graphs':>10} {'eager':>10} {'delayed':>10} "
      f"{'delayed/sync':>13}")
for c in map(int, ablation.split(",")):
    n = level(plain, "sync", c)
    s, e, d = (level(rows, m, c) for m in ("sync", "eager", "delayed"))
    ratio = d["output_tok_s"] / s["output_tok_s"] if s and d else None
    print(f"{c:>11} {tok(n):>10} {tok(s):>10} {tok(e):>10} {tok(d):>10} "
          f"{(f'{ratio:.2f}x' if ratio else '-'):>13}")
    if c == 16:
        goal("delayed >= 1.6x lock-step with CUDA graphs at concurrency 16",
             ratio and ratio >= 1.6)

print("(2) scaling, delayed (published: x8.61 throughput from 1 to 16, keeping 51.7 % of "
      "single-user speed)")
rows = load("scaling")
print(f"{'concurrency':>11} {'output tok/s':>13} {'per-user tok/s':>15} {'LLM share':>10}")
levels = [level(rows, "delayed", c) for c in map(int, scaling.split(","))]
for r in filter(None, levels):
    print(f"{r['concurrency']:>11} {r['output_tok_s']:>13.1f} {r['per_user_tok_s']:>15.1f} "
          f"{100 * r['llm_token_share']:>9.1f}%")
one, sixteen = level(rows, "delayed", 1), level(rows, "delayed", 16)
if one and sixteen:
    gain = sixteen["output_tok_s"] / one["output_tok_s"]
    kept = sixteen["per_user_tok_s"] / one["per_user_tok_s"]
    print(f"  1 -> 16: throughput x{gain:.2f}, per-user speed kept {100 * kept:.1f} %")
    goal("throughput 1 -> 16 >= 8.6x while keeping >= 50 % of single-user speed",
         gain >= 8.6 and kept >= 0.5)
else:
    goal("scaling levels 1 and 16 measured", False)

print(f"(3) routed vs alone at concurrency {share_c}, output tok/s (the measured LLM share "
      "should be near p)")
base = load(f"share-{goal_p}")
llm_alone, slm_alone = level(base, "llm-alone", share_c), level(base, "slm-alone", share_c)
print(f"  LLM alone {tok(llm_alone)}, SLM alone {tok(slm_alone)}")
for p in shares.split():
    r = level(load(f"share-{p}"), "delayed", share_c)
    vs = r["output_tok_s"] / llm_alone["output_tok_s"] if r and llm_alone else None
    share = f"{100 * r['llm_token_share']:.1f} %" if r else "-"
    print(f"  p = {p}: {tok(r)} tok/s, LLM share {share}, "
          f"{(f'{vs:.2f}x' if vs else '-')} the LLM alone")
    if p == goal_p:
        goal(f"routed at p = {p} >= 3x the LLM alone", vs and vs >= 3)

print(f"(4) output length at concurrency {long_c}, output tok/s (published: throughput steady "
      "from 2048 to 8192, lock-step loses 58-85 %)")
lengths = [int(n) for n in long_tokens.split(",")]
got = {n: {m: level(load(f"long-{n}"), m, long_c) for m in ("delayed", "sync")} for n in lengths}
for n in lengths:
    sync = f", sync {tok(got[n]['sync'])}" if got[n]["sync"] else ""
    print(f"  max tokens {n}: delayed {tok(got[n]['delayed'])}{sync}")
a, b = got[lengths[0]]["delayed"], got[lengths[-1]]["delayed"]
if a and b:
    drift = b["output_tok_s"] / a["output_tok_s"] - 1
    print(f"  delayed {lengths[0]} -> {lengths[-1]}: {100 * drift:+.1f} %")
    goal("throughput within 10 % from the shortest to the longest output", abs(drift) <= 0.10)
else:
    goal("both output lengths measured", False)
print("GPU BENCH:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
