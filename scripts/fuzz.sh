#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer, nightly Rust) of the request parsers, the
# chat template renderer, the tokenizer path and the model loader (GGUF and safetensors):
# each target DURATION seconds (default 30), starting from its seeds (fuzz/seeds, written by
# `cargo run --example fuzz_seeds`) and what earlier runs here found (fuzz/corpus). An input
# that fails is left in fuzz/artifacts/TARGET/; it goes to fuzz/regressions/TARGET/ with its
# fix, where tests/fuzz_regressions.rs replays it. Longer runs: scripts/fuzz.sh 3600.
#
#   scripts/fuzz.sh [DURATION] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-30}
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(requests chat_template tokenizer model_file kv_events)

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz: no nightly Rust toolchain here (libFuzzer's instrumentation needs one): not fuzzed" >&2
  exit 0
fi
command -v cargo-fuzz >/dev/null || cargo install -q cargo-fuzz --version 0.13.2 --locked
cd fuzz
fuzz=(cargo +nightly fuzz)
flags=(-O --debug-assertions)
log=$(mktemp)
if ! "${fuzz[@]}" build "${flags[@]}" >"$log" 2>&1; then
  tail -40 "$log"
  exit 1
fi
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target"
  log=$(mktemp)
  if "${fuzz[@]}" run "${flags[@]}" "$target" "corpus/$target" "seeds/$target" -- \
      -max_total_time="$DURATION" -rss_limit_mb=4096 -timeout=30 >"$log" 2>&1; then
    echo "fuzz $target: $(grep -E '^Done' "$log" || echo done), corpus $(ls "corpus/$target" | wc -l) inputs"
  else
    grep -E -A12 'panicked|ERROR|SUMMARY' "$log" | head -60
    echo "fuzz $target: FAILED; the input is in fuzz/artifacts/$target/" >&2
    exit 1
  fi
  rm -f "$log"
done
