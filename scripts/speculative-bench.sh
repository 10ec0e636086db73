#!/usr/bin/env bash
# Speculative decoding against the LLM alone at batch 1, on the same HumanEval prompts: for
# each prompt, `tokenrouter generate` greedily with the LLM alone and with speculative
# decoding, alternating which goes first, asked as `tokenrouter bench --workload human-eval`
# asks (chat, MAX_TOKENS new tokens past the end-of-sequence token). Prints each run's decode
# rate (the tokens after the first arrival over the time after it, as `generate` reports it)
# and end-to-end rate (every output token over the whole request, prefills included), the
# drafts accepted, whether the two texts are identical (greedy speculative decoding gives the
# LLM's own tokens, but computed in multi-row extends, whose rounding can flip a near tie that
# the LLM alone's one-row decode resolves the other way), and the totals; then llama.cpp's
# speculative decoding on the same models and prompts (scripts/llama-cpp-bench.sh).
#
#   scripts/speculative-bench.sh [PROMPTS]          (default 5: HumanEval problems 0..4)
#
# TOKENROUTER (default target/release/tokenrouter), CONFIG (configs/speculative.toml, whose
# `draft_tokens` applies; DRAFT_TOKENS overrides it), MAX_TOKENS (64), LLAMA (1; 0 skips
# llama.cpp), DRAFT_MAX (llama.cpp's draft length, 5).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${TOKENROUTER:-$root/target/release/tokenrouter}"
config="${CONFIG:-$root/configs/speculative.toml}"
prompts="${1:-5}"
max_tokens="${MAX_TOKENS:-64}"
dataset="$root/datasets/HumanEval.jsonl"
slm="$root/models/Qwen2.5-Coder-0.5B-Instruct.gguf"
llm="$root/models/Qwen2.5-Coder-1.5B-Instruct.gguf"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

die() { echo "speculative-bench: $*" >&2; exit 1; }
[ -x "$bin" ] || die "$bin is missing (cargo build --release)"
[ -f "$dataset" ] || die "$dataset is missing (run scripts/fetch-datasets.sh)"
[ -f "$slm" ] && [ -f "$llm" ] || die "the Qwen2.5-Coder pair is missing (run scripts/fetch-models.sh)"
if [ -n "${DRAFT_TOKENS:-}" ]; then
  sed -E "s/^draft_tokens = .*/draft_tokens = $DRAFT_TOKENS/" "$config" >"$(dirname "$config")/.speculative-bench.toml"
  config="$(dirname "$config")/.speculative-bench.toml"
  trap 'rm -rf "$work" "$config"' EXIT
fi

# One generation: prints "<decode tok/s> <e2e tok/s> <accepted> <drafted>"; the text goes
# to $3.
generate() {
  local which=$1 prompt=$2 out=$3 log="$work/log"
  if [ "$which" = alone ]; then
    "$bin" generate --model "$llm" --chat --prompt "$prompt" --max-tokens "$max_tokens" \
      --ignore-eos >"$out" 2>"$log" || die "generate (LLM alone) failed: $(tail -1 "$log")"
  else
    "$bin" generate --config "$config" --chat --prompt "$prompt" --max-tokens "$max_tokens" \
      --ignore-eos >"$out" 2>"$log" || die "generate (speculative) failed: $(tail -1 "$log")"
  fi
  local rate e2e accepted drafted
  rate=$(sed -nE 's/.*decode: [0-9]+ tokens at ([0-9.]+) tok\/s.*/\1/p' "$log" | tail -1)
  e2e=$(sed -nE 's/.*e2e: ([0-9.]+) s.*/\1/p' "$log" | tail -1)
  accepted=$(sed -nE 's/.*drafts accepted: ([0-9]+) of ([0-9]+).*/\1/p' "$log" | tail -1)
  drafted=$(sed -nE 's/.*drafts accepted: ([0-9]+) of ([0-9]+).*/\2/p' "$log" | tail -1)
  [ -n "$rate" ] && [ -n "$e2e" ] || die "no decode rate in: $(tail -1 "$log")"
  echo "$rate $(python3 -c "print(f'{$max_tokens / $e2e:.1f}')") ${accepted:-0} ${drafted:-0}"
}

echo "== tokenrouter, batch 1, $max_tokens tokens per prompt, $(nproc) cores"
echo "| prompt | LLM alone decode tok/s | speculative decode tok/s | speed-up | e2e tok/s alone / speculative | drafts accepted | same text |"
echo "|---|---|---|---|---|---|---|"
sum_alone=0; sum_spec=0; sum_alone_e2e=0; sum_spec_e2e=0; all_accepted=0; all_drafted=0; differ=0
for i in $(seq 0 $((prompts - 1))); do
  prompt=$(python3 -c 'import json, sys
line = open(sys.argv[1]).read().splitlines()[int(sys.argv[2])]
p = json.loads(line)["prompt"]
print("Complete the following Python function. Reply with code only.\n\n```python\n" + p + "```")' "$dataset" "$i")
  # Alternate which runs first, so drift on a noisy machine falls on both alike.
  if [ $((i % 2)) -eq 0 ]; then order="alone spec"; else order="spec alone"; fi
  for which in $order; do
    read -r rate e2e accepted drafted < <(generate "$which" "$prompt" "$work/$which.txt")
    if [ "$which" = alone ]; then
      alone=$rate; alone_e2e=$e2e
    else
      spec=$rate; spec_e2e=$e2e; acc=$accepted; dra=$drafted
    fi
  done
  same=yes
  cmp -s "$work/alone.txt" "$work/spec.txt" || { same=no; differ=$((differ + 1)); }
  echo "| $i | $alone | $spec | $(python3 -c "print(f'{$spec / $alone:.2f}×')") | $alone_e2e / $spec_e2e | $acc / $dra | $same |"
  sum_alone=$(python3 -c "print($sum_alone + $alone)"); sum_spec=$(python3 -c "print($sum_spec + $spec)")
  sum_alone_e2e=$(python3 -c "print($sum_alone_e2e + $alone_e2e)")
  sum_spec_e2e=$(python3 -c "print($sum_spec_e2e + $spec_e2e)")
  all_accepted=$((all_accepted + acc)); all_drafted=$((all_drafted + dra))
done
python3 -c "print(f'| mean | {$sum_alone / $prompts:.1f} | {$sum_spec / $prompts:.1f} | {$sum_spec / $sum_alone:.2f}× | {$sum_alone_e2e / $prompts:.1f} / {$sum_spec_e2e / $prompts:.1f} ({$sum_spec_e2e / $sum_alone_e2e:.2f}×) | {100 * $all_accepted / max($all_drafted, 1):.0f} % | {$prompts - $differ} of $prompts |')"

if [ "${LLAMA:-1}" = 1 ]; then
  DRAFT="$slm" PROMPTS="$prompts" MAX_TOKENS="$max_tokens" DRAFT_MAX="${DRAFT_MAX:-5}" \
    "$root/scripts/llama-cpp-bench.sh" "$llm"
fi
if [ "$differ" -gt 0 ]; then
  echo "speculative-bench: $differ of $prompts texts differ from the LLM alone's one-row decode:" \
    "a verification computes the LLM's tokens in a multi-row extend, whose logits differ from a" \
    "one-row decode's by rounding, which flips a greedy choice where the top two are that close" >&2
fi
