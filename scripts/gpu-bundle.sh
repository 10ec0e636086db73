#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh and scripts/gpu-bench.sh run on a GPU machine that has no
# Rust toolchain: the server binary and the GPU-vs-CPU test binary, with the `cuda` feature,
# stripped, in gpu-bundle/ (git-ignored) beside copies of both scripts and vocab.gguf, the
# tokenizer the benchmark's random-weight models use (made from the shipped 0.5B model, which
# Qwen3 shares, with the `gguf` package). Copy that folder over and run
#   gpu-bundle/gpu-check.sh
#   gpu-bundle/gpu-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle
rm -rf "$out" && mkdir -p "$out"

cargo build --release --features cuda
cp "${CARGO_TARGET_DIR:-target}/release/tokenrouter" "$out/"
# The test binary's path, from cargo's own report of what it built.
parity=$(cargo test --release --features cuda --test cuda_parity --no-run --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_parity" and m.get("executable"):
        print(m["executable"])')
cp "$parity" "$out/cuda_parity"
strip "$out/tokenrouter" "$out/cuda_parity"
cp scripts/gpu-env.sh scripts/gpu-check.sh scripts/gpu-bench.sh "$out/"
model=models/Qwen2.5-Coder-0.5B-Instruct.gguf
[ -f "$model" ] || scripts/fetch-models.sh
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q gguf==0.19.0 \
  || python3 -m pip install -q --break-system-packages gguf==0.19.0
python3 scripts/make-vocab-gguf.py "$model" "$out/vocab.gguf"
du -sh "$out"/*
