#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain: the
# server binary and the GPU-vs-CPU test binary, with the `cuda` feature, stripped, in
# gpu-bundle/ (git-ignored) beside a copy of the check script. Copy that folder over and run
#   gpu-bundle/gpu-check.sh
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
cp scripts/gpu-check.sh "$out/"
du -sh "$out"/*
