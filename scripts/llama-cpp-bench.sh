#!/usr/bin/env bash
# Builds llama.cpp's CPU benchmarks from the source that the llama-cpp-python package ships as
# its source distribution on PyPI (fetched with pip by name and version), and runs them on the
# fetched models, so `tokenrouter bench-model`'s figures can be set against llama.cpp's on the
# same machine, files and thread count.
#
#   scripts/llama-cpp-bench.sh [MODEL.gguf ...]      (default: every model in models/)
#
# THREADS (default 2) sets the threads of both benchmarks. The build goes to
# target/llama.cpp/ and is reused. It uses the CPU's AVX2, AVX-512 (F, VBMI, VNNI, BF16) and
# AVX-VNNI where present, never AMX: ggml's AMX kernels stop with SIGILL at a `tileloadd` on
# the Xeon VM this was written on, as a `-DGGML_NATIVE=ON` build does there.
# Printed: llama-bench's prompt (pp64) and batch-1 decode (tg32) rates, three repetitions,
# then llama-batched-bench's decode rate S_TG summed over 1, 4, 8 and 16 sequences (64-token
# prompts, 32 new tokens each): bench-model's `--batch 1,4,8,16 --decode-steps 32`.
#
#   DRAFT=DRAFT.gguf PROMPTS=N scripts/llama-cpp-bench.sh TARGET.gguf
#
# runs llama.cpp's speculative decoding instead (`llama-speculative-simple`, greedy, the draft
# model drafting DRAFT_MAX tokens, default 5) on the first N HumanEval prompts of
# datasets/HumanEval.jsonl, each asked as `tokenrouter bench --workload human-eval` asks it,
# in the Qwen chat format, MAX_TOKENS (default 64) new tokens,
# and prints per prompt its decode rate, drafted and accepted tokens, then their totals and
# the target's own batch-1 decode rate (llama-bench).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
version=0.3.36
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
work="$root/target/llama.cpp"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
bin="$src/build/bin"
threads="${THREADS:-2}"

die() { echo "llama-cpp-bench: $*" >&2; exit 1; }
for tool in python3 tar sha256sum c++ make; do
  command -v "$tool" >/dev/null || die "$tool is required"
done

if [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/llama-batched-bench" ] \
  || [ ! -x "$bin/llama-speculative-simple" ]; then
  mkdir -p "$work"
  tarball="$work/llama_cpp_python-$version.tar.gz"
  if ! [ -f "$tarball" ] || [ "$(sha256sum "$tarball" | cut -d' ' -f1)" != "$sha" ]; then
    echo "llama-cpp-bench: downloading llama-cpp-python $version (its sdist holds llama.cpp)"
    rm -f "$tarball"
    # pip reads the sdist's metadata through its build backend (installed as wheels into a
    # throwaway environment) but builds nothing. `--no-binary=:all:` would also apply to the
    # backend's own requirements and compile CMake from source, hence the package name.
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
      --no-binary=llama-cpp-python -d "$work" "llama-cpp-python==$version" \
      || die "pip download of llama-cpp-python==$version failed"
    [ -f "$tarball" ] || die "pip did not leave $tarball"
    [ "$(sha256sum "$tarball" | cut -d' ' -f1)" = "$sha" ] || die "$tarball: sha256 mismatch"
  fi
  tar -xzf "$tarball" -C "$work"
  if ! command -v cmake >/dev/null; then
    python3 -m pip install -q cmake || python3 -m pip install -q --break-system-packages cmake \
      || die "cmake is required (pip install cmake)"
  fi
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
  echo "llama-cpp-bench: building llama-bench, llama-batched-bench and llama-speculative-simple (a few minutes)"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" \
    -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)" \
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF >"$work/cmake.log" 2>&1 \
    || die "cmake configure failed, see $work/cmake.log"
  cmake --build "$src/build" -j"$(nproc)" \
    --target llama-bench llama-batched-bench llama-speculative-simple \
    >"$work/build.log" 2>&1 || die "build failed, see $work/build.log"
fi

if [ -n "${DRAFT:-}" ]; then
  [ $# -eq 1 ] || die "with DRAFT, name one target model"
  dataset="$root/datasets/HumanEval.jsonl"
  [ -f "$dataset" ] || die "$dataset is missing (run scripts/fetch-datasets.sh)"
  echo "== speculative: target $(basename "$1"), draft $(basename "$DRAFT"), $threads threads"
  echo "| prompt | decode tok/s | drafted | accepted |"
  echo "|---|---|---|---|"
  prompt_file="$work/prompt.txt"
  total_tokens=0; total_seconds=0; total_drafted=0; total_accepted=0
  for i in $(seq 0 $((${PROMPTS:-3} - 1))); do
    python3 - "$dataset" "$i" >"$prompt_file" <<'PY'
import json, sys
line = open(sys.argv[1]).read().splitlines()[int(sys.argv[2])]
prompt = json.loads(line)["prompt"]
user = ("Complete the following Python function. Reply with code only.\n\n```python\n"
        + prompt + "```")
sys.stdout.write("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                 "assistant.<|im_end|>\n<|im_start|>user\n" + user + "<|im_end|>\n"
                 "<|im_start|>assistant\n")
PY
    log="$work/speculative-$i.log"
    "$bin/llama-speculative-simple" -m "$1" -md "$DRAFT" -f "$prompt_file" -t "$threads" \
      -td "$threads" -n "${MAX_TOKENS:-64}" --spec-type draft-simple --spec-draft-n-max "${DRAFT_MAX:-5}" --spec-draft-n-min 0 \
      --temp 0 -c 4096 --ignore-eos >"$log" 2>&1 || die "llama-speculative-simple failed, see $log"
    read -r tokens seconds < <(sed -nE 's/.*decoded +([0-9]+) tokens in +([0-9.]+) seconds.*/\1 \2/p' "$log" | tail -1)
    drafted=$(sed -nE 's/.*n_drafted *= *([0-9]+).*/\1/p' "$log" | tail -1)
    accepted=$(sed -nE 's/.*n_accept *= *([0-9]+).*/\1/p' "$log" | tail -1)
    [ -n "$tokens" ] && [ -n "$drafted" ] || die "no result in $log"
    echo "| $i | $(python3 -c "print(f'{$tokens / $seconds:.1f}')") | $drafted | $accepted |"
    total_tokens=$((total_tokens + tokens)); total_drafted=$((total_drafted + drafted))
    total_accepted=$((total_accepted + accepted))
    total_seconds=$(python3 -c "print($total_seconds + $seconds)")
  done
  python3 -c "print(f'| all | {$total_tokens / $total_seconds:.1f} | $total_drafted | $total_accepted ({100 * $total_accepted / max($total_drafted, 1):.0f} %) |')"
  echo "== the target alone: llama-bench batch-1 decode of ${MAX_TOKENS:-64} tokens"
  "$bin/llama-bench" -m "$1" -t "$threads" -p 0 -n "${MAX_TOKENS:-64}" -r 3 2>/dev/null | grep -E '^\|'
  exit 0
fi

models=("$@")
if [ ${#models[@]} -eq 0 ]; then
  models=("$root"/models/*.gguf)
  [ -e "${models[0]}" ] || die "no models in $root/models (run scripts/fetch-models.sh)"
fi
for model in "${models[@]}"; do
  [ -f "$model" ] || die "$model: no such file"
  echo "== $(basename "$model"), $threads threads"
  "$bin/llama-bench" -m "$model" -t "$threads" -p 64 -n 32 -r 3 2>/dev/null | grep -E '^\|'
  "$bin/llama-batched-bench" -m "$model" -t "$threads" -tb "$threads" -c 2048 \
    -npp 64 -ntg 32 -npl 1,4,8,16 2>/dev/null | grep -E '^\|'
done
